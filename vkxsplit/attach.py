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
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import (
    BackendDied,
    BackendStalled,
    Closable,
    ClosedError,
    EnvironmentProblem,
    Stalled,
    VkxError,
    WaitTimeout,
)
from .vk.api import NULL, check, ffi, lib, new, vk
from .vk.event import HANDLE_OPAQUE_FD as SEM_OPAQUE_FD
from .vk.event import HANDLE_SYNC_FD as SEM_SYNC_FD
from .vk.event import POLL_S, Peer, StallClock, Timeline, default_timeout
from .vk.kernel import View
from .vk.memory import (
    HANDLE_DMA_BUF,
    HANDLE_HOST_ALLOCATION,
    HANDLE_OPAQUE_FD,
    HOST_COHERENT,
    HOST_VISIBLE,
    Block,
    Buffer,
    _align,
)

if TYPE_CHECKING:
    from .vk.device import Device

log = logging.getLogger("vkxsplit.attach")

Point = tuple[Timeline, int]

#: Memory handle kinds in negotiation order (best first); ``staged`` is the fallback.
MEMORY_HANDLES = ("dma_buf", "opaque_fd", "host_allocation")
#: Event handle kinds in negotiation order; ``host`` (the host bridge) always works.
EVENT_HANDLES = ("timeline_opaque_fd", "sync_fd", "host")

DEFAULT_CHUNK = 16 << 20


# ---------------------------------------------------------------------------------------------
# counters


class AttachStats:
    """Counters the tests (and ``vkxsplit info``) read. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.staged_bytes = 0        # bytes copied because no shared handle worked
            self.staged_copies = 0
            self.staged_reasons: list[str] = []
            self.host_waits = 0          # host waits on timeline points made by caller threads
            self.bridge_waits = 0        # ... made by bridge threads (expected, not the caller's)
            self.host_signals = 0        # timeline values signalled from the host by bridges
            self.bridged_jobs = 0
            self.backend_deaths = 0
            self._step_base = 0

    def begin_step(self) -> None:
        """Start counting the caller's host waits for one step."""
        with self._lock:
            self._step_base = self.host_waits

    @property
    def host_waits_in_step(self) -> int:
        """Host waits made by caller threads since :meth:`begin_step`."""
        return self.host_waits - self._step_base

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def staged(self, nbytes: int, reason: str) -> None:
        with self._lock:
            self.staged_bytes += nbytes
            self.staged_copies += 1
            if reason not in self.staged_reasons:
                self.staged_reasons.append(reason)


#: The process-wide counters.
stats = AttachStats()

_tls = threading.local()


def in_bridge_thread() -> bool:
    return bool(getattr(_tls, "bridge", False))


def mark_bridge_thread() -> None:
    """Mark the current thread as a bridge/service thread (its waits are not the caller's)."""
    _tls.bridge = True


def host_wait(point: Point, timeout: float | None = None, counters: AttachStats | None = None,
              peers: Iterable[Peer] = ()) -> None:
    """Block until ``point`` is reached, counted: :class:`~vkxsplit.errors.Stalled` after
    ``timeout`` s without progress, :class:`BackendDied` as soon as one of ``peers`` is gone
    (:meth:`vkxsplit.vk.event.Timeline.wait`)."""
    c = counters or stats
    c.add("bridge_waits" if in_bridge_thread() else "host_waits")
    tl, value = point
    if peers:
        tl.wait(value, timeout, peers=peers)
    else:
        tl.wait(value, timeout)


# ---------------------------------------------------------------------------------------------
# negotiation


@dataclass(frozen=True)
class Choice:
    """The outcome of one negotiation: the ``kind`` chosen and why each better one was not."""

    kind: str
    rejected: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        why = "; ".join(f"{k}: {r}" for k, r in self.rejected)
        return self.kind + (f" (not {why})" if why else "")


def _memory_allocator_reason() -> str | None:
    from . import native

    if not native.native_available():
        return "the compiled helper vkxsplit._native is missing (dma-heap/udmabuf calls)"
    if os.path.exists("/dev/dma_heap/system") or os.path.exists("/dev/udmabuf"):
        return None
    return "no dma-buf allocator on this machine (/dev/dma_heap/system and /dev/udmabuf are absent)"


def hub_memory_support(device: Device) -> dict[str, str | None]:
    """For each memory handle kind: ``None`` when the hub can use it, else the reason it cannot."""
    from .vk.interop import buffer_handle_support

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
    from .vk.interop import semaphore_handle_support

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


