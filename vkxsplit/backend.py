"""The backend interface: how an accelerator joins the hub's step graph.

Modelled on ggml's ``ggml_backend_i``: one class, :class:`Backend`, whose methods are a table of
hooks (:data:`HOOKS`). Exactly one hook is required, :meth:`Backend.mul_mat`; every other hook is
optional and has a default that says "not supported" or does nothing. A backend declares what it
can do in a :class:`Capabilities` record, and the hub plans around it (which ops, weight types,
batch sizes and how many resident kernels; which memory and event handles it can import).

Every hook that does work is *asynchronous*: it enqueues and returns at once, never blocking the
caller. Work starts after a ``wait`` point ``(hub Timeline, value)`` is reached and signals a
``signal`` point ``(the backend's Timeline, value)`` when done. Errors in the asynchronous part
are recorded and raised by :meth:`Backend.check` (or :meth:`Backend.wait`) when the caller
collects the step's result.

Worked example: an NPU vendor implementing only ``mul_mat``
-----------------------------------------------------------

The NPU computes bf16 x bf16 -> f32, wants at least 16 rows per call, keeps at most 6 weight
matrices resident, maps dma-bufs or plain host memory, and has no way to wait on a Vulkan
semaphore. Its SDK call ``npu.matmul(...)`` blocks until done::

    import numpy as np
    from vkxsplit.attach import HostBridge
    from vkxsplit.backend import Backend, Capabilities, register_backend

    class MyNpu(Backend):
        name = "my-npu"
        caps = Capabilities(ops={"mul_mat"}, weight_types={"bf16"}, compute_dtypes={"bf16"},
                            min_batch=16, max_kernels=6,
                            memory_handles=("dma_buf", "host_allocation"), event_handles=("host",))

        def __init__(self, hub, **opts):
            super().__init__(hub, **opts)
            # the host bridge waits for the hub point, calls _run, then signals our timeline
            self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run,
                                     timeout=self.timeout)

        def mul_mat(self, job, wait, signal):          # the one required hook
            self.check_job(job)                        # types/shape/batch against self.caps
            self.bridge.enqueue(wait, signal[1], job)  # returns at once

        def _run(self, job):                           # bridge thread, after the hub point
            w = job.weight.backend_array(np.uint16)    # zero-copy views of the hub's memory
            x = job.x.backend_array(np.uint16)
            y = job.y.backend_array(np.float32)
            npu.matmul(w, x, y, job.M, job.rows, job.K, job.x_stride, job.y_stride, job.r0)

    register_backend("my-npu", MyNpu)

The hub side of a step then reads (see ``docs/ATTACH.md`` for the full story)::

    npu = create_backend("my-npu", hub)
    arena = SharedArena(hub, [npu])                   # negotiates dma_buf > host_allocation
    ...
    v1 = seq1.submit()                                # hub work producing x (bf16)
    p = npu.next_point()
    npu.mul_mat(MatMulJob(w.view(), "bf16", x.view(), y.view(), M, N, K, x_type="bf16"),
                wait=(seq1.timeline, v1), signal=p)
    v2 = seq2.submit(waits=[p])                       # hub work consuming y
    ...
    seq2.wait(); npu.check()                          # collect: raises what went wrong
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from .attach import (
    EVENT_HANDLES,
    MEMORY_HANDLES,
    AttachStats,
    Choice,
    HostBridge,
    Point,
    SharedView,
    host_wait,
    negotiate_events,
    stats,
)
from .errors import Closable, EnvironmentProblem, KernelError, VkxError
from .ops.quant import ELEM_BYTES, row_bytes, type_info
from .vk.api import next_serial
from .vk.event import Timeline, default_timeout

if TYPE_CHECKING:
    from .vk.device import Device

# ---------------------------------------------------------------------------------------------
# ggml types (the table lives in vkxsplit.ops.quant; this name stays for backends written
# against it)

ggml_type_info = type_info

#: Op names a backend may list in ``Capabilities.ops`` (the hub's op vocabulary).
KNOWN_OPS = frozenset({"mul_mat", "add", "mul", "scale", "rms_norm", "norm", "softmax", "rope", "silu",
                       "gelu", "get_rows", "cpy", "flash_attn", "add_rms_norm", "swiglu",
                       "mul_mat_id", "kv_store", "attention", "argmax"})


# ---------------------------------------------------------------------------------------------
# capabilities and jobs


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the planner only hands it work that fits.

    - ``ops``: op names it implements (``"mul_mat"`` is mandatory)
    - ``weight_types``: ggml types of the weights it reads (``{"bf16"}``, ``{"q4_0", "f16"}``...)
    - ``compute_dtypes``: activation types it computes in; ``{"bf16"}`` means the hub converts
      x to bf16 before and the backend writes f32 y (the hub's bf16 conversion shaders)
    - ``min_batch`` / ``max_batch``: useful range of M (rows of x) per ``mul_mat``
    - ``max_kernels``: cap on distinct resident kernels (loaded weights), ``None`` = unlimited
    - ``memory_handles``: handles it can import, preferred first (``"dma_buf"``, ``"opaque_fd"``,
      ``"host_allocation"``); an empty tuple means only staged copies
    - ``event_handles``: ``"timeline_opaque_fd"``, ``"sync_fd"``, ``"host"`` (the host bridge)
    """

    ops: frozenset[str] = frozenset({"mul_mat"})
    weight_types: frozenset[str] = frozenset({"f32"})
    compute_dtypes: frozenset[str] = frozenset({"f32"})
    min_batch: int = 1
    max_batch: int | None = None
    max_kernels: int | None = None
    memory_handles: tuple[str, ...] = ("host_allocation",)
    event_handles: tuple[str, ...] = ("host",)

    def __post_init__(self) -> None:
        for name in ("ops", "weight_types", "compute_dtypes"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        object.__setattr__(self, "memory_handles", tuple(self.memory_handles))
        object.__setattr__(self, "event_handles", tuple(self.event_handles))
        if "mul_mat" not in self.ops:
            raise VkxError("a backend must implement mul_mat (Capabilities.ops lacks it)")
        unknown = self.ops - KNOWN_OPS
        if unknown:
            raise VkxError(f"unknown op name(s) in Capabilities.ops: {', '.join(sorted(unknown))}")
        for t in self.weight_types:
            ggml_type_info(t)
        bad = [d for d in self.compute_dtypes if d not in ELEM_BYTES]
        if bad or not self.compute_dtypes:
            raise VkxError(f"compute_dtypes must be some of {', '.join(ELEM_BYTES)}, got {sorted(self.compute_dtypes)}")
        if self.min_batch < 1 or (self.max_batch is not None and self.max_batch < self.min_batch):
            raise VkxError(f"bad batch range [{self.min_batch}, {self.max_batch}]")
        if self.max_kernels is not None and self.max_kernels < 1:
            raise VkxError(f"max_kernels must be positive or None, got {self.max_kernels}")
        for k in self.memory_handles:
            if k not in MEMORY_HANDLES:
                raise VkxError(f"unknown memory handle {k!r} (known: {', '.join(MEMORY_HANDLES)})")
        for k in self.event_handles:
            if k not in EVENT_HANDLES:
                raise VkxError(f"unknown event handle {k!r} (known: {', '.join(EVENT_HANDLES)})")

    @property
    def x_dtype(self) -> str:
        """The activation type the hub hands this backend: f32 when it computes in f32, else the
        first of bf16/f16 it does."""
        for d in ("f32", "bf16", "f16"):
            if d in self.compute_dtypes:
                return d
        raise AssertionError("unreachable")


def _check_product(job: MatMulJob | MatMulIdJob, what: str) -> None:
    """Defaults and the checks a plain and a routed product share: strides default to whole
    rows, ``r1`` to ``N``; a non-empty shape, a row range inside ``[0, N)``, a known x type,
    strides no shorter than rows."""
    if job.x_stride <= 0:
        job.x_stride = job.K
    if job.y_stride <= 0:
        job.y_stride = job.N
    if job.r1 < 0:
        job.r1 = job.N
    if min(job.M, job.N, job.K) < 1:
        raise KernelError(f"{what}: empty shape")
    if not 0 <= job.r0 < job.r1 <= job.N:
        raise KernelError(f"{what}: row range [{job.r0}, {job.r1}) outside [0, {job.N})")
    if job.x_type not in ELEM_BYTES:
        raise KernelError(f"{what}: x type must be one of {', '.join(ELEM_BYTES)}")
    if job.x_stride < job.K or job.y_stride < job.N:
        raise KernelError(f"{what}: strides ({job.x_stride}, {job.y_stride}) shorter than rows")


@dataclass
class MatMulJob:
    """``y[m, n] = sum_k W[n, k] * x[m, k]`` for ``m < M`` and output features ``r0 <= n < r1``.

    - ``weight``: ggml rows of ``K`` elements of type ``w_type``; the view's first row is global
      row ``w_row0`` (a backend may hold only its own slice of a tensor split)
    - ``x``: ``M`` rows of ``x_type`` (f32, or bf16/f16 when the backend computes in it), row
      stride ``x_stride`` elements (default ``K``)
    - ``y``: f32, row stride ``y_stride`` elements (default ``N``); only columns ``[r0, r1)``
      are written, so several backends can fill one ``y`` (tensor split)
    """

    weight: SharedView
    w_type: str
    x: SharedView
    y: SharedView
    M: int
    N: int
    K: int
    x_type: str = "f32"
    x_stride: int = 0
    y_stride: int = 0
    r0: int = 0
    r1: int = -1
    w_row0: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        what = f"mul_mat {self.name or ''}({self.w_type} x {self.x_type}, M={self.M} N={self.N} K={self.K})"
        _check_product(self, what)
        for v, n in ((self.weight, "weight"), (self.x, "x"), (self.y, "y")):
            if not isinstance(v, SharedView):
                raise KernelError(f"{what}: {n} must be a SharedView (memory shared with the backend), "
                                  f"got {type(v).__name__}")
        rb = row_bytes(self.w_type, self.K)
        if self.w_row0 > self.r0 or (self.r1 - self.w_row0) * rb > self.weight.size:
            raise KernelError(f"{what}: the weight view ({self.weight.size} bytes from row {self.w_row0}) "
                              f"does not hold rows [{self.r0}, {self.r1}) of {rb} bytes")
        need_x = ((self.M - 1) * self.x_stride + self.K) * ELEM_BYTES[self.x_type]
        need_y = ((self.M - 1) * self.y_stride + self.r1) * 4
        if need_x > self.x.size or need_y > self.y.size:
            raise KernelError(f"{what}: x/y views ({self.x.size}, {self.y.size} bytes) are smaller than "
                              f"the shape needs ({need_x}, {need_y})")

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def flops(self) -> int:
        return 2 * self.M * self.rows * self.K

    @property
    def weight_row_bytes(self) -> int:
        return row_bytes(self.w_type, self.K)

    @property
    def weight_key(self) -> tuple[Any, ...]:
        """Identifies the loaded weight (a "kernel"): chunk (or hub block), offset, rows held,
        type, K."""
        return (*weight_place(self.weight), self.weight.size // self.weight_row_bytes, self.w_type, self.K)


@dataclass
class MatMulIdJob:
    """Routed expert product (ggml's ``mul_mat_id``) for ``mul_mat_id``:
    ``y[t, s, n] = sum_k W[ids[t, s], n, k] * x[t, s if n_xb > 1 else 0, k]`` for tokens
    ``t < M``, slots ``s < n_used`` and output features ``r0 <= n < r1``.

    - ``weight``: the stored ``(n_expert, N, K)`` tensor, ggml rows of ``K`` elements of
      ``w_type``, expert ``e`` row ``n`` at row ``e * N + n``; the view's first row is row
      ``w_row0`` of expert 0 (a backend holding only rows from ``w_row0`` of each expert keeps the
      stored layout: the view spans to row ``r1`` of the last expert)
    - ``x``: ``(M, n_xb, K)`` rows of ``x_type``, row stride ``x_stride`` elements (rows
      ``t * n_xb + s``); ``n_xb`` is 1 (every slot reads the token's one row: gate/up) or
      ``n_used`` (each slot its own row: down)
    - ``ids``: ``(M, n_used)`` contiguous int32 expert ids, each in ``[0, n_expert)``
    - ``y``: ``(M, n_used, N)`` f32 rows, row stride ``y_stride`` elements (rows ``t * n_used + s``);
      only columns ``[r0, r1)`` are written
    """

    weight: SharedView
    w_type: str
    x: SharedView
    y: SharedView
    M: int
    N: int
    K: int
    x_type: str = "f32"
    x_stride: int = 0
    y_stride: int = 0
    r0: int = 0
    r1: int = -1
    w_row0: int = 0
    name: str = ""
    ids: SharedView | None = None
    n_expert: int = 0
    n_used: int = 0
    n_xb: int = 1

    def __post_init__(self) -> None:
        what = (f"mul_mat_id {self.name or ''}({self.w_type} x {self.x_type}, M={self.M} N={self.N} K={self.K}, "
                f"{self.n_used} of {self.n_expert} experts)")
        _check_product(self, what)
        if not 1 <= self.n_used <= self.n_expert:
            raise KernelError(f"{what}: n_used must be in [1, n_expert]")
        if self.n_xb not in (1, self.n_used):
            raise KernelError(f"{what}: n_xb must be 1 or n_used ({self.n_used}), got {self.n_xb}")
        for v, n in ((self.weight, "weight"), (self.x, "x"), (self.y, "y"), (self.ids, "ids")):
            if not isinstance(v, SharedView):
                raise KernelError(f"{what}: {n} must be a SharedView (memory shared with the backend), "
                                  f"got {type(v).__name__}")
        assert self.ids is not None
        rb = row_bytes(self.w_type, self.K)
        need_w = ((self.n_expert - 1) * self.N + self.r1 - self.w_row0) * rb
        if self.w_row0 > self.r0 or need_w > self.weight.size:
            raise KernelError(f"{what}: the weight view ({self.weight.size} bytes from row {self.w_row0}) does "
                              f"not hold rows [{self.r0}, {self.r1}) of each expert ({need_w} bytes of {rb}-byte rows)")
        need_x = ((self.M * self.n_xb - 1) * self.x_stride + self.K) * ELEM_BYTES[self.x_type]
        need_y = ((self.M * self.n_used - 1) * self.y_stride + self.r1) * 4
        need_i = self.M * self.n_used * 4
        if need_x > self.x.size or need_y > self.y.size or need_i > self.ids.size:
            raise KernelError(f"{what}: x/y/ids views ({self.x.size}, {self.y.size}, {self.ids.size} bytes) are "
                              f"smaller than the shape needs ({need_x}, {need_y}, {need_i})")

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def flops(self) -> int:
        return 2 * self.M * self.n_used * self.rows * self.K

    @property
    def weight_row_bytes(self) -> int:
        return row_bytes(self.w_type, self.K)


#: Ops besides ``mul_mat`` a backend may take (listing them in ``caps.ops`` and implementing
#: ``run_op``): the small ones between a layer's matmuls, so that a backend taking a whole FFN
#: block (norm, gate/up, SwiGLU, down, residual) crosses from and to the hub once, not per matmul.
NODE_OPS = frozenset({"rms_norm", "add_rms_norm", "swiglu", "add"})
#: The rest of a llama-style step a backend may also take (listing them in ``caps.ops``), so
#: that on a hub with nothing better to do (a CPU hub) the whole step runs on the backend: the
#: embedding lookup, RoPE, the KV-cache store (RoPE of K fused), attention over the f16 cache and
#: the argmax of the logits. The planner places them like :data:`NODE_OPS` (``run_op``).
STEP_OPS = frozenset({"get_rows", "rope", "kv_store", "attention", "argmax"})
#: (inputs, outputs) of each OpJob op; a range where an input is optional (RoPE's frequency factors)
_OP_ARITY: dict[str, tuple[tuple[int, ...], int]] = {
    "rms_norm": ((2,), 1), "add_rms_norm": ((3,), 2), "swiglu": ((2,), 1), "add": ((2,), 1),
    "get_rows": ((2,), 1), "rope": ((2, 3), 1), "kv_store": ((3, 4), 2), "attention": ((4,), 1),
    "argmax": ((1,), 1)}


@dataclass
class OpJob:
    """One of :data:`NODE_OPS` for ``run_op``: f32 rows of ``cols`` contiguous elements, in
    memory shared with the backend. Semantics (the hub's kernels; ``eps`` from the model):

    - ``rms_norm``: inputs ``(x, w)``, outputs ``(out,)``: ``out[r] = x[r] / sqrt(mean(x[r]^2)
      + eps) * w``
    - ``add_rms_norm``: inputs ``(x, res, w)``, outputs ``(out, x)``: ``x[r] += res[r]`` in
      place, then ``out[r] = rms_norm(x[r]) * w``
    - ``swiglu``: inputs ``(g, u)``, outputs ``(g,)``: ``g[r] = silu(g[r]) * u[r]`` in place
    - ``add``: inputs ``(x, b)``, outputs ``(x,)``: ``x[r] += b[r]`` (``b`` one row, broadcast,
      when ``b_rows == 1``)

    ``w`` (the norms' weight) is one row of ``cols``.

    The :data:`STEP_OPS` (the hub's kernels' semantics, ``params`` from the graph node):

    - ``get_rows``: inputs ``(table, ids)``, outputs ``(out,)``: ``out[t] = table[ids[t]]``
      dequantized to f32 (``rows`` = tokens, ``cols`` = row length; ``params["w_type"]``)
    - ``rope``: inputs ``(x, pos[, freq_factors])``, outputs ``(out,)``: ggml's ``rope_ext`` of
      ``rows`` tokens of ``params["n_heads"]`` heads of ``params["head_dim"]`` (``n_dims``,
      ``mode`` norm/neox, ``freq_base``, ``freq_scale``, YaRN's ``n_ctx_orig``,
      ``ext_factor``, ``attn_factor``, ``beta_fast``, ``beta_slow``)
    - ``kv_store``: inputs ``(k, v, pos[, freq_factors])``, outputs ``(cache_k, cache_v)``: row
      ``pos[t]`` of the f16 caches (``params["n_ctx"]`` rows of ``cols``) gets k (roped with
      ``params["rope_k"]`` when set) and v
    - ``attention``: inputs ``(q, cache_k, cache_v, pos)``, outputs ``(out,)``: causal GQA
      attention of ``rows`` tokens at consecutive positions from ``pos[0]`` over cache rows
      ``0 .. pos[t]`` (``n_heads``, ``n_kv_heads``, ``head_dim``, ``n_ctx``, ``scale``,
      ``window``)
    - ``argmax``: inputs ``(logits,)``, outputs ``(ids,)``: the first index of each row's
      maximum, int32; -1 for a row holding a NaN or +infinity (``vkxsplit.ops.argmax``)
    """

    op: str
    inputs: tuple[SharedView, ...]
    outputs: tuple[SharedView, ...]
    rows: int
    cols: int
    eps: float = 0.0
    b_rows: int = 0
    name: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        what = f"{self.op} {self.name}".strip()
        arity = _OP_ARITY.get(self.op)
        if arity is None:
            raise KernelError(f"{what}: not a backend op (one of {', '.join(sorted(NODE_OPS | STEP_OPS))} "
                              "or mul_mat)")
        n_in, n_out = arity
        if len(self.inputs) not in n_in or len(self.outputs) != n_out:
            raise KernelError(f"{what}: takes {' or '.join(map(str, n_in))} inputs and {n_out} outputs")
        if self.rows < 1 or self.cols < 1:
            raise KernelError(f"{what}: empty shape")
        for v in (*self.inputs, *self.outputs):
            if not isinstance(v, SharedView):
                raise KernelError(f"{what}: every tensor must be a SharedView, got {type(v).__name__}")
        if self.b_rows <= 0:
            self.b_rows = self.rows


def weight_place(v: Any) -> tuple[Any, int]:
    """(memory identity, byte offset) of a weight view: the arena chunk of a SharedView, or
    ``("hub", block serial)`` of a weight in the hub's private memory."""
    if isinstance(v, SharedView):
        return v.chunk.id, v.chunk_offset
    return ("hub", v.buffer.block._serial), v.buffer.offset + v.offset


# ---------------------------------------------------------------------------------------------
# the hook table


@dataclass(frozen=True)
class Hook:
    name: str
    required: bool
    signature: str
    doc: str


#: The backend interface, ggml-style: what each hook does and whether it must be implemented.
HOOKS: dict[str, Hook] = {h.name: h for h in (
    Hook("mul_mat", True, "mul_mat(job: MatMulJob, wait: Point, signal: Point) -> None",
         "enqueue y = W x for the job's output rows; start after `wait`, signal `signal` when done; "
         "never block"),
    Hook("supports", False, "supports(op: str, w_type: str, M: int) -> bool",
         "whether the backend wants this op/type/batch (default: from `caps`)"),
    Hook("mul_mat_id", False, "mul_mat_id(job: MatMulIdJob, wait: Point, signal: Point) -> None",
         "enqueue the routed expert product (ggml_mul_mat_id) for the job's output rows; list "
         "'mul_mat_id' in caps.ops (default: KernelError)"),
    Hook("run_op", False, "run_op(op: str, job: Any, wait: Point, signal: Point) -> None",
         "enqueue another op listed in caps.ops (default: KernelError)"),
    Hook("run_chain", False, "run_chain(jobs: list[MatMulJob | MatMulIdJob | OpJob], wait: Point, signal: Point) -> None",
         "enqueue consecutive jobs (no hub work between them) as one unit: start after `wait`, run them "
         "in order, signal `signal` (the last job's point; the executor took one per job) when all are done "
         "(default: KernelError; the executor then hands them over one by one)"),
    Hook("time_job", False, "time_job(job: MatMulJob, reps: int) -> float | None",
         "seconds of the job's own work, from the device's clock (default: None: the planner "
         "times queued jobs on the host)"),
    Hook("calibrate", False, "calibrate() -> dict[str, float]",
         "measure throughput for the planner, e.g. {'mul_mat_gflops': 12.5} (default: {})"),
    Hook("unload", False, "unload(weight: SharedView) -> None",
         "drop a resident kernel / cached dequantized weight (default: nothing)"),
    Hook("check", False, "check() -> None",
         "raise the error recorded by asynchronous work (default: the host bridge's)"),
    Hook("liveness", False, "liveness() -> str | None",
         "None while alive, else what is gone (\"backend X's process 123 exited with code -9\"); "
         "default: the host bridge's (its liveness probe, its thread); host waits poll it"),
    Hook("progress", False, "progress() -> Any",
         "a value that changes while the backend works (answers, a heartbeat); default: the "
         "host bridge's; a wait fails as slow only after the stall limit without a change"),
    Hook("release", False, "release() -> None",
         "the backend's own teardown, called once by close(): drain, free imports, stop a process; "
         "values it handed out must end up signalled (default: nothing)"),
    Hook("close", False, "close() -> None",
         "default: bridge close, release(), the timeline retired; override only to act before the bridge closes"),
)}


class Backend(Closable):
    """Base class of every backend; see the module docstring and :data:`HOOKS`. After
    ``close()`` every public method raises :class:`~vkxsplit.errors.ClosedError` (subclasses
    get that from :class:`~vkxsplit.errors.Closable` without code of their own).

    Construction negotiates the event handle (``self.events``) and creates the backend's stream
    timeline on the hub device (``self.timeline``, exportable when the backend imports timelines).
    """

    name: ClassVar[str] = "backend"
    caps: Capabilities = Capabilities()

    def __init__(self, hub: Device, *, timeout: float | None = None,
                 counters: AttachStats | None = None, caps: Capabilities | None = None) -> None:
        self.hub = hub
        if caps is not None:
            self.caps = caps
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.stats = counters or stats
        self.events: Choice = negotiate_events(hub, self.caps.event_handles)
        self.timeline = Timeline(hub, exportable=self.events.kind == "timeline_opaque_fd",
                                 name=f"{self.name}-stream")
        self.bridge: HostBridge | None = None
        self._closed = False
        self._serial = next_serial()
        hub.adopt(self)  # the device closes a backend left open (after waiting idle), before its timeline

    # -- the required hook ---------------------------------------------------------------

    def mul_mat(self, job: MatMulJob, wait: Point, signal: Point) -> None:
        """REQUIRED. Enqueue ``job`` after ``wait``; signal ``signal`` when done; never block."""
        raise NotImplementedError(f"backend {self.name} does not implement the required hook mul_mat")

    # -- optional hooks ------------------------------------------------------------------

    def supports(self, op: str, w_type: str, M: int) -> bool:
        """OPTIONAL. Whether to plan ``op`` on ``w_type`` weights with batch ``M`` here."""
        c = self.caps
        return (op in c.ops and (op != "mul_mat" or w_type in c.weight_types)
                and M >= c.min_batch and (c.max_batch is None or M <= c.max_batch))

    def mul_mat_id(self, job: MatMulIdJob, wait: Point, signal: Point) -> None:
        """OPTIONAL. Enqueue a routed expert product (:class:`MatMulIdJob`) like ``mul_mat``."""
        raise KernelError(f"backend {self.name} does not implement mul_mat_id",
                          "plan the expert products on the hub (or another backend)")

    def run_op(self, op: str, job: Any, wait: Point, signal: Point) -> None:
        """OPTIONAL. Enqueue another op (one listed in ``caps.ops``)."""
        raise KernelError(f"backend {self.name} does not implement op {op}",
                          "plan this op on the hub (or another backend)")

    def run_chain(self, jobs: list[Any], wait: Point, signal: Point) -> None:
        """OPTIONAL. Enqueue ``jobs`` (each a job ``mul_mat`` / ``mul_mat_id`` / ``run_op`` would
        take) to run in order after ``wait`` and signal ``signal`` once all are done: one
        hand-off for work with nothing of the hub's between it."""
        raise KernelError(f"backend {self.name} does not implement run_chain",
                          "hand the jobs over one by one")

    def time_job(self, job: MatMulJob, reps: int) -> float | None:
        """OPTIONAL. Seconds one ``job`` takes on the backend's own clock (e.g. CUDA events),
        the mean of ``reps`` runs after a warm-up, without waits or signals; None where the
        backend has no clock of its own (the planner then times queued jobs on the host)."""
        return None

    def calibrate(self) -> dict[str, float]:
        """OPTIONAL. Measured rates for the planner (``{}`` when the backend does not measure)."""
        return {}

    def unload(self, weight: SharedView) -> None:
        """OPTIONAL. Drop what the backend keeps for ``weight`` (resident kernel, cache)."""

    def check(self) -> None:
        """OPTIONAL (has a default). Raise the first error recorded by asynchronous work:
        :class:`~vkxsplit.errors.BackendDied`, :class:`~vkxsplit.errors.WaitTimeout`, a
        :class:`~vkxsplit.errors.KernelError`..."""
        if self.bridge is not None:
            self.bridge.check()

    def liveness(self) -> str | None:
        """OPTIONAL (has a default). None while the backend is alive; else what is gone. Host
        waits that watch the backend poll it (cheap: once per poll slice) and raise
        :class:`~vkxsplit.errors.BackendDied` with the text at once."""
        return self.bridge.gone() if self.bridge is not None else None

    def progress(self) -> Any:
        """OPTIONAL (has a default). A value that changes whenever the backend makes progress
        (see :class:`vkxsplit.vk.event.Peer`): the bridge's answers and heartbeat, and the
        backend timeline's counter."""
        tl = self.timeline
        return (tl._value() if tl.handle is not None else None,
                self.bridge.progress() if self.bridge is not None else None)

    def close(self) -> None:
        """OPTIONAL (has a default). Stop; every pending timeline value ends up signalled.

        The timeline is retired (:func:`retire_timeline`): destroyed now when nothing can use
        it any more, else once that is so (queued hub work may still wait on it). Kept until
        the hub closed, one timeline per backend ever made held a driver handle each (on the
        H200: an fd to /dev/nvidia0, tools/diag_peer_fds.py).
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.bridge is not None:
                self.bridge.close()
            self.release()
        finally:
            hub = getattr(self, "hub", None)  # (construction may have failed half-way)
            if hub is not None:
                retire_timeline(hub, getattr(self, "timeline", None))
                hub.disown(self)

    def release(self) -> None:
        """OPTIONAL (default: nothing). The backend's own teardown, called once by close()
        after the host bridge closed and before the timeline is retired (so it may still
        signal values it handed out): drain the stream, free imports, stop a process."""

    # -- provided helpers ----------------------------------------------------------------

    def next_point(self) -> Point:
        """A fresh ``(timeline, value)`` to pass as ``signal`` (and to make hub work wait on)."""
        return (self.timeline, self.timeline.next())

    def wait(self, point: Point | int | None = None, timeout: float | None = None) -> None:
        """Collect: block until ``point`` (default: the last value handed out) is reached, then
        :meth:`check`. Counted as a host wait of the caller."""
        if point is None:
            point = self.timeline.last
        if isinstance(point, int):
            point = (self.timeline, point)
        host_wait(point, self.timeout if timeout is None else timeout, self.stats, peers=(self,))
        self.check()

    def check_job(self, job: MatMulJob, signal: Point | None = None) -> None:
        """Validate a job against ``caps`` (raise :class:`KernelError` naming what does not fit)."""
        c = self.caps
        if job.w_type not in c.weight_types:
            raise KernelError(f"backend {self.name} cannot read {job.w_type} weights "
                              f"(it reads {', '.join(sorted(c.weight_types))})",
                              "convert the weight on the hub first, or plan it elsewhere")
        if job.x_type not in c.compute_dtypes:
            raise KernelError(f"backend {self.name} computes in {', '.join(sorted(c.compute_dtypes))}, "
                              f"not {job.x_type}", f"hand it x as {c.x_dtype} (hub conversion shaders)")
        if c.max_batch is not None and job.M > c.max_batch:
            raise KernelError(f"backend {self.name}: batch M={job.M} is over its max_batch {c.max_batch}",
                              "split the batch")
        if signal is not None and signal[0] is not self.timeline:
            raise VkxError(f"backend {self.name} signals its own timeline ({self.timeline.name}), "
                           f"not {signal[0].name}", "take signal points from backend.next_point()")

    def refuse(self, signal: Point | None, exc: BaseException) -> BaseException:
        """For a ``mul_mat`` that raises instead of enqueueing: still signal ``signal`` (when it
        is this backend's point) so hub work already queued behind it is not stranded, and
        return ``exc`` for the caller to raise."""
        if signal is not None and signal[0] is self.timeline and self.bridge is not None:
            self.bridge.skip(signal[1])
        return exc

    @classmethod
    def implements(cls, hook: str) -> bool:
        """Whether this class overrides ``hook`` (for optional hooks: does it really do something)."""
        if hook not in HOOKS:
            raise VkxError(f"no backend hook named {hook!r} (hooks: {', '.join(HOOKS)})")
        return getattr(cls, hook) is not getattr(Backend, hook)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} events={self.events.kind}>"


# ---------------------------------------------------------------------------------------------
# registry


class Availability:
    """``bool(avail)`` says whether a backend can run here; ``avail.reason`` says why not."""

    __slots__ = ("ok", "reason")

    def __init__(self, ok: bool, reason: str = "") -> None:
        self.ok = ok
        self.reason = reason

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return "Availability(ok)" if self.ok else f"Availability(no: {self.reason})"


@dataclass
class _Entry:
    target: str | type[Backend]
    available: Callable[[], Availability] | str | None = None
    opts: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, _Entry] = {
    "cpu": _Entry("vkxsplit.backends.cpu:CpuBackend", "vkxsplit.backends.cpu:available"),
    "npu-emu": _Entry("vkxsplit.backends.npu_emu:NpuEmuBackend", "vkxsplit.backends.npu_emu:available"),
    "cuda": _Entry("vkxsplit.backends.cuda:CudaBackend", "vkxsplit.backends.cuda:available"),
    "hip": _Entry("vkxsplit.backends.cuda:HipBackend", "vkxsplit.backends.cuda:available_hip"),
}


def _resolve(ref: str) -> Any:
    mod, _, attr = ref.partition(":")
    return getattr(importlib.import_module(mod), attr)


def register_backend(name: str, target: str | type[Backend],
                     available: Callable[[], Availability] | str | None = None, **opts: Any) -> None:
    """Make ``create_backend(name, hub)`` build ``target`` (a class or ``"module:Class"``)."""
    _REGISTRY[name] = _Entry(target, available, opts)


def backend_availability(names: Iterable[str] | None = None) -> dict[str, Availability]:
    """Each registered backend's :class:`Availability` (imports are lazy; a failing import is a
    reason, never an exception)."""
    out: dict[str, Availability] = {}
    for n in (names if names is not None else _REGISTRY):
        e = _REGISTRY.get(n)
        if e is None:
            out[n] = Availability(False, f"no backend named {n!r} is registered")
            continue
        try:
            fn = _resolve(e.available) if isinstance(e.available, str) else e.available
            out[n] = fn() if fn is not None else Availability(True)
        except Exception as exc:  # an import error is a reason to report
            out[n] = Availability(False, f"{type(exc).__name__}: {exc}")
    return out


def available_backends() -> list[str]:
    """Names of the registered backends that can run on this machine."""
    return [n for n, a in backend_availability().items() if a]


def retire_timeline(hub: Device, tl: Timeline | None) -> None:
    """Destroy ``tl`` (a timeline on ``hub``) once nothing can use it: every value handed out
    is signalled and the hub's queue has passed every submission made before this call (they
    may wait on it). Safe now (the usual case at close): destroyed now; otherwise kept on the
    hub's list and tried again at the next call (and destroyed with the hub at the latest).
    Never blocks."""
    from .vk.command import hub_timeline

    pending: list[tuple[Timeline, int]] = hub.__dict__.setdefault("_retiring_timelines", [])
    htl = hub_timeline(hub)
    if tl is not None and tl.handle is not None:
        pending.append((tl, htl.last))
    now = htl.value if htl.handle is not None else 0
    keep = []
    for t, after in pending:
        if t.handle is None:
            continue
        if t.value >= t.last and now >= after:
            t.close()
        else:
            keep.append((t, after))
    pending[:] = keep


def create_backend(name: str, hub: Device, **opts: Any) -> Backend:
    """Build the backend registered as ``name`` on the hub device ``hub``."""
    e = _REGISTRY.get(name)
    if e is None:
        raise VkxError(f"no backend named {name!r} (registered: {', '.join(sorted(_REGISTRY))})")
    avail = backend_availability([name])[name]
    if not avail:
        raise EnvironmentProblem(f"backend {name} is not available here: {avail.reason}",
                                 "`vkxsplit info` lists the backends this machine can run")
    cls = _resolve(e.target) if isinstance(e.target, str) else e.target
    return cls(hub, **{**e.opts, **opts})


def with_caps(backend_cls: type[Backend], **changes: Any) -> Capabilities:
    """``backend_cls.caps`` with some fields replaced (for per-instance limits)."""
    return replace(backend_cls.caps, **changes)


__all__ = ["Availability", "Backend", "Capabilities", "HOOKS", "Hook", "MatMulIdJob", "MatMulJob", "NODE_OPS", "OpJob", "Point", "STEP_OPS",
           "available_backends", "backend_availability", "create_backend", "ggml_type_info",
           "register_backend", "row_bytes", "with_caps"]
