"""Elementwise ops on the rows of 2-D f32 tensors (``shaders/elementwise.comp``).

``add``/``mul`` (``b`` broadcast by rows: row ``r`` of ``a`` meets row ``r % b_rows`` of ``b``, so
a one-row ``b`` is a row vector applied to every row), ``scale`` (by a float), ``silu``,
``gelu`` (tanh approximation, as ggml), fused ``swiglu`` ``silu(gate) * up`` and ``geglu``
``gelu(gate) * up`` (Gemma's FFN), and ``softcap`` ``cap * tanh(x / cap)`` (a final-logit
soft cap).

Every operand is a buffer (or :class:`~vkxsplit.vk.kernel.View`) plus an element offset and a
row stride in elements (default: rows are contiguous), so non-contiguous rows (views of a
larger tensor) work. Any row length works; ``dst`` may be one of the inputs (same offset and
stride): in-place. Partly overlapping operands are refused.

This module also holds the validation helpers the other row-op modules (norm, softmax, rope,
argmax, attention) share.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, as_range

WG = 256
MAX_GROUPS = 65535
U32 = 1 << 32

OPS = {"add": 0, "mul": 1, "scale": 2, "silu": 3, "gelu": 4, "swiglu": 5, "geglu": 6, "softcap": 7}
BINARY_OPS = ("add", "mul", "swiglu", "geglu")
PUSH = "IIIIIIIIIf"

VARIANTS = [
    Variant(name=f"{op}_f32", source="elementwise.comp", defines={"OP": str(code)},
            bindings=3 if op in BINARY_OPS else 2, writes=(2,) if op in BINARY_OPS else (1,),
            push=PUSH, local_size=(WG, 1, 1))
    for op, code in OPS.items()
]


# -- shared validation helpers --------------------------------------------------------------

def check_dtype(op: str, dtype: str, shape: tuple[int, ...], supported: tuple[str, ...] = ("f32",)) -> None:
    if dtype not in supported:
        raise KernelError(f"{op}: dtype {dtype!r} with shape {list(shape)} is not supported "
                          f"(supported: {', '.join(supported)})")


def check_dims(op: str, dtype: str, shape: tuple[int, ...], **dims: int) -> None:
    for name, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= U32:
            raise KernelError(f"{op}_{dtype}: {name} = {v!r} is not a valid size "
                              f"(shape {list(shape)})")


class Operand:
    """A 2-D operand: binding, element offset, row stride, rows, columns, element size."""

    __slots__ = ("name", "buf", "offset", "stride", "rows", "cols", "itemsize")

    def __init__(self, name: str, buf: Bindable, offset: int, stride: int, rows: int, cols: int,
                 itemsize: int = 4) -> None:
        self.name, self.buf, self.offset, self.stride = name, buf, offset, stride
        self.rows, self.cols, self.itemsize = rows, cols, itemsize

    def span(self) -> tuple[int, int, int]:
        """(block serial, first byte, end byte) of the memory the operand covers."""
        _h, off, _size, serial = as_range(self.buf)
        start = off + self.offset * self.itemsize
        n = (self.rows - 1) * self.stride + self.cols if self.rows and self.cols else 0
        return serial, start, start + n * self.itemsize


def check_operand(op: str, o: Operand, shape: tuple[int, ...], min_stride: int | None = None) -> None:
    """Offsets and strides are sane, the operand fits its binding and the uint32 push fields."""
    _h, _off, size, _ = as_range(o.buf)
    where = f"{op}: {o.name} (shape {list(shape)}, offset {o.offset}, row stride {o.stride})"
    for what, v in (("offset", o.offset), ("row stride", o.stride)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise KernelError(f"{where}: {what} must be a non-negative integer")
    if o.stride < (o.cols if min_stride is None else min_stride) and o.rows > 1:
        raise KernelError(f"{where}: row stride is shorter than a row")
    if o.rows == 0 or o.cols == 0:
        return
    last = o.offset + (o.rows - 1) * o.stride + o.cols  # one past the last element
    if last * o.itemsize > size:
        raise KernelError(f"{where}: needs {last * o.itemsize} bytes, the binding has {size}")
    if last >= U32:
        raise KernelError(f"{where}: element indices exceed 32 bits; bind a View nearer the data")


def check_alias(op: str, dst: Operand, src: Operand, shape: tuple[int, ...]) -> None:
    """``dst`` may be ``src`` exactly (in place) or disjoint from it; nothing in between."""
    b1, s1, e1 = dst.span()
    b2, s2, e2 = src.span()
    if b1 != b2 or e1 <= s2 or e2 <= s1:
        return
    if s1 == s2 and dst.stride == src.stride and dst.itemsize == src.itemsize:
        return  # in place
    st = dst.stride * dst.itemsize
    if dst.stride == src.stride and dst.itemsize == src.itemsize and st > 0:
        dlt = (s2 - s1) % st
        if dlt >= dst.cols * dst.itemsize and st - dlt >= src.cols * src.itemsize:
            return  # interleaved, disjoint columns of the same rows
    raise KernelError(f"{op}: {dst.name} partly overlaps {src.name} (shape {list(shape)}); "
                      "use the same offset and stride (in place) or separate memory")


def groups_2d(cols: int, rows: int, wg: int = WG) -> tuple[int, int, int]:
    return (max(1, min(4096, -(-cols // wg))), max(1, min(MAX_GROUPS, rows)), 1)


# -- entries --------------------------------------------------------------------------------

def _record(seq: Sequence, op: str, a: Operand, b: Operand | None, dst: Operand, b_rows: int,
            scale: float, dtype: str) -> None:
    shape = (a.rows, a.cols)
    check_dtype(op, dtype, shape)
    check_dims(op, dtype, shape, rows=a.rows, cols=a.cols)
    check_operand(f"{op}_{dtype}", a, shape)
    check_operand(f"{op}_{dtype}", dst, shape)
    check_alias(f"{op}_{dtype}", dst, a, shape)
    if b is not None:
        if b_rows < 1 or (a.rows and a.rows % b_rows):
            raise KernelError(f"{op}_{dtype}: b has {b_rows} rows, which does not divide the "
                              f"{a.rows} rows of a (shape {list(shape)})")
        check_operand(f"{op}_{dtype}", b, shape)
        check_alias(f"{op}_{dtype}", dst, b, shape)
    if a.rows == 0 or a.cols == 0:
        return
    k = Kernel.get(seq.device, f"{op}_{dtype}")
    bufs = [a.buf, b.buf, dst.buf] if b is not None else [a.buf, dst.buf]
    push = (a.cols, a.rows, a.offset, a.stride,
            b.offset if b is not None else 0, b.stride if b is not None else 0, b_rows,
            dst.offset, dst.stride, float(scale))
    seq.dispatch(k, bufs, push, groups_2d(a.cols, a.rows))


def _binary(seq: Sequence, op: str, a: Bindable, b: Bindable, dst: Bindable, rows: int, cols: int,
            a_offset: int, a_stride: int | None, b_offset: int, b_stride: int | None,
            b_rows: int | None, dst_offset: int, dst_stride: int | None, dtype: str,
            names: tuple[str, str] = ("a", "b")) -> None:
    b_rows = 1 if b_rows is None else b_rows
    oa = Operand(names[0], a, a_offset, cols if a_stride is None else a_stride, rows, cols)
    ob = Operand(names[1], b, b_offset, cols if b_stride is None else b_stride, b_rows, cols)
    od = Operand("dst", dst, dst_offset, cols if dst_stride is None else dst_stride, rows, cols)
    _record(seq, op, oa, ob, od, b_rows, 1.0, dtype)


def record_add(seq: Sequence, a: Bindable, b: Bindable, dst: Bindable, rows: int, cols: int, *,
               b_rows: int = 1, a_offset: int = 0, a_stride: int | None = None, b_offset: int = 0,
               b_stride: int | None = None, dst_offset: int = 0, dst_stride: int | None = None,
               dtype: str = "f32") -> None:
    """``dst[r, :] = a[r, :] + b[r % b_rows, :]`` for a ``rows x cols`` f32 tensor ``a``.

    ``b_rows`` must divide ``rows`` (1: row vector broadcast; ``rows``: same shape as ``a``).
    Offsets and strides are in elements; strides default to ``cols`` (contiguous rows)."""
    _binary(seq, "add", a, b, dst, rows, cols, a_offset, a_stride, b_offset, b_stride, b_rows,
            dst_offset, dst_stride, dtype)


def record_mul(seq: Sequence, a: Bindable, b: Bindable, dst: Bindable, rows: int, cols: int, *,
               b_rows: int = 1, a_offset: int = 0, a_stride: int | None = None, b_offset: int = 0,
               b_stride: int | None = None, dst_offset: int = 0, dst_stride: int | None = None,
               dtype: str = "f32") -> None:
    """``dst[r, :] = a[r, :] * b[r % b_rows, :]`` (see :func:`record_add`)."""
    _binary(seq, "mul", a, b, dst, rows, cols, a_offset, a_stride, b_offset, b_stride, b_rows,
            dst_offset, dst_stride, dtype)


def record_swiglu(seq: Sequence, gate: Bindable, up: Bindable | None, dst: Bindable, rows: int,
                  cols: int, *, gate_offset: int = 0, gate_stride: int | None = None,
                  up_offset: int | None = None, up_stride: int | None = None, dst_offset: int = 0,
                  dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst[r, :] = silu(gate[r, :]) * up[r, :]`` over ``rows x cols``.

    With ``up=None`` gate and up are the two halves of each row of ``gate`` (ggml's
    ``swiglu(a)``): gate = columns ``0..cols-1``, up = columns ``cols..2*cols-1``, row stride
    ``2*cols`` unless given."""
    if up is None:
        up = gate
        gate_stride = 2 * cols if gate_stride is None else gate_stride
        up_offset = gate_offset + cols if up_offset is None else up_offset
        up_stride = gate_stride if up_stride is None else up_stride
    _binary(seq, "swiglu", gate, up, dst, rows, cols, gate_offset, gate_stride,
            0 if up_offset is None else up_offset, up_stride, rows, dst_offset, dst_stride, dtype,
            names=("gate", "up"))


