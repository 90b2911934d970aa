"""A table larger than 4 GiB: byte offsets past 2^32 in the file, in memory and on the wire."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import local_tables, start_daemon
from tableclient import TableClient

from tableserver.tables.demo import DemoRows, DemoTable
from tableserver.tables.tablefile import TableFileWriter, read_header

pytestmark = pytest.mark.slow

ROWS = 18_000_000  # x 264 B = 4.42 GiB
BOUNDARY_ROW = (1 << 32) // 264  # the row that straddles byte 4 GiB
REAL = [(0, 50_000), (BOUNDARY_ROW - 60_000, BOUNDARY_ROW + 60_000), (ROWS - 50_000, ROWS)]


@pytest.fixture(scope="module")
def large_file(tmp_path_factory):
    """Real rows at the start, around byte 4 GiB and at the end; zeros (sparse) between."""
    path = str(tmp_path_factory.mktemp("large") / "large.bin")
    big, after = DemoTable("big", ROWS, 264, 1), DemoTable("after", 10_000, 264, 14)
    with TableFileWriter(path, [big.spec(), after.spec()]) as w:
        gen, pos = DemoRows(big), 0
        for a, b in REAL:
            w.skip(0, a - pos)
            for s in range(a, b, 65_536):
                w.append(0, gen.rows(s, min(s + 65_536, b)))
            pos = b
        w.append(1, DemoRows(after).rows(0, after.rows))
    return path


def test_large_table_bit_exact(large_file, tmp_path):
    header = read_header(large_file)
    assert header.tables[0].nbytes > 1 << 32 and header.tables[1].offset > 1 << 32
    local = local_tables(large_file)
    d = start_daemon(str(tmp_path / "d"), "--tables", large_file)
    try:
        rng = np.random.default_rng(0)
        ids = np.concatenate(
            [rng.integers(a, b, 2000) for a, b in REAL]
            + [
                rng.integers(0, ROWS, 500),  # zero regions too
                np.arange(BOUNDARY_ROW - 3, BOUNDARY_ROW + 4),
                [0, ROWS - 1],
            ]
        )
        assert (ids.astype(np.int64) * 264 > 1 << 32).sum() > 2000
        for transport in ("shm", "tcp"):
            with TableClient(d.address, transport=transport) as c:
                rows = c.table("big").gather(ids)
                np.testing.assert_array_equal(rows, local["big"][ids])
                assert rows[-1].any() and rows[0].any()  # real, non-zero rows at both ends
                after = np.arange(0, 10_000, 7)
                np.testing.assert_array_equal(c.table("after").gather(after), local["after"][after])
    finally:
        d.stop()


def test_large_table_from_disk(large_file, tmp_path):
    """The same table served from disk (--disk-tables): page reads at byte offsets past 4 GiB, over tcp and
    the same-host rows socket."""
    local = local_tables(large_file)
    d = start_daemon(str(tmp_path / "d"), "--tables", large_file, "--disk-tables", "all")
    try:
        rng = np.random.default_rng(1)
        ids = np.concatenate(
            [rng.integers(a, b, 1000) for a, b in REAL] + [np.arange(BOUNDARY_ROW - 3, BOUNDARY_ROW + 4), [0, ROWS - 1]]
        )
        assert (ids.astype(np.int64) * 264 > 1 << 32).sum() > 1000
        for transport in ("shm", "tcp"):
            with TableClient(d.address, transport=transport) as c:
                t = c.table("big")
                assert t.info.tier == "disk"
                rows = t.gather(ids)
                np.testing.assert_array_equal(rows, local["big"][ids])
                assert rows[-1].any() and rows[0].any()
                after = np.arange(0, 10_000, 7)
                np.testing.assert_array_equal(c.table("after").gather(after), local["after"][after])
    finally:
        d.stop()
