"""Hostile or greedy clients of the control plane and of sessions (issue 12, and the server hardening after
it): OpenSession requests too large or with names that would forge log lines, session opens rate-limited and
capped per peer, where a peer is a network prefix, GetCatalog metered and its reply built once, sessions that
never bind a keepalive stream (the bind timeout), a reader that trickles a response, and a metrics endpoint
held to a bounded number of threads. Each is refused or dropped alone, and the server keeps serving the
others."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, wait_for
from tests_helpers import open_raw_session, scrape, tcp_hello, value
from tests_helpers import parse_serve_flags as _parse

from tableserver.common.wire import HEADER, HEADER_BYTES, FrameType, Status, recv_exact, request_header, send_all
from tableserver.config import resolve
from tableserver.errors import ConfigError
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


# ---------------------------------------------- OpenSession requests: their size, the names they log


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


# ---------------------------------------------------------- session opens: a rate and a cap per peer


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


# ------------------------------------------------------------------------ peers are network prefixes


def test_peer_keys_are_network_prefixes():
    from tableserver.control import peer_key

    assert peer_key("ipv4:127.0.0.45:5678") == "127.0.0.0/24"
    assert peer_key("ipv4:10.1.2.3:80", 16) == "10.1.0.0/16"
    assert peer_key("ipv4:10.1.2.3:80", 32) == "10.1.2.3/32"
    assert peer_key("ipv6:[2001:db8:1:2:3:4:5:6]:443") == "2001:db8:1:2::/64"
    assert peer_key("ipv6:%5B2001:db8:1:2:3:4:5:6%5D:443", 24, 48) == "2001:db8:1::/48"
    assert peer_key("ipv6:[::ffff:192.168.7.9]:80") == "192.168.7.0/24"  # IPv4-mapped: as IPv4
    assert peer_key("ipv6:[fe80::1%eth0]:80") == "fe80::/64"
    assert peer_key("unix:/run/a.sock") == peer_key("unix:") == "unix"


def test_the_open_and_catalog_buckets_are_shared_by_a_prefix():
    from tableserver.control import OpenRate, peer_key

    rate = OpenRate(50.0, 200)
    many = [peer_key(f"ipv4:127.0.0.{i}:1000") for i in range(2, 47)]  # 45 loopback sources, one /24
    assert sum(rate.allow(k, now=0.0) for k in many for _ in range(10)) == 200
    assert rate.allow(peer_key("ipv4:127.0.1.2:1000"), now=0.0)  # another /24 has its own bucket
    assert rate.allow(many[0], now=0.02) and not rate.allow(many[0], now=0.02)  # 50/s refills one per 20 ms


class _Forwarder:
    """A local TCP relay whose upstream connections leave from ``source``: a gRPC channel to it reaches
    the server from that source address (grpc cannot bind a client's source address itself)."""

    def __init__(self, source: str, upstream: tuple[str, int]):
        self.source, self.upstream = source, upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.socket()
            up.bind((self.source, 0))
            up.connect(self.upstream)
            self._socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self):
        for s in self._socks:
            s.close()


def _open_from(address: str):
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.TableServiceStub(ch).OpenSession(
            pb.OpenSessionRequest(client_name="prefix", transports=["tcp"]), timeout=EVENT_TIMEOUT
        )


def test_the_per_peer_session_cap_counts_a_whole_prefix(fresh_daemon):
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1, source_address=("127.0.0.2", 0)).close()
    except ConnectionRefusedError:
        pass
    except OSError as e:
        pytest.skip(f"this host cannot send from 127.0.0.2 ({e})")
    d = fresh_daemon("--max-sessions-per-peer", "3", "--session-open-rate", "1000")
    upstream = _hostport(d.address)
    relays = {
        src: _Forwarder(src, upstream) for src in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.1.2")
    }
    try:
        for src in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):  # three hosts of one /24: the cap of 3
            _open_from(relays[src].address)
        with pytest.raises(grpc.RpcError) as e:
            _open_from(relays["127.0.0.5"].address)  # a fourth address does not buy a fourth session
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "session limit reached for 127.0.0.0/24" in e.value.details(), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            _open_from(d.address)  # nor does 127.0.0.1
        assert "127.0.0.0/24" in e.value.details()
        _open_from(relays["127.0.1.2"].address)  # another /24 has its own cap
        assert "from ipv4:127.0.0.3:" in d.log() and "from ipv4:127.0.1.2:" in d.log()  # they came from there
    finally:
        for r in relays.values():
            r.close()


def test_the_rate_limit_names_the_prefix(fresh_daemon):
    d = fresh_daemon("--session-open-rate", "0.01")  # burst 1
    _open_from(d.address)
    with pytest.raises(grpc.RpcError) as e:
        _open_from(d.address)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many sessions opened from 127.0.0.0/24" in e.value.details() and "retry later" in e.value.details()


# -------------------------------------------------------------------- GetCatalog metered, built once


