"""Runs the RDMA suite (tests/rdma) on kernel Soft-RoCE inside a QEMU guest.

The guest boots Debian's kernel under TCG, chroots into this machine's
filesystem over 9p (same checkout, same venv), creates rxe_lo and runs pytest
on tests/rdma. This test passes only if the guest ran every RDMA test and all
passed: none may be skipped. Where the guest cannot run (not root and the
Debian packages missing) it skips with one line naming what is missing.

The guest has two vCPUs and its suite is mostly one process at a time (a daemon's start, a client's imports),
so it runs in two phases (phases()): first the tests that time a spinning thread against a tight deadline
(ALONE), alone; then the rest as two pytest processes side by side, one per vCPU (SIDE and the rest). Each
process writes a junit report of its own; this test adds them up. On a quiet host: 689 s in one process, 539 s
so (docs/perf.md).
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
from conftest import ROOT, summary_line

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
#: Phase 1, alone in the guest: files whose tests bound how late a spinning thread is released after its deadline
#: (tests/rdma/test_graphpoll_rdma.py's RELEASE_SLACK_S, 50 ms), which a second pytest process on the other vCPU
#: would eat into. Less the tests SIDE takes from them.
ALONE = ("test_graphpoll_rdma.py",)
#: Phase 2, two pytest processes side by side: "side" runs these (whole files, or single tests ``file::name``
#: taken from a file another process runs), "rest" runs every other file, new files and tests included. Chosen to
#: even out the two by the guest's timings of 2026-12-07 (CI, 1085 s in one process): the 4 GiB table (148 s),
#: the two failovers to a replica (47 s, 37 s), the poller's node restart (85 s) and the packed-only sources
#: (148 s, and torch's import) against test_rdma.py's other tests (~330 s), the QP sessions (~90 s) and the disk
#: faults (~70 s); on a quiet host then, side 386 s beside rest 398 s. A name here that no longer exists fails at
#: once (check_phases); its test would otherwise run in whatever process runs its file.
SIDE = (
    "test_rdma.py::test_table_with_offsets_over_4gib",
    "test_rdma.py::test_a_verbs_error_on_first_use_fails_over_to_a_replica",
    "test_rdma.py::test_a_qp_error_before_the_first_read_fails_over_to_a_replica",
    "test_graphpoll_rdma.py::test_the_native_poller_connects_again_after_its_node_restarts",
    "test_graphpoll_sources_rdma.py",
    "test_cqevents.py",
)


def _tests_in(path: str) -> list[str]:
    with open(path) as f:
        return re.findall(r"^(?:async )?def (test_\w+)\(", f.read(), re.M)


def check_phases(rdma_dir: str = RDMA_DIR, alone=ALONE, side=SIDE) -> list[str]:
    """Why the phases would not run every test of ``rdma_dir`` exactly once (empty when they do): a file or
    test named in ``alone`` or ``side`` that is not there, or a single test whose name starts another test's
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


def phases(rdma_dir: str = RDMA_DIR, alone=ALONE, side=SIDE) -> list[list[tuple[str, list[str]]]]:
    """pytest arguments per process, per phase: ``[[("alone", args)], [("side", args), ("rest", args)]]``."""
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, rdma_dir, "test_*.py")))
    taken = [entry for entry in side if "::" in entry]  # single tests the side process runs
    whole = {entry for entry in side if "::" not in entry}

    def run(names: list[str]) -> list[str]:
        deselect = [f"--deselect={rdma_dir}/{t}" for t in taken if t.partition("::")[0] in names]
        return [f"{rdma_dir}/{name}" for name in names] + deselect

    rest = [name for name in files if name not in alone and name not in whole]
    return [
        [("alone", run(list(alone)))],
        [("side", [f"{rdma_dir}/{entry}" for entry in side]), ("rest", run(rest))],
    ]


def guest_script(results: str) -> str:
    """The guest's shell script: each phase's pytest processes side by side (their console lines prefixed with
    their name), one phase after another; exits non-zero when any of them did. Meanwhile it notes the guest's
    lowest MemAvailable (read without a fork every 5 s) in ``mem-low``, for the summary."""
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
    ]
    names = []
    for phase in phases():
        pids = []
        for name, args in phase:
            names.append(name)
            argv = " ".join(shlex.quote(a) for a in args)
            lines.append(
                f'{{ {pytest_cmd} --basetemp=/run/tmp/pytest-{name} --junitxml="$R/junit-{name}.xml" {argv}; '
                f'echo $? > "$R/rc-{name}"; }} 2>&1 | sed -u "s/^/{name}| /" & {name}=$!'
            )
            pids.append(f"${name}")
        lines.append(f"wait {' '.join(pids)}")
    lines += [
        "kill $sampler",
        "rc=0",
        f'for name in {" ".join(names)}; do [ "$(cat "$R/rc-$name" 2>/dev/null)" = 0 ] || rc=1; done',
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
    every = phases()
    assert [name for phase in every for name, _ in phase] == ["alone", "side", "rest"]
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, RDMA_DIR, "test_*.py")))
    whole = [a for phase in every for _, args in phase for a in args if a.endswith(".py")]
    assert sorted(os.path.basename(a) for a in whole) == files  # each file run whole by one process
    singles = [a for phase in every for _, args in phase for a in args if "::" in a and "--deselect" not in a]
    deselected = [a.split("=", 1)[1] for phase in every for _, args in phase for a in args if "--deselect" in a]
    assert sorted(singles) == sorted(deselected)  # a single test taken is deselected where its file runs


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
    names = [name for phase in phases() for name, _ in phase]
    missing = [name for name in names if not os.path.exists(os.path.join(results, f"junit-{name}.xml"))]
    if missing:
        print(res.console)  # the whole console in the test's captured output
        pytest.fail(f"the guest produced no results from {', '.join(missing)} (exit {res.rc}):\n{tail}", pytrace=False)
    suites = [read_suite(os.path.join(results, f"junit-{name}.xml")) for name in names]
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = guest_failures(suites)
    took = dict(zip(names, (float(s.get("time", 0) or 0) for s in suites)))
    try:
        with open(os.path.join(results, "mem-low")) as f:
            memory = f", its lowest MemAvailable {int(f.read()) >> 10} MiB"
    except (OSError, ValueError):
        memory = ""
    summary_line(
        f"Soft-RoCE guest (kernel {vm.kernel_version()}): {counts['tests']} RDMA tests, {counts['failures']} "
        f"failed, {counts['errors']} errors, {counts['skipped']} skipped in {res.seconds:.0f} s"
        + "".join(f"\n  failed in the guest: {test}" for test, _ in failed)
        + "\n  pytest processes: "
        + ", then ".join(" beside ".join(f"{name} {took[name]:.0f} s" for name, _ in phase) for phase in phases())
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
