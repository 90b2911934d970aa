"""Server-side data transports, by name. Modules load lazily (rdma needs pyverbs).

:func:`open_transport` is the one way the daemon makes one: every transport
takes the same (session registry, options) and reports a host that cannot run
it as :class:`~tableserver.errors.TransportUnavailable` (from its constructor
or ``bind``), so the server names none of them.
"""

from __future__ import annotations

import importlib

_REGISTRY = {
    "rdma": "tableserver.transports.rdma:RdmaTransport",
    "shm": "tableserver.transports.shm:ShmTransport",
    "tcp": "tableserver.transports.tcp:TcpTransport",
}

#: Every transport name a client may ask for, in the server's default preference.
KNOWN = ("rdma", "shm", "tcp")
#: ``--transports auto``: rdma when this host has a usable device, then shm and tcp.
AUTO = KNOWN


def transport_class(name: str):
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown transport {name!r}: use {', '.join(KNOWN)}") from None
    return getattr(importlib.import_module(module), cls)


def open_transport(name: str, sessions, options: dict):
    """A new, unbound transport ``name`` (``bind`` it next); ValueError for a name no transport has."""
    return transport_class(name)(sessions, options)
