"""Mixture-of-experts ops on the hub: the routed expert product, the router and the combine.

- ``mul_mat_id`` (ggml's ``ggml_mul_mat_id``): ``y[t, s, :] = W[ids[t, s]] @ x[t, s if n_xb > 1
  else 0, :]`` for ``ids`` int32 ``(T, n_used)``, ``x`` f32 ``(T, n_xb, K)`` (``n_xb`` 1: every
  slot reads the token's one row, as the gate/up products; ``n_used``: each slot its own, as
  the down product), ``W`` the stored ``(n_expert, N, K)`` tensor in any hub weight type
  (:data:`vkxsplit.ops.quant.TYPES`, raw GGUF bytes), ``y`` f32 ``(T, n_used, N)``.
  ``shaders/mul_mat_id.comp`` dequantizes through ``shaders/dequant.glsl``'s ``dq4``/``dq1``, so a
  type declared there and in ``TYPES`` works here too. Decode (T = 1), and batches of fewer
  than :data:`GROUPED_PAIRS_PER_EXPERT` pairs per expert on average: a mat-vec over N x
  pairs that reads only the selected experts' rows, once per pair (the mat-vec units of
  ``dequant.glsl``). Larger batches (prefill): the (token, slot) pairs are first grouped by
  expert on the GPU (``shaders/moe_group.comp``: counts, offsets,
  a row map and a tile list, :func:`record_moe_group`), then a tiled mat-mat runs per tile of
  at most 32 pairs of one expert, so an expert's rows are read once per 32 pairs routed to
  it rather than once per token (the grid: ceil(N / 64) x (P / 32 + n_expert + 2) workgroups
  for P = T * n_used pairs, the unused tiles exiting at once). Where the device has the
  cooperative-matrix path (:meth:`~vkxsplit.ops.choose.DeviceKernels.coopmat_available`, as
  the dense products' ``coopmat`` path) the tiles run ``mul_mat_id_coopmat_<type>_f32``
  instead (``shaders/mul_mat_coopmat.comp`` with ``MUL_MAT_ID``, ggml-vulkan's ``mul_mm`` id
  variant: the tile's x rows gathered through the grouping's row map, the expert's W rows
  dequantized to f16, f16 16x16x16 matrices accumulating in f32, the output fragments
  scattered to the pairs' rows; :data:`COOP_ID_TILE`); elsewhere the f32 tiles of
  ``mul_mat_id.comp`` (``path="tiled"``). The decode mat-vec (T = 1), where the dense decode takes
  the integer-dot-product kernel for the type (:meth:`~vkxsplit.ops.choose.DeviceKernels.vecq`:
  Q4_0, Q4_1, Q8_0, Q4_K on GPUs, and Q6_K on CPU devices), quantizes x to q8_1 blocks first
  (``quantize_q8_1``, into a scratch of the device) and runs ``mul_mat_id_vecq_<type>_q8_1_*``
  (``shaders/mul_mat_vecq.comp`` with ``MUL_MAT_ID``: the dense decode kernel's shape for the
  type, one workgroup row per (token, slot) pair, the rows of its expert); else the f32-x
  mat-vec of ``mul_mat_id.comp`` (``path="vec_f32"``). In a model's decode graph the q8_1 x
  comes from x's producer instead (the q8_1 pass of :mod:`vkxsplit.fusion`: the FFN norm for
  gate/up, the MoE SwiGLU for down; node params ``xq``, ``vecq``), and the node records the
  kernel alone (``quantize=False``).
- ``moe_topk``: per token, softmax (or sigmoid) over the router logits, the ``n_used`` best
  experts (ties to the lower expert index: a stable descending sort), their probabilities
  as weights, normalised to sum 1 (clamped as llama.cpp: ``/ max(sum, 6.103515625e-5)``) when
  asked, times a scale.
- ``moe_combine``: ``y[t] = sum_s w[t, s] * e[t, s, :]``.

SwiGLU over the ``(T, n_used, n_ff)`` gate/up outputs is the ordinary ``swiglu`` op over
``T * n_used`` rows (:func:`vkxsplit.ops.elementwise.record_swiglu`).

An id outside ``[0, n_expert)`` cannot come from ``moe_topk`` (it writes -1 only for a token
whose probabilities are all NaN); ``mul_mat_id`` writes NaN rows for such an id, so the model
reports non-finite logits instead of decoding from a wrong expert or reading out of bounds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import KernelError
from ..shaders import Variant, variant_meta
from ..vk.kernel import Bindable, Kernel, as_range, bindings_overlap
from .choose import kernels_for
from .mul_mat import MAX_GROUPS as _MAX_GRID
from .mul_mat import _Scratch, check_q8_1_scratch, record_quantize_q8_1, vecq_scratch_bytes
from .mul_mat_kernels import (
    VECQ_GPU_TYPES,
    VECQ_TYPES,
    CoopTile,
    VecqConfig,
    coop_module_name,
    make_coop_variant,
    make_vecq_variant,
    vecq_default_config,
    vecq_module_name,
    vecq_spec,
)
from .quant import TYPES, TypeLike, WeightType, weight_type

if TYPE_CHECKING:
    from ..graph import Node, Tensor
    from ..vk.command import Sequence

_STORAGE = ("storageBuffer16BitAccess", "storageBuffer8BitAccess")
PUSH_ID = "I" * 10   # N, K, n_used, n_xb, n_expert, T, w_rows, w_row0, y_stride, flags
VEC_NR = 8           # rows per workgroup of the decode path (mul_mat_id.comp, flags bit 1)
FLAG_VEC = 2
TILE_BM = 32         # pairs per tile (mul_mat_id.comp, VEC = 0)
TILE_BN = 64         # weight rows per tile
MAX_EXPERTS = 512    # moe_group.comp's MAXE
MAX_GROUPS = 65535
GATING = {"softmax": 1, "sigmoid": 2}
#: ``{arch}.expert_gating_func`` values (llama.cpp's ``llama_expert_gating_func_type``)
GATING_BY_ID = {1: "softmax", 2: "sigmoid"}
NORM_CLAMP = 6.103515625e-5  # llama.cpp clamps the sum of the selected weights to this


def kernel_name(t: str) -> str:
    """The routed product of weight type ``t`` (the mat-vec and the f32 tiles: one module)."""
    return f"mul_mat_id_{t}_f32"


#: the grouped product's cooperative-matrix tiling: 32 pairs (moe_group.comp's tile) x 128
#: rows of the expert, BK 64, 4 subgroups of 2 x 2 fragments, one stage (27 KiB of shared
#: memory). At T = 512 a Qwen3-30B-A3B layer routes 32 pairs to an expert on average, so a
#: taller pair tile would mostly hold empty rows. (Other tilings: tools/kernels.py's
#: COOP_ID_SWEEP, timed by tools/bench_moe.py.)
COOP_ID_TILE = CoopTile(TILE_BM, 128, 64, 32, 32, stages=1)
GROUPED_PATHS = ("grouped", "tiled", "coopmat")   # grouped: the device's choice of the other two
VEC_PATHS = ("vec", "vec_f32", "vec_q8_1")         # vec: the device's choice of the other two


def vecq_id_config(t: str, cpu: bool) -> VecqConfig:
    """The routed decode shape of ``t`` weights: the dense decode's (ops.mul_mat_kernels.
    vecq_default_config) without whole-word block loads (w5u: the last row's trailing word
    unchecked, which the dense path guards per binding with a second shipped variant)."""
    return replace(vecq_default_config(t, cpu), w5u=0)


def vecq_id_name(t: str, cfg: VecqConfig) -> str:
    """mul_mat_id_vecq_<type>_q8_1_<shape tag>."""
    return f"mul_mat_id_vecq_{t}_q8_1_{cfg.tag}"


def make_vecq_id_variant(name: str, t: str, cfg: VecqConfig) -> Variant:
    """The routed decode kernel of ``t`` weights with shape ``cfg``: the dense integer-dot-
    product mat-vec (one x column) with ``MUL_MAT_ID``: four bindings (W, q8_1 x, y, ids) and
    mul_mat_id's push constants."""
    v = make_vecq_variant(name, t, cfg, 1)
    return replace(v, defines={**v.defines, "MUL_MAT_ID": "1"}, module=vecq_module_name(t, cfg, routed=True),
                   bindings=4, push=PUSH_ID)


