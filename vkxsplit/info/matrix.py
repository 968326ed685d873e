"""The attach matrix of ``vkxsplit info``: per available backend, the memory path
(:data:`MEMORY_PATHS`) and event path (:data:`EVENT_PATHS`) it gets with a given hub device,
and why each better path is out (rules in docs/INFO.md); and the check that an exported
opaque fd of the hub can be mmapped by the CPU (:func:`probe_opaque_fd_mappable`).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import VkxError
from .names import _uuid

MEMORY_PATHS = ("dma_buf", "opaque_fd", "host_allocation", "staged_copy")
EVENT_PATHS = ("imported_timeline", "sync_file", "host_bridge")
PATH_LABELS = {"dma_buf": "dma-buf", "opaque_fd": "opaque fd", "host_allocation": "host allocation",
               "staged_copy": "staged copy", "imported_timeline": "imported timeline",
               "sync_file": "sync_file", "host_bridge": "host bridge"}


_MEM_EXT = {"dma_buf": "VK_EXT_external_memory_dma_buf", "opaque_fd": "VK_KHR_external_memory_fd",
            "host_allocation": "VK_EXT_external_memory_host"}


def _mem_can(interop: dict[str, Any], path: str, export: bool = False, import_: bool = False,
             either: bool = False) -> tuple[bool, str]:
    """Whether the hub's storage buffers support ``path`` that way; else why not."""
    e = interop["memory"][path]
    label = PATH_LABELS[path]
    if not e.get("extension_present"):
        return False, f"{label}: {e.get('extension', _MEM_EXT[path])} missing"
    if either:
        if e.get("exportable") or e.get("importable"):
            return True, ""
        return False, f"{label}: storage buffers neither exportable nor importable"
    if export and not e.get("exportable"):
        return False, f"{label}: storage buffers not exportable"
    if import_ and not e.get("importable"):
        return False, f"{label}: storage buffers not importable"
    return True, ""


def _sem_can(interop: dict[str, Any], handle: str, kind: str, export: bool, import_: bool) -> tuple[bool, str]:
    s = interop["semaphores"][handle][kind]
    label = {"opaque_fd": "opaque fd", "sync_fd": "sync fd"}[handle]
    missing = [w for w, need, have in (("export", export, s.get("exportable")),
                                       ("import", import_, s.get("importable"))) if need and not have]
    if missing:
        return False, f"hub cannot {'/'.join(missing)} {kind} semaphores as {label}"
    return True, ""


def _same_device(physical: Any, backend: dict[str, Any]) -> tuple[bool, str]:
    """Opaque handles only work within one physical device (matching device UUIDs). Backends
    that report no UUIDs are assumed to match."""
    uuids = [d.get("uuid") for d in backend.get("devices", ()) if d.get("uuid")]
    if not uuids:
        return True, ""
    mine = _uuid(getattr(physical, "device_uuid", b"") or b"")
    if not mine or mine in uuids:
        return True, ""
    return False, (f"hub '{physical.name}' is not one of the {backend.get('kind', backend['name'])} "
                   "devices (device UUIDs differ)")


