"""Probes (tools/probes.py, built on demand with the other experiment kernels): the read-only launch and the cooperative-matrix multiply-add
loops that tools/bench_kernels.py reads the library's kernels against. A probe that skipped
work would look fast, so each is checked here: the read against numpy's wrapping sum of the
words, the multiply-adds against float64 (integer operands: every sum is exact in f32)."""

from __future__ import annotations

import numpy as np
import probes as pr  # tools/probes.py
import pytest

from vkxsplit.errors import KernelError
from vkxsplit.vk.command import Sequence


@pytest.fixture(autouse=True)
def _probe_kernels(tool_kernels):
    """The probes built and loaded (those of the workgroup-scope multiply-add need glslang15:
    their test asks for them itself, and runs only on a coopmat2 device anyway)."""
    tool_kernels(*(v.name for v in pr.VARIANTS if v.compiler != "glslang15"))
    return tool_kernels


def _run(device, record) -> None:
    """Record ``record(seq)`` into a new sequence and run it (closed also on failure)."""
    s = Sequence(device, "probe")
    try:
        record(s)
        s.run(timeout=60)
    finally:
        s.close()


@pytest.mark.parametrize("unroll", pr.READ_UNROLLS)
@pytest.mark.parametrize("nbytes,groups,passes", [(16, None, 1), (4096 * 16 + 48, None, 1), (1 << 20, None, 1),
                                                  (1 << 20, 3, 1), (5 * 256 * 8 * 16 + 16, 2, 1),
                                                  (4096 * 16 + 48, 5, 3)])
