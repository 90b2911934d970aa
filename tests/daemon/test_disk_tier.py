"""Disk tables (--disk-tables) served by the real daemon over tcp and the same-host path: bit-exact rows,
the catalog's tier, faults answered with IO_ERROR while everything else keeps being served, start-up
refusals, and the daemon's memory bounded by its I/O buffers, not the table."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, run_cli, start_daemon
from tableclient import RemoteError, TableClient
from tests_helpers import open_raw_session, scrape, tcp_hello, value

from tableserver.common.wire import FrameType, request_header, send_all
from tableserver.tables.demo import DemoTable, write_demo_file

DISK = "engram.layer14,dense.f32"


@pytest.fixture(scope="module")
def disk_daemon(demo_file, tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("disk")), "--tables", demo_file, "--disk-tables", DISK)
    yield d
    d.stop()


def _ids(rng, rows: int, shape) -> np.ndarray:
    ids = rng.integers(0, rows, shape)
    edges = np.array([0, rows - 1, 0, rows - 1, 1, 1, rows // 2, rows // 2]) % rows  # first, last, repeats
    ids.flat[: min(ids.size, 8)] = edges[: min(ids.size, 8)]
    return ids


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_disk_tables_bit_exact(disk_daemon, demo_local, transport):
    with TableClient(disk_daemon.address, transport=transport) as c:
        tiers = {name: c.table(name).info.tier for name in demo_local}
        assert tiers == {"engram.layer1": "memory", "engram.layer14": "disk", "dense.f32": "disk", "tiny": "memory"}
        rng = np.random.default_rng(3)
        for name, local in demo_local.items():
            t = c.table(name)
            for shape in [(1,), (24,), (64, 24), (6144,)]:
                ids = _ids(rng, t.rows, shape)
                np.testing.assert_array_equal(t.gather(ids), local[ids], err_msg=f"{transport} {name} {shape}")
        # both layers of a step at once: the disk layer's gather waits on the drive, the memory one does not
        l1, l14 = c.table("engram.layer1"), c.table("engram.layer14")
        a, b = _ids(rng, l1.rows, (1536,)), _ids(rng, l14.rows, (1536,))
        h1, h14 = l1.gather_async(a), l14.gather_async(b)
        np.testing.assert_array_equal(h14.wait(), demo_local["engram.layer14"][b])
        np.testing.assert_array_equal(h1.wait(), demo_local["engram.layer1"][a])


def test_disk_tables_sealed_tcp(demo_file, demo_local, tmp_path):
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--disk-tables", "all", "--data-encryption", "on")
    try:
        with TableClient(d.address, transport="tcp") as c:
            rng = np.random.default_rng(4)
            for name, local in demo_local.items():
                ids = _ids(rng, local.shape[0], (700,))
                np.testing.assert_array_equal(c.table(name).gather(ids), local[ids])
    finally:
        d.stop()


def test_disk_tables_metrics_count_reads(disk_daemon):
    with TableClient(disk_daemon.address, transport="tcp") as c:
        c.table("engram.layer14").gather(np.arange(0, 6000, 3))
    port = disk_daemon.ready["metrics"].rsplit(":", 1)[1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values['tableserver_table_on_disk{table="engram.layer14"}'] == 1.0
    assert values['tableserver_table_on_disk{table="engram.layer1"}'] == 0.0
    # 2,000 rows 3 rows apart span 6,000 * 264 B: every 4 KiB page of that range read once, none twice
    pages = values['tableserver_disk_pages_read_total{table="engram.layer14"}']
    assert pages >= -(-6000 * 264 // 4096)
    assert values['tableserver_disk_gathers_total{table="engram.layer14"}'] >= 1
    assert values['tableserver_disk_buffer_bytes{table="engram.layer14"}'] > 0


def test_no_verify_is_honest_in_the_catalog(demo_file, demo_local, tmp_path):
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--disk-tables", "all", "--no-verify")
    try:
        with TableClient(d.address, transport="tcp") as c:
            t = c.table("engram.layer14")
            assert t.info.checksum.startswith("unverified:")
            np.testing.assert_array_equal(t.gather([5, 6]), demo_local["engram.layer14"][[5, 6]])
    finally:
        d.stop()


def test_unknown_disk_table_is_one_line(demo_file):
    r = run_cli("serve", "--tables", demo_file, "--disk-tables", "engram.layer99", "--listen", "127.0.0.1:0")
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and "--disk-tables engram.layer99: no such table" in err[0], r.stderr


def test_truncated_disk_table_refused_at_start(demo_file, tmp_path):
    path = str(tmp_path / "cut.bin")
    shutil.copy(demo_file, path)
    os.truncate(path, os.path.getsize(path) - 5000)
    r = run_cli("serve", "--tables", path, "--disk-tables", "all", "--no-verify", "--listen", "127.0.0.1:0")
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and "truncated" in err[0] and path in err[0], r.stderr


def test_file_changed_under_the_daemon_fails_that_gather_only(demo_file, demo_local, tmp_path):
    path = str(tmp_path / "served.bin")
    shutil.copy(demo_file, path)
    d = start_daemon(str(tmp_path / "d"), "--tables", path, "--disk-tables", "engram.layer14")
    try:
        with TableClient(d.address, transport="tcp") as c, TableClient(d.address, transport="shm") as other:
            l14, l1 = c.table("engram.layer14"), c.table("engram.layer1")
            ids = np.arange(100, 400)
            np.testing.assert_array_equal(l14.gather(ids), demo_local["engram.layer14"][ids])
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # "written in place"
            for _ in range(2):  # every gather of the changed file fails, clearly; none returns rows
                with pytest.raises(RemoteError) as e:
                    l14.gather(ids)
                assert e.value.status == "IO_ERROR" and "modified" in e.value.message
            # the same connection, the memory table and other sessions go on being served
            np.testing.assert_array_equal(l1.gather(ids), demo_local["engram.layer1"][ids])
            np.testing.assert_array_equal(other.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])
        port = d.ready["metrics"].rsplit(":", 1)[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'tableserver_disk_read_errors_total{table="engram.layer14"} 2.0' in text
        assert 'tableserver_errors_total{reason="disk_io"} 2.0' in text
    finally:
        d.stop()


def _metric(d, series: str) -> float:
    port = d.ready["metrics"].rsplit(":", 1)[1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split(" ")[1])
    raise AssertionError(f"no {series} in /metrics")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_rss_bounded_while_16_clients_gather(tmp_path):
    """The daemon's memory holds its I/O buffers and reply buffers, never the table: its RSS while 16
    clients gather from a 400 MB disk table grows by less than 5% of the table."""
    path = write_demo_file(str(tmp_path / "big.bin"), [DemoTable("engram.layer14", 1_500_000, 264, 14)], seed=2)
    table_bytes = 1_500_000 * 264
    local = local_tables(path)["engram.layer14"]
    d = start_daemon(str(tmp_path / "d"), "--tables", path, "--disk-tables", "all")
    try:
        time.sleep(0.5)
        at_ready = _rss(d.proc.pid)
        peak = [at_ready]
        errors: list = []
        stop = threading.Event()

        def client(k: int) -> None:
            rng = np.random.default_rng(k)
            try:
                with TableClient(d.address, transport="tcp" if k % 2 else "shm") as c:
                    t = c.table("engram.layer14")
                    while not stop.is_set():
                        ids = rng.integers(0, t.rows, 1536)
                        if not np.array_equal(t.gather(ids), local[ids]):
                            errors.append(f"client {k}: wrong rows")
            except Exception as e:  # surfaced below
                errors.append(f"client {k}: {e!r}")

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            peak.append(_rss(d.proc.pid))
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(EVENT_TIMEOUT)
        assert not errors, errors[:3]
        grown = max(peak) - at_ready
        assert grown < 0.05 * table_bytes, f"RSS grew {grown >> 20} MiB serving a {table_bytes >> 20} MiB disk table"
        assert at_ready < table_bytes / 2, f"RSS {at_ready >> 20} MiB at SERVING for a {table_bytes >> 20} MiB table"
    finally:
        d.stop()


def test_disk_shard_beside_a_memory_shard(demo_file, demo_local, tmp_path):
    """Shard 0 of every table in one node's memory, shard 1 on another node's disk: one client gathers
    across both, bit-exact."""
    a = start_daemon(str(tmp_path / "a"), "--tables", demo_file, "--shard", "0/2", "--node-id", "mem")
    b = start_daemon(str(tmp_path / "b"), "--tables", demo_file, "--shard", "1/2", "--node-id", "disk",
                     "--disk-tables", "all")  # fmt: skip
    try:
        with TableClient(f"{a.address},{b.address}", transport="tcp") as c:
            rng = np.random.default_rng(5)
            for name, local in demo_local.items():
                ids = _ids(rng, local.shape[0], (3000,))
                np.testing.assert_array_equal(c.table(name).gather(ids), local[ids], err_msg=name)
    finally:
        a.stop()
        b.stop()


def test_io_error_fails_over_to_a_replica(demo_file, demo_local, tmp_path):
    """One replica's disk table file changes under it: the gather gets its rows from the other replica
    (both nodes stay up), and only a gather no replica can read raises IO_ERROR."""
    paths = [str(tmp_path / f"r{k}.bin") for k in range(2)]
    for p in paths:
        shutil.copy(demo_file, p)
    nodes = [
        start_daemon(str(tmp_path / f"d{k}"), "--tables", p, "--disk-tables", "engram.layer14", "--node-id", f"n{k}")
        for k, p in enumerate(paths)
    ]

    def touch(k: int) -> None:  # a changed file stays refused (its ctime moved: no utime puts it back)
        os.utime(paths[k], ns=(os.stat(paths[k]).st_atime_ns, os.stat(paths[k]).st_mtime_ns + 1_000_000_000))

    errors = 'tableserver_disk_read_errors_total{table="engram.layer14"}'
    gathers = 'tableserver_disk_gathers_total{table="engram.layer14"}'
    try:
        with TableClient(",".join(n.address for n in nodes), transport="tcp") as c:
            t = c.table("engram.layer14")
            ids = np.arange(0, 3000, 2)
            want = demo_local["engram.layer14"][ids]
            np.testing.assert_array_equal(t.gather(ids), want)
            preferred = max(range(2), key=lambda k: _metric(nodes[k], gathers))  # the replica that served it
            touch(preferred)  # the client's preferred replica fails its reads: the gathers move on
            for _ in range(3):
                np.testing.assert_array_equal(t.gather(ids), want)
                np.testing.assert_array_equal(t.gather_async(ids).wait(), want)
            assert _metric(nodes[preferred], errors) >= 1  # it refused, and the gather moved on
            touch(1 - preferred)
            with pytest.raises(RemoteError) as e:
                t.gather(ids)
            assert e.value.status == "IO_ERROR"
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])
    finally:
        for n in nodes:
            n.stop()


def test_doctor_checks_disk_tables(demo_file):
    r = run_cli("doctor", "--tables", demo_file, "--disk-tables", "engram.layer14")
    lines = r.stdout.splitlines()
    disk = [line for line in lines if "disk tables:" in line]
    assert disk and disk[0].startswith("ok") and "engram.layer14" in disk[0], r.stdout
    assert any(line.startswith("ok") and "1 served from disk" in line for line in lines), r.stdout
    r = run_cli("doctor", "--tables", demo_file, "--disk-tables", "nope")
    assert r.returncode == 1 and "--disk-tables nope: no such table" in r.stdout


def test_striped_disk_table(demo_file, demo_local, tmp_path):
    """`tableserver stripe` deals layer 14 over three files; the daemon serves it from them (verified
    through the stripes at start), bit-exact; stripes in the wrong order or a wrong unit are refused
    at start with one line."""
    stripes = [str(tmp_path / f"nvme{k}" / "layer14.stripe") for k in range(3)]
    for s in stripes:
        os.makedirs(os.path.dirname(s))
    unit = 64 << 10  # small, so that a 18 MB table spreads over every file many times
    r = run_cli("stripe", demo_file, *stripes, "--table", "engram.layer14", "--unit", str(unit))
    assert r.returncode == 0, r.stderr
    nbytes = demo_local["engram.layer14"].nbytes
    assert sum(os.path.getsize(s) for s in stripes) == nbytes
    arg = "engram.layer14=" + ":".join(stripes)
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--disk-stripes", arg, "--disk-stripe-unit", str(unit))
    try:
        assert "striped over 3 files" in d.log()
        for transport in ("tcp", "shm"):
            with TableClient(d.address, transport=transport) as c:
                t = c.table("engram.layer14")
                assert t.info.tier == "disk" and not t.info.checksum.startswith("unverified")
                ids = _ids(np.random.default_rng(8), t.rows, (5000,))
                np.testing.assert_array_equal(t.gather(ids), demo_local["engram.layer14"][ids])
                l1 = c.table("engram.layer1")
                assert l1.info.tier == "memory"
                few = ids[:100] % l1.rows
                np.testing.assert_array_equal(l1.gather(few), demo_local["engram.layer1"][few])
    finally:
        d.stop()
    for bad in (
        ("--disk-stripes", "engram.layer14=" + ":".join(stripes[::-1]), "--disk-stripe-unit", str(unit)),
        ("--disk-stripes", arg, "--disk-stripe-unit", str(2 * unit)),
        ("--disk-stripes", "engram.layer14=" + stripes[0]),
    ):
        r = run_cli("serve", "--tables", demo_file, "--listen", "127.0.0.1:0", "--progress", "never", *bad)
        assert r.returncode != 0
        err = [line for line in r.stderr.splitlines() if "error:" in line]
        assert len(err) == 1 and ("stripe" in err[0] or "truncated" in err[0]), r.stderr


@pytest.fixture(scope="module")
def aligned_file(tmp_path_factory):
    """The small demo tables again, page-aligned (15 rows of 264 B per 4 KiB page)."""
    path = str(tmp_path_factory.mktemp("aligned") / "aligned.bin")
    r = run_cli("gen-demo", path, "--rows", "40000", "--layers", "1,14", "--seed", "7", "--page-aligned")
    assert r.returncode == 0, r.stderr
    return path


def _aligned_rows(path: str) -> dict:
    from tableserver.tables.tablefile import logical_bytes, read_header

    mm = np.memmap(path, np.uint8, "r")
    return {s.name: logical_bytes(mm, s, 0, s.nbytes).reshape(s.rows, s.row_bytes) for s in read_header(path).tables}


def test_page_aligned_file(aligned_file, demo_file):
    """A page-aligned file: format version 2, one table page per 15 rows, the same rows and identity as
    the row-major file of the same tables, inspect verifies it."""
    from tableserver.tables.demo import DemoRows, DemoTable
    from tableserver.tables.tablefile import read_header

    with open(aligned_file, "rb") as f:
        assert int.from_bytes(f.read(10)[8:10], "little") == 2
    specs = {s.name: s for s in read_header(aligned_file).tables}
    s14 = specs["engram.layer14"]
    assert s14.rows_per_page == 15 and s14.file_bytes == -(-40000 // 15) * 4096
    rows = _aligned_rows(aligned_file)
    expected = DemoRows(DemoTable("engram.layer14", 40000, 264, 14), seed=7).rows(0, 40000)
    np.testing.assert_array_equal(rows["engram.layer14"], expected)
    r = run_cli("inspect", aligned_file)
    assert r.returncode == 0 and r.stdout.count("ok ") == 2, r.stdout


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_page_aligned_tables_served(aligned_file, tmp_path, where):
    """Served from memory (compacted at load) or from disk (one page per row): bit-exact over tcp and
    shm; on disk, a gather of 15 rows of one page reads that page alone."""
    rows = _aligned_rows(aligned_file)
    extra = ("--disk-tables", "all") if where == "disk" else ()
    d = start_daemon(str(tmp_path / "d"), "--tables", aligned_file, *extra)
    try:
        for transport in ("tcp", "shm"):
            with TableClient(d.address, transport=transport) as c:
                for name, local in rows.items():
                    t = c.table(name)
                    assert t.info.tier == where
                    ids = _ids(np.random.default_rng(9), t.rows, (3000,))
                    np.testing.assert_array_equal(t.gather(ids), local[ids], err_msg=f"{where} {transport}")
        if where == "disk":
            series = 'tableserver_disk_pages_read_total{table="engram.layer14"}'
            before = _metric(d, series)
            with TableClient(d.address, transport="tcp") as c:
                c.table("engram.layer14").gather(np.arange(150, 165))  # page 10's 15 rows
            assert _metric(d, series) - before == 1
    finally:
        d.stop()


def test_page_aligned_disk_shard(aligned_file, tmp_path):
    """A page-aligned disk table's rows 1007.. (not on a page boundary) on one node, rows ..1006 in another's
    memory: one client gathers across both, bit-exact."""
    rows = _aligned_rows(aligned_file)["engram.layer14"]
    a = start_daemon(str(tmp_path / "a"), "--tables", aligned_file, "--rows", "0:1007", "--node-id", "a")
    b = start_daemon(str(tmp_path / "b"), "--tables", aligned_file, "--disk-tables", "all", "--rows", "1007:40000",
                     "--node-id", "b")  # fmt: skip
    try:
        with TableClient(f"{a.address},{b.address}", transport="tcp") as c:
            ids = _ids(np.random.default_rng(10), 40000, (4000,))
            np.testing.assert_array_equal(c.table("engram.layer14").gather(ids), rows[ids])
        assert _metric(b, 'tableserver_disk_gathers_total{table="engram.layer14"}') >= 1
    finally:
        a.stop()
        b.stop()


# -- the served file is the verified file (issue 34) ---------------------------------------------------


def _same_shape_files(tmp_path, page_aligned: bool = False) -> tuple[str, str]:
    """Two table files of one shape and other rows (an atomic re-pack of the same model, say)."""
    tables = [DemoTable("engram.layer14", 40_000, 264, 14)]
    a = write_demo_file(str(tmp_path / "engram.bin"), tables, seed=1, page_aligned=page_aligned)
    b = write_demo_file(str(tmp_path / "other.bin"), tables, seed=2, page_aligned=page_aligned)
    return a, b


def _served_rows(tables, name: str, ids: np.ndarray) -> np.ndarray:
    t = tables.by_name[name]
    out = np.empty((ids.size, t.row_bytes), np.uint8)
    t.disk.gather(ids, out)
    return out


@pytest.mark.parametrize("layout", ["row-major", "page-aligned", "striped", "shard"])
def test_disk_table_replaced_while_verifying_is_never_served(tmp_path, layout):
    """`rename(other.bin, engram.bin)` (or over a stripe file) while the loader verifies a disk table: the
    start fails with one line naming the change; it never serves the other file's rows under the first
    file's checksum."""
    from tableserver.errors import TableFileError
    from tableserver.tables.loader import load_tables

    path, other = _same_shape_files(tmp_path, page_aligned=layout == "page-aligned")
    kw: dict = {"disk_tables": ["all"]}
    victim, replacement = path, other
    if layout == "striped":
        stripes = [str(tmp_path / f"s{k}.stripe") for k in range(2)]
        others = [str(tmp_path / f"o{k}.stripe") for k in range(2)]
        for src, outs in ((path, stripes), (other, others)):
            r = run_cli("stripe", src, *outs, "--table", "engram.layer14", "--unit", str(64 << 10))
            assert r.returncode == 0, r.stderr
        kw = {"disk_stripes": {"engram.layer14": stripes}, "disk_stripe_unit": 64 << 10}
        victim, replacement = stripes[1], others[1]
    elif layout == "shard":
        kw["shard"] = (1, 2)
    swapped = []

    def swap_once():  # called as verified bytes arrive: the file changes under the verification
        if not swapped:
            os.rename(replacement, victim)
            swapped.append(True)

    try:
        tables = load_tables([path], cancel=swap_once, progress="never", lock=False, disk_timeout=5.0, **kw)
    except TableFileError as e:
        assert swapped
        assert "was replaced" in str(e) and "restart once the file is final" in str(e), e
        assert "\n" not in str(e), e
        return
    with tables:  # before the fix: served, every row the other file's, under the first file's checksum
        ids = np.arange(0, tables.by_name["engram.layer14"].rows, 997)
        served = _served_rows(tables, "engram.layer14", ids)
        pytest.fail(f"served {served.shape[0]} rows of a file that changed while it was verified")


