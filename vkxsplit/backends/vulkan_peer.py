"""The ``vulkan-peer`` backend: a second Vulkan device attached to the hub as a peer.

(Registered as ``vulkan-peer``: the planner reserves ``vulkan`` as an alias of the hub itself.)

The peer has its own ``VkDevice`` (another physical GPU, or a second logical device on the
hub's own physical device) and runs the hub's own SPIR-V ``mul_mat`` kernels
(:func:`vkxsplit.ops.mul_mat.record_mul_mat`) on its own queue. The planner hands it
:class:`~vkxsplit.backend.MatMulJob` s exactly as it does for cuda/cpu/npu-emu, so it can put
layers, or row ranges of a matrix (tensor split), on the other GPU. See ``docs/MULTI_GPU.md``.

Memory modes (``memory=``):

``shared``  the peer and the hub report the same deviceUUID and driverUUID (one physical
            device: a second logical device). Hub memory is imported in place, zero copies:
            blocks of the hub's ``export`` pool by opaque fd (``VkImportMemoryFdInfoKHR`` with
            a ``dup`` of the fd, a dedicated allocation of the export's ``allocationSize`` and
            memory type), host-allocation chunks by host pointer
            (``VkImportMemoryHostPointerInfoEXT``). Weights, x and y are bound where they are.
``split``   different devices (two GPUs). Opaque fds may not cross (Vulkan shares them only
            between devices with equal UUIDs), so the arena is ``host_allocation``: memfd pages
            both devices import by host pointer. The peer's **weights live in its own memory**:
            the first job naming a weight row slice queues a one-time GPU copy (the peer's own
            copy engine, over PCIe) from the shared host pages into a peer ``device`` buffer of
            just those rows. Per job, x is copied into peer memory (one copy) and y's columns
            ``[r0, r1)`` are written straight into the shared pages. Those bytes are the
            cross-device traffic (:data:`traffic`).
``auto``    ``shared`` where it is possible, else ``split``.

Events: where the hub exports timeline semaphores as opaque fds and the peer imports them (same
UUIDs: NVIDIA, one GPU), the backend's stream timeline (on the hub, exportable) is imported
into the peer device and signalled by the peer's queue; a hub point the peer must wait for is
first :func:`~vkxsplit.attach.relay` ed on the hub queue to an exportable relay timeline the peer
imported. No host synchronisation at all. Elsewhere (lavapipe: no semaphore fds; two different
GPUs) the :class:`~vkxsplit.attach.HostBridge` thread waits for the hub point, submits the
peer's recorded sequence, waits for the peer's queue, and signals the stream timeline from the
host. Either way :meth:`VulkanPeerBackend.mul_mat` only enqueues: the caller never blocks.

Sequences are recorded once per job shape and buffers (key: weight, x, y views, M/N/K, strides,
rows) and replayed. A hub buffer's peer import (and every sequence naming it) is released when
the hub frees the buffer's chunk, after the peer's queue has passed its last use.

Helpers for a K-split (a down projection whose K is divided between the GPUs, each computing a
partial sum over its K slice): :func:`k_split_bounds`, :func:`k_slice_rows`,
:func:`k_slice_job` and :func:`record_reduce_add` (the hub adds the partials on the GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..attach import (
    AttachStats,
    HostBridge,
    Point,
    SharedView,
    hub_event_support,
    hub_memory_support,
    import_host_pages,
    relay,
)
from ..backend import Availability, Backend, Capabilities, MatMulJob, retire_timeline, weight_place
from ..errors import EnvironmentProblem, KernelError, VkxError, WaitTimeout
from ..ops.quant import TYPES, row_bytes, weight_type
from ..vk.api import NULL, ffi, new, next_serial, vk
from ..vk.command import Sequence, hub_timeline
from ..vk.device import Device
from ..vk.event import HANDLE_OPAQUE_FD as SEM_OPAQUE_FD
from ..vk.event import Timeline
from ..vk.instance import PhysicalDeviceInfo
from ..vk.kernel import Bindable, View
from ..vk.memory import HANDLE_HOST_ALLOCATION, HANDLE_OPAQUE_FD, Block, Buffer

if TYPE_CHECKING:
    from ..attach import SharedBuffer

log = logging.getLogger("vkxsplit.backends.vulkan_peer")

MEMORY_MODES = ("auto", "shared", "split")
EVENT_MODES = ("auto", "timeline_opaque_fd", "host")


# ---------------------------------------------------------------------------------------------
# cross-device traffic


class PeerTraffic:
    """Bytes between the hub and peer devices, in total and per step. Thread-safe.

    - ``crossed_bytes``: activation bytes that moved between two devices' memories during jobs
      (``split`` mode: x copied into the peer, y columns written back to the shared pages)
    - ``inplace_bytes``: activation bytes peer jobs read/wrote in place in the hub's memory
      (``shared`` mode; one physical device: nothing crosses a bus)
    - ``loaded_bytes``: weight bytes copied into peer memory (``split`` mode, once per slice)
    - ``jobs``, ``recorded`` (sequences recorded), ``replays`` (jobs that reused one)

    ``begin_step()`` then ``step()`` gives the deltas of one step (what the bench reports).
    """

    FIELDS = ("crossed_bytes", "inplace_bytes", "loaded_bytes", "jobs", "recorded", "replays")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            for f in self.FIELDS:
                setattr(self, f, 0)
            self._base = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, n in counts.items():
                setattr(self, k, getattr(self, k) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f: getattr(self, f) for f in self.FIELDS}

    def begin_step(self) -> None:
        snap = self.snapshot()
        with self._lock:
            self._base = snap

    def step(self) -> dict[str, int]:
        """Counts since :meth:`begin_step`."""
        snap = self.snapshot()
        with self._lock:
            return {f: snap[f] - self._base[f] for f in self.FIELDS}

    @property
    def step_crossed_bytes(self) -> int:
        return self.step()["crossed_bytes"]


#: The process-wide counters (a backend takes ``traffic=`` for its own).
traffic = PeerTraffic()


def _default_traffic() -> PeerTraffic:
    return traffic


# ---------------------------------------------------------------------------------------------
# compatibility


def available() -> Availability:
    """The peer needs only what the hub needs (a Vulkan loader); a second logical device on the
    hub's own physical device always exists."""
    try:
        from ..vk import api  # noqa: F401
    except Exception as exc:  # EnvironmentProblem from the loader check
        return Availability(False, str(exc).splitlines()[0])
    return Availability(True)


