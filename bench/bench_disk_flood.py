"""The disk tier under hostile clients (issue 34): a small gather's latency and the daemon's memory.

Writes one Engram-like table of ``--rows`` rows into ``--dir``, serves it with ``--disk-tables all``, and
measures, in one run against the same daemon:

* quiet: one client's 24-row disk gathers (``--transport``), back to back for ``--seconds``: p50/p99;
* flood: 4 sessions x 8 raw tcp connections, each sending two 65,536-row gathers of the table and never
  reading their answers, while the same client gathers as before: p50/p99 and the ratio to quiet (the
  goal: p99 within 2x of quiet); the daemon's RSS growth and the disk rows it holds
  (``tableserver_disk_rows_held_bytes``);
* departing clients: ``--rounds`` rounds of 300 connections of one session, each sending one 65,536-row
  gather and resetting: HELLOs refused BUSY, pages read for clients that left, RSS after each drained round.

    python bench/bench_disk_flood.py --rows 1500000 --seconds 8

It speaks only the daemon's CLI, gRPC and wire protocol, so it also measures an older checkout
(``PYTHONPATH=/path/to/old:/path/to/old/client python bench/bench_disk_flood.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from common import process_rss  # noqa: E402
from tableclient import TableClient  # noqa: E402

from tableserver.common.wire import (  # noqa: E402
    HEADER,
    HEADER_BYTES,
    FrameType,
    hello_frame,
    recv_challenge,
    recv_exact,
    request_header,
    send_all,
)
from tableserver.ops.demo_run import start_server  # noqa: E402
from tableserver.tables.demo import DemoTable, write_demo_file  # noqa: E402
from tableserver.v1 import tableserver_pb2 as pb  # noqa: E402
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc  # noqa: E402

BIG = 65_536
SMALL = 24


def metric(metrics: str, name: str) -> float | None:
    """Sum of the samples of ``name`` on the daemon's /metrics (None: it exports no such series)."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    found, total = False, 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found, total = True, total + float(line.rsplit(" ", 1)[1])
    return total if found else None


def open_session(address: str):
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.TableServiceStub(ch).OpenSession(
            pb.OpenSessionRequest(client_name="flood", transports=["tcp"]), timeout=30
        )


def raw_connection(tcp: str, session) -> socket.socket | None:
    """A raw tcp data connection of ``session`` past its HELLO; None when the HELLO was refused."""
    host, port = tcp.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    nonce = recv_challenge(s)
    s.sendall(hello_frame(session.session_id, session.secret, nonce)[0])
    head = bytearray(HEADER_BYTES)
    if not recv_exact(s, memoryview(head)):
        s.close()
        return None
    status, count = HEADER.unpack(head)[2], HEADER.unpack(head)[5]
    recv_exact(s, memoryview(bytearray(count)))
    if status != 0:
        s.close()
        return None
    return s


def send_gather(s: socket.socket, ids: np.ndarray, request_id: int = 1) -> None:
    send_all(s, [request_header(FrameType.GATHER, request_id, 0, ids.size), ids.astype("<i8")])


def reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def small_gathers(table, rows: int, seconds: float, local, rng) -> list[float]:
    """One client's 24-row gathers for ``seconds``: each one's latency (every row checked)."""
    lat = []
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        ids = rng.integers(0, rows, SMALL)
        t0 = time.perf_counter()
        got = table.gather(ids)
        lat.append(time.perf_counter() - t0)
        if not np.array_equal(got, local[ids]):
            raise SystemExit("a small gather returned rows that differ from the file")
    return lat


