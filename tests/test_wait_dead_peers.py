"""Review findings on waits: a wait without a stall limit (``timeout=inf``, what
``VKXSPLIT_TIMEOUT_S=inf`` means) must still fail at once for a watched peer that is gone;
"never" is about slowness, not about death."""

from __future__ import annotations

import threading
import time

import pytest

from vkxsplit.errors import BackendDied
from vkxsplit.vk.event import Timeline


class _Peer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.gone: str | None = None

    def liveness(self) -> str | None:
        return self.gone

    def progress(self) -> int:
        return 0


@pytest.mark.parametrize("timeout", [float("inf"), 30.0])
def test_a_dead_peer_fails_a_wait_even_without_a_stall_limit(device, timeout):
    tl = Timeline(device, name="dead-peer-inf")
    peer = _Peer("deadbeat")
    box: dict[str, BaseException | None] = {}

    def waiter() -> None:
        try:
            tl.wait(1, timeout=timeout, peers=[peer], what="the job")
            box["exc"] = None
        except BaseException as exc:  # noqa: BLE001  (inspected below)
            box["exc"] = exc

    t = threading.Thread(target=waiter, daemon=True)
    try:
        t.start()
        time.sleep(0.2)
        peer.gone = "backend deadbeat's process 1 exited"
        t.join(5.0)
        alive = t.is_alive()
        if alive:
            tl.signal(1)  # release the hung waiter before failing
            t.join(5.0)
        assert not alive, "the wait ignored a dead peer"
        assert isinstance(box["exc"], BackendDied) and "deadbeat" in str(box["exc"])
    finally:
        if t.is_alive():
            tl.signal(1)
            t.join(5.0)
        tl.close()
