"""Buffers a socket copies rows into or out of, placed half a page off page alignment.

The kernel copies a tcp payload between the caller's buffer and its own socket pages, which start at
(or near) a page boundary. When the user buffer starts at the same offset within a 4 KiB page -- the
first 64 bytes of a page, as every large ``malloc``/``np.empty`` (an mmap, offset 16) and every
page-aligned pinned buffer does -- each load of the copy aliases a store a few bytes before it (the
CPU matches addresses on their low 12 bits: "4K aliasing") and the copy stalls, on the sending and
the receiving side alike (bench/bench_transports.py measures with such buffers; figures in
docs/perf.md and bench/README.md). Half a page is as far as an offset gets from the kernel's.
"""

from __future__ import annotations

import math

import numpy as np

PAGE = 4096
#: where in its page a copy buffer starts
OFFSET = PAGE // 2
#: smaller buffers are plain ``np.empty`` arrays: their copies are too short to stall for long, and a
#: page more for each would cost callers that keep many small results
PLACE_MIN = 16 << 10


def copy_buffer(nbytes: int) -> np.ndarray:
    """A 1-D uint8 array of ``nbytes``; from PLACE_MIN bytes on it starts OFFSET bytes into a page (a
    view into one allocation a page larger: its ``base`` is that allocation)."""
    if nbytes < PLACE_MIN:
        return np.empty(nbytes, dtype=np.uint8)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (OFFSET - raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def rows_buffer(shape, row_bytes: int) -> np.ndarray:
    """An uninitialised uint8 ``[*shape, row_bytes]`` array for gathered rows, placed like
    ``copy_buffer``: pass it as ``out`` to gathers over tcp."""
    try:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        row_bytes = int(row_bytes)
    except (TypeError, ValueError):
        raise ValueError(
            f"rows_buffer needs a shape of ints and an int row size, got {shape!r}, {row_bytes!r}"
        ) from None
    if any(s < 0 for s in shape) or row_bytes <= 0:
        raise ValueError(
            f"rows_buffer needs a shape of sizes >= 0 and row_bytes > 0 (a table's row size, e.g. "
            f"264), got {shape!r}, {row_bytes!r}"
        )
    return copy_buffer(math.prod(shape) * row_bytes).reshape(*shape, row_bytes)


def pinned_rows_buffer(torch, shape, row_bytes: int, pin: bool):
    """``rows_buffer`` as a torch uint8 tensor, in pinned memory when ``pin`` (a view into one
    allocation a page larger, which keeps it alive). Left unplaced where the page more would push a
    pinned allocation past a power of two (torch's host allocator rounds up to one: it would double)."""
    shape = tuple(int(s) for s in shape) + (int(row_bytes),)
    n = math.prod(shape)
    if n < PLACE_MIN or (pin and (n - 1).bit_length() != (n + PAGE - 1).bit_length()):
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
    raw = torch.empty(n + PAGE, dtype=torch.uint8, pin_memory=pin)
    start = (OFFSET - raw.data_ptr()) % PAGE
    return raw[start : start + n].view(shape)
