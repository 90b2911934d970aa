"""The disk tier's page reader against the drive's floor, in one run (issue 27).

Builds a table file of ``--gib`` GiB of random 264 B rows in ``--dir`` (so on that filesystem), then

* the floor: ``fio`` random 4 KiB O_DIRECT reads over the same file at the same queue depth, twice --
  ``psync`` with ``numjobs=QD`` (what a preadv thread pool is) and ``io_uring`` with ``iodepth=QD``;
* ``tableserver.diskio.DiskTable`` gathers of 24 / 1,536 / 6,144 random rows (batch 1 / 64 / 256 of
  layer 14's 24 rows per token): page reads/s, per-gather p50/p99, the ratio of its page reads/s to
  fio's at the same depth (goal >= 0.8x the better fio engine), and the process's RSS against the table.

The default buffer pool (16 x QD pages) is measured beside a pool of only QD pages, whose batches drain
the queue at each boundary. Prints a table and writes it to ``--dir``/disk.txt.

    python bench/bench_disk.py --gib 1 --qd 32 --runtime 10
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
from tableserver.diskio import DiskTable  # noqa: E402

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
    """Random gathers of ``count`` rows for about ``seconds``: page reads/s and per-gather latency."""
    out = np.empty((count, ROW_BYTES), np.uint8)
    lat = []
    t.gather(rng.integers(0, rows, count), out)  # warm the threads
    p0, t0 = t.pages_read, time.perf_counter()
    while time.perf_counter() - t0 < seconds or len(lat) < 5:
        ids = rng.integers(0, rows, count)
        a = time.perf_counter()
        t.gather(ids, out)
        lat.append(time.perf_counter() - a)
    wall = time.perf_counter() - t0
    lat_ms = np.array(lat) * 1e3
    pages = t.pages_read - p0
    return {
        "gathers": len(lat),
        "pages_per_gather": pages / len(lat),
        "reads_s": pages / wall,
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="table size in GiB (default 1)")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--qd", type=int, default=32, help="queue depth, fio's and the reader's (default 32)")
    ap.add_argument("--runtime", type=float, default=10.0, help="seconds per fio run and per gather size")
    ap.add_argument("--keep", action="store_true", help="keep the table file for the next run")
    args = ap.parse_args(argv)

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"disk-bench-{args.gib:g}gib.bin")
    rows = build_table(path, args.gib)
    nbytes = rows * ROW_BYTES
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"bench_disk: {nbytes / 2**30:.2f} GiB table ({rows:,} rows of {ROW_BYTES} B) in {path}, QD {args.qd}")
    floor = {}
    if shutil.which("fio") is None:
        say("fio: not installed (apt-get install fio): no floor measured, ratios skipped")
    else:
        for engine in ("psync", "io_uring"):
            r = fio(path, nbytes, args.qd, engine, args.runtime)
            if r is None:
                say(f"fio {engine}: no result (see stderr)")
                continue
            floor[engine] = r
            say(
                f"fio {engine:8s} QD{args.qd}: {r['iops']:>10,.0f} IOPS  p50 {r['p50_us']:7.0f} us  "
                f"p99 {r['p99_us']:7.0f} us  (random 4 KiB O_DIRECT)"
            )
    best = max((r["iops"] for r in floor.values()), default=0.0)
    best_name = max(floor, key=lambda k: floor[k]["iops"]) if floor else "-"

    rng = np.random.default_rng(1)
    rss0 = rss_bytes()
    say()
    hdr = (
        f"{'pool':>10} {'rows':>6} {'pages/g':>8} {'reads/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'vs psync':>9} {'vs uring':>9} {'goal':>7}"
    )
    say(hdr)
    say("-" * len(hdr))
    io_mode = "?"
    pools = {}
    for label, pool in (("16xQD", None), ("1xQD", args.qd)):
        with DiskTable(path, OFFSET, rows, ROW_BYTES, queue_depth=args.qd, pool_pages=pool) as t:
            io_mode = t.io_mode
            for count in SIZES:
                r = gathers(t, rows, count, args.runtime / 2, rng)
                ratio = {k: r["reads_s"] / v["iops"] for k, v in floor.items()}
                goal = "-" if not best else ("met" if r["reads_s"] / best >= GOAL else "MISSED")
                say(
                    f"{label:>10} {count:>6,} {r['pages_per_gather']:>8.0f} {r['reads_s']:>10,.0f} "
                    f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                    f"{ratio.get('psync', float('nan')):>8.2f}x {ratio.get('io_uring', float('nan')):>8.2f}x "
                    f"{goal:>7}"
                )
            pools[label] = t.pool_pages * t.page
    rss1 = rss_bytes()
    say()
    say(f"reader: {io_mode}, Python threads over os.preadv; goal: >= {GOAL}x fio's best ({best_name}) at QD{args.qd}")
    say(
        f"RSS: {rss1 / 2**20:.0f} MiB after the gathers ({(rss1 - rss0) / 2**20:+.1f} MiB over the start), "
        f"pools {', '.join(f'{k} {v / 2**20:.2f} MiB' for k, v in pools.items())}; table {nbytes / 2**20:.0f} MiB: RSS is {rss1 / nbytes:.1%} of it "
        f"(the Python + numpy baseline dominates a small table)"
    )
    with open(os.path.join(args.dir, "disk.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not args.keep:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
