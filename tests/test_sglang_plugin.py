"""The SGLang adapter, bit-exact against SGLang's own local lookup, end to end from tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tableclient import TableClient
from tableclient.engram import EngramConfig, EngramHasher, identity_token_map
from tableclient.sglang_plugin import EngramLookup, PluginConfig, dequantize, register

FP8_BLOCK_SIZE = 32


def sglang_local_lookup(weight: torch.Tensor, scale: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """EngramEmbedding._lookup as SGLang writes it for a local fp8 table (one shard, all rows owned)."""
    w = weight.view(torch.uint8)[indices].view(torch.float8_e4m3fn)
    s_raw = scale.view(torch.uint8)[indices].to(torch.float32)
    s = torch.pow(2.0, s_raw - 127.0)
    rows = w.float().unflatten(-1, (-1, FP8_BLOCK_SIZE))
    values = (rows * s.unsqueeze(-1)).flatten(-2)
    return values.to(torch.bfloat16)


@pytest.fixture(scope="module")
def local_weights(demo_local):
    """The demo table split back into SGLang's two checkpoint tensors per layer."""
    out = {}
    for layer in (1, 14):
        rows = torch.from_numpy(np.array(demo_local[f"engram.layer{layer}"]))
        out[layer] = (rows[:, :256].contiguous().view(torch.float8_e4m3fn),
                      rows[:, 256:].contiguous().view(torch.float8_e8m0fnu))
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_adapter_matches_sglang_local_lookup_bit_exact(daemon, local_weights, transport):
    config = PluginConfig(address=daemon.address, transport=transport)
    with TableClient(daemon.address, transport=transport) as client:
        rng = np.random.default_rng(0)
        for layer, (weight, scale) in local_weights.items():
            lookup = EngramLookup(layer, config, client=client)
            indices = torch.from_numpy(rng.integers(0, weight.shape[0], (37, 24)))
            got = lookup(indices)
            want = sglang_local_lookup(weight, scale, indices)
            assert got.dtype == torch.bfloat16 and got.shape == (37, 24, 256)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit-exact, not just close


def test_tokens_to_rows_end_to_end(daemon, local_weights):
    """Hash real token histories with the V4.1 algorithm (small vocab so ids fit the demo tables)."""
    cfg = EngramConfig(vocab_size=1700, compressed_vocab_size=5000)
    hasher = EngramHasher(cfg, identity_token_map(5000))
    assert all(r <= 50_000 for r in hasher.layout.table_rows)
    rng = np.random.default_rng(1)
    histories = [rng.integers(0, 5000, rng.integers(1, 12)).tolist() for _ in range(64)]
    ids = hasher.by_layer(hasher.step(histories))
    with TableClient(daemon.address) as client:
        for layer, (weight, scale) in local_weights.items():
            got = EngramLookup(layer, PluginConfig(address=daemon.address), client=client)(torch.from_numpy(ids[layer]))
            want = sglang_local_lookup(weight, scale, torch.from_numpy(ids[layer]))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_dequantize_known_values():
    rows = torch.zeros((1, 264), dtype=torch.uint8)
    rows[0, 0] = 0x38  # e4m3 1.0
    rows[0, 32] = 0x40  # e4m3 2.0
    rows[0, 256], rows[0, 257] = 127, 129  # scales 2^0 and 2^2
    out = dequantize(rows)
    assert out[0, 0].item() == 1.0 and out[0, 32].item() == 8.0 and out[0, 1].item() == 0.0


def test_config_from_env_and_file(tmp_path):
    cfg = PluginConfig.load({"TABLESERVER_ADDRESS": "mem:7070", "TABLESERVER_MODE": "pack", "TABLESERVER_TIMEOUT": "2"})
    assert (cfg.address, cfg.mode, cfg.timeout, cfg.enabled) == ("mem:7070", "pack", 2.0, True)
    f = tmp_path / "ts.toml"
    f.write_text('address = "other:1"\ntable_prefix = "t"\n')
    cfg = PluginConfig.load({"TABLESERVER_ADDRESS": "mem:7070", "TABLESERVER_SGLANG_CONFIG": str(f)})
    assert cfg.address == "other:1" and cfg.table_prefix == "t"
    f.write_text("bogus = 1\n")
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        PluginConfig.load({"TABLESERVER_SGLANG_CONFIG": str(f)})
    assert not PluginConfig.load({}).enabled


def test_register_without_sglang_is_a_clean_no_op(monkeypatch):
    monkeypatch.delenv("TABLESERVER_ADDRESS", raising=False)
    assert register() is False
    monkeypatch.setenv("TABLESERVER_ADDRESS", "127.0.0.1:1")
    assert register() is False  # SGLang cannot run on these machines: nothing to patch, no error


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = entry_points(group="sglang.srt.plugins")
    assert any(ep.name == "tableserver" and ep.value == "tableclient.sglang_plugin:register" for ep in eps)
