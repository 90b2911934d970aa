"""A data connection the server closed while it sat unused (``--idle-timeout``, issue 50): the client's next
gather re-opens it and is served bit-exact; no error, no node marked down, no failure policy. Real daemons,
real sockets; each wait is for the server (its metric) and the client's socket to say the connection was
closed, never a fixed sleep."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, start_daemon, wait_for
from prometheus_client import REGISTRY
from tableclient import TableClient
from tableclient.step import EngramStep, LayerPlan
from tests_helpers import scrape, value

#: the servers' --idle-timeout: long enough that no request is closed under a worker the machine is slow to
#: schedule (the server measures idleness from its last answer, also while a request waits for a worker)
IDLE = "0.3"
#: idle_check values: peek before sending (the close is found before a request goes out), or never (the
#: request is sent into the closed connection and re-sent on a fresh one)
PATHS = {"peek": 0.0, "resend": float("inf")}


def client_counters(address: str) -> tuple:
    """What routing reports about failures: (fail-overs, transport errors, the node's up gauge)."""
    return (
        REGISTRY.get_sample_value("tableserver_client_failovers_total") or 0.0,
        REGISTRY.get_sample_value("tableserver_client_errors_total", {"reason": "transport"}) or 0.0,
        REGISTRY.get_sample_value("tableserver_client_replica_up", {"address": address}),
    )


def wait_closed(d, transport, gauge: str = "tcp") -> None:
    """Until the server's sessions gauge for ``gauge`` says it holds no connection of the session any more
    and ``transport``'s socket has the server's FIN."""
    wait_for(
        lambda: value(scrape(d.ready["metrics"]), "tableserver_sessions", transport=gauge) == 0,
        f"the server to close the idle {gauge} connection",
    )
    wait_for(transport.peer_closed, "the server's FIN on the client's connection")


def check_up(client, d, before) -> None:
    """The node is up and routing counted no failure since ``before``."""
    state = client.replicas()[d.address]
    assert state["state"] == "up" and not state["error"], state
    failovers, errors, up = client_counters(d.address)
    assert (failovers, errors, up) == (before[0], before[1], 1.0)


@pytest.mark.parametrize(("path", "sealed"), [("peek", False), ("resend", False), ("resend", True)])
def test_a_tcp_connection_closed_while_idle_is_reopened(fresh_daemon, demo_local, path, sealed):
    """Before: the gather after the idle gap failed with 'server closed the connection' and the node went
    down. Now the connection is re-opened (and the requests sent into the closed one re-sent, pipelined
    ones included, under new request ids; sealed under the new connection's keys), rows bit-exact, the
    node up, nothing counted as a failure."""
    d = fresh_daemon("--idle-timeout", IDLE, *(("--data-encryption", "on") if sealed else ()))
    rng = np.random.default_rng(3)
    with TableClient(d.address, transport="tcp", idle_check=PATHS[path]) as c:
        t = c.node_transport()
        assert t.sealed is sealed
        before = client_counters(d.address)
        layer1, layer14 = c.table("engram.layer1"), c.table("engram.layer14")
        for gap in range(1, 4):
            wait_closed(d, t)
            if gap == 1:  # one synchronous gather
                ids = rng.integers(0, 50_000, 3000)
                np.testing.assert_array_equal(
                    layer1.gather(ids, timeout=EVENT_TIMEOUT), demo_local["engram.layer1"][ids]
                )
            else:  # several requests in flight at once, all sent into the closed connection on the resend path
                ids14, ids1 = rng.integers(0, 70_001, (64, 24)), rng.integers(0, 50_000, (64, 24))
                h14, h1 = c.gather_many([(layer14, ids14), (layer1, ids1)])
                np.testing.assert_array_equal(h14.wait(EVENT_TIMEOUT), demo_local["engram.layer14"][ids14])
                np.testing.assert_array_equal(h1.wait(EVENT_TIMEOUT), demo_local["engram.layer1"][ids1])
            assert c.node_transport() is t, "the node's session was replaced: its transport failed"
            assert t.reopened == gap
            check_up(c, d, before)


def test_the_rows_port_of_shm_reopens_a_connection_closed_while_idle(fresh_daemon, demo_local):
    """shm's disk tables are gathered over the rows socket, tcp's protocol: closed while idle, it is re-opened
    the same way. (The handshake's connection, closed too, is never used again: mapped tables keep serving.)"""
    d = fresh_daemon("--idle-timeout", IDLE, "--disk-tables", "engram.layer14")
    rng = np.random.default_rng(4)
    with TableClient(d.address, transport="shm", idle_check=float("inf")) as c:
        shm = c.node_transport()
        rows = shm.rows_port
        assert rows is not None, "a disk table but no rows port"
        before = client_counters(d.address)
        for gap in range(1, 3):
            wait_closed(d, rows, gauge="shm")
            for name in ("engram.layer14", "engram.layer1"):  # over the rows socket, then from the mapping
                ids = rng.integers(0, demo_local[name].shape[0], 2000)
                np.testing.assert_array_equal(c.table(name).gather(ids, timeout=EVENT_TIMEOUT), demo_local[name][ids])
            assert c.node_transport() is shm and rows.reopened == gap
            check_up(c, d, before)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_step_with_policy_fail_survives_idle_gaps(fresh_daemon, demo_local, transport):
    """The step API with failure policy ``fail`` (the default options: no idle_check given), a decode step
    after each idle gap: every layer's rows bit-exact, nothing raised, the node up. Over shm, layer 14 is a
    disk table read over the rows socket."""
    d = fresh_daemon("--idle-timeout", IDLE, "--disk-tables", "engram.layer14")
    plans = [LayerPlan(14, "engram.layer14", 9.3e-3), LayerPlan(1, "engram.layer1", 0.3e-3)]
    rng = np.random.default_rng(5)
    with TableClient(d.address, transport=transport) as c:
        step = EngramStep(c, plans, max_tokens=32, policy="fail")
        t = c.node_transport()
        socket_of = t if transport == "tcp" else t.rows_port
        before = client_counters(d.address)
        for _ in range(3):
            wait_closed(d, socket_of, gauge=transport)
            ids = {1: rng.integers(0, 50_000, (32, 24)), 14: rng.integers(0, 70_001, (32, 24))}
            step.begin_step(ids)
            for layer, name in ((1, "engram.layer1"), (14, "engram.layer14")):
                np.testing.assert_array_equal(step.wait(layer).numpy(), demo_local[name][ids[layer]])
        assert step.summary()[1]["steps"] == 3
        check_up(c, d, before)


def test_a_node_gone_while_its_connection_was_idle_still_fails_over(tmp_path, demo_file, demo_local):
    """Re-opening is for a node that is up: the first idle close is re-opened (the node stays up), but once
    the node is killed, its connection's re-open is refused (or its keepalive's loss seen first) and the
    gather is served by the other replica, the dead node marked down."""
    nodes = [
        start_daemon(
            str(tmp_path / n), "--tables", demo_file, "--transports", "tcp", "--node-id", n, "--idle-timeout", IDLE
        )
        for n in ("a", "b")
    ]
    try:
        with TableClient(",".join(n.address for n in nodes), transport="tcp", standby=False) as c:
            first = next(n for n in nodes if n.address == c.read_from("engram.layer1"))
            other = next(n for n in nodes if n is not first)
            t = c.node_transport("engram.layer1")
            ids = np.random.default_rng(6).integers(0, 50_000, 4000)
            want = demo_local["engram.layer1"][ids]
            wait_closed(first, t)
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids, timeout=EVENT_TIMEOUT), want)
            assert c.replicas()[first.address]["state"] == "up" and t.reopened == 1
            wait_closed(first, t)
            first.stop(signal.SIGKILL)
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids, timeout=EVENT_TIMEOUT), want)
            assert c.replicas()[first.address]["state"] == "down"
            assert c.read_from("engram.layer1") == other.address
    finally:
        for n in nodes:
            n.stop()


