"""Attached backends computing on the hub's memory: cpu, npu-emu (a separate process), cuda
(skipped without CUDA). Chains are submitted in one go; the caller never waits in between."""

from __future__ import annotations

import os
import signal
import time

import ml_dtypes
import numpy as np
import pytest
from conftest import WAIT_S
from gguf import quants
from gguf.constants import GGMLQuantizationType
from test_cpu_ggml import ggml_bound

from vkxsplit.attach import SharedArena, stats
from vkxsplit.backend import MatMulJob, create_backend
from vkxsplit.errors import BackendDied, KernelError, WaitTimeout
from vkxsplit.ops.convert import record_convert
from vkxsplit.vk.command import Sequence
from vkxsplit.vk.event import Timeline

TIMEOUT = WAIT_S  # (conftest: first dispatches compile inside the wait on lavapipe)


@pytest.fixture(scope="module")
def cpu(device):
    b = create_backend("cpu", device, timeout=TIMEOUT)
    yield b
    b.close()


@pytest.fixture(scope="module")
def npu(device):
    b = create_backend("npu-emu", device, timeout=TIMEOUT, gflops=50.0, min_batch=8, max_kernels=6)
    yield b
    b.close()


@pytest.fixture
def arena(device, cpu, npu):
    a = SharedArena(device, [cpu, npu], name="test")
    yield a
    a.close()


def put(arena, a, name=""):
    a = np.ascontiguousarray(a)
    sb = arena.alloc(a.nbytes, name)
    sb.numpy(np.uint8)[:] = a.view(np.uint8).ravel()
    return sb


def bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def f32_bound(x, w):
    """|error| allowed for an f32-accumulated product of exact inputs (K terms)."""
    K = x.shape[1]
    return 4 * K * 2.0**-24 * (np.abs(x) @ np.abs(w).T) + 1e-30


