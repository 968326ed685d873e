"""mul_mat kernels (vkxsplit/ops/mul_mat.py) against a float64 numpy reference.

Weights: ``gguf.quants.quantize`` for the types it implements (F16, BF16, Q4_0..Q8_0), random
valid blocks (random bytes with finite f16 scales) for the K-quants and IQ4_NL / IQ4_XS (gguf
cannot quantize them); the reference multiplies by ``gguf.quants.dequantize`` of the same
bytes, in float64.

Error bound (elementwise): |y - ref| <= (K + 4) * 2^-24 * (|x| @ A^T), where A = |W| for
types whose weights are sc * code, and for the types with an additive min (Q4_1, Q5_1: d q + m;
Q2_K, Q4_K, Q5_K: d sc q - dmin m) A = |d| q + |m| (resp. |d| sc q + |dmin| m), the sum of the
magnitudes of the two terms, computed by dequantizing the same blocks with the signs of the
f16 scale fields adjusted. That is the worst-case first-order bound of an f32 dot product of
K terms summed in any order (gamma_K = K u, u = 2^-24), which also covers the kernels'
factoring of block scales (sc * sum(code * x) + mn * sum(x): each term goes through fewer
than K roundings, and the min term is bounded by |m| |x|) and numpy's own rounding of the
reference weights (the + 4). It does not depend on the kernels' summation order and was
fixed before any run. The coopmat path rounds x and W to f16 (u = 2^-11 each) and may
accumulate with truncation: (2^-10 + 2 K 2^-23) * (|x| @ A^T) instead.
"""

from __future__ import annotations

import types
from dataclasses import replace

import kernels as tk  # tools/kernels.py: the experiment variants (sweep shapes, emulations)
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from vkxsplit import shaders
from vkxsplit.errors import KernelError
from vkxsplit.ops import choose
from vkxsplit.ops import mul_mat as mm
from vkxsplit.ops import mul_mat_kernels as mk
from vkxsplit.ops.choose import kernels_for
from vkxsplit.ops.quant import TYPES, block_size, row_bytes, weight_type
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.kernel import View

