"""The hedge timer: one thread per client that, when a part of a gather given ``hedge_after`` is
still missing at its hedge time, issues it again on another replica (the first answer wins, bit-exact
either way; the data path cancels the other)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time

from tableclient.errors import TableClientError
from tableclient.metrics import metrics
from tableclient.routing.options import HEDGER_IDLE_S


class Hedger:
    """Hedges of every routed gather of one client, in hedge-time order. ``issue(routed, part,
    hedge=True)`` sends a hedge (the data path's); ``closed`` (an Event) ends the thread."""

    def __init__(self, issue, closed: threading.Event):
        self._issue, self._closed = issue, closed
        self._heap: list = []
        self._seq = itertools.count()  # ties broken by scheduling order, never by comparing gathers
        self._cv = threading.Condition()
        self._metrics = metrics()
        self._thread: threading.Thread | None = None

    def schedule(self, routed, part) -> None:
        """Hedges ``part`` of ``routed`` at its ``hedge_at`` unless it is done by then."""
        with self._cv:
            heapq.heappush(self._heap, (part.hedge_at, next(self._seq), routed, part))
            self._cv.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tableclient-hedges", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Wakes the thread (to see a close)."""
        with self._cv:
            self._cv.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while not self._closed.is_set():
            with self._cv:
                while not self._heap and not self._closed.is_set():
                    self._cv.wait(HEDGER_IDLE_S)
                if self._closed.is_set():
                    return
                at, _, routed, part = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
            if part.done or routed.cancelled or routed.finished:
                continue
            with routed.lock:
                live = part.live()
                if part.hedged or len(live) != 1 or live[0].pending.done():
                    continue
                part.hedged = True
            try:
                attempt = self._issue(routed, part, hedge=True)
            except TableClientError:
                attempt = None
            if attempt is not None:
                self._metrics.hedges.labels("issued").inc()
