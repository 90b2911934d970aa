"""Surviving a memory node, on loopback: reconnect, identity, replicas, fail-over, hedging, shards.

Real daemons (several per test), real sockets; every row checked bit-exact against the table file. The
same scenarios across network namespaces (separate hosts, dropped packets, DNS) are in test_multihost.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, start_daemon, wait_for
from tableclient import ConnectError, TableClient
from tests_helpers import free_port_block, freeze, scrape, value

from tableserver.tables.demo import DemoTable, write_demo_file

TABLES = [DemoTable("engram.layer1", 30_000, 264, 1), DemoTable("engram.layer14", 40_001, 264, 14)]


@pytest.fixture(scope="module")
def v1(tmp_path_factory):
    return write_demo_file(str(tmp_path_factory.mktemp("v1") / "v1.bin"), TABLES, seed=1)


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    """Same names and sizes, other rows: another version of the tables."""
    return write_demo_file(str(tmp_path_factory.mktemp("v2") / "v2.bin"), TABLES, seed=2)


def node(tmp_path, name, table, port=None, *flags):
    port = port or free_port_block()
    return start_daemon(
        str(tmp_path / name),
        "--tables",
        table,
        "--listen",
        f"127.0.0.1:{port}",
        "--transports",
        "tcp",
        "--node-id",
        name,
        *flags,
    )


def check(client, local, rng, n=2000):
    for name in ("engram.layer1", "engram.layer14"):
        ids = rng.integers(0, local[name].shape[0], n)
        np.testing.assert_array_equal(client.table(name).gather(ids, timeout=EVENT_TIMEOUT), local[name][ids])


def test_reconnects_after_a_restart_and_fails_fast_while_down(tmp_path, v1):
    local = local_tables(v1)
    port = free_port_block()
    d = node(tmp_path, "a", v1, port)
    rng = np.random.default_rng(0)
    from prometheus_client import REGISTRY

    reconnects = REGISTRY.get_sample_value("tableserver_client_reconnects_total") or 0
    with TableClient(d.address, transport="tcp") as c:
        check(c, local, rng)
        d.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="is up .*reconnects in the background"):
            wait_for(lambda: c.replicas()[d.address]["state"] == "down", "the client to notice the loss")
            c.table("engram.layer1").gather([1, 2, 3], timeout=EVENT_TIMEOUT)
        assert time.monotonic() - t0 < EVENT_TIMEOUT  # failed fast, not after the timeout
        d = node(tmp_path, "a2", v1, port)  # the same address, restarted
        wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
        check(c, local, rng)
    assert REGISTRY.get_sample_value("tableserver_client_reconnects_total") >= reconnects + 1
    d.stop()


def test_a_restarted_node_with_other_data_is_refused_never_read(tmp_path, v1, v2):
    local = local_tables(v1)
    port = free_port_block()
    d = node(tmp_path, "a", v1, port)
    from prometheus_client import REGISTRY

    refusals = REGISTRY.get_sample_value("tableserver_client_version_refusals_total") or 0
    with TableClient(d.address, transport="tcp") as c:
        check(c, local, np.random.default_rng(1))
        d.stop(signal.SIGKILL)
        d = node(tmp_path, "a2", v2, port)  # same address, same names, other rows
        wait_for(lambda: c.replicas()[d.address]["state"] == "refused", lambda: f"a refusal: {c.replicas()}")
        assert "pinned sha256:" in c.replicas()[d.address]["error"]
        with pytest.raises(ConnectError, match="refused"):
            c.table("engram.layer1").gather([5], timeout=EVENT_TIMEOUT)
    assert REGISTRY.get_sample_value("tableserver_client_version_refusals_total") > refusals
    # a client that pins the version it expects refuses a node with another from the start
    with pytest.raises(ConnectError, match="refused"):
        TableClient(d.address, transport="tcp", checksums={"engram.layer1": local_checksum(v1, "engram.layer1")})
    d.stop()


def local_checksum(path, name):
    from tableserver.tables.tablefile import read_header

    return next(s.checksum for s in read_header(path).tables if s.name == name)


def test_shm_client_releases_a_dead_servers_memory(tmp_path, v1):
    d = start_daemon(str(tmp_path / "d"), "--tables", v1)
    c = TableClient(d.address, transport="shm")
    try:
        assert c.transport == "shm"
        maps = lambda: [ln for ln in open(f"/proc/{os.getpid()}/maps") if "tableserver:" in ln]  # noqa: E731
        assert maps(), "the tables are not mapped"
        d.stop(signal.SIGKILL)
        wait_for(lambda: not maps(), "the mapping of the dead server's tables to be released")
        with pytest.raises(ConnectError):
            c.table("engram.layer1").gather([0], timeout=EVENT_TIMEOUT)
    finally:
        c.close()


def test_a_frozen_node_is_detected_by_its_silence(tmp_path, v1):
    d = node(tmp_path, "a", v1)
    with TableClient(d.address, transport="tcp", liveness_timeout=1.0) as c:
        check(c, local_tables(v1), np.random.default_rng(2))
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: c.replicas()[d.address]["state"] == "down", "the frozen node to be failed")
            assert "no keepalive answer" in c.replicas()[d.address]["error"]
            t0 = time.monotonic()
            with pytest.raises(ConnectError):
                c.table("engram.layer1").gather([1], timeout=EVENT_TIMEOUT)
            assert time.monotonic() - t0 < 5  # no hang on a frozen server
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
    d.stop()


@pytest.fixture
def three(tmp_path, v1):
    nodes = [node(tmp_path, f"n{k}", v1) for k in range(3)]
    yield nodes
    for d in nodes:
        d.stop()


def test_clients_spread_by_rendezvous_and_only_a_dead_nodes_clients_move(three, v1):
    addresses = ",".join(d.address for d in three)
    primaries = {}
    # a node is down only when it is: 12 clients' keepalives in one process on a busy machine run late, and a live
    # node taken for frozen would move its clients (SIGKILL ends the victim's streams at once: no wait for that)
    clients = [
        TableClient(addresses, transport="tcp", client_id=f"worker-{k}", liveness_timeout=60.0) for k in range(12)
    ]
    try:
        for k, c in enumerate(clients):
            primaries[k] = c.read_from("engram.layer1")
        assert len(set(primaries.values())) == 3  # 12 clients over 3 nodes: every node has some
        victim = three[0]
        victim.stop(signal.SIGKILL)
        local = local_tables(v1)
        rng = np.random.default_rng(3)
        for c in clients:
            check(c, local, rng, 300)  # fail-over: every gather still bit-exact
        for k, c in enumerate(clients):
            now = c.read_from("engram.layer1")
            if primaries[k] != victim.address:
                assert now == primaries[k]  # the others' clients stay where they were
            else:
                assert now != victim.address
    finally:
        for c in clients:
            c.close()


def test_kill_mid_stream_fails_over_bit_exact(three, v1):
    from prometheus_client import REGISTRY

    local = local_tables(v1)
    failovers = REGISTRY.get_sample_value("tableserver_client_failovers_total") or 0
    with TableClient(",".join(d.address for d in three), transport="tcp", client_id="mid", liveness_timeout=60.0) as c:
        primary = c.read_from("engram.layer14")
        rng = np.random.default_rng(4)
        batches = [rng.integers(0, 40_001, 20_000) for _ in range(8)]
        handles = [c.table("engram.layer14").gather_async(ids) for ids in batches]
        next(d for d in three if d.address == primary).stop(signal.SIGKILL)  # with requests in flight
        for ids, h in zip(batches, handles):
            np.testing.assert_array_equal(h.wait(EVENT_TIMEOUT), local["engram.layer14"][ids])
        check(c, local, rng)
    assert REGISTRY.get_sample_value("tableserver_client_failovers_total") >= failovers


def test_hedged_read_wins_over_a_frozen_primary(three, v1):
    from prometheus_client import REGISTRY

    local = local_tables(v1)

    def counts():
        return {
            k: REGISTRY.get_sample_value(name, labels) or 0
            for k, name, labels in (
                ("won", "tableserver_client_hedges_total", {"outcome": "won"}),
                ("issued", "tableserver_client_hedges_total", {"outcome": "issued"}),
                ("failovers", "tableserver_client_failovers_total", {}),
            )
        }

    won = counts()["won"]
    with TableClient(
        ",".join(d.address for d in three), transport="tcp", client_id="hedge", liveness_timeout=60.0
    ) as c:  # only the hedge can save these gathers
        # the replica this client reads first (rendezvous), once its session is up: a client may start on
        # another one while the first one's session is still opening, and move back to it after
        first = c.shards("engram.layer1")[0].replicas[0].address
        wait_for(lambda: c.read_from("engram.layer1") == first, "the first replica's session")
        # and the warm standby's (on a busy machine it may still be opening): the hedge needs one to go to
        wait_for(lambda: sum(r["state"] == "up" for r in c.replicas().values()) >= 2, "the standby's session")
        primary = next(d for d in three if d.address == first)
        ids = np.arange(0, 30_000, 7)
        freeze(primary.proc.pid)  # every thread stopped before the gather: none can still answer it
        try:
            t0 = time.monotonic()
            rows = c.table("engram.layer1").gather(ids, timeout=EVENT_TIMEOUT, hedge_after=0.02)
            elapsed = time.monotonic() - t0
            np.testing.assert_array_equal(rows, local["engram.layer1"][ids])
            assert elapsed < 10, elapsed  # not held up by the frozen primary (the liveness check is at 60 s)
        finally:
            os.kill(primary.proc.pid, signal.SIGCONT)
        state = c.replicas()
    assert counts()["won"] >= won + 1, (counts(), first, state)


def test_two_shards_times_two_replicas(tmp_path, v1):
    """--shard 0/2 and 1/2, each on two nodes: ids routed to their shard and scattered back in order; a
    node of each shard killed, every row still bit-exact."""
    nodes = [node(tmp_path, f"s{k}r{r}", v1, None, "--shard", f"{k}/2") for k in range(2) for r in range(2)]
    local = local_tables(v1)
    try:
        with TableClient(",".join(d.address for d in nodes), transport="tcp", client_id="sharded") as c:
            assert c.tables["engram.layer1"].rows == 30_000  # the whole table, over two shards
            rng = np.random.default_rng(5)
            check(c, local, rng)
            for shape in ((64, 24), (0,), (3, 0, 2)):
                ids = rng.integers(0, 30_000, shape)
                np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), local["engram.layer1"][ids])
            edge = np.array([0, 14_999, 15_000, 29_999, 15_000, 0])  # both sides of the shard boundary, twice
            np.testing.assert_array_equal(c.table("engram.layer1").gather(edge), local["engram.layer1"][edge])
            for k in range(2):  # one node of each shard dies
                victim = c.shards("engram.layer1")[k].replicas[0]
                next(d for d in nodes if d.address == victim.address).stop(signal.SIGKILL)
            check(c, local, rng)
    finally:
        for d in nodes:
            d.stop()


@pytest.fixture(scope="module")
def one_table(tmp_path_factory):
    return write_demo_file(str(tmp_path_factory.mktemp("one") / "one.bin"), [DemoTable("t", 20_000, 264, 1)], seed=3)


def test_a_shard_that_restarts_with_another_range_never_yields_an_unwritten_row(tmp_path, one_table):
    """Before: b restarted with rows 10000:15000 of 0:20000 (same checksum, so re-admitted), the router's
    rebuilt map no longer tiled the table, ids >= 15000 fell past the last shard and the caller got
    unwritten scratch memory as their rows, with no error. Now they fail naming the rows no node holds,
    the others stay bit-exact, and overlapping or nested layouts are routed to nodes holding the rows."""
    local = local_tables(one_table)["t"]
    port_b = free_port_block()
    started = [
        node(tmp_path, "a", one_table, None, "--rows", "0:10000"),
        node(tmp_path, "b", one_table, port_b, "--rows", "10000:20000"),
    ]
    every = np.arange(20_000)
    try:
        with TableClient(",".join(d.address for d in started), transport="tcp") as c:
            t = c.table("t")
            np.testing.assert_array_equal(t.gather(every, timeout=EVENT_TIMEOUT), local)

            def restart_b(rows: str, name: str):
                b = started[-1]
                b.stop(signal.SIGKILL)
                wait_for(lambda: c.replicas()[b.address]["state"] == "down", "the client to notice b's loss")
                started.append(node(tmp_path, name, one_table, port_b, "--rows", rows))
                wait_for(lambda: c.replicas()[b.address]["state"] == "up", lambda: f"b to be back: {c.replicas()}")

            restart_b("10000:15000", "b2")
            with pytest.raises(ConnectError, match=r"rows 15000\.\.19999 of 't' are on no node"):
                t.gather(np.array([3, 12_000, 19_999]), timeout=EVENT_TIMEOUT)
            with pytest.raises(ConnectError, match=r"rows 15000\.\.19999 of 't' are on no node"):
                t.gather_async(every).wait(EVENT_TIMEOUT)
            held = np.arange(15_000)
            np.testing.assert_array_equal(t.gather(held, timeout=EVENT_TIMEOUT), local[held])

            restart_b("5000:20000", "b3")  # overlapping a's range: 5000..9999 on both
            np.testing.assert_array_equal(t.gather(every, timeout=EVENT_TIMEOUT), local)
            restart_b("0:20000", "b4")  # a's range nested in b's
            ids = np.random.default_rng(7).integers(0, 20_000, 5000)
            np.testing.assert_array_equal(t.gather(ids, timeout=EVENT_TIMEOUT), local[ids])
            np.testing.assert_array_equal(t.gather(every, timeout=EVENT_TIMEOUT), local)
    finally:
        for d in started:
            d.stop()


def test_a_part_whose_rows_come_to_span_two_segments_is_split_again(tmp_path, one_table):
    """A gather split while both nodes held every row (one segment), then both restarted with halves of
    the table before its part was re-issued: the part's ids now span two segments. Before: the gather
    failed ("moved to other nodes while the gather was in flight"). Now the part is split again over the
    new segments and every row comes back bit-exact."""
    local = local_tables(one_table)["t"]
    ports = [free_port_block(), free_port_block()]
    started = [node(tmp_path, "a", one_table, ports[0]), node(tmp_path, "b", one_table, ports[1])]
    every = np.arange(20_000)
    try:
        with TableClient(",".join(d.address for d in started), transport="tcp", reconnect_wait=EVENT_TIMEOUT) as c:
            t = c.table("t")
            np.testing.assert_array_equal(t.gather(every, timeout=EVENT_TIMEOUT), local)
            for d in started:
                d.stop(signal.SIGKILL)
            wait_for(lambda: all(r["state"] == "down" for r in c.replicas().values()), "both nodes to be down")
            handle = t.gather_async(every)  # one part: rows 0..19999, on a or b, neither up
            started.append(node(tmp_path, "a2", one_table, ports[0], "--rows", "0:10000"))
            started.append(node(tmp_path, "b2", one_table, ports[1], "--rows", "10000:20000"))
            np.testing.assert_array_equal(handle.wait(EVENT_TIMEOUT), local)
            ids = np.random.default_rng(8).integers(0, 20_000, 5000)  # and split so from the start now
            np.testing.assert_array_equal(t.gather(ids, timeout=EVENT_TIMEOUT), local[ids])
    finally:
        for d in started:
            d.stop()


def test_a_gather_waiting_when_the_client_closes_ends(tmp_path, v1):
    """Found in review: closing the client while a gather waited on a failing primary left the waiter
    looping for ever, opening (and closing) a session with the standby on every turn. Now it ends with a
    TableClientError as soon as the client is closed."""
    from tableclient import TableClientError

    a, b = node(tmp_path, "a", v1), node(tmp_path, "b", v1)
    try:
        c = TableClient(
            f"{a.address},{b.address}", transport="tcp", client_id="close", standby=False, liveness_timeout=600.0
        )
        primary = c.replicas()
        first = c.shards("engram.layer1")[0].replicas[0].address
        frozen = a if first == a.address else b
        freeze(frozen.proc.pid)
        outcome = {}

        def waiter():
            try:
                c.table("engram.layer1").gather_async(np.arange(100)).wait(EVENT_TIMEOUT)
                outcome["r"] = "rows"
            except TableClientError as e:
                outcome["r"] = e

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.5)  # the gather is in flight on the frozen primary
        c.close()
        t.join(EVENT_TIMEOUT)
        assert not t.is_alive(), f"the gather still waits after close ({primary})"
        assert isinstance(outcome["r"], TableClientError), outcome
        other = b if frozen is a else a  # before: ~100 sessions opened with it after close, until rate-limited
        assert value(scrape(other.ready["metrics"]), "tableserver_sessions_opened_total") <= 1
    finally:
        for d in (a, b):
            os.kill(d.proc.pid, signal.SIGCONT)
            d.stop()


@pytest.fixture(scope="module")
def wide_table(tmp_path_factory):
    """One table of wide rows: a gather of every row moves 80 MB, so its reorder takes a while."""
    return write_demo_file(str(tmp_path_factory.mktemp("wide") / "wide.bin"), [DemoTable("w", 40_000, 2048, 1)], seed=4)


def test_cancel_is_a_barrier_for_the_shards_reorder(tmp_path, wide_table):
    """A gather over two shards lands in scratch by shard and is reordered into ``out`` on the waiting
    thread. Before: cancel() neither stopped nor waited for that reorder, and rows of a cancelled gather
    kept landing in ``out`` after cancel() returned. Now not one row changes after cancel() returns."""
    from tests_helpers import rows_changed_after_cancel

    nodes = [node(tmp_path, "a", wide_table, None, "--rows", "0:20000"),
             node(tmp_path, "b", wide_table, None, "--rows", "20000:40000")]  # fmt: skip
    try:
        with TableClient(",".join(d.address for d in nodes), transport="tcp") as c:
            ids = np.random.default_rng(6).permutation(40_000)  # distinct ids: no dedup, the reorder alone
            changed = rows_changed_after_cancel(c.table("w"), ids, 30)
    finally:
        for d in nodes:
            d.stop()
    assert not any(changed), f"rows written after cancel() returned, per trial: {changed}"
