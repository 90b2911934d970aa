"""The test daemons' zygote (tests/support/zygote.py): a forked ``python -m tableserver`` says, exits and is seen as
an exec'd one does. The suite's other tests run their daemons through it; these compare it with an exec."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, ZYGOTE, run_cli, start_daemon
from tableclient import TableClient
from zygote import Forked

from tableserver.ops.demo_run import serve_command


def stamped(line: str) -> str:
    """A log line less its time, pid and ports (``2026-12-08T01:33:19.210Z tableserver[13038] ... :39029``)."""
    return re.sub(r":\d+\b", ":PORT", re.sub(r"^\S+ tableserver\[\d+\] ", "", line))


def both(monkeypatch, *args) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """``run_cli(*args)`` forked, then exec'd."""
    forked = run_cli(*args)
    monkeypatch.setenv("TABLESERVER_TEST_ZYGOTE", "0")
    execd = run_cli(*args)
    monkeypatch.delenv("TABLESERVER_TEST_ZYGOTE")
    return forked, execd


@pytest.mark.parametrize(
    "args",
    [
        ("--version",),
        ("inspect", "{demo}"),
        ("--no-such-flag",),
        ("--tables", "{missing}", "--listen", "127.0.0.1:0", "--metrics-port", "off"),
    ],
)
def test_a_forked_cli_prints_and_exits_as_an_execd_one(monkeypatch, demo_file, tmp_path, args):
    args = [a.format(demo=demo_file, missing=tmp_path / "missing.bin") for a in args]
    forked, execd = both(monkeypatch, *args)
    assert (forked.returncode, forked.stdout) == (execd.returncode, execd.stdout)
    assert [stamped(line) for line in forked.stderr.splitlines()] == [
        stamped(line) for line in execd.stderr.splitlines()
    ]


def test_a_forked_daemon_serves_stops_on_sigterm_and_reports_a_kill(demo_file, demo_local, tmp_path):
    d = start_daemon(str(tmp_path / "a"), "--tables", demo_file)
    assert isinstance(d.proc, Forked)  # what the rest of the suite gets
    assert os.readlink(f"/proc/{d.proc.pid}/cwd") == ROOT
    with TableClient(d.address, transport="tcp") as c:
        assert bytes(c.table("tiny").gather([0])[0]) == bytes(demo_local["tiny"][0])
    assert d.proc.poll() is None
    assert d.stop() == 0  # SIGTERM: drained, exit 0, as exec'd
    k = start_daemon(str(tmp_path / "b"), "--tables", demo_file)
    assert k.stop(signal.SIGKILL) == -signal.SIGKILL  # as subprocess reports a signal
    assert k.proc.wait(0) == -signal.SIGKILL


def test_only_what_a_fork_runs_alike_is_forked(monkeypatch):
    cmd = serve_command("/r/ready.json", "--tables", "t.bin")
    assert ZYGOTE.forkable(cmd, None)
    assert not ZYGOTE.forkable(["prlimit", "--as=1", *cmd], None)  # a wrapper execs
    assert not ZYGOTE.forkable([sys.executable, "-c", "pass"], None)
    assert not ZYGOTE.forkable(cmd, {**os.environ, "TABLESERVER_NATIVE_TAKE": "0"})  # read at import
    assert ZYGOTE.forkable(cmd, {**os.environ, "SOME_OTHER": "1"})
    monkeypatch.setenv("TABLESERVER_TEST_ZYGOTE", "0")
    assert not ZYGOTE.forkable(cmd, None)
