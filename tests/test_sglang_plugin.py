"""The plugin inside the released SGLang (0.5.23, pinned): SGLang's own Engram classes on the CPU.

Every module here is SGLang's: ``DeepseekV41Config`` (with its nested ``text_config``), ``EngramLayout``,
``EngramHasher`` (its real tokenizer normalization and per-request history), ``Engram`` and
``EngramEmbedding`` (constructed through SGLang's own HookRegistry, which applies the plugin's hooks),
``ForwardBatch``, SGLang's weight loaders and checkpoint iterator. The hooks come from SGLang's real
``load_plugins()``, which finds the ``tableserver`` entry point of this installed package.

Two models are built over the same tables: one where SGLang loads its own table for every layer, one
with the plugin. The same forward batches (prefill, chunked prefill, decode) go through both, driven as
``DeepseekV4Model`` drives them (hash once per forward, then each Engram layer in turn); layer outputs
must be bit-identical, and the tableserver's own metrics must show that it served the rows.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torchvision_cpu  # noqa: F401  (before sglang: torchvision on a CPU torch)
from conftest import local_tables, start_daemon
from tests_helpers import as_version, resident_share, run_fresh, scrape, value

from tableserver.tables.demo import DemoTable, write_demo_file

torch = pytest.importorskip("torch")
try:
    import sglang.srt.layers.engram  # noqa: F401
except ModuleNotFoundError as e:  # only sglang itself missing skips; an installed SGLang that cannot load fails
    if (e.name or "").split(".")[0] != "sglang":
        raise
    pytest.skip("sglang==0.5.23 is installed by `make test`", allow_module_level=True)

from sglang.srt.configs.deepseek_v41 import DeepseekV41Config  # noqa: E402
from sglang.srt.layers.engram import Engram, EngramHasher, EngramLayout, build_compressed_token_map  # noqa: E402
from sglang.srt.layers.engram_staging import EngramRowStager  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from tableclient.sglang import PluginConfig, configure, hooks, rows  # noqa: E402

LAYERS = (1, 14)
HIDDEN, HC = 64, 2


# ---------------------------------------------------------------------- the model's pieces
def make_tokenizer():
    """A local word-level tokenizer (no hub): 300 words, some differing only in case, so SGLang's
    normalization compresses the vocabulary as it does DeepSeek's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(240)] + [f"W{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def model_config():
    tokenizer = make_tokenizer()
    _, compressed = build_compressed_token_map(tokenizer)
    engram = dict(
        engram_layer_ids=list(LAYERS),
        engram_max_ngram_size=4,
        engram_n_heads=8,
        engram_vocab_size=2000,
        engram_head_dim=256,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed,
    )
    probe = EngramLayout.from_config(DeepseekV41Config(text_config=engram))
    engram["engram_num_embeddings"] = [probe.column_bounds(i)[-1] for i in range(len(LAYERS))]
    cfg = DeepseekV41Config(
        text_config=dict(engram, hidden_size=HIDDEN, hc_mult=HC, rms_norm_eps=1e-6, num_hidden_layers=16)
    )
    return cfg, tokenizer


@pytest.fixture(scope="module")
def engram_tables(model_config, tmp_path_factory):
    cfg, _ = model_config
    path = str(tmp_path_factory.mktemp("sglang") / "engram.bin")
    write_demo_file(
        path,
        [DemoTable(f"engram.layer{layer}", rows, 264, layer) for layer, rows in zip(LAYERS, cfg.engram_num_embeddings)],
        seed=11,
    )
    return path


