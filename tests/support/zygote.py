"""Test daemons forked from a process that imported the daemon once (a zygote), not each from a new interpreter.

Most of a test daemon's start is Python importing numpy, grpc, asyncio, prometheus_client and pyverbs before it
reads a byte of its table: under half a second of a core on the host, 10-20 s in the Soft-RoCE guest (TCG), and
the suites start some 240 daemons on the host and 25 in the guest. Each pytest process starts one zygote on its
first daemon; every later ``python -m tableserver ARGS`` it runs is a fork of it that runs exactly what that
command runs (``tableserver.cli.main``, then the interpreter's own exit: atexit handlers, threads joined) in the
command's working directory and environment, stdout and stderr where the command's would go. Only how the process
is made differs. A command that needs an exec still gets one (:func:`forkable`): one behind a wrapper (prlimit,
setpriv, a ``python -c`` prelude), a ``preexec_fn``, or an environment that is not the zygote's (a variable read
at import time would keep the zygote's value). ``TABLESERVER_TEST_ZYGOTE=0`` turns it off.

    python tests/support/zygote.py        # the zygote: JSON requests on stdin, a JSON line answered for each

A request is ``{"argv", "cwd", "env", "stdout", "stderr", "status"}`` (file paths for the two streams and for the
exit status); the answer ``{"pid"}``. The zygote reaps its children (a pidfd each) and writes each one's exit
status, as ``subprocess`` gives it (negative: killed by that signal), to its ``status`` file; at the end of its
stdin (its pytest process gone) it exits, leaving its running children to their own tests' clean-up.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

#: what ``python -m tableserver serve`` imports before it serves (optional ones skipped where missing)
PRELOAD = (
    "numpy",
    "grpc",
    "asyncio",
    "prometheus_client",
    "tableserver.cli",
    "tableserver.server",
    "tableserver.transports.tcp",
    "tableserver.transports.shm",
    "tableserver.transports.rdma",
    "tableserver.disk",
    "pyverbs.device",
    "pyverbs.qp",
    "pyverbs.mr",
    "pyverbs.cq",
    "pyverbs.pd",
)
#: environment variables whose value, differing from the zygote's, would make a fork run something else than an
#: exec would: they are read at interpreter start or at import
IMPORT_TIME_ENV = ("TABLESERVER_", "PYTHON", "LD_", "TRITON_", "GRPC_", "OMP_", "MALLOC_")
ENV_SWITCH = "TABLESERVER_TEST_ZYGOTE"


# -- the zygote's side ------------------------------------------------------------------------------------------


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _become(request: dict) -> None:
    """In the forked child: the command's streams, directory, environment and default signal dispositions."""
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = out if request["stderr"] == request["stdout"] else os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])


def _write_status(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.replace(tmp, path)


def serve() -> None:
    """The zygote's loop. Returns only in a forked child, after :func:`_become`; the zygote exits at stdin's end."""
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, None)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.data is not None:  # a child exited: reap it, say how
                pid, status = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, wait_status = os.waitpid(pid, 0)
                _write_status(status, os.waitstatus_to_exitcode(wait_status))
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    _become(request)
                    return
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, request["status"]))
                os.write(1, json.dumps({"pid": pid}).encode() + b"\n")


# -- the test process's side ------------------------------------------------------------------------------------


class Forked:
    """A forked daemon as ``subprocess.Popen`` shows one: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill`` (its exit status comes from the zygote, which reaps it)."""

    def __init__(self, args: list[str], pid: int, status: str):
        self.args, self.pid, self.returncode = args, pid, None
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._status):
            with open(self._status) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited, not reaped yet
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote process (started on first use) and the requests sent to it, one at a time."""

    def __init__(self, root: str):
        self._root = root
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._env: dict = {}
        self._dir = ""
        self._count = 0

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._env = dict(os.environ)
            self._dir = tempfile.mkdtemp(prefix="zygote-")
            self._proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                cwd=self._root, env=self._env,
            )  # fmt: skip
            atexit.register(self.close)
        return self._proc

    def forkable(self, argv: list[str], env: dict | None) -> bool:
        """Whether ``argv`` is ``python -m tableserver ...`` (this Python) in an environment the zygote can give it."""
        if os.environ.get(ENV_SWITCH, "1") == "0" or argv[:3] != [sys.executable, "-m", "tableserver"]:
            return False
        env = dict(os.environ) if env is None else env
        base = self._env if self._proc is not None else dict(os.environ)
        keys = {k for k in (*env, *base) if k.startswith(IMPORT_TIME_ENV)}
        return all(env.get(k) == base.get(k) for k in keys)

    def spawn(self, argv: list[str], stdout: str, stderr: str, env: dict | None, cwd: str) -> Forked:
        """``argv`` (:meth:`forkable`) forked, its output appended to the files ``stdout`` and ``stderr``."""
        with self._lock:
            proc = self._start()
            self._count += 1
            status = os.path.join(self._dir, f"{self._count}.exit")
            args = [os.path.join(os.path.dirname(importlib.util.find_spec("tableserver").origin), "__main__.py")]
            request = {
                "argv": [*args, *argv[3:]],
                "cwd": cwd,
                "env": dict(os.environ) if env is None else env,
                "stdout": stdout,
                "stderr": stderr,
                "status": status,
            }
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the test daemons' zygote exited ({proc.poll()}): see the test's stderr")
        return Forked(argv, json.loads(answer)["pid"], status)

    def close(self) -> None:
        """Ends the zygote (its running children stay their tests'); the exit statuses' folder goes with it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as for ``python -m``: the working directory first
    _preload()
    serve()
    # a forked child from here on: what ``python -m tableserver`` runs
    from tableserver.cli import main

    raise SystemExit(main())
