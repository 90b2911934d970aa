"""Where each engine keeps the Engram tables and what that takes, per process and per host (pure logic)."""

from __future__ import annotations

import pytest

from tableserver.common.hostmem import (
    GIB,
    Parallel,
    default_home,
    engine_bytes,
    pinned_bytes,
    placed_bytes,
    process_bytes,
    rank_rows,
    staging_bytes,
    table_bytes,
    vllm_columns,
    vllm_private_bytes,
)
from tableserver.common.model import ROWS_PER_TOKEN, TABLE_ROWS

L1, L14 = TABLE_ROWS[1], TABLE_ROWS[14]
B1 = table_bytes(L1)  # 94.4 GiB


def test_torch_pins_powers_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 4096, 4097, 3 * GIB)] == [0, 1, 4096, 8192, 4 * GIB]


def test_vllm_shards_columns_from_the_first_rank():
    assert [vllm_columns(8, r) for r in range(8)] == [3] * 8
    assert [vllm_columns(5, r) for r in range(5)] == [5, 5, 5, 5, 4]
    assert sum(vllm_columns(7, r) for r in range(7)) == ROWS_PER_TOKEN
    assert sum(rank_rows("sglang", 1001, 8, r) for r in range(8)) == 1001


def test_vllm_private_pinned_tables_round_up():
    """TP 8, DP 1 (vLLM's cpu_offload default there): each rank pins 48 M rows as 12.3 GB of fp8 values and
    0.4 GB of scales, rounded to 16 GiB and 512 MiB: 264 GiB for both tables instead of 188.8."""
    p = Parallel("vllm", tp=8)
    assert default_home(p) == "per-rank"
    assert process_bytes("vllm", "per-rank", rank_rows("vllm", L1, 8, 0)) == 16 * GIB + GIB // 2
    assert engine_bytes(p, "per-rank", L1) + engine_bytes(p, "per-rank", L14) == 264 * GIB
    assert vllm_private_bytes(1000) == 1024 * 256 + 8192  # values and scales rounded apart


def test_vllm_shares_one_copy_per_host_between_replicas():
    p = Parallel("vllm", tp=4, dp=2)
    assert default_home(p) == "shared"
    assert abs(engine_bytes(p, "shared", L1) - B1) <= 8 * 264  # every TP shard once, split between 2 replicas
    assert default_home(Parallel("vllm", tp=8, dp=2, nnodes=2)) == "per-rank"  # replicas on different hosts
    with pytest.raises(ValueError, match="dp_shared_memory needs DP replicas together"):
        engine_bytes(Parallel("vllm", tp=8), "shared", L1)


def test_sglang_host_table_is_one_copy_per_tp_group():
    assert engine_bytes(Parallel("sglang", tp=8), "shared", L1) == B1
    assert engine_bytes(Parallel("sglang", tp=4, dp=2), "shared", L1) == 2 * B1  # two TP groups, two memfds
    assert engine_bytes(Parallel("sglang", tp=8, dp=8, dp_attention=True), "shared", L1) == B1  # one TP group
    assert engine_bytes(Parallel("sglang", tp=8), "per-rank", L1) == B1  # shards of one copy
    assert engine_bytes(Parallel("sglang", tp=8), "device", L1) == 0
    with pytest.raises(ValueError, match="cannot span hosts"):
        engine_bytes(Parallel("sglang", tp=16, nnodes=2), "shared", L1)
    assert abs(engine_bytes(Parallel("sglang", tp=16, nnodes=2), "per-rank", L1) - B1 // 2) <= 8 * 264  # its half


def test_a_placement_keeps_a_node_copy_and_nothing_for_remote():
    p = Parallel("sglang", tp=4, dp=2)
    assert placed_bytes(p, "shared", "remote", L1) == 0
    assert placed_bytes(p, "shared", "node", L1) == B1  # the node daemon's one copy, whatever the replicas
    assert placed_bytes(p, "shared", "local", L1) == 2 * B1
    with pytest.raises(ValueError, match="use one of remote, node, local"):
        placed_bytes(p, "shared", "far", L1)


def test_the_plugins_staging_is_pinned_per_channel():
    # SGLang: forward, scheduler staging and decode graphs; 8192 tokens x 24 rows x 264 B = 51.9 MB -> 64 MiB
    assert staging_bytes(Parallel("sglang", tp=8), 2) == 3 * 2 * 64 * (1 << 20)
    # vLLM: a rank stages only its 3 of 24 columns, one step per layer
    assert staging_bytes(Parallel("vllm", tp=8), 1) == pinned_bytes(8192 * 3 * 264)


def test_layouts_that_cannot_be_are_refused():
    for kwargs, msg in (
        ({"engine": "trt"}, "use one of sglang, vllm"),
        ({"engine": "sglang", "tp": 0}, "tp 0"),
        ({"engine": "vllm", "tp": 8, "dp": 2, "dp_attention": True}, "attention DP is SGLang's"),
        ({"engine": "sglang", "tp": 3, "nnodes": 2}, "do not spread evenly"),
    ):
        with pytest.raises(ValueError, match=msg):
            Parallel(**kwargs)