def _vecq_id_shipped() -> dict[str, tuple[str, VecqConfig]]:
    """The routed decode shapes a default choice can name: per type the CPU devices' and, for
    the types GPUs take, the GPUs' (as ops.choose.DeviceKernels.vecq_decode)."""
    out = {}
    for t in VECQ_TYPES:
        for cpu in (True, False) if t in VECQ_GPU_TYPES else (True,):
            cfg = vecq_id_config(t, cpu)
            out[vecq_id_name(t, cfg)] = (t, cfg)
    return out


def vec_path(device: object, t: str, T: int = 1) -> str:
    """The routed mat-vec's kernel on ``device`` for ``T`` tokens of ``t`` weights: as the dense
    products choose (:meth:`~vkxsplit.ops.choose.DeviceKernels.vecq`), ``vec_q8_1`` for the
    decode (T = 1) where the dense decode takes the integer-dot-product kernel for the type,
    else ``vec_f32`` (several tokens: x stays f32, as the dense mat-vec of M <= 8 keeps it)."""
    return "vec_q8_1" if T == 1 and kernels_for(device).vecq(t, 1) is not None else "vec_f32"


def vecq_id_decode(device: object) -> dict[str, str]:
    """weight type -> the routed decode kernel (``mul_mat_id_vecq_*``) a decode graph's
    ``mul_mat_id`` of that type runs on ``device``: the types whose routed decode takes the
    q8_1 path (:func:`vec_path` at T = 1). The q8_1 pass of :mod:`vkxsplit.fusion` gives such
    a node the q8_1 x its producer writes (params ``xq``, ``vecq``)."""
    kc = kernels_for(device)
    return {t: vecq_id_name(t, vecq_id_config(t, kc.is_cpu)) for t in kc.vecq_decode()
            if vec_path(device, t, 1) == "vec_q8_1"}


