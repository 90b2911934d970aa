"""``tableserver.disk.reader.DiskTable``: rows read page by page from real files, bit-exact against ``np.memmap`` of
the same bytes -- duplicates, rows straddling pages, first and last rows, 2-D ids, stripes, an unaligned
offset, offsets past 4 GiB, a block device -- and its refusals: truncated, changed and replaced files, read
errors, reads past the timeout, ids out of range, and the bound on its buffer pool. Each with every read
engine that runs here (io_uring, threads, python), in one batch and in pipelined batches; then the engine
choice, its fallbacks and the native engine's own interface."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT

from tableserver.disk import engines
from tableserver.disk.plan import MAX_RUN_PAGES
from tableserver.disk.reader import DiskReadError, DiskTable

ROW_BYTES = 264
PAGE = 4096
ENGINES = ("io_uring", "threads", "python")
HOLD = engines.HOLD


def engine_missing(io: str) -> str | None:
    """Why engine ``io`` cannot run here, or None."""
    if io == "python":
        return None
    if engines.native is None:
        return engines.NATIVE_MISSING
    try:
        engines.native.Engine(io, 1, bytearray(PAGE)).close()
    except OSError as e:
        return engines.uring_unavailable(e) if io == "io_uring" else str(e)
    return None


@pytest.fixture(params=ENGINES)
def io(request):
    """Each read engine in turn; skipped where it cannot run."""
    why = engine_missing(request.param)
    if why:
        pytest.skip(f"io={request.param}: {why}")
    return request.param


def fault_reads(t: DiskTable, at: int, code: int):
    """Reads covering file byte ``at`` fail with errno ``code`` (HOLD: stay in flight) until the returned
    function is called: the engine's fault hook (every engine has it)."""
    eng = t.io_engine
    eng.inject(at, code)
    return lambda: eng.inject(0, 0)


