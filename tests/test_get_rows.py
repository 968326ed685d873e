"""get_rows kernels (vkxsplit/ops/get_rows.py): embedding lookup of raw GGUF rows.

Every type from random valid blocks (random quant bytes, finite f16 scales; plain random
floats for F32/F16/BF16), compared with ``gguf.quants.dequantize`` of the same bytes.
Bound: types whose dequantization is one rounding, d * (q - offset) or d * sc * q with the
same operation order as numpy (F32, F16, BF16, Q4_0, Q5_0, Q8_0, Q6_K), must match exactly;
types with an added min (Q4_1, Q5_1, Q4_K, Q5_K: d*q + m) may be fused into one rounding by
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

EXACT = {"f32", "f16", "bf16", "q4_0", "q5_0", "q8_0", "q6_k"}


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


@pytest.mark.parametrize("t", ["f16", "q4_k", "q5_0"])
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
    with pytest.raises(KernelError, match="IQ4_NL"):
        record_get_rows(seq, wb, "iq4_nl", ib, ob, 4, K)
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
