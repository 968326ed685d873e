"""Experiment kernels: the shader variants benchmarks and tests use that no default path of
vkxsplit chooses, so they do not ship in ``vkxsplit/spv``.

- mat-vec sweep shapes (``VEC_SWEEP``: M = 1, ``shaders/mul_mat_vec.comp``), the wide mat-vec
  (``VEC_WIDE``, ``shaders/mul_mat_vec_wide.comp``), integer-dot-product shapes (``VECQ_SWEEP``,
  with the feature-free ``_emu`` ones and M = 4 ones): tools/bench_matvec.py, tests/test_mul_mat.py
- cooperative-matrix tilings (``COOP_SWEEP_TILES`` for ``COOP_SWEEP_TYPES``, ``CM2_SWEEP_TILES``)
  and the emulated coopmat variants (``COOP_EMU_*``: the coopmat logic without cooperative
  matrices, which lavapipe runs): tools/bench_coopmat.py, tests
- ``cm2_decode_check_<type>`` (mul_mat_cm2's decode formulas from an ordinary binding: tests)
- probes (tools/probes.py) and flag waits (tools/flags.py)

Each table holds the shipped shapes of its family too (a sweep compares against the default);
:data:`VARIANTS` is what is not shipped. They are compiled on demand with vkxsplit's build step
(:func:`vkxsplit.shaders.build_into`) into ``build/tool-spv`` (git-ignored; env
``VKXSPLIT_TOOL_SPV`` overrides it), incrementally (a variant is rebuilt when its source, an
include or its defines change), and loaded by name after the shipped kernels
(:func:`vkxsplit.shaders.add_kernel_dir`). A sweep shape of a source whose shapes are
specialization constants (``mul_mat_vec.comp``, ``mul_mat_vecq.comp``, ``mul_mat_coopmat.comp``,
``mul_mat_cm2.comp``) names the module of its type and code path; where that module ships, the
shape differs only in spec values: it compiles nothing and its manifest entry points at the
shipped SPIR-V (``build_into(reuse_shipped=True)``), and tilings of one emulated or swept
module compile that module once. :func:`ensure` does both and returns the names
available: where a compiler is missing (a GPU machine without one; glslang15 for the
VK_NV_cooperative_matrix2 ones), only what was built before (and is still fresh) is there.

    python tools/build_tool_shaders.py [--only REGEX] [--force]   # build ahead (then carry build/tool-spv)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "tools")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import flags  # noqa: E402
import probes  # noqa: E402

from vkxsplit import shaders  # noqa: E402
from vkxsplit.ops import attention as attn  # noqa: E402
from vkxsplit.ops import moe  # noqa: E402
from vkxsplit.ops import mul_mat as mm  # noqa: E402
from vkxsplit.ops.mul_mat import Cm2Tile, CoopTile, VecConfig, VecqConfig  # noqa: E402
from vkxsplit.ops.quant import TYPES  # noqa: E402
from vkxsplit.shaders import Variant  # noqa: E402

OUT_DIR = Path(os.environ.get("VKXSPLIT_TOOL_SPV") or ROOT / "build" / "tool-spv")

# ------------------------------------------------------------------------------------------
# mat-vec (f32 x): M = 1 sweep shapes per type; the first of each is the CPU-device shape

_SWEEP_SHAPES: dict[str, list[VecConfig]] = {
    "q4_0": [VecConfig(32, 4, 1, 4), VecConfig(128, 4, 2, 4), VecConfig(256, 4, 2, 2), VecConfig(64, 4, 2, 2),
             VecConfig(128, 2, 2, 2), VecConfig(128, 8, 1, 2), VecConfig(128, 4, 4, 2), VecConfig(256, 2, 2, 4),
             VecConfig(128, 4, 1, 4)],
    "q8_0": [VecConfig(32, 4, 1, 4), VecConfig(128, 4, 2, 4), VecConfig(256, 4, 2, 2), VecConfig(64, 4, 2, 2),
             VecConfig(128, 2, 2, 2), VecConfig(128, 8, 1, 2), VecConfig(128, 4, 4, 2), VecConfig(256, 2, 2, 4),
             VecConfig(128, 4, 1, 4)],
    "q4_1": [VecConfig(32, 4, 1, 4), VecConfig(128, 4, 2, 4), VecConfig(256, 4, 2, 2), VecConfig(128, 2, 2, 2),
             VecConfig(128, 8, 1, 2), VecConfig(128, 4, 4, 2)],
    "q4_k": [VecConfig(32, 2, 1, 8), VecConfig(128, 4, 1, 8), VecConfig(256, 2, 1, 8), VecConfig(64, 2, 1, 8),
             VecConfig(128, 2, 2, 8), VecConfig(128, 2, 1, 4), VecConfig(128, 1, 2, 8), VecConfig(256, 4, 1, 8)],
    "q6_k": [VecConfig(32, 2, 1), VecConfig(128, 4, 1), VecConfig(256, 2, 1), VecConfig(64, 2, 1),
             VecConfig(128, 2, 2), VecConfig(128, 1, 2), VecConfig(256, 1, 2)],
    "f16": [VecConfig(64, 2, 1), VecConfig(128, 2, 2), VecConfig(256, 4, 2), VecConfig(128, 4, 4),
            VecConfig(64, 4, 2), VecConfig(128, 8, 1)],
}
#: sweep variant name -> (type, shape); names mul_mat_vec_<type>_f32_m1_<shape tag>
VEC_SWEEP: dict[str, tuple[str, VecConfig]] = {
    mm.vec_m1_name(t, c): (t, c) for t, cs in _SWEEP_SHAPES.items() for c in cs}


@dataclass(frozen=True)
class WideConfig:
    """Shape of a wide mat-vec kernel (``shaders/mul_mat_vec_wide.comp``, Q4_0 / Q8_0 rows
    that are 16-byte aligned, K % 256 == 0): ``wg`` threads per workgroup, ``nr`` rows per
    workgroup (thread t works on row t % nr, so ``wg // nr`` threads per row), ``unr`` 8-block
    groups per thread per loop iteration (each a run of 9 / 17 uvec4 loads), ``xsh``: x staged
    in shared memory (1) or read from global memory (0)."""

    wg: int
    nr: int
    unr: int = 1
    xsh: int = 0

    @property
    def tag(self) -> str:
        return f"wide_wg{self.wg}_nr{self.nr}" + (f"_u{self.unr}" if self.unr > 1 else "") + (
            "_xs" if self.xsh else "")

    @property
    def rows(self) -> int:
        return self.nr

    def defines(self) -> dict[str, str]:
        return {"WG": str(self.wg), "NR": str(self.nr), "UNR": str(self.unr), "XSH": str(self.xsh)}


WIDE_K = mm.WIDE_K
_WIDE_SHAPES = [WideConfig(128, 4), WideConfig(128, 8), WideConfig(128, 2), WideConfig(256, 8),
                WideConfig(64, 4), WideConfig(128, 4, 2), WideConfig(128, 8, 2), WideConfig(128, 8, 1, 1)]
_WIDE_M4 = WideConfig(128, 4)
#: wide variant name -> (type, shape, most columns of x); names mul_mat_vec_<type>_f32_m<1|4>_<shape tag>
VEC_WIDE: dict[str, tuple[str, WideConfig, int]] = {
    **{f"mul_mat_vec_{t}_f32_m1_{c.tag}": (t, c, 1) for t in ("q4_0", "q8_0") for c in _WIDE_SHAPES},
    **{f"mul_mat_vec_{t}_f32_m4_{_WIDE_M4.tag}": (t, _WIDE_M4, 4) for t in ("q4_0", "q8_0")},
}


def _wide_variant(name: str, t: str, cfg: WideConfig, maxm: int) -> Variant:
    return Variant(name=name, source="mul_mat_vec_wide.comp",
                   defines={"WTYPE": str(TYPES[t].id), "MAXM": str(maxm), **cfg.defines()},
                   bindings=3, writes=(2,), push=mm.PUSH, local_size=(cfg.wg, 1, 1), requires=mm._STORAGE)


# ------------------------------------------------------------------------------------------
# integer-dot-product mat-vec (x as q8_1): sweep shapes

_VECQ_SINGLE = ("q4_1", "q4_k", "q6_k")  # single-block (one super-block for the K-quants) loads only
_VECQ_SHAPES = [
    # 8-block groups (blk 8) and single blocks (blk 1), 2 to 16 threads per row
    VecqConfig(128, 4), VecqConfig(128, 8), VecqConfig(128, 2), VecqConfig(256, 8),
    VecqConfig(64, 4), VecqConfig(128, 4, unr=2), VecqConfig(128, 4, sat=1),
    VecqConfig(128, 4, blk=1), VecqConfig(128, 4, blk=1, unr=2), VecqConfig(256, 4, blk=1, unr=2),
    VecqConfig(32, 4, blk=1),
    # 64 threads per row
    VecqConfig(128, 2, blk=1, unr=2), VecqConfig(64, 2, blk=1, unr=2), VecqConfig(128, 2, blk=1, unr=4),
    # rows per thread (each x block's loads serve 2 or 4 weight rows; Q4_0 / Q8_0)
    VecqConfig(128, 2, blk=1, unr=2, rpt=2), VecqConfig(64, 2, blk=1, unr=2, rpt=2),
    VecqConfig(128, 2, blk=1, rpt=4),
    # the subgroupAdd reduction, alone and with 128 threads per row and 2 rows per thread
    VecqConfig(128, 2, blk=1, unr=2, sg=1), VecqConfig(128, 1, blk=1, unr=2, rpt=2, sg=1),
    # Q4_K: quarter super-blocks per load unit
    VecqConfig(128, 4, blk=1, sub=4), VecqConfig(128, 2, blk=1, sub=4),
    VecqConfig(128, 2, blk=1, unr=2, sub=4), VecqConfig(128, 1, blk=1, unr=2, sub=4, sg=1),
    # whole-word block loads (w5u; Q4_0 / Q8_0)
    VecqConfig(128, 1, blk=1, unr=2, rpt=2, sg=1, w5u=1), VecqConfig(128, 2, blk=1, rpt=4, w5u=1),
    # the CPU-device shape: one row per invocation
    VecqConfig(64, 64, blk=1),
    # without shaderIntegerDotProduct: the same logic with int multiply-adds
    VecqConfig(128, 4, idp=0), VecqConfig(128, 4, blk=1, idp=0)]
_VECQ_M4 = (VecqConfig(128, 4), VecqConfig(128, 4, idp=0))
#: integer-dot-product mat-vec variants, name -> (type, shape, most columns of x); names
#: mul_mat_vecq_<type>_q8_1_m<1|4>_<shape tag> (the shipped decode shapes among them)
VECQ_SWEEP: dict[str, tuple[str, VecqConfig, int]] = {
    **{mm.vecq_name(t, c): (t, c, 1) for t in mm.VECQ_TYPES for c in _VECQ_SHAPES
       if (c.blk == 1 or t not in _VECQ_SINGLE) and (c.rpt == 1 or t in ("q4_0", "q8_0"))
       and (c.sub == 1 or t == "q4_k") and (c.w5u == 0 or t in ("q4_0", "q8_0"))},
    **{mm.vecq_name(t, c, 4): (t, c, 4) for t in mm.VECQ_TYPES for c in _VECQ_M4 if t not in _VECQ_SINGLE},
}

# ------------------------------------------------------------------------------------------
# cooperative-matrix mat-mat: tilings the sweep times besides the shipped ones, and the
# emulated variants

COOP_SWEEP_TYPES = ("f16", "q4_0", "q8_0", "q4_k", "q6_k")
COOP_SWEEP_TILES = {t.name: t for t in (
    CoopTile(128, 128, 32, 32, 64),   # 8 subgroups of 2 x 4 fragments, double-buffered; 48 KiB
    CoopTile(128, 128, 32, 64, 64),   # 4 subgroups of 4 x 4 (ggml-vulkan's large tile shape)
    CoopTile(128, 256, 32, 64, 64, stages=1),  # COOP_BIG_QUANT's BN 256 twin
)}
#: every real tiling the sweep knows (shipped and not), by name
COOP_ALL_TILES = {**mm.COOP_TILES, **COOP_SWEEP_TILES}
#: emulated variants (COOPMAT_EMULATE=1: no cooperative matrices, any subgroup size):
#: mul_mat_coopmat_emu_<type>_f32 with COOP_EMU_TILE for every type, plus extra tilings for a
#: few types (BK 64 with one stage, K-quant blocks spanning steps; BK 16, tall subgroup blocks,
#: fewer weight units than threads; 16 subgroups as COOP_BIG_FLOAT). Each fits lavapipe's 32
#: KiB of shared memory.
COOP_EMU_TILE = CoopTile(64, 64, 32, 32, 32)
COOP_EMU_EXTRA = {
    CoopTile(32, 64, 64, 32, 32, stages=1): ("f16", "q4_k"),
    CoopTile(64, 32, 16, 16, 32): ("bf16", "q8_0"),
    CoopTile(64, 128, 16, 16, 32, stages=1): ("f16", "q4_0"),
}


def _coop_tables() -> tuple[dict[str, tuple[str, CoopTile]], dict[str, tuple[str, CoopTile]]]:
    """(real variants, emulated variants): name -> (type, tiling)."""
    real: dict[str, tuple[str, CoopTile]] = {}
    for t in TYPES:
        for key in dict.fromkeys((mm.COOP_CONFIG[t], mm.coop_big_tile(t))):
            real[mm.coop_variant_name(t, None if key == mm.COOP_CONFIG[t] else key)] = (t, mm.COOP_TILES[key])
    for t in COOP_SWEEP_TYPES:
        for key, tile in COOP_ALL_TILES.items():
            real[mm.coop_variant_name(t, None if key == mm.COOP_CONFIG[t] else key)] = (t, tile)
    emu = {mm.coop_variant_name(t, emulate=True): (t, COOP_EMU_TILE) for t in TYPES}
    for tile, ts in COOP_EMU_EXTRA.items():
        for t in ts:
            emu[mm.coop_variant_name(t, tile.name, emulate=True)] = (t, tile)
    return real, emu


#: mul_mat_coopmat variants (shipped and sweep) and emulated ones: name -> (type, tiling)
COOP_VARIANTS, COOP_EMU_VARIANTS = _coop_tables()

CM2_SWEEP_TYPES = COOP_SWEEP_TYPES
CM2_SWEEP_TILES = {t.name: t for t in (
    Cm2Tile(256, 128, 64),
    Cm2Tile(128, 128, 32),
    Cm2Tile(64, 64, 64, 128),
)}
CM2_ALL_TILES = {**mm.CM2_TILES, **CM2_SWEEP_TILES}
#: mul_mat_cm2 variants (shipped, and every tiling for CM2_SWEEP_TYPES): name -> (type, tiling)
CM2_VARIANTS: dict[str, tuple[str, Cm2Tile]] = {
    mm.cm2_variant_name(t, key): (t, tile) for t in TYPES for key, tile in CM2_ALL_TILES.items()
    if t in CM2_SWEEP_TYPES or key == mm.CM2_DEFAULT or key in mm.CM2_CHOICES[t]}

#: test kernels: the mul_mat_cm2 decode of every type but F16 (read as is), element by element
#: from an ordinary binding (shaders/cm2_decode_check.comp), so its formulas are checked against
#: gguf's dequantize on any device (tests/test_mul_mat_cm2.py), not only where coopmat2 runs
CM2_CHECK_VARIANTS = [
    Variant(name=f"cm2_decode_check_{t}", source="cm2_decode_check.comp", defines={"WTYPE": str(wt.id)},
            bindings=2, writes=(1,), push="I", local_size=(64, 1, 1), compiler="glslang",
            requires=("shaderFloat16", "shaderInt8", *mm._STORAGE))
    for t, wt in TYPES.items() if t != "f16"]

# ------------------------------------------------------------------------------------------
# the routed product's cooperative-matrix kernels (mul_mat_coopmat.comp with MUL_MAT_ID):
# emulated ones for every type with the shipped tiling, and one more tiling (double-buffered
# BK 32, 4 subgroups of 1 x 2 fragments) for two types (tests/test_moe.py); tilings
# tools/bench_moe.py times against the shipped one (32 pairs a tile: moe_group's)

COOP_ID_EMU_EXTRA = {CoopTile(32, 64, 32, 16, 32): ("q4_k", "f16")}
COOP_ID_SWEEP_TYPES = ("q4_k", "q4_0", "q8_0", "q6_k")
COOP_ID_SWEEP_TILES = {t.name: t for t in (
    CoopTile(32, 64, 64, 32, 32, stages=1),    # 2 subgroups: twice the workgroups of the shipped one
    CoopTile(32, 128, 32, 32, 32),             # the shipped one double-buffered at BK 32
    CoopTile(32, 256, 32, 32, 64, stages=1),   # each gathered x tile serves 256 rows of the expert
)}
#: name -> (type, tiling, emulated)
COOP_ID_VARIANTS: dict[str, tuple[str, CoopTile, bool]] = {
    **{moe.coop_id_name(t, emulate=True): (t, moe.COOP_ID_TILE, True) for t in TYPES},
    **{moe.coop_id_name(t, tile.name, emulate=True): (t, tile, True) for tile, ts in COOP_ID_EMU_EXTRA.items()
       for t in ts},
    **{moe.coop_id_name(t, key): (t, tile, False) for t in COOP_ID_SWEEP_TYPES
       for key, tile in COOP_ID_SWEEP_TILES.items()},
}

#: routed q8_1 decode shapes (mul_mat_vecq.comp with MUL_MAT_ID) tools/bench_moe.py times beside
#: the shipped one (the dense decode's shape): a Qwen3-30B-A3B expert has K = 2048 (gate, up)
#: and 768 (down), 32 and 12 quarter super-blocks of Q4_K per row, fewer than the 64 lanes per
#: row of the dense shape; these give a row 32, 16 or 8 lanes
VECQ_ID_SWEEP: dict[str, tuple[str, VecqConfig]] = {
    moe.vecq_id_name(t, c): (t, c) for t, c in (
        ("q4_k", VecqConfig(128, 4, blk=1, unr=2, sub=4)),
        ("q4_k", VecqConfig(128, 8, blk=1, unr=1, sub=4)),
        ("q4_k", VecqConfig(128, 16, blk=1, unr=1, sub=4)),
        ("q4_k", VecqConfig(128, 4, blk=1, unr=1, sub=1)),
    )}


#: the cooperative-matrix attention emulated (COOPMAT_EMULATE=1), for the tests: head_dim 64
#: with blocks of 16 and 32 positions (one and two fragments a block; lavapipe's 32 KiB of
#: shared memory holds no emulated head_dim 128): name -> (head_dim, block)
ATTN_CM_EMU: dict[str, tuple[int, int]] = {attn.attn_cm_name(64, bc, emulate=True): (64, bc) for bc in (16, 32)}


def all_declared() -> dict[str, Variant]:
    """Every variant of the tables above, probes and flag waits included (shipped ones too)."""
    vs = ([mm.make_vec_variant(n, t, c, 1) for n, (t, c) in VEC_SWEEP.items()]
          + [_wide_variant(n, t, c, mx) for n, (t, c, mx) in VEC_WIDE.items()]
          + [mm.make_vecq_variant(n, t, c, mx) for n, (t, c, mx) in VECQ_SWEEP.items()]
          + [mm.make_coop_variant(n, t, tile) for n, (t, tile) in COOP_VARIANTS.items()]
          + [mm.make_coop_variant(n, t, tile, emulate=True) for n, (t, tile) in COOP_EMU_VARIANTS.items()]
          + [mm.make_cm2_variant(t, tile) for t, tile in CM2_VARIANTS.values()]
          + [moe.make_coop_id_variant(n, t, tile, emu) for n, (t, tile, emu) in COOP_ID_VARIANTS.items()]
          + [moe.make_vecq_id_variant(n, t, c) for n, (t, c) in VECQ_ID_SWEEP.items()]
          + [attn.make_attn_cm_variant(hd, bc, emulate=True) for hd, bc in ATTN_CM_EMU.values()]
          + CM2_CHECK_VARIANTS + probes.VARIANTS + flags.VARIANTS)
    return {v.name: v for v in vs}


def tool_variants() -> dict[str, Variant]:
    """The experiment variants: those declared here that vkxsplit does not ship."""
    shipped = shaders.all_variants()
    return {n: v for n, v in all_declared().items() if n not in shipped}


def _select(select: str | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if select is None:
        return lambda n: True
    if isinstance(select, str):
        pat = re.compile(select)
        return lambda n: bool(pat.search(n))
    return select


def compiler_available(v: Variant) -> bool:
    """Whether this machine has ``v``'s compiler and spirv-val."""
    return shaders.have_tool(v.compiler) and shaders.have_tool("spirv-val")


def build(select: str | Callable[[str], bool] | None = None, out: Path = OUT_DIR, force: bool = False,
          log: Callable[[str], object] = print) -> tuple[list[str], list[str]]:
    """Compile the experiment variants ``select`` (a regex or a predicate on the name; default:
    all) names into ``out``, those whose compiler is here. Returns (built or fresh, skipped for
    a missing compiler)."""
    pick = _select(select)
    vs = {n: v for n, v in tool_variants().items() if pick(n)}
    ok = {n: v for n, v in vs.items() if compiler_available(v)}
    skipped = sorted(set(vs) - set(ok))
    # (pruned only when everything was built: a skipped variant keeps what was built before)
    shaders.build_into(ok, out, force=force, log=log, prune=select is None and not skipped, reuse_shipped=True)
    return sorted(ok), skipped


def load(select: str | Callable[[str], bool] | None = None, out: Path = OUT_DIR) -> set[str]:
    """Load ``out``'s kernels without building anything; returns the experiment variants
    ``select`` names that are built there and fresh."""
    pick = _select(select)
    vs = {n: v for n, v in tool_variants().items() if pick(n)}
    stale = {p.split(":", 1)[0] for p in shaders.check_dir(vs, out)}
    shaders.add_kernel_dir(out)
    return set(vs) - stale


def ensure(select: str | Callable[[str], bool] | None = None, out: Path = OUT_DIR,
           log: Callable[[str], object] = lambda msg: print(msg, file=sys.stderr)) -> set[str]:
    """Build what ``select`` names (default: every experiment variant) where it is missing or
    stale and its compiler is here, load ``out``'s kernels (:func:`vkxsplit.shaders.add_kernel_dir`),
    and return the names now available (shipped ones of the tables included)."""
    pick = _select(select)
    vs = {n: v for n, v in tool_variants().items() if pick(n)}
    stale = set(shaders.check_dir(vs, out))
    stale_names = {p.split(":", 1)[0] for p in stale}
    todo = {n: v for n, v in vs.items() if n in stale_names and compiler_available(v)}
    if any("older manifest format" in p for p in stale):
        # the whole directory moves to the current format at once: its SPIR-V that is still
        # fresh is kept (not recompiled), and no variant's entry is lost
        todo = {n: v for n, v in tool_variants().items() if compiler_available(v)}
    if todo:
        shaders.build_into(todo, out, log=log, reuse_shipped=True)
    shaders.add_kernel_dir(out)
    have = (set(vs) - stale_names) | set(todo)
    return have | {n for n in all_declared() if pick(n) and n in shaders.all_variants()}


__all__ = ["CM2_ALL_TILES", "CM2_CHECK_VARIANTS", "COOP_ID_EMU_EXTRA", "COOP_ID_SWEEP_TILES", "COOP_ID_SWEEP_TYPES",
           "COOP_ID_VARIANTS", "VECQ_ID_SWEEP", "ATTN_CM_EMU", "CM2_SWEEP_TILES", "CM2_SWEEP_TYPES", "CM2_VARIANTS",
           "COOP_ALL_TILES", "COOP_EMU_EXTRA", "COOP_EMU_TILE", "COOP_EMU_VARIANTS", "COOP_SWEEP_TILES",
           "COOP_SWEEP_TYPES", "COOP_VARIANTS", "OUT_DIR", "VECQ_SWEEP", "VEC_SWEEP", "VEC_WIDE", "WIDE_K",
           "WideConfig", "all_declared", "build", "compiler_available", "ensure", "load", "tool_variants"]
