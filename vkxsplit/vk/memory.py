"""Device memory: large blocks, sub-allocated into buffers.

Drivers cap the number of VkDeviceMemory allocations (and each is slow to make), so the
allocator takes blocks of ``VKXSPLIT_BLOCK_MB`` (default 256 MiB) per pool and hands out
aligned ranges of them. Each block carries one VkBuffer that spans it; a :class:`Buffer`
is (block, offset, size), bound to descriptors by offset. Pools:

- ``device``: device-local; written through a staging copy when not host-visible
- ``host``: host-visible, coherent, cached where possible (readback, small per-step values)
- ``upload``: host-visible, device-local where the device has such memory (BAR / UMA)
- ``export``: device-local and exportable (opaque fd, or dma-buf where offered): memory that
  attached backends import; the fd names the whole block, a buffer is (fd, offset, size)

A buffer's numpy view (:meth:`Buffer.numpy`) aliases the mapped memory: no copy. A view may
outlive ``close()`` of its buffer, allocator or device: the memory under it then stays mapped
(and, on the device's close, the VkDeviceMemory and the VkDevice stay alive) until the last view
is gone (see :class:`_Pin`); every method of a closed object raises
:class:`~vkxsplit.errors.ClosedError`.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Closable, OutOfDeviceMemory, VkxError
from .api import NULL, check, ffi, lib, new, next_serial, vk

if TYPE_CHECKING:
    from .device import Device

log = logging.getLogger("vkxsplit.vk")

MiB = 1 << 20
# Vulkan 1.2 core values (the `vulkan` package's aliases of them resolve to None)
USAGE_DEVICE_ADDRESS = 0x00020000   # VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT
ALLOCATE_DEVICE_ADDRESS = 0x2       # VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT
BUFFER_USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)

DEVICE_LOCAL = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT
HOST_VISIBLE = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
HOST_COHERENT = vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
HOST_CACHED = vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT

HANDLE_OPAQUE_FD = vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT
HANDLE_DMA_BUF = vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_DMA_BUF_BIT_EXT
HANDLE_HOST_ALLOCATION = vk.VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT

# pool name -> (required flags, preferred flags, (avoided flags))
POOLS: dict[str, tuple[int, int, int]] = {
    "device": (DEVICE_LOCAL, 0, HOST_VISIBLE),
    "host": (HOST_VISIBLE | HOST_COHERENT, HOST_CACHED, 0),
    "upload": (HOST_VISIBLE | HOST_COHERENT, DEVICE_LOCAL, 0),
    "export": (DEVICE_LOCAL, 0, HOST_VISIBLE),
}


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass
class _Range:
    offset: int
    size: int


class Block:
    """One VkDeviceMemory with a VkBuffer spanning it, optionally mapped and/or exportable."""

    def __init__(self, alloc: Allocator, pool: str, size: int, type_index: int,
                 export_types: int = 0, import_info: Any = None, dedicated: bool = False) -> None:
        dev = alloc.device
        self.alloc = alloc
        self.pool = pool
        self.size = size
        self.type_index = type_index
        self.export_types = export_types
        self.imported = import_info is not None
        self.dedicated = dedicated
        self.memory: Any = None
        self.buffer: Any = None
        self.ptr: Any = None
        self.allocation_size = 0  # VkMemoryAllocateInfo.allocationSize (what importers must name)
        self.pins = 0  # live numpy views of this block's mapping (see _Pin)
        self.doomed = False  # its allocator closed while views were alive: freed with the last one
        self._dev_handle = dev.handle  # (the device's handle outlives its public close while pinned)
        # Called (no arguments) once the VkDeviceMemory is freed: owners of imported payloads
        # (a host mapping, a memfd) release them here, after Vulkan stopped using them.
        self.on_close: list[Callable[[], None]] = []
        self._serial = next_serial()
        flags = alloc.device.physical.memory_types[type_index].flags
        self.host_visible = bool(flags & HOST_VISIBLE)
        self.device_local = bool(flags & DEVICE_LOCAL)

        heap = dev.physical.memory_heaps[dev.physical.memory_types[type_index].heap]
        if size > heap.size:  # never valid to ask (VUID-vkAllocateMemory-pAllocateInfo-01713)
            raise OutOfDeviceMemory(
                f"vkAllocateMemory({size / MiB:.1f} MiB, pool {pool})", vk.VK_ERROR_OUT_OF_DEVICE_MEMORY,
                f"{size / MiB:.1f} MiB is more than the whole memory heap {heap.index} "
                f"({heap.size / MiB:.0f} MiB): use a smaller model, context or batch")
        handle_types = export_types or (import_info.handleType if import_info is not None else 0)
        ext_bci = new("VkExternalMemoryBufferCreateInfo", handleTypes=handle_types) if handle_types else None
        # mul_mat_cm2's decode functions take a physical-storage-buffer pointer into the weights:
        # on a device with VK_NV_cooperative_matrix2 (bufferDeviceAddress enabled with it) plain
        # buffers are created for device addresses (imported and exported memory stays as it was)
        bda = bool(getattr(dev, "coopmat2", False)) and import_info is None and not export_types
        self.device_address = bda  # (mul_mat_cm2 reads weights only from such blocks)
        usage = BUFFER_USAGE | (USAGE_DEVICE_ADDRESS if bda else 0)
        bci = new("VkBufferCreateInfo", size=size, usage=usage,
                  sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE,
                  pNext=ext_bci if ext_bci is not None else NULL)
        out = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev.handle, bci, NULL, out), "vkCreateBuffer")
        self.buffer = out[0]
        req = new("VkMemoryRequirements")
        lib.vkGetBufferMemoryRequirements(dev.handle, self.buffer, req)
        if not (req.memoryTypeBits >> type_index) & 1:
            lib.vkDestroyBuffer(dev.handle, self.buffer, NULL)
            raise VkxError(f"memory type {type_index} cannot back storage buffers on {dev.name}")

        chain: Any = NULL
        keep = []
        if export_types:
            exp = new("VkExportMemoryAllocateInfo", handleTypes=export_types)
            keep.append(exp)
            chain = exp
        if import_info is not None:
            import_info.pNext = chain
            chain = import_info
        # A host-pointer import must not name a dedicated buffer (VUID-VkMemoryAllocateInfo-pNext-02806).
        host_import = import_info is not None and bool(import_info.handleType & HANDLE_HOST_ALLOCATION)
        if dedicated or export_types or (import_info is not None and not host_import):
            ded = new("VkMemoryDedicatedAllocateInfo", buffer=self.buffer, pNext=chain)
            keep.append(ded)
            chain = ded
        if bda:
            fl = new("VkMemoryAllocateFlagsInfo", flags=ALLOCATE_DEVICE_ADDRESS, pNext=chain)
            keep.append(fl)
            chain = fl
        mai = new("VkMemoryAllocateInfo", allocationSize=max(size, req.size), memoryTypeIndex=type_index,
                  pNext=chain)
        mem = ffi.new("VkDeviceMemory*")
        res = lib.vkAllocateMemory(dev.handle, mai, NULL, mem)
        if res < 0:
            lib.vkDestroyBuffer(dev.handle, self.buffer, NULL)
            self.buffer = None
            if res in (vk.VK_ERROR_OUT_OF_DEVICE_MEMORY, vk.VK_ERROR_OUT_OF_HOST_MEMORY):
                raise OutOfDeviceMemory(
                    f"vkAllocateMemory({size / MiB:.1f} MiB, pool {pool})", res,
                    f"the device is out of memory ({alloc.allocated_bytes / MiB:.0f} MiB already "
                    "allocated by vkxsplit): use a smaller model, context or batch")
            check(res, f"vkAllocateMemory({size / MiB:.1f} MiB, pool {pool})")
        self.memory = mem[0]
        self.allocation_size = int(mai.allocationSize)
        check(lib.vkBindBufferMemory(dev.handle, self.buffer, self.memory, 0), "vkBindBufferMemory")
        if self.host_visible:
            pp = ffi.new("void**")
            check(lib.vkMapMemory(dev.handle, self.memory, 0, size, 0, pp), "vkMapMemory")
            self.ptr = pp[0]
        self.free: list[_Range] = [_Range(0, size)]
        self.used = 0

    def try_alloc(self, size: int, align: int) -> int | None:
        for i, r in enumerate(self.free):
            start = _align(r.offset, align)
            end = start + size
            if end <= r.offset + r.size:
                pieces = []
                if start > r.offset:
                    pieces.append(_Range(r.offset, start - r.offset))
                if end < r.offset + r.size:
                    pieces.append(_Range(end, r.offset + r.size - end))
                self.free[i:i + 1] = pieces
                self.used += end - start
                return start
        return None

    def release(self, offset: int, size: int) -> None:
        self.used -= size
        self.free.append(_Range(offset, size))
        self.free.sort(key=lambda r: r.offset)
        merged: list[_Range] = []
        for r in self.free:
            if merged and merged[-1].offset + merged[-1].size == r.offset:
                merged[-1].size += r.size
            else:
                merged.append(r)
        self.free = merged

    def export_fd(self, handle_type: int = HANDLE_OPAQUE_FD) -> int:
        """A new fd for this block's memory (the caller owns and closes it)."""
        if not self.export_types & handle_type:
            raise VkxError(f"block of pool '{self.pool}' was not allocated exportable as handle type "
                           f"{handle_type:#x}")
        dev = self.alloc.device
        gi = new("VkMemoryGetFdInfoKHR", memory=self.memory, handleType=handle_type)
        fd = ffi.new("int*")
        check(dev.fn("vkGetMemoryFdKHR")(dev.handle, gi, fd), "vkGetMemoryFdKHR")
        return fd[0]

    def close(self) -> None:
        handle = self._dev_handle
        if self.memory is not None:
            if self.ptr is not None:
                lib.vkUnmapMemory(handle, self.memory)
                self.ptr = None
            lib.vkFreeMemory(handle, self.memory, NULL)
            self.memory = None
        if self.buffer is not None:
            lib.vkDestroyBuffer(handle, self.buffer, NULL)
            self.buffer = None
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # keep releasing
                log.warning("closing block of pool %s: %s", self.pool, exc)


