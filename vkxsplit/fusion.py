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
   routed product quantizes its own x (ops.moe.record_mul_mat_id);
4. :func:`fuse_mul_mat_swiglu` (``fuse_glu``): in a decode graph whose hub runs every node (no
   backend), the FFN's gate and up mat-vecs (q8_1 x, one weight type) and their SwiGLU ->
   ``mul_mat_swiglu``: one kernel computes the same rows of both, then silu(gate) * up as f32
   and, where the SwiGLU wrote the down product's q8_1 x, as those q8_1 blocks
   (``mul_mat_vecq_swiglu_*``, ``shaders/mul_mat_vecq.comp`` with ``GLU``).

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

__all__ = ["DecodeQ8", "decode_q8_x", "fuse_add_rms_norm", "fuse_mul_mat_swiglu", "fuse_rope_kv_store", "optimize"]


def _runs(g: Graph, width: int, fuse: Callable[[int], Node | None]) -> int:
    """Replace each run of ``width`` adjacent nodes of ``g`` starting at index ``i`` for which
    ``fuse(i)`` gives a node by that node; returns how many. Only adjacent nodes: a fused node
    runs where the first of its run ran, so a node between them (reading or writing what they
    touch) would see the work of all of them done early."""
    out: list[Node] = []
    nodes, i, n = g.nodes, 0, 0
    while i < len(nodes):
        f = fuse(i) if i + width <= len(nodes) else None
        if f is None:
            out.append(nodes[i])
            i += 1
        else:
            out.append(f)
            i += width
            n += 1
    g.nodes = out
    return n


def _pairs(g: Graph, fuse: Callable[[Node, Node], Node | None]) -> int:
    """:func:`_runs` of pairs: ``fuse(a, b)`` for adjacent nodes a, b."""
    nodes = g.nodes
    return _runs(g, 2, lambda i: fuse(nodes[i], nodes[i + 1]))


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
    the MoE's, over T * n_used rows), and attention, whose KV-split merge writes it: no extra
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


def _glu(g: Graph, i: int, variants: dict[str, str], max_range: int,
         out_scratch: Callable[[int], Any] | None) -> Node | None:
    """The ``mul_mat_swiglu`` node replacing nodes i, i + 1, i + 2 of ``g`` (gate ``mul_mat``, up
    ``mul_mat``, ``swiglu``), or None where they are not that: both products read the same q8_1
    x of one token (``xq``) with weights of one type and shape whose type has a SwiGLU kernel
    in ``variants`` (each weight within ``max_range`` bytes: one binding), the SwiGLU reads
    exactly their outputs and writes the gate's in place (and writes the down product's q8_1 x
    only where its rows are whole blocks and ``out_scratch`` gives that q8_1 x a place apart
    from the one it reads: its workgroups write blocks while others still read x's), and
    nothing after reads the up product's output before it is written again (it is no longer
    made)."""
    from .ops.quant import row_bytes

    a, b, c = g.nodes[i:i + 3]
    if a.op != "mul_mat" or b.op != "mul_mat" or c.op != "swiglu" or len(a.inputs) != 2 or len(b.inputs) != 2:
        return None
    (wg, x), (wu, xb) = a.inputs, b.inputs
    xq = a.params.get("xq")
    if (xq is None or b.params.get("xq") is not xq or set(a.params) != {"xq", "vecq"} or set(b.params) != {"xq", "vecq"}
            or not (wg.weight and wu.weight) or wg.dtype != wu.dtype or wg.shape != wu.shape or len(wg.shape) != 2
            or wg.dtype not in variants or x is not xb or x.rows != 1 or x.cols != wg.shape[-1]):
        return None
    gate, up = a.output, b.output
    N = wg.shape[0]
    if (c.inputs != [gate, up] or c.output is not gate or gate.shape != (1, N) or up.shape != (1, N)
            or gate.dtype != "f32" or up.dtype != "f32" or set(c.params) - {"xq", "q8"}):
        return None
    if any(row_bytes(w.dtype, w.shape[-1]) * N > max_range for w in (wg, wu)):
        return None
    xq_out = c.params.get("xq")
    if xq_out is not None and (N % 32 or out_scratch is None):
        return None
    us = span(up)
    for n in g.nodes[i + 3:]:
        if any(overlap(us, span(t)) for t in n.reads()):
            return None  # a later reader of up's output
        if any(overlap(us, span(t)) for t in n.writes()):
            break
    name = a.name + "_up" if a.name.endswith("ffn_gate") else c.name
    params: dict[str, Any] = {"xq": xq, "vecq": variants[wg.dtype]}
    if xq_out is not None:
        from .ops.mul_mat import vecq_scratch_bytes

        xq_out.buffer = out_scratch(vecq_scratch_bytes(1, N))  # (the down product reads this tensor too)
        params["xq_out"] = xq_out
    return Node("mul_mat_swiglu", name, [wg, wu, x], gate, params, hub=c.hub)


