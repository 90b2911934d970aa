"""The plugin inside the released vLLM (0.33.0, pinned) with its CUDA graph modes, on vLLM's own classes on the CPU
(tests/support/vllm_cpu.py; the fixtures and helpers of tests/engines/vllm/test_vllm_plugin.py).

``node`` layers in graph mode ``device``: gathered by the plugin's Triton kernel (Triton's interpreter here)
from the node daemon's mapping, as a GPU reads it once registered; vLLM's ``Worker.execute_model`` (hooked)
checks their tables before every step, as it does under FULL graphs, where nothing else of the plugin runs on
the host (the table's refusal under policy fail where vLLM reads the step's results). ``remote`` layers in graph
mode ``in_graph`` (vLLM's FULL graphs): the forward publishes their ids and waits for their rows flag (the host
stands in for the stream), ``Worker.execute_model`` arms each step.
Every graph mode of vLLM against every placement; the failure policies on both host paths.
"""

from __future__ import annotations

import contextlib
import os
import signal

import numpy as np
import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)
from conftest import start_daemon, wait_for
from tests_helpers import client_rows, free_port_block
from vllm_cpu import HC, HIDDEN, LAYERS, worker_step

torch = pytest.importorskip("torch")
vllm_cpu.require_vllm()

from tableclient.engine import PluginConfig  # noqa: E402
from tableclient.vllm import eager as vllm_eager  # noqa: E402
from tableclient.vllm import graphs as vllm_graphs  # noqa: E402
from tableclient.vllm import hooks  # noqa: E402
from tableclient.vllm import layers as vllm_layers  # noqa: E402
from test_vllm_plugin import (  # noqa: E402,F401  (fixtures: the model, its tables, one memory node, the plugin)
    assert_bit_identical,
    build,
    engram_tables,
    hasher,
    local_run,
    memnode,
    model_dir,
    model_tables,
    plugin,
    run,
    server_rows,
    vllm_config,
)
from vllm.models.deepseek_v41.common.engram import DEAD_ID  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


TABLES = tuple(f"engram.layer{layer}" for layer in LAYERS)


@pytest.fixture(scope="module")
def other_tables(model_dir, tmp_path_factory):
    """The same tables' names and sizes with other rows: another version of the data."""
    return model_tables(model_dir, tmp_path_factory.mktemp("vllm-other"), 12)


def shm_rows() -> dict:
    """Row ids this process's clients gathered from each table over shm (on the host)."""
    return {t: client_rows(t, layer, "shm") for t, layer in zip(TABLES, LAYERS)}


