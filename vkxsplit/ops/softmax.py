"""Softmax over the rows of a 2-D f32 tensor (``shaders/softmax.comp``).

``y = softmax(x * scale + mask)``: the optional additive f32 mask has ``mask_rows`` rows and
row ``r`` of ``x`` uses mask row ``r % mask_rows`` (1: one row broadcast to all; for attention
scores laid out [head, token, kv] it is the [token, kv] causal mask). Numerically stable (the
row maximum is subtracted); ``-inf`` entries give 0, a row that is ``-inf`` everywhere gives
zeros.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel
from .elementwise import MAX_GROUPS, Operand, check_alias, check_dims, check_dtype, check_operand

WG = 256
PUSH = "IIIIIIIIIf"

VARIANTS = [
    Variant(name="softmax_f32", source="softmax.comp", defines={"HAS_MASK": "0"}, bindings=2,
            writes=(1,), push=PUSH, local_size=(WG, 1, 1)),
    Variant(name="softmax_mask_f32", source="softmax.comp", defines={"HAS_MASK": "1"}, bindings=3,
            writes=(2,), push=PUSH, local_size=(WG, 1, 1)),
]


def record_softmax(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int, *,
                   scale: float = 1.0, mask: Bindable | None = None, mask_rows: int = 1,
                   mask_offset: int = 0, mask_stride: int | None = None, src_offset: int = 0,
                   src_stride: int | None = None, dst_offset: int = 0,
                   dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst[r] = softmax(src[r] * scale + mask[r % mask_rows])`` for ``rows x cols``.

    Offsets and strides in elements; ``dst`` may be ``src`` (in place)."""
    op = "softmax_mask" if mask is not None else "softmax"
    shape = (rows, cols)
    check_dtype(op, dtype, shape)
    check_dims(op, dtype, shape, rows=rows, cols=cols, mask_rows=mask_rows)
    s = Operand("src", src, src_offset, cols if src_stride is None else src_stride, rows, cols)
    d = Operand("dst", dst, dst_offset, cols if dst_stride is None else dst_stride, rows, cols)
    check_operand(f"{op}_{dtype}", s, shape)
    check_operand(f"{op}_{dtype}", d, shape)
    check_alias(f"{op}_{dtype}", d, s, shape)
    bufs: list[Bindable] = [src, dst]
    m_stride = cols if mask_stride is None else mask_stride
    if mask is not None:
        if mask_rows < 1:
            raise KernelError(f"{op}_{dtype}: mask_rows = {mask_rows} (shape {list(shape)})")
        m = Operand("mask", mask, mask_offset, m_stride, mask_rows, cols)
        check_operand(f"{op}_{dtype}", m, shape)
        check_alias(f"{op}_{dtype}", d, m, shape)
        bufs = [src, mask, dst]
    if rows == 0 or cols == 0:
        return
    k = Kernel.get(seq.device, f"{op}_{dtype}")
    seq.dispatch(k, bufs, (cols, rows, s.offset, s.stride, mask_offset, m_stride, max(mask_rows, 1),
                           d.offset, d.stride, float(scale)), min(rows, MAX_GROUPS))