# --------------------------------------------------------------------------------------------
# single backends


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k"])
def test_cpu_mul_mat_zero_copy(device, cpu, arena, seqs, rng, wtype):
    M, N, K = 3, 40, 256
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    t = GGMLQuantizationType[wtype.upper()]
    if wtype == "q4_k":  # gguf cannot quantize K-quants: random valid blocks (f16 d, dmin first)
        wq = rng.integers(0, 256, (N, K // 256 * 144), dtype=np.uint8)
        scales = wq.reshape(N, -1, 144)[:, :, :4].view(np.float16)
        scales[:] = rng.uniform(0.001, 0.02, scales.shape).astype(np.float16)
    else:
        wq = quants.quantize(w, t)
    wd = quants.dequantize(wq, t).astype(np.float64)
    xs, ys = K + 8, N + 5  # strided rows
    xb = put(arena, np.pad(x, ((0, 0), (0, 8))))
    wb = put(arena, wq)
    y = arena.alloc(M * ys * 4)
    y.numpy(np.float32)[:] = np.nan
    staged0, built0 = stats.staged_bytes, cpu.graphs_built
    for _rep in range(2):  # the second run replays the job's cached ggml graph
        p = cpu.next_point()
        cpu.mul_mat(MatMulJob(wb.view(), wtype, xb.view(), y.view(), M, N, K, x_stride=xs, y_stride=ys),
                    wait=None, signal=p)
        cpu.wait(p)
    got = y.numpy(np.float32).reshape(M, ys)
    ref = x.astype(np.float64) @ wd.T
    assert np.all(np.abs(got[:, :N] - ref) <= ggml_bound(x, wd, wtype))  # ggml rounds x to the dot type
    assert np.isnan(got[:, N:]).all()  # nothing outside the job's columns
    assert stats.staged_bytes == staged0 == 0
    assert cpu.graphs_built == built0 + 1


def test_npu_emu_mul_mat_bf16(device, npu, arena, seqs, rng):
    M, N, K = 8, 48, 96
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xf, wf = put(arena, x), put(arena, w)
    xb, wb = arena.alloc(M * K * 2), arena.alloc(N * K * 2)
    y = arena.alloc(M * N * 4)
    y.numpy(np.float32)[:] = np.nan
    s = seqs("to-bf16")
    record_convert(s, wf.view(), wb.view(), N * K, "f32", "bf16")
    record_convert(s, xf.view(), xb.view(), M * K, "f32", "bf16")
    v = s.submit()
    p = npu.next_point()
    npu.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16"), (s.timeline, v), p)
    npu.wait(p)
    xr, wr = bf16(x), bf16(w)
    ref = xr @ wr.T
    assert np.all(np.abs(y.numpy(np.float32).reshape(M, N) - ref) <= f32_bound(xr, wr))
    assert stats.staged_bytes == 0
    assert npu.supports("mul_mat", "bf16", 8) and not npu.supports("mul_mat", "bf16", 4)
    assert not npu.supports("mul_mat", "f32", 8)
    with pytest.raises(KernelError, match="computes in bf16"):
        npu.mul_mat(MatMulJob(wb.view(), "bf16", xf.view(), y.view(), M, N, K), None, npu.next_point())
    wb.close()  # drops the resident kernel
    assert npu.resident_kernels == 0


# --------------------------------------------------------------------------------------------
# chains


def test_chain_hub_cpu_hub_npu_hub_without_caller_waits(device, cpu, npu, arena, seqs, rng, caller_waits):
    M, K, N1, N2 = 8, 64, 48, 32
    x = rng.standard_normal((M, K)).astype(np.float32)
    w1 = rng.standard_normal((N1, K)).astype(np.float32)
    w2 = rng.standard_normal((N2, N1)).astype(np.float32)
    w1q = quants.quantize(w1, GGMLQuantizationType.Q8_0)
    x_in, xa = put(arena, x), arena.alloc(x.nbytes)
    w1b = put(arena, w1q)
    y1, y1b = arena.alloc(M * N1 * 4), arena.alloc(M * N1 * 2)
    w2f, w2b = put(arena, w2), arena.alloc(N2 * N1 * 2)
    y2, out = arena.alloc(M * N2 * 4), arena.alloc(M * N2 * 4)
    out.numpy(np.float32)[:] = np.nan
    prep = seqs("weights")
    record_convert(prep, w2f.view(), w2b.view(), N2 * N1, "f32", "bf16")  # once, at load time
    prep.run()
    s1, s2, s3 = seqs("hub1"), seqs("hub2"), seqs("hub3")
    record_convert(s1, x_in.view(), xa.view(), M * K, "f32", "f32")
    record_convert(s2, y1.view(), y1b.view(), M * N1, "f32", "bf16")
    record_convert(s3, y2.view(), out.view(), M * N2, "f32", "f32")
    job1 = MatMulJob(w1b.view(), "q8_0", xa.view(), y1.view(), M, N1, K)
    job2 = MatMulJob(w2b.view(), "bf16", y1b.view(), y2.view(), M, N2, N1, x_type="bf16")

    caller_waits.clear()
    stats.begin_step()
    t0 = time.monotonic()
    v1 = s1.submit()
    pc = cpu.next_point()
    cpu.mul_mat(job1, (s1.timeline, v1), pc)
    v2 = s2.submit(waits=[pc])
    pn = npu.next_point()
    npu.mul_mat(job2, (s2.timeline, v2), pn)
    v3 = s3.submit(waits=[pn])
    submitted = time.monotonic() - t0
    assert stats.host_waits_in_step == 0
    assert caller_waits == []
    assert submitted < 1.0
    # collect
    s3.wait(TIMEOUT)
    cpu.check()
    npu.check()
    assert s1.timeline.value >= v3
    w1d = quants.dequantize(w1q, GGMLQuantizationType.Q8_0).astype(np.float64)
    y1_got = y1.numpy(np.float32).reshape(M, N1)
    assert np.all(np.abs(y1_got - x.astype(np.float64) @ w1d.T) <= ggml_bound(x, w1d, "q8_0"))  # x rounded to q8_0
    a, b = bf16(y1_got), bf16(w2)
    assert np.all(np.abs(out.numpy(np.float32).reshape(M, N2) - a @ b.T) <= f32_bound(a, b))
    assert stats.staged_bytes == 0
    w2b.close()


def test_chain_submission_returns_before_the_work_runs(device, npu, arena, seqs, rng):
    """The npu part takes ~0.3 s (throughput emulation); submitting the chain does not."""
    M, N, K = 8, 64, 64
    slow = create_backend("npu-emu", device, timeout=TIMEOUT, gflops=2 * M * N * K / 0.3e9)
    try:
        xb, wb = arena.alloc(M * K * 2), arena.alloc(N * K * 2)
        xb.numpy(np.uint16)[:] = 0x3F80  # 1.0
        wb.numpy(np.uint16)[:] = 0x4000  # 2.0
        y, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4)
        s1, s2 = seqs("a"), seqs("b")
        record_convert(s1, xb.view(), xb.view(0, 16), 1, "bf16", "bf16")
        record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
        t0 = time.monotonic()
        v1 = s1.submit()
        p = slow.next_point()
        slow.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16"),
                     (s1.timeline, v1), p)
        v2 = s2.submit(waits=[p])
        assert time.monotonic() - t0 < 0.25
        assert s2.timeline.value < v2
        s2.wait(TIMEOUT)
        assert time.monotonic() - t0 >= 0.25
        slow.check()
        np.testing.assert_array_equal(out.numpy(np.float32), 2.0 * K)
    finally:
        slow.close()


