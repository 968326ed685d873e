"""Hub recorders of graph nodes: for each node op (:class:`vkxsplit.graph.Node` ``op``), the
function that records its kernel(s) into a :class:`~vkxsplit.vk.command.Sequence`, from the
node's tensors and params.

A recorder is registered under its op name with :func:`register` and looked up with
:func:`recorder` (a :class:`~vkxsplit.errors.KernelError` for an op nobody registered). It is
called as ``fn(seq, node)``; the ``mul_mat`` recorder also takes ``r0, r1, y`` (a row range of
the output, written into y's columns ``[r0, r1)``: the hub's share of a split product).
The executor (:mod:`vkxsplit.executor`) records hub segments and whole graphs through it.

Imports: ``vkxsplit.errors`` and the ``record_*`` entries of the op modules next to this one
(``vkxsplit.graph`` and ``vkxsplit.vk.command`` for types only); nothing of the planner,
executor or model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..errors import KernelError
from .argmax import record_argmax
from .attention import record_attention, record_kv_store
from .convert import record_convert
from .copy import record_copy
from .elementwise import record_add, record_geglu, record_scale, record_softcap, record_swiglu
from .get_rows import record_get_rows
from .link import record_link_sum
from .moe import NODE_RECORDERS as MOE_RECORDERS
from .mul_mat import record_mul_mat, record_mul_mat_vecq, record_quantize_q8_1, record_swiglu_q8_1
from .norm import record_add_rms_norm, record_rms_norm
from .rope import YARN_DEFAULTS, record_rope

if TYPE_CHECKING:
    from ..graph import Node, Tensor
    from ..vk.command import Sequence
    from ..vk.kernel import Bindable

#: a hub recorder: ``fn(seq, node)`` (``mul_mat``'s also takes ``r0, r1, y``)
Recorder = Callable[..., None]

_RECORDERS: dict[str, Recorder] = {}


def register(op: str) -> Callable[[Recorder], Recorder]:
    """Decorator: ``fn`` records nodes of ``op`` on the hub (one recorder per op)."""

    def add(fn: Recorder) -> Recorder:
        have = _RECORDERS.get(op)
        if have is not None and have is not fn:
            raise KernelError(f"op {op} already has a hub recorder ({have.__module__}.{have.__qualname__})")
        _RECORDERS[op] = fn
        return fn

    return add


def recorder(op: str, *, node: str | None = None) -> Recorder:
    """The hub recorder of node op ``op``; a :class:`KernelError` when there is none (``node``:
    the node's name, for the message)."""
    fn = _RECORDERS.get(op)
    if fn is None:
        where = f" (node {node})" if node else ""
        raise KernelError(f"no hub kernel for op {op}{where}", f"the hub records: {', '.join(sorted(_RECORDERS))}")
    return fn


def recorders() -> Mapping[str, Recorder]:
    """Every registered recorder by op name (a read-only view)."""
    return MappingProxyType(_RECORDERS)


def record_node(seq: Sequence, node: Node) -> None:
    """Record ``node`` on the hub (its op's recorder)."""
    recorder(node.op, node=node.name)(seq, node)


def record_tensor_convert(seq: Sequence, src: Tensor, dst: Tensor) -> None:
    """``src`` converted elementwise into ``dst``'s element type (f32/f16/bf16; the planner's
    inserted conversions: x f32 -> bf16 for a bf16 backend)."""
    record_convert(seq, src.buffer, dst.buffer, src.rows * src.cols, src.dtype, dst.dtype)


def weight_parts(seq: Sequence, w: Tensor, r0: int, r1: int) -> list[tuple[Bindable, int, int, int]]:
    """Rows ``[r0, r1)`` of weight ``w`` as ``(binding, base, a, b)``: rows ``[a, b)`` of the
    binding, whose byte 0 is row ``base``. One part, the weight's own binding (base 0), when it
    fits the device's ``maxStorageBufferRange``; else views of at most that many bytes, each
    starting at a row that is a multiple of 256 (offsets aligned for any
    ``minStorageBufferOffsetAlignment``)."""
    from ..vk.kernel import View, as_range
    from .quant import row_bytes

    maxr = int(seq.device.physical.limits["maxStorageBufferRange"])
    _h, _off, size, _ = as_range(w.buffer)
    if size <= maxr:
        return [(w.buffer, 0, r0, r1)]
    rb = row_bytes(w.dtype, w.shape[-1])
    step = maxr // rb // 256 * 256
    if step < 1:
        raise KernelError(f"weight {w.name}: a row of 256 x {rb} bytes exceeds maxStorageBufferRange ({maxr})")
    base, off0 = (w.buffer.buffer, w.buffer.offset) if isinstance(w.buffer, View) else (w.buffer, 0)
    out: list[tuple[Bindable, int, int, int]] = []
    for a in range(r0 - r0 % step, r1, step):
        lo, hi = max(a, r0), min(a + step, r1)
        out.append((View(base, off0 + a * rb, (hi - a) * rb), a, lo, hi))
    return out


# ---------------------------------------------------------------------------------------------
# the recorders


@register("mul_mat")
def _mul_mat(seq: Sequence, n: Node, r0: int = 0, r1: int | None = None, y: Tensor | None = None) -> None:
    """Output rows ``[r0, r1)`` of a ``mul_mat`` node (all by default) into y's columns
    ``[r0, r1)`` (y: the node's output unless given). A node with an ``xq``
    param reads x as q8_1, written earlier by the node that made x or a ``quantize_q8_1``
    node (:class:`vkxsplit.model.DecodeQ8`): only the integer-dot-product kernel
    ``params["vecq"]`` is recorded."""
    w, x = n.inputs
    y = n.output if y is None else y
    N = w.shape[0]
    r1 = N if r1 is None else r1
    xq = n.params.get("xq")
    for wb, base, a, b in weight_parts(seq, w, r0, r1):  # (one part unless W exceeds a binding)
        if xq is not None:
            record_mul_mat_vecq(seq, wb, w.dtype, x.buffer, xq.buffer, y.buffer, M=x.rows, N=b - a,
                                K=w.shape[-1], w_row_offset=a - base, y_col_offset=a, y_stride=N,
                                variant=n.params["vecq"], quantize=False)
        else:
            record_mul_mat(seq, wb, w.dtype, x.buffer, y.buffer, M=x.rows, N=b - a, K=w.shape[-1],
                           w_row_offset=a - base, y_col_offset=a, y_stride=N)


@register("quantize_q8_1")
def _quantize_q8_1(seq: Sequence, n: Node) -> None:
    """x (f32 rows) -> the q8_1 scratch the following integer-dot-product mat-vecs read."""
    (x,) = n.inputs
    record_quantize_q8_1(seq, x.buffer, n.output.buffer, x.rows, x.cols, x.cols, 0)


@register("get_rows")
def _get_rows(seq: Sequence, n: Node) -> None:
    w, ids = n.inputs
    parts = weight_parts(seq, w, 0, w.rows)
    if len(parts) == 1:
        record_get_rows(seq, w.buffer, w.dtype, ids.buffer, n.output.buffer, ids.shape[0], w.shape[-1])
        return
    for wb, _base, a, b in parts:  # a table larger than a binding (Gemma 3's 262144 x 640 Q8_0 on lavapipe)
        record_get_rows(seq, wb, w.dtype, ids.buffer, n.output.buffer, ids.shape[0], w.shape[-1],
                        n_rows=b - a, row0=a)


@register("rms_norm")
def _rms_norm(seq: Sequence, n: Node) -> None:
    x, w = n.inputs
    xq = n.params.get("xq")  # the output also as q8_1 for the mat-vecs that read it
    record_rms_norm(seq, x.buffer, n.output.buffer, x.rows, x.cols, n.params["eps"], w.buffer,
                    xq=None if xq is None else xq.buffer)


@register("add_rms_norm")
def _add_rms_norm(seq: Sequence, n: Node) -> None:
    x, r, w = n.inputs  # x += r in place, then output = rms_norm(x) * w
    xq = n.params.get("xq")
    record_add_rms_norm(seq, x.buffer, r.buffer, w.buffer, n.output.buffer, x.rows, x.cols, n.params["eps"],
                        xq=None if xq is None else xq.buffer)


@register("add")
def _add(seq: Sequence, n: Node) -> None:
    a, b = n.inputs
    record_add(seq, a.buffer, b.buffer, n.output.buffer, a.rows, a.cols, b_rows=b.rows if len(b.shape) > 1 else 1)


@register("swiglu")
def _swiglu(seq: Sequence, n: Node) -> None:
    g, u = n.inputs
    xq = n.params.get("xq")
    if xq is not None:  # the output also as q8_1 for the mat-vec that reads it (ffn_down)
        record_swiglu_q8_1(seq, g.buffer, u.buffer, n.output.buffer, xq.buffer, g.rows, g.cols)
        return
    record_swiglu(seq, g.buffer, u.buffer, n.output.buffer, g.rows, g.cols)


@register("geglu")
def _geglu(seq: Sequence, n: Node) -> None:
    """``out = gelu(gate) * up`` (Gemma's FFN; out may be gate, in place)."""
    g, u = n.inputs
    record_geglu(seq, g.buffer, u.buffer, n.output.buffer, g.rows, g.cols)


@register("scale")
def _scale(seq: Sequence, n: Node) -> None:
    """``out = x * params["scale"]`` (Gemma's embedding scale sqrt(n_embd); in place allowed)."""
    (x,) = n.inputs
    record_scale(seq, x.buffer, n.output.buffer, x.rows, x.cols, n.params["scale"])


@register("softcap")
def _softcap(seq: Sequence, n: Node) -> None:
    """``out = cap * tanh(x / cap)`` (a final-logit soft cap, ``params["cap"]``)."""
    (x,) = n.inputs
    record_softcap(seq, x.buffer, n.output.buffer, x.rows, x.cols, n.params["cap"])


@register("rope")
def _rope(seq: Sequence, n: Node) -> None:
    x, pos, *ff = n.inputs  # (a third input: the frequency factors, rope_freqs.weight)
    p = n.params
    record_rope(seq, x.buffer, pos.buffer, n.output.buffer, x.rows, p["n_heads"], p["head_dim"],
                n_dims=p["n_dims"], mode="neox" if p["mode"] == "neox" else "normal",
                freq_base=p["freq_base"], freq_scale=p["freq_scale"],
                freq_factors=ff[0].buffer if ff else None,
                **{k: p[k] for k in YARN_DEFAULTS if k in p})  # (YaRN / attn_factor, when the model has them)


@register("kv_store")
def _kv_store(seq: Sequence, n: Node) -> None:
    k, v, pos, *ff = n.inputs  # (a fourth input: RoPE's frequency factors, rope_freqs.weight)
    p = n.params
    rope = p.get("rope_k")
    if rope is not None:
        rope = dict(rope, mode="neox" if rope["mode"] == "neox" else "normal",
                    freq_factors=ff[0].buffer if ff else None)
    record_kv_store(seq, k.buffer, v.buffer, pos.buffer, n.output.buffer, p["cache_v"].buffer, k.rows,
                    p["n_kv_heads"], p["head_dim"], n.output.shape[0], rope=rope)


@register("attention")
def _attention(seq: Sequence, n: Node) -> None:
    q, ck, cv, pos = n.inputs
    p = n.params
    scratch = p.get("scratch")
    record_attention(seq, q.buffer, ck.buffer, cv.buffer, pos.buffer, n.output.buffer, q.rows, p["n_heads"],
                     p["n_kv_heads"], p["head_dim"], p["n_ctx"], n_splits=p.get("n_splits", 1),
                     scratch=scratch.buffer if scratch is not None else None, scale=p.get("scale"),
                     window=p.get("window", 0), xq=p["xq"].buffer if p.get("xq") is not None else None)


@register("cpy")
def _cpy(seq: Sequence, n: Node) -> None:
    """An f32 tensor copied as is (a pipeline stage's hidden state into or out of the host
    pages it shares with the next hub of a layer split: :mod:`vkxsplit.hubs`)."""
    (src,) = n.inputs
    if src.dtype != n.output.dtype or src.shape != n.output.shape:
        raise KernelError(f"cpy {n.name}: {src.dtype}{list(src.shape)} -> {n.output.dtype}{list(n.output.shape)} "
                          "is not a plain copy")
    record_copy(seq, src.buffer, n.output.buffer, src.rows * src.cols * 4)


@register("link_sum")
def _link_sum(seq: Sequence, n: Node) -> None:
    """A tensor-split shard's partial plus the other shard's, read from the host pages it
    published to (the row split over hubs: :mod:`vkxsplit.hubs`): ``out = a + peer``."""
    a, peer = n.inputs
    if (a.shape != peer.shape or a.shape != n.output.shape or a.dtype != peer.dtype
            or a.dtype not in ("f32", "f16", "bf16") or n.output.dtype != "f32"):
        raise KernelError(f"link_sum {n.name}: {a.dtype}{list(a.shape)} + {peer.dtype}{list(peer.shape)} -> "
                          f"{n.output.dtype}{list(n.output.shape)} is not a sum of equal shapes into f32")
    record_link_sum(seq, a.buffer, peer.buffer, n.output.buffer, a.rows * a.cols, parts=a.dtype)


@register("convert")
def _convert(seq: Sequence, n: Node) -> None:
    """An f32/f16/bf16 tensor converted elementwise into another of those (a tensor-split
    shard's partial sums published in f16 or bf16)."""
    (src,) = n.inputs
    if src.shape != n.output.shape:
        raise KernelError(f"convert {n.name}: {list(src.shape)} -> {list(n.output.shape)}")
    record_convert(seq, src.buffer, n.output.buffer, src.rows * src.cols, src.dtype, n.output.dtype)


@register("argmax")
def _argmax(seq: Sequence, n: Node) -> None:
    (x,) = n.inputs
    record_argmax(seq, x.buffer, n.output.buffer, x.rows, x.cols)


# the mixture-of-experts ops: mul_mat_id (its recorder also takes r0, r1, y), moe_topk,
# moe_group, moe_combine (vkxsplit/ops/moe.py)
for _op, _fn in MOE_RECORDERS.items():
    register(_op)(_fn)


__all__ = ["Recorder", "record_node", "record_tensor_convert", "recorder", "recorders", "register"]
