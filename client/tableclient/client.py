"""TableClient: a client's tables, wherever their rows live.

    with TableClient("memnode:7070") as client:          # transport="auto"
        layer1 = client.table("engram.layer1")
        rows = layer1.gather(row_ids)                     # [..., 264] uint8
        h1, h14 = client.gather_many([(layer1, ids1), ("engram.layer14", ids14)])

    TableClient("a:7070,b:7070,c:7070")                  # replicas (also a list)
    TableClient("dns:///tableserver.ns.svc:7070")        # every address behind a name

One address or many, the client keeps a session with the node it reads each
table (or row-range shard) from, a warm one with the next (rendezvous order
of ``client_id``), re-opens lost sessions with backoff, fails over and hedges
(:mod:`tableclient.routing`); each session is a
:class:`~tableclient.node.NodeSession`. Every table's whole-table checksum is
pinned: rows of two versions are never mixed.

Not fork-safe (gRPC channels are not): create clients after forking.
"""

from __future__ import annotations

import logging

from tableclient.errors import TableClientError
from tableclient.metrics import flush_deferred
from tableclient.node import NodeOptions
from tableclient.routing import Router, RoutingOptions
from tableclient.table import GatherHandle, RemoteTable, TableInfo, check_mode
from tableclient.transports import KNOWN

log = logging.getLogger("tableclient")


