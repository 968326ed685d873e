#!/usr/bin/env python3
"""Cost of one cross-backend hand-off, hub -> cuda -> hub, on shared device memory.

Measured with Vulkan GPU timestamps (one clock for both hub sequences): the producer
sequence writes a timestamp at its end, the consumer sequence one at its start; between
them lies the CUDA job (wait on the imported timeline, a tiny GEMM, signal). The same gap
with no CUDA job in between (hub -> hub through the same timeline wait) is the baseline.
The CUDA job's own duration is measured with CUDA events on an identical GEMM.

  hand-off = (gap_with_cuda - cuda_job - gap_hub_only) / 2      (two hand-offs per chain)

Host time per step: what the caller's thread spends submitting the 3-part chain (it never
waits inside the step). Prints a markdown table. Needs CUDA (the H200, tools/device_run.sh).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vkxsplit.attach import SharedArena, stats  # noqa: E402
from vkxsplit.backend import MatMulJob, create_backend  # noqa: E402
from vkxsplit.errors import VkxError  # noqa: E402
from vkxsplit.ops.convert import record_convert  # noqa: E402
from vkxsplit.vk.command import Sequence, Timestamps  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402
from vkxsplit.vk.event import Timeline  # noqa: E402


def main() -> int:
    reps = 200
    dev = Device.open()
    try:
        gpu = create_backend("cuda", dev)
    except VkxError as exc:
        print(f"bench_handoff: no cuda backend here: {exc}", file=sys.stderr)
        dev.close()
        return 2
    arena = SharedArena(dev, [gpu])
    M, N, K = 1, 256, 256
    rng = np.random.default_rng(0)
    x_in, xa = arena.alloc(M * K * 4), arena.alloc(M * K * 4)
    wb, y, out = arena.alloc(N * K * 2), arena.alloc(M * N * 4), arena.alloc(M * N * 4)
    x_in.buffer.write(rng.standard_normal(M * K).astype(np.float32))
    wb.buffer.write(rng.standard_normal(N * K).astype(np.float16))
    ts = Timestamps(dev, 2)
    s1, s2 = Sequence(dev, "producer"), Sequence(dev, "consumer")
    record_convert(s1, x_in.view(), xa.view(), M * K, "f32", "f32")
    s1.write_timestamp(ts, 0)
    s2.write_timestamp(ts, 1)
    record_convert(s2, y.view(), out.view(), M * N, "f32", "f32")
    s1.end()
    s2.end()

    gate = Timeline(dev, name="gate")

    blocked: list[float] = []  # host enqueue times of gated chains that the watchdog had to open

    def chain(with_cuda: bool, gated: bool = True) -> tuple[float, float]:
        # Gated: the whole chain is queued behind a host-signalled gate, so the GPU gap measures
        # the GPU-side hand-off, not how long the host takes to enqueue the CUDA part. If
        # enqueueing the CUDA part synchronised with the GPU (a first-use effect: module load,
        # memory import, pool growth) it would wait for the gate forever: a watchdog opens the
        # gate after 10 s and the chain is reported as blocked instead of hanging.
        g = gate.next()
        opened = threading.Lock()

        def open_gate() -> None:
            if opened.acquire(blocking=False):
                gate.signal(g)

        dog = threading.Timer(10.0, open_gate)
        if gated:
            dog.start()
        else:
            open_gate()
        t0 = time.perf_counter()
        stats.begin_step()
        v1 = s1.submit(waits=[(gate, g)])
        if with_cuda:
            p = gpu.next_point()
            gpu.mul_mat(MatMulJob(wb.view(), "f16", xa.view(), y.view(), M, N, K), (s1.timeline, v1), p)
            s2.submit(waits=[p])
        else:
            s2.submit(waits=[(s1.timeline, v1)])
        host = time.perf_counter() - t0
        assert stats.host_waits_in_step == 0
        dog.cancel()
        if gated:
            if opened.acquire(blocking=False):
                gate.signal(g)
            else:  # the watchdog opened it: the enqueue waited for the GPU
                blocked.append(host)
        s2.wait(30)
        gpu.check()
        t = ts.read()
        return (t[1] - t[0]) * 1e-3, host * 1e6  # us

    for with_cuda in (True, False):  # warm-up, ungated: dequant caches, imports, pipelines
        for _ in range(10):
            chain(with_cuda, gated=False)
    gaps_c, hosts_c = zip(*[chain(True) for _ in range(reps)])
    gaps_v, hosts_v = zip(*[chain(False) for _ in range(reps)])

    cp = gpu.cp
    with cp.cuda.Device(gpu.device_id), gpu.stream:
        a = cp.asarray(rng.standard_normal((M, K)), dtype=cp.float16)
        b = cp.asarray(rng.standard_normal((N, K)), dtype=cp.float16)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(10):
            (a @ b.T).astype(cp.float32)
        e0.record(gpu.stream)
        for _ in range(reps):
            (a @ b.T).astype(cp.float32)
        e1.record(gpu.stream)
        e1.synchronize()
        cuda_job = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps  # us

    # pipelined: many chains queued back to back, one wait at the end
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        v1 = s1.submit()
        p = gpu.next_point()
        gpu.mul_mat(MatMulJob(wb.view(), "f16", xa.view(), y.view(), M, N, K), (s1.timeline, v1), p)
        s2.submit(waits=[p])
    s2.wait(60)
    pipelined = (time.perf_counter() - t0) / n * 1e6

    med = statistics.median
    handoff = (med(gaps_c) - cuda_job - med(gaps_v)) / 2
    print(f"device: {dev.name}; memory path: {arena.kind}; event path: "
          f"{'imported timeline' if gpu.bridge is None else 'host bridge'}; hub timeline "
          f"{'exported' if s1.timeline.exportable else 'relayed'}\n")
    print("| measure | median |\n|---|---:|")
    print(f"| GPU gap producer end -> consumer start, via cuda (us) | {med(gaps_c):.1f} |")
    print(f"| GPU gap producer end -> consumer start, hub only (us) | {med(gaps_v):.1f} |")
    print(f"| cuda job alone (CUDA events, us) | {cuda_job:.1f} |")
    print(f"| **one hand-off, GPU side (us)** | **{handoff:.1f}** |")
    print(f"| host time to submit the 3-part chain (us) | {med(hosts_c):.1f} |")
    print(f"| host time to submit the 2-part hub chain (us) | {med(hosts_v):.1f} |")
    print(f"| pipelined chain throughput (us per chain) | {pipelined:.1f} |")
    print(f"| host waits inside a step | {stats.host_waits_in_step} |")
    print(f"| gated chains whose CUDA enqueue blocked on the GPU | {len(blocked)} of {reps} |")
    for s in (s1, s2):
        s.close()
    ts.close()
    gate.close()
    for b in (x_in, xa, wb, y, out):
        b.close()
    gpu.close()
    arena.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
