"""Shared memory between the hub and its backends: :class:`SharedArena`, :class:`SharedBuffer`,
:class:`SharedView` and the :class:`Chunk` they are cut from.

The arena negotiates one memory handle for all its backends (:mod:`vkxsplit.attach.handles`)
and makes chunks of that kind: a sealed memfd imported by host pointer (``host_allocation``),
a dma-buf from a dma-heap or udmabuf imported with ``VkImportMemoryFdInfoKHR`` (``dma_buf``),
a block of the hub's exportable pool whose opaque fd the backend imports (``opaque_fd``, handed
out by :meth:`SharedArena.export_fd`), or a hub buffer plus a private mirror that every job
copies (``staged``). Small buffers are sub-allocated from shared chunks; a chunk closes (Vulkan
memory, then the mapping, then the fd) with its last buffer.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Closable, ClosedError, EnvironmentProblem, VkxError
from ..vk.api import check, new
from ..vk.kernel import View
from ..vk.memory import HANDLE_DMA_BUF, HANDLE_OPAQUE_FD, Block, Buffer, _align
from .counters import AttachStats, stats
from .handles import Choice, hub_memory_support, negotiate_memory
from .host import HostMapping, _memfd, host_page_align, import_host_pages

if TYPE_CHECKING:
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.attach")


DEFAULT_CHUNK = 16 << 20


# ---------------------------------------------------------------------------------------------
# chunks: one piece of memory both sides reach


_chunk_ids = iter(range(1, 1 << 62))


class Chunk:
    """One shareable allocation: a hub :class:`Block` (when the hub imported it) plus the backend
    side (an owned fd and/or a host mapping). Sub-allocated into :class:`SharedBuffer`s.

    ``listeners`` are called with the chunk when it closes (backends drop their mappings).
    The fd is closed exactly once, after Vulkan freed its memory and the mapping is gone.
    """

    def __init__(self, kind: str, size: int, fd: Any = None, mapping: HostMapping | None = None,
                 block: Block | None = None) -> None:
        self.id = next(_chunk_ids)
        self.kind = kind
        self.size = size
        self.fd = fd
        self.mapping = mapping
        self.block = block
        self.dedicated = False
        self.closed = False
        self.listeners: list[Callable[[Chunk], None]] = []

    def array(self, dtype: Any, offset: int, count: int) -> np.ndarray:
        if self.mapping is None:
            raise VkxError(f"{self.kind} chunk {self.id} has no host mapping")
        return self.mapping.array(dtype, offset, count)

    def cpu_access(self, write: bool = True) -> Any:
        """Bracket CPU access (DMA_BUF_IOCTL_SYNC for dma-bufs; nothing for host memory)."""
        if self.kind == "dma_buf" and self.fd is not None:
            from ..native import DmaBufCpuAccess

            return DmaBufCpuAccess(self.fd, read=True, write=write)
        return _NullContext()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fn in list(self.listeners):
            try:
                fn(self)
            except Exception as exc:  # keep closing
                log.warning("chunk %d listener: %s", self.id, exc)
        self.listeners.clear()
        if self.mapping is not None:
            self.mapping.close()
        if self.fd is not None:
            self.fd.close()

    def __repr__(self) -> str:
        return f"Chunk({self.id}, {self.kind}, {self.size} bytes{', closed' if self.closed else ''})"


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# shared buffers


class SharedView(View):
    """A byte range of a :class:`SharedBuffer`: binds like a :class:`View` in
    ``Sequence.dispatch`` and carries the shared buffer for backends."""

    __slots__ = ("shared",)

    def __init__(self, shared: SharedBuffer, offset: int = 0, size: int | None = None) -> None:
        super().__init__(shared.buffer, offset, size)
        if offset < 0 or self.offset + self.size > shared.size:
            raise VkxError(f"view [{offset}, +{self.size}) outside shared buffer '{shared.name}' "
                           f"({shared.size} bytes)")
        self.shared = shared

    @property
    def chunk(self) -> Chunk:
        return self.shared.chunk

    @property
    def chunk_offset(self) -> int:
        """Offset of this view in its chunk (what a process backend's mapping is indexed by)."""
        return self.shared.chunk_offset + self.offset

    def backend_array(self, dtype: Any, count: int | None = None) -> np.ndarray:
        """The backend's zero-copy host view (the staging mirror for ``staged`` buffers)."""
        dt = np.dtype(dtype)
        n = self.size // dt.itemsize if count is None else count
        return self.shared.backend_array(dt, n, self.offset)

    def numpy(self, dtype: Any, count: int | None = None) -> np.ndarray:
        """The hub-side host view of this range (see :meth:`SharedBuffer.numpy`)."""
        dt = np.dtype(dtype)
        n = self.size // dt.itemsize if count is None else count
        return self.shared.numpy(dt, (n,), self.offset)

    def __repr__(self) -> str:
        return f"SharedView({self.shared.name!r}, offset={self.offset}, size={self.size})"


class SharedBuffer:
    """Memory the hub binds (``self.buffer``, a :class:`Buffer`) that a backend reaches through
    ``self.kind``. ``close()`` is idempotent; the chunk closes when its last buffer does."""

    def __init__(self, arena: SharedArena, buffer: Buffer, chunk: Chunk, chunk_offset: int,
                 name: str) -> None:
        self.arena = arena
        self.buffer = buffer
        self.chunk = chunk
        self.chunk_offset = chunk_offset
        self.kind = arena.kind
        self.size = buffer.size
        self.name = name
        self.on_close: list[Callable[[SharedBuffer], None]] = []
        self._closed = False
        #: byte ranges [start, end) of this buffer whose pages were given back (:meth:`discard`):
        #: they read as zeros until :meth:`restore` writes them again
        self.discarded: list[tuple[int, int]] = []

    # -- views ----------------------------------------------------------------------------

    def view(self, offset: int = 0, size: int | None = None) -> SharedView:
        return SharedView(self, offset, size)

    def numpy(self, dtype: Any = np.uint8, shape: Any = None, offset: int = 0) -> np.ndarray:
        """A zero-copy host view of the hub's memory (for filling inputs and reading results).

        ``host_allocation``/``dma_buf``: the shared mapping itself; ``staged``: the hub buffer
        (host pool); ``opaque_fd``: the hub buffer when its memory is host-visible.
        """
        self._check_open()
        dt = np.dtype(dtype)
        count = (self.size - offset) // dt.itemsize if shape is None else int(np.prod(shape))
        if self.chunk.mapping is not None and self.kind != "staged":
            arr = self.chunk.array(dt, self.chunk_offset + offset, count)
        else:
            arr = self.buffer.numpy(dt, (count,), offset)
        return arr.reshape(shape) if shape is not None else arr

    def backend_array(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        """The backend side: same memory as :meth:`numpy` except for ``staged`` (the mirror)."""
        self._check_open()
        return self.chunk.array(dtype, self.chunk_offset + offset, count)

    # -- giving pages back -----------------------------------------------------------------

    def discard(self, offset: int = 0, size: int | None = None) -> int:
        """Give back the host pages of ``[offset, offset + size)`` when nothing will read them
        (a weight a backend holds in a layout of its own): only host pages of a
        ``host_allocation`` arena, whose device reads them by pointer; other kinds keep them and
        return 0. The range is recorded in :attr:`discarded` (what reads it before
        :meth:`restore` reads zeros: readers check :meth:`is_discarded` first). Returns the
        bytes given back (the whole pages inside the range)."""
        self._check_open()
        n = self.size - offset if size is None else size
        if self.kind != "host_allocation" or self.chunk.mapping is None or n <= 0:
            return 0
        got = self.chunk.mapping.discard(self.chunk_offset + offset, n)
        if got:
            self.discarded.append((offset, offset + n))
        return got

    def restore(self, data: np.ndarray, offset: int = 0) -> None:
        """Write ``data`` (bytes) at ``offset`` again after :meth:`discard`, and forget the
        discarded ranges it covers."""
        self._check_open()
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.numpy(np.uint8, (raw.size,), offset)[:] = raw
        end = offset + raw.size
        self.discarded = [(a, b) for a, b in self.discarded if not (offset <= a and b <= end)]

    def is_discarded(self, offset: int, size: int) -> bool:
        """Whether any byte of ``[offset, offset + size)`` lies in a discarded range."""
        return any(a < offset + size and offset < b for a, b in self.discarded)

    # -- staging (only ``staged`` buffers copy; the others return at once) -----------------

    def stage_in(self, offset: int = 0, size: int | None = None) -> None:
        """Hub -> backend mirror, before a backend reads the range."""
        if self.kind != "staged":
            return
        n = self.size - offset if size is None else size
        self.backend_array(np.uint8, n, offset)[:] = self.buffer.numpy(np.uint8, (n,), offset)
        self.arena.stats.staged(n, self.arena.choice.describe())
        self.arena.staged_bytes += n

    def stage_out(self, offset: int = 0, size: int | None = None) -> None:
        """Backend mirror -> hub, after a backend wrote the range."""
        if self.kind != "staged":
            return
        n = self.size - offset if size is None else size
        self.buffer.numpy(np.uint8, (n,), offset)[:] = self.backend_array(np.uint8, n, offset)
        self.arena.stats.staged(n, self.arena.choice.describe())
        self.arena.staged_bytes += n

    # -- lifetime -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"shared buffer '{self.name}' is closed: it cannot be used after close()",
                              "keep the buffer open while you use it, or allocate a new one")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fn in self.on_close:
            try:
                fn(self)
            except Exception as exc:  # keep closing
                log.warning("shared buffer %s close hook: %s", self.name, exc)
        self.on_close.clear()
        self.arena._release(self)

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedBuffer({self.name!r}, {self.kind}, {self.size} bytes, chunk {self.chunk.id})"


class SharedArena(Closable):
    """Allocates :class:`SharedBuffer`s reachable by the hub and every backend in ``backends``.
    After ``close()`` its methods raise :class:`~vkxsplit.errors.ClosedError` (``live`` still
    counts what is left).

    The memory handle is negotiated once (``self.choice``) from the backends' capabilities
    (``memory_handles``, or pass ``wants``: lists of kinds); ``force`` picks a kind (tests use
    ``force="staged"``). Small buffers are sub-allocated from chunks of ``chunk_size`` bytes;
    a chunk is freed (Vulkan memory, then the mapping, then the fd) with its last buffer.
    """

    _closed_exempt = ("name", "live")

    def __init__(self, device: Device, backends: Iterable[Any] = (), *,
                 wants: Sequence[Sequence[str]] | None = None, force: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK, counters: AttachStats | None = None,
                 name: str = "shared") -> None:
        self.device = device
        self.name = name
        self.stats = counters or stats
        if wants is None:
            wants = [tuple(b.caps.memory_handles) for b in backends]
        self.support = hub_memory_support(device)
        choice = negotiate_memory(device, wants, self.support)
        if force is not None:
            if force != "staged" and self.support.get(force, "unknown kind") is not None:
                raise VkxError(f"cannot force memory handle {force!r}: "
                               f"{self.support.get(force, 'unknown kind')}")
            choice = Choice(force, ((choice.kind, "forced"),) if choice.kind != force else ())
        self.choice = choice
        self.kind = choice.kind
        alloc = device.memory
        page = host_page_align(device)
        self.host_align = page
        self.chunk_size = _align(max(chunk_size, page), page)
        self.staged_bytes = 0
        self._chunks: list[Chunk] = []          # shared (non-dedicated) chunks, guarded by alloc._lock
        self._export_chunks: dict[int, Chunk] = {}
        self._live: set[SharedBuffer] = set()
        self._live_lock = threading.Lock()
        if self.kind == "staged":
            log.warning("arena %s: no zero-copy handle, backends work on staged copies (%s)",
                        name, choice.describe())
        else:
            log.info("arena %s: memory handle %s", name, choice.describe())
        self._pool = f"shared:{self.kind}"
        self._alloc = alloc

    # -- chunk makers ---------------------------------------------------------------------

    def _new_host_chunk(self, size: int) -> Chunk:
        """memfd -> mmap -> VkImportMemoryHostPointerInfoEXT."""
        fd = _memfd(size, f"vkxsplit-{self.name}")
        mapping = None
        try:
            mapping = HostMapping(fd.fd, size, self.host_align)
            block = import_host_pages(self.device, mapping.addr, size, self._pool)
        except BaseException:
            if mapping is not None:
                mapping.close()
            fd.close()
            raise
        return Chunk("host_allocation", size, fd=fd, mapping=mapping, block=block)

    def _new_dmabuf_chunk(self, size: int) -> Chunk:
        """dma-heap (or udmabuf) dma-buf -> mmap -> VkImportMemoryFdInfoKHR(DMA_BUF).

        Written to the spec; no machine here has a dma-buf allocator and a driver that imports
        dma-bufs, so this path has never run.
        """
        from .. import native

        dev = self.device
        try:
            fd = native.dma_heap_alloc(size, "system")
        except EnvironmentProblem:
            mfd = native.memfd(size, f"vkxsplit-{self.name}")
            try:
                fd = native.udmabuf_from_memfd(mfd, 0, size)
            finally:
                mfd.close()
        mapping = None
        dup = -1
        try:
            props = new("VkMemoryFdPropertiesKHR")
            check(dev.fn("vkGetMemoryFdPropertiesKHR")(dev.handle, HANDLE_DMA_BUF, fd.fd, props),
                  "vkGetMemoryFdPropertiesKHR(DMA_BUF)")
            type_index = self._pick_type(props.memoryTypeBits, 0, "dma-buf")
            mapping = HostMapping(fd.fd, size)
            dup = os.dup(fd.fd)  # Vulkan owns the imported fd once the import succeeds
            ii = new("VkImportMemoryFdInfoKHR", handleType=HANDLE_DMA_BUF, fd=dup)
            block = Block(self._alloc, self._pool, size, type_index, import_info=ii)
        except BaseException:
            if dup >= 0:
                os.close(dup)
            if mapping is not None:
                mapping.close()
            fd.close()
            raise
        return Chunk("dma_buf", size, fd=fd, mapping=mapping, block=block)

    def _pick_type(self, bits: int, want: int, what: str) -> int:
        types = self.device.physical.memory_types
        good = [t.index for t in types if (bits >> t.index) & 1 and t.flags & want == want]
        if not good:
            raise VkxError(f"'{self.device.name}' offers no memory type for importing a {what} "
                           f"(type bits {bits:#x}, wanted flags {want:#x})")
        return good[0]

    # -- allocation -----------------------------------------------------------------------

    def alloc(self, size: int, name: str = "") -> SharedBuffer:
        """A shared buffer of ``size`` bytes (offsets aligned for storage-buffer binding)."""
        size = max(int(size), 4)
        name = name or f"{self.name}#{len(self._live)}"
        if self.kind == "opaque_fd":
            sb = self._alloc_export(size, name)
        elif self.kind == "staged":
            sb = self._alloc_staged(size, name)
        else:
            sb = self._alloc_imported(size, name)
        with self._live_lock:
            self._live.add(sb)
        return sb

    def _alloc_imported(self, size: int, name: str) -> SharedBuffer:
        alloc = self._alloc
        asize = _align(size, alloc.alignment)
        if asize > self.chunk_size // 2:
            ch = self._new_chunk(_align(asize, self.host_align), dedicated=True)
            with alloc._lock:
                off = ch.block.try_alloc(asize, alloc.alignment)  # type: ignore[union-attr]
                assert off is not None
                alloc.live_buffers += 1
            return SharedBuffer(self, Buffer(ch.block, off, size, name), ch, off, name)
        while True:
            with alloc._lock:
                for ch in self._chunks:
                    off = ch.block.try_alloc(asize, alloc.alignment)  # type: ignore[union-attr]
                    if off is not None:
                        alloc.live_buffers += 1
                        return SharedBuffer(self, Buffer(ch.block, off, size, name), ch, off, name)
            self._new_chunk(self.chunk_size, dedicated=False)

    def _new_chunk(self, size: int, dedicated: bool) -> Chunk:
        ch = self._new_host_chunk(size) if self.kind == "host_allocation" else self._new_dmabuf_chunk(size)
        ch.dedicated = dedicated
        block = ch.block
        assert block is not None

        def on_block_closed() -> None:  # runs under alloc._lock, after vkFreeMemory
            if ch in self._chunks:
                self._chunks.remove(ch)
            ch.close()

        block.on_close.append(on_block_closed)
        self._alloc.adopt_block(block)
        if not dedicated:
            with self._alloc._lock:
                self._chunks.append(ch)
        return ch

    def _alloc_export(self, size: int, name: str) -> SharedBuffer:
        buf = self.device.memory.alloc(size, "export", name=name)
        block = buf.block
        with self._alloc._lock:
            ch = self._export_chunks.get(block._serial)
            if ch is None or ch.closed:
                ch = Chunk("opaque_fd", block.size, block=block)
                self._export_chunks[block._serial] = ch
                serial = block._serial

                def on_block_closed(ch: Chunk = ch, serial: int = serial) -> None:
                    self._export_chunks.pop(serial, None)
                    ch.close()

                block.on_close.append(on_block_closed)
        return SharedBuffer(self, buf, ch, buf.offset, name)

    def _alloc_staged(self, size: int, name: str) -> SharedBuffer:
        buf = self.device.memory.alloc(size, "host", name=name)
        msize = _align(size, mmap.PAGESIZE)
        fd = _memfd(msize, f"vkxsplit-{self.name}-mirror")
        try:
            mapping = HostMapping(fd.fd, msize)
        except BaseException:
            fd.close()
            buf.close()
            raise
        ch = Chunk("staged", msize, fd=fd, mapping=mapping)
        ch.dedicated = True
        return SharedBuffer(self, buf, ch, 0, name)

    def export_fd(self, sb: SharedBuffer, handle: str = "opaque_fd") -> tuple[Any, int, int, int]:
        """``(Fd, allocation_size, offset, dedicated)`` naming ``sb``'s whole hub block.

        ``handle``: ``"opaque_fd"`` (CUDA/HIP/Vulkan importers) or ``"dma_buf"`` (the export
        direction of dma-buf sharing: device memory handed to a driver that imports dma-bufs;
        only where the hub's export pool was made dma-buf exportable). A new owned fd per call:
        an importer that takes ownership (CUDA does, on success) ``detach()``-es it; otherwise
        the caller closes it.
        """
        from ..native import Fd

        if self.kind != "opaque_fd":
            raise VkxError(f"shared buffer '{sb.name}' is {self.kind} memory, not exportable from the hub "
                           "(only 'opaque_fd' arenas allocate from the exportable pool)")
        types = {"opaque_fd": HANDLE_OPAQUE_FD, "dma_buf": HANDLE_DMA_BUF}
        if handle not in types:
            raise VkxError(f"unknown export handle {handle!r} (known: {', '.join(types)})")
        block = sb.buffer.block
        if not block.export_types & types[handle]:
            raise VkxError(f"'{self.device.name}' did not make the export pool exportable as {handle}",
                           "the driver lacks VK_EXT_external_memory_dma_buf export for storage buffers"
                           if handle == "dma_buf" else "")
        fd = Fd(block.export_fd(types[handle]))
        return fd, block.allocation_size, sb.buffer.offset, int(block.dedicated or bool(block.export_types))

    def _release(self, sb: SharedBuffer) -> None:
        with self._live_lock:
            self._live.discard(sb)
        if self.kind == "staged":
            sb.chunk.close()
        sb.buffer.close()  # frees the block (and closes its chunk) when it was the last one

    @property
    def live(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Close every buffer still allocated from this arena."""
        with self._live_lock:
            bufs = list(self._live)
        for sb in bufs:
            sb.close()

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
