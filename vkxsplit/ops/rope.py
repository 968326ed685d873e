"""Rotary position embedding (``shaders/rope.comp``), as ggml's rope with ext_factor = 0.

Applied to an f32 tensor [n_tokens, n_heads, head_dim] (token and head strides in elements, so
a view of a fused QKV row works) with int32 positions read from a buffer (one per token):
``theta_i = pos * freq_scale * freq_base^(-2i / n_dims) / freq_factors[i]`` for ``i < n_dims / 2``
(``freq_factors``: ggml's optional per-pair frequency factors, llama 3.x's ``rope_freqs.weight``;
1 when absent);

- ``mode="normal"`` (llama): rotate the pairs ``(2i, 2i+1)``;
- ``mode="neox"``: rotate the pairs ``(i, i + n_dims/2)``;

elements from ``n_dims`` on are copied unchanged. ``dst`` may be ``src`` (in place).
"""

from __future__ import annotations

import math

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel
from .elementwise import Operand, check_alias, check_dims, check_dtype, check_operand

WG = 256
MODES = {"normal": "rope", "neox": "rope_neox"}

VARIANTS = [
    Variant(name=f"{name}_f32", source="rope.comp", defines={"NEOX": "1" if mode == "neox" else "0"},
            bindings=4, writes=(2,), push="IIIIIIIIIIIffI", local_size=(WG, 1, 1))
    for mode, name in MODES.items()
]


def _check_3d(op: str, name: str, buf: Bindable, offset: int, ts: int, hs: int, n_tokens: int,
              n_heads: int, head_dim: int, shape: tuple[int, ...]) -> Operand:
    if hs < head_dim and n_heads > 1:
        raise KernelError(f"{op}: {name} head stride {hs} is shorter than head_dim (shape {list(shape)})")
    if ts < (n_heads - 1) * hs + head_dim and n_tokens > 1:
        raise KernelError(f"{op}: {name} token stride {ts} is shorter than a token's heads "
                          f"(shape {list(shape)})")
    # the rows (token, head) as one operand: fits the binding iff its last element does
    o = Operand(name, buf, offset, ts, n_tokens, (n_heads - 1) * hs + head_dim)
    check_operand(op, o, shape)
    return o


def record_rope(seq: Sequence, src: Bindable, pos: Bindable, dst: Bindable, n_tokens: int,
                n_heads: int, head_dim: int, *, n_dims: int | None = None, mode: str = "normal",
                freq_base: float = 10000.0, freq_scale: float = 1.0, pos_offset: int = 0,
                src_offset: int = 0, src_token_stride: int | None = None,
                src_head_stride: int | None = None, dst_offset: int = 0,
                dst_token_stride: int | None = None, dst_head_stride: int | None = None,
                dtype: str = "f32", freq_factors: Bindable | None = None) -> None:
    """Rotate ``src`` [n_tokens, n_heads, head_dim] into ``dst`` by the int32 positions
    ``pos[pos_offset : pos_offset + n_tokens]``. ``n_dims`` (default ``head_dim``, even, <=
    head_dim) leading elements of each head are rotated. Strides in elements default to the
    contiguous layout. ``freq_factors`` (optional): an f32 buffer of ``n_dims / 2`` factors,
    each pair's angle divided by its factor (ggml's ``freq_factors``)."""
    name = MODES.get(mode)
    shape = (n_tokens, n_heads, head_dim)
    if name is None:
        raise KernelError(f"rope: mode {mode!r} is not supported (modes: {', '.join(MODES)}; "
                          f"shape {list(shape)})")
    check_dtype(name, dtype, shape)
    n_dims = head_dim if n_dims is None else n_dims
    check_dims(name, dtype, shape, n_tokens=n_tokens, n_heads=n_heads, head_dim=head_dim, n_dims=n_dims)
    if head_dim % 2 or n_dims % 2 or n_dims > head_dim or n_dims == 0:
        raise KernelError(f"{name}_{dtype}: n_dims = {n_dims} and head_dim = {head_dim} must be even "
                          f"with 0 < n_dims <= head_dim (shape {list(shape)})")
    if not (freq_base > 0 and math.isfinite(freq_base) and math.isfinite(freq_scale)):
        raise KernelError(f"{name}_{dtype}: freq_base = {freq_base!r}, freq_scale = {freq_scale!r} "
                          f"(shape {list(shape)})")
    shs = head_dim if src_head_stride is None else src_head_stride
    sts = n_heads * shs if src_token_stride is None else src_token_stride
    dhs = head_dim if dst_head_stride is None else dst_head_stride
    dts = n_heads * dhs if dst_token_stride is None else dst_token_stride
    s = _check_3d(f"{name}_{dtype}", "src", src, src_offset, sts, shs, n_tokens, n_heads, head_dim, shape)
    d = _check_3d(f"{name}_{dtype}", "dst", dst, dst_offset, dts, dhs, n_tokens, n_heads, head_dim, shape)
    check_alias(f"{name}_{dtype}", d, s, shape)  # coarse: only exact in-place or disjoint spans pass
    pp = Operand("pos", pos, pos_offset, 1, 1, n_tokens)
    check_operand(f"{name}_{dtype}", pp, shape)
    check_alias(f"{name}_{dtype}", d, pp, shape)
    if freq_factors is not None:
        fo = Operand("freq_factors", freq_factors, 0, 1, 1, n_dims // 2)
        check_operand(f"{name}_{dtype}", fo, shape)
        check_alias(f"{name}_{dtype}", d, fo, shape)
    if n_tokens == 0 or n_heads == 0:
        return
    total = n_tokens * n_heads * (head_dim // 2)
    if total >= 1 << 32:
        raise KernelError(f"{name}_{dtype}: too many elements (shape {list(shape)})")
    theta_log2 = -2.0 * math.log2(freq_base) / n_dims
    k = Kernel.get(seq.device, f"{name}_{dtype}")
    # (without factors, binding 3 is any buffer: has_ff = 0 and the shader never reads it)
    seq.dispatch(k, [src, pos, dst, pos if freq_factors is None else freq_factors],
                 (head_dim, n_heads, n_tokens, n_dims, src_offset, sts, shs, dst_offset, dts, dhs,
                  pos_offset, theta_log2, float(freq_scale), int(freq_factors is not None)),
                 max(1, min(65535, -(-total // WG))))
