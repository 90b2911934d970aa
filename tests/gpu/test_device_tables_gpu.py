"""Graph mode ``device`` on a real GPU: a real daemon's sealed table mapping registered with CUDA read-only and
mapped, the rows gathered by the compiled kernel inside a captured CUDA graph, bit-exact; the daemon restarted
on the same data is registered anew and the same graph, replayed without capturing again, reads the new
mapping; the start-up probe of stream memory operations passes. Skipped without CUDA (the skip line says so):
tests/daemon/test_device_tables.py runs the same paths on the CPU through Triton's interpreter."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch
from conftest import local_tables, start_daemon, wait_for
from tests_helpers import free_port_block

from tableserver.tables.demo import DemoTable, write_demo_file

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine): graph mode device has not run here"
)

TABLES = [DemoTable("engram.layer14", 200_003, 264, 14)]


def test_the_probe_passes_and_a_second_call_is_cached():
    from tableclient.graph.streams import probe_device

    probe_device(torch, 0)
    assert probe_device(torch, 0) == 0.0


def test_a_captured_graph_gathers_the_registered_mapping_and_follows_a_restart_without_recapture(tmp_path):
    from tableclient import TableClient
    from tableclient.graph.device.table import DeviceTable, gather

    path = write_demo_file(str(tmp_path / "t.bin"), TABLES, seed=5)
    table = local_tables(path)["engram.layer14"]
    port = free_port_block()
    serve = ("--tables", path, "--listen", f"127.0.0.1:{port}")
    d = start_daemon(str(tmp_path / "a"), *serve)
    with TableClient(d.address, transport="shm") as c:
        t = DeviceTable(c, "engram.layer14", "cuda")
        n = 512 * 24
        ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        out = torch.zeros((n, 264), dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gather(t, ids, out)  # compiled before the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gather(t, ids, out)
        rng = np.random.default_rng(1)

        def replay_and_check():
            want = rng.integers(0, table.shape[0], n)
            ids.copy_(torch.from_numpy(want))
            t.refresh()
            graph.replay()
            torch.cuda.synchronize()
            np.testing.assert_array_equal(out.cpu().numpy(), table[want])

        for _ in range(5):
            replay_and_check()
        generation = t.generation
        d.stop(signal.SIGKILL)
        wait_for(lambda: c.replicas()[d.address]["state"] == "down", "the client to notice the loss")
        d = start_daemon(str(tmp_path / "b"), *serve)
        wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
        replay_and_check()  # the same graph: the kernel reads the rewritten pointer
        assert t.generation > generation
        t.close()
    d.stop()