ALL = list(TYPES)
FLOATS = ["f32", "f16", "bf16"]
QUANTIZABLE = ["f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
U = 2.0 ** -24

# byte offsets and magnitudes of the f16 scale fields of each block type: (offset, lo, hi)
_SCALES = {
    "q4_0": [(0, 0.05, 0.3)], "q5_0": [(0, 0.03, 0.15)], "q8_0": [(0, 0.002, 0.02)],
    "q4_1": [(0, 0.05, 0.3), (2, 0.2, 2.0)], "q5_1": [(0, 0.03, 0.15), (2, 0.2, 2.0)],
    "q4_k": [(0, 0.001, 0.01), (2, 0.001, 0.01)], "q5_k": [(0, 0.0005, 0.005), (2, 0.001, 0.01)],
    "q6_k": [(208, 0.0002, 0.002)],
    "q2_k": [(80, 0.002, 0.02), (82, 0.001, 0.01)], "q3_k": [(108, 0.0005, 0.005)],
    "iq4_nl": [(0, 0.002, 0.02)], "iq4_xs": [(0, 0.0001, 0.001)],
}


def gtype(t: str) -> GGMLQuantizationType:
    return weight_type(t).ggml


def test_k(t: str) -> int:
    """A row length that is a multiple of the block size but of no tile size."""
    return {1: 96, 32: 96, 256: 512}[block_size(t)]


test_k.__test__ = False  # a helper, not a test


def random_blocks(rng: np.random.Generator, t: str, rows: int, k: int) -> np.ndarray:
    """Random valid blocks: every quant byte random, f16 scales finite, normal, random sign."""
    bs, bb = GGML_QUANT_SIZES[gtype(t)]
    nb = k // bs
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    for off, lo, hi in _SCALES[t]:
        d = (rng.uniform(lo, hi, (rows, nb)) * rng.choice([-1.0, 1.0], (rows, nb))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * bb)


def make_weights(rng: np.random.Generator, t: str, rows: int, k: int,
                 random_bits: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(raw ggml bytes [rows, row_bytes], the dequantized float64 reference [rows, k])."""
    g = gtype(t)
    if t == "f32":
        w = rng.standard_normal((rows, k)).astype(np.float32)
        return w.view(np.uint8).reshape(rows, -1), w.astype(np.float64)
    if t in QUANTIZABLE and (not random_bits or t in FLOATS):
        raw = np.ascontiguousarray(quantize(rng.standard_normal((rows, k)).astype(np.float32), g))
        raw = raw.view(np.uint8).reshape(rows, -1)
    else:
        raw = random_blocks(rng, t, rows, k)
    assert raw.shape == (rows, row_bytes(t, k))
    ref = dequantize(raw.view(np.float16) if t == "f16" else raw, g)
    return raw, np.asarray(ref, dtype=np.float64).reshape(rows, k)


# byte offsets of the f16 (scale, min) fields of the types with an additive min, and whether
# the min field is subtracted (K-quants: d sc q - dmin m)
_MIN_FIELDS = {"q4_1": (0, 2, False), "q5_1": (0, 2, False), "q4_k": (0, 2, True), "q5_k": (0, 2, True),
               "q2_k": (80, 82, True)}


def abs_terms(raw: np.ndarray, t: str, w: np.ndarray) -> np.ndarray:
    """Per-element sum of the magnitudes of the dequantization terms (see the module doc)."""
    if t not in _MIN_FIELDS:
        return np.abs(w)
    ds, ms, sub = _MIN_FIELDS[t]
    bs, bb = GGML_QUANT_SIZES[gtype(t)]
    blocks = raw.reshape(raw.shape[0], -1, bb).copy()
    blocks[:, :, ds + 1] &= 0x7F                      # |d|
    if sub:
        blocks[:, :, ms + 1] |= 0x80                  # -|dmin|: d sc q - (-|dmin|) m
    else:
        blocks[:, :, ms + 1] &= 0x7F                  # |m|
    a = dequantize(blocks.reshape(raw.shape), gtype(t))
    return np.asarray(a, dtype=np.float64).reshape(w.shape)


class Bufs:
    """Host-visible buffers freed at the end of a test."""

    def __init__(self, device):
        self.device = device
        self.bufs = []

    def new(self, nbytes: int, fill: np.ndarray | None = None):
        b = self.device.memory.alloc(max(nbytes, 4), "host", name="test")
        self.bufs.append(b)
        if fill is not None:
            b.numpy(np.uint8, (fill.nbytes,))[:] = np.ascontiguousarray(fill).view(np.uint8).ravel()
        return b

    def close(self):
        for b in self.bufs:
            b.close()


@pytest.fixture
def bufs(device):
    b = Bufs(device)
    yield b
    b.close()


def target_cols(y, M, n, yo, ys, c0):
    """Columns [c0, c0 + n) of the M rows of y (rows ys apart from element yo), after checking
    that everything else is still NaN (nothing written outside the target columns)."""
    region = np.zeros(y.size, bool)
    got = np.empty((M, n), np.float32)
    for m in range(M):
        sl = slice(yo + m * ys + c0, yo + m * ys + c0 + n)
        region[sl] = True
        got[m] = y[sl]
    assert np.isnan(y[~region]).all(), "wrote outside the target columns"
    return got


def strided_x(bufs, x, stride, offset):
    """A new f32 buffer holding the rows of ``x`` ``stride`` elements apart from element
    ``offset``; everything else is NaN (padding must never be read)."""
    M, K = x.shape
    full = np.full(offset + M * stride, np.nan, np.float32)
    for m in range(M):
        full[offset + m * stride: offset + m * stride + K] = x[m]
    return bufs.new(full.nbytes, full)


def nan_y(bufs, n):
    """A new f32 buffer of ``n`` elements poisoned with NaN, and its numpy view."""
    yb = bufs.new(4 * n)
    y = yb.numpy(np.float32, (n,))
    y[:] = np.nan
    return yb, y


def run_mm(device, bufs, w_buf, t, x, M, N, K, y_elems, path, **kw):
    """Run one mul_mat with y poisoned by NaN; returns (y as float32 array, path taken)."""
    xb = bufs.new(x.nbytes, x.astype(np.float32))
    yb, y = nan_y(bufs, y_elems)
    seq = Sequence(device, "mm")
    try:
        took = mm.record_mul_mat(seq, w_buf, t, xb, yb, M, N, K, path=path, **kw)
        seq.run()
    finally:
        seq.close()
    return y.copy(), took


def check(got, ref, bound):
    assert not np.isnan(got).any(), "NaN in the output: some element was not written"
    err = np.abs(got.astype(np.float64) - ref)
    bad = err > bound
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements over the bound; worst err "
                           f"{err.max():.3g}, ratio {np.max(err / np.maximum(bound, 1e-300)):.3g}")


def bound_f32(x, a):
    """a: abs_terms() of the weights"""
    return (x.shape[1] + 4) * U * (np.abs(x) @ a.T)


@pytest.mark.parametrize("t", ALL)
def test_mat_vec(device, bufs, rng, t):
    N, K = 37, test_k(t)
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    for M in (1, 2, 3, 8):  # the m1, m2, m4 and m8 variants
        x = rng.standard_normal((M, K))
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, None)
        assert took == "vec"
        check(y.reshape(M, N), x @ W.T, bound_f32(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("t", ALL)
def test_tiled(device, bufs, rng, t):
    N, K = 70, test_k(t)
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    for M in (17, 64):
        x = rng.standard_normal((M, K))
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "tiled")
        assert took == "tiled"
        check(y.reshape(M, N), x @ W.T, bound_f32(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("path", ["vec", "tiled"])
@pytest.mark.parametrize("t", ALL)
def test_row_range_and_strides(device, bufs, rng, t, path):
    """Rows [r0, r0 + n) of W into y columns [r0, r0 + n); x rows with a stride that is not a
    multiple of 4 and an offset (scalar x loads); y with a wider stride and an offset. Nothing
    outside the target region may be written."""
    n_total, r0, n, K = 45, 6, 23, test_k(t)
    M = 3 if path == "vec" else 19
    raw, W = make_weights(rng, t, n_total, K)
    wb = bufs.new(raw.nbytes, raw)
    xs, xo = K + 3, 5
    ys, yo = n_total + 2, 3
    x = rng.standard_normal((M, K))
    xb = strided_x(bufs, x, xs, xo)
    y_elems = yo + M * ys
    yb, y = nan_y(bufs, y_elems)
    seq = Sequence(device, "mm")
    try:
        mm.record_mul_mat(seq, wb, t, xb, yb, M, n, K, x_stride=xs, y_stride=ys, x_offset=xo,
                          y_offset=yo, w_row_offset=r0, path=path)
        seq.run()
    finally:
        seq.close()
    got = target_cols(y, M, n, yo, ys, r0)
    Wr = W[r0:r0 + n]
    check(got, x @ Wr.T, bound_f32(x, abs_terms(raw, t, W)[r0:r0 + n]))


@pytest.mark.parametrize("K", [100, 99])
@pytest.mark.parametrize("t", FLOATS)
def test_float_rows_any_length(device, bufs, rng, t, K):
    """Float weights need no blocks: K = 100 (vec: element path, tiled: vec4 rows) and K = 99
    (rows not 4-byte multiples for f16/bf16; element path everywhere)."""
    N = 21
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    for M, path in ((2, "vec"), (11, "tiled")):
        x = rng.standard_normal((M, K))
        y, _ = run_mm(device, bufs, wb, t, x, M, N, K, M * N, path)
        check(y.reshape(M, N), x @ W.T, bound_f32(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("t", ["q4_0", "q8_0", "q5_1"])
def test_random_bit_patterns(device, bufs, rng, t):
    """Legacy quants from random bytes (codes quantize() never writes, e.g. -128 in Q8_0)."""
    N, K = 19, 64
    raw, W = make_weights(rng, t, N, K, random_bits=True)
    wb = bufs.new(raw.nbytes, raw)
    for M, path in ((4, "vec"), (9, "tiled")):
        x = rng.standard_normal((M, K))
        y, _ = run_mm(device, bufs, wb, t, x, M, N, K, M * N, path)
        check(y.reshape(M, N), x @ W.T, bound_f32(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("t", ALL)
def test_coopmat(device, bufs, rng, t):
    if not kernels_for(device).coopmat:
        pytest.skip(f"'{device.name}' has no usable cooperative matrices")
    if "coopmat" in device.disabled:
        pytest.skip("VKXSPLIT_DISABLE=coopmat")
    N, K = 150, test_k(t) * (3 if block_size(t) == 1 else 1)
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    for M in (9, 70):
        x = rng.standard_normal((M, K))
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, None)
        assert took == "coopmat"
        check(y.reshape(M, N), x @ W.T, (2.0 ** -10 + 2 * K * 2.0 ** -23) * (np.abs(x) @ abs_terms(raw, t, W).T))


def _wrong_reference(raw: np.ndarray, t: str, rows: int, k: int) -> np.ndarray:
    """A plausible wrong decoding of the same bytes: Q3_K without its hmask bit (every third
    bit taken as set: no - 4), Q2_K without its min, IQ4_NL / IQ4_XS with kvalues_iq4nl read
    as linear codes (IQ4_NL as Q4_0, d (q - 8); IQ4_XS with the same linear codes)."""
    bad = raw.copy().reshape(rows, -1, GGML_QUANT_SIZES[gtype(t)][1])
    g = gtype(t)
    if t == "q3_k":
        bad[:, :, 0:32] = 0xFF
    elif t == "q2_k":
        bad[:, :, 82:84] = 0  # dmin = +0
    elif t == "iq4_nl":
        g = GGMLQuantizationType.Q4_0  # the same 18-byte layout
    else:  # iq4_xs: d (sc - 32) (q - 8)
        from gguf import quants as gq

        d = np.asarray(dequantize(bad.reshape(rows, -1), g), np.float64).reshape(rows, -1, 256)
        q = bad[:, :, 8:].reshape(rows, -1, 8, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1) & 15
        lv = np.array(gq.IQ4_NL.kvalues, np.float64)[q.reshape(rows, -1, 256)]
        return (d / lv * (q.reshape(rows, -1, 256) - 8.0)).reshape(rows, k)
    return np.asarray(dequantize(bad.reshape(rows, -1), g), np.float64).reshape(rows, k)


@pytest.mark.parametrize("path", ["vec", "tiled"])
def test_new_types_check_fails_for_a_wrong_decoding(device, bufs, rng, path):
    """The check that passes the new types (against gguf's dequantize) fails against a wrong
    decoding of the same bytes (:func:`_wrong_reference`): it can tell a missing hmask bit,
    a missing min or linear codes for the IQ4 table apart from the right kernels."""
    for t in ("q2_k", "q3_k", "iq4_nl", "iq4_xs"):
        N, K = 9, test_k(t)
        raw, W = make_weights(rng, t, N, K)
        wb = bufs.new(raw.nbytes, raw)
        M = 1 if path == "vec" else 9
        x = rng.standard_normal((M, K))
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, path)
        assert took == path
        bound = bound_f32(x, abs_terms(raw, t, W))
        check(y.reshape(M, N), x @ W.T, bound)
        wrong = _wrong_reference(raw, t, N, K)
        assert not np.allclose(wrong, W)
        with pytest.raises(AssertionError, match="over the bound"):
            check(y.reshape(M, N), x @ wrong.T, bound)


def _fake_device(coop=True, shape=(16, 16, 16, 0, 0, 1, 1, 3), sg=(32, 32), ops=0x4, disabled=()):
    s = types.SimpleNamespace(m=shape[0], n=shape[1], k=shape[2], a_type=shape[3], b_type=shape[4],
                              c_type=shape[5], result_type=shape[6], scope=shape[7], saturating=False)
    feats = {"cooperativeMatrix": coop, "shaderFloat16": True, "vulkanMemoryModel": True,
             "subgroupSizeControl": True}
    phys = types.SimpleNamespace(coopmat_shapes=[s], min_subgroup_size=sg[0], max_subgroup_size=sg[1],
                                 subgroup_ops=ops, subgroup_stages=0x20)
    return types.SimpleNamespace(features=feats, physical=phys, name="fake", disabled=frozenset(disabled))


def test_path_selection(device):
    assert mm.check_mul_mat("q4_0", 8, 10, 64) == "vec"
    assert mm.check_mul_mat("q4_0", 9, 10, 64) == "tiled"
    nv = _fake_device()
    assert kernels_for(nv).coopmat
    assert mm.check_mul_mat("q4_k", 1, 10, 256, device=nv) == "vec"
    assert mm.check_mul_mat("q4_k", 9, 10, 256, device=nv) == "coopmat"
    assert mm.check_mul_mat("q4_k", 9, 10, 256, path="tiled", device=nv) == "tiled"
    for bad in (_fake_device(coop=False), _fake_device(sg=(64, 64)),
                _fake_device(shape=(16, 16, 16, 0, 0, 0, 0, 3)), _fake_device(shape=(16, 8, 16, 0, 0, 1, 1, 3))):
        assert not kernels_for(bad).coopmat
        assert mm.check_mul_mat("q4_k", 9, 10, 256, device=bad) == "tiled"
    assert mm.check_mul_mat("f16", 2, 10, 64, device=_fake_device(coop=False, ops=0)) == "tiled"
    off = _fake_device(disabled={"coopmat"})  # VKXSPLIT_DISABLE=coopmat
    assert kernels_for(off).coopmat and not kernels_for(off).coopmat_available
    assert mm.check_mul_mat("q4_k", 9, 10, 256, device=off) == "tiled"
    with pytest.raises(KernelError, match="switched off"):
        mm.check_mul_mat("q4_k", 9, 10, 256, path="coopmat", device=off)
    assert mm.check_mul_mat("q4_k", 9, 10, 256, device=_fake_device(disabled={"coopmat2", "splitk"})) == "coopmat"
    # this machine's device (lavapipe has no cooperative matrices)
    expect = "coopmat" if kernels_for(device).coopmat else "tiled"
    assert mm.check_mul_mat("q8_0", 64, 10, 64, device=device) == expect
    if expect == "tiled":
        with pytest.raises(KernelError, match="cooperative"):
            mm.check_mul_mat("q8_0", 64, 10, 64, path="coopmat", device=device)


def test_quant_table():
    for t, wt in TYPES.items():
        assert (wt.block_size, wt.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[t.upper()]]
        assert weight_type(t.upper()) is wt and weight_type(wt.ggml) is wt and weight_type(int(wt.ggml)) is wt
    assert row_bytes("q4_0", 64) == 36 and row_bytes("q6_k", 512) == 420 and row_bytes("bf16", 7) == 14
    for bad in ("IQ3_S", GGMLQuantizationType.IQ2_XXS, int(GGMLQuantizationType.IQ1_S), "q4_2", 999):
        with pytest.raises(KernelError, match="no vkxsplit kernel"):
            weight_type(bad)
    with pytest.raises(KernelError, match="IQ2_XXS") as err:
        weight_type(GGMLQuantizationType.IQ2_XXS)
    # the message lists the supported types, the new ones among them
    assert all(t.upper() in str(err.value) for t in ("q2_k", "q3_k", "iq4_nl", "iq4_xs", "q4_0"))
    with pytest.raises(KernelError, match="block"):
        row_bytes("q4_k", 300)


def test_errors(device, bufs, seq):
    K, N, M = 64, 8, 2
    wb = bufs.new(row_bytes("q8_0", K) * N)
    xb = bufs.new(4 * M * K)
    yb = bufs.new(4 * M * N)

    def rec(**kw):
        args = dict(w=wb, w_type="q8_0", x=xb, y=yb, M=M, N=N, K=K)
        args.update(kw)
        return mm.record_mul_mat(seq, **args)

    with pytest.raises(KernelError, match="IQ2_XXS"):
        rec(w_type="iq2_xxs")
    with pytest.raises(KernelError, match="multiple of the Q8_0 block size"):
        rec(K=48)
    with pytest.raises(KernelError, match="weight binding"):
        rec(N=N + 1)
    with pytest.raises(KernelError, match="weight binding"):
        rec(w_row_offset=1, y_stride=N + 1, y=bufs.new(4 * M * (N + 1)))
    with pytest.raises(KernelError, match="x "):
        rec(x_stride=K + 1)
    with pytest.raises(KernelError, match="y "):
        rec(y_offset=1)
    with pytest.raises(KernelError, match="y_stride"):
        rec(y_stride=N - 1)
    with pytest.raises(KernelError, match="M <= 8"):
        rec(M=9, path="vec")
    with pytest.raises(KernelError, match="unknown path"):
        rec(path="fast")
    with pytest.raises(KernelError, match="overlaps"):
        rec(y=xb)
    with pytest.raises(KernelError, match="16-byte aligned"):
        rec(w=View(wb, 8, row_bytes("q8_0", K) * N - 8), N=1)
    with pytest.raises(KernelError, match="non-negative"):
        rec(N=-1)
    with pytest.raises(KernelError, match="at least 1"):
        mm.check_mul_mat("f32", 1, 1, 0)
    assert seq.dispatches == 0
    # empty products record nothing
    assert rec(M=0) == "vec" and rec(N=0) == "vec"
    assert seq.dispatches == 0


# ------------------------------------------------------------------------------------------
# cooperative-matrix kernel logic, via its emulated variants (COOPMAT_EMULATE=1: no
# cooperative matrices, any subgroup size), so it is tested on every device


def coop_bound(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """test_coopmat's bound: x and W rounded to f16, f32 accumulation (a: abs_terms())."""
    return (2.0 ** -10 + 2 * x.shape[1] * 2.0 ** -23) * (np.abs(x) @ a.T)


def _coop_k(t: str) -> list[int]:
    # floats: K = 100 (vector rows, the last 8-element unit straddles K) and 99 (element loads)
    return [100, 99] if block_size(t) == 1 else [test_k(t)]


@pytest.mark.parametrize("t", ALL)
def test_coopmat_emu(device, bufs, rng, t, tool_kernels):
    """Default emulated tiling (64 x 64, BK 32): N and M with interior tiles (straight
    stores) and edge tiles (staged, bounds-checked), K not a multiple of BK."""
    tool_kernels(mm.coop_variant_name(t, emulate=True))
    tile = tk.COOP_EMU_TILE
    N = 2 * tile.bn + 24  # y rows 16-byte aligned: interior tiles store straight to y
    for K in _coop_k(t):
        raw, W = make_weights(rng, t, N, K)
        wb = bufs.new(raw.nbytes, raw)
        for M in (9, 2 * tile.bm):
            x = rng.standard_normal((M, K))
            y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "coopmat",
                             coop_variant=mm.coop_variant_name(t, emulate=True))
            assert took == "coopmat"
            check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("name", sorted(n for n in tk.COOP_EMU_VARIANTS if not n.endswith("_f32")))
def test_coopmat_emu_tilings(device, bufs, rng, name, tool_kernels):
    """The extra emulated tilings (BK 64 with blocks spanning steps and partial last steps; BK
    16 with tall subgroup blocks and fewer weight units than threads)."""
    tool_kernels(name)
    t, tile = tk.COOP_EMU_VARIANTS[name]
    assert mm.coop_tile(name) == tile
    N = 3 * tile.bn + 5
    K = 100 if block_size(t) == 1 else (96 if block_size(t) == 32 else 768)
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    for M in (2 * tile.bm, 2 * tile.bm + 3):
        x = rng.standard_normal((M, K))
        y, _ = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "coopmat", coop_variant=name)
        check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))


