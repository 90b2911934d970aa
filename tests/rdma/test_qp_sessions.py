"""A native poller's QP session (tableclient.node.QpSession) behind one address for several daemons -- a Service VIP
during a rolling update -- is its main session's daemon's or none: never another daemon's rows.

``Vip`` is that address: a TCP forwarder whose new connections go to the backend of the moment, and whose
``switch`` does to the connections it has what a draining daemon's gRPC server does (an HTTP/2 GOAWAY: their
streams go on, no new one starts there). The client's main session keeps its keepalive stream on the old
connection to its daemon; the QP session's calls take a new connection, to the new backend: another start of the
same node (same tables, same node id), or another node serving another version of the tables. Real daemons,
real gRPC, real QPs on kernel Soft-RoCE in the QEMU guest (tests/host/test_rdma_guest.py boots it)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, SMALL_TABLES, local_tables
from guest import SLOW_CLIENT, guest_daemon
from tableclient import TableClient
from tableclient.errors import ConnectError
from tableclient.node import NodeOptions, NodeSession
from tests_helpers import stream_step

from tableserver.common.verbs import Device, create_rc_qp, verbs
from tableserver.tables.demo import write_demo_file

pytestmark = pytest.mark.rdma

FLAGS = ("--transports", "rdma,tcp")
TABLE = "engram.layer14"
#: an HTTP/2 GOAWAY (type 7, stream 0): last stream id 2^31-1, NO_ERROR -- a gRPC server's graceful shutdown
GOAWAY = (8).to_bytes(3, "big") + bytes([7, 0]) + (0).to_bytes(4, "big") + (2**31 - 1).to_bytes(4, "big") + bytes(4)


def recv_exact(s: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class Vip:
    """One address in front of several daemons: each new connection goes to ``backend`` of the moment."""

    def __init__(self, backend: str):
        self.backend = backend
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._conns: list = []  # (client side, server side, the lock of writes to the client side)
        threading.Thread(target=self._accept, name="vip-accept", daemon=True).start()

    def switch(self, backend: str) -> None:
        """A rolling update: new connections go to ``backend``, and the old daemon drains the connections it has
        (a GOAWAY between two of its frames)."""
        self.backend = backend
        with self._lock:
            conns = list(self._conns)
        for client, _server, lock in conns:
            with lock:
                try:
                    client.sendall(GOAWAY)
                except OSError:  # a connection that ended already (the client's or the daemon's doing)
                    pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for client, server, _lock in self._conns:
                client.close()
                server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, port = self.backend.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            conn = (client, server, threading.Lock())
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._up, args=conn, name="vip-up", daemon=True).start()
            threading.Thread(target=self._down, args=conn, name="vip-down", daemon=True).start()

    @staticmethod
    def _up(client: socket.socket, server: socket.socket, _lock) -> None:
        """Client to daemon, as it comes."""
        try:
            while data := client.recv(1 << 16):
                server.sendall(data)
            server.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    @staticmethod
    def _down(client: socket.socket, server: socket.socket, lock) -> None:
        """Daemon to client, an HTTP/2 frame at a time (a GOAWAY goes between two frames)."""
        try:
            while (head := recv_exact(server, 9)) is not None:
                body = recv_exact(server, int.from_bytes(head[:3], "big"))
                if body is None:
                    break
                with lock:
                    client.sendall(head + body)
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.fixture(scope="module")
def daemons(demo_file, tmp_path_factory):
    """n1 (the client's), n1 started again beside it (same tables), and n2 serving another version of them."""
    other = write_demo_file(str(tmp_path_factory.mktemp("other") / "other.bin"), SMALL_TABLES, seed=8)
    started = {}
    try:
        for name, node, tables in (("a", "n1", demo_file), ("again", "n1", demo_file), ("other", "n2", other)):
            started[name] = guest_daemon(str(tmp_path_factory.mktemp(name)), "--tables", tables, "--node-id", node,
                                         *FLAGS)  # fmt: skip
        yield started, local_tables(other)
    finally:
        for d in started.values():
            d.stop()


@pytest.fixture
def qp():
    """A QP in INIT on rxe_lo (what a native poller offers in its QP session), as QpInfo, and the device's name."""
    with Device("rxe_lo") as dev:
        cq = verbs().cq.CQ(dev.context, 4, None, None, 0)
        made, info = create_rc_qp(dev, cq, 1, 1, 0)
        try:
            yield info, dev.name
        finally:
            made.close()
            cq.close()


def qp_sessions(d) -> list[str]:
    """The log lines of the QP sessions ``d`` opened."""
    return [line for line in d.log().splitlines() if "(graph poller)" in line and " opened " in line]


@pytest.fixture
def vip(daemons):
    v = Vip(daemons[0]["a"].address)
    yield v
    v.close()


def test_a_qp_session_opened_through_a_drained_connection_to_the_same_daemon_is_admitted(daemons, vip, qp):
    """The set-up's control: a GOAWAY with the backend unchanged: the QP session takes a new connection to the
    same daemon, is admitted, and the daemon logs it as opened on behalf of the main session."""
    a = daemons[0]["a"]
    info, device = qp
    main = NodeSession(vip.address, NodeOptions(transport="rdma", connect_timeout=EVENT_TIMEOUT))
    try:
        before = len(qp_sessions(a))
        vip.switch(a.address)
        side = main.open_qp_session(info, device, 16, EVENT_TIMEOUT)
        try:
            assert side.server.instance_id == main.server.instance_id and side.peer.qp_num
        finally:
            side.close()
        opened = qp_sessions(a)[before:]
        assert len(opened) == 1 and f"for session {main.session.id.hex()[:12]})" in opened[0], opened
    finally:
        main.close()


@pytest.mark.parametrize(
    "backend, why",
    [
        ("again", "node 'n1' there is another start of it (instance "),
        ("other", "table 'engram.layer1' there is sha256:"),
    ],
)
def test_a_qp_session_that_reaches_another_daemon_is_refused_in_one_line(daemons, vip, qp, backend, why):
    """The QP session's calls reach another start of the node, or another node with another version of the
    tables: refused before any session is opened there, one line naming what differs and the fix (the client's,
    where the catalog's call reached the other daemon first; else that daemon's, which does not hold the session
    the QP session is opened for: both calls may take different connections while the address drains)."""
    started, _ = daemons
    other = started[backend]
    info, device = qp
    main = NodeSession(vip.address, NodeOptions(transport="rdma", connect_timeout=EVENT_TIMEOUT))
    try:
        vip.switch(other.address)
        with pytest.raises(ConnectError) as e:
            main.open_qp_session(info, device, 16, EVENT_TIMEOUT)
        message = str(e.value)
        assert "\n" not in message
        if "FAILED_PRECONDITION" in message:  # the open's call reached the other daemon before the catalog's did:
            assert "is not held by this daemon" in message and "a Service VIP" in message  # refused there
        else:  # the client saw the other daemon first
            assert message.startswith(
                f"tableserver at {vip.address}: the graph poller's QP session reached another daemon than its "
                "session's ("
            )
            assert why in message and message.endswith("give the client each node's own address (a headless Service)")
        assert not qp_sessions(other)  # nothing opened there
        assert main.error is None  # the main session goes on, on its daemon
    finally:
        main.close()


def test_a_graph_step_behind_a_shared_address_never_gets_another_daemons_rows(daemons, vip, demo_local):
    """A GraphStep's native poller over rdma whose QP session would reach another node serving another version of
    the table: its steps get the client's node's rows (read another way) or the policy's zeros, never the other
    node's rows; or the native poller is not used at all, saying why."""
    import torch  # noqa: F401  (the GraphStep's staging)
    from tableclient.graph.poller.native import NativeUnavailable
    from tableclient.graph.step import GraphStep, HostStreamOps
    from tableclient.step import LayerPlan

    started, other_local = daemons
    mine, theirs = demo_local[TABLE], other_local[TABLE]
    rng = np.random.default_rng(50)
    with TableClient(vip.address, transport="rdma", **SLOW_CLIENT) as c:
        vip.switch(started["other"].address)
        try:
            g = GraphStep(c, [LayerPlan(14, TABLE, EVENT_TIMEOUT)], {14: "in_graph"}, 8, policy="zeros",
                          stream_ops=HostStreamOps(EVENT_TIMEOUT), poller="native", timeout=EVENT_TIMEOUT,
                          budgets={14: EVENT_TIMEOUT})  # fmt: skip
        except NativeUnavailable as e:
            assert "reached another daemon than its session's" in str(e), e
            print(f"the native poller is not used: {e}")
            return
        try:
            served = 0
            for _ in range(4):
                ids = {14: rng.integers(0, mine.shape[0], (8, 24))}
                g.arm(8)
                rows = stream_step(g, ids, 8, layers=[14])[14]
                assert not (rows == theirs[ids[14]]).all(axis=-1).any(), "a row of the other node's table"
                if (rows == mine[ids[14]]).all():
                    served += 1
                else:
                    assert not rows.any(), "rows neither the table's nor the policy's zeros"
            assert served, "no step got the table's rows"
            print(f"{served} of 4 steps got the table's rows, the rest the policy's zeros")
        finally:
            g.close()
