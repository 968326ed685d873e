"""An assignment lowered to items: what the hub and each backend run, in graph order.

:func:`lower` turns a planner's assignment (node index -> :class:`~.result.Part`\\ s: who
runs which rows; nodes not listed run on the hub) into the items :func:`.schedule.build_schedule`
cuts into hub segments and backend jobs: hub nodes, hub row ranges, backend products (with the
hub's conversions of x, once per value, and of weights a backend cannot read, once per plan:
:mod:`.workspace`) and backend glue nodes. :func:`hub_xq_reads` says which q8_1 x the hub still
reads under an assignment (the rest is not quantized, and the glue writing it may leave the
hub); over several hubs every node is an item of its hub (:func:`hub_items`).

Imports: ``vkxsplit.graph``, ``vkxsplit.errors`` and the modules of this package below it.
"""

from __future__ import annotations

import dataclasses

from ..errors import PlanError
from ..graph import Graph, Span, Tensor, any_overlap, span
from .participants import NODE_OPS, Participants
from .result import ROUTED_OPS, Part, out_rows
from .schedule import BackendIdOp, BackendNodeOp, BackendOp, HubOp, Item, Schedule
from .spec import HUB
from .workspace import Workspace


def hub_xq_reads(graph: Graph, assign: dict[int, list[Part]]) -> set[int]:
    """The ids of the q8_1 x tensors (``xq`` params, :class:`vkxsplit.archs.DecodeQ8`) that a
    matrix node read by the hub under ``assign`` reads (wholly on the hub, or a hub row
    range). Backends read x in f32, so a q8_1 x outside this set has no reader: its
    ``quantize_q8_1`` node is not lowered and the glue writing it may leave the hub."""
    out: set[int] = set()
    for n in graph.nodes:
        xq = n.params.get("xq")
        if xq is None or n.op in NODE_OPS:  # NODE_OPS carrying xq write it
            continue
        parts = assign.get(n.index)
        if not parts or any(p.participant == HUB for p in parts):
            out.add(id(xq))
    return out


def lower(ps: Participants, graph: Graph, assign: dict[int, list[Part]], ws: Workspace) -> list[Item]:
    """The items of ``graph`` under ``assign`` for the participants ``ps`` (inserted memory
    from ``ws``)."""
    items: list[Item] = []
    fresh: dict[tuple[Span, str], tuple[Span, Tensor]] = {}

    def invalidate(written: list[Tensor]) -> None:
        ws_ = [span(t) for t in written]
        for k in [k for k, (src, _t) in fresh.items() if any_overlap([src], ws_)]:
            del fresh[k]

    hub_xq = hub_xq_reads(graph, assign)
    for n in graph.nodes:
        parts = assign.get(n.index)
        if n.op == "quantize_q8_1" and not parts and id(n.output) not in hub_xq:
            continue  # x as q8_1 for decode mat-vecs that all run on backends: nobody reads it
        if not parts:
            if n.op != "mul_mat" and "xq" in n.params and id(n.params["xq"]) not in hub_xq:
                # a hub node that would also write q8_1 x (attention) that no hub mat-vec
                # reads: run it without that output
                n = dataclasses.replace(n, params={k: v for k, v in n.params.items() if k not in ("xq", "q8")})
            items.append(HubOp("node", n.name, n.reads(), n.writes(), node=n))
            invalidate(n.writes())
            continue
        if n.op in NODE_OPS:
            items.append(BackendNodeOp(parts[0].participant, n.name, n))
            invalidate(n.writes())
            continue
        w, x = n.inputs[:2]
        y = n.output
        N = out_rows(n)
        routed = n.op in ROUTED_OPS
        group = n.index if len(parts) > 1 else None
        for part in parts:
            if part.participant == HUB:
                continue
            b = ps.backends[part.participant]
            xd = b.caps.x_dtype
            xt = x
            if xd != "f32":
                key = (span(x), xd)
                if key in fresh:
                    xt = fresh[key][1]
                else:
                    xt = ws.shadow(x, xd)
                    items.append(HubOp("convert", f"{x.name}->{xd}", [x], [xt], src=x, dst=xt))
                    fresh[key] = (span(x), xt)
            wt, conv, why = ps.route(b, w)
            if wt is None:
                raise PlanError(f"{n.name} on {b.name}: {why}")
            name = n.name if group is None else f"{n.name}[{part.r0}:{part.r1}]"
            if routed:
                if conv:
                    raise PlanError(f"{n.name} on {b.name}: the hub converts no expert tensors ({w.name} "
                                    f"is {w.dtype}, {b.name} reads {', '.join(sorted(b.caps.weight_types))})")
                items.append(BackendIdOp(b.name, name, n, w, xt, y, part.r0, part.r1, group))
                continue
            if conv:
                wtensor, w_row0 = ws.converted_weight(w, part.r0, part.r1, wt), part.r0
            else:
                wtensor, w_row0 = w, 0
            items.append(BackendOp(b.name, name, n, wtensor, w_row0, xt, y, part.r0, part.r1, group, conv))
        for part in parts:
            if part.participant != HUB:
                continue
            if (part.r0, part.r1) == (0, N):
                items.append(HubOp("node", n.name, n.reads(), n.writes(), node=n))
            else:
                items.append(HubOp("rows", f"{n.name}[{part.r0}:{part.r1}]", list(n.inputs), [y], node=n,
                                   r0=part.r0, r1=part.r1, group=group))
        invalidate([y])
    return items


def job_needs(sch: Schedule) -> set[tuple[str, str, int, int, int]]:
    """The backend products of a schedule as the cost model keys them: (backend, weight type,
    N, K, M)."""
    return {(j.op.backend, j.op.weight.dtype, *j.op.mul_mat_shape()) if isinstance(j.op, BackendIdOp)
            else (j.op.backend, j.op.weight.dtype, j.op.N, j.op.K, j.op.M) for j in sch.jobs
            if isinstance(j.op, (BackendOp, BackendIdOp))}


def hub_items(graph: Graph) -> list[Item]:
    """Every node of a graph over several hubs as an item of its hub (``Node.hub``)."""
    return [HubOp("node", n.name, n.reads(), n.writes(), node=n, hub=n.hub) for n in graph.nodes]


__all__ = ["hub_items", "hub_xq_reads", "job_needs", "lower"]
