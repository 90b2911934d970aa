"""Binary framing of the tcp and shm data transports (shared by server and client).

Every frame starts with a 24-byte little-endian header::

    request  magic b"TSQ1" | type u16 | flags u16  | request_id u64 | table u32     | count u32
    response magic b"TSR1" | type u16 | status u16 | request_id u64 | row_bytes u32 | count u32

* HELLO (type 1): payload = 16-byte session id + 32-byte session secret
  (count = 48). Must be the first frame of a connection; answered with OK
  (shm: plus a JSON table list and the table fds, see transports/shm.py).
* GATHER (type 2): payload = ``count`` int64 row ids of table ``table``.
  The OK response carries ``count * row_bytes`` bytes: the rows in request order.

Any error response carries a UTF-8 message of ``count`` bytes instead of rows.
Errors marked fatal (bad frame, unauthenticated, too many rows, session closed)
close the connection after the response; the others leave it usable.
Responses come back in request order, so several requests may be in flight.
"""

from __future__ import annotations

import enum
import socket
import struct

HEADER = struct.Struct("<4sHHQII")
HEADER_BYTES = HEADER.size
REQUEST_MAGIC = b"TSQ1"
RESPONSE_MAGIC = b"TSR1"
SESSION_ID_BYTES = 16
SECRET_BYTES = 32
HELLO_BYTES = SESSION_ID_BYTES + SECRET_BYTES
ROW_ID_BYTES = 8


class FrameType(enum.IntEnum):
    HELLO = 1
    GATHER = 2


class Status(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1
    UNAUTHENTICATED = 2
    UNKNOWN_TABLE = 3
    ROW_OUT_OF_RANGE = 4
    TOO_MANY_ROWS = 5
    SESSION_CLOSED = 6
    INTERNAL = 7


FATAL = frozenset({Status.BAD_FRAME, Status.UNAUTHENTICATED, Status.TOO_MANY_ROWS, Status.SESSION_CLOSED})


def request_header(frame: FrameType, request_id: int, table: int, count: int) -> bytes:
    return HEADER.pack(REQUEST_MAGIC, frame, 0, request_id, table, count)


def response_header(frame: int, status: Status, request_id: int, row_bytes: int, count: int) -> bytes:
    return HEADER.pack(RESPONSE_MAGIC, frame, status, request_id, row_bytes, count)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fills ``view`` from ``sock``. False on a clean EOF before the first byte."""
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            if pos == 0:
                return False
            raise ConnectionResetError(f"connection closed mid-frame ({pos} of {n} bytes)")
        pos += got
    return True


def send_all(sock: socket.socket, parts: list) -> None:
    """sendmsg of several buffers, looping over partial sends."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
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
