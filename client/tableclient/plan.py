"""A gather's plan: which row ids it fetches, in which requests. Pure: arrays in, arrays out.

:func:`plan_gather` makes, once per gather, what the table layer's two remote paths dispatch: the
direct request to the one node that holds the table, and the routed gather (``tableclient.routing``).
Each distinct id is fetched once where that pays (``rowids.dedup``), and the fetch is cut into
requests of at most ``max_rows`` ids. Request ``k`` asks for ``unique[a:b]``, ``(a, b) = slices[k]``,
into rows ``a:b`` of the fetch's buffer; row ``i`` of the caller's ``out`` is row ``inverse[i]`` of
that buffer, which is ``out`` itself when ``inverse`` is None. No I/O, no transport: ids must have
been checked against the table before (``rowids``, ``RemoteTable._checked``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tableclient.rowids import dedup


@dataclass(frozen=True)
class GatherPlan:
    """One gather's fetch (made by :func:`plan_gather`, never edited).

    ``ids``: the flat row ids, in the caller's order. ``unique``: the ids fetched: each distinct id once
    when deduplicated, else ``ids`` itself. ``inverse``: ``unique[inverse] == ids``, or None when
    ``unique`` is ``ids``. ``slices``: ``(start, stop)`` over ``unique`` of each request, in order,
    covering it once. ``max_rows`` and ``dedup_min_ids``: the limits it was made for."""

    ids: np.ndarray
    unique: np.ndarray
    inverse: np.ndarray | None
    slices: tuple[tuple[int, int], ...]
    max_rows: int
    dedup_min_ids: int | None

    def made_for(self, max_rows: int, dedup_min_ids: int | None) -> bool:
        """Whether these are the limits it was made for: :func:`plan_gather` is pure, so a path with
        them dispatches this plan as it is instead of making the same one again."""
        return self.max_rows == max_rows and self.dedup_min_ids == dedup_min_ids


def plan_gather(ids: np.ndarray, max_rows: int, dedup_min_ids: int | None = None) -> GatherPlan:
    """The plan of a gather of the flat int64 row ids ``ids`` for a transport whose requests carry at
    most ``max_rows`` ids and which deduplicates batches of at least ``dedup_min_ids`` ids where that
    pays (None: it never deduplicates). An empty ``ids`` has no request. ValueError if ``max_rows < 1``."""
    if max_rows < 1:
        raise ValueError(f"a request carries at least one row id, not {max_rows}")
    unique, inverse = (ids, None) if dedup_min_ids is None else dedup(ids, dedup_min_ids)
    n = unique.size
    slices = ((0, n),) if 0 < n <= max_rows else tuple((a, min(a + max_rows, n)) for a in range(0, n, max_rows))
    return GatherPlan(ids, unique, inverse, slices, max_rows, dedup_min_ids)
