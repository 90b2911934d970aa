"""What every module of the vLLM plugin shares: the vLLM release it is pinned to, the vLLM modules it hooks, the
ids and flag vLLM's graphs are spoken of by, and the process's plugin state.

The plugin sets no attribute of its own on vLLM's objects: which layer an ``Engram`` was built as, and whether it
is served, are in the process's :class:`~tableclient.engine.plugin.PluginState` (:data:`STATE`, weakly held), as are
its configuration and its rows (:func:`config`, :func:`rows`). Nothing here imports the rest of the plugin.
"""

from __future__ import annotations

from tableclient.engine.config import PluginConfig
from tableclient.engine.plugin import PluginState

SUPPORTED_VLLM = "0.33.0"
ENGRAM = "vllm.models.deepseek_v41.common.engram"
WEIGHTS = "vllm.model_executor.model_loader.weight_utils"
MODEL = "vllm.models.deepseek_v41"  # DeepseekV41ForCausalLM, the NVIDIA or the ROCm build of it
WORKER = "vllm.v1.worker.gpu_worker"  # Worker.execute_model: the host, before every step (graphs or not)
OUTPUTS = "vllm.v1.outputs"  # AsyncModelRunnerOutput: a step's results, read by vLLM's get_output()
DEAD_ID = -1  # vLLM's engram.DEAD_ID, checked at start-up: ids of padding and dummy runs, zero rows
PIECEWISE_FLAG = """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'"""

#: the process's plugin state: its configuration and rows, and each Engram built (its layer, whether served)
STATE = PluginState("vllm", dead_id=DEAD_ID)


def config() -> PluginConfig | None:
    return STATE.config


def rows():
    return STATE.rows()


def served(layer: int) -> bool:
    return STATE.served(layer)


def vllm_modules():
    """vLLM's Engram module, its weight utilities and its DeepSeek-V4.1 model module."""
    import importlib

    return importlib.import_module(ENGRAM), importlib.import_module(WEIGHTS), importlib.import_module(MODEL)


def vllm_worker():
    """vLLM's GPU worker module."""
    import importlib

    return importlib.import_module(WORKER)
