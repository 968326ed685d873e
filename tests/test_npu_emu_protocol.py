"""The npu-emu protocol spoken directly to a server process with hostile messages: each gets an
error reply (never a crash, never a leaked fd) and the server still answers a valid request
afterwards; the process ignores SIGINT and runs in its own session; ``close()`` drains the
queued unmap/unload steps before ``stop`` (no broken pipes, exit status 0)."""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import WAIT_S

from vkxsplit.attach import SharedArena
from vkxsplit.backend import MatMulJob, create_backend
from vkxsplit.vk.event import Timeline

ROOT = Path(__file__).resolve().parents[1]
M, N, K = 8, 8, 16
CHUNK = 64 << 10
W_OFF, X_OFF, Y_OFF = 0, 16 << 10, 32 << 10


def bf16_bits(a):
    """Small integers, exact in bf16: their bf16 bit patterns."""
    return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def memfd(size, seal=True):
    fd = os.memfd_create("npu-proto", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


class Server:
    """A server process on one end of a socketpair; the test is the host."""

    def __init__(self, tmp: Path) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.stderr_path = tmp / "npu-server.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vkxsplit.backends.npu_emu_server", "--fd", str(child.fileno()),
                 "--gflops", "1e6", "--max-kernels", "6"],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stderr=err, env=env)
        child.close()
        self.sock = parent
        parent.settimeout(WAIT_S)
        assert self.recv()["op"] == "hello"
        parent.settimeout(10.0)
        self.seq = 0
        # one sealed memfd chunk holding w, x and y
        self.fd = memfd(CHUNK)
        self.mem = mmap.mmap(self.fd, CHUNK)
        rng = np.random.default_rng(5)
        self.w = rng.integers(-4, 5, (N, K)).astype(np.float32)
        self.x = rng.integers(-4, 5, (M, K)).astype(np.float32)
        np.frombuffer(self.mem, np.uint16, N * K, W_OFF)[:] = bf16_bits(self.w).ravel()
        np.frombuffer(self.mem, np.uint16, M * K, X_OFF)[:] = bf16_bits(self.x).ravel()
        self.send({"op": "map", "chunk": 1, "size": CHUNK, "kind": "host_allocation"}, [self.fd])

    def send(self, msg, fds=()) -> None:
        data = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.send(data)

    def recv(self) -> dict:
        data = self.sock.recv(1 << 16)
        assert data, f"the server closed the socket (exit {self.proc.wait(5)}): {self.stderr()}"
        return json.loads(data)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def nfds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def mul_mat(self, **over) -> dict:
        self.seq += 1
        msg = {"op": "mul_mat", "seq": self.seq, "M": M, "N": N, "K": K, "xs": K, "ys": N, "r0": 0, "r1": N,
               "w_row0": 0, "key": [1, W_OFF, N, "bf16", K], "w": [1, W_OFF, N * K * 2],
               "x": [1, X_OFF, M * K * 2], "y": [1, Y_OFF, M * N * 4]}
        msg.update(over)
        return msg

    def check_valid(self) -> None:
        """A valid request is answered, with the right numbers."""
        y = np.frombuffer(self.mem, np.float32, M * N, Y_OFF)
        y[:] = np.nan
        msg = self.mul_mat()
        self.send(msg)
        assert self.recv() == {"op": "done", "seq": msg["seq"]}
        np.testing.assert_array_equal(y.reshape(M, N), self.x @ self.w.T)

    def close(self) -> int:
        try:
            self.send({"op": "stop"})
        except OSError:
            pass
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.sock.close()
            self.mem.close()
            os.close(self.fd)



@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)  # one process per case: a crash shows in that case only
    s.check_valid()
    yield s
    rc = s.close()
    assert rc == 0, s.stderr()
    assert "Traceback" not in s.stderr(), s.stderr()


def _mm(**over):
    return lambda s: (s.mul_mat(**over), [])


def _raw(data):
    return lambda s: (data, [])


def _map(size=4096, kind="host_allocation", chunk=100, fds=None, **extra):
    def build(s):
        fd_list = fds(s) if fds is not None else []
        return {"op": "map", "chunk": chunk, "size": size, "kind": kind, **extra}, fd_list
    return build


def _pipe(s):
    r, w = os.pipe()
    os.close(w)
    return [r]


