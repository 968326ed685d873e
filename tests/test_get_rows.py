"""get_rows kernels (vkxsplit/ops/get_rows.py): embedding lookup of raw GGUF rows.

Every type from random valid blocks (random quant bytes, finite f16 scales; plain random
floats for F32/F16/BF16), compared with ``gguf.quants.dequantize`` of the same bytes.
Bound: types whose dequantization is one rounding, d * (q - offset) or d * sc * q with the
same operation order as numpy (F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q6_K, Q3_K, and IQ4_NL / IQ4_XS:
d * level or (d * sc) * level), must match exactly; types with an added min (Q4_1, Q5_1, Q2_K,
Q4_K, Q5_K: d*q + m) may be fused into one rounding by
the shader compiler, so they may differ by a couple of f32 ulps of the larger term, bounded
here by 2^-20 * max|row| (the rows' terms are at most ~2x the row maximum for these scales).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_mul_mat import ALL, make_weights, test_k

from vkxsplit.errors import KernelError
from vkxsplit.ops.get_rows import record_get_rows
from vkxsplit.ops.quant import row_bytes
from vkxsplit.vk.command import Sequence

EXACT = {"f32", "f16", "bf16", "q4_0", "q5_0", "q8_0", "q6_k", "q3_k", "iq4_nl", "iq4_xs"}


@pytest.fixture
def bufs(device):
    made = []

    def new(nbytes, fill=None):
        b = device.memory.alloc(max(nbytes, 4), "host", name="test")
        made.append(b)
        if fill is not None:
            b.numpy(np.uint8, (fill.nbytes,))[:] = np.ascontiguousarray(fill).view(np.uint8).ravel()
        return b

    yield new
    for b in made:
        b.close()


def _run(device, w, t, ids_buf, out_buf, n_ids, K, **kw):
    seq = Sequence(device, "get_rows")
    try:
        record_get_rows(seq, w, t, ids_buf, out_buf, n_ids, K, **kw)
        seq.run()
    finally:
        seq.close()


@pytest.mark.parametrize("t", ALL)
def test_get_rows(device, bufs, rng, t):
    n_rows, K = 13, test_k(t)
    raw, W = make_weights(rng, t, n_rows, K, random_bits=True)
    wb = bufs(raw.nbytes, raw)
    ids = np.array([3, 0, 12, 3, 7, 12, 1], np.int32)
    ib = bufs(ids.nbytes, ids)
    ob = bufs(4 * len(ids) * K)
    out = ob.numpy(np.float32, (len(ids), K))
    out[:] = np.nan
    _run(device, wb, t, ib, ob, len(ids), K)
    ref = W[ids]
    if t in EXACT:
        np.testing.assert_array_equal(out, ref.astype(np.float32))
    else:
        tol = 2.0 ** -20 * np.abs(ref).max(axis=1, keepdims=True)
        assert (np.abs(out - ref) <= tol).all()


@pytest.mark.parametrize("t", ["f16", "q4_k", "q5_0", "q3_k", "iq4_nl"])
def test_get_rows_strided_and_bad_ids(device, bufs, rng, t):
    """ids from an offset, output rows with a stride and an offset; ids outside the table give
    NaN rows; nothing between the output rows is written."""
    n_rows, K = 9, test_k(t)
    raw, W = make_weights(rng, t, n_rows, K, random_bits=True)
    wb = bufs(raw.nbytes, raw)
    ids = np.array([-5, 4, -1, 8, 9, 0, 1 << 30], np.int32)
    ib = bufs(ids.nbytes, ids)
    io, n, oo, os_ = 1, 6, 3, K + 5
    nel = oo + n * os_
    ob = bufs(4 * nel)
    out = ob.numpy(np.float32, (nel,))
    out[:] = 12345.0
    _run(device, wb, t, ib, ob, n, K, ids_offset=io, out_offset=oo, out_stride=os_)
    written = np.zeros(nel, bool)
    for i in range(n):
        row = out[oo + i * os_: oo + i * os_ + K]
        written[oo + i * os_: oo + i * os_ + K] = True
        rid = ids[io + i]
        if 0 <= rid < n_rows:
            np.testing.assert_allclose(row, W[rid], rtol=0, atol=2.0 ** -20 * np.abs(W[rid]).max())
        else:
            assert np.isnan(row).all(), f"id {rid} should give a NaN row"
    assert (out[~written] == 12345.0).all()


def test_get_rows_errors(device, bufs, seq):
    K = 256
    wb = bufs(row_bytes("q4_k", K) * 4)
    ib = bufs(4 * 4)
    ob = bufs(4 * 4 * K)
    with pytest.raises(KernelError, match="IQ2_XXS.*supported: .*IQ4_XS"):
        record_get_rows(seq, wb, "iq2_xxs", ib, ob, 4, K)
    with pytest.raises(KernelError, match="block size"):
        record_get_rows(seq, wb, "q4_k", ib, ob, 4, 128)
    with pytest.raises(KernelError, match="ids"):
        record_get_rows(seq, wb, "q4_k", ib, ob, 5, K)
    with pytest.raises(KernelError, match="output"):
        record_get_rows(seq, wb, "q4_k", ib, ob, 4, K, out_offset=1)
    with pytest.raises(KernelError, match="do not fit"):
        record_get_rows(seq, wb, "q4_k", ib, ob, 4, K, n_rows=5)
    with pytest.raises(KernelError, match="overlaps"):
        record_get_rows(seq, wb, "f32", ib, ib, 1, 2)
    assert seq.dispatches == 0


@pytest.mark.parametrize("t", [t for t in ALL if t not in ("f32", "f16", "bf16")])
def test_dequant_rows_f16(device, bufs, rng, t):
    """dequant_rows_<type>_f16 (mul_mat's dequantize-first path): rows row0.. of every quantized
    type to compact f16 rows at an offset, against gguf's dequantize rounded to f16 (within one
    f16 ulp: the f16 conversion's rounding is the driver's), outputs poisoned with NaN, nothing
    outside the n rows written."""
    from vkxsplit.ops.get_rows import record_dequant_rows

    n_rows, K = 11, test_k(t)
    raw, W = make_weights(rng, t, n_rows, K, random_bits=True)
    wb = bufs(raw.nbytes, raw)
    row0, n, oo = 3, 7, 8
    nel = oo + n * K + 8
    ob = bufs(2 * nel)
    out = ob.numpy(np.uint16, (nel,))
    out[:] = 0x7E00  # f16 NaN
    seq = Sequence(device, "dequant_rows")
    try:
        record_dequant_rows(seq, wb, t, ob, n, K, row0=row0, out_offset=oo)
        seq.run()
    finally:
        seq.close()
    got = out[oo:oo + n * K].view(np.float16).astype(np.float64).reshape(n, K)
    ref = W[row0:row0 + n].astype(np.float32).astype(np.float16).astype(np.float64)
    assert not np.isnan(got).any()
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
    assert (np.abs(got - ref) <= ulp).all()
    assert (out[:oo] == 0x7E00).all() and (out[oo + n * K:] == 0x7E00).all()


def test_dequant_rows_loops_over_rows(device, bufs, rng, monkeypatch):
    """More rows than workgroups across them (each workgroup loops) and rows longer than one
    workgroup's 2048 elements."""
    from vkxsplit.ops import get_rows as gr

    monkeypatch.setattr(gr, "DQ_ROW_GROUPS", 3)
    n, K = 10, 2304
    raw, W = make_weights(rng, "q8_0", n, K, random_bits=True)
    wb = bufs(raw.nbytes, raw)
    ob = bufs(2 * n * K)
    out = ob.numpy(np.uint16, (n * K,))
    out[:] = 0x7E00
    seq = Sequence(device, "dequant_rows")
    try:
        gr.record_dequant_rows(seq, wb, "q8_0", ob, n, K)
        seq.run()
    finally:
        seq.close()
    got = out.view(np.float16).astype(np.float64).reshape(n, K)
    ref = W.astype(np.float32).astype(np.float16).astype(np.float64)
    assert (np.abs(got - ref) <= np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)).all()


def test_dequant_rows_errors(device, bufs, seq):
    from vkxsplit.ops.get_rows import record_dequant_rows

    K = 256
    wb = bufs(row_bytes("q4_0", K) * 4)
    ob = bufs(2 * 4 * K)
    with pytest.raises(KernelError, match="only quantized"):
        record_dequant_rows(seq, wb, "f16", ob, 4, K)
    with pytest.raises(KernelError, match="block size"):
        record_dequant_rows(seq, wb, "q4_0", ob, 4, 48)
    with pytest.raises(KernelError, match="do not fit the weight"):
        record_dequant_rows(seq, wb, "q4_0", ob, 4, K, row0=1)
    with pytest.raises(KernelError, match="output binding"):
        record_dequant_rows(seq, wb, "q4_0", ob, 4, K, out_offset=8)
    with pytest.raises(KernelError, match="multiple of 8"):
        record_dequant_rows(seq, wb, "q4_0", ob, 1, K, out_offset=4)
    with pytest.raises(KernelError, match="overlaps"):
        record_dequant_rows(seq, wb, "q4_0", wb, 1, 32)
    assert seq.dispatches == 0
