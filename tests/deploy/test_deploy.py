"""Deployment hooks (issue 13): systemd notify protocol on a real notify socket, plaintext probes."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request

from conftest import EVENT_TIMEOUT


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=EVENT_TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_systemd_notify_protocol(fresh_daemon, tmp_path):
    """Type=notify: STATUS while loading, READY=1 once SERVING, WATCHDOG=1 pings when WatchdogSec is set,
    STOPPING=1 on SIGTERM, all on a real AF_UNIX datagram socket as systemd provides it."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(EVENT_TIMEOUT)
    messages: list[str] = []
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    d = fresh_daemon(env=env)

    def got(text: str) -> bool:
        while not any(text in m for m in messages):
            messages.append(sock.recv(4096).decode())
        return True

    assert got("STATUS=loading")
    assert got("READY=1")
    assert any("STATUS=serving" in m for m in messages if "READY=1" in m)
    assert got("WATCHDOG=1")
    assert messages.index(next(m for m in messages if "READY=1" in m)) > 0  # loading came first
    d.stop()
    assert got("STOPPING=1")
    sock.close()


def test_readyz_and_livez(fresh_daemon):
    d = fresh_daemon()
    base = f"http://{d.ready['metrics']}"
    assert _get(base + "/readyz") == (200, "SERVING\n")
    assert _get(base + "/livez") == (200, "alive\n")
    assert "tableserver_serving 1.0" in _get(base + "/metrics")[1]


def test_probe_answers_follow_the_server_state():
    """What /readyz and /livez answer for each state, on a metrics endpoint of its own bound to stand-in state (the
    daemon's states are tested above and in test_connections, where a port that cannot accept turns health
    NOT_SERVING)."""
    import time
    from types import SimpleNamespace

    from tableserver.metrics import LIVENESS_S, ServerMetrics

    m = ServerMetrics()
    base = f"http://127.0.0.1:{m.serve('127.0.0.1', 0)}"
    try:
        m.bind(
            SimpleNamespace(
                state=SimpleNamespace(ready=False, unready_reason="tables are still loading"),
                heartbeat=time.monotonic(),
            )
        )
        assert _get(base + "/readyz") == (503, "NOT_SERVING: tables are still loading\n")
        assert _get(base + "/livez") == (200, "alive\n")
        m.bind(
            SimpleNamespace(
                state=SimpleNamespace(ready=True, unready_reason=""), heartbeat=time.monotonic() - LIVENESS_S - 5
            )
        )
        assert _get(base + "/readyz") == (200, "SERVING\n")
        status, text = _get(base + "/livez")
        assert status == 503 and "has not run for" in text
    finally:
        m.close()


def _memory_cgroup(tmp_name: str):
    """(a fresh memory cgroup, the file that limits it), v1 or v2; or None."""
    from tests_helpers import make_cgroup

    made = make_cgroup("memory", tmp_name)
    return None if made is None else (made[0], "memory.limit_in_bytes" if made[1] == "v1" else "memory.max")


def test_a_cgroup_memory_limit_fails_before_loading(tmp_path):
    """The host has the memory, the pod's cgroup does not: one line naming the cgroup and the knob, exit 1,
    before any table is allocated (no OOM kill or SIGBUS half-way through a load)."""
    import subprocess
    import sys

    import pytest
    from conftest import ROOT
    from tests_helpers import assert_one_line_error

    from tableserver.tables.demo import DemoTable, write_demo_file

    made = _memory_cgroup(f"tableserver-test-{os.getpid()}")
    if made is None:
        pytest.skip("no writable memory cgroup on this machine")
    group, knob = made
    try:
        with open(os.path.join(group, knob), "w") as f:
            f.write(str(64 << 20))
        table = write_demo_file(str(tmp_path / "t.bin"), [DemoTable("engram.layer1", 400_000, 264, 1)])  # 100 MiB
        cmd = [
            "sh",
            "-c",
            f'echo $$ > {group}/cgroup.procs && exec "$@"',
            "sh",
            sys.executable,
            "-m",
            "tableserver",
            "--tables",
            table,
            "--listen",
            "127.0.0.1:0",
            "--hugepages",
            "off",
            "--shm-socket",
            str(tmp_path / "s.sock"),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=EVENT_TIMEOUT, cwd=ROOT)
        assert_one_line_error(
            res, f"cgroup /{os.path.basename(group)} allows", knob, "raise it (Kubernetes: resources.limits.memory"
        )
        assert "loaded" not in res.stderr  # refused before any table was allocated
    finally:
        os.rmdir(group)


