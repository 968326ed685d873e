"""Command sequences: record once, replay many times.

A :class:`Sequence` is one primary command buffer (``SIMULTANEOUS_USE``, so a replay can be
queued while the previous one still runs). Recording tracks which byte ranges each dispatch
reads and writes and puts a memory barrier only where a later command touches a range an
earlier one wrote (or writes one it read). Submitting signals the device's hub timeline (and
any extra points) and can wait on other backends' points; the structs for a given set of
semaphores are built once and only their values change per submit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import VkxError
from .api import NULL, check, ffi, lib, new, next_serial, vk
from .event import Timeline, default_timeout
from .kernel import Bindable, Kernel, as_range

log = logging.getLogger("vkxsplit.vk")

if TYPE_CHECKING:
    from .device import Device

_ALL_ACCESS = (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
               | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
# Between two dispatches only the compute stage needs ordering: a narrower barrier than the
# compute+transfer one lets drivers skip flushing the copy engine path.
_SHADER_ACCESS = vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
_COMPUTE = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT


def hub_timeline(device: Device) -> Timeline:
    """The device's own timeline: every sequence submit signals its next value."""
    t = device.__dict__.get("_hub_timeline")
    if t is None or t.handle is None:
        # Not exportable: when it was, the H200 run had the validation layer report command
        # buffers still pending after a host wait on it, and the CUDA hand-off benchmark hung
        # (not yet understood). Backends that import timelines wait on a relay instead
        # (vkxsplit.attach.relay: one empty submit on the hub queue, no host wait).
        t = device.__dict__["_hub_timeline"] = Timeline(device, name=f"hub:{device.name}")
    return t


Point = tuple[Timeline, int]


class _Submit:
    """Pre-built VkSubmitInfo for one (wait semaphores, signal semaphores) signature."""

    def __init__(self, seq: Sequence, waits: list[Timeline], signals: list[Timeline]) -> None:
        nw, ns = len(waits), len(signals)
        self.wait_sems = ffi.new(f"VkSemaphore[{max(1, nw)}]", [t.handle for t in waits] or [NULL])
        self.wait_vals = ffi.new(f"uint64_t[{max(1, nw)}]")
        self.wait_stages = ffi.new(f"VkPipelineStageFlags[{max(1, nw)}]",
                                   [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT] * max(1, nw))
        self.sig_sems = ffi.new(f"VkSemaphore[{ns}]", [t.handle for t in signals])
        self.sig_vals = ffi.new(f"uint64_t[{ns}]")
        self.cbs = ffi.new("VkCommandBuffer[1]", [seq.cb])
        self.tsi = new("VkTimelineSemaphoreSubmitInfo", waitSemaphoreValueCount=nw,
                       pWaitSemaphoreValues=self.wait_vals, signalSemaphoreValueCount=ns,
                       pSignalSemaphoreValues=self.sig_vals)
        self.si = new("VkSubmitInfo", pNext=self.tsi, waitSemaphoreCount=nw,
                      pWaitSemaphores=self.wait_sems if nw else NULL,
                      pWaitDstStageMask=self.wait_stages if nw else NULL, commandBufferCount=1,
                      pCommandBuffers=self.cbs, signalSemaphoreCount=ns, pSignalSemaphores=self.sig_sems)


