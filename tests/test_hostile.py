"""Hostile and faulty inputs and peers (issue 12): every one is refused in one line, bounded, and the
server keeps serving the others."""

from __future__ import annotations

import json
import os
import resource
import time
import zlib

import pytest
from conftest import run_cli
from test_faults import assert_one_line_error

from tableserver.tables.demo import DemoTable, write_demo_file
from tableserver.tables.tablefile import FORMAT_VERSION, MAGIC, PREAMBLE


def _table_file(path, doc: bytes, data_bytes: int = 4 << 20) -> str:
    pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(doc), zlib.crc32(doc), 0, 1 << 21)
    with open(path, "wb") as f:
        f.write(pre + doc)
        f.truncate((1 << 21) + data_bytes)
    return str(path)


def _limited_memory():
    """The child may allocate at most 512 MiB of data: a header must not make it allocate per byte."""
    resource.setrlimit(resource.RLIMIT_DATA, (512 << 20, 512 << 20))


@pytest.mark.parametrize(
    "doc, needle",
    [
        (
            {
                "tables": [
                    {"name": "t", "rows": (4 << 20) // 264, "row_bytes": 264, "offset": 1 << 21, "chunk_crc32": []}
                ],
                "chunk_bytes": 1,
            },
            "chunk_bytes must be an integer in 4096..",
        ),
        ({"tables": [], "metadata": "x"}, "metadata is not an object"),
        (
            {
                "tables": [
                    {"name": "t", "rows": 10, "row_bytes": 8, "offset": 1 << 21, "chunk_crc32": ["0"], "metadata": [1]}
                ]
            },
            "metadata is not an object",
        ),
        (
            {"tables": [{"name": "t", "rows": 10, "row_bytes": 8, "offset": 1 << 21, "chunk_crc32": ["nothex"]}]},
            "hex strings",
        ),
    ],
)
def test_hostile_table_file_headers_are_one_line_errors_in_bounded_memory(tmp_path, doc, needle):
    path = _table_file(tmp_path / "h.bin", json.dumps(doc).encode())
    for cmd in (("inspect", path), ("--tables", path, "--listen", "127.0.0.1:0")):
        assert_one_line_error(run_cli(*cmd, preexec=_limited_memory), needle)


def test_a_header_nested_200k_deep_is_one_line(tmp_path):
    path = _table_file(tmp_path / "deep.bin", b"[" * 200_000 + b"]" * 200_000)
    assert_one_line_error(run_cli("inspect", path), "nested too deep")


def test_a_zero_width_safetensors_tensor_is_no_table(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = str(tmp_path / "zw.safetensors")
    save_file({"w": torch.zeros(10, 0), "ok": torch.ones(4, 2)}, path)
    res = run_cli("inspect", path)
    assert res.returncode == 0 and " ok " in res.stdout and " w " not in res.stdout, res.stdout + res.stderr


def test_writers_never_follow_a_planted_symlink(tmp_path, monkeypatch):
    """gen-demo / pack / --ready-file wrote through `PATH.tmp` (O_CREAT|O_TRUNC): a symlink planted there
    overwrote its target. Temp files are now unpredictable and created O_EXCL|O_NOFOLLOW."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "demo.bin"
    os.symlink(victim, str(out) + ".tmp")  # the old, predictable temp name
    res = run_cli("gen-demo", str(out), "--rows", "1000")
    assert res.returncode == 0, res.stderr
    assert victim.read_bytes() == b"precious"
    # even a planted symlink at the very name drawn is refused, not followed
    import tableserver.tables.tablefile as tf

    monkeypatch.setattr("secrets.token_hex", lambda n: "0" * (2 * n))
    os.symlink(victim, tmp_path / f".again.bin.{'0' * 16}.tmp")
    with pytest.raises(tf.TableFileError, match="cannot create a temporary file"):
        write_demo_file(str(tmp_path / "again.bin"), [DemoTable("t", 10, 8)])
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "again.bin").exists()


# ---------------------------------------------------------------------- control plane
def _open(address, timeout=30, **fields):
    import grpc

    from tableserver.v1 import tableserver_pb2 as pb
    from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        return pb_grpc.TableServiceStub(ch).OpenSession(pb.OpenSessionRequest(**fields), timeout=timeout)


def test_oversized_open_session_requests_are_refused_cheaply(fresh_daemon):
    import grpc

    d = fresh_daemon()
    for fields, code in (
        ({"transports": ["tcp"] * 830_000}, grpc.StatusCode.RESOURCE_EXHAUSTED),  # 3 MB message
        ({"transports": ["tcp"] * 1000}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"client_name": "x" * 5000}, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as e:
            _open(d.address, **fields)
        assert e.value.code() == code, e.value
    assert _open(d.address, transports=["tcp", "tcp", "shm"]).offers  # duplicates collapse, still served


def test_a_client_name_cannot_forge_log_lines(fresh_daemon):
    d = fresh_daemon()
    _open(d.address, client_name="evil\n2026-01-01T00:00:00.000Z tableserver[1] ERROR forged: line", transports=["tcp"])
    lines = d.log().splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines)
    assert any("evil\\x0a2026-01-01" in line for line in lines)


def test_session_opens_are_rate_limited_and_capped_per_peer(fresh_daemon):
    import grpc

    def outcomes(d, n):
        out = []
        for _ in range(n):
            try:
                _open(d.address, transports=["tcp"])
                out.append("ok")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                out.append(
                    "rate" if "retry later" in e.details() else "cap" if "session limit" in e.details() else e.details()
                )
        return out

    capped = fresh_daemon("--session-open-rate", "1000", "--max-sessions-per-peer", "8")
    assert outcomes(capped, 12) == ["ok"] * 8 + ["cap"] * 4
    limited = fresh_daemon("--session-open-rate", "0.01")  # burst 1, one more every 100 s
    assert outcomes(limited, 3) == ["ok", "rate", "rate"]


def test_the_catalog_says_when_it_did_not_verify(fresh_daemon, demo_file):
    """Before: with --no-verify the catalog advertised the file's checksum for data nobody checked.
    Now it says "unverified:", and a client pinning the SHA-256 digest refuses such a server."""
    from tableclient import ConnectError, TableClient

    from tableserver.tables.tablefile import read_header

    spec = read_header(demo_file).tables[0]
    assert spec.checksum.startswith("sha256:")
    d = fresh_daemon("--no-verify")
    with TableClient(d.address) as c:
        assert c.tables[spec.name].checksum == "unverified:" + spec.checksum
    with pytest.raises(ConnectError, match="refused"):
        TableClient(d.address, checksums={spec.name: spec.checksum})
    verified = fresh_daemon()
    with TableClient(verified.address, checksums={spec.name: spec.checksum}) as c:
        assert c.tables[spec.name].checksum == spec.checksum


def test_table_memory_without_the_write_seal_is_refused_for_shm():
    """The shm transport starts only over memory nobody can write: mode 0400 and F_SEAL_FUTURE_WRITE,
    checked at start (a kernel that refused the seal used to be ignored silently)."""
    import fcntl

    from tableserver.errors import TableServerError
    from tableserver.tables.memory import PinnedRegion
    from tableserver.transports.shm import check_read_only

    with PinnedRegion("t", 4096) as good:
        good.seal()
        check_read_only(good)  # the loader's own regions pass
    with PinnedRegion("t", 4096) as half:
        fcntl.fcntl(half.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # what an old kernel gives
        with pytest.raises(TableServerError, match="F_SEAL_FUTURE_WRITE needs Linux >= 5.1"):
            check_read_only(half)
    with PinnedRegion("t", 4096) as loose:
        loose.seal()
        os.fchmod(loose.fd, 0o644)
        with pytest.raises(TableServerError, match="mode 644, expected 0400"):
            check_read_only(loose)


def test_the_metrics_endpoint_holds_a_bounded_number_of_threads(fresh_daemon):
    """Before: one thread per connection to /metrics, forever for an idle one. Now at most 8 requests are
    served at once, each must arrive within 5 s, and extra connections are closed at once."""
    import socket
    import urllib.request

    from conftest import wait_for

    d = fresh_daemon()
    host, port = d.ready["metrics"].rsplit(":", 1)
    assert host == "127.0.0.1"  # loopback unless told otherwise

    def threads() -> int:
        with open(f"/proc/{d.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("Threads:")).split()[1])

    before = threads()
    idle = [socket.create_connection((host, int(port))) for _ in range(100)]
    try:
        time.sleep(0.5)
        assert threads() <= before + 8
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: threads() <= before, "the metrics threads to go")
    wait_for(
        lambda: (
            b"tableserver_serving 1.0" in urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read()
        ),
        "a scrape once the idle connections are gone",
    )


@pytest.mark.parametrize(
    "field, value", [("offset", float("inf")), ("rows", 1.5), ("row_bytes", "264"), ("layer", True), ("shape", "abc")]
)
def test_header_numbers_must_be_integers(tmp_path, field, value):
    """Found by the fuzzer: an offset of Infinity (JSON allows it) was an OverflowError traceback."""
    t = {"name": "t", "rows": 10, "row_bytes": 8, "offset": 1 << 21, "chunk_crc32": ["0"], field: value}
    path = _table_file(tmp_path / "n.bin", json.dumps({"tables": [t]}).encode())
    assert_one_line_error(run_cli("inspect", path), field)
