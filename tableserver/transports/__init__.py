"""Server-side data transports, by name. Modules load lazily (rdma needs pyverbs)."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "shm": "tableserver.transports.shm:ShmTransport",
    "tcp": "tableserver.transports.tcp:TcpTransport",
}

#: Every transport name a client may ask for, in the server's default preference.
KNOWN = ("shm", "tcp")


def transport_class(name: str):
    try:
        module, cls = _REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown transport {name!r}: use {', '.join(KNOWN)}") from None
    return getattr(importlib.import_module(module), cls)
