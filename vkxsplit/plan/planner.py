"""The split planner: which participant (the Vulkan hub or an attached backend) runs each op.

Given a graph (:mod:`vkxsplit.graph`), the backends present and a split spec
(:mod:`.spec`), :meth:`Planner.plan` produces a :class:`~.result.Plan` in four steps:

1. the split kind's assignment (:mod:`.strategies`): for every node the participant that runs
   it, or for a ``mul_mat`` the row ranges each participant computes (over several hubs each
   node on its hub instead: :mod:`.hub_split`);
2. the backends' kernel caps checked (:class:`.participants.Participants`, which the planner
   is: the participants and what each can take);
3. the assignment lowered to items (:mod:`.lowering`), with the conversions it inserts (x
   f32 -> bf16 every step and the weights once, on the hub, for a backend that computes in
   bf16; y stays f32: :mod:`.workspace`);
4. the items cut by :func:`.schedule.build_schedule` into hub segments, backend jobs and the
   timeline points between them; with ``predict`` (or ``auto``) the time :func:`.cost.simulate`
   predicts for it.

The executor (:class:`vkxsplit.executor.Executor`) runs the plan. ``auto`` and predictions take
a :class:`.cost.CostModel`.

Imports: the modules of this package; never the executor or the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..graph import Graph
from .cost import CostModel, simulate
from .hub_split import plan_over_hubs
from .lowering import job_needs, lower
from .participants import GRANULE, Participants
from .result import Part, Plan
from .schedule import HubOp, build_schedule
from .spec import HUB, SplitSpec
from .strategies import place_auto, place_layer, place_mode, place_tensor
from .workspace import Workspace


class Planner(Participants):
    """Plans graphs for one set of attached backends (see the module docstring).

    ``backends``: objects with ``name`` and ``caps`` (attached :class:`~vkxsplit.backend.Backend`\\ s,
    or stand-ins for dry planning). ``workspace``: where inserted memory comes from (default:
    dry, buffer-less). ``cost``: a :class:`CostModel` (needed by ``auto`` and for predictions).
    ``require_shared``: offload only ``mul_mat``\\ s whose memory backends can reach."""

    def __init__(self, backends: Iterable[Any] = (), *, cost: CostModel | None = None,
                 workspace: Workspace | None = None, require_shared: bool = True, granule: int = GRANULE,
                 hubs: int = 1) -> None:
        super().__init__(backends, workspace=workspace, require_shared=require_shared, granule=granule, hubs=hubs)
        self.cost = cost

    def plan(self, graph: Graph, spec: str | SplitSpec | None, *, predict: bool = False,
             commit: bool = True) -> Plan:
        """Plan ``graph`` under ``spec``; raises :class:`PlanError` naming what is wrong."""
        s = self.check(spec)
        if self.hubs > 1:
            return plan_over_hubs(self.names, graph, s)
        T = graph.T or max((n.inputs[1].rows for n in graph.mul_mats()), default=1)
        notes: list[str] = []
        candidates: list[tuple[str, float]] = []
        family = s.kind
        if s.kind == "none":
            assign: dict[int, list[Part]] = {}
        elif s.kind == "layer":
            assign = place_layer(self, graph, s, notes)
        elif s.kind == "tensor":
            assign = place_tensor(self, graph, s, notes)
        elif s.kind == "mode":
            assign = place_mode(self, graph, s, T, notes)
        else:
            assign, family, candidates = place_auto(self, graph, T, notes, self.cost)
        self.check_caps(graph, assign, s)
        items = lower(self, graph, assign, self.workspace)
        dropped = sum(n.op == "quantize_q8_1" for n in graph.nodes) - sum(
            isinstance(it, HubOp) and it.node is not None and it.node.op == "quantize_q8_1" for it in items)
        if dropped:
            notes.append(f"{dropped} quantize_q8_1 node(s) not run: every mat-vec reading that q8_1 x runs "
                         "on a backend, which reads x in f32")
        sch = build_schedule(items)
        participants = [p for p in self.names if p == HUB or any(j.op.backend == p for j in sch.jobs)]
        plan = Plan(graph, s, family, assign, items, sch, participants, _dedupe(notes), candidates=candidates)
        if commit:
            for p, keys in self.kernel_keys(graph, assign).items():
                self.workspace.resident(p).update(keys)
        if (predict or s.kind == "auto") and self.cost is not None:
            self.cost.prepare(graph, job_needs(sch))
            plan.prediction = simulate(sch, self.cost)
        return plan


def _dedupe(xs: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in xs if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]


__all__ = ["Planner"]
