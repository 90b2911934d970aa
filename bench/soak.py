#!/usr/bin/env python3
"""Soak under attack: 16 client processes (shm + tcp, sync + async) gather for a bounded time from a memory table
and a disk table while flood clients attack the same server; every row is checked against the table file.

The run has two halves of equal length: quiet, then with the floods. The flood process does what issues 12 and 24
found harmful: it keeps ~1,000 idle tcp connections and ~500 idle shm connections open (reconnecting as the server
evicts them), sends garbage frames, opens sessions as fast as the rate limit lets it, holds a slow-reading
connection with a big pending response, floods OpenSession with sessions that never bind a keepalive stream, and
keeps 64 GetCatalog calls in flight at all times. The server runs under LimitNOFILE=1024, as the shipped systemd
unit had it.

The disk table (``--disk``, on by default: ``soak.disk`` served with ``--disk-tables``) is gathered by every
victim (over tcp, and over shm's rows socket) and by two probes that gather 24 rows every 5 ms (one tcp, one shm).
The flood half is cut in thirds: the floods above run through all of it, alone in the first third (the reference
for what the disk floods add); a second flood process attacks the disk tier as issue 34 found harmful in the next
two thirds:

* unread disk gathers: 4 sessions x 8 tcp connections, each sending two 65,536-row gathers of the disk table and
  never reading the responses (a connection the server drops is opened again);
* departing clients: connect, HELLO, send one 65,536-row disk gather, reset (SO_LINGER 0), 4 sessions x 8
  connections a batch, batches for half of each of 3 rounds; after each round it waits for the server to drain
  (no flood gather queued or held) and reads the server's RSS.

Reports: rows checked, mismatches (must be 0), failed gathers (must be 0); victims' p50/p99 per transport and table
without and with the floods (goal: p99 within 2x); the probes' p50/p99 quiet, under the other floods alone, under
the unread disk gathers and under the departing clients, with the ratio to quiet (goal: within 2x) and to the other
floods alone; HELLOs refused BUSY (goal: 0), how long each round took to drain and the RSS after it (goal: flat);
the disk tier's rows held (``tableserver_disk_rows_held_bytes``) and queued gathers, and the server's RSS growth,
per window; and the server's fds, threads and RSS before, between and after the halves (flat: nothing a peer did
is still held). Timing figures are reported, not judged (the machine is shared): the verdict is 0 mismatches and no
failed gather of a well-behaved client.

Usage: python bench/soak.py [--seconds 20] [--rows 200000] [--disk-rows 200000] [--no-disk]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import select
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tableserver.common.model import ROW_BYTES  # noqa: E402
from tableserver.tables.demo import DemoTable, write_demo_file  # noqa: E402

CLIENTS = [(t, m) for t in ("shm", "tcp") for m in ("sync", "async")] * 4  # 16 processes
BATCH = 512
MEMORY_TABLE = "soak"
DISK_TABLE = "soak.disk"
DISK_BATCH = 96  # rows of a victim's disk gather (4 tokens x 24 rows)
PROBES = ("tcp", "shm")
PROBE_ROWS = 24
PROBE_EVERY_S = 0.005
FLOOD_ROWS = 65_536  # rows of each flood gather (the server's default --max-rows-per-request)
FLOOD_SESSIONS = 4  # sessions of each disk flood phase
FLOOD_CONNS = 8  # connections per flood session (the server's default --max-connections-per-session)
UNREAD_GATHERS = 2  # gathers each unread connection sends
DEPART_ROUNDS = 3
DRAIN_TIMEOUT_S = 20.0  # how long the departing-clients flood waits for a round to drain
SETTLE_S = 1.0  # ... or for the hang-ups it sees to stop coming (a gather reset before the server read it)
HANGUP_WAIT_S = 0.5  # how long the next batch of departing clients waits for the server to see the last one leave
DISK_BUFFER_MIB = 512  # the server's --disk-buffer-mib (its default), said in the report
HELD = "tableserver_disk_rows_held_bytes"
QUEUED = f'tableserver_disk_queued_gathers{{table="{DISK_TABLE}"}}'
CANCELLED = f'tableserver_disk_cancelled_gathers_total{{table="{DISK_TABLE}"}}'
DISCONNECTS = 'tableserver_errors_total{reason="disconnect"}'
WINDOWS = {"unread": "+ unread disk gathers", "departing": "+ departing clients"}  # the disk floods' phases


def server_stats(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
    }


def scrape(address: str) -> dict:
    """The server's /metrics as {series (name and labels, as exposed): value}."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def file_tables(path: str) -> dict:
    """Every table of the file, read-only from the file itself: {name: uint8 [rows, row_bytes]}."""
    from tableserver.tables.tablefile import read_header

    return {
        s.name: np.memmap(path, np.uint8, "r", s.offset, s.nbytes).reshape(s.rows, s.row_bytes)
        for s in read_header(path).tables
    }


