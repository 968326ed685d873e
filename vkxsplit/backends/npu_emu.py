"""The npu-emu backend: an emulated NPU in another process (``npu_emu_server``).

What it emulates, and why each matters to the hub:

- computes only bf16 x bf16 -> f32 ``mul_mat``: weights arrive in bf16 (the hub converts f32/f16
  weights once with its conversion shaders) and x in bf16 (converted each step); y is f32
- a minimum useful batch (``min_batch``: :meth:`supports` says no below it) and a cap of
  ``max_kernels`` distinct resident kernels (loaded weights): a 7th raises :class:`KernelError`
  in :meth:`NpuEmuBackend.mul_mat`, before anything is queued
- a configurable throughput (``gflops``; the server sleeps to match it)
- it lives in another process: memory reaches it as fds (SCM_RIGHTS over a SOCK_SEQPACKET
  socketpair) that it mmaps; completion comes back over the socket to the host bridge, which
  signals the backend's timeline. If the process dies, the bridge records
  :class:`~vkxsplit.errors.BackendDied` and still signals every pending value.

A real NPU with its own Vulkan device would instead list ``"timeline_opaque_fd"`` in
``event_handles``: the hub exports the stream timeline (``Timeline(..., exportable=True)``,
``export_fd()``), the NPU's driver imports it (``VkImportSemaphoreFdInfoKHR``) and waits/signals
on its own queue with no host bridge. This platform (lavapipe) can export neither timelines nor
sync_files, and a timeline cannot be handed to a process that has no Vulkan device.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

from ..attach import AttachStats, Chunk, HostBridge, Point, SharedView, cpu_ticks, mark_bridge_thread
from ..backend import Availability, Backend, Capabilities, MatMulJob, with_caps
from ..errors import BackendDied, EnvironmentProblem, KernelError, VkxError

if TYPE_CHECKING:
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.backends.npu_emu")


def available() -> Availability:
    if not hasattr(socket, "AF_UNIX") or not hasattr(socket, "SOCK_SEQPACKET"):
        return Availability(False, "needs AF_UNIX SOCK_SEQPACKET sockets (Linux)")
    return Availability(True)


class NpuEmuBackend(Backend):
    name = "npu-emu"
    caps = Capabilities(ops={"mul_mat"}, weight_types={"bf16"}, compute_dtypes={"bf16"},
                        min_batch=8, max_kernels=6,
                        memory_handles=("dma_buf", "host_allocation"), event_handles=("host",))

    def __init__(self, hub: Device, *, gflops: float = 20.0, min_batch: int = 8, max_kernels: int = 6,
                 timeout: float | None = None, start_timeout: float = 30.0,
                 counters: AttachStats | None = None) -> None:
        super().__init__(hub, timeout=timeout, counters=counters,
                         caps=with_caps(NpuEmuBackend, min_batch=min_batch, max_kernels=max_kernels))
        self.gflops = gflops
        self._closing = False
        self._stop_sent = False  # nothing is sent after "stop"
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._mapped: dict[int, Chunk] = {}
        self._kernels: dict[tuple[Any, ...], str] = {}
        self._post: dict[int, Any] = {}
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vkxsplit.backends.npu_emu_server", "--fd", str(child.fileno()),
                 "--gflops", str(gflops), "--max-kernels", str(max_kernels)],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)  # Ctrl-C is the parent's to handle (the server ignores SIGINT)
        except OSError as exc:
            parent.close()
            raise EnvironmentProblem(f"cannot start the npu-emu process: {exc}") from exc
        finally:
            child.close()  # only the child holds its end now: its death is EOF here
        self.sock = parent
        try:
            parent.settimeout(start_timeout)
            hello = json.loads(parent.recv(1 << 16) or b"{}")
            parent.settimeout(None)
            if hello.get("op") != "hello":
                raise BackendDied(f"npu-emu process {self.proc.pid} did not start (exit {self.proc.poll()})")
        except (OSError, ValueError, BackendDied) as exc:
            self.proc.kill()
            self.proc.wait()
            parent.close()
            if isinstance(exc, BackendDied):
                raise
            raise BackendDied(f"npu-emu process did not answer at start: {exc}") from exc
        self.pid = int(hello["pid"])
        # liveness: the process (poll) and the socket (the reader sees EOF); progress: answers and
        # the process's CPU time, a heartbeat the server need not send (a slow job keeps it
        # rising; a wedged or stopped process's stays flat)
        self.bridge = HostBridge(hub, self.timeline, name=self.name, timeout=self.timeout,
                                 liveness=self._liveness, counters=self.stats,
                                 heartbeat=partial(cpu_ticks, self.proc.pid))
        self._reader = threading.Thread(target=self._read_loop, name="npu-emu-reader", daemon=True)
        self._reader.start()

    # -- hooks ----------------------------------------------------------------------------

    def mul_mat(self, job: MatMulJob, wait: Point, signal: Point) -> None:
        try:
            msg, new_chunks = self._admit(job, signal)
        except Exception as exc:
            raise self.refuse(signal, exc) from None
        self.bridge.enqueue(wait, signal[1], release=partial(self._release, job, msg, new_chunks))  # type: ignore[union-attr]

    def _admit(self, job: MatMulJob, signal: Point) -> tuple[dict[str, Any], list[Chunk]]:
        """Validate, register the kernel and the chunks the process must map; the message."""
        self.check_job(job, signal)
        if job.x_type != "bf16" or job.w_type != "bf16":
            raise KernelError(f"npu-emu computes bf16 x bf16 only (got {job.w_type} x {job.x_type})",
                              "convert on the hub first (record_convert ... 'bf16')")
        key = job.weight_key
        new_chunks = []
        with self._lock:
            for v in (job.weight, job.x, job.y):
                ch = v.chunk
                if ch.id not in self._mapped and ch not in new_chunks:
                    if ch.fd is None:
                        raise VkxError(f"npu-emu: buffer '{v.shared.name}' ({ch.kind}) has no fd to pass")
                    new_chunks.append(ch)
            if key not in self._kernels:
                cap = self.caps.max_kernels
                if cap is not None and len(self._kernels) >= cap:
                    loaded = ", ".join(self._kernels.values())
                    raise KernelError(
                        f"npu-emu: cannot load a kernel #{len(self._kernels) + 1} for weight "
                        f"'{job.weight.shared.name}' ({job.N}x{job.K} bf16): the NPU holds at most "
                        f"{cap} resident kernels (loaded: {loaded})",
                        "unload one (backend.unload(weight)) or plan fewer matrices on this backend")
                self._kernels[key] = f"{job.weight.shared.name} {job.N}x{job.K}"
                job.weight.shared.on_close.append(lambda sb, key=key: self._drop_kernel(key))
            for ch in new_chunks:
                self._mapped[ch.id] = ch
                ch.listeners.append(self._on_chunk_closed)
        msg = {"op": "mul_mat", "seq": signal[1], "M": job.M, "N": job.N, "K": job.K,
               "xs": job.x_stride, "ys": job.y_stride, "r0": job.r0, "r1": job.r1, "w_row0": job.w_row0,
               "key": list(key),
               "w": [job.weight.chunk.id, job.weight.chunk_offset, job.weight.size],
               "x": [job.x.chunk.id, job.x.chunk_offset, job.x.size],
               "y": [job.y.chunk.id, job.y.chunk_offset, job.y.size]}
        return msg, new_chunks

    def unload(self, weight: SharedView) -> None:
        with self._lock:
            keys = [k for k in self._kernels if k[0] == weight.chunk.id and k[1] == weight.chunk_offset]
        for k in keys:
            self._drop_kernel(k)

    def calibrate(self) -> dict[str, float]:
        return {"mul_mat_gflops": self.gflops}  # the emulated rate is the configured one

    @property
    def resident_kernels(self) -> int:
        return len(self._kernels)

    def close(self) -> None:
        if self._closed:
            return
        if hasattr(self, "_reader"):  # (not when construction failed half-way)
            self._closing = True
            # "stop" goes through the bridge queue: after every job, unmap and unload queued
            # before it (the server handles requests in order, then exits 0)
            self.bridge.control(self._send_stop)  # type: ignore[union-attr]
        super().close()  # the bridge (drains its queue), then release(), then the timeline retired

    def release(self) -> None:
        if not hasattr(self, "_reader"):
            return
        try:  # the bridge did not get to it (dead, or its thread still stuck after its close timeout)
            self._send_stop()
        except Exception:  # already gone
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(5)
        self.sock.close()

    # -- plumbing -------------------------------------------------------------------------

    def _send_stop(self) -> None:
        self._send({"op": "stop"})

    def _send(self, msg: dict[str, Any], fds: list[Any] = ()) -> None:  # type: ignore[assignment]
        data = json.dumps(msg).encode()
        with self._send_lock:
            if self._stop_sent:
                return  # the process is exiting: a late unmap/unload has nothing left to do
            self._stop_sent = msg.get("op") == "stop"
            try:
                if fds:
                    from .. import native

                    if native.native_available():
                        native.send_fds(self.sock, fds, data)
                    else:
                        socket.send_fds(self.sock, [data], [f.fileno() for f in fds])
                else:
                    self.sock.send(data)
            except (OSError, VkxError) as exc:
                raise BackendDied(f"npu-emu process {self.pid} is unreachable: {exc}",
                                  "the hub keeps running; recreate the backend") from exc

    def _drop_kernel(self, key: tuple[Any, ...]) -> None:
        with self._lock:
            if self._kernels.pop(key, None) is None:
                return
        self.bridge.control(partial(self._send, {"op": "unload", "key": list(key)}))  # type: ignore[union-attr]

    def _on_chunk_closed(self, ch: Chunk) -> None:
        # May run under the hub allocator's lock: only bookkeeping and an ordered queue item.
        with self._lock:
            if self._mapped.pop(ch.id, None) is None:
                return
            for k in [k for k in self._kernels if k[0] == ch.id]:
                del self._kernels[k]
        self.bridge.control(partial(self._send, {"op": "unmap", "chunk": ch.id}))  # type: ignore[union-attr]

    def _release(self, job: MatMulJob, msg: dict[str, Any], new_chunks: list[Chunk]) -> None:
        """Bridge thread, after the hub point: stage (only for ``staged`` memory), map, send."""
        x_bytes = ((job.M - 1) * job.x_stride + job.K) * 2
        job.x.shared.stage_in(job.x.offset, x_bytes)
        job.weight.shared.stage_in(job.weight.offset, job.weight.size)
        if job.y.shared.kind == "staged":
            self._post[msg["seq"]] = job
        for ch in new_chunks:
            self._send({"op": "map", "chunk": ch.id, "size": ch.size, "kind": ch.kind}, [ch.fd])
        self._send(msg)

    def _liveness(self) -> str | None:
        if self._closing:
            return None
        rc = self.proc.poll()
        return None if rc is None else f"process {self.pid} exited with code {rc}"

    def _read_loop(self) -> None:
        mark_bridge_thread()
        bridge = self.bridge
        assert bridge is not None
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                if not self._closing:
                    try:
                        rc = self.proc.wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        rc = None
                    bridge.fail(BackendDied(
                        f"backend {self.name}'s process {self.pid} exited with code {rc} (its connection "
                        "closed)" if rc is not None else
                        f"backend {self.name}'s connection to process {self.pid} closed",
                        "the hub keeps running; recreate the backend or plan without it"))
                return
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            try:
                seq = int(msg.get("seq", 0))
            except (AttributeError, TypeError, ValueError):
                continue
            if msg.get("op") == "beat":  # the server is working on a long job (progress, not an answer)
                bridge.beat()
                continue
            if msg.get("op") == "done":
                job = self._post.pop(seq, None)
                if job is not None:
                    for m in range(job.M):
                        job.y.shared.stage_out(job.y.offset + (m * job.y_stride + job.r0) * 4, job.rows * 4)
                bridge.complete(seq)
            elif msg.get("op") == "error":
                self._post.pop(seq, None)
                what = "" if seq else f" (request {msg.get('request')!r})"  # a rejected map/unmap/unload
                bridge.complete(seq, KernelError(f"npu-emu{what}: {msg.get('message')}"))