def _sock(s):
    a, b = socket.socketpair()
    b.close()
    return [a.detach()]


def _tmpfile(s):
    f = tempfile.TemporaryFile()
    f.truncate(4096)
    return [os.dup(f.fileno())]


HOSTILE = {
    # transport and JSON
    "bad JSON": _raw(b"{not json"),
    "not UTF-8": _raw(b"\xff\xfe\xfa"),
    "deeply nested JSON": _raw(b"[" * 60000),
    "JSON array": _raw(b"[1, 2]"),
    "empty message": _raw(b""),
    "oversized message": _raw(b'{"op": "stop", "pad": "' + b"x" * 70000 + b'"}'),
    "unknown op": _raw(b'{"op": "frobnicate"}'),
    # the error text would echo the request: 21,000 euro signs are 63 KB of UTF-8 in the request
    # and 126 KB as JSON escapes in a reply that quoted them; it must still fit a 64 KiB receive
    "huge unknown op": _raw(('{"op": "' + "\u20ac" * 21000 + '"}').encode()),
    "op missing": _raw(b'{"chunk": 1}'),
    "op not a string": _raw(b'{"op": 3}'),
    # map: fds
    "map without fd": _map(),
    "map with a pipe fd": _map(fds=_pipe),
    "map with a socket fd": _map(fds=_sock),
    "map with a memfd smaller than claimed": _map(size=1 << 20, fds=lambda s: [memfd(4096)]),
    "map with an unsealed memfd": _map(fds=lambda s: [memfd(4096, seal=False)]),
    "map with a plain file": _map(fds=_tmpfile),
    "map kind dma_buf with a memfd": _map(kind="dma_buf", fds=lambda s: [memfd(4096)]),
    "map with two fds": _map(fds=lambda s: [memfd(4096), memfd(4096)]),
    "map with too many fds": _map(fds=lambda s: [memfd(4096) for _ in range(6)]),
    "unmap with an fd": lambda s: ({"op": "unmap", "chunk": 100}, [memfd(4096)]),
    # map: fields
    "map of a mapped chunk": _map(chunk=1, fds=lambda s: [memfd(4096)]),
    "map size 0": _map(size=0, fds=lambda s: [memfd(4096)]),
    "map size negative": _map(size=-4096, fds=lambda s: [memfd(4096)]),
    "map size a string": _map(size="4096", fds=lambda s: [memfd(4096)]),
    "map size huge": _map(size=1 << 62, fds=lambda s: [memfd(4096)]),
    "map chunk negative": _map(chunk=-1, fds=lambda s: [memfd(4096)]),
    "map unknown kind": _map(kind="gpu", fds=lambda s: [memfd(4096)]),
    "map extra field": _map(fds=lambda s: [memfd(4096)], offset=0),
    "unmap chunk a list": _raw(b'{"op": "unmap", "chunk": [1]}'),
    "unload key a dict": _raw(b'{"op": "unload", "key": {"a": 1}}'),
    # mul_mat: strides and shapes
    "negative xs": _mm(xs=-K),
    "negative ys": _mm(ys=-N),
    "huge xs": _mm(xs=1 << 40),
    "huge ys": _mm(ys=1 << 62),
    "xs below K": _mm(xs=K - 1),
    "M beyond x": _mm(M=1 << 20),
    "K huge": _mm(K=1 << 40),
    "negative M": _mm(M=-1),
    "r1 beyond N": _mm(r1=N + 1),
    "r0 not below r1": _mm(r0=N, r1=N),
    "w_row0 above r0": _mm(w_row0=1),
    "w range beyond the mapping": _mm(w=[1, CHUNK - 16, 4096]),
    "y offset negative": _mm(y=[1, -4, M * N * 4]),
    "y offset huge": _mm(y=[1, 1 << 62, M * N * 4]),
    "x misaligned": _mm(x=[1, X_OFF + 1, M * K * 2]),
    "unmapped chunk": _mm(x=[7, 0, M * K * 2]),
    "y range smaller than the shape": _mm(y=[1, Y_OFF, M * N * 4 - 4]),
    # mul_mat: types and fields
    "M a string": _mm(M="8"),
    "M a float": _mm(M=8.0),
    "M a bool": _mm(M=True),
    "w not three ints": _mm(w=[1, 0]),
    "w with a float": _mm(w=[1, 0.5, 256]),
    "key unhashable": _mm(key=[[1]]),
    "key a string": _mm(key="k"),
    "seq a string": _mm(seq="1"),
    "seq negative": _mm(seq=-5),
    "mul_mat extra field": _mm(extra=1),
    "mul_mat missing field": lambda s: ({k: v for k, v in s.mul_mat().items() if k != "K"}, []),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_request_gets_an_error_reply(server, case):
    before = server.nfds()
    msg, fds = HOSTILE[case](server)
    try:
        server.send(msg, fds)
    finally:
        for fd in fds:
            os.close(fd)
    reply = server.recv()
    assert reply["op"] == "error", reply
    assert "bad request" in reply["message"]
    seq = msg.get("seq") if isinstance(msg, dict) and msg.get("op") == "mul_mat" else None
    want = seq if type(seq) is int and seq > 0 else 0
    assert reply["seq"] == want, reply
    assert server.proc.poll() is None, server.stderr()
    assert server.nfds() == before  # every fd it was sent is closed again
    server.check_valid()


def test_unmap_and_unload_of_unknown_things_are_no_ops(server):
    server.send({"op": "unmap", "chunk": 12345})
    server.send({"op": "unload", "key": [9, 9, "bf16"]})
    server.check_valid()  # (no reply came before this one)


def test_server_ignores_sigint(tmp_path):
    s = Server(tmp_path)
    try:
        os.kill(s.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert s.proc.poll() is None, s.stderr()
        s.check_valid()
    finally:
        rc = s.close()
    assert rc == 0
    assert "KeyboardInterrupt" not in s.stderr()


# -- through the backend (a hub device) ----------------------------------------------------------


def _step(npu, w, x, y, wait=None):
    p = npu.next_point()
    npu.mul_mat(MatMulJob(w.view(), "bf16", x.view(), y.view(), 8, 8, 32, x_type="bf16"), wait, p)
    return p


def test_backend_process_in_own_session_and_survives_sigint(device):
    npu = create_backend("npu-emu", device, timeout=WAIT_S, gflops=1e3)
    arena = SharedArena(device, [npu], name="sigint")
    try:
        assert os.getsid(npu.pid) == npu.pid
        assert os.getsid(npu.pid) != os.getsid(0)
        os.kill(npu.pid, signal.SIGINT)  # what Ctrl-C in the parent's terminal would not even send now
        time.sleep(0.5)
        assert npu.proc.poll() is None
        wv, xv = np.arange(8 * 32) % 5 - 2, np.arange(8 * 32) % 3 - 1
        w, x, y = arena.alloc(8 * 32 * 2), arena.alloc(8 * 32 * 2), arena.alloc(8 * 8 * 4)
        w.numpy(np.uint16)[:] = bf16_bits(wv)
        x.numpy(np.uint16)[:] = bf16_bits(xv)
        npu.wait(_step(npu, w, x, y))
        np.testing.assert_array_equal(y.numpy(np.float32).reshape(8, 8),
                                      xv.reshape(8, 32) @ wv.reshape(8, 32).T)
    finally:
        arena.close()
        npu.close()
    assert npu.proc.returncode == 0


def test_close_drains_queued_unmap_and_unload(device, caplog, capfd):
    npu = create_backend("npu-emu", device, timeout=WAIT_S, gflops=1e3)
    arena = SharedArena(device, [npu], chunk_size=64 << 10, name="drain")
    gate = Timeline(device, name="drain-gate")
    try:
        w = arena.alloc(8 * 32 * 2)
        bufs = [arena.alloc(40 << 10) for _ in range(6)]  # a dedicated chunk each
        npu.wait(_step(npu, w, bufs[0], bufs[1]))  # mapped, kernel loaded
        npu.wait(_step(npu, w, bufs[2], bufs[3]))
        _step(npu, w, bufs[4], bufs[5], wait=(gate, 1))  # the bridge now waits for the gate...
        npu.unload(w.view())  # ...and the unload and unmaps queue up behind that job
        for b in bufs[:4]:
            b.close()
        with caplog.at_level(logging.WARNING, logger="vkxsplit"):
            npu.close()
        assert npu.proc.returncode == 0
        bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not bad, bad
        err = capfd.readouterr().err
        assert "BrokenPipe" not in err and "Traceback" not in err, err
    finally:
        gate.signal(1)
        gate.close()
        arena.close()