def test_disk_table_replaced_after_its_header_is_refused(tmp_path):
    """A file replaced between the header read and the reader's open: the reader refuses it (one line)."""
    from tableserver.disk.reader import DiskReadError, DiskTable
    from tableserver.errors import TableFileError
    from tableserver.tables.sources import TableFileSource

    path, other = _same_shape_files(tmp_path)
    source = TableFileSource(path)
    spec = source.specs[0]
    os.rename(other, path)
    with pytest.raises(DiskReadError, match="since it was first opened") as e:
        DiskTable(path, spec.offset, spec.rows, spec.row_bytes, expect=[source.identity])
    assert "\n" not in str(e.value)
    with ThreadPoolExecutor(2) as pool, pytest.raises(TableFileError, match="since its header was read"):
        source.verify(spec, pool, lambda n: None)


def test_same_size_write_with_mtime_restored_is_detected(tmp_path):
    """A same-size in-place write that puts the mtime back with utime: the ctime still moves, and the next
    gather raises instead of returning the rewritten rows."""
    from tableserver.disk.reader import DiskReadError, DiskTable
    from tableserver.tables.sources import TableFileSource

    path, other = _same_shape_files(tmp_path)
    spec = TableFileSource(path).specs[0]
    want = np.array(local_tables(path)["engram.layer14"])  # a copy: the file is written below
    with DiskTable(path, spec.offset, spec.rows, spec.row_bytes, io="threads") as reader:
        ids = np.arange(20) * 1999
        np.testing.assert_array_equal(reader.gather(ids), want[ids])
        st = os.stat(path)
        replacement = local_tables(other)["engram.layer14"]
        with open(path, "r+b") as f:
            for i in ids:
                f.seek(spec.offset + int(i) * spec.row_bytes)
                f.write(replacement[i].tobytes())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size
        with pytest.raises(DiskReadError, match="ctime changed"):
            reader.gather(ids)


