"""KV cache store and causal grouped-query attention over an f16 KV cache
(``shaders/kv_store.comp``, ``shaders/attention.comp``, ``shaders/attn_combine.comp``).

The cache of one layer is two f16 tensors K, V [n_ctx, n_kv_heads, head_dim]. Both kernels
take their position from an int32 buffer, never from push constants, so one recorded
:class:`~vkxsplit.vk.command.Sequence` serves every decode step: write the new positions into
that buffer and submit again. The same buffer can hold the rope positions (one per token):

- :func:`record_kv_store` writes token ``t``'s K and V rows at cache position ``pos[t]``;
- :func:`record_attention` reads ``pos0 = pos[pos_offset]``: token ``t`` sits at ``pos0 + t``
  and attends to cache positions ``0 .. pos0 + t`` (causal); positions must be consecutive.

Attention is flash-attention style: one workgroup per (KV split, block of 16 query rows, kv
head), where the query rows of a block are the (token, head) pairs of the heads sharing that
kv head (GQA: head ``h`` uses kv head ``h // (n_heads // n_kv_heads)``), so every K/V block
read serves the whole group; online softmax over blocks of 32 positions, f32 accumulation.
For decode (one token, long cache) split the KV length over ``n_splits`` workgroups
(flash-decoding, :func:`attention_splits` picks a count); that needs a ``scratch`` buffer of
:func:`attention_scratch_bytes` and adds a small combine dispatch.

Kernels: head_dim 64 and 128 with cache offsets that are multiples of 4 elements take the
tiled ``attn_f16_f32_d64``/``_d128`` (compile-time head_dim, vec4 tiles, register-blocked
scores and outputs, cache reads issued one block ahead); any other head_dim <= 128 takes the
generic ``attn_f16_f32``, and head_dim 129..256 (Gemma 3: 256) its ``attn_f16_f32_h256`` form
(8 query rows and 16 cache positions a block, so its tiles fit the same shared memory). All
give the same results to f32 rounding.

``window`` > 0 is a sliding window (llama.cpp's ``LLAMA_SWA_TYPE_STANDARD``): the query at
position i sees the cache positions j with ``j <= i`` and ``i - j < window``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel
from .choose import kernels_for
from .elementwise import MAX_GROUPS, Operand, check_alias, check_dims, check_dtype, check_operand
from .mul_mat import check_q8_1_scratch, record_quantize_q8_1
from .rope import YARN_DEFAULTS, yarn_push

MAX_HEAD_DIM = 256
BR = 16  # query rows per attention workgroup (attention.comp; 8 in attn_f16_f32_h256)
BR_H256 = 8
GENERIC_MAX_HEAD_DIM = 128  # the largest head_dim of attn_f16_f32; above it attn_f16_f32_h256
COMBINE_WG = 128
TILED_HEAD_DIMS = (64, 128)  # head dims with a compile-time tiled kernel (attn_f16_f32_d<hd>)

#: the cooperative-matrix attention (attention_coopmat.comp) of prefill-sized batches: its head
#: dims, query rows per workgroup, cache positions per block, and the fewest query rows (tokens
#: x heads per kv head) it takes: below one workgroup's rows the tiled kernel's 16-row blocks
#: waste less
CM_HEAD_DIMS = (64, 128)
CM_BR = 64
CM_BC = 32
CM_MIN_ROWS = CM_BR
_CM_SPEC_IDS = {"HD": 0, "BC": 1}
_CM_REQUIRES = ("cooperativeMatrix", "shaderFloat16", "vulkanMemoryModel", "subgroupSizeControl",
                "storageBuffer16BitAccess")

#: attention.comp's specialization constants on its generic path (the tiled one has HD, id 0):
#: query rows and cache positions per workgroup block, the largest head_dim
_GENERIC_SPEC_IDS = {"BR": 0, "BC": 1, "DMAX": 2}


def _attn_variant(name: str, module: str, defines: dict[str, str], spec: dict[str, int],
                  spec_ids: dict[str, int]) -> Variant:
    """An attention.comp variant: one module per path (``TILED``), its sizes as spec values.
    The generic path gives each invocation BR DMAX / 128 = 16 output entries (its OPT)."""
    if "DMAX" in spec and spec["BR"] * spec["DMAX"] != 16 * 128:
        raise KernelError(f"{name}: BR x DMAX must be 16 x 128 invocations' output entries, got "
                          f"{spec['BR']} x {spec['DMAX']}")
    if "HD" in spec and spec["HD"] % 32:
        raise KernelError(f"{name}: the tiled attention's head_dim must be a multiple of 32, got {spec['HD']}")
    return Variant(name=name, source="attention.comp", defines=defines, module=module, spec=spec,
                   spec_ids=spec_ids, bindings=6, writes=(4, 5), push="IIIIIIIIIIIIIfI", local_size=(128, 1, 1),
                   requires=("storageBuffer16BitAccess",))


def cm_shared_bytes(hd: int, bc: int, emulate: bool = False) -> int:
    """Shared memory of attention_coopmat.comp at head_dim ``hd`` and block ``bc``: the Q / K /
    V tiles (Q apart from K and V when emulated), P, S and the softmax's pair and row values."""
    sq, sp = (hd if emulate else hd + 8) // 4, (bc + 8) // 4
    tiles = (2 * bc + CM_BR) * sq if emulate else max(CM_BR, 2 * bc) * sq
    return 8 * (tiles + CM_BR * sp) + 4 * (4 * 16 * bc + 2 * 128 + 2 * CM_BR)


