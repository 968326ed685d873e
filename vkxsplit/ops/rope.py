"""Rotary position embedding (``shaders/rope.comp``), as ggml's ``rope_ext``.

Applied to an f32 tensor [n_tokens, n_heads, head_dim] (token and head strides in elements, so
a view of a fused QKV row works) with int32 positions read from a buffer (one per token):
``theta_i = pos * freq_scale * freq_base^(-2i / n_dims) / freq_factors[i]`` for ``i < n_dims / 2``
(``freq_factors``: ggml's optional per-pair frequency factors, llama 3.x's ``rope_freqs.weight``;
1 when absent);

- ``mode="normal"`` (llama): rotate the pairs ``(2i, 2i+1)``;
- ``mode="neox"``: rotate the pairs ``(i, i + n_dims/2)``;

elements from ``n_dims`` on are copied unchanged. ``dst`` may be ``src`` (in place).

YaRN (ggml's ``rope_yarn``, the parameters of ``ggml_rope_ext``: ``n_ctx_orig``,
``ext_factor``, ``attn_factor``, ``beta_fast``, ``beta_slow``): with ``theta_extrap = pos *
freq_base^(-2i/n_dims) / freq_factors[i]`` and ``theta_interp = freq_scale * theta_extrap``,
when ``ext_factor != 0`` the angle is ``theta_interp (1 - r) + theta_extrap r`` with ``r =
ext_factor * ramp(i)``, ``ramp(i) = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)`` over the
correction dims ``(lo, hi)`` of :func:`yarn_corr_dims`, and cos/sin are scaled by ``attn_factor
* (1 + 0.1 ln(1 / freq_scale))`` (:func:`yarn_mscale`; ``attn_factor`` alone when
``ext_factor = 0``). The per-model scalars are formed on the host in float32, as ggml does, and
pushed to the ``rope_yarn`` kernels; ``ext_factor = 0`` with ``attn_factor = 1`` (every model
without YaRN or an attention factor) runs the plain kernels.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import KernelError
from ..shaders import Variant
from ..vk.command import Sequence
from ..vk.kernel import Bindable, Kernel
from .elementwise import Operand, check_alias, check_dims, check_dtype, check_operand

WG = 256
MODES = {"normal": "rope", "neox": "rope_neox"}

#: the YaRN keyword arguments of :func:`record_rope` (and of the ``rope`` dict of
#: ``record_kv_store``), ggml's defaults: as ``ggml_rope_ext`` takes them
YARN_DEFAULTS: dict[str, float] = {"n_ctx_orig": 0, "ext_factor": 0.0, "attn_factor": 1.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0}

VARIANTS = [
    *[Variant(name=f"{name}_f32", source="rope.comp",
              defines={"NEOX": "1" if mode == "neox" else "0", "YARN": "0"},
              bindings=4, writes=(2,), push="IIIIIIIIIIIffI", local_size=(WG, 1, 1))
      for mode, name in MODES.items()],
    *[Variant(name=f"{name.replace('rope', 'rope_yarn')}_f32", source="rope.comp",
              defines={"NEOX": "1" if mode == "neox" else "0", "YARN": "1"},
              bindings=4, writes=(2,), push="IIIIIIIIIIIffIffff", local_size=(WG, 1, 1))
      for mode, name in MODES.items()],
]


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml's ``ggml_rope_yarn_corr_dims`` in float32 as ggml computes it: the pair index
    ``n_dims ln(n_ctx_orig / (beta 2 pi)) / (2 ln freq_base)`` for ``beta_fast`` (floored, at
    least 0) and ``beta_slow`` (ceiled, at most ``n_dims - 1``)."""
    f = np.float32

    def corr_dim(beta: float) -> np.float32:
        return f(f(n_dims) * np.log(f(n_ctx_orig) / (f(beta) * f(2) * f(math.pi))) / (f(2) * np.log(f(freq_base))))

    lo = max(0.0, float(np.floor(corr_dim(beta_fast))))
    hi = min(float(n_dims - 1), float(np.ceil(corr_dim(beta_slow))))
    return lo, hi


