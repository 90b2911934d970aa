"""One connection layer for the socket data transports (tcp and shm).

A fixed pool of worker threads waits on one epoll set. Every socket, the
listener included, is registered ``EPOLLONESHOT``: each readiness event goes to
exactly one worker, which handles it without blocking (accepts a batch, reads
what has arrived, answers complete requests, sends what the socket takes) and
re-arms it. No thread belongs to a connection: an idle connection costs one fd
and its small state, and no thread is started after :meth:`ConnectionLoop.start`
(a pids limit reached later cannot stop serving).

Every limit is written here once, for every transport:

* **handshake deadline**: a connection that has not authenticated within
  ``handshake_timeout`` is closed. When ``max_handshakes`` are pending, the
  oldest is evicted to admit a new one: a flood of idle connections churns
  itself out while a real client, which answers the challenge in
  microseconds, gets in.
* **idle timeout** (off by default: a session's lease already bounds how long
  its connections live; it closes only a connection with no request in any
  stage: read, queued unread, served by a worker, parked on a disk read, or
  being sent) and a **send timeout**: a response not wholly sent
  within ``send_timeout`` of when its sending began drops the connection (a
  peer that reads a byte now and then cannot hold it and its buffers).
  A Protocol marks a response in flight with ``conn.send_since``.
* **connection caps**: ``max_connections`` in all (the default fits the fd
  limit), ``max_per_session`` per session.
* **accept errors** (EMFILE, ENFILE, ENOBUFS, ENOMEM, ...): back off 50 ms..1 s,
  evict the oldest pending handshake to free an fd, log once per interval; while
  accepts keep failing :meth:`ConnectionLoop.health` says so, and the daemon
  reports NOT_SERVING.

A :class:`Protocol` (one per transport) supplies the greeting sent on accept and
handles a ready connection; it returns what to wait for next, or ``PARK``: the
connection waits on something else (a disk read) and no worker gets it until
the protocol calls :meth:`ConnectionLoop.resume` (the fd stays disarmed, so
nothing it receives meanwhile wakes a worker). A protocol parks a connection
with :meth:`ConnectionLoop.park` before it hands the work on: while parked, the
housekeeper watches the socket for a hang-up (EPOLLRDHUP, EPOLLHUP, EPOLLERR on
an epoll set of its own) and, when the peer left, calls the protocol's
:meth:`Protocol.hangup` (which stops the work) and drops the connection: its
slot, its session's count and its buffers are freed at once, not when the work
ends. Whichever of ``resume`` and the hang-up comes first owns the connection.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import select
import socket
import stat
import threading
import time
from dataclasses import dataclass

from tableserver.common.wire import Refused, Status
from tableserver.config import option
from tableserver.errors import ListenError
from tableserver.logs import RateLimitedLog

log = logging.getLogger(__name__)

READ, WRITE, CLOSE, PARK = "read", "write", "close", "park"

#: accept errors that mean "out of a resource": back off instead of spinning
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
#: accept errors about one connection that is already gone: skip it
_TRANSIENT = {
    errno.ECONNABORTED,
    errno.EPROTO,
    errno.EPERM,
    errno.EINTR,
    errno.ENETDOWN,
    errno.ENOPROTOOPT,
    errno.EHOSTDOWN,
    errno.ENONET,
    errno.EHOSTUNREACH,
    errno.EOPNOTSUPP,
    errno.ENETUNREACH,
}
_ONESHOT = select.EPOLLONESHOT
_EVENTS = {READ: select.EPOLLIN | _ONESHOT, WRITE: select.EPOLLOUT | _ONESHOT}
#: what a parked connection is watched for: its peer gone
_HANGUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR


def default_max_connections(transports: int = 2) -> int:
    """Connections one transport may hold so all of them fit under RLIMIT_NOFILE (with room for tables,
    gRPC and metrics), within --max-connections' range."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, min(option("max_connections").hi, (soft - 128) // max(1, transports)))


