"""The host bridge: a thread that joins a backend which cannot share semaphores with the hub.

:class:`HostBridge` waits (with a stall limit) for each job's hub point, releases the job (or
runs it on its own thread), and signals the backend's timeline from the host, in order, when
the backend reports completion. A dead or stuck backend becomes a recorded
:class:`~vkxsplit.errors.BackendDied` / :class:`~vkxsplit.errors.BackendStalled` and every
pending value is still signalled, so the hub never stays blocked. :func:`cpu_ticks` is the
heartbeat of a peer that computes.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import BackendDied, BackendStalled, Stalled, VkxError, WaitTimeout
from ..vk.event import POLL_S, StallClock, Timeline, default_timeout
from .counters import AttachStats, Point, mark_bridge_thread, stats

if TYPE_CHECKING:
    from ..vk.device import Device

log = logging.getLogger("vkxsplit.attach")


@dataclass
class _Item:
    wait: Point | None
    value: int              # backend timeline value to signal; 0 for control items
    job: Any = None
    release: Callable[[], None] | None = None
    control: Callable[[], None] | None = None
    t_enqueue: float = field(default_factory=time.monotonic)
    t_release: float = 0.0


_STOP = object()


def cpu_ticks(pid: int, tid: int | None = None) -> int | None:
    """CPU time (clock ticks, user + system) a process (or one of its threads) has used: the
    heartbeat of a peer that computes (it rises while it works; a wedged or stopped peer's stays
    flat). None where /proc is not there."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        with open(path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


