"""Attaching backends to the hub: shared memory, handle negotiation and event bridging.

A backend (CPU thread, NPU process, CUDA device...) computes on memory the hub owns, without
copies, and joins the hub's asynchronous graph through timeline points. This module holds the
pieces every backend uses; ``vkxsplit/backend.py`` holds the backend interface itself and
``docs/ATTACH.md`` tells the whole story.

Memory (:class:`SharedArena`, :class:`SharedBuffer`, :class:`SharedView`)
    Memory the hub binds as a Vulkan buffer (``sb.buffer`` or a :class:`SharedView` go straight
    into ``Sequence.dispatch``) and that the backend reaches without a copy, through the best
    handle both sides support, negotiated in the order of :data:`MEMORY_HANDLES`:

    ``dma_buf``          a dma-buf (dma-heap or udmabuf), mmapped by the backend, imported into
                         Vulkan with ``VkImportMemoryFdInfoKHR(DMA_BUF)``
    ``opaque_fd``        the hub's exportable ``export`` pool; the backend (CUDA, HIP, another
                         Vulkan device) imports the block's opaque fd
    ``host_allocation``  a sealed memfd, mmapped here (and by process backends, fd passed over
                         SCM_RIGHTS), imported with ``VkImportMemoryHostPointerInfoEXT``
    ``staged``           no shared handle: the backend works on a private mirror and every job
                         copies in and out (logged once with the reason, counted in
                         :attr:`AttachStats.staged_bytes`)

Events (:func:`negotiate_events`, :class:`HostBridge`, :class:`SyncFdBridge`, :func:`relay`)
    Each backend stream has a :class:`~vkxsplit.vk.event.Timeline` on the hub device. A backend
    that imports timelines (CUDA: ``timeline_opaque_fd``) waits and signals on its own queue. Where
    neither side can share a semaphore, a :class:`HostBridge` thread waits for the hub point
    (with a timeout), releases the backend's job, and signals the backend's timeline from the
    host when the backend reports completion, so the caller submits a whole chain at once and
    the hub queue waits on not-yet-signalled values (wait-before-signal is legal for timelines).
    A dead or stuck backend is turned into a recorded :class:`~vkxsplit.errors.BackendDied`
    and its pending values are still signalled: the hub never stays blocked.

Host waits made through :func:`host_wait` are counted per thread kind in :data:`stats`, so tests
can assert that submitting a step made none (``stats.host_waits_in_step == 0``).

The modules, one concern each: :mod:`~vkxsplit.attach.counters` (:data:`stats`,
:func:`host_wait`, :data:`Point`), :mod:`~vkxsplit.attach.handles` (what the hub can share and
the negotiation), :mod:`~vkxsplit.attach.host` (host mappings, sealed memfds, host-pointer
import), :mod:`~vkxsplit.attach.arena` (the shared arena, its chunks, buffers and views),
:mod:`~vkxsplit.attach.gpu_relay` (:func:`relay`, :class:`Relay`, :class:`SyncFdBridge`) and
:mod:`~vkxsplit.attach.bridge` (:class:`HostBridge`). This package re-exports their public
names, so ``from vkxsplit.attach import SharedArena`` is the import to write.
"""

from __future__ import annotations

from .arena import DEFAULT_CHUNK, Chunk, SharedArena, SharedBuffer, SharedView
from .bridge import HostBridge, cpu_ticks
from .counters import AttachStats, Point, host_wait, in_bridge_thread, mark_bridge_thread, stats
from .gpu_relay import Relay, SyncFdBridge, relay
from .handles import (
    EVENT_HANDLES,
    MEMORY_HANDLES,
    Choice,
    hub_event_support,
    hub_memory_support,
    negotiate,
    negotiate_events,
    negotiate_memory,
)
from .host import HostMapping, host_page_align, import_host_pages
from .host import _memfd as _memfd  # (vkxsplit.hubs makes the memfds of its links between hubs)

__all__ = [
    "DEFAULT_CHUNK",
    "EVENT_HANDLES",
    "MEMORY_HANDLES",
    "AttachStats",
    "Choice",
    "Chunk",
    "HostBridge",
    "HostMapping",
    "Point",
    "Relay",
    "SharedArena",
    "SharedBuffer",
    "SharedView",
    "SyncFdBridge",
    "cpu_ticks",
    "host_page_align",
    "host_wait",
    "hub_event_support",
    "hub_memory_support",
    "import_host_pages",
    "in_bridge_thread",
    "mark_bridge_thread",
    "negotiate",
    "negotiate_events",
    "negotiate_memory",
    "relay",
    "stats",
]
