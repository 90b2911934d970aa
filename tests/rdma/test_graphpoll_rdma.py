"""The native in_graph poller over rdma (client/tableclient/graph/poller/_native_c/verbs.c) on a real verbs stack: Soft-RoCE in the
QEMU guest (tests/host/test_rdma_guest.py boots it).

A GraphStep's in_graph layers with ``poller="native"`` and a thread standing in for the CUDA stream
(HostStreamOps, as tests/daemon/test_graphstep.py drives it without a GPU), its client over rdma: the poller's
thread READs each step's rows through an RC QP of its own, offered to the node in a session of its own. Every
step is checked bit-exact against the table file; the faults end in the policy and the stream goes on.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, wait_for
from guest import SLOW_CLIENT, guest_daemon
from prometheus_client import REGISTRY
from tableclient import TableClient
from tests_helpers import free_port_block, freeze, stream_step

from tableserver.common.verbs import Device

torch = pytest.importorskip("torch")

from tableclient.graph.poller import native  # noqa: E402
from tableclient.graph.step import GraphStep, HostStreamOps  # noqa: E402
from tableclient.metrics import metrics  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

pytestmark = pytest.mark.rdma

PLANS = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]
#: 16 tokens of 24 rows: 384 READs a layer and step (Soft-RoCE under TCG moves a few thousand a second)
MAX_TOKENS = 16
DEAD = -1
#: shm off (rows come over rdma or nowhere); 3 MiB MR chunks: engram.layer14 spans several regions
FLAGS = ("--transports", "rdma,tcp", "--rdma-mr-chunk-bytes", str(3 << 20))
#: a step's READs cannot all complete this soon after its ids under TCG (a batch of 64 takes milliseconds there)
STALL_BUDGET_S = 0.001
#: how late after its deadline a step may be released: rxe does a post's work in the posting thread (one
#: batch of READs), then the barrier's drain (2 ms at most), and the guest's scheduling of the spinning thread
#: (TCG, two vCPUs shared with the daemon and this test)
RELEASE_SLACK_S = 0.05
#: a QP number rxe_lo never hands out: READs sent to it are dropped unanswered, and retried (~67 ms apart)
NO_SUCH_QP = 0xFFFFF0


@pytest.fixture(scope="module")
def rdma_daemon(demo_file, tmp_path_factory):
    d = guest_daemon(str(tmp_path_factory.mktemp("graphpoll")), "--tables", demo_file, *FLAGS)
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def built():
    """The guest runs the host's build: the rdma source must be there (CI installs libibverbs-dev)."""
    assert native.RDMA, f"the native poller cannot read over rdma here: {native.RDMA_MISSING}"


def make(client, modes, **kw) -> GraphStep:
    kw.setdefault("timeout", EVENT_TIMEOUT)
    kw.setdefault("budgets", {1: EVENT_TIMEOUT, 14: EVENT_TIMEOUT})
    g = GraphStep(client, PLANS, modes, MAX_TOKENS, stream_ops=HostStreamOps(EVENT_TIMEOUT), poller="native", **kw)
    assert g.poller == "native"
    return g


def random_ids(rng, local, tokens: int, dead: float = 0.0) -> dict:
    ids = {p.layer: rng.integers(0, local[p.table].shape[0], (tokens, 24)) for p in PLANS}
    for layer in ids:
        ids[layer][rng.random((tokens, 24)) < dead] = DEAD
    return ids


def expected(local, table: str, ids: np.ndarray) -> np.ndarray:
    want = local[table][np.where(ids == DEAD, 0, ids)]
    want[ids == DEAD] = 0
    return want


def staging(g: GraphStep, layer: int, row_bytes: int) -> np.ndarray:
    """The layer's pinned staging (where the poller's thread puts a step's rows), as bytes."""
    n = MAX_TOKENS * 24 * row_bytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(g.buffers()[f"staging.{layer}"]))


def watchdog_releases(layer: int) -> float:
    metrics()  # registered in the default registry on first use
    return REGISTRY.get_sample_value("tableserver_client_watchdog_releases_total", {"layer": str(layer)}) or 0.0


def poller_sessions(d) -> int:
    """Sessions the daemon opened for a native poller's own QP."""
    return sum(1 for line in d.log().splitlines() if "(graph poller)" in line and "opened" in line)


