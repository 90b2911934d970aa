"""The memory nodes of one client and their states: probes, admission against the pinned identities,
refusal, failure with backoff, DNS re-resolution. Every change bumps ``generation``, which is how
the data path and the readers know that what they cached about a replica is stale."""

from __future__ import annotations

import logging
import threading
import time

from tableclient.errors import ConnectError
from tableclient.metrics import metrics
from tableclient.node import NodeOptions, NodeSession, fetch_catalog
from tableclient.routing.addresses import parse_addresses, resolve
from tableclient.routing.identity import Pins, refusal
from tableclient.routing.layout import Layout
from tableclient.routing.options import BACKOFF_DOUBLINGS, RoutingOptions
from tableclient.routing.replica import Replica
from tableclient.table import TableInfo

log = logging.getLogger(__name__)


class Membership:
    """Every replica of one client, its tables' layout and their pinned identities, under one lock
    (``changed`` is notified on every change of a replica). ``on_change()`` runs after each change."""

    def __init__(self, address, node_options: NodeOptions, options: RoutingOptions, checksums=None, on_change=None):
        self.node_options, self.options = node_options, options
        self.static, self.dns = parse_addresses(address)
        self.address = ",".join(self.static) if self.static else f"dns:///{self.dns}"
        self.pins = Pins(checksums)
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.closed = threading.Event()
        self.replicas: dict[str, Replica] = {}
        self.layout = Layout()
        self.generation = 0  # bumped on every change of a replica or of the layout
        self.last_error: BaseException | None = None
        self._on_change = on_change
        self._metrics = metrics()
        self._next_dns = 0.0
        self._dns_busy = False  # a re-resolution is running

    def discover(self) -> list[Replica]:
        """A replica for every address given (or behind the DNS name now), in that order."""
        addresses = self.static or resolve(self.dns)
        if not addresses:
            raise ConnectError(f"{self.address} resolves to no address")
        self._next_dns = time.monotonic() + self.options.dns_refresh
        for a in addresses:
            self.replicas[a] = Replica(a)
        return list(self.replicas.values())

    def probe_all(self, replicas: list) -> list:
        """Every replica's catalog or error, fetched at once (one thread each: a slow node delays no other;
        each fetch ends within connect_timeout)."""
        found: list = [None] * len(replicas)

        def probe(i: int) -> None:
            found[i] = self.probe(replicas[i])

        threads = [
            threading.Thread(target=probe, args=(i,), name="tableclient-probe", daemon=True)
            for i in range(len(replicas))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return found

    def probe(self, replica: Replica):
        """(ServerInfo, [TableInfo]) of the replica's node, or the error fetching them."""
        try:
            return fetch_catalog(replica.address, self.node_options)
        except BaseException as e:  # reported per replica by the caller
            return e

    def admit(self, replica: Replica, server, infos) -> bool:
        """Checks a node's tables against the pinned identity; idle (usable) or refused."""
        with self.lock:
            bad = self.pins.mismatch(infos)
            if bad is not None:
                return self._refuse(replica, *bad)
            replica.node_id = server.node_id or replica.address
            layout = {t.name: (t.row_lo, t.rows) for t in infos}
            changed = layout != {t.name: (t.row_lo, t.rows) for t in replica.tables.values()}
            replica.tables = {t.name: t for t in infos}
            if changed and self.layout.tables:  # another layout (or a first one): every map is rebuilt before use
                self.rebuild()
            was = replica.state
            replica.state = "up" if replica.live is not None else "idle"
            replica.failures, replica.error = 0, ""
            if was in ("down", "refused"):
                log.info("tableserver %s (node %s) re-admitted", replica.address, replica.node_id)
            self._gauge(replica)
            self.changed.notify_all()
            return True

    def _refuse(self, replica: Replica, t: TableInfo, pin: tuple) -> bool:
        replica.state = "refused"
        replica.failures += 1
        replica.retry_at = time.monotonic() + self.options.backoff_max
        replica.error = refusal(t, pin)
        self._metrics.version_refusals.inc()
        self._gauge(replica)
        log.warning("tableserver %s refused: %s: never mixing rows of two versions", replica.address, replica.error)
        return False

    def rebuild(self) -> None:
        """Every shard map, from the catalogs of the replicas now (the tables' indices stay stable)."""
        with self.lock:
            self.layout.rebuild(self.replicas.values(), self.options.client_id)
            self.invalidate()

    def attach(self, replica: Replica, node: NodeSession) -> bool:
        """A session opened on ``replica``: up; False (the caller closes it) once the client is closing."""
        with self.lock:
            if self.closed.is_set():
                return False
            replica.node = node
            replica.state = "up"
            if replica.lost:
                replica.lost = False
                self._metrics.reconnects.inc()
                log.info("tableserver %s: new session after the last was lost", replica.address)
            self._gauge(replica)
            self.changed.notify_all()
            return True

    def on_lost(self, node: NodeSession, error: BaseException) -> None:
        """A session's keepalive stream broke: its replica is down (unless it has another session now)."""
        replica = self.replicas.get(node.address)
        if replica is not None and replica.node is node:
            self.set_down(replica, error)

    def set_down(self, replica: Replica, error) -> None:
        """Fails a replica: its session closes (in-flight requests fail and are re-issued elsewhere)."""
        with self.lock:
            node, replica.node = replica.node, None
            if node is not None:
                replica.lost = True
            if replica.state != "down":
                log.warning("tableserver %s down: %s", replica.address, error)
            replica.state = "down"
            replica.failures += 1
            replica.error = str(error)
            self.last_error = error if isinstance(error, BaseException) else ConnectError(str(error))
            o = self.options
            delay = min(o.backoff_max, o.backoff_min * 2 ** min(replica.failures - 1, BACKOFF_DOUBLINGS))
            replica.retry_at = time.monotonic() + delay
            self._gauge(replica)
        if node is not None:
            node.close(graceful=False)

    def invalidate(self) -> None:
        """Marks what the data path and the readers cached about replicas stale (and lets it go)."""
        self.generation += 1
        if self._on_change is not None:
            self._on_change()

    def _gauge(self, replica: Replica) -> None:
        self.invalidate()  # every change of a replica's state or session passes here
        self._metrics.replica_up.labels(replica.address).set(1 if replica.usable else 0)

    def retry(self, replica: Replica) -> None:
        """Probes a failed (or refused, or new) replica again: re-admitted if its tables still match."""
        result = self.probe(replica)
        if isinstance(result, BaseException):
            self.set_down(replica, result)
            return
        if self.admit(replica, *result):
            self.rebuild()

    def refresh_dns_due(self, now: float) -> None:
        """Re-resolves the DNS name on a thread of its own once ``dns_refresh`` has passed since the last."""
        if self.dns and now >= self._next_dns and not self._dns_busy:
            self._next_dns = now + self.options.dns_refresh
            self._dns_busy = True
            threading.Thread(target=self._refresh_dns, name="tableclient-dns", daemon=True).start()

    def _refresh_dns(self) -> None:
        try:
            current = set(resolve(self.dns))
        except ConnectError as e:
            log.warning("%s", e)
            return
        finally:
            self._dns_busy = False
        with self.lock:
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
            self.rebuild()

    def close(self) -> None:
        """Ends every session; nothing is opened again."""
        self.closed.set()
        self.invalidate()
        with self.lock:
            self.changed.notify_all()
            nodes = [r.node for r in self.replicas.values() if r.node is not None]
            for r in self.replicas.values():
                r.node = None
        for node in nodes:
            node.close()
