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
plugins, so that line is raised as SystemExit.
"""

from __future__ import annotations

import logging

from tableclient.engine import ConfigError, EngramRows, EngramRowsError, PluginConfig, dequantize
from tableclient.sglang.hooks import PluginError, configure, rows

log = logging.getLogger("tableclient.sglang")

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
    import os

    from tableclient.sglang import hooks

    try:
        config = PluginConfig.load()
        if not config.enabled:
            log.info(
                "tableserver plugin installed but not configured (set TABLESERVER_ADDRESS or "
                "TABLESERVER_SGLANG_CONFIG): SGLang keeps its own Engram tables"
            )
            return False
        version = hooks.check_sglang()
        configure(config)
        hooks.register_hooks()
    except Exception as e:  # SGLang would log and go on without us: with TABLESERVER_* set, stop instead
        if not isinstance(e, (ConfigError, PluginError)) and not any(k.startswith("TABLESERVER_") for k in os.environ):
            raise
        text = str(e).removeprefix("tableserver plugin: ")
        raise SystemExit(
            f"tableserver plugin: {text if isinstance(e, (ConfigError, PluginError)) else repr(e)}"
        ) from None
    log.info(
        "tableserver plugin: hooks in place in SGLang %s (%s)",
        version,
        "every Engram layer remote"
        if not config.layers
        else ", ".join(f"layer {k} {v}" for k, v in sorted(config.layers.items())),
    )
    return True
