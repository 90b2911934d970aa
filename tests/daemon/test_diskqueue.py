"""The disk tier's queue (tableserver.disk.queue) over real files and the real read engines: a timed-out
or cancelled gather never writes into its buffer afterwards, a small gather goes before an owner that
floods the queue, row buffers stay inside the budget and each owner's share, and closing a reader waits
for the gather running on it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT

from tableserver.common.wire import Refused
from tableserver.disk.engines import HOLD
from tableserver.disk.queue import EXPRESS_SHARE, DiskBudget, DiskQueue
from tableserver.disk.reader import DiskTable

ROW_BYTES = 264
ROWS = 70_000
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dq") / "rows.bin"
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    data.tofile(path)
    return str(path), data


def _reader(path: str, **kw) -> DiskTable:
    return DiskTable(path, 0, ROWS, ROW_BYTES, **kw)


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not {what} after {timeout:g} s")
        time.sleep(0.01)


def test_timed_out_gather_never_writes_into_its_buffer_later(table_file):
    """Big gathers queued ahead (one owner): gather(timeout=0.2) raises, and none of its rows lands in
    ``out`` afterwards, however long the queue takes to drain (the rdma packer reuses that buffer)."""
    path, data = table_file
    rng = np.random.default_rng(1)
    with _reader(path, timeout=30.0) as reader:
        q = DiskQueue(reader, "rows")
        try:
            ahead = []
            for _ in range(6):
                ids = rng.integers(0, ROWS, 65_536)
                done = threading.Event()
                q.submit(ids, np.empty((ids.size, ROW_BYTES), np.uint8), lambda _j, d=done: d.set())
                ahead.append(done)
            ids = rng.integers(0, ROWS, 4096)
            out = np.full((ids.size, ROW_BYTES), SENTINEL, np.uint8)
            with pytest.raises(Refused, match="not done in time"):
                q.gather(ids, out, timeout=0.2)
            before = out.copy()
            for done in ahead:
                assert done.wait(120), "the queue did not drain"
            time.sleep(0.2)
            assert np.array_equal(out, before), (
                f"{int((out != before).any(axis=1).sum())} rows written after the timeout"
            )
            assert (out == SENTINEL).all()
        finally:
            q.close()


def test_cancelled_job_is_dropped_and_never_called_back(table_file):
    path, data = table_file
    with _reader(path) as reader:
        q = DiskQueue(reader, "rows", budget=DiskBudget(1 << 30, 1 << 30))
        try:
            blockers = [q.submit(np.arange(65_536), None, lambda _j: None, owner="a") for _ in range(3)]
            called = []
            job = q.submit(np.arange(10), None, called.append, owner="a")
            assert job.cancel()
            assert job.cancel()  # idempotent: still stopped
            for b in blockers:
                _wait(lambda b=b: b.rows is not None or b.error is not None, "admitted")
            _wait(lambda: q.queued == 0, "drained")
            assert not called and job.rows is None
            for b in blockers:
                assert b.error is None
                np.testing.assert_array_equal(b.rows, data[:65_536])
                b.release()
            assert q.budget.held == 0
        finally:
            q.close()


@pytest.mark.parametrize("express_rows", [256, 0], ids=["express-lane", "turns-only"])
def test_small_gather_goes_before_an_owner_that_floods_the_queue(table_file, express_rows):
    """Owner A queues eight 65,536-row gathers; owner B's 24-row gather, queued after them, is read before
    A's first gather is done (read beside A's slice on the express lane, or, without one, in the next
    turn: a turn is one slice, not a whole job), bit-exact."""
    path, data = table_file
    rng = np.random.default_rng(2)
    with _reader(path) as reader:
        q = DiskQueue(reader, "rows", budget=DiskBudget(1 << 30, 1 << 30), express_rows=express_rows)
        try:
            finished: list[str] = []
            lock = threading.Lock()

            def note(tag):
                def done(job):
                    with lock:
                        finished.append(tag)

                return done

            flood = [q.submit(rng.integers(0, ROWS, 65_536), None, note("a"), owner="a") for _ in range(8)]
            _wait(lambda: reader.gathers > 0, "reading A's first gather")
            ids = rng.integers(0, ROWS, 24)
            small = q.submit(ids, None, note("b"), owner="b")
            _wait(lambda: "b" in finished, "B's gather done")
            with lock:
                assert finished.index("b") == 0, f"B's gather finished after {finished.index('b')} of A's"
            np.testing.assert_array_equal(small.rows, data[ids])
            for job in flood:
                job.cancel()
        finally:
            q.close()


def test_main_lane_keeps_few_reads_in_flight_while_the_express_lane_has_work(table_file):
    """A short gather's reads wait at the drive behind every read in flight: whenever the express lane
    reads (and for EXPRESS_HOLD_S after), the main lane may keep only 1/EXPRESS_SHARE of its depth in
    flight; then its whole depth again. Short and flood rows stay bit-exact throughout."""
    path, data = table_file
    rng = np.random.default_rng(4)
    with _reader(path, queue_depth=64) as reader:
        q = DiskQueue(reader, "rows", budget=DiskBudget(1 << 30, 1 << 30))
        express = q.lanes[1].reader
        limits = []  # the main lane's limit at every read of the express lane
        read = express.gather

        def watched(*args, **kwargs):
            limits.append(reader.read_limit)
            return read(*args, **kwargs)

        express.gather = watched
        try:
            assert reader.read_limit == 64
            flood_ids = [rng.integers(0, ROWS, 65_536) for _ in range(8)]  # outlasts the short gathers
            first_done = threading.Event()
            flood = [q.submit(ids, None, lambda job: first_done.set(), owner="a") for ids in flood_ids]
            _wait(lambda: reader.gathers > 0, "reading A's first gather")
            for _ in range(5):
                ids = rng.integers(0, ROWS, 24)
                out = np.empty((24, ROW_BYTES), np.uint8)
                q.gather(ids, out, owner="b", timeout=EVENT_TIMEOUT)
                np.testing.assert_array_equal(out, data[ids])
            assert limits and limits == [64 // EXPRESS_SHARE] * len(limits), limits
            _wait(lambda: reader.read_limit == 64, "the main lane's depth given back")
            _wait(first_done.is_set, "A's first gather done")
            done = [job for job in flood if not job.cancel()]  # the rest stopped: the finished ones checked
            for job in done:
                ids = flood_ids[flood.index(job)]
                assert job.error is None
                np.testing.assert_array_equal(job.rows, data[ids])
                job.release()
        finally:
            q.close()
    assert reader.read_limit == 0


def test_rows_held_stay_inside_the_budget_and_each_owners_share(table_file):
    """Rows read but never released (responses a client never reads): an owner past its share waits, then
    is refused BUSY; another owner is still admitted; released rows admit the waiting ones."""
    path, data = table_file
    job_bytes = 4096 * ROW_BYTES
    budget = DiskBudget(6 * job_bytes, 2 * job_bytes)
    with _reader(path) as reader:
        q = DiskQueue(reader, "rows", budget=budget, admit_timeout=1.0)
        try:
            results: dict = {}

            def done(job):
                results[id(job)] = job.error

            a = [q.submit(np.arange(4096) + k, None, done, owner="a") for k in range(3)]
            _wait(lambda: id(a[1]) in results, "A's first two gathers done")
            assert budget.held == 2 * job_bytes and a[2].rows is None  # A's share is full: the third waits
            b = q.submit(np.arange(4096), None, done, owner="b")
            _wait(lambda: id(b) in results, "B's gather done")
            assert results[id(b)] is None and budget.held == 3 * job_bytes
            _wait(lambda: id(a[2]) in results, "A's third gather refused", timeout=10)
            assert "BUSY" in results[id(a[2])].describe() and "--disk-buffer-mib" in str(results[id(a[2])])
            a[0].release()
            a[0].release()  # idempotent
            again = q.submit(np.arange(4096), None, done, owner="a")
            _wait(lambda: id(again) in results, "A's next gather done")
            assert results[id(again)] is None
            np.testing.assert_array_equal(again.rows, data[:4096])
            for job in (a[1], b, again):
                job.release()
            assert budget.held == 0
        finally:
            q.close()


def test_close_waits_for_the_gather_running_on_the_reader(table_file):
    """close() from another thread while a gather's reads are held in the drive: it returns only after
    that gather ended, and the gather gets its rows bit-exact (nothing is freed under it)."""
    path, data = table_file
    reader = _reader(path, io="threads", timeout=20.0, pool_pages=64)
    engine = reader.io_engine  # its fault hook holds the reads covering one byte
    engine.inject(40 * 4096, HOLD)
    ids = np.arange(0, ROWS, 7)
    got: dict = {}

    def gather():
        try:
            got["rows"] = reader.gather(ids)
        except Exception as e:  # noqa: BLE001 (reported below)
            got["error"] = e
        got["ended"] = time.monotonic()

    g = threading.Thread(target=gather)
    g.start()
    _wait(lambda: engine.inflight > 0, "the gather reading")
    closed = {}
    c = threading.Thread(target=lambda: (reader.close(), closed.setdefault("at", time.monotonic())))
    c.start()
    time.sleep(0.3)
    engine.inject(0, 0)
    g.join(EVENT_TIMEOUT)
    c.join(EVENT_TIMEOUT)
    assert "error" not in got, got.get("error")
    np.testing.assert_array_equal(got["rows"], data[ids])
    assert closed["at"] >= got["ended"]
    with pytest.raises(ValueError, match="closed"):
        reader.gather(ids[:3])


def test_a_long_gather_progresses_under_steady_small_gathers(table_file):
    """Eight owners gather 96 rows in a loop while one owner's 65,536-row gather is queued: the long one is
    read too (an owner's tag survives its idle moments, so returning small owners do not start over ahead
    of it), bit-exact, and the small ones keep being served."""
    path, data = table_file
    with _reader(path) as reader:
        q = DiskQueue(reader, "rows", budget=DiskBudget(1 << 30, 1 << 30))
        stop = threading.Event()
        served = [0] * 8

        def small(k: int) -> None:
            rng = np.random.default_rng(k)
            while not stop.is_set():
                ids = rng.integers(0, ROWS, 96)
                out = np.empty((ids.size, ROW_BYTES), np.uint8)
                q.gather(ids, out, owner=f"small{k}")
                assert np.array_equal(out, data[ids])
                served[k] += 1

        threads = [threading.Thread(target=small, args=(k,), daemon=True) for k in range(8)]
        try:
            for t in threads:
                t.start()
            _wait(lambda: min(served) > 0, "every small owner served")
            ids = np.random.default_rng(99).integers(0, ROWS, 65_536)
            done = threading.Event()
            long_job = q.submit(ids, None, lambda _j: done.set(), owner="long")
            before = list(served)
            assert done.wait(120), f"the long gather read {long_job.next} of {ids.size} rows in 120 s"
            assert long_job.error is None
            np.testing.assert_array_equal(long_job.rows, data[ids])
            assert all(a > b for a, b in zip(served, before)), "small owners starved meanwhile"
        finally:
            stop.set()
            for t in threads:
                t.join(EVENT_TIMEOUT)
            q.close()