def test_tensor_split_cpu_and_npu_write_one_y(device, cpu, npu, arena, seqs, rng, caller_waits):
    M, N, K, r = 8, 72, 64, 40
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xf, wf = put(arena, x), put(arena, w)
    xb = arena.alloc(M * K * 2)
    wslice = arena.alloc((N - r) * K * 2)  # the npu holds only its rows [r, N)
    y, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4)
    y.numpy(np.float32)[:] = np.nan
    s0, s1, s2 = seqs("load"), seqs("split-in"), seqs("split-out")
    record_convert(s0, wf.view(), wslice.view(), (N - r) * K, "f32", "bf16", src_offset=r * K)
    s0.run()
    record_convert(s1, xf.view(), xb.view(), M * K, "f32", "bf16")
    record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
    caller_waits.clear()
    stats.begin_step()
    v1 = s1.submit()
    pc, pn = cpu.next_point(), npu.next_point()
    cpu.mul_mat(MatMulJob(wf.view(), "f32", xf.view(), y.view(), M, N, K, r0=0, r1=r), (s1.timeline, v1), pc)
    npu.mul_mat(MatMulJob(wslice.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16", r0=r, r1=N,
                          w_row0=r), (s1.timeline, v1), pn)
    s2.submit(waits=[pc, pn])
    assert stats.host_waits_in_step == 0 and caller_waits == []
    s2.wait(TIMEOUT)
    cpu.check()
    npu.check()
    got = out.numpy(np.float32).reshape(M, N)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    assert np.all(np.abs(got[:, :r] - x64 @ w64[:r].T) <= f32_bound(x, w[:r]))
    xr, wr = bf16(x), bf16(w[r:])
    assert np.all(np.abs(got[:, r:] - xr @ wr.T) <= f32_bound(xr, wr))
    wslice.close()


