"""`tableserver doctor --fix-pyverbs`: the README's RDMA install step, run in fresh virtual environments."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

from tableserver.ops import doctor


def _venv(tmp_path) -> str:
    """A new, empty virtual environment of this Python (no pip: nothing from PyPI in it)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    return str(tmp_path / "venv" / "bin" / "python")


def _tableserver(python: str, *args) -> subprocess.CompletedProcess:
    """The real CLI in that environment (the doctor needs nothing but the standard library)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [python, "-m", "tableserver", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


def _import_pyverbs(python: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [python, "-c", "import pyverbs.device, pyverbs.qp; print(pyverbs.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _system_pyverbs() -> str:
    dirs = doctor.system_pyverbs_dirs()
    if not dirs:
        pytest.skip(f"no distribution pyverbs on this host: {doctor.install_hint()} (.ci/run installs it)")
    return dirs[0]


def test_fix_pyverbs_in_a_fresh_venv(tmp_path):
    system = _system_pyverbs()
    python = _venv(tmp_path)
    before = _tableserver(python, "doctor")
    assert before.returncode == 0, before.stderr
    assert re.search(r"^warn  pyverbs: not importable .*tableserver doctor --fix-pyverbs", before.stdout, re.M), (
        before.stdout
    )
    assert _import_pyverbs(python).returncode != 0

    fixed = _tableserver(python, "doctor", "--fix-pyverbs")
    assert fixed.returncode == 0 and fixed.stdout.startswith("ok    pyverbs: linked into"), fixed.stdout + fixed.stderr
    assert re.search(r"rdma-core \d+", fixed.stdout), fixed.stdout
    imported = _import_pyverbs(python)
    assert imported.returncode == 0, imported.stderr
    assert os.path.realpath(os.path.dirname(imported.stdout.strip())) == os.path.realpath(system)
    # only pyverbs came along, not the rest of the system's site-packages
    leaked = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('apt') is not None)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert leaked == "False"

    again = _tableserver(python, "doctor", "--fix-pyverbs")
    assert again.returncode == 0 and "already importable" in again.stdout, again.stdout + again.stderr
    assert _tableserver(python, "doctor").stdout.startswith("ok    pyverbs:")


def _mismatched_copy(system: str, dest: str) -> str:
    """The host's pyverbs, its verbs symbol version rewritten: what a pyverbs built for another rdma-core
    (e.g. PyPI's, for rdma-core 59) is to this host. The dynamic loader refuses it for real."""
    pkg = os.path.join(dest, "pyverbs")
    shutil.copytree(system, pkg, symlinks=True)
    for so in glob.glob(os.path.join(pkg, "*.so")):
        with open(so, "rb") as f:
            data = f.read()
        with open(so, "wb") as f:
            f.write(re.sub(rb"IBVERBS_PRIVATE_(\d\d)", b"IBVERBS_PRIVATE_99", data))
    return pkg


def test_a_pip_installed_pyverbs_for_another_rdma_core_is_named(tmp_path):
    system = _system_pyverbs()
    python = _venv(tmp_path)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    _mismatched_copy(system, purelib)  # as `pip install pyverbs` would leave it
    assert "IBVERBS_PRIVATE_99" in _import_pyverbs(python).stderr

    res = _tableserver(python, "doctor", "--fix-pyverbs")
    assert res.returncode == 1 and res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tableserver: error: the pyverbs at " + purelib), res.stderr
    assert "IBVERBS_PRIVATE_99" in lines[0] and "pip uninstall pyverbs" in lines[0]


def test_pyverbs_from_a_directory_that_does_not_load(tmp_path):
    system = _system_pyverbs()
    python = _venv(tmp_path)
    broken = _mismatched_copy(system, str(tmp_path / "vendor"))
    res = _tableserver(python, "doctor", "--fix-pyverbs", "--pyverbs-from", broken)
    assert res.returncode == 1 and "but it does not work" in res.stderr and "IBVERBS_PRIVATE_99" in res.stderr
    assert "No module named 'pyverbs'" in _import_pyverbs(python).stderr  # the failed link was taken back
    res = _tableserver(python, "doctor", "--fix-pyverbs")
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr
    assert _import_pyverbs(python).returncode == 0


@pytest.mark.parametrize(
    "files, message",
    [
        ([], "not a pyverbs package directory"),
        (["__init__.py", "device.cpython-399-x86_64-linux-gnu.so"], "no pyverbs here is built for this Python"),
    ],
)
def test_pyverbs_from_refusals(tmp_path, files, message):
    pkg = tmp_path / "pyverbs"
    pkg.mkdir()
    for f in files:
        (pkg / f).write_bytes(b"")
    res = _tableserver(_venv(tmp_path), "doctor", "--pyverbs-from", str(pkg))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and message in lines[0], res.stderr


@pytest.mark.parametrize(
    "release, hint",
    [
        ('ID=debian\nVERSION_ID="12"\n', "apt-get install python3-pyverbs"),
        ("ID=ubuntu\nID_LIKE=debian\n", "apt-get install python3-pyverbs"),
        ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "dnf install python3-pyverbs"),
        ("ID=arch\n", "your distribution's python3-pyverbs"),
    ],
)
def test_install_hint_by_distribution(tmp_path, release, hint):
    (tmp_path / "os-release").write_text(release)
    assert hint in doctor.install_hint(str(tmp_path / "os-release"))


def test_verbs_versions_and_rdma_core_version(tmp_path):
    lib = tmp_path / "libibverbs.so.1.14.44.0"
    lib.write_bytes(b"\0IBVERBS_1.1\0IBVERBS_1.14\0IBVERBS_PRIVATE_34\0junk")
    assert doctor.verbs_versions(str(lib)) == {"IBVERBS_1.1", "IBVERBS_1.14", "IBVERBS_PRIVATE_34"}
    assert doctor.rdma_core_version(str(lib)) == "44.0"
