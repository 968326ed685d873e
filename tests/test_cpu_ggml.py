"""The cpu backend on ggml's CPU kernels (libggml-python): every hub weight type, decode and
prefill shapes, row ranges and strides against float64 numpy; the routed expert product
(mul_mat_id); zero staged bytes and graphs built once; bad shapes refused before ggml sees them.

The reference dequantizes the weight with gguf-py (independent of ggml's code) and multiplies
in float64. ggml rounds x to the weight's dot-product type first (q8_0 / q8_1 for 32-element
blocks, q8_K for K-quants and iq4_xs, f16 / bf16 for those weights, f32 as is): the bound
:func:`ggml_bound` states that rounding's error and the f32 accumulation's."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import WAIT_S
from gguf import quants
from gguf.constants import GGMLQuantizationType

from vkxsplit.attach import SharedArena, stats
from vkxsplit.backend import MatMulIdJob, MatMulJob, create_backend
from vkxsplit.backends import ggml_cpu
from vkxsplit.errors import KernelError
from vkxsplit.ops.quant import TYPES

#: the type ggml converts x to for each weight type (ggml-cpu's ``vec_dot_type``)
DOT_TYPE = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0",
            "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1", "q2_k": "q8_k", "q3_k": "q8_k", "q4_k": "q8_k",
            "q5_k": "q8_k", "q6_k": "q8_k", "iq4_xs": "q8_k"}

#: byte offsets of the f16 scale fields in one block (gguf-py / ggml-common.h layouts), for
#: random valid blocks of the types gguf-py cannot quantize
F16_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
              "iq4_nl": (0,), "iq4_xs": (0,)}


def x_error(x: np.ndarray, wtype: str) -> np.ndarray:
    """Per-element bound on |x - x as ggml rounds it| for ``wtype``'s dot type.

    q8_0/q8_1: per 32-block d = amax/127 stored as f16, q = round(x/d): |err| <= d/2 + 127 d 2^-11;
    q8_K: per 256-block, d a float: d/2 (+ float rounding); f16 / bf16: half an ulp."""
    dot = DOT_TYPE[wtype]
    ax = np.abs(x.astype(np.float64))
    if dot == "f32":
        return np.zeros_like(ax)
    if dot == "f16":
        return ax * 2.0**-11 + 2.0**-25
    if dot == "bf16":
        return ax * 2.0**-8
    bs = 256 if dot == "q8_k" else 32
    M, K = x.shape
    amax = ax.reshape(M, K // bs, bs).max(axis=2, keepdims=True)
    d = amax / 127
    e = d / 2 + 127 * d * 2.0**-10 + amax * 2.0**-20
    return np.broadcast_to(e, (M, K // bs, bs)).reshape(M, K)


def ggml_x(x: np.ndarray, wtype: str) -> np.ndarray:
    """x (float64, rows of K) as ggml rounds it for a product with a ``wtype`` weight, written
    from the block formats (ggml-common.h), not from ggml's code: q8_0 / q8_1 (32-element
    blocks, d = amax/127 stored as f16, q = round(x / d)), q8_K (256-element blocks, d a
    float), f16 / bf16 casts, f32 as is."""
    import ml_dtypes

    dot = DOT_TYPE[wtype]
    x = np.asarray(x, np.float64)
    if dot == "f32":
        return x
    if dot == "f16":
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    if dot == "bf16":
        return x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    bs = 256 if dot == "q8_k" else 32
    M, K = x.shape
    xb = x.astype(np.float32).astype(np.float64).reshape(M, K // bs, bs)
    d = np.abs(xb).max(axis=2, keepdims=True) / 127
    q = np.clip(np.round(np.divide(xb, d, out=np.zeros_like(xb), where=d > 0)), -127, 127)
    ds = d.astype(np.float16).astype(np.float64) if dot != "q8_k" else d.astype(np.float32).astype(np.float64)
    return (q * ds).reshape(M, K)


def ggml_bound(x: np.ndarray, wd: np.ndarray, wtype: str) -> np.ndarray:
    """|y - x @ wd.T| allowed for ggml's product: the x rounding (times |w|), the f16-stored
    sums of q8_1 (times the weight's block scale, covered by 2^-9 of sum |w| |x|), and the f32
    accumulation of K terms."""
    X, W = np.abs(x.astype(np.float64)), np.abs(wd)
    acc = np.abs(x).astype(np.float64) @ W.T
    return x_error(x, wtype) @ W.T + (2.0**-9 if DOT_TYPE[wtype] == "q8_1" else 0) * acc \
        + 4 * x.shape[1] * 2.0**-24 * (X @ W.T) + 1e-6


def make_weight(rng: np.random.Generator, wtype: str, rows: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes or floats as the hub keeps them, float64 dequantized by gguf-py)."""
    t = GGMLQuantizationType[wtype.upper()]
    w = rng.standard_normal((rows, K)).astype(np.float32)
    if wtype in F16_FIELDS:
        bs, bb = TYPES[wtype].block_size, TYPES[wtype].block_bytes
        wq = rng.integers(0, 256, (rows, K // bs, bb), dtype=np.uint8)
        for off in F16_FIELDS[wtype]:
            wq[:, :, off:off + 2].view(np.float16)[:] = rng.uniform(0.001, 0.02, (rows, K // bs, 1))
        wq = wq.reshape(rows, K // bs * bb)
    else:
        wq = quants.quantize(w, t)
    return wq, quants.dequantize(wq, t).astype(np.float64).reshape(rows, K)


@pytest.fixture(scope="module")
def cpu(device):
    b = create_backend("cpu", device, timeout=WAIT_S)
    yield b
    b.close()


@pytest.fixture
def arena(device, cpu):
    a = SharedArena(device, [cpu], name="ggml-test")
    yield a
    a.close()


def put(arena, a):
    a = np.ascontiguousarray(a)
    sb = arena.alloc(a.nbytes)
    sb.numpy(np.uint8)[:] = a.view(np.uint8).ravel()
    return sb


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wtype", list(TYPES))
@pytest.mark.parametrize("M", [1, 7])
def test_mul_mat_every_type(cpu, arena, rng, wtype, M):
    """Decode (M=1) and prefill (M=7) with strided x and y and a row range of a weight slice
    (the view starts at global row w_row0): y columns [r0, r1) only, against float64."""
    N, K = 24, 512
    w_row0, r0, r1 = 4, 6, 21
    xs, ys = K + 32, N + 3
    wq, wd = make_weight(rng, wtype, N, K)
    x = (rng.standard_normal((M, K)) * rng.uniform(0.1, 3, (M, 1))).astype(np.float32)
    xb = put(arena, np.pad(x, ((0, 0), (0, xs - K)), constant_values=np.nan))  # padding never read
    wb = put(arena, wq[w_row0:])
    y = arena.alloc(M * ys * 4)
    y.numpy(np.float32)[:] = np.nan
    staged0, built0 = stats.staged_bytes, cpu.graphs_built
    job = MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, x_stride=xs, y_stride=ys,
                    r0=r0, r1=r1, w_row0=w_row0)
    p = cpu.next_point()
    cpu.mul_mat(job, wait=None, signal=p)
    cpu.wait(p)
    got = y.numpy(np.float32).reshape(M, ys)
    ref = x.astype(np.float64) @ wd[r0:r1].T
    bound = ggml_bound(x, wd[r0:r1], wtype)
    err = np.abs(got[:, r0:r1] - ref)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"
    mask = np.ones(ys, bool)
    mask[r0:r1] = False
    assert np.isnan(got[:, mask]).all()  # nothing outside the job's columns
    # a wrong variant (the rows shifted by one) fails the same check
    assert not np.all(np.abs(got[:, r0:r1] - x.astype(np.float64) @ wd[r0 + 1:r1 + 1].T)
                      <= ggml_bound(x, wd[r0 + 1:r1 + 1], wtype))
    assert stats.staged_bytes == staged0 == 0
    assert cpu.graphs_built == built0 + 1
    wb.close()
    xb.close()
    y.close()


def test_graph_built_once_and_replayed(device, cpu, arena, rng, seqs, caller_waits):
    """Three steps of hub -> cpu -> hub: one graph, the same object replayed, no staged bytes,
    no host wait in the caller's thread; y follows x as the hub rewrites it."""
    from vkxsplit.ops.convert import record_convert

    M, N, K = 2, 32, 256
    wq, wd = make_weight(rng, "q4_0", N, K)
    wb = put(arena, wq)
    x_in, xb, y, out = (arena.alloc(n) for n in (M * K * 4, M * K * 4, M * N * 4, M * N * 4))
    s1, s2 = seqs("in"), seqs("out")
    record_convert(s1, x_in.view(), xb.view(), M * K, "f32", "f32")
    record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
    job = MatMulJob(wb.view(), "q4_0", xb.view(), y.view(), M, N, K)
    stats.reset()
    built0 = cpu.graphs_built
    graphs = set()
    for step in range(3):
        x = rng.standard_normal((M, K)).astype(np.float32)
        x_in.numpy(np.float32)[:] = x.ravel()
        caller_waits.clear()
        stats.begin_step()
        v1 = s1.submit()
        p = cpu.next_point()
        cpu.mul_mat(job if step < 2 else MatMulJob(wb.view(), "q4_0", xb.view(), y.view(), M, N, K),
                    (s1.timeline, v1), p)
        v2 = s2.submit(waits=[p])
        assert stats.host_waits_in_step == 0 and caller_waits == []
        s2.wait(WAIT_S)
        cpu.check()
        assert s2.timeline.value >= v2
        got = out.numpy(np.float32).reshape(M, N)
        assert np.all(np.abs(got - x.astype(np.float64) @ wd.T) <= ggml_bound(x, wd, "q4_0"))
        graphs |= {id(c.graph) for c in cpu.graphs.values()}
    assert cpu.graphs_built == built0 + 1  # an equal job (step 3) finds the same graph
    assert stats.staged_bytes == 0
    c = cpu.graphs[next(k for k in cpu.graphs if k[0] == "MatMulJob" and k[1][0][0] == wb.chunk.id)]
    assert c.graph.computes == 3
    assert c.graph.n_nodes == 1  # the product alone: operands are leaves (no view nodes, no barriers)
    wb.close()
    assert not any(wb is b for c in cpu.graphs.values() for b in c.buffers)  # closing drops its graphs


@pytest.mark.parametrize("wtype", ["f32", "q4_0", "q4_k"])
@pytest.mark.parametrize("n_xb", [1, 3])
def test_mul_mat_id(cpu, arena, rng, wtype, n_xb):
    """ggml_mul_mat_id: y[t, s] = W[ids[t, s]] @ x[t, s if n_xb > 1 else 0], strided y, a row
    range of every expert, against float64."""
    T, n_expert, n_used, N, K = 4, 5, 3, 20, 256
    r0, r1, ys, xs = 3, 17, N + 2, K + 32
    parts = [make_weight(rng, wtype, N, K) for _ in range(n_expert)]
    wq = np.concatenate([p[0] for p in parts])
    wd = np.stack([p[1] for p in parts])  # (n_expert, N, K)
    ids = np.stack([rng.permutation(n_expert)[:n_used] for _ in range(T)]).astype(np.int32)
    x = rng.standard_normal((T, n_xb, K)).astype(np.float32)
    xb = put(arena, np.pad(x.reshape(T * n_xb, K), ((0, 0), (0, xs - K))))
    wb, ib = put(arena, wq), put(arena, ids)
    y = arena.alloc(T * n_used * ys * 4)
    y.numpy(np.float32)[:] = np.nan
    job = MatMulIdJob(wb.view(), wtype, xb.view(), y.view(), T, N, K, x_stride=xs, y_stride=ys, r0=r0, r1=r1,
                      ids=ib.view(), n_expert=n_expert, n_used=n_used, n_xb=n_xb)
    p = cpu.next_point()
    cpu.mul_mat_id(job, None, p)
    cpu.wait(p)
    got = y.numpy(np.float32).reshape(T, n_used, ys)
    for t in range(T):
        for s in range(n_used):
            xr = x[t, s if n_xb > 1 else 0][None]
            w = wd[ids[t, s], r0:r1]
            assert np.all(np.abs(got[t, s, r0:r1] - (xr.astype(np.float64) @ w.T)[0])
                          <= ggml_bound(xr, w, wtype)[0])
            # the wrong expert fails the same check
            wrong = wd[(ids[t, s] + 1) % n_expert, r0:r1]
            assert not np.all(np.abs(got[t, s, r0:r1] - (xr.astype(np.float64) @ wrong.T)[0])
                              <= ggml_bound(xr, wrong, wtype)[0])
    assert np.isnan(got[:, :, :r0]).all() and np.isnan(got[:, :, r1:]).all()
    # an expert id out of range is a KernelError from check(), not an abort in ggml
    ib.numpy(np.int32)[1] = n_expert
    p = cpu.next_point()
    cpu.mul_mat_id(job, None, p)
    with pytest.raises(KernelError, match=f"expert id {n_expert} outside"):
        cpu.wait(p)
    for b in (wb, ib, xb, y):
        b.close()


def test_bad_shapes_refused_before_ggml(cpu, arena, rng):
    wb, xb, y, ib = arena.alloc(64 * 1024), arena.alloc(4096), arena.alloc(4096), arena.alloc(64)
    try:
        with pytest.raises(KernelError, match="not a whole number of 32-element"):
            MatMulJob(wb.view(), "q4_0", xb.view(), y.view(), 1, 8, 48)
        with pytest.raises(KernelError, match="x must be f32|computes in f32"):
            cpu.mul_mat(MatMulJob(wb.view(), "f16", xb.view(), y.view(), 1, 8, 64, x_type="bf16"), None,
                        cpu.next_point())
        with pytest.raises(KernelError, match="n_xb must be 1 or n_used"):
            MatMulIdJob(wb.view(), "f32", xb.view(), y.view(), 1, 8, 64, ids=ib.view(), n_expert=4, n_used=2, n_xb=3)
        with pytest.raises(KernelError, match="n_used must be in"):
            MatMulIdJob(wb.view(), "f32", xb.view(), y.view(), 1, 8, 64, ids=ib.view(), n_expert=2, n_used=3)
        with pytest.raises(KernelError, match="does not hold rows"):
            MatMulIdJob(wb.view(0, 1024), "f32", xb.view(), y.view(), 1, 8, 64, ids=ib.view(), n_expert=4,
                        n_used=2)
        with pytest.raises(KernelError, match="1 \\(broadcast\\) or"):
            from vkxsplit.backend import OpJob

            v = xb.view()
            cpu.run_op("add", OpJob("add", (v, v), (v,), 4, 16, b_rows=2), None, cpu.next_point())
        with pytest.raises(KernelError, match="takes a MatMulIdJob"):
            cpu.mul_mat_id(MatMulJob(wb.view(), "f32", xb.view(), y.view(), 1, 8, 64), None, cpu.next_point())
        cpu.check()  # refusals still signalled their points: nothing recorded
    finally:
        for b in (wb, xb, y, ib):
            b.close()


@pytest.mark.parametrize("wtype", ["f32", "q4_1", "q6_k"])
def test_large_job_on_the_thread_pool(device, rng, wtype):
    """A job over SMALL_JOB_FLOPS runs on the pool of ``threads`` (here 2), a small one on the
    bridge thread alone; both right."""
    from vkxsplit.backends.cpu import SMALL_JOB_FLOPS

    b = create_backend("cpu", device, threads=2, timeout=WAIT_S)
    arena = SharedArena(device, [b])
    try:
        for M, N, K in ((16, 520, 512), (1, 64, 512)):
            wq, wd = make_weight(rng, wtype, N, K)
            x = rng.standard_normal((M, K)).astype(np.float32)
            xb, wb, y = put(arena, x), put(arena, wq), arena.alloc(M * N * 4)
            p = b.next_point()
            b.mul_mat(MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K), None, p)
            b.wait(p)
            got = y.numpy(np.float32).reshape(M, N)
            assert np.all(np.abs(got - x.astype(np.float64) @ wd.T) <= ggml_bound(x, wd, wtype))
            (c,) = [c for c in b.graphs.values() if wb is c.buffers[0]]
            assert c.graph.cplan.n_threads == (2 if 2 * M * N * K >= SMALL_JOB_FLOPS else 1)
    finally:
        b.close()
        arena.close()


def test_threads_option(device):
    b = create_backend("cpu", device, threads=1)
    try:
        assert b.threads == 1 and b.pool.n_threads == 1
        assert b.calibrate()["mul_mat_gflops"] > 0  # the planner's rate, measured with ggml
    finally:
        b.close()
    from vkxsplit.errors import VkxError

    with pytest.raises(VkxError, match="threads must be an integer"):
        create_backend("cpu", device, threads=0)
    with pytest.raises(VkxError, match="poll must be an integer"):
        create_backend("cpu", device, poll=101)
    assert ggml_cpu.physical_cores() >= 1
    from vkxsplit.backends.cpu import default_threads

    # a CPU hub (lavapipe) leaves a core to the hub and the rest of the machine
    want = max(1, ggml_cpu.physical_cores() - 1) if device.is_cpu else ggml_cpu.physical_cores()
    assert default_threads(device) == want


def test_small_runs_on_one_thread_with_an_openmp_ggml(device, monkeypatch):
    """An OpenMP build of ggml (llama.cpp's) meets its threads at an OpenMP barrier after every
    node: a run of jobs averaging under OPENMP_RUN_JOB_FLOPS runs on one thread there; with
    ggml's own pool (libggml-python) every run takes every thread. Whether the loaded build is
    one is what its libggml-cpu links (libgomp among the names its dynamic section needs)."""
    from vkxsplit.backends.cpu import OPENMP_RUN_JOB_FLOPS

    b = create_backend("cpu", device, timeout=WAIT_S, threads=2)
    try:
        g = b.ggml
        with open(ggml_cpu._lib(g.libdir, "libggml-cpu"), "rb") as f:
            assert g.openmp == (b"libgomp.so" in f.read())
        monkeypatch.setattr(g, "_openmp", True)
        assert b._run_pool(3 * OPENMP_RUN_JOB_FLOPS - 1, 3) is b.pool1
        assert b._run_pool(3 * OPENMP_RUN_JOB_FLOPS, 3) is b.pool is not b.pool1
        monkeypatch.setattr(g, "_openmp", False)
        assert b._run_pool(1, 3) is b.pool
    finally:
        b.close()


def test_binding_reports_version_and_features():
    g = ggml_cpu.load()
    assert g.version.count(".") >= 1
    f = g.features()
    assert set(f) == set(ggml_cpu.FEATURES) and all(isinstance(v, bool) for v in f.values())



@pytest.mark.parametrize("wtype", ["q4_0", "q4_1", "q4_k", "f16", "bf16"])
def test_x_rounding_model(rng, wtype):
    """ggml_x (the rounding the model tests emulate) stays inside x_error (the bound above)."""
    x = rng.standard_normal((3, 512)) * 3
    assert np.all(np.abs(ggml_x(x, wtype) - x) <= x_error(x.astype(np.float32), wtype) + 1e-12)


def test_llama_build_taken_where_it_runs(monkeypatch, tmp_path):
    """llama.cpp's ggml build (``ggml_cpu.LLAMA_PACKAGE``) is loaded where it is installed, not
    switched off (``VKXSPLIT_DISABLE=ggml_llama``) and able to run on this CPU, asked of a child
    process that computes with it (cached per build and CPU); a build that cannot run is passed
    over with the reason (here: files that are not libraries); the libggml-python wheel's build
    runs."""
    import importlib.machinery
    import importlib.util

    monkeypatch.setenv("VKXSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "pkg" / "bin"
    bad.mkdir(parents=True)
    for n in ("libggml-base.so", "libggml-cpu.so"):
        (bad / n).write_bytes(b"not a library")
    ok, why = ggml_cpu._runs_here(str(bad))
    assert not ok and "exit status 1" in why
    # an exit status is not cached (it may be passing trouble); a success is, and a cached
    # answer that is not a bool is asked again
    assert not list((tmp_path / "cache").glob("ggml-build-*.json"))
    assert ggml_cpu._runs_here(str(bad)) == (ok, why)
    import libggml

    wheel = os.path.join(os.path.dirname(libggml.__file__), "lib64")
    assert ggml_cpu._runs_here(wheel) == (True, "runs here")
    (cached,) = (tmp_path / "cache").glob("ggml-build-*.json")
    assert ggml_cpu._runs_here(wheel) == (True, "runs here")
    cached.write_text('{"ok": "false", "why": "?"}')
    assert ggml_cpu._runs_here(wheel) == (True, "runs here")
    # the child runs from the checkout, not the caller's directory (a module there named like
    # one the probe imports is not taken)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cffi.py").write_text("raise SystemExit(7)\n")
    cached.unlink()
    assert ggml_cpu._runs_here(wheel) == (True, "runs here")
    # the package found through its module: a build that cannot run is not taken
    real = importlib.util.find_spec
    installed = real(ggml_cpu._LLAMA_MODULE)
    fake = importlib.machinery.ModuleSpec(ggml_cpu._LLAMA_MODULE, None, is_package=True)
    fake.submodule_search_locations = [str(tmp_path / "pkg")]
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: fake if name == ggml_cpu._LLAMA_MODULE else real(name, *a))
    assert ggml_cpu._llama_build() is None
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if installed is None:
        assert ggml_cpu._llama_build() is None
        return
    got = ggml_cpu._llama_build()
    if got is not None:  # (installed and it runs here: what this process loaded)
        assert ggml_cpu.load().package == ggml_cpu.LLAMA_PACKAGE and ggml_cpu.load().libdir == got[0]
    monkeypatch.setenv("VKXSPLIT_DISABLE", "ggml_llama")
    assert ggml_cpu._llama_build() is None


def test_llama_build_that_does_not_load_is_a_clear_error(monkeypatch, tmp_path):
    """llama.cpp's build passed its child self-test but does not load here: a clear error naming
    the kill switch, never a silent fall back to libggml-python's build (its libggml-base would
    mix with the one already loaded)."""
    from vkxsplit.errors import EnvironmentProblem

    monkeypatch.delenv(ggml_cpu.LIBDIR_ENV, raising=False)
    monkeypatch.setattr(ggml_cpu, "_llama_build", lambda: (str(tmp_path), "0.0"))
    ggml_cpu._load.cache_clear()
    try:
        with pytest.raises(EnvironmentProblem, match="does not load in this one") as e:
            ggml_cpu.load()
        assert "VKXSPLIT_DISABLE=ggml_llama" in str(e.value.hint)
    finally:
        ggml_cpu._load.cache_clear()


def test_missing_package_is_a_clear_reason(monkeypatch):
    """Without libggml-python the cpu backend is unavailable with a reason naming the package
    (and `vkxsplit info` says so), never an ImportError traceback."""
    import sys

    from vkxsplit.backends import cpu as cpu_mod
    from vkxsplit.info import probe_backends

    monkeypatch.setitem(sys.modules, "libggml", None)  # import libggml -> ImportError
    monkeypatch.setenv("VKXSPLIT_DISABLE", "ggml_llama")  # (nor llama.cpp's build in its place)
    ggml_cpu._load.cache_clear()
    try:
        a = cpu_mod.available()
        assert not a and "libggml-python" in a.reason and "pip install" in a.reason
        row = probe_backends()[0]
        assert row["name"] == "cpu" and not row["available"] and "libggml-python" in row["detail"]
    finally:
        monkeypatch.undo()
        ggml_cpu._load.cache_clear()
    assert cpu_mod.available()
    row = probe_backends()[0]
    assert row["available"] and row["ggml"]["version"] == ggml_cpu.load().version
    assert "avx2" in row["ggml"]["features"]


def test_graph_cache_is_bounded(device, rng, monkeypatch):
    """At most MAX_GRAPHS graphs are kept (the least recently built go first); a job whose
    graph went is rebuilt and still right."""
    from vkxsplit.backends import cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "MAX_GRAPHS", 2)
    b = create_backend("cpu", device, threads=1, timeout=WAIT_S)
    arena = SharedArena(device, [b])
    try:
        K = 64
        wq, wd = make_weight(rng, "q8_0", 8, K)
        wb = put(arena, wq)
        jobs = []
        for M in (1, 2, 3):
            x = rng.standard_normal((M, K)).astype(np.float32)
            xb, y = put(arena, x), arena.alloc(M * 8 * 4)
            jobs.append((MatMulJob(wb.view(), "q8_0", xb.view(), y.view(), M, 8, K), x, y))
        for job, x, y in [*jobs, jobs[0]]:
            p = b.next_point()
            b.mul_mat(job, None, p)
            b.wait(p)
            assert len(b.graphs) <= 2
            got = y.numpy(np.float32).reshape(job.M, 8)
            assert np.all(np.abs(got - x.astype(np.float64) @ wd.T) <= ggml_bound(x, wd, "q8_0"))
        assert b.graphs_built == 4  # the first job's graph was dropped for the third, then rebuilt
    finally:
        b.close()
        arena.close()


# --------------------------------------------------------------------------------------------
# the rest of a step (backend.STEP_OPS, cpu:step=1): each op against float64 numpy written from
# llama.cpp's conventions (ggml.h's rope_ext pseudo-code, llama.cpp's GQA mapping), then a run of
# jobs as one graph


@pytest.fixture(scope="module")
def cpu_step(device):
    b = create_backend("cpu", device, step=1, threads=1, timeout=WAIT_S)
    yield b
    b.close()


@pytest.fixture
def step_arena(device, cpu_step):
    a = SharedArena(device, [cpu_step], name="ggml-step-test")
    yield a
    a.close()


def run_op(b, job):
    p = b.next_point()
    b.run_op(job.op, job, None, p)
    b.wait(p)


def rope_ref(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: str, base: float, scale: float = 1.0,
             ff: np.ndarray | None = None, yarn: dict | None = None) -> np.ndarray:
    """RoPE in float64 as llama.cpp defines it (ggml.h, docs/ARCHITECTURE.md): pair i of the first
    n_dims of each head turns by theta = p base^(-2i/n_dims) / ff_i, scaled by freq_scale, with
    YaRN's ramp and magnitude when ext_factor != 0; pairs (2i, 2i+1) for ``norm``, (i, i + n_dims/2)
    for ``neox``. x: [T, heads, head_dim]."""
    out = np.array(x, np.float64)
    i = np.arange(n_dims // 2, dtype=np.float64)
    th_ex = pos[:, None].astype(np.float64) * base ** (-2 * i / n_dims) / (1.0 if ff is None else ff)
    th = scale * th_ex
    mag = 1.0
    if yarn is not None:
        nco, ext, attn, bf, bs = (yarn[k] for k in ("n_ctx_orig", "ext_factor", "attn_factor", "beta_fast",
                                                   "beta_slow"))

        def d(beta: float) -> float:
            return n_dims * np.log(nco / (2 * np.pi * beta)) / (2 * np.log(base))

        lo, hi = max(0.0, np.floor(d(bf))), min(n_dims - 1.0, np.ceil(d(bs)))
        r = ext * (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1))
        th = th * (1 - r) + th_ex * r
        mag = attn * (1 + 0.1 * np.log(1 / scale))
    c, s = np.cos(th)[:, None, :] * mag, np.sin(th)[:, None, :] * mag
    if mode == "norm":
        a, b = out[..., 0:n_dims:2].copy(), out[..., 1:n_dims:2].copy()
        out[..., 0:n_dims:2], out[..., 1:n_dims:2] = a * c - b * s, a * s + b * c
    else:
        h = n_dims // 2
        a, b = out[..., :h].copy(), out[..., h:n_dims].copy()
        out[..., :h], out[..., h:n_dims] = a * c - b * s, a * s + b * c
    return out


YARN = {"n_ctx_orig": 64, "ext_factor": 1.0, "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("extra", ["plain", "freq_factors", "yarn"])
def test_rope_against_float64(cpu_step, step_arena, rng, mode, extra):
    """ggml's rope_ext on the backend, in place as the hub's rope node: both orderings, n_dims
    below head_dim (the rest copied), frequency factors, YaRN; f32 sin/cos over angles up to
    ~100 rad: 2e-5 of |x|. The other ordering misses the same bound."""
    from vkxsplit.backend import OpJob

    T, nh, hd, nd = 3, 2, 16, 12
    x = rng.standard_normal((T, nh, hd)).astype(np.float32)
    pos = np.array([3, 40, 97], np.int32)
    ff = rng.uniform(1, 4, nd // 2).astype(np.float32) if extra == "freq_factors" else None
    params = {"n_heads": nh, "head_dim": hd, "n_dims": nd, "mode": mode, "freq_base": 10000.0,
              "freq_scale": 0.25 if extra == "yarn" else 1.0, **(YARN if extra == "yarn" else {})}
    xb, pb = put(step_arena, x), put(step_arena, pos)
    ins = (xb.view(), pb.view()) + ((put(step_arena, ff).view(),) if ff is not None else ())
    run_op(cpu_step, OpJob("rope", ins, (xb.view(),), T, nh * hd, params=params))
    got = xb.numpy(np.float32)[:T * nh * hd].reshape(T, nh, hd)
    yarn = YARN if extra == "yarn" else None
    want = rope_ref(x, pos, nd, mode, 10000.0, params["freq_scale"], ff, yarn)
    bound = 2e-5 * np.abs(x).max()
    assert np.abs(got - want).max() <= bound
    other = rope_ref(x, pos, nd, "neox" if mode == "norm" else "norm", 10000.0, params["freq_scale"], ff, yarn)
    assert np.abs(got - other).max() > 100 * bound
    assert np.array_equal(got[..., nd:], x[..., nd:])  # the dims past n_dims are not turned


def test_kv_store_ropes_k_into_the_f16_cache(cpu_step, step_arena, rng):
    """K roped (neox, with factors) and V stored as f16 at cache rows pos[t], every other row
    untouched: equal to the float64 result rounded to f16 within one f16 ulp."""
    from vkxsplit.backend import OpJob

    T, nkv, hd, n_ctx = 3, 2, 16, 12
    k = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    pos = np.array([4, 5, 9], np.int32)
    ff = rng.uniform(1, 2, hd // 2).astype(np.float32)
    rope = {"n_dims": hd, "mode": "neox", "freq_base": 500.0, "freq_scale": 1.0}
    ck = np.full((n_ctx, nkv * hd), 7.0, np.float16)
    cv = np.full((n_ctx, nkv * hd), 7.0, np.float16)
    kb, vb, pb, fb, ckb, cvb = (put(step_arena, a) for a in (k, v, pos, ff, ck, cv))
    run_op(cpu_step, OpJob("kv_store", (kb.view(), vb.view(), pb.view(), fb.view()), (ckb.view(), cvb.view()), T,
                           nkv * hd, params={"n_kv_heads": nkv, "head_dim": hd, "n_ctx": n_ctx, "rope_k": rope}))
    gk = ckb.numpy(np.float16)[:n_ctx * nkv * hd].reshape(n_ctx, nkv * hd).astype(np.float64)
    gv = cvb.numpy(np.float16)[:n_ctx * nkv * hd].reshape(n_ctx, nkv * hd).astype(np.float64)
    wk = rope_ref(k, pos, hd, "neox", 500.0, 1.0, ff).reshape(T, -1)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(wk), 2.0**-14))) - 10)
    assert (np.abs(gk[pos] - wk) <= ulp + 1e-6).all()
    assert (gv[pos] == v.reshape(T, -1).astype(np.float16)).all()
    rest = np.setdiff1d(np.arange(n_ctx), pos)
    assert (gk[rest] == 7).all() and (gv[rest] == 7).all()


def attention_ref(q, ck, cv, pos0, nkv, scale=None):
    """Causal GQA attention in float64 (llama.cpp: head h reads KV head h // (n_head / n_kv_head);
    query t at pos0 + t sees cache rows 0 .. pos0 + t). q: [T, nh, hd]; caches [n_ctx, nkv, hd]."""
    T, nh, hd = q.shape
    scale = 1 / np.sqrt(hd) if scale is None else scale
    out = np.zeros((T, nh, hd))
    for t in range(T):
        n = pos0 + t + 1
        for h in range(nh):
            g = h // (nh // nkv)
            s = ck[:n, g].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ cv[:n, g].astype(np.float64) / p.sum()
    return out


@pytest.mark.parametrize("T,pos0", [(1, 0), (1, 21), (4, 0), (5, 9)])
def test_attention_causal_gqa(cpu_step, step_arena, rng, T, pos0):
    """ggml's flash_attn_ext over the f16 cache: decode and prefill, GQA (4 heads on 2 KV heads),
    the KV length of each step from the positions (the graph built once, replayed at another
    position). Bound: ggml converts q to f16 and keeps the running V sum in f16 (llama.cpp's CPU
    path), one f16 rounding (2^-11 of at most max |v|) per cache row: over n_kv <= 32 rows of
    random signs ~sqrt(32) 2^-11 = 2.8e-3, so 3e-3 of max |v| (the worst case, every rounding
    the same way, would be 32 2^-11). A reference that sees more rows or groups heads as
    h % n_kv misses it."""
    from vkxsplit.backend import OpJob

    nh, nkv, hd, n_ctx = 4, 2, 32, 32
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    ck = rng.standard_normal((n_ctx, nkv, hd)).astype(np.float16)
    cv = rng.standard_normal((n_ctx, nkv, hd)).astype(np.float16)
    qb, ckb, cvb, ob = put(step_arena, q), put(step_arena, ck), put(step_arena, cv), step_arena.alloc(T * nh * hd * 4)
    pb = put(step_arena, np.arange(pos0, pos0 + T, dtype=np.int32))
    job = OpJob("attention", (qb.view(), ckb.view(), cvb.view(), pb.view()), (ob.view(),), T, nh * hd,
                params={"n_heads": nh, "n_kv_heads": nkv, "head_dim": hd, "n_ctx": n_ctx})
    bound = 3e-3 * np.abs(cv).astype(np.float64).max()
    built = cpu_step.graphs_built
    for p0 in (pos0, pos0 + 3):  # the same job replayed at a later position
        pb.numpy(np.int32)[:T] = np.arange(p0, p0 + T)
        run_op(cpu_step, job)
        got = ob.numpy(np.float32)[:T * nh * hd].reshape(T, nh, hd)
        want = attention_ref(q, ck, cv, p0, nkv)
        assert np.abs(got - want).max() <= bound, (p0, np.abs(got - want).max())
    assert cpu_step.graphs_built == built + 1
    assert np.abs(got - attention_ref(q, ck, cv, n_ctx - 1 - T, nkv)).max() > 10 * bound  # (sees more rows)
    wrong = np.stack([attention_ref(q[:, h:h + 1], ck[:, [h % nkv]], cv[:, [h % nkv]], pos0 + 3, 1)[:, 0]
                      for h in range(nh)], 1)
    assert np.abs(got - wrong).max() > 10 * bound  # (h % n_kv: not llama.cpp's grouping)


@pytest.mark.parametrize("wtype", list(TYPES))
def test_get_rows_every_type(cpu_step, step_arena, rng, wtype):
    """The embedding lookup of every hub weight type: rows dequantized by ggml equal gguf-py's
    dequantization (to f32 rounding); a token id outside the table is a KernelError, not an abort."""
    from vkxsplit.backend import OpJob

    n_rows, K, T = 10, 256, 4
    wq, wd = make_weight(rng, wtype, n_rows, K)
    ids = np.array([3, 0, 9, 3], np.int32)
    wb, ib, ob = put(step_arena, wq), put(step_arena, ids), step_arena.alloc(T * K * 4)
    job = OpJob("get_rows", (wb.view(), ib.view()), (ob.view(),), T, K, params={"w_type": wtype, "n_rows": n_rows})
    run_op(cpu_step, job)
    got = ob.numpy(np.float32)[:T * K].reshape(T, K)
    assert np.abs(got - wd[ids]).max() <= 1e-6 * np.abs(wd).max()
    ib.numpy(np.int32)[1] = n_rows
    with pytest.raises(KernelError, match="token id 10 outside"):
        run_op(cpu_step, job)


def test_argmax_ties_nan_and_inf(cpu_step, step_arena):
    """The first index of the maximum (ties to the lowest, as the hub's argmax), -1 for a row
    with a NaN or +inf, -inf allowed."""
    from vkxsplit.backend import OpJob

    x = np.array([[1, 5, 5, 2], [0, np.nan, 9, 1], [np.inf, 1, 2, 3], [-np.inf, -1, -3, -1]], np.float32)
    xb, ob = put(step_arena, x), step_arena.alloc(16)
    run_op(cpu_step, OpJob("argmax", (xb.view(),), (ob.view(),), 4, 4))
    assert ob.numpy(np.int32)[:4].tolist() == [1, -1, -1, 1]


def test_chain_runs_as_one_graph(cpu_step, step_arena, rng):
    """A run of jobs (norm -> product -> SwiGLU -> product, then the argmax) through run_chain: one
    graph for the four ggml jobs plus the host argmax, built once and replayed, the same results
    as the jobs one by one; the run signals its last point."""
    from vkxsplit.backend import OpJob

    K, F, M = 64, 96, 3
    x = rng.standard_normal((M, K)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    wg, _ = make_weight(rng, "q8_0", 2 * F, K)
    wd, _ = make_weight(rng, "q4_0", K, F)
    xb, nb, gb, db = (put(step_arena, a) for a in (x, nw, wg, wd))
    h, gu, y, am = (step_arena.alloc(n) for n in (M * K * 4, M * 2 * F * 4, M * K * 4, M * 4))

    def jobs():
        return [OpJob("rms_norm", (xb.view(), nb.view()), (h.view(),), M, K, eps=1e-5),
                MatMulJob(gb.view(), "q8_0", h.view(), gu.view(), M, 2 * F, K),
                OpJob("swiglu", (gu.view(0, M * 2 * F * 4), gu.view(0, M * 2 * F * 4)), (gu.view(0, M * 2 * F * 4),),
                      M, 2 * F),
                MatMulJob(db.view(), "q4_0", gu.view(), y.view(), M, K, F, x_stride=2 * F),
                OpJob("argmax", (y.view(),), (am.view(),), M, K)]

    one = []
    for j in jobs():
        p = cpu_step.next_point()
        if isinstance(j, MatMulJob):
            cpu_step.mul_mat(j, None, p)
        else:
            cpu_step.run_op(j.op, j, None, p)
        cpu_step.wait(p)
        one.append(y.numpy(np.float32)[:M * K].copy())
    want_am = am.numpy(np.int32)[:M].copy()
    run = jobs()
    built = cpu_step.graphs_built
    for _ in range(2):
        y.numpy(np.float32)[:] = 0
        am.numpy(np.int32)[:] = 7
        pts = [cpu_step.next_point() for _ in run]
        cpu_step.run_chain(run, None, pts[-1])
        cpu_step.wait(pts[-1])
        assert np.array_equal(y.numpy(np.float32)[:M * K], one[-1])
        assert np.array_equal(am.numpy(np.int32)[:M], want_am)
    assert cpu_step.graphs_built == built + 1  # the run (its graph and its argmax), once
    from vkxsplit.backends.cpu import _job_key

    c = cpu_step.graphs[tuple(_job_key(j) for j in run)]
    assert [p.host is not None for p in c.pieces] == [False, True] and c.pieces[0].graph.n_nodes == 5  # norm, scale, product, SwiGLU, product


def test_step_ops_refused_before_ggml(cpu, cpu_step, step_arena):
    """Shapes ggml would abort on are KernelErrors naming the cause: positions outside the cache
    (recorded by the asynchronous run, the hub's point still signalled), non-consecutive
    attention positions, heads that do not fill q; and without step=1 the backend takes none of
    the step ops."""
    from vkxsplit.backend import OpJob

    q, c, p, o = step_arena.alloc(4096), step_arena.alloc(8192), step_arena.alloc(64), step_arena.alloc(4096)
    prm = {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "n_ctx": 8}
    p.numpy(np.int32)[:3] = [7, 8, 9]
    job = OpJob("kv_store", (q.view(), q.view(), p.view()), (c.view(), c.view()), 3, 16,
                params={"n_kv_heads": 1, "head_dim": 16, "n_ctx": 8})
    with pytest.raises(KernelError, match="positions 7..9 outside the cache"):
        run_op(cpu_step, job)
    p.numpy(np.int32)[:3] = [0, 2, 3]
    att = OpJob("attention", (q.view(), c.view(), c.view(), p.view()), (o.view(),), 3, 32, params=prm)
    with pytest.raises(KernelError, match="not consecutive"):
        run_op(cpu_step, att)
    with pytest.raises(KernelError, match="must fill q"):
        cpu_step.run_op("attention", OpJob("attention", att.inputs, att.outputs, 3, 48, params=prm), None,
                        cpu_step.next_point())
    with pytest.raises(KernelError, match="without step=1"):
        cpu.run_op("attention", att, None, cpu.next_point())
    cpu_step.check()
    cpu.check()


def test_chain_store_then_attend_is_one_graph(cpu_step, step_arena, rng):
    """A layer's KV store followed by its attention (which reads the cache the store writes) stay
    one graph: the attention's per-step setting reads only the positions, which no job of the
    run writes. Results equal the two jobs run one by one, at two positions."""
    from vkxsplit.backend import OpJob

    T, nh, nkv, hd, n_ctx = 2, 4, 2, 16, 16
    k, v = (rng.standard_normal((T, nkv * hd)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((T, nh * hd)).astype(np.float32)
    kb, vb, qb = put(step_arena, k), put(step_arena, v), put(step_arena, q)
    pb, ob = step_arena.alloc(T * 4), step_arena.alloc(T * nh * hd * 4)
    ck, cv = (put(step_arena, rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)) for _ in range(2))
    rope = {"n_dims": hd, "mode": "norm", "freq_base": 10000.0, "freq_scale": 1.0}
    run = [OpJob("kv_store", (kb.view(), vb.view(), pb.view()), (ck.view(), cv.view()), T, nkv * hd,
                 params={"n_kv_heads": nkv, "head_dim": hd, "n_ctx": n_ctx, "rope_k": rope}),
           OpJob("attention", (qb.view(), ck.view(), cv.view(), pb.view()), (ob.view(),), T, nh * hd,
                 params={"n_heads": nh, "n_kv_heads": nkv, "head_dim": hd, "n_ctx": n_ctx})]
    for p0 in (3, 9):
        pb.numpy(np.int32)[:T] = [p0, p0 + 1]
        for j in run:
            run_op(cpu_step, j)
        want = ob.numpy(np.float32)[:T * nh * hd].copy()
        ob.numpy(np.float32)[:] = 0
        pts = [cpu_step.next_point() for _ in run]
        cpu_step.run_chain(run, None, pts[-1])
        cpu_step.wait(pts[-1])
        assert np.array_equal(ob.numpy(np.float32)[:T * nh * hd], want)
    from vkxsplit.backends.cpu import _job_key

    c = cpu_step.graphs[tuple(_job_key(j) for j in run)]
    assert len(c.pieces) == 1 and c.pieces[0].graph.n_nodes >= 4  # rope, reshape, set_rows x2, attention


def test_step_threads_leave_busy_cores(device, monkeypatch):
    """With step=1 (the hub has nothing to run) the default is every physical core others do not
    keep busy, at least 1; busy_cores reads a plausible figure from /proc."""
    from vkxsplit.backends import cpu as cpu_mod

    cores = ggml_cpu.physical_cores()
    monkeypatch.setattr(cpu_mod, "busy_cores", lambda sample_s=0.2: 0.2)
    assert cpu_mod.default_threads(device, step=True) == cores
    monkeypatch.setattr(cpu_mod, "busy_cores", lambda sample_s=0.2: cores + 3.0)
    assert cpu_mod.default_threads(device, step=True) == 1
    monkeypatch.undo()
    assert 0.0 <= cpu_mod.busy_cores(0.05) <= 4 * (os.cpu_count() or 1)
    with pytest.raises(Exception, match="step must be 0 or 1"):
        create_backend("cpu", device, step=2)


def test_busy_cores_counts_only_this_process_cpus(monkeypatch):
    """In a container /proc/stat lists the host's CPUs: busy_cores counts only the CPUs this
    process may run on (its affinity), so a busy host outside the container's two CPUs leaves
    both of them to ggml. The fake /proc below: 8 host CPUs, 6 of them (2..7) fully busy over the
    sample, this process's CPUs 0 and 1 busy 0.5 s each, of which 0.25 s this process's own."""
    import io

    from vkxsplit.backends import cpu as cpu_mod

    hz = os.sysconf("SC_CLK_TCK")

    def stat(busy01: float, busy_rest: float) -> str:
        per = [busy01] * 2 + [busy_rest] * 6
        lines = [f"cpu  {sum(per) * hz:.0f} 0 0 {1000 * hz} 0 0 0 0 0 0"]
        lines += [f"cpu{i} {b * hz:.0f} 0 0 {100 * hz} 0 0 0 0 0 0" for i, b in enumerate(per)]
        return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"

    reads = {"/proc/stat": [stat(0, 0), stat(0.5, 1.0)],
             "/proc/self/stat": [f"1 (py) R {' '.join(['0'] * 10)} 0 0 0", f"1 (py) R {' '.join(['0'] * 10)} "
                                 f"{0.25 * hz:.0f} {0.25 * hz:.0f} 0"]}

    def fake_open(path, *a, **k):
        return io.StringIO(reads[path].pop(0))

    class Clock:
        t = 0.0

        @classmethod
        def monotonic(cls) -> float:
            return cls.t

        @classmethod
        def sleep(cls, s: float) -> None:
            cls.t += 1.0

    monkeypatch.setattr(cpu_mod, "open", fake_open, raising=False)
    monkeypatch.setattr(cpu_mod, "time", Clock)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    # cpu0 + cpu1: 1.0 s busy, 0.5 s of it this process's: 0.5 cores busy with others
    assert cpu_mod.busy_cores(1.0) == pytest.approx(0.5, abs=0.05)


def test_failed_construction_frees_its_thread_pools(device, monkeypatch):
    """A cpu backend whose construction fails after its ggml thread pools started (here the
    host bridge) stops them: no worker threads left behind."""
    from vkxsplit.backends import cpu as cpu_mod

    made: list[ggml_cpu.ThreadPool] = []
    real = ggml_cpu.ThreadPool

    class Pool(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def broken(*a, **k):
        raise RuntimeError("bridge failed")

    monkeypatch.setattr(cpu_mod.ggml_cpu, "ThreadPool", Pool)
    monkeypatch.setattr(cpu_mod, "HostBridge", broken)
    with pytest.raises(RuntimeError, match="bridge failed"):
        create_backend("cpu", device, threads=2, timeout=WAIT_S)
    assert len(made) == 2 and all(p.handle is None for p in made)


def test_attention_mask_rows_padded_for_older_ggml(cpu_step, step_arena, rng):
    """The causal mask of a prefill attention has its query rows padded to 64: a ggml older than
    the removal of GGML_KQ_MASK_PAD (a llama.cpp build loaded through VKXSPLIT_GGML_LIBDIR)
    asserts ``mask->ne[1] >= GGML_PAD(q->ne[1], GGML_KQ_MASK_PAD)`` (64, earlier 32) when the
    graph is built, which ends the process. The padded mask still gives the causal result."""
    from vkxsplit.backend import OpJob
    from vkxsplit.backends.cpu import _job_key

    T, nh, nkv, hd, n_ctx, pos0 = 3, 2, 1, 16, 16, 4
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    ck, cv = (rng.standard_normal((n_ctx, nkv, hd)).astype(np.float16) for _ in range(2))
    qb, ckb, cvb, ob = put(step_arena, q), put(step_arena, ck), put(step_arena, cv), step_arena.alloc(T * nh * hd * 4)
    pb = put(step_arena, np.arange(pos0, pos0 + T, dtype=np.int32))
    job = OpJob("attention", (qb.view(), ckb.view(), cvb.view(), pb.view()), (ob.view(),), T, nh * hd,
                params={"n_heads": nh, "n_kv_heads": nkv, "head_dim": hd, "n_ctx": n_ctx})
    run_op(cpu_step, job)
    g = cpu_step.graphs[_job_key(job)].graph
    fa = cpu_step.ggml.base.ggml_graph_node(g.gf, -1)
    mask = fa.src[3]
    assert mask != cpu_step.ggml.ffi.NULL and mask.ne[1] % 64 == 0 and mask.ne[1] >= T
    got = ob.numpy(np.float32)[:T * nh * hd].reshape(T, nh, hd)
    assert np.abs(got - attention_ref(q, ck, cv, pos0, nkv)).max() <= 3e-3 * np.abs(cv).astype(np.float64).max()


def test_attention_masks_shared_per_shape_and_right_for_each(cpu_step, step_arena, rng):
    """Causal masks are one buffer per (query rows, n_ctx), shared by every attention of that
    shape (a step's layers): two jobs of 3 and 4 query rows ending at the same KV length (their
    masks differ) and a second 3-row job (sharing the first's buffer) all give the causal result.
    A mask keyed by its padded rows alone would hand the 4-row job the 3-row mask."""
    from vkxsplit.backend import OpJob

    nh, nkv, hd, n_ctx = 2, 1, 16, 16
    ck, cv = (rng.standard_normal((n_ctx, nkv, hd)).astype(np.float16) for _ in range(2))
    ckb, cvb = put(step_arena, ck), put(step_arena, cv)
    bound = 3e-3 * np.abs(cv).astype(np.float64).max()
    bufs = []
    for T, pos0 in ((3, 5), (4, 4), (3, 5)):
        q = rng.standard_normal((T, nh, hd)).astype(np.float32)
        qb, ob = put(step_arena, q), step_arena.alloc(T * nh * hd * 4)
        pb = put(step_arena, np.arange(pos0, pos0 + T, dtype=np.int32))
        run_op(cpu_step, OpJob("attention", (qb.view(), ckb.view(), cvb.view(), pb.view()), (ob.view(),), T, nh * hd,
                               params={"n_heads": nh, "n_kv_heads": nkv, "head_dim": hd, "n_ctx": n_ctx}))
        got = ob.numpy(np.float32)[:T * nh * hd].reshape(T, nh, hd)
        assert np.abs(got - attention_ref(q, ck, cv, pos0, nkv)).max() <= bound, (T, pos0)
        bufs.append(cpu_step._masks[(T, n_ctx)][0])
    assert bufs[0] is bufs[2] and bufs[1] is not bufs[0]  # (one buffer per shape, shared)


def test_default_threads_within_the_cgroup_cpu_quota(device, tmp_path, monkeypatch):
    """A container limited by a CPU quota (docker --cpus: cgroup v2 cpu.max, v1 cfs_quota_us)
    sees every host CPU in its affinity: the default thread count stays within the quota (ggml's
    threads spin at barriers, so threads beyond it stall one another). The quota is read from
    this process's cgroup and its ancestors, the tightest one counting."""
    from vkxsplit.backends import cpu as cpu_mod

    v2 = tmp_path / "v2"
    (v2 / "ctr" / "job").mkdir(parents=True)
    (v2 / "ctr" / "cpu.max").write_text("150000 100000\n")
    (v2 / "ctr" / "job" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cg2").write_text("0::/ctr/job\n")
    assert cpu_mod.cgroup_cpu_limit(str(v2), str(tmp_path / "cg2")) == pytest.approx(1.5)
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "x").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cg1").write_text("4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n1:name=systemd:/\n")
    assert cpu_mod.cgroup_cpu_limit(str(v1), str(tmp_path / "cg1")) == pytest.approx(3.0)
    (tmp_path / "cg0").write_text("0::/\n")
    assert cpu_mod.cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "cg0")) is None

    monkeypatch.setattr(ggml_cpu, "physical_cores", lambda: 16)
    monkeypatch.setattr(cpu_mod, "busy_cores", lambda sample_s=0.2: 0.0)
    monkeypatch.setattr(cpu_mod, "cgroup_cpu_limit", lambda *a: 2.5)
    assert cpu_mod.default_threads(None) == 2
    assert cpu_mod.default_threads(None, step=True) == 2
    monkeypatch.setattr(cpu_mod, "cgroup_cpu_limit", lambda *a: 0.5)
    assert cpu_mod.default_threads(None, step=True) == 1
    monkeypatch.setattr(cpu_mod, "cgroup_cpu_limit", lambda *a: None)
    assert cpu_mod.default_threads(None) == 16
    # under a quota the busy cores are the host's: 16 cores, 10 busy, a quota of 4 -> 4 threads
    monkeypatch.setattr(cpu_mod, "cgroup_cpu_limit", lambda *a: 4.0)
    monkeypatch.setattr(cpu_mod, "busy_cores", lambda sample_s=0.2: 10.0)
    assert cpu_mod.default_threads(None, step=True) == 4
    monkeypatch.setattr(cpu_mod, "busy_cores", lambda sample_s=0.2: 14.0)
    assert cpu_mod.default_threads(None, step=True) == 2


def test_no_job_runs_after_release(device, rng):
    """close() joins the bridge thread for a bounded time, then frees the graphs and the thread
    pools; a job the thread takes after that (a long queue) is refused with a clear error, not
    run on freed pools over memory the closing model unmaps."""
    from vkxsplit.errors import VkxError

    b = create_backend("cpu", device, threads=1, timeout=WAIT_S)
    arena = SharedArena(device, [b], name="ggml-release-test")
    try:
        w, _ = make_weight(rng, "q8_0", 8, 32)
        wb, xb, y = put(arena, w), put(arena, np.ones((1, 32), np.float32)), arena.alloc(32)
        job = MatMulJob(wb.view(), "q8_0", xb.view(), y.view(), 1, 8, 32)
        b._run(job)  # (as the bridge thread runs it)
        b.release()
        y.numpy(np.float32)[:] = 7
        with pytest.raises(VkxError, match="closed"):
            b._run(job)
        assert (y.numpy(np.float32)[:8] == 7).all()
    finally:
        b.close()
        arena.close()


@pytest.mark.parametrize("case", ["qwen3", "gemma3-pattern", "gemma3-h256", "phi3-long"])
def test_whole_step_on_cpu_other_architectures(device, tmp_path, case):
    """``mode:cpu`` with ``cpu:step=1`` for the architectures beyond llama: qwen3's per-head Q/K
    norms, gemma3's window layers (their attention kept on the hub: the cpu backend's has no
    window), embedding scale, post-norms, GeGLU and soft cap, phi3's long RoPE factors and
    attention factor; prefill in ubatches of 8 and decode against the float64 reference of
    tests/test_archs.py (its wrong variants fail the same check there)."""
    if not device.is_cpu:
        pytest.skip("the state is shared with the cpu backend beside a CPU hub only")
    from reference import reference_forward_arch
    from test_archs import CASES, REL_BOUND, check, run_logits, write_arch

    from vkxsplit.gguf_model import load_model as load_gguf

    arch, opts, n_ctx, n_tok, _wrongs = CASES[case]
    path = write_arch(tmp_path / f"{case}.gguf", arch, **opts)
    ids = [int(i) for i in np.random.default_rng(7).integers(0, opts.get("n_vocab", 64), n_tok)]
    with load_gguf(path) as mf:
        want = reference_forward_arch(mf, ids, n_ctx=n_ctx)
    for ub in (8, 1):  # (f32/f16 weights: ggml keeps x in f32; the f16 cache and FA's f16 q/V sums)
        got = run_logits(device, path, ids, n_ctx, ub, split="mode:cpu", backends="cpu:step=1")
        assert check(got, want, 2 * REL_BOUND) is None, (ub, check(got, want, 2 * REL_BOUND))
