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
  (``mul_mat_vecq_*``, :func:`vecq_variant`).
- ``tiled`` (``mul_mat_<type>_f32``), any M: 64 x 64 shared-memory tiles with 4 x 4 register
  blocking, W dequantized in the tile loader; f32 throughout.
- ``coopmat`` (``mul_mat_coopmat_<type>_f32``), any M: GL_KHR_cooperative_matrix 16x16x16
  with f16 operands and f32 accumulation; used for M > 8 when the device has it. Where the
  device also has VK_NV_cooperative_matrix2 the same path runs ``mul_mat_cm2_<type>_f32_<tile>``
  (workgroup-scope matrices staged by the driver, weights decoded per element by
  ``shaders/cm2_decode.glsl``) on x converted to f16 first (``convert_rows_f32_f16``), and
  quantized weights of large products may be dequantized to f16 rows first (dq16).

Only the variants these choices can name ship (:data:`VARIANTS`); benchmarks and tests build
other shapes on demand (``tools/kernels.py``) and pin them with ``vec_variant=`` /
``coop_variant=`` / :func:`record_mul_mat_vecq`'s ``variant=``: a variant's shape is read
from its manifest entry (its defines), so any built variant of a family runs here.
``VKXSPLIT_DISABLE`` (:mod:`vkxsplit.features`: coopmat, coopmat2, intdot, dq16, splitk) takes
paths away, per device.

