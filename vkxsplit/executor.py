"""The executor: runs a plan's step as hub segments and backend jobs, submitted in one go.

Reading order:

1. A plan (:mod:`vkxsplit.plan`) lowers its graph to a list of *items* in execution order:
   :class:`HubOp` (a graph node on the hub, the hub's rows of a split ``mul_mat``, or an
   inserted f32 -> bf16 conversion) and :class:`BackendOp` (a ``mul_mat`` or a row range of
   one, for an attached backend).
2. :func:`build_schedule` cuts the hub items into *segments* at backend boundaries, from the
   bytes each item reads and writes (:func:`vkxsplit.graph.span`): a backend job waits for the
   hub segment that last touched its inputs or outputs; a hub item that touches what a pending
   job reads or writes starts a new segment that waits for that job's point. Parts of one
   split ``mul_mat`` write disjoint columns of one ``y`` and do not wait for each other, so
   the hub computes its rows while the backends compute theirs. A backend runs its jobs in
   submission order (the host bridge and a CUDA stream do), so only jobs of *other* backends
   create waits between jobs (through an empty "join" segment).
3. :class:`Executor` records each segment once into a :class:`~vkxsplit.vk.command.Sequence`
   and builds each :class:`~vkxsplit.backend.MatMulJob` once. :meth:`Executor.step` then
   submits the whole step up front: ``Sequence.submit(waits=[backend points])`` for segments,
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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import attach as _attach
from .errors import KernelError, VkxError
from .graph import Graph, Node, Span, Tensor, any_overlap, span
from .vk.command import Sequence, Timestamps, hub_timeline
from .vk.event import default_timeout

if TYPE_CHECKING:
    from .backend import Backend, MatMulJob, OpJob
    from .plan import Plan
    from .vk.device import Device


# ---------------------------------------------------------------------------------------------
# hub recorders of graph nodes


def _mul_mat(seq: Sequence, n: Node, r0: int = 0, r1: int | None = None, y: Tensor | None = None) -> None:
    """Output rows ``[r0, r1)`` of a ``mul_mat`` node (all by default) into y's columns
    ``[r0, r1)`` (y: the node's output, or a staging shadow of it). A node with an ``xq``
    param reads x as q8_1, written earlier by the node that made x or a ``quantize_q8_1``
    node (:class:`vkxsplit.model.DecodeQ8`): only the integer-dot-product kernel
    ``params["vecq"]`` is recorded."""
    from .ops.mul_mat import record_mul_mat, record_mul_mat_vecq

    w, x = n.inputs
    y = n.output if y is None else y
    N = w.shape[0]
    r1 = N if r1 is None else r1
    xq = n.params.get("xq")
    if xq is not None:
        record_mul_mat_vecq(seq, w.buffer, w.dtype, x.buffer, xq.buffer, y.buffer, M=x.rows, N=r1 - r0,
                            K=w.shape[-1], w_row_offset=r0, y_col_offset=r0, y_stride=N,
                            variant=n.params["vecq"], quantize=False)
    else:
        record_mul_mat(seq, w.buffer, w.dtype, x.buffer, y.buffer, M=x.rows, N=r1 - r0, K=w.shape[-1],
                       w_row_offset=r0, y_col_offset=r0, y_stride=N)


def _quantize_q8_1(seq: Sequence, n: Node) -> None:
    """x (f32 rows) -> the q8_1 scratch the following integer-dot-product mat-vecs read."""
    from .ops.mul_mat import record_quantize_q8_1

    (x,) = n.inputs
    record_quantize_q8_1(seq, x.buffer, n.output.buffer, x.rows, x.cols, x.cols, 0)


def _get_rows(seq: Sequence, n: Node) -> None:
    from .ops.get_rows import record_get_rows

    w, ids = n.inputs
    record_get_rows(seq, w.buffer, w.dtype, ids.buffer, n.output.buffer, ids.shape[0], w.shape[-1])


def _rms_norm(seq: Sequence, n: Node) -> None:
    from .ops.norm import record_rms_norm

    x, w = n.inputs
    xq = n.params.get("xq")  # the output also as q8_1 for the mat-vecs that read it
    record_rms_norm(seq, x.buffer, n.output.buffer, x.rows, x.cols, n.params["eps"], w.buffer,
                    xq=None if xq is None else xq.buffer)


def _add_rms_norm(seq: Sequence, n: Node) -> None:
    from .ops.norm import record_add_rms_norm

    x, r, w = n.inputs  # x += r in place, then output = rms_norm(x) * w
    xq = n.params.get("xq")
    record_add_rms_norm(seq, x.buffer, r.buffer, w.buffer, n.output.buffer, x.rows, x.cols, n.params["eps"],
                        xq=None if xq is None else xq.buffer)


def _add(seq: Sequence, n: Node) -> None:
    from .ops.elementwise import record_add

    a, b = n.inputs
    record_add(seq, a.buffer, b.buffer, n.output.buffer, a.rows, a.cols, b_rows=b.rows if len(b.shape) > 1 else 1)


def _swiglu(seq: Sequence, n: Node) -> None:
    from .ops.elementwise import record_swiglu

    g, u = n.inputs
    xq = n.params.get("xq")
    if xq is not None:  # the output also as q8_1 for the mat-vec that reads it (ffn_down)
        from .ops.mul_mat import record_swiglu_q8_1

        record_swiglu_q8_1(seq, g.buffer, u.buffer, n.output.buffer, xq.buffer, g.rows, g.cols)
        return
    record_swiglu(seq, g.buffer, u.buffer, n.output.buffer, g.rows, g.cols)


def _rope(seq: Sequence, n: Node) -> None:
    from .ops.rope import record_rope

    x, pos = n.inputs
    p = n.params
    record_rope(seq, x.buffer, pos.buffer, n.output.buffer, x.rows, p["n_heads"], p["head_dim"],
                n_dims=p["n_dims"], mode="neox" if p["mode"] == "neox" else "normal",
                freq_base=p["freq_base"], freq_scale=p["freq_scale"])


def _kv_store(seq: Sequence, n: Node) -> None:
    from .ops.attention import record_kv_store

    k, v, pos = n.inputs
    p = n.params
    rope = p.get("rope_k")
    if rope is not None:
        rope = dict(rope, mode="neox" if rope["mode"] == "neox" else "normal")
    record_kv_store(seq, k.buffer, v.buffer, pos.buffer, n.output.buffer, p["cache_v"].buffer, k.rows,
                    p["n_kv_heads"], p["head_dim"], n.output.shape[0], rope=rope)


def _attention(seq: Sequence, n: Node) -> None:
    from .ops.attention import record_attention

    q, ck, cv, pos = n.inputs
    p = n.params
    scratch = p.get("scratch")
    record_attention(seq, q.buffer, ck.buffer, cv.buffer, pos.buffer, n.output.buffer, q.rows, p["n_heads"],
                     p["n_kv_heads"], p["head_dim"], p["n_ctx"], n_splits=p.get("n_splits", 1),
                     scratch=scratch.buffer if scratch is not None else None)


def _cpy(seq: Sequence, n: Node) -> None:
    """An f32 tensor copied as is (a pipeline stage's hidden state into or out of the host
    pages it shares with the next GPU: :mod:`vkxsplit.pipeline`)."""
    from .ops.copy import record_copy

    (src,) = n.inputs
    if src.dtype != n.output.dtype or src.shape != n.output.shape:
        raise KernelError(f"cpy {n.name}: {src.dtype}{list(src.shape)} -> {n.output.dtype}{list(n.output.shape)} "
                          "is not a plain copy")
    record_copy(seq, src.buffer, n.output.buffer, src.rows * src.cols * 4)


def _link_sum(seq: Sequence, n: Node) -> None:
    """A tensor-split shard's partial plus the other shard's, read from the host pages it
    published to (:mod:`vkxsplit.tensor_split`): ``out = a + peer``."""
    from .ops.link import record_link_sum

    a, peer = n.inputs
    if (a.shape != peer.shape or a.shape != n.output.shape or a.dtype != peer.dtype
            or a.dtype not in ("f32", "f16") or n.output.dtype != "f32"):
        raise KernelError(f"link_sum {n.name}: {a.dtype}{list(a.shape)} + {peer.dtype}{list(peer.shape)} -> "
                          f"{n.output.dtype}{list(n.output.shape)} is not a sum of equal shapes into f32")
    record_link_sum(seq, a.buffer, peer.buffer, n.output.buffer, a.rows * a.cols, parts=a.dtype)


def _convert(seq: Sequence, n: Node) -> None:
    """An f32/f16/bf16 tensor converted elementwise into another of those (a tensor-split
    shard's partial sums published in f16)."""
    from .ops.convert import record_convert

    (src,) = n.inputs
    if src.shape != n.output.shape:
        raise KernelError(f"convert {n.name}: {list(src.shape)} -> {list(n.output.shape)}")
    record_convert(seq, src.buffer, n.output.buffer, src.rows * src.cols, src.dtype, n.output.dtype)


def _argmax(seq: Sequence, n: Node) -> None:
    from .ops.argmax import record_argmax

    (x,) = n.inputs
    record_argmax(seq, x.buffer, n.output.buffer, x.rows, x.cols)


HUB_OPS: dict[str, Callable[[Sequence, Node], None]] = {
    "mul_mat": _mul_mat,
    "quantize_q8_1": _quantize_q8_1,
    "get_rows": _get_rows,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "add": _add,
    "swiglu": _swiglu,
    "rope": _rope,
    "kv_store": _kv_store,
    "attention": _attention,
    "argmax": _argmax,
    "cpy": _cpy,
    "link_sum": _link_sum,
    "convert": _convert,
}


def record_graph(seq: Sequence, graph: Graph, ops: dict[str, Any] | None = None) -> None:
    """Record every node of ``graph`` on the hub, in order, into one sequence."""
    table = ops or HUB_OPS
    for node in graph.nodes:
        fn = table.get(node.op)
        if fn is None:
            raise KernelError(f"graph {graph.name}: no hub kernel for op {node.op} (node {node.name})")
        fn(seq, node)


# ---------------------------------------------------------------------------------------------
# lowered items


@dataclass(eq=False)
class HubOp:
    """One hub command: ``kind`` is ``node`` (a graph node), ``rows`` (output rows
    ``[r0, r1)`` of a split ``mul_mat``, written into y's columns ``[r0, r1)``, or into
    ``dst`` when set: the arena shadow of y for a backend that stages activations) or
    ``convert`` (``src`` -> ``dst`` element type, e.g. x f32 -> bf16 for a bf16 backend, or an
    f32 copy between an activation and its shadow)."""

    kind: str
    name: str
    reads: list[Tensor]
    writes: list[Tensor]
    node: Node | None = None
    r0: int = 0
    r1: int = 0
    group: int | None = None  # parts of one split mul_mat share a group: disjoint y columns
    src: Tensor | None = None
    dst: Tensor | None = None

    participant = "hub"

    def record(self, seq: Sequence) -> None:
        if self.kind == "node":
            assert self.node is not None
            fn = HUB_OPS.get(self.node.op)
            if fn is None:
                raise KernelError(f"no hub kernel for op {self.node.op} (node {self.node.name})")
            fn(seq, self.node)
        elif self.kind == "rows":
            assert self.node is not None
            _mul_mat(seq, self.node, self.r0, self.r1, self.dst)  # dst: a staging shadow of y
        elif self.kind == "convert":
            from .ops.convert import record_convert

            assert self.src is not None and self.dst is not None
            record_convert(seq, self.src.buffer, self.dst.buffer, self.src.rows * self.src.cols,
                           self.src.dtype, self.dst.dtype)
        else:
            raise VkxError(f"unknown hub item kind {self.kind!r}")

    def __repr__(self) -> str:
        rows = f" rows {self.r0}:{self.r1}" if self.kind == "rows" else ""
        return f"HubOp({self.kind} {self.name}{rows})"


@dataclass(eq=False)
class BackendOp:
    """A ``mul_mat`` (output rows ``[r0, r1)``) for the attached backend ``backend``:
    ``weight`` is the model's weight tensor itself (read in place, ``w_row0 = 0``) or its
    slice converted once at load to a type the backend reads (``w_row0 = r0``); ``x`` is the
    f32 activation or its per-step bf16/f16 shadow; ``y`` is the node's output."""

    backend: str
    name: str
    node: Node
    weight: Tensor
    w_row0: int
    x: Tensor
    y: Tensor
    r0: int
    r1: int
    group: int | None = None
    converted_weight: bool = False

    participant_kind = "backend"

    @property
    def participant(self) -> str:
        return self.backend

    @property
    def reads(self) -> list[Tensor]:
        return [self.weight, self.x]

    @property
    def writes(self) -> list[Tensor]:
        return [self.y]

    @property
    def N(self) -> int:
        return self.node.inputs[0].shape[0]

    @property
    def K(self) -> int:
        return self.node.inputs[0].shape[-1]

    @property
    def M(self) -> int:
        return self.x.rows

    def job(self) -> MatMulJob:
        from .backend import MatMulJob

        host = None if self.weight.shared or self.converted_weight else self.weight.host
        return MatMulJob(self.weight.buffer, self.weight.dtype, self.x.buffer, self.y.buffer,  # type: ignore[arg-type]
                         self.M, self.N, self.K, x_type=self.x.dtype, r0=self.r0, r1=self.r1,
                         w_row0=self.w_row0, name=self.name, weight_host=host)

    def __repr__(self) -> str:
        return f"BackendOp({self.backend} {self.name} rows {self.r0}:{self.r1})"


@dataclass(eq=False)
class BackendNodeOp:
    """One of the small ops (:data:`vkxsplit.backend.NODE_OPS`: norms, SwiGLU, residual add)
    on the attached backend ``backend`` (its ``run_op``), so that a backend taking a layer's
    matmuls also takes the glue between them and the step crosses between it and the hub
    less often. Rows ``r0:r1`` are always the whole output (no row split)."""

    backend: str
    name: str
    node: Node
    group: int | None = None

    participant_kind = "backend"

    @property
    def participant(self) -> str:
        return self.backend

    @property
    def reads(self) -> list[Tensor]:
        return self.node.reads()

    @property
    def writes(self) -> list[Tensor]:
        return self.node.writes()

    @property
    def r0(self) -> int:
        return 0

    @property
    def r1(self) -> int:
        return self.node.output.rows

    def job(self) -> OpJob:
        from .backend import OpJob

        n = self.node
        ins = n.inputs
        rows, cols = ins[0].rows, ins[0].cols
        if n.op == "add_rms_norm":
            outs = (n.output.buffer, ins[0].buffer)
        else:
            outs = (n.output.buffer,)
        b_rows = ins[1].rows if n.op == "add" and len(ins[1].shape) > 1 else (1 if n.op == "add" else rows)
        return OpJob(n.op, tuple(t.buffer for t in ins), outs, rows, cols,  # type: ignore[arg-type]
                     eps=float(n.params.get("eps", 0.0)), b_rows=b_rows, name=self.name)

    def __repr__(self) -> str:
        return f"BackendNodeOp({self.backend} {self.name} {self.node.op})"


Item = HubOp | BackendOp | BackendNodeOp


# ---------------------------------------------------------------------------------------------
# schedule


@dataclass
class Segment:
    """Hub items submitted together; waits for the backend jobs ``waits`` (job indices,
    the latest of each backend) and signals the next value of the hub timeline."""

    index: int
    ops: list[HubOp] = field(default_factory=list)
    waits: list[int] = field(default_factory=list)


@dataclass
class Job:
    """A backend op; starts after hub segment ``wait`` and signals its backend's timeline."""

    index: int
    op: BackendOp | BackendNodeOp
    wait: int


@dataclass
class Schedule:
    segments: list[Segment]
    jobs: list[Job]
    order: list[tuple[str, int]]  # ("seg", i) / ("job", j): the order of submission
    trailing: list[int]           # jobs no segment waits for: the caller collects them

    @property
    def submits(self) -> int:
        return len(self.segments)

    def points(self) -> list[str]:
        """The timeline points between participants, in submission order, as text."""
        out = []
        for kind, i in self.order:
            if kind == "seg":
                s = self.segments[i]
                w = ", ".join(f"{self.jobs[j].op.backend}#{j}" for j in s.waits)
                first = s.ops[0].name if s.ops else "(join)"
                out.append(f"hub#{i} [{first} .. {len(s.ops)} ops]" + (f" waits {w}" if w else ""))
            else:
                jb = self.jobs[i]
                out.append(f"{jb.op.backend}#{i} [{jb.op.name} rows {jb.op.r0}:{jb.op.r1}] waits hub#{jb.wait}")
        return out


def _spans(ts: Iterable[Tensor]) -> list[Span]:
    return [span(t) for t in ts]


def _conflict(ar: list[Span], aw: list[Span], br: list[Span], bw: list[Span]) -> bool:
    return any_overlap(aw, br) or any_overlap(aw, bw) or any_overlap(ar, bw)


def build_schedule(items: list[Item]) -> Schedule:
    """Cut ``items`` into hub segments and backend jobs (see the module docstring).

    The first event is always a segment (it carries the waits for the previous step's
    unfinished jobs), and every job waits for some segment."""
    segments: list[Segment] = []
    jobs: list[Job] = []
    order: list[tuple[str, int]] = []
    job_rw: list[tuple[list[Span], list[Span]]] = []
    hub_hist: list[tuple[int, list[Span], list[Span]]] = []  # (segment, reads, writes)
    pending: list[int] = []
    cur: Segment | None = None

    def new_segment() -> Segment:
        s = Segment(len(segments))
        segments.append(s)
        return s

    def close() -> None:
        nonlocal cur
        if cur is not None:
            order.append(("seg", cur.index))
            cur = None

    def wait_for(seg: Segment, confl: list[int]) -> None:
        """Make ``seg`` wait for the jobs ``confl`` and drop what that covers from ``pending``.
        It waits for the latest pending job of each backend concerned (a backend runs its jobs
        in order, and the hub needs the others soon: one wait instead of one segment each)."""
        latest: dict[str, int] = {}
        for j in confl:
            latest[jobs[j].op.backend] = -1
        for j in pending:
            b = jobs[j].op.backend
            if b in latest:
                latest[b] = max(latest[b], j)
        for j in list(seg.waits):
            b = jobs[j].op.backend
            latest[b] = max(latest.get(b, -1), j)
        seg.waits = sorted(latest.values())
        for j in list(pending):
            b = jobs[j].op.backend
            if b in latest and j <= latest[b]:
                pending.remove(j)
                # from now on the job's effects are ordered like this segment's: a later job
                # that depends on them waits for this segment
                hub_hist.append((seg.index, *job_rw[j]))

    for it in items:
        r, w = _spans(it.reads), _spans(it.writes)
        if isinstance(it, HubOp):
            confl = [j for j in pending
                     if not (it.group is not None and jobs[j].op.group == it.group)
                     and _conflict(r, w, *job_rw[j])]
            if confl:
                if cur is not None and cur.ops:
                    close()
                if cur is None:
                    cur = new_segment()
                wait_for(cur, confl)
            if cur is None:
                cur = new_segment()
            cur.ops.append(it)
            hub_hist.append((cur.index, r, w))
            continue
        # a backend job
        if not segments:
            cur = new_segment()  # the step's first submit (carries the previous step's waits)
        confl = [j for j in pending if jobs[j].op.backend != it.backend
                 and not (it.group is not None and jobs[j].op.group == it.group)
                 and _conflict(r, w, *job_rw[j])]
        if confl:  # depends on another backend's job: join through the hub
            if cur is not None and cur.ops:
                close()
            if cur is None:
                cur = new_segment()
            wait_for(cur, confl)
            dep = cur.index
            close()
        else:
            dep = 0
            for seg_i, hr, hw in reversed(hub_hist):
                if _conflict(r, w, hr, hw):
                    dep = seg_i
                    break
            if cur is not None and dep == cur.index:
                close()
        jobs.append(Job(len(jobs), it, dep))
        job_rw.append((r, w))
        order.append(("job", len(jobs) - 1))
        pending.append(len(jobs) - 1)
    if cur is None and not segments:
        cur = new_segment()
    close()
    return Schedule(segments, jobs, order, list(pending))


# ---------------------------------------------------------------------------------------------
# running


class Executor:
    """Runs one plan step after step: segments recorded once, jobs built once, every step
    submitted up front (see the module docstring)."""

    def __init__(self, device: Device, plan: Plan, backends: Mapping[str, Backend] | Iterable[Backend] = (),
                 *, trace: bool = False, name: str | None = None) -> None:
        self.device = device
        self.plan = plan
        self.schedule = plan.schedule
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
        self._ts: Timestamps | None = None
        self._ts_base: list[int] = []
        self._last: Step | None = None
        try:
            if trace:
                n = sum(len(s.ops) + 1 for s in self.schedule.segments)
                self._ts = Timestamps(device, max(1, n))
            k = 0
            for seg in self.schedule.segments:
                seq = Sequence(device, f"{self.name}#{seg.index}")
                self._seqs.append(seq)
                self._ts_base.append(k)
                if self._ts is not None:
                    seq.write_timestamp(self._ts, k)
                    k += 1
                for op in seg.ops:
                    op.record(seq)
                    if self._ts is not None:
                        seq.write_timestamp(self._ts, k)
                        k += 1
                seq.end()
                self.recordings += 1
            self._jobs = [j.op.job() for j in self.schedule.jobs]
            self._last_seg = max((i for k, i in self.schedule.order if k == "seg"), default=-1)
            self._hub_only = not self._jobs and self._ts is None
        except BaseException:
            self.close()
            raise

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
        if self._hub_only:  # split none: one submit per segment and nothing else (the hub path)
            _attach.stats.begin_step()
            vals = [seq.submit(waits=extra) if i == 0 else seq.submit() for i, seq in enumerate(seqs)]
            step = Step(self, vals, [], 0)
            step.submits = len(vals)
            if self.steps == 0:
                step.recordings = self.recordings
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
            else:
                jb = sch.jobs[i]
                b = self.backends[jb.op.backend]
                p = b.next_point()
                job_pts[i] = p
                job = self._jobs[i]
                if isinstance(jb.op, BackendNodeOp):
                    b.run_op(job.op, job, (tl, seg_vals[jb.wait]), p)
                else:
                    b.mul_mat(job, (tl, seg_vals[jb.wait]), p)
        step.host_waits = stats.host_waits_in_step
        if self.steps == 0:
            step.recordings = self.recordings
        self.steps += 1
        if self._ts is not None:
            step._start_watch()
        return step

    def run(self, timeout: float | None = None) -> Step:
        """Submit one step and wait for all of it."""
        s = self.step()
        s.wait(timeout)
        return s

    def close(self) -> None:
        if self._last is not None:
            try:
                self._last.wait()
            except Exception:  # closing: the error was (or will be) reported by its step
                pass
            self._last = None
        for s in self._seqs:
            s.wait()
            s.close()
        self._seqs.clear()
        if self._ts is not None:
            self._ts.close()
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
        pts: list[Any] = []
        if ex._last_seg >= 0 and self.seg_values[ex._last_seg]:
            pts.append((ex.timeline, self.seg_values[ex._last_seg]))
        if self.job_points:
            pts += [self.job_points[j] for j in ex.schedule.trailing if self.job_points[j] is not None]
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
        sch = self.executor.schedule
        out = []
        for j in sch.trailing:
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
        pts = self._final_points() if outputs is None else self._writer_points(outputs)
        for p in pts:
            host_wait(p, timeout)
        if outputs is None:
            self.done = True
            if self.job_points:
                self.staged_bytes = _attach.stats.staged_bytes - self._staged0
            if self._watch is not None:
                self._watch.join(timeout)
        for b in self.executor.backends.values():
            b.check()

    # -- tracing ----------------------------------------------------------------------------

    def _start_watch(self) -> None:
        sch = self.executor.schedule
        tl = self.executor.timeline
        pts: list[tuple[tuple[str, int], Any, int]] = []
        for kind, i in sch.order:
            if kind == "seg":
                pts.append((("seg", i), tl, self.seg_values[i]))
            else:
                p = self.job_points[i]
                pts.append((("job", i), p[0], p[1]))
        deadline = time.monotonic() + default_timeout()

        def watch() -> None:
            left = list(pts)
            while left and time.monotonic() < deadline and not self._stop:
                now = time.perf_counter_ns()
                cache: dict[int, int] = {}
                keep = []
                for key, t, v in left:
                    cur = cache.get(id(t))
                    if cur is None:
                        try:
                            cur = cache[id(t)] = t.value
                        except VkxError:
                            return
                    if cur >= v:
                        self._seen[key] = now
                    else:
                        keep.append((key, t, v))
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
        ts = ex._ts.read()
        tracks = ["hub"] + sorted(ex.backends)
        tid = {n: i for i, n in enumerate(tracks)}
        ev: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": ex.name}}]
        for n, i in tid.items():
            label = f"{n} ({ex.device.name})" if n == "hub" else n
            ev.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": label}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": i, "args": {"sort_index": i}})
        # GPU -> host clock: the smallest (seen - gpu end) over segments (seeing is always late)
        offs = []
        for s in sch.segments:
            seen = self._seen.get(("seg", s.index))
            if seen is not None:
                offs.append(seen - ts[ex._ts_base[s.index] + len(s.ops)])
        off = min(offs) if offs else self._t0 - ts[0]
        seg_end: dict[int, float] = {}

        def us(host_ns: float) -> float:
            return (host_ns - self._t0) / 1000.0

        for s in sch.segments:
            base = ex._ts_base[s.index]
            seg_end[s.index] = ts[base + len(s.ops)] + off
            for k, op in enumerate(s.ops):
                a, b = ts[base + k] + off, ts[base + k + 1] + off
                ev.append({"ph": "X", "name": op.name, "cat": op.kind, "pid": 1, "tid": tid["hub"],
                           "ts": us(a), "dur": max(0.0, (b - a) / 1000.0),
                           "args": {"segment": s.index, **({"rows": [op.r0, op.r1]} if op.kind == "rows" else {})}})
            if not s.ops:
                ev.append({"ph": "i", "name": f"join#{s.index}", "pid": 1, "tid": tid["hub"], "s": "t",
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
        ts = ex._ts.read()
        out: dict[int, float] = {}
        for s in ex.schedule.segments:
            base = ex._ts_base[s.index]
            for k, op in enumerate(s.ops):
                out[id(op)] = max(0.0, (ts[base + k + 1] - ts[base + k]) * 1e-9)
        return out


__all__ = ["BackendNodeOp", "BackendOp", "Executor", "HUB_OPS", "HubOp", "Item", "Job", "Schedule", "Segment", "Step",
           "build_schedule", "record_graph"]
