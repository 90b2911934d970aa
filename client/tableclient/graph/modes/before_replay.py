"""Graph mode ``before_replay``: the engine computes the step's row ids before it replays the graph (SGLang: with
its own non-committing hash kernel); :meth:`BeforeReplayMode.before_replay` gathers every such layer into its
staging, shortest window first, and returns once the rows are in place (failure policy applied). The graph holds
only the copy staging -> device and what reads it. Works for any layer and placement; the GPU waits for the
gather before the step starts (what the step costs)."""

from __future__ import annotations

import time

from tableclient.errors import TableClientError
from tableclient.graph.modes import Mode, staged_rows
from tableclient.metrics import metrics
from tableclient.step import EngramStep


class BeforeReplayMode(Mode):
    """The ``before_replay`` layers of ``plans``, gathered through one EngramStep (:attr:`step`)."""

    name = "before_replay"

    def __init__(self, torch, client, plans: list, options, device, max_tokens: int, common: dict):
        super().__init__([p.layer for p in sorted(plans, key=lambda p: p.window_s)])
        self.options = options
        #: the layers' EngramStep: their staging (pinned host ``[max_tokens, 24, row_bytes]``) and gathers
        self.step = EngramStep(client, plans, max_tokens, **common)
        for staging in self.step.staging.values():  # a padded bucket's rows copy what is there: zeros, then
            staging.zero_()  # earlier steps'
        rows = max_tokens * options.rows_per_token
        self.device_rows = {
            layer: torch.zeros((rows, self.step.staging[layer].shape[-1]), dtype=torch.uint8, device=device)
            for layer in self.layers
        }
        # per layer whether this step's rows are the table's (1) or the policy's (0), written before the replay
        self._index = {layer: i for i, layer in enumerate(sorted(self.layers))}
        self._ok = torch.ones(max(len(self.layers), 1), dtype=torch.int32, pin_memory=common["pin"])
        m = metrics()
        self._waits = {layer: m.graph_waits.labels(str(layer), "before_replay") for layer in self.layers}
        self._zero_steps = {layer: m.zero_rows.labels(str(layer)) for layer in self.layers if options.results_check}

    def before_replay(self, row_ids: dict) -> None:
        """Every layer's rows for this step (``row_ids[layer]``: host ``[T, 24]`` ids of the step's real tokens)
        gathered into its staging, shortest window first; returns once all are in place (the failure policy
        applied per layer; under ``results_check`` a failed layer's step runs on zeros, its outcome 0)."""
        pre = self.step
        t0 = time.perf_counter()
        pre.begin_step({layer: row_ids[layer] for layer in pre.tables})
        for layer in list(pre.issue_order):
            zeros = pre.stats[layer].zeros_served
            ok = 1
            try:
                pre.wait(layer)
            except (TableClientError, TimeoutError, OSError):
                if not self.options.results_check:
                    raise
                # policy fail, checked where the results are read: the step runs (on every rank) on zeros
                pre.staging[layer][: len(row_ids[layer])].zero_()
                self._zero_steps[layer].inc()  # a step served zero rows (the metric counts steps)
                ok = 0
            else:
                ok = int(pre.stats[layer].zeros_served == zeros)
            self._ok[self._index[layer]] = ok
            self._waits[layer].observe(time.perf_counter() - t0)

    def rows(self, layer: int, tokens: int, dst, graph: bool) -> None:
        staged_rows(self.step.staging[layer], tokens, dst)

    def host_ok(self, layer: int):
        i = self._index[layer]
        return self._ok[i : i + 1]

    def buffers(self) -> dict:
        return {f"staging.{layer}": t.data_ptr() for layer, t in self.step.staging.items()}

    def close(self) -> None:
        self.step.abandon()