def attn_cm_name(hd: int, bc: int = CM_BC, emulate: bool = False) -> str:
    return f"attn_cm{'_emu' if emulate else ''}_f16_f32_d{hd}" + ("" if bc == CM_BC else f"_c{bc}")


def make_attn_cm_variant(hd: int, bc: int = CM_BC, emulate: bool = False) -> Variant:
    """An attention_coopmat.comp variant: head_dim ``hd`` and block ``bc`` as specialization
    constants; ``emulate``: the same kernel without cooperative matrices (COOPMAT_EMULATE, for
    the tests on devices without them)."""
    if hd <= 0 or bc <= 0 or hd % 16 or bc % 16 or (bc * hd // 8) % 128 or 16 * bc < 256:
        raise KernelError(f"attention_coopmat: head_dim {hd} and block {bc} must be multiples of 16 with "
                          "head_dim / 8 x block a multiple of 128")
    common = {"name": attn_cm_name(hd, bc, emulate), "source": "attention_coopmat.comp",
              "spec": {"HD": hd, "BC": bc}, "spec_ids": _CM_SPEC_IDS, "bindings": 6, "writes": (4, 5),
              "push": "IIIIIIIIIIIIIfI", "local_size": (128, 1, 1)}
    if emulate:
        return Variant(module="mod_attn_cm_emu_f16_f32", defines={"COOPMAT_EMULATE": "1"},
                       requires=("shaderFloat16", "storageBuffer16BitAccess"), **common)  # type: ignore[arg-type]
    return Variant(module="mod_attn_cm_f16_f32", target_env="vulkan1.3", compiler="glslang", subgroup_size=32,
                   requires=_CM_REQUIRES, **common)  # type: ignore[arg-type]


VARIANTS = [
    Variant(name="kv_store_f32_f16", source="kv_store.comp", defines={"ROPE": "0", "NEOX": "0"}, bindings=5,
            writes=(3, 4), push="IIIIIIIIIIIIff", local_size=(256, 1, 1), requires=("storageBuffer16BitAccess",)),
    # the RoPE of K fused in: plain, and with ggml's YaRN terms (ops.rope's rope_yarn kernels)
    *[Variant(name=f"kv_store_rope{'_yarn' if yarn else ''}{'_neox' if neox else ''}_f32_f16",
              source="kv_store.comp", defines={"ROPE": "1", "NEOX": "1" if neox else "0", "YARN": "1" if yarn else "0"},
              bindings=6, writes=(3, 4), push="IIIIIIIIIIIIffI" + ("ffff" if yarn else ""), local_size=(256, 1, 1),
              requires=("storageBuffer16BitAccess",))
      for yarn in (False, True) for neox in (False, True)],
    *[_attn_variant(name, "mod_attn_f16_f32", {}, {"BR": br, "BC": bc, "DMAX": dmax}, _GENERIC_SPEC_IDS)
      for name, br, bc, dmax in (("attn_f16_f32", BR, 32, GENERIC_MAX_HEAD_DIM),
                                 ("attn_f16_f32_h256", BR_H256, 16, MAX_HEAD_DIM))],
    *[_attn_variant(f"attn_f16_f32_d{hd}", "mod_attn_f16_f32_tiled", {"TILED": "1"}, {"HD": hd}, {"HD": 0})
      for hd in TILED_HEAD_DIMS],
    *[make_attn_cm_variant(hd) for hd in CM_HEAD_DIMS],
    Variant(name="attn_combine_f32", source="attn_combine.comp", bindings=2, writes=(1,),
            push="IIIIII", local_size=(COMBINE_WG, 1, 1)),
    # the output also as q8_1 blocks (the x of the output projection's integer-dot mat-vec)
    Variant(name="attn_combine_q8_1_f32", source="attn_combine.comp", defines={"Q8": "1"}, bindings=3,
            writes=(1, 2), push="IIIIII", local_size=(COMBINE_WG, 1, 1)),
]


def record_kv_store(seq: Sequence, k: Bindable, v: Bindable, pos: Bindable, k_cache: Bindable,
                    v_cache: Bindable, n_tokens: int, n_kv_heads: int, head_dim: int, n_ctx: int, *,
                    k_offset: int = 0, k_stride: int | None = None, v_offset: int = 0,
                    v_stride: int | None = None, pos_offset: int = 0, k_cache_offset: int = 0,
                    v_cache_offset: int = 0, dtype: str = "f32", cache_dtype: str = "f16",
                    rope: dict[str, Any] | None = None) -> None:
    """Write K and V (f32 [n_tokens, n_kv_heads, head_dim], token strides ``k_stride`` /
    ``v_stride`` in elements, heads contiguous) into the f16 caches [n_ctx, n_kv_heads,
    head_dim] at rows ``pos[pos_offset + t]`` (int32; rows outside ``0..n_ctx-1`` are skipped).
    Rounding to f16 is round-to-nearest-even. Offsets in elements of each buffer's type.

    ``rope`` (optional: ``n_dims``, ``mode`` "normal"/"neox", ``freq_base``, ``freq_scale``,
    ``freq_factors``: an f32 buffer of ``n_dims / 2`` factors or None, and ggml's YaRN
    parameters ``n_ctx_orig``, ``ext_factor``, ``attn_factor``, ``beta_fast``, ``beta_slow``
    (defaults: :data:`~vkxsplit.ops.rope.YARN_DEFAULTS`), as
    :func:`~vkxsplit.ops.rope.record_rope` takes them; ``yarn_kernel``: as there) rotates K by
    its position on the way into the cache: the RoPE of K and the store in one dispatch."""
    op = "kv_store"
    shape = (n_tokens, n_kv_heads, head_dim)
    check_dtype(op, dtype, shape)
    check_dtype(op, cache_dtype, (n_ctx, n_kv_heads, head_dim), supported=("f16",))
    check_dims(op, dtype, shape, n_tokens=n_tokens, n_kv_heads=n_kv_heads, head_dim=head_dim, n_ctx=n_ctx)
    row = n_kv_heads * head_dim
    ok = Operand("k", k, k_offset, row if k_stride is None else k_stride, n_tokens, row)
    ov = Operand("v", v, v_offset, row if v_stride is None else v_stride, n_tokens, row)
    okc = Operand("k_cache", k_cache, k_cache_offset, row, n_ctx, row, itemsize=2)
    ovc = Operand("v_cache", v_cache, v_cache_offset, row, n_ctx, row, itemsize=2)
    op_ = Operand("pos", pos, pos_offset, 1, 1, n_tokens)
    for o in (ok, ov, okc, ovc, op_):
        check_operand("kv_store_f32_f16", o, shape)
    for src in (ok, ov, op_):
        for dst in (okc, ovc):
            check_alias("kv_store_f32_f16", dst, src, shape)
    b1, s1, e1 = okc.span()
    b2, s2, e2 = ovc.span()
    if row and n_ctx and b1 == b2 and s1 < e2 and s2 < e1:
        raise KernelError(f"kv_store_f32_f16: the K and V caches overlap (shape {list(shape)})")
    ff = None if rope is None else rope.get("freq_factors")
    if ff is not None:
        n_ff = int(rope.get("n_dims") or head_dim) // 2
        off = Operand("freq_factors", ff, 0, 1, 1, n_ff)
        check_operand("kv_store_rope", off, shape)
        for dst in (okc, ovc):
            check_alias("kv_store_rope", dst, off, shape)
    if n_tokens == 0 or row == 0:
        return
    name, rp, binds = "kv_store_f32_f16", (0, 0, 0.0, 0.0), [k, v, pos, k_cache, v_cache]
    if rope is not None:
        n_dims = int(rope.get("n_dims") or head_dim)
        mode = rope.get("mode", "normal")
        base, fscale = float(rope.get("freq_base", 10000.0)), float(rope.get("freq_scale", 1.0))
        if mode not in ("normal", "neox") or not (0 < n_dims <= head_dim and n_dims % 2 == 0):
            raise KernelError(f"kv_store_rope: mode {mode!r} / n_dims {n_dims} unsupported for head_dim "
                              f"{head_dim} (shape {list(shape)})")
        if not (base > 0 and math.isfinite(base) and math.isfinite(fscale)):
            raise KernelError(f"kv_store_rope: freq_base = {base!r}, freq_scale = {fscale!r} (shape {list(shape)})")
        name = "kv_store_rope_neox_f32_f16" if mode == "neox" else "kv_store_rope_f32_f16"
        rp = (head_dim, n_dims, -2.0 * math.log2(base) / n_dims, fscale, int(ff is not None))
        yp = yarn_push("kv_store_rope", shape, n_dims, base, fscale,
                       **{k: rope.get(k, d) for k, d in YARN_DEFAULTS.items()})
        if yp is not None or rope.get("yarn_kernel"):
            name = name.replace("kv_store_rope", "kv_store_rope_yarn")
            rp += yp or (0.0, 0.0, 0.0, 1.0)
        binds.append(pos if ff is None else ff)  # (without factors: any buffer, never read)
    kern = Kernel.get(seq.device, name)
    seq.dispatch(kern, binds,
                 (n_tokens, row, n_ctx, k_offset, ok.stride, v_offset, ov.stride, pos_offset,
                  k_cache_offset, v_cache_offset, *rp),
                 (max(1, min(4096, -(-row // 256))), min(n_tokens, MAX_GROUPS), 2))


def attention_scratch_bytes(n_tokens: int, n_heads: int, head_dim: int, n_splits: int) -> int:
    """Bytes of the ``scratch`` buffer :func:`record_attention` needs for ``n_splits`` > 1."""
    return 4 * n_splits * n_tokens * n_heads * (head_dim + 2) if n_splits > 1 else 0


def decode_target_workgroups(device: Any) -> int:
    """Workgroups a decode attention should spread over: two per compute unit of a GPU (264
    for an H100/H200's 132 SMs; a GPU that does not report its units counts as one of those),
    one per host core on a CPU device (``kernels_for(device).decode_workgroups``). On lavapipe
    (2 cores) the GPU value made SmolLM2's decode attention 6.8x slower (44.8 vs 6.6 ms per
    token over 30 layers: 32 splits, most of them over empty cache) and the whole step 152 vs
    121 ms."""
    return kernels_for(device).decode_workgroups


def attention_splits(n_tokens: int, n_heads: int, n_kv_heads: int, n_ctx: int,
                     target_workgroups: int = 264, min_positions: int = 128) -> int:
    """A KV split count for :func:`record_attention`: enough workgroups to fill a large GPU
    (``target_workgroups``, about two per SM of an H100/H200), each split covering at least
    ``min_positions`` cache positions of a full cache. 1 for prefill-sized batches."""
    blocks = n_kv_heads * -(-(n_tokens * max(1, n_heads // max(1, n_kv_heads))) // BR)
    want = -(-target_workgroups // max(1, blocks))
    return max(1, min(want, n_ctx // min_positions, MAX_GROUPS))


def _check_variant(name: str, head_dim: int, n_splits: int, k_off: int, v_off: int, shape: tuple[int, ...]) -> None:
    """What a kernel named by :func:`record_attention`'s ``variant`` needs of the operands (the
    same as :func:`attention_kernel` asks before choosing it); raises KernelError."""
    m = re.fullmatch(r"attn_(cm_(?:emu_)?)?f16_f32(?:_d(\d+)(?:_c\d+)?|_h256)?", name)
    if m is None:
        raise KernelError(f"attention: {name!r} is not an attention kernel (shape {list(shape)})")
    hd = int(m.group(2)) if m.group(2) else None
    align = 8 if m.group(1) else 4 if hd else 1
    need_hd = hd is None or hd == head_dim
    fits = need_hd and head_dim <= (MAX_HEAD_DIM if name.endswith("h256") else GENERIC_MAX_HEAD_DIM if hd is None
                                    else hd)
    if not (fits and k_off % align == 0 and v_off % align == 0 and (n_splits == 1 or not m.group(1))):
        raise KernelError(f"{name}: runs {'head_dim ' + str(hd) if hd else 'head_dims up to its limit'}"
                          f"{', one split' if m.group(1) else ''} and cache offsets that are multiples of {align} "
                          f"(head_dim {head_dim}, n_splits {n_splits}, offsets {k_off}, {v_off}; shape {list(shape)})")


def attention_kernel(device: Any, rows: int, head_dim: int, n_splits: int = 1, k_cache_offset: int = 0,
                     v_cache_offset: int = 0) -> str:
    """The attention variant for ``rows`` query rows per kv head (tokens x heads per kv head):
    the cooperative-matrix kernel for one split of at least :data:`CM_MIN_ROWS` rows at head_dim
    64 / 128 on a device that has it (cache offsets multiples of 8: 16-byte loads); else the
    tiled kernel of the head_dim (offsets multiples of 4), else the generic one (``_h256``
    above head_dim 128)."""
    kc = kernels_for(device)
    if (n_splits == 1 and rows >= CM_MIN_ROWS and head_dim in CM_HEAD_DIMS and k_cache_offset % 8 == 0
            and v_cache_offset % 8 == 0 and kc.attn_coopmat_available
            and cm_shared_bytes(head_dim, CM_BC) <= kc.shared_max):
        return attn_cm_name(head_dim)
    if head_dim in TILED_HEAD_DIMS and k_cache_offset % 4 == 0 and v_cache_offset % 4 == 0:
        return f"attn_f16_f32_d{head_dim}"
    return "attn_f16_f32_h256" if head_dim > GENERIC_MAX_HEAD_DIM else "attn_f16_f32"


def record_attention(seq: Sequence, q: Bindable, k_cache: Bindable, v_cache: Bindable, pos: Bindable,
                     dst: Bindable, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                     n_ctx: int, *, scale: float | None = None, q_offset: int = 0,
                     q_stride: int | None = None, dst_offset: int = 0, dst_stride: int | None = None,
                     k_cache_offset: int = 0, v_cache_offset: int = 0, pos_offset: int = 0,
                     n_splits: int = 1, scratch: Bindable | None = None, dtype: str = "f32",
                     cache_dtype: str = "f16", window: int = 0, xq: Bindable | None = None,
                     variant: str | None = None) -> None:
    """``dst[t, h] = softmax(scale * q[t, h] . K[0..p, g]) V[0..p, g]`` with ``p = pos0 + t``,
    ``pos0 = pos[pos_offset]`` (int32, read on the device) and ``g = h // (n_heads //
    n_kv_heads)``.

    ``q``/``dst``: f32 [n_tokens, n_heads, head_dim] (token strides in elements, heads
    contiguous); K/V caches: f16 [n_ctx, n_kv_heads, head_dim]. ``scale`` defaults to
    ``1/sqrt(head_dim)``. ``n_splits`` > 1 splits the KV length over that many workgroups per
    (row block, kv head) and needs ``scratch`` (:func:`attention_scratch_bytes`). The caller
    keeps ``pos0 + n_tokens <= n_ctx`` (positions past the cache are not read). ``window`` > 0:
    a sliding window, position ``p`` sees only ``p - window < j <= p`` (0: none). ``xq``: also
    write dst as q8_1 blocks there (the bits :func:`~vkxsplit.ops.mul_mat.record_quantize_q8_1`
    makes of it; head_dim % 32 == 0, dst rows contiguous): in the combine's epilogue when the
    KV length is split, else by a quantize dispatch after the attention.

    Kernel: :func:`attention_kernel` (``variant`` names another of the same family, e.g. an
    emulated cooperative-matrix one in the tests)."""
    op = "attn"
    shape = (n_tokens, n_heads, head_dim)
    check_dtype(op, dtype, shape)
    check_dtype(op, cache_dtype, (n_ctx, n_kv_heads, head_dim), supported=("f16",))
    check_dims(op, dtype, shape, n_tokens=n_tokens, n_heads=n_heads, n_kv_heads=n_kv_heads,
               head_dim=head_dim, n_ctx=n_ctx, n_splits=n_splits, window=window)
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise KernelError(f"attn_f16_f32: head_dim {head_dim} is not supported (1..{MAX_HEAD_DIM}; "
                          f"shape {list(shape)})")
    if n_kv_heads == 0 or n_heads % n_kv_heads:
        raise KernelError(f"attn_f16_f32: n_heads {n_heads} is not a multiple of n_kv_heads "
                          f"{n_kv_heads} (shape {list(shape)})")
    if n_tokens > n_ctx:
        raise KernelError(f"attn_f16_f32: {n_tokens} tokens do not fit a cache of {n_ctx} "
                          f"(shape {list(shape)})")
    if not 1 <= n_splits <= MAX_GROUPS:
        raise KernelError(f"attn_f16_f32: n_splits {n_splits} is outside 1..{MAX_GROUPS} "
                          f"(shape {list(shape)})")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise KernelError(f"attn_f16_f32: scale = {scale!r} must be a finite number > 0 (shape {list(shape)})")
    row = n_heads * head_dim
    kv_row = n_kv_heads * head_dim
    oq = Operand("q", q, q_offset, row if q_stride is None else q_stride, n_tokens, row)
    od = Operand("dst", dst, dst_offset, row if dst_stride is None else dst_stride, n_tokens, row)
    ok = Operand("k_cache", k_cache, k_cache_offset, kv_row, n_ctx, kv_row, itemsize=2)
    ov = Operand("v_cache", v_cache, v_cache_offset, kv_row, n_ctx, kv_row, itemsize=2)
    op_ = Operand("pos", pos, pos_offset, 1, 1, 1)
    for o in (oq, od, ok, ov, op_):
        check_operand("attn_f16_f32", o, shape)
    for src in (ok, ov, op_):
        check_alias("attn_f16_f32", od, src, shape)
    # dst must not be q even in place: a workgroup reads all its queries first, but other
    # workgroups of the same kv head could still be reading rows it writes.
    b1, s1, e1 = od.span()
    b2, s2, e2 = oq.span()
    if n_tokens and b1 == b2 and s1 < e2 and s2 < e1:
        raise KernelError(f"attn_f16_f32: dst overlaps q (shape {list(shape)})")
    if xq is not None:
        if head_dim % 32 or od.stride != row:
            raise KernelError(f"attn_f16_f32: a q8_1 output needs head_dim % 32 == 0 and contiguous dst rows "
                              f"(head_dim {head_dim}, dst stride {od.stride}; shape {list(shape)})")
        check_q8_1_scratch("attn_f16_f32 (q8_1 output)", xq, n_tokens, row,
                           (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("pos", pos), ("dst", dst))
                           + ((("scratch", scratch),) if scratch is not None and n_splits > 1 else ()))
    part: Bindable = dst
    if n_splits > 1:
        if scratch is None:
            raise KernelError(f"attn_f16_f32: n_splits = {n_splits} needs a scratch buffer of "
                              f"{attention_scratch_bytes(n_tokens, n_heads, head_dim, n_splits)} bytes "
                              f"(shape {list(shape)})")
        n = n_splits * n_tokens * n_heads * (head_dim + 2)
        osc = Operand("scratch", scratch, 0, n, 1, n)
        check_operand("attn_f16_f32", osc, shape)
        for o in (oq, od, ok, ov, op_):
            b1, s1, e1 = osc.span()
            b2, s2, e2 = o.span()
            if b1 == b2 and s1 < e2 and s2 < e1:
                raise KernelError(f"attn_f16_f32: scratch overlaps {o.name} (shape {list(shape)})")
        part = scratch
    if n_tokens == 0 or n_heads == 0:
        return
    grp = n_heads // n_kv_heads
    name = variant or attention_kernel(seq.device, n_tokens * grp, head_dim, n_splits, k_cache_offset,
                                       v_cache_offset)
    if variant is not None:
        _check_variant(variant, head_dim, n_splits, k_cache_offset, v_cache_offset, shape)
    br = CM_BR if name.startswith("attn_cm") else BR_H256 if name == "attn_f16_f32_h256" else BR
    row_blocks = -(-(n_tokens * grp) // br)
    if row_blocks > MAX_GROUPS or n_kv_heads > MAX_GROUPS:
        raise KernelError(f"attn_f16_f32: too many rows for one dispatch (shape {list(shape)})")
    kern = Kernel.get(seq.device, name)
    seq.dispatch(kern, [q, k_cache, v_cache, pos, dst, part],
                 (n_tokens, n_heads, n_kv_heads, head_dim, n_ctx, q_offset, oq.stride,
                  k_cache_offset, v_cache_offset, pos_offset, dst_offset, od.stride, n_splits, scale,
                  window),
                 (n_splits, row_blocks, n_kv_heads))
    if n_splits > 1:
        n_rows = n_tokens * n_heads
        bufs = [scratch, dst] if xq is None else [scratch, dst, xq]
        comb = Kernel.get(seq.device, "attn_combine_f32" if xq is None else "attn_combine_q8_1_f32")
        seq.dispatch(comb, bufs, (n_rows, n_heads, head_dim, n_splits, dst_offset, od.stride),  # type: ignore[arg-type]
                     min(n_rows, MAX_GROUPS))
    elif xq is not None:
        record_quantize_q8_1(seq, dst, xq, n_tokens, row, od.stride, dst_offset)
