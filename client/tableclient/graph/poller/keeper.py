"""The native poller's connections, opened off the launch path by a thread of their own, with back-off; and its
look, every CHECK_S, for connections the server closed while idle. What it connects and checks is the poller's
(:class:`tableclient.graph.poller.native.NativePoller` hands it two callables); this is the when."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

#: the keeper's back-off between connect attempts to a node: from BACKOFF_MIN doubling to BACKOFF_MAX seconds
BACKOFF_MIN, BACKOFF_MAX = 0.05, 5.0
#: how often the keeper looks for connections the server closed while idle
CHECK_S = 0.05


class Keeper:
    """The native poller's connections, opened off the launch path: ``want(i, key, route)`` asks for layer
    ``i``'s connection (connected at once, again with back-off while it fails); ``drop(i)`` withdraws it. Every
    CHECK_S it also runs ``check()`` (connections the server closed while idle)."""

    def __init__(self, connect, check):
        self._connect, self._check = connect, check
        self._cond = threading.Condition()
        self._jobs: dict = {}  # slot -> [key, route, attempts, due]
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tableclient-graph-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def want(self, i: int, key: tuple, route) -> None:
        with self._cond:
            job = self._jobs.get(i)
            if job is not None and job[0] == key:
                job[1] = route
                return
            self._jobs[i] = [key, route, 0, 0.0]
            self._cond.notify()

    def drop(self, i: int) -> None:
        with self._cond:
            self._jobs.pop(i, None)

    def pending(self, i: int) -> bool:
        """Whether layer ``i``'s connection is asked for and not yet made."""
        with self._cond:
            return i in self._jobs

    def _run(self) -> None:
        checked = 0.0
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [(i, job) for i, job in self._jobs.items() if job[3] <= now]
                if not due:
                    wake = min((job[3] for job in self._jobs.values()), default=now + CHECK_S)
                    self._cond.wait(max(min(wake - now, checked + CHECK_S - now), 0.001))
            if time.monotonic() - checked >= CHECK_S:
                checked = time.monotonic()
                try:
                    self._check()
                except Exception:  # noqa: BLE001  (the keeper outlives any one look: the layers' steps go on)
                    log.exception("the native poller's keeper could not look at its connections")
            for i, job in due:
                key, route, attempts = job[0], job[1], job[2]
                try:
                    done = self._connect(i, key, route)
                except Exception:  # noqa: BLE001  (as above: tried again after the back-off)
                    log.exception("the native poller's keeper could not connect layer slot %d", i)
                    done = False
                with self._cond:
                    if self._jobs.get(i) is not job:
                        continue
                    if done:
                        del self._jobs[i]
                    else:
                        job[2] = attempts + 1
                        job[3] = time.monotonic() + min(BACKOFF_MIN * 2**attempts, BACKOFF_MAX)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._connect = self._check = None  # no cycle back to the poller: it is freed with its GraphStep
