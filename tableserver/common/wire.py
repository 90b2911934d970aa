"""Binary framing of the tcp and shm data transports (shared by server and client).

Every frame starts with a 24-byte little-endian header::

    request  magic b"TSQ1" | type u16 | flags u16  | request_id u64 | table u32     | count u32
    response magic b"TSR1" | type u16 | status u16 | request_id u64 | row_bytes u32 | count u32

* CHALLENGE (type 3, server -> client): the server's first frame on every
  connection, a response carrying a fresh 32-byte nonce (or, when the server has
  no room for the connection, a BUSY error frame before it closes).
* HELLO (type 1): payload = 16-byte session id + 16-byte client nonce +
  HMAC-SHA256(session secret, "tableserver-hello" | session id | server nonce |
  client nonce) (count = 64). Must be the first client frame; answered with OK
  carrying the server's proof, HMAC-SHA256(secret, "tableserver-server" | same),
  so each side shows it holds the secret and the secret never crosses the wire
  (a sniffed HELLO is useless: the next connection gets another nonce). Its
  row_bytes field carries flags: HELLO_SEALED when every payload that follows is
  AES-256-GCM sealed with keys derived from the same secret (tableserver/common/seal.py).
  shm: the OK carries a JSON table list and the table fds instead (transports/shm.py).
* GATHER (type 2): payload = ``count`` int64 row ids of table ``table``.
  The OK response carries ``count * row_bytes`` bytes: the rows in request order.

Any error response carries a UTF-8 message of ``count`` bytes instead of rows.
Errors marked fatal (bad frame, unauthenticated, too many rows, session closed,
busy) close the connection after the response; the others leave it usable.
Responses come back in request order, so several requests may be in flight.

A refusal -- of a connection, a handshake or one request, on tcp, shm or rdma
pack mode -- is always one :class:`Refused` (a :class:`Status` and a message):
the server raises it where it decides and answers with its frame
(:meth:`Refused.frame`, :meth:`Refused.pack_error`); the client reads error
frames back into it (:meth:`Refused.from_wire`, :func:`parse_challenge`,
:func:`parse_pack_error`) and reports it as its own error.
"""

from __future__ import annotations

import enum
import select
import socket
import struct
import time

HEADER = struct.Struct("<4sHHQII")
HEADER_BYTES = HEADER.size
REQUEST_MAGIC = b"TSQ1"
RESPONSE_MAGIC = b"TSR1"
SESSION_ID_BYTES = 16
SECRET_BYTES = 32
NONCE_BYTES = 32  # the server's challenge
CLIENT_NONCE_BYTES = 16
MAC_BYTES = 32
HELLO_BYTES = SESSION_ID_BYTES + CLIENT_NONCE_BYTES + MAC_BYTES
#: flags in the row_bytes field of the server's OK to HELLO
HELLO_SEALED = 1  # every payload that follows is AES-GCM sealed (tableserver/common/seal.py)
ROW_ID_BYTES = 8


class FrameType(enum.IntEnum):
    HELLO = 1
    GATHER = 2
    CHALLENGE = 3


