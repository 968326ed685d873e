"""What each Vulkan hub of a model holds: weights, KV cache, activations, per-step buffers, links.

A :class:`~vkxsplit.model.Model` opens one hub per device it is given (``devices="0,1"``;
the same device twice gives two hubs on one GPU, which is how the tests run on lavapipe) and
keeps one :class:`HubShare` per hub. Which part of the model each hub holds is decided at load
from the split spec (weights are uploaded before the first plan):

- **one hub** (split ``none``, ``layer``, ``tensor``, ``mode``, ``auto`` over attached
  backends): the whole model;
- **layer split over hubs** (``layer:hub0=3,hub1=1``, llama.cpp's ``--split-mode layer``):
  hub ``i`` holds a contiguous range of layers (:func:`layer_ranges`, by share) and their KV
  cache; the first also the token embeddings, the last the output norm and projection. Its
  graph ends with a ``cpy`` of the hidden state into a :class:`HostLink` (host pages both
  devices import: two GPUs of different deviceUUIDs cannot import each other's opaque-fd memory
  or semaphores, host allocations carry no such rule), the next hub's starts with a ``cpy`` out
  of it. Several slots (micro-batches: a prompt step cut into pieces, in flight on different
  hubs at once) use different rows of the links, ids, positions and logits;
- **row split over hubs** (``tensor:hub0=1,hub1=1``, llama.cpp's ``--split-mode row``): shard
  ``r`` of 2 holds half of the attention heads (rows of ``attn_q/k/v``, its KV cache only those
  heads), half of the FFN width (rows of ``ffn_gate/up``) and the matching *columns* of
  ``attn_output`` and ``ffn_down`` (:func:`shard_slices`); norms and embeddings whole, only
  shard 0 makes logits. Its graph is the one-hub graph on its own dimensions
  (:func:`shard_hparams`). A column slice gives a partial sum of the layer's output: the
  all-reduce (:meth:`HubShare._reduce`) copies it into this shard's half of host pages both hubs
  import and adds the other shard's half with ``link_sum``. ``a + b`` and ``b + a`` are the
  same float, so both shards keep bit-identical hidden states. Two slots per shard, by parity
  of the all-reduce: a shard can be at most one all-reduce ahead of the other's reads. As
  llama.cpp's tensor-parallel backends do, a small partial crosses in f32 and a large one (from
  the threshold the calibration measured, :meth:`vkxsplit.placement.PlacedModel.reduce_dtype`)
  as bf16, rounded to nearest even on the sending hub (half the bytes over the bus), widened and
  added in f32 on the receiving one; each shard rounds its own partial the same way, so both
  still add the same two floats.

The planner (:mod:`vkxsplit.plan`) sees one graph with every hub's nodes (``Node.hub``); the
two imports of one :class:`HostLink` are one memory for its dependency analysis
(:func:`vkxsplit.graph.span`), so a node of hub 1 reading what a node of hub 0 wrote there is
a cross-hub dependency the schedule turns into a wait through the relay
(:mod:`vkxsplit.relay`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .archs import build_graph, weight_tensors
from .attach import HostMapping, _memfd, host_page_align, import_host_pages
from .defaults import PARTIALS  # how the all-reduce's partials cross (Model.reduce_dtype)
from .errors import ModelError, VkxError
from .graph import Graph, Tensor
from .vk.command import Uploader
from .vk.kernel import View
from .vk.memory import Buffer, _align

if TYPE_CHECKING:
    from .vk.device import Device

#: bytes of a weight copied to the hub at a time (the file pages behind each chunk are released)
_UPLOAD_CHUNK = 16 << 20

WORLD = 2  # shards of the row split; the all-reduce sums two partials
ROWS = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")  # outputs split: each shard its rows
COLS = ("attn_output", "ffn_down")  # inputs split: each shard a partial sum of the whole output


def slot_rows(ubatch: int, slots: int) -> int:
    """Rows per slot: ``ubatch`` rounded up to 64 rows when there are several slots, so every
    slot's offset into an i32 or f32 buffer is a multiple of 256 bytes (the largest
    ``minStorageBufferOffsetAlignment`` the Vulkan spec allows)."""
    return ubatch if slots <= 1 else -(-ubatch // 64) * 64


def parse_devices(devices: Any) -> list[str | int]:
    """``"0,1"`` / ``[0, "H200"]`` -> device selectors (index or name part, as ``VKXSPLIT_DEVICE``)."""
    if isinstance(devices, (str, int)):
        devices = [d.strip() for d in str(devices).split(",") if d.strip()]
    out = [int(d) if isinstance(d, str) and d.isdigit() else d for d in devices]
    if not out:
        raise VkxError(f"no device in devices={devices!r}", "give device indices or name parts, e.g. 0,1")
    return out


def layer_ranges(n_layer: int, proportions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per hub, sized by ``proportions`` (llama.cpp's
    ``--tensor-split`` rule: cumulative shares rounded to whole layers; every hub at least one
    layer)."""
    props = [float(p) for p in proportions]
    if len(props) < 1 or any(p < 0 or math.isnan(p) for p in props) or sum(props) <= 0:
        raise VkxError(f"bad layer split {list(proportions)}: give one non-negative share per device, "
                       "not all zero (e.g. 1,1)")
    if len(props) > n_layer:
        raise VkxError(f"{len(props)} stages for {n_layer} layers: every stage needs at least one layer")
    total = sum(props)
    bounds = [0]
    acc = 0.0
    for i, p in enumerate(props[:-1]):
        acc += p
        b = round(n_layer * acc / total)
        # at least one layer for this hub and one for each hub after it
        b = max(b, bounds[-1] + 1)
        b = min(b, n_layer - (len(props) - 1 - i))
        bounds.append(b)
    bounds.append(n_layer)
    return [(bounds[i], bounds[i + 1]) for i in range(len(props))]


