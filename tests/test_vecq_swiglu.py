"""The decode mat-vec of gate and up with the SwiGLU in its epilogue (``mul_mat_vecq_swiglu_*``:
shaders/mul_mat_vecq.comp with GLU, ops.mul_mat.record_mul_mat_vecq_swiglu), every shipped
variant (the CPU shape of each q8_1-x type, the GPU shapes: RPT 2 with and without whole-word
loads, Q4_1 and Q4_K's quarter super-blocks; each runs on lavapipe too) and the experiment
kernels of the code paths no default takes (BLK 8, Q4_K whole super-blocks; tools/kernels.py).

x is given as q8_1 blocks (q8_1_reference's, written into the scratch by numpy), so the
reference is exact in its input: g = (d q) @ W_gate^T and u = (d q) @ W_up^T in float64 from
the dequantized weights, h = silu(g) u. Bounds, fixed before any run:
- g and u as the plain vecq kernel's bound (a) (tests/test_mul_mat.py): per term at most
  2 nb + 8 roundings (the blocks a lane sums, then the tree over the team, log2(lanes) <= 6);
- h: |dh| <= |silu'(g)| |dg| |u| + |silu(g)| |du| + 2^-18 (1 + |g|) |h| (|silu'| <= 1.1; the
  last term: exp, the division and the products in f32, with Vulkan's exp error of 3 + 2|g| ulp).
The q8_1 blocks the kernel writes are checked byte for byte against quantize_q8_1 of its own f32
output (the kernel on the device, and q8_1_reference). A kernel with gate and up swapped (silu
applied to up) fails the same check.
"""

from __future__ import annotations

import kernels as tk  # tools/kernels.py: the experiment variants
import numpy as np
import pytest
from test_mul_mat import Bufs, U, abs_terms, make_weights

from vkxsplit.errors import KernelError
from vkxsplit.ops import mul_mat as mm
from vkxsplit.ops import mul_mat_kernels as mk
from vkxsplit.vk.command import Sequence

SHIPPED = sorted(mm._vecq_glu_shipped())
EXPERIMENT = sorted(tk.VECQ_GLU_EXTRA)


@pytest.fixture
def bufs(device):
    b = Bufs(device)
    yield b
    b.close()


def _xq_bytes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (1 x K) as the q8_1 scratch bytes quantize_q8_1 writes, and (q, d, sums)."""
    q, d, s = mm.q8_1_reference(x)
    meta = np.stack([d.ravel().view(np.uint32), s.ravel().astype(np.int32).view(np.uint32)], axis=1)
    return np.concatenate([q.ravel().view(np.uint8), meta.ravel().view(np.uint8)]), q, d, s


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _run(device, bufs, rng, t, name, N, K, r0=0, q8=True, w_pad=0, swap=False):
    """Rows [r0, r0 + N) of gate and up (N + r0 + 1 rows each, random weights) times random
    x; y and its q8_1 blocks poisoned, with a guard past each. Returns (y, h_ref, bound, q8 bytes
    or None)."""
    rows = N + r0 + 1
    rg, Wg = make_weights(rng, t, rows, K)
    ru, Wu = make_weights(rng, t, rows, K)
    bg, bu = bufs.new(rg.nbytes + w_pad, rg), bufs.new(ru.nbytes + w_pad, ru)
    x = (rng.standard_normal((1, K)) * (4 / np.sqrt(K))).astype(np.float32)  # (g and u of a few units)
    xqb, q, d, _ = _xq_bytes(x)
    xq = bufs.new(xqb.nbytes, xqb)
    yb = bufs.new(4 * N + 64)
    yv = yb.numpy(np.float32, (N + 16,))
    yv[:] = np.nan
    nq = mm.vecq_scratch_bytes(1, N) if q8 else 0
    qb = bufs.new(nq + 64) if q8 else None
    if q8:
        qb.numpy(np.uint8, (nq + 64,))[:] = 0xAB
    seq = Sequence(device, "glu")
    try:
        a, b = (bu, bg) if swap else (bg, bu)
        mm.record_mul_mat_vecq_swiglu(seq, a, b, t, xq, yb, qb, N, K, variant=name, w_row_offset=r0)
        assert seq.dispatches == 1
        seq.run()
    finally:
        seq.close()
    assert np.isnan(yv[N:]).all(), "wrote past y"
    y = yv[:N].copy()
    xdq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    nb = K // 32
    g = (xdq @ Wg[r0:r0 + N].T)[0]
    u = (xdq @ Wu[r0:r0 + N].T)[0]
    bg_ = (2 * nb + 8) * U * (np.abs(xdq) @ abs_terms(rg, t, Wg)[r0:r0 + N].T)[0]
    bu_ = (2 * nb + 8) * U * (np.abs(xdq) @ abs_terms(ru, t, Wu)[r0:r0 + N].T)[0]
    h = _silu(g) * u
    bound = 1.1 * bg_ * (np.abs(u) + bu_) + np.abs(_silu(g)) * bu_ + 2.0 ** -18 * (1 + np.abs(g)) * np.abs(h)
    got_q8 = None
    if q8:
        sb = qb.numpy(np.uint8, (nq + 64,))
        assert (sb[nq:] == 0xAB).all(), "wrote past the q8_1 scratch"
        got_q8 = sb[:nq].copy()
    return y, h, bound, got_q8


def _quantize_on_device(device, bufs, y):
    N = y.size
    yb = bufs.new(y.nbytes, y)
    nq = mm.vecq_scratch_bytes(1, N)
    qb = bufs.new(nq)
    seq = Sequence(device, "q8")
    try:
        mm.record_quantize_q8_1(seq, yb, qb, 1, N, N, 0)
        seq.run()
    finally:
        seq.close()
    return qb.numpy(np.uint8, (nq,)).copy()


def _check(y, h, bound):
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - h)
    assert (err <= bound).all(), (float((err / np.maximum(bound, 1e-300)).max()), int(np.argmax(err - bound)))


def _shape(name):
    t, cfg = mk.vecq_glu_spec(name)
    unit = 256 if cfg.blk == 8 or t in ("q4_k", "q6_k") else 32
    return t, cfg, unit


def _skip(device, name):
    if not device.features.get("shaderIntegerDotProduct"):
        pytest.skip(f"'{device.name}' lacks shaderIntegerDotProduct")


@pytest.mark.parametrize("name", SHIPPED + EXPERIMENT)
def test_swiglu_kernel(device, bufs, rng, name, tool_kernels):
    """Each variant: N a multiple of 32 but not of the workgroup's rows (where they differ) with
    q8_1 blocks, and N odd (rows past N computed, not written; f32 only), a row offset, K with an
    odd number of blocks and K long enough for several loop iterations per lane; the q8_1
    bytes equal quantize_q8_1 of the kernel's own f32 y."""
    _skip(device, name)
    if name in EXPERIMENT:
        tool_kernels(name)
    t, cfg, unit = _shape(name)
    lanes = cfg.wg // cfg.nr
    R = cfg.rows
    pad = 2 if cfg.w5u else 0
    Ks = (unit * 9 if unit == 32 else 1280, unit * (2 * cfg.unr * lanes + 3))
    for N, K, r0, q8 in ((R + 32, Ks[0], 0, True), (R + 5, Ks[0], 3, False), (2 * R, Ks[1], 1, True)):
        y, h, bound, got = _run(device, bufs, rng, t, name, N, K, r0=r0, q8=q8, w_pad=pad)
        _check(y, h, bound)
        if q8:
            assert np.array_equal(got, _quantize_on_device(device, bufs, y))
            want, _, _, _ = _xq_bytes(y[None, :])
            assert np.array_equal(got, want)


