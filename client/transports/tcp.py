"""tcp transport, client side: pipelined gathers over one connection.

The caller's thread frames a request (header + the int64 ids, one
``sendmsg``) and returns at once; a receiver thread reads each response
straight into that request's output buffer (no intermediate copy) and
completes it. Responses arrive in request order (see tableserver/wire.py).

Lifetime of an output buffer: it belongs to the request until its Pending
completes. A cancelled request's late rows land in a scratch buffer instead.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import socket
import threading

import numpy as np

from tableclient.errors import AuthError, ConnectError, RemoteError, TransportError
from tableclient.transports.base import ClientTransport, Pending
from tableserver.seal import C2S, S2C, TAG_BYTES, BadTag, Direction, derive_key
from tableserver.wire import (
    FATAL, HEADER, HEADER_BYTES, HELLO_SEALED, RESPONSE_MAGIC, FrameType, HandshakeRefused, Status, hello_frame,
    recv_challenge, recv_exact, request_header, send_all, server_proof,
)

log = logging.getLogger("tableclient.tcp")


#: how long cancelling a response that is being received waits for its last bytes before the
#: connection is broken instead (a server stuck mid-response must not write into the buffer later)
CANCEL_GRACE_S = 1.0


class _TcpPending(Pending):
    __slots__ = ("out", "request_id", "receiving", "transport")

    def __init__(self, out: np.ndarray, request_id: int, transport):
        super().__init__()
        self.out = out
        self.request_id = request_id
        self.receiving = False  # the receiver is writing this response into ``out``
        self.transport = transport

    def cancel(self) -> None:
        # With the receiver's order (receiving = True, then check cancelled) one of the two sides
        # always sees the other: either the rows go to scratch, or we wait for them to be in.
        self.cancelled = True
        if self.receiving and not self._event.wait(CANCEL_GRACE_S):
            self.transport._abort("a cancelled response stalled mid-transfer")
            self._event.wait()


class TcpTransport(ClientTransport):
    name = "tcp"
    dedups = True

    def __init__(self, offer, session, catalog, connect_timeout: float = 10.0):
        ep = offer.tcp
        self.endpoint = f"{ep.host}:{ep.port}"
        try:
            sock = socket.create_connection((ep.host, ep.port), timeout=connect_timeout)
        except OSError as e:
            raise ConnectError(f"cannot connect to the tcp data port {self.endpoint}: {e.strerror or e}: "
                               "check that the server's --tcp-listen/--tcp-advertise address is reachable") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._seal_tx = self._seal_rx = None  # seal.Direction each way when the server seals this connection
        self._scratch = bytearray(0)
        self._hello(session.id, session.secret)
        sock.settimeout(None)
        self._ids = itertools.count(1)
        self._pending: collections.deque[_TcpPending] = collections.deque()
        self._send_lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._rx = threading.Thread(target=self._receive_loop, name="tableclient-tcp-rx", daemon=True)
        self._rx.start()

    def _hello(self, session_id: bytes, secret: bytes) -> None:
        """Challenge-response: the secret never crosses the wire, and the server proves it holds it too."""
        status, msg, flags = Status.OK, b"", 0
        try:
            nonce = recv_challenge(self._sock)
            frame, client_nonce = hello_frame(session_id, secret, nonce)
            send_all(self._sock, [frame])
            head = bytearray(HEADER_BYTES)
            if not recv_exact(self._sock, memoryview(head)):
                raise ConnectionResetError("server closed the connection")
            magic, _t, status, _rid, flags, count = HEADER.unpack(head)
            if magic != RESPONSE_MAGIC or count > 65536:
                raise ValueError("not a tableserver response")
            msg = bytearray(count)
            if count:
                recv_exact(self._sock, memoryview(msg))
        except HandshakeRefused as e:
            self._sock.close()
            raise ConnectError(f"tcp data port {self.endpoint} refused the connection: {e}") from None
        except (OSError, ValueError) as e:
            self._sock.close()
            raise ConnectError(f"tcp handshake with {self.endpoint} failed: {e}") from None
        if status != Status.OK:
            self._sock.close()
            text = msg.decode(errors="replace")
            if status == Status.UNAUTHENTICATED:
                raise AuthError(f"tcp data port {self.endpoint} refused the session: {text}")
            raise ConnectError(f"tcp handshake with {self.endpoint} failed: {text}")
        if not hmac.compare_digest(bytes(msg), server_proof(secret, session_id, nonce, client_nonce)):
            self._sock.close()
            raise AuthError(f"tcp data port {self.endpoint} could not prove it holds the session secret: "
                            "not the server that opened this session")
        if flags & HELLO_SEALED:  # every payload from here on is AES-GCM sealed (tableserver/seal.py)
            self._seal_tx = Direction(derive_key(secret, C2S, nonce, client_nonce))
            self._seal_rx = Direction(derive_key(secret, S2C, nonce, client_nonce))

    def gather(self, table_index: int, ids: np.ndarray, out: np.ndarray, sync: bool = False,
               mode: str = "read", expand=None) -> Pending:
        with self._send_lock:
            if self._error is not None:
                raise self._error
            p = _TcpPending(out, next(self._ids), self)
            self._pending.append(p)  # before sending: the receiver may answer at once
            try:
                header = request_header(FrameType.GATHER, p.request_id, table_index, ids.size)
                payload = ids if self._seal_tx is None else self._seal_tx.seal(header, memoryview(ids).cast("B"))
                send_all(self._sock, [header, payload])
            except OSError as e:
                self._fail(TransportError(f"tcp connection to {self.endpoint} broke while sending: {e}"))
                raise self._error from None
        return p

    def _receive_loop(self) -> None:
        head = bytearray(HEADER_BYTES)
        sock = self._sock
        p = None  # the response being received: no longer in _pending, failed here if the connection breaks
        try:
            while True:
                if not recv_exact(sock, memoryview(head)):
                    raise ConnectionResetError("server closed the connection")
                magic, _t, status, req_id, row_bytes, count = HEADER.unpack(head)
                if magic != RESPONSE_MAGIC:
                    raise ConnectionError(f"bad response magic {magic!r}")
                p = self._pending.popleft() if self._pending else None
                if p is None or p.request_id != req_id:
                    raise ConnectionError(f"response to request {req_id} that is not next in line")
                if status == Status.OK:
                    p.receiving = True
                    dest = p.out if not p.cancelled else np.empty(p.out.nbytes, np.uint8)
                    if count * row_bytes != dest.nbytes:
                        raise ConnectionError(f"response of {count}x{row_bytes} bytes for a "
                                              f"{dest.nbytes}-byte buffer")
                    if self._seal_rx is None:
                        recv_exact(sock, memoryview(dest).cast("B"))
                    else:
                        self._open(sock, bytes(head), memoryview(dest).cast("B"))
                    p.complete()
                else:
                    msg = bytearray(count)
                    if self._seal_rx is None:
                        recv_exact(sock, memoryview(msg))
                    else:
                        self._open(sock, bytes(head), memoryview(msg))
                    name = Status(status).name if status in Status._value2member_map_ else str(status)
                    p.complete(RemoteError(name, msg.decode(errors="replace")))
                    if status in FATAL:
                        raise ConnectionError(f"server closed the connection after {name}")
        except (OSError, ValueError, BadTag) as e:
            error = TransportError(f"tcp connection to {self.endpoint} lost: {e}")
            if p is not None and not p.done():
                p.complete(error)
            self._fail(error)

    def _open(self, sock, header: bytes, dest: memoryview) -> None:
        """Receives a sealed payload (ciphertext + tag) and decrypts it into ``dest``; BadTag if forged."""
        n = len(dest) + TAG_BYTES
        if len(self._scratch) < n:
            self._scratch = bytearray(n)
        view = memoryview(self._scratch)[:n]
        recv_exact(sock, view)
        self._seal_rx.open_into(header, view[:len(dest)], view[len(dest):], dest)

    def _abort(self, why: str) -> None:
        """Breaks the connection: the receiver stops at once and fails what is pending."""
        log.warning("tcp connection to %s aborted: %s", self.endpoint, why)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error if not self._closed else TransportError("transport closed")
        while self._pending:
            self._pending.popleft().complete(self._error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._rx.join(timeout=5)
        self._sock.close()
        self._fail(TransportError("transport closed"))
