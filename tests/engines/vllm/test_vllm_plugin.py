"""The plugin inside the released vLLM (0.33.0, pinned): vLLM's own Engram classes on the CPU.

Every module here is vLLM's: ``ModelConfig``/``VllmConfig`` of a DeepSeek-V4.1 model directory (its
config class, its tokenizer), ``EngramLayout``, ``NgramHashState`` (the V2 runner's stateless hash,
int32 ids, image spans dead), ``Engram`` and its ``ParallelEngramEmbedding`` (loaded through vLLM's
weight loader), vLLM's process groups (gloo), its safetensors iterator and file filter. Their Triton
kernels run in Triton's interpreter (tests/support/vllm_cpu.py). The hooks come from vLLM's real
``load_general_plugins()``, which finds the ``tableserver`` entry point of this installed package.

Two sets of layers are built over the same tables: one where vLLM holds its own table for every layer,
one with the plugin. The same steps (prefill with an image span, chunked prefill, decode) go through
both as ``DeepseekV4Model.forward`` drives them (hash once, every layer's ``prepare_embeddings``, then
each layer); outputs must be bit-identical, and the tableserver's own metrics must show it served them.

``node`` layers in graph mode ``device`` are gathered by the plugin's Triton kernel (Triton's interpreter
here) from the node daemon's mapping, as a GPU reads it once registered; vLLM's ``Worker.execute_model``
(hooked) checks their tables before every step, as it does under FULL graphs, where nothing else of the
plugin runs on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)
from conftest import EVENT_TIMEOUT, ROOT, local_tables, start_daemon, wait_for
from tests_helpers import client_rows, free_port_block, resident_share, scrape, value
from vllm_cpu import HC, HIDDEN, LAYERS

from tableserver.tables.demo import DemoTable, write_demo_file

torch = pytest.importorskip("torch")
try:
    import vllm.models.deepseek_v41.common.engram  # noqa: F401
except ModuleNotFoundError as e:  # only vllm itself missing skips; an installed vLLM that cannot load fails
    if (e.name or "").split(".")[0] != "vllm":
        raise
    pytest.skip("vllm==0.33.0 is installed by `make test`", allow_module_level=True)

from tableclient.engine import PluginConfig  # noqa: E402
from tableclient.vllm import hooks  # noqa: E402
from vllm.models.deepseek_v41.common.engram import DEAD_ID, Engram, ParallelEngramEmbedding  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vllm-model"))
    return path, vllm_cpu.write_model(path)


def model_tables(model_dir, folder, seed: int) -> str:
    """A table file of the model's Engram layers (their names and sizes), rows drawn from ``seed``."""
    _, sizes = model_dir
    path = str(folder / "engram.bin")
    tables = [DemoTable(f"engram.layer{layer}", rows, 264, layer) for layer, rows in zip(LAYERS, sizes)]
    return write_demo_file(path, tables, seed=seed)


@pytest.fixture(scope="module")
def engram_tables(model_dir, tmp_path_factory):
    return model_tables(model_dir, tmp_path_factory.mktemp("vllm-tables"), 11)


@pytest.fixture(scope="module")
def other_tables(model_dir, tmp_path_factory):
    """The same tables' names and sizes with other rows: another version of the data."""
    return model_tables(model_dir, tmp_path_factory.mktemp("vllm-other"), 12)


@pytest.fixture(scope="module")
def memnode(engram_tables, tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("memnode")), "--tables", engram_tables)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def plugin(memnode):
    """vLLM's own plugin loading (once per process, as in every vLLM process), enabled by TABLESERVER_ADDRESS."""
    from vllm.plugins import load_general_plugins

    os.environ["TABLESERVER_ADDRESS"] = memnode.address
    os.environ["VLLM_PLUGINS"] = "tableserver"  # vLLM's allow-list: ours is the one plugin loaded
    try:
        load_general_plugins()
    finally:
        del os.environ["TABLESERVER_ADDRESS"]
    assert hooks.hooked(Engram.prepare_embeddings, hooks._prepare_embeddings), "load_general_plugins did not hook"
    yield
    hooks.configure(PluginConfig())  # closes the clients; every layer local again


@pytest.fixture(scope="module")
def vllm_config(model_dir, plugin):
    cfg = vllm_cpu.make_vllm_config(model_dir[0])
    vllm_cpu.init_parallel(cfg)
    yield cfg
    vllm_cpu.close_parallel()


@pytest.fixture(scope="module")
def hasher(vllm_config):
    return vllm_cpu.make_hasher(vllm_config)


