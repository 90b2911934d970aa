"""What the tensor-parallel ranks of one engine decide alike, once, at start-up.

With TP > 1 every rank runs the same collectives, the plugin's among them (each served layer's agreement on its
rows, an all-reduce inside the step), and a layer's path (graph mode ``device``, ``in_graph``, the host's
``before_replay`` or the eager break) decides what a step does beside its peers: a rank that chooses differently
hangs all of them, or serves rows its peers do not. A choice that depends on a rank's own host -- whether its GPU
can register a node table, whether the native poller can serve its in_graph layers -- is therefore taken once,
across the group: a MIN all-reduce of each rank's capability on the engine's CPU group (gloo), as vLLM's own
DeepSeek-V4.1 specialized decode combines its requirements. The rank that cannot says why in one line; the
adapters log the decision once, on the group's first rank.

Each step, the rows a layer served outside any graph (vLLM's eager break, SGLang's eager forwards and the eager
breaks of its breakable decode graphs: Python on the host, its rows gathered there) are agreed the same way, one MIN
over the CPU group per layer and step (:func:`served_alike`): every rank serves the table's rows, or every rank the
policy's, or every rank raises; the graph modes agree inside their steps (``GraphStep``).
"""

from __future__ import annotations

import logging
import weakref

from tableclient.engine.plugin import PluginError
from tableclient.graph.device.table import DeviceTable
from tableclient.graph.errors import GraphStepError
from tableclient.metrics import metrics

log = logging.getLogger(__name__)

#: why a layer whose table this rank registered takes another path all the same
PEER_REFUSED = "another tensor-parallel rank cannot register its table"
#: a layer's rows in one step on one rank, as the ranks reduce them (their MIN is what every rank serves): its fetch
#: raised (policy fail, or any error), the policy's rows (zeros), the table's rows (fallback's included)
RAISED, POLICY, TABLE = 0, 1, 2
#: EngramRows -> (layer -> its steps agreed so far: the step a line names, layer -> its steps masked here)
_agreed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Ranks:
    """An engine's tensor-parallel group as the start-up decisions see it: ``size`` ranks, this one ``rank``, and
    the engine's CPU process group (``group``) their capabilities are reduced over; one rank: nothing to agree."""

    def __init__(self, size: int = 1, rank: int = 0, group=None):
        self.size, self.rank, self.group = size, rank, group

    @property
    def first(self) -> bool:
        """Whether this is the group's first rank (the one that logs what the group decided)."""
        return self.rank == 0

    def all(self, flags: list) -> list[bool]:
        """Per flag, whether it holds on every rank of the group (each rank passes as many, in the same order)."""
        return [v > 0 for v in self.least([int(bool(f)) for f in flags])]

    def least(self, values: list[int]) -> list[int]:
        """Per value, its minimum over the group's ranks (each rank passes as many, in the same order): a MIN
        all-reduce on the CPU group; with one rank the values themselves, no collective."""
        if self.size <= 1 or not values:
            return [int(v) for v in values]
        import torch
        import torch.distributed as dist

        held = torch.tensor([int(v) for v in values], dtype=torch.int32)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in held.tolist()]

    def __repr__(self) -> str:
        return f"Ranks(rank {self.rank} of {self.size})"


def register_tables(ranks: Ranks, client, layers: dict, device, tables: dict) -> dict[int, str]:
    """Graph mode ``device`` for ``layers`` (layer -> table name), as every rank can take it: each table registered
    with CUDA here (one :class:`DeviceTable` per table, kept in ``tables``, name -> table), then each layer agreed
    over the ranks. Returns {layer: why} for the layers every rank serves on another path: refused here (why), or
    on another rank (:data:`PEER_REFUSED`); a table registered here that no agreed layer reads is closed again."""
    why: dict[int, str] = {}
    for layer, name in sorted(layers.items()):
        if name in tables:
            continue
        try:
            tables[name] = DeviceTable(client, name, device)
        except GraphStepError as e:  # DeviceTableUnavailable, or no CUDA driver bindings
            why[layer] = str(e)
    order = sorted(layers)
    agreed = ranks.all([layer not in why for layer in order])
    refused = {layer: why.get(layer, PEER_REFUSED) for layer, ok in zip(order, agreed) if not ok}
    kept = {layers[layer] for layer in order if layer not in refused}
    for name in {layers[layer] for layer in refused} - kept:
        table = tables.pop(name, None)
        if table is not None:
            table.close()
    return refused


