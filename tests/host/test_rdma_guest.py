"""Runs the RDMA suite (tests/rdma) on kernel Soft-RoCE inside a QEMU guest.

The guest boots Debian's kernel under TCG, chroots into this machine's
filesystem over 9p (same checkout, same venv), creates rxe_lo and runs pytest
on tests/rdma. This test passes only if the guest ran every RDMA test and all
passed: none may be skipped. Where the guest cannot run (not root and the
Debian packages missing) it skips with one line naming what is missing.

The guest has two vCPUs and its suite is mostly one process at a time (a daemon's start, a client's imports),
so it runs as two pytest processes at once, one per vCPU (processes()): "side" runs its share (SIDE), then the
tests that time a spinning thread against a tight deadline (ALONE) with the guest to itself, once "rest" (every
other test) has ended. Each process writes a junit report of its own; this test adds them up. Their
daemons fork from one process that imported the daemon (tests/support/zygote.py), as on the host.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from conftest import EVENT_TIMEOUT, ROOT, summary_line

sys.path.insert(0, os.path.join(ROOT, "tests", "rdma"))
import vm  # noqa: E402

MIN_TESTS = 32
#: The suite takes 6-16 minutes in the guest (TCG); a host busy with other tests can make it several times
#: slower, and every wait in it is bounded by conftest.EVENT_TIMEOUT. This bound only catches a hung guest.
GUEST_TIMEOUT_S = 3600
#: A guest test running this long has every thread's traceback dumped on the console (the test goes on):
#: where a guest that hangs was waiting.
GUEST_TRACEBACK_AFTER_S = 900
#: failures shown in full (the rest by name)
SHOWN_FAILURES = 5

RDMA_DIR = os.path.join("tests", "rdma")
#: The tests of these files run last in the first pytest process ("side"), with the guest to themselves once the
#: second ("rest") has ended (tests/support/guest_alone.py): they bound how late a spinning thread is released
#: after its deadline (tests/rdma/test_graphpoll_rdma.py's RELEASE_SLACK_S, 50 ms), which a test process on the
#: other vCPU would eat into. Less their tests SIDE names: those run in side beside the rest.
ALONE = ("test_graphpoll_rdma.py",)
#: What "side" runs beside the rest (whole files, or single tests ``file::name``); "rest" runs every other file, new
#: files and tests included, less the single tests named here. The tests that import torch are all here (the
#: GraphStep's staging: its import takes a guest's vCPU over a minute under TCG), so one process pays for it; the
#: rest evens out the two by the guest's timings. A name here that no longer exists fails at once (check_phases);
#: its test would otherwise run in whatever process runs its file.
SIDE = (
    "test_rdma.py::test_table_with_offsets_over_4gib",
    "test_rdma.py::test_a_verbs_error_on_first_use_fails_over_to_a_replica",
    "test_graphpoll_rdma.py::test_in_graph_layers_read_over_rdma_by_the_native_poller_bit_exact",
    "test_graphpoll_rdma.py::test_without_its_rdma_source_the_python_poller_serves_and_the_start_up_log_says_why",
    "test_graphpoll_rdma.py::test_the_native_poller_connects_again_after_its_node_restarts",
    "test_qp_sessions.py::test_a_graph_step_behind_a_shared_address_never_gets_another_daemons_rows",
    "test_graphpoll_sources_rdma.py",
)
#: the file that tells the side process the rest has ended (tests/support/guest_alone.py)
REST_DONE = "rest-done"


def _tests_in(path: str) -> list[str]:
    with open(path) as f:
        return re.findall(r"^(?:async )?def (test_\w+)\(", f.read(), re.M)


def check_phases(rdma_dir: str = RDMA_DIR, alone=ALONE, side=SIDE) -> list[str]:
    """Why the two processes would not run every test of ``rdma_dir`` exactly once (empty when they do): a file
    or test named in ``alone`` or ``side`` that is not there, or a single test whose name starts another test's
    name in its file (pytest's --deselect takes a prefix: the other test would run nowhere)."""
    files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, rdma_dir, "test_*.py"))}
    wrong = [f"{rdma_dir}/{name}: no such file" for name in alone if name not in files]
    for entry in side:
        name, _, test = entry.partition("::")
        if name not in files:
            wrong.append(f"{rdma_dir}/{name}: no such file")
            continue
        if not test:
            if name in alone:
                wrong.append(f"{rdma_dir}/{name}: both alone and side")
            continue
        if name in side:
            wrong.append(f"{rdma_dir}/{entry}: its file is run whole beside it")
        tests = _tests_in(os.path.join(ROOT, rdma_dir, name))
        if test not in tests:
            wrong.append(f"{rdma_dir}/{entry}: no such test")
        wrong += [f"{rdma_dir}/{entry}: {other} starts with its name" for other in tests
                  if other != test and other.startswith(test)]  # fmt: skip
    return wrong


