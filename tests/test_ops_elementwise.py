"""Row ops (vkxsplit.ops.elementwise, norm, softmax, rope, argmax) against independent float64
numpy references on fresh random inputs; outputs are poisoned with NaN before every run.

Error bounds (|got - ref|, elementwise):
- add, mul, scale: exact (IEEE f32 +, * are correctly rounded on every Vulkan device), so
  the result equals the f64 reference rounded to f32.
- silu, gelu, swiglu: 1e-5 |ref| + 1e-6 (exp in f32; gelu's 1 - 2/(e^2v + 1) form, as ggml,
  loses absolute, not relative, accuracy where the result is tiny).
- rms_norm: 1e-5 |ref| + 1e-6 max|ref| (f32 sum of squares over the row).
- softmax: 1e-5 |ref| + 1e-7.
- rope: (2e-6 + 4 |theta|max 2^-24) max|x|: the angle is formed in f32 (as ggml), so its error
  grows with the position.
- argmax: exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from vkxsplit.errors import KernelError
from vkxsplit.ops.argmax import NONFINITE, record_argmax
from vkxsplit.ops.elementwise import (
    record_add,
    record_gelu,
    record_mul,
    record_scale,
    record_silu,
    record_swiglu,
)
from vkxsplit.ops.norm import record_add_rms_norm, record_rms_norm
from vkxsplit.ops.rope import record_rope
from vkxsplit.ops.softmax import record_softmax
from vkxsplit.vk.kernel import View


@pytest.fixture
def bufs(device):
    """bufs(n_floats) -> host buffer (closed after the test)."""
    made = []

    def make(n, dtype=np.float32):
        b = device.memory.alloc(n * np.dtype(dtype).itemsize, "host", name="t")
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def put(buf, arr):
    buf.numpy(arr.dtype, arr.size)[:] = arr.reshape(-1)


def get(buf, n, dtype=np.float32):
    return buf.numpy(dtype, n).copy()


def poison(buf):
    buf.numpy(np.float32)[:] = np.nan


def run(seq):
    seq.run()


def assert_close(got, ref, rtol, atol, what=""):
    got = np.asarray(got, np.float64)
    err = np.abs(got - ref)
    bound = rtol * np.abs(ref) + atol
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside bound; worst err "
                           f"{np.nanmax(err):.3g} at {np.unravel_index(np.nanargmax(err - bound), err.shape)}")


# -- add / mul ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("rows,cols,b_rows,a_stride,off", [
    (5, 777, 1, 777, 0),      # row-vector broadcast, tail
    (4, 300, 4, 300, 0),      # same shape
    (6, 33, 3, 40, 7),        # b repeated every 3 rows; strided, offset rows
    (1, 70001, 1, 70001, 0),  # one long row (several column groups)
])
def test_binary(seq, bufs, rng, op, rows, cols, b_rows, a_stride, off):
    a = rng.standard_normal((rows, a_stride)).astype(np.float32)
    b = rng.standard_normal((b_rows, cols)).astype(np.float32)
    A, B, D = bufs(off + rows * a_stride), bufs(b.size), bufs(off + rows * a_stride)
    put(A, np.concatenate([np.zeros(off, np.float32), a.reshape(-1)]))
    put(B, b)
    poison(D)
    fn = record_add if op == "add" else record_mul
    fn(seq, A, B, D, rows, cols, b_rows=b_rows, a_offset=off, a_stride=a_stride, dst_offset=off,
       dst_stride=a_stride)
    run(seq)
    got = get(D, off + rows * a_stride)[off:].reshape(rows, a_stride)[:, :cols]
    bb = np.tile(b.astype(np.float64), (rows // b_rows, 1))
    ref = a[:, :cols].astype(np.float64) + bb if op == "add" else a[:, :cols].astype(np.float64) * bb
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    # columns between rows are not written
    assert np.isnan(get(D, off + rows * a_stride)[off:].reshape(rows, a_stride)[:, cols:]).all()


def test_binary_in_place_and_views(seq, bufs, rng):
    rows, cols = 3, 513
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    A = bufs(4096)
    W = bufs(cols + 64)
    put(A, np.pad(a.reshape(-1), (0, 4096 - a.size)))
    put(W, np.pad(w, (64, 0)))
    wv = View(W, 256)  # 64 floats in: a byte-offset binding
    record_mul(seq, A, wv, A, rows, cols)        # x *= w (in place)
    record_add(seq, A, A, A, rows, cols, b_rows=rows)  # x += x
    run(seq)
    ref = (a.astype(np.float64) * w) * 2
    np.testing.assert_array_equal(get(A, rows * cols).reshape(rows, cols), ref.astype(np.float32))


# -- unary ----------------------------------------------------------------------------------

def _silu(x):
    return x / (1 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))


@pytest.mark.parametrize("op", ["scale", "silu", "gelu"])
@pytest.mark.parametrize("rows,cols,stride", [(3, 1000, 1000), (7, 5, 9)])
def test_unary(seq, bufs, rng, op, rows, cols, stride):
    x = (rng.standard_normal((rows, stride)) * 4).astype(np.float32)
    x[0, :3] = [0.0, -30.0, 30.0] if cols >= 3 else x[0, :3]
    S, D = bufs(x.size), bufs(rows * cols)
    put(S, x)
    poison(D)
    if op == "scale":
        record_scale(seq, S, D, rows, cols, 0.37, src_stride=stride)
    else:
        (record_silu if op == "silu" else record_gelu)(seq, S, D, rows, cols, src_stride=stride)
    run(seq)
    got = get(D, rows * cols).reshape(rows, cols)
    x64 = x[:, :cols].astype(np.float64)
    if op == "scale":
        np.testing.assert_array_equal(got, (x64 * np.float32(0.37)).astype(np.float32))
    else:
        ref = _silu(x64) if op == "silu" else _gelu(x64)
        assert_close(got, ref, 1e-5, 1e-6, op)


def test_unary_in_place(seq, bufs, rng):
    rows, cols = 2, 301
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    X = bufs(x.size)
    put(X, x)
    record_silu(seq, X, X, rows, cols)
    record_gelu(seq, X, X, rows, cols)
    record_scale(seq, X, X, rows, cols, -2.0)
    run(seq)
    ref = -2.0 * _gelu(_silu(x.astype(np.float64)))
    assert_close(get(X, x.size).reshape(rows, cols), ref, 3e-5, 3e-6, "silu,gelu,scale in place")


# -- swiglu ---------------------------------------------------------------------------------

def test_swiglu_two_tensors(seq, bufs, rng):
    rows, cols = 5, 1111
    g = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    u = rng.standard_normal((rows, cols)).astype(np.float32)
    G, U, D = bufs(g.size), bufs(u.size), bufs(g.size)
    put(G, g)
    put(U, u)
    poison(D)
    record_swiglu(seq, G, U, D, rows, cols)
    run(seq)
    assert_close(get(D, g.size).reshape(rows, cols), _silu(g.astype(np.float64)) * u, 1e-5, 1e-6,
                 "swiglu")


def test_swiglu_halves_in_place(seq, bufs, rng):
    rows, cols = 4, 259
    gu = rng.standard_normal((rows, 2 * cols)).astype(np.float32)
    GU = bufs(gu.size)
    put(GU, gu)
    # ggml swiglu(a): gate = first half, up = second half; the result overwrites the gate half
    record_swiglu(seq, GU, None, GU, rows, cols, dst_stride=2 * cols)
    run(seq)
    out = get(GU, gu.size).reshape(rows, 2 * cols)
    g64 = gu.astype(np.float64)
    assert_close(out[:, :cols], _silu(g64[:, :cols]) * g64[:, cols:], 1e-5, 1e-6, "swiglu halves")
    np.testing.assert_array_equal(out[:, cols:], gu[:, cols:])  # up half untouched


# -- rms_norm -------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [False, True])
# Rows of more than 32 x WG columns take the kernel's chunked path, the others its registers;
# up to 4 rows of at least 2048 columns run on the wide workgroup (WG 1024), the rest on WG 256:
# (5, 8197) the narrow chunked path, (2, 8197) and (1, 4096) the wide registers, (2, 33000) the
# wide chunked path.
@pytest.mark.parametrize("rows,cols,stride", [(3, 576, 576), (5, 1001, 1030), (2, 7, 7), (2, 8197, 8200),
                                              (5, 8197, 8200), (1, 4096, 4096), (2, 33000, 33001)])
def test_rms_norm(seq, bufs, rng, weighted, rows, cols, stride):
    x = (rng.standard_normal((rows, stride)) * 2 + 0.5).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    eps = 1e-5
    X, W, D = bufs(x.size), bufs(cols), bufs(rows * cols)
    put(X, x)
    put(W, w)
    poison(D)
    record_rms_norm(seq, X, D, rows, cols, eps, W if weighted else None, src_stride=stride)
    run(seq)
    x64 = x[:, :cols].astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + eps)
    if weighted:
        ref = ref * w
    assert_close(get(D, rows * cols).reshape(rows, cols), ref, 1e-5, 1e-6 * np.abs(ref).max(), "rms_norm")


def test_rms_norm_in_place(seq, bufs, rng):
    rows, cols = 3, 700
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    X, W = bufs(x.size), bufs(cols)
    put(X, x)
    put(W, w)
    record_rms_norm(seq, X, X, rows, cols, 1e-6, W)
    run(seq)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    assert_close(get(X, x.size).reshape(rows, cols), ref, 1e-5, 1e-6 * np.abs(ref).max(), "rms_norm in place")


@pytest.mark.parametrize("rows,cols,stride", [(1, 576, 576), (5, 1000, 1003), (3, 4097, 4097), (2, 9001, 9001),
                                              (6, 4097, 4100)])
def test_add_rms_norm(seq, bufs, rng, rows, cols, stride):
    """The residual add fused with the next norm: x += r exactly as an f32 add, dst as rms_norm."""
    x = (rng.standard_normal((rows, stride)) * 2).astype(np.float32)
    r = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    eps = 1e-5
    X, R, W, D = bufs(x.size), bufs(r.size), bufs(cols), bufs(rows * cols)
    put(X, x)
    put(R, r)
    put(W, w)
    poison(D)
    record_add_rms_norm(seq, X, R, W, D, rows, cols, eps, x_stride=stride)
    run(seq)
    xs = get(X, x.size).reshape(rows, stride)
    summed = x[:, :cols] + r  # float32 addition, as the kernel does it
    assert np.array_equal(xs[:, :cols], summed), "x += r must be the exact f32 sum"
    assert np.array_equal(xs[:, cols:], x[:, cols:]), "wrote outside the rows' columns"
    s64 = summed.astype(np.float64)
    ref = s64 / np.sqrt((s64 ** 2).mean(axis=1, keepdims=True) + eps) * w
    assert_close(get(D, rows * cols).reshape(rows, cols), ref, 1e-5, 1e-6 * np.abs(ref).max(), "add_rms_norm")


def test_rms_norm_workgroup_follows_the_rows(seq):
    """A decode step's row (few rows, wide) gets the wide workgroup, a prefill's rows the
    narrow one: both are the same SPIR-V module at two specialization values."""
    from vkxsplit.ops import norm

    for name in ("rms_norm_mul_q8_1_f32", "add_rms_norm_mul_f32"):
        assert norm._kernel(seq, name, 1, 4096).local_size[0] == norm.WG_WIDE
        assert norm._kernel(seq, name, 4, 2048).local_size[0] == norm.WG_WIDE
        assert norm._kernel(seq, name, 5, 4096).local_size[0] == norm.WG
        assert norm._kernel(seq, name, 1, 576).local_size[0] == norm.WG
    wide = [v for v in norm.VARIANTS if v.name.endswith("_wg1024")]
    assert len(wide) == len(norm.VARIANTS) // 2 and all(v.module == v.name[:-7] for v in wide)


def test_decode_kernels_stay_narrow_where_the_workgroup_is_too_wide(seq, bufs, rng, monkeypatch):
    """A device that allows 1024 invocations per workgroup but only 512 along x (a valid pair
    of limits): a decode step's norm and argmax take the 256-wide kernels, not the 1024-wide
    ones the device cannot run (Kernel would refuse them), and give the right answers."""
    from vkxsplit.vk.kernel import Kernel

    lim = seq.device.physical.limits
    monkeypatch.setitem(lim, "maxComputeWorkGroupInvocations", 1024)
    monkeypatch.setitem(lim, "maxComputeWorkGroupSize", (512, 512, 64))
    asked: list[str] = []
    kget = Kernel.get.__func__
    monkeypatch.setattr(Kernel, "get", classmethod(lambda cls, dev, name: asked.append(name) or kget(cls, dev, name)))
    cols = 4096
    x = rng.standard_normal(cols).astype(np.float32)
    x[[3000, 1000]] = 9.0
    X, D, A = bufs(cols), bufs(cols), bufs(1, np.int32)
    put(X, x)
    poison(D)
    record_rms_norm(seq, X, D, 1, cols, 1e-5)
    record_argmax(seq, X, A, 1, cols)
    run(seq)
    assert asked == ["rms_norm_f32", "argmax_f32"]
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean() + 1e-5)
    assert_close(get(D, cols), ref, 1e-5, 1e-6 * np.abs(ref).max(), "rms_norm")
    assert get(A, 1, np.int32)[0] == 1000


def test_add_rms_norm_rejects_dst_overlap(seq, bufs):
    X, R, W = bufs(64), bufs(64), bufs(64)
    with pytest.raises(KernelError, match="dst overlaps x"):
        record_add_rms_norm(seq, X, R, W, X, 1, 64)


def _q8_1_blocks(y):
    """y (f32 [rows, cols]) as q8_1 scratch bytes, written here from the format: per 32
    elements d = fl32(max|y| * fl32(1/127)) (0 unless normal), q = round(y / d) half away from
    zero, sum = the block's sum of q; layout 32 int8 per block, then (d bits, sum) per block."""
    yb = y.astype(np.float32).reshape(-1, 32)
    d = np.abs(yb).max(axis=1) * np.float32(1 / 127)
    d[~(d >= np.float32(2.0 ** -126)) | ~np.isfinite(d)] = 0
    mag = np.floor(np.abs(yb.astype(np.float64)) / np.where(d > 0, d, 1).astype(np.float64)[:, None] + 0.5)
    q = np.where(d[:, None] > 0, np.sign(yb) * np.minimum(mag, 127), 0).astype(np.int8)
    meta = np.stack([d.view(np.uint32), q.astype(np.int32).sum(axis=1, dtype=np.int32).view(np.uint32)], axis=1)
    return np.concatenate([q.view(np.uint8).ravel(), meta.astype(np.uint32).view(np.uint8).ravel()])


