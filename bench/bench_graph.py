#!/usr/bin/env python3
"""Served layers inside captured decode graphs (tableclient.graph.step), the modes side by side.

    python bench/bench_graph.py [--steps 200] [--buckets 1,8,64] [--transports shm,tcp] [--out bench/out]
    python bench/bench_graph.py --device cpu --steps 20     (the same steps, eagerly, flags on the host)
    python bench/bench_graph.py --stage probe|node|modes|faults   (one stage; bench/gpu_check.sh runs them)
    python tests/rdma/vm.py -- "python bench/bench_graph.py --device cpu --stage wake --transports rdma \\
        --steps 100 --condition-s 40"                  (the wake stage over rdma, in the Soft-RoCE guest)

Stages (all by default): ``probe``, the start-up probe of stream memory operations
(tableclient.graph.streams: a write and a wait captured, replayed, released from a host thread);
``node``, both layers in graph mode ``device`` over this host's daemon at buckets 1/64/512
(``--node-buckets``): the graph's own kernel gathers the rows from the registered mapping, and the GPU
time from the step's start to layer 1's rows (against its window) and layer 14's wait are reported;
``modes``, the graph-mode sets below side by side on the same steps; ``faults``, a frozen and a killed
server under each mode that releases rows in the graph; ``wake``, the in_graph poller (native and
Python) at 64 tokens a step: from the graph's ids flag to its rows released, stamped by a native stand-in
for the GPU (the poller's release time itself: the stand-in's own wake-up on a crowded machine is not the
GPU's), quiet, beside a busy Python thread and beside a thread that holds the GIL inside C, against
the bare gather of the same ids through the same client, both paced as decode steps come (``--pace-ms``)
and taking turns in blocks; and the watchdog with the server frozen and the GIL held in C for a second.
Under each native poller's condition two more lines say what the host did to the poller's thread meanwhile
(``Witness``, from /proc: its waits for its CPU, preemptions, migrations, and a pinned poller's CPU's
interrupts and stolen time) and the p99 of the steps in which it never waited for its CPU, so a miss
reads as the poller's own or as the scheduler's.

Needs a CUDA GPU for graphs (exits 2 without one, unless --device cpu). A real tableserver serves the
demo table file. Per graph-mode set -- both layers before_replay; layer 1 before_replay and layer 14
in_graph; both in_graph -- one CUDA graph per batch bucket is captured, each holding what a decode step
holds for the served layers: a stand-in hasher (the step's row ids from its tokens, on the device),
each in_graph layer's ids published to the host, layer 1's copy from the staging, GPU work standing in
for layers 2..13 (``--gap-ms``), and layer 14's copy (an in_graph layer waits for its flag first). Each
step: new tokens into the graph's static buffer (as SGLang's load_batch does), the host part
(before_replay gathers, arm), the replay, and every row checked bit-exact against the table file.

Reported per mode, transport and bucket (p50 / p99 over the steps):
* host before replay: the time the GPU stays idle before the step because of the mode (before_replay
  layers gather here; in_graph layers only arm);
* blocked in graph: CUDA-event time from just before layer 14's flag wait to just after it (0 when the
  rows were released before the GPU got there: the gather was hidden behind layers 2..13);
* step: host clock from the tokens' copy to the replay's end.
The in_graph poller's wake-up (ids flag to rows released, over shm, flags on the host) is measured quiet
and with a GIL-holding Python thread beside it. Then the server is frozen (SIGSTOP: the gather hangs, the watchdog releases the flag at the layer's 2 s
timeout), then killed, and after each one more step of each in_graph mode is replayed: it must complete
(policy ``zeros``), layer 14 zero rows -- or, over shm, the table's rows while the server's tables are
still mapped -- and nothing else.

Writes ``graph.txt`` (``graph-<stage>.txt`` for one stage) into --out. Every line is printed (and flushed)
as it is measured.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

import numpy as np
from prometheus_client import REGISTRY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tableclient import TableClient  # noqa: E402
from tableclient.graph.poller.cpu import parse_cpus  # noqa: E402
from tableclient.graph.step import GraphStep, HostStreamOps  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

from tableserver.common.model import ROWS_PER_TOKEN, WINDOWS_S  # noqa: E402
from tableserver.ops.demo_run import ensure_demo_file, freeze, start_server  # noqa: E402
from tableserver.tables.tablefile import read_header  # noqa: E402

MODES = {
    "before_replay": {},
    "layer14_in_graph": {14: "in_graph"},
    "both_in_graph": {1: "in_graph", 14: "in_graph"},
    "both_device": {1: "device", 14: "device"},  # shm only: the graph reads this host's mapping itself
}
STAGES = ("probe", "node", "modes", "faults", "wake")
#: the wake stage's pollers, in the order it runs them
POLLERS = ("native", "native-rt", "python", "native-pin")
#: the wake stage's longest condition by default (seconds, ``--condition-s``): a slow poller's p99 comes from
#: the steps it got through
WAKE_CONDITION_S = 12.0
#: what the wake stage measures per poller: the bare gather (the baseline) and the poller's three conditions
WAKE_KINDS = ("bare", "quiet", "busy", "gil-in-C")
#: the wake stage's steps of one kind in a row, after one untimed step that lets its condition settle; the
#: kinds take turns in rounds, the order rotated each round, so the host's slower drifts (its other tenants,
#: its clock, its caches) fall on every kind alike instead of on whichever ran during them
BLOCK_STEPS = 20
#: a poller's wait for its CPU that the wake stage counts against a step (us)
LOST_US = 20
#: untimed steps first, the bare gather's and each poller's: a connection's first use (an rdma client's first
#: READs, a poller's endpoint) is not a step's wake-up
WARM_STEPS = 3
PLANS = [LayerPlan(1, "engram.layer1", WINDOWS_S[1]), LayerPlan(14, "engram.layer14", WINDOWS_S[14])]


def pct(a, q) -> float:
    return float(np.percentile(np.asarray(a), q)) if len(a) else float("nan")


class Model:
    """What a decode graph holds for the served layers, on fixed buffers."""

    def __init__(self, torch, g: GraphStep, rows: dict, max_bs: int, device, gap_iters: int):
        self.torch, self.g, self.device, self.gap_iters = torch, g, device, gap_iters
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)  # load_batch's static input
        rng = np.random.default_rng(7)
        # the stand-in hasher: id = (token * mult + add) % rows, per layer and column
        self.mult = {layer: torch.from_numpy(rng.integers(1, 1 << 20, ROWS_PER_TOKEN)).to(device) for layer in rows}
        self.add = {layer: torch.from_numpy(rng.integers(0, 1 << 20, ROWS_PER_TOKEN)).to(device) for layer in rows}
        self.rows = rows
        self.out = {
            layer: torch.zeros(
                (max_bs * ROWS_PER_TOKEN, g.device_rows[layer].shape[1]), dtype=torch.uint8, device=device
            )
            for layer in rows
        }
        self.gap_a = torch.randn(256, 256, device=device)
        self.cuda = device.type == "cuda"
        if self.cuda:
            timing = dict(enable_timing=True, external=True)
            self.start, self.l1 = torch.cuda.Event(**timing), torch.cuda.Event(**timing)
            self.before, self.after = torch.cuda.Event(**timing), torch.cuda.Event(**timing)

    def ids(self, layer: int, bs: int):
        return (self.tokens[:bs, None] * self.mult[layer] + self.add[layer]) % self.rows[layer]

    def host_ids(self, tokens: np.ndarray, layer: int) -> np.ndarray:
        return (tokens[:, None] * self.mult[layer].cpu().numpy() + self.add[layer].cpu().numpy()) % self.rows[layer]

    def forward(self, bs: int, graph: bool) -> None:
        """The captured step: hasher, publish, layer 1, layers 2..13 stand-in, layer 14."""
        g = self.g
        timed = self.cuda and graph
        if timed:
            self.start.record()
        ids = {layer: self.ids(layer, bs) for layer in self.rows}
        for layer in sorted(self.rows):  # layer 1 first
            g.publish_ids(layer, ids[layer], graph=graph)
        self.out[1][: bs * ROWS_PER_TOKEN].copy_(g.rows(1, bs, graph=graph))
        if timed:
            self.l1.record()
        x = self.gap_a
        for _ in range(self.gap_iters):
            x = (x @ self.gap_a).tanh()
        if self.cuda and graph:
            self.before.record()
        self.out[14][: bs * ROWS_PER_TOKEN].copy_(g.rows(14, bs, graph=graph))
        if self.cuda and graph:
            self.after.record()


def capture(torch, model: Model, bs: int):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-ups, as SGLang's full backend runs them: no flags
            model.forward(bs, graph=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.forward(bs, graph=True)
    return graph


def run_mode(
    torch,
    client,
    local: dict,
    modes: dict,
    buckets: list,
    steps: int,
    device,
    gap_iters: int,
    policy: str = "fail",
    faults=None,
    lines: list | None = None,
) -> tuple[list[str], dict]:
    max_bs = max(buckets)
    cpu = device.type == "cpu"
    g = GraphStep(
        client,
        PLANS,
        modes,
        max_bs,
        policy=policy,
        device=device,
        timeout=2.0,
        budgets={1: 2.0, 14: 2.0},  # rows checked bit-exact: a busy machine's slow gather is no failure here
        stream_ops=HostStreamOps(60.0) if cpu else None,
    )
    rows = {p.layer: local[p.table].shape[0] for p in PLANS}
    model = Model(torch, g, rows, max_bs, device, gap_iters)
    graphs = {} if cpu else {bs: capture(torch, model, bs) for bs in buckets}
    before_buffers = g.buffers()
    rng = np.random.default_rng(11)
    stats = {bs: {"host": [], "blocked": [], "step": [], "l1": []} for bs in buckets}
    lines = [] if lines is None else lines

    def step(bs: int) -> tuple:
        """One decode step of ``bs`` tokens: (tokens, host time before the replay, step time)."""
        tokens = rng.integers(0, 1 << 30, bs)
        t0 = time.perf_counter()
        model.tokens[:bs].copy_(torch.from_numpy(tokens))  # what SGLang's load_batch does
        if g.pre is not None:  # as SGLang's hook does: the ids computed on the device, then to the host
            g.before_replay({layer: model.ids(layer, bs).cpu().numpy() for layer in g.pre.tables})
        g.arm(bs)
        t1 = time.perf_counter()
        if cpu:
            model.forward(bs, graph=True)  # the "replay": flags on the host, this thread the stream
        else:
            graphs[bs].replay()
            torch.cuda.current_stream().synchronize()
        g.after_replay()
        return tokens, t1 - t0, time.perf_counter() - t0

    try:
        for i in range(steps * len(buckets)):
            bs = buckets[i % len(buckets)]
            tokens, host_s, step_s = step(bs)
            host_ids = {layer: model.host_ids(tokens, layer) for layer in rows}
            for p in PLANS:
                got = model.out[p.layer][: bs * ROWS_PER_TOKEN].cpu().numpy()
                want = local[p.table][host_ids[p.layer].reshape(-1)]
                if not np.array_equal(got, want):
                    raise SystemExit(
                        f"FAIL: {modes or 'before_replay'} bucket {bs} step {i}: layer {p.layer} rows "
                        "differ from the table file"
                    )
            s = stats[bs]
            s["host"].append(host_s)
            s["step"].append(step_s)
            if not cpu:
                s["blocked"].append(model.before.elapsed_time(model.after) * 1e-3)
                s["l1"].append(model.start.elapsed_time(model.l1) * 1e-3)
        assert g.buffers() == before_buffers, "a buffer the graphs touch moved"
        for bs in buckets:
            s = stats[bs]

            def gpu(key):
                return f"{pct(s[key], 50) * 1e6:>9.0f}{pct(s[key], 99) * 1e6:>8.0f}" if s[key] else f"{'-':>9}{'-':>8}"

            line = (
                f"{bs:>6}{pct(s['host'], 50) * 1e6:>10.0f}{pct(s['host'], 99) * 1e6:>8.0f}{gpu('l1')}{gpu('blocked')}"
                f"{pct(s['step'], 50) * 1e6:>10.0f}{pct(s['step'], 99) * 1e6:>8.0f}"
            )
            if s["l1"]:
                line += f"   layer 1 within its {WINDOWS_S[1] * 1e6:.0f} us: {np.mean(np.array(s['l1']) <= WINDOWS_S[1]):.0%}"
            say(lines, line)
        seen = {}
        for fault, act in (faults or {}).items() if g.modes.get(14) in ("in_graph", "device") else ():
            act()  # the server freezes, then dies: each next replay must still complete, layer 14 zero-filled
            bs = buckets[-1]
            tokens, _, took = step(bs)
            got = model.out[14][: bs * ROWS_PER_TOKEN].cpu().numpy()
            want = local["engram.layer14"][model.host_ids(tokens, 14).reshape(-1)]
            # zero rows (the policy), or the table's rows where they were still mapped (shm): nothing else
            seen[fault] = (
                took,
                "zero rows"
                if not got.any()
                else "the table's rows (still mapped)"
                if np.array_equal(got, want)
                else None,
            )
    finally:
        g.close()
    return lines, seen


def gil_section(torch, client, local: dict, steps: int) -> list[str]:
    """The in_graph poller's wake-up behind a busy Python thread: from the graph's ids flag to its rows
    released, with the flags on the host (this thread plays the stream), quiet and with a thread that
    holds the GIL (a pure-Python loop) beside it. The poller waits natively; its gather needs the GIL."""
    import threading

    g = GraphStep(
        client,
        PLANS,
        {14: "in_graph"},
        8,
        policy="fail",
        device=torch.device("cpu"),
        timeout=5.0,
        stream_ops=HostStreamOps(60.0),
    )
    rng = np.random.default_rng(3)
    lines = [
        f"in_graph wake-up (ids flag -> rows released, 8 tokens, switch interval {sys.getswitchinterval() * 1e3:g} ms):"
    ]
    try:
        for busy in (False, True):
            stop = threading.Event()

            def spin():
                x = 0
                while not stop.is_set():
                    x += 1

            spinner = threading.Thread(target=spin) if busy else None
            if spinner is not None:
                spinner.start()
            took = []
            try:
                for _ in range(steps):
                    ids = rng.integers(0, local["engram.layer14"].shape[0], (8, ROWS_PER_TOKEN))
                    g.arm(8)
                    t0 = time.perf_counter()
                    g.publish_ids(14, torch.from_numpy(ids))
                    got = g.rows(14, 8)
                    took.append(time.perf_counter() - t0)
                    if not np.array_equal(got.numpy().reshape(8, ROWS_PER_TOKEN, -1), local["engram.layer14"][ids]):
                        raise SystemExit("FAIL: in_graph rows differ from the table file")
            finally:
                stop.set()
                if spinner is not None:
                    spinner.join()
            lines.append(
                f"  {'a busy Python thread beside it' if busy else 'quiet':<32}p50 {pct(took, 50) * 1e6:>7.0f} us"
                f"   p99 {pct(took, 99) * 1e6:>7.0f} us"
            )
    finally:
        g.close()
    return lines


def say(lines: list, line: str) -> None:
    """A figure as soon as it is measured: printed and flushed (a crash later loses none), and kept."""
    print(line, flush=True)
    lines.append(line)


def header(lines: list) -> None:
    say(
        lines, f"{'bucket':>6}{'host before replay us':>18}{'layer 1 ready':>17}{'blocked in graph':>17}{'step us':>18}"
    )
    say(lines, f"{'':>6}{'p50':>10}{'p99':>8}{'p50':>9}{'p99':>8}{'p50':>9}{'p99':>8}{'p50':>10}{'p99':>8}")


def stage_probe(torch, device, lines: list) -> bool:
    """The start-up probe of stream memory operations (what GraphStep runs before in_graph layers)."""
    from tableclient.graph.cuda import DRIVER_NAMES, driver_symbols
    from tableclient.graph.errors import GraphStepError
    from tableclient.graph.streams import probe_device

    try:
        driver_symbols()
    except GraphStepError as e:
        say(lines, f"probe: {e}")
        return device.type != "cuda"
    say(lines, f"probe: cuda-bindings resolves every driver name used ({len(DRIVER_NAMES)})")
    if device.type != "cuda":
        say(lines, "probe: no CUDA device: the capture, replay and release are not run here")
        return True
    try:
        took = probe_device(torch, device.index or 0)
    except GraphStepError as e:
        say(lines, f"probe: FAILED: {e}")
        return False
    say(lines, f"probe: write and wait captured, replayed, released from a host thread: ok in {took * 1e3:.1f} ms")
    return True


class Disturber:
    """A thread beside the measurement: ``busy`` spins in Python (it holds the GIL but for switch
    intervals), ``gil-in-C`` calls usleep(2 ms) through ctypes.PyDLL, holding the GIL in C each time."""

    def __init__(self, kind: str):
        import ctypes
        import threading

        self.kind, self.stop = kind, threading.Event()
        libc = ctypes.PyDLL(None)

        def spin():
            x = 0
            while not self.stop.is_set():
                x += 1

        def hold():
            while not self.stop.is_set():
                libc.usleep(2000)

        self.thread = None if kind == "quiet" else threading.Thread(target=spin if kind == "busy" else hold)

    def __enter__(self):
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def graph_waits(since: tuple | None = None):
    """Layer 14's in_graph waits the poller itself timed (ids seen -> rows released; the client's
    ``tableserver_client_graph_wait_seconds``): (sum, count) now, or the mean since ``since``."""
    labels = {"layer": "14", "phase": "in_graph"}
    now = tuple(
        REGISTRY.get_sample_value(f"tableserver_client_graph_wait_seconds_{part}", labels) or 0.0
        for part in ("sum", "count")
    )
    if since is None:
        return now
    return (now[0] - since[0]) / max(now[1] - since[1], 1.0)


class Witness:
    """What the host did to the native poller's thread, read from /proc (counters since boot: a block's share
    is the difference of two readings): the time it was runnable but not running (schedstat), its involuntary
    switches and its migrations; and, while it is pinned to ``cpu``, that CPU's interrupts, the TLB shootdowns
    among them, and the time the hypervisor stole from it. A disturbed kind's slower steps with these at the
    quiet kind's level did not come from this machine's scheduler or interrupts."""

    FIELDS = ("runnable_ms", "preempted", "migrated", "irqs", "LOC", "RES", "CAL", "TLB", "steal_ms")
    #: the interrupts named apart: the local timer, rescheduling and function-call IPIs, TLB shootdowns
    NAMED = ("LOC", "RES", "CAL", "TLB")

    def __init__(self, tid: int, cpu: int | None):
        self.task, self.cpu = f"/proc/self/task/{tid}", cpu
        self.tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def find(name: str = "graph-poller") -> int | None:
        """The tid of this process's thread called ``name`` (the native poller's PR_SET_NAME), or None."""
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == name:
                        return int(tid)
            except OSError:
                continue
        return None

    def kept_off(self) -> int:
        """The poller's time runnable but not running since it started, ns (schedstat's run delay: added up
        each time it gets its CPU back, so exact between readings when it is running at both)."""
        try:
            with open(f"{self.task}/schedstat") as f:
                return int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    def __call__(self) -> np.ndarray:
        got = np.zeros(len(self.FIELDS))
        try:
            got[0] = self.kept_off() / 1e6
            with open(f"{self.task}/status") as f:
                got[1] = next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
            with open(f"{self.task}/sched") as f:
                got[2] = next((int(line.split()[-1]) for line in f if line.startswith("se.nr_migrations")), 0)
        except (OSError, StopIteration, ValueError):
            got[:3] = np.nan  # the thread ended, or this kernel keeps no such count
        if self.cpu is not None:
            with open("/proc/interrupts") as f:
                header = f.readline().split()
                column = header.index(f"CPU{self.cpu}")
                for line in f:
                    parts = line.split()  # a count per CPU after the name (ERR and MIS: one, for all)
                    if len(parts) > len(header) and parts[column + 1].isdigit():
                        got[3] += int(parts[column + 1])
                        if parts[0][:-1] in self.NAMED:
                            got[4 + self.NAMED.index(parts[0][:-1])] = int(parts[column + 1])
            with open("/proc/stat") as f:
                row = next(line.split() for line in f if line.startswith(f"cpu{self.cpu} "))
            got[8] = int(row[8]) * self.tick_ms if len(row) > 8 else np.nan
        else:
            got[3:] = np.nan
        return got

    def describe(self, seen: np.ndarray, steps: int) -> str:
        """One block sum (``seen``, over ``steps`` timed steps) as a line's tail, per 100 steps."""
        per = 100.0 / max(steps, 1)
        r, p, m, irqs, timer, resched, call, tlb, steal = seen * per
        out = f"per 100 steps: runnable, not running {r:.2f} ms, preempted {p:.0f}, migrated {m:.0f}"
        if self.cpu is not None:
            out += (f"; CPU {self.cpu}: {irqs:.0f} interrupts (timer {timer:.0f}, rescheduling {resched:.0f}, "
                    f"function call {call:.0f}, TLB shootdown {tlb:.0f}), stolen {steal:.0f} ms")  # fmt: skip
        return out