def test_tensor_split_three_ways_with_the_hub(device, cpu, npu, arena, seqs, rng):
    mm = pytest.importorskip("vkxsplit.ops.mul_mat")
    M, N, K, a, b = 8, 96, 64, 32, 64
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xf, wf = put(arena, x), put(arena, w)
    xb, wslice = arena.alloc(M * K * 2), arena.alloc((b - a) * K * 2)
    y = arena.alloc(M * N * 4)
    y.numpy(np.float32)[:] = np.nan
    s1, s2 = seqs("split3"), seqs("after")
    record_convert(s1, wf.view(), wslice.view(), (b - a) * K, "f32", "bf16", src_offset=a * K)
    record_convert(s1, xf.view(), xb.view(), M * K, "f32", "bf16")
    mm.record_mul_mat(s1, wf.view(), "f32", xf.view(), y.view(), M, N - b, K, y_stride=N, w_row_offset=b)
    record_convert(s2, xf.view(), xf.view(0, 16), 1, "f32", "f32")
    v1 = s1.submit()
    pc, pn = cpu.next_point(), npu.next_point()
    cpu.mul_mat(MatMulJob(wf.view(), "f32", xf.view(), y.view(), M, N, K, r0=0, r1=a), (s1.timeline, v1), pc)
    npu.mul_mat(MatMulJob(wslice.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16", r0=a, r1=b,
                          w_row0=a), (s1.timeline, v1), pn)
    s2.submit(waits=[pc, pn])
    s2.wait(TIMEOUT)
    cpu.check()
    npu.check()
    got = y.numpy(np.float32).reshape(M, N)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    assert np.all(np.abs(got[:, :a] - x64 @ w64[:a].T) <= f32_bound(x, w[:a]))
    xr, wr = bf16(x), bf16(w[a:b])
    assert np.all(np.abs(got[:, a:b] - xr @ wr.T) <= f32_bound(xr, wr))
    np.testing.assert_allclose(got[:, b:], x64 @ w64[b:].T, rtol=1e-3, atol=1e-3)  # hub: own bounds
    wslice.close()


def test_npu_emu_process_unmaps_freed_memory(device, npu):
    """Freed shared memory is unmapped in the npu-emu process too (nothing lingers there)."""

    def mappings():
        with open(f"/proc/{npu.pid}/maps") as f:
            return sum("memfd:vkxsplit-" in line for line in f)

    def step(bufs):
        w, x, y = bufs
        p = npu.next_point()
        npu.mul_mat(MatMulJob(w.view(), "bf16", x.view(), y.view(), 8, 8, 32, x_type="bf16"), None, p)
        return p

    arena = SharedArena(device, [npu], chunk_size=64 << 10, name="unmap")
    try:
        # memfds of earlier tests may still be unmapping in the process: count from a flush
        npu.wait(step([arena.alloc(8 * 32 * 2), arena.alloc(8 * 32 * 2), arena.alloc(8 * 8 * 4)]))
        base = mappings()
        w = arena.alloc(8 * 32 * 2)
        bufs = [w]
        for _ in range(40):
            x, y = arena.alloc(40 << 10), arena.alloc(40 << 10)  # a dedicated chunk each
            bufs += [x, y]
            p = step((w, x, y))
        npu.wait(p)
        assert mappings() >= base + 80
        for b in bufs:
            b.close()
        flush = [arena.alloc(8 * 32 * 2), arena.alloc(8 * 32 * 2), arena.alloc(8 * 8 * 4)]
        npu.wait(step(flush))  # answered after the process handled every unmap queued before it
        assert mappings() <= base + 1  # the 80 dedicated chunks are gone (the flush chunk may stay)
    finally:
        arena.close()
    assert npu.resident_kernels == 0


# --------------------------------------------------------------------------------------------
# failures


