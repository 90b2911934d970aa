"""vLLM plugin: DeepSeek-V4.1's Engram layers served by tableservers instead of tables in every worker.

Installed as the ``vllm.general_plugins`` entry point ``tableserver`` (setup.cfg); vLLM (0.33.0, the
version it is tested with) calls :func:`register` in every process: the front end, the engine core and
each worker before its model is built (``VLLM_PLUGINS`` is vLLM's allow-list). With
``TABLESERVER_ADDRESS`` or ``TABLESERVER_VLLM_CONFIG`` set it hooks vLLM's Engram classes (``hooks``),
so that each layer's rows come from where its configuration places it (``remote``, ``node`` or
``local``), the same configuration, rows and failure policy as the SGLang plugin
(``tableclient.engine``); this package holds only what is vLLM's.

Without configuration it does nothing. Enabled but unable to engage (another vLLM version, a bad
configuration) it stops the start-up with one line saying why (``SystemExit``).

Modules: ``hooks`` (what :func:`register` calls: the pin, the configuration, the wrappers put on vLLM), ``layers``
(a served layer built, and its step start and run handed to its graph mode's path), ``graphs`` (graph modes
``device`` and ``in_graph``: the GraphStep, each step armed and checked by vLLM's Worker), ``eager`` (graph mode
``eager_break``), ``loading`` (checkpoint loading, the start-up check), ``memory`` (the table memory freed, the host
KV cache checked), ``ranks`` (vLLM's process groups), ``state`` (the pin, vLLM's module names, the process's plugin
state), ``embedding`` (the embedding a served layer gets in place of vLLM's).
"""

from __future__ import annotations

import logging

from tableclient.engine import ConfigError, EngramRowsError, PluginConfig, PluginError
from tableclient.engine.plugin import start

log = logging.getLogger(__name__)

__all__ = ["register", "PluginConfig", "ConfigError", "PluginError", "EngramRowsError"]


def register() -> bool:
    """The ``vllm.general_plugins`` entry point. Returns whether the hooks are in place."""
    from tableclient.vllm import hooks

    def engage(config: PluginConfig) -> str:
        version = hooks.check_vllm()
        hooks.check_config(config)
        hooks.configure(config)
        hooks.patch()
        return version

    return start("vLLM", "TABLESERVER_VLLM_CONFIG", engage, log)
