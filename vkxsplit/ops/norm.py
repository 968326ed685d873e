"""RMS norm over the rows of a 2-D f32 tensor (``shaders/rms_norm.comp``).

``y = x / sqrt(mean(x^2) + eps)``, optionally times a weight row vector (``rms_norm(x) * w``,
what llama does) in the same pass. One workgroup per row, f32 accumulation.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel
from .elementwise import MAX_GROUPS, Operand, check_alias, check_dims, check_dtype, check_operand

WG = 256

VARIANTS = [
    Variant(name="rms_norm_f32", source="rms_norm.comp", defines={"FUSE_MUL": "0"}, bindings=2,
            writes=(1,), push="IIIIIIIf", local_size=(WG, 1, 1)),
    Variant(name="rms_norm_mul_f32", source="rms_norm.comp", defines={"FUSE_MUL": "1"}, bindings=3,
            writes=(2,), push="IIIIIIIf", local_size=(WG, 1, 1)),
]


def record_rms_norm(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int,
                    eps: float = 1e-6, weight: Bindable | None = None, *, src_offset: int = 0,
                    src_stride: int | None = None, weight_offset: int = 0, dst_offset: int = 0,
                    dst_stride: int | None = None, dtype: str = "f32") -> None:
    """``dst[r] = src[r] / sqrt(mean(src[r]^2) + eps) (* weight)`` for ``rows x cols``.

    ``weight`` (optional) is one f32 row of ``cols`` elements at ``weight_offset``. Offsets and
    strides are in elements; ``dst`` may be ``src`` (in place)."""
    op = "rms_norm_mul" if weight is not None else "rms_norm"
    shape = (rows, cols)
    check_dtype(op, dtype, shape)
    check_dims(op, dtype, shape, rows=rows, cols=cols)
    if not eps >= 0.0:
        raise KernelError(f"{op}_{dtype}: eps = {eps!r} must be >= 0 (shape {list(shape)})")
    s = Operand("src", src, src_offset, cols if src_stride is None else src_stride, rows, cols)
    d = Operand("dst", dst, dst_offset, cols if dst_stride is None else dst_stride, rows, cols)
    check_operand(f"{op}_{dtype}", s, shape)
    check_operand(f"{op}_{dtype}", d, shape)
    check_alias(f"{op}_{dtype}", d, s, shape)
    bufs: list[Bindable] = [src, dst]
    if weight is not None:
        w = Operand("weight", weight, weight_offset, cols, 1, cols)
        check_operand(f"{op}_{dtype}", w, shape)
        check_alias(f"{op}_{dtype}", d, w, shape)
        bufs = [src, weight, dst]
    if rows == 0 or cols == 0:
        return
    k = Kernel.get(seq.device, f"{op}_{dtype}")
    seq.dispatch(k, bufs, (cols, rows, s.offset, s.stride, weight_offset, d.offset, d.stride,
                           float(eps)), min(rows, MAX_GROUPS))
