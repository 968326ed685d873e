"""Owned file descriptors, dma-buf allocation, CPU-access sync, sync_file fences and fd passing.

The Python face of ``vkxsplit._native`` (native/vkx_native.c, built by cffi when the package is
installed). Everything here is Linux-only.

- :class:`Fd` owns one descriptor: it closes it exactly once (``close()`` is idempotent and never
  touches a number the kernel has since handed to someone else), works as a context manager and
  closes on garbage collection with a ``ResourceWarning``.
- :func:`dma_heap_alloc` (``/dev/dma_heap/<heap>``), :func:`udmabuf_from_memfd` (``/dev/udmabuf``)
  and :func:`memfd` make buffers; :class:`DmaBufCpuAccess` brackets CPU access to a mapped dma-buf.
- :func:`export_sync_file` / :func:`import_sync_file` move fences between a dma-buf and a
  sync_file; :func:`sync_file_wait` waits on one.
- :func:`send_fds` / :func:`recv_fds` pass descriptors between processes over a unix socket.

A missing device node raises :class:`~vkxsplit.errors.EnvironmentProblem` (with a hint); any other
failing system call raises :class:`~vkxsplit.errors.VkxError` naming the call and the errno, with
the errno number in ``err.errno``. Bad arguments raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import math
import mmap
import operator
import os
import threading
import time
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from .errors import EnvironmentProblem, VkxError

try:
    from . import _native  # type: ignore[attr-defined]
except ImportError as _exc:  # not built: every native call raises EnvironmentProblem
    _native = None
    _NATIVE_IMPORT_ERROR: ImportError | None = _exc
else:
    _NATIVE_IMPORT_ERROR = None

__all__ = [
    "MAX_FDS",
    "SYNC_READ",
    "SYNC_WRITE",
    "DmaBufCpuAccess",
    "Fd",
    "dma_heap_alloc",
    "export_sync_file",
    "import_sync_file",
    "memfd",
    "native_available",
    "open_fd_count",
    "recv_fds",
    "send_fds",
    "sync_file_wait",
    "udmabuf_from_memfd",
    "uapi",
]

#: DMA_BUF_SYNC_READ / DMA_BUF_SYNC_WRITE (<linux/dma-buf.h>).
SYNC_READ = 1
SYNC_WRITE = 2
#: The most descriptors one SCM_RIGHTS message carries (the kernel's SCM_MAX_FD).
MAX_FDS = 253
#: memfd names longer than this are rejected by the kernel (NAME_MAX minus "memfd:").
MEMFD_NAME_MAX = 249

_DMA_HEAP_DIR = "/dev/dma_heap"
_UDMABUF_NODE = "/dev/udmabuf"
_INT_MAX = 2**31 - 1
_FALLBACK_HINT = "or use the opaque-fd / host-allocation path instead of dma-buf"


# --------------------------------------------------------------------------------------------
# the compiled module


def native_available() -> bool:
    """Whether ``vkxsplit._native`` was built and imports."""
    return _native is not None


def _lib() -> tuple[Any, Any]:
    if _native is None:
        raise EnvironmentProblem(
            f"the compiled helper vkxsplit._native is missing or does not import ({_NATIVE_IMPORT_ERROR})",
            "reinstall the package with gcc and the Python headers present: pip install -e . "
            "(or build it in place with: python native/build_native.py)",
        )
    return _native.lib, _native.ffi


def uapi() -> dict[str, int]:
    """The uapi values compiled into the C module: ioctl numbers, flags, sizeof/offsetof of structs."""
    lib, ffi = _lib()
    return {
        ffi.string(lib.vkx_uapi_name(i)).decode(): int(lib.vkx_uapi_value(i))
        for i in range(lib.vkx_uapi_count())
    }


def _errno_text(err: int) -> str:
    return f"{_errno.errorcode.get(err, f'errno {err}')} ({os.strerror(err)})"


def _last_op() -> str:
    lib, ffi = _lib()
    return ffi.string(lib.vkx_last_op()).decode()


def _fail(rc: int, what: str, hint: str = "") -> VkxError:
    """A VkxError for a negative-errno return ``rc``, naming the failing call and the errno."""
    err = -rc
    exc = VkxError(f"{what}: {_last_op()} failed with {_errno_text(err)}", hint)
    exc.errno = err  # type: ignore[attr-defined]
    return exc


def _env_problem(message: str, hint: str, err: int) -> EnvironmentProblem:
    exc = EnvironmentProblem(message, hint)
    exc.errno = err  # type: ignore[attr-defined]
    return exc


# --------------------------------------------------------------------------------------------
# owned descriptors


class Fd:
    """One owned file descriptor, closed exactly once.

    ``close()`` may be called any number of times (and from several threads): only the first
    call closes, later ones do nothing, so a number the kernel reuses for someone else's file is
    never closed by mistake. ``detach()`` gives the number up without closing it.
    """

    __slots__ = ("_fd", "_lock", "__weakref__")

    def __init__(self, fd: int) -> None:
        if isinstance(fd, bool):
            raise TypeError("Fd() takes an int descriptor, not a bool")
        fd = operator.index(fd)
        if fd < 0:
            raise ValueError(f"Fd() needs a non-negative descriptor, got {fd}")
        self._lock = threading.Lock()
        self._fd = fd

    @property
    def fd(self) -> int:
        """The descriptor number; ``ValueError`` once closed or detached."""
        fd = self._fd
        if fd < 0:
            raise ValueError("I/O operation on a closed Fd")
        return fd

    def fileno(self) -> int:
        return self.fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _take(self) -> int:
        with self._lock:
            fd, self._fd = self._fd, -1
        return fd

    def close(self) -> None:
        """Close the descriptor the first time; do nothing afterwards."""
        fd = self._take()
        if fd >= 0:
            os.close(fd)

    def detach(self) -> int:
        """Give up ownership and return the number; the caller must close it."""
        fd = self._take()
        if fd < 0:
            raise ValueError("detach() on a closed Fd")
        return fd

    def dup(self) -> Fd:
        """A new owned descriptor (close-on-exec) for the same open file."""
        return Fd(os.dup(self.fd))

    def __enter__(self) -> Fd:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0 and hasattr(self, "_lock"):
            fd = self._take()
            if fd >= 0:
                warnings.warn(f"unclosed Fd({fd})", ResourceWarning, stacklevel=2)
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __repr__(self) -> str:
        return "Fd(closed)" if self._fd < 0 else f"Fd({self._fd})"


def _fileno(obj: Any, what: str = "descriptor") -> int:
    """The int behind an Fd, an int, or anything with fileno()."""
    if isinstance(obj, Fd):
        return obj.fd
    if isinstance(obj, bool):
        raise TypeError(f"{what} must be an Fd, an int or have fileno(), not bool")
    if isinstance(obj, int):
        if obj < 0:
            raise ValueError(f"{what} must be non-negative, got {obj}")
        return obj
    fileno = getattr(obj, "fileno", None)
    if fileno is None:
        raise TypeError(f"{what} must be an Fd, an int or have fileno(), not {type(obj).__name__}")
    return int(fileno())


def open_fd_count() -> int:
    """How many descriptors this process has open (entries of /proc/self/fd).

    The descriptor used to list the directory is not counted.
    """
    return len(os.listdir("/proc/self/fd")) - 1


def open_fd_targets() -> dict[str, str]:
    """fd number -> what it refers to (``/proc/self/fd`` links: a path, ``/memfd:...``,
    ``anon_inode:...``), for naming a leak; fds closed while listing are skipped."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


