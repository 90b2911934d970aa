"""One tensor-parallel rank of vLLM's Engram layers on the CPU (gloo), its remote layers in graph mode in_graph
(vLLM's FULL graphs), each rank with its own memory node: whether the ranks agree on each step's rows.

    python tests/support/vllm_agree.py RANK WORLD PORT MODEL_DIR TABLE_FILE KILL_AT [POLICY ADDRESS DAEMON_PID]...

Started once per rank by tests/engines/vllm/test_vllm_ranks.py. For each POLICY in turn, served by this rank's
node at ADDRESS: every step of the conversation runs through vLLM's own ``Worker.execute_model`` and
``Worker.sample_tokens`` (hooked), and through vLLM's own layers over its own tables and over all-zero tables
(the references, on every rank alike). Rank 1 kills its node (SIGKILL) before step KILL_AT. Per step it
prints one JSON line: the policy, which reference each served layer's output equals ("table", "zeros" or
"neither") and what the check where the result is read said ("ok" or its error).
"""

from __future__ import annotations

import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # tests/support, tests (conftest)

import vllm_cpu  # noqa: E402  (before vllm)
from graph_ranks import dead  # noqa: E402


def main(rank: int, world: int, port: int, model_dir: str, table_file: str, kill_at: int, runs: list) -> None:
    import numpy as np
    import torch
    from conftest import local_tables, wait_for
    from tableclient import TableClientError
    from tableclient.engine import PluginConfig
    from tableclient.vllm import hooks
    from vllm.config import CUDAGraphMode
    from vllm.plugins import load_general_plugins

    os.environ.update(TABLESERVER_ADDRESS=runs[0][1], TABLESERVER_TRANSPORT="tcp", VLLM_PLUGINS="tableserver")
    load_general_plugins()
    cfg = vllm_cpu.make_vllm_config(model_dir)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL  # remote layers: in_graph
    vllm_cpu.init_parallel(cfg, world_size=world, rank=rank, port=port, tp=world)
    tables = local_tables(table_file)
    hasher = vllm_cpu.make_hasher(cfg)

    def build(plugin_config, zero=False):
        hooks.configure(plugin_config)
        engrams = vllm_cpu.build_engrams(cfg)
        for e, layer in zip(engrams, vllm_cpu.LAYERS):
            table = np.array(tables[f"engram.layer{layer}"])
            vllm_cpu.load_table(e, np.zeros_like(table) if zero else table)
        return engrams

    own, zeros = build(PluginConfig()), build(PluginConfig(), zero=True)
    try:
        for policy, address, pid in runs:
            served = build(PluginConfig(address=address, transport="tcp", policy=policy, timeout=30.0,
                                        liveness_timeout=600.0, gather_budget=600.0))  # fmt: skip
            assert all(e.embed_tokens.in_graph for e in served)
            rng = np.random.default_rng(0)
            for i, requests in enumerate(vllm_cpu.conversation()):
                if i == kill_at and rank == 1:
                    os.kill(pid, signal.SIGKILL)
                    wait_for(lambda: dead(pid), "the node to die")  # its sockets closed
                _, hashes, mask = vllm_cpu.hash_batch(hasher, requests)
                x = rng.standard_normal((len(hashes), vllm_cpu.HC, vllm_cpu.HIDDEN)).astype(np.float32)
                x = torch.from_numpy(x).to(torch.bfloat16)
                want, zero = vllm_cpu.step(own, hashes, x, mask), vllm_cpu.step(zeros, hashes, x, mask)
                outs, check = [], "ok"
                try:
                    vllm_cpu.worker_step(served, hashes, x, mask, outs=outs)
                except TableClientError as e:
                    check = str(e)
                rows = {}
                for layer, got, a, b in zip(vllm_cpu.LAYERS, outs[-1], want, zero):
                    same = lambda r: torch.equal(got.view(torch.int16), r.view(torch.int16))  # noqa: E731
                    rows[str(layer)] = "table" if same(a) else "zeros" if same(b) else "neither"
                print(json.dumps({"policy": policy, "step": i, "rows": rows, "check": check}), flush=True)
    finally:
        hooks.configure(PluginConfig())
        vllm_cpu.close_parallel()


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    rest = sys.argv[7:]
    runs = [(rest[k], rest[k + 1], int(rest[k + 2])) for k in range(0, len(rest), 3)]
    main(rank, world, port, sys.argv[4], sys.argv[5], int(sys.argv[6]), runs)
