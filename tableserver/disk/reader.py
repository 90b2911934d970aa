"""Rows read from disk: :class:`DiskTable`, a page reader for a table of fixed-size rows kept in a file
(or striped over several files) rather than in memory.

The disk tier's reader (issue 27): ``tableserver.tables.loader`` opens one for each table served from disk.

Layout. The table lives in a *logical file*: row ``r`` is the ``row_bytes`` bytes at logical byte
``offset + r * row_bytes`` -- or, page-aligned (``rows_per_page`` k), at ``offset + (r // k) * page +
(r % k) * row_bytes``, so that no row straddles two pages (``row_base`` shifts the rows of a shard).

* One file: the logical file is that file; logical byte ``L`` is at byte ``L`` of it.
* Striped over ``n`` files with stripe unit ``stripe`` bytes (a multiple of ``page``): the logical file
  is cut into units of ``stripe`` bytes, dealt round robin. Logical byte ``L`` is in unit
  ``u = L // stripe``, kept in file ``u % n`` at byte ``(u // n) * stripe + L % stripe``. File ``i`` holds
  units ``i, i + n, i + 2n, ...`` back to back, from its byte 0 (the stripe files have no header of
  their own: ``offset`` counts in the logical file). A page never spans two files, since a stripe
  unit is a whole number of pages.

Each file must hold at least the bytes of the logical range ``[0, offset + rows * row_bytes)`` dealt to
it; a shorter file is refused at open. The last page of a file may end past its end: that read is
legitimately short, any read shorter than the table's bytes in it means the file shrank.

Reads. The plan (pages, batches, runs) comes from the pure functions of :mod:`tableserver.disk.plan`;
this class only does the I/O. ``gather(row_ids, out)`` reads exactly the pages holding the rows asked
for: the first and last page of each row (a 264 B row straddles two 4 KiB pages 6.25% of the time), deduplicated with
``np.unique``. Pages are placed in the buffer pool in page order, so consecutive logical pages sit
side by side and a straddling row's bytes are contiguous there; the rows are then copied out with one
fancy index over a byte-strided view of the pool (no per-row Python). Runs of pages that are contiguous
in one file are read by one read (up to ``MAX_RUN_PAGES`` pages), ``queue_depth`` of them in flight for
the whole batch, by one of the engines (``io``; ``engine`` says which runs, ``engine_reason`` why), made
once per table and kept for its life: ``"io_uring"`` (the native engine's ring), ``"threads"`` (its
pthreads over ``preadv``) or ``"python"`` (a Python thread pool over ``os.preadv``, the fallback when the
extension is not built), chosen by :func:`tableserver.disk.engines.open_engine` (``"auto"``, the default:
the best that runs here; that module says more). Every engine reads the same page plan into the same pool
and reports faults the same way. The engine itself is ``io_engine`` (tests inject read faults through its
``inject``).

Modules: the files (opening, the O_DIRECT probe, the change check) are :mod:`tableserver.disk.files`'s, the
buffer pool :mod:`tableserver.disk.pool`'s, the engines :mod:`tableserver.disk.engines`'s, the errors
:mod:`tableserver.disk.errors`'s; this class only drives them.

Memory held: the buffer pool only, ``pool_pages`` pages of an anonymous mapping (page-aligned, as
O_DIRECT wants) -- never the table. A gather needing more pages than the pool is done in batches of
half the pool each, the two halves in turn: the next batch is read into one half while the rows of the
last are copied out of the other (the engine goes on to its reads before the last reads of a batch are
back), and a half is reused only once its rows are out and its reads all back. A row straddling two
batches has its pages read once: the shared pages are moved over, not reread.

Faults. A read error (EIO, any OSError), a short read, or a file changed under the reader (``fstat``
of the fd and ``stat`` of the path against the :class:`FileIdentity` seen at open -- inode, size, mtime
and ctime, which userspace cannot set back -- once per gather, after the reads) raises
:class:`DiskReadError` naming the file, the offset and the fix; the gather's ``out`` is then undefined,
and no wrong row is ever returned as a success. ``expect`` ties a reader to the file another open saw
(the header's, the verification's): a file replaced or written in between is refused at open.

Output. A gather writes into its ``out`` only inside its :class:`OutputGuard` (when given): once the
guard's :meth:`~OutputGuard.cancel` returns, no write is under way and none starts, so its caller may
reuse ``out`` at once (the reads still in flight write only into the reader's own pool).

Every wait (the pool lock,
the reads) is bounded by ``timeout``; a read that outlives it poisons the pool (its buffer may still
be written by the kernel) and later gathers fail until it is back. ``close`` never unmaps the pool (nor
frees the native engine's ring or threads) under such a read: it leaves them mapped and logs it; nor
under a running gather: it waits for the gather lock (up to ``timeout``), else the gather frees the
reader as it ends.

O_DIRECT: every file is opened with it and probed with one page read; where the filesystem refuses it
(EINVAL: tmpfs before Linux 6.6, 9p, some FUSE) the reader falls back to buffered reads, logs why, and
says so in ``direct`` / ``io_mode``. Buffered reads leave the pages in the page cache.

Block devices: a table may be a raw block device (a loop or device-mapper device): its size is where
``lseek(SEEK_END)`` ends (``st_size`` is 0 there), and the change check compares the device (inode, device
number and size), not the node's mtime.
"""