def build(cfg, tables_path, *, placement=None, address=None, layers=LAYERS, **plugin_options):
    """vLLM's Engram layers, each table loaded through vLLM's weight loader; plugin placement or none."""
    plugin_options.setdefault("transport", "tcp")  # a memory node is another host (auto would pick shm here)
    plugin_options.setdefault("liveness_timeout", 600.0)  # a busy machine must not fail the memory node over
    plugin_options.setdefault("gather_budget", 600.0)  # nor run an in_graph layer's gather out of its budget
    hooks.configure(PluginConfig(address=address or "", layers=placement or {}, **plugin_options))
    engrams = vllm_cpu.build_engrams(cfg, layers=layers)
    tables = local_tables(tables_path)
    for e, layer in zip(engrams, layers):
        vllm_cpu.load_table(e, np.array(tables[f"engram.layer{layer}"]))
    return engrams


def table_bytes(engram) -> int:
    return sum(p.numel() * p.element_size() for p in engram.embed_tokens.parameters())


def run(engrams, hasher, seed: int = 0, step=None):
    """Every step of the conversation: (hash ids, each layer's output); ``step`` runs one (the layers' own
    forward by default; ``worker_step``: through vLLM's Worker)."""
    rng = np.random.default_rng(seed)
    outs = []
    for requests in vllm_cpu.conversation():
        ids, hashes, mask = vllm_cpu.hash_batch(hasher, requests)
        x = torch.from_numpy(rng.standard_normal((len(ids), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
        outs.append((hashes, (step or vllm_cpu.step)(engrams, hashes, x, mask)))
    return outs


def assert_bit_identical(got, want):
    assert len(got) == len(want)
    for (h1, o1), (h2, o2) in zip(got, want):
        assert h1.dtype == torch.int32 and torch.equal(h1, h2)
        for a, b in zip(o1, o2):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit, not just close


def server_rows(memnode, table) -> float:
    return value(scrape(memnode.ready["metrics"]), "tableserver_gather_rows_total", table=table)


# ---------------------------------------------------------------------- served layers in vLLM's forward
def test_every_layer_remote_is_bit_identical_and_served_remotely(vllm_config, hasher, engram_tables, memnode):
    local = build(vllm_config, engram_tables)
    assert all(isinstance(e.embed_tokens, ParallelEngramEmbedding) and table_bytes(e) > 0 for e in local)
    want = run(local, hasher)
    before = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}

    remote = build(vllm_config, engram_tables, address=memnode.address)
    assert [table_bytes(e) for e in remote] == [0, 0]  # vLLM allocated no table rows
    assert all(e.staged_rows.shape[1:] == (24, 256) for e in remote)  # TP=1: every hash column on this rank
    got = run(remote, hasher)
    assert_bit_identical(got, want)

    summary = hooks.rows().summary()
    for layer in LAYERS:  # every step's rows were issued in prepare_embeddings, before the layers ran
        assert summary[layer]["prefetched"] == len(want) and summary[layer]["fetched"] == 0, summary
    served = {t: server_rows(memnode, t) - before[t] for t in before}
    ids = sum(h.shape[0] for h, _ in got) * 24
    assert all(0 < n <= ids for n in served.values()), served  # distinct ids of each gather, from the server


def test_mixed_placement_layer1_local_layer14_remote(vllm_config, hasher, engram_tables, memnode, model_dir):
    want = run(build(vllm_config, engram_tables), hasher)
    before = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}
    mixed = build(vllm_config, engram_tables, address=memnode.address, placement={1: "local", 14: "remote"})
    assert table_bytes(mixed[0]) == 264 * model_dir[1][0] and table_bytes(mixed[1]) == 0
    assert_bit_identical(run(mixed, hasher), want)
    assert server_rows(memnode, "engram.layer1") == before["engram.layer1"]  # layer 1 never asked the server
    assert server_rows(memnode, "engram.layer14") > before["engram.layer14"]


TABLES = tuple(f"engram.layer{layer}" for layer in LAYERS)


def shm_rows() -> dict:
    """Row ids this process's clients gathered from each table over shm (on the host)."""
    return {t: client_rows(t, layer, "shm") for t, layer in zip(TABLES, LAYERS)}


def with_dead_ids(hasher):
    """A prefill whose ids hold DEAD_ID (a padded token, single columns), and vLLM's own dummy-run ids."""
    _, hashes, mask = vllm_cpu.hash_batch(hasher, [([], list(range(3, 40)))])
    hashes = hashes.clone()
    hashes[5] = DEAD_ID
    hashes[9, :, ::3] = DEAD_ID
    dummy, keep = hasher.dummy_hashes(torch.zeros(4, dtype=torch.int32))
    x = torch.randn((len(hashes), HC, HIDDEN), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    return [(hashes, x, mask), (dummy, x[:4], keep)]


@pytest.mark.parametrize("graph", ["device", "eager_break"])
def test_node_layers_are_bit_identical_gathered_by_the_kernel_or_through_the_eager_break(
    vllm_config, hasher, engram_tables, memnode, graph
):
    """Placed node, a layer reads the table this host's daemon maps into the process (shm). In graph mode
    device (a node layer's default) the plugin's kernel gathers each step's rows from that mapping at step
    start, on the host not one row; with eager_break the host gathers them. Either way every output over
    prefill (an image span), chunked prefill, decode, dead ids and vLLM's dummy run is bit-identical to
    vLLM's own tables."""
    local = build(vllm_config, engram_tables)
    want = run(local, hasher)
    graphs = {} if graph == "device" else {"graph": {1: "eager_break", 14: "eager_break"}}
    node = build(vllm_config, engram_tables, placement={1: "node", 14: "node"}, node_address=memnode.address, **graphs)
    assert hooks.rows().client("node").transport == "shm"
    assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == [graph, graph]
    assert all((e.embed_tokens.device_rows is not None) == (graph == "device") for e in node)
    before = shm_rows()
    assert_bit_identical(run(node, hasher), want)
    for hash_ids, x, mask in with_dead_ids(hasher):
        for a, b in zip(vllm_cpu.step(local, hash_ids, x, mask), vllm_cpu.step(node, hash_ids, x, mask)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    gathered = {t: n - before[t] for t, n in shm_rows().items()}
    if graph == "device":
        assert gathered == {t: 0 for t in TABLES}, gathered  # every row came through the kernel
        assert all(e.embed_tokens.device_rows.table.pointer.item() != 0 for e in node)
    else:
        assert all(n > 0 for n in gathered.values()), gathered


def worker_step(engrams, hashes, x, mask):
    """One step as vLLM's worker runs it: its own ``Worker.execute_model`` (hooked: the plugin's check before
    every step, the one host code of the plugin a FULL graph's replay runs), whose model runner (here: what
    DeepseekV4Model.forward does with the step) hashes and runs the layers. Returns their outputs, or raises
    before the forward."""
    from vllm.v1.worker.gpu_worker import Worker

    assert hooks.hooked(Worker.execute_model, hooks._execute_model)
    outs = []
    worker = object.__new__(Worker)
    worker._pp_send_work, worker.profiler, worker.use_v2_model_runner = [], None, False
    worker.model_runner = types.SimpleNamespace(
        execute_model=lambda scheduler_output, intermediate: outs.append(vllm_cpu.step(engrams, hashes, x, mask))
    )
    Worker.execute_model(worker, types.SimpleNamespace(total_num_scheduled_tokens=len(hashes)))
    return outs[0]


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


@pytest.mark.parametrize("policy", ["zeros", "fail"])
def test_a_node_restart_is_registered_anew_and_a_node_on_other_data_is_never_read(
    vllm_config, hasher, engram_tables, other_tables, tmp_path, policy
):
    """Device layers across node daemon restarts, each step through vLLM's Worker.execute_model. The node
    killed: its table is unreadable, the kernel's pointer is 0 and the policy applies (zeros: the layers
    compute what vLLM's own do over zero tables, counted per row; fail: the step is not run). Restarted on
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
        tables = [e.embed_tokens.device_rows.table for e in served]
        buffers = [
            (e.embed_tokens.device_rows.ids.data_ptr(), e.embed_tokens.device_rows.rows.data_ptr()) for e in served
        ]
        steps = iter(vllm_cpu.conversation())
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
                with pytest.raises(hooks.PluginError, match="is not mapped in this process.*the step is not run"):
                    worker_step(served, hashes, x, mask)
            else:
                assert_same(worker_step(served, hashes, x, mask), vllm_cpu.step(zero, hashes, x, mask))
                assert [zero_rows_served(layer) - z for layer, z in zip(LAYERS, zeros)] == [1, 1]  # one step each
            assert all(t.pointer.item() == 0 for t in tables)

        hashes, x, mask = step(served)
        assert_same(worker_step(served, hashes, x, mask), vllm_cpu.step(local, hashes, x, mask))
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
        assert [
            (e.embed_tokens.device_rows.ids.data_ptr(), e.embed_tokens.device_rows.rows.data_ptr()) for e in served
        ] == buffers

        daemons[-1].stop(signal.SIGKILL)
        daemons.append(node("a3", other_tables))  # same names and sizes, other rows
        wait_for(
            lambda: client.replicas()[daemons[-1].address]["state"] == "refused",
            lambda: f"the client to refuse the other data: {client.replicas()}",
        )
        assert all(client.reader(t.name).local() is None for t in tables)
        unreadable_step()
        assert hooks.hooked(Worker.execute_model, hooks._execute_model)
    finally:
        hooks.configure(PluginConfig())
        for d in daemons:
            d.stop()


def test_a_node_table_the_gpu_cannot_read_falls_back_to_the_eager_break_saying_why_in_one_line(
    vllm_config, hasher, engram_tables, tmp_path, caplog
):
    """A node daemon serving the tables from disk maps nothing into the process: graph mode device cannot
    register them, so each layer logs one line with the reason and takes the host path (vLLM's eager break),
    bit-identical still; under FULL graphs the host path waited for inside them (in_graph); piecewise graphs
    that are not breakable are refused, naming why."""
    disk = start_daemon(str(tmp_path / "disk"), "--tables", engram_tables, "--disk-tables", "all")
    try:
        want = run(build(vllm_config, engram_tables), hasher)
        node = {"placement": {1: "node", 14: "node"}, "node_address": disk.address}
        with caplog.at_level("WARNING", logger="tableclient.vllm"):
            engrams = build(vllm_config, engram_tables, **node)
        lines = [r.getMessage() for r in caplog.records if "graph mode 'device' unavailable" in r.getMessage()]
        assert len(lines) == 2, lines
        for layer, line in zip(LAYERS, lines):
            assert "\n" not in line and line.startswith(f"tableserver plugin: Engram layer {layer}: ")
            assert "not mapped in this process" in line and line.endswith("falls back to the eager break")
        assert all(e.embed_tokens.device_rows is None for e in engrams)
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


def test_dead_ids_and_int32_ids_give_vllms_zero_rows(vllm_config, hasher, engram_tables, memnode):
    """DEAD_ID (-1) marks padding and dummy runs: vLLM's lookup gives those rows zeros. The plugin never
    sends them (the server would refuse a negative id) and zero-fills them, whatever else is in the step."""
    local = build(vllm_config, engram_tables)
    remote = build(vllm_config, engram_tables, address=memnode.address)
    _, hashes, mask = vllm_cpu.hash_batch(hasher, [([], list(range(3, 40)))])
    hashes = hashes.clone()
    hashes[5] = DEAD_ID  # a padded token
    hashes[9, :, ::3] = DEAD_ID  # and single columns
    dummy, keep = vllm_cpu.make_hasher(vllm_config).dummy_hashes(torch.zeros(4, dtype=torch.int32))  # vLLM's own
    assert dummy.dtype == torch.int32 and bool((dummy == DEAD_ID).all())
    x = torch.randn((len(hashes), HC, HIDDEN), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for hash_ids, token_mask, inputs in ((hashes, mask, x), (dummy, keep, x[:4])):
        before = server_rows(memnode, "engram.layer14")
        want = vllm_cpu.step(local, hash_ids, inputs, token_mask)
        for a, b in zip(want, vllm_cpu.step(remote, hash_ids, inputs, token_mask)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        if hash_ids is dummy:  # a dummy run (every id dead) sends nothing
            assert server_rows(memnode, "engram.layer14") == before
    for e in remote:  # the staged rows of the dead ids are exact zeros
        e.prepare_embeddings(hashes[:, e.layer_hash_index])
        rows = e.embed(hashes[:, e.layer_hash_index])
        assert not rows[5].any() and not rows[9, ::3].any() and rows[9, 1::3].any()


def tcp_rows(table: str) -> float:
    """Row ids this process's clients asked for from ``table`` over tcp."""
    return client_rows(table, int(table.removeprefix("engram.layer")), "tcp")


def test_a_step_mixing_live_and_dead_ids_sends_only_the_live_ones(vllm_config, hasher, engram_tables, memnode):
    """DEAD_ID marks vLLM's padding and dummy runs. Before: whenever a step mixed live and dead
    ids, every dead id was sent as row 0 (measured in vLLM: 2,832 rows per layer for 2,712 live ids). Now
    the client asks for exactly the live ids, in prepare_embeddings' gathers and in the embedding's
    lookup, the server serves no more than those, and every output stays bit-identical with vLLM's."""
    local = build(vllm_config, engram_tables)
    remote = build(vllm_config, engram_tables, address=memnode.address)
    _, hashes, mask = vllm_cpu.hash_batch(hasher, next(vllm_cpu.conversation()))  # a prefill, two requests
    hashes = hashes.clone()
    hashes[40] = DEAD_ID  # a padded token
    hashes[20, :, ::5] = DEAD_ID  # and single columns
    x = torch.randn((len(hashes), HC, HIDDEN), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tables = [f"engram.layer{layer}" for layer in LAYERS]
    live = {t: int((hashes[:, e.layer_hash_index] != DEAD_ID).sum()) for t, e in zip(tables, remote)}
    assert all(0 < n < hashes[:, 0].numel() for n in live.values()), live  # a mix of live and dead ids
    asked, served = {t: tcp_rows(t) for t in tables}, {t: server_rows(memnode, t) for t in tables}
    want = vllm_cpu.step(local, hashes, x, mask)
    for a, b in zip(want, vllm_cpu.step(remote, hashes, x, mask)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    asked = {t: tcp_rows(t) - asked[t] for t in tables}
    served = {t: server_rows(memnode, t) - served[t] for t in tables}
    assert asked == live, f"row ids sent {asked} for live ids {live}"
    assert all(served[t] <= live[t] for t in tables), (served, live)
    embed = remote[1].embed_tokens  # vLLM's lookup and forward: gathered now
    ids = hashes[:, remote[1].layer_hash_index]
    before = tcp_rows(tables[1])
    got = torch.empty((len(ids), 24, 264), dtype=torch.uint8)
    embed.lookup(ids, got)
    assert tcp_rows(tables[1]) - before == live[tables[1]]
    want = torch.empty_like(got)
    local[1].embed_tokens.lookup(ids, want)
    assert torch.equal(got, want)


def test_a_layer_never_gets_rows_it_did_not_issue(vllm_config, hasher, engram_tables, memnode):
    """Each step's rows are handed over once, to the layer and token count they were issued for: a layer run
    without its prepare_embeddings, or a second time, fails instead of reusing another step's rows."""
    from tableclient.engine import EngramRowsError

    e = build(vllm_config, engram_tables, address=memnode.address, layers=(14,))[0]
    _, hashes, _ = vllm_cpu.hash_batch(hasher, [([], list(range(3, 12)))])
    with pytest.raises(EngramRowsError, match="not issued at step start"):
        e.embed(hashes[:, 1])
    e.prepare_embeddings(hashes[:, 1])
    e.embed(hashes[:, 1])
    with pytest.raises(EngramRowsError, match="not issued at step start"):
        e.embed(hashes[:, 1])  # collected already
    e.prepare_embeddings(hashes[:5, 1])
    with pytest.raises(EngramRowsError, match="not issued at step start"):
        e.embed(hashes[:, 1])  # issued for 5 tokens, asked for 9


def test_embedding_lookup_and_forward_are_vllms(vllm_config, hasher, engram_tables, memnode):
    """The served embedding answers vLLM's ParallelEngramEmbedding interface too (lookup into bf16 or packed
    rows, forward), with the same bytes."""
    local = build(vllm_config, engram_tables, layers=(14,))[0].embed_tokens
    remote = build(vllm_config, engram_tables, address=memnode.address, layers=(14,))[0].embed_tokens
    _, hashes, _ = vllm_cpu.hash_batch(hasher, [([], list(range(50, 70)))])
    ids = hashes[:, 1].clone()
    ids[3] = DEAD_ID
    assert torch.equal(local(ids).view(torch.int16), remote(ids).view(torch.int16))
    for dtype, width in ((torch.bfloat16, 256), (torch.uint8, 264)):
        want, got = (torch.empty((len(ids), 24, width), dtype=dtype) for _ in range(2))
        local.lookup(ids, want)
        remote.lookup(ids, got)
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))


def test_dequantize_follows_vllms_scale_arithmetic():
    """vLLM's lookup kernel puts the scale byte into the float32 exponent (byte 0 -> 0.0); torch's e8m0
    type (SGLang's arithmetic) reads byte 0 as 2**-127. The plugin uses vLLM's."""
    from tableclient.engine import dequantize

    packed = torch.zeros((1, 264), dtype=torch.uint8)
    packed[0, :256] = 0x38  # fp8 e4m3 1.0
    packed[0, 256:] = torch.tensor([0, 1, 100, 126, 127, 128, 150, 200], dtype=torch.uint8)
    got = dequantize(packed, 256, exponent_scales=True).float().view(8, 32)[:, 0]
    assert got[0] == 0.0 and got[1] == 2.0**-126 and got[4] == 1.0 and got[6] == 2.0**23
    assert dequantize(packed, 256).float()[0, 0] == 2.0**-127  # SGLang's


@pytest.mark.slow
def test_tensor_and_sequence_parallel_ranks_gather_their_columns(model_dir, engram_tables, memnode):
    """TP=2 in two processes over gloo (tests/support/vllm_ranks.py): each rank's served layers gather only its
    hash columns (12 of 24), and vLLM's own collectives join them, as for its head-sharded local tables;
    with sequence parallelism too; placed remote (the host path) and placed node (graph mode device: each
    rank's kernel gathers its own columns of every token). Every output bit-identical to vLLM's own tables on
    that rank."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(port), model_dir[0], engram_tables, memnode.address]
    ranks = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "support", "vllm_ranks.py"), str(rank), "2", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for rank in range(2)
    ]
    reports = []
    for proc in ranks:
        out, err = proc.communicate(timeout=EVENT_TIMEOUT)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for rank, report in enumerate(reports):
        for mode in ("tp", "sp"):
            assert report[mode]["identical"], report
            assert report[mode]["columns"] == [[12 * rank, 12 * rank + 12]] * 2, report
            assert report[mode]["node"] == {"identical": True, "columns": report[mode]["columns"], "device": True}
        assert report["served"] == {"1": 8, "14": 8}  # sp's steps, each issued at step start


# ---------------------------------------------------------------------- start-up
def test_wrong_or_missing_table_fails_at_construction(vllm_config, engram_tables, memnode):
    from tableclient.engine import EngramRowsError

    with pytest.raises(EngramRowsError, match="serves no table 'nope.14'"):
        build(vllm_config, engram_tables, address=memnode.address, tables={14: "nope.14"})
    with pytest.raises(EngramRowsError, match="has .* rows of 264 B but layer 1 of this model needs"):
        build(vllm_config, engram_tables, address=memnode.address, tables={1: "engram.layer14"})


def test_start_up_check(vllm_config, engram_tables, memnode, caplog):
    engrams = build(vllm_config, engram_tables, address=memnode.address, placement={1: "local"})
    with caplog.at_level("INFO", logger="tableclient.vllm"):
        hooks.verify(torch.nn.ModuleList(engrams))
    assert "engaged: layer 1 local (vLLM's own table), layer 14 remote" in caplog.text
    engrams = build(vllm_config, engram_tables, address=memnode.address, placement={1: "local", 7: "remote"})
    with pytest.raises(hooks.PluginError, match="names layer 7, which is not an Engram layer"):
        hooks.verify(torch.nn.ModuleList(engrams))


def test_a_local_table_sharded_over_dp_ranks_cannot_sit_beside_a_served_layer(vllm_config, engram_tables, memnode):
    """With Engram DP groups vLLM may shard a local table over the replicas (dp_size 2 below, as vLLM sets it
    for two replicas) and then stages every layer as one batch of all replicas' tokens: a served layer
    reads its own replica's rows, so the mix is refused when the model is built, and again at load."""
    from vllm.models.deepseek_v41.common.engram import EngramBatch

    engrams = build(vllm_config, engram_tables, address=memnode.address, placement={1: "local"})
    assert EngramBatch.create(engrams, 64) is None  # dp_size 1 everywhere: vLLM builds no batch, as before
    engrams[0].embed_tokens.dp_size = 2
    with pytest.raises(hooks.PluginError, match="sharded over data-parallel ranks"):
        EngramBatch.create(engrams, 64)
    with pytest.raises(hooks.PluginError, match="sharded over data-parallel ranks"):
        hooks.verify(torch.nn.ModuleList(engrams))


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
            assert all(e.embed_tokens.device_rows is not None for e in engrams)
            assert [hooks.rows().layers[layer].graph_mode for layer in LAYERS] == ["device", "device"]
            if mode == "PIECEWISE" and breakable:
                assert build(vllm_config, engram_tables, address=memnode.address)[1].embed_tokens.rows is hooks.rows()
                assert all(e.embed_tokens.device_rows is None for e in build(vllm_config, engram_tables, **eager_node))
                continue
            refused = [eager_node]
            if mode == "PIECEWISE":
                refused.append({"address": memnode.address})
            else:
                remote = build(vllm_config, engram_tables, address=memnode.address)
                assert all(e.embed_tokens.in_graph for e in remote)
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


def dummy_batch(engrams, hasher):
    """vLLM's own ``Worker.execute_dummy_batch`` (hooked), its model runner's dummy run stepping the layers
    over vLLM's dummy hashes (every id dead)."""
    from vllm.v1.worker.gpu_worker import Worker

    assert hooks.hooked(Worker.execute_dummy_batch, hooks._execute_dummy_batch)
    dummy, keep = hasher.dummy_hashes(torch.zeros(4, dtype=torch.int32))
    x = torch.zeros((4, HC, HIDDEN), dtype=torch.bfloat16)
    outs = []
    worker = object.__new__(Worker)
    worker.parallel_config = types.SimpleNamespace(data_parallel_size=2)  # a DP replica, as vLLM runs them
    worker.model_runner = types.SimpleNamespace(
        uniform_decode_query_len=1,
        _dummy_run=lambda *a, **k: outs.append(vllm_cpu.step(engrams, dummy, x, keep)),
    )
    Worker.execute_dummy_batch(worker)
    return outs[0]


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_remote_layers_in_full_graphs_wait_for_their_rows_inside_the_graph_bit_identical(
    vllm_config, hasher, engram_tables, memnode, mode
):
    """Remote layers under vLLM's FULL graphs (graph mode in_graph): the forward publishes each layer's ids
    right after vLLM's hasher and waits for its rows flag just before the layer (here the host stands in
    for the stream: HostStreamOps), ``Worker.execute_model`` arms each step for its real tokens and the
    native poller gathers them. A profile run before any step (nothing armed) only copies; every step of the
    conversation (an image span's dead ids, chunked prefill, decode) is bit-identical to vLLM's own tables;
    only live ids are sent; a data-parallel dummy batch (armed for 0 tokens: its rows are padding vLLM
    drops) is released at once and reads nothing."""
    local = build(vllm_config, engram_tables)
    want = run(local, hasher)
    with graph_mode(vllm_config, mode):
        remote = build(vllm_config, engram_tables, address=memnode.address)
    waits = {layer: _in_graph_waits(layer) for layer in LAYERS}
    served = {t: server_rows(memnode, t) for t in TABLES}
    try:
        hashes, x, mask = with_dead_ids(hasher)[0]
        vllm_cpu.step(remote, hashes, x, mask)  # vLLM's profile run: not a step, nothing armed or gathered
        steps = hooks._graph["steps"]
        assert steps is not None and {s.poller for s in steps.values()} == {"native"}
        assert_bit_identical(run(remote, hasher, step=worker_step), want)
        for i, t in enumerate(TABLES):  # every live id of the steps read once, no dead one
            live = sum(int((h[:, i] != DEAD_ID).sum()) for h, _ in want)
            assert server_rows(memnode, t) - served[t] == live, t
        served = {t: server_rows(memnode, t) for t in TABLES}
        assert len(dummy_batch(remote, hasher)) == len(LAYERS)
        assert {t: server_rows(memnode, t) for t in TABLES} == served
        for s in steps.values():
            s.account()
        assert {layer: _in_graph_waits(layer) - waits[layer] for layer in LAYERS} == {1: 9, 14: 9}  # 8 steps, dummy
    finally:
        hooks.close_graphs()


def _in_graph_waits(layer: int) -> float:
    from prometheus_client import REGISTRY

    labels = {"layer": str(layer), "phase": "in_graph"}
    return REGISTRY.get_sample_value("tableserver_client_graph_wait_seconds_count", labels) or 0


def test_gathers_run_in_vllms_eager_break(plugin):
    """The host path's issue and wait, and the device path's launch and join, are wrapped by vLLM's
    eager_break_during_capture, as vLLM's own prefetch: breakable piecewise graphs run them between captured
    segments at every replay (a side stream's fork cannot span segments); FULL graphs capture them inline."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    for name, fn in (
        ("issue", hooks._issue),
        ("collect", hooks._collect),
        ("launch", hooks._launch),
        ("join", hooks._join),
        ("publish", hooks._publish),
        ("rows", hooks._graph_rows),
    ):
        wrapped = hooks._eager[name]
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
        assert remote[1].embed_tokens.in_graph == (graph == "in_graph")
        steps = list(vllm_cpu.conversation())
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


# ---------------------------------------------------------------------- checkpoint loading
def _checkpoint(tmp_path, rows: int = 600_000):
    """Two safetensors shards named as DeepSeek-V4.1's are: one with both layers' tables (154 MB each: far
    more than the readahead around what is read) and a projection, one holding nothing but a table of layer
    14. Returns (paths, the first file's tensors, their byte spans in it)."""
    import struct

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    first = {
        f"layers.{layer}.engram.embed.{name}": torch.randint(0, 120, (rows, n), generator=g, dtype=torch.uint8)
        for layer in LAYERS
        for name, n in (("weight", 256), ("scale", 8))
    }
    first["layers.14.engram.wkv.weight"] = torch.randn(64, 32, generator=g)
    only14 = {
        f"layers.14.engram.embed.{name}": torch.zeros((1000, n), dtype=torch.uint8)
        for name, n in (("weight", 256), ("scale", 8))
    }
    paths = [str(tmp_path / "model-00001-of-00002.safetensors"), str(tmp_path / "model-00002-of-00002.safetensors")]
    save_file(first, paths[0])
    save_file(only14, paths[1])
    with open(paths[0], "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    spans = {
        k: (8 + header_len + v["data_offsets"][0], 8 + header_len + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }
    return paths, first, spans


def test_checkpoint_tensors_of_served_tables_are_never_read(plugin, memnode, tmp_path):
    """vLLM's default safetensors iterator, hooked: layer 14's table (served) is neither yielded nor read from
    disk, and the shard holding nothing but it is not even opened; layer 1's (local) and every other tensor
    are read, unchanged."""
    from vllm.model_executor.model_loader.weight_utils import (
        filter_safetensors_files_by_weight_name,
        safetensors_weights_iterator,
    )
    from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM

    paths, tensors, spans = _checkpoint(tmp_path)
    if max(resident_share(paths[0], *span) for span in spans.values()) > 0.5:
        pytest.skip("this filesystem keeps the file in the page cache (tmpfs?): cannot tell what was read")
    hooks.configure(PluginConfig(address=memnode.address, transport="tcp", layers={1: "local"}))
    try:
        # the load format's shard filter, with the model's rule: the layer-14-only shard is dropped
        unused = DeepseekV41ForCausalLM.is_unused_checkpoint_weight.__get__(object.__new__(DeepseekV41ForCausalLM))
        assert filter_safetensors_files_by_weight_name(paths, unused) == paths[:1]
        got = dict(safetensors_weights_iterator(paths[:1], False))
    finally:
        hooks.configure(PluginConfig())
    served = {k for k in tensors if k.startswith("layers.14.engram.embed.")}
    assert set(got) == set(tensors) - served
    for k in got:
        assert torch.equal(got[k], tensors[k])
    assert resident_share(paths[0], *spans["layers.1.engram.embed.weight"]) > 0.5  # read
    # never read: at most the kernel's readahead next to what was read
    assert resident_share(paths[0], *spans["layers.14.engram.embed.weight"]) < 0.25
    assert hooks.hooked(DeepseekV41ForCausalLM.load_weights, hooks._load_weights)
    hooks.configure(PluginConfig(address=memnode.address, layers={1: "local"}))
    try:
        names = [
            "layers.14.engram.embed.weight",
            "layers.14.engram.embed.scale",
            "model.layers.14.engram.embed_tokens.weight",
            "model.layers.14.engram.embed_tokens.weight_scale_inv",
            "layers.1.engram.embed.weight",
            "layers.14.engram.wkv.weight",
        ]
        assert [hooks.served_key(k) for k in names] == [True, True, True, True, False, False]
    finally:
        hooks.configure(PluginConfig())


def test_a_whole_file_load_format_reaches_the_served_layer_and_is_dropped(
    vllm_config, engram_tables, memnode, model_dir
):
    """Load formats that read whole shards hand the served table's tensors to its parameters by name: the
    parameters exist (vLLM's params_dict finds them) and their loader drops the bytes."""
    remote = build(vllm_config, engram_tables, address=memnode.address, layers=(14,))[0]  # loaded as vLLM loads
    assert table_bytes(remote) == 0
    assert remote.embed_tokens.discarded_bytes == 264 * model_dir[1][1]


def test_load_weights_hook_drops_served_tensors_and_counts_their_parameters(
    vllm_config, engram_tables, memnode, caplog
):
    """The model's load_weights, hooked (vLLM's DeepseekV41ForCausalLM needs a GPU to build, so the hook runs here
    around a recorder): whatever the load format read, a served table's tensors never reach vLLM's loading, its
    empty parameters count as loaded (vLLM checks every parameter was), and the start-up check runs."""
    from vllm.models.deepseek_v41 import DeepseekV41ForCausalLM

    assert hooks.hooked(DeepseekV41ForCausalLM.load_weights, hooks._load_weights)
    engrams = build(vllm_config, engram_tables, address=memnode.address, placement={1: "local"})
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(16))
    for e, layer in zip(engrams, LAYERS):
        model.layers[layer].engram = e
    seen = []

    def vllms_load_weights(self, weights):
        seen.extend(name for name, _ in weights)
        return set(seen)

    weights = [(f"layers.{layer}.engram.embed.{n}", torch.zeros(1)) for layer in LAYERS for n in ("weight", "scale")]
    with caplog.at_level("INFO", logger="tableclient.vllm"):
        loaded = hooks._load_weights(vllms_load_weights, model, iter(weights + [("layers.14.engram.wkv.weight", 0)]))
    assert seen == ["layers.1.engram.embed.weight", "layers.1.engram.embed.scale", "layers.14.engram.wkv.weight"]
    assert {"layers.14.engram.embed_tokens.weight", "layers.14.engram.embed_tokens.weight_scale_inv"} <= loaded
    assert "engaged: layer 1 local (vLLM's own table), layer 14 remote" in caplog.text
