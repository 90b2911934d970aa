"""The data ports' connection limits (tcp and shm), read from the serve options.

Each :class:`~tableserver.transports.connections.Limits` field comes from one serve option; an option
missing from ``options`` takes its default from the options table (tableserver/config.py), so the
defaults are written once.
"""

from __future__ import annotations

from tableserver.config import option
from tableserver.transports.connections import Limits

#: Limits field -> the serve option it comes from
LIMIT_OPTIONS = {
    "handshake_timeout": "handshake_timeout",
    "idle_timeout": "idle_timeout",
    "send_timeout": "send_timeout",
    "max_connections": "max_connections",
    "max_per_session": "max_connections_per_session",
    "max_handshakes": "max_handshakes",
}
_KINDS = {"float": float, "int": int}


def connection_limits(options) -> Limits:
    """The connection layer's limits of a data port serving ``options`` (the resolved serve options)."""
    values = {}
    for field, name in LIMIT_OPTIONS.items():
        opt = option(name)
        values[field] = _KINDS[opt.kind](options.get(name, opt.default))
    return Limits(**values)
