"""tcp transport: row gathers over a framed binary protocol (see tableserver/wire.py).

One thread per connection: read a request header and its int64 row ids
straight into a reusable numpy buffer, check every id against the table in one
vectorized pass, gather with ``np.take`` into a reusable output buffer and
send header + rows with one ``sendmsg``. No per-row Python. Requests on one
connection are answered in order, so a client may pipeline several.

Invariants: no byte outside a table is ever read (ids are range-checked, and
``np.take(mode="clip")`` could not read outside even if they were not); a
malformed or hostile connection is closed without affecting any other.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import numpy as np

from tableserver.errors import ListenError
from tableserver.logs import RateLimitedLog
from tableserver.sessions import Session
from tableserver.transports.base import ServerTransport
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.wire import (
    FATAL, HEADER, HEADER_BYTES, HELLO_BYTES, REQUEST_MAGIC, SESSION_ID_BYTES, FrameType, Status,
    recv_exact, response_header, send_all,
)

log = logging.getLogger("tableserver.tcp")


class RequestError(Exception):
    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port)."""
    from tableserver.errors import ConfigError

    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ConfigError(f"{what} {value!r}: expected HOST:PORT, e.g. 127.0.0.1:7070")
    return host.strip("[]"), int(port)


def bind_listener(host: str, port: int, what: str, flag: str) -> socket.socket:
    """A listening TCP socket; ListenError naming the flag when it cannot bind."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"{what} address {host}:{port} does not resolve ({e.strerror}): fix {flag}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(256)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ListenError(f"{what} port {host}:{port} is already in use: stop the other server or pass "
                              f"{flag} HOST:PORT (port 0 picks a free port)", errno=e.errno) from None
        raise ListenError(f"cannot listen on {host}:{port} for {what} ({e.strerror}): fix {flag}",
                          errno=e.errno) from None
    return sock


class TcpTransport(ServerTransport):
    name = "tcp"

    def __init__(self, sessions, options):
        super().__init__(sessions, options)
        self.host, self.port = options["tcp_listen"]
        self.advertise_host = options.get("tcp_advertise") or self.host
        self.max_rows = int(options["max_rows_per_request"])
        self._sock: socket.socket | None = None
        self._conns: dict[socket.socket, Session | None] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._ratelog = RateLimitedLog(log)
        self._inst: dict[int, tuple] = {}

    # -- lifecycle
    def bind(self) -> None:
        self._sock = bind_listener(self.host, self.port, "tcp data", "--tcp-listen")
        self.port = self._sock.getsockname()[1]

    def start(self, tables) -> None:
        self.tables = tables
        for t in tables:  # series exist from 0, so rate() counts the first requests
            self._instruments(t.index)
        t = threading.Thread(target=self._accept_loop, name="tableserver-tcp-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def describe(self) -> str:
        return f"tcp {self.host}:{self.port}"

    def offer(self, session, request):
        host = self.advertise_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return pb.TransportOffer(name="tcp", tcp=pb.TcpEndpoint(host=host, port=self.port))

    def release(self, session: Session) -> None:
        with self._lock:
            conns = [c for c, s in self._conns.items() if s is session]
        for c in conns:
            _shutdown(c)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            _shutdown(self._sock)  # wakes the accept() blocked in another thread
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shutdown(c)
        for t in self._threads:
            t.join(timeout=5)

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def active_sessions(self) -> int:
        with self._lock:
            return len({id(s) for s in self._conns.values() if s is not None})

    # -- serving
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns[conn] = None
            t = threading.Thread(target=self._serve, args=(conn, addr), name="tableserver-tcp-conn", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        head = bytearray(HEADER_BYTES)
        buffers = _Buffers()
        session: Session | None = None
        try:
            while True:
                if not recv_exact(conn, memoryview(head)):
                    return  # clean EOF between frames
                magic, ftype, _flags, req_id, table_index, count = HEADER.unpack(head)
                try:
                    if magic != REQUEST_MAGIC:
                        raise RequestError(Status.BAD_FRAME, f"bad frame magic {magic!r}: not a tableserver client")
                    if ftype == FrameType.HELLO:
                        session = self._hello(conn, count)
                        with self._lock:
                            self._conns[conn] = session
                        send_all(conn, [response_header(ftype, Status.OK, req_id, 0, 0)])
                        continue
                    if session is None:
                        raise RequestError(Status.UNAUTHENTICATED, "send HELLO with the session secret first")
                    if session.closed:
                        raise RequestError(Status.SESSION_CLOSED, f"session ended: {session.close_reason}")
                    if ftype != FrameType.GATHER:
                        raise RequestError(Status.BAD_FRAME, f"unknown frame type {ftype}")
                    if count > self.max_rows:
                        raise RequestError(Status.TOO_MANY_ROWS, f"{count} row ids in one request, the limit is "
                                           f"{self.max_rows}: split the gather")
                    ids = buffers.ids(count)
                    recv_exact(conn, memoryview(ids).cast("B"))
                    start = time.perf_counter()
                    rows = self._gather(table_index, ids, buffers)
                    send_all(conn, [response_header(ftype, Status.OK, req_id, rows.shape[1], count), rows])
                    latency, nrows, nbytes = self._instruments(table_index)
                    latency.observe(time.perf_counter() - start)
                    nrows.inc(count)
                    nbytes.inc(rows.nbytes)
                except RequestError as e:
                    self.metrics.refused(e.status)
                    msg = str(e).encode()
                    self._ratelog.warning(f"{e.status.name}", "tcp %s: %s: %s", peer, e.status.name, e)
                    send_all(conn, [response_header(ftype, e.status, req_id, 0, len(msg)), msg])
                    if e.status in FATAL:
                        _lingering_close(conn)
                        return
        except (ConnectionError, OSError) as e:
            if not self._closed:
                self.metrics.error("disconnect")
                self._ratelog.info("disconnect", "tcp %s: connection ended mid-request (%s)", peer, e)
        except Exception:
            self.metrics.error("internal")
            log.exception("tcp %s: internal error; closing this connection", peer)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _instruments(self, table_index: int):
        """Per-table metric children, made once (labels() is too slow for every request)."""
        inst = self._inst.get(table_index)
        if inst is None:
            inst = self._inst[table_index] = self.metrics.gather_op("tcp", "gather", self.tables[table_index].name)
        return inst

    def _hello(self, conn: socket.socket, count: int) -> Session:
        if count != HELLO_BYTES:
            raise RequestError(Status.BAD_FRAME, f"HELLO carries {count} bytes, expected {HELLO_BYTES}")
        payload = bytearray(HELLO_BYTES)
        if not recv_exact(conn, memoryview(payload)):
            raise ConnectionResetError("closed during HELLO")
        session = self.sessions.authenticate(bytes(payload[:SESSION_ID_BYTES]), bytes(payload[SESSION_ID_BYTES:]))
        if session is None:
            raise RequestError(Status.UNAUTHENTICATED, "unknown session or wrong secret: open a session over gRPC")
        if "tcp" not in session.transports:
            raise RequestError(Status.UNAUTHENTICATED, "this session was not granted the tcp transport")
        return session

    def _gather(self, table_index: int, ids: np.ndarray, buffers: "_Buffers") -> np.ndarray:
        tables = self.tables
        if table_index >= len(tables):
            raise RequestError(Status.UNKNOWN_TABLE, f"no table #{table_index}: the catalog has {len(tables)} tables")
        table = tables[table_index]
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.rows:
                bad = lo if lo < 0 else hi
                raise RequestError(Status.ROW_OUT_OF_RANGE,
                                   f"row id {bad} out of range for table {table.name!r} (0..{table.rows - 1})")
        rows = buffers.rows(ids.size, table.row_bytes)
        np.take(table.data, ids, axis=0, out=rows, mode="clip")
        return rows


class _Buffers:
    """A connection's reusable row-id and row buffers (grown, never shrunk)."""

    def __init__(self):
        self._ids = np.empty(0, dtype="<i8")
        self._out = np.empty(0, dtype=np.uint8)

    def ids(self, count: int) -> np.ndarray:
        if self._ids.size < count:
            self._ids = np.empty(count, dtype="<i8")
        return self._ids[:count]

    def rows(self, count: int, row_bytes: int) -> np.ndarray:
        need = count * row_bytes
        if self._out.size < need:
            self._out = np.empty(max(need, 1 << 20), dtype=np.uint8)
        return self._out[:need].reshape(count, row_bytes)


def _lingering_close(conn: socket.socket, max_bytes: int = 1 << 20, timeout: float = 1.0) -> None:
    """Half-closes, then drains what the peer already sent, so the error frame
    reaches it (closing with unread input makes the kernel send RST, which can
    destroy the frame in flight)."""
    try:
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(timeout)
        drained = 0
        while drained < max_bytes:
            chunk = conn.recv(65536)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