@pytest.mark.parametrize("fused_add", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 576), (3, 2080), (2, 32), (2, 8224), (1, 4096), (6, 2080)])
def test_rms_norm_q8_1_output(device, seq, bufs, rng, fused_add, rows, cols):
    """rms_norm * w (optionally after x += r) that also writes its output as q8_1 blocks: the
    f32 output as the plain kernel's, the blocks exactly the quantization of that output (a
    numpy model written here, and the separate quantize_q8_1 kernel on the same output),
    nothing written past the scratch. 2080 columns: three chunks of 1024 on the narrow workgroup
    (6 rows), one partial chunk of 4096 on the wide one (3 rows)."""
    from vkxsplit.ops.mul_mat import record_quantize_q8_1, vecq_scratch_bytes

    x = (rng.standard_normal((rows, cols)) * 2).astype(np.float32)
    r = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    nq = vecq_scratch_bytes(rows, cols)
    X, R, W, D = bufs(x.size), bufs(r.size), bufs(cols), bufs(x.size)
    Q, Q2 = bufs(nq // 4 + 16), bufs(nq // 4 + 16)
    for b, a in ((X, x), (R, r), (W, w)):
        put(b, a)
    poison(D)
    Q.numpy(np.uint8)[:] = 0xAB
    if fused_add:
        record_add_rms_norm(seq, X, R, W, D, rows, cols, 1e-5, xq=Q)
    else:
        record_rms_norm(seq, X, D, rows, cols, 1e-5, W, xq=Q)
    record_quantize_q8_1(seq, D, Q2, rows, cols, cols, 0)
    run(seq)
    y = get(D, x.size).reshape(rows, cols)
    s64 = (x + r if fused_add else x).astype(np.float64)
    ref = s64 / np.sqrt((s64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert_close(y, ref, 1e-5, 1e-6 * np.abs(ref).max(), "rms_norm q8_1")
    got = Q.numpy(np.uint8)
    assert np.array_equal(got[:nq], _q8_1_blocks(y)), "q8_1 blocks differ from the model of the format"
    assert np.array_equal(got[:nq], Q2.numpy(np.uint8)[:nq]), "fused and separate quantization differ"
    assert (got[nq:] == 0xAB).all(), "wrote past the scratch"


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 1536), (3, 96)])
def test_swiglu_q8_1(seq, bufs, rng, in_place, rows, cols):
    """silu(gate) * up written as f32 (in place over gate, or not) and as q8_1 blocks: the f32
    against float64, the blocks exactly the format's model of that output and the separate
    quantize kernel's bits, nothing written past the scratch."""
    from vkxsplit.ops.mul_mat import record_quantize_q8_1, record_swiglu_q8_1, vecq_scratch_bytes

    g = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    u = rng.standard_normal((rows, cols)).astype(np.float32)
    nq = vecq_scratch_bytes(rows, cols)
    G, U, D, Q, Q2 = bufs(g.size), bufs(u.size), bufs(g.size), bufs(nq // 4 + 16), bufs(nq // 4 + 16)
    put(G, g)
    put(U, u)
    poison(D)
    Q.numpy(np.uint8)[:] = 0xAB
    out = G if in_place else D
    record_swiglu_q8_1(seq, G, U, out, Q, rows, cols)
    record_quantize_q8_1(seq, out, Q2, rows, cols, cols, 0)
    run(seq)
    y = get(out, g.size).reshape(rows, cols)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    assert_close(y, ref, 1e-5, 1e-6 * np.abs(ref).max(), "swiglu q8_1")
    got = Q.numpy(np.uint8)
    assert np.array_equal(got[:nq], _q8_1_blocks(y))
    assert np.array_equal(got[:nq], Q2.numpy(np.uint8)[:nq])
    assert (got[nq:] == 0xAB).all(), "wrote past the scratch"
    with pytest.raises(KernelError, match="multiple of 32"):
        record_swiglu_q8_1(seq, G, U, D, Q, 1, 40)
    with pytest.raises(KernelError, match="overlaps"):
        record_swiglu_q8_1(seq, G, U, D, G, rows, cols)


def test_rms_norm_q8_1_refusals(seq, bufs):
    X, W, D, Q = bufs(96), bufs(96), bufs(96), bufs(256)
    with pytest.raises(KernelError, match="multiple of 32"):
        record_rms_norm(seq, X, D, 1, 40, 1e-5, W, xq=Q)
    with pytest.raises(KernelError, match="needs the weight"):
        record_rms_norm(seq, X, D, 1, 64, 1e-5, None, xq=Q)
    with pytest.raises(KernelError, match="scratch has"):
        record_rms_norm(seq, X, D, 3, 32, 1e-5, W, xq=View(Q, 0, 64))
    with pytest.raises(KernelError, match="overlaps dst"):
        record_rms_norm(seq, X, D, 1, 32, 1e-5, W, xq=D)
    assert seq.dispatches == 0


# -- softmax --------------------------------------------------------------------------------

def _softmax_ref(x, scale, mask):
    v = x.astype(np.float64) * np.float32(scale)
    if mask is not None:
        v = v + mask
    m = v.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(v - m)
        out = e / e.sum(axis=1, keepdims=True)
    return np.nan_to_num(out, nan=0.0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("rows,cols,mask_rows", [(6, 1000, 3), (4, 13, 1), (2, 300, 2)])
def test_softmax(seq, bufs, rng, masked, rows, cols, mask_rows):
    x = (rng.standard_normal((rows, cols)) * 5 + 40).astype(np.float32)  # large: needs the max
    mask = rng.standard_normal((mask_rows, cols)).astype(np.float32)
    mask[:, ::3] = -np.inf  # masked out
    scale = 0.7
    X, M, D = bufs(x.size), bufs(mask.size), bufs(x.size)
    put(X, x)
    put(M, mask)
    poison(D)
    record_softmax(seq, X, D, rows, cols, scale=scale, mask=M if masked else None, mask_rows=mask_rows)
    run(seq)
    full = np.tile(mask.astype(np.float64), (rows // mask_rows, 1)) if masked else None
    ref = _softmax_ref(x, scale, full)
    got = get(D, x.size).reshape(rows, cols)
    assert_close(got, ref, 1e-5, 1e-7, "softmax")
    if masked:
        assert (got[:, ::3] == 0).all()


def test_softmax_in_place_causal_and_empty_rows(seq, bufs, rng):
    rows, cols = 5, 37
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    mask = np.triu(np.full((rows, cols), -np.inf, np.float32), k=cols - rows + 1)
    mask[3] = -np.inf  # a row with nothing visible gives zeros
    X, M = bufs(x.size), bufs(mask.size)
    put(X, x)
    put(M, mask)
    record_softmax(seq, X, X, rows, cols, mask=M, mask_rows=rows)
    run(seq)
    got = get(X, x.size).reshape(rows, cols)
    ref = _softmax_ref(x, 1.0, mask.astype(np.float64))
    ref[3] = 0
    assert_close(got, ref, 1e-5, 1e-7, "softmax causal in place")
    assert (got[3] == 0).all()


# -- rope -----------------------------------------------------------------------------------

def _rope_ref(x, pos, n_dims, mode, base, fscale, ff=None):
    """x [T, H, D] float64; ggml rope (ext_factor 0) from its definition; ``ff``: ggml's
    freq_factors (each pair's angle divided by its factor)."""
    out = x.copy()
    i = np.arange(n_dims // 2)
    theta = pos[:, None].astype(np.float64) * fscale * base ** (-2.0 * i / n_dims)  # [T, n_dims/2]
    if ff is not None:
        theta = theta / np.asarray(ff, np.float64)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if mode == "normal":
        i0, i1 = 2 * i, 2 * i + 1
    else:
        i0, i1 = i, i + n_dims // 2
    x0, x1 = x[:, :, i0], x[:, :, i1]
    out[:, :, i0] = x0 * c - x1 * s
    out[:, :, i1] = x0 * s + x1 * c
    return out, np.abs(theta).max()


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_tokens,n_heads,head_dim,n_dims,base,fscale", [
    (7, 3, 64, 64, 10000.0, 1.0),
    (5, 2, 128, 96, 500000.0, 0.25),
    (3, 4, 40, 16, 10000.0, 1.0),
])
@pytest.mark.parametrize("factors", [False, True])
def test_rope(seq, bufs, rng, mode, n_tokens, n_heads, head_dim, n_dims, base, fscale, factors):
    """With ``factors``: per-pair frequency factors (llama 3.x's rope_freqs.weight, ggml's
    freq_factors) in [0.5, 8], against the reference that divides each angle by its factor,
    and far from the unscaled rotation."""
    # a view of a fused QKV row: token stride covers q, k and v heads
    tstride = 3 * n_heads * head_dim
    x = rng.standard_normal((n_tokens, tstride)).astype(np.float32)
    pos = rng.integers(0, 600, n_tokens).astype(np.int32)
    pos[0] = 0
    off = n_heads * head_dim  # the "k" part
    X, P, D = bufs(x.size), bufs(n_tokens + 3, np.int32), bufs(n_tokens * n_heads * head_dim)
    put(X, x)
    put(P, np.concatenate([np.full(3, 77, np.int32), pos]))
    poison(D)
    ff = F = None
    if factors:
        ff = rng.uniform(0.5, 8.0, n_dims // 2).astype(np.float32)
        F = bufs(n_dims // 2)
        put(F, ff)
    record_rope(seq, X, P, D, n_tokens, n_heads, head_dim, n_dims=n_dims, mode=mode, freq_base=base,
                freq_scale=fscale, pos_offset=3, src_offset=off, src_token_stride=tstride, freq_factors=F)
    run(seq)
    xin = x[:, off:off + n_heads * head_dim].reshape(n_tokens, n_heads, head_dim).astype(np.float64)
    ref, tmax = _rope_ref(xin, pos, n_dims, mode, base, fscale, ff)
    got = get(D, n_tokens * n_heads * head_dim).reshape(n_tokens, n_heads, head_dim)
    bound = (2e-6 + 4 * tmax * 2.0 ** -24) * np.abs(xin).max()
    assert_close(got, ref, 0.0, bound, f"rope {mode}")
    if factors:  # the factors matter: the unscaled rotation is far outside the bound
        plain, _ = _rope_ref(xin, pos, n_dims, mode, base, fscale)
        assert np.abs(got - plain).max() > 100 * bound
    np.testing.assert_array_equal(got[:, :, n_dims:], xin[:, :, n_dims:].astype(np.float32))


def test_rope_in_place(seq, bufs, rng):
    T, H, Dh = 4, 2, 64
    x = rng.standard_normal((T, H, Dh)).astype(np.float32)
    pos = np.array([5, 6, 7, 8], np.int32)
    X, P = bufs(x.size), bufs(T, np.int32)
    put(X, x)
    put(P, pos)
    record_rope(seq, X, P, X, T, H, Dh, n_dims=32, mode="neox")
    run(seq)
    ref, tmax = _rope_ref(x.astype(np.float64), pos, 32, "neox", 10000.0, 1.0)
    assert_close(get(X, x.size).reshape(T, H, Dh), ref, 0.0, 1e-5, "rope in place")


# -- argmax ---------------------------------------------------------------------------------

@pytest.mark.parametrize("per_row", [False, True])
def test_argmax(seq, bufs, rng, per_row):
    """7 rows in one dispatch (the narrow workgroup), or each row alone (a decode step's one
    row: the wide workgroup)."""
    rows, cols = 7, 50001
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[1, [1041, 4000, 49999, 530]] = 9.0   # ties: lowest index (1041: a later load of a lower invocation)
    x[2, :] = -np.inf                      # -inf never wins, and is allowed
    x[2, [300, 301]] = -1.0
    x[3, :] = np.nan                       # any NaN or +inf: NONFINITE (-1), not an id
    x[4, :] = 1.0                          # all equal -> 0
    x[5, 5:] = np.nan
    x[6, 49000] = np.inf
    X, D = bufs(x.size + 10), bufs(rows + 1, np.int32)
    put(X, np.concatenate([np.zeros(10, np.float32), x.reshape(-1)]))
    D.numpy(np.int32)[:] = -7
    if per_row:
        for r in range(rows):
            record_argmax(seq, X, D, 1, cols, src_offset=10 + r * cols, dst_offset=1 + r)
    else:
        record_argmax(seq, X, D, rows, cols, src_offset=10, dst_offset=1)
    run(seq)
    got = get(D, rows + 1, np.int32)
    ref = [int(np.argmax(x[0])), 530, 300, NONFINITE, 0, NONFINITE, NONFINITE]
    assert got[0] == -7
    assert list(got[1:]) == ref


def test_argmax_tail(seq, bufs, rng):
    rows, cols = 3, 3
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    X, D = bufs(x.size), bufs(rows, np.int32)
    put(X, x)
    record_argmax(seq, X, D, rows, cols)
    run(seq)
    assert list(get(D, rows, np.int32)) == list(np.argmax(x, axis=1))


# -- validation -----------------------------------------------------------------------------

def test_validation_errors(seq, bufs):
    A, B = bufs(100), bufs(100)
    with pytest.raises(KernelError, match=r"add: dtype 'f16' with shape \[2, 10\]"):
        record_add(seq, A, B, A, 2, 10, dtype="f16")
    with pytest.raises(KernelError, match=r"add_f32: a .*needs 404 bytes"):
        record_add(seq, A, B, B, 1, 101)
    with pytest.raises(KernelError, match="does not divide"):
        record_add(seq, A, B, A, 4, 10, b_rows=3)
    with pytest.raises(KernelError, match="partly overlaps"):
        record_silu(seq, A, A, 2, 10, dst_offset=1)
    with pytest.raises(KernelError, match="row stride is shorter"):
        record_scale(seq, A, B, 3, 10, 2.0, src_stride=5)
    with pytest.raises(KernelError, match="rope_neox_f32: n_dims = 7"):
        record_rope(seq, A, B, A, 1, 1, 8, n_dims=7, mode="neox")
    with pytest.raises(KernelError, match="mode 'yarn'"):
        record_rope(seq, A, B, A, 1, 1, 8, mode="yarn")
    with pytest.raises(KernelError, match="rope_f32: freq_factors"):  # 63 floats for 64 pairs
        record_rope(seq, bufs(128), B, bufs(128), 1, 1, 128, freq_factors=bufs(63))
    with pytest.raises(KernelError, match="rms_norm_mul: dtype 'bf16'"):
        record_rms_norm(seq, A, B, 1, 10, 1e-5, A, dtype="bf16")
    with pytest.raises(KernelError, match="softmax_mask_f32: mask_rows"):
        record_softmax(seq, A, B, 2, 10, mask=A, mask_rows=0)
    with pytest.raises(KernelError, match="argmax_f32: rows of length 0"):
        record_argmax(seq, A, B, 2, 0)
    assert seq.dispatches == 0
