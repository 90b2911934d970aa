"""What every engine adapter's plugin entry point does the same way: one process-wide state (the
configuration, the :class:`EngramRows` built from it, and what the hooks know of the engine's objects),
and the start-up that turns a bad configuration or an engine the adapter cannot hook into one line.

An adapter supplies only what is its engine's: the version check and the hooks (``engage``).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import weakref

from tableclient.engine.config import ConfigError, PluginConfig
from tableclient.engine.memory import FreedTable, export
from tableclient.engine.rows import EngramRows, EngramRowsError
from tableclient.errors import TableClientError


class PluginError(TableClientError, RuntimeError):
    """The plugin is enabled but cannot engage as configured; the message says why and what to do."""


def check_release(dist: str, engine: str, supported: str) -> str:
    """The installed ``dist``'s version if it is the one release the adapter hooks; PluginError naming the
    fix otherwise (the adapters patch an engine's internals, which move between releases)."""
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise PluginError(f"tableserver plugin: {dist} is not installed in this environment") from None
    if version != supported:
        raise PluginError(
            f"tableserver plugin: {engine} {version} is not supported (tested with {supported}, whose Engram "
            f"internals it hooks): install {dist}=={supported}, or unset TABLESERVER_ADDRESS to run {engine} "
            "without the plugin"
        )
    return version


def check_layout(expected: dict, engine: str, pin: str, original=inspect.unwrap) -> None:
    """Each hooked function of ``expected`` {function: [parameter names]} still has those parameters
    (``original`` finds the engine's function under a wrapper); PluginError naming ``pin`` otherwise."""
    for fn, params in expected.items():
        got = list(inspect.signature(original(fn)).parameters)
        if got != params:
            raise PluginError(
                f"tableserver plugin: {engine}'s {fn.__qualname__}{tuple(got)} is not the layout this plugin "
                f"hooks ({tuple(params)}): install {pin}"
            )


def check_placement(cfg: PluginConfig, built: list, engine: str) -> list:
    """Start-up check, once the engine built its model: ``built`` holds, per Engram layer, (its layer id,
    or None where it was built without the plugin's hooks; whether the plugin serves it). Every layer is
    where ``cfg`` places it and ``cfg`` names no other layer, or PluginError. Returns the layer ids."""
    layers = []
    for layer, is_served in built:
        if layer is None:
            raise PluginError(
                "tableserver plugin: an Engram layer was built without the plugin's hooks: the plugin cannot engage"
            )
        layers.append(layer)
        if cfg.enabled and cfg.placement(layer) != "local" and not is_served:
            raise PluginError(
                f"tableserver plugin: Engram layer {layer} is placed {cfg.placement(layer)} but {engine} built its "
                "own table: the plugin's hooks did not engage"
            )
    unknown = sorted(set(cfg.layers) - set(layers))
    if unknown:
        raise PluginError(
            f"tableserver plugin: [layers] names layer {unknown[0]}, which is not an Engram layer of this model "
            f"(it has {', '.join(map(str, layers))}): fix the placement"
        )
    return layers


class PluginState:
    """This process's configuration and rows: the layers built from now on follow ``configure``.

    It also keeps what the hooks know of the engine's modules (which Engram layer each was built as,
    and which serve theirs from a tableserver), so the plugin never sets an attribute of its own on an
    engine's object. The modules are held weakly: a model freed is forgotten."""

    def __init__(self, engine: str, dead_id: int | None = None):
        self.engine = engine
        self.dead_id = dead_id
        self.config: PluginConfig | None = None
        self._rows: EngramRows | None = None
        self.hooks_in_place = False  # set by the adapter once its hooks are in place in this process
        self._built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its layer id
        self._served: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the layer it serves
        self.freed: dict[int, FreedTable] = {}  # layer -> what the engine did not allocate for it here

    def configure(self, cfg: PluginConfig, client_factory=None) -> EngramRows:
        """Makes ``cfg`` this process's configuration (the previous one's clients are closed)."""
        if self._rows is not None:
            self._rows.close()
        for old in self.freed.values():  # the next configuration's layers report their own
            export(FreedTable(old.layer, old.placement, 0, old.memory))
        self.freed.clear()
        self.config = cfg
        self._rows = EngramRows(cfg, client_factory, engine=self.engine, dead_id=self.dead_id)
        return self._rows

    def rows(self) -> EngramRows:
        if self._rows is None:
            raise PluginError("tableserver plugin: not configured (set TABLESERVER_ADDRESS)")
        return self._rows

    @property
    def configured(self) -> bool:
        return self._rows is not None

    def served(self, layer: int) -> bool:
        """Whether ``layer`` reads its rows from a tableserver (placed ``remote`` or ``node``)."""
        cfg = self.config
        return cfg is not None and cfg.enabled and cfg.placement(layer) != "local"

    def built(self, module, layer: int, served: bool = False) -> None:
        """The hooks built the engine's ``module`` as Engram layer ``layer``; ``served``: it reads its rows
        from a tableserver."""
        self._built[module] = layer
        if served:
            self._served[module] = layer

    def table_not_allocated(self, freed: FreedTable) -> None:
        """The engine built ``freed.layer`` without its table: recorded for the start-up report, and exported
        (``tableserver_client_freed_table_{host,device}_bytes``)."""
        self.freed[freed.layer] = freed
        export(freed)

    def layer_of(self, module) -> int | None:
        """The layer the hooks built ``module`` as; None for a module built without them."""
        return self._built.get(module)

    def served_layer(self, module) -> int | None:
        """The layer ``module`` serves from a tableserver; None for a local one (or one the hooks did not build)."""
        return self._served.get(module)


def start(engine: str, file_var: str, engage, log: logging.Logger) -> bool:
    """The body of an engine's plugin entry point. Loads the configuration (``file_var`` names its TOML
    file); unconfigured, logs that the engine keeps its own tables and returns False. Otherwise calls
    ``engage(config)``, which checks the engine, puts the hooks in place and returns the engine's
    version, and returns True.

    Enabled but unable to engage (a bad configuration, an engine version or layout the adapter does not
    hook), start-up stops with one line: ``SystemExit``, which engines that log and ignore a plugin's
    exceptions let through, and which prints just that line."""
    try:
        config = PluginConfig.load(file_var=file_var)
        if not config.enabled:
            log.info(
                "tableserver plugin installed but not configured (set TABLESERVER_ADDRESS or %s): "
                "%s keeps its own Engram tables",
                file_var,
                engine,
            )
            return False
        version = engage(config)
    except Exception as e:  # with TABLESERVER_* set the user asked for the plugin: stop instead of going on without
        ours = isinstance(e, (ConfigError, PluginError, EngramRowsError))
        if not ours and not any(k.startswith("TABLESERVER_") for k in os.environ):
            raise
        text = str(e).removeprefix("tableserver plugin: ")
        raise SystemExit(f"tableserver plugin: {text if ours else repr(e)}") from None
    log.info(
        "tableserver plugin: hooks in place in %s %s (%s)",
        engine,
        version,
        "every Engram layer remote"
        if not config.layers
        else ", ".join(f"layer {k} {v}" for k, v in sorted(config.layers.items())),
    )
    return True
