"""The relay: the host thread between Vulkan hubs that cannot wait on each other's timelines.

Two GPUs have different deviceUUIDs, so neither can import the other's timeline semaphore, and a
GPU polling a flag in host pages does not see the other GPU's write (``tools/bench_link.py``:
the H200 serves the poll from its cache after the first read). A segment of hub ``j`` that
depends on a segment of hub ``i`` (the schedule's ``hub_waits``) therefore goes through this one
thread, which handles the rounds the executor queues in order. Each round waits until the
points it names (``(label, timeline, value)`` of the source hubs) are reached, then either

- **signals** a timeline of the destination hub (:meth:`Relay.timeline`), which the destination
  segment, queued up front, waits on (the layer split: its segments read the hidden state the
  previous hub wrote into host pages), or
- **submits** the destination segment itself (the row split): its ``vkQueueSubmit`` is what
  makes the other GPU's partial (made available to the host by the barrier that closes the
  source segment) visible to this GPU. Queued up front instead, waiting on timelines the relay
  signalled, the partials were read stale on two H200s when a step's segments went in one
  submit call (``tools/diag_tensor_split.py``; docs/MULTI_GPU.md has the measurements). Once a
  step hands one segment to the relay, every later segment of that step goes through it too
  (a hub's queue runs in submission order).

The relay spins on the source counter before it blocks (a blocking ``vkWaitSemaphores``
returned ~1.3 ms late per crossing on the H200, ~0.2 ms spinning; 0 on CPU devices, where a
spin takes a core). A wait that makes no progress for ``timeout`` seconds is recorded as
:class:`~vkxsplit.errors.Stalled` naming the hub (:meth:`Relay.check` raises it); after an
error, signal rounds signal at once (no queue stays blocked on a relay timeline) and submit
rounds are dropped (no segment runs after its step raised). :meth:`Relay.reset` starts a fresh
thread after a failed step, so that an error the old one records later is not the next step's.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import Stalled, WaitTimeout
from .vk.event import StallClock, Timeline, default_timeout

if TYPE_CHECKING:
    from .vk.device import Device

#: a relay wait point: (label naming the hub, timeline, value)
LabelledPoint = tuple[str, Timeline, int]


class _Worker:
    """One relay thread and its queue (replaced whole by :meth:`Relay.reset`)."""

    def __init__(self, relay: Relay, name: str) -> None:
        self.relay = relay
        self.queue: collections.deque[tuple[Callable[[], list[LabelledPoint]], Any, Any]] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        rl = self.relay
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed and not self.queue:
                    return
                points, submit, signal = self.queue.popleft()
            if self.closed or self.error is not None:
                self._skip(submit, signal)
                continue
            try:
                if self._wait_all(points(), rl.timeout if rl.timeout is not None else default_timeout()):
                    with rl.submitting:
                        if submit is not None:
                            submit()
                        else:
                            signal[0].signal(signal[1])
                    rl.rounds += 1
                    rl.progress = time.monotonic()
                else:
                    self._skip(submit, signal)
            except BaseException as exc:  # noqa: BLE001 (recorded, raised by check())
                self.error = exc
                self._skip(submit, signal)

    @staticmethod
    def _skip(submit: Any, signal: Any) -> None:
        """A round after an error or close: a signal still goes out (the destination queue must
        not stay blocked; its step has raised), a submit never happens."""
        if signal is not None:
            try:
                signal[0].signal(signal[1])
            except Exception:  # noqa: BLE001 (a closed timeline: nothing waits on it any more)
                pass

    def _wait_all(self, points: list[LabelledPoint], timeout: float) -> bool:
        """Every point reached (False: closed meanwhile): spinning, then blocking waits in slices
        so that close is heard. ``timeout`` is a stall limit (:class:`StallClock`): a GPU whose
        counter still advances, or whose first run compiles its kernels, is waited for."""
        rl = self.relay
        for label, tl, v in points:
            if tl.spin(v, max(0.0, min(rl.spin_s, timeout)), lambda: self.closed):
                continue
            clock = StallClock(tl, v, timeout, what=f"{label} to reach {v}")
            left = timeout
            while True:
                try:
                    tl.wait(v, max(0.0, min(rl.slice_s, left)))
                    break
                except WaitTimeout:
                    if self.closed:
                        return False
                    try:
                        left = clock.poll()  # raises Stalled after the limit without progress
                    except Stalled as exc:
                        raise Stalled(f"relay: {label} ({tl.name}) did not reach {v}: "
                                      f"{str(exc).splitlines()[0]}; a hub's segment that another hub "
                                      "waits for is stuck or slow", exc.hint) from None
        return not self.closed

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()


class Relay:
    """The one relay of a model over several hubs (see the module docstring). ``timeout``: the
    stall limit of its waits (None: ``VKXSPLIT_TIMEOUT_S``); ``spin_s``: seconds to spin on a
    counter before blocking (0 on CPU devices)."""

    spin_s = 0.5
    slice_s = 0.05  # longest single blocking wait, so that close is heard

    def __init__(self, name: str = "relay", timeout: float | None = None, spin_s: float | None = None) -> None:
        self.name, self.timeout = name, timeout
        if spin_s is not None:
            self.spin_s = spin_s
        self.submitting = threading.Lock()  # held while a round submits or signals
        self.rounds = 0
        self.progress = time.monotonic()  # when a round last went through (or was queued)
        self._timelines: dict[int, Timeline] = {}
        self._worker = _Worker(self, name)

    @property
    def error(self) -> BaseException | None:
        return self._worker.error

    def timeline(self, device: Device, label: str) -> Timeline:
        """The timeline on ``device`` this relay signals (made once per device)."""
        tl = self._timelines.get(id(device))
        if tl is None:
            tl = self._timelines[id(device)] = Timeline(device, name=f"relay:{label}")
        return tl

    def enqueue(self, points: Callable[[], list[LabelledPoint]], *, submit: Callable[[], None] | None = None,
                signal: tuple[Timeline, int] | None = None) -> None:
        """Queue one round: once ``points()`` (evaluated when the round comes up: the values of
        segments the relay itself submits are known only then) are reached, call ``submit()`` or
        signal ``signal``."""
        if (submit is None) == (signal is None):
            raise ValueError("a relay round either submits or signals")
        w = self._worker
        with w.cond:
            self.progress = time.monotonic()
            w.queue.append((points, submit, signal))
            w.cond.notify()

    def check(self) -> None:
        """Raise what the relay recorded (a source hub that did not get there)."""
        err = self._worker.error
        if err is not None:
            raise err

    def reset(self) -> None:
        """After a failed step: a fresh thread and error state (pending signals go out, pending
        submits are dropped)."""
        self._worker.close()
        self._worker = _Worker(self, self.name)

    def close(self) -> None:
        """Stop the thread (pending signals go out, pending submits are dropped); the timelines
        stay until :meth:`close_timelines` (queued work may still wait on them)."""
        self._worker.close()

    def close_timelines(self) -> None:
        for tl in self._timelines.values():
            tl.close()
        self._timelines.clear()


__all__ = ["LabelledPoint", "Relay"]