# --------------------------------------------------------------------------------------------
# allocation


def _check_size(size: int, what: str = "size") -> int:
    size = operator.index(size)
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {size}")
    if size >= 2**63:
        raise ValueError(f"{what} {size} does not fit in a signed 64-bit offset")
    return size


def dma_heap_alloc(size: int, heap: str = "system") -> Fd:
    """Allocate a ``size``-byte dma-buf from ``/dev/dma_heap/<heap>`` (DMA_HEAP_IOCTL_ALLOC).

    The kernel rounds ``size`` up to whole pages. The returned descriptor is O_RDWR | O_CLOEXEC.
    """
    size = _check_size(size)
    if not isinstance(heap, str) or not heap or "/" in heap or heap in (".", "..") or "\0" in heap:
        raise ValueError(f"bad dma-heap name {heap!r}: expected a name under {_DMA_HEAP_DIR}/")
    lib, ffi = _lib()
    out = ffi.new("int *", -1)
    rc = lib.vkx_dma_heap_alloc(heap.encode(), size, out)
    if rc == 0:
        return Fd(out[0])
    node = f"{_DMA_HEAP_DIR}/{heap}"
    err = -rc
    if _last_op().startswith("open(") and err in (_errno.ENOENT, _errno.ENODEV, _errno.ENXIO):
        heaps = sorted(os.listdir(_DMA_HEAP_DIR)) if os.path.isdir(_DMA_HEAP_DIR) else []
        if heaps:
            raise _env_problem(
                f"{node} does not exist: this kernel's dma-buf heaps are {', '.join(heaps)}",
                f"pass heap= one of those, enable the heap you need (CONFIG_DMABUF_HEAPS_SYSTEM "
                f"for 'system', CONFIG_DMABUF_HEAPS_CMA for 'reserved'/'linux,cma'), {_FALLBACK_HINT}",
                err,
            )
        raise _env_problem(
            f"{node} does not exist: this kernel exposes no dma-buf heap",
            "use a kernel built with CONFIG_DMABUF_HEAPS=y and CONFIG_DMABUF_HEAPS_SYSTEM=y "
            f"(or load its heap module), {_FALLBACK_HINT}",
            err,
        )
    if _last_op().startswith("open(") and err in (_errno.EACCES, _errno.EPERM):
        raise _env_problem(
            f"permission denied opening {node}",
            f"give this user access to {_DMA_HEAP_DIR}/* (a udev rule or group), {_FALLBACK_HINT}",
            err,
        )
    raise _fail(rc, f"allocating {size} bytes from {node}")


