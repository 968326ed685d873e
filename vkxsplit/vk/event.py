"""Events: timeline semaphores.

Every backend stream has a :class:`Timeline`; a dependency between backends is a
``(timeline, value)`` point. The host can signal a value, wait for one, and a timeline can be
exported as an opaque fd for backends that import it (CUDA, HIP, another Vulkan device) or
imported from one.

Waits tell slow from dead. A wait's ``timeout`` is a *stall limit*: it fails only after that
long without progress, where progress is its own counter advancing, any peer it watches
reporting progress (:class:`Peer`: a backend's completions, a child process's CPU time) or the
hub noting activity (:func:`note_progress`); a wait on a value marked with
:meth:`Timeline.expect_slow` (the first run of recorded kernels, which drivers compile at
first dispatch) gets ``COLD_FACTOR`` times the limit. A slow wait raises
:class:`~vkxsplit.errors.Stalled` ("no progress for N s while ..."). A watched peer that is gone
(process exited, connection closed, thread ended) raises
:class:`~vkxsplit.errors.BackendDied` naming it at the next poll. Short waits cost nothing
extra: the first slice is one blocking wait of up to ``POLL_S``; only longer waits wake up once
per slice to look at progress and liveness.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import BackendDied, Closable, Stalled, VkxError
from .api import NULL, UINT64_MAX, check, ffi, lib, new, next_serial, vk

if TYPE_CHECKING:
    from .device import Device

HANDLE_OPAQUE_FD = vk.VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD_BIT
HANDLE_SYNC_FD = vk.VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_SYNC_FD_BIT


def default_timeout() -> float:
    """Seconds a wait may go without progress before it is an error (``VKXSPLIT_TIMEOUT_S``,
    default 60; ``inf``: never)."""
    return float(os.environ.get("VKXSPLIT_TIMEOUT_S", "60"))


#: longest blocking slice of a wait (seconds) before it looks at progress and liveness
POLL_S = 0.5

#: Host semaphore calls (counter reads, host signals) are serialized, and waits poll the counter
#: instead of blocking in vkWaitSemaphores, on a device created with synchronization validation
#: on (``Device.serialize_semaphores``). The layer's timeline tracking (Debian 12's 1.3.239)
#: blocks for about 10 s, then logs UNASSIGNED-VkSemaphore-state-timeout ("most likely a
#: validation bug"), when a host thread signals a timeline while another thread waits on or
#: reads it: what every host-bridged backend does. Serialized, the same steps ran without it.
_HOST_SYNC_LOCK = threading.Lock()
_SERIAL_POLL_S = 0.0005
#: a wait on a value marked by :meth:`Timeline.expect_slow` tolerates this many stall limits
COLD_FACTOR = 10.0


class Peer(Protocol):
    """What a wait watches besides its own counter (a backend implements both)."""

    name: str

    def liveness(self) -> str | None:
        """None while alive; else what is gone, e.g. "backend npu-emu's process 123 exited
        with code -9" (cheap: called once per poll slice)."""

    def progress(self) -> Any:
        """A value that changes whenever the peer makes progress (compared with ``!=``)."""


class _Activity:
    """Process-wide count of hub activity notes (a backend answered, a pipeline was built)."""

    count = 0
    what = ""


def note_progress(what: str = "") -> None:
    """Record that the hub or a backend did something: waits that see it keep waiting."""
    _Activity.count += 1  # (a lost increment under a race is harmless: any change counts)
    if what:
        _Activity.what = what


class StallClock:
    """The progress bookkeeping of one wait for ``timeline >= value``: :meth:`poll` raises
    :class:`BackendDied` for a dead peer and :class:`Stalled` once nothing moved for the limit."""

    def __init__(self, timeline: Timeline, value: int, limit: float, peers: Iterable[Peer] = (),
                 what: str = "", start: float | None = None, base: int | None = None) -> None:
        self.timeline = timeline
        self.value = value
        self.limit = limit
        self.peers = tuple(peers)
        self.what = what or f"{timeline.name} to reach {value}"
        self.start = self.changed = time.monotonic() if start is None else start
        self._token: Any = None
        # the counter and the hub activity when the wait began (cheap to read up front; the
        # peers' progress is first read at the first poll)
        self._base = None if base is None else (base, _Activity.count)

    def poll(self, exc_type: type[Stalled] = Stalled) -> float:
        """Check once; returns the seconds left before the stall limit."""
        for p in self.peers:
            why = p.liveness()
            if why:
                raise BackendDied(f"{why} (while waiting for {self.what})",
                                  "the hub keeps running; recreate the backend or plan without it")
        cur = self.timeline._value()
        token = (cur, _Activity.count, tuple(p.progress() for p in self.peers))
        now = time.monotonic()
        if self._token is not None and token != self._token:
            self.changed = now
        elif self._token is None and self._base is not None and token[:2] != self._base:
            self.changed = now  # it moved during the first slice
        self._token = token
        limit = self.limit
        cold = ""
        if cur < self.timeline._slow_until:
            limit *= COLD_FACTOR
            cold = f"; {self.timeline._slow_why}, allowed {limit:g} s"
        idle = now - self.changed
        if idle >= limit:
            watched = f"; watching {', '.join(p.name for p in self.peers)} (alive)" if self.peers else ""
            raise exc_type(
                f"no progress for {idle:.1f} s while waiting for {self.what} (it is at {cur}{cold}){watched}",
                "the hub or a backend is slow or wedged, not dead (a dead peer is reported as such); "
                "if the machine is just loaded, raise VKXSPLIT_TIMEOUT_S (seconds without progress)")
        return limit - idle