@dataclass
class Limits:
    handshake_timeout: float = 5.0
    idle_timeout: float = 0.0  # 0: off
    send_timeout: float = 10.0
    max_connections: int = 0  # 0: default_max_connections()
    max_per_session: int = 8
    max_handshakes: int = 256

    def __post_init__(self):
        if not self.max_connections:
            self.max_connections = default_max_connections()
        self.max_handshakes = max(1, min(self.max_handshakes, self.max_connections))


class Connection:
    """One accepted socket and its protocol state (``state``, owned by the Protocol)."""

    __slots__ = (
        "sock", "fd", "peer", "session", "opened", "last_active", "state", "evicted", "send_since", "parked", "busy",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.session = None
        self.opened = self.last_active = time.monotonic()
        self.state = None
        self.evicted = False
        self.send_since = 0.0  # monotonic time the response being sent began sending (0: none)
        self.parked = False  # waiting on the protocol's work, watched for a hang-up (under the loop's lock)
        self.busy = False  # a worker has it (between its event and its re-arm): never idle meanwhile

    def shutdown(self) -> None:
        """Wakes whichever worker owns or will get this connection; it drops it (only a worker closes)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Protocol:
    """What one transport does with its connections. Methods run on worker threads, one at a time
    per connection, and must not block: sockets are non-blocking."""

    def greeting(self, conn: Connection) -> bytes:
        """Bytes sent on accept (the CHALLENGE)."""
        return b""

    def busy(self, message: str) -> bytes:
        """The frame that refuses a connection the layer has no room for."""
        return b""

    def ready(self, conn: Connection, events: int) -> str:
        """Handles a readiness event; returns READ, WRITE or CLOSE."""
        raise NotImplementedError

    def closed(self, conn: Connection) -> None:
        """The connection is gone (its state may be freed)."""

    def hangup(self, conn: Connection) -> None:
        """The peer of a parked connection left: stop the work it waits on (it is dropped next)."""


class ConnectionLoop:
    def __init__(
        self, name: str, listener: socket.socket, protocol: Protocol, limits: Limits, workers: int, metrics=None
    ):
        self.name = name
        self.listener = listener
        self.protocol = protocol
        self.limits = limits
        self.workers = max(1, workers)
        self.metrics = metrics
        listener.setblocking(False)
        self._listen_fd = listener.fileno()
        self._ep = select.epoll()
        self._park_ep = select.epoll()  # parked connections, watched for hang-ups by the housekeeper
        self._lock = threading.Lock()
        self._conns: dict[int, Connection] = {}
        self._handshakes: collections.OrderedDict[int, Connection] = collections.OrderedDict()
        self._by_session: dict[int, set[Connection]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._stop = threading.Event()
        self._accept_failing_since = 0.0  # monotonic time of the first failure in a row, 0 when accepting
        self._accept_resume = 0.0  # re-arm the listener at this time (0: armed)
        self._backoff = 0.0
        self._ratelog = RateLimitedLog(log)
        self.accepted = self.refused = self.evicted = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the workers and the housekeeper; raises RuntimeError when a thread cannot start."""
        self._ep.register(self._listen_fd, select.EPOLLIN | _ONESHOT)
        targets = [(self._work, f"tableserver-{self.name}-{i}") for i in range(self.workers)]
        targets.append((self._housekeep, f"tableserver-{self.name}-timers"))
        for target, tname in targets:
            t = threading.Thread(target=target, name=tname, daemon=True)
            try:
                t.start()
            except RuntimeError as e:
                self.close()
                raise RuntimeError(
                    f"cannot start the {self.name} worker threads ({e}): raise the pids/"
                    f"tasks limit (TasksMax, pids.max) or lower --data-threads"
                ) from None
            self._threads.append(t)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.shutdown()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self._handshakes.clear()
            self._by_session.clear()
        for c in conns:
            c.sock.close()
        self._ep.close()
        self._park_ep.close()

    # ------------------------------------------------------------------ sessions
    def attach(self, conn: Connection, session) -> None:
        """Marks ``conn`` authenticated for ``session``; Refused (wire.Refused, BUSY) past the per-session cap."""
        with self._lock:
            conns = self._by_session.setdefault(id(session), set())
            if len(conns) >= self.limits.max_per_session:
                raise Refused(
                    Status.BUSY,
                    f"this session already holds {len(conns)} {self.name} connections "
                    f"(the limit is {self.limits.max_per_session}): reuse them",
                )
            conns.add(conn)
            conn.session = session
            self._handshakes.pop(conn.fd, None)

    def release(self, session) -> None:
        """Drops every connection of ``session``."""
        with self._lock:
            conns = list(self._by_session.get(id(session), ()))
        for c in conns:
            c.shutdown()

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def active_sessions(self) -> int:
        with self._lock:
            return sum(1 for s in self._by_session.values() if s)

    def health(self) -> tuple[bool, str]:
        """(True, "") while this loop can serve; (False, why) when it cannot (read by the daemon's health)."""
        if self._closed:
            return False, f"{self.name} transport closed"
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead:
            return False, f"{self.name} worker {dead[0]} died"
        since = self._accept_failing_since
        if since and time.monotonic() - since > 2.0:
            return (
                False,
                f"{self.name} cannot accept connections for {time.monotonic() - since:.0f} s "
                f"({self._last_accept_error})",
            )
        return True, ""

    _last_accept_error = ""

    # ------------------------------------------------------------------ workers
    def _work(self) -> None:
        ep = self._ep
        while not self._stop.is_set():
            try:
                events = ep.poll(0.5, 1)
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return  # closed
            for fd, ev in events:
                try:
                    if fd == self._listen_fd:
                        self._accept()
                    else:
                        self._ready(fd, ev)
                except Exception:  # never lose a worker
                    self._ratelog.log(logging.ERROR, "worker", "%s: internal error in a worker (continuing)", self.name)
                    log.debug("worker error", exc_info=True)

    def _ready(self, fd: int, events: int) -> None:
        conn = self._conns.get(fd)
        if conn is None:
            return
        conn.busy = True  # until re-armed: a request being served is no idle connection
        try:
            want = self.protocol.ready(conn, events)
        except (OSError, ConnectionError):
            want = CLOSE
        except Exception:
            want = CLOSE
            if self.metrics is not None:
                self.metrics.error("internal")
            log.exception("%s %s: internal error; closing this connection", self.name, conn.peer)
        if want == PARK:  # the protocol resumes it; from here on another thread may own it
            return
        self._rearm(conn, want)

    def park(self, conn: Connection) -> None:
        """Marks ``conn`` parked (its protocol returns PARK next) and watches it for a hang-up; call it
        before handing the work on, so that a resume from the work always finds it parked."""
        with self._lock:
            if self._conns.get(conn.fd) is not conn or conn.parked:
                return
            conn.parked = True
            try:
                self._park_ep.register(conn.fd, _HANGUP)
            except (OSError, ValueError):
                pass  # the loop is closing: resume or close drops it

    def _unpark_locked(self, conn: Connection) -> bool:
        """Takes ``conn`` out of the parked state (True), or says another thread took it (False)."""
        if not conn.parked:
            return False
        conn.parked = False
        try:
            self._park_ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        return True

    def resume(self, conn: Connection, want: str) -> None:
        """Re-arms a parked connection for ``want`` (READ, WRITE or CLOSE), from any thread. A connection
        dropped meanwhile (its peer hung up, or the loop closed) is left alone."""
        with self._lock:
            if self._conns.get(conn.fd) is not conn or not self._unpark_locked(conn):
                return
        self._rearm(conn, want)

    def _hung_up(self, fd: int) -> None:
        """The housekeeper saw parked ``fd``'s peer leave: the protocol stops its work, the connection goes."""
        with self._lock:
            conn = self._conns.get(fd)
            if conn is None or not self._unpark_locked(conn):
                return
        if self.metrics is not None:
            self.metrics.error("disconnect")  # a peer that left mid-request
        try:
            self.protocol.hangup(conn)
        except Exception:
            log.exception("%s %s: stopping a parked connection's work", self.name, conn.peer)
        self._drop(conn)

    def _rearm(self, conn: Connection, want: str) -> None:
        if want == CLOSE or self._closed:
            self._drop(conn)
            return
        conn.last_active = time.monotonic()
        conn.busy = False
        try:
            self._ep.modify(conn.fd, _EVENTS[want])
        except (OSError, ValueError):
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        with self._lock:
            if self._conns.pop(conn.fd, None) is None:
                return
            self._unpark_locked(conn)
            self._handshakes.pop(conn.fd, None)
            if conn.session is not None:
                group = self._by_session.get(id(conn.session))
                if group is not None:
                    group.discard(conn)
                    if not group:
                        del self._by_session[id(conn.session)]
        try:
            self._ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        conn.sock.close()
        try:
            self.protocol.closed(conn)
        except Exception:
            log.exception("%s: releasing a connection", self.name)

    # ------------------------------------------------------------------ accepting
    def _accept(self) -> None:
        for i in range(64):
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in _TRANSIENT:
                    continue
                if i and e.errno in _EXHAUSTED:
                    break  # the kernel checks for a free fd before it looks for a connection: maybe none waits
                self._accept_failed(e)
                return  # the housekeeper re-arms the listener after the back-off
            self._accept_failing_since, self._backoff = 0.0, 0.0
            self._admit(sock, addr)
        try:
            self._ep.modify(self._listen_fd, select.EPOLLIN | _ONESHOT)
        except (OSError, ValueError):
            pass

    def _accept_failed(self, e: OSError) -> None:
        now = time.monotonic()
        if not self._accept_failing_since:
            self._accept_failing_since = now
        self._last_accept_error = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
        self._backoff = min(1.0, max(0.05, self._backoff * 2))
        self._accept_resume = now + self._backoff
        if self.metrics is not None:
            self.metrics.error("accept")
        hint = (
            " (the open-file limit: raise LimitNOFILE/ulimit -n or lower --max-connections)"
            if e.errno in (errno.EMFILE, errno.ENFILE)
            else ""
        )
        self._ratelog.warning(
            f"accept-{e.errno}",
            "%s: cannot accept connections: %s%s; retrying in %.2f s",
            self.name,
            self._last_accept_error,
            hint,
            self._backoff,
        )
        self._evict_oldest_handshake()  # frees an fd when a flood holds them

    def _admit(self, sock: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else "local"
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock, peer)
        limits = self.limits
        with self._lock:
            full = len(self._conns) >= limits.max_connections
            if full or len(self._handshakes) >= limits.max_handshakes:
                victim = self._oldest_handshake_locked()
                if victim is None and full:
                    self.refused += 1
                    refuse = True
                else:
                    refuse = False
            else:
                victim, refuse = None, False
            if not refuse:
                self._conns[conn.fd] = conn
                self._handshakes[conn.fd] = conn
                self.accepted += 1
        if victim is not None:
            self._evict(victim)
        if refuse:
            self._refuse(
                sock,
                f"the {self.name} port is at its limit of {limits.max_connections} connections: "
                f"retry later, or raise --max-connections",
            )
            return
        try:
            greeting = self.protocol.greeting(conn)
            if greeting:
                sock.send(greeting)  # a fresh socket's buffer always takes it whole
            self._ep.register(conn.fd, select.EPOLLIN | _ONESHOT)
        except OSError:
            self._drop(conn)

    def _refuse(self, sock: socket.socket, message: str) -> None:
        if self.metrics is not None:
            self.metrics.error("busy")
        self._ratelog.warning("busy", "%s: refused a connection: %s", self.name, message)
        try:
            sock.send(self.protocol.busy(message))
        except OSError:
            pass
        sock.close()

    def _oldest_handshake_locked(self) -> Connection | None:
        for conn in self._handshakes.values():
            if not conn.evicted:
                return conn
        return None

    def _evict_oldest_handshake(self) -> None:
        with self._lock:
            victim = self._oldest_handshake_locked()
        if victim is not None:
            self._evict(victim)

    def _evict(self, conn: Connection) -> None:
        conn.evicted = True
        self.evicted += 1
        if self.metrics is not None:
            self.metrics.error("handshake_evicted")
        with self._lock:
            self._handshakes.pop(conn.fd, None)
        conn.shutdown()

    # ------------------------------------------------------------------ timers
    def _timed_out(self, log, limit: str, what: str, conn: Connection) -> None:
        """Counts ``conn`` over ``limit`` (a Limits timeout, also the error reason) and logs it, rate-limited:
        ``what`` holds a ``%g`` for the limit's seconds."""
        if self.metrics is not None:
            self.metrics.error(limit)
        log(limit.replace("_", "-"), f"%s %s: {what}", self.name, conn.peer, getattr(self.limits, limit))

    def _housekeep(self) -> None:
        limits = self.limits
        while not self._stop.is_set():
            try:  # the housekeeper's tick, and the parked connections' hang-ups
                hangups = self._park_ep.poll(0.05)
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return  # closed
            for fd, _ in hangups:
                self._hung_up(fd)
            now = time.monotonic()
            if self._accept_resume and now >= self._accept_resume:
                self._accept_resume = 0.0
                try:
                    self._ep.modify(self._listen_fd, select.EPOLLIN | _ONESHOT)
                except (OSError, ValueError):
                    pass
            expired, slow = [], []
            with self._lock:
                for conn in self._handshakes.values():  # oldest first
                    if now - conn.opened < limits.handshake_timeout:
                        break
                    expired.append(conn)
                for conn in self._conns.values():
                    since = conn.send_since
                    if since and now - since > limits.send_timeout:
                        slow.append(conn)
                    elif (
                        conn.session is not None
                        and limits.idle_timeout
                        and now - conn.last_active > limits.idle_timeout
                        and _idle(conn)
                    ):
                        expired.append(conn)
            for conn in expired:
                if conn.session is None:
                    self._timed_out(self._ratelog.info, "handshake_timeout", "no HELLO within %g s; closed", conn)
                with self._lock:
                    self._handshakes.pop(conn.fd, None)
                conn.shutdown()
            for conn in slow:
                conn.send_since = 0.0  # counted once; the worker that gets the shutdown drops it
                self._timed_out(
                    self._ratelog.warning,
                    "send_timeout",
                    "a response not taken within %g s of its start (--send-timeout); dropped the connection",
                    conn,
                )
                conn.shutdown()


def _idle(conn: Connection) -> bool:
    """Whether ``conn`` is idle: no worker has it, no work of its protocol is pending (parked), no response is
    being sent (a slow reader is the send timeout's), and no request waits unread in its socket (all workers
    busy elsewhere). Only such a connection is closed for --idle-timeout: a request in any stage is served."""
    if conn.busy or conn.parked or conn.send_since:
        return False
    try:
        return not conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": the peer left, idle too
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return True  # broken: closing it is right


def bind_unix(path: str, kind: int, gid: int, what: str) -> socket.socket:
    """A listening Unix socket of ``kind`` at ``path``, mode 0660 and group ``gid`` (-1: the user's),
    after removing a stale one (a live server's is refused); ListenError naming ``what`` otherwise."""
    sock = socket.socket(socket.AF_UNIX, kind)
    try:
        remove_stale_socket(path, kind)
        sock.bind(path)
        if gid >= 0:
            os.chown(path, -1, gid)
        os.chmod(path, 0o660)  # this user and the group may connect; the session proof admits them
        sock.listen(256)
    except OSError as e:
        sock.close()
        raise ListenError(
            f"cannot listen on {what} {path} ({e.strerror}): pass --shm-socket PATH in a writable directory",
            errno=e.errno,
        ) from None
    return sock


def remove_stale_socket(path: str, kind: int) -> None:
    """Removes a socket file left by a dead server; refuses to steal a live one (probed as ``kind``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(17, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: stale
        return
    finally:
        probe.close()
    raise OSError(98, "another tableserver is listening on it")


def wait_writable(sock: socket.socket, timeout: float) -> bool:
    """True when ``sock`` can take more bytes within ``timeout`` seconds (a short, bounded spin that
    saves a round trip through epoll for a client that is reading)."""
    p = select.poll()
    p.register(sock, select.POLLOUT)
    return bool(p.poll(timeout * 1000))


def cpu_workers() -> int:
    """--data-threads 0: 2 per core, within the option's range."""
    bounds = option("data_threads")
    return max(bounds.lo, min(bounds.hi, 2 * (os.cpu_count() or 1)))
