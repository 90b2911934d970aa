"""The house plan is enforced, not just written down: the import contracts in setup.cfg (run by
``make lint``) fail on a copy of the tree that breaks them, naming the import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")

pytestmark = pytest.mark.skipif(not os.path.exists(LINT_IMPORTS), reason="import-linter is not installed (.[dev])")


def _lint(tree: str) -> subprocess.CompletedProcess:
    """lint-imports over the packages in ``tree`` (found there before the installed ones)."""
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", os.path.join(tree, "setup.cfg")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tree(tmp_path):
    """A copy of the two packages and setup.cfg, importable from ``tmp_path``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(os.path.join(ROOT, "tableserver"), tmp_path / "tableserver", ignore=ignore)
    shutil.copytree(os.path.join(ROOT, "client", "tableclient"), tmp_path / "tableclient", ignore=ignore)
    shutil.copy(os.path.join(ROOT, "setup.cfg"), tmp_path / "setup.cfg")
    return tmp_path


def _append(path, line: str) -> None:
    with open(path, "a") as f:
        f.write(f"\n{line}  # noqa\n")


def test_the_tree_keeps_every_contract(tree):
    res = _lint(str(tree))
    assert res.returncode == 0, res.stdout[-3000:]
    assert "0 broken" in res.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        (
            "tableclient/table.py",
            "import tableserver.server",
            "tableclient is not allowed to import tableserver.server",
        ),
        ("tableserver/common/take.py", "import tableserver.errors", "is not allowed to import tableserver.errors"),
        ("tableserver/tables/loader.py", "import tableclient", "tableserver is not allowed to import tableclient"),
        ("tableclient/transports/tcp.py", "import tableclient.routing", "is not allowed to import tableclient.routing"),
        (
            "tableclient/engine/rows.py",
            "import tableclient.sglang.hooks",
            "is not allowed to import tableclient.sglang",
        ),
        ("tableclient/engine/config.py", "import vllm.config", "is not allowed to import vllm"),
        ("tableclient/sglang/hooks.py", "import tableclient.vllm.hooks", "is not allowed to import tableclient.vllm"),
        (
            "tableclient/sglang/graphs.py",
            "import tableclient.sglang.hooks",
            "is not allowed to import tableclient.sglang.hooks",
        ),
        ("tableclient/graph/step.py", "import tableclient.engine.rows", "is not allowed to import tableclient.engine"),
        ("tableclient/graph/poller/python.py", "import sglang", "is not allowed to import sglang"),
        ("tableclient/step.py", "import tableclient.graph.step", "is not allowed to import tableclient.graph"),
        ("tableclient/graph/streams.py", "import tableclient.graph.poller.native", "tableclient.graph.streams ->"),
        (
            "tableserver/disk/reader.py",
            "import tableserver.tables.loader",
            "is not allowed to import tableserver.tables",
        ),
        ("tableserver/disk/queue.py", "import tableserver.config", "is not allowed to import tableserver.config"),
        (
            "tableserver/tables/loader.py",
            "import tableserver.transports.tcp",
            "is not allowed to import tableserver.transports",
        ),
        ("tableserver/server.py", "import tableserver.ops.doctor", "is not allowed to import tableserver.ops"),
        (
            "tableserver/transports/tcp.py",
            "import tableserver.control",
            "tableserver.transports.tcp -> tableserver.control",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tree, module, line, broken):
    _append(tree / module, line)
    res = _lint(str(tree))
    assert res.returncode != 0
    assert "BROKEN" in res.stdout and broken in res.stdout, res.stdout[-3000:]


def test_the_old_graph_step_name_re_exports_the_wing():
    """``tableclient.graphstep`` stays one release, the same objects as ``tableclient.graph``."""
    import tableclient.graph
    import tableclient.graphstep

    for name in ("GraphStep", "GraphStepError", "HostStreamOps", "CudaStreamOps", "GraphFlags", "MODES", "OUTCOMES",
                 "min_from_sum", "gather_budget", "wait_flag"):  # fmt: skip
        assert getattr(tableclient.graphstep, name) is getattr(tableclient.graph, name), name