def coop_id_name(t: str, tile: str | None = None, emulate: bool = False) -> str:
    """mul_mat_id_coopmat[_emu]_<type>_f32[_<tile>] (no tile: COOP_ID_TILE)."""
    return f"mul_mat_id_coopmat{'_emu' if emulate else ''}_{t}_f32" + (f"_{tile}" if tile else "")


def make_coop_id_variant(name: str, t: str, tile: CoopTile, emulate: bool = False) -> Variant:
    """The routed product's cooperative-matrix kernel of weight type ``t``: the dense
    mul_mat_coopmat variant of ``tile`` (``emulate``: COOPMAT_EMULATE, for tests on devices
    without cooperative matrices) with ``MUL_MAT_ID``: four bindings (W, x, y, the grouping)
    and mul_mat_id's push constants."""
    if tile.bm != TILE_BM:
        raise KernelError(f"{name}: the routed product's tiles hold {TILE_BM} pairs (moe_group's), not {tile.bm}")
    v = make_coop_variant(name, t, tile, emulate)
    return replace(v, defines={**v.defines, "MUL_MAT_ID": "1"}, module=coop_module_name(t, emulate, routed=True),
                   bindings=4, push=PUSH_ID)


def _coop_id_tile(name: str, t: str) -> CoopTile:
    """The tiling of built routed cooperative-matrix variant ``name`` for ``t`` weights;
    KernelError for any other kernel."""
    meta = variant_meta(name)
    d = (meta or {}).get("defines") or {}
    if (meta is None or meta.get("source") != "mul_mat_coopmat.comp" or d.get("MUL_MAT_ID") != "1"
            or d.get("WTYPE") != str(TYPES[t].id)):
        raise KernelError(f"{name!r} is not a built routed cooperative-matrix kernel for {t.upper()} weights",
                          f"the shipped one is {coop_id_name(t)}; emulated and sweep variants: tools/kernels.py")
    return CoopTile.from_defines(d)


VARIANTS = (
    [Variant(name=kernel_name(t), source="mul_mat_id.comp", defines={"WTYPE": str(wt.id)},
             bindings=4, writes=(3,), push=PUSH_ID, local_size=(256, 1, 1), requires=_STORAGE)
     for t, wt in TYPES.items()]
    + [make_coop_id_variant(coop_id_name(t), t, COOP_ID_TILE) for t in TYPES]
    + [make_vecq_id_variant(n, t, cfg) for n, (t, cfg) in _vecq_id_shipped().items()]
    + [Variant(name="moe_group", source="moe_group.comp", defines={"MAXE": f"{MAX_EXPERTS}u"}, bindings=2,
               writes=(1,), push="III", local_size=(256, 1, 1))]
    + [Variant(name=f"moe_topk_{g}", source="moe_topk.comp", defines={"GATING": str(code), "MAXE": f"{MAX_EXPERTS}u"},
               bindings=3, writes=(1, 2), push="IIIIIf", local_size=(32, 1, 1)) for g, code in GATING.items()]
    + [Variant(name="moe_combine_f32", source="moe_combine.comp", bindings=3, writes=(2,), push="III",
               local_size=(256, 1, 1))]
)


#: the grouped path from this many (token, slot) pairs per expert on average: below it each
#: expert meets few pairs, and one mat-vec pass per pair (which reads an expert once per pair
#: routed to it, about once per touched expert there) beat the tiles on the H200 (gate + down
#: of a Qwen3-30B-A3B layer, Q4_K: 1.5 ms vs 2.6 ms at T = 64, 2.9 vs 2.8 at T = 128, 5.9 vs
#: 3.0 at T = 256; tools/bench_moe.py). Measured against the f32 tiles; the cooperative-matrix
#: tiles, several times faster per tile, may move the crossover lower (tools/bench_moe.py
#: prints both paths by T, the default marked).
GROUPED_PAIRS_PER_EXPERT = 8


def use_grouped(T: int, n_used: int, n_expert: int) -> bool:
    """Whether a routed product of ``T`` tokens takes the grouped (tiled) path by default."""
    return T > 1 and T * n_used >= GROUPED_PAIRS_PER_EXPERT * n_expert


