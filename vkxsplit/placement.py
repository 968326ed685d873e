"""Where a model lives: its hubs, its backends, and what each hub holds, decided at load.

:class:`PlacedModel` is the part of :class:`vkxsplit.model.Model` that opens the Vulkan hubs
(one, or one per device of ``devices=``) and attaches the backends (their shared memory, a
:class:`~vkxsplit.attach.SharedArena`), then places the model over the hubs from the split
spec, once, at load (:meth:`~PlacedModel._place`): the whole model on one hub; a layer range
per hub (a pipeline, a prompt step cut into micro-batches, each in its own slot of rows) with
the host pages between neighbours; or a row shard per hub with the pages of their all-reduces.
The shares themselves (weights, KV cache, activations, per-step buffers) are
:class:`vkxsplit.hubs.HubShare` s. ``auto`` over several hubs is decided here too
(:meth:`~PlacedModel._choose_hub_split`: one hub, the layer split or the row split, priced
over dry shares before anything is placed), as is the type the row split's partial sums cross
in (:meth:`~PlacedModel.reduce_dtype`); both ask the cost model of these hubs and backends
(:attr:`~PlacedModel.cost`, measuring on them what the device profile lacks).

Every attribute here is set by :meth:`vkxsplit.model.Model.__init__`, which loads in the order
of this module: open the hubs, attach, check the split, place.

Imports: ``vkxsplit.hubs``, ``vkxsplit.plan``, ``vkxsplit.calibrate`` (the measuring cost
model), ``vkxsplit.relay``, ``vkxsplit.vk``, ``vkxsplit.generation``; never the executor.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any

import numpy as np

from .attach import SharedArena
from .backend import Backend, create_backend
from .calibrate import MeasuringCostModel, hub_node_times
from .errors import VkxError
from .features import is_disabled
from .generation import LanguageModel
from .gguf_model import ModelFile
from .graph import Graph
from .hubs import (
    WORLD,
    DryHubShare,
    DryLink,
    HostLink,
    HubShare,
    join_hub_graphs,
    layer_ranges,
    shard_hparams,
    slot_rows,
)
from .plan.cost import CostModel
from .plan.hub_split import HUB_AUTO_WORKLOAD, HubCandidate, choose_hub_split
from .plan.planner import Planner
from .plan.profile import Profile
from .plan.spec import SplitSpec, parse_backends, parse_spec
from .plan.workspace import ArenaWorkspace
from .relay import Relay
from .vk.device import Device
from .vk.memory import _align

log = logging.getLogger("vkxsplit.model")


class PlacedModel(LanguageModel):
    """A language model placed over its hubs and backends (see the module docstring; the
    attributes are :class:`vkxsplit.model.Model`'s)."""

    path: Path
    file: ModelFile
    device: Device                       # hub 0
    hubs: list[Device]
    shares: list[HubShare]               # what each hub holds
    links: list[HostLink]                # host pages between hubs
    relay: Relay | None                  # the one relay between hubs (several hubs)
    timeout: float | None
    ranges: list[tuple[int, int]]        # each hub's layers (a layer split)
    micro: int                           # a prompt step's micro-batches (a layer split over hubs)
    piece: int                           # tokens per micro-batch
    slots: int                           # rows sets of the per-step buffers (one per micro-batch)
    backends: dict[str, Any]
    _owned_backends: list[Any]
    arena: Any                           # the memory shared with the backends
    workspace: ArenaWorkspace | None
    planner: Planner
    split: SplitSpec
    partials: str                        # the row split's partial sums: auto, f32, f16 or bf16
    _reduce_min: tuple[int | None, str] | None
    hub_choice: dict[str, Any] | None    # auto over several hubs: what it chose at load
    _cost: CostModel | None
    _profile_dir: str | Path | None
    _own_device: bool
    given_back: dict[str, int]           # weights whose stored pages were given back (name -> bytes)

    # -- hubs and backends --------------------------------------------------------------------

    def _open_hubs(self, device: Device | None, sels: list[Any] | None) -> None:
        """Hub 0 is ``device`` (opened here when None); with ``sels``, one hub per selector."""
        if sels is None:
            self.device = device or Device.open()
            self.hubs = [self.device]
        else:
            for sel in sels:
                self.hubs.append(Device.open(sel))
                self.device = self.hubs[0]  # (at once: close() after a failed open closes it)
            self._own_device = True

    def _attach(self, backends: Any) -> None:
        """Attach ``backends`` (names, ``(name, options)`` or :class:`~vkxsplit.backend.Backend`
        objects, which stay the caller's) to hub 0, with the memory they share with it."""
        for item in parse_backends(backends):
            if isinstance(item, Backend):
                b = item
            else:
                name, opts = item if isinstance(item, tuple) else (item, {})
                b = create_backend(name, self.device, **opts)
                self._owned_backends.append(b)
            if b.name in self.backends:
                raise VkxError(f"backend {b.name} is attached twice")
            self.backends[b.name] = b
        if self.backends:
            self.arena = SharedArena(self.device, list(self.backends.values()), name=f"model:{self.path.name}")
            self.workspace = ArenaWorkspace(self.device, self.arena)

    # -- what each hub holds ------------------------------------------------------------------

    def _place(self, micro_batches: int | None, progress: Any) -> None:
        """What each hub holds (:mod:`vkxsplit.hubs`), from the split spec: the whole model on
        one hub; layer ranges by share (a pipeline; micro-batches in slots); or row shards."""
        hubs, n, E = self.hubs, len(self.hubs), self.hp.n_embd
        if micro_batches is not None:  # (1: one piece, what every split but the layer split runs)
            if int(micro_batches) < 1:
                raise VkxError(f"micro_batches {micro_batches}: a prompt step goes as at least 1 piece",
                               "give micro_batches at least 1 (--micro-batches), or leave it out")
            if int(micro_batches) > 1 and (n == 1 or self.split.kind != "layer"):
                raise VkxError(f"micro_batches={micro_batches} puts pieces of a prompt step in flight on "
                               "different hubs: it goes with a layer split over several hubs, not "
                               + (f"split {self.split}" if n > 1 else "a model on one hub"),
                               "drop micro_batches, or split the layers: devices='0,1' (split 'layer')")
        if n == 1:
            self.shares = [HubShare(self, 0, self.device)]
        elif self.split.kind == "layer":
            self.ranges = layer_ranges(self.hp.n_layer, self.planner.hub_shares(self.split))
            self.micro, self.piece = self._pieces(micro_batches)
            self.slots = self.micro
            link_bytes = self.micro * slot_rows(self.piece, self.micro) * E * 4
            for i in range(n - 1):
                self.links.append(HostLink([hubs[i], hubs[i + 1]], link_bytes, f"link{i}"))
            for i, rng in enumerate(self.ranges):
                self.shares.append(HubShare(self, i, hubs[i], layers=rng,
                                            link_in=self.links[i - 1].views[1] if i > 0 else None,
                                            link_out=self.links[i].views[0] if i < n - 1 else None))
        else:  # tensor: row shards, an all-reduce through host pages both hubs import
            shard_hparams(self.hp)  # refuse early, with the reason
            slot = _align(self.ubatch * E * 4, 256)
            pages = HostLink(hubs, 2 * WORLD * slot, "row-split")
            self.links.append(pages)

            def views(dev: int, owner: int) -> list[Any]:  # (buffer as hub dev sees it, offset) per parity
                return [(pages.views[dev], (owner * 2 + p) * slot) for p in range(2)]

            for r in range(n):
                self.shares.append(HubShare(self, r, hubs[r], rank=r, publish=views(r, r), peer=views(r, 1 - r)))
        for sh in self.shares:
            sh.upload_weights(progress)
            sh.alloc_state()
        if n > 1:  # (a spin on the counters would take a core from a CPU device)
            self.relay = Relay("hub-relay", self.timeout, spin_s=0.0 if any(d.is_cpu for d in hubs) else None)

    def _pieces(self, micro_batches: int | None) -> tuple[int, int]:
        """(micro-batches, tokens per micro-batch) of a prompt step of a layer split over the
        hubs: ``micro_batches`` pieces, by default twice the hubs, pieces of at least 32 tokens."""
        n = len(self.hubs)
        want = 2 * n if micro_batches is None else int(micro_batches)
        micro = max(1, min(want, self.ubatch // 32 if micro_batches is None else self.ubatch, self.ubatch))
        piece = -(-self.ubatch // micro)  # tokens per micro-batch
        return -(-self.ubatch // piece), piece  # the pieces a full step has (8 in 5 -> 4 of 2)

    def _choose_hub_split(self, micro_batches: int | None) -> tuple[str, int | None]:
        """``auto`` over several hubs, decided here because the weights are placed at load: one
        hub (the others closed), the layer split or the row split, whichever the cost model
        predicts cheapest for :data:`~vkxsplit.plan.hub_split.HUB_AUTO_WORKLOAD`
        (:func:`~vkxsplit.plan.hub_split.choose_hub_split` over each candidate's graphs, built
        over dry shares: no weight read or placed). Hub node times come from the device profile where an
        earlier run measured those shapes, else the cost model's roofline estimate (named in
        ``hub_choice``); the relay crossing is the cost model's. Returns the spec to place and
        ``micro_batches`` (dropped unless the layer split wins)."""
        cands: list[HubCandidate] = []
        notes: list[str] = []
        for label, spec in (("one hub", "none"), ("layer", "layer"), ("row", "tensor:1,1")):
            try:
                cands.append(HubCandidate(label, spec, self._dry_steps(spec, micro_batches)))
            except VkxError as exc:  # (a model the row split cannot halve; more than two hubs)
                notes.append(f"{label}: not a candidate ({exc})")
        cost = self.cost
        if isinstance(cost, MeasuringCostModel):  # what the profile lacks of the candidates' nodes
            cost.prepare()  # (the hub's submit overhead)
            for c in cands:
                for g, _times in c.steps:
                    cost.measure_dry(g, self.hubs, self.n_ctx)
        picked, table, est = choose_hub_split(cands, cost)
        prompt, decode = HUB_AUTO_WORKLOAD
        self.hub_choice = {"picked": picked.label, "spec": picked.spec, "candidates": table, "estimated": est,
                           "workload": f"a {prompt}-token prompt in steps of {min(prompt, self.ubatch)} and "
                                       f"{decode} decode steps", "notes": notes}
        log.info("auto over %d hubs: %s (%s)", len(self.hubs), picked.label,
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in table))
        if picked.spec == "none":  # one hub: the others are closed, the model is a one-hub model
            for d in self.hubs[1:]:
                d.close()
            self.hubs = self.hubs[:1]
            self.planner = Planner(self.backends.values(), workspace=self.workspace, hubs=1, cost=cost)
        return picked.spec, micro_batches if picked.spec == "layer" else None

    def _dry_steps(self, spec: str, micro_batches: int | None) -> list[tuple[Graph, float]]:
        """The graphs of :data:`HUB_AUTO_WORKLOAD`'s steps (a prompt step of ``ubatch`` tokens,
        as its micro-batches for a layer split, and a decode step) of the model placed over the
        hubs by ``spec``, over dry shares (:class:`vkxsplit.hubs.DryHubShare`), with how often
        each runs."""
        hubs, n, E = self.hubs, len(self.hubs), self.hp.n_embd
        kind = parse_spec(spec).kind
        stub = types.SimpleNamespace(file=self.file, n_ctx=self.n_ctx, piece=self.ubatch, slots=1, backends={},
                                     arena=None, partials=self.partials, reduce_dtype=self.reduce_dtype)
        if kind == "none":
            shares = [DryHubShare(stub, 0, hubs[0])]
        elif kind == "layer":
            ranges = layer_ranges(self.hp.n_layer, self.planner.hub_shares(spec))
            stub.slots, stub.piece = self._pieces(micro_batches)
            nb = stub.slots * slot_rows(stub.piece, stub.slots) * E * 4
            links = [DryLink([hubs[i], hubs[i + 1]], nb, f"link{i}") for i in range(n - 1)]
            shares = [DryHubShare(stub, i, hubs[i], layers=rng, link_in=links[i - 1].views[1] if i > 0 else None,
                                  link_out=links[i].views[0] if i < n - 1 else None) for i, rng in enumerate(ranges)]
        else:
            self.planner.hub_shares(spec)
            shard_hparams(self.hp)
            slot = _align(self.ubatch * E * 4, 256)
            pages = DryLink(hubs, 2 * WORLD * slot, "row-split")
            shares = [DryHubShare(stub, r, hubs[r], rank=r, publish=[(pages.views[r], (r * 2 + p) * slot) for p in range(2)],
                                  peer=[(pages.views[r], ((1 - r) * 2 + p) * slot) for p in range(2)])
                      for r in range(n)]
        for sh in shares:
            sh.upload_weights()
            sh.alloc_state()

        def step(T: int) -> Graph:
            nodes: list[Any] = []
            for j, s in enumerate(range(0, T, stub.piece)):
                parts = [sh.build_graph(min(stub.piece, T - s), False, j) for sh in shares]
                nodes += join_hub_graphs("", T, parts, interleave=kind == "tensor").nodes
            g = Graph(f"{self.file.name}:{spec}:T{T}", T=T)
            for node in nodes:
                node.index = len(g.nodes)
                g.nodes.append(node)
            return g

        prompt, decode = HUB_AUTO_WORKLOAD
        T = min(prompt, self.ubatch)
        return [(step(T), prompt / T), (step(1), float(decode))]

    # -- the placement in words, and the row split's partials ---------------------------------

    @property
    def split_label(self) -> str:
        """The split in words: the spec, and over several hubs what each holds (and what auto
        compared, when it chose)."""
        hc = self.hub_choice
        if hc is None:
            return self._placed_label()
        costs = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in hc["candidates"])
        return f"auto over {len(hc['candidates'])} candidates ({costs}): {hc['picked']}, {self._placed_label()}"

    def _placed_label(self) -> str:
        if len(self.hubs) == 1:
            return str(self.split)
        if self.split.kind == "layer":
            return f"{self.split}: layers " + ",".join(f"{a}-{b - 1}" for a, b in self.ranges) + \
                f" on hub{'s' if len(self.hubs) > 1 else ''} 0-{len(self.hubs) - 1}"
        return f"{self.split}: tensor split (rows) over {len(self.hubs)} hubs, {self.partials_label}"

    @property
    def partials_label(self) -> str:
        """How the row split's partial sums cross, in words."""
        if self.partials != "auto":
            return f"{self.partials} partials"
        if self._reduce_min is None:
            return "f32 partials, bf16 from a size measured at the first step"
        th, why = self._reduce_min
        return "f32 partials" + (f", bf16 from {th} bytes ({why})" if th is not None else f" ({why})")

    def reduce_dtype(self, nbytes: int) -> str:
        """The type the row split's all-reduce sends a partial sum of ``nbytes`` (as f32) in:
        ``partials``, or for ``auto`` bf16 from the threshold the calibration measured on hub 0
        (:func:`vkxsplit.calibrate.measure_reduce`, kept in the device profile; the cost
        model's documented default until then), f32 below it; always f32 when
        ``VKXSPLIT_DISABLE=bf16_reduce``. Read once per model (every step's graph agrees)."""
        if self.partials != "auto":
            return self.partials
        if self._reduce_min is None:
            if is_disabled(self.device, "bf16_reduce"):
                self._reduce_min = (None, "bf16 switched off: VKXSPLIT_DISABLE=bf16_reduce")
            else:
                cost = self.cost
                th = cost.reduce_threshold()
                est = "bf16 all-reduce threshold" in cost.estimated
                self._reduce_min = (th, "the default, not measured" if est else
                                    "measured" if th is not None else "bf16 was slower at every size measured")
        th = self._reduce_min[0]
        return "bf16" if th is not None and nbytes >= th else "f32"

    # -- the buffers ---------------------------------------------------------------------------

    def _share(self) -> HubShare:
        return self.shares[0]

    # the buffers of a model on one hub (hub 0's share over several hubs; the logits: _out())
    weights = property(lambda self: self._share().weights)
    kv = property(lambda self: self._share().kv)
    act = property(lambda self: self._share().act)
    ids_buf = property(lambda self: self._share().ids_buf)
    pos_buf = property(lambda self: self._share().pos_buf)
    xq_buf = property(lambda self: self._share().xq_buf)
    attn_scratch = property(lambda self: self._share().attn_scratch)
    decode_splits = property(lambda self: self._share().decode_splits)
    slot_rows = property(lambda self: self._share().slot_rows)
    logits_buf = property(lambda self: self._out().logits_buf)
    argmax_buf = property(lambda self: self._out().argmax_buf)

    def _out(self) -> HubShare:
        """The share that makes the logits (the last layer's hub; shard 0 of a row split)."""
        return next(sh for sh in self.shares if sh.makes_logits)

    # -- the cost model of these hubs and backends --------------------------------------------

    @property
    def cost(self) -> CostModel:
        """The cost model (measured on demand, cached in the device profile)."""
        if self._cost is None:
            self._cost = MeasuringCostModel(Profile.for_device(self.device, self._profile_dir), device=self.device,
                                            arena=self.arena, backends=self.backends.values(),
                                            hub_runner=self._time_hub)
            first: dict[bytes, int] = {}  # hubs on one device take it in turn (simulate)
            for i, d in enumerate(self.hubs):
                j = first.setdefault(bytes(d.physical.device_uuid), i)
                if j != i:
                    self._cost.hub_groups[f"hub{i}"] = f"hub{j}"
            if len(self.hubs) > 1:  # the relay crossing, measured between hubs 0 and 1
                self._cost.relay_devices = list(self.hubs)
                self._cost.relay_key = f"relay|{bytes(self.hubs[1].physical.device_uuid).hex()}"
            self.planner.cost = self._cost
        return self._cost

    # -- weights the cpu backend repacked ------------------------------------------------------

    def _repacker(self) -> Any:
        """The attached cpu backend that repacks weights, when the stored pages of the weights
        it repacks may be given back: it is the only backend, on one hub that is a CPU device
        (lavapipe reads the arena's host pages by pointer; a GPU driver pins them), with a
        ``host_allocation`` arena. Else None."""
        if len(self.shares) != 1 or not self.device.is_cpu or len(self.backends) != 1:
            return None
        b = next(iter(self.backends.values()))
        if not getattr(b, "repack", False) or not hasattr(b, "pack"):
            return None
        return b if self.arena is not None and self.arena.kind == "host_allocation" else None

    def _restore_weights(self, names: Any = None) -> None:
        """Write the stored bytes of given-back weights (``names``; None: all) again from the
        file, before anything reads them as stored."""
        from .archs import weight_tensors

        todo = [n for n in self.given_back if names is None or n in names]
        if not todo:
            return
        sh = self.shares[0]
        tensors = weight_tensors(self.file)
        for name in todo:
            ti = tensors[name]
            _shape, data = sh._weight_data(name, ti)
            v = sh.weights[name].buffer
            v.shared.restore(data, v.offset)
            self.file.release_pages(ti.data)  # (the arena's copy is the one kept)
            del self.given_back[name]

    def _time_hub(self, graph: Graph) -> dict[int, float]:
        """Hub seconds per node of ``graph``, run alone with timestamps (over several hubs, each
        hub's nodes on its own device). Positions are the last ``T`` of the context: KV rows
        written there are rewritten before any step reads them."""
        T = graph.T
        self._restore_weights()  # (the hub reads every weight of the graph as stored)
        # the calibration overwrites the outputs: keep what last_logits()/last_argmax() read
        keep_logits = self.logits_buf.numpy(np.float32, (self.hp.n_vocab,)).copy()
        keep_argmax = self.argmax_buf.numpy(np.int32, (1,)).copy()
        try:
            out: dict[int, float] = {}
            for h, sh in enumerate(self.shares):
                nodes = [n for n in graph.nodes if n.hub == h]
                part = graph if len(self.shares) == 1 else Graph(f"{graph.name}:hub{h}", nodes, T)

                def before(sh: HubShare = sh) -> None:
                    sh.ids_buf.numpy(np.int32, (T,))[:] = 0
                    sh.pos_buf.numpy(np.int32, (T,))[:] = np.arange(self.n_ctx - T, self.n_ctx, dtype=np.int32)

                if nodes:
                    out.update(hub_node_times(self.hubs[h], part, before))
            return out
        finally:
            self.logits_buf.numpy(np.float32, (self.hp.n_vocab,))[:] = keep_logits
            self.argmax_buf.numpy(np.int32, (1,))[:] = keep_argmax


__all__ = ["PlacedModel"]
