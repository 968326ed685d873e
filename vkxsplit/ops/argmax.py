"""Argmax over the rows of a 2-D f32 tensor (``shaders/argmax.comp``): one int32 per row, ties
to the lowest index; -1 for a row holding any NaN or +infinity (:data:`NONFINITE`), which the
model reports as non-finite logits instead of decoding an id."""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, workgroup_fits
from .elementwise import MAX_GROUPS, Operand, check_alias, check_dims, check_dtype, check_operand

WG = 256
#: the workgroup size for few rows (decode's one row of logits: one workgroup does it all)
WG_WIDE = 1024
WIDE_ROWS = 4
#: what a row with a NaN or a +infinity gives (-infinity never wins: allowed)
NONFINITE = -1

# one SPIR-V module at two workgroup sizes (WG is a specialization constant)
VARIANTS = [
    Variant(name="argmax_f32" + ("" if wg == WG else f"_wg{wg}"), source="argmax.comp", bindings=2, writes=(1,),
            push="IIIII", local_size=(wg, 1, 1), module="argmax_f32", spec={"WG": wg}, spec_ids={"WG": 0},
            local_size_spec="WG")
    for wg in (WG, WG_WIDE)
]


def _kernel(seq: Sequence, name: str, rows: int) -> Kernel:
    """``name`` at the workgroup size for ``rows`` rows (the wide one where the device has it)."""
    if rows <= WIDE_ROWS and workgroup_fits(seq.device, (WG_WIDE, 1, 1)):
        return Kernel.get(seq.device, f"{name}_wg{WG_WIDE}")
    return Kernel.get(seq.device, name)


def record_argmax(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int, *,
                  src_offset: int = 0, src_stride: int | None = None, dst_offset: int = 0,
                  dtype: str = "f32") -> None:
    """``dst[dst_offset + r] = argmax(src[r, :])`` (int32) for a ``rows x cols`` f32 tensor, or
    NONFINITE where the row holds a NaN or a +infinity."""
    op = "argmax"
    shape = (rows, cols)
    check_dtype(op, dtype, shape)
    check_dims(op, dtype, shape, rows=rows, cols=cols)
    if cols == 0 and rows > 0:
        raise KernelError(f"argmax_{dtype}: rows of length 0 have no argmax (shape {list(shape)})")
    s = Operand("src", src, src_offset, cols if src_stride is None else src_stride, rows, cols)
    d = Operand("dst", dst, dst_offset, 1, 1, rows)
    check_operand(f"{op}_{dtype}", s, shape)
    check_operand(f"{op}_{dtype}", d, shape)
    check_alias(f"{op}_{dtype}", d, s, shape)
    if rows == 0:
        return
    k = _kernel(seq, f"{op}_{dtype}", rows)
    seq.dispatch(k, [src, dst], (cols, rows, s.offset, s.stride, dst_offset), min(rows, MAX_GROUPS))
