"""Pure logic: row-id checks, dedup, config precedence, wire framing, memory planning (no daemon, no torch:
torch ids and outputs are checked in tests/daemon/test_gather.py)."""

from __future__ import annotations

import argparse
import socket

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT
from tableclient.rowids import dedup, prepare_out, to_row_ids

from tableserver.common.wire import HEADER, FrameType, Status, recv_exact, request_header, response_header, send_all
from tableserver.config import SERVE_OPTIONS, add_flags, resolve
from tableserver.errors import ConfigError, MemoryLimitError
from tableserver.tables.memory import plan_memory


@pytest.mark.parametrize(
    "ids, message",
    [
        (np.array([0.0, 1.0]), "must be integers"),
        (np.array([True, False]), "must be integers"),
        (np.array(["1"]), "must be integers"),
        (np.array([-1, 3]), "row id -1 is negative"),
        (np.array([[0, 10]]), "row id 10 is out of range: table 't' has rows 0..9"),
        (np.array([2**63 + 5], dtype=np.uint64), "out of range"),
    ],
)
def test_bad_row_ids_raise_value_error(ids, message):
    with pytest.raises(ValueError, match=message):
        to_row_ids(ids, 10, "t")


def test_row_ids_normalized():
    ids, torch_in = to_row_ids(np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2], 10, "t")
    assert ids.dtype == np.int64 and ids.flags.c_contiguous and ids.shape == (2, 2) and not torch_in
    ids, _ = to_row_ids([], 10, "t")
    assert ids.shape == (0,) and ids.dtype == np.int64