@pytest.fixture(scope="module")
def memnode(engram_tables, tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("memnode")), "--tables", engram_tables)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def plugin(memnode):
    """SGLang's own plugin loading, with the plugin's entry point enabled by TABLESERVER_ADDRESS."""
    from sglang.srt.layers.engram import EngramEmbedding
    from sglang.srt.plugins import load_plugins

    os.environ["TABLESERVER_ADDRESS"] = memnode.address
    os.environ["SGLANG_PLUGINS"] = "tableserver"  # SGLang's whitelist: ours is the one plugin loaded
    try:
        load_plugins()
    finally:
        del os.environ["TABLESERVER_ADDRESS"]
    assert hooks._state.hooks_in_place, "the plugin's register() did not complete (see SGLang's log)"
    assert hooks._wraps(EngramEmbedding.forward, hooks._embedding_forward), "load_plugins did not apply the hooks"
    yield
    configure(PluginConfig())  # closes the clients; every layer local again


def build(model_config, engram_tables, *, placement=None, address=None, tp=(1, 0), **plugin_options):
    """SGLang's hasher and Engram layers, loaded the way SGLang loads them; plugin placement or none."""
    cfg, tokenizer = model_config
    # A memory node is another host: tcp (auto would pick shm, the daemon being on this host).
    plugin_options.setdefault("transport", "tcp")
    configure(PluginConfig(address=address or "", layers=placement or {}, **plugin_options))
    layout = EngramLayout.from_config(cfg)
    tables = local_tables(engram_tables)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as SGLang's model loader builds modules
    try:
        with get_parallel().override(tp_size=tp[0], tp_rank=tp[1]):
            hasher = EngramHasher(layout, tokenizer, cfg.engram_pad_token_id, cfg.engram_compressed_vocab_size)
            engrams = [Engram(cfg, layer, layout, prefix=f"model.layers.{layer}.engram") for layer in LAYERS]
    finally:
        torch.set_default_dtype(default)
    hasher.init_history(num_req_slots=8, device="cpu")
    gen = torch.Generator().manual_seed(5)
    for e, layer in zip(engrams, LAYERS):
        with torch.no_grad():
            e.wkv.weight.copy_((torch.randn(e.wkv.weight.shape, generator=gen) * 0.02).to(e.wkv.weight.dtype))
            e.q_weight.copy_(1 + 0.1 * torch.randn(e.q_weight.shape, generator=gen))
        params = dict(e.embed.named_parameters())
        if params:  # SGLang's own table: loaded through its weight loader, from the checkpoint's two tensors
            full = torch.from_numpy(np.array(tables[f"engram.layer{layer}"]))
            for name, part in (("weight", full[:, :256]), ("scale", full[:, 256:])):
                p = params[name]
                p.weight_loader(p, part.contiguous().view(p.dtype))
    return hasher, engrams


def table_bytes(engram) -> int:
    return sum(p.numel() * p.element_size() for p in engram.embed.parameters())


# ---------------------------------------------------------------------- forward batches
def extend_batch(chunks, slots):
    """An EXTEND ForwardBatch: ``chunks`` [(prefix_len, tokens)] per request, in req slots ``slots``."""
    ids = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.int64)
    lens = [len(toks) for _, toks in chunks]
    positions = torch.cat([torch.arange(p, p + len(toks)) for p, toks in chunks])
    starts = torch.tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), dtype=torch.int64)
    return ids, ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(chunks),
        input_ids=ids,
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor([p + n for (p, _), n in zip(chunks, lens)]),
        out_cache_loc=torch.arange(1, len(ids) + 1),
        seq_lens_sum=int(sum(lens)),
        positions=positions,
        extend_seq_lens=torch.tensor(lens),
        extend_start_loc=starts,
        extend_seq_lens_cpu=lens,
        extend_prefix_lens=torch.tensor([p for p, _ in chunks]),
    )


def decode_batch(tokens, positions, slots):
    ids = torch.tensor(tokens, dtype=torch.int64)
    return ids, ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(tokens),
        input_ids=ids,
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor(positions) + 1,
        out_cache_loc=torch.arange(1, len(ids) + 1),
        seq_lens_sum=int(sum(positions) + len(ids)),
        positions=torch.tensor(positions),
    )