def _unary(seq: Sequence, op: str, src: Bindable, dst: Bindable, rows: int, cols: int, scale: float,
           src_offset: int, src_stride: int | None, dst_offset: int, dst_stride: int | None,
           dtype: str) -> None:
    os_ = Operand("src", src, src_offset, cols if src_stride is None else src_stride, rows, cols)
    od = Operand("dst", dst, dst_offset, cols if dst_stride is None else dst_stride, rows, cols)
    _record(seq, op, os_, None, od, 1, scale, dtype)


def record_scale(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int, scale: float, *,
                 src_offset: int = 0, src_stride: int | None = None, dst_offset: int = 0,
                 dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst = src * scale`` over ``rows x cols``."""
    _unary(seq, "scale", src, dst, rows, cols, scale, src_offset, src_stride, dst_offset,
           dst_stride, dtype)


def record_silu(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int, *,
                src_offset: int = 0, src_stride: int | None = None, dst_offset: int = 0,
                dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst = src * sigmoid(src)`` over ``rows x cols``."""
    _unary(seq, "silu", src, dst, rows, cols, 1.0, src_offset, src_stride, dst_offset,
           dst_stride, dtype)


def record_gelu(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int, *,
                src_offset: int = 0, src_stride: int | None = None, dst_offset: int = 0,
                dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (ggml's GELU) over ``rows x cols``."""
    _unary(seq, "gelu", src, dst, rows, cols, 1.0, src_offset, src_stride, dst_offset,
           dst_stride, dtype)


def record_geglu(seq: Sequence, gate: Bindable, up: Bindable, dst: Bindable, rows: int, cols: int, *,
                 gate_offset: int = 0, gate_stride: int | None = None, up_offset: int = 0,
                 up_stride: int | None = None, dst_offset: int = 0, dst_stride: int | None = None,
                 dtype: str = "f32") -> None:
    """``dst[r, :] = gelu(gate[r, :]) * up[r, :]`` over ``rows x cols`` (GELU as :func:`record_gelu`;
    llama.cpp's ``LLM_FFN_GELU`` + ``LLM_FFN_PAR``)."""
    _binary(seq, "geglu", gate, up, dst, rows, cols, gate_offset, gate_stride, up_offset, up_stride, rows,
            dst_offset, dst_stride, dtype, names=("gate", "up"))


def record_softcap(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int, cap: float, *,
                   src_offset: int = 0, src_stride: int | None = None, dst_offset: int = 0,
                   dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst = cap * tanh(src / cap)`` over ``rows x cols`` (``cap`` > 0; ggml's scale, tanh, scale)."""
    import math

    if not (math.isfinite(cap) and cap > 0):
        raise KernelError(f"softcap_{dtype}: cap = {cap!r} must be a finite number > 0 (shape {[rows, cols]})")
    _unary(seq, "softcap", src, dst, rows, cols, cap, src_offset, src_stride, dst_offset, dst_stride, dtype)
