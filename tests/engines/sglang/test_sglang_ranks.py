"""Tensor-parallel ranks in the released SGLang (0.5.23, pinned): two ranks in two processes over gloo
(tests/support/sglang_ranks.py), each with SGLang's own process groups, plugin loading, hasher, Engram layers and
decode graph runner class. Every test reads the one run of the two rank processes (every case, in turn): ranks agree,
or all stop together (issue 50, items 13-16)."""

from __future__ import annotations

import pytest
import torchvision_cpu  # noqa: F401  (before sglang: torchvision on a CPU torch)

pytest.importorskip("torch")
pytest.importorskip("sglang.srt.layers.engram")

from rank_report import TABLE_ROWS, assert_agreed, by_case  # noqa: E402
from sglang_cpu import engram_tables, memnode, model_config  # noqa: E402,F401  (fixtures)

KILL_AT = 2
POLICIES = ("fail", "zeros")
EAGER_MODES = ("eager", "eager_break")


@pytest.fixture(scope="module")
def ranks(engram_tables, memnode, tmp_path_factory):
    """Each rank's JSON lines, by case, of the one run of the two rank processes (every case of
    tests/support/sglang_ranks.py in turn). Each run of a node lost first (agreement: per policy; eager: per mode and
    policy) gives rank 1 a node of its own, killed before decode step KILL_AT, and rank 0 the memnode (never lost);
    rank 1's nodes of the modes case one that maps nothing (it serves from disk) and one that seals its tcp payloads.
    A rank left waiting in a collective ends itself, its stacks on stderr, before the test's own bound."""
    import json

    from conftest import EVENT_TIMEOUT, start_daemon
    from tests_helpers import free_port_block, run_ranks

    tmp = tmp_path_factory.mktemp("sglang-ranks")
    runs = [{"case": "agreement", "policy": p} for p in POLICIES]
    runs += [{"case": "eager", "mode": m, "policy": p} for m in EAGER_MODES for p in ("zeros", "fail")]
    own = {
        i: start_daemon(str(tmp / f"{run['case']}-{run.get('mode', '')}{run['policy']}1"), "--tables", engram_tables)
        for i, run in enumerate(runs)
    }
    disk = start_daemon(str(tmp / "disk"), "--tables", engram_tables, "--disk-tables", "all")
    sealed = start_daemon(str(tmp / "sealed"), "--tables", engram_tables, "--data-encryption", "on")

    def plan(rank: int) -> str:
        return json.dumps({
            "memnode": memnode.address,
            "kill_at": KILL_AT,
            "runs": [dict(run, address=own[i].address, pid=own[i].proc.pid) if rank == 1 else
                     dict(run, address=memnode.address, pid=None) for i, run in enumerate(runs)],
            "node": disk.address if rank == 1 else memnode.address,
            "remote": sealed.address if rank == 1 else memnode.address,
            "restart_port": free_port_block(),
            "workdir": str(tmp),
            "bound": EVENT_TIMEOUT * 0.9,
        })  # fmt: skip

    try:
        lines = run_ranks("sglang_ranks.py", [memnode, memnode], lambda rank, _: [engram_tables, plan(rank)])
    finally:
        for d in (*own.values(), disk, sealed):
            d.stop()
    return by_case(lines)


@pytest.fixture(scope="module")
def eager_ranks(ranks):
    """The eager cases' lines (eager, eager_zero_rows, eager_idle) of the same run."""
    return ranks