def test_the_systemd_unit_verifies(tmp_path):
    """deploy/tableserver.service passes `systemd-analyze verify` (ExecStart pointed at this venv)."""
    import shutil
    import subprocess
    import sys

    import pytest
    from conftest import ROOT

    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    unit = open(os.path.join(ROOT, "deploy", "tableserver.service")).read()
    assert "Type=notify" in unit and "LimitNOFILE=" in unit and "WatchdogSec=" in unit
    exe = os.path.join(os.path.dirname(sys.executable), "tableserver")
    path = tmp_path / "tableserver.service"
    path.write_text(unit.replace("/opt/tableserver/.venv/bin/tableserver", exe))
    res = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True, timeout=EVENT_TIMEOUT)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


def _doctor(*args, prefix=()):
    import subprocess
    import sys

    from conftest import ROOT

    res = subprocess.run(
        [*prefix, sys.executable, "-m", "tableserver", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=EVENT_TIMEOUT,
        cwd=ROOT,
    )
    lines = {line[6:].split(":", 1)[0]: line for line in res.stdout.splitlines()}
    return res, lines


def test_doctor_names_each_problem_and_its_fix(tmp_path, demo_file):
    """Each FAIL the doctor can print, made real: a locked-memory limit without CAP_IPC_LOCK, hugepages that
    are not reserved, a cgroup memory limit, no RDMA device, a port in use, a missing table file."""
    import shutil

    import pytest

    base = ("--tables", demo_file, "--hugepages", "off", "--listen", "127.0.0.1:0", "--metrics-port", "off")
    res, lines = _doctor(*base)
    assert res.returncode == 0 and not any(v.startswith("FAIL") for v in lines.values()), res.stdout
    assert lines["tables"].startswith("ok") and lines["memory plan"].startswith("ok")

    if shutil.which("setpriv"):  # root without CAP_IPC_LOCK, under a 64 KiB lock limit
        res, lines = _doctor(
            *base,
            prefix=("setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", "prlimit", "--memlock=65536:65536"),
        )
        assert res.returncode == 1 and lines["memlock"].startswith("FAIL"), res.stdout
        assert "ulimit -l unlimited" in lines["memlock"]

    from tableserver.tables.memory import HUGE_1G, free_hugepages

    if free_hugepages(HUGE_1G) == 0:
        res, lines = _doctor(*base, "--hugepages", "1g")
        assert (
            res.returncode == 1 and lines["memory plan"].startswith("FAIL") and "reserve them" in lines["memory plan"]
        )
        assert lines["hugepages"].startswith("FAIL")

    made = _memory_cgroup(f"tableserver-doctor-{os.getpid()}")
    if made is not None:
        group, knob = made
        from tableserver.tables.demo import DemoTable, write_demo_file

        big = write_demo_file(str(tmp_path / "big.bin"), [DemoTable("engram.layer1", 800_000, 264, 1)])  # 201 MiB
        try:
            with open(os.path.join(group, knob), "w") as f:
                f.write(str(160 << 20))  # room for the doctor itself, not for the tables
            res, lines = _doctor(
                "--tables", big, *base[2:], prefix=("sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh")
            )
            assert (
                lines["memory plan"].startswith("FAIL") and f"cgroup /{os.path.basename(group)}" in lines["memory plan"]
            ), res.stdout
        finally:
            os.rmdir(group)

    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        res, lines = _doctor(*base, "--transports", "rdma")
        assert res.returncode == 1 and lines["rdma devices"].startswith("FAIL"), res.stdout

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        res, lines = _doctor(
            "--tables", demo_file, "--hugepages", "off", "--listen", f"127.0.0.1:{port}", "--metrics-port", "off"
        )
        assert res.returncode == 1 and lines["ports"].startswith("FAIL") and "already in use" in lines["ports"]

    res, lines = _doctor("--tables", str(tmp_path / "missing.bin"), "--hugepages", "off")
    assert res.returncode == 1 and lines["tables"].startswith("FAIL") and "not found" in lines["tables"]
    if made is None:
        pytest.skip("no writable memory cgroup here: the cgroup FAIL was not made")