def memfd(size: int, name: str = "vkxsplit") -> Fd:
    """A ``size``-byte anonymous shared-memory file (memfd_create) sealed against shrinking.

    Created with MFD_CLOEXEC | MFD_ALLOW_SEALING, sized with ftruncate, then F_SEAL_SHRINK is
    added, which is what :func:`udmabuf_from_memfd` needs. It can still grow and be written.
    """
    size = operator.index(size)
    if size < 0 or size >= 2**63:
        raise ValueError(f"memfd size must be in [0, 2**63), got {size}")
    raw = name.encode()
    if b"\0" in raw or len(raw) > MEMFD_NAME_MAX:
        raise ValueError(f"memfd name must be at most {MEMFD_NAME_MAX} bytes without NUL, got {name!r}")
    lib, ffi = _lib()
    out = ffi.new("int *", -1)
    rc = lib.vkx_memfd_create(raw, size, out)
    if rc != 0:
        raise _fail(rc, f"creating a {size}-byte memfd {name!r}")
    return Fd(out[0])


def udmabuf_from_memfd(memfd: Fd | int, offset: int, size: int) -> Fd:
    """Wrap ``[offset, offset + size)`` of a memfd as a dma-buf through ``/dev/udmabuf``.

    ``offset`` and ``size`` must be multiples of the page size, the range must lie inside the
    file, and the memfd must carry F_SEAL_SHRINK and not F_SEAL_WRITE (as :func:`memfd` makes it).
    The memfd itself stays owned by the caller.
    """
    fd = _fileno(memfd, "memfd")
    offset = operator.index(offset)
    size = _check_size(size)
    page = mmap.PAGESIZE
    if offset < 0 or offset % page or size % page:
        raise ValueError(
            f"udmabuf offset ({offset}) and size ({size}) must be multiples of the page size {page}"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"descriptor {fd} is not a sealable memfd ({_errno_text(exc.errno or 0)})") from exc
    if not seals & fcntl.F_SEAL_SHRINK or seals & fcntl.F_SEAL_WRITE:
        raise ValueError(
            f"udmabuf needs a memfd sealed with F_SEAL_SHRINK and without F_SEAL_WRITE (seals are {seals:#x})"
        )
    file_size = os.fstat(fd).st_size
    if offset + size > file_size:
        raise ValueError(f"range [{offset}, {offset + size}) lies beyond the memfd's {file_size} bytes")
    lib, ffi = _lib()
    out = ffi.new("int *", -1)
    rc = lib.vkx_udmabuf_create(fd, offset, size, out)
    if rc == 0:
        return Fd(out[0])
    err = -rc
    if _last_op().startswith("open(") and err in (_errno.ENOENT, _errno.ENODEV, _errno.ENXIO):
        raise _env_problem(
            f"{_UDMABUF_NODE} does not exist: the udmabuf driver is not loaded",
            f"load it (modprobe udmabuf; kernel option CONFIG_UDMABUF=y), {_FALLBACK_HINT}",
            err,
        )
    if _last_op().startswith("open(") and err in (_errno.EACCES, _errno.EPERM):
        raise _env_problem(
            f"permission denied opening {_UDMABUF_NODE}",
            f"give this user access to {_UDMABUF_NODE} (a udev rule or group), {_FALLBACK_HINT}",
            err,
        )
    raise _fail(rc, f"wrapping [{offset}, {offset + size}) of memfd {fd} as a udmabuf")


