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

With ``step=1`` the backend also runs the rest of the step (embedding rows, RoPE, KV store,
attention, argmax): their checks and graph nodes are :mod:`.cpu_step`'s.

Repacked weights (``repack``, on unless ``VKXSPLIT_DISABLE=cpu_repack``): a product's weight
rows whose type and row count ggml-cpu has an interleaved layout for on this CPU
(``ggml_repack_get_optimal_repack_type``: Q4_0, Q4_K, IQ4_NL with AVX2, more on ARM) are
copied once into that layout (:class:`.ggml_cpu.PackedWeight`, a buffer of ggml's repack buffer
type), and the job's graph multiplies by that copy, so ggml's repacked gemv / gemm kernels run
(docs/PERFORMANCE.md has the rates). Where the ggml build has the AMX buffer type (llama.cpp's
build on a CPU with AMX tiles) the weights of the types and row counts its kernels take (Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS; rows a multiple of 32) go there first, the same way
(``VKXSPLIT_DISABLE=cpu_amx`` leaves them to the repack buffer type). The copy is the backend's own memory, made from the stored
bytes the first time a job reads those rows: a weight's bytes must not change after that
(:meth:`CpuBackend.unload` drops its copies). The owner of the stored bytes may give their pages
back (:meth:`SharedBuffer.discard <vkxsplit.attach.SharedBuffer.discard>`) when nothing else
reads them (the model does under the CPU default: ``Model._settle_weights`` in
:mod:`vkxsplit.model`), and every job that would read discarded bytes as stored is refused here
rather than computed from zeros.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from ..attach import AttachStats, HostBridge, Point, SharedBuffer, SharedView
from ..backend import NODE_OPS, STEP_OPS, Availability, Backend, Capabilities, MatMulIdJob, MatMulJob, OpJob
from ..errors import KernelError, VkxError
from ..features import is_disabled
from ..ops.quant import TYPES, row_bytes, weight_type
from . import cpu_step, ggml_cpu
from .cpu_step import F32, I32
from .cpu_step import addr as _addr

if TYPE_CHECKING:
    from ..vk.device import Device

#: tensors (leaves and nodes) one job adds to a graph at most (a kv_store with RoPE: 10)
TENSORS_PER_JOB = 12
Job = MatMulJob | MatMulIdJob | OpJob

#: jobs of fewer flops run on the calling (bridge) thread alone: waking the pool's sleeping
#: workers and meeting them at ggml's barriers costs more than such a job gains from them (a
#: decode mat-vec of a small model; an estimate from the 2-core machine, where such jobs ran
#: faster alone)
SMALL_JOB_FLOPS = 4_000_000
#: with an OpenMP build of ggml (llama.cpp's), a graph's threads meet at an OpenMP barrier after
#: every node, which sleeps and wakes them where cores are few: a run of jobs averaging fewer
#: flops than this per job runs on the calling thread alone (a small model's decode step: 26 ->
#: 72 tok/s for SmolLM2 on the 2-core machine, while llama1b's decode still gains from two
#: threads; docs/PERFORMANCE.md, "CPU machine")
OPENMP_RUN_JOB_FLOPS = 4_000_000

#: graphs kept (least recently built first out): a graph is ~7 KB of ggml headers, and a model
#: keeps a few plans of some hundred jobs each (one per token count it ran)
MAX_GRAPHS = 4096


def available() -> Availability:
    try:
        ggml_cpu.load()
    except VkxError as exc:
        return Availability(False, f"{exc} ({exc.hint})" if getattr(exc, "hint", "") else str(exc))
    return Availability(True)


