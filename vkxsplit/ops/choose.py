"""Kernel choice for the matrix products: made once per device, from what the device reports.

:func:`kernels_for` returns the device's :class:`DeviceKernels`, a frozen object built once
(cached per device, weakly) from :func:`vkxsplit.features.kernel_inputs`: the compute units
(SMs / CUs), the shared-memory and workgroup limits, the subgroup sizes, the cooperative-matrix
shapes, the enabled features and the kill switches (``VKXSPLIT_DISABLE``). Everything that
decides which mul_mat kernel runs is here, as its methods:

- which paths the device has (:attr:`~DeviceKernels.vec`, ``coopmat``, ``coopmat2``, integer
  dot products, ``dq16``, ``splitk``; after the disabled set) and the default path for M;
- the mat-vec variant (:meth:`~DeviceKernels.matvec`: CPU devices' small workgroups at M = 1)
  and the q8_1-x decode variant (:meth:`~DeviceKernels.vecq`, :func:`vecq_for_shape`);
- the cooperative-matrix tiling and split K (:meth:`~DeviceKernels.coop`,
  :meth:`~DeviceKernels.cm2`, :meth:`~DeviceKernels.matmat`) by a cost model of waves of
  workgroups whose wave sizes come from the compute units, with the large tilings only where
  the device's limits take them, and dequantize-first (:meth:`~DeviceKernels.dq16`).

:mod:`vkxsplit.ops.mul_mat` records what these choose; the kernels' shapes and names are
:mod:`vkxsplit.ops.mul_mat_kernels`'s. The cost profile is keyed by the inputs' hash
(:func:`vkxsplit.features.kernel_config_ident`). The constants below were fitted on an H200
(measured: docs/PERFORMANCE.md, "Prefill kernels" and "Decode kernels").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..features import KernelInputs, kernel_inputs
from ..features import disabled as _disabled
from ..vk.kernel import Bindable, View
from .mul_mat_kernels import (
    _CM2_REQUIRES,
    CM2_CHOICES,
    CM2_DEFAULT,
    CM2_TILES,
    CM2_TYPES,
    COOP_BIG_FLOAT,
    COOP_BIG_QUANT,
    COOP_CONFIG,
    COOP_SUBGROUP,
    COOP_TILES,
    MAX_VEC_M,
    VEC_CPU_M1,
    VECQ_GPU_M1_TALL,
    VECQ_GPU_TYPES,
    VECQ_TALL_K,
    VECQ_TALL_N,
    VECQ_TYPES,
    Cm2Tile,
    CoopTile,
    cm2_variant_name,
    coop_big_tile,
    coop_variant_name,
    vec_kernel_name,
    vec_m1_name,
    vecq_default_config,
    vecq_name,
)
from .quant import TYPES

# ------------------------------------------------------------------------------------------
# what the device reports, and the fallbacks where it does not

#: compute units of a GPU that does not report them (no VK_NV_shader_sm_builtins nor AMD's
#: shader core properties: Intel, some drivers): the H200's 132 SMs, the device the cost
#: constants below were fitted on (so such a device chooses as the H200 does). CPU devices
#: count the host's cores.
DEFAULT_COMPUTE_UNITS = 132
#: mul_mat_coopmat workgroups (8 subgroups) resident per compute unit, as the wave model uses
#: it: fitted on an H200, where 132 SMs run one each (registers allow no second) and the
#: measured splits fit a wave of 128 (docs/PERFORMANCE.md, "Prefill kernels"); 128 / 132 keeps
#: that wave there and scales it with other devices' unit counts
COOP_OCCUPANCY = 128 / 132
#: shared memory a coopmat tiling may use on an object that reports no limits (test doubles,
#: the cost model alone): the H200's maxComputeSharedMemorySize
COOP_SHARED_MAX = 49152
#: workgroup limits of an object that reports none (Vulkan's usual 1024)
DEFAULT_WORKGROUP_INVOCATIONS = 1024

# ------------------------------------------------------------------------------------------
# the cost model: waves of workgroups (docs/KERNELS.md, "Tiling and split by shape")

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
#: mul_mat_cm2 tilings' throughput per workgroup-second relative to CM2_DEFAULT, per type
#: (F32/BF16 take F16's) (measured: docs/PERFORMANCE.md, "Prefill kernels";
#: tools/bench_coopmat.py --cm2)
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
    # not yet measured: the nearest measured type's (as CM2_CHOICES)
    "q2_k": {"w128x256_k64_n256": 1.25, "w64x256_k64_n256": 1.2},
    "q3_k": {"w128x256_k64_n256": 1.25, "w64x256_k64_n256": 1.2},
    "iq4_nl": {"w64x128_k64_n128": 0.51, "w64x256_k64_n256": 1.05},
    "iq4_xs": {"w64x256_k64_n256": 1.24},
}
#: Dequantize-first (dq16): on a coopmat2 device a product of quantized weights may decode its
#: N x K weights once into f16 rows (dequant_rows_<type>_f16, a scratch of N K 2 bytes) and run
#: mul_mat_cm2's F16 kernel on them, instead of decoding in the tile loader for every tile of
#: x (ceil(M / BX) times). It pays where M is large enough that F16's rate makes up for the
#: extra pass. The model: each path's wave cost (cm2's units) times the type's cost per
#: unit relative to F16 (DQ16_DIRECT_COST), against F16's cost plus the pass's bytes (read the
#: blocks, write f16) at DQ16_UNITS_PER_BYTE (F16's units per second over the pass's bytes
#: per second). DQ16_DIRECT_COST is fitted so that the model's direct / dq16 ratio at the
#: FFN's shape (14336x4096, M = 512) is the measured one, each type's fastest tiling against
#: dq16 (measured: docs/PERFORMANCE.md, "Prefill kernels"; tools/bench_coopmat.py --cm2).
DQ16_DIRECT_COST: dict[str, float] = {"q4_0": 1.32, "q4_1": 1.4, "q5_0": 1.65, "q5_1": 1.47, "q8_0": 1.67,
                                      "q4_k": 1.6, "q5_k": 1.8, "q6_k": 1.66,
                                      # not yet measured: the nearest measured type's
                                      "q2_k": 1.66, "q3_k": 1.66, "iq4_nl": 1.32, "iq4_xs": 1.6}
#: fewest rows of x the model takes the path for: more than one 128-row tile of x (at M <= 128
#: the tile loader decodes every weight once too, and the pass is pure overhead)
DQ16_MIN_M = 129
DQ16_UNITS_PER_BYTE = 0.30
#: the pass's own dispatch and the barrier after it (~2 us at F16's rate)
DQ16_FIXED_UNITS = 1.6e6
#: largest f16 copy the model makes (N K 2 bytes): the FFN of a 70B model (28672 x 8192, 448
#: MiB) fits, an all-logits output projection of a 128k vocabulary (1 GiB) does not
DQ16_MAX_BYTES = 512 << 20

# VkComponentTypeKHR / VkScopeKHR values
_FLOAT16, _FLOAT32, _SCOPE_WORKGROUP, _SCOPE_SUBGROUP = 0, 1, 2, 3
_COOP_FEATURES = ("cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel", "subgroupSizeControl")


def split_chunk(K: int, splits: int, bk: int) -> int:
    """K elements per range when K is cut into ``splits`` ranges of whole ``bk`` steps (the
    last range takes what is left; the count used is ceil(K / chunk), maybe fewer)."""
    per = -(-K // splits)
    return -(-per // bk) * bk


def _split_cost(tile: Any, M: int, N: int, K: int, splits: int, wave: int, eff: float,
                quantum: int) -> tuple[float, int] | None:
    """(modelled time, K elements per split or 0) of ``tile`` with K cut into ``splits``
    ranges of whole ``quantum`` multiples (None when not allowed: ranges under SPLITK_MIN_K,
    partials over SPLITK_MAX_SCRATCH): waves of ``wave`` workgroups, each wave as long as one
    workgroup's BM x BN x K-range work / ``eff``, plus SPLITK_FIXED_K per split workgroup. A
    workgroup's time is its K loop whatever the grid, so a grid under a wave leaves units idle
    and one just over it takes two waves' time."""
    chunk = split_chunk(K, splits, quantum)
    used = -(-K // max(chunk, 1))
    if used > 1 and (chunk < SPLITK_MIN_K or 4 * M * N * used > SPLITK_MAX_SCRATCH):
        return None
    groups = -(-M // tile.bm) * -(-N // tile.bn) * used
    work = chunk / eff + (SPLITK_FIXED_K if used > 1 else 0)
    return -(-groups // wave) * tile.bm * tile.bn * work, (chunk if used > 1 and chunk < K else 0)


def _wave_cost(tile: Any, M: int, N: int, K: int, wave: int, eff: float, nosplit: bool,
               quantum: int = 0) -> tuple[float, int]:
    """(modelled time, K elements per split or 0) of the best split of SPLITK_COUNTS for
    ``tile`` (only one range when ``nosplit``; ties: fewer splits), ranges whole multiples of
    ``quantum`` (default the tile's BK)."""
    best: tuple[float, int] | None = None
    for n in (1,) if nosplit else SPLITK_COUNTS:
        got = _split_cost(tile, M, N, K, n, wave, eff, quantum or tile.bk)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    assert best is not None
    return best


def vecq_for_shape(variant: str, t: str, N: int, K: int) -> str:
    """The decode variant for an N x K product of ``t`` weights, given the type's default
    ``variant`` (:meth:`DeviceKernels.vecq`): VECQ_GPU_M1_TALL's shape where the default is the
    GPU one and the product is tall; the default otherwise. (A graph decides on the weight's
    rows; where a plan splits that product's rows between backends the hub's share runs the
    same shape, correct for any rows, measured only for the whole.)"""
    tall = VECQ_GPU_M1_TALL.get(t)
    if (tall is None or N < VECQ_TALL_N or N > 4 * K or K > VECQ_TALL_K
            or variant != vecq_name(t, vecq_default_config(t, cpu=False))):
        return variant
    return vecq_name(t, tall)


class MatMat(NamedTuple):
    """A mat-mat product's kernel (:meth:`DeviceKernels.matmat`): ``variant`` (a mul_mat_cm2 or
    mul_mat_coopmat variant), K elements per split (0: none), and whether W is dequantized to
    f16 rows first (then ``variant`` is F16's)."""

    variant: str
    k_split: int
    dq16: bool


@dataclass(frozen=True)
class DeviceKernels:
    """Kernel choice for one device (:func:`kernels_for`), from its :class:`KernelInputs`.

    Derived once: ``compute_units`` (reported; else the host's cores on a CPU device, else
    DEFAULT_COMPUTE_UNITS), the waves of the cost model (``coop_wave``: mul_mat_coopmat
    workgroups at once, compute_units x COOP_OCCUPANCY; ``cm2_wave``: mul_mat_cm2 workgroups of
    256 invocations, one per unit), the limits a tiling must fit (``shared_max``, ...), and what
    the device supports (``vec``, ``coopmat``, ``coopmat2``, ``intdot``, and ``cm2_tiles``: the
    mul_mat_cm2 tilings it has a flexible shape for, None: any). What is available is that minus
    the disabled set (the ``*_available`` properties)."""

    inputs: KernelInputs
    compute_units: int
    coop_wave: int
    cm2_wave: int
    shared_max: int
    max_invocations: int
    max_workgroup_x: int
    vec: bool
    coopmat: bool
    coopmat2: bool
    intdot: bool
    cm2_tiles: frozenset[str] | None

    @classmethod
    def from_inputs(cls, i: KernelInputs) -> DeviceKernels:
        units = i.compute_units or (i.host_cores if i.is_cpu else 0) or DEFAULT_COMPUTE_UNITS
        base = cls(inputs=i, compute_units=units, coop_wave=max(1, round(units * COOP_OCCUPANCY)),
                   cm2_wave=units, shared_max=i.shared_memory or COOP_SHARED_MAX,
                   max_invocations=i.workgroup_invocations or DEFAULT_WORKGROUP_INVOCATIONS,
                   max_workgroup_x=i.workgroup_size_x or DEFAULT_WORKGROUP_INVOCATIONS,
                   vec=i.subgroup_arithmetic, coopmat=False, coopmat2=False, intdot=False, cm2_tiles=None)
        tiles = None if i.coopmat2_flex is None else frozenset(
            k for k, tile in CM2_TILES.items() if _flex_fits(i, tile))
        coop = (all(f in i.features for f in _COOP_FEATURES)
                and i.min_subgroup_size <= COOP_SUBGROUP <= i.max_subgroup_size
                and all(base.tile_fits(COOP_TILES[COOP_CONFIG[t]]) for t in TYPES)
                and any(s[:7] == (16, 16, 16, _FLOAT16, _FLOAT16, _FLOAT32, _FLOAT32) and s[8] == _SCOPE_SUBGROUP
                        for s in i.coopmat_shapes))
        cm2 = (i.coopmat2 and all(f in i.features for f in _CM2_REQUIRES)
               and _flex_fits(i, CM2_TILES[CM2_DEFAULT]))
        return cls(**{**base.__dict__, "coopmat": coop, "coopmat2": cm2, "cm2_tiles": tiles,
                      "intdot": "shaderIntegerDotProduct" in i.features and i.subgroup_arithmetic})

    # -- what is available ------------------------------------------------------------------
    @property
    def disabled(self) -> frozenset[str]:
        return self.inputs.disabled

    @property
    def is_cpu(self) -> bool:
        return self.inputs.is_cpu

    @property
    def coopmat_available(self) -> bool:
        """The coopmat kernels (f16 16x16x16 subgroup matrices at subgroup size 32, the
        default tilings within the limits) and ``coopmat`` not switched off."""
        return self.coopmat and "coopmat" not in self.disabled

    @property
    def attn_coopmat_available(self) -> bool:
        """The cooperative-matrix attention of prefill-sized batches (attention_coopmat.comp:
        the coopmat kernels' f16 16x16x16 subgroup matrices at subgroup size 32), neither
        ``coopmat`` nor ``attn_coopmat`` switched off."""
        return self.coopmat and not ({"coopmat", "attn_coopmat"} & self.disabled)

    @property
    def coopmat2_available(self) -> bool:
        """mul_mat_cm2 (VK_NV_cooperative_matrix2 enabled with what the kernel needs, a
        flexible f16 shape for the default tiling), neither ``coopmat`` nor ``coopmat2`` off."""
        return self.coopmat2 and not ({"coopmat", "coopmat2"} & self.disabled)

    @property
    def vecq_available(self) -> bool:
        """Integer dot products (shaderIntegerDotProduct, subgroup arithmetic), ``intdot`` on."""
        return self.intdot and "intdot" not in self.disabled

    @property
    def splits_k(self) -> bool:
        return "splitk" not in self.disabled

    @property
    def decode_workgroups(self) -> int:
        """Workgroups a decode attention should spread over: two per compute unit of a GPU
        (264 on an H200), one per core of a CPU device (ops/attention.py)."""
        return self.compute_units if self.is_cpu else 2 * self.compute_units

    def ident(self) -> str:
        """The hash of the inputs (what :func:`vkxsplit.features.kernel_config_ident` keys by)."""
        return self.inputs.ident()

    def tile_fits(self, tile: CoopTile) -> bool:
        """Whether the device's limits take ``tile``'s workgroup: threads, shared memory,
        subgroups of COOP_SUBGROUP (where the device reports a most)."""
        most_sg = self.inputs.workgroup_subgroups
        return (tile.threads <= self.max_invocations and tile.shared_bytes <= self.shared_max
                and tile.threads <= self.max_workgroup_x
                and (most_sg == 0 or tile.threads // COOP_SUBGROUP <= most_sg))

    def cm2_tile_supported(self, tile: Cm2Tile) -> bool:
        """A flexible f16 x f16 -> f32 workgroup shape of ``tile.threads`` invocations whose
        granularities divide the tile (any tiling for an object without a physical device)."""
        return self.inputs.coopmat2_flex is None or _flex_fits(self.inputs, tile)

    # -- the path and the mat-vec -----------------------------------------------------------
    def path(self, M: int) -> str:
        """The default path of a product with M rows of x: ``vec`` (M <= MAX_VEC_M, subgroup
        arithmetic), ``coopmat`` (where available), else ``tiled``."""
        if M <= MAX_VEC_M and self.vec:
            return "vec"
        return "coopmat" if self.coopmat_available else "tiled"

    def matvec(self, t: str, M: int) -> str:
        """The f32-x mat-vec variant for M columns of x times ``t`` weights: CPU devices take
        VEC_CPU_M1's small workgroups at M = 1, everything else the type's VEC_CONFIG shape for
        the fewest VEC_MAXM columns that hold M."""
        c = VEC_CPU_M1.get(t) if M == 1 and self.is_cpu else None
        return vec_kernel_name(t, M) if c is None else vec_m1_name(t, c)

    def vecq_decode(self) -> dict[str, str]:
        """weight type -> the integer-dot-product mat-vec variant decode (M = 1) uses; empty
        without integer dot products or with ``intdot`` switched off. GPUs: VECQ_GPU_TYPES;
        CPU devices: every VECQ_TYPES type, one row per invocation."""
        if not self.vecq_available:
            return {}
        cpu = self.is_cpu
        return {t: vecq_name(t, vecq_default_config(t, cpu)) for t in VECQ_TYPES if cpu or t in VECQ_GPU_TYPES}

    def vecq(self, t: str, M: int) -> str | None:
        """The integer-dot-product mat-vec variant a graph uses for ``M`` columns of x times
        ``t`` weights (x quantized to q8_1 once, shared by every mat-vec reading it), or None
        where the f32-x kernels stay (M > 1, other types, no integer dot products)."""
        return self.vecq_decode().get(t) if M == 1 else None

    def vecq_for_shape(self, variant: str, t: str, N: int, K: int) -> str:
        """:func:`vecq_for_shape` (the tall GPU shapes by N and K)."""
        return vecq_for_shape(variant, t, N, K)

    # -- cooperative matrices: tiling and split ---------------------------------------------
    def coop_cost(self, tile: CoopTile, M: int, N: int, K: int, splits: int) -> float | None:
        """Modelled time of a mul_mat_coopmat product with ``tile`` and K in ``splits`` ranges
        (None where that split is not allowed): waves of ``coop_wave`` workgroups."""
        got = _split_cost(tile, M, N, K, splits, self.coop_wave, COOP_TILE_EFF.get(tile.name, 1.0), tile.bk)
        return None if got is None else got[0]

    def _coop_best(self, tile: CoopTile, M: int, N: int, K: int) -> tuple[float, int]:
        return _wave_cost(tile, M, N, K, self.coop_wave, COOP_TILE_EFF.get(tile.name, 1.0), not self.splits_k)

    def coop_k_split(self, tile: CoopTile, M: int, N: int, K: int) -> int:
        """K elements per split of a mul_mat_coopmat product with ``tile`` (0: none): the count
        of SPLITK_COUNTS with the least modelled time, as a multiple of BK; 0 with ``splitk``
        off."""
        return self._coop_best(tile, M, N, K)[1]

    def coop(self, t: str, M: int, N: int, K: int) -> tuple[str, int]:
        """(variant, K elements per split) of a mul_mat_coopmat product of ``t`` weights: the
        type's default tiling or its large one (coop_big_tile, where the device's limits take
        it), whichever the model times faster with its best split (ties: the default). (How
        close the model's picks come to the fastest measured: docs/PERFORMANCE.md, "Prefill
        kernels".)"""
        keys = [COOP_CONFIG[t]]
        big = coop_big_tile(t)
        if big != COOP_CONFIG[t] and self.tile_fits(COOP_TILES[big]):
            keys.append(big)
        best: tuple[float, str, int] | None = None
        for key in keys:  # the default first: it keeps ties
            cost, ks = self._coop_best(COOP_TILES[key], M, N, K)
            if best is None or cost < best[0]:
                best = (cost, key, ks)
        assert best is not None
        _, key, ks = best
        return coop_variant_name(t, None if key == COOP_CONFIG[t] else key), ks

    def _cm2_cost(self, t: str, tile: str | Cm2Tile, M: int, N: int, K: int) -> tuple[float, int]:
        """(modelled time, K elements per split or 0) of mul_mat_cm2 tiling ``tile`` for type
        ``t``: waves of ``cm2_wave`` workgroups of 256 invocations (twice as many of 128). Where
        K % 256 == 0 split ranges are whole 256-element runs, so every range keeps the kernel's
        aligned fast path (a range of BK multiples only would drop every workgroup of the split
        to the element loads, several times slower)."""
        tile = CM2_TILES[tile] if isinstance(tile, str) else tile
        wave = self.cm2_wave * max(1, 256 // tile.threads)
        quantum = 256 if K % 256 == 0 else tile.bk
        return _wave_cost(tile, M, N, K, wave, CM2_TILE_EFF.get(t, {}).get(tile.name, 1.0), not self.splits_k,
                          quantum)

    def _cm2_best(self, t: str, keys: tuple[str, ...], M: int, N: int, K: int) -> tuple[float, str, int]:
        best: tuple[float, str, int] | None = None
        for key in keys:  # ties: the earlier tiling
            cost, ks = self._cm2_cost(t, key, M, N, K)
            if best is None or cost < best[0]:
                best = (cost, key, ks)
        assert best is not None
        return best

    def cm2(self, t: str, M: int, N: int, K: int) -> tuple[str, int]:
        """(variant, K elements per split) of a mul_mat_cm2 product of ``t`` weights: the tiling
        of CM2_CHOICES[t] the device has a shape for and split with the least modelled time
        (CM2_TILE_EFF; ties: the earlier tiling, fewer splits)."""
        keys = tuple(k for k in CM2_CHOICES[t] if k == CM2_DEFAULT or self.cm2_tiles is None or k in self.cm2_tiles)
        _, key, ks = self._cm2_best(t, keys, M, N, K)
        return cm2_variant_name(t, key), ks

    def cm2_k_split(self, t: str, tile: str | Cm2Tile, M: int, N: int, K: int) -> int:
        """K elements per split of mul_mat_cm2 tiling ``tile`` (a Cm2Tile, e.g. of a benchmark
        variant, or a CM2_TILES key) for ``t`` weights (0: none), by :meth:`cm2`'s model."""
        return self._cm2_cost(t, tile, M, N, K)[1]

    # -- dequantize first -------------------------------------------------------------------
    def dq16_available(self, t: str) -> bool:
        """Whether a product of ``t`` weights may dequantize to f16 rows first: a quantized
        type, mul_mat_cm2 available (its F16 kernel reads the rows; no device addresses needed,
        so weights in exported or imported blocks qualify too), ``dq16`` not switched off."""
        return t in DQ16_DIRECT_COST and "dq16" not in self.disabled and self.coopmat2_available

    def dq16(self, t: str, M: int, N: int, K: int) -> bool:
        """Whether the model prefers dequantize-first for this product (the model alone, not
        :meth:`dq16_available`): the direct side modelled as mul_mat_cm2 with every tiling of
        CM2_CHOICES (where the device filters tilings or the weights keep mul_mat_coopmat the
        real direct path is no faster, so the pick errs towards the tile loader), times
        DQ16_DIRECT_COST, against F16's plus the pass's bytes."""
        if t not in DQ16_DIRECT_COST or M < DQ16_MIN_M or 2 * N * K > DQ16_MAX_BYTES:
            return False
        direct = self._cm2_best(t, CM2_CHOICES[t], M, N, K)[0] * DQ16_DIRECT_COST[t]
        pass_bytes = N * (TYPES[t].row_bytes(K) + 2 * K)
        first = (self._cm2_best("f16", CM2_CHOICES["f16"], M, N, K)[0]
                 + pass_bytes * DQ16_UNITS_PER_BYTE + DQ16_FIXED_UNITS)
        return first < direct

    def cm2_eligible(self, t: str, w: Bindable) -> bool:
        """Whether a product of ``t`` weights bound as ``w`` runs mul_mat_cm2: a CM2_TYPES type,
        the kernel available, and the weights in a block created for device addresses (the
        decode functions take a pointer into it; exported or imported blocks, such as an arena
        shared with an attached backend, are not: those products keep mul_mat_coopmat)."""
        if t not in CM2_TYPES or not self.coopmat2_available:
            return False
        buf = w.buffer if isinstance(w, View) else w
        return bool(getattr(getattr(buf, "block", None), "device_address", False))

    def matmat(self, t: str, M: int, N: int, K: int, addressable: bool = True,
               dq16: bool | None = None) -> MatMat:
        """The coopmat path's kernel for an M x N x K product of ``t`` weights (the path must be
        available): dequantize-first where available and the model (or ``dq16=True``) takes
        it (``dq16=False``: never), then mul_mat_cm2 where available for the weights
        (``addressable``: their block has device addresses; the f16 rows always do), else
        mul_mat_coopmat."""
        first = dq16 is not False and self.dq16_available(t) and (bool(dq16) or self.dq16(t, M, N, K))
        if first:
            t, addressable = "f16", True
        if addressable and t in CM2_TYPES and self.coopmat2_available:
            return MatMat(*self.cm2(t, M, N, K), first)
        return MatMat(*self.coop(t, M, N, K), first)


def _flex_fits(i: KernelInputs, tile: Cm2Tile) -> bool:
    """A flexible f16 x f16 -> f32 workgroup-scope shape (CoopMatFlex's field order) of
    ``tile.threads`` invocations whose granularities divide the tile (A: BW x BK, B: BK x BX)."""
    return any(f[8] == _SCOPE_WORKGROUP and f[3:7] == (_FLOAT16, _FLOAT16, _FLOAT32, _FLOAT32)
               and f[9] == tile.threads and tile.bw % f[0] == 0 and tile.bx % f[1] == 0 and tile.bk % f[2] == 0
               for f in i.coopmat2_flex or ())


_CACHE: weakref.WeakKeyDictionary[Any, DeviceKernels] = weakref.WeakKeyDictionary()


def kernels_for(device: Any) -> DeviceKernels:
    """The :class:`DeviceKernels` of ``device`` (a Device, a physical device standing in for
    one, a test double, or None: the cost model alone with the process's VKXSPLIT_DISABLE),
    built once per device and kept while the device lives; rebuilt only where the object's
    disabled set changed since (tests set it)."""
    try:
        got = _CACHE.get(device)
    except TypeError:  # None, or an object that cannot be weakly referenced: not cached
        return DeviceKernels.from_inputs(kernel_inputs(device))
    if got is None or got.disabled != _disabled(device):
        got = _CACHE[device] = DeviceKernels.from_inputs(kernel_inputs(device))
    return got


# module-level forms of the device predicates, for callers that hold a device and ask one thing

def coopmat_supported(device: Any) -> bool:
    return kernels_for(device).coopmat


def coopmat_available(device: Any) -> bool:
    return kernels_for(device).coopmat_available


def coopmat2_supported(device: Any) -> bool:
    return kernels_for(device).coopmat2


def coopmat2_available(device: Any) -> bool:
    return kernels_for(device).coopmat2_available


def cm2_tile_supported(device: Any, tile: Cm2Tile) -> bool:
    return kernels_for(device).cm2_tile_supported(tile)


def vecq_variant(device: Any, t: str, M: int) -> str | None:
    return kernels_for(device).vecq(t, M)


__all__ = ["COOP_OCCUPANCY", "COOP_SHARED_MAX", "COOP_TILE_EFF", "CM2_TILE_EFF", "DEFAULT_COMPUTE_UNITS",
           "DQ16_DIRECT_COST", "DQ16_FIXED_UNITS", "DQ16_MAX_BYTES", "DQ16_MIN_M", "DQ16_UNITS_PER_BYTE",
           "DeviceKernels", "MatMat", "SPLITK_COUNTS", "SPLITK_FIXED_K", "SPLITK_MAX_SCRATCH", "SPLITK_MIN_K",
           "cm2_tile_supported", "coopmat2_available", "coopmat2_supported", "coopmat_available",
           "coopmat_supported", "kernels_for", "split_chunk", "vecq_for_shape", "vecq_variant"]
