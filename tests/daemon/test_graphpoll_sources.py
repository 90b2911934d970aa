"""Sources that change under a built GraphStep's native poller (issue 50, items 1-4), on real daemons and a
scripted peer: a node back serving a table from its disk tier or sealing its tcp payloads is read through
the client's own transport (never the policy on every step, never an exception out of arm()); a data port
that accepts and never answers never stalls arm() (connections are made by a keeper thread in the
background); another replica's change of state reconnects nothing; a connection the server closed while idle
(--idle-timeout) never costs a step. A thread stands in for the CUDA stream (tests_helpers.stream_step).
Both pollers where the behaviour is both pollers'; the native one alone where it is its own."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, start_daemon, wait_for
from prometheus_client import REGISTRY
from tests_helpers import free_port_block, stream_step

torch = pytest.importorskip("torch")

from tableclient import TableClient  # noqa: E402
from tableclient.graph.poller import keeper, native  # noqa: E402
from tableclient.graph.step import GraphStep, HostStreamOps  # noqa: E402
from tableclient.metrics import metrics  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

PLANS = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]

if not native.BUILT:
    pytest.skip("tableclient.graph.poller._native is not built here", allow_module_level=True)


@pytest.fixture(scope="module")
def local(demo_file):
    return local_tables(demo_file)


def native_step(client, plans=PLANS, **kw) -> GraphStep:
    kw.setdefault("timeout", 30.0)
    kw.setdefault("policy", "zeros")
    kw.setdefault("budgets", {p.layer: EVENT_TIMEOUT for p in plans})  # a busy machine's gather is not late
    g = GraphStep(client, plans, {p.layer: "in_graph" for p in plans}, 16, poller="native",
                  stream_ops=HostStreamOps(EVENT_TIMEOUT), **kw)  # fmt: skip
    assert g.poller == "native"
    return g


def step(g: GraphStep, tables: dict, rng, tokens: int = 4) -> tuple[dict, dict]:
    """One step of every layer of ``g``: (ids, rows) per layer."""
    ids = {p.layer: rng.integers(0, tables[p.table].shape[0], (tokens, 24)) for p in g.post.plans}
    g.arm(tokens)
    return ids, stream_step(g, ids, tokens, layers=[p.layer for p in g.post.plans])


def assert_rows(g: GraphStep, tables: dict, ids: dict, out: dict) -> None:
    for p in g.post.plans:
        np.testing.assert_array_equal(out[p.layer], tables[p.table][ids[p.layer]], err_msg=f"layer {p.layer}")


def counter(name: str, layer: int) -> float:
    metrics()
    return REGISTRY.get_sample_value(name, {"layer": str(layer)}) or 0.0


def steps_across_a_restart(
    tmp_path, demo_file, local, caplog, transport: str, flags: tuple, again: tuple
) -> tuple[list, float]:
    """A native GraphStep's steps over ``transport`` against a node started with ``flags``, then restarted on the
    same address with ``again`` added: a step before, four after (bit-exact each). What the poller logged after
    the restart, and its handoffs of layer 14 there."""
    port = free_port_block()
    flags = ("--tables", demo_file, *flags, "--listen", f"127.0.0.1:{port}")
    d = start_daemon(str(tmp_path / "a"), *flags)
    try:
        with TableClient(d.address, transport=transport) as c:
            g = native_step(c)
            try:
                rng = np.random.default_rng(1)
                assert_rows(g, local, *step(g, local, rng))
                handed = counter("tableserver_client_graph_handoffs_total", 14)
                d.stop()
                d = start_daemon(str(tmp_path / "b"), *flags, *again)
                wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
                with caplog.at_level(logging.WARNING, logger="tableclient.graph"):
                    for tokens in (4, 16, 1, 8):
                        assert_rows(g, local, *step(g, local, rng, tokens))
                return [r.getMessage() for r in caplog.records], counter(
                    "tableserver_client_graph_handoffs_total", 14
                ) - handed
            finally:
                g.close()
    finally:
        d.stop()


# ---------------------------------------------------------------------- items 1 and 2
def test_a_node_back_serving_a_table_from_its_disk_tier_is_read_through_the_clients_transport(
    tmp_path, demo_file, local, caplog
):
    """Item 1: shm, both layers copied by the thread from the table this process maps. The node comes back
    serving layer 14 from its disk tier (same file, same checksum): nothing to map, so the thread cannot read
    it, and it hands the layer's steps to the client's own transport, which reads it fine: rows, bit-exact,
    said once. Before, every later step of the layer got the policy (zeros), silently, forever."""
    said, handed = steps_across_a_restart(
        tmp_path, demo_file, local, caplog, "shm", (), ("--disk-tables", "engram.layer14")
    )
    said = [m for m in said if "cannot read table 'engram.layer14'" in m]
    assert len(said) == 1 and "disk tier" in said[0], said
    assert handed >= 4


def test_a_node_back_sealing_its_tcp_payloads_never_raises_out_of_arm(tmp_path, demo_file, local, caplog):
    """Item 2: tcp, both layers over the thread's own plain connections. The node comes back sealing its tcp
    payloads (--data-encryption on): the thread cannot read sealed rows, so the layers' steps go through the
    client's transport (which unseals them): rows, bit-exact, said once per layer. Before, every arm() raised
    NativeUnavailable on the launch path."""
    said, handed = steps_across_a_restart(tmp_path, demo_file, local, caplog, "tcp", ("--transports", "tcp"),
                                          ("--data-encryption", "on"))  # fmt: skip
    said = [m for m in said if "seals its tcp payloads" in m]
    assert len(said) == 2, said  # once per layer
    assert handed >= 4


# ---------------------------------------------------------------------- item 3
def test_a_data_port_that_accepts_and_never_answers_never_stalls_arm(tmp_path):
    """Item 3: the scripted node's data connections are closed under the poller and its data port then accepts
    and never answers (no CHALLENGE). The poller's connect timeout is an hour (the GraphStep's timeout); yet
    every arm() returns at once: the keeper thread connects in the background, the steps meanwhile go through
    the client's transport and get the policy by their own budget. Before, arm() connected on the launch path
    and waited out the whole timeout."""
    from hostile_server import ScriptedServer, table_rows

    rows = table_rows()
    plans = [LayerPlan(1, "t", 0.3e-3)]
    with ScriptedServer("honest", str(tmp_path)) as srv, TableClient(srv.address, transport="tcp") as c:
        g = native_step(c, plans, timeout=3600.0, budgets={1: 0.5})
        try:
            rng = np.random.default_rng(3)
            ids, out = step(g, {"t": rows}, rng)
            np.testing.assert_array_equal(out[1], rows[ids[1]])
            srv.behaviour = "data_port_silent"
            for conn in list(srv.conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            done = []

            def steps():
                for _ in range(3):
                    step(g, {"t": rows}, rng)  # arm, the ids, the release: by the layer's budget
                    done.append(1)

            t = threading.Thread(target=steps, daemon=True)
            t.start()
            t.join(EVENT_TIMEOUT)
            assert not t.is_alive() and len(done) == 3, "arm() waited on a connect to a port that never answers"
        finally:
            g.close()


def data_connections(port: int) -> set[int]:
    """The local ports of this host's established tcp connections to ``port`` (/proc/net/tcp)."""
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state = line.split()[1:4]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                out.add(int(local.split(":")[1], 16))
    return out


