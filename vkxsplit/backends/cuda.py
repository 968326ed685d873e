"""The cuda backend (and ``hip``: the same code over HIP): cuBLAS on the hub's memory.

Memory: the hub's ``export`` pool blocks are imported once each (``cudaImportExternalMemory``
with an opaque fd, ``cudaExternalMemoryGetMappedBuffer`` over the whole block); a shared buffer
is (block pointer + offset). Host-allocation arenas are reached with ``cudaHostRegister``
(mapped) instead. Events: the backend's stream timeline is created exportable and imported
(``cudaImportExternalSemaphore``, ``TimelineSemaphoreFd``); a hub point on a timeline CUDA did
not import (the device's own hub timeline is not exportable) is first relayed on the hub queue
to an exportable relay timeline (:func:`vkxsplit.attach.relay`: no host wait).

Per job, all on one CUDA stream and with no host synchronisation:
``cudaWaitExternalSemaphoresAsync`` on the hub point -> dequantize the weight once into a cached
f16 buffer (Q4_0/Q8_0 by RawKernels; F16/BF16/F32 are used in place) -> convert x to the
weight's compute type -> ``cublasGemmEx`` (f32 output written straight into y's columns
[r0, r1) with y's row stride) -> ``cudaSignalExternalSemaphoresAsync`` with the signal value.

Where timelines cannot be shared (``events == "host"``) the host bridge waits for the hub point,
enqueues the same work and synchronises the stream in the bridge thread.

Everything CUDA is imported lazily: this module imports without CUDA, and :func:`available`
says why it cannot run. The ``hip`` backend is the same module with the :data:`HIP` table
(hip-python's ``hip.hip``; cupy built for ROCm maps cuBLAS to hipBLAS). Never run here (no
NVIDIA/AMD GPU on the development machine): see docs/ATTACH.md.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..attach import AttachStats, Chunk, HostBridge, Point, Relay, SharedBuffer, SharedView
from ..backend import NODE_OPS, Availability, Backend, Capabilities, MatMulJob, OpJob, retire_timeline
from ..errors import EnvironmentProblem, KernelError, VkxError
from ..vk.event import Timeline

if TYPE_CHECKING:
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.backends.cuda")


@dataclass(frozen=True)
class RuntimeApi:
    """The runtime functions/types/enums this backend uses, by role, for one GPU runtime."""

    name: str
    module: str
    install: str
    fns: dict[str, str]
    types: dict[str, str]
    enums: dict[str, str]


CUDA = RuntimeApi(
    name="cuda", module="cuda.bindings.runtime", install="pip install 'vkxsplit[cuda]' "
    "(cuda-bindings and cupy-cuda12x) and an NVIDIA driver",
    fns={
        "device_count": "cudaGetDeviceCount", "device_properties": "cudaGetDeviceProperties",
        "set_device": "cudaSetDevice", "error_string": "cudaGetErrorString",
        "import_memory": "cudaImportExternalMemory", "mapped_buffer": "cudaExternalMemoryGetMappedBuffer",
        "destroy_memory": "cudaDestroyExternalMemory", "free": "cudaFree",
        "import_semaphore": "cudaImportExternalSemaphore", "destroy_semaphore": "cudaDestroyExternalSemaphore",
        "wait_semaphores": "cudaWaitExternalSemaphoresAsync",
        "signal_semaphores": "cudaSignalExternalSemaphoresAsync",
        "host_register": "cudaHostRegister", "host_unregister": "cudaHostUnregister",
        "host_device_pointer": "cudaHostGetDevicePointer",
    },
    types={"memory_desc": "cudaExternalMemoryHandleDesc", "buffer_desc": "cudaExternalMemoryBufferDesc",
           "semaphore_desc": "cudaExternalSemaphoreHandleDesc",
           "wait_params": "cudaExternalSemaphoreWaitParams",
           "signal_params": "cudaExternalSemaphoreSignalParams"},
    enums={"success": "cudaError_t.cudaSuccess",
           "memory_opaque_fd": "cudaExternalMemoryHandleType.cudaExternalMemoryHandleTypeOpaqueFd",
           "semaphore_timeline_fd":
               "cudaExternalSemaphoreHandleType.cudaExternalSemaphoreHandleTypeTimelineSemaphoreFd",
           "memory_dedicated": "cudaExternalMemoryDedicated", "host_register_mapped": "cudaHostRegisterMapped"},
)

HIP = RuntimeApi(
    name="hip", module="hip.hip", install="pip install hip-python and cupy built for ROCm, and a ROCm driver",
    fns={
        "device_count": "hipGetDeviceCount", "device_properties": "hipGetDeviceProperties",
        "set_device": "hipSetDevice", "error_string": "hipGetErrorString",
        "import_memory": "hipImportExternalMemory", "mapped_buffer": "hipExternalMemoryGetMappedBuffer",
        "destroy_memory": "hipDestroyExternalMemory", "free": "hipFree",
        "import_semaphore": "hipImportExternalSemaphore", "destroy_semaphore": "hipDestroyExternalSemaphore",
        "wait_semaphores": "hipWaitExternalSemaphoresAsync",
        "signal_semaphores": "hipSignalExternalSemaphoresAsync",
        "host_register": "hipHostRegister", "host_unregister": "hipHostUnregister",
        "host_device_pointer": "hipHostGetDevicePointer",
    },
    types={"memory_desc": "hipExternalMemoryHandleDesc", "buffer_desc": "hipExternalMemoryBufferDesc",
           "semaphore_desc": "hipExternalSemaphoreHandleDesc",
           "wait_params": "hipExternalSemaphoreWaitParams",
           "signal_params": "hipExternalSemaphoreSignalParams"},
    enums={"success": "hipError_t.hipSuccess",
           "memory_opaque_fd": "hipExternalMemoryHandleType.hipExternalMemoryHandleTypeOpaqueFd",
           "semaphore_timeline_fd":
               "hipExternalSemaphoreHandleType.hipExternalSemaphoreHandleTypeTimelineSemaphoreFd",
           "memory_dedicated": "hipExternalMemoryDedicated", "host_register_mapped": "hipHostRegisterMapped"},
)

# cudaDataType / cublasComputeType / cublasOperation values (stable ABI numbers)
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1

#: weight type -> (storage/compute type of the cached or in-place weight, cuBLAS data type)
WEIGHT_TYPES = {"f32": ("f32", CUDA_R_32F), "f16": ("f16", CUDA_R_16F), "bf16": ("bf16", CUDA_R_16BF),
                "q4_0": ("f16", CUDA_R_16F), "q8_0": ("f16", CUDA_R_16F)}
_DT_SIZE = {"f32": 4, "f16": 2, "bf16": 2}

_KERNELS = r"""
__device__ __forceinline__ float vkx_h2f(unsigned short h) {
    unsigned int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? __int_as_float(0x7fc00000) : __int_as_float(0x7f800000);
    else v = ldexpf((float)(m | 0x400), (int)e - 25);
    return s ? -v : v;
}

