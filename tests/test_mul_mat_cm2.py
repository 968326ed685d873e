"""mul_mat_cm2 (GL_NV_cooperative_matrix2, shaders/mul_mat_cm2.comp): every tiling and weight
type against float64 numpy with weights from gguf's quantize / random valid blocks (as
test_mul_mat), outputs poisoned with NaN. The kernels need VK_NV_cooperative_matrix2, so these
run on the H200 (tools/device_run.sh kernels) and skip on lavapipe; what runs everywhere: the
f16 conversion of x's rows, the selection rules, the device checks and the struct layouts the
extension is queried and enabled with."""

from __future__ import annotations

import ctypes
import types

import kernels as tk  # tools/kernels.py: the sweep tilings and the decode checks
import numpy as np
import pytest
from test_mul_mat import (
    ALL,
    abs_terms,
    check,
    coop_bound,
    make_weights,
    nan_y,
    run_mm,
    strided_x,
    target_cols,
    test_k,
)
from test_mul_mat import bufs as bufs  # noqa: F401  (fixture)

from vkxsplit.errors import KernelError
from vkxsplit.ops import choose
from vkxsplit.ops import convert as cv
from vkxsplit.ops import mul_mat as mm
from vkxsplit.ops.choose import kernels_for
from vkxsplit.ops.quant import block_size
from vkxsplit.vk import instance as vki
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.kernel import Kernel

CM2_NAMES = sorted(tk.CM2_VARIANTS)  # (the shipped tilings and the sweep's)


def _skip(device, name: str | None = None) -> None:
    if not kernels_for(device).coopmat2:
        pytest.skip(f"'{device.name}' has no usable VK_NV_cooperative_matrix2")
    if name is not None and not kernels_for(device).cm2_tile_supported(tk.CM2_VARIANTS[name][1]):
        pytest.skip(f"'{device.name}' has no workgroup-scope shape for {name}")


def _type_of(name: str) -> str:
    return name.removeprefix("mul_mat_cm2_").split("_f32")[0]


def _k_for(t: str) -> int:
    # a last K step shorter than BK (clamped loads): floats 100 (not even a multiple of 8),
    # 32-blocks 96, K-quants 3 blocks (BK divides 256: blocks span steps)
    return {1: 100, 32: 96, 256: 768}[block_size(t)]


@pytest.mark.parametrize("name", CM2_NAMES)
def test_cm2_tiling(device, bufs, rng, name, tool_kernels):  # noqa: F811
    """Interior tiles (unclamped loads) and tiles crossing N and M (clamped loads, dropped
    stores), K with a partial last step."""
    _skip(device, name)
    tool_kernels(name)
    t, tile = tk.CM2_VARIANTS[name]
    assert t == _type_of(name) and mm.coop_tile(name) == tile
    N, K = 2 * tile.bw + 24, _k_for(t)
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    for M in (9, 2 * tile.bx):
        x = rng.standard_normal((M, K))
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "coopmat", coop_variant=name, k_split=0)
        assert took == "coopmat"
        check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))



@pytest.mark.parametrize("t", ALL)
def test_cm2_default_path(device, bufs, rng, t, monkeypatch):  # noqa: F811
    """Without a pinned variant the coopmat path takes mul_mat_cm2 for CM2_TYPES (x converted
    once), split as the device's cm2 choice says, and mul_mat_coopmat for the others; a device with
    ``coopmat2`` switched off (VKXSPLIT_DISABLE=coopmat2) goes back to mul_mat_coopmat."""
    _skip(device)
    N, K = 300, test_k(t) * (4 if block_size(t) != 256 else 2)
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    converts, passes = [], []
    real, real_dq = mm.record_convert_rows, mm.record_dequant_rows
    monkeypatch.setattr(mm, "record_convert_rows", lambda *a, **k: converts.append(a[3:5]) or real(*a, **k))
    monkeypatch.setattr(mm, "record_dequant_rows", lambda *a, **k: passes.append(a[4:6]) or real_dq(*a, **k))
    for M in (9, 130):
        x = rng.standard_normal((M, K))
        n = len(passes)
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, None)
        assert took == "coopmat" and converts[-1] == (M, K)  # every type takes mul_mat_cm2
        dq = kernels_for(device).matmat(t, M, N, K).dq16
        assert len(passes) == n + dq and (not dq or passes[-1] == (N, K))
        check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))
    monkeypatch.setattr(device, "disabled", frozenset({"coopmat2"}))
    converts.clear()
    n = len(converts)
    y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * N, None)
    assert took == "coopmat" and len(converts) == n
    check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("t", ["f32", "f16", "bf16", "q4_0", "q5_1", "q8_0", "q4_k", "q6_k",
                               "q2_k", "q3_k", "iq4_nl", "iq4_xs"])
