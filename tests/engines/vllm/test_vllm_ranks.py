"""Tensor and sequence parallelism in the released vLLM (0.33.0, pinned): two ranks in two processes over gloo
(tests/support/vllm_ranks.py), each building vLLM's own layers; apart from tests/engines/vllm/test_vllm_plugin.py
(whose fixtures it uses) so that the test workers share vLLM's minutes. Every test reads the one run of the rank
processes (vLLM starts once a rank): ranks agree, or all stop together (issue 50, items 13-16)."""

from __future__ import annotations

import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)

pytest.importorskip("torch")
vllm_cpu.require_vllm()

from rank_report import TABLE_ROWS, assert_agreed, by_case  # noqa: E402
from test_vllm_plugin import engram_tables, memnode, model_dir  # noqa: E402,F401  (fixtures)

KILL_AT = 3
POLICIES = ("fail", "zeros")
PLACEMENTS = ("remote", "node")


@pytest.fixture(scope="module")
def ranks(model_dir, engram_tables, memnode, tmp_path_factory):
    """Each rank's JSON lines (tests/support/vllm_ranks.py): each rank with its own node per placement and policy
    for the agreement and per policy for the eager case, rank 1's device layers reading a node that maps nothing
    (it serves from disk); a rank left waiting in a collective ends itself, its stacks on stderr, before the test's
    own bound."""
    import json

    from conftest import EVENT_TIMEOUT, start_daemon
    from tests_helpers import run_ranks

    tmp = tmp_path_factory.mktemp("ranks")
    nodes = {
        (placement, policy, rank): start_daemon(str(tmp / f"{placement}-{policy}{rank}"), "--tables", engram_tables)
        for placement in (*PLACEMENTS, "eager")
        for policy in POLICIES
        for rank in range(2)
    }
    disk = start_daemon(str(tmp / "disk"), "--tables", engram_tables, "--disk-tables", "all")

    def plan(rank: int) -> str:
        runs = [
            {"placement": placement, "policy": policy, "address": d.address, "pid": d.proc.pid}
            for (placement, policy, r), d in nodes.items()
            if r == rank
        ]
        return json.dumps({
            "memnode": memnode.address,
            "kill_at": KILL_AT,
            "runs": [run for run in runs if run["placement"] != "eager"],
            "eager": [run for run in runs if run["placement"] == "eager"],
            "refuse": disk.address if rank == 1 else memnode.address,
            "bound": EVENT_TIMEOUT * 0.9,
        })  # fmt: skip

    try:
        lines = run_ranks(
            "vllm_ranks.py",
            [memnode, memnode],
            lambda rank, _: [model_dir[0], engram_tables, plan(rank)],
        )
    finally:
        for d in (*nodes.values(), disk):
            d.stop()
    return by_case(lines)


def eager(ranks, policy: str) -> list[dict]:
    """Each rank's lines of the eager case's run under ``policy``, by case."""
    cases = ("eager", "eager_zero_rows")
    return by_case([[line for c in cases for line in lines.get(c, []) if line["policy"] == policy] for lines in ranks])


@pytest.mark.slow
def test_tensor_and_sequence_parallel_ranks_gather_their_columns(ranks):
    """TP=2 in two processes over gloo: each rank's served layers gather only its hash columns (12 of 24), and
    vLLM's own collectives join them, as for its head-sharded local tables; with sequence parallelism too;
    placed remote (the host path) and placed node (graph mode device: each rank's kernel gathers its own
    columns of every token). Every output bit-identical to vLLM's own tables on that rank."""
    for rank, cases in enumerate(ranks):
        (report,) = cases["columns"]
        for mode in ("tp", "sp"):
            assert report[mode]["identical"], report
            assert report[mode]["columns"] == [[12 * rank, 12 * rank + 12]] * 2, report
            assert report[mode]["node"] == {"identical": True, "columns": report[mode]["columns"], "device": True}
        assert report["served"] == {"1": 8, "14": 8}  # sp's steps, each issued at step start


def agreement(ranks, placement: str) -> None:
    """The agreement runs of ``placement``: each rank's own node, rank 1's killed before step KILL_AT
    (:func:`rank_report.assert_agreed`)."""
    assert_agreed([[s for s in c["agreement"] if s["placement"] == placement] for c in ranks], KILL_AT, POLICIES)