def forward(model, ids, batch, x):
    """What DeepseekV4Model does per forward: hash once, then each Engram layer on the residual."""
    hasher, engrams = model
    hash_ids = hasher(ids, batch)
    return hash_ids, [e(x, hash_ids[:, e.layer_hash_index], batch, input_ids=ids) for e in engrams]


def conversation(rng):
    """Prefill of two prompts, the second chunked; then decode steps. Yields (ids, batch)."""
    a, b = rng.integers(0, 300, 37).tolist(), rng.integers(0, 300, 50).tolist()
    yield extend_batch([(0, a), (0, b[:20])], [0, 1])  # prefill + first chunk of a chunked prefill
    yield extend_batch([(20, b[20:])], [1])  # the second chunk: look-back from the first, via history
    pos = [len(a), len(b)]
    for _ in range(6):
        toks = rng.integers(0, 300, 2).tolist()
        yield decode_batch(toks, pos, [0, 1])
        pos = [p + 1 for p in pos]


def run(model, seed=0):
    rng = np.random.default_rng(seed)
    outs = []
    for ids, batch in conversation(rng):
        x = torch.from_numpy(rng.standard_normal((len(ids), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
        hash_ids, layer_outs = forward(model, ids, batch, x)
        outs.append((hash_ids, layer_outs))
    return outs


def assert_bit_identical(got, want):
    assert len(got) == len(want)
    for (h1, o1), (h2, o2) in zip(got, want):
        assert torch.equal(h1, h2)
        for a, b in zip(o1, o2):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit, not just close


def server_rows(memnode, table) -> float:
    return value(scrape(memnode.ready["metrics"]), "tableserver_gather_rows_total", table=table)


# ---------------------------------------------------------------------- the tests
def test_every_layer_remote_is_bit_identical_and_served_remotely(plugin, model_config, engram_tables, memnode):
    local = build(model_config, engram_tables)
    want = run(local)
    assert all(table_bytes(e) > 0 for e in local[1])
    before = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}

    remote = build(model_config, engram_tables, address=memnode.address)
    assert [table_bytes(e) for e in remote[1]] == [0, 0]  # SGLang allocated no table rows
    got = run(remote)
    assert_bit_identical(got, want)

    summary = rows().summary()
    steps = len(want)
    for layer in LAYERS:  # every forward's rows were fetched at step start, by the hasher's hook
        assert summary[layer]["prefetched"] == steps and summary[layer]["fetched"] == 0, summary
    served = {t: server_rows(memnode, t) - before[t] for t in before}
    ids = sum(h.shape[0] for h, _ in got) * 24
    assert all(0 < n <= ids for n in served.values()), served  # distinct ids of each gather, from the server


def test_mixed_placement_layer1_local_layer14_remote(plugin, model_config, engram_tables, memnode):
    want = run(build(model_config, engram_tables))
    before = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}
    mixed = build(model_config, engram_tables, address=memnode.address, placement={1: "local", 14: "remote"})
    assert table_bytes(mixed[1][0]) == 264 * model_config[0].engram_num_embeddings[0]
    assert table_bytes(mixed[1][1]) == 0
    assert_bit_identical(run(mixed), want)
    assert server_rows(memnode, "engram.layer1") == before["engram.layer1"]  # layer 1 never asked the server
    assert server_rows(memnode, "engram.layer14") > before["engram.layer14"]


def test_node_placement_reads_this_hosts_server_over_shm(plugin, model_config, engram_tables, memnode):
    want = run(build(model_config, engram_tables))
    node = build(model_config, engram_tables, placement={1: "node", 14: "node"}, node_address=memnode.address)
    assert_bit_identical(run(node), want)
    assert rows().client("node").transport == "shm"


def test_tensor_parallel_ranks_get_whole_rows_without_a_collective(plugin, model_config, engram_tables, memnode):
    """TP=2, rank 1: SGLang would shard the table and all-reduce; a served layer returns whole rows on
    every rank (no process group exists here: a collective would fail)."""
    want = run(build(model_config, engram_tables))
    tp = build(model_config, engram_tables, address=memnode.address, tp=(2, 1))
    assert all(e.embed.tp_size == 2 for e in tp[1])
    assert_bit_identical(run(tp), want)


def test_start_up_check_and_no_staging_without_cuda(plugin, model_config, engram_tables, memnode, caplog):
    """SGLang's EngramRowStager.from_model (called once the model is loaded) runs the plugin's start-up
    check; without CUDA there is no scheduler staging and the forward prefetches instead."""
    hasher, engrams = build(model_config, engram_tables, address=memnode.address, placement={1: "local"})
    model = torch.nn.ModuleList([hasher, *engrams])
    with caplog.at_level("INFO", logger="tableclient.sglang"):
        assert EngramRowStager.from_model(model, hasher, torch.device("cpu")) is None
    assert "engaged: layer 1 local (SGLang's own table), layer 14 remote" in caplog.text

    hasher, engrams = build(model_config, engram_tables, address=memnode.address, placement={1: "local", 7: "remote"})
    with pytest.raises(hooks.PluginError, match="names layer 7, which is not an Engram layer"):
        EngramRowStager.from_model(torch.nn.ModuleList([hasher, *engrams]), hasher, torch.device("cpu"))


def test_wrong_or_missing_table_fails_at_construction(plugin, model_config, engram_tables, memnode):
    from tableclient.sglang import EngramRowsError

    with pytest.raises(EngramRowsError, match="serves no table 'nope.14'"):
        build(model_config, engram_tables, address=memnode.address, tables={14: "nope.14"})
    with pytest.raises(EngramRowsError, match="has .* rows of 264 B but layer 1 of this model needs"):
        build(model_config, engram_tables, address=memnode.address, tables={1: "engram.layer14"})


@pytest.mark.parametrize("policy", ["fail", "zeros", "fallback"])
def test_failure_policy_when_the_memory_node_dies(plugin, model_config, engram_tables, tmp_path, policy):
    from prometheus_client import REGISTRY
    from tableclient import TableClientError

    primary = start_daemon(str(tmp_path / "primary"), "--tables", engram_tables)
    backup = start_daemon(str(tmp_path / "backup"), "--tables", engram_tables) if policy == "fallback" else None
    try:
        local = build(model_config, engram_tables)
        extra = {"fallback_address": backup.address} if backup else {}
        remote = build(
            model_config,
            engram_tables,
            address=primary.address,
            placement={1: "local"},
            policy=policy,
            timeout=30.0,
            **extra,
        )
        rng = np.random.default_rng(3)
        batches = list(conversation(rng))
        x = torch.ones((len(batches[0][0]), HC, HIDDEN), dtype=torch.bfloat16)
        forward(local, *batches[0], x), forward(remote, *batches[0], x)  # served normally
        primary.stop(signal.SIGKILL)  # the memory node dies between steps
        ids, batch = batches[1]
        x = torch.ones((len(ids), HC, HIDDEN), dtype=torch.bfloat16)
        zeros_before = REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total", {"layer": "14"}) or 0
        if policy == "fail":
            with pytest.raises(TableClientError):
                forward(remote, ids, batch, x)
            return
        hash_ids, got = forward(remote, ids, batch, x)
        _, want = forward(local, ids, batch, x)
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))  # layer 1 is local
        if policy == "zeros":  # layer 14's forward ran on zero rows: SGLang's gate on a zero key and value
            from sglang.srt.layers.engram import engram_gate

            e14 = remote[1][1]
            kv = torch.zeros((len(ids), (HC + 1) * HIDDEN), dtype=torch.bfloat16)
            zero_out = engram_gate(x, kv, e14.q_weight, e14.k_weight, e14.eps, e14.clamp_value)
            assert torch.equal(got[1].view(torch.int16), zero_out.view(torch.int16))
            assert not torch.equal(got[1], want[1])
            assert (
                REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total", {"layer": "14"})
                == zeros_before + 1
            )
        else:
            assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
            assert rows().summary()[14]["fallbacks"] >= 1
    finally:
        configure(PluginConfig())
        primary.stop()
        if backup:
            backup.stop()