def test_coopmat_tilings_share_one_module_per_type(device, bufs, rng, tool_kernels):
    """mul_mat_coopmat's tilings are specialization constants: a type's shipped default and
    large tilings name one module with different spec values (the module declares the
    constants the Python table names), and so do its emulated tilings; two emulated tilings of
    one module are two pipelines from one SPIR-V, each matching the float64 reference (a
    wrong reference fails the check)."""
    from vkxsplit.vk.kernel import Kernel

    shipped = shaders.shipped()
    for t in ALL:
        a, b = shipped[mm.coop_variant_name(t)], shipped[mm.coop_variant_name(t, mm.coop_big_tile(t))]
        assert a["module"] == b["module"] == mk.coop_module_name(t) and a["spec"] != b["spec"]
        assert a["spec"]["NT"] == mm.COOP_TILES[mm.COOP_CONFIG[t]].threads == a["local_size"][0]
    code = (shaders.SPV_DIR / f"{mk.coop_module_name('q4_0')}.spv").read_bytes()
    assert set(shaders.spec_constants(code)) == set(mk.COOP_SPEC_IDS.values())
    t = "q4_0"
    names = [mm.coop_variant_name(t, emulate=True), mm.coop_variant_name(t, "t64x128_k16_w16x32_s1", emulate=True)]
    tool_kernels(*names)
    ma, mb = (shaders.variant_meta(n) for n in names)
    assert ma["module"] == mb["module"] == mk.coop_module_name(t, emulate=True) and ma["spec"] != mb["spec"]
    assert shaders.spirv(names[0]) == shaders.spirv(names[1])
    ka, kb = Kernel.get(device, names[0]), Kernel.get(device, names[1])
    assert ka is not kb and ka.pipeline != kb.pipeline
    N, K, M = 200, 96, 70  # edge tiles in M and N for both tilings
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    x = rng.standard_normal((M, K))
    ref, bound = x @ W.T, coop_bound(x, abs_terms(raw, t, W))
    for name in names:
        y, _ = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "coopmat", coop_variant=name)
        check(y.reshape(M, N), ref, bound)
    with pytest.raises(AssertionError, match="over the bound"):
        check(y.reshape(M, N), np.roll(ref, 1, axis=1), bound)


def test_coopmat_tiling_the_kernel_cannot_run_is_refused():
    """A tiling whose subgroup blocks do not divide the tile, or are not whole 16 x 16
    fragments, is refused when the variant is made (the shader no longer checks it: its sizes
    are specialization constants)."""
    for bad in (mm.CoopTile(128, 128, 32, 48, 64), mm.CoopTile(128, 128, 24, 32, 64),
                mm.CoopTile(96, 128, 32, 64, 64), mm.CoopTile(128, 128, 32, 32, 64, stages=3)):
        with pytest.raises(KernelError, match="multiples"):
            mm.make_coop_variant("x", "q4_0", bad)
    assert mm.make_coop_variant("x", "q4_0", mm.CoopTile(64, 64, 32, 32, 32)).spec["NT"] == 128


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("t", ["f32", "f16", "q4_0", "q5_0", "q4_k", "q6_k", "q3_k", "iq4_nl"])
def test_coopmat_emu_row_range_and_strides(device, bufs, rng, t, aligned, tool_kernels):
    """Rows [r0, r0 + n) of W into y columns [c0, c0 + n), x with a row stride and offset, y
    with a wider stride and an offset; nothing outside the target region may be written.
    aligned: x rows vec4-aligned and y rows 16-byte aligned (straight fragment stores for
    interior tiles); otherwise element loads of x and staged stores everywhere."""
    tool_kernels(mm.coop_variant_name(t, emulate=True))
    tile = tk.COOP_EMU_TILE
    n_total, r0, n, K = tile.bn + 80, 12, tile.bn + 20, test_k(t)
    M = tile.bm + 5
    raw, W = make_weights(rng, t, n_total, K)
    wb = bufs.new(raw.nbytes, raw)
    if aligned:
        xs, xo, ys, yo, c0 = K + 4, 8, n_total + 12, 4, 16
    else:
        xs, xo, ys, yo, c0 = K + 3, 5, n_total + 2, 3, r0
    x = rng.standard_normal((M, K))
    xb = strided_x(bufs, x, xs, xo)
    y_elems = yo + M * ys
    yb, y = nan_y(bufs, y_elems)
    seq = Sequence(device, "mm")
    try:
        mm.record_mul_mat(seq, wb, t, xb, yb, M, n, K, x_stride=xs, y_stride=ys, x_offset=xo,
                          y_offset=yo, w_row_offset=r0, y_col_offset=c0, path="coopmat",
                          coop_variant=mm.coop_variant_name(t, emulate=True))
        seq.run()
    finally:
        seq.close()
    got = target_cols(y, M, n, yo, ys, c0)
    check(got, x @ W[r0:r0 + n].T, coop_bound(x, abs_terms(raw, t, W)[r0:r0 + n]))


