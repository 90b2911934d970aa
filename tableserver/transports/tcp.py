"""tcp transport: row gathers over a framed binary protocol (see tableserver/common/wire.py).

Connections live in the shared connection layer (transports/connections.py):
a fixed pool of workers on one epoll set, no thread per connection, every
limit (handshake deadline, caps, send timeout, accept back-off) written there.
A response marks ``conn.send_since`` when it starts sending and clears it once
wholly sent: the send timeout bounds the whole response, not each partial send.
A connection opens with the server's CHALLENGE; the client answers with a
HELLO that proves it holds its session secret without sending it.

A request is served without blocking: read its header and int64 row ids (as
they arrive) into the connection's buffer, check every id against the table in
one vectorized pass, then gather with ``np.take`` in chunks of at most
CHUNK_BYTES and send each with ``sendmsg`` as the socket takes it; when the
client does not read, the worker re-arms the connection for writing and moves
on. No per-row Python. Requests on one connection are answered in order, so a
client may pipeline several.

A disk table's gather (``table.disk``) cannot stream: a read error must
still be answered with an error frame, so the rows are read whole first. The
worker hands the gather to the table's DiskQueue and **parks** the connection
(no worker holds it while the drive works; the connection layer watches it for
a hang-up, which cancels the gather); the queue's thread sets up the response
(OK header, or IO_ERROR / BUSY) and resumes the connection for writing; the
rows then go out as a memory table's do, from the job's buffer, which goes back
to the disk tier's budget once sent.

Memory a connection can make the server hold: its row-id buffer (at most
8 * max_rows_per_request bytes) and one chunk (CHUNK_BYTES); a disk gather's
rows are the disk tier's budget (``--disk-buffer-mib``, a share per session),
not the connection's.

Invariants: no byte outside a table is ever read (ids are range-checked, and
``np.take(mode="clip")`` could not read outside even if they were not); a
malformed or hostile connection is closed without affecting any other.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import termios
import time

import numpy as np

from tableserver.common.buffers import copy_buffer
from tableserver.common.seal import C2S, S2C, TAG_BYTES, BadTag, Direction, crypt_into, derive_key
from tableserver.common.take import in_range, take_checked
from tableserver.common.wire import (
    CLIENT_NONCE_BYTES,
    HEADER,
    HEADER_BYTES,
    HELLO_BYTES,
    HELLO_SEALED,
    NONCE_BYTES,
    REQUEST_MAGIC,
    SESSION_ID_BYTES,
    FrameType,
    Refused,
    Status,
    challenge_frame,
    response_header,
)
from tableserver.errors import ListenError
from tableserver.logs import RateLimitedLog
from tableserver.transports.base import ServerTransport
from tableserver.transports.connections import (
    CLOSE,
    PARK,
    READ,
    WRITE,
    Connection,
    ConnectionLoop,
    Protocol,
    bind_unix,
    cpu_workers,
    wait_writable,
)
from tableserver.transports.limits import connection_limits
from tableserver.v1 import tableserver_pb2 as pb

log = logging.getLogger(__name__)

#: rows are gathered and sent in chunks of at most this many bytes
CHUNK_BYTES = 512 << 10


def chunk_rows(row_bytes: int) -> int:
    """Rows of ``row_bytes`` in one chunk."""
    return max(1, CHUNK_BYTES // row_bytes)


#: how long a worker waits for a reading client's socket to drain before re-arming it for later
SEND_SPIN_S = 0.002
#: requests one connection may have answered per turn before the worker serves others
REQUESTS_PER_TURN = 8


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
            raise ListenError(
                f"{what} port {host}:{port} is already in use: stop the other server or pass "
                f"{flag} HOST:PORT (port 0 picks a free port)",
                errno=e.errno,
            ) from None
        raise ListenError(
            f"cannot listen on {host}:{port} for {what} ({e.strerror}): fix {flag}", errno=e.errno
        ) from None
    return sock


class TcpTransport(ServerTransport):
    #: also the grant a session needs (OpenSession's transports) and the metrics' transport label
    name = "tcp"

    def __init__(self, sessions, options):
        super().__init__(sessions, options)
        self.host, self.port = options["tcp_listen"]
        self.advertise_host = options.get("tcp_advertise") or self.host
        self.max_rows = int(options["max_rows_per_request"])
        self.limits = connection_limits(options)
        self.workers = int(options.get("data_threads", 0)) or cpu_workers()
        mode = options.get("data_encryption", "auto") or "auto"
        self.seal = mode == "on" or (mode == "auto" and bool(options.get("tls_cert")))
        self._sock: socket.socket | None = None
        self._loop: ConnectionLoop | None = None
        self._closed = False
        self._inst: dict = {}  # table index -> its Recorder

    # -- lifecycle
    def bind(self) -> None:
        self._sock = bind_listener(self.host, self.port, "tcp data", "--tcp-listen")
        self.port = self._sock.getsockname()[1]

    def start(self, tables) -> None:
        self.tables = tables
        for t in tables:  # series exist from 0, so rate() counts the first requests
            self.instruments(t.index)
        self._loop = ConnectionLoop(self.name, self._sock, _TcpProtocol(self), self.limits, self.workers, self.metrics)
        self._loop.start()

    def describe(self) -> str:
        return f"tcp {self.host}:{self.port}"

    def offer(self, session, request):
        host = self.advertise_host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        return pb.TransportOffer(name="tcp", tcp=pb.TcpEndpoint(host=host, port=self.port))

    def release(self, session) -> None:
        if self._loop is not None:
            self._loop.release(session)

    def attach(self, conn: Connection, session) -> None:
        """Binds a connection whose HELLO proved ``session`` to it (its protocol calls this)."""
        self._loop.attach(conn, session)

    def park(self, conn: Connection) -> None:
        """Parks a connection whose gather goes to a disk queue (watched for a hang-up meanwhile)."""
        self._loop.park(conn)

    def resume(self, conn: Connection, want: str) -> None:
        """Re-arms a connection the protocol parked (a disk gather done)."""
        self._loop.resume(conn, want)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.close()
        if self._sock is not None:
            self._sock.close()

    def connections(self) -> int:
        return self._loop.connections() if self._loop is not None else 0

    def active_sessions(self) -> int:
        return self._loop.active_sessions() if self._loop is not None else 0

    def health(self) -> tuple[bool, str]:
        return self._loop.health() if self._loop is not None else (True, "")

    def instruments(self, table_index: int):
        """Per-table metric children, made once (labels() is too slow for every request)."""
        inst = self._inst.get(table_index)
        if inst is None:
            inst = self._inst[table_index] = self.metrics.gather_op(self.name, "gather", self.tables[table_index].name)
        return inst


class UnixRowsPort(TcpTransport):
    """tcp's protocol on a Unix stream socket: the same-host path to disk tables (the shm transport
    offers it beside its own socket). A session needs the shm grant; rows are not sealed (they never
    leave the host); the socket's mode and group are the shm socket's."""

    name = "shm"

    def __init__(self, sessions, options, path: str, gid: int = -1):
        super().__init__(sessions, dict(options, data_encryption="off"))
        self.path = path
        self.gid = gid

    def bind(self) -> None:
        sock = bind_unix(self.path, socket.SOCK_STREAM, self.gid, "the disk rows socket")
        self._sock = sock

    def describe(self) -> str:
        return f"shm-rows {self.path}"

    def close(self) -> None:
        if not self._closed and self._sock is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        super().close()


class _State:
    """One tcp connection's protocol state."""

    __slots__ = (
        "nonce",
        "head",
        "got",
        "need",
        "target",
        "ftype",
        "req_id",
        "table",
        "count",
        "ids_buf",
        "chunk_buf",
        "parts",
        "next_row",
        "chunk_busy",
        "sending",
        "closing",
        "started",
        "hello",
        "error",
        "rx",
        "tx",
        "enc",
        "cipher_buf",
        "sealed_buf",
        "client_nonce",
        "disk_job",
        "source_rows",
    )

    def __init__(self, nonce: bytes):
        self.nonce = nonce
        self.head = bytearray(HEADER_BYTES)
        self.got = 0
        self.need = HEADER_BYTES
        self.target = memoryview(self.head)  # what the bytes being received fill
        self.ftype = self.req_id = self.table = self.count = 0
        self.ids_buf = np.empty(0, dtype="<i8")
        self.chunk_buf = np.empty(0, dtype=np.uint8)
        self.parts: list[memoryview] = []
        self.next_row = 0
        self.chunk_busy = False
        self.sending = False  # a response is (partly) unsent: the send timeout applies
        self.closing = False  # a fatal error was answered: drain, then close
        self.started = 0.0
        self.hello = bytearray(HELLO_BYTES)
        self.error: Refused | None = None  # a refusal decided from the header alone
        self.rx = self.tx = None  # seal.Direction each way once the connection is sealed
        self.enc = None  # the encryptor of the response being sent
        self.cipher_buf = copy_buffer(0)  # a sealed request's payload + tag as received
        self.sealed_buf = copy_buffer(0)  # an encrypted chunk of rows
        self.client_nonce = b""
        self.disk_job = None  # the DiskJob of the disk gather parked or being answered
        self.source_rows = None  # its rows, read: sent as they are (memory tables' rows are taken chunk by chunk)

    def drop_disk_job(self) -> None:
        """Stops the disk gather (a barrier: nothing writes into its rows after) and gives its rows back."""
        job, self.disk_job, self.source_rows = self.disk_job, None, None
        if job is not None:
            job.cancel()
            job.release()

    def expect_header(self) -> None:
        self.got, self.need, self.target = 0, HEADER_BYTES, memoryview(self.head)

    def ids(self, count: int) -> np.ndarray:
        if self.ids_buf.size < count:
            self.ids_buf = np.empty(count, dtype="<i8")
        return self.ids_buf[:count]

    def chunk(self, rows: int, row_bytes: int) -> np.ndarray:
        need = rows * row_bytes
        if self.chunk_buf.size < need:
            self.chunk_buf = copy_buffer(need)  # half a page off alignment: no 4K aliasing in the send copy
        return self.chunk_buf[:need].reshape(rows, row_bytes)


