"""A source the native poller cannot READ after its GraphStep was built, on a real verbs stack (Soft-RoCE in the
QEMU guest): the node comes back serving a table from its disk tier, so packed only over rdma (it registers no
memory of it for READs). The layer's steps are read through the client's own rdma transport (packed, bit-exact)
instead; before, every later step got the policy (zeros), silently, for ever (issue 50, item 1). The host's
side of the same (shm, tcp) is tests/daemon/test_graphpoll_sources.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import wait_for
from guest import SLOW_CLIENT, guest_daemon
from prometheus_client import REGISTRY
from tableclient import TableClient
from tests_helpers import free_port_block, stream_step

torch = pytest.importorskip("torch")

from tableclient.graph.poller import native  # noqa: E402
from tableclient.graph.step import GraphStep, HostStreamOps  # noqa: E402
from tableclient.metrics import metrics  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

pytestmark = pytest.mark.rdma

PLANS = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]
FLAGS = ("--transports", "rdma,tcp")


def handoffs(layer: int) -> float:
    metrics()
    return REGISTRY.get_sample_value("tableserver_client_graph_handoffs_total", {"layer": str(layer)}) or 0.0


def test_a_table_held_across_a_restart_onto_the_disk_tier_is_read_packed(tmp_path, demo_file, demo_local):
    """The client's own transport, which the poller hands such a layer to: a RemoteTable taken while the node
    served the table from memory, the node restarted serving it from disk. Its reads go packed on the new
    session (no memory of it to READ there), bit-exact. Before, they were READs against no region at all:
    an IndexError from the transport."""
    port = free_port_block()
    flags = ("--tables", demo_file, *FLAGS, "--listen", f"127.0.0.1:{port}")
    d = guest_daemon(str(tmp_path / "a"), *flags)
    try:
        with TableClient(d.address, transport="rdma", **SLOW_CLIENT) as c:
            t = c.table("engram.layer14")
            rng = np.random.default_rng(32)
            ids = rng.integers(0, demo_local["engram.layer14"].shape[0], 4096)
            np.testing.assert_array_equal(t.gather(ids), demo_local["engram.layer14"][ids])
            d.stop()
            d = guest_daemon(str(tmp_path / "b"), *flags, "--disk-tables", "engram.layer14")
            wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
            for n in (1, 4096, 70_001):
                ids = rng.integers(0, demo_local["engram.layer14"].shape[0], n)
                np.testing.assert_array_equal(t.gather(ids, mode="read"), demo_local["engram.layer14"][ids])
    finally:
        d.stop()


def test_a_node_back_serving_a_table_packed_only_is_read_through_the_clients_transport(
    tmp_path, demo_file, demo_local, caplog
):
    assert native.RDMA, f"the native poller cannot read over rdma here: {native.RDMA_MISSING}"
    port = free_port_block()
    flags = ("--tables", demo_file, *FLAGS, "--listen", f"127.0.0.1:{port}")
    d = guest_daemon(str(tmp_path / "a"), *flags)
    try:
        with TableClient(d.address, transport="rdma", **SLOW_CLIENT) as c:
            g = GraphStep(c, PLANS, {1: "in_graph", 14: "in_graph"}, 8, stream_ops=HostStreamOps(600.0),
                          poller="native", policy="fail", timeout=600.0, budgets={1: 600.0, 14: 600.0})  # fmt: skip
            try:
                assert g.poller == "native"
                rng = np.random.default_rng(31)

                def step(tokens: int) -> None:
                    ids = {p.layer: rng.integers(0, demo_local[p.table].shape[0], (tokens, 24)) for p in PLANS}
                    g.arm(tokens)
                    out = stream_step(g, ids, tokens)
                    g.after_replay()  # policy fail: a layer that failed raises, naming why
                    for p in PLANS:
                        np.testing.assert_array_equal(out[p.layer], demo_local[p.table][ids[p.layer]])

                step(4)
                d.stop()
                d = guest_daemon(str(tmp_path / "b"), *flags, "--disk-tables", "engram.layer14")
                wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
                handed = handoffs(14)
                with caplog.at_level(logging.WARNING, logger="tableclient.graph"):
                    for tokens in (4, 8, 1):
                        step(tokens)
                    wait_for(lambda: "cannot read table 'engram.layer14'" in caplog.text, "the reason, once")
                    step(2)
                said = [
                    r.getMessage() for r in caplog.records if "cannot read table 'engram.layer14'" in r.getMessage()
                ]
                assert len(said) == 1 and "packed only" in said[0], said
                assert handoffs(14) >= handed + 4
            finally:
                g.close()
    finally:
        d.stop()
