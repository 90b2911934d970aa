"""The disk tier's read engines: what reads a batch of runs into a
:class:`~tableserver.disk.reader.DiskTable`'s page pool. Two classes behind one interface; :func:`open_engine`
picks one per table, once (``io``):

* ``"io_uring"`` (:class:`NativeEngine`): the native engine (:data:`native`, the C extension
  ``tableserver.disk._diskio``): one ring of ``queue_depth`` entries driven by one engine thread, the page
  pool registered once as its fixed buffer (READ_FIXED; plain READ where registering is refused, e.g. by
  RLIMIT_MEMLOCK). A batch is handed over in one call, the GIL released while Python waits for it.
* ``"threads"`` (:class:`NativeEngine`): the native engine with ``queue_depth`` persistent pthreads doing
  ``preadv``, each taking the next run in turn; handed over and waited for the same way.
* ``"python"`` (:class:`PythonEngine`): ``queue_depth`` Python threads over ``os.preadv`` (it releases the
  GIL, but each read costs some GIL and a thread switch). The fallback when the extension is not built.
* ``"auto"``: io_uring where the kernel allows it (not disabled by ``kernel.io_uring_disabled``, a seccomp
  policy or an old kernel), else threads, else python.

Every engine reads the same page plan into the same pool and reports faults the same way (the
:class:`~tableserver.disk.errors.ReadErrors` of its reader).

The interface (both classes): ``name`` (the ``DiskTable.engine`` it is), ``reason`` (``engine_reason``),
``depth``; what came back, counted across the engine's life: ``pages_read`` (pages of batches read whole),
``bytes_read``, ``reads`` (read calls that returned); ``read(runs)`` (a batch, all back on return),
``submit(runs)`` (a batch queued behind the last; its ticket) and ``wait(ticket)`` (that batch all back),
each raising the batch's DiskReadError; ``abandon(tickets, wait_s)`` (after a failed batch: the reads of
those queued behind it stopped, waited for up to ``wait_s``); ``settle()`` (DiskReadError while reads of an
abandoned batch may still write into the pool); ``limit`` and ``throttle(reads)`` (reads in flight now; the
native engines only follow it); ``close(timeout)`` (True: nothing in flight, the pool is the caller's
again); ``leftover`` (what a close with reads in flight leaves mapped besides the pool, for its log line).

Faults, for tests: ``engine.inject(at, code)`` -- every read covering byte ``at`` of any file fails with
errno ``code`` (instead of being issued), or, ``code`` :data:`HOLD`, stays in flight until the fault is
cleared (``code`` 0) or replaced; any other code: ValueError. The same on every engine (the native one's
hook is the extension's, :func:`native_fault`: ValueError once that engine is closed, but for clearing the
fault of one left to its reads). A :class:`~tableserver.disk.reader.DiskTable` shows its engine as
``io_engine``.
"""

from __future__ import annotations

import errno as errno_module
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import NamedTuple

import numpy as np

from tableserver.disk.errors import DiskReadError, ReadErrors

try:
    from tableserver.disk import _diskio as native
except ImportError as e:  # built without a C compiler (setup.py): the Python engine only
    native = None
    NATIVE_MISSING = f"tableserver.disk._diskio not built ({e})"
else:
    NATIVE_MISSING = ""
#: ``native``: the extension module (its ``Engine``, the status codes ``OK``, ``ERROR``, ``SHORT``, ``TIMEOUT``,
#: ``BUSY``), None where it is not built; ``NATIVE_MISSING``: then, why (else "")

#: the values of DiskTable's ``io``
ENGINES = ("auto", "io_uring", "threads", "python")

#: how to get the native engine when it is missing
BUILD_FIX = "reinstall tableserver where a C compiler and Python's headers are present (pip install -e .)"

#: :meth:`inject`'s code that holds the reads in flight (0 clears a fault, an errno fails them)
HOLD = -1


def sysctl(name: str) -> str | None:
    """The value of sysctl ``name`` (dotted), or None where it cannot be read."""
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return None


