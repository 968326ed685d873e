"""Mixture-of-experts ops (vkxsplit/ops/moe.py): the routed product mul_mat_id, the router
moe_topk, moe_combine, and the whole MoE FFN chain, against the float64 references of
tests/reference.py (weights dequantized by ``gguf.quants.dequantize``).

Bounds: mul_mat_id as test_mul_mat's f32 products, ``(K + 4) u (|x| @ |W|^T)`` per element
(u = 2^-24, |W| the magnitudes of the dequantization terms); the router's ids exactly (the
logits are drawn far from ties, or tied exactly), its weights to 1e-5 relative. The chain
test also shows that a wrong reference (top-1 routing, or unnormalised weights) fails the
check the right one passes.

The grouped product's cooperative-matrix kernel (``mul_mat_id_coopmat_*``,
``shaders/mul_mat_coopmat.comp`` with ``MUL_MAT_ID``) runs here through its emulated
variants (tools/kernels.py: the same tiling, gather, loaders and scatter without cooperative
matrices), with test_mul_mat's coopmat bound (x and W rounded to f16, f32 accumulation):
``(2^-10 + 2 K 2^-23) (|x| @ |W|^T)`` per element.
"""

from __future__ import annotations

import kernels as tk  # tools/kernels.py: the emulated routed coopmat variants
import numpy as np
import pytest
from reference import moe_ffn, moe_route, mul_mat_id
from test_mul_mat import ALL, U, abs_terms, make_weights, test_k

from vkxsplit.errors import KernelError
from vkxsplit.ops import moe, mul_mat
from vkxsplit.ops.elementwise import record_swiglu
from vkxsplit.ops.mul_mat import record_mul_mat
from vkxsplit.ops.quant import block_size
from vkxsplit.vk.command import Sequence

E = 8  # experts