def processes(rdma_dir: str = RDMA_DIR, alone=ALONE, side=SIDE) -> list[tuple[str, list[str]]]:
    """pytest arguments per process: ``[("side", args), ("rest", args)]``."""
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, rdma_dir, "test_*.py")))
    whole = set(alone) | {entry for entry in side if "::" not in entry}
    taken = [entry for entry in side if "::" in entry and entry.partition("::")[0] not in alone]
    rest = [name for name in files if name not in whole]
    side_args = [f"{rdma_dir}/{name}" for name in alone] + [
        f"{rdma_dir}/{e}" for e in side if e.split("::")[0] not in alone
    ]
    rest_args = [f"{rdma_dir}/{name}" for name in rest] + [f"--deselect={rdma_dir}/{t}" for t in taken]
    return [("side", side_args), ("rest", rest_args)]


def alone_env(results: str, alone=ALONE, side=SIDE) -> dict[str, str]:
    """The side process's environment for tests/support/guest_alone.py."""
    return {
        "TABLESERVER_GUEST_ALONE": ",".join(alone),
        "TABLESERVER_GUEST_NOT_ALONE": ",".join(e for e in side if "::" in e and e.split("::")[0] in alone),
        "TABLESERVER_GUEST_REST_DONE": os.path.join(results, REST_DONE),
    }


def guest_script(results: str) -> str:
    """The guest's shell script: the side and rest processes at once (their console lines prefixed with their
    name), the side's alone tests let go once the rest has ended; exits non-zero when either did. It notes when the
    rest ended (``rest-at``, seconds after the start) and the guest's lowest MemAvailable (read without a fork every
    5 s) in ``mem-low``, for the summary."""
    pytest_cmd = (
        f"{shlex.quote(sys.executable)} -m pytest -p no:cacheprovider --color=no -v -rfEs --durations=10 "
        f"-o faulthandler_timeout={GUEST_TRACEBACK_AFTER_S} -o junit_family=xunit2"
    )
    lines = [
        vm.RXE_SETUP,
        f"cd {shlex.quote(ROOT)}",
        f"R={shlex.quote(results)}",
        '(low=999999999; while :; do while read -r k v _; do if [ "$k" = MemAvailable: ] && [ "$v" -lt $low ]; '
        'then low=$v; echo $low > "$R/mem-low"; fi; done < /proc/meminfo; sleep 5; done) & sampler=$!',
        "t0=$(date +%s)",
    ]
    (side, side_args), (rest, rest_args) = processes()
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in alone_env(results).items())
    for name, args, prefix in ((side, side_args, f"env {env} "), (rest, rest_args, "")):
        argv = " ".join(shlex.quote(a) for a in args)
        lines.append(
            f'{{ {prefix}{pytest_cmd} --basetemp=/run/tmp/pytest-{name} --junitxml="$R/junit-{name}.xml" {argv}; '
            f'echo $? > "$R/rc-{name}"; }} 2>&1 | sed -u "s/^/{name}| /" & {name}=$!'
        )
    lines += [
        f"wait ${rest}",
        f'echo $(( $(date +%s) - t0 )) > "$R/rest-at"; touch "$R/{REST_DONE}"',
        f"wait ${side}",
        "kill $sampler",
        "rc=0",
        f'for name in {side} {rest}; do [ "$(cat "$R/rc-$name" 2>/dev/null)" = 0 ] || rc=1; done',
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def slowest(suites: list[ET.Element], count: int) -> list[tuple[str, float]]:
    """The guest's ``count`` slowest tests, ``(name, seconds)``: where its minutes go."""
    cases = [(case.get("name", ""), float(case.get("time", 0) or 0)) for s in suites for case in s.iter("testcase")]
    return sorted(cases, key=lambda c: -c[1])[:count]


def guest_failures(suites: list[ET.Element]) -> list[tuple[str, str]]:
    """``(test id, what failed)`` per failed or errored test of the guest's junit reports: the message and the
    end of the traceback (where the assertion is)."""
    failed = []
    for suite in suites:
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                for el in case.findall(kind):
                    test = f"{case.get('classname', '')}::{case.get('name', '')}"
                    text = (el.text or "").strip()
                    failed.append((test, f"{kind} {test}: {el.get('message', '')}\n{text[-3000:]}"))
    return failed


def read_suite(path: str) -> ET.Element:
    root = ET.parse(path).getroot()
    return root if root.tag == "testsuite" else root.find("testsuite")


def test_phases_run_every_rdma_test_once():
    """ALONE and SIDE name files and tests that are there, and no single test SIDE takes drags another along."""
    assert check_phases() == []
    every = processes()
    assert [name for name, _ in every] == ["side", "rest"]
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, RDMA_DIR, "test_*.py")))
    whole = [a for _, args in every for a in args if a.endswith(".py")]
    assert sorted(os.path.basename(a) for a in whole) == files  # each file run whole by one process
    singles = [a for _, args in every for a in args if "::" in a and "--deselect" not in a]
    deselected = [a.split("=", 1)[1] for _, args in every for a in args if "--deselect" in a]
    assert sorted(singles) == sorted(deselected)  # a single test taken is deselected where its file runs
    env = alone_env("/r")
    assert env["TABLESERVER_GUEST_ALONE"] == ",".join(ALONE) and env["TABLESERVER_GUEST_NOT_ALONE"]