def _uuid(b: bytes) -> str:
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_mismatch(hub: PhysicalDeviceInfo, peer: PhysicalDeviceInfo) -> str | None:
    """Why opaque-fd memory and semaphores of ``hub`` cannot be imported on ``peer`` (``None``:
    they can). Vulkan shares opaque fds only between devices reporting the same deviceUUID and
    driverUUID (the spec's external memory/semaphore compatibility tables)."""
    diffs = []
    if hub.device_uuid != peer.device_uuid:
        diffs.append(f"its deviceUUID {_uuid(peer.device_uuid)} is not the hub's {_uuid(hub.device_uuid)}")
    if hub.driver_uuid != peer.driver_uuid:
        diffs.append(f"its driverUUID {_uuid(peer.driver_uuid)} is not the hub's {_uuid(hub.driver_uuid)}")
    if not diffs:
        return None
    return (f"'{peer.name}' cannot import the hub's opaque fds: " + " and ".join(diffs)
            + " (Vulkan shares opaque-fd memory and semaphores only between devices with the same "
              "deviceUUID and driverUUID)")


def peer_memory_support(hub: Device, peer: PhysicalDeviceInfo) -> dict[str, str | None]:
    """For ``opaque_fd`` and ``host_allocation``: ``None`` when hub and peer can share memory
    that way, else the reason."""
    from ..vk.interop import buffer_handle_support

    hub_sup = hub_memory_support(hub)
    out: dict[str, str | None] = {}
    why = uuid_mismatch(hub.physical, peer) or hub_sup["opaque_fd"]
    if why is None and not peer.has("VK_KHR_external_memory_fd"):
        why = f"'{peer.name}' lacks VK_KHR_external_memory_fd"
    if why is None and not buffer_handle_support(peer, HANDLE_OPAQUE_FD)["importable"]:
        why = f"'{peer.name}' cannot import storage buffers from opaque fds"
    out["opaque_fd"] = why
    why = hub_sup["host_allocation"]
    if why is None and not peer.has("VK_EXT_external_memory_host"):
        why = f"'{peer.name}' lacks VK_EXT_external_memory_host"
    if why is None and not buffer_handle_support(peer, HANDLE_HOST_ALLOCATION)["importable"]:
        why = f"'{peer.name}' cannot import host allocations as storage buffers"
    out["host_allocation"] = why
    return out


def peer_timeline_support(hub: Device, peer: PhysicalDeviceInfo) -> str | None:
    """``None`` when the peer can import the hub's timelines as opaque fds (GPU-side waits),
    else the reason (the host bridge is used)."""
    from ..vk.interop import semaphore_handle_support

    why = uuid_mismatch(hub.physical, peer) or hub_event_support(hub)["timeline_opaque_fd"]
    if why is None and not peer.has("VK_KHR_external_semaphore_fd"):
        why = f"'{peer.name}' lacks VK_KHR_external_semaphore_fd"
    if why is None and not semaphore_handle_support(peer, SEM_OPAQUE_FD, True)["importable"]:
        why = f"'{peer.name}' cannot import timeline semaphores from opaque fds"
    return why


def pick_peer_physical(hub: Device, selector: str | int | None = None) -> PhysicalDeviceInfo:
    """The physical device for the peer: ``selector`` (index or name part, as ``VKXSPLIT_DEVICE``),
    else another device of the hub's type (a second GPU), else the hub's own physical device
    (the peer is then a second logical device on it)."""
    inst = hub.instance
    if selector is not None:
        return inst.select(selector)
    others = [d for d in inst.physical_devices()
              if d.device_uuid != hub.physical.device_uuid and d.device_type == hub.physical.device_type]
    return others[0] if others else hub.physical


# ---------------------------------------------------------------------------------------------
# bookkeeping records


@dataclass
class _Import:
    """A hub block/chunk imported into the peer device."""

    key: tuple[Any, ...]
    block: Block
    buffer: Buffer
    last_use: int = 0
    plans: set[tuple[Any, ...]] = field(default_factory=set)
    weights: set[tuple[Any, ...]] = field(default_factory=set)


