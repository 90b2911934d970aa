"""The engine-neutral half of a serving-engine adapter: what the SGLang adapter (``tableclient.sglang``)
uses and a second engine's adapter uses the same way.

``config`` (:class:`PluginConfig`: per-layer placement, addresses, failure policy, graph modes),
``rows`` (:class:`EngramRows`: one client and one step per tableserver, prefetch at step start, the
packed rows a layer asks for; :func:`dequantize`, :func:`to_device`), ``plugin`` (:class:`PluginState`,
the entry point's start-up, :class:`PluginError`), ``memory`` (the start-up report of the table memory the
engine did not allocate, and of its host KV cache). The graph-safe step is ``tableclient.graph.step``.
Nothing here imports an engine. Their errors (:class:`ConfigError`, :class:`PluginError`,
:class:`EngramRowsError`) are the client's: each derives from ``tableclient.errors.TableClientError``.
"""

from tableclient.engine.config import ConfigError, PluginConfig
from tableclient.engine.plugin import PluginError, PluginState
from tableclient.engine.rows import EngramRows, EngramRowsError, dequantize, to_device

__all__ = [
    "ConfigError",
    "PluginConfig",
    "PluginError",
    "PluginState",
    "EngramRows",
    "EngramRowsError",
    "dequantize",
    "to_device",
]
