"""Embedding lookup: ``out[i, :] = dequant(W[ids[i], :])`` (``shaders/get_rows.comp``).

``W`` holds raw ggml rows of ``K`` elements in any type of :mod:`vkxsplit.ops.quant`;
``ids`` are int32; ``out`` is f32. An id outside ``[0, n_rows)`` produces a row of NaN (the
kernel never reads outside the weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import KernelError
from ..shaders import Variant
from ..vk.kernel import Bindable, Kernel, as_range, bindings_overlap
from .quant import TYPES, TypeLike, WeightType, weight_type

if TYPE_CHECKING:
    from ..vk.command import Sequence

WG = 64
MAX_GROUPS = 65535
DQ_WG = 256          # dequant_rows: threads per workgroup, 8 elements each
DQ_ROW_GROUPS = 4096  # dequant_rows: workgroups across the rows (each loops over n / 4096 rows)

VARIANTS = [
    Variant(name=f"get_rows_{t}_f32", source="get_rows.comp", defines={"WTYPE": str(wt.id)},
            bindings=3, writes=(2,), push="I" * 8, local_size=(WG, 1, 1),
            requires=("storageBuffer16BitAccess", "storageBuffer8BitAccess"))
    for t, wt in TYPES.items()
] + [
    # rows of quantized weights to compact f16 rows (mul_mat's dequantize-first path, dq16)
    Variant(name=f"dequant_rows_{t}_f16", source="dequant_rows.comp", defines={"WTYPE": str(wt.id)},
            bindings=2, writes=(1,), push="I" * 4, local_size=(DQ_WG, 1, 1),
            requires=("storageBuffer16BitAccess", "storageBuffer8BitAccess"))
    for t, wt in TYPES.items() if wt.quantized
]


def record_get_rows(seq: Sequence, w: Bindable, w_type: TypeLike | WeightType, ids: Bindable, out: Bindable,
                    n_ids: int, K: int, ids_offset: int = 0, out_offset: int = 0,
                    out_stride: int | None = None, n_rows: int | None = None, row0: int | None = None) -> None:
    """Record ``out[out_offset + i*out_stride + k] = W[ids[ids_offset + i], k]`` for i < n_ids,
    k < K (offsets/strides in elements; ``out_stride`` defaults to K; ``n_rows``, the rows of
    W that ids may name, defaults to all rows that fit the binding).

    ``row0`` (a table too large for one binding, looked up part by part): ``w`` holds rows
    ``row0 .. row0 + n_rows - 1``; ids in that range are looked up, the others skipped (their
    output rows untouched)."""
    wt = weight_type(w_type)
    name = f"get_rows[{wt.name.upper()}, n_ids={n_ids}, K={K}]"
    out_stride = K if out_stride is None else out_stride
    for what, v in (("n_ids", n_ids), ("K", K), ("ids_offset", ids_offset), ("out_offset", out_offset),
                    ("out_stride", out_stride)):
        if not isinstance(v, int) or v < 0:
            raise KernelError(f"{name}: {what} must be a non-negative integer, got {v!r}")
    if K == 0:
        raise KernelError(f"{name}: K must be at least 1")
    if K % wt.block_size:
        raise KernelError(f"{name}: K must be a multiple of the {wt.name.upper()} block size {wt.block_size}")
    if n_ids > 1 and out_stride < K:
        raise KernelError(f"{name}: out_stride {out_stride} < K (rows would overlap)")
    rbytes = wt.row_bytes(K)
    _, w_off, w_size, _ = as_range(w)
    _, i_off, i_size, _ = as_range(ids)
    _, o_off, o_size, _ = as_range(out)
    if w_off % 16:
        raise KernelError(f"{name}: the weight binding starts at byte {w_off}, not 16-byte aligned")
    if i_off % 4 or o_off % 4:
        raise KernelError(f"{name}: ids/out bindings must be 4-byte aligned")
    fit = w_size // rbytes
    n_rows = fit if n_rows is None else n_rows
    if n_rows > fit or n_rows < 0:
        raise KernelError(f"{name}: {n_rows} rows of {rbytes} bytes do not fit the weight binding "
                          f"({w_size} bytes)")
    if (ids_offset + n_ids) * 4 > i_size:
        raise KernelError(f"{name}: {n_ids} ids from {ids_offset} do not fit the ids binding ({i_size} bytes)")
    if n_ids and (out_offset + (n_ids - 1) * out_stride + K) * 4 > o_size:
        raise KernelError(f"{name}: the output does not fit its binding ({o_size} bytes)")
    if n_ids and out_offset + (n_ids - 1) * out_stride + K >= 1 << 32:
        raise KernelError(f"{name}: element offsets exceed 32 bits")
    if bindings_overlap(out, w) or bindings_overlap(out, ids):
        raise KernelError(f"{name}: out overlaps the weights or the ids")
    gx = ((K + 3) // 4 + WG - 1) // WG
    if gx > MAX_GROUPS:
        raise KernelError(f"{name}: rows of {K} elements are too long for one dispatch")
    if n_ids == 0:
        return
    flags = (2 if (wt.quantized or K % 4 == 0) else 0) | (4 if row0 is not None else 0)
    if row0 is not None and not 0 <= row0 < 1 << 31:
        raise KernelError(f"{name}: row0 = {row0!r} is not a row index")
    kernel = Kernel.get(seq.device, f"get_rows_{wt.name}_f32")
    seq.dispatch(kernel, [w, ids, out], (n_ids, K, n_rows, ids_offset, out_offset, out_stride, flags, row0 or 0),
                 (gx, min(n_ids, MAX_GROUPS), 1))


def record_dequant_rows(seq: Sequence, w: Bindable, w_type: TypeLike | WeightType, out: Bindable, n: int, K: int,
                        row0: int = 0, out_offset: int = 0) -> None:
    """Record ``out[out_offset + i*K + k] = f16(dequant(W[row0 + i, k]))`` for i < n, k < K
    (quantized types; ``out`` holds f16, offsets in elements, ``out_offset`` % 8 == 0)."""
    wt = weight_type(w_type)
    name = f"dequant_rows[{wt.name.upper()}, n={n}, K={K}]"
    if not wt.quantized:
        raise KernelError(f"{name}: only quantized types (float weights need no dequantization)")
    for what, v in (("n", n), ("K", K), ("row0", row0), ("out_offset", out_offset)):
        if not isinstance(v, int) or v < 0:
            raise KernelError(f"{name}: {what} must be a non-negative integer, got {v!r}")
    if K == 0 or K % wt.block_size:
        raise KernelError(f"{name}: K must be a positive multiple of the {wt.name.upper()} block size "
                          f"{wt.block_size}")
    if out_offset % 8:
        raise KernelError(f"{name}: out_offset must be a multiple of 8 (16-byte stores)")
    rbytes = wt.row_bytes(K)
    _, w_off, w_size, _ = as_range(w)
    _, o_off, o_size, _ = as_range(out)
    if w_off % 16 or o_off % 16:
        raise KernelError(f"{name}: the weight and output bindings must start 16-byte aligned")
    if (row0 + n) * rbytes > w_size:
        raise KernelError(f"{name}: rows {row0}..{row0 + n} of {rbytes} bytes do not fit the weight "
                          f"binding ({w_size} bytes)")
    if (out_offset + n * K) * 2 > o_size:
        raise KernelError(f"{name}: {n} rows of {K} f16 do not fit the output binding ({o_size} bytes)")
    if (row0 + n) * rbytes >= 1 << 32 or out_offset + n * K >= 1 << 32:
        raise KernelError(f"{name}: offsets exceed 32 bits")
    if bindings_overlap(out, w):
        raise KernelError(f"{name}: out overlaps the weights")
    gx = (K // 8 + DQ_WG - 1) // DQ_WG
    if gx > MAX_GROUPS:
        raise KernelError(f"{name}: rows of {K} elements are too long for one dispatch")
    if n == 0:
        return
    seq.dispatch(Kernel.get(seq.device, f"dequant_rows_{wt.name}_f16"), [w, out], (n, K, row0, out_offset),
                 (gx, min(n, DQ_ROW_GROUPS), 1))
