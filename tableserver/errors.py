"""Server-side error hierarchy.

Every error a user can cause (bad file, bad flag, too little memory, a port in
use) is a :class:`TableServerError` whose message is one line naming the
problem and the fix. The CLI prints exactly that line and exits non-zero; it
never shows a traceback for these. ``errno`` carries the OS error number when
one caused the failure (as pyverbs' ``PyverbsRDMAError`` does).
"""

from __future__ import annotations


class TableServerError(Exception):
    """Base class of the errors the daemon reports to its user."""

    exit_code = 1

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class ConfigError(TableServerError):
    """A flag, environment variable or config file value is invalid."""

    exit_code = 2


class TableFileError(TableServerError):
    """A table file is missing, truncated, corrupt or inconsistent."""


class ChecksumError(TableFileError):
    """Table bytes do not match the checksum recorded for them."""


class MemoryLimitError(TableServerError):
    """Not enough memory, hugepages or locked-memory allowance for the tables."""


class ListenError(TableServerError):
    """A listening socket could not be opened (port in use, bad address)."""


class TransportUnavailable(TableServerError):
    """A data transport cannot run on this host (rdma: no pyverbs, no device, its port down).

    ``--transports auto`` then goes without it; asked for by name, the server stops with this line."""


class TransportError(TableServerError):
    """A data transport's resources could not be set up (rdma: a verbs call failed, e.g. registering a
    table's memory against the locked-memory limit)."""