@pytest.mark.parametrize("t", ["f16", "q4_0", "q8_0", "q4_k", "q6_k", "q2_k", "iq4_xs"])
def test_coopmat_emu_split_k(device, bufs, rng, t, tool_kernels):
    """Split K: each workgroup z sums one K range into its partial (the device's split-K
    scratch), reduce_splitk_f32 adds the partials into y's target columns. Ranges that are
    whole and partial BK steps, a last range shorter than the others, a K-quant block split
    between ranges; y with a stride, offset and column range (nothing else written); the float64
    bound as without the split, and the result equal to the unsplit kernel's within f32
    reassociation (the partials are added in a different order)."""
    tool_kernels(mm.coop_variant_name(t, emulate=True))
    tile = tk.COOP_EMU_TILE
    bs = block_size(t)
    K = 3 * 256 + (256 if bs == 256 else 96)  # a last range of K % chunk
    n_total, r0, n = tile.bn + 40, 8, tile.bn + 20
    M = tile.bm + 3
    raw, W = make_weights(rng, t, n_total, K)
    wb = bufs.new(raw.nbytes, raw)
    x = rng.standard_normal((M, K))
    xb = bufs.new(x.nbytes, x.astype(np.float32))
    ys, yo, c0 = n_total + 4, 4, r0
    ref = x @ W[r0:r0 + n].T
    bound = coop_bound(x, abs_terms(raw, t, W)[r0:r0 + n])
    outs = {}
    for split in (0, tile.bk, 4 * tile.bk, 256 + tile.bk):  # 0: unsplit
        yb, y = nan_y(bufs, yo + M * ys)
        seq = Sequence(device, "mm")
        try:
            mm.record_mul_mat(seq, wb, t, xb, yb, M, n, K, y_stride=ys, y_offset=yo, w_row_offset=r0,
                              y_col_offset=c0, path="coopmat", coop_variant=mm.coop_variant_name(t, emulate=True),
                              k_split=split)
            assert seq.dispatches == (2 if split else 1)
            seq.run()
        finally:
            seq.close()
        got = target_cols(y, M, n, yo, ys, c0)
        check(got, ref, bound)
        outs[split] = got.astype(np.float64)
    for got in outs.values():
        # the same f16-rounded products; only the order of the f32 additions differs
        assert np.abs(got - outs[0]).max() <= 4 * K * 2.0 ** -24 * (np.abs(x) @ abs_terms(raw, t, W)[r0:r0 + n].T).max()
    with pytest.raises(KernelError, match="multiple of BK"):
        mm.record_mul_mat(Sequence(device, "bad"), wb, t, xb, yb, M, n, K, y_stride=ys, w_row_offset=r0,
                          path="coopmat", coop_variant=mm.coop_variant_name(t, emulate=True), k_split=tile.bk + 1)


def test_coopmat_split_k_stores_straight_only_with_aligned_partials(device, bufs, rng, monkeypatch, tool_kernels):
    """The partials' rows are N floats from byte 0 of the scratch: fragments may be stored
    straight (FLAG_YVEC: 16-byte aligned rows, what coopMatStore needs) only when N % 4 == 0.
    Checked on the recorded push constants, and the odd-N result against float64."""
    from vkxsplit.vk.command import Sequence as Seq

    tile = tk.COOP_EMU_TILE
    t, K, M = "q8_0", 512, tile.bm
    tool_kernels(mm.coop_variant_name(t, emulate=True))
    pushes = []
    real = Seq.dispatch

    def spy(self, kernel, bindings, push=b"", groups=1):
        pushes.append(push)
        return real(self, kernel, bindings, push, groups)

    monkeypatch.setattr(Seq, "dispatch", spy)
    for N in (tile.bn + 4, tile.bn + 5):
        raw, W = make_weights(rng, t, N, K)
        wb = bufs.new(raw.nbytes, raw)
        x = rng.standard_normal((M, K))
        pushes.clear()
        y, _ = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "coopmat",
                      coop_variant=mm.coop_variant_name(t, emulate=True), k_split=128)
        flags = pushes[0][9]
        assert bool(flags & mm.FLAG_YVEC) == (N % 4 == 0), (N, flags)
        check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))


def test_splitk_scratch_grows_geometrically(device):
    """Needs growing by 1 MiB at a time (prompts of every length up to 128 tokens) allocate a
    few doubling buffers, not one per size; all of them stay under 4x the largest need."""
    sc_cls = mm._Scratch
    before = device.memory.allocated_bytes
    try:
        sizes = [(i + 1) << 20 for i in range(40)]
        for n in sizes:
            assert sc_cls.get(device, "splitk", n).size >= n
        sc = device.__dict__["_splitk_scratch"]
        assert len(sc.buffers) <= 7
        assert sum(b.size for b in sc.buffers) <= 4 * sizes[-1]
    finally:
        device.__dict__["_splitk_scratch"].close()
    assert device.memory.allocated_bytes <= before  # every scratch buffer returned (earlier ones too)


def test_coop_k_split_rule(monkeypatch):
    """coop_k_split takes the split count of SPLITK_COUNTS with the least modelled time: waves
    of coop_wave workgroups, each as long as its tile work plus SPLITK_FIXED_K per split
    workgroup, ranges at least SPLITK_MIN_K and whole BK steps (worked by hand for the H200's
    128 x 128 tiles, BK 64; costs in K elements per workgroup wave; the cost model alone, no
    device: the H200's 132 compute units, a wave of 128)."""
    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)
    tile = mm.COOP_TILES["t128x128_k64_w32x64_s1"]
    h = kernels_for(None)
    assert (h.coop_wave, choose.SPLITK_FIXED_K, choose.SPLITK_MIN_K) == (128, 256, 512)
    # M=128, N=4096, K=4096: 32 tiles; 1: 4096, 2: 2304, 4 (128 groups): 1280, 8 (2 waves): 1536
    assert h.coop_k_split(tile, 128, 4096, 4096) == 1024
    # M=512, N=1024 (GQA k/v): 32 tiles, the same
    assert h.coop_k_split(tile, 512, 1024, 4096) == 1024
    # M=512, N=4096, K=14336 (ffn_down): 128 tiles; 1: 14336, 2 (2 waves): 2 x 7424 -> no split
    assert h.coop_k_split(tile, 512, 4096, 14336) == 0
    # M=256, N=4096, K=14336: 64 tiles; 2: 7424, 4 (2 waves): 7680 -> 2 ranges of 7168
    assert h.coop_k_split(tile, 256, 4096, 14336) == 7168
    # M=512, N=14336: 448 tiles; 1: 4 waves x 4096 = 16384, 2: 7 x 2304 = 16128 (measured: q4_0
    # 0.687 ms split vs 0.747 unsplit)
    assert h.coop_k_split(tile, 512, 14336, 4096) == 2048
    # K = 1000, 1 tile: 2 ranges of 512 (8 BK steps) + 488: 768 < 1024
    assert h.coop_k_split(tile, 128, 128, 1000) == 512
    # K = 1536: 4 ranges would be 384 < SPLITK_MIN_K: 2 of 768
    assert h.coop_k_split(tile, 16, 100, 1536) == 768
    # the partials' scratch is bounded: M x N x 4 bytes per range
    for M, N in ((128, 65536), (1024, 16384), (64, 4096)):
        ks = h.coop_k_split(tile, M, N, 4096)
        assert ks == 0 or 4 * M * N * -(-4096 // ks) <= choose.SPLITK_MAX_SCRATCH
    assert h.coop_cost(tile, 4096, 4096, 4096, 2) is None  # 128 MiB of partials


def test_coop_choose_rule(monkeypatch):
    """The default coopmat choice (worked by hand with coop_cost): the type's default tiling
    or its large one, whichever is modelled faster with its best split; a device with
    ``splitk`` switched off (VKXSPLIT_DISABLE=splitk) never splits. Every variant it can name
    ships."""
    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)  # (no device: the process's setting)
    h = kernels_for(None)
    assert choose.COOP_TILE_EFF == {"t256x128_k32_w64x64_s1": 1.15, "t128x256_k32_w32x64_s1": 1.25}
    q, f = "mul_mat_coopmat_q4_0_f32_t256x128_k32_w64x64_s1", "mul_mat_coopmat_f16_f32_t128x256_k32_w32x64_s1"
    # q4_0 M=512, 4096x4096: default 128 tiles unsplit = 4096 x 16384 (67.1 M); large tiling 64
    # tiles in 2 ranges = (2048 / 1.15 + 256) x 32768 (66.7 M)
    assert h.coop("q4_0", 512, 4096, 4096) == (q, 2048)
    # f16 (128 x 256 tiles, 16 subgroups): (2048 / 1.25 + 256) x 32768 = 62.1 M < 67.1 M
    assert h.coop("f16", 512, 4096, 4096) == (f, 2048)
    # M=512, N=14336: large 224 tiles, 2 waves x 4096 / 1.15 x 32768 (233 M; f16: / 1.25, 215 M)
    # vs the default's 7 waves x 2304 x 16384 (264 M)
    assert h.coop("q4_0", 512, 14336, 4096) == (q, 0)
    assert h.coop("f16", 512, 14336, 4096) == (f, 0)
    # M=512, N=1024: default 4 x 1024 (1280 x 16384 = 21.0 M) vs large 8 x 512 (701 x 32768 = 23.0 M)
    assert h.coop("q4_0", 512, 1024, 4096) == ("mul_mat_coopmat_q4_0_f32", 1024)
    # M=128: a 256-row tile is half empty: the default, 4 ranges
    assert h.coop("q4_0", 128, 4096, 4096) == ("mul_mat_coopmat_q4_0_f32", 1024)
    nosplit = types.SimpleNamespace(disabled=frozenset({"splitk"}))
    assert kernels_for(nosplit).coop("q4_0", 512, 4096, 4096) == ("mul_mat_coopmat_q4_0_f32", 0)  # 67.1 M vs 3562 x 32768
    monkeypatch.setenv("VKXSPLIT_DISABLE", "splitk")  # no device: the process's setting
    assert kernels_for(None).coop("q4_0", 512, 4096, 4096) == ("mul_mat_coopmat_q4_0_f32", 0)
    monkeypatch.delenv("VKXSPLIT_DISABLE")
    # a device whose limits do not take the large tiling (256 threads, 32 KiB) keeps the default
    class Small:
        class physical:  # noqa: N801
            limits = {"maxComputeWorkGroupInvocations": 256, "maxComputeSharedMemorySize": 32768,
                      "maxComputeWorkGroupSize": (256, 256, 64)}
    small = kernels_for(Small)
    assert not small.tile_fits(mm.COOP_TILES[mk.COOP_BIG_FLOAT])
    assert small.coop("f16", 512, 14336, 4096)[0] == "mul_mat_coopmat_f16_f32"
    assert small.coop("q4_0", 512, 14336, 4096)[0] == "mul_mat_coopmat_q4_0_f32"
    names = {v.name for v in mm.VARIANTS}
    for t in ALL:
        for M, N, K in ((128, 4096, 4096), (512, 4096, 4096), (512, 14336, 4096), (300, 1000, 1000)):
            name, ks = h.coop(t, M, N, K)
            assert name in names and mm.coop_tile(name) is not None
            assert ks % mm.coop_tile(name).bk == 0 and ks < K