def test_kill_npu_emu_mid_step(device, arena, seqs, rng):
    M, N, K = 8, 32, 64
    timeout = 5.0
    npu = create_backend("npu-emu", device, timeout=timeout, gflops=1e-6)  # ~30 s per job
    try:
        xb, wb = arena.alloc(M * K * 2), arena.alloc(N * K * 2)
        y, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4)
        s1, s3 = seqs("before"), seqs("after")
        record_convert(s1, xb.view(), xb.view(0, 16), 1, "bf16", "bf16")
        record_convert(s3, y.view(), out.view(), M * N, "f32", "f32")
        v1 = s1.submit()
        p = npu.next_point()
        npu.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16"),
                    (s1.timeline, v1), p)
        v3 = s3.submit(waits=[p])
        s1.wait(TIMEOUT)
        time.sleep(0.2)  # the job is in the process now
        assert s3.timeline.value < v3
        t0 = time.monotonic()
        os.kill(npu.pid, signal.SIGKILL)
        s3.wait(timeout)  # the hub queue is released...
        assert time.monotonic() - t0 < timeout
        with pytest.raises(BackendDied, match="npu-emu"):  # ...and the step reports the death
            npu.check()
        with pytest.raises(BackendDied):
            npu.check()  # sticky
        # later work for the dead backend never blocks the hub either
        p2 = npu.next_point()
        npu.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16"), None, p2)
        s3.submit(waits=[p2])
        s3.wait(timeout)
        # the hub is fine: a hub-only sequence runs and is right
        src = put(arena, rng.standard_normal(1000).astype(np.float32))
        dst = arena.alloc(1000 * 2)
        s4 = seqs("hub-only")
        record_convert(s4, src.view(), dst.view(), 1000, "f32", "bf16")
        s4.run(TIMEOUT)
        np.testing.assert_array_equal(dst.numpy(np.uint16),
                                      src.numpy(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    finally:
        npu.close()


def test_backend_wait_timeout_does_not_hang_the_hub(device, arena, seqs):
    cpu = create_backend("cpu", device, timeout=0.3)
    try:
        never = Timeline(device, name="never")
        M, N, K = 2, 8, 32
        xb, wb, y = arena.alloc(M * K * 4), arena.alloc(N * K * 4), arena.alloc(M * N * 4)
        s = seqs("waits-on-cpu")
        record_convert(s, y.view(), y.view(0, 16), 1, "f32", "f32")
        p = cpu.next_point()
        t0 = time.monotonic()
        cpu.mul_mat(MatMulJob(wb.view(), "f32", xb.view(), y.view(), M, N, K), (never, 1), p)
        s.submit(waits=[p])
        s.wait(TIMEOUT)
        assert 0.25 < time.monotonic() - t0 < 5
        with pytest.raises(WaitTimeout, match="never"):
            cpu.check()
        with pytest.raises(WaitTimeout):  # the caller's own collection wait times out too
            cpu.wait((never, 1), timeout=0.1)
    finally:
        cpu.close()


def test_npu_emu_kernel_cap(device, npu, arena, rng):
    M, K = 8, 32
    xb = arena.alloc(M * K * 2)
    y = arena.alloc(M * 64 * 4)
    weights = [arena.alloc((8 + i) * K * 2, f"w{i}") for i in range(7)]
    try:
        for w in weights[:6]:
            n = w.size // (2 * K)
            p = npu.next_point()
            npu.mul_mat(MatMulJob(w.view(), "bf16", xb.view(), y.view(), M, n, K, x_type="bf16"), None, p)
        npu.wait(p)
        assert npu.resident_kernels == 6
        refused = npu.next_point()
        with pytest.raises(KernelError, match=r"kernel #7 .*at most 6 resident kernels"):
            npu.mul_mat(MatMulJob(weights[6].view(), "bf16", xb.view(), y.view(), M, 14, K, x_type="bf16"),
                        None, refused)
        npu.wait(refused, timeout=5)  # a refused job's point is still signalled (nothing stranded)
        npu.check()  # and nothing failed asynchronously
        npu.unload(weights[0].view())
        p = npu.next_point()
        npu.mul_mat(MatMulJob(weights[6].view(), "bf16", xb.view(), y.view(), M, 14, K, x_type="bf16"), None, p)
        npu.wait(p)  # the process agrees: the unload reached it before the 7th load
    finally:
        for w in weights:
            w.close()
    assert npu.resident_kernels == 0


def test_staged_fallback_is_counted_and_correct(device, cpu, npu, seqs, rng):
    stats.reset()
    arena = SharedArena(device, [cpu, npu], force="staged")
    try:
        assert arena.kind == "staged"
        M, N, K = 8, 16, 32
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        xf, wf = put(arena, x), put(arena, w)
        xb, wb = arena.alloc(M * K * 2), arena.alloc(N * K * 2)
        y = arena.alloc(M * N * 4)
        y.numpy(np.float32)[:] = np.nan
        s = seqs("stage")
        record_convert(s, xf.view(), xb.view(), M * K, "f32", "bf16")
        record_convert(s, wf.view(), wb.view(), N * K, "f32", "bf16")
        v = s.submit()
        pc, pn = cpu.next_point(), npu.next_point()
        cpu.mul_mat(MatMulJob(wf.view(), "f32", xf.view(), y.view(), M, N, K, r1=8), (s.timeline, v), pc)
        npu.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16", r0=8),
                    (s.timeline, v), pn)
        cpu.wait(pc)
        npu.wait(pn)
        got = y.numpy(np.float32).reshape(M, N)
        assert np.all(np.abs(got[:, :8] - x.astype(np.float64) @ w[:8].T.astype(np.float64))
                      <= f32_bound(x, w[:8]))
        xr, wr = bf16(x), bf16(w[8:])
        assert np.all(np.abs(got[:, 8:] - xr @ wr.T) <= f32_bound(xr, wr))
        assert stats.staged_bytes > 0 and stats.staged_copies > 0
        assert arena.staged_bytes == stats.staged_bytes
        assert any("forced" in r for r in stats.staged_reasons)
        wb.close()
    finally:
        arena.close()
        stats.reset()


# --------------------------------------------------------------------------------------------
# cuda (runs only where CUDA is available; written for an H200)


def _cuda_or_skip():
    from vkxsplit.backends import cuda

    avail = cuda.available()
    if not avail:
        pytest.skip(f"cuda backend unavailable: {avail.reason}")


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_cuda_mul_mat_chain(device, seqs, rng, wtype, caller_waits):
    _cuda_or_skip()
    gpu = create_backend("cuda", device, timeout=TIMEOUT)
    arena = SharedArena(device, [gpu])
    try:
        assert arena.kind == "opaque_fd", arena.choice.describe()
        M, N, K, r = 16, 96, 256, 40
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32)
        t = GGMLQuantizationType[wtype.upper()]
        wq = quants.quantize(w, t)
        wd = quants.dequantize(wq, t).astype(np.float64)
        x_in, xa, wb = arena.alloc(x.nbytes), arena.alloc(x.nbytes), arena.alloc(wq.nbytes)
        y, out = arena.alloc(M * N * 4), arena.alloc(M * N * 4)
        x_in.buffer.write(x)
        wb.buffer.write(wq)
        s1, s2 = seqs("cuda-in"), seqs("cuda-out")
        record_convert(s1, x_in.view(), xa.view(), M * K, "f32", "f32")
        record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
        caller_waits.clear()
        stats.begin_step()
        job = MatMulJob(wb.view(), wtype, xa.view(), y.view(), M, N, K, r0=r)
        for rep in range(3):  # a new job (prepared), the same job again (replayed), a new equal one
            v1 = s1.submit()
            p = gpu.next_point()
            if rep == 2:
                job = MatMulJob(wb.view(), wtype, xa.view(), y.view(), M, N, K, r0=r)
            gpu.mul_mat(job, (s1.timeline, v1), p)
            v2 = s2.submit(waits=[p])
        assert stats.host_waits_in_step == 0 and caller_waits == []
        s2.wait(TIMEOUT)
        gpu.check()
        assert s2.timeline.value >= v2
        got = out.buffer.read(np.float32).reshape(M, N)[:, r:]
        ref = x.astype(np.float64) @ wd[r:].T
        rel = {"f32": 1e-4, "bf16": 1e-2, "f16": 2e-3, "q8_0": 2e-3, "q4_0": 2e-3}[wtype]
        scale = np.abs(x) @ np.abs(wd[r:]).T
        assert np.all(np.abs(got - ref) <= rel * scale + 1e-4)
    finally:
        gpu.close()
        arena.close()


