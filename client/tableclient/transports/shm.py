"""shm transport, client side: map the server's tables read-only and gather locally.

Offered only when the server runs on this host (same boot id) and its Unix
socket is reachable from this process's mount namespace; otherwise it raises
:class:`TransportUnavailable` and ``transport="auto"`` moves on to tcp.
A gather is a bounds-safe ``np.take`` from the mapping into the caller's
buffer: no server round trip, no dedup needed. A synchronous ``gather``
copies inline. ``gather_async`` queues the copy and returns; a worker thread runs queued copies in order, and ``wait`` runs its own
copy inline if the worker has not started it yet. So with
``gather_many([layer1, layer14])`` the caller copies layer 1 the moment it
waits for it while the worker copies layer 14 alongside (``np.take`` releases
the GIL): the first layer never waits behind the others.

A disk table (the server reads it from its file per gather: no memory to map)
comes in the table list with ``"tier": "disk"`` and no descriptor; its gathers
go over the endpoint's rows socket, a Unix stream socket speaking tcp's
protocol (:class:`RowsSocket`, a :class:`~tableclient.transports.tcp.TcpTransport`
that dials a path instead of a port).

A server with ``--idle-timeout`` closes both connections once unused that long.
The handshake's connection is never used again (the mappings outlive it); the
rows socket is re-opened like tcp's connection (tcp.py): a gather after an idle
gap never fails for it.
"""

from __future__ import annotations

import collections
import fcntl
import hmac
import json
import mmap
import os
import socket
import threading
import time

import numpy as np

from tableclient.errors import AuthError, ConnectError, TransportUnavailable
from tableclient.transports.base import DEFAULT_OPTIONS, DONE, ClientTransport, Pending
from tableclient.transports.tcp import TcpTransport
from tableserver.common.host import host_id as local_host_id
from tableserver.common.take import take_checked
from tableserver.common.wire import (
    HEADER,
    HEADER_BYTES,
    RESPONSE_MAGIC,
    Refused,
    Status,
    hello_frame,
    parse_challenge,
    server_proof,
)

#: the largest handshake reply read (~100 bytes a table; one message carries at most 253 descriptors)
MAX_REPLY_BYTES = 1 << 20
#: a table's mapping may exceed its rows by at most this (the server rounds memory up to its page size,
#: 1 GiB at most): a sparse, huge memfd is never mapped (and populated)
MAX_MAPPING_SLACK = 1 << 30
#: what the server seals every table memfd with (tableserver/transports/shm.py checks it at start):
#: without SHRINK a server could truncate the file under the mapping and kill this process with SIGBUS
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _table_entries(reply, catalog, path: str) -> list:
    """[(TableInfo, mapping size)] of the reply's table list, each matching the catalog (size None for a
    disk table: nothing to map); ConnectError for anything else."""
    by_index = {t.index: t for t in catalog}
    out, seen = [], set()
    doc = reply.get("tables") if isinstance(reply, dict) else None
    if not isinstance(doc, list) or len(doc) != len(catalog):
        raise ConnectError(f"shm handshake on {path}: a table list no tableserver sends")
    for entry in doc:
        fields = [entry.get(k) if isinstance(entry, dict) else None for k in ("index", "rows", "row_bytes", "size")]
        if not all(type(v) is int for v in fields):
            raise ConnectError(f"shm handshake on {path}: a table entry no tableserver sends")
        index, rows, row_bytes, size = fields
        info = by_index.get(index)
        disk = entry.get("tier") == "disk"
        if (
            info is None
            or index in seen
            or (info.rows, info.row_bytes) != (rows, row_bytes)
            or disk != (info.tier == "disk")
            or not (disk or info.rows * info.row_bytes <= size <= info.rows * info.row_bytes + MAX_MAPPING_SLACK)
        ):
            raise ConnectError(f"shm table {str(entry.get('name'))[:64]!r} (index {index}) does not match the catalog")
        seen.add(index)
        out.append((info, None if disk else size))
    return out