def test_coopmat_variants():
    """Every real tiling fits the shared-memory budget and the 16x16 fragment grid; every type
    ships its default and its large tiling (what DeviceKernels.coop picks from) and nothing else;
    every type has an emulated variant; the sweep covers each tiling for its types."""
    for tile in {*tk.COOP_ALL_TILES.values(), tk.COOP_EMU_TILE, *tk.COOP_EMU_EXTRA}:
        assert tile.bm % tile.wm == 0 and tile.bn % tile.wn == 0 and tile.bk % 16 == 0
        assert tile.wm % 16 == 0 and tile.wn % 16 == 0 and tile.threads <= 1024
    for tile in tk.COOP_ALL_TILES.values():
        assert tile.shared_bytes <= choose.COOP_SHARED_MAX, tile.name  # the H200's limit
    for tile in (tk.COOP_EMU_TILE, *tk.COOP_EMU_EXTRA):
        assert tile.shared_bytes <= 32768, tile.name  # lavapipe's limit
    names = {v.name: v for v in mm.VARIANTS}
    declared = tk.all_declared()
    for t in ALL:
        v = names[mm.coop_variant_name(t)]
        tile = mm.COOP_TILES[mm.COOP_CONFIG[t]]
        assert v.local_size == (tile.threads, 1, 1) and v.subgroup_size == 32
        assert "cooperativeMatrix" in v.requires
        assert mm.coop_variant_name(t, mm.coop_big_tile(t)) in names
        e = declared[mm.coop_variant_name(t, emulate=True)]
        assert e.defines["COOPMAT_EMULATE"] == "1" and "cooperativeMatrix" not in e.requires
        assert e.name not in names  # (tests only)
    for t in tk.COOP_SWEEP_TYPES:
        for key in tk.COOP_ALL_TILES:
            assert (mm.coop_variant_name(t, key) if key != mm.COOP_CONFIG[t] else mm.coop_variant_name(t)) in declared
    assert len([n for n in names if n.startswith("mul_mat_coopmat")]) == 2 * len(ALL)  # the shipped SPIR-V


def test_coopmat_variant_errors(device, bufs, seq, tool_kernels):
    tool_kernels(mm.coop_variant_name("q8_0", emulate=True), mm.coop_variant_name("q4_0", emulate=True))
    K, N, M = 64, 8, 16
    wb = bufs.new(row_bytes("q8_0", K) * N)
    xb = bufs.new(4 * M * K)
    yb = bufs.new(4 * M * N)
    for kw in ({"path": "tiled", "coop_variant": mm.coop_variant_name("q8_0", emulate=True)},
               {"path": "coopmat", "coop_variant": mm.coop_variant_name("q4_0", emulate=True)},
               {"path": "coopmat", "coop_variant": "mul_mat_q8_0_f32"}):
        with pytest.raises(KernelError, match="coop_variant"):
            mm.record_mul_mat(seq, wb, "q8_0", xb, yb, M, N, K, **kw)
    assert seq.dispatches == 0


# ------------------------------------------------------------------------------------------
# mat-vec kernel paths (shaders/mul_mat_vec.comp): every quant type and M = 1..8, rows that
# start 16-byte aligned (K % 256 == 0, 16-aligned binding offset) and rows that do not (K not
# a multiple of 256, odd w_row_offset), vec4 and scalar x loads, row ranges, every registered
# variant (defaults and the sweep shapes of tools/kernels.py).

VEC_NAMES = sorted(tk.VEC_SWEEP) + sorted(mm.vec_kernel_name(t, m) for t in ALL for m in mm.VEC_MAXM)


def _vec_run(device, bufs, rng, t, M, n_total, r0, n, K, w_off=0, x_off=0, variant=None, y_col=None,
             random_bits=False):
    """Rows [r0, r0 + n) of an n_total x K weight (bound at byte w_off of its buffer) times M
    columns of x (starting x_off elements into the x buffer, rows K + x_off apart) into y
    columns [y_col, y_col + n) (default: y column = weight row, rows n_total + 1 apart; with
    y_col, rows y_col + n + 2 apart); y is poisoned with NaN and must be written exactly at the
    target columns."""
    raw, W = make_weights(rng, t, n_total, K, random_bits=random_bits)
    wbuf = bufs.new(w_off + raw.nbytes, np.concatenate([np.zeros(w_off, np.uint8), raw.ravel()]))
    wv = View(wbuf, w_off, raw.nbytes)
    xs = K + x_off
    x = rng.standard_normal((M, K))
    xb = strided_x(bufs, x, xs, x_off)
    ys = n_total + 1 if y_col is None else y_col + n + 2
    yb, y = nan_y(bufs, M * ys)
    seq = Sequence(device, "mm")
    try:
        took = mm.record_mul_mat(seq, wv, t, xb, yb, M, n, K, x_stride=xs, x_offset=x_off, y_stride=ys,
                                 w_row_offset=r0, y_col_offset=y_col, path="vec" if variant is None else None,
                                 vec_variant=variant)
        seq.run()
    finally:
        seq.close()
    assert took == "vec"
    c0 = r0 if y_col is None else y_col
    y2 = y.reshape(M, ys)
    outside = np.ones_like(y2, bool)
    outside[:, c0:c0 + n] = False
    assert np.isnan(y2[outside]).all(), "wrote outside the target columns"
    check(y2[:, c0:c0 + n], x @ W[r0:r0 + n].T, bound_f32(x, abs_terms(raw, t, W)[r0:r0 + n]))


@pytest.mark.parametrize("t", ALL)
def test_mat_vec_aligned_rows_every_m(device, bufs, rng, t):
    """K % 256 == 0 (every row 16-byte aligned), 16-aligned binding offset, vec4 x, M = 1..8,
    N not a multiple of any rows-per-workgroup."""
    for M in range(1, 9):
        _vec_run(device, bufs, rng, t, M, n_total=21, r0=0, n=21, K=512, w_off=32)


@pytest.mark.parametrize("t", ALL)
def test_mat_vec_unaligned_rows_every_m(device, bufs, rng, t):
    """K not a multiple of 256 (rows only 2-byte aligned for Q4_0 / Q8_0 / Q6_K, an odd number
    of blocks per row), odd w_row_offset, x offset by one element (scalar x loads), M = 1..8."""
    K = {1: 104, 32: 160, 256: 768}[block_size(t)]
    for M in range(1, 9):
        _vec_run(device, bufs, rng, t, M, n_total=19, r0=3, n=13, K=K, w_off=16, x_off=1)


@pytest.mark.parametrize("K_blocks", [1, 3, 9])
@pytest.mark.parametrize("t", ["q4_0", "q8_0", "q4_k", "q6_k", "q3_k", "iq4_nl", "iq4_xs"])
def test_mat_vec_few_units(device, bufs, rng, t, K_blocks):
    """Rows with fewer units than threads (most threads idle) and a remainder loop."""
    K = K_blocks * block_size(t)
    _vec_run(device, bufs, rng, t, 2, n_total=9, r0=1, n=7, K=K)


@pytest.mark.parametrize("name", VEC_NAMES)
def test_vec_variant(device, bufs, rng, name, tool_kernels):
    """Every registered mat-vec variant (defaults and sweep shapes), through vec_variant:
    aligned rows with vec4 x, then an unaligned row range with scalar x."""
    tool_kernels(name)
    t = name.removeprefix("mul_mat_vec_").split("_f32")[0]
    bs = block_size(t)
    M = min(3, mm.vec_variant_maxm(name))
    _vec_run(device, bufs, rng, t, M, n_total=13, r0=0, n=13, K=512 if bs < 256 else 1024, variant=name)
    _vec_run(device, bufs, rng, t, M, n_total=11, r0=1, n=9, K={1: 72, 32: 288, 256: 768}[bs], x_off=3,
             variant=name)


def test_vec_variant_errors(device, bufs, seq):
    K, N = 64, 4
    wb = bufs.new(row_bytes("q8_0", K) * N)
    xb = bufs.new(4 * 2 * K)
    yb = bufs.new(4 * 2 * N)
    sweep_q8 = mm.vec_m1_name("q8_0", mm.VEC_CPU_M1["q8_0"])  # (an M = 1 variant that ships)
    for bad, M, path in (("mul_mat_vec_q4_0_f32", 1, None), (sweep_q8, 2, None), ("mul_mat_vec_q8_0_f32_m1", 2, None),
                         ("mul_mat_vec_q8_0_f32", 1, "tiled")):
        with pytest.raises(KernelError, match="vec_variant"):
            mm.record_mul_mat(seq, wb, "q8_0", xb, yb, M, N, K, path=path, vec_variant=bad)
    assert seq.dispatches == 0


