"""Hostile peers on the data ports (issue 12): connection floods under a real fd limit, slow handshakes,
connection caps, a sniffed HELLO, thread and fd exhaustion. Each is bounded, reported truthfully, and
the server keeps serving everyone else bit-exact."""

from __future__ import annotations

import os
import resource
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, wait_for
from tableclient import ConnectError, TableClient
from tests_helpers import assert_still_serving, open_raw_session, tcp_hello, tuple_of

from tableserver.common.wire import REQUEST_MAGIC, FrameType, HandshakeRefused, Status, recv_challenge


@pytest.fixture(autouse=True, scope="module")
def _many_fds():
    """This test process opens more sockets than the default soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def health(channel) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_a_connection_flood_under_nofile_1024_leaves_everyone_else_served(fresh_daemon, demo_local):
    """Before: ~1,000 idle connections under LimitNOFILE=1024 made every new tcp and shm client fail.
    Now idle connections hold no thread, the oldest pending handshakes are evicted, and the fd count
    stays bounded while a flooder keeps reconnecting."""
    d = fresh_daemon(prefix=("prlimit", "--nofile=1024:1024"))
    tcp = tuple_of(d.ready["tcp"])
    held: list[socket.socket] = []
    stop = threading.Event()
    opened = [0]

    def flood():
        while not stop.is_set():
            try:
                s = socket.create_connection(tcp, timeout=5)
                u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                u.connect(d.ready["shm"])
            except OSError:
                continue
            held.extend((s, u))
            opened[0] += 2
            while len(held) > 2400:  # keep 1,200 of each open, like a client that never says HELLO
                held.pop(0).close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        wait_for(lambda: opened[0] >= 2400, "the flood to hold 2,400 connections")
        started = time.monotonic()
        assert_still_serving(d, demo_local)  # tcp and shm clients, bit-exact, during the flood
        served_in = time.monotonic() - started
        assert fd_count(d.proc.pid) < 1000
    finally:
        stop.set()
        flooder.join(EVENT_TIMEOUT)
        for s in held:
            s.close()
    assert d.proc.poll() is None
    assert served_in < EVENT_TIMEOUT


def test_a_connection_that_never_says_hello_is_closed_at_the_deadline(fresh_daemon):
    d = fresh_daemon("--handshake-timeout", "0.5")
    with socket.create_connection(tuple_of(d.ready["tcp"]), timeout=EVENT_TIMEOUT) as s:
        recv_challenge(s)
        started = time.monotonic()
        assert s.recv(1) == b""  # closed by the server ...
        assert time.monotonic() - started >= 0.4  # ... at its deadline
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as u:
        u.settimeout(EVENT_TIMEOUT)
        u.connect(d.ready["shm"])
        u.recv(4096)  # the challenge
        assert u.recv(4096) == b""


def test_connection_caps_per_session_and_in_all(fresh_daemon, demo_local):
    d = fresh_daemon("--max-connections", "3", "--max-connections-per-session", "2")
    tcp = tuple_of(d.ready["tcp"])
    resp = open_raw_session(d.address)
    conns = [socket.create_connection(tcp, timeout=EVENT_TIMEOUT) for _ in range(3)]
    try:
        assert tcp_hello(conns[0], resp.session_id, resp.secret)[0] == Status.OK
        assert tcp_hello(conns[1], resp.session_id, resp.secret)[0] == Status.OK
        status, body = tcp_hello(conns[2], resp.session_id, resp.secret)
        assert status == Status.BUSY and b"this session already holds 2 tcp connections" in body
        other = open_raw_session(d.address)
        third = socket.create_connection(tcp, timeout=EVENT_TIMEOUT)
        conns.append(third)
        assert tcp_hello(third, other.session_id, other.secret)[0] == Status.OK  # 3 in all now
        with socket.create_connection(tcp, timeout=EVENT_TIMEOUT) as s:  # a 4th: no room, nothing to evict
            with pytest.raises(HandshakeRefused, match="at its limit of 3 connections"):
                recv_challenge(s)
        with pytest.raises(ConnectError, match="BUSY"):
            TableClient(d.address, transport="tcp")
    finally:
        for s in conns:
            s.close()
    wait_for(lambda: _serves(d, demo_local), "the server to serve again once the connections closed")


def _serves(d, demo_local) -> bool:
    try:
        assert_still_serving(d, demo_local)
        return True
    except ConnectError:
        return False


def _tcp_payloads(packets: list[bytes], port: int, source: bool = False) -> bytes:
    """The tcp payload bytes sent to ``port`` (or from it, with ``source``) in captured loopback frames."""
    out = bytearray()
    for frame in packets:
        ip = frame[14:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 0xF) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:total]
        if struct.unpack("!H", tcp[0:2] if source else tcp[2:4])[0] != port:
            continue
        out += tcp[(tcp[12] >> 4) * 4 :]
    return bytes(out)


def test_a_sniffed_hello_is_useless(fresh_daemon, demo_local):
    """Before: the HELLO carried the session secret in clear; a sniffer replayed it and read a table.
    Now the secret never crosses the wire and a replayed HELLO answers the wrong challenge."""
    d = fresh_daemon()
    host, port = tuple_of(d.ready["tcp"])
    seen = {}

    def traffic():
        with TableClient(d.address, transport="tcp") as c:
            seen["secret"] = c.session.secret
            ids = np.arange(16)
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])

    sent, _ = _capture(port, traffic)  # a real capture on lo
    assert sent.startswith(REQUEST_MAGIC + struct.pack("<H", FrameType.HELLO))  # we saw the handshake
    assert seen["secret"] not in sent
    hello = sent[: 24 + 64]
    with socket.create_connection((host, port), timeout=EVENT_TIMEOUT) as s:  # replayed on a new connection
        recv_challenge(s)
        s.sendall(hello)
        head = s.recv(24)
        assert struct.unpack_from("<H", head, 6)[0] == Status.UNAUTHENTICATED


def test_a_thread_that_cannot_start_stops_nothing(demo_file, demo_local, monkeypatch):
    """Before: the accept loops started a thread per connection outside any try: one failed start
    (TasksMax, a pids limit) killed them for good while health said SERVING. Now no thread starts
    after start(): with every server thread start failing, new connections are served."""
    from types import SimpleNamespace

    from tableclient.transports.tcp import TcpTransport as ClientTcp

    from tableserver.sessions import SessionRegistry
    from tableserver.tables.loader import load_tables
    from tableserver.transports.tcp import TcpTransport

    tables = load_tables([demo_file], hugepages="off", lock=False, progress="never")
    sessions = SessionRegistry(60)
    server = TcpTransport(sessions, {"tcp_listen": ("127.0.0.1", 0), "max_rows_per_request": 4096})
    server.bind()
    server.start(tables)
    real_start = threading.Thread.start
    refused = []

    def start(self):
        if self.name.startswith("tableserver-"):
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        session = sessions.open(transports=("tcp",))
        offer = server.offer(session, None)
        offer.tcp.host = "127.0.0.1"
        clients = [ClientTcp(offer, SimpleNamespace(id=session.id, secret=session.secret), [], 10) for _ in range(8)]
        table = next(t for t in tables if t.name == "engram.layer1")
        rng = np.random.default_rng(3)
        for client in clients:
            ids = rng.integers(0, table.rows, 500)
            out = np.empty((500, table.row_bytes), np.uint8)
            client.gather(table.index, ids, out).wait(EVENT_TIMEOUT)
            np.testing.assert_array_equal(out, demo_local["engram.layer1"][ids])
        assert server.health() == (True, "")
        assert not refused  # nothing even tried
        for client in clients:
            client.close()
    finally:
        monkeypatch.undo()
        server.close()
        sessions.close_all()
        tables.close()


def test_a_pids_limit_reached_after_start_stops_nothing(fresh_daemon, demo_local):
    """The daemon moved into a pids cgroup that allows not one more thread: new tcp and shm clients are
    served bit-exact and health stays SERVING (truthfully: every transport can serve)."""
    from tests_helpers import make_cgroup

    made = make_cgroup("pids", f"tableserver-test-{os.getpid()}")
    if made is None:
        pytest.skip("no writable pids cgroup on this machine (tested by the injected thread-start failure)")
    group = made[0]
    parent = os.path.dirname(group)
    d = fresh_daemon()
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(d.proc.pid))
        with open(os.path.join(group, "pids.current")) as f:
            current = f.read().strip()
        with open(os.path.join(group, "pids.max"), "w") as f:
            f.write(current)
        with grpc.insecure_channel(d.address) as ch:
            for _ in range(3):
                assert_still_serving(d, demo_local)
            assert health(ch) == "SERVING"
        assert d.proc.poll() is None
    finally:
        with open(os.path.join(parent, "cgroup.procs"), "w") as f:
            f.write(str(d.proc.pid))
        os.rmdir(group)


def test_fd_exhaustion_backs_off_and_health_says_so(fresh_daemon, demo_local):
    """Authenticated connections fill a too-small open-file limit (a misconfigured --max-connections):
    the tcp accept loop backs off with a rate-limited log naming the fix, health turns NOT_SERVING,
    and both recover once the connections close."""
    d = fresh_daemon("--max-connections", "5000", prefix=("prlimit", "--nofile=128:128"))
    tcp = tuple_of(d.ready["tcp"])
    sessions = [open_raw_session(d.address) for _ in range(20)]
    with grpc.insecure_channel(d.address) as ch:
        assert health(ch) == "SERVING"
        held = []
        try:
            for resp in sessions:
                for _ in range(8):
                    s = socket.create_connection(tcp, timeout=EVENT_TIMEOUT)
                    held.append(s)
                    s.settimeout(1.0)
                    try:
                        assert tcp_hello(s, resp.session_id, resp.secret)[0] == Status.OK
                    except TimeoutError:
                        break  # the server cannot accept any more: out of fds
                else:
                    continue
                break
            else:
                pytest.fail("160 connections fit under a limit of 128 open files")
            wait_for(lambda: health(ch) == "NOT_SERVING", "health NOT_SERVING while accepts fail")
            assert "cannot accept connections" in d.log() and "LimitNOFILE" in d.log()
        finally:
            for s in held:
                s.close()
        wait_for(lambda: health(ch) == "SERVING", "health SERVING again")
    assert_still_serving(d, demo_local)


def _capture(port: int, fn) -> tuple[bytes, bytes]:
    """Runs ``fn()`` while capturing loopback: (bytes sent to ``port``, bytes sent from it)."""
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniffer.bind(("lo", 0))
    sniffer.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE (root: past rmem_max): drop nothing
    sniffer.settimeout(0.2)
    try:
        fn()
        packets = []
        while True:
            try:
                frame, addr = sniffer.recvfrom(1 << 16)
            except TimeoutError:
                break
            if addr[2] != socket.PACKET_OUTGOING:
                packets.append(frame)
    finally:
        sniffer.close()
    return _tcp_payloads(packets, port), _tcp_payloads(packets, port, source=True)


@pytest.mark.parametrize("sealed", [False, True])
def test_sealed_tcp_keeps_rows_and_row_ids_private(fresh_daemon, demo_local, sealed):
    """--data-encryption on (the default with a TLS control plane): AES-256-GCM keyed from the session
    secret. A sniffer on the wire sees neither the row ids nor the rows; without it, it sees both (which
    shows the capture works). Either way every gather is bit-exact, errors included."""
    d = fresh_daemon("--data-encryption", "on" if sealed else "off")
    _, port = tuple_of(d.ready["tcp"])
    table = demo_local["engram.layer14"]
    ids = np.random.default_rng(11).choice(len(table), 12_288, replace=False)  # 3.2 MB: several sealed chunks
    marker = np.array([1234567], "<i8")  # an id that shows on the wire unless sealed

    def traffic():
        with TableClient(d.address, transport="tcp") as c:
            assert c.node_transport().sealed == sealed
            t = c.table("engram.layer14")
            np.testing.assert_array_equal(t.gather(ids), table[ids])
            np.testing.assert_array_equal(t.gather(np.zeros(0, np.int64)), table[[]])
            with pytest.raises(ValueError):
                t.gather(marker)  # refused before sending: the client checks ids too
            from tableclient import RemoteError

            np.testing.assert_array_equal(t.gather([7, 7, 8]), table[[7, 7, 8]])
            with pytest.raises(RemoteError):  # a sealed error answer, from the server's own check
                c.node_transport().gather(
                    c.tables["engram.layer14"].index,
                    np.array([len(table)], np.int64),
                    np.empty((1, table.shape[1]), np.uint8),
                ).wait(EVENT_TIMEOUT)

    sent, received = _capture(port, traffic)
    assert len(received) > table[ids].nbytes  # the capture saw the rows' worth of bytes
    row = table[ids[5000]].tobytes()
    id_bytes = ids[100:104].astype("<i8").tobytes()
    assert (row in received) == (not sealed)
    assert (id_bytes in sent) == (not sealed)


def test_a_tampered_sealed_frame_ends_its_connection(fresh_daemon, demo_local):
    """A byte flipped in a sealed GATHER fails its tag: BAD_FRAME, the connection closes, others go on."""
    from tableserver.common.seal import C2S, S2C, Direction, derive_key
    from tableserver.common.wire import HEADER, HELLO_SEALED, hello_frame, recv_exact, request_header

    d = fresh_daemon("--data-encryption", "on")
    resp = open_raw_session(d.address)
    with socket.create_connection(tuple_of(d.ready["tcp"]), timeout=EVENT_TIMEOUT) as s:
        nonce = recv_challenge(s)
        frame, client_nonce = hello_frame(resp.session_id, resp.secret, nonce)
        s.sendall(frame)
        head = bytearray(24)
        recv_exact(s, memoryview(head))
        assert HEADER.unpack(head)[4] & HELLO_SEALED
        recv_exact(s, memoryview(bytearray(HEADER.unpack(head)[5])))
        tx = Direction(derive_key(resp.secret, C2S, nonce, client_nonce))
        rx = Direction(derive_key(resp.secret, S2C, nonce, client_nonce))
        header = request_header(FrameType.GATHER, 5, 0, 2)
        sealed = bytearray(tx.seal(header, np.array([1, 2], "<i8").tobytes()))
        sealed[3] ^= 0x40
        s.sendall(header + bytes(sealed))
        recv_exact(s, memoryview(head))
        status, count = HEADER.unpack(head)[2], HEADER.unpack(head)[5]
        body = bytearray(count + 16)
        recv_exact(s, memoryview(body))
        msg = bytearray(count)
        rx.open_into(bytes(head), body[:count], bytes(body[count:]), memoryview(msg))  # the answer is sealed too
        assert status == Status.BAD_FRAME and b"failed authentication" in msg
        assert s.recv(1) == b""  # closed
    assert_still_serving(d, demo_local)


def test_a_closed_session_drops_every_data_connection_it_held(fresh_daemon, demo_local):
    """CloseSession ends the session's tcp connection, its shm connection and its connection to the shm
    transport's rows port (the same-host socket for disk tables), while the client keeps every socket
    open; another session's connections on all three keep being served."""
    from tests_helpers import shm_hello

    from tableserver.common.wire import HEADER, HEADER_BYTES, recv_exact, request_header, send_all
    from tableserver.v1 import tableserver_pb2 as pb
    from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

    d = fresh_daemon("--disk-tables", "engram.layer14")
    layer14 = list(demo_local).index("engram.layer14")  # the catalog's order is the file's

    def connect(session) -> dict:
        rows_path = {o.name: o for o in session.offers}["shm"].shm.rows_socket_path
        assert rows_path, "the shm transport offered no rows port although a disk table is served"
        tcp = socket.create_connection(tuple_of(d.ready["tcp"]), timeout=EVENT_TIMEOUT)
        shm = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        rows = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for s, path in ((shm, d.ready["shm"]), (rows, rows_path)):
            s.settimeout(EVENT_TIMEOUT)
            s.connect(path)
        assert tcp_hello(tcp, session.session_id, session.secret)[0] == Status.OK
        msg, fds = shm_hello(shm, session.session_id, session.secret)
        for fd in fds:
            os.close(fd)
        assert HEADER.unpack_from(msg)[2] == Status.OK
        assert tcp_hello(rows, session.session_id, session.secret)[0] == Status.OK
        return {"tcp": tcp, "shm": shm, "rows port": rows}

    closed, kept = (open_raw_session(d.address, ("tcp", "shm")) for _ in range(2))
    ending, staying = connect(closed), connect(kept)
    try:
        with grpc.insecure_channel(d.address) as ch:
            pb_grpc.TableServiceStub(ch).CloseSession(
                pb.CloseSessionRequest(session_id=closed.session_id), timeout=EVENT_TIMEOUT
            )
        for name, s in ending.items():
            assert s.recv(4096) == b"", f"the closed session's {name} connection was not dropped"
        ids = np.array([0, 5, 5, demo_local["engram.layer14"].shape[0] - 1], np.int64)
        for name in ("tcp", "rows port"):  # the other session's gathers are answered on the same sockets
            s = staying[name]
            send_all(s, [request_header(FrameType.GATHER, 7, layer14, ids.size), ids.astype("<i8")])
            head = bytearray(HEADER_BYTES)
            assert recv_exact(s, memoryview(head)), f"the other session's {name} connection was dropped"
            assert HEADER.unpack(head)[2] == Status.OK
            rows = bytearray(ids.size * demo_local["engram.layer14"].shape[1])
            assert recv_exact(s, memoryview(rows))
            np.testing.assert_array_equal(np.frombuffer(rows, np.uint8).reshape(ids.size, -1),
                                          demo_local["engram.layer14"][ids], err_msg=name)  # fmt: skip
    finally:
        for s in (*ending.values(), *staying.values()):
            s.close()
    assert_still_serving(d, demo_local)
