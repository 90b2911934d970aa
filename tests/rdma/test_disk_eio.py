"""Disk tables on a failing drive: a device-mapper ``error`` target over some pages of a table's rows.

Runs inside the QEMU guest with the RDMA suite (tests/host/test_rdma_guest.py boots it; the guest is root and its
initramfs loads dm-mod and loop, see vm.py): this machine's own kernel has no device-mapper. A table file is
attached to a loop device; a dm device maps it ``linear`` everywhere except an ``error`` target over a few
4 KiB pages inside one table's rows (and one page inside another's). Reads go through ``/dev/mapper/<name>``;
expected rows always come from the table file itself (``np.memmap``), which never fails.

Only one test here starts a daemon: the rest read with :class:`tableserver.disk.reader.DiskTable` directly.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import numpy as np
import pytest
import vm
from conftest import EVENT_TIMEOUT, local_tables, run_cli
from guest import SLOW_CLIENT, guest_daemon
from tableclient import TableClient
from tableclient.errors import RemoteError

from tableserver.disk.reader import DiskReadError, DiskTable
from tableserver.tables.demo import DemoTable, write_demo_file
from tableserver.tables.tablefile import read_header

pytestmark = pytest.mark.rdma

PAGE = 4096
SECTOR = 512
#: table sizes are whole pages (264 B x 512k rows, 384 B x 32k rows), so the file ends on a page too
TABLES = [DemoTable("disk.a", 16_384, 264, 1), DemoTable("disk.b", 3_072, 384, -1)]
#: table -> (first failing page, counted from the table's first byte; failing pages)
FAILING = {"disk.a": (100, 8), "disk.b": (17, 1)}


@dataclass
class FailingDisk:
    file: str  # the table file: never fails
    device: str  # /dev/mapper/<name>: the same bytes, except the failing pages
    specs: dict  # name -> TableSpec
    local: dict  # name -> rows read from the file
    bad: dict  # name -> the row ids with a byte in a failing page (sorted)
    loop: str  # the loop device under it (the file's bytes)
    failing: list  # the dm table of ``device``
    healthy: list  # a dm table of the loop device that never fails


def failing_rows(row_bytes: int, first_page: int, pages: int) -> np.ndarray:
    """Rows with at least one byte in table bytes [first_page * PAGE, (first_page + pages) * PAGE)."""
    lo, hi = first_page * PAGE, (first_page + pages) * PAGE
    return np.arange(lo // row_bytes, (hi - 1) // row_bytes + 1)


def dm_lines(size_sectors: int, loop: str, errors: list[tuple[int, int]]) -> list[str]:
    """A dm table: ``linear`` onto ``loop`` at the same sector everywhere but the ``(start, length)`` sector
    ranges in ``errors``, which are ``error``."""
    lines, at = [], 0
    for start, length in sorted(errors):
        assert at <= start and start + length <= size_sectors
        if start > at:
            lines.append(f"{at} {start - at} linear {loop} {at}")
        lines.append(f"{start} {length} error")
        at = start + length
    if at < size_sectors:
        lines.append(f"{at} {size_sectors - at} linear {loop} {at}")
    return lines


@pytest.fixture(scope="module")
def failing_disk(tmp_path_factory):
    path = write_demo_file(str(tmp_path_factory.mktemp("disk-eio") / "disk.bin"), TABLES, seed=5)
    size = os.path.getsize(path)
    assert size % PAGE == 0, size
    specs = {s.name: s for s in read_header(path).tables}
    errors, bad = [], {}
    for name, (first, pages) in FAILING.items():
        spec = specs[name]
        assert spec.offset % PAGE == 0 and (first + pages) * PAGE <= spec.nbytes
        errors.append(((spec.offset + first * PAGE) // SECTOR, pages * PAGE // SECTOR))
        bad[name] = failing_rows(spec.row_bytes, first, pages)
    loop = vm.loop_attach(path)
    name = f"ts-eio-{os.getpid()}"
    try:
        assert vm.sectors(loop) * SECTOR == size
        failing, healthy = dm_lines(size // SECTOR, loop, errors), dm_lines(size // SECTOR, loop, [])
        device = vm.dm_create(name, failing)
        try:
            assert vm.dm_table(name).count(" error") == len(FAILING), vm.dm_table(name)
            yield FailingDisk(path, device, specs, local_tables(path), bad, loop, failing, healthy)
        finally:
            vm.dm_remove(name)
    finally:
        vm.loop_detach(loop)


def test_the_device_fails_exactly_the_chosen_pages(failing_disk):
    """The fixture itself: each failing page gives EIO through the dm device, the pages next to it read
    like the file."""
    d = failing_disk
    fd = os.open(d.device, os.O_RDONLY)
    try:
        with open(d.file, "rb") as f:
            for name, (first, pages) in FAILING.items():
                at = d.specs[name].offset + first * PAGE
                for page in (at, at + (pages - 1) * PAGE):
                    with pytest.raises(OSError) as e:
                        os.pread(fd, PAGE, page)
                    assert e.value.errno == errno.EIO
                for page in (at - PAGE, at + pages * PAGE):
                    f.seek(page)
                    assert os.pread(fd, PAGE, page) == f.read(PAGE)
    finally:
        os.close(fd)


def open_disk_table(d: FailingDisk, name: str, io: str, direct: bool) -> DiskTable:
    spec = d.specs[name]
    # timeout: what a gather's reads may take (default 30 s), the event bound on a slow guest: a failing page
    # fails at once (EIO), never by the timeout
    return DiskTable(
        d.device, offset=spec.offset, rows=spec.rows, row_bytes=spec.row_bytes, direct=direct, queue_depth=8, io=io,
        timeout=EVENT_TIMEOUT,
    )  # fmt: skip


#: (table, read engine, O_DIRECT): every engine both ways on disk.a, the default engine on disk.b
CASES = [("disk.a", io, direct) for io in ("python", "threads", "io_uring") for direct in (True, False)]
CASES += [("disk.b", "auto", True), ("disk.b", "auto", False)]


@pytest.mark.parametrize(
    "name,io,direct", CASES, ids=[f"{n}-{io}-{'o_direct' if direct else 'buffered'}" for n, io, direct in CASES]
)
def test_a_failing_page_is_eio_and_never_a_wrong_row(failing_disk, name, io, direct):
    """A gather touching a failing page raises DiskReadError (EIO, naming the device); the next gathers of
    rows outside it are bit-exact; over many random gathers, each either raises (exactly when one of its
    rows is in a failing page) or is bit-exact -- never silently wrong. With each read engine, with O_DIRECT
    and through the page cache (a failed page is never cached as good)."""
    d = failing_disk
    local, bad = d.local[name], d.bad[name]
    rows = local.shape[0]
    before, after = int(bad[0]) - 1, int(bad[-1]) + 1  # the closest good rows, wholly outside
    good = np.array([0, before, after, rows - 1, before - 1, after + 1, before, 7])
    with open_disk_table(d, name, io, direct) as t:
        assert io in ("auto", t.engine), (t.engine, t.engine_reason)
        if direct:
            assert t.direct, t.io_mode  # a block device takes O_DIRECT
        np.testing.assert_array_equal(t.gather(good), local[good])
        for ids in ([bad[0]], [bad[-1]], [before, int(bad[len(bad) // 2]), after], [int(bad[0])] * 3 + [0]):
            for _ in range(2):  # and again: the failed read left nothing behind that reads as good
                with pytest.raises(DiskReadError) as e:
                    t.gather(np.array(ids))
                assert e.value.errno == errno.EIO, e.value
                assert d.device in str(e.value) and "read error" in str(e.value), e.value
            np.testing.assert_array_equal(t.gather(good), local[good])  # the next gather: exact
        rng = np.random.default_rng(17 + direct + 2 * len(io))
        failed = exact = 0
        for i in range(60):  # about half of them touch a failing page
            near = rng.integers(max(0, before - 300), min(rows, after + 300), 3)
            ids = np.concatenate([near, rng.integers(0, rows, 21 if i % 2 else 45)])
            if i % 5 == 0:
                ids[rng.integers(0, ids.size)] = rng.choice(bad)
            ids = ids.reshape(4, -1)
            if np.isin(ids, bad).any():
                with pytest.raises(DiskReadError) as e:
                    t.gather(ids)
                assert e.value.errno == errno.EIO and d.device in str(e.value), e.value
                failed += 1
            else:
                out = np.full(ids.shape + (t.row_bytes,), 0xEE, np.uint8)
                assert t.gather(ids, out) is out
                np.testing.assert_array_equal(out, local[ids])
                exact += 1
        assert failed >= 10 and exact >= 10, (failed, exact)
        np.testing.assert_array_equal(t.gather(good), local[good])


def test_daemon_answers_io_error_then_serves_exact_rows(failing_disk, tmp_path):
    """The daemon serving a dm device's tables from disk (verified at start, while the device is healthy),
    and then the drive fails under it: a client gather of a failing row gets RemoteError IO_ERROR (that
    request only), the following gathers are bit-exact, the daemon stays up; once the drive is healthy
    again, the rows that failed are served bit-exact too."""
    usage = run_cli("serve", "--help")
    if "--disk-tables" not in usage.stdout:
        pytest.skip("daemon has no --disk-tables yet")
    d = failing_disk
    name = f"ts-eio-live-{os.getpid()}"
    device = vm.dm_create(name, d.healthy)
    try:
        daemon = guest_daemon(str(tmp_path / "d"), "--tables", device, "--disk-tables", "all", "--transports", "tcp")
        try:
            with TableClient(daemon.address, transport="tcp", **SLOW_CLIENT) as c:
                for table in FAILING:
                    ids = d.bad[table]
                    np.testing.assert_array_equal(
                        c.table(table).gather(ids, timeout=EVENT_TIMEOUT), d.local[table][ids]
                    )
                vm.dm_reload(name, d.failing)  # the drive fails under the running daemon
                for table in FAILING:
                    t = c.table(table)
                    local, bad = d.local[table], d.bad[table]
                    before, after = int(bad[0]) - 1, int(bad[-1]) + 1
                    good = np.array([0, before, after, t.rows - 1])
                    np.testing.assert_array_equal(t.gather(good, timeout=EVENT_TIMEOUT), local[good])
                    for ids in ([int(bad[0])], [before, int(bad[-1]), after]):
                        for _ in range(2):
                            with pytest.raises(RemoteError) as e:
                                t.gather(ids, timeout=EVENT_TIMEOUT)
                            assert e.value.status == "IO_ERROR", e.value
                            np.testing.assert_array_equal(t.gather(good, timeout=EVENT_TIMEOUT), local[good])
                    rng = np.random.default_rng(23)
                    for i in range(20):
                        ids = rng.integers(max(0, before - 200), min(t.rows, after + 200), 32)
                        if i % 4 == 0:
                            ids[0] = rng.choice(bad)
                        if np.isin(ids, bad).any():
                            with pytest.raises(RemoteError) as e:
                                t.gather(ids, timeout=EVENT_TIMEOUT)
                            assert e.value.status == "IO_ERROR", e.value
                        else:
                            np.testing.assert_array_equal(t.gather(ids, timeout=EVENT_TIMEOUT), local[ids])
                vm.dm_reload(name, d.healthy)  # and heals: nothing of the failure stays behind
                for table in FAILING:
                    ids = d.bad[table]
                    np.testing.assert_array_equal(
                        c.table(table).gather(ids, timeout=EVENT_TIMEOUT), d.local[table][ids]
                    )
            assert daemon.proc.poll() is None, daemon.log()[-4000:]  # read errors never take the daemon down
        finally:
            daemon.stop()
    finally:
        vm.dm_remove(name)