def fuse_mul_mat_swiglu(g: Graph, variants: dict[str, str], max_range: int = 1 << 32,
                        out_scratch: Callable[[int], Any] | None = None) -> int:
    """Pass 4 (after the q8_1 pass: it fuses products that read q8_1 x): each decode FFN's gate
    ``mul_mat``, up ``mul_mat`` and ``swiglu`` (adjacent, as :func:`vkxsplit.archs.dense_ffn`
    adds them) become one ``mul_mat_swiglu`` (named as the gate product plus ``_up``): inputs
    the gate and up weights and x, output the SwiGLU's, params ``xq`` (the q8_1 x it reads),
    ``vecq`` (the kernel, ``variants[weight type]``: :meth:`~vkxsplit.ops.choose.DeviceKernels.vecq_glu`)
    and, where the SwiGLU wrote the down product's q8_1 x, ``xq_out`` (written; moved to
    ``out_scratch(nbytes)``, a binding apart from every other q8_1 x: without it such a triple
    stays as it is). One dispatch and one dependent level fewer per layer, and the up
    product's output is never written. Returns how many."""
    if not variants:
        return 0
    return _runs(g, 3, lambda i: _glu(g, i, variants, max_range, out_scratch))


def optimize(g: Graph, device: Any, xq_scratch: Callable[[int], Any], backends: bool = False,
             glu_scratch: Callable[[int], Any] | None = None) -> Graph:
    """The hub's passes over the plain graph ``g`` (rewritten in place and returned), in their
    fixed order, each unless its kill switch is set for ``device``: residual add + RMSNorm,
    then RoPE of K + KV store, then the q8_1 x of decode (T = 1) mat-vecs, whose variants come
    from ``kernels_for(device).vecq_decode()`` (``xq_scratch(nbytes)``: the binding all q8_1 x
    share), then gate/up + SwiGLU of decode where no backend is attached (``backends``: a
    ``mul_mat_swiglu`` runs on the hub only, and a plan may give gate and up rows to a backend;
    ``glu_scratch(nbytes)``: where it writes the down product's q8_1 x).
    The order matters: the q8_1 pass lets the ``add_rms_norm`` the first pass made write the
    q8_1 x of the next layer's Q/K/V, and the SwiGLU pass fuses the products it made read q8_1 x."""
    from .ops.choose import kernels_for

    if not is_disabled(device, "fuse_norm"):
        fuse_add_rms_norm(g)
    if not is_disabled(device, "fuse_rope"):
        fuse_rope_kv_store(g)
    from .ops.moe import vecq_id_decode

    variants = kernels_for(device).vecq_decode() if g.T == 1 else {}
    decode_q8_x(g, variants, xq_scratch, fuse=not is_disabled(device, "fuse_q8"),
                id_variants=vecq_id_decode(device) if variants else None)
    if variants and not backends and not is_disabled(device, "fuse_glu"):
        kc = kernels_for(device)
        glu = {t: v for t in variants if (v := kc.vecq_glu(t)) is not None}
        limits = getattr(getattr(device, "physical", None), "limits", None) or {}
        fuse_mul_mat_swiglu(g, glu, int(limits.get("maxStorageBufferRange", 1 << 32)), glu_scratch)
    for i, n in enumerate(g.nodes):
        n.index = i
    return g
