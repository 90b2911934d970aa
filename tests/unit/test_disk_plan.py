"""The disk tier's page plan (tableserver.disk.plan) as pure logic, property-tested: no file, no engine.

For any layout (row-major or page-aligned, rows shorter or longer than a page, one file or striped, a shard's
row base) and any ids: the pages are exactly those the rows touch, each row's pages sit side by side in the
pool; batches serve every row once and fit their half of the pool; reads cover a batch's pages once, each
contiguous in one file, never longer than MAX_RUN_PAGES, and need no byte past a file's end."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tableserver.disk.plan import MAX_RUN_PAGES, Layout, batches_of, pages_of, reads_of


@st.composite
def layouts(draw) -> Layout:
    page = draw(st.sampled_from([512, 1024, 4096]))
    row_bytes = draw(st.integers(1, 3 * page))
    aligned = row_bytes <= page and draw(st.booleans())
    rows_per_page = draw(st.integers(1, page // row_bytes)) if aligned else 0
    row_base = draw(st.integers(0, 50)) if aligned else 0
    files = draw(st.integers(1, 4))
    stripe = page * draw(st.integers(1, 4)) if files > 1 else 0
    offset = draw(st.integers(0, 3 * page))
    rows = draw(st.integers(1, 3000))
    return Layout(offset, rows, row_bytes, page, rows_per_page, row_base, files, stripe)


@st.composite
def gathers(draw) -> tuple[Layout, np.ndarray]:
    layout = draw(layouts())
    ids = draw(st.lists(st.integers(0, layout.rows - 1), min_size=1, max_size=300))
    return layout, np.asarray(ids, np.int64)


def row_bytes_at(layout: Layout, r: int) -> tuple[int, int]:
    """A row's first logical byte and the byte past it, the slow way."""
    t = r + layout.row_base
    if layout.rows_per_page:
        start = (t // layout.rows_per_page) * layout.page + (t % layout.rows_per_page) * layout.row_bytes
    else:
        start = t * layout.row_bytes
    return layout.offset + start, layout.offset + start + layout.row_bytes


def file_byte(layout: Layout, logical: int) -> tuple[int, int]:
    if layout.files == 1:
        return 0, logical
    unit, inside = divmod(logical, layout.stripe)
    return unit % layout.files, (unit // layout.files) * layout.stripe + inside


@settings(max_examples=300, deadline=None)
@given(gathers())
def test_pages_are_exactly_those_the_rows_touch_and_a_rows_pages_sit_side_by_side(case):
    layout, ids = case
    plan = pages_of(layout, ids)
    want = set()
    for k, r in enumerate(ids.tolist()):
        lo, hi = row_bytes_at(layout, r)
        first, last = lo // layout.page, (hi - 1) // layout.page
        want.update(range(first, last + 1))
        assert plan.pages[plan.first[k]] == first and plan.pages[plan.last[k]] == last
        assert plan.last[k] - plan.first[k] == last - first  # consecutive pool slots: the row is contiguous there
        assert plan.within[k] == lo - first * layout.page
    assert plan.pages.tolist() == sorted(want)


@settings(max_examples=300, deadline=None)
@given(gathers(), st.integers(1, 40))
def test_batches_serve_every_row_once_and_fit_their_half_of_the_pool(case, batch_pages):
    layout, ids = case
    plan = pages_of(layout, ids)
    pool_pages = batch_pages + layout.span - 1
    halves, region, parts = batches_of(plan, pool_pages, batch_pages, layout.span)
    assert halves in (1, 2) and halves * region <= pool_pages
    served = np.concatenate([b.rows for b in parts])
    assert sorted(served.tolist()) == list(range(len(ids)))
    prev_hi = 0
    for b in parts:
        assert 0 < b.hi - b.lo <= region  # the batch's pages fit its region
        assert (plan.first[b.rows] >= b.lo).all() and (plan.last[b.rows] < b.hi).all()
        assert b.keep == max(0, prev_hi - b.lo)  # the pages the batch before read already, moved over
        assert b.lo >= prev_hi - b.keep
        prev_hi = b.hi
    assert prev_hi == len(plan.pages)


@settings(max_examples=300, deadline=None)
@given(gathers(), st.integers(0, 64))
def test_reads_cover_the_pages_once_each_contiguous_in_one_file(case, dst_page):
    layout, ids = case
    pages = pages_of(layout, ids).pages
    needs = np.asarray(layout.file_needs(), np.int64)
    r = reads_of(layout, pages, dst_page, needs)
    assert r.pages == len(pages)
    covered = []
    for f, at, dst, length, need in zip(r.file, r.at, r.dst, r.len, r.need, strict=True):
        n = length // layout.page
        assert length % layout.page == 0 and 1 <= n <= MAX_RUN_PAGES
        assert dst % layout.page == 0 and 0 < need <= length  # every read holds some of the table's bytes
        assert need == min(length, needs[f] - at)
        slot = dst // layout.page - dst_page
        for k in range(n):  # the k-th page of the read is the slot's logical page, in that file at that byte
            assert file_byte(layout, int(pages[slot + k]) * layout.page) == (f, at + k * layout.page)
        covered.extend(range(slot, slot + n))
    assert covered == list(range(len(pages)))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_each_file_holds_exactly_the_bytes_of_the_table_dealt_to_it(layout):
    needs = layout.file_needs()
    end = layout.end()
    assert sum(needs) == end  # every logical byte in exactly one file
    for f, need in enumerate(needs):  # the file's last byte is a table byte dealt to it
        if need:
            last = [L for L in range(max(0, end - layout.files * max(layout.stripe, 1) - 1), end)
                    if file_byte(layout, L)[0] == f]  # fmt: skip
            assert file_byte(layout, last[-1]) == (f, need - 1)
