"""Host pages both sides reach: mappings, sealed memfds and their import into Vulkan.

:class:`HostMapping` maps an fd shared at an aligned address through libc's ``mmap`` (numpy
views of it never pin the fd, unlike :class:`mmap.mmap`); :func:`_memfd` makes a sealed memfd
(a peer cannot shrink or grow it under a mapping); :func:`host_page_align` and
:func:`import_host_pages` import such pages into a device as a host-coherent
:class:`~vkxsplit.vk.memory.Block` (``VK_EXT_external_memory_host``), for the shared arena, a
vulkan peer and the links between pipeline stages.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import VkxError
from ..vk.api import check, ffi, new
from ..vk.memory import HANDLE_HOST_ALLOCATION, HOST_COHERENT, HOST_VISIBLE, Block, _align

if TYPE_CHECKING:
    from ..vk.device import Device


# ---------------------------------------------------------------------------------------------
# host mappings (raw mmap through libc: numpy views of them never pin an fd, unlike mmap.mmap)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
#: madvise advice that frees the pages of a shared memfd range (a hole: later reads see zeros)
_MADV_REMOVE = 9
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int) -> int:
    p = _libc.mmap(addr, length, prot, flags, fd, 0)
    if p is None or p == _MAP_FAILED:
        err = ctypes.get_errno()
        raise VkxError(f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(p)


class HostMapping:
    """``size`` bytes of ``fd`` mapped shared, at an address aligned to ``align``."""

    def __init__(self, fd: int, size: int, align: int = mmap.PAGESIZE) -> None:
        self.size = size
        if align <= mmap.PAGESIZE:
            self.base = self.addr = _mmap(None, size, _RW, mmap.MAP_SHARED, fd)
            self.length = size
        else:  # reserve, then map the file at an aligned address inside the reservation
            self.length = size + align
            self.base = _mmap(None, self.length, mmap.PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
            self.addr = _align(self.base, align)
            try:
                _mmap(self.addr, size, _RW, mmap.MAP_SHARED | _MAP_FIXED, fd)
            except BaseException:
                _libc.munmap(self.base, self.length)
                raise

    def array(self, dtype: Any, offset: int, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        if offset < 0 or offset + count * dt.itemsize > self.size:
            raise VkxError(f"host view [{offset}, +{count * dt.itemsize}) outside a {self.size}-byte mapping")
        if self.base == 0:
            raise VkxError("host view of an unmapped chunk (its buffer was freed)")
        raw = (ctypes.c_char * (count * dt.itemsize)).from_address(self.addr + offset)
        return np.frombuffer(raw, dtype=dt, count=count)

    def discard(self, offset: int, size: int) -> int:
        """Give the whole pages inside ``[offset, offset + size)`` back to the system
        (``madvise(MADV_REMOVE)``: the memfd's pages are freed, and a later read of the range
        sees zeros, a write allocates anew). Returns the bytes given back (0 where the range
        holds no whole page or the kernel refuses)."""
        if not self.base or offset < 0 or offset + size > self.size:
            return 0
        page = mmap.PAGESIZE
        lo = -(-(self.addr + offset) // page) * page
        hi = (self.addr + offset + size) // page * page
        if hi <= lo or _libc.madvise(lo, hi - lo, _MADV_REMOVE) != 0:
            return 0
        return hi - lo

    def close(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.length)
            self.base = 0


def _memfd(size: int, name: str) -> Any:
    """A sealed memfd of ``size`` bytes: it can neither shrink nor grow (a peer cannot truncate it
    under our mapping), as an owned :class:`vkxsplit.native.Fd` (or int-owning stand-in)."""
    import fcntl

    from .. import native

    if native.native_available():
        fd = native.memfd(size, name)
    else:
        fd = native.Fd(os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
        os.ftruncate(fd.fd, size)
    try:
        fcntl.fcntl(fd.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        fd.close()
        raise
    return fd


def host_page_align(device: Device) -> int:
    """The alignment (and size granule) of host pages ``device`` can import by pointer."""
    return max(mmap.PAGESIZE, int(device.physical.min_imported_host_pointer_alignment or 0))


def import_host_pages(device: Device, addr: int, size: int, pool: str) -> Block:
    """``size`` bytes of host pages at ``addr`` (aligned to :func:`host_page_align`) imported
    into ``device`` as a host-coherent Block (VkImportMemoryHostPointerInfoEXT). Several devices
    may import the same pages: the shared arena and the links between the hubs of a model over
    several GPUs (:class:`vkxsplit.hubs.HostLink`) do. The pages must outlive
    the Block."""
    ptr = ffi.cast("void*", addr)
    props = new("VkMemoryHostPointerPropertiesEXT")
    check(device.fn("vkGetMemoryHostPointerPropertiesEXT")(device.handle, HANDLE_HOST_ALLOCATION, ptr, props),
          "vkGetMemoryHostPointerPropertiesEXT")
    want = HOST_VISIBLE | HOST_COHERENT
    types = [t.index for t in device.physical.memory_types
             if (props.memoryTypeBits >> t.index) & 1 and t.flags & want == want]
    if not types:
        raise VkxError(f"'{device.name}' offers no host-coherent memory type for importing host pointers "
                       f"(type bits {props.memoryTypeBits:#x})")
    ii = new("VkImportMemoryHostPointerInfoEXT", handleType=HANDLE_HOST_ALLOCATION, pHostPointer=ptr)
    return Block(device.memory, pool, size, types[0], import_info=ii)
