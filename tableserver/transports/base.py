"""The interface every server-side data transport implements.

A transport is constructed with the loaded tables and the session registry,
binds its listening resources in :meth:`bind` (before tables load, so a port
in use fails fast), starts serving in :meth:`start` (after tables load),
describes itself to each new session in :meth:`offer`, drops a session's
resources in :meth:`release`, and frees everything in :meth:`close`
(idempotent). Adding a transport = one new module + one line in
``tableserver/transports/__init__.py``.
"""

from __future__ import annotations

import abc

from tableserver.sessions import Session, SessionRegistry
from tableserver.v1 import tableserver_pb2 as pb


class ServerTransport(abc.ABC):
    name: str = ""

    def __init__(self, sessions: SessionRegistry, options: dict):
        self.sessions = sessions
        self.options = options
        self.tables = None  # TableSet, set by start()
        metrics = options.get("metrics")
        if metrics is None:
            from tableserver.metrics import ServerMetrics

            metrics = ServerMetrics()  # a private registry: a transport used on its own (tests)
        self.metrics = metrics

    @abc.abstractmethod
    def bind(self) -> None:
        """Acquires listening resources; raises ListenError."""

    @abc.abstractmethod
    def start(self, tables) -> None:
        """Starts serving ``tables`` (a TableSet)."""

    @abc.abstractmethod
    def offer(self, session: Session, request: pb.OpenSessionRequest) -> pb.TransportOffer | None:
        """This transport's endpoint for ``session``; None if it cannot serve that client."""

    def release(self, session: Session) -> None:  # noqa: B027 - a hook most transports leave empty
        """Frees what ``session`` holds in this transport (connections, QPs)."""

    def active_sessions(self) -> int:
        """Sessions attached to this transport now (tableserver_sessions{transport})."""
        return 0

    def health(self) -> tuple[bool, str]:
        """(True, "") while this transport can serve new clients; (False, why) when it cannot."""
        return True, ""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops serving and frees everything. Idempotent."""

    def describe(self) -> str:
        return self.name

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