@pytest.mark.slow
def test_tensor_parallel_ranks_serve_the_tables_rows_or_all_the_policys(ranks):
    """Remote layers in graph mode in_graph (FULL graphs): the ranks reduce each layer's ok byte with vLLM's own
    all-reduce inside the step and mask the rows by it: from rank 1's node's loss on, both ranks' layers run on zero
    rows (rank 0's own rows masked too: never a mix the collectives after the layer would blend), and under policy
    fail both ranks refuse each such step where vLLM reads its result, naming the layer and the rank it failed on.
    Both policies in turn, a fresh pair of nodes each."""
    agreement(ranks, "remote")


@pytest.mark.slow
def test_device_layers_outcomes_are_agreed_and_fail_raises_on_every_rank_at_the_same_step(ranks):
    """Node layers in graph mode device (the kernel reading each rank's own node's mapping): rank 1's node lost
    first. Before, rank 1 alone refused the step before its forward while rank 0 served its table's rows and
    waited in the layer's collectives; now each layer's ok (its table mapped) is reduced inside the step as the
    in_graph layers' is: both ranks serve zeros (zeros) or both refuse the same step where vLLM reads its result
    (fail). See :func:`agreement`."""
    agreement(ranks, "node")


@pytest.mark.slow
def test_one_graph_mode_per_layer_and_one_poller_for_every_rank(ranks):
    """Rank 1's GPU cannot register its node's tables (its node serves them from disk: nothing mapped), rank 0's
    can: the ranks decide each layer's mode once, at start-up, with a MIN over vLLM's tensor-parallel CPU group, so
    both take the host path inside FULL graphs (in_graph) instead of rank 0 alone gathering on the device (whose
    steps issue none of the in_graph layers' per-layer collectives); the poller too (rank 1's in_graph layers are
    read over shm without a mapping, which only the Python poller serves). Each rank says why in one line, the
    decision is logged once (rank 0), and every step is bit-identical to vLLM's own tables on both ranks."""
    reports = [cases["modes"][0] for cases in ranks]
    for rank, report in enumerate(reports):
        assert report["modes"] == {"1": "in_graph", "14": "in_graph"}, (rank, report)
        assert report["identical"], (rank, report)
        why = "not mapped in this process" if rank == 1 else "another tensor-parallel rank cannot register its table"
        fallback = [line for line in report["lines"] if "graph mode 'device' unavailable" in line]
        assert len(fallback) == 2 and all(why in line and "\n" not in line for line in fallback), (rank, fallback)
    assert reports[0]["pollers"] == reports[1]["pollers"] == {"node": reports[1]["pollers"]["node"]}
    decided = [line for report in reports for line in report["lines"] if "served layers in vLLM's graphs" in line]
    poller = reports[0]["pollers"]["node"]
    assert decided == [
        f"INFO tableserver plugin: served layers in vLLM's graphs: layer 1 in_graph, layer 14 in_graph; in_graph "
        f"layers served by the {poller} poller (agreed by the 2 tensor-parallel ranks)"
    ], decided


@pytest.mark.slow
def test_a_failed_arm_fails_that_step_only(ranks):
    """Step KILL_AT is armed and its model runner returns without running the layers (its graph never publishes
    the ids): its result is refused (no outcome was written), the next step's ``arm()`` fails (the step before was
    never consumed) and that step is refused before its forward on both ranks; every GraphStep is reset, so the
    steps after it are served and checked again (before, the outcome ring lagged and every later step failed)."""
    for rank, cases in enumerate(ranks):
        steps = cases["failed_arm"]
        assert len(steps) > KILL_AT + 2
        for s in steps:
            if s["step"] == KILL_AT:
                assert s["rows"] == {} and "outcome is not held" in s["check"], (rank, s)
            elif s["step"] == KILL_AT + 1:
                assert s["rows"] == {} and "this step could not be armed" in s["check"], (rank, s)
                assert "it is not run" in s["check"] and "\n" not in s["check"], (rank, s)
            else:
                assert (s["rows"], s["check"]) == (TABLE_ROWS, "ok"), (rank, s)


