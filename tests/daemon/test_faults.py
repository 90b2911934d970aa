"""Bad input and faults: one-line errors, non-zero exits, and a server that keeps serving."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, ROOT, run_cli, start_daemon, wait_for
from tableclient import RemoteError, TableClient, TransportError
from tests_helpers import assert_one_line_error, assert_still_serving, open_raw_session, tcp_hello, tuple_of

from tableserver.common.wire import (
    HEADER,
    HEADER_BYTES,
    FrameType,
    Status,
    recv_challenge,
    recv_exact,
    request_header,
    send_all,
)
from tableserver.tables.demo import DemoTable, write_demo_file
from tableserver.tables.tablefile import TableFileWriter, TableSpec

# ------------------------------------------------------------------ the CLI


def test_missing_table_file(tmp_path):
    assert_one_line_error(
        run_cli("--tables", str(tmp_path / "nope.bin"), "--listen", "127.0.0.1:0"), "not found", "gen-demo"
    )


def test_no_tables():
    assert_one_line_error(run_cli("--listen", "127.0.0.1:0"), "no tables", code=2)


def test_truncated_and_corrupt_files(tmp_path, demo_file):
    cut = tmp_path / "cut.bin"
    with open(demo_file, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(demo_file) - 100))
    assert_one_line_error(run_cli("--tables", str(cut), "--listen", "127.0.0.1:0"), "truncated")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 4096)
    assert_one_line_error(run_cli("--tables", str(bad), "--listen", "127.0.0.1:0"), "not a tableserver table file")


def test_checksum_mismatch_is_refused_unless_no_verify(tmp_path, demo_local):
    path = write_demo_file(str(tmp_path / "flip.bin"), [DemoTable("t", 5000, 264, 1)])
    from tableserver.tables.tablefile import read_header

    spec = read_header(path).tables[0]
    with open(path, "r+b") as f:
        f.seek(spec.offset + 264 * 4321 + 17)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert_one_line_error(
        run_cli("--tables", path, "--listen", "127.0.0.1:0", "--progress", "never"),
        "checksum mismatch in table 't'",
        "--no-verify",
    )
    res = run_cli("inspect", path)
    assert res.returncode == 1 and "FAIL" in res.stdout
    d = start_daemon(str(tmp_path / "nv"), "--tables", path, "--no-verify")
    try:
        with TableClient(d.address, transport="tcp") as c:
            assert c.table("t").gather([4321])[0, 17] == byte[0] ^ 0xFF  # served as-is, unverified
    finally:
        d.stop()


def test_duplicate_table_names_across_files(tmp_path, demo_file):
    other = write_demo_file(str(tmp_path / "other.bin"), [DemoTable("engram.layer1", 10, 264, 1)])
    assert_one_line_error(
        run_cli("--tables", f"{demo_file},{other}", "--listen", "127.0.0.1:0"), "'engram.layer1' is defined in both"
    )


def test_memory_too_small(tmp_path):
    path = str(tmp_path / "huge.bin")
    rows = (64 << 30) // 264  # 64 GiB of zeros, sparse on disk: more than this machine has
    with TableFileWriter(path, [TableSpec("huge", rows, 264)]) as w:
        w.fill_zeros(0)
    assert_one_line_error(
        run_cli("--tables", path, "--listen", "127.0.0.1:0"),
        "the tables need 64.00 GiB of memory but only",
        "available",
    )


def _without_ipc_lock():
    """Runs the command without CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK otherwise)."""
    import shutil

    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to drop CAP_IPC_LOCK; .ci/run installs it")
    return [setpriv, "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock", "--"] if os.geteuid() == 0 else []


def test_memlock_limit_too_small(demo_file):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))

    cmd = [*_without_ipc_lock(), sys.executable, "-m", "tableserver", "--tables", demo_file, "--listen", "127.0.0.1:0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=EVENT_TIMEOUT, preexec_fn=limit, cwd=ROOT)
    assert_one_line_error(res, "locked-memory limit is 0.00 GiB", "ulimit -l unlimited", "LimitMEMLOCK=infinity")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_in_use(tmp_path, demo_file):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(
            run_cli("--tables", demo_file, "--listen", f"127.0.0.1:{port}"),
            f"control port 127.0.0.1:{port} is already in use",
            "--listen",
        )
        assert_one_line_error(
            run_cli(
                "--tables", demo_file, "--listen", f"127.0.0.1:{_free_port()}", "--tcp-listen", f"127.0.0.1:{port}"
            ),
            "tcp data port",
            "already in use",
            "--tcp-listen",
        )


def test_bad_flags_exit_2(demo_file):
    assert_one_line_error(
        run_cli("--tables", demo_file, "--lease-seconds", "soon"), "expected a number in 0.1..86400", code=2
    )
    assert_one_line_error(
        run_cli("--tables", demo_file, "--transports", "carrier-pigeon"), "unknown transport 'carrier-pigeon'", code=2
    )
    assert_one_line_error(run_cli("--tables", demo_file, "--listen", "nohost"), "expected HOST:PORT", code=2)
    assert_one_line_error(run_cli("--tables", demo_file, "--bogus"), "unrecognized arguments", code=2)
    assert_one_line_error(run_cli("--tables", demo_file, "--tls-cert", "x.pem"), "--tls-key", code=2)
    assert_one_line_error(run_cli("gen-demo", "/nonexistent-dir/x.bin"), "does not exist", code=2)


def test_pack_and_inspect_errors(tmp_path, demo_file):
    assert_one_line_error(run_cli("pack", str(tmp_path / "o.bin"), demo_file), "pack reads .safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\0\0\0\0\0\0\0{nope")
    assert_one_line_error(run_cli("pack", str(tmp_path / "o.bin"), str(junk)), "not a valid safetensors file")
    assert_one_line_error(run_cli("inspect", str(tmp_path / "nope.bin")), "not found")


# -------------------------------------------------------- the data transports


def raw_connect(daemon, hello=True, resp=None):
    resp = resp or open_raw_session(daemon.address)
    host, port = daemon.ready["tcp"].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=EVENT_TIMEOUT)
    if hello:
        assert tcp_hello(s, resp.session_id, resp.secret)[0] == Status.OK
    return s


def read_response(s):
    head = bytearray(HEADER_BYTES)
    if not recv_exact(s, memoryview(head)):
        return None, b""
    _m, _t, status, _rid, row_bytes, count = HEADER.unpack(head)
    body = bytearray(count * (row_bytes if status == Status.OK else 1))
    recv_exact(s, memoryview(body))
    return Status(status), bytes(body)


def test_malformed_frames_close_only_that_connection(daemon, demo_local):
    with socket.create_connection(tuple_of(daemon.ready["tcp"])) as s:  # garbage
        recv_challenge(s)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = read_response(s)
        assert status == Status.BAD_FRAME and b"magic" in body
        assert read_response(s)[0] is None  # closed
    with socket.create_connection(tuple_of(daemon.ready["tcp"])) as s:  # gather before hello
        recv_challenge(s)
        send_all(s, [request_header(FrameType.GATHER, 1, 0, 1), np.zeros(1, "<i8")])
        assert read_response(s)[0] == Status.UNAUTHENTICATED
    with socket.create_connection(tuple_of(daemon.ready["tcp"])) as s:  # wrong secret
        resp = open_raw_session(daemon.address)
        assert tcp_hello(s, resp.session_id, os.urandom(32))[0] == Status.UNAUTHENTICATED
    with raw_connect(daemon) as s:  # unknown frame type
        send_all(s, [request_header(9, 2, 0, 0)])
        assert read_response(s)[0] == Status.BAD_FRAME
    with raw_connect(daemon) as s:  # more ids than allowed
        send_all(s, [request_header(FrameType.GATHER, 2, 0, 10_000_000)])
        status, body = read_response(s)
        assert status == Status.TOO_MANY_ROWS and b"split" in body
    assert_still_serving(daemon, demo_local)


def test_recoverable_errors_keep_the_connection(daemon, demo_local):
    with raw_connect(daemon) as s:
        send_all(s, [request_header(FrameType.GATHER, 5, 99, 2), np.array([0, 1], "<i8")])
        status, body = read_response(s)
        assert status == Status.UNKNOWN_TABLE and b"no table #99" in body
        send_all(s, [request_header(FrameType.GATHER, 6, 0, 3), np.array([0, 50_000, 1], "<i8")])
        status, body = read_response(s)
        assert status == Status.ROW_OUT_OF_RANGE and b"row id 50000 out of range" in body
        send_all(s, [request_header(FrameType.GATHER, 7, 0, 2), np.array([-1, 1], "<i8")])
        assert read_response(s)[0] == Status.ROW_OUT_OF_RANGE
        ids = np.array([49_999, 0, 7], "<i8")
        send_all(s, [request_header(FrameType.GATHER, 8, 0, 3), ids])
        status, body = read_response(s)
        assert status == Status.OK
        np.testing.assert_array_equal(np.frombuffer(body, np.uint8).reshape(3, 264), demo_local["engram.layer1"][ids])


def test_remote_error_surfaces_as_remote_error(daemon):
    """A request the server refuses raises RemoteError from wait (here: a table index it lacks)."""
    with TableClient(daemon.address, transport="tcp") as c:
        transport = c.node_transport()
        pending = transport.gather(42, np.array([0], np.int64), np.empty((1, 8), np.uint8))
        with pytest.raises(RemoteError, match="UNKNOWN_TABLE"):
            pending.wait(10)
        assert c.table("tiny").gather([0]).shape == (1, 8)


def test_client_disconnects_mid_request(daemon, demo_local):
    with raw_connect(daemon) as s:  # announces 1000 ids, sends 100, leaves
        send_all(s, [request_header(FrameType.GATHER, 1, 0, 1000), np.arange(100, dtype="<i8")])
    with raw_connect(daemon) as s:  # asks for 16 MB and leaves before reading it
        send_all(s, [request_header(FrameType.GATHER, 1, 1, 60_000), np.arange(60_000, dtype="<i8")])
    with raw_connect(daemon) as s:  # half a header
        s.sendall(request_header(FrameType.GATHER, 1, 0, 1)[:10])
    assert_still_serving(daemon, demo_local)


def test_killed_client_session_is_reclaimed(fresh_daemon, demo_local):
    """A client killed right after connecting: its keepalive stream's end frees the session, not the lease.

    The constructor returns only once the server has bound the stream to the session, so from then on the
    process's death always ends it (before that, only the lease could: a client killed right after
    OpenSession used to escape this way on a busy machine)."""
    d = fresh_daemon("--lease-seconds", "3600")
    code = (
        "import sys, numpy as np; from tableclient import TableClient\n"
        f"c = TableClient({d.address!r}, transport='tcp')\n"
        "h = c.table('engram.layer14').gather_async(np.arange(60000))\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.PIPE, cwd=ROOT)
    assert child.stdout.readline().strip() == b"ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    wait_for(lambda: "ended: keepalive stream ended" in d.log(), lambda: f"the session to end:\n{d.log()}")
    assert "lapsed" not in d.log()
    assert_still_serving(d, demo_local)


def test_lease_expiry_closes_data_connections(fresh_daemon):
    d = fresh_daemon("--lease-seconds", "0.5")
    with raw_connect(d) as s:  # no keepalive: the lease lapses and the server drops the connection
        s.settimeout(EVENT_TIMEOUT)
        assert read_response(s)[0] is None
    assert "lease of 0.5 s lapsed" in d.log()


def test_sigterm_mid_session_is_graceful(fresh_daemon):
    d = fresh_daemon()
    c = TableClient(d.address, transport="tcp")
    assert c.table("tiny").gather([0]).shape == (1, 8)
    assert d.stop(signal.SIGTERM) == 0
    assert "shutting down" in d.log()
    assert not os.path.exists(d.ready["shm"])  # socket file removed
    with pytest.raises(Exception):
        c.table("tiny").gather([0], timeout=5)
    c.close()


def test_sigint_during_load_exits_cleanly(tmp_path):
    path = str(tmp_path / "slow.bin")
    with TableFileWriter(path, [TableSpec("slow", (6 << 30) // 264, 264)]) as w:
        w.fill_zeros(0)
    d = start_daemon(str(tmp_path / "d"), "--tables", path, wait=False)
    wait_for(lambda: "memory plan" in d.log() or d.proc.poll() is not None, lambda: f"the load to start:\n{d.log()}")
    assert d.proc.poll() is None, d.log()
    assert d.stop(signal.SIGINT) == 0
    assert "stopped while loading" in d.log()


def test_rdma_requested_without_a_device(demo_file):
    """This host has no RDMA device (the RDMA suite runs in the Soft-RoCE guest): a clear refusal."""
    res = run_cli("--tables", demo_file, "--listen", "127.0.0.1:0", "--transports", "rdma")
    assert_one_line_error(res, "rdma transport:")
    assert "rdma link add" in res.stderr or "python3-pyverbs" in res.stderr


def test_client_asks_for_rdma_without_a_device(daemon):
    from tableclient import ConnectError

    with pytest.raises(ConnectError, match="rdma"):
        TableClient(daemon.address, transport="rdma")


class _StallingPeer:
    """A tcp data port that answers one GATHER of 100 ids with half its rows, then stalls until
    ``release`` is set (and then sends the rest)."""

    def __init__(self, answer: bool = True):
        import threading

        self.answer = answer  # False: never answer the GATHER at all
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sent_half, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._peer, daemon=True)
        self.thread.start()

    def _peer(self):
        from tableserver.common.wire import HEADER_BYTES, challenge_frame, response_header, server_proof

        conn, _ = self.listener.accept()
        with conn:
            nonce = os.urandom(32)
            conn.sendall(challenge_frame(nonce))
            hello = bytearray(HEADER_BYTES + 64)
            recv_exact(conn, memoryview(hello))  # HELLO
            client_nonce = bytes(hello[HEADER_BYTES + 16 : HEADER_BYTES + 32])
            proof = server_proof(b"s" * 32, b"i" * 16, nonce, client_nonce)
            conn.sendall(response_header(FrameType.HELLO, Status.OK, 0, 0, 32) + proof)
            recv_exact(conn, memoryview(bytearray(HEADER_BYTES + 8 * 100)))  # GATHER of 100 ids
            if not self.answer:
                self.release.wait(30)
                return
            conn.sendall(response_header(FrameType.GATHER, Status.OK, 1, 264, 100) + b"\x07" * (264 * 50))
            self.sent_half.set()
            self.release.wait(30)
            try:
                conn.sendall(b"\x07" * (264 * 50))  # the rest
            except OSError:
                pass

    def transport(self):
        from types import SimpleNamespace

        from tableclient.transports import tcp

        host, port = self.listener.getsockname()
        offer = SimpleNamespace(tcp=SimpleNamespace(host=host, port=port))
        return tcp.TcpTransport(offer, SimpleNamespace(id=b"i" * 16, secret=b"s" * 32), [], 10)

    def close(self):
        self.release.set()
        self.thread.join(EVENT_TIMEOUT)
        self.listener.close()


def test_cancel_is_a_barrier_even_when_the_server_stalls_mid_response():
    """A tcp response stuck half-way (the peer stops sending) is cancelled within the grace time, and no
    byte lands in the caller's buffer after cancel() returns (the connection is broken instead)."""
    peer = _StallingPeer()
    transport = peer.transport()
    out = np.zeros((100, 264), np.uint8)
    pending = transport.gather(0, np.arange(100, dtype=np.int64), out)
    assert peer.sent_half.wait(EVENT_TIMEOUT)
    wait_for(lambda: out[49].any(), "the first half of the rows")  # the receiver is mid-response
    pending.cancel()  # returns after the grace time: the connection was broken
    assert pending.done()
    snapshot = out.copy()
    peer.close()
    assert np.array_equal(out, snapshot) and not out[50:].any()
    with pytest.raises(TransportError):
        pending.wait(0)
    transport.close()


