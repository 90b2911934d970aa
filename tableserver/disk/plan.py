"""The disk tier's page plan: which pages a gather reads, in which batches, by which reads. Pure functions
over numpy arrays: no file, no fd, no engine (``tableserver.disk.reader.DiskTable`` does the I/O).

A table's :class:`Layout` says where row ``r`` lives: at logical byte ``offset + start(r)``, ``start(r) =
r * row_bytes``, or, page-aligned (``rows_per_page`` k), ``(r // k) * page + (r % k) * row_bytes``; logical
byte ``L`` of a table striped over ``files`` files with stripe unit ``stripe`` is in unit ``u = L // stripe``,
kept in file ``u % files`` at byte ``(u // files) * stripe + L % stripe``.

* :func:`pages_of` -- the distinct logical pages a gather touches, sorted, and where each row's bytes sit
  in them: the pages are placed in the pool in page order, so a row's pages are side by side there;
* :func:`batches_of` -- a plan that needs more pages than the pool holds, cut into batches of first pages
  read into the pool's two halves in turn (a straddling row's last pages carried over, not reread);
* :func:`reads_of` -- the reads of one batch's pages: runs contiguous in one file, at most
  ``MAX_RUN_PAGES`` long, each with the bytes it must get (a file's last page may end past the file).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: the longest run of contiguous pages read by one read (longer runs are cut, so that a gather of
#: neighbouring rows still spreads over the queue)
MAX_RUN_PAGES = 32


class Layout(NamedTuple):
    """Where a table's rows are: see the module. ``row_base``: the table row this reader's row 0 is (a
    shard of a page-aligned table); ``files``/``stripe``: striping (1/0: one file)."""

    offset: int
    rows: int
    row_bytes: int
    page: int
    rows_per_page: int = 0
    row_base: int = 0
    files: int = 1
    stripe: int = 0

    @property
    def span(self) -> int:
        """The most pages one row touches: a row of row_bytes starting anywhere in a page."""
        return (self.row_bytes + self.page - 2) // self.page + 1

    def row_start(self, r):
        """Logical byte (past ``offset``) of table row ``r`` (an int or an int64 array)."""
        k = self.rows_per_page
        if k:
            return (r // k) * self.page + (r % k) * self.row_bytes
        return r * self.row_bytes

    def end(self) -> int:
        """The logical byte past the last row."""
        return self.offset + (self.row_start(self.row_base + self.rows - 1) + self.row_bytes if self.rows else 0)

    def file_needs(self) -> list[int]:
        """Bytes of each file that hold part of the logical range [0, :meth:`end`)."""
        end, n = self.end(), self.files
        if n == 1:
            return [end]
        units, rem = divmod(end, self.stripe)
        return [
            ((units - i + n - 1) // n if units > i else 0) * self.stripe + (rem if i == units % n else 0)
            for i in range(n)
        ]

    def locate(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file index, byte offset in that file) of each logical page."""
        at = pages * self.page
        if self.files == 1:
            return np.zeros(len(pages), np.int64), at
        unit, inside = np.divmod(at, self.stripe)
        return unit % self.files, (unit // self.files) * self.stripe + inside


class Pages(NamedTuple):
    """A gather's pages (sorted, distinct logical page numbers) and, per row in the gather's order, the pool
    slot of its first page (``first``, its position in ``pages``), of its last (``last``) and the byte of
    the row within its first page (``within``): with the pages in the pool in order from slot 0, the row is
    at pool byte ``first * page + within``."""

    pages: np.ndarray
    first: np.ndarray
    last: np.ndarray
    within: np.ndarray


def pages_of(layout: Layout, ids: np.ndarray) -> Pages:
    """The pages rows ``ids`` (int64, in range) touch: the first and last page of each row (every page
    between for rows longer than a page), deduplicated."""
    page, rb = layout.page, layout.row_bytes
    start = layout.offset + layout.row_start(ids + layout.row_base if layout.row_base else ids)
    first = start // page
    last = (start + (rb - 1)) // page
    if layout.span == 2:
        pages = np.unique(np.concatenate((first, last)))
    else:  # rows longer than a page: every page between first and last
        pages = np.unique(np.minimum(first[:, None] + np.arange(layout.span), last[:, None]))
    fslot = np.searchsorted(pages, first)
    return Pages(pages, fslot, fslot + (last - first), start - first * page)


class Batch(NamedTuple):
    """One batch: the rows it serves (positions in the gather), its pages ``pages[lo:hi]``, of which the
    first ``keep`` the batch before holds already (moved over, not reread)."""

    rows: np.ndarray
    lo: int
    hi: int
    keep: int


class Batches(NamedTuple):
    """A gather's batches, read into ``halves`` regions of ``region`` pool pages in turn (batch k into
    region k % halves, from pool page (k % halves) * region)."""

    halves: int
    region: int
    parts: list[Batch]


def batches_of(plan: Pages, pool_pages: int, batch_pages: int, span: int) -> Batches:
    """``plan`` cut into batches for a pool of ``pool_pages`` pages (``batch_pages`` + span - 1): each row
    in exactly one batch, the one holding its first page; a batch's pages fit its region. Two halves when
    the pool has room for at least one first page per half, else one batch (of ``batch_pages`` first pages)
    at a time."""
    region = pool_pages // 2
    per = region - (span - 1)  # first pages per batch: a batch's rows may end span - 1 pages past its last
    halves = 2
    if per < 1:
        halves, region, per = 1, pool_pages, batch_pages
    nbatch = -(-len(plan.pages) // per)
    order = np.argsort(plan.first, kind="stable")
    sorted_first = plan.first[order]
    bounds = np.searchsorted(sorted_first, np.arange(nbatch + 1) * per).tolist()
    parts = []
    held_hi = 0
    for b in range(nbatch):
        if bounds[b] == bounds[b + 1]:
            continue
        rows = order[bounds[b] : bounds[b + 1]]
        lo = int(sorted_first[bounds[b]])
        hi = int(plan.last[rows].max()) + 1
        parts.append(Batch(rows, lo, hi, max(0, held_hi - lo)))
        held_hi = hi
    return Batches(halves, region, parts)


class Reads(NamedTuple):
    """One batch's reads (int64 arrays, a read an entry): the file index, the byte in it, the pool byte, the
    length and the bytes it must get; ``pages``: the pages they read."""

    pages: int
    file: np.ndarray
    at: np.ndarray
    dst: np.ndarray
    len: np.ndarray
    need: np.ndarray


def reads_of(layout: Layout, pages: np.ndarray, dst_page: int, needs: np.ndarray) -> Reads:
    """The reads of logical pages ``pages`` (sorted) into pool pages ``dst_page``, ``dst_page + 1``, ...:
    runs of pages contiguous in one file, at most MAX_RUN_PAGES long; ``needs``: each file's bytes
    (:meth:`Layout.file_needs`), past which a read may come back short."""
    npg = len(pages)
    files, at = layout.locate(pages)
    brk = np.empty(npg, bool)  # where a run starts: not the next page of the same file as the page before
    brk[:1] = True
    if layout.files == 1:
        np.not_equal(pages[1:], pages[:-1] + 1, out=brk[1:])
    else:
        brk[1:] = (at[1:] != at[:-1] + layout.page) | (files[1:] != files[:-1])
    starts = np.flatnonzero(brk)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1:] = npg
    if npg and (ends - starts).max() > MAX_RUN_PAGES:  # cut long runs
        lens = ends - starts
        pieces = -(-lens // MAX_RUN_PAGES)
        first = np.repeat(starts, pieces)
        k = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts = first + k * MAX_RUN_PAGES
        ends = np.minimum(starts + MAX_RUN_PAGES, np.repeat(ends, pieces))
    run_file = files[starts]
    run_at = at[starts]
    run_len = (ends - starts) * layout.page
    return Reads(
        npg, run_file, run_at, (starts + dst_page) * layout.page, run_len, np.minimum(run_len, needs[run_file] - run_at)
    )
