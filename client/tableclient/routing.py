"""Routing gathers across memory nodes: replicas, row-range shards, fail-over, hedged reads.

One layer above the data transports, with their interface (:class:`Router`
is a :class:`~tableclient.transports.base.ClientTransport` to the table
layer): validation, dedup and request splitting stay where they are.

* **Membership**: the addresses a client is given (``a:7070,b:7070``, a list)
  or every address behind ``dns:///name:port`` (a Kubernetes headless
  Service), re-resolved every ``dns_refresh`` seconds. No master: tables are
  immutable, so each node's catalog says what it holds.
* **Identity**: every table has a whole-table checksum. The client pins the
  first it sees (or the one given) with the total rows and row size; a node
  whose table differs is refused (and counted), never read from.
* **Shards**: each node holds rows ``[row_lo, row_lo + rows)`` of each table.
  The client's shard map (:mod:`tableclient.shardmap`) cuts each table into
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
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from tableclient.errors import ConnectError, GatherTimeout, RemoteError, TableClientError, TransportError
from tableclient.metrics import flush_deferred, metrics
from tableclient.node import NodeOptions, NodeSession, fetch_catalog
from tableclient.shardmap import Shard, ShardMap, build, holds, local_ids
from tableclient.table import TableInfo
from tableclient.transports.base import ClientTransport, Pending
from tableserver.common.buffers import rows_buffer

log = logging.getLogger("tableclient.routing")

_NODE_FAILURES = (TransportError, ConnectError, TableClientError)  # but not RemoteError / GatherTimeout


class VersionMismatch(ConnectError):
    """A node serves a table whose identity (checksum, rows, row size) differs from the pinned one."""


@dataclass(frozen=True)
class RoutingOptions:
    client_id: str = ""  # rendezvous key (default hostname:pid)
    request_timeout: float = 30.0  # a gather waited for without a timeout ends after this
    liveness_timeout: float = 2.0  # a node silent this long (no keepalive answer) is failed
    dns_refresh: float = 5.0  # seconds between re-resolutions of dns:/// addresses
    standby: bool = True  # keep a warm session on each shard's second replica
    reconnect_wait: float = 0.0  # a gather with no replica up waits this long for one (0: fail at once)
    backoff_min: float = 0.05
    backoff_max: float = 5.0


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


class Replica:
    """One memory node as this client sees it."""

    def __init__(self, address: str):
        self.address = address
        self.node_id = address
        self.state = "new"  # new -> idle (catalog ok) / up (session) -> down -> ...; refused: other data
        self.node: NodeSession | None = None
        self.tables: dict[str, TableInfo] = {}
        self.failures = 0
        self.retry_at = 0.0
        self.error = ""
        self.busy = False  # a connect or catalog fetch is running for it
        self.lost = False  # it had a session that was lost: the next one counts as a reconnect
        self.connect_lock = threading.Lock()

    @property
    def usable(self) -> bool:
        return self.state in ("idle", "up")

    def __repr__(self) -> str:
        return f"Replica({self.address}, {self.state})"


class _Attempt:
    __slots__ = ("replica", "pending", "buf", "hedge")

    def __init__(self, replica, pending, buf, hedge):
        self.replica, self.pending, self.buf, self.hedge = replica, pending, buf, hedge


class _Part:
    """The ids of one gather that one shard holds, and the attempts to fetch them."""

    __slots__ = ("shard", "ids", "out", "attempts", "tried", "hedge_at", "hedged", "done", "winner")

    def __init__(self, shard: Shard, ids: np.ndarray, out: np.ndarray, hedge_at: float | None):
        self.shard, self.ids, self.out = shard, ids, out
        self.attempts: list[_Attempt] = []
        self.tried: set = set()
        self.hedge_at, self.hedged, self.done, self.winner = hedge_at, False, False, None


class RoutedPending(Pending):
    """One gather across shards and replicas; ``wait`` drives fail-over and collects hedges."""

    __slots__ = ("router", "name", "parts", "out", "order", "scratch", "mode", "lock")

    def __init__(self, router, name, parts, out, order, scratch, mode):
        super().__init__()
        self.router, self.name, self.parts = router, name, parts
        self.out, self.order, self.scratch, self.mode = out, order, scratch, mode
        self.lock = threading.Lock()

    def done(self) -> bool:
        if self._event.is_set():
            return True
        return all(p.done or any(a.pending is not None and a.pending.done() for a in p.attempts) for p in self.parts)

    def wait(self, timeout: float | None = None) -> None:
        if self._event.is_set():
            return super().wait(0)
        bound = timeout if timeout is not None else self.router.options.request_timeout
        deadline = time.monotonic() + bound
        try:
            for part in self.parts:
                self.router.finish_part(self, part, deadline, bound)
        except GatherTimeout:
            raise  # still in flight: the caller may wait again or cancel
        except BaseException as e:
            self.cancel()
            self.complete(e)
            raise
        if self.order is not None:
            self.out[self.order] = self.scratch  # the shards' rows back into the caller's order
        self.completed_at = max(
            (p.winner.pending.completed_at for p in self.parts if p.winner is not None), default=time.perf_counter()
        )
        self._event.set()

    def cancel(self) -> None:
        self.cancelled = True
        for part in self.parts:
            for a in part.attempts:
                if a.pending is not None:
                    a.pending.cancel()


class Router(ClientTransport):
    """Every memory node of one client, and the routing of its gathers."""

    expands = False  # rows of duplicate ids are expanded by the table layer, after the scatter

    def __init__(
        self,
        address,
        node_options: NodeOptions,
        options: RoutingOptions = RoutingOptions(),
        checksums: dict | None = None,
    ):
        self.node_options = node_options
        self.options = replace(options, client_id=options.client_id or f"{socket.gethostname()}:{os.getpid()}")
        self.static, self.dns = parse_addresses(address)
        self.address = ",".join(self.static) if self.static else f"dns:///{self.dns}"
        self._pins: dict[str, tuple] = {name: (c, None, None) for name, c in (checksums or {}).items()}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.replicas: dict[str, Replica] = {}
        self.tables: dict[str, TableInfo] = {}
        self.infos: list[TableInfo] = []
        self._maps: dict[str, ShardMap] = {}  # table -> its shard map, replaced whole on every change
        self._closed = threading.Event()
        self._dns_busy = False  # a re-resolution is running
        self._hedges: list = []
        self._hedge_seq = itertools.count()
        self._hedge_cv = threading.Condition()
        self._metrics = metrics()
        self._next_dns = 0.0
        self._generation = 0  # bumped on every replica change: invalidates _local
        self._local: dict[str, tuple] = {}  # table -> (generation, node, (replica, node, local rows or None))
        self._primary: tuple | None = None  # (generation, node read first)
        self._rows_limit: dict[str, tuple] = {}  # mode -> (generation, most ids per request)
        self.last_error: BaseException | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self._threads = [
            threading.Thread(target=self._maintain, name="tableclient-routing", daemon=True),
            threading.Thread(target=self._hedger, name="tableclient-hedges", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ start-up
    def _start(self) -> None:
        addresses = self.static or resolve(self.dns)
        if not addresses:
            raise ConnectError(f"{self.address} resolves to no address")
        self._next_dns = time.monotonic() + self.options.dns_refresh
        self._start_deadline = time.monotonic() + self.node_options.connect_timeout  # probes and sessions
        for a in addresses:
            self.replicas[a] = Replica(a)
        found = self._probe_all(list(self.replicas.values()))
        for replica, result in zip(list(self.replicas.values()), found):  # in the order given: the first pins
            if isinstance(result, BaseException):
                self._set_down(replica, result)
            else:
                self._admit(replica, *result)
        if not any(r.usable for r in self.replicas.values()):
            errors = "; ".join(f"{r.address} {r.state}: {r.error}" for r in self.replicas.values())
            first = next(iter(self.replicas.values()))
            if len(self.replicas) == 1 and isinstance(found[0], BaseException):
                raise found[0]
            raise ConnectError(f"no tableserver of {self.address} is usable ({errors or first.error})")
        self._rebuild()
        gaps = "; ".join(filter(None, (m.describe_holes() for m in self._maps.values())))
        if gaps:
            raise ConnectError(f"{self.address}: {gaps}: start the nodes holding those rows or fix the address")
        for m in list(self._maps.values()):  # every shard's primary connects now, or the client fails
            for shard in m.shards:
                errors = []
                for r in [r for r in shard.replicas if r.usable]:
                    if self._session(r, errors, deadline=self._start_deadline) is not None:
                        break
                else:
                    if len(errors) == 1:
                        raise errors[0]
                    raise ConnectError(
                        f"no session with any node of {self.address}: " + "; ".join(f"{e}" for e in errors)
                    )
                self._warm(shard)

    def _probe_all(self, replicas: list) -> list:
        """Every replica's catalog or error, fetched at once (one thread each: a slow node delays no other;
        each fetch ends within connect_timeout)."""
        found: list = [None] * len(replicas)

        def probe(i: int) -> None:
            found[i] = self._probe(replicas[i])

        threads = [
            threading.Thread(target=probe, args=(i,), name="tableclient-probe", daemon=True)
            for i in range(len(replicas))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return found

    def _probe(self, replica: Replica):
        try:
            return fetch_catalog(replica.address, self.node_options)
        except BaseException as e:  # reported per replica by the caller
            return e

    def _admit(self, replica: Replica, server, infos) -> bool:
        """Checks a node's tables against the pinned identity; idle (usable) or refused."""
        with self._lock:
            for t in infos:
                pin = self._pins.get(t.name)
                ident = (t.checksum, t.total_rows, t.row_bytes)
                if pin is None or pin[1] is None:
                    if pin is not None and pin[0] != t.checksum:
                        return self._refuse(replica, t, pin)
                    self._pins[t.name] = ident
                elif pin != ident:
                    return self._refuse(replica, t, pin)
            replica.node_id = server.node_id or replica.address
            layout = {t.name: (t.row_lo, t.rows) for t in infos}
            changed = layout != {t.name: (t.row_lo, t.rows) for t in replica.tables.values()}
            replica.tables = {t.name: t for t in infos}
            if changed and self.tables:  # another layout (or a first one): every map is rebuilt before use
                self._rebuild()
            was = replica.state
            replica.state = "up" if replica.node is not None and not replica.node.closed else "idle"
            replica.failures, replica.error = 0, ""
            if was in ("down", "refused"):
                log.info("tableserver %s (node %s) re-admitted", replica.address, replica.node_id)
            self._gauge(replica)
            self._changed.notify_all()
            return True

    def _refuse(self, replica: Replica, t: TableInfo, pin: tuple) -> bool:
        replica.state = "refused"
        replica.failures += 1
        replica.retry_at = time.monotonic() + self.options.backoff_max
        pinned = pin[0] if pin[1] is None else f"{pin[0]} ({pin[1]} rows of {pin[2]} B)"
        replica.error = (
            f"table {t.name!r} there is {t.checksum} ({t.total_rows} rows of {t.row_bytes} B) but this "
            f"client pinned {pinned}"
        )
        self._metrics.version_refusals.inc()
        self._gauge(replica)
        log.warning("tableserver %s refused: %s: never mixing rows of two versions", replica.address, replica.error)
        return False

    def _rebuild(self) -> None:
        """Shard maps from the catalogs of every replica not refused (the router's own table indices
        stay stable). Each map is checked when built (tableclient.shardmap) and replaces the old one
        whole; rows no replica holds any more become holes, which gathers refuse by name."""
        with self._lock:
            held: dict[str, list] = {name: [] for name in self.tables}
            for r in self.replicas.values():
                if r.state == "refused":
                    continue
                for t in r.tables.values():
                    held.setdefault(t.name, []).append((t.row_lo, t.row_lo + t.rows, r))
            cid = self.options.client_id

            def order(replicas):
                return sorted(replicas, key=lambda r: rendezvous_score(cid, r.node_id), reverse=True)

            for name, ranges in held.items():
                if name not in self.tables:
                    t = ranges[0][2].tables[name]
                    info = replace(
                        t, index=len(self.infos), rows=t.total_rows, row_lo=0, nbytes=t.total_rows * t.row_bytes
                    )
                    self.tables[name] = info
                    self.infos.append(info)
                self._maps[name] = build(name, self.tables[name].rows, ranges, order)
            self._invalidate()

    def shards(self, name: str) -> list[Shard]:
        """The segments of table ``name`` as routed now (rows, replicas in this client's order)."""
        return list(self._maps[name].shards)

    # ------------------------------------------------------------------ sessions
    def _session(
        self, replica: Replica, errors: list | None = None, deadline: float | None = None
    ) -> NodeSession | None:
        """The replica's live session, opened now if it has none; None when it cannot be (the reason is
        appended to ``errors`` when given)."""
        node = replica.node
        if node is not None and not node.closed:
            return node
        if not replica.usable or self._closed.is_set():
            return None
        with replica.connect_lock:
            if replica.node is not None and not replica.node.closed:
                return replica.node
            if not replica.usable:
                return None
            try:
                node = NodeSession(replica.address, self.node_options, on_lost=self._on_lost, deadline=deadline)
            except BaseException as e:
                if errors is not None:
                    errors.append(e)
                self._set_down(replica, e)
                return None
            if not self._admit(replica, node.server, node.infos):
                node.close()
                if errors is not None:
                    errors.append(VersionMismatch(f"tableserver {replica.address} refused: {replica.error}"))
                return None
            with self._lock:
                if self._closed.is_set():
                    node.close()
                    return None
                replica.node = node
                replica.state = "up"
                if replica.lost:
                    replica.lost = False
                    self._metrics.reconnects.inc()
                    log.info("tableserver %s: new session after the last was lost", replica.address)
                self._gauge(replica)
                self._changed.notify_all()
            return node

    def _warm(self, shard: Shard, wait: bool = False) -> None:
        """Sessions on the shard's primary (and standby) replicas."""
        want = 2 if self.options.standby else 1
        for r in [r for r in shard.replicas if r.usable][:want]:
            if r.node is None or r.node.closed:
                if wait:
                    self._session(r)
                elif not r.busy:
                    r.busy = True
                    self._spawn(self._session, r)

    def _spawn(self, fn, replica) -> None:
        """Runs ``fn(replica)`` (a connect or a catalog fetch) on a thread of its own: at most one per
        replica (``busy``, set by the caller), so a node that answers slowly or never holds up no other
        node's reconnect."""
        threading.Thread(target=self._background, args=(fn, replica), name="tableclient-connect", daemon=True).start()

    def _background(self, fn, replica) -> None:
        try:
            if not self._closed.is_set():
                fn(replica)
        finally:
            replica.busy = False

    def _on_lost(self, node: NodeSession, error: BaseException) -> None:
        replica = self.replicas.get(node.address)
        if replica is not None and replica.node is node:
            self._set_down(replica, error)

    def _set_down(self, replica: Replica, error) -> None:
        """Fails a replica: its session closes (in-flight requests fail and are re-issued elsewhere)."""
        with self._lock:
            node, replica.node = replica.node, None
            if node is not None:
                replica.lost = True
            if replica.state != "down":
                log.warning("tableserver %s down: %s", replica.address, error)
            replica.state = "down"
            replica.failures += 1
            replica.error = str(error)
            self.last_error = error if isinstance(error, BaseException) else ConnectError(str(error))
            delay = min(self.options.backoff_max, self.options.backoff_min * 2 ** min(replica.failures - 1, 16))
            replica.retry_at = time.monotonic() + delay
            self._gauge(replica)
        if node is not None:
            node.close(graceful=False)

    def _invalidate(self) -> None:
        """Drops what the data path cached about replicas (and the mappings of a closed node with it)."""
        self._generation += 1
        self._local.clear()
        self._primary = None

    def _gauge(self, replica: Replica) -> None:
        self._invalidate()  # every change of a replica's state or session passes here
        self._metrics.replica_up.labels(replica.address).set(1 if replica.usable else 0)

    # ------------------------------------------------------------------ background
    def _maintain(self) -> None:
        while not self._closed.wait(0.05):
            try:
                self._tick()
            except Exception:  # never let the routing thread die
                log.exception("routing maintenance")

    def _tick(self) -> None:
        flush_deferred()  # the fast paths' metrics, applied in batches: at most one tick late
        now = time.monotonic()
        for r in list(self.replicas.values()):
            node = r.node
            if node is not None and not node.closed and node.silent_for() > self.options.liveness_timeout:
                self._set_down(
                    r,
                    ConnectError(
                        f"no keepalive answer from {r.address} for {node.silent_for():.1f} s: frozen or unreachable"
                    ),
                )
            elif r.state in ("down", "refused", "new") and now >= r.retry_at and not r.busy:
                r.busy = True
                self._spawn(self._retry, r)
        if self.dns and now >= self._next_dns and not self._dns_busy:
            self._next_dns = now + self.options.dns_refresh
            self._dns_busy = True
            threading.Thread(target=self._refresh_dns, name="tableclient-dns", daemon=True).start()
        with self._lock:
            shards = [s for m in self._maps.values() for s in m.shards]
        for s in shards:
            self._warm(s)

    def _retry(self, replica: Replica) -> None:
        result = self._probe(replica)
        if isinstance(result, BaseException):
            self._set_down(replica, result)
            return
        if self._admit(replica, *result):
            self._rebuild()

    def _refresh_dns(self) -> None:
        try:
            current = set(resolve(self.dns))
        except ConnectError as e:
            log.warning("%s", e)
            return
        finally:
            self._dns_busy = False
        with self._lock:
            known = set(self.replicas)
            for a in sorted(current - known):
                log.info("%s: new address %s", self.address, a)
                self.replicas[a] = Replica(a)  # probed by the next tick
            gone = [self.replicas.pop(a) for a in sorted(known - current)]
        for r in gone:
            log.info("%s: address %s is gone", self.address, r.address)
            self._metrics.replica_up.labels(r.address).set(0)
            node, r.node, r.state = r.node, None, "removed"
            if node is not None:
                node.close()
        if gone:
            self._rebuild()

    # ------------------------------------------------------------------ the data path
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
        return node.data.dedup_min_ids if node is not None else 2

    @property
    def modes(self) -> tuple:
        node = self._primary_node()
        return node.data.modes if node is not None else ("read",)

    def _primary_node(self) -> NodeSession | None:
        hit = self._primary
        if hit is not None and hit[0] == self._generation and (hit[1] is None or not hit[1].closed):
            return hit[1]
        generation = self._generation
        node = self._find_primary()
        self._primary = (generation, node)
        return node

    def _find_primary(self) -> NodeSession | None:
        for m in list(self._maps.values()):
            for s in m.shards:
                for r in s.replicas:
                    node = r.node
                    if r.usable and node is not None and not node.closed:
                        return node
        return None

    def primary(self, name: str | None = None) -> NodeSession | None:
        """The session this client reads ``name`` (default: any table) from now."""
        if name is None:
            return self._primary_node()
        for r in self._maps[name].shards[0].replicas:
            if r.usable and r.node is not None and not r.node.closed:
                return r.node
        return None

    def reader(self, name: str) -> tuple:
        """(replica, node, local rows or None) that reads ``name`` first, when one shard holds the whole
        table and that replica's session is up; (None, None, None) otherwise.

        On every gather: cached until a replica changes state (``_generation``), and never keeping a
        closed node (or its mapping) alive."""
        hit = self._local.get(name)
        if hit is not None and hit[0] == self._generation and (hit[1] is None or not hit[1]._closed):
            return hit[2]  # the cached tuple itself: nothing built per gather
        generation, found = self._generation, (None, None, None)
        m = self._maps.get(name)
        whole = m.whole() if m is not None else None
        if whole is not None:
            for r in whole.replicas:
                node = r.node
                info = node.tables.get(name) if node is not None else None  # the session's own catalog
                if r.usable and node is not None and not node.closed:
                    transport = node._transport
                    if transport is not None and holds(info, whole) and info.row_lo == 0:
                        found = (r, node, transport.local_table(info.index))
                    break
        self._local[name] = (generation, found[1], found)
        if self._generation != generation:  # changed meanwhile: keep no mapping of a node now gone
            self._local.pop(name, None)
        return found

    def local_table(self, name: str):
        """The rows of ``name`` as a local array when the replica read first maps them (shm) and the table
        has one shard; None otherwise. The mapping stays valid while the array lives."""
        return self.reader(name)[2]

    def fail(self, replica: Replica, error: BaseException) -> None:
        """A node failed a request sent straight to it (the table layer's direct path): down it goes,
        as when a routed gather finds it failed, and the gather is re-issued through routing."""
        self._set_down(replica, error)
        shards = [s for m in list(self._maps.values()) for s in m.shards if replica in s.replicas]
        if any(r.usable for s in shards for r in s.replicas if r is not replica):
            self._metrics.failovers.inc()
            log.info("%s failed (%s): re-issuing on another replica", replica.address, error)

    def request_rows(self, mode: str = "read") -> int | None:
        hit = self._rows_limit.get(mode)
        if hit is not None and hit[0] == self._generation:
            return hit[1]
        generation = self._generation
        limits = [
            min(r.node.data.request_rows(mode) or 1 << 62, r.node.max_rows_per_request)
            for r in list(self.replicas.values())
            if r.node is not None and not r.node.closed
        ]
        limit = min(limits) if limits else None
        self._rows_limit[mode] = (generation, limit)
        return limit

    def gather(
        self,
        table_index: int,
        ids: np.ndarray,
        out: np.ndarray,
        sync: bool = False,
        mode: str = "read",
        expand=None,
        hedge_after: float | None = None,
    ) -> Pending:
        name = self.infos[table_index].name
        m = self._maps[name]  # one map for the whole gather: a rebuild meanwhile replaces it, never edits it
        hedge_at = None if hedge_after is None else time.monotonic() + hedge_after
        if len(m.shards) == 1:
            parts, order, scratch = [_Part(m.shards[0], ids, out, hedge_at)], None, None
        else:  # one stable sort by shard; each shard's ids become one contiguous slice of scratch
            order, ordered, split = m.split(ids)
            scratch = rows_buffer(out.shape[:-1], out.shape[-1])
            parts = [_Part(shard, ordered[a:b], scratch[a:b], hedge_at) for shard, a, b in split]
        routed = RoutedPending(self, name, parts, out, order, scratch, mode)
        one = len(parts) == 1 and hedge_at is None
        for part in parts:
            self._issue(routed, part, sync=sync and one, wait_until=None)
            if hedge_at is not None:
                self._schedule_hedge(routed, part)
        return routed

    def _issue(
        self,
        routed: RoutedPending,
        part: _Part,
        sync: bool = False,
        wait_until: float | None = None,
        hedge: bool = False,
    ) -> _Attempt | None:
        """Sends the part to the first usable replica not tried yet (a hedge: not the one in flight);
        nothing once the gather is cancelled."""
        while not routed.cancelled:
            busy = {a.replica for a in part.attempts if a.pending is not None}
            moved = False
            for r in part.shard.replicas:
                if r in part.tried or r in busy or not r.usable:
                    continue
                if hedge and (r.node is None or r.node.closed):
                    continue  # a hedge never waits for a connect (the hedger serves every gather)
                node = self._session(r)
                if node is None:
                    continue
                info = node.tables.get(routed.name)  # that session's own catalog: index and range go together
                if not holds(info, part.shard):
                    moved = True  # it no longer holds these rows: never sent a request it would misread
                    continue
                buf = (
                    part.out
                    if not any(a.buf is part.out for a in part.attempts)
                    else rows_buffer(part.out.shape[:-1], part.out.shape[-1])
                )
                try:
                    pending = node.data.gather(info.index, local_ids(part.ids, info), buf, sync, routed.mode)
                except RemoteError:
                    raise
                except _NODE_FAILURES as e:
                    self._set_down(r, e)
                    part.tried.add(r)
                    continue
                attempt = _Attempt(r, pending, buf, hedge)
                part.attempts.append(attempt)
                if routed.cancelled:  # cancelled meanwhile: cancel() may not have seen this attempt
                    pending.cancel()
                return attempt
            if moved:  # the layout changed since the gather was split: the segment holding them now, if one does
                shard = self._holding(routed.name, part.ids)
                if shard is None or shard is part.shard:
                    return None
                part.shard = shard
                continue
            if wait_until is None or hedge:
                return None
            # every replica failed or is down: wait for one to come back, up to the caller's deadline
            with self._changed:
                remaining = wait_until - time.monotonic()
                if remaining < 0 or self._closed.is_set():
                    return None
                part.tried = {r for r in part.tried if not r.usable}
                if any(r.usable and r not in part.tried for r in part.shard.replicas):
                    continue
                self._changed.wait(min(remaining, 0.1))

    def finish_part(self, routed: RoutedPending, part: _Part, deadline: float, bound: float) -> None:
        """Drives one part of a routed gather to completion by ``deadline``: waits, fails over, hedges."""
        while not part.done:
            if routed.cancelled:  # a barrier: no attempt is issued (or re-issued) for a cancelled gather
                raise TableClientError(f"gather of {part.ids.size} rows of {routed.name!r} was cancelled")
            with routed.lock:
                live = [a for a in part.attempts if a.pending is not None]
            if not live:
                wait_until = min(deadline, time.monotonic() + self.options.reconnect_wait)
                if self._issue(routed, part, wait_until=wait_until) is None:
                    raise ConnectError(self._unreachable(routed.name, part))
                continue
            now = time.monotonic()
            if now >= deadline:
                raise GatherTimeout(f"gather of {part.ids.size} rows of {routed.name!r} not complete after {bound:g} s")
            if len(live) == 1 and (part.hedge_at is None or now < part.hedge_at):
                until = deadline if part.hedge_at is None else min(deadline, part.hedge_at)
                slice_s = max(until - now, 0.0)
            else:  # past the hedge time: a hedge may join at any moment; poll (rdma needs the waiter to poll)
                slice_s = 0.0005
            for a in live:
                try:
                    a.pending.wait(slice_s if len(live) == 1 else 0.0)
                except GatherTimeout:
                    continue
                except RemoteError:
                    raise
                except _NODE_FAILURES as e:
                    with routed.lock:
                        a.pending = None
                        part.tried.add(a.replica)
                    self._set_down(a.replica, e)
                    self._metrics.failovers.inc()
                    log.info(
                        "gather of %r: %s failed (%s), re-issuing on another replica", routed.name, a.replica.address, e
                    )
                    break
                self._won(routed, part, a)
                return
            else:
                if len(live) > 1:
                    time.sleep(slice_s)

    def _won(self, routed: RoutedPending, part: _Part, winner: _Attempt) -> None:
        with routed.lock:
            part.done, part.winner = True, winner
            losers = [a for a in part.attempts if a is not winner and a.pending is not None]
        for a in losers:
            a.pending.cancel()  # a barrier: nothing of theirs lands after this
        if winner.buf is not part.out:
            np.copyto(part.out, winner.buf)
        if winner.hedge:
            self._metrics.hedges.labels("won").inc()

    def _holding(self, name: str, ids: np.ndarray) -> Shard | None:
        """The segment of the current map that holds every id of ``ids`` (a part's), if one does."""
        m = self._maps.get(name)
        if m is None or not ids.size:
            return None
        lo, hi = int(ids.min()), int(ids.max())
        shard = m.shards[int(np.searchsorted(m.bounds, lo, side="right"))]
        return shard if shard.replicas and hi < shard.hi else None

    def _unreachable(self, name: str, part: _Part) -> str:
        m = self._maps.get(name)
        lo, hi = (int(part.ids.min()), int(part.ids.max())) if part.ids.size else (part.shard.lo, part.shard.lo)
        holes = [s for s in (m.holes if m is not None else []) if s.lo <= hi and lo < s.hi]
        if not part.shard.replicas or holes:
            where = ", ".join(f"{s.lo}..{s.hi - 1}" for s in holes) or f"{part.shard.lo}..{part.shard.hi - 1}"
            return (
                f"rows {where} of {name!r} are on no node (the nodes' row ranges changed): start the node "
                "holding them, or restart the others with row ranges that cover the table"
            )
        if any(r.usable and not holds(r.tables.get(name), part.shard) for r in part.shard.replicas):
            return (
                f"rows {lo}..{hi} of {name!r} moved to other nodes while the gather was in flight (the nodes' "
                "row ranges changed): gather them again"
            )
        states = ", ".join(f"{r.address} {r.state}{': ' + r.error if r.error else ''}" for r in part.shard.replicas)
        return (
            f"no replica of rows {part.shard.lo}..{part.shard.hi - 1} of {name!r} is up ({states}); "
            "the client reconnects in the background"
        )

    # ------------------------------------------------------------------ hedging
    def _schedule_hedge(self, routed: RoutedPending, part: _Part) -> None:
        with self._hedge_cv:
            heapq.heappush(self._hedges, (part.hedge_at, next(self._hedge_seq), routed, part))
            self._hedge_cv.notify()

    def _hedger(self) -> None:
        while not self._closed.is_set():
            with self._hedge_cv:
                while not self._hedges and not self._closed.is_set():
                    self._hedge_cv.wait(0.5)
                if self._closed.is_set():
                    return
                at, _, routed, part = self._hedges[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._hedge_cv.wait(delay)
                    continue
                heapq.heappop(self._hedges)
            if part.done or routed.cancelled or routed._event.is_set():
                continue
            with routed.lock:
                live = [a for a in part.attempts if a.pending is not None]
                if part.hedged or len(live) != 1 or live[0].pending.done():
                    continue
                part.hedged = True
            try:
                attempt = self._issue(routed, part, hedge=True)
            except TableClientError:
                attempt = None
            if attempt is not None:
                self._metrics.hedges.labels("issued").inc()

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

    def close(self) -> None:
        self._closed.set()
        self._invalidate()
        with self._hedge_cv:
            self._hedge_cv.notify_all()
        with self._lock:
            self._changed.notify_all()
            nodes = [r.node for r in self.replicas.values() if r.node is not None]
            for r in self.replicas.values():
                r.node = None
        for node in nodes:
            node.close()
        for t in getattr(self, "_threads", ()):
            if t is not threading.current_thread():
                t.join(timeout=2.0)