@pytest.mark.slow
def test_data_parallel_dummy_batches_leave_no_step_armed(ranks):
    """vLLM's ``execute_dummy_batch`` arms the in_graph layers for 0 tokens; outside FULL replays its dummy run
    hashes nothing, so its graph never publishes the ids (before, the next real step's arm waited out the timeout
    and failed, and every step after it). Each dummy is followed by a reset of every GraphStep: every real step
    after a dummy that hashed nothing, or one that ran the layers, is served and checked on both ranks."""
    for rank, cases in enumerate(ranks):
        assert [d["check"] for d in cases["dummy_batch"]] == ["ok", "ok"], (rank, cases["dummy_batch"])
        steps = cases["dummy"]
        assert len(steps) > 3
        assert all((s["rows"], s["check"]) == (TABLE_ROWS, "ok") for s in steps), (rank, steps)


@pytest.mark.slow
def test_pipeline_parallelism_is_refused_at_start_up_with_one_line(ranks):
    """vLLM's pipeline parallelism (two stages): the stage holding a served layer returns no results to check its
    rows by, the last stage checks none. Building a served layer is refused on every stage, in one line naming the
    flag."""
    for rank, cases in enumerate(ranks):
        (said,) = [c["said"] for c in cases["pipeline"]]
        assert said.startswith("PluginError: tableserver plugin: served Engram layers do not handle pipeline "), said
        assert "--pipeline-parallel-size 1" in said and "\n" not in said, (rank, said)


@pytest.mark.slow
def test_eager_break_layers_serve_zeros_on_every_rank_from_the_step_one_rank_fails(ranks):
    """Remote layers in graph mode eager_break (vLLM's eager break: rows gathered on the host, collected when the
    layer runs, outside any graph), policy zeros, rank 1's node lost before step KILL_AT. Each layer's outcome is
    reduced in its eager break, one MIN over vLLM's tensor-parallel CPU group, before vLLM's all-gather joins the
    ranks' columns: from that step on both ranks' layers run on zero rows (before, rank 0 served its table's rows
    and rank 1 zeros, which the all-gather blended), and the step is counted as zero rows on both ranks (rank 1
    failed, rank 0's own rows masked)."""
    for rank, cases in enumerate(eager(ranks, "zeros")):
        steps = cases["eager"]
        assert len(steps) > KILL_AT + 1, (rank, steps)
        for s in steps:
            want = TABLE_ROWS if s["step"] < KILL_AT else {"1": "zeros", "14": "zeros"}
            assert (s.get("rows"), s["check"]) == (want, "ok"), (rank, s)
        (counted,) = cases["eager_zero_rows"]
        assert counted["counted"] == {"1": len(steps) - KILL_AT, "14": len(steps) - KILL_AT}, (rank, counted)


@pytest.mark.slow
def test_eager_break_layers_fail_on_every_rank_at_the_same_step(ranks):
    """As above under policy fail: from rank 1's node's loss on, both ranks raise at layer 1 of every such step, in
    its eager break, in one line naming the layer, the step (the same on both) and where it failed (here on rank 1,
    on another rank on rank 0). Before, rank 1 alone raised inside its forward while rank 0 waited in the layer's
    all-gather: the instance hung (here, the rank processes ended by their bound)."""
    raised = [[s for s in cases["eager"] if s["step"] >= KILL_AT] for cases in eager(ranks, "fail")]
    for rank, cases in enumerate(eager(ranks, "fail")):
        steps = cases["eager"]
        assert len(steps) > KILL_AT + 1, (rank, steps)
        for s in steps:
            if s["step"] < KILL_AT:
                assert (s["rows"], s["check"]) == (TABLE_ROWS, "ok"), (rank, s)
                continue
            where = "here" if rank == 1 else "on another rank"
            said = f"tableserver plugin: layer 1: step {s['step'] + 1}'s rows were not served {where} (policy fail: "
            assert s["rows"] == {} and s["check"].startswith(said) and "\n" not in s["check"], (rank, s)
    assert [s["step"] for s in raised[0]] == [s["step"] for s in raised[1]]
