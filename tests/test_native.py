"""Tests for native/vkx_native.c and vkxsplit.native.

This machine has no dma-buf exporter (/dev/dma_heap, /dev/udmabuf, sw_sync), so the dma-buf
ioctls are checked by layout (ioctl numbers and struct layouts against the kernel headers, read
and computed here independently of the C compiler) and by their error paths; memfd, SCM_RIGHTS
passing, poll-based waiting and descriptor ownership run for real.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import fcntl
import gc
import mmap
import os
import platform
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest

from vkxsplit import native
from vkxsplit.errors import EnvironmentProblem, VkxError

ROOT = Path(__file__).resolve().parents[1]
UAPI_DIR = Path("/usr/include/linux")
PAGE = mmap.PAGESIZE


# --------------------------------------------------------------------------------------------
# an independent reading of the kernel uapi headers


def _header(name: str) -> str:
    path = UAPI_DIR / name
    if not path.exists():
        pytest.skip(f"{path} missing: install the kernel uapi headers (apt-get install -y linux-libc-dev)")
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # block comments
    text = re.sub(r"//[^\n]*", " ", text)
    return text.replace("\\\n", " ")  # line continuations


def _defines(text: str) -> dict[str, str]:
    """Object-like macros: NAME -> body (function-like macros are skipped)."""
    out = {}
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?!\()[ \t]+(.+?)[ \t]*$", text, flags=re.M):
        out[m.group(1)] = m.group(2)
    return out


_CTYPES = {
    "__u8": ctypes.c_uint8,
    "__u16": ctypes.c_uint16,
    "__u32": ctypes.c_uint32,
    "__s32": ctypes.c_int32,
    "__u64": ctypes.c_uint64,
    "__s64": ctypes.c_int64,
}


def _structs(text: str) -> dict[str, type[ctypes.Structure]]:
    """Every struct of fixed-size scalar fields in the header, as a ctypes.Structure."""
    out: dict[str, type[ctypes.Structure]] = {}
    for m in re.finditer(r"struct\s+(\w+)\s*\{([^{}]*)\}\s*;", text):
        fields = []
        ok = True
        for decl in filter(None, (d.strip() for d in m.group(2).split(";"))):
            fm = re.fullmatch(r"(__[us]\d+)\s+(\w+)", decl)
            if fm is None or fm.group(1) not in _CTYPES:
                ok = False  # arrays, nested structs: not needed here
                break
            fields.append((fm.group(2), _CTYPES[fm.group(1)]))
        if ok:
            out[m.group(1)] = type(m.group(1), (ctypes.Structure,), {"_fields_": fields})
    return out


def _eval_int(expr: str, defines: dict[str, str]) -> int:
    """Evaluate a small C integer expression: literals, 'c', names, <<, |, parentheses."""
    expr = re.sub(r"'(.)'", lambda m: str(ord(m.group(1))), expr)
    expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return _eval_int(defines[node.id], defines)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.BitOr, ast.Add)):
            a, b = ev(node.left), ev(node.right)
            return (
                a << b
                if isinstance(node.op, ast.LShift)
                else (a | b if isinstance(node.op, ast.BitOr) else a + b)
            )
        raise AssertionError(f"unexpected expression {expr!r}")

    return ev(ast.parse(expr.strip(), mode="eval"))


def _ioc_layout() -> dict[str, int]:
    """_IOC field widths and direction bits from <asm-generic/ioctl.h>."""
    text = Path("/usr/include/asm-generic/ioctl.h")
    if not text.exists():
        pytest.skip("asm-generic/ioctl.h missing: apt-get install -y linux-libc-dev")
    defs = _defines(re.sub(r"/\*.*?\*/", " ", text.read_text(), flags=re.S))
    return {
        k: _eval_int(defs[k], defs)
        for k in ("_IOC_NRBITS", "_IOC_TYPEBITS", "_IOC_SIZEBITS", "_IOC_WRITE", "_IOC_READ")
    }


GENERIC_IOCTL_ARCHES = {
    "x86_64",
    "i386",
    "i686",
    "aarch64",
    "arm64",
    "armv7l",
    "riscv64",
    "s390x",
    "loongarch64",
}


def _ioctl_number(body: str, defines: dict[str, str], structs: dict[str, type[ctypes.Structure]]) -> int:
    """dir << 30 | size << 16 | type << 8 | nr for a `_IOW(type, nr, struct x)` style body."""
    m = re.fullmatch(
        r"(_IOWR|_IOW|_IOR)\s*\(\s*([^,]+?)\s*,\s*([^,]+?)\s*,\s*struct\s+(\w+)\s*\)", body.strip()
    )
    assert m, f"unexpected ioctl definition {body!r}"
    direction = {"_IOW": 1, "_IOR": 2, "_IOWR": 3}[m.group(1)]  # _IOC_WRITE = 1, _IOC_READ = 2
    typ = _eval_int(m.group(2), defines)
    nr = _eval_int(m.group(3), defines)
    size = ctypes.sizeof(structs[m.group(4)])
    assert size < (1 << 14) and typ < 256 and nr < 256
    return (direction << 30) | (size << 16) | (typ << 8) | nr


# (header, ioctl macro, struct, fields the C code reads or writes)
UAPI_USED = [
    (
        "dma-heap.h",
        "DMA_HEAP_IOCTL_ALLOC",
        "dma_heap_allocation_data",
        ["len", "fd", "fd_flags", "heap_flags"],
    ),
    ("udmabuf.h", "UDMABUF_CREATE", "udmabuf_create", ["memfd", "flags", "offset", "size"]),
    ("dma-buf.h", "DMA_BUF_IOCTL_SYNC", "dma_buf_sync", ["flags"]),
    ("dma-buf.h", "DMA_BUF_IOCTL_EXPORT_SYNC_FILE", "dma_buf_export_sync_file", ["flags", "fd"]),
    ("dma-buf.h", "DMA_BUF_IOCTL_IMPORT_SYNC_FILE", "dma_buf_import_sync_file", ["flags", "fd"]),
]
FLAGS_USED = [
    (
        "dma-buf.h",
        [
            "DMA_BUF_SYNC_READ",
            "DMA_BUF_SYNC_WRITE",
            "DMA_BUF_SYNC_RW",
            "DMA_BUF_SYNC_START",
            "DMA_BUF_SYNC_END",
        ],
    ),
    ("udmabuf.h", ["UDMABUF_FLAGS_CLOEXEC"]),
]


def test_native_module_is_built() -> None:
    assert native.native_available(), "vkxsplit._native is not built: pip install -e . (gcc needed)"
    import vkxsplit._native as mod

    assert Path(mod.__file__).parent == Path(native.__file__).parent  # lives inside the package
    assert mod.lib.vkx_uapi_lookup(b"no such name", mod.ffi.new("uint64_t *")) == -errno.ENOENT


def test_ioc_encoding_is_the_generic_one() -> None:
    if platform.machine() not in GENERIC_IOCTL_ARCHES:
        pytest.skip(f"{platform.machine()} does not use the asm-generic _IOC encoding")
    assert _ioc_layout() == {
        "_IOC_NRBITS": 8,
        "_IOC_TYPEBITS": 8,
        "_IOC_SIZEBITS": 14,
        "_IOC_WRITE": 1,
        "_IOC_READ": 2,
    }


@pytest.mark.parametrize(("header", "macro", "struct", "fields"), UAPI_USED, ids=[u[1] for u in UAPI_USED])
def test_ioctl_numbers_and_struct_layouts_match_headers(
    header: str, macro: str, struct: str, fields: list[str]
) -> None:
    if platform.machine() not in GENERIC_IOCTL_ARCHES:
        pytest.skip(f"{platform.machine()} does not use the asm-generic _IOC encoding")
    text = _header(header)
    defines = _defines(text)
    structs = _structs(text)
    if macro not in defines:
        pytest.skip(f"{UAPI_DIR / header} predates {macro}")
    table = native.uapi()
    ref = structs[struct]
    assert table[macro] == _ioctl_number(defines[macro], defines, structs)
    assert table[f"sizeof(struct {struct})"] == ctypes.sizeof(ref)
    assert [f for f, _ in ref._fields_] == fields, "the C code uses exactly the header's fields"
    for field in fields:
        assert table[f"offsetof(struct {struct}, {field})"] == getattr(ref, field).offset, field


@pytest.mark.parametrize(("header", "names"), FLAGS_USED, ids=[f[0] for f in FLAGS_USED])
def test_flag_values_match_headers(header: str, names: list[str]) -> None:
    defines = _defines(_header(header))
    table = native.uapi()
    for name in names:
        assert table[name] == _eval_int(defines[name], defines), name
    if header == "dma-buf.h":
        assert (native.SYNC_READ, native.SYNC_WRITE) == (
            table["DMA_BUF_SYNC_READ"],
            table["DMA_BUF_SYNC_WRITE"],
        )


def test_libc_constants_match_python() -> None:
    table = native.uapi()
    assert table["MFD_CLOEXEC"] == os.MFD_CLOEXEC
    assert table["MFD_ALLOW_SEALING"] == os.MFD_ALLOW_SEALING
    assert table["F_ADD_SEALS"] == fcntl.F_ADD_SEALS
    assert table["F_GET_SEALS"] == fcntl.F_GET_SEALS
    assert table["F_SEAL_SHRINK"] == fcntl.F_SEAL_SHRINK
    assert table["SCM_RIGHTS"] == socket.SCM_RIGHTS
    assert table["MSG_CMSG_CLOEXEC"] == socket.MSG_CMSG_CLOEXEC
    assert table["VKX_MAX_FDS"] == native.MAX_FDS == 253


def test_uapi_fallback_copies_match_system_headers(tmp_path: Path) -> None:
    """Compile vkx_native.c ignoring the system uapi headers: its own copies must agree."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed")
    so = tmp_path / "fallback.so"
    cmd = [gcc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-DVKX_NO_SYSTEM_UAPI_HEADERS"]
    subprocess.run(
        [*cmd, "-o", str(so), str(ROOT / "native" / "vkx_native.c")], check=True, capture_output=True
    )
    lib = ctypes.CDLL(str(so))
    lib.vkx_uapi_name.restype = ctypes.c_char_p
    lib.vkx_uapi_name.argtypes = [ctypes.c_size_t]
    lib.vkx_uapi_value.restype = ctypes.c_uint64
    lib.vkx_uapi_value.argtypes = [ctypes.c_size_t]
    lib.vkx_uapi_count.restype = ctypes.c_size_t
    fallback = {lib.vkx_uapi_name(i).decode(): lib.vkx_uapi_value(i) for i in range(lib.vkx_uapi_count())}
    assert lib.vkx_uapi_system_headers() == 0
    assert fallback == native.uapi()
    # The module compiled against this machine's headers took every definition from them.
    import vkxsplit._native as mod

    expected = 0
    for bit, (header, macro) in enumerate(
        [
            ("dma-heap.h", "DMA_HEAP_IOCTL_ALLOC"),
            ("udmabuf.h", "UDMABUF_CREATE"),
            ("dma-buf.h", "DMA_BUF_IOCTL_SYNC"),
            ("dma-buf.h", "DMA_BUF_IOCTL_EXPORT_SYNC_FILE"),
            ("dma-buf.h", "DMA_BUF_IOCTL_IMPORT_SYNC_FILE"),
        ]
    ):
        if (UAPI_DIR / header).exists() and macro in _defines(_header(header)):
            expected |= 1 << bit
    assert mod.lib.vkx_uapi_system_headers() == expected


# --------------------------------------------------------------------------------------------
# errors: missing device nodes, non-dma-buf descriptors, missing module


def test_dma_heap_missing_node_is_an_environment_problem() -> None:
    if os.path.exists("/dev/dma_heap/system"):
        pytest.skip("/dev/dma_heap/system exists here")
    before = native.open_fd_count()
    with pytest.raises(EnvironmentProblem) as info:
        native.dma_heap_alloc(1 << 20)
    msg = str(info.value)
    assert "/dev/dma_heap/system does not exist" in msg
    assert "CONFIG_DMABUF_HEAPS_SYSTEM" in info.value.hint and "host-allocation" in info.value.hint
    assert info.value.errno == errno.ENOENT
    assert native.open_fd_count() == before


def test_dma_heap_unknown_heap_names_the_node() -> None:
    with pytest.raises(EnvironmentProblem, match=r"/dev/dma_heap/vkx-no-such-heap does not exist"):
        native.dma_heap_alloc(4096, heap="vkx-no-such-heap")
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError):
            native.dma_heap_alloc(4096, heap=bad)
    with pytest.raises(ValueError):
        native.dma_heap_alloc(0)


