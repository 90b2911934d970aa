"""Server-side data transports, by name. Modules load lazily (rdma needs pyverbs)."""

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
