"""shm transport: same-host clients map the pinned tables read-only and gather locally.

The server listens on a Unix ``SOCK_SEQPACKET`` socket (mode 0660, group from
``--shm-group``) served by the shared connection layer (connections.py: no
thread per connection, handshake deadline, caps). Its first message on a
connection is a CHALLENGE; the client answers with a HELLO that proves it
holds its session secret (tableserver/common/wire.py); the server answers with one
message: an OK header, a JSON object with the table list (index, name, rows,
row_bytes, size) and the server's proof, and, as ``SCM_RIGHTS``, one
**read-only** file descriptor per table (a fresh ``O_RDONLY`` open of each
table's memfd). The client maps them ``PROT_READ`` and gathers with numpy:
zero copies through the server, and one copy of the tables in memory serves
every process on the node.

Read-only by construction: each memfd has mode 0400 (no process but root can
reopen it writable through ``/proc/PID/fd``) and carries
``F_SEAL_FUTURE_WRITE`` (not even root can map it writable or write to it);
both are verified when the transport starts.

Disk tables (``--disk-tables``) have no memory to map: the table list marks
them ``"tier": "disk"`` with no descriptor, and the endpoint names a second
Unix socket, a stream one (``rows_socket_path``), where tcp's protocol answers
their gathers (transports/tcp.py ``UnixRowsPort``): the rows cross one socket
copy on the host, no network stack, beside a read from the drive that costs
far more.

Lifetime: the connection stays open for the session; the server closes it
when the session ends. A mapping the client already holds cannot be revoked
(that is the nature of shared memory), so shm is offered only to
authenticated sessions on the same host.
"""

from __future__ import annotations

import fcntl
import functools
import grp
import json
import logging
import os
import socket
import tempfile

from tableserver.common.host import host_id
from tableserver.common.wire import (
    HEADER,
    HEADER_BYTES,
    HELLO_BYTES,
    NONCE_BYTES,
    REQUEST_MAGIC,
    FrameType,
    Refused,
    Status,
    challenge_frame,
    response_header,
)
from tableserver.errors import ConfigError, TableServerError
from tableserver.logs import RateLimitedLog
from tableserver.tables.memory import F_SEAL_FUTURE_WRITE
from tableserver.transports.base import ServerTransport
from tableserver.transports.connections import CLOSE, READ, Connection, ConnectionLoop, Protocol, bind_unix
from tableserver.transports.limits import connection_limits
from tableserver.transports.tcp import UnixRowsPort
from tableserver.v1 import tableserver_pb2 as pb

log = logging.getLogger(__name__)

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE


