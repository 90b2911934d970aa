"""The plugins' start-up memory report, the same for every engine: the Engram table memory the engine did not
allocate in this process because a tableserver serves the layer (a log line, and the gauges
``tableserver_client_freed_table_{host,device}_bytes``), the engine's host KV flag named where that freed host
memory goes unused, and a warning where the engine's host KV cache asks more than this process has once the
plugin's staging is allocated. The adapters supply what only their engine knows: what it would have allocated
(``FreedTable``), whether it runs a host KV cache and how large. The sizing itself is ``tableserver plan``'s
(``tableserver/ops/launch_plan.py``), over the arithmetic of ``tableclient.hostmem``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tableclient.engine.config import PluginConfig
from tableclient.hostmem import GIB, proc_kib

#: host memory freed in a process (by remote layers) from which the plugin names the engine's host KV flag
ADVICE_MIN_BYTES = 4 * GIB


@dataclass(frozen=True)
class FreedTable:
    """What the engine did not allocate in this process for a served layer's table: ``nbytes`` of ``memory``
    (``host`` or ``device``), this process's share where the engine would share one copy."""

    layer: int
    placement: str
    nbytes: int
    memory: str


def export(freed: FreedTable) -> None:
    from tableclient.metrics import metrics

    gauge = metrics().freed_host if freed.memory == "host" else metrics().freed_device
    gauge.labels(str(freed.layer)).set(freed.nbytes)


def report(state, engine: str, host_kv: bool | None, flag: str, hint: str, log: logging.Logger) -> int:
    """Start-up report, once the engine built its model: the table memory the engine did not allocate in this
    process because of the placement (``state``: the process's PluginState), per layer; and, where the remote layers freed at least
    ``ADVICE_MIN_BYTES`` of host memory here and the engine runs without host KV cache (``host_kv`` False;
    None: unknown), one warning naming ``flag`` and the ``tableserver plan`` command (``hint``) that sizes it.
    Returns the host bytes the remote layers freed in this process."""
    freed = [state.freed[layer] for layer in sorted(state.freed)]
    if not freed:
        return 0
    log.info(
        "tableserver plugin: %s did not allocate these Engram tables in this process: %s",
        engine,
        "; ".join(
            f"layer {f.layer} ({f.placement}) {f.nbytes / GIB:.2f} GiB of {f.memory} memory"
            + (" (this host's tableserver keeps one copy)" if f.placement == "node" and f.memory == "host" else "")
            for f in freed
        ),
    )
    host = sum(f.nbytes for f in freed if f.memory == "host" and f.placement == "remote")
    if host_kv is False and host >= ADVICE_MIN_BYTES:
        log.warning(
            "tableserver plugin: %.1f GiB of host memory freed in this process, and %s runs without host KV cache: "
            "add %s (`%s` sizes it for this host)",
            host / GIB,
            engine,
            flag,
            hint,
        )
    return host


def check_host_kv(engine: str, requested: int, available: int, staging: int, fix: str, log: logging.Logger) -> bool:
    """Whether the engine's host KV cache (``requested`` bytes in this process) fits what this process has
    (``available``) once the plugin's own ``staging`` is allocated; warns, naming ``fix``, where it does not
    (before the engine allocates it and fails, or is killed)."""
    if requested + staging <= available:
        return True
    log.warning(
        "tableserver plugin: %s's host KV cache asks %.1f GiB in this process but %.1f GiB is available here once "
        "the plugin's staging (%.2f GiB) is allocated: %s",
        engine,
        requested / GIB,
        max(available - staging, 0) / GIB,
        staging / GIB,
        fix,
    )
    return False


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """This host's MemAvailable now (bytes; 0 where it cannot be read)."""
    return proc_kib(meminfo, "MemAvailable")


def plan_hint(engine: str, cfg: PluginConfig, layers, tp: int, dp: int) -> str:
    """The ``tableserver plan`` command for this process's engine, layout and placement."""
    placement = ",".join(f"{layer}={cfg.placement(layer)}" for layer in sorted(layers))
    return f"tableserver plan --engine {engine} --tp {tp} --dp {dp} --placement {placement} --kv-pool-gib <as logged>"