def agree_pollers(ranks: Ranks, steps: dict, rebuild) -> dict:
    """``steps`` (placement -> GraphStep) served by the same poller on every rank: where the native one cannot serve
    a placement's in_graph layers on some rank (its GraphStep says why, there), every rank takes Python's for them:
    ``rebuild(placements)`` builds those placements' GraphSteps again with it (the ones here closed first). Returns
    the steps."""
    placements = sorted(steps)
    native = ranks.all([steps[p].poller != "python" for p in placements])
    redo = [p for p, ok in zip(placements, native) if not ok and steps[p].poller == "native"]
    if not redo:
        return steps
    for p in redo:
        steps[p].close()
    return steps | rebuild(redo)


def describe(steps: dict, ranks: Ranks) -> str:
    """One line of what the ranks decided: each layer's graph mode and who serves the in_graph ones."""
    modes = sorted((layer, mode) for step in steps.values() for layer, mode in step.modes.items())
    pollers = sorted({step.poller for step in steps.values() if step.poller is not None})
    text = ", ".join(f"layer {layer} {mode}" for layer, mode in modes)
    if pollers:
        text += f"; in_graph layers served by the {' and '.join(pollers)} poller"
    if ranks.size > 1:
        text += f" (agreed by the {ranks.size} tensor-parallel ranks)"
    return text


def served_alike(ranks: Ranks, rows, layer: int, fetch):
    """A layer's rows for one step, served alike on every rank of ``ranks``: ``fetch()`` gets this rank's (its failure
    policy applied, as ``rows``, the process's EngramRows, serves them); its outcome here (the table's rows, the
    policy's zeros, or raised) is reduced with one MIN over the group's CPU group, which every rank reaches, its own
    fetch raising or not. Returns ``fetch()``'s result where every rank served the table's rows; None where any rank
    served the policy's (every rank then serves zeros: the caller writes them; a rank whose own rows were the table's
    counts the step in ``tableserver_client_zero_rows_served_total``, as the rank that failed did); raises PluginError
    on every rank where any rank's fetch raised (policy ``fail``, or an error of any kind), in one line naming the
    layer, the step (the layer's steps agreed since start-up, alike on every rank) and whether it failed here or on
    another rank. One rank: ``fetch()`` as it is, no collective."""
    if ranks.size <= 1:
        return fetch()
    steps, masked = _agreed.setdefault(rows, ({}, {}))
    step = steps[layer] = steps.get(layer, 0) + 1
    zeros, error, result = rows.zeros_served(layer), None, None
    try:
        result = fetch()
        here = TABLE if rows.zeros_served(layer) == zeros else POLICY
    except Exception as e:  # every rank must reach the reduction: it decides what each one does
        here, error = RAISED, e
    (agreed,) = ranks.least([here])
    if agreed == TABLE:
        return result
    if agreed == POLICY:
        if here == TABLE:  # this rank's own rows masked: another rank could not serve its rows
            times = masked[layer] = masked.get(layer, 0) + 1
            metrics().zero_rows.labels(str(layer)).inc()
            if times in (1, 10, 100) or times % 1000 == 0:
                log.warning("layer %d: serving zero rows (%d times so far): another tensor-parallel rank could not "
                            "serve its rows", layer, times)  # fmt: skip
        return None
    where = "here" if here == RAISED else "on another rank"
    cause = f"; {type(error).__name__}: {' '.join(str(error).split())}" if error is not None else ""
    raise PluginError(
        f"tableserver plugin: layer {layer}: step {step}'s rows were not served {where} (policy {rows.config.policy}: "
        f"every tensor-parallel rank stops the step{cause})"
    ) from None
