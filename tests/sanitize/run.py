"""The sanitizer job of ``make test`` (``make sanitize``): the four C extensions built with
``-fsanitize=address,undefined``, their unit tests and a short randomized run of each under it.

1. Copies the tree's sources (tableserver/, client/, tests/, the setup files) into ``build/sanitize/tree``
   and builds the extensions there in place with setup.py, CFLAGS/LDFLAGS adding the sanitizers: the
   .so files the rest of the suite imports, in the working tree, are never touched.
2. Runs, with gcc's libasan and libubsan preloaded (Python itself is not instrumented) and the copy first
   on PYTHONPATH: the extensions' unit tests (tests/unit/test_take.py, tests/daemon/test_diskio.py, the flag wait's
   and the native poller's tests of tests/daemon/test_graphstep.py, its rdma source's host tests in
   tests/unit/test_graphverbs.py), then tests/sanitize/stress.py. Both refuse to run unless every
   extension is imported from the copy and instrumented (tests/sanitize/sanitized_build.py).
3. Fails on a non-zero exit, and on any sanitizer report: in the output, or in the report files that
   ASAN_OPTIONS/UBSAN_OPTIONS' log_path leaves (processes the tests start report there too).

Reports abort the process (ASan halts on its first; ``-fno-sanitize-recover=undefined`` and
``halt_on_error=1`` make UBSan's fatal too). Leak checking is off: Python frees little at exit, and a
leaked engine (close() with reads in flight) is leaked on purpose.

Usage: ``python tests/sanitize/run.py [--iterations N] [--seed S] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SANITIZE = "-fsanitize=address,undefined"
CFLAGS = f"{SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g"
COPY = ("tableserver", "client", "tests", "setup.py", "setup.cfg", "pyproject.toml", "README.md")
UNIT_TESTS = (
    "tests/unit/test_take.py",
    "tests/unit/test_graphverbs.py",
    "tests/unit/test_graphpoll.py",
    "tests/daemon/test_diskio.py",
    "tests/daemon/test_graphstep.py::test_the_flag_wait_is_native_where_required_and_checks_its_arguments",
    "tests/daemon/test_graphstep.py::test_steps_bit_exact_over_buckets_and_nothing_moves",
    "tests/daemon/test_graphstep.py::test_a_frozen_server_is_released_by_the_watchdog",
    "tests/daemon/test_graphstep.py::test_the_native_poller_connects_again_after_its_node_restarts",
    "tests/daemon/test_graphstep.py::test_dead_ids_are_never_read_and_give_zero_rows",
    "tests/daemon/test_graphpoll_sources.py",
)
EXTENSIONS = (
    "tableserver/disk/_diskio",
    "tableserver/common/_take",
    "client/tableclient/graph/_flags",
    "client/tableclient/graph/poller/_native",
) + (  # the poller's rdma source, built where libibverbs' headers are (CI installs them: libibverbs-dev)
    ("client/tableclient/graph/poller/_verbs",) if Path("/usr/include/infiniband/verbs.h").exists() else ()
)
REPORT = re.compile(
    r"ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|UndefinedBehaviorSanitizer|SUMMARY: \w+Sanitizer"
)


def runtime(cc: str, name: str) -> str:
    """The sanitizer runtime ``name`` of compiler ``cc`` (gcc prints the bare name when it has none)."""
    path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        sys.exit(f"sanitize: {cc} has no {name}: install gcc (Debian's libgcc-*-dev brings libasan and libubsan)")
    return os.path.realpath(path)


def copy_tree(tree: Path) -> None:
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.so", ".hypothesis", ".pytest_cache", "build", "*.egg-info")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=skip, symlinks=True)
        else:
            shutil.copy2(src, tree / name)


def build(tree: Path, work: Path, cc: str) -> None:
    env = dict(os.environ, CFLAGS=CFLAGS, LDFLAGS=SANITIZE, TABLESERVER_REQUIRE_NATIVE="1", CC=cc)
    env.pop("TABLESERVER_BUILD_NATIVE", None)
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force", "-t", str(work / "tmp")]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"sanitize: the sanitized build failed ({shlex.join(cmd)} in {tree}):\n{res.stdout}{res.stderr}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for ext in EXTENSIONS:
        so = tree / f"{ext}{suffix}"
        if not so.exists() or b"__asan_" not in so.read_bytes():
            sys.exit(f"sanitize: {so} missing or not instrumented after the build")


def run_step(name: str, cmd: list[str], cwd: Path, env: dict, logs: Path) -> tuple[bool, float]:
    """Runs one step, its output streamed; whether it ran clean (exit 0, no report) and how long it took."""
    print(f"sanitize: {name}: {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    reports = []
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "errors": "replace"}
    with subprocess.Popen(cmd, cwd=cwd, env=env, **pipe) as p:
        for line in p.stdout:
            sys.stdout.write(line)
            if REPORT.search(line):
                reports.append(line.rstrip())
    took = time.monotonic() - t0
    kept = logs / name.replace(" ", "-")  # this step's report files, out of the next step's way
    for f in sorted(f for f in logs.iterdir() if f.is_file()):
        if f.stat().st_size:
            print(f"sanitize: report {f}:\n{f.read_text(errors='replace')}", file=sys.stderr, flush=True)
            reports.append(str(f))
            kept.mkdir(exist_ok=True)
            f.rename(kept / f.name)
        else:
            f.unlink()
    ok = p.returncode == 0 and not reports
    print(
        f"sanitize: {name}: {'clean' if ok else 'FAILED'} in {took:.0f} s (exit {p.returncode}, {len(reports)} reports)",
        flush=True,
    )
    return ok, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "sanitize", help="where the copy is built")
    ap.add_argument("--iterations", type=int, default=150, help="stress.py's iterations (of each part)")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("SANITIZE_SEED", time.time_ns() % 1000003)))
    ap.add_argument("--skip-tests", action="store_true", help="the stress run only")
    a = ap.parse_args()
    work = a.dir.resolve()
    tree, logs = work / "tree", work / "logs"
    cc = (sysconfig.get_config_var("CC") or "gcc").split()[0]
    t0 = time.monotonic()
    copy_tree(tree)
    build(tree, work, cc)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    print(f"sanitize: built {', '.join(EXTENSIONS)} with {CFLAGS} in {tree} ({time.monotonic() - t0:.0f} s)")
    common = f"abort_on_error=1:halt_on_error=1:print_stacktrace=1:log_path={logs}"
    env = dict(
        os.environ,
        LD_PRELOAD=" ".join([runtime(cc, "libasan.so"), runtime(cc, "libubsan.so")]),
        ASAN_OPTIONS=f"detect_leaks=0:{common}/asan",
        UBSAN_OPTIONS=f"{common}/ubsan",
        PYTHONPATH=os.pathsep.join([str(tree), str(tree / "client"), str(tree / "tests" / "sanitize")]),
        TABLESERVER_SANITIZE_TREE=str(tree),
        TABLESERVER_REQUIRE_NATIVE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    steps = []
    if not a.skip_tests:
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "sanitized_build"]
        steps.append(("unit tests", [*pytest, *UNIT_TESTS]))
    stress = [sys.executable, "tests/sanitize/stress.py", "--expect-dir", str(tree)]
    steps.append(("stress", [*stress, "--iterations", str(a.iterations), "--seed", str(a.seed)]))
    failed = [name for name, cmd in steps if not run_step(name, cmd, tree, env, logs)[0]]
    took = time.monotonic() - t0
    if failed:
        print(f"sanitize: FAILED ({', '.join(failed)}) in {took:.0f} s; reports kept in {logs}", file=sys.stderr)
        return 1
    print(f"sanitize: the {len(EXTENSIONS)} extensions ran clean under ASan and UBSan ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
