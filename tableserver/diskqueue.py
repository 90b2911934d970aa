"""The gathers of one disk table, in order, on the table's own thread.

A transport never reads a disk table on its own threads: a gather of a few thousand rows waits on
the drive for milliseconds, and the tcp workers and the rdma packer serve every other session
meanwhile. It hands the gather to the table's :class:`DiskQueue` with a callback and goes on; the
queue's thread runs the gathers one after another through the table's
:class:`~tableserver.diskio.DiskTable` (which keeps ``queue_depth`` page reads in flight for each)
and calls back with ``None`` or the :class:`~tableserver.common.wire.Refused` (``IO_ERROR``, or
``BUSY`` when the queue is full) the transport answers with.

Bounded: at most ``max_queued`` gathers wait (each transport connection or rdma session has at most
one outstanding, so the bound is never reached by well-behaved peers); their output buffers belong
to the transports, which bound them per connection.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from tableserver.common.wire import Refused, Status
from tableserver.diskio import DiskReadError, DiskTable
from tableserver.logs import RateLimitedLog

log = logging.getLogger("tableserver.diskqueue")

#: gathers one disk table's queue holds before refusing more (BUSY)
MAX_QUEUED = 4096

Done = Callable[[Refused | None], None]


class DiskQueue:
    """Runs gathers of ``reader`` (a DiskTable) one at a time on its own thread; ``name`` is the
    table's. ``errors`` counts failed gathers. Idempotent :meth:`close`."""

    def __init__(self, reader: DiskTable, name: str, max_queued: int = MAX_QUEUED):
        self.reader = reader
        self.name = name
        self.max_queued = max_queued
        self.errors = 0
        self._jobs: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._ratelog = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name=f"tableserver-disk-{name}"[:15], daemon=True)
        self._thread.start()

    def submit(self, ids: np.ndarray, out: np.ndarray, done: Done) -> None:
        """Queues the gather of rows ``ids`` (checked in range by the caller) into ``out``; ``done`` is
        called once, on the queue's thread (or at once when refused), with None or a Refused."""
        with self._ready:
            if self._closed:
                refused = Refused(Status.SESSION_CLOSED, f"disk table {self.name!r}: the server is shutting down")
            elif len(self._jobs) >= self.max_queued:
                refused = Refused(Status.BUSY, f"disk table {self.name!r}: {len(self._jobs)} gathers queued: retry")
            else:
                self._jobs.append((ids, out, done))
                self._ready.notify()
                return
        done(refused)

    def gather(self, ids: np.ndarray, out: np.ndarray, timeout: float | None = None) -> None:
        """The same, waited for: raises the Refused."""
        flag = threading.Event()
        result: list = []

        def finished(error):
            result.append(error)
            flag.set()

        self.submit(ids, out, finished)
        if not flag.wait(timeout if timeout is not None else self.reader.timeout * 2 + 1):
            raise Refused(Status.IO_ERROR, f"disk table {self.name!r}: gather not done in time")
        if result[0] is not None:
            raise result[0]

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self._closed:
                    self._ready.wait()
                if not self._jobs:
                    return
                ids, out, done = self._jobs.popleft()
            error = None
            t0 = time.perf_counter()
            try:
                self.reader.gather(ids, out)
            except DiskReadError as e:
                self.errors += 1
                self._ratelog.warning("read", "disk table %s: gather of %d rows failed: %s", self.name, ids.size, e)
                error = Refused(Status.IO_ERROR, f"disk table {self.name!r}: {e}")
            except ValueError as e:  # closed under us, or ids the caller did not check
                self.errors += 1
                error = Refused(Status.IO_ERROR, f"disk table {self.name!r}: {e}")
            except Exception as e:  # never lose the thread: the gather fails, the next ones run
                self.errors += 1
                log.exception("disk table %s: internal error in a gather", self.name)
                error = Refused(Status.INTERNAL, f"disk table {self.name!r}: internal error ({type(e).__name__})")
            log.debug("disk table %s: %d rows in %.3f ms", self.name, ids.size, (time.perf_counter() - t0) * 1e3)
            try:
                done(error)
            except Exception:
                log.exception("disk table %s: a gather's completion failed", self.name)

    def close(self) -> None:
        """Fails queued gathers (SESSION_CLOSED), stops the thread, closes the reader."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._ready.notify_all()
        for _ids, _out, done in jobs:
            try:
                done(Refused(Status.SESSION_CLOSED, f"disk table {self.name!r}: the server is shutting down"))
            except Exception:
                log.exception("disk table %s: a gather's completion failed", self.name)
        self._thread.join(timeout=self.reader.timeout + 5)
        self.reader.close()
