"""Rank-consistent failure (issue 37): the tensor-parallel ranks of a step serve the table's rows or all serve the
policy's, never a mix that the collectives after the layer would blend undetected.

Two ranks, each a process with its own memory node over tcp (the same tables) and a gloo process group
(tests/support/graph_ranks.py); each rank's GraphStep reduces its layers' ok bytes over the group inside the
step (``agree``), masks the rows by the result, and answers :meth:`GraphStep.check` where an engine reads the
step's results. Rank 1's node is killed mid-run: from then on rank 0's own gathers still succeed, yet both
ranks serve zeros for both layers, and under policy ``fail`` both ranks' check refuses the step (``zeros``:
rank 0 counts the steps its peer's failure masked).
"""

from __future__ import annotations

import pytest
from conftest import start_daemon
from tests_helpers import run_ranks

pytest.importorskip("torch")

KILL_AT, STEPS = 3, 6


@pytest.mark.parametrize("policy,poller", [("fail", "auto"), ("zeros", "python")])
def test_every_rank_serves_the_tables_rows_or_every_rank_the_policys(demo_file, tmp_path, policy, poller):
    daemons = [start_daemon(str(tmp_path / f"node{rank}"), "--tables", demo_file) for rank in range(2)]
    try:
        reports = run_ranks(
            "graph_ranks.py",
            daemons,
            lambda rank, d: [d.address, str(d.proc.pid), demo_file, policy, poller, str(KILL_AT), str(STEPS)],
        )
    finally:
        for d in daemons:
            d.stop()
    for rank, steps in enumerate(reports):
        assert [s["step"] for s in steps] == list(range(STEPS)), steps
        for s in steps:
            if s["step"] < KILL_AT:
                assert s["rows"] == {"1": "table", "14": "table"} and s["check"] == "ok", (rank, s)
                continue
            assert s["rows"] == {"1": "zeros", "14": "zeros"}, (rank, s)  # rank 0's own rows masked too
            if policy == "fail":
                where = "on another rank" if rank == 0 else "here"
                assert s["check"].startswith(f"layer 1: step {s['step'] + 1}'s rows were not served {where}"), s
            else:
                assert s["check"] == "ok", (rank, s)
        if policy == "zeros":
            # a step served zeros is counted on both ranks: rank 1 by its policy, rank 0 because the peer failed
            assert steps[-1]["zero_steps"] == {"1": STEPS - KILL_AT, "14": STEPS - KILL_AT}, (rank, steps[-1])
