"""What a planner returns: a :class:`Plan` (who runs each node and which rows, the lowered
items and their schedule), and its description for people (:meth:`Plan.describe`) and tools
(:meth:`Plan.to_dict`). The planner itself is :mod:`.planner`.

Imports: ``vkxsplit.graph`` and the modules of this package below the planner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..graph import Graph, Node
from .cost import Prediction
from .schedule import BackendOp, HubOp, Item, Schedule
from .spec import HUB, SplitSpec

#: Ops the planner may hand a backend; every other op of the graph stays on the hub. The
#: routed expert product ``mul_mat_id`` (a MoE FFN's gate/up/down experts) is placed like
#: ``mul_mat`` (layer overrides such as ``layer:blk\..*\.ffn_.*_exps=cpu``, tensor split over
#: the rows of every expert, mode rules) on backends that implement the ``mul_mat_id`` hook.
OFFLOADABLE_OPS = frozenset({"mul_mat", "mul_mat_id"})
ROUTED_OPS = frozenset({"mul_mat_id"})


def out_rows(n: Node) -> int:
    """Output features of a matrix node: the weight's rows (``mul_mat``), the rows of each
    expert's matrix (``mul_mat_id``: weight (n_expert, N, K)); 0 for other ops."""
    if n.op == "mul_mat":
        return n.inputs[0].shape[0]
    if n.op in ROUTED_OPS:
        return n.inputs[0].shape[-2]
    return 0


@dataclass(frozen=True)
class Part:
    """Output rows ``[r0, r1)`` of a ``mul_mat`` on ``participant`` (``hub`` or a backend)."""

    participant: str
    r0: int
    r1: int