def yarn_mscale(freq_scale: float, ext_factor: float, attn_factor: float) -> float:
    """What ggml's ``rope_yarn`` multiplies cos and sin by, in float32: ``attn_factor``, times
    ``1 + 0.1 ln(1 / freq_scale)`` when ``ext_factor != 0``."""
    f = np.float32
    m = f(attn_factor)
    if ext_factor != 0.0:
        m = f(m * f(f(1) + f(0.1) * np.log(f(1) / f(freq_scale))))
    return float(m)


def yarn_push(name: str, shape: tuple[int, ...], n_dims: int, freq_base: float, freq_scale: float,
              n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0,
              beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[float, float, float, float] | None:
    """The YaRN push constants ``(corr_lo, corr_hi, ext_factor, mscale)`` of a rope kernel, or
    None when the parameters ask for nothing beyond the plain kernel (``ext_factor = 0``,
    ``attn_factor = 1``). Bad values are a :class:`KernelError` naming them."""
    vals = {"ext_factor": ext_factor, "attn_factor": attn_factor, "beta_fast": beta_fast, "beta_slow": beta_slow}
    bad = [f"{k} = {v!r}" for k, v in vals.items()
           if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(float(v))]
    if bad or isinstance(n_ctx_orig, bool) or not isinstance(n_ctx_orig, (int, np.integer)):
        raise KernelError(f"{name}: {', '.join(bad) or f'n_ctx_orig = {n_ctx_orig!r}'} "
                          f"(YaRN parameters must be finite numbers; shape {list(shape)})")
    if ext_factor == 0.0 and attn_factor == 1.0:
        return None
    if ext_factor != 0.0 and not (n_ctx_orig > 0 and beta_fast > 0 and beta_slow > 0 and freq_scale > 0):
        raise KernelError(f"{name}: YaRN needs n_ctx_orig > 0, beta_fast > 0, beta_slow > 0 and freq_scale > 0 "
                          f"(got {n_ctx_orig}, {beta_fast}, {beta_slow}, {freq_scale}; shape {list(shape)})")
    lo, hi = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow) if ext_factor != 0.0 else (0.0, 0.0)
    return lo, hi, float(ext_factor), yarn_mscale(freq_scale, ext_factor, attn_factor)


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
                dtype: str = "f32", freq_factors: Bindable | None = None, n_ctx_orig: int = 0,
                ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
                beta_slow: float = 1.0, yarn_kernel: bool | None = None) -> None:
    """Rotate ``src`` [n_tokens, n_heads, head_dim] into ``dst`` by the int32 positions
    ``pos[pos_offset : pos_offset + n_tokens]``. ``n_dims`` (default ``head_dim``, even, <=
    head_dim) leading elements of each head are rotated. Strides in elements default to the
    contiguous layout. ``freq_factors`` (optional): an f32 buffer of ``n_dims / 2`` factors,
    each pair's angle divided by its factor (ggml's ``freq_factors``). ``n_ctx_orig``,
    ``ext_factor``, ``attn_factor``, ``beta_fast``, ``beta_slow``: ggml's YaRN parameters (see
    the module). ``yarn_kernel``: None picks the ``rope_yarn`` kernel only when the parameters
    need it; True runs it whatever they are (to compare the two kernels)."""
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
    yp = yarn_push(f"{name}_{dtype}", shape, n_dims, freq_base, freq_scale, n_ctx_orig, ext_factor,
                   attn_factor, beta_fast, beta_slow)
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
    push = (head_dim, n_heads, n_tokens, n_dims, src_offset, sts, shs, dst_offset, dts, dhs,
            pos_offset, theta_log2, float(freq_scale), int(freq_factors is not None))
    if yp is not None or yarn_kernel:
        name = name.replace("rope", "rope_yarn")
        push += yp or (0.0, 0.0, 0.0, 1.0)
    k = Kernel.get(seq.device, f"{name}_{dtype}")
    # (without factors, binding 3 is any buffer: has_ff = 0 and the shader never reads it)
    seq.dispatch(k, [src, pos, dst, pos if freq_factors is None else freq_factors], push,
                 max(1, min(65535, -(-total // WG))))
