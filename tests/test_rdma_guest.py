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

MIN_TESTS = 18


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
    script = (
        vm.RXE_SETUP + f"cd {ROOT}\n"
        f"{sys.executable} -m pytest tests/rdma -p no:cacheprovider --color=no -q -rfEs "
        f"--junitxml={junit} -o junit_family=xunit2\n"
    )
    res = vm.run_guest(script, workdir=str(tmp_path), memory_mb=8192, timeout=2400)
    tail = res.console[-6000:]
    assert os.path.exists(junit), f"the guest produced no results (exit {res.rc}):\n{tail}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary_line(
        f"Soft-RoCE guest (kernel {vm.kernel_version()}): {counts['tests']} RDMA tests, {counts['failures']} "
        f"failed, {counts['errors']} errors, {counts['skipped']} skipped in {res.seconds:.0f} s"
    )
    assert res.rc == 0 and counts["failures"] == counts["errors"] == 0, f"guest exit {res.rc} {counts}:\n{tail}"
    assert counts["skipped"] == 0, f"RDMA tests skipped in the guest: {counts}\n{tail}"
    assert counts["tests"] >= MIN_TESTS, f"only {counts['tests']} RDMA tests ran:\n{tail}"