class TableClient:
    """Sessions with one or more tableservers. Thread-safe for gathers; use as a context manager.

    Routing options: ``client_id`` (rendezvous key: which replica this client reads first; default
    hostname:pid), ``checksums`` ({table: checksum} to pin instead of the first seen),
    ``request_timeout`` (a gather waited for without a timeout, seconds), ``liveness_timeout`` (a node
    that answers no keepalive for this long is failed: frozen or unreachable), ``keepalive_interval``,
    ``dns_refresh``, ``standby`` (a warm session on each shard's second replica), ``hedge_after``
    (plain gathers: re-issue on another replica when still missing after this many seconds; the step
    API hedges each layer at ``hedge_fraction`` of its window instead), ``reconnect_wait`` (a gather
    whose rows are on no node that is up waits this long for one to come back; 0: it fails at once
    with ConnectError, and the client keeps reconnecting in the background). ``busy_poll`` (tcp,
    seconds, default 0): whoever reads a response spins on the socket this long before sleeping in
    the kernel -- no wake-up when rows arrive within it, for one core busy up to that long per wait.
    """

    def __init__(
        self,
        address="127.0.0.1:7070",
        transport: str = "auto",
        *,
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        client_name: str = "",
        connect_timeout: float = 10.0,
        mode: str = "read",
        rdma_device: str | None = None,
        rdma_gid_index: int | None = None,
        rdma_port: int = 1,
        rdma_qps: int = 4,
        rdma_ring_rows: int = 4096,
        client_id: str = "",
        checksums: dict | None = None,
        request_timeout: float = 30.0,
        liveness_timeout: float = 2.0,
        keepalive_interval: float = 0.5,
        dns_refresh: float = 5.0,
        standby: bool = True,
        hedge_after: float | None = None,
        hedge_fraction: float = 0.5,
        reconnect_wait: float = 0.0,
        busy_poll: float = 0.0,
    ):
        if transport != "auto" and transport not in KNOWN:
            raise ValueError(f"unknown transport {transport!r}: use auto, {', '.join(KNOWN)}")
        self.mode = check_mode(mode)
        if not 1 <= rdma_qps <= 64 or rdma_ring_rows < 16:
            raise ValueError("rdma_qps must be 1..64 and rdma_ring_rows at least 16")
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("request_timeout", request_timeout),
            ("liveness_timeout", liveness_timeout),
            ("keepalive_interval", keepalive_interval),
            ("dns_refresh", dns_refresh),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if not 0 <= busy_poll <= 0.01:
            raise ValueError(f"busy_poll must be 0..0.01 seconds (a core spins this long per wait), got {busy_poll!r}")
        if not 0 < hedge_fraction <= 1 or (hedge_after is not None and not hedge_after > 0):
            raise ValueError("hedge_fraction must be in (0, 1] and hedge_after > 0 seconds")
        self.connect_timeout = connect_timeout
        self.hedge_after, self.hedge_fraction = hedge_after, hedge_fraction
        self._closed = False
        options = NodeOptions(
            transport=transport,
            token=token,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
            client_name=client_name,
            connect_timeout=connect_timeout,
            keepalive_interval=keepalive_interval,
            busy_poll=busy_poll,
            rdma=dict(
                device=rdma_device, gid_index=rdma_gid_index, port=rdma_port, qps=rdma_qps, ring_rows=rdma_ring_rows
            ),
        )
        self._router = Router(
            address,
            options,
            RoutingOptions(
                client_id=client_id,
                request_timeout=request_timeout,
                liveness_timeout=liveness_timeout,
                dns_refresh=dns_refresh,
                standby=standby,
                reconnect_wait=reconnect_wait,
            ),
            checksums,
        )
        self.address = self._router.address
        self._infos: list[TableInfo] = self._router.infos
        self.tables: dict[str, TableInfo] = self._router.tables

    # --------------------------------------------------------------- public
    @property
    def transport(self) -> str:
        """Name of the data transport of the node read first (shm, tcp, rdma)."""
        return self._router.name

    @property
    def replicated(self) -> bool:
        """Whether more than one node serves this client (hedging has somewhere to go)."""
        return len(self._router.replicas) > 1

    @property
    def server(self):
        """ServerInfo of the node read first."""
        node = self._router.primary()
        if node is None:
            raise TableClientError(f"no tableserver of {self.address} is reachable now")
        return node.server

    @property
    def session(self):
        node = self._router.primary()
        return node.session if node is not None else None

    @property
    def session_error(self) -> BaseException | None:
        """The last loss of a session (the client reconnected or failed over since, if it could)."""
        return self._router.last_error

    @property
    def max_rows_per_request(self) -> int:
        node = self._router.primary()
        return node.max_rows_per_request if node is not None else 65536

    def replicas(self) -> dict:
        """{address: {node, state, error, transport}} of every memory node this client knows."""
        return self._router.describe()

    def table(self, name: str | None = None, *, layer: int | None = None, mode: str | None = None) -> RemoteTable:
        """A table by name, or by model layer (``client.table(layer=1)``); ``mode`` "read" or "pack"."""
        mode = mode or self.mode
        if name is not None:
            info = self.tables.get(name)
            if info is None:
                raise KeyError(f"no table {name!r} on {self.address}: it serves {', '.join(self.tables) or 'none'}")
            return RemoteTable(self, info, mode)
        matches = [t for t in self._infos if layer is not None and t.layer == layer]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} tables for layer {layer} on {self.address}: pass a name instead")
        return RemoteTable(self, matches[0], mode)

    def gather_many(self, requests, outs=None, hedge_after=None) -> list[GatherHandle]:
        """Issues several tables' gathers in the order given (put the shortest deadline first).

        ``requests`` is a list of ``(table or name, row_ids)``; ``outs`` an
        optional list of output buffers; ``hedge_after`` an optional list of
        per-request hedge delays (seconds). Returns one handle per request.
        """
        outs = outs if outs is not None else [None] * len(requests)
        if len(outs) != len(requests):
            raise ValueError(f"{len(outs)} outs for {len(requests)} requests")
        hedges = hedge_after if hedge_after is not None else [None] * len(requests)
        handles = []
        for (table, ids), out, hedge in zip(requests, outs, hedges):
            t = table if isinstance(table, RemoteTable) else self.table(table)
            handles.append(t.gather_async(ids, out, hedge_after=hedge))
        return handles

    def _data_transport(self):
        if self._closed:
            raise TableClientError("client is closed")
        return self._router

    def _node_transport(self, name: str | None = None):
        """The data transport of the node read first (tests and tools that speak to one node)."""
        node = self._router.primary(name)
        if node is None:
            raise TableClientError(f"no session with a node of {self.address}")
        return node.data

    def close(self) -> None:
        """Ends every session and frees everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._router.close()
        flush_deferred()

    def __enter__(self) -> TableClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TableClient({self.address!r}, transport={self.transport!r}, tables={list(self.tables)})"
