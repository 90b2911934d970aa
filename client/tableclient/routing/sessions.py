"""Sessions on a client's replicas: opened when a gather needs one or in the background (one connect
at a time per replica, on a thread of its own), and the maintenance thread that keeps them: liveness,
retries of failed nodes once their backoff has passed, DNS re-resolution, warm standbys."""

from __future__ import annotations

import logging
import threading
import time

from tableclient.errors import ConnectError
from tableclient.metrics import flush_deferred
from tableclient.node import NodeSession
from tableclient.routing.identity import VersionMismatch
from tableclient.routing.membership import Membership
from tableclient.routing.options import TICK_S
from tableclient.routing.replica import Replica
from tableclient.routing.shardmap import Shard

log = logging.getLogger(__name__)


class Sessions:
    """Opens and keeps the sessions of every replica of ``members``."""

    def __init__(self, members: Membership):
        self._members = members
        self._thread: threading.Thread | None = None

    def session(self, replica: Replica, errors: list | None = None, deadline: float | None = None):
        """The replica's live session, opened now if it has none; None when it cannot be (the reason is
        appended to ``errors`` when given)."""
        node = replica.live
        if node is not None:
            return node
        m = self._members
        if not replica.usable or m.closed.is_set():
            return None
        with replica.connect_lock:
            node = replica.live
            if node is not None:
                return node
            if not replica.usable:
                return None
            try:
                node = NodeSession(replica.address, m.node_options, on_lost=m.on_lost, deadline=deadline)
            except BaseException as e:
                if errors is not None:
                    errors.append(e)
                m.set_down(replica, e)
                return None
            if not m.admit(replica, node.server, node.infos):
                node.close()
                if errors is not None:
                    errors.append(VersionMismatch(f"tableserver {replica.address} refused: {replica.error}"))
                return None
            if not m.attach(replica, node):
                node.close()
                return None
            return node

    def open_primaries(self, deadline: float) -> None:
        """A session on every shard's first usable replica by ``deadline``, or the error why not; the
        standbys connect in the background."""
        m = self._members
        for shard in m.layout.all_shards():
            errors: list = []
            for r in [r for r in shard.replicas if r.usable]:
                if self.session(r, errors, deadline=deadline) is not None:
                    break
            else:
                if len(errors) == 1:
                    raise errors[0]
                raise ConnectError(f"no session with any node of {m.address}: " + "; ".join(f"{e}" for e in errors))
            self.warm(shard)

    def warm(self, shard: Shard, wait: bool = False) -> None:
        """Sessions on the shard's primary (and standby) replicas."""
        want = 2 if self._members.options.standby else 1
        for r in [r for r in shard.replicas if r.usable][:want]:
            if r.live is None:
                if wait:
                    self.session(r)
                elif not r.busy:
                    r.busy = True
                    self._spawn(self.session, r)

    def _spawn(self, fn, replica: Replica) -> None:
        """Runs ``fn(replica)`` (a connect or a catalog fetch) on a thread of its own: at most one per
        replica (``busy``, set by the caller), so a node that answers slowly or never holds up no other
        node's reconnect."""
        threading.Thread(target=self._background, args=(fn, replica), name="tableclient-connect", daemon=True).start()

    def _background(self, fn, replica: Replica) -> None:
        try:
            if not self._members.closed.is_set():
                fn(replica)
        finally:
            replica.busy = False

    # ------------------------------------------------------------------ maintenance
    def start(self) -> None:
        self._thread = threading.Thread(target=self._maintain, name="tableclient-routing", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _maintain(self) -> None:
        while not self._members.closed.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # never let the routing thread die
                log.exception("routing maintenance")

    def tick(self) -> None:
        """One round of maintenance (the thread runs one every TICK_S)."""
        flush_deferred()  # the fast paths' metrics, applied in batches: at most one tick late
        m = self._members
        now = time.monotonic()
        for r in list(m.replicas.values()):
            node = r.live
            if node is not None and node.silent_for() > m.options.liveness_timeout:
                m.set_down(
                    r,
                    ConnectError(
                        f"no keepalive answer from {r.address} for {node.silent_for():.1f} s: frozen or unreachable"
                    ),
                )
            elif r.state in ("down", "refused", "new") and now >= r.retry_at and not r.busy:
                r.busy = True
                self._spawn(m.retry, r)
        m.refresh_dns_due(now)
        with m.lock:
            shards = m.layout.all_shards()
        for s in shards:
            self.warm(s)