# ---------------------------------------------------------------------------------------------
# host mappings (raw mmap through libc: numpy views of them never pin an fd, unlike mmap.mmap)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
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

    def close(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.length)
            self.base = 0


def _memfd(size: int, name: str) -> Any:
    """A sealed memfd of ``size`` bytes: it can neither shrink nor grow (a peer cannot truncate it
    under our mapping), as an owned :class:`vkxsplit.native.Fd` (or int-owning stand-in)."""
    import fcntl

    from . import native

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
            from .native import DmaBufCpuAccess

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
        from . import native

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
        from .native import Fd

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
        from .native import Fd

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


# ---------------------------------------------------------------------------------------------
# the host bridge


@dataclass
class _Item:
    wait: Point | None
    value: int              # backend timeline value to signal; 0 for control items
    job: Any = None
    release: Callable[[], None] | None = None
    control: Callable[[], None] | None = None
    t_enqueue: float = field(default_factory=time.monotonic)
    t_release: float = 0.0


_STOP = object()


def cpu_ticks(pid: int, tid: int | None = None) -> int | None:
    """CPU time (clock ticks, user + system) a process (or one of its threads) has used: the
    heartbeat of a peer that computes (it rises while it works; a wedged or stopped peer's stays
    flat). None where /proc is not there."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        with open(path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


class HostBridge:
    """Joins a backend that cannot share semaphores with the hub (see the module docstring).

    ``enqueue(wait, value, job)`` returns at once. The bridge thread waits (in slices, up to
    ``timeout`` s) for the hub point ``wait``, then either runs ``run(job)`` itself (a thread
    backend: the value is signalled when it returns) or calls the item's ``release()`` (a
    process/device backend: it reports completion later with :meth:`complete`). Values are
    signalled in order, each once. ``liveness()`` (optional) returns an error text when the
    backend is gone (its process exited, its connection closed); ``heartbeat()`` (optional)
    returns a value that changes while the backend works (a child process's CPU time; a ``run``
    bridge uses its own thread's CPU time); both and the in-flight watchdog are polled every
    ``poll_s``. ``spin_s``: how long to poll the hub point's counter before blocking (0: block
    at once). ``timeout`` is a stall limit: seconds without progress, never a total.

    Errors: a hub point that makes no progress for ``timeout`` s records
    :class:`~vkxsplit.errors.Stalled` (the job is skipped, its value still signalled); a job that
    raises records that error; a backend that dies records :class:`BackendDied` at the next poll,
    and one that leaves a released job unanswered with no heartbeat for ``timeout`` s records
    :class:`~vkxsplit.errors.BackendStalled` (slow or wedged, not dead); either way every
    pending and later value is signalled at once. :meth:`check` raises what was recorded.
    :meth:`gone` and :meth:`progress` are what host waits watch (:class:`vkxsplit.vk.event.Peer`).
    """

    def __init__(self, device: Device, timeline: Timeline, *, name: str,
                 run: Callable[[Any], None] | None = None, timeout: float | None = None,
                 poll_s: float = 0.02, liveness: Callable[[], str | None] | None = None,
                 counters: AttachStats | None = None, spin_s: float = 0.0,
                 heartbeat: Callable[[], Any] | None = None) -> None:
        self.device = device
        self.spin_s = spin_s  # spin on the hub point's counter this long before blocking waits
        self.timeline = timeline
        self.name = name
        self.run = run
        self.timeout = default_timeout() if timeout is None else timeout
        self.poll_s = poll_s
        self.liveness = liveness
        self.heartbeat = heartbeat
        self._completions = 0  # jobs answered (progress)
        self._beats = 0  # heartbeat messages the backend sent (beat())
        self._beat: Any = None  # the last heartbeat seen, and when it last changed
        self._beat_at = time.monotonic()
        self.stats = counters or stats
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque[Any] = collections.deque()
        self._pending: collections.OrderedDict[int, bool] = collections.OrderedDict()  # value -> done
        self._in_flight: dict[int, float] = {}  # value -> release time
        self._signalled = timeline.value
        self._errors: list[BaseException] = []
        self.dead: BackendDied | None = None  # (a BackendStalled when given up on without dying)
        self._closing = False
        self._thread = threading.Thread(target=self._main, name=f"bridge-{name}", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def enqueue(self, wait: Point | None, value: int, job: Any = None, *,
                release: Callable[[], None] | None = None) -> None:
        """Queue one job: start after ``wait``, signal ``value`` on the backend timeline when done."""
        with self._cond:
            if value <= self._signalled or value in self._pending:
                raise VkxError(f"{self.name}: timeline value {value} was already used "
                               f"(signalled up to {self._signalled})",
                               "take signal values from backend.next_point()")
            self._pending[value] = False
            if self.dead is not None or self._closing:
                self._pending[value] = True
                self._flush_locked(force=True)
                return
            self._queue.append(_Item(wait, value, job, release))
            self._cond.notify()

    def skip(self, value: int) -> None:
        """Signal ``value`` (in order) without running anything: for a job the backend refused,
        so hub work already queued behind its point is not stranded."""
        with self._cond:
            if value <= self._signalled or value in self._pending:
                return
            self._pending[value] = True
            self._flush_locked()

    def control(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the bridge thread after every job queued before it was released."""
        with self._cond:
            if self.dead is not None or self._closing:
                return
            self._queue.append(_Item(None, 0, control=fn))
            self._cond.notify()

    def complete(self, value: int, error: BaseException | None = None) -> None:
        """The backend finished the job that signals ``value`` (any thread)."""
        with self._cond:
            if error is not None:
                self._errors.append(error)
            self._completions += 1
            self._in_flight.pop(value, None)
            if value in self._pending:
                self._pending[value] = True
            self._flush_locked()
            self._cond.notify_all()

    def fail(self, exc: BackendDied) -> None:
        """The backend is gone: record ``exc`` and signal everything pending, now and later."""
        with self._cond:
            if self.dead is None:
                self.dead = exc
                self._errors.append(exc)
                self.stats.add("backend_deaths")
                log.error("%s", exc)
            self._queue.clear()
            self._in_flight.clear()
            for v in self._pending:
                self._pending[v] = True
            self._flush_locked(force=True)
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the first recorded error (a death stays; other errors are reported once)."""
        with self._lock:
            if not self._errors:
                return
            err = self._errors[0]
            self._errors = [e for e in self._errors if e is self.dead]
        raise err

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def gone(self) -> str | None:
        """What is gone, for host waits (None while alive): a death recorded, the liveness probe,
        the bridge thread ended. A stalled backend is not gone (its waits report no progress)."""
        d = self.dead
        if d is not None and not isinstance(d, Stalled):
            return str(d).split("\n")[0]
        if self._closing:
            return None
        if self.liveness is not None:
            try:
                why = self.liveness()
            except Exception as exc:
                why = f"liveness probe failed: {exc}"
            if why:
                return f"backend {self.name}'s {why}"
        if not self._thread.is_alive():
            return f"backend {self.name}'s bridge thread ended"
        return None

    def beat(self) -> None:
        """The backend says it is working (a heartbeat message of a process peer; any thread)."""
        self._beats += 1

    def progress(self) -> Any:
        """Changes whenever the backend answers a job or its heartbeat moves."""
        return (self._signalled, self._completions, self._beats, self._heartbeat())

    def _heartbeat(self) -> Any:
        if self.heartbeat is not None:
            try:
                return self.heartbeat()
            except Exception:
                return None
        if self.run is not None and self._thread.native_id is not None:  # the jobs run here
            return cpu_ticks(os.getpid(), self._thread.native_id)
        return None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; whatever is still pending is signalled (the hub never blocks on us)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._queue.append(_STOP)
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._cond:
            # every value handed out (even one never enqueued) ends up signalled
            if self.timeline._last > self._signalled:
                self._pending[self.timeline._last] = True
            for v in self._pending:
                self._pending[v] = True
            self._flush_locked(force=True)

    # -- signalling -----------------------------------------------------------------------

    def _flush_locked(self, force: bool = False) -> None:
        """Signal the longest done prefix of pending values (all of them when ``force``)."""
        top = 0
        while self._pending:
            v, done = next(iter(self._pending.items()))
            if not done and not force:
                break
            self._pending.popitem(last=False)
            top = max(top, v)
        if top > self._signalled:
            try:
                self.timeline.signal(top)
                self._signalled = top
                self.stats.add("host_signals")
            except Exception as exc:  # the device is gone: nothing left to unblock
                log.error("%s: signalling %s to %d failed: %s", self.name, self.timeline.name, top, exc)

    # -- the thread -----------------------------------------------------------------------

    def _main(self) -> None:
        mark_bridge_thread()
        while True:
            with self._cond:
                while not self._queue:
                    self._watch_locked()
                    if self._closing and not self._queue:
                        return
                    self._cond.wait(self.poll_s)
                item = self._queue.popleft()
            if item is _STOP:
                return
            if item.control is not None:
                try:
                    item.control()
                except Exception as exc:
                    log.warning("%s: control step failed: %s", self.name, exc)
                continue
            self._handle(item)

    def _watch_locked(self) -> None:
        if self.dead is not None:
            return
        why = None
        if self.liveness is not None:
            try:
                why = self.liveness()
            except Exception as exc:  # a broken probe counts as dead
                why = f"liveness probe failed: {exc}"
        err: BackendDied | None = None
        if why is not None:
            err = BackendDied(f"backend {self.name} died: {why}",
                              "the hub keeps running; recreate the backend or plan without it")
        elif self._in_flight:
            now = time.monotonic()
            beat = (self._completions, self._beats, self._heartbeat())
            if beat != self._beat:
                self._beat, self._beat_at = beat, now
            oldest = min(self._in_flight.values())
            idle = now - max(oldest, self._beat_at)
            if idle > self.timeout:
                v = min(self._in_flight, key=self._in_flight.__getitem__)
                alive = ("its process is alive" if self.liveness is not None else "no liveness probe")
                err = BackendStalled(
                    f"backend {self.name}: no progress for {idle:.1f} s: the job signalling "
                    f"{self.timeline.name} = {v} got no answer within {self.timeout:g} s and no "
                    f"heartbeat ({alive}: slow or wedged, not dead)",
                    "the hub keeps running without it; if the backend is just slow (a loaded machine), "
                    "raise VKXSPLIT_TIMEOUT_S (seconds without progress)")
        if err is not None:
            self._cond.release()
            try:
                self.fail(err)
            finally:
                self._cond.acquire()

    def _wait_hub(self, point: Point) -> bool | Stalled:
        """Wait for the hub point: True when reached; False when closing, dead or the hub is
        gone (recorded); the :class:`Stalled` error when it made no progress for the limit."""
        tl, value = point
        clock = StallClock(tl, value, self.timeout, what=f"the hub point {tl.name} >= {value}")
        self.stats.add("bridge_waits")
        if self.spin_s > 0:  # (a relay between GPUs: a blocking wait returns late on the H200)
            try:
                tl.spin(value, min(self.spin_s, self.timeout), lambda: self._closing)
            except VkxError:
                pass  # (the blocking wait below reports it)
        while True:
            try:
                left = clock.poll()
            except Stalled as exc:
                return exc
            except VkxError as exc:  # the hub device or timeline is gone
                with self._cond:
                    self._errors.append(exc)
                return False
            try:
                tl.wait(value, max(0.0, min(self.poll_s * 5, left, POLL_S)))
                return True
            except WaitTimeout:  # (this slice is over)
                pass
            except VkxError as exc:  # the hub device or timeline is gone
                with self._cond:
                    self._errors.append(exc)
                return False
            with self._cond:
                if self.dead is not None or self._closing:
                    return False
                self._watch_locked()
                if self.dead is not None:
                    return False

    def _handle(self, item: _Item) -> None:
        reached = True if item.wait is None else self._wait_hub(item.wait)
        if reached is not True:
            with self._cond:
                if self.dead is None and not self._closing and isinstance(reached, Stalled):
                    self._errors.append(Stalled(
                        f"{self.name}: {str(reached).splitlines()[0]}; the job signalling "
                        f"{self.timeline.name} = {item.value} was skipped",
                        "an earlier part of the step is stuck, or the chain waits on a value that is "
                        "never submitted; if the work is just slow, raise VKXSPLIT_TIMEOUT_S "
                        "(seconds without progress)"))
                if item.value in self._pending:
                    self._pending[item.value] = True
                self._flush_locked()
            return
        with self._cond:
            if self.dead is not None:
                return
            self._in_flight[item.value] = time.monotonic()
        self.stats.add("bridged_jobs")
        try:
            if item.release is not None:
                item.release()
                return  # completion arrives through complete()
            if self.run is None:
                raise VkxError(f"{self.name}: bridge item without release() and bridge without run()")
            self.run(item.job)
        except BackendDied as exc:
            self.fail(exc)
            return
        except Exception as exc:
            log.debug("%s: job for value %d failed: %s", self.name, item.value, exc)
            self.complete(item.value, exc)
            return
        self.complete(item.value)
