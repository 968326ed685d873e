#!/usr/bin/env python3
"""Which step of a vulkan-peer round leaves file descriptors open (a diagnostic for the
H200 finding of tests/test_vulkan_peer.py::test_close_leaves_no_fds_or_hub_memory: two fds
to /dev/nvidia0 per round). Each step runs three times; the fds a step leaves behind are
printed per repetition (a driver that caches its own fds shows them on the first repetition
only; a leak shows them every time).

    python3 tools/diag_peer_fds.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vkxsplit.attach import SharedArena  # noqa: E402
from vkxsplit.backend import MatMulJob, create_backend  # noqa: E402
from vkxsplit.native import open_fd_targets as fds  # noqa: E402
from vkxsplit.vk.device import Device  # noqa: E402
from vkxsplit.vk.event import Timeline  # noqa: E402


def main() -> int:
    hub = Device.open()
    print(f"device: {hub.name}; semaphore fd export: {'VK_KHR_external_semaphore_fd' in hub.extensions}")

    def peer_device() -> None:
        Device(hub.instance, hub.physical).close()

    def hub_timeline_fd() -> None:
        tl = Timeline(hub, exportable=True, name="diag")
        os.close(tl.export_fd())
        tl.close()

    def timeline_into_peer() -> None:
        tl = Timeline(hub, exportable=True, name="diag")
        p = Device(hub.instance, hub.physical)
        imp = Timeline(p, import_fd=tl.export_fd(), name="diag@peer")
        imp.close()
        p.close()
        tl.close()

    def backend_only() -> None:
        create_backend("vulkan-peer", hub, device=hub.physical.index, timeout=20.0).close()

    def arena_only() -> None:
        b = create_backend("vulkan-peer", hub, device=hub.physical.index, timeout=20.0)
        a = SharedArena(hub, [b])
        a.alloc(1 << 20).close()
        b.close()
        a.close()

    def one_job(events: str) -> Callable[[], None]:
        def run() -> None:
            b = create_backend("vulkan-peer", hub, device=hub.physical.index, timeout=20.0, events=events)
            a = SharedArena(hub, [b])
            M = N = K = 64
            w, x, y = a.alloc(N * K * 4), a.alloc(M * K * 4), a.alloc(M * N * 4)
            p = b.next_point()
            b.mul_mat(MatMulJob(w.view(), "f32", x.view(), y.view(), M, N, K), None, p)
            b.wait(p, 20.0)
            b.close()
            a.close()
        return run

    steps: list[tuple[str, Callable[[], None]]] = [
        ("peer VkDevice create + destroy", peer_device),
        ("hub timeline: export an fd, close it", hub_timeline_fd),
        ("hub timeline imported by a peer VkDevice", timeline_into_peer),
        ("vulkan-peer backend created + closed", backend_only),
        ("+ a shared arena block (exported memory imported by the peer)", arena_only),
        ("+ one mul_mat, host-bridge events", one_job("host")),
        ("+ one mul_mat, GPU-side timeline events", one_job("timeline_opaque_fd")),
    ]
    print("| step | rep 1 | rep 2 | rep 3 |\n|---|---|---|---|")
    for name, fn in steps:
        cells = []
        for _ in range(3):
            before = fds()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
                cells.append(f"error: {exc}"[:80])
                continue
            new = sorted(t for f, t in fds().items() if before.get(f) != t)
            cells.append(", ".join(new) or "-")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    hub.close()
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
