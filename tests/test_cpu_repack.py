"""The cpu backend's repacked weights (ggml-cpu's extra buffer types: AMX where the ggml build and
the CPU have it, CPU_REPACK; ``VKXSPLIT_DISABLE=cpu_repack`` / ``cpu_amx`` switch them off): each
type ggml repacks on this CPU, in each buffer type, decode (T=1) and prefill (T=8, 128) products
against float64 numpy of gguf-py's dequantized weight; row ranges; the stored pages given back
and the guard against reading them; a plain read of repacked bytes (the silent failure a view
without ``extra`` would be) failing the same check; and the CPU default on a model: logits beside
hub-only and the plain cpu path, pages given back, restored for a plan that reads them as stored.

The bound is tests/test_cpu_ggml.py's :func:`ggml_bound`: ggml rounds x to the weight's dot type
(q8_0 for Q4_0 / IQ4_NL, q8_K for the K-quants) before the repacked kernels as before the plain
ones, so the same statement of that rounding holds."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import WAIT_S
from test_cpu_ggml import ggml_bound, make_weight, put

from vkxsplit.attach import SharedArena, stats
from vkxsplit.backend import MatMulJob, create_backend
from vkxsplit.backends import ggml_cpu
from vkxsplit.errors import KernelError
from vkxsplit.ops.quant import TYPES

#: types ggml-cpu has repacked layouts for on some CPU (repack.cpp's
#: ggml_repack_get_optimal_repack_type); which of them repack here, ggml decides
CANDIDATES = ("q4_0", "q4_k", "iq4_nl", "q8_0", "q2_k", "q5_k", "q6_k")


def repacks_here(wtype: str, rows: int = 8, amx: bool = True) -> str | None:
    """The buffer type ggml copies a ``rows``-row ``wtype`` matrix of two blocks per row into on
    this CPU, None where none (asked of ggml itself)."""
    return ggml_cpu.load().repacks(TYPES[wtype].id, 2 * TYPES[wtype].block_size, rows, amx=amx)


def has_amx() -> bool:
    return ggml_cpu.load().extra_buft(ggml_cpu.AMX_BUFT_NAME) is not None


@pytest.fixture(scope="module")
def cpu(device):
    b = create_backend("cpu", device, timeout=WAIT_S)
    assert b.repack and b.amx  # (on by default)
    yield b
    b.close()


@pytest.fixture(scope="module")
def cpu_noamx(device):
    b = create_backend("cpu", device, timeout=WAIT_S, amx=0)
    yield b
    b.close()


@pytest.fixture(scope="module")
def plain_cpu(device):
    b = create_backend("cpu", device, timeout=WAIT_S, repack=0)
    yield b
    b.close()


@pytest.fixture
def arena(device, cpu, plain_cpu, cpu_noamx):
    a = SharedArena(device, [cpu, plain_cpu, cpu_noamx], name="repack-test", force="host_allocation")
    yield a
    a.close()


def run(b, job):
    p = b.next_point()
    b.mul_mat(job, wait=None, signal=p)
    b.wait(p)


def test_repack_buffer_type_found_and_q4_0_repacks():
    """The public route (CPU registry -> device 0 -> ggml_backend_dev_get_extra_bufts) finds
    CPU_REPACK; with AVX2 ggml repacks Q4_0 (so the tests below are not all skipped), never a
    row count that is not a multiple of its interleave."""
    g = ggml_cpu.load()
    buft = g.repack_buft()
    assert buft is not None
    assert g.ffi.string(g.base.ggml_backend_buft_name(buft)) == b"CPU_REPACK"
    if g.features()["avx2"]:
        assert all(repacks_here(t, 8, amx=False) == "CPU_REPACK" for t in ("q4_0", "q4_k", "iq4_nl"))
    assert repacks_here("q4_0", 12) is None  # (12 % 8: ggml's init_tensor leaves extra NULL)
    assert repacks_here("f16", 8) is None and repacks_here("f16", 32) is None
    # AMX (where the build has it and the OS lets this process use the tiles): its types at a
    # multiple of 32 rows, and only then; amx=False never
    if has_amx():
        for t in ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k"):
            assert repacks_here(t, 32) == "AMX" and repacks_here(t, 64) == "AMX", t
            assert repacks_here(t, 16) != "AMX" and repacks_here(t, 32, amx=False) != "AMX", t
    else:
        assert all(repacks_here(t, 32) != "AMX" for t in CANDIDATES)
    # vkxsplit info names them, by buffer type (a 32-row weight of 256 columns)
    from vkxsplit.info.backends import probe_backends

    cpu = next(b for b in probe_backends() if b["name"] == "cpu")
    got = cpu["ggml"]["repacked_types"]
    want: dict[str, list[str]] = {}
    for t in TYPES:
        k = ggml_cpu.load().repacks(TYPES[t].id, 256, 32) if TYPES[t].quantized else None
        if k:
            want.setdefault(k, []).append(t)
    assert got == want and "repacked weight layouts" in cpu["detail"]
    assert ("AMX" in got) is has_amx()


@pytest.mark.parametrize("kind", ["CPU_REPACK", "AMX"])
@pytest.mark.parametrize("wtype", CANDIDATES)
@pytest.mark.parametrize("M", [1, 8, 128])
def test_repacked_products_against_float64(cpu, cpu_noamx, arena, rng, wtype, M, kind):
    """Decode and prefill products of a weight copied into each buffer type (AMX: the backend's
    default, CPU_REPACK: with amx=0), y strided (and x for decode: both read prefill x rows K
    apart), against float64 numpy of the dequantized weight within ggml's q8 rounding bound;
    graph and copy made once (a second run allocates nothing), nothing staged."""
    N, K = 32, 512
    if repacks_here(wtype, N, amx=kind == "AMX") != kind:
        pytest.skip(f"ggml-cpu does not copy {wtype} into {kind} on this CPU")
    if kind == "CPU_REPACK":
        cpu = cpu_noamx
    # (AMX's prefill products take a contiguous result only: test_strided_results_and_amx)
    xs, ys = (K + 16 if M == 1 else K), (N if kind == "AMX" and M > 1 else N + 5)
    wq, wd = make_weight(rng, wtype, N, K)
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
    xb = put(arena, np.pad(x, ((0, 0), (0, xs - K)), constant_values=np.nan))
    wb = put(arena, wq)
    y = arena.alloc(M * ys * 4)
    y.numpy(np.float32)[:] = np.nan
    job = MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, x_stride=xs, y_stride=ys)
    packed0, built0, staged0 = cpu.packed_bytes, cpu.graphs_built, stats.staged_bytes
    run(cpu, job)
    grew = cpu.packed_bytes - packed0
    assert grew >= wq.nbytes  # the job ran on a copy (AMX's layout may be larger than the stored one)
    assert [p.kind for sb, p in cpu._packed.values() if sb is wb] == [kind]
    got = y.numpy(np.float32).reshape(M, ys)
    ref = x.astype(np.float64) @ wd.T
    bound = ggml_bound(x, wd, wtype)
    assert np.all(np.abs(got[:, :N] - ref) <= bound), f"max excess {np.max(np.abs(got[:, :N] - ref) - bound)}"
    assert np.isnan(got[:, N:]).all()  # y's padding untouched
    # replayed: the same graph and copy, nothing built, allocated or staged
    y.numpy(np.float32)[:] = np.nan
    run(cpu, job)
    assert np.array_equal(y.numpy(np.float32).reshape(M, ys)[:, :N], got[:, :N])
    assert cpu.graphs_built == built0 + 1 and cpu.packed_bytes == packed0 + grew
    assert stats.staged_bytes == staged0 == 0
    for b in (wb, xb, y):
        b.close()
    assert cpu.packed_bytes == packed0  # the copy went with the weight's buffer


@pytest.mark.parametrize("N, M", [(16, 8), (32, 2)])
def test_strided_prefill_x_reads_the_stored_weight(cpu, arena, rng, N, M):
    """Prefill x rows not K apart (ggml's repacked gemm reads 4 rows at a time K apart, the AMX
    kernels every row at m K: both would misread them): that job reads the weight as stored, and
    is right. A 16-row weight goes to CPU_REPACK (strided x refused from 4 rows), a 32-row one to
    AMX where there is one (refused from 2 rows)."""
    wtype, K = "q4_0", 256
    if not repacks_here(wtype, N) or (N == 32 and not has_amx()):
        pytest.skip(f"ggml-cpu does not repack a {N}-row q4_0 weight into the buffer type this case is for")
    wq, wd = make_weight(rng, wtype, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xs = K + 32
    xb, wb, y = put(arena, np.pad(x, ((0, 0), (0, xs - K)), constant_values=np.nan)), put(arena, wq), arena.alloc(M * N * 4)
    job = MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, x_stride=xs)
    assert not cpu.pack(job)
    run(cpu, job)
    assert np.all(np.abs(y.numpy(np.float32).reshape(M, N) - x.astype(np.float64) @ wd.T) <= ggml_bound(x, wd, wtype))
    for b in (xb, wb, y):
        b.close()


def test_strided_results_and_amx(cpu, arena, rng):
    """A prefill product into a strided result (columns of a wider row) does not take the AMX
    copy (it reads the weight as stored) and is right; the wrong variant, the AMX kernels given
    that strided result through a graph of their own, loses the rows past its first 4 KiB."""
    if not has_amx():
        pytest.skip("this ggml build or CPU has no AMX buffer type")
    wtype, N, K, M, ys = "q4_0", 32, 256, 64, 37
    g = ggml_cpu.load()
    wq, wd = make_weight(rng, wtype, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xb, wb, y = put(arena, x), put(arena, wq), arena.alloc(M * ys * 4)
    ref, bound = x.astype(np.float64) @ wd.T, ggml_bound(x, wd, wtype)
    job = MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, y_stride=ys)
    assert not cpu.pack(job)
    y.numpy(np.float32)[:] = np.nan
    run(cpu, job)
    assert np.all(np.abs(y.numpy(np.float32).reshape(M, ys)[:, :N] - ref) <= bound)
    assert cpu.pack(MatMulJob(wb.view(), wtype, xb.view(), y.view(), 1, N, K, y_stride=ys))  # decode does
    # the wrong variant
    p = ggml_cpu.PackedWeight.create(g, TYPES[wtype].id, K, N, int(g.ffi.cast("uintptr_t", g.ffi.from_buffer(wq))))
    assert p is not None and p.kind == "AMX"
    out = np.full((M, ys), np.nan, np.float32)
    gr, pool = ggml_cpu.Graph(g), ggml_cpu.ThreadPool(g, 1)
    try:
        X = gr.strided(0, x.ctypes.data, K, M, K * 4)
        gr.finish(gr.place(g.base.ggml_mul_mat(gr.ctx, p.tensor, X), out.ctypes.data, ys * 4), pool)
        gr.compute(g.ffi.new("uint8_t[]", max(gr.work_size, 1)))
    finally:
        gr.close()
        pool.close()
        p.close()
    ok = np.all(np.abs(out[:, :N] - ref) <= bound, axis=1)
    assert ok[:16].all() and not ok.all()
    for b in (xb, wb, y):
        b.close()


@pytest.mark.parametrize("wtype", ["q4_0", "q4_1", "q8_0"])
def test_one_block_rows_not_amx(cpu, arena, rng, wtype):
    """A weight of one 32-element block per row (K = 32) of Q4_0 / Q4_1 / Q8_0 does not go to AMX
    (two blocks do) and its prefill product is right, into a result that held other values. The
    wrong variant, the AMX copy of it through a graph of its own, adds the product to what the
    result held: it fails the same check."""
    if not has_amx():
        pytest.skip("this ggml build or CPU has no AMX buffer type")
    g, tid, N, M = ggml_cpu.load(), TYPES[wtype].id, 32, 32
    assert not g.amx_takes(tid, N, 32) and g.amx_takes(tid, N, 64)
    assert g.repacks(tid, 32, N) != "AMX" and g.repacks(tid, 64, N) == "AMX"
    wq, wd = make_weight(rng, wtype, N, 32)
    x = rng.standard_normal((M, 32)).astype(np.float32)
    ref, bound = x.astype(np.float64) @ wd.T, ggml_bound(x, wd, wtype)
    xb, wb, y = put(arena, x), put(arena, wq), arena.alloc(M * N * 4)
    y.numpy(np.float32)[:] = 1.0
    run(cpu, MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, 32))
    assert np.all(np.abs(y.numpy(np.float32).reshape(M, N) - ref) <= bound)
    assert all(p is None or p.kind != "AMX" for sb, p in cpu._packed.values() if sb is wb)
    # the wrong variant
    p = ggml_cpu.PackedWeight._create_in(g, g.extra_buft(ggml_cpu.AMX_BUFT_NAME), "AMX", tid, 32, N,
                                         int(g.ffi.cast("uintptr_t", g.ffi.from_buffer(wq))))
    assert p is not None
    out = np.ones((M, N), np.float32)
    gr, pool = ggml_cpu.Graph(g), ggml_cpu.ThreadPool(g, 1)
    try:
        X = gr.strided(0, x.ctypes.data, 32, M, 32 * 4)
        gr.finish(gr.place(g.base.ggml_mul_mat(gr.ctx, p.tensor, X), out.ctypes.data, N * 4), pool)
        gr.compute(g.ffi.new("uint8_t[]", max(gr.work_size, 1)))
    finally:
        gr.close()
        pool.close()
        p.close()
    assert not np.all(np.abs(out - ref) <= bound)
    for b in (xb, wb, y):
        b.close()


def test_read_as_stored_and_keep_packed_free_copies(cpu, arena, rng):
    """A copy no live plan multiplies by is freed: ``read_as_stored`` of a copied weight frees its
    copy and the graphs over it (the next run reads the stored bytes, and is right);
    ``keep_packed`` frees every copy but those of the jobs it is given."""
    wtype, N, K, M = "q4_0", 32, 256, 4
    if not repacks_here(wtype, N):
        pytest.skip("ggml-cpu does not repack q4_0 on this CPU")
    wq, wd = make_weight(rng, wtype, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    ref, bound = x.astype(np.float64) @ wd.T, ggml_bound(x, wd, wtype)
    xb, wa, wb, y = put(arena, x), put(arena, wq), put(arena, wq), arena.alloc(M * N * 4)
    ja, jb = (MatMulJob(w.view(), wtype, xb.view(), y.view(), M, N, K) for w in (wa, wb))
    base = cpu.packed_bytes
    assert cpu.pack(ja) and cpu.pack(jb)
    one = (cpu.packed_bytes - base) // 2
    run(cpu, ja)
    assert cpu.graphs
    cpu.read_as_stored(ja)
    assert cpu.packed_bytes == base + one and not cpu.graphs and not cpu.pack(ja)
    y.numpy(np.float32)[:] = np.nan
    run(cpu, ja)
    assert np.all(np.abs(y.numpy(np.float32).reshape(M, N) - ref) <= bound)
    assert cpu.keep_packed([jb]) == 0 and cpu.packed_bytes == base + one
    assert cpu.keep_packed([]) == one and cpu.packed_bytes == base
    for b in (xb, wa, wb, y):
        b.close()


def test_row_ranges_repack_when_aligned(cpu, arena, rng):
    """A tensor split's row range: rows [8, 24) of a weight held from global row 4 get their own
    repacked copy; rows [6, 21) (not a multiple of 8) are read as stored. Both within the bound."""
    wtype, N, K, M = "q4_0", 36, 256, 8
    if not repacks_here(wtype):
        pytest.skip("ggml-cpu does not repack q4_0 on this CPU")
    wq, wd = make_weight(rng, wtype, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xb, wb = put(arena, x), put(arena, wq[4:])
    for r0, r1, packs in ((8, 24, True), (6, 21, False)):
        y = arena.alloc(M * N * 4)
        y.numpy(np.float32)[:] = np.nan
        before = cpu.packed_bytes
        job = MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, r0=r0, r1=r1, w_row0=4)
        assert cpu.pack(job) is packs
        run(cpu, job)
        assert (cpu.packed_bytes > before) is packs
        got = y.numpy(np.float32).reshape(M, N)[:, r0:r1]
        assert np.all(np.abs(got - x.astype(np.float64) @ wd[r0:r1].T) <= ggml_bound(x, wd[r0:r1], wtype))
        y.close()
    xb.close()
    wb.close()


def test_given_back_pages_and_the_plain_read_of_repacked_bytes(cpu, plain_cpu, arena, rng):
    """After the stored pages are given back (SharedBuffer.discard: they read as zeros) the
    repacked job still matches the reference (it reads its copy); a job that would read the
    stored bytes (the plain backend, or a row range ggml cannot repack) is refused, not computed
    from zeros; restored, they are read again. The wrong variant: the plain kernel over the
    repacked bytes (what a view of a repacked tensor, which has no ``extra``, would run) fails
    the check the repacked product passes."""
    wtype, N, K, M = "q4_0", 32, 512, 4
    if not repacks_here(wtype):
        pytest.skip("ggml-cpu does not repack q4_0 on this CPU")
    wq, wd = make_weight(rng, wtype, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xb, wb, y = put(arena, x), put(arena, wq), arena.alloc(M * N * 4)
    ref, bound = x.astype(np.float64) @ wd.T, ggml_bound(x, wd, wtype)

    def ok(out):
        return bool(np.all(np.abs(out - ref) <= bound))

    job = MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K)
    assert cpu.pack(job)
    gone = wb.discard()
    assert gone > 0 and (wb.numpy(np.uint8) == 0).sum() >= gone  # whole pages inside it read zeros now
    run(cpu, job)
    assert ok(y.numpy(np.float32).reshape(M, N))
    with pytest.raises(KernelError, match="given back"):
        plain_cpu._run(MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K))
    with pytest.raises(KernelError, match="given back"):
        cpu._run(MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, r0=0, r1=12))
    wb.restore(wq)
    assert not wb.discarded
    plain_cpu._run(MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K))
    assert ok(y.numpy(np.float32).reshape(M, N))
    # the plain kernel over the repacked bytes: wrong, and the check says so
    key = next(k for k, (sb, _p) in cpu._packed.items() if sb is wb)
    packed = cpu._packed[key][1]
    raw = np.frombuffer(ggml_cpu.load().ffi.buffer(packed.tensor.data, packed.nbytes), np.uint8).copy()
    assert not np.array_equal(raw, wq.reshape(-1))
    rb = put(arena, raw)
    plain_cpu._run(MatMulJob(rb.view(), wtype, xb.view(), y.view(), M, N, K))
    assert not ok(y.numpy(np.float32).reshape(M, N))
    for b in (xb, wb, y, rb):
        b.close()


def test_repack_switch(device, monkeypatch):
    """``VKXSPLIT_DISABLE=cpu_repack`` (read when the hub device is created) and ``repack=0``
    turn it off; a bad value is refused naming the option."""
    from vkxsplit.errors import VkxError
    from vkxsplit.features import FEATURES

    assert "cpu_repack" in FEATURES and "cpu_amx" in FEATURES
    monkeypatch.setattr(device, "disabled", device.disabled | {"cpu_repack", "cpu_amx"})
    b = create_backend("cpu", device, timeout=WAIT_S)
    try:
        assert not b.repack and not b.amx
    finally:
        b.close()
    with pytest.raises(VkxError, match="repack must be 0 or 1"):
        create_backend("cpu", device, timeout=WAIT_S, repack=2)
    with pytest.raises(VkxError, match="amx must be 0 or 1"):
        create_backend("cpu", device, timeout=WAIT_S, amx=2)


# -- a model under the CPU default ---------------------------------------------------------------

IDS = [3, 17, 250, 41, 7, 99, 128, 5, 60, 311, 2, 77]


def logits(m, ids):
    """Prefill logits of ``ids`` (ubatch 8: two steps), then three decode steps' logits."""
    m.reset()
    pp = m.logits(ids)
    dec = []
    for t in (9, 400, 23):
        m.run_step([t], all_logits=False)
        dec.append(m.last_logits().copy())
    return np.concatenate([pp, np.stack(dec)])


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k"])
def test_cpu_default_on_a_repacked_model(device, tmp_path, qtype):
    """A Q4_0 (Q4_K) model under the CPU default (``mode:cpu``, ``cpu:step=1``): every product's
    weight is repacked and its stored pages given back (the embedding, read by get_rows, keeps
    them); the logits equal the plain cpu path's but for f32 summation order (the same q8
    rounding of x), and are within the q8 bound of hub-only's with the same top-1 where it is
    clear; no staged bytes, nothing built or allocated by a replayed step. ``set_split('none')``
    then restores the given-back bytes from the file before the hub reads them: hub-only
    logits again."""
    if not device.is_cpu:
        pytest.skip("the CPU default (and giving pages back) is for a CPU hub")
    if not repacks_here(qtype):
        pytest.skip(f"ggml-cpu does not repack {qtype} on this CPU")
    from vkxsplit.defaults import CPU_HUB_BACKENDS, CPU_HUB_SPLIT
    from vkxsplit.model import load_model
    from vkxsplit.synth import write_synthetic

    path = write_synthetic(tmp_path / f"tiny-{qtype}.gguf", "tiny", qtype, seed=3)
    kw = dict(device=device, n_ctx=32, ubatch=8)
    with load_model(path, split="none", **kw) as m:
        hub = logits(m, IDS)
    with load_model(path, split="mode:cpu", backends="cpu:step=1:repack=0", **kw) as m:
        plain = logits(m, IDS)
        assert not m.given_back
    # the CPU-hub default (what load_model picks when it opens a CPU hub itself)
    with load_model(path, split=CPU_HUB_SPLIT, backends=CPU_HUB_BACKENDS, **kw) as m:
        assert str(m.split) == "mode:cpu" and m.backends["cpu"].step
        cpu = m.backends["cpu"]
        got = logits(m, IDS)
        products = {n for n, t in m.weights.items() if t.dtype == qtype and n != "token_embd.weight"}
        assert set(m.given_back) == products, sorted(set(m.weights) - set(m.given_back))
        w = m.weights["blk.0.ffn_down.weight"].buffer
        assert not w.numpy(np.uint8)[4096:-4096].any()  # its stored pages are gone
        assert cpu.packed_bytes >= sum(m.weights[n].buffer.size for n in products)
        st0, built, packed, work = dict(m.stats), cpu.graphs_built, cpu.packed_bytes, cpu._work
        again = logits(m, IDS)
        assert np.array_equal(again, got)
        assert cpu.graphs_built == built and cpu.packed_bytes == packed and cpu._work is work
        assert m.stats["staged_bytes"] == st0["staged_bytes"] == 0 and m.stats["host_waits_in_step"] == 0
        m.set_split("none")
        back = logits(m, IDS)
        assert not m.given_back and w.numpy(np.uint8)[4096:-4096].any()
        assert np.array_equal(back, hub)  # (the hub's kernels over the restored bytes)
        assert cpu.packed_bytes == 0 and not cpu.graphs  # (the copies went: the weights are held once)
        m.set_split("mode:cpu")  # copied again, pages given back again, the same logits
        assert np.array_equal(logits(m, IDS), got)
        assert set(m.given_back) == products and cpu.packed_bytes == packed
    scale = np.abs(hub).max()
    # the same q8 rounding of x: equal but for f32 summation order, except where the repacked
    # gemm's 4-row quantizer (ggml_quantize_mat_q8_K_4x8) rounds a value to the other
    # neighbour than quantize_row_q8_K (a tie: one Q4_K prefill row of 15 moved by 0.3%)
    rows = np.abs(got - plain).max(1) / scale
    assert (rows <= 1e-4).mean() >= 0.8 and rows.max() <= 1e-2, rows
    # ggml's 8-bit x against the hub's f32 x over 4 layers: within 3% of the logits' scale
    # (measured 0.3% for Q4_0, 1.5% for Q4_K's q8_K x, repacked or not alike), the top-1 the
    # same where the hub's margin is over twice that
    E = 3e-2 * scale
    assert np.abs(got - hub).max() <= E
    srt = np.sort(hub, axis=1)
    clear = (srt[:, -1] - srt[:, -2]) > 2 * E
    assert (got.argmax(1) == hub.argmax(1))[clear].all()
