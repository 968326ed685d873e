"""Probes: kernels that measure the device, not compute an op (``shaders/probe.comp``, ``shaders/probe_rows.comp``).

Not part of vkxsplit: the variants are declared here (:data:`VARIANTS`) and built on demand
with the other experiment kernels (``tools/kernels.py``: ``kernels.ensure()`` builds and loads
them; ``python tools/build_tool_shaders.py`` builds them ahead, e.g. for a machine without a
compiler).

The kernel benchmark (``tools/bench_kernels.py``) reads each kernel of the library against
what one launch of its kind can do at all on the device and driver:

- :func:`record_probe_read`: a read-only launch of ``nbytes`` (16-byte loads, several in flight
  per thread) summing the 32-bit words, one sum per workgroup: the ceiling of a mat-vec of the same
  weight bytes, which reads them and writes almost nothing.
- :func:`record_probe_mma`: cooperative-matrix multiply-adds on operands loaded once, at
  subgroup scope (``probe_mma_f16_sg``, VK_KHR_cooperative_matrix, 16 x 16 x 16) or at the
  workgroup scope and tile of ``mul_mat_cm2`` (``probe_mma_f16_wg_*``, VK_NV_cooperative_matrix2):
  the matrix units' rate as the driver issues them, without the loads of a real product.
- :func:`record_probe_read_rows`: a read-only launch laid out as a decode kernel's grid (its teams
  and rows per workgroup) with coalesced loads, one sum per row: what the grid costs a mat-vec,
  apart from the loads its block layout makes it issue (``probe_vecq_nox`` kind ``noc``).

Each produces a result the tests check against numpy (the sums of the words; ``iters`` times the
operands' product), so a probe that skipped work would fail rather than look fast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vkxsplit.errors import KernelError
from vkxsplit.ops.mul_mat import _CM2_REQUIRES, _COOP_REQUIRES, COOP_SUBGROUP
from vkxsplit.shaders import Variant
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.kernel import Bindable, Kernel, as_range

if TYPE_CHECKING:
    from vkxsplit.vk.device import Device

READ_WG = 256
READ_UNROLLS = (2, 4, 8)
#: subgroup-scope probe: fragments of A and B per subgroup (FM x FN 16 x 16 accumulators)
MMA_SG_FM, MMA_SG_FN, MMA_SG_WG = 2, 4, 128


@dataclass(frozen=True)
class MmaTile:
    """Workgroup-scope probe tile: A is ``bw`` x ``bk``, B ``bk`` x ``bx``, ``nt`` invocations."""

    bw: int
    bx: int
    bk: int
    nt: int

    @property
    def tag(self) -> str:
        return f"w{self.bw}x{self.bx}_k{self.bk}_n{self.nt}"


#: the workgroup-scope tiles probed: mul_mat_cm2's F16 default (128 x 128, K step 64) and its
#: 128 x 256 alternative (the two F16 tilings it keeps)
MMA_WG_TILES = (MmaTile(128, 128, 64, 256), MmaTile(128, 256, 64, 256))


@dataclass(frozen=True)
class RowsShape:
    """A row-wise read probe's grid (``probe_rows_*``, shaders/probe_rows.comp): ``wg`` threads in ``nr`` teams,
    ``r`` rows per team, ``u`` loads of ``v`` words per row in flight per thread."""

    v: int
    wg: int
    nr: int
    r: int
    u: int

    @property
    def tag(self) -> str:
        return f"v{self.v}_wg{self.wg}_nr{self.nr}_r{self.r}_u{self.u}"

    @property
    def rows(self) -> int:
        """Rows per workgroup and row group."""
        return self.nr * self.r


#: the read-only launch in the grids of the Q4_0 decode shapes (``b1_wg128_nr1_u2_r2_sg_w5u``: 128
#: threads on 2 rows; the tall ``b1_wg128_nr2_r4_w5u``: 2 teams of 64 on 4 rows each), with
#: 16-byte and 32-bit coalesced loads
ROWS_SHAPES = (RowsShape(4, 128, 1, 2, 2), RowsShape(1, 128, 1, 2, 8), RowsShape(4, 128, 2, 4, 2))

#: decode kernels without their x loads (``probe_vecq_nox_<vecq variant>``, PROBE_NOX in
#: shaders/mul_mat_vecq.comp): the GPU default shapes of Q4_0 and Q8_0 (RPT > 1), timed beside
#: the real kernel, say what reading x costs a mat-vec
NOX_BASES = ("mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr1_u2_r2_sg_w5u", "mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr2_r4_w5u",
             "mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr2_u2_r2", "mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr1_u2_r2_sg")


#: the two cuts of a decode kernel: ``nox`` leaves out its x loads (y = the rows' weight sums),
#: ``noc`` leaves out x and the dot products too (the weights' loads alone; y = per row, the sum
#: over blocks of the xor of the block's quant bytes and the 4 bytes of its scale as f32)
NOX_KINDS = {"nox": "1", "noc": "2"}


def nox_name(base: str, kind: str = "nox") -> str:
    """The no-x (``nox``) or loads-only (``noc``) probe of vecq variant ``base``."""
    return base.replace("mul_mat_vecq_", f"probe_vecq_{kind}_", 1)


def _nox_variant(base: str, kind: str) -> Variant:
    from vkxsplit.ops.mul_mat import make_vecq_variant, vecq_spec

    spec = vecq_spec(base)  # (the bases are shipped decode shapes)
    assert spec is not None, base
    t, cfg, maxm = spec
    v = make_vecq_variant(nox_name(base, kind), t, cfg, maxm)
    return replace(v, defines={**v.defines, "PROBE_NOX": NOX_KINDS[kind]},
                   module=v.module_name.replace("mod_mul_mat_vecq_", f"mod_probe_vecq_{kind}_", 1))


VARIANTS = [
    *[Variant(name=f"probe_read_u{u}", source="probe.comp", defines={"PROBE": "1", "WG": str(READ_WG), "U": str(u)},
              bindings=2, writes=(1,), push="II", local_size=(READ_WG, 1, 1)) for u in READ_UNROLLS],
    Variant(name="probe_mma_f16_sg", source="probe.comp",
            defines={"PROBE": "2", "WG": str(MMA_SG_WG), "FM": str(MMA_SG_FM), "FN": str(MMA_SG_FN)},
            bindings=3, writes=(2,), push="I", local_size=(MMA_SG_WG, 1, 1), target_env="vulkan1.3",
            compiler="glslang", subgroup_size=COOP_SUBGROUP, requires=_COOP_REQUIRES),
    *[Variant(name=f"probe_mma_f16_wg_{t.tag}", source="probe.comp",
              defines={"PROBE": "3", "WG": str(t.nt), "BW": str(t.bw), "BX": str(t.bx), "BK": str(t.bk)},
              bindings=3, writes=(2,), push="I", local_size=(t.nt, 1, 1), target_env="vulkan1.3",
              compiler="glslang15", requires=_CM2_REQUIRES) for t in MMA_WG_TILES],
    *[_nox_variant(b, k) for b in NOX_BASES for k in NOX_KINDS],
    *[Variant(name=f"probe_rows_{t.tag}", source="probe_rows.comp",
              defines={"WG": str(t.wg), "V": str(t.v), "NR": str(t.nr), "R": str(t.r), "U": str(t.u)},
              bindings=2, writes=(1,), push="II", local_size=(t.wg, 1, 1)) for t in ROWS_SHAPES],
]


def read_groups(device: Device, nbytes: int, unroll: int) -> int:
    """Workgroups for one pass (each thread loads ``unroll`` uvec4 once), at most the device's
    limit."""
    limit = device.physical.limits["maxComputeWorkGroupCount"][0]
    return max(1, min(limit, -(-(nbytes // 16) // (READ_WG * unroll))))


def record_probe_read(seq: Sequence, src: Bindable, out: Bindable, nbytes: int, unroll: int = 4,
                      groups: int | None = None, passes: int = 1) -> None:
    """Sum the 32-bit words of ``src[:nbytes]`` (a multiple of 16), wrapping, one word per
    workgroup: ``out[w]`` for workgroup ``w`` of ``groups`` (default: one pass,
    :func:`read_groups`); ``unroll`` 16-byte loads per thread in flight. ``passes`` > 1: the grid
    reads the buffer that many times, each workgroup another one's part each pass (each word
    counted as often): a buffer that fits in the L2 then measures the L2's read rate."""
    if not 1 <= passes < 1 << 16:
        raise KernelError(f"probe_read: {passes} passes is outside 1..65535")
    if unroll not in READ_UNROLLS:
        raise KernelError(f"probe_read: unroll {unroll} is not one of {READ_UNROLLS}")
    g = read_groups(seq.device, nbytes, unroll) if groups is None else groups
    if g < 1 or nbytes // 16 + g * READ_WG * unroll > 1 << 32:
        # (the shader's uvec4 indices run up to n + one grid's chunk: past 2^32 they would wrap)
        raise KernelError(f"probe_read: {nbytes} bytes on {g} workgroups: the uvec4 indices would pass 2^32 "
                          "(or no workgroups); read it in parts")
    _, off, size, _ = as_range(src)
    if nbytes <= 0 or nbytes % 16 or off % 16 or size < nbytes:
        raise KernelError(f"probe_read: {nbytes} bytes must be a positive multiple of 16 within a "
                          f"16-byte aligned binding of {size} bytes")
    _, ooff, osize, _ = as_range(out)
    if ooff % 4 or osize < 4 * g:
        raise KernelError(f"probe_read: the out binding must hold {g} aligned 32-bit words (one per workgroup)")
    seq.dispatch(Kernel.get(seq.device, f"probe_read_u{unroll}"), [src, out], (nbytes // 16, passes), g)


def mma_variant(tile: MmaTile | None) -> str:
    """The probe's variant name: subgroup scope for ``None``, else the workgroup-scope tile's."""
    return "probe_mma_f16_sg" if tile is None else f"probe_mma_f16_wg_{tile.tag}"


def mma_shapes(tile: MmaTile | None) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(A elements as (rows, cols), B as (rows, cols), output floats per workgroup) of the probe:
    subgroup scope stacks its FM A and FN B fragments (each 16 x 16, row-major) along rows."""
    if tile is None:
        return (16 * MMA_SG_FM, 16), (16 * MMA_SG_FN, 16), (MMA_SG_WG // COOP_SUBGROUP) * MMA_SG_FM * MMA_SG_FN * 256
    return (tile.bw, tile.bk), (tile.bk, tile.bx), tile.bw * tile.bx


def mma_flops(tile: MmaTile | None, groups: int, iters: int) -> int:
    """Floating-point operations (2 per multiply-add) of one probe dispatch."""
    if tile is None:
        per_group = (MMA_SG_WG // COOP_SUBGROUP) * MMA_SG_FM * MMA_SG_FN * 2 * 16 ** 3
    else:
        per_group = 2 * tile.bw * tile.bx * tile.bk
    return per_group * groups * iters


def mma_supported(device: Device, tile: MmaTile | None = None) -> bool:
    """Whether ``device`` runs the probe: the subgroup-scope kernels' requirements
    (``coopmat_supported``) or, for a workgroup-scope tile, mul_mat_cm2's and a flexible shape
    of the tile's invocations."""
    from vkxsplit.ops import mul_mat as mm

    if tile is None:
        return mm.coopmat_supported(device)
    return mm.coopmat2_supported(device) and mm.cm2_tile_supported(
        device, mm.Cm2Tile(tile.bw, tile.bx, tile.bk, tile.nt))


def record_probe_mma(seq: Sequence, a: Bindable, b: Bindable, out: Bindable, iters: int, groups: int,
                     tile: MmaTile | None = None) -> None:
    """``iters`` rounds of multiply-adds on the f16 operands ``a`` and ``b`` (shapes from
    :func:`mma_shapes`) on ``groups`` workgroups; each workgroup stores its f32 accumulators
    (``iters`` times the products) at its slot of ``out``. ``tile`` None: subgroup scope."""
    name = mma_variant(tile)
    if tile is not None and tile not in MMA_WG_TILES:
        raise KernelError(f"probe_mma: tile {tile.tag} is not one of {[t.tag for t in MMA_WG_TILES]}")
    if not 0 < iters < 1 << 31 or groups < 1:
        raise KernelError(f"{name}: iters {iters} must be in 1..2^31-1 and groups {groups} positive")
    (ar, ac), (br, bc), per = mma_shapes(tile)
    for what, buf, need in (("a", a, 2 * ar * ac), ("b", b, 2 * br * bc), ("out", out, 4 * per * groups)):
        _, off, size, _ = as_range(buf)
        if off % 16 or size < need:
            raise KernelError(f"{name}: the {what} binding must hold {need} bytes, 16-byte aligned "
                              f"(has {size} at offset {off})")
    seq.dispatch(Kernel.get(seq.device, name), [a, b, out], (iters,), groups)


def rows_groups(device: Device, rows: int, shape: RowsShape) -> int:
    """Workgroups giving each of ``rows`` / shape.rows row groups its own, at most the device's limit."""
    return max(1, min(device.physical.limits["maxComputeWorkGroupCount"][0], -(-rows // shape.rows)))


def record_probe_read_rows(seq: Sequence, src: Bindable, out: Bindable, rows: int, row_bytes: int,
                           shape: RowsShape, groups: int | None = None) -> None:
    """Sum each of ``rows`` rows of ``row_bytes`` bytes of ``src`` as 32-bit words (wrapping) into
    ``out[row]``, read in ``shape``'s grid (``probe_rows_*``): a read-only launch laid out as a
    decode kernel. ``groups`` workgroups (default :func:`rows_groups`: one per row group; fewer
    loop over the row groups)."""
    if shape not in ROWS_SHAPES:
        raise KernelError(f"probe_read_rows: shape {shape.tag} is not one of {[t.tag for t in ROWS_SHAPES]}")
    if rows < 1 or row_bytes < 1 or row_bytes % (4 * shape.v):
        raise KernelError(f"probe_read_rows: {rows} rows of {row_bytes} bytes: rows must be positive and "
                          f"each a positive multiple of {4 * shape.v} bytes (shape {shape.tag})")
    if rows * (row_bytes // (4 * shape.v)) >= 1 << 32:
        raise KernelError(f"probe_read_rows: {rows} rows of {row_bytes} bytes: the unit indices would pass 2^32")
    g = rows_groups(seq.device, rows, shape) if groups is None else groups
    if g < 1:
        raise KernelError("probe_read_rows: at least one workgroup")
    _, off, size, _ = as_range(src)
    if off % 16 or size < rows * row_bytes:
        raise KernelError(f"probe_read_rows: the src binding must hold {rows * row_bytes} bytes, 16-byte aligned")
    _, ooff, osize, _ = as_range(out)
    if ooff % 4 or osize < 4 * rows:
        raise KernelError(f"probe_read_rows: the out binding must hold {rows} aligned 32-bit words (one per row)")
    seq.dispatch(Kernel.get(seq.device, f"probe_rows_{shape.tag}"), [src, out], (rows, row_bytes // 4), g)


def record_probe_vecq_nox(seq: Sequence, w: Bindable, w_type: str, scratch: Bindable, y: Bindable, N: int, K: int,
                          base: str, kind: str = "nox") -> None:
    """The decode kernel ``base`` (one of NOX_BASES) on ``N`` x ``K`` weights ``w`` without its x
    loads (``kind`` ``nox``: ``y[n]`` = the sum of row n's weights, every x element 1) or without
    x and its dot products (``noc``: see NOX_KINDS). ``scratch`` is bound where the real kernel
    reads x (unread). Raises KernelError for another base, type or kind."""
    from vkxsplit.ops.mul_mat import _grid, check_mul_mat, vecq_spec
    from vkxsplit.ops.quant import row_bytes, weight_type

    if kind not in NOX_KINDS:
        raise KernelError(f"probe_vecq_nox: kind {kind!r} is not one of {tuple(NOX_KINDS)}")
    spec = vecq_spec(base)
    if base not in NOX_BASES or spec is None or spec[0] != w_type:
        raise KernelError(f"probe_vecq_nox: {base!r} is not one of {NOX_BASES} for {w_type} weights")
    wt = weight_type(w_type)
    check_mul_mat(wt, 1, N, K, path="vec")
    wneed = N * row_bytes(w_type, K)
    if spec[1].w5u:  # whole-word loads: the last row's trailing word too
        wneed = -(-wneed // 4) * 4
    for what, buf, need in (("w", w, wneed), ("y", y, 4 * N)):
        _, off, size, _ = as_range(buf)
        if off % 16 or size < need:
            raise KernelError(f"probe_vecq_nox: the {what} binding must hold {need} bytes, 16-byte aligned")
    gx, gy, _ = _grid("vec", wt, 1, N, base)
    seq.dispatch(Kernel.get(seq.device, nox_name(base, kind)), [w, scratch, y], (1, N, K, K, N, 0, 0, 0, 0, 0), (gx, gy, 1))


__all__ = ["MMA_WG_TILES", "NOX_BASES", "ROWS_SHAPES", "RowsShape", "record_probe_read_rows", "rows_groups",
           "NOX_KINDS", "nox_name", "record_probe_vecq_nox", "MmaTile", "READ_UNROLLS", "mma_flops", "mma_shapes",
           "mma_supported", "mma_variant", "read_groups", "record_probe_mma", "record_probe_read", "VARIANTS"]
