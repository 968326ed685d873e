"""A plan lowered: the items of one step in execution order, and the schedule cut from them.

A plan (:func:`vkxsplit.plan.lowering.lower`) lowers its graph to a list of *items*:
:class:`HubOp` (a graph node on the hub, the hub's rows of a split ``mul_mat`` /
``mul_mat_id``, or an inserted f32 -> bf16 conversion), :class:`BackendOp` (a ``mul_mat`` or a
row range of one, for an attached backend), :class:`BackendIdOp` (the same for a routed expert
product ``mul_mat_id``: the backend's ``mul_mat_id`` hook) and :class:`BackendNodeOp` (a small
op on a backend's ``run_op``).

:func:`build_schedule` (pure: no Vulkan) cuts the hub items into *segments* at backend
boundaries, from the bytes each item reads and writes (:func:`vkxsplit.graph.span`): a backend
job waits for the hub segment that last touched its inputs or outputs; a hub item that touches
what a pending job reads or writes starts a new segment that waits for that job's point. Parts
of one split ``mul_mat`` write disjoint columns of one ``y`` and do not wait for each other, so
the hub computes its rows while the backends compute theirs. A backend runs its jobs in
submission order (the host bridge and a CUDA stream do), so only jobs of *other* backends
create waits between jobs (through an empty "join" segment). The executor
(:mod:`vkxsplit.executor`) records the segments and builds the jobs.

Imports: ``vkxsplit.graph`` only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..graph import Node, Span, Tensor, any_overlap, span


@dataclass(eq=False)
class HubOp:
    """One hub command: ``kind`` is ``node`` (a graph node), ``rows`` (output rows
    ``[r0, r1)`` of a split ``mul_mat``, written into y's columns ``[r0, r1)``) or
    ``convert`` (``src`` -> ``dst`` element type, e.g. x f32 -> bf16 for a bf16 backend)."""

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
    hub: int = 0  # which Vulkan hub records it (a model over several hubs)

    participant = "hub"

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

    def __repr__(self) -> str:
        return f"BackendOp({self.backend} {self.name} rows {self.r0}:{self.r1})"


@dataclass(eq=False)
class BackendIdOp:
    """A routed expert product ``mul_mat_id`` (output rows ``[r0, r1)`` of every expert) for
    the attached backend ``backend``, whose ``mul_mat_id`` hook runs it as a
    :class:`vkxsplit.backend.MatMulIdJob` built from these fields: ``weight`` the stored
    ``(n_expert, N, K)`` tensor (read in place: the hub converts no expert tensors), ``x`` the
    ``(M, n_xb, K)`` activation (or its bf16/f16 shadow), ``ids`` the ``(M, n_used)`` int32
    expert ids, ``y`` the ``(M, n_used, N)`` output. Not a :class:`BackendOp`, and without its
    ``w_row0``: code that builds a ``mul_mat`` job from it fails instead of computing something
    else."""

    backend: str
    name: str
    node: Node
    weight: Tensor
    x: Tensor
    y: Tensor
    r0: int
    r1: int
    group: int | None = None

    participant_kind = "backend"

    @property
    def participant(self) -> str:
        return self.backend

    @property
    def ids(self) -> Tensor:
        return self.node.inputs[2]

    @property
    def reads(self) -> list[Tensor]:
        return [self.weight, self.x, self.ids]

    @property
    def writes(self) -> list[Tensor]:
        return [self.y]

    @property
    def n_expert(self) -> int:
        return self.node.inputs[0].shape[0]

    @property
    def N(self) -> int:
        """Rows of each expert's matrix."""
        return self.node.inputs[0].shape[-2]

    @property
    def K(self) -> int:
        return self.node.inputs[0].shape[-1]

    @property
    def M(self) -> int:
        """Tokens."""
        return self.ids.shape[0]

    @property
    def n_used(self) -> int:
        return self.ids.shape[1]

    @property
    def n_xb(self) -> int:
        return self.node.inputs[1].shape[1]

    def mul_mat_shape(self) -> tuple[int, int, int]:
        """``(N, K, M)`` of the ``mul_mat`` whose cost stands for this product's (the cost model,
        calibration): the rows of the experts it can touch (at most min(n_expert, M n_used),
        each read once) and the tokens per touched expert, so that both the weight bytes and
        the flops (2 M n_used N K) come out right."""
        touched = max(1, min(self.n_expert, self.M * self.n_used))
        return self.N * touched, self.K, max(1, -(-self.M * self.n_used // touched))

    def __repr__(self) -> str:
        return f"BackendIdOp({self.backend} {self.name} rows {self.r0}:{self.r1})"


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
        # not the q8_1 x a hub norm / SwiGLU would also write (``xq``): the backend never
        # touches it (the planner moves such a node only when no hub mat-vec reads that x)
        xq = self.node.params.get("xq")
        return [t for t in self.node.reads() if t is not xq]

    @property
    def writes(self) -> list[Tensor]:
        return self.node.writes()

    @property
    def r0(self) -> int:
        return 0

    @property
    def r1(self) -> int:
        return self.node.output.rows

    def __repr__(self) -> str:
        return f"BackendNodeOp({self.backend} {self.name} {self.node.op})"


Item = HubOp | BackendOp | BackendIdOp | BackendNodeOp


# ---------------------------------------------------------------------------------------------
# schedule


@dataclass
class Segment:
    """Hub items submitted together; waits for the backend jobs ``waits`` (job indices,
    the latest of each backend) and signals the next value of the hub timeline."""

    index: int
    ops: list[HubOp] = field(default_factory=list)
    waits: list[int] = field(default_factory=list)
    hub: int = 0  # the hub whose queue runs it
    hub_waits: list[int] = field(default_factory=list)  # segments of other hubs it waits for (the relay)


@dataclass
class Job:
    """A backend op; starts after hub segment ``wait`` and signals its backend's timeline."""

    index: int
    op: BackendOp | BackendIdOp | BackendNodeOp
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

    @property
    def hubs(self) -> int:
        """How many Vulkan hubs the schedule's segments run on."""
        return 1 + max((s.hub for s in self.segments), default=0)

    def cross_waits(self) -> list[tuple[int, int]]:
        """``(source segment, destination segment)`` of every cross-hub dependency."""
        return [(j, s.index) for s in self.segments for j in s.hub_waits]

    def points(self) -> list[str]:
        """The timeline points between participants, in submission order, as text."""
        out = []
        for kind, i in self.order:
            if kind == "seg":
                s = self.segments[i]
                w = ", ".join([f"{self.jobs[j].op.backend}#{j}" for j in s.waits]
                              + [f"hub{self.segments[j].hub}#{j}" for j in s.hub_waits])
                first = s.ops[0].name if s.ops else "(join)"
                who = f"hub{s.hub}" if self.hubs > 1 else "hub"
                out.append(f"{who}#{i} [{first} .. {len(s.ops)} ops]" + (f" waits {w}" if w else ""))
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
    unfinished jobs), and every job waits for some segment. Items of several hubs (a model
    over several GPUs, no backends): :func:`_hub_schedule`."""
    if any(isinstance(it, HubOp) and it.hub for it in items):
        return _hub_schedule(items)
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


def _hub_schedule(items: list[Item]) -> Schedule:
    """Items of several hubs (all :class:`HubOp`) cut into segments, one hub each: a new segment
    starts where the hub changes, or where an item touches bytes a segment of another hub
    touched (only host pages several hubs import are memory of two hubs: their imports share one
    span key) that this hub has not waited for yet; the segment then waits for the latest such
    segment of each other hub (``hub_waits``). A hub's own segments run in queue order."""
    segments: list[Segment] = []
    order: list[tuple[str, int]] = []
    # per memory key: the accesses (segment, hub, start, end, write) of keys two hubs touch;
    # keys = every key seen, with the hubs that touched it
    touch: dict[object, list[tuple[int, int, int, int, bool]]] = {}
    hubs_of: dict[object, set[int]] = {}
    covered: dict[tuple[int, int], int] = {}  # (hub, other hub) -> latest segment of other waited for
    cur: Segment | None = None
    for it in items:
        if not isinstance(it, HubOp):
            raise ValueError("a schedule over several hubs takes hub items only (no attached backends)")
        h = it.hub
        acc = [(s, False) for s in _spans(it.reads)] + [(s, True) for s in _spans(it.writes)]
        deps: dict[int, int] = {}
        for (key, a, b), wr in acc:
            hubs_of.setdefault(key, set()).add(h)
            if len(hubs_of[key]) < 2:
                continue
            for seg_i, hh, a2, b2, wr2 in touch.get(key, ()):
                if hh != h and (wr or wr2) and a < b2 and a2 < b:
                    deps[hh] = max(deps.get(hh, -1), seg_i)
        need = {g: s for g, s in deps.items() if s > covered.get((h, g), -1)}
        if cur is not None and (cur.hub != h or (need and cur.ops)):
            order.append(("seg", cur.index))
            cur = None
        if cur is None:
            cur = Segment(len(segments), hub=h)
            segments.append(cur)
        for g, s in need.items():
            covered[(h, g)] = s
            cur.hub_waits.append(s)
        cur.hub_waits.sort()
        cur.ops.append(it)
        for (key, a, b), wr in acc:
            touch.setdefault(key, []).append((cur.index, h, a, b, wr))
    if cur is None:
        cur = Segment(0)
        segments.append(cur)
    order.append(("seg", cur.index))
    return Schedule(segments, [], order, [])


__all__ = ["BackendIdOp", "BackendNodeOp", "BackendOp", "HubOp", "Item", "Job", "Schedule", "Segment", "build_schedule"]
