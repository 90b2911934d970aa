"""Who may still write into an output buffer: :class:`OutputGuard`, a barrier between the thread that
fills a buffer and the owner that stops waiting for it (shared by the daemon's disk reads and the
client's copies into a caller's rows)."""

from __future__ import annotations

import threading


class Cancelled(Exception):
    """A write refused because its guard was cancelled."""


class OutputGuard:
    """Writes into one output happen only inside ``with guard:`` (which raises :class:`Cancelled` once
    cancelled); :meth:`cancel` returns when no write is under way, and none starts after it."""

    __slots__ = ("_lock", "cancelled")

    def __init__(self):
        self._lock = threading.Lock()
        self.cancelled = False

    def __enter__(self) -> None:
        self._lock.acquire()
        if self.cancelled:
            self._lock.release()
            raise Cancelled("the output's owner stopped waiting")

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