class RowsSocket(TcpTransport):
    """Gathers of the server's disk tables over its shm endpoint's rows socket (tcp's protocol on a
    Unix stream socket: same host, no network stack)."""

    name = "shm"

    def _dial(self, offer, deadline: float) -> socket.socket:
        path = offer.shm.rows_socket_path
        self.endpoint = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise ConnectError(
                f"cannot connect to the disk rows socket {path}: {e.strerror or e}: is the server still running?"
            ) from None
        return sock


def check_mappable(fd: int, size: int, name: str) -> None:
    """TransportUnavailable unless ``fd`` is a memfd sealed as the real server seals table memory
    (never shrinking, growing or written) and at least ``size`` bytes long: only then can its mapping
    never fault (SIGBUS) or change under a gather."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        length = os.fstat(fd).st_size
    except OSError as e:
        raise TransportUnavailable(f"table {name!r}: the descriptor sent is no sealed memfd ({e.strerror})") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise TransportUnavailable(
            f"table {name!r}: memory not sealed against shrinking and writes (seals {seals:#x}): not mapped"
        )
    if length < size:
        raise TransportUnavailable(f"table {name!r}: {length} bytes sent for {size}: not mapped")


class _Copy(Pending):
    """One queued copy; whoever claims it first (worker or waiter) runs it."""

    __slots__ = ("_args", "_claim")

    def __init__(self, args):
        super().__init__()
        self._args = args
        self._claim = threading.Lock()

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # already running or done elsewhere
        try:
            if not self.cancelled:
                src, ids, out = self._args
                take_checked(src, ids, out)  # checked by the caller; ValueError if the ids changed since
            self._args = None
            self.complete()
        except BaseException as e:  # surfaces in wait()
            self.complete(e)

    def wait(self, timeout: float | None = None) -> None:
        self.run()
        super().wait(timeout)

    def cancel(self) -> None:
        self.cancelled = True
        if self._claim.acquire(blocking=False):  # nobody started it: it never will
            self._args = None
            self.complete()
        else:
            self._event.wait()  # a copy in progress (a local memcpy): let it finish before returning


class ShmTransport(ClientTransport):
    name = "shm"
    dedups = False

    def __init__(self, offer, session, catalog, connect_timeout=10.0, options=DEFAULT_OPTIONS, prepared=None):
        self.populate = options.populate
        ep = offer.shm
        if ep.host_id != local_host_id():
            raise TransportUnavailable("the server runs on another host")
        self.path = ep.socket_path
        self._deadline = time.monotonic() + connect_timeout  # connect and handshake, all of it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise TransportUnavailable(f"shm socket {self.path} not reachable ({e.strerror})") from None
        self._sock = sock
        self._maps: list[mmap.mmap] = []
        self._tables: dict[int, np.ndarray] = {}
        self._rows: RowsSocket | None = None  # the disk tables' gathers, when the server has any
        self._disk: set[int] = set()
        self._queue: collections.deque[_Copy] = collections.deque()
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self._closed = False
        try:
            self._handshake(session, catalog)
            if self._disk:
                if not ep.rows_socket_path:
                    raise ConnectError(f"shm socket {self.path}: disk tables but no rows socket (not a tableserver?)")
                left = max(self._deadline - time.monotonic(), 0.001)
                self._rows = RowsSocket(offer, session, catalog, left, options)
        except BaseException:
            self.close()
            raise
        sock.settimeout(None)

    def _left(self) -> float:
        """Arms the socket with what is left of the handshake's deadline (socket.timeout once passed)."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake's deadline passed")
        self._sock.settimeout(left)
        return left

    def _handshake(self, session, catalog) -> None:
        try:
            self._left()
            nonce = parse_challenge(self._sock.recv(4096))
            frame, client_nonce = hello_frame(session.id, session.secret, nonce, request_id=1)
            self._left()
            self._sock.send(frame)
            self._left()
            msg, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_REPLY_BYTES, len(catalog) + 16)
        except Refused as e:
            raise ConnectError(f"shm socket {self.path} refused the connection: {e.describe()}") from None
        except TimeoutError:
            raise ConnectError(
                f"shm handshake on {self.path} did not complete within the connect deadline (connect_timeout)"
            ) from None
        except ValueError as e:
            raise ConnectError(f"shm handshake on {self.path} failed: {e}") from None
        except OSError as e:
            raise ConnectError(f"shm handshake on {self.path} failed: {e.strerror or e}") from None
        try:
            if len(msg) < HEADER_BYTES:
                raise ConnectError(f"shm handshake on {self.path} failed: server closed the connection")
            magic, _t, status, _rid, _rb, count = HEADER.unpack_from(msg)
            body = msg[HEADER_BYTES : HEADER_BYTES + count]
            if magic != RESPONSE_MAGIC or status != Status.OK:
                refused = Refused(status, body.decode(errors="replace")[:1024])
                if refused.status == Status.UNAUTHENTICATED:
                    raise AuthError(f"shm socket {self.path} refused the session: {refused.message}")
                raise ConnectError(f"shm handshake on {self.path} failed: {refused.message}")
            try:
                reply = json.loads(body)
                proof_hex = reply["proof"]
                ok = isinstance(proof_hex, str) and hmac.compare_digest(
                    bytes.fromhex(proof_hex), server_proof(session.secret, session.id, nonce, client_nonce)
                )
            except (ValueError, TypeError, KeyError, RecursionError):
                raise ConnectError(f"shm handshake on {self.path}: a reply no tableserver sends") from None
            if not ok:
                raise AuthError(
                    f"shm socket {self.path} could not prove it holds the session secret: not the "
                    "server that opened this session"
                )
            entries = _table_entries(reply, catalog, self.path)
            self._disk = {info.index for info, size in entries if size is None}
            entries = [(info, size) for info, size in entries if size is not None]
            if len(fds) != len(entries):
                raise ConnectError(f"shm handshake on {self.path}: {len(entries)} tables but {len(fds)} descriptors")
            for (info, size), fd in zip(entries, fds):
                check_mappable(fd, size, info.name)  # sealed, and as large as it says: nothing to SIGBUS us
                # MAP_POPULATE builds this process's page tables now, so no gather
                # pays a first-touch fault (hugepage-backed tables make this cheap).
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self.populate else 0)
                mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
                self._maps.append(mm)
                nbytes = info.rows * info.row_bytes
                self._tables[info.index] = np.frombuffer(mm, np.uint8, count=nbytes).reshape(info.rows, info.row_bytes)
        finally:
            for fd in fds:
                os.close(fd)

    def local_table(self, table_index: int):
        return self._tables.get(table_index)

    @property
    def rows_port(self) -> RowsSocket | None:
        """The connection to the server's rows socket that serves this session's disk tables (a
        TcpTransport); None when the server serves none."""
        return self._rows

    def gather(self, table_index, ids, out, sync=False, mode="read", expand=None, hedge_after=None) -> Pending:
        if table_index in self._disk:
            return self._rows.gather(table_index, ids, out, sync)
        if sync:  # the caller waits at once: a thread handoff would only add latency
            take_checked(self._tables[table_index], ids, out)  # checked by the caller; again here
            return DONE
        return self.take_async(self._tables[table_index], ids, out)

    def take_async(self, rows: np.ndarray, ids: np.ndarray, out: np.ndarray) -> Pending:
        """``rows.take(ids, out=out)`` on the copy thread, or by the first ``wait`` if that comes first.
        ``rows`` is a view of one of this transport's mappings (it keeps the mapping alive, so a
        transport closed meanwhile still serves it: the copy then runs at the wait)."""
        job = _Copy((rows, ids, out))
        with self._ready:
            if self._closed:
                return job  # no copy thread any more: wait() runs it
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="tableclient-shm", daemon=True)
                self._worker.start()
            self._queue.append(job)
            self._ready.notify()
        return job

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            job.run()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            pending, self._queue = list(self._queue), collections.deque()
            self._ready.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=5)
        for job in pending:
            job.run()  # finish queued copies: their callers own the buffers and may be waiting
        self._tables.clear()  # drop the views first so the mappings can close
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()
        if self._rows is not None:
            self._rows.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