def test_in_graph_layers_read_over_rdma_by_the_native_poller_bit_exact(rdma_daemon, demo_local):
    """Both layers in_graph over rdma, dead ids among them (never read, zero rows), steps of several sizes:
    bit-exact; the server frozen (SIGSTOP) meanwhile changes nothing: one-sided READs need no server CPU."""
    before = poller_sessions(rdma_daemon)
    with TableClient(rdma_daemon.address, transport="rdma", **SLOW_CLIENT) as c:
        assert c.transport == "rdma"
        g = make(c, {1: "in_graph", 14: "in_graph"}, dead_id=DEAD, policy="fail")
        try:
            assert poller_sessions(rdma_daemon) == before + 2  # one QP session of its own per layer
            rng = np.random.default_rng(21)
            for k, tokens in enumerate((1, MAX_TOKENS, 5, MAX_TOKENS)):
                ids = random_ids(rng, demo_local, tokens, dead=0.3 if k % 2 else 0.0)
                ids[14][0] = DEAD  # a whole token
                g.arm(tokens)
                out = stream_step(g, ids, tokens)
                g.after_replay()  # policy fail: raises if a layer failed
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], expected(demo_local, p.table, ids[p.layer]))
            freeze(rdma_daemon.proc.pid)
            try:
                ids = random_ids(rng, demo_local, MAX_TOKENS)
                g.arm(MAX_TOKENS)
                out = stream_step(g, ids, MAX_TOKENS)
                g.after_replay()
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], demo_local[p.table][ids[p.layer]])
            finally:
                os.kill(rdma_daemon.proc.pid, signal.SIGCONT)
        finally:
            g.close()


def test_without_its_rdma_source_the_python_poller_serves_and_the_start_up_log_says_why(
    rdma_daemon, demo_local, monkeypatch, caplog
):
    """Where tableclient.graph.poller._verbs is not built (no libibverbs headers at install) or cannot load, an in_graph
    layer read over rdma keeps today's Python poller (bit-exact), and the GraphStep's start-up line says why;
    ``poller="native"`` refuses with that reason."""
    why = "tableclient.graph.poller._verbs is not built (no libibverbs headers at install: Debian's libibverbs-dev)"
    monkeypatch.setattr(native, "RDMA", False)
    monkeypatch.setattr(native, "RDMA_MISSING", why)
    with TableClient(rdma_daemon.address, transport="rdma", **SLOW_CLIENT) as c:
        with caplog.at_level(logging.INFO, logger="tableclient.graph"):
            g = GraphStep(c, PLANS, {14: "in_graph"}, MAX_TOKENS, stream_ops=HostStreamOps(EVENT_TIMEOUT),
                          timeout=EVENT_TIMEOUT, budgets={14: EVENT_TIMEOUT})  # fmt: skip
        try:
            assert g.poller == "python"
            assert f"the Python poller (table 'engram.layer14' is read over rdma and {why})" in caplog.text
            ids = random_ids(np.random.default_rng(24), demo_local, 4)
            g.before_replay({1: ids[1]})
            g.arm(4)
            out = stream_step(g, ids, 4)
            g.after_replay()
            for p in PLANS:
                np.testing.assert_array_equal(out[p.layer], demo_local[p.table][ids[p.layer]])
        finally:
            g.close()
        with pytest.raises(native.NativeUnavailable, match="is read over rdma and tableclient.graph.poller._verbs"):
            make(c, {14: "in_graph"})


def test_a_gather_past_its_budget_is_released_at_its_deadline(rdma_daemon, demo_local):
    """A step whose READs cannot all complete within its budget (1 ms after its ids, under TCG): released with
    zeros within RELEASE_SLACK_S of that deadline by the same native loop (a watchdog release); a pattern
    written into the staging after the release is still there a while later. A replay nobody armed gets
    zeros at once; a step whose ids come late is released at its deadline, and the late ids are consumed
    without a gather; then the layer reads again (a new QP where the cancelled one was broken)."""
    row_bytes = demo_local["engram.layer14"].shape[1]
    with TableClient(rdma_daemon.address, transport="rdma", **SLOW_CLIENT) as c:
        g = make(c, {14: "in_graph"}, policy="zeros", timeout=3.0, budgets={14: STALL_BUDGET_S})
        try:
            rng = np.random.default_rng(22)
            released = watchdog_releases(14)
            ids = random_ids(rng, demo_local, MAX_TOKENS)
            g.arm(MAX_TOKENS)
            published = {}
            out = stream_step(g, ids, MAX_TOKENS, layers=[14], published=published)
            took = g.released_at(14) - published[14]
            g.account()
            assert watchdog_releases(14) == released + 1, "the step was not released by its deadline"
            assert not out[14].any()  # the policy: zeros
            print(f"stalled step released {took * 1e3:.2f} ms after its ids were published (budget "
                  f"{STALL_BUDGET_S * 1e3:g} ms)")  # fmt: skip
            assert STALL_BUDGET_S <= took < STALL_BUDGET_S + RELEASE_SLACK_S, took
            view = staging(g, 14, row_bytes)
            view[:] = 0xA5  # after the release: the staging is the graph's until the next arm
            time.sleep(1.0)
            assert (view == 0xA5).all(), "bytes landed in the staging after the step was released"

            # a replay nobody armed: zeros at once, the stream never waits
            t0 = time.monotonic()
            out = stream_step(g, ids, 2, layers=[14])
            assert not out[14].any() and time.monotonic() - t0 < 1.0
            g.reset()

            # ids that come after the deadline: released by the watchdog, the late ids consumed without a gather
            g.arm(2)
            wait_for(lambda: g.flags.host[g.flags.index(0, 1)] == 1, "the watchdog's release", interval=0.01)
            out = stream_step(g, ids, 2, layers=[14])
            assert not out[14].any()
            g.account()
            assert watchdog_releases(14) == released + 2
        finally:
            g.close()
        # the same client, a budget the guest meets: rows again
        g = make(c, {14: "in_graph"}, policy="fail")
        try:
            ids = random_ids(rng, demo_local, MAX_TOKENS)
            g.arm(MAX_TOKENS)
            out = stream_step(g, ids, MAX_TOKENS, layers=[14])
            g.after_replay()
            np.testing.assert_array_equal(out[14], demo_local["engram.layer14"][ids[14]])
        finally:
            g.close()


