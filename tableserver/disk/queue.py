"""The gathers of one disk table, on the table's own thread, in fair turns, within a memory budget.

A transport never reads a disk table on its own threads: a gather of a few thousand rows waits on
the drive for milliseconds, and the tcp workers and the rdma packer serve every other session
meanwhile. It hands the gather to the table's :class:`DiskQueue` (:meth:`DiskQueue.submit`, which returns
the :class:`DiskJob`) and goes on; the queue's thread reads it through the table's
:class:`~tableserver.disk.reader.DiskTable` and calls back once, with the job (its ``error`` None, or the
:class:`~tableserver.common.wire.Refused` the transport answers with: ``IO_ERROR``, or ``BUSY``).

Fair share. Jobs queue per *owner* (a session). They are read in slices of at most ``slice_rows`` rows,
always the slice with the smallest finish tag (fair queueing on virtual time counted in rows: an owner's
next slice starts where its last one ended, or at the slice in service when the owner was idle, and ends
its length later). An owner that has just arrived therefore goes before owners that keep the drive busy,
whatever they have queued. Two *lanes* read: the table's reader, which takes any job, and an express
lane, a second reader of the same files that takes only short jobs (at most ``express_rows`` rows): a
short gather does not wait for the long slice being read, it is read beside it. Its reads still wait at
the drive behind the main lane's reads in flight, so while the express lane has work (and EXPRESS_HOLD_S
after, the gap between one client's back-to-back gathers) the main lane keeps at most 1/EXPRESS_SHARE of
its depth in flight (:meth:`DiskTable.throttle`): short gathers stay near their quiet latency, and a flood
reads at a lower depth only while they come. One owner's jobs run in order, one slice at a time.

Memory. A job writes into the buffer its caller gives (the rdma packer's staging), or into rows the queue
allocates when it admits the job, from the :class:`DiskBudget` every disk table shares: at most
``total`` bytes in all and ``per_owner`` bytes per owner (one job may always run when its owner holds
nothing, so a request larger than the share still runs alone). A job waits unadmitted (holding only its
ids) while the budget is spent, and is refused ``BUSY`` after ``admit_timeout``. Its owner gives the rows
back with :meth:`DiskJob.release` once its response is sent (the rows are mapped memory: freed, they
go back to the system).

Cancel. :meth:`DiskJob.cancel` is a barrier: once it returns, nothing writes into the job's output and
the queue never calls it back; a job not started is dropped, a running one stops at its next write.

Bounded: at most ``max_queued`` jobs wait per table (each transport connection or rdma session has at
most one outstanding, so well-behaved peers never reach it); each job holds its ids (8 bytes a row)
and, once admitted, its rows, inside the budget.
"""

from __future__ import annotations

import collections
import logging
import mmap
import threading
import time
from collections.abc import Callable, Hashable

import numpy as np

from tableserver.common.buffers import OFFSET, PAGE
from tableserver.common.guard import Cancelled, OutputGuard
from tableserver.common.wire import Refused, Status
from tableserver.disk.reader import DiskReadError, DiskTable
from tableserver.logs import RateLimitedLog

log = logging.getLogger(__name__)

#: jobs one disk table's queue holds before refusing more (BUSY)
MAX_QUEUED = 4096
#: rows of one job a turn reads while other sessions wait (the express lane keeps short gathers from
#: waiting for a turn)
SLICE_ROWS = 1024
#: rows one turn of the main lane reads in all: slices of several sessions, or more of one when the others
#: have less (a turn's reads drain the drive's queue at its end: longer turns, fewer drains)
TURN_ROWS = 4096
#: the longest job the express lane takes
EXPRESS_ROWS = 256
#: while the express lane has work, and this long after, the main lane keeps at most 1/EXPRESS_SHARE of its
#: reads in flight: a short gather's reads queue at the drive behind every read in flight, so it waits for
#: few of them (the hold spans the gap between one client's back-to-back gathers)
EXPRESS_SHARE = 32
EXPRESS_HOLD_S = 0.005
#: the disk tier's row buffers, all tables together, by default
BUDGET_BYTES = 512 << 20
#: an owner's share of the budget by default: this fraction of it
OWNER_SHARE = 8

Done = Callable[["DiskJob"], None]

_QUEUED, _ADMITTED, _DONE, _CANCELLED = range(4)


