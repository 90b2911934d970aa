"""Shared fixtures: demo table files and real tableserver daemons on loopback.

Every integration test talks to a real ``python -m tableserver`` subprocess
over real sockets; expected rows always come from the table file itself
(``np.memmap``), i.e. a local ``table[row_ids]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from tableserver.demo import DemoTable, write_demo_file
from tableserver.tablefile import read_header

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_GUEST = os.environ.get("TABLESERVER_IN_GUEST") == "1"

# tests/rdma needs a verbs device: it runs inside the Soft-RoCE guest (tests/test_rdma_guest.py
# boots it), never directly on the host, where it would only skip.
collect_ignore = [] if IN_GUEST else ["rdma"]


def local_tables(path: str) -> dict[str, np.ndarray]:
    """Every table of a file as a read-only ``[rows, row_bytes]`` array."""
    header = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return {s.name: mm[s.offset:s.offset + s.nbytes].reshape(s.rows, s.row_bytes) for s in header.tables}


@dataclass
class Daemon:
    proc: subprocess.Popen
    workdir: str
    ready: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.ready["control"]

    def log(self) -> str:
        with open(os.path.join(self.workdir, "server.log"), errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_cli(*args, env=None, timeout: float = 120, preexec=None) -> subprocess.CompletedProcess:
    """Runs ``python -m tableserver ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "tableserver", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=preexec, cwd=ROOT)


def start_daemon(workdir: str, *args, env=None, wait: bool = True, timeout: float = 180,
                 prefix: tuple = ()) -> Daemon:
    os.makedirs(workdir, exist_ok=True)
    ready = os.path.join(workdir, "ready.json")
    if os.path.exists(ready):
        os.unlink(ready)
    log = open(os.path.join(workdir, "server.log"), "w")
    cmd = [*prefix, sys.executable, "-m", "tableserver", "serve", "--listen", "127.0.0.1:0", "--ready-file", ready,
           "--progress", "never", "--shm-socket", os.path.join(workdir, "shm.sock"), *args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    d = Daemon(proc, workdir)
    if not wait:
        return d
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise RuntimeError(f"tableserver exited {proc.returncode}:\n{d.log()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"tableserver not ready after {timeout} s:\n{d.log()}")
        time.sleep(0.02)
    with open(ready) as f:
        d.ready = json.load(f)
    return d


SMALL_TABLES = [
    DemoTable("engram.layer1", 50_000, 264, 1),
    DemoTable("engram.layer14", 70_001, 264, 14),
    DemoTable("dense.f32", 3_001, 4 * 96, -1),
    DemoTable("tiny", 1, 8, -1),
]


@pytest.fixture(scope="session")
def demo_file(tmp_path_factory) -> str:
    """A small demo table file: two Engram tables plus odd row sizes."""
    path = str(tmp_path_factory.mktemp("tables") / "demo.bin")
    return write_demo_file(path, SMALL_TABLES, seed=7)


@pytest.fixture(scope="session")
def demo_local(demo_file) -> dict[str, np.ndarray]:
    return local_tables(demo_file)


@pytest.fixture(scope="session")
def daemon(demo_file, tmp_path_factory):
    """One shared server over the small demo file (shm + tcp)."""
    d = start_daemon(str(tmp_path_factory.mktemp("daemon")), "--tables", demo_file, "--lease-seconds", "5")
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(demo_file, tmp_path):
    """A server of the test's own, for tests that disturb it."""
    started = []

    def make(*args, **kw):
        d = start_daemon(str(tmp_path / f"d{len(started)}"), "--tables", demo_file, *args, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
