#!/usr/bin/env python3
"""What the SGLang plugin saves: table memory in an SGLang worker, with and without the plugin.

    python bench/bench_sglang.py [--rows-per-layer 2000000] [--out bench/out]

SGLang 0.5.23's own Engram layers (``EngramHasher``, ``Engram``,
``EngramEmbedding``; CPU here) are built for two V4.1-shaped layers (1 and 14,
24 hash columns of 256-dim FP8 rows + e8m0 scales) whose tables hold about
--rows-per-layer rows each, and loaded the way SGLang loads them (its weight
loader, from the checkpoint's two tensors per layer). Each placement runs in
its own process, side by side in one run against one tableserver:

* ``local``: no plugin, SGLang's own tables (what every worker holds today);
* ``mixed``: the plugin with layer 1 local and layer 14 remote;
* ``remote``: the plugin with both layers remote.

Reported per placement: bytes of table parameters, the growth of the
process's resident anonymous and shared memory (RssAnon + RssShmem: not the
checkpoint's page cache) from before building the layers to after loading
them, and the time of a decode step of 64 tokens through both layers (hash,
rows, a small wkv, gate). The
remote placements read over tcp from a daemon on this host (a memory node is
another host; shm would map the server's copy instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "support")]

from common import rss_bytes, run_placements  # noqa: E402

from tableserver.common.model import ROW_BYTES, ROWS_PER_TOKEN  # noqa: E402

CASES = {"local": {}, "mixed": {1: "local", 14: "remote"}, "remote": {1: "remote", 14: "remote"}}


def engram_config(rows_per_layer: int):
    """A V4.1-shaped config whose per-layer tables hold about ``rows_per_layer`` rows."""
    from sglang.srt.configs.deepseek_v41 import DeepseekV41Config
    from sglang.srt.layers.engram import EngramLayout

    text = dict(
        engram_layer_ids=[1, 14],
        engram_max_ngram_size=4,
        engram_n_heads=8,
        engram_head_dim=256,
        engram_vocab_size=max(rows_per_layer // ROWS_PER_TOKEN, 100),
        engram_pad_token_id=2,
        engram_compressed_vocab_size=300,
        hidden_size=64,
        hc_mult=2,
        rms_norm_eps=1e-6,
        num_hidden_layers=16,
    )
    probe = EngramLayout.from_config(DeepseekV41Config(text_config=text))
    text["engram_num_embeddings"] = [probe.column_bounds(i)[-1] for i in range(2)]
    return DeepseekV41Config(text_config=text)


def run_case(case: str, table: str, address: str, rows_per_layer: int) -> dict:
    """In this (fresh) process: build and load SGLang's layers under ``case``; measure."""
    import numpy as np
    import torch
    import torchvision_cpu  # noqa: F401  (CPU torch: torchvision's op schemas)
    from sglang.srt.layers.engram import Engram, EngramHasher, EngramLayout, build_compressed_token_map
    from sglang.srt.runtime_context import get_parallel
    from sglang_cpu import decode_batch, extend_batch, make_tokenizer
    from tableclient.sglang import PluginConfig, configure, hooks

    from tableserver.tables.tablefile import read_header

    tokenizer = make_tokenizer()
    cfg = engram_config(rows_per_layer)
    cfg.engram_compressed_vocab_size = build_compressed_token_map(tokenizer)[1]
    if CASES[case]:
        configure(PluginConfig(address=address, transport="tcp", layers=CASES[case]))
        hooks.register_hooks()
    layout = EngramLayout.from_config(cfg)
    header = {s.name: s for s in read_header(table).tables}
    mm = np.memmap(table, dtype=np.uint8, mode="r")
    before = rss_bytes()
    torch.set_default_dtype(torch.bfloat16)
    with get_parallel().override(tp_size=1, tp_rank=0):
        hasher = EngramHasher(layout, tokenizer, cfg.engram_pad_token_id, cfg.engram_compressed_vocab_size)
        engrams = [Engram(cfg, layer, layout, prefix=f"model.layers.{layer}.engram") for layer in (1, 14)]
    torch.set_default_dtype(torch.float32)
    for e, layer in zip(engrams, (1, 14)):
        params = dict(e.embed.named_parameters())
        if params:  # SGLang's weight loader, one checkpoint tensor at a time
            spec = header[f"engram.layer{layer}"]
            full = torch.from_numpy(mm[spec.offset : spec.offset + spec.nbytes].reshape(spec.rows, spec.row_bytes))
            for name, part in (("weight", full[:, :256]), ("scale", full[:, 256:])):
                params[name].weight_loader(params[name], part.contiguous().view(params[name].dtype))
                del part
            del full
    table_bytes = sum(p.numel() * p.element_size() for e in engrams for p in e.embed.parameters())
    loaded = rss_bytes()
    hasher.init_history(num_req_slots=64, device="cpu")
    rng = np.random.default_rng(0)
    ids, batch = extend_batch([(0, rng.integers(0, 300, 16).tolist()) for _ in range(64)], list(range(64)))
    x = torch.zeros((len(ids), 2, 64), dtype=torch.bfloat16)
    h = hasher(ids, batch)
    [e(x, h[:, e.layer_hash_index], batch, input_ids=ids) for e in engrams]
    times = []
    for step in range(30):
        ids, batch = decode_batch(rng.integers(0, 300, 64).tolist(), [16 + step] * 64, list(range(64)))
        x = torch.zeros((64, 2, 64), dtype=torch.bfloat16)
        t0 = time.perf_counter()
        h = hasher(ids, batch)
        [e(x, h[:, e.layer_hash_index], batch, input_ids=ids) for e in engrams]
        times.append(time.perf_counter() - t0)
    return {
        "case": case,
        "table_bytes": table_bytes,
        "rss_growth": loaded - before,
        "step_p50_ms": float(np.percentile(times, 50) * 1e3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-layer", type=int, default=2_000_000)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.table, args.address, args.rows_per_layer)))
        return 0
    import torchvision_cpu  # noqa: F401

    from tableserver.ops.demo_run import start_server
    from tableserver.tables.demo import DemoTable, write_demo_file

    cfg = engram_config(args.rows_per_layer)
    rows = list(cfg.engram_num_embeddings)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "engram.bin")
        write_demo_file(
            table, [DemoTable(f"engram.layer{layer}", n, ROW_BYTES, layer) for layer, n in zip((1, 14), rows)]
        )
        proc, ready = start_server(table, tmp)
        try:
            argv = ["--table", table, "--address", ready["control"], "--rows-per-layer", str(args.rows_per_layer)]
            results = run_placements(__file__, CASES, argv)
            if results is None:
                return 1
        finally:
            proc.terminate()
            proc.wait(30)
    gib = 1 << 30
    lines = [
        f"SGLang 0.5.23 Engram layers 1 and 14, tables of {rows[0]:,} and {rows[1]:,} rows x {ROW_BYTES} B "
        f"({sum(rows) * ROW_BYTES / gib:.2f} GiB), loaded as SGLang loads them; one process per placement",
        f"{'placement':<10}{'table params GiB':>18}{'memory growth GiB':>19}{'vs local':>10}{'decode step p50 ms':>20}",
    ]
    base = results[0]["rss_growth"]
    for r in results:
        lines.append(
            f"{r['case']:<10}{r['table_bytes'] / gib:>18.3f}{r['rss_growth'] / gib:>19.3f}"
            f"{r['rss_growth'] / base:>9.2f}x{r['step_p50_ms']:>20.2f}"
        )
    lines.append(
        "(memory: RssAnon + RssShmem growth from before building the layers to after loading them; "
        "decode step:\n 64 tokens through the hasher and both layers on this CPU; remote layers over tcp from "
        "a server on this host)"
    )
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(args.out, "sglang_memory.txt"), "w") as f:
        f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