def test_cm2_row_range_strides_and_split(device, bufs, rng, t):  # noqa: F811
    """Rows [r0, r0 + n) of W into y columns [c0, c0 + n); x with a row stride and offset
    (converted to compact f16 rows first); y with a wider stride and an offset; nothing
    outside the target region written; unsplit and split K (partials reduced) agree with the
    float64 reference."""
    _skip(device)
    name = mm.cm2_variant_name(t)
    tile = mm.coop_tile(name)
    bs = block_size(t)
    K = 3 * 256 + (256 if bs == 256 else 96)
    n_total, r0, n = tile.bw + 80, 12, tile.bw + 20
    M = tile.bx + 5
    raw, W = make_weights(rng, t, n_total, K)
    wb = bufs.new(raw.nbytes, raw)
    xs, xo, ys, yo, c0 = K + 3, 5, n_total + 2, 3, r0 + 1
    x = rng.standard_normal((M, K))
    xb = strided_x(bufs, x, xs, xo)
    ref = x @ W[r0:r0 + n].T
    bound = coop_bound(x, abs_terms(raw, t, W)[r0:r0 + n])
    for split in (0, tile.bk, 4 * tile.bk):
        yb, y = nan_y(bufs, yo + M * ys)
        seq = Sequence(device, "mm")
        try:
            mm.record_mul_mat(seq, wb, t, xb, yb, M, n, K, x_stride=xs, y_stride=ys, x_offset=xo, y_offset=yo,
                              w_row_offset=r0, y_col_offset=c0, path="coopmat", coop_variant=name, k_split=split)
            assert seq.dispatches == (3 if split else 2)  # convert, product (, reduce)
            seq.run()
        finally:
            seq.close()
        check(target_cols(y, M, n, yo, ys, c0), ref, bound)


