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
    """Graph mode device as vLLM's FULL graphs run it, without vLLM: the plugin's GraphStep over a table registered
    beforehand (as the ranks agree on it at start-up), this rank's columns handed to it (its kernel launched on its
    side stream), its rows taken where the layer reads them (the side stream joined) and dequantized with vLLM's
    arithmetic; captured once in a CUDA graph. Every replay, with that step's ids in the graph's input buffer, gives
    a TP=2 rank's columns of the node's table bit-exact (DEAD_ID: zero rows), read by the kernel from the registered
    mapping; the GraphStep leaves the table it did not register to its owner."""
    import types

    from tableclient import TableClient
    from tableclient.graph.device.table import DeviceTable
    from tableclient.graph.step import GraphStep
    from tableclient.step import LayerPlan
    from tableclient.vllm.embedding import RemoteEngramEmbedding

    path = str(tmp_path / "engram.bin")
    write_demo_file(path, [DemoTable("engram.layer14", 50_000, 264, 14)], seed=5)
    table = local_tables(path)["engram.layer14"]
    daemon = start_daemon(str(tmp_path / "node"), "--tables", path)
    try:
        with TableClient(daemon.address, transport="shm") as client:
            rows = types.SimpleNamespace(dead_id=-1)
            embed = RemoteEngramEmbedding(rows, 14, 50_000, 256, tuple([2003] * 24), tp_size=2, tp_rank=1)
            device_table = DeviceTable(client, "engram.layer14", "cuda")
            step = GraphStep(
                client, [LayerPlan(14, "engram.layer14", 9.3e-3)], {14: "device"}, 64, rows_per_token=12,
                device="cuda", dead_id=-1, tables={"engram.layer14": device_table},
            )  # fmt: skip
            assert step.device_tables == {14: device_table}
            hash_ids = torch.zeros((64, 24), dtype=torch.int32, device="cuda")  # the graph's input, as vLLM's
            ids = torch.empty((64, 12), dtype=torch.int64, device="cuda")  # this rank's columns (the hooks')
            out = torch.empty((64, 12, 256), dtype=torch.bfloat16, device="cuda")  # vLLM's staged_rows

            def forward(graph: bool):
                ids.copy_(hash_ids[:, 12:])
                step.publish_ids(14, ids, graph=graph)
                embed.dequantize_into(step.rows(14, 64, graph=graph).view(64, 12, -1), out)

            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):  # Triton compiles its kernel here, outside the capture
                forward(False)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward(True)
            rng = np.random.default_rng(1)
            for n in range(4):
                want_ids = rng.integers(0, 50_000, (64, 24))
                want_ids[n] = -1
                hash_ids.copy_(torch.from_numpy(want_ids).to(torch.int32))
                step.arm(64)
                graph.replay()
                torch.cuda.synchronize()
                mine = want_ids[:, 12:]
                want = dequantize(torch.from_numpy(np.where(mine[..., None] >= 0, table[np.maximum(mine, 0)], 0)),
                                  256, exponent_scales=True)  # fmt: skip
                assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
            step.close()
            assert device_table.pointer.item() != 0  # still registered: its owner closes it
            device_table.close()
    finally:
        daemon.stop()
