"""The table file format: layout, checksums, validation of every header field."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tableserver.errors import TableFileError
from tableserver.tables.demo import DemoRows, DemoTable, default_tables, write_demo_file
from tableserver.tables.sources import compute_checksum
from tableserver.tables.tablefile import (
    ALIGNMENT,
    PREAMBLE,
    TableFileWriter,
    TableSpec,
    chunk_ranges,
    read_header,
    table_digest,
    table_sha256,
)


def _write(path, specs, fill, chunk_bytes=1 << 20):
    with TableFileWriter(str(path), specs, chunk_bytes=chunk_bytes) as w:
        for i, s in enumerate(specs):
            fill(w, i, s)
    return str(path)


def test_layout_alignment_and_checksums(tmp_path):
    rng = np.random.default_rng(0)
    specs = [TableSpec("a", 10_000, 264, layer=1), TableSpec("b", 7, 3), TableSpec("c", 5_000, 512)]
    data = {s.name: rng.integers(0, 256, (s.rows, s.row_bytes), dtype=np.uint8) for s in specs}

    def fill(w, i, s):
        rows = data[s.name]
        for a in range(0, s.rows, 999):  # odd block size: blocks straddle checksum chunks
            w.append(i, rows[a : a + 999])

    path = _write(tmp_path / "t.bin", specs, fill)
    h = read_header(path)
    raw = np.fromfile(path, dtype=np.uint8)
    assert [s.name for s in h.tables] == ["a", "b", "c"]
    with ThreadPoolExecutor(2) as pool:
        for s in h.tables:
            assert s.offset % ALIGNMENT == 0 and s.offset >= h.data_offset
            got = raw[s.offset : s.offset + s.nbytes].reshape(s.rows, s.row_bytes)
            np.testing.assert_array_equal(got, data[s.name])
            crcs = [zlib.crc32(got.reshape(-1)[a:b]) for a, b in chunk_ranges(s.nbytes, h.chunk_bytes)]
            assert list(s.chunk_crcs) == crcs
            shas = [hashlib.sha256(got.reshape(-1)[a:b]).digest() for a, b in chunk_ranges(s.nbytes, h.chunk_bytes)]
            assert list(s.chunk_sha256) == shas
            assert s.checksum == table_sha256(shas) == compute_checksum(got.reshape(-1), h.chunk_bytes, pool)
            assert s.checksum.startswith("sha256:")
    assert h.tables[0].layer == 1 and h.tables[1].layer == -1


def test_sparse_zero_rows_have_correct_checksums(tmp_path):
    specs = [TableSpec("z", 9_000, 264)]

    def fill(w, i, s):
        w.append(i, np.full((10, 264), 7, np.uint8))
        w.skip(i, 4_000)
        w.append(i, np.full((1, 264), 9, np.uint8))
        w.fill_zeros(i)

    path = _write(tmp_path / "z.bin", specs, fill, chunk_bytes=256 << 10)
    s = read_header(path).tables[0]
    got = np.fromfile(path, dtype=np.uint8)[s.offset : s.offset + s.nbytes]
    assert list(s.chunk_crcs) == [zlib.crc32(got[a:b]) for a, b in chunk_ranges(s.nbytes, 256 << 10)]
    assert list(s.chunk_sha256) == [hashlib.sha256(got[a:b]).digest() for a, b in chunk_ranges(s.nbytes, 256 << 10)]
    rows = got.reshape(s.rows, 264)
    assert (rows[:10] == 7).all() and (rows[10:4010] == 0).all() and (rows[4010] == 9).all()
    assert (rows[4011:] == 0).all()


def test_writer_publishes_atomically(tmp_path):
    path = tmp_path / "x.bin"
    with pytest.raises(RuntimeError):
        with TableFileWriter(str(path), [TableSpec("a", 10, 8)]) as w:
            w.append(0, np.zeros((5, 8), np.uint8))
            raise RuntimeError("interrupted")
    assert not path.exists() and not (tmp_path / "x.bin.tmp").exists()
    with pytest.raises(ValueError, match="wrote 40 of 80"):
        with TableFileWriter(str(path), [TableSpec("a", 10, 8)]) as w:
            w.append(0, np.zeros((5, 8), np.uint8))
    with pytest.raises(TableFileError, match="given twice"):
        TableFileWriter(str(path), [TableSpec("a", 1, 8), TableSpec("a", 1, 8)])
    with pytest.raises(TableFileError, match="invalid table name"):
        TableFileWriter(str(path), [TableSpec("bad name", 1, 8)])


def test_demo_rows_deterministic_unique_and_engram_shaped(tmp_path):
    t = DemoTable("engram.layer1", 100_000, 264, 1)
    a, b = DemoRows(t, seed=3), DemoRows(t, seed=3)
    np.testing.assert_array_equal(a.rows(0, 1000), b.rows(0, 1000))
    np.testing.assert_array_equal(a.rows(500, 600), a.rows(0, 1000)[500:600])  # independent of chunking
    rows = a.rows(0, t.rows)
    assert len(np.unique(rows, axis=0)) == t.rows
    fp8, scales = rows[:, :256], rows[:, 256:]
    assert not ((fp8 & 0x7F) == 0x7F).any()  # no e4m3 NaN encodings
    assert scales.min() >= 112 and scales.max() <= 127
    assert not np.array_equal(DemoRows(t, seed=4).rows(0, 10), a.rows(0, 10))
    other = DemoRows(DemoTable("x", 1000, 40), seed=3).rows(0, 1000)
    assert len(np.unique(other, axis=0)) == 1000
    path = write_demo_file(str(tmp_path / "d.bin"), default_tables(3000))
    assert [s.name for s in read_header(path).tables] == ["engram.layer1", "engram.layer14"]


# ---------------------------------------------------------------- bad files


@pytest.fixture
def good_file(tmp_path):
    return write_demo_file(str(tmp_path / "good.bin"), [DemoTable("t", 20_000, 264, 1)])


def _preamble(path):
    with open(path, "rb") as f:
        return PREAMBLE.unpack(f.read(PREAMBLE.size))


def _rewrite_header(path, mutate):
    magic, version, flags, n, _crc, r, data_offset = _preamble(path)
    with open(path, "r+b") as f:
        f.seek(PREAMBLE.size)
        doc = json.loads(f.read(n))
        mutate(doc)
        raw = json.dumps(doc).encode()
        assert PREAMBLE.size + len(raw) <= data_offset
        f.seek(0)
        f.write(PREAMBLE.pack(magic, version, flags, len(raw), zlib.crc32(raw), r, data_offset) + raw)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "not found"),
        ("directory", "is a directory"),
        ("empty", "truncated table file"),
        ("magic", "not a tableserver table file"),
        ("version", "format version 9"),
        ("header-bytes", "corrupt header"),
        ("header-cut", "truncated table file"),
        ("data-cut", "truncated table file: table 't' ends at byte"),
        ("duplicate", "appears twice"),
        ("overlap", "overlap"),
        ("bad-rows", "bad header: table #0"),
        ("crc-count", "chunk checksums"),
    ],
)
def test_bad_files_are_named_precisely(good_file, tmp_path, case, message):
    path = good_file
    if case == "missing":
        path = str(tmp_path / "nope.bin")
    elif case == "directory":
        path = str(tmp_path)
    elif case == "empty":
        open(path, "w").close()
    elif case == "magic":
        with open(path, "r+b") as f:
            f.write(b"NOTTABLE")
    elif case == "version":
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<H", 9))
    elif case == "header-bytes":
        with open(path, "r+b") as f:
            f.seek(PREAMBLE.size + 10)
            f.write(b"#")
    elif case == "header-cut":
        os.truncate(path, PREAMBLE.size + 5)
    elif case == "data-cut":
        os.truncate(path, os.path.getsize(path) - 1)
    elif case == "duplicate":
        _rewrite_header(path, lambda d: d["tables"].append(dict(d["tables"][0])))
    elif case == "overlap":

        def two(d):
            t = dict(d["tables"][0], name="u", rows=10, nbytes=2640)
            t["chunk_crc32"] = ["00000000"]
            d["tables"].append(t)

        _rewrite_header(path, two)
    elif case == "bad-rows":
        _rewrite_header(path, lambda d: d["tables"][0].update(rows=-5))
    elif case == "crc-count":
        _rewrite_header(path, lambda d: d["tables"][0]["chunk_crc32"].pop())
    with pytest.raises(TableFileError, match=message) as e:
        read_header(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("io", ["direct", "buffered", "auto"])
def test_loader_reads_bit_exact_with_every_io_mode(tmp_path, io):
    """O_DIRECT reads (aligned body + buffered tail), buffered reads and the auto choice load the same bytes,
    holes included, from a real disk file and from tmpfs (no O_DIRECT there: it falls back)."""
    from tableserver.tables.loader import load_tables
    from tableserver.tables.sources import page_cache_fraction

    rng = np.random.default_rng(5)
    specs = [TableSpec("odd", 50_001, 264, layer=1), TableSpec("tiny", 3, 5), TableSpec("holes", 40_000, 264)]
    data = {s.name: rng.integers(0, 256, (s.rows, s.row_bytes), dtype=np.uint8) for s in specs}
    data["holes"][1000:39_000] = 0

    def fill(w, i, s):
        if s.name == "holes":
            w.append(i, data["holes"][:1000])
            w.skip(i, 38_000)
            w.append(i, data["holes"][39_000:])
        else:
            w.append(i, data[s.name])

    dirs = [tmp_path] + ([p for p in ["/dev/shm"] if os.access(p, os.W_OK)])
    # 1 MiB chunks (aligned) and 4100-byte chunks (O_DIRECT impossible: those chunks are read buffered)
    for d, chunk in [(d, c) for d in dirs for c in (1 << 20, 4100)]:
        path = _write(os.path.join(d, f"io-{io}-{os.getpid()}.bin"), specs, fill, chunk_bytes=chunk)
        try:
            assert 0.0 <= page_cache_fraction(path) <= 1.0
            with load_tables([path], hugepages="off", lock=False, progress="never", io=io) as tables:
                for s in specs:
                    np.testing.assert_array_equal(tables.by_name[s.name].data, data[s.name])
        finally:
            os.unlink(path)


def test_files_without_chunk_sha256_still_load_by_crc(tmp_path):
    """Files written before the SHA-256 digest: checked and identified by their CRC-32 chunks."""
    path = _write(
        tmp_path / "old.bin",
        [TableSpec("t", 1000, 264)],
        lambda w, i, s: w.append(i, np.full((1000, 264), 3, np.uint8)),
    )
    pre = PREAMBLE.unpack(open(path, "rb").read(PREAMBLE.size))
    with open(path, "r+b") as f:
        f.seek(PREAMBLE.size)
        doc = json.loads(f.read(pre[3]))
        for t in doc["tables"]:
            del t["chunk_sha256"]
        raw = json.dumps(doc).encode().ljust(pre[3])
        f.seek(0)
        f.write(PREAMBLE.pack(pre[0], pre[1], pre[2], len(raw), zlib.crc32(raw), pre[5], pre[6]) + raw)
    s = read_header(path).tables[0]
    assert s.chunk_sha256 is None and s.checksum == table_digest(s.chunk_crcs)
    assert s.chunk_ok(0, np.full(264 * 1000, 3, np.uint8)) and not s.chunk_ok(0, np.zeros(264 * 1000, np.uint8))