class _Pin:
    """The base object of every numpy view a :class:`Buffer` hands out: numpy keeps the base of
    an array (and of every view, slice or reshape made from it) alive, and this object keeps the
    buffer's range pinned while it lives. Freeing mapped memory under a live array would make a
    later read of it touch unmapped pages (a segfault, or silently another allocation's bytes
    once the range is reused); an array cannot be made unusable, so instead the unmap and free
    are deferred: ``Buffer.close()`` returns the range, the allocator frees the block and the
    device destroys itself only once the last view is gone (a ``weakref.finalize`` on this
    object). The closed objects raise :class:`~vkxsplit.errors.ClosedError` meanwhile."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


class Buffer(Closable):
    """A sub-allocated range of a :class:`Block`. Owned by whoever allocated it; ``close()``
    returns the range (idempotent; deferred while a numpy view of it lives: :class:`_Pin`)."""

    def __init__(self, block: Block, offset: int, size: int, name: str = "") -> None:
        self.block = block
        self.offset = offset
        self.size = size
        self.name = name
        self._closed = False
        self._views = 0  # live numpy views (pins) of this buffer
        self._serial = next_serial()

    @property
    def handle(self) -> Any:
        return self.block.buffer

    @property
    def host_visible(self) -> bool:
        return self.block.host_visible

    @property
    def device(self) -> Device:
        return self.block.alloc.device

    def numpy(self, dtype: Any = np.uint8, shape: Any = None, offset: int = 0) -> np.ndarray:
        """A numpy array aliasing this buffer's mapped memory (no copy). It stays valid after
        ``close()``: the memory is freed once the last such view is gone (:class:`_Pin`)."""
        arr = self._view(dtype, shape, offset)
        pin = _Pin(arr.ctypes.data, arr.nbytes)
        with self.block.alloc._lock:
            if self._closed:  # closed by another thread since the guard: its range is returned
                raise self._closed_error("numpy()")
            self._views += 1
            self.block.pins += 1
        fin = weakref.finalize(pin, self.block.alloc._unpin, self)
        fin.atexit = False  # at exit the process's memory goes with it
        out = np.asarray(pin).view(arr.dtype)
        return out.reshape(arr.shape)

    def _view(self, dtype: Any = np.uint8, shape: Any = None, offset: int = 0) -> np.ndarray:
        """An unpinned view, for use within one call (read/write): no finalizer to pay for."""
        if not self.block.host_visible:
            raise VkxError(f"buffer '{self.name}' lives in device-only memory and has no host view",
                           "allocate it from the 'host' or 'upload' pool, or use read()/write()")
        dt = np.dtype(dtype)
        nbytes = self.size - offset
        count = nbytes // dt.itemsize if shape is None else int(np.prod(shape))
        if count * dt.itemsize > nbytes:
            raise VkxError(f"view of {count} x {dt} does not fit buffer '{self.name}' ({self.size} bytes)")
        raw = ffi.buffer(self.block.ptr + self.offset + offset, count * dt.itemsize)
        arr = np.frombuffer(raw, dtype=dt, count=count)
        return arr.reshape(shape) if shape is not None else arr

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like / numpy) into the buffer at ``offset``."""
        src = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if offset + src.nbytes > self.size:
            raise VkxError(f"write of {src.nbytes} bytes at {offset} overflows buffer '{self.name}' "
                           f"({self.size} bytes)")
        if self.block.host_visible:
            self._view(np.uint8, (src.nbytes,), offset)[:] = src
        else:
            from .command import staged_upload

            staged_upload(self, src, offset)

    def read(self, dtype: Any = np.uint8, shape: Any = None, offset: int = 0) -> np.ndarray:
        """A copy of the buffer's contents (through a staging buffer when device-only)."""
        dt = np.dtype(dtype)
        count = (self.size - offset) // dt.itemsize if shape is None else int(np.prod(shape))
        if self.block.host_visible:
            return self._view(dt, (count,), offset).copy().reshape(shape if shape is not None else (count,))
        from .command import staged_download

        raw = staged_download(self, offset, count * dt.itemsize)
        return raw.view(dt).reshape(shape if shape is not None else (count,))

    def export_fd(self, handle_type: int = HANDLE_OPAQUE_FD) -> tuple[int, int, int]:
        """``(fd, block_size, offset)``: the fd names the whole block (caller closes it)."""
        return self.block.export_fd(handle_type), self.block.size, self.offset

    def close(self) -> None:
        with self.block.alloc._lock:  # (one step with _unpin: the range is returned once)
            if self._closed:
                return
            self._closed = True
            if self._views:
                return  # the last view's finalizer returns the range (Allocator._unpin)
            self.block.alloc._release(self)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Buffer({self.name!r}, pool={self.block.pool}, offset={self.offset}, size={self.size})"


