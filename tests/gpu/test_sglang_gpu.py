"""The plugin's GPU side in SGLang 0.5.23: device rows through SGLang's dequant kernel, the scheduler's
staging of extend batches (copies on its side stream), and CUDA-graph capture refused for served layers.

Runs only where CUDA is (the device machine); skipped elsewhere, which the skip line says. Reuses the
CPU tests' models, tables and forward batches (tests/support/sglang_cpu.py), moved to the GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision_cpu  # noqa: F401

pytest.importorskip("sglang.srt.layers.engram")  # the device machine has no SGLang wheel

from sglang_cpu import (  # noqa: E402,F401  (fixtures)
    HC,
    HIDDEN,
    LAYERS,
    build,
    engram_tables,
    extend_batch,
    forward,
    memnode,
    model_config,
    plugin,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (none on this machine): the plugin's GPU paths have not run here",
)


def to_cuda(model):
    hasher, engrams = model
    hasher.to("cuda")
    hasher.init_history(num_req_slots=8, device="cuda")
    return hasher, [e.to("cuda") for e in engrams]


#: the per-token fields of a ForwardBatch the layers read on the GPU
BATCH_TENSORS = ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_seq_lens", "extend_start_loc",
                 "extend_prefix_lens")  # fmt: skip


def batch_to_cuda(batch) -> None:
    for name in BATCH_TENSORS:
        setattr(batch, name, getattr(batch, name).cuda())


def test_device_rows_match_sglang_gpu_lookup(plugin, model_config, engram_tables, memnode):
    local = to_cuda(build(model_config, engram_tables))
    remote = to_cuda(build(model_config, engram_tables, address=memnode.address))
    rng = np.random.default_rng(0)
    for chunks in ([(0, rng.integers(0, 300, 40).tolist())], [(0, rng.integers(0, 300, 7).tolist())] * 3):
        ids, batch = extend_batch(chunks, list(range(len(chunks))))
        ids, batch.input_ids = ids.cuda(), ids.cuda()
        batch_to_cuda(batch)
        x = torch.randn((len(ids), HC, HIDDEN), device="cuda").to(torch.bfloat16)
        _, want = forward(local, ids, batch, x)
        _, got = forward(remote, ids, batch, x)
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    from tableclient.sglang import rows

    assert all(
        rows().summary()[layer]["prefetched"] == 2 and rows().summary()[layer]["fetched"] == 0 for layer in LAYERS
    ), rows().summary()


def test_scheduler_staging_of_served_layers(plugin, model_config, engram_tables, memnode):
    """EngramRowStager built by the plugin (both layers remote): stage() gathers from the tableserver into
    pinned staging, copies on the stager's side stream, and the layers dequantize the staged rows."""
    from sglang.srt.layers.engram_staging import EngramRowStager

    local = to_cuda(build(model_config, engram_tables))
    hasher, engrams = to_cuda(build(model_config, engram_tables, address=memnode.address))
    stager = EngramRowStager.from_model(torch.nn.ModuleList([hasher, *engrams]), hasher, torch.device("cuda"))
    assert stager is not None and all(e.embed.staged_by_scheduler for e in engrams)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, 30).tolist(), rng.integers(0, 300, 11).tolist()]
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    schedule = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        reqs=[SimpleNamespace(full_untruncated_fill_ids=p) for p in prompts],
        prefix_lens=[0, 0],
        extend_lens=[len(p) for p in prompts],
        encoder_swa_reset=None,
    )
    staged = stager.stage(schedule)
    assert staged is not None and len(staged) == len(LAYERS)
    ids, batch = extend_batch([(0, p) for p in prompts], [0, 1])
    batch.engram_staged_rows = staged
    x = torch.randn((len(ids), HC, HIDDEN)).to(torch.bfloat16)
    ids_c, x_c = ids.cuda(), x.cuda()
    batch_to_cuda(batch)
    batch.input_ids = ids_c
    _, got = forward((hasher, engrams), ids_c, batch, x_c)
    batch.engram_staged_rows = None
    _, want = forward(local, ids_c, batch, x_c)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_capturing_a_served_layer_in_a_cuda_graph_is_refused(plugin, model_config, engram_tables, memnode):
    from tableclient.sglang import PluginError

    hasher, engrams = to_cuda(build(model_config, engram_tables, address=memnode.address))
    hash_ids = torch.zeros((4, len(LAYERS), 24), dtype=torch.int64, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(PluginError, match="--cuda-graph-backend-decode disabled"):
            with torch.cuda.graph(graph):
                engrams[1].embed(hash_ids[:, 1])
