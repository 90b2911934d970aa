"""safetensors -> table file (pack), serving safetensors directly, and inspect."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import local_tables, run_cli, start_daemon
from safetensors.torch import save_file
from tableclient import TableClient

from tableserver.tablefile import ENGRAM_DTYPE, read_header

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
    res = run_cli("pack", out, str(d / "a.safetensors"), str(d / "b.safetensors"), "--version", "3")
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
    assert run_cli("pack", out, str(d / "a.safetensors"), str(d / "b.safetensors")).returncode == 0
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
