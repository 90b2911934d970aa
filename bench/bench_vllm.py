#!/usr/bin/env python3
"""What the vLLM plugin saves: table memory in a vLLM worker, with and without the plugin.

    python bench/bench_vllm.py [--engram-vocab 80000] [--cases local,mixed,remote] [--out bench/out] [--json]

vLLM 0.33.0's own Engram layers (``Engram``, ``ParallelEngramEmbedding``, ``NgramHashState``; on this
CPU through Triton's interpreter, tests/support/vllm_cpu.py) are built for DeepSeek-V4.1's two Engram layers
(1 and 14, 24 hash columns of 256-dim FP8 rows + e8m0 scales) whose tables hold about 24 x
--engram-vocab rows each, and loaded the way vLLM loads them: its safetensors iterator over a
checkpoint on disk (the two tensors per layer, named as DeepSeek-V4.1's), its weights mapper, each
parameter's weight loader. Each placement runs in its own process, side by side in one run against
one tableserver:

* ``local``: no plugin, vLLM's own tables (what every worker holds today);
* ``mixed``: the plugin with layer 1 local and layer 14 remote;
* ``remote``: the plugin with both layers remote.

Reported per placement: bytes of table parameters and the growth of the process's resident anonymous
and shared memory (RssAnon + RssShmem: not the checkpoint's page cache) from before building the layers
to after loading them. One step (a prefill of 64 tokens) then runs through the hasher and both layers,
and its outputs must be the same bits in every placement. The remote placements read over tcp from a
daemon on this host (a memory node is another host; shm would map the server's copy instead).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "support")]

from common import rss_bytes, run_placements  # noqa: E402

from tableserver.common.model import ROW_BYTES  # noqa: E402

CASES = {"local": "", "mixed": "1=local,14=remote", "remote": "1=remote,14=remote"}


def run_case(case: str, model_dir: str, checkpoint: str, address: str) -> dict:
    """In this (fresh) process: vLLM's plugin loading, its layers built and loaded under ``case``; measure."""
    import numpy as np
    import torch
    import vllm_cpu  # before vllm

    if CASES[case]:
        os.environ.update(TABLESERVER_ADDRESS=address, TABLESERVER_PLACEMENT=CASES[case], TABLESERVER_TRANSPORT="tcp")
    os.environ["VLLM_PLUGINS"] = "tableserver"
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.models.deepseek_v41.nvidia.model import _make_deepseek_v4_weights_mapper
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own plugin loading: the plugin engages only where TABLESERVER_* is set
    cfg = vllm_cpu.make_vllm_config(model_dir)
    vllm_cpu.init_parallel(cfg)
    before = rss_bytes()
    engrams = vllm_cpu.build_engrams(cfg)
    params = {
        f"model.layers.{layer}.engram.{name}": p
        for layer, e in zip(vllm_cpu.LAYERS, engrams)
        for name, p in e.named_parameters()
    }
    mapper = _make_deepseek_v4_weights_mapper("fp4")  # the checkpoint's names -> vLLM's parameter names
    for name, tensor in mapper.apply(safetensors_weights_iterator([checkpoint], False)):
        param = params[name]
        param.weight_loader(param, tensor)
        del tensor
    table_bytes = sum(p.numel() * p.element_size() for e in engrams for p in e.embed_tokens.parameters())
    loaded = rss_bytes()
    hasher = vllm_cpu.make_hasher(cfg)
    rng = np.random.default_rng(0)
    _, hashes, mask = vllm_cpu.hash_batch(hasher, [([], rng.integers(0, 300, 32).tolist()) for _ in range(2)])
    x = torch.from_numpy(rng.standard_normal((len(hashes), vllm_cpu.HC, vllm_cpu.HIDDEN)).astype(np.float32))
    outs = vllm_cpu.step(engrams, hashes, x.to(torch.bfloat16), mask)
    digest = hashlib.sha256(b"".join(o.view(torch.int16).numpy().tobytes() for o in outs)).hexdigest()
    return {"case": case, "param_bytes": table_bytes, "rss_growth": loaded - before, "outputs": digest}


