"""Row-range shards and catalog identity, server side: --shard K/N, --rows LO:HI, --node-id."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import local_tables, run_cli, start_daemon
from tableclient import ConnectError, TableClient
from tableclient.node import NodeOptions, NodeSession
from tests_helpers import assert_one_line_error

from tableserver.tables.demo import DemoRows, DemoTable
from tableserver.tables.tablefile import TableFileWriter, read_header

ROWS = 20_000


@pytest.fixture(scope="module")
def chunked_file(tmp_path_factory):
    """Two tables in 64 KiB checksum chunks, so a row range starts and ends inside chunks."""
    path = str(tmp_path_factory.mktemp("shards") / "chunked.bin")
    tables = [DemoTable("engram.layer1", ROWS, 264, 1), DemoTable("engram.layer14", ROWS + 7, 264, 14)]
    with TableFileWriter(path, [t.spec() for t in tables], chunk_bytes=64 << 10) as w:
        for i, t in enumerate(tables):
            w.append(i, DemoRows(t, 3).rows(0, t.rows))
    return path


@pytest.mark.parametrize(
    "flags, ranges",
    [
        (("--shard", "1/3"), lambda rows: (rows // 3, 2 * rows // 3)),
        (("--shard", "2/3"), lambda rows: (2 * rows // 3, rows)),
        (("--rows", "5000:12345"), lambda rows: (5000, 12345)),
    ],
)
def test_a_server_holds_and_serves_its_row_range(chunked_file, tmp_path, flags, ranges):
    local = local_tables(chunked_file)
    full = {s.name: s for s in read_header(chunked_file).tables}
    d = start_daemon(str(tmp_path / "d"), "--tables", chunked_file, "--node-id", "memnode-b", *flags)
    node = NodeSession(d.address, NodeOptions(transport="tcp"))  # one server's own view: rows from row_lo
    try:
        assert node.server.node_id == "memnode-b"
        for name, spec in full.items():
            info = node.tables[name]
            lo, hi = ranges(spec.rows)
            assert (info.row_lo, info.rows, info.total_rows) == (lo, hi - lo, spec.rows)
            assert info.checksum == spec.checksum  # the whole table's identity, not the range's
            ids = np.concatenate([np.arange(0, hi - lo, 37), [hi - lo - 1]])  # ids of the held rows
            out = np.empty((ids.size, 264), np.uint8)
            node.data.gather(info.index, ids, out).wait(60)
            np.testing.assert_array_equal(out, local[name][ids + lo])
        # a client needs every row of every table: one shard alone is refused, naming what is missing
        with pytest.raises(
            ConnectError,
            match=f"rows 0..{ranges(ROWS)[0] - 1} of 'engram.layer1' are on no node"
            if ranges(ROWS)[0]
            else "are on no node",
        ):
            TableClient(d.address, transport="tcp")
    finally:
        node.close()
        d.stop()
    assert "(rows " in d.log()


def test_node_id_defaults_to_the_hostname(daemon):
    import socket

    with TableClient(daemon.address, transport="tcp") as c:
        assert c.server.node_id == socket.gethostname()


def test_a_corrupt_byte_outside_the_range_but_inside_a_boundary_chunk_is_caught(chunked_file, tmp_path):
    """Boundary chunks are read whole and checked: the range is verified by the file's own CRCs."""
    import shutil

    bad = str(tmp_path / "bad.bin")
    shutil.copy(chunked_file, bad)
    spec = read_header(bad).tables[0]
    lo = 5000 * 264  # --rows 5000:... starts inside the chunk [4.x chunks of 64 KiB]
    chunk_start = lo // (64 << 10) * (64 << 10)
    assert chunk_start < lo
    with open(bad, "r+b") as f:
        f.seek(spec.offset + chunk_start + 10)  # before our first row, same chunk
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x55]))
    res = run_cli("--tables", bad, "--listen", "127.0.0.1:0", "--rows", "5000:6000", "--progress", "never")
    assert_one_line_error(res, "checksum mismatch in table 'engram.layer1'")
    d = start_daemon(str(tmp_path / "nv"), "--tables", bad, "--rows", "5000:6000", "--no-verify")
    d.stop()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (("--shard", "3/3"), "--shard '3/3': expected K/N with 0 <= K < N"),
        (("--shard", "half"), "--shard 'half': expected K/N"),
        (("--rows", "9:3"), "--rows '9:3': expected LO:HI with 0 <= LO < HI"),
        (("--rows", "0:1000000"), "--rows 0:1000000: table 'engram.layer1' has only 20000 rows"),
        (("--rows", "1:2", "--shard", "0/2"), "--shard and --rows both given"),
    ],
)
def test_bad_ranges_are_one_line_errors(chunked_file, flags, needle):
    assert_one_line_error(run_cli("--tables", chunked_file, "--listen", "127.0.0.1:0", *flags), needle)


def test_a_range_of_a_safetensors_file_is_refused(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = str(tmp_path / "t.safetensors")
    save_file({"w": torch.zeros(100, 8)}, path)
    assert_one_line_error(
        run_cli("--tables", path, "--listen", "127.0.0.1:0", "--shard", "0/2"),
        "serving a row range needs a table file with chunk checksums",
    )
