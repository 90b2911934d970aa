"""A disk table reader's buffer pool: :class:`PagePool`, the one memory a
:class:`~tableserver.disk.reader.DiskTable` holds -- pages of an anonymous mapping (page-aligned, as O_DIRECT
wants) that its engine reads into and its rows are copied out of."""

from __future__ import annotations

import mmap

import numpy as np


class PagePool:
    """``pages`` pages of ``page`` bytes, mapped once; rows of ``row_bytes`` are copied out of it. ``map``
    (the mapping: the native engine's buffer), ``buf`` (a uint8 array of it), ``view`` (a memoryview of it:
    the Python engine's). :meth:`free` unmaps it; a pool a read may still write into is never freed (the
    reader drops it, and it stays mapped as long as anything holds it)."""

    def __init__(self, pages: int, page: int, row_bytes: int):
        self.page, self.row_bytes = page, row_bytes
        self.map = mmap.mmap(-1, pages * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self.map, np.uint8)
        self.view = memoryview(self.map)
        self._rows = None

    @property
    def nbytes(self) -> int:
        """Bytes mapped (0 once freed)."""
        return 0 if self.map.closed else len(self.map)

    def copy_rows(self, pos: np.ndarray, out2: np.ndarray) -> None:
        """Rows at byte positions ``pos`` of the pool into ``out2`` (one gather over a view of overlapping rows)."""
        if self._rows is None:
            buf = self.buf
            n = buf.size - self.row_bytes + 1
            self._rows = np.lib.stride_tricks.as_strided(
                buf, shape=(n, self.row_bytes), strides=(1, 1), writeable=False
            )
        # fancy indexing, not np.take: take makes a non-contiguous source C-contiguous first, i.e. copies
        # row_bytes times the pool
        out2[...] = self._rows[pos]

    def move(self, dst: int, src: int, pages: int) -> None:
        """``pages`` pages from pool byte ``src`` to pool byte ``dst``."""
        n = pages * self.page
        self.buf[dst : dst + n] = self.buf[src : src + n]

    def free(self) -> None:
        """Unmaps the pool, unless a caller still holds a view of it (the mapping then goes with that view)."""
        self._rows = self.buf = None
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass

    def drop_rows(self) -> None:
        """Lets go of the rows view (a pool left mapped to reads still in flight keeps its mapping)."""
        self._rows = None
