#!/usr/bin/env python3
"""Cost of one cross-backend hand-off, hub -> cuda -> hub, on shared device memory.

Measured with Vulkan GPU timestamps (one clock for both hub sequences): the producer
sequence writes a timestamp at its end, the consumer sequence one at its start. Every chain is
queued behind a host-signalled gate, then released, so the gap is GPU-side only. Four chains,
interleaved: hub -> hub (the baseline: one queue submission boundary), hub -> relay submit ->
hub (the relay: the hub timeline is not exportable), hub -> cuda with no work -> hub (the two
hand-offs), hub -> cuda GEMM -> hub (the real job).

  hand-off = (gap_empty - gap_hub) / 2      (two hand-offs per chain, relay included)

Host time per step: what the caller's thread spends submitting the 3-part chain (it never
waits inside the step). Prints a markdown table. Needs CUDA (the H200, tools/device_run.sh).
"""

from __future__ import annotations

import statistics
import sys
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
from vkxsplit.vk.event import Gate  # noqa: E402


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
    cp = gpu.cp
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

    gate = Gate(dev, name="gate")

    blocked: list[float] = []  # host enqueue times of gated chains that the watchdog had to open

    job = MatMulJob(wb.view(), "f16", xa.view(), y.view(), M, N, K)  # one object: replayed as in a step

    def empty_cuda(wait: tuple, p: tuple) -> None:
        """The CUDA side of a hand-off with no work: wait on the (relayed) hub point, signal."""
        rv = gpu.relay_timeline.next()
        gpu._relay(wait, rv)
        gpu._wp.params.fence.value = rv
        gpu._sp.params.fence.value = p[1]
        sem = gpu._semaphore(gpu.relay_timeline)
        with cp.cuda.Device(gpu.device_id):
            gpu._check(gpu._wait_fn([sem], [gpu._wp], 1, gpu.stream.ptr), "wait_semaphores")
            gpu._check(gpu._signal_fn([gpu._own_sem], [gpu._sp], 1, gpu.stream.ptr), "signal_semaphores")

    def chain(mode: str, gated: bool = True) -> tuple[float, float]:
        """mode: cuda (hub -> cuda GEMM -> hub), empty (hub -> cuda, no work -> hub), relay
        (hub -> relay submit -> hub), hub (hub -> hub). Gated: the chain is queued behind a
        host-signalled gate (with a watchdog: vkxsplit.vk.event.Gate), so the GPU gap measures
        the GPU-side hand-off, not how long the host takes to enqueue the CUDA part."""
        hold = gate.hold(10.0 if gated else None)
        t0 = time.perf_counter()
        stats.begin_step()
        v1 = s1.submit(waits=[hold.point])
        if mode == "cuda":
            p = gpu.next_point()
            gpu.mul_mat(job, (s1.timeline, v1), p)
            s2.submit(waits=[p])
        elif mode == "empty":
            p = gpu.next_point()
            empty_cuda((s1.timeline, v1), p)
            s2.submit(waits=[p])
        elif mode == "relay":
            rv = gpu.relay_timeline.next()
            gpu._relay((s1.timeline, v1), rv)
            s2.submit(waits=[(gpu.relay_timeline, rv)])
        else:
            s2.submit(waits=[(s1.timeline, v1)])
        host = time.perf_counter() - t0
        assert stats.host_waits_in_step == 0
        if gated and not hold.release():  # the watchdog opened it: the enqueue waited for the GPU
            blocked.append(host)
        s2.wait(30)
        gpu.check()
        t = ts.read()
        return (t[1] - t[0]) * 1e-3, host * 1e6  # us

    modes = ("cuda", "empty", "relay", "hub")
    for mode in modes:  # warm-up, ungated: dequant caches, imports, pipelines
        for _ in range(10):
            chain(mode, gated=False)
    gaps: dict[str, list[float]] = {m: [] for m in modes}
    hosts: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):  # interleaved, so drifts hit every mode alike
        for mode in modes:
            g_us, h_us = chain(mode)
            gaps[mode].append(g_us)
            hosts[mode].append(h_us)

    # pipelined: many chains queued back to back, one wait at the end
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        v1 = s1.submit()
        p = gpu.next_point()
        gpu.mul_mat(job, (s1.timeline, v1), p)
        s2.submit(waits=[p])
    s2.wait(60)
    pipelined = (time.perf_counter() - t0) / n * 1e6

    med = statistics.median
    g = {m: med(v) for m, v in gaps.items()}
    handoff = (g["empty"] - g["hub"]) / 2
    print(f"device: {dev.name}; memory path: {arena.kind}; event path: "
          f"{'imported timeline' if gpu.bridge is None else 'host bridge'}; hub timeline "
          f"{'exported' if s1.timeline.exportable else 'relayed'}; {reps} gated chains per mode, interleaved\n")
    print("| measure | median |\n|---|---:|")
    print(f"| GPU gap producer end -> consumer start: hub -> hub (us) | {g['hub']:.1f} |")
    print(f"| ... hub -> relay submit -> hub (us) | {g['relay']:.1f} |")
    print(f"| ... hub -> relay -> cuda wait + signal, no work -> hub (us) | {g['empty']:.1f} |")
    print(f"| ... hub -> relay -> cuda (x to f16, {M}x{N}x{K} GEMM) -> hub (us) | {g['cuda']:.1f} |")
    print(f"| the relay submit (relay - hub, us) | {g['relay'] - g['hub']:.1f} |")
    print(f"| **one hand-off, GPU side ((empty - hub) / 2, us)** | **{handoff:.1f}** |")
    print(f"| the cuda job's own GPU time (cuda - empty, us) | {g['cuda'] - g['empty']:.1f} |")
    print(f"| host time to enqueue the 3-part chain (us) | {med(hosts['cuda']):.1f} |")
    print(f"| host time to enqueue the 2-part hub chain (us) | {med(hosts['hub']):.1f} |")
    print(f"| pipelined chain throughput (us per chain) | {pipelined:.1f} |")
    print(f"| host waits inside a step | {stats.host_waits_in_step} |")
    print(f"| gated chains whose CUDA enqueue blocked on the GPU | {len(blocked)} of {reps} |")
    flags = {}
    for fwd, back, label in (
            ("flag", "semaphore", "hub -> cuda by a memory flag (cuStreamWaitValue32), cuda -> hub by the semaphore"),
            ("semaphore", "flag", "hub -> cuda by the semaphore, cuda -> hub by a memory flag "
                                  "(cuStreamWriteValue32, polled by a hub dispatch)"),
            ("flag", "flag", "memory flags both ways")):
        r = flag_handoff(dev, gpu, arena, gate, ts, s2, (x_in, xa, M * K), reps, back=back, forward=fwd)
        flags[(fwd, back)] = r
        print(f"| ... {label}, no work (us) | {r if isinstance(r, str) else f'{r:.1f}'} |")
    for (fwd, back), what in ((("flag", "semaphore"), "hub -> cuda"), (("semaphore", "flag"), "cuda -> hub")):
        r = flags[(fwd, back)]
        if not isinstance(r, str):
            print(f"| the semaphore's extra cost in the {what} direction (empty - that row, us) | "
                  f"{g['empty'] - r:.1f} |")
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


