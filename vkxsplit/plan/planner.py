"""The split planner: which participant (the Vulkan hub or an attached backend) runs each op.

Given a graph (:mod:`vkxsplit.graph`), the backends present and a split spec
(:mod:`.spec`), :class:`Planner` produces a :class:`Plan`: for every node the participant that
runs it, or for a ``mul_mat`` the row ranges each participant computes; the conversions it
inserts (x f32 -> bf16 every step and the weights once, on the hub, for a backend that computes
in bf16; y stays f32: :mod:`.workspace`); and, lowered and cut by
:func:`.schedule.build_schedule`, the timeline points between participants. The executor
(:class:`vkxsplit.executor.Executor`) runs it. ``auto`` and predictions take a
:class:`.cost.CostModel`.

Imports: ``vkxsplit.graph``, ``vkxsplit.backend`` (``NODE_OPS``), ``vkxsplit.errors`` and the
modules of this package; never the executor or the model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..backend import NODE_OPS as GLUE_OPS
from ..backend import STEP_OPS
from ..errors import PlanError
from ..graph import Graph, Node, Span, Tensor, any_overlap, span
from .cost import CostModel, simulate
from .result import OFFLOADABLE_OPS, ROUTED_OPS, Part, Plan, _compress, out_rows
from .schedule import BackendIdOp, BackendNodeOp, BackendOp, HubOp, Item, Schedule, build_schedule
from .spec import HUB, HUB_ALIASES, Rule, SplitSpec, parse_spec
from .workspace import Workspace

#: ops a backend runs through ``run_op`` (the glue between matmuls, and the rest of a step for a
#: backend that lists them in ``caps.ops``)
NODE_OPS = GLUE_OPS | STEP_OPS

#: Ops whose inputs and outputs are f32 state (residual stream, norms, attention, positions):
#: they have no bf16 form, so a backend that computes only in bf16 can never take them.
F32_ONLY_OPS = frozenset({"get_rows", "rms_norm", "add_rms_norm", "add", "swiglu", "rope", "kv_store", "attention", "argmax",
                          "softmax", "norm", "mul", "scale", "silu", "gelu", "cpy"})
GRANULE = 16  # tensor-split row boundaries are multiples of this (except the last)
#: what ``auto`` over several hubs compares the candidate splits on: the predicted time of
#: llama-bench's default tests, a 512-token prompt (in steps of at most ubatch tokens) and 128
#: decode steps
HUB_AUTO_WORKLOAD = (512, 128)
_HUB_N = re.compile(r"hub(\d+)")  # the participant name of Vulkan hub N of a model over several hubs


def _has_hook(b: Any, hook: str) -> bool:
    """Whether backend ``b`` overrides optional hook ``hook`` (stand-ins without the Backend
    class's ``implements``, in dry planning: whether their caps say so is all there is)."""
    impl = getattr(type(b), "implements", None)
    return True if impl is None else bool(impl(hook))


@dataclasses.dataclass
class HubCandidate:
    """A way to place a model over its hubs that ``auto`` prices (:meth:`Planner.choose_hub_split`):
    ``label`` (``one hub``, ``layer``, ``row``), the ``spec`` the model places it with (``none``:
    everything on hub 0), and the graphs of its workload's steps, each with how many times it
    runs (:data:`HUB_AUTO_WORKLOAD`), built over the hubs' (dry) shares."""

    label: str
    spec: str
    steps: list[tuple[Graph, float]]


def matrices(graph: Graph) -> list[Node]:
    """The nodes a backend may take as matrix products (:data:`OFFLOADABLE_OPS`)."""
    return [n for n in graph.nodes if n.op in OFFLOADABLE_OPS]


# =============================================================================================
# the planner


class Planner:
    """Plans graphs for one set of attached backends (see the module docstring).

    ``backends``: objects with ``name`` and ``caps`` (attached :class:`~vkxsplit.backend.Backend`\\ s,
    or stand-ins for dry planning). ``workspace``: where inserted memory comes from (default:
    dry, buffer-less). ``cost``: a :class:`CostModel` (needed by ``auto`` and for predictions).
    ``require_shared``: offload only ``mul_mat``\\ s whose memory backends can reach."""

    def __init__(self, backends: Iterable[Any] = (), *, cost: CostModel | None = None,
                 workspace: Workspace | None = None, require_shared: bool = True, granule: int = GRANULE,
                 hubs: int = 1) -> None:
        self.backends: dict[str, Any] = {}
        for b in backends:
            if b.name in HUB_ALIASES or _HUB_N.fullmatch(b.name):
                raise PlanError(f"a backend cannot be named {b.name!r} (a hub's name)")
            self.backends[b.name] = b
        self.hubs = int(hubs)
        if self.hubs > 1 and self.backends:
            raise PlanError(f"backends ({', '.join(self.backends)}) attached to a model over {self.hubs} hubs: "
                            "with several hubs every participant is a Vulkan hub",
                            "attach backends to a model on one hub (no --devices), or drop --backends")
        # the participants: "hub" and the backends, or one "hubN" per Vulkan hub of the model
        self.names = [HUB, *self.backends] if self.hubs == 1 else [f"hub{i}" for i in range(self.hubs)]
        self.cost = cost
        self.workspace = workspace or Workspace()
        self.require_shared = require_shared
        self.granule = granule

    # -- spec checks that need only the backends -----------------------------------------

    def _name(self, name: str, spec: SplitSpec) -> str:
        if name in HUB_ALIASES:
            return self.names[0]
        m = _HUB_N.fullmatch(name)
        if m:
            i = int(m.group(1))
            if i < self.hubs:
                return self.names[i]
            opened = ", ".join(f"hub{k}" for k in range(self.hubs))
            raise PlanError(f"split '{spec}' names {name}, a Vulkan hub this model did not open "
                            f"(it opened {self.hubs}: {opened})",
                            "open one hub per device: --devices 0,1 (load_model(..., devices='0,1')), "
                            "or name only the hubs there are")
        if name not in self.backends:
            attached = ", ".join(self.names)
            raise PlanError(f"unknown backend '{name}' in split '{spec}' (attached: {attached})",
                            f"attach it with --backends {name}, or name one of: {attached}")
        return name

    def _ratios(self, spec: SplitSpec) -> dict[str, float]:
        if not spec.ratios:
            return {}
        if spec.ratios[0][0] is None:
            if len(spec.ratios) != len(self.names):
                raise PlanError(
                    f"split '{spec}' gives {len(spec.ratios)} ratio{'s' if len(spec.ratios) != 1 else ''} for "
                    f"{len(self.names)} participants ({', '.join(self.names)})",
                    f"one ratio per participant, {self.names[0]} first ({spec.kind}:{','.join(['1'] * len(self.names))}), "
                    f"or name them ({spec.kind}:{self.names[0]}=1,{self.names[-1]}=1)")
            r = {p: v for p, (_, v) in zip(self.names, spec.ratios)}
        else:
            r = {p: 0.0 for p in self.names}
            for n, v in spec.ratios:
                r[self._name(n or "", spec)] = v
        if sum(r.values()) <= 0:
            raise PlanError(f"split '{spec}': every ratio is 0, nothing would compute")
        return r

    def _rules(self, spec: SplitSpec) -> list[Rule]:
        out: list[Rule] = []
        seen: set[str] = set()
        for r in spec.rules:
            name = self._name(r.backend, spec)
            if name == HUB:
                raise PlanError(f"split '{spec}': a mode rule names the hub",
                                "the hub takes every batch size no backend rule takes; give rules for backends")
            if name in seen:
                raise PlanError(f"split '{spec}': two rules for {name}", "give one range per backend, e.g. cpu>=8<=64")
            seen.add(name)
            caps = self.backends[name].caps
            lo, hi = r.lo, r.hi
            if not r.explicit:
                lo, hi = caps.min_batch, caps.max_batch
            else:
                lo = 1 if lo is None else lo
                if hi is None:
                    hi = caps.max_batch
            if caps.max_batch is not None and (hi is None or hi > caps.max_batch or lo > caps.max_batch):
                if lo > caps.max_batch:
                    raise PlanError(f"split '{spec}': {name} takes at most {caps.max_batch} tokens per mul_mat "
                                    f"(max_batch), so batch sizes >= {lo} are nonsensical for it")
                raise PlanError(f"split '{spec}': the range of {name} goes beyond its max_batch {caps.max_batch}",
                                f"add <={caps.max_batch}")
            out.append(Rule(name, lo, hi, r.filter))
        for i, a in enumerate(out):
            for b in out[i + 1:]:
                a_hi = math.inf if a.hi is None else a.hi
                b_hi = math.inf if b.hi is None else b.hi
                lo, hi = max(a.lo or 1, b.lo or 1), min(a_hi, b_hi)
                if lo <= hi:
                    raise PlanError(f"split '{spec}': the batch ranges of {a.backend} ({a.describe()}) and "
                                    f"{b.backend} ({b.describe()}) overlap at T={lo}",
                                    "give each batch size to one backend, e.g. mode:cpu<8,npu-emu>=8")
        return out

    def check(self, spec: str | SplitSpec | None) -> SplitSpec:
        """Parse ``spec`` and check what needs only the backends (names, ratio counts, batch
        ranges); returns the parsed spec. Graph-level checks happen in :meth:`plan`."""
        s = parse_spec(spec)
        if self.hubs > 1:
            self.hub_shares(s)
        for n in s.names():
            self._name(n, s)
        if s.kind in ("tensor", "layer"):
            self._ratios(s)
        if s.kind == "mode":
            self._rules(s)
        return s

    # -- what a backend can take ------------------------------------------------------------

    def route(self, b: Any, w: Tensor) -> tuple[str | None, bool, str]:
        """``(weight type handed to b, converted?, why not)`` for a weight ``w``."""
        caps = b.caps
        if w.dtype in caps.weight_types:
            return w.dtype, False, ""
        pref = [caps.x_dtype] if caps.x_dtype != "f32" else []
        pref += [d for d in ("f16", "bf16", "f32") if d not in pref]
        targets = [d for d in pref if d in caps.weight_types]
        if not targets:
            return None, False, (f"{b.name} reads {', '.join(sorted(caps.weight_types))} weights, not {w.dtype}, "
                                 "and none of f32/f16/bf16 the hub could convert to")
        from ..ops.quant import TYPES

        if w.dtype not in TYPES:
            return None, False, f"the hub cannot dequantize {w.dtype} weights for {b.name}"
        return targets[0], True, ""

    def why_not(self, b: Any, node: Node, *, soft: bool = True,
                hub_xq: set[int] | None = None) -> tuple[str, str] | None:
        """Why ``node`` cannot run on ``b``: ``("hard", reason)`` (never), ``("soft", reason)``
        (not at this batch size / memory), or None when it can. ``hub_xq``: the ids of the q8_1
        x tensors hub-run mat-vecs read under the assignment being made (:func:`hub_xq_reads`);
        None: every one is read."""
        if node.op in NODE_OPS:
            if node.op not in b.caps.ops or not type(b).implements("run_op"):
                return "hard", f"{node.op} runs on the hub only ({b.name} does not take it)"
            xq = node.params.get("xq")  # its q8_1 output feeds the hub's integer-dot-product mat-vecs
            if xq is not None and (hub_xq is None or id(xq) in hub_xq):
                return "hard", f"{node.name} also writes the q8_1 x of the hub's mat-vecs (hub only)"
            if "f32" not in b.caps.compute_dtypes:
                return "hard", f"{node.op} computes in f32, {b.name} does not"
            refuse = getattr(b, "node_why_not", None)  # what the backend's form of the op lacks
            why = refuse(node) if callable(refuse) else None
            if why:
                return "hard", why
            if self.require_shared:
                unshared = sorted({t.name for t in (*node.inputs, *node.writes()) if not t.shared})
                if unshared:
                    return "soft", f"{', '.join(unshared)} not in memory shared with backends"
            return None
        if node.op not in OFFLOADABLE_OPS:
            return "hard", f"{node.op} runs on the hub only"
        w, x = node.inputs[:2]
        routed = node.op in ROUTED_OPS
        if routed and ("mul_mat_id" not in b.caps.ops or not _has_hook(b, "mul_mat_id")):
            return "hard", (f"{b.name} has no routed expert product (mul_mat_id) for the MoE experts "
                            f"{w.name}; they run on the hub or on a backend that has it")
        wt, conv, why = self.route(b, w)
        if wt is None:
            return "hard", why
        if routed and conv:
            return "hard", (f"{b.name} does not read {w.dtype} and the hub converts no expert tensors "
                            f"({w.name}); give the experts to a backend that reads {w.dtype}")
        caps = b.caps
        M = node.inputs[2].shape[0] if routed else x.rows  # tokens
        if caps.max_batch is not None and M > caps.max_batch:
            return "soft", f"M={M} is over {b.name}'s max_batch {caps.max_batch}"
        if soft and M < caps.min_batch:
            return "soft", f"M={M} is under {b.name}'s min_batch {caps.min_batch}"
        if self.require_shared:
            need = [node.output] + ([] if conv else [w]) + ([x] if caps.x_dtype == "f32" else []) + (
                [node.inputs[2]] if routed else [])
            unshared = [t.name for t in need if not t.shared]
            if unshared:
                return "soft", f"{', '.join(unshared)} not in memory shared with backends"
        return None

    def _kernel_key(self, b: Any, node: Node, part: Part) -> tuple[Any, ...]:
        """The resident kernel of a ``mul_mat`` part on ``b`` (auto's cap fitting)."""
        return self._kernel_keys_of(b, node, part)[0]

    def _kernel_keys_of(self, b: Any, node: Node, part: Part) -> list[tuple[Any, ...]]:
        """The resident kernels a part of a matrix node needs on ``b``: one per weight matrix
        (per converted row range), and for a routed product one per expert."""
        w = node.inputs[0]
        if node.op in ROUTED_OPS:
            return [(w.name, e) for e in range(w.shape[0])]
        _wt, conv, _ = self.route(b, w)
        return [(w.name, part.r0, part.r1) if conv else (w.name,)]

    # -- planning ---------------------------------------------------------------------------

    def plan(self, graph: Graph, spec: str | SplitSpec | None, *, predict: bool = False,
             commit: bool = True) -> Plan:
        """Plan ``graph`` under ``spec``; raises :class:`PlanError` naming what is wrong."""
        s = self.check(spec)
        if self.hubs > 1:
            return self._hubs_plan(graph, s)
        T = graph.T or max((n.inputs[1].rows for n in graph.mul_mats()), default=1)
        notes: list[str] = []
        candidates: list[tuple[str, float]] = []
        family = s.kind
        if s.kind == "none":
            assign: dict[int, list[Part]] = {}
        elif s.kind == "layer":
            assign = self._layer(graph, s, notes)
        elif s.kind == "tensor":
            assign = self._tensor(graph, s, notes)
        elif s.kind == "mode":
            assign = self._mode(graph, s, T, notes)
        else:
            assign, family, candidates = self._auto(graph, T, notes)
        self._check_caps(graph, assign, s)
        items = self._lower(graph, assign, self.workspace)
        dropped = sum(n.op == "quantize_q8_1" for n in graph.nodes) - sum(
            isinstance(it, HubOp) and it.node is not None and it.node.op == "quantize_q8_1" for it in items)
        if dropped:
            notes.append(f"{dropped} quantize_q8_1 node(s) not run: every mat-vec reading that q8_1 x runs "
                         "on a backend, which reads x in f32")
        sch = build_schedule(items)
        participants = [p for p in self.names if p == HUB or any(j.op.backend == p for j in sch.jobs)]
        plan = Plan(graph, s, family, assign, items, sch, participants, _dedupe(notes), candidates=candidates)
        if commit:
            for p, keys in self._kernel_keys(graph, assign).items():
                self.workspace.resident(p).update(keys)
        if (predict or s.kind == "auto") and self.cost is not None:
            self.cost.prepare(graph, self._job_needs(sch))
            plan.prediction = simulate(sch, self.cost)
        return plan

    # -- several Vulkan hubs ---------------------------------------------------------------

    def hub_shares(self, spec: str | SplitSpec) -> list[float]:
        """What each hub of a model over several hubs holds under ``spec``: the share of the
        layers (``layer[:R,...]``: a pipeline of stages, equal shares by default) or of every
        matrix's rows (``tensor:1,1``: shards with an all-reduce after each attention and FFN).
        The model places weights and KV cache by it at load; raises :class:`PlanError` for a
        spec the hubs cannot run."""
        s = parse_spec(spec)
        n = self.hubs
        if s.kind not in ("layer", "tensor"):
            raise PlanError(f"split '{s}' on a model over {n} hubs: several hubs split the model by layers "
                            "(a pipeline) or by rows (shards)" + (", auto is chosen among them when the model "
                                                                   "loads" if s.kind == "auto" else ""),
                            f"use layer (equal shares) or layer:{','.join(['1'] * n)} (--split-mode layer), "
                            "or tensor:1,1 over two hubs (--split-mode row), or load the model with split "
                            "auto (vkxsplit.load_model(..., devices=..., split='auto'))")
        if s.overrides:
            raise PlanError(f"split '{s}': a model over several hubs takes layer shares, not REGEX=NAME overrides",
                            f"e.g. layer:{','.join(['1'] * n)}")
        if s.kind == "tensor" and s.filter:
            raise PlanError(f"split '{s}': the row split over hubs splits every matrix (no @REGEX)")
        if s.kind == "tensor" and n != 2:
            raise PlanError(f"split '{s}': the row split over hubs halves every layer's heads and FFN width "
                            f"over two hubs (this model opened {n})", "open two hubs, or use the layer split")
        shares = [1.0] * n if not s.ratios else [self._ratios(s)[p] for p in self.names]
        if s.kind == "tensor" and len(set(shares)) != 1:
            raise PlanError(f"split '{s}': the row split over hubs halves every layer's heads and FFN width "
                            f"over two hubs (this model opened {n})",
                            "give equal shares over two hubs (tensor:1,1), or use the layer split")
        return shares

    def choose_hub_split(self, candidates: Sequence[HubCandidate], cost: CostModel | None = None
                         ) -> tuple[HubCandidate, list[tuple[str, float]], list[str]]:
        """``auto`` over several hubs: each candidate's steps planned as :meth:`_hubs_plan` plans
        them (each node on its hub, a relay crossing per cross-hub wait), their times predicted
        by :func:`.cost.simulate` over ``cost`` (default: the planner's), weighted by how often
        each step runs; returns the cheapest candidate, every candidate's predicted seconds, and
        what the prediction estimated rather than read from measurements."""
        cost = cost or self.cost
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
                pred = simulate(build_schedule(_hub_items(g)), cost)
                total += times * pred.total_s
                est.update(pred.estimated)
            table.append((c.label, total))
        best = min(range(len(candidates)), key=lambda i: table[i][1])
        return candidates[best], table, sorted(est)

    def _hubs_plan(self, graph: Graph, s: SplitSpec) -> Plan:
        """A model over several hubs: each node runs on the hub that holds its buffers
        (``Node.hub``, set where the model built that hub's part of the graph). The nodes that
        cross hubs are those touching host pages several hubs import (the hidden-state links of
        a layer split, the partials of a row split's all-reduces): the schedule cuts a segment
        there and makes it wait for the other hub's (:func:`.schedule.build_schedule`), and the
        executor's relay carries that wait (signalling for a layer split, submitting the next
        segment for a row split: :mod:`vkxsplit.relay`)."""
        assign = {n.index: [Part(self.names[n.hub], 0, out_rows(n))] for n in graph.nodes}
        items = _hub_items(graph)
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
        plan = Plan(graph, s, s.kind, assign, items, sch, list(self.names), notes)
        plan.cross = "submit" if s.kind == "tensor" else "signal"
        plan.cross_nodes = [n.name for n in cross]
        # bytes written into the memory of several hubs per step: what crosses between them
        esz = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
        plan.crossed_bytes = sum(n.output.rows * n.output.cols * esz.get(n.output.dtype, 4) for n in graph.nodes
                                 if len(keys[span(n.output)[0]]) > 1)
        return plan

    def _place(self, assign: dict[int, list[Part]], node: Node, p: str, notes: list[str], *, why: str,
               soft: bool = True) -> None:
        N = node.output.rows if node.op in NODE_OPS else out_rows(node)
        if p == HUB:
            assign.pop(node.index, None)
            return
        bad = self.why_not(self.backends[p], node, soft=soft)
        if bad is not None:
            kind, reason = bad
            if kind == "hard":
                raise PlanError(f"{why} puts {node.name} on {p}, which cannot run it: {reason}")
            notes.append(f"{node.name} stays on the hub: {reason}")
            assign.pop(node.index, None)
            return
        assign[node.index] = [Part(p, 0, N)]

    def _layer(self, graph: Graph, spec: SplitSpec, notes: list[str]) -> dict[int, list[Part]]:
        assign: dict[int, list[Part]] = {}
        taken: set[int] = set()
        for ov in spec.overrides:
            p = self._name(ov.backend, spec)
            matched = graph.find(ov.pattern)
            if not matched:
                sample = ", ".join(n.name for n in matrices(graph)[:3])
                raise PlanError(f"split '{spec}': override '{ov.pattern}={ov.backend}' matches no node or tensor "
                                f"of {graph.name}", f"names look like {sample} (regexes use re.search)")
            mms = [n for n in matched if n.op in OFFLOADABLE_OPS]
            if not mms and p != HUB:
                b = self.backends[p]
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
                self._place(assign, n, p, notes, why=f"override '{ov.pattern}={ov.backend}'")
            if skipped and p != HUB:
                notes.append(f"'{ov.pattern}' also matches {skipped} op(s) other than mul_mat: they stay on the hub")
        ratios = self._ratios(spec)
        if not ratios and not spec.overrides:
            ratios = {p: 1.0 for p in self.names}
        if ratios:
            n_layer = graph.n_layer
            total = sum(ratios.values())
            bounds: list[tuple[str, float, float]] = []
            acc = 0.0
            for p in self.names:
                r = ratios.get(p, 0.0)
                bounds.append((p, acc / total * n_layer, (acc + r) / total * n_layer))
                acc += r
            for n in matrices(graph):
                if n.index in taken or n.layer is None:
                    continue
                mid = n.layer + 0.5
                owner = next((p for p, a, b in bounds if a <= mid < b and b > a), HUB)
                self._place(assign, n, owner, notes, why=f"layer split '{spec}'")
        return assign

    def _filtered(self, graph: Graph, spec: SplitSpec, pattern: str | None) -> list[Node]:
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

    def bounds(self, N: int, shares: Sequence[float]) -> list[tuple[int, int]]:
        """Row ranges for ``shares`` of N rows: contiguous, in order, boundaries on multiples
        of the granule (the last one at N); a share of 0 gets an empty range."""
        total = sum(shares)
        if total <= 0:
            raise PlanError("every ratio is 0")
        g = max(1, min(self.granule, N))
        last = max(i for i, s in enumerate(shares) if s > 0)
        cuts = [0]
        acc = 0.0
        for i, s in enumerate(shares):
            acc += s
            end = N if i >= last else min(N, int(round(acc / total * N / g)) * g)
            cuts.append(max(end, cuts[-1]))
        return [(cuts[i], cuts[i + 1]) for i in range(len(shares))]

    def _tensor(self, graph: Graph, spec: SplitSpec, notes: list[str]) -> dict[int, list[Part]]:
        ratios = self._ratios(spec)
        assign: dict[int, list[Part]] = {}
        shares = [ratios.get(p, 0.0) for p in self.names]
        for n in self._filtered(graph, spec, spec.filter):
            N = out_rows(n)  # (a routed product: the rows of every expert)
            parts: list[Part] = []
            for p, (r0, r1) in zip(self.names, self.bounds(N, shares)):
                if r1 <= r0:
                    continue
                if p != HUB:
                    bad = self.why_not(self.backends[p], n)
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

    def _mode(self, graph: Graph, spec: SplitSpec, T: int, notes: list[str]) -> dict[int, list[Part]]:
        rules = self._rules(spec)
        assign: dict[int, list[Part]] = {}
        hit = [r for r in rules if (r.lo or 1) <= T <= (math.inf if r.hi is None else r.hi)]
        for r in rules:
            self._filtered(graph, spec, r.filter)  # a filter matching nothing is an error at any T
        if not hit:
            notes.append(f"T={T}: no rule takes this batch size; everything runs on the hub")
            return assign
        rule = hit[0]
        explicit = any(o.backend == rule.backend and o.explicit for o in spec.rules)
        for n in self._filtered(graph, spec, rule.filter):
            self._place(assign, n, rule.backend, notes, why=f"mode rule {rule.describe()}", soft=not explicit)
        if rule.filter is None:
            self._add_glue(graph, assign, rule.backend)
        return assign

    def _add_glue(self, graph: Graph, assign: dict[int, list[Part]], name: str) -> dict[int, list[Part]]:
        """Put the glue between the matmuls (norms, SwiGLU, residual adds) on backend ``name``
        too, where it runs them (``caps.ops`` and ``run_op``). Why: every hand-off between hub
        and backend costs a round trip (~0.3 ms hub <-> cuda on the H200); with the glue on the
        backend a decoder layer crosses once (attention stays on the hub) instead of four
        times."""
        b = self.backends.get(name)
        if b is not None and b.caps.ops & NODE_OPS and type(b).implements("run_op"):
            # a norm / SwiGLU that also writes the q8_1 x of decode mat-vecs (DecodeQ8) may go
            # too when none of those mat-vecs runs on the hub: the backend reads f32 x
            hub_xq = hub_xq_reads(graph, assign)
            for n in graph.nodes:
                if n.op in NODE_OPS and self.why_not(b, n, hub_xq=hub_xq) is None:
                    assign[n.index] = [Part(b.name, 0, n.output.rows)]
        return assign

    def _kernel_keys(self, graph: Graph, assign: dict[int, list[Part]]) -> dict[str, set[tuple[Any, ...]]]:
        out: dict[str, set[tuple[Any, ...]]] = {}
        for idx, parts in assign.items():
            n = graph.nodes[idx]
            if n.op in NODE_OPS:  # no weight matrix: nothing resident
                continue
            for part in parts:
                if part.participant == HUB:
                    continue
                b = self.backends[part.participant]
                if b.caps.max_kernels is not None:
                    out.setdefault(b.name, set()).update(self._kernel_keys_of(b, n, part))
        return out

    def _check_caps(self, graph: Graph, assign: dict[int, list[Part]], spec: SplitSpec) -> None:
        for name, keys in self._kernel_keys(graph, assign).items():
            cap = self.backends[name].caps.max_kernels
            have = self.workspace.resident(name)
            total = keys | have
            if len(total) > cap:
                shown = ", ".join(_compress(sorted({k[0].removesuffix(".weight") for k in keys})))
                raise PlanError(
                    f"split '{spec}' puts {len(keys)} weight matrices on {name}"
                    + (f" (plus {len(have - keys)} other plans loaded)" if have - keys else "")
                    + f", which holds at most {cap} resident kernels: {shown}",
                    "restrict it with a regex (layer:'blk\\.0\\.ffn_.*=NAME', tensor:...@REGEX, "
                    "mode:NAME>=N@REGEX) or use auto, which picks the ones that save most")

    def _lower(self, graph: Graph, assign: dict[int, list[Part]], ws: Workspace) -> list[Item]:
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
                b = self.backends[part.participant]
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
                wt, conv, why = self.route(b, w)
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
                items.append(BackendOp(b.name, n.name if group is None else f"{n.name}[{part.r0}:{part.r1}]",
                                       n, wtensor, w_row0, xt, y, part.r0, part.r1, group, conv))
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

    def _job_needs(self, sch: Schedule) -> set[tuple[str, str, int, int, int]]:
        return {(j.op.backend, j.op.weight.dtype, *j.op.mul_mat_shape()) if isinstance(j.op, BackendIdOp)
                else (j.op.backend, j.op.weight.dtype, j.op.N, j.op.K, j.op.M) for j in sch.jobs
                if isinstance(j.op, (BackendOp, BackendIdOp))}

    # -- auto ---------------------------------------------------------------------------------

    def _auto(self, graph: Graph, T: int, notes: list[str]) -> tuple[dict[int, list[Part]], str,
                                                                     list[tuple[str, float]]]:
        cost = self.cost
        if cost is None:
            raise PlanError("split 'auto' needs a cost model (a measured device profile)",
                            "plan through a loaded model (vkxsplit.load_model) or pass "
                            "Planner(cost=vkxsplit.calibrate.MeasuringCostModel(...))")
        mms = graph.mul_mats()
        able: dict[int, list[str]] = {}
        needs: set[tuple[str, str, int, int, int]] = set()
        for n in mms:
            ps = []
            for name, b in self.backends.items():
                if self.why_not(b, n) is None:
                    ps.append(name)
                    wt, _conv, _ = self.route(b, n.inputs[0])
                    w = n.inputs[0]
                    needs.add((name, wt or w.dtype, w.shape[0], w.shape[-1], n.inputs[1].rows))
            able[n.index] = ps
        cost.prepare(graph, needs)

        def whole(n: Node, p: str) -> float:
            if p == HUB:
                return cost.hub_node(n)
            b = self.backends[p]
            w, x = n.inputs
            wt, _conv, _ = self.route(b, w)
            t = cost.latency(p) + cost.job(p, wt or w.dtype, w.shape[0], w.shape[-1], x.rows)
            if b.caps.x_dtype != "f32":
                t += cost.convert(x.rows * x.cols)
            return t

        costs = {n.index: {p: whole(n, p) for p in [HUB, *able[n.index]]} for n in mms}
        cands: list[tuple[str, dict[int, list[Part]]]] = [("none", {})]
        # mode-like: one backend takes every mul_mat it can
        for name in self.backends:
            choice = {n.index: name for n in mms if name in able[n.index]}
            if choice:
                only = {i: {HUB: c[HUB], name: c[name]} for i, c in costs.items() if name in c}
                cands.append((f"mode:{name}", self._add_glue(graph, self._cap_fit(graph, choice, only), name)))
        # layer-like: each mul_mat on its cheapest participant
        best = {i: min(c, key=c.get) for i, c in costs.items()}  # type: ignore[arg-type]
        greedy = self._cap_fit(graph, {i: p for i, p in best.items() if p != HUB}, costs)
        cands.append(("layer", greedy))
        # tensor: rows divided where that beats the cheapest single participant
        mixed = {k: list(v) for k, v in greedy.items()}
        any_split = False
        for n in mms:
            ps = [HUB] + [p for p in able[n.index]
                          if self.backends[p].caps.max_kernels is None and not self.route(self.backends[p], n.inputs[0])[1]]
            if len(ps) < 2:
                continue
            lat = {p: (0.0 if p == HUB else cost.latency(p)) for p in ps}
            full = {p: (costs[n.index][HUB] if p == HUB else costs[n.index][p] - lat[p]) for p in ps}
            shares, finish = _water_fill(lat, full)
            whole_best = min(costs[n.index].values())
            if finish < 0.95 * whole_best and sum(1 for v in shares.values() if v > 0) > 1:
                N = n.inputs[0].shape[0]
                parts = [Part(p, r0, r1) for p, (r0, r1) in zip(ps, self.bounds(N, [shares[p] for p in ps]))
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
            sch = build_schedule(self._lower(graph, assign, dry))
            results.append((label, simulate(sch, cost).total_s, assign))
        label, _t, assign = min(results, key=lambda r: r[1])
        fam = label.split(":")[0]
        notes.append(f"auto picked {label} for T={T}")
        return assign, fam, [(lb, t) for lb, t, _ in results]

    def _cap_fit(self, graph: Graph, choice: dict[int, str], costs: dict[int, dict[str, float]]) -> dict[int, list[Part]]:
        """Whole-op assignment ``choice`` with capped backends limited to the ops where they save
        most (kernels already resident first); the rest go to their next cheapest participant."""
        choice = dict(choice)
        for name, b in self.backends.items():
            cap = b.caps.max_kernels
            if cap is None:
                continue
            mine = [i for i, p in choice.items() if p == name]
            resident = self.workspace.resident(name)

            def saving(i: int, name: str = name) -> float:
                alt = min(v for p, v in costs[i].items() if p != name)
                return alt - costs[i][name]

            keys = {i: self._kernel_key(b, graph.nodes[i], Part(name, 0, graph.nodes[i].inputs[0].shape[0]))
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


def _hub_items(graph: Graph) -> list[Item]:
    """Every node of a graph over several hubs as an item of its hub (``Node.hub``)."""
    return [HubOp("node", n.name, n.reads(), n.writes(), node=n, hub=n.hub) for n in graph.nodes]


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
    out: list[Part] = []
    for p in parts:
        if out and out[-1].participant == p.participant == HUB and out[-1].r1 == p.r0:
            out[-1] = Part(HUB, out[-1].r0, p.r1)
        else:
            out.append(p)
    return out


def _dedupe(xs: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in xs if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]


__all__ = ["F32_ONLY_OPS", "GRANULE", "HUB_AUTO_WORKLOAD", "OFFLOADABLE_OPS", "HubCandidate", "Part", "Plan", "Planner"]
