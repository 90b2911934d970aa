"""A routed gather in flight: its parts (the ids one shard holds), each part's attempts (one per
replica it was sent to), and the handle the table layer waits on."""

from __future__ import annotations

import threading
import time

import numpy as np

from tableclient.errors import GatherTimeout
from tableclient.routing.shardmap import Shard
from tableclient.transports.base import Pending


class Attempt:
    """One part sent to one replica: its pending request and the buffer its rows land in."""

    __slots__ = ("replica", "pending", "buf", "hedge")

    def __init__(self, replica, pending, buf, hedge):
        self.replica, self.pending, self.buf, self.hedge = replica, pending, buf, hedge


class Part:
    """The ids of one gather that one shard holds, and the attempts to fetch them."""

    __slots__ = ("shard", "ids", "out", "attempts", "tried", "hedge_at", "hedged", "done", "winner", "refused", "error")

    def __init__(self, shard: Shard, ids: np.ndarray, out: np.ndarray, hedge_at: float | None):
        self.shard, self.ids, self.out = shard, ids, out
        self.attempts: list[Attempt] = []
        self.tried: set = set()
        #: replicas whose disk failed these rows (IO_ERROR): never asked again for this gather, though up
        self.refused: set = set()
        self.error = None  # the last such refusal: raised when no replica is left
        self.hedge_at, self.hedged, self.done, self.winner = hedge_at, False, False, None

    def live(self) -> list[Attempt]:
        """The attempts still in flight (the caller holds the gather's lock)."""
        return [a for a in self.attempts if a.pending is not None]


class RoutedPending(Pending):
    """One gather across shards and replicas; ``wait`` drives fail-over and collects hedges through
    ``path`` (the data path: ``finish_part`` and ``request_timeout``)."""

    __slots__ = ("path", "name", "parts", "out", "order", "scratch", "mode", "lock")

    def __init__(self, path, name, parts, out, order, scratch, mode):
        super().__init__()
        self.path, self.name, self.parts = path, name, parts
        self.out, self.order, self.scratch, self.mode = out, order, scratch, mode
        self.lock = threading.Lock()

    @property
    def finished(self) -> bool:
        """Whether ``wait`` has ended it: every row in place, or failed."""
        return self._event.is_set()

    def done(self) -> bool:
        if self._event.is_set():
            return True
        return all(p.done or any(a.pending is not None and a.pending.done() for a in p.attempts) for p in self.parts)

    def wait(self, timeout: float | None = None) -> None:
        if self._event.is_set():
            return super().wait(0)
        bound = timeout if timeout is not None else self.path.request_timeout
        deadline = time.monotonic() + bound
        try:
            for part in self.parts:
                self.path.finish_part(self, part, deadline, bound)
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