def test_out_buffer_checks():
    arr, res = prepare_out(None, (2, 3), 8, torch_in=False)
    assert arr.shape == (2, 3, 8) and res is arr
    for bad in (
        np.zeros((2, 3, 7), np.uint8),
        np.zeros((2, 3, 8), np.int8),
        np.zeros((3, 2, 8), np.uint8).transpose(1, 0, 2),
        [1, 2],
    ):
        with pytest.raises(ValueError):
            prepare_out(bad, (2, 3), 8, torch_in=False)
    ro = np.zeros((2, 3, 8), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        prepare_out(ro, (2, 3), 8, torch_in=False)


def test_dedup():
    ids = np.array([5, 3, 5, 9, 3])
    unique, inverse = dedup(ids)
    assert sorted(unique.tolist()) == [3, 5, 9] and np.array_equal(unique[inverse], ids)
    same, inv = dedup(np.array([4, 1, 2]))
    assert inv is None and same.tolist() == [4, 1, 2]  # no duplicates: order kept, no copy
    rng = np.random.default_rng(5)
    uniform = rng.integers(0, 400_000_000, 12288)  # a real table's size: repeats too rare to pay
    assert dedup(uniform)[1] is None
    zipf = (rng.zipf(1.1, 12288) % 400_000_000).astype(np.int64)  # Zipf-heavy: each row fetched once
    unique, inverse = dedup(zipf)
    assert inverse is not None and unique.size < 0.7 * zipf.size and np.array_equal(unique[inverse], zipf)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(argv)


def test_config_precedence(tmp_path):
    cfg_file = tmp_path / "ts.toml"
    cfg_file.write_text('listen = "127.0.0.1:1"\nlease-seconds = 3.5\ntransports = ["tcp"]\nmlock = false\n')
    env = {"TABLESERVER_LISTEN": "127.0.0.1:2", "TABLESERVER_MAX_ROWS_PER_REQUEST": "77"}
    cfg = resolve(_parse(["--config", str(cfg_file), "--max-rows-per-request", "99"]), env)
    assert cfg["listen"] == "127.0.0.1:2"  # env beats file
    assert cfg["max_rows_per_request"] == 99  # flag beats env
    assert cfg["lease_seconds"] == 3.5 and cfg["transports"] == ["tcp"] and cfg["mlock"] is False
    assert resolve(_parse([]), {})["listen"] == "127.0.0.1:7070"
    assert resolve(_parse(["--no-verify"]), {"TABLESERVER_VERIFY": "1"})["verify"] is False
    assert {o.name for o in SERVE_OPTIONS} >= {"tables", "listen", "transports", "auth_token", "tls_cert"}


@pytest.mark.parametrize(
    "args, env, toml, message",
    [
        (["--lease-seconds", "abc"], {}, None, "--lease-seconds = 'abc': expected a number in 0.1..86400"),
        ([], {"TABLESERVER_MLOCK": "maybe"}, None, "TABLESERVER_MLOCK = 'maybe': expected true or false"),
        ([], {}, "bogus = 1\n", "unknown key 'bogus'"),
        ([], {}, "listen = [\n", "not valid TOML"),
        ([], {"TABLESERVER_MAX_ROWS_PER_REQUEST": "-3"}, None, "expected an integer in 1..1048576"),
    ],
)
def test_config_errors(tmp_path, args, env, toml, message):
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
        args = args + ["--config", str(tmp_path / "c.toml")]
    with pytest.raises(ConfigError, match=message):
        resolve(_parse(args), env)


def test_wire_roundtrip_over_a_real_socket_pair():
    a, b = socket.socketpair()
    ids = np.arange(1000, dtype="<i8")
    send_all(a, [request_header(FrameType.GATHER, 42, 3, ids.size), ids])
    head = bytearray(HEADER.size)
    assert recv_exact(b, memoryview(head))
    magic, ftype, _flags, req, table, count = HEADER.unpack(head)
    got = np.empty(count, "<i8")
    recv_exact(b, memoryview(got).cast("B"))
    assert (magic, ftype, req, table) == (b"TSQ1", FrameType.GATHER, 42, 3) and np.array_equal(got, ids)
    assert HEADER.unpack(response_header(2, Status.ROW_OUT_OF_RANGE, 42, 264, 5))[2] == Status.ROW_OUT_OF_RANGE
    a.close()
    assert recv_exact(b, memoryview(head)) is False  # clean EOF
    b.close()


def test_memory_plan_limits():
    plan = plan_memory([10 << 20, 1], hugepages="off")
    assert plan.page_sizes == (4096, 4096) and plan.total_bytes == (10 << 20) + 4096
    with pytest.raises(MemoryLimitError, match="available"):
        plan_memory([1 << 50], hugepages="off")
    with pytest.raises(MemoryLimitError, match="--hugepages 1g needs 2 free 1024 MiB hugepages"):
        plan_memory([(1 << 30) + 1], hugepages="1g")


def test_deploy_config_parses():
    import os

    from conftest import ROOT

    cfg = resolve(_parse(["--config", os.path.join(ROOT, "deploy", "tableserver.toml")]), {})
    assert cfg["tables"] == ["/var/lib/tableserver/engram.bin"] and cfg["tls_cert"] and cfg["auth_token_file"]


def test_ring_allocator_is_fifo_contiguous_and_never_overlaps():
    import random

    from tableserver.common.verbs import RingAllocator

    ring = RingAllocator(100)
    a, b = ring.alloc(60), ring.alloc(30)
    assert (a, b) == (0, 60) and ring.alloc(20) is None  # 10 left at the end, none at the start
    ring.free(b)
    assert ring.alloc(20) is None  # b is free but a (older) is not: space returns in order
    ring.free(a)
    assert ring.alloc(20) == 0 and ring.alloc(81) is None and ring.alloc(70) == 20
    with pytest.raises(ValueError):
        ring.alloc(101)
    rng = random.Random(0)
    ring, live = RingAllocator(64), {}
    for _ in range(5000):
        if live and (rng.random() < 0.5 or len(live) > 6):
            start = rng.choice(list(live))
            ring.free(start)
            del live[start]
        else:
            n = rng.randint(1, 40)
            start = ring.alloc(n)
            if start is not None:
                assert 0 <= start and start + n <= 64
                for s, m in live.items():
                    assert start + n <= s or s + m <= start, "overlap"
                live[start] = n


def test_rdma_flags():
    cfg = resolve(_parse(["--gid-index", "1", "--rdma-device", "rxe0", "--transports", "rdma,tcp"]), {})
    assert cfg["rdma_gid_index"] == "1" and cfg["rdma_device"] == "rxe0" and cfg["transports"] == ["rdma", "tcp"]
    assert resolve(_parse([]), {})["transports"] == ["auto"]


def test_dedup_only_when_it_pays():
    """Uniform random ids over a big table skip the sort; Zipf-heavy batches are fetched once per row;
    small batches are always deduplicated, unless under the transport's minimum."""
    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 384_000_000, 12_288)
    same, inverse = dedup(uniform)
    assert same is uniform and inverse is None
    zipf = (rng.zipf(1.1, 12_288) % 400_000).astype(np.int64)
    unique, inverse = dedup(zipf)
    assert unique.size < 0.6 * zipf.size and np.array_equal(unique[inverse], zipf)
    small = np.array([5, 1, 5, 2], np.int64)
    unique, inverse = dedup(small)
    assert sorted(unique.tolist()) == [1, 2, 5] and np.array_equal(unique[inverse], small)
    # below the transport's minimum nothing is deduplicated, Zipf-heavy or not
    same, inverse = dedup(zipf[:1536], min_ids=4096)
    assert same is not None and inverse is None and np.array_equal(same, zipf[:1536])
    assert dedup(zipf[:4096], min_ids=4096)[1] is not None