def test_udmabuf_missing_node_is_an_environment_problem() -> None:
    if os.path.exists("/dev/udmabuf"):
        pytest.skip("/dev/udmabuf exists here")
    with native.memfd(4 * PAGE, "udmabuf-src") as m:
        before = native.open_fd_count()
        with pytest.raises(EnvironmentProblem) as info:
            native.udmabuf_from_memfd(m, PAGE, 2 * PAGE)
        assert "/dev/udmabuf does not exist" in str(info.value)
        assert "modprobe udmabuf" in info.value.hint and "host-allocation" in info.value.hint
        assert native.open_fd_count() == before
        assert not m.closed, "the memfd stays the caller's"


def test_udmabuf_argument_checks_follow_the_kernel_rules() -> None:
    with native.memfd(4 * PAGE, "src") as m:
        with pytest.raises(ValueError, match="page size"):
            native.udmabuf_from_memfd(m, 1, PAGE)
        with pytest.raises(ValueError, match="page size"):
            native.udmabuf_from_memfd(m, 0, PAGE + 1)
        with pytest.raises(ValueError, match="beyond"):
            native.udmabuf_from_memfd(m, 2 * PAGE, 3 * PAGE)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING: no seals at all
    try:
        os.ftruncate(unsealed, PAGE)
        assert fcntl.fcntl(unsealed, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0
        with pytest.raises(ValueError, match="F_SEAL_SHRINK"):
            native.udmabuf_from_memfd(unsealed, 0, PAGE)
    finally:
        os.close(unsealed)


def _kernel_errno(fd: int, request: int, arg: bytes) -> int:
    """The errno the kernel gives for this ioctl, asked through Python's fcntl (the reference)."""
    with pytest.raises(OSError) as info:
        fcntl.ioctl(fd, request, arg)
    return info.value.errno


def test_dmabuf_ioctls_on_a_non_dmabuf_name_the_ioctl_and_errno() -> None:
    table = native.uapi()
    with native.memfd(PAGE) as m:
        expect = _kernel_errno(m.fd, table["DMA_BUF_IOCTL_SYNC"], bytes(8))
        assert expect == errno.ENOTTY
        with pytest.raises(VkxError) as info:
            with native.DmaBufCpuAccess(m, read=True, write=False):
                pass
        assert not isinstance(info.value, EnvironmentProblem)
        assert "ioctl(DMA_BUF_IOCTL_SYNC)" in str(info.value) and "ENOTTY" in str(info.value)
        assert info.value.errno == expect

        expect = _kernel_errno(m.fd, table["DMA_BUF_IOCTL_EXPORT_SYNC_FILE"], bytes(8))
        with pytest.raises(
            VkxError, match=r"ioctl\(DMA_BUF_IOCTL_EXPORT_SYNC_FILE\) failed with ENOTTY"
        ) as info:
            native.export_sync_file(m, read=True)
        assert info.value.errno == expect
        with pytest.raises(VkxError, match=r"ioctl\(DMA_BUF_IOCTL_IMPORT_SYNC_FILE\) failed with ENOTTY"):
            native.import_sync_file(m, m, write=True)
        with pytest.raises(ValueError):
            native.export_sync_file(m, read=False, write=False)


def test_missing_compiled_module_says_how_to_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(native, "_NATIVE_IMPORT_ERROR", ImportError("No module named 'vkxsplit._native'"))
    assert not native.native_available()
    with pytest.raises(EnvironmentProblem) as info:
        native.memfd(PAGE)
    assert "vkxsplit._native" in str(info.value) and "pip install -e ." in info.value.hint


# --------------------------------------------------------------------------------------------
# memfd


def test_memfd_is_sized_sealed_cloexec_and_maps() -> None:
    size = 3 * PAGE + 5
    with native.memfd(size, "vkx-test") as m:
        assert os.fstat(m.fd).st_size == size
        assert os.readlink(f"/proc/self/fd/{m.fd}") == "/memfd:vkx-test (deleted)"
        assert native.open_fd_targets()[str(m.fd)] == "/memfd:vkx-test (deleted)"
        assert fcntl.fcntl(m.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        seals = fcntl.fcntl(m.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and not seals & (fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        with pytest.raises(PermissionError):
            os.ftruncate(m.fd, PAGE)  # the shrink seal holds
        with mmap.mmap(m.fd, size) as mm:
            pattern = bytes(i * 7 % 251 for i in range(size))
            mm[:] = pattern
            assert os.pread(m.fd, size, 0) == pattern  # the file, read another way
        os.ftruncate(m.fd, size + PAGE)  # growing is allowed
        assert os.fstat(m.fd).st_size == size + PAGE
    with native.memfd(0, "empty") as m:
        assert os.fstat(m.fd).st_size == 0
    with pytest.raises(ValueError):
        native.memfd(PAGE, "x" * (native.MEMFD_NAME_MAX + 1))


# --------------------------------------------------------------------------------------------
# SCM_RIGHTS between processes


def _child(sock: socket.socket) -> int:
    fds, payload = native.recv_fds(sock, 4, 1024)
    if len(fds) != 1 or not payload.startswith(b"fill:"):
        return 2
    fill = int(payload[5:])
    with fds[0] as m, mmap.mmap(m.fd, 4 * PAGE) as mm:
        for i in range(4):
            mm[i * PAGE : (i + 1) * PAGE] = bytes([(fill + i) % 256]) * PAGE
    with native.memfd(PAGE, "from-child") as reply:
        os.pwrite(reply.fd, b"child says hi", 0)
        native.send_fds(sock, [reply], b"done")
    return 0


def test_fds_pass_between_processes_over_a_socketpair() -> None:
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            parent_sock.close()
            code = _child(child_sock)
        finally:
            os._exit(code)
    child_sock.close()
    parent_sock.settimeout(10)  # a dead child cannot hang the test
    try:
        with native.memfd(4 * PAGE, "shared") as m, mmap.mmap(m.fd, 4 * PAGE) as mm:
            native.send_fds(parent_sock, [m], b"fill:40")
            fds, payload = native.recv_fds(parent_sock, 4, 64)
            assert payload == b"done" and len(fds) == 1
            with fds[0] as reply:
                assert fcntl.fcntl(reply.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # MSG_CMSG_CLOEXEC
                assert os.pread(reply.fd, 13, 0) == b"child says hi"
            expected = b"".join(bytes([40 + i]) * PAGE for i in range(4))
            assert mm[:] == expected  # the child's writes, seen through the parent's mapping
    finally:
        _, status = os.waitpid(pid, 0)
        parent_sock.close()
    assert os.waitstatus_to_exitcode(status) == 0


def test_several_fds_in_one_message_refer_to_the_same_files() -> None:
    a, b = socket.socketpair()
    with a, b, native.memfd(PAGE, "one") as m1, native.memfd(2 * PAGE, "two") as m2:
        r, w = os.pipe()
        try:
            native.send_fds(a, [m1, m2, r], b"three")
            fds, payload = native.recv_fds(b, 8, 64)
            assert payload == b"three" and len(fds) == 3
            for sent, got in zip([m1.fd, m2.fd, r], fds):
                assert got.fd != sent
                assert (os.fstat(got.fd).st_ino, os.fstat(got.fd).st_dev) == (
                    os.fstat(sent).st_ino,
                    os.fstat(sent).st_dev,
                )
            os.write(w, b"ping")
            assert os.read(fds[2].fd, 4) == b"ping"
            for f in fds:
                f.close()
        finally:
            os.close(r)
            os.close(w)


def test_too_many_fds_are_closed_and_reported() -> None:
    a, b = socket.socketpair()
    with a, b, native.memfd(PAGE) as m:
        before = native.open_fd_count()
        native.send_fds(a, [m, m, m], b"x")
        with pytest.raises(VkxError) as info:
            native.recv_fds(b, 1, 64)
        assert info.value.errno == errno.EMSGSIZE
        assert native.open_fd_count() == before  # nothing received was leaked
        native.send_fds(a, [m], b"y")
        with pytest.raises(VkxError):
            native.recv_fds(b, 0, 64)  # descriptors offered to a receiver that takes none
        assert native.open_fd_count() == before


def test_payload_larger_than_the_socket_buffer_arrives_whole() -> None:
    a, b = socket.socketpair()
    a.settimeout(5)  # non-blocking underneath: the sender must wait for room, not cut the message
    b.settimeout(5)
    payload = os.urandom(1 << 20)
    with a, b, native.memfd(PAGE) as m:
        sender = threading.Thread(target=native.send_fds, args=(a, [m], payload))
        sender.start()
        fds, chunk = native.recv_fds(b, 1, len(payload))
        got = bytearray(chunk)
        while len(got) < len(payload):
            more_fds, chunk = native.recv_fds(b, 1, len(payload))
            assert more_fds == [] and chunk
            got += chunk
        sender.join(5)
        assert bytes(got) == payload and len(fds) == 1
        fds[0].close()


def test_recv_honours_the_socket_timeout() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.05)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            native.recv_fds(b, 1, 16)
        assert time.monotonic() - t0 >= 0.045
        b.settimeout(0)
        with pytest.raises(BlockingIOError):
            native.recv_fds(b, 1, 16)
        b.settimeout(1)
        a.sendall(b"late")
        assert native.recv_fds(b, 1, 16) == ([], b"late")


def test_a_closed_peer_gives_epipe_not_sigpipe() -> None:
    """Python ignores SIGPIPE; a child restores the default action, which would kill it."""
    a, b = socket.socketpair()
    b.close()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            with native.memfd(PAGE) as m:
                try:
                    native.send_fds(a, [m], b"x")
                except VkxError as exc:
                    code = 0 if getattr(exc, "errno", None) == errno.EPIPE else 3
        finally:
            os._exit(code)
    a.close()
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"killed by signal {os.WTERMSIG(status)}"
    assert os.waitstatus_to_exitcode(status) == 0


def test_send_recv_edge_cases() -> None:
    a, b = socket.socketpair()
    with b, native.memfd(PAGE) as m:
        with pytest.raises(ValueError, match="payload byte"):
            native.send_fds(a, [m], b"")
        with pytest.raises(ValueError):
            native.send_fds(a, [m] * (native.MAX_FDS + 1), b"x")
        native.send_fds(a, [], b"plain")
        assert native.recv_fds(b, 2, 64) == ([], b"plain")
        a.close()
        assert native.recv_fds(b, 2, 64) == ([], b"")  # end of stream
        with pytest.raises(VkxError) as info:
            native.send_fds(b, [m], b"x")  # peer gone: EPIPE, and no SIGPIPE kills us
        assert info.value.errno == errno.EPIPE and "sendmsg" in str(info.value)


# --------------------------------------------------------------------------------------------
# sync_file_wait behaves as poll(POLLIN)


def _poll_ready(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


def test_sync_file_wait_on_an_eventfd() -> None:
    efd = os.eventfd(0, os.EFD_CLOEXEC)
    try:
        assert _poll_ready(efd) is False
        t0 = time.monotonic()
        assert native.sync_file_wait(efd, 0.05) is False
        assert time.monotonic() - t0 >= 0.045
        assert native.sync_file_wait(efd, 0) is False
        os.eventfd_write(efd, 1)
        assert _poll_ready(efd) is True
        t0 = time.monotonic()
        assert native.sync_file_wait(efd, 5.0) is True
        assert time.monotonic() - t0 < 1.0
        os.eventfd_read(efd)
        assert native.sync_file_wait(efd, 0) is _poll_ready(efd) is False

        timer = threading.Timer(0.05, os.eventfd_write, args=(efd, 1))
        timer.start()
        t0 = time.monotonic()
        assert native.sync_file_wait(efd, None) is True  # wakes when another thread signals
        assert time.monotonic() - t0 >= 0.04
        timer.join()
    finally:
        os.close(efd)


def test_sync_file_wait_on_a_pipe() -> None:
    r, w = os.pipe()
    try:
        assert native.sync_file_wait(r, 0.02) is False
        os.write(w, b"x")
        assert native.sync_file_wait(r, 0.02) is True is _poll_ready(r)
        os.read(r, 1)
        assert native.sync_file_wait(r, 0) is False
        os.close(w)
        w = -1
        assert native.sync_file_wait(r, 1.0) is True  # POLLHUP: a read will not block
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_sync_file_wait_keeps_its_timeout_across_signals() -> None:
    """poll() fails with EINTR on every signal; the wait resumes with the time that is left."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals need the main thread")
    efd = os.eventfd(0, os.EFD_CLOEXEC)
    hits = []
    stop = threading.Event()
    main_id = threading.main_thread().ident
    assert main_id is not None

    sent = []

    def pester() -> None:  # SIGUSR1 to the waiting thread every 20 ms (SIGALRM is pytest-timeout's)
        while not stop.wait(0.02):
            signal.pthread_kill(main_id, signal.SIGUSR1)
            sent.append(time.monotonic())

    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    pester_thread = threading.Thread(target=pester)
    try:
        pester_thread.start()
        t0 = time.monotonic()
        assert native.sync_file_wait(efd, 0.25) is False
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        pester_thread.join()
        signal.signal(signal.SIGUSR1, old)
        os.close(efd)
    # Pending signals coalesce, so Python's handler runs at least once, after the call returns.
    assert hits
    assert len([t for t in sent if t < t0 + 0.24]) >= 3, "several signals landed inside the wait"
    assert 0.24 <= elapsed < 1.0


def test_sync_file_wait_on_a_closed_fd() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    p = select.poll()
    p.register(r, select.POLLIN)
    assert p.poll(0) == [(r, select.POLLNVAL)]  # the reference behaviour
    with pytest.raises(VkxError) as info:
        native.sync_file_wait(r, 0)
    assert info.value.errno == errno.EBADF
    with pytest.raises(ValueError):
        native.sync_file_wait(0, -1)


# --------------------------------------------------------------------------------------------
# Fd ownership


def test_thousands_of_memfds_leave_the_fd_count_unchanged() -> None:
    gc.collect()
    before = native.open_fd_count()
    assert before == len(os.listdir("/proc/self/fd")) - 1
    held = [native.memfd(PAGE, f"bulk{i}") for i in range(1000)]
    assert native.open_fd_count() == before + 1000
    for f in held:
        f.close()
    assert native.open_fd_count() == before
    for i in range(3000):
        with native.memfd(PAGE, "loop") as f:
            if i % 3 == 0:
                f.dup().close()
            elif i % 3 == 1:
                os.close(native.Fd(f.detach()).detach())
    assert native.open_fd_count() == before


def test_double_close_never_closes_someone_elses_fd() -> None:
    a = native.memfd(PAGE)
    number = a.fd
    a.close()
    assert a.closed and repr(a) == "Fd(closed)"
    other = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    if other != number:  # normally the kernel reuses the lowest free number; make sure of it
        os.dup2(other, number, inheritable=False)
        os.close(other)
        other = number
    try:
        assert os.path.samestat(os.fstat(number), os.stat("/dev/null"))
        a.close()
        with a:
            pass
        assert os.path.samestat(os.fstat(other), os.stat("/dev/null"))  # still open, still ours
        with pytest.raises(ValueError):
            a.fileno()
        with pytest.raises(ValueError):
            a.detach()
    finally:
        os.close(other)


def test_concurrent_close_closes_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_close = os.close

    def counting_close(fd: int) -> None:
        calls.append(fd)
        real_close(fd)

    f = native.memfd(PAGE)
    number = f.fd
    barrier = threading.Barrier(8)

    def closer() -> None:
        barrier.wait()
        f.close()

    monkeypatch.setattr(native.os, "close", counting_close)
    threads = [threading.Thread(target=closer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert calls == [number]


def test_dup_detach_and_garbage_collection() -> None:
    before = native.open_fd_count()
    with native.memfd(PAGE, "orig") as f:
        d = f.dup()
        assert d.fd != f.fd and os.fstat(d.fd).st_ino == os.fstat(f.fd).st_ino
        assert fcntl.fcntl(d.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    os.pwrite(d.fd, b"alive", 0)  # the duplicate outlives the original
    raw = d.detach()
    assert d.closed
    d.close()  # does not close the detached number
    assert os.pread(raw, 5, 0) == b"alive"
    os.close(raw)
    assert native.open_fd_count() == before

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        leaked = native.memfd(PAGE)
        del leaked
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert native.open_fd_count() == before

    with pytest.raises(ValueError):
        native.Fd(-1)
    with pytest.raises(TypeError):
        native.Fd(True)
