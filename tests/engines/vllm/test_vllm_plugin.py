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

The graph modes (``device``, ``in_graph``) and the failure policies: tests/engines/vllm/test_vllm_graphs.py;
tensor and sequence parallel ranks: test_vllm_ranks.py; vLLM's start-up: test_vllm_startup.py (they use
this module's fixtures and helpers; apart so that the test workers share vLLM's minutes).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)
from conftest import local_tables, start_daemon
from tests_helpers import client_rows, resident_share, scrape, value
from vllm_cpu import HC, HIDDEN, LAYERS

from tableserver.tables.demo import DemoTable, write_demo_file

torch = pytest.importorskip("torch")
vllm_cpu.require_vllm()

from tableclient.engine import PluginConfig  # noqa: E402
from tableclient.vllm import hooks  # noqa: E402
from tableclient.vllm import layers as vllm_layers  # noqa: E402
from tableclient.vllm import loading as vllm_loading  # noqa: E402
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
    assert hooks.hooked(Engram.prepare_embeddings, vllm_layers.prepare_embeddings), "load_general_plugins did not hook"
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


@pytest.fixture(scope="module")
def local_run(vllm_config, hasher, engram_tables):
    """:func:`run` of vLLM's own layers over the tables (no plugin): the reference every served conversation of
    this module is held to, computed once (every build and run of it is the same bits)."""
    return run(build(vllm_config, engram_tables), hasher)


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
def test_every_layer_remote_is_bit_identical_and_served_remotely(
    vllm_config, hasher, engram_tables, memnode, local_run
):
    local = build(vllm_config, engram_tables)
    assert all(isinstance(e.embed_tokens, ParallelEngramEmbedding) and table_bytes(e) > 0 for e in local)
    want = local_run
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


def test_mixed_placement_layer1_local_layer14_remote(vllm_config, hasher, engram_tables, memnode, model_dir, local_run):
    want = local_run
    before = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}
    mixed = build(vllm_config, engram_tables, address=memnode.address, placement={1: "local", 14: "remote"})
    assert table_bytes(mixed[0]) == 264 * model_dir[1][0] and table_bytes(mixed[1]) == 0
    assert_bit_identical(run(mixed, hasher), want)
    assert server_rows(memnode, "engram.layer1") == before["engram.layer1"]  # layer 1 never asked the server
    assert server_rows(memnode, "engram.layer14") > before["engram.layer14"]


def test_dead_ids_and_int32_ids_give_vllms_zero_rows(vllm_config, hasher, engram_tables, memnode):
    """DEAD_ID (-1) marks padding and dummy runs: vLLM's lookup gives those rows zeros. The plugin never
    sends them (the server would refuse a negative id) and zero-fills them, whatever else is in the step."""
    local = build(vllm_config, engram_tables)
    remote = build(vllm_config, engram_tables, address=memnode.address)
    _, hashes, mask = vllm_cpu.hash_batch(hasher, [([], list(range(3, 20)))])
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
    hashes[20] = DEAD_ID  # a padded token (of the second request)
    hashes[15, :, ::5] = DEAD_ID  # and single columns (of the first, after its image span)
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
    assert hooks.hooked(DeepseekV41ForCausalLM.load_weights, vllm_loading.load_weights)
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

    assert hooks.hooked(DeepseekV41ForCausalLM.load_weights, vllm_loading.load_weights)
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
        loaded = vllm_loading.load_weights(
            vllms_load_weights, model, iter(weights + [("layers.14.engram.wkv.weight", 0)])
        )
    assert seen == ["layers.1.engram.embed.weight", "layers.1.engram.embed.scale", "layers.14.engram.wkv.weight"]
    assert {"layers.14.engram.embed_tokens.weight", "layers.14.engram.embed_tokens.weight_scale_inv"} <= loaded
    assert "engaged: layer 1 local (vLLM's own table), layer 14 remote" in caplog.text