def _unique_cases(n):
    rng = np.random.default_rng(n)
    cases = [
        rng.integers(0, 5, n),
        rng.integers(0, 2**40, n),
        (rng.zipf(1.1, n) % 4_000_000).astype(np.int64),
        np.full(n, 2**62),
        rng.integers(-5, 5, n),
        np.arange(n)[::-1].copy(),
        rng.integers(0, 1000, 2 * n)[::2],
        rng.integers(0, 7, n).astype(np.int32),
    ]
    bits = max(1, (n - 1).bit_length())  # the packing boundary: the largest id that fits, the first that does not
    for top in (2 ** (63 - bits) - 1, 2 ** (63 - bits)):
        cases.append(np.where(rng.integers(0, 2, n) == 1, top, rng.integers(0, 50, n)).astype(np.int64))
    # extremes of int64, and ids spaced by a power of two (what a multiply-shift hash keeps apart worst)
    cases.append(np.where(rng.integers(0, 2, n) == 1, np.iinfo(np.int64).min, np.iinfo(np.int64).max))
    cases.append(rng.integers(0, 64, n) << 40)
    return cases


@pytest.mark.parametrize("n", [1, 2, 3, 64, 65, 1536, 12_288, 70_000])
def test_sorted_unique_inverse_is_np_unique(n):
    """numpy's path: the packed-key sort returns exactly np.unique's (unique, inverse), and falls back to
    np.unique for ids that do not fit beside their position (negative, near 2**63) or are not int64."""
    from tableclient.rowids import sorted_unique_inverse

    for ids in _unique_cases(n):
        unique, inverse = sorted_unique_inverse(ids)
        want_unique, want_inverse = np.unique(ids, return_inverse=True)
        assert unique.dtype == want_unique.dtype and np.array_equal(unique, want_unique)
        assert np.array_equal(inverse, want_inverse.reshape(-1)) and np.array_equal(unique[inverse], ids)


@pytest.mark.parametrize("n", [1, 2, 3, 64, 65, 1536, 12_288, 70_000])
def test_unique_inverse_has_each_id_once_in_first_occurrence_order(n):
    """The native hashing pass (numpy's sort where it is not built): each id exactly once, inverse maps
    back to every id, and natively the order is first occurrence."""
    from tableclient.rowids import unique_inverse

    from tableserver.common.take import native_unique

    for ids in _unique_cases(n):
        unique, inverse = unique_inverse(ids)
        assert np.array_equal(np.sort(unique), np.unique(ids)) and np.array_equal(unique[inverse], ids)
        assert inverse.dtype == np.intp and inverse.shape == (ids.size,)
        if native_unique is not None and ids.dtype == np.int64:
            _, first = np.unique(ids, return_index=True)
            assert np.array_equal(unique, ids[np.sort(first)])  # first-occurrence order