def write_checkpoint(path: str, table: str) -> None:
    """The tables as a DeepSeek-V4.1 checkpoint holds them: per layer ``engram.embed.weight`` (fp8 e4m3)
    and ``engram.embed.scale`` (e8m0)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from tableserver.tables.tablefile import read_header

    mm = np.memmap(table, dtype=np.uint8, mode="r")
    tensors = {}
    for spec in read_header(table).tables:
        layer = spec.name.removeprefix("engram.layer")
        full = torch.from_numpy(
            np.array(mm[spec.offset : spec.offset + spec.nbytes]).reshape(spec.rows, spec.row_bytes)
        )
        tensors[f"layers.{layer}.engram.embed.weight"] = full[:, :256].contiguous().view(torch.float8_e4m3fn)
        tensors[f"layers.{layer}.engram.embed.scale"] = full[:, 256:].contiguous().view(torch.float8_e8m0fnu)
    save_file(tensors, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engram-vocab", type=int, default=80_000, help="Engram's vocab size: ~24x rows per table")
    ap.add_argument("--cases", default=",".join(CASES), help="placements to run, of " + ", ".join(CASES))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    ap.add_argument("--workdir", help="where the model, tables and checkpoint go (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line as well")
    ap.add_argument(
        "--metrics-dir",
        help="PROMETHEUS_MULTIPROC_DIR of the placements' processes (as vLLM sets for its own): where their "
        "tableserver_client_* metrics go",
    )
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.model, args.checkpoint, args.address)))
        return 0
    if not 1_000 <= args.engram_vocab <= 20_000_000:
        print(f"bench_vllm: --engram-vocab {args.engram_vocab}: use 1000 .. 20000000 (about 24x that many rows per table)",
              file=sys.stderr)  # fmt: skip
        return 2
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        print(f"bench_vllm: --cases {args.cases!r}: use some of {', '.join(CASES)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        return measure(args, cases, args.workdir or tmp)


def measure(args, cases: list, work: str) -> int:
    import vllm_cpu  # noqa: F401  (before vllm)

    from tableserver.ops.demo_run import start_server
    from tableserver.tables.demo import DemoTable, write_demo_file

    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "model")
    os.makedirs(model, exist_ok=True)
    rows = vllm_cpu.write_model(model, vocab_size=args.engram_vocab)
    table = os.path.join(work, "engram.bin")
    write_demo_file(
        table, [DemoTable(f"engram.layer{layer}", n, ROW_BYTES, layer) for layer, n in zip(vllm_cpu.LAYERS, rows)]
    )
    checkpoint = os.path.join(work, "model-00001-of-00001.safetensors")
    write_checkpoint(checkpoint, table)
    proc, ready = start_server(table, work)
    try:
        env = dict(os.environ, **({"PROMETHEUS_MULTIPROC_DIR": args.metrics_dir} if args.metrics_dir else {}))
        argv = ["--model", model, "--checkpoint", checkpoint, "--address", ready["control"]]
        results = run_placements(__file__, cases, argv, env)
        if results is None:
            return 1
    finally:
        proc.terminate()
        proc.wait(30)
    same = len({r["outputs"] for r in results}) == 1
    gib = 1 << 30
    total = sum(rows) * ROW_BYTES
    lines = [
        f"vLLM 0.33.0 Engram layers 1 and 14, tables of {rows[0]:,} and {rows[1]:,} rows x {ROW_BYTES} B "
        f"({total / gib:.3f} GiB), loaded as vLLM loads them; one process per placement",
        f"{'placement':<10}{'table params GiB':>18}{'memory growth GiB':>19}{'vs local':>10}",
    ]
    base = next((r["rss_growth"] for r in results if r["case"] == "local"), None)
    for r in results:
        ratio = f"{r['rss_growth'] / base:>9.3f}x" if base else f"{'-':>10}"
        lines.append(f"{r['case']:<10}{r['param_bytes'] / gib:>18.3f}{r['rss_growth'] / gib:>19.3f}{ratio}")
    lines.append(
        "(memory: RssAnon + RssShmem growth from before building the layers to after loading them; one prefill "
        f"step's outputs {'bit-identical in every placement' if same else 'DIFFER between placements'})"
    )
    report = "\n".join(lines)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm_memory.txt"), "w") as f:
        f.write(report + "\n")
    if args.json:
        print(json.dumps({"table_bytes": total, "identical": same, **{r["case"]: r for r in results}}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
