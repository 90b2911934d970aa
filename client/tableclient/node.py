"""NodeSession: one session with one tableserver (one memory node).

Opening it fetches the server's catalog, opens a session (the server returns a
secret and one offer per transport we accept), connects the first transport
that works, and starts a keepalive stream; it returns only once the server
has bound that stream to the session, so from then on this process's death
ends the session at once. The stream is also how we hear the server: a
response to every ping (every ``keepalive_interval``), so :meth:`silent_for`
tells a frozen or unreachable server from a live one within a bounded time,
and a broken stream calls ``on_lost``.

Routing across nodes (replicas, shards, fail-over, hedging) is one layer up,
in :mod:`tableclient.routing`; this module knows one server only.
Not fork-safe (gRPC channels are not): create sessions after forking.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from tableclient.errors import AuthError, ConnectError, TableClientError, TransportUnavailable
from tableclient.metrics import metrics
from tableclient.table import TableInfo, check_catalog
from tableclient.transports import AUTO_ORDER, KNOWN, TransportOptions, open_transport, prepare_transport
from tableclient.transports.shm import local_host_id
from tableserver.common.verbs import QpInfo
from tableserver.common.wire import SECRET_BYTES, SESSION_ID_BYTES, owner_proof
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

#: the longest session lease a client accepts (the bound of the server's --lease-seconds)
MAX_LEASE_S = 86400.0
#: offers of one session looked at (a server offers one per transport asked for)
MAX_OFFERS = 16

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionInfo:
    id: bytes
    secret: bytes
    lease_seconds: float
    max_rows_per_request: int


@dataclass(frozen=True)
class NodeOptions:
    """How to reach and talk to a tableserver; the same for every node of a client."""

    transport: str = "auto"
    token: str | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    client_name: str = ""
    connect_timeout: float = 10.0
    keepalive_interval: float = 0.5  # seconds between pings; the server answers each
    #: how the data transports are set up (tcp busy-polling, rdma device and rings, ...)
    transport_options: TransportOptions = field(default_factory=TransportOptions)

    def metadata(self) -> tuple:
        token = self.token if self.token is not None else os.environ.get("TABLESERVER_AUTH_TOKEN") or None
        return (("authorization", f"Bearer {token}"),) if token else ()


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConnectError(f"cannot read {path} ({e.strerror})") from None


def make_channel(address: str, o: NodeOptions):
    options = [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if o.tls_server_name:
        options.append(("grpc.ssl_target_name_override", o.tls_server_name))
    if not (o.tls or o.tls_ca or o.tls_cert):
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(o.tls_ca), private_key=_read(o.tls_key), certificate_chain=_read(o.tls_cert)
    )
    return grpc.secure_channel(address, creds, options=options)


def rpc_error(address: str, e: grpc.RpcError) -> TableClientError:
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"tableserver at {address} rejected the credentials: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ConnectError(f"cannot reach tableserver at {address}: {details}")
    return ConnectError(f"tableserver at {address}: {code.name}: {details}")


def fetch_catalog(address: str, o: NodeOptions, channel=None, timeout: float | None = None):
    """(ServerInfo, [TableInfo]) of the server at ``address`` (one GetCatalog call, within ``timeout``
    seconds, default ``connect_timeout``); ConnectError for a catalog no tableserver sends."""
    own = channel is None
    channel = channel or make_channel(address, o)
    try:
        catalog = pb_grpc.TableServiceStub(channel).GetCatalog(
            pb.GetCatalogRequest(),
            timeout=max(o.connect_timeout if timeout is None else timeout, 0.001),
            metadata=o.metadata(),
        )
    except grpc.RpcError as e:
        raise rpc_error(address, e) from None
    finally:
        if own:
            channel.close()
    try:
        return catalog.server, check_catalog([TableInfo.from_proto(t) for t in catalog.tables])
    except ValueError as e:
        raise ConnectError(
            f"tableserver at {address} sent a bad catalog ({e}): not a tableserver, or a "
            "broken one; fix or remove that address"
        ) from None


def _session_info(address: str, resp) -> SessionInfo:
    """The session the server granted, checked: ConnectError for values no tableserver sends."""
    lease = resp.lease_seconds
    if len(resp.session_id) != SESSION_ID_BYTES or len(resp.secret) != SECRET_BYTES or not 0.0 < lease <= MAX_LEASE_S:
        raise ConnectError(
            f"tableserver at {address} granted a malformed session (id of {len(resp.session_id)} "
            f"bytes, secret of {len(resp.secret)}, lease {lease!r} s): not a tableserver of this "
            "version"
        )
    return SessionInfo(resp.session_id, resp.secret, lease, resp.max_rows_per_request)


class NodeSession:
    """A session with the tableserver at ``address``: catalog, data transport, keepalive.

    Opening it -- catalog, session, keepalive bound, data transport handshake -- ends within one
    deadline, ``connect_timeout`` seconds from the start, however the server paces its answers."""

    def __init__(self, address: str, options: NodeOptions, on_lost=None, deadline: float | None = None):
        """``deadline`` (time.monotonic()): end the open by then rather than connect_timeout from now,
        when that is sooner (a client's start-up: its catalog probes and sessions share one deadline)."""
        o = options
        if o.transport != "auto" and o.transport not in KNOWN:
            raise ValueError(f"unknown transport {o.transport!r}: use auto, {', '.join(KNOWN)}")
        self.address = address
        self.options = o
        self._metadata = o.metadata()
        self._on_lost = on_lost
        self.closed = False  # read on every gather (a plain attribute: no property call); set by close
        self._counted = ""  # transport this session counts in tableserver_client_sessions
        self._transport = None
        self._offers: dict = {}  # transport name -> the server's offer, for data connections of their own
        self._keepalive_thread = None
        self._keepalive_call = None
        self._stop = threading.Event()
        self.session: SessionInfo | None = None
        self.error: BaseException | None = None  # why the session was lost, once it was
        self.last_heard = time.monotonic()
        self._deadline = time.monotonic() + o.connect_timeout  # the whole open: every step below
        if deadline is not None:
            self._deadline = min(self._deadline, deadline)
        self._channel = make_channel(address, o)
        self._metrics = metrics()
        try:
            self._stub = pb_grpc.TableServiceStub(self._channel)
            self.server, self.infos = fetch_catalog(address, o, self._channel, self._left())
            self.tables: dict[str, TableInfo] = {t.name: t for t in self.infos}
            self._connect(o.transport, o.client_name)
        except BaseException as e:
            if isinstance(e, Exception):
                self._metrics.error(e)
            self.close(graceful=False)  # within the deadline: ending the keepalive stream ends the session
            raise
        if self._transport is not None:  # a QpSession's data path is its owner's: counted nowhere
            self._metrics.connects.labels(self.transport).inc()
            self._metrics.sessions.labels(self.transport).inc()
            self._counted = self.transport

    # ----------------------------------------------------------- connecting
    def _left(self) -> float:
        """Seconds left of the open's deadline; ConnectError once it has passed."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise ConnectError(
                f"tableserver at {self.address} did not complete the session set-up within "
                f"connect_timeout={self.options.connect_timeout:g} s: check the server or raise "
                "connect_timeout"
            )
        return left

    def _call(self, method, request, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self._left(), metadata=self._metadata)
        except grpc.RpcError as e:
            raise rpc_error(self.address, e) from None

    def _connect(self, transport: str, client_name: str) -> None:
        wanted = list(AUTO_ORDER) if transport == "auto" else [transport]
        if transport == "auto":
            if self.server.host_id != local_host_id():
                wanted.remove("shm")  # another host: do not even ask for it
            wanted = [t for t in wanted if t in self.server.transports] or wanted
        reasons, skipped = [], 0
        options = self.options.transport_options
        prepared = {}  # name -> what it made before the session (rdma: QPs the handshake carries)
        try:
            for name in list(wanted):
                try:
                    made = prepare_transport(name, options, self.infos)
                except TransportUnavailable as e:
                    if transport == name:
                        raise ConnectError(f"transport={name!r} to {self.address}: {e}") from None
                    wanted.remove(name)
                    reasons.append(f"{name}: {e}")
                    continue
                if made is not None:
                    prepared[name] = made
            fields = {k: v for made in prepared.values() for k, v in made.request_fields().items()}
            resp = self._call(
                self._stub.OpenSession,
                pb.OpenSessionRequest(
                    client_name=client_name or f"tableclient/{os.path.basename(sys.argv[0] or 'python')}",
                    hostname=socket.gethostname(),
                    host_id=local_host_id(),
                    pid=os.getpid(),
                    transports=wanted,
                    **fields,
                ),
            )
            self.session = _session_info(self.address, resp)
            self._start_keepalive()
            self._offers = {offer.name: offer for offer in resp.offers[:MAX_OFFERS]}
            for offer in resp.offers[:MAX_OFFERS]:
                if offer.name not in wanted:  # not asked for (or unknown to this client): never tried
                    skipped += 1
                    continue
                made = prepared.pop(offer.name, None)  # the transport takes it over (and frees it if it fails)
                try:
                    self._transport = open_transport(
                        offer.name, offer, self.session, self.infos, self._left(), options, made
                    )
                    break
                except TransportUnavailable as e:
                    reasons.append(f"{offer.name}: {e}")
                except TableClientError:
                    if made is not None:
                        made.close()
                    raise
                except Exception as e:  # an offer this client cannot use as sent: the next one, never a crash
                    reasons.append(f"{offer.name}: malformed offer ({type(e).__name__}: {e})")
                if made is not None:
                    made.close()  # idempotent: freed already unless it failed before taking it over
        finally:
            for made in prepared.values():  # never handed to a transport
                made.close()
        if self._transport is None:
            if skipped:
                reasons.append(f"{skipped} offer(s) of transports not asked for, skipped")
            raise ConnectError(f"no usable transport to {self.address} ({'; '.join(reasons) or 'none offered'})")
        log.debug("session %s with %s uses %s", self.session.id.hex()[:12], self.address, self._transport.name)

    def _start_keepalive(self) -> None:
        """Starts the KeepAlive stream and returns once the server has bound it to the session.

        Before the server's first answer only the lease would reclaim the session if this process
        died, so nothing else happens until then.
        """
        interval = max(min(self.session.lease_seconds / 3.0, self.options.keepalive_interval), 0.02)
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
                    self.last_heard = time.monotonic()
                    answered.set()
                    bound.set()
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    self.error = rpc_error(self.address, e)
                    if answered.is_set():
                        self._metrics.session_losses.inc()
                        log.warning("tableserver session with %s lost: %s", self.address, self.error)
                        if self._on_lost is not None:
                            self._on_lost(self, self.error)
            finally:
                bound.set()  # wakes the constructor when the stream ends before its first answer

        self._keepalive_thread = threading.Thread(target=run, name="tableclient-keepalive", daemon=True)
        self._keepalive_thread.start()
        if not bound.wait(self._left()):
            raise ConnectError(
                f"tableserver at {self.address} did not answer the session keepalive within "
                f"{self.options.connect_timeout:g} s: raise connect_timeout or check the server"
            )
        if not answered.is_set():
            raise self.error or ConnectError(
                f"tableserver at {self.address} ended the session keepalive before answering it"
            )

    # --------------------------------------------------------------- public
    @property
    def transport(self) -> str:
        """Name of the data transport in use (shm, tcp, ...)."""
        return self._transport.name if self._transport is not None else ""

    @property
    def data(self):
        """The data transport (raises once the session is closed)."""
        if self._transport is None:
            raise TableClientError(f"session with {self.address} is closed")
        return self._transport

    @property
    def data_or_none(self):
        """The data transport, or None once the session is closed (never raises: for the per-gather path;
        read it once and keep the reference, a close may clear it meanwhile)."""
        return self._transport

    def open_data_socket(self, timeout: float) -> tuple[socket.socket, bool]:
        """A data connection of its own to this session's tcp endpoint, authenticated (HELLO) within
        ``timeout`` seconds, for a reader that speaks the wire protocol itself (a GraphStep's native
        poller): the socket and whether its payloads are sealed. ConnectError where the server offered
        no tcp (ask for it: the client's transport ``auto`` or ``tcp``)."""
        from tableclient.transports.tcp import TcpTransport

        offer = self._offers.get("tcp")
        if offer is None or self.session is None or self.closed:
            raise ConnectError(f"tableserver at {self.address} offered this session no tcp data connection")
        return TcpTransport(offer, self.session, self.infos, timeout, self.options.transport_options).detach()

    def open_qp_session(self, qp: QpInfo, device: str, max_rd_atomic: int, timeout: float) -> QpSession:
        """A session of its own with this node offering one RC QP (in INIT) and asking for rdma alone, for a
        reader that drives that QP itself (a GraphStep's native poller, client/tableclient/graph/poller/_native_c/verbs.c), opened
        within ``timeout`` seconds: the server connects a QP of its own to it and answers with the regions its
        rkeys read (:class:`QpSession`).

        It is this session's daemon's or none: opened on behalf of this session (the server refuses it unless
        it holds this session), its catalog this session's (every table's checksum, rows and row size, and
        where the node holds it), its server this session's node and start (``node_id``, ``instance_id``) in
        both the catalog and the open's answer. So where one address reaches several daemons (a Service VIP in
        a rolling update) a reader never READs another daemon's rows. ConnectError (one line) where it is not
        this daemon's, where this session is closed or lost, or where the server offers no rdma."""
        if self.session is None or self.closed:
            raise ConnectError(f"session with {self.address} is closed")
        if self.error is not None:
            raise ConnectError(f"session with {self.address} is lost ({self.error}): no QP session on its behalf")
        if "rdma" not in self.server.transports:
            raise ConnectError(f"tableserver at {self.address} offers no rdma")
        deadline = time.monotonic() + timeout
        return QpSession(self.address, self.options, qp, device, max_rd_atomic, owner=self, deadline=deadline)

    @property
    def node_id(self) -> str:
        return self.server.node_id or self.address

    @property
    def max_rows_per_request(self) -> int:
        return self.session.max_rows_per_request or 65536

    def silent_for(self) -> float:
        """Seconds since the server last answered a keepalive ping."""
        return time.monotonic() - self.last_heard

    def close(self, graceful: bool = True) -> None:
        """Ends the session and frees everything (an shm mapping included). Idempotent.

        ``graceful=False`` (a server found dead or frozen) skips telling it: its lease reclaims the rest.
        """
        if self.closed:
            return
        self.closed = True
        if self._counted:
            self._metrics.sessions.labels(self._counted).dec()
            self._counted = ""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if graceful and self.session is not None and self.error is None:
            try:
                self._stub.CloseSession(
                    pb.CloseSessionRequest(session_id=self.session.id),
                    timeout=min(2.0, self.options.connect_timeout),
                    metadata=self._metadata,
                )
            except grpc.RpcError:
                pass  # the server may be gone; the lease reclaims the session
        self._stop.set()  # after CloseSession, so the server logs why the session ended
        if self._keepalive_call is not None:
            self._keepalive_call.cancel()
        if self._keepalive_thread is not None and self._keepalive_thread is not threading.current_thread():
            self._keepalive_thread.join(timeout=2.0)
        self._channel.close()

    def __repr__(self) -> str:
        return f"NodeSession({self.address!r}, node={self.node_id!r}, transport={self.transport!r})"


def catalog_difference(mine: list[TableInfo], theirs: list[TableInfo]) -> str | None:
    """How the catalog ``theirs`` differs from ``mine`` (a session's, admitted through the client's pins), in a
    few words; None when it is the same: every table's identity (checksum, total rows, row size, as the pins
    hold it) first, then every other field (where the node holds it: index, rows, row_lo, tier; and the rest)."""
    by_name = {t.name: t for t in theirs}
    for t in mine:
        o = by_name.get(t.name)
        if o is None:
            return f"table {t.name!r} is not served there"
        if (o.checksum, o.total_rows, o.row_bytes) != (t.checksum, t.total_rows, t.row_bytes):
            return (
                f"table {t.name!r} there is {o.checksum} ({o.total_rows} rows of {o.row_bytes} B), the session's "
                f"{t.checksum} ({t.total_rows} rows of {t.row_bytes} B)"
            )
        changed = [f.name for f in dataclasses.fields(t) if getattr(o, f.name) != getattr(t, f.name)]
        if changed:
            return f"table {t.name!r} there has " + ", ".join(
                f"{name} {getattr(o, name)!r} (the session's {getattr(t, name)!r})" for name in changed
            )
    if len(theirs) != len(mine):
        return f"{len(theirs)} tables there, the session's {len(mine)}"
    return None


def daemon_difference(mine, theirs) -> str | None:
    """How the daemon ``theirs`` (a ServerInfo) is not ``mine`` (a session's), in a few words; None when it is
    that daemon: the same node (``node_id``, ``host_id``) and the same start of it (``instance_id``, which a
    daemon of this version always names)."""
    if not mine.instance_id:
        return f"node {mine.node_id!r} names no instance (tableserver {mine.version or '?'}, older than this client)"
    if theirs.node_id != mine.node_id:
        return f"node {theirs.node_id!r} there, the session's {mine.node_id!r}"
    if theirs.host_id != mine.host_id:
        return f"node {mine.node_id!r} there runs on host {theirs.host_id!r}, the session's on {mine.host_id!r}"
    if theirs.instance_id != mine.instance_id:
        return (
            f"node {mine.node_id!r} there is another start of it (instance {theirs.instance_id or 'none'!r}, "
            f"the session's {mine.instance_id!r})"
        )
    return None


class QpSession(NodeSession):
    """A session with one node whose data path is one RC QP its owner drives (a GraphStep's native poller over
    rdma: :meth:`NodeSession.open_qp_session`): opened offering ``qp`` and asking for rdma alone, on behalf of
    the session ``owner`` and admitted only as that session's daemon's (its catalog, node and start; the server
    holds ``owner``), kept alive by a keepalive stream of its own like any session; ``peer`` is the server's QP
    (in RTS), ``rd_atomic`` the READs it takes in flight, :meth:`regions` where a table's rows are and the rkeys
    this QP reads them with. Closing it ends the session: the server destroys its QP and, with per-session
    memory windows, its rkeys. It has no transport and is counted in no session metric."""

    def __init__(self, address: str, options: NodeOptions, qp: QpInfo, device: str, max_rd_atomic: int, *,
                 owner: NodeSession, deadline: float | None = None):  # fmt: skip
        self._qp, self._device, self._max_rd_atomic = qp, device, max_rd_atomic
        if owner.session is None:
            raise ConnectError(f"session with {address} is closed")
        self._owner_server, self._owner_infos, self._owner_session = owner.server, owner.infos, owner.session
        self._endpoint = None
        super().__init__(address, options, deadline=deadline)

    def _refuse(self, why: str) -> ConnectError:
        """The one-line error of a QP session that reached a daemon other than its owner's."""
        return ConnectError(
            f"tableserver at {self.address}: the graph poller's QP session reached another daemon than its "
            f"session's ({why}), so nothing is read through it: that address leads to several daemons (a Service "
            "VIP, e.g. in a rolling update); give the client each node's own address (a headless Service)"
        )

    def _connect(self, transport: str, client_name: str) -> None:
        why = catalog_difference(self._owner_infos, self.infos) or daemon_difference(self._owner_server, self.server)
        if why:
            raise self._refuse(why)
        q, owner = self._qp, self._owner_session
        resp = self._call(
            self._stub.OpenSession,
            pb.OpenSessionRequest(
                client_name=f"{client_name or 'tableclient/' + os.path.basename(sys.argv[0] or 'python')} (graph poller)",
                hostname=socket.gethostname(),
                host_id=local_host_id(),
                pid=os.getpid(),
                transports=["rdma"],
                owner_session_id=owner.id,
                owner_proof=owner_proof(owner.secret, owner.id),
                rdma=pb.RdmaClientParams(
                    qps=[pb.RdmaQueuePair(qp_num=q.qp_num, psn=q.psn, gid=q.gid, mtu=q.mtu)],
                    device=self._device,
                    max_rd_atomic=self._max_rd_atomic,
                ),
            ),
        )
        self.session = _session_info(self.address, resp)
        # the daemon that opened it, whichever connection this call took (the catalog's may have been another's)
        why = (
            daemon_difference(self._owner_server, resp.server)
            if resp.HasField("server")
            else "the server that opened it does not name itself (a tableserver older than this client)"
        )
        if why:
            self._end_opened()
            raise self._refuse(why)
        self._start_keepalive()
        offer = next((o for o in resp.offers[:MAX_OFFERS] if o.name == "rdma" and o.HasField("rdma")), None)
        if offer is None or len(offer.rdma.qps) != 1:
            raise ConnectError(
                f"tableserver at {self.address} answered the graph poller's QP with "
                f"{len(offer.rdma.qps) if offer is not None else 'no'} QPs of its own (one expected)"
            )
        self._endpoint = offer.rdma

    def _end_opened(self) -> None:
        """Ends the session just opened on a daemon it is refused for (best effort: else its lease does)."""
        try:
            self._stub.CloseSession(
                pb.CloseSessionRequest(session_id=self.session.id),
                timeout=max(min(2.0, self._deadline - time.monotonic()), 0.001),
                metadata=self._metadata,
            )
        except grpc.RpcError:
            pass

    @property
    def peer(self) -> QpInfo:
        """The server's QP connected to ours."""
        q = self._endpoint.qps[0]
        return QpInfo(q.qp_num, q.psn, q.gid, q.mtu)

    @property
    def rd_atomic(self) -> int:
        """RDMA READs the server takes in flight on its QP."""
        return max(self._endpoint.max_rd_atomic, 1)

    def regions(self, table_index: int) -> list[tuple[int, int, int, int]]:
        """``(table_offset, addr, rkey, length)`` of table ``table_index``'s regions, by offset: the rkey this
        session's QP reads each with (its own memory window's, or the region's shared one). Empty for a table
        the server serves packed only (a disk table)."""
        return sorted(
            (r.table_offset, r.addr, r.qp_rkeys[0] if r.qp_rkeys else r.rkey, r.length)
            for r in self._endpoint.regions
            if r.table == table_index
        )
