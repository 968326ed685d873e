"""Matrix products with GGUF weights: ``y[m, n] = sum_k x[m, k] * W[n, k]`` (ggml's x @ W^T).

``W`` is a weight tensor of ``N`` rows (output features) of ``K`` elements, stored raw in its
ggml type (:mod:`vkxsplit.ops.quant`); ``x`` is f32 ``[M, K]`` and ``y`` f32 ``[M, N]``, both
row-major with arbitrary row strides (in elements). Three kernel families
(``shaders/mul_mat_vec.comp``, ``mul_mat.comp``, ``mul_mat_coopmat.comp``; dequantization in
``shaders/dequant.glsl``):

- ``vec`` (``mul_mat_vec_<type>_f32``, and ``..._f32_m1/_m2/_m4`` compiled for at most
  1/2/4 columns), M <= 8: a workgroup computes a few output rows for all M columns, reading
  each weight once; memory-bandwidth bound (decode).
- ``tiled`` (``mul_mat_<type>_f32``), any M: 64 x 64 shared-memory tiles with 4 x 4 register
  blocking, W dequantized in the tile loader; f32 throughout.
- ``coopmat`` (``mul_mat_coopmat_<type>_f32``), any M: GL_KHR_cooperative_matrix 16x16x16
  with f16 operands and f32 accumulation; used for M > 8 when the device has it (and
  ``VKXSPLIT_DISABLE_COOPMAT`` is not set).

A tensor split computes only output rows ``[r0, r0 + N)``: pass ``w_row_offset=r0`` (and
the full tensor as ``w``); results go to y columns ``y_col_offset + n`` (default ``r0``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import KernelError
from ..shaders import Variant
from ..vk.instance import env_flag
from ..vk.kernel import Bindable, Kernel, as_range
from .quant import TYPES, TypeLike, WeightType, weight_type

if TYPE_CHECKING:
    from ..vk.command import Sequence
    from ..vk.device import Device

MAX_VEC_M = 8           # the mat-vec kernel handles up to this many columns of x in one pass
PUSH = "I" * 10         # M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0, y_col0, flags
FLAG_XVEC = 1           # x rows are vec4-aligned (x binding 16-aligned, offset/stride % 4 == 0)
FLAG_WVEC = 2           # float W rows allow vector loads (vec: K % 8 == 0; others: K % 4 == 0)
MAX_GROUPS = 65535      # per grid dimension (Vulkan's guaranteed minimum; lavapipe and NVIDIA)

_STORAGE = ("storageBuffer16BitAccess", "storageBuffer8BitAccess")

# mat-vec shape per type: (workgroup size, output rows per workgroup); tuned on an H200
VEC_CONFIG: dict[str, tuple[int, int]] = {
    **{t: (64, 2) for t in ("f32", "f16", "bf16")},
    **{t: (32, 4) for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")},
    **{t: (32, 2) for t in ("q4_k", "q5_k", "q6_k")},
}
# mat-vec variants by the most columns of x they handle (fewer columns, fewer registers);
# the 8-column one is mul_mat_vec_<type>_f32, the others carry an _m<n> suffix
VEC_MAXM = (1, 2, 4, 8)


def vec_kernel_name(t: str, M: int) -> str:
    mm = next(m for m in VEC_MAXM if m >= M)
    return f"mul_mat_vec_{t}_f32" + ("" if mm == MAX_VEC_M else f"_m{mm}")


TILED_BM, TILED_BN = 64, 64       # mul_mat.comp tile (rows of x, rows of W)
COOP_BM, COOP_BN = 64, 128        # mul_mat_coopmat.comp tile
COOP_SUBGROUP = 32

VARIANTS = (
    [Variant(name=vec_kernel_name(t, mm), source="mul_mat_vec.comp",
             defines={"WTYPE": str(wt.id), "WG": str(VEC_CONFIG[t][0]), "NR": str(VEC_CONFIG[t][1]),
                      "MAXM": str(mm)},
             bindings=3, writes=(2,), push=PUSH, local_size=(VEC_CONFIG[t][0], 1, 1), requires=_STORAGE)
     for t, wt in TYPES.items() for mm in VEC_MAXM]
    + [Variant(name=f"mul_mat_{t}_f32", source="mul_mat.comp", defines={"WTYPE": str(wt.id)},
               bindings=3, writes=(2,), push=PUSH, local_size=(256, 1, 1), requires=_STORAGE)
       for t, wt in TYPES.items()]
    + [Variant(name=f"mul_mat_coopmat_{t}_f32", source="mul_mat_coopmat.comp", defines={"WTYPE": str(wt.id)},
               bindings=3, writes=(2,), push=PUSH, local_size=(128, 1, 1), target_env="vulkan1.3",
               compiler="glslang", subgroup_size=COOP_SUBGROUP,
               requires=("cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel", "subgroupSizeControl",
                         *_STORAGE))
       for t, wt in TYPES.items()]
)

PATHS = ("vec", "tiled", "coopmat")

# VkComponentTypeKHR / VkScopeKHR values
_FLOAT16, _FLOAT32, _SCOPE_SUBGROUP = 0, 1, 3
_SUBGROUP_ARITHMETIC = 0x4
_STAGE_COMPUTE = 0x20


def coopmat_disabled() -> bool:
    """``VKXSPLIT_DISABLE_COOPMAT=1`` switches the cooperative-matrix path off."""
    return env_flag("VKXSPLIT_DISABLE_COOPMAT")


def coopmat_supported(device: Device) -> bool:
    """Whether ``device`` can run the coopmat kernels: the cooperativeMatrix feature, an
    f16 x f16 -> f32 16x16x16 subgroup shape, f16 arithmetic, the Vulkan memory model, and
    subgroup size 32 (the kernels' layout)."""
    f = device.features
    if not all(f.get(x) for x in ("cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel",
                                  "subgroupSizeControl")):
        return False
    p = device.physical
    if not (p.min_subgroup_size <= COOP_SUBGROUP <= p.max_subgroup_size):
        return False
    return any(s.m == 16 and s.n == 16 and s.k == 16 and s.a_type == _FLOAT16 and s.b_type == _FLOAT16
               and s.c_type == _FLOAT32 and s.result_type == _FLOAT32 and s.scope == _SCOPE_SUBGROUP
               for s in p.coopmat_shapes)


def coopmat_available(device: Device) -> bool:
    return not coopmat_disabled() and coopmat_supported(device)


def vec_supported(device: Device) -> bool:
    """The mat-vec kernel reduces with subgroup arithmetic in compute shaders."""
    p = device.physical
    return bool(p.subgroup_ops & _SUBGROUP_ARITHMETIC) and bool(p.subgroup_stages & _STAGE_COMPUTE)


def _grid(path: str, wt: WeightType, M: int, N: int) -> tuple[int, int, int]:
    if path == "vec":
        g = max(1, -(-N // VEC_CONFIG[wt.name][1]))
        gx = min(g, MAX_GROUPS)
        return gx, -(-g // gx), 1
    bm, bn = (TILED_BM, TILED_BN) if path == "tiled" else (COOP_BM, COOP_BN)
    return max(1, -(-N // bn)), max(1, -(-M // bm)), 1


def check_mul_mat(w_type: TypeLike | WeightType, M: int, N: int, K: int, path: str | None = None,
                  device: Device | None = None) -> str:
    """Plan-time check that a ``[M, K] x [N, K]^T`` product with ``w_type`` weights has a
    kernel; returns the path :func:`record_mul_mat` would take (with ``device=None``, the
    device-independent choice: ``vec`` for M <= 8, else ``tiled``). Raises KernelError."""
    wt = weight_type(w_type)
    name = f"mul_mat[{wt.name.upper()}, M={M}, N={N}, K={K}]"
    for what, v in (("M", M), ("N", N), ("K", K)):
        if not isinstance(v, int) or v < 0:
            raise KernelError(f"{name}: {what} must be a non-negative integer")
    if K == 0:
        raise KernelError(f"{name}: K must be at least 1")
    if K % wt.block_size:
        raise KernelError(f"{name}: K must be a multiple of the {wt.name.upper()} block size "
                          f"{wt.block_size}", "ggml stores whole blocks per row; check the tensor's shape")
    if wt.row_bytes(K) * max(N, 1) >= 1 << 32:
        raise KernelError(f"{name}: the weight tensor is 4 GiB or more; byte offsets are 32-bit")
    if path is not None and path not in PATHS:
        raise KernelError(f"{name}: unknown path {path!r} (one of {', '.join(PATHS)})")
    if path is None:
        if M <= MAX_VEC_M and (device is None or vec_supported(device)):
            path = "vec"
        elif device is not None and coopmat_available(device):
            path = "coopmat"
        else:
            path = "tiled"
    elif path == "vec":
        if M > MAX_VEC_M:
            raise KernelError(f"{name}: the mat-vec path handles M <= {MAX_VEC_M}")
        if device is not None and not vec_supported(device):
            raise KernelError(f"{name}: the mat-vec path needs subgroup arithmetic in compute shaders, "
                              f"which '{device.name}' lacks")
    elif path == "coopmat" and device is not None:
        if coopmat_disabled():
            raise KernelError(f"{name}: the coopmat path is disabled (VKXSPLIT_DISABLE_COOPMAT)")
        if not coopmat_supported(device):
            raise KernelError(f"{name}: '{device.name}' has no f16 16x16x16 subgroup cooperative "
                              "matrices with subgroup size 32")
    gx, gy, _ = _grid(path, wt, M, N)
    if gx > MAX_GROUPS or gy > MAX_GROUPS:
        raise KernelError(f"{name}: too large for one {path} dispatch ({gx} x {gy} workgroups)")
    return path


def _overlap(a: Bindable, b: Bindable) -> bool:
    _, oa, sa, ba = as_range(a)
    _, ob, sb, bb = as_range(b)
    return ba == bb and oa < ob + sb and ob < oa + sa


def record_mul_mat(seq: Sequence, w: Bindable, w_type: TypeLike | WeightType, x: Bindable, y: Bindable,
                   M: int, N: int, K: int, x_stride: int | None = None, y_stride: int | None = None,
                   x_offset: int = 0, y_offset: int = 0, w_row_offset: int = 0, path: str | None = None,
                   y_col_offset: int | None = None) -> str:
    """Record ``y[y_offset + m*y_stride + y_col_offset + n] = sum_k x[x_offset + m*x_stride + k]
    * W[w_row_offset + n, k]`` for m < M, n < N (offsets and strides in elements; W rows are
    raw ggml rows of K elements starting at byte 0 of ``w``). ``x_stride`` defaults to K,
    ``y_col_offset`` to ``w_row_offset``, ``y_stride`` to ``y_col_offset + N``. ``path``:
    ``vec`` / ``tiled`` / ``coopmat`` or None (M <= 8: vec; else coopmat when available, else
    tiled). Returns the path taken. Raises KernelError for anything no kernel handles."""
    wt = weight_type(w_type)
    dev = seq.device
    path = check_mul_mat(wt, M, N, K, path=path, device=dev)
    name = f"mul_mat[{wt.name.upper()}, M={M}, N={N}, K={K}]"
    x_stride = K if x_stride is None else x_stride
    y_col = w_row_offset if y_col_offset is None else y_col_offset
    y_stride = y_col + N if y_stride is None else y_stride
    for what, v in (("x_stride", x_stride), ("y_stride", y_stride), ("x_offset", x_offset),
                    ("y_offset", y_offset), ("w_row_offset", w_row_offset), ("y_col_offset", y_col)):
        if not isinstance(v, int) or v < 0:
            raise KernelError(f"{name}: {what} must be a non-negative integer, got {v!r}")
    if M > 1 and x_stride < K:
        raise KernelError(f"{name}: x_stride {x_stride} < K")
    if M > 1 and y_stride < y_col + N:
        raise KernelError(f"{name}: y_stride {y_stride} < y_col_offset + N = {y_col + N} (rows would overlap)")

    _, w_off, w_size, _ = as_range(w)
    _, x_off, x_size, _ = as_range(x)
    _, y_off, y_size, _ = as_range(y)
    if w_off % 16:
        raise KernelError(f"{name}: the weight binding starts at byte {w_off}, not 16-byte aligned")
    if x_off % 4 or y_off % 4:
        raise KernelError(f"{name}: x/y bindings must be 4-byte aligned")
    rbytes = wt.row_bytes(K)
    if (w_row_offset + N) * rbytes > w_size:
        raise KernelError(f"{name}: rows {w_row_offset}..{w_row_offset + N} of {rbytes} bytes do not fit "
                          f"the weight binding ({w_size} bytes)")
    if M and (x_offset + (M - 1) * x_stride + K) * 4 > x_size:
        raise KernelError(f"{name}: x ({M} rows of stride {x_stride} from {x_offset}) does not fit "
                          f"its binding ({x_size} bytes)")
    if M and (y_offset + (M - 1) * y_stride + y_col + N) * 4 > y_size:
        raise KernelError(f"{name}: y ({M} rows of stride {y_stride} from {y_offset}, columns "
                          f"{y_col}..{y_col + N}) does not fit its binding ({y_size} bytes)")
    if _overlap(y, w) or _overlap(y, x):
        raise KernelError(f"{name}: y overlaps x or the weights")
    for v in (x_offset + (M - 1) * x_stride + K, y_offset + (M - 1) * y_stride + y_col + N):
        if v >= 1 << 32:
            raise KernelError(f"{name}: element offsets exceed 32 bits")
    if M == 0 or N == 0:
        return path

    flags = 0
    if x_off % 16 == 0 and x_offset % 4 == 0 and (x_stride % 4 == 0 or M == 1) and K % 4 == 0:
        flags |= FLAG_XVEC
    if wt.quantized or K % (8 if path == "vec" else 4) == 0:
        flags |= FLAG_WVEC
    if path == "vec":
        kernel = Kernel.get(dev, vec_kernel_name(wt.name, M))
    else:
        kernel = Kernel.get(dev, f"{'mul_mat' if path == 'tiled' else 'mul_mat_coopmat'}_{wt.name}_f32")
    seq.dispatch(kernel, [w, x, y],
                 (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset, y_col, flags),
                 _grid(path, wt, M, N))
    return path


__all__ = ["VARIANTS", "check_mul_mat", "record_mul_mat", "coopmat_available", "coopmat_supported",
           "coopmat_disabled", "vec_supported", "MAX_VEC_M", "PATHS"]