def failed(out: dict, e: Exception) -> None:
    """Counts a failed gather and keeps the first few distinct errors, one line each."""
    out["failed"] += 1
    text = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    if len(out["errors"]) < 3 and text not in out["errors"]:
        out["errors"].append(text)


def victim(address: str, path: str, transport: str, mode: str, seed: int, t_end: float, disk: bool, q) -> None:
    """Gathers BATCH rows of the memory table, then DISK_BATCH rows of the disk table, until ``t_end``."""
    from tableclient import TableClient

    local = file_tables(path)
    rng = np.random.default_rng(seed)
    out = {"kind": "victim", "transport": transport, "mode": mode, "samples": {"memory": [], "disk": []}}
    out.update(rows=0, bad=0, failed=0, errors=[])
    plan = [("memory", MEMORY_TABLE, BATCH)] + ([("disk", DISK_TABLE, DISK_BATCH)] if disk else [])
    try:
        with TableClient(address, transport=transport, client_name=f"soak-{transport}-{mode}") as c:
            tables = [(kind, c.table(name), local[name], n) for kind, name, n in plan]
            while time.time() < t_end:
                for kind, table, rows, n in tables:
                    ids = rng.integers(0, table.rows, n)
                    t0 = time.perf_counter()
                    try:
                        got = table.gather(ids) if mode == "sync" else table.gather_async(ids).wait(10)
                    except Exception as e:
                        failed(out, e)
                        continue
                    out["samples"][kind].append((time.time(), time.perf_counter() - t0))
                    out["rows"] += ids.size
                    out["bad"] += int((got != rows[ids]).any(axis=1).sum())
    except Exception as e:  # could not connect, or the client broke: a failure of this victim, reported
        failed(out, e)
    q.put(out)


def probe(address: str, path: str, transport: str, t_end: float, q) -> None:
    """A well-behaved decode client: PROBE_ROWS rows of the disk table every PROBE_EVERY_S, each timed and checked."""
    from tableclient import TableClient

    local = file_tables(path)[DISK_TABLE]
    rng = np.random.default_rng(1000 + PROBES.index(transport))
    out = {"kind": "probe", "transport": transport, "samples": [], "rows": 0, "bad": 0, "failed": 0, "errors": []}
    try:
        with TableClient(address, transport=transport, client_name=f"soak-probe-{transport}") as c:
            table = c.table(DISK_TABLE)
            due = time.time()
            while time.time() < t_end:
                ids = rng.integers(0, table.rows, PROBE_ROWS)
                t0 = time.perf_counter()
                try:
                    got = table.gather(ids)
                except Exception as e:
                    failed(out, e)
                else:
                    out["samples"].append((time.time(), time.perf_counter() - t0))
                    out["rows"] += ids.size
                    out["bad"] += int((got != local[ids]).any(axis=1).sum())
                due += PROBE_EVERY_S
                pause = due - time.time()
                if pause > 0:
                    time.sleep(pause)
                else:
                    due = time.time()  # late (a slow gather): no catching up in a burst
    except Exception as e:
        failed(out, e)
    q.put(out)


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
    q.put({"kind": "flood", "flood": counts})


