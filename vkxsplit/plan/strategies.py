"""The split kinds: which participant runs each node, and which rows, under a split spec.

One function per kind, each returning an assignment (node index -> :class:`~.result.Part`\\ s;
nodes not listed run on the hub) that :class:`.planner.Planner` checks and lowers:

- :func:`place_layer` (``layer``): whole matrices by layer share, ``REGEX=NAME`` overrides first;
- :func:`place_tensor` (``tensor``): every matrix's rows divided by ratio (granule-aligned);
- :func:`place_mode` (``mode``): every matrix to the backend whose batch range holds ``T``,
  with the glue between the matrices (:func:`add_glue`);
- :func:`place_auto` (``auto``): candidate assignments (none, each backend mode-like, each
  matrix on its cheapest participant, rows divided where that pays) lowered and compared by
  :func:`.cost.simulate`; backends with a kernel cap keep the matrices that save most.

Every function asks the participants (:class:`.participants.Participants`) what each backend
can take. Imports: ``vkxsplit.graph``, ``vkxsplit.errors`` and the modules of this package
below it.
"""

from __future__ import annotations

import math

from ..errors import PlanError
from ..graph import Graph, Node
from .cost import CostModel, simulate
from .lowering import hub_xq_reads, lower
from .participants import F32_ONLY_OPS, NODE_OPS, Participants, matrices
from .result import OFFLOADABLE_OPS, Part, out_rows
from .schedule import build_schedule
from .spec import HUB, SplitSpec
from .workspace import Workspace


def _place(ps: Participants, assign: dict[int, list[Part]], node: Node, p: str, notes: list[str], *, why: str,
           soft: bool = True) -> None:
    """``node`` whole on participant ``p`` (the hub: left out of ``assign``); a backend that
    cannot take it now keeps it on the hub with a note, one that never can is an error."""
    N = node.output.rows if node.op in NODE_OPS else out_rows(node)
    if p == HUB:
        assign.pop(node.index, None)
        return
    bad = ps.why_not(ps.backends[p], node, soft=soft)
    if bad is not None:
        kind, reason = bad
        if kind == "hard":
            raise PlanError(f"{why} puts {node.name} on {p}, which cannot run it: {reason}")
        notes.append(f"{node.name} stays on the hub: {reason}")
        assign.pop(node.index, None)
        return
    assign[node.index] = [Part(p, 0, N)]


def place_layer(ps: Participants, graph: Graph, spec: SplitSpec, notes: list[str]) -> dict[int, list[Part]]:
    """``layer``: the overrides' matches on their participants (first match wins), then each
    remaining matrix on the participant whose share of the layers holds its layer."""
    assign: dict[int, list[Part]] = {}
    taken: set[int] = set()
    for ov in spec.overrides:
        p = ps.participant(ov.backend, spec)
        matched = graph.find(ov.pattern)
        if not matched:
            sample = ", ".join(n.name for n in matrices(graph)[:3])
            raise PlanError(f"split '{spec}': override '{ov.pattern}={ov.backend}' matches no node or tensor "
                            f"of {graph.name}", f"names look like {sample} (regexes use re.search)")
        mms = [n for n in matched if n.op in OFFLOADABLE_OPS]
        if not mms and p != HUB:
            b = ps.backends[p]
            ops = sorted({n.op for n in matched})
            names = ", ".join(n.name for n in matched[:4]) + (" ..." if len(matched) > 4 else "")
            if "f32" not in b.caps.compute_dtypes and any(o in F32_ONLY_OPS for o in ops):
                raise PlanError(f"split '{spec}': {p} computes only in {'/'.join(sorted(b.caps.compute_dtypes))} "
                                f"and '{ov.pattern}' selects only f32-only ops ({', '.join(ops)}: {names})",
                                "a bf16 backend takes mul_mat; match the matrices, e.g. 'blk\\..*\\.ffn_(gate|up|down)'")
            raise PlanError(f"split '{spec}': {p} does not run {', '.join(ops)} ('{ov.pattern}' selects {names}); "
                            "backends take mul_mat", "match mul_mat nodes (attn_q/k/v/output, ffn_*, output)")
        skipped = 0
        for n in matched:
            if n.index in taken:
                continue
            taken.add(n.index)
            if n.op not in OFFLOADABLE_OPS:
                skipped += 1
                continue
            _place(ps, assign, n, p, notes, why=f"override '{ov.pattern}={ov.backend}'")
        if skipped and p != HUB:
            notes.append(f"'{ov.pattern}' also matches {skipped} op(s) other than mul_mat: they stay on the hub")
    ratios = ps.ratios(spec)
    if not ratios and not spec.overrides:
        ratios = {p: 1.0 for p in ps.names}
    if ratios:
        n_layer = graph.n_layer
        total = sum(ratios.values())
        bounds: list[tuple[str, float, float]] = []
        acc = 0.0
        for p in ps.names:
            r = ratios.get(p, 0.0)
            bounds.append((p, acc / total * n_layer, (acc + r) / total * n_layer))
            acc += r
        for n in matrices(graph):
            if n.index in taken or n.layer is None:
                continue
            mid = n.layer + 0.5
            owner = next((p for p, a, b in bounds if a <= mid < b and b > a), HUB)
            _place(ps, assign, n, owner, notes, why=f"layer split '{spec}'")
    return assign


