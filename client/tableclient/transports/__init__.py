"""Client-side data transports, by name. Modules load lazily (rdma needs pyverbs)."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "rdma": "tableclient.transports.rdma:RdmaTransport",
    "shm": "tableclient.transports.shm:ShmTransport",
    "tcp": "tableclient.transports.tcp:TcpTransport",
}

#: What ``transport="auto"`` tries, in order: RDMA when a device reaches the server, then
#: shared memory when the server is on this host, then tcp.
AUTO_ORDER = ("rdma", "shm", "tcp")
KNOWN = tuple(_REGISTRY)


def transport_class(name: str):
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown transport {name!r}: use auto, {', '.join(KNOWN)}") from None
    return getattr(importlib.import_module(module), cls)
