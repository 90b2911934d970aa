"""Shared fixtures: demo table files and real tableserver daemons on loopback.

Every integration test talks to a real ``python -m tableserver`` process
over real sockets; expected rows always come from the table file itself
(``np.memmap``), i.e. a local ``table[row_ids]``. The daemons fork from a
process that imported the daemon once (``ZYGOTE``, tests/support/zygote.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

# The helpers every kind of test shares (daemon fixtures' helpers, the engines' CPU setups, scripted peers)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import guest_alone  # noqa: E402
from zygote import Zygote  # noqa: E402

from tableserver.ops.demo_run import serve_command  # noqa: E402
from tableserver.tables.demo import DemoTable, write_demo_file  # noqa: E402
from tableserver.tables.tablefile import read_header  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: test daemons and CLI runs forked from one process that imported the daemon (tests/support/zygote.py)
ZYGOTE = Zygote(ROOT)
IN_GUEST = os.environ.get("TABLESERVER_IN_GUEST") == "1"
# Without an NVIDIA GPU every Triton kernel here runs in Triton's interpreter, which Triton must be told
# before anything imports it: the graph's row kernel (tests/daemon) and the engines' own kernels share a
# worker process under xdist, and Triton's library functions decorated in compiled mode never interpret.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: The kinds of tests, one folder each; a test gets its folder's marker (``pytest -m unit`` runs one kind).
KINDS = ("unit", "daemon", "engines", "host", "deploy", "gpu")
#: the kinds whose modules import an engine
ENGINE_KINDS = ("engines", "gpu")


def _kind(path) -> str:
    return os.path.relpath(str(path), os.path.dirname(os.path.abspath(__file__))).split(os.sep)[0]


def pytest_collect_file(file_path, parent):
    """Where vLLM is installed, its kernels run in Triton's interpreter on a CPU-only machine
    (tests/support/vllm_cpu.py). Triton has to be in that mode before anything imports it, so before the
    first engine test module is collected: SGLang's modules import Triton too, and Triton's own library
    functions decorated before would not run interpreted. A run without engine tests never pays for it."""
    if (
        not IN_GUEST
        and _kind(file_path) in ENGINE_KINDS
        and "vllm_cpu" not in sys.modules
        and importlib.util.find_spec("vllm") is not None
    ):
        import vllm_cpu  # noqa: F401


def pytest_collection_modifyitems(config, items):
    """Each test gets its kind's marker; files with a slow test go first (a stable sort: the order inside a
    file stays), so that spread over workers a file at a time (make test) the longest files start first."""
    slow_files = set()
    for item in items:
        if _kind(item.path) in KINDS:
            item.add_marker(_kind(item.path))
        if item.get_closest_marker("slow"):
            slow_files.add(item.path)
    items.sort(key=lambda item: item.path not in slow_files)
    if IN_GUEST:
        guest_alone.order(items)


def pytest_runtest_logstart(nodeid, location):
    if IN_GUEST:
        guest_alone.starting(nodeid)


#: The bound on any wait for an event (a log line, a metric, a socket state, a process exit). Generous on
#: purpose: each wait ends as soon as its event happens, so a busy machine makes a test slower, never red.
EVENT_TIMEOUT = float(os.environ.get("TABLESERVER_TEST_EVENT_TIMEOUT", "600"))
#: Session lease of the test daemons: far longer than a starved client's keepalive can be late.
TEST_LEASE = "120"
#: How long the test daemons keep a session that never binds a keepalive stream: tests open raw
#: sessions without one (tests_helpers.open_raw_session) and must not lose them on a busy machine.
TEST_BIND_TIMEOUT = "3600"

# tests/rdma needs a verbs device: it runs inside the Soft-RoCE guest (tests/host/test_rdma_guest.py
# boots it), never directly on the host, where it would only skip.
collect_ignore = [] if IN_GUEST else ["rdma"]


_SUMMARY: list[str] = []


def summary_line(text: str) -> None:
    """A line for the end of the test run's output (e.g. what the Soft-RoCE guest ran), shown even with -q."""
    _SUMMARY.append(text)


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)


def wait_for(condition, what, timeout: float = EVENT_TIMEOUT, interval: float = 0.05):
    """Polls ``condition()`` until it returns something true (and returns that), at most ``timeout`` s.

    ``what`` names the event (a string, or a callable giving details such as a log) for the failure.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what() if callable(what) else what}")
        time.sleep(interval)


def local_tables(path: str) -> dict[str, np.ndarray]:
    """Every table of a file as a read-only ``[rows, row_bytes]`` array."""
    header = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return {s.name: mm[s.offset : s.offset + s.nbytes].reshape(s.rows, s.row_bytes) for s in header.tables}


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

    def stop(self, sig=signal.SIGTERM, timeout: float = EVENT_TIMEOUT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def run_cli(*args, env=None, timeout: float = EVENT_TIMEOUT, preexec=None) -> subprocess.CompletedProcess:
    """Runs ``python -m tableserver ARGS`` to completion (forked from the zygote where it can be)."""
    cmd = [sys.executable, "-m", "tableserver", *args]
    if preexec is None and ZYGOTE.forkable(cmd, env):
        with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            open(err, "w").close()
            proc = ZYGOTE.spawn(cmd, out, err, env, ROOT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            with open(out) as o, open(err) as e:
                return subprocess.CompletedProcess(cmd, proc.returncode, o.read(), e.read())
    return subprocess.run([sys.executable, "-m", "tableserver", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, preexec_fn=preexec, cwd=ROOT)  # fmt: skip


def start_daemon(
    workdir: str, *args, env=None, wait: bool = True, timeout: float = EVENT_TIMEOUT, prefix: tuple = ()
) -> Daemon:
    os.makedirs(workdir, exist_ok=True)
    ready = os.path.join(workdir, "ready.json")
    if os.path.exists(ready):
        os.unlink(ready)
    log = open(os.path.join(workdir, "server.log"), "w")
    # a later flag wins: a test may pass its own --lease-seconds, --session-bind-timeout
    cmd = serve_command(
        ready, "--listen", "127.0.0.1:0", "--shm-socket", os.path.join(workdir, "shm.sock"),
        "--lease-seconds", TEST_LEASE, "--session-bind-timeout", TEST_BIND_TIMEOUT,
        *args, prefix=prefix,
    )  # fmt: skip
    if ZYGOTE.forkable(cmd, env):
        log.close()
        proc = ZYGOTE.spawn(cmd, log.name, log.name, env, ROOT)
    else:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    d = Daemon(proc, workdir)
    if not wait:
        return d
    try:
        wait_for(
            lambda: os.path.exists(ready) or proc.poll() is not None,
            lambda: f"tableserver to be ready:\n{d.log()}",
            timeout,
            interval=0.02,
        )
    except AssertionError:
        proc.kill()
        raise
    if not os.path.exists(ready):
        raise RuntimeError(f"tableserver exited {proc.returncode}:\n{d.log()}")
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
    d = start_daemon(str(tmp_path_factory.mktemp("daemon")), "--tables", demo_file)
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