def test_the_cancel_barrier_with_reads_in_flight():
    """An endpoint whose QP is connected to a QP nobody has: its READs are in flight (unanswered, retried) when
    the gather's deadline comes. The gather fails then (ETIMEDOUT, within RELEASE_SLACK_S), its QP moved to
    the error state; nothing is written to the caller's buffer then or later (past the QP's retries: the READs
    land in the endpoint's own bounce buffer, copied out only once all completed); the endpoint is broken for
    good (the next gather fails at once, saying why). The barrier waits for the READs' flush 2 ms at most
    (DRAIN_NS), so the GPU is not held for it: under the guest's emulation it may not drain in that time,
    and the endpoint then says so."""
    from tableclient.graph.poller import _verbs

    with Device("rxe_lo") as dev:
        name, port, gid_index = dev.name, dev.port, dev.gid_index
    rows, row_bytes = 4096, 264
    ep = _verbs.Endpoint(name, port, gid_index, 64, row_bytes)
    try:
        ep.connect(NO_SUCH_QP, 1, ep.gid, ep.mtu, 16, rows, [(0, 1 << 20, 1, rows * row_bytes)])
        out = np.full((64, row_bytes), 0xA5, np.uint8)
        t0 = time.monotonic()
        with pytest.raises(OSError, match="by the deadline") as e:
            ep.read(np.arange(0, 64 * 7, 7, dtype=np.int64), out, 0.05)
        took = time.monotonic() - t0
        assert e.value.errno == errno.ETIMEDOUT
        print(f"gather with READs in flight failed {(took - 0.05) * 1e3:.2f} ms after its deadline")
        assert 0.05 <= took < 0.05 + RELEASE_SLACK_S, took
        assert ep.broken is not None and "by the deadline" in ep.broken
        assert "did not go to the error state" not in ep.broken, ep.broken
        print(f"the flush {'not drained in 2 ms' if 'not flushed' in ep.broken else 'drained'}: {ep.broken}")
        time.sleep(1.0)  # past the QP's retries: a READ still owed would have landed by now
        assert (out == 0xA5).all(), "bytes landed in the caller's buffer after the gather returned"
        with pytest.raises(OSError, match="by the deadline"):
            ep.read(np.arange(4, dtype=np.int64), out, 5.0)  # broken: at once
        assert (out == 0xA5).all()
    finally:
        ep.close()
        ep.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        ep.read(np.arange(4, dtype=np.int64), out, 1.0)


def test_the_native_poller_connects_again_after_its_node_restarts(tmp_path, demo_file, demo_local):
    """The node killed: the layer gets the policy (zeros), the stream goes on; restarted on the same port, the
    rows are bit-exact again (through the client's transport until the poller's keeper has connected a new QP
    and session of its own, in the background: never on the launch path)."""
    port = free_port_block()
    flags = ("--tables", demo_file, *FLAGS, "--listen", f"127.0.0.1:{port}")
    d = guest_daemon(str(tmp_path / "a"), *flags)
    try:
        with TableClient(d.address, transport="rdma", **SLOW_CLIENT) as c:
            g = make(c, {14: "in_graph"}, policy="zeros")  # the steps are judged on rows, never on speed (TCG)
            try:
                rng = np.random.default_rng(23)
                ids = random_ids(rng, demo_local, 4)
                g.arm(4)
                out = stream_step(g, ids, 4, layers=[14])
                np.testing.assert_array_equal(out[14], demo_local["engram.layer14"][ids[14]])
                d.stop(signal.SIGKILL)
                ids = random_ids(rng, demo_local, 4)
                g.arm(4)
                out = stream_step(g, ids, 4, layers=[14])
                assert not out[14].any()  # the policy
                d = guest_daemon(str(tmp_path / "b"), *flags)
                wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
                ids = random_ids(rng, demo_local, 4)
                g.arm(4)
                out = stream_step(g, ids, 4, layers=[14])
                np.testing.assert_array_equal(out[14], demo_local["engram.layer14"][ids[14]])
                # the poller's own QP session with the new server, made by its keeper in the background (the steps
                # meanwhile read through the client's transport, bit-exact as above)
                wait_for(lambda: poller_sessions(d) == 1, "the poller's keeper to connect to the new server")
            finally:
                g.close()
    finally:
        d.stop()
