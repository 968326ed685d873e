"""Hub timeline points moved onto other semaphores by the GPU, without a host wait.

:func:`relay` and :class:`Relay` queue an empty batch on the hub queue that waits for a hub
point and signals a point of a timeline a backend imported (the device's own hub timeline is
not exportable). :class:`SyncFdBridge` does the same through sync_file fds and binary
semaphores, for backends whose driver speaks sync_file fences but not timeline semaphores.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from ..errors import EnvironmentProblem, VkxError
from ..vk.api import NULL, check, ffi, lib, new, vk
from ..vk.event import HANDLE_SYNC_FD as SEM_SYNC_FD
from ..vk.event import Timeline
from .counters import Point
from .handles import hub_event_support

if TYPE_CHECKING:
    from ..vk.device import Device


# ---------------------------------------------------------------------------------------------
# GPU-side relay (no host wait)


def relay(device: Device, point: Point, target: Point) -> None:
    """Queue an empty batch on the hub queue that waits for ``point`` and signals ``target``.

    Used to re-express a hub point on a timeline a backend imported (the device's own hub
    timeline is not exportable), without the host waiting.
    """
    (wt, wv), (st, sv) = point, target
    wsem = ffi.new("VkSemaphore[1]", [wt.handle])
    wval = ffi.new("uint64_t[1]", [wv])
    stage = ffi.new("VkPipelineStageFlags[1]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT])
    ssem = ffi.new("VkSemaphore[1]", [st.handle])
    sval = ffi.new("uint64_t[1]", [sv])
    tsi = new("VkTimelineSemaphoreSubmitInfo", waitSemaphoreValueCount=1, pWaitSemaphoreValues=wval,
              signalSemaphoreValueCount=1, pSignalSemaphoreValues=sval)
    si = new("VkSubmitInfo", pNext=tsi, waitSemaphoreCount=1, pWaitSemaphores=wsem, pWaitDstStageMask=stage,
             commandBufferCount=0, signalSemaphoreCount=1, pSignalSemaphores=ssem)
    device.submit(si)


class Relay:
    """:func:`relay` onto one target timeline with the submit structures built once (a backend
    relays once per step and hub point: this is on the per-step path)."""

    def __init__(self, device: Device, target: Timeline) -> None:
        self.device = device
        self.target = target
        self._wsem = ffi.new("VkSemaphore[1]")
        self._wval = ffi.new("uint64_t[1]")
        self._stage = ffi.new("VkPipelineStageFlags[1]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT])
        self._ssem = ffi.new("VkSemaphore[1]", [target.handle])
        self._sval = ffi.new("uint64_t[1]")
        self._tsi = new("VkTimelineSemaphoreSubmitInfo", waitSemaphoreValueCount=1, pWaitSemaphoreValues=self._wval,
                        signalSemaphoreValueCount=1, pSignalSemaphoreValues=self._sval)
        self._si = new("VkSubmitInfo", pNext=self._tsi, waitSemaphoreCount=1, pWaitSemaphores=self._wsem,
                       pWaitDstStageMask=self._stage, commandBufferCount=0, signalSemaphoreCount=1,
                       pSignalSemaphores=self._ssem)
        self._lock = threading.Lock()

    def __call__(self, point: Point, value: int) -> None:
        """Queue a batch that waits for ``point`` and signals ``value`` on the target."""
        with self._lock:  # the structures are shared; device.submit copies them
            self._wsem[0] = point[0].handle
            self._wval[0] = point[1]
            self._sval[0] = value
            self.device.submit(self._si)


# ---------------------------------------------------------------------------------------------
# sync_file bridging (binary semaphores, temporary SYNC_FD import / copy-transference export)


class SyncFdBridge:
    """Move hub timeline points to and from sync_file fds, for backends whose driver speaks
    sync_file in/out fences (DRM accelerators) but not timeline semaphores.

    - :meth:`export_point`: a batch waits for the hub point and signals a binary semaphore; the
      semaphore's payload is exported as a sync_file (copy transference: the semaphore is
      unsignalled again afterwards). The hub point must already be *submitted* (a sync_file is a
      fence of submitted work: VUID-VkSemaphoreGetFdInfoKHR-handleType-03254).
    - :meth:`import_to_point`: the sync_file is imported into a binary semaphore temporarily
      (``VK_SEMAPHORE_IMPORT_TEMPORARY_BIT``; Vulkan owns the fd on success) and a batch waits on
      it and signals the backend's timeline point.

    Written to the spec; only constructed where the device reports SYNC_FD import and export for
    binary semaphores, which no machine here does, so it has never run.
    """

    def __init__(self, device: Device) -> None:
        why = hub_event_support(device)["sync_fd"]
        if why is not None:
            raise EnvironmentProblem(f"sync_file bridging is unavailable: {why}",
                                     "the backend joins through the host bridge instead")
        self.device = device
        self._lock = threading.Lock()
        self._out = self._binary(export=True)
        self._in = self._binary(export=False)
        device.adopt(self)

    def _binary(self, export: bool) -> Any:
        exp = new("VkExportSemaphoreCreateInfo", handleTypes=SEM_SYNC_FD) if export else None
        sci = new("VkSemaphoreCreateInfo", pNext=exp if exp is not None else NULL)
        out = ffi.new("VkSemaphore*")
        check(lib.vkCreateSemaphore(self.device.handle, sci, NULL, out), "vkCreateSemaphore(binary)")
        return out[0]

    def _submit(self, wait: tuple[Any, int | None], signal: tuple[Any, int | None]) -> None:
        (wsem, wv), (ssem, sv) = wait, signal
        ws = ffi.new("VkSemaphore[1]", [wsem])
        wvals = ffi.new("uint64_t[1]", [wv or 0])
        stage = ffi.new("VkPipelineStageFlags[1]", [vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT])
        ss = ffi.new("VkSemaphore[1]", [ssem])
        svals = ffi.new("uint64_t[1]", [sv or 0])
        tsi = new("VkTimelineSemaphoreSubmitInfo", waitSemaphoreValueCount=1, pWaitSemaphoreValues=wvals,
                  signalSemaphoreValueCount=1, pSignalSemaphoreValues=svals)
        si = new("VkSubmitInfo", pNext=tsi, waitSemaphoreCount=1, pWaitSemaphores=ws, pWaitDstStageMask=stage,
                 commandBufferCount=0, signalSemaphoreCount=1, pSignalSemaphores=ss)
        self.device.submit(si)

    def export_point(self, point: Point) -> Any:
        """A sync_file (owned :class:`vkxsplit.native.Fd`) that signals when ``point`` is reached."""
        from ..native import Fd

        tl, value = point
        if value > tl.last:
            raise VkxError(f"cannot export {tl.name} value {value} as a sync_file before it is submitted "
                           f"(last submitted value {tl.last})")
        with self._lock:
            self._submit((tl.handle, value), (self._out, None))
            gi = new("VkSemaphoreGetFdInfoKHR", semaphore=self._out, handleType=SEM_SYNC_FD)
            fd = ffi.new("int*")
            check(self.device.fn("vkGetSemaphoreFdKHR")(self.device.handle, gi, fd), "vkGetSemaphoreFdKHR(SYNC_FD)")
        return Fd(fd[0])

    def import_to_point(self, sync_file: Any, target: Point) -> None:
        """Signal ``target`` (on the GPU) when ``sync_file`` signals; ``sync_file`` stays the caller's."""
        tl, value = target
        dup = os.dup(sync_file.fileno() if hasattr(sync_file, "fileno") else int(sync_file))
        with self._lock:
            ii = new("VkImportSemaphoreFdInfoKHR", semaphore=self._in, handleType=SEM_SYNC_FD, fd=dup,
                     flags=vk.VK_SEMAPHORE_IMPORT_TEMPORARY_BIT)
            res = self.device.fn("vkImportSemaphoreFdKHR")(self.device.handle, ii)
            if res < 0:
                os.close(dup)
                check(res, "vkImportSemaphoreFdKHR(SYNC_FD, TEMPORARY)")
            self._submit((self._in, None), (tl.handle, value))

    def close(self) -> None:
        if self.device.handle is None or self._out is None:
            return
        lib.vkDestroySemaphore(self.device.handle, self._out, NULL)
        lib.vkDestroySemaphore(self.device.handle, self._in, NULL)
        self._out = self._in = None
        self.device.disown(self)
