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
from tests_helpers import as_version, fork_cases, resident_share, run_fresh

torch = pytest.importorskip("torch")
try:
    import sglang.srt.layers.engram  # noqa: F401
except ModuleNotFoundError as e:  # only sglang itself missing skips; an installed SGLang that cannot load fails
    if (e.name or "").split(".")[0] != "sglang":
        raise
    pytest.skip("sglang==0.5.23 is installed by `make test`", allow_module_level=True)

from sglang.srt.layers.engram_staging import EngramRowStager  # noqa: E402
from sglang_cpu import (  # noqa: E402,F401  (fixtures)
    HC,
    HIDDEN,
    LAYERS,
    assert_bit_identical,
    build,
    conversation,
    decode_batch,
    engram_tables,
    extend_batch,
    forward,
    local_outputs,
    make_tokenizer,
    memnode,
    model_config,
    plugin,
    run,
    server_rows,
    table_bytes,
)
from tableclient.sglang import PluginConfig, configure, hooks, rows  # noqa: E402


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


def test_mixed_placement_layer1_local_layer14_remote(plugin, model_config, engram_tables, memnode, local_outputs):
    want = local_outputs
    before = {t: server_rows(memnode, t) for t in ("engram.layer1", "engram.layer14")}
    mixed = build(model_config, engram_tables, address=memnode.address, placement={1: "local", 14: "remote"})
    assert table_bytes(mixed[1][0]) == 264 * model_config[0].engram_num_embeddings[0]
    assert table_bytes(mixed[1][1]) == 0
    assert_bit_identical(run(mixed), want)
    assert server_rows(memnode, "engram.layer1") == before["engram.layer1"]  # layer 1 never asked the server
    assert server_rows(memnode, "engram.layer14") > before["engram.layer14"]


def test_node_placement_reads_this_hosts_server_over_shm(plugin, model_config, engram_tables, memnode, local_outputs):
    want = local_outputs
    node = build(model_config, engram_tables, placement={1: "node", 14: "node"}, node_address=memnode.address)
    assert_bit_identical(run(node), want)
    assert rows().client("node").transport == "shm"


def test_tensor_parallel_ranks_get_whole_rows_without_a_collective(
    plugin, model_config, engram_tables, memnode, local_outputs
):
    """TP=2, rank 1: SGLang would shard the table and all-reduce; a served layer returns whole rows on
    every rank (no process group exists here: a collective would fail)."""
    want = local_outputs
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
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, tensors, {name: its bytes' span in the file}) of a checkpoint file, written once for the iterators."""
    import json
    import struct

    from safetensors.torch import save_file

    rows = 600_000  # 154 MB of table per layer: far more than the readahead around what is read (8+ MB)
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{layer}.engram.embed.{name}": torch.randint(0, 120, (rows, n), generator=g, dtype=torch.uint8)
        for layer in LAYERS
        for name, n in (("weight", 256), ("scale", 8))
    }
    tensors["layers.14.engram.wkv.weight"] = torch.randn(64, 32, generator=g)
    tensors["embed.weight"] = torch.randn(300, 64, generator=g)
    path = str(tmp_path_factory.mktemp("checkpoint") / "model-00001-of-00001.safetensors")
    save_file(tensors, path)
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        os.fsync(f.fileno())
    spans = {
        k: (8 + header_len + v["data_offsets"][0], 8 + header_len + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }
    return path, tensors, spans


@pytest.mark.parametrize(
    "iterator",
    [
        "buffered_multi_thread_safetensors_weights_iterator",  # SGLang's default
        "safetensors_weights_iterator",
    ],
)
def test_checkpoint_tensors_of_served_tables_are_never_read(plugin, memnode, checkpoint, iterator):
    """SGLang's own safetensors iterators, hooked: layer 14's table (served) is neither yielded nor read
    from disk; layer 1's (local) and every other tensor are, unchanged."""
    from sglang.srt.model_loader import weight_utils

    path, tensors, spans = checkpoint
    with open(path, "rb") as f:  # none of it in the page cache (the other iterator's reads neither)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
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
    assert hooks.applied("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.load_weights")
    configure(PluginConfig(address=memnode.address, layers={1: "local"}))
    try:
        assert [
            hooks.served_key(k)
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
#: SGLang's plugin loading in fresh processes, as a scheduler process starts, one a case: an interpreter imports
#: SGLang's plugin framework once (what every case imports first), then forks each case's process before any plugin
#: is loaded; the case sets its environment and runs its code, exiting as the interpreter would. Prints
#: {case: [exit status, stdout, stderr]}.
FORK_CASES = fork_cases(
    "from sglang.srt.plugins import load_plugins  # noqa: F401  (SGLang imported, no plugin loaded)"
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each case's process (a CompletedProcess: its exit status, stdout and stderr): SGLang's plugin loading with
    no TABLESERVER_* variables but the case's own."""
    import json
    import subprocess

    bad = tmp_path_factory.mktemp("plugin") / "placement.toml"
    bad.write_text('address = "mem:7070"\n[layers]\n14 = "elsewhere"\n')
    cases = {
        "bad_layer": ({"TABLESERVER_SGLANG_CONFIG": str(bad)}, LOAD_PLUGINS),
        "no_fallback_address": ({"TABLESERVER_ADDRESS": "mem:7070", "TABLESERVER_POLICY": "fallback"}, LOAD_PLUGINS),
        "other_version": ({"TABLESERVER_ADDRESS": "mem:7070"}, as_version("sglang", "0.5.24", LOAD_PLUGINS)),
        "not_configured": ({}, LOAD_PLUGINS + (
            "from sglang.srt.layers.engram import EngramEmbedding\n"
            "print(hasattr(EngramEmbedding.forward, '__wrapped__'))\n"
        )),
    }  # fmt: skip
    res = run_fresh(FORK_CASES, {"SGLANG_PLUGINS": "tableserver", "PLUGIN_CASES": json.dumps(cases)}, "torchvision_cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    return {name: subprocess.CompletedProcess(name, *said) for name, said in json.loads(res.stdout).items()}


def test_enabled_but_misconfigured_stops_start_up_with_one_line(launched):
    res = launched["bad_layer"]
    assert res.returncode != 0
    assert (
        res.stderr.strip().splitlines()[-1]
        == "tableserver plugin: layers.14 = 'elsewhere': use one of remote, node, local"
    )
    res = launched["no_fallback_address"]
    assert res.returncode != 0 and "needs fallback_address" in res.stderr.strip().splitlines()[-1]


def test_other_sglang_versions_are_refused(launched):
    """Until a version is tested, the plugin refuses it at start-up (SGLang itself only logs plugin errors)."""
    res = launched["other_version"]
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "tableserver plugin: SGLang 0.5.24 is not supported (tested with 0.5.23, whose Engram internals it hooks): "
        "install sglang==0.5.23, or unset TABLESERVER_ADDRESS to run SGLang without the plugin"
    )


def test_not_configured_leaves_sglang_alone(launched):
    res = launched["not_configured"]
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-2000:]