def _filtered(graph: Graph, spec: SplitSpec, pattern: str | None) -> list[Node]:
    """The matrices ``pattern`` selects (all of them without one); a pattern that selects
    none is an error."""
    if pattern is None:
        return matrices(graph)
    matched = graph.find(pattern)
    if not matched:
        raise PlanError(f"split '{spec}': regex '{pattern}' matches no node or tensor of {graph.name}")
    mms = [n for n in matched if n.op in OFFLOADABLE_OPS]
    if not mms:
        ops = sorted({n.op for n in matched})
        raise PlanError(f"split '{spec}': regex '{pattern}' matches only {', '.join(ops)}; "
                        f"{spec.kind} split divides mul_mat", "match mul_mat nodes (e.g. 'ffn_(gate|up|down)')")
    return mms


def place_tensor(ps: Participants, graph: Graph, spec: SplitSpec, notes: list[str]) -> dict[int, list[Part]]:
    """``tensor``: the rows of every (selected) matrix divided by the ratios; a backend's rows
    it cannot take now go to the hub."""
    ratios = ps.ratios(spec)
    assign: dict[int, list[Part]] = {}
    shares = [ratios.get(p, 0.0) for p in ps.names]
    for n in _filtered(graph, spec, spec.filter):
        N = out_rows(n)  # (a routed product: the rows of every expert)
        parts: list[Part] = []
        for p, (r0, r1) in zip(ps.names, ps.bounds(N, shares)):
            if r1 <= r0:
                continue
            if p != HUB:
                bad = ps.why_not(ps.backends[p], n)
                if bad is not None:
                    kind, reason = bad
                    if kind == "hard":
                        raise PlanError(f"split '{spec}': {p} has ratio {ratios[p]:g} but cannot run "
                                        f"{n.name}: {reason}", f"give {p} ratio 0, or restrict with @REGEX")
                    notes.append(f"{n.name} rows {r0}:{r1} of {p} go to the hub: {reason}")
                    p = HUB
            parts.append(Part(p, r0, r1))
        assign[n.index] = _merge_hub(parts, N)
    return {k: v for k, v in assign.items() if v != [Part(HUB, 0, v[-1].r1)]}


def place_mode(ps: Participants, graph: Graph, spec: SplitSpec, T: int, notes: list[str]) -> dict[int, list[Part]]:
    """``mode``: every (selected) matrix on the backend whose batch range holds ``T`` (none:
    everything on the hub), and without a filter the glue with them."""
    rules = ps.rules(spec)
    assign: dict[int, list[Part]] = {}
    hit = [r for r in rules if (r.lo or 1) <= T <= (math.inf if r.hi is None else r.hi)]
    for r in rules:
        _filtered(graph, spec, r.filter)  # a filter matching nothing is an error at any T
    if not hit:
        notes.append(f"T={T}: no rule takes this batch size; everything runs on the hub")
        return assign
    rule = hit[0]
    explicit = any(o.backend == rule.backend and o.explicit for o in spec.rules)
    for n in _filtered(graph, spec, rule.filter):
        _place(ps, assign, n, rule.backend, notes, why=f"mode rule {rule.describe()}", soft=not explicit)
    if rule.filter is None:
        add_glue(ps, graph, assign, rule.backend)
    return assign


