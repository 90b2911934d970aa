"""Client-side data transports, by name. Modules load lazily (rdma needs pyverbs)."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "shm": "tableclient.transports.shm:ShmTransport",
    "tcp": "tableclient.transports.tcp:TcpTransport",
}

#: What ``transport="auto"`` tries, in order: local shared memory, then the network.
AUTO_ORDER = ("shm", "tcp")
KNOWN = tuple(_REGISTRY)


def transport_class(name: str):
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown transport {name!r}: use auto, {', '.join(KNOWN)}") from None
    return getattr(importlib.import_module(module), cls)