def _readable_now(sock: socket.socket) -> bool:
    """Whether bytes wait on ``sock`` (FIONREAD: one ioctl, cheaper than a recv that raises EAGAIN)."""
    try:
        return fcntl.ioctl(sock.fileno(), termios.FIONREAD, _FIONREAD_BUF) != _ZERO
    except OSError:
        return True  # let recv report it


_FIONREAD_BUF = bytes(4)
_ZERO = bytes(4)


class _TcpProtocol(Protocol):
    def __init__(self, transport: TcpTransport):
        self.t = transport
        self.ratelog = RateLimitedLog(log)

    def greeting(self, conn: Connection) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        conn.state = _State(nonce)
        return challenge_frame(nonce)

    def busy(self, message: str) -> bytes:
        return Refused(Status.BUSY, message).frame(FrameType.CHALLENGE)

    def closed(self, conn: Connection) -> None:
        st: _State | None = conn.state
        conn.state = None
        if st is not None:
            st.drop_disk_job()

    def hangup(self, conn: Connection) -> None:
        st: _State | None = conn.state
        if st is not None:
            st.drop_disk_job()

    def ready(self, conn: Connection, events: int) -> str:
        st: _State = conn.state
        if st.closing:
            return self._drain(conn)
        if st.sending:
            if not self._pump(conn):
                return WRITE
            self._finish(conn)
            if st.closing:
                return self._drain(conn)
        for _ in range(REQUESTS_PER_TURN):
            complete = self._receive(conn)
            if complete is None:
                return CLOSE
            if not complete:
                return READ
            if self._answer(conn):
                return PARK  # a disk gather: the disk queue resumes the connection (it may own it already)
            if not self._pump(conn):
                return WRITE
            self._finish(conn)
            if st.closing:
                return self._drain(conn)
            if not _readable_now(conn.sock):
                break  # the usual case (one request, one answer): no recv that would only say EAGAIN
        return READ  # level-triggered: re-fires at once if more requests are waiting

    # -- receiving
    def _receive(self, conn: Connection):
        """True when a whole frame is in, False when more bytes are to come, None on a clean EOF."""
        st: _State = conn.state
        sock = conn.sock
        while True:
            if st.got < st.need:
                try:
                    n = sock.recv_into(st.target[st.got :], st.need - st.got)
                except (BlockingIOError, InterruptedError):
                    return False
                if n == 0:
                    if st.got == 0 and st.target.obj is st.head:
                        return None
                    raise ConnectionResetError(f"connection closed mid-frame ({st.got} of {st.need} bytes)")
                st.got += n
                if st.got < st.need:
                    continue
            if st.target.obj is st.head:
                if not self._header(conn):
                    return True  # an error to answer: no payload follows that we read
                if st.got >= st.need:
                    return True
                continue
            return True

    def _header(self, conn: Connection) -> bool:
        """Parses the header just received; sets up the payload. False when it is refused outright."""
        st: _State = conn.state
        magic, ftype, _flags, req_id, table, count = HEADER.unpack(st.head)
        st.ftype, st.req_id, st.table, st.count = ftype, req_id, table, count
        st.error = None
        try:
            if magic != REQUEST_MAGIC:
                raise Refused(Status.BAD_FRAME, f"bad frame magic {magic!r}: not a tableserver client")
            if ftype == FrameType.HELLO:
                if count != HELLO_BYTES:
                    raise Refused(
                        Status.BAD_FRAME,
                        f"HELLO carries {count} bytes, expected {HELLO_BYTES} (a client older than this server?)",
                    )
                st.got, st.need, st.target = 0, HELLO_BYTES, memoryview(st.hello)
                return True
            if conn.session is None:
                raise Refused(Status.UNAUTHENTICATED, "send HELLO with the session's proof first")
            if ftype != FrameType.GATHER:
                raise Refused(Status.BAD_FRAME, f"unknown frame type {ftype}")
            if count > self.t.max_rows:
                raise Refused(
                    Status.TOO_MANY_ROWS,
                    f"{count} row ids in one request, the limit is {self.t.max_rows}: split the gather",
                )
            st.got, st.need = 0, count * 8
            if st.rx is not None:  # sealed: ciphertext + tag land aside, then decrypt into the id buffer
                st.need += TAG_BYTES
                if len(st.cipher_buf) < st.need:
                    st.cipher_buf = copy_buffer(st.need)
                st.target = memoryview(st.cipher_buf)
            else:
                st.target = memoryview(st.ids(count)).cast("B")
            return True
        except Refused as e:
            st.error = e
            return False

    # -- answering
    def _answer(self, conn: Connection) -> bool:
        """Turns the frame just received into a response (parts to send, rows to gather). True when it
        went to a disk queue instead: the connection is parked, and this worker must not touch it again."""
        st: _State = conn.state
        st.started = time.perf_counter()
        st.next_row = st.count = st.count if st.ftype == FrameType.GATHER else 0
        error = st.error
        try:
            if error is not None:
                raise error
            if st.ftype == FrameType.HELLO:
                proof = self._hello(conn)
                # row_bytes of the HELLO answer carries flags: SEALED when the payloads that follow are sealed
                st.parts = [
                    memoryview(
                        response_header(
                            FrameType.HELLO, Status.OK, st.req_id, HELLO_SEALED if self.t.seal else 0, len(proof)
                        )
                        + proof
                    )
                ]
                st.count = 0
                if self.t.seal:
                    self._seal(conn)
            else:
                session = conn.session
                if st.rx is not None:
                    self._open_ids(st)
                if session.closed:
                    raise Refused(Status.SESSION_CLOSED, f"session ended: {session.close_reason}")
                table = self._check(st)
                if table.disk is not None and st.count:
                    self._park(conn, table)
                    return True
                st.next_row = 0
                header = response_header(FrameType.GATHER, Status.OK, st.req_id, table.row_bytes, st.count)
                st.parts = [memoryview(header)]
                if st.tx is not None:
                    st.enc = st.tx.encryptor(header)
        except Refused as e:
            self.t.metrics.refused(e.status)
            self.ratelog.warning(e.name, "tcp %s: %s", conn.peer, e.describe())
            st.parts = [memoryview(e.frame(st.ftype, st.req_id, st.tx.seal if st.tx is not None else None))]
            st.next_row = st.count = 0
            st.enc = None
            st.closing = e.fatal
        st.error = None
        st.sending = True
        conn.send_since = time.monotonic()  # the send timeout bounds the whole response from here
        st.chunk_busy = False
        st.expect_header()
        return False

    def _park(self, conn: Connection, table) -> None:
        """Hands a disk table's gather to its queue, the connection parked first (a completion may come at
        once); :meth:`_disk_done` answers it."""
        st: _State = conn.state
        st.error = None
        st.sending = False  # no send timeout while the drive works (the disk timeout bounds it)
        st.chunk_busy = False
        st.expect_header()
        self.t.park(conn)
        st.disk_job = table.disk.job(  # held before it starts: its completion may come at once
            st.ids_buf[: st.count], None, lambda job: self._disk_done(conn, table, job), owner=id(conn.session)
        )
        table.disk.start(st.disk_job)
        if conn.state is None:  # the peer hung up while it was handed over: stop it (closed() may not have seen it)
            st.drop_disk_job()

    def _disk_done(self, conn: Connection, table, job) -> None:
        """On the disk queue's thread: the response to a parked gather set up, then the connection resumed."""
        st: _State | None = conn.state
        if st is None:  # dropped meanwhile (closed() stopped the job, or it finished first)
            job.release()
            return
        error = job.error
        if error is None:
            header = response_header(FrameType.GATHER, Status.OK, st.req_id, table.row_bytes, st.count)
            st.parts = [memoryview(header)]
            st.source_rows = job.rows
            st.next_row = 0
            st.chunk_busy = False
            st.enc = st.tx.encryptor(header) if st.tx is not None else None
        else:
            st.drop_disk_job()
            self.t.metrics.refused(error.status)
            self.ratelog.warning(error.name, "%s %s: %s", self.t.name, conn.peer, error.describe())
            st.parts = [memoryview(error.frame(st.ftype, st.req_id, st.tx.seal if st.tx is not None else None))]
            st.next_row = st.count = 0
            st.closing = error.fatal
            st.enc = None
        st.sending = True
        conn.send_since = time.monotonic()
        self.t.resume(conn, WRITE)

    def _seal(self, conn: Connection) -> None:
        st: _State = conn.state
        secret = conn.session.secret
        st.rx = Direction(derive_key(secret, C2S, st.nonce, st.client_nonce))
        st.tx = Direction(derive_key(secret, S2C, st.nonce, st.client_nonce))

    def _open_ids(self, st: _State) -> None:
        """Decrypts a sealed GATHER's ids into the id buffer; a bad tag is fatal (BAD_FRAME)."""
        n = st.count * 8
        header = bytes(st.head)
        try:
            st.rx.open_into(
                header,
                memoryview(st.cipher_buf)[:n],
                bytes(st.cipher_buf[n : n + TAG_BYTES]),
                memoryview(st.ids(st.count)).cast("B"),
            )
        except BadTag as e:
            raise Refused(Status.BAD_FRAME, str(e)) from None

    def _hello(self, conn: Connection) -> bytes:
        st: _State = conn.state
        if conn.session is not None:
            raise Refused(Status.BAD_FRAME, "a second HELLO on one connection")
        session, proof = self.t.sessions.authenticate_hello(bytes(st.hello), st.nonce)
        st.client_nonce = bytes(st.hello[SESSION_ID_BYTES : SESSION_ID_BYTES + CLIENT_NONCE_BYTES])
        if session is None:
            raise Refused(Status.UNAUTHENTICATED, "unknown session or wrong proof: open a session over gRPC")
        if self.t.name not in session.transports:
            raise Refused(Status.UNAUTHENTICATED, f"this session was not granted the {self.t.name} transport")
        self.t.attach(conn, session)
        return proof

    def _check(self, st: _State):
        tables = self.t.tables
        if st.table >= len(tables):
            raise Refused(Status.UNKNOWN_TABLE, f"no table #{st.table}: the catalog has {len(tables)} tables")
        table = tables[st.table]
        ids = st.ids_buf[: st.count]
        if not in_range(ids, table.rows):
            lo, hi = int(ids.min()), int(ids.max())
            bad = lo if lo < 0 else hi
            raise Refused(
                Status.ROW_OUT_OF_RANGE, f"row id {bad} out of range for table {table.name!r} (0..{table.rows - 1})"
            )
        return table

    def _pump(self, conn: Connection) -> bool:
        """Sends what the socket takes, gathering the next chunk when the last one is out. True when
        the whole response is sent."""
        st: _State = conn.state
        sock = conn.sock
        while True:
            if st.next_row < st.count and not st.chunk_busy:
                table = self.t.tables[st.table]
                if st.source_rows is not None:  # a disk gather's rows, read: sent from where they are
                    n = (
                        st.count - st.next_row
                        if st.enc is None
                        else min(st.count - st.next_row, chunk_rows(table.row_bytes))
                    )
                    rows = st.source_rows[st.next_row : st.next_row + n]
                else:
                    n = min(st.count - st.next_row, chunk_rows(table.row_bytes))
                    rows = st.chunk(n, table.row_bytes)
                    take_checked(table.data, st.ids_buf[st.next_row : st.next_row + n], rows)  # checked in _check
                st.next_row += n
                view = memoryview(rows.reshape(-1))
                if st.enc is not None:
                    if len(st.sealed_buf) < len(view) + 15 + TAG_BYTES:
                        st.sealed_buf = copy_buffer(max(len(view), CHUNK_BYTES) + 15 + TAG_BYTES)
                    crypt_into(st.enc, view, memoryview(st.sealed_buf)[: len(view) + 15])
                    view = memoryview(st.sealed_buf)[: len(view)]
                    if st.next_row == st.count:  # the last chunk carries the tag
                        st.enc.finalize()
                        memoryview(st.sealed_buf)[len(view) : len(view) + TAG_BYTES] = st.enc.tag
                        view = memoryview(st.sealed_buf)[: len(view) + TAG_BYTES]
                        st.enc = None
                st.parts.append(view)
                st.chunk_busy = True
            elif st.enc is not None and st.next_row == st.count:  # zero rows: the tag alone
                st.enc.finalize()
                st.parts.append(memoryview(st.enc.tag))
                st.enc = None
            if not st.parts:
                return True
            try:
                sent = sock.sendmsg(st.parts)
            except (BlockingIOError, InterruptedError):
                if wait_writable(sock, SEND_SPIN_S):
                    continue
                return False
            conn.last_active = time.monotonic()
            parts = st.parts
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]
            if not parts:
                st.chunk_busy = False

    def _finish(self, conn: Connection) -> None:
        st: _State = conn.state
        st.sending = False
        conn.send_since = 0.0
        if st.ftype == FrameType.GATHER and st.count and not st.closing:
            self.t.instruments(st.table).defer(
                st.count, st.count * self.t.tables[st.table].row_bytes, time.perf_counter() - st.started
            )
        if st.disk_job is not None:  # a disk gather's rows are out: back to the disk tier's budget
            st.drop_disk_job()
        if st.closing:
            try:  # the error frame is out: half-close, then drain what the peer still sends
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _drain(self, conn: Connection) -> str:
        """After a fatal error: read and drop the peer's bytes until it closes (closing with unread input
        makes the kernel send RST, which can destroy the error frame in flight); the send timeout bounds it."""
        st: _State = conn.state
        st.sending = True
        if not conn.send_since:  # so the send timeout closes a peer that never hangs up
            conn.send_since = time.monotonic()
        for _ in range(16):
            try:
                chunk = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return READ
            if not chunk:
                return CLOSE
        return READ
