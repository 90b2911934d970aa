"""The engine plugins' configuration: where each Engram layer's rows come from.

One TOML file named by ``TABLESERVER_SGLANG_CONFIG`` (SGLang) or ``TABLESERVER_VLLM_CONFIG`` (vLLM)
and/or ``TABLESERVER_*`` environment variables (the environment wins, so one file can serve a fleet
while a pod overrides its address)::

    address = "memnode:7070"          # TABLESERVER_ADDRESS: the memory node of "remote" layers
    node_address = "127.0.0.1:7070"   # TABLESERVER_NODE_ADDRESS: this host's tableserver ("node" layers, shm)
    transport = "auto"                # TABLESERVER_TRANSPORT: remote layers' transport (auto, rdma, tcp)
    mode = "read"                     # TABLESERVER_MODE: rdma gather mode (read | pack)
    token = "..."                     # TABLESERVER_AUTH_TOKEN
    tls_ca = "/etc/tableserver/ca.pem"  # TABLESERVER_TLS_CA
    policy = "fail"                   # TABLESERVER_POLICY: fail | zeros | fallback (on a memory-node failure)
    fallback_address = ""             # TABLESERVER_FALLBACK_ADDRESS: the second tableserver of "fallback"
    timeout = 5.0                     # TABLESERVER_TIMEOUT: seconds one layer's rows may take
    gather_budget = 0.0               # TABLESERVER_GATHER_BUDGET: an in_graph layer's gather, from its ids (s;
                                      # 0: four windows, at least 5 ms): a late node stalls a step this long
    max_tokens = 8192                 # TABLESERVER_MAX_TOKENS: staging rows per layer (tokens per forward)
    table_prefix = "engram.layer"     # table of layer L, unless [tables] names it

    [layers]                          # TABLESERVER_PLACEMENT="1=local,14=remote"
    1 = "local"                       # the engine's own table, untouched
    14 = "remote"                     # every layer not named here: remote

    [tables]                          # optional: table name per layer
    14 = "engram.layer14"

    [windows]                         # optional: seconds after step start each layer needs its rows
    1 = 0.0003                        # (orders the gathers, shortest first; counts deadline misses)

    [graph]                           # TABLESERVER_GRAPH_MODE="1=before_replay,14=in_graph"
    14 = "in_graph"                   # how a served layer's rows reach a captured decode graph
    switch_interval = 0.0             # TABLESERVER_SWITCH_INTERVAL: with in_graph layers, set the interpreter's
                                      # GIL switch interval (s; 0 = leave it): the Python poller's gather needs the GIL
    poller_priority = "normal"        # TABLESERVER_POLLER_PRIORITY: the native in_graph poller's thread, normal or
                                      # realtime (SCHED_FIFO 1 where permitted: no scheduler slice mid-step on busy cores)
    poller_cpus = ""                  # TABLESERVER_POLLER_CPUS: CPUs kept free of the engine (taskset, isolcpus), e.g.
                                      # "14,15": each native poller on this host pinned to one no other poller holds

Placements: ``remote`` (a memory node: rdma or tcp), ``node`` (a tableserver
on this host, over shm: one copy of the table per node) and ``local``
(the engine's own table for that layer, as without the plugin). ``make replay``
writes the ``[layers]`` and ``[graph]`` tables it recommends from measured read times.

Graph modes (decode CUDA graphs on; client/tableclient/graph/step.py): ``device`` (the default for a
``node`` layer: its table, mapped here, is registered with CUDA and the captured graph gathers it with
a kernel on a side stream; no host work at replay), ``before_replay`` (the default otherwise: rows
gathered on the host before each replay, for any layer), ``in_graph`` (the graph publishes its ids and
waits for the rows just before the layer: the gather overlaps the layers before it; for a layer whose
window covers its gather, e.g. 14), ``eager_break`` (with SGLang's ``--cuda-graph-backend-decode
breakable``: the layer runs eagerly between captured segments). Under vLLM a ``remote`` layer runs
through vLLM's own eager break (piecewise graphs) and a ``node`` layer in ``device`` mode in any of its
graph modes (client/tableclient/vllm/hooks.py).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields

from tableclient.bounds import MAX_TIMEOUT_S, timeout_error
from tableclient.errors import TableClientError
from tableclient.graph.poller.cpu import parse_cpus
from tableclient.hostmem import STAGING_TOKENS
from tableclient.model import WINDOWS_S

PLACEMENTS = ("remote", "node", "local")
GRAPH_MODES = ("before_replay", "in_graph", "eager_break", "device")
POLICIES = ("fail", "zeros", "fallback")
ENV = {
    "address": "TABLESERVER_ADDRESS",
    "node_address": "TABLESERVER_NODE_ADDRESS",
    "transport": "TABLESERVER_TRANSPORT",
    "mode": "TABLESERVER_MODE",
    "token": "TABLESERVER_AUTH_TOKEN",
    "tls_ca": "TABLESERVER_TLS_CA",
    "policy": "TABLESERVER_POLICY",
    "fallback_address": "TABLESERVER_FALLBACK_ADDRESS",
    "timeout": "TABLESERVER_TIMEOUT",
    "liveness_timeout": "TABLESERVER_LIVENESS_TIMEOUT",
    "gather_budget": "TABLESERVER_GATHER_BUDGET",
    "max_tokens": "TABLESERVER_MAX_TOKENS",
    "table_prefix": "TABLESERVER_TABLE_PREFIX",
    "layers": "TABLESERVER_PLACEMENT",
    "graph": "TABLESERVER_GRAPH_MODE",
    "switch_interval": "TABLESERVER_SWITCH_INTERVAL",
    "poller_priority": "TABLESERVER_POLLER_PRIORITY",
    "poller_cpus": "TABLESERVER_POLLER_CPUS",
}


class ConfigError(TableClientError, ValueError):
    """The plugin's configuration is invalid; the message names the key and the fix. The client's one
    ConfigError (a TableClient's own options that are out of bounds raise plain ValueError)."""


@dataclass(frozen=True)
class PluginConfig:
    address: str = ""
    node_address: str = "127.0.0.1:7070"
    transport: str = "auto"
    mode: str = "read"
    token: str = ""
    tls_ca: str = ""
    policy: str = "fail"
    fallback_address: str = ""
    timeout: float = 5.0
    liveness_timeout: float = 2.0  # a tableserver silent this long (no keepalive answer) is failed over
    gather_budget: float = 0.0  # an in_graph layer's gather, from its ids: seconds (0: four windows, >= 5 ms)
    max_tokens: int = STAGING_TOKENS
    table_prefix: str = "engram.layer"
    layers: dict = field(default_factory=dict)  # layer -> placement (default remote)
    tables: dict = field(default_factory=dict)  # layer -> table name
    windows: dict = field(default_factory=dict)  # layer -> seconds
    graph: dict = field(default_factory=dict)  # layer -> graph mode (default before_replay)
    switch_interval: float = 0.0  # with in_graph layers: sys.setswitchinterval(this), 0 = leave it
    poller_priority: str = "normal"  # the native in_graph poller's thread: normal | realtime
    poller_cpus: str = ""  # CPUs set aside for native pollers ("14,15", "12-15"): each poller pinned to one

    def __post_init__(self):
        for f in fields(self):
            value, kind = getattr(self, f.name), {"float": (int, float), "int": int, "dict": dict}.get(f.type, str)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ConfigError(f"{f.name} = {value!r}: expected {'a table' if kind is dict else f.type}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy = {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.policy == "fallback" and not self.fallback_address:
            raise ConfigError(
                "policy = 'fallback' needs fallback_address (TABLESERVER_FALLBACK_ADDRESS): the "
                "second tableserver to read from when the first fails"
            )
        if self.mode not in ("read", "pack"):
            raise ConfigError(f"mode = {self.mode!r}: use read or pack")
        if self.transport not in ("auto", "rdma", "tcp", "shm"):
            raise ConfigError(f"transport = {self.transport!r}: use auto, rdma, tcp or shm")
        if not 0 <= self.gather_budget <= MAX_TIMEOUT_S:
            raise ConfigError(
                f"gather_budget = {self.gather_budget!r}: expected seconds 0 (from the windows) to {MAX_TIMEOUT_S:g}"
            )
        for name in ("timeout", "liveness_timeout"):  # a deadline of inf or 1e10 s overflows the native poller's
            why = timeout_error(name, getattr(self, name))
            if why is not None:
                raise ConfigError(f"{why} ({ENV[name]})")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.poller_priority not in ("normal", "realtime"):
            raise ConfigError(f"poller_priority = {self.poller_priority!r}: use normal or realtime")
        try:
            parse_cpus(self.poller_cpus)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not 0 <= self.switch_interval <= 0.1:
            raise ConfigError(
                f"switch_interval = {self.switch_interval!r}: expected seconds in 0..0.1 (0: leave the interpreter's)"
            )
        for name in ("layers", "tables", "windows", "graph"):
            object.__setattr__(self, name, _by_layer(name, getattr(self, name)))
        for layer, placement in self.layers.items():
            if placement not in PLACEMENTS:
                raise ConfigError(f"layers.{layer} = {placement!r}: use one of {', '.join(PLACEMENTS)}")
        for layer, mode in self.graph.items():
            if mode not in GRAPH_MODES:
                raise ConfigError(f"graph.{layer} = {mode!r}: use one of {', '.join(GRAPH_MODES)}")
            if mode == "device" and self.placement(layer) != "node":
                raise ConfigError(
                    f"graph.{layer} = 'device': the graph gathers from the table this host's tableserver maps, "
                    f"and layer {layer} is placed {self.placement(layer)!r}: place it 'node', or use before_replay"
                )
            if mode == "device" and self.policy == "fallback":
                raise ConfigError(
                    f"graph.{layer} = 'device' with policy 'fallback': the fallback's rows are gathered on the "
                    "host: use policy zeros or fail, or graph mode before_replay"
                )
        if any(p == "remote" for p in self.layers.values()) and not self.address:
            raise ConfigError(
                "a layer is placed 'remote' but no address is set: set address "
                "(TABLESERVER_ADDRESS) to the memory node, or place the layer 'node' or 'local'"
            )

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, environ=None, file_var: str = "TABLESERVER_SGLANG_CONFIG") -> PluginConfig:
        """From the TOML file ``environ[file_var]`` names (if set) and the ``TABLESERVER_*`` variables."""
        environ = os.environ if environ is None else environ
        values: dict = {}
        path = environ.get(file_var)
        if path:
            try:
                with open(path, "rb") as f:
                    doc = tomllib.load(f)
            except OSError as e:
                raise ConfigError(f"{file_var}={path}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{file_var}={path}: not valid TOML ({e})") from None
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(doc) - known)
            if unknown:
                raise ConfigError(f"{path}: unknown key {unknown[0]!r}: known keys are {', '.join(sorted(known))}")
            values.update(doc)
        for name, var in ENV.items():
            if environ.get(var):
                values[name] = _parse_placement(var, environ[var]) if name in ("layers", "graph") else environ[var]
        for name, kind in (
            ("timeout", float),
            ("max_tokens", int),
            ("switch_interval", float),
            ("liveness_timeout", float),
            ("gather_budget", float),
        ):
            if name in values:
                try:
                    values[name] = kind(values[name])
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"{name} = {values[name]!r}: expected {'seconds' if kind is float else 'a whole number'}"
                    ) from None
        return cls(**values)

    @property
    def enabled(self) -> bool:
        """Whether any layer is to be served by a tableserver (remote needs an address, node has a default)."""
        return bool(self.address) or any(p == "node" for p in self.layers.values())

    # ------------------------------------------------------------------ per layer
    def placement(self, layer: int) -> str:
        return self.layers.get(layer, "remote" if self.address else "local")

    def address_of(self, placement: str) -> str:
        """The tableserver a placement reads from (remote: the memory node; node: this host's)."""
        return {"remote": self.address, "node": self.node_address, "fallback": self.fallback_address}[placement]

    def graph_mode(self, layer: int) -> str:
        """The layer's graph mode: as configured, else ``device`` for a ``node`` layer (its table is
        mapped here: the graph gathers it) unless the policy is ``fallback``, else ``before_replay``."""
        if layer in self.graph:
            return self.graph[layer]
        return "device" if self.placement(layer) == "node" and self.policy != "fallback" else "before_replay"

    def table(self, layer: int) -> str:
        return self.tables.get(layer, f"{self.table_prefix}{layer}")

    def window(self, layer: int) -> float:
        if layer in self.windows:
            return self.windows[layer]
        # DeepSeek-V4.1's measured windows (seed paper; tableserver/common/model.py): layer 1's rows are due
        # 0.3 ms after step start, layer 14's 9.3 ms. Other layers: the line through those two points (a
        # window grows with the layers before it).
        if layer in WINDOWS_S:
            return WINDOWS_S[layer]
        (l1, w1), (l2, w2) = sorted(WINDOWS_S.items())
        return max(0.0, w1 + (layer - l1) * (w2 - w1) / (l2 - l1))

    def describe(self, layers, engine: str = "SGLang") -> str:
        """``1 local, 14 remote (memnode:7070)``: one phrase for a log line."""

        def where(placement: str) -> str:
            return f"{engine}'s own table" if placement == "local" else self.address_of(placement)

        return ", ".join(f"layer {layer} {self.placement(layer)} ({where(self.placement(layer))})" for layer in layers)


def _by_layer(name: str, table: dict) -> dict:
    out = {}
    for key, value in (table or {}).items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"[{name}] key {key!r}: keys are Engram layer numbers, e.g. 14 = ...") from None
        if name == "windows":
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"windows.{layer} = {value!r}: expected seconds") from None
        out[layer] = value
    return out


def _parse_placement(var: str, text: str) -> dict:
    """``1=local,14=remote`` -> {"1": "local", "14": "remote"}."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        layer, sep, placement = item.partition("=")
        if not sep:
            raise ConfigError(f"{var}={text!r}: expected LAYER=PLACEMENT pairs, e.g. 1=local,14=remote")
        out[layer.strip()] = placement.strip()
    return out