# -- hostile clients of the disk tier (issue 34) ----------------------------------------------------


@pytest.fixture(scope="module")
def big_disk_file(tmp_path_factory) -> str:
    """A 200,000-row Engram table, served from disk by the tests below (65,536-row gathers read for long)."""
    path = str(tmp_path_factory.mktemp("bigdisk") / "big.bin")
    return write_demo_file(path, [DemoTable("engram.layer14", 200_000, 264, 14)], seed=5)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def _raw_gather(d, session, ids: np.ndarray, repeat: int = 1) -> tuple[socket.socket | None, int]:
    """A raw tcp connection of ``session`` that sends ``repeat`` gathers of ``ids`` (table 0) and reads
    nothing after its HELLO: (the socket, or None when the HELLO was refused; the HELLO's status)."""
    host, port = d.ready["tcp"].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    status, _ = tcp_hello(s, session.session_id, session.secret)
    if status != 0:
        s.close()
        return None, status
    for k in range(repeat):
        send_all(s, [request_header(FrameType.GATHER, k + 1, 0, ids.size), ids.astype("<i8")])
    return s, status


def _reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # RST: the client is gone at once


def test_clients_that_leave_while_parked_free_their_slots_reads_and_memory(big_disk_file, tmp_path):
    """Rounds of 8 connections (one session's cap) each sending a 65,536-row disk gather, then, once the
    daemon has taken every request, resetting: the daemon sees each hang-up while the gather is parked and
    cancels it (the reads stop: far fewer pages than the gathers' are read), frees the slot (every later
    HELLO is accepted) and the rows (RSS flat over rounds)."""
    d = start_daemon(str(tmp_path / "d"), "--tables", big_disk_file, "--disk-tables", "all", "--progress", "never")
    table = {"table": "engram.layer14"}

    def counts() -> dict:
        f = scrape(d.ready["metrics"])
        return {k: value(f, f"tableserver_disk_{k}", **table) for k in
                ("pages_read_total", "gathers_total", "cancelled_gathers_total", "queued_gathers")}  # fmt: skip

    try:
        session = open_raw_session(d.address)
        rng = np.random.default_rng(9)
        refused, rss, cancelled = 0, [], 0
        for _ in range(4):
            before = counts()
            socks, full_pages = [], 0
            for _ in range(8):
                ids = rng.integers(0, 200_000, 65_536)
                full_pages += np.unique(np.concatenate(((ids * 264) >> 12, (ids * 264 + 263) >> 12))).size
                s, status = _raw_gather(d, session, ids)
                if s is None:
                    refused += 1
                else:
                    socks.append(s)
            taken = lambda c: c["queued_gathers"] + c["gathers_total"] - before["gathers_total"]  # noqa: E731
            wait_until = time.monotonic() + 120
            while taken(counts()) < len(socks):  # every request read and queued (or, the first, already done)
                assert time.monotonic() < wait_until, "the daemon never took the requests"
                time.sleep(0.01)
            for s in socks:
                _reset(s)
            while counts()["queued_gathers"]:
                assert time.monotonic() < wait_until, "the disk queue never drained"
                time.sleep(0.05)
            after = counts()
            done = after["gathers_total"] - before["gathers_total"]
            stopped = after["cancelled_gathers_total"] - before["cancelled_gathers_total"]
            assert done + stopped == len(socks), (done, stopped)
            pages = after["pages_read_total"] - before["pages_read_total"]
            assert pages < 0.5 * full_pages, f"read {pages:.0f} of {full_pages} pages for clients that left"
            cancelled += stopped
            rss.append(_rss(d.proc.pid))
        assert cancelled >= 16, f"only {cancelled} of 32 gathers of departed clients were stopped"
        assert value(scrape(d.ready["metrics"]), "tableserver_errors_total", reason="disconnect") >= cancelled
        assert refused == 0, f"{refused} of 32 HELLOs refused: departed connections still held their slots"
        assert rss[-1] - rss[0] < 64 << 20, f"RSS over rounds {[r >> 20 for r in rss]} MiB"
        with TableClient(d.address, transport="tcp") as c:  # and the daemon serves on
            ids = rng.integers(0, 200_000, 24)
            np.testing.assert_array_equal(
                c.table("engram.layer14").gather(ids), local_tables(big_disk_file)["engram.layer14"][ids]
            )
    finally:
        d.stop()


