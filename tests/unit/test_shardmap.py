"""The client's shard map (tableclient.routing.shardmap), as pure logic: random layouts and restarts.

Before: the router rebuilt its map after a node came back with another row range without checking that
the shards still tiled the table; ids past the last shard were dropped by the split and the caller got
unwritten scratch memory as rows. Now every map covers the table exactly (holes are segments with no
replica), and the split puts every id in one part whose replicas hold all of it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tableclient.routing.shardmap import Shard, ShardMap, build, check, holds, local_ids


def _info(lo: int, hi: int):
    return SimpleNamespace(row_lo=lo, rows=hi - lo)


@st.composite
def layouts(draw):
    """(total rows, [(lo, hi)] per node, restarts: [(node, lo, hi)]) -- any ranges, overlapping, nested,
    empty, past the table's end, with holes or not."""
    total = draw(st.integers(1, 5000))
    rng = st.integers(-10, total + 10)
    nodes = draw(st.lists(st.tuples(rng, rng), min_size=0, max_size=6))
    restarts = draw(st.lists(st.tuples(st.integers(0, 5), rng, rng), max_size=4))
    return total, nodes, restarts


def _map(total, ranges):
    replicas = [
        SimpleNamespace(address=f"n{i}", info=_info(max(0, min(lo, hi)), max(0, max(lo, hi))))
        for i, (lo, hi) in enumerate(ranges)
    ]
    held = [(r.info.row_lo, r.info.row_lo + r.info.rows, r) for r in replicas]
    return build("t", total, held), replicas


@settings(max_examples=600, deadline=None)
@given(layouts(), st.integers(0, 2**32))
def test_every_id_lands_in_one_part_held_by_its_replicas(layout, seed):
    total, ranges, restarts = layout
    ranges = [(min(a, b), max(a, b)) for a, b in ranges]
    maps = []
    m, replicas = _map(total, ranges)
    maps.append((m, replicas, list(ranges)))
    for node, lo, hi in restarts:  # a node restarts with another range: the map is built anew
        if node < len(ranges):
            ranges[node] = (min(lo, hi), max(lo, hi))
        m, replicas = _map(total, ranges)
        maps.append((m, replicas, list(ranges)))
    rng = np.random.default_rng(seed)
    for m, replicas, _ranges in maps:
        check("t", total, m.shards)  # sorted, non-overlapping, covering 0..total
        covered = np.zeros(total, bool)
        for r in replicas:
            covered[r.info.row_lo : r.info.row_lo + r.info.rows] = True
        hole_rows = np.zeros(total, bool)
        for s in m.holes:
            hole_rows[s.lo : s.hi] = True
        np.testing.assert_array_equal(hole_rows, ~covered)  # a hole is exactly what no node holds
        ids = rng.integers(0, total, int(rng.integers(1, 300)))
        order, ordered, parts = m.split(ids)
        written = np.zeros(ids.size, bool)
        pos = 0
        for shard, a, b in parts:
            assert a == pos and b > a  # the slices tile 0..n in order: no row of out is left unwritten
            pos = b
            written[a:b] = True
            part = ordered[a:b]
            assert ((shard.lo <= part) & (part < shard.hi)).all()
            for r in shard.replicas:  # every replica of a segment holds all of its ids, numbered its own way
                assert holds(r.info, shard)
                local = local_ids(part, r.info)
                assert ((0 <= local) & (local < r.info.rows)).all()
            if not shard.replicas:
                assert hole_rows[part].all()
        assert pos == ids.size and written.all()
        np.testing.assert_array_equal(ordered, ids[order])
        assert sorted(order.tolist()) == list(range(ids.size))


def test_overlapping_and_nested_ranges_route_to_holders():
    a = SimpleNamespace(address="a", info=_info(0, 100))
    b = SimpleNamespace(address="b", info=_info(50, 200))
    c = SimpleNamespace(address="c", info=_info(60, 70))
    m = build("t", 200, [(0, 100, a), (50, 200, b), (60, 70, c)])
    assert [(s.lo, s.hi, [r.address for r in s.replicas]) for s in m.shards] == [
        (0, 50, ["a"]),
        (50, 60, ["a", "b"]),
        (60, 70, ["a", "b", "c"]),
        (70, 100, ["a", "b"]),
        (100, 200, ["b"]),
    ]
    assert m.whole() is None and not m.holes


def test_a_shrunken_range_leaves_a_named_hole():
    """The issue's layout: 0:100000 and 100000:200000; the second restarts with 100000:150000."""
    a, b = (
        SimpleNamespace(address="a", info=_info(0, 100_000)),
        SimpleNamespace(address="b", info=_info(100_000, 150_000)),
    )
    m = build("t", 200_000, [(0, 100_000, a), (100_000, 150_000, b)])
    assert m.describe_holes() == "rows 150000..199999 of 't' are on no node"
    _, _, parts = m.split(np.array([5, 199_999, 120_000], np.int64))
    assert [(s.lo, s.hi, len(s.replicas)) for s, _, _ in parts] == [
        (0, 100_000, 1),
        (100_000, 150_000, 1),
        (150_000, 200_000, 0),
    ]


def test_same_replicas_merge_and_one_full_holder_is_whole():
    a = SimpleNamespace(address="a", info=_info(0, 10))
    b = SimpleNamespace(address="b", info=_info(0, 10))
    m = build("t", 10, [(0, 10, a), (0, 10, b)])
    assert len(m.shards) == 1 and m.whole() is m.shards[0] and m.whole().replicas == [a, b]
    assert build("t", 10, []).describe_holes() == "rows 0..9 of 't' are on no node"


@pytest.mark.parametrize(
    "shards",
    [
        [Shard(0, 5, []), Shard(6, 10, [])],  # a gap
        [Shard(0, 6, []), Shard(5, 10, [])],  # an overlap
        [Shard(0, 5, []), Shard(5, 9, [])],  # short of the end
        [Shard(0, 0, []), Shard(0, 10, [])],  # an empty segment
        [],
    ],
)
def test_a_broken_map_is_never_used(shards):
    with pytest.raises(ValueError, match="shard map of 't'"):
        ShardMap("t", 10, shards)