def write_table(path, rows: int, offset: int = 0, seed: int = 0, tail: int = 0) -> np.ndarray:
    """A file of ``offset`` filler bytes, ``rows`` random rows and ``tail`` more; returns the rows."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, offset + rows * ROW_BYTES + tail, dtype=np.uint8)
    data.tofile(path)
    return np.memmap(path, np.uint8, "r", offset=offset, shape=(rows, ROW_BYTES))


def straddlers(rows: int, offset: int = 0) -> np.ndarray:
    start = offset + np.arange(rows) * ROW_BYTES
    return np.flatnonzero(start // PAGE != (start + ROW_BYTES - 1) // PAGE)


def test_gather_bit_exact(tmp_path, io):
    rows = 12_000  # ~3 MiB
    path = tmp_path / "t.bin"
    table = write_table(path, rows, offset=2 << 20)
    rng = np.random.default_rng(1)
    with DiskTable(path, 2 << 20, rows, ROW_BYTES, io=io) as t:
        ids = rng.integers(0, rows, 3000)
        ids[:100] = ids[100:200]  # duplicates
        cross = straddlers(rows, 2 << 20)
        assert 0.05 < len(cross) / rows < 0.07  # 6.25% of 264 B rows straddle a 4 KiB page
        ids = np.concatenate((ids, cross[:500], [0, rows - 1, rows - 1, 0]))
        got = t.gather(ids)
        assert np.array_equal(got, table[ids])
        # 2-D ids: out[..., row_bytes], into a caller's buffer
        ids2 = rng.integers(0, rows, (7, 33))
        out = np.empty((7, 33, ROW_BYTES), np.uint8)
        assert t.gather(ids2, out) is out
        assert np.array_equal(out, table[ids2])
        # one row, the last one (it ends the file mid-page: a short last read is legitimate)
        assert np.array_equal(t.gather([rows - 1])[0], table[rows - 1])
        assert t.gather(np.empty(0, np.int64)).shape == (0, ROW_BYTES)
        # exactly the pages holding the rows, each once
        before = t.pages_read
        t.gather(np.array([0, 0, 1]))
        assert t.pages_read - before == 1
        first_cross = int(cross[0])
        before = t.pages_read
        t.gather([first_cross])
        assert t.pages_read - before == 2
        # every read whole but the file's last page, read once per gather of the last row (short: EOF)
        assert t.pages_read * PAGE - 5 * PAGE < t.bytes_read <= t.pages_read * PAGE


def test_unaligned_offset_and_uint_ids(tmp_path, io):
    rows, offset = 5000, 12_345
    path = tmp_path / "u.bin"
    table = write_table(path, rows, offset=offset, tail=77)
    ids = np.random.default_rng(2).integers(0, rows, 2000).astype(np.uint32)
    with DiskTable(str(path), offset, rows, ROW_BYTES, queue_depth=4, io=io) as t:
        assert np.array_equal(t.gather(ids), table[ids])
        assert np.array_equal(t.gather([0, rows - 1]), table[[0, rows - 1]])


def test_striped_over_three_files(tmp_path, io):
    rows, offset, stripe, n = 9000, 4096 + 100, 16 * PAGE, 3
    logical = np.random.default_rng(3).integers(0, 256, offset + rows * ROW_BYTES, dtype=np.uint8)
    units = [logical[a : a + stripe] for a in range(0, logical.size, stripe)]
    paths = [tmp_path / f"s{i}.bin" for i in range(n)]
    for i, p in enumerate(paths):
        np.concatenate(units[i::n]).tofile(p)
    table = logical[offset:].reshape(rows, ROW_BYTES)
    ids = np.random.default_rng(4).integers(0, rows, 4000)
    ids = np.concatenate((ids, straddlers(rows, offset), [0, rows - 1]))
    with DiskTable(paths, offset, rows, ROW_BYTES, stripe=stripe, queue_depth=8, io=io) as t:
        assert np.array_equal(t.gather(ids), table[ids])
        # sequential rows: runs of contiguous pages cut at each stripe boundary
        seq = np.arange(rows)
        assert np.array_equal(t.gather(seq), table)
    os.truncate(paths[1], os.path.getsize(paths[1]) - 1)
    with pytest.raises(DiskReadError, match="truncated"):
        DiskTable(paths, offset, rows, ROW_BYTES, stripe=stripe, io=io)
    with pytest.raises(ValueError, match="stripe"):
        DiskTable(paths, offset, rows, ROW_BYTES, io=io)
    with pytest.raises(ValueError, match="multiple of page"):
        DiskTable(paths, offset, rows, ROW_BYTES, stripe=1000, io=io)


def test_offsets_past_4gib(tmp_path, io):
    """A sparse 5 GiB file with a table near its end: 64-bit offsets all the way down."""
    path = tmp_path / "big.bin"
    size, rows = 5 << 30, 4000
    offset = size - rows * ROW_BYTES - 999  # unaligned, past 4 GiB
    with open(path, "wb") as f:
        f.truncate(size)
        data = np.random.default_rng(5).integers(0, 256, rows * ROW_BYTES, dtype=np.uint8)
        f.seek(offset)
        f.write(data.tobytes())
    table = data.reshape(rows, ROW_BYTES)
    ids = np.random.default_rng(6).integers(0, rows, 1000)
    with DiskTable(path, offset, rows, ROW_BYTES, io=io) as t:
        assert offset > 4 << 30
        assert np.array_equal(t.gather(ids), table[ids])
        assert np.array_equal(t.gather([0, rows - 1]), table[[0, rows - 1]])


def test_pool_bound_batches(tmp_path, io):
    """A gather of far more pages than the pool is done in batches; the pool never grows."""
    rows = 20_000
    path = tmp_path / "p.bin"
    table = write_table(path, rows)
    with DiskTable(path, 0, rows, ROW_BYTES, queue_depth=3, pool_pages=5, io=io) as t:
        assert t.pool_pages == 6  # 5 pages of first pages, one more for a straddling row's second page
        pool = t.pool_bytes
        ids = np.random.default_rng(7).permutation(rows)[:6000]
        ids = np.concatenate((ids, ids[:50]))
        assert np.array_equal(t.gather(ids), table[ids])
        assert t.pool_bytes == pool == 6 * PAGE  # the pool never grows
        npages = len(np.unique(np.concatenate((ids * ROW_BYTES // PAGE, (ids * ROW_BYTES + ROW_BYTES - 1) // PAGE))))
        assert npages > 20 * t.pool_pages
        assert t.pages_read == npages  # no page read twice across batches here
        assert np.array_equal(t.gather(np.arange(rows)), table)


def test_ids_out_of_range(tmp_path, io):
    path = tmp_path / "r.bin"
    write_table(path, 100)
    with DiskTable(path, 0, 100, ROW_BYTES, io=io) as t:
        for bad in ([100], [-1], [0, 5, 1 << 40]):
            with pytest.raises(ValueError, match="outside 0..99"):
                t.gather(bad)
        with pytest.raises(ValueError, match="outside"):
            t.gather(np.array([100], np.uint64))
        with pytest.raises(TypeError):
            t.gather([1.5])
        with pytest.raises(ValueError, match="shape"):
            t.gather([1, 2], np.empty((3, ROW_BYTES), np.uint8))
        assert t.pages_read == 0


def test_truncated_file(tmp_path, io):
    rows = 3000
    path = tmp_path / "t.bin"
    table = write_table(path, rows)
    with pytest.raises(DiskReadError, match=r"truncated.*re-copy"):
        DiskTable(path, 0, rows + 1, ROW_BYTES, io=io)
    with DiskTable(path, 0, rows, ROW_BYTES, io=io) as t:
        assert np.array_equal(t.gather([rows - 1]), table[[rows - 1]])
        os.truncate(path, rows * ROW_BYTES // 2)
        with pytest.raises(DiskReadError, match=r"short read|changed size") as e:
            t.gather([rows - 1])
        assert str(path) in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(DiskReadError, match="changed size"):  # rows still there, the file is not
            t.gather([0])


def test_changed_or_replaced_file(tmp_path, io):
    rows = 2000
    path = tmp_path / "c.bin"
    table = write_table(path, rows)
    os.utime(path, ns=(10**18, 10**18))  # a past mtime: a write now changes it whatever the clock tick
    with DiskTable(path, 0, rows, ROW_BYTES, io=io) as t:
        assert np.array_equal(t.gather([5]), table[[5]])
        with open(path, "r+b") as f:
            f.seek(5 * ROW_BYTES)
            f.write(b"x" * ROW_BYTES)
        with pytest.raises(DiskReadError, match=r"modified.*restart"):
            t.gather([5])
    with DiskTable(path, 0, rows, ROW_BYTES, io=io) as t:
        assert t.gather([1]).shape == (1, ROW_BYTES)
        other = tmp_path / "c2.bin"
        write_table(other, rows, seed=9)
        os.replace(other, path)
        with pytest.raises(DiskReadError, match="replaced"):
            t.gather([1])


POOLS = pytest.mark.parametrize("pool_pages", [None, 8], ids=["one_batch", "batches"])


@POOLS
def test_read_error_fails_that_gather_only(tmp_path, io, pool_pages):
    """EIO on one page: that gather raises (naming the file and the failing run's first byte), the next
    are exact. ``batches``: the failing page is in a later batch of a pipelined gather."""
    rows = 4000
    path = tmp_path / "e.bin"
    table = write_table(path, rows)
    bad_at = 40 * PAGE
    with DiskTable(path, 0, rows, ROW_BYTES, queue_depth=4, pool_pages=pool_pages, io=io) as t:
        clear = fault_reads(t, bad_at, errno.EIO)
        row_on_bad = bad_at // ROW_BYTES + 1
        for _ in range(2):
            with pytest.raises(DiskReadError, match="read error") as e:
                t.gather(np.arange(0, rows, 7).tolist() + [row_on_bad])
            assert e.value.errno == errno.EIO and "dmesg" in str(e.value)
            at = int(re.search(rf"^{re.escape(str(path))}: read error at byte (\d+) \(", str(e.value)).group(1))
            assert at % PAGE == 0 and at <= bad_at < at + MAX_RUN_PAGES * PAGE  # the failing run's first byte
            assert "\n" not in str(e.value)
            ok = np.array([0, 1, rows - 1])
            assert np.array_equal(t.gather(ok), table[ok])  # the next gathers succeed
            many = np.arange(0, 30 * PAGE // ROW_BYTES, 3)  # pages before the failing one, many batches
            assert np.array_equal(t.gather(many), table[many])
        clear()
        assert np.array_equal(t.gather([row_on_bad]), table[[row_on_bad]])
        ids = np.arange(0, rows, 7)
        assert np.array_equal(t.gather(ids), table[ids])


def gather_once_back(t, ids):
    """``t.gather(ids)`` once the reads an earlier gather left in flight are back: a released read still
    takes its time on a busy machine (the sanitizer's, say), and until then the pool is refused."""
    deadline = time.monotonic() + EVENT_TIMEOUT
    while True:
        try:
            return t.gather(ids)
        except DiskReadError as e:
            if "still in flight" not in str(e) or time.monotonic() > deadline:
                raise


@POOLS
def test_timeout_poisons_the_pool_until_the_reads_are_back(tmp_path, caplog, io, pool_pages):
    """A read held in flight past ``timeout``: that gather fails (ETIMEDOUT), the next ones refuse the pool
    until the read is back, then read exactly; close with a read still in flight leaves the pool mapped.
    ``batches``: the held read is in a later batch of a pipelined gather, batches queued behind it."""
    rows = 3000
    path = tmp_path / "h.bin"
    table = write_table(path, rows)
    held_at = 20 * PAGE
    row_on_held = held_at // ROW_BYTES + 1
    ok = np.array([0, 5, rows - 1])
    before = np.arange(0, row_on_held, 9)  # pages before the held one: in batches ahead of it
    t = DiskTable(path, 0, rows, ROW_BYTES, queue_depth=4, timeout=0.2, pool_pages=pool_pages, io=io)
    try:
        release = fault_reads(t, held_at, HOLD)
        with pytest.raises(DiskReadError, match=r"took over 0.2 s.*raise timeout") as e:
            t.gather(np.concatenate((before, [row_on_held], ok)))
        assert e.value.errno == errno.ETIMEDOUT
        with pytest.raises(DiskReadError, match="still in flight") as e:
            t.gather(ok)
        assert e.value.errno == errno.ETIMEDOUT
        release()
        assert np.array_equal(gather_once_back(t, ok), table[ok])  # the held read comes back: exact rows
        ids = np.concatenate((before, [row_on_held], ok))
        assert np.array_equal(t.gather(ids), table[ids])
        release = fault_reads(t, held_at, HOLD)
        with pytest.raises(DiskReadError, match="took over"):
            t.gather([row_on_held])
        with caplog.at_level(logging.WARNING, "tableserver.disk"):
            t.close()
        assert any("left mapped" in r.getMessage() for r in caplog.records)
    finally:
        release()
        t.close()


@pytest.mark.parametrize("row_bytes", [264, 4096, 10_000])
def test_rows_of_any_length_over_many_batches(tmp_path, io, row_bytes):
    """Rows of a page and longer than a page (each touching 2..4 pages) through small and default pools: exact,
    and no page read twice (a straddling row's pages shared by two batches are moved, not reread)."""
    rows, offset = 700, 1000
    rng = np.random.default_rng(12)
    data = rng.integers(0, 256, offset + rows * row_bytes, dtype=np.uint8)
    path = tmp_path / "l.bin"
    data.tofile(path)
    table = data[offset:].reshape(rows, row_bytes)
    for pool_pages in (1, 3, 8, None):
        with DiskTable(path, offset, rows, row_bytes, queue_depth=3, pool_pages=pool_pages, io=io) as t:
            for ids in (rng.integers(0, rows, 400), np.arange(rows), np.array([rows - 1, 0, rows - 1])):
                before = t.pages_read
                assert np.array_equal(t.gather(ids), table[ids])
                start = offset + np.unique(ids) * row_bytes
                spans = [np.arange(a // PAGE, (a + row_bytes - 1) // PAGE + 1) for a in start]
                assert t.pages_read - before == len(np.unique(np.concatenate(spans)))


def test_block_device(tmp_path, io):
    """A table on a loop device: its size from SEEK_END (st_size is 0), gathers exact, the change check quiet."""
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup for a loop device")
    rows, offset = 6000, 8192 + 100
    path = tmp_path / "dev.bin"
    table = write_table(path, rows, offset=offset, tail=PAGE)
    res = subprocess.run(["losetup", "--find", "--show", "--read-only", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"no loop device: {res.stderr.strip()}")
    dev = res.stdout.strip()
    try:
        assert os.stat(dev).st_size == 0
        size = os.path.getsize(path) // 512 * 512  # a loop device ends on its last whole sector
        with DiskTable(dev, offset, rows, ROW_BYTES, queue_depth=8, io=io) as t:
            assert t.direct, t.io_mode
            ids = np.random.default_rng(11).integers(0, rows, 2000)
            for _ in range(3):  # the change check after each gather: no misfire on a device node
                assert np.array_equal(t.gather(ids), table[ids])
            assert np.array_equal(t.gather([0, rows - 1]), table[[0, rows - 1]])
        too_many = (size - offset) // ROW_BYTES + 1
        with pytest.raises(DiskReadError, match=f"truncated disk table file: {size} bytes"):
            DiskTable(dev, offset, too_many, ROW_BYTES, io=io)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def test_concurrent_gathers(tmp_path, io):
    """Gathers from several threads at once take turns on the one engine: every one exact."""
    rows = 8000
    path = tmp_path / "m.bin"
    table = write_table(path, rows)
    errors = []
    with DiskTable(path, 0, rows, ROW_BYTES, queue_depth=8, pool_pages=40, io=io) as t:
        engine = t.io_engine

        def run(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(20):
                    ids = rng.integers(0, rows, int(rng.integers(1, 600)))
                    assert np.array_equal(t.gather(ids), table[ids])
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert t.io_engine is engine and t.gathers == 80  # one engine for the table's life


def test_buffered_fallback_when_direct_refused(tmp_path, monkeypatch, caplog, io):
    rows = 1000
    path = tmp_path / "b.bin"
    table = write_table(path, rows, offset=100)
    real = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with DiskTable(path, 100, rows, ROW_BYTES, io=io) as t:
        assert not t.direct and "buffered" in t.io_mode and "O_DIRECT" in t.io_mode
        ids = np.random.default_rng(8).integers(0, rows, 500)
        assert np.array_equal(t.gather(ids), table[ids])
    assert any("O_DIRECT" in r.getMessage() for r in caplog.records)


def test_direct_and_close(tmp_path, io):
    rows = 100
    path = tmp_path / "d.bin"
    write_table(path, rows)
    t = DiskTable(path, 0, rows, ROW_BYTES, direct=False, io=io)
    assert not t.direct and t.io_mode.startswith("buffered")
    assert t.pool_bytes == t.pool_pages * PAGE and t.read_limit == t.queue_depth
    t.close()
    t.close()  # idempotent
    assert t.pool_bytes == 0 and t.read_limit == 0  # unmapped: nothing was in flight
    with pytest.raises(ValueError, match="closed"):
        t.gather([0])
    with DiskTable(path, 0, rows, ROW_BYTES, io=io) as t:  # ext4/xfs take O_DIRECT; tmpfs/9p fall back
        assert t.io_mode == ("O_DIRECT" if t.direct else t.io_mode)
        assert "DiskTable(" in repr(t)
        assert t.io_engine.name == t.engine
        for bad in (-2, 4096):  # the fault hook takes an errno, HOLD or 0, on every engine
            with pytest.raises(ValueError, match=r"code: an errno, -1 \(hold\) or 0 \(clear\)"):
                t.io_engine.inject(0, bad)


def test_engine_choice(tmp_path, caplog):
    path = tmp_path / "a.bin"
    write_table(path, 100)
    with caplog.at_level(logging.INFO, "tableserver.disk"):
        with DiskTable(path, 0, 100, ROW_BYTES) as t:
            expected = next(e for e in ENGINES if engine_missing(e) is None)
            assert t.engine == expected and t.engine_reason and "\n" not in t.engine_reason
            if t.engine == "io_uring":
                assert t.engine_reason.startswith("auto: ring of 32, page pool ")
                assert ("registered (READ_FIXED)" in t.engine_reason) == t.io_engine.fixed
            assert t.engine in repr(t)
    assert sum(f"by the {expected} engine" in r.getMessage() for r in caplog.records) == 1  # logged once, at open
    with pytest.raises(ValueError, match="io='uring': pass one of auto, io_uring, threads, python"):
        DiskTable(path, 0, 100, ROW_BYTES, io="uring")
    with DiskTable(path, 0, 100, ROW_BYTES, io="python") as t:
        assert t.engine == "python" and "Python threads" in t.engine_reason


def test_engine_fallbacks(tmp_path, monkeypatch):
    """io_uring refused (EPERM, as kernel.io_uring_disabled=2 does): auto reads with threads and says why, a
    named io_uring fails naming the fix; no extension: auto reads with Python, named engines fail."""
    path = tmp_path / "f.bin"
    table = write_table(path, 500)
    ids = np.arange(0, 500, 3)
    if engines.native is not None and engine_missing("threads") is None:
        real = engines.native.Engine

        def refuse_uring(mode, depth, pool):
            if mode == "io_uring":
                raise OSError(errno.EPERM, "Operation not permitted", "io_uring_setup")
            return real(mode, depth, pool)

        monkeypatch.setattr(engines.native, "Engine", refuse_uring)
        monkeypatch.setattr(engines, "sysctl", lambda name: "2" if name == "kernel.io_uring_disabled" else None)
        with DiskTable(path, 0, 500, ROW_BYTES, queue_depth=4) as t:
            assert t.engine == "threads"
            assert t.engine_reason == "io_uring unavailable: EPERM (kernel.io_uring_disabled=2); 4 threads over preadv"
            assert np.array_equal(t.gather(ids), table[ids])
        with pytest.raises(
            DiskReadError, match=r"io='io_uring' cannot run here: io_uring unavailable: EPERM.*io='threads'"
        ):
            DiskTable(path, 0, 500, ROW_BYTES, io="io_uring")
        monkeypatch.setattr(engines, "sysctl", lambda name: "0")
        assert "seccomp" in engines.uring_unavailable(OSError(errno.EPERM, "Operation not permitted"))
        assert "ENOSYS" in engines.uring_unavailable(OSError(errno.ENOSYS, "Function not implemented"))
    monkeypatch.setattr(engines, "native", None)
    monkeypatch.setattr(engines, "NATIVE_MISSING", "tableserver.disk._diskio not built (No module named x)")
    with DiskTable(path, 0, 500, ROW_BYTES) as t:
        assert t.engine == "python" and t.engine_reason.startswith("tableserver.disk._diskio not built")
        assert np.array_equal(t.gather(ids), table[ids])
    for named in ("io_uring", "threads"):
        with pytest.raises(
            DiskReadError, match=rf"io='{named}' needs the native read engine.*pip install -e .*io='python'"
        ):
            DiskTable(path, 0, 500, ROW_BYTES, io=named)


def test_io_uring_without_a_registered_pool(tmp_path):
    """RLIMIT_MEMLOCK below the pool's size (no CAP_IPC_LOCK): the pool is not registered, the ring reads with
    plain READ, exactly, and engine_reason says why."""
    if engine_missing("io_uring"):
        pytest.skip(f"io_uring: {engine_missing('io_uring')}")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("needs root, setpriv and prlimit to drop CAP_IPC_LOCK under a small RLIMIT_MEMLOCK")
    path = tmp_path / "m.bin"
    write_table(path, 5000)
    code = (
        "import numpy as np, sys\n"
        "from tableserver.disk.reader import DiskTable\n"
        "rows = np.memmap(sys.argv[1], np.uint8, 'r', shape=(5000, 264))\n"
        "with DiskTable(sys.argv[1], 0, 5000, 264, io='io_uring', pool_pages=256) as t:\n"
        "    ids = np.random.default_rng(0).integers(0, 5000, 3000)\n"
        "    assert np.array_equal(t.gather(ids), rows[ids])\n"
        "    print(t.io_engine.fixed, t.engine_reason)\n"
    )
    cmd = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "prlimit", "--memlock=65536:65536"]
    res = subprocess.run([*cmd, sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    if res.returncode and "setpriv" in res.stderr:
        pytest.skip(f"setpriv refused: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("False ring of 32, page pool not registered (ENOMEM"), res.stdout
    assert "RLIMIT_MEMLOCK" in res.stdout


def test_io_uring_waits_of_older_kernels(tmp_path):
    """The ring's waits as on a kernel before 5.11 (no IORING_ENTER_EXT_ARG: poll(2) on the ring fd): exact
    gathers over many batches, and a held read still times out."""
    if engine_missing("io_uring"):
        pytest.skip(f"io_uring: {engine_missing('io_uring')}")
    path = tmp_path / "o.bin"
    write_table(path, 6000)
    code = (
        "import errno, numpy as np, sys\n"
        "from tableserver.disk.reader import DiskReadError, DiskTable\n"
        "rows = np.memmap(sys.argv[1], np.uint8, 'r', shape=(6000, 264))\n"
        "with DiskTable(sys.argv[1], 0, 6000, 264, io='io_uring', queue_depth=8, pool_pages=16, timeout=0.3) as t:\n"
        "    ids = np.random.default_rng(0).integers(0, 6000, 3000)\n"
        "    assert np.array_equal(t.gather(ids), rows[ids])\n"
        "    t.io_engine.inject(40 * 4096, -1)\n"
        "    try:\n"
        "        t.gather(np.append(ids, 40 * 4096 // 264 + 1))\n"
        "        raise AssertionError('no timeout')\n"
        "    except DiskReadError as e:\n"
        "        assert e.errno == errno.ETIMEDOUT, e\n"
        "    t.io_engine.inject(0, 0)\n"
        "    assert np.array_equal(t.gather(ids), rows[ids])\n"
        "    print(t.engine_reason)\n"
    )
    env = dict(os.environ, TABLESERVER_DISKIO_POLL_WAITS="1")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("poll waits"), res.stdout


@pytest.mark.parametrize("mode", ["io_uring", "threads"])
def test_native_engine_interface(mode):
    """The extension's Engine directly: batches queued and waited in order, refusals of bad runs and misuse,
    drain, close idempotent."""
    why = engine_missing(mode)
    if why:
        pytest.skip(f"{mode}: {why}")
    pool = mmap.mmap(-1, 16 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with tempfile.TemporaryFile() as f:
        data = np.random.default_rng(13).integers(0, 256, 64 * PAGE, dtype=np.uint8)
        f.write(data.tobytes())
        f.flush()
        fd = f.fileno()
        eng = engines.native.Engine(mode, 4, pool)
        assert eng.mode == mode and eng.depth == 4 and eng.queued == 0 and eng.inflight == 0

        def batch(pages, slot0):
            n = len(pages)
            length = np.full(n, PAGE, np.int64)
            at = np.asarray(pages, np.int64) * PAGE
            return np.full(n, fd, np.int64), at, (slot0 + np.arange(n, dtype=np.int64)) * PAGE, length, length

        assert eng.submit(*batch([3, 9, 60], 0), 1.0) == engines.native.OK
        assert eng.submit(*batch([1, 2], 8), 1.0) == engines.native.OK
        with pytest.raises(RuntimeError, match="full"):
            eng.submit(*batch([5], 12), 1.0)
        with pytest.raises(RuntimeError, match="empty queue"):
            eng.read(*batch([5], 12), 1.0)
        assert eng.wait(5.0) == (engines.native.OK, -1, 0, 3 * PAGE, 3)
        assert eng.wait(5.0) == (engines.native.OK, -1, 0, 2 * PAGE, 2)
        with pytest.raises(RuntimeError, match="no batch"):
            eng.wait(1.0)
        buf = np.frombuffer(pool, np.uint8).reshape(16, PAGE)
        for slot, page in ((0, 3), (1, 9), (2, 60), (8, 1), (9, 2)):
            assert np.array_equal(buf[slot], data[page * PAGE : (page + 1) * PAGE])
        del buf
        fds, at, dst, length, need = batch([0], 15)
        with pytest.raises(ValueError, match="do not fit"):
            eng.read(fds, at, dst + PAGE, length, need, 1.0)  # past the pool
        with pytest.raises(ValueError, match="do not fit"):
            eng.read(fds, at, dst, length, need + 1, 1.0)  # needs more than it reads
        with pytest.raises(TypeError, match="int64"):
            eng.read(fds.astype(np.int32), at, dst, length, need, 1.0)
        st, run, got, *_ = eng.read(fds, np.array([64 * PAGE - 100]), dst, length, need, 1.0)  # past the end
        assert (st, run, got) == (engines.native.SHORT, 0, 100)
        assert eng.submit(*batch([4, 5], 0), 1.0) == engines.native.OK
        assert eng.drain(5.0) == 0 and eng.queued == 0
        assert eng.read(*batch([7], 0), 1.0)[0] == engines.native.OK
        assert eng.close(1.0) is True and eng.close() is True and eng.mode == "closed"
        with pytest.raises(ValueError, match="closed"):
            eng.read(*batch([7], 0), 1.0)
    pool.close()  # the engine let go of its buffer


@pytest.mark.parametrize("mode", ["io_uring", "threads"])
def test_engine_limit_caps_the_reads_in_flight(mode):
    """Engine.limit, set while a batch runs: lowered, no read starts past it (eight reads held at the drive
    by the fault hook: only `limit` of them are ever in flight); raised, the rest start at once; every read
    still lands. Out of 1..depth: ValueError, the limit unchanged."""
    import time

    why = engine_missing(mode)
    if why:
        pytest.skip(f"{mode}: {why}")
    E = engines.native
    pool = mmap.mmap(-1, 8 * PAGE)
    with tempfile.TemporaryFile() as f:
        data = np.random.default_rng(5).integers(0, 256, 8 * PAGE, dtype=np.uint8)
        f.write(data.tobytes())
        f.flush()
        eng = E.Engine(mode, 8, pool)
        assert eng.limit == 8
        for bad in (0, 9, -1):
            with pytest.raises(ValueError, match="1..8"):
                eng.limit = bad
        eng.limit = 2
        assert eng.limit == 2
        engines.native_fault(eng, 0, HOLD)  # every read covering byte 0 is held in flight
        n = 8
        length = np.full(n, PAGE, np.int64)
        assert eng.submit(np.full(n, f.fileno(), np.int64), np.zeros(n, np.int64),
                          np.arange(n, dtype=np.int64) * PAGE, length, length, 5.0) == E.OK  # fmt: skip

        def settle(want, seconds=30.0):
            deadline = time.monotonic() + seconds
            while eng.inflight != want and time.monotonic() < deadline:
                time.sleep(0.001)
            return eng.inflight

        assert settle(2) == 2
        time.sleep(0.05)
        assert eng.inflight == 2  # no read past the limit
        eng.limit = 5
        assert settle(5) == 5
        eng.limit = 1  # lowered under five held reads: they stay, no new one starts
        engines.native_fault(eng, 0, 0)
        assert eng.wait(10.0) == (E.OK, -1, 0, n * PAGE, n)
        assert np.array_equal(np.frombuffer(pool, np.uint8).reshape(n, PAGE), np.tile(data[:PAGE], (n, 1)))
        assert eng.close(5.0) is True and eng.limit == 0
        with pytest.raises(ValueError, match="closed"):
            eng.limit = 1
    pool.close()


@pytest.mark.parametrize("mode", ["io_uring", "threads"])
def test_native_engine_getters_and_calls_during_and_after_close(mode):
    """The engine's close() against other threads (the use-after-free of issue 34: a getter read the core
    close() was freeing with the GIL released). Six threads read every getter and call submit, read, wait,
    drain, the fault hook and close while the main thread closes the engine: nothing crashes, every refusal is
    ValueError "closed" or RuntimeError (in use, queue), and a second close() waits for the first one's
    outcome. After close(): mode "closed", depth 0, fixed and ext_arg False, queued and inflight 0, every
    call ValueError; a leaked engine's inflight still counts its held read, and its fault can be cleared."""
    import time

    why = engine_missing(mode)
    if why:
        pytest.skip(f"{mode}: {why}")
    E = engines.native
    getters = ("mode", "depth", "limit", "fixed", "ext_arg", "note", "inflight", "queued", "closed", "leaked")
    # what every getter of a closed (and not leaked) engine says, from the moment close() starts
    CLOSED_STATE = {"mode": "closed", "depth": 0, "limit": 0, "fixed": False, "ext_arg": False, "inflight": 0,
                    "queued": 0}  # fmt: skip
    with tempfile.TemporaryFile() as f:
        f.write(np.random.default_rng(21).integers(0, 256, 16 * PAGE, dtype=np.uint8).tobytes())
        f.flush()
        fd = f.fileno()

        def batch(k, n=2):
            length = np.full(n, PAGE, np.int64)
            pages = (np.arange(n, dtype=np.int64) + k) % 16
            return np.full(n, fd, np.int64), pages * PAGE, (k * 2 + np.arange(n, dtype=np.int64)) * PAGE, length, length

        def calls(eng, k):
            return (
                lambda: eng.read(*batch(k), 1.0),
                lambda: eng.submit(*batch(k), 0.5),
                lambda: eng.wait(0.01),
                lambda: eng.drain(0.01),
                lambda: engines.native_fault(eng, 3 * PAGE, errno.EIO if k % 2 else 0),
                lambda: setattr(eng, "limit", 1),
            )

        for it in range(10):
            pool = mmap.mmap(-1, 16 * PAGE)
            eng = E.Engine(mode, 1 + it % 4, pool)
            note = eng.note
            stop = threading.Event()
            errors, closes = [], []

            def hammer(k, eng=eng, stop=stop, errors=errors, closes=closes):
                ops = calls(eng, k)
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        closed = eng.closed
                        seen = {name: getattr(eng, name) for name in getters}
                        if closed and {g: seen[g] for g in CLOSED_STATE} != CLOSED_STATE:
                            errors.append(f"getters of a closing engine: {seen}")  # the freed core's (issue 34)
                        if k == 5 and i == 3 + it % 7:
                            closes.append(eng.close(10.0))  # a close racing the main thread's
                        ops[(i + k) % len(ops)]()
                    except ValueError as e:
                        if "closed" not in str(e):
                            errors.append(e)
                    except RuntimeError:
                        pass  # in use by another thread, queue full or not empty, no batch queued
                    except Exception as e:  # noqa: BLE001 -- reported below
                        errors.append(e)

            threads = [threading.Thread(target=hammer, args=(k,)) for k in range(6)]
            for th in threads:
                th.start()
            time.sleep(0.001 * (it % 5))
            closes.append(eng.close(10.0))
            state = {name: getattr(eng, name) for name in getters}
            time.sleep(0.005)  # the threads go on calling the closed engine
            stop.set()
            for th in threads:
                th.join(EVENT_TIMEOUT)
                assert not th.is_alive()
            assert not errors, errors
            assert closes and all(c is True for c in closes), closes  # nothing held: freed, and both say so
            assert state == {**CLOSED_STATE, "note": note, "closed": True, "leaked": False}
            for op in calls(eng, 0):
                with pytest.raises(ValueError, match="closed"):
                    op()
            assert eng.close() is True
            pool.close()  # the engine let go of its buffer

        # a read held in flight: close() leaks the engine, whose getters stay safe and say so
        pool = mmap.mmap(-1, 16 * PAGE)
        eng = E.Engine(mode, 2, pool)
        engines.native_fault(eng, 0, HOLD)
        assert eng.submit(*batch(0), 1.0) == E.OK
        deadline = time.monotonic() + 30
        while not eng.inflight and time.monotonic() < deadline:  # the held read started
            time.sleep(0.001)
        first = []
        closer = threading.Thread(target=lambda eng=eng: first.append(eng.close(0.3)))
        closer.start()
        while not eng.closed:
            time.sleep(0.001)
        assert eng.close(10.0) is False  # waited for the first close() (still draining), which leaked the engine
        closer.join()
        assert first == [False] and eng.close(0.0) is False and eng.leaked and eng.closed
        assert (eng.mode, eng.depth, eng.limit, eng.fixed, eng.ext_arg) == ("closed", 0, 0, False, False)
        assert eng.inflight >= 1
        with pytest.raises(ValueError, match="closed"):
            eng.read(*batch(0), 1.0)
        engines.native_fault(eng, 0, 0)  # the held read goes on, into the pool it still holds
        while eng.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.inflight == 0
        del eng  # leaked for good: the pool stays exported (never unmapped under a read)
