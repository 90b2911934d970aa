"""Routing gathers across memory nodes: replicas, row-range shards, fail-over, hedged reads.

One layer above the data transports, with their interface (:class:`Router`
is a :class:`~tableclient.transports.base.ClientTransport` to the table
layer): validation, dedup and request splitting stay in the table layer, which
dispatches its one gather plan (``tableclient.plan``) here as it dispatches it
to a single node. The table layer and the step API read each table through its
:class:`~tableclient.routing.reader.TableReader` (``Router.reader``).

* **Membership**: the addresses a client is given (``a:7070,b:7070``, a list)
  or every address behind ``dns:///name:port`` (a Kubernetes headless
  Service), re-resolved every ``dns_refresh`` seconds. No master: tables are
  immutable, so each node's catalog says what it holds.
* **Identity**: every table has a whole-table checksum. The client pins the
  first it sees (or the one given) with the total rows and row size; a node
  whose table differs is refused (and counted), never read from.
* **Shards**: each node holds rows ``[row_lo, row_lo + rows)`` of each table.
  The client's shard map (:mod:`tableclient.routing.shardmap`) cuts each table into
  segments at every range boundary, a segment's replicas being the nodes whose
  range holds all of it (overlapping and nested ranges included); it is rebuilt
  from the catalogs on every change of a replica and checked (sorted,
  non-overlapping, covering the table) before use. At start every row must be
  on some node. A gather is split by segment with one vectorized sort, each
  part sent on a session whose own catalog holds all of its rows, and the rows
  scattered back in order; ids no live node holds fail the gather with a
  ConnectError naming them.
* **Replica choice**: rendezvous (highest-random-weight) hashing of the
  client id and the node id orders each shard's replicas per client: clients
  spread evenly, and only the clients of a node that fails move. The first
  usable replica is the primary; the second keeps a warm session (standby).
* **Fail-over**: a part whose node fails (connection reset, QP error, session
  lost, no keepalive answer for ``liveness_timeout`` seconds: frozen or
  unreachable) is re-issued on the next replica, within the caller's timeout
  (reads are idempotent). Failed nodes are retried with backoff and re-admitted
  only if their tables still match the pinned identity. With no replica left
  the gather fails at once with ConnectError (so a failure policy can act), or
  waits up to ``reconnect_wait`` for one to come back.
* **Hedging**: a part given ``hedge_after`` seconds (the step API passes a
  fraction of the layer's window) and still missing then is issued again on
  another replica; the first answer wins (bit-exact either way), the other is
  cancelled (a barrier: its late rows never land).

Its parts, one concept each: ``options`` (RoutingOptions, the fixed timings),
``addresses`` (parsing, DNS, rendezvous order), ``identity`` (pinned table
identities), ``replica`` and ``membership`` (the nodes and their states),
``shardmap`` and ``layout`` (the tables' shard maps), ``sessions`` (opening
and keeping sessions, the maintenance thread), ``pending`` and ``datapath``
(routed gathers and fail-over), ``hedge`` (the hedge timer thread), ``reader``
(the table layer's view) and ``router`` (:class:`Router`, composing them).
"""

from tableclient.routing.addresses import parse_addresses, rendezvous_score, resolve
from tableclient.routing.identity import VersionMismatch
from tableclient.routing.options import RoutingOptions
from tableclient.routing.pending import RoutedPending
from tableclient.routing.reader import NO_ROUTE, Route, TableReader
from tableclient.routing.replica import Replica
from tableclient.routing.router import Router

__all__ = [
    "NO_ROUTE",
    "Replica",
    "Route",
    "RoutedPending",
    "Router",
    "RoutingOptions",
    "TableReader",
    "VersionMismatch",
    "parse_addresses",
    "rendezvous_score",
    "resolve",
]
