"""A short randomized run of each C extension, for the sanitizer job (tests/sanitize/run.py, ``make sanitize``).

Run by run.py in the sanitized copy of the tree with libasan/libubsan preloaded; it refuses to run
against any other build (``--expect-dir``: every extension must be imported from there, and be
instrumented). What it does, each part seeded (``--seed``) and bounded by ``--iterations``:

* ``tableserver.disk._diskio.Engine``: six threads submitting, reading, waiting, draining, injecting faults
  and reading every getter while the main thread (and now and then one of the six) closes the engine,
  then going on calling it after close; each mode the machine runs, a fresh engine an iteration. Every
  read() that returns OK is checked byte for byte, and a close() that returned True must leave the
  engine not leaked. Then ``DiskTable``: gathers from six threads while the main thread closes it,
  every gather that returns checked against the file.
* ``tableserver.common._take``: take/check/unique over random tables, shapes and ids (out of range,
  negative, extreme), buffers it must refuse (dtype, shape, contiguity, alignment, overlap, read-only),
  each result checked against numpy; and big gathers (GIL released) while another thread rewrites the
  ids under them (each id is clamped at use: never a read outside the table).
* ``tableclient.graph._flags.wait_u32``: waiters on random flags while other threads set them, and the
  arguments it must refuse (index, value, timeout, dtype, alignment, read-only, empty).
* ``tableclient.graph.poller._native.Poller``: steps armed, published, released and checked against the table, with
  resets, sources swapped and closes from other threads while its thread gathers; replays nobody armed;
  ids outside the table; the arguments it must refuse.

A sanitizer report aborts the process (run.py's options); any other failure exits 1 with one line per
failure. Exit 0: nothing found.
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import random
import socket
import sys
import tempfile
import threading
import time

import numpy as np

PAGE = 4096
FILE_PAGES = 64
THREADS = 6
failures: list[str] = []
#: what the diskio run did, so that a clean run shows it exercised something
counts: dict[str, int] = {}


def count(what: str) -> None:
    counts[what] = counts.get(what, 0) + 1


def fail(what: str) -> None:
    failures.append(what)
    print(f"FAIL: {what}", file=sys.stderr, flush=True)


def check_imports(expect_dir: str | None) -> None:
    """Every extension imported from the sanitized build, and instrumented (RuntimeError otherwise): else a
    clean run proves nothing."""
    import importlib

    from tableserver.disk import engines

    if engines.native is None:
        raise RuntimeError(engines.NATIVE_MISSING)
    names = ("tableserver.common._take", "tableclient.graph._flags", "tableclient.graph.poller._native")
    for mod in (engines.native, *map(importlib.import_module, names)):
        path = os.path.realpath(mod.__file__)
        if expect_dir is not None and not path.startswith(os.path.realpath(expect_dir) + os.sep):
            raise RuntimeError(f"{mod.__name__} imported from {path}, not from the sanitized build in {expect_dir}")
        with open(path, "rb") as f:
            image = f.read()
        if b"__asan_" not in image or b"__ubsan_handle" not in image:
            raise RuntimeError(f"{path} is not built with -fsanitize=address,undefined")
    with open("/proc/self/maps") as f:
        if "libasan" not in f.read():
            raise RuntimeError("libasan is not loaded: run through tests/sanitize/run.py (LD_PRELOAD)")


# -- _diskio ---------------------------------------------------------------------------------------------


def engine_modes() -> list[str]:
    from tableserver.disk import engines

    modes = []
    for mode in ("io_uring", "threads"):
        try:
            engines.native.Engine(mode, 1, bytearray(PAGE)).close()
            modes.append(mode)
        except OSError as e:
            print(f"diskio: {mode} cannot run here ({e}): skipped", flush=True)
    return modes


GETTERS = ("mode", "depth", "limit", "fixed", "ext_arg", "note", "inflight", "queued", "closed", "leaked")


def read_getters(eng) -> None:
    for name in GETTERS:
        getattr(eng, name)


def engine_iteration(mode: str, fd: int, data: np.ndarray, rng: random.Random) -> None:
    from tableserver.disk import engines

    slots = 4  # pool pages per thread: each thread reads into its own, so its OK reads can be checked
    pool = mmap.mmap(-1, (THREADS + 1) * slots * PAGE)
    view = np.frombuffer(pool, np.uint8)
    eng = engines.native.Engine(mode, rng.randint(1, 8), pool)
    stop = threading.Event()
    closes: list[bool] = []
    start = threading.Barrier(THREADS + 1)

    def batch(r: random.Random, k: int, bad: bool):
        n = r.randint(1, slots)
        pages = [r.randrange(FILE_PAGES) for _ in range(n)]
        fds = np.full(n, fd, np.int64)
        at = np.array(pages, np.int64) * PAGE
        dst = (k * slots + np.arange(n, dtype=np.int64)) * PAGE
        length = np.full(n, PAGE, np.int64)
        need = length.copy()
        if bad:  # a refusal (past the pool, negative), a read error (no such fd) or a short read (past EOF)
            which = r.randrange(4)
            if which == 0:
                dst[-1] = len(pool)
            elif which == 1:
                at[0] = -1
            elif which == 2:
                fds[0] = 1 << 20
            else:
                at[-1] = FILE_PAGES * PAGE - 100
        return pages, (fds, at, dst, length, need)

    def worker(k: int, seed: float) -> None:
        r = random.Random(seed)
        start.wait()
        after = 0
        while after < 20:  # and 20 calls after close
            if stop.is_set():
                after += 1
            op = r.random()
            try:
                if op < 0.25:
                    pages, b = batch(r, k, r.random() < 0.1)
                    res = eng.read(*b, r.choice((0.0, 0.01, 1.0)))
                    count(f"read {res[0]}")
                    if res[0] == engines.native.OK:
                        got = view[k * slots * PAGE : (k * slots + len(pages)) * PAGE].reshape(-1, PAGE)
                        want = np.stack([data[p * PAGE : (p + 1) * PAGE] for p in pages])
                        if not np.array_equal(got, want):
                            fail(f"diskio {mode}: read() returned OK with other bytes than the file's")
                elif op < 0.40:
                    count(f"submit {eng.submit(*batch(r, k, r.random() < 0.1)[1], r.choice((0.0, 0.01)))}")
                elif op < 0.50:
                    count(f"wait {eng.wait(r.choice((0.0, 0.001, 0.05)))[0]}")
                elif op < 0.53:
                    eng.drain(r.choice((0.0, 0.01)))
                elif op < 0.55:
                    eng.limit = r.randint(1, 8)  # past the depth: ValueError
                    count("limit set")
                elif op < 0.60:
                    code = r.choice((errno.EIO, errno.EIO, 0, 0, -1))
                    engines.native_fault(eng, r.randrange(FILE_PAGES) * PAGE, code)
                    if code == -1:
                        time.sleep(0.001)
                        engines.native_fault(eng, 0, 0)
                elif op < 0.602:
                    closes.append(eng.close(r.choice((0.0, 0.01))))
                else:
                    read_getters(eng)
                    count("getters" if not eng.closed else "getters after close")
            except (ValueError, RuntimeError) as e:
                count(f"{type(e).__name__}: {str(e).split(':')[0][:30]}")
                # closed, in use by another thread, queue full/not empty, a run that does not fit
            time.sleep(0 if r.random() < 0.7 else 0.0005)

    threads = [threading.Thread(target=worker, args=(k, rng.random())) for k in range(THREADS)]
    for t in threads:
        t.start()
    start.wait()
    time.sleep(rng.choice((0.0, 0.001, 0.005, 0.02)))
    closes.append(eng.close(rng.choice((0.0, 0.0, 0.02, 0.2))))
    read_getters(eng)
    stop.set()
    for t in threads:
        t.join(60)
        if t.is_alive():
            fail(f"diskio {mode}: a thread still in a call 60 s after close")
            return
    try:
        engines.native_fault(eng, 0, 0)  # a held read of a leaked engine goes on (and its thread ends)
    except ValueError:
        pass
    if not eng.closed or eng.mode != "closed":
        fail(f"diskio {mode}: closed={eng.closed} mode={eng.mode!r} after close()")
    if any(closes) and eng.leaked:
        fail(f"diskio {mode}: close() returned True but the engine is leaked")
    count("engine leaked" if eng.leaked else "engine freed")
    count("closed by more than one thread" if len(closes) > 1 else "closed by the main thread only")
    read_getters(eng)
    view = None  # noqa: F841 -- the worker threads' view, let go of (they have ended)
    if not eng.leaked:
        pool.close()  # the engine let go of its buffer


def disktable_iteration(path: str, data: np.ndarray, rng: random.Random, io: str) -> None:
    from tableserver.disk.reader import DiskTable

    row_bytes = 264
    rows = len(data) // row_bytes
    table = data[: rows * row_bytes].reshape(rows, row_bytes)
    t = DiskTable(path, 0, rows, row_bytes, queue_depth=rng.randint(1, 8), pool_pages=8, io=io, timeout=2.0)
    start = threading.Barrier(THREADS + 1)

    def worker(seed: int) -> None:
        r = np.random.default_rng(seed)
        start.wait()
        for _ in range(30):
            ids = r.integers(0, rows, int(r.integers(1, 200)))
            try:
                got = t.gather(ids)
            except Exception:  # noqa: BLE001 -- closed under it: any refusal will do, a wrong row will not
                continue
            if not np.array_equal(got, table[ids]):
                fail(f"DiskTable io={io}: a gather racing close() returned other rows than the file's")

    threads = [threading.Thread(target=worker, args=(rng.randrange(1 << 30),)) for _ in range(THREADS)]
    for th in threads:
        th.start()
    start.wait()
    time.sleep(rng.choice((0.0, 0.002, 0.01)))
    t.close()
    for th in threads:
        th.join(60)
        if th.is_alive():
            fail(f"DiskTable io={io}: a gather still running 60 s after close")


def stress_diskio(iterations: int, seed: int) -> None:
    rng = random.Random(seed)
    data = np.random.default_rng(seed).integers(0, 256, FILE_PAGES * PAGE, dtype=np.uint8)
    with tempfile.NamedTemporaryFile(prefix="sanitize-diskio-") as f:
        f.write(data.tobytes())
        f.flush()
        modes = engine_modes()
        t0 = time.monotonic()
        for mode in modes:
            for _ in range(iterations):
                engine_iteration(mode, f.fileno(), data, rng)
        n = max(iterations // 4, 1)
        for io in modes:
            for _ in range(n):
                disktable_iteration(f.name, data, rng, io)
        print("diskio:", ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
        print(
            f"diskio: {iterations} engine iterations and {n} DiskTable iterations each for {', '.join(modes)}"
            f" in {time.monotonic() - t0:.1f} s",
            flush=True,
        )


# -- _take -----------------------------------------------------------------------------------------------


def random_ids(r: np.random.Generator, rows: int, shape) -> np.ndarray:
    ids = r.integers(0, max(rows, 1), shape, dtype=np.int64)
    if ids.size and r.random() < 0.3:  # out of range, negative, extreme
        bad = r.choice(np.array([rows, rows + 1, -1, -(1 << 63), (1 << 63) - 1], np.int64))
        ids.reshape(-1)[r.integers(0, ids.size)] = bad
    return ids


def random_shape(r: np.random.Generator) -> tuple:
    return tuple(int(x) for x in r.integers(0, 6, int(r.integers(0, 4))))


def take_one(r: np.random.Generator) -> None:
    from tableserver.common import _take

    rows = int(r.integers(0, 300))
    row_bytes = int(r.integers(1, 300))
    table = r.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    shape = random_shape(r)
    ids = random_ids(r, rows, shape)
    out = np.full(shape + (row_bytes,), 7, np.uint8)
    valid = ids.size == 0 or (rows > 0 and ids.min() >= 0 and ids.max() < rows)
    got = _take.take(table, ids, out)
    if valid:
        if got != ids.size or not np.array_equal(out, table[ids]):
            fail(f"take: rows {rows} x {row_bytes}, ids {shape}: wrong copy ({got})")
    else:
        flat = ids.reshape(-1)
        if got >= 0 or 0 <= flat[-1 - got] < rows or (out != 7).any():
            fail(f"take: rows {rows}, a bad id not reported or rows copied ({got})")
    pos = _take.check(ids, rows)
    if (pos < 0) != valid:
        fail(f"check: rows {rows}: {pos} for ids valid={valid}")
    refused = [  # each must raise TypeError or ValueError, copying nothing
        (table, ids.astype(np.int32), out),
        (table, ids.astype(np.float64), out),
        (table, ids, out.astype(np.int16)),
        (table, ids, np.empty(shape + (row_bytes + 1,), np.uint8)),
        (table.reshape(-1), ids, out),
        (table[:, :0] if row_bytes else table, ids, np.empty(shape + (0,), np.uint8)),
        (np.zeros((rows, row_bytes), np.int16), ids, out),
    ]
    if ids.ndim and out.size:
        refused.append((table, ids, out.reshape(-1)))
    if ids.size and table.size >= out.size:
        refused.append((table, ids, table.reshape(-1)[: out.size].reshape(out.shape)))  # out overlaps the table
    if ids.size:
        odd = np.frombuffer(bytearray(ids.nbytes + 1), np.int64, ids.size, 1).reshape(ids.shape)
        odd[...] = ids
        refused.append((table, odd, out))  # misaligned ids
    strided = ids[..., ::2] if ids.ndim else ids
    if not strided.flags.c_contiguous:
        refused.append((table, strided, np.empty(strided.shape + (row_bytes,), np.uint8)))
    for args in refused:
        try:
            _take.take(*args)
        except (TypeError, ValueError, BufferError):
            continue
        fail(f"take accepted a buffer it must refuse: {[(a.dtype, a.shape) for a in args]}")
    ro = out.copy()
    ro.flags.writeable = False
    try:
        _take.take(table, ids, ro)
        fail("take wrote into a read-only out")
    except (TypeError, ValueError, BufferError):
        pass


def unique_one(r: np.random.Generator) -> None:
    from tableserver.common import _take

    n = int(r.integers(0, 3000))
    span = int(r.integers(1, 1 << int(r.integers(1, 62))))
    ids = r.integers(-span, span, n, dtype=np.int64)
    if n and r.random() < 0.5:
        ids = ids[r.integers(0, n, n)]  # repeats
    uniq = np.empty(n + int(r.integers(0, 3)), np.int64)
    inv = np.empty(n + int(r.integers(0, 3)), np.int64)
    k = _take.unique(ids, uniq, inv, int(r.integers(0, 1 << 63, dtype=np.uint64)))
    want = np.unique(ids).size
    if k != want or not np.array_equal(uniq[:k][inv[:n]], ids) or len(set(uniq[:k].tolist())) != k:
        fail(f"unique: {n} ids: k={k}, want {want}, or the inverse does not rebuild them")
    for bad in ((ids, uniq[: n - 1], inv), (ids, uniq, inv.astype(np.int32)), (ids, ids, inv)) if n else ():
        try:
            _take.unique(*bad, 3)
        except (TypeError, ValueError):
            continue
        fail("unique accepted outputs it must refuse")


def take_concurrent(seed: int, seconds: float) -> None:
    """Gathers past NOGIL_BYTES (the GIL released) while another thread rewrites their ids with any value."""
    from tableserver.common import _take

    r = np.random.default_rng(seed)
    rows, row_bytes = 2000, 264
    table = r.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    ids = r.integers(0, rows, 4096, dtype=np.int64)
    out = np.empty((ids.size, row_bytes), np.uint8)
    uniq = np.empty_like(ids)
    inv = np.empty_like(ids)
    stop = time.monotonic() + seconds
    calls = [0]

    def gatherer() -> None:
        while time.monotonic() < stop:
            _take.take(table, ids, out)
            _take.check(ids, rows)
            k = _take.unique(ids, uniq, inv, 0x9E3779B97F4A7C15)
            if not 0 <= k <= ids.size:
                fail(f"unique: k={k} of {ids.size} ids rewritten under it")
            calls[0] += 1

    def scribbler() -> None:
        w = np.random.default_rng(seed + 1)
        extremes = np.array([-1, rows, -(1 << 63), (1 << 63) - 1], np.int64)
        while time.monotonic() < stop:
            at = w.integers(0, ids.size, 64)
            ids[at] = w.choice(extremes, 64)
            ids[at] = w.integers(0, rows, 64)

    threads = [threading.Thread(target=gatherer) for _ in range(3)] + [threading.Thread(target=scribbler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not calls[0]:
        fail("take: no concurrent gather ran")


def stress_take(iterations: int, seed: int) -> None:
    t0 = time.monotonic()
    r = np.random.default_rng(seed)
    for _ in range(iterations * 10):
        take_one(r)
    for _ in range(iterations):
        unique_one(r)
    take_concurrent(seed, 3.0)
    print(f"take: {iterations * 10} gathers, {iterations} dedups, 3 s concurrent in {time.monotonic() - t0:.1f} s")


# -- _flags ----------------------------------------------------------------------------------------------


def stress_flags(iterations: int, seed: int) -> None:
    from tableclient.graph._flags import wait_u32

    t0 = time.monotonic()
    flags = np.zeros(64, np.uint32)
    refused = [
        (flags, 64, 1, 0.0),
        (flags, -1, 1, 0.0),
        (flags, 1 << 62, 1, 0.0),
        (flags, 0, 1 << 32, 0.0),
        (flags, 0, 1, -1.0),
        (flags, 0, 1, float("nan")),
        (np.zeros(4, np.int64), 0, 1, 0.0),
        (np.zeros(4, np.float32), 0, 1, 0.0),
        (np.zeros(0, np.uint32), 0, 1, 0.0),
        (flags[::2], 0, 1, 0.0),
        (bytes(16), 0, 1, 0.0),
        (np.zeros(4, np.uint32).view(np.dtype(">u4")), 0, 1, 0.0),
    ]
    for args in refused:
        try:
            wait_u32(*args)
        except (TypeError, ValueError, OverflowError, BufferError):
            continue
        fail(f"wait_u32 accepted what it must refuse: {args[1:]} on {getattr(args[0], 'dtype', type(args[0]))}")
    if wait_u32(flags, 3, 1, 0.0) or not wait_u32(flags, 3, 0, 0.0) or wait_u32(flags, 3, 1, 0.001):
        fail("wait_u32: wrong answer on a flag nobody sets")

    def waiter(k: int) -> None:
        r = random.Random(seed + k)
        for _ in range(iterations):
            i = r.randrange(flags.size)
            v = r.randrange(4)
            timeout = r.choice((0.0, 0.0001, 0.002, float("inf") if v == 0 else 0.001))
            if not wait_u32(flags, i, v, timeout) and timeout == float("inf"):
                fail("wait_u32: an infinite wait returned False")

    def setter() -> None:
        r = random.Random(seed - 1)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(t.is_alive() for t in waiters):
            flags[r.randrange(flags.size)] = r.randrange(4)
            if r.random() < 0.05:
                flags[:] = 0  # every infinite wait (for 0) ends
        flags[:] = 0

    waiters = [threading.Thread(target=waiter, args=(k,)) for k in range(4)]
    for t in waiters:
        t.start()
    setters = [threading.Thread(target=setter) for _ in range(2)]
    for t in setters:
        t.start()
    for t in waiters + setters:
        t.join()
    # a flag set from another thread is seen
    flags[5] = 0
    threading.Timer(0.01, lambda: flags.__setitem__(5, 7)).start()
    if not wait_u32(flags, 5, 7, 30.0):
        fail("wait_u32: a flag set by another thread not seen within 30 s")
    print(f"flags: {4 * iterations} waits, {len(refused)} refusals in {time.monotonic() - t0:.1f} s")


# -- _graphpoll -----------------------------------------------------------------------------------------


def stress_graphpoll(iterations: int, seed: int) -> None:
    from tableclient.graph.poller._native import Poller

    t0 = time.monotonic()
    r = np.random.default_rng(seed)
    rows, row_bytes, cols, max_tokens = 5000, 264, 24, 16
    table = r.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    other = r.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    flags = np.zeros(64, np.uint32)
    ids = np.zeros((2, max_tokens * cols), np.int64)
    staging = np.zeros((2, max_tokens * cols * row_bytes), np.uint8)
    refused = [
        (flags[::2], [(0, 16, -1, ids[0], staging[0], row_bytes, cols)], False),
        (flags, [(0, 64, -1, ids[0], staging[0], row_bytes, cols)], False),
        (flags, [(0, 16, -1, ids[0].view(np.float64), staging[0], row_bytes, cols)], False),
        (flags, [(0, 16, -1, ids[0], staging[0][:100], row_bytes, cols)], False),
        (flags, [], False),
    ]
    for args in refused:
        try:
            Poller(*args)
        except (TypeError, ValueError, BufferError):
            continue
        fail(f"Poller accepted what it must refuse: {args[1][:1]}")
    try:
        Poller(flags, [(0, 16, -1, ids[0], staging[0], row_bytes, cols)], False, dead_id="-1")
        fail("Poller accepted a dead id that is not an integer")
    except TypeError:
        pass
    for cpu in (-2, 1 << 20):
        try:
            Poller(flags, [(0, 16, -1, ids[0], staging[0], row_bytes, cols)], False, cpu=cpu)
            fail(f"Poller accepted cpu={cpu}")
        except ValueError:
            pass
    cpus = sorted(os.sched_getaffinity(0))
    if 1023 not in cpus:  # a CPU this cpuset lacks: the pin refused, the thread runs unpinned
        p = Poller(flags, [(0, 16, -1, ids[0], staging[0], row_bytes, cols)], False, cpu=1023)
        if p.cpu != -1:
            fail(f"Poller(cpu=1023) says it runs on {p.cpu}")
        p.close()
    steps = 0
    for it in range(max(1, iterations // 5)):
        flags[:] = 0
        p = Poller(
            flags,
            [(0, 16, 32, ids[0], staging[0], row_bytes, cols), (48, 56, -1, ids[1], staging[1], row_bytes, cols)],
            bool(it % 2),
            dead_id=-1 if it % 3 == 0 else None,  # an engine's padding marker: never read, zero rows
            cpu=-1 if it % 2 else cpus[it % len(cpus)],  # pinned or not
        )
        if it % 2 == 0 and p.cpu != cpus[it % len(cpus)]:
            fail(f"Poller(cpu={cpus[it % len(cpus)]}) runs on {p.cpu}")
        dead = it % 3 == 0
        source = [table, table]
        p.set_shm(0, table, rows)
        p.set_shm(1, table, rows)
        for _ in range(20):
            tokens = int(r.integers(1, max_tokens + 1))
            n = tokens * cols
            bad = r.random() < 0.1
            for k in range(2):
                ids[k, :n] = r.integers(0, rows, n)
                if dead:
                    ids[k, :n][r.random(n) < 0.3] = -1
                if bad:
                    ids[k, 0] = rows + 7
            if r.random() < 0.1:  # swap a source between steps
                k = int(r.integers(0, 2))
                source[k] = other if source[k] is table else table
                p.set_shm(k, source[k], rows)
            try:
                p.arm(tokens, [time.monotonic() + 2.0] * 2)
            except RuntimeError:
                p.reset()
                continue
            flags[0] = flags[48] = 1
            errors = p.wait_released(5.0)
            if errors is None:
                fail("Poller: a step not released within 5 s")
                break
            for k, rows_flag in ((0, 16), (1, 56)):
                got = staging[k, : n * row_bytes].reshape(n, row_bytes)
                if flags[rows_flag] != 1:
                    fail(f"Poller: slot {k} released but its rows flag is {flags[rows_flag]}")
                elif bad and (got.any() or not errors):
                    fail(f"Poller: slot {k}: an id outside the table was not refused with zero rows")
                elif not bad and not np.array_equal(
                    got, np.where((ids[k, :n] < 0)[:, None], 0, source[k][np.maximum(ids[k, :n], 0)])
                ):
                    fail(f"Poller: slot {k}: rows differ from the table (dead ids: zero rows)")
                flags[rows_flag] = 0  # the graph consumed the release
            if flags[32] != (0 if bad else 1):
                fail(f"Poller: the ok flag is {flags[32]} for a step {'refused' if bad else 'served'}")
            steps += 1
        # a replay nobody armed: released with zeros at once; a late close while a thread resets
        flags[0] = 1
        end = time.monotonic() + 5.0
        while flags[16] != 1 and time.monotonic() < end:
            time.sleep(0.001)
        if flags[16] != 1 or staging[0].any():
            fail("Poller: a replay nobody armed was not released with zero rows")
        resetter = threading.Thread(target=p.reset)
        resetter.start()
        p.close()
        resetter.join()
        p.close()  # idempotent
        if flags[16] != 1 or flags[56] != 1:
            fail("Poller: close left a rows flag unset")
    print(f"graphpoll: {steps} steps, {len(refused)} refusals in {time.monotonic() - t0:.1f} s")


def _wire_peer(conn: socket.socket, table: np.ndarray, close_after: int) -> None:
    """A tcp peer of the poller's reader: answers GATHER frames from ``table`` (a whole response before it
    reads on), closes after ``close_after`` responses (an idle timeout, a restart)."""
    from tableserver.common.wire import HEADER, HEADER_BYTES, FrameType, Status, response_header

    def recv(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            got = conn.recv(n - len(buf))
            if not got:
                return None
            buf += got
        return bytes(buf)

    try:
        for _ in range(close_after):
            head = recv(HEADER_BYTES)
            if head is None:
                return
            _m, _t, _f, request_id, _table, count = HEADER.unpack(head)
            ids = np.frombuffer(recv(count * 8) or b"", "<i8")
            if ids.size != count:
                return
            rows = table[ids]
            conn.sendall(
                response_header(FrameType.GATHER, Status.OK, request_id, table.shape[1], count) + rows.tobytes()
            )
    except OSError:
        pass
    finally:
        conn.close()


def stress_graphpoll_sources(iterations: int, seed: int) -> None:
    """The poller's tcp reader against peers that close at random (steps handed to Python then), steps handed
    over (set_host) and taken or left to the watchdog, sources changed at random, close() racing a thread
    that arms and sets sources: rows bit-exact or the policy, never a fd closed twice or leaked."""
    from tableclient.graph.poller._native import Poller

    t0 = time.monotonic()
    r = np.random.default_rng(seed + 1)
    rows, row_bytes, cols, max_tokens = 4000, 24, 24, 16
    table = r.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    fds_before = len(os.listdir("/proc/self/fd"))
    steps = handed = 0
    for _ in range(max(1, iterations // 10)):
        flags = np.zeros(64, np.uint32)
        ids = np.zeros(max_tokens * cols, np.int64)
        staging = np.zeros(max_tokens * cols * row_bytes, np.uint8)
        p = Poller(flags, [(0, 16, 32, ids, staging, row_bytes, cols)], False)
        stop = threading.Event()

        def handoffs(p=p, ids=ids, staging=staging, stop=stop):
            nonlocal handed
            while not stop.is_set():
                job = p.take_handoff(0.05)
                if job is None:
                    continue
                slot, step, tokens, deadline = job
                n = tokens * cols
                if r.random() < 0.8:  # else left: finished late, or as failed
                    staging[: n * row_bytes] = table[ids[:n]].reshape(-1)
                    p.finish_handoff(slot, step, True, "", False)
                    handed += 1
                else:
                    p.finish_handoff(slot, step, False, "refused", bool(r.random() < 0.5))

        helper = threading.Thread(target=handoffs)
        helper.start()
        peers = []
        for _ in range(15):
            kind = r.random()
            if kind < 0.5:
                a, b = socket.socketpair()
                t = threading.Thread(target=_wire_peer, args=(b, table, int(r.integers(0, 4))), daemon=True)
                t.start()
                peers.append((a, t))
                p.set_tcp(0, a.fileno(), 0, int(r.integers(1, 400)))
            elif kind < 0.8:
                p.set_host(0)
            else:
                p.set_shm(0, table, rows)
            for _ in range(int(r.integers(1, 4))):
                tokens = int(r.integers(1, max_tokens + 1))
                n = tokens * cols
                ids[:n] = r.integers(0, rows, n)
                if r.random() < 0.2:
                    p.poll_closed(0)
                try:
                    p.arm(tokens, [time.monotonic() + 0.5])
                except RuntimeError:
                    p.reset()
                    continue
                flags[0] = 1
                if p.wait_released(5.0) is None:
                    fail("Poller sources: a step not released within 5 s")
                    break
                if flags[16] != 1:
                    fail(f"Poller sources: released but the rows flag is {flags[16]}")
                got = staging[: n * row_bytes].reshape(n, row_bytes)
                if flags[32] == 1 and not np.array_equal(got, table[ids[:n]]):
                    fail("Poller sources: rows marked ok differ from the table")
                elif flags[32] == 0 and got.any():
                    fail("Poller sources: a step refused without zero rows")
                flags[16] = 0
                steps += 1
                p.broken(0)
                p.take_events()
        closer = threading.Thread(target=p.close)
        arming = threading.Thread(target=lambda p=p: [_try(p.arm, 1, [time.monotonic() + 0.01]) for _ in range(50)])
        arming.start()
        closer.start()
        closer.join()
        arming.join()
        stop.set()
        helper.join()
        try:
            a, b = socket.socketpair()
            p.set_tcp(0, a.fileno(), 0, 16)
            fail("Poller sources: a source set after close was taken")
        except RuntimeError:
            pass
        a.close()
        b.close()
        for a, t in peers:
            a.close()
            t.join(5)
        del p
    leaked = len(os.listdir("/proc/self/fd")) - fds_before
    if leaked > 0:
        fail(f"Poller sources: {leaked} descriptors left open")
    print(f"graphpoll sources: {steps} steps, {handed} handed to Python in {time.monotonic() - t0:.1f} s")


def _try(call, *args) -> None:
    try:
        call(*args)
    except RuntimeError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect-dir", help="the sanitized tree every extension must be imported from")
    ap.add_argument("--iterations", type=int, default=150)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--only", choices=("diskio", "take", "flags", "graphpoll", "sources"), action="append")
    a = ap.parse_args()
    try:
        check_imports(a.expect_dir)
    except RuntimeError as e:
        sys.exit(f"stress: {e}")
    print(f"stress: seed {a.seed}, {a.iterations} iterations", flush=True)
    parts = {"diskio": stress_diskio, "take": stress_take, "flags": stress_flags, "graphpoll": stress_graphpoll,
             "sources": stress_graphpoll_sources}  # fmt: skip
    for part in a.only or tuple(parts):
        parts[part](a.iterations, a.seed)
    if failures:
        print(f"stress: {len(failures)} failures (seed {a.seed})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
