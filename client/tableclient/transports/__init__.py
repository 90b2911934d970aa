"""Client-side data transports, by name. Modules load lazily (rdma needs pyverbs).

Opening one is the same for every transport, so callers name none of them:
:func:`prepare_transport` before the session opens (resources its request
carries; None for most), then :func:`open_transport` with the server's offer,
both configured by one :class:`~tableclient.transports.base.TransportOptions`.
"""

from __future__ import annotations

import importlib

from tableclient.transports.base import DEFAULT_OPTIONS, ClientTransport, Prepared, TransportOptions

_REGISTRY = {
    "rdma": "tableclient.transports.rdma:RdmaTransport",
    "shm": "tableclient.transports.shm:ShmTransport",
    "tcp": "tableclient.transports.tcp:TcpTransport",
}

#: What ``transport="auto"`` tries, in order: RDMA when a device reaches the server, then
#: shared memory when the server is on this host, then tcp.
AUTO_ORDER = ("rdma", "shm", "tcp")
KNOWN = tuple(_REGISTRY)

__all__ = [
    "AUTO_ORDER",
    "KNOWN",
    "TransportOptions",
    "Prepared",
    "transport_class",
    "prepare_transport",
    "open_transport",
]


def transport_class(name: str) -> type[ClientTransport]:
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown transport {name!r}: use auto, {', '.join(KNOWN)}") from None
    return getattr(importlib.import_module(module), cls)


def prepare_transport(name: str, options: TransportOptions, catalog: list) -> Prepared | None:
    """What transport ``name`` makes before the session opens (None: nothing); TransportUnavailable
    when it cannot work on this host."""
    return transport_class(name).prepare(options, catalog)


def open_transport(name, offer, session, catalog, connect_timeout=10.0, options=DEFAULT_OPTIONS, prepared=None):
    """The ClientTransport ``name`` (its constructor's parameters: ``ClientTransport.__init__``) connected to the server's ``offer`` within ``connect_timeout`` seconds; it takes
    ``prepared`` (from :func:`prepare_transport`) over, closing it if it fails."""
    return transport_class(name)(offer, session, catalog, connect_timeout, options, prepared)