class Timeline(Closable):
    """A timeline semaphore owned by this object (``close()`` destroys it once; its methods then
    raise :class:`~vkxsplit.errors.ClosedError`)."""

    def __init__(self, device: Device, initial: int = 0, exportable: bool = False, name: str = "",
                 import_fd: int | None = None) -> None:
        self.device = device
        self.name = name or "timeline"
        self.handle: Any = None
        self._serial = next_serial()
        self._lock = threading.Lock()
        self._last = initial  # the highest value handed out by next()
        self._slow_until = 0  # waits below this value get COLD_FACTOR x their stall limit
        self._slow_why = ""
        self._serial = bool(getattr(device, "serialize_semaphores", False))  # see _HOST_SYNC_LOCK
        tci = new("VkSemaphoreTypeCreateInfo", semaphoreType=vk.VK_SEMAPHORE_TYPE_TIMELINE,
                  initialValue=initial)
        chain: Any = tci
        exp = None
        if exportable:
            if "VK_KHR_external_semaphore_fd" not in device.extensions:
                raise VkxError(f"'{device.name}' cannot export semaphores (no VK_KHR_external_semaphore_fd)",
                               "attached backends will use the host bridge instead")
            exp = new("VkExportSemaphoreCreateInfo", handleTypes=HANDLE_OPAQUE_FD, pNext=tci)
            chain = exp
        sci = new("VkSemaphoreCreateInfo", pNext=chain)
        out = ffi.new("VkSemaphore*")
        check(lib.vkCreateSemaphore(device.handle, sci, NULL, out), "vkCreateSemaphore(timeline)")
        self.handle = out[0]
        self.exportable = exportable
        self._counter = ffi.new("uint64_t*")
        if import_fd is not None:
            ii = new("VkImportSemaphoreFdInfoKHR", semaphore=self.handle, handleType=HANDLE_OPAQUE_FD,
                     fd=import_fd)
            res = device.fn("vkImportSemaphoreFdKHR")(device.handle, ii)
            if res < 0:
                lib.vkDestroySemaphore(device.handle, self.handle, NULL)
                self.handle = None
                check(res, "vkImportSemaphoreFdKHR")
            self._last = self.value
        # (host waits come from several threads at once: each builds its own wait info)
        self._sems = ffi.new("VkSemaphore[1]", [self.handle])
        device.adopt(self)

    def next(self) -> int:
        """Reserve and return the next value to signal."""
        with self._lock:
            self._last += 1
            return self._last

    @property
    def last(self) -> int:
        """The highest value handed out so far (what the stream will reach when idle)."""
        return self._last

    @property
    def value(self) -> int:
        """The value the semaphore has reached now."""
        return self._value()

    def _value(self) -> int:
        if self.handle is None:
            raise self._closed_error("value")
        if self._serial:
            with _HOST_SYNC_LOCK:
                res = lib.vkGetSemaphoreCounterValue(self.device.handle, self.handle, self._counter)
                got = int(self._counter[0])
        else:
            res = lib.vkGetSemaphoreCounterValue(self.device.handle, self.handle, self._counter)
            got = int(self._counter[0])
        check(res, "vkGetSemaphoreCounterValue")
        return got

    def expect_slow(self, value: int, why: str) -> None:
        """Waits for values up to ``value`` may be slow for a known reason (``why``, e.g. the first
        run of recorded kernels): their stall limit is ``COLD_FACTOR`` times longer."""
        with self._lock:
            if value >= self._slow_until:
                self._slow_until, self._slow_why = value, why

    def spin(self, value: int, seconds: float, stop: Any = None) -> bool:
        """Poll the counter until it reaches ``value``, for at most ``seconds`` (or until
        ``stop()``); whether it did. For a relay between GPUs: on the H200 a blocking
        vkWaitSemaphores returned ~1.3 ms late per crossing, polling ~0.2 ms
        (tools/diag_tensor_split.py); callers block after it, in :meth:`wait`."""
        end = time.monotonic() + seconds
        while self.value < value:
            if time.monotonic() >= end or (stop is not None and stop()):
                return False
        return True

    def signal(self, value: int) -> None:
        """Signal ``value`` from the host."""
        si = new("VkSemaphoreSignalInfo", semaphore=self.handle, value=value)
        if self._serial:
            with _HOST_SYNC_LOCK:
                res = lib.vkSignalSemaphore(self.device.handle, si)
        else:
            res = lib.vkSignalSemaphore(self.device.handle, si)
        check(res, "vkSignalSemaphore")
        with self._lock:
            self._last = max(self._last, value)

    def wait(self, value: int, timeout: float | None = None, peers: Iterable[Peer] = (),
             what: str = "") -> None:
        """Block until the semaphore reaches ``value``. ``timeout``: the stall limit (seconds
        without progress; default ``VKXSPLIT_TIMEOUT_S``): :class:`~vkxsplit.errors.Stalled`
        after that long with nothing moving; ``peers``: what else to watch (a dead one raises
        :class:`~vkxsplit.errors.BackendDied` naming it). See the module docstring."""
        if timeout is None:
            timeout = default_timeout()
        vals = ffi.new("uint64_t[1]", [value])
        wi = new("VkSemaphoreWaitInfo", semaphoreCount=1, pSemaphores=self._sems, pValues=vals)
        peers = tuple(peers)
        if timeout == float("inf") and not peers:  # (with peers: the loop below, never stalled)
            while not self._block(wi, value, None):
                pass
            return
        timeout = max(0.0, timeout)
        t0 = time.monotonic()
        base = self._value()
        if base >= value:
            return
        # the first slice is one blocking wait (no wakeup for a wait that ends within it); half
        # the limit at most, so that progress seen at its end still leaves time to wait on
        if self._block(wi, value, min(timeout / 2, POLL_S)):
            return
        clock = StallClock(self, value, timeout, peers, what, t0, base)
        while True:
            left = clock.poll()  # raises for a dead peer or a stall
            if self._block(wi, value, max(0.0, min(left, POLL_S))):
                return

    def _block(self, wi: Any, value: int, seconds: float | None) -> bool:
        """One blocking slice of a wait (``None``: no limit): whether ``value`` was reached."""
        if self._serial:  # poll (see _HOST_SYNC_LOCK)
            end = None if seconds is None else time.monotonic() + seconds
            while self._value() < value:
                if end is not None and time.monotonic() >= end:
                    return False
                time.sleep(_SERIAL_POLL_S)
            return True
        ns = UINT64_MAX if seconds is None else int(seconds * 1e9)
        res = lib.vkWaitSemaphores(self.device.handle, wi, ns)
        if res == vk.VK_TIMEOUT:
            return False
        check(res, "vkWaitSemaphores")
        return True

    def export_fd(self) -> int:
        """A new opaque fd for this semaphore (caller owns it)."""
        gi = new("VkSemaphoreGetFdInfoKHR", semaphore=self.handle, handleType=HANDLE_OPAQUE_FD)
        fd = ffi.new("int*")
        check(self.device.fn("vkGetSemaphoreFdKHR")(self.device.handle, gi, fd), "vkGetSemaphoreFdKHR")
        return fd[0]

    def close(self) -> None:
        if self.handle is not None and self.device.handle is not None:
            lib.vkDestroySemaphore(self.device.handle, self.handle, NULL)
        self.handle = None
        self.device.disown(self)

    def __repr__(self) -> str:
        return f"Timeline({self.name!r}, last={self._last})"


