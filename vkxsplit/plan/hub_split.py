"""A model over several Vulkan hubs as a plan: each node on its hub, and ``auto``'s choice
among one hub, the layer split and the row split.

Over several hubs (``hub0``, ``hub1``, ...) nothing is placed per step: what each hub holds was
decided when the model loaded (:meth:`.participants.Participants.hub_shares`,
:mod:`vkxsplit.hubs`), and every node of the step's graph carries its hub (``Node.hub``).
:func:`plan_over_hubs` makes that graph a :class:`~.result.Plan` with its cross-hub waits;
:func:`choose_hub_split` prices candidate placements (:class:`HubCandidate`, graphs built over
dry shares) on :data:`HUB_AUTO_WORKLOAD` with :func:`.cost.simulate`, for the model to place the
cheapest.

Imports: ``vkxsplit.graph``, ``vkxsplit.errors`` and the modules of this package below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import PlanError
from ..graph import Graph, span
from .cost import CostModel, simulate
from .lowering import hub_items
from .result import Part, Plan, out_rows
from .schedule import build_schedule
from .spec import SplitSpec

#: what ``auto`` over several hubs compares the candidate splits on: the predicted time of
#: llama-bench's default tests, a 512-token prompt (in steps of at most ubatch tokens) and 128
#: decode steps
HUB_AUTO_WORKLOAD = (512, 128)


@dataclasses.dataclass
class HubCandidate:
    """A way to place a model over its hubs that ``auto`` prices (:func:`choose_hub_split`):
    ``label`` (``one hub``, ``layer``, ``row``), the ``spec`` the model places it with (``none``:
    everything on hub 0), and the graphs of its workload's steps, each with how many times it
    runs (:data:`HUB_AUTO_WORKLOAD`), built over the hubs' (dry) shares."""

    label: str
    spec: str
    steps: list[tuple[Graph, float]]


def choose_hub_split(candidates: Sequence[HubCandidate], cost: CostModel | None
                     ) -> tuple[HubCandidate, list[tuple[str, float]], list[str]]:
    """``auto`` over several hubs: each candidate's steps planned as :func:`plan_over_hubs`
    plans them (each node on its hub, a relay crossing per cross-hub wait), their times
    predicted by :func:`.cost.simulate` over ``cost``, weighted by how often each step runs;
    returns the cheapest candidate, every candidate's predicted seconds, and what the
    prediction estimated rather than read from measurements."""
    if cost is None:
        raise PlanError("split 'auto' over several hubs needs a cost model (a measured device profile)",
                        "load the model (vkxsplit.load_model) or pass Planner(cost=...)")
    if not candidates:
        raise PlanError("split 'auto' over several hubs: no candidate split can run this model")
    table: list[tuple[str, float]] = []
    est: set[str] = set()
    for c in candidates:
        total = 0.0
        for g, times in c.steps:
            pred = simulate(build_schedule(hub_items(g)), cost)
            total += times * pred.total_s
            est.update(pred.estimated)
        table.append((c.label, total))
    best = min(range(len(candidates)), key=lambda i: table[i][1])
    return candidates[best], table, sorted(est)


def plan_over_hubs(names: list[str], graph: Graph, s: SplitSpec) -> Plan:
    """A model over several hubs: each node runs on the hub that holds its buffers
    (``Node.hub``, set where the model built that hub's part of the graph). The nodes that
    cross hubs are those touching host pages several hubs import (the hidden-state links of
    a layer split, the partials of a row split's all-reduces): the schedule cuts a segment
    there and makes it wait for the other hub's (:func:`.schedule.build_schedule`), and the
    executor's relay carries that wait (signalling for a layer split, submitting the next
    segment for a row split: :mod:`vkxsplit.relay`)."""
    assign = {n.index: [Part(names[n.hub], 0, out_rows(n))] for n in graph.nodes}
    items = hub_items(graph)
    sch = build_schedule(items)
    keys: dict[Any, set[int]] = {}
    for n in graph.nodes:
        for t in (*n.reads(), *n.writes()):
            keys.setdefault(span(t)[0], set()).add(n.hub)
    cross = [n for n in graph.nodes if any(len(keys[span(t)[0]]) > 1 for t in (*n.reads(), *n.writes()))]
    ops: dict[str, int] = {}
    for n in cross:
        ops[n.op] = ops.get(n.op, 0) + 1
    notes = ["cross-hub nodes (host pages both hubs import): "
             + ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))
             + f"; {len(sch.cross_waits())} relay rounds per step, "
             + ("each submitting the next segment (row split)" if s.kind == "tensor"
                else "each signalling the next hub (layer split)")]
    sums: dict[str, int] = {}  # the row split's all-reduces by the type their partials cross in
    for n in graph.nodes:
        if n.op == "link_sum" and n.hub == 0:
            sums[n.inputs[1].dtype] = sums.get(n.inputs[1].dtype, 0) + 1
    if sums:
        notes.append(f"{sum(sums.values())} all-reduces per step, partials crossing as "
                     + ", ".join(f"{k} ({v})" for k, v in sorted(sums.items())))
    plan = Plan(graph, s, s.kind, assign, items, sch, list(names), notes)
    plan.cross = "submit" if s.kind == "tensor" else "signal"
    plan.cross_nodes = [n.name for n in cross]
    # bytes written into the memory of several hubs per step: what crosses between them
    esz = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
    plan.crossed_bytes = sum(n.output.rows * n.output.cols * esz.get(n.output.dtype, 4) for n in graph.nodes
                             if len(keys[span(n.output)[0]]) > 1)
    return plan


__all__ = ["HUB_AUTO_WORKLOAD", "HubCandidate", "choose_hub_split", "plan_over_hubs"]
