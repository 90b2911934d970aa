"""Graph mode ``in_graph``: the graph publishes the ids itself. Right after the hasher it copies the layer's ids
into pinned memory and writes the layer's ``ids`` flag; a poller of this process (:mod:`tableclient.graph.poller`:
the native thread, or Python's) waits for the flag, gathers the ids into the staging and writes the ``rows`` flag;
the graph waits for that just before the layer's copy. The gather overlaps every layer before it (layer 14's rows
travel while layers 0..13 run). The GPU never waits forever: at the layer's deadline the poller releases the flag
with zeros or the fallback's rows in the staging (policies ``zeros``, ``fallback``; the fallback's own gather adds
its time), or with zeros and the step poisoned (``fail``: :meth:`InGraphMode.after_replay` raises, before the
engine reads the step's output).

The flags (:class:`tableclient.graph.streams.GraphFlags`, three per layer: ids, rows, ok) and the stream's side of
them (``ops``: captured stream memory operations, or the host) are the GraphStep's; the protocol is in
:mod:`tableclient.graph.step`'s docstring."""

from __future__ import annotations

from tableclient.graph import poller as pollers
from tableclient.graph.modes import Mode, staged_rows
from tableclient.step import EngramStep

IDS, ROWS, OK = 0, 1, 2


def gather_budget(window_s: float) -> float:
    """How long an in_graph layer's gather may take once the graph published its ids, by default: four
    windows, at least 5 ms (layer 1: 5 ms, layer 14: 37 ms). The rows are due one window after the ids;
    a gather several windows late is a node in trouble, and each step then stalls the GPU this long at
    most (with the policy's rows), not for the whole ``timeout``, which bounds only a replay whose ids
    never come."""
    return max(4.0 * window_s, 0.005)


class InGraphMode(Mode):
    """The ``in_graph`` layers of ``plans`` (served shortest window first), their poller started."""

    name = "in_graph"

    def __init__(self, torch, client, plans: list, options, device, max_tokens: int, common: dict, flags, ops):
        plans = sorted(plans, key=lambda p: p.window_s)
        super().__init__([p.layer for p in plans])
        given = options.budgets or {}
        #: per layer: seconds its gather may take once its ids came (gather_budget(window) by default)
        self.budgets = {p.layer: float(given.get(p.layer, gather_budget(p.window_s))) for p in plans}
        for layer, budget in self.budgets.items():
            if not 0 <= budget <= 1e6:
                raise ValueError(f"layer {layer}: a gather budget of {budget!r} s: use 0 (the deadline alone) to 1e6")
        self.options, self.flags, self.ops = options, flags, ops
        #: the layers' EngramStep: their staging (pinned host ``[max_tokens, 24, row_bytes]``) and gathers
        self.step = EngramStep(client, plans, max_tokens, deadlines=False, **common)
        for staging in self.step.staging.values():  # a padded bucket's rows copy what is there: zeros, then
            staging.zero_()  # earlier steps'
        staging = {layer: self.step.staging[layer].numpy() for layer in self.layers}
        rows = max_tokens * options.rows_per_token
        self.device_rows = {
            layer: torch.zeros((rows, staging[layer].shape[-1]), dtype=torch.uint8, device=device)
            for layer in self.layers
        }
        #: layer -> the pinned ids buffer the graph publishes into, ``[max_tokens, 24]`` int64
        self.ids = {
            layer: torch.zeros((max_tokens, options.rows_per_token), dtype=torch.int64, pin_memory=common["pin"])
            for layer in self.layers
        }
        #: layer -> its flags' indexes (ids, rows, ok)
        self.slots = {
            layer: tuple(flags.index(i, which) for which in (IDS, ROWS, OK)) for i, layer in enumerate(self.layers)
        }
        spec = [(p, *self.slots[p.layer], self.ids[p.layer].numpy(), staging[p.layer]) for p in plans]
        #: who serves these layers (tableclient.graph.poller's contract)
        self.poller = pollers.start(
            options.poller, client, spec, flags.host, options.policy, self.step, timeout=options.timeout,
            budgets=self.budgets, realtime=options.realtime, dead_id=options.dead_id, cpus=options.poller_cpus,
        )  # fmt: skip

    def arm(self, tokens: int) -> None:
        self.poller.arm(tokens, self.options.timeout)

    def publish_ids(self, layer: int, ids, graph: bool) -> None:
        """The layer's ids (``[T, 24]`` int64 on the device) into the pinned ids buffer, then its ``ids`` flag."""
        self.ids[layer][: ids.shape[0]].copy_(ids, non_blocking=True)
        if graph:
            self.ops.write(self.flags, self.slots[layer][IDS], 1)

    def rows(self, layer: int, tokens: int, dst, graph: bool) -> None:
        """Waits for the layer's ``rows`` flag and clears it, then copies the staging."""
        if graph:
            self.ops.wait(self.flags, self.slots[layer][ROWS], 1)
            self.ops.write(self.flags, self.slots[layer][ROWS], 0)
        staged_rows(self.step.staging[layer], tokens, dst)

    def host_ok(self, layer: int):
        at = self.slots[layer][OK]
        return self.flags.tensor[at : at + 1]

    def after_replay(self) -> None:
        """Policy ``fail`` (checked here, not where the results are read): waits for every layer's release
        (bounded by its deadline) and raises the first failed layer's error; otherwise returns at once."""
        if self.options.policy == "fail" and not self.options.results_check:
            self.poller.after_replay(self.options.timeout)

    def reset(self) -> None:
        self.poller.reset()

    def buffers(self) -> dict:
        return {f"staging.{layer}": t.data_ptr() for layer, t in self.step.staging.items()}

    def close(self) -> None:
        for _ids, rows, _ok in self.slots.values():
            self.flags.host[rows] = 1  # a graph replayed after this waits for nobody
        self.poller.close()
        self.step.abandon()