def flag_handoff(dev: Device, gpu, arena: SharedArena, gate: Gate, ts: Timestamps, s2: Sequence,
                 x: tuple, reps: int, back: str = "semaphore", forward: str = "flag") -> float | str:
    """The GPU gap of hub -> cuda (no work) -> hub with words of shared memory in place of the
    imported semaphores, one direction or both. Forward ``flag``: the producer's last command
    copies the chain's number (written by the host into a host-visible buffer before the
    submit) into a flag in the hub's exported memory, and the CUDA stream waits on it with
    cuStreamWaitValue32 (GEQ); ``semaphore``: CUDA waits on the relayed hub point as usual.
    Back ``semaphore``: CUDA signals its timeline and the consumer waits on it; ``flag``: CUDA
    writes the number into a second flag (cuStreamWriteValue32) and the consumer's first
    dispatch polls it (``wait_flag``, bounded; the consumer waits on the producer's point
    first, a same-queue dependency). Median over ``reps`` gated chains, or the reason it could
    not be measured. A flag never satisfied is unblocked (the hub writes the largest value
    into the forward flag; the poll gives up by itself)."""
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # noqa: BLE001 - a report, not a failure
        return f"cuda.bindings.driver unavailable ({exc})"
    import kernels
    from flags import GAVE_UP, record_wait_flag

    kernels.ensure("^wait_flag$")

    x_in, xa, n = x
    flag, flag2 = arena.alloc(256, "flag"), arena.alloc(256, "flag-back")
    val = dev.memory.alloc(256, "host", "flag-value")
    target = dev.memory.alloc(256, "host", "flag-target")
    result = dev.memory.alloc(256, "host", "flag-polls")
    s1f, s2f = Sequence(dev, "producer-flag"), Sequence(dev, "consumer-flag")
    consumer = s2
    try:
        flag.buffer.write(np.zeros(64, np.uint32))
        flag2.buffer.write(np.zeros(64, np.uint32))
        record_convert(s1f, x_in.view(), xa.view(), n, "f32", "f32")
        s1f.write_timestamp(ts, 0)
        if forward == "flag":
            s1f.copy(val, flag.view(), 4)
        s1f.end()
        if back == "flag":
            record_wait_flag(s2f, flag2.view(), target, result, 1 << 24)  # seconds of polls at most
            s2f.write_timestamp(ts, 1)
            s2f.end()
            consumer = s2f
        fptr, bptr = gpu._pointer(flag.view()), gpu._pointer(flag2.view())
        stream = cu.CUstream(gpu.stream.ptr)
        gaps: list[float] = []
        for i in range(1, reps + 11):
            val.numpy(np.uint32)[0] = i
            target.numpy(np.uint32)[0] = i
            hold = gate.hold(10.0)
            v1 = s1f.submit(waits=[hold.point])
            p = gpu.next_point()
            with gpu.cp.cuda.Device(gpu.device_id):
                if forward == "flag":
                    (err,) = cu.cuStreamWaitValue32(stream, cu.CUdeviceptr(fptr), i,
                                                    cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
                    if err != cu.CUresult.CUDA_SUCCESS:
                        hold.release()
                        s1f.wait(10)
                        return f"cuStreamWaitValue32 failed: {err}"
                else:  # the relayed hub point, as a plain hand-off
                    rv = gpu.relay_timeline.next()
                    gpu._relay((s1f.timeline, v1), rv)
                    gpu._wp.params.fence.value = rv
                    gpu._check(gpu._wait_fn([gpu._semaphore(gpu.relay_timeline)], [gpu._wp], 1, gpu.stream.ptr),
                               "wait_semaphores")
                if back == "flag":
                    (err,) = cu.cuStreamWriteValue32(stream, cu.CUdeviceptr(bptr), i, 0)
                    if err != cu.CUresult.CUDA_SUCCESS:
                        hold.release()
                        s1f.wait(10)
                        return f"cuStreamWriteValue32 failed: {err}"
                gpu._sp.params.fence.value = p[1]  # the stream's point, signalled either way
                gpu._check(gpu._signal_fn([gpu._own_sem], [gpu._sp], 1, gpu.stream.ptr), "signal_semaphores")
            consumer.submit(waits=[p] if back == "semaphore" else [(s1f.timeline, v1)])
            hold.release()
            try:
                consumer.wait(30)
                gpu.wait(p, 30)
            except VkxError as exc:  # a flag never satisfied: unblock the stream
                unblock = Sequence(dev, "flag-unblock")
                unblock.fill(flag.view(), 0x7FFFFFFF)
                unblock.run(timeout=10)
                unblock.close()
                consumer.wait(30)
                return f"a flag was never seen ({str(exc).splitlines()[0]})"
            if back == "flag" and int(result.numpy(np.uint32)[0]) == GAVE_UP:
                return "the hub's poll gave up: CUDA's write never became visible to it"
            t = ts.read()
            if i > 10:
                gaps.append((t[1] - t[0]) * 1e-3)
        return statistics.median(gaps)
    finally:
        s1f.close()
        s2f.close()
        for b in (val, target, result, flag, flag2):
            b.close()

if __name__ == "__main__":
    sys.exit(main())
