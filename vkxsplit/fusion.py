"""The hub's fusion passes: the plain graph the model code builds, rewritten into fewer dispatches.

:mod:`vkxsplit.archs` builds each architecture's forward pass as the plain graph of llama.cpp's
builders: a residual ``add`` then the next ``rms_norm``, the ``rope`` of K then the
``kv_store``, mat-vecs reading f32 x. :func:`optimize` (what :func:`vkxsplit.archs.build_graph`
runs last; ggml's ``graph_optimize`` is the same idea) rewrites it in a fixed order, one
function per pass, each with its kill switch (:data:`vkxsplit.features.PASSES`;
``VKXSPLIT_DISABLE=fusion`` switches all of them off):

1. :func:`fuse_add_rms_norm` (``fuse_norm``): residual add + the next RMSNorm ->
   ``add_rms_norm``;
2. :func:`fuse_rope_kv_store` (``fuse_rope``): RoPE of K + the KV store -> ``kv_store`` with
   ``rope_k``;
3. :func:`decode_q8_x` (``fuse_q8``): the decode mat-vecs of the types the device has an
   integer-dot-product kernel for read x as q8_1, written by x's producer where it can
   (:class:`DecodeQ8`), else by a ``quantize_q8_1`` node; so do the decode's routed expert
   products (``mul_mat_id``: the experts' gate/up read the FFN norm's q8_1, down the MoE
   SwiGLU's). With ``fuse_q8`` off the mat-vecs still read q8_1 x (that is a kernel choice:
   ``VKXSPLIT_DISABLE=intdot`` turns it off), from ``quantize_q8_1`` nodes only, and each
   routed product quantizes its own x (ops.moe.record_mul_mat_id).

Each fused node does what the nodes it replaces did, in one dispatch: the graphs differ only by
the dependent dispatch levels (and the round trips through memory) they save. The passes
rewrite adjacent nodes only, so no node moves past another (tests/test_fusion.py checks the
result node for node against the graphs the builder once fused by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .features import is_disabled
from .graph import Graph, Node, Tensor, overlap, span

__all__ = ["DecodeQ8", "decode_q8_x", "fuse_add_rms_norm", "fuse_rope_kv_store", "optimize"]


def _pairs(g: Graph, fuse: Callable[[Node, Node], Node | None]) -> int:
    """Replace each adjacent pair (a, b) of ``g``'s nodes for which ``fuse(a, b)`` gives a node
    by that node; returns how many. Only adjacent pairs: a fused node runs where the first of
    its pair ran, so a node between them (reading or writing what they touch) would see the
    work of both done early."""
    out: list[Node] = []
    nodes, i, n = g.nodes, 0, 0
    while i < len(nodes):
        f = fuse(nodes[i], nodes[i + 1]) if i + 1 < len(nodes) else None
        if f is None:
            out.append(nodes[i])
            i += 1
        else:
            out.append(f)
            i += 2
            n += 1
    g.nodes = out
    return n


def _residual_norm(a: Node, b: Node) -> Node | None:
    """``x += o`` then ``h = rms_norm(x) * w`` -> ``add_rms_norm(x, o, w)`` writing h and x
    (``x_out``): x is read once and written once, not written, then read back by the norm;
    one dispatch and one barrier level fewer per residual (two per layer)."""
    if a.op != "add" or a.params or len(a.inputs) != 2 or b.op != "rms_norm" or len(b.inputs) != 2:
        return None
    x, o = a.inputs
    # the residual stream updated in place by an activation of its own shape (not a bias: the
    # fused kernel does not broadcast), and the norm reads exactly that tensor (not a view of
    # some of its rows, as the output norm of the last row does) with a weight
    if a.output is not x or o.weight or o.shape != x.shape or b.inputs[0] is not x or not b.inputs[1].weight:
        return None
    if set(b.params) != {"eps"} or any(overlap(span(b.output), span(t)) for t in (x, o)):
        return None  # (h is written beside x: it must not be x or o)
    return Node("add_rms_norm", b.name, [x, o, b.inputs[1]], b.output, {"eps": b.params["eps"], "x_out": x})


def fuse_add_rms_norm(g: Graph) -> int:
    """Pass 1: each residual add followed by the RMSNorm of its result becomes one
    ``add_rms_norm`` (named as the norm). Returns how many."""
    return _pairs(g, _residual_norm)


def _rope_store(a: Node, b: Node) -> Node | None:
    """``rope(k)`` in place then ``kv_store(k, v)`` -> ``kv_store`` that ropes K on its way into
    the cache (``rope_k``: the RoPE's parameters; its frequency factors as a 4th input): K is
    not written back roped and read again, one dispatch and one level fewer per layer."""
    if a.op != "rope" or b.op != "kv_store" or b.params.get("rope_k") is not None or len(b.inputs) != 3:
        return None
    k, pos = a.inputs[0], a.inputs[1]
    if a.output is not k or b.inputs[0] is not k or b.inputs[2] is not pos:
        return None
    if a.params.get("n_heads") != b.params.get("n_kv_heads") or a.params.get("head_dim") != b.params.get("head_dim"):
        return None
    rope = {key: v for key, v in a.params.items() if key != "n_heads"}
    return Node("kv_store", b.name, [*b.inputs, *a.inputs[2:]], b.output, {**b.params, "rope_k": rope})


def fuse_rope_kv_store(g: Graph) -> int:
    """Pass 2: each RoPE of K followed by the KV store of that K becomes one ``kv_store`` with
    ``rope_k``. Returns how many."""
    return _pairs(g, _rope_store)


class DecodeQ8:
    """Where a decode graph quantizes x for the integer-dot-product mat-vecs (ggml's MMVQ).

    ``mul_mat(name, w, x, out)`` adds a ``mul_mat`` node; when ``w``'s type has a variant in
    ``variants`` (from :meth:`~vkxsplit.ops.choose.DeviceKernels.vecq_decode`), the node reads x as q8_1
    (params ``xq``, ``vecq``). ``mul_mat_id(node, variant)`` appends a decode
    ``mul_mat_id`` node (the routed expert product) reading x as q8_1 the same way, with the
    routed kernel ``variant`` (:func:`vkxsplit.ops.moe.vecq_id_decode`). x is quantized
    once, before its first such reader, and shared by the rest (q/k/v, gate/up, the experts'
    gate/up with the router when it reads q8_1 too) until something rewrites x: by the node
    that made x where it can write q8_1 too (a norm with a weight, add_rms_norm, swiglu (also
    the MoE's, over T * n_used rows), and attention, whose KV-split combine writes it: no extra
    dispatch or barrier level; not with ``fuse`` off), else by a ``quantize_q8_1`` node. A
    reader's x is the x quantized when it covers the same bytes with the same rows and columns
    (the experts read the norm's (T, n_embd) output as (T, 1, n_embd)). All q8_1 data lives
    in one scratch (``scratch(nbytes)`` gives the binding): a producer after which readers of
    the previous x's q8_1 still come cannot write the new one at its place.
    """

    FUSABLE = ("rms_norm", "add_rms_norm", "swiglu", "attention")

    @staticmethod
    def _writes_q8(pn: Node) -> bool:
        """Whether the producer ``pn`` of x can also write x as q8_1 blocks."""
        if pn.op == "swiglu":
            return True
        if pn.op == "attention":  # (its combine's blocks must not straddle heads)
            hd = pn.params.get("head_dim")
            return hd is not None and hd % 32 == 0
        return pn.weight is not None

    @staticmethod
    def _same(a: Tensor, b: Tensor) -> bool:
        """Whether ``a`` and ``b`` are the same x for q8_1 blocks: the same bytes as the same
        rows of the same columns (whatever their shapes' leading dimensions)."""
        return a is b or (span(a) == span(b) and a.rows == b.rows and a.cols == b.cols and a.dtype == b.dtype)

    def __init__(self, g: Graph, variants: dict[str, str], scratch: Any, fuse: bool = True) -> None:
        self.g, self.variants, self.scratch, self.fuse = g, variants, scratch, fuse
        self._cur: tuple[Tensor, int, Tensor] | None = None  # (x, index of its quantizer, xq)

    def _stale(self, x: Tensor) -> bool:
        if self._cur is None or not self._same(self._cur[0], x):
            return True
        xs = span(x)
        return any(overlap(xs, span(t)) for n in self.g.nodes[self._cur[1] + 1:] for t in n.writes())

    def _xq(self, name: str, x: Tensor) -> Tensor:
        """The q8_1 x of a reader ``name`` of f32 ``x`` (rows of x.cols % 32 == 0): the current
        one unless stale, else a new one written by x's producer where it can, else by a
        ``quantize_q8_1`` node added here."""
        from .ops.mul_mat import vecq_scratch_bytes

        g = self.g
        if self._stale(x):
            nbytes = vecq_scratch_bytes(x.rows, x.cols)
            xq = Tensor(f"xq:{x.name}", (1, nbytes // 4), "q8_1", self.scratch(nbytes))
            xs = span(x)
            prod = next((i for i in range(len(g.nodes) - 1, -1, -1)
                         if any(overlap(xs, span(t)) for t in g.nodes[i].writes())), None)
            pn = g.nodes[prod] if prod is not None else None
            busy = pn is not None and self._cur is not None and any(
                n.params.get("xq") is self._cur[2] for n in g.nodes[prod + 1:])
            if (self.fuse and pn is not None and not busy and self._same(pn.output, x) and "xq" not in pn.params
                    and pn.op in self.FUSABLE and self._writes_q8(pn)):
                pn.params.update(xq=xq, q8=1)  # rms_norm.comp with Q8 / swiglu_q8_1 / attn_combine_q8_1
                self._cur = (x, prod, xq)
            else:
                k = sum(n.op == "quantize_q8_1" for n in g.nodes)  # unique names: blk.N.quantize.K
                g.add("quantize_q8_1", (name.rsplit(".", 1)[0] + "." if "." in name else "") + f"quantize.{k}",
                      [x], xq)
                self._cur = (x, len(g.nodes) - 1, xq)
        return self._cur[2]

    def mul_mat(self, name: str, w: Tensor, x: Tensor, out: Tensor) -> Tensor:
        from .ops.choose import vecq_for_shape

        v = self.variants.get(w.dtype)
        if v is None or x.cols % 32:
            return self.g.add("mul_mat", name, [w, x], out)
        v = vecq_for_shape(v, w.dtype, w.rows, w.cols)  # tall products: their own shape
        return self.g.add("mul_mat", name, [w, x], out, xq=self._xq(name, x), vecq=v)

    def mul_mat_id(self, n: Node, variant: str) -> Tensor:
        """Append the decode ``mul_mat_id`` node ``n`` (x f32 (T, n_xb, K): T n_xb q8_1 rows of
        K, as the routed kernel reads them) reading x as q8_1 with the routed kernel
        ``variant`` (params ``xq``, ``vecq``; the node itself, whatever else it carries)."""
        n.params.update(xq=self._xq(n.name, n.inputs[1]), vecq=variant)
        self.g.nodes.append(n)
        n.index = len(self.g.nodes) - 1
        return n.output


def decode_q8_x(g: Graph, variants: dict[str, str], scratch: Callable[[int], Any], fuse: bool = True,
                id_variants: dict[str, str] | None = None) -> int:
    """Pass 3: the graph's mat-vecs (``mul_mat`` of a weight and f32 x) replayed in order
    through :class:`DecodeQ8`: those of a type in ``variants`` read x as q8_1, quantized once
    per x, by x's producer where it can write it (``fuse``) else by a ``quantize_q8_1`` node
    inserted before the first reader. Decode's mat-vecs are bound by reading the weights; the
    integer dot products read x at a quarter of the bytes, and a producer writing q8_1 saves
    the quantize dispatch and its level. With ``fuse``, the routed expert products of a decode
    graph (``mul_mat_id`` of one token without a grouping, of a type in ``id_variants``:
    :func:`vkxsplit.ops.moe.vecq_id_decode`) read x as q8_1 the same way: the experts' gate
    and up the q8_1 of the FFN norm's output, the down product that of the MoE SwiGLU's,
    instead of each quantizing its own x (two dependent dispatch levels per layer fewer);
    with ``fuse`` off they keep their own quantize dispatch. Returns how many mat-vecs
    (both ops) read q8_1 x."""
    if not variants:
        return 0
    ids_v = (id_variants or {}) if fuse else {}
    nodes, g.nodes = g.nodes, []
    q8 = DecodeQ8(g, variants, scratch, fuse=fuse)
    for n in nodes:
        if n.op == "mul_mat" and not n.params and len(n.inputs) == 2 and n.inputs[0].weight:
            q8.mul_mat(n.name, n.inputs[0], n.inputs[1], n.output)
        elif (n.op == "mul_mat_id" and not n.params and len(n.inputs) == 3 and n.inputs[2].shape[0] == 1
              and n.inputs[0].dtype in ids_v and n.inputs[1].dtype == "f32" and n.inputs[1].cols % 32 == 0):
            q8.mul_mat_id(n, ids_v[n.inputs[0].dtype])
        else:
            g.nodes.append(n)
            n.index = len(g.nodes) - 1  # (DecodeQ8 reads the graph so far by index)
    return sum("xq" in n.params for n in g.nodes if n.op in ("mul_mat", "mul_mat_id"))


def optimize(g: Graph, device: Any, xq_scratch: Callable[[int], Any]) -> Graph:
    """The hub's passes over the plain graph ``g`` (rewritten in place and returned), in their
    fixed order, each unless its kill switch is set for ``device``: residual add + RMSNorm,
    then RoPE of K + KV store, then the q8_1 x of decode (T = 1) mat-vecs, whose variants come
    from ``kernels_for(device).vecq_decode()`` (``xq_scratch(nbytes)``: the binding all q8_1 x
    share). The order matters: the q8_1 pass lets the ``add_rms_norm`` the first pass made
    write the q8_1 x of the next layer's Q/K/V."""
    from .ops.choose import kernels_for

    if not is_disabled(device, "fuse_norm"):
        fuse_add_rms_norm(g)
    if not is_disabled(device, "fuse_rope"):
        fuse_rope_kv_store(g)
    from .ops.moe import vecq_id_decode

    variants = kernels_for(device).vecq_decode() if g.T == 1 else {}
    decode_q8_x(g, variants, xq_scratch, fuse=not is_disabled(device, "fuse_q8"),
                id_variants=vecq_id_decode(device) if variants else None)
    for i, n in enumerate(g.nodes):
        n.index = i
    return g
