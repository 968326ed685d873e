"""The mul_mat kernel family's shapes: what each variant is, not which one runs.

The shape dataclasses (:class:`VecConfig`, :class:`VecqConfig`, :class:`CoopTile`,
:class:`Cm2Tile`), the shapes that ship per type (``VEC_CONFIG``, ``VEC_CPU_M1``, the
``VECQ_*`` decode tables, ``COOP_TILES`` / ``COOP_CONFIG``, ``CM2_TILES`` / ``CM2_CHOICES``),
the variant names, the :class:`~vkxsplit.shaders.Variant` makers, and what a built variant's
manifest defines say about it (:func:`coop_tile`, :func:`vec_config`, :func:`vecq_spec`).
Which of them a product runs on a device is :mod:`vkxsplit.ops.choose`'s; the recorders and
the shipped ``VARIANTS`` list are :mod:`vkxsplit.ops.mul_mat`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KernelError
from ..shaders import Variant, variant_meta
from .quant import TYPES

MAX_VEC_M = 8           # the mat-vec kernel handles up to this many columns of x in one pass
PUSH = "I" * 10         # M, N, K, x_stride, y_stride, x_offset, y_offset, w_row0, y_col0, flags
PUSH_COOP = PUSH + "I"  # ... ksplit (coopmat: K elements per split, 0 = no split)
FLAG_XVEC = 1           # x rows are vec4-aligned (x binding 16-aligned, offset/stride % 4 == 0)
FLAG_WVEC = 2           # float W rows allow vector loads (vec: K % 8 == 0; others: K % 4 == 0)

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
    # not yet measured: the shapes of the nearest measured type (Q2_K / Q3_K share Q6_K's unit,
    # IQ4_NL Q4_0's block, IQ4_XS Q4_K's super-block), without a lane choice (DQX_L): they
    # read dq_codes()'s units
    **{t: VecConfig(128, 2, 2) for t in ("q2_k", "q3_k")},
    "iq4_nl": VecConfig(128, 4, 4), "iq4_xs": VecConfig(128, 2, 1),
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
    # the nearest measured type's shape (as VEC_CONFIG)
    **{t: VecConfig(32, 2, 1) for t in ("q2_k", "q3_k", "iq4_xs")}, "iq4_nl": VecConfig(32, 4, 1),
}


def vec_m1_name(t: str, cfg: VecConfig) -> str:
    """The name of an M = 1 mat-vec variant of shape ``cfg``: mul_mat_vec_<type>_f32_m1_<tag>."""
    return f"mul_mat_vec_{t}_f32_m1_{cfg.tag}"


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


#: mul_mat_vec.comp's specialization constants (its ``layout(constant_id = N)``; WG is also
#: the workgroup size, ``local_size_x_id = 0``)
VEC_SPEC_IDS = {"WG": 0, "NR": 1, "UNR": 2, "MAXM": 3}


def vec_module_name(t: str, lanes: int = 0) -> str:
    """The SPIR-V module every mat-vec (f32 x) shape of weight type ``t`` with ``lanes`` per
    block (0: the type's default) specializes: mod_mul_mat_vec_<type>[_l<lanes>]."""
    return f"mod_mul_mat_vec_{t}" + (f"_l{lanes}" if lanes else "")


def make_vec_variant(name: str, t: str, cfg: VecConfig, maxm: int) -> Variant:
    """The Variant of a mat-vec (f32 x) kernel of weight type ``t``, shape ``cfg``, ``maxm``
    columns: the type's module (per lane count) with the shape as specialization constants.
    Raises KernelError for a shape the kernel cannot run (its final reduction takes one
    thread per row and column: ``nr * maxm <= wg``)."""
    if min(cfg.wg, cfg.nr, cfg.unr, maxm) < 1 or not 1 <= maxm <= MAX_VEC_M:
        raise KernelError(f"mat-vec shape {cfg} with {maxm} columns: sizes must be positive and at most "
                          f"{MAX_VEC_M} columns")
    if cfg.nr * maxm > cfg.wg:
        raise KernelError(f"mat-vec shape {cfg.tag} with {maxm} columns: the final reduction needs a "
                          f"thread per row and column, {cfg.nr} x {maxm} > {cfg.wg} threads",
                          "take more threads per workgroup (wg) or fewer rows (nr)")
    defines = {"WTYPE": str(TYPES[t].id)}
    if cfg.lanes:
        defines["DQX_L"] = str(cfg.lanes)
    return Variant(name=name, source="mul_mat_vec.comp", defines=defines, module=vec_module_name(t, cfg.lanes),
                   spec={"WG": cfg.wg, "NR": cfg.nr, "UNR": cfg.unr, "MAXM": maxm}, spec_ids=VEC_SPEC_IDS,
                   local_size_spec="WG", bindings=3, writes=(2,), push=PUSH, local_size=(cfg.wg, 1, 1),
                   requires=_STORAGE)


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

    @property
    def module_tag(self) -> str:
        """The tag of the code path (the shape's defines): shapes with one module_tag differ only
        in specialization constants (WG, NR, UNR and the columns of x) and share a module."""
        return (f"b{self.blk}" + (f"_r{self.rpt}" if self.rpt > 1 else "") + (f"_s{self.sub}" if self.sub > 1 else "")
                + ("_sg" if self.sg else "") + ("_w5u" if self.w5u else "") + ("_sat" if self.sat else "")
                + ("" if self.idp else "_emu"))

    def defines(self) -> dict[str, str]:
        """The shape as defines and spec values together (as a built variant's resolved defines
        hold them; :meth:`from_defines` reads them back)."""
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


def vecq_spec(name: str) -> tuple[str, VecqConfig, int] | None:
    """(weight type, shape, most columns of x) of a built integer-dot-product mat-vec variant
    (shipped or loaded), from its defines; None for any other name."""
    d = _defines(name, ("mul_mat_vecq.comp",))
    if d is None or "PROBE_NOX" in d:
        return None
    t = _type_of(d)
    return None if t is None else (t, VecqConfig.from_defines(d), int(d["MAXM"]))


#: mul_mat_vecq.comp's specialization constants (its ``layout(constant_id = N)``; WG is also
#: the workgroup size, ``local_size_x_id = 0``)
VECQ_SPEC_IDS = {"WG": 0, "NR": 1, "UNR": 2, "MAXM": 3}


def vecq_module_name(t: str, cfg: VecqConfig, routed: bool = False) -> str:
    """The SPIR-V module of integer-dot-product mat-vec shape ``cfg`` of weight type ``t``: one
    per code path (:attr:`VecqConfig.module_tag`), mod_mul_mat[_id]_vecq_<type>_<module tag>
    (``routed``: with MUL_MAT_ID, ops.moe's decode kernels)."""
    return f"mod_mul_mat{'_id' if routed else ''}_vecq_{t}_{cfg.module_tag}"


def make_vecq_variant(name: str, t: str, cfg: VecqConfig, maxm: int) -> Variant:
    """The Variant of an integer-dot-product mat-vec kernel of weight type ``t``, shape ``cfg``,
    ``maxm`` columns of x: the module of its code path with WG, NR, UNR and the columns as
    specialization constants. Raises KernelError for a shape the kernel cannot run (a row's
    team is WG / NR threads; the final reduction takes a thread per row and column)."""
    if min(cfg.wg, cfg.nr, cfg.unr, cfg.rpt, maxm) < 1 or cfg.wg % cfg.nr or cfg.nr * cfg.rpt * maxm > cfg.wg:
        raise KernelError(f"q8_1-x mat-vec shape {cfg.tag} with {maxm} columns: WG must be a multiple of NR "
                          f"and at least NR x RPT x columns ({cfg.nr} x {cfg.rpt} x {maxm}), sizes positive")
    defines = {k: v for k, v in cfg.defines().items() if k not in VECQ_SPEC_IDS}
    return Variant(name=name, source="mul_mat_vecq.comp", defines={"WTYPE": str(TYPES[t].id), **defines},
                   module=vecq_module_name(t, cfg),
                   spec={"WG": cfg.wg, "NR": cfg.nr, "UNR": cfg.unr, "MAXM": maxm}, spec_ids=VECQ_SPEC_IDS,
                   local_size_spec="WG", bindings=3, writes=(2,), push=PUSH, local_size=(cfg.wg, 1, 1),
                   requires=(*(_IDP_REQUIRES if cfg.idp else ()), *_STORAGE))




TILED_BM, TILED_BN = 64, 64       # mul_mat.comp tile (rows of x, rows of W)
COOP_SUBGROUP = 32
FLAG_YVEC = 4           # coopmat: y rows 16-byte aligned (binding, offset, column offset, stride)


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
#: large ones DeviceKernels.coop weighs against it: COOP_BIG_QUANT for quantized weights (BM 256:
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


#: mul_mat_coopmat.comp's specialization constants (its ``layout(constant_id = N)``; NT, the
#: invocations, is also the workgroup size, ``local_size_x_id = 0``)
COOP_SPEC_IDS = {"NT": 0, "BM": 1, "BN": 2, "BK": 3, "WM": 4, "WN": 5, "STAGES": 6}


def coop_module_name(t: str, emulate: bool = False, routed: bool = False) -> str:
    """The SPIR-V module every mul_mat_coopmat tiling of weight type ``t`` specializes:
    mod_mul_mat[_id]_coopmat[_emu]_<type> (``routed``: with MUL_MAT_ID, ops.moe's kernels)."""
    return f"mod_mul_mat{'_id' if routed else ''}_coopmat{'_emu' if emulate else ''}_{t}"


def make_coop_variant(name: str, t: str, tile: CoopTile, emulate: bool = False) -> Variant:
    """The Variant of a mul_mat_coopmat kernel of weight type ``t`` with ``tile``: the type's
    module with the tiling as specialization constants; ``emulate``: the same tiling, loaders
    and edge handling without cooperative matrices (COOPMAT_EMULATE: any device with f16
    arithmetic runs it; how lavapipe tests the coopmat logic). Raises KernelError for a tiling
    the kernel cannot run."""
    if (min(tile.bm, tile.bn, tile.bk, tile.wm, tile.wn) < 16 or tile.bm % tile.wm or tile.bn % tile.wn
            or tile.wm % 16 or tile.wn % 16 or tile.bk % 16 or tile.stages not in (1, 2)):
        raise KernelError(f"coopmat tiling {tile.name}: BM and BN must be multiples of the subgroup block "
                          "WM x WN, WM, WN and BK multiples of 16 (the fragments), stages 1 or 2")
    defines = {"WTYPE": str(TYPES[t].id)}
    spec = {"NT": tile.threads, "BM": tile.bm, "BN": tile.bn, "BK": tile.bk, "WM": tile.wm, "WN": tile.wn,
            "STAGES": tile.stages}
    shape = {"module": coop_module_name(t, emulate), "spec": spec, "spec_ids": COOP_SPEC_IDS,
             "local_size_spec": "NT", "local_size": (tile.threads, 1, 1)}
    if emulate:
        return Variant(name=name, source="mul_mat_coopmat.comp", defines={**defines, "COOPMAT_EMULATE": "1"},
                       bindings=3, writes=(2,), push=PUSH_COOP, requires=("shaderFloat16", *_STORAGE), **shape)
    return Variant(name=name, source="mul_mat_coopmat.comp", defines=defines, bindings=3, writes=(2,),
                   push=PUSH_COOP, target_env="vulkan1.3", compiler="glslang",
                   subgroup_size=COOP_SUBGROUP, requires=_COOP_REQUIRES, **shape)


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
#: types whose coopmat path takes mul_mat_cm2: every type (Q4_K / Q5_K read their block header
#: with one 16-byte load and unpack scales and mins branch-free, as ggml-vulkan does)
CM2_TYPES = frozenset(TYPES)
_CM2_FLOAT = ("w128x128_k64_n256", "w128x256_k64_n256")
_CM2_QUANT32 = ("w128x128_k64_n256", "w64x128_k64_n128", "w64x256_k64_n256")
#: the mul_mat_cm2 tilings that ship per type: the ones DeviceKernels.cm2 weighs (their measured
#: speeds: ops/choose.py's CM2_TILE_EFF; docs/PERFORMANCE.md, "Prefill kernels";
#: tools/bench_coopmat.py --cm2)
CM2_CHOICES: dict[str, tuple[str, ...]] = {
    **{t: _CM2_FLOAT for t in ("f32", "f16", "bf16")},
    **{t: _CM2_QUANT32 for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")},
    "q6_k": ("w128x128_k64_n256", "w128x256_k64_n256", "w64x256_k64_n256"),
    "q4_k": (CM2_DEFAULT, "w64x256_k64_n256"), "q5_k": (CM2_DEFAULT, "w64x256_k64_n256"),
    # not yet measured: the nearest measured type's tilings (Q6_K's super-block of 16-element
    # scales, Q4_0's 32-element block, Q4_K's super-block of 32-element scales)
    **{t: ("w128x128_k64_n256", "w128x256_k64_n256", "w64x256_k64_n256") for t in ("q2_k", "q3_k")},
    "iq4_nl": _CM2_QUANT32, "iq4_xs": (CM2_DEFAULT, "w64x256_k64_n256"),
}

_CM2_REQUIRES = ("cooperativeMatrix", "cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                 "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads", "bufferDeviceAddress",
                 "shaderFloat16", "vulkanMemoryModel", *_STORAGE)


def cm2_variant_name(t: str, tile: str = CM2_DEFAULT) -> str:
    """mul_mat_cm2_<type>_f32_<tile>."""
    return f"mul_mat_cm2_{t}_f32_{tile}"


#: mul_mat_cm2.comp's specialization constants (its ``layout(constant_id = N)``; NT is also the
#: workgroup size, ``local_size_x_id = 0``)
CM2_SPEC_IDS = {"NT": 0, "BW": 1, "BX": 2, "BK": 3}


def cm2_module_name(t: str) -> str:
    """The SPIR-V module every mul_mat_cm2 tiling of weight type ``t`` specializes: mod_mul_mat_cm2_<type>."""
    return f"mod_mul_mat_cm2_{t}"


def make_cm2_variant(t: str, tile: Cm2Tile) -> Variant:
    """The Variant of mul_mat_cm2 for weight type ``t`` with ``tile`` (compiled by glslang15): the
    type's module with the tiling as specialization constants. Raises KernelError for sizes
    that are not positive multiples of 16 (the matrices' granularity) or a K slice that does not
    divide the fast path's 256-element steps."""
    if min(tile.bw, tile.bx, tile.bk, tile.threads) < 16 or tile.bw % 16 or tile.bx % 16 or 256 % tile.bk:
        raise KernelError(f"mul_mat_cm2 tiling {tile.name}: BW and BX must be multiples of 16 and BK a divisor "
                          "of 256 (and a multiple of 16)")
    return Variant(name=cm2_variant_name(t, tile.name), source="mul_mat_cm2.comp",
                   defines={"WTYPE": str(TYPES[t].id)}, module=cm2_module_name(t),
                   spec={"NT": tile.threads, "BW": tile.bw, "BX": tile.bx, "BK": tile.bk}, spec_ids=CM2_SPEC_IDS,
                   local_size_spec="NT", bindings=3, writes=(2,), push=PUSH_COOP, local_size=(tile.threads, 1, 1),
                   target_env="vulkan1.3", compiler="glslang15", requires=_CM2_REQUIRES)