def test_native_unique_refuses_buffers_it_cannot_fill():
    """Wrong dtypes, short or overlapping outputs raise (unique_inverse then takes the sort); any
    multiplier works, even an even one (made odd), and 0 ids give 0."""
    from tableserver.common.take import native_unique

    if native_unique is None:
        pytest.skip("native take off: not built (no C compiler at install) or TABLESERVER_NATIVE_TAKE=0")
    ids = np.array([7, 7, 1], np.int64)
    u, v = np.empty(3, np.int64), np.empty(3, np.int64)
    with pytest.raises(TypeError):
        native_unique(ids.astype(np.int32), u, v, 3)
    with pytest.raises(TypeError):
        native_unique(ids, u.astype(np.float64), v, 3)
    with pytest.raises(ValueError, match="as many"):
        native_unique(ids, u[:2], v, 3)
    with pytest.raises(ValueError, match="overlap"):
        native_unique(ids, ids, v, 3)
    ro = np.empty(3, np.int64)
    ro.flags.writeable = False
    with pytest.raises((BufferError, TypeError, ValueError)):
        native_unique(ids, ro, v, 3)
    for mult in (0, 2, 2**64 - 1):
        assert native_unique(ids, u, v, mult) == 2 and u[:2].tolist() == [7, 1] and v.tolist() == [0, 0, 1]
    assert native_unique(np.empty(0, np.int64), u, v, 3) == 0


def shm_metrics(registry):
    """Client metrics in ``registry`` and the label values of table t, layer 1, shm reads."""
    from tableclient.metrics import ClientMetrics

    return ClientMetrics(registry), ("t", "1", "shm")


def registry_samples(registry) -> dict:
    """{(sample name, labels): value} of every sample but the *_created timestamps (when each registry
    was made); collecting first applies what a FlushFirst in the registry guards."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }


def test_deferred_gathers_are_applied_by_the_next_scrape():
    """The fast paths defer their metrics; a collection of the registry applies them first (so a scrape
    sees every gather), exactly as prometheus_client's own inc() and observe() per gather would, the
    split ``count`` at issue and ``observe`` at the wait included."""
    from prometheus_client import CollectorRegistry
    from tableclient.metrics import GatherRecorder

    from tableserver.common.recorder import MAX_DEFERRED, FlushFirst

    now_reg, later_reg = CollectorRegistry(), CollectorRegistry()
    guard = FlushFirst()  # first in its registry, as the client's is in the process's
    later_reg.register(guard)
    m, labels = shm_metrics(now_reg)
    lm, _ = shm_metrics(later_reg)
    later = guard.add(
        GatherRecorder(
            lm.gather_latency.labels(*labels, "read"),
            lm.rows.labels(*labels),
            lm.unique_rows.labels(*labels),
            lm.bytes.labels(*labels),
        )
    )
    edges = [0.0, 2e-6, 2.5e-6, 4e-6, 1e-4, 0.3, 0.5, 7.0]
    values = edges + list(np.random.default_rng(1).exponential(1e-3, 2 * MAX_DEFERRED))
    for i, seconds in enumerate(values):
        m.rows.labels(*labels).inc(i + 1)
        m.unique_rows.labels(*labels).inc(i)
        m.bytes.labels(*labels).inc(264 * i)
        m.gather_latency.labels(*labels, "read").observe(float(seconds))
        if i % 3:
            later.defer(i + 1, i, 264 * i, float(seconds))
        else:
            later.count(i + 1, i, 264 * i)
            later.observe(float(seconds))
    assert 0 < later.pending < MAX_DEFERRED  # applied inline once that many waited, some still waiting

    got, want = registry_samples(later_reg), registry_samples(now_reg)  # collecting applies the rest
    assert later.pending == 0 and got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key
    count = later_reg.get_sample_value(
        "tableserver_client_gather_duration_seconds_count",
        {"table": "t", "layer": "1", "transport": "shm", "mode": "read"},
    )
    assert count == len(values)


def test_flag_wakes_every_waiter_and_times_out():
    import threading
    import time

    from tableclient.transports.base import Flag

    flag = Flag()
    assert not flag.is_set() and not flag.wait(0.01) and not flag.wait(0)
    woken = []
    waiters = [threading.Thread(target=lambda: woken.append(flag.wait(10))) for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.05)
    flag.set()
    flag.set()  # idempotent
    for t in waiters:
        t.join(EVENT_TIMEOUT)
    assert woken == [True] * 4 and flag.wait() and flag.wait(0) and flag.is_set()


def test_server_gather_metrics_are_deferred_and_applied_by_a_scrape():
    """The daemon's per-request metrics (rows, bytes, latency) wait in a deque; collecting its registry
    applies them first, equal to prometheus_client's own inc() and observe() per request."""
    from prometheus_client import CollectorRegistry

    from tableserver.metrics import ServerMetrics

    now, later = ServerMetrics(CollectorRegistry()), ServerMetrics(CollectorRegistry())
    recorder = later.gather_op("tcp", "gather", "t")
    for i, seconds in enumerate(np.random.default_rng(2).exponential(1e-3, 3000).tolist()):
        now.gather_rows.labels("t", "tcp", "gather").inc(i + 1)
        now.gather_bytes.labels("t", "tcp", "gather").inc(264 * (i + 1))
        now.gather_latency.labels("tcp", "gather").observe(seconds)
        recorder.defer(i + 1, 264 * (i + 1), seconds)
    assert recorder.pending  # some still waiting ...

    def gathers(registry):  # sums compare approximately (added in another order)
        return {k: v for k, v in registry_samples(registry).items() if k[0].startswith("tableserver_gather_")}

    got = gathers(later.registry)  # ... applied by the scrape, bucket for bucket
    assert recorder.pending == 0 and got == pytest.approx(gathers(now.registry), rel=1e-12)
    labels = {"op": "gather", "table": "t", "transport": "tcp"}
    assert later.registry.get_sample_value("tableserver_gather_rows_total", labels) == 3000 * 3001 / 2


