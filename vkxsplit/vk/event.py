"""Events: timeline semaphores.

Every backend stream has a :class:`Timeline`; a dependency between backends is a
``(timeline, value)`` point. The host can signal a value, wait for one (always with a
timeout: a peer that never signals raises :class:`WaitTimeout`, it never hangs), and a
timeline can be exported as an opaque fd for backends that import it (CUDA, HIP, another
Vulkan device) or imported from one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import VkxError, WaitTimeout
from .api import NULL, UINT64_MAX, check, ffi, lib, new, next_serial, vk

if TYPE_CHECKING:
    from .device import Device

HANDLE_OPAQUE_FD = vk.VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD_BIT
HANDLE_SYNC_FD = vk.VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_SYNC_FD_BIT


def default_timeout() -> float:
    """Seconds a wait may take before it is an error (``VKXSPLIT_TIMEOUT_S``, default 60)."""
    return float(os.environ.get("VKXSPLIT_TIMEOUT_S", "60"))


class Timeline:
    """A timeline semaphore owned by this object (``close()`` destroys it once)."""

    def __init__(self, device: Device, initial: int = 0, exportable: bool = False, name: str = "",
                 import_fd: int | None = None) -> None:
        self.device = device
        self.name = name or "timeline"
        self.handle: Any = None
        self._serial = next_serial()
        self._lock = threading.Lock()
        self._last = initial  # the highest value handed out by next()
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
        check(lib.vkGetSemaphoreCounterValue(self.device.handle, self.handle, self._counter),
              "vkGetSemaphoreCounterValue")
        return int(self._counter[0])

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
        check(lib.vkSignalSemaphore(self.device.handle, si), "vkSignalSemaphore")
        with self._lock:
            self._last = max(self._last, value)

    def wait(self, value: int, timeout: float | None = None) -> None:
        """Block until the semaphore reaches ``value``; :class:`WaitTimeout` after ``timeout`` s."""
        if timeout is None:
            timeout = default_timeout()
        ns = UINT64_MAX if timeout == float("inf") else int(timeout * 1e9)
        vals = ffi.new("uint64_t[1]", [value])
        wi = new("VkSemaphoreWaitInfo", semaphoreCount=1, pSemaphores=self._sems, pValues=vals)
        res = lib.vkWaitSemaphores(self.device.handle, wi, ns)
        if res == vk.VK_TIMEOUT:
            raise WaitTimeout(
                f"timed out after {timeout:g} s waiting for {self.name} to reach {value} "
                f"(it is at {self.value})",
                "a backend that should signal it is stuck or dead; raise VKXSPLIT_TIMEOUT_S if "
                "the work is just slow")
        check(res, "vkWaitSemaphores")

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