@pytest.mark.parametrize("name", [SHIPPED[0], *[n for n in SHIPPED if "wg1024" in n][:1]])
def test_swapped_gate_and_up_fails(device, bufs, rng, name):
    """The check is not trivially met: silu applied to up instead of gate (the bindings swapped)
    fails it."""
    _skip(device, name)
    t, cfg, unit = _shape(name)
    y, h, bound, _ = _run(device, bufs, rng, t, name, cfg.rows, unit * 9 if unit == 32 else 512, swap=True)
    with pytest.raises(AssertionError):
        _check(y, h, bound)


def test_swiglu_w5u_fallback(device, bufs, rng):
    """A w5u variant over weights whose binding ends 2 bytes into the last row's trailing word
    (an odd number of Q4_0 blocks, bound exactly) records its halfword twin, still right."""
    name = next(n for n in SHIPPED if n.endswith("_w5u"))
    _skip(device, name)
    t, cfg, _ = _shape(name)
    y, h, bound, _ = _run(device, bufs, rng, t, name, cfg.rows, 32 * 9, w_pad=0)
    _check(y, h, bound)


def test_swiglu_refusals(device, bufs):
    """What the kernel cannot do is refused: q8_1 blocks of N % 32 != 0 rows, a variant of
    another type, the output's q8_1 scratch overlapping x's."""
    name = next(n for n in SHIPPED if "_q8_0_" in n)
    K, N = 64, 40
    w = bufs.new(mm.TYPES["q8_0"].row_bytes(K) * 64)
    xq = bufs.new(mm.vecq_scratch_bytes(1, K))
    y = bufs.new(4 * 64)
    q = bufs.new(mm.vecq_scratch_bytes(1, 64))
    seq = Sequence(device, "refuse")
    try:
        with pytest.raises(KernelError, match="N % 32"):
            mm.record_mul_mat_vecq_swiglu(seq, w, w, "q8_0", xq, y, q, N, K, variant=name)
        with pytest.raises(KernelError, match="not a SwiGLU"):
            mm.record_mul_mat_vecq_swiglu(seq, w, w, "q4_0", xq, y, q, 32, K, variant=name)
        with pytest.raises(KernelError, match="overlaps"):
            mm.record_mul_mat_vecq_swiglu(seq, w, w, "q8_0", xq, y, xq, 32, K, variant=name)
    finally:
        seq.close()


def test_shapes():
    """Every shipped SwiGLU shape: whole q8_1 blocks per workgroup, a power-of-two team, within
    1024 invocations; each GPU type's and the CPU shape ship; make_vecq_glu_variant refuses others."""
    for name in SHIPPED:
        t, cfg = mm._vecq_glu_shipped()[name]
        assert cfg.rows % 32 == 0 and cfg.wg <= 1024 and not cfg.sg
    for t, cfg in mk.VECQ_GLU_GPU.items():
        assert mk.vecq_glu_name(t, cfg) in SHIPPED
    with pytest.raises(KernelError):
        mk.make_vecq_glu_variant("x", "q8_0", mk.VecqConfig(128, 4, blk=1))  # 4 rows: not whole blocks
    with pytest.raises(KernelError):
        mk.make_vecq_glu_variant("x", "q8_0", mk.VecqConfig(96, 32, blk=1))  # 3 lanes
