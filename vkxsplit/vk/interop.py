"""What a physical device can share with other APIs: external memory and semaphore handles.

Queries only (``vkGetPhysicalDeviceExternal*Properties``); the attach layer uses the answers
to negotiate the best handle per backend pair, and ``vkxsplit info`` prints them.
"""

from __future__ import annotations

from typing import Any

from .api import ffi, lib, new, vk
from .memory import BUFFER_USAGE

MEMORY_HANDLE_TYPES = {
    "dma_buf": vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_DMA_BUF_BIT_EXT,
    "opaque_fd": vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT,
    "host_allocation": vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT,
}

SEMAPHORE_HANDLE_TYPES = {
    "opaque_fd": vk.VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD_BIT,
    "sync_fd": vk.VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_SYNC_FD_BIT,
}

FENCE_HANDLE_TYPES = {
    "opaque_fd": vk.VK_EXTERNAL_FENCE_HANDLE_TYPE_OPAQUE_FD_BIT,
    "sync_fd": vk.VK_EXTERNAL_FENCE_HANDLE_TYPE_SYNC_FD_BIT,
}


def _features(flags: int, export_bit: int, import_bit: int, dedicated_bit: int = 0) -> dict[str, bool]:
    out = {"exportable": bool(flags & export_bit), "importable": bool(flags & import_bit)}
    if dedicated_bit:
        out["dedicated_only"] = bool(flags & dedicated_bit)
    return out


def buffer_handle_support(physical: Any, handle_type: int) -> dict[str, bool]:
    """Whether storage buffers can be exported/imported with ``handle_type``."""
    info = new("VkPhysicalDeviceExternalBufferInfo", usage=BUFFER_USAGE, handleType=handle_type)
    props = new("VkExternalBufferProperties")
    lib.vkGetPhysicalDeviceExternalBufferProperties(physical.handle, info, props)
    f = props.externalMemoryProperties.externalMemoryFeatures
    return _features(f, vk.VK_EXTERNAL_MEMORY_FEATURE_EXPORTABLE_BIT,
                     vk.VK_EXTERNAL_MEMORY_FEATURE_IMPORTABLE_BIT,
                     vk.VK_EXTERNAL_MEMORY_FEATURE_DEDICATED_ONLY_BIT)


def semaphore_handle_support(physical: Any, handle_type: int, timeline: bool) -> dict[str, bool]:
    tci = new("VkSemaphoreTypeCreateInfo",
              semaphoreType=vk.VK_SEMAPHORE_TYPE_TIMELINE if timeline else vk.VK_SEMAPHORE_TYPE_BINARY)
    info = new("VkPhysicalDeviceExternalSemaphoreInfo", handleType=handle_type, pNext=tci)
    props = new("VkExternalSemaphoreProperties")
    lib.vkGetPhysicalDeviceExternalSemaphoreProperties(physical.handle, info, props)
    f = props.externalSemaphoreFeatures
    return _features(f, vk.VK_EXTERNAL_SEMAPHORE_FEATURE_EXPORTABLE_BIT,
                     vk.VK_EXTERNAL_SEMAPHORE_FEATURE_IMPORTABLE_BIT)


def fence_handle_support(physical: Any, handle_type: int) -> dict[str, bool]:
    info = new("VkPhysicalDeviceExternalFenceInfo", handleType=handle_type)
    props = new("VkExternalFenceProperties")
    lib.vkGetPhysicalDeviceExternalFenceProperties(physical.handle, info, props)
    f = props.externalFenceFeatures
    return _features(f, vk.VK_EXTERNAL_FENCE_FEATURE_EXPORTABLE_BIT, vk.VK_EXTERNAL_FENCE_FEATURE_IMPORTABLE_BIT)


def interop_report(physical: Any) -> dict[str, Any]:
    """All of the above for one device, as plain data."""
    mem = {}
    for name, t in MEMORY_HANDLE_TYPES.items():
        needs = {"dma_buf": "VK_EXT_external_memory_dma_buf", "opaque_fd": "VK_KHR_external_memory_fd",
                 "host_allocation": "VK_EXT_external_memory_host"}[name]
        entry: dict[str, Any] = {"extension": needs, "extension_present": physical.has(needs)}
        entry.update(buffer_handle_support(physical, t))
        mem[name] = entry
    sems = {}
    for name, t in SEMAPHORE_HANDLE_TYPES.items():
        sems[name] = {"binary": semaphore_handle_support(physical, t, False),
                      "timeline": semaphore_handle_support(physical, t, True)}
    fences = {name: fence_handle_support(physical, t) for name, t in FENCE_HANDLE_TYPES.items()}
    return {"memory": mem, "semaphores": sems, "fences": fences,
            "min_imported_host_pointer_alignment": physical.min_imported_host_pointer_alignment}


__all__ = ["buffer_handle_support", "semaphore_handle_support", "fence_handle_support", "interop_report",
           "MEMORY_HANDLE_TYPES", "SEMAPHORE_HANDLE_TYPES", "FENCE_HANDLE_TYPES", "ffi"]
