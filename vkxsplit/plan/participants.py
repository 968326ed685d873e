"""The participants of a plan, and what each can take.

A :class:`Participants` is the hub and the attached backends (``hub``, ``cpu``, ...), or one
Vulkan hub per device of a model over several hubs (``hub0``, ``hub1``, ...). It answers what
a split spec means for them before any graph is seen (:meth:`Participants.check`: names, ratio
counts, mode rules' batch ranges; over several hubs :meth:`~Participants.hub_shares`, what each
hub holds) and what a backend can run (:meth:`~Participants.route`: the weight type it is
handed, converted or not; :meth:`~Participants.why_not`: why a node cannot go to it; the
resident kernels a capped backend would hold). :class:`vkxsplit.plan.planner.Planner` is a
``Participants`` that also plans; the split kinds (:mod:`.strategies`) ask it these questions.

Imports: ``vkxsplit.backend`` (``NODE_OPS``, ``STEP_OPS``), ``vkxsplit.graph``,
``vkxsplit.errors``, ``vkxsplit.ops.quant`` (lazily) and the modules of this package below it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..backend import NODE_OPS as GLUE_OPS
from ..backend import STEP_OPS
from ..errors import PlanError
from ..graph import Graph, Node, Tensor
from .result import OFFLOADABLE_OPS, ROUTED_OPS, Part, _compress
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
_HUB_N = re.compile(r"hub(\d+)")  # the participant name of Vulkan hub N of a model over several hubs


def _has_hook(b: Any, hook: str) -> bool:
    """Whether backend ``b`` overrides optional hook ``hook`` (stand-ins without the Backend
    class's ``implements``, in dry planning: whether their caps say so is all there is)."""
    impl = getattr(type(b), "implements", None)
    return True if impl is None else bool(impl(hook))


def matrices(graph: Graph) -> list[Node]:
    """The nodes a backend may take as matrix products (:data:`OFFLOADABLE_OPS`)."""
    return [n for n in graph.nodes if n.op in OFFLOADABLE_OPS]


class Participants:
    """The participants of the plans of one set of attached backends (or of hubs).

    ``backends``: objects with ``name`` and ``caps`` (attached :class:`~vkxsplit.backend.Backend`\\ s,
    or stand-ins for dry planning). ``workspace``: where inserted memory comes from (default:
    dry, buffer-less), and the kernels each capped backend holds resident. ``require_shared``:
    offload only nodes whose memory backends can reach. ``hubs``: the Vulkan hubs of the model
    (more than one: the participants are ``hub0..hubN``, no backends)."""

    def __init__(self, backends: Iterable[Any] = (), *, workspace: Workspace | None = None,
                 require_shared: bool = True, granule: int = GRANULE, hubs: int = 1) -> None:
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
        self.workspace = workspace or Workspace()
        self.require_shared = require_shared
        self.granule = granule

    # -- split specs checked against the participants ----------------------------------------

    def participant(self, name: str, spec: SplitSpec) -> str:
        """The participant ``name`` in ``spec`` stands for (``hub``/``vulkan``: the first hub)."""
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

    def ratios(self, spec: SplitSpec) -> dict[str, float]:
        """The ratio of each participant in a ``layer`` or ``tensor`` spec ({} without ratios)."""
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
                r[self.participant(n or "", spec)] = v
        if sum(r.values()) <= 0:
            raise PlanError(f"split '{spec}': every ratio is 0, nothing would compute")
        return r

    def rules(self, spec: SplitSpec) -> list[Rule]:
        """A ``mode`` spec's rules with their batch ranges filled in from the backends' caps."""
        out: list[Rule] = []
        seen: set[str] = set()
        for r in spec.rules:
            name = self.participant(r.backend, spec)
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
        ranges); returns the parsed spec. Graph-level checks happen in
        :meth:`vkxsplit.plan.planner.Planner.plan`."""
        s = parse_spec(spec)
        if self.hubs > 1:
            self.hub_shares(s)
        for n in s.names():
            self.participant(n, s)
        if s.kind in ("tensor", "layer"):
            self.ratios(s)
        if s.kind == "mode":
            self.rules(s)
        return s

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
        shares = [1.0] * n if not s.ratios else [self.ratios(s)[p] for p in self.names]
        if s.kind == "tensor" and len(set(shares)) != 1:
            raise PlanError(f"split '{s}': the row split over hubs halves every layer's heads and FFN width "
                            f"over two hubs (this model opened {n})",
                            "give equal shares over two hubs (tensor:1,1), or use the layer split")
        return shares

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
        x tensors hub-run mat-vecs read under the assignment being made (:func:`.lowering.hub_xq_reads`);
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

    def kernel_keys_of(self, b: Any, node: Node, part: Part) -> list[tuple[Any, ...]]:
        """The resident kernels a part of a matrix node needs on ``b``: one per weight matrix
        (per converted row range), and for a routed product one per expert."""
        w = node.inputs[0]
        if node.op in ROUTED_OPS:
            return [(w.name, e) for e in range(w.shape[0])]
        _wt, conv, _ = self.route(b, w)
        return [(w.name, part.r0, part.r1) if conv else (w.name,)]

    def kernel_keys(self, graph: Graph, assign: dict[int, list[Part]]) -> dict[str, set[tuple[Any, ...]]]:
        """The resident kernels ``assign`` puts on each backend that holds a limited number."""
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
                    out.setdefault(b.name, set()).update(self.kernel_keys_of(b, n, part))
        return out

    def check_caps(self, graph: Graph, assign: dict[int, list[Part]], spec: SplitSpec) -> None:
        """Refuse an assignment that puts more resident kernels on a capped backend than it holds
        (counting those the plans made before keep loaded)."""
        for name, keys in self.kernel_keys(graph, assign).items():
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


__all__ = ["F32_ONLY_OPS", "GRANULE", "NODE_OPS", "Participants", "matrices"]
