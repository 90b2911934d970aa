"""Runs the RDMA suite (tests/rdma) on kernel Soft-RoCE inside a QEMU guest.

The guest boots Debian's kernel under TCG, chroots into this machine's
filesystem over 9p (same checkout, same venv), creates rxe_lo and runs pytest
on tests/rdma. This test passes only if the guest ran every RDMA test and all
passed: none may be skipped. Where the guest cannot run (not root and the
Debian packages missing) it skips with one line naming what is missing.
"""

from __future__ import annotations

import os
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


def slowest(suite: ET.Element, count: int) -> list[tuple[str, float]]:
    """The guest's ``count`` slowest tests, ``(name, seconds)``: where its minutes go."""
    cases = [(case.get("name", ""), float(case.get("time", 0) or 0)) for case in suite.iter("testcase")]
    return sorted(cases, key=lambda c: -c[1])[:count]


def guest_failures(suite: ET.Element) -> list[tuple[str, str]]:
    """``(test id, what failed)`` per failed or errored test of the guest's junit report: the message and the
    end of the traceback (where the assertion is)."""
    failed = []
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            for el in case.findall(kind):
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                text = (el.text or "").strip()
                failed.append((test, f"{kind} {test}: {el.get('message', '')}\n{text[-3000:]}"))
    return failed


@pytest.mark.slow
def test_rdma_suite_in_softroce_guest(tmp_path):
    try:
        vm.ensure_host_packages(install=os.geteuid() == 0)
    except vm.GuestUnavailable as e:
        pytest.skip(str(e))
    # The user-facing install step for RDMA clients (README): the host's pyverbs, linked into this venv.
    fix = subprocess.run(
        [sys.executable, "-m", "tableserver", "doctor", "--fix-pyverbs"], capture_output=True, text=True, cwd=ROOT
    )
    assert fix.returncode == 0 and fix.stdout.startswith("ok"), fix.stdout + fix.stderr
    junit = os.path.join(str(tmp_path), "results", "junit.xml")
    # -v: the console names each test as it starts, so a guest that hangs or is killed shows where
    script = (
        vm.RXE_SETUP + f"cd {ROOT}\n"
        f"{sys.executable} -m pytest tests/rdma -p no:cacheprovider --color=no -v -rfEs --durations=10 "
        f"-o faulthandler_timeout={GUEST_TRACEBACK_AFTER_S} --junitxml={junit} -o junit_family=xunit2\n"
    )
    try:
        res = vm.run_guest(script, workdir=str(tmp_path), memory_mb=8192, timeout=GUEST_TIMEOUT_S)
    except TimeoutError:
        with open(os.path.join(str(tmp_path), vm.CONSOLE_LOG), errors="replace") as f:
            print(f.read())  # the whole console in the test's captured output: the last test named hung
        raise
    tail = f"--- guest console, last lines (all of it: {res.console_log}):\n{res.console[-4000:]}"
    if not os.path.exists(junit):
        print(res.console)  # the whole console in the test's captured output
        pytest.fail(f"the guest produced no results (exit {res.rc}):\n{tail}", pytrace=False)
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = guest_failures(suite)
    summary_line(
        f"Soft-RoCE guest (kernel {vm.kernel_version()}): {counts['tests']} RDMA tests, {counts['failures']} "
        f"failed, {counts['errors']} errors, {counts['skipped']} skipped in {res.seconds:.0f} s"
        + "".join(f"\n  failed in the guest: {test}" for test, _ in failed)
        + "\n  slowest: "
        + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in slowest(suite, 5))
    )
    if res.rc != 0 or failed or counts["failures"] or counts["errors"]:
        print(res.console)
        shown = "\n\n".join(what for _, what in failed[:SHOWN_FAILURES])
        more = "".join(f"\nalso failed: {test}" for test, _ in failed[SHOWN_FAILURES:])
        pytest.fail(f"guest exit {res.rc} {counts}:\n{shown}{more}\n{tail}", pytrace=False)
    assert counts["skipped"] == 0, f"RDMA tests skipped in the guest: {counts}\n{tail}"
    assert counts["tests"] >= MIN_TESTS, f"only {counts['tests']} RDMA tests ran:\n{tail}"
