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
once per table and kept for its life:

* ``"io_uring"``: the native engine (``tableserver.disk._diskio``, a C extension): one ring of ``queue_depth``
  entries driven by one engine thread, the page pool registered once as its fixed buffer (READ_FIXED;
  plain READ where registering is refused, e.g. by RLIMIT_MEMLOCK). A batch is handed over in one call,
  the GIL released while Python waits for it.
* ``"threads"``: the native engine with ``queue_depth`` persistent pthreads doing ``preadv``, each taking
  the next run in turn; handed over and waited for the same way.
* ``"python"``: ``queue_depth`` Python threads over ``os.preadv`` (it releases the GIL, but each read
  costs some GIL and a thread switch). The fallback when the extension is not built.
* ``"auto"`` (the default): io_uring where the kernel allows it (not disabled by
  ``kernel.io_uring_disabled``, a seccomp policy or an old kernel), else threads, else python.

Every engine reads the same page plan into the same pool and reports faults the same way.

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
import itertools
import logging
import mmap
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import NamedTuple

import numpy as np

from tableserver.common.guard import OutputGuard
from tableserver.common.take import in_range
from tableserver.disk.fileid import FileIdentity
from tableserver.disk.plan import Layout, batches_of, pages_of, reads_of
from tableserver.errors import TableFileError

try:
    from tableserver.disk import _diskio
except ImportError as e:  # built without a C compiler (setup.py): the Python engine only
    _diskio = None
    _NATIVE_MISSING = f"tableserver.disk._diskio not built ({e})"
else:
    _NATIVE_MISSING = ""

log = logging.getLogger(__name__)


#: pool pages per queue slot by default: a batch of only ``queue_depth`` pages would drain the drive's
#: queue to zero at every batch boundary
POOL_PAGES_PER_SLOT = 16

#: the default pool's floor, in bytes: at a small queue depth, batches of a few pages would cost more in
#: Python (planning and copying out each one) than their reads take
POOL_MIN_BYTES = 1 << 20

#: the values of DiskTable's ``io``
ENGINES = ("auto", "io_uring", "threads", "python")

#: how to get the native engine when it is missing
_BUILD_FIX = "reinstall tableserver where a C compiler and Python's headers are present (pip install -e .)"


class DiskReadError(TableFileError):
    """A disk table's read failed (EIO, a short read, a file changed or replaced under the reader, or a
    read past the timeout). One line naming the file, the offset and the fix; ``errno`` is the OS error
    number where one caused it."""


class _Unguarded:
    """The guard of a gather nobody cancels."""

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass


_UNGUARDED = _Unguarded()


def _sysctl(name: str) -> str | None:
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return None


def _uring_unavailable(e: OSError) -> str:
    """One line on why io_uring_setup failed: "io_uring unavailable: EPERM (kernel.io_uring_disabled=2)"."""
    code = e.errno or 0
    name = errno_module.errorcode.get(code, f"errno {code}")
    if code == errno_module.EPERM:
        disabled = _sysctl("kernel.io_uring_disabled")
        if disabled not in (None, "0"):
            why = f"kernel.io_uring_disabled={disabled}"
        else:
            why = "a seccomp or container policy forbids it"
    elif code == errno_module.ENOSYS:
        why = "the kernel has no io_uring, or a seccomp policy hides it"
    elif code == errno_module.ENOMEM:
        why = "RLIMIT_MEMLOCK (ulimit -l) too low for the ring on this kernel"
    else:
        why = e.strerror or str(e)
    return f"io_uring unavailable: {name} ({why})"


class _Runs(NamedTuple):
    """One batch's reads as handed to an engine (int64 arrays, a run an entry): file index, its fd, pool
    byte, length, file byte, bytes needed (:class:`~tableserver.disk.plan.Reads` with the fds)."""

    npg: int
    file: np.ndarray
    fd: np.ndarray
    dst: np.ndarray
    len: np.ndarray
    at: np.ndarray
    need: np.ndarray


class _PyBatch(NamedTuple):
    """A batch queued on the Python engine: its workers' futures, its first failure, the stop flag."""

    npg: int
    futures: list
    failed: list
    stop: list