from __future__ import annotations

import errno as errno_module
import logging
import os
import threading
from collections import deque
from contextlib import ExitStack

import numpy as np

from tableserver.common.guard import OutputGuard
from tableserver.common.take import in_range
from tableserver.disk.engines import ENGINES, Runs, open_engine
from tableserver.disk.errors import DiskReadError, ReadErrors
from tableserver.disk.fileid import FileIdentity
from tableserver.disk.files import TableFiles
from tableserver.disk.plan import Layout, batches_of, pages_of, reads_of
from tableserver.disk.pool import PagePool

log = logging.getLogger(__name__)


#: pool pages per queue slot by default: a batch of only ``queue_depth`` pages would drain the drive's
#: queue to zero at every batch boundary
POOL_PAGES_PER_SLOT = 16

#: the default pool's floor, in bytes: at a small queue depth, batches of a few pages would cost more in
#: Python (planning and copying out each one) than their reads take
POOL_MIN_BYTES = 1 << 20


class _Unguarded:
    """The guard of a gather nobody cancels."""

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_UNGUARDED = _Unguarded()


def _warn_buffered(reason: str) -> None:
    log.warning("%s; reading buffered (the page cache will hold the pages read)", reason)


def _check_geometry(n, offset, rows, row_bytes, page, stripe, queue_depth, timeout, io, rows_per_page, row_base):
    """DiskTable's arguments refused, as ValueError (see its docstring)."""
    if n == 0:
        raise ValueError("DiskTable needs at least one file: pass a path or a list of stripe files")
    if offset < 0 or rows < 0 or row_bytes <= 0:
        raise ValueError(
            f"bad table geometry offset={offset} rows={rows} row_bytes={row_bytes}: "
            "offset and rows must be >= 0, row_bytes > 0"
        )
    if page <= 0 or page % 512:
        raise ValueError(f"page={page}: the read unit must be a positive multiple of 512 (O_DIRECT alignment)")
    if n > 1 and stripe is None:
        raise ValueError(f"{n} files but no stripe: pass stripe=<bytes>, the round-robin unit they were cut in")
    stripe = stripe if stripe is not None else 0
    if n > 1 and (stripe <= 0 or stripe % page):
        raise ValueError(f"stripe={stripe}: the stripe unit must be a positive multiple of page={page}")
    if not 1 <= queue_depth <= 1024:
        raise ValueError(f"queue_depth={queue_depth}: pass 1..1024")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout}: pass a positive number of seconds")
    if io not in ENGINES:
        raise ValueError(f"io={io!r}: pass one of {', '.join(ENGINES)}")
    k, base, row_bytes, page = int(rows_per_page), int(row_base), int(row_bytes), int(page)
    if k < 0 or k * row_bytes > page or base < 0:
        raise ValueError(
            f"rows_per_page={rows_per_page} row_base={row_base}: a page of {page} B holds at most "
            f"{page // row_bytes} rows of {row_bytes} B, and row_base must be >= 0"
        )
    if base and not k:
        raise ValueError("row_base is for page-aligned tables: add row_base * row_bytes to offset instead")


