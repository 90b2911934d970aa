#!/usr/bin/env python3
"""Engram rows on the GPU: the step path to device memory against the bare in-process path, side by side.

    python bench/bench_gpu.py [--steps 300] [--batches 1,64,512] [--transports shm,tcp] [--out bench/out]

Needs a CUDA GPU (exits 2 without one). Three sections, each measured in one run:

1. **Host-to-device copies** of a layer's staged rows (24, 1,536 and 12,288 rows of 264 B): from the
   step API's pinned staging (placed 2 KiB into a page, tableserver/common/buffers.py), from page-aligned pinned
   memory and from pageable memory. CUDA events time the copy on the GPU; the host clock times
   copy + synchronize as a caller sees it. The placed buffer must cost nothing over the aligned one.
2. **Layer-1 rows on the device**, per decode step (the replay's traffic, hashed with the real Engram
   algorithm): ``begin_step`` issues both layers at step start, ``wait_to_device(1)`` copies layer 1's
   rows on the step's side stream, and the step ends for layer 1 when that copy's event completes.
   Against it, in random order each step: the bare in-process path, ``tableserver.common.take`` (native where
   built, else ``np.take(mode="clip")``) from a private copy of the table into pinned memory, then the same copy and event. Layer 1 is due 0.3 ms
   after step start.
3. **A CUDA graph of the copy** (what a captured decode step replays) against the eager copy.

Writes ``gpu.txt`` into --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from common import Hugepages  # noqa: E402
from replay import ENGRAM, VOCAB, Traffic, step_ids  # noqa: E402
from tableclient import TableClient  # noqa: E402
from tableclient.engram import EngramHasher  # noqa: E402
from tableclient.step import EngramStep, LayerPlan  # noqa: E402

from tableserver.common.buffers import OFFSET, PAGE, pinned_rows_buffer  # noqa: E402
from tableserver.common.model import ROW_BYTES, ROWS_PER_TOKEN, WINDOWS_S  # noqa: E402
from tableserver.common.take import NATIVE, take  # noqa: E402
from tableserver.ops.demo_run import ensure_demo_file, start_server  # noqa: E402
from tableserver.tables.demo import DEFAULT_ROWS  # noqa: E402
from tableserver.tables.tablefile import read_header  # noqa: E402


def pct(a, q) -> float:
    return float(np.percentile(np.asarray(a), q))


def copy_section(torch, reps: int) -> list[str]:
    """H2D copy of n staged rows from three kinds of host memory: GPU time (events) and caller's time."""
    lines = [f"{'rows':>7}  {'host memory':<30}{'GPU us p50':>12}{'GB/s':>7}{'copy+sync us p50':>18}{'p99':>8}"]
    stream = torch.cuda.Stream()
    for n in (ROWS_PER_TOKEN, 64 * ROWS_PER_TOKEN, 512 * ROWS_PER_TOKEN):  # 24, 1,536, 12,288
        dev = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
        placed = pinned_rows_buffer(torch, (n,), ROW_BYTES, True)
        sources = {
            "pinned, placed": placed,
            "pinned, page-aligned": torch.empty((n, ROW_BYTES), dtype=torch.uint8, pin_memory=True),
            "pageable": torch.empty((n, ROW_BYTES), dtype=torch.uint8),
        }
        for buf in sources.values():
            buf.numpy()[:] = np.random.default_rng(n).integers(0, 256, (n, ROW_BYTES), dtype=np.uint8)
        gpu, host = {k: [] for k in sources}, {k: [] for k in sources}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        order = np.random.default_rng(0)
        for _ in range(reps):
            for name in order.permutation(list(sources)):
                src = sources[name]
                with torch.cuda.stream(stream):
                    t = time.perf_counter()
                    start.record(stream)
                    dev.copy_(src, non_blocking=True)
                    end.record(stream)
                    end.synchronize()
                    host[name].append(time.perf_counter() - t)
                gpu[name].append(start.elapsed_time(end) * 1e-3)
        assert torch.equal(dev.cpu(), sources[name]), "the copied rows differ from the source"
        for name in sources:
            g = pct(gpu[name], 50)
            where = f" (offset {sources[name].data_ptr() % PAGE})" if name.startswith("pinned") else ""
            lines.append(
                f"{n:>7}  {name + where:<30}{g * 1e6:>12.1f}{n * ROW_BYTES / g / 1e9:>7.1f}"
                f"{pct(host[name], 50) * 1e6:>18.1f}{pct(host[name], 99) * 1e6:>8.1f}"
            )
        ratio = pct(gpu["pinned, placed"], 50) / pct(gpu["pinned, page-aligned"], 50)
        lines.append(f"{'':>7}  placed / page-aligned (GPU time): {ratio:.2f}x")
    return lines