def test_get_catalog_is_metered_per_prefix_and_counted(fresh_daemon):
    d = fresh_daemon("--catalog-rate", "0.01")  # burst 1, one more every 100 s
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.TableServiceStub(ch)
        first = stub.GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
        assert len(first.tables) == 4
        with pytest.raises(grpc.RpcError) as e:
            stub.GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = e.value.details()
    assert "too many catalog requests from 127.0.0.0/24" in details and "--catalog-rate" in details, details
    assert "\n" not in details
    families = scrape(d.ready["metrics"])
    assert value(families, "tableserver_errors_total", reason="rate_limited") == 1


def test_the_default_catalog_rate_lets_many_clients_connect(fresh_daemon, demo_local):
    from tableclient import TableClient

    d = fresh_daemon("--session-open-rate", "1000")
    clients = [TableClient(d.address, client_name=f"c{i}", transport="tcp") for i in range(40)]  # 2 calls each
    try:
        ids = np.arange(16).reshape(4, 4)
        for c in clients[::13]:
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])
    finally:
        for c in clients:
            c.close()


def test_the_catalog_reply_is_built_once():
    from tableserver.control import ServerState

    class Spec:
        dtype, logical_shape, layer, version = "uint8", (2, 4), 1, 1

    class Table:
        index, name, rows, row_bytes, checksum, nbytes, total_rows, row_lo, spec, tier = (
            0,
            "t",
            2,
            4,
            "x",
            8,
            2,
            0,
            Spec,
            "memory",
        )

    class Sessions:
        lease_seconds = 15.0

    state = ServerState(Sessions(), {"tcp": None}, 64, "host")
    state.tables = [Table]
    first = state.catalog()
    assert first is state.catalog() and first.tables[0].name == "t" and list(first.server.transports) == ["tcp"]


# -------------------------------------------------------------- sessions that never bind a keepalive


def test_a_session_without_a_keepalive_stream_is_closed_after_the_bind_timeout(fresh_daemon, demo_local):
    """A session nobody binds a keepalive stream to is closed after the bind timeout, not after its lease; a
    real client, which binds its stream right after opening, keeps being served. (On a machine so busy that
    a client's first ping comes later than the bind timeout, its session is closed too and the client opens
    another: the gather below waits for that rather than fail.)"""
    from tableclient import TableClient, TableClientError

    d = fresh_daemon("--session-bind-timeout", "0.5", "--lease-seconds", "3600")
    with TableClient(d.address, client_name="honest", transport="tcp") as c:  # binds its stream at once
        raw = open_raw_session(d.address)
        wait_for(
            lambda: "never bound a keepalive stream within 0.5 s" in d.log() and "(raw pid" in d.log(),
            lambda: f"the unbound session to be closed:\n{d.log()}",
        )
        with socket.create_connection(tuple(_hostport(d.ready["tcp"])), timeout=EVENT_TIMEOUT) as s:
            assert tcp_hello(s, raw.session_id, raw.secret)[0] == Status.UNAUTHENTICATED
        ids = np.arange(64).reshape(8, 8)

        def served():
            try:
                return np.array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])
            except TableClientError:
                return False

        wait_for(served, "the honest client to be served")
        ended = [line for line in d.log().splitlines() if " ended: " in line and "(raw pid" in line]
        assert len(ended) == 1 and "never bound a keepalive stream" in ended[0], ended
    families = scrape(d.ready["metrics"])
    assert value(families, "tableserver_sessions_ended_total", reason="unbound") >= 1


def test_the_bind_timeout_is_bounded():
    with pytest.raises(ConfigError, match="--session-bind-timeout = 'inf': expected a number in 0.1..86400"):
        resolve(_parse(["--session-bind-timeout", "inf"]), {})
    assert resolve(_parse([]), {})["session_bind_timeout"] == 10.0


# ---------------------------------------------------------- the send timeout bounds a whole response


def test_a_reader_that_trickles_is_dropped_when_the_whole_response_is_late(fresh_daemon):
    d = fresh_daemon("--send-timeout", "3")
    with grpc.insecure_channel(d.address) as ch:
        catalog = pb_grpc.TableServiceStub(ch).GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
    table = max(catalog.tables, key=lambda t: t.row_bytes)
    count = catalog.server.max_rows_per_request
    total = HEADER_BYTES + count * table.row_bytes  # megabytes: at the pace read below, minutes to send
    resp = open_raw_session(d.address)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # a small window, set before connecting
    s.settimeout(EVENT_TIMEOUT)
    s.connect(_hostport(d.ready["tcp"]))
    with s:
        assert tcp_hello(s, resp.session_id, resp.secret)[0] == Status.OK
        send_all(s, [request_header(FrameType.GATHER, 1, table.index, count), np.zeros(count, "<i8")])
        head = bytearray(HEADER_BYTES)
        assert recv_exact(s, memoryview(head)) and HEADER.unpack(head)[2] == Status.OK
        got, dropped = HEADER_BYTES, False
        while got < total:  # at most 64 KiB every 50 ms: the server can send again well within the timeout
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                dropped = True
                break
            got += len(chunk)
            time.sleep(0.05)
    assert dropped and got < total, (got, total)
    wait_for(lambda: "(--send-timeout); dropped the connection" in d.log(), lambda: f"the drop logged:\n{d.log()}")
    families = scrape(d.ready["metrics"])
    assert value(families, "tableserver_errors_total", reason="send_timeout") == 1


# ------------------------------------------------------------------------------ the metrics endpoint


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
