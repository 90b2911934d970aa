"""Who serves a GraphStep's in_graph layers: one contract, two implementations.

* :class:`tableclient.graph.poller.native.NativePoller` -- one C thread (``_native_c/``), no GIL on the hot path;
  it reads shm, tcp and rdma itself and hands what it cannot read to a Python thread.
* :class:`tableclient.graph.poller.python.PythonPoller` -- a Python thread per layer and a watchdog; its step
  state is :mod:`tableclient.graph.poller.slots`' pure state machine.

:func:`start` picks one (``poller``: "auto" the native one where it can serve, else Python's; "native";
"python") and says which in one log line. Both take the layers as ``(plan, ids_flag, rows_flag, ok_flag, ids,
staging)`` and answer the same calls (:class:`Poller`); ``tests/daemon/test_poller_contract.py`` runs one suite
against both. Beside them: :mod:`.silence` (a node that stopped answering, both pollers'), :mod:`.cpu` (the CPUs
set aside for pollers)."""

from __future__ import annotations

import logging
from typing import Protocol

from tableclient.graph.poller.silence import Silence

log = logging.getLogger(__name__)
KINDS = ("auto", "native", "python")


class Poller(Protocol):
    """What a GraphStep asks of the poller of its in_graph layers."""

    kind: str  # "native" or "python"
    cpu: int | None  # the CPU its thread is pinned to, or None
    realtime: bool  # whether its thread runs at real-time priority

    def arm(self, tokens: int, timeout: float) -> None:
        """The next step: ``tokens`` tokens, each layer's rows due ``timeout`` s from now; first waits (bounded
        by ``timeout``: GraphStepError past it, or at once once closed) until the last step was released, its
        graph consumed the release and any late ids flag of it was taken."""

    def after_replay(self, timeout: float) -> None:
        """(policy fail) Waits for every layer's release, bounded; raises the first failed layer's error."""

    def reset(self) -> None:
        """Clears every flag and step state after a replay that may not have run (nothing once closed)."""

    def released_at(self, layer: int) -> float:
        """When ``layer``'s last step was released (time.monotonic()'s clock)."""

    def silence(self, layer: int) -> Silence:
        """``layer``'s silence: whether its node answers since a step ran out of time, and its probes."""

    def account(self) -> None:
        """What the poller did since the last call, into the metrics (off the hot path)."""

    def close(self) -> None:
        """Stops its threads and lets go of everything it holds; every rows flag released. Idempotent."""


def start(kind: str, client, slots: list, flags, policy: str, step, *, timeout: float, budgets: dict,
          realtime: bool = False, dead_id: int | None = None, cpus: list | None = None) -> Poller:  # fmt: skip
    """The poller of ``slots`` (see the module docstring), started. ``flags``: the host's view of the GraphStep's
    flags; ``step``: the layers' EngramStep (the Python poller gathers through it); ``budgets``: per layer the
    seconds its gather may take once its ids came (0: the deadline alone)."""
    from tableclient.graph.poller.native import NativePoller, NativeUnavailable
    from tableclient.graph.poller.python import PythonPoller

    if kind not in KINDS:
        raise ValueError(f"poller {kind!r}: use {', '.join(KINDS)}")
    layers = sorted(plan.layer for plan, *_ in slots)
    if kind != "python":
        try:
            native = NativePoller(
                client, slots, flags, policy, connect_timeout=timeout, realtime=realtime,
                budgets=[budgets[plan.layer] for plan, *_ in slots], dead_id=dead_id, cpus=cpus,
            )  # fmt: skip
        except NativeUnavailable as e:
            if kind == "native":
                raise
            log.info("in_graph layers %s: the Python poller (%s)", layers, e)
        else:
            log.info(
                "in_graph layers %s: the native poller (no GIL on the hot path; %s; %s)",
                layers,
                "real-time priority"
                if native.realtime
                else "normal priority: grant CAP_SYS_NICE or an rtprio limit (ulimit -r 1) for a shorter tail on "
                "busy cores",
                f"pinned to CPU {native.cpu}"
                if native.cpu is not None
                else "not pinned: set poller_cpus to cores kept free of the engine"
                if not cpus
                else f"not pinned: {native.cpu_note}",
            )
            return native
    return PythonPoller(client, slots, flags, policy, step, budgets, dead_id=dead_id)