def test_prefetched_rows_are_used_only_for_the_ids_they_were_fetched_for(plugin, model_config, engram_tables, memnode):
    """A layer gets the prefetched rows for the very ids the hasher produced (or equal ones, as after a copy
    into a CUDA graph's static buffer), and rows fetched now for any other ids, even of the same shape."""
    hasher, engrams = build(model_config, engram_tables, address=memnode.address)
    tables = local_tables(engram_tables)["engram.layer14"]
    rng = np.random.default_rng(6)
    ids, batch = extend_batch([(0, rng.integers(0, 300, 12).tolist())], [0])
    embed = engrams[1].embed
    for other in ("copy", "different"):
        hash_ids = hasher(ids, batch)  # step start: prefetch
        before = dict(rows().summary()[14])
        column = hash_ids[:, 1].clone() if other == "copy" else (hash_ids[:, 1] + 1) % tables.shape[0]
        got = embed(column)
        from tableclient.sglang import dequantize

        want = dequantize(torch.from_numpy(tables[column.numpy()]), 256)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        after = rows().summary()[14]
        moved = {k: after[k] - before[k] for k in ("prefetched", "fetched")}
        assert moved == ({"prefetched": 1, "fetched": 0} if other == "copy" else {"prefetched": 0, "fetched": 1})


