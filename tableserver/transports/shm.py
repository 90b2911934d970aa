"""shm transport: same-host clients map the pinned tables read-only and gather locally.

The server listens on a Unix ``SOCK_SEQPACKET`` socket. A client sends a HELLO
frame with its session id and secret; the server answers with one message:
an OK header, a JSON list of the tables (index, name, rows, row_bytes, size)
and, as ``SCM_RIGHTS``, one **read-only** file descriptor per table (a fresh
``O_RDONLY`` open of each table's sealed memfd). The client maps them
``PROT_READ`` and gathers with numpy: zero copies through the server, and one
copy of the tables in memory serves every process on the node.

Lifetime: the connection stays open for the session; the server closes it
when the session ends. A mapping the client already holds cannot be revoked
(that is the nature of shared memory), so shm is offered only to
authenticated sessions on the same host; seals forbid writable mappings.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading

from tableserver.errors import ListenError
from tableserver.logs import RateLimitedLog
from tableserver.sessions import Session
from tableserver.transports.base import ServerTransport
from tableserver.transports.tcp import _shutdown
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.wire import (
    HEADER, HEADER_BYTES, HELLO_BYTES, REQUEST_MAGIC, SESSION_ID_BYTES, FrameType, Status, response_header,
)

log = logging.getLogger("tableserver.shm")


def host_id() -> str:
    """This kernel's boot id: equal on every process of one host (and its containers)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def default_socket_path(port: int) -> str:
    for d in (os.environ.get("XDG_RUNTIME_DIR"), "/run/tableserver", "/tmp"):
        if not d:
            continue
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return os.path.join(d, f"tableserver-{port}.sock")
    return f"/tmp/tableserver-{port}.sock"


class ShmTransport(ServerTransport):
    name = "shm"

    def __init__(self, sessions, options):
        super().__init__(sessions, options)
        self.path = options.get("shm_socket") or ""
        self.host_id = host_id()
        self._sock: socket.socket | None = None
        self._conns: dict[socket.socket, Session | None] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._ratelog = RateLimitedLog(log)

    def bind(self) -> None:
        if not self.path:
            self.path = default_socket_path(self.options["control_port"])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            _remove_stale(self.path)
            sock.bind(self.path)
            os.chmod(self.path, 0o666)  # any local user may connect; the session secret admits them
            sock.listen(256)
        except OSError as e:
            sock.close()
            raise ListenError(f"cannot listen on shm socket {self.path} ({e.strerror}): pass --shm-socket PATH "
                              "in a writable directory", errno=e.errno) from None
        self._sock = sock

    def start(self, tables) -> None:
        self.tables = tables
        t = threading.Thread(target=self._accept_loop, name="tableserver-shm-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def describe(self) -> str:
        return f"shm {self.path}"

    def offer(self, session, request):
        return pb.TransportOffer(name="shm", shm=pb.ShmEndpoint(socket_path=self.path, host_id=self.host_id))

    def release(self, session: Session) -> None:
        with self._lock:
            conns = [c for c, s in self._conns.items() if s is session]
        for c in conns:
            _shutdown(c)

    def active_sessions(self) -> int:
        with self._lock:
            return len({id(s) for s in self._conns.values() if s is not None})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            _shutdown(self._sock)
            self._sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shutdown(c)
        for t in self._threads:
            t.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                self._conns[conn] = None
            t = threading.Thread(target=self._serve, args=(conn,), name="tableserver-shm-conn", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid = _peer_pid(conn)
            msg = conn.recv(HEADER_BYTES + HELLO_BYTES + 1)
            if len(msg) != HEADER_BYTES + HELLO_BYTES:
                return self._refuse(conn, 0, Status.BAD_FRAME, "expected one HELLO frame")
            magic, ftype, _f, req_id, _t, count = HEADER.unpack_from(msg)
            if magic != REQUEST_MAGIC or ftype != FrameType.HELLO or count != HELLO_BYTES:
                return self._refuse(conn, req_id, Status.BAD_FRAME, "expected one HELLO frame")
            payload = msg[HEADER_BYTES:]
            session = self.sessions.authenticate(payload[:SESSION_ID_BYTES], payload[SESSION_ID_BYTES:])
            if session is None or "shm" not in session.transports:
                return self._refuse(conn, req_id, Status.UNAUTHENTICATED,
                                    "unknown session, wrong secret, or shm not granted: open a session over gRPC")
            with self._lock:
                self._conns[conn] = session
            self._send_tables(conn, req_id)
            log.info("shm: session %s mapped %d tables (pid %s)", session.label, len(self.tables), pid)
            while conn.recv(64):  # hold the connection until the client or the session ends it
                pass
        except OSError as e:
            if not self._closed:
                log.info("shm: connection ended (%s)", e)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _send_tables(self, conn: socket.socket, req_id: int) -> None:
        doc = [{"index": t.index, "name": t.name, "rows": t.rows, "row_bytes": t.row_bytes,
                "size": t.region.size} for t in self.tables]
        body = json.dumps(doc).encode()
        fds = []
        try:
            for t in self.tables:
                fds.append(t.region.readonly_fd())
            socket.send_fds(conn, [response_header(FrameType.HELLO, Status.OK, req_id, 0, len(body)) + body], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _refuse(self, conn: socket.socket, req_id: int, status: Status, message: str) -> None:
        body = message.encode()
        self.metrics.refused(status)
        self._ratelog.warning(status.name, "shm: refused a connection: %s", message)
        try:
            conn.send(response_header(FrameType.HELLO, status, req_id, 0, len(body)) + body)
        except OSError:
            pass


def _peer_pid(conn: socket.socket) -> int:
    import struct

    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except OSError:
        return 0


def _remove_stale(path: str) -> None:
    """Removes a socket file left by a dead server; refuses to steal a live one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(17, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: stale
        return
    finally:
        probe.close()
    raise OSError(98, "another tableserver is listening on it")
