"""Helpers the daemon tests share: the data protocols spoken by hand, scrapes, cgroups, one-line CLI errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
from conftest import EVENT_TIMEOUT, ROOT
from prometheus_client.parser import text_string_to_metric_families
from tableclient import TableClient

from tableserver.common.wire import HEADER, HEADER_BYTES, Status, hello_frame, recv_challenge, recv_exact
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc


def tcp_hello(s: socket.socket, session_id: bytes, secret: bytes) -> tuple[int, bytes]:
    """Answers the server's CHALLENGE on a raw tcp data connection: (status, body of the reply)."""
    nonce = recv_challenge(s)
    s.sendall(hello_frame(session_id, secret, nonce)[0])
    head = bytearray(HEADER_BYTES)
    assert recv_exact(s, memoryview(head))
    count = HEADER.unpack(head)[5]
    body = bytearray(count)
    recv_exact(s, memoryview(body))
    return HEADER.unpack(head)[2], bytes(body)


def shm_hello(s: socket.socket, session_id: bytes, secret: bytes):
    """Answers the CHALLENGE on a raw shm connection: (the reply message, the fds that came with it)."""
    from tableserver.common.wire import parse_challenge

    nonce = parse_challenge(s.recv(4096))
    s.send(hello_frame(session_id, secret, nonce, request_id=1)[0])
    msg, fds, _, _ = socket.recv_fds(s, 1 << 20, 16)
    return msg, fds


def open_raw_session(address: str, transports=("tcp",)):
    """A session opened with the generated stubs (no keepalive: the lease reclaims it)."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.TableServiceStub(ch)
        return stub.OpenSession(
            pb.OpenSessionRequest(client_name="raw", transports=list(transports)), timeout=EVENT_TIMEOUT
        )


def shm_fds(daemon) -> list[int]:
    """The table fds the shm transport hands a freshly opened session."""
    resp = open_raw_session(daemon.address, ("shm",))
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(daemon.ready["shm"])
        msg, fds = shm_hello(s, resp.session_id, resp.secret)
    assert HEADER.unpack_from(msg)[2] == Status.OK
    return fds


def gather_worker(address: str, path: str, seed: int, steps: int, results, batch: int = 64, **client_kwargs):
    """A client process: decode steps over both Engram tables, each checked bit-exact against the file.

    Puts ``(seed, "ok")`` or ``(seed, what went wrong)`` on ``results``.
    """
    from conftest import local_tables
    from tableclient import TableClient

    local = local_tables(path)
    try:
        with TableClient(address, client_name=f"worker-{seed}", **client_kwargs) as c:
            if "transport" in client_kwargs:
                assert c.transport == client_kwargs["transport"]
            rng = np.random.default_rng(seed)
            l1, l14 = c.table("engram.layer1"), c.table("engram.layer14")
            for _ in range(steps):
                ids1, ids14 = rng.integers(0, l1.rows, (batch, 24)), rng.integers(0, l14.rows, (batch, 24))
                h1, h14 = c.gather_many([(l1, ids1), (l14, ids14)])
                if not (
                    np.array_equal(h1.wait(120), local[l1.name][ids1])
                    and np.array_equal(h14.wait(120), local[l14.name][ids14])
                ):
                    results.put((seed, "mismatch"))
                    return
        results.put((seed, "ok"))
    except Exception as e:  # reported to the parent
        results.put((seed, repr(e)))


def run_workers(configs: list[dict], address: str, path: str, steps: int, batch: int = 64) -> dict:
    """Runs one spawned gather_worker per config concurrently; returns {seed: outcome}."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=gather_worker, args=(address, path, seed, steps, results, batch), kwargs=kw)
        for seed, kw in enumerate(configs)
    ]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=EVENT_TIMEOUT) for _ in procs)
    for p in procs:
        p.join(EVENT_TIMEOUT)
    return outcomes