def test_scheduler_staging_channel_is_apart_from_the_forward(plugin, model_config, engram_tables, memnode):
    """The host side of the plugin's EngramRowStager.stage(): rows issued for the next batch (channel
    "stage") are not disturbed by the forward's prefetch of the running one, and are the table's rows."""
    hasher, engrams = build(model_config, engram_tables, address=memnode.address)
    tables = local_tables(engram_tables)
    rng = np.random.default_rng(4)
    ids_a, batch_a = extend_batch([(0, rng.integers(0, 300, 25).tolist())], [0])
    ids_b, batch_b = extend_batch([(0, rng.integers(0, 300, 9).tolist())], [1])
    staged_ids = hasher(ids_a, batch_a)
    assert rows().prefetch(staged_ids, channel="stage")  # the scheduler, ahead of the forward
    running = hasher(ids_b, batch_b)  # the running forward's step start: its own prefetch
    out = engrams[1](
        torch.zeros((len(ids_b), HC, HIDDEN), dtype=torch.bfloat16), running[:, 1], batch_b, input_ids=ids_b
    )
    assert out.shape == (len(ids_b), HC, HIDDEN)
    for column, layer in enumerate(LAYERS):
        got = rows().staged(layer).numpy()
        np.testing.assert_array_equal(got, tables[f"engram.layer{layer}"][staged_ids[:, column].numpy()])
    assert rows().summary()[14]["staged"] == 1


