"""Load progress for humans: bytes done, rate and ETA.

On a terminal it redraws one line; otherwise (journald, CI logs) it prints a
line at most every ``interval`` seconds so logs stay readable. Thread-safe:
loader threads call :meth:`update` concurrently.
"""

from __future__ import annotations

import sys
import threading
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, label: str = "loading", stream=None, mode: str = "auto", interval: float = 5.0):
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.enabled = mode == "always" or (mode == "auto")
        self.tty = tty and mode != "never"
        self.interval = 0.2 if self.tty else interval
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()
        if mode == "never":
            self.enabled = False

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and (now - self._last >= self.interval or self.done >= self.total):
                self._last = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = _eta((self.total - self.done) / rate) if rate > 0 else "?"
        line = (
            f"{self.label}: {human_bytes(self.done)} / {human_bytes(self.total)} ({pct:5.1f}%) "
            f"{human_bytes(rate)}/s ETA {eta}"
        )
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> float:
        """Ends the bar; returns the elapsed seconds."""
        elapsed = time.monotonic() - self.start
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
        return elapsed
