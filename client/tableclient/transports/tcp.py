"""tcp transport, client side: pipelined gathers over one connection.

The caller's thread frames a request (header + the int64 ids, one
``sendmsg``). Each response is read straight into its request's output buffer
(no intermediate copy) by whichever thread reads next: one reader at a time
(``_rx_lock``), responses in request order (see tableserver/common/wire.py), and the
response being read is resumable, so readers may take turns mid-frame.

* A synchronous gather (``sync=True``: the caller waits at once) is read by
  the caller's own thread: request, server, caller -- no hand-off to a
  receiver thread and back (one thread wake-up less per gather).
* Asynchronous gathers are read by the receiver thread, woken only when one is
  outstanding; a synchronous waiter that times out hands its request over to it.
* ``busy_poll`` (seconds, default 0): a reader first polls with non-blocking
  ``recv``s, through the whole response, this long before sleeping in the
  kernel, like polling an RDMA CQ: no wake-up at all when the rows arrive within
  it, at the price of one core spinning for up to ``busy_poll`` per wait (the
  bench reports both).

Lifetime of an output buffer: it belongs to the request until its Pending
completes. A cancelled request's late rows land in a scratch buffer instead.

A connection the server closed while it sat unused (its ``--idle-timeout``) is
re-opened, never reported as a broken node: a request about to go out on a
connection quiet for ``idle_check`` seconds first looks (one non-blocking peek)
whether the server's FIN or reset is already there, and re-opens it then; and a
request sent on a quiet connection keeps a copy of its ids, so when the
connection turns out closed (EOF, ECONNRESET, EPIPE) before any byte of a
response came back, it is re-sent once on a fresh connection (gathers are
idempotent reads), under a new request id. Anything else -- the re-opened
connection refused or failing too, a timeout, a connection that broke while it
was answering -- breaks the transport as before, and routing fails over.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import math
import select
import socket
import struct
import threading
import time

import numpy as np

from tableclient.errors import AuthError, ConnectError, GatherTimeout, TableClientError, TransportError
from tableclient.transports.base import (
    DEFAULT_OPTIONS,
    ClientTransport,
    Pending,
    remote_error,
)
from tableserver.common.buffers import copy_buffer
from tableserver.common.seal import C2S, S2C, TAG_BYTES, BadTag, Direction, derive_key
from tableserver.common.wire import (
    HEADER,
    HEADER_BYTES,
    HELLO_SEALED,
    MAC_BYTES,
    MAX_HANDSHAKE_MESSAGE,
    RESPONSE_MAGIC,
    FrameType,
    Refused,
    Status,
    hello_frame,
    recv_challenge,
    recv_exact,
    request_header,
    send_all,
    server_proof,
)

log = logging.getLogger(__name__)


#: how long cancelling a response that is being received waits for its last bytes before the
#: connection is broken instead (a server stuck mid-response must not write into the buffer later)
CANCEL_GRACE_S = 1.0
_BROKEN = (OSError, ValueError, BadTag)
_TIMEVAL = struct.Struct("@ll")  # struct timeval for SO_RCVTIMEO
#: mid-response, a blocking recv waits at most this long before the reader checks its deadline again
#: (a signal restarts a recv with its full SO_RCVTIMEO: only a handler firing more often than this,
#: while the server stalls mid-response, could stretch a wait past its deadline)
RECV_SLICE_S = 0.25
#: the least time a request has to be taken by the server's socket: each request is sent within the
#: connect_timeout the transport was opened with (what the session's open had left of it), at least this
MIN_SEND_TIMEOUT_S = 1.0
#: a request sent on a connection quiet this long (nothing in flight, nothing sent or received) may find
#: it closed by the server's --idle-timeout (0.01 s at least, measured from the server's last answer): it
#: keeps a copy of its ids, to be re-sent on a fresh connection if that one turns out closed before any
#: response began. Requests sent back to back (a step's burst, a busy pipeline) keep none
QUIET_S = 0.001
#: what a connection the peer closed looks like on its next use: EOF (raised as a reset), reset, broken pipe
_CLOSED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _connect(address: tuple, deadline: float) -> socket.socket:
    """A connected socket to the first address of ``address`` that answers, all by ``deadline``
    (socket.create_connection gives each address the whole timeout)."""
    last: OSError = TimeoutError("the connect deadline passed")
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise last


class _TcpPending(Pending):
    __slots__ = ("out", "request_id", "receiving", "transport", "sync", "again")

    def __init__(self, out: np.ndarray, request_id: int, transport, sync: bool):
        super().__init__()
        self.out = out
        self.request_id = request_id
        self.receiving = False  # a reader is writing this response into ``out``
        self.transport = transport
        self.sync = sync  # read by the waiting caller's thread, not the receiver thread
        #: (table index, a copy of the ids) of a request sent on a quiet connection: what re-sending it takes
        self.again: tuple[int, np.ndarray] | None = None

    def wait(self, timeout: float | None = None) -> None:
        if self.sync and not self._event.is_set():
            self.transport.read_for(self, timeout)
            error = self.transport.error
            if not self._event.is_set() and error is not None:  # broken meanwhile: its failure completes us
                if not self._event.wait(CANCEL_GRACE_S):
                    raise error
            if not self._event.is_set() and timeout is not None:
                raise GatherTimeout(f"gather not complete after {timeout:.6f} s")
        super().wait(timeout)

    def cancel(self) -> None:
        # With the reader's order (receiving = True, then check cancelled) one of the two sides
        # always sees the other: either the rows go to scratch, or we wait for them to be in.
        self.cancelled = True
        if self.receiving and not self._event.wait(CANCEL_GRACE_S):
            self.transport.abort("a cancelled response stalled mid-transfer")
            self._event.wait()


class _Reading:
    """The response being read, resumable by whichever reader comes next."""

    __slots__ = ("head", "view", "got", "p", "status", "dest", "sealed")

    def __init__(self):
        self.head = bytearray(HEADER_BYTES)
        self.sealed = b""
        self.header()

    def header(self) -> None:
        self.view, self.got, self.p, self.status, self.dest = memoryview(self.head), 0, None, 0, None


class TcpTransport(ClientTransport):
    name = "tcp"
    dedups = True
    #: where dedup starts to pay over loopback: below it the hashing costs more than the repeated rows
    #: it saves (bench/bench_transports.py's dedup section measures it; figures in docs/perf.md)
    dedup_min_ids = 4096

    def __init__(self, offer, session, catalog, connect_timeout=10.0, options=DEFAULT_OPTIONS, prepared=None):
        self.busy_poll = max(0.0, float(options.busy_poll))
        #: how long one request may take to be sent: a server that reads none of it for that long has
        #: stopped reading (the connection is then broken, not waited on forever)
        self.send_timeout = max(float(connect_timeout), MIN_SEND_TIMEOUT_S)
        #: seconds a connection may sit unused before a request first checks that the server has not closed it
        self.idle_check = max(0.0, float(options.idle_check))
        #: connections re-opened because the server had closed the last one while it sat unused
        self.reopened = 0
        self._offer, self._session = offer, session  # what re-opening the connection takes
        self._scratch = copy_buffer(0)  # a sealed response as received (placed: no 4K aliasing)
        self._open(time.monotonic() + connect_timeout)  # connect and handshake, all of it
        self._last_io = time.perf_counter()  # the last request sent or response in (perf_counter, as completed_at)
        self._exposed = False  # a request went out on a quiet connection and no response has begun since
        self._ids = itertools.count(1)
        self._pending: collections.deque[_TcpPending] = collections.deque()
        self._send_lock = threading.Lock()
        self._rx_lock = threading.Lock()  # held by the one thread reading responses
        self._reading = _Reading()
        self._wake = threading.Condition(threading.Lock())
        self._async = 0  # asynchronous requests not completed yet: the receiver thread reads while > 0
        self._error: BaseException | None = None
        self._closed = False
        self._rx = threading.Thread(target=self._receive_loop, name="tableclient-tcp-rx", daemon=True)
        self._rx.start()

    def _open(self, deadline: float) -> None:
        """Dials the offer and authenticates, by ``deadline``: the connection becomes ``_sock``."""
        self._sock = self._dial(self._offer, deadline)
        self._seal_tx = self._seal_rx = None  # seal.Direction each way when the server seals this connection
        self._hello(self._session.id, self._session.secret, deadline)
        self._sock.settimeout(None)
        self._rcvtimeo = -1.0  # SO_RCVTIMEO as last set (seconds, 0 = none)
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)

    def _dial(self, offer, deadline: float) -> socket.socket:
        """The connected socket of ``offer`` (a tcp endpoint here), by ``deadline``; sets ``endpoint``."""
        ep = offer.tcp
        self.endpoint = f"{ep.host}:{ep.port}"
        if not ep.host or len(ep.host) > 255 or not 0 < ep.port < 65536:
            raise ConnectError(f"tcp offer {ep.host[:64]!r}:{ep.port}: not an address (not a tableserver?)")
        try:
            sock = _connect((ep.host, ep.port), deadline)
        except OSError as e:
            raise ConnectError(
                f"cannot connect to the tcp data port {self.endpoint}: {e.strerror or e}: "
                "check that the server's --tcp-listen/--tcp-advertise address is reachable"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _hello(self, session_id: bytes, secret: bytes, deadline: float) -> None:
        """Challenge-response: the secret never crosses the wire, and the server proves it holds it too.
        All of it by ``deadline``, however the server paces its bytes; its reply is read only up to the
        size a tableserver sends (the proof, or a short refusal)."""
        status, msg, flags = Status.OK, b"", 0
        try:
            nonce = recv_challenge(self._sock, deadline)
            frame, client_nonce = hello_frame(session_id, secret, nonce)
            send_all(self._sock, [frame], deadline)
            head = bytearray(HEADER_BYTES)
            if not recv_exact(self._sock, memoryview(head), deadline):
                raise ConnectionResetError("server closed the connection")
            magic, _t, status, _rid, flags, count = HEADER.unpack(head)
            if magic != RESPONSE_MAGIC or count > (MAC_BYTES if status == Status.OK else MAX_HANDSHAKE_MESSAGE):
                raise ValueError(f"not a tableserver response (a HELLO reply of {count} bytes)")
            msg = bytearray(count)
            if count and not recv_exact(self._sock, memoryview(msg), deadline):
                raise ConnectionResetError("server closed the connection before its HELLO reply")
        except Refused as e:
            self._sock.close()
            raise ConnectError(f"tcp data port {self.endpoint} refused the connection: {e.describe()}") from None
        except TimeoutError:
            self._sock.close()
            raise ConnectError(
                f"tcp handshake with {self.endpoint} did not complete within the connect deadline "
                "(connect_timeout): the server is overloaded or not a tableserver"
            ) from None
        except (OSError, ValueError) as e:
            self._sock.close()
            raise ConnectError(f"tcp handshake with {self.endpoint} failed: {e}") from None
        if status != Status.OK:
            self._sock.close()
            refused = Refused.from_wire(status, msg)
            if refused.status == Status.UNAUTHENTICATED:
                raise AuthError(f"tcp data port {self.endpoint} refused the session: {refused.message}")
            raise ConnectError(f"tcp handshake with {self.endpoint} failed: {refused.message}")
        if not hmac.compare_digest(bytes(msg), server_proof(secret, session_id, nonce, client_nonce)):
            self._sock.close()
            raise AuthError(
                f"tcp data port {self.endpoint} could not prove it holds the session secret: "
                "not the server that opened this session"
            )
        if flags & HELLO_SEALED:  # every payload from here on is AES-GCM sealed (tableserver/common/seal.py)
            self._seal_tx = Direction(derive_key(secret, C2S, nonce, client_nonce))
            self._seal_rx = Direction(derive_key(secret, S2C, nonce, client_nonce))

    @property
    def sealed(self) -> bool:
        """Whether the server seals this connection's payloads (AES-GCM, its control plane is TLS)."""
        return self._seal_rx is not None

    @property
    def error(self) -> BaseException | None:
        """Why the connection broke, once it has (every request then fails with it)."""
        return self._error

    def peer_closed(self) -> bool:
        """Whether the server has closed this connection: its FIN (or reset) is here with no response
        before it. A look that reads nothing (one non-blocking peek); the next request re-opens it."""
        try:
            return not self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # reset, or this transport closed
            return True

    def fileno(self) -> int:
        """The descriptor of the connection now (a re-opened one has another), to wait until a response is
        here to read (``select``/``poll`` take the transport itself); reading or writing it is the transport's
        alone."""
        return self._sock.fileno()

    def gather(self, table_index, ids, out, sync=False, mode="read", expand=None, hedge_after=None) -> Pending:
        now = time.perf_counter()
        if not self._pending and now - self._last_io >= self.idle_check:  # a hint, looked at unlocked
            self._check_idle()
            now = time.perf_counter()
        with self._send_lock:
            if self._error is not None:
                raise self._error
            if not self._pending and now - self._last_io >= QUIET_S:
                self._exposed = True  # the server may have closed it meanwhile: keep what re-sending takes
            # Synchronous until handed over: another thread's read may complete it before the hand-over,
            # which must then count nothing (the receiver counts exactly the async requests not done)
            p = _TcpPending(out, next(self._ids), self, True)
            if self._exposed:
                p.again = (table_index, np.array(ids, np.int64))  # a copy: the caller's ids may change
            self._pending.append(p)  # before sending: a reader may see the answer at once
            self._last_io = now
            sent = 0  # > 0 once (part of) the frame may be on the wire
            try:
                header, payload, size = self._frame(p.request_id, table_index, ids)
                try:  # never blocking: a server that stops reading must not hold this thread
                    sent = self._sock.sendmsg([header, payload], [], socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent < len(header) + size:  # the socket was full: the rest as room frees, by the deadline
                    rest = memoryview(header + memoryview(payload).cast("B").tobytes())[sent:]
                    sent = max(sent, 1)
                    send_all(self._sock, [rest], time.monotonic() + self.send_timeout)
            except TimeoutError:
                self._fail(
                    TransportError(
                        f"tcp connection to {self.endpoint} closed: the server did not take a "
                        f"{len(header) + size}-byte request within {self.send_timeout:.1f} s (it stopped reading "
                        "its data port): check the server, or raise connect_timeout if it is only slow"
                    )
                )
                self.abort("the server stopped reading requests")
                raise self._error from None
            except _CLOSED as e:
                if not self._exposed:
                    self._fail(TransportError(f"tcp connection to {self.endpoint} broke while sending: {e}"))
                    raise self._error from None
                # closed by the server while it sat unused: the reader finds it so, re-opens it and re-sends
                log.debug("tcp connection to %s closed under a request (%s): re-sent once re-opened", self.endpoint, e)
            except OSError as e:
                self._fail(TransportError(f"tcp connection to {self.endpoint} broke while sending: {e}"))
                raise self._error from None
            except BaseException:
                if sent:  # (part of) a frame is on the wire: the connection cannot be used any more
                    self._fail(TransportError(f"tcp connection to {self.endpoint} abandoned mid-request"))
                elif self._pending and self._pending[-1] is p:  # refused before a byte went out
                    self._pending.pop()
                raise
        if not sync:
            self._hand_over(p)
        return p

    def _frame(self, request_id: int, table_index: int, ids: np.ndarray) -> tuple:
        """One GATHER request: (header, payload, payload bytes), the payload sealed when the connection is."""
        header = request_header(FrameType.GATHER, request_id, table_index, ids.size)
        if self._seal_tx is None:
            return header, ids, ids.nbytes
        payload = self._seal_tx.seal(header, memoryview(ids).cast("B"))
        return header, payload, len(payload)

    # -- a connection the server closed while it sat unused
    def _check_idle(self) -> None:
        """Before the first request after ``idle_check`` seconds without one: re-opens the connection now
        if the server has closed it meanwhile (its idle timeout), so no request is sent into it."""
        if not self.peer_closed():
            return
        with self._rx_lock, self._send_lock:
            if self._pending or self._closed or self._error is not None or not self.peer_closed():
                return  # used meanwhile (a request sent into it is re-sent), or re-opened already
            self._reopen("was closed by the server while idle")

    def _lost(self, e: BaseException) -> None:
        """A reader found the connection broken (it holds the reader's lock). Closed by the peer before any
        byte of a response came back, after requests were sent on a quiet connection: the server closed
        it while idle, and the connection is re-opened and those requests re-sent, once. Otherwise (or
        when re-opening fails) the transport is broken and every pending request fails."""
        r = self._reading
        if isinstance(e, _CLOSED) and self._exposed and r.p is None and r.got == 0 and not self._closed:
            with self._send_lock:
                if (
                    self._exposed
                    and self._error is None
                    and self._pending
                    and all(p.again is not None for p in self._pending)
                ):
                    self._reopen(f"was closed by the server while idle ({e})")
                    return
        self._broken(e)

    def _reopen(self, why: str) -> bool:
        """Replaces the connection, which the server closed while it sat unused, with a fresh one (dialed
        and authenticated within send_timeout), then re-sends the pending requests in order, each under
        a new request id (nothing of the old connection can answer them). The caller holds the reader's
        and the send lock. False when that fails too: the transport is then broken, as by any failure."""
        old = self._sock
        try:
            old.close()
        except OSError:
            pass
        n = len(self._pending)
        try:
            if self._closed:
                raise ConnectError("the transport was closed")
            deadline = time.monotonic() + self.send_timeout
            self._open(deadline)
            if self._closed:  # closed while it dialed: close() ends the new socket
                raise ConnectError("the transport was closed")
            self._reading.header()
            for p in self._pending:
                table_index, ids = p.again
                p.again, p.request_id = None, next(self._ids)
                header, payload, _ = self._frame(p.request_id, table_index, ids)
                send_all(self._sock, [header, payload], deadline)
        except (TableClientError, OSError) as e:
            self._fail(TransportError(f"tcp connection to {self.endpoint} {why}, and re-opening it failed: {e}"))
            return False
        self._exposed = False  # once: a fresh connection that fails too is a failure
        self._last_io = time.perf_counter()
        self.reopened += 1
        log.debug("tcp connection to %s %s: re-opened, %d request(s) re-sent", self.endpoint, why, n)
        return True

    # -- reading: one reader at a time, in request order
    def _hand_over(self, p: _TcpPending) -> None:
        """Makes ``p`` the receiver thread's to read (an asynchronous request, or a timed-out sync one)."""
        with self._wake:
            p.sync = False
            if not p.done():
                self._async += 1
                self._wake.notify()

    def read_for(self, p: _TcpPending, timeout: float | None) -> None:
        """The caller's thread reads responses until ``p``'s is in (or ``timeout`` passes: then the
        receiver thread takes ``p`` over and the caller's wait times out)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not p.done() and self._error is None:
            if not self._rx_lock.acquire(timeout=-1 if deadline is None else max(deadline - time.monotonic(), 0)):
                break
            try:
                while not p.done() and self._error is None:
                    if not self._read_one(deadline):
                        break
            except _BROKEN as e:
                self._lost(e)
            finally:
                self._rx_lock.release()
            if deadline is not None and time.monotonic() >= deadline:
                break
        if not p.done():
            self._hand_over(p)

    def _receive_loop(self) -> None:
        while True:
            with self._wake:
                while self._async <= 0 and not self._closed and self._error is None:
                    self._wake.wait()
                if self._closed or self._error is not None:
                    return
            with self._rx_lock:
                try:
                    while self._async > 0 and self._error is None:
                        self._read_one(None)
                except _BROKEN as e:
                    self._lost(e)

    def _timeout(self, seconds: float | None) -> None:
        """Bounds how long the next blocking ``recv`` sleeps (SO_RCVTIMEO; None: no bound). The bound
        already set is kept while it lies within ``seconds`` + 1 ms and above half of it, so gathers
        that share a timeout set it once. The kernel rounds it up to a scheduler tick."""
        current = self._rcvtimeo
        if seconds is None:
            if current == 0.0:
                return
            seconds = 0.0  # SO_RCVTIMEO 0: none
        else:
            if 0.0 < current and seconds * 0.5 <= current <= seconds + 0.001:
                return
            seconds = max(seconds, 1e-6)
        whole = int(seconds)
        micros = int((seconds - whole) * 1e6)
        if seconds and not whole and not micros:
            micros = 1  # a zero timeval would mean no bound at all
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(whole, micros))
        self._rcvtimeo = seconds

    def _read_one(self, deadline: float | None) -> bool:
        """Reads (the rest of) one response and completes its request; False if ``deadline`` passed first
        (what was read is kept: the next reader resumes there; bytes already here are always taken).

        Waiting for a response to begin is a ``poll`` to the deadline (to the millisecond, and a signal
        does not restart it), then a non-blocking ``recv``. Once it has begun, the rest of each part
        (header, body) is one blocking ``recv`` with MSG_WAITALL straight into its buffer, in slices of
        at most RECV_SLICE_S (SO_RCVTIMEO): the rows are flowing, and the thread sleeps in the kernel
        until the part is in, with no Python between the packets of a large response. With
        ``busy_poll`` the reader first polls with non-blocking ``recv``s, the whole response included,
        for up to ``busy_poll`` in all: rows that arrive within it wake no thread at all."""
        r, sock = self._reading, self._sock
        spin_until = time.monotonic() + self.busy_poll if self.busy_poll else 0.0
        while True:
            view = r.view
            while r.got < len(view):
                if spin_until:
                    now = time.monotonic()
                    if now >= spin_until or (deadline is not None and now >= deadline):
                        spin_until = 0.0  # spun long enough: sleep in the kernel from here
                        continue
                    try:
                        n = sock.recv_into(view[r.got :], 0, socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        continue
                elif deadline is None:
                    self._timeout(None)
                    n = sock.recv_into(view[r.got :], 0, socket.MSG_WAITALL)
                else:
                    left = deadline - time.monotonic()
                    if left > 0 and (r.got or r.p is not None):  # mid-response
                        self._timeout(min(left, RECV_SLICE_S))
                        flags = socket.MSG_WAITALL
                    else:  # before the response begins, or no time left: poll, then take what is here
                        if not self._poller.poll(math.ceil(left * 1000) if left > 0 else 0):
                            if time.monotonic() >= deadline:
                                return False
                            continue
                        flags = socket.MSG_DONTWAIT
                    try:
                        n = sock.recv_into(view[r.got :], 0, flags)
                    except (BlockingIOError, InterruptedError):  # the slice passed with nothing read
                        if left <= 0:
                            return False
                        continue
                if n == 0:
                    if r.p is None and r.got == 0:
                        raise ConnectionResetError("server closed the connection")
                    raise ConnectionResetError(f"connection closed mid-frame ({r.got} of {len(view)} bytes)")
                r.got += n
            if r.p is None:
                self._begin_body(r)
                if len(r.view):
                    continue
            self._end_body(r)
            return True

    def _begin_body(self, r: _Reading) -> None:
        """A response header is in: match it to the next request and aim the payload at its buffer."""
        magic, _t, status, req_id, row_bytes, count = HEADER.unpack(r.head)
        if magic != RESPONSE_MAGIC:
            raise ConnectionError(f"bad response magic {magic!r}")
        p = self._pending[0] if self._pending else None
        if p is None or p.request_id != req_id:  # left in line: the connection's failure completes it
            raise ConnectionError(f"response to request {req_id} that is not next in line")
        self._exposed = False  # the server answers on this connection: a close from here on is a failure
        self._pending.popleft()
        p.again = None
        r.p, r.status = p, status
        if status == Status.OK:
            p.receiving = True
            dest = p.out if not p.cancelled else np.empty(p.out.nbytes, np.uint8)
            if count * row_bytes != dest.nbytes:
                raise ConnectionError(f"response of {count}x{row_bytes} bytes for a {dest.nbytes}-byte buffer")
            r.dest = memoryview(dest).cast("B")
        else:
            if count > 65536:
                raise ConnectionError(f"error message of {count} bytes")
            r.dest = memoryview(bytearray(count))
        if self._seal_rx is None:
            r.view = r.dest
        else:  # ciphertext + tag land aside, then are opened into the destination
            r.sealed = bytes(r.head)
            n = len(r.dest) + TAG_BYTES
            if len(self._scratch) < n:
                self._scratch = copy_buffer(n)
            r.view = memoryview(self._scratch)[:n]
        r.got = 0

    def _end_body(self, r: _Reading) -> None:
        p, status, dest = r.p, r.status, r.dest
        if self._seal_rx is not None:
            n = len(dest)
            self._seal_rx.open_into(r.sealed, r.view[:n], r.view[n:], dest)
        r.header()
        refused = Refused.from_wire(status, dest) if status != Status.OK else None
        error = remote_error(refused) if refused is not None else None
        with self._wake:  # atomic with _hand_over: a request is counted as asynchronous exactly until done
            if not p.sync:
                self._async -= 1
            p.complete(error)
        self._last_io = p.completed_at
        if refused is not None and refused.fatal:
            raise ConnectionError(f"server closed the connection after {refused.name}")

    def _broken(self, e: BaseException) -> None:
        error = TransportError(f"tcp connection to {self.endpoint} lost: {e}")
        p = self._reading.p
        if p is not None and not p.done():
            p.complete(error)
        self._fail(error)

    def abort(self, why: str) -> None:
        """Breaks the connection: the reader stops at once and fails what is pending."""
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
        with self._wake:
            self._async = 0
            self._wake.notify_all()

    def detach(self) -> tuple[socket.socket, bool]:
        """Hands the authenticated connection over, unused, to a reader of its own (a GraphStep's native
        poller speaks the wire protocol on it): the socket and whether its payloads are sealed. Only
        before any request was sent; this transport is closed after it (the socket stays open)."""
        with self._send_lock:
            if self._closed or self._error is not None or self._pending:
                raise TransportError(f"tcp connection to {self.endpoint}: in use, not handed over")
            self._closed = True
        with self._wake:
            self._wake.notify_all()
        self._rx.join(timeout=5)
        sock, self._sock = self._sock, socket.socket()  # close() below closes a placeholder
        self._fail(TransportError("transport handed over"))
        return sock, self._seal_tx is not None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._wake:
            self._wake.notify_all()
        self._rx.join(timeout=5)
        with self._rx_lock:  # a caller reading sees the shutdown and stops
            pass
        self._sock.close()
        self._fail(TransportError("transport closed"))