@dataclass
class _LocalWeight:
    """``split`` mode: a weight row slice in peer memory (and its one-time load)."""

    key: tuple[Any, ...]
    buffer: Buffer
    nbytes: int
    load: Sequence | None
    plans: set[tuple[Any, ...]] = field(default_factory=set)
    last_use: int = 0
    staging: Buffer | None = None  # host bytes on their way in (a weight the hub keeps private)


@dataclass
class _Plan:
    """One recorded job: replayed for every job with the same key."""

    key: tuple[Any, ...]
    seq: Sequence
    imports: tuple[tuple[Any, ...], ...]
    weight: _LocalWeight | None
    x_local: Buffer | None
    crossed: int
    inplace: int
    last_use: int = 0
    closed: bool = False


def _vkey(v: SharedView | View) -> tuple[Any, int, int]:
    return (*weight_place(v), v.size)


def _empty_submit(device: Device, waits: list[Point], signals: list[Point]) -> None:
    """A batch without commands: waits for ``waits``, then signals ``signals``."""
    nw, ns = len(waits), len(signals)
    wsem = ffi.new(f"VkSemaphore[{max(1, nw)}]", [t.handle for t, _ in waits] or [NULL])
    wval = ffi.new(f"uint64_t[{max(1, nw)}]", [v for _, v in waits] or [0])
    stage = ffi.new(f"VkPipelineStageFlags[{max(1, nw)}]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT] * max(1, nw))
    ssem = ffi.new(f"VkSemaphore[{ns}]", [t.handle for t, _ in signals])
    sval = ffi.new(f"uint64_t[{ns}]", [v for _, v in signals])
    tsi = new("VkTimelineSemaphoreSubmitInfo", waitSemaphoreValueCount=nw, pWaitSemaphoreValues=wval,
              signalSemaphoreValueCount=ns, pSignalSemaphoreValues=sval)
    si = new("VkSubmitInfo", pNext=tsi, waitSemaphoreCount=nw, pWaitSemaphores=wsem if nw else NULL,
             pWaitDstStageMask=stage if nw else NULL, commandBufferCount=0, signalSemaphoreCount=ns,
             pSignalSemaphores=ssem)
    device.submit(si)


# ---------------------------------------------------------------------------------------------
# the backend


class VulkanPeerBackend(Backend):
    """A second Vulkan device computing ``mul_mat`` on the hub's memory (see the module doc).

    ``device``: a selector (index or name part), a :class:`PhysicalDeviceInfo` of the hub's
    instance (a logical device is created on it and owned), or an open :class:`Device` (not
    owned; it must not be the hub device itself); default :func:`pick_peer_physical`. ``memory``: ``auto`` / ``shared`` /
    ``split``; ``events``: ``auto`` / ``timeline_opaque_fd`` / ``host``. ``traffic``: a
    :class:`PeerTraffic` (default: the process-wide :data:`traffic`). ``name``: the planner's
    name for this participant (default ``vulkan-peer``; give each peer its own when there are
    several GPUs).
    """

    # what a closed peer still held (leak checks read them after close)
    _closed_exempt = ("name", "imports", "resident_weight_bytes")

    name = "vulkan-peer"
    caps = Capabilities(ops={"mul_mat"}, weight_types=set(TYPES), compute_dtypes={"f32"},
                        memory_handles=("opaque_fd", "host_allocation"),
                        event_handles=("timeline_opaque_fd", "host"))

    def __init__(self, hub: Device, *, device: Device | PhysicalDeviceInfo | str | int | None = None,
                 memory: str = "auto", events: str = "auto", timeout: float | None = None,
                 counters: AttachStats | None = None, traffic: PeerTraffic | None = None,
                 name: str | None = None) -> None:
        if name is not None:
            self.name = name  # type: ignore[misc]  # per instance: one name per peer GPU
        if memory not in MEMORY_MODES:
            raise VkxError(f"unknown peer memory mode {memory!r} (one of {', '.join(MEMORY_MODES)})")
        if events not in EVENT_MODES:
            raise VkxError(f"unknown peer event mode {events!r} (one of {', '.join(EVENT_MODES)})")
        # state close() relies on, before anything can fail
        self._closed = True
        self.bridge = None
        self.peer: Device | None = None
        self._owns_peer = False
        self._lock = threading.RLock()
        self._imports: dict[tuple[Any, ...], _Import] = {}
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._weights: dict[tuple[Any, ...], _LocalWeight] = {}
        self._retired: list[tuple[int, Callable[[], None]]] = []
        self._sems: dict[int, tuple[Timeline, Timeline]] = {}
        self._stream: Timeline | None = None
        self.relay_timeline: Timeline | None = None
        self._relay_import: Timeline | None = None
        self._gflops: float | None = None
        self.traffic = traffic if traffic is not None else _default_traffic()

        if isinstance(device, Device):
            if device is hub or device.handle is hub.handle:
                raise VkxError("the vulkan peer needs its own VkDevice, not the hub device",
                               "pass a selector, a PhysicalDeviceInfo, or another Device")
            phys = device.physical
        elif isinstance(device, PhysicalDeviceInfo):
            phys = device
        else:
            phys = pick_peer_physical(hub, device)
        self.mismatch = uuid_mismatch(hub.physical, phys)
        self.memory_support = peer_memory_support(hub, phys)
        mem = self.memory_support
        if memory == "shared" or (memory == "auto" and mem["opaque_fd"] is None):
            if mem["opaque_fd"] is not None:
                raise EnvironmentProblem(
                    f"the vulkan peer '{phys.name}' cannot share the hub's memory in place: {mem['opaque_fd']}",
                    "use memory='split' (weights copied into the peer, activations through shared host "
                    "pages) or pick a peer on the hub's own GPU")
            self.mode = "shared"
            handles: tuple[str, ...] = ("opaque_fd", "host_allocation") if mem["host_allocation"] is None \
                else ("opaque_fd",)
        else:
            if mem["host_allocation"] is not None:
                raise EnvironmentProblem(
                    f"the vulkan peer '{phys.name}' and the hub share no memory: opaque fd: "
                    f"{mem['opaque_fd']}; host allocation: {mem['host_allocation']}",
                    "both devices need VK_EXT_external_memory_host for the split mode")
            self.mode = "split"
            handles = ("host_allocation",)
        self.timeline_support = peer_timeline_support(hub, phys)
        if events == "timeline_opaque_fd" and self.timeline_support is not None:
            raise EnvironmentProblem(f"GPU-side events with the vulkan peer are impossible: {self.timeline_support}",
                                     "use events='auto' (the host bridge)")
        ev: tuple[str, ...] = ("timeline_opaque_fd", "host") if (
            self.timeline_support is None and events != "host") else ("host",)
        caps = dataclasses.replace(type(self).caps, memory_handles=handles, event_handles=ev)

        if isinstance(device, Device):
            peer = device
        else:
            peer = Device(hub.instance, phys)
            self._owns_peer = True
        self.peer = peer
        try:
            super().__init__(hub, timeout=timeout, counters=counters, caps=caps)
        except BaseException:
            self._closed = False
            self.close()
            raise
        try:
            self.peer_timeline = hub_timeline(peer)  # every peer submit signals its next value
            if self.events.kind == "timeline_opaque_fd":
                self._stream = self._import_timeline(self.timeline)
                self.relay_timeline = Timeline(hub, exportable=True, name=f"{self.name}-relay")
                self._relay_import = self._import_timeline(self.relay_timeline)
            else:
                self.bridge = HostBridge(hub, self.timeline, name=self.name, run=self._run_bridged,
                                          timeout=self.timeout, counters=self.stats)
            # closing either device closes this backend first: after everything it made so far
            self._serial = next_serial()
            peer.adopt(self)
        except BaseException:
            self.close()
            raise
        log.info("vulkan peer '%s' (%s memory, events %s)%s", peer.name, self.mode, self.events.describe(),
                 "" if self.mismatch is None else f": {self.mismatch}")

    # -- peer-side memory --------------------------------------------------------------------

    def _import_fd(self, sb: SharedBuffer) -> _Import:
        """The hub ``export``-pool block of ``sb``, imported by opaque fd (once)."""
        hb = sb.buffer.block
        key = ("opaque_fd", hb._serial)
        imp = self._imports.get(key)
        if imp is not None:
            return imp
        if self.mismatch is not None:
            raise EnvironmentProblem(f"refusing to import '{sb.name}' by opaque fd: {self.mismatch}",
                                     "use memory='split' for a peer on another GPU")
        assert self.peer is not None
        if hb.type_index >= len(self.peer.physical.memory_types):
            raise VkxError(f"the hub's memory type {hb.type_index} does not exist on '{self.peer.name}'")
        fd, size, _offset, _dedicated = sb.arena.export_fd(sb)
        try:
            dup = os.dup(fd.fd)
        finally:
            fd.close()
        ii = new("VkImportMemoryFdInfoKHR", handleType=HANDLE_OPAQUE_FD, fd=dup)
        try:  # a dedicated allocation (Block adds it for fd imports) of the export's size and type
            pb = Block(self.peer.memory, "peer-import", size, hb.type_index, import_info=ii)
        except BaseException:
            os.close(dup)  # Vulkan owns the fd only once the import succeeded
            raise
        if pb.allocation_size != size:
            pb.close()
            raise VkxError(f"importing '{sb.name}' on '{self.peer.name}': allocationSize {pb.allocation_size} "
                           f"differs from the export's {size}")
        return self._adopt_import(key, pb, sb)

    def _import_host(self, sb: SharedBuffer) -> _Import:
        """The host-allocation chunk of ``sb``, imported by host pointer (once)."""
        ch = sb.chunk
        key = ("host_allocation", ch.id)
        imp = self._imports.get(key)
        if imp is not None:
            return imp
        assert self.peer is not None and ch.mapping is not None
        pb = import_host_pages(self.peer, ch.mapping.addr, ch.size, "peer-host")
        return self._adopt_import(key, pb, sb)

    def _adopt_import(self, key: tuple[Any, ...], pb: Block, sb: SharedBuffer) -> _Import:
        imp = _Import(key, pb, Buffer(pb, 0, pb.size, f"peer:{sb.name}"))
        self._imports[key] = imp
        # Runs when the hub frees the chunk: before its host mapping goes (host chunks).
        sb.chunk.listeners.append(lambda _ch, key=key: self._forget_import(key))
        return imp

    def _peer_view(self, v: SharedView) -> tuple[_Import, View]:
        """The peer's binding of a hub view (importing its memory on first use)."""
        sb = v.shared
        if sb.closed:
            raise VkxError(f"shared buffer '{sb.name}' is closed")
        if sb.kind == "opaque_fd":
            imp = self._import_fd(sb)
            return imp, View(imp.buffer, sb.buffer.offset + v.offset, v.size)
        if sb.kind == "host_allocation":
            imp = self._import_host(sb)
            return imp, View(imp.buffer, sb.chunk_offset + v.offset, v.size)
        raise KernelError(f"backend {self.name} cannot reach {sb.kind} memory (buffer '{sb.name}')",
                          "allocate it from a SharedArena negotiated with this backend "
                          "(SharedArena(hub, [backend]))")

    # -- plans (recorded sequences) ----------------------------------------------------------

    def _job_key(self, job: MatMulJob) -> tuple[Any, ...]:
        return (job.w_type, job.M, job.N, job.K, job.x_stride, job.y_stride, job.r0, job.r1, job.w_row0,
                _vkey(job.weight), _vkey(job.x), _vkey(job.y))

    def _plan(self, job: MatMulJob) -> _Plan:
        from ..ops.mul_mat import record_mul_mat

        key = self._job_key(job)
        with self._lock:
            if self._closed:
                raise VkxError(f"backend {self.name} is closed")
            plan = self._plans.get(key)
            if plan is not None:
                self.traffic.add(replays=1)
                return plan
            assert self.peer is not None
            ximp, xv = self._peer_view(job.x)
            yimp, yv = self._peer_view(job.y)
            y_bytes = job.M * job.rows * 4
            x_span = ((job.M - 1) * job.x_stride + job.K) * 4
            seq = Sequence(self.peer, f"{self.name}:{job.name or 'mul_mat'}")
            x_local = None
            lw = None
            try:
                if self.mode == "shared":
                    wimp, wv = self._peer_view(job.weight)
                    record_mul_mat(seq, wv, job.w_type, xv, yv, job.M, job.rows, job.K, x_stride=job.x_stride,
                                   y_stride=job.y_stride, w_row_offset=job.r0 - job.w_row0, y_col_offset=job.r0)
                    imports = (wimp.key, ximp.key, yimp.key)
                    crossed, inplace = 0, x_span + y_bytes
                else:
                    lw, wimp = self._local_weight(job)
                    x_local = self.peer.memory.alloc(x_span, "device", name=f"{self.name}:x")
                    seq.copy(View(xv.buffer, xv.offset, x_span), x_local, x_span)
                    record_mul_mat(seq, lw.buffer, job.w_type, x_local, yv, job.M, job.rows, job.K,
                                   x_stride=job.x_stride, y_stride=job.y_stride, w_row_offset=0,
                                   y_col_offset=job.r0)
                    imports = ((wimp.key,) if wimp is not None else ()) + (ximp.key, yimp.key)
                    crossed, inplace = x_span + y_bytes, 0
                seq.end()
            except BaseException:
                seq.close()
                if x_local is not None:
                    x_local.close()
                raise
            plan = _Plan(key, seq, imports, lw, x_local, crossed, inplace)
            self._plans[key] = plan
            for k in imports:
                self._imports[k].plans.add(key)
            if lw is not None:
                lw.plans.add(key)
            self.traffic.add(recorded=1)
            return plan

    def _local_weight(self, job: MatMulJob) -> tuple[_LocalWeight, _Import]:
        """``split`` mode: the job's weight rows in peer memory, with a pending load the first time."""
        assert self.peer is not None
        in_arena = isinstance(job.weight, SharedView)
        wimp, wv = self._peer_view(job.weight) if in_arena else (None, None)
        key = ("w", *weight_place(job.weight), job.w_row0, job.r0, job.r1, job.w_type, job.K)
        lw = self._weights.get(key)
        if lw is not None:
            return lw, wimp
        rb = job.weight_row_bytes
        first, n = (job.r0 - job.w_row0) * rb, job.rows * rb
        buf = self.peer.memory.alloc(n, "device", name=f"{self.name}:w[{job.r0}:{job.r1}]")
        load = Sequence(self.peer, f"{self.name}:load")
        staging = None
        try:
            if in_arena:
                assert wv is not None
                load.copy(View(wv.buffer, wv.offset + first, n), buf, n)
            else:  # the hub keeps the weight in its own memory: load the rows from the host bytes
                src = np.asarray(job.weight_host).reshape(-1).view(np.uint8)[first:first + n]
                staging = self.peer.memory.alloc(n, "host", name=f"{self.name}:w-staging")
                staging.numpy(np.uint8)[:] = src
                load.copy(staging, buf, n)
            load.end()
        except BaseException:
            load.close()
            buf.close()
            if staging is not None:
                staging.close()
            raise
        lw = _LocalWeight(key, buf, n, load, staging=staging)
        self._weights[key] = lw
        if wimp is not None:
            wimp.weights.add(key)
            # the hub buffer may be freed and its place reused by another tensor while the chunk
            # lives on: the peer's copy must go with the buffer, not with the chunk
            job.weight.shared.on_close.append(lambda _sb, key=key: self._forget_weight(key))
        return lw, wimp

    def _forget_weight(self, key: tuple[Any, ...]) -> None:
        out: list[Any] = []
        with self._lock:
            last = self._drop_weight(key, out)
        self._release_after(last, out, "a freed weight's peer copy")

    def _submit(self, plan: _Plan, waits: list[Point], signals: list[Point]) -> int:
        """Queue ``plan`` (after its weight load, the first time) on the peer queue."""
        with self._lock:
            if plan.closed or self._closed:
                raise VkxError(f"backend {self.name}: a buffer of this job was freed (or the backend "
                               "closed) while the job was queued")
            lw = plan.weight
            if lw is not None and lw.load is not None:
                lv = lw.load.submit(waits=waits)
                self._retired.append((lv, lw.load.close))
                lw.load = None
                if lw.staging is not None:
                    self._retired.append((lv, lw.staging.close))
                    lw.staging = None
                self.traffic.add(loaded_bytes=lw.nbytes)
            v = plan.seq.submit(waits=waits, signals=signals)
            plan.last_use = v
            if lw is not None:
                lw.last_use = v
            for k in plan.imports:
                imp = self._imports.get(k)
                if imp is not None:
                    imp.last_use = v
            return v

    # -- peer-side events ----------------------------------------------------------------------

    def _import_timeline(self, tl: Timeline) -> Timeline:
        """The peer's import of an exportable hub timeline (cached)."""
        got = self._sems.get(id(tl))
        if got is not None and got[0] is tl:
            return got[1]
        assert self.peer is not None
        fd = tl.export_fd()
        try:
            imp = Timeline(self.peer, import_fd=fd, name=f"{tl.name}@{self.name}")
        except BaseException:
            os.close(fd)  # not consumed: the import failed
            raise
        self._sems[id(tl)] = (tl, imp)
        return imp

    def _peer_point(self, point: Point) -> Point:
        """``point`` as something the peer queue can wait on, without a host wait."""
        tl, value = point
        if tl.device is self.peer:
            return point
        if tl is self.timeline:
            assert self._stream is not None
            return (self._stream, value)
        if tl.device is not self.hub:
            raise VkxError(f"backend {self.name} cannot wait on {tl.name}: it is neither the hub's nor the peer's")
        if tl.exportable:
            return (self._import_timeline(tl), value)
        assert self.relay_timeline is not None and self._relay_import is not None
        rv = self.relay_timeline.next()
        relay(self.hub, point, (self.relay_timeline, rv))  # hub queue: point -> relay value
        return (self._relay_import, rv)

    def _signal_only(self, value: int) -> None:
        """GPU-event mode: signal ``value`` of the stream from the peer queue, in order."""
        if self._stream is None or self.peer is None or self.peer.handle is None:
            return
        try:
            with self._lock:
                _empty_submit(self.peer, [], [(self._stream, value),
                                              (self.peer_timeline, self.peer_timeline.next())])
        except Exception as exc:  # the peer device is lost: nothing left to signal from
            log.error("%s: signalling %s = %d from the peer queue failed: %s", self.name,
                      self.timeline.name, value, exc)

    # -- the hook ------------------------------------------------------------------------------

    def mul_mat(self, job: MatMulJob, wait: Point | None, signal: Point) -> None:
        try:
            self.check_job(job, signal)
            plan = self._plan(job)
        except Exception as exc:
            if self.bridge is None and signal[0] is self.timeline:
                self._signal_only(signal[1])
            raise self.refuse(signal, exc) from None
        self.traffic.add(jobs=1, crossed_bytes=plan.crossed, inplace_bytes=plan.inplace)
        self._sweep()
        if self.bridge is not None:
            self.bridge.enqueue(wait, signal[1], plan)
            return
        assert self._stream is not None
        try:
            waits = [self._peer_point(wait)] if wait is not None else []
            self._submit(plan, waits, [(self._stream, signal[1])])
        except BaseException:
            self._signal_only(signal[1])  # the hub never waits forever on this value
            raise

    def _run_bridged(self, plan: _Plan) -> None:
        """Bridge thread, after the hub point: run the recorded job and wait for the peer queue."""
        v = self._submit(plan, [], [])
        self.peer_timeline.wait(v, self.timeout)
        self._sweep()

    # -- retiring ------------------------------------------------------------------------------

    def _sweep(self) -> None:
        """Run the releases whose peer work has passed (no waiting)."""
        with self._lock:
            if not self._retired or self.peer is None or self.peer.handle is None:
                return
            reached = self.peer_timeline.value
            done = [f for v, f in self._retired if v <= reached]
            self._retired = [(v, f) for v, f in self._retired if v > reached]
            for f in done:
                self._call(f)

    @staticmethod
    def _call(f: Callable[[], None]) -> None:
        try:
            f()
        except Exception as exc:  # keep releasing
            log.warning("vulkan peer release: %s", exc)

    def _drop_plan(self, key: tuple[Any, ...], out: list[Any]) -> int:
        """Under the lock: unlink a plan; its resources go to ``out``; returns its last use."""
        plan = self._plans.pop(key, None)
        if plan is None:
            return 0
        plan.closed = True
        out.append(plan.seq)
        if plan.x_local is not None:
            out.append(plan.x_local)
        if plan.weight is not None:
            plan.weight.plans.discard(key)
        for k in plan.imports:
            imp = self._imports.get(k)
            if imp is not None:
                imp.plans.discard(key)
        return plan.last_use

    def _drop_weight(self, key: tuple[Any, ...], out: list[Any]) -> int:
        lw = self._weights.pop(key, None)
        if lw is None:
            return 0
        last = lw.last_use
        for pk in list(lw.plans):
            last = max(last, self._drop_plan(pk, out))
        if lw.load is not None:
            out.append(lw.load)
        if lw.staging is not None:
            out.append(lw.staging)
        out.append(lw.buffer)
        return last

    def _release_after(self, last: int, things: list[Any], what: str) -> None:
        """Close ``things`` once the peer queue passed ``last`` (waits for it, bounded)."""
        if not things:
            return
        if self.peer is not None and self.peer.handle is not None and last > self.peer_timeline.value:
            try:
                self.peer_timeline.wait(last, self.timeout)
            except (WaitTimeout, VkxError) as exc:  # still in use: leak rather than free under the GPU
                log.error("vulkan peer: %s is still in use by the peer queue (%s); not released", what, exc)
                return
        with self._lock:
            for t in things:
                self._call(t.close)

    def _forget_import(self, key: tuple[Any, ...]) -> None:
        """The hub freed a chunk: drop its import and everything recorded on it."""
        out: list[Any] = []
        with self._lock:
            imp = self._imports.pop(key, None)
            if imp is None:
                return
            last = imp.last_use
            for wk in list(imp.weights):
                last = max(last, self._drop_weight(wk, out))
            for pk in list(imp.plans):
                last = max(last, self._drop_plan(pk, out))
            out.append(imp.block)
        self._release_after(last, out, f"the import of hub chunk {key}")

    def unload(self, weight: SharedView | View) -> None:
        """Drop the peer copies of ``weight`` (``split``) and the sequences naming it."""
        cid, off = weight_place(weight)
        out: list[Any] = []
        last = 0
        with self._lock:
            for wk in [k for k in self._weights if k[1] == cid and k[2] == off]:
                last = max(last, self._drop_weight(wk, out))
            for pk in [k for k in self._plans if k[9][0] == cid and k[9][1] == off]:
                last = max(last, self._drop_plan(pk, out))
        self._release_after(last, out, "an unloaded weight")

    # -- stats and lifetime --------------------------------------------------------------------

    @property
    def private_weights(self) -> bool:
        """``split`` mode loads its own copy of the rows it computes: the model may keep its
        weights in the hub's device memory (not in the shared host pages) and hand the rows'
        bytes over in ``MatMulJob.weight_host``."""
        return getattr(self, "mode", "") == "split"

    @property
    def stages_activations(self) -> bool:
        """``split`` mode reaches only host pages: the model keeps its activations in the hub's
        device memory and the plan stages each job's x out and y back through arena shadows."""
        return getattr(self, "mode", "") == "split"

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of weights held in peer memory (``split`` mode)."""
        with self._lock:
            return sum(w.nbytes for w in self._weights.values())

    @property
    def imports(self) -> int:
        """Hub blocks/chunks currently imported into the peer."""
        return len(self._imports)

    def calibrate(self) -> dict[str, float]:
        """GFLOP/s of an f16 ``mul_mat`` (M=32, 1024 x 1024) on peer-local buffers (measured once)."""
        from ..ops.mul_mat import record_mul_mat

        if self._gflops is None:
            assert self.peer is not None
            M, N, K = 32, 1024, 1024
            bufs = [self.peer.memory.alloc(n, "device", name="calibrate") for n in (N * K * 2, M * K * 4, M * N * 4)]
            seq = None
            try:
                with self._lock:  # recording: the command pool is shared with the bridge thread's releases
                    seq = Sequence(self.peer, "calibrate")
                    for b in bufs:
                        seq.fill(b, 0)
                    record_mul_mat(seq, bufs[0], "f16", bufs[1], bufs[2], M, N, K)
                    seq.end()
                seq.run(self.timeout)  # warm-up
                t = time.perf_counter()
                for _ in range(3):
                    seq.run(self.timeout)
                dt = (time.perf_counter() - t) / 3
                self._gflops = 2.0 * M * N * K / max(dt, 1e-9) / 1e9
            finally:
                if seq is not None:
                    seq.wait(self.timeout)
                    with self._lock:
                        seq.close()
                for b in bufs:
                    b.close()
        return {"mul_mat_gflops": self._gflops}

    def release(self) -> None:
        """Stop (close() closed the bridge: every value it handed out is signalled): pending
        stream values are signalled, the peer's queue drains (bounded), every import, recorded
        sequence and peer buffer is released, and an owned peer device closed."""
        peer = self.peer
        if peer is not None:
            peer.disown(self)
        drained = True
        if peer is not None and peer.handle is not None and "peer_timeline" in self.__dict__:
            try:
                self.peer_timeline.wait(self.peer_timeline.last, self.timeout)
            except (WaitTimeout, VkxError) as exc:
                drained = False
                log.error("vulkan peer '%s' did not drain at close: %s", peer.name, exc)
        if self._stream is not None and drained and self.timeline.handle is not None \
                and self.timeline.value < self.timeline.last:
            self.timeline.signal(self.timeline.last)  # values handed out but never enqueued
        with self._lock:
            things: list[Any] = []
            for pk in list(self._plans):
                self._drop_plan(pk, things)
            for wk in list(self._weights):
                self._drop_weight(wk, things)
            things += [imp.block for imp in self._imports.values()]
            self._imports.clear()
            for _v, f in self._retired:
                self._call(f)
            self._retired.clear()
            if drained:
                for t in things:
                    self._call(t.close)
            for _tl, imp_tl in self._sems.values():
                self._call(imp_tl.close)
            self._sems.clear()
        if self._owns_peer and peer is not None and drained:
            peer.close()
        if drained:  # the relay's hub timeline (the stream's: by close())
            retire_timeline(self.hub, self.relay_timeline)
            self.relay_timeline = None


# ---------------------------------------------------------------------------------------------
# K-split helpers: partial sums over K slices, reduced on the hub


def k_split_bounds(K: int, w_type: str, fractions: Iterable[float] = (0.5, 0.5)) -> list[tuple[int, int]]:
    """``[(k0, k1), ...]`` covering ``[0, K)`` in proportion to ``fractions``, on whole blocks of
    ``w_type`` (every part gets at least one block)."""
    fr = [float(f) for f in fractions]
    bs = weight_type(w_type).block_size
    if K % bs:
        raise KernelError(f"K={K} is not a whole number of {w_type} blocks ({bs})")
    nb = K // bs
    if not fr or min(fr) <= 0 or len(fr) > nb:
        raise KernelError(f"cannot split {nb} blocks of K={K} into parts {fr}")
    total = sum(fr)
    out, acc, prev = [], 0.0, 0
    for i, f in enumerate(fr):
        acc += f
        edge = nb if i == len(fr) - 1 else min(nb - (len(fr) - 1 - i), max(prev + 1, round(nb * acc / total)))
        out.append((prev * bs, edge * bs))
        prev = edge
    return out


def k_slice_rows(w: np.ndarray, w_type: str, K: int, k0: int, k1: int) -> np.ndarray:
    """The raw ggml rows of ``W[:, k0:k1]`` (``w``: raw rows of ``K`` elements of ``w_type``, any
    dtype), as a contiguous ``uint8`` array: what one GPU of a K-split holds."""
    rb = row_bytes(w_type, K)
    raw = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
    if raw.size % rb:
        raise KernelError(f"{raw.size} bytes are not whole {w_type} rows of K={K} ({rb} bytes)")
    b0, b1 = row_bytes(w_type, k0), row_bytes(w_type, k1)
    if not 0 <= k0 < k1 <= K:
        raise KernelError(f"K slice [{k0}, {k1}) outside [0, {K})")
    return np.ascontiguousarray(raw.reshape(-1, rb)[:, b0:b1])


def k_slice_job(weight: SharedView, w_type: str, x: SharedView, partial: SharedView, M: int, N: int, K: int,
                k0: int, k1: int, *, x_stride: int | None = None, name: str = "") -> MatMulJob:
    """The job computing ``partial[m, n] = sum_{k0 <= k < k1} W[n, k] x[m, k]`` from ``weight`` =
    the K slice's raw rows (:func:`k_slice_rows`) and the full f32 ``x`` (row stride
    ``x_stride``, default ``K``)."""
    xs = K if x_stride is None else x_stride
    kk = k1 - k0
    xv = SharedView(x.shared, x.offset + k0 * 4, ((M - 1) * xs + kk) * 4)
    return MatMulJob(weight, w_type, xv, partial, M, N, kk, x_stride=xs, name=name or f"k[{k0}:{k1}]")


def record_reduce_add(seq: Sequence, partials: list[Bindable], out: Bindable, M: int, N: int, *,
                      stride: int | None = None, out_stride: int | None = None) -> None:
    """Record ``out = sum(partials)`` (``M x N`` f32, row strides in elements) on ``seq``'s
    device with the hub's ``add`` kernel: the reduction of a K-split. ``out`` may be
    ``partials[0]`` (accumulate in place)."""
    from ..ops.elementwise import record_add

    if len(partials) < 2:
        raise KernelError(f"reduce_add needs at least two partials, got {len(partials)}")
    s = N if stride is None else stride
    o = N if out_stride is None else out_stride
    record_add(seq, partials[0], partials[1], out, M, N, b_rows=M, a_stride=s, b_stride=s, dst_stride=o)
    for p in partials[2:]:
        record_add(seq, out, p, out, M, N, b_rows=M, a_stride=o, b_stride=s, dst_stride=o)


__all__ = ["EVENT_MODES", "MEMORY_MODES", "PeerTraffic", "VulkanPeerBackend", "available", "k_slice_job",
           "k_slice_rows", "k_split_bounds", "peer_memory_support", "peer_timeline_support",
           "pick_peer_physical", "record_reduce_add", "traffic", "uuid_mismatch"]