class Gate:
    """Holds queued GPU work back until the host releases it: a host-signalled timeline point
    to put in a submission's waits (benchmarks queue a whole chain behind one, then release
    it, so timestamps see only GPU-side time).

    A watchdog releases the point after ``watchdog_s`` seconds: if enqueueing part of the
    chain itself waited for the GPU (a first-use effect in some drivers), it would otherwise
    wait for the gate forever. :meth:`release` says whether the caller got there first."""

    def __init__(self, device: Device, name: str = "gate") -> None:
        self.timeline = Timeline(device, name=name)

    def hold(self, watchdog_s: float | None = 10.0) -> GateHold:
        """A new held point (``watchdog_s=None``: released at once, for ungated runs)."""
        h = GateHold(self.timeline, self.timeline.next())
        if watchdog_s is None:
            h.release()
        else:
            h._dog = threading.Timer(watchdog_s, h._open)
            h._dog.daemon = True
            h._dog.start()
        return h

    def close(self) -> None:
        self.timeline.close()


class GateHold:
    """One held point of a :class:`Gate` (``point`` goes in the submission's waits)."""

    def __init__(self, timeline: Timeline, value: int) -> None:
        self.point = (timeline, value)
        self._opened = threading.Lock()
        self._dog: threading.Timer | None = None

    def _open(self) -> bool:
        if not self._opened.acquire(blocking=False):
            return False
        self.point[0].signal(self.point[1])
        return True

    def release(self) -> bool:
        """Signal the point; False when the watchdog had already done it (the enqueue behind
        the gate waited for the GPU)."""
        if self._dog is not None:
            self._dog.cancel()
        return self._open()
