"""Rows in memory: ``in_range(row_ids, rows)``, the id check both sides run, and ``take(table, row_ids,
out)``, the row gather every path runs.

``take`` copies ``table[row_ids]`` into ``out`` (shape ``row_ids.shape + (row_bytes,)``) and returns the
number of rows, or ``-1 - position`` of an id outside ``0..rows-1`` -- and then copies nothing. The shm
client's gathers, the tcp server's chunks, rdma's packed rows and dedup's expansion all use it.
``in_range`` is the check before any request is sent or served; ``take_checked`` is ``take`` for ids
checked before, which raises if they changed since.

Both are native (``tableserver/common/_take.c``, built with the package where a C compiler is present) or numpy:

* native: one C pass checks the ids, then a copy loop that prefetches 16 rows ahead. A random gather
  is bound by memory latency, and ``np.take`` leaves the next rows' misses to the CPU, where the
  prefetching loop overlaps them (bench/bench_transports.py times both; figures in docs/perf.md). A
  check costs no numpy calls either, which matters with caches cold between two gathers. Any buffer
  the native code does not take (dtype, shape, contiguity, overlap: TypeError or ValueError) goes to numpy's path.
* numpy (no compiler at install, or ``TABLESERVER_NATIVE_TAKE=0``): ``in_range`` views the ids as
  uint64 (a negative id is huge) and takes one ``argmax``; ``take`` is ``in_range``, then
  ``np.take(mode="clip")`` -- "clip" copies without a temporary, and never reads outside the table even
  for ids changed meanwhile.

The same extension has dedup's pass (``native_unique``, used by ``tableclient.rowids.unique_inverse``):
each id once in first-occurrence order by hashing, where numpy sorts.

``NATIVE`` says which one runs; ``tableserver doctor`` and the benches print it.
"""

from __future__ import annotations

import os

import numpy as np

try:
    from tableserver.common._take import check as native_check
    from tableserver.common._take import take as native_take
    from tableserver.common._take import unique as native_unique
except ImportError:  # built without a C compiler: numpy's path
    native_check = native_take = native_unique = None

if os.environ.get("TABLESERVER_NATIVE_TAKE", "1") == "0":
    native_check = native_take = native_unique = None

#: whether ``take`` and ``in_range`` are native
NATIVE = native_take is not None

#: numpy's path checks up to this many ids as a Python list (no numpy call at all)
SMALL_IDS = 8


_INT64 = np.dtype(np.int64)


def _other_ints(ids) -> np.ndarray | None:
    """``ids`` as an array when they are integers other than native int64 (another width, unsigned,
    the other byte order), None for native int64; TypeError for anything but integers."""
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.dtype == _INT64:
        return None
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row ids must be integers, got {arr.dtype}")
    return arr


def _bad_positions(arr: np.ndarray, rows: int) -> np.ndarray:
    """Which ids of any integer dtype lie outside 0..rows-1 (compared as numbers, in their own dtype's
    byte order and width: nothing is reinterpreted)."""
    return (arr < 0) | (arr >= rows) if arr.dtype.kind == "i" else arr >= rows


def in_range(ids: np.ndarray, rows: int) -> bool:
    """Whether every id is in 0..rows-1. Native int64 ids take one pass (viewed as uint64 a negative id
    is huge); integers of another width, signedness or byte order are compared as the numbers they
    are; anything else is a TypeError.
    Both sides use it: the client before sending (or reading a mapping), the server before gathering.

    numpy's path: ``argmax`` rather than ``max``, which skips the ufunc reduction machinery, whose
    set-up costs several microseconds more per call, most of all with caches cold after a gather."""
    if native_check is not None:
        try:
            return native_check(ids, rows) < 0
        except (TypeError, ValueError, BufferError, OverflowError):
            pass  # not C-contiguous aligned int64 (or rows >= 2**63): numpy's path
    other = _other_ints(ids)
    if other is not None:
        return not other.size or not _bad_positions(other, rows).any()
    if ids.size <= SMALL_IDS:
        values = ids.ravel().tolist()
        return not values or (min(values) >= 0 and max(values) < rows)
    flat = ids.view(np.uint64)
    return flat.item(flat.argmax()) < rows  # argmax is a flat index for any shape; item() a Python int


def numpy_take(table: np.ndarray, row_ids, out) -> int:
    """``take`` in numpy: integer ids of any dtype, shape and byte order (others: TypeError)."""
    ids = np.asarray(row_ids)
    other = _other_ints(ids)
    rows = table.shape[0]
    if other is not None:
        if ids.size and _bad_positions(other, rows).any():
            return -1 - int(np.argmax(_bad_positions(other, rows).reshape(-1)))
        ids = other.astype(_INT64)  # every id is in 0..rows-1: the cast keeps each one's value
    elif ids.size and not in_range(ids, rows):
        flat = ids.reshape(-1).view(np.uint64)
        return -1 - int(np.argmax(flat >= rows))
    if np.may_share_memory(ids, out):
        ids = ids.copy()  # ids inside out: the copy would overwrite ids it has yet to read
    table.take(ids, axis=0, out=out, mode="clip")
    return ids.size


def _native_or_numpy(table: np.ndarray, row_ids, out) -> int:
    """``take`` natively, or in numpy for buffers the native one does not take."""
    try:
        return native_take(table, row_ids, out)
    except (TypeError, ValueError, BufferError):
        return numpy_take(table, row_ids, out)


take = _native_or_numpy if NATIVE else numpy_take


def take_checked(table: np.ndarray, row_ids, out) -> int:
    """``take`` for ids checked before: an id found outside the table when ``take`` checks them --
    another thread changed the ids after the caller's check -- raises ValueError, where ``take`` would
    leave ``out`` unwritten and say so only in its return value. Ids changed while the rows are being
    copied are not detected: the copy stays memory-safe (each id is clamped to the table where it is
    read), but the rows of such ids are whatever rows the clamped ids name, so leave row_ids alone
    until the gather is done."""
    n = take(table, row_ids, out)
    if n < 0:
        pos = -1 - n
        raise ValueError(
            f"row id {int(np.asarray(row_ids).reshape(-1)[pos])} at position {pos} is outside "
            f"0..{table.shape[0] - 1}: the ids changed after they were checked (leave row_ids "
            f"alone until the gather is done)"
        )
    return n
