"""Handle negotiation between the hub and its backends.

What the hub device can share (:func:`hub_memory_support`, :func:`hub_event_support`: ``None``
per kind, else the reason it cannot) and the choice of the best kind every party supports
(:func:`negotiate`, :func:`negotiate_memory`, :func:`negotiate_events`), recorded with the
reason each better kind was rejected (:class:`Choice`). The orders are :data:`MEMORY_HANDLES`
and :data:`EVENT_HANDLES`; ``staged`` and ``host`` are the fallbacks that always work.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import VkxError
from ..vk.event import HANDLE_OPAQUE_FD as SEM_OPAQUE_FD
from ..vk.event import HANDLE_SYNC_FD as SEM_SYNC_FD
from ..vk.memory import HANDLE_DMA_BUF, HANDLE_HOST_ALLOCATION, HANDLE_OPAQUE_FD

if TYPE_CHECKING:
    from ..vk.device import Device


#: Memory handle kinds in negotiation order (best first); ``staged`` is the fallback.
MEMORY_HANDLES = ("dma_buf", "opaque_fd", "host_allocation")
#: Event handle kinds in negotiation order; ``host`` (the host bridge) always works.
EVENT_HANDLES = ("timeline_opaque_fd", "sync_fd", "host")


@dataclass(frozen=True)
class Choice:
    """The outcome of one negotiation: the ``kind`` chosen and why each better one was not."""

    kind: str
    rejected: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        why = "; ".join(f"{k}: {r}" for k, r in self.rejected)
        return self.kind + (f" (not {why})" if why else "")


def _memory_allocator_reason() -> str | None:
    from .. import native

    if not native.native_available():
        return "the compiled helper vkxsplit._native is missing (dma-heap/udmabuf calls)"
    if os.path.exists("/dev/dma_heap/system") or os.path.exists("/dev/udmabuf"):
        return None
    return "no dma-buf allocator on this machine (/dev/dma_heap/system and /dev/udmabuf are absent)"


def hub_memory_support(device: Device) -> dict[str, str | None]:
    """For each memory handle kind: ``None`` when the hub can use it, else the reason it cannot."""
    from ..vk.interop import buffer_handle_support

    ext = device.extensions
    out: dict[str, str | None] = {}
    if "VK_EXT_external_memory_dma_buf" not in ext:
        out["dma_buf"] = f"'{device.name}' lacks VK_EXT_external_memory_dma_buf"
    elif not buffer_handle_support(device.physical, HANDLE_DMA_BUF)["importable"]:
        out["dma_buf"] = f"'{device.name}' cannot import storage buffers from dma-bufs"
    else:
        out["dma_buf"] = _memory_allocator_reason()
    if "VK_KHR_external_memory_fd" not in ext:
        out["opaque_fd"] = f"'{device.name}' lacks VK_KHR_external_memory_fd"
    elif not device.memory.export_handle_types & HANDLE_OPAQUE_FD:
        out["opaque_fd"] = f"'{device.name}' cannot export storage-buffer memory as an opaque fd"
    else:
        out["opaque_fd"] = None
    if "VK_EXT_external_memory_host" not in ext:
        out["host_allocation"] = f"'{device.name}' lacks VK_EXT_external_memory_host"
    elif not buffer_handle_support(device.physical, HANDLE_HOST_ALLOCATION)["importable"]:
        out["host_allocation"] = f"'{device.name}' cannot import host allocations as storage buffers"
    else:
        out["host_allocation"] = None
    return out


def hub_event_support(device: Device) -> dict[str, str | None]:
    """For each event handle kind: ``None`` when the hub can use it, else the reason it cannot."""
    from ..vk.interop import semaphore_handle_support

    ext = device.extensions
    out: dict[str, str | None] = {}
    if "VK_KHR_external_semaphore_fd" not in ext:
        out["timeline_opaque_fd"] = f"'{device.name}' lacks VK_KHR_external_semaphore_fd"
        out["sync_fd"] = out["timeline_opaque_fd"]
    else:
        tl = semaphore_handle_support(device.physical, SEM_OPAQUE_FD, True)
        out["timeline_opaque_fd"] = None if tl["exportable"] else (
            f"'{device.name}' cannot export timeline semaphores as opaque fds")
        sf = semaphore_handle_support(device.physical, SEM_SYNC_FD, False)
        missing = [w for w in ("importable", "exportable") if not sf[w]]
        out["sync_fd"] = None if not missing else (
            f"'{device.name}' reports binary semaphores not {' or '.join(missing)} as SYNC_FD")
    out["host"] = None
    return out


def negotiate(wants: Sequence[Sequence[str]], support: dict[str, str | None], order: Sequence[str],
              fallback: str) -> Choice:
    """Pick the first kind of ``wants[0]`` (the first party's preference order) that every party
    in ``wants`` lists and ``support`` allows; ``fallback`` when none is left.

    Kinds not in ``order`` are an error (a typo in a backend's capabilities must not silently
    fall back to copies).
    """
    if not wants:
        wants = [list(order)]
    for w in wants:
        bad = [k for k in w if k not in order and k != fallback]
        if bad:
            raise VkxError(f"unknown handle kind(s) {', '.join(map(repr, bad))} (known: {', '.join(order)})")
    rejected: list[tuple[str, str]] = []
    seen: set[str] = set()
    for kind in [*wants[0], *[k for k in order if k not in wants[0]]]:
        if kind in seen or kind == fallback:
            continue
        seen.add(kind)
        lacking = [i for i, w in enumerate(wants) if kind not in w]
        if lacking:
            if kind in wants[0] or any(kind in w for w in wants):
                rejected.append((kind, f"not supported by backend #{lacking[0]}" if len(wants) > 1
                                 else "not supported by the backend"))
            continue
        why = support.get(kind, "unknown to the hub")
        if why is not None:
            rejected.append((kind, why))
            continue
        return Choice(kind, tuple(rejected))
    return Choice(fallback, tuple(rejected))


def negotiate_memory(device: Device, wants: Sequence[Sequence[str]],
                     support: dict[str, str | None] | None = None) -> Choice:
    """The memory handle for buffers shared between the hub and all backends in ``wants``."""
    return negotiate(wants, hub_memory_support(device) if support is None else support,
                     MEMORY_HANDLES, "staged")


def negotiate_events(device: Device, wants: Sequence[str],
                     support: dict[str, str | None] | None = None) -> Choice:
    """The event handle for one backend stream (``host`` = the host bridge)."""
    return negotiate([list(wants)], hub_event_support(device) if support is None else support,
                     EVENT_HANDLES, "host")
