"""Shard maps: which replicas hold which rows of a table, rebuilt whenever a replica changes.

Each node's catalog says which rows ``[row_lo, row_lo + rows)`` of a table it
holds. The map cuts the table ``0..total_rows`` at every range boundary into
contiguous **segments**; a segment's replicas are the nodes whose range holds
all of it (adjacent segments with the same replicas are merged, so a plain
``--shard K/N`` layout gives one segment per shard). By construction the
segments are sorted, do not overlap and cover the table exactly
(:func:`check` verifies it again); rows no node holds form **holes**, segments
with no replica, so an id there fails with a ConnectError naming its rows
instead of being dropped. Overlapping or nested ranges (a re-shard rolling
through the nodes) are routed correctly: every part of a gather goes to a node
that holds all of its rows, with the ids made relative to that node's own
``row_lo`` when the request is sent (:func:`local_ids`).

Pure logic over arrays: no sockets, no threads (the router holds the lock).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Shard:
    """Rows ``lo..hi-1`` of one table and the replicas holding all of them, in this client's order."""

    lo: int
    hi: int
    replicas: list  # [Replica]; empty: a hole (no node holds these rows)

    def __repr__(self) -> str:
        return f"Shard({self.lo}..{self.hi - 1}, {[getattr(r, 'address', r) for r in self.replicas]})"


class ShardMap:
    """The segments of one table; replaced whole on every change (a gather reads one map, never half
    of an old one and half of a new one)."""

    __slots__ = ("name", "total_rows", "shards", "bounds")

    def __init__(self, name: str, total_rows: int, shards: list[Shard]):
        check(name, total_rows, shards)
        self.name, self.total_rows, self.shards = name, total_rows, shards
        self.bounds = np.array([s.hi for s in shards], np.int64)  # segment i holds ids < bounds[i]

    @property
    def holes(self) -> list[Shard]:
        return [s for s in self.shards if not s.replicas]

    def whole(self) -> Shard | None:
        """The one segment when a single set of replicas holds every row, else None."""
        return self.shards[0] if len(self.shards) == 1 and self.shards[0].replicas else None

    def describe_holes(self) -> str:
        """'' when every row is on some node; else what is missing, e.g. "rows 150000..199999 of 't' are
        on no node"."""
        return "; ".join(f"rows {s.lo}..{s.hi - 1} of {self.name!r} are on no node" for s in self.holes)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """How a gather of int64 ids in ``0..total_rows-1`` goes to the segments: ``(order, ordered ids,
        [(segment, start, stop)])`` -- ``ids[order]`` sorted stably by segment, and for each segment
        that holds any of them the slice of ``ordered`` it holds. The slices cover ``0..ids.size``
        exactly, in order: every id is in one part, so every row of the caller's ``out`` is written."""
        which = np.searchsorted(self.bounds, ids, side="right")
        counts = np.bincount(which, minlength=len(self.shards))
        if counts.size != len(self.shards):  # an id at or past total_rows: the checks before forbid it
            raise ValueError(f"row ids of {self.name!r} outside 0..{self.total_rows - 1} reached routing")
        order = np.argsort(which, kind="stable")
        parts, start = [], 0
        for shard, n in zip(self.shards, counts.tolist()):
            if n:
                parts.append((shard, start, start + n))
            start += n
        return order, ids[order], parts


def build(name: str, total_rows: int, held: list[tuple[int, int, object]], order=None) -> ShardMap:
    """The map of a table from ``held``: one ``(row_lo, row_hi, replica)`` per replica holding part
    of it. Ranges are clipped to the table; empty ones hold nothing. ``order(replicas)`` sorts each
    segment's replicas (rendezvous order); default: as given."""
    ranges = [(max(0, int(lo)), min(int(total_rows), int(hi)), r) for lo, hi, r in held]
    ranges = [(lo, hi, r) for lo, hi, r in ranges if hi > lo]
    cuts = sorted({0, int(total_rows), *(lo for lo, _, _ in ranges), *(hi for _, hi, _ in ranges)})
    shards: list[Shard] = []
    for a, b in zip(cuts, cuts[1:]):
        replicas = [r for lo, hi, r in ranges if lo <= a and b <= hi]
        if order is not None:
            replicas = order(replicas)
        if shards and [id(r) for r in shards[-1].replicas] == [id(r) for r in replicas]:
            shards[-1].hi = b  # the same replicas hold the next rows too: one segment
        else:
            shards.append(Shard(a, b, replicas))
    return ShardMap(name, int(total_rows), shards)


def check(name: str, total_rows: int, shards: list[Shard]) -> None:
    """ValueError unless the segments are sorted, non-empty, non-overlapping and cover
    ``0..total_rows`` exactly: the invariant every gather's split relies on."""
    pos = 0
    for s in shards:
        if s.lo != pos or s.hi <= s.lo:
            raise ValueError(f"shard map of {name!r} is broken at row {pos} ({s!r}): this is a bug, report it")
        pos = s.hi
    if pos != total_rows or (total_rows and not shards):
        raise ValueError(
            f"shard map of {name!r} ends at row {pos}, the table at {total_rows}: this is a bug, report it"
        )


def holds(info, shard: Shard) -> bool:
    """Whether a node's table (its catalog's row_lo, rows) still holds every row of ``shard``."""
    return info is not None and info.row_lo <= shard.lo and shard.hi <= info.row_lo + info.rows


def local_ids(ids: np.ndarray, info) -> np.ndarray:
    """Table row ids as the node holding them numbers its rows (from its own row_lo)."""
    return ids if not info.row_lo else ids - info.row_lo
