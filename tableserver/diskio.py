"""Rows read from disk: :class:`DiskTable`, a page reader for a table of fixed-size rows kept in a file
(or striped over several files) rather than in memory.

The first piece of the disk tier (issue 27); nothing in the daemon uses it yet.

Layout. The table lives in a *logical file*: row ``r`` is the ``row_bytes`` bytes at logical byte
``offset + r * row_bytes``.

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

Reads. ``gather(row_ids, out)`` reads exactly the pages holding the rows asked for: the first and last
page of each row (a 264 B row straddles two 4 KiB pages 6.25% of the time), deduplicated with
``np.unique``. Pages are placed in the buffer pool in page order, so consecutive logical pages sit
side by side and a straddling row's bytes are contiguous there; the rows are then copied out with one
fancy index over a byte-strided view of the pool (no per-row Python). Runs of pages that are contiguous
in one file are read by one ``os.preadv`` (up to ``MAX_RUN_PAGES`` pages). ``queue_depth`` worker
threads each keep one read in flight, taking the next run from a shared counter, so the drive sees
``queue_depth`` outstanding reads for the whole batch.

Memory held: the buffer pool only, ``pool_pages`` pages of an anonymous mapping (page-aligned, as
O_DIRECT wants) -- never the table. A gather needing more pages than the pool is done in batches;
each batch waits for all its reads before the pool is reused.

Faults. A read error (EIO, any OSError), a short read, or a file changed under the reader (``fstat``
of the fd and ``stat`` of the path against the inode, size and mtime seen at open, once per gather,
after the reads) raises :class:`DiskReadError` naming the file, the offset and the fix; the gather's
``out`` is then undefined, and no wrong row is ever returned as a success. Every wait (the pool lock,
the reads) is bounded by ``timeout``; a read that outlives it poisons the pool (its buffer may still
be written by the kernel) and later gathers fail until it is back.

O_DIRECT: every file is opened with it and probed with one page read; where the filesystem refuses it
(EINVAL: tmpfs before Linux 6.6, 9p, some FUSE) the reader falls back to buffered reads, logs why, and
says so in ``direct`` / ``io_mode``. Buffered reads leave the pages in the page cache.

The reads run in Python threads (``os.preadv`` releases the GIL): about a microsecond or two of GIL
per read. The plan (issue 27) is a native io_uring/pthread engine behind the same page plan.
"""

from __future__ import annotations

import errno as errno_module
import itertools
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np

from tableserver.errors import TableFileError

log = logging.getLogger("tableserver.diskio")

#: the longest run of contiguous pages read by one preadv (longer runs are cut, so that a gather of
#: neighbouring rows still spreads over the queue)
MAX_RUN_PAGES = 32

#: pool pages per queue slot by default: a batch of only ``queue_depth`` pages would drain the drive's
#: queue to zero at every batch boundary
POOL_PAGES_PER_SLOT = 16


class DiskReadError(TableFileError):
    """A disk table's read failed (EIO, a short read, a file changed or replaced under the reader, or a
    read past the timeout). One line naming the file, the offset and the fix; ``errno`` is the OS error
    number where one caused it."""


