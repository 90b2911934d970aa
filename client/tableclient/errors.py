"""Client error hierarchy.

Bad arguments (row ids out of range, wrong dtype or shape, a bad ``out``)
raise ``ValueError`` before anything is sent. Everything else derives from
:class:`TableClientError`; the subclasses also derive from the matching
built-in (ConnectionError, TimeoutError) so generic handlers work. ``errno``
carries the OS error number when one caused the failure (a verbs call's).
The engine layer's errors derive from it too, each with its built-in:
``tableclient.engine``'s ``ConfigError`` (ValueError), ``PluginError`` and
``EngramRowsError`` (RuntimeError), and the graph wing's (``tableclient.graph``)
``GraphStepError``.

Errors of the layers below (the shared verbs plumbing's ``VerbsError``, the
wire's ``Refused``) never escape: each transport turns them into these where
they arise.
"""

from __future__ import annotations


class TableClientError(Exception):
    """Base class of errors raised by tableclient."""

    def __init__(self, message: str = "", errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class ConnectError(TableClientError, ConnectionError):
    """The server could not be reached, or no session/transport could be set up."""


class AuthError(ConnectError):
    """The server rejected our credentials (token, TLS certificate)."""


class TransportError(TableClientError, ConnectionError):
    """A data connection broke; requests in flight on it failed."""


class RemoteError(TableClientError):
    """The server refused one request (its status and message are attached)."""

    def __init__(self, status: str, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class GatherTimeout(TableClientError, TimeoutError):
    """A gather did not complete within its deadline (it may still complete later)."""


class TransportUnavailable(TableClientError):
    """A transport cannot serve this client (e.g. shm on another host); try the next."""
