"""``tableserver.common.take``: the native row gather and numpy's, bit-exact against plain indexing, and the
native one's refusals (anything it does not take goes to numpy's path, never to a wrong copy)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tableserver.common.take as take_module
from tableserver.common.take import in_range, native_check, native_take, numpy_take, take

ROWS, ROW_BYTES = 1000, 264
TABLE = np.random.default_rng(0).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
needs_native = pytest.mark.skipif(
    native_take is None, reason="native take off: not built (no C compiler at install) or TABLESERVER_NATIVE_TAKE=0"
)
TAKES = [
    pytest.param(numpy_take, id="numpy"),
    pytest.param(native_take, id="native", marks=needs_native),
    pytest.param(take, id="take"),
]


def test_native_built_where_required():
    """CI (.ci/run) installs a compiler and sets TABLESERVER_REQUIRE_NATIVE=1: the extension must build."""
    if os.environ.get("TABLESERVER_REQUIRE_NATIVE") == "1":
        assert take_module.NATIVE, (
            "tableserver.common._take did not build: install gcc and python3-dev, then pip install -e ."
        )


@pytest.mark.parametrize("fn", TAKES)
@pytest.mark.parametrize("shape", [(), (1,), (24,), (1536,), (3, 7), (2, 3, 4), (0,), (4, 0)])
def test_bit_exact_any_shape(fn, shape):
    ids = np.random.default_rng(len(shape)).integers(0, ROWS, shape)
    ids.reshape(-1)[:1] = ROWS - 1  # the last row too
    out = np.full(shape + (ROW_BYTES,), 7, np.uint8)
    assert fn(TABLE, ids, out) == ids.size
    np.testing.assert_array_equal(out, TABLE[ids])


@pytest.mark.parametrize("fn", TAKES)
@pytest.mark.parametrize("bad", [ROWS, ROWS + 5, -1, -(1 << 63), (1 << 63) - 1])
def test_bad_id_copies_nothing(fn, bad):
    ids = np.arange(40, dtype=np.int64)
    ids[[17, 30]] = bad
    out = np.full((40, ROW_BYTES), 7, np.uint8)
    pos = fn(TABLE, ids, out)
    assert pos < 0 and ids[-1 - pos] == bad
    assert (out == 7).all()  # nothing copied


@needs_native
def test_native_reports_the_first_bad_position():
    ids = np.arange(100, dtype=np.int64)
    ids[[41, 77]] = -3, ROWS
    assert native_take(TABLE, ids, np.empty((100, ROW_BYTES), np.uint8)) == -42


@needs_native
@pytest.mark.parametrize(
    "ids, out, error",
    [
        (np.arange(4, dtype=np.int32), np.empty((4, ROW_BYTES), np.uint8), TypeError),  # not int64
        (np.arange(4, dtype=np.uint64), np.empty((4, ROW_BYTES), np.uint8), TypeError),
        (np.arange(4).astype(">i8"), np.empty((4, ROW_BYTES), np.uint8), TypeError),  # byte-swapped
        (np.arange(4.0), np.empty((4, ROW_BYTES), np.uint8), TypeError),
        (np.arange(8)[::2], np.empty((4, ROW_BYTES), np.uint8), (TypeError, ValueError, BufferError)),  # strided
        (np.zeros(40, np.uint8)[4:36].view(np.int64), np.empty((4, ROW_BYTES), np.uint8), TypeError),  # unaligned
        (np.arange(4), np.empty((4, ROW_BYTES), np.int8), ValueError),  # out not uint8
        (np.arange(4), np.empty((4, ROW_BYTES + 1), np.uint8), ValueError),  # wrong row size
        (np.arange(4), np.empty((5, ROW_BYTES), np.uint8), ValueError),
        (np.arange(4), np.empty((1, 4, ROW_BYTES), np.uint8), ValueError),  # wrong ndim
        (np.arange(4), np.empty((ROW_BYTES, 4), np.uint8).T, (TypeError, ValueError, BufferError)),  # not C-contiguous
    ],
)
def test_native_refuses_what_it_does_not_take(ids, out, error):
    with pytest.raises(error):
        native_take(TABLE, ids, out)


@needs_native
def test_native_refuses_read_only_and_overlapping_buffers():
    out = np.empty((4, ROW_BYTES), np.uint8)
    out.flags.writeable = False
    with pytest.raises((TypeError, ValueError, BufferError)):
        native_take(TABLE, np.arange(4), out)
    raw = np.zeros(4 * ROW_BYTES + 64, np.uint8)  # ids living inside out: the copy would rewrite them
    ids = raw[:32].view(np.int64)
    with pytest.raises(ValueError, match="overlaps"):
        native_take(TABLE, ids, raw[: 4 * ROW_BYTES].reshape(4, ROW_BYTES))
    table = np.zeros((10, ROW_BYTES), np.uint8)  # out inside the table
    with pytest.raises(ValueError, match="overlaps"):
        native_take(table, np.arange(2), table[5:7])
    with pytest.raises(TypeError):
        native_take(TABLE.reshape(-1), np.arange(2), np.empty((2, ROW_BYTES), np.uint8))  # table not 2-D
    with pytest.raises(TypeError):
        native_take(TABLE, np.arange(2))


def test_take_falls_back_to_numpy_for_what_native_refuses():
    ids = np.arange(8)[::2]  # strided: native refuses, numpy takes it
    out = np.empty((4, ROW_BYTES), np.uint8)
    assert take(TABLE, ids, out) == 4
    np.testing.assert_array_equal(out, TABLE[ids])


@needs_native
def test_native_reads_from_a_read_only_mapping_past_4_gib_offsets():
    """Offsets past 2^32 bytes: a sparse file mapped read-only, rows written at both ends."""
    import mmap
    import tempfile

    rows = (5 << 30) // ROW_BYTES
    with tempfile.TemporaryFile(dir="/var/tmp") as f:
        f.truncate(rows * ROW_BYTES)
        ids = np.array([rows - 1, 3, (1 << 32) // ROW_BYTES, rows - 2], np.int64)
        for i in ids:
            f.seek(int(i) * ROW_BYTES)
            f.write(TABLE[int(i) % ROWS].tobytes())
        f.flush()
        with mmap.mmap(f.fileno(), rows * ROW_BYTES, prot=mmap.PROT_READ) as mm:
            table = np.frombuffer(mm, np.uint8).reshape(rows, ROW_BYTES)
            out = np.empty((4, ROW_BYTES), np.uint8)
            assert native_take(table, ids, out) == 4
            np.testing.assert_array_equal(out, TABLE[ids % ROWS])
            assert native_take(table, np.array([rows], np.int64), out[:1]) == -1
            del table


CHECKS = [pytest.param(None, id="numpy"), pytest.param(native_check, id="native", marks=needs_native)]


@pytest.mark.parametrize("native", CHECKS)
@pytest.mark.parametrize("n", [0, 1, 8, 9, 1536])
def test_in_range_both_paths(native, n, monkeypatch):
    monkeypatch.setattr(take_module, "native_check", native)
    ids = np.random.default_rng(n).integers(0, ROWS, n)
    assert in_range(ids, ROWS) and in_range(ids.reshape(1, -1), ROWS)
    if n:
        for bad in (ROWS, -1, -(1 << 63), (1 << 63) - 1):
            wrong = ids.copy()
            wrong[n // 2] = bad
            assert not in_range(wrong, ROWS)
        assert not in_range(ids, 0)
        assert in_range(ids[::2], ROWS)  # strided: numpy's path either way


@needs_native
def test_native_check_positions_and_refusals():
    ids = np.arange(50, dtype=np.int64)
    assert native_check(ids, 50) == -1 and native_check(ids, 49) == 49 and native_check(ids, 0) == 0
    ids[[7, 9]] = -1
    assert native_check(ids, 50) == 7
    assert native_check(np.zeros((0,), np.int64), 0) == -1
    with pytest.raises(ValueError):
        native_check(ids, -1)
    with pytest.raises(TypeError):
        native_check(ids.astype(np.int32), 50)
    with pytest.raises((TypeError, ValueError, BufferError)):
        native_check(ids[::2], 50)


def test_take_checked_raises_for_ids_changed_after_their_check():
    """Callers that checked the ids before (the shm copy thread, the servers) never report success for a
    gather that copied nothing: an id that has left the table since raises, naming it."""
    from tableclient.transports.shm import _Copy

    from tableserver.common.take import take_checked

    out = np.full((3, ROW_BYTES), 7, np.uint8)
    with pytest.raises(ValueError, match=r"row id 1000 at position 1 .*changed after they were checked"):
        take_checked(TABLE, np.array([1, ROWS, 2]), out)
    assert (out == 7).all()
    ids = np.array([4, 5, 6])
    copy = _Copy((TABLE, ids, out))  # an async shm take, queued after the caller's check
    ids[1] = ROWS + 3  # the caller changes its ids before the copy runs
    with pytest.raises(ValueError, match="changed after they were checked"):
        copy.wait(5)
    assert (out == 7).all()


def test_numpy_take_with_ids_inside_out():
    raw = np.zeros(4 * ROW_BYTES, np.uint8)
    ids = raw[:32].view(np.int64)
    ids[:] = [3, 1, 4, 1]
    want = TABLE[ids.copy()]
    assert numpy_take(TABLE, ids, raw.reshape(4, ROW_BYTES)) == 4
    np.testing.assert_array_equal(raw.reshape(4, ROW_BYTES), want)


@pytest.mark.parametrize("native", CHECKS)
def test_in_range_with_a_row_count_past_int64(native, monkeypatch):
    """No table has 2**63 rows, but a count that large is answered, not an OverflowError."""
    monkeypatch.setattr(take_module, "native_check", native)
    assert in_range(np.arange(20), 1 << 63) and not in_range(np.array([-1] * 20), 1 << 63)


@pytest.mark.parametrize("fn", [pytest.param(numpy_take, id="numpy"), pytest.param(take, id="take")])
@pytest.mark.parametrize("dtype", [">i8", ">i4", "<i4", "i2", ">i2", "i1", "u1", "u2", ">u8", "u8"])
def test_ids_of_any_integer_dtype_and_byte_order_are_the_rows_they_name(fn, dtype):
    """Before: numpy's path viewed every id array as uint64, so big-endian ids named byte-swapped rows and
    int8/int16 ids were read 8 bytes at a time -- wrong rows, no error. Now they are compared and taken
    as the numbers they are; a bad one is found and nothing is copied."""
    top = min(ROWS, np.iinfo(np.dtype(dtype)).max + 1)
    ids = np.array([0, 1, top - 1, 7, top // 2] * 5, dtype=dtype)
    out = np.full(ids.shape + (ROW_BYTES,), 9, np.uint8)
    assert in_range(ids, top) and fn(TABLE, ids, out) == ids.size
    np.testing.assert_array_equal(out, TABLE[ids.astype(np.int64)])
    if np.dtype(dtype).kind == "i":
        ids[3] = -1
        out[:] = 9
        assert not in_range(ids, top) and fn(TABLE, ids, out) == -1 - 3 and (out == 9).all()
    assert not in_range(np.array([5, 300], ">i2"), 256) and in_range(np.array([5, 255], ">i2"), 256)


@pytest.mark.parametrize("ids", [np.array([1.0, 2.0]), np.array([True, False]), np.array(["1"])])
def test_ids_that_are_not_integers_are_refused(ids):
    with pytest.raises(TypeError, match="row ids must be integers"):
        in_range(ids, 10)
    with pytest.raises(TypeError, match="row ids must be integers"):
        numpy_take(TABLE, ids, np.empty(ids.shape + (ROW_BYTES,), np.uint8))