class HostBridge:
    """Joins a backend that cannot share semaphores with the hub (see the module docstring).

    ``enqueue(wait, value, job)`` returns at once. The bridge thread waits (in slices, up to
    ``timeout`` s) for the hub point ``wait``, then either runs ``run(job)`` itself (a thread
    backend: the value is signalled when it returns) or calls the item's ``release()`` (a
    process/device backend: it reports completion later with :meth:`complete`). Values are
    signalled in order, each once. ``liveness()`` (optional) returns an error text when the
    backend is gone (its process exited, its connection closed); ``heartbeat()`` (optional)
    returns a value that changes while the backend works (a child process's CPU time; a ``run``
    bridge uses its own thread's CPU time); both and the in-flight watchdog are polled every
    ``poll_s``. ``spin_s``: how long to poll the hub point's counter before blocking (0: block
    at once). ``timeout`` is a stall limit: seconds without progress, never a total.

    Errors: a hub point that makes no progress for ``timeout`` s records
    :class:`~vkxsplit.errors.Stalled` (the job is skipped, its value still signalled); a job that
    raises records that error; a backend that dies records :class:`BackendDied` at the next poll,
    and one that leaves a released job unanswered with no heartbeat for ``timeout`` s records
    :class:`~vkxsplit.errors.BackendStalled` (slow or wedged, not dead); either way every
    pending and later value is signalled at once. :meth:`check` raises what was recorded.
    :meth:`gone` and :meth:`progress` are what host waits watch (:class:`vkxsplit.vk.event.Peer`).
    """

    def __init__(self, device: Device, timeline: Timeline, *, name: str,
                 run: Callable[[Any], None] | None = None, timeout: float | None = None,
                 poll_s: float = 0.02, liveness: Callable[[], str | None] | None = None,
                 counters: AttachStats | None = None, spin_s: float = 0.0,
                 heartbeat: Callable[[], Any] | None = None) -> None:
        self.device = device
        self.spin_s = spin_s  # spin on the hub point's counter this long before blocking waits
        self.timeline = timeline
        self.name = name
        self.run = run
        self.timeout = default_timeout() if timeout is None else timeout
        self.poll_s = poll_s
        self.liveness = liveness
        self.heartbeat = heartbeat
        self._completions = 0  # jobs answered (progress)
        self._beats = 0  # heartbeat messages the backend sent (beat())
        self._beat: Any = None  # the last heartbeat seen, and when it last changed
        self._beat_at = time.monotonic()
        self.stats = counters or stats
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque[Any] = collections.deque()
        self._pending: collections.OrderedDict[int, bool] = collections.OrderedDict()  # value -> done
        self._in_flight: dict[int, float] = {}  # value -> release time
        self._signalled = timeline.value
        self._errors: list[BaseException] = []
        self.dead: BackendDied | None = None  # (a BackendStalled when given up on without dying)
        self._closing = False
        self._thread = threading.Thread(target=self._main, name=f"bridge-{name}", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------

    def enqueue(self, wait: Point | None, value: int, job: Any = None, *,
                release: Callable[[], None] | None = None) -> None:
        """Queue one job: start after ``wait``, signal ``value`` on the backend timeline when done."""
        with self._cond:
            if value <= self._signalled or value in self._pending:
                raise VkxError(f"{self.name}: timeline value {value} was already used "
                               f"(signalled up to {self._signalled})",
                               "take signal values from backend.next_point()")
            self._pending[value] = False
            if self.dead is not None or self._closing:
                self._pending[value] = True
                self._flush_locked(force=True)
                return
            self._queue.append(_Item(wait, value, job, release))
            self._cond.notify()

    def skip(self, value: int) -> None:
        """Signal ``value`` (in order) without running anything: for a job the backend refused,
        so hub work already queued behind its point is not stranded."""
        with self._cond:
            if value <= self._signalled or value in self._pending:
                return
            self._pending[value] = True
            self._flush_locked()

    def control(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the bridge thread after every job queued before it was released."""
        with self._cond:
            if self.dead is not None or self._closing:
                return
            self._queue.append(_Item(None, 0, control=fn))
            self._cond.notify()

    def complete(self, value: int, error: BaseException | None = None) -> None:
        """The backend finished the job that signals ``value`` (any thread)."""
        with self._cond:
            if error is not None:
                self._errors.append(error)
            self._completions += 1
            self._in_flight.pop(value, None)
            if value in self._pending:
                self._pending[value] = True
            self._flush_locked()
            self._cond.notify_all()

    def fail(self, exc: BackendDied) -> None:
        """The backend is gone: record ``exc`` and signal everything pending, now and later."""
        with self._cond:
            if self.dead is None:
                self.dead = exc
                self._errors.append(exc)
                self.stats.add("backend_deaths")
                log.error("%s", exc)
            self._queue.clear()
            self._in_flight.clear()
            for v in self._pending:
                self._pending[v] = True
            self._flush_locked(force=True)
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the first recorded error (a death stays; other errors are reported once)."""
        with self._lock:
            if not self._errors:
                return
            err = self._errors[0]
            self._errors = [e for e in self._errors if e is self.dead]
        raise err

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def gone(self) -> str | None:
        """What is gone, for host waits (None while alive): a death recorded, the liveness probe,
        the bridge thread ended. A stalled backend is not gone (its waits report no progress)."""
        d = self.dead
        if d is not None and not isinstance(d, Stalled):
            return str(d).split("\n")[0]
        if self._closing:
            return None
        if self.liveness is not None:
            try:
                why = self.liveness()
            except Exception as exc:
                why = f"liveness probe failed: {exc}"
            if why:
                return f"backend {self.name}'s {why}"
        if not self._thread.is_alive():
            return f"backend {self.name}'s bridge thread ended"
        return None

    def beat(self) -> None:
        """The backend says it is working (a heartbeat message of a process peer; any thread)."""
        self._beats += 1

    def progress(self) -> Any:
        """Changes whenever the backend answers a job or its heartbeat moves."""
        return (self._signalled, self._completions, self._beats, self._heartbeat())

    def _heartbeat(self) -> Any:
        if self.heartbeat is not None:
            try:
                return self.heartbeat()
            except Exception:
                return None
        if self.run is not None and self._thread.native_id is not None:  # the jobs run here
            return cpu_ticks(os.getpid(), self._thread.native_id)
        return None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; whatever is still pending is signalled (the hub never blocks on us)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._queue.append(_STOP)
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._cond:
            # every value handed out (even one never enqueued) ends up signalled
            if self.timeline._last > self._signalled:
                self._pending[self.timeline._last] = True
            for v in self._pending:
                self._pending[v] = True
            self._flush_locked(force=True)

    # -- signalling -----------------------------------------------------------------------

    def _flush_locked(self, force: bool = False) -> None:
        """Signal the longest done prefix of pending values (all of them when ``force``)."""
        top = 0
        while self._pending:
            v, done = next(iter(self._pending.items()))
            if not done and not force:
                break
            self._pending.popitem(last=False)
            top = max(top, v)
        if top > self._signalled:
            try:
                self.timeline.signal(top)
                self._signalled = top
                self.stats.add("host_signals")
            except Exception as exc:  # the device is gone: nothing left to unblock
                log.error("%s: signalling %s to %d failed: %s", self.name, self.timeline.name, top, exc)

    # -- the thread -----------------------------------------------------------------------

    def _main(self) -> None:
        mark_bridge_thread()
        while True:
            with self._cond:
                while not self._queue:
                    self._watch_locked()
                    if self._closing and not self._queue:
                        return
                    self._cond.wait(self.poll_s)
                item = self._queue.popleft()
            if item is _STOP:
                return
            if item.control is not None:
                try:
                    item.control()
                except Exception as exc:
                    log.warning("%s: control step failed: %s", self.name, exc)
                continue
            self._handle(item)

    def _watch_locked(self) -> None:
        if self.dead is not None:
            return
        why = None
        if self.liveness is not None:
            try:
                why = self.liveness()
            except Exception as exc:  # a broken probe counts as dead
                why = f"liveness probe failed: {exc}"
        err: BackendDied | None = None
        if why is not None:
            err = BackendDied(f"backend {self.name} died: {why}",
                              "the hub keeps running; recreate the backend or plan without it")
        elif self._in_flight:
            now = time.monotonic()
            beat = (self._completions, self._beats, self._heartbeat())
            if beat != self._beat:
                self._beat, self._beat_at = beat, now
            oldest = min(self._in_flight.values())
            idle = now - max(oldest, self._beat_at)
            if idle > self.timeout:
                v = min(self._in_flight, key=self._in_flight.__getitem__)
                alive = ("its process is alive" if self.liveness is not None else "no liveness probe")
                err = BackendStalled(
                    f"backend {self.name}: no progress for {idle:.1f} s: the job signalling "
                    f"{self.timeline.name} = {v} got no answer within {self.timeout:g} s and no "
                    f"heartbeat ({alive}: slow or wedged, not dead)",
                    "the hub keeps running without it; if the backend is just slow (a loaded machine), "
                    "raise VKXSPLIT_TIMEOUT_S (seconds without progress)")
        if err is not None:
            self._cond.release()
            try:
                self.fail(err)
            finally:
                self._cond.acquire()

    def _wait_hub(self, point: Point) -> bool | Stalled:
        """Wait for the hub point: True when reached; False when closing, dead or the hub is
        gone (recorded); the :class:`Stalled` error when it made no progress for the limit."""
        tl, value = point
        clock = StallClock(tl, value, self.timeout, what=f"the hub point {tl.name} >= {value}")
        self.stats.add("bridge_waits")
        if self.spin_s > 0:  # (a relay between GPUs: a blocking wait returns late on the H200)
            try:
                tl.spin(value, min(self.spin_s, self.timeout), lambda: self._closing)
            except VkxError:
                pass  # (the blocking wait below reports it)
        while True:
            try:
                left = clock.poll()
            except Stalled as exc:
                return exc
            except VkxError as exc:  # the hub device or timeline is gone
                with self._cond:
                    self._errors.append(exc)
                return False
            try:
                tl.wait(value, max(0.0, min(self.poll_s * 5, left, POLL_S)))
                return True
            except WaitTimeout:  # (this slice is over)
                pass
            except VkxError as exc:  # the hub device or timeline is gone
                with self._cond:
                    self._errors.append(exc)
                return False
            with self._cond:
                if self.dead is not None or self._closing:
                    return False
                self._watch_locked()
                if self.dead is not None:
                    return False

    def _handle(self, item: _Item) -> None:
        reached = True if item.wait is None else self._wait_hub(item.wait)
        if reached is not True:
            with self._cond:
                if self.dead is None and not self._closing and isinstance(reached, Stalled):
                    self._errors.append(Stalled(
                        f"{self.name}: {str(reached).splitlines()[0]}; the job signalling "
                        f"{self.timeline.name} = {item.value} was skipped",
                        "an earlier part of the step is stuck, or the chain waits on a value that is "
                        "never submitted; if the work is just slow, raise VKXSPLIT_TIMEOUT_S "
                        "(seconds without progress)"))
                if item.value in self._pending:
                    self._pending[item.value] = True
                self._flush_locked()
            return
        with self._cond:
            if self.dead is not None:
                return
            self._in_flight[item.value] = time.monotonic()
        self.stats.add("bridged_jobs")
        try:
            if item.release is not None:
                item.release()
                return  # completion arrives through complete()
            if self.run is None:
                raise VkxError(f"{self.name}: bridge item without release() and bridge without run()")
            self.run(item.job)
        except BackendDied as exc:
            self.fail(exc)
            return
        except Exception as exc:
            log.debug("%s: job for value %d failed: %s", self.name, item.value, exc)
            self.complete(item.value, exc)
            return
        self.complete(item.value)