@functools.lru_cache(maxsize=1)
def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR or /run/tableserver when writable; else a fresh directory with an unpredictable
    name (so no other local user can plant a socket or a file at the path first)."""
    for d in (os.environ.get("XDG_RUNTIME_DIR"), "/run/tableserver"):
        if not d:
            continue
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    d = tempfile.mkdtemp(prefix="tableserver-")
    os.chmod(d, 0o711)  # others may reach the socket (its own mode decides), not list the directory
    return d


def default_socket_path(port: int) -> str:
    return os.path.join(runtime_dir(), f"tableserver-{port}.sock")


def check_read_only(region) -> None:
    """TableServerError unless the table memfd can only ever be mapped read-only (mode 0400 + seals)."""
    mode = os.fstat(region.fd).st_mode & 0o777
    if mode & 0o377:
        raise TableServerError(
            f"table memory {region.name!r} has mode {mode:o}, expected 0400: shm clients could "
            "reopen it writable; this is a bug, report it"
        )
    seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise TableServerError(
            f"the kernel did not seal table memory {region.name!r} against writes "
            f"(seals {seals:#x}, F_SEAL_FUTURE_WRITE needs Linux >= 5.1): shm clients could write "
            "to it; serve without shm (--transports tcp or rdma) or upgrade the kernel"
        )


class ShmTransport(ServerTransport):
    name = "shm"

    def __init__(self, sessions, options):
        super().__init__(sessions, options)
        self.path = options.get("shm_socket") or ""
        self.group = options.get("shm_group") or ""
        self.host_id = host_id()
        self.limits = connection_limits(options)
        self._sock: socket.socket | None = None
        self._loop: ConnectionLoop | None = None
        self._closed = False
        self.rows_port: UnixRowsPort | None = None  # gathers of disk tables, when there are any
        self._gid = -1
        if self.group:
            try:
                self._gid = int(self.group) if self.group.isdigit() else grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise ConfigError(
                    f"--shm-group {self.group!r}: no such group: name an existing group "
                    "(its members may use the shm transport)"
                ) from None

    def bind(self) -> None:
        if not self.path:
            self.path = default_socket_path(self.options["control_port"])
        sock = bind_unix(self.path, socket.SOCK_SEQPACKET, self._gid, "shm socket")
        self._sock = sock
        if self.options.get("disk_tables") or self.options.get("disk_stripes"):
            base = self.path[:-5] if self.path.endswith(".sock") else self.path
            self.rows_port = UnixRowsPort(self.sessions, self.options, base + ".rows.sock", self._gid)
            self.rows_port.bind()

    def start(self, tables) -> None:
        self.tables = tables
        for t in tables.memory:
            check_read_only(t.region)
        if self.rows_port is not None:
            if any(t.disk is not None for t in tables):
                self.rows_port.start(tables)
            else:
                self.rows_port.close()
                self.rows_port = None
        self._loop = ConnectionLoop("shm", self._sock, _ShmProtocol(self), self.limits, 2, self.metrics)
        self._loop.start()

    def describe(self) -> str:
        return f"shm {self.path}"

    def offer(self, session, request):
        rows = self.rows_port.path if self.rows_port is not None else ""
        return pb.TransportOffer(
            name="shm", shm=pb.ShmEndpoint(socket_path=self.path, host_id=self.host_id, rows_socket_path=rows)
        )

    def release(self, session) -> None:
        if self._loop is not None:
            self._loop.release(session)
        if self.rows_port is not None:
            self.rows_port.release(session)

    def attach(self, conn: Connection, session) -> None:
        """Binds a connection whose HELLO proved ``session`` to it (its protocol calls this)."""
        self._loop.attach(conn, session)

    def active_sessions(self) -> int:
        return self._loop.active_sessions() if self._loop is not None else 0

    def connections(self) -> int:
        rows = self.rows_port.connections() if self.rows_port is not None else 0
        return (self._loop.connections() if self._loop is not None else 0) + rows

    def health(self) -> tuple[bool, str]:
        if self.rows_port is not None:
            ok, why = self.rows_port.health()
            if not ok:
                return ok, why
        return self._loop.health() if self._loop is not None else (True, "")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.rows_port is not None:
            self.rows_port.close()
        if self._loop is not None:
            self._loop.close()
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def tables_message(self, req_id: int, proof: bytes) -> tuple[bytes, list[int]]:
        doc = {
            "tables": [
                {"index": t.index, "name": t.name, "rows": t.rows, "row_bytes": t.row_bytes, "size": t.region.size}
                if t.region is not None
                else {
                    "index": t.index,
                    "name": t.name,
                    "rows": t.rows,
                    "row_bytes": t.row_bytes,
                    "size": 0,
                    "tier": "disk",
                }
                for t in self.tables
            ],
            "proof": proof.hex(),
        }
        body = json.dumps(doc).encode()
        return response_header(FrameType.HELLO, Status.OK, req_id, 0, len(body)) + body, [
            t.region.readonly_fd() for t in self.tables.memory
        ]


class _ShmProtocol(Protocol):
    def __init__(self, transport: ShmTransport):
        self.t = transport
        self.ratelog = RateLimitedLog(log)

    def greeting(self, conn: Connection) -> bytes:
        conn.state = os.urandom(NONCE_BYTES)
        return challenge_frame(conn.state)

    def busy(self, message: str) -> bytes:
        return Refused(Status.BUSY, message).frame(FrameType.CHALLENGE)

    def ready(self, conn: Connection, events: int) -> str:
        sock = conn.sock
        if conn.session is not None:  # held for the session's life: drop whatever the peer sends
            for _ in range(16):
                try:
                    if not sock.recv(64):
                        return CLOSE
                except (BlockingIOError, InterruptedError):
                    return READ
            return READ
        try:
            msg = sock.recv(HEADER_BYTES + HELLO_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return READ
        if not msg:
            return CLOSE
        req_id = 0
        try:
            if len(msg) != HEADER_BYTES + HELLO_BYTES:
                raise Refused(Status.BAD_FRAME, "expected one HELLO frame (a client older than this server?)")
            magic, ftype, _f, req_id, _t, count = HEADER.unpack_from(msg)
            if magic != REQUEST_MAGIC or ftype != FrameType.HELLO or count != HELLO_BYTES:
                raise Refused(Status.BAD_FRAME, "expected one HELLO frame")
            session, proof = self.t.sessions.authenticate_hello(msg[HEADER_BYTES:], conn.state)
            if session is None or "shm" not in session.transports:
                raise Refused(
                    Status.UNAUTHENTICATED, "unknown session, wrong proof, or shm not granted: open a session over gRPC"
                )
            self.t.attach(conn, session)
        except Refused as e:
            self.t.metrics.refused(e.status)
            self.ratelog.warning(e.name, "shm: refused a connection: %s", e)
            try:
                sock.send(e.frame(FrameType.HELLO, req_id))
            except OSError:
                pass
            return CLOSE
        message, fds = self.t.tables_message(req_id, proof)
        try:
            socket.send_fds(sock, [message], fds)
        finally:
            for fd in fds:
                os.close(fd)
        log.info("shm: session %s mapped %d tables (pid %s)", session.label, len(self.t.tables.memory), _peer_pid(sock))
        return READ


def _peer_pid(conn: socket.socket) -> int:
    import struct

    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except OSError:
        return 0
