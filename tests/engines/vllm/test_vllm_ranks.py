"""Tensor and sequence parallelism in the released vLLM (0.33.0, pinned): two ranks in two processes over gloo
(tests/support/vllm_ranks.py), each building vLLM's own layers; apart from tests/engines/vllm/test_vllm_plugin.py
(whose fixtures it uses) so that the test workers share vLLM's minutes. Both tests read the one run of the rank
processes (vLLM starts once a rank)."""

from __future__ import annotations

import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)

pytest.importorskip("torch")
vllm_cpu.require_vllm()

from test_vllm_plugin import engram_tables, memnode, model_dir  # noqa: E402,F401  (fixtures)

KILL_AT = 3
POLICIES = ("fail", "zeros")


@pytest.fixture(scope="module")
def ranks(model_dir, engram_tables, memnode, tmp_path_factory):
    """Each rank's JSON lines: the agreement's steps, then the columns' report (tests/support/vllm_ranks.py),
    each rank with its own pair of nodes for the agreement (one a policy)."""
    from conftest import start_daemon
    from tests_helpers import run_ranks

    tmp = tmp_path_factory.mktemp("ranks")
    nodes = {
        (policy, rank): start_daemon(str(tmp / f"{policy}{rank}"), "--tables", engram_tables)
        for policy in POLICIES
        for rank in range(2)
    }
    try:
        return run_ranks(
            "vllm_ranks.py",
            [nodes[(POLICIES[0], rank)] for rank in range(2)],
            lambda rank, _: (
                [model_dir[0], engram_tables, memnode.address, str(KILL_AT)]
                + [f for p in POLICIES for f in (p, nodes[(p, rank)].address, str(nodes[(p, rank)].proc.pid))]
            ),
        )
    finally:
        for d in nodes.values():
            d.stop()


@pytest.mark.slow
def test_tensor_and_sequence_parallel_ranks_gather_their_columns(ranks):
    """TP=2 in two processes over gloo: each rank's served layers gather only its hash columns (12 of 24), and
    vLLM's own collectives join them, as for its head-sharded local tables; with sequence parallelism too;
    placed remote (the host path) and placed node (graph mode device: each rank's kernel gathers its own
    columns of every token). Every output bit-identical to vLLM's own tables on that rank."""
    for rank, lines in enumerate(ranks):
        report = lines[-1]
        for mode in ("tp", "sp"):
            assert report[mode]["identical"], report
            assert report[mode]["columns"] == [[12 * rank, 12 * rank + 12]] * 2, report
            assert report[mode]["node"] == {"identical": True, "columns": report[mode]["columns"], "device": True}
        assert report["served"] == {"1": 8, "14": 8}  # sp's steps, each issued at step start


@pytest.mark.slow
def test_tensor_parallel_ranks_serve_the_tables_rows_or_all_the_policys(ranks):
    """Remote layers in graph mode in_graph (FULL graphs), each rank with its own memory node: the ranks reduce
    each layer's ok byte with vLLM's own all-reduce inside the step and mask the rows by it. Rank 1's node
    dies before step KILL_AT: from then on rank 0's gathers still succeed, yet both ranks' layers run on zero
    rows (never a mix the collectives after the layer would blend), and under policy fail both ranks refuse
    each such step where vLLM reads its result (``Worker.sample_tokens``), naming the layer and the rank it
    failed on. Both policies in turn, a fresh pair of nodes each."""
    for rank, lines in enumerate(ranks):
        steps = lines[:-1]
        assert {s["policy"] for s in steps} == set(POLICIES)
        for s in steps:
            if s["step"] < KILL_AT:
                assert (s["rows"], s["check"]) == ({"1": "table", "14": "table"}, "ok"), (rank, s)
                continue
            assert s["rows"] == {"1": "zeros", "14": "zeros"}, (rank, s)  # rank 0's own rows masked too
            if s["policy"] == "fail":
                where = "on another rank" if rank == 0 else "here"
                assert f"layer 1: step {s['step'] + 1}'s rows were not served {where}" in s["check"], (rank, s)
            else:
                assert s["check"] == "ok", (rank, s)
        for policy in POLICIES:
            assert len([s for s in steps if s["policy"] == policy]) > KILL_AT + 1, steps
