"""Tests go through the project's public interfaces (issue 51): at most MAX_PRIVATE reads of the project's private
names are left in tests/ (tests/support included), each where no public seam can exist, and each says why on its
line with a ``# private: <why>`` comment.

A read here is an attribute access ``x._name`` (loaded, assigned or deleted; ``x`` not ``self`` or ``cls``; dunders
not counted), or the same by name (``getattr(x, "_name")``, ``setattr``/``hasattr``/``delattr`` and
``monkeypatch.setattr(x, "_name", ...)``), where ``_name`` is a private name the project's code defines
(tableserver/ and client/, by AST: ``def _x``/``class _X``, ``self._x =``/``cls._x =``, class-level ``_x``,
module-level ``_x`` and imports ``as _x``, and modules named ``_x``).

Another library's private names are not ours (an engine's, torch's, prometheus_client's, argparse's). A read is
theirs, and not counted, when the object it reads from is a name the test file imported from outside tableserver
and tableclient (``torch.cuda._sleep``), or when its line says whose it is: ``# SGLang's own`` (any ``<owner>'s
own``). Such a comment on a read from a name imported from the project is refused.

Run alone to see the reads left: ``python -m pytest -q tests/unit/test_private_reads.py``."""

from __future__ import annotations

import ast
import collections
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: where the project's code is (its private names are collected there) and where its tests are
PROJECT = ("tableserver", "client")
PROJECT_PACKAGES = ("tableserver", "tableclient")
TESTS = "tests"
#: the most reads of the project's private names tests may keep, each with a ``# private:`` comment
MAX_PRIVATE = 20
PRIVATE_COMMENT = re.compile(r"#\s*private:\s*\S")
THEIRS_COMMENT = re.compile(r"#.*?\b[\w.-]+'s own\b")
#: the calls that read or set an attribute named by a string: getattr(x, "_name"), monkeypatch.setattr(x, "_name", v)
BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def _python_files(top: str):
    for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name != "_"


def _bound(stmt) -> list[str]:
    """The plain names one statement binds itself (not those of the statements nested in it)."""
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in stmt.names]
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        targets = stmt.targets
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign | ast.For | ast.AsyncFor):
        targets = [stmt.target]
    elif isinstance(stmt, ast.With | ast.AsyncWith):
        targets = [item.optional_vars for item in stmt.items if item.optional_vars is not None]
    else:
        return []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _nested(body: list):
    """The statements of a module's or class's body, those in its if/try/with/for blocks included (not those of
    the functions and classes it defines)."""
    for stmt in body:
        yield stmt
        if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    yield from _nested(inner)


def project_private_names() -> set[str]:
    """Every private name tableserver/ and client/ define (see the module's docstring)."""
    names = set()
    for top in PROJECT:
        for _folder, dirs, files in os.walk(os.path.join(ROOT, top)):  # modules: _x.py, _x.c (an extension), _x/
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            names.update(dirs)
            names.update(f.split(".")[0] for f in files if f.endswith((".py", ".so", ".c")))
        for path in _python_files(top):
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for stmt in _nested(tree.body):  # module level
                names.update(_bound(stmt))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                if isinstance(node, ast.ClassDef):  # class level
                    for stmt in _nested(node.body):
                        names.update(_bound(stmt))
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                ):
                    names.add(node.attr)
    return {n for n in names if _private(n)}


def own_modules() -> set[str]:
    """The names the tests' own modules are imported by (conftest, tests_helpers, guest, ...)."""
    return {os.path.basename(p)[: -len(".py")] for p in _python_files(TESTS)} | {TESTS}


def _imported(tree) -> dict[str, str]:
    """name -> the module it was imported from, for every import in the file (``x = pytest.importorskip("m")``
    too; a relative import's module starts with a dot)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                out[a.asname or a.name] = "." * node.level + (node.module or "")
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "importorskip"
            and node.value.args
            and isinstance(node.value.args[0], ast.Constant)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = str(node.value.args[0].value)
    return out


def _root(node) -> str | None:
    """The plain name an expression reads from (``torch`` in ``torch.cuda.current_stream()``), if any."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _comments(source: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


Read = collections.namedtuple("Read", "path line name private theirs project_receiver")


