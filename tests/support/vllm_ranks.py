"""One tensor-parallel rank of vLLM's Engram layers on the CPU (gloo), with and without the plugin.

    python tests/support/vllm_ranks.py RANK WORLD PORT MODEL_DIR TABLE_FILE ADDRESS

Started once per rank by tests/engines/vllm/test_vllm_ranks.py. On each rank vLLM's own layers are built three
times over the same tables: with vLLM's own (head-sharded) tables, with every layer served remote (ADDRESS, the
host path) and with every layer served node (ADDRESS as this host's tableserver over shm: graph mode device, the
plugin's kernel gathering from its mapping), without and with sequence parallelism, and the same steps go
through all three; prints one JSON line: per mode and placement whether every output was bit-identical to
vLLM's own, and the hash columns this rank's served layers gathered.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # tests/support, tests (conftest)

import vllm_cpu  # noqa: E402  (before vllm)


def main(rank: int, world: int, port: int, model_dir: str, table_file: str, address: str) -> dict:
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
    hooks.configure(PluginConfig())
    vllm_cpu.close_parallel()
    return report


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    print(json.dumps(main(rank, world, port, *sys.argv[4:7])))
