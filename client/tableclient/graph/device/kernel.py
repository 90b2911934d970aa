"""The kernel of graph mode ``device``: rows of a registered host table gathered by the GPU (Triton).

One program gathers ``BLOCK_R`` rows, each in words (8, 4 or 1 bytes: ``out``'s element type) so a
264-byte row is 33 loads of 8 bytes. The table's address is read from a one-element device tensor at
every run (so a captured graph follows a table registered anew), never baked into the graph; an id
outside ``[0, rows)``, a dead id (negative) and address 0 write a zero row and read nothing.
:data:`interpreted` runs the same function in Triton's interpreter, on CPU tensors (the tests, an
engine without a GPU); this module imports Triton, so it is imported only when a kernel is needed.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def gather_rows(pointer, ids, out, n, rows, WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.arange(0, BLOCK_W)
    live = r < n
    row = tl.load(ids + r, mask=live, other=-1).to(tl.int64)
    address = tl.load(pointer)
    ok = live & (row >= 0) & (row < rows) & (address != 0)
    row = tl.where(ok, row, 0)
    words = w[None, :] < WORDS
    table = address.to(tl.pointer_type(out.dtype.element_ty))
    v = tl.load(table + row[:, None] * WORDS + w[None, :], mask=ok[:, None] & words, other=0)
    tl.store(out + r[:, None] * WORDS + w[None, :], v, mask=live[:, None] & words)


#: on the GPU (compiled; interpreted where TRITON_INTERPRET=1 asks for it)
compiled = triton.jit(gather_rows)
#: on CPU tensors
interpreted = InterpretedFunction(gather_rows)