def add_glue(ps: Participants, graph: Graph, assign: dict[int, list[Part]], name: str) -> dict[int, list[Part]]:
    """Put the glue between the matmuls (norms, SwiGLU, residual adds) on backend ``name``
    too, where it runs them (``caps.ops`` and ``run_op``). Why: every hand-off between hub
    and backend costs a round trip (~0.3 ms hub <-> cuda on the H200); with the glue on the
    backend a decoder layer crosses once (attention stays on the hub) instead of four
    times."""
    b = ps.backends.get(name)
    if b is not None and b.caps.ops & NODE_OPS and type(b).implements("run_op"):
        # a norm / SwiGLU that also writes the q8_1 x of decode mat-vecs (DecodeQ8) may go
        # too when none of those mat-vecs runs on the hub: the backend reads f32 x
        hub_xq = hub_xq_reads(graph, assign)
        for n in graph.nodes:
            if n.op in NODE_OPS and ps.why_not(b, n, hub_xq=hub_xq) is None:
                assign[n.index] = [Part(b.name, 0, n.output.rows)]
    return assign


def place_auto(ps: Participants, graph: Graph, T: int, notes: list[str], cost: CostModel | None
               ) -> tuple[dict[int, list[Part]], str, list[tuple[str, float]]]:
    """``auto``: the assignment of the candidates (everything on the hub; each backend taking
    every matrix it can, with the glue; each matrix on its cheapest participant; that with
    rows divided where it pays) whose lowered schedule ``cost`` predicts fastest. Returns it,
    the family it came from, and every candidate's predicted seconds."""
    if cost is None:
        raise PlanError("split 'auto' needs a cost model (a measured device profile)",
                        "plan through a loaded model (vkxsplit.load_model) or pass "
                        "Planner(cost=vkxsplit.calibrate.MeasuringCostModel(...))")
    mms = graph.mul_mats()
    able: dict[int, list[str]] = {}
    needs: set[tuple[str, str, int, int, int]] = set()
    for n in mms:
        takers = []
        for name, b in ps.backends.items():
            if ps.why_not(b, n) is None:
                takers.append(name)
                wt, _conv, _ = ps.route(b, n.inputs[0])
                w = n.inputs[0]
                needs.add((name, wt or w.dtype, w.shape[0], w.shape[-1], n.inputs[1].rows))
        able[n.index] = takers
    cost.prepare(graph, needs)

    def whole(n: Node, p: str) -> float:
        if p == HUB:
            return cost.hub_node(n)
        b = ps.backends[p]
        w, x = n.inputs
        wt, _conv, _ = ps.route(b, w)
        t = cost.latency(p) + cost.job(p, wt or w.dtype, w.shape[0], w.shape[-1], x.rows)
        if b.caps.x_dtype != "f32":
            t += cost.convert(x.rows * x.cols)
        return t

    costs = {n.index: {p: whole(n, p) for p in [HUB, *able[n.index]]} for n in mms}
    cands: list[tuple[str, dict[int, list[Part]]]] = [("none", {})]
    # mode-like: one backend takes every mul_mat it can
    for name in ps.backends:
        choice = {n.index: name for n in mms if name in able[n.index]}
        if choice:
            only = {i: {HUB: c[HUB], name: c[name]} for i, c in costs.items() if name in c}
            cands.append((f"mode:{name}", add_glue(ps, graph, _cap_fit(ps, graph, choice, only), name)))
    # layer-like: each mul_mat on its cheapest participant
    best = {i: min(c, key=c.get) for i, c in costs.items()}  # type: ignore[arg-type]
    greedy = _cap_fit(ps, graph, {i: p for i, p in best.items() if p != HUB}, costs)
    cands.append(("layer", greedy))
    # tensor: rows divided where that beats the cheapest single participant
    mixed = {k: list(v) for k, v in greedy.items()}
    any_split = False
    for n in mms:
        takers = [HUB] + [p for p in able[n.index]
                          if ps.backends[p].caps.max_kernels is None and not ps.route(ps.backends[p], n.inputs[0])[1]]
        if len(takers) < 2:
            continue
        lat = {p: (0.0 if p == HUB else cost.latency(p)) for p in takers}
        full = {p: (costs[n.index][HUB] if p == HUB else costs[n.index][p] - lat[p]) for p in takers}
        shares, finish = _water_fill(lat, full)
        whole_best = min(costs[n.index].values())
        if finish < 0.95 * whole_best and sum(1 for v in shares.values() if v > 0) > 1:
            N = n.inputs[0].shape[0]
            parts = [Part(p, r0, r1) for p, (r0, r1) in zip(takers, ps.bounds(N, [shares[p] for p in takers]))
                     if r1 > r0]
            if len(parts) > 1:
                mixed[n.index] = _merge_hub(parts, N)
                any_split = True
    if any_split:
        cands.append(("tensor", mixed))
    results: list[tuple[str, float, dict[int, list[Part]]]] = []
    dry = Workspace()
    seen: list[dict[int, list[Part]]] = []
    for label, assign in cands:
        if assign in seen:  # the same assignment under another name: evaluated once
            continue
        seen.append(assign)
        sch = build_schedule(lower(ps, graph, assign, dry))
        results.append((label, simulate(sch, cost).total_s, assign))
    label, _t, assign = min(results, key=lambda r: r[1])
    fam = label.split(":")[0]
    notes.append(f"auto picked {label} for T={T}")
    return assign, fam, [(lb, t) for lb, t, _ in results]


