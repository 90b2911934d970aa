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
from tableclient.options import ClientOptions, client_options
from tableclient.routing import Router, TableReader
from tableclient.table import GatherHandle, RemoteTable, TableInfo

log = logging.getLogger(__name__)

#: most ids per request while no session is up to say (a session's own limit replaces it)
DEFAULT_ROWS_PER_REQUEST = 65536


class TableClient:
    """Sessions with one or more tableservers. Thread-safe for gathers; use as a context manager.

    ``options`` (:class:`~tableclient.options.ClientOptions`) holds every setting in groups:
    ``connection`` (:class:`~tableclient.node.NodeOptions`, how each node is reached: ``transport``,
    ``token``, TLS, ``connect_timeout``, ``keepalive_interval``, and in ``transport_options`` the data
    transports' set-up: ``busy_poll``, tcp's seconds a reader spins on the socket before sleeping in
    the kernel, no wake-up when rows arrive within it for one core busy up to that long per wait;
    rdma's device, queue pairs and rings), ``routing`` (:class:`~tableclient.routing.RoutingOptions`:
    ``client_id``, the rendezvous key of which replica this client reads first, default hostname:pid;
    ``request_timeout``, a gather waited for without a timeout; ``liveness_timeout``, a node that
    answers no keepalive this long is failed, frozen or unreachable; ``dns_refresh``; ``standby``, a warm
    session on each shard's second replica; ``reconnect_wait``, how long a gather whose rows are on no
    node that is up waits for one to come back, 0: it fails at once with ConnectError while the client
    keeps reconnecting in the background), and ``mode``, ``hedge_after`` (plain gathers: re-issue on
    another replica when still missing after this many seconds; the step API hedges each layer at
    ``hedge_fraction`` of its window instead) and ``checksums`` ({table: checksum} to pin instead of
    the first seen).

    Every option is also a keyword argument of its own (``transport`` the second positional one),
    applied on top of ``options``.
    """

    def __init__(
        self,
        address="127.0.0.1:7070",
        transport: str | None = None,
        *,
        options: ClientOptions | None = None,
        **settings,
    ):
        if transport is not None:
            settings["transport"] = transport
        self.options = o = client_options(options, **settings)
        self.mode = o.mode
        self.connect_timeout = o.connection.connect_timeout
        self.hedge_after, self.hedge_fraction = o.hedge_after, o.hedge_fraction
        self._closed = False
        self._router = Router(address, o.connection, o.routing, o.checksums)
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
        return node.max_rows_per_request if node is not None else DEFAULT_ROWS_PER_REQUEST

    def replicas(self) -> dict:
        """{address: {node, state, error, transport}} of every memory node this client knows."""
        return self._router.describe()

    def shards(self, name: str) -> list:
        """The segments of table ``name`` as routed now: ``Shard``s (their rows, and their replicas in the
        order this client reads them; ``tableclient.routing.layout``)."""
        if name not in self.tables:
            raise KeyError(f"no table {name!r} on {self.address}: it serves {', '.join(self.tables) or 'none'}")
        return self._router.shards(name)

    def read_from(self, name: str) -> str | None:
        """The address of the node this client reads table ``name`` (its first segment) from now; None while
        none of its replicas is up."""
        if name not in self.tables:
            raise KeyError(f"no table {name!r} on {self.address}: it serves {', '.join(self.tables) or 'none'}")
        node = self._router.primary(name)
        return node.address if node is not None else None

    def reader(self, name: str) -> TableReader:
        """How table ``name`` is read now (which node and mapping serve it; see ``tableclient.routing.reader``)."""
        if name not in self.tables:
            raise KeyError(f"no table {name!r} on {self.address}: it serves {', '.join(self.tables) or 'none'}")
        return self._router.reader(name)

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

    def node_transport(self, name: str | None = None):
        """The data transport (tcp, shm or rdma) of the node table ``name`` is read from now (by default
        any table's), for tools and tests that speak to one node below the routing: its requests skip
        fail-over, hedging and the client's metrics. TableClientError while no such node is usable."""
        if name is not None and name not in self.tables:
            raise KeyError(f"no table {name!r} on {self.address}: it serves {', '.join(self.tables) or 'none'}")
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
