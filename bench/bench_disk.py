"""The disk tier's page reader against the drive's floor, in one run (issue 27).

Builds a table file of ``--gib`` GiB of random 264 B rows in ``--dir`` (so on that filesystem), then, at each
queue depth of ``--qd`` (default 1, 32 and 128), on the same file:

* the floor: ``fio`` random 4 KiB O_DIRECT reads over the table's bytes, twice -- ``psync`` with
  ``numjobs=QD`` (what a preadv thread pool is) and ``io_uring`` with ``iodepth=QD``;
* ``tableserver.disk.reader.DiskTable`` with each read engine of ``--engines`` (io_uring, threads, python), the
  same queue depth: gathers of 24 / 1,536 / 6,144 random rows (batch 1 / 64 / 256 of layer 14's 24 rows
  per token): page reads/s, per-gather p50/p99, the ratio of its page reads/s to fio's at the same depth
  (goal >= 0.8x the better fio engine), and the process's RSS against the table.

fio and the engines are measured in ``--rounds`` turns (each a share of ``--runtime``), so that a shared
virtual disk's drift falls on all of them alike. ``--small-pool`` adds the engines' rows with a pool of
only QD pages (the default pool is 16 x QD pages, at least 1 MiB; a gather of more pages than the pool is read in batches,
half the pool each, the next one read while the rows of one are copied out). Prints a table and writes
it to ``--dir``/disk.txt.

    python bench/bench_disk.py --gib 1 --qd 1,32,128 --runtime 12 --rounds 4

``goal`` is "met" where page reads/s reach 0.8x the better fio engine's IOPS at that QD, "<QD" where a
gather holds fewer reads than the queue (nothing to keep it full: bound by latency, not throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tableserver.common.model import ROW_BYTES  # noqa: E402
from tableserver.disk.reader import DiskReadError, DiskTable  # noqa: E402

OFFSET = 2 << 20  # a table starts 2 MiB-aligned in a table file (tablefile.py)
SIZES = (24, 1536, 6144)
GOAL = 0.8


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def build_table(path: str, gib: float) -> int:
    """A file of OFFSET filler bytes and ``gib`` GiB of random rows (kept when it already has that size)."""
    rows = int(gib * 2**30) // ROW_BYTES
    size = OFFSET + rows * ROW_BYTES
    if os.path.exists(path) and os.path.getsize(path) == size:
        return rows
    print(f"writing {path} ({size / 2**30:.2f} GiB) ...", flush=True)
    rng = np.random.default_rng(0)
    chunk = 64 << 20
    with open(path + ".part", "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
    return rows


def fio(path: str, nbytes: int, qd: int, engine: str, runtime: float) -> dict | None:
    """fio's random 4 KiB O_DIRECT read IOPS and latency over the table's bytes of ``path``."""
    depth = ["--numjobs", str(qd), "--iodepth=1"] if engine == "psync" else ["--numjobs=1", "--iodepth", str(qd)]
    cmd = [
        "fio",
        "--name=floor",
        f"--filename={path}",
        "--readonly",
        "--direct=1",
        "--rw=randread",
        "--bs=4k",
        f"--ioengine={engine}",
        *depth,
        f"--offset={OFFSET}",
        f"--size={nbytes // 4096 * 4096}",
        "--time_based",
        f"--runtime={runtime:g}",
        "--group_reporting",
        "--norandommap",
        "--output-format=json",
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime + 60)
    except subprocess.TimeoutExpired:
        print(f"fio {engine}: did not finish within {runtime + 60:g} s", file=sys.stderr)
        return None
    if res.returncode != 0:
        print(f"fio {engine} failed: {res.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    try:
        read = json.loads(res.stdout[res.stdout.index("{") :])["jobs"][0]["read"]
    except (ValueError, KeyError, IndexError) as e:
        print(f"fio {engine}: unreadable output ({e})", file=sys.stderr)
        return None
    pct = read.get("clat_ns", {}).get("percentile", {})
    return {
        "iops": read["iops"],
        "p50_us": pct.get("50.000000", 0) / 1e3,
        "p99_us": pct.get("99.000000", 0) / 1e3,
    }


def gathers(t: DiskTable, rows: int, count: int, seconds: float, rng) -> dict:
    """Random gathers of ``count`` rows for about ``seconds``: pages read, wall time, per-gather latencies."""
    out = np.empty((count, ROW_BYTES), np.uint8)
    lat = []
    t.gather(rng.integers(0, rows, count), out)  # warm the threads
    p0, t0 = t.pages_read, time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(lat) < 5:
        ids = rng.integers(0, rows, count)
        a = time.perf_counter()
        t.gather(ids, out)
        lat.append(time.perf_counter() - a)
    return {"pages": t.pages_read - p0, "wall": time.perf_counter() - t0, "lat": lat}


def summarize(parts: list[dict]) -> dict:
    """Rounds of :func:`gathers` as one: page reads/s over their total time, latency percentiles over all."""
    pages = sum(p["pages"] for p in parts)
    lat_ms = np.concatenate([p["lat"] for p in parts]) * 1e3
    return {
        "pages_per_gather": pages / len(lat_ms),
        "reads_s": pages / sum(p["wall"] for p in parts),
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="table size in GiB (default 1)")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--qd", default="1,32,128", help="queue depths, fio's and the reader's (default 1,32,128)")
    ap.add_argument("--engines", default="io_uring,threads,python", help="DiskTable read engines (io=...)")
    ap.add_argument("--runtime", type=float, default=10.0, help="seconds per fio run; half per gather size")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of fio and every engine in turn (default 3)")
    ap.add_argument("--small-pool", action="store_true", help="also measure a pool of only QD pages")
    ap.add_argument("--keep", action="store_true", help="keep the table file for the next run")
    args = ap.parse_args(argv)
    depths = [int(q) for q in args.qd.split(",")]
    engines = [e for e in args.engines.split(",") if e]

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"disk-bench-{args.gib:g}gib.bin")
    rows = build_table(path, args.gib)
    nbytes = rows * ROW_BYTES
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    say(
        f"bench_disk: {nbytes / 2**30:.2f} GiB table ({rows:,} rows of {ROW_BYTES} B) in {path}, "
        f"QD {', '.join(map(str, depths))}, {os.cpu_count()} CPUs"
    )
    have_fio = shutil.which("fio") is not None
    if not have_fio:
        say("fio: not installed (apt-get install fio): no floor measured, ratios skipped")
    rng = np.random.default_rng(1)
    rss0 = rss_bytes()
    hdr = (
        f"{'engine':>9} {'QD':>4} {'pool':>7} {'rows':>6} {'pages/g':>8} {'reads/s':>10} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'vs psync':>9} {'vs uring':>9} {'goal':>7}"
    )
    io_mode = "?"
    reasons: dict[str, str] = {}
    pools: dict[str, int] = {}
    summary: list[str] = []
    for qd in depths:
        say()
        # rounds: fio and every engine in turn, each round a share of the time, so that the drive's own drift
        # (a shared virtual disk's throughput wanders) falls on all of them alike
        fio_runs: dict[str, list] = {}
        parts: dict[tuple, list] = {}
        cannot: dict[str, str] = {}
        for _ in range(args.rounds):
            for engine in ("psync", "io_uring") if have_fio else ():
                r = fio(path, nbytes, qd, engine, args.runtime / args.rounds)
                if r is not None:
                    fio_runs.setdefault(engine, []).append(r)
            for io in engines:
                for label, pool in (("default", None), ("1xQD", qd)) if args.small_pool else (("default", None),):
                    if io in cannot:
                        continue
                    try:
                        t = DiskTable(path, OFFSET, rows, ROW_BYTES, queue_depth=qd, pool_pages=pool, io=io)
                    except (ValueError, OSError, DiskReadError) as e:
                        cannot[io] = str(e)
                        continue
                    with t:
                        io_mode = t.io_mode
                        reasons[t.engine] = t.engine_reason
                        for count in SIZES:
                            r = gathers(t, rows, count, args.runtime / 2 / args.rounds, rng)
                            parts.setdefault((io, label, count), []).append(r)
                        pools[label] = t.pool_pages * t.page
        floor = {}
        for engine, runs in fio_runs.items():
            floor[engine] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
            r = floor[engine]
            spread = f", rounds {min(x['iops'] for x in runs):,.0f}..{max(x['iops'] for x in runs):,.0f}"
            say(
                f"fio {engine:8s} QD{qd}: {r['iops']:>10,.0f} IOPS  p50 {r['p50_us']:7.0f} us  "
                f"p99 {r['p99_us']:7.0f} us  (random 4 KiB O_DIRECT{spread if len(runs) > 1 else ''})"
            )
        if have_fio and not floor:
            say("fio: no result (see stderr)")
        best = max((r["iops"] for r in floor.values()), default=0.0)
        say(hdr)
        say("-" * len(hdr))
        for io in engines:
            if io in cannot:
                say(f"{io:>9} {qd:>4}: cannot run here: {cannot[io]}")
                continue
            for label in ("default", "1xQD") if args.small_pool else ("default",):
                for count in SIZES:
                    r = summarize(parts[(io, label, count)])
                    ratio = {k: r["reads_s"] / v["iops"] for k, v in floor.items()}
                    goal = "-" if not best else ("met" if r["reads_s"] / best >= GOAL else "MISSED")
                    if r["pages_per_gather"] < qd:
                        goal = "<QD"  # fewer reads in a gather than the queue holds: latency-bound
                    say(
                        f"{io:>9} {qd:>4} {label:>7} {count:>6,} {r['pages_per_gather']:>8.0f} "
                        f"{r['reads_s']:>10,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                        f"{ratio.get('psync', float('nan')):>8.2f}x {ratio.get('io_uring', float('nan')):>8.2f}x "
                        f"{goal:>7}"
                    )
                    if label == "default" and count != SIZES[0]:
                        summary.append(
                            f"{io:>9} QD{qd:<4} {count:>6,} rows  {ratio.get('psync', float('nan')):5.2f}x psync  "
                            f"{ratio.get('io_uring', float('nan')):5.2f}x fio io_uring"
                        )
    rss1 = rss_bytes()
    say()
    say(f"reads: {io_mode}; goal: >= {GOAL}x the better fio engine's IOPS at the same QD")
    for name, why in reasons.items():
        say(f"engine {name}: {why}")
    say(
        f"page reads/s over fio's IOPS at the same QD (gathers of {SIZES[0]} rows, about {SIZES[0]} reads each, "
        "are bound by one read's latency, not the queue: left out):"
    )
    for line in summary:
        say(f"  {line}")
    say(
        f"RSS: {rss1 / 2**20:.0f} MiB after the gathers ({(rss1 - rss0) / 2**20:+.1f} MiB over the start), "
        f"pools (largest QD) {', '.join(f'{k} {v / 2**20:.2f} MiB' for k, v in pools.items())}; "
        f"table {nbytes / 2**20:.0f} MiB: RSS is {rss1 / nbytes:.1%} of it "
        f"(the Python + numpy baseline dominates a small table)"
    )
    with open(os.path.join(args.dir, "disk.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not args.keep:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
