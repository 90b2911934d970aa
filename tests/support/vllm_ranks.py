"""One tensor-parallel rank of vLLM's Engram layers on the CPU (gloo), with and without the plugin.

    python tests/support/vllm_ranks.py RANK WORLD PORT MODEL_DIR TABLE_FILE ADDRESS KILL_AT [POLICY NODE PID]...

Started once per rank by tests/engines/vllm/test_vllm_ranks.py. On each rank vLLM's own layers are built three
times over the same tables: with vLLM's own (head-sharded) tables, with every layer served remote (ADDRESS, the
host path) and with every layer served node (ADDRESS as this host's tableserver over shm: graph mode device, the
plugin's kernel gathering from its mapping), without and with sequence parallelism, and the same steps go
through all three; prints one JSON line: per mode and placement whether every output was bit-identical to
vLLM's own, and the hash columns this rank's served layers gathered.

Then whether the ranks agree on each step's rows (:func:`agreement`): for each POLICY in turn, this rank's
layers served remote by its own node (NODE, whose process is PID) in graph mode in_graph (vLLM's FULL graphs),
each decode step through vLLM's own ``Worker.execute_model`` and ``Worker.sample_tokens`` (hooked), beside vLLM's
own layers over its own tables and over all-zero tables (the references, alike on every rank). Rank 1 kills
its node (SIGKILL) before step KILL_AT. One JSON line a step, before the report: the policy, which reference
each served layer's output equals ("table", "zeros" or "neither") and what the check where vLLM reads the
result said ("ok" or its error).
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


def main(rank: int, world: int, port: int, model_dir: str, table_file: str, address: str, kill_at: int,
         runs: list) -> dict:  # fmt: skip
    import numpy as np
    import torch
    from conftest import local_tables
    from tableclient.engine import PluginConfig
    from tableclient.vllm import hooks
    from vllm.plugins import load_general_plugins

    os.environ.update(TABLESERVER_ADDRESS=address, TABLESERVER_TRANSPORT="tcp", VLLM_PLUGINS="tableserver")
    load_general_plugins()
    cfg = vllm_cpu.make_vllm_config(model_dir)
    vllm_cpu.init_parallel(cfg, world_size=world, rank=rank, port=port, tp=world)
    tables = local_tables(table_file)
    hasher = vllm_cpu.make_hasher(cfg)
    report = {"rank": rank}
    placements = {
        "local": PluginConfig(transport="tcp"),
        "remote": PluginConfig(address=address, transport="tcp"),
        "node": PluginConfig(node_address=address, layers={layer: "node" for layer in vllm_cpu.LAYERS}),
    }
    for sp in (False, True):
        outs, columns, device = [], {}, False
        for placement, plugin_config in placements.items():
            hooks.configure(plugin_config)
            engrams = vllm_cpu.build_engrams(cfg, sequence_parallel=sp)
            for e, layer in zip(engrams, vllm_cpu.LAYERS):
                vllm_cpu.load_table(e, np.array(tables[f"engram.layer{layer}"]))
            if placement != "local":
                columns[placement] = [(e.embed_tokens.head_start, e.embed_tokens.head_end) for e in engrams]
            if placement == "node":
                device = all(e.embed_tokens.device_rows is not None for e in engrams)
            rng = np.random.default_rng(0)
            got = []
            for requests in vllm_cpu.conversation():
                _, hashes, mask = vllm_cpu.hash_batch(hasher, requests)
                tokens = len(hashes)
                x = torch.from_numpy(rng.standard_normal((tokens, vllm_cpu.HC, vllm_cpu.HIDDEN)).astype(np.float32))
                x = x.to(torch.bfloat16)
                if sp:  # this rank's share of the tokens, padded to the shard size as vLLM's sp_shard pads it
                    chunk = -(-tokens // world)
                    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, chunk * world - tokens))[
                        rank * chunk : (rank + 1) * chunk
                    ]
                got.append(vllm_cpu.step(engrams, hashes, x, mask))
            outs.append(got)
            if placement == "remote" and sp:  # sp's steps, each issued at step start
                report["served"] = {str(k): v["prefetched"] for k, v in hooks.rows().summary().items()}

        def same(got):
            return all(
                torch.equal(a.view(torch.int16), b.view(torch.int16))
                for sa, sb in zip(got, outs[0])
                for a, b in zip(sa, sb)
            )

        report["sp" if sp else "tp"] = {
            "identical": same(outs[1]),
            "columns": columns["remote"],
            "steps": len(outs[0]),
            "node": {"identical": same(outs[2]), "columns": columns["node"], "device": device},
        }
    try:
        agreement(rank, cfg, hasher, tables, kill_at, runs)
    finally:
        hooks.configure(PluginConfig())
        vllm_cpu.close_parallel()
    return report


def agreement(rank: int, cfg, hasher, tables, kill_at: int, runs: list) -> None:
    """Each step's rows, ranks agreeing or not, per policy in ``runs`` ((policy, node address, node pid))."""
    import numpy as np
    import torch
    from conftest import wait_for
    from tableclient import TableClientError
    from tableclient.engine import PluginConfig
    from tableclient.vllm import hooks
    from vllm.config import CUDAGraphMode

    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL  # remote layers: in_graph

    def build(plugin_config, zero=False):
        hooks.configure(plugin_config)
        engrams = vllm_cpu.build_engrams(cfg)
        for e, layer in zip(engrams, vllm_cpu.LAYERS):
            table = np.array(tables[f"engram.layer{layer}"])
            vllm_cpu.load_table(e, np.zeros_like(table) if zero else table)
        return engrams

    own, zeros = build(PluginConfig()), build(PluginConfig(), zero=True)
    for policy, address, pid in runs:
        served = build(PluginConfig(address=address, transport="tcp", policy=policy, timeout=30.0,
                                    liveness_timeout=600.0, gather_budget=600.0))  # fmt: skip
        assert all(e.embed_tokens.in_graph for e in served)
        rng = np.random.default_rng(0)
        for i, requests in enumerate(vllm_cpu.decode_steps()):
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


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    rest = sys.argv[8:]
    runs = [(rest[k], rest[k + 1], int(rest[k + 2])) for k in range(0, len(rest), 3)]
    print(json.dumps(main(rank, world, port, *sys.argv[4:7], int(sys.argv[7]), runs)))
