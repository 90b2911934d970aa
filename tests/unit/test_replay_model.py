"""The deadline model's arithmetic and the replay's helpers (pure logic)."""

from __future__ import annotations

import os
import sys

import numpy as np
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
from replay import ENGRAM, Traffic, graph_mode, lru_hit_rate, placement_toml, predict_stall, wait_overheads  # noqa: E402

W1, W14 = 0.3e-3, 9.3e-3


def test_reads_inside_windows_cost_only_the_waits():
    reads = np.array([[0.1e-3, 5e-3]] * 10)
    overheads = np.full((10, 2), 2e-6)
    assert abs(predict_stall(reads, overheads, np.random.default_rng(0)) - 4e-6) < 1e-12


def test_late_layer_1_carries_over_to_layer_14():
    # layer 1 lands 0.2 ms late; layer 14 lands 0.1 ms after its own window, inside the carried-over stall
    reads = np.array([[W1 + 0.2e-3, W14 + 0.1e-3]])
    assert abs(predict_stall(reads, np.zeros((1, 2)), np.random.default_rng(0)) - 0.2e-3) < 1e-12
    reads = np.array([[W1 + 0.2e-3, W14 + 0.5e-3]])  # later than the carry-over: it adds the rest
    assert abs(predict_stall(reads, np.zeros((1, 2)), np.random.default_rng(0)) - 0.5e-3) < 1e-12


def test_wait_overheads_subtract_lateness():
    samples = np.array([[W1 + 0.1e-3, 1e-3, 0.13e-3, 5e-6]])  # stall1 = 0.1 ms late + 30 us of overhead
    o = wait_overheads(samples)
    assert np.allclose(o, [[30e-6, 5e-6]])


def test_lru_hit_rate():
    stream = [np.array([1, 2, 3]), np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([1])]
    assert lru_hit_rate(stream, capacity=10) == 4 / 10
    assert lru_hit_rate(stream, capacity=3) == 3 / 10  # 1 was evicted by 4, 5, 6


def test_traffic_reuses_tokens_and_hashes_to_table_ranges():
    from tableclient.engram import EngramHasher

    hasher = EngramHasher(ENGRAM, np.arange(ENGRAM.compressed_vocab_size))
    traffic = Traffic(8, seed=0)
    ids = hasher.step(traffic.step())
    assert ids.shape == (8, 2, 24)
    assert (ids[:, 0] < hasher.layout.table_rows[0]).all() and max(hasher.layout.table_rows) <= 600_000
    tokens = [t for h in traffic.step() for t in h]
    assert len(set(tokens)) < len(tokens) / 2  # sessions share a system prompt and reuse tokens


def test_placement_written_by_the_replay_is_the_plugins_configuration(tmp_path):
    """What `make replay` recommends, as the file the SGLang plugin reads (TABLESERVER_SGLANG_CONFIG)."""
    from tableclient.sglang import PluginConfig

    stalls = {1: {"tcp": 310e-6, "shm": 120e-6, "local": 2e-6}, 14: {"tcp": 0.0, "local": 0.0}}
    path = tmp_path / "placement.toml"
    path.write_text(placement_toml({1: "local", 14: "tcp"}, 64, stalls))
    cfg = PluginConfig.load({"TABLESERVER_SGLANG_CONFIG": str(path), "TABLESERVER_ADDRESS": "memnode:7070"})
    assert cfg.layers == {1: "local", 14: "remote"} and cfg.transport == "tcp"
    assert cfg.window(1) == W1 and cfg.window(14) == W14
    assert "batch 64" in path.read_text() and "tcp 310" in path.read_text()
    path.write_text(placement_toml({1: "shm", 14: "rdma"}, 1, {1: {"shm": 0.0}, 14: {"rdma": 0.0}}))
    cfg = PluginConfig.load({"TABLESERVER_SGLANG_CONFIG": str(path), "TABLESERVER_ADDRESS": "memnode:7070"})
    assert cfg.layers == {1: "node", 14: "remote"} and cfg.transport == "rdma"
    # decode graph modes: in_graph where the read p99 fits half the window; a local layer has none
    modes = {1: graph_mode(200e-6, W1), 14: graph_mode(1e-3, W14)}
    assert modes == {1: "before_replay", 14: "in_graph"} and graph_mode(100e-6, W1) == "in_graph"
    path.write_text(placement_toml({1: "local", 14: "tcp"}, 64, stalls, modes))
    cfg = PluginConfig.load({"TABLESERVER_SGLANG_CONFIG": str(path), "TABLESERVER_ADDRESS": "memnode:7070"})
    assert cfg.graph == {14: "in_graph"} and cfg.graph_mode(1) == "before_replay"