def test_vec_config_tables(tool_kernels):
    tool_kernels(*tk.VEC_SWEEP)
    for name, (t, cfg) in tk.VEC_SWEEP.items():
        assert name == f"mul_mat_vec_{t}_f32_m1_{cfg.tag}" and mm.vec_config(name) == cfg
        assert mm.vec_variant_maxm(name) == 1 and cfg.nr <= cfg.wg
    for t in ALL:
        for m in mm.VEC_MAXM:
            assert mm.vec_config(mm.vec_kernel_name(t, m)) == mm.VEC_CONFIG[t]
            assert mm.vec_variant_maxm(mm.vec_kernel_name(t, m)) == m
    assert len(tk.VEC_SWEEP) <= 60
    shipped = {v.name for v in mm.VARIANTS if v.source == "mul_mat_vec.comp"}
    # the defaults for every M and the CPU devices' M = 1 shapes ship, no other shape
    assert shipped == ({mm.vec_kernel_name(t, m) for t in ALL for m in mm.VEC_MAXM}
                       | {mm.vec_m1_name(t, c) for t, c in mm.VEC_CPU_M1.items()})
    with pytest.raises(KernelError, match="not a built mat-vec"):
        mm.vec_config("mul_mat_vec_q4_0_f32_m1_nonesuch")


def test_cpu_devices_get_the_small_decode_shapes(device):
    """CPU Vulkan devices (lavapipe) run M = 1 with the small-workgroup shapes of VEC_CPU_M1
    (the GPU defaults are 2-5x slower there); GPUs, and M > 1, keep the defaults. The variants
    themselves are checked against numpy by test_vec_variant above."""
    gpu = kernels_for(types.SimpleNamespace(physical=types.SimpleNamespace(), is_cpu=False))
    cpu = kernels_for(types.SimpleNamespace(physical=types.SimpleNamespace(), is_cpu=True))
    for t, c in mm.VEC_CPU_M1.items():
        name = cpu.matvec(t, 1)
        assert name in shaders.shipped() and mm.vec_config(name) == c
        assert cpu.matvec(t, 2) == mm.vec_kernel_name(t, 2) and gpu.matvec(t, 1) == mm.vec_kernel_name(t, 1)
    assert cpu.matvec("q5_k", 1) == mm.vec_kernel_name("q5_k", 1)  # no sweep shape: the default
    assert (kernels_for(device).matvec("q4_1", 1) != mm.vec_kernel_name("q4_1", 1)) == device.is_cpu


# ------------------------------------------------------------------------------------------
# wide mat-vec variants (shaders/mul_mat_vec_wide.comp, tools/kernels.py VEC_WIDE; sweep only):
# Q4_0 / Q8_0 rows of whole 8-block groups (K % 256 == 0) read with uvec4 loads.

WIDE_NAMES = sorted(tk.VEC_WIDE)


def _wide_run(device, bufs, rng, t, name, M, n_total, r0, n, K, y_col, w_off=0, x_off=0, random_bits=False):
    """_vec_run with the wide variant ``name`` and y columns [y_col, y_col + n)."""
    _vec_run(device, bufs, rng, t, M, n_total, r0, n, K, w_off=w_off, x_off=x_off, variant=name, y_col=y_col,
             random_bits=random_bits)


@pytest.mark.parametrize("name", WIDE_NAMES)
def test_vec_wide_variant(device, bufs, rng, name, tool_kernels):
    """Every wide variant: N not a multiple of its rows per workgroup, row ranges with y
    column offsets, vec4 and scalar x, few groups per row (idle lanes) and enough groups for
    several loop iterations per lane plus a remainder."""
    tool_kernels(name)
    t, cfg, maxm = tk.VEC_WIDE[name]
    lanes = cfg.wg // cfg.nr
    Ms = (1,) if maxm == 1 else (3, 4)
    for M in Ms:
        # aligned: one row range from row 0, 16-aligned binding offset, vec4 x
        _wide_run(device, bufs, rng, t, name, M, n_total=cfg.nr + 3, r0=0, n=cfg.nr + 3, K=512, y_col=0,
                  w_off=32)
        # row range, y column offset, scalar x, few groups
        _wide_run(device, bufs, rng, t, name, M, n_total=2 * cfg.nr + 5, r0=3, n=cfg.nr + 2, K=1280, y_col=5,
                  w_off=16, x_off=3)
    # several iterations per lane plus a remainder; random quant bytes
    K = 256 * (2 * cfg.unr * lanes + 3)
    _wide_run(device, bufs, rng, t, name, Ms[-1], n_total=cfg.nr + 1, r0=1, n=cfg.nr, K=K, y_col=2,
              random_bits=True)


def test_vec_wide_variant_errors(device, bufs, seq, tool_kernels):
    """K not a multiple of 256: the wide variants refuse (rows not whole 16-aligned groups)."""
    tool_kernels(*tk.VEC_WIDE)
    for t in ("q4_0", "q8_0"):
        K, N = 288, 4
        wb = bufs.new(row_bytes(t, K) * N)
        xb = bufs.new(4 * 4 * K)
        yb = bufs.new(4 * 4 * N)
        for name in (n for n, (ty, _, _) in tk.VEC_WIDE.items() if ty == t):
            with pytest.raises(KernelError, match="K % 256"):
                mm.record_mul_mat(seq, wb, t, xb, yb, 1, N, K, vec_variant=name)
        other = next(n for n, (ty, _, _) in tk.VEC_WIDE.items() if ty != t)
        with pytest.raises(KernelError, match="vec_variant"):  # another type's variant
            mm.record_mul_mat(seq, wb, t, xb, yb, 1, N, K, vec_variant=other)
        m1 = next(n for n, (ty, _, mx) in tk.VEC_WIDE.items() if ty == t and mx == 1)
        with pytest.raises(KernelError, match="vec_variant"):  # too many columns
            mm.record_mul_mat(seq, wb, t, xb, yb, 2, N, K, vec_variant=m1)
    assert seq.dispatches == 0


