"""RMS norm over the rows of a 2-D f32 tensor (``shaders/rms_norm.comp``).

``y = x / sqrt(mean(x^2) + eps)``, optionally times a weight row vector (``rms_norm(x) * w``,
what llama does) in the same pass. One workgroup per row, f32 accumulation.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, spans_overlap, workgroup_fits
from .elementwise import MAX_GROUPS, Operand, check_alias, check_dims, check_dtype, check_operand
from .mul_mat import check_q8_1_scratch

WG = 256
#: the workgroup size for a step of few rows (decode): one row is one workgroup's work, so a
#: wider workgroup has a quarter of the serial work (loads, reduction, q8_1 blocks) per invocation
WG_WIDE = 1024
#: rows up to which, with rows of at least WIDE_COLS, the wide workgroup is used
WIDE_ROWS = 4
WIDE_COLS = 2048

_BASE = [  # (name, defines, bindings, writes)
    ("rms_norm_f32", {"FUSE_MUL": "0", "FUSE_ADD": "0"}, 2, (1,)),
    ("rms_norm_mul_f32", {"FUSE_MUL": "1", "FUSE_ADD": "0"}, 3, (2,)),
    ("add_rms_norm_mul_f32", {"FUSE_MUL": "1", "FUSE_ADD": "1"}, 4, (0, 3)),
    # the output also as q8_1 blocks (the x of the integer-dot-product mat-vecs that read it)
    ("rms_norm_mul_q8_1_f32", {"FUSE_MUL": "1", "FUSE_ADD": "0", "Q8": "1"}, 4, (2, 3)),
    ("add_rms_norm_mul_q8_1_f32", {"FUSE_MUL": "1", "FUSE_ADD": "1", "Q8": "1"}, 5, (0, 3, 4)),
]

# each kernel at both workgroup sizes, one SPIR-V module (WG is a specialization constant)
VARIANTS = [
    Variant(name=name + ("" if wg == WG else f"_wg{wg}"), source="rms_norm.comp", defines=defines,
            bindings=bindings, writes=writes, push="IIIIIIIfII", local_size=(wg, 1, 1), module=name,
            spec={"WG": wg}, spec_ids={"WG": 0}, local_size_spec="WG")
    for name, defines, bindings, writes in _BASE for wg in (WG, WG_WIDE)
]


def _kernel(seq: Sequence, name: str, rows: int, cols: int) -> Kernel:
    """``name`` at the workgroup size for ``rows x cols`` (the wide one where the device has it)."""
    if rows <= WIDE_ROWS and cols >= WIDE_COLS and workgroup_fits(seq.device, (WG_WIDE, 1, 1)):
        return Kernel.get(seq.device, f"{name}_wg{WG_WIDE}")
    return Kernel.get(seq.device, name)


def record_rms_norm(seq: Sequence, src: Bindable, dst: Bindable, rows: int, cols: int,
                    eps: float = 1e-6, weight: Bindable | None = None, *, src_offset: int = 0,
                    src_stride: int | None = None, weight_offset: int = 0, dst_offset: int = 0,
                    dst_stride: int | None = None, dtype: str = "f32", xq: Bindable | None = None) -> None:
    """``dst[r] = src[r] / sqrt(mean(src[r]^2) + eps) (* weight)`` for ``rows x cols``.

    ``weight`` (optional) is one f32 row of ``cols`` elements at ``weight_offset``. Offsets and
    strides are in elements; ``dst`` may be ``src`` (in place). ``xq`` (with ``weight``): also
    write dst as q8_1 blocks there, the bits ``record_quantize_q8_1`` would make of it."""
    if xq is not None and weight is None:
        raise KernelError("rms_norm: the q8_1 output (xq) needs the weight (rms_norm_mul_q8_1)")
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
    if xq is not None:
        check_q8_1_scratch(f"{op}_q8_1_{dtype}", xq, rows, cols, (("src", src), ("weight", weight), ("dst", dst)))
        op += "_q8_1"
        bufs.append(xq)
    if rows == 0 or cols == 0:
        return
    k = _kernel(seq, f"{op}_{dtype}", rows, cols)
    seq.dispatch(k, bufs, (cols, rows, s.offset, s.stride, weight_offset, d.offset, d.stride,
                           float(eps), 0, 0), min(rows, MAX_GROUPS))


def record_add_rms_norm(seq: Sequence, x: Bindable, residual: Bindable, weight: Bindable, dst: Bindable,
                        rows: int, cols: int, eps: float = 1e-6, *, x_offset: int = 0,
                        x_stride: int | None = None, residual_offset: int = 0,
                        residual_stride: int | None = None, weight_offset: int = 0, dst_offset: int = 0,
                        dst_stride: int | None = None, dtype: str = "f32", xq: Bindable | None = None) -> None:
    """``x[r] += residual[r]`` (in place), then ``dst[r] = rms_norm(x[r]) * weight`` for
    ``rows x cols``: the residual add of a decoder block fused with the next norm (one dispatch
    and one barrier level fewer). ``dst`` must not overlap ``x`` or ``residual``. ``xq``: also
    write dst as q8_1 blocks there (as :func:`record_rms_norm`)."""
    op = "add_rms_norm_mul"
    shape = (rows, cols)
    check_dtype(op, dtype, shape)
    check_dims(op, dtype, shape, rows=rows, cols=cols)
    if not eps >= 0.0:
        raise KernelError(f"{op}_{dtype}: eps = {eps!r} must be >= 0 (shape {list(shape)})")
    xs = Operand("x", x, x_offset, cols if x_stride is None else x_stride, rows, cols)
    rs = Operand("residual", residual, residual_offset, cols if residual_stride is None else residual_stride,
                 rows, cols)
    w = Operand("weight", weight, weight_offset, cols, 1, cols)
    d = Operand("dst", dst, dst_offset, cols if dst_stride is None else dst_stride, rows, cols)
    for o in (xs, rs, w, d):
        check_operand(f"{op}_{dtype}", o, shape)
    check_alias(f"{op}_{dtype}", xs, rs, shape)
    for other in (xs, rs, w):
        if spans_overlap(d.span(), other.span()):
            raise KernelError(f"{op}_{dtype}: dst overlaps {other.name} (shape {list(shape)})")
    bufs: list[Bindable] = [x, residual, weight, dst]
    if xq is not None:
        check_q8_1_scratch(f"{op}_q8_1_{dtype}", xq, rows, cols,
                           (("x", x), ("residual", residual), ("weight", weight), ("dst", dst)))
        op += "_q8_1"
        bufs.append(xq)
    if rows == 0 or cols == 0:
        return
    k = _kernel(seq, f"{op}_{dtype}", rows, cols)
    seq.dispatch(k, bufs,
                 (cols, rows, xs.offset, xs.stride, weight_offset, d.offset, d.stride, float(eps),
                  rs.offset, rs.stride), min(rows, MAX_GROUPS))