def reset(sock: socket.socket) -> None:
    """Closes ``sock`` with an RST (SO_LINGER 0): a client that vanished, its input unread."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def unsent(sock: socket.socket) -> int:
    """Bytes of ``sock``'s send queue the peer has not acknowledged yet (SIOCOUTQ)."""
    import fcntl
    import termios

    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
    except OSError:
        return 0


def disk_flood(address: str, tcp: tuple, pid: int, metrics: str, t_mid: float, t_end: float, calm: int, q) -> None:
    """The disk tier's floods over the flood half (see the module): unread disk gathers, then departing clients.
    ``calm``: disk gathers the well-behaved clients may have queued at once (a round is drained at or below it)."""
    try:
        q.put(_disk_flood(address, tcp, pid, metrics, t_mid, t_end, calm))
    except Exception as e:  # the soak could not run this flood: said in one line, and the run fails
        q.put({"kind": "disk_flood", "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})


def _disk_flood(address: str, tcp: tuple, pid: int, metrics: str, t_mid: float, t_end: float, calm: int) -> dict:
    import grpc

    from tableserver.common.wire import (
        HEADER,
        HEADER_BYTES,
        MAX_HANDSHAKE_MESSAGE,
        FrameType,
        Refused,
        Status,
        hello_frame,
        recv_challenge,
        recv_exact,
        request_header,
    )
    from tableserver.v1 import tableserver_pb2 as pb
    from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.TableServiceStub(channel)
    stop = threading.Event()
    streams = []

    def open_session(name: str):
        """A tcp session kept alive by a KeepAlive stream (opened before the flood half: its session flood
        spends the rate limit)."""
        for _ in range(50):
            try:
                resp = stub.OpenSession(pb.OpenSessionRequest(client_name=name, transports=["tcp"]), timeout=5)
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                time.sleep(0.2)
        else:
            raise RuntimeError(f"{name}: OpenSession refused 50 times (rate limit)")
        interval = max(0.1, resp.lease_seconds / 3)

        def pings(session_id=resp.session_id):
            yield pb.KeepAliveRequest(session_id=session_id)
            while not stop.wait(interval):
                yield pb.KeepAliveRequest(session_id=session_id)

        call = stub.KeepAlive(pings())

        def drain(call=call):
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass

        threading.Thread(target=drain, daemon=True).start()
        streams.append(call)
        return resp

    unread_sessions = [open_session(f"soak-unread-{i}") for i in range(FLOOD_SESSIONS)]
    depart_sessions = [open_session(f"soak-departing-{i}") for i in range(FLOOD_SESSIONS)]
    info = next(t for t in stub.GetCatalog(pb.GetCatalogRequest(), timeout=5).tables if t.name == DISK_TABLE)
    rng = np.random.default_rng(34)
    frames = [
        request_header(FrameType.GATHER, 1, info.index, FLOOD_ROWS)
        + rng.integers(0, info.rows, FLOOD_ROWS).astype("<i8").tobytes()
        for _ in range(4)
    ]
    one = len(frames[0])

    def connect(resp, counts: dict) -> socket.socket | None:
        """A tcp data connection past its HELLO, or None (counted: BUSY at the HELLO, at the CHALLENGE, other)."""
        deadline = time.monotonic() + 5
        counts["hellos"] += 1
        try:
            sock = socket.create_connection(tcp, timeout=5)
        except OSError:
            counts["errors"] += 1
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                nonce = recv_challenge(sock, deadline)
            except Refused as e:  # refused before the HELLO (the port's connection cap)
                counts["challenge_busy" if e.status == Status.BUSY else "refused"] += 1
                sock.close()
                return None
            sock.sendall(hello_frame(resp.session_id, resp.secret, nonce)[0])
            head = bytearray(HEADER_BYTES)
            if not recv_exact(sock, memoryview(head), deadline):
                raise ConnectionResetError("closed before the HELLO's answer")
            _, _, status, _, _, count = HEADER.unpack(head)
            if count > MAX_HANDSHAKE_MESSAGE:
                raise ValueError(f"a HELLO answer of {count} bytes")
            recv_exact(sock, memoryview(bytearray(count)), deadline)
            if status == Status.OK:
                return sock
            counts["busy" if status == Status.BUSY else "refused"] += 1
        except (OSError, ValueError):
            counts["errors"] += 1
        sock.close()
        return None

    def new_counts() -> dict:
        return dict(hellos=0, busy=0, challenge_busy=0, refused=0, errors=0, gathers=0)

    def snapshot() -> dict:
        m = scrape(metrics)
        return {
            "queued": m.get(QUEUED, 0.0),
            "held": m.get(HELD, 0.0),
            "cancelled": m.get(CANCELLED, 0.0),
            "disconnects": m.get(DISCONNECTS, 0.0),
        }

    def drained(since: float, base: dict, left: int) -> dict:
        """Waits (at most DRAIN_TIMEOUT_S) until no flood gather is queued or held: the server saw all ``left``
        connections hang up since ``base`` (or, for those it had not read a gather from, nothing changed for
        SETTLE_S); the round's figures."""
        last, steady = None, time.time()
        while True:
            m = snapshot()
            now = time.time()
            if m["disconnects"] != last:
                last, steady = m["disconnects"], now
            idle = m["queued"] <= calm and m["held"] < FLOOD_ROWS * ROW_BYTES
            done = idle and (m["disconnects"] - base["disconnects"] >= left or now - steady >= SETTLE_S)
            if done or now - since > DRAIN_TIMEOUT_S:
                return dict(m, drained=done, drain_s=now - since, rss_mib=server_stats(pid)["rss_mib"])
            time.sleep(0.05)

    start = snapshot()
    third = (t_end - t_mid) / 3  # the flood half: the other floods alone (the reference), + unread, + departing
    t_unread, t_split = t_mid + third, t_mid + 2 * third
    while time.time() < t_unread:
        time.sleep(0.01)

    # -- unread disk gathers: 4 sessions x 8 connections, two 65,536-row gathers each, never read
    unread = dict(new_counts(), dropped=0, answered=0)
    poller = select.poll()
    hangup = select.POLLRDHUP | select.POLLHUP | select.POLLERR
    conns: dict[int, dict] = {}  # fd -> the connection, its unsent bytes, its session, ...
    reopen: list = []  # (session, when)

    def watch(fd: int, c: dict) -> None:
        """What to wait for on a connection: room to send, its response's first bytes (never read), a hang-up."""
        poller.modify(fd, hangup | (select.POLLOUT if c["pending"] else 0) | (0 if c["answered"] else select.POLLIN))

    def open_unread(resp) -> None:
        sock = connect(resp, unread)
        if sock is None:
            reopen.append((resp, time.time() + 0.2))
            return
        sock.setblocking(False)
        pending = b"".join(frames[(unread["hellos"] + k) % len(frames)] for k in range(UNREAD_GATHERS))
        conns[sock.fileno()] = dict(sock=sock, pending=memoryview(pending), resp=resp, sent=0, answered=False)
        poller.register(sock, hangup)
        watch(sock.fileno(), conns[sock.fileno()])

    for resp in unread_sessions:
        for _ in range(FLOOD_CONNS):
            open_unread(resp)
    while time.time() < t_split:
        for fd, ev in poller.poll(50):
            c = conns.get(fd)
            if c is None:
                continue
            if not ev & hangup and ev & select.POLLOUT and c["pending"]:
                try:
                    c["pending"] = c["pending"][c["sock"].send(c["pending"]) :]
                except BlockingIOError:
                    pass
                except OSError:
                    ev |= select.POLLERR
                sent = UNREAD_GATHERS - -(-len(c["pending"]) // one)  # whole frames handed to the kernel
                unread["gathers"] += sent - c["sent"]
                c["sent"] = sent
            if ev & select.POLLIN and not c["answered"]:  # the server read a gather and sends it: left unread
                c["answered"] = True
                unread["answered"] += 1
            if ev & hangup:  # the server dropped it (its send timeout): open another in its place
                poller.unregister(fd)
                del conns[fd]
                reset(c["sock"])
                unread["dropped"] += 1
                reopen.append((c["resp"], time.time() + 0.2))
            else:
                watch(fd, c)
        now = time.time()
        for item in [r for r in reopen if r[1] <= now]:
            reopen.remove(item)
            open_unread(item[0])
    for c in conns.values():
        reset(c["sock"])
    unread_end = time.time()
    after_unread = drained(unread_end, start, len(conns))

    # -- departing clients: connect, HELLO, one 65,536-row gather, RST; 4 sessions x 8 connections a batch
    depart_start = time.time()
    round_s = max(1.0, (t_end - depart_start) / DEPART_ROUNDS)
    rounds = []
    for r in range(DEPART_ROUNDS):
        counts, base, lags = new_counts(), snapshot(), []
        t_round = time.time()
        while time.time() < t_round + round_s / 2:
            batch = []
            for resp in depart_sessions:
                for _ in range(FLOOD_CONNS):
                    sock = connect(resp, counts)
                    if sock is None:
                        continue
                    try:
                        sock.sendall(frames[(r + len(batch)) % len(frames)])
                        batch.append(sock)
                    except OSError:
                        counts["errors"] += 1
                        sock.close()
            until = time.monotonic() + 2.0  # the server has every gather's bytes: it parks each at once
            while any(unsent(s) for s in batch) and time.monotonic() < until:
                time.sleep(0.001)
            time.sleep(0.02)
            seen = snapshot()["disconnects"] + len(batch)
            t_reset = time.time()
            for s in batch:
                reset(s)
            counts["gathers"] += len(batch)
            # the next batch once the server saw these hang-ups (a BUSY then is a slot a departed client still
            # holds, not a hang-up still in the server's backlog): how long that took, at most HANGUP_WAIT_S
            while snapshot()["disconnects"] < seen and time.time() - t_reset < HANGUP_WAIT_S:
                time.sleep(0.005)
            lags.append(time.time() - t_reset)
        rounds.append(dict(counts, **drained(time.time(), base, counts["gathers"]), lags=lags))
    depart_end = time.time()
    stop.set()
    for call in streams:
        call.cancel()
    for resp in unread_sessions + depart_sessions:
        try:
            stub.CloseSession(pb.CloseSessionRequest(session_id=resp.session_id), timeout=5)
        except grpc.RpcError:
            pass
    channel.close()
    return {
        "kind": "disk_flood",
        "unread": unread,
        "after_unread": after_unread,
        "rounds": rounds,
        "start": start,
        "end": snapshot(),
        "windows": {"unread": (t_unread, unread_end), "departing": (depart_start, depart_end)},
    }


def pct(samples: list, lo: float, hi: float) -> tuple[float, float, int]:
    lat = np.array([d for t, d in samples if lo <= t < hi])
    if not lat.size:
        return float("nan"), float("nan"), 0
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6), lat.size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each half (default 20)")
    ap.add_argument("--rows", type=int, default=200_000, help=f"rows of the memory table ({ROW_BYTES} B each)")
    ap.add_argument("--disk-rows", type=int, default=200_000, help="rows of the disk table (default 200000)")
    ap.add_argument(
        "--disk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve a disk table beside the memory one, gather it too, and flood the disk tier (default on)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "soak.txt"))
    args = ap.parse_args()
    from tableserver.ops.demo_run import start_server

    lines = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    tables = [DemoTable(MEMORY_TABLE, args.rows, ROW_BYTES, 1)]
    flags = ["--hugepages", "off", "--session-open-rate", "20"]
    if args.disk:
        tables.append(DemoTable(DISK_TABLE, args.disk_rows, ROW_BYTES, 14))
        flags += ["--disk-tables", DISK_TABLE, "--disk-buffer-mib", str(DISK_BUFFER_MIB)]
    monitor: list = []  # (time, server RSS MiB, disk rows held bytes, disk gathers queued)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_file(os.path.join(tmp, "soak.bin"), tables, seed=5)
        proc, ready = start_server(path, tmp, flags, prefix=["prlimit", "--nofile=1024:1024"])
        stop_monitor = threading.Event()
        try:
            address, pid = ready["control"], proc.pid
            host, port = ready["tcp"].rsplit(":", 1)
            metrics = ready.get("metrics", "")

            def watch() -> None:
                while not stop_monitor.wait(0.25):
                    try:
                        m = scrape(metrics) if metrics else {}
                        monitor.append(
                            (time.time(), server_stats(pid)["rss_mib"], m.get(HELD, 0.0), m.get(QUEUED, 0.0))
                        )
                    except (OSError, ValueError, KeyError):
                        pass

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            before = server_stats(pid)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            t0 = time.time() + 3.0  # time for the clients to start
            t_mid, t_end = t0 + args.seconds, t0 + 2 * args.seconds
            procs = [
                ctx.Process(target=victim, args=(address, path, t, m, i, t_end, args.disk, q))
                for i, (t, m) in enumerate(CLIENTS)
            ]
            tcp = (host, int(port))
            procs.append(ctx.Process(target=flood, args=(address, tcp, ready["shm"], t_mid, t_end, q)))
            if args.disk:
                procs += [ctx.Process(target=probe, args=(address, path, t, t_end, q)) for t in PROBES]
                calm = len(CLIENTS) + len(PROBES)
                procs.append(ctx.Process(target=disk_flood, args=(address, tcp, pid, metrics, t_mid, t_end, calm, q)))
            for p in procs:
                p.start()
            while time.time() < t_mid - 0.5:
                time.sleep(0.1)
            middle = server_stats(pid)
            results = [q.get(timeout=2 * args.seconds + 4 * DRAIN_TIMEOUT_S + 120) for _ in procs]
            for p in procs:
                p.join(60)
            time.sleep(args.seconds / 4 + 6)  # evicted/timed-out peers and lapsed flood sessions go
            after = server_stats(pid)
        finally:
            stop_monitor.set()
            proc.terminate()
            proc.wait(60)
    by_kind = {k: [r for r in results if r["kind"] == k] for k in ("victim", "probe", "flood", "disk_flood")}
    flood_counts = by_kind["flood"][0]["flood"]
    clients, probes = by_kind["victim"], by_kind["probe"]
    checked = clients + probes
    rows = sum(r["rows"] for r in checked)
    bad = sum(r["bad"] for r in checked)
    failures = sum(r["failed"] for r in checked)
    errors = sorted({e for r in checked for e in r["errors"]})
    disk_part = (
        f"{args.disk_rows} rows on disk ({DISK_TABLE}: {DISK_BATCH}-row gathers by every victim; "
        f"{len(PROBES)} probes, {PROBE_ROWS} rows every {PROBE_EVERY_S * 1e3:g} ms)"
        if args.disk
        else "no disk table (--no-disk)"
    )
    say(
        f"soak: {len(clients)} client processes ({BATCH}-row gathers), 2 x {args.seconds:g} s, server under "
        f"LimitNOFILE=1024, {args.rows} rows x {ROW_BYTES} B in memory, {disk_part}"
    )
    say(f"flood (second half): {json.dumps(flood_counts)}")
    say(f"rows checked: {rows:,}   mismatches: {bad}   failed gathers: {failures}")
    for e in errors:
        say(f"  error: {e}")
    say()
    say(f"{'victims':<16}{'quiet p50':>11}{'p99 us':>9}{'n':>8}{'flood p50':>12}{'p99 us':>9}{'n':>8}{'p99 ratio':>11}")
    ratios = {}
    for kind in ("memory", "disk") if args.disk else ("memory",):
        for transport in ("shm", "tcp"):
            for mode in ("sync", "async"):
                samples = [
                    s for r in clients if r["transport"] == transport and r["mode"] == mode for s in r["samples"][kind]
                ]
                q50, q99, qn = pct(samples, t0, t_mid)
                f50, f99, fn = pct(samples, t_mid, t_end)
                label = f"{transport} {mode}" if kind == "memory" else f"disk {transport} {mode}"
                ratios[label] = f99 / q99
                say(f"{label:<16}{q50:>11.0f}{q99:>9.0f}{qn:>8}{f50:>12.0f}{f99:>9.0f}{fn:>8}{f99 / q99:>10.2f}x")
    probe_ratios = {}
    df = by_kind["disk_flood"][0] if args.disk else {}
    if "error" in df:
        say(f"\nthe disk flood could not run: {df['error']}")
    elif args.disk:
        unread_start = df["windows"]["unread"][0]
        windows = [("quiet", (t0, t_mid)), ("other floods", (t_mid, unread_start))]
        windows += [(WINDOWS[k], w) for k, w in df["windows"].items()]
        say()
        say(
            f"{PROBE_ROWS}-row disk gathers of a well-behaved client, us (the other floods run through the flood "
            f"half: their third alone is the reference for what the disk floods add)"
        )
        say(f"{'probe':<7}{'window':<24}{'p50':>8}{'p99':>9}{'n':>7}{'p99 / quiet':>13}{'/ other floods':>16}")
        for r in probes:
            quiet99 = pct(r["samples"], t0, t_mid)[1]
            floods99 = pct(r["samples"], t_mid, unread_start)[1]
            for name, (lo, hi) in windows:
                p50, p99, n = pct(r["samples"], lo, hi)
                vs_quiet = "" if name == "quiet" else f"{p99 / quiet99:.2f}x"
                vs_floods = f"{p99 / floods99:.2f}x" if name in WINDOWS.values() else ""
                if name in WINDOWS.values():
                    probe_ratios[f"{r['transport']} {name}"] = (p99 / quiet99, p99 / floods99)
                say(f"{r['transport']:<7}{name:<24}{p50:>8.0f}{p99:>9.0f}{n:>7}{vs_quiet:>13}{vs_floods:>16}")
        u = df["unread"]
        for r in [u, *df["rounds"]]:
            r["failed"] = r["challenge_busy"] + r["refused"] + r["errors"]  # refused at the CHALLENGE, or broke
        say()
        say(
            f"unread disk gathers: {FLOOD_SESSIONS} sessions x {FLOOD_CONNS} connections, {u['gathers']} gathers of "
            f"{FLOOD_ROWS:,} rows sent and never read; HELLOs {u['hellos']}, refused BUSY {u['busy']}, other "
            f"failures {u['failed']}; connections answered (the server read a flood gather) {u['answered']} of "
            f"{u['hellos'] - u['busy'] - u['failed']}, dropped by the server {u['dropped']}"
        )
        say(
            f"departing clients: connect, HELLO, one {FLOOD_ROWS:,}-row disk gather, RST; {FLOOD_SESSIONS} sessions x "
            f"{FLOOD_CONNS} connections a batch, the next once the server saw the last leave (<= "
            f"{HANGUP_WAIT_S * 1e3:.0f} ms); after each round the server drains (<= {calm} disk gathers queued, no flood "
            f"gather's rows held)"
        )
        say(
            f"{'phase':<16}{'HELLOs':>8}{'BUSY':>6}{'failed':>8}{'gathers':>9}{'drained in':>12}{'RSS MiB':>9}"
            f"{'held MiB':>10}{'cancelled':>11}{'disconnects':>13}{'hang-ups seen in, ms':>22}"
        )
        say(f"{'quiet':<16}{'':>43}{middle['rss_mib']:>9.0f}")
        prev = df["start"]
        phases = [("unread flood", dict(df["unread"], **df["after_unread"]))]
        phases += [(f"departing {i + 1}", r) for i, r in enumerate(df["rounds"])]
        for label, r in phases:
            drain = f"{r['drain_s']:.2f} s" + ("" if r["drained"] else "+")  # +: not drained when it gave up
            lags = np.array(r.get("lags") or [np.nan]) * 1e3  # per batch: reset to the server counting it
            seen = f"p50 {np.median(lags):.0f}, max {lags.max():.0f}" if "lags" in r else ""
            say(
                f"{label:<16}{r['hellos']:>8}{r['busy']:>6}{r['failed']:>8}{r['gathers']:>9}"
                f"{drain:>12}{r['rss_mib']:>9.0f}{r['held'] / 2**20:>10.1f}{r['cancelled'] - prev['cancelled']:>11.0f}"
                f"{r['disconnects'] - prev['disconnects']:>13.0f}{seen:>22}"
            )
            prev = r
        busy = sum(r["busy"] for r in df["rounds"])
        hellos = sum(r["hellos"] for r in df["rounds"])
        say()
        quiet_rss = [s[1] for s in monitor if t0 <= s[0] < t_mid] or [middle["rss_mib"]]
        base = float(np.median(quiet_rss))
        say(f"{'server (disk tier)':<24}{'RSS MiB max':>12}{'growth':>9}{'rows held MiB max':>19}{'queued max':>12}")
        for name, (lo, hi) in windows:
            w = [s for s in monitor if lo <= s[0] < hi]
            if not w:
                continue
            rss_max = max(s[1] for s in w)
            say(
                f"{name:<24}{rss_max:>12.0f}{rss_max - base:>+9.0f}{max(s[2] for s in w) / 2**20:>19.1f}"
                f"{max(s[3] for s in w):>12.0f}"
            )
        say(
            f"(disk buffer budget {DISK_BUFFER_MIB} MiB, a session's share {DISK_BUFFER_MIB // 8} MiB; "
            f"one flood gather's rows {FLOOD_ROWS * ROW_BYTES / 2**20:.1f} MiB)"
        )
    say()
    say(f"{'server':<8}{'before':>10}{'quiet':>10}{'after':>10}")
    for key in ("fds", "threads", "rss_mib"):
        say(f"{key:<8}{before[key]:>10.0f}{middle[key]:>10.0f}{after[key]:>10.0f}")
    ok = bad == 0 and failures == 0 and "error" not in df
    verdict = (
        f"\n{'PASS' if ok else 'FAIL'}: {bad} mismatches, {failures} failed gathers; worst victim p99 ratio "
        f"{max(ratios.values()):.2f}x (goal <= 2x)"
    )
    if probe_ratios:
        verdict += (
            f"; {PROBE_ROWS}-row disk probe under the disk floods: worst p99 {max(v[0] for v in probe_ratios.values()):.2f}x "
            f"quiet (goal <= 2x), {max(v[1] for v in probe_ratios.values()):.2f}x the other floods alone; "
            f"departing HELLOs refused BUSY {busy} of {hellos}"
        )
    verdict += (
        f"; fds {before['fds']} -> {after['fds']}, threads {before['threads']} -> {after['threads']}, "
        f"RSS {before['rss_mib']:.0f} -> {after['rss_mib']:.0f} MiB"
    )
    say(verdict)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
