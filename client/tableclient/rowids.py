"""Row-id and output-buffer checks: small pure functions over arrays.

Row ids may be any integer numpy array or CPU torch tensor of any shape
``[...]``; the rows come back as ``uint8 [..., row_bytes]``. Everything is
checked here, vectorized, before a request is built, so a bad call fails with
a ``ValueError`` that names the problem and sends nothing.
"""

from __future__ import annotations

import os

import numpy as np

from tableserver.common.buffers import rows_buffer
from tableserver.common.take import in_range, native_unique


def is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def to_row_ids(row_ids, rows: int, table: str) -> tuple[np.ndarray, bool]:
    """int64 C-contiguous ids (any shape) and whether the input was a torch tensor.

    One pass over int64 ids checks both bounds (viewed as uint64, a negative id is huge); the
    message naming the bad id is worked out only when the check fails."""
    if type(row_ids) is np.ndarray:
        arr, torch_in = row_ids, False
    else:
        torch_in = is_torch(row_ids)
        if torch_in:
            if row_ids.device.type != "cpu":
                raise ValueError(
                    f"row_ids is on {row_ids.device}: pass a CPU tensor (rows are gathered into "
                    "host memory; copy them to the device afterwards)"
                )
            if row_ids.dtype.is_floating_point or row_ids.dtype.is_complex:
                raise ValueError(f"row_ids must be integers, got a tensor of {row_ids.dtype}")
            arr = row_ids.detach().numpy()
        else:
            arr = np.asarray(row_ids)
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int64), torch_in
    if arr.dtype != np.int64:
        if arr.dtype.kind not in "iu":
            raise ValueError(f"row_ids must be integers, got {arr.dtype} (cast with .astype(np.int64))")
        _check_range(arr, rows, table)  # before the cast: a uint64 id >= 2**63 must not wrap
        return np.ascontiguousarray(arr, dtype=np.int64), torch_in
    if not in_range(arr, rows):
        _check_range(arr, rows, table)
    return np.ascontiguousarray(arr), torch_in


def _check_range(arr: np.ndarray, rows: int, table: str) -> None:
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"row id {lo} is negative: table {table!r} has rows 0..{rows - 1}")
    if hi >= rows:
        raise ValueError(f"row id {hi} is out of range: table {table!r} has rows 0..{rows - 1}")


def prepare_out(out, shape: tuple, row_bytes: int, torch_in: bool):
    """(numpy view to fill, object to return) for an ``out`` argument (or None)."""
    want = tuple(shape) + (row_bytes,)
    if out is None:
        arr = rows_buffer(shape, row_bytes)  # placed so a socket's copy into it does not 4K-alias
        if torch_in:
            import torch

            return arr, torch.from_numpy(arr)
        return arr, arr
    if type(out) is np.ndarray:
        pass
    elif is_torch(out):
        if out.device.type != "cpu":
            raise ValueError(f"out is on {out.device}: pass a CPU (ideally pinned) tensor")
        if str(out.dtype) != "torch.uint8" or not out.is_contiguous() or tuple(out.shape) != want:
            raise ValueError(
                f"out must be a contiguous torch.uint8 tensor of shape {want}, got {out.dtype} {tuple(out.shape)}"
            )
        return out.numpy(), out
    if not isinstance(out, np.ndarray):
        raise ValueError(f"out must be a numpy array or torch tensor, got {type(out).__name__}")
    if out.dtype != np.uint8 or out.shape != want or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            f"out must be a writable C-contiguous uint8 array of shape {want}, got {out.dtype} {out.shape}"
        )
    return out, out


#: dedup looks at this many ids first (a Python set of them: no numpy call, whose set-up alone costs
#: microseconds -- tens with caches cold after a gather) ...
DEDUP_SAMPLE = 64
#: ... and dedups the whole batch only when at least this share of the sample repeats: below it, the
#: dedup pass, a scratch buffer and the expanding copy cost more than the row bytes they save; uniform
#: random ids over a big table never get there
DEDUP_MIN_SHARE = 0.25