def scrape(address: str) -> dict:
    """name -> metric family, from a live /metrics endpoint."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=EVENT_TIMEOUT) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    """Sum of the samples of ``name`` (sample name ``sample``) whose labels include ``labels``."""
    family = name[: -len("_total")] if name.endswith("_total") and name not in families else name
    fam = families[family]
    sample = sample or (family + "_total" if fam.type == "counter" else name)
    return sum(
        s.value for s in fam.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def make_cgroup(controller: str, name: str):
    """A fresh cgroup of ``controller`` this test may limit: (its directory, "v1" or "v2"), or None where
    no such hierarchy is writable. Members are written to <dir>/cgroup.procs; the caller removes it."""
    import os

    v1 = os.path.join("/sys/fs/cgroup", controller)
    if os.access(os.path.join(v1, "cgroup.procs"), os.W_OK):
        d = os.path.join(v1, name)
        os.mkdir(d)
        return d, "v1"
    for v2 in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        try:
            with open(os.path.join(v2, "cgroup.controllers")) as f:
                if controller not in f.read().split():
                    continue
            with open(os.path.join(v2, "cgroup.subtree_control"), "a") as f:
                f.write("+" + controller)
            d = os.path.join(v2, name)
            os.mkdir(d)
            return d, "v2"
        except OSError:
            continue
    return None


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (tableserver/ops/demo_run.py's)."""
    from tableserver.ops.demo_run import freeze as freeze_process

    freeze_process(pid, EVENT_TIMEOUT)


def run_fresh(code: str, env: dict, prelude: str = "") -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter from the repository root, as an engine's process starts: ``prelude``
    (a module of tests/) imported first, no TABLESERVER_* variables but those in ``env``."""
    import os
    import sys

    from conftest import ROOT

    environ = {k: v for k, v in os.environ.items() if not k.startswith("TABLESERVER_")}
    environ.update(env)
    head = f"import sys; sys.path[:0] = ['tests', 'tests/support']; import {prelude}\n" if prelude else ""
    return subprocess.run(
        [sys.executable, "-c", head + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=EVENT_TIMEOUT,
    )


def as_version(dist: str, version: str, code: str) -> str:
    """``code`` run where importlib.metadata reports ``dist`` at ``version``."""
    return (
        "import importlib.metadata as m; real = m.version\n"
        f"m.version = lambda name: {version!r} if name == {dist!r} else real(name)\n" + code
    )


def resident_share(path: str, start: int, end: int) -> float:
    """Share of the file's bytes [start, end) in the page cache (mincore): what a loader read of it."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start -= start % page
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            addr = np.frombuffer(m, np.uint8).ctypes.data
            pages = (end - start + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(ctypes.c_void_p(addr + start), ctypes.c_size_t(end - start), vec) == 0
            return sum(v & 1 for v in vec) / pages
        finally:
            m.close()


def rows_changed_after_cancel(table, ids: np.ndarray, trials: int) -> list[int]:
    """Races ``cancel()`` against the waiter of ``trials`` gathers of ``ids`` from ``table``, each into an
    ``out`` filled with a sentinel: this thread cancels as soon as the gather's requests are done (the
    waiter's thread then expands duplicates or reorders shards into ``out``), snapshots ``out`` the moment
    cancel returns (every 61st row first, a copy that takes no time, then all of it) and compares once the
    waiter has ended. Per trial: rows of ``out`` written after cancel() returned (a barrier leaves 0 in
    every trial)."""
    import threading
    import time

    from tableclient import TableClientError

    out = np.empty(ids.shape + (table.row_bytes,), np.uint8)
    changed = []

    def wait(handle):
        try:
            handle.wait(EVENT_TIMEOUT)
        except TableClientError:
            pass  # cancelled: what a waiter of a cancelled gather may get

    for _ in range(trials):
        out.fill(0x5A)
        handle = table.gather_async(ids, out=out)
        waiter = threading.Thread(target=wait, args=(handle,))
        waiter.start()
        while not handle.done():  # the rows are in: the waiter is about to write them into out
            time.sleep(0.0002)
        handle.cancel()
        sample = out.reshape(-1, table.row_bytes)[::61].copy()  # before a writer still running gets far
        snapshot = out.copy()
        waiter.join(EVENT_TIMEOUT)
        assert not waiter.is_alive(), "the waiter of a cancelled gather never returned"
        late = (out != snapshot).any(axis=-1).reshape(-1)
        late[::61] |= (out.reshape(-1, table.row_bytes)[::61] != sample).any(axis=-1)
        changed.append(int(late.sum()))
    return changed


def client_rows(table: str, layer: int, transport: str) -> float:
    """Row ids this process's clients asked for from ``table`` over ``transport`` (the client's own
    tableserver_client_rows_total; collecting it applies the deferred counts first)."""
    from prometheus_client import REGISTRY

    labels = {"table": table, "layer": str(layer), "transport": transport}
    return REGISTRY.get_sample_value("tableserver_client_rows_total", labels) or 0.0


def assert_one_line_error(res, *needles, code=None):
    assert res.returncode != 0 if code is None else res.returncode == code, res
    err = res.stderr.strip().splitlines()
    assert err, "no error printed"
    last = err[-1]
    assert last.startswith("tableserver: error: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in last, last


def assert_still_serving(daemon, demo_local):
    for transport in ("tcp", "shm"):
        with TableClient(daemon.address, transport=transport) as c:
            ids = np.random.default_rng(0).integers(0, 50_000, (64, 24))
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])