class Allocator(Closable):
    """Pools of blocks on one device; see the module docstring."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.block_size = int(os.environ.get("VKXSPLIT_BLOCK_MB", "256")) * MiB
        lim = device.physical.limits
        self.alignment = max(256, int(lim["minStorageBufferOffsetAlignment"]),
                             int(lim["nonCoherentAtomSize"]))
        self.blocks: dict[str, list[Block]] = {}
        # reentrant: a view's finalizer (_unpin) may run wherever the last reference drops
        self._lock = threading.RLock()
        self._doomed: list[Block] = []  # blocks kept past close() for live views
        self._on_drained: Callable[[], None] | None = None  # the device's deferred destroy
        self.allocated_bytes = 0
        self.live_buffers = 0
        self.type_for_pool = {p: self._choose_type(p) for p in POOLS}
        self.export_handle_types = self._export_types()

    def _choose_type(self, pool: str) -> int:
        req, pref, avoid = POOLS[pool]
        types = self.device.physical.memory_types
        best, best_score = -1, -1
        for t in types:
            if t.flags & req != req:
                continue
            score = 4 * bool(t.flags & pref == pref and pref) + 2 * (not (t.flags & avoid)) + 1
            if score > best_score:
                best, best_score = t.index, score
        if best < 0:
            if pool in ("device", "export"):
                return self._choose_type("host") if any(
                    t.flags & HOST_VISIBLE for t in types) else types[0].index
            raise VkxError(f"device '{self.device.name}' has no memory type for pool '{pool}' "
                           f"(needs flags {req:#x})")
        return best

    def _export_types(self) -> int:
        """Handle types that exportable blocks are made with: opaque fd (and dma-buf where the
        driver both offers the extension and reports storage buffers exportable as dma-buf)."""
        ext = self.device.extensions
        t = 0
        if "VK_KHR_external_memory_fd" in ext:
            t |= HANDLE_OPAQUE_FD
        if "VK_EXT_external_memory_dma_buf" in ext:
            from .interop import buffer_handle_support

            if buffer_handle_support(self.device.physical, HANDLE_DMA_BUF)["exportable"]:
                t |= HANDLE_DMA_BUF
        if t and "VK_KHR_external_memory_fd" in ext:
            from .interop import buffer_handle_support

            if not buffer_handle_support(self.device.physical, HANDLE_OPAQUE_FD)["exportable"]:
                t &= ~HANDLE_OPAQUE_FD
        return t

    def alloc(self, size: int, pool: str = "device", name: str = "") -> Buffer:
        """A buffer of ``size`` bytes (rounded up to the alignment) from ``pool``."""
        if pool not in POOLS:
            raise VkxError(f"unknown memory pool {pool!r} (pools: {', '.join(POOLS)})")
        size = max(int(size), 4)
        asize = _align(size, self.alignment)
        with self._lock:
            blocks = self.blocks.setdefault(pool, [])
            if asize <= self.block_size // 2:
                for b in blocks:
                    if b.dedicated:
                        continue
                    off = b.try_alloc(asize, self.alignment)
                    if off is not None:
                        self.live_buffers += 1
                        return Buffer(b, off, size, name)
                b = self._new_block(pool, self.block_size, dedicated=False)
            else:
                b = self._new_block(pool, asize, dedicated=True)
            off = b.try_alloc(asize, self.alignment)
            assert off is not None
            self.live_buffers += 1
            return Buffer(b, off, size, name)

    def _new_block(self, pool: str, size: int, dedicated: bool) -> Block:
        export = 0
        if pool == "export":
            export = self.export_handle_types
            if not export:
                raise VkxError(f"device '{self.device.name}' cannot export memory (no "
                               "VK_KHR_external_memory_fd)", "attach through host-allocation import")
        b = Block(self, pool, size, self.type_for_pool[pool], export_types=export, dedicated=dedicated)
        self.blocks.setdefault(pool, []).append(b)
        self.allocated_bytes += size
        log.debug("new %s block of %.1f MiB (type %d)", pool, size / MiB, b.type_index)
        return b

    def adopt_block(self, block: Block) -> None:
        """Take ownership of a block made elsewhere (an imported allocation)."""
        with self._lock:
            self.blocks.setdefault(block.pool, []).append(block)
            self.allocated_bytes += block.size

    def _release(self, buf: Buffer) -> None:
        with self._lock:
            b = buf.block
            if b.memory is None or b.doomed:  # (a doomed block is freed as a whole: _unpin)
                return
            b.release(buf.offset, _align(buf.size, self.alignment))
            self.live_buffers -= 1
            if b.used == 0:
                # Blocks are returned to the driver once empty: shared/imported memory must not
                # linger, and a process's footprint should shrink after a model is closed.
                self.blocks[b.pool].remove(b)
                self.allocated_bytes -= b.size
                b.close()

    def _unpin(self, buf: Buffer) -> None:
        """A numpy view of ``buf`` is gone (its _Pin's finalizer)."""
        drained = None
        with self._lock:
            buf._views -= 1
            b = buf.block
            b.pins -= 1
            if b.doomed:
                if b.pins == 0:
                    b.close()
                    self._doomed.remove(b)
                    if not self._doomed:
                        drained, self._on_drained = self._on_drained, None
            elif buf._views == 0 and buf._closed:
                self._release(buf)
        if drained is not None:
            drained()

    def close(self, on_drained: Callable[[], None] | None = None) -> bool:
        """Free every block; a block that a numpy view still maps is kept until its last view is
        gone (then ``on_drained()`` runs once all such blocks are freed). Whether any was kept."""
        with self._lock:
            for blocks in self.blocks.values():
                for b in blocks:
                    if b.pins:
                        b.doomed = True
                        self._doomed.append(b)
                    else:
                        b.close()
            self.blocks.clear()
            self.allocated_bytes = 0
            if self._doomed:
                self._on_drained = on_drained
                return True
            return False
