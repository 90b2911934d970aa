"""The data path of routed gathers: a gather split by shard, each part sent to the first usable
replica whose own catalog holds all of its rows, failed over to the next when that node fails, hedged
on another once ``hedge_after`` has passed, and finished by the caller's deadline."""

from __future__ import annotations

import logging
import time

import numpy as np

from tableclient.errors import ConnectError, GatherTimeout, RemoteError, TableClientError, TransportError
from tableclient.metrics import metrics
from tableclient.routing.hedge import Hedger
from tableclient.routing.membership import Membership
from tableclient.routing.options import HEDGE_POLL_S, REPLICA_WAIT_S
from tableclient.routing.pending import Attempt, Part, RoutedPending
from tableclient.routing.sessions import Sessions
from tableclient.routing.shardmap import holds, local_ids
from tableserver.common.buffers import rows_buffer

log = logging.getLogger(__name__)

#: a refusal another replica may not share (its own drive): the gather moves on, the node stays up
IO_ERROR = "IO_ERROR"
_NODE_FAILURES = (TransportError, ConnectError, TableClientError)  # but not RemoteError / GatherTimeout


class DataPath:
    """Routed gathers over the replicas of ``members``, on the sessions of ``sessions``."""

    def __init__(self, members: Membership, sessions: Sessions):
        self._members, self._sessions = members, sessions
        self._metrics = metrics()
        self.hedger = Hedger(self.issue, members.closed)

    @property
    def request_timeout(self) -> float:
        return self._members.options.request_timeout

    def gather(self, name, ids, out, sync: bool, mode: str, hedge_after: float | None) -> RoutedPending:
        m = self._members.layout.maps[name]  # one map for the whole gather: a rebuild replaces it, never edits it
        hedge_at = None if hedge_after is None else time.monotonic() + hedge_after
        if len(m.shards) == 1:
            parts, order, scratch = [Part(m.shards[0], ids, out, hedge_at)], None, None
        else:  # one stable sort by shard; each shard's ids become one contiguous slice of scratch
            order, ordered, split = m.split(ids)
            scratch = rows_buffer(out.shape[:-1], out.shape[-1])
            parts = [Part(shard, ordered[a:b], scratch[a:b], hedge_at) for shard, a, b in split]
        routed = RoutedPending(self, name, parts, out, order, scratch, mode)
        one = len(parts) == 1 and hedge_at is None
        for part in parts:
            self.issue(routed, part, sync=sync and one, wait_until=None)
            if hedge_at is not None:
                self.hedger.schedule(routed, part)
        return routed

    def issue(
        self, routed: RoutedPending, part: Part, sync: bool = False, wait_until: float | None = None, hedge=False
    ) -> Attempt | None:
        """Sends the part to the first usable replica not tried yet (a hedge: not the one in flight);
        nothing once the gather is cancelled."""
        members = self._members
        while not routed.cancelled:
            busy = {a.replica for a in part.attempts if a.pending is not None}
            moved = False
            for r in part.shard.replicas:
                if r in part.tried or r in busy or r in part.refused or not r.usable:
                    continue
                if hedge and r.live is None:
                    continue  # a hedge never waits for a connect (the hedger serves every gather)
                node = self._sessions.session(r)
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
                    members.set_down(r, e)
                    part.tried.add(r)
                    continue
                attempt = Attempt(r, pending, buf, hedge)
                part.attempts.append(attempt)
                if routed.cancelled:  # cancelled meanwhile: cancel() may not have seen this attempt
                    pending.cancel()
                return attempt
            if moved:  # the layout changed since the gather was split: the segment holding them now, if one does
                shard = members.layout.holding(routed.name, part.ids)
                if shard is None and not hedge:  # several segments hold them now (or none): split over them
                    self._split(routed, part)
                    return None
                if shard is None or shard is part.shard:
                    return None
                part.shard = shard
                continue
            if wait_until is None or hedge or all(r in part.refused for r in part.shard.replicas):
                return None
            # every replica failed or is down: wait for one to come back, up to the caller's deadline
            with members.changed:
                remaining = wait_until - time.monotonic()
                if remaining < 0 or members.closed.is_set():
                    return None
                part.tried = {r for r in part.tried if not r.usable}
                if any(r.usable and r not in part.tried and r not in part.refused for r in part.shard.replicas):
                    continue
                members.changed.wait(min(remaining, REPLICA_WAIT_S))

    def _split(self, routed: RoutedPending, part: Part) -> None:
        """Splits ``part``, whose ids the layout now puts in several segments, into one child part per
        segment of the map now (each issued at once, and hedged like the part); ``finish_part`` drives
        the children and puts their rows back into the part's ``out`` in order."""
        order, ordered, pieces = self._members.layout.split(routed.name, part.ids)
        scratch = rows_buffer(part.out.shape[:-1], part.out.shape[-1])
        children = [Part(shard, ordered[a:b], scratch[a:b], part.hedge_at) for shard, a, b in pieces]
        with routed.lock:
            part.split(order, scratch, children)
        log.info("gather of %r: rows %d..%d span %d segments now (the nodes' row ranges changed): split over them",
                 routed.name, int(part.ids.min()), int(part.ids.max()), len(children))  # fmt: skip
        for child in children:
            self.issue(routed, child)
            if child.hedge_at is not None:
                self.hedger.schedule(routed, child)

    def _finish_children(self, routed: RoutedPending, part: Part, deadline: float, bound: float) -> None:
        """Drives a split part's children to completion, then puts their rows into its ``out`` in order."""
        for child in part.children:
            self.finish_part(routed, child, deadline, bound)
        order, scratch, out = part.order, part.scratch, part.out

        def reorder(a: int, b: int) -> None:
            out[order[a:b]] = scratch[a:b]

        routed.write(order.size, reorder)
        part.done = True

    def finish_part(self, routed: RoutedPending, part: Part, deadline: float, bound: float) -> None:
        """Drives one part of a routed gather to completion by ``deadline``: waits, fails over, hedges;
        splits it again when its ids came to span several segments."""
        while not part.done:
            if routed.cancelled:  # a barrier: no attempt is issued (or re-issued) for a cancelled gather
                raise TableClientError(f"gather of {part.ids.size} rows of {routed.name!r} was cancelled")
            if part.children is not None:
                self._finish_children(routed, part, deadline, bound)
                return
            with routed.lock:
                live = part.live()
            if not live:
                wait_until = min(deadline, time.monotonic() + self._members.options.reconnect_wait)
                if self.issue(routed, part, wait_until=wait_until) is None:
                    if part.children is not None:
                        continue  # split over the segments that hold its ids now
                    if part.error is not None:  # every replica left refused these rows: say why
                        raise part.error
                    raise ConnectError(self._unreachable(routed.name, part))
                continue
            now = time.monotonic()
            if now >= deadline:
                raise GatherTimeout(f"gather of {part.ids.size} rows of {routed.name!r} not complete after {bound:g} s")
            if len(live) == 1 and (part.hedge_at is None or now < part.hedge_at):
                until = deadline if part.hedge_at is None else min(deadline, part.hedge_at)
                slice_s = max(until - now, 0.0)
            else:  # past the hedge time: a hedge may join at any moment; poll
                slice_s = HEDGE_POLL_S
            for a in live:
                try:
                    a.pending.wait(slice_s if len(live) == 1 else 0.0)
                except GatherTimeout:
                    continue
                except RemoteError as e:
                    if e.status != IO_ERROR:
                        raise
                    with routed.lock:  # this node's disk failed these rows: another replica's may not
                        a.pending = None
                        part.refused.add(a.replica)
                        part.error = e
                    self._metrics.failovers.inc()
                    log.warning("gather of %r: %s could not read the rows (%s), trying another replica",
                                routed.name, a.replica.address, e)  # fmt: skip
                    break
                except _NODE_FAILURES as e:
                    with routed.lock:
                        a.pending = None
                        part.tried.add(a.replica)
                    self._members.set_down(a.replica, e)
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

    def _won(self, routed: RoutedPending, part: Part, winner: Attempt) -> None:
        with routed.lock:
            part.done, part.winner = True, winner
            losers = [a for a in part.attempts if a is not winner and a.pending is not None]
        for a in losers:
            a.pending.cancel()  # a barrier: nothing of theirs lands after this
        if winner.buf is not part.out:  # a hedge won: its rows into the part's out (the caller's, maybe)

            def copy(a: int, b: int) -> None:
                np.copyto(part.out[a:b], winner.buf[a:b])

            routed.write(part.out.shape[0], copy)
        if winner.hedge:
            self._metrics.hedges.labels("won").inc()

    def _unreachable(self, name: str, part: Part) -> str:
        """Why no replica can serve ``part``: rows on no node, rows moved meanwhile, or every replica down."""
        lo, hi = (int(part.ids.min()), int(part.ids.max())) if part.ids.size else (part.shard.lo, part.shard.lo)
        holes = self._members.layout.holes(name, lo, hi)
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