def mapped_rows(rows: int, row_bytes: int) -> np.ndarray:
    """An uninitialised uint8 ``[rows, row_bytes]`` array in its own anonymous mapping (unmapped when the
    last view of it goes), starting OFFSET bytes into a page like the socket copy buffers."""
    raw = mmap.mmap(-1, rows * row_bytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(raw, np.uint8, rows * row_bytes, OFFSET).reshape(rows, row_bytes)


class DiskBudget:
    """Bytes of disk-gather rows held at once: ``total`` in all, ``per_owner`` per owner (default
    ``total // OWNER_SHARE``). Thread-safe; ``held`` is what is taken now."""

    def __init__(self, total: int = BUDGET_BYTES, per_owner: int | None = None):
        if total <= 0 or (per_owner is not None and not 0 < per_owner <= total):
            raise ValueError(f"disk buffer budget {total} B, {per_owner} B per owner: pass 0 < per_owner <= total")
        self.total = int(total)
        self.per_owner = int(per_owner) if per_owner is not None else max(1, self.total // OWNER_SHARE)
        self.held = 0
        self._by_owner: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def take(self, owner: Hashable, nbytes: int) -> bool:
        """Takes ``nbytes`` for ``owner`` when the budget has them (or nothing is held: one job always
        fits); False otherwise."""
        with self._lock:
            mine = self._by_owner.get(owner, 0)
            if self.held and (self.held + nbytes > self.total or (mine and mine + nbytes > self.per_owner)):
                return False
            self.held += nbytes
            self._by_owner[owner] = mine + nbytes
            return True

    def give(self, owner: Hashable, nbytes: int) -> None:
        """Gives back what :meth:`take` took; wakes the queues waiting for room."""
        with self._lock:
            self.held -= nbytes
            left = self._by_owner.get(owner, 0) - nbytes
            if left > 0:
                self._by_owner[owner] = left
            else:
                self._by_owner.pop(owner, None)
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def listen(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(wake)

    def unlisten(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._listeners:
                self._listeners.remove(wake)


class DiskJob:
    """One gather queued on a :class:`DiskQueue`: rows ``ids`` into ``rows`` (the caller's buffer, or the
    queue's once admitted), ``error`` once done (None: every row is in ``rows``)."""

    __slots__ = ("ids", "rows", "done", "owner", "nbytes", "next", "error", "guard", "state", "since", "_queue")

    def __init__(self, queue: DiskQueue, ids: np.ndarray, rows: np.ndarray | None, done: Done, owner: Hashable,
                 nbytes: int):  # fmt: skip
        self.ids = ids
        self.rows = rows
        self.done = done
        self.owner = owner
        self.nbytes = nbytes  # taken from the budget when admitted (0: the caller's buffer)
        self.next = 0  # rows read so far
        self.error: Refused | None = None
        self.guard = OutputGuard()
        self.state = _QUEUED
        self.since = time.monotonic()
        self._queue = queue

    def cancel(self) -> bool:
        """A barrier: from its return on nothing writes into ``rows`` and ``done`` is not called. True when
        the job was stopped, False when it had finished (``done`` was or is being called)."""
        self.guard.cancel()
        return self._queue.drop(self)

    def release(self) -> None:
        """Gives the queue's rows back to the budget (idempotent); call once they are sent."""
        self._queue.release(self)


class _Owner:
    __slots__ = ("jobs", "finish", "busy")

    def __init__(self):
        self.jobs: collections.deque[DiskJob] = collections.deque()
        self.finish = 0.0  # where the owner's last slice ended, in rows of virtual time
        self.busy = False  # a lane is reading its first job's slice


class _Lane:
    """A reader and the thread that reads slices through it: jobs of at most ``most_rows`` rows (None: any)."""

    __slots__ = ("reader", "most_rows", "thread")

    def __init__(self, reader: DiskTable, most_rows: int | None):
        self.reader = reader
        self.most_rows = most_rows
        self.thread: threading.Thread | None = None


class DiskQueue:
    """Runs gathers of ``reader`` (a DiskTable; the queue owns it) on its own threads, fairly between owners
    (see the module); ``name`` is the table's, ``budget`` the disk tier's, ``express_rows`` the longest job
    of the express lane (0: no express lane). ``gathers`` and ``errors`` count jobs done and failed,
    ``cancelled`` jobs stopped, ``queued`` those waiting; ``pages_read``, ``bytes_read``, ``reads`` and
    ``buffer_bytes`` are the readers' together. Idempotent :meth:`close`."""

    def __init__(self, reader: DiskTable, name: str, max_queued: int = MAX_QUEUED, budget: DiskBudget | None = None,
                 slice_rows: int = SLICE_ROWS, admit_timeout: float | None = None,
                 express_rows: int = EXPRESS_ROWS):  # fmt: skip
        if slice_rows < 1 or express_rows < 0:
            raise ValueError(
                f"slice_rows={slice_rows}, express_rows={express_rows}: pass slice_rows >= 1, express_rows >= 0"
            )
        self.reader = reader
        self.lanes = [_Lane(reader, None)]
        if express_rows:  # the same files, checked to be the very ones the reader has open
            self.lanes.append(_Lane(reader.twin(pool_pages=2 * express_rows), express_rows))
        self.name = name
        self.max_queued = max_queued
        self.budget = budget if budget is not None else DiskBudget()
        self.slice_rows = int(slice_rows)
        self.admit_timeout = admit_timeout if admit_timeout is not None else reader.timeout
        self.gathers = self.errors = self.cancelled = 0
        self.queued = 0
        self._owners: dict[Hashable, _Owner] = {}
        self._vtime = 0.0
        self._ready = threading.Condition()
        self._closed = False
        self._ratelog = RateLimitedLog(log)
        self.budget.listen(self._wake)
        for k, lane in enumerate(self.lanes):
            lane.thread = threading.Thread(target=self._run, args=(lane,), name=f"ts-disk{k}-{name}"[:15], daemon=True)
            lane.thread.start()

    @property
    def pages_read(self) -> int:
        return sum(lane.reader.pages_read for lane in self.lanes)

    @property
    def bytes_read(self) -> int:
        return sum(lane.reader.bytes_read for lane in self.lanes)

    @property
    def reads(self) -> int:
        return sum(lane.reader.reads for lane in self.lanes)

    @property
    def buffer_bytes(self) -> int:
        """The readers' page pools."""
        return sum(lane.reader.pool_pages * lane.reader.page for lane in self.lanes)

    # -- the callers' side -------------------------------------------------------------------------

    def submit(self, ids: np.ndarray, out: np.ndarray | None, done: Done, owner: Hashable = None) -> DiskJob:
        """Queues the gather of rows ``ids`` (checked in range by the caller; copied) into ``out`` (uint8
        ``[n, row_bytes]``), or, when None, into rows the queue allocates from the budget (``job.rows``,
        given back by :meth:`DiskJob.release`). ``done(job)`` is called once, on the queue's thread (or at
        once when refused), unless the job is cancelled first. ``start(job(...))``."""
        return self.start(self.job(ids, out, done, owner))

    def job(self, ids: np.ndarray, out: np.ndarray | None, done: Done, owner: Hashable = None) -> DiskJob:
        """The job :meth:`submit` queues, not queued yet: a caller that must hold it before it can be done
        (``done`` may come at once on another thread) keeps it, then :meth:`start` s it."""
        ids = np.array(ids, dtype=np.int64).reshape(-1)  # the caller's buffer may be reused at once
        return DiskJob(self, ids, out, done, owner, 0 if out is not None else ids.size * self.reader.row_bytes)

    def start(self, job: DiskJob) -> DiskJob:
        """Queues ``job`` (from :meth:`job`), or refuses it (``done`` called at once, on this thread)."""
        with self._ready:
            if self._closed:
                job.error = Refused(Status.SESSION_CLOSED, f"disk table {self.name!r}: the server is shutting down")
            elif self.queued >= self.max_queued:
                job.error = Refused(Status.BUSY, f"disk table {self.name!r}: {self.queued} gathers queued: retry")
            else:
                self._owners.setdefault(job.owner, _Owner()).jobs.append(job)
                self.queued += 1
                self._ready.notify_all()  # every lane: only some may take this job
                return job
            job.state = _DONE
        self._call(job)
        return job

    def gather(self, ids: np.ndarray, out: np.ndarray, timeout: float | None = None, owner: Hashable = None) -> None:
        """The same, waited for (up to ``timeout``, by default what the reader's reads may take): raises
        the Refused. Past the timeout the job is cancelled before this returns: ``out`` is the caller's."""
        flag = threading.Event()
        job = self.submit(ids, out, lambda _job: flag.set(), owner)
        if not flag.wait(timeout if timeout is not None else self.reader.timeout * 2 + 1) and job.cancel():
            raise Refused(Status.IO_ERROR, f"disk table {self.name!r}: gather not done in time")
        flag.wait()  # done, or being called back: it sets the flag at once
        if job.error is not None:
            raise job.error

    def drop(self, job: DiskJob) -> bool:
        """:meth:`DiskJob.cancel`'s work, after its guard is cancelled."""
        with self._ready:
            if job.state == _DONE:
                return False
            if job.state != _CANCELLED:
                owner = self._owners.get(job.owner)
                if owner is not None and job in owner.jobs:
                    owner.jobs.remove(job)
                    self.queued -= 1
                    if not owner.jobs:
                        del self._owners[job.owner]
                job.state = _CANCELLED
                self.cancelled += 1
        self.release(job)
        return True

    def release(self, job: DiskJob) -> None:
        """:meth:`DiskJob.release`'s work: the rows it was admitted with back to the budget, once."""
        with self._ready:
            if job.rows is None or not job.nbytes:  # not admitted, given back already, or the caller's buffer
                return
            nbytes, job.nbytes, job.rows = job.nbytes, 0, None
        self.budget.give(job.owner, nbytes)

    def _wake(self) -> None:
        with self._ready:
            self._ready.notify_all()

    # -- the queue's thread ------------------------------------------------------------------------

    def _turn(self, lane: _Lane) -> tuple[list[tuple[_Owner, DiskJob, int]], list[DiskJob]]:
        """For ``lane``, under the lock: the parts of one read, owners' first jobs in order of their slices'
        finish tags, a slice each (their jobs admitted from the budget if they are not yet), then, while the
        turn has room (TURN_ROWS; the express lane: its ``most_rows``), more of the same jobs in that order;
        and the jobs refused BUSY meanwhile (waiting past admit_timeout)."""
        v = self._vtime
        candidates = []
        for key, owner in list(self._owners.items()):
            if not owner.jobs:  # idle: its tag matters until virtual time passes it
                if owner.finish <= v:
                    del self._owners[key]
                continue
            job = owner.jobs[0]
            if owner.busy or (lane.most_rows is not None and job.ids.size > lane.most_rows):
                continue
            n = min(self.slice_rows, job.ids.size - job.next)
            candidates.append((max(v, owner.finish) + n, n, owner, job))
        candidates.sort(key=lambda c: c[0])  # of slices that start together, the shorter ends first
        parts, refused, now = [], [], time.monotonic()
        room = lane.most_rows or TURN_ROWS  # the express lane's turns stay short
        for finish, n, owner, job in candidates:
            if job.state == _QUEUED:
                if job.rows is None and job.nbytes:
                    if not self.budget.take(job.owner, job.nbytes):
                        if now - job.since > self.admit_timeout:
                            b = self.budget
                            job.error = Refused(
                                Status.BUSY,
                                f"disk table {self.name!r}: the disk tier's row buffers are full ({b.held >> 20} of "
                                f"{b.total >> 20} MiB held by gathers not yet sent): retry, or raise --disk-buffer-mib",
                            )
                            refused.append(job)
                        continue
                    job.rows = mapped_rows(job.ids.size, self.reader.row_bytes)
                job.state = _ADMITTED
            n = min(n, room)
            if not parts:
                self._vtime = finish - n  # the first slice's start: virtual time goes with the reads
            owner.finish, owner.busy = max(v, owner.finish) + n, True
            parts.append([owner, job, n])
            room -= n
            if not room:
                break
        for part in parts:  # room left: more of the same jobs, in the same order (one contiguous part each)
            if not room:
                break
            owner, job, n = part
            more = min(room, job.ids.size - job.next - n)
            part[2] += more
            owner.finish += more
            room -= more
        return [tuple(p) for p in parts], refused

    def _finish(self, job: DiskJob) -> bool:
        """Takes a finished (or failed) job off its owner's queue; False when it was cancelled. Under the lock."""
        if job.state in (_CANCELLED, _DONE):  # cancelled, or failed by close()
            return False
        owner = self._owners[job.owner]
        owner.jobs.popleft()
        self.queued -= 1
        if not self.queued:
            self._owners.clear()  # idle: tags start over
            self._vtime = 0.0
        job.state = _DONE
        return True

    def _run(self, lane: _Lane) -> None:
        scratch = np.empty((lane.most_rows or TURN_ROWS, self.reader.row_bytes), np.uint8)  # a turn of several jobs
        express = lane is not self.lanes[0]
        held_until = 0.0  # the express lane's: the main lane is throttled until then
        while True:
            with self._ready:
                while True:
                    if self._closed:
                        return
                    parts, refused = self._turn(lane) if self._owners else ([], [])
                    if parts or refused:
                        break
                    wait = 0.05 if self._owners else None  # unadmitted jobs: their timeout ticks
                    if held_until:
                        left = held_until - time.monotonic()
                        if left <= 0:
                            self.reader.throttle(None)
                            held_until = 0.0
                        else:
                            wait = min(wait or left, left)
                    self._ready.wait(wait)
            if parts and express:
                if not held_until:
                    self.reader.throttle(self.reader.queue_depth // EXPRESS_SHARE)
                held_until = time.monotonic() + EXPRESS_HOLD_S
            if parts:
                self._read(lane.reader, parts, scratch)
            done = []
            with self._ready:
                for owner, job, _ in parts:
                    owner.busy = False
                    if (job.error is not None or job.next >= job.ids.size) and self._finish(job):
                        done.append(job)
                done += [job for job in refused if self._finish(job)]
                self._ready.notify_all()  # the owners' next slices, for either lane
            for job in done:
                if job.error is None:
                    self.gathers += 1
                self._call(job)

    def _read(self, reader: DiskTable, parts: list, scratch: np.ndarray) -> None:
        """Reads each part's rows ``job.next .. job.next + n`` in one gather: straight into a lone part's
        rows, else through ``scratch``, each job's rows written under its guard. A failed read fails every
        job of the turn (job.error)."""
        t0 = time.perf_counter()
        jobs = [(job, n, job.rows) for _, job, n in parts]
        live = [(job, n, rows) for job, n, rows in jobs if rows is not None]  # not cancelled since picked
        error = None
        try:
            if len(live) == 1:
                job, n, rows = live[0]
                a = job.next
                try:
                    reader.gather(job.ids[a : a + n], rows[a : a + n], guard=job.guard)
                    job.next = a + n
                except Cancelled:
                    pass
            elif live:
                ids = np.concatenate([job.ids[job.next : job.next + n] for job, n, _ in live])
                reader.gather(ids, scratch[: ids.size])
                k = 0
                for job, n, rows in live:
                    a = job.next
                    try:
                        with job.guard:
                            rows[a : a + n] = scratch[k : k + n]
                        job.next = a + n
                    except Cancelled:
                        pass
                    k += n
        except DiskReadError as e:
            self.errors += len(live)
            self._ratelog.warning("read", "disk table %s: a read of %d gathers failed: %s", self.name, len(live), e)
            error = Refused(Status.IO_ERROR, f"disk table {self.name!r}: {e}")
        except ValueError as e:  # closed under us, or ids the caller did not check
            self.errors += len(live)
            error = Refused(Status.IO_ERROR, f"disk table {self.name!r}: {e}")
        except Exception as e:  # never lose the thread: the jobs fail, the next ones run
            self.errors += len(live)
            log.exception("disk table %s: internal error in a gather", self.name)
            error = Refused(Status.INTERNAL, f"disk table {self.name!r}: internal error ({type(e).__name__})")
        if error is not None:
            for job, _, _ in live:
                job.error = error
        log.debug("disk table %s: %d gathers, %d rows in %.3f ms", self.name, len(live),
                  sum(n for _, n, _ in live), (time.perf_counter() - t0) * 1e3)  # fmt: skip

    def _call(self, job: DiskJob) -> None:
        try:
            job.done(job)
        except Exception:
            log.exception("disk table %s: a gather's completion failed", self.name)

    def close(self) -> None:
        """Fails queued jobs (SESSION_CLOSED), stops the thread, closes the reader."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            jobs = [j for owner in self._owners.values() for j in owner.jobs if j.state != _CANCELLED]
            for j in jobs:
                j.state = _DONE
                j.error = Refused(Status.SESSION_CLOSED, f"disk table {self.name!r}: the server is shutting down")
            self._owners.clear()
            self.queued = 0
            self._ready.notify_all()
        self.budget.unlisten(self._wake)
        for j in jobs:
            j.guard.cancel()  # a slice still running writes nothing more
            self._call(j)
        for lane in self.lanes:
            lane.thread.join(timeout=lane.reader.timeout + 5)
        for lane in self.lanes:
            lane.reader.close()
