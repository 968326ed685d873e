"""The cost model: seconds of each op on each participant, from the device profile, and the
predicted step time of a schedule (:func:`simulate`).

:class:`CostModel` only reads its :class:`~vkxsplit.plan.profile.Profile`; what the profile
lacks it estimates from :data:`DEFAULTS` and the backends' ``calibrate()`` rates (and says so
in ``estimated``). Measuring what is missing, by running the hub and the backends, is
:class:`vkxsplit.calibrate.MeasuringCostModel`'s job (it sits above the executor).

Imports: ``vkxsplit.graph``, :mod:`.spec`, :mod:`.schedule`, :mod:`.workspace` (element sizes),
:mod:`.profile`; ``vkxsplit.ops.quant`` and ``vkxsplit.vk.api`` lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..graph import Graph, Node
from ..ops.quant import ELEM_BYTES as _ELEM
from ..ops.quant import row_bytes
from .profile import Profile
from .schedule import BackendIdOp, BackendNodeOp, BackendOp, HubOp, Schedule
from .spec import HUB

if TYPE_CHECKING:
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.plan")

#: Used where nothing was measured (dry planning without a profile).
DEFAULTS = {"hub_gflops": 100.0, "hub_gbs": 50.0, "backend_gflops": 10.0, "latency_s": 2e-4,
            "submit_s": 3e-5, "convert_ns_per_elem": 0.1, "enqueue_s": 2e-5,
            # one crossing between two hubs through the relay thread (GPU -> host -> GPU): the
            # round trip tools/bench_link.py measures (docs/MULTI_GPU.md)
            "relay_s": 1e-4,
            # the smallest partial sum (bytes as f32) the row split's all-reduce sends as bf16
            # until the calibration measured it (vkxsplit.calibrate.measure_reduce): above a
            # decode step's rows (latency-bound: llama8b's 16 KiB per token), below a prompt
            # step's (bandwidth-bound: 8 MiB at 512 tokens); an estimate, not a measurement
            "bf16_reduce_min_bytes": 64 << 10}

#: the profile entry (scope ``hub``) holding the measured all-reduce threshold
REDUCE_KEY = "reduce_bf16"


class CostModel:
    """Seconds per op for each participant, from a :class:`Profile`; missing entries are
    estimated from :data:`DEFAULTS` and the backends' ``calibrate()`` rates (then
    ``estimated`` says so). :class:`vkxsplit.calibrate.MeasuringCostModel` measures them on
    demand instead.

    Keys: hub nodes by :meth:`vkxsplit.graph.Node.signature`; backend ``mul_mat`` by (weight
    type handed to it, N, K, M); per-backend round-trip latency and enqueue time; the hub's
    submit overhead and conversion rate. ``device``: the hub (which hardware participants
    share: :meth:`resource`)."""

    def __init__(self, profile: Profile | None = None, *, device: Device | None = None,
                 backends: Iterable[Any] = ()) -> None:
        self.profile = profile or Profile()
        self.device = device
        self.backends = {b.name: b for b in backends}
        self.estimated: set[str] = set()
        self.measured = 0
        self._rates: dict[str, float] = {}
        #: hub lanes that share another hub's device (:meth:`hub_resource`)
        self.hub_groups: dict[str, str] = {}
        #: the profile key of the relay crossing between this model's hubs (``relay|<UUID of the
        #: other hub's device>``: one device twice and two GPUs cross differently)
        self.relay_key = "relay"

    # -- keys ---------------------------------------------------------------------------------

    def scope(self, name: str) -> str:
        if name == HUB:
            return "hub"
        b = self.backends.get(name)
        extra = []
        for attr in ("gflops",):
            if b is not None and isinstance(getattr(b, attr, None), (int, float)):
                extra.append(f"{attr}={getattr(b, attr):g}")
        # (a backend whose speed depends on the library build it loaded names it: the cpu
        # backend's ggml, libggml-python's or llama.cpp's)
        build = getattr(b, "build", None) if b is not None else None
        if isinstance(build, str) and build:
            extra.append(f"build={build}")
        return f"backend:{name}" + (f"({','.join(extra)})" if extra else "")

    def resource(self, name: str) -> str:
        """The hardware a participant computes on, for the simulation: participants on one
        resource do not overlap. cuda/hip run on the hub's own GPU (the backend requires the
        same device UUID); the cpu backend shares the cores of a CPU hub (lavapipe). A backend
        may say so itself with a ``shares_hub`` attribute."""
        if name == HUB:
            return HUB
        b = self.backends.get(name)
        explicit = getattr(b, "shares_hub", None)
        if isinstance(explicit, bool):
            return HUB if explicit else name
        if name in ("cuda", "hip"):
            return HUB
        if name == "cpu" and getattr(self.device, "is_cpu", False):
            return HUB
        return name

    def hub_resource(self, lane: str) -> str:
        """The hardware hub ``lane`` (``hub0``, ``hub1``, ...) of a model over several hubs
        computes on: its own, unless ``hub_groups`` maps it to another hub's (two hubs on one
        device, ``devices="0,0"``: their segments take the device in turn, as on one hub)."""
        return self.hub_groups.get(lane, lane)

    @staticmethod
    def job_key(w_type: str, N: int, K: int, M: int) -> str:
        return f"mul_mat|{w_type}|{N}x{K}|M={M}"

    # -- queries ------------------------------------------------------------------------------

    def submit(self) -> float:
        v = self.profile.get("hub", "submit")
        if v is None:
            self.estimated.add("hub submit")
            return DEFAULTS["submit_s"]
        return float(v)

    def relay(self) -> float:
        """Seconds from a hub's segment end to the start of another hub's segment waiting for it
        (the relay thread's crossing), measured between the hubs ``relay_key`` names
        (:func:`vkxsplit.calibrate.measure_relay`)."""
        v = self.profile.get("hub", self.relay_key)
        if v is None:
            self.estimated.add("hub relay")
            return DEFAULTS["relay_s"]
        return float(v)

    def reduce_threshold(self) -> int | None:
        """The smallest partial (its bytes in f32) the row split's all-reduce sends as bf16
        (None: never, bf16 was not cheaper at any size measured): from the profile (measured by
        :func:`vkxsplit.calibrate.measure_reduce`), else :data:`DEFAULTS`."""
        v = self.profile.get("hub", REDUCE_KEY)
        if not isinstance(v, dict) or "min_bytes" not in v:
            self.estimated.add("bf16 all-reduce threshold")
            return int(DEFAULTS["bf16_reduce_min_bytes"])
        return None if v["min_bytes"] is None else int(v["min_bytes"])

    def convert(self, n: int) -> float:
        v = self.profile.get("hub", "convert")
        if v is None:
            self.estimated.add("hub convert")
            return n * DEFAULTS["convert_ns_per_elem"] * 1e-9
        a, b = v
        return float(a) + float(b) * n

    def hub_node(self, node: Node) -> float:
        v = self.profile.get("hub", "node|" + node.signature())
        if v is not None:
            return float(v)
        self.estimated.add(f"hub {node.op}")
        nbytes = sum(t.rows * t.cols * _ELEM.get(t.dtype, 1) for t in (*node.inputs, node.output)
                     if not t.weight or t.dtype in _ELEM)
        if node.op == "mul_mat":
            w, x = node.inputs
            nbytes += w.shape[0] * row_bytes(w.dtype, w.shape[-1]) if w.dtype not in _ELEM else 0
            return 2.0 * x.rows * w.shape[0] * w.shape[-1] / (DEFAULTS["hub_gflops"] * 1e9) + \
                nbytes / (DEFAULTS["hub_gbs"] * 1e9)
        if node.op == "mul_mat_id":  # the experts the tokens can touch, each read once
            w, ids = node.inputs[0], node.inputs[2]
            E, N, K = w.shape
            P = ids.rows * ids.cols
            if w.dtype not in _ELEM:
                nbytes += min(E, P) * N * row_bytes(w.dtype, K)
            return 2.0 * P * N * K / (DEFAULTS["hub_gflops"] * 1e9) + nbytes / (DEFAULTS["hub_gbs"] * 1e9)
        return nbytes / (DEFAULTS["hub_gbs"] * 1e9)

    def hub_item(self, it: HubOp) -> float:
        if it.kind == "convert":
            assert it.src is not None
            return self.convert(it.src.rows * it.src.cols)
        assert it.node is not None
        t = self.hub_node(it.node)
        if it.kind == "rows":  # (of a routed product: rows of every expert)
            return t * (it.r1 - it.r0) / it.node.inputs[0].shape[-2 if it.node.op == "mul_mat_id" else 0]
        return t

    def _rate(self, name: str) -> float:
        r = self._rates.get(name)
        if r is None:
            b = self.backends.get(name)
            r = DEFAULTS["backend_gflops"]
            try:
                got = b.calibrate() if b is not None else {}
                r = float(got.get("mul_mat_gflops", r)) or r
            except Exception as exc:  # a broken calibrate() hook: keep the default
                log.debug("%s.calibrate(): %s", name, exc)
            self._rates[name] = r
        return r

    def job(self, backend: str, w_type: str, N: int, K: int, M: int) -> float:
        """Seconds of one full ``mul_mat`` (all N rows) on ``backend``, sync latency excluded."""
        v = self.profile.get(self.scope(backend), self.job_key(w_type, N, K, M))
        if v is not None:
            return float(v)
        self.estimated.add(f"{backend} mul_mat")
        return 2.0 * M * N * K / (self._rate(backend) * 1e9)

    def latency(self, backend: str) -> float:
        v = self.profile.get(self.scope(backend), "latency")
        if v is None:
            self.estimated.add(f"{backend} latency")
            return DEFAULTS["latency_s"]
        return float(v)

    def enqueue(self, backend: str) -> float:
        """Host seconds to enqueue one job on ``backend`` (a step enqueues everything up front:
        a job cannot start before the host got to it)."""
        v = self.profile.get(self.scope(backend), "enqueue")
        if v is None:
            self.estimated.add(f"{backend} enqueue")
            return DEFAULTS["enqueue_s"]
        return float(v)

    def backend_item(self, op: BackendOp | BackendIdOp | BackendNodeOp) -> float:
        if isinstance(op, BackendNodeOp):
            return self.node_on(op.backend, op.node)
        if isinstance(op, BackendIdOp):  # as the mul_mat of the same weight bytes and flops
            N, K, M = op.mul_mat_shape()
            return self.job(op.backend, op.weight.dtype, N, K, M) * (op.r1 - op.r0) / op.N
        return self.job(op.backend, op.weight.dtype, op.N, op.K, op.M) * (op.r1 - op.r0) / op.N

    def node_on(self, backend: str, node: Node) -> float:
        """Seconds of a small op (norm, SwiGLU, add) on a backend: not measured; the hub's
        time for it (the same memory-bound work) on a backend sharing the hub's GPU, else
        from its bytes at the default bandwidth."""
        self.estimated.add(f"{backend} {node.op}")
        if self.resource(backend) == HUB:
            return self.hub_node(node)
        nbytes = sum(t.rows * t.cols * 4 for t in (*node.inputs, *node.writes()))
        return nbytes / (DEFAULTS["hub_gbs"] * 1e9)

    # -- measuring (none here: vkxsplit.calibrate.MeasuringCostModel) -------------------------

    @property
    def can_measure(self) -> bool:
        return False

    def prepare(self, graph: Graph | None = None, jobs: Iterable[tuple[str, str, int, int, int]] = ()) -> None:
        """Make sure the profile holds what ``graph`` (hub nodes) and ``jobs`` ((backend,
        w_type, N, K, M) of full-row jobs) need: nothing to do for a model that only reads
        its profile (what is missing is estimated)."""


@dataclass
class Prediction:
    total_s: float
    busy: dict[str, float]
    estimated: list[str]

    def describe(self) -> str:
        busy = ", ".join(f"{k} busy {v * 1e3:.3f} ms" for k, v in self.busy.items())
        est = f"; estimated, not measured: {', '.join(self.estimated)}" if self.estimated else ""
        return f"{self.total_s * 1e3:.3f} ms ({busy}){est}"


def simulate(schedule: Schedule, cost: CostModel) -> Prediction:
    """Predicted step time: hub segments run one after another (over several hubs, each hub's
    in order, a segment starting a relay crossing after the other hubs' segments it waits for),
    each backend runs its jobs in order; a job starts half a round trip after its hub point, a
    segment half a round trip after the jobs it waits for; each segment costs one submit.
    Participants on one hardware resource (:meth:`CostModel.resource`; hubs on one device:
    :meth:`CostModel.hub_resource`) take it in submission order, without overlap. The
    host enqueues the step in order, a backend job taking it :meth:`CostModel.enqueue`: a job
    starts no earlier than the host got to it (what bounds a step of small jobs on a backend
    driven from Python)."""
    before = set(cost.estimated)
    cost.estimated.clear()
    free: dict[str, float] = {}      # per participant stream (the hub's segments, each backend's jobs)
    res_free: dict[str, float] = {}  # per hardware resource
    seg_end: dict[int, float] = {}
    job_end: dict[int, float] = {}
    multi = schedule.hubs > 1
    busy: dict[str, float] = {} if multi else {HUB: 0.0}
    host = 0.0                       # the caller's thread, enqueueing the step
    for kind, i in schedule.order:
        if kind == "seg":
            s = schedule.segments[i]
            lane = f"hub{s.hub}" if multi else HUB  # (each hub its own GPU, unless two share one)
            res = cost.hub_resource(lane) if multi and hasattr(cost, "hub_resource") else lane
            start = max(free.get(lane, 0.0), res_free.get(res, 0.0))
            for j in s.waits:
                start = max(start, job_end[j] + cost.latency(schedule.jobs[j].op.backend) / 2)
            for j in s.hub_waits:
                start = max(start, seg_end[j] + cost.relay())
            dur = cost.submit() + sum(cost.hub_item(op) for op in s.ops)
            free[lane] = res_free[res] = seg_end[i] = start + dur
            busy[lane] = busy.get(lane, 0.0) + dur
        else:
            jb = schedule.jobs[i]
            b = jb.op.backend
            res = cost.resource(b)
            host += cost.enqueue(b)
            start = max(seg_end[jb.wait] + cost.latency(b) / 2, free.get(b, 0.0), res_free.get(res, 0.0), host)
            dur = cost.backend_item(jb.op)
            free[b] = res_free[res] = job_end[i] = start + dur
            busy[b] = busy.get(b, 0.0) + dur
    total = max([*free.values(), *job_end.values(), 0.0])
    est = sorted(cost.estimated)
    cost.estimated |= before
    return Prediction(total, busy, est)


__all__ = ["DEFAULTS", "REDUCE_KEY", "CostModel", "Prediction", "simulate"]