class Sequence:
    """A recorded list of dispatches, copies and barriers (Kompute's "sequence")."""

    def __init__(self, device: Device, name: str = "") -> None:
        self.device = device
        self.name = name or "sequence"
        self._serial = next_serial()
        self.dispatches = 0
        self.barriers = 0
        self.submits = 0
        self.last_value = 0
        self._recording = False
        self._keep: list[Any] = []
        self._submits: dict[tuple[int, ...], _Submit] = {}
        self._pending_w: list[tuple[int, int, int]] = []  # (block serial, start, end) written
        self._pending_r: list[tuple[int, int, int]] = []
        self._pending_xfer = False  # a copy/fill was recorded since the last barrier
        self.timeline = hub_timeline(device)
        ai = new("VkCommandBufferAllocateInfo", commandPool=device.command_pool,
                 level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1)
        out = ffi.new("VkCommandBuffer*")
        with device._pool_lock:
            check(lib.vkAllocateCommandBuffers(device.handle, ai, out), "vkAllocateCommandBuffers")
        self.cb = out[0]
        self._barrier = new("VkMemoryBarrier", srcAccessMask=_ALL_ACCESS, dstAccessMask=_ALL_ACCESS)
        self._host_barrier = new("VkMemoryBarrier", srcAccessMask=_ALL_ACCESS,
                                 dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT)
        self._publish_barrier = new("VkMemoryBarrier", srcAccessMask=_ALL_ACCESS,
                                    dstAccessMask=_ALL_ACCESS | vk.VK_ACCESS_HOST_READ_BIT)
        self._shader_barrier = new("VkMemoryBarrier", srcAccessMask=_SHADER_ACCESS,
                                   dstAccessMask=_SHADER_ACCESS)
        device.adopt(self)
        self.begin()

    # -- recording ------------------------------------------------------------------------

    def begin(self) -> Sequence:
        """Start (re-)recording; drops what was recorded before."""
        if self._recording:
            raise VkxError(f"sequence {self.name} is already recording")
        with self.device._pool_lock:
            check(lib.vkResetCommandBuffer(self.cb, 0), "vkResetCommandBuffer")
        bi = new("VkCommandBufferBeginInfo", flags=vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT)
        check(lib.vkBeginCommandBuffer(self.cb, bi), "vkBeginCommandBuffer")
        self._recording = True
        self._keep.clear()
        self.dispatches = 0
        self.barriers = 0
        # Order against whatever earlier submissions on this queue wrote.
        self.barrier()
        return self

    def _touch(self, bindings: list[Bindable], writes: tuple[int, ...], transfer: bool = False) -> None:
        ranges = [as_range(b) for b in bindings]
        need = False
        for i, (_h, o, s, blk) in enumerate(ranges):
            for (b2, s2, e2) in self._pending_w:
                if b2 == blk and o < e2 and s2 < o + s:
                    need = True
                    break
            if not need and i in writes:
                for (b2, s2, e2) in self._pending_r:
                    if b2 == blk and o < e2 and s2 < o + s:
                        need = True
                        break
            if need:
                break
        if need:
            if transfer or self._pending_xfer:
                self.barrier()
            else:
                self._compute_barrier()
        for i, (_h, o, s, blk) in enumerate(ranges):
            (self._pending_w if i in writes else self._pending_r).append((blk, o, o + s))
        self._pending_xfer = self._pending_xfer or transfer

    def barrier(self) -> None:
        """A full compute/transfer memory barrier."""
        self._require_recording()
        lib.vkCmdPipelineBarrier(self.cb, _STAGES, _STAGES, 0, 1, self._barrier, 0, NULL, 0, NULL)
        self.barriers += 1
        self._pending_w.clear()
        self._pending_r.clear()
        self._pending_xfer = False

    def publish_barrier(self) -> None:
        """A full barrier whose destination also includes the host (HOST stage, HOST_READ):
        the memory domain operation that makes this device's writes available to the host
        domain, i.e. written back out of its caches to memory. What a later command publishes
        to another device through host pages (:mod:`vkxsplit.ops.link`) is recorded after it."""
        self._require_recording()
        lib.vkCmdPipelineBarrier(self.cb, _STAGES, _STAGES | vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                                 self._publish_barrier, 0, NULL, 0, NULL)
        self.barriers += 1
        self._pending_w.clear()
        self._pending_r.clear()
        self._pending_xfer = False

    def _compute_barrier(self) -> None:
        """Dispatch -> dispatch ordering (shader writes visible to later shader reads/writes)."""
        lib.vkCmdPipelineBarrier(self.cb, _COMPUTE, _COMPUTE, 0, 1, self._shader_barrier, 0, NULL, 0, NULL)
        self.barriers += 1
        self._pending_w.clear()
        self._pending_r.clear()

    def dispatch(self, kernel: Kernel, bindings: list[Bindable], push: bytes | tuple[Any, ...] = b"",
                 groups: tuple[int, int, int] | int = 1) -> None:
        """Record ``kernel`` over ``bindings`` with ``push`` constants on ``groups`` workgroups."""
        self._require_recording()
        if isinstance(push, tuple):
            push = kernel.pack(*push)
        if len(push) != kernel.push_size:
            raise VkxError(f"kernel {kernel.name} takes {kernel.push_size} bytes of push constants, "
                           f"got {len(push)}")
        g = (groups, 1, 1) if isinstance(groups, int) else groups
        maxg = self.device.physical.limits["maxComputeWorkGroupCount"]
        if any(x > m for x, m in zip(g, maxg)) or min(g) < 1:
            raise VkxError(f"kernel {kernel.name}: {g} workgroups is outside the device's "
                           f"range (1..{maxg})")
        ds = kernel.descriptor_set(bindings)
        self._touch(bindings, kernel.writes)
        lib.vkCmdBindPipeline(self.cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, kernel.pipeline)
        dss = ffi.new("VkDescriptorSet[1]", [ds])
        lib.vkCmdBindDescriptorSets(self.cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, kernel.layout, 0, 1, dss, 0, NULL)
        if push:
            pbuf = ffi.from_buffer(push)
            lib.vkCmdPushConstants(self.cb, kernel.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push), pbuf)
        lib.vkCmdDispatch(self.cb, g[0], g[1], g[2])
        self.dispatches += 1

    def copy(self, src: Bindable, dst: Bindable, size: int | None = None) -> None:
        """Copy bytes between buffers (whole ``src`` by default)."""
        self._require_recording()
        sh, so, ss, _ = as_range(src)
        dh, do, ds, _ = as_range(dst)
        n = ss if size is None else size
        if n > ss or n > ds:
            raise VkxError(f"copy of {n} bytes does not fit ({ss} -> {ds})")
        self._touch([src, dst], (1,), transfer=True)
        region = new("VkBufferCopy", srcOffset=so, dstOffset=do, size=n)
        lib.vkCmdCopyBuffer(self.cb, sh, dh, 1, region)

    def fill(self, dst: Bindable, word: int = 0) -> None:
        """Fill ``dst`` with a repeated 32-bit word (size rounded down to 4)."""
        self._require_recording()
        h, o, s, _ = as_range(dst)
        self._touch([dst], (0,), transfer=True)
        lib.vkCmdFillBuffer(self.cb, h, o, s & ~3, word & 0xFFFFFFFF)

    def end(self) -> Sequence:
        """Finish recording (adds a barrier that makes results visible to the host)."""
        self._require_recording()
        lib.vkCmdPipelineBarrier(self.cb, _STAGES, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, self._host_barrier,
                                 0, NULL, 0, NULL)
        check(lib.vkEndCommandBuffer(self.cb), "vkEndCommandBuffer")
        self._recording = False
        return self

    @property
    def recording(self) -> bool:
        """Still recording (``end()`` not called yet)."""
        return self._recording

    def write_timestamp(self, ts: Timestamps, index: int, reset: bool = True) -> None:
        """Reset and write GPU timestamp ``index`` of ``ts`` (after earlier commands finish).
        ``reset=False``: the query was reset earlier in this recording (:meth:`reset_timestamps`),
        so no reset command sits between the commands being timed."""
        self._require_recording()
        if reset:
            lib.vkCmdResetQueryPool(self.cb, ts.handle, index, 1)
        lib.vkCmdWriteTimestamp(self.cb, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, ts.handle, index)

    def reset_timestamps(self, ts: Timestamps) -> None:
        """Reset every query of ``ts`` with one command (before writing them with ``reset=False``)."""
        self._require_recording()
        lib.vkCmdResetQueryPool(self.cb, ts.handle, 0, ts.count)

    def _require_recording(self) -> None:
        if not self._recording:
            raise VkxError(f"sequence {self.name} is not recording (call begin())")

    # -- submission -----------------------------------------------------------------------

    def submit(self, waits: list[Point] = (), signals: list[Point] = ()) -> int:  # type: ignore[assignment]
        """Queue the recorded commands after ``waits``; signal ``signals`` and the hub
        timeline when done. Returns the hub timeline value that marks completion."""
        if self._recording:
            self.end()
        sig = [*signals, (self.timeline, 0)]
        key = tuple(id(t) for t, _ in waits) + (-1,) + tuple(id(t) for t, _ in sig)
        s = self._submits.get(key)
        if s is None:
            s = self._submits[key] = _Submit(self, [t for t, _ in waits], [t for t, _ in sig])
        for i, (_t, v) in enumerate(waits):
            s.wait_vals[i] = v
        value = self.timeline.next()
        for i, (_t, v) in enumerate(signals):
            s.sig_vals[i] = v
        s.sig_vals[len(signals)] = value
        self.device.submit(s.si)
        self.submits += 1
        self.last_value = value
        return value

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the last submit to complete."""
        if self.last_value:
            self.timeline.wait(self.last_value, timeout)

    def run(self, timeout: float | None = None) -> None:
        """Submit and wait."""
        self.submit()
        self.wait(timeout)

    def close(self) -> None:
        """Free the command buffer, once its last submission has completed: freeing a pending
        one is undefined. Another API may have seen it complete (a CUDA stream that waited on
        its point), Vulkan has not until the host looks: so look, bounded; still pending after
        that (a stuck wait on a dead backend), the buffer is left to the pool (freed with the
        device) and an error logged, rather than freed under the GPU."""
        if self.cb is None or self.device.handle is None:
            return
        tl = self.timeline
        if self.last_value and tl.handle is not None and tl.value < self.last_value:
            try:
                tl.wait(self.last_value, min(5.0, default_timeout()))
            except VkxError as exc:
                log.error("sequence %s closed while its last submission is pending (%s): its command "
                          "buffer stays allocated until the device closes", self.name, exc)
                self.cb = None
                self.device.disown(self)
                return
        with self.device._pool_lock:
            cbs = ffi.new("VkCommandBuffer[1]", [self.cb])
            lib.vkFreeCommandBuffers(self.device.handle, self.device.command_pool, 1, cbs)
        self.cb = None
        self.device.disown(self)


def staged_upload(dst: Any, data: np.ndarray, offset: int = 0) -> None:
    """Copy host bytes into a device-only buffer through a host-visible staging buffer."""
    dev = dst.device
    with dev.memory.alloc(data.nbytes, "host", name="staging") as tmp:
        tmp.numpy(np.uint8, (data.nbytes,))[:] = data
        from .kernel import View

        seq = Sequence(dev, "upload")
        try:
            seq.copy(tmp, View(dst, offset, data.nbytes), data.nbytes)
            seq.run()
        finally:
            seq.close()


class Uploader:
    """Host bytes into device-only buffers through a ring of staging buffers allocated once:
    the host fills one slot while the GPU copies the others. A model's weights go through one
    of these, not through a staging allocation and a submit-and-wait per chunk (allocating
    host-visible memory costs the driver milliseconds a time; a 16 GB load paid it a thousand
    times). Buffers the host can map are written directly."""

    def __init__(self, device: Device, slot_bytes: int = 32 << 20, slots: int = 3) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise VkxError(f"uploader needs slots of > 0 bytes (got {slots} x {slot_bytes})")
        self.device = device
        self.slot_bytes = int(slot_bytes)
        self.staged_bytes = 0
        self._slots: list[tuple[Any, Sequence]] = []
        try:
            for i in range(slots):
                buf = device.memory.alloc(self.slot_bytes, "host", name=f"upload staging {i}")
                self._slots.append((buf, Sequence(device, f"upload {i}")))
        except BaseException:
            self.close()
            raise
        self._next = 0

    def write(self, dst: Any, data: Any, offset: int = 0) -> None:
        """Copy ``data`` into ``dst`` at ``offset``: directly when the host can map ``dst``,
        else staged (:meth:`stage`)."""
        if dst.host_visible:
            dst.write(data, offset)
        else:
            self.stage(dst, data, offset)

    def stage(self, dst: Any, data: Any, offset: int = 0) -> None:
        """Copy ``data`` into ``dst`` at ``offset`` through the staging slots, whatever memory
        ``dst`` is in. Returns once the bytes are in a slot; :meth:`finish` waits for the GPU."""
        from .kernel import View

        src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset < 0 or offset + src.nbytes > dst.size:
            raise VkxError(f"write of {src.nbytes} bytes at {offset} overflows buffer '{dst.name}' "
                           f"({dst.size} bytes)")
        for o in range(0, src.nbytes, self.slot_bytes):
            n = min(self.slot_bytes, src.nbytes - o)
            tmp, seq = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            seq.wait()  # the slot's previous copy has read it
            tmp.numpy(np.uint8, (self.slot_bytes,))[:n] = src[o:o + n]
            if not seq.recording:  # (a new sequence starts recording)
                seq.begin()
            seq.copy(View(tmp, 0, n), View(dst, offset + o, n), n)
            seq.submit()
            self.staged_bytes += n

    def finish(self, timeout: float | None = None) -> None:
        """Wait for every copy queued so far."""
        for _, seq in self._slots:
            seq.wait(timeout)

    def close(self) -> None:
        """Wait for the copies, then free the slots (each sequence waits for its own last
        submission before freeing its command buffer). A slot whose copy is still pending after
        that bounded wait (logged by :meth:`Sequence.close`) keeps its staging buffer, as the
        sequence keeps its command buffer: the copy may still read it (both go with the device)."""
        slots, self._slots = self._slots, []
        for buf, seq in slots:
            seq.close()
            tl = seq.timeline
            if seq.last_value and tl.handle is not None and tl.value < seq.last_value:
                continue
            buf.close()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def staged_download(src: Any, offset: int, nbytes: int) -> np.ndarray:
    dev = src.device
    with dev.memory.alloc(nbytes, "host", name="staging") as tmp:
        from .kernel import View

        seq = Sequence(dev, "download")
        try:
            seq.copy(View(src, offset, nbytes), tmp, nbytes)
            seq.run()
        finally:
            seq.close()
        return tmp.numpy(np.uint8, (nbytes,)).copy()


class Timestamps:
    """A timestamp query pool: ``seq.write_timestamp(ts, i)`` records GPU time i; ``read()``
    returns nanoseconds (for benchmarks and the executor's trace)."""

    def __init__(self, device: Device, count: int) -> None:
        if device.timestamp_bits == 0:
            raise VkxError(f"the queue of '{device.name}' has no timestamps")
        self.device = device
        self.count = count
        self._serial = next_serial()
        qci = new("VkQueryPoolCreateInfo", queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=count)
        out = ffi.new("VkQueryPool*")
        check(lib.vkCreateQueryPool(device.handle, qci, NULL, out), "vkCreateQueryPool")
        self.handle = out[0]
        device.adopt(self)

    def read(self, count: int | None = None) -> np.ndarray:
        """The first ``count`` (default all) timestamps, in ns. Only queries a submitted command
        wrote may be read: with ``VK_QUERY_RESULT_WAIT_BIT`` a query reset and never written
        waits forever on some drivers (the NVIDIA one), so a pool written only in part is read
        up to what was written."""
        n = self.count if count is None else int(count)
        if not 0 <= n <= self.count:
            raise VkxError(f"read of {n} timestamps from a pool of {self.count}")
        data = np.zeros(n, np.uint64)
        if n == 0:
            return data.astype(np.float64)
        check(lib.vkGetQueryPoolResults(self.device.handle, self.handle, 0, n, data.nbytes,
                                        ffi.from_buffer(data), 8,
                                        vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT),
              "vkGetQueryPoolResults")
        mask = (1 << self.device.timestamp_bits) - 1 if self.device.timestamp_bits < 64 else (1 << 64) - 1
        period = float(self.device.physical.limits["timestampPeriod"])
        return (data & np.uint64(mask)).astype(np.float64) * period

    def close(self) -> None:
        if self.handle is not None and self.device.handle is not None:
            lib.vkDestroyQueryPool(self.device.handle, self.handle, NULL)
        self.handle = None
        self.device.disown(self)