def test_the_alone_tests_go_last_and_wait_for_the_rest_to_end(tmp_path, monkeypatch):
    """tests/support/guest_alone.py: in the side process its alone tests last (each file's order kept), the first
    of them waiting until the rest process has ended; the others never wait."""
    import threading
    from types import SimpleNamespace

    import guest_alone

    for key, value in alone_env(str(tmp_path)).items():
        monkeypatch.setenv(key, value)
    shared = next(e for e in SIDE if e.startswith(ALONE[0] + "::")).split("::")[1]
    ids = [f"{RDMA_DIR}/{ALONE[0]}::test_a[x]", f"{RDMA_DIR}/test_rdma.py::test_handshake",
           f"{RDMA_DIR}/{ALONE[0]}::{shared}", f"{RDMA_DIR}/{ALONE[0]}::test_b"]  # fmt: skip
    items = [SimpleNamespace(nodeid=i) for i in ids]
    guest_alone.order(items)
    assert [i.nodeid for i in items] == [ids[1], ids[2], ids[0], ids[3]]
    guest_alone.starting(ids[1])  # not alone: no wait (the rest is running)
    guest_alone.starting(ids[2])
    started = threading.Event()
    waiter = threading.Thread(target=lambda: (guest_alone.starting(ids[0]), started.set()))
    waiter.start()
    assert not started.wait(1.0)  # alone: waits for the rest
    (tmp_path / REST_DONE).touch()
    waiter.join(EVENT_TIMEOUT)
    assert started.is_set()


@pytest.mark.slow
def test_rdma_suite_in_softroce_guest(tmp_path):
    try:
        vm.ensure_host_packages(install=os.geteuid() == 0)
    except vm.GuestUnavailable as e:
        pytest.skip(str(e))
    wrong = check_phases()
    assert not wrong, "the guest's phases (ALONE, SIDE) name what is not there: " + "; ".join(wrong)
    # The user-facing install step for RDMA clients (README): the host's pyverbs, linked into this venv.
    fix = subprocess.run(
        [sys.executable, "-m", "tableserver", "doctor", "--fix-pyverbs"], capture_output=True, text=True, cwd=ROOT
    )
    assert fix.returncode == 0 and fix.stdout.startswith("ok"), fix.stdout + fix.stderr
    # The guest's root is read-only: a module without a current .pyc is compiled again, under TCG, by every
    # process that imports it (make test compiles first too; this covers a run of this test alone)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "tableserver", "client", "tests"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    results = os.path.join(str(tmp_path), "results")
    try:
        res = vm.run_guest(guest_script(results), workdir=str(tmp_path), memory_mb=8192, timeout=GUEST_TIMEOUT_S)
    except TimeoutError:
        with open(os.path.join(str(tmp_path), vm.CONSOLE_LOG), errors="replace") as f:
            print(f.read())  # the whole console in the test's captured output: the last test named hung
        raise
    tail = f"--- guest console, last lines (all of it: {res.console_log}):\n{res.console[-4000:]}"
    names = [name for name, _ in processes()]
    missing = [name for name in names if not os.path.exists(os.path.join(results, f"junit-{name}.xml"))]
    if missing:
        print(res.console)  # the whole console in the test's captured output
        pytest.fail(f"the guest produced no results from {', '.join(missing)} (exit {res.rc}):\n{tail}", pytrace=False)
    suites = [read_suite(os.path.join(results, f"junit-{name}.xml")) for name in names]
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = guest_failures(suites)
    took = dict(zip(names, (float(s.get("time", 0) or 0) for s in suites)))
    try:
        with open(os.path.join(results, "rest-at")) as f:
            rest_at = f" (side's alone tests after the rest ended, at {int(f.read())} s)"
    except (OSError, ValueError):
        rest_at = ""
    try:
        with open(os.path.join(results, "mem-low")) as f:
            memory = f", its lowest MemAvailable {int(f.read()) >> 10} MiB"
    except (OSError, ValueError):
        memory = ""
    summary_line(
        f"Soft-RoCE guest (kernel {vm.kernel_version()}): {counts['tests']} RDMA tests, {counts['failures']} "
        f"failed, {counts['errors']} errors, {counts['skipped']} skipped in {res.seconds:.0f} s"
        + "".join(f"\n  failed in the guest: {test}" for test, _ in failed)
        + f"\n  pytest processes: side {took['side']:.0f} s, rest {took['rest']:.0f} s{rest_at}"
        + memory
        + "\n  slowest: "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in slowest(suites, 5))
    )
    if res.rc != 0 or failed or counts["failures"] or counts["errors"]:
        print(res.console)
        shown = "\n\n".join(what for _, what in failed[:SHOWN_FAILURES])
        more = "".join(f"\nalso failed: {test}" for test, _ in failed[SHOWN_FAILURES:])
        pytest.fail(f"guest exit {res.rc} {counts}:\n{shown}{more}\n{tail}", pytrace=False)
    assert counts["skipped"] == 0, f"RDMA tests skipped in the guest: {counts}\n{tail}"
    assert counts["tests"] >= MIN_TESTS, f"only {counts['tests']} RDMA tests ran:\n{tail}"