def default_threads(hub: Device | None = None, step: bool = False) -> int:
    """ggml threads when ``threads`` is not given: the physical cores (no more than the CPU
    quota of a container, :func:`cgroup_cpu_limit`), less one where the hub is
    itself a CPU device (lavapipe: its threads and everything else on the machine share the
    cores). ggml's threads meet at spinning barriers inside each graph: when one of them loses
    its core, the others spin until it is back, so a pool as wide as the machine is fast only on
    an otherwise idle machine and several times slower as soon as anything else runs
    (docs/PERFORMANCE.md, "CPU machine": 1 vs 2 threads on the 2-core machine).
    ``threads=N`` (``--backends cpu:threads=N``, ``-t N``) overrides it. With ``step`` (the
    backend takes the whole step: the hub has nothing left to run) every physical core that
    other processes do not keep busy when the backend starts (:func:`busy_cores`, rounded), at
    least 1: on the 2-core machine 2 threads when it is quiet, 1 beside another job, where 2
    run several times slower (docs/PERFORMANCE.md)."""
    machine = ggml_cpu.physical_cores()
    quota = cgroup_cpu_limit()
    # a container's CPU quota (docker --cpus): its affinity lists every CPU of the host
    cores = machine if quota is None else max(1, min(machine, int(quota)))
    cpu_hub = hub is not None and bool(getattr(hub, "is_cpu", False))
    if step:  # (the busy cores are of the CPUs the affinity lists: the quota's are some of those)
        return max(1, min(cores, machine - int(busy_cores() + 0.5)))
    return max(1, cores - 1) if cpu_hub else cores


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> float | None:
    """CPUs per period this process's cgroup may use (its CFS quota over its period: cgroup v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), the tightest of its cgroup
    and their ancestors under ``root``; None where no quota is set or none can be read. (A
    container without its own cgroup namespace lists its host path: the levels that do not
    exist under ``root`` are passed over.)"""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: float | None = None

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrls, path = parts[1], parts[2].strip("/")
        if ctrls == "":  # v2 (or the unified hierarchy of a hybrid set-up)
            bases = [root, os.path.join(root, "unified")]
        elif "cpu" in ctrls.split(","):  # v1: the cpu controller's mount (cpu or cpu,cpuacct)
            bases = [os.path.join(root, ctrls), os.path.join(root, "cpu")]
        else:
            continue
        levels = path.split("/") if path else []
        for base in dict.fromkeys(bases):
            for n in range(len(levels), -1, -1):
                d = os.path.join(base, *levels[:n])
                try:
                    if ctrls == "":
                        text = read(os.path.join(d, "cpu.max"))
                        if text is None or text.split()[0] == "max":
                            continue
                        quota, period = (float(x) for x in text.split()[:2])
                    else:
                        q, per = read(os.path.join(d, "cpu.cfs_quota_us")), read(os.path.join(d, "cpu.cfs_period_us"))
                        if q is None or per is None or float(q) < 0:
                            continue
                        quota, period = float(q), float(per)
                except (ValueError, IndexError):
                    continue
                if quota > 0 and period > 0:
                    best = quota / period if best is None else min(best, quota / period)
    return best


def busy_cores(sample_s: float = 0.2) -> float:
    """How many cores other processes keep busy now: the busy CPU time over ``sample_s`` of the
    CPUs this process may run on (its affinity) less this process's, per second (/proc/stat's
    per-CPU lines, /proc/self/stat); 0 where they cannot be read. Only those CPUs: in a
    container /proc/stat lists every CPU of the host, whose other work does not take ours.
    (The load average lags by a minute: right after another job ends it still counts it.)"""
    try:
        mine_cpus: set[str] | None = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    except AttributeError:
        mine_cpus = None

    def machine() -> float:
        total, seen, whole = 0.0, False, None
        with open("/proc/stat") as f:
            for line in f:
                name, *rest = line.split()
                if not name.startswith("cpu"):
                    break  # (the CPU lines come first)
                v = [float(x) for x in rest]
                busy = sum(v) - v[3] - (v[4] if len(v) > 4 else 0.0)  # all but idle and iowait
                if name == "cpu":
                    whole = busy
                elif mine_cpus is None or name in mine_cpus:
                    total, seen = total + busy, True
        if not seen:
            if whole is None:
                raise ValueError("no cpu line in /proc/stat")
            return whole
        return total

    def mine() -> float:
        with open("/proc/self/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return float(v[11]) + float(v[12])  # utime + stime

    try:
        m0, s0, t0 = machine(), mine(), time.monotonic()
        time.sleep(sample_s)
        m1, s1, t1 = machine(), mine(), time.monotonic()
    except (OSError, ValueError, IndexError):
        return 0.0
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return max(0.0, ((m1 - m0) - (s1 - s0)) / hz / max(t1 - t0, 1e-3))


class _Cached:
    """One job's ggml graph (or a run's: :meth:`CpuBackend.run_chain`) and what it needs at run
    time: ``before``, checks and per-step settings run before each compute (ids in range,
    positions, the attention's KV length and mask), ``host``: a job computed on the host
    instead of a graph (the argmax), ``keep``: memory of the backend's own the graph uses."""

    __slots__ = ("graph", "buffers", "ids", "before", "host", "keep")

    def __init__(self, graph: ggml_cpu.Graph | None, buffers: tuple[SharedBuffer, ...], ids: Any = None,
                 before: list[Any] | None = None, host: Any = None, keep: list[Any] | None = None) -> None:
        self.graph = graph
        self.buffers = buffers
        self.ids = ids  # (numpy view of the ids, n_expert) for mul_mat_id: checked before each run
        self.before = before or []
        self.host = host
        self.keep = keep or []

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()


class _Run:
    """The pieces of a run of jobs (:meth:`CpuBackend.run_chain`): ggml graphs holding several
    jobs each, cut where a job's checks read what an earlier job of the piece writes, and host
    jobs."""

    __slots__ = ("pieces", "buffers", "graph")

    def __init__(self, pieces: list[_Cached]) -> None:
        self.pieces = pieces
        self.buffers = tuple({id(b): b for p in pieces for b in p.buffers}.values())
        self.graph = self  # (closed through the same call as a _Cached's graph)

    def close(self) -> None:
        for p in self.pieces:
            p.close()


def _rng(v: SharedView, nbytes: int | None = None) -> tuple[Any, int, int]:
    return (v.chunk.id, v.chunk_offset, v.chunk_offset + (v.size if nbytes is None else nbytes))


def _overlaps(a: list[tuple[Any, int, int]], b: list[tuple[Any, int, int]]) -> bool:
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


def _params_key(p: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, _params_key(v) if isinstance(v, dict) else v) for k, v in p.items()))