A tensor split computes only output rows ``[r0, r0 + N)``: pass ``w_row_offset=r0`` (and
the full tensor as ``w``); results go to y columns ``y_col_offset + n`` (default ``r0``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import KernelError, OutOfDeviceMemory
from ..features import disabled as _disabled
from ..shaders import Variant, variant_meta
from ..vk.kernel import Bindable, Kernel, View, as_range
from .convert import record_convert_rows
from .get_rows import record_dequant_rows
from .quant import TYPES, TypeLike, WeightType, weight_type

if TYPE_CHECKING:
    from ..vk.command import Sequence
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.mul_mat")

MAX_VEC_M = 8           # the mat-vec kernel handles up to this many columns of x in one pass
PUSH = "I" * 10         # M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0, y_col0, flags
PUSH_COOP = PUSH + "I"  # ... ksplit (coopmat: K elements per split, 0 = no split)
FLAG_XVEC = 1           # x rows are vec4-aligned (x binding 16-aligned, offset/stride % 4 == 0)
FLAG_WVEC = 2           # float W rows allow vector loads (vec: K % 8 == 0; others: K % 4 == 0)
MAX_GROUPS = 65535      # per grid dimension (Vulkan's guaranteed minimum; lavapipe and NVIDIA)

_STORAGE = ("storageBuffer16BitAccess", "storageBuffer8BitAccess")
_TYPE_BY_ID = {wt.id: t for t, wt in TYPES.items()}


def _defines(name: str, sources: tuple[str, ...]) -> dict[str, str] | None:
    """The defines of kernel ``name`` (shipped or loaded) when its source is one of ``sources``."""
    meta = variant_meta(name)
    if meta is None or meta.get("source") not in sources:
        return None
    return dict(meta.get("defines") or {})


def _type_of(defines: dict[str, str]) -> str | None:
    wid = defines.get("WTYPE")
    return None if wid is None else _TYPE_BY_ID.get(int(wid))


@dataclass(frozen=True)
class VecConfig:
    """Shape of a mat-vec kernel (``shaders/mul_mat_vec.comp``): ``wg`` threads per workgroup,
    ``nr`` output rows per workgroup, ``unr`` units per thread per loop iteration (the loads a
    thread has in flight: ``nr * unr`` units), ``lanes`` per block (``DQX_L``: 2 or 4 for
    Q4_0/Q4_1/Q8_0, 4 or 8 for Q4_K/Q5_K; 0 for the type's default / types without a choice)."""

    wg: int
    nr: int
    unr: int = 1
    lanes: int = 0

    @property
    def tag(self) -> str:
        return f"wg{self.wg}_nr{self.nr}_u{self.unr}" + (f"_l{self.lanes}" if self.lanes else "")

    @property
    def rows(self) -> int:
        """Rows per workgroup."""
        return self.nr

    def defines(self) -> dict[str, str]:
        d = {"WG": str(self.wg), "NR": str(self.nr), "UNR": str(self.unr)}
        if self.lanes:
            d["DQX_L"] = str(self.lanes)
        return d

    @classmethod
    def from_defines(cls, d: dict[str, str]) -> VecConfig:
        return cls(int(d["WG"]), int(d["NR"]), int(d.get("UNR", 1)), int(d.get("DQX_L", 0)))


#: mat-vec shape per type: >= 128 threads per workgroup so enough workgroups are resident to
#: fill a GPU's cores, rows per workgroup to reuse each x load, units per iteration for loads
#: in flight; Q5_* and BF16/F32 follow their nearest measured type (measured:
#: docs/PERFORMANCE.md, "Decode kernels"; tools/bench_matvec.py sweeps alternatives)
VEC_CONFIG: dict[str, VecConfig] = {
    **{t: VecConfig(128, 4, 4) for t in ("f32", "f16", "bf16")},
    **{t: VecConfig(128, 4, 2) for t in ("q5_0", "q5_1")},
    **{t: VecConfig(128, 4, 4, 2) for t in ("q4_0", "q8_0")},
    "q4_1": VecConfig(128, 8, 1, 2),
    **{t: VecConfig(128, 2, 1, 4) for t in ("q4_k", "q5_k")},
    "q6_k": VecConfig(128, 2, 2),
}
# mat-vec variants by the most columns of x they handle (fewer columns, fewer registers);
# the 8-column one is mul_mat_vec_<type>_f32, the others carry an _m<n> suffix
VEC_MAXM = (1, 2, 4, 8)

#: M = 1 (decode) mat-vec shapes for CPU Vulkan devices: lavapipe runs a workgroup's invocations
#: on one core, where the GPU shapes above (128 threads, several units in flight) are several
#: times slower than small workgroups (measured: docs/PERFORMANCE.md, "Decode kernels")
VEC_CPU_M1: dict[str, VecConfig] = {
    **{t: VecConfig(32, 4, 1, 4) for t in ("q4_0", "q4_1", "q8_0")},
    "q4_k": VecConfig(32, 2, 1, 8), "q6_k": VecConfig(32, 2, 1), "f16": VecConfig(128, 8, 1),
}


def vec_m1_name(t: str, cfg: VecConfig) -> str:
    """The name of an M = 1 mat-vec variant of shape ``cfg``: mul_mat_vec_<type>_f32_m1_<tag>."""
    return f"mul_mat_vec_{t}_f32_m1_{cfg.tag}"


def device_vec_variant(device: Device, t: str, M: int) -> str | None:
    """The mat-vec variant for ``device`` where it differs from the default (CPU devices, M = 1)."""
    from ..vk.api import vk

    if M != 1 or getattr(device.physical, "device_type", None) != vk.VK_PHYSICAL_DEVICE_TYPE_CPU:
        return None
    c = VEC_CPU_M1.get(t)
    return None if c is None else vec_m1_name(t, c)


def vec_kernel_name(t: str, M: int) -> str:
    mm = next(m for m in VEC_MAXM if m >= M)
    return f"mul_mat_vec_{t}_f32" + ("" if mm == MAX_VEC_M else f"_m{mm}")


#: sources of the mat-vec kernels (the f32-x one, the wide one of the benchmarks, the q8_1-x one)
_VEC_SOURCES = ("mul_mat_vec.comp", "mul_mat_vec_wide.comp")
WIDE_K = 256  # mul_mat_vec_wide.comp needs K % WIDE_K == 0 (whole 16-byte-aligned 8-block groups)


def vec_config(name: str) -> VecConfig | VecqConfig:
    """The shape of a built mat-vec variant (f32 x or q8_1 x) by name, from its defines.
    Raises KernelError for a name that is neither shipped nor loaded."""
    d = _defines(name, ("mul_mat_vec.comp",))
    if d is not None:
        return VecConfig.from_defines(d)
    d = _defines(name, ("mul_mat_vecq.comp",))
    if d is not None:
        return VecqConfig.from_defines(d)
    raise KernelError(f"{name!r} is not a built mat-vec variant")


def vec_variant_maxm(name: str) -> int:
    """The most columns of x a built mat-vec variant handles (0 for an unknown name)."""
    d = _defines(name, (*_VEC_SOURCES, "mul_mat_vecq.comp"))
    return 0 if d is None else int(d.get("MAXM", MAX_VEC_M))


def _vec_rows(name: str) -> int:
    """Rows per workgroup of a built mat-vec variant (NR, times RPT for q8_1-x shapes)."""
    d = _defines(name, (*_VEC_SOURCES, "mul_mat_vecq.comp"))
    if d is None:
        raise KernelError(f"{name!r} is not a built mat-vec variant")
    return int(d["NR"]) * int(d.get("RPT", 1))


def make_vec_variant(name: str, t: str, cfg: VecConfig, maxm: int) -> Variant:
    """The Variant of a mat-vec (f32 x) kernel of weight type ``t``, shape ``cfg``, ``maxm`` columns."""
    return Variant(name=name, source="mul_mat_vec.comp",
                   defines={"WTYPE": str(TYPES[t].id), "MAXM": str(maxm), **cfg.defines()},
                   bindings=3, writes=(2,), push=PUSH, local_size=(cfg.wg, 1, 1), requires=_STORAGE)


@dataclass(frozen=True)
class VecqConfig:
    """Shape of an integer-dot-product mat-vec kernel (``shaders/mul_mat_vecq.comp``, Q4_0 /
    Q4_1 / Q8_0 / Q4_K / Q6_K weights times x quantized to 8-bit blocks by ``quantize_q8_1.comp``): ``wg``
    threads per workgroup, ``nr`` rows per workgroup (``wg // nr`` threads per row), ``blk`` weight
    blocks per load unit (8: 16-byte aligned 8-block groups, K % 256 == 0, not Q4_1; 1: single blocks,
    any K % 32 == 0), ``unr`` units per thread per loop iteration, ``idp`` 1: packed 4x8 dot
    products (OpSDot; needs shaderIntegerDotProduct), 0: the same sums with int multiply-adds
    of unpacked bytes (``_emu``), ``sat``: OpSDotAccSat instead of OpSDot + add, ``rpt`` rows
    per thread (Q4_0 / Q8_0 with ``blk`` 1: each x block loaded once for ``rpt`` rows; a
    workgroup then computes ``nr * rpt`` rows), ``sg`` 1: the partial sums reduced with
    subgroupAdd per row instead of one thread adding a row's ``wg // nr`` partials in order,
    ``sub`` (Q4_K) load units per super-block: 1 whole super-blocks, 4 quarters (the header and
    32 nibble bytes each: four times the units per row, so short rows keep more lanes busy),
    ``w5u`` (Q4_0 / Q8_0, ``blk`` 1) 1: each block read as QW + 1 32-bit words instead of QW
    words and two halfwords; the last word is not bounds-checked, so a binding that ends inside
    the last row's trailing word runs the same shape without ``w5u`` (:func:`vecq_fits`)."""

    wg: int
    nr: int
    blk: int = 8
    unr: int = 1
    idp: int = 1
    sat: int = 0
    rpt: int = 1
    sg: int = 0
    sub: int = 1
    w5u: int = 0

    @property
    def tag(self) -> str:
        return (f"b{self.blk}_wg{self.wg}_nr{self.nr}" + (f"_u{self.unr}" if self.unr > 1 else "")
                + (f"_r{self.rpt}" if self.rpt > 1 else "") + (f"_s{self.sub}" if self.sub > 1 else "")
                + ("_sg" if self.sg else "") + ("_w5u" if self.w5u else "")
                + ("_sat" if self.sat else "") + ("" if self.idp else "_emu"))

    @property
    def rows(self) -> int:
        """Rows per workgroup (``nr`` teams, ``rpt`` rows per thread)."""
        return self.nr * self.rpt

    def defines(self) -> dict[str, str]:
        d = {"WG": str(self.wg), "NR": str(self.nr), "BLK": str(self.blk), "UNR": str(self.unr),
             "IDP": str(self.idp), "IDP_SAT": str(self.sat)}
        if self.rpt > 1:
            d["RPT"] = str(self.rpt)
        if self.sg:
            d["SG"] = "1"
        if self.sub > 1:
            d["KSUB"] = str(self.sub)
        if self.w5u:
            d["WLOAD5"] = "1"
        return d

    @classmethod
    def from_defines(cls, d: dict[str, str]) -> VecqConfig:
        return cls(int(d["WG"]), int(d["NR"]), blk=int(d["BLK"]), unr=int(d.get("UNR", 1)), idp=int(d["IDP"]),
                   sat=int(d.get("IDP_SAT", 0)), rpt=int(d.get("RPT", 1)), sg=int(d.get("SG", 0)),
                   sub=int(d.get("KSUB", 1)), w5u=int(d.get("WLOAD5", 0)))


VECQ_QUANTIZE = "quantize_q8_1"   # the quantize-x kernel (shaders/quantize_q8_1.comp)
VECQ_QUANTIZE_WG = 256            # its workgroup: 8 threads per 32-element block
VECQ_BLOCK_BYTES = 40             # scratch bytes per block of x: 32 int8 + f32 d + int32 sum
VECQ_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
_IDP_REQUIRES = ("shaderIntegerDotProduct",)
#: the decode (M = 1) shape per device kind where no type-specific one applies: GPUs a
#: workgroup of 4 teams of 32; CPU devices (llvmpipe runs a workgroup's invocations as SIMD
#: batches on one core) one row per invocation, no cross-lane reduction
VECQ_DEFAULT_M1 = {"gpu": VecqConfig(128, 4, blk=1), "cpu": VecqConfig(64, 64, blk=1)}
#: GPU decode shapes per type: Q4_0 128 threads per row, 2 rows per thread, the subgroupAdd
#: reduction and whole-word block loads; Q8_0 64 threads per row, 2 rows per thread; Q4_K
#: quarter super-blocks per load unit (a row of K = 4096 has only 16 super-blocks)
#: (measured: docs/PERFORMANCE.md, "Decode kernels")
VECQ_GPU_M1_BY_TYPE = {"q4_0": VecqConfig(128, 1, blk=1, unr=2, rpt=2, sg=1, w5u=1),
                       "q8_0": VecqConfig(128, 2, blk=1, unr=2, rpt=2),
                       "q4_k": VecqConfig(128, 2, blk=1, unr=2, sub=4)}
#: GPU decode shapes for tall products (VECQ_TALL_N <= N <= 4 K, K <= VECQ_TALL_K: the FFN's
#: gate and up, 2.7-3.5x wider than K in llama-family models; not an output projection, whose
#: vocabulary is 8-31x K), where they beat the type's shape and lose at the other shapes
#: (measured: docs/PERFORMANCE.md, "Decode kernels")
VECQ_GPU_M1_TALL = {"q4_0": VecqConfig(128, 2, blk=1, rpt=4, w5u=1),
                    "q8_0": VecqConfig(128, 1, blk=1, unr=2, rpt=2, sg=1)}
VECQ_TALL_N, VECQ_TALL_K = 8192, 4096
#: types whose vecq path GPUs take by default; Q6_K's (one 210-byte super-block per load unit)
#: is no faster than its f32-x kernel on a GPU, so only CPU devices, where it is several times
#: faster, take it (CPU devices take every VECQ_TYPES type)
VECQ_GPU_TYPES = ("q4_0", "q4_1", "q8_0", "q4_k")


def vecq_name(t: str, cfg: VecqConfig, maxm: int = 1) -> str:
    """mul_mat_vecq_<type>_q8_1_m<maxm>_<shape tag>."""
    return f"mul_mat_vecq_{t}_q8_1_m{maxm}_{cfg.tag}"


def vecq_default_config(t: str, cpu: bool) -> VecqConfig:
    """The decode (M = 1) integer-dot-product shape of weight type ``t`` on a CPU or GPU device."""
    if cpu:
        return VECQ_DEFAULT_M1["cpu"]
    return VECQ_GPU_M1_BY_TYPE.get(t, VECQ_DEFAULT_M1["gpu"])


def vecq_decode(physical: Any, features: Any = None, disabled: frozenset[str] | None = None) -> dict[str, str]:
    """weight type -> the integer-dot-product mat-vec variant decode (M = 1) uses on this
    physical device (``features``: the enabled ones, default: what it offers; ``disabled``:
    the features switched off, default: VKXSPLIT_DISABLE); empty without
    shaderIntegerDotProduct or subgroup arithmetic, or with ``intdot`` switched off."""
    from ..features import disabled_from_env
    from ..vk.api import vk

    feats = physical.features if features is None else features
    off = disabled_from_env() if disabled is None else disabled
    if "intdot" in off or not feats.get("shaderIntegerDotProduct") or not _vec_ok(physical):
        return {}
    cpu = getattr(physical, "device_type", None) == vk.VK_PHYSICAL_DEVICE_TYPE_CPU
    return {t: vecq_name(t, vecq_default_config(t, cpu)) for t in VECQ_TYPES if cpu or t in VECQ_GPU_TYPES}


def vecq_for_shape(variant: str, t: str, N: int, K: int) -> str:
    """The decode variant for an N x K product of ``t`` weights, given the type's default
    ``variant`` (:func:`vecq_variant`): VECQ_GPU_M1_TALL's shape where the default is the GPU
    one and the product is tall; the default otherwise. (A graph decides on the weight's
    rows; where a plan splits that product's rows between backends the hub's share runs the
    same shape, correct for any rows, measured only for the whole.)"""
    tall = VECQ_GPU_M1_TALL.get(t)
    if (tall is None or N < VECQ_TALL_N or N > 4 * K or K > VECQ_TALL_K
            or variant != vecq_name(t, vecq_default_config(t, cpu=False))):
        return variant
    return vecq_name(t, tall)


def vecq_variant(device: Device, t: str, M: int) -> str | None:
    """The integer-dot-product mat-vec variant a graph uses for ``M`` columns of x times ``t``
    weights on ``device`` (x quantized to q8_1 once, shared by every mat-vec reading it), or
    None where the f32-x kernels stay: other types (those outside VECQ_GPU_TYPES on GPUs), M > 1, no
    shaderIntegerDotProduct, or ``intdot`` switched off for the device."""
    return vecq_decode(device.physical, device.features, _disabled(device)).get(t) if M == 1 else None


def vecq_spec(name: str) -> tuple[str, VecqConfig, int] | None:
    """(weight type, shape, most columns of x) of a built integer-dot-product mat-vec variant
    (shipped or loaded), from its defines; None for any other name."""
    d = _defines(name, ("mul_mat_vecq.comp",))
    if d is None or "PROBE_NOX" in d:
        return None
    t = _type_of(d)
    return None if t is None else (t, VecqConfig.from_defines(d), int(d["MAXM"]))


def vecq_scratch_bytes(M: int, K: int) -> int:
    """Bytes of the quantized-x scratch of :func:`record_mul_mat_vecq` (M columns of K)."""
    return M * (K // 32) * VECQ_BLOCK_BYTES


def make_vecq_variant(name: str, t: str, cfg: VecqConfig, maxm: int) -> Variant:
    """The Variant of an integer-dot-product mat-vec kernel of weight type ``t``, shape ``cfg``."""
    return Variant(name=name, source="mul_mat_vecq.comp",
                   defines={"WTYPE": str(TYPES[t].id), "MAXM": str(maxm), **cfg.defines()},
                   bindings=3, writes=(2,), push=PUSH, local_size=(cfg.wg, 1, 1),
                   requires=(*(_IDP_REQUIRES if cfg.idp else ()), *_STORAGE))


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
        if _overlap(xq_scratch, b):
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
    if _overlap(dst, up):
        raise KernelError(f"{name}: dst overlaps up")
    if M == 0:
        return
    nq = -(-M * (K // 32) // (VECQ_QUANTIZE_WG // 8))
    seq.dispatch(Kernel.get(seq.device, "swiglu_q8_1_f32"), [gate, up, dst, xq_scratch],
                 (M, 0, K, K, 0, 0, 0, 0, 0, 0), (nq, 1, 1))



TILED_BM, TILED_BN = 64, 64       # mul_mat.comp tile (rows of x, rows of W)
COOP_SUBGROUP = 32
FLAG_YVEC = 4           # coopmat: y rows 16-byte aligned (binding, offset, column offset, stride)
COOP_SHARED_MAX = 49152  # bytes of shared memory a coopmat variant may use (H200's limit)


@dataclass(frozen=True)
class CoopTile:
    """A mul_mat_coopmat.comp tiling: BM x BN output tile per workgroup (rows of x x rows of
    W), BK the K slice per step, WM x WN the block of one subgroup (of 32 invocations),
    stages: 2 (double-buffered shared tiles, one barrier per step) or 1 (two barriers)."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int = 2

    @property
    def name(self) -> str:
        return f"t{self.bm}x{self.bn}_k{self.bk}_w{self.wm}x{self.wn}" + ("_s1" if self.stages == 1 else "")

    @property
    def threads(self) -> int:
        return 32 * (self.bm // self.wm) * (self.bn // self.wn)

    @property
    def shared_bytes(self) -> int:
        """f16 stages of rows padded to BK + 8, plus a 16x16 f32 staging area per subgroup"""
        return self.stages * 2 * (self.bm + self.bn) * (self.bk + 8) + 4 * 256 * (self.threads // 32)

    def defines(self) -> dict[str, str]:
        return {"BM": str(self.bm), "BN": str(self.bn), "BK": str(self.bk), "WM": str(self.wm),
                "WN": str(self.wn), "STAGES": str(self.stages)}

    @classmethod
    def from_defines(cls, d: dict[str, str]) -> CoopTile:
        return cls(int(d["BM"]), int(d["BN"]), int(d["BK"]), int(d["WM"]), int(d["WN"]), int(d.get("STAGES", 2)))


#: the tilings models run: COOP_DEFAULT, 8 subgroups of 2 x 4 fragments with BK 64 and one
#: stage (44 KiB), the fastest over the measured shapes for every measured type; and the
#: large ones coop_choose weighs against it: COOP_BIG_QUANT for quantized weights (BM 256:
#: each dequantized W tile serves 256 rows of x; 8 subgroups of 4 x 4, one stage, 38 KiB) and
#: COOP_BIG_FLOAT for f16/bf16/f32 (BN 256: each converted x tile serves 256 W rows; 16
#: subgroups of 2 x 4, one stage, 46 KiB: at 512 threads NVIDIA's compiler fits 128 registers
#: per thread, where the 8-subgroup tilings take up to 246, so an SM keeps twice the warps in
#: flight) (measured: docs/PERFORMANCE.md, "Prefill kernels"; tools/bench_coopmat.py sweeps
#: other tilings, tools/kernels.py)
COOP_TILES = {t.name: t for t in (
    CoopTile(128, 128, 64, 32, 64, stages=1),
    CoopTile(256, 128, 32, 64, 64, stages=1),
    CoopTile(128, 256, 32, 32, 64, stages=1),
)}
COOP_DEFAULT = "t128x128_k64_w32x64_s1"
# tiling of mul_mat_coopmat_<type>_f32, by type (retune from tools/bench_coopmat.py's "fastest" table)
COOP_CONFIG: dict[str, str] = {t: COOP_DEFAULT for t in TYPES}
COOP_BIG_QUANT = "t256x128_k32_w64x64_s1"
COOP_BIG_FLOAT = "t128x256_k32_w32x64_s1"
_COOP_REQUIRES = ("cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel", "subgroupSizeControl", *_STORAGE)


def coop_variant_name(t: str, tile: str | None = None, emulate: bool = False) -> str:
    """mul_mat_coopmat[_emu]_<type>_f32[_<tile>] (no tile: the type's default variant)."""
    return f"mul_mat_coopmat{'_emu' if emulate else ''}_{t}_f32" + (f"_{tile}" if tile else "")


def coop_big_tile(t: str) -> str:
    """The large tiling of weight type ``t`` (COOP_BIG_QUANT or COOP_BIG_FLOAT)."""
    return COOP_BIG_QUANT if TYPES[t].quantized else COOP_BIG_FLOAT


def make_coop_variant(name: str, t: str, tile: CoopTile, emulate: bool = False) -> Variant:
    """The Variant of a mul_mat_coopmat kernel of weight type ``t`` with ``tile``; ``emulate``:
    the same tiling, loaders and edge handling without cooperative matrices (COOPMAT_EMULATE:
    any device with f16 arithmetic runs it; how lavapipe tests the coopmat logic)."""
    defines = {"WTYPE": str(TYPES[t].id), **tile.defines()}
    if emulate:
        return Variant(name=name, source="mul_mat_coopmat.comp", defines={**defines, "COOPMAT_EMULATE": "1"},
                       bindings=3, writes=(2,), push=PUSH_COOP, local_size=(tile.threads, 1, 1),
                       requires=("shaderFloat16", *_STORAGE))
    return Variant(name=name, source="mul_mat_coopmat.comp", defines=defines, bindings=3, writes=(2,),
                   push=PUSH_COOP,
                   local_size=(tile.threads, 1, 1), target_env="vulkan1.3", compiler="glslang",
                   subgroup_size=COOP_SUBGROUP, requires=_COOP_REQUIRES)


@dataclass(frozen=True)
class Cm2Tile:
    """A mul_mat_cm2.comp tiling: BW rows of W x BX rows of x per workgroup (the
    workgroup-scope accumulator is BW x BX), BK the K slice per step, ``threads`` invocations.
    ``bm`` / ``bn`` (rows of x / of W) give it CoopTile's grid and cost-model interface."""

    bw: int
    bx: int
    bk: int
    threads: int = 256

    @property
    def name(self) -> str:
        return f"w{self.bw}x{self.bx}_k{self.bk}_n{self.threads}"

    @property
    def bm(self) -> int:
        return self.bx

    @property
    def bn(self) -> int:
        return self.bw

    def defines(self) -> dict[str, str]:
        return {"BW": str(self.bw), "BX": str(self.bx), "BK": str(self.bk), "NT": str(self.threads)}

    @classmethod
    def from_defines(cls, d: dict[str, str]) -> Cm2Tile:
        return cls(int(d["BW"]), int(d["BX"]), int(d["BK"]), int(d["NT"]))


def coop_tile(name: str) -> CoopTile | Cm2Tile | None:
    """The tiling of a built mul_mat_coopmat or mul_mat_cm2 variant (shipped or loaded), from
    its defines; None for any other name."""
    meta = variant_meta(name)
    src = None if meta is None else meta.get("source")
    if src == "mul_mat_coopmat.comp":
        return CoopTile.from_defines(meta["defines"])  # type: ignore[index]
    if src == "mul_mat_cm2.comp":
        return Cm2Tile.from_defines(meta["defines"])  # type: ignore[index]
    return None


def _is_cm2(name: str) -> bool:
    meta = variant_meta(name)
    return meta is not None and meta.get("source") == "mul_mat_cm2.comp"


def _is_emulated(name: str) -> bool:
    meta = variant_meta(name)
    return meta is not None and "COOPMAT_EMULATE" in (meta.get("defines") or {})


#: the mul_mat_cm2 tilings models run (tools/bench_coopmat.py --cm2 sweeps others)
CM2_TILES = {t.name: t for t in (
    Cm2Tile(128, 128, 64),        # CM2_DEFAULT
    Cm2Tile(128, 256, 64),        # llama.cpp's large coopmat2 tile: 128 weight rows x 256 tokens
    Cm2Tile(64, 128, 64, 128),    # two workgroups per SM
    # 64 rows of W x 256 of x: the accumulator area of 128 x 128, but each W tile the driver
    # decodes serves twice the rows of x (the quantized types' fastest tile loader)
    Cm2Tile(64, 256, 64),
)}
CM2_DEFAULT = "w128x128_k64_n256"
#: mul_mat_cm2 workgroups of 256 invocations the H200 runs at once (one per SM: 448 tiles of
#: 128 x 128 take 3.6x the time of 128), twice as many of 128
CM2_WAVE = 132
#: types whose coopmat path takes mul_mat_cm2: every type (Q4_K / Q5_K read their block header
#: with one 16-byte load and unpack scales and mins branch-free, as ggml-vulkan does)
CM2_TYPES = frozenset(TYPES)
_CM2_FLOAT = ("w128x128_k64_n256", "w128x256_k64_n256")
_CM2_QUANT32 = ("w128x128_k64_n256", "w64x128_k64_n128", "w64x256_k64_n256")
#: tilings cm2_choose weighs per type, and their throughput per workgroup-second relative to
#: CM2_DEFAULT (CM2_TILE_EFF; F32/BF16 take F16's) (measured: docs/PERFORMANCE.md, "Prefill
#: kernels"; tools/bench_coopmat.py --cm2)
CM2_CHOICES: dict[str, tuple[str, ...]] = {
    **{t: _CM2_FLOAT for t in ("f32", "f16", "bf16")},
    **{t: _CM2_QUANT32 for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")},
    "q6_k": ("w128x128_k64_n256", "w128x256_k64_n256", "w64x256_k64_n256"),
    "q4_k": (CM2_DEFAULT, "w64x256_k64_n256"), "q5_k": (CM2_DEFAULT, "w64x256_k64_n256"),
}
CM2_TILE_EFF: dict[str, dict[str, float]] = {
    **{t: {"w128x256_k64_n256": 1.1} for t in ("f32", "f16", "bf16")},
    "q4_0": {"w64x128_k64_n128": 0.51, "w64x256_k64_n256": 1.05},
    "q4_1": {"w64x128_k64_n128": 0.53, "w64x256_k64_n256": 1.15},
    "q5_0": {"w64x128_k64_n128": 0.55, "w64x256_k64_n256": 1.17},
    "q5_1": {"w64x128_k64_n128": 0.5, "w64x256_k64_n256": 1.12},
    "q8_0": {"w64x128_k64_n128": 0.55, "w64x256_k64_n256": 1.07},
    "q4_k": {"w64x256_k64_n256": 1.24},
    "q5_k": {"w64x256_k64_n256": 1.3},
    "q6_k": {"w128x256_k64_n256": 1.25, "w64x256_k64_n256": 1.2},
}


_CM2_REQUIRES = ("cooperativeMatrix", "cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                 "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads", "bufferDeviceAddress",
                 "shaderFloat16", "vulkanMemoryModel", *_STORAGE)


def cm2_variant_name(t: str, tile: str = CM2_DEFAULT) -> str:
    """mul_mat_cm2_<type>_f32_<tile>."""
    return f"mul_mat_cm2_{t}_f32_{tile}"


def make_cm2_variant(t: str, tile: Cm2Tile) -> Variant:
    """The Variant of mul_mat_cm2 for weight type ``t`` with ``tile`` (compiled by glslang15)."""
    return Variant(name=cm2_variant_name(t, tile.name), source="mul_mat_cm2.comp",
                   defines={"WTYPE": str(TYPES[t].id), **tile.defines()}, bindings=3, writes=(2,),
                   push=PUSH_COOP, local_size=(tile.threads, 1, 1), target_env="vulkan1.3", compiler="glslang15",
                   requires=_CM2_REQUIRES)


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

# ------------------------------------------------------------------------------------------
# split K and tiling for the coopmat path: a cost model of waves of workgroups

#: workgroups of 8 subgroups the H200 runs at once: one per SM (132; registers allow no second),
#: rounded to 128. A workgroup's time is its K loop whatever the grid, so a grid under a wave
#: leaves SMs idle and one just over it takes two waves' time.
COOP_WAVE = 128
#: a split's fixed cost per workgroup, in K elements of its tile's work (the partial's store,
#: the reduce dispatch, the loop's prologue), fitted with COOP_TILE_EFF to measured splits
SPLITK_FIXED_K = 256
#: split counts the model considers; ranges are rounded up to whole BK steps, so the count used
#: can come out lower (16 ranges of K = 7200 at BK 64 are 15 of 512 and one empty: 15 used)
SPLITK_COUNTS = (1, 2, 4, 8, 16)
#: shortest K range of a split but the last (elements; the last takes what is left of K)
SPLITK_MIN_K = 512
#: most bytes of partial products one dispatch may stage (the device's shared scratch)
SPLITK_MAX_SCRATCH = 64 << 20
#: tile throughput (MACs per workgroup-second) relative to the default tiling's, by tile: the
#: 4 x 4-fragment large tilings do more MMAs per shared-memory load (measured:
#: docs/PERFORMANCE.md, "Prefill kernels")
COOP_TILE_EFF = {COOP_BIG_QUANT: 1.15, COOP_BIG_FLOAT: 1.25}


def splitk_off(device: Any) -> bool:
    """Whether ``splitk`` is switched off for ``device`` (VKXSPLIT_DISABLE; no device: the
    process's setting)."""
    return "splitk" in _disabled(device)


def split_chunk(K: int, splits: int, bk: int) -> int:
    """K elements per range when K is cut into ``splits`` ranges of whole ``bk`` steps (the
    last range takes what is left; the count used is ceil(K / chunk), maybe fewer)."""
    per = -(-K // splits)
    return -(-per // bk) * bk


def coop_cost(tile: CoopTile, M: int, N: int, K: int, splits: int) -> float | None:
    """Modelled time of a coopmat product with ``tile`` and K in ``splits`` ranges (None when
    that split is not allowed: ranges under SPLITK_MIN_K, partials over SPLITK_MAX_SCRATCH):
    waves of COOP_WAVE workgroups, each wave as long as one workgroup's tile work, BM x BN x
    its K range / COOP_TILE_EFF, plus SPLITK_FIXED_K of work per split workgroup."""
    got = _split_cost(tile, M, N, K, splits, COOP_WAVE, COOP_TILE_EFF.get(tile.name, 1.0), tile.bk)
    return None if got is None else got[0]


def _split_cost(tile: Any, M: int, N: int, K: int, splits: int, wave: int, eff: float,
                quantum: int) -> tuple[float, int] | None:
    """(modelled time, K elements per split or 0) of ``tile`` with K cut into ``splits``
    ranges of whole ``quantum`` multiples (None when not allowed: ranges under SPLITK_MIN_K,
    partials over SPLITK_MAX_SCRATCH): waves of ``wave`` workgroups, each wave as long as one
    workgroup's BM x BN x K-range work / ``eff``, plus SPLITK_FIXED_K per split workgroup."""
    chunk = split_chunk(K, splits, quantum)
    used = -(-K // max(chunk, 1))
    if used > 1 and (chunk < SPLITK_MIN_K or 4 * M * N * used > SPLITK_MAX_SCRATCH):
        return None
    groups = -(-M // tile.bm) * -(-N // tile.bn) * used
    work = chunk / eff + (SPLITK_FIXED_K if used > 1 else 0)
    return -(-groups // wave) * tile.bm * tile.bn * work, (chunk if used > 1 and chunk < K else 0)


def _best_split(tile: CoopTile, M: int, N: int, K: int, nosplit: bool = False) -> tuple[float, int]:
    """(modelled cost, K elements per split or 0) of the count of SPLITK_COUNTS with the least
    coop_cost (ties: fewer splits; one range is always allowed; only that with ``nosplit``)."""
    return _wave_cost(tile, M, N, K, COOP_WAVE, COOP_TILE_EFF.get(tile.name, 1.0), nosplit)


def coop_k_split(tile: CoopTile, M: int, N: int, K: int) -> int:
    """K elements per split for a coopmat product with ``tile`` (0: no split): the count of
    SPLITK_COUNTS with the least coop_cost (ties: fewer splits), as a multiple of BK."""
    return _best_split(tile, M, N, K)[1]


def coop_tile_fits(tile: CoopTile, device: Device | None) -> bool:
    """Whether ``device``'s limits take ``tile``'s workgroup (threads, shared memory, subgroups
    of COOP_SUBGROUP at the required size); any tile without a device or limits (the H200's
    are COOP_SHARED_MAX, 1024 threads, 32 subgroups)."""
    phys = getattr(device, "physical", None)
    lim = getattr(phys, "limits", None)
    if not lim:
        return True
    most_sg = int(getattr(phys, "max_workgroup_subgroups", 0) or 0)
    return (tile.threads <= int(lim.get("maxComputeWorkGroupInvocations", 1024))
            and tile.shared_bytes <= int(lim.get("maxComputeSharedMemorySize", COOP_SHARED_MAX))
            and tile.threads <= int(lim.get("maxComputeWorkGroupSize", (1024,))[0])
            and (most_sg == 0 or tile.threads // COOP_SUBGROUP <= most_sg))


def coop_choose(t: str, M: int, N: int, K: int, device: Device | None = None) -> tuple[str, int]:
    """(variant, K elements per split) of a coopmat product of weight type ``t`` that names
    no variant: the type's default tiling or its large one (coop_big_tile), whichever
    coop_cost models faster with its best split (ties: the default). No split where ``splitk``
    is switched off for ``device``; only the default tiling where ``device``'s limits do not
    take the large one (coop_tile_fits: the float one has 512 threads and 46 KiB of shared
    memory, the quantized one 256 and 38 KiB). (How close the model's picks come to the
    fastest measured: docs/PERFORMANCE.md, "Prefill kernels".)"""
    nosplit = splitk_off(device)
    keys = [COOP_CONFIG[t]]
    big = coop_big_tile(t)
    if big != COOP_CONFIG[t] and coop_tile_fits(COOP_TILES[big], device):
        keys.append(big)
    best: tuple[float, str, int] | None = None
    for key in keys:  # the default first: it keeps ties
        tile = COOP_TILES[key]
        cost, ks = _best_split(tile, M, N, K, nosplit)
        if best is None or cost < best[0]:
            best = (cost, key, ks)
    assert best is not None
    _, key, ks = best
    return coop_variant_name(t, None if key == COOP_CONFIG[t] else key), ks


def cm2_choose(t: str, M: int, N: int, K: int, device: Device | None = None) -> tuple[str, int]:
    """(variant, K elements per split) of a mul_mat_cm2 product of weight type ``t``: the
    tiling of CM2_CHOICES[t] and split with the least modelled time (coop_cost's waves, with
    CM2_WAVE workgroups at once and CM2_TILE_EFF); ties: the earlier tiling, fewer splits; only
    tilings ``device`` has a flexible shape for. No split where ``splitk`` is switched off."""
    keys = CM2_CHOICES[t]
    if getattr(device, "physical", None) is not None:
        keys = tuple(k for k in keys if k == CM2_DEFAULT or cm2_tile_supported(device, CM2_TILES[k]))
    _, key, ks = _cm2_best(t, keys, M, N, K, splitk_off(device))
    return cm2_variant_name(t, key), ks


def _cm2_best(t: str, keys: tuple[str, ...], M: int, N: int, K: int, nosplit: bool) -> tuple[float, str, int]:
    """(modelled time, tiling, K elements per split or 0) of the cheapest of ``keys`` for type
    ``t`` (ties: the earlier tiling; one range only with ``nosplit``)."""
    best: tuple[float, str, int] | None = None
    for key in keys:
        cost, ks = _cm2_cost(t, key, M, N, K, nosplit)
        if best is None or cost < best[0]:
            best = (cost, key, ks)
    assert best is not None
    return best


def _cm2_cost(t: str, tile: str | Cm2Tile, M: int, N: int, K: int, nosplit: bool) -> tuple[float, int]:
    """(modelled time, K elements per split or 0) of mul_mat_cm2 tiling ``tile`` (a Cm2Tile or
    a CM2_TILES key) for type ``t``. Where K % 256 == 0 split ranges are whole 256-element
    runs, so every range keeps the kernel's aligned fast path (a range of BK multiples only
    would drop every workgroup of the split to the element loads, several times slower)."""
    tile = CM2_TILES[tile] if isinstance(tile, str) else tile
    wave = CM2_WAVE * max(1, 256 // tile.threads)
    quantum = 256 if K % 256 == 0 else tile.bk
    return _wave_cost(tile, M, N, K, wave, CM2_TILE_EFF.get(t, {}).get(tile.name, 1.0), nosplit, quantum)


def cm2_k_split(t: str, tile: str | Cm2Tile, M: int, N: int, K: int, device: Any = None) -> int:
    """K elements per split of mul_mat_cm2 tiling ``tile`` (a Cm2Tile, e.g. :func:`coop_tile`'s
    of a benchmark variant, or a CM2_TILES key) for weight type ``t`` (0: none), by
    cm2_choose's model (no split where ``splitk`` is switched off for ``device``)."""
    return _cm2_cost(t, tile, M, N, K, splitk_off(device))[1]


#: Dequantize-first (dq16): on a coopmat2 device a product of quantized weights may decode its
#: N x K weights once into f16 rows (dequant_rows_<type>_f16, a scratch of N K 2 bytes) and run
#: mul_mat_cm2's F16 kernel on them, instead of decoding in the tile loader for every tile of
#: x (ceil(M / BX) times). It pays where M is large enough that F16's rate makes up for the
#: extra pass. The model: each path's wave cost (cm2_choose's units) times the type's cost per
#: unit relative to F16 (DQ16_DIRECT_COST), against F16's cost plus the pass's bytes (read the
#: blocks, write f16) at DQ16_UNITS_PER_BYTE (F16's units per second over the pass's bytes
#: per second). DQ16_DIRECT_COST is fitted so that the model's direct / dq16 ratio at the
#: FFN's shape (14336x4096, M = 512) is the measured one, each type's fastest tiling against
#: dq16 (measured: docs/PERFORMANCE.md, "Prefill kernels"; tools/bench_coopmat.py --cm2).
DQ16_DIRECT_COST: dict[str, float] = {"q4_0": 1.32, "q4_1": 1.4, "q5_0": 1.65, "q5_1": 1.47, "q8_0": 1.67,
                                      "q4_k": 1.6, "q5_k": 1.8, "q6_k": 1.66}
#: fewest rows of x the model takes the path for: more than one 128-row tile of x (at M <= 128
#: the tile loader decodes every weight once too, and the pass is pure overhead)
DQ16_MIN_M = 129
DQ16_UNITS_PER_BYTE = 0.30
#: the pass's own dispatch and the barrier after it (~2 us at F16's rate)
DQ16_FIXED_UNITS = 1.6e6
#: largest f16 copy the model makes (N K 2 bytes): the FFN of a 70B model (28672 x 8192, 448
#: MiB) fits, an all-logits output projection of a 128k vocabulary (1 GiB) does not
DQ16_MAX_BYTES = 512 << 20


def dq16_available(device: Device, t: str) -> bool:
    """Whether a product of ``t`` weights may take the dequantize-first path on ``device``: a
    quantized type, mul_mat_cm2 available (its F16 kernel reads the f16 rows; no device
    addresses needed, so weights in exported or imported blocks qualify too), and ``dq16``
    not switched off for the device."""
    return t in DQ16_DIRECT_COST and "dq16" not in _disabled(device) and coopmat2_available(device)


def dq16_chosen(t: str, M: int, N: int, K: int, device: Any = None) -> bool:
    """Whether the model above prefers the dequantize-first path for this product (the
    direct side modelled as mul_mat_cm2 with every tiling of CM2_CHOICES: where the device
    filters tilings or the weights keep mul_mat_coopmat, the real direct path is no faster, so
    the pick errs towards the tile loader; both sides unsplit where ``splitk`` is switched off
    for ``device``)."""
    if t not in DQ16_DIRECT_COST or M < DQ16_MIN_M or 2 * N * K > DQ16_MAX_BYTES:
        return False
    nosplit = splitk_off(device)
    direct = _cm2_best(t, CM2_CHOICES[t], M, N, K, nosplit)[0] * DQ16_DIRECT_COST[t]
    pass_bytes = N * (TYPES[t].row_bytes(K) + 2 * K)
    first = (_cm2_best("f16", CM2_CHOICES["f16"], M, N, K, nosplit)[0]
             + pass_bytes * DQ16_UNITS_PER_BYTE + DQ16_FIXED_UNITS)
    return first < direct


def _wave_cost(tile: Any, M: int, N: int, K: int, wave: int, eff: float, nosplit: bool,
               quantum: int = 0) -> tuple[float, int]:
    """(modelled time, K elements per split or 0) of the best split of SPLITK_COUNTS for
    ``tile`` (only one range when ``nosplit``), ranges whole multiples of ``quantum`` (default
    the tile's BK): waves of ``wave`` workgroups, each wave as long as one workgroup's BM x BN x
    K-range work / ``eff``, plus SPLITK_FIXED_K per split."""
    best: tuple[float, int] | None = None
    for n in (1,) if nosplit else SPLITK_COUNTS:
        got = _split_cost(tile, M, N, K, n, wave, eff, quantum or tile.bk)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    assert best is not None
    return best


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

# VkComponentTypeKHR / VkScopeKHR values
_FLOAT16, _FLOAT32, _SCOPE_WORKGROUP, _SCOPE_SUBGROUP = 0, 1, 2, 3
_SUBGROUP_ARITHMETIC = 0x4
_STAGE_COMPUTE = 0x20


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
    if not all(coop_tile_fits(COOP_TILES[COOP_CONFIG[t]], device) for t in TYPES):
        return False  # the default tilings' workgroups exceed the device's limits
    return any(s.m == 16 and s.n == 16 and s.k == 16 and s.a_type == _FLOAT16 and s.b_type == _FLOAT16
               and s.c_type == _FLOAT32 and s.result_type == _FLOAT32 and s.scope == _SCOPE_SUBGROUP
               for s in p.coopmat_shapes)


def coopmat_available(device: Device) -> bool:
    """coopmat_supported and ``coopmat`` not switched off for ``device``."""
    return "coopmat" not in _disabled(device) and coopmat_supported(device)


def coopmat2_supported(device: Device) -> bool:
    """Whether ``device`` runs mul_mat_cm2: VK_NV_cooperative_matrix2 enabled with the features
    the kernel needs (Device enables it only with all of them), and an f16 x f16 -> f32
    workgroup-scope flexible shape whose granularities divide the default tiling at its
    workgroup size (cm2_choose leaves out other tilings the device has no shape for)."""
    if not getattr(device, "coopmat2", False) or not all(device.features.get(f) for f in _CM2_REQUIRES):
        return False
    return all(cm2_tile_supported(device, tile) for tile in (CM2_TILES[CM2_DEFAULT],))


def cm2_tile_supported(device: Device, tile: Cm2Tile) -> bool:
    """An f16 x f16 -> f32 workgroup-scope flexible shape of ``tile.threads`` invocations whose
    granularities divide the tile (A: BW x BK, B: BK x BX, accumulator BW x BX)."""
    return any(f.scope == _SCOPE_WORKGROUP and f.a_type == _FLOAT16 and f.b_type == _FLOAT16
               and f.c_type == _FLOAT32 and f.result_type == _FLOAT32
               and f.workgroup_invocations == tile.threads
               and tile.bw % f.m_granularity == 0 and tile.bx % f.n_granularity == 0
               and tile.bk % f.k_granularity == 0
               for f in getattr(device.physical, "coopmat2_flex", []))


def coopmat2_available(device: Device) -> bool:
    """coopmat2_supported, and neither ``coopmat`` nor ``coopmat2`` switched off for ``device``."""
    return not ({"coopmat", "coopmat2"} & _disabled(device)) and coopmat2_supported(device)


def cm2_eligible(device: Device, t: str, w: Bindable) -> bool:
    """Whether a product of ``t`` weights bound as ``w`` runs mul_mat_cm2 on ``device``: a
    CM2_TYPES type, the kernel available, and the weights in a block created for device
    addresses (the decode functions take a pointer into it; exported or imported blocks, such
    as an arena shared with an attached backend, are not: those products keep mul_mat_coopmat)."""
    if t not in CM2_TYPES or not coopmat2_available(device):
        return False
    buf = w.buffer if isinstance(w, View) else w
    return bool(getattr(getattr(buf, "block", None), "device_address", False))


def vec_supported(device: Device) -> bool:
    """The mat-vec kernel reduces with subgroup arithmetic in compute shaders."""
    return _vec_ok(device.physical)


def _vec_ok(p: Any) -> bool:
    return bool(p.subgroup_ops & _SUBGROUP_ARITHMETIC) and bool(p.subgroup_stages & _STAGE_COMPUTE)


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
        if "coopmat" in _disabled(device):
            raise KernelError(f"{name}: the coopmat path is switched off (VKXSPLIT_DISABLE=coopmat)")
        if not coopmat_supported(device):
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
    if _overlap(y, w) or _overlap(y, x):
        raise KernelError(f"{name}: y overlaps x or the weights")
    for v in (x_offset + (M - 1) * x_stride + K, y_offset + (M - 1) * y_stride + y_col + N):
        if v >= 1 << 32:
            raise KernelError(f"{name}: element offsets exceed 32 bits")
    return x_off, y_off


def _overlap(a: Bindable, b: Bindable) -> bool:
    _, oa, sa, ba = as_range(a)
    _, ob, sb, bb = as_range(b)
    return ba == bb and oa < ob + sb and ob < oa + sa


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
    ``coop_variant`` :func:`coop_choose` picks tiling and split, with a real one
    :func:`coop_k_split` picks the split (never for emulated variants, nor where ``splitk``
    is switched off for the device); 0: no split.

    ``dq16`` (coopmat path, quantized weights, coopmat2 devices): True decodes W's N rows to f16
    first and runs mul_mat_cm2's F16 kernel on them (dq16_chosen's model otherwise: None; False
    never)."""
    wt = weight_type(w_type)
    dev = seq.device
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
    if dq16 and (coop_variant is not None or not dq16_available(dev, wt.name)):
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
        vec_variant = device_vec_variant(dev, wt.name, M)
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
        kernel = Kernel.get(dev, vec_variant or vec_kernel_name(wt.name, M))
    elif path == "tiled":
        kernel = Kernel.get(dev, f"mul_mat_{wt.name}_f32")
    else:
        if coop_variant is None and dq16 is not False and dq16_available(dev, wt.name) and (
                dq16 or dq16_chosen(wt.name, M, N, K, dev)):
            # dequantize first: W's N rows once to f16, then mul_mat_cm2's F16 kernel on them
            wh = _dq16_rows(dev, name, N * K * 2, forced=bool(dq16))
            if wh is not None:
                record_dequant_rows(seq, w, wt, wh, N, K, row0=w_row_offset)
                w, wt, w_row_offset = wh, TYPES["f16"], 0
        cm2 = coop_variant is None and cm2_eligible(dev, wt.name, w)
        if coop_variant is None and k_split is not None:
            # a pinned split: the default tiling
            cname, chosen = (cm2_variant_name(wt.name) if cm2 else coop_variant_name(wt.name)), k_split
        elif cm2:
            cname, chosen = cm2_choose(wt.name, M, N, K, dev)
        elif coop_variant is None:
            cname, chosen = coop_choose(wt.name, M, N, K, dev)
        elif _is_cm2(coop_variant):
            cname, chosen = coop_variant, cm2_k_split(wt.name, tile, M, N, K, dev)  # type: ignore[arg-type]
        else:
            cname, chosen = coop_variant, 0 if emulated or splitk_off(dev) else coop_k_split(
                tile, M, N, K)  # type: ignore[arg-type]
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


__all__ = ["VARIANTS", "VEC_CONFIG", "VEC_CPU_M1", "VEC_MAXM", "VecConfig", "VecqConfig", "CoopTile", "Cm2Tile",
           "make_vec_variant", "make_vecq_variant", "make_coop_variant", "make_cm2_variant", "vec_m1_name",
           "vecq_name", "vecq_spec", "coop_tile", "q8_1_reference", "record_mul_mat_vecq", "record_quantize_q8_1",
           "vecq_scratch_bytes", "check_q8_1_scratch", "vecq_decode", "vecq_fits", "vecq_variant",
           "VECQ_DEFAULT_M1", "VECQ_GPU_M1_BY_TYPE", "VECQ_GPU_M1_TALL", "VECQ_TYPES", "vecq_for_shape",
           "vecq_default_config", "VECQ_GPU_TYPES", "record_swiglu_q8_1", "check_mul_mat", "coop_k_split",
           "cm2_choose", "cm2_variant_name", "coopmat2_available", "coopmat2_supported", "CM2_TILES", "CM2_DEFAULT",
           "CM2_TYPES", "CM2_CHOICES", "cm2_k_split", "cm2_eligible", "cm2_tile_supported", "dq16_available",
           "dq16_chosen", "DQ16_DIRECT_COST", "coop_cost", "split_chunk", "coop_choose", "coop_tile_fits",
           "splitk_off", "COOP_TILES", "COOP_CONFIG", "COOP_WAVE", "SPLITK_FIXED_K", "coopmat_available",
           "coopmat_supported", "coop_variant_name", "device_vec_variant", "record_mul_mat", "vec_config",
           "vec_kernel_name", "vec_variant_maxm", "vec_supported", "MAX_VEC_M", "PATHS", "WIDE_K"]
