"""The graph-safe step (tableclient.graph.step) on the CPU: real daemons, real clients, and a thread standing
in for the CUDA stream -- it runs the graph's side of the flag protocol (publish the ids, wait for the rows,
copy them) exactly where a captured graph would, through HostStreamOps. Every step's rows are checked
bit-exact against the table file; faults (a dead server, a frozen one, a step whose ids never come) end in
the failure policy within the layer's timeout, and the stream is never left waiting.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, start_daemon, wait_for
from prometheus_client import REGISTRY
from tests_helpers import freeze, stream_step

torch = pytest.importorskip("torch")

from tableclient import TableClient  # noqa: E402
from tableclient.graph.step import OUTCOMES, GraphStep, GraphStepError, HostStreamOps  # noqa: E402
from tableclient.metrics import metrics  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

PLANS = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]
MAX_TOKENS = 64
POLLER = {"kind": "auto"}


@pytest.fixture(autouse=True, params=["auto", "python"])
def poller(request):
    """Every test with both pollers of in_graph layers: the native one where it serves them (auto), Python's."""
    POLLER["kind"] = request.param
    yield request.param
    POLLER["kind"] = "auto"


@pytest.fixture(scope="module")
def local(demo_file):
    return local_tables(demo_file)


def make(client, modes, **kw):
    kw.setdefault("timeout", 10.0)
    kw.setdefault("poller", POLLER["kind"])
    kw.setdefault("budgets", {1: EVENT_TIMEOUT, 14: EVENT_TIMEOUT})  # a busy machine's gather is not late
    return GraphStep(client, PLANS, modes, MAX_TOKENS, stream_ops=HostStreamOps(EVENT_TIMEOUT), **kw)


def one_step(g: GraphStep, rng, local, tokens: int) -> dict:
    ids = {p.layer: rng.integers(0, local[p.table].shape[0], (tokens, 24)) for p in PLANS}
    g.before_replay({layer: ids[layer] for layer in g.layers if g.modes[layer] == "before_replay"})
    g.arm(tokens)
    out = stream_step(g, ids, tokens)
    g.after_replay()
    return ids, out