extern "C" __global__ void dequant_q4_0(const unsigned char* __restrict__ src, float* __restrict__ dst,
                                        long long nblocks) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nblocks * 32) return;
    const unsigned char* b = src + (i >> 5) * 18;
    int j = (int)(i & 31);
    float d = vkx_h2f((unsigned short)(b[0] | (b[1] << 8)));
    int q = j < 16 ? (b[2 + j] & 0xF) : (b[2 + j - 16] >> 4);
    dst[i] = (float)(q - 8) * d;
}

extern "C" __global__ void dequant_q8_0(const unsigned char* __restrict__ src, float* __restrict__ dst,
                                        long long nblocks) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nblocks * 32) return;
    const unsigned char* b = src + (i >> 5) * 34;
    float d = vkx_h2f((unsigned short)(b[0] | (b[1] << 8)));
    dst[i] = (float)(signed char)b[2 + (i & 31)] * d;
}

// NODE_OPS (vkxsplit.backend.OpJob): f32 rows of `cols`; one block of 256 threads per row
extern "C" __global__ void vkx_rms_norm(const float* x, const float* __restrict__ res,
                                        const float* __restrict__ w, float* __restrict__ out, float* xout,
                                        int cols, float eps, int add) {
    __shared__ float sh[256];
    long long base = (long long)blockIdx.x * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = x[base + c];
        if (add) { v += res[base + c]; xout[base + c] = v; }  // x += res in place (xout is x)
        s += v * v;
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    float scale = rsqrtf(sh[0] / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = add ? xout[base + c] : x[base + c];  // this thread's own element
        out[base + c] = v * scale * w[c];
    }
}