def default_path(device: object, t: str, T: int, n_used: int, n_expert: int) -> str:
    """The kernel a routed product of ``T`` tokens of ``t`` weights takes by default on
    ``device`` (:func:`record_mul_mat_id` without ``path``): the grouped tiles from
    GROUPED_PAIRS_PER_EXPERT pairs per expert (:func:`grouped_path`), else the mat-vec
    (:func:`vec_path`)."""
    return grouped_path(device) if use_grouped(T, n_used, n_expert) else vec_path(device, t, T)


def grouped_path(device: object) -> str:
    """The grouped product's kernel on ``device``: ``coopmat`` where the dense products have
    the cooperative-matrix path (available and not switched off), else ``tiled``."""
    return "coopmat" if kernels_for(device).coopmat_available else "tiled"


def max_tiles(P: int, n_expert: int) -> int:
    """Tiles of the grouped product's tile list: a bound on ``sum_e ceil(count_e / 32)``."""
    return P // TILE_BM + min(n_expert + 1, P) + 1


def group_words(T: int, n_used: int, n_expert: int) -> int:
    """32-bit words of :func:`record_moe_group`'s output (counts, offsets, tile count, tiles,
    row map) for ``T`` tokens of ``n_used`` slots over ``n_expert`` experts."""
    P = T * n_used
    return 2 * (n_expert + 1) + 1 + 2 * max_tiles(P, n_expert) + P


def group_bytes(T: int, n_used: int, n_expert: int) -> int:
    return 4 * group_words(T, n_used, n_expert)


def _size(b: Bindable) -> int:
    return as_range(b)[2]


def _check_int(name: str, **vals: int) -> None:
    for what, v in vals.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 32:
            raise KernelError(f"{name}: {what} = {v!r} is not a valid size")


def _check_fit(name: str, what: str, b: Bindable, nbytes: int) -> None:
    _, off, size, _ = as_range(b)
    if off % 4:
        raise KernelError(f"{name}: the {what} binding starts at byte {off}, not 4-byte aligned")
    if nbytes > size:
        raise KernelError(f"{name}: {what} needs {nbytes} bytes, its binding has {size}")


def _check_experts(name: str, n_expert: int, n_used: int) -> None:
    if n_expert < 1 or n_expert > MAX_EXPERTS:
        raise KernelError(f"{name}: n_expert = {n_expert}; the MoE kernels handle 1..{MAX_EXPERTS} experts")
    if n_used < 1 or n_used > n_expert:
        raise KernelError(f"{name}: n_used = {n_used} must be in 1..n_expert ({n_expert})")


