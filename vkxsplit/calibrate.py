"""Calibration: the measurements behind the cost model, taken by running the hub and the
backends on this machine.

:class:`MeasuringCostModel` is a :class:`~vkxsplit.plan.cost.CostModel` that measures what its
device profile lacks when the planner asks (``prepare``): the hub's submit overhead and
``convert`` rate (GPU timestamps), each backend's round-trip latency and enqueue time, and its
``mul_mat`` times on the graph's shapes (scratch buffers of the arena), then saves the profile.
Hub node times come from ``hub_runner(graph)``; the model passes one built on
:func:`hub_node_times`, which runs the graph alone through the executor with GPU timestamps.
The row split's all-reduce threshold (from which partial size bf16 crosses instead of f32) is
:func:`measure_reduce`'s, asked for by ``reduce_threshold()``.

Imports: ``vkxsplit.plan.*`` and ``vkxsplit.executor`` (it runs them): above the executor,
below the model, which is the one that imports it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from . import attach as _attach
from . import progress
from .backend import MatMulJob, row_bytes
from .errors import VkxError
from .executor import Executor, record_graph
from .graph import Graph
from .ops.convert import record_convert
from .ops.copy import record_copy
from .ops.link import record_link_sum
from .ops.quant import ELEM_BYTES as _ELEM
from .plan.cost import REDUCE_KEY, CostModel
from .plan.planner import Planner
from .plan.profile import Profile
from .plan.schedule import HubOp
from .vk.command import Sequence, Timestamps
from .vk.event import Gate

if TYPE_CHECKING:
    from .attach import SharedArena
    from .vk.device import Device

log = logging.getLogger("vkxsplit.plan")


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


class MeasuringCostModel(CostModel):
    """A :class:`~vkxsplit.plan.cost.CostModel` that measures missing entries on demand
    (``device``, ``arena`` and ``backends`` given; without a device it only estimates, like its
    base): hub nodes by ``hub_runner(graph)`` (seconds per node index), backend ``mul_mat`` on
    scratch buffers of ``arena`` (the backend's own clock where it has one, else host timers),
    the round-trip latency per backend, the hub's submit overhead and conversion rate;
    ``reps`` repetitions each."""

    def __init__(self, profile: Profile | None = None, *, device: Device | None = None,
                 arena: SharedArena | None = None, backends: Iterable[Any] = (), reps: int = 3,
                 hub_runner: Callable[[Graph], dict[int, float]] | None = None) -> None:
        super().__init__(profile, device=device, backends=backends)
        #: the hubs of a model over several (the relay crossing is measured between the first two)
        self.relay_devices: list[Any] = []
        self.arena = arena
        self.reps = max(1, reps)
        self.hub_runner = hub_runner

    @property
    def can_measure(self) -> bool:
        return self.device is not None

    def relay(self) -> float:
        """The relay crossing between the hubs (:meth:`CostModel.relay`), measured by
        :func:`measure_relay` between ``relay_devices`` and saved in the profile the first
        time it is asked."""
        devs = self.relay_devices
        if self.can_measure and len(devs) > 1 and self.profile.get("hub", self.relay_key) is None:
            self.profile.put("hub", self.relay_key, measure_relay(devs[:2], reps=max(10, 4 * self.reps)))
            self.measured += 1
            self.profile.save()
        return super().relay()

    def reduce_threshold(self) -> int | None:
        """The all-reduce's bf16 threshold (:meth:`CostModel.reduce_threshold`), measured on
        the hub (:func:`measure_reduce`) and saved in the profile the first time it is asked."""
        if self.can_measure and not isinstance(self.profile.get("hub", REDUCE_KEY), dict):
            assert self.device is not None
            with progress.task("calibrating the all-reduce (once per device: kept in the device profile)"):
                self.profile.put("hub", REDUCE_KEY, measure_reduce(self.device, reps=self.reps))
            self.measured += 1
            self.profile.save()
        return super().reduce_threshold()

    def prepare(self, graph: Graph | None = None, jobs: Iterable[tuple[str, str, int, int, int]] = ()) -> None:
        """Measure what is missing for ``graph`` (hub nodes) and ``jobs`` ((backend, w_type,
        N, K, M) of full-row jobs), then save the profile."""
        if not self.can_measure:
            return
        jobs = sorted(set(jobs))
        hub_missing = graph is not None and self.hub_runner is not None and any(
            self.profile.get("hub", "node|" + n.signature()) is None for n in graph.nodes)
        lat_missing = sorted(name for name in {j[0] for j in jobs}
                             if self.profile.get(self.scope(name), "latency") is None)
        job_missing = [j for j in jobs if self.profile.get(self.scope(j[0]), self.job_key(*j[1:])) is None]
        total = int(hub_missing) + len(lat_missing) + len(job_missing)
        label = f"calibrating for T={graph.T}" if graph is not None else "calibrating"
        with progress.task(label + " (once per device: kept in the device profile)", total or None,
                           "measurements") as bar:
            self._measure_hub_basics()
            if hub_missing:
                assert graph is not None and self.hub_runner is not None
                times = self.hub_runner(graph)
                for n in graph.nodes:
                    if n.index in times:
                        self.profile.put("hub", "node|" + n.signature(), times[n.index])
                self.measured += 1
                bar.update(1, "hub ops")
            for name in lat_missing:
                self._measure_latency(name)
                bar.update(1, f"{name} latency")
            for name, w_type, N, K, M in job_missing:
                self._measure_job(name, w_type, N, K, M)
                bar.update(1, f"{name} {w_type} {N}x{K} M={M}")
        self.profile.save()

    def measure_dry(self, graph: Graph, devices: list[Device], n_ctx: int) -> None:
        """Measure the hub nodes of ``graph`` whose signature the profile lacks, where its
        tensors live in buffers that are not there (``handle`` None: the dry shares ``auto``
        over several hubs builds candidate splits on, :class:`vkxsplit.hubs.DryHubShare`):
        one node per signature (a model's layers share them), on the device of its hub
        (``devices[node.hub]``), over real buffers of the dry ones' sizes for the time of the
        measurement (zeros; host memory for the links between hubs, which are host pages; the
        positions the last of the context, as the model's own measurement has them)."""
        if not self.can_measure:
            return
        from .graph import Node, Tensor
        from .vk.kernel import View

        todo: dict[str, Node] = {}
        for n in graph.nodes:
            key = "node|" + n.signature()
            if self.profile.get("hub", key) is None and key not in todo:
                todo[key] = n
        by_hub: dict[int, list[Node]] = {}
        for n in todo.values():
            by_hub.setdefault(n.hub, []).append(n)
        T = graph.T
        for h, nodes in sorted(by_hub.items()):
            dev = devices[h]
            real: dict[int, Any] = {}
            try:
                def bind(t: Tensor, dev: Any = dev, real: dict[int, Any] = real) -> Tensor:
                    b = t.buffer
                    base, off, size = (b.buffer, b.offset, b.size) if isinstance(b, View) else (b, 0, b.size)
                    if getattr(base, "handle", 0) is not None:
                        return t  # (real memory already)
                    rb = real.get(id(base))
                    if rb is None:
                        pool = "host" if getattr(base, "host_pages", False) or base.name == "positions" else "device"
                        rb = real[id(base)] = dev.memory.alloc(max(16, base.size), pool, f"probe:{base.name}")
                        seq = Sequence(dev, "probe-zero")
                        try:
                            seq.fill(rb, 0)
                            seq.end()
                            seq.run()
                        finally:
                            seq.close()
                        if base.name == "positions":
                            rows = rb.size // 4
                            rb.numpy(np.int32, (rows,))[:] = np.clip(n_ctx - T + np.arange(rows), 0, n_ctx - 1)
                    return Tensor(t.name, t.shape, t.dtype, View(rb, off, size), t.weight)

                probe = Graph(f"{graph.name}:hub{h}:probe", T=T)
                for i, n in enumerate(nodes):
                    params = {k: bind(v) if isinstance(v, Tensor) else v for k, v in n.params.items()}
                    probe.nodes.append(Node(n.op, n.name, [bind(t) for t in n.inputs], bind(n.output), params,
                                            index=i))
                times = hub_node_times(dev, probe)
                for i, n in enumerate(nodes):
                    if i in times:
                        self.profile.put("hub", "node|" + n.signature(), times[i])
                self.measured += 1
            finally:
                for b in real.values():
                    b.close()
        self.profile.save()

    def _measure_hub_basics(self) -> None:
        dev = self.device
        assert dev is not None
        if self.profile.get("hub", "submit") is None:
            seq = Sequence(dev, "probe-submit")
            try:
                seq.end()
                ts = []
                for r in range(self.reps + 2):
                    t = time.perf_counter()
                    seq.submit()
                    seq.wait()
                    if r:
                        ts.append(time.perf_counter() - t)
            finally:
                seq.close()
            self.profile.put("hub", "submit", _median(ts))
        if self.profile.get("hub", "convert") is None and dev.timestamp_bits:
            sizes = (4096, 1 << 20)
            src = dev.memory.alloc(sizes[-1] * 4, "device", "probe-src")
            dst = dev.memory.alloc(sizes[-1] * 2, "device", "probe-dst")
            got = []
            try:
                for n in sizes:
                    tsp = Timestamps(dev, 2)
                    seq = Sequence(dev, "probe-convert")
                    try:
                        record_convert(seq, src, dst, n, "f32", "bf16")
                        seq.barrier()
                        seq.write_timestamp(tsp, 0)
                        for _ in range(self.reps):
                            record_convert(seq, src, dst, n, "f32", "bf16")
                            seq.barrier()
                        seq.write_timestamp(tsp, 1)
                        seq.run()
                        t = tsp.read()
                        got.append(max(1e-9, (t[1] - t[0]) * 1e-9 / self.reps))
                    finally:
                        seq.close()
                        tsp.close()
            finally:
                src.close()
                dst.close()
            b = max(0.0, (got[1] - got[0]) / (sizes[1] - sizes[0]))
            a = max(0.0, got[0] - b * sizes[0])
            self.profile.put("hub", "convert", [a, b])

    def _backend_types(self, name: str) -> tuple[str, str] | None:
        """(weight type, x type) of a small probe job the backend takes."""
        b = self.backends[name]
        wt = next((d for d in (b.caps.x_dtype, "f32", "bf16", "f16") if d in b.caps.weight_types), None)
        return (wt, b.caps.x_dtype) if wt else None

    def _capped_full(self, name: str) -> bool:
        b = self.backends[name]
        cap = b.caps.max_kernels
        n = getattr(b, "resident_kernels", None)
        return cap is not None and isinstance(n, int) and n >= cap

    def _scratch(self, nbytes: int, name: str) -> Any:
        assert self.arena is not None
        sb = self.arena.alloc(nbytes, name)
        sb.buffer.write(np.zeros(nbytes, np.uint8))
        return sb

    def _measure_latency(self, name: str) -> None:
        """Round trip hub -> backend -> hub of a tiny job (``latency``), and the host time of
        one ``mul_mat`` call (``enqueue``).

        Where the hub has timestamps the round trip is measured on the GPU clock, as a step
        runs it: the chain (hub sequence, backend job, hub sequence) is queued behind a
        host-signalled gate, then released; latency = the gap between the two sequences less
        the same gap with no backend in between. That excludes the host's time to enqueue
        (a step enqueues everything up front; ``enqueue`` models that). A backend whose
        enqueue waits for the GPU would wait for the gate forever: a watchdog opens it after
        a few seconds and the host round trip is used instead. Without timestamps: the host
        round trip less two submits."""
        types = self._backend_types(name)
        if self.arena is None or types is None or self._capped_full(name):
            return
        b = self.backends[name]
        wt, xt = types
        N, K = 16, 32
        bufs = [self._scratch(N * K * _ELEM[wt], "probe-w"), self._scratch(K * _ELEM[xt], "probe-x"),
                self._scratch(N * 4, "probe-y")]
        dev = self.device
        assert dev is not None
        s1, s2 = Sequence(dev, "probe-a"), Sequence(dev, "probe-b")
        try:
            job = MatMulJob(bufs[0].view(), wt, bufs[1].view(), bufs[2].view(), 1, N, K, x_type=xt)
            enq: list[float] = []
            lat = self._gpu_round_trip(b, job, s1, s2, enq) if dev.timestamp_bits else None
            if lat is None:
                lat = self._host_round_trip(b, job, s1, s2, enq)
            self.profile.put(self.scope(name), "latency", max(1e-6, lat))
            self.profile.put(self.scope(name), "enqueue", _median(enq))
            self.measured += 1
        finally:
            s1.close()
            s2.close()
            b.unload(bufs[0].view())
            for sb in bufs:
                sb.close()

    def _host_round_trip(self, b: Any, job: Any, s1: Any, s2: Any, enq: list[float]) -> float:
        if s1.recording:
            s1.end()
            s2.end()
        ts = []
        for r in range(self.reps + 2):
            t = time.perf_counter()
            v1 = s1.submit()
            p = b.next_point()
            t1 = time.perf_counter()
            b.mul_mat(job, (s1.timeline, v1), p)
            enq.append(time.perf_counter() - t1)
            s2.submit(waits=[p])
            _attach.host_wait((s2.timeline, s2.last_value))
            b.check()
            if r:
                ts.append(time.perf_counter() - t)
        return _median(ts) - 2 * self.submit()

    def _gpu_round_trip(self, b: Any, job: Any, s1: Any, s2: Any, enq: list[float]) -> float | None:
        dev = self.device
        ts = Timestamps(dev, 2)  # type: ignore[arg-type]
        gate = Gate(dev, name="probe-gate")  # type: ignore[arg-type]
        try:
            s1.write_timestamp(ts, 0)
            s2.write_timestamp(ts, 1)
            s1.end()
            s2.end()

            def gap(via_backend: bool, gated: bool) -> float | None:
                hold = gate.hold(5.0 if gated else None)
                v1 = s1.submit(waits=[hold.point])
                if via_backend:
                    p = b.next_point()
                    t = time.perf_counter()
                    b.mul_mat(job, (s1.timeline, v1), p)
                    enq.append(time.perf_counter() - t)
                    s2.submit(waits=[p])
                else:
                    s2.submit(waits=[(s1.timeline, v1)])
                late = gated and not hold.release()
                _attach.host_wait((s2.timeline, s2.last_value))
                b.check()
                t01 = ts.read()
                return None if late else (t01[1] - t01[0]) * 1e-9

            for _ in range(2):  # warm-up, ungated: first-use work (imports, kernel loads)
                gap(True, False)
                gap(False, False)
            enq.clear()
            via, hub = [], []
            for _ in range(self.reps + 2):
                a, c = gap(True, True), gap(False, True)
                if a is None:  # the enqueue waited for the GPU: no GPU-side measure
                    log.info("%s: mul_mat enqueue waits for the GPU; latency from a host round trip", b.name)
                    return None
                if c is not None:
                    via.append(a)
                    hub.append(c)
            return _median(via) - _median(hub)
        finally:
            ts.close()
            gate.close()

    def _measure_job(self, name: str, w_type: str, N: int, K: int, M: int) -> None:
        b = self.backends.get(name)
        if b is None or self.arena is None or self._capped_full(name):
            return
        xt = b.caps.x_dtype
        try:
            bufs = [self._scratch(N * row_bytes(w_type, K), "probe-w"), self._scratch(M * K * _ELEM[xt], "probe-x"),
                    self._scratch(M * N * 4, "probe-y")]
        except VkxError as exc:
            log.warning("cannot measure %s mul_mat %s %dx%d: %s", name, w_type, N, K, exc)
            return
        try:
            job = MatMulJob(bufs[0].view(), w_type, bufs[1].view(), bufs[2].view(), M, N, K, x_type=xt)
            tiny = MatMulJob(bufs[0].view(0, row_bytes(w_type, K)), w_type, bufs[1].view(), bufs[2].view(),
                             1, N, K, x_type=xt, r0=0, r1=1)

            def timed(j: Any, n: int) -> float:
                """Seconds per job with ``n`` jobs queued back to back and one wait at the end:
                in a step every job is enqueued up front, so a per-call host wait (which is
                large for a GPU driven from Python) is not part of a job's cost."""
                t = time.perf_counter()
                for _ in range(n):
                    p = b.next_point()
                    b.mul_mat(j, None, p)
                b.wait(p)
                return (time.perf_counter() - t) / n

            own = b.time_job(job, self.reps) if type(b).implements("time_job") else None
            if own is not None:  # the backend's own clock: no host round trips in it
                self.profile.put(self.scope(name), self.job_key(w_type, N, K, M), max(1e-7, own))
                self.measured += 1
                return
            timed(job, 1)  # warm-up (a backend may prepare the weight once: dequantize, load)
            timed(tiny, 1)
            full = _median([timed(job, 4) for _ in range(self.reps)])
            over = _median([timed(tiny, 4) for _ in range(self.reps)])
            self.profile.put(self.scope(name), self.job_key(w_type, N, K, M), max(1e-7, full - over))
            self.measured += 1
        except VkxError as exc:
            log.warning("cannot measure %s mul_mat %s %dx%d M=%d: %s", name, w_type, N, K, M, exc)
        finally:
            b.unload(bufs[0].view())
            for sb in bufs:
                sb.close()



# ---------------------------------------------------------------------------------------------
# the relay crossing between hubs


def measure_relay(devices: list[Device], reps: int = 20) -> float:
    """Seconds one relay crossing adds between two hubs (:mod:`vkxsplit.relay`, as the row split
    crosses: the relay waits until hub 0's segment completed, then submits hub 1's): host time
    of an empty segment on hub 0 followed through the relay by an empty segment on hub 1, less
    that of the one segment on hub 0 waited for directly and one submit (the cost model counts
    each segment's submit apart). The median of ``reps`` rounds after two warm-up rounds."""
    import threading

    from .relay import Relay

    a, b = Sequence(devices[0], "probe-relay-a"), Sequence(devices[1], "probe-relay-b")
    relay = Relay("probe-relay", spin_s=0.0 if any(d.is_cpu for d in devices) else None)
    try:
        a.end()
        b.end()
        submit = []
        for _ in range(reps + 2):  # (the hub's submit overhead, as _measure_hub_basics has it)
            t = time.perf_counter()
            b.submit()
            submit.append(time.perf_counter() - t)
            b.wait()

        def single() -> float:
            t = time.perf_counter()
            a.submit()
            a.wait()
            return time.perf_counter() - t

        def crossing() -> float:
            done = threading.Event()
            t = time.perf_counter()
            va = a.submit()
            relay.enqueue(lambda: [("hub0", a.timeline, va)], submit=lambda: (b.submit(), done.set()))
            if not done.wait(30.0):
                relay.check()
                raise VkxError("the relay crossing being measured did not happen within 30 s")
            b.wait()
            relay.check()
            return time.perf_counter() - t

        one = [single() for _ in range(reps + 2)][2:]
        via = [crossing() for _ in range(reps + 2)][2:]
    finally:
        relay.close()
        a.close()
        b.close()
        relay.close_timelines()
    return max(1e-6, _median(via) - _median(one) - _median(submit[2:]))


# ---------------------------------------------------------------------------------------------
# the all-reduce's threshold

#: partial sizes (bytes as f32) :func:`measure_reduce` times: from a few decode rows of a small
#: model to a 512-token step of an 8192-wide one
REDUCE_SIZES = tuple(4096 << (2 * i) for i in range(7))  # 4 KiB ... 16 MiB


def measure_reduce(device: Device, sizes: tuple[int, ...] = REDUCE_SIZES, reps: int = 3) -> dict[str, Any]:
    """GPU seconds of one hub's half of a row-split all-reduce per partial size, both ways
    (vkxsplit.hubs): f32 (the partial copied into host pages, then summed with the other's
    f32 from host pages) and bf16 (the partial rounded to bf16 twice, for itself and into the
    host pages, then summed with the other's bf16 from host pages). One device plays both
    shards: its "other" partial is host pages it wrote, which is what a crossing reads (host
    memory over the bus). The relay's crossing is the same either way and not part of it.

    ``min_bytes``: the smallest size from which bf16 took no longer than f32 at that size and
    every larger one (None: bf16 lost at the largest size); ``sizes``, ``f32_s``, ``bf16_s``:
    the times behind it."""
    from .attach import HostMapping, _memfd, host_page_align, import_host_pages
    from .vk.memory import Buffer, _align

    top = max(sizes)
    align = host_page_align(device)
    size = _align(top, align)
    fd = _memfd(2 * size, "vkxsplit-probe-reduce")
    mapping = blk = None
    bufs: list[Any] = []
    try:
        mapping = HostMapping(fd.fd, 2 * size, align)
        blk = import_host_pages(device, mapping.addr, 2 * size, "probe-reduce")
        pub, peer = Buffer(blk, 0, size, "probe-published"), Buffer(blk, size, size, "probe-peer")
        mem = device.memory
        own = mem.alloc(top, "device", "probe-own")
        bufs.append(own)
        own16 = mem.alloc(top // 2, "device", "probe-own16")
        bufs.append(own16)
        dst = mem.alloc(top, "device", "probe-sum")
        bufs.append(dst)
        seq = Sequence(device, "probe-zero")
        try:  # defined contents (the validation layer, and no NaN slow paths)
            seq.fill(own, 0)
            seq.end()
            seq.run()
        finally:
            seq.close()

        def record(seq: Sequence, n: int, parts: str) -> None:
            if parts == "f32":
                record_copy(seq, own, pub, n * 4)
            else:
                record_convert(seq, own, own16, n, "f32", "bf16")
                record_convert(seq, own, pub, n, "f32", "bf16")
            seq.barrier()
            record_link_sum(seq, own if parts == "f32" else own16, peer, dst, n, parts=parts)
            seq.barrier()

        def timed(n: int, parts: str) -> float:
            seq = Sequence(device, f"probe-reduce-{parts}")
            ts = Timestamps(device, 2) if device.timestamp_bits else None
            try:
                record(seq, n, parts)  # (warm-up: first-use work, caches)
                if ts is not None:
                    seq.write_timestamp(ts, 0)
                for _ in range(reps):
                    record(seq, n, parts)
                if ts is not None:
                    seq.write_timestamp(ts, 1)
                seq.end()
                t = time.perf_counter()
                seq.run()
                host = time.perf_counter() - t
                if ts is not None:
                    got = ts.read()
                    return max(1e-9, float(got[1] - got[0]) * 1e-9 / reps)
                return host / (reps + 1)
            finally:
                seq.close()
                if ts is not None:
                    ts.close()

        ladder = sorted(sizes)
        f32 = [timed(b // 4, "f32") for b in ladder]
        b16 = [timed(b // 4, "bf16") for b in ladder]
    finally:
        for b in bufs:
            b.close()
        if blk is not None:
            blk.close()
        if mapping is not None:
            mapping.close()
        fd.close()
    return {"min_bytes": reduce_min_bytes(ladder, f32, b16), "sizes": ladder, "f32_s": f32, "bf16_s": b16}


def reduce_min_bytes(sizes: list[int], f32_s: list[float], bf16_s: list[float]) -> int | None:
    """The smallest of ``sizes`` (ascending) from which bf16 is no slower than f32 at it and at
    every larger size; None when bf16 is slower at the largest."""
    best: int | None = None
    for b, a32, a16 in zip(reversed(sizes), reversed(f32_s), reversed(bf16_s)):
        if a16 > a32:
            break
        best = b
    return best


# ---------------------------------------------------------------------------------------------
# hub timing of a graph (the cost model's hub runner)


def hub_node_times(device: Device, graph: Graph, before_step: Callable[[], None] | None = None,
                   steps: int = 2) -> dict[int, float]:
    """Seconds of each node of ``graph`` run on the hub alone: GPU timestamps around every node
    give the shares, and two timestamps around the whole graph (recorded without the others,
    which cost time themselves) the total (the last of ``steps`` runs; the first warms up)."""
    plan = Planner().plan(graph, "none")
    ex = Executor(device, plan, trace=True, name=f"calibrate {graph.name}")
    try:
        st = None
        for _ in range(max(1, steps)):
            if before_step is not None:
                before_step()
            st = ex.run()
        assert st is not None
        times = st.op_times()
    finally:
        ex.close()
    out = {it.node.index: times[id(it)] for it in plan.items if isinstance(it, HubOp) and it.node is not None}
    ts = Timestamps(device, 2)
    seq = Sequence(device, f"calibrate {graph.name} (total)")
    try:
        seq.write_timestamp(ts, 0)
        record_graph(seq, graph)
        seq.write_timestamp(ts, 1)
        seq.end()
        for _ in range(max(1, steps)):
            if before_step is not None:
                before_step()
            seq.run()
        t = ts.read()
        total = max(0.0, (t[1] - t[0]) * 1e-9)
    finally:
        seq.close()
        ts.close()
    parts = sum(out.values())
    if parts > 0 and total > 0:
        out = {k: v * total / parts for k, v in out.items()}
    return out



__all__ = ["REDUCE_SIZES", "MeasuringCostModel", "hub_node_times", "measure_reduce", "measure_relay",
           "reduce_min_bytes"]
