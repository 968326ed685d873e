"""Shared memory, handle negotiation, host bridge and the backend interface (vkxsplit.attach,
vkxsplit.backend). Backends with real compute are in test_backends.py."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import numpy as np
import pytest

from vkxsplit.attach import (
    MEMORY_HANDLES,
    HostBridge,
    SharedArena,
    SyncFdBridge,
    host_wait,
    hub_event_support,
    hub_memory_support,
    negotiate,
    negotiate_events,
    negotiate_memory,
    relay,
    stats,
)
from vkxsplit.backend import (
    HOOKS,
    Backend,
    Capabilities,
    MatMulJob,
    available_backends,
    backend_availability,
    create_backend,
)
from vkxsplit.errors import BackendDied, EnvironmentProblem, KernelError, VkxError, WaitTimeout
from vkxsplit.vk.event import Timeline
from vkxsplit.vk.memory import HANDLE_DMA_BUF


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------------------------
# negotiation


ALL_OK = {"dma_buf": None, "opaque_fd": None, "host_allocation": None}
CPU = ("dma_buf", "host_allocation")
CUDA = ("opaque_fd", "host_allocation")


def test_memory_negotiation_order_and_reasons():
    assert negotiate_memory(None, [CPU], ALL_OK).kind == "dma_buf"
    no_dmabuf = {**ALL_OK, "dma_buf": "no dma-buf allocator"}
    c = negotiate_memory(None, [CPU], no_dmabuf)
    assert c.kind == "host_allocation"
    assert c.rejected == (("dma_buf", "no dma-buf allocator"),)
    assert "no dma-buf allocator" in c.describe()
    # a GPU backend gets the opaque fd; a pair of CPU + GPU meets on host memory
    assert negotiate_memory(None, [CUDA], ALL_OK).kind == "opaque_fd"
    pair = negotiate_memory(None, [CUDA, CPU], ALL_OK)
    assert pair.kind == "host_allocation"
    assert pair.rejected[0][0] == "opaque_fd" and "backend #1" in pair.rejected[0][1]
    # nothing shared: staged copies, with every reason kept
    none = {k: f"{k} missing" for k in MEMORY_HANDLES}
    s = negotiate_memory(None, [CPU], none)
    assert s.kind == "staged" and [k for k, _ in s.rejected] == ["dma_buf", "host_allocation"]
    assert negotiate_memory(None, [()], ALL_OK).kind == "staged"
    with pytest.raises(VkxError, match="dmabuf"):
        negotiate_memory(None, [("dmabuf",)], ALL_OK)


def test_event_negotiation():
    ok = {"timeline_opaque_fd": None, "sync_fd": None, "host": None}
    assert negotiate_events(None, ("timeline_opaque_fd", "host"), ok).kind == "timeline_opaque_fd"
    assert negotiate_events(None, ("sync_fd", "host"), ok).kind == "sync_fd"
    c = negotiate_events(None, ("timeline_opaque_fd", "sync_fd", "host"),
                         {**ok, "timeline_opaque_fd": "no export", "sync_fd": "no sync fd"})
    assert c.kind == "host" and dict(c.rejected) == {"timeline_opaque_fd": "no export", "sync_fd": "no sync fd"}
    assert negotiate(([],), {}, ("a",), "host").kind == "host"


def test_hub_support_on_this_device(device):
    mem = hub_memory_support(device)
    ev = hub_event_support(device)
    assert set(mem) == set(MEMORY_HANDLES)
    assert ev["host"] is None
    if "VK_EXT_external_memory_dma_buf" not in device.extensions:
        assert "VK_EXT_external_memory_dma_buf" in mem["dma_buf"]
    if "VK_EXT_external_memory_host" in device.extensions:
        assert mem["host_allocation"] is None
    if device.physical.is_lavapipe:  # what the development machine reports (docs/ATTACH.md)
        assert mem["opaque_fd"] is None and mem["host_allocation"] is None
        assert ev["timeline_opaque_fd"] is not None and ev["sync_fd"] is not None
        c = negotiate_events(device, ("timeline_opaque_fd", "sync_fd", "host"))
        assert c.kind == "host" and [k for k, _ in c.rejected] == ["timeline_opaque_fd", "sync_fd"]


def test_sync_fd_bridge_needs_device_support(device):
    why = hub_event_support(device)["sync_fd"]
    if why is None:
        pytest.skip("this device supports SYNC_FD semaphores; the bridge is constructible")
    with pytest.raises(EnvironmentProblem, match="sync_file bridging is unavailable"):
        SyncFdBridge(device)


def test_dmabuf_arena_error_paths(device):
    why = hub_memory_support(device)["dma_buf"]
    if why is None:
        pytest.skip("dma-buf import works here")
    with pytest.raises(VkxError, match="cannot force memory handle 'dma_buf'"):
        SharedArena(device, wants=[("dma_buf",)], force="dma_buf")
    arena = SharedArena(device, wants=[("dma_buf",)])
    assert arena.kind == "staged" and arena.choice.rejected[0] == ("dma_buf", why)


# --------------------------------------------------------------------------------------------
# shared memory


def test_host_allocation_buffer_is_hub_bindable_and_zero_copy(device, seq, rng):
    from vkxsplit.ops.convert import record_convert

    arena = SharedArena(device, wants=[("host_allocation",)])
    assert arena.kind == "host_allocation"
    a = arena.alloc(4000 * 4, "a")
    b = arena.alloc(4000 * 4, "b")
    try:
        # the backend side is a sealed memfd that cannot shrink or grow under the mapping
        seals = fcntl.fcntl(a.chunk.fd.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert os.readlink(f"/proc/self/fd/{a.chunk.fd.fd}").startswith("/memfd:")
        x = rng.standard_normal(4000).astype(np.float32)
        a.numpy(np.float32)[:] = x
        b.numpy(np.float32)[:] = np.nan
        record_convert(seq, a.view(), b.view(0, 2000 * 4), 2000, "f32", "f32")
        record_convert(seq, a.buffer, b.view(2000 * 4), 2000, "f32", "f32", src_offset=2000)
        seq.run()
        # the hub wrote through its buffer; the backend's mapping sees it without a copy
        np.testing.assert_array_equal(b.view().backend_array(np.float32), x)
        np.testing.assert_array_equal(b.buffer.numpy(np.float32), x)
    finally:
        a.close()
        b.close()
    assert arena.live == 0


def test_thousands_of_shared_buffers_do_not_leak(device, rng):
    alloc = device.memory
    fds0, bytes0, live0 = open_fds(), alloc.allocated_bytes, alloc.live_buffers
    arena = SharedArena(device, wants=[("host_allocation",)], chunk_size=256 << 10)
    staged = SharedArena(device, force="staged")
    live = []
    n = 0
    for i in range(3000):
        size = int(rng.integers(4, 96 << 10)) if i % 10 else int(rng.integers(200 << 10, 600 << 10))
        live.append((staged if i % 37 == 0 else arena).alloc(size))
        n += 1
        if len(live) > 40 or rng.random() < 0.3:
            for j in sorted(rng.choice(len(live), size=min(len(live), int(rng.integers(1, 8))),
                                       replace=False), reverse=True):
                live.pop(j).close()
    assert open_fds() > fds0  # chunks were live
    mid_chunks = len(arena._chunks)
    for sb in live:
        sb.close()
    for sb in live:  # closing twice is harmless
        sb.close()
    assert n == 3000 and mid_chunks >= 1
    assert open_fds() == fds0
    assert alloc.allocated_bytes == bytes0
    assert alloc.live_buffers == live0
    assert arena.live == 0 and arena._chunks == []


def test_opaque_fd_export_is_owned(device):
    if hub_memory_support(device)["opaque_fd"] is not None:
        pytest.skip("no opaque-fd export here")
    fds0, bytes0 = open_fds(), device.memory.allocated_bytes
    arena = SharedArena(device, wants=[("opaque_fd",)])
    assert arena.kind == "opaque_fd"
    bufs = [arena.alloc(1 << 16) for _ in range(50)]
    for sb in bufs:
        fd, size, offset, dedicated = arena.export_fd(sb)
        assert size >= sb.buffer.block.size and offset == sb.buffer.offset and dedicated
        fd.close()
        fd.close()  # exactly once
    with pytest.raises(VkxError, match="not exportable"):
        SharedArena(device, force="staged").export_fd(bufs[0])
    if not device.memory.export_handle_types & HANDLE_DMA_BUF:
        with pytest.raises(VkxError, match="exportable as dma_buf"):
            arena.export_fd(bufs[0], "dma_buf")
    for sb in bufs:
        sb.close()
    assert open_fds() == fds0 and device.memory.allocated_bytes == bytes0


# --------------------------------------------------------------------------------------------
# events


def test_host_bridge_orders_signals_and_times_out(device):
    hub = Timeline(device, name="fake-hub")
    tl = Timeline(device, name="bridged")
    ran = []
    bridge = HostBridge(device, tl, name="t", run=lambda job: ran.append(job), timeout=0.4)
    try:
        bridge.enqueue((hub, 1), 1, "a")
        bridge.enqueue((hub, 2), 2, "b")
        time.sleep(0.05)
        assert ran == [] and tl.value == 0  # nothing runs before the hub point
        hub.signal(2)
        tl.wait(2, timeout=5)
        assert ran == ["a", "b"]
        bridge.check()
        with pytest.raises(VkxError, match="already used"):
            bridge.enqueue(None, 2, "again")
        # a hub point that never comes: WaitTimeout recorded, value still signalled, no hang
        t0 = time.monotonic()
        bridge.enqueue((hub, 99), 3, "never")
        tl.wait(3, timeout=5)
        assert 0.3 < time.monotonic() - t0 < 3
        assert "never" not in ran
        with pytest.raises(WaitTimeout, match="fake-hub"):
            bridge.check()
        bridge.check()  # reported once
        # a job that raises: the error is recorded, the value signalled
        bridge.run = lambda job: 1 / 0
        bridge.enqueue(None, 4, "boom")
        tl.wait(4, timeout=5)
        with pytest.raises(ZeroDivisionError):
            bridge.check()
        # death: pending and later values are signalled at once, the error sticks
        bridge.run = lambda job: time.sleep(10)
        bridge.enqueue((hub, 100), 5, "stuck")
        bridge.fail(BackendDied("gone"))
        tl.wait(5, timeout=1)
        bridge.enqueue((hub, 101), 6, "after")
        tl.wait(6, timeout=1)
        for _ in range(2):
            with pytest.raises(BackendDied, match="gone"):
                bridge.check()
    finally:
        bridge.close()


def test_host_bridge_watchdog_declares_unanswered_job_dead(device):
    tl = Timeline(device, name="mute")
    bridge = HostBridge(device, tl, name="mute", timeout=0.3)
    try:
        bridge.enqueue(None, 1, release=lambda: None)  # released, never completed
        t0 = time.monotonic()
        tl.wait(1, timeout=5)
        assert time.monotonic() - t0 < 3
        with pytest.raises(BackendDied, match="no answer within"):
            bridge.check()
    finally:
        bridge.close()


def test_waits_time_out_instead_of_hanging(device):
    tl = Timeline(device, name="silent")
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match="silent"):
        host_wait((tl, 1), 0.2)
    assert time.monotonic() - t0 < 2


def test_relay_moves_a_point_on_the_gpu_queue(device):
    a = Timeline(device, name="relay-a")
    b = Timeline(device, name="relay-b")
    relay(device, (a, 1), (b, 7))
    time.sleep(0.05)
    assert b.value == 0  # the queue waits for a=1 (wait-before-signal)
    a.signal(1)
    b.wait(7, timeout=5)
    assert b.value == 7


def test_prebuilt_relay_reused_for_many_points(device):
    """The per-step Relay (structures built once) moves successive points, in order."""
    from vkxsplit.attach import Relay

    a = Timeline(device, name="relay-src")
    b = Timeline(device, name="relay-dst")
    r = Relay(device, b)
    r((a, 1), 10)
    time.sleep(0.05)
    assert b.value == 0  # waits for a=1
    for v in (1, 2, 3):
        if v > 1:
            r((a, v), 10 * v)
        a.signal(v)
        b.wait(10 * v, timeout=5)
        assert b.value == 10 * v


# --------------------------------------------------------------------------------------------
# the backend interface


def test_hook_table_and_capabilities():
    assert [h for h in HOOKS.values() if h.required] == [HOOKS["mul_mat"]]
    assert all(not h.required for n, h in HOOKS.items() if n != "mul_mat")
    assert not Backend.implements("calibrate")
    with pytest.raises(VkxError, match="must implement mul_mat"):
        Capabilities(ops={"add"})
    with pytest.raises(VkxError, match="unknown memory handle"):
        Capabilities(memory_handles=("dmabuf",))
    with pytest.raises(KernelError, match="unknown ggml type"):
        Capabilities(weight_types={"q9_9"})
    c = Capabilities(weight_types={"bf16"}, compute_dtypes={"bf16"}, min_batch=8, max_kernels=6)
    assert c.x_dtype == "bf16" and isinstance(c.ops, frozenset)


def test_registry():
    avail = backend_availability()
    assert {"cpu", "npu-emu", "cuda", "hip"} <= set(avail)
    assert {"cpu", "npu-emu"} <= set(available_backends())
    for name in ("cuda", "hip"):
        if not avail[name]:
            assert avail[name].reason  # says why, never raises
    with pytest.raises(VkxError, match="no backend named"):
        create_backend("tpu", None)


def test_cuda_module_imports_without_cuda(device):
    from vkxsplit.backends import cuda

    a = cuda.available()
    if a:
        pytest.skip("CUDA is present here")
    assert "cuda" in a.reason.lower()
    with pytest.raises(EnvironmentProblem, match="not available"):
        create_backend("cuda", device)


class _MiniNpu(Backend):
    """The docs' worked example: an NPU vendor implementing only mul_mat (numpy stands in for
    the vendor SDK's blocking ``npu.matmul``)."""

    name = "mini-npu"
    caps = Capabilities(ops={"mul_mat"}, weight_types={"bf16"}, compute_dtypes={"bf16"}, min_batch=4,
                        max_kernels=6, memory_handles=("dma_buf", "host_allocation"), event_handles=("host",))

    def __init__(self, hub, **opts):
        super().__init__(hub, **opts)
        self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run, timeout=self.timeout)

    def mul_mat(self, job, wait, signal):
        self.check_job(job, signal)
        self.bridge.enqueue(wait, signal[1], job)

    def _run(self, job):
        def f32(a):
            return (a.astype(np.uint32) << 16).view(np.float32)

        w = f32(job.weight.backend_array(np.uint16)).reshape(-1, job.K)[job.r0 - job.w_row0:job.r1 - job.w_row0]
        x = f32(job.x.backend_array(np.uint16)[:job.M * job.K]).reshape(job.M, job.K)
        job.y.backend_array(np.float32).reshape(job.M, job.N)[:, job.r0:job.r1] = x @ w.T