def test_vec_wide_tables(tool_kernels):
    tool_kernels(*tk.VEC_WIDE)
    for name, (t, cfg, maxm) in tk.VEC_WIDE.items():
        assert t in ("q4_0", "q8_0") and name == f"mul_mat_vec_{t}_f32_m{maxm}_{cfg.tag}"
        meta = shaders.variant_meta(name)
        assert meta["source"] == "mul_mat_vec_wide.comp" and mm.vec_variant_maxm(name) == maxm
        assert {k: meta["defines"][k] for k in cfg.defines()} == cfg.defines()
        assert cfg.wg % cfg.nr == 0 and cfg.nr * maxm <= cfg.wg and name not in tk.VEC_SWEEP
        assert (not cfg.xsh or maxm == 1) and cfg.unr * (cfg.wg // cfg.nr) * 1024 * cfg.xsh <= 16384
    assert sum(mx == 4 for _, _, mx in tk.VEC_WIDE.values()) == 2
    # sweep only: no wide variant ships
    assert not any(v.source == "mul_mat_vec_wide.comp" for v in shaders.all_variants().values())


# --- integer-dot-product mat-vec (x quantized to 8-bit blocks; mul_mat_vecq.comp) -------------
#
# x is rounded by quantize_q8_1 (d = fl32(max|x| * fl32(1/127)) per 32-block, q = round(x / d)
# half away from zero, exactly) and the reference q8_1_reference reproduces it bit for bit
# (checked on the scratch buffer). Bounds, fixed before any run:
# (a) against the float64 product of the SAME quantized x (d q) and the dequantized weights:
#     per block the kernels sum exact integers and add (d_w * d_x) * s to an f32 accumulator,
#     then reduce the lanes' partials: at most 2 + (blocks per lane) + (non-zero partials)
#     <= 2 nb + 2 roundings on any term, so |y - ref_q| <= (2 nb + 8) u (|d q| @ |W|^T);
# (b) against the float64 product of the unquantized x: |x - d q| <= d / 2 per element, so
#     |y - x @ W^T| <= (d / 2) @ |W|^T (1 + 2^-20) + bound (a).
VECQ_NAMES = sorted(tk.VECQ_SWEEP)


def _vecq_skip(device, name):
    req = [f for f in shaders_requires(name) if not device.features.get(f)]
    if req:
        pytest.skip(f"'{device.name}' lacks {', '.join(req)}")


def shaders_requires(name):
    return tk.all_declared()[name].requires


def _vecq_run(device, bufs, rng, t, name, M, n_total, r0, n, K, y_col, x_off=0, random_bits=False, x=None,
              w_pad=0):
    """Rows [r0, r0 + n) of an n_total x K weight times M columns of x (x_off elements in,
    rows K + x_off apart) into y columns [y_col, y_col + n) of rows y_col + n + 2 apart; y
    poisoned with NaN. Checks the scratch against q8_1_reference bit for bit, and bounds (a)
    and (b). Returns y's target block."""
    raw, W = make_weights(rng, t, n_total, K, random_bits=random_bits)
    wb = bufs.new(raw.nbytes + w_pad, raw)  # (w_pad bytes past the tensor, unused)
    xs = K + x_off
    if x is None:
        x = rng.standard_normal((M, K)).astype(np.float32)
    xb = strided_x(bufs, x, xs, x_off)
    qbytes = mm.vecq_scratch_bytes(M, K)
    qb = bufs.new(qbytes + 64)
    qb.numpy(np.uint8, (qbytes + 64,))[:] = 0xAB
    ys = y_col + n + 2
    yb, y = nan_y(bufs, M * ys)
    seq = Sequence(device, "mmq")
    try:
        mm.record_mul_mat_vecq(seq, wb, t, xb, qb, yb, M, n, K, x_stride=xs, x_offset=x_off, y_stride=ys,
                               w_row_offset=r0, y_col_offset=y_col, variant=name)
        assert seq.dispatches == 2
        seq.run()
    finally:
        seq.close()
    # the scratch: bit-exact quantization, nothing written past it
    q, d, s = mm.q8_1_reference(x)
    nblk = M * (K // 32)
    scratch = qb.numpy(np.uint8, (qbytes + 64,))
    assert (scratch[qbytes:] == 0xAB).all(), "quantize_q8_1 wrote past its scratch"
    assert np.array_equal(scratch[:32 * nblk].view(np.int8).reshape(M, K), q)
    meta = scratch[32 * nblk:qbytes].view(np.uint32).reshape(nblk, 2)
    assert np.array_equal(meta[:, 0], d.ravel().view(np.uint32))
    assert np.array_equal(meta[:, 1].view(np.int32), s.ravel())
    y2 = y.reshape(M, ys)
    outside = np.ones_like(y2, bool)
    outside[:, y_col:y_col + n] = False
    assert np.isnan(y2[outside]).all(), "wrote outside the target columns"
    got = y2[:, y_col:y_col + n]
    Wr, Aw = W[r0:r0 + n], abs_terms(raw, t, W)[r0:r0 + n]  # (K-quants: |d sc q| + |dmin m|)
    dfull = np.repeat(d.astype(np.float64), 32, axis=1)
    xdq = q.astype(np.float64) * dfull
    bound_a = (2 * (K // 32) + 8) * U * (np.abs(xdq) @ Aw.T)
    check(got, xdq @ Wr.T, bound_a)
    check(got, x.astype(np.float64) @ Wr.T, 0.5 * (dfull @ Aw.T) * (1 + 2.0 ** -20) + bound_a)
    return got


@pytest.mark.parametrize("name", VECQ_NAMES)
def test_mat_vecq_variant(device, bufs, rng, name, tool_kernels):
    """Every vecq variant (skipped where the device lacks its features): N not a multiple of
    its rows per workgroup, row ranges with y column offsets, x with an offset and a stride,
    an odd number of blocks per row (single-block variants: both halfword parities in each
    row position), and enough blocks for several loop iterations per lane plus a remainder
    with random quant bytes (Q8_0 codes -128)."""
    _vecq_skip(device, name)
    tool_kernels(name)
    t, cfg, maxm = tk.VECQ_SWEEP[name]
    lanes = cfg.wg // cfg.nr
    rows = cfg.rows  # per workgroup: nr teams x rpt rows per thread
    Ms = (1,) if maxm == 1 else (3, 4)
    unit = 256 if cfg.blk == 8 or t in ("q4_k", "q6_k") else 32  # (K-quants: one super-block per unit)
    pad = 2 if cfg.w5u else 0  # whole-word loads: the binding holds the last row's trailing word
    for M in Ms:
        _vecq_run(device, bufs, rng, t, name, M, n_total=rows + 3, r0=0, n=rows + 3, K=512, y_col=0, w_pad=pad)
        _vecq_run(device, bufs, rng, t, name, M, n_total=2 * rows + 5, r0=3, n=rows + 2,
                  K=1280 if unit == 256 else 288, y_col=5, x_off=3, w_pad=pad)
    K = unit * (2 * cfg.unr * lanes + 3)
    _vecq_run(device, bufs, rng, t, name, Ms[-1], n_total=rows + 1, r0=1, n=rows, K=K, y_col=2,
              random_bits=True, w_pad=pad)


@pytest.mark.parametrize("name", [v for v in VECQ_NAMES if tk.VECQ_SWEEP[v][1].w5u])
def test_mat_vecq_w5u_fallback(device, bufs, rng, monkeypatch, name, tool_kernels):
    """A w5u variant reads each block's last word whole, unchecked: where the binding ends 2
    bytes into the last row's trailing word (an odd number of blocks, bound exactly), the
    same shape without w5u is recorded instead, and the product is still right; with the
    word there, the w5u kernel itself."""
    _vecq_skip(device, name)
    tool_kernels(name, name.replace("_w5u", ""))
    t, cfg, _ = tk.VECQ_SWEEP[name]
    wt = weight_type(t)
    got = []
    real_get = mm.Kernel.get
    monkeypatch.setattr(mm.Kernel, "get", lambda dev, n: got.append(n) or real_get(dev, n))
    K, n_total = 32 * 9, 2 * cfg.rows + 1  # 9 blocks per row, an odd number of rows
    assert not mm.vecq_fits(View(bufs.new(n_total * wt.row_bytes(K)), 0, n_total * wt.row_bytes(K)), wt, n_total, K)
    assert mm.vecq_fits(bufs.new(n_total * wt.row_bytes(K) + 2), wt, n_total, K)
    assert mm.vecq_fits(bufs.new(n_total * wt.row_bytes(K)), wt, n_total - 1, K)  # (an even row count ends on a word)
    for pad, want in ((0, name.replace("_w5u", "")), (2, name)):
        got.clear()
        _vecq_run(device, bufs, rng, t, name, 1, n_total=n_total, r0=1, n=n_total - 1, K=K, y_col=1,
                  random_bits=True, w_pad=pad)
        assert want in got and (pad or name not in got)


def test_q8_1_quantize_edge_cases(device, bufs, rng, tool_kernels):
    """quantize_q8_1 bit for bit against q8_1_reference on blocks with exact ties (x / d = k +
    1/2, both signs: rounded away from zero), an all-zero block, a block of subnormals (d not
    normal: all zero), subnormal and signed-zero elements in a normal block, and a block whose
    maximum is negative."""
    K = 32 * 6
    x = rng.standard_normal((1, K)).astype(np.float32)
    blk = x.reshape(6, 32)
    # block 0: ties. An amax with d = fl(amax C) = 2^-4 exactly, then (k + 1/2) 2^-4 (exact)
    d0 = np.float32(2.0 ** -4)
    amax = np.float32(127 * d0)
    for _ in range(200):
        if amax * np.float32(1.0 / 127.0) == d0:
            break
        amax = np.nextafter(amax, np.float32(np.inf if amax * np.float32(1.0 / 127.0) < d0 else 0))
    assert amax * np.float32(1.0 / 127.0) == d0, "no amax with a round scale"
    exact = [k + 0.5 for k in range(-120, 121, 9)]
    blk[0, :] = 0.25
    blk[0, 0] = amax
    blk[0, 1:1 + len(exact)] = np.array(exact) * np.float64(d0)
    blk[1, :] = 0.0                                               # all zero
    blk[2, :] = np.float32(1e-40) * rng.uniform(-1, 1, 32).astype(np.float32)  # subnormal block
    blk[3, :5] = [np.float32(1e-42), -np.float32(1e-39), 0.0, -0.0, np.float32(2.0 ** -126)]
    blk[4, 7] = -10.0                                             # negative maximum
    blk[5, :] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-30)
    q, d, _ = mm.q8_1_reference(x)
    # the stated rounding: half away from zero
    assert d[0, 0] == d0
    for i, v in enumerate(exact):
        assert q[0, 1 + i] == int(np.sign(v) * np.floor(abs(v) + 0.5))  # e.g. 2.5 -> 3, -2.5 -> -3
    assert d[0, 1] == 0 and d[0, 2] == 0 and not q[0, 32:96].any()
    name = "mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr4_emu"
    tool_kernels(name)
    _vecq_run(device, bufs, rng, "q8_0", name, 1, n_total=3, r0=0, n=3, K=K, y_col=0, x=x)


def test_vecq_shapes_share_one_module_per_code_path(device, bufs, rng):
    """mul_mat_vecq's WG, NR, UNR and columns are specialization constants: shapes of one
    code path (block loads, rows per thread, reduction, ...) name one module. Q4_1's shipped GPU
    and CPU decode shapes are two pipelines of one SPIR-V module, each matching the float64
    reference (both bounds of _vecq_run); a shape the kernel cannot run is refused."""
    from vkxsplit.vk.kernel import Kernel

    _vecq_skip_feature(device)
    gpu, cpu = mm.vecq_default_config("q4_1", False), mm.vecq_default_config("q4_1", True)
    names = [mm.vecq_name("q4_1", gpu), mm.vecq_name("q4_1", cpu)]
    ma, mb = (shaders.variant_meta(n) for n in names)
    assert ma["module"] == mb["module"] == mk.vecq_module_name("q4_1", gpu) and ma["spec"] != mb["spec"]
    assert shaders.spirv(names[0]) == shaders.spirv(names[1])
    code = (shaders.SPV_DIR / f"{ma['module']}.spv").read_bytes()
    assert set(shaders.spec_constants(code)) == set(mk.VECQ_SPEC_IDS.values())
    assert mm.vecq_spec(names[1]) == ("q4_1", cpu, 1)
    ka, kb = Kernel.get(device, names[0]), Kernel.get(device, names[1])
    assert ka is not kb and ka.pipeline != kb.pipeline
    for name, cfg in zip(names, (gpu, cpu)):
        _vecq_run(device, bufs, rng, "q4_1", name, 1, n_total=cfg.rows + 3, r0=1, n=cfg.rows + 2, K=288, y_col=2)
    for bad, maxm in ((mm.VecqConfig(128, 3, blk=1), 1), (mm.VecqConfig(64, 64, blk=1), 2),
                      (mm.VecqConfig(64, 32, blk=1, rpt=4), 1)):
        with pytest.raises(KernelError, match="multiple of NR"):
            mm.make_vecq_variant("x", "q4_0", bad, maxm)


def _vecq_skip_feature(device):
    if not device.features.get("shaderIntegerDotProduct"):
        pytest.skip(f"'{device.name}' lacks shaderIntegerDotProduct")


def test_mat_vecq_real_matches_emulated(device, bufs, rng, tool_kernels):
    """The packed dot-product instructions give the same bits as the int multiply-add
    fallback (exact integer block sums, same float operations in the same order)."""
    for t in mm.VECQ_TYPES:
        for tag in ("b8_wg128_nr4", "b1_wg128_nr4"):
            real, emu = f"mul_mat_vecq_{t}_q8_1_m1_{tag}", f"mul_mat_vecq_{t}_q8_1_m1_{tag}_emu"
            if real not in tk.VECQ_SWEEP:  # Q4_1: single-block loads only
                continue
            _vecq_skip(device, real)
            tool_kernels(real, emu)
            x = rng.standard_normal((1, 1024)).astype(np.float32)
            seed = int(rng.integers(1 << 30))
            a = _vecq_run(device, bufs, np.random.default_rng(seed), t, real, 1, 9, 0, 9, 1024, 0, x=x)
            b = _vecq_run(device, bufs, np.random.default_rng(seed), t, emu, 1, 9, 0, 9, 1024, 0, x=x)
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_mat_vecq_errors(device, bufs, seq, tool_kernels):
    tool_kernels("mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr4_emu", "mul_mat_vecq_q4_0_q8_1_m1_b8_wg128_nr4_emu",
                 "mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr4_emu")
    t, K, N = "q4_0", 288, 4
    wb = bufs.new(row_bytes(t, K) * N)
    xb = bufs.new(4 * 4 * K)
    yb = bufs.new(4 * 4 * N)
    qb = bufs.new(mm.vecq_scratch_bytes(4, K) + 16)
    b1 = "mul_mat_vecq_q4_0_q8_1_m1_b1_wg128_nr4_emu"
    cases = [
        (dict(variant="mul_mat_vecq_q4_0_q8_1_m1_b8_wg128_nr4_emu"), "K % 256"),
        (dict(variant="mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr4_emu"), "not an integer-dot"),
        (dict(variant="mul_mat_vec_q4_0_f32_m1"), "not an integer-dot"),
        (dict(variant=b1, M=2), "not an integer-dot"),
        (dict(variant=b1, xq=View(qb, 8)), "16-byte aligned"),
        (dict(variant=b1, xq=View(qb, 0, mm.vecq_scratch_bytes(1, K) - 8)), "scratch has"),
        (dict(variant=b1, xq=xb), "overlaps"),
    ]
    for kw, match in cases:
        with pytest.raises(KernelError, match=match):
            mm.record_mul_mat_vecq(seq, wb, t, xb, kw.get("xq", qb), yb, kw.get("M", 1), N, K,
                                   variant=kw["variant"])
    with pytest.raises(KernelError, match="block size"):
        mm.record_mul_mat_vecq(seq, wb, t, xb, qb, yb, 1, N, 100, variant=b1)
    assert seq.dispatches == 0


def test_mat_vecq_one_barrier(device, bufs, tool_kernels):
    """quantize -> barrier -> dot product: the sequence records exactly one barrier between."""
    tool_kernels("mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr4_emu")
    t, K, N = "q8_0", 256, 8
    raw, _ = make_weights(np.random.default_rng(1), t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    xb = bufs.new(4 * K, np.ones(K, np.float32))
    qb = bufs.new(mm.vecq_scratch_bytes(1, K))
    yb = bufs.new(4 * N)
    s = Sequence(device, "mmq")
    try:
        before = s.barriers
        mm.record_mul_mat_vecq(s, wb, t, xb, qb, yb, 1, N, K, variant="mul_mat_vecq_q8_0_q8_1_m1_b1_wg128_nr4_emu")
        assert (s.dispatches, s.barriers - before) == (2, 1)
        s.run()
    finally:
        s.close()


def test_vecq_tables(tool_kernels):
    tool_kernels(*tk.VECQ_SWEEP)
    allv = shaders.all_variants()
    declared = tk.all_declared()
    assert mm.VECQ_QUANTIZE in allv and not allv[mm.VECQ_QUANTIZE].requires
    for name, (t, cfg, maxm) in tk.VECQ_SWEEP.items():
        assert t in mm.VECQ_TYPES and name == f"mul_mat_vecq_{t}_q8_1_m{maxm}_{cfg.tag}"
        assert mm.vec_config(name) == cfg and cfg.wg % cfg.nr == 0 and cfg.nr * maxm <= cfg.wg
        assert mm.vecq_spec(name) == (t, cfg, maxm)
        assert cfg.blk in (1, 8) and not (cfg.sat and not cfg.idp) and (cfg.blk == 1 or t not in ("q4_1", "q4_k", "q6_k"))
        v = declared[name]
        assert ("shaderIntegerDotProduct" in v.requires) == bool(cfg.idp)
        assert {"storageBuffer16BitAccess", "storageBuffer8BitAccess"} <= set(v.requires)
        assert name not in tk.VEC_SWEEP and name not in tk.VEC_WIDE
    # every type has an emulated (feature-free) single-block variant
    assert all(any(ty == t and not c.idp and c.blk == 1 for ty, c, _ in tk.VECQ_SWEEP.values())
               for t in mm.VECQ_TYPES)
    # what ships: each device kind's decode shape per type, the GPUs' tall shapes, and the
    # halfword twin of each whole-word (w5u) shape (vecq_fits' fallback); nothing else
    shipped = {n for n, v in allv.items() if v.source == "mul_mat_vecq.comp" and "MUL_MAT_ID" not in v.defines}
    want = set()
    for t in mm.VECQ_TYPES:
        cfgs = [mm.vecq_default_config(t, cpu=True)]
        if t in mm.VECQ_GPU_TYPES:
            cfgs += [mm.vecq_default_config(t, cpu=False), *([mm.VECQ_GPU_M1_TALL[t]] if t in mm.VECQ_GPU_M1_TALL else [])]
        want |= {mm.vecq_name(t, c) for c in cfgs} | {mm.vecq_name(t, replace(c, w5u=0)) for c in cfgs}
    assert shipped == want and shipped <= set(tk.VECQ_SWEEP)


def test_vecq_default_policy(device, monkeypatch):
    """Which decode mat-vecs take x as q8_1: Q4_0/Q4_1/Q8_0/Q4_K everywhere with integer dot
    products, Q6_K on CPU devices, never at M > 1, never with ``intdot`` switched off; the
    variant's shape is the device kind's (on GPUs per type where one was measured faster), and
    every choice, with its halfword twin where it loads whole words, ships."""
    kc = kernels_for(device)
    if "intdot" in device.disabled or not device.features.get("shaderIntegerDotProduct"):
        assert all(kc.vecq(t, 1) is None for t in mm.VECQ_TYPES)
        return
    shipped = shaders.shipped()
    cpu = device.is_cpu
    for t in mm.VECQ_TYPES:
        cfg = mk.VECQ_DEFAULT_M1["cpu"] if cpu else mk.VECQ_GPU_M1_BY_TYPE.get(t, mk.VECQ_DEFAULT_M1["gpu"])
        want = f"mul_mat_vecq_{t}_q8_1_m1_{cfg.tag}" if cpu or t in mm.VECQ_GPU_TYPES else None
        assert kc.vecq(t, 1) == want and (want is None or want in shipped)
        assert kc.vecq(t, 2) is None
    assert kc.vecq("f16", 1) is None and kc.vecq("q5_k", 1) is None
    for t in mm.VECQ_GPU_TYPES:
        assert f"mul_mat_vecq_{t}_q8_1_m1_{mm.vecq_default_config(t, cpu=False).tag}" in shipped
    # tall products (the FFN's gate / up) take VECQ_GPU_M1_TALL's shape on GPUs only
    gpu_q4 = f"mul_mat_vecq_q4_0_q8_1_m1_{mm.vecq_default_config('q4_0', cpu=False).tag}"
    tall = choose.vecq_for_shape(gpu_q4, "q4_0", 14336, 4096)
    assert tall != gpu_q4 and tall in shipped and mm.vecq_spec(tall)[1].rpt == 4
    assert choose.vecq_for_shape(gpu_q4, "q4_0", 4096, 4096) == gpu_q4
    assert choose.vecq_for_shape(gpu_q4, "q4_0", 4096, 14336) == gpu_q4
    cpu_q4 = f"mul_mat_vecq_q4_0_q8_1_m1_{mm.vecq_default_config('q4_0', cpu=True).tag}"
    assert choose.vecq_for_shape(cpu_q4, "q4_0", 14336, 4096) == cpu_q4
    gpu_q8 = f"mul_mat_vecq_q8_0_q8_1_m1_{mm.vecq_default_config('q8_0', cpu=False).tag}"
    tall8 = choose.vecq_for_shape(gpu_q8, "q8_0", 14336, 4096)
    assert tall8 != gpu_q8 and tall8 in shipped and mm.vecq_spec(tall8)[1].sg == 1
    assert choose.vecq_for_shape(gpu_q8, "q8_0", 4096, 14336) == gpu_q8
    # the whole-word (w5u) shapes' halfword twins ship: record_mul_mat_vecq records them where
    # the weight binding ends inside the last row's trailing word
    for v in (gpu_q4, tall):
        assert mm.vecq_spec(v)[1].w5u == 1 and v.replace("_w5u", "") in shipped
    # intdot switched off for a device (VKXSPLIT_DISABLE=intdot): f32 x everywhere
    off = types.SimpleNamespace(physical=device.physical, features=device.features, disabled=frozenset({"intdot"}))
    assert all(kernels_for(off).vecq(t, 1) is None for t in mm.VECQ_TYPES)
    assert kernels_for(off).vecq_decode() == {} and kc.vecq_decode()

