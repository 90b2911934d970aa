"""The tables of one client and each one's shard map, rebuilt whole from its replicas' catalogs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tableclient.routing.addresses import rendezvous_order
from tableclient.routing.shardmap import Shard, ShardMap, build
from tableclient.table import TableInfo


class Layout:
    """Every table this client has seen, numbered once for its life (``infos[i].index == i``, whatever
    the nodes number them), and its shard map now. Not locked: the membership holds its lock around
    ``rebuild``; readers take one map and keep it for a whole gather."""

    def __init__(self):
        self.tables: dict[str, TableInfo] = {}
        self.infos: list[TableInfo] = []
        self.maps: dict[str, ShardMap] = {}  # table -> its shard map, replaced whole on every change

    def rebuild(self, replicas, client_id: str) -> None:
        """Shard maps from the catalogs of every replica not refused, each replica list in rendezvous
        order of ``client_id``. Each map is checked when built (``shardmap.check``) and replaces the old
        one whole; rows no replica holds any more become holes, which gathers refuse by name."""
        held: dict[str, list] = {name: [] for name in self.tables}
        for r in replicas:
            if r.state == "refused":
                continue
            for t in r.tables.values():
                held.setdefault(t.name, []).append((t.row_lo, t.row_lo + t.rows, r))

        def order(replicas):
            return rendezvous_order(client_id, replicas)

        for name, ranges in held.items():
            if name not in self.tables:
                t = ranges[0][2].tables[name]
                info = replace(t, index=len(self.infos), rows=t.total_rows, row_lo=0, nbytes=t.total_rows * t.row_bytes)
                self.tables[name] = info
                self.infos.append(info)
            self.maps[name] = build(name, self.tables[name].rows, ranges, order)

    def shards(self, name: str) -> list[Shard]:
        """The segments of table ``name`` (KeyError for a table never seen)."""
        return list(self.maps[name].shards)

    def all_shards(self) -> list[Shard]:
        """Every segment of every table, as mapped now."""
        return [s for m in list(self.maps.values()) for s in m.shards]

    def holding(self, name: str, ids: np.ndarray) -> Shard | None:
        """The segment of the current map that holds every id of ``ids`` (a part's), if one does."""
        m = self.maps.get(name)
        if m is None or not ids.size:
            return None
        lo, hi = int(ids.min()), int(ids.max())
        shard = m.shards[int(np.searchsorted(m.bounds, lo, side="right"))]
        return shard if shard.replicas and hi < shard.hi else None

    def split(self, name: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """How ``ids`` (a part's) go to the segments of the current map of table ``name``: the map's
        ``split`` -- ``(order, ordered ids, [(segment, start, stop)])``."""
        return self.maps[name].split(ids)

    def holes(self, name: str, lo: int, hi: int) -> list[Shard]:
        """The holes (rows on no node) of table ``name`` among rows ``lo..hi``."""
        m = self.maps.get(name)
        return [s for s in (m.holes if m is not None else []) if s.lo <= hi and lo < s.hi]

    def describe_holes(self) -> str:
        """'' when every row of every table is on some node; else what is missing."""
        return "; ".join(filter(None, (m.describe_holes() for m in list(self.maps.values()))))
