"""SGLang plugin: DeepSeek-V4.1's Engram lookups served by a tableserver instead of local tables.

Installed as the ``sglang.srt.plugins`` entry point ``tableserver`` (setup.cfg).
SGLang calls :func:`register` in each worker; when configured, it replaces
``EngramEmbedding._lookup(self, indices)`` — the function that turns row ids
``[..., n_cols]`` into bf16 rows ``[..., n_cols, head_dim]`` — with
:class:`EngramLookup`, which has the same call signature: it gathers the
264-byte packed rows from the memory node and dequantizes them exactly as
SGLang does (``fp8 * 2^(e8m0 - 127)`` per block of 32, then bf16).

Configuration: one TOML file named by ``TABLESERVER_SGLANG_CONFIG``, or
``TABLESERVER_*`` environment variables (the file wins where both set a key)::

    address = "memnode:7070"        # TABLESERVER_ADDRESS (required to enable the plugin)
    transport = "auto"              # TABLESERVER_TRANSPORT
    token = "..."                   # TABLESERVER_AUTH_TOKEN
    tls_ca = "/etc/tableserver/ca.pem"   # TABLESERVER_TLS_CA
    table_prefix = "engram.layer"   # TABLESERVER_TABLE_PREFIX: table of layer L = prefix + L
    mode = "read"                   # TABLESERVER_MODE: read | pack (rdma)
    timeout = 5.0                   # TABLESERVER_TIMEOUT: seconds one lookup may take

The client is created lazily in the worker process (gRPC is not fork-safe).
"""

from __future__ import annotations

import logging
import os
import threading
import tomllib
from dataclasses import dataclass, fields

log = logging.getLogger("tableclient.sglang")

FP8_BLOCK = 32
ENV = {"address": "TABLESERVER_ADDRESS", "transport": "TABLESERVER_TRANSPORT", "token": "TABLESERVER_AUTH_TOKEN",
       "tls_ca": "TABLESERVER_TLS_CA", "table_prefix": "TABLESERVER_TABLE_PREFIX", "mode": "TABLESERVER_MODE",
       "timeout": "TABLESERVER_TIMEOUT"}


@dataclass(frozen=True)
class PluginConfig:
    address: str = ""
    transport: str = "auto"
    token: str = ""
    tls_ca: str = ""
    table_prefix: str = "engram.layer"
    mode: str = "read"
    timeout: float = 5.0

    @classmethod
    def load(cls, environ=None) -> "PluginConfig":
        environ = os.environ if environ is None else environ
        values = {name: environ[var] for name, var in ENV.items() if environ.get(var)}
        path = environ.get("TABLESERVER_SGLANG_CONFIG")
        if path:
            try:
                with open(path, "rb") as f:
                    doc = tomllib.load(f)
            except (OSError, tomllib.TOMLDecodeError) as e:
                raise ValueError(f"TABLESERVER_SGLANG_CONFIG={path}: {e}") from None
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(doc) - known)
            if unknown:
                raise ValueError(f"{path}: unknown key {unknown[0]!r}: known keys are {', '.join(sorted(known))}")
            values.update(doc)
        if "timeout" in values:
            values["timeout"] = float(values["timeout"])
        return cls(**values)

    @property
    def enabled(self) -> bool:
        return bool(self.address)


def dequantize(rows):
    """uint8 ``[..., 264]`` packed rows -> bf16 ``[..., 256]``, SGLang's arithmetic exactly."""
    import torch

    weight = rows[..., :256].contiguous().view(torch.float8_e4m3fn)
    scale = rows[..., 256:264].to(torch.float32)
    values = weight.float().unflatten(-1, (-1, FP8_BLOCK)) * torch.pow(2.0, scale - 127.0).unsqueeze(-1)
    return values.flatten(-2).to(torch.bfloat16)


class EngramLookup:
    """``lookup(indices) -> bf16 [..., n_cols, 256]`` for one Engram layer, rows from the tableserver."""

    def __init__(self, layer: int, config: PluginConfig, client=None):
        self.layer = layer
        self.config = config
        self._client = client
        self._table = None
        self._lock = threading.Lock()

    def _remote(self):
        if self._table is None:
            with self._lock:
                if self._table is None:
                    if self._client is None:
                        self._client = shared_client(self.config)
                    self._table = self._client.table(f"{self.config.table_prefix}{self.layer}", mode=self.config.mode)
        return self._table

    def rows(self, indices):
        """The packed uint8 rows ``[..., 264]`` for ``indices`` (a CPU torch tensor comes back)."""
        return self._remote().gather(indices.detach().to("cpu", dtype=_int64()), timeout=self.config.timeout)

    def __call__(self, indices):
        return dequantize(self.rows(indices)).to(indices.device)


_clients: dict = {}
_clients_lock = threading.Lock()


def shared_client(config: PluginConfig):
    """One TableClient per process and address (each SGLang worker process makes its own)."""
    from tableclient import TableClient

    key = (os.getpid(), config.address, config.transport)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = TableClient(config.address, transport=config.transport, token=config.token or None,
                                        tls_ca=config.tls_ca or None, mode=config.mode,
                                        client_name=f"sglang-worker-{os.getpid()}")
            log.info("tableserver engram lookups via %s (%s)", config.address, _clients[key].transport)
        return _clients[key]


def _int64():
    import torch

    return torch.int64


def register() -> bool:
    """The ``sglang.srt.plugins`` entry point. Returns whether SGLang's lookup now uses the tableserver."""
    try:
        config = PluginConfig.load()
    except ValueError as e:
        log.error("tableserver plugin disabled: %s", e)
        return False
    if not config.enabled:
        log.info("tableserver plugin installed but not configured (set TABLESERVER_ADDRESS)")
        return False
    try:
        from sglang.srt.layers import engram as sglang_engram
    except ImportError:
        log.warning("tableserver plugin: sglang.srt.layers.engram not importable; nothing to patch")
        return False
    cls = sglang_engram.EngramEmbedding
    original = cls._lookup
    lookups: dict = {}

    def _lookup(self, indices):
        layer = getattr(self, "layer_id", None)
        if layer is None:
            layer = getattr(self, "layer_hash_index", None)
        if layer is None:
            return original(self, indices)
        if layer not in lookups:
            lookups[layer] = EngramLookup(layer, config)
        return lookups[layer](indices)

    cls._lookup = _lookup
    log.info("tableserver plugin: EngramEmbedding._lookup now gathers from %s", config.address)
    return True
