"""Review findings on close with pinned numpy views: a second device on the hub's instance (what
the vulkan peer backend makes) whose destruction waits for a live view must keep the shared
instance alive too, so that closing the hub (which owns the instance) does not destroy the
instance under a device that still exists. Run in a child process: the bug is a segfault."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import numpy as np
from vkxsplit.vk.device import Device

hub = Device.open()
peer = Device(hub.instance, hub.physical)  # (the vulkan peer backend's device on the hub's instance)
buf = peer.memory.alloc(1 << 20, "host", name="peer-view")
view = buf.numpy(np.float32)
view[:] = 3.0
buf.close()
peer.close()  # deferred: the view pins the peer's memory and device
hub.close()   # owns the instance: it must wait for the peer device too
print("INSTANCE_ALIVE", hub.instance.handle is not None, flush=True)
s = float(view.sum())
del view  # the peer device goes now, then the instance
print("INSTANCE_GONE", hub.instance.handle is None, flush=True)
print("SUM", s, "MSGS", len(hub.instance._messages), flush=True)
"""


def test_a_pinned_peer_device_keeps_the_shared_instance_alive():
    env = dict(os.environ, VKXSPLIT_VALIDATION="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "INSTANCE_ALIVE True" in r.stdout and "INSTANCE_GONE True" in r.stdout, r.stdout
    assert f"SUM {3.0 * (1 << 18)} MSGS 0" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "Validation Error" not in r.stderr, r.stderr[-3000:]


class _HookLock:
    """The allocator's lock, running ``hook`` once just before the next acquire by the thread
    that armed it: how the last view dying on another thread (its finalizer) interleaves."""

    def __init__(self, lock):
        self.lock = lock
        self.hook = None

    def __enter__(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_the_last_view_dying_during_close_returns_the_range_once(device):
    import numpy as np

    mem = device.memory
    keep = mem.alloc(4096, "host", name="neighbour")  # keeps the block (an empty one is freed whole)
    live = mem.live_buffers
    a = mem.alloc(4096, "host", name="racy")
    assert a.block is keep.block
    box = {"view": a.numpy(np.uint32)}
    real = mem._lock
    mem._lock = _HookLock(real)
    try:
        mem._lock.hook = lambda: box.pop("view")  # the view goes between close's two steps
        a.close()
    finally:
        mem._lock = real
    assert "view" not in box
    assert mem.live_buffers == live, (mem.live_buffers, live)  # returned once, not twice
    b = mem.alloc(4096, "host", name="after")
    c = mem.alloc(4096, "host", name="after2")
    try:  # a range returned twice would be handed out twice
        assert (b.block, b.offset) != (c.block, c.offset)
    finally:
        b.close()
        c.close()
        keep.close()


def test_a_view_taken_while_another_thread_closes_the_buffer_is_refused(device):
    import numpy as np
    import pytest

    from vkxsplit.errors import ClosedError

    mem = device.memory
    keep = mem.alloc(4096, "host", name="neighbour")
    a = mem.alloc(4096, "host", name="closing")
    real = mem._lock
    mem._lock = _HookLock(real)
    try:
        mem._lock.hook = a.close  # the close completes between numpy()'s guard and its pin
        with pytest.raises(ClosedError):
            a.numpy(np.uint32)  # a view of a returned range would alias the next allocation
    finally:
        mem._lock = real
        keep.close()
