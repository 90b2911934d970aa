"""The SGLang plugin's start-up memory report, on SGLang 0.5.23's own classes on the CPU.

SGLang's ``EngramEmbedding`` is built through its HookRegistry (the plugin loaded by SGLang's own
``load_plugins``), with SGLang's own knobs for where its tables would live (``envs``,
``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE`` and its layout); ``EngramRowStager.from_model`` runs the start-up
check as SGLang calls it once the model is loaded; SGLang's runtime context is published with
``override_server_args``, SGLang's own scoped publisher; its DeepSeek V4 host-pool sizing
(``_deepseek_v4_num_host_pages``, hooked) runs under that context against SGLang's own host budget.
"""

from __future__ import annotations

import types

import torchvision_cpu  # noqa: F401  (before sglang: torchvision on a CPU torch)
from engine_skip import require_engine

require_engine("sglang.srt.layers.engram")
import torch  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.layers.engram import EngramLayout, shard_range  # noqa: E402
from sglang.srt.layers.engram_staging import EngramRowStager  # noqa: E402
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: E402
from sglang.srt.mem_cache.pool_host import base as pool_host  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang_cpu import build, engram_tables, memnode, model_config, plugin  # noqa: E402,F401  (fixtures)
from tableclient.engine import memory as engine_memory  # noqa: E402

GIB = 1 << 30
SERVED = {1: "remote", 14: "remote"}


def freed(memory: str, layer: int) -> float | None:
    return REGISTRY.get_sample_value(f"tableserver_client_freed_table_{memory}_bytes", {"layer": str(layer)})


def shard(model_config, index: int, rank: int, tp: int = 2) -> int:
    """Rows SGLang's own row sharding gives TP rank ``rank`` of the table at hash column ``index``."""
    cfg = model_config[0]
    start, end = shard_range(
        cfg.engram_num_embeddings[index], EngramLayout.from_config(cfg).column_bounds(index), rank, tp
    )
    return end - start


def start_up(model, caplog):
    """SGLang's call once its model is loaded: the plugin's start-up check and report."""
    hasher, engrams = model
    with caplog.at_level("INFO", logger="tableclient.sglang"):
        EngramRowStager.from_model(torch.nn.ModuleList([hasher, *engrams]), hasher, torch.device("cpu"))
    return caplog.text


def test_the_tables_sglang_did_not_allocate_are_logged_and_exported(
    plugin, model_config, engram_tables, memnode, caplog
):
    rows = model_config[0].engram_num_embeddings
    # SGLang's default: its tables on the GPUs, the rows split over the TP ranks (SGLang's shard_range)
    model = build(model_config, engram_tables, address=memnode.address, placement={1: "local"}, tp=(2, 1))
    assert freed("device", 14) == 264 * shard(model_config, 1, rank=1) and not freed("host", 14)
    text = start_up(model, caplog)
    assert "SGLang did not allocate these Engram tables in this process: layer 14 (remote) " in text
    assert "of device memory" in text and "runs without host KV cache" not in text
    # with SGLang's host table (layout shared: one memfd per TP group), this rank's share of host memory
    with envs.SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE.override(True):
        where = {"address": memnode.address, "node_address": memnode.address}
        build(model_config, engram_tables, placement={1: "remote", 14: "node"}, tp=(2, 1), **where)
        assert freed("host", 1) == 264 * rows[0] // 2 and freed("host", 14) == 264 * rows[1] // 2
        assert freed("device", 14) == 0  # the previous configuration's figure is withdrawn
        with envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.override("per_rank"):
            build(model_config, engram_tables, address=memnode.address, placement=SERVED, tp=(2, 0))
            assert freed("host", 1) == 264 * shard(model_config, 0, rank=0)  # rank 0's row shard


def test_freed_host_memory_without_host_kv_cache_names_the_flag(
    plugin, model_config, engram_tables, memnode, caplog, monkeypatch
):
    monkeypatch.setattr(engine_memory, "ADVICE_MIN_BYTES", 1)  # the test's tables are small: any amount counts
    with envs.SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE.override(True):
        model = build(model_config, engram_tables, address=memnode.address, placement=SERVED)
    with get_context().override_server_args():  # SGLang's defaults: no hierarchical cache
        text = start_up(model, caplog)
    assert "runs without host KV cache: add --enable-hierarchical-cache --hicache-ratio R (`tableserver plan " in text
    assert "--engine sglang --tp 1 --dp 1 --placement 1=remote,14=remote --kv-pool-gib <as logged>`" in text
    caplog.clear()
    with get_context().override_server_args(enable_hierarchical_cache=True, hicache_ratio=2.0):
        text = start_up(model, caplog)
    assert "did not allocate" in text and "runs without host KV cache" not in text


def test_a_host_kv_cache_larger_than_the_host_is_called_out_before_sglang_allocates_it(
    plugin, model_config, engram_tables, memnode, caplog, monkeypatch
):
    """SGLang sizes its DeepSeek V4 host pools (host pages = device pages x ratio) and then allocates them,
    each checked against its budget; the plugin, hooked on the sizing, says first when they will not fit once
    its own staging is there, and names the fix."""
    build(model_config, engram_tables, address=memnode.address, placement=SERVED)
    pool = object.__new__(DeepSeekV4TokenToKVPool)  # as SGLang's own stubs; its PD accounting of 10 GiB
    pool.size, pool.swa_size = 1 << 20, 1 << 17
    pool.get_contiguous_buf_infos = lambda: ([0, 0], [6 * GIB, 2 * GIB], [1, 1])
    pool.get_state_buf_infos = lambda: ([0], [2 * GIB], [1])
    params = types.SimpleNamespace(token_to_kv_pool_allocator=types.SimpleNamespace(size_full=pool.size))
    # a host SGLang grants 30 GiB a rank: 40 GiB available less its 10 GiB reserve, one rank
    monkeypatch.setattr(pool_host, "available_host_memory_bytes", lambda **_: 40 * GIB)
    monkeypatch.setattr(pool_host, "ranks_per_host", lambda: 1)
    for ratio, fits in ((2.5, True), (3.5, False)):
        caplog.clear()
        with get_context().override_server_args(enable_hierarchical_cache=True, hicache_ratio=ratio):
            with caplog.at_level("INFO", logger="tableclient.sglang"):
                pages = hybrid_pool_assembler._deepseek_v4_num_host_pages(
                    params=params, kvcache=pool, page_size=256, swa_page_size=128
                )
        assert pages[0] == int(4096 * ratio)  # SGLang's own sizing, untouched by the hook
        warned = [r.getMessage() for r in caplog.records if "host KV cache asks" in r.getMessage()]
        assert not warned if fits else warned, caplog.text
    assert warned[0].startswith("tableserver plugin: SGLang's host KV cache asks 35.0 GiB in this process but 29.")
    assert "lower --hicache-ratio below 3.5" in warned[0]
