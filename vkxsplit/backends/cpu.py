"""The cpu backend: ggml's CPU kernels (the ``libggml-python`` wheel) on the hub's shared memory.

Each job becomes a small ggml graph the first time it is seen (:mod:`.ggml_cpu`), cached under
the job's memory and shape, and replayed at every later step: the graph's tensors point into the
shared mappings in place (weights byte for byte as the hub stores them, never dequantized; x and
y with the job's strides and row range), so no byte is copied and no step allocates. For a
quantized weight ggml converts x to its 8-bit dot-product type itself (q8_0/q8_1/q8_K). The
graphs run on one persistent ggml thread pool (``threads``, :func:`default_threads`) with one
work buffer, sized by ``ggml_graph_plan`` for the largest graph.

Joins the hub through the host bridge: :meth:`CpuBackend.mul_mat` validates the job (a shape
ggml would abort on is a :class:`~vkxsplit.errors.KernelError` here) and returns at once; the
bridge thread waits for the hub point, computes, and signals the backend's timeline.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from ..attach import AttachStats, HostBridge, Point, SharedBuffer, SharedView
from ..backend import NODE_OPS, Availability, Backend, Capabilities, MatMulIdJob, MatMulJob, OpJob
from ..errors import KernelError, VkxError
from ..ops.quant import TYPES, row_bytes, weight_type
from . import ggml_cpu

if TYPE_CHECKING:
    from ..vk.device import Device

F32 = 0  # GGML_TYPE_F32
I32 = 26  # GGML_TYPE_I32

#: jobs of fewer flops run on the calling (bridge) thread alone: waking the pool's sleeping
#: workers and meeting them at ggml's barriers costs more than such a job gains from them (a
#: decode mat-vec of a small model); the crossover measured on the 2-core machine is in
#: docs/PERFORMANCE.md (the cpu backend's thread table)
SMALL_JOB_FLOPS = 4_000_000

#: graphs kept (least recently built first out): a graph is ~7 KB of ggml headers, and a model
#: keeps a few plans of some hundred jobs each (one per token count it ran)
MAX_GRAPHS = 4096


def available() -> Availability:
    try:
        ggml_cpu.load()
    except VkxError as exc:
        return Availability(False, f"{exc} ({exc.hint})" if getattr(exc, "hint", "") else str(exc))
    return Availability(True)


def default_threads(hub: Device | None = None) -> int:
    """ggml threads when ``threads`` is not given: the physical cores, less one where the hub is
    itself a CPU device (lavapipe: its threads and everything else on the machine share the
    cores). ggml's threads meet at spinning barriers inside each graph: when one of them loses
    its core, the others spin until it is back, so a pool as wide as the machine is fast only on
    an otherwise idle machine and several times slower as soon as anything else runs
    (docs/PERFORMANCE.md: the cpu backend's thread table, 1 vs 2 threads on the 2-core machine).
    ``threads=N`` (``--backends cpu:threads=N``, ``-t N``) overrides it."""
    cores = ggml_cpu.physical_cores()
    cpu_hub = hub is not None and bool(getattr(hub, "is_cpu", False))
    return max(1, cores - 1) if cpu_hub else cores


class _Cached:
    """One job's ggml graph and what it needs at run time."""

    __slots__ = ("graph", "buffers", "ids")

    def __init__(self, graph: ggml_cpu.Graph, buffers: tuple[SharedBuffer, ...], ids: Any = None) -> None:
        self.graph = graph
        self.buffers = buffers
        self.ids = ids  # (numpy view of the ids, n_expert) for mul_mat_id: checked before each run


def _addr(v: SharedView, nbytes: int) -> int:
    """Address of the backend's mapping of ``v`` (checked to hold ``nbytes``)."""
    return int(v.backend_array(np.uint8, nbytes).ctypes.data)


def _job_key(job: MatMulJob | MatMulIdJob | OpJob) -> tuple[Any, ...]:
    """Identifies a job's graph: its memory (chunk, offset) and every shape parameter."""
    if isinstance(job, OpJob):
        return ("op", job.op, tuple((v.chunk.id, v.chunk_offset, v.size) for v in (*job.inputs, *job.outputs)),
                job.rows, job.cols, job.eps, job.b_rows)
    views = (job.weight, job.x, job.y) + ((job.ids,) if isinstance(job, MatMulIdJob) else ())
    extra = (job.n_expert, job.n_used, job.n_xb) if isinstance(job, MatMulIdJob) else ()
    return (type(job).__name__, tuple((v.chunk.id, v.chunk_offset, v.size) for v in views), job.w_type,  # type: ignore[union-attr]
            job.x_type, job.M, job.N, job.K, job.x_stride, job.y_stride, job.r0, job.r1, job.w_row0, *extra)


class CpuBackend(Backend):
    name = "cpu"
    caps = Capabilities(ops={"mul_mat", "mul_mat_id", *NODE_OPS}, weight_types=frozenset(TYPES),
                        compute_dtypes={"f32"}, memory_handles=("dma_buf", "host_allocation"),
                        event_handles=("host",))

    def __init__(self, hub: Device, *, threads: int | None = None, poll: int = 0, timeout: float | None = None,
                 counters: AttachStats | None = None, caps: Capabilities | None = None) -> None:
        if threads is None:
            threads = default_threads(hub)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 512:
            raise VkxError(f"cpu backend: threads must be an integer in [1, 512], got {threads!r}",
                           "e.g. --backends cpu:threads=2")
        if isinstance(poll, bool) or not isinstance(poll, int) or not 0 <= poll <= 100:
            raise VkxError(f"cpu backend: poll must be an integer in [0, 100], got {poll!r}",
                           "ggml's polling level: 0 lets idle workers sleep (the default), e.g. cpu:poll=1")
        self.ggml = ggml_cpu.load()
        super().__init__(hub, timeout=timeout, counters=counters, caps=caps)
        self.threads = threads
        self.pool = ggml_cpu.ThreadPool(self.ggml, threads, poll)
        self.pool1 = ggml_cpu.ThreadPool(self.ggml, 1) if threads > 1 else self.pool
        self.graphs: OrderedDict[tuple[Any, ...], _Cached] = OrderedDict()
        # job objects seen (the executor builds its jobs once and replays them): id -> (the job,
        # its graph, whether a run needs dma-buf brackets or staging); the job is held, so its
        # id stays its own
        self._fast: OrderedDict[int, tuple[Any, _Cached, bool]] = OrderedDict()
        self._lock = threading.Lock()
        self._hooked: set[int] = set()
        self._work = np.zeros(0, np.uint8)
        self._work_ptr: Any = self.ggml.ffi.NULL
        self.graphs_built = 0
        self.jobs_done = 0
        self.busy_s = 0.0  # seconds in ggml_graph_compute (the bridge thread's own work)
        self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run, timeout=self.timeout,
                                 counters=self.stats)

    # -- hooks ----------------------------------------------------------------------------

    def mul_mat(self, job: MatMulJob, wait: Point, signal: Point) -> None:
        try:
            if not isinstance(job, MatMulJob):
                raise KernelError(f"backend {self.name}: mul_mat takes a MatMulJob, got {type(job).__name__}")
            self.check_job(job, signal)
            self._check_ggml(job)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], job)  # type: ignore[union-attr]

    def mul_mat_id(self, job: MatMulIdJob, wait: Point, signal: Point) -> None:
        try:
            if not isinstance(job, MatMulIdJob):
                raise KernelError(f"backend {self.name}: mul_mat_id takes a MatMulIdJob, got {type(job).__name__}")
            self.check_job(job, signal)  # type: ignore[arg-type]
            self._check_ggml(job)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], job)  # type: ignore[union-attr]

    def run_op(self, op: str, job: OpJob, wait: Point, signal: Point) -> None:
        """The NODE_OPS as ggml graphs on the shared buffers, on the bridge thread like mul_mat."""
        try:
            if op not in self.caps.ops or op not in NODE_OPS or not isinstance(job, OpJob) or job.op != op:
                raise KernelError(f"backend {self.name} does not run op {op!r} ({type(job).__name__})")
            if signal[0] is not self.timeline:
                raise VkxError(f"backend {self.name} signals its own timeline, not {signal[0].name}")
            self._check_op(job)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], job)  # type: ignore[union-attr]

    def unload(self, weight: SharedView) -> None:
        self._forget(weight.shared)

    def calibrate(self) -> dict[str, float]:
        """f32 GFLOP/s of ggml on this machine's threads (a 128x512x512 product)."""
        M, N, K = 128, 512, 512
        w = np.ones((N, K), np.float32)
        x = np.ones((M, K), np.float32)
        y = np.zeros((M, N), np.float32)
        with self._lock:  # the lock the bridge thread computes under: one graph at a time on the pool
            g = ggml_cpu.Graph(self.ggml)
            try:
                lib = self.ggml.base
                W = g.strided(F32, w.ctypes.data, K, N, K * 4)
                X = g.strided(F32, x.ctypes.data, K, M, K * 4)
                g.finish(g.place(lib.ggml_mul_mat(g.ctx, W, X), y.ctypes.data, N * 4), self.pool)
                work = np.zeros(max(g.work_size, 1), np.uint8)
                ptr = self.ggml.ffi.cast("uint8_t *", work.ctypes.data)
                g.compute(ptr)
                t = time.perf_counter()
                for _ in range(4):
                    g.compute(ptr)
                dt = max(time.perf_counter() - t, 1e-9)
            finally:
                g.close()
        return {"mul_mat_gflops": 4 * 2 * M * N * K / dt / 1e9}

    def release(self) -> None:
        with self._lock:
            for c in self.graphs.values():
                c.graph.close()
            self.graphs.clear()
            self._fast.clear()
            self._work = np.zeros(0, np.uint8)
            self._work_ptr = self.ggml.ffi.NULL
        if self.pool1 is not self.pool:
            self.pool1.close()
        self.pool.close()

    # -- validation (caller thread: what ggml would abort on) -------------------------------

    def _check_ggml(self, job: MatMulJob | MatMulIdJob) -> None:
        what = f"backend {self.name}: {job.name or 'mul_mat'} ({job.w_type}, M={job.M} N={job.N} K={job.K})"
        if job.w_type not in TYPES:
            raise KernelError(f"{what}: no ggml type for weight type {job.w_type}")
        bs = weight_type(job.w_type).block_size
        if job.K % bs:
            raise KernelError(f"{what}: K={job.K} is not a whole number of {bs}-element {job.w_type} blocks")
        if job.x_type != "f32":
            raise KernelError(f"{what}: x must be f32 (ggml converts it to the weight's dot type), not {job.x_type}",
                              "hand the cpu backend f32 activations")
        if not isinstance(job.weight, SharedView):
            raise KernelError(f"{what}: the weight must be in memory shared with the backend (a SharedView)",
                              "allocate it from the SharedArena")

    def _check_op(self, job: OpJob) -> None:
        what = f"backend {self.name}: {job.op} {job.name}".rstrip()
        n = job.rows * job.cols * 4
        if job.op in ("rms_norm", "add_rms_norm") and not (math.isfinite(job.eps) and job.eps >= 0):
            raise KernelError(f"{what}: eps must be finite and >= 0, got {job.eps}")
        if job.op == "add" and job.b_rows not in (1, job.rows):
            raise KernelError(f"{what}: b has {job.b_rows} rows; it must have 1 (broadcast) or {job.rows}")
        sizes = {"rms_norm": (n, job.cols * 4, n), "add_rms_norm": (n, n, job.cols * 4, n, n),
                 "swiglu": (n, n, n), "add": (n, job.b_rows * job.cols * 4, n)}[job.op]
        for v, need in zip((*job.inputs, *job.outputs), sizes):
            if v.size < need:
                raise KernelError(f"{what}: a {v.size}-byte view is smaller than the {need} bytes "
                                  f"{job.rows} x {job.cols} f32 needs")

    # -- graphs (bridge thread) ---------------------------------------------------------------

    def _forget(self, sb: SharedBuffer) -> None:
        """Drop the graphs that point into ``sb`` (it is closing, or its weight is unloaded)."""
        with self._lock:
            for k in [k for k, c in self.graphs.items() if any(b is sb for b in c.buffers)]:
                self.graphs.pop(k).graph.close()
            for k in [k for k, f in self._fast.items() if any(b is sb for b in f[1].buffers)]:
                del self._fast[k]
            self._hooked.discard(id(sb))

    def _hook(self, buffers: tuple[SharedBuffer, ...]) -> None:
        for sb in buffers:
            if id(sb) not in self._hooked:
                self._hooked.add(id(sb))
                sb.on_close.append(self._forget)

    def _pool_for(self, flops: int) -> ggml_cpu.ThreadPool:
        return self.pool if flops >= SMALL_JOB_FLOPS else self.pool1

    def _build_mul_mat(self, job: MatMulJob) -> _Cached:
        g = ggml_cpu.Graph(self.ggml)
        lib = self.ggml.base
        tid = weight_type(job.w_type).id
        rb = row_bytes(job.w_type, job.K)
        held = job.weight.size // rb
        W = g.strided(tid, _addr(job.weight, held * rb) + (job.r0 - job.w_row0) * rb, job.K, job.rows, rb)
        nx = (job.M - 1) * job.x_stride + job.K
        X = g.strided(F32, _addr(job.x, nx * 4), job.K, job.M, job.x_stride * 4)
        ny = (job.M - 1) * job.y_stride + job.r1
        y = lib.ggml_mul_mat(g.ctx, W, X)  # (rows, M) f32, written into y's columns [r0, r1)
        g.place(y, _addr(job.y, ny * 4) + job.r0 * 4, job.y_stride * 4)
        g.finish(y, self._pool_for(job.flops))
        return _Cached(g, (job.weight.shared, job.x.shared, job.y.shared))

    def _build_mul_mat_id(self, job: MatMulIdJob) -> _Cached:
        assert job.ids is not None
        g = ggml_cpu.Graph(self.ggml)
        lib = self.ggml.base
        tid = weight_type(job.w_type).id
        rb = row_bytes(job.w_type, job.K)
        held = job.weight.size // rb
        W = g.strided(tid, _addr(job.weight, held * rb) + (job.r0 - job.w_row0) * rb, job.K, job.rows, rb,
                      job.n_expert, job.N * rb)
        T, nu, nxb = job.M, job.n_used, job.n_xb
        nx = (T * nxb - 1) * job.x_stride + job.K
        X = g.strided(F32, _addr(job.x, nx * 4), job.K, nxb, job.x_stride * 4, T, nxb * job.x_stride * 4)
        ids = g.strided(I32, _addr(job.ids, T * nu * 4), nu, T, nu * 4)
        ny = (T * nu - 1) * job.y_stride + job.r1
        y = lib.ggml_mul_mat_id(g.ctx, W, X, ids)  # (rows, n_used, T)
        g.place(y, _addr(job.y, ny * 4) + job.r0 * 4, job.y_stride * 4, nu * job.y_stride * 4)
        g.finish(y, self._pool_for(job.flops))
        return _Cached(g, (job.weight.shared, job.x.shared, job.y.shared, job.ids.shared),
                       (job.ids.backend_array(np.int32, T * nu), job.n_expert))

    def _build_op(self, job: OpJob) -> _Cached:
        g = ggml_cpu.Graph(self.ggml)
        lib = self.ggml.base
        R, C = job.rows, job.cols

        def t(v: SharedView, rows: int) -> Any:
            return g.strided(F32, _addr(v, rows * C * 4), C, rows, C * 4)

        if job.op in ("rms_norm", "add_rms_norm"):
            x = t(job.inputs[0], R)
            if job.op == "add_rms_norm":  # x += res in place, then the norm of the sum
                x = lib.ggml_add_inplace(g.ctx, x, t(job.inputs[1], R))
            n = g.place(lib.ggml_rms_norm(g.ctx, x, job.eps), _addr(job.outputs[0], R * C * 4), C * 4)
            out = lib.ggml_mul_inplace(g.ctx, n, t(job.inputs[-1], 1))  # (C, 1) broadcast over rows
        elif job.op == "swiglu":  # silu(g) * u, written over g (element by element: in place is safe)
            out = lib.ggml_swiglu_split(g.ctx, t(job.inputs[0], R), t(job.inputs[1], R))
            g.place(out, _addr(job.outputs[0], R * C * 4), C * 4)
        else:  # add: x += b (b one row broadcast, or R rows)
            out = lib.ggml_add_inplace(g.ctx, t(job.inputs[0], R), t(job.inputs[1], job.b_rows))
        g.finish(out, self._pool_for(8 * R * C))  # a few flops per element
        return _Cached(g, tuple(v.shared for v in (*job.inputs, *job.outputs)))

    def _graph(self, job: MatMulJob | MatMulIdJob | OpJob) -> _Cached:
        key = _job_key(job)
        c = self.graphs.get(key)
        if c is not None:
            self.graphs.move_to_end(key)
            return c
        while len(self.graphs) >= MAX_GRAPHS:
            _k, old = self.graphs.popitem(last=False)
            for k in [k for k, f in self._fast.items() if f[1] is old]:
                del self._fast[k]
            old.graph.close()
        if isinstance(job, OpJob):
            c = self._build_op(job)
        elif isinstance(job, MatMulIdJob):
            c = self._build_mul_mat_id(job)
        else:
            c = self._build_mul_mat(job)
        self.graphs[key] = c
        self.graphs_built += 1
        self._hook(c.buffers)
        if c.graph.work_size > self._work.size:
            self._work = np.zeros(c.graph.work_size, np.uint8)
            self._work_ptr = self.ggml.ffi.cast("uint8_t *", self._work.ctypes.data)
        return c

    # -- work (bridge thread) -------------------------------------------------------------

    def _run(self, job: MatMulJob | MatMulIdJob | OpJob) -> None:
        with self._lock:
            f = self._fast.get(id(job))
            if f is None or f[0] is not job:  # first sight of this job object: find or build its graph
                f = self._fast[id(job)] = (job, self._graph(job), self._needs_sync(job))
                if len(self._fast) > 2 * MAX_GRAPHS:
                    self._fast.popitem(last=False)
            _job, c, sync = f
            if sync or c.ids is not None:
                self._run_synced(job, c)
            else:  # host memory, nothing to bracket or stage: the replay is the ggml call alone
                t0 = time.perf_counter()
                c.graph.compute(self._work_ptr)
                self.busy_s += time.perf_counter() - t0
        self.jobs_done += 1

    @staticmethod
    def _views(job: MatMulJob | MatMulIdJob | OpJob) -> tuple[tuple[SharedView, ...], tuple[SharedView, ...]]:
        """(views read, views written)."""
        if isinstance(job, OpJob):
            outs = job.outputs
            if job.op in ("add_rms_norm", "add"):
                outs = (*outs, job.inputs[0])  # x is written in place
            return job.inputs, outs
        ins = (job.weight, job.x) + ((job.ids,) if isinstance(job, MatMulIdJob) else ())
        return ins, (job.y,)  # type: ignore[return-value]

    def _needs_sync(self, job: MatMulJob | MatMulIdJob | OpJob) -> bool:
        ins, outs = self._views(job)
        return any(v.chunk.kind == "dma_buf" or v.shared.kind == "staged" for v in (*ins, *outs))

    def _run_synced(self, job: MatMulJob | MatMulIdJob | OpJob, c: _Cached) -> None:
        """A run that brackets dma-buf access, stages copies, or checks expert ids first."""
        ins, outs = self._views(job)
        written = {v.chunk.id for v in outs}
        with contextlib.ExitStack() as stack:
            for cid, ch in {v.chunk.id: v.chunk for v in (*ins, *outs)}.items():
                stack.enter_context(ch.cpu_access(write=cid in written))
            for v in ins:
                if v.shared.kind == "staged":
                    v.shared.stage_in(v.offset, v.size)
            if c.ids is not None:
                ids, n_expert = c.ids
                if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
                    bad = int(ids[(ids < 0) | (ids >= n_expert)][0])
                    raise KernelError(f"backend {self.name}: {job.name or 'mul_mat_id'}: expert id {bad} "
                                      f"outside [0, {n_expert})", "the router's top-k produced a bad id")
            t0 = time.perf_counter()
            c.graph.compute(self._work_ptr)
            self.busy_s += time.perf_counter() - t0
            for v in outs:
                if v.shared.kind != "staged":
                    continue
                if isinstance(job, OpJob):
                    v.shared.stage_out(v.offset, job.rows * job.cols * 4)
                else:  # only this job's columns: other backends may write the rest of y
                    n_rows = job.M * (job.n_used if isinstance(job, MatMulIdJob) else 1)
                    for m in range(n_rows):
                        v.shared.stage_out(v.offset + (m * job.y_stride + job.r0) * 4, job.rows * 4)