def uring_unavailable(e: OSError) -> str:
    """One line on why io_uring_setup failed: "io_uring unavailable: EPERM (kernel.io_uring_disabled=2)"."""
    code = e.errno or 0
    name = errno_module.errorcode.get(code, f"errno {code}")
    if code == errno_module.EPERM:
        disabled = sysctl("kernel.io_uring_disabled")
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


def native_fault(core, at: int, code: int) -> None:
    """The fault hook of a bare ``native.Engine`` ``core`` (the extension's, for its tests): see the module;
    ValueError once it is closed (but for clearing the fault of a leaked one)."""
    core._fault(at, code)  # the extension's test hook (module.c names it so that no user calls it)


class Runs(NamedTuple):
    """One batch's reads as handed to an engine (int64 arrays, a run an entry): file index, its fd, pool
    byte, length, file byte, bytes needed (:class:`~tableserver.disk.plan.Reads` with the fds); ``npg``:
    the pages they read."""

    npg: int
    file: np.ndarray
    fd: np.ndarray
    dst: np.ndarray
    len: np.ndarray
    at: np.ndarray
    need: np.ndarray


class NativeEngine:
    """The native engine in ``mode`` ("io_uring" or "threads"): one ``native.Engine`` of ``depth`` reads over
    the pool buffer ``pool``, every wait bounded by ``timeout``. OSError where it cannot start here
    (io_uring_setup's, the threads'). Besides the interface: what the extension says of itself (``fixed``,
    ``ext_arg``, ``note``, ``inflight``, ``queued``)."""

    def __init__(self, mode: str, depth: int, pool, errors: ReadErrors, timeout: float):
        self._core = native.Engine(mode, depth, pool)
        self.name, self.depth, self.reason = mode, self._core.depth, ""
        self.leftover = f" (and the {mode} engine's state with it)"
        self._errors, self._timeout = errors, timeout
        self.pages_read = self.bytes_read = self.reads = 0

    @property
    def fixed(self) -> bool:
        """io_uring: the pool is a registered buffer (READ_FIXED)."""
        return self._core.fixed

    @property
    def ext_arg(self) -> bool:
        """io_uring: waits with IORING_ENTER_EXT_ARG (else poll on the ring fd)."""
        return self._core.ext_arg

    @property
    def note(self) -> str:
        """One line on how it reads."""
        return self._core.note

    @property
    def inflight(self) -> int:
        """Reads in flight now."""
        return self._core.inflight

    @property
    def queued(self) -> int:
        """Batches queued (submitted, not yet waited for or drained)."""
        return self._core.queued

    @property
    def limit(self) -> int:
        """Reads it may keep in flight now (:meth:`throttle`); 0 once closed."""
        return self._core.limit

    def throttle(self, reads: int | None) -> None:
        """At most ``reads`` reads in flight from now on (None: ``depth``); a closed engine ignores it."""
        try:
            self._core.limit = self.depth if reads is None else max(1, min(int(reads), self.depth))
        except ValueError:  # closed meanwhile: nothing left to throttle
            pass

    def refusal(self, r: Runs) -> str | None:
        """Reads ``r`` as a trial (each file's first page): the errno's name where this engine cannot read
        these files (EINVAL, EOPNOTSUPP; it is closed then), else None (any other fault is the gathers')."""
        status, _, detail, _, _ = self._core.read(r.fd, r.at, r.dst, r.len, r.need, self._timeout)
        if status == native.ERROR and detail in (errno_module.EINVAL, errno_module.EOPNOTSUPP):
            self._core.close(self._timeout)
            return errno_module.errorcode[detail]
        return None

    def read(self, r: Runs) -> None:
        self._check(r, self._core.read(r.fd, r.at, r.dst, r.len, r.need, self._timeout))

    def submit(self, r: Runs) -> Runs:
        if r.npg and self._core.submit(r.fd, r.at, r.dst, r.len, r.need, self._timeout):
            raise self._errors.still_in_flight()  # BUSY: an abandoned batch's reads are not back
        return r

    def wait(self, ticket: Runs) -> None:
        if ticket.npg:
            self._check(ticket, self._core.wait(self._timeout))

    def abandon(self, tickets, wait_s: float) -> None:
        if self._core.queued:
            self._core.drain(wait_s)

    def settle(self) -> None:
        if self._core.queued and self._core.drain(self._timeout):
            raise self._errors.still_in_flight()

    def close(self, timeout: float) -> bool:
        return self._core.close(timeout)

    def inject(self, at: int, code: int) -> None:
        """Reads covering file byte ``at`` fail with errno ``code`` (:data:`HOLD`: stay in flight; 0: clear)."""
        native_fault(self._core, at, code)

    def _check(self, r: Runs, result: tuple) -> None:
        """The core's result for the runs ``r``, counted; its faults as the Python engine's."""
        status, run, detail, got, calls = result
        self.bytes_read += got
        self.reads += calls
        if status == native.OK:
            self.pages_read += r.npg
            return
        if status == native.TIMEOUT:
            raise self._errors.timed_out(r.npg)
        if status == native.BUSY:
            raise self._errors.still_in_flight()
        if run < 0:  # the ring itself failed (not one read), or the batch was cut short
            raise DiskReadError(
                f"{self._errors.paths[0]}: the {self.name} engine failed "
                f"({os.strerror(detail) if detail else 'cut'}): open the table with io='threads' and report it",
                detail or None,
            )
        f, where = int(r.file[run]), int(r.at[run])
        if status == native.SHORT:
            raise self._errors.short(f, where, detail, int(r.need[run]))
        raise self._errors.read(f, where, OSError(detail, os.strerror(detail)))