def assert_eager_agreed(eager_ranks, mode: str) -> None:
    """The runs of ``mode``, rank 1's node lost before decode step KILL_AT: before it the table's rows on both ranks;
    from it on under zeros both ranks' layers run on zero rows, each step counted as zero rows on both ranks (rank 1
    failed, rank 0's own rows masked); under fail both ranks raise at layer 1 of each such step, in one line naming
    the step (the same on both ranks) and where it failed (here on rank 1, on another rank on rank 0)."""
    import re

    said = []
    for rank, cases in enumerate(eager_ranks):
        steps = [s for s in cases["eager"] if s["mode"] == mode]
        for policy in ("zeros", "fail"):
            run = [s for s in steps if s["policy"] == policy]
            assert len(run) > KILL_AT + 1, (rank, policy, run)
            for s in run:
                if s["step"] < KILL_AT:
                    assert (s.get("rows"), s["check"]) == (TABLE_ROWS, "ok"), (rank, s)
                elif policy == "zeros":
                    assert (s.get("rows"), s["check"]) == ({"1": "zeros", "14": "zeros"}, "ok"), (rank, s)
            (counted,) = [c["counted"] for c in cases["eager_zero_rows"] if (c["mode"], c["policy"]) == (mode, policy)]
            assert counted == ({"1": len(run) - KILL_AT, "14": len(run) - KILL_AT} if policy == "zeros" else
                               {"1": 0, "14": 0}), (rank, policy, counted)  # fmt: skip
        where = "here" if rank == 1 else "on another rank"
        failed = [s for s in steps if s["policy"] == "fail" and s["step"] >= KILL_AT]
        pattern = re.compile(
            rf"tableserver plugin: layer 1: step (\d+)'s rows were not served {where} \(policy fail: every "
            r"tensor-parallel rank stops the step"
        )
        matched = [pattern.match(s["check"]) for s in failed]
        assert all(matched) and all("rows" not in s and "\n" not in s["check"] for s in failed), (rank, failed)
        said.append([int(m.group(1)) for m in matched])
    assert said[0] == said[1] and said[0] == list(range(said[0][0], said[0][0] + len(said[0]))), said


@pytest.mark.slow
def test_eager_decode_ranks_serve_zeros_together_or_all_fail_at_the_same_step(eager_ranks):
    """SGLang's decode CUDA graphs disabled: every decode step an eager forward, each served layer's rows gathered on
    the host (prefetched at step start). Each layer's outcome is reduced where SGLang's Engram reads its rows
    (``Engram.embed_rows``), one MIN over SGLang's tensor-parallel CPU group. Before, rank 1 alone served zeros (or
    raised inside its forward, before the collectives after the layer that its peers then wait in) while rank 0
    served its table's rows. See :func:`assert_eager_agreed`."""
    assert_eager_agreed(eager_ranks, "eager")


@pytest.mark.slow
def test_eager_break_layers_in_breakable_decode_graphs_agree_per_step(eager_ranks):
    """Both layers graph mode eager_break (``--cuda-graph-backend-decode breakable``: their rows fetched in the graph's
    eager breaks at every replay): each break reduces its layer's outcome over the CPU group before it writes the rows.
    See :func:`assert_eager_agreed`."""
    assert_eager_agreed(eager_ranks, "eager_break")


@pytest.mark.slow
def test_dp_attentions_idle_batches_join_every_eager_agreement(eager_ranks):
    """DP attention, decode graphs disabled: from decode step KILL_AT on rank 1's batches are idle (no token) while
    rank 0 decodes. SGLang runs every Engram layer on an idle batch too, so the idle rank joins each layer's reduction
    (it gathers nothing: the table's rows): rank 0's steps are its table's rows and checked, never a hang."""
    for rank, cases in enumerate(eager_ranks):
        steps = cases["eager_idle"]
        assert len(steps) > KILL_AT + 1, (rank, steps)
        for s in steps:
            if rank == 1 and s["step"] >= KILL_AT:
                assert (s["did"], s["check"]) == ("idle", "ok") and "rows" not in s, (rank, s)
            else:
                assert (s.get("rows"), s["check"]) == (TABLE_ROWS, "ok"), (rank, s)


