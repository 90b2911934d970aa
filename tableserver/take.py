"""The row gather every path runs: ``take(table, row_ids, out)``, bounds-checked, into the caller's buffer.

``take`` copies ``table[row_ids]`` into ``out`` (shape ``row_ids.shape + (row_bytes,)``) and returns the
number of rows, or ``-1 - position`` of an id outside ``0..rows-1`` -- and then copies nothing. The shm
client's gathers, the tcp server's chunks, rdma's packed rows and dedup's expansion all use it.

It is native (``tableserver/_take.c``, built with the package where a C compiler is present) or numpy:

* native: one C pass checks the ids, then a copy loop that prefetches 16 rows ahead. A random gather
  is bound by memory latency, and ``np.take`` leaves the next rows' misses to the CPU: the prefetching
  loop measured 1.14-1.21x ``np.take(mode="clip")`` at 1,536 and 12,288 rows of 264 B on this
  project's VM. The check costs no Python calls either. Any buffer it does not take (dtype, shape,
  contiguity, overlap: TypeError or ValueError) goes to numpy's path, which the callers' general
  checks then word.
* numpy (no compiler at install, or ``TABLESERVER_NATIVE_TAKE=0``): ``in_range`` (one uint64
  ``argmax``), then ``np.take(mode="clip")`` -- "clip" copies without a temporary, and never reads
  outside the table even for ids changed meanwhile.

``NATIVE`` says which one runs; ``tableserver doctor`` and the benches print it.
"""

from __future__ import annotations

import os

import numpy as np

from tableserver.wire import in_range

try:
    from tableserver._take import take as native_take
except ImportError:  # built without a C compiler: numpy's path
    native_take = None

if os.environ.get("TABLESERVER_NATIVE_TAKE", "1") == "0":
    native_take = None

#: whether ``take`` is the native gather
NATIVE = native_take is not None


def numpy_take(table: np.ndarray, row_ids, out) -> int:
    """``take`` in numpy: any array-like ids numpy can index with (the checks before it saw to that)."""
    ids = np.asarray(row_ids)
    if ids.size and not in_range(ids, table.shape[0]):
        flat = ids.reshape(-1).view(np.uint64)
        return -1 - int(np.argmax(flat >= table.shape[0]))
    table.take(ids, axis=0, out=out, mode="clip")
    return ids.size


def _native_or_numpy(table: np.ndarray, row_ids, out) -> int:
    """``take`` natively, or in numpy for buffers the native one does not take."""
    try:
        return native_take(table, row_ids, out)
    except (TypeError, ValueError, BufferError):
        return numpy_take(table, row_ids, out)


take = _native_or_numpy if NATIVE else numpy_take