# --------------------------------------------------------------------------------------------
# NODE_OPS through run_op (norms, SwiGLU, add): cpu here, cuda where CUDA is


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_node_ops_through_run_op(device, rng, name, caller_waits):
    """rms_norm, add_rms_norm (x += res in place), swiglu (in place), add (row and broadcast)
    on the backend's stream against float64, queued back to back behind one hub point."""
    from vkxsplit.backend import OpJob

    if name == "cuda":
        _cuda_or_skip()
    b = create_backend(name, device, timeout=TIMEOUT)
    arena = SharedArena(device, [b])
    try:
        R, C, eps = 5, 300, 1e-5
        x, res, g, u = (rng.standard_normal((R, C)).astype(np.float32) for _ in range(4))
        w, brow = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
        bufs = {}
        for k, a in (("x", x), ("res", res), ("w", w), ("g", g), ("u", u), ("brow", brow), ("x2", x)):
            bufs[k] = arena.alloc(a.nbytes, k)
            bufs[k].buffer.write(a)
        for k in ("n1", "n2"):
            bufs[k] = arena.alloc(R * C * 4, k)
            bufs[k].buffer.write(np.full(R * C, np.nan, np.float32))
        v = {k: sb.view() for k, sb in bufs.items()}
        jobs = [OpJob("rms_norm", (v["x2"], v["w"]), (v["n1"],), R, C, eps=eps),
                OpJob("add_rms_norm", (v["x"], v["res"], v["w"]), (v["n2"], v["x"]), R, C, eps=eps),
                OpJob("swiglu", (v["g"], v["u"]), (v["g"],), R, C),
                OpJob("add", (v["x2"], v["brow"]), (v["x2"],), R, C, b_rows=1)]
        s1 = Sequence(device, "ops-in")
        s1.end()
        caller_waits.clear()
        v1 = s1.submit()
        p = None
        for job in jobs:
            p = b.next_point()
            b.run_op(job.op, job, (s1.timeline, v1), p)
        assert caller_waits == []
        b.wait(p, TIMEOUT)
        s1.close()

        def got(k):
            return bufs[k].buffer.read(np.float32)[:R * C].reshape(R, C).astype(np.float64)

        X, Rs, W = x.astype(np.float64), res.astype(np.float64), w.astype(np.float64)

        def norm(a):
            return a / np.sqrt(np.mean(a * a, axis=1, keepdims=True) + eps) * W

        G, U = g.astype(np.float64), u.astype(np.float64)
        tol = 1e-5
        np.testing.assert_allclose(got("n1"), norm(X), rtol=tol, atol=tol)
        np.testing.assert_allclose(got("x"), X + Rs, rtol=tol, atol=tol)
        np.testing.assert_allclose(got("n2"), norm(X + Rs), rtol=tol, atol=tol)
        np.testing.assert_allclose(got("g"), G / (1 + np.exp(-G)) * U, rtol=tol, atol=tol)
        np.testing.assert_allclose(got("x2"), X + brow.astype(np.float64), rtol=tol, atol=tol)
        with pytest.raises(KernelError, match="does not run op"):
            b.run_op("rope", jobs[0], None, b.next_point())
    finally:
        b.close()
        arena.close()


def test_close_retires_the_backend_timeline(device):
    """A closed backend's stream timeline is destroyed (each one held a driver fd on the
    H200): at close when nothing can use it any more, else at the next retire once queued hub
    work that waits on it has run. The validation layer fails the test on a semaphore destroyed
    while a submission still uses it."""
    from vkxsplit.backend import retire_timeline

    b = create_backend("cpu", device, timeout=TIMEOUT)
    tl = b.timeline
    b.next_point()  # handed out, never enqueued: close() signals it
    b.close()
    assert tl.handle is None
    b2 = create_backend("cpu", device, timeout=TIMEOUT)
    tl2 = b2.timeline
    gate = Timeline(device, name="gate")
    s = Sequence(device, "waits-on-backend")
    try:
        s.end()
        p = b2.next_point()
        s.submit(waits=[(gate, 1), p])  # hub work naming the backend's timeline, held by the gate
        b2.close()  # signals p; the submission is still queued behind the gate
        assert tl2.handle is not None, "destroyed while a queued submission waits on it"
        gate.signal(1)
        s.wait(TIMEOUT)
        retire_timeline(device, None)
        assert tl2.handle is None
    finally:
        s.close()
        gate.close()