@pytest.mark.slow
def test_one_graph_mode_per_layer_and_one_poller_for_every_rank(ranks):
    """Layer 1 placed node (graph mode device), layer 14 remote in_graph. Rank 1's GPU cannot register its node's
    table (the node serves from disk: nothing mapped) and its remote node seals its tcp payloads (which the native
    poller does not read); rank 0 could do both. Decided once, before capture, with a MIN over SGLang's
    tensor-parallel CPU group: both ranks gather layer 1 before_replay and serve layer 14 with the Python poller.
    Each rank says why in one line, the decision is logged once (rank 0), every decode step bit-identical to
    SGLang's own tables on both ranks."""
    reports = [cases["modes"][0] for cases in ranks]
    for rank, report in enumerate(reports):
        assert report["modes"] == {"1": "before_replay", "14": "in_graph"}, (rank, report)
        assert report["pollers"] == {"node": None, "remote": "python"}, (rank, report)
        why = "not mapped in this process" if rank == 1 else "another tensor-parallel rank cannot register its table"
        fallback = [line for line in report["lines"] if "graph mode 'device' unavailable" in line]
        assert len(fallback) == 1 and why in fallback[0] and "\n" not in fallback[0], (rank, fallback)
        steps = ranks[rank]["modes_step"]
        assert steps and all((s["rows"], s["check"]) == (TABLE_ROWS, "ok") for s in steps), (rank, steps)
    assert any("the Python poller (" in line and "seals its tcp payloads" in line for line in reports[1]["lines"])
    decided = [line for report in reports for line in report["lines"] if "decode CUDA graphs of up to" in line]
    assert decided == [
        "INFO tableserver plugin: decode CUDA graphs of up to 8 tokens: layer 1 before_replay, layer 14 in_graph; "
        "in_graph layers served by the python poller (agreed by the 2 tensor-parallel ranks)"
    ], decided


@pytest.mark.slow
def test_device_layers_outcomes_are_agreed_and_fail_raises_on_every_rank_at_the_same_step(ranks):
    """Both layers placed node (graph mode device), each rank with its own node; rank 1's node lost first. Each
    layer's ok is reduced inside the graph over SGLang's tensor-parallel group (before, SGLang's world size was
    read from a name SGLang 0.5.23 does not export, so no rank ever agreed): from then on both ranks serve zero
    rows (zeros), or both refuse that step where the scheduler processes its result (fail), naming the layer and
    the rank it failed on."""
    assert_agreed([cases["agreement"] for cases in ranks], KILL_AT, POLICIES)


@pytest.mark.slow
def test_a_failed_arm_fails_that_step_only(ranks):
    """Decode step KILL_AT is armed and its graph never runs: its result is refused (no outcome was written), the
    next step's arm fails (inside SGLang's execute, which runs the plugin's host part in load_batch: the plugin
    resets every GraphStep) and that step is refused on both ranks; every step after it is served and checked."""
    for rank, cases in enumerate(ranks):
        steps = cases["failed_arm"]
        assert len(steps) > KILL_AT + 2
        for s in steps:
            if s["step"] == KILL_AT:
                assert "outcome is not held" in s["check"] and "rows" not in s, (rank, s)
            elif s["step"] == KILL_AT + 1:
                assert "was not released and consumed" in s["check"] and "rows" not in s, (rank, s)
            else:
                assert (s["rows"], s["check"]) == (TABLE_ROWS, "ok"), (rank, s)


@pytest.mark.slow
def test_dp_attentions_idle_batches_never_mask_their_peers_rows(ranks):
    """DP attention (two attention-DP ranks): rank 1's node dies before decode step KILL_AT (both ranks serve
    zeros that step: agreed), comes back, and rank 1 then runs idle batches (replays of no real token, beside rank
    0's decode, the agreement's collectives alike). An idle replay gathers nothing and its before_replay layers'
    rows count as the table's: rank 0's rows are the table's again (before, the idle rank kept the failed step's
    outcome and masked its peer's rows with zeros for as long as it stayed idle)."""
    for rank, cases in enumerate(ranks):
        steps = cases["idle"]
        assert len(steps) > KILL_AT + 2
        for s in steps:
            assert s["check"] == "ok", (rank, s)
            if s["step"] < KILL_AT:
                assert s["rows"] == TABLE_ROWS, (rank, s)
            elif s["step"] == KILL_AT:
                assert s["rows"] == {"1": "zeros", "14": "zeros"}, (rank, s)
            elif rank == 1:
                assert s["did"] == "idle" and "rows" not in s, (rank, s)
            else:
                assert s["rows"] == TABLE_ROWS, (rank, s)
