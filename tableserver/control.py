"""The gRPC control plane: catalog, sessions, liveness, health.

Runs on grpc.aio so that each client's long-lived KeepAlive stream costs no
thread. Health (``grpc.health.v1``) reports NOT_SERVING until every table is
pinned and every transport is serving, SERVING after, and NOT_SERVING again
from the moment a graceful shutdown begins. gRPC never carries row data.

What one client network may ask is bounded: clients are grouped by network
prefix (:func:`peer_key`: /24 for IPv4, /64 for IPv6 by default, IPv4-mapped
IPv6 as IPv4, every Unix-socket peer as one), and each prefix has its own
session cap, session-open token bucket and GetCatalog token bucket, so many
source addresses of one network cannot take what an honest client needs. The
catalog is built once, when the tables are in (it never changes after).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
import time
import urllib.parse

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from tableserver import __version__
from tableserver.errors import ListenError
from tableserver.sessions import SessionRegistry
from tableserver.transports import KNOWN
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "tableserver.v1.TableService"
#: what one peer may ask of the control plane: bounded so no request costs more than a few microseconds
#: of the event loop or a few kilobytes of reply
MAX_MESSAGE_BYTES = 1 << 20
MAX_TRANSPORTS = 8
MAX_NAME_BYTES = 256


def _peer_host(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` / ``unix:...`` -> the host part (for a unix peer: its kind)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]")
    return kind


def peer_key(peer: str, prefix_v4: int = 24, prefix_v6: int = 64) -> str:
    """The client network a gRPC peer address belongs to, the key of every per-peer limit:
    ``ipv4:10.1.2.3:5678`` -> ``10.1.2.0/24``, ``ipv6:[2001:db8::5]:80`` -> ``2001:db8::/64``,
    ``ipv6:[::ffff:10.1.2.3]:80`` -> ``10.1.2.0/24``; every ``unix:`` peer -> ``unix``."""
    return _prefix(_peer_host(peer), prefix_v4, prefix_v6)


@functools.lru_cache(maxsize=4096)
def _prefix(host: str, prefix_v4: int, prefix_v6: int) -> str:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is not part of the net
    except ValueError:
        return host  # unix, unix-abstract, ...: one key per kind
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = prefix_v4 if ip.version == 4 else prefix_v6
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class OpenRate:
    """Token bucket per client network (a :func:`peer_key`): calls per second, with a burst."""

    def __init__(self, per_second: float, burst: int, max_peers: int = 65536):
        self.rate, self.burst, self.max_peers = per_second, burst, max_peers
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, peer: str, now: float | None = None) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if len(self._buckets) >= self.max_peers and peer not in self._buckets:
            self._buckets.clear()  # bounded: forget everyone rather than grow without end
        if tokens < 1.0:
            self._buckets[peer] = (tokens, now)
            return False
        self._buckets[peer] = (tokens - 1.0, now)
        return True


class ServerState:
    """What the control plane answers from; filled in as the server starts."""

    def __init__(
        self,
        sessions: SessionRegistry,
        transports: dict,
        max_rows: int,
        host_id: str,
        metrics=None,
        node_id: str = "",
        open_rate: OpenRate | None = None,
        max_sessions: int = 4096,
        max_sessions_per_peer: int = 512,
        catalog_rate: OpenRate | None = None,
        peer_prefixes: tuple[int, int] = (24, 64),
    ):
        self.sessions = sessions
        self.metrics = metrics
        self.transports = transports  # name -> ServerTransport, in server preference order
        self.tables = None  # TableSet once loaded
        self.max_rows = max_rows
        self.host_id = host_id
        self.node_id = node_id or socket.gethostname()
        #: this daemon's start (ServerInfo.instance_id): random, new every time the daemon starts
        self.instance_id = os.urandom(8).hex()
        self.open_rate = open_rate or OpenRate(20.0, 100)
        self.catalog_rate = catalog_rate or OpenRate(50.0, 200)
        self.max_sessions, self.max_sessions_per_peer = max_sessions, max_sessions_per_peer
        self.peer_prefixes = peer_prefixes
        self.ready = False
        self.unready_reason = "tables are still loading"
        self._catalog: pb.Catalog | None = None

    def peer_key(self, peer: str) -> str:
        return peer_key(peer, *self.peer_prefixes)

    def server_info(self) -> pb.ServerInfo:
        return pb.ServerInfo(
            version=__version__,
            hostname=socket.gethostname(),
            host_id=self.host_id,
            transports=list(self.transports),
            max_rows_per_request=self.max_rows,
            node_id=self.node_id,
            instance_id=self.instance_id,
        )

    def catalog(self) -> pb.Catalog:
        """The catalog reply, built on first use: the tables and transports are fixed once serving."""
        if self._catalog is None:
            self._catalog = self._build_catalog()
        return self._catalog

    def _build_catalog(self) -> pb.Catalog:
        tables = [
            pb.TableInfo(
                index=t.index,
                name=t.name,
                rows=t.rows,
                row_bytes=t.row_bytes,
                dtype=t.spec.dtype,
                shape=list(t.spec.logical_shape),
                layer=t.spec.layer,
                version=t.spec.version,
                checksum=t.checksum,
                nbytes=t.nbytes,
                total_rows=t.total_rows,
                row_lo=t.row_lo,
                tier=t.tier,
            )
            for t in self.tables
        ]
        return pb.Catalog(tables=tables, server=self.server_info())


class TableService(pb_grpc.TableServiceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    async def _require_ready(self, context) -> None:
        if not self.state.ready:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.state.unready_reason}: retry when health reports SERVING"
            )

    async def _exhausted(self, context, reason: str, message: str) -> None:
        """Refuses the call with RESOURCE_EXHAUSTED (counted under ``reason``)."""
        if self.state.metrics is not None:
            self.state.metrics.error(reason)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def _rate_limit(self, context, limiter, peer, what: str, fix: str = "") -> None:
        """Refuses the call (RESOURCE_EXHAUSTED, rate_limited) when ``peer`` is over ``limiter``'s rate."""
        if not limiter.allow(peer):
            await self._exhausted(
                context,
                "rate_limited",
                f"too many {what} from {peer}: at most {limiter.rate:g}/s "
                f"per network prefix (burst {limiter.burst}); retry later{fix}",
            )

    async def GetCatalog(self, request, context):
        await self._require_ready(context)
        state = self.state
        peer = state.peer_key(context.peer())
        await self._rate_limit(context, state.catalog_rate, peer, "catalog requests", ", or raise --catalog-rate")
        return state.catalog()

    async def OpenSession(self, request, context):
        await self._require_ready(context)
        state = self.state
        if len(request.transports) > MAX_TRANSPORTS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(request.transports)} transports requested: at most {MAX_TRANSPORTS}",
            )
        if len(request.client_name.encode()) > MAX_NAME_BYTES or len(request.hostname.encode()) > MAX_NAME_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"client_name and hostname are limited to {MAX_NAME_BYTES} bytes"
            )
        owner = b""
        if request.owner_session_id or request.owner_proof:
            held = state.sessions.owner(request.owner_session_id, request.owner_proof)
            if held is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session {request.owner_session_id.hex()[:12]} this session is opened on behalf of is not "
                    f"held by this daemon (node {state.node_id}, instance {state.instance_id}): another daemon "
                    "behind the same address holds it (a shared address such as a Service VIP); open the "
                    "session where that one is, or open a session of its own",
                )
            owner = held.id
        peer = state.peer_key(context.peer())
        await self._rate_limit(context, state.open_rate, peer, "sessions opened")
        if len(state.sessions) >= state.max_sessions:
            await self._exhausted(
                context,
                "too_many_sessions",
                f"session limit reached ({state.max_sessions} open in all): close idle clients or raise --max-sessions",
            )
        if state.sessions.count(peer) >= state.max_sessions_per_peer:
            await self._exhausted(
                context,
                "too_many_sessions",
                f"session limit reached for {peer} ({state.max_sessions_per_peer} open from that "
                "network prefix): close idle clients, or raise --max-sessions-per-peer (or "
                "--peer-prefix-v4/-v6)",
            )
        wanted = list(dict.fromkeys(request.transports)) or list(state.transports)
        unknown = [t for t in wanted if t not in KNOWN and t != "rdma"]
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unknown transport {unknown[0]!r}: use {', '.join(KNOWN)}"
            )
        granted = [t for t in wanted if t in state.transports]
        if not granted:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"none of the requested transports ({', '.join(wanted)}) is enabled on this "
                f"server (enabled: {', '.join(state.transports)})",
            )
        session = state.sessions.open(
            client_name=request.client_name,
            hostname=request.hostname,
            pid=request.pid,
            peer=context.peer(),
            peer_key=peer,
            transports=tuple(granted),
            owner=owner,
        )
        if state.metrics is not None:
            state.metrics.sessions_opened.inc()
        try:
            offers = [o for o in (state.transports[t].offer(session, request) for t in granted) if o is not None]
        except Exception as e:
            state.sessions.close(session.id, f"transport setup failed: {e}")
            log.exception("OpenSession: transport setup failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"transport setup failed: {e}")
        return pb.OpenSessionResponse(
            session_id=session.id,
            secret=session.secret,
            lease_seconds=state.sessions.lease_seconds,
            offers=offers,
            max_rows_per_request=state.max_rows,
            server=state.catalog().server,
        )

    async def KeepAlive(self, request_iterator, context):
        sessions = self.state.sessions
        session_id = None
        try:
            async for req in request_iterator:
                session_id = session_id or req.session_id
                # the first renew binds the session to this stream (no bind deadline any more)
                if req.session_id != session_id or not sessions.renew(session_id):
                    await context.abort(grpc.StatusCode.NOT_FOUND, "session expired or closed: open a new session")
                yield pb.KeepAliveResponse(lease_seconds=sessions.lease_seconds)
        finally:
            # The stream is the session's liveness: when it ends (client exit,
            # crash, network loss), the session and its resources go with it.
            if session_id is not None:
                sessions.close(session_id, "keepalive stream ended")

    async def CloseSession(self, request, context):
        self.state.sessions.close(request.session_id, "closed by client")
        return pb.CloseSessionResponse()


async def start_control_plane(
    state: ServerState, host: str, port: int, *, credentials=None, interceptors=()
) -> tuple[grpc.aio.Server, HealthServicer, int]:
    """Binds and starts the gRPC server (health NOT_SERVING). Returns (server, health, port)."""
    options = [
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    server = grpc.aio.server(interceptors=list(interceptors), options=options)
    pb_grpc.add_TableServiceServicer_to_server(TableService(state), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        bound = 0
        detail = str(e)
    else:
        detail = ""
    if not bound:
        in_use = _port_in_use(host, port)
        reason = (
            "is already in use: stop the other server or pass --listen HOST:PORT (port 0 picks a free port)"
            if in_use
            else f"cannot be bound ({detail or 'bad address'}): fix --listen"
        )
        raise ListenError(f"control port {host}:{port} {reason}", errno=98 if in_use else None)
    await server.start()
    return server, health, bound


async def set_serving(health: HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("", status)
    await health.set(SERVICE_NAME, status)


def _port_in_use(host: str, port: int) -> bool:
    if port == 0:
        return False
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError as e:
        return e.errno == 98
    return False


def is_loopback(host: str) -> bool:
    """True when ``host`` names a loopback address (only local clients can reach it)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False
