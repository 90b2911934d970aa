"""A GraphStep whose native poller turns out unable to serve its layers once made (a node that seals its tcp
payloads; over rdma, where tableclient.graph.poller._verbs is missing: tests/rdma/test_graphpoll_rdma.py) keeps the
Python poller, which serves from the first step.

Before: the native poller, closed on the way out, left every rows flag released ("a replay after close waits
for nobody"), so the Python poller's first arm waited out its timeout for a consumption that never came."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, start_daemon

torch = pytest.importorskip("torch")

from tableclient import TableClient  # noqa: E402
from tableclient.graph.poller import native  # noqa: E402
from tableclient.graph.step import GraphStep, HostStreamOps  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

PLANS = [LayerPlan(14, "engram.layer14", 9.3e-3)]


def test_a_native_poller_refused_after_it_was_made_leaves_the_python_poller_clean_flags(tmp_path, demo_file, caplog):
    if not native.BUILT:
        pytest.skip("tableclient.graph.poller._native is not built here")
    local = local_tables(demo_file)["engram.layer14"]
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp", "--data-encryption", "on")
    try:
        with TableClient(d.address, transport="tcp") as c:
            with caplog.at_level(logging.INFO, logger="tableclient.graph"):
                g = GraphStep(c, PLANS, {14: "in_graph"}, 8, stream_ops=HostStreamOps(EVENT_TIMEOUT), timeout=2.0,
                              budgets={14: EVENT_TIMEOUT})  # fmt: skip
            try:
                assert g.poller == "python"
                assert "the server seals its tcp payloads" in caplog.text
                assert all(g.flags.host[g.flags.index(i, 1)] == 0 for i in range(len(g.ids))), "rows flags released"
                rng = np.random.default_rng(31)
                for _ in range(2):
                    ids = rng.integers(0, local.shape[0], (8, 24))
                    g.arm(8)  # before: GraphStepError after 2 s, the rows flag never consumed
                    out = {}

                    def stream():
                        g.publish_ids(14, torch.from_numpy(ids))
                        out[14] = g.rows(14, 8).clone().numpy().reshape(8, 24, -1)

                    t = threading.Thread(target=stream)
                    t.start()
                    t.join(EVENT_TIMEOUT)
                    assert not t.is_alive(), "the stream was left waiting"
                    g.after_replay()
                    np.testing.assert_array_equal(out[14], local[ids])
            finally:
                g.close()
    finally:
        d.stop()