# --------------------------------------------------------------------------------------------
# dma-buf CPU access and fences

_NOT_DMABUF_HINT = "the descriptor is not a dma-buf (ENOTTY: its file does not implement dma-buf ioctls)"


def _flags(read: bool, write: bool) -> int:
    flags = (SYNC_READ if read else 0) | (SYNC_WRITE if write else 0)
    if not flags:
        raise ValueError("at least one of read and write must be true")
    return flags


class DmaBufCpuAccess:
    """Bracket CPU access to a mapped dma-buf with DMA_BUF_IOCTL_SYNC START ... END.

    ``with DmaBufCpuAccess(buf, read=True, write=True): view[:] = ...`` issues
    ``SYNC_START | RW`` on entry and ``SYNC_END | RW`` on exit (also when the body raises).
    """

    def __init__(self, dmabuf: Fd | int, *, read: bool = True, write: bool = True) -> None:
        _flags(read, write)
        self._dmabuf = dmabuf
        self.read = read
        self.write = write
        self._active = False

    def _sync(self, begin: bool) -> None:
        lib, _ = _lib()
        fd = _fileno(self._dmabuf, "dma-buf")
        rc = lib.vkx_dmabuf_sync(fd, int(begin), int(self.read), int(self.write))
        if rc != 0:
            stage = "START" if begin else "END"
            hint = _NOT_DMABUF_HINT if rc == -_errno.ENOTTY else ""
            raise _fail(rc, f"DMA_BUF_IOCTL_SYNC {stage} on fd {fd}", hint)

    def __enter__(self) -> DmaBufCpuAccess:
        self._sync(True)
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._active:
            self._active = False
            self._sync(False)


def export_sync_file(dmabuf: Fd | int, *, read: bool = True, write: bool = False) -> Fd:
    """Snapshot the dma-buf's fences as a sync_file (DMA_BUF_IOCTL_EXPORT_SYNC_FILE, Linux 6.0).

    ``read=True`` alone: the sync_file signals when writers are done (safe to read).
    ``write=True``: it signals when every user is done (safe to write).
    """
    flags = _flags(read, write)
    lib, ffi = _lib()
    fd = _fileno(dmabuf, "dma-buf")
    out = ffi.new("int *", -1)
    rc = lib.vkx_dmabuf_export_sync_file(fd, flags, out)
    if rc != 0:
        hint = f"{_NOT_DMABUF_HINT}, or the kernel predates Linux 6.0" if rc == -_errno.ENOTTY else ""
        raise _fail(rc, f"exporting a sync_file from dma-buf fd {fd}", hint)
    return Fd(out[0])


def import_sync_file(
    dmabuf: Fd | int, sync_file: Fd | int, *, read: bool = False, write: bool = True
) -> None:
    """Attach a sync_file to the dma-buf as an implicit fence (DMA_BUF_IOCTL_IMPORT_SYNC_FILE).

    ``write=True``: every later implicitly-synchronised user waits on it; ``read=True`` alone:
    only later writers wait. The sync_file stays owned by the caller.
    """
    flags = _flags(read, write)
    lib, _ = _lib()
    fd = _fileno(dmabuf, "dma-buf")
    sfd = _fileno(sync_file, "sync_file")
    rc = lib.vkx_dmabuf_import_sync_file(fd, flags, sfd)
    if rc != 0:
        hint = f"{_NOT_DMABUF_HINT}, or the kernel predates Linux 6.0" if rc == -_errno.ENOTTY else ""
        raise _fail(rc, f"importing sync_file fd {sfd} into dma-buf fd {fd}", hint)


