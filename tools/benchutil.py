"""Shared by the benchmark scripts: bring the GPU to its working clocks before timing.

GPUs idle at low clocks and take a while under load to ramp up; a benchmark whose first
shapes run on a cold GPU reports them slow (the first shapes of bench_matvec and bench_coopmat
timed 1.5-5x slower than larger later ones on the H200: docs/PERFORMANCE-HISTORY.md). ``spin_up`` keeps
the device busy with copies for ``seconds`` first, and ``replay_warm`` replays a recorded
benchmark sequence for a while before the run that is timed: the checks and host-side set-up
between timings leave the GPU idle long enough to drop its clocks again (the first shapes timed
after the numpy checks stayed 1.5-5x slow even after a spin-up at start).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vkxsplit.ops.copy import record_copy
from vkxsplit.vk.command import Sequence, Timestamps
from vkxsplit.vk.device import Device


def spin_up(dev: Device, seconds: float = 1.5, nbytes: int = 256 << 20) -> int:
    """Run device-to-device copies back to back for about ``seconds``; returns the number of
    submits. A CPU Vulkan device (lavapipe) gets one short submit (it has no clocks to raise)."""
    if _cpu(dev):
        nbytes, seconds = 1 << 20, 0.0
    a = dev.memory.alloc(nbytes, "device", "spin_a")
    b = dev.memory.alloc(nbytes, "device", "spin_b")
    seq = Sequence(dev, "spin-up")
    try:
        for _ in range(16):
            record_copy(seq, a, b, nbytes)
            record_copy(seq, b, a, nbytes)
        t0, n = time.perf_counter(), 0
        while True:
            seq.run(timeout=60)
            n += 1
            if time.perf_counter() - t0 >= seconds:
                return n
    finally:
        seq.close()
        a.close()
        b.close()


def _cpu(dev: Device) -> bool:
    return dev.is_cpu


def replay_warm(seq: Sequence, seconds: float = 0.2) -> None:
    """Submit the recorded ``seq`` back to back for about ``seconds`` (not on CPU devices),
    then return: the caller's next ``seq.run()`` is the timed one."""
    if _cpu(seq.device):
        return
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        seq.run(timeout=60)


def timed(dev: Device, record: Callable[[Sequence, int], None], reps: int, barrier: bool = True,
          warmup: int | None = None, setup: Callable[[Sequence], None] | None = None) -> float:
    """Seconds per repetition of ``record(seq, i)`` (i = 0..reps-1) from GPU timestamps: one
    sequence with ``setup(seq)`` (untimed, e.g. inputs the timed dispatches read), then
    ``warmup`` untimed repetitions (default: all ``reps``; pipelines, TLB), then the timed ones,
    a barrier after each when ``barrier``; replayed warm (:func:`replay_warm`) before the run
    that is read."""
    ts = Timestamps(dev, 2)
    seq = Sequence(dev, "bench")
    try:
        if setup is not None:
            setup(seq)
            seq.barrier()
        for i in range(reps if warmup is None else warmup):
            record(seq, i)
        seq.barrier()
        seq.write_timestamp(ts, 0)
        for i in range(reps):
            record(seq, i)
            if barrier:
                seq.barrier()
        if not barrier:
            seq.barrier()
        seq.write_timestamp(ts, 1)
        replay_warm(seq)
        seq.run(timeout=600)
        t = ts.read()
        return (t[1] - t[0]) * 1e-9 / reps
    finally:
        seq.close()
        ts.close()

