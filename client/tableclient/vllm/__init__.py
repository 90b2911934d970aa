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