def cpu_waits(took: list, kept: list) -> str:
    """In how many of a kind's steps the poller waited over LOST_US for its CPU (another thread ran there),
    from arm to rows, and the p99 of the other steps: a p99 that meets its goal without them missed it
    through the host's scheduler, not through the poller."""
    took, kept = np.asarray(took), np.asarray(kept, np.float64) / 1e3
    if took.size == 0 or kept.size != took.size:
        return "the poller's waits for its CPU: not read"
    waited = kept > LOST_US
    rest = f"{pct(took[~waited], 99) * 1e6:.0f} us" if (~waited).any() else "none"
    most = f", {kept.max():.0f} us at most" if waited.any() else ""
    return (f"the poller waited over {LOST_US} us for its CPU in {waited.sum()} of {took.size} steps{most}; "
            f"p99 of the other steps {rest}")  # fmt: skip


def layout(cpus: list, poller_cpu: int, transport: str) -> tuple:
    """(the engine's CPUs, the server's) for the native-pin rows over ``transport``, the poller's CPU apart.
    A tcp server stands for another host (a memory node), so it gets CPUs the engine's threads do not run
    on, the upper half of the rest; with one CPU left besides the poller's (a 2-vCPU VM) it shares the
    poller's, which sleeps in poll() while a tcp request is out. Over shm the daemon is a process of this
    host, and over rdma the NIC answers READs: no server thread is on the step's path, and an operator who
    keeps a core for the poller keeps the daemon off it too, so with one CPU left the daemon shares the
    engine's."""
    rest = [c for c in cpus if c != poller_cpu]
    if len(rest) < 2:
        return rest, ([poller_cpu] if transport == "tcp" else rest)
    return rest[: len(rest) // 2], rest[len(rest) // 2 :]


def place(where: dict) -> dict:
    """Every thread of each pid in ``where`` on its CPUs (as an operator's taskset, isolcpus or a memory
    node's own cores would place them); what each thread's CPUs were, for :func:`restore`. Threads started
    later inherit their starter's."""
    saved = {}
    for pid, cpus in where.items():
        for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
            try:
                saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
                saved.pop(tid, None)
    return saved


def restore(saved: dict) -> None:
    for tid, cpus in saved.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass


def rotation(kinds: tuple, steps: int, pace: float, step, waits=None, unplaced: dict | None = None,
             budget_s: float = WAKE_CONDITION_S, witness=None) -> dict | None:  # fmt: skip
    """Runs ``steps`` timed steps of each kind, in blocks of BLOCK_STEPS taking turns (the order rotated each
    round), each block inside its :class:`Disturber` (``bare`` and ``quiet`` beside nothing) and led by one
    untimed step; a block of ``bare, unplaced`` runs with every thread of each pid in ``unplaced`` on the
    CPUs given there, each thread put back where it was after. ``step(kind)`` runs one step and returns
    (when its ids went out, monotonic; its latency[, the ns its poller waited for a CPU meanwhile]), or None
    when it failed (then so does this). Steps are
    paced: one's ids no sooner than ``pace`` after the previous step's, whatever its kind. A kind that has
    used ``budget_s`` seconds stops where it is. Returns {kind: {"took": latencies, "gaps": each timed step's
    time since the previous step's ids, "waited": the mean of ``waits()``' (sum, count) over its timed
    steps, "seen": what ``witness()`` (a :class:`Witness`) counted over them, summed, "kept": the steps'
    poller's waits for its CPU, ns, where ``step`` returned them}}."""
    out = {k: {"took": [], "gaps": [], "sums": [0.0, 0.0], "spent": 0.0, "seen": 0.0, "kept": []} for k in kinds}
    last = None
    for r in range(-(-steps // BLOCK_STEPS)):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            o = out[kind]
            want = min(BLOCK_STEPS, steps - len(o["took"]))
            if want <= 0 or o["spent"] > budget_s:
                continue
            start, before, seen = time.monotonic(), None, None
            moved = place(unplaced) if kind == "bare, unplaced" else {}
            try:
                with Disturber(kind if kind in ("busy", "gil-in-C") else "quiet"):
                    for i in range(1 + want):
                        if pace and last is not None:
                            time.sleep(max(0.0, last + pace - time.monotonic()))
                        got = step(kind)
                        if got is None:
                            return None
                        published, took = got[:2]
                        if i:
                            o["took"].append(took)
                            o["gaps"].append(published - last)
                            o["kept"].extend(got[2:])
                        else:  # from the first timed step on
                            before = waits() if waits is not None else None
                            seen = witness() if witness is not None else None
                        last = published
            finally:
                restore(moved)
            o["spent"] += time.monotonic() - start
            if seen is not None:
                o["seen"] = o["seen"] + witness() - seen
            if before is not None:
                after = waits()
                o["sums"] = [o["sums"][0] + after[0] - before[0], o["sums"][1] + after[1] - before[1]]
    for o in out.values():
        o["waited"] = o["sums"][0] / max(o["sums"][1], 1.0)
    return out


def stage_wake(torch, path: str, tmp: str, local: dict, transports: list, steps: int, lines: list,
               poller_cpu: int = -1, cpus: tuple = (), pollers: tuple = POLLERS, pace: float = 0.0,
               condition_s: float = WAKE_CONDITION_S) -> bool:  # fmt: skip
    """ids published -> rows released for an in_graph layer 14 at 64 tokens, per transport and poller,
    quiet, beside a busy Python thread and beside a thread holding the GIL in C, against the bare gather of
    the same ids through the same client. Per poller the four take turns in blocks (:func:`rotation`), so
    a drift of the host between them does not read as the poller's. ``native-pin``: the native poller
    pinned to ``poller_cpu`` (poller_cpus), the bench's other threads and its server's on the CPUs
    ``cpus[transport]`` gives (:func:`layout`); its bare gather runs placed so and, in blocks of its own, on every CPU
    (the goal is judged against the faster of the two).

    Steps are paced (``pace`` seconds from one step's ids to the next's, as decode steps come), the bare
    gather's too (the back-to-back one is printed as well): a gather after a pause of milliseconds runs
    slower than one right after another (its caches cooled meanwhile), and unpaced, a disturbed condition's
    slower steps would make its ratio to quiet measure that pause.

    Run with torch's intra-op threads at 1: the host copies of the step (ids in, rows out) stand for a GPU's,
    which take no host thread, while torch's pool spins on after each parallel copy (libgomp's spin-wait)
    and took the poller's CPU in 4 ms turns on a 2-vCPU host (``perf sched timehist``)."""
    import ctypes
    import threading

    from tableclient.graph.poller import native

    if not native.BUILT:
        say(
            lines,
            "wake: tableclient.graph.poller._native is not built here (no native stand-in, no native poller): skipped",
        )
        return True
    tokens, table_rows = 64, local["engram.layer14"].shape[0]
    plan = [PLANS[1]]
    ok = True
    say(
        lines,
        f"wake: ids flag -> rows released, layer 14 in_graph, {tokens} tokens a step, {steps} steps, p50 / p99 us",
    )
    pollers = tuple(p for p in pollers if p != "native-pin" or poller_cpu >= 0)
    everywhere = sorted(os.sched_getaffinity(0))  # the bench's CPUs before any row's placement
    if poller_cpu < 0:
        say(lines, "  native-pin: not run (--poller-cpu -1, or one CPU: nothing to keep off the poller's)")
    else:
        for transport in transports:
            engine, server = cpus[transport]
            say(lines, f"  native-pin over {transport}: the poller on CPU {poller_cpu}, the bench's other threads "
                       f"on CPUs {','.join(map(str, engine))}, its server's on {','.join(map(str, server))}")  # fmt: skip
    for transport in transports:
        proc, ready = serve(path, tmp, transport)
        kept_off = {}
        try:
            with TableClient(ready["control"], transport=transport) as client:
                rng = np.random.default_rng(21)
                table = client.table("engram.layer14")
                buf = np.empty((tokens * ROWS_PER_TOKEN, 264), np.uint8)

                def bare_step(kind: str = "bare") -> tuple:
                    ids = rng.integers(0, table_rows, tokens * ROWS_PER_TOKEN)
                    t0 = time.monotonic()
                    table.gather(ids, out=buf)
                    return t0, time.monotonic() - t0

                for _ in range(WARM_STEPS):
                    bare_step()
                back = [bare_step()[1] for _ in range(steps)]
                back99 = pct(back, 99)
                say(
                    lines,
                    f"  {transport:<4} bare gather (same client, back to back){pct(back, 50) * 1e6:>8.0f} {back99 * 1e6:>8.0f}",
                )
                if transport == "rdma":
                    say(lines, "  rdma watchdog: not run (a stopped server's NIC still answers READs; "
                               "tests/rdma/test_graphpoll_rdma.py stalls the gather instead)")  # fmt: skip
                for poller in pollers:  # native-pin last: the threads stay off its CPU until the server goes
                    which = "python" if poller == "python" else "native"
                    pinned = [poller_cpu] if poller == "native-pin" else None
                    if pinned:
                        kept_off = place({os.getpid(): cpus[transport][0], proc.pid: cpus[transport][1]})
                    g = GraphStep(client, plan, {14: "in_graph"}, tokens, policy="zeros", timeout=5.0, budgets={14: 5.0},
                                  stream_ops=HostStreamOps(60.0), poller=which, realtime=poller == "native-rt",
                                  poller_cpus=pinned)  # fmt: skip
                    if which == "native" and g.poller != "native":
                        say(lines, f"FAIL: wake {transport}/{poller}: the native poller is not serving ({g.poller})")
                        ok = False
                        g.close()
                        continue
                    if poller == "native-rt" and not g.poller_realtime:
                        say(
                            lines,
                            f"  {transport:<4} native-rt: real-time priority refused here (CAP_SYS_NICE): skipped",
                        )
                        g.close()
                        continue
                    if pinned and g.poller_cpu != poller_cpu:
                        say(lines, f"  {transport:<4} native-pin: CPU {poller_cpu} not granted (held by another "
                                   "poller on this host, or outside this cpuset): skipped")  # fmt: skip
                        g.close()
                        continue
                    ids_flag, rows_flag = g.flags.index(0, 0), g.flags.index(0, 1)

                    def step(kind: str) -> tuple | None:
                        if kind.startswith("bare"):
                            return bare_step()
                        ids = rng.integers(0, table_rows, (tokens, ROWS_PER_TOKEN))
                        kept = witness.kept_off() if witness is not None else None
                        g.arm(tokens)
                        g.publish_ids(14, torch.from_numpy(ids), graph=False)  # the copy only
                        seen = native.stand_in(g.flags.host, ids_flag, rows_flag, 30.0)
                        got = g.rows(14, tokens).numpy().reshape(tokens, ROWS_PER_TOKEN, -1)
                        # the release itself: a GPU would see it at once, the stand-in sees it when this
                        # crowded machine runs it again
                        dt = None if seen is None else g.released_at(14) - seen[0]
                        if dt is None or not np.array_equal(got, local["engram.layer14"][ids]):
                            say(lines, f"FAIL: wake {transport}/{poller}/{kind}: rows differ or never came")
                            return None
                        return (seen[0], dt) if kept is None else (seen[0], dt, witness.kept_off() - kept)

                    def waits() -> tuple:
                        g.account()
                        return graph_waits()

                    # the bare gather of the native-pin rows both placed as they are and on every CPU
                    kinds = WAKE_KINDS + (("bare, unplaced",) if pinned else ())
                    unplaced = {os.getpid(): everywhere, proc.pid: everywhere}
                    tid = Witness.find() if which == "native" else None
                    witness = Witness(tid, poller_cpu if pinned else None) if tid is not None else None
                    try:
                        warm = [step("quiet") for _ in range(WARM_STEPS)]
                        got = None if None in warm else rotation(kinds, steps, pace, step, waits, unplaced,
                                                                 condition_s, witness)  # fmt: skip
                        if got is None:
                            ok = False
                            continue
                        base = min(pct(got[k]["took"], 99) for k in kinds if k.startswith("bare"))
                        for kind in kinds:
                            took, gaps = got[kind]["took"], got[kind]["gaps"]
                            p99 = pct(took, 99)
                            if kind.startswith("bare"):
                                note = f"{p99 / back99:.2f}x back to back"
                            elif kind == "quiet":
                                quiet99 = p99
                                goal = p99 <= max(1.5 * base, base + 150e-6)
                                note = (f"{p99 / base:.2f}x bare p99 (goal <= 1.5x or +150 us: "
                                        f"{'met' if goal else 'missed'}), {p99 / back99:.2f}x back to back")  # fmt: skip
                            else:
                                limit = 1.5 if kind == "busy" else 2.0
                                note = (f"{p99 / quiet99:.2f}x quiet p99 (goal <= {limit}x: "
                                        f"{'met' if p99 <= limit * quiet99 else 'missed'})")  # fmt: skip
                            if not kind.startswith("bare"):
                                note += f"; mean {np.mean(took) * 1e6:.0f} us, of it ids seen -> released {got[kind]['waited'] * 1e6:.0f} us"
                            count = "" if len(took) == steps else f"{len(took)} steps, "
                            note += f"; {count}a step every {np.mean(gaps) * 1e3:.1f} ms" if gaps else "; no step"
                            label = kind.replace("bare", "bare gather")
                            say(
                                lines,
                                f"  {transport:<4} {poller:<10} {label:<26}{pct(took, 50) * 1e6:>8.0f} {p99 * 1e6:>8.0f}   {note}",
                            )
                            if witness is not None and not kind.startswith("bare"):
                                say(lines, f"{'':<43}{witness.describe(got[kind]['seen'], len(took))}")
                                say(lines, f"{'':<43}{cpu_waits(took, got[kind]['kept'])}")
                    finally:
                        g.close()
                    if transport != "tcp":
                        continue
                    # the watchdog: the server frozen, the GIL held in C for a whole second meanwhile
                    deadline_s = 0.05
                    g = GraphStep(client, plan, {14: "in_graph"}, tokens, policy="zeros", timeout=deadline_s,
                                  budgets={14: deadline_s}, stream_ops=HostStreamOps(60.0), poller=which,
                                  realtime=poller == "native-rt", poller_cpus=pinned)  # fmt: skip
                    libc = ctypes.PyDLL(None)

                    go = threading.Event()

                    def hold_gil():
                        go.wait()  # once the ids are published: the GIL held in C for a second from then
                        libc.usleep(1_000_000)

                    try:
                        freeze(proc.pid)  # every thread stopped: none answers the step's request
                        ids = rng.integers(0, table_rows, (tokens, ROWS_PER_TOKEN))
                        holder = threading.Thread(target=hold_gil)
                        holder.start()
                        armed = time.monotonic()
                        g.arm(tokens)
                        g.publish_ids(14, torch.from_numpy(ids), graph=False)
                        published = time.monotonic()
                        go.set()  # the holder takes the GIL as this thread lets it go in the stand-in
                        seen = native.stand_in(g.flags.host, g.flags.index(0, 0), g.flags.index(0, 1), 30.0)
                        holder.join()
                        zeros = not g.rows(14, tokens).numpy().any()  # policy zeros: the watchdog's, not rows
                        dt = None if seen is None else g.released_at(14) - seen[0]
                        if dt is None or not zeros:
                            say(lines, f"FAIL: watchdog {transport}/{poller}: the step was not released with the "
                                       "policy's zero rows (the frozen server answered, or no release)")  # fmt: skip
                            ok = False
                            continue
                        late = published - armed + dt - deadline_s  # the deadline runs from the arm
                        when = (f"{dt * 1e3:.1f} ms after the ids" if dt >= 0 else
                                f"before its ids (published {(published - armed) * 1e3:.1f} ms after the arm: "
                                "this thread lost its CPU)")  # fmt: skip
                        say(lines, f"  tcp  {poller:<10} watchdog, server frozen, GIL in C 1 s: released {when}, "
                                   f"{late * 1e3:+.1f} ms past its {deadline_s * 1e3:.0f} ms deadline "
                                   f"(goal <= +10 ms: {'met' if late <= 0.010 else 'missed'})")  # fmt: skip
                    finally:
                        proc.send_signal(signal.SIGCONT)
                        g.close()
        finally:
            restore(kept_off)
            proc.kill()
            proc.wait()
    return ok


def serve(path: str, tmp: str, transport: str):
    run_dir = tempfile.mkdtemp(dir=tmp)  # a fresh daemon per run: the last one may have been killed
    return start_server(path, run_dir, ["--hugepages", "off", "--transports", transport])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per bucket and mode (default 200)")
    ap.add_argument("--buckets", default="1,8,64", help="batch buckets captured (default 1,8,64)")
    ap.add_argument("--node-buckets", default="1,64,512", help="the node stage's buckets (default 1,64,512)")
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="GPU time standing in for layers 2..13")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--stage", choices=STAGES, help="run one stage (default: all)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"))
    mine = sorted(os.sched_getaffinity(0))
    ap.add_argument("--poller-cpu", type=int, default=mine[-1] if len(mine) > 1 else -1,
                    help="the wake stage's native-pin poller's CPU, kept free of every other thread "
                         f"(default: this process's last, {mine[-1] if len(mine) > 1 else -1}; -1: no native-pin)")  # fmt: skip
    ap.add_argument("--pace-ms", type=float, default=20.0,
                    help="the wake stage's steps: one every this many ms at most often, and a bare gather paced so "
                         "(default 20, a decode step's order; 0: back to back)")  # fmt: skip
    ap.add_argument("--condition-s", type=float, default=WAKE_CONDITION_S,
                    help="the wake stage's time for each kind of step of one poller, at most (default "
                         f"{WAKE_CONDITION_S:g} s; more under emulation, where a step takes ~50 ms or more)")  # fmt: skip
    ap.add_argument("--pollers", default=",".join(POLLERS), help=f"the wake stage's (default {','.join(POLLERS)})")
    ap.add_argument("--server-cpus", default="",
                    help="the native-pin rows' server CPUs, a cpulist (default: the upper half of those left "
                         "besides the poller's; where one is left, the poller's own over tcp, that one over shm "
                         "and rdma); the bench's threads get the others (all but the poller's if none)")  # fmt: skip
    args = ap.parse_args()
    if args.poller_cpu != -1 and args.poller_cpu not in mine:
        ap.error(f"--poller-cpu {args.poller_cpu}: not one of this process's CPUs ({mine[0]}..{mine[-1]}); -1: none")
    if not 0.0 <= args.pace_ms <= 1000.0:  # nan fails both
        ap.error(f"--pace-ms {args.pace_ms:g}: from 0 (back to back) to 1000")
    if not 0.0 < args.condition_s <= 3600.0:  # nan fails both
        ap.error(f"--condition-s {args.condition_s:g}: more than 0, at most 3600")
    pollers = tuple(p for p in POLLERS if p in args.pollers.split(","))
    if not pollers or set(args.pollers.split(",")) - set(POLLERS):
        ap.error(f"--pollers {args.pollers}: name some of {','.join(POLLERS)}")
    transports = args.transports.split(",")
    placed = {t: layout(mine, args.poller_cpu, t) for t in transports}
    if args.server_cpus:
        try:
            server_cpus = parse_cpus(args.server_cpus)
        except ValueError:
            ap.error(f"--server-cpus {args.server_cpus!r}: not a cpulist: use e.g. '8-14' or '7,9'")
        if not server_cpus or not set(server_cpus) <= set(mine):
            ap.error(f"--server-cpus {args.server_cpus}: not this process's CPUs ({mine[0]}..{mine[-1]})")
        rest = [c for c in mine if c != args.poller_cpu]
        engine_cpus = [c for c in rest if c not in server_cpus] or rest  # none left: the bench shares the server's
        placed = dict.fromkeys(transports, (engine_cpus, server_cpus))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_graph: needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    stages = [args.stage] if args.stage else list(STAGES)
    buckets = [int(b) for b in args.buckets.split(",")]
    node_buckets = [int(b) for b in args.node_buckets.split(",")]
    gap_iters = 1
    if device.type == "cuda":  # iterations of the stand-in for layers 2..13 that take --gap-ms on this GPU
        a = torch.randn(256, 256, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x = a
        for _ in range(100):
            x = (x @ a).tanh()
        end.record()
        end.synchronize()
        gap_iters = max(1, int(100 * args.gap_ms / max(start.elapsed_time(end), 1e-3)))
    path = ensure_demo_file()
    local = {
        s.name: np.memmap(path, np.uint8, "r", s.offset, s.nbytes).reshape(s.rows, s.row_bytes)
        for s in read_header(path).tables
    }
    out_lines: list = []
    say(
        out_lines,
        f"bench_graph: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (eager)'}, "
        f"torch {torch.__version__}, layers 2..13 stand-in {args.gap_ms:g} ms, {args.steps} steps a bucket, "
        f"stages {', '.join(stages)}",
    )
    ok = True
    faults_of = {
        "frozen (SIGSTOP)": lambda proc: freeze(proc.pid),
        "killed": lambda proc: (proc.send_signal(signal.SIGCONT), proc.kill()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if "probe" in stages:
            ok &= stage_probe(torch, device, out_lines)
        if "node" in stages:
            say(
                out_lines,
                f"node / both_device: the graph's kernel reads this host's daemon's mapping, buckets {node_buckets}",
            )
            header(out_lines)
            proc, ready = serve(path, tmp, "shm")
            try:
                with TableClient(ready["control"], transport="shm") as client:
                    run_mode(
                        torch,
                        client,
                        local,
                        MODES["both_device"],
                        node_buckets,
                        args.steps,
                        device,
                        gap_iters,
                        lines=out_lines,
                    )
            finally:
                proc.kill()
                proc.wait()
        if "modes" in stages:
            proc, ready = serve(path, tmp, "shm")
            try:
                with TableClient(ready["control"], transport="shm") as client:
                    for line in gil_section(torch, client, local, args.steps):
                        say(out_lines, line)
            finally:
                proc.kill()
                proc.wait()
            header(out_lines)
            for transport in args.transports.split(","):
                for name, modes in MODES.items():
                    if name == "both_device" and transport != "shm":
                        continue
                    proc, ready = serve(path, tmp, transport)
                    try:
                        with TableClient(ready["control"], transport=transport) as client:
                            say(out_lines, f"{transport} / {name}")
                            run_mode(
                                torch, client, local, modes, buckets, args.steps, device, gap_iters, lines=out_lines
                            )
                    finally:
                        proc.kill()
                        proc.wait()
        if "faults" in stages:
            for transport, name in (("shm", "layer14_in_graph"), ("tcp", "layer14_in_graph"), ("shm", "both_device")):
                if transport not in args.transports.split(","):
                    continue
                proc, ready = serve(path, tmp, transport)
                try:
                    with TableClient(ready["control"], transport=transport) as client:
                        say(out_lines, f"faults: {transport} / {name}")
                        faults = {fault: (lambda act=act: act(proc)) for fault, act in faults_of.items()}
                        _, seen = run_mode(
                            torch, client, local, MODES[name], buckets[-1:], max(2, args.steps // 10), device,
                            gap_iters, policy="zeros", faults=faults, lines=[],
                        )  # fmt: skip
                        for fault, (took, rows) in seen.items():
                            say(
                                out_lines,
                                f"  server {fault}: the next replay completed in {took * 1e3:.0f} ms, "
                                f"layer 14: {rows or 'WRONG ROWS'}",
                            )
                            ok &= rows is not None
                finally:
                    proc.kill()
                    proc.wait()
        if "wake" in stages:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the stand-in's copies stand for the GPU's: see stage_wake
            say(out_lines, f"wake: torch's intra-op threads 1 (were {threads}): the host copies stand for the GPU's")
            try:
                ok &= stage_wake(
                    torch, path, tmp, local, args.transports.split(","), args.steps, out_lines, args.poller_cpu,
                    placed, pollers, args.pace_ms / 1e3, args.condition_s,
                )  # fmt: skip
            finally:
                torch.set_num_threads(threads)
    os.makedirs(args.out, exist_ok=True)
    name = f"graph-{args.stage}.txt" if args.stage else "graph.txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write("\n".join(out_lines) + "\n")
    print("PASS: every row bit-exact, every replay completed" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