class DiskTable:
    """A table of ``rows`` rows of ``row_bytes`` bytes read page by page from ``paths`` (one path, or a
    list of stripe files: see the module's layout).

    ``page``: the read unit (a multiple of 512, the offsets O_DIRECT needs); ``stripe``: the stripe unit
    in bytes, required with several files (a multiple of ``page``); ``queue_depth``: reads in flight;
    ``pool_pages``: the buffer pool, in pages (default ``16 * queue_depth``); ``direct``: try O_DIRECT;
    ``timeout``: seconds any wait may take.

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
    ):
        self.paths = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
        n = len(self.paths)
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
        self.offset, self.rows, self.row_bytes, self.page = int(offset), int(rows), int(row_bytes), int(page)
        self.stripe, self.queue_depth, self.timeout = int(stripe), int(queue_depth), float(timeout)
        self.nbytes = self.rows * self.row_bytes
        #: most pages one row touches: a row of row_bytes starting anywhere in a page
        self._span = (self.row_bytes + self.page - 2) // self.page + 1
        batch = int(pool_pages) if pool_pages is not None else POOL_PAGES_PER_SLOT * self.queue_depth
        if batch < 1:
            raise ValueError(f"pool_pages={pool_pages}: pass at least 1")
        self._batch = batch  # pages of first pages per batch
        #: pages in the pool: a batch's rows may end up to span-1 pages past its last first page
        self.pool_pages = batch + self._span - 1
        self.pages_read = 0
        self.bytes_read = 0
        self.reads = 0  # preadv calls
        self.gathers = 0
        self.direct = bool(direct)
        self.io_mode = "O_DIRECT" if direct else "buffered (direct=False)"
        self._fds: list[int] = []
        self._stats: list[tuple[int, int, int, int]] = []
        self._pool = None
        self._executor = None
        self._inflight: list = []
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._need = self._file_needs()
            self._open_files(direct)
            self._pool = mmap.mmap(-1, self.pool_pages * self.page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._buf = np.frombuffer(self._pool, np.uint8)
            self._view = memoryview(self._pool)
            if self.direct:
                self._probe()
            self._executor = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="tableserver-disk")
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------------

    def _file_needs(self) -> list[int]:
        """Bytes of each file that hold part of the logical range [0, offset + nbytes)."""
        end = self.offset + self.nbytes
        n = len(self.paths)
        if n == 1:
            return [end]
        units, rem = divmod(end, self.stripe)
        needs = []
        for i in range(n):
            full = (units - i + n - 1) // n if units > i else 0
            needs.append(full * self.stripe + (rem if i == units % n else 0))
        return needs

    def _open_files(self, direct: bool) -> None:
        for path, need in zip(self.paths, self._need):
            flags = os.O_RDONLY | os.O_CLOEXEC
            fd = -1
            if self.direct:
                try:
                    fd = os.open(path, flags | os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno_module.EINVAL:
                        raise DiskReadError(
                            f"{path}: cannot open the disk table ({e.strerror}): check the path", e.errno
                        ) from None
                    self._go_buffered(f"{path}: the filesystem refuses O_DIRECT")
            if fd < 0:
                try:
                    fd = os.open(path, flags)
                except OSError as e:
                    raise DiskReadError(
                        f"{path}: cannot open the disk table ({e.strerror}): check the path", e.errno
                    ) from None
            self._fds.append(fd)
            st = os.fstat(fd)
            if st.st_size < need:
                raise DiskReadError(
                    f"{path}: truncated disk table file: {st.st_size} bytes, the table needs {need} "
                    f"(offset {self.offset}, {self.rows} rows of {self.row_bytes} B): re-copy or re-pack it"
                )
            self._stats.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    def _go_buffered(self, reason: str) -> None:
        if self.direct:
            log.warning("%s; reading buffered (the page cache will hold the pages read)", reason)
        self.direct = False
        self.io_mode = f"buffered ({reason})"

    def _probe(self) -> None:
        """One O_DIRECT read of the table's first page per file; EINVAL (an alignment the device does not
        take) switches every file to buffered reads."""
        first = self.offset // self.page * self.page
        for i, fd in enumerate(self._fds):
            at = first if len(self._fds) == 1 else 0
            try:
                os.preadv(fd, [self._view[: self.page]], at)
            except OSError as e:
                if e.errno != errno_module.EINVAL:
                    raise self._error(i, at, e) from None
                self._go_buffered(f"{self.paths[i]}: O_DIRECT reads of {self.page} B at offset {at} refused (EINVAL)")
                break
        if not self.direct:
            for i, fd in enumerate(self._fds):
                os.close(fd)
                self._fds[i] = os.open(self.paths[i], os.O_RDONLY | os.O_CLOEXEC)
                st = os.fstat(self._fds[i])
                if (st.st_dev, st.st_ino) != self._stats[i][:2]:
                    raise self._changed(i, "replaced while opening")

    # -- errors ----------------------------------------------------------------------------------

    def _error(self, i: int, at: int, e: OSError) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[i]}: read error at byte {at} ({e.strerror or e}): the drive or file is failing; "
            "check the kernel log (dmesg) and re-copy the table to a healthy drive",
            e.errno,
        )

    def _changed(self, i: int, what: str) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[i]}: disk table file {what} since it was opened: rows read now may be wrong; "
            "never write a served table in place -- restart the reader (or daemon) on the new file"
        )

    # -- gathering -------------------------------------------------------------------------------

    def gather(self, row_ids, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``row_ids`` (any integer array) into ``out`` (uint8, C-contiguous, shape
        ``row_ids.shape + (row_bytes,)``; allocated when None), which is returned. Ids outside
        ``0..rows-1``: ValueError, before any read. A failed read: DiskReadError (``out`` undefined)."""
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
        bad = (flat < 0) | (flat >= self.rows) if ids.dtype.kind == "i" else flat >= self.rows
        if bad.any():
            pos = int(np.argmax(bad))
            raise ValueError(f"row id {int(flat[pos])} at position {pos} is outside 0..{self.rows - 1}")
        if not self._lock.acquire(timeout=self.timeout):
            raise DiskReadError(
                f"{self.paths[0]}: gather waited {self.timeout:g} s for the reader's buffers: "
                "the disk is too slow for the load, lower the request rate or raise timeout",
                errno_module.ETIMEDOUT,
            )
        try:
            self._check_idle()
            self._gather(flat.astype(np.int64, copy=False), out.reshape(-1, self.row_bytes))
            self._check_files()
            self.gathers += 1
        finally:
            self._lock.release()
        return out

    def _gather(self, ids: np.ndarray, out2: np.ndarray) -> None:
        page, rb = self.page, self.row_bytes
        start = self.offset + ids * rb
        first = start // page
        last = (start + (rb - 1)) // page
        if self._span == 2:
            pages = np.unique(np.concatenate((first, last)))
        else:  # rows longer than a page: every page between first and last
            steps = np.minimum(first[:, None] + np.arange(self._span), last[:, None])
            pages = np.unique(steps)
        fslot = np.searchsorted(pages, first)
        lslot = fslot + (last - first)
        within = start - first * page
        nbatch = -(-len(pages) // self._batch)
        if nbatch == 1:  # one batch: rows straight into out, in their own order
            self._read_slots(pages, 0, len(pages))
            self._copy_rows(fslot * page + within, out2)
            return
        order = np.argsort(fslot, kind="stable")
        sorted_f = fslot[order]
        bounds = np.searchsorted(sorted_f, np.arange(nbatch + 1) * self._batch)
        held_lo = held_hi = 0  # the slots the pool holds from the batch before
        for b in range(nbatch):
            sel = order[bounds[b] : bounds[b + 1]]
            if sel.size == 0:
                continue
            lo = int(sorted_f[bounds[b]])
            hi = int(lslot[sel].max()) + 1
            keep = max(0, held_hi - lo)  # the last batch's straddling rows' second pages: move, not reread
            if keep:
                src = (lo - held_lo) * page
                self._buf[: keep * page] = self._buf[src : src + keep * page]
            self._read_slots(pages, lo, hi, keep)
            held_lo, held_hi = lo, hi
            part = np.empty((sel.size, rb), np.uint8)
            self._copy_rows((fslot[sel] - lo) * page + within[sel], part)
            out2[sel] = part

    def _copy_rows(self, pos: np.ndarray, out2: np.ndarray) -> None:
        """Rows at byte positions ``pos`` of the pool into ``out2`` (one gather over a view of overlapping rows)."""
        buf = self._buf
        n = buf.size - self.row_bytes + 1
        rows_view = np.lib.stride_tricks.as_strided(buf, shape=(n, self.row_bytes), strides=(1, 1), writeable=False)
        # fancy indexing, not np.take: take makes a non-contiguous source C-contiguous first, i.e. copies
        # row_bytes times the pool
        out2[...] = rows_view[pos]

    def _locate(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, byte offset in that file) of each logical page."""
        at = pages * self.page
        if len(self._fds) == 1:
            return np.zeros(len(pages), np.int64), at
        n = len(self._fds)
        unit, inside = np.divmod(at, self.stripe)
        return unit % n, (unit // n) * self.stripe + inside

    def _read_slots(self, pages: np.ndarray, lo: int, hi: int, keep: int = 0) -> None:
        """Pages ``pages[lo:hi]`` into pool pages 0..hi-lo-1, in parallel runs, all back on return; the first
        ``keep`` are in the pool already."""
        chunk = pages[lo + keep : hi]
        if chunk.size == 0:
            return
        files, at = self._locate(chunk)
        npg = len(chunk)
        if npg > 1:
            brk = (np.diff(at) != self.page) | (np.diff(files) != 0)
            starts = np.flatnonzero(np.concatenate(([True], brk)))
        else:
            starts = np.zeros(1, np.int64)
        ends = np.append(starts[1:], npg)
        if (ends - starts).max() > MAX_RUN_PAGES:  # cut long runs
            lens = ends - starts
            pieces = -(-lens // MAX_RUN_PAGES)
            base = np.repeat(starts, pieces)
            k = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            starts = base + k * MAX_RUN_PAGES
            ends = np.minimum(starts + MAX_RUN_PAGES, np.repeat(ends, pieces))
        run_file = files[starts]
        run_at = at[starts]
        run_len = (ends - starts) * self.page
        starts = starts + keep
        need_file = np.asarray(self._need, np.int64)[run_file]
        run_need = np.minimum(run_len, need_file - run_at)
        jobs = list(
            zip(
                run_file.tolist(),
                (starts * self.page).tolist(),
                run_len.tolist(),
                run_at.tolist(),
                run_need.tolist(),
            )
        )
        counter = itertools.count()
        failed: list = []
        view, fds = self._view, self._fds
        njobs = len(jobs)

        def worker() -> tuple[int, int]:
            got = calls = 0
            while not failed:
                j = next(counter)
                if j >= njobs:
                    break
                f, dst, length, where, need = jobs[j]
                try:
                    n = os.preadv(fds[f], [view[dst : dst + length]], where)
                except OSError as e:
                    failed.append(self._error(f, where, e))
                    break
                calls += 1
                got += n
                if n < need:
                    failed.append(
                        DiskReadError(
                            f"{self.paths[f]}: short read at byte {where}: {n} of {need} bytes (the file "
                            "shrank or was truncated since it was opened): re-copy the table and restart the reader"
                        )
                    )
                    break
            return got, calls

        futures = [self._executor.submit(worker) for _ in range(min(self.queue_depth, njobs))]
        done, pending = wait_futures(futures, timeout=self.timeout)
        if pending:
            self._inflight = list(pending)
            failed.append(
                DiskReadError(
                    f"{self.paths[0]}: reads of {npg} pages took over {self.timeout:g} s: the drive is stalled or "
                    "overloaded; check it (dmesg, iostat) or raise timeout",
                    errno_module.ETIMEDOUT,
                )
            )
        for fut in done:
            got, calls = fut.result()
            self.bytes_read += got
            self.reads += calls
        if failed:
            raise failed[-1] if pending else failed[0]
        self.pages_read += npg

    def _check_idle(self) -> None:
        """Refuses to reuse the pool while a timed-out read may still write into it."""
        if self._inflight:
            _, pending = wait_futures(self._inflight, timeout=self.timeout)
            if pending:
                raise DiskReadError(
                    f"{self.paths[0]}: reads from an earlier gather are still in flight after {self.timeout:g} s: "
                    "the drive is stalled; check it (dmesg) and restart the reader",
                    errno_module.ETIMEDOUT,
                )
            self._inflight = []

    def _check_files(self) -> None:
        """The file behind each fd, and the file at each path, are still the ones opened."""
        for i, (fd, path) in enumerate(zip(self._fds, self.paths)):
            dev, ino, size, mtime = self._stats[i]
            st = os.fstat(fd)
            if st.st_size != size:
                raise self._changed(i, f"changed size ({size} -> {st.st_size} bytes)")
            if st.st_mtime_ns != mtime:
                raise self._changed(i, "was modified (mtime changed)")
            try:
                sp = os.stat(path)
            except OSError:
                raise self._changed(i, "was removed or renamed") from None
            if (sp.st_dev, sp.st_ino) != (dev, ino):
                raise self._changed(i, "was replaced (another inode at the path)")

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the workers and closes the files and the pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        stalled = False
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            if self._inflight:  # a timed-out read may still write into the pool: never unmap it under one
                _, pending = wait_futures(self._inflight, timeout=self.timeout)
                stalled = bool(pending)
            self._executor = None
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        if stalled:
            log.warning("%s: closed with reads still in flight; the buffer pool is left mapped", self.paths[0])
            self._pool = None
        if self._pool is not None:
            self._buf = None
            try:
                self._view.release()
                self._pool.close()
            except BufferError:  # a caller still holds a view of it: the mapping goes with that view
                pass
            self._pool = None

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
            f"{self.io_mode})"
        )