def _job_key(job: MatMulJob | MatMulIdJob | OpJob) -> tuple[Any, ...]:
    """Identifies a job's graph: its memory (chunk, offset) and every shape parameter."""
    if isinstance(job, OpJob):
        return ("op", job.op, tuple((v.chunk.id, v.chunk_offset, v.size) for v in (*job.inputs, *job.outputs)),
                job.rows, job.cols, job.eps, job.b_rows, _params_key(job.params))
    views = (job.weight, job.x, job.y) + ((job.ids,) if isinstance(job, MatMulIdJob) else ())
    extra = (job.n_expert, job.n_used, job.n_xb) if isinstance(job, MatMulIdJob) else ()
    return (type(job).__name__, tuple((v.chunk.id, v.chunk_offset, v.size) for v in views), job.w_type,  # type: ignore[union-attr]
            job.x_type, job.M, job.N, job.K, job.x_stride, job.y_stride, job.r0, job.r1, job.w_row0, *extra)


class CpuBackend(Backend):
    name = "cpu"
    caps = Capabilities(ops={"mul_mat", "mul_mat_id", *NODE_OPS}, weight_types=frozenset(TYPES),
                        compute_dtypes={"f32"}, memory_handles=("dma_buf", "host_allocation"),
                        event_handles=("host",))

    def __init__(self, hub: Device, *, threads: int | None = None, poll: int = 0, step: bool | int = False,
                 repack: bool | int | None = None, amx: bool | int | None = None, timeout: float | None = None, counters: AttachStats | None = None,
                 caps: Capabilities | None = None) -> None:
        """``step`` (``--backends cpu:step=1``): also take the rest of the step
        (:data:`~vkxsplit.backend.STEP_OPS`: embedding, RoPE, KV store, attention, argmax), so
        that beside a CPU hub a plan can run the whole step here (the CPU-hub default,
        :mod:`vkxsplit.defaults`). ``repack`` (``cpu:repack=0|1``; default: on unless
        ``VKXSPLIT_DISABLE=cpu_repack``): multiply by copies of the weights in ggml-cpu's
        repacked layout where ggml has one (the module docstring); ``amx`` (``cpu:amx=0|1``;
        default: on unless ``VKXSPLIT_DISABLE=cpu_amx``): in the AMX buffer type first, where the
        ggml build has one."""
        if step not in (True, False, 0, 1):
            raise VkxError(f"cpu backend: step must be 0 or 1, got {step!r}", "e.g. --backends cpu:step=1")
        if repack not in (True, False, 0, 1, None):
            raise VkxError(f"cpu backend: repack must be 0 or 1, got {repack!r}", "e.g. --backends cpu:repack=0")
        if amx not in (True, False, 0, 1, None):
            raise VkxError(f"cpu backend: amx must be 0 or 1, got {amx!r}", "e.g. --backends cpu:amx=0")
        self.step = bool(step)
        self.repack = not is_disabled(hub, "cpu_repack") if repack is None else bool(repack)
        self.amx = not is_disabled(hub, "cpu_amx") if amx is None else bool(amx)
        if caps is None and self.step:
            caps = Capabilities(**{**{f: getattr(self.caps, f) for f in self.caps.__dataclass_fields__},
                                   "ops": self.caps.ops | STEP_OPS})
        if threads is None:
            threads = default_threads(hub, self.step)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 512:
            raise VkxError(f"cpu backend: threads must be an integer in [1, 512], got {threads!r}",
                           "e.g. --backends cpu:threads=2")
        if isinstance(poll, bool) or not isinstance(poll, int) or not 0 <= poll <= 100:
            raise VkxError(f"cpu backend: poll must be an integer in [0, 100], got {poll!r}",
                           "ggml's polling level: 0 lets idle workers sleep (the default), e.g. cpu:poll=1")
        self.ggml = ggml_cpu.load()
        #: the ggml build the products run on and the weight layouts taken off (part of the
        #: profile key of measured costs: a profile measured on AMX tiles is not the stored
        #: layout's)
        self.build = f"{self.ggml.package}-{self.ggml.package_version}" + ("" if self.repack else "+repack=0") \
            + ("+amx=0" if self.repack and not self.amx and self.ggml.extra_buft(ggml_cpu.AMX_BUFT_NAME) is not None
               else "")
        super().__init__(hub, timeout=timeout, counters=counters, caps=caps)
        self.threads = threads
        self.graphs: OrderedDict[tuple[Any, ...], _Cached] = OrderedDict()
        # job objects seen (the executor builds its jobs once and replays them): id -> (the job,
        # its graph, whether a run needs dma-buf brackets or staging); the job is held, so its
        # id stays its own
        self._fast: OrderedDict[int, tuple[Any, _Cached, bool]] = OrderedDict()
        self._lock = threading.Lock()
        self._hooked: set[int] = set()
        self._released = False
        # causal attention masks by (query rows, n_ctx): one buffer and the KV length it holds, shared
        # by every attention of that shape (each layer of a step has the same positions; graphs
        # compute one at a time, each setting the mask for its step first)
        self._masks: dict[tuple[int, int], tuple[np.ndarray, list[int]]] = {}
        self._work = np.zeros(0, np.uint8)
        self._work_ptr: Any = self.ggml.ffi.NULL
        # repacked weight rows: (chunk id, offset of the first row in it, type, K, rows) -> (the
        # shared buffer holding the stored rows, the repacked copy or None where ggml has no
        # layout for them); built once, freed with that buffer
        self._packed: dict[tuple[Any, ...], tuple[SharedBuffer, ggml_cpu.PackedWeight | None]] = {}
        self.packed_bytes = 0  # bytes of repacked copies held
        self.pack_s = 0.0  # seconds spent repacking
        self.graphs_built = 0
        self.jobs_done = 0
        self.busy_s = 0.0  # seconds in ggml_graph_compute (the bridge thread's own work)
        self.pool = ggml_cpu.ThreadPool(self.ggml, threads, poll)
        try:
            self.pool1 = ggml_cpu.ThreadPool(self.ggml, 1) if threads > 1 else self.pool
            self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run, timeout=self.timeout,
                                     counters=self.stats)
        except BaseException:  # (no close() will come: stop the pools' worker threads here)
            if getattr(self, "pool1", self.pool) is not self.pool:
                self.pool1.close()
            self.pool.close()
            raise

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
        """The NODE_OPS (and with ``step`` the STEP_OPS) as ggml graphs on the shared buffers, on
        the bridge thread like mul_mat."""
        try:
            if signal[0] is not self.timeline:
                raise VkxError(f"backend {self.name} signals its own timeline, not {signal[0].name}")
            self._check_any(job, op)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], job)  # type: ignore[union-attr]

    def run_chain(self, jobs: list[Job], wait: Point, signal: Point) -> None:
        """Consecutive jobs as one hand-off: after ``wait`` the bridge thread runs them in order as
        one ggml graph (a few where a job's checks need what an earlier one writes, and the
        host's argmax), built the first time and replayed, then signals ``signal``. The whole
        step of a plan that leaves the hub nothing is one such run: one graph compute, no
        hub <-> backend crossing inside it."""
        try:
            if signal[0] is not self.timeline:
                raise VkxError(f"backend {self.name} signals its own timeline, not {signal[0].name}")
            if not isinstance(jobs, list) or not jobs:
                raise KernelError(f"backend {self.name}: run_chain takes a non-empty list of jobs")
            for job in jobs:
                self._check_any(job)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], jobs)  # type: ignore[union-attr]

    def node_why_not(self, node: Any) -> str | None:
        """Why a graph node of the STEP_OPS cannot run here (the planner keeps it on the hub), or
        None (:func:`.cpu_step.why_not`)."""
        return cpu_step.why_not(node)

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
            self._released = True  # (a job the bridge thread takes after its bounded join is refused)
            for c in self.graphs.values():
                c.close()
            self.graphs.clear()
            self._fast.clear()
            for k in list(self._packed):
                self._drop_packed(k)
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

    def _check_any(self, job: Job, op: str | None = None) -> None:
        """What ``mul_mat`` / ``mul_mat_id`` / ``run_op`` check before enqueueing ``job``."""
        if isinstance(job, OpJob):
            ops = NODE_OPS | (STEP_OPS if self.step else frozenset())
            if job.op not in self.caps.ops or job.op not in ops or (op is not None and job.op != op):
                raise KernelError(f"backend {self.name} does not run op {op or job.op!r}"
                                  + ("" if self.step or job.op not in STEP_OPS else " (without step=1)"),
                                  "plan it on the hub, or attach the backend with --backends cpu:step=1")
            self._check_op(job)
        elif isinstance(job, (MatMulJob, MatMulIdJob)) and op is None:
            self.check_job(job)  # type: ignore[arg-type]
            self._check_ggml(job)
        else:
            raise KernelError(f"backend {self.name} does not run op {op!r} ({type(job).__name__})")

    def _check_op(self, job: OpJob) -> None:
        what = f"backend {self.name}: {job.op} {job.name}".rstrip()
        if job.op in STEP_OPS:
            cpu_step.check(job, what)
            return
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
                self.graphs.pop(k).close()
            for k in [k for k, f in self._fast.items() if any(b is sb for b in f[1].buffers)]:
                del self._fast[k]
            for k in [k for k, (b, _p) in self._packed.items() if b is sb]:
                self._drop_packed(k)
            self._hooked.discard(id(sb))

    def _hook(self, buffers: tuple[SharedBuffer, ...]) -> None:
        for sb in buffers:
            if id(sb) not in self._hooked:
                self._hooked.add(id(sb))
                sb.on_close.append(self._forget)

    def _pool_for(self, flops: int) -> ggml_cpu.ThreadPool:
        return self.pool if flops >= SMALL_JOB_FLOPS else self.pool1

    def _run_pool(self, flops: int, jobs: int) -> ggml_cpu.ThreadPool:
        """The pool of a graph of ``jobs`` consecutive jobs of ``flops`` in all: every thread,
        but for an OpenMP build of ggml the calling thread alone where the jobs are small
        (:data:`OPENMP_RUN_JOB_FLOPS`)."""
        if self.ggml.openmp and flops < OPENMP_RUN_JOB_FLOPS * max(jobs, 1):
            return self.pool1
        return self.pool

    @staticmethod
    def _op_flops(job: OpJob) -> int:
        """A rough count for the thread choice: a few flops per element; attention's over the cache."""
        if job.op == "attention":
            return 4 * job.rows * job.cols * job.params["n_ctx"]
        return 8 * job.rows * job.cols

    # -- repacked weights ---------------------------------------------------------------------

    def _drop_packed(self, key: tuple[Any, ...]) -> None:
        _sb, p = self._packed.pop(key)
        if p is not None:
            self.packed_bytes -= p.nbytes
            p.close()

    def _check_stored(self, v: SharedView, offset: int, nbytes: int, what: str) -> None:
        """``nbytes`` at ``offset`` of ``v`` are about to be read as stored: refuse where their
        pages were given back (they would read as zeros)."""
        if v.shared.is_discarded(v.offset + offset, nbytes):
            raise KernelError(f"backend {self.name}: {what} reads the stored bytes of '{v.shared.name}', whose "
                              "pages were given back after the weight was repacked",
                              "restore them first (SharedBuffer.restore: the model does when a plan reads them)")

    def _packed_for(self, job: MatMulJob) -> ggml_cpu.PackedWeight | None:
        """The repacked copy of ``job``'s weight rows, made the first time (None: read as stored:
        repack off, no layout for the type or row count here, x rows of a prefill job not
        contiguous, or memory that needs dma-buf brackets or staging around each read). Under
        ``self._lock``."""
        if not self.repack or not isinstance(job, MatMulJob) or not weight_type(job.w_type).quantized:
            return None
        tid = weight_type(job.w_type).id
        amx = self.amx and self.ggml.amx_takes(tid, job.rows, job.K)
        if job.M >= (2 if amx else 4) and job.x_stride != job.K:
            # both kinds read x rows K apart: ggml's repacked gemm quantizes x four rows at a time
            # (ggml_quantize_mat_q8_*_4x*), the AMX kernels each row at m * K: strided x rows would
            # be misread
            return None
        if amx and job.M >= 2 and job.y_stride != job.rows:
            # the AMX kernels' multi-row path loses rows of a strided result (those past its first
            # 4 KiB: tests/test_cpu_repack.py shows it); one row (decode) is right
            return None
        v, key, first, rb = self._pack_key(job)
        got = self._packed.get(key)
        if got is not None:
            return got[1]
        p = None
        if v.chunk.kind != "dma_buf" and v.shared.kind != "staged":
            self._check_stored(v, first, job.rows * rb, job.name or "repacking a weight")
            t0 = time.perf_counter()
            p = ggml_cpu.PackedWeight.create(self.ggml, tid, job.K, job.rows, _addr(v, first + job.rows * rb) + first,
                                             amx=amx)
            self.pack_s += time.perf_counter() - t0
            if p is not None:
                self.packed_bytes += p.nbytes
        self._packed[key] = (v.shared, p)
        self._hook((v.shared,))
        return p

    @staticmethod
    def _pack_key(job: MatMulJob) -> tuple[SharedView, tuple[Any, ...], int, int]:
        """(weight view, the key of its rows' copy, their offset in the view, row bytes)."""
        v = job.weight
        rb = row_bytes(job.w_type, job.K)
        first = (job.r0 - job.w_row0) * rb
        return v, (v.chunk.id, v.chunk_offset + first, job.w_type, job.K, job.rows), first, rb

    def read_as_stored(self, job: MatMulJob) -> None:
        """Have ``job``'s weight rows read as stored, never copied (the model asks where a plan
        reads the weight as stored anyway: the weights are then held once). A copy made before
        is freed with the graphs built over it (they are built again on the stored bytes)."""
        with self._lock:
            v, key, _first, _rb = self._pack_key(job)
            got = self._packed.get(key)
            if got is not None and got[1] is not None:
                self._drop_packed(key)
                self._drop_graphs()
            if key not in self._packed:
                self._packed[key] = (v.shared, None)
                self._hook((v.shared,))

    def keep_packed(self, jobs: list[MatMulJob]) -> int:
        """Free the repacked copies of weight rows that none of ``jobs`` (the products of the
        live plans) multiplies by, and the graphs built over them: a plan dropped for another
        split reads its weights as stored again, and they must not be held twice. Returns the
        bytes freed."""
        with self._lock:
            live = {self._pack_key(j)[1] for j in jobs}
            gone = [k for k, (_sb, p) in self._packed.items() if p is not None and k not in live]
            freed = sum(self._packed[k][1].nbytes for k in gone)  # type: ignore[union-attr]
            for k in gone:
                self._drop_packed(k)
            if gone:
                self._drop_graphs()
            return freed

    def _drop_graphs(self) -> None:
        """Forget every graph (under ``self._lock``): some point at a freed copy; a job's next run
        builds its graph again."""
        for c in self.graphs.values():
            c.close()
        self.graphs.clear()
        self._fast.clear()

    def pack(self, job: MatMulJob) -> bool:
        """Make the repacked copy of ``job``'s weight rows now (the first step would otherwise:
        the model calls this when it builds a plan, weight by weight, and gives back the stored
        pages of each weight as soon as it is repacked). True when ``job`` will multiply by a
        repacked copy; False when it reads the weight as stored."""
        self.check_job(job)
        self._check_ggml(job)
        with self._lock:
            if self._released:
                raise VkxError(f"backend {self.name} is closed: it repacks nothing more",
                               "close the backend after the model that uses it")
            return self._packed_for(job) is not None

    def _emit_mul_mat(self, g: ggml_cpu.Graph, job: MatMulJob) -> Any:
        lib = self.ggml.base
        tid = weight_type(job.w_type).id
        rb = row_bytes(job.w_type, job.K)
        held = job.weight.size // rb
        packed = self._packed_for(job)
        if packed is not None:  # the repacked tensor itself: its buffer and extra select ggml's kernels
            W = packed.tensor
        else:
            self._check_stored(job.weight, (job.r0 - job.w_row0) * rb, job.rows * rb, job.name or "mul_mat")
            W = g.strided(tid, _addr(job.weight, held * rb) + (job.r0 - job.w_row0) * rb, job.K, job.rows, rb)
        nx = (job.M - 1) * job.x_stride + job.K
        X = g.strided(F32, _addr(job.x, nx * 4), job.K, job.M, job.x_stride * 4)
        ny = (job.M - 1) * job.y_stride + job.r1
        y = lib.ggml_mul_mat(g.ctx, W, X)  # (rows, M) f32, written into y's columns [r0, r1)
        return g.place(y, _addr(job.y, ny * 4) + job.r0 * 4, job.y_stride * 4)

    def _build_mul_mat(self, job: MatMulJob) -> _Cached:
        g = ggml_cpu.Graph(self.ggml)
        g.finish(self._emit_mul_mat(g, job), self._pool_for(job.flops))
        return _Cached(g, (job.weight.shared, job.x.shared, job.y.shared))

    def _build_mul_mat_id(self, job: MatMulIdJob) -> _Cached:
        assert job.ids is not None
        g = ggml_cpu.Graph(self.ggml)
        lib = self.ggml.base
        tid = weight_type(job.w_type).id
        rb = row_bytes(job.w_type, job.K)
        held = job.weight.size // rb
        self._check_stored(job.weight, 0, held * rb, job.name or "mul_mat_id")
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

    def _emit_op(self, g: ggml_cpu.Graph, job: OpJob, before: list[Any], keep: list[Any]) -> list[Any]:
        """Add ``job``'s nodes to ``g``; returns the tensors to expand, in order. Checks and
        settings that must run before each compute go to ``before`` as (function, the view it
        reads), memory of the backend's own the graph points into to ``keep``."""
        lib = self.ggml.base
        R, C = job.rows, job.cols
        for v in job.inputs:  # (get_rows reads a weight as stored)
            self._check_stored(v, 0, v.size, f"{job.op} {job.name}".rstrip())
        if job.op in STEP_OPS:
            return cpu_step.emit(self.ggml, g, job, before, keep, self._masks, f"backend {self.name}")

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
        return [out]

    def _build_op(self, job: OpJob) -> _Cached:
        bufs = tuple(v.shared for v in (*job.inputs, *job.outputs))
        if job.op == "argmax":
            return _Cached(None, bufs, host=cpu_step.host_argmax(job))
        g = ggml_cpu.Graph(self.ggml)
        before: list[Any] = []
        keep: list[Any] = []
        for out in self._emit_op(g, job, before, keep):
            g.expand(out)
        before = [fn for fn, _v in before]
        g.finish(None, self._pool_for(self._op_flops(job)))
        return _Cached(g, bufs, before=before, keep=keep)

    def _build_run(self, jobs: list[Job]) -> _Run:
        """One :class:`_Run` of ``jobs``: graphs of consecutive jobs, cut before a job whose
        checks read memory an earlier job of the graph writes, and around host jobs (argmax) and
        routed products (their ids are checked before each compute)."""
        pieces: list[_Cached] = []
        g: ggml_cpu.Graph | None = None
        before: list[Any] = []
        keep: list[Any] = []
        bufs: list[SharedBuffer] = []
        written: list[tuple[Any, int, int]] = []
        flops, count = 0, 0

        def close() -> None:
            nonlocal g, before, keep, bufs, written, flops, count
            if g is not None:
                g.finish(None, self._run_pool(flops, count))
                pieces.append(_Cached(g, tuple(bufs), before=before, keep=keep))
            g, before, keep, bufs, written, flops, count = None, [], [], [], [], 0, 0

        for job in jobs:
            ins, outs = self._views(job)
            if isinstance(job, MatMulIdJob) or (isinstance(job, OpJob) and job.op == "argmax"):
                close()
                pieces.append(self._build_mul_mat_id(job) if isinstance(job, MatMulIdJob) else self._build_op(job))
                continue
            mine: list[Any] = []
            if g is None:
                g = ggml_cpu.Graph(self.ggml, TENSORS_PER_JOB * len(jobs) + 16)
            if isinstance(job, OpJob):
                outs_t = self._emit_op(g, job, mine, keep)
            else:
                outs_t = [self._emit_mul_mat(g, job)]
            if _overlaps([_rng(v) for _fn, v in mine], written):  # its checks read what the graph so far writes
                close()
                g = ggml_cpu.Graph(self.ggml, TENSORS_PER_JOB * len(jobs) + 16)
                mine = []
                outs_t = self._emit_op(g, job, mine, keep) if isinstance(job, OpJob) else [self._emit_mul_mat(g, job)]
            for t in outs_t:
                g.expand(t)
            before += [fn for fn, _v in mine]
            bufs += [v.shared for v in (*ins, *outs)]
            written += [_rng(v) for v in outs]
            flops += self._op_flops(job) if isinstance(job, OpJob) else job.flops
            count += 1
        close()
        return _Run(pieces)

    def _graph(self, job: Job | list[Job]) -> Any:
        key = tuple(_job_key(j) for j in job) if isinstance(job, list) else _job_key(job)
        c = self.graphs.get(key)
        if c is not None:
            self.graphs.move_to_end(key)
            return c
        while len(self.graphs) >= MAX_GRAPHS:
            _k, old = self.graphs.popitem(last=False)
            for k in [k for k, f in self._fast.items() if f[1] is old]:
                del self._fast[k]
            old.close()
        if isinstance(job, list):
            c = self._build_run(job)
        elif isinstance(job, OpJob):
            c = self._build_op(job)
        elif isinstance(job, MatMulIdJob):
            c = self._build_mul_mat_id(job)
        else:
            c = self._build_mul_mat(job)
        self.graphs[key] = c
        self.graphs_built += 1
        self._hook(c.buffers)
        for piece in (c.pieces if isinstance(c, _Run) else [c]):
            if piece.graph is not None and piece.graph.work_size > self._work.size:
                self._work = np.zeros(piece.graph.work_size, np.uint8)
                self._work_ptr = self.ggml.ffi.cast("uint8_t *", self._work.ctypes.data)
        return c

    # -- work (bridge thread) -------------------------------------------------------------

    def _compute(self, c: _Cached) -> None:
        for fn in c.before:
            fn()
        t0 = time.perf_counter()
        if c.host is not None:
            c.host()
        else:
            c.graph.compute(self._work_ptr)  # type: ignore[union-attr]
        self.busy_s += time.perf_counter() - t0

    def _run(self, job: Job | list[Job]) -> None:
        with self._lock:
            if self._released:
                raise VkxError(f"backend {self.name} is closed: its graphs and thread pools are freed",
                               "close the backend after the steps that use it have finished")
            f = self._fast.get(id(job))
            if f is None or f[0] is not job:  # first sight of this job object: find or build its graph
                sync = any(self._needs_sync(j) for j in job) if isinstance(job, list) else self._needs_sync(job)
                f = self._fast[id(job)] = (job, self._graph(job), sync)
                if len(self._fast) > 2 * MAX_GRAPHS:
                    self._fast.popitem(last=False)
            _job, c, sync = f
            if isinstance(job, list):
                if sync:  # dma-buf brackets or staging: job by job, each through the synced path
                    for j in job:
                        self._run_synced(j, self._graph(j))
                else:
                    for piece in c.pieces:
                        if piece.ids is not None:
                            self._check_ids(piece)
                        self._compute(piece)
                self.jobs_done += len(job)
                return
            if sync or c.ids is not None:
                self._run_synced(job, c)
            else:  # host memory, nothing to bracket or stage: the replay is the ggml call alone
                self._compute(c)
        self.jobs_done += 1

    def _check_ids(self, c: _Cached, name: str = "") -> None:
        ids, n_expert = c.ids
        if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
            bad = int(ids[(ids < 0) | (ids >= n_expert)][0])
            raise KernelError(f"backend {self.name}: {name or 'mul_mat_id'}: expert id {bad} outside [0, {n_expert})",
                              "the router's top-k produced a bad id")

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
                self._check_ids(c, job.name)
            self._compute(c)
            for v in outs:
                if v.shared.kind != "staged":
                    continue
                if isinstance(job, OpJob):
                    v.shared.stage_out(v.offset, v.size if job.op in STEP_OPS else job.rows * job.cols * 4)
                else:  # only this job's columns: other backends may write the rest of y
                    n_rows = job.M * (job.n_used if isinstance(job, MatMulIdJob) else 1)
                    for m in range(n_rows):
                        v.shared.stage_out(v.offset + (m * job.y_stride + job.r0) * 4, job.rows * 4)