def test_worked_example_backend_joins_a_hub_chain(device, rng):
    from vkxsplit.backend import register_backend
    from vkxsplit.ops.convert import record_convert
    from vkxsplit.vk.command import Sequence

    register_backend("mini-npu", _MiniNpu)
    npu = create_backend("mini-npu", device, timeout=10)
    assert npu.implements("mul_mat") and not npu.implements("calibrate")
    assert npu.supports("mul_mat", "bf16", 4) and not npu.supports("mul_mat", "bf16", 2)
    assert not npu.supports("mul_mat", "q4_0", 8)
    arena = SharedArena(device, [npu])
    M, N, K = 4, 24, 32
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    bufs = [arena.alloc(n) for n in (x.nbytes, M * K * 2, w.nbytes, N * K * 2, M * N * 4, M * N * 4)]
    xf, xb, wf, wb, y, out = bufs
    s1, s2 = Sequence(device, "pre"), Sequence(device, "post")
    try:
        xf.numpy(np.float32)[:] = x.ravel()
        wf.numpy(np.float32)[:] = w.ravel()
        out.numpy(np.float32)[:] = np.nan
        record_convert(s1, wf.view(), wb.view(), N * K, "f32", "bf16")  # weights once...
        record_convert(s1, xf.view(), xb.view(), M * K, "f32", "bf16")  # ...x every step
        record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
        stats.begin_step()
        v1 = s1.submit()
        p = npu.next_point()
        npu.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16"),
                    wait=(s1.timeline, v1), signal=p)
        s2.submit(waits=[p])
        assert stats.host_waits_in_step == 0
        s2.wait(10)
        npu.check()
        with pytest.raises(KernelError, match="cannot read f32 weights"):
            npu.mul_mat(MatMulJob(wf.view(), "f32", xb.view(), y.view(), M, N, K, x_type="bf16"),
                        wait=(s1.timeline, v1), signal=npu.next_point())
        import ml_dtypes

        ref = (x.astype(ml_dtypes.bfloat16).astype(np.float64)
               @ w.astype(ml_dtypes.bfloat16).astype(np.float64).T)
        np.testing.assert_allclose(out.numpy(np.float32).reshape(M, N), ref, rtol=1e-5, atol=1e-4)
    finally:
        npu.close()
        s1.close()
        s2.close()
        for b in bufs:
            b.close()


def test_bridge_threads_do_not_count_as_caller_waits(device):
    tl = Timeline(device, name="count")
    stats.begin_step()
    done = threading.Event()

    def in_thread():
        from vkxsplit.attach import mark_bridge_thread

        mark_bridge_thread()
        tl.signal(1)
        host_wait((tl, 1), 1)
        done.set()

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert done.is_set() and stats.host_waits_in_step == 0
    host_wait((tl, 1), 1)
    assert stats.host_waits_in_step == 1
