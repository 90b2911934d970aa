"""``tableserver.diskio.DiskTable``: rows read page by page from real files, bit-exact against ``np.memmap`` of
the same bytes -- duplicates, rows straddling pages, first and last rows, 2-D ids, stripes, an unaligned
offset, offsets past 4 GiB -- and its refusals: truncated, changed and replaced files, read errors, ids out of
range, and the bound on its buffer pool."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tableserver.diskio import DiskReadError, DiskTable

ROW_BYTES = 264
PAGE = 4096


def write_table(path, rows: int, offset: int = 0, seed: int = 0, tail: int = 0) -> np.ndarray:
    """A file of ``offset`` filler bytes, ``rows`` random rows and ``tail`` more; returns the rows."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, offset + rows * ROW_BYTES + tail, dtype=np.uint8)
    data.tofile(path)
    return np.memmap(path, np.uint8, "r", offset=offset, shape=(rows, ROW_BYTES))


def straddlers(rows: int, offset: int = 0) -> np.ndarray:
    start = offset + np.arange(rows) * ROW_BYTES
    return np.flatnonzero(start // PAGE != (start + ROW_BYTES - 1) // PAGE)


def test_gather_bit_exact(tmp_path):
    rows = 12_000  # ~3 MiB
    path = tmp_path / "t.bin"
    table = write_table(path, rows, offset=2 << 20)
    rng = np.random.default_rng(1)
    with DiskTable(path, 2 << 20, rows, ROW_BYTES) as t:
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


def test_unaligned_offset_and_uint_ids(tmp_path):
    rows, offset = 5000, 12_345
    path = tmp_path / "u.bin"
    table = write_table(path, rows, offset=offset, tail=77)
    ids = np.random.default_rng(2).integers(0, rows, 2000).astype(np.uint32)
    with DiskTable(str(path), offset, rows, ROW_BYTES, queue_depth=4) as t:
        assert np.array_equal(t.gather(ids), table[ids])
        assert np.array_equal(t.gather([0, rows - 1]), table[[0, rows - 1]])


def test_striped_over_three_files(tmp_path):
    rows, offset, stripe, n = 9000, 4096 + 100, 16 * PAGE, 3
    logical = np.random.default_rng(3).integers(0, 256, offset + rows * ROW_BYTES, dtype=np.uint8)
    units = [logical[a : a + stripe] for a in range(0, logical.size, stripe)]
    paths = [tmp_path / f"s{i}.bin" for i in range(n)]
    for i, p in enumerate(paths):
        np.concatenate(units[i::n]).tofile(p)
    table = logical[offset:].reshape(rows, ROW_BYTES)
    ids = np.random.default_rng(4).integers(0, rows, 4000)
    ids = np.concatenate((ids, straddlers(rows, offset), [0, rows - 1]))
    with DiskTable(paths, offset, rows, ROW_BYTES, stripe=stripe, queue_depth=8) as t:
        assert np.array_equal(t.gather(ids), table[ids])
        # sequential rows: runs of contiguous pages cut at each stripe boundary
        seq = np.arange(rows)
        assert np.array_equal(t.gather(seq), table)
    os.truncate(paths[1], os.path.getsize(paths[1]) - 1)
    with pytest.raises(DiskReadError, match="truncated"):
        DiskTable(paths, offset, rows, ROW_BYTES, stripe=stripe)
    with pytest.raises(ValueError, match="stripe"):
        DiskTable(paths, offset, rows, ROW_BYTES)
    with pytest.raises(ValueError, match="multiple of page"):
        DiskTable(paths, offset, rows, ROW_BYTES, stripe=1000)


def test_offsets_past_4gib(tmp_path):
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
    with DiskTable(path, offset, rows, ROW_BYTES) as t:
        assert offset > 4 << 30
        assert np.array_equal(t.gather(ids), table[ids])
        assert np.array_equal(t.gather([0, rows - 1]), table[[0, rows - 1]])


def test_pool_bound_batches(tmp_path):
    """A gather of far more pages than the pool is done in batches; the pool never grows."""
    rows = 20_000
    path = tmp_path / "p.bin"
    table = write_table(path, rows)
    with DiskTable(path, 0, rows, ROW_BYTES, queue_depth=3, pool_pages=5) as t:
        assert t.pool_pages == 6  # 5 pages of first pages, one more for a straddling row's second page
        pool = len(t._pool)
        ids = np.random.default_rng(7).permutation(rows)[:6000]
        ids = np.concatenate((ids, ids[:50]))
        assert np.array_equal(t.gather(ids), table[ids])
        assert len(t._pool) == pool == 6 * PAGE
        npages = len(np.unique(np.concatenate((ids * ROW_BYTES // PAGE, (ids * ROW_BYTES + ROW_BYTES - 1) // PAGE))))
        assert npages > 20 * t.pool_pages
        assert t.pages_read == npages  # no page read twice across batches here
        assert np.array_equal(t.gather(np.arange(rows)), table)


def test_ids_out_of_range(tmp_path):
    path = tmp_path / "r.bin"
    write_table(path, 100)
    with DiskTable(path, 0, 100, ROW_BYTES) as t:
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


def test_truncated_file(tmp_path):
    rows = 3000
    path = tmp_path / "t.bin"
    table = write_table(path, rows)
    with pytest.raises(DiskReadError, match=r"truncated.*re-copy"):
        DiskTable(path, 0, rows + 1, ROW_BYTES)
    with DiskTable(path, 0, rows, ROW_BYTES) as t:
        assert np.array_equal(t.gather([rows - 1]), table[[rows - 1]])
        os.truncate(path, rows * ROW_BYTES // 2)
        with pytest.raises(DiskReadError, match=r"short read|changed size") as e:
            t.gather([rows - 1])
        assert str(path) in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(DiskReadError, match="changed size"):  # rows still there, the file is not
            t.gather([0])


def test_changed_or_replaced_file(tmp_path):
    rows = 2000
    path = tmp_path / "c.bin"
    table = write_table(path, rows)
    os.utime(path, ns=(10**18, 10**18))  # a past mtime: a write now changes it whatever the clock tick
    with DiskTable(path, 0, rows, ROW_BYTES) as t:
        assert np.array_equal(t.gather([5]), table[[5]])
        with open(path, "r+b") as f:
            f.seek(5 * ROW_BYTES)
            f.write(b"x" * ROW_BYTES)
        with pytest.raises(DiskReadError, match=r"modified.*restart"):
            t.gather([5])
    with DiskTable(path, 0, rows, ROW_BYTES) as t:
        assert t.gather([1]).shape == (1, ROW_BYTES)
        other = tmp_path / "c2.bin"
        write_table(other, rows, seed=9)
        os.replace(other, path)
        with pytest.raises(DiskReadError, match="replaced"):
            t.gather([1])


def test_read_error_fails_that_gather_only(tmp_path, monkeypatch):
    rows = 4000
    path = tmp_path / "e.bin"
    table = write_table(path, rows)
    real = os.preadv
    bad_at = 40 * PAGE

    def preadv(fd, bufs, at):
        n = sum(len(b) for b in bufs)
        if at <= bad_at < at + n:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, at)

    with DiskTable(path, 0, rows, ROW_BYTES, queue_depth=4) as t:
        monkeypatch.setattr(os, "preadv", preadv)
        row_on_bad = bad_at // ROW_BYTES + 1
        with pytest.raises(DiskReadError, match="read error") as e:
            t.gather(np.arange(0, rows, 7).tolist() + [row_on_bad])
        assert e.value.errno == errno.EIO and "dmesg" in str(e.value)
        ok = np.array([0, 1, rows - 1])
        assert np.array_equal(t.gather(ok), table[ok])  # the next gathers succeed
        monkeypatch.setattr(os, "preadv", real)
        assert np.array_equal(t.gather([row_on_bad]), table[[row_on_bad]])


def test_buffered_fallback_when_direct_refused(tmp_path, monkeypatch, caplog):
    rows = 1000
    path = tmp_path / "b.bin"
    table = write_table(path, rows, offset=100)
    real = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with DiskTable(path, 100, rows, ROW_BYTES) as t:
        assert not t.direct and "buffered" in t.io_mode and "O_DIRECT" in t.io_mode
        ids = np.random.default_rng(8).integers(0, rows, 500)
        assert np.array_equal(t.gather(ids), table[ids])
    assert any("O_DIRECT" in r.getMessage() for r in caplog.records)


def test_direct_and_close(tmp_path):
    rows = 100
    path = tmp_path / "d.bin"
    write_table(path, rows)
    t = DiskTable(path, 0, rows, ROW_BYTES, direct=False)
    assert not t.direct and t.io_mode.startswith("buffered")
    t.close()
    t.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        t.gather([0])
    with DiskTable(path, 0, rows, ROW_BYTES) as t:  # ext4/xfs take O_DIRECT; tmpfs/9p fall back
        assert t.io_mode == ("O_DIRECT" if t.direct else t.io_mode)
        assert "DiskTable(" in repr(t)
