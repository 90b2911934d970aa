"""bench/gpu_check.sh --cpu: every stage of the device script that runs without a GPU (the probe's driver names,
graph mode device through Triton's interpreter, the graph modes side by side, a frozen and a killed server),
run as the script runs them, so the script the device machine gets cannot rot here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.mark.slow
def test_gpu_check_cpu_runs_every_stage_and_exits_0(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "gpu_check (cpu): every stage passed" in r.stdout
    for stage in ("report", "probe", "node", "modes", "faults", "wake"):
        assert f"== {stage}: ok" in r.stdout
        assert (tmp_path / f"{stage}.log").stat().st_size > 0
    assert "PASS: every row bit-exact" in (tmp_path / "node.log").read_text()
    assert "layer 14: WRONG ROWS" not in r.stdout