def shard_hparams(hp: Any, world: int = WORLD) -> Any:
    """The dimensions one row-split shard computes with: its share of the query and KV heads
    and of the FFN width. Raises where the model does not divide (heads, or a column slice that
    would cut a quantization block: checked per weight by :func:`slice_weight`)."""
    bad = [f"{k} {v}" for k, v in (("n_head", hp.n_head), ("n_head_kv", hp.n_head_kv), ("n_ff", hp.n_ff))
           if v % world]
    if bad:
        raise ModelError(f"a tensor split over {world} GPUs needs the heads and the FFN width to divide by "
                         f"{world}: this model has {', '.join(bad)}",
                         "use the layer split (--devices without --split-mode row)")
    return dataclasses.replace(hp, n_head=hp.n_head // world, n_head_kv=hp.n_head_kv // world,
                               n_ff=hp.n_ff // world)


def shard_slices(hp: Any, rank: int, world: int = WORLD) -> dict[str, tuple[str, int, int]]:
    """Per weight kind (``attn_q``, ...): ``("rows" | "cols", start, stop)`` of shard ``rank``,
    in the file's (whole model's) rows or columns."""
    sh = shard_hparams(hp, world)
    q, k, v = sh.n_head * hp.head_dim, sh.n_head_kv * hp.head_dim, sh.n_head_kv * hp.head_dim_v
    o, f = sh.n_head * hp.head_dim_v, sh.n_ff
    return {"attn_q": ("rows", rank * q, (rank + 1) * q), "attn_k": ("rows", rank * k, (rank + 1) * k),
            "attn_v": ("rows", rank * v, (rank + 1) * v), "ffn_gate": ("rows", rank * f, (rank + 1) * f),
            "ffn_up": ("rows", rank * f, (rank + 1) * f),
            "attn_output": ("cols", rank * o, (rank + 1) * o), "ffn_down": ("cols", rank * f, (rank + 1) * f)}


def slice_weight(ti: Any, kind: str, a: int, b: int) -> tuple[tuple[int, ...], np.ndarray]:
    """Rows or columns ``[a, b)`` of tensor ``ti`` as (shape, raw bytes in the file's block
    layout): rows are a zero-copy view of the file; columns a copy of whole blocks of each row."""
    from gguf.constants import GGML_QUANT_SIZES

    if ti.n_dims == 1:  # a bias: its elements, like the rows of the matrix it goes with
        if kind != "rows":  # (an output projection's bias is added once, after the sum)
            raise ModelError(f"{ti.name}: a 1-D tensor cannot be split by columns")
        esz = ti.nbytes // ti.cols
        return (b - a,), ti.data[a * esz:b * esz]
    row_bytes = ti.nbytes // ti.rows
    if kind == "rows":
        return (b - a, ti.cols), ti.data[a * row_bytes:b * row_bytes]
    blk, tsz = GGML_QUANT_SIZES[ti.ggml_type]
    if a % blk or b % blk:
        raise ModelError(f"{ti.name}: columns [{a}, {b}) of a {ti.ggml_type.name} matrix cut its "
                         f"{blk}-value blocks", "use the layer split (--devices without --split-mode row)")
    data = ti.data.reshape(ti.rows, row_bytes)[:, a // blk * tsz:b // blk * tsz]
    return (ti.rows, b - a), np.ascontiguousarray(data).reshape(-1)


def check_partials(partials: str) -> str:
    if partials not in PARTIALS:
        raise VkxError(f"partials {partials!r}: the all-reduce's partial sums cross as {', '.join(PARTIALS[1:])}, "
                       "or auto (f32 for small ones, bf16 from a measured size on)",
                       "give partials='auto' (the default), 'f32', 'f16' or 'bf16'")
    return partials


class HostLink:
    """Host pages two (or more) devices import by pointer: ``views[i]`` is the same bytes as
    device ``i`` binds them. Both imports are one memory for the graph's dependency analysis
    (they share the first import's block serial), so a write through one and a read through the
    other order the two nodes. Owns the memfd, the mapping and the imports."""

    def __init__(self, devices: Sequence[Device], nbytes: int, name: str) -> None:
        align = max(host_page_align(d) for d in devices)
        size = _align(max(int(nbytes), 4), align)
        self.name, self.size = name, size
        self._fd: Any = _memfd(size, f"vkxsplit-{name}")
        self._blocks: list[Any] = []
        self.mapping: HostMapping | None = None
        try:
            self.mapping = HostMapping(self._fd.fd, size, align)
            for dev in devices:
                self._blocks.append(import_host_pages(dev, self.mapping.addr, size, f"link:{name}"))
        except BaseException:
            self.close()
            raise
        for blk in self._blocks[1:]:
            blk._serial = self._blocks[0]._serial  # one memory for vkxsplit.graph.span
        self.views = [Buffer(blk, 0, size, f"{name}:{i}") for i, blk in enumerate(self._blocks)]

    def close(self) -> None:
        """Free the imports, then the pages (after every step using them completed)."""
        for b in self._blocks:
            b.close()
        self._blocks.clear()
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self._fd is not None:
            self._fd.close()
            self._fd = None


def join_hub_graphs(name: str, T: int, parts: Sequence[Graph], interleave: bool) -> Graph:
    """The graphs of each hub's part as one graph over the hubs: a layer split's parts one after
    another; a row split's interleaved at the all-reduces (each shard's nodes up to its next
    ``link_sum``, hub by hub), so that both partials are published before either sum reads
    them."""
    g = Graph(name, T=T)
    if not interleave:
        order = [n for part in parts for n in part.nodes]
    else:
        pieces: list[list[list[Any]]] = []
        for part in parts:
            cut: list[list[Any]] = [[]]
            for n in part.nodes:
                if n.op == "link_sum":
                    cut.append([])
                cut[-1].append(n)
            pieces.append(cut)
        order = [n for k in range(max(len(c) for c in pieces)) for c in pieces if k < len(c) for n in c[k]]
    for n in order:
        n.index = len(g.nodes)
        g.nodes.append(n)
    return g


class _DryBlock:
    """The memory identity a :class:`DryBuffer` stands on (a Block's creation serial)."""

    __slots__ = ("_serial",)

    def __init__(self, serial: int) -> None:
        self._serial = serial


class DryBuffer:
    """A hub buffer that is not there: its size and a memory identity for the graph's dependency
    analysis (:func:`vkxsplit.graph.span`), no memory. ``auto`` over several hubs builds each
    candidate split's graphs over these to price them before any weight is placed
    (:class:`DryHubShare`); ``serial``: share another's identity (the two imports of a link)."""

    host_visible = False
    host_pages = False  # host pages several hubs import (a link), not device memory

    def __init__(self, nbytes: int, name: str, serial: int | None = None) -> None:
        from .vk.memory import next_serial

        self.handle, self.offset, self.size, self.name = None, 0, int(nbytes), name
        self.block = _DryBlock(next_serial() if serial is None else serial)

    def close(self) -> None:
        pass


class DryLink:
    """A :class:`HostLink` that is not there: one :class:`DryBuffer` per device, one memory."""

    def __init__(self, devices: Sequence[Any], nbytes: int, name: str) -> None:
        first = DryBuffer(nbytes, f"{name}:0")
        self.views = [first] + [DryBuffer(nbytes, f"{name}:{i}", first.block._serial) for i in range(1, len(devices))]
        for v in self.views:
            v.host_pages = True  # (measured in host memory: vkxsplit.calibrate.MeasuringCostModel.measure_dry)

    def close(self) -> None:
        pass


class HubShare:
    """What hub ``index`` of ``model`` (the :class:`vkxsplit.model.Model` that places it: its file,
    sizes, backends and ``partials``) holds and computes: the object the architecture's graph
    builder (:func:`vkxsplit.archs.build_graph`) reads its buffers from.

    ``layers``: the decoder layers it holds (a layer-split hub), ``link_in`` / ``link_out``: the
    host pages its hidden state comes from / goes to (a hub that does not start at layer 0 /
    does not end at the last layer). ``rank``: its shard of a row split (None: whole matrices),
    ``publish[p]`` / ``peer[p]``: (buffer, byte offset) of its and the other shard's partials
    for all-reduce parity ``p``."""

    def __init__(self, model: Any, index: int, device: Device, layers: tuple[int, int] | None = None,
                 link_in: Any = None, link_out: Any = None, rank: int | None = None,
                 publish: list[Any] | None = None, peer: list[Any] | None = None) -> None:
        self.model, self.index, self.device = model, index, device
        self.file = model.file
        self.rank, self.world = rank, (WORLD if rank is not None else 1)
        self.hp = shard_hparams(model.file.hparams) if rank is not None else model.file.hparams
        n_layer = self.hp.n_layer
        self.layers = range(*(layers or (0, n_layer)))
        if not (0 <= self.layers.start < self.layers.stop <= n_layer):
            raise VkxError(f"layers {tuple(layers or ())} are not a non-empty range of the model's {n_layer} layers")
        self.first, self.last = self.layers.start == 0, self.layers.stop == n_layer
        if (link_in is None) != self.first or (link_out is None) != self.last:
            raise VkxError(f"hub of layers [{self.layers.start}, {self.layers.stop}): a hub that does not start "
                           "at layer 0 needs link_in, one that does not end at the last layer needs link_out "
                           "(and only those)")
        self.link_in, self.link_out = link_in, link_out
        self._publish, self._peer = publish or [], peer or []
        self._n_reduce = 0
        self.n_ctx, self.ubatch, self.slots = model.n_ctx, model.piece, model.slots
        self.slot_rows = slot_rows(self.ubatch, self.slots)
        # attached backends are on hub 0 only (the planner refuses them with several hubs)
        self.backends = model.backends if index == 0 else {}
        self.arena = model.arena if index == 0 else None
        self._bufs: list[Any] = []
        self.weights: dict[str, Tensor] = {}
        self.weight_bytes = 0
        self.logits_buf: Any = None
        self.argmax_buf: Any = None

    @property
    def makes_logits(self) -> bool:
        """The last layer's hub (or shard 0 of a row split) makes the logits."""
        return self.last and (self.rank is None or self.rank == 0)

    # -- memory -------------------------------------------------------------------------------

    def _alloc(self, nbytes: int, pool: str, name: str, shared: bool = False) -> Any:
        """A buffer from the hub pool ``pool``, or from the shared arena when ``shared`` and
        backends are attached (a SharedBuffer: hub kernels bind it, backends reach it)."""
        if shared and self.arena is not None:
            sb = self.arena.alloc(nbytes, name)
            if pool == "host" and not sb.buffer.host_visible:  # the caller reads it: keep it readable
                sb.close()
            else:
                return sb
        b = self.device.memory.alloc(nbytes, pool, name)
        self._bufs.append(b)
        return b

    @staticmethod
    def _view(buf: Any, offset: int = 0, size: int | None = None) -> Any:
        from .attach import SharedBuffer

        if isinstance(buf, SharedBuffer):
            return buf.view(offset, size)
        return View(buf, offset, size)

    def _holds(self, name: str) -> bool:
        """Whether this hub needs weight ``name`` (a layer-split hub: its layers)."""
        if name.startswith("blk."):
            return int(name.split(".")[1]) in self.layers
        tied = "output.weight" not in self.file.tensors
        if name == "token_embd.weight":
            return self.first or (self.last and tied)
        if name in ("output_norm.weight", "output.weight"):
            return self.makes_logits
        return True

    def _weight_data(self, name: str, ti: Any) -> tuple[tuple[int, ...], np.ndarray]:
        """The shape and raw bytes this hub holds of weight ``ti``: all of it, or a row-split
        shard's rows or columns."""
        parts = name.split(".")
        if self.rank is None or parts[0] != "blk":
            return ti.shape, ti.data
        if parts[2] in COLS and ti.n_dims == 1:
            return ti.shape, ti.data  # (not read by the graph: it adds no output-projection bias)
        if parts[2] in ROWS + COLS:
            kind, a, b = shard_slices(self.file.hparams, self.rank, self.world)[parts[2]]
            return slice_weight(ti, kind, a, b)
        return ti.shape, ti.data

    def upload_weights(self, progress: Any) -> None:
        from .attach import SharedBuffer

        # (phi3's fused attn_qkv / gate-up ffn_up come as their row ranges: archs.weight_tensors)
        items = sorted(weight_tensors(self.file).items())
        # weights go to the shared arena when backends are attached: they read them in place
        shared = bool(self.backends)
        items = [(name, ti) for name, ti in items if self._holds(name)]
        total = sum(t.nbytes for _, t in items)
        done = held = 0
        with Uploader(self.device, slot_bytes=_UPLOAD_CHUNK) as up:
            for name, ti in items:
                shape, data = self._weight_data(name, ti)
                buf = self._alloc(data.nbytes, "device", name, shared=shared)
                dst = buf.buffer if isinstance(buf, SharedBuffer) else buf
                src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
                # The hub's copy (or the arena's) is the one kept: copy in chunks and let go of
                # the file pages each chunk touched, or every weight is resident twice (and a
                # large one briefly three times through a staging buffer as large as it).
                for o in range(0, src.nbytes, _UPLOAD_CHUNK):
                    up.write(dst, src[o:o + _UPLOAD_CHUNK], o)  # staged when device-only
                    self.file.release_pages(src[o:o + _UPLOAD_CHUNK])
                self.file.release_pages(ti.data)  # (a slice copied from it: the file's pages too)
                self.weights[name] = Tensor(name, shape, ti.ggml_type.name.lower(), self._view(buf), weight=True)
                done += ti.nbytes
                held += data.nbytes
                if progress:
                    progress(done, total)
            up.finish()
        self.weight_bytes = held

    def alloc_state(self) -> None:
        hp, T = self.hp, self.ubatch
        f32 = 4
        self.kv: dict[int, tuple[Any, Any]] = {}
        kv_row = hp.n_head_kv * hp.head_dim * 2  # f16
        # the step's state (KV cache, ids, positions, argmax) in shared memory when a backend can
        # run the whole step (backend.STEP_OPS) beside a CPU hub, whose memory is the same RAM
        st = bool(self.device.is_cpu) and any("kv_store" in b.caps.ops for b in self.backends.values())
        for i in self.layers:
            kv = (self._alloc(self.n_ctx * kv_row, "device", f"cache_k.{i}", shared=st),
                  self._alloc(self.n_ctx * hp.n_head_kv * hp.head_dim_v * 2, "device", f"cache_v.{i}", shared=st))
            self.kv[i] = (self._view(kv[0]), self._view(kv[1])) if st else kv  # (graph tensors take views)
        # per-step inputs, written by the host before each submit (one ubatch per slot)
        S = self.slots * self.slot_rows
        self.ids_buf = self._alloc(S * 4, "host", "ids", shared=st)
        self.pos_buf = self._alloc(S * 4, "host", "positions", shared=st)
        # activations (shared by every graph: steps run one after another on one queue), in
        # shared memory when backends are attached (they read and write them in place)
        E, F = hp.n_embd, hp.n_ff
        sizes = {"x": E, "h": E, "q": hp.n_embd_q, "k": hp.n_embd_k_gqa, "v": hp.n_embd_v_gqa,
                 "attn": hp.n_head * hp.head_dim_v, "o": E, "gate": F, "up": F}
        if hp.moe is not None:  # the MoE FFN's router, grouping and expert activations (vkxsplit/moe.py)
            from .moe import moe_act_cols

            sizes.update(moe_act_cols(hp.moe, E, T))
        act_shared = bool(self.backends)
        self.act = {k: self._alloc(T * c * f32, "device", k, shared=act_shared) for k, c in sizes.items()}
        from .ops.attention import attention_scratch_bytes, attention_splits, decode_target_workgroups

        # decode attention splits the KV length over workgroups (flash-decoding), as many as
        # fill the device
        self.decode_splits = attention_splits(1, hp.n_head, hp.n_head_kv, self.n_ctx,
                                              target_workgroups=decode_target_workgroups(self.device))
        self.attn_scratch = self._alloc(
            attention_scratch_bytes(1, hp.n_head, hp.head_dim_v, self.decode_splits), "device", "attn_scratch",
            shared=st)
        if st:
            self.attn_scratch = self._view(self.attn_scratch)
        # decode: x quantized to q8_1 for the integer-dot-product mat-vecs (hub only; one
        # scratch reused by every quantize node: each one's readers come before the next)
        from .ops.mul_mat import vecq_scratch_bytes

        self.xq_buf = self._alloc(vecq_scratch_bytes(1, max(sizes.values())), "device", "xq")
        self.own16 = None
        if self.rank is not None and self.model.partials != "f32":  # this shard's partial as the other reads it
            self.own16 = self._alloc(T * hp.n_embd * 2, "device", "partial_16")
        if self.makes_logits:  # (all logits of every slot's rows: logits() of a prompt in micro-batches)
            self.logits_buf = self._alloc(S * hp.n_vocab * f32, "host", "logits", shared=act_shared)
            self.argmax_buf = self._alloc(S * 4, "host", "argmax", shared=st)

    # -- graph --------------------------------------------------------------------------------

    def build_graph(self, T: int, all_logits: bool, slot: int = 0) -> Graph:
        """This hub's part of the forward pass for ``T`` tokens over its buffers (its layers,
        reading or writing the hidden state through its links; a shard's all-reduces)."""
        self._n_reduce = 0
        g = build_graph(self, T, all_logits, slot)  # type: ignore[arg-type]
        for n in g.nodes:
            n.hub = self.index
        return g

    def _reduce(self, g: Graph, name: str, o: Tensor) -> Tensor:
        """Where a layer's output projection (``attn_output``, ``ffn_down``) ends: the identity
        on a whole-matrix hub; on a row-split shard, publish this shard's partial into its half
        of the host pages and sum it with the other shard's (the all-reduce)."""
        if self.rank is None:
            return o
        par = self._n_reduce % 2
        self._n_reduce += 1
        dt = self.model.reduce_dtype(o.rows * o.cols * 4)
        nbytes = o.rows * o.cols * (4 if dt == "f32" else 2)
        (pb, po), (qb, qo) = self._publish[par], self._peer[par]
        pub = Tensor(name + ":published", o.shape, dt, View(pb, po, nbytes))
        peer = Tensor(name + ":peer", o.shape, dt, View(qb, qo, nbytes))
        if dt == "f32":
            g.add("cpy", name + "_publish", [o], pub)
            own = o
        else:  # both shards add the same two f16 / bf16 values: each rounds its own partial
            # once, by the same kernel, for itself and for the other shard
            own = Tensor(name + f":own_{dt}", o.shape, dt, View(self.own16, 0, nbytes))
            g.add("convert", name + "_round", [o], own)
            g.add("convert", name + "_publish", [o], pub)
        return g.add("link_sum", name + "_sum", [own, peer], o)

    def weight_shape(self, name: str, ti: Any) -> tuple[tuple[int, ...], int]:
        """The shape and bytes of this hub's part of weight ``ti`` (what :meth:`_weight_data`
        gives, without reading or copying it); a column range cutting a block is refused."""
        from gguf.constants import GGML_QUANT_SIZES

        parts = name.split(".")
        if self.rank is None or parts[0] != "blk" or parts[2] not in ROWS + COLS or (
                parts[2] in COLS and ti.n_dims == 1):
            return tuple(ti.shape), int(ti.nbytes)
        kind, a, b = shard_slices(self.file.hparams, self.rank, self.world)[parts[2]]
        if ti.n_dims == 1:
            return (b - a,), (b - a) * (ti.nbytes // ti.cols)
        if kind == "rows":
            return (b - a, ti.cols), (b - a) * (ti.nbytes // ti.rows)
        blk, tsz = GGML_QUANT_SIZES[ti.ggml_type]
        if a % blk or b % blk:
            raise ModelError(f"{ti.name}: columns [{a}, {b}) of a {ti.ggml_type.name} matrix cut its "
                             f"{blk}-value blocks", "use the layer split (--devices without --split-mode row)")
        return (ti.rows, b - a), ti.rows * (b - a) // blk * tsz

    def write_inputs(self, ids: list[int], start: int, slot: int = 0) -> None:
        """The step's token ids and positions ``start..`` into ``slot``'s rows."""
        T = len(ids)
        views = self.__dict__.get("_io_views")
        if views is None:  # zero-copy views of the per-step input buffers, made once
            views = self._io_views = (self.ids_buf.numpy(np.int32), self.pos_buf.numpy(np.int32),
                                      None if self.argmax_buf is None else self.argmax_buf.numpy(np.int32))
        r0 = slot * self.slot_rows
        views[0][r0:r0 + T] = ids
        views[1][r0:r0 + T] = np.arange(start, start + T, dtype=np.int32)

    def close(self) -> None:
        self._io_views = None  # views of buffers freed below
        for b in self._bufs:
            b.close()
        self._bufs.clear()


class DryHubShare(HubShare):
    """A :class:`HubShare` without memory (every buffer a :class:`DryBuffer`, no weight read or
    uploaded): the same graphs as the share it stands for, for the cost model to price a
    candidate split over the hubs before the model places one (``auto``)."""

    def _alloc(self, nbytes: int, pool: str, name: str, shared: bool = False) -> Any:
        return DryBuffer(nbytes, name)

    def upload_weights(self, progress: Any = None) -> None:
        for name, ti in sorted(weight_tensors(self.file).items()):
            if self._holds(name):
                shape, nbytes = self.weight_shape(name, ti)
                self.weights[name] = Tensor(name, shape, ti.ggml_type.name.lower(), View(DryBuffer(nbytes, name)),
                                            weight=True)  # type: ignore[arg-type]
                self.weight_bytes += nbytes


__all__ = ["COLS", "DryBuffer", "DryHubShare", "DryLink", "PARTIALS", "ROWS", "WORLD", "HostLink", "HubShare", "check_partials", "join_hub_graphs", "layer_ranges", "parse_devices",
           "shard_hparams", "shard_slices", "slice_weight", "slot_rows"]