def test_probe_read_sums_every_word(device, unroll, nbytes, groups, passes):
    rng = np.random.default_rng(nbytes + unroll)
    words = rng.integers(0, 1 << 32, nbytes // 4 + 8, dtype=np.uint64).astype(np.uint32)
    mem = device.memory
    g = pr.read_groups(device, nbytes, unroll) if groups is None else groups
    src, out = mem.alloc(words.nbytes, "host", "src"), mem.alloc(4 * g + 4, "host", "out")
    try:
        src.numpy(np.uint32)[:] = words
        out.numpy(np.uint32)[:] = 0xDEADBEEF  # poisoned: a workgroup that skips its store fails
        _run(device, lambda s: pr.record_probe_read(s, src, out, nbytes, unroll, groups, passes))
        want = passes * int(words[: nbytes // 4].astype(np.uint64).sum()) % (1 << 32)  # the 8 words past nbytes: unread
        got = out.numpy(np.uint32)
        assert int(got[:g].astype(np.uint64).sum()) % (1 << 32) == want
        assert got[g] == 0xDEADBEEF  # nothing past the workgroups' words
    finally:
        src.close()
        out.close()


def test_probe_read_rejects_bad_sizes(device):
    mem = device.memory
    src, out = mem.alloc(64, "host", "src"), mem.alloc(16, "host", "out")
    try:
        s = Sequence(device, "bad")
        for nbytes in (0, 24, 80):  # not a multiple of 16; past the binding
            with pytest.raises(KernelError, match="probe_read"):
                pr.record_probe_read(s, src, out, nbytes)
        with pytest.raises(KernelError, match="passes"):
            pr.record_probe_read(s, src, out, 64, passes=0)
        with pytest.raises(KernelError, match="one per workgroup"):
            pr.record_probe_read(s, src, out, 64, groups=5)  # out holds 4 words
        with pytest.raises(KernelError, match="2\\^32"):  # uvec4 indices past 2^32 would wrap: refused
            pr.record_probe_read(s, src, out, 1 << 36, unroll=2, groups=1)
        with pytest.raises(KernelError, match="unroll"):
            pr.record_probe_read(s, src, out, 64, unroll=3)
        s.close()
    finally:
        src.close()
        out.close()


@pytest.mark.parametrize("tile", [None, *pr.MMA_WG_TILES], ids=lambda t: "sg" if t is None else t.tag)
def test_probe_mma_is_iters_times_the_product(device, tile, tool_kernels):
    if not pr.mma_supported(device, tile):
        pytest.skip(f"'{device.name}' cannot run {pr.mma_variant(tile)}")
    tool_kernels(pr.mma_variant(tile))
    rng = np.random.default_rng(7)
    (ar, ac), (br, bc), per = pr.mma_shapes(tile)
    a = rng.integers(-1, 2, (ar, ac)).astype(np.float16)
    b = rng.integers(-1, 2, (br, bc)).astype(np.float16)
    groups, iters = 3, 37
    mem = device.memory
    ba, bb, bo = mem.alloc(a.nbytes, "host", "a"), mem.alloc(b.nbytes, "host", "b"), mem.alloc(4 * per * groups, "host", "o")
    try:
        ba.numpy(np.float16)[:] = a.ravel()
        bb.numpy(np.float16)[:] = b.ravel()
        bo.numpy(np.float32)[:] = np.nan  # poisoned: an unstored element fails
        _run(device, lambda s: pr.record_probe_mma(s, ba, bb, bo, iters, groups, tile))
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        if tile is None:  # per subgroup, FM x FN 16 x 16 blocks: fragment i of A times fragment j of B
            fa, fb = a64.reshape(-1, 16, 16), b64.reshape(-1, 16, 16)
            one = np.einsum("ikl,jlm->ijkm", fa, fb).reshape(-1)
            want = np.tile(iters * one, per * groups // one.size)
        else:
            want = np.tile((iters * (a64 @ b64)).ravel(), groups)
        assert np.array_equal(bo.numpy(np.float32)[: per * groups].astype(np.float64), want)
        # 2 flops per multiply-add: per workgroup, 4 subgroups of 2 x 4 16x16x16 products, or one
        # BW x BX x BK product, per round
        per_round = 4 * 2 * 4 * 16 ** 3 if tile is None else tile.bw * tile.bx * tile.bk
        assert pr.mma_flops(tile, groups, iters) == 2 * per_round * groups * iters
    finally:
        for buf in (ba, bb, bo):
            buf.close()


@pytest.mark.parametrize("base", pr.NOX_BASES)
def test_probe_vecq_nox_sums_the_rows(device, base):
    """The decode kernel without its x loads (every x element 1, scale 1): y is each row's sum
    of the weights, against float64 sums of gguf's dequantization."""
    from gguf import GGMLQuantizationType, quantize
    from gguf.quants import dequantize

    from vkxsplit.ops import mul_mat as mm

    t = mm.vecq_spec(base)[0]
    rng = np.random.default_rng(11)
    N, K = 37, 1024  # N not a multiple of the workgroup's rows
    qt = GGMLQuantizationType[t.upper()]
    raw = quantize(rng.standard_normal((N, K)).astype(np.float32), qt)
    W = dequantize(raw, qt).astype(np.float64)
    mem = device.memory
    wb, sb, yb = mem.alloc(raw.nbytes, "host", "w"), mem.alloc(16, "host", "x"), mem.alloc(4 * N + 4, "host", "y")
    try:
        wb.numpy(np.uint8)[: raw.nbytes] = raw.reshape(-1).view(np.uint8)
        yb.numpy(np.float32)[:] = np.nan  # poisoned
        _run(device, lambda s: pr.record_probe_vecq_nox(s, wb, t, sb, yb, N, K, base))
        y = yb.numpy(np.float32)[: N + 1].astype(np.float64)
        want = W.sum(axis=1)
        assert np.all(np.abs(y[:N] - want) <= 1e-5 * np.abs(W).sum(axis=1))
        assert np.isnan(y[N])  # nothing past the N rows
        with pytest.raises(KernelError, match="probe_vecq_nox"):
            _run(device, lambda s: pr.record_probe_vecq_nox(s, wb, "q4_1", sb, yb, N, K, base))
    finally:
        for b in (wb, sb, yb):
            b.close()


@pytest.mark.parametrize("base", pr.NOX_BASES)
def test_probe_vecq_noc_folds_the_blocks(device, base):
    """The decode kernel with its weight loads only: y[n] is the sum over row n's blocks of the
    xor of the block's quant bytes and the 4 bytes of its f16 scale as f32, against numpy on the
    raw GGUF blocks (every byte of every block counts, so a load left out changes y)."""
    from gguf import GGMLQuantizationType, quantize

    from vkxsplit.ops import mul_mat as mm

    t = mm.vecq_spec(base)[0]
    rng = np.random.default_rng(12)
    N, K = 37, 1024
    qt = GGMLQuantizationType[t.upper()]
    raw = quantize(rng.standard_normal((N, K)).astype(np.float32), qt)
    bsz = 18 if t == "q4_0" else 34
    blocks = raw.reshape(N, K // 32, bsz)
    d32 = blocks[..., :2].copy().view(np.float16).astype(np.float32).view(np.uint32)[..., 0]
    fold = np.bitwise_xor.reduce(blocks[..., 2:], axis=-1)
    for sh in (0, 8, 16, 24):
        fold ^= ((d32 >> sh) & 0xFF).astype(np.uint8)
    want = fold.astype(np.float64).sum(axis=1)
    mem = device.memory
    wb, sb, yb = mem.alloc(raw.nbytes, "host", "w"), mem.alloc(16, "host", "x"), mem.alloc(4 * N + 4, "host", "y")
    try:
        wb.numpy(np.uint8)[: raw.nbytes] = raw.reshape(-1).view(np.uint8)
        yb.numpy(np.float32)[:] = np.nan  # poisoned
        _run(device, lambda s: pr.record_probe_vecq_nox(s, wb, t, sb, yb, N, K, base, kind="noc"))
        y = yb.numpy(np.float32)[: N + 1].astype(np.float64)
        assert np.array_equal(y[:N], want)
        assert np.isnan(y[N])
        with pytest.raises(KernelError, match="kind"):
            _run(device, lambda s: pr.record_probe_vecq_nox(s, wb, t, sb, yb, N, K, base, kind="nothing"))
    finally:
        for b in (wb, sb, yb):
            b.close()


@pytest.mark.parametrize("shape", pr.ROWS_SHAPES, ids=lambda t: t.tag)
@pytest.mark.parametrize("rows,row_bytes,groups", [(37, 1152, None), (37, 1152, 3), (8, 16 * 4100, None), (1, 16, 1)])
def test_probe_read_rows_sums_each_row(device, shape, rows, row_bytes, groups):
    """The read-only launch in a decode kernel's grid: out[row] is the wrapping sum of the row's
    words, against numpy; rows not a multiple of the workgroup's, fewer workgroups than row groups
    (they loop), rows longer than a round of loads; the word after the rows stays poisoned."""
    rng = np.random.default_rng(rows * row_bytes + shape.v)
    words = rng.integers(0, 1 << 32, rows * row_bytes // 4 + 8, dtype=np.uint64).astype(np.uint32)
    mem = device.memory
    src, out = mem.alloc(words.nbytes, "host", "src"), mem.alloc(4 * rows + 4, "host", "out")
    try:
        src.numpy(np.uint32)[:] = words
        out.numpy(np.uint32)[:] = 0xDEADBEEF
        _run(device, lambda s: pr.record_probe_read_rows(s, src, out, rows, row_bytes, shape, groups))
        want = words[: rows * row_bytes // 4].reshape(rows, -1).astype(np.uint64).sum(axis=1) % (1 << 32)
        got = out.numpy(np.uint32)
        assert np.array_equal(got[:rows].astype(np.uint64), want)
        assert got[rows] == 0xDEADBEEF
    finally:
        src.close()
        out.close()


def test_probe_read_rows_rejects_bad_sizes(device):
    mem = device.memory
    src, out = mem.alloc(256, "host", "src"), mem.alloc(16, "host", "out")
    v4, v1 = pr.ROWS_SHAPES[0], pr.ROWS_SHAPES[1]
    try:
        s = Sequence(device, "bad")
        with pytest.raises(KernelError, match="multiple of 16"):
            pr.record_probe_read_rows(s, src, out, 2, 20, v4)  # rows of 20 bytes: not whole uvec4
        with pytest.raises(KernelError, match="src binding"):
            pr.record_probe_read_rows(s, src, out, 4, 128, v1)  # 512 bytes past the 256 bound
        with pytest.raises(KernelError, match="one per row"):
            pr.record_probe_read_rows(s, src, out, 8, 16, v4)  # out holds 4 words
        with pytest.raises(KernelError, match="not one of"):
            pr.record_probe_read_rows(s, src, out, 2, 16, pr.RowsShape(4, 64, 1, 1, 1))
        with pytest.raises(KernelError, match="2\\^32"):
            pr.record_probe_read_rows(s, src, out, 1 << 20, 1 << 14, v1)
        s.close()
    finally:
        src.close()
        out.close()
