"""The bf16/f16 conversion shaders, bit-exact against ml_dtypes / numpy (round to nearest even)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from vkxsplit.errors import KernelError
from vkxsplit.ops.convert import record_convert

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
BITS = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16}


def edge_values_f32() -> np.ndarray:
    """Values that exercise every rounding path of f32 -> bf16 / f16."""
    u = np.array([
        0x00000000, 0x80000000,                # +-0
        0x7F800000, 0xFF800000,                # +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF812345,  # quiet/signalling NaNs
        0x00000001, 0x807FFFFF, 0x00400000,    # f32 subnormals
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # bf16 ties (even/odd) and near-ties
        0x3FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,  # round up into next exponent / to inf
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # f16 max, just under/at overflow
        0x38800000, 0x387FFFFF, 0x38000000, 0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF,  # f16 sub
        0x3A801000, 0x3A803000, 0x3A800FFF,    # f16 subnormal ties
        0x3F800000, 0xBF800000, 0x40490FDB,
    ], dtype=np.uint32)
    return u.view(np.float32)


def _run(device, seq, x: np.ndarray, src: str, dst: str) -> np.ndarray:
    n = x.size
    a = device.memory.alloc(max(4, x.nbytes), "host", "src")
    b = device.memory.alloc(max(4, n * np.dtype(NP[dst]).itemsize), "host", "dst")
    try:
        a.numpy(np.uint8, (x.nbytes,))[:] = x.view(np.uint8)
        b.numpy(np.uint8)[:] = 0xFF  # poison: all-ones is a NaN pattern in every dtype
        record_convert(seq, a, b, n, src, dst)
        seq.run()
        return b.numpy(BITS[dst], (n,)).copy()
    finally:
        a.close()
        b.close()


def _assert_bits_equal(got: np.ndarray, want_vals: np.ndarray, dst: str) -> None:
    want = want_vals.view(BITS[dst])
    nan = np.isnan(want_vals.astype(np.float32))
    got_vals = got.view(NP[dst]).astype(np.float32)
    assert np.isnan(got_vals[nan]).all(), "NaN must stay NaN"
    bad = np.nonzero((got != want) & ~nan)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first at {bad[:5]}: got {got[bad[:5]]} want {want[bad[:5]]}"


@pytest.mark.parametrize("dst", ["bf16", "f16"])
@pytest.mark.parametrize("n", [1, 255, 257, 100_003])
def test_f32_to_16bit_random(device, seq, rng, dst, n):
    # wide exponent range: normal, subnormal-in-f16, overflow-in-f16
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 20, n))).astype(np.float32)
    got = _run(device, seq, x, "f32", dst)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(NP[dst])
    _assert_bits_equal(got, want, dst)


@pytest.mark.parametrize("dst", ["bf16", "f16"])
def test_f32_to_16bit_edges(device, seq, dst):
    x = edge_values_f32()
    got = _run(device, seq, x, "f32", dst)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(NP[dst])
    _assert_bits_equal(got, want, dst)


@pytest.mark.parametrize("src", ["bf16", "f16"])
def test_16bit_to_f32_all_patterns(device, seq, src):
    # every one of the 65536 bit patterns: exact widening (NaN stays NaN)
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = _run(device, seq, bits, src, "f32")
    _assert_bits_equal(got, bits.view(NP[src]).astype(np.float32), "f32")


def test_f16_bf16_cross(device, seq, rng):
    x = rng.standard_normal(4097).astype(np.float16)
    got = _run(device, seq, x, "f16", "bf16")
    _assert_bits_equal(got, x.astype(np.float32).astype(ml_dtypes.bfloat16), "bf16")


def test_offsets_and_bounds(device, seq, rng):
    x = rng.standard_normal(300).astype(np.float32)
    a = device.memory.alloc(x.nbytes, "host", "src")
    b = device.memory.alloc(600, "host", "dst")
    try:
        a.numpy(np.float32)[:] = x
        b.numpy(np.uint16)[:] = 0xFFFF
        record_convert(seq, a, b, 100, "f32", "bf16", src_offset=50, dst_offset=7)
        seq.run()
        out = b.numpy(np.uint16, (300,))
        assert np.array_equal(out[7:107], x[50:150].astype(ml_dtypes.bfloat16).view(np.uint16))
        assert (out[:7] == 0xFFFF).all() and (out[107:] == 0xFFFF).all(), "wrote outside its range"
        with pytest.raises(KernelError, match="do not fit"):
            record_convert(seq, a, b, 301, "f32", "bf16")
        with pytest.raises(KernelError, match="unsupported dtype"):
            record_convert(seq, a, b, 1, "f32", "q4_0")
    finally:
        a.close()
        b.close()