def test_sync_gather_timed_out_mid_response_is_finished_by_the_receiver():
    """A synchronous gather is read by the caller's thread; when its wait times out half-way through the
    response, the receiver thread resumes that very frame, so the rows still land whole and in place."""
    from tableclient import GatherTimeout

    peer = _StallingPeer()
    transport = peer.transport()
    out = np.zeros((100, 264), np.uint8)
    pending = transport.gather(0, np.arange(100, dtype=np.int64), out, sync=True)
    assert peer.sent_half.wait(EVENT_TIMEOUT)
    with pytest.raises(GatherTimeout):
        pending.wait(0.2)  # the caller read the first half, then gave up
    assert out[:50].all() and not out[50:].any() and not pending.done()
    peer.release.set()
    pending.wait(EVENT_TIMEOUT)  # completed by the receiver thread, which took the request over
    assert (out == 7).all()
    peer.close()
    transport.close()


def test_sync_wait_keeps_its_deadline_while_signals_arrive():
    """A signal handler firing every 10 ms (a profiler's timer, say) does not stretch a synchronous wait
    for a response that never begins: the reader polls to its deadline, which a signal does not restart."""
    import signal

    from tableclient import GatherTimeout

    peer = _StallingPeer(answer=False)
    transport = peer.transport()
    ticks = []
    previous = signal.signal(signal.SIGALRM, lambda *_: ticks.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
    try:
        pending = transport.gather(0, np.arange(100, dtype=np.int64), np.zeros((100, 264), np.uint8), sync=True)
        start = time.monotonic()
        with pytest.raises(GatherTimeout):
            pending.wait(0.3)
        elapsed = time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(ticks) >= 5  # the signals did arrive while it waited
    assert elapsed < 5.0, elapsed  # bounded by its deadline (0.3 s), not by the signals
    pending.cancel()
    peer.close()
    transport.close()


def test_sync_wait_with_no_time_left_takes_rows_already_here(daemon, demo_local):
    """``wait(0)`` on a synchronous gather whose rows have arrived returns them: bytes already in the
    socket are read before the deadline is judged (a one-row answer arrives whole, in one segment)."""
    import select as select_module

    with TableClient(daemon.address, transport="tcp") as c:
        transport = c.node_transport()
        table = c.table("engram.layer1")
        for row in (0, 4321, table.info.rows - 1):
            ids = np.array([row], dtype=np.int64)
            out = np.empty((1, 264), np.uint8)
            pending = transport.gather(table.info.index, ids, out, sync=True)
            poller = select_module.poll()
            poller.register(transport, select_module.POLLIN)
            assert poller.poll(EVENT_TIMEOUT * 1000)  # the answer is here
            pending.wait(0.0)  # no GatherTimeout: the reader takes it without waiting
            np.testing.assert_array_equal(out, demo_local[table.name][ids])
