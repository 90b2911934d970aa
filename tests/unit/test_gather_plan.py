"""A gather's plan (tableclient.plan), as pure logic: no daemon, no transport, no torch.

Before: RemoteTable's direct path and its routed path each checked the mode and the ids, deduplicated
and cut the requests on their own, so a gather the direct path gave up on was planned twice. Now one
pure function makes the plan both paths dispatch; these properties hold for any ids and limits.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tableclient import rowids
from tableclient.plan import GatherPlan, plan_gather

ROW_BYTES = 3


@st.composite
def gathers(draw):
    """(flat int64 ids, max rows per request, dedup_min_ids): ids over a table of any size, from a few
    distinct values (heavy repeats: dedup pays) to many (few repeats or none), below and above dedup's
    sample, and limits from one id per request to none."""
    rows = draw(st.integers(1, 100_000))
    distinct = draw(st.integers(1, min(rows, 5000)))
    n = draw(st.integers(0, 2000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.choice(rows, distinct, replace=False).astype(np.int64)
    ids = values[rng.integers(0, distinct, n)]
    max_rows = draw(st.integers(1, 700) | st.just(1 << 62))
    min_ids = draw(st.sampled_from([None, 1, 2, 64, 4096]))
    return ids, max_rows, min_ids


def _dispatch(plan: GatherPlan, table: np.ndarray) -> np.ndarray:
    """What both remote paths do with a plan, a transport being one ``take`` per request: each slice's
    ids into the same rows of the fetch's buffer, then the buffer expanded into the caller's order."""
    out = np.full((plan.ids.size, table.shape[1]), 0xEE, np.uint8)
    dest = out if plan.inverse is None else np.full((plan.unique.size, table.shape[1]), 0xDD, np.uint8)
    for a, b in plan.slices:
        np.take(table, plan.unique[a:b], axis=0, out=dest[a:b])
    if plan.inverse is not None:
        np.take(dest, plan.inverse, axis=0, out=out)
    return out


#: both ways dedup finds the distinct ids: the native hashing pass (where built) and the sort of packed keys
DEDUP_PATHS = pytest.mark.parametrize(
    "native_unique", [pytest.param(rowids.native_unique, id="native"), pytest.param(None, id="numpy")]
)


@contextmanager
def dedup_path(native_unique):
    if rowids.native_unique is None and native_unique is not None:
        pytest.skip("the native dedup is not built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rowids, "native_unique", native_unique)
        yield


def planned(native_unique, case) -> GatherPlan:
    """The plan of a drawn gather, made on the given dedup path."""
    with dedup_path(native_unique):
        return plan_gather(*case)


@DEDUP_PATHS
@settings(max_examples=400, deadline=None)
@given(gathers())
def test_slices_cover_the_fetch_once_within_the_limit(native_unique, case):
    plan, max_rows = planned(native_unique, case), case[1]
    n = plan.unique.size
    bounds = [0] + [b for _, b in plan.slices]
    assert [a for a, _ in plan.slices] == bounds[:-1] and bounds[-1] == n  # contiguous, in order, all of it
    assert all(0 < b - a <= max_rows for a, b in plan.slices)
    assert len(plan.slices) == -(-n // max_rows)  # as few requests as the limit allows


@DEDUP_PATHS
@settings(max_examples=400, deadline=None)
@given(gathers())
def test_every_id_is_fetched_exactly_once_and_the_inverse_puts_it_back(native_unique, case):
    plan, ids = planned(native_unique, case), case[0]
    assert plan.ids is ids
    if plan.inverse is None:
        assert plan.unique is ids  # nothing deduplicated: the caller's ids go out as they are
    else:
        fetched = np.concatenate([plan.unique[a:b] for a, b in plan.slices])
        assert np.unique(fetched).size == fetched.size == plan.unique.size < ids.size  # each once
        assert set(fetched.tolist()) == set(ids.tolist())  # and every id of the gather
        assert plan.inverse.shape == ids.shape
        np.testing.assert_array_equal(plan.unique[plan.inverse], ids)


@DEDUP_PATHS
@settings(max_examples=200, deadline=None)
@given(gathers(), st.integers(0, 2**32 - 1))
def test_dispatching_the_plan_is_a_local_take(native_unique, case, seed):
    ids = case[0]
    rows = int(ids.max()) + 1 if ids.size else 1
    table = np.random.default_rng(seed).integers(0, 256, (rows, ROW_BYTES), dtype=np.uint8)
    np.testing.assert_array_equal(_dispatch(planned(native_unique, case), table), table[ids])


@settings(max_examples=200, deadline=None)
@given(gathers())
def test_dedup_only_where_the_transport_asks(case):
    ids, max_rows, min_ids = case
    plan = plan_gather(ids, max_rows, min_ids)
    if min_ids is None or ids.size < max(2, min_ids):
        assert plan.inverse is None  # shm-like transports, and batches under the transport's threshold
    if np.unique(ids).size == ids.size:
        assert plan.inverse is None  # nothing repeats: nothing to expand
    if min_ids is not None and 2 <= ids.size <= rowids.DEDUP_SAMPLE and ids.size >= min_ids:
        assert (plan.inverse is not None) == (np.unique(ids).size < ids.size)  # small batches: any repeat


@settings(max_examples=200, deadline=None)
@given(gathers(), st.integers(1, 700), st.sampled_from([None, 2, 4096]))
def test_the_plan_is_pure_so_a_path_with_the_same_limits_may_reuse_it(case, other_rows, other_min):
    ids, max_rows, min_ids = case
    plan, again = plan_gather(ids, max_rows, min_ids), plan_gather(ids.copy(), max_rows, min_ids)
    assert plan.slices == again.slices and (plan.inverse is None) == (again.inverse is None)
    np.testing.assert_array_equal(plan.unique, again.unique)
    if plan.inverse is not None:
        np.testing.assert_array_equal(plan.inverse, again.inverse)
    assert plan.made_for(max_rows, min_ids)
    assert plan.made_for(other_rows, other_min) == ((other_rows, other_min) == (max_rows, min_ids))


def test_edges():
    empty = plan_gather(np.zeros(0, np.int64), 10, 2)
    assert empty.slices == () and empty.inverse is None and empty.unique.size == 0
    one = plan_gather(np.array([7, 7, 7], np.int64), 1, 2)
    assert one.unique.tolist() == [7] and one.inverse.tolist() == [0, 0, 0] and one.slices == ((0, 1),)
    split = plan_gather(np.arange(10, dtype=np.int64), 4, None)
    assert split.slices == ((0, 4), (4, 8), (8, 10)) and split.unique is split.ids
    for bad in (0, -1):
        with pytest.raises(ValueError, match="at least one row id"):
            plan_gather(np.arange(3, dtype=np.int64), bad, 2)
    with pytest.raises(Exception):  # frozen: a plan is never edited once made
        split.slices = ()
