#!/usr/bin/env python3
"""Gather latency and throughput: in-process numpy vs shm vs tcp, side by side in one run.

For 1,536 rows (one layer of one batch-64 decode step) and 12,288 rows of
264 B, with fresh random row ids every iteration (no cache reuse), the three
paths run interleaved so machine noise hits them alike. Prints p50/p99 latency,
rows/s, and the ratios the targets are stated in:

    shm rows/s >= 0.9 x in-process rows/s;  tcp p50 <= 1 ms for 1,536 rows.

Usage: python bench/bench_transports.py [--gib 2] [--iters 300] [--server-pages 2m|4k]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from common import Hugepages, bench_table
from tableclient import TableClient
from tableserver.demo_run import start_server
from tableserver.tablefile import read_header


def stats(samples: np.ndarray, rows: int) -> tuple[float, float, float]:
    return (float(np.percentile(samples, 50)), float(np.percentile(samples, 99)), rows * len(samples) / samples.sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="table size (default 2 GiB)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--server-pages", choices=("2m", "4k"), default="2m",
                    help="server table memory: 2 MiB hugepages (reserved for the run, needs root) or 4 KiB pages")
    args = ap.parse_args()
    path = bench_table(args.gib)
    spec = read_header(path).tables[0]
    print(f"loading the in-process copy ({spec.nbytes / 2**30:.2f} GiB) ...", flush=True)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    local = np.array(mm[spec.offset:spec.offset + spec.nbytes]).reshape(spec.rows, 264)  # private, resident copy
    del mm
    with tempfile.TemporaryDirectory() as tmp, Hugepages(spec.nbytes if args.server_pages == "2m" else 0) as huge:
        huge = huge and args.server_pages == "2m"
        if not huge:
            print("note: could not reserve 2 MiB hugepages (needs root); the server uses 4 KiB pages while numpy's\n"
                  "      in-process copy gets transparent hugepages, so shm pays extra TLB misses")
        proc, ready = start_server(path, tmp, ["--hugepages", "2m" if huge else "off"])
        # a second server on the same table file seals its tcp rows (AES-256-GCM): what privacy costs
        sealed_dir = os.path.join(tmp, "sealed")
        os.makedirs(sealed_dir)
        sproc, sready = start_server(path, sealed_dir, ["--hugepages", "off", "--transports", "tcp",
                                                        "--data-encryption", "on", "--metrics-port", "off"])
        try:
            shm = TableClient(ready["control"], transport="shm")
            tcp = TableClient(ready["control"], transport="tcp")
            sealed = TableClient(sready["control"], transport="tcp")
            tables = {"shm": shm.table("bench"), "tcp": tcp.table("bench"), "tcp sealed": sealed.table("bench")}
            paths = ("in-process", "shm", "tcp", "tcp sealed")
            print(f"server SERVING in {ready['time_to_serving_s']:.2f} s on {'2 MiB hugepages' if huge else '4 KiB pages'}; "
                  f"{args.iters} iterations per size, "
                  "paths interleaved, fresh random ids each time\n")
            print(f"{'rows':>6}  {'path':<12}{'p50 us':>9}{'p99 us':>9}{'rows/s':>13}{'vs in-process':>15}")
            results = {}
            for n in (1536, 12288):
                rng = np.random.default_rng(n)
                out = np.empty((n, 264), np.uint8)
                t = {k: np.empty(args.iters) for k in paths}
                for i in range(args.iters + 20):  # first 20: warm-up
                    ids = rng.integers(0, spec.rows, n)
                    for k in paths:
                        s = time.perf_counter()
                        if k == "in-process":
                            np.take(local, ids, axis=0, out=out)
                        else:
                            tables[k].gather(ids, out=out)
                        if i >= 20:
                            t[k][i - 20] = time.perf_counter() - s
                    if i == 20:  # correctness once per size, outside the timings
                        np.testing.assert_array_equal(tables["tcp"].gather(ids), local[ids])
                        np.testing.assert_array_equal(tables["shm"].gather(ids), local[ids])
                        np.testing.assert_array_equal(tables["tcp sealed"].gather(ids), local[ids])
                base = stats(t["in-process"], n)[2]
                for k in t:
                    p50, p99, rps = stats(t[k], n)
                    results[(n, k)] = (p50, p99, rps)
                    print(f"{n:>6}  {k:<12}{p50 * 1e6:>9.0f}{p99 * 1e6:>9.0f}{rps:>13,.0f}{rps / base:>14.2f}x")
            shm.close()
            tcp.close()
            sealed.close()
        finally:
            for p in (proc, sproc):
                p.terminate()
                p.wait(30)
    r_shm = min(results[(n, "shm")][2] / results[(n, "in-process")][2] for n in (1536, 12288))
    tcp_p50 = results[(1536, "tcp")][0]
    print(f"\ntarget shm >= 0.9x in-process rows/s: worst size {r_shm:.2f}x  "
          f"[{'met' if r_shm >= 0.9 else 'MISSED'}]")
    print(f"target tcp p50 <= 1 ms for 1,536 rows: {tcp_p50 * 1e3:.3f} ms  [{'met' if tcp_p50 <= 1e-3 else 'MISSED'}]")
    for n in (1536, 12288):
        print(f"sealed tcp (AES-256-GCM) at {n:,} rows: {results[(n, 'tcp sealed')][2] / results[(n, 'tcp')][2]:.2f}x "
              f"plain tcp rows/s, p50 {results[(n, 'tcp sealed')][0] * 1e3:.2f} vs {results[(n, 'tcp')][0] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