@pytest.mark.parametrize(
    "modes",
    [{}, {14: "in_graph"}, {1: "in_graph", 14: "in_graph"}],
    ids=["before_replay", "layer14_in_graph", "both_in_graph"],
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_steps_bit_exact_over_buckets_and_nothing_moves(daemon, local, modes, transport):
    with TableClient(daemon.address, transport=transport) as c:
        g = make(c, modes)
        try:
            before = g.buffers()
            rng = np.random.default_rng(3)
            for tokens in [1, 2, 8, 64, 3, 64, 1] * 4:  # several batch buckets, in any order
                ids, out = one_step(g, rng, local, tokens)
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
            assert g.buffers() == before  # nothing a graph touches was allocated or moved
            with pytest.raises(ValueError, match="this GraphStep holds 64"):
                g.arm(MAX_TOKENS + 1)
        finally:
            g.close()


@pytest.mark.parametrize("modes", [{14: "in_graph"}, {1: "in_graph", 14: "in_graph"}], ids=["layer14", "both"])
def test_the_next_step_armed_while_the_last_still_runs(daemon, local, modes):
    """SGLang's overlap scheduler launches step k+1 before step k's GPU work is done: arm(k+1) waits for step
    k's release and its consumption (it raised "armed again" before), and both steps are bit-exact."""
    with TableClient(daemon.address, transport="tcp") as c:
        g = make(c, modes)
        try:
            rng = np.random.default_rng(8)
            for _ in range(5):
                ids = [{p.layer: rng.integers(0, local[p.table].shape[0], (4, 24)) for p in PLANS} for _ in range(2)]
                g.before_replay({layer: ids[0][layer] for layer in g.layers if g.modes[layer] == "before_replay"})
                g.arm(4)
                outs, slow = [{}, {}], threading.Event()

                def graph_k():  # step k's GPU: reaches the hasher late, then runs its layers
                    slow.wait(EVENT_TIMEOUT)
                    outs[0].update(stream_step(g, ids[0], 4))

                t = threading.Thread(target=graph_k)
                t.start()
                threading.Timer(0.3, slow.set).start()
                g.before_replay({layer: ids[1][layer] for layer in g.layers if g.modes[layer] == "before_replay"})
                g.arm(4)  # step k+1, while step k is not even published: waits, never raises
                t.join(EVENT_TIMEOUT)
                outs[1] = stream_step(g, ids[1], 4)
                g.after_replay()
                for k in (0, 1):
                    for layer in g.layers:
                        if g.modes[layer] == "in_graph":
                            table = next(p.table for p in PLANS if p.layer == layer)
                            np.testing.assert_array_equal(outs[k][layer], local[table][ids[k][layer]])
        finally:
            g.close()


def answered_again(g: GraphStep, d, rng, local, tokens: int) -> tuple:
    """Resumes a frozen daemon whose node went silent for layer 14 (a step's rows did not come after its ids):
    steps get the policy at once and probe the node until a probe is answered (not the next keepalive:
    tableclient.graph.poller.silence); the step after that reads the table again. That step's (ids, rows)."""
    os.kill(d.proc.pid, signal.SIGCONT)
    g.reset()  # a step the frozen node left unconsumed: start clean
    silence = g.silence(14)
    assert silence.node is not None, "the layer's node was not silent"
    answered = silence.answered
    for _ in range(2):  # a probe issued while it was frozen may be answered now; else this step's
        ids, out = one_step(g, rng, local, tokens)
        if silence.node is None:
            break
        assert not out[14].any()  # still silent: the policy at once, and a probe of it
        wait_for(silence.probe_done, "the thawed node to answer the probe")
    assert silence.node is None and silence.answered == answered + 1
    return ids, out


def watchdog_releases(layer: int) -> float:
    metrics()  # registered in the default registry on first use
    return REGISTRY.get_sample_value("tableserver_client_watchdog_releases_total", {"layer": str(layer)}) or 0.0


@pytest.mark.parametrize("policy", ["zeros", "fail", "fallback"])
def test_a_dead_server_ends_in_the_policy_and_the_stream_goes_on(tmp_path, demo_file, local, policy):
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp")
    spare = start_daemon(str(tmp_path / "spare"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(d.address, transport="tcp") as c, TableClient(spare.address, transport="tcp") as fb:
            g = make(c, {14: "in_graph"}, policy=policy, fallback=fb if policy == "fallback" else None)
            try:
                rng = np.random.default_rng(4)
                one_step(g, rng, local, 8)
                d.stop(signal.SIGKILL)
                ids = {p.layer: rng.integers(0, local[p.table].shape[0], (8, 24)) for p in PLANS}
                if policy == "fail":
                    with pytest.raises(Exception):
                        g.before_replay({1: ids[1]})  # layer 1 before replay: fails at once
                g.arm(8)
                out = stream_step(g, ids, 8)  # the stream is released, whatever the policy
                if policy == "fail":
                    with pytest.raises(Exception):
                        g.after_replay()  # the step is poisoned: its output must not be read
                    assert not out[14].any()
                else:
                    g.after_replay()
                    want = local["engram.layer14"][ids[14]] if policy == "fallback" else 0
                    np.testing.assert_array_equal(out[14], np.broadcast_to(want, out[14].shape))
            finally:
                g.close()
    finally:
        d.stop()
        spare.stop()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_ids_are_never_read_and_give_zero_rows(daemon, local, transport):
    """An engine's padding marker (``dead_id``, vLLM's DEAD_ID): in_graph layers send only the live ids and
    spread their rows into place, the dead ones zero, bit-exact; a step of dead ids only reads nothing, nor
    does a step of no tokens."""
    dead = -1
    with TableClient(daemon.address, transport=transport) as c:
        g = make(c, {1: "in_graph", 14: "in_graph"}, dead_id=dead)
        try:
            rng = np.random.default_rng(9)
            for tokens in (8, 1, 64, 3):
                ids = {p.layer: rng.integers(0, local[p.table].shape[0], (tokens, 24)) for p in PLANS}
                ids[1][rng.random((tokens, 24)) < 0.3] = dead
                ids[14][0] = dead  # a whole token
                g.arm(tokens)
                out = stream_step(g, ids, tokens)
                g.after_replay()
                for p in PLANS:
                    want = local[p.table][np.where(ids[p.layer] == dead, 0, ids[p.layer])]
                    want[ids[p.layer] == dead] = 0
                    np.testing.assert_array_equal(out[p.layer], want)
            ids = {p.layer: np.full((4, 24), dead) for p in PLANS}
            g.arm(4)
            out = stream_step(g, ids, 4)
            g.after_replay()
            assert not any(out[p.layer].any() for p in PLANS)
            g.arm(0)  # a step of no tokens (a data-parallel dummy run's): released at once, no rows
            out = stream_step(g, {p.layer: np.zeros((0, 24), np.int64) for p in PLANS}, 0)
            g.after_replay()
            assert all(out[p.layer].shape[0] == 0 for p in PLANS)
        finally:
            g.close()


def test_policy_fail_checked_where_the_results_are_read(tmp_path, demo_file, local):
    """``results_check``: nothing of policy fail raises on the launch path (before_replay serves zeros,
    after_replay returns at once), and ``check(step)`` -- where an engine reads the step's results -- refuses
    the failed step naming its first layer, passes the good ones, and refuses a step whose outcome is no
    longer held."""
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(d.address, transport="tcp") as c:
            g = make(c, {14: "in_graph"}, policy="fail", results_check=True)
            try:
                rng = np.random.default_rng(4)
                steps = []
                for _ in range(2):
                    ids = {p.layer: rng.integers(0, local[p.table].shape[0], (8, 24)) for p in PLANS}
                    g.before_replay({1: ids[1]})
                    steps.append(g.arm(8))
                    out = stream_step(g, ids, 8)
                    g.after_replay()
                    for p in PLANS:
                        np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
                assert steps == [1, 2]
                for step in steps:
                    g.check(step)
                d.stop(signal.SIGKILL)
                ids = {p.layer: rng.integers(0, local[p.table].shape[0], (8, 24)) for p in PLANS}
                g.before_replay({1: ids[1]})  # fails, served as zeros: the replay runs
                failed = g.arm(8)
                out = stream_step(g, ids, 8)
                g.after_replay()  # at once: the check is where the results are read
                assert not out[1].any() and not out[14].any()
                with pytest.raises(GraphStepError, match=rf"layer 1: step {failed}'s rows were not served here"):
                    g.check(failed)
                for _ in range(OUTCOMES):  # later steps (failed too) take its entry
                    g.before_replay({1: ids[1][:1]})
                    g.arm(1)
                    stream_step(g, ids, 1)
                with pytest.raises(GraphStepError, match=f"step {failed}'s outcome is not held"):
                    g.check(failed)
            finally:
                g.close()
    finally:
        d.stop()


def test_a_frozen_server_is_released_by_the_watchdog(tmp_path, demo_file, local):
    """The gather hangs (SIGSTOP): at the layer's timeout the watchdog cancels it, fills zeros and releases
    the stream; the rows of the hung gather never land later."""
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(d.address, transport="tcp", liveness_timeout=600.0) as c:
            g = make(c, {14: "in_graph"}, policy="zeros", timeout=1.0)
            try:
                rng = np.random.default_rng(5)
                one_step(g, rng, local, 4)
                released = watchdog_releases(14)
                freeze(d.proc.pid)
                ids = {p.layer: rng.integers(0, local[p.table].shape[0], (4, 24)) for p in PLANS}
                g.arm(4)
                t_out = {}  # layer 1 (before_replay) would hang too: this step is layer 14's alone

                def stream():
                    g.publish_ids(14, torch.from_numpy(ids[14]))
                    t_out[14] = g.rows(14, 4).clone().numpy().reshape(4, 24, -1)

                t = threading.Thread(target=stream)
                t.start()
                t.join(EVENT_TIMEOUT)
                assert not t.is_alive() and not t_out[14].any()
                g.account()  # the native poller's releases reach the metrics off the hot path
                assert watchdog_releases(14) == released + 1
                ids2, out = answered_again(g, d, rng, local, 4)  # the server answers again: bit-exact, nothing stale
                np.testing.assert_array_equal(out[14], local["engram.layer14"][ids2[14]])
                np.testing.assert_array_equal(out[1], local["engram.layer1"][ids2[1]])
            finally:
                g.close()
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()


def test_a_step_whose_ids_never_come_is_released_and_the_next_is_clean(daemon, local):
    with TableClient(daemon.address, transport="tcp") as c:
        g = make(c, {14: "in_graph"}, policy="fail", timeout=0.5)
        try:
            rng = np.random.default_rng(6)
            g.arm(4)  # the graph is slow to publish: the watchdog releases the step at its deadline
            with pytest.raises(Exception, match="watchdog"):
                g.after_replay()
            ids = {p.layer: rng.integers(0, local[p.table].shape[0], (4, 24)) for p in PLANS}
            out = stream_step(g, ids, 4)  # the late graph passes at once (zeros) and consumes the release
            assert not out[14].any()
            g.before_replay({1: ids[1]})
            ids, out = one_step(g, rng, local, 4)
            np.testing.assert_array_equal(out[14], local["engram.layer14"][ids[14]])
        finally:
            g.close()


def test_arming_a_step_whose_release_was_never_consumed_is_refused(daemon):
    with TableClient(daemon.address, transport="tcp") as c:
        g = make(c, {14: "in_graph"}, policy="zeros", timeout=0.3)
        try:
            g.arm(2)
            g.after_replay()
            with pytest.raises(GraphStepError, match="never launched"):  # the watchdog released, nobody consumed
                _wait_released_then_arm(g)
            g.reset()
            g.arm(2)  # after reset: clean
        finally:
            g.close()


def _wait_released_then_arm(g: GraphStep) -> None:
    from conftest import wait_for

    wait_for(lambda: g.flags.host[g.flags.index(0, 1)] == 1, "the watchdog's release")
    g.arm(2)


@pytest.mark.parametrize("modes", [{}, {14: "in_graph"}], ids=["before_replay", "in_graph"])
def test_a_closed_graph_step_refuses_to_arm_and_keeps_its_flags_released(daemon, local, modes):
    """Before: arm() after close() was accepted (before_replay layers alone) or waited out its timeout for a
    release nobody would give (in_graph), and reset() after close() cleared the rows flags close() had
    released, so the next replay waited on them forever. Now arm() and before_replay() raise one line at
    once, and reset() leaves the flags released."""
    with TableClient(daemon.address, transport="tcp") as c:
        g = make(c, modes, timeout=2.0)
        rng = np.random.default_rng(12)
        ids, _ = one_step(g, rng, local, 4)
        g.close()
        with pytest.raises(GraphStepError, match="GraphStep is closed"):
            g.arm(4)
        with pytest.raises(GraphStepError, match="GraphStep is closed"):
            g.before_replay({layer: ids[layer] for layer in g.layers if g.modes[layer] == "before_replay"})
        g.reset()
        assert all(g.flags.host[g.flags.index(i, 1)] == 1 for i in range(len(g.ids))), "a replay would wait"
        g.close()  # idempotent


def test_modes_and_timeouts_are_checked(daemon):
    """A graph mode it does not know; a timeout of inf or 1e10 s (issue 50, item 7: natively an int64 deadline
    that overflowed, every step released at once with zeros) or nan: one line naming it."""
    with TableClient(daemon.address, transport="tcp") as c:
        with pytest.raises(ValueError, match="unknown graph mode 'sometimes'"):
            GraphStep(c, PLANS, {14: "sometimes"}, MAX_TOKENS)
        for timeout in (float("inf"), 1e10, float("nan"), 0.0):
            with pytest.raises(ValueError, match="timeout must be seconds above 0 and at most 86400"):
                GraphStep(c, PLANS, {14: "in_graph"}, MAX_TOKENS, timeout=timeout)


def test_the_flag_wait_is_native_where_required_and_checks_its_arguments():
    """The poller waits for the graph's flag without the GIL (client/tableclient/graph/_flags.c): built in CI
    (TABLESERVER_REQUIRE_NATIVE=1), and refusing what it cannot read."""

    from tableclient.graph import streams

    if os.environ.get("TABLESERVER_REQUIRE_NATIVE") == "1":
        assert streams.native_wait is not None, "tableclient.graph._flags did not build: install gcc and python3-dev"
    flags = np.zeros(32, np.uint32)
    assert not streams.wait_flag(flags, 16, 1, 0.01)
    threading.Timer(0.05, lambda: flags.__setitem__(16, 1)).start()
    t0 = time.monotonic()
    assert streams.wait_flag(flags, 16, 1, EVENT_TIMEOUT) and time.monotonic() - t0 < EVENT_TIMEOUT
    if streams.native_wait is not None:
        with pytest.raises(ValueError, match="index outside the flags"):
            streams.native_wait(flags, 32, 1, 0.0)
        with pytest.raises(TypeError, match="native uint32"):
            streams.native_wait(np.zeros(4, np.int64), 0, 1, 0.0)
        misaligned = np.frombuffer(bytearray(17), np.uint32, 4, 1)  # an atomic load there may tear
        with pytest.raises(TypeError, match="4-byte aligned"):
            streams.native_wait(misaligned, 0, 1, 0.0)


def test_in_graph_layers_get_the_native_poller_where_it_is_built(daemon, poller):
    """shm and plain tcp are the native poller's; policy fallback stays with Python's (it re-reads through
    another client), and says so."""
    from tableclient.graph.poller import native

    if not native.BUILT:
        assert os.environ.get("TABLESERVER_REQUIRE_NATIVE") != "1", "tableclient.graph.poller._native did not build"
        pytest.skip("tableclient.graph.poller._native is not built here")
    for transport in ("shm", "tcp"):
        with TableClient(daemon.address, transport=transport) as c:
            g = make(c, {14: "in_graph"})
            try:
                assert g.poller == ("native" if poller == "auto" else "python")
            finally:
                g.close()
    with TableClient(daemon.address, transport="tcp") as c, TableClient(daemon.address, transport="tcp") as fb:
        g = make(c, {14: "in_graph"}, policy="fallback", fallback=fb)
        try:
            assert g.poller == "python"
            with pytest.raises(GraphStepError, match="policy 'fallback'"):
                GraphStep(c, PLANS, {14: "in_graph"}, MAX_TOKENS, policy="fallback", fallback=fb, poller="native")
        finally:
            g.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_native_poller_releases_a_step_while_another_thread_holds_the_gil(daemon, local, poller, transport):
    """The graph's ids are published, then this thread holds the GIL inside C for 300 ms (a C extension that
    never releases it): the native poller gathers and releases the step meanwhile; Python's poller, which
    needs the GIL to gather, cannot (the contrast is the point of the native one)."""
    import ctypes

    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    with TableClient(daemon.address, transport=transport) as c:
        g = make(c, {14: "in_graph"}, timeout=EVENT_TIMEOUT)
        try:
            rng = np.random.default_rng(12)
            one_step(g, rng, local, 8)  # warm: the connection and the poller's first step
            ids = rng.integers(0, local["engram.layer14"].shape[0], (8, 24))
            g.before_replay({1: rng.integers(0, local["engram.layer1"].shape[0], (8, 24))})
            g.arm(8)
            flag = g.flags.index(0, 1)  # layer 14's rows flag (its only in_graph layer)
            interval = sys.getswitchinterval()
            sys.setswitchinterval(30.0)  # no other Python thread runs until this one waits: not even a slow CI's
            try:
                g.publish_ids(14, torch.from_numpy(ids))
                libc.usleep(300_000)
                released = int(g.flags.host[flag])  # read before this thread lets any other run
            finally:
                sys.setswitchinterval(interval)
            out = g.rows(14, 8).clone().numpy().reshape(8, 24, -1)
            g.after_replay()
            np.testing.assert_array_equal(out, local["engram.layer14"][ids])
            assert released == (1 if g.poller == "native" else 0), g.poller
        finally:
            g.close()


def test_the_native_poller_connects_again_after_its_node_restarts(tmp_path, demo_file, local, poller):
    """tcp: the node killed (the layer gets the policy, zeros), restarted on the same port: the next arm
    gives the thread a new connection of its own and the rows are bit-exact again."""
    from tests_helpers import free_port_block

    port = free_port_block()
    flags = ("--tables", demo_file, "--transports", "tcp", "--listen", f"127.0.0.1:{port}")
    d = start_daemon(str(tmp_path / "a"), *flags)
    try:
        with TableClient(d.address, transport="tcp") as c:
            g = make(c, {1: "in_graph", 14: "in_graph"}, policy="zeros", timeout=2.0)
            try:
                rng = np.random.default_rng(13)
                one_step(g, rng, local, 8)
                d.stop(signal.SIGKILL)
                ids, out = one_step(g, rng, local, 8)
                assert not out[14].any()  # the policy
                d = start_daemon(str(tmp_path / "b"), *flags)
                wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
                ids, out = one_step(g, rng, local, 8)
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
            finally:
                g.close()
    finally:
        d.stop()


def test_the_native_poller_runs_at_real_time_priority_where_permitted_and_stays_bit_exact(daemon, local, poller):
    """realtime=True: SCHED_FIFO 1 exactly where this process may have a real-time thread (tried on a
    throwaway thread), the steps as bit-exact as ever; the plugins' poller_priority is checked."""
    from tableclient.engine import ConfigError, PluginConfig
    from tableclient.graph.poller import native

    if poller != "auto" or not native.BUILT:
        pytest.skip("the native poller's priority (built, and asked for)")
    allowed = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    with TableClient(daemon.address, transport="shm") as c:
        g = make(c, {1: "in_graph", 14: "in_graph"}, realtime=True)
        try:
            assert g.poller == "native" and g.poller_realtime == allowed[0]
            rng = np.random.default_rng(14)
            for tokens in (1, 64, 7):
                ids, out = one_step(g, rng, local, tokens)
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
        finally:
            g.close()
    assert PluginConfig.load({"TABLESERVER_POLLER_PRIORITY": "realtime"}).poller_priority == "realtime"
    with pytest.raises(ConfigError, match="poller_priority = 'fast': use normal or realtime"):
        PluginConfig(poller_priority="fast")
    with pytest.raises(ConfigError, match="gather_budget = -1.0: expected seconds 0 .from the windows. to 86400"):
        PluginConfig.load({"TABLESERVER_GATHER_BUDGET": "-1"})
    with TableClient(daemon.address, transport="shm") as c, pytest.raises(ValueError, match="a gather budget of"):
        make(c, {14: "in_graph"}, budgets={14: -0.5})


def poller_threads() -> dict:
    """This process's native poller threads (named by the extension): tid -> the CPUs it may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "graph-poller":
                    out[int(tid)] = os.sched_getaffinity(int(tid))
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def test_the_native_poller_is_pinned_to_a_cpu_of_poller_cpus_no_other_poller_holds(daemon, local, poller):
    """poller_cpus: the thread runs on one CPU of the list (the kernel's affinity says so), a second
    GraphStep takes the next CPU, a third with none left runs unpinned, a closed one's CPU is free again;
    steps stay bit-exact. The CPUs are this process's last two, so no other test's poller holds them."""
    from tableclient.graph.poller import native

    if poller != "auto" or not native.BUILT:
        pytest.skip("the native poller's CPU (built, and asked for)")
    cpus = sorted(os.sched_getaffinity(0))[-2:]
    with TableClient(daemon.address, transport="shm") as c:
        before = set(poller_threads())
        g1 = make(c, {1: "in_graph", 14: "in_graph"}, poller_cpus=cpus[:1])
        g2 = g3 = None
        try:
            assert g1.poller_cpu == cpus[0]
            (tid1,) = set(poller_threads()) - before
            assert poller_threads()[tid1] == {cpus[0]}
            rng = np.random.default_rng(15)
            for tokens in (1, 64):
                ids, out = one_step(g1, rng, local, tokens)
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
            g2 = make(c, {14: "in_graph"}, poller_cpus=cpus)
            assert g2.poller_cpu == (cpus[1] if len(cpus) > 1 else None)
            g3 = make(c, {14: "in_graph"}, poller_cpus=cpus)
            assert g3.poller == "native" and g3.poller_cpu is None  # every CPU held: it serves, unpinned
            ids, out = one_step(g3, rng, local, 8)
            np.testing.assert_array_equal(out[14], local["engram.layer14"][ids[14]])
            g1.close()
            g1 = make(c, {14: "in_graph"}, poller_cpus=cpus[:1])
            assert g1.poller_cpu == cpus[0]  # the closed one's claim went with it
        finally:
            for g in (g1, g2, g3):
                if g is not None:
                    g.close()
        outside = max(os.cpu_count() or 1, 1024)  # a CPU no cpuset has: the pin is refused, the poller serves
        g = make(c, {14: "in_graph"}, poller_cpus=[outside - 1])
        try:
            assert g.poller == "native" and g.poller_cpu is None
        finally:
            g.close()


def test_a_frozen_node_stalls_one_step_by_its_budget_and_the_next_get_the_policy_at_once(tmp_path, demo_file, local,
                                                                                            poller, caplog):  # fmt: skip
    """tcp, the node frozen (SIGSTOP): the first step's gather runs out of its budget (from its ids, not the
    5 s timeout) and the watchdog releases it; while the node has not answered since, the next steps get
    the policy at once (no second watchdog release: nothing waited; nothing connects to it again) and probe
    it; once a probe is answered, rows again. Both pollers."""
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "tcp")
    try:
        with TableClient(d.address, transport="tcp", liveness_timeout=600.0) as c:
            # timeout: the ids' deadline, and the connect timeout a reconnect to the frozen node would wait out
            g = make(c, {14: "in_graph"}, policy="zeros", timeout=20.0, budgets={14: 0.3})
            try:
                if poller == "auto" and g.poller != "native":
                    pytest.skip("tableclient.graph.poller._native is not built here (the python run covers Python's)")
                rng = np.random.default_rng(15)
                one_step(g, rng, local, 4)
                freeze(d.proc.pid)
                released = watchdog_releases(14)
                out = {}
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="tableclient.graph"):
                    for k in range(3):  # as an engine steps: each arm folds the step before's events
                        ids = rng.integers(0, local["engram.layer14"].shape[0], (4, 24))
                        g.arm(4)
                        out[k] = stream_step(g, {14: ids}, 4, layers=[14])[14]
                    g.account()
                said = [r.getMessage() for r in caplog.records]
                # no reconnect to the silent node (on the launch path it would wait out the connect timeout)
                assert not [m for m in said if "connected in the background" in m or "no connection" in m], said
                assert sum("has not answered since a step ran out of time" in m for m in said) == 1, said
                assert not any(o.any() for o in out.values())  # the policy, every step
                assert watchdog_releases(14) == released + 1  # one step waited (its budget); the others did not
                ids2, rows = answered_again(g, d, rng, local, 4)
                np.testing.assert_array_equal(rows[14], local["engram.layer14"][ids2[14]])
            finally:
                g.close()
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
