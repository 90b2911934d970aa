"""Pure logic: the transport interface both sides share -- one factory and options object, the base
classes' signatures kept by every transport, verbs errors wrapped at each side's boundary, and one
``Refused`` for every refusal on the wire."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from tableclient.errors import ConnectError, TableClientError, TransportError, TransportUnavailable
from tableclient.transports import KNOWN, TransportOptions, open_transport, prepare_transport, transport_class
from tableclient.transports.base import DONE, ClientTransport, Prepared

from tableserver.common import verbs, wire
from tableserver.common.wire import (
    HEADER,
    HEADER_BYTES,
    FrameType,
    HandshakeRefused,
    Refused,
    Status,
    parse_challenge,
    parse_pack_error,
)
from tableserver.errors import TableServerError
from tableserver.transports import KNOWN as SERVER_KNOWN
from tableserver.transports import transport_class as server_transport_class
from tableserver.transports.base import ServerTransport


def _params(fn) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


CLIENT_API = ["__init__", "prepare", "gather", "local_table", "take_async", "request_rows", "close"]


@pytest.mark.parametrize("name", KNOWN)
def test_every_client_transport_keeps_the_base_signatures(name):
    """A transport is opened and driven through ClientTransport alone: every override takes exactly the
    base's parameters (names, kinds and defaults; their types are documented once, on the base), so no
    caller needs to know which it has."""
    cls = transport_class(name)
    assert issubclass(cls, ClientTransport) and cls.name == name
    for attr in CLIENT_API:
        if attr in cls.__dict__:
            assert _params(getattr(cls, attr)) == _params(getattr(ClientTransport, attr)), f"{cls.__name__}.{attr}"
    assert not inspect.isabstract(cls)


@pytest.mark.parametrize("name", SERVER_KNOWN)
def test_every_server_transport_keeps_the_base_signatures(name):
    cls = server_transport_class(name)
    assert issubclass(cls, ServerTransport) and cls.name == name
    for attr in ("__init__", "bind", "start", "offer", "release", "active_sessions", "health", "close", "describe"):
        if attr in cls.__dict__:
            assert _params(getattr(cls, attr)) == _params(getattr(ServerTransport, attr)), f"{cls.__name__}.{attr}"


def test_the_factory_passes_what_the_constructor_takes():
    """open_transport's arguments are the constructor's, in order; only rdma prepares anything."""
    assert _params(open_transport)[1:] == _params(ClientTransport.__init__)[1:]
    assert prepare_transport("tcp", TransportOptions(), []) is None
    assert prepare_transport("shm", TransportOptions(), []) is None
    with pytest.raises(ValueError, match="unknown transport 'udp'"):
        prepare_transport("udp", TransportOptions(), [])


def test_take_async_is_there_for_every_transport():
    """The table layer calls take_async on any transport that maps a table; the default copies inline."""

    class Plain(ClientTransport):
        def gather(self, table_index, ids, out, sync=False, mode="read", expand=None, hedge_after=None):
            raise AssertionError

        def close(self):
            pass

    rows = np.arange(40, dtype=np.uint8).reshape(10, 4)
    out = np.empty((3, 4), np.uint8)
    pending = Plain(None, None, []).take_async(rows, np.array([9, 0, 9]), out)
    assert pending is DONE and pending.done()
    np.testing.assert_array_equal(out, rows[[9, 0, 9]])
    assert "take_async" in transport_class("shm").__dict__  # shm's runs on its copy thread


def test_verbs_errors_belong_to_neither_side():
    """tableserver.common.verbs has its own errno-carrying base: the daemon and the client wrap it."""
    for cls in (verbs.RdmaUnavailable, verbs.RdmaError):
        assert issubclass(cls, verbs.VerbsError)
        assert not issubclass(cls, (TableServerError, TableClientError))
    e = verbs.RdmaError("Failed to register MR", errno=12)
    assert e.errno == 12 and str(e) == "Failed to register MR"
    assert verbs.error_errno(OSError(5, "x")) == 5 and verbs.error_errno(ValueError()) is None
    assert verbs.rdma_error("Failed to create a QP", e).errno == 12


def test_the_client_rdma_transport_reports_verbs_errors_as_its_own():
    """What a verbs call raises inside the client's rdma transport (at connect, on a table's first read,
    posting or polling) leaves it as a TableClientError, errno kept: routing fails over on it."""
    from tableclient.transports import rdma

    used = rdma.verbs_failure("rdma staging of 4096 bytes on rxe0", verbs.RdmaError("Failed to register MR", errno=12))
    assert isinstance(used, TransportError) and isinstance(used, TableClientError) and isinstance(used, ConnectionError)
    assert used.errno == 12 and "rdma staging of 4096 bytes on rxe0: Failed to register MR" == str(used)
    at_connect = rdma.verbs_failure("rdma to the server on rxe0", verbs.RdmaError("x"), TransportUnavailable)
    assert isinstance(at_connect, TransportUnavailable) and at_connect.errno is None


def _skip_with_rdma_devices() -> None:
    try:
        devices = verbs.list_devices()
    except verbs.RdmaUnavailable:
        devices = []
    if devices:
        pytest.skip(f"this host has RDMA devices ({', '.join(devices)})")


def test_rdma_without_a_device_is_unavailable_to_the_client():
    """On this host (no RDMA device, or no pyverbs) the real verbs stack answers, and the client sees
    TransportUnavailable -- a TableClientError -- from the one factory, never a verbs error."""
    _skip_with_rdma_devices()
    with pytest.raises(TransportUnavailable) as caught:
        prepare_transport("rdma", TransportOptions(rdma_qps=1), [])
    assert isinstance(caught.value, TableClientError) and not isinstance(caught.value, verbs.VerbsError)
    assert "rdma link add" in str(caught.value) or "python3-pyverbs" in str(caught.value)
    with pytest.raises(TransportUnavailable, match="prepared before the session"):
        open_transport("rdma", None, None, [], 1.0, TransportOptions(), None)


def test_rdma_without_a_device_is_unavailable_to_the_daemon():
    from tableserver.errors import TransportUnavailable as ServerUnavailable
    from tableserver.sessions import SessionRegistry
    from tableserver.transports import open_transport as open_server_transport

    t = open_server_transport("rdma", SessionRegistry(60), {})
    _skip_with_rdma_devices()
    with pytest.raises(ServerUnavailable, match="^rdma transport: ") as caught:
        t.bind()
    assert isinstance(caught.value, TableServerError)  # the CLI prints it as one line
    t.close()


def test_one_refused_for_every_refusal():
    from tableserver.transports import connections

    assert HandshakeRefused is Refused and connections.Refused is Refused
    r = Refused(Status.BUSY, "the tcp port is at its limit of 3 connections")
    assert r.fatal and r.name == "BUSY" and str(r) == r.message
    assert r.describe() == "BUSY: the tcp port is at its limit of 3 connections"
    assert Refused(99, "?").name == "99" and not Refused(Status.ROW_OUT_OF_RANGE, "").fatal

    # a refused connection: the frame the server sends in place of its CHALLENGE, parsed by the client
    with pytest.raises(Refused) as caught:
        parse_challenge(r.frame(FrameType.CHALLENGE))
    assert (caught.value.status, caught.value.message) == (Status.BUSY, r.message)

    # a refused request: header + message, request id and type kept
    frame = Refused(Status.UNKNOWN_TABLE, "no table #9").frame(FrameType.GATHER, 77)
    magic, ftype, status, rid, row_bytes, count = HEADER.unpack_from(frame)
    assert (magic, ftype, status, rid, row_bytes) == (
        wire.RESPONSE_MAGIC,
        FrameType.GATHER,
        Status.UNKNOWN_TABLE,
        77,
        0,
    )
    back = Refused.from_wire(status, frame[HEADER_BYTES : HEADER_BYTES + count])
    assert (back.status, back.message) == (Status.UNKNOWN_TABLE, "no table #9")

    # sealed connections seal the message under the header
    sealed = Refused(Status.BAD_FRAME, "bad").frame(FrameType.GATHER, 1, seal=lambda h, m: m[::-1] + b"tag")
    assert sealed[HEADER_BYTES:] == b"dabtag" and HEADER.unpack_from(sealed)[5] == 3

    # rdma pack mode: the PACK_ERROR message, cut to the client's receive buffer
    long = Refused(Status.TOO_MANY_ROWS, "x" * 1000).pack_error(5)
    assert len(long) == wire.PACK_REPLY_BYTES
    request_id, refused = parse_pack_error(long)
    assert request_id == 5 and refused.status == Status.TOO_MANY_ROWS and refused.message == "x" * (len(long) - 16)
    assert parse_pack_error(b"TSPK" + bytes(12)) is None and parse_pack_error(b"short") is None


def test_the_client_reports_a_refused_request_as_remote_error():
    from tableclient.errors import RemoteError
    from tableclient.transports.base import remote_error

    e = remote_error(Refused(Status.ROW_OUT_OF_RANGE, "row id 10 out of range"))
    assert isinstance(e, RemoteError) and e.status == "ROW_OUT_OF_RANGE" and e.message == "row id 10 out of range"
    assert str(e) == "ROW_OUT_OF_RANGE: row id 10 out of range"
    assert not issubclass(RemoteError, ConnectError)


def test_a_prepared_base_asks_nothing_and_frees_nothing():
    p = Prepared()
    assert p.request_fields() == {}
    p.close()
    p.close()
