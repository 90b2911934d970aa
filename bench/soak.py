#!/usr/bin/env python3
"""Soak under attack: 16 client processes (shm + tcp, sync + async) gather for a bounded time while a
flood client attacks the same server; every row is checked against the table file.

The run has two halves of equal length: quiet, then with the flood. The flood process does what
issues 12 and 24 found harmful: it keeps ~1,000 idle tcp connections and ~500 idle shm connections
open (reconnecting as the server evicts them), sends garbage frames, opens sessions as fast as the
rate limit lets it, holds a slow-reading connection with a big pending response, floods OpenSession
with sessions that never bind a keepalive stream, and keeps 64 GetCatalog calls in flight at all
times. The server runs under LimitNOFILE=1024, as the shipped systemd unit had it.

Reports: rows checked, mismatches (must be 0), failed gathers, victims' p50/p99 per transport
without and with the flood (goal: p99 within 2x), and the server's fds, threads and RSS before,
between and after the halves (flat: nothing a peer did is still held).

Usage: python bench/soak.py [--seconds 20] [--rows 200000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tableserver.common.model import ROW_BYTES  # noqa: E402
from tableserver.demo import DemoTable, write_demo_file  # noqa: E402

CLIENTS = [(t, m) for t in ("shm", "tcp") for m in ("sync", "async")] * 4  # 16 processes
BATCH = 512


def server_stats(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
    }


def victim(address: str, path: str, transport: str, mode: str, seed: int, t_end: float, q) -> None:
    from tableclient import TableClient

    from tableserver.tablefile import read_header

    spec = read_header(path).tables[0]
    local = np.memmap(path, np.uint8, "r", spec.offset, spec.nbytes).reshape(spec.rows, spec.row_bytes)
    rng = np.random.default_rng(seed)
    samples, rows, bad, failed = [], 0, 0, 0
    with TableClient(address, transport=transport, client_name=f"soak-{transport}-{mode}") as c:
        table = c.table(spec.name)
        while time.time() < t_end:
            ids = rng.integers(0, spec.rows, BATCH)
            t0 = time.perf_counter()
            try:
                got = table.gather(ids) if mode == "sync" else table.gather_async(ids).wait(10)
            except Exception:
                failed += 1
                continue
            samples.append((time.time(), time.perf_counter() - t0))
            rows += ids.size
            bad += int((got != local[ids]).any(axis=1).sum())
    q.put({"transport": transport, "mode": mode, "samples": samples, "rows": rows, "bad": bad, "failed": failed})


def flood(address: str, tcp: tuple, shm_path: str, t_start: float, t_end: float, q) -> None:
    import grpc

    from tableserver.common.wire import FrameType, hello_frame, recv_challenge, request_header
    from tableserver.v1 import tableserver_pb2 as pb
    from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    while time.time() < t_start:
        time.sleep(0.01)
    counts = {
        "tcp_conns": 0,
        "shm_conns": 0,
        "garbage": 0,
        "sessions_tried": 0,
        "slow_readers": 0,
        "unbound_sessions": 0,
        "unbound_refused": 0,
        "catalogs": 0,
        "catalogs_refused": 0,
    }
    held_tcp, held_shm, slow = [], [], []
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.TableServiceStub(channel)
    import threading

    def rpc_flood(call, request, ok_key: str, refused_key: str, in_flight: int) -> None:
        """Keeps ``in_flight`` calls outstanding until the end (each a session or a catalog nobody uses)."""
        ch = grpc.insecure_channel(address)
        method = getattr(pb_grpc.TableServiceStub(ch), call)
        live = []
        while time.time() < t_end:
            while len(live) < in_flight:
                live.append(method.future(request, timeout=5))
            done = [f for f in live if f.done()]
            for f in done:
                live.remove(f)
                counts[ok_key if f.exception() is None else refused_key] += 1
            time.sleep(0.001)
        for f in live:
            f.cancel()
        ch.close()

    floods = [
        threading.Thread(
            target=rpc_flood,
            args=(
                "OpenSession",
                pb.OpenSessionRequest(client_name="unbound", transports=["tcp"]),
                "unbound_sessions",
                "unbound_refused",
                8,
            ),
        ),
        threading.Thread(
            target=rpc_flood, args=("GetCatalog", pb.GetCatalogRequest(), "catalogs", "catalogs_refused", 64)
        ),
    ]
    for t in floods:
        t.start()
    while time.time() < t_end:
        try:  # idle connections that never say HELLO
            for _ in range(20):
                held_tcp.append(socket.create_connection(tcp, timeout=2))
                counts["tcp_conns"] += 1
            for _ in range(10):
                u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                u.connect(shm_path)
                held_shm.append(u)
                counts["shm_conns"] += 1
        except OSError:
            pass
        while len(held_tcp) > 1000:
            held_tcp.pop(0).close()
        while len(held_shm) > 500:
            held_shm.pop(0).close()
        try:  # garbage frames
            with socket.create_connection(tcp, timeout=2) as s:
                s.sendall(os.urandom(256))
                counts["garbage"] += 1
        except OSError:
            pass
        try:  # session opens as fast as allowed, and a slow reader with a big response pending
            counts["sessions_tried"] += 1
            resp = stub.OpenSession(pb.OpenSessionRequest(client_name="flood", transports=["tcp"]), timeout=2)
            if len(slow) < 8:
                s = socket.create_connection(tcp, timeout=2)
                s.sendall(hello_frame(resp.session_id, resp.secret, recv_challenge(s))[0])
                ids = np.random.default_rng(0).integers(0, 1000, 4096).astype("<i8")
                s.sendall(request_header(FrameType.GATHER, 1, 0, ids.size) + ids.tobytes())
                slow.append(s)  # never read
                counts["slow_readers"] += 1
        except (grpc.RpcError, OSError, ValueError):
            pass
    for t in floods:
        t.join()
    for s in held_tcp + held_shm + slow:
        s.close()
    channel.close()
    q.put({"flood": counts})


def pct(samples: list, lo: float, hi: float) -> tuple[float, float, int]:
    lat = np.array([d for t, d in samples if lo <= t < hi])
    if not lat.size:
        return float("nan"), float("nan"), 0
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6), lat.size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each half (default 20)")
    ap.add_argument("--rows", type=int, default=200_000, help=f"rows of the soak table ({ROW_BYTES} B each)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "soak.txt"))
    args = ap.parse_args()
    from tableserver.demo_run import start_server

    lines = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_file(os.path.join(tmp, "soak.bin"), [DemoTable("soak", args.rows, ROW_BYTES, 1)], seed=5)
        proc, ready = start_server(
            path, tmp, ["--hugepages", "off", "--session-open-rate", "20"], prefix=["prlimit", "--nofile=1024:1024"]
        )
        try:
            address, pid = ready["control"], proc.pid
            host, port = ready["tcp"].rsplit(":", 1)
            before = server_stats(pid)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            t0 = time.time() + 3.0  # time for the clients to start
            t_mid, t_end = t0 + args.seconds, t0 + 2 * args.seconds
            victims = [
                ctx.Process(target=victim, args=(address, path, t, m, i, t_end, q)) for i, (t, m) in enumerate(CLIENTS)
            ]
            attacker = ctx.Process(target=flood, args=(address, (host, int(port)), ready["shm"], t_mid, t_end, q))
            for p in victims + [attacker]:
                p.start()
            while time.time() < t_mid - 0.5:
                time.sleep(0.1)
            middle = server_stats(pid)
            results = [q.get(timeout=2 * args.seconds + 120) for _ in range(len(victims) + 1)]
            for p in victims + [attacker]:
                p.join(60)
            time.sleep(args.seconds / 4 + 6)  # evicted/timed-out peers and lapsed flood sessions go
            after = server_stats(pid)
        finally:
            proc.terminate()
            proc.wait(60)
    flood_counts = next(r["flood"] for r in results if "flood" in r)
    clients = [r for r in results if "flood" not in r]
    rows = sum(r["rows"] for r in clients)
    bad = sum(r["bad"] for r in clients)
    failed = sum(r["failed"] for r in clients)
    say(
        f"soak: {len(clients)} client processes ({BATCH}-row gathers), 2 x {args.seconds:g} s, "
        f"server under LimitNOFILE=1024, {args.rows} rows x {ROW_BYTES} B"
    )
    say(f"flood (second half): {json.dumps(flood_counts)}")
    say(f"rows checked: {rows:,}   mismatches: {bad}   failed gathers: {failed}")
    say()
    say(f"{'victims':<11}{'quiet p50':>11}{'p99 us':>9}{'n':>8}{'flood p50':>12}{'p99 us':>9}{'n':>8}{'p99 ratio':>11}")
    ratios = {}
    for transport in ("shm", "tcp"):
        for mode in ("sync", "async"):
            samples = [s for r in clients if r["transport"] == transport and r["mode"] == mode for s in r["samples"]]
            q50, q99, qn = pct(samples, t0, t_mid)
            f50, f99, fn = pct(samples, t_mid, t_end)
            ratios[f"{transport}-{mode}"] = f99 / q99
            say(
                f"{transport + ' ' + mode:<11}{q50:>11.0f}{q99:>9.0f}{qn:>8}{f50:>12.0f}{f99:>9.0f}{fn:>8}"
                f"{f99 / q99:>10.2f}x"
            )
    say()
    say(f"{'server':<8}{'before':>10}{'quiet':>10}{'after':>10}")
    for key in ("fds", "threads", "rss_mib"):
        say(f"{key:<8}{before[key]:>10.0f}{middle[key]:>10.0f}{after[key]:>10.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    ok = bad == 0 and failed == 0
    say(
        f"\n{'PASS' if ok else 'FAIL'}: {bad} mismatches, {failed} failed gathers; worst p99 ratio "
        f"{max(ratios.values()):.2f}x (goal <= 2x); fds {before['fds']} -> {after['fds']}, threads "
        f"{before['threads']} -> {after['threads']}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