def _accesses(tree, names: set[str]):
    """(node, name, receiver) for each access to one of ``names`` in the tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                yield node, node.attr, node.value
        elif isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            second = node.args[1] if len(node.args) > 1 else None
            # getattr(x, "_name"), monkeypatch.setattr(x, "_name", v), mock.patch.object(x, "_name")
            if (called in BY_NAME or called == "object") and isinstance(second, ast.Constant) and second.value in names:
                yield node, second.value, first
            # monkeypatch.setattr("pkg.module._name", v), mock.patch("pkg.module._name")
            elif called in ("setattr", "delattr", "patch") and isinstance(first, ast.Constant):
                dotted = str(first.value)
                if "." in dotted and dotted.rsplit(".", 1)[-1] in names:
                    yield node, dotted.rsplit(".", 1)[-1], None


def reads_in(source: str, rel: str, names: set[str], ours: set[str] = frozenset()) -> list[Read]:
    """The accesses to ``names`` in one test file's ``source``, each told ours or theirs, explained or not.
    ``ours``: the tests' own modules (a name imported from one of them is no other library's)."""
    tree = ast.parse(source, rel)
    imported, comments = _imported(tree), _comments(source)
    found = []
    for node, name, receiver in _accesses(tree, names):
        said = " ".join(comments.get(i, "") for i in range(node.lineno, (node.end_lineno or node.lineno) + 1))
        root = _root(receiver) if receiver is not None else None
        module = imported.get(root, "").split(".")[0] if root is not None else ""
        project = module in PROJECT_PACKAGES
        foreign = bool(module) and not project and module not in ours  # a relative import's is "": the tests'
        theirs = foreign or bool(THEIRS_COMMENT.search(said))
        found.append(Read(rel, node.lineno, name, bool(PRIVATE_COMMENT.search(said)), theirs, project))
    return found


def scan(names: set[str] | None = None) -> list[Read]:
    """Every access in tests/ to a private name of the project's (see the module's docstring)."""
    names = project_private_names() if names is None else names
    ours, found = own_modules(), []
    for path in _python_files(TESTS):
        with open(path) as f:
            found += reads_in(f.read(), os.path.relpath(path, ROOT), names, ours)
    return sorted(found)


def _where(reads) -> str:
    return "\n".join(f"  {r.path}:{r.line}: {r.name}" for r in reads)


def breakdown(reads) -> str:
    per_file = collections.Counter(r.path for r in reads)
    return "\n".join(f"  {n:3d} {path}" for path, n in sorted(per_file.items()))


def test_the_scan_finds_reads_and_tells_whose_they_are():
    names = {"_mine", "_sleep", "_engines"}
    source = (
        "import torch\n"
        "import tests_helpers\n"
        "from tableclient import step\n"
        "x._mine\n"
        "self._mine\n"
        "x._mine  # private: why\n"
        "torch.cuda._sleep(1)\n"
        "engine._engines  # SGLang's own\n"
        "step._mine  # engine's own\n"
        "getattr(x, '_mine')\n"
        "monkeypatch.setattr(x, '_mine', 1)\n"
        "monkeypatch.setattr('tableclient.step._mine', 1)\n"
        "x._other\n"
        "x.__init__\n"
        "tests_helpers.client._mine\n"
        "mock.patch.object(x, '_mine')\n"
    )
    got = [
        (r.line, r.name, r.private, r.theirs, r.project_receiver)
        for r in reads_in(source, "t.py", names, {"tests_helpers"})
    ]
    assert sorted(got) == [
        (4, "_mine", False, False, False),
        (6, "_mine", True, False, False),
        (7, "_sleep", False, True, False),  # from a name imported from torch
        (8, "_engines", False, True, False),
        (9, "_mine", False, True, True),  # refused: step is the project's
        (10, "_mine", False, False, False),
        (11, "_mine", False, False, False),
        (12, "_mine", False, False, False),
        (15, "_mine", False, False, False),  # the tests' own module is no other library
        (16, "_mine", False, False, False),
    ]


def test_the_project_names_are_collected_by_kind():
    names = project_private_names()
    assert {"_fail_all", "_SEND_TAG", "_TableState", "_register", "_qps", "_take"} <= names  # def, module, class, self
    assert "__init__" not in names and "_" not in names


def test_tests_read_few_private_names_and_say_why():
    reads = scan()
    ours = [r for r in reads if not r.theirs]
    claimed = [r for r in reads if r.theirs and r.project_receiver]
    assert not claimed, "these read from a name imported from the project but say another's own:\n" + _where(claimed)
    unexplained = [r for r in ours if not r.private]
    assert len(ours) <= MAX_PRIVATE and not unexplained, (
        f"{len(ours)} reads of the project's private names in tests (at most {MAX_PRIVATE}); per file:\n"
        f"{breakdown(ours)}\n"
        + (f"without a '# private: <why>' comment on their line:\n{_where(unexplained)}" if unexplained else "")
    )