def test_another_replica_changing_state_reconnects_nothing(tmp_path, demo_file, local):
    """Item 3: two replicas; the poller reads from the first over connections of its own. The second dies
    (routing's generation changes): the poller keeps its connections to the first, which did not change.
    Before, every change of any replica made it connect anew on the launch path."""
    a = start_daemon(str(tmp_path / "a"), "--tables", demo_file, "--transports", "tcp")
    b = start_daemon(str(tmp_path / "b"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(f"{a.address},{b.address}", transport="tcp", client_id="replicas") as c:
            g = native_step(c)
            try:
                rng = np.random.default_rng(4)
                assert_rows(g, local, *step(g, local, rng))
                port = int(a.ready["tcp"].rsplit(":", 1)[1])
                before = data_connections(port)
                b.stop(signal.SIGKILL)
                wait_for(lambda: c.replicas()[b.address]["state"] == "down", "the client to notice the loss")
                for _ in range(3):
                    assert_rows(g, local, *step(g, local, rng))
                assert before <= data_connections(port), "the poller connected to the first replica anew"
            finally:
                g.close()
    finally:
        a.stop()
        b.stop()


# ---------------------------------------------------------------------- item 4
def all_closed_by_server(port: int) -> bool:
    """Whether the server closed every one of this host's tcp connections to ``port`` (none established, one
    at least in CLOSE_WAIT): the poller's and the client transport's, all idle."""
    with open("/proc/net/tcp") as f:
        states = [line.split()[3] for line in f.readlines()[1:] if int(line.split()[2].split(":")[1], 16) == port]
    return "08" in states and "01" not in states


def reconnected(said: str) -> bool:
    """Whether every new connection the poller's log says was asked for was made."""
    return said.count("a new one is connected in the background") == said.count("over tcp again")


@pytest.mark.parametrize("found_by", ["the keeper", "the step"])
def test_a_connection_the_server_closed_while_idle_never_costs_a_step(tmp_path, demo_file, local, caplog, found_by,
                                                                      monkeypatch):  # fmt: skip
    """Item 4, the native poller: the daemon closes idle data connections (--idle-timeout 0.2). The keeper
    finds the poller's connection closed between steps and connects anew; where a step finds it first (the
    keeper's look made rare here), the step is sent again through the client's transport (reads are
    idempotent). Either way: rows, bit-exact, no policy step, the node never marked down. Before, the first
    step after every idle gap got the policy (zeros)."""
    if found_by == "the step":
        monkeypatch.setattr(keeper, "CHECK_S", 3600.0)
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp", "--idle-timeout", "0.2")
    try:  # a busy machine's late keepalive answer fails no node here: the session stays the one the keeper knows
        with TableClient(d.address, transport="tcp", liveness_timeout=EVENT_TIMEOUT) as c:
            g = native_step(c, PLANS[1:])
            try:
                rng = np.random.default_rng(5)
                port = int(d.ready["tcp"].rsplit(":", 1)[1])
                zeros = counter("tableserver_client_zero_rows_served_total", 14)
                handed = counter("tableserver_client_graph_handoffs_total", 14)
                with caplog.at_level(logging.INFO, logger="tableclient.graph"):
                    for _ in range(3):
                        assert_rows(g, local, *step(g, local, rng))
                        if found_by == "the keeper":
                            wait_for(lambda: "closed the native poller's idle connection" in caplog.text,
                                     "the keeper to find the connection closed")  # fmt: skip
                            caplog.clear()
                        else:  # no new connection of the poller's own pending (asked for at an arm after a break),
                            wait_for(lambda: reconnected(caplog.text) and all_closed_by_server(port),  # then idle
                                     "the server to close the idle connections")  # fmt: skip
                    assert_rows(g, local, *step(g, local, rng))
                g.account()
                assert counter("tableserver_client_zero_rows_served_total", 14) == zeros
                assert c.replicas()[d.address]["state"] == "up"
                if found_by == "the step":  # a step that found its connection closed: sent again through the client's
                    # transport (after the first gap and the last; after the second the keeper may have connected anew
                    # between the arm and the ids, and that step is the thread's own)
                    assert counter("tableserver_client_graph_handoffs_total", 14) >= handed + 2
            finally:
                g.close()
    finally:
        d.stop()


# ---------------------------------------------------------------------- item 6
def test_one_late_step_ends_at_the_first_probe_answered_not_the_next_keepalive(tmp_path, demo_file, local):
    """Item 6, tcp: one step of layer 14 runs out of its budget (the node frozen for that step); the layer's
    node is silent, its next step gets the policy at once and probes it, and the first probe answered ends
    it: rows again at once. The client pings its node once a minute here, so no keepalive is what ends it
    (before, steps got the policy until the next keepalive: up to half a second of steps by default)."""
    from tests_helpers import freeze

    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(d.address, transport="tcp", liveness_timeout=600.0, keepalive_interval=60.0) as c:
            for poller in ("native", "python"):
                g = GraphStep(c, PLANS[1:], {14: "in_graph"}, 16, poller=poller, policy="zeros", timeout=30.0,
                              budgets={14: 0.3}, stream_ops=HostStreamOps(EVENT_TIMEOUT))  # fmt: skip
                try:
                    rng = np.random.default_rng(6)
                    assert_rows(g, local, *step(g, local, rng))
                    freeze(d.proc.pid)
                    ids, out = step(g, local, rng)
                    assert not out[14].any()  # out of its budget: the watchdog's release
                    os.kill(d.proc.pid, signal.SIGCONT)
                    silence = g.silence(14)
                    served = None
                    for _ in range(3):  # the step that finds it silent, the one after its probe was answered
                        g.account()
                        ids, out = step(g, local, rng)
                        if out[14].any():
                            served = ids, out
                            break
                        wait_for(silence.probe_done, "the probe to be answered")
                    assert served is not None, f"{poller}: still the policy after its node answered a probe"
                    assert_rows(g, local, *served)
                    assert silence.node is None and silence.answered >= 1
                finally:
                    g.close()
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