def check_mul_mat_id(w_type: TypeLike | WeightType, n_expert: int, N: int, K: int, n_used: int, n_xb: int,
                     T: int, w_rows: int | None = None, w_row0: int = 0) -> WeightType:
    """Plan-time checks of a routed product (see :func:`record_mul_mat_id`); returns the weight
    type. Raises KernelError naming the problem."""
    wt = weight_type(w_type)
    w_rows = N if w_rows is None else w_rows
    name = f"mul_mat_id[{wt.name.upper()}, experts={n_expert}, N={N}, K={K}, T={T}, n_used={n_used}]"
    _check_int(name, n_expert=n_expert, N=N, K=K, n_used=n_used, n_xb=n_xb, T=T, w_rows=w_rows, w_row0=w_row0)
    _check_experts(name, n_expert, n_used)
    if n_xb not in (1, n_used):
        raise KernelError(f"{name}: x has {n_xb} rows per token; mul_mat_id takes 1 (shared by every slot) "
                          f"or n_used = {n_used} (one per slot)")
    if K == 0 or K % wt.block_size:
        raise KernelError(f"{name}: K must be a positive multiple of the {wt.name.upper()} block size "
                          f"{wt.block_size}", "ggml stores whole blocks per row; check the tensor's shape")
    if w_row0 + N > w_rows:
        raise KernelError(f"{name}: rows {w_row0}..{w_row0 + N} are outside the experts' {w_rows} rows")
    if wt.row_bytes(K) * w_rows * n_expert >= 1 << 32:
        raise KernelError(f"{name}: the expert tensor is 4 GiB or more; byte offsets are 32-bit",
                          "split the experts over backends (--split) or use a smaller quantization")
    if T * n_used * max(w_rows, K) >= 1 << 32:
        raise KernelError(f"{name}: element offsets exceed 32 bits")
    if -(-N // VEC_NR) > MAX_GROUPS or T * n_used > MAX_GROUPS or max_tiles(T * n_used, n_expert) > MAX_GROUPS:
        raise KernelError(f"{name}: too large for one dispatch")
    return wt


def record_moe_group(seq: Sequence, ids: Bindable, groups: Bindable, T: int, n_used: int, n_expert: int) -> None:
    """Group the ``T * n_used`` (token, slot) pairs of ``ids`` (int32) by expert into ``groups``
    (at least :func:`group_bytes` bytes): what the tiled :func:`record_mul_mat_id` reads. The
    gate, up and down products of one MoE FFN share one grouping."""
    name = f"moe_group[T={T}, n_used={n_used}, experts={n_expert}]"
    _check_int(name, T=T, n_used=n_used, n_expert=n_expert)
    _check_experts(name, n_expert, n_used)
    _check_fit(name, "ids", ids, 4 * T * n_used)
    _check_fit(name, "groups", groups, group_bytes(T, n_used, n_expert))
    if bindings_overlap(ids, groups):
        raise KernelError(f"{name}: the groups buffer overlaps the ids")
    if T == 0:
        return
    seq.dispatch(Kernel.get(seq.device, "moe_group"), [ids, groups], (T * n_used, n_expert, TILE_BM), (1, 1, 1))


def record_mul_mat_id(seq: Sequence, w: Bindable, w_type: TypeLike | WeightType, x: Bindable, ids: Bindable,
                      y: Bindable, *, n_expert: int, N: int, K: int, T: int, n_used: int, n_xb: int,
                      w_rows: int | None = None, w_row0: int = 0, y_stride: int | None = None,
                      groups: Bindable | None = None, grouped: bool = False, path: str | None = None,
                      coop_variant: str | None = None, vec_variant: str | None = None,
                      xq_scratch: Bindable | None = None, xq_slot: str = "", quantize: bool = True) -> str:
    """The routed product ``y[t, s, w_row0 + n] = sum_k W[ids[t, s], w_row0 + n, k] * x[t, s', k]``
    (``s' = s`` if ``n_xb > 1`` else 0; ``0 <= n < N``).

    ``w``: the ``(n_expert, w_rows, K)`` expert tensor (16-byte aligned binding; ``w_rows``
    defaults to N; ``w_row0``/``N``: a row range of every expert, a tensor split's share, written
    into y's columns ``w_row0 ..``); ``x`` f32 ``(T, n_xb, K)`` contiguous; ``ids`` int32 ``(T,
    n_used)``; ``y`` f32 ``(T * n_used)`` rows of ``y_stride`` (default ``w_rows``) elements.
    ``path``: default :func:`default_path`; ``"vec"`` or ``"grouped"``: the device's kernel of
    that family. ``"vec"`` at T = 1 quantizes x to q8_1 and runs the integer-dot-product kernel
    where the device's dense decode does for the type (:func:`vec_path`), else the f32-x
    mat-vec; ``"vec_f32"`` / ``"vec_q8_1"`` pin one of the two, at any T (``vec_variant``: a
    built routed q8_1 variant of the type, e.g. a shape of tools/kernels.py's sweep;
    ``xq_scratch``: the q8_1 x, at least ops.mul_mat.vecq_scratch_bytes(T n_xb, K) bytes,
    default a scratch buffer of the device, one per ``xq_slot``: products of different slots,
    such as a layer's gate and up, do not wait for each other's scratch; ``quantize=False``: the
    given ``xq_scratch`` already holds x as q8_1, T n_xb rows of K as ``quantize_q8_1`` writes
    them, made by x's producer in the graph (the decode's q8_1 pass, :mod:`vkxsplit.fusion`):
    no quantize dispatch is recorded). ``"grouped"`` runs the
    cooperative-matrix tiles where the device has them (:func:`grouped_path`), else the f32
    tiles; ``"tiled"`` / ``"coopmat"`` pin one of the two. The grouped paths need ``groups``,
    a buffer of :func:`group_bytes`: the grouping is recorded here unless ``grouped`` says an
    earlier :func:`record_moe_group` of the same ids filled it. ``coop_variant`` (tests and
    benchmarks; path ``coopmat``): run this built routed cooperative-matrix variant instead
    of the type's shipped one, e.g. an emulated one (``mul_mat_id_coopmat_emu_*``, which runs
    without cooperative matrices) or a tiling of the sweep (tools/kernels.py). Returns the
    path taken (``vec_f32``, ``vec_q8_1``, ``tiled`` or ``coopmat``)."""
    wt = check_mul_mat_id(w_type, n_expert, N, K, n_used, n_xb, T, w_rows, w_row0)
    w_rows = N if w_rows is None else w_rows
    y_stride = w_rows if y_stride is None else y_stride
    name = f"mul_mat_id[{wt.name.upper()}, experts={n_expert}, N={N}, K={K}, T={T}, n_used={n_used}]"
    _check_int(name, y_stride=y_stride)
    if y_stride < w_row0 + N:
        raise KernelError(f"{name}: y_stride {y_stride} < w_row0 + N = {w_row0 + N} (rows would overlap)")
    path = path or default_path(seq.device, wt.name, T, n_used, n_expert)
    if path not in (*VEC_PATHS, *GROUPED_PATHS):
        raise KernelError(f"{name}: unknown path {path!r} ({', '.join(VEC_PATHS + GROUPED_PATHS)})")
    if vec_variant is not None and path != "vec_q8_1":
        raise KernelError(f"{name}: vec_variant {vec_variant!r} needs path 'vec_q8_1', not {path!r}")
    if path == "vec":
        path = vec_path(seq.device, wt.name, T)
    if path == "vec_q8_1":
        if vec_variant is None:
            kc = kernels_for(seq.device)
            if kc.vecq(wt.name, 1) is None:
                raise KernelError(f"{name}: no integer-dot-product decode for {wt.name.upper()} weights on "
                                  f"'{seq.device.name}' (integer dot products, the type's kernel, intdot on)",
                                  "use path 'vec' (the device's choice)")
            vec_variant = vecq_id_name(wt.name, vecq_id_config(wt.name, kc.is_cpu))
        spec = vecq_spec(vec_variant)
        meta = variant_meta(vec_variant) or {}
        if spec is None or spec[0] != wt.name or (meta.get("defines") or {}).get("MUL_MAT_ID") != "1":
            raise KernelError(f"{name}: {vec_variant!r} is not a built routed q8_1 kernel for {wt.name.upper()} "
                              "weights")
        vq_rows = spec[1].rows
        if -(-N // vq_rows) > _MAX_GRID:
            raise KernelError(f"{name}: too large for one dispatch")
    if coop_variant is not None:
        if path != "coopmat":
            raise KernelError(f"{name}: coop_variant {coop_variant!r} needs path 'coopmat', not {path!r}")
        tile = _coop_id_tile(coop_variant, wt.name)
    elif path == "grouped":
        path = grouped_path(seq.device)
    if path == "coopmat" and coop_variant is None:
        kc = kernels_for(seq.device)
        if not kc.coopmat_available:
            why = ("is switched off (VKXSPLIT_DISABLE=coopmat)" if kc.coopmat else
                   f"needs f16 16x16x16 subgroup cooperative matrices at subgroup size 32, which "
                   f"'{seq.device.name}' lacks")
            raise KernelError(f"{name}: the coopmat path {why}", "use path 'grouped' (the device's choice)")
        coop_variant, tile = coop_id_name(wt.name), COOP_ID_TILE
    _, w_off, w_size, _ = as_range(w)
    if w_off % 16:
        raise KernelError(f"{name}: the weight binding starts at byte {w_off}, not 16-byte aligned")
    if n_expert * w_rows * wt.row_bytes(K) > w_size:
        raise KernelError(f"{name}: {n_expert} experts of {w_rows} rows of {wt.row_bytes(K)} bytes do not fit "
                          f"the weight binding ({w_size} bytes)")
    _check_fit(name, "x", x, 4 * T * n_xb * K)
    _check_fit(name, "ids", ids, 4 * T * n_used)
    P = T * n_used
    _check_fit(name, "y", y, 4 * ((P - 1) * y_stride + w_row0 + N) if P else 0)
    for what, b in (("x", x), ("the weights", w), ("ids", ids)):
        if bindings_overlap(y, b):
            raise KernelError(f"{name}: y overlaps {what}")
    if not quantize and (path != "vec_q8_1" or xq_scratch is None):
        raise KernelError(f"{name}: quantize=False reads x as q8_1 from the given xq_scratch: it needs path "
                          f"'vec_q8_1' (not {path!r}) and an xq_scratch")
    if path == "vec_q8_1":
        if xq_scratch is None:
            xq_scratch = _Scratch.get(seq.device, f"xq_id_{xq_slot}", vecq_scratch_bytes(T * n_xb, K))
        check_q8_1_scratch(name, xq_scratch, T * n_xb, K, (("the weights", w), ("x", x), ("y", y), ("ids", ids)))
    if path in GROUPED_PATHS:
        if groups is None:
            raise KernelError(f"{name}: the grouped path needs a groups buffer ({group_bytes(T, n_used, n_expert)} "
                              "bytes, ops.moe.group_bytes)")
        _check_fit(name, "groups", groups, group_bytes(T, n_used, n_expert))
        for what, b in (("y", y), ("x", x), ("the weights", w)):
            if bindings_overlap(groups, b):
                raise KernelError(f"{name}: the groups buffer overlaps {what}")
    if P == 0 or N == 0:
        return path
    if path == "coopmat":
        # bit 0: x rows vec4-readable (16-byte aligned binding, K % 4 == 0); bit 1: W rows
        # read 8 elements at a time (quantized: whole blocks; float types: K % 4 == 0)
        xvec = as_range(x)[1] % 16 == 0 and K % 4 == 0
        wvec = wt.quantized or K % 4 == 0
        push = (N, K, n_used, n_xb, n_expert, T, w_rows, w_row0, y_stride, int(xvec) | 2 * int(wvec))
        assert groups is not None and coop_variant is not None
        if not grouped:
            record_moe_group(seq, ids, groups, T, n_used, n_expert)
        seq.dispatch(Kernel.get(seq.device, coop_variant), [w, x, y, groups], push,
                     (-(-N // tile.bn), max_tiles(P, n_expert), 1))
        return path
    if path == "vec_q8_1":
        assert vec_variant is not None and xq_scratch is not None
        kd = Kernel.get(seq.device, vec_variant)   # (raises where the device lacks a feature)
        if quantize:
            record_quantize_q8_1(seq, x, xq_scratch, T * n_xb, K, K, 0)
        seq.dispatch(kd, [w, xq_scratch, y, ids], (N, K, n_used, n_xb, n_expert, T, w_rows, w_row0, y_stride, 0),
                     (-(-N // vq_rows), P, 1))
        return path
    flags = (1 if K % 4 == 0 else 0) | (FLAG_VEC if path == "vec_f32" else 0)
    push = (N, K, n_used, n_xb, n_expert, T, w_rows, w_row0, y_stride, flags)
    kd = Kernel.get(seq.device, kernel_name(wt.name))
    if path == "vec_f32":
        seq.dispatch(kd, [w, x, ids, y], push, (-(-N // VEC_NR), P, 1))
        return path
    assert groups is not None
    if not grouped:
        record_moe_group(seq, ids, groups, T, n_used, n_expert)
    seq.dispatch(kd, [w, x, groups, y], push, (-(-N // TILE_BN), max_tiles(P, n_expert), 1))
    return path


def record_moe_topk(seq: Sequence, logits: Bindable, ids: Bindable, weights: Bindable, *, T: int, n_expert: int,
                    n_used: int, gating: str = "softmax", norm: bool = True, scale: float = 1.0,
                    l_stride: int | None = None) -> None:
    """The router: for each of ``T`` rows of ``n_expert`` f32 logits (row stride ``l_stride``,
    default n_expert), ``ids`` (int32 ``(T, n_used)``) the experts of largest probability
    (``gating``: softmax or sigmoid) in decreasing order, equal probabilities in increasing
    expert index; ``weights`` (f32 ``(T, n_used)``) their probabilities, divided by
    ``max(sum, 6.103515625e-5)`` when ``norm``, times ``scale``."""
    name = f"moe_topk[T={T}, experts={n_expert}, n_used={n_used}]"
    l_stride = n_expert if l_stride is None else l_stride
    _check_int(name, T=T, n_expert=n_expert, n_used=n_used, l_stride=l_stride)
    _check_experts(name, n_expert, n_used)
    if gating not in GATING:
        raise KernelError(f"{name}: gating function {gating!r} is not one the router runs (softmax, sigmoid)")
    if l_stride < n_expert:
        raise KernelError(f"{name}: logit row stride {l_stride} < n_expert")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale != scale or abs(scale) == float("inf"):
        raise KernelError(f"{name}: scale {scale!r} is not a finite number")
    _check_fit(name, "logits", logits, 4 * ((T - 1) * l_stride + n_expert) if T else 0)
    _check_fit(name, "ids", ids, 4 * T * n_used)
    _check_fit(name, "weights", weights, 4 * T * n_used)
    for a, b, what in ((ids, logits, "ids and logits"), (weights, logits, "weights and logits"),
                       (ids, weights, "ids and weights")):
        if bindings_overlap(a, b):
            raise KernelError(f"{name}: {what} overlap")
    if T == 0:
        return
    seq.dispatch(Kernel.get(seq.device, f"moe_topk_{gating}"), [logits, ids, weights],
                 (n_expert, n_used, T, l_stride, int(bool(norm)), float(scale)), (min(T, MAX_GROUPS), 1, 1))


def record_moe_combine(seq: Sequence, e: Bindable, weights: Bindable, y: Bindable, *, T: int, n_used: int,
                       N: int) -> None:
    """``y[t, :] = sum_s weights[t, s] * e[t, s, :]`` for f32 ``e`` ``(T, n_used, N)``, ``weights``
    ``(T, n_used)``, ``y`` ``(T, N)`` (all contiguous; y apart from both)."""
    name = f"moe_combine[T={T}, n_used={n_used}, N={N}]"
    _check_int(name, T=T, n_used=n_used, N=N)
    if n_used < 1:
        raise KernelError(f"{name}: n_used must be at least 1")
    _check_fit(name, "expert outputs", e, 4 * T * n_used * N)
    _check_fit(name, "weights", weights, 4 * T * n_used)
    _check_fit(name, "y", y, 4 * T * N)
    if bindings_overlap(y, e) or bindings_overlap(y, weights):
        raise KernelError(f"{name}: y overlaps its inputs")
    if T * n_used * N >= 1 << 32:
        raise KernelError(f"{name}: element offsets exceed 32 bits")
    if T == 0 or N == 0:
        return
    seq.dispatch(Kernel.get(seq.device, "moe_combine_f32"), [e, weights, y], (N, T, n_used),
                 (min(4096, -(-N // 256)), min(T, MAX_GROUPS), 1))


# ---------------------------------------------------------------------------------------------
# graph nodes (registered by vkxsplit.ops.nodes)
#
#   moe_topk     inputs [logits (T, n_expert) f32] -> ids (T, n_used) i32; params: weights (the
#                (T, n_used) f32 tensor it also writes), n_expert, n_used, gating, norm, scale
#   moe_group    inputs [ids] -> groups (group_words,) u32; params: n_expert
#   mul_mat_id   inputs [W (n_expert, N, K), x (T, n_xb, K) f32, ids, and groups for the
#                grouped path (use_grouped)] -> (T, n_used, N) f32; params (decode, the q8_1
#                pass): xq (x as q8_1, T n_xb rows of K, written by x's producer or a
#                quantize_q8_1 node), vecq (the routed q8_1 kernel, vecq_id_decode)
#   moe_combine  inputs [e (T, n_used, N) f32, weights (T, n_used) f32] -> (T, N) f32


def _node_mul_mat_id(seq: Sequence, n: Node, r0: int = 0, r1: int | None = None, y: Tensor | None = None) -> None:
    """Rows ``[r0, r1)`` of every expert (all by default) into y's columns ``[r0, r1)`` (y:
    the node's output or a staging shadow of it), as the ``mul_mat`` recorder."""
    w, x, ids, *grp = n.inputs
    y = n.output if y is None else y
    n_expert, N, K = w.shape
    T, n_used = ids.shape
    r1 = N if r1 is None else r1
    xq = n.params.get("xq")
    if xq is not None:  # x as q8_1 already (written by x's producer: the q8_1 pass), no quantize dispatch
        record_mul_mat_id(seq, w.buffer, w.dtype, x.buffer, ids.buffer, y.buffer, n_expert=n_expert, N=r1 - r0,
                          K=K, T=T, n_used=n_used, n_xb=x.shape[1], w_rows=N, w_row0=r0, y_stride=N,
                          path="vec_q8_1", vec_variant=n.params["vecq"], xq_scratch=xq.buffer, quantize=False)
        return
    record_mul_mat_id(seq, w.buffer, w.dtype, x.buffer, ids.buffer, y.buffer, n_expert=n_expert, N=r1 - r0, K=K,
                      T=T, n_used=n_used, n_xb=x.shape[1], w_rows=N, w_row0=r0, y_stride=N,
                      groups=grp[0].buffer if grp else None, grouped=True, path=None if grp else "vec",
                      xq_slot=n.name.rsplit(".", 1)[-1])  # (the role: ffn_gate_exps, ffn_up_exps, ...)


def _node_moe_topk(seq: Sequence, n: Node) -> None:
    (logits,) = n.inputs
    p = n.params
    record_moe_topk(seq, logits.buffer, n.output.buffer, p["weights"].buffer, T=logits.shape[0],
                    n_expert=p["n_expert"], n_used=p["n_used"], gating=p.get("gating", "softmax"),
                    norm=p.get("norm", True), scale=p.get("scale", 1.0))


def _node_moe_group(seq: Sequence, n: Node) -> None:
    (ids,) = n.inputs
    T, n_used = ids.shape
    record_moe_group(seq, ids.buffer, n.output.buffer, T, n_used, n.params["n_expert"])


def _node_moe_combine(seq: Sequence, n: Node) -> None:
    e, w = n.inputs
    T, n_used, N = e.shape
    record_moe_combine(seq, e.buffer, w.buffer, n.output.buffer, T=T, n_used=n_used, N=N)


#: the hub recorders of the MoE graph ops, by op name (vkxsplit.ops.nodes registers them)
NODE_RECORDERS = {"mul_mat_id": _node_mul_mat_id, "moe_topk": _node_moe_topk, "moe_group": _node_moe_group,
                  "moe_combine": _node_moe_combine}

__all__ = ["COOP_ID_TILE", "GROUPED_PAIRS_PER_EXPERT", "GROUPED_PATHS", "NODE_RECORDERS", "VEC_PATHS",
           "coop_id_name", "default_path", "grouped_path", "make_coop_id_variant", "make_vecq_id_variant", "use_grouped", "vec_path",
           "vecq_id_config", "vecq_id_decode", "vecq_id_name", "GATING", "GATING_BY_ID", "NORM_CLAMP", "VARIANTS", "check_mul_mat_id", "group_bytes", "group_words",
           "max_tiles", "record_moe_combine", "record_moe_group", "record_moe_topk", "record_mul_mat_id"]
