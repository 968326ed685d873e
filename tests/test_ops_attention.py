"""KV cache store and causal GQA attention over the f16 cache (vkxsplit.ops.attention) against
an independent float64 numpy reference; outputs are poisoned with NaN before every run.

The reference attends over the f16-rounded K/V (what the cache holds), so the bound isolates
the kernel's own error: f32 dot products, online softmax and accumulation,
|got - ref| <= 2e-5 |ref| + 2e-5 max|V| (the output is a convex combination of V rows).
kv_store is bit-exact with numpy's f32 -> f16 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from vkxsplit.errors import KernelError
from vkxsplit.ops.attention import (
    attention_scratch_bytes,
    attention_splits,
    record_attention,
    record_kv_store,
)
from vkxsplit.ops.rope import record_rope
from vkxsplit.vk.command import Sequence

RTOL = 2e-5
ATOL = 2e-5  # times max|V|


@pytest.fixture
def bufs(device):
    made = []

    def make(n, dtype=np.float32):
        b = device.memory.alloc(max(1, n) * np.dtype(dtype).itemsize, "host", name="t")
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def put(buf, arr, offset=0):
    arr = np.ascontiguousarray(arr)
    buf.numpy(arr.dtype, arr.size, offset * arr.dtype.itemsize)[:] = arr.reshape(-1)


def get(buf, shape, dtype=np.float32):
    return buf.numpy(dtype, int(np.prod(shape))).copy().reshape(shape)


def attention_ref(q, kc, vc, pos0, n_kv, window=0, q16=False, extra=0):
    """q [T, H, D] f32; kc, vc [n_ctx, n_kv, D] f16 -> [T, H, D] float64. ``window`` > 0: the
    query at position i sees j > i - window only. ``q16``: the scaled queries rounded to f16
    first (what the cooperative-matrix kernel multiplies). ``extra``: positions past the causal
    limit seen too (a deliberately wrong mask)."""
    T, H, D = q.shape
    grp = H // n_kv
    out = np.zeros((T, H, D))
    k64, v64 = kc.astype(np.float64), vc.astype(np.float64)
    qs = q.astype(np.float64) / np.sqrt(D)
    if q16:
        qs = (q / np.float32(np.sqrt(D))).astype(np.float16).astype(np.float64)
    for t in range(T):
        n = pos0 + t + 1 + extra
        lo = max(0, n - extra - window) if window else 0
        for h in range(H):
            g = h // grp
            s = k64[lo:n, g, :] @ qs[t, h]
            p = np.exp(s - s.max())
            out[t, h] = p @ v64[lo:n, g, :] / p.sum()
    return out


def within(got, ref, vmax, atol=ATOL):
    err = np.abs(got.astype(np.float64) - ref)
    bound = RTOL * np.abs(ref) + atol * vmax
    return bool((err <= bound).all()), err.max(), bound.min()


def check(got, ref, vmax, what, atol=ATOL):
    ok, worst, bound = within(got, ref, vmax, atol)
    assert ok, f"{what}: worst err {worst:.3g} (bound {bound:.3g}..)"


class Cache:
    def __init__(self, bufs, rng, n_ctx, n_kv, D, fill_to, offset=0):
        self.n_ctx, self.n_kv, self.D, self.offset = n_ctx, n_kv, D, offset
        self.k = (rng.standard_normal((n_ctx, n_kv, D)) * 1.5).astype(np.float16)
        self.v = rng.standard_normal((n_ctx, n_kv, D)).astype(np.float16)
        self.k[fill_to:] = np.float16(np.nan)  # never read: positions past the query are masked
        self.v[fill_to:] = np.float16(np.nan)
        self.K = bufs(offset + self.k.size, np.float16)
        self.V = bufs(offset + self.v.size, np.float16)
        put(self.K, self.k, offset)
        put(self.V, self.v, offset)


def _attend(seq, bufs, rng, n_tokens, n_heads, n_kv, D, n_ctx, pos0, n_splits, cache_offset=0):
    """cache_offset (elements) not a multiple of 4 takes the generic kernel for D 64/128.
    Where the device chooses the cooperative-matrix kernel (prefill-sized, below), its f16
    operands' reference and bound apply."""
    from vkxsplit.ops.attention import attention_kernel

    if attention_kernel(seq.device, n_tokens * (n_heads // n_kv), D, n_splits, cache_offset,
                        cache_offset).startswith("attn_cm"):
        _attend_cm(seq, bufs, rng, n_tokens, n_heads, n_kv, D, n_ctx, pos0, cache_offset=cache_offset)
        return
    cache = Cache(bufs, rng, n_ctx, n_kv, D, pos0 + n_tokens, cache_offset)
    q = rng.standard_normal((n_tokens, n_heads, D)).astype(np.float32)
    Q, Out, P = bufs(q.size), bufs(q.size), bufs(2, np.int32)
    put(Q, q)
    put(P, np.array([-5, pos0], np.int32))
    Out.numpy(np.float32)[:] = np.nan
    scratch = bufs(attention_scratch_bytes(n_tokens, n_heads, D, n_splits) // 4) if n_splits > 1 else None
    record_attention(seq, Q, cache.K, cache.V, P, Out, n_tokens, n_heads, n_kv, D, n_ctx, pos_offset=1,
                     n_splits=n_splits, scratch=scratch, k_cache_offset=cache_offset,
                     v_cache_offset=cache_offset)
    seq.run()
    ref = attention_ref(q, cache.k, cache.v, pos0, n_kv)
    check(get(Out, q.shape), ref, 4.5, f"attn T={n_tokens} pos0={pos0} splits={n_splits}")


@pytest.mark.parametrize("pos0", [0, 1, 31, 32, 95, 200])
@pytest.mark.parametrize("n_splits", [1, 4, 19])  # (19: the combine's loads 8 at a time, then 3)
def test_decode_gqa(seq, bufs, rng, pos0, n_splits):
    _attend(seq, bufs, rng, 1, 6, 2, 64, 256, pos0, n_splits)


def test_decode_every_split_busy(seq, bufs, rng):
    """19 splits of 32 positions, each with cache to read (591 positions): the combine's
    unrolled loads (8, 8) and its remainder (3) all carry weight."""
    _attend(seq, bufs, rng, 1, 6, 2, 64, 640, 590, 19)


@pytest.mark.parametrize("n_tokens,pos0,n_splits", [(40, 0, 1), (37, 23, 1), (29, 70, 3)])
def test_prefill_gqa(seq, bufs, rng, n_tokens, pos0, n_splits):
    _attend(seq, bufs, rng, n_tokens, 6, 2, 64, 128, pos0, n_splits)


@pytest.mark.parametrize("n_tokens,n_heads,n_kv,D,pos0,n_splits,cache_offset", [
    (1, 6, 2, 64, 77, 3, 2),      # generic kernel (offset not a multiple of 4)
    (21, 6, 2, 64, 5, 1, 6),
    (5, 8, 2, 128, 40, 2, 2),
    (3, 6, 2, 64, 33, 2, 4),      # tiled kernel with an offset
])
def test_attention_paths(seq, bufs, rng, n_tokens, n_heads, n_kv, D, pos0, n_splits, cache_offset):
    _attend(seq, bufs, rng, n_tokens, n_heads, n_kv, D, 96, pos0, n_splits, cache_offset)


def test_attention_sizes_are_spec_values_of_two_modules(seqs, bufs, rng):
    """attention.comp's sizes are specialization constants: the tiled head dims (64, 128) are
    one module, the generic kernel and its head_dim-256 form (BR, BC, DMAX) another; each of
    the generic module's two pipelines matches the float64 reference (head_dim 96 runs the
    generic one, 256 the h256 one); sizes the kernel cannot run are refused."""
    from vkxsplit import shaders
    from vkxsplit.ops import attention as at

    m = {n: shaders.variant_meta(n) for n in ("attn_f16_f32", "attn_f16_f32_h256", "attn_f16_f32_d64",
                                              "attn_f16_f32_d128")}
    assert m["attn_f16_f32"]["module"] == m["attn_f16_f32_h256"]["module"] != m["attn_f16_f32_d64"]["module"]
    assert m["attn_f16_f32_d64"]["module"] == m["attn_f16_f32_d128"]["module"]
    assert m["attn_f16_f32"]["spec"] == {"BR": at.BR, "BC": 32, "DMAX": 128}
    assert m["attn_f16_f32_h256"]["spec"] == {"BR": at.BR_H256, "BC": 16, "DMAX": 256}
    assert shaders.spirv("attn_f16_f32") == shaders.spirv("attn_f16_f32_h256")
    _attend(seqs("generic"), bufs, rng, 3, 4, 2, 96, 64, 20, 1)
    _attend(seqs("h256"), bufs, rng, 3, 2, 1, 256, 64, 20, 2)
    with pytest.raises(KernelError, match="16 x 128"):
        at._attn_variant("x", "m", {}, {"BR": 16, "BC": 32, "DMAX": 256}, at._GENERIC_SPEC_IDS)
    with pytest.raises(KernelError, match="multiple of 32"):
        at._attn_variant("x", "m", {"TILED": "1"}, {"HD": 80}, {"HD": 0})


def test_prefill_512(seq, bufs, rng):
    _attend(seq, bufs, rng, 512, 6, 2, 64, 520, 0, 1)


# ------------------------------------------------------------------------------------------
# the cooperative-matrix attention of prefill-sized batches (attention_coopmat.comp): its
# logic through the emulated variants on every device, the real kernel where the device has
# cooperative matrices. Its operands are f16 (q * scale, K, V, the probabilities P): against
# the reference over the f16-rounded scaled queries the error is P's rounding (the kernel's row
# sums add the same rounded P), at most 2^-10 of max|V| (the output is a combination of V rows
# with weights P / l; 2^-10, not 2^-11: Vulkan leaves the f32 -> f16 conversion's rounding
# mode to the implementation, so round-toward-zero is allowed), plus f32 arithmetic.
CM_ATOL = 2.0 ** -10 + ATOL


def _attend_cm(seq, bufs, rng, n_tokens, n_heads, n_kv, D, n_ctx, pos0, *, variant=None, window=0,
               cache_offset=0, pad=0):
    """``pad`` > 0: q and dst rows strided (``pad`` elements past each token's row) and offset."""
    cache = Cache(bufs, rng, n_ctx, n_kv, D, pos0 + n_tokens, cache_offset)
    q = (rng.standard_normal((n_tokens, n_heads, D)) * 2).astype(np.float32)
    row = n_heads * D
    stride = row + pad
    Q, Out, P = bufs(pad + n_tokens * stride), bufs(2 * pad + n_tokens * stride), bufs(2, np.int32)
    qs = np.full((n_tokens, stride), np.nan, np.float32)
    qs[:, :row] = q.reshape(n_tokens, row)
    put(Q, qs, pad)
    put(P, np.array([-5, pos0], np.int32))
    Out.numpy(np.float32)[:] = np.nan
    record_attention(seq, Q, cache.K, cache.V, P, Out, n_tokens, n_heads, n_kv, D, n_ctx, pos_offset=1,
                     k_cache_offset=cache_offset, v_cache_offset=cache_offset, window=window, variant=variant,
                     q_offset=pad, q_stride=stride, dst_offset=2 * pad, dst_stride=stride)
    seq.run()
    out = Out.numpy(np.float32)[2 * pad:].reshape(n_tokens, stride)
    if pad:
        assert np.isnan(out[:, row:]).all() and np.isnan(Out.numpy(np.float32)[:2 * pad]).all()
    got = out[:, :row].reshape(q.shape).copy()
    ref = attention_ref(q, cache.k, cache.v, pos0, n_kv, window=window, q16=True)
    check(got, ref, 4.5, f"attn_cm T={n_tokens} H={n_heads}/{n_kv} D={D} pos0={pos0} window={window}", CM_ATOL)
    return q, cache, got


CM_SHAPES = [  # n_tokens, n_heads, n_kv, pos0, window, cache_offset, q / dst row padding
    (100, 6, 2, 0, 0, 0, 0),     # group 3: 300 rows, a partial last block; blocks cross the causal edge
    (70, 4, 4, 37, 0, 8, 0),     # MHA over a cache already holding 37 positions, offset cache
    (90, 4, 2, 5, 20, 0, 0),     # sliding window: workgroups start past position 0
    (3, 32, 1, 60, 0, 0, 0),     # MQA: 96 rows of three tokens
    (64, 8, 1, 20, 0, 0, 5),     # strided, offset q and dst rows
]


@pytest.mark.parametrize("bc", [16, 32])
@pytest.mark.parametrize("shape", CM_SHAPES, ids=[f"T{s[0]}_H{s[1]}_{s[2]}_p{s[3]}_w{s[4]}_o{s[5]}_s{s[6]}"
                                                  for s in CM_SHAPES])
def test_attention_coopmat_emulated(seq, bufs, rng, tool_kernels, bc, shape):
    from vkxsplit.ops.attention import attn_cm_name

    name = attn_cm_name(64, bc, emulate=True)
    tool_kernels(name)
    T, H, n_kv, pos0, window, off, pad = shape
    _attend_cm(seq, bufs, rng, T, H, n_kv, 64, 192, pos0, variant=name, window=window, cache_offset=off, pad=pad)


def test_attention_coopmat_bound_tells_a_wrong_mask(seq, bufs, rng, tool_kernels):
    """The check above fails a reference that lets each query see one position too many, and a
    bound four times tighter fails the f32-query reference the kernel's f16 queries differ from:
    the bound is not so loose that it hides what the reference models."""
    from vkxsplit.ops.attention import attn_cm_name

    name = attn_cm_name(64, 32, emulate=True)
    tool_kernels(name)
    T, pos0 = 40, 30
    q, cache, got = _attend_cm(seq, bufs, rng, T, 4, 2, 64, 128, pos0, variant=name)
    wrong = attention_ref(q[:-1], cache.k, cache.v, pos0, 2, q16=True, extra=1)
    assert not within(got[:-1], wrong, 4.5, CM_ATOL)[0]
    assert not within(got, attention_ref(q, cache.k, cache.v, pos0, 2), 4.5, 2.0 ** -13)[0]


@pytest.mark.parametrize("D", [64, 128])
def test_attention_coopmat(device, seqs, bufs, rng, D):
    """The real cooperative-matrix kernel where the device has it (chosen by attention_kernel
    for one split of >= CM_MIN_ROWS rows at head_dim 64 / 128)."""
    from vkxsplit.ops.attention import CM_MIN_ROWS, attention_kernel
    from vkxsplit.ops.choose import kernels_for

    if not kernels_for(device).attn_coopmat_available:
        assert attention_kernel(device, 4096, D) == f"attn_f16_f32_d{D}"
        pytest.skip("no cooperative matrices on this device")
    assert attention_kernel(device, CM_MIN_ROWS, D) == f"attn_cm_f16_f32_d{D}"
    assert attention_kernel(device, CM_MIN_ROWS - 1, D) == f"attn_f16_f32_d{D}"
    assert attention_kernel(device, 4096, D, n_splits=2) == f"attn_f16_f32_d{D}"
    assert attention_kernel(device, 4096, D, k_cache_offset=4) == f"attn_f16_f32_d{D}"
    for i, (T, H, n_kv, pos0, window, off, pad) in enumerate(CM_SHAPES + [(512, 32, 8, 0, 0, 0, 0)]):
        _attend_cm(seqs(f"s{i}"), bufs, rng, T, H, n_kv, D, 640, pos0, window=window, cache_offset=off, pad=pad)


def test_attention_coopmat_variant_checks(seq, bufs):
    from vkxsplit.ops import attention as at

    A, K, P = bufs(8192), bufs(8192, np.float16), bufs(1, np.int32)
    with pytest.raises(KernelError, match="runs head_dim 64, one split"):
        record_attention(seq, A, K, K, P, bufs(8192), 64, 1, 1, 128, 64, variant=at.attn_cm_name(64))
    with pytest.raises(KernelError, match="runs head_dim 64, one split"):
        record_attention(seq, A, K, K, P, bufs(8192), 1, 1, 1, 64, 64, variant=at.attn_cm_name(64, 16),
                         n_splits=2, scratch=bufs(8192))
    with pytest.raises(KernelError, match="multiples of 8"):
        record_attention(seq, A, K, K, P, bufs(8192), 64, 1, 1, 64, 64, variant=at.attn_cm_name(64),
                         k_cache_offset=4)
    # the other kernels' needs too: a head_dim-64 tiled kernel never runs head_dim 128
    with pytest.raises(KernelError, match="attn_f16_f32_d64: runs head_dim 64"):
        record_attention(seq, A, K, K, P, bufs(8192), 4, 1, 1, 128, 64, variant="attn_f16_f32_d64")
    with pytest.raises(KernelError, match="multiples of 4"):
        record_attention(seq, A, K, K, P, bufs(8192), 4, 1, 1, 64, 64, variant="attn_f16_f32_d64",
                         v_cache_offset=2)
    with pytest.raises(KernelError, match="not an attention kernel"):
        record_attention(seq, A, K, K, P, bufs(8192), 4, 1, 1, 64, 64, variant="mul_mat_f32_f32")
    for hd, bc in ((72, 32), (0, 32), (64, 0)):
        with pytest.raises(KernelError, match="multiples of 16"):
            at.make_attn_cm_variant(hd, bc)
    assert seq.dispatches == 0


@pytest.mark.parametrize("n_tokens,n_heads,n_kv,D,pos0,n_splits", [
    (1, 4, 4, 128, 150, 2),    # llama head_dim, MHA, decode
    (6, 8, 2, 128, 10, 1),     # llama head_dim, group 4, short prefill
    (3, 9, 3, 40, 50, 1),      # odd head_dim, group 3 (rows straddle blocks)
    (2, 32, 1, 64, 20, 2),     # MQA: 64 query rows of one kv head
])
def test_attention_shapes(seq, bufs, rng, n_tokens, n_heads, n_kv, D, pos0, n_splits):
    _attend(seq, bufs, rng, n_tokens, n_heads, n_kv, D, 192, pos0, n_splits)


def test_kv_store(seq, bufs, rng):
    T, n_kv, D, n_ctx = 5, 2, 64, 32
    row = n_kv * D
    qkv = (rng.standard_normal((T, 3 * row)) * 100).astype(np.float32)  # k, v: views of a fused row
    qkv[0, row:row + 4] = [1e-7, 7e4, -0.0, 65519.0]  # subnormal, overflow, signed zero, rounding
    pos = np.array([3, 4, 9, 31, 40], np.int32)       # 40 is outside the cache: skipped
    X, P = bufs(qkv.size), bufs(T, np.int32)
    put(X, qkv)
    put(P, pos)
    K, V = bufs(n_ctx * row, np.float16), bufs(n_ctx * row, np.float16)
    K.numpy(np.uint16)[:] = 0x7E01
    V.numpy(np.uint16)[:] = 0x7E01
    record_kv_store(seq, X, X, P, K, V, T, n_kv, D, n_ctx, k_offset=row, k_stride=3 * row,
                    v_offset=2 * row, v_stride=3 * row)
    seq.run()
    k_ref = np.full((n_ctx, row), 0x7E01, np.uint16)
    v_ref = k_ref.copy()
    with np.errstate(over="ignore"):  # 7e4 rounds to inf, on purpose
        for t in range(T - 1):
            k_ref[pos[t]] = qkv[t, row:2 * row].astype(np.float16).view(np.uint16)
            v_ref[pos[t]] = qkv[t, 2 * row:].astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(get(K, (n_ctx, row), np.uint16), k_ref)
    np.testing.assert_array_equal(get(V, (n_ctx, row), np.uint16), v_ref)


def _rope64(x, pos, n_dims, neox, base, fscale, ff=None):
    """float64 RoPE of x [T, heads, D] (ggml's formula), positions per token; ``ff``: ggml's
    freq_factors (each pair's angle divided by its factor)."""
    x = x.astype(np.float64).copy()
    half = n_dims // 2
    theta = (pos.astype(np.float64)[:, None] * fscale) * base ** (-2.0 * np.arange(half) / n_dims)
    if ff is not None:
        theta = theta / np.asarray(ff, np.float64)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + (half if neox else 1)
    a, b = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0], x[..., i1] = a * c - b * s, a * s + b * c
    return x


@pytest.mark.parametrize("factors", [False, True])
@pytest.mark.parametrize("neox", [False, True])
def test_kv_store_with_rope(seq, bufs, rng, neox, factors):
    """RoPE of K fused into the store: within half an f16 ulp (the rounding) plus the f32
    rotation bound test_rope uses ((2e-6 + 4 |theta|max 2^-24) max|x|) of the float64 rope of
    K; V stored unrotated; and as close to rope_f32 followed by the plain store. ``factors``:
    with per-pair frequency factors (llama 3.x's rope_freqs.weight) in [0.5, 8], in both."""
    T, n_kv, D, n_ctx, n_dims = 6, 3, 64, 40, 48
    row = n_kv * D
    k = rng.standard_normal((T, row)).astype(np.float32)
    v = rng.standard_normal((T, row)).astype(np.float32)
    pos = np.array([0, 1, 7, 20, 33, 39], np.int32)
    Kin, Vin, P = bufs(k.size), bufs(v.size), bufs(T, np.int32)
    put(Kin, k)
    put(Vin, v)
    put(P, pos)
    Kc, Vc = bufs(n_ctx * row, np.float16), bufs(n_ctx * row, np.float16)
    Kc.numpy(np.uint16)[:] = 0x7E01
    Vc.numpy(np.uint16)[:] = 0x7E01
    ff = F = None
    if factors:
        ff = rng.uniform(0.5, 8.0, n_dims // 2).astype(np.float32)
        F = bufs(n_dims // 2)
        put(F, ff)
    rope = {"n_dims": n_dims, "mode": "neox" if neox else "normal", "freq_base": 10000.0, "freq_scale": 0.5,
            "freq_factors": F}
    record_kv_store(seq, Kin, Vin, P, Kc, Vc, T, n_kv, D, n_ctx, rope=rope)
    seq.run()
    got_k = get(Kc, (n_ctx, row), np.float16)[pos].astype(np.float64)
    got_v = get(Vc, (n_ctx, row), np.uint16)[pos]
    ref_k = _rope64(k.reshape(T, n_kv, D), pos, n_dims, neox, 10000.0, 0.5, ff).reshape(T, row)
    ulp = np.spacing(np.abs(ref_k).astype(np.float16)).astype(np.float64)
    tmax = float(pos.max()) * 0.5 / (float(ff.min()) if factors else 1.0)
    rot = (2e-6 + 4 * tmax * 2.0**-24) * np.abs(k).max()
    if factors:  # the factors matter: the unscaled rotation is far off
        plain = _rope64(k.reshape(T, n_kv, D), pos, n_dims, neox, 10000.0, 0.5).reshape(T, row)
        assert np.abs(got_k - plain).max() > 0.1
    bad = np.argwhere(np.abs(got_k - ref_k) > 0.5 * ulp + rot)
    assert bad.size == 0, (bad[:10], got_k[tuple(bad[0])], ref_k[tuple(bad[0])])
    np.testing.assert_array_equal(got_v, v.astype(np.float16).view(np.uint16))
    untouched = np.setdiff1d(np.arange(n_ctx), pos)
    assert (get(Kc, (n_ctx, row), np.uint16)[untouched] == 0x7E01).all()
    # the unfused pair: rope_f32 then the plain store
    R = bufs(k.size)
    Kc2 = bufs(n_ctx * row, np.float16)
    s2 = Sequence(seq.device, "unfused")
    try:
        record_rope(s2, Kin, P, R, T, n_kv, D, n_dims=n_dims, mode=rope["mode"], freq_base=10000.0,
                    freq_scale=0.5, freq_factors=F)
        record_kv_store(s2, R, Vin, P, Kc2, Vc, T, n_kv, D, n_ctx)
        s2.run()
    finally:
        s2.close()
    two = get(Kc2, (n_ctx, row), np.float16)[pos].astype(np.float64)
    assert np.all(np.abs(two - got_k) <= ulp + 2 * rot)


def test_kv_store_rope_validation(seq, bufs):
    K, P = bufs(64), bufs(1, np.int32)
    C = bufs(64, np.float16)
    C2 = bufs(64, np.float16)
    with pytest.raises(KernelError, match="n_dims"):
        record_kv_store(seq, K, K, P, C, C2, 1, 1, 64, 1, rope={"n_dims": 65, "mode": "normal"})
    with pytest.raises(KernelError, match="mode"):
        record_kv_store(seq, K, K, P, C, C2, 1, 1, 64, 1, rope={"n_dims": 64, "mode": "glm"})
    with pytest.raises(KernelError, match="freq_factors"):  # 31 floats for 32 pairs
        record_kv_store(seq, K, K, P, C, C2, 1, 1, 64, 1,
                        rope={"n_dims": 64, "mode": "normal", "freq_factors": bufs(31)})


def _neox(v, p, D):
    theta = p * 10000.0 ** (-2.0 * np.arange(D // 2) / D)
    c, s = np.cos(theta), np.sin(theta)
    v = v.astype(np.float64).reshape(-1, D)
    a, b = v[:, :D // 2], v[:, D // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=1)


def test_replay_decode(device, bufs, rng):
    """One sequence (rope q/k, store k/v, attend) recorded once, replayed for successive
    positions by rewriting only the inputs and the position buffer."""
    H, n_kv, D, n_ctx = 6, 2, 64, 96
    qkv_row = (H + 2 * n_kv) * D
    X = bufs(qkv_row)
    P = bufs(1, np.int32)
    Q = bufs(H * D)
    Kr = bufs(n_kv * D)
    Out = bufs(H * D)
    K, V = bufs(n_ctx * n_kv * D, np.float16), bufs(n_ctx * n_kv * D, np.float16)
    n_splits = 3
    S = bufs(attention_scratch_bytes(1, H, D, n_splits) // 4)
    K.numpy(np.uint16)[:] = 0
    V.numpy(np.uint16)[:] = 0
    seq = Sequence(device, "decode")
    try:
        record_rope(seq, X, P, Q, 1, H, D, mode="neox")
        record_rope(seq, X, P, Kr, 1, n_kv, D, mode="neox", src_offset=H * D)
        record_kv_store(seq, Kr, X, P, K, V, 1, n_kv, D, n_ctx, v_offset=(H + n_kv) * D)
        record_attention(seq, Q, K, V, P, Out, 1, H, n_kv, D, n_ctx, n_splits=n_splits, scratch=S)
        seq.end()
        dispatches = seq.dispatches
        k_hist = np.zeros((n_ctx, n_kv, D), np.float16)
        v_hist = np.zeros((n_ctx, n_kv, D), np.float16)
        positions = list(range(0, 12)) + list(range(30, 34)) + [63, 64, 65]
        for p in positions:
            x = rng.standard_normal(qkv_row).astype(np.float32)
            put(X, x)
            put(P, np.array([p], np.int32))
            Out.numpy(np.float32)[:] = np.nan
            seq.run()
            assert seq.dispatches == dispatches  # nothing re-recorded
            q = _neox(x[:H * D], p, D)
            k_hist[p] = _neox(x[H * D:(H + n_kv) * D], p, D).astype(np.float32).astype(np.float16)
            v_hist[p] = x[(H + n_kv) * D:].reshape(n_kv, D).astype(np.float16)
            # the cache row the kernel wrote equals the reference up to rope's f32 rounding
            got_k = get(K, (n_ctx, n_kv, D), np.float16)[p].astype(np.float64)
            assert np.abs(got_k - k_hist[p]).max() <= 2e-3 * np.abs(k_hist[p]).max()
            k_hist[p] = get(K, (n_ctx, n_kv, D), np.float16)[p]  # isolate attention's error
            np.testing.assert_array_equal(get(V, (n_ctx, n_kv, D), np.float16)[p], v_hist[p])
            # the reference attends over what the cache holds (rows this test wrote, zeros
            # elsewhere)
            hist_k = get(K, (n_ctx, n_kv, D), np.float16)
            hist_v = get(V, (n_ctx, n_kv, D), np.float16)
            ref = attention_ref(get(Q, (1, H, D)), hist_k, hist_v, p, n_kv)
            check(get(Out, (1, H, D)), ref, np.abs(hist_v[:p + 1]).max(), f"replay pos {p}")
            assert np.abs(get(Q, (1, H, D)).astype(np.float64) - q.reshape(1, H, D)).max() < 1e-4
    finally:
        seq.wait()
        seq.close()


@pytest.mark.parametrize("n_tokens,n_splits,n_ctx", [(1, 1, 64), (1, 4, 256), (2, 300, 320)])
def test_attention_q8_1_output(seq, bufs, rng, n_tokens, n_splits, n_ctx):
    """Attention that also writes its output as q8_1 blocks (the x of the output projection's
    integer-dot mat-vec): in the KV-split combine's epilogue, or by a quantize dispatch after an
    unsplit attention. The f32 output against float64, the blocks exactly the separate quantize
    kernel's bits of that output, nothing written past the scratch. 300 splits: more than the
    combine keeps in shared memory (its recomputing path)."""
    from vkxsplit.ops.mul_mat import record_quantize_q8_1, vecq_scratch_bytes

    H, n_kv, D, pos0 = 4, 2, 64, n_ctx - n_tokens - 3
    cache = Cache(bufs, rng, n_ctx, n_kv, D, pos0 + n_tokens)
    q = rng.standard_normal((n_tokens, H, D)).astype(np.float32)
    Q, Out, P = bufs(q.size), bufs(q.size), bufs(1, np.int32)
    put(Q, q)
    put(P, np.array([pos0], np.int32))
    Out.numpy(np.float32)[:] = np.nan
    nq = vecq_scratch_bytes(n_tokens, H * D)
    XQ, XQ2 = bufs(nq // 4 + 16), bufs(nq // 4 + 16)
    XQ.numpy(np.uint8)[:] = 0xAB
    scratch = bufs(attention_scratch_bytes(n_tokens, H, D, n_splits) // 4) if n_splits > 1 else None
    record_attention(seq, Q, cache.K, cache.V, P, Out, n_tokens, H, n_kv, D, n_ctx, n_splits=n_splits,
                     scratch=scratch, xq=XQ)
    record_quantize_q8_1(seq, Out, XQ2, n_tokens, H * D, H * D, 0)
    seq.run()
    check(get(Out, q.shape), attention_ref(q, cache.k, cache.v, pos0, n_kv), 4.5, f"attn q8_1 splits={n_splits}")
    got = XQ.numpy(np.uint8)
    assert np.array_equal(got[:nq], XQ2.numpy(np.uint8)[:nq]), "fused and separate quantization differ"
    assert (got[nq:] == 0xAB).all(), "wrote past the scratch"


def test_attention_q8_1_output_needs_whole_blocks_per_head(seq, bufs):
    with pytest.raises(KernelError, match="head_dim % 32"):
        record_attention(seq, bufs(40), bufs(400, np.float16), bufs(400, np.float16), bufs(1, np.int32),
                         bufs(40), 1, 1, 1, 40, 10, xq=bufs(64))


def test_attention_splits():
    assert attention_splits(1, 32, 8, 4096) == 32       # decode: 8 workgroups -> 32 splits
    assert attention_splits(1, 9, 3, 256) == 2          # short cache: >= 128 positions a split
    assert attention_splits(512, 32, 8, 4096) == 1      # prefill fills the GPU by itself
    # a CPU device (2 cores): one workgroup per core, so SmolLM2's 3 kv heads need no split
    assert attention_splits(1, 9, 3, 4096, target_workgroups=2) == 1
    assert attention_splits(1, 32, 8, 4096, target_workgroups=16) == 2


def test_decode_target_workgroups_by_device_kind():
    """Two workgroups per compute unit of a GPU (264 on an H200's 132 SMs, and on a GPU that
    does not report its units), one per host core on a CPU device."""
    import os
    import types

    from vkxsplit.ops.attention import decode_target_workgroups

    def dev(cpu, units=0):
        return types.SimpleNamespace(physical=types.SimpleNamespace(compute_units=units), is_cpu=cpu)

    assert decode_target_workgroups(dev(True)) == (os.cpu_count() or 1)
    assert decode_target_workgroups(dev(False)) == 264
    assert decode_target_workgroups(dev(False, 132)) == 264
    assert decode_target_workgroups(dev(False, 108)) == 216


def test_attention_validation(seq, bufs):
    A, K, P = bufs(4096), bufs(4096, np.float16), bufs(1, np.int32)
    with pytest.raises(KernelError, match=r"head_dim 512 is not supported \(1\.\.256"):
        record_attention(seq, A, K, K, P, A, 1, 1, 1, 512, 4)
    with pytest.raises(KernelError, match="not a multiple of n_kv_heads"):
        record_attention(seq, A, K, K, P, A, 1, 6, 4, 64, 4)
    with pytest.raises(KernelError, match="needs a scratch buffer"):
        record_attention(seq, A, K, K, P, bufs(64), 1, 1, 1, 64, 4, n_splits=2)
    with pytest.raises(KernelError, match="dst overlaps q"):
        record_attention(seq, A, K, K, P, A, 1, 1, 1, 64, 4)
    with pytest.raises(KernelError, match=r"attn_f16_f32: k_cache .*needs"):
        record_attention(seq, A, K, K, P, bufs(64), 1, 1, 1, 64, 100)
    with pytest.raises(KernelError, match=r"attn: dtype 'bf16'"):
        record_attention(seq, A, K, K, P, bufs(64), 1, 1, 1, 64, 4, dtype="bf16")
    with pytest.raises(KernelError, match=r"kv_store: dtype 'f32'.*supported: f16"):
        record_kv_store(seq, A, A, P, K, K, 1, 1, 64, 4, cache_dtype="f32")
    with pytest.raises(KernelError, match="K and V caches overlap"):
        record_kv_store(seq, A, A, P, K, K, 1, 1, 64, 4)
    assert seq.dispatches == 0
