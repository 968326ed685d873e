"""convert / copy between f32, f16 and bf16 (``shaders/convert.comp``).

Rounding is round-to-nearest-even done in integer bit math, so results are bit-exact with
``ml_dtypes``/numpy on every device; NaN stays NaN, infinities and signed zeros are kept,
f16 subnormals are produced and read exactly.
"""

from __future__ import annotations

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel, as_range

DTYPES = {"f32": (0, 4), "f16": (1, 2), "bf16": (2, 2)}
WG = 256
MAX_GROUPS = 4096

VARIANTS = [
    Variant(name=f"convert_{s}_{d}", source="convert.comp",
            defines={"SRC_TYPE": str(DTYPES[s][0]), "DST_TYPE": str(DTYPES[d][0])},
            bindings=2, writes=(1,), push="III", local_size=(WG, 1, 1),
            requires=("storageBuffer16BitAccess",))
    for s in DTYPES for d in DTYPES
] + [
    # strided rows to compact ones (the f16 activations of mul_mat_cm2)
    Variant(name="convert_rows_f32_f16", source="convert.comp",
            defines={"SRC_TYPE": "0", "DST_TYPE": "1", "ROWS": "1"},
            bindings=2, writes=(1,), push="IIII", local_size=(WG, 1, 1),
            requires=("storageBuffer16BitAccess",))
]
#: most workgroups per row of convert_rows (each loops over the row's remaining elements)
ROW_GROUPS = 16
#: most rows of one convert_rows dispatch (Vulkan's guaranteed grid size)
MAX_ROWS = 65535


def itemsize(dtype: str) -> int:
    if dtype not in DTYPES:
        raise KernelError(f"convert: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[dtype][1]


def record_convert(seq: Sequence, src: Bindable, dst: Bindable, n: int, src_type: str, dst_type: str,
                   src_offset: int = 0, dst_offset: int = 0) -> None:
    """Record ``dst[dst_offset:+n] = convert(src[src_offset:+n])`` (offsets in elements)."""
    ss, ds = itemsize(src_type), itemsize(dst_type)
    _, _, sbytes, _ = as_range(src)
    _, _, dbytes, _ = as_range(dst)
    if (src_offset + n) * ss > sbytes or (dst_offset + n) * ds > dbytes:
        raise KernelError(f"convert_{src_type}_{dst_type}: {n} elements do not fit the buffers "
                          f"({sbytes} and {dbytes} bytes)")
    if n == 0:
        return
    k = Kernel.get(seq.device, f"convert_{src_type}_{dst_type}")
    groups = min(MAX_GROUPS, (n + WG - 1) // WG)
    seq.dispatch(k, [src, dst], (n, src_offset, dst_offset), groups)


def record_convert_rows(seq: Sequence, src: Bindable, dst: Bindable, rows: int, n: int, src_stride: int,
                        src_offset: int = 0, dst_offset: int = 0) -> None:
    """Record ``dst[dst_offset + r*n + i] = f16(src[src_offset + r*src_stride + i])`` for r <
    ``rows``, i < ``n`` (f32 to f16, offsets and stride in elements): strided rows to compact."""
    _, _, sbytes, _ = as_range(src)
    _, _, dbytes, _ = as_range(dst)
    if rows == 0 or n == 0:
        return
    if (src_offset + (rows - 1) * src_stride + n) * 4 > sbytes or (dst_offset + rows * n) * 2 > dbytes:
        raise KernelError(f"convert_rows_f32_f16: {rows} rows of {n} (stride {src_stride}) do not fit "
                          f"the buffers ({sbytes} and {dbytes} bytes)")
    k = Kernel.get(seq.device, "convert_rows_f32_f16")
    for r0 in range(0, rows, MAX_ROWS):  # the grid's y dimension: at most 65535 rows a dispatch
        nr = min(MAX_ROWS, rows - r0)
        seq.dispatch(k, [src, dst], (n, src_offset + r0 * src_stride, dst_offset + r0 * n, src_stride),
                     (min(ROW_GROUPS, (n + WG - 1) // WG), nr, 1))