def with_dead_ids(hasher):
    """A prefill whose ids hold DEAD_ID (a padded token, single columns), and vLLM's own dummy-run ids."""
    _, hashes, mask = vllm_cpu.hash_batch(hasher, [([], list(range(3, 20)))])
    hashes = hashes.clone()
    hashes[5] = DEAD_ID
    hashes[9, :, ::3] = DEAD_ID
    dummy, keep = hasher.dummy_hashes(torch.zeros(4, dtype=torch.int32))
    x = torch.randn((len(hashes), HC, HIDDEN), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    return [(hashes, x, mask), (dummy, x[:4], keep)]


def zero_table_layers(cfg, tables_path):
    """vLLM's own layers over all-zero tables: what a step of zero rows computes."""
    zero = build(cfg, tables_path)
    for e in zero:
        e.embed_tokens.weight.data.view(torch.uint8).zero_()
        e.embed_tokens.weight_scale_inv.data.zero_()
    return zero


def zero_rows_served(layer: int) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total", {"layer": str(layer)}) or 0.0


@contextlib.contextmanager
def graph_mode(vllm_config, mode: str, breakable: bool = True):
    """vLLM's own compilation config set to cudagraph_mode ``mode`` (VLLM_USE_BREAKABLE_CUDAGRAPH as given)."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    saved, env = compilation.cudagraph_mode, os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
    compilation.cudagraph_mode = CUDAGraphMode[mode]
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1" if breakable else "0"
    try:
        yield
    finally:
        compilation.cudagraph_mode = saved
        if env is None:
            os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
        else:
            os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = env


def _in_graph_waits(layer: int) -> float:
    from prometheus_client import REGISTRY

    labels = {"layer": str(layer), "phase": "in_graph"}
    return REGISTRY.get_sample_value("tableserver_client_graph_wait_seconds_count", labels) or 0


@pytest.mark.parametrize("graph", ["device", "eager_break"])
def test_node_layers_are_bit_identical_gathered_by_the_kernel_or_through_the_eager_break(
    vllm_config, hasher, engram_tables, memnode, local_run, graph
):
    """Placed node, a layer reads the table this host's daemon maps into the process (shm). In graph mode
    device (a node layer's default) the plugin's kernel gathers each step's rows from that mapping at step
    start, on the host not one row; with eager_break the host gathers them. Either way every output over
    prefill (an image span), chunked prefill, decode, dead ids and vLLM's dummy run is bit-identical to
    vLLM's own tables."""
    local, want = build(vllm_config, engram_tables), local_run
    graphs = {} if graph == "device" else {"graph": {1: "eager_break", 14: "eager_break"}}
    node = build(vllm_config, engram_tables, placement={1: "node", 14: "node"}, node_address=memnode.address, **graphs)
    assert hooks.rows().client("node").transport == "shm"
    assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == [graph, graph]
    assert all(e.embed_tokens.graph_mode == graph for e in node)
    before = shm_rows()
    assert_bit_identical(run(node, hasher), want)
    for hash_ids, x, mask in with_dead_ids(hasher):
        for a, b in zip(vllm_cpu.step(local, hash_ids, x, mask), vllm_cpu.step(node, hash_ids, x, mask)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    gathered = {t: n - before[t] for t, n in shm_rows().items()}
    if graph == "device":
        assert gathered == {t: 0 for t in TABLES}, gathered  # every row came through the kernel
        assert sorted(hooks.graph_steps()["node"].device_tables) == list(LAYERS)
        assert all(t.pointer.item() != 0 for t in hooks.device_tables().values())
    else:
        assert all(n > 0 for n in gathered.values()), gathered


@pytest.mark.parametrize("policy", ["zeros", "fail"])
def test_a_node_restart_is_registered_anew_and_a_node_on_other_data_is_never_read(
    vllm_config, hasher, engram_tables, other_tables, tmp_path, policy
):
    """Device layers across node daemon restarts, each step through vLLM's Worker.execute_model. The node
    killed: its table is unreadable, the kernel's pointer is 0 and the policy applies (zeros: the layers
    compute what vLLM's own do over zero tables, counted per step; fail: the step's result is refused where vLLM
    reads it, naming the layer, nothing raised before). Restarted on
    the same data: mapped anew, registered again, the pointer rewritten, bit-identical again, the same
    device buffers (nothing to capture again). Restarted on other data (same names and sizes): refused by
    the client's pinned checksum, never mapped, never read: the policy again."""
    from vllm.v1.worker.gpu_worker import Worker

    port = free_port_block()

    def node(name, tables):
        return start_daemon(
            str(tmp_path / name), "--tables", tables, "--listen", f"127.0.0.1:{port}", "--node-id", name
        )

    daemons = [node("a", engram_tables)]
    try:
        zero, local = zero_table_layers(vllm_config, engram_tables), build(vllm_config, engram_tables)
        served = build(
            vllm_config,
            engram_tables,
            placement={1: "node", 14: "node"},
            node_address=daemons[0].address,
            policy=policy,
            timeout=30.0,
        )
        client = hooks.rows().client("node")
        tables = [hooks.device_tables()[t] for t in TABLES]
        steps = iter(vllm_cpu.decode_steps())
        rng = np.random.default_rng(4)

        def step(engrams):
            _, hashes, mask = vllm_cpu.hash_batch(hasher, next(steps))
            x = torch.from_numpy(rng.standard_normal((len(hashes), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
            return hashes, x, mask

        def assert_same(got, want):
            for a, b in zip(got, want):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))

        def unreadable_step():
            """A step while no mapping of the table is there: the policy."""
            hashes, x, mask = step(served)
            zeros = [zero_rows_served(layer) for layer in LAYERS]
            if policy == "fail":
                with pytest.raises(hooks.PluginError, match=r"layer 1: step \d+'s rows were not served here"):
                    worker_step(served, hashes, x, mask)
            else:
                assert_same(worker_step(served, hashes, x, mask), vllm_cpu.step(zero, hashes, x, mask))
                assert [zero_rows_served(layer) - z for layer, z in zip(LAYERS, zeros)] == [1, 1]  # one step each
            assert all(t.pointer.item() == 0 for t in tables)

        hashes, x, mask = step(served)
        assert_same(worker_step(served, hashes, x, mask), vllm_cpu.step(local, hashes, x, mask))
        buffers = hooks.graph_steps()["node"].buffers()
        first = [(t.generation, t.pointer.item()) for t in tables]
        assert all(p == client.reader(t.name).local().ctypes.data for t, (_, p) in zip(tables, first))

        daemons[0].stop(signal.SIGKILL)
        wait_for(lambda: client.replicas()[daemons[0].address]["state"] == "down", "the client to see the node down")
        unreadable_step()

        daemons.append(node("a2", engram_tables))  # the same data: a new memfd, mapped anew
        wait_for(lambda: client.replicas()[daemons[-1].address]["state"] == "up", "the client to reconnect")
        hashes, x, mask = step(served)
        assert_same(worker_step(served, hashes, x, mask), vllm_cpu.step(local, hashes, x, mask))
        for t, (generation, _) in zip(tables, first):  # registered again (the address itself may be reused)
            assert t.generation > generation + 1 and t.pointer.item() == client.reader(t.name).local().ctypes.data
        assert hooks.graph_steps()["node"].buffers() == buffers

        daemons[-1].stop(signal.SIGKILL)
        daemons.append(node("a3", other_tables))  # same names and sizes, other rows
        wait_for(
            lambda: client.replicas()[daemons[-1].address]["state"] == "refused",
            lambda: f"the client to refuse the other data: {client.replicas()}",
        )
        assert all(client.reader(t.name).local() is None for t in tables)
        unreadable_step()
        assert hooks.hooked(Worker.execute_model, vllm_graphs.execute_model)
    finally:
        hooks.configure(PluginConfig())
        for d in daemons:
            d.stop()


def test_a_node_table_the_gpu_cannot_read_falls_back_to_the_eager_break_saying_why_in_one_line(
    vllm_config, hasher, engram_tables, local_run, tmp_path, caplog
):
    """A node daemon serving the tables from disk maps nothing into the process: graph mode device cannot
    register them, so each layer logs one line with the reason and takes the host path (vLLM's eager break),
    bit-identical still; under FULL graphs the host path waited for inside them (in_graph); piecewise graphs
    that are not breakable are refused, naming why."""
    disk = start_daemon(str(tmp_path / "disk"), "--tables", engram_tables, "--disk-tables", "all")
    try:
        want = local_run
        node = {"placement": {1: "node", 14: "node"}, "node_address": disk.address}
        with caplog.at_level("WARNING", logger="tableclient.vllm"):
            engrams = build(vllm_config, engram_tables, **node)
        lines = [r.getMessage() for r in caplog.records if "graph mode 'device' unavailable" in r.getMessage()]
        assert len(lines) == 2, lines
        for layer, line in zip(LAYERS, lines):
            assert "\n" not in line and line.startswith(f"tableserver plugin: Engram layer {layer}: ")
            assert "not mapped in this process" in line and line.endswith("falls back to the eager break")
        assert [e.embed_tokens.graph_mode for e in engrams] == ["eager_break", "eager_break"]
        assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == ["eager_break", "eager_break"]
        assert_bit_identical(run(engrams, hasher), want)
        assert all(hooks.rows().summary()[layer]["prefetched"] == len(want) for layer in LAYERS)
        with graph_mode(vllm_config, "FULL_AND_PIECEWISE"), caplog.at_level("WARNING", logger="tableclient.vllm"):
            caplog.clear()
            build(vllm_config, engram_tables, **node)
            assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == ["in_graph", "in_graph"]
            assert all(r.getMessage().endswith("(in_graph)") for r in caplog.records if "unavailable" in r.getMessage())
        with graph_mode(vllm_config, "PIECEWISE", breakable=False):
            with pytest.raises(hooks.PluginError, match="the GPU cannot read its table here .*not mapped in this pro"):
                build(vllm_config, engram_tables, **node)
    finally:
        hooks.configure(PluginConfig())
        disk.stop()


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE"])
def test_every_graph_mode_takes_node_layers_gathered_by_the_gpu_and_remote_ones_in_graph_or_eager(
    vllm_config, engram_tables, memnode, mode
):
    """Placement x vLLM's cudagraph_mode: a node layer in graph mode device is taken in each (its gather is a
    kernel the graph captures, or an eager break of a breakable one), breakable or not. A remote layer waits
    for its rows inside FULL graphs (graph mode in_graph, their default there); under piecewise graphs it runs
    through vLLM's eager break, taken only where breakable. A layer configured for the eager break is refused
    where FULL graphs would capture it inline (capture-time rows at every replay), with the flag to use."""
    node = {"placement": {1: "node", 14: "node"}, "node_address": memnode.address}
    eager_node = {"graph": {1: "eager_break", 14: "eager_break"}, **node}  # node, configured for the eager break
    for breakable in (True, False):
        with graph_mode(vllm_config, mode, breakable):
            engrams = build(vllm_config, engram_tables, **node)
            assert all(e.embed_tokens.graph_mode == "device" for e in engrams)
            assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == ["device", "device"]
            if mode == "PIECEWISE" and breakable:
                assert build(vllm_config, engram_tables, address=memnode.address)[1].embed_tokens.rows is hooks.rows()
                eager = build(vllm_config, engram_tables, **eager_node)
                assert all(e.embed_tokens.graph_mode == "eager_break" for e in eager)
                continue
            refused = [eager_node]
            if mode == "PIECEWISE":
                refused.append({"address": memnode.address})
            else:
                remote = build(vllm_config, engram_tables, address=memnode.address)
                assert all(e.embed_tokens.graph_mode == "in_graph" for e in remote)
                assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == ["in_graph", "in_graph"]
            refusal = "VLLM_USE_BREAKABLE_CUDAGRAPH=1" if mode == "PIECEWISE" else "FULL graphs do not take .*PIECEWISE"
            for options in refused:
                with pytest.raises(hooks.PluginError, match=f"eager break, which .*{refusal}"):
                    build(vllm_config, engram_tables, **options)
            build(vllm_config, engram_tables, address=memnode.address, placement={1: "local", 14: "local"})


def test_vllm_takes_graph_modes_device_in_graph_and_eager_break_and_refuses_before_replay():
    hooks.check_config(PluginConfig(layers={1: "node", 14: "remote"}, address="mem:1", graph={1: "device"}))
    hooks.check_config(PluginConfig(address="mem:1", graph={1: "eager_break", 14: "in_graph"}))
    with pytest.raises(hooks.PluginError) as e:
        hooks.check_config(PluginConfig(address="mem:1", graph={14: "before_replay"}))
    assert str(e.value) == (
        "tableserver plugin: graph.14 = 'before_replay' is an SGLang decode-graph mode; under vLLM a served layer "
        "runs through vLLM's eager break (piecewise CUDA graphs), waits for its rows inside vLLM's graphs "
        "(in_graph) or, placed node, is gathered by the GPU: remove it, or set 'in_graph', 'eager_break' or "
        "'device' (node)"
    )


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_remote_layers_in_full_graphs_wait_for_their_rows_inside_the_graph_bit_identical(
    vllm_config, hasher, engram_tables, memnode, local_run, mode
):
    """Remote layers under vLLM's FULL graphs (graph mode in_graph): the forward publishes each layer's ids
    right after vLLM's hasher and waits for its rows flag just before the layer (here the host stands in
    for the stream: HostStreamOps), ``Worker.execute_model`` arms each step for its real tokens and the
    native poller gathers them. A profile run before any step (nothing armed) only copies; every step of the
    conversation (an image span's dead ids, chunked prefill, decode) is bit-identical to vLLM's own tables;
    only live ids are sent; a data-parallel dummy batch (armed for 0 tokens: its rows are padding vLLM
    drops) is released at once and reads nothing."""
    want = local_run
    with graph_mode(vllm_config, mode):
        remote = build(vllm_config, engram_tables, address=memnode.address)
    waits = {layer: _in_graph_waits(layer) for layer in LAYERS}
    served = {t: server_rows(memnode, t) for t in TABLES}
    try:
        hashes, x, mask = with_dead_ids(hasher)[0]
        vllm_cpu.step(remote, hashes, x, mask)  # vLLM's profile run: not a step, nothing armed or gathered
        steps = hooks.graph_steps()
        assert steps is not None and {s.poller for s in steps.values()} == {"native"}
        assert_bit_identical(run(remote, hasher, step=worker_step), want)
        for i, t in enumerate(TABLES):  # every live id of the steps read once, no dead one
            live = sum(int((h[:, i] != DEAD_ID).sum()) for h, _ in want)
            assert server_rows(memnode, t) - served[t] == live, t
        served = {t: server_rows(memnode, t) for t in TABLES}
        assert len(vllm_cpu.dummy_step(remote, hasher)) == len(LAYERS)
        assert {t: server_rows(memnode, t) for t in TABLES} == served
        for s in steps.values():
            s.account()
        assert {layer: _in_graph_waits(layer) - waits[layer] for layer in LAYERS} == {1: 9, 14: 9}  # 8 steps, dummy
    finally:
        hooks.close_graphs()


def test_gathers_run_in_vllms_eager_break(plugin):
    """The host path's issue and wait, and the graph step's publish and rows (the device path's launch and join),
    are wrapped by vLLM's eager_break_during_capture, as vLLM's own prefetch: breakable piecewise graphs run them
    between captured segments at every replay (a side stream's fork cannot span segments); FULL graphs capture them
    inline."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    for name, fn in (
        ("issue", vllm_eager.issue),
        ("collect", vllm_eager.collect),
        ("publish", vllm_graphs.publish),
        ("rows", vllm_graphs.graph_rows),
    ):
        wrapped = vllm_layers.eager_breaks()[name]
        assert wrapped.__wrapped__ is fn
        assert wrapped.__code__ is eager_break_during_capture(fn).__code__


@pytest.mark.parametrize("policy", ["fail", "zeros", "fallback"])
@pytest.mark.parametrize("graph", ["eager", "in_graph"])
def test_failure_policy_when_the_memory_node_dies(vllm_config, hasher, engram_tables, tmp_path, policy, graph):
    """The node dies between steps: fail raises before the step's output is read (in_graph: from vLLM's
    ``Worker.execute_model``, once the poller released the step), zeros runs the layer on zero rows
    (counted), fallback reads the backup's rows; the local layer is untouched. In graph mode in_graph (FULL
    graphs) as on the eager path."""
    from prometheus_client import REGISTRY
    from tableclient import TableClientError

    step = vllm_cpu.step if graph == "eager" else worker_step

    primary = start_daemon(str(tmp_path / "primary"), "--tables", engram_tables)
    backup = start_daemon(str(tmp_path / "backup"), "--tables", engram_tables) if policy == "fallback" else None
    try:
        zero = build(vllm_config, engram_tables, layers=(14,))[0]  # vLLM's own layer 14 over an all-zero table
        zero.embed_tokens.weight.data.view(torch.uint8).zero_()
        zero.embed_tokens.weight_scale_inv.data.zero_()
        local = build(vllm_config, engram_tables)
        extra = {"fallback_address": backup.address} if backup else {}
        with graph_mode(vllm_config, "FULL") if graph == "in_graph" else contextlib.nullcontext():
            remote = build(
                vllm_config,
                engram_tables,
                address=primary.address,
                placement={1: "local"},
                policy=policy,
                timeout=30.0,
                **extra,
            )
        assert remote[1].embed_tokens.graph_mode == ("in_graph" if graph == "in_graph" else "eager_break")
        steps = vllm_cpu.decode_steps()
        _, hashes, mask = vllm_cpu.hash_batch(hasher, steps[0])
        x = torch.ones((len(hashes), HC, HIDDEN), dtype=torch.bfloat16)
        got = step(remote, hashes, x, mask)  # served normally
        assert torch.equal(got[1].view(torch.int16), vllm_cpu.step(local, hashes, x, mask)[1].view(torch.int16))
        primary.stop(signal.SIGKILL)  # the memory node dies between steps
        _, hashes, mask = vllm_cpu.hash_batch(hasher, steps[1])
        x = torch.ones((len(hashes), HC, HIDDEN), dtype=torch.bfloat16)
        zeros_before = REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total", {"layer": "14"}) or 0
        fallbacks = REGISTRY.get_sample_value("tableserver_client_fallbacks_total", {"layer": "14"}) or 0
        if policy == "fail":
            with pytest.raises(TableClientError, match="layer 14" if graph == "in_graph" else ""):
                step(remote, hashes, x, mask)
            return
        got, want = step(remote, hashes, x, mask), vllm_cpu.step(local, hashes, x, mask)
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))  # layer 1 is local
        if policy == "zeros":  # layer 14 ran on zero rows
            zero.prepare_embeddings(hashes[:, 1])
            assert torch.equal(got[1].view(torch.int16), zero(x, hashes[:, 1], mask).view(torch.int16))
            assert not torch.equal(got[1], want[1])
            value = REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total", {"layer": "14"})
            assert value == zeros_before + 1
        else:
            assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
            assert REGISTRY.get_sample_value("tableserver_client_fallbacks_total", {"layer": "14"}) == fallbacks + 1
    finally:
        hooks.configure(PluginConfig())  # the in_graph layers' GraphStep closed with the configuration
        primary.stop()
        if backup:
            backup.stop()


def test_policy_fail_is_checked_where_vllm_reads_the_steps_result(vllm_config, hasher, engram_tables, tmp_path):
    """Graph mode in_graph under policy fail: the launch path never raises (``Worker.execute_model`` returns as
    vLLM's does, its CPU lead intact); the step's outcome is checked where its results are read: a
    ModelRunnerOutput in ``Worker.sample_tokens``; with vLLM's async scheduling, the AsyncModelRunnerOutput's
    ``get_output()``, as vLLM's own executor reads it (its AsyncOutputFuture). A good step passes both."""
    from tableclient import TableClientError
    from vllm.v1.executor.uniproc_executor import AsyncOutputFuture
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    class Async(AsyncModelRunnerOutput):  # a step's result still on its way to the host, as vLLM's runner has it
        def __init__(self):
            self.read = 0

        def get_output(self):
            self.read += 1
            return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7]])

        def get_kv_connector_output(self):
            return None

    primary = start_daemon(str(tmp_path / "primary"), "--tables", engram_tables)
    try:
        with graph_mode(vllm_config, "FULL"):
            remote = build(vllm_config, engram_tables, address=primary.address, placement={1: "local"},
                           policy="fail", timeout=30.0)  # fmt: skip
        steps = vllm_cpu.decode_steps()
        _, hashes, mask = vllm_cpu.hash_batch(hasher, steps[0])
        x = torch.ones((len(hashes), HC, HIDDEN), dtype=torch.bfloat16)
        inner = Async()
        _, result = worker_step(remote, hashes, x, mask, output=inner)  # served: checked when read
        assert isinstance(result, AsyncModelRunnerOutput) and inner.read == 0
        assert AsyncOutputFuture(result, True).result().sampled_token_ids == [[7]]
        primary.stop(signal.SIGKILL)  # the memory node dies between steps
        _, hashes, mask = vllm_cpu.hash_batch(hasher, steps[1])
        x = torch.ones((len(hashes), HC, HIDDEN), dtype=torch.bfloat16)
        inner = Async()
        _, result = worker_step(remote, hashes, x, mask, output=inner)  # launched: nothing raised
        with pytest.raises(TableClientError, match=r"layer 14: step \d+'s rows were not served here"):
            AsyncOutputFuture(result, True).result()
        with pytest.raises(TableClientError, match=r"layer 14: step \d+'s rows were not served here"):
            worker_step(remote, hashes, x, mask)  # the synchronous output: checked in sample_tokens
    finally:
        hooks.configure(PluginConfig())
        primary.stop()
