"""The npu-emu device process: ``python -m vkxsplit.backends.npu_emu_server --fd N``.

Emulates an NPU that sits behind a driver in another process: it only computes
bf16 x bf16 -> f32 ``mul_mat``, holds at most ``--max-kernels`` resident kernels (a kernel is a
loaded weight: its location and shape), and runs at ``--gflops`` GFLOP/s (it sleeps to emulate
that rate). It reaches the hub's memory only through fds passed with SCM_RIGHTS, which it mmaps.

Protocol (one JSON object per SOCK_SEQPACKET message; the host side is ``npu_emu.py``):

- host -> npu: ``{"op": "map", "chunk", "size", "kind"}`` + 1 fd; ``{"op": "unmap", "chunk"}``;
  ``{"op": "unload", "key"}``; ``{"op": "mul_mat", "seq", "w", "x", "y", "M", "N", "K", "xs",
  "ys", "r0", "r1", "w_row0", "key"}`` with ``w``/``x``/``y`` = ``[chunk, offset, size]``;
  ``{"op": "stop"}``
- npu -> host: ``{"op": "hello", "pid", ...}`` once; ``{"op": "done", "seq"}`` or
  ``{"op": "error", "seq", "message"}`` per ``mul_mat``, in order.

It imports only numpy (and the fd helpers), so it starts fast and never touches Vulkan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import socket
import sys
import time
from typing import Any

import numpy as np


def _recv(sock: socket.socket) -> tuple[list[int], bytes]:
    try:
        from vkxsplit import native

        if native.native_available():
            fds, data = native.recv_fds(sock, max_fds=4, max_bytes=1 << 16)
            return [f.detach() for f in fds], data
    except ImportError:
        pass
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
    return list(fds), data


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


class Npu:
    def __init__(self, sock: socket.socket, gflops: float, max_kernels: int) -> None:
        self.sock = sock
        self.gflops = gflops
        self.max_kernels = max_kernels
        self.maps: dict[int, tuple[mmap.mmap, int, str]] = {}  # chunk -> (mapping, fd or -1, kind)
        self.kernels: dict[tuple[Any, ...], tuple[int, int]] = {}

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(json.dumps(msg).encode())

    def _array(self, ref: list[int], dtype: Any, count: int) -> np.ndarray:
        chunk, off, size = ref
        m = self.maps.get(chunk)
        if m is None:
            raise RuntimeError(f"chunk {chunk} is not mapped")
        dt = np.dtype(dtype)
        if count * dt.itemsize > size:
            raise RuntimeError(f"view of {count} x {dt} exceeds the {size}-byte range")
        return np.frombuffer(m[0], dtype=dt, count=count, offset=off)

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
        left = budget - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)

    def _compute(self, msg: dict[str, Any], M: int, N: int, K: int, xs: int, ys: int, r0: int, r1: int,
                 w_row0: int, held: int) -> None:
        W = self._array(msg["w"], np.uint16, held * K).reshape(held, K)[r0 - w_row0:r1 - w_row0]
        xa = self._array(msg["x"], np.uint16, (M - 1) * xs + K)
        X = np.lib.stride_tricks.as_strided(xa, (M, K), (xs * 2, 2), writeable=False)
        ya = self._array(msg["y"], np.float32, (M - 1) * ys + r1)[r0:]
        Y = np.lib.stride_tricks.as_strided(ya, (M, r1 - r0), (ys * 4, 4))
        # bf16 products are exact in f32; accumulate in f32 like the NPU's MAC array
        np.matmul(_bf16_to_f32(X), _bf16_to_f32(W).T, out=Y)

    def serve(self) -> int:
        self.send({"op": "hello", "pid": os.getpid(), "max_kernels": self.max_kernels, "gflops": self.gflops})
        while True:
            fds, data = _recv(self.sock)
            if not data:
                return 0  # the host closed the socket
            msg = json.loads(data)
            op = msg.get("op")
            if op == "map":
                fd = fds[0]
                mm = mmap.mmap(fd, msg["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                if msg.get("kind") != "dma_buf":  # keep dma-buf fds for DMA_BUF_IOCTL_SYNC
                    os.close(fd)
                    fd = -1
                self.maps[msg["chunk"]] = (mm, fd, msg.get("kind", ""))
                for extra in fds[1:]:
                    os.close(extra)
            elif op == "unmap":
                m = self.maps.pop(msg["chunk"], None)
                if m is not None:
                    m[0].close()
                    if m[1] >= 0:
                        os.close(m[1])
                for k in [k for k in self.kernels if k[0] == msg["chunk"]]:
                    del self.kernels[k]
            elif op == "unload":
                self.kernels.pop(tuple(msg["key"]), None)
            elif op == "mul_mat":
                try:
                    self.mul_mat(msg)
                except Exception as exc:
                    self.send({"op": "error", "seq": msg["seq"], "message": str(exc)})
                else:
                    self.send({"op": "done", "seq": msg["seq"]})
            elif op == "stop":
                return 0
            else:
                for fd in fds:
                    os.close(fd)
                self.send({"op": "error", "seq": msg.get("seq", 0), "message": f"unknown op {op!r}"})


def main(argv: list[str] | None = None) -> int:
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
