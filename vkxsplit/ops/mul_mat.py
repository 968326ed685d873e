"""Matrix products with GGUF weights: ``y[m, n] = sum_k x[m, k] * W[n, k]`` (ggml's x @ W^T).

``W`` is a weight tensor of ``N`` rows (output features) of ``K`` elements, stored raw in its
ggml type (:mod:`vkxsplit.ops.quant`); ``x`` is f32 ``[M, K]`` and ``y`` f32 ``[M, N]``, both
row-major with arbitrary row strides (in elements). Kernel families (``shaders/mul_mat_vec.comp``,
``mul_mat_vecq.comp``, ``mul_mat.comp``, ``mul_mat_coopmat.comp``, ``mul_mat_cm2.comp``;
dequantization in ``shaders/dequant.glsl``):

- ``vec`` (``mul_mat_vec_<type>_f32``, and ``..._f32_m1/_m2/_m4`` compiled for at most
  1/2/4 columns), M <= 8: a workgroup computes a few output rows for all M columns, reading
  each weight once; memory-bandwidth bound (decode). At M = 1 graphs read Q4_0 / Q4_1 / Q8_0 /
  Q4_K (and Q6_K on CPU devices) with x quantized to q8_1 and integer dot products
  (``mul_mat_vecq_*``, ``kernels_for(device).vecq``).
- ``tiled`` (``mul_mat_<type>_f32``), any M: 64 x 64 shared-memory tiles with 4 x 4 register
  blocking, W dequantized in the tile loader; f32 throughout.
- ``coopmat`` (``mul_mat_coopmat_<type>_f32``), any M: GL_KHR_cooperative_matrix 16x16x16
  with f16 operands and f32 accumulation; used for M > 8 when the device has it. Where the
  device also has VK_NV_cooperative_matrix2 the same path runs ``mul_mat_cm2_<type>_f32_<tile>``
  (workgroup-scope matrices staged by the driver, weights decoded per element by
  ``shaders/cm2_decode.glsl``) on x converted to f16 first (``convert_rows_f32_f16``), and
  quantized weights of large products may be dequantized to f16 rows first (dq16).

This module records products and checks their operands. Which kernel a product runs is the
device's :class:`~vkxsplit.ops.choose.DeviceKernels` (``kernels_for(device)``: built once per
device from its queried limits); the kernels' shapes and names are
:mod:`vkxsplit.ops.mul_mat_kernels`'s. Only the variants the choices can name ship
(:data:`VARIANTS`); benchmarks and tests build other shapes on demand (``tools/kernels.py``)
and pin them with ``vec_variant=`` / ``coop_variant=`` / :func:`record_mul_mat_vecq`'s
``variant=``: a variant's shape is read from its manifest entry (its defines), so any built
variant of a family runs here. ``VKXSPLIT_DISABLE`` (:mod:`vkxsplit.features`: coopmat,
coopmat2, intdot, dq16, splitk) takes paths away, per device.

A tensor split computes only output rows ``[r0, r0 + N)``: pass ``w_row_offset=r0`` (and
the full tensor as ``w``); results go to y columns ``y_col_offset + n`` (default ``r0``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import KernelError, OutOfDeviceMemory
from ..shaders import Variant
from ..vk.kernel import Bindable, Kernel, as_range, bindings_overlap
from .choose import (  # noqa: F401  (re-exported: tools/probes.py and tests name these here)
    cm2_tile_supported,
    coopmat2_supported,
    coopmat_available,
    coopmat_supported,
    kernels_for,
    vecq_for_shape,
    vecq_variant,
)
from .convert import record_convert_rows
from .get_rows import record_dequant_rows
from .mul_mat_kernels import (  # noqa: F401  (the kernel shapes, re-exported: tools/kernels.py and tests name them here)
    _CM2_REQUIRES,
    _COOP_REQUIRES,
    _STORAGE,
    _VEC_SOURCES,
    CM2_CHOICES,
    CM2_DEFAULT,
    CM2_TILES,
    CM2_TYPES,
    COOP_CONFIG,
    COOP_SUBGROUP,
    COOP_TILES,
    FLAG_WVEC,
    FLAG_XVEC,
    FLAG_YVEC,
    MAX_VEC_M,
    PUSH,
    PUSH_COOP,
    TILED_BM,
    TILED_BN,
    VEC_CONFIG,
    VEC_CPU_M1,
    VEC_MAXM,
    VECQ_BLOCK_BYTES,
    VECQ_GPU_M1_TALL,
    VECQ_GPU_TYPES,
    VECQ_QUANTIZE,
    VECQ_QUANTIZE_WG,
    VECQ_TYPES,
    WIDE_K,
    Cm2Tile,
    CoopTile,
    VecConfig,
    VecqConfig,
    _defines,
    _is_cm2,
    _is_emulated,
    _vec_rows,
    cm2_variant_name,
    coop_big_tile,
    coop_tile,
    coop_variant_name,
    make_cm2_variant,
    make_coop_variant,
    make_vec_variant,
    make_vecq_variant,
    vec_config,
    vec_kernel_name,
    vec_m1_name,
    vec_variant_maxm,
    vecq_default_config,
    vecq_name,
    vecq_spec,
)
from .quant import TYPES, TypeLike, WeightType, weight_type

if TYPE_CHECKING:
    from ..vk.command import Sequence
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.mul_mat")

MAX_GROUPS = 65535      # per grid dimension (Vulkan's guaranteed minimum; lavapipe and NVIDIA)

def vecq_scratch_bytes(M: int, K: int) -> int:
    """Bytes of the quantized-x scratch of :func:`record_mul_mat_vecq` (M columns of K)."""
    return M * (K // 32) * VECQ_BLOCK_BYTES


def _vecq_shipped() -> dict[str, tuple[str, VecqConfig]]:
    """The decode shapes a default choice can name: each device kind's per type, the tall
    ones, and for each whole-word (w5u) shape its halfword twin (:func:`vecq_fits`)."""
    out: dict[str, tuple[str, VecqConfig]] = {}
    for t in VECQ_TYPES:
        cfgs = [vecq_default_config(t, cpu=True)]
        if t in VECQ_GPU_TYPES:
            cfgs.append(vecq_default_config(t, cpu=False))
            if t in VECQ_GPU_M1_TALL:
                cfgs.append(VECQ_GPU_M1_TALL[t])
        for c in cfgs:
            for cc in (c, replace(c, w5u=0)):
                out[vecq_name(t, cc)] = (t, cc)
    return out


def q8_1_reference(x):  # type: ignore[no-untyped-def]
    """numpy model of ``quantize_q8_1.comp`` (bit-exact): x (f32-representable, [M, K], K %
    32 == 0) -> (q int8 [M, K], d float32 [M, K // 32], sum int32 [M, K // 32]) with d =
    fl32(max|x| * fl32(1/127)) (0 unless a normal float), q = round(x / d) half away from zero
    (exact quotient), clipped to +-127, sum = the block sums of q."""
    import numpy as np

    xb = np.asarray(x, dtype=np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1)
    d = amax * np.float32(1.0 / 127.0)
    d[~(d >= np.float32(2.0 ** -126)) | ~np.isfinite(d)] = 0
    safe = np.where(d > 0, d, 1).astype(np.float64)[..., None]
    mag = np.floor(np.abs(xb.astype(np.float64)) / safe + 0.5)
    q = np.where(d[..., None] > 0, np.sign(xb) * np.minimum(mag, 127), 0).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float32), q.astype(np.int32).sum(axis=-1)


def record_mul_mat_vecq(seq: Sequence, w: Bindable, w_type: TypeLike | WeightType, x: Bindable,
                        xq_scratch: Bindable, y: Bindable, M: int, N: int, K: int,
                        x_stride: int | None = None, y_stride: int | None = None, x_offset: int = 0,
                        y_offset: int = 0, w_row_offset: int = 0, y_col_offset: int | None = None, *,
                        variant: str, quantize: bool = True) -> None:
    """``y = x @ W^T`` as :func:`record_mul_mat` (same arguments and layout), with x first
    quantized to 8-bit blocks (ggml's MMVQ): records ``quantize_q8_1`` (x -> ``xq_scratch``,
    at least :func:`vecq_scratch_bytes` bytes, 16-byte aligned, overlapping nothing else),
    a compute barrier (inserted by the sequence's hazard tracking: the second dispatch reads
    what the first wrote) and ``variant`` (a built vecq variant of the weight type, see
    :func:`vecq_spec`; graphs take :func:`vecq_variant`). Not bit-comparable with the f32 path: x is
    rounded to 8 bits per element with a per-32-block scale. ``quantize=False``: the scratch
    already holds x quantized (:func:`record_quantize_q8_1`, e.g. once for the q, k and v
    projections of one x); only the dot-product kernel is recorded, x is used for the checks.
    Raises KernelError for anything the kernels do not handle."""
    wt = weight_type(w_type)
    dev = seq.device
    spec = vecq_spec(variant)
    if spec is None or spec[0] != wt.name or M > spec[2]:
        raise KernelError(f"vecq variant {variant!r} is not an integer-dot-product mat-vec variant for "
                          f"{wt.name.upper()} weights and M = {M}")
    _, cfg, _ = spec
    check_mul_mat(wt, M, N, K, path="vec")
    name = f"mul_mat_vecq[{wt.name.upper()}, M={M}, N={N}, K={K}]"
    if cfg.blk == 8 and K % WIDE_K:
        raise KernelError(f"{name}: variant {variant!r} needs K % {WIDE_K} == 0 (16-byte aligned rows of "
                          "whole 8-block groups)")
    x_stride, y_col, y_stride = _layout(name, M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset,
                                        y_col_offset)
    check_q8_1_scratch(name, xq_scratch, M, K, (("the weights", w), ("x", x), ("y", y)))
    _check_bindings(name, wt, w, x, y, M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset, y_col)
    if cfg.w5u and not vecq_fits(w, wt, w_row_offset + N, K):
        cfg = replace(cfg, w5u=0)  # the binding ends inside the last row's trailing word
        variant = vecq_name(wt.name, cfg, spec[2])
    gx, gy, _ = _grid("vec", wt, M, N, variant)
    nq = -(-M * (K // 32) // (VECQ_QUANTIZE_WG // 8))
    if gy > MAX_GROUPS or nq > MAX_GROUPS:
        raise KernelError(f"{name}: too large for one dispatch")
    if M == 0 or N == 0:
        return
    kd = Kernel.get(dev, variant)  # raises when the device lacks a required feature
    if quantize:
        record_quantize_q8_1(seq, x, xq_scratch, M, K, x_stride, x_offset)
    seq.dispatch(kd, [w, xq_scratch, y], (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset, y_col, 0),
                 (gx, gy, 1))


def vecq_fits(w: Bindable, wt: WeightType, rows: int, K: int) -> bool:
    """Whether weight binding ``w`` holds whole 32-bit words up to the end of row ``rows - 1``
    (a ``w5u`` variant reads the word holding a row's last byte whole; where the rows end 2
    bytes into a word and the binding with them, :func:`record_mul_mat_vecq` records the same
    shape without ``w5u``)."""
    return as_range(w)[2] >= -(-rows * wt.row_bytes(K) // 4) * 4


def check_q8_1_scratch(name: str, xq_scratch: Bindable, M: int, K: int,
                       others: tuple[tuple[str, Bindable], ...] = ()) -> None:
    """The checks every writer of q8_1 x makes (quantize_q8_1, the norms and the SwiGLU that
    write it too): K a positive multiple of 32, the scratch 16-byte aligned, large enough for
    M rows of K, and apart from every binding in ``others`` (name, binding)."""
    _, q_off, q_size, _ = as_range(xq_scratch)
    if K <= 0 or K % 32:
        raise KernelError(f"{name}: q8_1 blocks need a row length that is a positive multiple of 32, got {K}")
    if q_off % 16:
        raise KernelError(f"{name}: the q8_1 scratch must be 16-byte aligned (byte {q_off})")
    if vecq_scratch_bytes(M, K) > q_size:
        raise KernelError(f"{name}: the q8_1 scratch has {q_size} bytes, needs {vecq_scratch_bytes(M, K)}")
    for what, b in others:
        if bindings_overlap(xq_scratch, b):
            raise KernelError(f"{name}: the q8_1 scratch overlaps {what}")


def record_quantize_q8_1(seq: Sequence, x: Bindable, xq_scratch: Bindable, M: int, K: int, x_stride: int,
                         x_offset: int) -> None:
    """The quantize-x dispatch of :func:`record_mul_mat_vecq` alone: M rows of K elements of
    x (``x_stride`` apart from element ``x_offset``) into ``xq_scratch`` (graphs record it
    once per x that several mat-vecs read; benchmarks time it alone)."""
    name = f"quantize_q8_1[M={M}, K={K}]"
    check_q8_1_scratch(name, xq_scratch, M, K, (("x", x),))
    _, x_off, x_size, _ = as_range(x)
    if x_off % 4:
        raise KernelError(f"{name}: x must be 4-byte aligned")
    if M and (x_offset + (M - 1) * x_stride + K) * 4 > x_size:
        raise KernelError(f"{name}: x ({M} rows of stride {x_stride} from {x_offset}) does not fit its binding")
    nq = -(-M * (K // 32) // (VECQ_QUANTIZE_WG // 8))
    seq.dispatch(Kernel.get(seq.device, VECQ_QUANTIZE), [x, xq_scratch],
                 (M, 0, K, x_stride, 0, x_offset, 0, 0, 0, 0), (nq, 1, 1))


def record_swiglu_q8_1(seq: Sequence, gate: Bindable, up: Bindable, dst: Bindable, xq_scratch: Bindable,
                       M: int, K: int) -> None:
    """``dst = silu(gate) * up`` over M contiguous rows of K (K % 32 == 0), also written as q8_1
    blocks into ``xq_scratch`` (the same bits :func:`record_quantize_q8_1` would make of dst):
    the SwiGLU and the quantization of the ffn_down mat-vec's x in one dispatch. ``dst`` may
    be ``gate``; the scratch overlaps nothing else."""
    name = f"swiglu_q8_1[M={M}, K={K}]"
    operands = (("gate", gate), ("up", up), ("dst", dst))
    check_q8_1_scratch(name, xq_scratch, M, K, operands)
    for what, b in operands:
        _, off, size, _ = as_range(b)
        if off % 4 or size < 4 * M * K:
            raise KernelError(f"{name}: {what} must be 4-byte aligned and hold {4 * M * K} bytes ({size} at byte {off})")
    if bindings_overlap(dst, up):
        raise KernelError(f"{name}: dst overlaps up")
    if M == 0:
        return
    nq = -(-M * (K // 32) // (VECQ_QUANTIZE_WG // 8))
    seq.dispatch(Kernel.get(seq.device, "swiglu_q8_1_f32"), [gate, up, dst, xq_scratch],
                 (M, 0, K, K, 0, 0, 0, 0, 0, 0), (nq, 1, 1))



VARIANTS = (
    [make_vec_variant(vec_kernel_name(t, mm), t, VEC_CONFIG[t], mm) for t in TYPES for mm in VEC_MAXM]
    + [make_vec_variant(vec_m1_name(t, c), t, c, 1) for t, c in VEC_CPU_M1.items()]
    + [make_vecq_variant(name, t, cfg, 1) for name, (t, cfg) in _vecq_shipped().items()]
    + [Variant(name=VECQ_QUANTIZE, source="quantize_q8_1.comp", defines={"WG": str(VECQ_QUANTIZE_WG)},
               bindings=2, writes=(1,), push=PUSH, local_size=(VECQ_QUANTIZE_WG, 1, 1)),
       Variant(name="swiglu_q8_1_f32", source="quantize_q8_1.comp",
               defines={"WG": str(VECQ_QUANTIZE_WG), "SWIGLU": "1"},
               bindings=4, writes=(2, 3), push=PUSH, local_size=(VECQ_QUANTIZE_WG, 1, 1))]
    + [Variant(name=f"mul_mat_{t}_f32", source="mul_mat.comp", defines={"WTYPE": str(wt.id)},
               bindings=3, writes=(2,), push=PUSH, local_size=(256, 1, 1), requires=_STORAGE)
       for t, wt in TYPES.items()]
    + [make_coop_variant(coop_variant_name(t, None if key == COOP_CONFIG[t] else key), t, COOP_TILES[key])
       for t in TYPES for key in dict.fromkeys((COOP_CONFIG[t], coop_big_tile(t)))]
    + [make_cm2_variant(t, CM2_TILES[key]) for t in TYPES for key in dict.fromkeys((CM2_DEFAULT, *CM2_CHOICES[t]))]
    + [Variant(name="reduce_splitk_f32", source="reduce_splitk.comp", bindings=2, writes=(1,), push="I" * 6,
               local_size=(256, 1, 1))]
)

class _Scratch:
    """A device's buffer for one kind of intermediate (``splitk``: split-K partial products;
    ``xh``: the f16 copy of x that mul_mat_cm2 reads; ``wh``: the f16 rows of dq16's weights), shared by every dispatch recorded on it
    (they run in queue order; each consumer reads before the next product writes: the
    sequences' hazard barriers, the begin barrier between submissions). Grows by replacement,
    at least doubling (a model that meets M = 9, 10, ... 128 allocates a few buffers, not one
    per M); buffers a recorded sequence may still bind stay until the device closes, so all of
    them together stay under 4x the largest need (partials of one dispatch: at most
    SPLITK_MAX_SCRATCH when ``coop_k_split`` chose the split)."""

    def __init__(self, device: Device, kind: str) -> None:
        self.device = device
        self.kind = kind
        self.buffers: list[Any] = []
        device.adopt(self)

    @classmethod
    def get(cls, device: Device, kind: str, nbytes: int) -> Any:
        key = f"_{kind}_scratch"
        sc = device.__dict__.get(key)
        if sc is None:
            sc = device.__dict__[key] = cls(device, kind)
        if not sc.buffers or sc.buffers[-1].size < nbytes:
            grow = 2 * sc.buffers[-1].size if sc.buffers else 1 << 20
            try:
                buf = device.memory.alloc(max(nbytes, grow), "device", f"{kind}_scratch")
            except OutOfDeviceMemory:
                if grow <= nbytes:
                    raise
                buf = device.memory.alloc(nbytes, "device", f"{kind}_scratch")  # no room to double
            sc.buffers.append(buf)
        return sc.buffers[-1]

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers.clear()
        self.device.__dict__.pop(f"_{self.kind}_scratch", None)


PATHS = ("vec", "tiled", "coopmat")


def _grid(path: str, wt: WeightType, M: int, N: int, variant: str | None = None) -> tuple[int, int, int]:
    if path == "vec":
        rows = _vec_rows(variant) if variant else VEC_CONFIG[wt.name].nr
        g = max(1, -(-N // rows))
        gx = min(g, MAX_GROUPS)
        return gx, -(-g // gx), 1
    if path == "tiled":
        bm, bn = TILED_BM, TILED_BN
    else:
        tile = coop_tile(variant) if variant else COOP_TILES[COOP_CONFIG[wt.name]]
        assert tile is not None
        bm, bn = tile.bm, tile.bn
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
    kc = None if device is None else kernels_for(device)
    if path is None:
        path = ("vec" if M <= MAX_VEC_M else "tiled") if kc is None else kc.path(M)
    elif path == "vec":
        if M > MAX_VEC_M:
            raise KernelError(f"{name}: the mat-vec path handles M <= {MAX_VEC_M}")
        if kc is not None and not kc.vec:
            raise KernelError(f"{name}: the mat-vec path needs subgroup arithmetic in compute shaders, "
                              f"which '{device.name}' lacks")
    elif path == "coopmat" and kc is not None:
        if "coopmat" in kc.disabled:
            raise KernelError(f"{name}: the coopmat path is switched off (VKXSPLIT_DISABLE=coopmat)")
        if not kc.coopmat:
            raise KernelError(f"{name}: '{device.name}' has no f16 16x16x16 subgroup cooperative "
                              "matrices with subgroup size 32")
    gx, gy, _ = _grid(path, wt, M, N)
    if gx > MAX_GROUPS or gy > MAX_GROUPS:
        raise KernelError(f"{name}: too large for one {path} dispatch ({gx} x {gy} workgroups)")
    return path


def _layout(name: str, M: int, N: int, K: int, x_stride: int | None, y_stride: int | None, x_offset: int,
            y_offset: int, w_row_offset: int, y_col_offset: int | None) -> tuple[int, int, int]:
    """The defaulted (x_stride, y_col_offset, y_stride) of a mat-mul's layout, checked: offsets
    and strides non-negative integers, rows of x and y not overlapping."""
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
    return x_stride, y_col, y_stride


def _check_bindings(name: str, wt: WeightType, w: Bindable, x: Bindable, y: Bindable, M: int, N: int, K: int,
                    x_stride: int, y_stride: int, x_offset: int, y_offset: int, w_row_offset: int,
                    y_col: int) -> tuple[int, int]:
    """The checks every mat-mul/mat-vec makes of its bindings (alignment, fit, overlap, 32-bit
    element offsets); returns the x and y bindings' byte offsets."""
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
    if bindings_overlap(y, w) or bindings_overlap(y, x):
        raise KernelError(f"{name}: y overlaps x or the weights")
    for v in (x_offset + (M - 1) * x_stride + K, y_offset + (M - 1) * y_stride + y_col + N):
        if v >= 1 << 32:
            raise KernelError(f"{name}: element offsets exceed 32 bits")
    return x_off, y_off


def _dq16_rows(dev: Device, name: str, nbytes: int, forced: bool) -> Any:
    """The device's scratch for dq16's f16 weight rows, or None where the device has no memory
    left for it and the path was the model's choice (the product then decodes in the tile
    loader, said once per device); raises OutOfDeviceMemory where ``forced``."""
    try:
        return _Scratch.get(dev, "wh", nbytes)
    except OutOfDeviceMemory:
        if forced:
            raise
        if not getattr(dev, "_dq16_oom_said", False):
            dev._dq16_oom_said = True
            log.warning("%s: no device memory for the %d MiB of f16 weight rows of the dequantize-first "
                        "path; decoding in the tile loader instead", name, nbytes >> 20)
        return None


def record_mul_mat(seq: Sequence, w: Bindable, w_type: TypeLike | WeightType, x: Bindable, y: Bindable,
                   M: int, N: int, K: int, x_stride: int | None = None, y_stride: int | None = None,
                   x_offset: int = 0, y_offset: int = 0, w_row_offset: int = 0, path: str | None = None,
                   y_col_offset: int | None = None, *, coop_variant: str | None = None,
                   vec_variant: str | None = None, k_split: int | None = None, dq16: bool | None = None) -> str:
    """Record ``y[y_offset + m*y_stride + y_col_offset + n] = sum_k x[x_offset + m*x_stride + k]
    * W[w_row_offset + n, k]`` for m < M, n < N (offsets and strides in elements; W rows are
    raw ggml rows of K elements starting at byte 0 of ``w``). ``x_stride`` defaults to K,
    ``y_col_offset`` to ``w_row_offset``, ``y_stride`` to ``y_col_offset + N``. ``path``:
    ``vec`` / ``tiled`` / ``coopmat`` or None (M <= 8: vec; else coopmat when available, else
    tiled). Returns the path taken. Raises KernelError for anything no kernel handles.

    ``coop_variant`` (tests and benchmarks only; ``path`` must be ``coopmat``): run this built
    mul_mat_coopmat or mul_mat_cm2 variant of the weight type instead of the chosen one, e.g.
    a tiling of the sweep or an emulated variant (``mul_mat_coopmat_emu_*``, which runs on
    devices without cooperative matrices; tools/kernels.py builds those).

    ``vec_variant`` (benchmarks and tests only; the path must be ``vec``): run this built
    mat-vec variant of the weight type (e.g. a sweep shape) instead of the default one for M.
    Those of ``shaders/mul_mat_vec_wide.comp`` need K % 256 == 0.

    ``k_split`` (coopmat only): K elements per split, a multiple of the tile's BK; the partial
    products go to the device's split-K scratch and ``reduce_splitk_f32`` sums them into y;
    pinned without ``coop_variant``, the type's default tiling runs it. None: without
    ``coop_variant`` the device's :meth:`~vkxsplit.ops.choose.DeviceKernels.matmat` picks
    tiling and split, with a real one its ``coop_k_split`` / ``cm2_k_split`` picks the split
    (never for emulated variants, nor where ``splitk`` is switched off for the device); 0: no
    split.

    ``dq16`` (coopmat path, quantized weights, coopmat2 devices): True decodes W's N rows to f16
    first and runs mul_mat_cm2's F16 kernel on them (the device's model otherwise: None; False
    never)."""
    wt = weight_type(w_type)
    dev = seq.device
    kc = kernels_for(dev)
    if vec_variant is not None:
        if (path not in (None, "vec") or not vec_variant.startswith(f"mul_mat_vec_{wt.name}_f32")
                or M > vec_variant_maxm(vec_variant) or _defines(vec_variant, _VEC_SOURCES) is None):
            raise KernelError(f"vec_variant {vec_variant!r} is not a mat-vec variant for {wt.name.upper()} "
                              f"weights and M = {M} (and path must be 'vec')")
        path = "vec"
    if coop_variant is not None:
        tile = coop_tile(coop_variant)
        if path != "coopmat" or tile is None or not coop_variant.startswith(
                (coop_variant_name(wt.name), coop_variant_name(wt.name, emulate=True),
                 f"mul_mat_cm2_{wt.name}_f32")):
            raise KernelError(f"coop_variant {coop_variant!r} is not a coopmat variant for "
                              f"{wt.name.upper()} weights (and path must be 'coopmat')")
    if dq16 and (coop_variant is not None or not kc.dq16_available(wt.name)):
        raise KernelError(f"mul_mat[{wt.name.upper()}]: dq16 (dequantize first) needs quantized weights, "
                          f"VK_NV_cooperative_matrix2 (not disabled) and no coop_variant")
    emulated = coop_variant is not None and _is_emulated(coop_variant)
    path = check_mul_mat(wt, M, N, K, path=path, device=None if emulated else dev)
    if dq16 and path != "coopmat":
        raise KernelError(f"mul_mat[{wt.name.upper()}, M={M}]: dq16 needs the coopmat path, this product "
                          f"takes '{path}'")
    if vec_variant is not None and _defines(vec_variant, ("mul_mat_vec_wide.comp",)) is not None and K % WIDE_K:
        raise KernelError(f"vec_variant {vec_variant!r} needs K % {WIDE_K} == 0 (16-byte aligned rows "
                          f"of whole 8-block groups), got K = {K}")
    if path == "vec" and vec_variant is None:
        vec_variant = kc.matvec(wt.name, M)
    name = f"mul_mat[{wt.name.upper()}, M={M}, N={N}, K={K}]"
    x_stride, y_col, y_stride = _layout(name, M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset,
                                        y_col_offset)

    x_off, y_off = _check_bindings(name, wt, w, x, y, M, N, K, x_stride, y_stride, x_offset, y_offset,
                                   w_row_offset, y_col)
    if M == 0 or N == 0:
        return path

    flags = 0
    if x_off % 16 == 0 and x_offset % 4 == 0 and (x_stride % 4 == 0 or M == 1) and K % 4 == 0:
        flags |= FLAG_XVEC
    if wt.quantized or K % (8 if path == "vec" else 4) == 0:
        flags |= FLAG_WVEC
    if path == "vec":
        kernel = Kernel.get(dev, vec_variant)
    elif path == "tiled":
        kernel = Kernel.get(dev, f"mul_mat_{wt.name}_f32")
    else:
        if coop_variant is None:
            pick = kc.matmat(wt.name, M, N, K, addressable=kc.cm2_eligible(wt.name, w), dq16=dq16)
            if pick.dq16:
                # dequantize first: W's N rows once to f16, then mul_mat_cm2's F16 kernel on them
                wh = _dq16_rows(dev, name, N * K * 2, forced=bool(dq16))
                if wh is None:
                    pick = kc.matmat(wt.name, M, N, K, addressable=kc.cm2_eligible(wt.name, w), dq16=False)
                else:
                    record_dequant_rows(seq, w, wt, wh, N, K, row0=w_row_offset)
                    w, wt, w_row_offset = wh, TYPES["f16"], 0
            cname, chosen = pick.variant, pick.k_split
            if k_split is not None:  # a pinned split: the default tiling
                cname = cm2_variant_name(wt.name) if _is_cm2(cname) else coop_variant_name(wt.name)
        elif _is_cm2(coop_variant):
            cname, chosen = coop_variant, kc.cm2_k_split(wt.name, tile, M, N, K)  # type: ignore[arg-type]
        else:
            cname, chosen = coop_variant, 0 if emulated else kc.coop_k_split(tile, M, N, K)  # type: ignore[arg-type]
        tile = coop_tile(cname)
        assert tile is not None
        if k_split is None:
            k_split = chosen
        if _is_cm2(cname):
            # mul_mat_cm2 reads x as compact f16 rows: converted once here, not per tile
            xh = _Scratch.get(dev, "xh", M * K * 2)
            record_convert_rows(seq, x, xh, M, K, x_stride, x_offset)
            x, x_stride, x_offset = xh, K, 0
        if k_split:
            if k_split % tile.bk or k_split >= K:
                raise KernelError(f"{name}: k_split {k_split} must be a multiple of BK {tile.bk} below K")
            splits = -(-K // k_split)
            part = _Scratch.get(dev, "splitk", splits * M * N * 4)
            if N % 4 == 0:  # partial rows of N floats, from byte 0: 16-byte aligned when N % 4 == 0
                flags |= FLAG_YVEC
            seq.dispatch(Kernel.get(dev, cname), [w, x, part],
                         (M, N, K, x_stride, N, x_offset, 0, w_row_offset, 0, flags, k_split),
                         (*_grid(path, wt, M, N, cname)[:2], splits))
            n = M * N
            gx = min(-(-n // 256), MAX_GROUPS)
            seq.dispatch(Kernel.get(dev, "reduce_splitk_f32"), [part, y],
                         (M, N, splits, y_stride, y_offset, y_col), (gx, -(-n // (256 * gx)), 1))
            return path
        if y_off % 16 == 0 and (y_offset + y_col) % 4 == 0 and y_stride % 4 == 0:
            flags |= FLAG_YVEC
        seq.dispatch(Kernel.get(dev, cname), [w, x, y],
                     (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset, y_col, flags, 0),
                     _grid(path, wt, M, N, cname))
        return path
    seq.dispatch(kernel, [w, x, y],
                 (M, N, K, x_stride, y_stride, x_offset, y_offset, w_row_offset, y_col, flags),
                 _grid(path, wt, M, N, vec_variant))
    return path


__all__ = ["MAX_GROUPS", "PATHS", "VARIANTS", "check_mul_mat", "check_q8_1_scratch", "q8_1_reference",
           "record_mul_mat", "record_mul_mat_vecq", "record_quantize_q8_1", "record_swiglu_q8_1", "vecq_fits",
           "vecq_scratch_bytes"]
