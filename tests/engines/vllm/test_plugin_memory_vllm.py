"""The vLLM plugin's start-up memory report, on vLLM 0.33.0's own classes on the CPU.

vLLM's ``Engram`` layers are built under vLLM's own ``VllmConfig`` (its ``EngramConfig`` saying where vLLM
would keep the tables, its ``CacheConfig`` the host KV cache), the plugin loaded by vLLM's own
``load_general_plugins``; the start-up check runs where vLLM's ``load_weights`` runs it, inside vLLM's current
configuration. Fixtures: the vLLM plugin tests' (tests/engines/vllm/test_vllm_plugin.py).
"""

from __future__ import annotations

import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)
from engine_skip import require_engine

require_engine("vllm.models.deepseek_v41.common.engram")
import torch  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from tableclient.engine import memory as engine_memory  # noqa: E402
from tableclient.hostmem import vllm_private_bytes  # noqa: E402
from tableclient.vllm import hooks  # noqa: E402
from test_vllm_plugin import build, engram_tables, memnode, model_dir, plugin, vllm_config  # noqa: E402,F401
from vllm.config import set_current_vllm_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def freed(memory: str, layer: int) -> float | None:
    return REGISTRY.get_sample_value(f"tableserver_client_freed_table_{memory}_bytes", {"layer": str(layer)})


def start_up(cfg, engrams, caplog) -> list[str]:
    """vLLM's load_weights end, inside its current configuration: the plugin's start-up check and report."""
    caplog.clear()
    with set_current_vllm_config(cfg), caplog.at_level("INFO", logger="tableclient.vllm"):
        hooks.verify(torch.nn.ModuleList(engrams))
    return [r.getMessage() for r in caplog.records]


def test_the_tables_vllm_did_not_allocate_and_the_host_kv_cache(
    vllm_config, engram_tables, memnode, caplog, monkeypatch
):
    rows = vllm_config.model_config.hf_text_config.engram_num_embeddings
    build(vllm_config, engram_tables, address=memnode.address, placement={1: "local"})  # cpu_offload=False here
    assert freed("device", 14) == 264 * rows[1] and not freed("host", 14)

    # vLLM's default, cpu_offload (TP 1, DP 1: no dp_shared_memory): each rank would pin its own shard
    monkeypatch.setattr(vllm_config.engram_config, "cpu_offload", True)
    engrams = build(vllm_config, engram_tables, address=memnode.address)
    assert freed("host", 1) == vllm_private_bytes(rows[0]) > 264 * rows[0]  # torch pins powers of two
    assert freed("device", 14) == 0  # the previous configuration's figure is withdrawn
    lines = start_up(vllm_config, engrams, caplog)
    assert any("vLLM did not allocate these Engram tables in this process: layer 1 (remote)" in m for m in lines)
    assert not any("host KV cache" in m for m in lines)  # a few MiB of test table: below the advice threshold

    monkeypatch.setattr(engine_memory, "ADVICE_MIN_BYTES", 1)
    lines = start_up(vllm_config, engrams, caplog)
    assert any(
        "runs without host KV cache: add --kv-offloading-size G --kv-offloading-backend native (`tableserver plan "
        "--engine vllm --tp 1 --dp 1 --placement 1=remote,14=remote --kv-pool-gib <as logged>`" in m
        for m in lines
    ), lines

    # vLLM pins what --kv-offloading-size says, checking no host memory: the plugin says so first
    monkeypatch.setattr(vllm_config.cache_config, "kv_offloading_size", 1 << 20)  # 1 PiB
    lines = start_up(vllm_config, engrams, caplog)
    asks = [m for m in lines if "host KV cache asks" in m]
    assert asks and asks[0].startswith("tableserver plugin: vLLM's host KV cache asks 1048576.0 GiB in this process")
    assert "lower --kv-offloading-size below 1.04858e+06" in asks[0]
    assert not any("runs without host KV cache" in m for m in lines)
    monkeypatch.setattr(vllm_config.cache_config, "kv_offloading_size", 0.001)
    assert not any("host KV cache asks" in m for m in start_up(vllm_config, engrams, caplog))
