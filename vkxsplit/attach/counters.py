"""The attach layer's counters and its counted host waits.

:class:`AttachStats` and the process-wide :data:`stats` (staged copies, host waits by caller
and by bridge threads, host signals, bridged jobs, backend deaths), the mark that tells a
bridge thread from a caller (:func:`mark_bridge_thread`), and :func:`host_wait`, a host wait on a
timeline point counted per thread kind, so that tests can assert that submitting a step made
none (``stats.host_waits_in_step == 0``). :data:`Point` (a timeline and a value) is the type
every part of the attach layer passes around.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..vk.event import Peer, Timeline

#: A point on a timeline: the timeline and a value of it (to wait for or to signal).
Point = tuple[Timeline, int]


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