def attach_matrix(physical: Any, backends: list[dict[str, Any]], interop: dict[str, Any] | None = None,
                  opaque_fd_mappable: bool | None = None, opaque_fd_reason: str = "") -> list[dict[str, Any]]:
    """The memory and event path each available backend gets with ``physical`` as the hub.

    ``backends``: dicts as :func:`probe_backends` returns (``name``, ``kind``, ``available``,
    optional ``devices`` with ``uuid``). ``interop``: :func:`vkxsplit.vk.interop.interop_report`
    of ``physical`` (queried when omitted). ``opaque_fd_mappable``: whether an exported opaque
    fd of the hub can be mmapped by the CPU (None = not checked: the path is not used).
    Each row: backend, kind, memory, memory_why_not (reasons the better memory paths are out),
    event, event_why_not, zero_copy. Rules are in docs/INFO.md.
    """
    if interop is None:
        from ..vk.interop import interop_report

        interop = interop_report(physical)
    rows = []
    for b in backends:
        if not b.get("available"):
            continue
        kind = b.get("kind", b["name"])
        ev_why: list[str] = []
        event = None
        cands: list[tuple[str, bool, str]] = []  # memory paths, best first: (path, ok, why not)
        if kind in ("cpu", "npu-emu"):
            cands.append(("host_allocation", *_mem_can(interop, "host_allocation", import_=True)))
            ok, why = _mem_can(interop, "opaque_fd", export=True)
            if ok and opaque_fd_mappable is not True:
                ok = False
                why = ("opaque fd: mmap of exported fds not checked" if opaque_fd_mappable is None else
                       f"opaque fd: exported fds are not mmappable ({opaque_fd_reason or 'mmap failed'})")
            cands.append(("opaque_fd", ok, why))
        elif kind in ("cuda", "hip"):
            cands.append(("dma_buf", *_mem_can(interop, "dma_buf", export=True)))
            ok, why = _mem_can(interop, "opaque_fd", export=True)
            if ok:
                ok, why = _same_device(physical, b)
                why = f"opaque fd: {why}" if why else why
            cands.append(("opaque_fd", ok, why))
        elif kind == "npu":
            cands.append(("dma_buf", *_mem_can(interop, "dma_buf", either=True)))
        else:
            cands.append(("dma_buf", False, f"unknown backend kind {kind!r}"))
        memory, mem_why = "staged_copy", []
        for path, ok, why in cands:
            if ok:
                memory = path
                break
            mem_why.append(why)

        if kind == "npu-emu":
            # The emulator reports completion over its socket (event_handles=("host",)); a real
            # NPU with its own Vulkan device would import the opaque-fd timeline instead.
            ev_why.append("imported timeline: the npu-emu process reports completion over its socket")
        elif kind in ("cuda", "hip"):
            ok, why = _sem_can(interop, "opaque_fd", "timeline", export=True, import_=False)
            if ok:
                ok, why = _same_device(physical, b)
            event = "imported_timeline" if ok else None
            if not ok:
                ev_why.append(f"imported timeline: {why}")
        elif kind == "npu":
            ok, why = _sem_can(interop, "sync_fd", "binary", export=True, import_=True)
            event = "sync_file" if ok else None
            if not ok:
                ev_why.append(f"sync_file: {why}")
        elif kind == "cpu":
            ev_why.append("imported timeline: the cpu backend cannot import Vulkan semaphores")
        if event is None:
            event = "host_bridge"
        rows.append({"backend": b["name"], "kind": kind, "memory": memory, "memory_why_not": mem_why,
                     "event": event, "event_why_not": ev_why, "zero_copy": memory != "staged_copy"})
    return rows


def probe_opaque_fd_mappable(device: Any) -> tuple[bool, str]:
    """Whether the CPU can use an exported opaque fd of ``device`` (a vkxsplit Device) as the
    memory itself: export a small host-visible block, fill it through the Vulkan mapping, and
    check that a read-only mmap of the fd at offset 0 shows the same bytes. Nothing is written
    through the fd (a driver may keep private data in the file: lavapipe does)."""
    import mmap

    from ..vk.api import ffi
    from ..vk.memory import HANDLE_OPAQUE_FD, Block

    size = 1 << 16
    block = None
    fd = -1
    try:
        block = Block(device.memory, "export", size, device.memory.type_for_pool["export"],
                      export_types=HANDLE_OPAQUE_FD, dedicated=True)
        if block.ptr is None:
            return False, "exportable memory is not host-visible: cannot check what an mmap shows"
        pattern = bytes((i * 7 + 3) & 0xFF for i in range(size))
        ffi.memmove(block.ptr, pattern, size)
        fd = block.export_fd(HANDLE_OPAQUE_FD)
        length = os.fstat(fd).st_size
        if length < size:
            return False, f"the fd's file is {length} bytes, smaller than the {size}-byte allocation"
        try:
            m = mmap.mmap(fd, length, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            return False, f"mmap failed: {exc}"
        with m:
            if m[:size] == pattern:
                return True, "an mmap of the fd at offset 0 aliases the Vulkan memory"
            at = m.find(pattern[:256])
        if at > 0:
            return False, f"the memory sits at file offset {at} after driver data, not at 0"
        return False, "an mmap of the fd does not show the Vulkan memory"
    except VkxError as exc:
        return False, str(exc).splitlines()[0]
    finally:
        if fd >= 0:
            os.close(fd)
        if block is not None:
            block.close()
