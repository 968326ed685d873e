"""The npu-emu device process: ``python -m vkxsplit.backends.npu_emu_server --fd N``.

Emulates an NPU that sits behind a driver in another process: it only computes
bf16 x bf16 -> f32 ``mul_mat``, holds at most ``--max-kernels`` resident kernels (a kernel is a
loaded weight: its location and shape), and runs at ``--gflops`` GFLOP/s (it sleeps to emulate
that rate). It reaches the hub's memory only through fds passed with SCM_RIGHTS, which it mmaps.

Protocol (one JSON object per SOCK_SEQPACKET message, at most 64 KiB and 4 fds; the host side
is ``npu_emu.py``):

- host -> npu: ``{"op": "map", "chunk", "size", "kind"}`` + 1 fd; ``{"op": "unmap", "chunk"}``;
  ``{"op": "unload", "key"}``; ``{"op": "mul_mat", "seq", "w", "x", "y", "M", "N", "K", "xs",
  "ys", "r0", "r1", "w_row0", "key"}`` with ``w``/``x``/``y`` = ``[chunk, offset, size]``;
  ``{"op": "stop"}`` (the host sends it last, after every queued request)
- npu -> host: ``{"op": "hello", "pid", ...}`` once; ``{"op": "done", "seq"}`` or
  ``{"op": "error", "seq", "message"}`` per ``mul_mat``, in order; ``{"op": "error", "seq": 0,
  "request", "message"}`` for any other request it rejects (``unmap`` of a chunk that is not
  mapped and ``unload`` of a kernel that is not loaded are no-ops, not errors: the host may
  free memory whose ``map`` it never sent).

Nothing in a request is trusted (docs/ATTACH.md, "What an NPU plugin must validate"): every
field is type- and range-checked against the schema below, every fd is ``fstat``-ed (a memfd
must be a regular file sealed against shrinking and at least the claimed size; a dma-buf must
be a dma-buf of at least that size), every view must lie inside its mapping, and a bad request
gets an error reply; the server keeps serving. It runs in its own session and ignores SIGINT:
the host handles Ctrl-C and stops it.

It imports only numpy (and the fd helpers), so it starts fast and never touches Vulkan.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import mmap
import os
import select
import signal
import socket
import stat
import sys
import time
from typing import Any

import numpy as np

MAX_MESSAGE = 1 << 16
MAX_FDS = 4
MAX_DIM = 1 << 31          # M, N, K, strides, rows
MAX_BYTES = 1 << 48        # a chunk size or offset
MAX_ID = (1 << 63) - 1     # chunk ids and seq values
KINDS = ("host_allocation", "staged", "dma_buf")
#: field -> type of every request (``int``: a JSON integer, never a bool; ``ref``: [chunk, offset, size]).
SCHEMA: dict[str, dict[str, str]] = {
    "map": {"chunk": "int", "size": "int", "kind": "str"},
    "unmap": {"chunk": "int"},
    "unload": {"key": "key"},
    "mul_mat": {"seq": "int", "w": "ref", "x": "ref", "y": "ref", "M": "int", "N": "int", "K": "int",
                "xs": "int", "ys": "int", "r0": "int", "r1": "int", "w_row0": "int", "key": "key"},
    "stop": {},
}
FDS = {"map": 1}  # fds each op carries (others: none)


#: longest error text in a reply (characters)
MAX_ERROR_TEXT = 1024

#: seconds between the heartbeats of a long job (well under any stall limit a client uses)
BEAT_S = 0.25


class BadRequest(Exception):
    """A request that does not pass validation: answered with an error reply."""


class _Stop(Exception):
    pass


def _recv(sock: socket.socket) -> tuple[list[int], bytes]:
    """One message as (raw fds, payload). Raises ``BadRequest`` for a truncated message or one
    with too many fds (whatever arrived was closed)."""
    try:
        from vkxsplit import native

        if native.native_available():
            from vkxsplit.errors import VkxError

            try:
                fds, data = native.recv_fds(sock, max_fds=MAX_FDS, max_bytes=MAX_MESSAGE)
            except VkxError as exc:  # EMSGSIZE: too many fds or over max_bytes (all closed)
                raise BadRequest(f"message rejected: {exc}") from None
            return [f.detach() for f in fds], data
    except ImportError:
        pass
    data, fds, flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise BadRequest(f"message rejected: over {MAX_MESSAGE} bytes or {MAX_FDS} fds")
    return list(fds), data


def _hung_up(sock: socket.socket) -> bool:
    """After a 0-byte read: the peer closed (EOF), rather than sent an empty message."""
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLRDHUP)
    return any(ev & (select.POLLHUP | select.POLLRDHUP) for _fd, ev in p.poll(0))


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def _int(msg: dict[str, Any], name: str, lo: int, hi: int) -> int:
    v = msg[name]
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' = {v} is outside [{lo}, {hi}]")
    return v


def _check_schema(msg: Any, nfds: int) -> str:
    """The op of a well-formed request: a JSON object with exactly the op's fields, each of
    its type, and the op's number of fds."""
    if not isinstance(msg, dict):
        raise BadRequest(f"a request is a JSON object, not {type(msg).__name__}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise BadRequest(f"unknown op {op!r} (ops: {', '.join(SCHEMA)})")
    fields = SCHEMA[op]
    missing = [f for f in fields if f not in msg]
    extra = [f for f in msg if f != "op" and f not in fields]
    if missing or extra:
        raise BadRequest(f"{op}: " + "; ".join(
            ([f"missing field(s) {', '.join(missing)}"] if missing else [])
            + ([f"unknown field(s) {', '.join(map(repr, extra))}"] if extra else [])))
    for name, kind in fields.items():
        v = msg[name]
        if kind == "int":
            ok = type(v) is int
        elif kind == "str":
            ok = type(v) is str
        elif kind == "ref":
            ok = type(v) is list and len(v) == 3 and all(type(e) is int for e in v)
        else:  # key: a short list of ints / short strings
            ok = (type(v) is list and 1 <= len(v) <= 16
                  and all(type(e) is int or (type(e) is str and len(e) <= 256) for e in v))
        if not ok:
            want = {"int": "an integer", "str": "a string", "ref": "[chunk, offset, size] integers",
                    "key": "a list of 1-16 integers/strings"}[kind]
            raise BadRequest(f"{op}: '{name}' must be {want}, got {json.dumps(v)[:80]}")
    want_fds = FDS.get(op, 0)
    if nfds != want_fds:
        raise BadRequest(f"{op} carries {want_fds} fd(s), got {nfds}")
    return op


def _check_fd(fd: int, kind: str, size: int) -> None:
    """The fd a ``map`` passes: what it is and that it covers ``size`` bytes for good."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise BadRequest(f"map: fstat of the fd failed: {exc}") from None
    mode, have = st.st_mode, st.st_size
    if kind == "dma_buf":  # (never run here: no dma-buf heap on the test machine)
        info: dict[str, str] = {}
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = dict(line.rstrip("\n").split(":", 1) for line in f if ":" in line)
        except OSError:
            pass
        if "exp_name" not in info or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise BadRequest(f"map: kind dma_buf but the fd is not a dma-buf (mode {stat.filemode(mode)})")
        with contextlib.suppress(KeyError, ValueError):
            have = int(info["size"].strip())  # the exporter's size (st_size too, on recent kernels)
    else:
        if not stat.S_ISREG(mode):
            raise BadRequest(f"map: kind {kind} needs a memfd (a regular file), got mode "
                             f"{stat.filemode(mode)}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise BadRequest("map: the memfd is not sealed against shrinking (F_SEAL_SHRINK): a later "
                             "truncate would turn access to the mapping into SIGBUS")
    if have < size:
        raise BadRequest(f"map: the fd holds {have} bytes, less than the claimed size {size}")


class Npu:
    def __init__(self, sock: socket.socket, gflops: float, max_kernels: int) -> None:
        self.sock = sock
        self.gflops = gflops
        self.max_kernels = max_kernels
        self.maps: dict[int, tuple[mmap.mmap, int, str]] = {}  # chunk -> (mapping, fd or -1, kind)
        self.kernels: dict[tuple[Any, ...], tuple[int, int]] = {}
        self.reply_seq = 0  # what an error reply for the request being handled names
        self.reply_op: str | None = None

    def send(self, msg: dict[str, Any]) -> None:
        # an error text may echo a hostile request: cut it so every reply fits the host's
        # 64 KiB receive (a cut reply would not parse and its job would never complete)
        if isinstance(msg.get("message"), str) and len(msg["message"]) > MAX_ERROR_TEXT:
            msg = {**msg, "message": msg["message"][:MAX_ERROR_TEXT] + " ..."}
        if "request" in msg and isinstance(msg["request"], str):
            msg["request"] = msg["request"][:64]
        self.sock.send(json.dumps(msg).encode())

    def _ref(self, msg: dict[str, Any], name: str, itemsize: int, nbytes: int) -> tuple[int, int, int]:
        """Validate ``msg[name]`` = [chunk, offset, size]: mapped, inside the mapping, aligned,
        and at least ``nbytes`` long (the extent the shapes and strides reach)."""
        chunk, off, size = msg[name]
        m = self.maps.get(chunk)
        if m is None:
            raise BadRequest(f"mul_mat: '{name}' names chunk {chunk}, which is not mapped")
        if off < 0 or size < 0 or off + size > len(m[0]):
            raise BadRequest(f"mul_mat: '{name}' = [{chunk}, {off}, {size}] is not inside the "
                             f"{len(m[0])}-byte mapping")
        if off % itemsize:
            raise BadRequest(f"mul_mat: '{name}' offset {off} is not {itemsize}-byte aligned")
        if nbytes > size:
            raise BadRequest(f"mul_mat: the shapes and strides reach {nbytes} bytes of '{name}', "
                             f"which holds {size}")
        return chunk, off, size

    def check_mul_mat(self, msg: dict[str, Any]) -> None:
        """Ranges and extents of a schema-checked ``mul_mat`` (Python ints: no overflow)."""
        M, N, K = (_int(msg, n, 1, MAX_DIM) for n in ("M", "N", "K"))
        xs, ys = _int(msg, "xs", K, MAX_DIM), _int(msg, "ys", N, MAX_DIM)
        r1 = _int(msg, "r1", 1, N)
        r0 = _int(msg, "r0", 0, r1 - 1)
        w_row0 = _int(msg, "w_row0", 0, r0)
        self._ref(msg, "w", 2, (r1 - w_row0) * K * 2)
        self._ref(msg, "x", 2, ((M - 1) * xs + K) * 2)
        self._ref(msg, "y", 4, ((M - 1) * ys + r1) * 4)

    def mul_mat(self, msg: dict[str, Any]) -> None:
        M, N, K = msg["M"], msg["N"], msg["K"]
        xs, ys, r0, r1, w_row0 = msg["xs"], msg["ys"], msg["r0"], msg["r1"], msg["w_row0"]
        key = tuple(msg["key"])
        if key not in self.kernels:
            if len(self.kernels) >= self.max_kernels:
                raise RuntimeError(f"cannot load kernel #{len(self.kernels) + 1} ({N}x{K} bf16): "
                                   f"the NPU holds at most {self.max_kernels} resident kernels")
            self.kernels[key] = (N, K)
        held = msg["w"][2] // (2 * K)
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for ref in {msg["w"][0], msg["x"][0], msg["y"][0]}:
                m = self.maps.get(ref)
                if m is not None and m[2] == "dma_buf" and m[1] >= 0:  # DMA_BUF_IOCTL_SYNC bracket
                    from vkxsplit.native import DmaBufCpuAccess

                    stack.enter_context(DmaBufCpuAccess(m[1], read=True, write=ref == msg["y"][0]))
            self._compute(msg, M, N, K, xs, ys, r0, r1, w_row0, held)
        budget = 2.0 * M * (r1 - r0) * K / (self.gflops * 1e9)
        # the emulated NPU's remaining time, slept in slices with a heartbeat between them: a
        # sleeping process uses no CPU time, so a job longer than the client's stall limit would
        # otherwise look wedged (a real plugin sends beats while its device works the same way)
        while (left := budget - (time.perf_counter() - t0)) > 0:
            time.sleep(min(left, BEAT_S))
            if budget - (time.perf_counter() - t0) > 0:
                self.send({"op": "beat", "seq": msg.get("seq", 0)})

    def _array(self, ref: list[int], dtype: Any, count: int) -> np.ndarray:
        chunk, off, _size = ref
        return np.frombuffer(self.maps[chunk][0], dtype=np.dtype(dtype), count=count, offset=off)

    def _compute(self, msg: dict[str, Any], M: int, N: int, K: int, xs: int, ys: int, r0: int, r1: int,
                 w_row0: int, held: int) -> None:
        W = self._array(msg["w"], np.uint16, held * K).reshape(held, K)[r0 - w_row0:r1 - w_row0]
        xa = self._array(msg["x"], np.uint16, (M - 1) * xs + K)
        X = np.lib.stride_tricks.as_strided(xa, (M, K), (xs * 2, 2), writeable=False)
        ya = self._array(msg["y"], np.float32, (M - 1) * ys + r1)[r0:]
        Y = np.lib.stride_tricks.as_strided(ya, (M, r1 - r0), (ys * 4, 4))
        # bf16 products are exact in f32; accumulate in f32 like the NPU's MAC array
        np.matmul(_bf16_to_f32(X), _bf16_to_f32(W).T, out=Y)

    def map(self, msg: dict[str, Any], fd: int) -> bool:
        """Map the chunk; True when ``fd`` was kept (dma-bufs, for DMA_BUF_IOCTL_SYNC)."""
        chunk = _int(msg, "chunk", 0, MAX_ID)
        size = _int(msg, "size", 1, MAX_BYTES)
        kind = msg["kind"]
        if kind not in KINDS:
            raise BadRequest(f"map: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        if chunk in self.maps:
            raise BadRequest(f"map: chunk {chunk} is already mapped (unmap it first)")
        _check_fd(fd, kind, size)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError) as exc:
            raise BadRequest(f"map: mmap of {size} bytes failed: {exc}") from None
        keep = kind == "dma_buf"
        self.maps[chunk] = (mm, fd if keep else -1, kind)
        return keep

    def handle(self, fds: list[int], data: bytes) -> None:
        """One request; owns ``fds`` (each is closed unless a mapping keeps it)."""
        kept = False
        try:
            try:
                msg = json.loads(data)
            except (ValueError, RecursionError) as exc:
                raise BadRequest(f"not JSON: {exc}") from None
            if isinstance(msg, dict) and isinstance(msg.get("op"), str):
                self.reply_op = msg["op"][:64]
                if msg["op"] == "mul_mat" and type(msg.get("seq")) is int and 1 <= msg["seq"] <= MAX_ID:
                    self.reply_seq = msg["seq"]  # (the error reply names the job when it can)
            op = _check_schema(msg, len(fds))
            if op == "map":
                kept = self.map(msg, fds[0])
            elif op == "unmap":
                m = self.maps.pop(_int(msg, "chunk", 0, MAX_ID), None)
                if m is not None:
                    m[0].close()
                    if m[1] >= 0:
                        os.close(m[1])
                for k in [k for k in self.kernels if k[0] == msg["chunk"]]:
                    del self.kernels[k]
            elif op == "unload":
                self.kernels.pop(tuple(msg["key"]), None)
            elif op == "mul_mat":
                seq = _int(msg, "seq", 1, MAX_ID)
                self.check_mul_mat(msg)
                try:
                    self.mul_mat(msg)
                except Exception as exc:
                    self.send({"op": "error", "seq": seq, "message": str(exc)})
                else:
                    self.send({"op": "done", "seq": seq})
            elif op == "stop":
                raise _Stop
        finally:
            for i, fd in enumerate(fds):
                if not (kept and i == 0):
                    os.close(fd)

    def serve(self) -> int:
        self.send({"op": "hello", "pid": os.getpid(), "max_kernels": self.max_kernels, "gflops": self.gflops})
        while True:
            self.reply_seq, self.reply_op = 0, None
            try:
                fds, data = _recv(self.sock)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    if _hung_up(self.sock):
                        return 0  # the host closed the socket
                    raise BadRequest("empty message")
                self.handle(fds, data)
            except _Stop:
                return 0
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # BadRequest, or a bug: either way an answer, not a crash
                text = str(exc) if isinstance(exc, BadRequest) else f"internal error: {type(exc).__name__}: {exc}"
                self.send({"op": "error", "seq": self.reply_seq, "request": self.reply_op,
                           "message": f"bad request: {text}"})


def main(argv: list[str] | None = None) -> int:
    # The host handles Ctrl-C and stops us over the socket (we also run in our own session).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket to the host")
    ap.add_argument("--gflops", type=float, default=20.0)
    ap.add_argument("--max-kernels", type=int, default=6)
    args = ap.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    try:
        return Npu(sock, args.gflops, args.max_kernels).serve()
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
