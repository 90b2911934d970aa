"""A routed gather in flight: its parts (the ids one shard holds), each part's attempts (one per
replica it was sent to), and the handle the table layer waits on."""

from __future__ import annotations

import threading
import time

import numpy as np

from tableclient.errors import GatherTimeout, TableClientError
from tableclient.routing.shardmap import Shard
from tableclient.transports.base import Pending, WriteGuard


class Attempt:
    """One part sent to one replica: its pending request and the buffer its rows land in."""

    __slots__ = ("replica", "pending", "buf", "hedge")

    def __init__(self, replica, pending, buf, hedge):
        self.replica, self.pending, self.buf, self.hedge = replica, pending, buf, hedge


class Part:
    """The ids of one gather that one shard holds, and the attempts to fetch them; or, once the layout
    changed so that its ids span several segments, the child parts it was split into (``children``,
    one per segment: their rows land in ``scratch`` and go back into ``out`` in ``order``)."""

    __slots__ = ("shard", "ids", "out", "attempts", "tried", "hedge_at", "hedged", "done", "winner", "refused",
                 "error", "children", "order", "scratch")  # fmt: skip

    def __init__(self, shard: Shard, ids: np.ndarray, out: np.ndarray, hedge_at: float | None):
        self.shard, self.ids, self.out = shard, ids, out
        self.attempts: list[Attempt] = []
        self.tried: set = set()
        #: replicas whose disk failed these rows (IO_ERROR): never asked again for this gather, though up
        self.refused: set = set()
        self.error = None  # the last such refusal: raised when no replica is left
        self.hedge_at, self.hedged, self.done, self.winner = hedge_at, False, False, None
        self.children: list[Part] | None = None
        self.order = self.scratch = None

    def live(self) -> list[Attempt]:
        """The attempts still in flight (the caller holds the gather's lock)."""
        return [a for a in self.attempts if a.pending is not None]

    def split(self, order: np.ndarray, scratch: np.ndarray, children: list[Part]) -> None:
        """Hands its ids over to ``children``: ``ids[order]`` cut by segment, their rows landing in ``scratch``."""
        self.order, self.scratch, self.children = order, scratch, children

    def ready(self) -> bool:
        """Whether its rows are in (done, an attempt done, or every child ready): waiting would not block."""
        if self.done:
            return True
        children = self.children
        if children is not None:
            return all(c.ready() for c in children)
        return any(a.pending is not None and a.pending.done() for a in self.attempts)

    def every_attempt(self):
        """Its attempts and its children's."""
        yield from self.attempts
        for child in self.children or ():
            yield from child.every_attempt()

    @property
    def completed_at(self) -> float:
        """perf_counter() when its rows were in place (its winner's, its last child's); 0 before."""
        if self.winner is not None:
            return self.winner.pending.completed_at
        return max((c.completed_at for c in self.children or ()), default=0.0)


class RoutedPending(Pending):
    """One gather across shards and replicas; ``wait`` drives fail-over and collects hedges through
    ``path`` (the data path: ``finish_part`` and ``request_timeout``). Every copy ``wait`` makes into the
    caller's buffer (the shards' rows reordered, a hedge's rows) goes through :meth:`write`, so
    ``cancel`` is a barrier for those too."""

    __slots__ = ("path", "name", "parts", "out", "order", "scratch", "mode", "lock", "guard")

    def __init__(self, path, name, parts, out, order, scratch, mode):
        super().__init__()
        self.path, self.name, self.parts = path, name, parts
        self.out, self.order, self.scratch, self.mode = out, order, scratch, mode
        self.lock = threading.Lock()
        self.guard = WriteGuard()

    @property
    def finished(self) -> bool:
        """Whether ``wait`` has ended it: every row in place, or failed."""
        return self._event.is_set()

    def done(self) -> bool:
        if self._event.is_set():
            return True
        return all(p.ready() for p in self.parts)

    def write(self, rows: int, step) -> None:
        """``step(a, b)`` over rows ``0..rows`` of a copy into the caller's buffer, a few MiB at a time;
        TableClientError once the gather is cancelled (nothing is written after ``cancel`` returns)."""
        if not self.guard.copy(rows, self.out.shape[-1], step):
            raise TableClientError(f"gather of {self.out.shape[0]} rows of {self.name!r} was cancelled")

    def wait(self, timeout: float | None = None) -> None:
        if self._event.is_set():
            return super().wait(0)
        bound = timeout if timeout is not None else self.path.request_timeout
        deadline = time.monotonic() + bound
        try:
            for part in self.parts:
                self.path.finish_part(self, part, deadline, bound)
            if self.order is not None:  # the shards' rows back into the caller's order
                self.write(self.order.size, self._reorder)
        except GatherTimeout:
            raise  # still in flight: the caller may wait again or cancel
        except BaseException as e:
            self.cancel()
            self.complete(e)
            raise
        self.completed_at = max((p.completed_at for p in self.parts), default=0.0) or time.perf_counter()
        self._event.set()

    def _reorder(self, a: int, b: int) -> None:
        self.out[self.order[a:b]] = self.scratch[a:b]

    def cancel(self) -> None:
        self.cancelled = True
        self.guard.cancel()  # a copy into out in progress ends first; none starts after
        for part in self.parts:
            for a in part.every_attempt():
                pending = a.pending
                if pending is not None:
                    pending.cancel()
