"""Decode CUDA graphs on (issue 25), on the CPU, inside the pinned SGLang's own classes.

What runs here is SGLang's: its ``DecodeCudaGraphRunner`` class (its hooked ``capture``, ``load_batch`` and
``execute``, on an instance that cannot capture on a CPU: built without its ``__init__``, with the
attributes the plugin reads), its ``EngramHasher`` (decode, prefill and chunked prefill), ``Engram`` and
``EngramEmbedding``, ``ForwardBatch``, its backends' classes and its ``eager_on_graph``. A replay is the
captured forward run again with the graph's flag operations on the host (``replay_on_host``): the forward's
thread stands in for the stream. Layer outputs must be bit-identical to SGLang's own tables'. Captures and
replays of real CUDA graphs run in bench/gpu_check.sh on a GPU.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torchvision_cpu  # noqa: F401  (before sglang: torchvision on a CPU torch)

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.layers.engram")

from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import (  # noqa: E402
    BreakableCudaGraphBackend,
)
from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend  # noqa: E402
from sglang_cpu import (  # noqa: E402,F401  (fixtures: one memory node and SGLang's plugin loading)
    HC,
    HIDDEN,
    assert_bit_identical,
    build,
    conversation,
    decode_batch,
    decode_runner,
    engram_tables,
    forward,
    local_outputs,
    memnode,
    model_config,
    plugin,
    server_rows,
)
from tableclient.sglang import graphs, hooks, rows  # noqa: E402

# the plugin's hooks on SGLang's decode runner and scheduler (hooks.hook(target): called as SGLang calls them)
CAPTURE, LOAD_BATCH, EXECUTE = (
    f"{hooks.RUNNER}.DecodeCudaGraphRunner.{m}" for m in ("capture", "load_batch", "execute")
)
RUN_BATCH, PROCESS_RESULT = (f"{hooks.SCHEDULER}.Scheduler.{m}" for m in ("run_batch", "process_batch_result"))


def runner_for(model, backend=FullCudaGraphBackend, max_bs: int = 8, **flags):
    return decode_runner(model, backend, max_bs, **flags)


def capture(runner, model):
    """The runner's capture as the plugin's hook wraps it: the forward run once per bucket (what a capture's
    warm-up runs) for a batch of dummy tokens."""

    def record(self):
        for bs in (1, 2, 4, 8):
            ids, batch = decode_batch([0] * bs, [5] * bs, list(range(bs)))
            forward(model, ids, batch, torch.zeros((bs, HC, HIDDEN), dtype=torch.bfloat16))

    hooks.hook(CAPTURE)(record, runner)


def replay_step(runner, model, ids, batch, x):
    """One decode step as SGLang's execute runs it: load_batch (the plugin's host side after it), then the
    replay -- the captured forward, its flag operations on the host."""
    s = graphs.session()
    runner.raw_num_token = len(ids)
    hooks.hook(LOAD_BATCH)(None, runner, batch)

    def replay(self, forward_batch):
        s.capturing = s.replay_on_host = True
        try:
            return forward(model, ids, forward_batch, x)
        finally:
            s.capturing = s.replay_on_host = False

    return hooks.hook(EXECUTE)(replay, runner, batch)


def run_graphs(model, runner, seed=0):
    """The test conversation: prefills eager (SGLang's prefill graphs are breakable), decode steps replayed."""
    rng = np.random.default_rng(seed)
    outs = []
    for ids, batch in conversation(rng):
        x = torch.from_numpy(rng.standard_normal((len(ids), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
        if batch.forward_mode.is_decode():
            outs.append(replay_step(runner, model, ids, batch, x))
        else:
            outs.append(forward(model, ids, batch, x))
    return outs


def test_the_hooks_are_on_sglangs_decode_runner(plugin):
    for target in (CAPTURE, LOAD_BATCH, EXECUTE, RUN_BATCH, PROCESS_RESULT):
        assert hooks.applied(target), target
    assert hooks.check_sglang() == hooks.SUPPORTED_SGLANG  # signatures checked, incl. the runner's


def test_ids_before_replay_equal_sglangs_hasher_and_leave_its_history(plugin, model_config, engram_tables, memnode):
    hasher, engrams = build(model_config, engram_tables, address=memnode.address)
    scratch = torch.empty_like(hasher.history)
    modes = set()
    for ids, batch in conversation(np.random.default_rng(9)):  # prefill, chunked prefill, decode
        before = hasher.history.clone()
        peeked = graphs.peek_hash_ids(hasher, scratch, ids, batch)
        assert torch.equal(hasher.history, before)  # nothing committed
        assert torch.equal(peeked, hasher(ids, batch))  # SGLang's own, committing
        modes.add(batch.forward_mode.name)
    assert modes == {"EXTEND", "DECODE"}


@pytest.mark.parametrize(
    "graph",
    [{}, {14: "in_graph"}, {1: "in_graph", 14: "in_graph"}],
    ids=["before_replay", "layer14_in_graph", "both_in_graph"],
)
def test_decode_steps_in_graphs_are_bit_identical(plugin, model_config, engram_tables, memnode, graph, local_outputs):
    want = local_outputs
    waits = {layer: _graph_waits(layer, graph.get(layer, "before_replay")) for layer in (1, 14)}
    served = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}
    model = build(model_config, engram_tables, address=memnode.address, graph=graph)
    runner = runner_for(model)
    capture(runner, model)
    s = graphs.session()
    assert s is not None and not s.capturing
    buffers = {p: step.buffers() for p, step in s.steps.items()}
    got = run_graphs(model, runner)
    assert_bit_identical(got, want)
    assert {p: step.buffers() for p, step in s.steps.items()} == buffers  # nothing allocated after capture
    for step in s.steps.values():  # the native poller's waits reach the metrics off the hot path
        step.account()
    summary = rows().summary()
    for layer in (1, 14):  # the decode steps' rows never went through the eager prefetch
        assert summary[layer]["prefetched"] == 2, summary  # the two prefill forwards only
        phase = graph.get(layer, "before_replay")
        assert _graph_waits(layer, phase) - waits[layer] == 6, (layer, phase)  # the six decode steps, in graphs
    # every row fetched once: the capture fetched nothing, and the hasher's run for the ids before a replay
    # did not prefetch them a second time (found in review: it did)
    tokens = sum(len(h) for h, _ in got)
    for t in served:
        assert server_rows(memnode, t) - served[t] == tokens * 24, t


def _graph_waits(layer: int, phase: str) -> float:
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value("tableserver_client_graph_wait_seconds_count", {"layer": str(layer), "phase": phase})
        or 0
    )


def test_an_eager_break_serves_the_layer_in_a_breakable_graph(
    plugin, model_config, engram_tables, memnode, local_outputs
):
    want = local_outputs
    model = build(model_config, engram_tables, address=memnode.address, graph={14: "eager_break"})
    runner = runner_for(model, BreakableCudaGraphBackend)
    capture(runner, model)
    assert_bit_identical(run_graphs(model, runner), want)
    assert rows().summary()[14]["fetched"] > 0  # fetched when the break ran


@pytest.mark.parametrize(
    "flags, needle",
    [
        ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
        ({"enable_pdmux": True}, "--enable-pdmux"),
        ({"speculative": True}, "--speculative-algorithm"),
    ],
)
def test_what_is_not_handled_is_refused_at_start_up(plugin, model_config, engram_tables, memnode, flags, needle):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if flags.pop("speculative", False):
        flags["speculative_algorithm"] = next(a for a in SpeculativeAlgorithm if not a.is_none())
    model = build(model_config, engram_tables, address=memnode.address)
    with pytest.raises(hooks.PluginError, match=needle):
        capture(runner_for(model, **flags), model)


def test_an_eager_break_needs_the_breakable_backend(plugin, model_config, engram_tables, memnode):
    model = build(model_config, engram_tables, address=memnode.address, graph={14: "eager_break"})
    with pytest.raises(hooks.PluginError, match="--cuda-graph-backend-decode breakable"):
        capture(runner_for(model), model)


def test_graph_modes_in_the_configuration():
    from tableclient.sglang import ConfigError, PluginConfig

    cfg = PluginConfig.load({"TABLESERVER_ADDRESS": "m:1", "TABLESERVER_GRAPH_MODE": "14=in_graph,1=before_replay"})
    assert (
        cfg.graph_mode(14) == "in_graph"
        and cfg.graph_mode(1) == "before_replay"
        and cfg.graph_mode(7) == "before_replay"
    )
    with pytest.raises(ConfigError, match="graph.14 = 'sometimes': use one of before_replay, in_graph, eager_break"):
        PluginConfig(address="m:1", graph={14: "sometimes"})


@pytest.mark.parametrize("backend", [FullCudaGraphBackend, BreakableCudaGraphBackend], ids=["full", "breakable"])
def test_node_layers_are_gathered_by_the_graphs_own_kernel_bit_identical(
    plugin, model_config, engram_tables, memnode, backend, local_outputs
):
    """Placed ``node`` (this host's daemon, its tables mapped here), both layers default to graph mode device:
    the captured forward launches the row kernel (Triton's interpreter here) right after SGLang's hasher, over
    the registered mapping; every decode step is bit-identical to SGLang's own tables, no decode row goes
    through the host path, and nothing a graph touches moves."""
    want = local_outputs
    model = build(model_config, engram_tables, placement={1: "node", 14: "node"}, node_address=memnode.address)
    runner = runner_for(model, backend)
    capture(runner, model)
    s = graphs.session()
    assert {layer: sl.graph_mode for layer, sl in s.layers.items()} == {1: "device", 14: "device"}
    step = s.steps["node"]
    assert sorted(step.device_tables) == [1, 14] and step.pre is None and step.post is None
    buffers = step.buffers()
    got = run_graphs(model, runner)
    assert_bit_identical(got, want)
    assert step.buffers() == buffers
    summary = rows().summary()
    for layer in (1, 14):  # the prefills' rows only: every decode step's came from the kernel
        assert summary[layer]["prefetched"] == 2 and summary[layer]["fetched"] == 0, summary


def test_a_node_table_the_gpu_cannot_read_takes_before_replay_with_one_line(
    plugin, model_config, engram_tables, tmp_path, caplog, local_outputs
):
    """The node daemon serves the tables from disk (nothing to map, so nothing to register): the layers fall
    back to before_replay, saying why in one line each, and stay bit-identical."""
    import logging

    from conftest import start_daemon

    want = local_outputs
    d = start_daemon(str(tmp_path / "disk"), "--tables", engram_tables, "--disk-tables", "all")
    try:
        with caplog.at_level(logging.WARNING, logger="tableclient.graph"):
            model = build(model_config, engram_tables, placement={1: "node", 14: "node"}, node_address=d.address)
            runner = runner_for(model)
            capture(runner, model)
        s = graphs.session()
        assert {layer: sl.graph_mode for layer, sl in s.layers.items()} == {1: "before_replay", 14: "before_replay"}
        lines = [r.getMessage() for r in caplog.records if "graph mode 'device' unavailable" in r.getMessage()]
        assert len(lines) == 2 and all("not mapped in this process" in line for line in lines)
        assert_bit_identical(run_graphs(model, runner), want)
    finally:
        graphs.close()
        d.stop()


def test_the_placement_and_graph_mode_matrix():
    from tableclient.sglang import ConfigError, PluginConfig

    cfg = PluginConfig(address="m:1", layers={1: "node", 14: "remote", 7: "local"})
    assert [cfg.graph_mode(layer) for layer in (1, 14, 7)] == ["device", "before_replay", "before_replay"]
    assert PluginConfig(address="m:1", layers={1: "node"}, graph={1: "in_graph"}).graph_mode(1) == "in_graph"
    fallback = PluginConfig(address="m:1", layers={1: "node"}, policy="fallback", fallback_address="f:1")
    assert fallback.graph_mode(1) == "before_replay"  # the fallback's rows are gathered on the host
    with pytest.raises(ConfigError, match="graph.14 = 'device'.*placed 'remote': place it 'node'"):
        PluginConfig(address="m:1", layers={14: "remote"}, graph={14: "device"})
    with pytest.raises(ConfigError, match="graph.1 = 'device' with policy 'fallback'"):
        PluginConfig(address="m:1", layers={1: "node"}, graph={1: "device"}, policy="fallback", fallback_address="f:1")


def scheduler_step(runner, model, ids, batch, x):
    """A decode batch as SGLang's scheduler runs it: ``run_batch`` (its replay; the plugin's hook binds the
    steps to the batch's result, a real ``GenerationBatchResult``), then ``process_batch_result`` (the
    plugin's hook checks them before SGLang reads the result)."""
    from sglang.srt.managers.scheduler import GenerationBatchResult

    out = {}

    def run_batch(self, b):
        out["y"] = replay_step(runner, model, ids, b, x)
        return GenerationBatchResult()

    result = hooks.hook(RUN_BATCH)(run_batch, None, batch)
    return hooks.hook(PROCESS_RESULT)(lambda self, b, r: out["y"], None, batch, result)


def test_policy_fail_is_checked_where_the_scheduler_reads_the_result(
    plugin, model_config, engram_tables, tmp_path, local_outputs
):
    """Policy fail with decode graphs: a step whose node died still replays (nothing raises on the launch
    path, the graph is never left waiting), and the step's result is refused where SGLang's scheduler
    processes it, naming the layer; the steps before it are bit-identical."""
    from conftest import start_daemon
    from tableclient.graph.step import GraphStepError

    want = local_outputs
    d = start_daemon(str(tmp_path / "node"), "--tables", engram_tables)
    try:
        model = build(model_config, engram_tables, address=d.address, graph={14: "in_graph"}, policy="fail",
                      timeout=2.0)  # fmt: skip
        runner = runner_for(model)
        capture(runner, model)
        rng = np.random.default_rng(0)
        decoded = 0
        for i, (ids, batch) in enumerate(conversation(rng)):
            x = torch.from_numpy(rng.standard_normal((len(ids), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
            if not batch.forward_mode.is_decode():
                forward(model, ids, batch, x)
                continue
            if decoded == 2:
                d.stop(signal.SIGKILL)
                with pytest.raises(
                    GraphStepError, match=r"layer 1: step \d+'s rows were not served here \(policy fail"
                ):
                    scheduler_step(runner, model, ids, batch, x)
                break
            assert_bit_identical([scheduler_step(runner, model, ids, batch, x)], [want[i]])
            decoded += 1
        assert decoded == 2
    finally:
        graphs.close()
        d.stop()
