"""SGLang plugin: DeepSeek-V4.1's Engram layers served by tableservers instead of tables in every worker.

Installed as the ``sglang.srt.plugins`` entry point ``tableserver`` (setup.cfg);
SGLang (0.5.23, the version it is tested with) calls :func:`register` in every
scheduler process and in the launcher. With ``TABLESERVER_ADDRESS`` or
``TABLESERVER_SGLANG_CONFIG`` set it hooks SGLang's Engram classes
(``hooks``) so that each layer's rows come from where its configuration places it
(``remote``, ``node`` or ``local``), fetched at step start: both are the engine-neutral
``tableclient.engine`` (``config``, ``rows``); this package holds only what is SGLang's.

Without configuration it does nothing. Enabled but unable to engage (another
SGLang version, a bad configuration, hooks that did not apply) it stops the
start-up with one line saying why: SGLang logs and ignores exceptions from
plugins, so that line is raised as SystemExit (``tableclient.engine.plugin.start``).
"""

from __future__ import annotations

import logging

from tableclient.engine import ConfigError, EngramRows, EngramRowsError, PluginConfig, dequantize
from tableclient.engine.plugin import PluginError, start
from tableclient.sglang.hooks import configure, rows

log = logging.getLogger(__name__)

__all__ = [
    "register",
    "configure",
    "rows",
    "PluginConfig",
    "ConfigError",
    "PluginError",
    "EngramRows",
    "EngramRowsError",
    "dequantize",
]


def register() -> bool:
    """The ``sglang.srt.plugins`` entry point. Returns whether the hooks are in place."""
    from tableclient.sglang import hooks

    def engage(config: PluginConfig) -> str:
        version = hooks.check_sglang()
        configure(config)
        hooks.register_hooks()
        return version

    return start("SGLang", "TABLESERVER_SGLANG_CONFIG", engage, log)