class _Batch(NamedTuple):
    """A batch queued on the Python engine: its workers' futures, its first failure, the stop flag."""

    npg: int
    futures: list
    failed: list
    stop: list


class PythonEngine:
    """``depth`` Python threads over os.preadv of the files ``fds`` (a list, read at each read) into the pool
    ``view`` (a memoryview), every wait bounded by ``timeout``. It keeps its depth (``throttle`` does
    nothing)."""

    name = "python"
    leftover = ""

    def __init__(self, depth: int, fds: list[int], view, errors: ReadErrors, timeout: float):
        self._executor = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="tableserver-disk")
        self.depth, self.reason = depth, ""
        self._fds, self._view, self._errors, self._timeout = fds, view, errors, timeout
        self.pages_read = self.bytes_read = self.reads = 0
        self._inflight: list = []  # workers of an abandoned batch, or one past its timeout, maybe still reading
        self._closed = False
        self._fault: tuple[int, int] | None = None
        self._released = threading.Event()  # cleared while a fault holds reads
        self._released.set()

    @property
    def limit(self) -> int:
        """Its depth; 0 once closed."""
        return 0 if self._closed else self.depth

    def throttle(self, reads: int | None) -> None:
        pass

    def read(self, r: Runs) -> None:
        self.wait(self.submit(r))

    def submit(self, r: Runs) -> _Batch:
        """The runs ``r`` by ``depth`` Python threads over os.preadv (queued behind the last batch's)."""
        jobs = list(zip(r.file.tolist(), r.dst.tolist(), r.len.tolist(), r.at.tolist(), r.need.tolist()))
        counter = itertools.count()
        batch = _Batch(r.npg, [], [], [])
        failed, stop = batch.failed, batch.stop
        view, fds, errors = self._view, self._fds, self._errors
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
                        if self._fault is not None:
                            self._faulted(where + n, where + length)
                        k = os.preadv(fds[f], [view[dst + n : dst + length]], where + n)
                        calls += 1
                        got += k
                        n += k
                        if n >= need or not k or n % 512:
                            break
                except OSError as e:
                    failed.append(errors.read(f, where, e))
                    break
                if n < need:
                    failed.append(errors.short(f, where, n, need))
                    break
            return got, calls

        batch.futures.extend(self._executor.submit(worker) for _ in range(min(self.depth, njobs)))
        return batch

    def wait(self, batch: _Batch) -> None:
        done, pending = wait_futures(batch.futures, timeout=self._timeout)
        if pending:
            self._inflight = list(pending)
            batch.failed.append(self._errors.timed_out(batch.npg))
        for fut in done:
            got, calls = fut.result()
            self.bytes_read += got
            self.reads += calls
        if batch.failed:
            raise batch.failed[-1] if pending else batch.failed[0]
        self.pages_read += batch.npg

    def abandon(self, tickets, wait_s: float) -> None:
        futures = []
        for ticket in tickets:
            ticket.stop.append(True)
            futures += ticket.futures
        if futures:
            _, pending = wait_futures(futures, timeout=wait_s)
            self._inflight += list(pending)

    def settle(self) -> None:
        if self._inflight:
            _, pending = wait_futures(self._inflight, timeout=self._timeout)
            if pending:
                raise self._errors.still_in_flight()
            self._inflight = []

    def close(self, timeout: float) -> bool:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._inflight:  # a timed-out read may still write into the pool
            _, pending = wait_futures(self._inflight, timeout=timeout)
            return not pending
        return True

    def inject(self, at: int, code: int) -> None:
        """Reads covering file byte ``at`` fail with errno ``code`` (:data:`HOLD`: stay in flight; 0: clear)."""
        if not HOLD <= code <= 4095:
            raise ValueError("code: an errno, -1 (hold) or 0 (clear)")
        if code == HOLD:
            self._released.clear()
        self._fault = (at, code) if code else None
        if code != HOLD:
            self._released.set()

    def _faulted(self, lo: int, hi: int) -> None:
        """The injected fault on a read of file bytes [lo, hi): OSError, or held until it is cleared."""
        fault = self._fault
        if fault is None or not lo <= fault[0] < hi:
            return
        if fault[1] != HOLD:
            raise OSError(fault[1], os.strerror(fault[1]))
        self._released.wait()