def test_copy_buffers_start_half_a_page_in():
    """Buffers a socket copies rows into or out of start OFFSET bytes into a page (no 4K aliasing with
    the kernel's page-aligned socket pages), whatever their size and shape; pinned ones too."""
    from tableserver.common.buffers import OFFSET, PAGE, PLACE_MIN, copy_buffer, rows_buffer

    for n in (PLACE_MIN, 405_504, 5 << 20):
        b = copy_buffer(n)
        assert b.size == n and b.dtype == np.uint8 and b.ctypes.data % PAGE == OFFSET
        assert b.flags.c_contiguous and b.flags.writeable
    for n in (0, 1, 264, PLACE_MIN - 1):  # small ones are plain arrays: no page more each
        b = copy_buffer(n)
        assert b.size == n and b.flags.owndata
    for shape, want in (((64, 24), (64, 24, 264)), (1536, (1536, 264)), ((), (264,))):
        r = rows_buffer(shape, 264)
        assert r.shape == want and r.flags.c_contiguous and (r.ctypes.data % PAGE == OFFSET or r.nbytes < PLACE_MIN)
    for shape, row_bytes in ((-1, 264), ((2, 3), 0), ((2, "x"), 264)):
        with pytest.raises(ValueError, match="rows_buffer needs"):
            rows_buffer(shape, row_bytes)


def test_a_flush_waits_for_one_in_progress():
    """Two flushes at once (a scrape and a worker's inline flush): the second returns only after the
    first has applied what it popped, so a scrape never reads a count still in flight."""
    import threading

    from prometheus_client import CollectorRegistry, Counter

    from tableserver.common.recorder import Recorder

    registry = CollectorRegistry()
    rows = Counter("rows", "rows", registry=registry)
    entered, go = threading.Event(), threading.Event()

    class Latency:  # a histogram child whose observe holds the first flush between popping and applied
        def observe(self, seconds):
            entered.set()
            assert go.wait(EVENT_TIMEOUT)

    recorder = Recorder(Latency(), rows)
    recorder.defer(1, 1e-4)
    first = threading.Thread(target=recorder.flush)
    first.start()
    assert entered.wait(EVENT_TIMEOUT) and recorder.pending == 0  # popped, being applied
    recorder.count(2)  # counted only: no latency to observe
    second = threading.Thread(target=recorder.flush)
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waits for the first ...
    go.set()
    first.join(EVENT_TIMEOUT)
    second.join(EVENT_TIMEOUT)
    assert not second.is_alive() and recorder.pending == 0  # ... then applies what it found
    assert registry.get_sample_value("rows_total") == 3
