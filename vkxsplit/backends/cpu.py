"""The cpu backend: numpy on the hub's shared memory, in a worker thread.

Zero-copy: x, y and the weight are numpy views of the memory the hub binds (host-allocation or
dma-buf mappings, see :mod:`vkxsplit.attach`). Quantized weights are dequantized once with
``gguf.quants.dequantize`` and cached per weight buffer (dropped when the buffer closes or on
:meth:`CpuBackend.unload`); f32 weights are used in place. Joins the hub through the host bridge:
:meth:`CpuBackend.mul_mat` returns at once, the bridge thread waits for the hub point, computes,
and signals the backend's timeline.
"""

from __future__ import annotations

import contextlib
import threading
import time
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from ..attach import AttachStats, HostBridge, Point, SharedBuffer, SharedView
from ..backend import NODE_OPS, Availability, Backend, Capabilities, MatMulJob, OpJob
from ..errors import KernelError, VkxError

if TYPE_CHECKING:
    from ..vk.device import Device


def available() -> Availability:
    try:
        import gguf.quants  # noqa: F401
    except ImportError as exc:
        return Availability(False, f"the gguf package is missing ({exc})")
    return Availability(True)


@lru_cache(maxsize=1)
def dequantizable_types() -> frozenset[str]:
    """ggml types ``gguf.quants.dequantize`` decodes (probed once on one zero block)."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    out = set()
    for t in GGMLQuantizationType:
        if t.name in ("I8", "I16", "I32", "I64", "F64"):
            continue
        try:
            quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[t][1]), np.uint8), t)
        except Exception:  # NotImplementedError and friends: not a type we read
            continue
        out.add(t.name.lower())
    return frozenset(out)


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    """f32 copy/view of an f32/f16/bf16 (raw uint16) array."""
    if dtype == "f32":
        return a
    if dtype == "f16":
        return a.view(np.float16).astype(np.float32)
    return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


_NP = {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16}


class CpuBackend(Backend):
    name = "cpu"
    caps = Capabilities(ops={"mul_mat", *NODE_OPS}, weight_types=dequantizable_types(),
                        compute_dtypes={"f32", "bf16", "f16"},
                        memory_handles=("dma_buf", "host_allocation"), event_handles=("host",))

    def __init__(self, hub: Device, *, timeout: float | None = None, counters: AttachStats | None = None,
                 caps: Capabilities | None = None) -> None:
        super().__init__(hub, timeout=timeout, counters=counters, caps=caps)
        self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run, timeout=self.timeout,
                                 counters=self.stats)
        self._cache: dict[tuple[Any, ...], np.ndarray] = {}
        self._cache_lock = threading.Lock()
        self._hooked: set[int] = set()
        self.cache_hits = 0
        self.cache_misses = 0
        self.jobs_done = 0

    # -- hooks ----------------------------------------------------------------------------

    def mul_mat(self, job: MatMulJob, wait: Point, signal: Point) -> None:
        try:
            self.check_job(job, signal)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], job)  # type: ignore[union-attr]

    def run_op(self, op: str, job: OpJob, wait: Point, signal: Point) -> None:
        """The NODE_OPS in numpy on the shared buffers, on the bridge thread like mul_mat."""
        try:
            if op not in self.caps.ops or not isinstance(job, OpJob) or job.op != op:
                raise KernelError(f"backend {self.name} does not run op {op!r} ({type(job).__name__})")
            if signal[0] is not self.timeline:
                raise VkxError(f"backend {self.name} signals its own timeline, not {signal[0].name}")
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], job)  # type: ignore[union-attr]

    def unload(self, weight: SharedView) -> None:
        self._forget(weight.shared)

    def calibrate(self) -> dict[str, float]:
        a = np.ones((128, 512), np.float32)
        b = np.ones((512, 512), np.float32)
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        dt = max(time.perf_counter() - t, 1e-9)
        return {"mul_mat_gflops": 4 * 2 * 128 * 512 * 512 / dt / 1e9}

    # -- work (bridge thread) ---------------------------------------------------------------

    def _forget(self, sb: SharedBuffer) -> None:
        with self._cache_lock:
            for k in [k for k in self._cache if k[0] == id(sb)]:
                del self._cache[k]
            self._hooked.discard(id(sb))

    def _weight(self, job: MatMulJob) -> np.ndarray:
        """All rows the weight view holds, as (rows, K) f32 (a view for f32 weights)."""
        rb = job.weight_row_bytes
        held = job.weight.size // rb
        if job.w_type == "f32":
            job.weight.shared.stage_in(job.weight.offset, held * rb)
            return job.weight.backend_array(np.float32, held * job.K).reshape(held, job.K)
        sb = job.weight.shared
        key = (id(sb), job.weight.offset, held, job.w_type, job.K)
        with self._cache_lock:
            w = self._cache.get(key)
        if w is not None:
            self.cache_hits += 1
            return w
        from gguf import quants
        from gguf.constants import GGMLQuantizationType

        sb.stage_in(job.weight.offset, held * rb)
        raw = job.weight.backend_array(np.uint8, held * rb).reshape(held, rb)
        w = np.ascontiguousarray(quants.dequantize(raw, GGMLQuantizationType[job.w_type.upper()]),
                                 dtype=np.float32).reshape(held, job.K)
        with self._cache_lock:
            self._cache[key] = w
            if id(sb) not in self._hooked:
                self._hooked.add(id(sb))
                sb.on_close.append(self._forget)
        self.cache_misses += 1
        return w

    def _run_op(self, job: OpJob) -> None:
        rows, cols = job.rows, job.cols
        views = (*job.inputs, *job.outputs)
        chunks = {v.chunk.id: v.chunk for v in views}
        written = {v.chunk.id for v in job.outputs}
        with contextlib.ExitStack() as stack:
            for cid, ch in chunks.items():
                stack.enter_context(ch.cpu_access(write=cid in written))

            def arr(v: SharedView, n_rows: int) -> np.ndarray:
                v.shared.stage_in(v.offset, n_rows * cols * 4)
                return v.backend_array(np.float32, n_rows * cols).reshape(n_rows, cols)

            if job.op in ("rms_norm", "add_rms_norm"):
                w = arr(job.inputs[-1], 1)[0]
                x = arr(job.inputs[0], rows)
                if job.op == "add_rms_norm":
                    x += arr(job.inputs[1], rows)
                ms = np.mean(np.square(x, dtype=np.float32), axis=1, dtype=np.float32, keepdims=True)
                arr(job.outputs[0], rows)[:] = x / np.sqrt(ms + np.float32(job.eps)) * w
            elif job.op == "swiglu":
                g, u = arr(job.inputs[0], rows), arr(job.inputs[1], rows)
                g *= u / (np.float32(1) + np.exp(-g))  # g = silu(g) * u = g / (1 + e^-g) * u
            else:  # add
                x = arr(job.inputs[0], rows)
                x += arr(job.inputs[1], job.b_rows)
            for v in job.outputs:
                if v.shared.kind == "staged":
                    v.shared.stage_out(v.offset, rows * cols * 4)
        self.jobs_done += 1

    def _run(self, job: MatMulJob | OpJob) -> None:
        if isinstance(job, OpJob):
            self._run_op(job)
            return
        M, K, xs, ys, r0, r1 = job.M, job.K, job.x_stride, job.y_stride, job.r0, job.r1
        chunks = {v.chunk.id: v.chunk for v in (job.weight, job.x, job.y)}
        with contextlib.ExitStack() as stack:
            for ch in chunks.values():
                stack.enter_context(ch.cpu_access(write=ch is job.y.chunk))
            xe = np.dtype(_NP[job.x_type]).itemsize
            nx = (M - 1) * xs + K
            job.x.shared.stage_in(job.x.offset, nx * xe)
            xa = job.x.backend_array(_NP[job.x_type], nx)
            X = np.lib.stride_tricks.as_strided(xa, (M, K), (xs * xe, xe), writeable=False)
            X = to_f32(X, job.x_type)
            W = self._weight(job)[r0 - job.w_row0:r1 - job.w_row0]
            ny = (M - 1) * ys + r1
            ya = job.y.backend_array(np.float32, ny)[r0:]
            Y = np.lib.stride_tricks.as_strided(ya, (M, r1 - r0), (ys * 4, 4))
            np.matmul(X, W.T, out=Y)
            if job.y.shared.kind == "staged":
                for m in range(M):  # only this backend's columns: others may write the rest
                    job.y.shared.stage_out(job.y.offset + (m * ys + r0) * 4, (r1 - r0) * 4)
        self.jobs_done += 1