def test_the_idle_timeout_never_closes_a_connection_with_a_response_in_flight(tmp_path, demo_file, demo_local):
    """The server's side: --idle-timeout closes only a connection with no request in any stage. A client asks
    for 60,000 rows (15 MiB, far more than the sockets buffer) and reads none of them for several idle
    timeouts; then it reads them all: every row there, bit-exact (a slow reader is the send timeout's).
    Before, the housekeeper measured idleness from the last bytes the server managed to send, and closed the
    connection mid-response after the idle timeout."""
    import socket
    import time

    from tests_helpers import open_raw_session, tcp_hello

    from tableserver.common.wire import HEADER, HEADER_BYTES, FrameType, recv_exact, request_header

    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp", "--idle-timeout", "0.05",
                     "--send-timeout", str(EVENT_TIMEOUT))  # fmt: skip
    try:
        resp = open_raw_session(d.address)
        host, port = d.ready["tcp"].rsplit(":", 1)
        table = demo_local["engram.layer1"]
        with TableClient(d.address, transport="tcp") as c:
            index = c.tables["engram.layer1"].index
        ids = np.random.default_rng(9).integers(0, table.shape[0], 60_000).astype("<i8")
        with socket.create_connection((host, int(port)), timeout=EVENT_TIMEOUT) as s:
            status, _ = tcp_hello(s, resp.session_id, resp.secret)
            assert status == 0
            s.sendall(request_header(FrameType.GATHER, 1, index, ids.size) + ids.tobytes())
            time.sleep(1.0)  # twenty idle timeouts with a response owed: the server must keep it
            head = bytearray(HEADER_BYTES)
            assert recv_exact(s, memoryview(head)), "the server closed the connection mid-response"
            _magic, _type, status, request_id, row_bytes, count = HEADER.unpack(head)
            assert (status, request_id, count, row_bytes) == (0, 1, ids.size, table.shape[1])
            rows = bytearray(count * row_bytes)
            assert recv_exact(s, memoryview(rows)), "the server closed the connection mid-response"
        np.testing.assert_array_equal(np.frombuffer(rows, np.uint8).reshape(count, row_bytes), table[ids])
    finally:
        d.stop()
