"""The host KV model's arithmetic (bench/kv_model.py) and the plan `make replay` prints beside its placement."""

from __future__ import annotations

import argparse
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
from kv_model import GIB, AgentTrace, PrefixCache, model, replay, report, sessions_for  # noqa: E402
from replay import plan_beside  # noqa: E402

SMALL = AgentTrace(context_tokens=20_000, turns=10, rounds=2)


def test_a_request_hits_its_longest_cached_prefix_and_leaves_go_first():
    cache = PrefixCache(pages=4)
    assert cache.serve(["s", "a1", "a2"], prompt_pages=2) == 0
    assert cache.serve(["s", "a1", "a2", "a3"], prompt_pages=3) == 3  # the previous turn's pages, reply included
    assert cache.serve(["s", "b1"], prompt_pages=2) == 1  # the shared page
    # 5 pages over a capacity of 4: the oldest leaf went (a3, the deepest of the least recent request)
    assert "a3" not in cache.lru and "s" in cache.lru and "a1" in cache.lru
    assert cache.serve(["x", "a1"], prompt_pages=2) == 0  # a prefix must start at the first page


def test_more_capacity_recomputes_less_and_enough_recomputes_only_first_sight():
    device = 2_000_000
    sessions = sessions_for(SMALL, device)
    assert sessions == 2 * device // int(SMALL.mean_context) + 1
    small, large, huge = (replay(SMALL, device * k, sessions) for k in (1, 2, 50))
    assert small["prompt"] == large["prompt"] == huge["prompt"]  # the same trace each time
    assert small["recomputed"] > large["recomputed"] > huge["recomputed"] > 0
    # with room for everything only what no request sent before is computed: each turn's new tokens, each
    # session's own context once (10 turns here), the shared prompt once, and partial pages
    assert huge["hit"] / huge["prompt"] > 0.85 > small["hit"] / small["prompt"]


def test_a_host_cache_no_larger_than_the_device_adds_nothing():
    rows, workload = model(GIB, {"host 1": 1.0, "host 0.5": 0.5, "none": None, "host 3": 3.0}, SMALL)
    assert [r is None for _, _, r in rows] == [False, True, True, True, False]
    assert rows[-1][2]["recomputed"] < rows[0][2]["recomputed"] and "live agent sessions" in workload
    text = report(GIB, {"host 3": 3.0}, SMALL)
    assert "a MODEL, not a measurement" in text and "assumed" in text and "write-through" in text


def test_make_replay_prints_the_plan_and_the_model_beside_its_placement():
    args = argparse.Namespace(
        plan_engine="sglang", plan_tp=8, plan_dp=1, plan_kv_pool_gib=4.0, plan_host_memory_gib=None
    )
    text = "\n".join(plan_beside({1: "shm", 14: "tcp"}, "out/placement.toml", args))
    assert "tableserver plan --placement out/placement.toml --engine sglang --tp 8" in text
    assert "a MODEL, not a measurement" in text and "device KV only" in text
    args.plan_host_memory_gib = 512.0
    text = "\n".join(plan_beside({1: "shm", 14: "tcp"}, "out/placement.toml", args))
    assert "TABLESERVER_SGLANG_CONFIG=out/placement.toml" in text and "reference serving host" not in text
    assert "+ host KV, tables served (ratio" in text
