"""Client sessions: identity, secret, lease, and the release of their resources.

A session is opened over gRPC (authenticated there) and gets a random id and
secret; data transports admit a connection only with both. A session ends when
the client closes it, when its KeepAlive stream ends (the client process died
or disconnected), when its lease lapses without a ping, or when its client has
not bound a KeepAlive stream to it (its first ping renews it) within the bind
timeout: a flood of opens without keepalives cannot hold sessions for a whole
lease. Ending a session calls every release listener (the transports drop its
connections and QPs) exactly once, outside the registry lock.

Each session carries the key of the client network it came from
(``peer_key``); the registry counts open sessions per key, for the per-peer
cap.

A session may be opened on behalf of another of the client's (a native
poller's QP session): it names that session (``owner``), proven with that
session's secret (:meth:`SessionRegistry.owner`), and this daemon refuses it
unless it holds that session: a client behind one address for several daemons
(a Service VIP in a rolling update) never gets a session on a daemon other than
its main session's.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tableserver.common.wire import SECRET_BYTES, SESSION_ID_BYTES, owner_proof

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Session:
    id: bytes
    secret: bytes = field(repr=False)
    client_name: str = ""
    hostname: str = ""
    pid: int = 0
    peer: str = ""
    peer_key: str = ""  # the client's network prefix (control.peer_key)
    transports: tuple[str, ...] = ()
    owner: bytes = b""  # the session this one was opened on behalf of (a native poller's QP session), if any
    created: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    bound: bool = False  # a KeepAlive stream has renewed it
    closed: bool = False
    close_reason: str = ""

    @property
    def label(self) -> str:
        owner = f" for session {self.owner.hex()[:12]}" if self.owner else ""
        return f"{self.id.hex()[:12]} ({self.client_name or '?'} pid {self.pid} from {self.peer or '?'}{owner})"


class SessionRegistry:
    def __init__(self, lease_seconds: float = 15.0, reap_interval: float = 0.5, bind_timeout: float | None = None):
        """``bind_timeout``: seconds a session may stay without a KeepAlive stream (None: only the lease
        bounds it; the daemon passes --session-bind-timeout)."""
        self.lease_seconds = lease_seconds
        self.bind_timeout = bind_timeout
        self._sessions: dict[bytes, Session] = {}
        self._per_key: dict[str, int] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Session], None]] = []
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap, args=(reap_interval,), name="tableserver-reaper", daemon=True
        )
        self._reaper.start()

    def add_listener(self, fn: Callable[[Session], None]) -> None:
        """``fn(session)`` runs once when any session ends."""
        self._listeners.append(fn)

    def open(self, **info) -> Session:
        s = Session(id=os.urandom(SESSION_ID_BYTES), secret=os.urandom(SECRET_BYTES), **info)
        s.deadline = time.monotonic() + self.lease_seconds
        with self._lock:
            self._sessions[s.id] = s
            self._per_key[s.peer_key] = self._per_key.get(s.peer_key, 0) + 1
        log.info("session %s opened (transports %s)", s.label, ",".join(s.transports))
        return s

    def get(self, session_id: bytes) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def owner(self, session_id: bytes, proof: bytes) -> Session | None:
        """The open session ``session_id`` when ``proof`` is its :func:`owner_proof` (a client opening a
        session on its behalf holds it); None when this daemon does not hold it or the proof is wrong."""
        s = self.get(session_id) if len(session_id) == SESSION_ID_BYTES else None
        if s is None or s.closed or not hmac.compare_digest(owner_proof(s.secret, s.id), proof):
            return None
        return s

    def authenticate_hello(self, payload: bytes, server_nonce: bytes) -> tuple[Session | None, bytes]:
        """A data-transport HELLO (session id, client nonce, MAC) checked against ``server_nonce``:
        (the session, the server's proof) or (None, b"")."""
        from tableserver.common.wire import CLIENT_NONCE_BYTES, HELLO_BYTES, hello_mac, server_proof

        if len(payload) != HELLO_BYTES:
            return None, b""
        sid = payload[:SESSION_ID_BYTES]
        client_nonce = payload[SESSION_ID_BYTES : SESSION_ID_BYTES + CLIENT_NONCE_BYTES]
        mac = payload[SESSION_ID_BYTES + CLIENT_NONCE_BYTES :]
        s = self.get(sid)
        if s is None or s.closed or not hmac.compare_digest(hello_mac(s.secret, sid, server_nonce, client_nonce), mac):
            return None, b""
        return s, server_proof(s.secret, sid, server_nonce, client_nonce)

    def renew(self, session_id: bytes) -> bool:
        """A keepalive ping: extends the lease and marks the session bound to its stream."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.closed:
                return False
            s.deadline = time.monotonic() + self.lease_seconds
            s.bound = True
            return True

    def count(self, peer_key: str) -> int:
        """Open sessions from the client network ``peer_key``."""
        with self._lock:
            return self._per_key.get(peer_key, 0)

    def close(self, session_id: bytes, reason: str = "closed by client", _unless=None) -> bool:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or (_unless is not None and _unless(s)):  # the reaper's reason went away meanwhile
                return False
            del self._sessions[session_id]
            s.closed, s.close_reason = True, reason
            left = self._per_key.pop(s.peer_key) - 1
            if left:
                self._per_key[s.peer_key] = left
        log.info("session %s ended: %s", s.label, reason)
        for fn in self._listeners:
            try:
                fn(s)
            except Exception:  # a transport failing to clean up must not stop the others
                log.exception("releasing session %s", s.label)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def _reap(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                expired = [s.id for s in self._sessions.values() if s.deadline < now]
                unbound = (
                    []
                    if self.bind_timeout is None
                    else [
                        s.id
                        for s in self._sessions.values()
                        if not s.bound and s.created < now - self.bind_timeout and s.deadline >= now
                    ]
                )
            for sid in expired:
                self.close(
                    sid,
                    f"lease of {self.lease_seconds:g} s lapsed without a keepalive",
                    _unless=lambda s: s.deadline >= time.monotonic(),
                )
            for sid in unbound:
                self.close(
                    sid,
                    f"never bound a keepalive stream within {self.bind_timeout:g} s of opening "
                    "(a client must start KeepAlive right after OpenSession)",
                    _unless=lambda s: s.bound,
                )

    def close_all(self, reason: str = "server shutting down") -> None:
        self._stop.set()
        for s in self.sessions():
            self.close(s.id, reason)
