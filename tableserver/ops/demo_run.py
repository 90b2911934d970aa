"""``tableserver demo``: the main job on a built-in default, end to end.

Generates (once, cached) the Engram-shaped demo table file, starts a real
``tableserver`` daemon on loopback, and runs the client's replay
(client/tableclient/demo.py, ``python -m tableclient.demo``) against it in a
subprocess: every step issues layer 1's and layer 14's gathers at step start
(shortest window first), 24 rows per token per layer, then waits for each. It
prints gather latency p50/p99 per layer against the layer's window and checks
sampled steps bit-exact against the file. This side is the daemon's: the
client runs in its own process, so the daemon never imports it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from tableserver.common.model import ROWS_PER_TOKEN
from tableserver.errors import TableServerError
from tableserver.tables.demo import DEFAULT_ROWS, default_tables, write_demo_file
from tableserver.tables.progress import Progress

#: how long the demo server may take to become SERVING (load the tables) before the demo gives up
READY_TIMEOUT_S = 300
#: how often the demo polls for the server's ready file
READY_POLL_S = 0.05
#: how long the demo server may take to exit once told to
STOP_TIMEOUT_S = 30
#: how often generating the demo file reports progress (seconds)
PROGRESS_INTERVAL_S = 2.0
#: the client half of the demo (run with this interpreter)
CLIENT_MODULE = "tableclient.demo"
#: what the client half's error line starts with (client/tableclient/demo.py: ERROR_PREFIX)
CLIENT_ERROR_PREFIX = CLIENT_MODULE + ": error: "


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "tableserver")
    os.makedirs(path, exist_ok=True)
    return path


def ensure_demo_file(rows: int | None = None, path: str | None = None) -> str:
    """The cached demo table file, generated if missing or unreadable."""
    from tableserver.tables.tablefile import read_header

    rows = rows or DEFAULT_ROWS
    path = path or os.path.join(cache_dir(), f"demo-engram-{rows}.bin")
    try:
        read_header(path)
        return path
    except TableServerError:
        pass
    tables = default_tables(rows)
    print(f"generating demo tables {path} ({', '.join(t.name for t in tables)}) ...", flush=True)
    bar = Progress(sum(t.rows * t.row_bytes for t in tables), "generating", interval=PROGRESS_INTERVAL_S)
    write_demo_file(path, tables, progress=bar.update)
    bar.finish()
    return path


def serve_command(ready_file: str, *flags: str, prefix: Sequence[str] = ()) -> list[str]:
    """``python -m tableserver serve`` that writes ``ready_file`` once it serves and draws no progress, then
    ``flags`` (a later flag wins); ``prefix`` is a wrapper that execs it (e.g. prlimit)."""
    serve = [sys.executable, "-m", "tableserver", "serve", "--ready-file", ready_file, "--progress", "never"]
    return [*prefix, *serve, *flags]


def start_server(
    table: str, ready_dir: str, extra: list[str] = (), prefix: list[str] = ()
) -> tuple[subprocess.Popen, dict]:
    """The daemon serving ``table`` on free ports; ``prefix`` runs it under a wrapper that execs it
    (e.g. prlimit), so the process is still the daemon's."""
    ready = os.path.join(ready_dir, "ready.json")
    log = open(os.path.join(ready_dir, "server.log"), "w+")
    cmd = serve_command(ready, "--tables", table, "--listen", "127.0.0.1:0", *extra, prefix=prefix)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not os.path.exists(ready):
        if proc.poll() is not None:
            log.seek(0)
            raise TableServerError(f"the demo server exited ({proc.returncode}): {log.read().strip()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TableServerError(f"the demo server did not become ready in {READY_TIMEOUT_S} s")
        time.sleep(READY_POLL_S)
    with open(ready) as f:
        return proc, json.load(f)


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (the benches' and tests' frozen server):
    the signal is asynchronous, and a thread already running can still answer a request after ``kill``
    returns. TableServerError if it has not stopped within ``timeout`` seconds."""
    import signal

    def stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that just exited
                continue
        return bool(states) and all(s in ("T", "t") for s in states)

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not stopped():
        if time.monotonic() > deadline:
            raise TableServerError(f"process {pid} did not stop within {timeout:g} s of SIGSTOP")
        time.sleep(0.001)


def page_note(page_sizes: dict) -> str:
    """What page size the tables sit on, and how to get hugepages when they are on 4 KiB pages."""
    smallest = min(page_sizes.values(), default=0)
    if not smallest:
        return ""
    if smallest >= 1 << 30:
        return "tables on 1 GiB hugepages"
    if smallest >= 2 << 20:
        return (
            f"tables on {smallest >> 20} MiB hugepages (1 GiB pages, as production uses, shorten the tail of a "
            "gather after an idle gap:\nreserve them at boot with hugepagesz=1G hugepages=N, or now with echo N > "
            "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages)"
        )
    return (
        "tables on 4 KiB pages: random row gathers run at ~0.6-0.8x their hugepage speed (TLB misses); for the\n"
        "production setup reserve hugepages first -- 1 GiB ones at boot (hugepagesz=1G hugepages=N), or 2 MiB ones\n"
        "now: echo N > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages (N = table bytes / 2 MiB, plus a\n"
        "few) -- then the server picks them (--hugepages auto)"
    )


def run_client(control: str, path: str, tables, steps: int, batch: int, transports) -> None:
    """Runs the client half (``python -m tableclient.demo``) against the server at ``control``: it prints
    the latency table; TableServerError with its error line when it fails."""
    cmd = [sys.executable, "-m", CLIENT_MODULE, "--control", control, "--file", path]
    for t in tables:
        cmd += ["--table", f"{t.name}:{t.offset}:{t.rows}:{t.row_bytes}"]
    cmd += ["--steps", str(steps), "--batch", str(batch), "--transports", ",".join(transports)]
    sys.stdout.flush()  # what this side printed comes before the client's lines
    res = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if res.returncode == 0:
        sys.stderr.write(res.stderr)
        return
    lines = res.stderr.strip().splitlines()
    why = lines[-1].removeprefix(CLIENT_ERROR_PREFIX) if lines else f"exit status {res.returncode}"
    raise TableServerError(why)


def run_demo(
    rows: int | None = None, steps: int = 200, batch: int = 64, transports=("shm", "tcp"), table: str | None = None
) -> int:
    from tableserver.tables.tablefile import read_header

    path = table or ensure_demo_file(rows)
    header = read_header(path)
    with tempfile.TemporaryDirectory(prefix="tableserver-demo-") as tmp:
        proc, ready = start_server(path, tmp)
        try:
            print(
                f"server pid {proc.pid} SERVING {len(ready['tables'])} tables in {ready['time_to_serving_s']:.2f} s "
                f"on {ready['control']}; replaying {steps} decode steps, batch {batch} "
                f"({batch * ROWS_PER_TOKEN} rows/layer/step)"
            )
            print(page_note(ready.get("page_sizes", {})) + "\n")
            run_client(ready["control"], os.path.abspath(path), header.tables, steps, batch, transports)
        finally:
            proc.terminate()
            proc.wait(timeout=STOP_TIMEOUT_S)
    return 0