@dataclass(eq=False)
class Plan:
    """Where each node of ``graph`` runs, the inserted conversions, and the schedule."""

    graph: Graph
    spec: SplitSpec
    family: str                           # none / layer / tensor / mode (what auto chose, too)
    assign: dict[int, list[Part]]         # node index -> parts; nodes not listed run on the hub
    items: list[Item]
    schedule: Schedule
    participants: list[str]
    notes: list[str] = field(default_factory=list)
    prediction: Prediction | None = None
    candidates: list[tuple[str, float]] = field(default_factory=list)
    #: several hubs: how the relay carries a cross-hub wait (``signal``: a timeline the waiting
    #: segment, queued up front, waits on; ``submit``: the relay submits that segment)
    cross: str = "signal"
    cross_nodes: list[str] = field(default_factory=list)  # nodes touching memory of several hubs
    crossed_bytes: int = 0  # bytes per step written into memory of several hubs

    @property
    def T(self) -> int:
        return self.graph.T

    @property
    def label(self) -> str:
        return str(self.spec) + (f" -> {self.family}" if self.spec.kind == "auto" else "")

    @property
    def backend_jobs(self) -> int:
        return len(self.schedule.jobs)

    def parts(self, node: Node | str) -> list[Part]:
        n = self.graph.node(node) if isinstance(node, str) else node
        got = self.assign.get(n.index)
        if got:
            return got
        return [Part(HUB, 0, out_rows(n))]

    def runs_on(self, node: Node | str) -> list[str]:
        return sorted({p.participant for p in self.parts(node)})

    def conversions(self) -> dict[str, list[str]]:
        step = [f"{it.src.name} {it.src.dtype}->{it.dst.dtype} ({it.src.rows}x{it.src.cols})"
                for it in self.items if isinstance(it, HubOp) and it.kind == "convert"
                and it.src is not None and it.dst is not None]
        once = sorted({f"{op.weight.name} ({op.backend})" for op in self.items
                       if isinstance(op, BackendOp) and op.converted_weight})
        return {"per_step": step, "once": once}

    def by_participant(self) -> dict[str, dict[str, list[str]]]:
        out: dict[str, dict[str, list[str]]] = {p: {"ops": [], "mul_mat": []} for p in self.participants}
        lowered = {id(it.node) for it in self.items if it.node is not None}
        for n in self.graph.nodes:
            if id(n) not in lowered:  # a q8_1 quantization nobody reads: not run
                continue
            for part in self.parts(n):
                d = out.setdefault(part.participant, {"ops": [], "mul_mat": []})
                if n.op in OFFLOADABLE_OPS:
                    N = out_rows(n)
                    rows = "" if (part.r0, part.r1) == (0, N) else f" rows {part.r0}:{part.r1}/{N}"
                    d["mul_mat"].append(f"{n.name}{rows}")
                else:
                    d["ops"].append(n.name)
        return out

    def describe(self, points: bool = False) -> str:
        lines = [f"plan {self.graph.name}  T={self.T}  split={self.spec}  ({self.family})"]
        for p, d in self.by_participant().items():
            mm = _compress(d["mul_mat"])
            other = _compress(d["ops"])
            lines.append(f"  {p}: {len(d['mul_mat'])} mul_mat{'s' if len(d['mul_mat']) != 1 else ''}"
                         + (f", {len(d['ops'])} other ops" if d["ops"] else ""))
            if mm:
                lines.append("      mul_mat: " + ", ".join(mm))
            if other and p == HUB and len(other) <= 12:
                lines.append("      ops: " + ", ".join(other))
        conv = self.conversions()
        if conv["per_step"]:
            lines.append("  per-step conversions on the hub: " + ", ".join(_compress(conv["per_step"])))
        if conv["once"]:
            lines.append("  weights converted once at load: " + ", ".join(_compress(conv["once"])))
        lines.append(f"  timeline: {self.schedule.submits} hub submit{'s' if self.schedule.submits != 1 else ''}, "
                     f"{self.backend_jobs} backend job{'s' if self.backend_jobs != 1 else ''} per step")
        if self.schedule.hubs > 1:
            lines.append(f"  between hubs: {self.crossed_bytes} bytes per step ({self.crossed_bytes / 1024:.1f} KiB)")
        if points:
            lines += ["      " + s for s in self.schedule.points()]
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.candidates:
            lines.append("  auto candidates: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.candidates))
        if self.prediction is not None:
            lines.append(f"  predicted: {self.prediction.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        sch = self.schedule
        multi = sch.hubs > 1  # several hubs: each segment's hub and cross-hub waits, what crosses
        return {
            "graph": self.graph.name, "T": self.T, "split": str(self.spec), "family": self.family,
            "participants": self.by_participant(),
            "conversions": self.conversions(),
            "segments": [{"index": s.index, "ops": [op.name for op in s.ops], "waits": s.waits,
                          **({"hub": s.hub, "hub_waits": s.hub_waits} if multi else {})} for s in sch.segments],
            **({"cross": self.cross, "cross_nodes": self.cross_nodes, "crossed_bytes": self.crossed_bytes}
               if multi else {}),
            "jobs": [{"index": j.index, "backend": j.op.backend, "op": j.op.name, "rows": [j.op.r0, j.op.r1],
                      **({"N": j.op.N, "K": j.op.K, "M": j.op.M, "w_type": j.op.weight.dtype, "x_type": j.op.x.dtype}
                         if isinstance(j.op, BackendOp) else {"node_op": j.op.node.op}),
                      "waits_segment": j.wait} for j in sch.jobs],
            "order": [f"{k}{i}" for k, i in sch.order],
            "notes": self.notes,
            "predicted_s": self.prediction.total_s if self.prediction else None,
            "busy_s": self.prediction.busy if self.prediction else None,
            "estimated": self.prediction.estimated if self.prediction else None,
            "candidates": [{"split": k, "predicted_s": v} for k, v in self.candidates],
        }


def _compress(names: list[str]) -> list[str]:
    """``blk.0.attn_q, blk.1.attn_q`` -> ``blk.{0-1}.attn_q`` (order of first appearance)."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for s in names:
        m = re.match(r"^blk\.(\d+)\.(.*)$", s)
        key, idx = (f"blk.{{}}.{m.group(2)}", int(m.group(1))) if m else (s, -1)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if idx >= 0:
            groups[key].append(idx)
    out = []
    for key in order:
        idx = sorted(set(groups[key]))
        if not idx:
            out.append(key)
            continue
        runs = []
        a = b = idx[0]
        for i in idx[1:]:
            if i == b + 1:
                b = i
            else:
                runs.append((a, b))
                a = b = i
        runs.append((a, b))
        rs = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        out.append(key.replace("{}", rs if len(runs) == 1 and runs[0][0] == runs[0][1] else "{" + rs + "}"))
    return out


__all__ = ["OFFLOADABLE_OPS", "ROUTED_OPS", "Part", "Plan", "out_rows"]
