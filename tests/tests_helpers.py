"""Helpers for tests that speak the data protocols by hand."""

from __future__ import annotations

import socket

import grpc

from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc
from tableserver.wire import HEADER, FrameType, Status, request_header


def open_raw_session(address: str, transports=("tcp",)):
    """A session opened with the generated stubs (no keepalive: the lease reclaims it)."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.TableServiceStub(ch)
        return stub.OpenSession(pb.OpenSessionRequest(client_name="raw", transports=list(transports)), timeout=10)


def shm_fds(daemon) -> list[int]:
    """The table fds the shm transport hands a freshly opened session."""
    resp = open_raw_session(daemon.address, ("shm",))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(daemon.ready["shm"])
        s.send(request_header(FrameType.HELLO, 1, 0, 48) + resp.session_id + resp.secret)
        msg, fds, _, _ = socket.recv_fds(s, 1 << 20, 16)
    assert HEADER.unpack_from(msg)[2] == Status.OK
    return fds
