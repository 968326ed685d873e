"""Progress of long work (loading, calibration, bench sweeps, shader builds).

Library code reports through :func:`task`; nothing is shown until a program calls
:func:`enable` (the command line does). Then a task shows a tqdm bar where the stream is a
terminal (cleared when done), and elsewhere (a log, a pipe) one line every
:data:`PERIOD_S` seconds once the task has run :data:`DELAY_S` seconds, and a closing line
if it printed any: short work prints nothing.

Imports: nothing of vkxsplit.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

#: a task quiet for this long prints nothing where the stream is not a terminal ...
DELAY_S = 15.0
#: ... and then one line at most this often
PERIOD_S = 15.0

_lock = threading.Lock()
_stream: TextIO | None = None
_tty: bool | None = None


def enable(stream: TextIO | None = None, tty: bool | None = None) -> None:
    """Show progress on ``stream`` (default: stderr); ``tty`` forces the bar (True) or the
    periodic lines (False) instead of asking the stream."""
    global _stream, _tty
    _stream, _tty = stream or sys.stderr, tty


def disable() -> None:
    global _stream, _tty
    _stream, _tty = None, None


def enabled() -> bool:
    return _stream is not None


class Task:
    """One piece of long work: ``update(n)`` adds to the count done, ``set(done, total)``
    sets both (the shape of :class:`vkxsplit.model.Model`'s ``progress`` callback)."""

    def __init__(self, label: str, total: float | None, unit: str, stream: TextIO | None,
                 tty: bool | None, delay: float | None = None) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done = 0.0
        self.stream = stream
        self.t0 = time.monotonic()
        self._next = self.t0 + (DELAY_S if delay is None else delay)
        self._printed = False
        self._bar: Any = None
        if stream is not None and (tty if tty is not None else _isatty(stream)):
            from tqdm import tqdm

            # a terminal that reports no width (a bare pseudo-terminal) gets 80 columns: tqdm would
            # trim the bar to nothing
            wide = _columns(stream) > 0
            self._bar = tqdm(total=total, desc=label, unit=unit, leave=False, file=stream, dynamic_ncols=wide,
                             ncols=None if wide else 80, nrows=None if wide else 24,
                             mininterval=0.2, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000)

    def set(self, done: float, total: float | None = None) -> None:
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
        self.update(done - self.done)

    def update(self, n: float = 1, note: str | None = None) -> None:
        self.done += n
        if self.stream is None:
            return
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + PERIOD_S
            self._printed = True
            tail = f", {note}" if note else ""
            self._line(f"{self.label}: {self._count()}{tail} ({now - self.t0:.0f} s)")

    def _count(self) -> str:
        if self.unit == "B":
            of = f" of {self.total / 2**20:.0f}" if self.total else ""
            return f"{self.done / 2**20:.0f}{of} MiB"
        of = f"/{self.total:g}" if self.total else ""
        return f"{self.done:g}{of} {self.unit}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._printed:
            self._line(f"{self.label}: done in {time.monotonic() - self.t0:.0f} s")

    def _line(self, text: str) -> None:
        assert self.stream is not None
        with _lock:
            self.stream.write(text + "\n")
            self.stream.flush()

    def callback(self) -> Callable[[float, float], None]:
        """A ``progress(done, total)`` function for :class:`vkxsplit.model.Model`."""
        return lambda done, total: self.set(done, total)


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def task(label: str, total: float | None = None, unit: str = "it", delay: float | None = None) -> Iterator[Task]:
    """A :class:`Task` shown while the ``with`` block runs (silent unless :func:`enable`);
    ``delay``: seconds before its first line where the stream is not a terminal (default
    :data:`DELAY_S`)."""
    t = Task(label, total, unit, _stream, _tty, delay)
    try:
        yield t
    finally:
        t.close()


__all__ = ["DELAY_S", "PERIOD_S", "Task", "disable", "enable", "enabled", "task"]
