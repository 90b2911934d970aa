"""A session opened on behalf of another (a native poller's QP session, tableclient.node.QpSession) is opened only by
the daemon that holds that other session: behind one address for several daemons (a Service VIP in a rolling
update) it is refused, in one line, and never opened elsewhere. Every daemon names its start (instance_id) in its
catalog and in every OpenSession answer, so a client tells two starts of one node apart. Spoken with the
generated stubs on real daemons; the client's side, over rdma, is tests/rdma/test_qp_sessions.py."""

from __future__ import annotations

import grpc
import pytest
from conftest import EVENT_TIMEOUT

from tableserver.common.wire import owner_proof
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc


class Raw:
    """The control plane of one daemon spoken with the generated stubs."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.TableServiceStub(self.channel)

    def catalog(self) -> pb.Catalog:
        return self.stub.GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)

    def open(self, **kw) -> pb.OpenSessionResponse:
        return self.stub.OpenSession(
            pb.OpenSessionRequest(client_name="owner-test", transports=["tcp"], **kw), timeout=EVENT_TIMEOUT
        )

    def close(self, session_id: bytes) -> None:
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=EVENT_TIMEOUT)


@pytest.fixture
def raw():
    made = []

    def connect(address: str) -> Raw:
        made.append(Raw(address))
        return made[-1]

    yield connect
    for r in made:
        r.channel.close()


def on_behalf_of(resp: pb.OpenSessionResponse) -> dict:
    return dict(owner_session_id=resp.session_id, owner_proof=owner_proof(resp.secret, resp.session_id))


def test_every_start_of_a_daemon_names_itself_in_its_catalog_and_open_answers(fresh_daemon, raw):
    a, b = fresh_daemon("--node-id", "n1"), fresh_daemon("--node-id", "n1")
    ra, rb = raw(a.address), raw(b.address)
    server = ra.catalog().server
    assert len(server.instance_id) == 16 and ra.catalog().server.instance_id == server.instance_id
    assert rb.catalog().server.node_id == "n1" and rb.catalog().server.instance_id != server.instance_id
    resp = ra.open()
    assert resp.server == server  # the daemon that opened it, as its catalog names it
    ra.close(resp.session_id)


def test_a_session_on_behalf_of_one_this_daemon_holds_is_opened_and_logged_as_such(daemon, raw):
    r = raw(daemon.address)
    main = r.open()
    try:
        side = r.open(**on_behalf_of(main))
        assert side.session_id != main.session_id and side.server.instance_id == r.catalog().server.instance_id
        r.close(side.session_id)
        assert f"for session {main.session_id.hex()[:12]})" in daemon.log()
    finally:
        r.close(main.session_id)


def test_a_session_on_behalf_of_one_this_daemon_does_not_hold_is_refused_in_one_line(fresh_daemon, raw):
    """Another daemon behind the same address (here: the other daemon's own), a closed session, a wrong proof, a
    malformed id: FAILED_PRECONDITION naming the session, this daemon, and the fix; no session opened."""
    a, b = fresh_daemon("--node-id", "n1"), fresh_daemon("--node-id", "n1")
    ra, rb = raw(a.address), raw(b.address)
    main = ra.open()
    b_instance = rb.catalog().server.instance_id
    with pytest.raises(grpc.RpcError) as e:
        rb.open(**on_behalf_of(main))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    message = e.value.details()
    assert "\n" not in message
    assert message.startswith(f"session {main.session_id.hex()[:12]} this session is opened on behalf of is not held")
    assert f"(node n1, instance {b_instance})" in message and "open the session where that one is" in message
    assert "opened (transports" not in b.log()  # B opened nothing

    for bad in (
        dict(owner_session_id=main.session_id, owner_proof=owner_proof(b"\0" * 32, main.session_id)),  # not its secret
        dict(owner_session_id=main.session_id[:5], owner_proof=b"x"),
        dict(owner_session_id=b"", owner_proof=owner_proof(main.secret, main.session_id)),
    ):
        with pytest.raises(grpc.RpcError) as e:
            ra.open(**bad)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    ra.close(main.session_id)
    with pytest.raises(grpc.RpcError) as e:  # a session that ended holds nothing on anyone's behalf
        ra.open(**on_behalf_of(main))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert a.log().count("opened (transports") == 1  # only the main session was ever opened on A
