"""The one public face of routing to the table layer and the step API: a :class:`TableReader` per
table says how that table is read now.

When one shard holds the whole table and the replica read first has a session up, the table layer
reads straight from that node (a synchronous request on the caller's thread, or a take from the rows
mapped here over shm) instead of building a routed gather: the reader's :class:`Route` names that
replica, session, transport and mapping. The route is cached until a replica changes state (the
reader's ``generation``: a caller keeping its own copy compares it) and never keeps a closed node,
or its mapping, alive. A direct read that fails is reported with ``fail``: the node goes down as when
a routed gather finds it failed, and the caller re-issues the gather through ``transport()``.
"""

from __future__ import annotations

from tableclient.errors import TableClientError
from tableclient.routing.shardmap import holds


class Route:
    """How one table is read straight from one node: ``replica``, its ``node`` (NodeSession) and data
    ``transport``, the node's own ``index`` of the table, and ``local``, the rows as a read-only array
    when this process maps them (shm), else None; ``replicas``, how many replicas hold the table (a
    request this one refuses may succeed on another). ``NO_ROUTE`` (every field None): through routing."""

    __slots__ = ("replica", "node", "transport", "index", "local", "replicas")

    def __init__(self, replica=None, node=None, transport=None, index: int = -1, local=None, replicas: int = 0):
        self.replica, self.node, self.transport, self.index, self.local = replica, node, transport, index, local
        self.replicas = replicas

    def __repr__(self) -> str:
        where = getattr(self.replica, "address", None)
        return f"Route({where}, {getattr(self.transport, 'name', '')}, mapped={self.local is not None})"


NO_ROUTE = Route()


class TableReader:
    """How table ``name`` is read now. Made by the router (``Router.reader``), one per table."""

    __slots__ = ("name", "_router", "_members", "_hit")

    def __init__(self, router, members, name: str):
        self.name = name
        self._router = router  # the ClientTransport of routed gathers, and where failures go
        self._members = members  # the router's replicas: their generation, closed flag and layout
        self._hit: tuple | None = None  # (generation, its node, Route)

    @property
    def generation(self) -> int:
        """Bumped on every change of a replica or of the layout: a route kept from an older one is stale."""
        return self._members.generation

    @property
    def request_timeout(self) -> float:
        """Seconds a gather waited for without a timeout is given."""
        return self._members.options.request_timeout

    def route(self) -> Route:
        """The direct route now (``NO_ROUTE`` when there is none, or the client is closed). On every
        gather: the cached route itself while the generation holds and its node is open."""
        hit = self._hit
        if hit is not None and hit[0] == self._members.generation:
            node = hit[1]
            if node is None or not node.closed:
                return hit[2]
        return self._refresh()

    def local(self):
        """The table's rows as a local array when the replica read first maps them (shm) and one shard
        holds the whole table; None otherwise. The mapping stays valid while the array lives."""
        return self.route().local

    def transport(self):
        """Where routed gathers of this table go (the router); TableClientError once the client is closed."""
        if self._members.closed.is_set():
            raise TableClientError("client is closed")
        return self._router

    def fail(self, route: Route, error: BaseException) -> None:
        """A node failed a request sent straight to it along ``route``: down it goes, as when a routed
        gather finds it failed; the caller then re-issues the gather through routing."""
        self._router.fail(route.replica, error)

    def forget(self) -> None:
        """Drops the cached route (the router calls it on every change: no closed node is kept)."""
        self._hit = None

    def _refresh(self) -> Route:
        members = self._members
        generation = members.generation
        found = NO_ROUTE if members.closed.is_set() else self._find()
        self._hit = (generation, found.node, found)
        if members.generation != generation:  # changed meanwhile: keep no mapping of a node now gone
            self._hit = None
        return found

    def _find(self) -> Route:
        m = self._members.layout.maps.get(self.name)
        whole = m.whole() if m is not None else None
        if whole is None:
            return NO_ROUTE
        for r in whole.replicas:
            node = r.node
            info = node.tables.get(self.name) if node is not None else None  # the session's own catalog
            if r.usable and node is not None and not node.closed:
                try:
                    transport = node.data
                except TableClientError:  # closed meanwhile
                    break
                if holds(info, whole) and info.row_lo == 0:
                    local = transport.local_table(info.index)
                    return Route(r, node, transport, info.index, local, len(whole.replicas))
                break
        return NO_ROUTE