@pytest.fixture
def bufs(device):
    made = []

    def new(nbytes: int, fill: np.ndarray | None = None, nan: bool = False):
        b = device.memory.alloc(max(nbytes, 16), "host", name="test")
        made.append(b)
        if fill is not None:
            b.numpy(np.uint8, (fill.nbytes,))[:] = np.ascontiguousarray(fill).view(np.uint8).ravel()
        elif nan:
            b.numpy(np.float32, (max(nbytes, 16) // 4,))[:] = np.nan
        return b

    yield new
    for b in made:
        b.close()


def run(device, fn) -> None:
    seq = Sequence(device, "moe")
    try:
        fn(seq)
        seq.run()
    finally:
        seq.close()


def routed_ids(rng, T: int, n_used: int, n_expert: int = E) -> np.ndarray:
    """Distinct experts per token, as a router chooses."""
    return np.stack([rng.permutation(n_expert)[:n_used] for _ in range(T)]).astype(np.int32)


def check(got: np.ndarray, ref: np.ndarray, bound: np.ndarray) -> None:
    assert not np.isnan(got).any(), "NaN in the output: some element was not written"
    err = np.abs(got.astype(np.float64) - ref)
    bad = err > bound
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements over the bound; worst err {err.max():.3g}, "
                           f"ratio {np.max(err / np.maximum(bound, 1e-300)):.3g}")


def mm_id(device, bufs, wb, t, x, ids, N, K, path=None, w_rows=None, w_row0=0, y_stride=None, groups=None,
          **kw):
    """(y, the path taken) of the routed product through record_mul_mat_id (``groups``: a
    filled grouping to use instead of recording one; ``kw``: coop_variant)."""
    T, n_used = ids.shape
    n_xb = x.shape[1]
    xb = bufs(x.nbytes, x.astype(np.float32))
    ib = bufs(ids.nbytes, ids)
    ys = (w_rows or N) if y_stride is None else y_stride
    yb = bufs(4 * T * n_used * ys, nan=True)
    gb = bufs(moe.group_bytes(T, n_used, E), groups)
    took = []
    run(device, lambda s: took.append(moe.record_mul_mat_id(
        s, wb, t, xb, ib, yb, n_expert=E, N=N, K=K, T=T, n_used=n_used, n_xb=n_xb, groups=gb, path=path,
        w_rows=w_rows, w_row0=w_row0, y_stride=y_stride, grouped=groups is not None, **kw)))
    if kw.get("coop_variant"):
        assert took == ["coopmat"]
    return yb.numpy(np.float32, (T, n_used, ys)).copy(), took[0]


def expert_weights(rng, t: str, N: int, K: int):
    raw, W = make_weights(rng, t, E * N, K)
    return raw, W.reshape(E, N, K), abs_terms(raw, t, W).reshape(E, N, K)


def id_bound(x: np.ndarray, A: np.ndarray, ids: np.ndarray, path: str = "vec_f32") -> np.ndarray:
    """The f32 products' bound; for the cooperative-matrix tiles (``path`` coopmat, which
    the grouped path takes on devices with them) test_mul_mat's coopmat bound; for the q8_1
    decode (``vec_q8_1``) test_mul_mat's vecq bound (b)."""
    if path == "coopmat":
        return coop_id_bound(x, A, ids)
    if path == "vec_q8_1":
        return vecq_id_bound(x, A, ids)
    return (x.shape[-1] + 4) * U * mul_mat_id(A, np.abs(x), ids)


def vecq_id_bound(x: np.ndarray, A: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """test_mul_mat's bound (b) of the integer-dot-product mat-vec per routed element: x
    rounded to q8_1 (|x - d q| <= d / 2, quantize_q8_1's rounding as mul_mat.q8_1_reference
    models it) plus (2 nb + 8) u of the exact sums of the quantized x."""
    K = x.shape[-1]
    q, d, _ = mul_mat.q8_1_reference(x.reshape(-1, K).astype(np.float32))
    dfull = np.repeat(d.astype(np.float64), 32, axis=1)
    xdq = (q.astype(np.float64) * dfull).reshape(x.shape)
    return (0.5 * mul_mat_id(A, dfull.reshape(x.shape), ids) * (1 + 2.0 ** -20)
            + (2 * (K // 32) + 8) * U * mul_mat_id(A, np.abs(xdq), ids))


@pytest.mark.parametrize("t", ALL)
@pytest.mark.parametrize("T", [1, 5, 37])
def test_mul_mat_id(device, bufs, rng, t, T):
    """Every hub weight type, decode (the mat-vec path) and prefill (grouped by expert), with
    n_used 1, 2 and all experts, x shared by the slots (gate/up) or one row per slot (down)."""
    N, K = 37, test_k(t)
    raw, W, A = expert_weights(rng, t, N, K)
    wb = bufs(raw.nbytes, raw)
    for n_used in (1, 2, E):
        ids = routed_ids(rng, T, n_used)
        for n_xb in (1, n_used):
            x = rng.standard_normal((T, n_xb, K))
            y, took = mm_id(device, bufs, wb, t, x, ids, N, K)
            check(y, mul_mat_id(W, x, ids), id_bound(x, A, ids, took))


@pytest.mark.parametrize("path", ["vec", "vec_f32", "grouped", "tiled"])
def test_mul_mat_id_paths_agree_and_skew(device, bufs, rng, path):
    """Either path at any T (vec / grouped: the device's choice; vec_f32 / tiled: the f32-x
    mat-vec and the f32 tiles pinned, which devices with integer dot products / cooperative
    matrices no longer take by default for every type); every token routed to the
    same two experts (tiles of 32 pairs: an expert with 37 pairs needs two), and an expert
    nobody chose."""
    t, N, K, T = "q4_k", 70, 256, 37
    raw, W, A = expert_weights(rng, t, N, K)
    wb = bufs(raw.nbytes, raw)
    ids = np.tile(np.array([[5, 2]], np.int32), (T, 1))
    x = rng.standard_normal((T, 1, K))
    y, took = mm_id(device, bufs, wb, t, x, ids, N, K, path=path)
    check(y, mul_mat_id(W, x, ids), id_bound(x, A, ids, took))
    ids1 = routed_ids(rng, 1, 3)
    x1 = rng.standard_normal((1, 3, K))
    y, took = mm_id(device, bufs, wb, t, x1, ids1, N, K, path=path)
    check(y, mul_mat_id(W, x1, ids1), id_bound(x1, A, ids1, took))


@pytest.mark.parametrize("path", ["vec", "grouped"])
def test_mul_mat_id_row_range(device, bufs, rng, path):
    """A tensor split's share: rows [r0, r0 + N) of every expert into y's columns r0.., the
    other columns untouched."""
    t, rows, K, T = "q8_0", 40, 64, 6
    raw, W, A = expert_weights(rng, t, rows, K)
    wb = bufs(raw.nbytes, raw)
    ids = routed_ids(rng, T, 2)
    x = rng.standard_normal((T, 2, K))
    y, took = mm_id(device, bufs, wb, t, x, ids, 13, K, path=path, w_rows=rows, w_row0=9)
    assert np.isnan(y[:, :, :9]).all() and np.isnan(y[:, :, 22:]).all()
    check(y[:, :, 9:22], mul_mat_id(W, x, ids)[:, :, 9:22], id_bound(x, A, ids, took)[:, :, 9:22])


@pytest.mark.parametrize("path", ["vec", "grouped"])
def test_mul_mat_id_bad_id_gives_nan(device, bufs, rng, path):
    """An id outside [0, n_expert) (a corrupt buffer) gives NaN rows, never a wrong expert."""
    t, N, K = "f16", 16, 64
    raw, W, A = expert_weights(rng, t, N, K)
    wb = bufs(raw.nbytes, raw)
    ids = np.array([[1, 8], [-1, 3]], np.int32)
    x = rng.standard_normal((2, 1, K))
    y, took = mm_id(device, bufs, wb, t, x, ids, N, K, path=path)
    assert np.isnan(y[0, 1]).all() and np.isnan(y[1, 0]).all()
    good = np.array([[1, 1], [3, 3]], np.int32)
    ref = mul_mat_id(W, x, good)
    check(y[0, 0], ref[0, 0], id_bound(x, A, good, took)[0, 0])
    check(y[1, 1], ref[1, 1], id_bound(x, A, good, took)[1, 1])


def topk(device, bufs, logits, n_used, **kw):
    T, n_expert = logits.shape
    lb = bufs(logits.nbytes, logits.astype(np.float32))
    ib = bufs(4 * T * n_used)
    wb = bufs(4 * T * n_used, nan=True)
    run(device, lambda s: moe.record_moe_topk(s, lb, ib, wb, T=T, n_expert=n_expert, n_used=n_used, **kw))
    return ib.numpy(np.int32, (T, n_used)).copy(), wb.numpy(np.float32, (T, n_used)).copy()


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_topk(device, bufs, rng, gating, norm):
    T = 37
    # distinct logits at least 1e-3 apart: no near-ties that f32 rounding could reorder
    logits = np.stack([rng.permutation(E) for _ in range(T)]) * 0.25 + rng.uniform(0, 1e-3, (T, 1)) - 1.0
    for n_used in (1, 2, E):
        scale = 2.5 if n_used == 2 else 1.0
        ids, w = topk(device, bufs, logits, n_used, gating=gating, norm=norm, scale=scale)
        rids, rw = moe_route(logits.astype(np.float32), n_used, gating=gating, norm=norm, scale=scale)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_allclose(w, rw, rtol=1e-5, atol=0)


@pytest.mark.parametrize("n_expert", [128, 300, 512])
def test_moe_topk_many_experts(device, bufs, rng, n_expert):
    """Routers wider than the workgroup (each invocation holds several experts; 300: the last
    invocations hold fewer), ties between experts of different invocations and of one
    invocation: the reference's ids in order and its weights."""
    T, n_used = 6, 8
    logits = np.stack([rng.permutation(n_expert) for _ in range(T)]) * 0.01 - 1.0
    top = logits[1].max()
    # a four-way tie: 5 and 37 in one invocation (5 + 32), 70 and the last in others
    logits[1, [n_expert - 1, 70, 37, 5]] = top + 1
    logits[2, :] = 0.5  # all equal: 0..n_used-1
    ids, w = topk(device, bufs, logits, n_used, gating="softmax", norm=True)
    rids, rw = moe_route(logits.astype(np.float32), n_used, gating="softmax", norm=True)
    np.testing.assert_array_equal(ids, rids)
    assert list(ids[1, :4]) == [5, 37, 70, n_expert - 1]
    assert list(ids[2]) == list(range(n_used))
    np.testing.assert_allclose(w, rw, rtol=1e-5, atol=0)


def test_moe_topk_ties(device, bufs):
    """Equal logits: the lower expert index first (a stable descending sort)."""
    logits = np.array([[1, 3, 3, 0, 3, -1, 2, 2],
                       [0, 0, 0, 0, 0, 0, 0, 0],
                       [5, 4, 4, 5, 1, 1, 1, 5]], np.float32)
    ids, w = topk(device, bufs, logits, 4, norm=True)
    np.testing.assert_array_equal(ids, [[1, 2, 4, 6], [0, 1, 2, 3], [0, 3, 7, 1]])
    rids, rw = moe_route(logits, 4)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=1e-5)
    assert np.allclose(w[1], 0.25)


def test_moe_topk_nan_row(device, bufs):
    """A token whose logits are all NaN gets id -1 (which mul_mat_id turns into NaN rows)."""
    logits = np.full((2, E), np.nan, np.float32)
    logits[1] = np.arange(E)
    ids, _ = topk(device, bufs, logits, 2)
    assert (ids[0] == -1).all() and list(ids[1]) == [7, 6]


@pytest.mark.parametrize("n_used", [3, 8, 11])  # (the loads 8 at a time, then the rest)
def test_moe_combine(device, bufs, rng, n_used):
    T, N = 5, 300
    e = rng.standard_normal((T, n_used, N)).astype(np.float32)
    w = rng.uniform(0, 1, (T, n_used)).astype(np.float32)
    eb, wb = bufs(e.nbytes, e), bufs(w.nbytes, w)
    yb = bufs(4 * T * N, nan=True)
    run(device, lambda s: moe.record_moe_combine(s, eb, wb, yb, T=T, n_used=n_used, N=N))
    ref = np.einsum("ts,tsn->tn", w.astype(np.float64), e.astype(np.float64))
    check(yb.numpy(np.float32, (T, N)), ref, (n_used + 2) * U * np.einsum("ts,tsn->tn", w, np.abs(e)) + 1e-30)


def separated_inputs(rng, R: np.ndarray, T: int, n_used: int, margin: float = 0.05) -> np.ndarray:
    """T rows of h whose router logits h @ R^T separate the chosen n_used experts from the
    rest by at least ``margin``: on GPUs the hub's router product of T > 8 rows runs in f16
    (coopmat), which must not flip a near-tie the float64 reference decides otherwise."""
    out = np.empty((T, R.shape[1]), np.float32)
    for t in range(T):
        while True:
            h = rng.standard_normal(R.shape[1]).astype(np.float32)
            lg = np.sort(R.astype(np.float64) @ h)[::-1]
            if n_used == len(lg) or lg[n_used - 1] - lg[n_used] >= margin:
                out[t] = h
                break
    return out


def _chain(device, bufs, rng, T, n_used, t, norm):
    n_embd, n_ff = 64, 96
    R = rng.standard_normal((E, n_embd)).astype(np.float32)
    rawg, G, _ = expert_weights(rng, t, n_ff, n_embd)
    rawu, Uw, _ = expert_weights(rng, t, n_ff, n_embd)
    rawd, D, _ = expert_weights(rng, t, n_embd, n_ff)
    h = separated_inputs(rng, R, T, n_used)
    rb, gb, ub, db = (bufs(a.nbytes, a) for a in (R, rawg, rawu, rawd))
    hb = bufs(h.nbytes, h)
    lb = bufs(4 * T * E)
    ib, wb = bufs(4 * T * n_used), bufs(4 * T * n_used)
    grp = bufs(moe.group_bytes(T, n_used, E))
    ga, ua = bufs(4 * T * n_used * n_ff), bufs(4 * T * n_used * n_ff)
    eo = bufs(4 * T * n_used * n_embd)
    yb = bufs(4 * T * n_embd, nan=True)
    kw = dict(n_expert=E, T=T, n_used=n_used, groups=grp)

    def rec(s):
        record_mul_mat(s, rb, "f32", hb, lb, T, E, n_embd)
        moe.record_moe_topk(s, lb, ib, wb, T=T, n_expert=E, n_used=n_used, norm=norm)
        if T > 1:
            moe.record_moe_group(s, ib, grp, T, n_used, E)
        moe.record_mul_mat_id(s, gb, t, hb, ib, ga, N=n_ff, K=n_embd, n_xb=1, grouped=True, **kw)
        moe.record_mul_mat_id(s, ub, t, hb, ib, ua, N=n_ff, K=n_embd, n_xb=1, grouped=True, **kw)
        record_swiglu(s, ga, ua, ga, T * n_used, n_ff)
        moe.record_mul_mat_id(s, db, t, ga, ib, eo, N=n_embd, K=n_ff, n_xb=n_used, grouped=True, **kw)
        moe.record_moe_combine(s, eo, wb, yb, T=T, n_used=n_used, N=n_embd)

    run(device, rec)
    got = yb.numpy(np.float32, (T, n_embd)).copy()
    return got, (h.astype(np.float64), R.astype(np.float64), G, Uw, D)


def q8_1_round(x: np.ndarray) -> np.ndarray:
    """x (..., K) as quantize_q8_1 rounds it (d q per element; mul_mat.q8_1_reference)."""
    K = x.shape[-1]
    q, d, _ = mul_mat.q8_1_reference(x.reshape(-1, K).astype(np.float32))
    return (q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)).reshape(x.shape)


def moe_ffn_q8_1(h, router, gate, up, down, n_used: int, norm: bool = True) -> np.ndarray:
    """reference.moe_ffn with the x of each expert product rounded to q8_1 blocks first (the
    decode's integer-dot-product path), float64 otherwise."""
    ids, w = moe_route(h @ router.T, n_used, norm=norm)
    x = q8_1_round(h[:, None, :])
    a = mul_mat_id(gate, x, ids)
    act = a / (1.0 + np.exp(-a)) * mul_mat_id(up, x, ids)
    return np.einsum("ts,tsn->tn", w, mul_mat_id(down, q8_1_round(act), ids))


@pytest.mark.parametrize("T", [1, 5, 37])
def test_moe_ffn_chain(device, bufs, rng, T):
    """router mul_mat -> moe_topk -> gate/up mul_mat_id -> swiglu -> down mul_mat_id ->
    combine against reference.moe_ffn, within 2e-3 of max|y| (the router's f16 coopmat on GPUs
    moves the weights by ~1e-4; lavapipe's f32 path stays under 1e-5); the same check fails
    for top-1 routing and for unnormalised weights. Where the expert products take the q8_1
    decode (x rounded to 8-bit blocks, as ggml's MMVQ; ~1e-2 of max|y| here) the reference
    rounds the products' x the same way (moe_ffn_q8_1)."""
    n_used = 2
    got, (h, R, G, Uw, D) = _chain(device, bufs, rng, T, n_used, "q8_0", norm=True)
    q8 = moe.default_path(device, "q8_0", T, n_used, E) == "vec_q8_1"
    ffn = moe_ffn_q8_1 if q8 else moe_ffn
    ref = ffn(h, R, G, Uw, D, n_used)
    scale = np.abs(ref).max()
    bound = 2e-3 * scale
    assert np.abs(got - ref).max() <= bound
    wrong_top1 = ffn(h, R, G, Uw, D, 1)
    wrong_nonorm = ffn(h, R, G, Uw, D, n_used, norm=False)
    assert np.abs(got - wrong_top1).max() > bound
    assert np.abs(got - wrong_nonorm).max() > bound


def test_errors(device, bufs):
    w = bufs(E * 16 * 64 * 4)
    x, ids, y, g = bufs(4 * 64 * 2), bufs(8), bufs(4 * 2 * 16), bufs(moe.group_bytes(1, 2, E))
    seq = Sequence(device, "moe-errors")
    try:
        kw = dict(n_expert=E, N=16, K=64, T=1, n_used=2)
        with pytest.raises(KernelError, match="1 .shared by every slot. or n_used"):
            moe.record_mul_mat_id(seq, w, "f32", x, ids, y, n_xb=3, **kw)
        with pytest.raises(KernelError, match="n_used = 9 must be in 1..n_expert"):
            moe.record_mul_mat_id(seq, w, "f32", x, ids, y, n_xb=1, **{**kw, "n_used": 9})
        with pytest.raises(KernelError, match="block size 32"):
            moe.record_mul_mat_id(seq, w, "q8_0", x, ids, y, n_xb=1, **{**kw, "K": 48})
        with pytest.raises(KernelError, match="do not fit the weight binding"):
            moe.record_mul_mat_id(seq, w, "f32", x, ids, y, n_xb=1, **{**kw, "N": 17})
        with pytest.raises(KernelError, match="needs a groups buffer"):
            moe.record_mul_mat_id(seq, w, "f32", x, ids, y, n_xb=1, path="grouped", **kw)
        with pytest.raises(KernelError, match="y overlaps x"):
            moe.record_mul_mat_id(seq, w, "f32", x, ids, x, n_xb=1, **{**kw, "N": 1})
        with pytest.raises(KernelError, match="gating function 'relu'"):
            moe.record_moe_topk(seq, x, ids, y, T=1, n_expert=E, n_used=2, gating="relu")
        with pytest.raises(KernelError, match="handle 1..512 experts"):
            moe.record_moe_group(seq, ids, g, 1, 2, 513)
        with pytest.raises(KernelError, match="IQ1_S has no vkxsplit kernel"):
            moe.check_mul_mat_id("iq1_s", E, 16, 256, 2, 1, 1)
    finally:
        seq.close()


# ------------------------------------------------------------------------------------------
# the grouped product's cooperative-matrix kernel, through its emulated variants


def coop_id_bound(x: np.ndarray, A: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """test_mul_mat's coopmat bound per routed element (A: the magnitudes of the terms)."""
    return (2.0 ** -10 + 2 * x.shape[-1] * 2.0 ** -23) * mul_mat_id(A, np.abs(x), ids)


def skewed_ids(rng, T: int) -> np.ndarray:
    """(T, 2) ids with uneven pair counts: slot 0 expert 5 for every token (T > 32: two tiles,
    the second partial), slot 1 drawn from the others but 3 (expert 3: no pairs at all)."""
    other = np.array([0, 1, 2, 4, 6, 7], np.int32)
    return np.stack([np.full(T, 5, np.int32), rng.choice(other, T)], axis=1)


def _coop_ks(t: str) -> list[int]:
    # floats: K = 100 (vec4 x rows, the last 8-element W unit straddles K) and 99 (element
    # loads); quantized: a multiple of the block that is no multiple of BK = 64 (96) or spans
    # several K steps per super-block (512)
    return [100, 99] if block_size(t) == 1 else [test_k(t)]


@pytest.mark.parametrize("t", ALL)
def test_mul_mat_id_coopmat_emu(device, bufs, rng, t, tool_kernels):
    """Every weight type through the shipped tiling's emulation (32 pairs x 128 rows, BK 64):
    T = 37 tokens (not a multiple of the 32-pair tile), an expert with 37 pairs (two tiles),
    uneven counts, an expert with none, N = 150 (a full and a partial 128-row tile), x shared
    by the slots (gate/up) and one row per slot (down); against the float64 reference."""
    name = moe.coop_id_name(t, emulate=True)
    tool_kernels(name)
    T, N = 37, 150
    for K in _coop_ks(t):
        raw, W, A = expert_weights(rng, t, N, K)
        wb = bufs(raw.nbytes, raw)
        ids = skewed_ids(rng, T)
        for n_xb in (1, 2):
            x = rng.standard_normal((T, n_xb, K))
            y, _ = mm_id(device, bufs, wb, t, x, ids, N, K, path="coopmat", coop_variant=name)
            check(y, mul_mat_id(W, x, ids), coop_id_bound(x, A, ids))


@pytest.mark.parametrize("name", sorted(n for n in tk.COOP_ID_VARIANTS if tk.COOP_ID_VARIANTS[n][2]
                                        and not n.endswith("_f32")))
def test_mul_mat_id_coopmat_emu_tilings(device, bufs, rng, name, tool_kernels):
    """The other emulated tiling (double-buffered BK 32, 64 rows, one fragment row per
    subgroup), all experts used (n_used = E), a row range of a tensor split."""
    tool_kernels(name)
    t = tk.COOP_ID_VARIANTS[name][0]
    T, rows, K = 19, 90, _coop_ks(t)[0]
    raw, W, A = expert_weights(rng, t, rows, K)
    wb = bufs(raw.nbytes, raw)
    ids = routed_ids(rng, T, E)
    x = rng.standard_normal((T, E, K))
    check(mm_id(device, bufs, wb, t, x, ids, rows, K, path="coopmat", coop_variant=name)[0],
          mul_mat_id(W, x, ids), coop_id_bound(x, A, ids))
    y, _ = mm_id(device, bufs, wb, t, x, ids, 70, K, path="coopmat", coop_variant=name, w_rows=rows, w_row0=11)
    assert np.isnan(y[:, :, :11]).all() and np.isnan(y[:, :, 81:]).all()
    check(y[:, :, 11:81], mul_mat_id(W, x, ids)[:, :, 11:81], coop_id_bound(x, A, ids)[:, :, 11:81])


def test_mul_mat_id_coopmat_emu_row_range_and_bad_ids(device, bufs, rng, tool_kernels):
    """A tensor split's share (rows [9, 22) of each expert into y's columns 9.., y rows of 40
    elements, the rest untouched), and ids outside [0, n_expert): NaN rows, never a wrong
    expert."""
    t = "q8_0"
    name = moe.coop_id_name(t, emulate=True)
    tool_kernels(name)
    rows, K, T = 40, 64, 6
    raw, W, A = expert_weights(rng, t, rows, K)
    wb = bufs(raw.nbytes, raw)
    ids = routed_ids(rng, T, 2)
    x = rng.standard_normal((T, 2, K))
    y, _ = mm_id(device, bufs, wb, t, x, ids, 13, K, path="coopmat", coop_variant=name, w_rows=rows, w_row0=9)
    assert np.isnan(y[:, :, :9]).all() and np.isnan(y[:, :, 22:]).all()
    check(y[:, :, 9:22], mul_mat_id(W, x, ids)[:, :, 9:22], coop_id_bound(x, A, ids)[:, :, 9:22])
    bad = np.array([[1, 8], [-1, 3]], np.int32)
    x2 = rng.standard_normal((2, 1, K))
    y, _ = mm_id(device, bufs, wb, t, x2, bad, rows, K, path="coopmat", coop_variant=name)
    assert np.isnan(y[0, 1]).all() and np.isnan(y[1, 0]).all()
    good = np.array([[1, 1], [3, 3]], np.int32)
    check(y[0, 0], mul_mat_id(W, x2, good)[0, 0], coop_id_bound(x2, A, good)[0, 0])
    check(y[1, 1], mul_mat_id(W, x2, good)[1, 1], coop_id_bound(x2, A, good)[1, 1])


def numpy_grouping(ids: np.ndarray, n_expert: int, gather: bool = True) -> np.ndarray:
    """moe_group.comp's layout written independently: counts, offsets, tile count, tiles of
    32 pairs, the row map. ``gather=False``: a deliberately wrong row map, pairs in token order
    (each expert's tiles then read the first pairs of the batch, not its own)."""
    P = ids.size
    flat = ids.ravel()
    counts = np.bincount(flat, minlength=n_expert + 1)[:n_expert + 1]
    offs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tiles = [(e, r) for e in range(n_expert + 1) for r in range(0, counts[e], moe.TILE_BM)]
    rows = np.argsort(flat, kind="stable") if gather else np.arange(P)
    words = np.zeros(moe.group_words(*ids.shape, n_expert), np.uint32)
    words[:n_expert + 1] = counts
    words[n_expert + 1:2 * n_expert + 2] = offs
    words[2 * n_expert + 2] = len(tiles)
    t0 = 2 * n_expert + 3
    words[t0:t0 + 2 * len(tiles)] = np.array(tiles, np.uint32).ravel()
    r0 = t0 + 2 * moe.max_tiles(P, n_expert)
    words[r0:r0 + P] = rows
    return words


def test_mul_mat_id_coopmat_emu_gathers_rows(device, bufs, rng, tool_kernels):
    """The same check fails where the rows are not gathered: an independent numpy grouping
    gives the reference's answer; the same grouping with the row map in token order (every
    expert's tile reading the first pairs of the batch) is caught by the bound."""
    t = "q4_k"
    name = moe.coop_id_name(t, emulate=True)
    tool_kernels(name)
    T, N, K = 37, 64, 256
    raw, W, A = expert_weights(rng, t, N, K)
    wb = bufs(raw.nbytes, raw)
    ids = skewed_ids(rng, T)
    x = rng.standard_normal((T, 1, K))
    ref, bound = mul_mat_id(W, x, ids), coop_id_bound(x, A, ids)
    good, _ = mm_id(device, bufs, wb, t, x, ids, N, K, path="coopmat", coop_variant=name,
                    groups=numpy_grouping(ids, E))
    check(good, ref, bound)
    wrong, _ = mm_id(device, bufs, wb, t, x, ids, N, K, path="coopmat", coop_variant=name,
                     groups=numpy_grouping(ids, E, gather=False))
    with pytest.raises(AssertionError, match="over the bound"):
        check(wrong, ref, bound)


def test_grouped_path_choice(device, bufs, rng, monkeypatch):
    """``grouped`` takes the cooperative-matrix tiles exactly where the dense products have the
    coopmat path (lavapipe: the f32 tiles); the default (default_path) as documented; pinning coopmat where there is none, a variant of
    another type or a variant without path coopmat are errors naming the cause."""
    from vkxsplit.ops.choose import kernels_for

    kc = kernels_for(device)
    assert moe.grouped_path(device) == ("coopmat" if kc.coopmat_available else "tiled")
    t, N, K, T = "q8_0", 16, 64, 12
    raw, W, A = expert_weights(rng, t, N, K)
    wb = bufs(raw.nbytes, raw)
    ids = routed_ids(rng, T, E)
    x = rng.standard_normal((T, 1, K))
    took = []
    xb, ib = bufs(x.nbytes, x.astype(np.float32)), bufs(ids.nbytes, ids)
    yb, gb = bufs(4 * T * E * N), bufs(moe.group_bytes(T, E, E))
    kw = dict(n_expert=E, N=N, K=K, T=T, n_used=E, n_xb=1, groups=gb)
    run(device, lambda s: took.append(moe.record_mul_mat_id(s, wb, t, xb, ib, yb, **kw)))
    # the default: grouped from GROUPED_PAIRS_PER_EXPERT pairs per expert, the mat-vec below
    assert took == [moe.default_path(device, t, T, E, E)] == [moe.grouped_path(device)]
    assert moe.default_path(device, "f16", 1, E, E) == "vec_f32"
    assert moe.default_path(device, t, 1, E, E) == moe.vec_path(device, t, 1)
    check(yb.numpy(np.float32, (T, E, N)), mul_mat_id(W, x, ids), id_bound(x, A, ids, took[0]))
    seq = Sequence(device, "moe-choice")
    try:
        if not kc.coopmat_available:
            with pytest.raises(KernelError, match="the coopmat path (needs f16 16x16x16|is switched off)"):
                moe.record_mul_mat_id(seq, wb, t, xb, ib, yb, path="coopmat", **kw)
        with pytest.raises(KernelError, match="not a built routed cooperative-matrix kernel for Q8_0"):
            moe.record_mul_mat_id(seq, wb, t, xb, ib, yb, path="coopmat", coop_variant=moe.coop_id_name("q4_0"),
                                  **kw)
        with pytest.raises(KernelError, match="needs path 'coopmat'"):
            moe.record_mul_mat_id(seq, wb, t, xb, ib, yb, path="grouped", coop_variant=moe.coop_id_name(t), **kw)
    finally:
        seq.close()

    class FakeKernels:
        coopmat_available = True

    monkeypatch.setattr(moe, "kernels_for", lambda dev: FakeKernels())
    assert moe.grouped_path(device) == "coopmat"


# ------------------------------------------------------------------------------------------
# the decode's integer-dot-product routed mat-vec (x quantized to q8_1)

VECQ_ID = {**moe._vecq_id_shipped(), **tk.VECQ_ID_SWEEP}


@pytest.mark.parametrize("name", sorted(VECQ_ID))
def test_mul_mat_id_vecq(device, bufs, rng, name, tool_kernels):
    """Each routed q8_1 decode shape, shipped (the CPU devices' and the GPUs' per type) and of
    the benchmark's sweep (those the device lacks features for skip): one token (decode) and 3 tokens, x shared by the
    slots and one row per slot, N not a multiple of the rows per workgroup; against the
    float64 reference within the vecq bound. The same bound fails for a reference that
    takes slot 0's x row for every slot of the down product (rows not gathered)."""
    tool_kernels(name)
    t, cfg = VECQ_ID[name]
    missing = [f for f in moe.make_vecq_id_variant(name, t, cfg).requires if not device.features.get(f)]
    if missing:
        pytest.skip(f"'{device.name}' lacks {', '.join(missing)}")
    N, K = 2 * cfg.rows * 3 + 5, 512
    raw, W, A = expert_weights(rng, t, N, K)
    wb = bufs(raw.nbytes, raw)
    for T in (1, 3):
        ids = routed_ids(rng, T, 3)
        for n_xb in (1, 3):
            x = rng.standard_normal((T, n_xb, K))
            y, took = mm_id(device, bufs, wb, t, x, ids, N, K, path="vec_q8_1", vec_variant=name)
            assert took == "vec_q8_1"
            bound = vecq_id_bound(x, A, ids)
            check(y, mul_mat_id(W, x, ids), bound)
            if n_xb == 3:
                with pytest.raises(AssertionError, match="over the bound"):
                    check(y, mul_mat_id(W, x[:, :1], ids), bound)


def test_mul_mat_id_vecq_row_range_and_bad_ids(device, bufs, rng):
    """The device's own q8_1 decode kernel (skipped where it has none), for 2 tokens: a tensor
    split's row range into y's columns 9.. (the rest untouched), and ids outside [0, n_expert)
    giving NaN rows."""
    t = "q4_k"
    if moe.vec_path(device, t) != "vec_q8_1":
        pytest.skip(f"'{device.name}' takes the f32-x decode for {t}")
    rows, K = 40, 256
    raw, W, A = expert_weights(rng, t, rows, K)
    wb = bufs(raw.nbytes, raw)
    ids = routed_ids(rng, 2, 2)
    x = rng.standard_normal((2, 2, K))
    y, took = mm_id(device, bufs, wb, t, x, ids, 13, K, path="vec_q8_1", w_rows=rows, w_row0=9)
    assert took == "vec_q8_1"
    assert np.isnan(y[:, :, :9]).all() and np.isnan(y[:, :, 22:]).all()
    check(y[:, :, 9:22], mul_mat_id(W, x, ids)[:, :, 9:22], vecq_id_bound(x, A, ids)[:, :, 9:22])
    bad = np.array([[1, 8], [-1, 3]], np.int32)
    y, _ = mm_id(device, bufs, wb, t, x, bad, rows, K, path="vec_q8_1")
    assert np.isnan(y[0, 1]).all() and np.isnan(y[1, 0]).all()
    good = np.array([[1, 1], [3, 3]], np.int32)
    check(y[0, 0], mul_mat_id(W, x, good)[0, 0], vecq_id_bound(x, A, good)[0, 0])
    check(y[1, 1], mul_mat_id(W, x, good)[1, 1], vecq_id_bound(x, A, good)[1, 1])


def test_mul_mat_id_vecq_reads_the_producers_q8_1(device, bufs, rng):
    """The decode's down product as the q8_1 pass records it: the MoE SwiGLU over the T *
    n_used rows of gate/up also writes them as q8_1 (record_swiglu_q8_1), and the routed
    product reads that scratch with ``quantize=False`` (no quantize dispatch of its own):
    the scratch's rows are the product's x rows per (token, slot) (n_xb = n_used), so y is
    bit for bit the self-quantizing product's of the SwiGLU's output, and within the vecq
    bound of the float64 product. Reading the q8_1 of another x (gate's, not the SwiGLU's)
    fails that check; ``quantize=False`` without a scratch, or off the q8_1 path, is refused."""
    from vkxsplit.ops.mul_mat import record_swiglu_q8_1, vecq_scratch_bytes

    t, T, n_used, F, N = "q8_0", 1, 2, 96, 40
    if moe.vec_path(device, t) != "vec_q8_1":
        pytest.skip(f"'{device.name}' takes the f32-x decode for {t}")
    raw, W, A = expert_weights(rng, t, N, F)
    wb = bufs(raw.nbytes, raw)
    ids = routed_ids(rng, T, n_used)
    ib = bufs(ids.nbytes, ids)
    g = rng.standard_normal((T, n_used, F)).astype(np.float32)
    u = rng.standard_normal((T, n_used, F)).astype(np.float32)
    gb, ub, hb = bufs(g.nbytes, g), bufs(u.nbytes, u), bufs(g.nbytes, nan=True)
    xq = bufs(vecq_scratch_bytes(T * n_used, F))
    kw = dict(n_expert=E, N=N, K=F, T=T, n_used=n_used, n_xb=n_used)
    y_given, y_own, y_wrong = (bufs(4 * T * n_used * N, nan=True) for _ in range(3))

    def rec(seq):
        record_swiglu_q8_1(seq, gb, ub, hb, xq, T * n_used, F)
        moe.record_mul_mat_id(seq, wb, t, hb, ib, y_given, path="vec_q8_1", xq_scratch=xq, quantize=False, **kw)
        moe.record_mul_mat_id(seq, wb, t, hb, ib, y_own, path="vec_q8_1", **kw)

    run(device, rec)
    h = hb.numpy(np.float32, g.shape).astype(np.float64)
    gg, uu = g.astype(np.float64), u.astype(np.float64)
    np.testing.assert_allclose(h, gg / (1 + np.exp(-gg)) * uu, rtol=1e-5, atol=1e-6)
    got = y_given.numpy(np.float32, (T, n_used, N)).copy()
    assert np.array_equal(got, y_own.numpy(np.float32, (T, n_used, N)))
    check(got, mul_mat_id(W, h, ids), vecq_id_bound(h, A, ids))
    # the q8_1 of gate's rows instead of the SwiGLU's: far outside the bound
    run(device, lambda seq: (mul_mat.record_quantize_q8_1(seq, gb, xq, T * n_used, F, F, 0),
                             moe.record_mul_mat_id(seq, wb, t, hb, ib, y_wrong, path="vec_q8_1", xq_scratch=xq,
                                                   quantize=False, **kw)))
    with pytest.raises(AssertionError):
        check(y_wrong.numpy(np.float32, (T, n_used, N)), mul_mat_id(W, h, ids), vecq_id_bound(h, A, ids))
    seq = Sequence(device, "moe-given-q8")
    try:
        with pytest.raises(KernelError, match="quantize=False reads x as q8_1 from the given xq_scratch"):
            moe.record_mul_mat_id(seq, wb, t, hb, ib, y_wrong, path="vec_q8_1", quantize=False, **kw)
        with pytest.raises(KernelError, match="needs path 'vec_q8_1' .not 'vec_f32'."):
            moe.record_mul_mat_id(seq, wb, t, hb, ib, y_wrong, path="vec_f32", xq_scratch=xq, quantize=False, **kw)
    finally:
        seq.close()


def test_vec_path_choice(device, bufs, rng):
    """``vec`` takes the q8_1 kernel at T = 1 exactly for the types the dense decode does (Q4_0,
    Q4_1, Q8_0, Q4_K on GPUs; Q6_K too on CPU devices; none without integer dot products), the
    f32 mat-vec otherwise and for several tokens (as the dense mat-vec of M > 1); pinning a variant of another type, or one without path vec_q8_1, is an
    error naming the cause."""
    from vkxsplit.ops.choose import kernels_for

    kc = kernels_for(device)
    for t in ALL:
        assert moe.vec_path(device, t) == ("vec_q8_1" if kc.vecq(t, 1) else "vec_f32")
        assert moe.vec_path(device, t, 3) == "vec_f32"
    assert moe.vec_path(device, "f16") == "vec_f32"
    w, x, ids, y = bufs(E * 16 * 144), bufs(4 * 256), bufs(8), bufs(4 * 2 * 16)
    q4k = moe.vecq_id_name("q4_k", moe.vecq_id_config("q4_k", True))
    q40 = moe.vecq_id_name("q4_0", moe.vecq_id_config("q4_0", True))
    seq = Sequence(device, "moe-vec-choice")
    try:
        kw = dict(n_expert=E, N=16, K=256, T=1, n_used=2, n_xb=1)
        with pytest.raises(KernelError, match="not a built routed q8_1 kernel for Q4_K"):
            moe.record_mul_mat_id(seq, w, "q4_k", x, ids, y, path="vec_q8_1", vec_variant=q40, **kw)
        with pytest.raises(KernelError, match="needs path 'vec_q8_1'"):
            moe.record_mul_mat_id(seq, w, "q4_k", x, ids, y, path="vec", vec_variant=q4k, **kw)
        with pytest.raises(KernelError, match="no integer-dot-product decode for F16"):
            moe.record_mul_mat_id(seq, bufs(E * 16 * 512), "f16", x, ids, y, path="vec_q8_1", **kw)
    finally:
        seq.close()


def test_routed_variant_tables():
    """What ships of the routed kernels: per type the f32 module, the cooperative-matrix tiles
    (the dense coopmat source with MUL_MAT_ID, COOP_ID_TILE's tiling, the dense kernel's
    requirements) and, for the integer-dot-product types, the q8_1 decode shapes the device
    kinds choose; the emulated twins (tools/kernels.py: the same defines plus COOPMAT_EMULATE,
    no cooperative-matrix features) and the sweep tilings do not ship."""
    from vkxsplit import shaders
    from vkxsplit.ops import mul_mat_kernels as mk

    allv = shaders.all_variants()
    declared = tk.all_declared()
    for t in ALL:
        v = allv[moe.coop_id_name(t)]
        assert v.source == "mul_mat_coopmat.comp" and v.defines["MUL_MAT_ID"] == "1"
        assert mk.CoopTile.from_defines({k: str(x) for k, x in v.spec.items()}) == moe.COOP_ID_TILE
        assert v.bindings == 4 and v.writes == (2,) and v.module == mk.coop_module_name(t, routed=True)
        assert "cooperativeMatrix" in v.requires and v.subgroup_size == mk.COOP_SUBGROUP and v.push == moe.PUSH_ID
        e = declared[moe.coop_id_name(t, emulate=True)]
        assert e.name not in allv and {**v.defines, "COOPMAT_EMULATE": "1"} == e.defines and e.spec == v.spec
        assert "cooperativeMatrix" not in e.requires
    vq = {n for n, v in allv.items() if v.source == "mul_mat_vecq.comp" and "MUL_MAT_ID" in v.defines}
    want = {moe.vecq_id_name(t, moe.vecq_id_config(t, cpu)) for t in mk.VECQ_TYPES
            for cpu in ((True, False) if t in mk.VECQ_GPU_TYPES else (True,))}
    assert vq == want and all(allv[n].spec["MAXM"] == 1 and allv[n].bindings == 4 for n in vq)
    assert not {n for n, (_, _, emu) in tk.COOP_ID_VARIANTS.items()} & set(allv)