class DiskTable:
    """A table of ``rows`` rows of ``row_bytes`` bytes read page by page from ``paths`` (one path, or a
    list of stripe files, or a block device: see the module's layout).

    ``page``: the read unit (a multiple of 512, the offsets O_DIRECT needs); ``stripe``: the stripe unit
    in bytes, required with several files (a multiple of ``page``); ``queue_depth``: reads in flight;
    ``pool_pages``: the buffer pool, in pages (default ``16 * queue_depth``, at least 1 MiB); ``direct``:
    try O_DIRECT; ``timeout``: seconds any wait may take; ``io``: the read engine, ``"auto"``, ``"io_uring"``,
    ``"threads"`` or ``"python"`` (see the module; a named engine that cannot run here raises
    :class:`DiskReadError` saying why and what to do). ``engine`` is the one that runs, ``engine_reason``
    one line on why. ``expect``: the :class:`FileIdentity` each file must still have (None entries: any),
    e.g. the one its header was read from; another file, or one written since, is refused.

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
        self.offset, self.rows, self.row_bytes, self.page = int(offset), int(rows), int(row_bytes), int(page)
        self.stripe, self.queue_depth, self.timeout = int(stripe), int(queue_depth), float(timeout)
        self.nbytes = self.rows * self.row_bytes
        #: page-aligned layout: ``rows_per_page`` rows at the start of each page (0: rows back to back);
        #: ``row_base``: the table row this reader's row 0 is (a shard of a page-aligned table)
        self.rows_per_page, self.row_base = int(rows_per_page), int(row_base)
        if self.rows_per_page < 0 or self.rows_per_page * self.row_bytes > self.page or self.row_base < 0:
            raise ValueError(
                f"rows_per_page={rows_per_page} row_base={row_base}: a page of {self.page} B holds at most "
                f"{self.page // self.row_bytes} rows of {self.row_bytes} B, and row_base must be >= 0"
            )
        if self.row_base and not self.rows_per_page:
            raise ValueError("row_base is for page-aligned tables: add row_base * row_bytes to offset instead")
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
        self.pages_read = 0
        self.bytes_read = 0
        self.reads = 0  # read calls (preadv calls, or io_uring reads) that returned
        self.gathers = 0
        self.direct = bool(direct)
        self.io_mode = "O_DIRECT" if direct else "buffered (direct=False)"
        self.engine = "none"
        self.engine_reason = "not started"
        self._fds: list[int] = []
        self._fd_of = np.zeros(0, np.int64)
        self._ids: list[FileIdentity] = []  # each file as opened
        self._pool = None
        self._rows_view = None
        self._executor = None
        self._engine = None
        self._inflight: list = []
        self._lock = threading.Lock()
        self._closed = False
        self._freed = False
        try:
            self._need = self.layout.file_needs()
            self._need_arr = np.asarray(self._need, np.int64)
            self._open_files(direct, expect)
            self._pool = mmap.mmap(-1, self.pool_pages * self.page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._buf = np.frombuffer(self._pool, np.uint8)
            self._view = memoryview(self._pool)
            if self.direct:
                self._probe()
            self._fd_of = np.asarray(self._fds, np.int64)
            self._start_engine(io)
        except BaseException:
            self.close()
            raise
        log.info(
            "%s: disk reads by the %s engine (%s), %s, queue depth %d",
            self.paths[0],
            self.engine,
            self.engine_reason,
            self.io_mode,
            self.queue_depth,
        )

    # -- opening ---------------------------------------------------------------------------------

    def _open_files(self, direct: bool, expect) -> None:
        expect = list(expect) if expect is not None else [None] * len(self.paths)
        if len(expect) != len(self.paths):
            raise ValueError(f"expect names {len(expect)} files, the reader has {len(self.paths)}")
        for path, need, want in zip(self.paths, self._need, expect):
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
            ident = FileIdentity.of(fd)
            why = want.change_at(fd, path) if want is not None else None
            if why is not None:
                raise DiskReadError(
                    f"{path}: the table file {why} since it was first opened (a re-pack or copy during start-up?): "
                    "restart once the file is final"
                )
            if ident.size < need:
                raise DiskReadError(
                    f"{path}: truncated disk table file: {ident.size} bytes, the table needs {need} "
                    f"(offset {self.offset}, {self.rows} rows of {self.row_bytes} B): re-copy or re-pack it"
                )
            self._ids.append(ident)

    def _go_buffered(self, reason: str) -> None:
        if self.direct:
            log.warning("%s; reading buffered (the page cache will hold the pages read)", reason)
        self.direct = False
        self.io_mode = f"buffered ({reason})"

    def _probe(self) -> None:
        """One O_DIRECT read of the table's first page per file; EINVAL (an alignment the device does not
        take) switches every file to buffered reads."""
        for i, fd in enumerate(self._fds):
            at = self._probe_at(i)
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
                why = self._ids[i].change(FileIdentity.of(self._fds[i]))
                if why is not None:
                    raise self._changed(i, why + " while opening")

    def _probe_at(self, i: int) -> int:
        return self.offset // self.page * self.page if len(self._fds) == 1 else 0

    def _start_engine(self, io: str) -> None:
        """Starts the engine ``io`` names (``auto``: the best that runs here); sets engine, engine_reason."""
        if io == "python":
            return self._start_python("io='python'")
        if _diskio is None:
            if io != "auto":
                raise DiskReadError(
                    f"{self.paths[0]}: io={io!r} needs the native read engine, but {_NATIVE_MISSING}: "
                    f"{_BUILD_FIX}, or pass io='python'"
                )
            return self._start_python(_NATIVE_MISSING)
        fallback = ""
        if io in ("auto", "io_uring"):
            why = self._start_native("io_uring")
            if why is None:
                ring = self._engine
                self.engine_reason = (
                    f"{'auto: ' if io == 'auto' else ''}ring of {ring.depth}, {ring.note}, "
                    f"{'EXT_ARG waits' if ring.ext_arg else 'poll waits'}"
                )
                return
            if io == "io_uring":
                raise DiskReadError(
                    f"{self.paths[0]}: io='io_uring' cannot run here: {why}: pass io='threads' (or 'auto'), "
                    "or allow io_uring (sysctl kernel.io_uring_disabled=0, the container's seccomp profile)"
                )
            fallback = why
        why = self._start_native("threads")
        if why is None:
            self.engine_reason = f"{fallback + '; ' if fallback else ''}{self._engine.note}"
            return
        if io == "threads":
            raise DiskReadError(f"{self.paths[0]}: io='threads' cannot run here: {why}: pass io='python' (or 'auto')")
        self._start_python(f"{fallback + '; ' if fallback else ''}{why}")

    def _start_native(self, mode: str) -> str | None:
        """Starts the native engine in ``mode`` and reads each file's first page through it: None, or why not."""
        try:
            eng = _diskio.Engine(mode, self.queue_depth, self._pool)
        except OSError as e:
            if mode == "io_uring":
                return _uring_unavailable(e)
            return f"{mode} engine unavailable: {e.strerror or e}"
        at = np.asarray([self._probe_at(i) for i in range(len(self._fds))], np.int64)
        length = np.full(len(at), self.page, np.int64)
        need = np.minimum(length, self._need_arr - at)
        status, _, detail, _, _ = eng.read(self._fd_of, at, np.zeros(len(at), np.int64), length, need, self.timeout)
        if status == _diskio.ERROR and detail in (errno_module.EINVAL, errno_module.EOPNOTSUPP):
            eng.close(self.timeout)  # this engine cannot read these files (any other fault is the gathers' to report)
            return f"{mode} reads of {self.paths[0]} refused ({errno_module.errorcode[detail]})"
        self._engine, self.engine = eng, mode
        return None

    def _start_python(self, reason: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="tableserver-disk")
        self.engine, self.engine_reason = "python", f"{reason}; {self.queue_depth} Python threads over os.preadv"

    # -- errors ----------------------------------------------------------------------------------

    def _error(self, i: int, at: int, e: OSError) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[i]}: read error at byte {at} ({e.strerror or e}): the drive or file is failing; "
            "check the kernel log (dmesg) and re-copy the table to a healthy drive",
            e.errno,
        )

    def _short(self, i: int, at: int, got: int, need: int) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[i]}: short read at byte {at}: {got} of {need} bytes (the file "
            "shrank or was truncated since it was opened): re-copy the table and restart the reader"
        )

    def _timed_out(self, npg: int) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[0]}: reads of {npg} pages took over {self.timeout:g} s: the drive is stalled or "
            "overloaded; check it (dmesg, iostat) or raise timeout",
            errno_module.ETIMEDOUT,
        )

    def _still_in_flight(self) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[0]}: reads from an earlier gather are still in flight after {self.timeout:g} s: "
            "the drive is stalled; check it (dmesg) and restart the reader",
            errno_module.ETIMEDOUT,
        )

    def _changed(self, i: int, what: str) -> DiskReadError:
        return DiskReadError(
            f"{self.paths[i]}: disk table file {what} since it was opened: rows read now may be wrong; "
            "never write a served table in place -- restart the reader (or daemon) on the new file"
        )

    # -- gathering -------------------------------------------------------------------------------

    def twin(self, pool_pages: int | None = None) -> DiskTable:
        """Another reader of the same files (checked to be the very ones this one has open), with the same
        geometry, engine and reads in flight, and a pool of its own (``pool_pages``, default as this one's)."""
        return DiskTable(
            self.paths, self.offset, self.rows, self.row_bytes, page=self.page, stripe=self.stripe or None,
            queue_depth=self.queue_depth, direct=self.direct, pool_pages=pool_pages, timeout=self.timeout,
            io=self.engine if self.engine in ENGINES else "auto", rows_per_page=self.rows_per_page,
            row_base=self.row_base, expect=self._ids,
        )  # fmt: skip

    def throttle(self, reads: int | None) -> None:
        """Lets the reader keep at most ``reads`` reads in flight from now on (None: ``queue_depth`` again);
        callable from any thread, during a gather too: the reads already at the drive finish, no new one
        starts past the limit. The native engines only (the python engine keeps its depth); a closed reader
        ignores it."""
        eng = self._engine
        if eng is None:
            return
        try:
            eng.limit = self.queue_depth if reads is None else max(1, min(int(reads), self.queue_depth))
        except ValueError:  # closed meanwhile: nothing left to throttle
            pass

    @property
    def read_limit(self) -> int:
        """Reads the reader may keep in flight now (:meth:`throttle`); 0 once closed."""
        eng = self._engine
        if eng is None:
            return 0 if self._closed else self.queue_depth
        return eng.limit

    @property
    def identities(self) -> tuple[FileIdentity, ...]:
        """Each file's identity as opened (pass it as another reader's ``expect``)."""
        return tuple(self._ids)

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
            self._check_idle()
            self._gather(flat.astype(np.int64, copy=False), out.reshape(-1, self.row_bytes), guard or _UNGUARDED)
            self._check_files()
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
            change = self._first_change()
        return (self.paths[change[0]], change[1]) if change is not None else None

    def _first_change(self) -> tuple[int, str] | None:
        """(file index, how) of the first file changed or replaced since it was opened."""
        for i, (fd, path, opened) in enumerate(zip(self._fds, self.paths, self._ids)):
            why = opened.change_at(fd, path)
            if why is not None:
                return i, why
        return None

    def _gather(self, ids: np.ndarray, out2: np.ndarray, guard) -> None:
        page, rb = self.page, self.row_bytes
        plan = pages_of(self.layout, ids)
        pages, fslot, within = plan.pages, plan.first, plan.within
        if len(pages) <= self._batch:  # one batch: rows straight into out, in their own order
            self._read_now(pages, 0, len(pages))
            with guard:
                self._copy_rows(fslot * page + within, out2)
            return
        # Batches of first pages, read into the two halves of the pool in turn: the next batch is read while
        # the rows of one are copied out (a pool too small to halve holds one batch at a time)
        nreg, region, plans = batches_of(plan, self.pool_pages, self._batch, self._span)
        queued: deque = deque()
        try:
            for k in range(min(nreg, len(plans))):
                queued.append(self._submit(pages, *plans[k][1:], base=(k % nreg) * region))
            for k, (sel, lo, _, _) in enumerate(plans):
                self._wait(queued.popleft())
                base = (k % nreg) * region
                part = np.empty((sel.size, rb), np.uint8)
                self._copy_rows((base + fslot[sel] - lo) * page + within[sel], part)
                with guard:
                    out2[sel] = part
                if k + 1 < len(plans) and plans[k + 1][3]:
                    # the next batch's first pages are this one's last (straddling rows): moved, not reread
                    keep, src = plans[k + 1][3], (base + plans[k + 1][1] - lo) * page
                    dst = ((k + 1) % nreg) * region * page
                    self._buf[dst : dst + keep * page] = self._buf[src : src + keep * page]
                if k + nreg < len(plans):
                    queued.append(self._submit(pages, *plans[k + nreg][1:], base=((k + nreg) % nreg) * region))
        except BaseException as e:
            self._abandon(queued, stalled=getattr(e, "errno", None) == errno_module.ETIMEDOUT)
            raise

    def _copy_rows(self, pos: np.ndarray, out2: np.ndarray) -> None:
        """Rows at byte positions ``pos`` of the pool into ``out2`` (one gather over a view of overlapping rows)."""
        if self._rows_view is None:
            buf = self._buf
            n = buf.size - self.row_bytes + 1
            self._rows_view = np.lib.stride_tricks.as_strided(
                buf, shape=(n, self.row_bytes), strides=(1, 1), writeable=False
            )
        # fancy indexing, not np.take: take makes a non-contiguous source C-contiguous first, i.e. copies
        # row_bytes times the pool
        out2[...] = self._rows_view[pos]

    def _runs(self, pages: np.ndarray, lo: int, hi: int, keep: int, base: int) -> _Runs:
        """The reads of pages ``pages[lo+keep:hi]`` into pool pages base+keep.. (the first ``keep`` are there
        already): :func:`~tableserver.disk.plan.reads_of`, with each read's fd."""
        r = reads_of(self.layout, pages[lo + keep : hi], base + keep, self._need_arr)
        return _Runs(r.pages, r.file, self._fd_of[r.file], r.dst, r.len, r.at, r.need)

    # -- the engines -----------------------------------------------------------------------------

    def _read_now(self, pages: np.ndarray, lo: int, hi: int) -> None:
        """Pages ``pages[lo:hi]`` into pool pages 0..hi-lo-1, all back on return."""
        r = self._runs(pages, lo, hi, 0, 0)
        if not r.npg:
            return
        if self._engine is None:
            return self._wait(self._submit_python(r))
        self._check_result(r, self._engine.read(r.fd, r.at, r.dst, r.len, r.need, self.timeout))

    def _submit(self, pages: np.ndarray, lo: int, hi: int, keep: int, base: int):
        """Queues the reads of one batch (see _runs); its ticket for :meth:`_wait`."""
        r = self._runs(pages, lo, hi, keep, base)
        if self._engine is None:
            return self._submit_python(r)
        if r.npg and self._engine.submit(r.fd, r.at, r.dst, r.len, r.need, self.timeout):
            raise self._still_in_flight()  # BUSY: an abandoned batch's reads are not back
        return r

    def _wait(self, ticket) -> None:
        """A batch's reads all back, or its DiskReadError."""
        if isinstance(ticket, _PyBatch):
            return self._wait_python(ticket)
        if ticket.npg:
            self._check_result(ticket, self._engine.wait(self.timeout))

    def _check_result(self, r: _Runs, result: tuple) -> None:
        """The native engine's result for the runs ``r``, faults mapped as the Python engine's."""
        status, run, detail, got, calls = result
        self.bytes_read += got
        self.reads += calls
        if status == _diskio.OK:
            self.pages_read += r.npg
            return
        if status == _diskio.TIMEOUT:
            raise self._timed_out(r.npg)
        if status == _diskio.BUSY:
            raise self._still_in_flight()
        if run < 0:  # the ring itself failed (not one read), or the batch was cut short
            raise DiskReadError(
                f"{self.paths[0]}: the {self.engine} engine failed ({os.strerror(detail) if detail else 'cut'}): "
                "open the table with io='threads' and report it",
                detail or None,
            )
        f, where = int(r.file[run]), int(r.at[run])
        if status == _diskio.SHORT:
            raise self._short(f, where, detail, int(r.need[run]))
        raise self._error(f, where, OSError(detail, os.strerror(detail)))

    def _abandon(self, queued, stalled: bool) -> None:
        """After a failed batch: the reads of those queued behind it, stopped and reaped, waiting up to timeout
        (not at all when ``stalled``, a timeout's aftermath); reads not back poison the pool."""
        wait_s = 0.0 if stalled else self.timeout
        if self._engine is not None:
            if self._engine.queued:
                self._engine.drain(wait_s)
            return
        futures = []
        for ticket in queued:
            ticket.stop.append(True)
            futures += ticket.futures
        if futures:
            _, pending = wait_futures(futures, timeout=wait_s)
            self._inflight += list(pending)

    def _submit_python(self, r: _Runs) -> _PyBatch:
        """The runs ``r`` by ``queue_depth`` Python threads over os.preadv (queued behind the last batch's)."""
        jobs = list(zip(r.file.tolist(), r.dst.tolist(), r.len.tolist(), r.at.tolist(), r.need.tolist()))
        counter = itertools.count()
        batch = _PyBatch(r.npg, [], [], [])
        failed, stop = batch.failed, batch.stop
        view, fds = self._view, self._fds
        njobs = len(jobs)

        def worker() -> tuple[int, int]:
            got = calls = 0
            while not failed and not stop:
                j = next(counter)
                if j >= njobs:
                    break
                f, dst, length, where, need = jobs[j]
                n = 0
                try:
                    while True:  # a read cut short at a 512-byte boundary goes on (as the native engine's)
                        k = os.preadv(fds[f], [view[dst + n : dst + length]], where + n)
                        calls += 1
                        got += k
                        n += k
                        if n >= need or not k or n % 512:
                            break
                except OSError as e:
                    failed.append(self._error(f, where, e))
                    break
                if n < need:
                    failed.append(self._short(f, where, n, need))
                    break
            return got, calls

        batch.futures.extend(self._executor.submit(worker) for _ in range(min(self.queue_depth, njobs)))
        return batch

    def _wait_python(self, batch: _PyBatch) -> None:
        done, pending = wait_futures(batch.futures, timeout=self.timeout)
        if pending:
            self._inflight = list(pending)
            batch.failed.append(self._timed_out(batch.npg))
        for fut in done:
            got, calls = fut.result()
            self.bytes_read += got
            self.reads += calls
        if batch.failed:
            raise batch.failed[-1] if pending else batch.failed[0]
        self.pages_read += batch.npg

    def _check_idle(self) -> None:
        """Refuses to reuse the pool while a timed-out read may still write into it."""
        if self._engine is not None:
            if self._engine.queued and self._engine.drain(self.timeout):
                raise self._still_in_flight()
            return
        if self._inflight:
            _, pending = wait_futures(self._inflight, timeout=self.timeout)
            if pending:
                raise self._still_in_flight()
            self._inflight = []

    def _check_files(self) -> None:
        """The file behind each fd, and the file at each path, are still the ones opened, unchanged (a
        block device: the same device, of the same size; its node's times mean nothing)."""
        change = self._first_change()
        if change is not None:
            raise self._changed(*change)

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
        stalled = False
        if self._engine is not None:
            stalled = not self._engine.close(self.timeout)
            self._engine = None
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
            log.warning(
                "%s: closed with reads still in flight; the buffer pool is left mapped%s",
                self.paths[0],
                "" if self.engine == "python" else f" (and the {self.engine} engine's state with it)",
            )
            self._pool = None
        self._rows_view = None
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
            f"{self.io_mode}, engine={self.engine})"
        )