# ---------------------------------------------------------------------- checkpoint loading
@pytest.mark.parametrize(
    "iterator",
    [
        "buffered_multi_thread_safetensors_weights_iterator",  # SGLang's default
        "safetensors_weights_iterator",
    ],
)
def test_checkpoint_tensors_of_served_tables_are_never_read(plugin, memnode, tmp_path, iterator):
    """SGLang's own safetensors iterators, hooked: layer 14's table (served) is neither yielded nor read
    from disk; layer 1's (local) and every other tensor are, unchanged."""
    import json
    import struct

    from safetensors.torch import save_file
    from sglang.srt.model_loader import weight_utils
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    rows = 600_000  # 154 MB of table per layer: far more than the readahead around what is read (8+ MB)
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{layer}.engram.embed.{name}": torch.randint(0, 120, (rows, n), generator=g, dtype=torch.uint8)
        for layer in LAYERS
        for name, n in (("weight", 256), ("scale", 8))
    }
    tensors["layers.14.engram.wkv.weight"] = torch.randn(64, 32, generator=g)
    tensors["embed.weight"] = torch.randn(300, 64, generator=g)
    path = str(tmp_path / "model-00001-of-00001.safetensors")
    save_file(tensors, path)
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    spans = {
        k: (8 + header_len + v["data_offsets"][0], 8 + header_len + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }
    if max(resident_share(path, *span) for span in spans.values()) > 0.5:
        pytest.skip("this filesystem keeps the file in the page cache (tmpfs?): cannot tell what was read")

    configure(PluginConfig(address=memnode.address, transport="tcp", layers={1: "local"}))
    try:
        extra = {"max_workers": 2} if "multi_thread" in iterator else {}
        got = dict(getattr(weight_utils, iterator)([path], **extra))
    finally:
        configure(PluginConfig())
    served = {k for k in tensors if k.startswith("layers.14.engram.embed.")}
    assert set(got) == set(tensors) - served
    for k in got:
        assert torch.equal(got[k], tensors[k])
    assert resident_share(path, *spans["layers.1.engram.embed.weight"]) > 0.5  # read
    # never read: at most the kernel's readahead next to what was read (the 4.8 MB scales may be all of it)
    assert resident_share(path, *spans["layers.14.engram.embed.weight"]) < 0.25
    # whatever iterator a load format uses, load_weights itself drops served tables' tensors too
    assert hooks._wraps(DeepseekV4ForCausalLM.load_weights, hooks._load_weights)
    configure(PluginConfig(address=memnode.address, layers={1: "local"}))
    try:
        assert [
            hooks._served_key(k)
            for k in (
                "layers.14.engram.embed.weight",
                "model.layers.14.engram.embed.scale",
                "layers.1.engram.embed.weight",
                "layers.14.engram.wkv.weight",
            )
        ] == [True, True, False, False]
    finally:
        configure(PluginConfig())


# ---------------------------------------------------------------------- refusing to start
LOAD_PLUGINS = "from sglang.srt.plugins import load_plugins; load_plugins()\n"


def _launch(env_extra: dict, code: str = LOAD_PLUGINS):
    """SGLang's plugin loading in a fresh process, as a scheduler process starts."""
    return run_fresh(code, {"SGLANG_PLUGINS": "tableserver", **env_extra}, prelude="torchvision_cpu")


def test_enabled_but_misconfigured_stops_start_up_with_one_line(tmp_path):
    bad = tmp_path / "placement.toml"
    bad.write_text('address = "mem:7070"\n[layers]\n14 = "elsewhere"\n')
    res = _launch({"TABLESERVER_SGLANG_CONFIG": str(bad)})
    assert res.returncode != 0
    assert (
        res.stderr.strip().splitlines()[-1]
        == "tableserver plugin: layers.14 = 'elsewhere': use one of remote, node, local"
    )
    res = _launch({"TABLESERVER_ADDRESS": "mem:7070", "TABLESERVER_POLICY": "fallback"})
    assert res.returncode != 0 and "needs fallback_address" in res.stderr.strip().splitlines()[-1]


def test_other_sglang_versions_are_refused(tmp_path):
    """Until a version is tested, the plugin refuses it at start-up (SGLang itself only logs plugin errors)."""
    res = _launch({"TABLESERVER_ADDRESS": "mem:7070"}, as_version("sglang", "0.5.24", LOAD_PLUGINS))
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "tableserver plugin: SGLang 0.5.24 is not supported (tested with 0.5.23, whose Engram internals it hooks): "
        "install sglang==0.5.23, or unset TABLESERVER_ADDRESS to run SGLang without the plugin"
    )


def test_not_configured_leaves_sglang_alone():
    code = LOAD_PLUGINS + (
        "from sglang.srt.layers.engram import EngramEmbedding\nprint(hasattr(EngramEmbedding.forward, '__wrapped__'))\n"
    )
    res = _launch({}, code)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-2000:]
