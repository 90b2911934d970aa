"""Each step's outcome kept by a captured CUDA graph (``GraphStep`` with ``results_check`` and ``agree``), on a
real GPU: the graph reads each layer's ok byte (the poller's flag for the in_graph layer, the host's for the
before_replay one) with a memcpy node at replay, reduces it (here one rank: ``agree`` is the identity the
all-reduce of one rank is), masks the rows by it and mirrors the outcome ring to pinned memory; ``check``
passes the good steps and refuses the step whose node died, naming the layer, and nothing raises on the launch
path. Skipped without CUDA (the skip line says so): tests/daemon/test_graph_ranks.py and
tests/daemon/test_graphstep.py run the same paths on the CPU, across two processes too."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from conftest import local_tables, start_daemon

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine): step outcomes have not run here"
)

TOKENS = 8


def test_a_captured_graph_keeps_each_steps_outcome_for_the_check_where_results_are_read(tmp_path, demo_file):
    from tableclient import TableClient
    from tableclient.graph.step import GraphStep, GraphStepError
    from tableclient.step import LayerPlan

    plans = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]
    local = local_tables(demo_file)
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(d.address, transport="tcp") as c:
            g = GraphStep(
                c, plans, {14: "in_graph"}, TOKENS, device="cuda", policy="fail", timeout=2.0, budgets={14: 2.0},
                agree=lambda ok: ok.clone(), results_check=True,
            )  # fmt: skip
            try:
                ids = torch.zeros((TOKENS, 24), dtype=torch.int64, device="cuda")
                out = {}

                def forward(graph: bool) -> None:
                    g.publish_ids(14, ids, graph=graph)
                    for p in plans:
                        out[p.layer] = g.rows(p.layer, TOKENS, graph=graph)

                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    forward(False)  # warm-up, as engines run one before capturing
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    forward(True)
                rng = np.random.default_rng(3)

                def step() -> tuple:
                    want = {p.layer: rng.integers(0, local[p.table].shape[0], (TOKENS, 24)) for p in plans}
                    ids.copy_(torch.from_numpy(want[14]))
                    g.before_replay({1: want[1]})  # policy fail, checked later: never raises here
                    number = g.arm(TOKENS)
                    graph.replay()
                    torch.cuda.synchronize()
                    g.after_replay()  # at once: the check is where the results are read
                    got = {p.layer: out[p.layer].cpu().numpy().reshape(TOKENS, 24, -1) for p in plans}
                    return number, want, got

                for _ in range(3):
                    number, want, got = step()
                    g.check(number)
                    for p in plans:
                        np.testing.assert_array_equal(got[p.layer], local[p.table][want[p.layer]])
                d.stop(signal.SIGKILL)
                number, _, got = step()
                assert not any(got[p.layer].any() for p in plans)
                with pytest.raises(GraphStepError, match=rf"layer 1: step {number}'s rows were not served here"):
                    g.check(number)
            finally:
                g.close()
    finally:
        d.stop()
