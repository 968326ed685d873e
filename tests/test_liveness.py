"""Waits tell slow from dead: a wait fails only after its stall limit without progress (and
says so: "no progress for N s while ..."), a peer that is gone fails it at once (naming it),
and a peer that is slow but advancing never fails it. Limits are made short here."""

from __future__ import annotations

import os
import threading
import time

import pytest

from vkxsplit.attach import HostBridge
from vkxsplit.backend import Backend
from vkxsplit.errors import BackendDied, BackendStalled, Stalled, WaitTimeout
from vkxsplit.vk.event import Timeline


class ThreadBackend(Backend):
    """A backend whose jobs run ``job()`` on its bridge thread (what the cpu backend does)."""

    name = "slowpoke"

    def __init__(self, hub, timeout):
        super().__init__(hub, timeout=timeout)
        self.bridge = HostBridge(hub, self.timeline, name=self.name, run=lambda job: job(),
                                 timeout=self.timeout, counters=self.stats)

    def mul_mat(self, job, wait, signal):  # (not planned here: jobs are queued directly)
        raise NotImplementedError

    def queue(self, job):
        v = self.timeline.next()
        self.bridge.enqueue(None, v, job)
        return v


def _signaller(tl, values, every):
    def run():
        for v in values:
            time.sleep(every)
            tl.signal(v)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_timeline_that_keeps_advancing_is_waited_for_past_the_stall_limit(device):
    tl = Timeline(device, name="advancing")
    try:
        t = _signaller(tl, range(1, 9), 0.15)  # 1.2 s in all, a step every 0.15 s
        t0 = time.monotonic()
        tl.wait(8, timeout=0.5)
        assert time.monotonic() - t0 > 0.5  # longer than the limit, and no error
        t.join()
    finally:
        tl.close()


def test_a_timeline_without_progress_fails_as_slow_naming_what_it_waited_for(device):
    tl = Timeline(device, name="wedged-tl")
    try:
        tl.signal(3)
        t0 = time.monotonic()
        with pytest.raises(Stalled, match=r"no progress for 0\.[3-9]\d* s while waiting for wedged-tl to reach 4 "
                                          r"\(it is at 3\)") as info:
            tl.wait(4, timeout=0.3)
        assert time.monotonic() - t0 < 2.0
        assert isinstance(info.value, WaitTimeout) and "VKXSPLIT_TIMEOUT_S" in info.value.hint
    finally:
        tl.close()


def test_a_value_expected_to_be_slow_gets_the_longer_limit(device):
    tl = Timeline(device, name="cold")
    try:
        tl.expect_slow(1, "the first run of 3 recorded hub ops")
        _signaller(tl, [1], 0.6)
        tl.wait(1, timeout=0.2)  # 0.6 s without progress, under 10 x 0.2 s
        tl.expect_slow(2, "the first run of 3 recorded hub ops")
        with pytest.raises(Stalled, match="first run of 3 recorded hub ops, allowed 0.5 s"):
            tl.wait(2, timeout=0.05)
    finally:
        tl.close()


def test_a_slow_backend_that_advances_passes(device):
    """Eight jobs of 0.2 s each (1.6 s) under a stall limit of 0.5 s: it answers every 0.2 s."""
    with ThreadBackend(device, timeout=0.5) as be:
        last = 0
        for _ in range(8):
            last = be.queue(lambda: time.sleep(0.2))
        t0 = time.monotonic()
        be.wait(last)
        assert time.monotonic() - t0 > 0.5
        assert be.timeline.value == last


def test_a_wedged_backend_fails_with_the_slow_message(device):
    gate = threading.Event()
    with ThreadBackend(device, timeout=0.3) as be:
        v = be.queue(lambda: gate.wait(30))  # blocked: no answer, no CPU time
        t0 = time.monotonic()
        try:
            with pytest.raises(Stalled, match=r"no progress for .* while waiting for slowpoke-stream to reach "
                                              rf"{v} .*watching slowpoke \(alive\)"):
                be.wait(v)
            assert time.monotonic() - t0 < 3.0
        finally:
            gate.set()
        be.wait(v, timeout=30)  # it answers once released: slow, never declared dead