def dedup(flat_ids: np.ndarray, min_ids: int = 2) -> tuple[np.ndarray, np.ndarray | None]:
    """(unique ids, inverse) when ``flat_ids`` repeats ids enough for dedup to pay, else (flat_ids, None).

    Batches under ``min_ids`` (the transport's ``dedup_min_ids``: below it, fetching duplicates costs
    less than the expanding copy) are never deduplicated. Batches up to DEDUP_SAMPLE ids are
    deduplicated whenever they repeat an id (cheap at that size); larger ones only when a strided
    sample of DEDUP_SAMPLE ids, its repeats scaled to the batch (birthday), suggests DEDUP_MIN_SHARE
    repeats (Zipf-heavy batches: fetch each row once), so uniform random ids over a big table skip the
    dedup pass entirely. ``unique`` is in first-occurrence order natively, ascending on numpy's path
    (``unique_inverse``)."""
    n = flat_ids.size
    if n < max(2, min_ids):
        return flat_ids, None
    step = n // DEDUP_SAMPLE
    sample = (flat_ids[: step * DEDUP_SAMPLE : step] if step > 1 else flat_ids[:DEDUP_SAMPLE]).tolist()
    k = len(sample)
    repeats = k - len(set(sample))
    if n <= DEDUP_SAMPLE:
        if not repeats:
            return flat_ids, None
    elif repeats * n < DEDUP_MIN_SHARE * k * k:
        # k sampled ids with r repeats suggest ~r/k * n/k of the n ids repeat
        return flat_ids, None
    unique, inverse = unique_inverse(flat_ids)
    if unique.size == n:
        return flat_ids, None
    return unique, inverse


#: the native dedup's hash multiplier: random and odd, drawn per process (multiply-shift hashing is
#: universal over it, so no fixed set of ids -- say n-grams picked to collide -- probes long everywhere)
HASH_MULT = int.from_bytes(os.urandom(8), "little") | 1


def unique_inverse(flat_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique, inverse) of 1-D ids: each id once, and ``unique[inverse] == flat_ids``.

    Natively (``tableserver.common._take.unique``): one pass through an open-addressing hash table, ids in
    first-occurrence order, an order of magnitude faster than the sort below (docs/perf.md). Otherwise ``np.unique(return_inverse=True)``'s
    result, ids ascending, about twice as fast as np.unique: each id is packed with its position into
    one int64 key (id << k | position, k = bits of the batch size), so one plain ``sort`` of the keys
    replaces np.unique's indirect argsort and gathers. Ids that do not fit beside the position
    (negative, or >= 2**(63-k)) take np.unique itself."""
    n = flat_ids.size
    if native_unique is not None and n and flat_ids.dtype == np.int64:
        if not flat_ids.flags.c_contiguous:
            flat_ids = np.ascontiguousarray(flat_ids)
        unique, inverse = np.empty(n, np.int64), np.empty(n, np.intp)
        try:
            k = native_unique(flat_ids, unique, inverse, HASH_MULT)
        except (TypeError, ValueError, BufferError):
            pass  # unaligned, or a 32-bit intp: the sort
        else:
            return unique[:k], inverse
    return sorted_unique_inverse(flat_ids)


def sorted_unique_inverse(flat_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(flat_ids, return_inverse=True)`` for 1-D ids, by one sort of packed keys (see
    ``unique_inverse``)."""
    n = flat_ids.size
    bits = max(1, (n - 1).bit_length())
    wide = flat_ids.view(np.uint64) if flat_ids.dtype == np.int64 else None
    if n == 0 or wide is None or wide.item(wide.argmax()) >> (63 - bits):
        unique, inverse = np.unique(flat_ids, return_inverse=True)
        return unique, inverse.reshape(-1)
    keys = flat_ids << bits
    keys |= np.arange(n, dtype=np.int64)
    keys.sort()
    ids = keys >> bits
    first = np.empty(n, dtype=bool)  # where each run of equal ids starts
    first[0] = True
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    group = np.cumsum(first, dtype=np.intp)
    group -= 1
    inverse = np.empty(n, dtype=np.intp)
    inverse[keys & ((1 << bits) - 1)] = group
    return ids[first], inverse
