"""The executor: runs a plan's step as hub segments and backend jobs, submitted in one go.

Reading order:

1. A plan (:mod:`vkxsplit.plan.planner`; :mod:`vkxsplit.plan.lowering`) lowers its graph to a
   list of *items* in execution order and cuts them into a
   :class:`~vkxsplit.plan.schedule.Schedule` of hub segments and backend jobs
   (:func:`vkxsplit.plan.schedule.build_schedule`: which segment waits for which job and the
   other way round).
2. :class:`Executor` records each segment once into a :class:`~vkxsplit.vk.command.Sequence`
   (each item through its op's hub recorder, :mod:`vkxsplit.ops.nodes`) and builds each
   backend job (:class:`~vkxsplit.backend.MatMulJob`, :class:`~vkxsplit.backend.OpJob`) once.
   :meth:`Executor.step` then submits the whole step up front:
   ``Sequence.submit(waits=[backend points])`` for segments,
   ``backend.mul_mat(job, wait=(hub timeline, value), signal=backend.next_point())`` for jobs.
   Nothing in a step waits on the host; the caller waits (:meth:`Step.wait`) only for the
   points that produce the outputs it reads.

Per step, :class:`Step` counts submits, host waits made while submitting (zero), bytes the
attach layer staged (copied) while the step ran, and re-recordings (zero for a replay).
With ``trace=True`` the executor writes GPU timestamps around every hub item and watches the
backend points from a helper thread; :meth:`Step.trace` returns a Chrome trace-event JSON
object (open it in https://ui.perfetto.dev): one track per backend, one slice per op.

``record_graph(seq, graph)`` (the whole graph into one sequence, no backends) stays for
simple callers and benchmarks.

Imports: ``vkxsplit.plan.schedule`` (never the planner or the model), ``vkxsplit.ops.nodes``,
``vkxsplit.backend`` (job types), ``vkxsplit.attach``, ``vkxsplit.vk``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import attach as _attach
from .backend import STEP_OPS, MatMulIdJob, MatMulJob, OpJob
from .errors import KernelError, VkxError, WaitTimeout
from .graph import Graph, Span, Tensor, any_overlap, span
from .ops.nodes import record_node, record_tensor_convert, recorder, recorders
from .plan.schedule import BackendIdOp, BackendNodeOp, BackendOp, HubOp
from .vk.api import NULL, lib, new, vk
from .vk.command import Sequence, Timestamps, hub_timeline
from .vk.event import COLD_FACTOR, default_timeout

if TYPE_CHECKING:
    from .backend import Backend
    from .plan.result import Plan
    from .relay import Relay
    from .vk.device import Device


def record_graph(seq: Sequence, graph: Graph, ops: Mapping[str, Any] | None = None) -> None:
    """Record every node of ``graph`` on the hub, in order, into one sequence (``ops``: a table
    of recorders by op name to use instead of :mod:`vkxsplit.ops.nodes`'s)."""
    table = ops or recorders()
    for node in graph.nodes:
        fn = table.get(node.op)
        if fn is None:
            raise KernelError(f"graph {graph.name}: no hub kernel for op {node.op} (node {node.name})")
        fn(seq, node)


# ---------------------------------------------------------------------------------------------
# items into commands and jobs


def _record(seq: Sequence, op: HubOp) -> None:
    """Record one hub item: a graph node, the hub's rows of a split ``mul_mat``, or an inserted
    conversion."""
    if op.kind == "node":
        assert op.node is not None
        record_node(seq, op.node)
    elif op.kind == "rows":
        assert op.node is not None
        recorder(op.node.op)(seq, op.node, op.r0, op.r1)
    elif op.kind == "convert":
        assert op.src is not None and op.dst is not None
        record_tensor_convert(seq, op.src, op.dst)
    else:
        raise VkxError(f"unknown hub item kind {op.kind!r}")


def _acquire_host_writes(seq: Sequence) -> None:
    """A barrier from the host's writes (HOST stage, HOST_WRITE) to the segment's commands: the
    memory domain operation, host to device, that makes what another device wrote into host
    pages (made available to the host by the barrier closing its segment) visible to this one.
    A segment that the relay *signals* (a layer split over hubs) was submitted before that write
    happened, so the submission's host write ordering guarantee does not cover it (a segment the
    relay *submits* is covered by its vkQueueSubmit); this barrier runs after its semaphore wait."""
    b = new("VkMemoryBarrier", srcAccessMask=vk.VK_ACCESS_HOST_WRITE_BIT,
            dstAccessMask=vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT)
    lib.vkCmdPipelineBarrier(seq.cb, vk.VK_PIPELINE_STAGE_HOST_BIT,
                             vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                             0, 1, b, 0, NULL, 0, NULL)
    seq.barriers += 1


def _job(op: BackendOp | BackendIdOp | BackendNodeOp) -> MatMulJob | MatMulIdJob | OpJob:
    """The backend job of a backend item, built once per executor."""
    if isinstance(op, BackendIdOp):  # a routed expert product: the backend's mul_mat_id hook
        return MatMulIdJob(op.weight.buffer, op.weight.dtype, op.x.buffer, op.y.buffer,  # type: ignore[arg-type]
                           op.M, op.N, op.K, x_type=op.x.dtype, r0=op.r0, r1=op.r1, name=op.name,
                           ids=op.ids.buffer, n_expert=op.n_expert, n_used=op.n_used,  # type: ignore[arg-type]
                           n_xb=op.n_xb)
    if isinstance(op, BackendNodeOp):
        n = op.node
        ins = n.inputs
        rows, cols = ins[0].rows, ins[0].cols
        params: dict[str, Any] = {}
        if n.op == "add_rms_norm":
            outs = (n.output.buffer, ins[0].buffer)
        elif n.op == "kv_store":  # (the V cache is a param of the node)
            outs = (n.output.buffer, n.params["cache_v"].buffer)
        else:
            outs = (n.output.buffer,)
        if n.op in STEP_OPS:  # the node's scalars (not its hub-only tensors: scratch, xq)
            params = {k: v for k, v in n.params.items() if not isinstance(v, Tensor)}
            if n.op == "get_rows":
                rows, cols = n.output.rows, ins[0].cols  # (ids: a 1-d tensor of T)
                params["w_type"], params["n_rows"] = ins[0].dtype, ins[0].rows
            elif n.op in ("kv_store", "attention"):
                params["n_ctx"] = (n.output if n.op == "kv_store" else ins[1]).shape[0]
        b_rows = ins[1].rows if n.op == "add" and len(ins[1].shape) > 1 else (1 if n.op == "add" else rows)
        return OpJob(n.op, tuple(t.buffer for t in ins), outs, rows, cols,  # type: ignore[arg-type]
                     eps=float(n.params.get("eps", 0.0)), b_rows=b_rows, name=op.name, params=params)
    return MatMulJob(op.weight.buffer, op.weight.dtype, op.x.buffer, op.y.buffer,  # type: ignore[arg-type]
                     op.M, op.N, op.K, x_type=op.x.dtype, r0=op.r0, r1=op.r1,
                     w_row0=op.w_row0, name=op.name)


def _spans(ts: Iterable[Tensor]) -> list[Span]:
    return [span(t) for t in ts]


# ---------------------------------------------------------------------------------------------
# running


class Executor:
    """Runs one plan step after step: segments recorded once, jobs built once, every step
    submitted up front (see the module docstring)."""

    def __init__(self, device: Device, plan: Plan, backends: Mapping[str, Backend] | Iterable[Backend] = (),
                 *, trace: bool = False, name: str | None = None, hubs: list[Device] | None = None,
                 relay: Relay | None = None) -> None:
        self.device = device
        self.plan = plan
        self.schedule = plan.schedule
        # the Vulkan hubs (device 0 = ``device``) and, with several, the relay between them
        self.hubs = list(hubs) if hubs else [device]
        self.relay = relay
        n_hubs = self.schedule.hubs
        if n_hubs > len(self.hubs):
            raise VkxError(f"the plan runs on {n_hubs} hubs; the executor was given {len(self.hubs)}")
        if n_hubs > 1 and relay is None:
            raise VkxError("a plan over several hubs needs the relay between them")
        self.timelines = [hub_timeline(d) for d in self.hubs]
        self._hub_last = {s.hub: s.index for s in self.schedule.segments} if n_hubs > 1 else {}
        if not isinstance(backends, Mapping):
            backends = {b.name: b for b in backends}
        used = {j.op.backend for j in self.schedule.jobs}
        missing = sorted(used - set(backends))
        if missing:
            raise VkxError(f"the plan uses backend(s) {', '.join(missing)}, which are not attached")
        self.backends = {n: backends[n] for n in sorted(used)}
        self.name = name or plan.graph.name
        self.timeline = hub_timeline(device)
        self.tracing = trace
        self.recordings = 0
        self.steps = 0
        self._seqs: list[Sequence] = []
        self._ts: Timestamps | None = None  # hub 0's timestamps (each hub's: _tss)
        self._tss: list[Timestamps] = []
        self._ts_base: list[int] = []  # each segment's first timestamp in its hub's
        self._last: Step | None = None
        try:
            if trace:
                for h in range(n_hubs):
                    n = sum(len(s.ops) + 1 for s in self.schedule.segments if s.hub == h)
                    self._tss.append(Timestamps(self.hubs[h], max(1, n)))
                self._ts = self._tss[0]
            k = [0] * n_hubs
            for seg in self.schedule.segments:
                seq = Sequence(self.hubs[seg.hub], f"{self.name}#{seg.index}")
                self._seqs.append(seq)
                if seg.hub_waits and plan.cross == "signal":  # (the relay signals it: see above)
                    _acquire_host_writes(seq)
                self._ts_base.append(k[seg.hub])
                ts = self._tss[seg.hub] if self._tss else None
                if ts is not None:
                    seq.write_timestamp(ts, k[seg.hub])
                    k[seg.hub] += 1
                for op in seg.ops:
                    _record(seq, op)
                    if ts is not None:
                        seq.write_timestamp(ts, k[seg.hub])
                        k[seg.hub] += 1
                seq.end()
                self.recordings += 1
            self._jobs = [_job(j.op) for j in self.schedule.jobs]
            self._chains, self._chained = self._find_chains()
            self._chain_jobs = {h: [self._jobs[j] for j in run] for h, run in self._chains.items()}
            # the segment each run starts after: the latest any of its jobs waits for
            self._chain_wait = {h: max(self.schedule.jobs[j].wait for j in run) for h, run in self._chains.items()}
            # of the trailing jobs, the last of each backend: a backend runs its jobs in order
            # (a step of hundreds of trailing jobs otherwise checks every point)
            last: dict[str, int] = {}
            for j in self.schedule.trailing:
                last[self.schedule.jobs[j].op.backend] = max(j, last.get(self.schedule.jobs[j].op.backend, -1))
            self._trailing = sorted(last.values())
            self._last_seg = max((i for k, i in self.schedule.order if k == "seg"), default=-1)
            self._hub_only = not self._jobs and self._ts is None
        except BaseException:
            self.close()
            raise

    def _find_chains(self) -> tuple[dict[int, list[int]], set[int]]:
        """Runs of consecutive jobs of one backend with no hub segment submitted between them,
        for backends that take them as one unit (``run_chain``): head job -> its run, and the
        jobs after the head. A run starts after the latest segment any of its jobs waits for
        (already submitted: no segment lies between) and signals its last job's point; a
        backend's points are in order, so every earlier point of the run is reached then too."""
        order, jobs = self.schedule.order, self.schedule.jobs
        chains: dict[int, list[int]] = {}
        run: list[int] = []

        def close() -> None:
            if len(run) > 1 and type(self.backends[jobs[run[0]].op.backend]).implements("run_chain"):
                chains[run[0]] = list(run)
            run.clear()

        for kind, i in order:
            if kind == "seg" or (run and jobs[run[0]].op.backend != jobs[i].op.backend):
                close()
            if kind == "job":
                run.append(i)
        close()
        return chains, {j for r in chains.values() for j in r[1:]}

    @property
    def backend_jobs(self) -> list[MatMulJob | MatMulIdJob | OpJob]:
        """The backend job of each of the schedule's jobs (in ``schedule.jobs`` order), built once."""
        return list(self._jobs)

    @property
    def submits_per_step(self) -> int:
        return len(self.schedule.segments)

    def step(self, waits: Iterable[Any] = ()) -> Step:
        """Submit one step: every segment and every job, without waiting on the host. ``waits``:
        points (timeline, value) of this device the step's first submit waits for on the GPU
        (a pipeline stage waits for the previous GPU's hidden state this way)."""
        sch = self.schedule
        seqs = self._seqs
        extra = list(waits)
        if self._hub_last:
            return self._hubs_step(extra)
        if self._hub_only:  # split none: one submit per segment and nothing else (the hub path)
            _attach.stats.begin_step()
            vals = [seq.submit(waits=extra) if i == 0 else seq.submit() for i, seq in enumerate(seqs)]
            step = Step(self, vals, [], 0)
            step.submits = len(vals)
            if self.steps == 0:
                step.recordings = self.recordings
                self._first_run(vals[-1] if vals else 0)
            self.steps += 1
            self._last = step
            return step
        stats = _attach.stats
        stats.begin_step()
        carry = self._last.unfinished() if self._last is not None else []
        seg_vals = [0] * len(sch.segments)
        job_pts: list[Any] = [None] * len(sch.jobs)
        step = Step(self, seg_vals, job_pts, stats.staged_bytes)
        self._last = step
        tl = self.timeline
        for kind, i in sch.order:
            if kind == "seg":
                waits = [job_pts[j] for j in sch.segments[i].waits]
                if i == 0 and (carry or extra):
                    waits = [*carry, *extra, *waits]
                seg_vals[i] = seqs[i].submit(waits=waits)
                step.submits += 1
            elif i in self._chained:  # (handed over with its run's head)
                continue
            elif i in self._chains:
                run = self._chains[i]
                b = self.backends[sch.jobs[i].op.backend]
                for j in run:
                    job_pts[j] = b.next_point()
                b.run_chain(self._chain_jobs[i], (tl, seg_vals[self._chain_wait[i]]), job_pts[run[-1]])
            else:
                jb = sch.jobs[i]
                b = self.backends[jb.op.backend]
                p = b.next_point()
                job_pts[i] = p
                job = self._jobs[i]
                if isinstance(jb.op, BackendNodeOp):
                    b.run_op(job.op, job, (tl, seg_vals[jb.wait]), p)
                elif isinstance(jb.op, BackendIdOp):
                    b.mul_mat_id(job, (tl, seg_vals[jb.wait]), p)
                else:
                    b.mul_mat(job, (tl, seg_vals[jb.wait]), p)
        step.host_waits = stats.host_waits_in_step
        if self.steps == 0:
            step.recordings = self.recordings
            self._first_run(max(seg_vals, default=0))
        self.steps += 1
        if self._ts is not None:
            step._start_watch()
        return step

    def _hubs_step(self, extra: list[Any]) -> Step:
        """Submit one step of a plan over several hubs: each segment on its hub's queue; a
        segment that waits for another hub's (``hub_waits``) goes through the relay, which
        either signals a timeline the segment, queued here, waits on (``plan.cross ==
        "signal"``) or submits it itself once the other hub got there (``"submit"``; from then
        on the relay submits every later segment of the step, so each hub's queue keeps the
        schedule's order). See :mod:`vkxsplit.relay`."""
        sch, seqs, relay = self.schedule, self._seqs, self.relay
        assert relay is not None
        _attach.stats.begin_step()
        vals = [0] * len(sch.segments)
        step = Step(self, vals, [], 0)
        self._last = step
        first = self.steps == 0
        if first:  # kernels compile at their first dispatch: the longer stall limit (vk.event)
            for h, tl in enumerate(self.timelines[:sch.hubs]):
                n = sum(1 for seg in sch.segments if seg.hub == h)
                tl.expect_slow(tl.last + n, f"the first run of {n} segments recorded on hub{h} "
                                              "(kernels compile at their first dispatch)")
        via_relay = False

        def points(seg: Any) -> Any:
            return lambda: [(f"hub{sch.segments[j].hub}", self.timelines[sch.segments[j].hub], vals[j])
                            for j in seg.hub_waits]

        def submit(i: int) -> Any:
            def run() -> None:
                vals[i] = seqs[i].submit()
                step.submits += 1
            return run

        for _kind, i in sch.order:
            seg = sch.segments[i]
            if self.plan.cross == "submit" and (seg.hub_waits or via_relay):
                via_relay = True
                relay.enqueue(points(seg), submit=submit(i))
                continue
            waits = list(extra) if i == 0 else []
            if seg.hub_waits:
                tl = relay.timeline(self.hubs[seg.hub], f"hub{seg.hub}")
                v = tl.next()
                relay.enqueue(points(seg), signal=(tl, v))
                waits.append((tl, v))
            vals[i] = seqs[i].submit(waits=waits)
            step.submits += 1
        if first:
            step.recordings = self.recordings
        self.steps += 1
        if self._ts is not None:
            step._start_watch()
        return step

    def step_with(self, seqs: list[Sequence], waits: Iterable[Any] = ()) -> Step:
        """Submit one step as :meth:`step` does, with ``seqs`` (other recordings of the same
        segments, one per segment: the level profiler's, :mod:`vkxsplit.profile_step`) in
        place of the executor's own; :meth:`step` itself never looks at them."""
        if len(seqs) != len(self._seqs):
            raise VkxError(f"step_with: {len(seqs)} sequences for {len(self._seqs)} segments")
        own = self._seqs
        self._seqs = seqs
        try:
            return self.step(waits)
        finally:
            self._seqs = own

    def _first_run(self, value: int) -> None:
        """The first step runs every recorded kernel for the first time, and drivers compile a
        kernel at its first dispatch (lavapipe's llvmpipe does, inside the queue, with nothing
        for the host to see): waits up to its last hub value get the longer stall limit."""
        if value:
            n = sum(len(s.ops) for s in self.schedule.segments)
            self.timeline.expect_slow(value, f"the first run of {n} recorded hub ops (kernels compile "
                                             "at their first dispatch)")

    def run(self, timeout: float | None = None) -> Step:
        """Submit one step and wait for all of it."""
        s = self.step()
        s.wait(timeout)
        return s

    def close(self) -> None:
        if self._last is not None and not self._hub_last:  # (several hubs: the sequences below)
            try:
                self._last.wait()
            except Exception:  # closing: the error was (or will be) reported by its step
                pass
            self._last = None
        for s in self._seqs:
            s.wait()
            s.close()
        self._seqs.clear()
        for ts in self._tss:
            ts.close()
        self._tss.clear()
        self._ts = None

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Step:
    """One submitted step: its points, counters, and (when traced) its timeline."""

    __slots__ = ("executor", "seg_values", "job_points", "submits", "host_waits", "recordings", "staged_bytes",
                 "jobs", "done", "_staged0", "_t0", "_seen", "_watch", "_stop")

    def __init__(self, ex: Executor, seg_vals: list[int], job_pts: list[Any], staged0: int) -> None:
        self.executor = ex
        self.seg_values = seg_vals
        self.job_points = job_pts
        self.submits = 0
        self.host_waits = 0          # host waits made while submitting (always 0)
        self.recordings = 0          # command buffers recorded for this step (0 when replayed)
        self.staged_bytes = 0        # bytes the attach layer copied while the step ran
        self.jobs = len(job_pts)
        self.done = False
        self._staged0 = staged0
        self._t0 = time.perf_counter_ns() if ex._ts is not None else 0
        self._seen: dict[tuple[str, int], int] = {}
        self._watch: threading.Thread | None = None
        self._stop = False

    # -- collection -------------------------------------------------------------------------

    def _final_points(self) -> list[Any]:
        ex = self.executor
        if ex._hub_last:  # several hubs: each one's last segment
            return [(ex.timelines[h], self.seg_values[i]) for h, i in sorted(ex._hub_last.items())]
        pts: list[Any] = []
        if ex._last_seg >= 0 and self.seg_values[ex._last_seg]:
            pts.append((ex.timeline, self.seg_values[ex._last_seg]))
        if self.job_points:
            pts += [self.job_points[j] for j in ex._trailing if self.job_points[j] is not None]
        return pts

    def _writer_points(self, outputs: Iterable[Tensor]) -> list[Any]:
        sch = self.executor.schedule
        tl = self.executor.timeline
        want = [span(t) for t in outputs]
        pts = []
        for t_span in want:
            best = None
            for kind, i in sch.order:
                if kind == "seg":
                    if any(any_overlap([t_span], _spans(op.writes)) for op in sch.segments[i].ops):
                        best = (tl, self.seg_values[i])
                elif any_overlap([t_span], _spans(sch.jobs[i].op.writes)):
                    best = self.job_points[i]
            if best is not None:
                pts.append(best)
        return pts

    def unfinished(self) -> list[Any]:
        """Points of this step's trailing jobs not yet reached (the next step waits for them)."""
        if self.done:
            return []
        out = []
        for j in self.executor._trailing:
            p = self.job_points[j]
            if p is not None and p[0].value < p[1]:
                out.append(p)
        return out

    def wait(self, timeout: float | None = None, outputs: Iterable[Tensor] | None = None) -> None:
        """Collect: wait for the points producing ``outputs`` (default: the whole step), then
        raise what any backend's asynchronous part recorded."""
        host_wait = _attach.host_wait
        if self.done:
            return
        timeout = default_timeout() if timeout is None else timeout
        if self.executor._hub_last:
            self._wait_hubs(timeout)
            self.done = True
            if self._watch is not None:  # (its points are reached: it ends; join cannot take inf)
                self._watch.join(None if timeout == float("inf") else timeout)
            return
        pts = self._final_points() if outputs is None else self._writer_points(outputs)
        # the backends of the step are watched: one that dies fails the wait at once, and their
        # progress (answers, heartbeats) counts as the step's (see vk.event: slow versus dead)
        peers = tuple(self.executor.backends.values()) if self.job_points else ()
        for p in pts:
            host_wait(p, timeout, peers=peers)
        if outputs is None:
            self.done = True
            if self.job_points:
                self.staged_bytes = _attach.stats.staged_bytes - self._staged0
            if self._watch is not None:  # (its points are reached: it ends; join cannot take inf)
                self._watch.join(None if timeout == float("inf") else timeout)
        for b in self.executor.backends.values():
            b.check()

    def _wait_hubs(self, timeout: float) -> None:
        """Wait for every hub's last segment of a step over several hubs. The relay's error is
        raised as soon as it has one (it names the hub that did not get there); the wait times
        out only after ``timeout`` s in which neither the counter nor the relay moved (a step
        is many crossings), longer while the first run compiles its kernels."""
        ex = self.executor
        relay = ex.relay
        assert relay is not None
        for h, i in sorted(ex._hub_last.items()):
            tl = ex.timelines[h]
            seen, since = -1, time.monotonic()
            while True:
                relay.check()
                v = self.seg_values[i]  # (0 until the relay submitted it)
                cur = tl._value()
                if v and cur >= v:
                    break
                if cur != seen:
                    seen, since = cur, time.monotonic()
                if v:
                    try:
                        tl.wait(v, 0.05)
                        continue
                    except WaitTimeout:
                        pass
                else:
                    time.sleep(0.002)
                cold = cur < tl._slow_until
                limit = timeout * (COLD_FACTOR if cold else 1.0) + 4 * relay.slice_s
                if time.monotonic() - max(since, relay.progress) > limit:
                    relay.check()
                    raise WaitTimeout(f"hub{h} ({tl.name}) did not reach {v or 'its last segment'} within "
                                      f"{timeout:g} s of the last crossing (it is at {cur}): a hub's step is stuck",
                                      "raise VKXSPLIT_TIMEOUT_S if the work is just slow")

    # -- tracing ----------------------------------------------------------------------------

    def _start_watch(self) -> None:
        sch = self.executor.schedule
        tls = self.executor.timelines
        vals = self.seg_values  # (over several hubs the relay may submit, and fill in, a value later)
        pts: list[tuple[tuple[str, int], Any, Any]] = []
        for kind, i in sch.order:
            if kind == "seg":
                pts.append((("seg", i), tls[sch.segments[i].hub], lambda i=i: vals[i]))
            else:
                p = self.job_points[i]
                pts.append((("job", i), p[0], lambda v=p[1]: v))
        deadline = time.monotonic() + default_timeout()

        def watch() -> None:
            left = list(pts)
            while left and time.monotonic() < deadline and not self._stop:
                now = time.perf_counter_ns()
                cache: dict[int, int] = {}
                keep = []
                for key, t, value in left:
                    v = value()
                    cur = cache.get(id(t))
                    if cur is None:
                        try:
                            cur = cache[id(t)] = t.value
                        except VkxError:
                            return
                    if v and cur >= v:
                        self._seen[key] = now
                    else:
                        keep.append((key, t, value))
                left = keep
                if left:
                    time.sleep(0.0002)

        self._watch = threading.Thread(target=watch, name="vkxsplit-trace", daemon=True)
        self._watch.start()

    def trace(self) -> dict[str, Any]:
        """The step as Chrome trace-event JSON (``{"traceEvents": [...]}``): one track per
        participant, a slice per op. Hub slices come from GPU timestamps, placed on the host
        clock by the segment completions the watcher saw; backend slices from host clocks
        (start: the later of its hub point and the backend's previous job; end: when its
        point was seen reached)."""
        ex = self.executor
        if ex._ts is None:
            raise VkxError("this executor was made without trace=True: no timeline to export")
        self.wait()
        sch = ex.schedule
        tss = [t.read() for t in ex._tss]
        multi = len(tss) > 1
        hubs = [f"hub{h}" for h in range(len(tss))] if multi else ["hub"]
        tracks = hubs + sorted(ex.backends)
        tid = {n: i for i, n in enumerate(tracks)}
        ev: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": ex.name}}]
        for n, i in tid.items():
            label = f"{n} ({ex.hubs[i].name})" if i < len(hubs) else n
            ev.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": label}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": i, "args": {"sort_index": i}})
        # GPU -> host clock per hub: the smallest (seen - gpu end) over its segments (seeing is
        # always late)
        offs: list[list[float]] = [[] for _ in tss]
        for s in sch.segments:
            seen = self._seen.get(("seg", s.index))
            if seen is not None:
                offs[s.hub].append(seen - tss[s.hub][ex._ts_base[s.index] + len(s.ops)])
        off = [min(o) if o else self._t0 - t[0] for o, t in zip(offs, tss)]
        seg_end: dict[int, float] = {}

        def us(host_ns: float) -> float:
            return (host_ns - self._t0) / 1000.0

        for s in sch.segments:
            base, ts, o = ex._ts_base[s.index], tss[s.hub], off[s.hub]
            seg_end[s.index] = ts[base + len(s.ops)] + o
            for k, op in enumerate(s.ops):
                a, b = ts[base + k] + o, ts[base + k + 1] + o
                ev.append({"ph": "X", "name": op.name, "cat": op.kind, "pid": 1, "tid": s.hub,
                           "ts": us(a), "dur": max(0.0, (b - a) / 1000.0),
                           "args": {"segment": s.index, **({"rows": [op.r0, op.r1]} if op.kind == "rows" else {})}})
            if not s.ops:
                ev.append({"ph": "i", "name": f"join#{s.index}", "pid": 1, "tid": s.hub, "s": "t",
                           "ts": us(seg_end[s.index])})
        free: dict[str, float] = {}
        for kind, i in sch.order:
            if kind != "job":
                continue
            jb = sch.jobs[i]
            end = self._seen.get(("job", i))
            if end is None:
                continue
            start = max(seg_end.get(jb.wait, self._t0), free.get(jb.op.backend, self._t0))
            start = min(start, end)
            free[jb.op.backend] = end
            op = jb.op
            args: dict[str, Any] = {"rows": [op.r0, op.r1], "waits_hub_segment": jb.wait}
            if isinstance(op, BackendOp):
                args.update(M=op.M, N=op.N, K=op.K, w_type=op.weight.dtype, x_type=op.x.dtype)
            ev.append({"ph": "X", "name": op.name, "cat": op.node.op, "pid": 1, "tid": tid[op.backend],
                       "ts": us(start), "dur": (end - start) / 1000.0, "args": args})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"plan": ex.plan.label, "T": ex.plan.T, "submits": self.submits,
                              "host_waits_in_step": self.host_waits}}

    def op_times(self) -> dict[int, float]:
        """Seconds per hub item (by ``id(item)``), from the trace's GPU timestamps."""
        ex = self.executor
        if ex._ts is None:
            raise VkxError("this executor was made without trace=True")
        self.wait()
        tss = [t.read() for t in ex._tss]
        out: dict[int, float] = {}
        for s in ex.schedule.segments:
            base, ts = ex._ts_base[s.index], tss[s.hub]
            for k, op in enumerate(s.ops):
                out[id(op)] = max(0.0, (ts[base + k + 1] - ts[base + k]) * 1e-9)
        return out


__all__ = ["Executor", "Step", "record_graph"]