def test_a_backend_computing_one_long_job_is_not_stalled(device):
    """One job longer than the stall limit that keeps its thread busy: its CPU time is the
    heartbeat (Linux /proc), so the wait goes on."""
    from vkxsplit.attach import cpu_ticks

    if cpu_ticks(os.getpid()) is None:
        pytest.skip("no /proc here: thread backends have no heartbeat")

    def spin():
        end = time.monotonic() + 1.2
        x = 0
        while time.monotonic() < end:
            x += 1

    with ThreadBackend(device, timeout=0.4) as be:
        v = be.queue(spin)
        be.wait(v)


def test_a_released_job_without_answer_or_heartbeat_is_given_up_as_stalled(device):
    tl = Timeline(device, name="mute2")
    beats = {"n": 0}
    bridge = HostBridge(device, tl, name="mute2", timeout=0.3, heartbeat=lambda: beats["n"])
    try:
        bridge.enqueue(None, 1, release=lambda: None)  # released, never answered
        # a heartbeat that moves keeps it alive past the limit
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            beats["n"] += 1
            time.sleep(0.05)
        bridge.check()
        assert bridge.dead is None and tl.value == 0
        tl.wait(1, timeout=5)  # once the heartbeat stops: given up on, its value signalled
        with pytest.raises(BackendStalled, match="no progress for .* slow or wedged, not dead"):
            bridge.check()
    finally:
        bridge.close()


def test_a_killed_npu_emu_process_fails_the_wait_at_once_naming_it(device):
    from vkxsplit.backends.npu_emu import NpuEmuBackend

    be = NpuEmuBackend(device, timeout=60.0)
    try:
        v = be.timeline.next()  # a point its stream would signal
        be.proc.kill()
        t0 = time.monotonic()
        with pytest.raises(BackendDied, match=rf"backend npu-emu's process {be.pid} exited with code -9"):
            be.wait(v)
        assert time.monotonic() - t0 < 5.0  # at once, not after the 60 s stall limit
    finally:
        be.close()


def test_a_stopped_npu_emu_process_is_slow_not_dead(device):
    """SIGSTOP: the process is alive but makes no progress: the wait fails with the slow message
    after the stall limit (not as dead), and the process is still there afterwards."""
    import signal

    from vkxsplit.backends.npu_emu import NpuEmuBackend

    be = NpuEmuBackend(device, timeout=0.5)
    try:
        v = be.timeline.next()
        os.kill(be.proc.pid, signal.SIGSTOP)
        with pytest.raises(Stalled, match=r"no progress for .*watching npu-emu \(alive\)"):
            be.wait(v)
        assert be.proc.poll() is None
    finally:
        os.kill(be.proc.pid, signal.SIGCONT)
        be.close()


def test_a_long_npu_emu_job_beats_and_is_not_stalled(device):
    """One emulated NPU job of ~1.2 s under a 0.4 s stall limit: the server sleeps it in slices
    with a heartbeat between them, so the wait sees progress and the job completes (before the
    beats the sleeping process looked wedged); the product is right."""
    import ml_dtypes
    import numpy as np

    from vkxsplit.attach import SharedArena
    from vkxsplit.backend import MatMulJob
    from vkxsplit.backends.npu_emu import NpuEmuBackend
    from vkxsplit.vk.command import Sequence

    M, N, K = 8, 32, 64
    be = NpuEmuBackend(device, timeout=0.4, gflops=2.0 * M * N * K / 1.2e9, min_batch=1)
    arena = SharedArena(device, [be], name="beats")
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
        xb, wb, y = arena.alloc(x.nbytes), arena.alloc(w.nbytes), arena.alloc(M * N * 4)
        xb.numpy(np.uint8)[:] = x.view(np.uint8).ravel()
        wb.numpy(np.uint8)[:] = w.view(np.uint8).ravel()
        s = Sequence(device, "beats")
        try:
            v = s.submit()  # an empty hub segment: the point the job waits for
            p = be.next_point()
            t0 = time.monotonic()
            be.mul_mat(MatMulJob(wb.view(), "bf16", xb.view(), y.view(), M, N, K, x_type="bf16"), (s.timeline, v), p)
            be.wait(p)
            assert time.monotonic() - t0 > 1.0  # it did take longer than the stall limit
        finally:
            s.close()
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(y.numpy(np.float32).reshape(M, N), ref, rtol=1e-5, atol=1e-4)
    finally:
        arena.close()
        be.close()