class DiskTable:
    """A table of ``rows`` rows of ``row_bytes`` bytes read page by page from ``paths`` (one path, or a
    list of stripe files, or a block device: see the module's layout).

    ``page``: the read unit (a multiple of 512, the offsets O_DIRECT needs); ``stripe``: the stripe unit
    in bytes, required with several files (a multiple of ``page``); ``queue_depth``: reads in flight;
    ``pool_pages``: the buffer pool, in pages (default ``16 * queue_depth``, at least 1 MiB); ``direct``:
    try O_DIRECT; ``timeout``: seconds any wait may take; ``io``: the read engine, ``"auto"``, ``"io_uring"``,
    ``"threads"`` or ``"python"`` (see the module; a named engine that cannot run here raises
    :class:`DiskReadError` saying why and what to do). ``engine`` is the one that runs, ``engine_reason``
    one line on why, ``io_engine`` the engine itself. ``expect``: the :class:`FileIdentity` each file must
    still have (None entries: any), e.g. the one its header was read from; another file, or one written
    since, is refused.

    Use as a context manager, or call :meth:`close` (idempotent)."""

    def __init__(
        self,
        paths,
        offset: int,
        rows: int,
        row_bytes: int,
        page: int = 4096,
        stripe: int | None = None,
        queue_depth: int = 32,
        direct: bool = True,
        pool_pages: int | None = None,
        timeout: float = 30.0,
        io: str = "auto",
        rows_per_page: int = 0,
        row_base: int = 0,
        expect=None,
    ):
        self.paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        n = len(self.paths)
        _check_geometry(n, offset, rows, row_bytes, page, stripe, queue_depth, timeout, io, rows_per_page, row_base)
        self.offset, self.rows, self.row_bytes, self.page = int(offset), int(rows), int(row_bytes), int(page)
        self.stripe, self.queue_depth, self.timeout = int(stripe or 0), int(queue_depth), float(timeout)
        self.nbytes = self.rows * self.row_bytes
        #: page-aligned layout: ``rows_per_page`` rows at the start of each page (0: rows back to back);
        #: ``row_base``: the table row this reader's row 0 is (a shard of a page-aligned table)
        self.rows_per_page, self.row_base = int(rows_per_page), int(row_base)
        #: where the rows are (the page plan's input)
        self.layout = Layout(self.offset, self.rows, self.row_bytes, self.page, self.rows_per_page, self.row_base,
                             n, self.stripe)  # fmt: skip
        self._span = self.layout.span
        if pool_pages is None:
            batch = max(POOL_PAGES_PER_SLOT * self.queue_depth, POOL_MIN_BYTES // self.page)
        else:
            batch = int(pool_pages)
        if batch < 1:
            raise ValueError(f"pool_pages={pool_pages}: pass at least 1")
        self._batch = batch  # pages of first pages per batch
        #: pages in the pool: a batch's rows may end up to span-1 pages past its last first page
        self.pool_pages = batch + self._span - 1
        self.gathers = 0
        self._errors = ReadErrors(self.paths, self.timeout)
        self._lock = threading.Lock()
        self._closed = self._freed = True  # until open: nothing to free
        with ExitStack() as undo:
            self._pool = PagePool(self.pool_pages, self.page, self.row_bytes)
            undo.callback(self._pool.free)
            self._files = TableFiles(self.layout, direct, expect, self._pool.view, self._errors, _warn_buffered)
            undo.callback(self._files.close)
            files = self._files
            self._io = open_engine(io, self.queue_depth, self.timeout, self._pool, files.fds, files.first_pages(),
                                   self._errors)  # fmt: skip
            undo.pop_all()
        self._closed = self._freed = False
        self.direct, self.io_mode = files.direct, files.io_mode
        self.engine, self.engine_reason = self._io.name, self._io.reason
        log.info(
            "%s: disk reads by the %s engine (%s), %s, queue depth %d",
            self.paths[0],
            self.engine,
            self.engine_reason,
            self.io_mode,
            self.queue_depth,
        )

    # -- what it says of itself -------------------------------------------------------------------

    @property
    def io_engine(self):
        """The engine that reads (:mod:`tableserver.disk.engines`: its ``name`` is ``engine``; tests inject
        read faults through its ``inject``)."""
        return self._io

    @property
    def pages_read(self) -> int:
        """Pages read, over the reader's life."""
        return self._io.pages_read

    @property
    def bytes_read(self) -> int:
        """Bytes read, over the reader's life."""
        return self._io.bytes_read

    @property
    def reads(self) -> int:
        """Read calls (preadv calls, or io_uring reads) that returned."""
        return self._io.reads

    @property
    def pool_bytes(self) -> int:
        """Bytes of the buffer pool mapped (the memory the reader holds; 0 once closed, unless left mapped to
        reads still in flight)."""
        return self._pool.nbytes

    @property
    def read_limit(self) -> int:
        """Reads the reader may keep in flight now (:meth:`throttle`); 0 once closed."""
        return 0 if self._closed else self._io.limit

    @property
    def identities(self) -> tuple[FileIdentity, ...]:
        """Each file's identity as opened (pass it as another reader's ``expect``)."""
        return tuple(self._files.ids)

    def twin(self, pool_pages: int | None = None) -> DiskTable:
        """Another reader of the same files (checked to be the very ones this one has open), with the same
        geometry, engine and reads in flight, and a pool of its own (``pool_pages``, default as this one's)."""
        return DiskTable(
            self.paths, self.offset, self.rows, self.row_bytes, page=self.page, stripe=self.stripe or None,
            queue_depth=self.queue_depth, direct=self.direct, pool_pages=pool_pages, timeout=self.timeout,
            io=self.engine if self.engine in ENGINES else "auto", rows_per_page=self.rows_per_page,
            row_base=self.row_base, expect=self._files.ids,
        )  # fmt: skip

    def throttle(self, reads: int | None) -> None:
        """Lets the reader keep at most ``reads`` reads in flight from now on (None: ``queue_depth`` again);
        callable from any thread, during a gather too: the reads already at the drive finish, no new one
        starts past the limit. The native engines only (the python engine keeps its depth); a closed reader
        ignores it."""
        self._io.throttle(reads)

    # -- gathering -------------------------------------------------------------------------------

    def gather(self, row_ids, out: np.ndarray | None = None, guard: OutputGuard | None = None) -> np.ndarray:
        """Rows ``row_ids`` (any integer array) into ``out`` (uint8, C-contiguous, shape
        ``row_ids.shape + (row_bytes,)``; allocated when None), which is returned. Ids outside
        ``0..rows-1``: ValueError, before any read. A failed read: DiskReadError (``out`` undefined).
        ``guard``: rows are written into ``out`` only inside it; cancelled, the gather stops with
        ``tableserver.common.guard.Cancelled``."""
        if self._closed:
            raise ValueError("DiskTable is closed: open a new one")
        ids = np.asarray(row_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"row ids must be integers, got {ids.dtype}")
        shape = ids.shape + (self.row_bytes,)
        if out is None:
            out = np.empty(shape, np.uint8)
        elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(
                f"out must be a writable C-contiguous uint8 array of shape {shape}, got {out.dtype} {out.shape}"
            )
        flat = ids.reshape(-1)
        if flat.size == 0:
            return out
        if not in_range(flat, self.rows):
            bad = (flat < 0) | (flat >= self.rows) if ids.dtype.kind == "i" else flat >= self.rows
            pos = int(np.argmax(bad))
            raise ValueError(f"row id {int(flat[pos])} at position {pos} is outside 0..{self.rows - 1}")
        if not self._lock.acquire(timeout=self.timeout):
            raise DiskReadError(
                f"{self.paths[0]}: gather waited {self.timeout:g} s for the reader's buffers: "
                "the disk is too slow for the load, lower the request rate or raise timeout",
                errno_module.ETIMEDOUT,
            )
        try:
            if self._closed:
                raise ValueError("DiskTable is closed: open a new one")
            self._io.settle()  # refuses the pool while a timed-out read may still write into it
            self._gather(flat.astype(np.int64, copy=False), out.reshape(-1, self.row_bytes), guard or _UNGUARDED)
            change = self._files.first_change()
            if change is not None:
                raise self._errors.changed(*change)
            self.gathers += 1
        finally:
            if self._closed:  # closed while this gather ran: close() left the freeing to it
                self._free()
            self._lock.release()
        return out

    def file_change(self) -> tuple[str, str] | None:
        """(path, how it changed) of the first file changed or replaced since it was opened (what every
        gather checks after its reads, as a DiskReadError); None when every file is as opened."""
        with self._lock:
            if self._closed:
                raise ValueError("DiskTable is closed: open a new one")
            change = self._files.first_change()
        return (self.paths[change[0]], change[1]) if change is not None else None

    def _gather(self, ids: np.ndarray, out2: np.ndarray, guard) -> None:
        page, rb, pool = self.page, self.row_bytes, self._pool
        plan = pages_of(self.layout, ids)
        pages, fslot, within = plan.pages, plan.first, plan.within
        if len(pages) <= self._batch:  # one batch: rows straight into out, in their own order
            r = self._runs(pages, 0, len(pages), 0, 0)
            if r.npg:
                self._io.read(r)
            with guard:
                pool.copy_rows(fslot * page + within, out2)
            return
        # Batches of first pages, read into the two halves of the pool in turn: the next batch is read while
        # the rows of one are copied out (a pool too small to halve holds one batch at a time)
        nreg, region, plans = batches_of(plan, self.pool_pages, self._batch, self._span)
        queued: deque = deque()
        try:
            for k in range(min(nreg, len(plans))):
                queued.append(self._io.submit(self._runs(pages, *plans[k][1:], base=(k % nreg) * region)))
            for k, (sel, lo, _, _) in enumerate(plans):
                self._io.wait(queued.popleft())
                base = (k % nreg) * region
                part = np.empty((sel.size, rb), np.uint8)
                pool.copy_rows((base + fslot[sel] - lo) * page + within[sel], part)
                with guard:
                    out2[sel] = part
                if k + 1 < len(plans) and plans[k + 1][3]:
                    # the next batch's first pages are this one's last (straddling rows): moved, not reread
                    keep = plans[k + 1][3]
                    pool.move(((k + 1) % nreg) * region * page, (base + plans[k + 1][1] - lo) * page, keep)
                if k + nreg < len(plans):
                    nxt = self._runs(pages, *plans[k + nreg][1:], base=((k + nreg) % nreg) * region)
                    queued.append(self._io.submit(nxt))
        except BaseException as e:
            # the reads of the batches queued behind a failed one, stopped and reaped, waiting up to timeout (not
            # at all after a timeout); reads not back poison the pool
            stalled = getattr(e, "errno", None) == errno_module.ETIMEDOUT
            self._io.abandon(queued, 0.0 if stalled else self.timeout)
            raise

    def _runs(self, pages: np.ndarray, lo: int, hi: int, keep: int, base: int) -> Runs:
        """The reads of pages ``pages[lo+keep:hi]`` into pool pages base+keep.. (the first ``keep`` are there
        already): :func:`~tableserver.disk.plan.reads_of`, with each read's fd."""
        r = reads_of(self.layout, pages[lo + keep : hi], base + keep, self._files.needs)
        return Runs(r.pages, r.file, self._files.fd_of[r.file], r.dst, r.len, r.at, r.need)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the engine and closes the files and the pool; idempotent. Waits up to ``timeout`` for a
        running gather (past it, that gather frees the reader as it ends: nothing is freed under it).
        Reads still in flight after ``timeout`` leave the pool mapped (and the native engine's ring or
        threads to them)."""
        if self._closed:
            return
        self._closed = True  # no gather starts from here on
        if not self._lock.acquire(timeout=self.timeout):
            log.warning("%s: closed during a gather; the reader is freed when it ends", self.paths[0])
            return
        try:
            self._free()
        finally:
            self._lock.release()

    def _free(self) -> None:
        """close()'s work, under the gather lock; once."""
        if self._freed:
            return
        self._freed = True
        back = self._io.close(self.timeout)
        self._files.close()
        if back:
            self._pool.free()
        else:  # a timed-out read may still write into the pool: never unmap it under one
            log.warning(
                "%s: closed with reads still in flight; the buffer pool is left mapped%s",
                self.paths[0],
                self._io.leftover,
            )
            self._pool.drop_rows()

    def __enter__(self) -> DiskTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"DiskTable({self.paths!r}, rows={self.rows}, row_bytes={self.row_bytes}, page={self.page}, "
            f"stripe={self.stripe or None}, queue_depth={self.queue_depth}, pool_pages={self.pool_pages}, "
            f"{self.io_mode}, engine={self.engine})"
        )
