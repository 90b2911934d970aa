"""Where a client's memory nodes are: the addresses it is given, the ones behind a DNS name, and the
order in which it reads its replicas (rendezvous hashing of its id and each node's)."""

from __future__ import annotations

import hashlib
import socket

from tableclient.errors import ConnectError


def parse_addresses(address) -> tuple[list[str], str | None]:
    """(static addresses, dns name:port or None) from ``"a:1,b:2"``, a list, or ``"dns:///name:port"``."""
    items = [address] if isinstance(address, str) else list(address)
    parts = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
    if not parts:
        raise ValueError("no tableserver address given: pass HOST:PORT, a list, or dns:///NAME:PORT")
    dns = [p for p in parts if p.startswith("dns:")]
    if dns and len(parts) > 1:
        raise ValueError("dns:///NAME:PORT stands alone: it resolves to every replica behind the name")
    if dns:
        target = dns[0].split(":", 1)[1].lstrip("/")
        if ":" not in target:
            raise ValueError(f"{dns[0]!r}: expected dns:///NAME:PORT")
        return [], target
    return parts, None


def resolve(target: str) -> list[str]:
    """Every address (ip:port) behind ``name:port``, sorted."""
    host, _, port = target.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        raise ConnectError(f"cannot resolve {target}: {e}") from None
    out = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        out.add(f"[{ip}]:{sockaddr[1]}" if family == socket.AF_INET6 else f"{ip}:{sockaddr[1]}")
    return sorted(out)


def rendezvous_score(client_id: str, node: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{client_id}|{node}".encode(), digest_size=8).digest(), "big")


def rendezvous_order(client_id: str, replicas: list) -> list:
    """``replicas`` in this client's order: highest rendezvous score of the client and node id first."""
    return sorted(replicas, key=lambda r: rendezvous_score(client_id, r.node_id), reverse=True)