def tuple_of(hostport: str):
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def parse_serve_flags(argv: list[str]):
    """``argv`` parsed by the serve flags alone (tableserver.config.add_flags), as resolve() takes them."""
    import argparse

    from tableserver.config import add_flags

    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(argv)


def free_port_block(n: int = 3) -> int:
    """A control port whose next n-1 ports (tcp data, metrics) are free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            socks = []
            for k in range(n):
                t = socket.socket()
                t.bind(("127.0.0.1", base + k))
                socks.append(t)
            for t in socks:
                t.close()
            return base
        except OSError:
            for t in socks:
                t.close()
    raise RuntimeError("no free port block")


def run_ranks(script: str, daemons: list, argv) -> list[list[dict]]:
    """``tests/support/<script> RANK WORLD PORT *argv(rank, daemon)``, one process a rank (one per daemon, a
    gloo group on a free port), all at once: each rank's printed JSON lines, once every rank exited 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path, world = os.path.join(ROOT, "tests", "support", script), str(len(daemons))
    ranks = [
        subprocess.Popen(
            [sys.executable, path, str(rank), world, str(port), *argv(rank, d)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for rank, d in enumerate(daemons)
    ]
    reports = []
    for proc in ranks:
        out, err = proc.communicate(timeout=EVENT_TIMEOUT)
        assert proc.returncode == 0, err[-3000:]
        reports.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return reports


def stream_step(g, ids: dict, tokens: int, layers=None, published: dict | None = None) -> dict:
    """What a replayed graph does for one step of ``tokens`` tokens at a GraphStep ``g`` (no GPU: its
    HostStreamOps): publish the in_graph layers' ids (the hasher's output), then each layer's copy of its rows;
    in a thread of its own, as a stream is. {layer: rows [tokens, 24, row_bytes]}; ``published`` gets when
    each layer's ids went out (time.monotonic())."""
    import threading
    import time

    import torch

    out, errors = {}, []
    layers = g.layers if layers is None else layers

    def run():
        try:
            for layer in layers:
                if published is not None:
                    published[layer] = time.monotonic()
                g.publish_ids(layer, torch.from_numpy(ids[layer][:tokens]))
            for layer in layers:
                rows = g.rows(layer, tokens).clone().numpy()
                out[layer] = rows.reshape(tokens, 24, rows.shape[-1])
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(EVENT_TIMEOUT)
    assert not t.is_alive(), "the stream was left waiting"
    if errors:
        raise errors[0]
    return out


_FORK_CASES = r"""
import json, os, sys, tempfile, traceback
{preload}
cases, said = json.loads(os.environ.pop("PLUGIN_CASES")), {}
for name, (env, code) in cases.items():
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.environ.update(env)
            status = 0
            try:
                exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as e:  # what the interpreter does with it
                if e.code is None or isinstance(e.code, int):
                    status = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
                    status = 1
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        _, wait = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        said[name] = [os.waitstatus_to_exitcode(wait), out.read(), err.read()]
print(json.dumps(said))
"""


def fork_cases(preload: str) -> str:
    """A ``python -c`` script that runs ``preload`` (an engine's plugin framework imported, no plugin loaded) once,
    then forks a process a case of ``$PLUGIN_CASES`` ({name: [env, code]}) before any plugin is loaded: each sets
    its environment and runs its code, exiting as the interpreter would. Prints {case: [exit status, stdout,
    stderr]}."""
    return _FORK_CASES.replace("{preload}", preload, 1)