class Status(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1
    UNAUTHENTICATED = 2
    UNKNOWN_TABLE = 3
    ROW_OUT_OF_RANGE = 4
    TOO_MANY_ROWS = 5
    SESSION_CLOSED = 6
    INTERNAL = 7
    BUSY = 8  # the server has no room for this connection (connection caps): retry later
    IO_ERROR = 9  # a disk table's read failed (EIO, short read, file changed): this request only


FATAL = frozenset({Status.BAD_FRAME, Status.UNAUTHENTICATED, Status.TOO_MANY_ROWS, Status.SESSION_CLOSED, Status.BUSY})


def status_name(status: int) -> str:
    """A wire status by name (its number when this version does not know it)."""
    try:
        return Status(status).name
    except ValueError:
        return str(status)


class Refused(Exception):
    """A refused connection, handshake or request: a wire ``status`` (not OK) and a one-line message.

    The one way both sides express a refusal: the server raises it and answers with its frame, the
    client parses error frames into it. ``str()`` is the message alone (what the frame carries);
    :meth:`describe` names the status too."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def name(self) -> str:
        return status_name(self.status)

    @property
    def fatal(self) -> bool:
        """The server closes the connection after answering with it."""
        return self.status in FATAL

    def describe(self) -> str:
        return f"{self.name}: {self.message}"

    def frame(self, ftype: int, request_id: int = 0, seal=None) -> bytes:
        """The error response frame: header + message (``seal(header, message)`` on a sealed connection)."""
        body = self.message.encode()
        header = response_header(ftype, self.status, request_id, 0, len(body))
        return header + (seal(header, body) if seal is not None else body)

    def pack_error(self, request_id: int) -> bytes:
        """The PACK_ERROR message answering rdma pack request ``request_id`` (cut to the client's buffer)."""
        body = self.message.encode()[: PACK_REPLY_BYTES - PACK_ERROR.size]
        return PACK_ERROR.pack(PACK_ERROR_MAGIC, request_id, self.status, len(body)) + body

    @classmethod
    def from_wire(cls, status: int, body) -> Refused:
        """The refusal an error frame carries (its message decoded leniently: it comes from the peer)."""
        return cls(status, bytes(body).decode(errors="replace"))


#: the name this error had when it covered only a connection refused before its CHALLENGE
HandshakeRefused = Refused


def hello_mac(
    secret: bytes, session_id: bytes, server_nonce: bytes, client_nonce: bytes, role: bytes = b"tableserver-hello"
) -> bytes:
    """The proof one side holds the session secret, bound to this connection's nonces."""
    import hashlib
    import hmac

    return hmac.new(secret, role + session_id + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, session_id: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hello_mac(secret, session_id, server_nonce, client_nonce, b"tableserver-server")


def owner_proof(secret: bytes, session_id: bytes) -> bytes:
    """HMAC-SHA256(secret, "tableserver-owner" | session id): a client opening a session on behalf of session
    ``session_id`` (OpenSessionRequest.owner_session_id) holds that session."""
    return hello_mac(secret, session_id, b"", b"", b"tableserver-owner")


def challenge_frame(nonce: bytes) -> bytes:
    return response_header(FrameType.CHALLENGE, Status.OK, 0, 0, len(nonce)) + nonce


def hello_frame(session_id: bytes, secret: bytes, server_nonce: bytes, request_id: int = 0) -> tuple[bytes, bytes]:
    """(the HELLO frame answering ``server_nonce``, the client nonce it used)."""
    import os

    client_nonce = os.urandom(CLIENT_NONCE_BYTES)
    payload = session_id + client_nonce + hello_mac(secret, session_id, server_nonce, client_nonce)
    return request_header(FrameType.HELLO, request_id, 0, len(payload)) + payload, client_nonce


def parse_challenge(frame: bytes) -> bytes:
    """The nonce of a CHALLENGE frame; Refused for an error frame (e.g. BUSY), ValueError for anything else."""
    if len(frame) < HEADER_BYTES:
        raise ValueError(f"expected a CHALLENGE frame, got {len(frame)} bytes: not a tableserver data port?")
    magic, ftype, status, _rid, _rb, count = HEADER.unpack_from(frame)
    body = bytes(frame[HEADER_BYTES : HEADER_BYTES + count])
    if magic != RESPONSE_MAGIC:
        raise ValueError("the server did not open with a CHALLENGE frame: not a tableserver data port?")
    if status != Status.OK:
        raise Refused.from_wire(status, body)
    if ftype != FrameType.CHALLENGE or count != NONCE_BYTES or len(body) != NONCE_BYTES:
        raise ValueError("the server did not open with a CHALLENGE frame: not a tableserver data port?")
    return body


#: the longest error message a handshake frame may carry (a BUSY or refusal reason)
MAX_HANDSHAKE_MESSAGE = 4096


def recv_challenge(sock: socket.socket, deadline: float | None = None) -> bytes:
    """Reads the CHALLENGE a stream connection starts with (by ``deadline``, time.monotonic(), when
    given: socket.timeout after it); its nonce."""
    head = bytearray(HEADER_BYTES)
    if not recv_exact(sock, memoryview(head), deadline):
        raise ConnectionResetError("the server closed the connection before its CHALLENGE")
    count = HEADER.unpack(head)[5]
    if count > MAX_HANDSHAKE_MESSAGE:
        raise ValueError("the server did not open with a CHALLENGE frame: not a tableserver data port?")
    body = bytearray(count)
    if count and not recv_exact(sock, memoryview(body), deadline):
        raise ConnectionResetError("the server closed the connection during its CHALLENGE")
    return parse_challenge(bytes(head + body))


def request_header(frame: FrameType, request_id: int, table: int, count: int) -> bytes:
    return HEADER.pack(REQUEST_MAGIC, frame, 0, request_id, table, count)


def response_header(frame: int, status: Status, request_id: int, row_bytes: int, count: int) -> bytes:
    return HEADER.pack(RESPONSE_MAGIC, frame, status, request_id, row_bytes, count)


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """Bounds the next blocking call on ``sock`` by what is left until ``deadline`` (socket.timeout
    once it has passed): a peer that dribbles bytes cannot stretch a bounded exchange."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fills ``view`` from ``sock`` (all of it by ``deadline`` when given). False on a clean EOF
    before the first byte."""
    pos, n = 0, len(view)
    while pos < n:
        _arm(sock, deadline)
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            if pos == 0:
                return False
            raise ConnectionResetError(f"connection closed mid-frame ({pos} of {n} bytes)")
        pos += got
    return True


def send_all(sock: socket.socket, parts: list, deadline: float | None = None) -> None:
    """sendmsg of several buffers, looping over partial sends. With ``deadline`` (time.monotonic()) all
    of it is sent by then, else TimeoutError (a peer that stops reading cannot hold the sender): it
    waits for room with ``poll`` and sends with MSG_DONTWAIT, leaving the socket's blocking mode and
    timeouts as they were (a reader on another thread may be using them)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    poller = None
    while views:
        if deadline is None:
            sent = sock.sendmsg(views)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            if not poller.poll(int(left * 1000) + 1):  # ms, rounded up: never wakes before the deadline
                continue
            try:
                sent = sock.sendmsg(views, [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


# --------------------------------------------------------------------------- rdma pack mode
#
# Owner-side packing over an RC QP: the client SENDs one request (header + the
# int64 row ids); the server gathers the rows into a registered staging buffer
# and RDMA-WRITEs them, packed, to ``dest_addr`` (``dest_rkey``) WITH_IMM, the
# immediate data being ``request_id``. A refused request is answered by a SEND
# of PACK_ERROR + a UTF-8 message into one of the client's receive buffers.

PACK_REQUEST = struct.Struct("<4sIIIQI4x")  # magic, request_id, table, count, dest_addr, dest_rkey
PACK_REQUEST_MAGIC = b"TSPK"
PACK_ERROR = struct.Struct("<4sIII")  # magic, request_id, status, message bytes
PACK_ERROR_MAGIC = b"TSPE"
PACK_REPLY_BYTES = 512  # size of the client's receive buffers (error replies are truncated to fit)


def parse_pack_error(raw: bytes) -> tuple[int, Refused] | None:
    """(request id, Refused) of a PACK_ERROR message; None for anything else."""
    if len(raw) < PACK_ERROR.size:
        return None
    magic, request_id, status, length = PACK_ERROR.unpack_from(raw)
    if magic != PACK_ERROR_MAGIC:
        return None
    return request_id, Refused.from_wire(status, raw[PACK_ERROR.size : PACK_ERROR.size + length])
