"""safetensors -> table file (pack), serving safetensors directly, and inspect."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import local_tables, run_cli, start_daemon
from safetensors.torch import save_file
from tableclient import TableClient
from tests_helpers import assert_one_line_error

from tableserver.tables.tablefile import ENGRAM_DTYPE, read_header

N1, N14 = 3_000, 4_321


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Two safetensors shards laid out like DeepSeek-V4.1's Engram layers, plus a dense table."""
    d = tmp_path_factory.mktemp("ckpt")
    g = torch.Generator().manual_seed(0)

    def engram(n):
        w = torch.randint(0, 0x7E, (n, 256), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s = torch.randint(112, 128, (n, 8), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
        return w, s

    w1, s1 = engram(N1)
    w14, s14 = engram(N14)
    dense = torch.randn(500, 64, generator=g).to(torch.bfloat16)
    save_file(
        {
            "model.layers.1.engram.embedding.weight": w1,
            "model.layers.1.engram.embedding.scale": s1,
            "model.layers.1.engram.norm": torch.ones(256),
        },
        str(d / "a.safetensors"),
    )
    save_file(
        {
            "model.layers.14.engram.embedding.weight": w14,
            "model.layers.14.engram.embedding.weight_scale_inv": s14,
            "extra.dense": dense,
        },
        str(d / "b.safetensors"),
    )
    expected = {
        "engram.layer1": np.concatenate([w1.view(torch.uint8).numpy(), s1.view(torch.uint8).numpy()], axis=1),
        "engram.layer14": np.concatenate([w14.view(torch.uint8).numpy(), s14.view(torch.uint8).numpy()], axis=1),
        "extra.dense": dense.view(torch.uint8).numpy().reshape(500, 128),
    }
    return d, expected


def test_pack_interleaves_fp8_rows_and_scales(checkpoint, tmp_path):
    d, expected = checkpoint
    out = str(tmp_path / "engram.bin")
    res = run_cli(
        "pack", out, str(d / "a.safetensors"), str(d / "b.safetensors"), "--version", "3", "--tensor", "extra.dense"
    )
    assert res.returncode == 0, res.stderr
    header = read_header(out)
    specs = {s.name: s for s in header.tables}
    assert set(specs) == set(expected)  # the 1-D norm is skipped
    assert specs["engram.layer1"].layer == 1 and specs["engram.layer14"].layer == 14
    assert specs["engram.layer1"].dtype == ENGRAM_DTYPE and specs["engram.layer1"].row_bytes == 264
    assert specs["extra.dense"].dtype == "bfloat16" and specs["extra.dense"].shape == (500, 64)
    assert all(s.version == 3 for s in specs.values())
    local = local_tables(out)
    for name, rows in expected.items():
        np.testing.assert_array_equal(local[name], rows)
    res = run_cli("inspect", out)
    assert res.returncode == 0 and "engram.layer14" in res.stdout
    assert res.stdout.count("ok ") == 3


def test_serve_safetensors_directly_matches_packed(checkpoint, tmp_path):
    d, expected = checkpoint
    out = str(tmp_path / "engram.bin")
    shards = (str(d / "a.safetensors"), str(d / "b.safetensors"))
    assert run_cli("pack", out, *shards, "--tensor", "extra.dense").returncode == 0
    direct = start_daemon(str(tmp_path / "direct"), "--tables", f"{d / 'a.safetensors'},{d / 'b.safetensors'}")
    packed = start_daemon(str(tmp_path / "packed"), "--tables", out)
    try:
        with TableClient(direct.address, transport="tcp") as a, TableClient(packed.address, transport="shm") as b:
            assert {n: t.checksum for n, t in a.tables.items()} == {n: t.checksum for n, t in b.tables.items()}
            for name, rows in expected.items():
                ids = np.random.default_rng(1).integers(0, len(rows), (10, 24))
                np.testing.assert_array_equal(a.table(name).gather(ids), rows[ids])
                np.testing.assert_array_equal(b.table(name).gather(ids), rows[ids])
    finally:
        direct.stop()
        packed.stop()


# ------------------------------------------------- a checkpoint is more than its Engram tables (issue 34)

ENGRAM_ROWS = 2_000


@pytest.fixture(scope="module")
def model_checkpoint(tmp_path_factory):
    """A model's shards as they come: an Engram pair beside linear weights (bf16 [k, m]) and a norm."""
    d = tmp_path_factory.mktemp("model")
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, 0x7E, (ENGRAM_ROWS, 256), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s = torch.randint(112, 128, (ENGRAM_ROWS, 8), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    linear = {
        "model.layers.1.self_attn.q_proj.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.down_proj.weight": torch.randn(64, 160, generator=g).to(torch.bfloat16),
    }
    save_file(
        {
            "model.layers.1.engram.embedding.weight": w,
            "model.layers.1.engram.embedding.scale": s,
            "model.layers.1.input_layernorm.weight": torch.ones(64).to(torch.bfloat16),
            **linear,
        },
        str(d / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"lm_head.weight": torch.randn(128, 64, generator=g).to(torch.bfloat16)},
        str(d / "model-00002-of-00002.safetensors"),
    )
    save_file(linear, str(d / "dense-only.safetensors"))
    engram = np.concatenate([w.view(torch.uint8).numpy(), s.view(torch.uint8).numpy()], axis=1)
    shards = [str(d / "model-00001-of-00002.safetensors"), str(d / "model-00002-of-00002.safetensors")]
    return d, shards, engram, linear


def test_pack_takes_only_the_engram_tables_by_default(model_checkpoint, tmp_path):
    d, shards, engram, _ = model_checkpoint
    out = str(tmp_path / "engram.bin")
    res = run_cli("pack", out, *shards)
    assert res.returncode == 0, res.stderr
    assert [s.name for s in read_header(out).tables] == ["engram.layer1"]  # no linear weight, no lm_head
    np.testing.assert_array_equal(local_tables(out)["engram.layer1"], engram)
    # the listing: one line per table it packs, with rows x row bytes and size
    lines = [ln for ln in res.stdout.splitlines() if "engram.layer1" in ln]
    assert len(lines) == 1, res.stdout
    assert "2,000 rows x 264 B" in lines[0] and "515.6 KiB" in lines[0], lines[0]
    assert "not packed: 3 other 2-D tensors" in res.stdout and "--tensor" in res.stdout, res.stdout


def test_pack_takes_other_tensors_only_when_named(model_checkpoint, tmp_path):
    d, shards, engram, linear = model_checkpoint
    out = str(tmp_path / "engram.bin")
    q = "model.layers.1.self_attn.q_proj.weight"
    res = run_cli("pack", out, *shards, "--tensor", q, "--tensor", "lm_head.weight")
    assert res.returncode == 0, res.stderr
    specs = {s.name: s for s in read_header(out).tables}
    assert set(specs) == {"engram.layer1", q, "lm_head.weight"}  # down_proj was not named
    assert specs[q].dtype == "bfloat16" and specs[q].shape == (96, 64)
    local = local_tables(out)
    np.testing.assert_array_equal(local["engram.layer1"], engram)
    np.testing.assert_array_equal(local[q], linear[q].view(torch.uint8).numpy().reshape(96, 128))
    listed = [ln for ln in res.stdout.splitlines() if any(n in ln.split() for n in specs)]
    assert len(listed) == 3 and any("96 rows x 128 B" in ln for ln in listed), res.stdout


def test_pack_refuses_shards_without_engram_tables_naming_the_flag(model_checkpoint, tmp_path):
    d, _, _, _ = model_checkpoint
    out = tmp_path / "engram.bin"
    assert_one_line_error(run_cli("pack", str(out), str(d / "dense-only.safetensors")), "no Engram tables", "--tensor")
    assert not out.exists()


def test_pack_refuses_a_named_tensor_that_is_not_a_2d_tensor_of_its_inputs(model_checkpoint, tmp_path):
    d, shards, _, _ = model_checkpoint
    out = tmp_path / "engram.bin"
    for name, says in (("no.such.weight", "no tensor"), ("model.layers.1.input_layernorm.weight", "1-D")):
        assert_one_line_error(run_cli("pack", str(out), *shards, "--tensor", name), f"--tensor {name}", says)
        assert not out.exists()


def test_pack_refuses_a_missing_input_naming_what_to_pass(tmp_path):
    out = tmp_path / "engram.bin"
    missing = str(tmp_path / "model-00001-of-00002.safetensors")
    assert_one_line_error(run_cli("pack", str(out), missing), missing, "pass the checkpoint's .safetensors files")
    assert not out.exists()