def open_engine(io: str, depth: int, timeout: float, pool, fds: list[int], probe: Runs, errors: ReadErrors):
    """The engine ``io`` names (``auto``: the best that runs here), its ``reason`` said: reads into ``pool``
    (a :class:`~tableserver.disk.pool.PagePool`) of the files ``fds``; ``probe``: each file's first page, the
    trial read of a native engine. A named engine that cannot run here: DiskReadError saying why and what
    to do."""
    path = errors.paths[0]

    def python(reason: str) -> PythonEngine:
        eng = PythonEngine(depth, fds, pool.view, errors, timeout)
        eng.reason = f"{reason}; {depth} Python threads over os.preadv"
        return eng

    def start(mode: str) -> tuple[NativeEngine | None, str]:
        """The native engine in ``mode``, having read each file's first page; or None and why not."""
        try:
            eng = NativeEngine(mode, depth, pool.map, errors, timeout)
        except OSError as e:
            return None, uring_unavailable(e) if mode == "io_uring" else f"{mode} engine unavailable: {e.strerror or e}"
        refused = eng.refusal(probe)  # this engine cannot read these files (any other fault is the gathers')
        return (None, f"{mode} reads of {path} refused ({refused})") if refused else (eng, "")

    if io == "python":
        return python("io='python'")
    if native is None:
        if io != "auto":
            raise DiskReadError(
                f"{path}: io={io!r} needs the native read engine, but {NATIVE_MISSING}: {BUILD_FIX}, or pass io='python'"
            )
        return python(NATIVE_MISSING)
    fallback = ""
    if io in ("auto", "io_uring"):
        eng, why = start("io_uring")
        if eng is not None:
            eng.reason = (
                f"{'auto: ' if io == 'auto' else ''}ring of {eng.depth}, {eng.note}, "
                f"{'EXT_ARG waits' if eng.ext_arg else 'poll waits'}"
            )
            return eng
        if io == "io_uring":
            raise DiskReadError(
                f"{path}: io='io_uring' cannot run here: {why}: pass io='threads' (or 'auto'), "
                "or allow io_uring (sysctl kernel.io_uring_disabled=0, the container's seccomp profile)"
            )
        fallback = why
    eng, why = start("threads")
    if eng is not None:
        eng.reason = f"{fallback + '; ' if fallback else ''}{eng.note}"
        return eng
    if io == "threads":
        raise DiskReadError(f"{path}: io='threads' cannot run here: {why}: pass io='python' (or 'auto')")
    return python(f"{fallback + '; ' if fallback else ''}{why}")