def sync_file_wait(fd: Fd | int, timeout_s: float | None) -> bool:
    """Wait until ``fd`` polls readable (a sync_file: its fence signalled). False on timeout.

    ``timeout_s=None`` waits forever; 0 only checks. Rounded up to whole milliseconds.
    """
    if timeout_s is None:
        timeout_ms = -1
    else:
        if timeout_s < 0 or math.isnan(timeout_s):
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        timeout_ms = min(math.ceil(timeout_s * 1000), _INT_MAX)
    lib, _ = _lib()
    n = _fileno(fd)
    rc = lib.vkx_sync_file_wait(n, timeout_ms)
    if rc < 0:
        raise _fail(rc, f"waiting on fd {n}")
    return rc == 1


# --------------------------------------------------------------------------------------------
# passing descriptors


def send_fds(sock: Any, fds: Iterable[Fd | int], payload: bytes) -> None:
    """Send ``payload`` with ``fds`` attached (SCM_RIGHTS) over a unix socket.

    Returns once the whole payload is queued: on a non-blocking socket (or one with a timeout)
    it waits for room rather than cut the message. A closed peer raises VkxError (EPIPE);
    SIGPIPE is never raised.

    The descriptors stay owned by the caller (the receiver gets its own copies). With any
    descriptor attached, ``payload`` must be at least one byte: a stream socket drops
    ancillary data that travels without payload.
    """
    nums = [_fileno(f) for f in fds]
    if len(nums) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} descriptors fit in one message, got {len(nums)}")
    data = memoryview(payload).cast("B")
    if nums and len(data) == 0:
        raise ValueError("descriptors need at least one payload byte to travel over a stream socket")
    lib, ffi = _lib()
    s = _fileno(sock, "socket")
    arr = ffi.new("int[]", nums) if nums else ffi.NULL
    buf = ffi.from_buffer(data) if len(data) else ffi.NULL
    rc = lib.vkx_send_fds(s, arr, len(nums), buf, len(data))
    if rc != 0:
        raise _fail(rc, f"sending {len(nums)} descriptor(s) and {len(data)} byte(s) on socket {s}")


def recv_fds(sock: Any, max_fds: int = MAX_FDS, max_bytes: int = 65536) -> tuple[list[Fd], bytes]:
    """Receive one message: up to ``max_fds`` descriptors (owned, close-on-exec) and its payload.

    Returns ``([], b"")`` at end of stream. On a stream socket, payload beyond ``max_bytes``
    stays queued for the next call. A ``socket.socket`` with a timeout raises ``TimeoutError``
    when nothing arrives in time (``BlockingIOError`` when non-blocking). If the sender attached more than ``max_fds`` descriptors,
    all of them are closed and VkxError (errno EMSGSIZE) is raised.
    """
    max_fds = operator.index(max_fds)
    max_bytes = operator.index(max_bytes)
    if not 0 <= max_fds <= MAX_FDS:
        raise ValueError(f"max_fds must be in [0, {MAX_FDS}], got {max_fds}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    lib, ffi = _lib()
    s = _fileno(sock, "socket")
    gettimeout = getattr(sock, "gettimeout", None)
    timeout = gettimeout() if gettimeout is not None else None
    deadline = None if timeout is None else time.monotonic() + timeout
    fds = ffi.new("int[]", max(max_fds, 1))
    data = ffi.new("char[]", max(max_bytes, 1))
    n_out = ffi.new("int *", 0)
    len_out = ffi.new("size_t *", 0)
    while True:
        rc = lib.vkx_recv_fds(s, fds, max_fds, n_out, data, max_bytes, len_out)
        if rc != -_errno.EAGAIN:
            break
        # A non-blocking descriptor: honour the socket object's timeout (None waits forever).
        if timeout == 0:
            raise BlockingIOError(_errno.EAGAIN, f"recv_fds: nothing to receive on non-blocking socket {s}")
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not sync_file_wait(s, left):
            raise TimeoutError(f"recv_fds: nothing arrived on socket {s} within {timeout} s")
    if rc != 0:
        hint = (
            f"the peer sent more than {max_fds} descriptor(s) or a datagram over {max_bytes} bytes; "
            "what arrived was closed"
            if rc == -_errno.EMSGSIZE
            else ""
        )
        raise _fail(rc, f"receiving descriptors on socket {s}", hint)
    owned = [Fd(fds[i]) for i in range(n_out[0])]
    return owned, bytes(ffi.buffer(data, len_out[0]))