def step_section(torch, client, name: str, hasher, local1: np.ndarray, batch: int, steps: int):
    """Per step, in seconds after step start: layer 1's rows on the device via EngramStep, begin_step
    returned (both layers issued), and layer 1's rows on the device via the bare path; each step's two
    paths in random order."""
    plans = [LayerPlan(1, "engram.layer1", WINDOWS_S[1]), LayerPlan(14, "engram.layer14", WINDOWS_S[14])]
    step = EngramStep(client, plans, max_tokens=batch, device="cuda")
    assert all(b.is_pinned() for b in step.staging.values()), "the step's staging is not pinned"
    bare_host = torch.empty((batch * ROWS_PER_TOKEN, ROW_BYTES), dtype=torch.uint8, pin_memory=True)
    bare_np = bare_host.numpy()
    bare_dev = torch.empty((batch * ROWS_PER_TOKEN, ROW_BYTES), dtype=torch.uint8, device="cuda")
    stream, event = torch.cuda.Stream(), torch.cuda.Event()
    traffic = Traffic(batch, seed=batch)
    rng = np.random.default_rng(batch)
    via_step, issued, bare = [], [], []

    def run_step(ids):
        """(layer 1 on the device, begin_step returned), seconds after step start; the device rows."""
        t0 = time.perf_counter()  # before begin_step's own set-up, as the bare path's clock
        step.begin_step(ids)
        returned = time.perf_counter() - t0
        dev, ev = step.wait_to_device(1)
        ev.synchronize()
        took = time.perf_counter() - t0
        step.wait(14)
        return (took, returned), dev

    def run_bare(ids) -> float:
        flat = ids[1].reshape(-1)
        t0 = time.perf_counter()
        take(local1, flat, bare_np[: flat.size])
        with torch.cuda.stream(stream):
            bare_dev[: flat.size].copy_(bare_host[: flat.size], non_blocking=True)
            event.record(stream)
        event.synchronize()
        return time.perf_counter() - t0

    for i in range(20 + steps):
        ids = step_ids(hasher, traffic)
        if rng.random() < 0.5:
            took, dev = run_step(ids)
            b = run_bare(ids)
        else:
            b = run_bare(ids)
            took, dev = run_step(ids)
        if i == 20:  # once: the device rows are the table's rows (bit-exact), and so are the bare path's
            n = ids[1].size
            want = local1[ids[1].reshape(-1)]
            assert np.array_equal(dev.reshape(n, ROW_BYTES).cpu().numpy(), want), f"{name}: device rows differ"
            assert np.array_equal(bare_dev[:n].cpu().numpy(), want), "bare device rows differ"
        if i >= 20:
            via_step.append(took[0])
            issued.append(took[1])
            bare.append(b)
    return np.array(via_step), np.array(issued), np.array(bare)