def pcts(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_500_000)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=300, help="connections per departing round")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more flag for the daemon (repeatable)")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"flood-{args.rows}.bin")
    if not os.path.exists(path):
        write_demo_file(path, [DemoTable("engram.layer14", args.rows, 264, 14)], seed=3)
    local = np.memmap(path, np.uint8, "r")
    from tableserver.tables.tablefile import read_header

    spec = read_header(path).tables[0]
    local = local[spec.offset : spec.offset + spec.nbytes].reshape(spec.rows, spec.row_bytes)
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as work:
        proc, ready = start_server(path, work, ["--disk-tables", "all", "--progress", "never", *args.serve_arg])
        try:
            pid = proc.pid
            metrics = ready["metrics"]
            with TableClient(ready["control"], transport=args.transport) as c:
                t = c.table("engram.layer14")
                small_gathers(t, args.rows, 1.0, local, rng)  # warm
                quiet = small_gathers(t, args.rows, args.seconds, local, rng)
                base = process_rss(pid)
                socks = []
                for _ in range(4):
                    session = open_session(ready["control"])
                    for _ in range(8):
                        s = raw_connection(ready["tcp"], session)
                        if s is None:
                            continue
                        for k in range(2):
                            send_gather(s, rng.integers(0, args.rows, BIG), k + 1)
                        socks.append(s)
                held = []
                stop = threading.Event()

                def sample():
                    while not stop.wait(0.2):
                        held.append((process_rss(pid), metric(metrics, "tableserver_disk_rows_held_bytes")))

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
                pages0, t0 = metric(metrics, "tableserver_disk_pages_read_total") or 0.0, time.perf_counter()
                flood = small_gathers(t, args.rows, args.seconds, local, rng)
                rate = ((metric(metrics, "tableserver_disk_pages_read_total") or 0.0) - pages0) / (
                    time.perf_counter() - t0
                )
                stop.set()
                sampler.join()
                for s in socks:
                    reset(s)
            q50, q99 = pcts(quiet)
            f50, f99 = pcts(flood)
            peak = max(r for r, _ in held) if held else process_rss(pid)
            rows_held = [h for _, h in held if h is not None]
            print(f"disk tier under hostile clients: {args.rows:,} rows of 264 B on disk, {args.transport} client")
            print(f"  {len(socks)} flood connections (4 sessions x 8), 2 x {BIG:,}-row gathers each, never read")
            print(f"  quiet   24-row gather: p50 {q50:7.2f} ms  p99 {q99:7.2f} ms  ({len(quiet)} gathers)")
            print(f"  flood   24-row gather: p50 {f50:7.2f} ms  p99 {f99:7.2f} ms  ({len(flood)} gathers)")
            print(
                f"  p99 under flood / quiet: {f99 / q99:.2f}x (goal <= 2x); the drive read {rate:,.0f} pages/s meanwhile"
            )
            print(f"  daemon RSS grew {(peak - base) / 2**20:.0f} MiB under the flood", end="")
            print(f"; disk rows held at most {max(rows_held) / 2**20:.0f} MiB" if rows_held else "")
            time.sleep(1.0)
            session = open_session(ready["control"])
            for r in range(args.rounds):
                pages0 = metric(metrics, "tableserver_disk_pages_read_total") or 0.0
                refused = 0
                for _ in range(args.connections):
                    s = raw_connection(ready["tcp"], session)
                    if s is None:
                        refused += 1
                        continue
                    send_gather(s, rng.integers(0, args.rows, BIG))
                    reset(s)
                t0 = time.monotonic()
                while True:  # drained: no page read for half a second
                    before = metric(metrics, "tableserver_disk_pages_read_total") or 0.0
                    time.sleep(0.5)
                    if (metric(metrics, "tableserver_disk_pages_read_total") or 0.0) == before:
                        break
                drained = time.monotonic() - t0 - 0.5
                pages = (metric(metrics, "tableserver_disk_pages_read_total") or 0.0) - pages0
                print(
                    f"  departing round {r + 1}: {refused} of {args.connections} HELLOs refused BUSY, "
                    f"{pages:,.0f} pages read for them, drained {drained:.1f} s after, RSS {process_rss(pid) / 2**20:.0f} MiB"
                )
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
