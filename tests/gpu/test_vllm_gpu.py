"""The vLLM plugin's GPU side that runs without vLLM (the device machine has no vLLM wheel): a served
layer's rows copied from the pinned staging to the GPU and dequantized there with vLLM's arithmetic, and
the staging refilled only once that copy is done.

Runs only where CUDA is (the device machine); skipped elsewhere, which the skip line says. vLLM's own
layers on the GPU are not exercised here: tests/engines/vllm/test_vllm_graphs.py runs them on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import local_tables, start_daemon
from tableclient.engine import EngramRows, PluginConfig, dequantize

from tableserver.tables.demo import DemoTable, write_demo_file

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (none on this machine): the vLLM plugin's device copies have not run here",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vllm-gpu") / "engram.bin")
    write_demo_file(path, [DemoTable("engram.layer14", 50_000, 264, 14)], seed=3)
    daemon = start_daemon(str(tmp_path_factory.mktemp("memnode")), "--tables", path)
    rows = EngramRows(PluginConfig(address=daemon.address, transport="tcp", max_tokens=64), engine="vllm", dead_id=-1)
    rows.add_layer(14, "remote", 50_000, 256, columns=12)  # a TP=2 rank's share of the hash columns
    yield rows, local_tables(path)["engram.layer14"]
    rows.close()
    daemon.stop()


def test_rows_dequantized_on_the_gpu_are_the_cpu_bits_and_the_staging_waits_for_the_copy(served):
    from tableclient.vllm.embedding import RemoteEngramEmbedding

    rows, table = served
    embed = RemoteEngramEmbedding(rows, 14, 50_000, 256, tuple([2003] * 24), tp_size=2, tp_rank=1)
    out = torch.empty((64, 12, 256), dtype=torch.bfloat16, device="cuda")  # vLLM's persistent staged_rows
    rng = np.random.default_rng(0)
    for step in range(5):
        ids = rng.integers(0, 50_000, (64, 12))
        ids[step] = -1  # DEAD_ID: zero rows
        assert rows.issue(14, ids, key=64)
        packed = rows.collect(14, key=64)
        embed.dequantize_into(packed, out)
        copied = torch.cuda.Event()
        copied.record()
        rows.fence("layer14", copied)  # the next issue refills the pinned staging only after this copy
        want = dequantize(torch.from_numpy(np.where(ids[..., None] >= 0, table[np.maximum(ids, 0)], 0)), 256,
                          exponent_scales=True)  # fmt: skip
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
    assert rows.summary()[14]["prefetched"] == 5


def test_device_rows_are_gathered_inside_a_captured_graph_bit_exact_at_every_replay(tmp_path):
    """Graph mode device as vLLM's FULL graphs run it (the plugin's launch, join and dequantize, without vLLM):
    captured once in a CUDA graph, the side stream forked and joined inside it; every replay, with that step's
    ids in the graph's input buffer, gives a TP=2 rank's columns of the node's table bit-exact (DEAD_ID: zero
    rows), read by the kernel from the registered mapping."""
    import types

    from tableclient import TableClient
    from tableclient.devicetable import DeviceTable
    from tableclient.vllm.embedding import DeviceRows, RemoteEngramEmbedding

    path = str(tmp_path / "engram.bin")
    write_demo_file(path, [DemoTable("engram.layer14", 50_000, 264, 14)], seed=5)
    table = local_tables(path)["engram.layer14"]
    daemon = start_daemon(str(tmp_path / "node"), "--tables", path)
    try:
        with TableClient(daemon.address, transport="shm") as client:
            rows = types.SimpleNamespace(dead_id=-1)
            embed = RemoteEngramEmbedding(rows, 14, 50_000, 256, tuple([2003] * 24), tp_size=2, tp_rank=1)
            device_table = DeviceTable(client, "engram.layer14", "cuda")
            embed.device_rows = DeviceRows(device_table, 64, embed.part_n_hash_cols, torch.cuda.Stream())
            hash_ids = torch.zeros((64, 24), dtype=torch.int32, device="cuda")  # the graph's input, as vLLM's
            out = torch.empty((64, 12, 256), dtype=torch.bfloat16, device="cuda")  # vLLM's staged_rows

            def forward():
                embed.launch(hash_ids)
                embed.join()
                embed.dequantize_gathered(out)

            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):  # Triton compiles its kernel here, outside the capture
                forward()
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
            rng = np.random.default_rng(1)
            for step in range(4):
                ids = rng.integers(0, 50_000, (64, 24))
                ids[step] = -1
                hash_ids.copy_(torch.from_numpy(ids).to(torch.int32))
                graph.replay()
                torch.cuda.synchronize()
                mine = ids[:, 12:]
                want = dequantize(torch.from_numpy(np.where(mine[..., None] >= 0, table[np.maximum(mine, 0)], 0)),
                                  256, exponent_scales=True)  # fmt: skip
                assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
            device_table.close()
    finally:
        daemon.stop()