def graph_section(torch, reps: int) -> list[str]:
    n = 64 * ROWS_PER_TOKEN
    src = pinned_rows_buffer(torch, (n,), ROW_BYTES, True)
    dev = torch.empty((n, ROW_BYTES), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        dev.copy_(src, non_blocking=True)  # warm-up before capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            dev.copy_(src, non_blocking=True)
    eager, replay = [], []
    for i in range(reps):
        src.numpy()[:] = i % 251
        with torch.cuda.stream(stream):
            t = time.perf_counter()
            dev.copy_(src, non_blocking=True)
            stream.synchronize()
            eager.append(time.perf_counter() - t)
            src.numpy()[:] = (i + 1) % 251
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            replay.append(time.perf_counter() - t)
            assert int(dev[-1, -1]) == (i + 1) % 251, "the graph replay did not copy this step's rows"
    return [
        f"1,536 rows: eager copy+sync p50 {pct(eager, 50) * 1e6:.1f} us, graph replay+sync p50 "
        f"{pct(replay, 50) * 1e6:.1f} us ({pct(replay, 50) / pct(eager, 50):.2f}x); every replay copied "
        "that step's rows"
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", default="1,64,512")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--reps", type=int, default=300, help="rounds of the copy and graph sections")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    args = ap.parse_args()
    if args.steps < 10 or args.reps < 10:
        ap.error("--steps and --reps must be at least 10")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: give batch sizes as integers, e.g. 1,64,512")
    if min(batches) < 1:
        ap.error(f"--batches {args.batches!r}: every batch size must be at least 1")
    unknown = [t for t in args.transports.split(",") if t and t not in ("shm", "tcp", "rdma")]
    if unknown:
        ap.error(f"--transports {args.transports!r}: unknown {', '.join(unknown)} (use shm, tcp or rdma)")
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed; install a CUDA build of torch to run this bench", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA GPU here; run it on a machine with one (the CPU benches are "
            "bench_transports.py and replay.py)",
            file=sys.stderr,
        )
        return 2
    os.makedirs(args.out, exist_ok=True)
    lines = [
        f"bench_gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"{os.cpu_count()} CPUs; pinned staging placed at page offset {OFFSET}"
    ]
    lines += ["", "1. host-to-device copy of a layer's staged rows", *copy_section(torch, args.reps)]
    path = ensure_demo_file(DEFAULT_ROWS)
    hasher = EngramHasher(ENGRAM, np.arange(VOCAB))
    header = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    s1 = next(s for s in header.tables if s.layer == 1)
    local1 = np.array(mm[s1.offset : s1.offset + s1.nbytes]).reshape(s1.rows, s1.row_bytes)
    sizes = [s.nbytes for s in header.tables]
    lines += [
        "",
        f"2. layer-1 rows on the device after step start ({args.steps} steps; due at "
        f"{WINDOWS_S[1] * 1e6:.0f} us); bare = {'native take' if NATIVE else 'np.take(mode=clip)'} from a private copy into pinned "
        "memory + the same copy",
        f"{'transport':<10}{'batch':>6}{'rows':>7}{'step p50 us':>13}{'p99':>8}{'issued p50':>12}"
        f"{'bare p50':>10}{'p99':>8}{'p50 ratio':>11}{'in window p50/p99':>19}",
    ]
    pages = Hugepages(sizes, "1g")
    with tempfile.TemporaryDirectory() as tmp, pages:
        proc, ready = start_server(path, tmp, ["--hugepages", pages.flag])
        try:
            for name in [t for t in args.transports.split(",") if t]:
                if name not in ready:
                    lines.append(f"{name:<10}  not offered by the server here")
                    continue
                with TableClient(ready["control"], transport=name) as client:
                    for batch in batches:
                        got, issued, bare = step_section(torch, client, name, hasher, local1, batch, args.steps)
                        w = WINDOWS_S[1]
                        inside = f"{'yes' if pct(got, 50) <= w else 'no'}/{'yes' if pct(got, 99) <= w else 'no'}"
                        lines.append(
                            f"{name:<10}{batch:>6}{batch * ROWS_PER_TOKEN:>7}{pct(got, 50) * 1e6:>13.0f}"
                            f"{pct(got, 99) * 1e6:>8.0f}{pct(issued, 50) * 1e6:>12.0f}"
                            f"{pct(bare, 50) * 1e6:>10.0f}"
                            f"{pct(bare, 99) * 1e6:>8.0f}{pct(got, 50) / pct(bare, 50):>10.2f}x"
                            f"{inside:>19}"
                        )
        finally:
            proc.terminate()
            proc.wait(30)
    lines.append(
        f"server tables on {pages.label}; issued = begin_step returned "
        "(both layers' gathers issued; over shm layer 1's rows gathered and their copy queued)"
    )
    lines += ["", "3. CUDA graph of the staged copy", *graph_section(torch, args.reps)]
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(args.out, "gpu.txt"), "w") as f:
        f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