def test_unread_disk_gathers_stay_inside_the_budget_and_others_are_served(big_disk_file, tmp_path):
    """4 sessions x 8 connections, each sending two 65,536-row disk gathers and never reading: the rows the
    daemon holds stay inside --disk-buffer-mib (RSS with them), and another client's small disk gathers
    are served bit-exact meanwhile."""
    d = start_daemon(str(tmp_path / "d"), "--tables", big_disk_file, "--disk-tables", "all", "--progress", "never",
                     "--disk-buffer-mib", "64")  # fmt: skip
    socks = []
    try:
        metrics = d.ready["metrics"]
        want = local_tables(big_disk_file)["engram.layer14"]
        rng = np.random.default_rng(10)
        with TableClient(d.address, transport="tcp") as c:
            t = c.table("engram.layer14")
            t.gather(rng.integers(0, 200_000, 24))
            base = _rss(d.proc.pid)
            for _ in range(4):
                session = open_raw_session(d.address)
                for _ in range(8):
                    s, status = _raw_gather(d, session, rng.integers(0, 200_000, 65_536), repeat=2)
                    assert s is not None, f"HELLO refused ({status})"
                    socks.append(s)
            held = []
            for _ in range(40):
                ids = rng.integers(0, 200_000, 24)
                np.testing.assert_array_equal(t.gather(ids), want[ids])
                held.append(value(scrape(metrics), "tableserver_disk_rows_held_bytes"))
            grown = _rss(d.proc.pid) - base
        assert max(held) <= 64 << 20, f"disk rows held {max(held) / 2**20:.0f} MiB, the budget is 64 MiB"
        assert max(held) > 0  # the flood's gathers were read and are held, unsent
        assert grown < 160 << 20, f"RSS grew {grown >> 20} MiB under the flood"
    finally:
        for s in socks:
            _reset(s)
        d.stop()