@pytest.mark.parametrize("t", ["f16", "q4_0", "q8_0", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs"])
def test_cm2_fast_path_and_fallback(device, bufs, rng, t):  # noqa: F811
    """Interior tiles with K = 1024: unsplit (the aligned fast path over four 256-element runs),
    split into 256-element ranges (fast path per range) and into 192-element ranges (not whole
    runs: every range falls back to the general interior loop); all against float64."""
    _skip(device)
    name = mm.cm2_variant_name(t)
    tile = mm.coop_tile(name)
    N, M, K = 2 * tile.bw, 2 * tile.bx, 1024
    raw, W = make_weights(rng, t, N, K)
    wb = bufs.new(raw.nbytes, raw)
    x = rng.standard_normal((M, K))
    for split in (0, 256, 192):
        y, _ = run_mm(device, bufs, wb, t, x, M, N, K, M * N, "coopmat", coop_variant=name, k_split=split)
        check(y.reshape(M, N), x @ W.T, coop_bound(x, abs_terms(raw, t, W)))


@pytest.mark.parametrize("t", [t for t in ALL if t != "f16"])
def test_cm2_decode_matches_gguf(device, bufs, rng, t, tool_kernels):  # noqa: F811
    """The decode functions mul_mat_cm2 gives the driver (shaders/cm2_dq_body.glsl), run element
    by element from an ordinary binding (cm2_decode_check_<type>), against gguf's dequantize of
    the same blocks (random valid blocks, and gguf's quantize where it supports the type): each
    element within the f16 rounding of the float64 value (bound 2^-10 |w| + 2^-24, plus f32
    rounding of the terms for types with a min); every element written."""
    missing = [f for f in ("shaderFloat16", "shaderInt8") if not device.features.get(f)]
    if missing:
        pytest.skip(f"'{device.name}' lacks {', '.join(missing)}")
    tool_kernels(f"cm2_decode_check_{t}")
    n_blocks = 64
    k = n_blocks * block_size(t)
    for raw, W in (make_weights(rng, t, 1, k, random_bits=True), make_weights(rng, t, 1, k)):
        wb = bufs.new(raw.nbytes, raw)
        ob = bufs.new(2 * k)
        out = ob.numpy(np.uint16, (k,))
        out[:] = 0x7E00  # f16 NaN: an element not written fails
        seq = Sequence(device, "dq")
        try:
            seq.dispatch(Kernel.get(device, f"cm2_decode_check_{t}"), [wb, ob], (k,), (-(-k // 64), 1, 1))
            seq.run()
        finally:
            seq.close()
        got = out.view(np.float16).astype(np.float64)
        ref = W.ravel()
        assert np.isfinite(ref).all() and np.isfinite(got).all()  # (NaN: an element not written)
        err = np.abs(got - ref)
        # (plus f32 rounding of the terms where d sc q - dmin m cancels: abs_terms)
        bound = 2.0 ** -10 * np.abs(ref) + 2.0 ** -22 * abs_terms(raw, t, W).ravel() + 2.0 ** -24
        bad = ~(err <= bound)
        assert not bad.any(), f"{bad.sum()} of {k} elements off; first at {np.argmax(bad)}: {got[bad][:4]} vs {ref[bad][:4]}"


def test_convert_rows(device, bufs, rng):  # noqa: F811
    """convert_rows_f32_f16: strided f32 rows to compact f16 rows, rounded as numpy's float16
    (round to nearest even; overflow to inf, subnormals kept); padding never read."""
    rows, n, stride, off = 7, 1000, 1013, 9
    x = (rng.standard_normal((rows, n)) * np.logspace(-9, 5, n)).astype(np.float32)
    x[0, :4] = [65520.0, -1e-8, 6.1e-5, np.inf]
    src = strided_x(bufs, x, stride, off)
    dst = bufs.new(2 * (rows * n + 16))
    out = dst.numpy(np.uint16, (rows * n + 16,))
    out[:] = 0xFFFF
    seq = Sequence(device, "cv")
    try:
        cv.record_convert_rows(seq, src, dst, rows, n, stride, off, 16)
        seq.run()
    finally:
        seq.close()
    assert (out[:16] == 0xFFFF).all()
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as it should
        ref = x.astype(np.float16).view(np.uint16).ravel()
    np.testing.assert_array_equal(out[16:], ref)
    with pytest.raises(KernelError, match="do not fit"):
        cv.record_convert_rows(Sequence(device, "bad"), src, dst, rows + 1, n, stride, off)


def test_convert_rows_in_chunks(device, bufs, rng, monkeypatch):  # noqa: F811
    """More rows than one dispatch's grid takes (65535) go in several dispatches, each with its
    rows' offsets (MAX_ROWS lowered to 3 to see it with 8 rows)."""
    monkeypatch.setattr(cv, "MAX_ROWS", 3)
    rows, n, stride, off = 8, 300, 307, 2
    x = rng.standard_normal((rows, n)).astype(np.float32)
    src = strided_x(bufs, x, stride, off)
    dst = bufs.new(2 * rows * n)
    seq = Sequence(device, "cv")
    try:
        cv.record_convert_rows(seq, src, dst, rows, n, stride, off)
        assert seq.dispatches == 3
        seq.run()
    finally:
        seq.close()
    np.testing.assert_array_equal(dst.numpy(np.uint16, (rows * n,)), x.astype(np.float16).view(np.uint16).ravel())


def _fake(flex: list[tuple[int, ...]], cm2: bool = True, disabled=()):
    feats = {f: True for f in mm._CM2_REQUIRES}
    phys = types.SimpleNamespace(coopmat2_flex=[
        vki.CoopMatFlex(*g, 0, 0, 1, 1, False, 2, n) for (*g, n) in flex])
    return types.SimpleNamespace(features=feats, physical=phys, coopmat2=cm2, name="fake", disabled=frozenset(disabled))


def test_cm2_device_checks():
    """coopmat2_supported: the extension enabled with every feature the kernel needs, and an
    f16 x f16 -> f32 workgroup-scope flexible shape of the default tiling's workgroup size
    whose granularities divide it; cm2_tile_supported per tiling; coopmat2_available: not
    with ``coopmat2`` or ``coopmat`` switched off."""
    ok = kernels_for(_fake([(16, 16, 16, 256), (16, 16, 16, 128)]))
    assert ok.coopmat2 and ok.coopmat2_available
    assert all(ok.cm2_tile_supported(tile) for tile in tk.CM2_ALL_TILES.values())
    assert not kernels_for(_fake([(16, 16, 16, 256)], cm2=False)).coopmat2
    assert not kernels_for(_fake([(16, 16, 16, 512)])).coopmat2    # no 256-invocation shape
    assert not kernels_for(_fake([(48, 16, 16, 256)])).coopmat2    # granularity not dividing
    only256 = kernels_for(_fake([(16, 16, 16, 256)]))
    assert not only256.cm2_tile_supported(tk.CM2_ALL_TILES["w64x64_k64_n128"])
    lacking = _fake([(16, 16, 16, 256)])
    del lacking.features["cooperativeMatrixBlockLoads"]
    assert not kernels_for(lacking).coopmat2
    for off in ({"coopmat2"}, {"coopmat"}):
        kc = kernels_for(_fake([(16, 16, 16, 256)], disabled=off))
        assert kc.coopmat2 and not kc.coopmat2_available
        assert not kc.dq16_available("q4_0")  # (dq16 runs mul_mat_cm2's F16 kernel)
    assert ok.dq16_available("q4_0") and not kernels_for(_fake([(16, 16, 16, 256)], disabled={"dq16"})).dq16_available("q4_0")


def test_cm2_eligible(monkeypatch):
    """mul_mat_cm2 runs for CM2_TYPES (all), where the kernel is available, and on weights in a
    block made for device addresses (plain device memory on a coopmat2 device); weights in an
    exported or imported block (an arena shared with a backend) keep mul_mat_coopmat. This
    machine's own buffers are never such blocks (lavapipe has no coopmat2)."""
    from vkxsplit.vk.kernel import View

    kc = kernels_for(_fake([(16, 16, 16, 256)]))
    plain = types.SimpleNamespace(block=types.SimpleNamespace(device_address=True), size=4096)
    shared = types.SimpleNamespace(block=types.SimpleNamespace(device_address=False), size=4096)
    assert kc.cm2_eligible("q4_0", plain) and kc.cm2_eligible("f16", View(plain, 256))
    assert not kc.cm2_eligible("q4_0", shared) and not kc.cm2_eligible("q4_0", View(shared, 256))
    assert kc.cm2_eligible("q4_k", plain) and kc.cm2_eligible("q5_k", plain)  # every type
    # the shared weights keep mul_mat_coopmat; dequantized first, their f16 rows take mul_mat_cm2
    assert kc.matmat("q4_0", 512, 4096, 4096, addressable=False, dq16=False).variant.startswith("mul_mat_coopmat_")
    assert kc.matmat("q4_0", 512, 4096, 4096, addressable=False, dq16=True).variant.startswith("mul_mat_cm2_f16_")
    assert not kernels_for(_fake([(16, 16, 16, 256)], disabled={"coopmat2"})).cm2_eligible("q4_0", plain)


def test_device_buffers_here_have_no_device_addresses(device):
    """Only a coopmat2 device creates blocks for device addresses (bufferDeviceAddress is
    enabled with the extension, never otherwise)."""
    b = device.memory.alloc(1024, "device", "t")
    try:
        assert b.block.device_address == bool(device.coopmat2)
        assert device.features.get("bufferDeviceAddress", False) == bool(device.coopmat2)
    finally:
        b.close()


@pytest.mark.parametrize("t", ["q4_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs"])
def test_cm2_dq16(device, bufs, rng, t, monkeypatch):  # noqa: F811
    """The dequantize-first path (dq16=True): W's rows w_row0.. decoded to f16 rows, then
    mul_mat_cm2's F16 kernel, unsplit and split, into y columns at an offset, against float64;
    a device with ``dq16`` switched off (VKXSPLIT_DISABLE=dq16) never takes it by itself."""
    _skip(device)
    N, K, row0 = 260, 4 * test_k(t) if block_size(t) != 256 else 1024, 5
    raw, W = make_weights(rng, t, N + row0, K)
    wb = bufs.new(raw.nbytes, raw)
    passes = []
    real = mm.record_dequant_rows
    monkeypatch.setattr(mm, "record_dequant_rows", lambda *a, **k: passes.append(a[4:6]) or real(*a, **k))
    M = 137
    x = rng.standard_normal((M, K))
    ref = x @ W[row0:].T
    for ks in (0, 256):
        y, took = run_mm(device, bufs, wb, t, x, M, N, K, M * (N + 3), "coopmat", dq16=True, k_split=ks,
                         w_row_offset=row0, y_col_offset=3)
        assert took == "coopmat" and passes[-1] == (N, K)
        check(y.reshape(M, N + 3)[:, 3:], ref, coop_bound(x, abs_terms(raw[row0:], t, W[row0:])))
    monkeypatch.setattr(device, "disabled", frozenset({"dq16"}))
    n = len(passes)
    y, _ = run_mm(device, bufs, wb, t, rng.standard_normal((512, K)), 512, N, K, 512 * (N + row0), "coopmat")
    assert len(passes) == n


def test_dq16_choice(device, monkeypatch):
    """The dq16 model (DeviceKernels.dq16): never for small batches of the cheap-to-decode types, for large ones where
    the model says the f16 rate pays for the pass; dq16 only where it can run (raises on a
    device without coopmat2, such as lavapipe); the kill switch; splitk switched off models
    both sides unsplit."""
    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)  # (no device: the process's setting)
    h = kernels_for(None)  # the cost model alone (the H200's compute units)
    for t in choose.DQ16_DIRECT_COST:
        picks = [h.dq16(t, M, 4096, 4096) for M in (16, 128, 512, 4096)]
        assert picks == sorted(picks), (t, picks)  # once it pays, it pays for every larger M
    assert not h.dq16("f16", 4096, 4096, 4096) and not h.dq16("q4_0", 16, 4096, 4096)
    assert h.dq16("q4_0", 8192, 4096, 4096)
    # the H200 sweep: the tile loader at M = 128, dq16 at M = 512 for every llama8b shape
    for t in ("q4_0", "q4_k", "q6_k"):
        for N, K in ((4096, 4096), (14336, 4096), (4096, 14336)):
            assert not h.dq16(t, 128, N, K) and h.dq16(t, 512, N, K), (t, N, K)
    # no f16 copy over DQ16_MAX_BYTES (an all-logits output projection of a 128k vocabulary)
    assert not h.dq16("q6_k", 4096, 128256, 4096) and 2 * 128256 * 4096 > choose.DQ16_MAX_BYTES
    if not kernels_for(device).coopmat2_available:
        assert not kernels_for(device).dq16_available("q4_0")
        wb = device.memory.alloc(18 * 64, "host", name="w")
        xb = device.memory.alloc(4 * 16 * 32, "host", name="x")
        yb = device.memory.alloc(4 * 16 * 64, "host", name="y")
        seq = Sequence(device, "dq16")
        try:
            with pytest.raises(KernelError, match="dq16"):
                mm.record_mul_mat(seq, wb, "q4_0", xb, yb, 16, 64, 32, path="coopmat", dq16=True)
        finally:
            seq.close()
            for b in (wb, xb, yb):
                b.close()
    assert not kernels_for(types.SimpleNamespace(disabled=frozenset({"dq16"}))).dq16_available("q4_0")
    nosplit = kernels_for(types.SimpleNamespace(disabled=frozenset({"splitk"})))
    for t in choose.DQ16_DIRECT_COST:
        picks = [nosplit.dq16(t, M, 4096, 4096) for M in (16, 128, 512, 4096)]
        assert picks == sorted(picks) and picks[-1], (t, picks)


def test_dq16_needs_the_coopmat_path(device, bufs, monkeypatch):  # noqa: F811
    """dq16=True for a product that resolves to another path (M <= 8: vec) raises, also where
    the device could run dq16."""
    monkeypatch.setattr(choose.DeviceKernels, "dq16_available", lambda self, t: True)
    wb, xb, yb = bufs.new(18 * 64), bufs.new(4 * 4 * 32), bufs.new(4 * 4 * 64)
    seq = Sequence(device, "dq16")
    try:
        with pytest.raises(KernelError, match="dq16 needs the coopmat path"):
            mm.record_mul_mat(seq, wb, "q4_0", xb, yb, 4, 64, 32, dq16=True)
        assert seq.dispatches == 0
    finally:
        seq.close()


def test_scratch_grows_to_the_exact_size_when_doubling_does_not_fit(monkeypatch):
    """_Scratch.get doubles a buffer that is too small; where the doubled size does not fit
    the device's memory it takes the size asked for, and raises only when that fails too."""
    from vkxsplit.errors import OutOfDeviceMemory

    made = []

    class Mem:
        def alloc(self, nbytes, kind, name):
            if nbytes > 7 << 18:  # 1.75 MiB of device memory
                raise OutOfDeviceMemory("vkAllocateMemory", -2)
            made.append(nbytes)
            return types.SimpleNamespace(size=nbytes, close=lambda: None)

    dev = types.SimpleNamespace(memory=Mem(), adopt=lambda obj: None)
    assert mm._Scratch.get(dev, "wh", 1 << 20).size == 1 << 20
    # 1.5 MiB: doubling to 2 MiB does not fit, 1.5 does
    assert mm._Scratch.get(dev, "wh", 3 << 19).size == 3 << 19 and made == [1 << 20, 3 << 19]
    assert mm._Scratch.get(dev, "wh", 1 << 20).size == 3 << 19 and len(made) == 2  # reused
    with pytest.raises(OutOfDeviceMemory):
        mm._Scratch.get(dev, "wh", 2 << 20)


def test_dq16_out_of_memory_falls_back(monkeypatch, caplog):
    """No device memory for dq16's f16 rows: the model's choice falls back to the tile loader
    (None, said once per device); a forced dq16 raises OutOfDeviceMemory."""
    from vkxsplit.errors import OutOfDeviceMemory

    def full(dev, kind, nbytes):
        raise OutOfDeviceMemory("vkAllocateMemory", -2)  # VK_ERROR_OUT_OF_DEVICE_MEMORY

    monkeypatch.setattr(mm._Scratch, "get", staticmethod(full))
    dev = types.SimpleNamespace()
    with caplog.at_level("WARNING", logger="vkxsplit.mul_mat"):
        assert mm._dq16_rows(dev, "mul_mat[Q4_K]", 1 << 30, forced=False) is None
        assert mm._dq16_rows(dev, "mul_mat[Q4_K]", 1 << 30, forced=False) is None
    assert sum("dequantize-first" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(OutOfDeviceMemory):
        mm._dq16_rows(dev, "mul_mat[Q4_K]", 1 << 30, forced=True)


def test_cm2_choose(monkeypatch):
    """DeviceKernels.cm2: a tiling of CM2_CHOICES (a shipped variant) and the split with the least
    modelled time; no split on a device with ``splitk`` switched off; splits in whole BK
    steps below K."""
    monkeypatch.delenv("VKXSPLIT_DISABLE", raising=False)  # (no device: the process's setting)
    h = kernels_for(None)  # the cost model alone (the H200's 132 compute units)
    names = {v.name for v in mm.VARIANTS}
    for t in ALL:
        for M, N, K in ((512, 4096, 4096), (128, 1024, 4096), (512, 14336, 4096), (512, 4096, 14336)):
            name, ks = h.cm2(t, M, N, K)
            assert name in names and name.startswith(f"mul_mat_cm2_{t}_f32_")
            assert ks == 0 or (ks % mm.coop_tile(name).bk == 0 and ks < K)
    # M = 128, N = 1024: 8 x 1 tiles of 128 x 128 for a wave of cm2_wave: splitting K is cheaper
    assert h.cm2("f16", 128, 1024, 4096)[1] > 0
    # where K % 256 == 0 every split range is whole 256-element runs (the kernel's fast path),
    # also for K = 11008 (43 runs) and 4864 (19), which BK-sized rounding would cut elsewhere
    for t in ALL:
        for M, N, K in ((128, 4096, 11008), (128, 896, 4864), (256, 1024, 4096), (512, 1024, 14336)):
            name, ks = h.cm2(t, M, N, K)
            assert ks % 256 == 0, (t, M, N, K, name, ks)
            assert h.cm2_k_split(t, mm.coop_tile(name).name, M, N, K) == ks
            assert h.cm2_k_split(t, mm.coop_tile(name), M, N, K) == ks
    # what the H200 measured (tools/bench_coopmat.py --cm2, M = 256, 4096x4096): the 64 x 256
    # tile loader split in two for the K-quants, ahead of dq16; the 64 x 128 one for Q8_0 at
    # M = 512 14336x4096 loses to dq16
    for t in ("q4_k", "q6_k"):
        name, ks = h.cm2(t, 256, 4096, 4096)
        assert name == mm.cm2_variant_name(t, "w64x256_k64_n256") and ks == 2048, (t, name, ks)
        assert not h.dq16(t, 256, 4096, 4096)
    assert h.dq16("q8_0", 512, 14336, 4096)
    nosplit = kernels_for(types.SimpleNamespace(disabled=frozenset({"splitk"})))
    assert nosplit.cm2("f16", 128, 1024, 4096)[1] == 0
    assert nosplit.cm2_k_split("f16", mm.CM2_DEFAULT, 128, 1024, 4096) == 0
    # a sweep tiling (tools/kernels.py) has a split too
    assert h.cm2_k_split("f16", tk.CM2_SWEEP_TILES["w128x128_k32_n256"], 128, 1024, 4096) > 0


def test_cm2_variants():
    """Every type ships the tilings DeviceKernels.cm2 weighs for it (and nothing else), the sweep
    types have every tiling (tools/kernels.py); tilings are multiples of 16 (the flexible
    granularity NVIDIA reports) and the kernels need what Device enables."""
    names = {v.name: v for v in mm.VARIANTS}
    for t in ALL:
        assert mm.cm2_variant_name(t) in names
        assert {mm.cm2_variant_name(t, k) for k in mm.CM2_CHOICES[t]} == {
            n for n in names if n.startswith(f"mul_mat_cm2_{t}_f32_")}
    declared = tk.all_declared()
    for t in tk.CM2_SWEEP_TYPES:
        for key in tk.CM2_ALL_TILES:
            assert mm.cm2_variant_name(t, key) in declared
    for tile in tk.CM2_ALL_TILES.values():
        assert tile.bw % 16 == 0 and tile.bx % 16 == 0 and tile.bk % 16 == 0
    v = names[mm.cm2_variant_name("q4_k")]
    assert v.compiler == "glslang15" and v.target_env == "vulkan1.3"
    assert {"cooperativeMatrixWorkgroupScope", "bufferDeviceAddress"} <= set(v.requires)


def test_cm2_tilings_share_one_module_per_type():
    """mul_mat_cm2's tilings are specialization constants (they size the workgroup-scope
    matrices): a type's shipped tilings name one module with different spec values, the module
    declares the constants the Python table names, a sweep tiling names the shipped module
    (it compiles nothing), and sizes the kernel cannot take are refused when the variant is
    made. (Each tiling against float64: test_cm2_tiling, on a coopmat2 device.)"""
    from vkxsplit import shaders
    from vkxsplit.ops import mul_mat_kernels as mk

    shipped = shaders.shipped()
    for t in ALL:
        metas = [shipped[mm.cm2_variant_name(t, k)] for k in mm.CM2_CHOICES[t]]
        assert {m["module"] for m in metas} == {mk.cm2_module_name(t)}
        assert len({tuple(sorted(m["spec"].items())) for m in metas}) == len(metas)
        for k, m in zip(mm.CM2_CHOICES[t], metas):
            assert m["spec"]["NT"] == mm.CM2_TILES[k].threads == m["local_size"][0]
            assert mm.coop_tile(mm.cm2_variant_name(t, k)) == mm.CM2_TILES[k]
    code = (shaders.SPV_DIR / f"{mk.cm2_module_name('q4_0')}.spv").read_bytes()
    assert set(shaders.spec_constants(code)) == set(mk.CM2_SPEC_IDS.values())
    sweep = mm.make_cm2_variant("q4_0", tk.CM2_SWEEP_TILES["w256x128_k64_n256"])
    assert sweep.module_name == mk.cm2_module_name("q4_0") and sweep.name not in shipped
    for bad in (mm.Cm2Tile(120, 128, 64), mm.Cm2Tile(128, 128, 48), mm.Cm2Tile(128, 8, 64)):
        with pytest.raises(KernelError, match="multiples of 16"):
            mm.make_cm2_variant("q4_0", bad)


def test_coopmat2_struct_layouts():
    """The VK_NV_cooperative_matrix2 structs declared in vkxsplit.vk.instance (newer than the
    `vulkan` package's headers) against the registry's C layout, rebuilt with ctypes."""
    class Hdr(ctypes.Structure):
        _fields_ = [("sType", ctypes.c_int32), ("pNext", ctypes.c_void_p)]

    def c_layout(fields):
        cls = type("S", (ctypes.Structure,), {"_fields_": [*Hdr._fields_, *fields]})
        return ctypes.sizeof(cls), {f: getattr(cls, f).offset for f, _ in fields}

    ffi = vki._bf16_ffi
    u32, i32 = ctypes.c_uint32, ctypes.c_int32
    for ctype, fields in (
        ("VkxCoopmat2Features", [(f, u32) for f in vki.COOPMAT2_FEATURES]),
        ("VkxCoopmat2Properties", [(f, u32) for f in vki.COOPMAT2_PROPERTIES]),
        ("VkxCoopFlexProperties", [("MGranularity", u32), ("NGranularity", u32), ("KGranularity", u32),
                                   ("AType", i32), ("BType", i32), ("CType", i32), ("ResultType", i32),
                                   ("saturatingAccumulation", u32), ("scope", i32),
                                   ("workgroupInvocations", u32)]),
    ):
        size, offs = c_layout(fields)
        assert ffi.sizeof(ctype) == size, ctype
        for f, o in offs.items():
            assert ffi.offsetof(ctype, f) == o, (ctype, f)
    # the registry's VkStructureType values (vk.xml, extension 594: offsets 0, 1, 2 in the
    # order the extension lists them: features, flexible-dimensions properties, properties)
    assert vki.STYPE_COOPMAT2_FEATURES == 1000593000
    assert vki.STYPE_COOPMAT_FLEX_PROPERTIES == 1000593001
    assert vki.STYPE_COOPMAT2_PROPERTIES == 1000593002


def test_lavapipe_has_no_coopmat2(device):
    """This machine's device either has the extension with its features or the kernels are
    refused with a message naming the missing feature, never a wrong answer."""
    if kernels_for(device).coopmat2:
        pytest.skip("this device has VK_NV_cooperative_matrix2")
    assert not device.coopmat2
    from vkxsplit.vk.kernel import Kernel
    with pytest.raises(KernelError, match="needs device feature"):
        Kernel.get(device, mm.cm2_variant_name("q4_0"))
