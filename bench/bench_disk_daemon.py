"""The daemon's disk tier against the drive's floor, in one run (issue 27), and the page layout question.

Writes a real table file (one Engram layer-14-like table of ``--gib`` GiB) into ``--dir``, starts
``tableserver --disk-tables all --disk-queue-depth QD``, and on the same file, in ``--rounds`` turns:

* the floor: ``fio`` io_uring random 4 KiB O_DIRECT reads at ``iodepth=QD`` over the table's bytes;
* the daemon: ``--clients`` client threads (same-host rows socket, or ``--transport tcp``) each gathering
  1,536 random rows in a loop; the daemon's page reads/s come from its own
  ``tableserver_disk_pages_read_total`` (goal >= 0.8x fio's IOPS), its RSS from /proc against the table
  size (goal < 5%);
* one client alone: per-gather p50/p99 of 24 / 1,536 / 6,144 rows (batch 1 / 64 / 256) against layer 14's
  9.3 ms window;
* the layout: a 264 B row straddles two 4 KiB pages 6.4% of the time (263 of 4,096 start bytes). A
  page-aligned layout (15 rows per page, 3.4% more bytes) reads exactly one page per row. Both are read
  here through ``DiskTable`` at QD on the same file: the real layout, and the aligned one simulated by
  reading the page ``id // 15`` as a 4,096 B row (the same reads an aligned file would get).

    python bench/bench_disk_daemon.py --gib 1 --qd 64 --clients 16 --seconds 6 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from bench_disk import fio  # noqa: E402
from common import process_rss  # noqa: E402
from tableclient import TableClient  # noqa: E402

from tableserver.common.model import ROW_BYTES, WINDOWS_S  # noqa: E402
from tableserver.disk.reader import DiskTable  # noqa: E402
from tableserver.ops.demo_run import start_server  # noqa: E402
from tableserver.tables.demo import DemoTable, write_demo_file  # noqa: E402
from tableserver.tables.tablefile import read_header  # noqa: E402

PAGE = 4096
ROWS_PER_PAGE = PAGE // ROW_BYTES  # 15


def pages_read(metrics: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tableserver_disk_pages_read_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def load(address: str, transport: str, clients: int, seconds: float, rows: int, local) -> tuple[int, float]:
    """``clients`` threads gathering 1,536 random rows for ``seconds``; (gathers done, wall seconds).
    Every client's first gather is checked against the file."""
    done, errors = [0] * clients, []

    def run(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            with TableClient(address, transport=transport) as c:
                t = c.table("engram.layer14")
                ids = rng.integers(0, rows, 1536)
                if not np.array_equal(t.gather(ids), local[ids]):
                    errors.append(f"client {k}: rows differ from the file")
                start.wait()
                while time.perf_counter() < until[0]:
                    t.gather(rng.integers(0, rows, 1536))
                    done[k] += 1
        except Exception as e:  # reported below
            errors.append(f"client {k}: {e!r}")

    start, until = threading.Event(), [0.0]
    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # connected
    until[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit("; ".join(errors[:3]))
    return sum(done), time.perf_counter() - t0


def latencies(address: str, transport: str, rows: int, seconds: float) -> dict:
    rng = np.random.default_rng(99)
    out = {}
    with TableClient(address, transport=transport) as c:
        t = c.table("engram.layer14")
        for n in (24, 1536, 6144):
            lat, t0 = [], time.perf_counter()
            while time.perf_counter() - t0 < seconds / 3 or len(lat) < 10:
                ids = rng.integers(0, rows, n)
                a = time.perf_counter()
                t.gather(ids)
                lat.append(time.perf_counter() - a)
            out[n] = (float(np.percentile(lat, 50)), float(np.percentile(lat, 99)))
    return out


def layout(path: str, offset: int, rows: int, qd: int, seconds: float, bursts: int = 8) -> dict:
    """Pages per gather and gathers/s of 1,536 random rows: today's layout against a page-aligned one, in
    alternating bursts (a shared disk's drift falls on both alike)."""
    rng = np.random.default_rng(5)
    pages = rows * ROW_BYTES // PAGE
    aligned_rows = pages * ROWS_PER_PAGE  # the ids an aligned copy of these bytes holds
    # aligned row r lies in page r // 15: read as the 256 B row 16 * (r // 15) + r % 15 of a table of 256 B
    # rows, it is one page read (256 divides 4,096) and a copy of about a row's size, as an aligned file's
    slots = PAGE // 256
    res = {"row-major (today)": [0, 0, 0.0], "page-aligned (15/page)": [0, 0, 0.0]}
    with (
        DiskTable(path, offset, rows, ROW_BYTES, queue_depth=qd) as plain,
        DiskTable(path, offset, pages * slots, 256, queue_depth=qd) as aligned,
    ):
        for _ in range(bursts):
            for name, table, to_ids in (
                ("row-major (today)", plain, lambda ids: ids),
                ("page-aligned (15/page)", aligned, lambda ids: ids // ROWS_PER_PAGE * slots + ids % ROWS_PER_PAGE),
            ):
                p0, t0 = table.pages_read, time.perf_counter()
                while time.perf_counter() - t0 < seconds / bursts:
                    table.gather(to_ids(rng.integers(0, aligned_rows, 1536)))
                    res[name][0] += 1
                res[name][1] += table.pages_read - p0
                res[name][2] += time.perf_counter() - t0
    return {name: (p / n, n / wall) for name, (n, p, wall) in res.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--qd", type=int, default=64, help="the daemon's --disk-queue-depth and fio's iodepth")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    ap.add_argument("--seconds", type=float, default=6.0, help="seconds of each measurement per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    rows = int(args.gib * 2**30) // ROW_BYTES
    path = os.path.join(args.dir, f"disk-daemon-{args.gib:g}gib.bin")
    if not os.path.exists(path) or read_header(path).tables[0].rows != rows:
        print(f"writing {path} ({rows:,} rows) ...", flush=True)
        write_demo_file(path, [DemoTable("engram.layer14", rows, ROW_BYTES, 14)], seed=3)
    spec = read_header(path).tables[0]
    mm = np.memmap(path, np.uint8, "r")
    local = mm[spec.offset : spec.offset + spec.nbytes].reshape(rows, ROW_BYTES)
    lines = [
        f"bench_disk_daemon: {spec.nbytes / 2**30:.2f} GiB disk table ({rows:,} rows of {ROW_BYTES} B), "
        f"--disk-queue-depth {args.qd}, {args.clients} clients over {args.transport}, "
        f"{args.rounds} rounds of {args.seconds:g} s, {os.cpu_count()} CPUs"
    ]
    with tempfile.TemporaryDirectory() as tmp:
        proc, ready = start_server(
            path, tmp, ["--disk-tables", "all", "--disk-queue-depth", str(args.qd), "--transports", "shm,tcp"]
        )
        try:
            rss0 = process_rss(proc.pid)
            fio_iops, daemon_pages_s, peak = [], [], rss0
            for _ in range(args.rounds):
                f = fio(path, spec.nbytes, args.qd, "io_uring", args.seconds)
                if f is not None:
                    fio_iops.append(f["iops"])
                p0 = pages_read(ready["metrics"])
                n, wall = load(ready["control"], args.transport, args.clients, args.seconds, rows, local)
                daemon_pages_s.append((pages_read(ready["metrics"]) - p0) / wall)
                peak = max(peak, process_rss(proc.pid))
            lat = latencies(ready["control"], args.transport, rows, args.seconds)
        finally:
            proc.terminate()
            proc.wait(30)
    lay = layout(path, spec.offset, rows, args.qd, 2 * args.seconds)
    fio_m, d_m = float(np.median(fio_iops)) if fio_iops else 0.0, float(np.median(daemon_pages_s))
    ratio = d_m / fio_m if fio_m else float("nan")
    lines.append(f"fio io_uring QD{args.qd}: {fio_m:,.0f} IOPS (rounds {', '.join(f'{x:,.0f}' for x in fio_iops)})")
    lines.append(
        f"daemon:         {d_m:,.0f} page reads/s (rounds {', '.join(f'{x:,.0f}' for x in daemon_pages_s)}) "
        f"= {ratio:.2f}x fio [{'met' if ratio >= 0.8 else 'MISSED'} >= 0.8x]"
    )
    share, grown = peak / spec.nbytes, (peak - rss0) / spec.nbytes
    lines.append(
        f"daemon RSS: {rss0 / 2**20:.0f} MiB at SERVING, {peak / 2**20:.0f} MiB at most under load = {share:.1%} of "
        f"the {spec.nbytes / 2**20:.0f} MiB table [{'met' if share < 0.05 else 'MISSED'} < 5%]; the load added "
        f"{(peak - rss0) / 2**20:.1f} MiB ({grown:.2%}: I/O and reply buffers; the rest is the Python baseline)"
    )
    window = WINDOWS_S[14]
    lines.append(f"one client, per gather (layer 14's window {window * 1e3:.1f} ms):")
    for n, (p50, p99) in lat.items():
        fits = "fits" if p99 <= window else "does NOT fit"
        lines.append(f"  {n:>5} rows: p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms  ({fits} the window)")
    lines.append(f"layout, 1,536 random rows per gather through DiskTable at QD{args.qd}:")
    base = lay["row-major (today)"]
    for name, (ppg, gps) in lay.items():
        lines.append(f"  {name:<24} {ppg:7.1f} pages/gather  {gps:6.1f} gathers/s  {gps / base[1]:.2f}x")
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(args.dir, "disk_daemon.txt"), "w") as f:
        f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
