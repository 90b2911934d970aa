"""Router: every memory node of one client, composed of routing's parts (see the package's docstring)."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace

from tableclient.errors import ConnectError
from tableclient.metrics import metrics
from tableclient.node import NodeOptions, NodeSession
from tableclient.routing.datapath import DataPath
from tableclient.routing.membership import Membership
from tableclient.routing.options import DEFAULT_ROUTING, JOIN_S, RoutingOptions
from tableclient.routing.reader import TableReader
from tableclient.routing.replica import Replica
from tableclient.routing.sessions import Sessions
from tableclient.routing.shardmap import Shard
from tableclient.transports.base import ClientTransport, Pending
from tableserver.common.model import NO_LIMIT

log = logging.getLogger(__name__)


class Router(ClientTransport):
    """Every memory node of one client, and the routing of its gathers: a ClientTransport to the
    table layer, which reads each table through its :class:`TableReader` (``reader``)."""

    expands = False  # rows of duplicate ids are expanded by the table layer, after the scatter

    def __init__(
        self,
        address,
        node_options: NodeOptions,
        options: RoutingOptions = DEFAULT_ROUTING,
        checksums: dict | None = None,
    ):
        self.node_options = node_options
        self.options = replace(options, client_id=options.client_id or f"{socket.gethostname()}:{os.getpid()}")
        self._readers: dict[str, TableReader] = {}
        self._primary: tuple | None = None  # (generation, node read first)
        self._rows_limit: dict[str, tuple] = {}  # mode -> (generation, most ids per request)
        self._metrics = metrics()
        self._members = m = Membership(address, node_options, self.options, checksums, on_change=self._forget)
        self._sessions = Sessions(m)
        self._path = DataPath(m, self._sessions)
        self.static, self.dns, self.address = m.static, m.dns, m.address
        self.replicas: dict[str, Replica] = m.replicas
        self.tables = m.layout.tables
        self.infos = m.layout.infos
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self._sessions.start()
        self._path.hedger.start()

    def _start(self) -> None:
        """Every node probed at once, admitted or refused, every row on some node, and a session on
        every shard's primary: all within connect_timeout, or the client fails."""
        m = self._members
        replicas = m.discover()
        deadline = time.monotonic() + self.node_options.connect_timeout  # probes and sessions
        found = m.probe_all(replicas)
        for replica, result in zip(replicas, found):  # in the order given: the first pins
            if isinstance(result, BaseException):
                m.set_down(replica, result)
            else:
                m.admit(replica, *result)
        if not any(r.usable for r in replicas):
            errors = "; ".join(f"{r.address} {r.state}: {r.error}" for r in replicas)
            if len(replicas) == 1 and isinstance(found[0], BaseException):
                raise found[0]
            raise ConnectError(f"no tableserver of {self.address} is usable ({errors or replicas[0].error})")
        m.rebuild()
        gaps = m.layout.describe_holes()
        if gaps:
            raise ConnectError(f"{self.address}: {gaps}: start the nodes holding those rows or fix the address")
        self._sessions.open_primaries(deadline)  # every shard's primary connects now, or the client fails

    # ------------------------------------------------------------------ what the table layer reads
    @property
    def name(self) -> str:
        node = self._primary_node()
        return node.transport if node is not None else ""

    @property
    def dedups(self) -> bool:
        node = self._primary_node()
        return node is None or node.data.dedups

    @property
    def dedup_min_ids(self) -> int:
        node = self._primary_node()
        return node.data.dedup_min_ids if node is not None else ClientTransport.dedup_min_ids

    @property
    def modes(self) -> tuple:
        node = self._primary_node()
        return node.data.modes if node is not None else ClientTransport.modes

    @property
    def last_error(self) -> BaseException | None:
        """The last failure of a node (its session lost, a request failed, a probe refused)."""
        return self._members.last_error

    def _primary_node(self) -> NodeSession | None:
        hit, generation = self._primary, self._members.generation
        if hit is not None and hit[0] == generation and (hit[1] is None or not hit[1].closed):
            return hit[1]
        node = self._find_primary()
        self._primary = (generation, node)
        return node

    def _find_primary(self) -> NodeSession | None:
        for s in self._members.layout.all_shards():
            for r in s.replicas:
                node = r.live
                if r.usable and node is not None:
                    return node
        return None

    def primary(self, name: str | None = None) -> NodeSession | None:
        """The session this client reads ``name`` (default: any table) from now."""
        if name is None:
            return self._primary_node()
        for r in self._members.layout.maps[name].shards[0].replicas:
            node = r.live
            if r.usable and node is not None:
                return node
        return None

    def reader(self, name: str) -> TableReader:
        """The reader of table ``name``: the one object through which the table layer reads it."""
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers.setdefault(name, TableReader(self, self._members, name))
        return reader

    def shards(self, name: str) -> list[Shard]:
        """The segments of table ``name`` as routed now (rows, replicas in this client's order)."""
        return self._members.layout.shards(name)

    def fail(self, replica: Replica, error: BaseException) -> None:
        """A node failed a request sent straight to it (the table layer's direct path): down it goes,
        as when a routed gather finds it failed, and the gather is re-issued through routing."""
        self._members.set_down(replica, error)
        shards = [s for s in self._members.layout.all_shards() if replica in s.replicas]
        if any(r.usable for s in shards for r in s.replicas if r is not replica):
            self._metrics.failovers.inc()
            log.info("%s failed (%s): re-issuing on another replica", replica.address, error)

    def request_rows(self, mode: str = "read") -> int | None:
        hit, generation = self._rows_limit.get(mode), self._members.generation
        if hit is not None and hit[0] == generation:
            return hit[1]
        nodes = [r.live for r in list(self.replicas.values())]
        limits = [min(n.data.request_rows(mode) or NO_LIMIT, n.max_rows_per_request) for n in nodes if n is not None]
        limit = min(limits) if limits else None
        self._rows_limit[mode] = (generation, limit)
        return limit

    def gather(self, table_index, ids, out, sync=False, mode="read", expand=None, hedge_after=None) -> Pending:
        return self._path.gather(self.infos[table_index].name, ids, out, sync, mode, hedge_after)

    # ------------------------------------------------------------------ state
    def describe(self) -> dict:
        """{address: {node, state, error, transport}} of every replica (for logs, tests and the CLI)."""
        return {
            r.address: {
                "node": r.node_id,
                "state": r.state,
                "error": r.error,
                "transport": r.node.transport if r.node is not None else "",
            }
            for r in list(self.replicas.values())
        }

    def _forget(self) -> None:
        """Drops what the data path cached about replicas (and the mappings of a closed node with it)."""
        self._primary = None
        for reader in list(self._readers.values()):
            reader.forget()

    def close(self) -> None:
        self._members.close()
        self._path.hedger.wake()
        self._sessions.join(JOIN_S)
        self._path.hedger.join(JOIN_S)