extern "C" __global__ void vkx_swiglu(float* g, const float* __restrict__ u, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = g[i];
    g[i] = v / (1.0f + expf(-v)) * u[i];
}

extern "C" __global__ void vkx_add(float* x, const float* __restrict__ b, long long n, int cols, int bcast) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] += b[bcast ? (i % cols) : i];
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ src, unsigned short* __restrict__ dst,
                                       int M, int K, long long xs) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * K) return;
    unsigned int u = __float_as_uint(src[(i / K) * xs + (i % K)]);
    dst[i] = ((u & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)((u >> 16) | 0x40)
                                              : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""


# ---------------------------------------------------------------------------------------------
# the runtime wrapper


class _Runtime:
    """Calls through a :class:`RuntimeApi` table; errors become :class:`VkxError` naming the call."""

    def __init__(self, api: RuntimeApi) -> None:
        self.api = api
        self.mod = importlib.import_module(api.module)
        self.success = self.enum("success")

    def enum(self, key: str) -> Any:
        obj: Any = self.mod
        for part in self.api.enums[key].split("."):
            obj = getattr(obj, part)
        return obj

    def struct(self, key: str) -> Any:
        return getattr(self.mod, self.api.types[key])()

    def call(self, role: str, *args: Any) -> Any:
        fname = self.api.fns[role]
        out = getattr(self.mod, fname)(*args)
        if not isinstance(out, tuple):
            out = (out,)
        err, rest = out[0], out[1:]
        if err != self.success:
            raise VkxError(f"{fname} failed: {self._describe(err)}",
                           f"check the {self.api.name} driver and that the hub GPU is this {self.api.name} device")
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def _describe(self, err: Any) -> str:
        try:
            out = getattr(self.mod, self.api.fns["error_string"])(err)
            s = out[1] if isinstance(out, tuple) else out
            return f"{getattr(err, 'name', err)} ({s.decode() if isinstance(s, bytes) else s})"
        except Exception:  # the error string is a nicety
            return str(err)


def available(api: RuntimeApi = CUDA) -> Availability:
    """Whether the runtime, cupy and a device are present (never raises)."""
    try:
        mod = importlib.import_module(api.module)
    except Exception as exc:  # ImportError, or a loader error from the bindings
        return Availability(False, f"{api.module} is not importable ({exc}); {api.install}")
    try:
        importlib.import_module("cupy")
    except Exception as exc:
        return Availability(False, f"cupy is not importable ({exc}); {api.install}")
    try:
        out = getattr(mod, api.fns["device_count"])()
        err, n = out[0], out[1]
        rt_ok = err == _Runtime(api).success
    except Exception as exc:  # driver library missing: the bindings raise on first call
        return Availability(False, f"the {api.name} driver is not usable ({exc})")
    if not rt_ok:
        return Availability(False, f"{api.fns['device_count']} failed ({err}): no usable {api.name} driver")
    if n < 1:
        return Availability(False, f"no {api.name} device found")
    return Availability(True)


def available_hip() -> Availability:
    return available(HIP)


@dataclass
class _Prepared:
    """A job's per-step work, worked out once: the x conversion (callable, args) or None, and
    the cublasGemmEx arguments after the handle; for a NODE_OPS job, its kernel launch in
    ``conv`` and no GEMM."""

    conv: Any
    gemm: tuple[Any, ...] | None


# ---------------------------------------------------------------------------------------------
# the backend


class CudaBackend(Backend):
    name = "cuda"
    API: RuntimeApi = CUDA
    caps = Capabilities(ops={"mul_mat", *NODE_OPS}, weight_types=set(WEIGHT_TYPES), compute_dtypes={"f32"},
                        memory_handles=("opaque_fd", "host_allocation"),
                        event_handles=("timeline_opaque_fd", "host"))

    def __init__(self, hub: Device, *, device_index: int | None = None, timeout: float | None = None,
                 counters: AttachStats | None = None) -> None:
        avail = available(self.API)
        if not avail:
            raise EnvironmentProblem(f"backend {self.name} cannot run: {avail.reason}", self.API.install)
        super().__init__(hub, timeout=timeout, counters=counters)
        import cupy

        self.cp = cupy
        self.rt = _Runtime(self.API)
        self.device_id = self._match_device(device_index)
        self.rt.call("set_device", self.device_id)
        cupy.cuda.Device(self.device_id).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.cublas = cupy.cuda.device.get_cublas_handle()
        self._module = cupy.RawModule(code=_KERNELS)
        self._k_q4_0 = self._module.get_function("dequant_q4_0")
        self._k_q8_0 = self._module.get_function("dequant_q8_0")
        self._k_bf16 = self._module.get_function("f32_to_bf16")
        self._k_ops = {n: self._module.get_function(f"vkx_{n}") for n in ("rms_norm", "swiglu", "add")}
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self._lock = threading.Lock()
        self._blocks: dict[int, tuple[Any, int, int]] = {}   # block serial -> (ext mem, dev ptr, size)
        self._hosts: dict[int, tuple[int, int]] = {}         # chunk id -> (host addr, dev ptr)
        self._sems: dict[int, tuple[Timeline, Any]] = {}     # id(timeline) -> (timeline, ext sem)
        self._weights: dict[tuple[Any, ...], Any] = {}       # weight key -> cupy array (dequantized)
        self._retired: list[tuple[Any, Any]] = []            # (cupy event, release fn) freed when passed
        self._keep: list[Any] = []                           # arrays the queued work still reads
        # id(job) -> (job, _Prepared): a step replays the same job objects, so everything
        # that does not change between steps (pointers, converted-x buffer, GEMM arguments) is
        # worked out once; the per-step cost is a few C calls (see _launch).
        self._prepared: dict[int, tuple[MatMulJob, _Prepared]] = {}
        self._to_f16 = cupy.ElementwiseKernel("float32 x", "float16 y", "y = (float16)x", "vkx_f32_to_f16")
        self._wait_fn = getattr(self.rt.mod, self.API.fns["wait_semaphores"])
        self._signal_fn = getattr(self.rt.mod, self.API.fns["signal_semaphores"])
        self._wp = self.rt.struct("wait_params")
        self._wp.flags = 0
        self._sp = self.rt.struct("signal_params")
        self._sp.flags = 0
        self._relayed: tuple[Any, int, int] | None = None    # (hub timeline, value, relay value)
        self._relay: Relay | None = None
        # id(timeline) -> the highest value this (in-order) stream has waited for: a later job
        # behind the same or an earlier point needs no wait of its own
        self._waited: dict[int, int] = {}
        if self.events.kind == "timeline_opaque_fd":
            self._own_sem = self._semaphore(self.timeline)
            self.relay_timeline = Timeline(hub, exportable=True, name=f"{self.name}-relay")
            self._semaphore(self.relay_timeline)
            self._relay = Relay(hub, self.relay_timeline)
        else:  # the host bridge: it waits for the hub point and synchronises the stream
            self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run_bridged,
                                     timeout=self.timeout, counters=self.stats)
        log.info("%s backend on device %d, events %s", self.name, self.device_id, self.events.describe())

    # -- setup ------------------------------------------------------------------------------

    def _match_device(self, index: int | None) -> int:
        n = self.rt.call("device_count")
        want = self.hub.physical.device_uuid
        for i in range(n):
            prop = self.rt.call("device_properties", i)
            uuid = bytes(getattr(prop.uuid, "bytes", b""))
            if uuid[:16] == want[:16]:
                if index is not None and index != i:
                    log.warning("%s device %d requested, but the hub is device %d: using %d",
                                self.name, index, i, i)
                return i
        raise EnvironmentProblem(
            f"the hub's Vulkan device '{self.hub.name}' is none of the {n} {self.name} device(s) "
            "(no UUID matches)",
            f"pick the {self.name} GPU as the hub (VKXSPLIT_DEVICE): memory and semaphores are shared "
            "within one device only")

    def _semaphore(self, tl: Timeline) -> Any:
        """The CUDA import of an exportable timeline (cached)."""
        got = self._sems.get(id(tl))
        if got is not None and got[0] is tl:
            return got[1]
        if not tl.exportable:
            raise VkxError(f"timeline {tl.name} was not created exportable")
        from ..native import Fd

        fd = Fd(tl.export_fd())
        desc = self.rt.struct("semaphore_desc")
        desc.type = self.rt.enum("semaphore_timeline_fd")
        desc.handle.fd = fd.fd
        desc.flags = 0
        try:
            sem = self.rt.call("import_semaphore", desc)
        except BaseException:
            fd.close()
            raise
        fd.detach()  # the driver owns the fd after a successful import
        self._sems[id(tl)] = (tl, sem)
        return sem

    def _block_pointer(self, sb: SharedBuffer) -> int:
        """Device address of ``sb``'s first byte, importing its hub block once."""
        block = sb.buffer.block
        serial = block._serial
        with self._lock:
            got = self._blocks.get(serial)
        if got is None:
            fd, size, _offset, dedicated = sb.arena.export_fd(sb)
            desc = self.rt.struct("memory_desc")
            desc.type = self.rt.enum("memory_opaque_fd")
            desc.handle.fd = fd.fd
            desc.size = size
            desc.flags = int(self.rt.enum("memory_dedicated")) if dedicated else 0
            try:
                ext = self.rt.call("import_memory", desc)
            except BaseException:
                fd.close()
                raise
            fd.detach()  # the driver owns the fd after a successful import
            bd = self.rt.struct("buffer_desc")
            bd.offset = 0
            bd.size = size
            bd.flags = 0
            try:
                ptr = int(self.rt.call("mapped_buffer", ext, bd))
            except BaseException:
                self.rt.call("destroy_memory", ext)
                raise
            got = (ext, ptr, size)
            with self._lock:
                self._blocks[serial] = got
            sb.chunk.listeners.append(lambda ch, serial=serial: self._retire_block(serial))
        return got[1] + sb.buffer.offset

    def _host_pointer(self, ch: Chunk) -> int:
        """Device address of a host-allocation chunk (registered mapped, once)."""
        with self._lock:
            got = self._hosts.get(ch.id)
        if got is None:
            addr = ch.mapping.addr  # type: ignore[union-attr]
            self.rt.call("host_register", addr, ch.size, int(self.rt.enum("host_register_mapped")))
            dev = int(self.rt.call("host_device_pointer", addr, 0))
            got = (addr, dev)
            with self._lock:
                self._hosts[ch.id] = got
            ch.listeners.append(self._unregister_host)
        return got[1]

    def _pointer(self, v: SharedView) -> int:
        sb = v.shared
        if sb.kind == "opaque_fd":
            return self._block_pointer(sb) + v.offset
        if sb.kind == "host_allocation":
            return self._host_pointer(sb.chunk) + v.chunk_offset
        raise KernelError(f"{self.name} cannot reach {sb.kind} memory (buffer '{sb.name}')",
                          "allocate from a SharedArena negotiated with this backend")

    def _retire_block(self, serial: int) -> None:
        # Runs when the hub frees the block (maybe under its allocator lock): defer the CUDA
        # release until the work queued so far has passed.
        with self._lock:
            got = self._blocks.pop(serial, None)
        if got is None:
            return
        self._prepared.clear()  # pointers into the block
        ext, ptr, _ = got

        def release() -> None:
            self.rt.call("free", ptr)
            self.rt.call("destroy_memory", ext)

        self._retire(release)

    def _unregister_host(self, ch: Chunk) -> None:
        with self._lock:
            got = self._hosts.pop(ch.id, None)
        if got is not None:  # the mapping goes away right after: unregister now (synchronous)
            self.rt.call("host_unregister", got[0])

    def _retire(self, fn: Any) -> None:
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(self.stream)
        with self._lock:
            self._retired.append((ev, fn))

    def _sweep(self) -> None:
        with self._lock:
            done = [(e, f) for e, f in self._retired if e.done]
            self._retired = [(e, f) for e, f in self._retired if not e.done]
            if len(self._keep) > 64:
                self._keep = self._keep[-64:]
        for _e, f in done:
            f()

    # -- work -------------------------------------------------------------------------------

    def _weight(self, job: MatMulJob) -> tuple[int, int, str]:
        """(device pointer of row ``r0``, cuBLAS type, compute type) of the job's weight rows."""
        cp = self.cp
        ctype, cublas_type = WEIGHT_TYPES[job.w_type]
        rb = job.weight_row_bytes
        held = job.weight.size // rb
        first = job.r0 - job.w_row0
        if job.w_type in ("f32", "f16", "bf16"):  # in place, zero-copy
            return self._pointer(job.weight) + first * rb, cublas_type, ctype
        key = job.weight_key
        w = self._weights.get(key)
        if w is None:
            nblocks = held * job.K // 32
            src = np.uint64(self._pointer(job.weight))  # raw pointer argument (the hub's memory)
            tmp = cp.empty((held * job.K,), cp.float32)
            kern = {"q4_0": self._k_q4_0, "q8_0": self._k_q8_0}.get(job.w_type)
            if kern is None:  # caps.weight_types keeps other types out; be explicit anyway
                raise KernelError(f"{self.name} cannot dequantize {job.w_type} weights "
                                  f"(it reads {', '.join(sorted(WEIGHT_TYPES))})")
            threads = 256
            kern(((nblocks * 32 + threads - 1) // threads,), (threads,), (src, tmp, np.int64(nblocks)))
            w = tmp.astype(cp.float16).reshape(held, job.K)
            del tmp
            self._weights[key] = w
            job.weight.shared.on_close.append(lambda sb, key=key: (self._weights.pop(key, None),
                                                                   self._prepared.clear()))
        return int(w.data.ptr) + first * job.K * 2, cublas_type, ctype

    def _prepare(self, job: MatMulJob) -> _Prepared:
        """Everything about ``job`` that does not change between steps: the weight pointer
        (dequantizing it once), x's pointer and its converted copy's buffer, y's pointer and
        the GEMM's arguments. Cached by job object (a step replays the same objects)."""
        got = self._prepared.get(id(job))
        if got is not None and got[0] is job:
            return got[1]
        cp = self.cp
        w_ptr, w_type, ctype = self._weight(job)
        x_ptr = self._pointer(job.x)
        conv: Any = None
        if ctype == "f32":
            b_ptr, b_type, ldb = x_ptr, CUDA_R_32F, job.x_stride
        else:
            nx = (job.M - 1) * job.x_stride + job.K
            xmem = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(x_ptr, nx * 4, self, self.device_id), 0)
            x = cp.ndarray((job.M, job.K), cp.float32, xmem, strides=(job.x_stride * 4, 4))
            if ctype == "f16":
                xc = cp.empty((job.M, job.K), cp.float16)
                conv = (self._to_f16, (x, xc))
            else:
                xc = cp.empty((job.M, job.K), cp.uint16)
                n = job.M * job.K
                conv = (self._k_bf16, (((n + 255) // 256,), (256,),
                                       (np.uint64(x_ptr), xc, np.int32(job.M), np.int32(job.K),
                                        np.int64(job.x_stride))))
            b_ptr, b_type, ldb = int(xc.data.ptr), w_type, job.K
        y_ptr = self._pointer(job.y) + job.r0 * 4
        # column-major: C (rows x M, ldc = y_stride) = W_rows^T (K x rows, lda = K)^T * X (K x M)
        gemm = (CUBLAS_OP_T, CUBLAS_OP_N, job.rows, job.M, job.K, self._one.ctypes.data, w_ptr, w_type, job.K,
                b_ptr, b_type, ldb, self._zero.ctypes.data, y_ptr, CUDA_R_32F, job.y_stride,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        prep = _Prepared(conv, gemm)
        if len(self._prepared) >= 1024:  # jobs made per call (tests, probes): keep the newest
            self._prepared.pop(next(iter(self._prepared)))
        self._prepared[id(job)] = (job, prep)
        return prep

    def _run(self, prep: _Prepared) -> None:
        """Enqueue the conversion and the GEMM on ``self.stream`` (the current stream)."""
        from cupy.cuda import cublas

        if prep.conv is not None:
            fn, args = prep.conv
            fn(*args)
        if prep.gemm is None:  # a NODE_OPS job: the kernel above was all of it
            return
        cublas.setStream(self.cublas, self.stream.ptr)
        cublas.gemmEx(self.cublas, *prep.gemm)

    def _prepare_op(self, job: OpJob) -> _Prepared:
        """A NODE_OPS job as one kernel launch with its arguments worked out once."""
        got = self._prepared.get(id(job))
        if got is not None and got[0] is job:
            return got[1]
        ptr = [np.uint64(self._pointer(v)) for v in (*job.inputs, *job.outputs)]
        rows, cols = job.rows, job.cols
        n = rows * cols
        flat = ((n + 255) // 256,), (256,)
        if job.op == "rms_norm":  # inputs x, w; outputs out
            x, w, out = ptr
            call = ((rows,), (256,), (x, x, w, out, out, np.int32(cols), np.float32(job.eps), np.int32(0)))
            fn = self._k_ops["rms_norm"]
        elif job.op == "add_rms_norm":  # inputs x, res, w; outputs out, x
            x, res, w, out, _x = ptr
            call = ((rows,), (256,), (x, res, w, out, x, np.int32(cols), np.float32(job.eps), np.int32(1)))
            fn = self._k_ops["rms_norm"]
        elif job.op == "swiglu":  # inputs g, u; outputs g
            g, u, _g = ptr
            call = (*flat, (g, u, np.int64(n)))
            fn = self._k_ops["swiglu"]
        else:  # add: inputs x, b; outputs x
            x, b, _x = ptr
            call = (*flat, (x, b, np.int64(n), np.int32(cols), np.int32(1 if job.b_rows == 1 else 0)))
            fn = self._k_ops["add"]
        prep = _Prepared((fn, call), None)
        if len(self._prepared) >= 1024:
            self._prepared.pop(next(iter(self._prepared)))
        self._prepared[id(job)] = (job, prep)  # type: ignore[assignment]
        return prep

    def run_op(self, op: str, job: OpJob, wait: Point, signal: Point) -> None:
        """NODE_OPS (norms, SwiGLU, add) as CUDA kernels on the stream, waits and signals as
        mul_mat's: with them a mode split crosses between hub and CUDA once per layer."""

        def validate() -> None:
            if op not in self.caps.ops or op == "mul_mat" or not isinstance(job, OpJob) or job.op != op:
                raise KernelError(f"backend {self.name} does not run op {op!r} ({type(job).__name__})")
            if signal[0] is not self.timeline:
                raise VkxError(f"backend {self.name} signals its own timeline, not {signal[0].name}")

        # a prepared job skips validation, but only for the op it was prepared as
        self._submit(job, wait, signal, validate, fast=getattr(job, "op", None) == op)

    def mul_mat(self, job: MatMulJob, wait: Point, signal: Point) -> None:
        self._submit(job, wait, signal, lambda: self.check_job(job, signal), fast=isinstance(job, MatMulJob))

    def _submit(self, job: MatMulJob | OpJob, wait: Point, signal: Point, validate: Any, fast: bool) -> None:
        """A job prepared before (a step replays its job objects) goes straight to the stream
        (``fast``: it is the kind of job the caller asked for); a new one is validated first:
        refused, its signal point is still signalled in stream order; with host events it goes
        to the bridge thread."""
        got = self._prepared.get(id(job)) if fast else None
        if got is None or got[0] is not job or self.bridge is not None or signal[0] is not self.timeline:
            try:
                validate()
            except Exception as exc:
                if self.bridge is None and signal[0] is self.timeline:  # keep the stream's order
                    self._signal_only(signal[1])
                raise self.refuse(signal, exc) from None
            if self.bridge is not None:
                self.bridge.enqueue(wait, signal[1], job)
                return
        self._launch(job, wait, signal[1])

    def _launch(self, job: MatMulJob | OpJob, wait: Point, value: int) -> None:
        """Wait for ``wait`` on the stream, run the job, signal ``value``: the per-step path,
        a handful of C calls once the job is prepared."""
        if self._retired:
            self._sweep()
        sem = None
        if wait is not None:
            tl, v = wait
            if not tl.exportable:  # re-express the point on our relay timeline, GPU-side
                r = self._relayed
                if r is not None and r[0] is tl and r[1] == v:  # jobs behind the same hub point: one relay
                    tl, v = self.relay_timeline, r[2]
                else:
                    rv = self.relay_timeline.next()
                    assert self._relay is not None
                    self._relay(wait, rv)
                    self._relayed = (tl, v, rv)
                    tl, v = self.relay_timeline, rv
            if self._waited.get(id(tl), -1) >= v:  # the stream already waited for this or later
                sem = None
            else:
                sem = self._semaphore(tl)
                self._wp.params.fence.value = v
                self._waited[id(tl)] = v
        self._sp.params.fence.value = value
        with self.cp.cuda.Device(self.device_id), self.stream:
            try:
                if sem is not None:
                    self._check(self._wait_fn([sem], [self._wp], 1, self.stream.ptr), "wait_semaphores")
                self._run(self._prepare_op(job) if isinstance(job, OpJob) else self._prepare(job))
            finally:  # signalled even when enqueueing failed: the hub never waits forever
                self._check(self._signal_fn([self._own_sem], [self._sp], 1, self.stream.ptr), "signal_semaphores")

    def _check(self, out: Any, role: str) -> None:
        err = out[0] if isinstance(out, tuple) else out
        if err != self.rt.success:
            raise VkxError(f"{self.API.fns[role]} failed: {self.rt._describe(err)}",
                           f"check the {self.API.name} driver")

    def time_job(self, job: MatMulJob, reps: int) -> float | None:
        """The job's GPU time from CUDA events around ``reps`` runs (after a warm-up run)."""
        if self.bridge is not None:
            return None
        self.check_job(job)
        prep = self._prepare(job)
        cp = self.cp
        with cp.cuda.Device(self.device_id), self.stream:
            self._run(prep)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(self.stream)
            for _ in range(max(1, reps)):
                self._run(prep)
            e1.record(self.stream)
            e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / max(1, reps)

    def _signal_only(self, value: int) -> None:
        sp = self.rt.struct("signal_params")
        sp.params.fence.value = value
        sp.flags = 0
        with self.cp.cuda.Device(self.device_id):
            self.rt.call("signal_semaphores", [self._own_sem], [sp], 1, self.stream.ptr)

    def _run_bridged(self, job: MatMulJob) -> None:
        with self.cp.cuda.Device(self.device_id), self.stream:  # the bridge thread's own device context
            self._run(self._prepare_op(job) if isinstance(job, OpJob) else self._prepare(job))
        self.stream.synchronize()
        self._sweep()

    def unload(self, weight: SharedView) -> None:
        self._prepared.clear()
        for k in [k for k in self._weights if k[0] == weight.chunk.id and k[1] == weight.chunk_offset]:
            w = self._weights.pop(k)
            self._retire(lambda w=w: None)  # keep the array alive until queued work passed

    def check(self) -> None:
        super().check()
        try:
            self.stream.done  # noqa: B018 - cudaStreamQuery: raises on an asynchronous error
        except Exception as exc:
            raise VkxError(f"{self.name} stream failed: {exc}") from exc

    def release(self) -> None:
        if not hasattr(self, "_sems"):  # construction failed half-way
            return
        try:
            self.stream.synchronize()
            if self.bridge is None and self.timeline.value < self.timeline.last:
                self.timeline.signal(self.timeline.last)  # values handed out but never enqueued
        finally:
            self._sweep()
            for _e, f in self._retired:
                f()
            self._retired.clear()
            self._weights.clear()
            self._prepared.clear()
            self._keep.clear()
            for ext, ptr, _ in self._blocks.values():
                self.rt.call("free", ptr)
                self.rt.call("destroy_memory", ext)
            self._blocks.clear()
            for addr, _dev in self._hosts.values():
                self.rt.call("host_unregister", addr)
            self._hosts.clear()
            for _tl, sem in self._sems.values():
                self.rt.call("destroy_semaphore", sem)
            self._sems.clear()
            # the stream is synchronized: the relay's timeline goes too (the stream's: by close())
            retire_timeline(self.hub, getattr(self, "relay_timeline", None))
            self.relay_timeline = None


class HipBackend(CudaBackend):
    """The same backend over HIP (hip-python + cupy for ROCm). Untested."""

    name = "hip"
    API = HIP
