"""TableClient: one session with a tableserver, its catalog and data transport.

    with TableClient("memnode:7070") as client:          # transport="auto"
        layer1 = client.table("engram.layer1")
        rows = layer1.gather(row_ids)                     # [..., 264] uint8
        h1, h14 = client.gather_many([(layer1, ids1), ("engram.layer14", ids14)])

Connecting fetches the catalog, opens a session (the server returns a secret
and one offer per transport we accept), connects the first transport that
works (auto: shm when the server is on this host, else tcp), and starts a
keepalive stream: the session lives exactly as long as this client.

Not fork-safe (gRPC channels are not): create clients after forking.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from dataclasses import dataclass

import grpc

from tableclient.errors import AuthError, ConnectError, TableClientError, TransportUnavailable
from tableclient.metrics import metrics
from tableclient.table import GatherHandle, RemoteTable, TableInfo, check_mode
from tableclient.transports import AUTO_ORDER, KNOWN, transport_class
from tableclient.transports.shm import local_host_id

from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

log = logging.getLogger("tableclient")

# Addresses whose session this process lost: the next connect there is a reconnect.
_lost: set[str] = set()
_lost_lock = threading.Lock()


@dataclass(frozen=True)
class SessionInfo:
    id: bytes
    secret: bytes
    lease_seconds: float
    max_rows_per_request: int


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConnectError(f"cannot read {path} ({e.strerror})") from None


class TableClient:
    """A session with one tableserver. Thread-safe for gathers; use as a context manager."""

    def __init__(self, address: str = "127.0.0.1:7070", transport: str = "auto", *, token: str | None = None,
                 tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_server_name: str | None = None, client_name: str = "",
                 connect_timeout: float = 10.0, mode: str = "read", rdma_device: str | None = None,
                 rdma_gid_index: int | None = None, rdma_port: int = 1, rdma_qps: int = 4,
                 rdma_ring_rows: int = 4096):
        if transport != "auto" and transport not in KNOWN:
            raise ValueError(f"unknown transport {transport!r}: use auto, {', '.join(KNOWN)}")
        self.mode = check_mode(mode)
        if not 1 <= rdma_qps <= 64 or rdma_ring_rows < 16:
            raise ValueError("rdma_qps must be 1..64 and rdma_ring_rows at least 16")
        self._rdma_options = dict(device=rdma_device, gid_index=rdma_gid_index, port=rdma_port, qps=rdma_qps,
                                  ring_rows=rdma_ring_rows)
        self.address = address
        self.connect_timeout = connect_timeout
        token = token if token is not None else os.environ.get("TABLESERVER_AUTH_TOKEN") or None
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._closed = False
        self._counted = ""  # transport this client counts in tableserver_client_sessions
        self._transport = None
        self._keepalive_thread = None
        self._keepalive_call = None
        self._stop = threading.Event()
        self.session: SessionInfo | None = None
        self.session_error: BaseException | None = None
        self._channel = self._make_channel(address, tls or bool(tls_ca or tls_cert), tls_ca, tls_cert, tls_key,
                                           tls_server_name)
        self._metrics = metrics()
        try:
            self._stub = pb_grpc.TableServiceStub(self._channel)
            catalog = self._call(self._stub.GetCatalog, pb.GetCatalogRequest())
            self.server = catalog.server
            self._infos = [TableInfo.from_proto(t) for t in catalog.tables]
            self.tables: dict[str, TableInfo] = {t.name: t for t in self._infos}
            self._connect(transport, client_name)
        except BaseException as e:
            if isinstance(e, Exception):
                self._metrics.error(e)
            self.close()
            raise
        self._metrics.connects.labels(self.transport).inc()
        self._metrics.sessions.labels(self.transport).inc()
        self._counted = self.transport
        with _lost_lock:
            if address in _lost:
                _lost.discard(address)
                self._metrics.reconnects.inc()

    # ----------------------------------------------------------- connecting
    @staticmethod
    def _make_channel(address, tls, ca, cert, key, server_name):
        options = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.keepalive_permit_without_calls", 1)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if not tls:
            return grpc.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                             certificate_chain=_read(cert))
        return grpc.secure_channel(address, creds, options=options)

    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.connect_timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._rpc_error(e) from None

    def _rpc_error(self, e: grpc.RpcError) -> TableClientError:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthError(f"tableserver at {self.address} rejected the credentials: {details}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ConnectError(f"cannot reach tableserver at {self.address}: {details}")
        return ConnectError(f"tableserver at {self.address}: {code.name}: {details}")

    def _connect(self, transport: str, client_name: str) -> None:
        wanted = list(AUTO_ORDER) if transport == "auto" else [transport]
        if transport == "auto":
            if self.server.host_id != local_host_id():
                wanted.remove("shm")  # another host: do not even ask for it
            wanted = [t for t in wanted if t in self.server.transports] or wanted
        reasons = []
        prepared = None
        if "rdma" in wanted:  # the handshake carries our QPs, so they exist before the session
            try:
                prepared = transport_class("rdma").prepare(**self._rdma_options, tables=len(self._infos))
            except TransportUnavailable as e:
                if transport == "rdma":
                    raise ConnectError(f"transport='rdma' to {self.address}: {e}") from None
                wanted.remove("rdma")
                reasons.append(f"rdma: {e}")
        try:
            resp = self._call(self._stub.OpenSession, pb.OpenSessionRequest(
                client_name=client_name or f"tableclient/{os.path.basename(sys.argv[0] or 'python')}",
                hostname=socket.gethostname(), host_id=local_host_id(), pid=os.getpid(), transports=wanted,
                rdma=prepared.params() if prepared is not None else None))
            self.session = SessionInfo(resp.session_id, resp.secret, resp.lease_seconds, resp.max_rows_per_request)
            self._start_keepalive()
            for offer in resp.offers:
                extra = dict(prepared=prepared) if offer.name == "rdma" else {}
                try:
                    self._transport = transport_class(offer.name)(offer, self.session, self._infos,
                                                                  self.connect_timeout, **extra)
                    break
                except TransportUnavailable as e:
                    reasons.append(f"{offer.name}: {e}")
                    if offer.name == "rdma":
                        prepared.close()
                        prepared = None
        finally:
            if prepared is not None and (self._transport is None or self._transport.name != "rdma"):
                prepared.close()
        if self._transport is None:
            raise ConnectError(f"no usable transport to {self.address} ({'; '.join(reasons) or 'none offered'})")
        log.debug("session %s uses %s", self.session.id.hex()[:12], self._transport.name)

    def _start_keepalive(self) -> None:
        """Starts the KeepAlive stream and returns once the server has bound it to the session.

        The stream is the session's liveness: once bound, the server ends the
        session the moment this process dies. Before the server's first answer
        only the lease would reclaim it, so nothing else happens until then.
        """
        interval = max(self.session.lease_seconds / 3.0, 0.05)
        session_id = self.session.id
        bound, answered = threading.Event(), threading.Event()

        def pings():
            yield pb.KeepAliveRequest(session_id=session_id)
            while not self._stop.wait(interval):
                yield pb.KeepAliveRequest(session_id=session_id)

        def run():
            try:
                self._keepalive_call = self._stub.KeepAlive(pings(), metadata=self._metadata)
                for _ in self._keepalive_call:
                    answered.set()
                    bound.set()
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    self.session_error = self._rpc_error(e)
                    if answered.is_set():
                        self._metrics.session_losses.inc()
                        with _lost_lock:
                            _lost.add(self.address)
                        log.warning("tableserver session lost: %s", self.session_error)
            finally:
                bound.set()  # wakes the constructor when the stream ends before its first answer

        self._keepalive_thread = threading.Thread(target=run, name="tableclient-keepalive", daemon=True)
        self._keepalive_thread.start()
        if not bound.wait(self.connect_timeout):
            raise ConnectError(f"tableserver at {self.address} did not answer the session keepalive within "
                               f"{self.connect_timeout:g} s: raise connect_timeout or check the server")
        if not answered.is_set():
            raise self.session_error or ConnectError(f"tableserver at {self.address} ended the session keepalive "
                                                     "before answering it")

    # --------------------------------------------------------------- public
    @property
    def transport(self) -> str:
        """Name of the data transport in use (shm, tcp, ...)."""
        return self._transport.name if self._transport is not None else ""

    @property
    def max_rows_per_request(self) -> int:
        return self.session.max_rows_per_request or 65536

    def table(self, name: str | None = None, *, layer: int | None = None, mode: str | None = None) -> RemoteTable:
        """A table by name, or by model layer (``client.table(layer=1)``); ``mode`` "read" or "pack"."""
        mode = mode or self.mode
        if name is not None:
            info = self.tables.get(name)
            if info is None:
                raise KeyError(f"no table {name!r} on {self.address}: it serves {', '.join(self.tables) or 'none'}")
            return RemoteTable(self, info, mode)
        matches = [t for t in self._infos if layer is not None and t.layer == layer]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} tables for layer {layer} on {self.address}: pass a name instead")
        return RemoteTable(self, matches[0], mode)

    def gather_many(self, requests, outs=None) -> list[GatherHandle]:
        """Issues several tables' gathers in the order given (put the shortest deadline first).

        ``requests`` is a list of ``(table or name, row_ids)``; ``outs`` an
        optional list of output buffers. Returns one handle per request.
        """
        outs = outs if outs is not None else [None] * len(requests)
        if len(outs) != len(requests):
            raise ValueError(f"{len(outs)} outs for {len(requests)} requests")
        handles = []
        for (table, ids), out in zip(requests, outs):
            t = table if isinstance(table, RemoteTable) else self.table(table)
            handles.append(t.gather_async(ids, out))
        return handles

    def _data_transport(self):
        if self._transport is None:
            raise TableClientError("client is closed")
        return self._transport

    def close(self) -> None:
        """Ends the session and frees everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._counted:
            self._metrics.sessions.labels(self._counted).dec()
            self._counted = ""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self.session is not None:
            try:
                self._stub.CloseSession(pb.CloseSessionRequest(session_id=self.session.id), timeout=2.0,
                                        metadata=self._metadata)
            except grpc.RpcError:
                pass  # the server may be gone; the lease reclaims the session
        self._stop.set()  # after CloseSession, so the server logs why the session ended
        if self._keepalive_call is not None:
            self._keepalive_call.cancel()
        if self._keepalive_thread is not None:
            self._keepalive_thread.join(timeout=2.0)
        self._channel.close()

    def __enter__(self) -> "TableClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TableClient({self.address!r}, transport={self.transport!r}, tables={list(self.tables)})"