def _cap_fit(ps: Participants, graph: Graph, choice: dict[int, str], costs: dict[int, dict[str, float]]
             ) -> dict[int, list[Part]]:
    """Whole-op assignment ``choice`` with capped backends limited to the ops where they save
    most (kernels already resident first); the rest go to their next cheapest participant."""
    choice = dict(choice)
    for name, b in ps.backends.items():
        cap = b.caps.max_kernels
        if cap is None:
            continue
        mine = [i for i, p in choice.items() if p == name]
        resident = ps.workspace.resident(name)

        def saving(i: int, name: str = name) -> float:
            alt = min(v for p, v in costs[i].items() if p != name)
            return alt - costs[i][name]

        keys = {i: ps.kernel_keys_of(b, graph.nodes[i], Part(name, 0, graph.nodes[i].inputs[0].shape[0]))[0]
                for i in mine}
        ranked = sorted(mine, key=lambda i: (keys[i] not in resident, -saving(i)))
        kept: list[int] = []
        loaded = set(resident)
        for i in ranked:
            if saving(i) <= 0:
                continue
            if keys[i] in loaded or len(loaded) < cap:
                loaded.add(keys[i])
                kept.append(i)
        for i in mine:
            if i not in kept:
                alts = {p: v for p, v in costs[i].items() if p != name}
                choice[i] = min(alts, key=alts.get)  # type: ignore[arg-type]
    return {i: [Part(p, 0, graph.nodes[i].inputs[0].shape[0])] for i, p in choice.items() if p != HUB}


def _water_fill(lat: dict[str, float], full: dict[str, float]) -> tuple[dict[str, float], float]:
    """Shares s_p >= 0, sum 1, minimising max_p(lat_p + s_p * full_p): all active participants
    finish together at F = (1 + sum lat/full) / sum 1/full."""
    active = sorted(lat, key=lambda p: lat[p])
    while True:
        inv = sum(1.0 / max(full[p], 1e-12) for p in active)
        F = (1.0 + sum(lat[p] / max(full[p], 1e-12) for p in active)) / inv
        drop = [p for p in active if lat[p] >= F]
        if not drop or len(active) == 1:
            break
        active = [p for p in active if p not in drop]
    shares = {p: (max(0.0, (F - lat[p]) / max(full[p], 1e-12)) if p in active else 0.0) for p in lat}
    tot = sum(shares.values()) or 1.0
    return {p: v / tot for p, v in shares.items()}, F


def _merge_hub(parts: list[Part], N: int) -> list[Part]:
    """Adjacent hub row ranges as one."""
    out: list[Part] = []
    for p in parts:
        if out and out[-1].participant == p.participant == HUB and out[-1].r1 == p.r0:
            out[-1] = Part(HUB, out[-1].r0, p.r1)
        else:
            out.append(p)
    return out


__all__ = ["add_glue", "place_auto", "place_layer", "place_mode", "place_tensor"]
