"""Each step's outcome, across ranks: what the graph keeps of whether every layer served the table's rows.

Ranks agree (``agree``) and policy ``fail`` is checked where the results are read (``results_check``): each layer's
rows-ok (the table's rows, or the policy's) is reduced over the tensor-parallel ranks inside the graph and the rows
masked by it, so all ranks serve the table's rows or all the policy's; the graph keeps each step's outcome (OUTCOMES
steps) for :meth:`Outcomes.check`, which an engine calls where it reads the step's results: nothing of ``fail``
raises on the launch path, where a rank alone would leave its peers waiting in the collective."""

from __future__ import annotations

from tableclient.graph.errors import GraphStepError
from tableclient.metrics import metrics

#: steps whose outcome (:meth:`Outcomes.check`) is held at once: the one read and those launched after it
OUTCOMES = 4


def min_from_sum(all_reduce_sum, ranks: int):
    """An ``agree`` for a GraphStep from an engine's own capturable all-reduce (a SUM over its tensor parallel
    group, in place or returning the sum): each rank's 1.0 (rows ok) or 0.0, reduced to 1.0 only where every one
    of the ``ranks`` ranks has 1.0 (their minimum)."""

    def agree(ok):
        total = all_reduce_sum(ok)
        total = ok if total is None else total
        return (total > ranks - 0.5).to(ok.dtype)

    return agree


class Outcomes:
    """Per layer whether its rows were the table's here (``ok``) and on every rank (``agree``'s reduction), in a
    ring of OUTCOMES steps on the device, mirrored to pinned host memory by the graph itself; ``steps`` counts the
    arms (a step's number)."""

    def __init__(self, torch, device, layers: list, policy: str, agree=None, results_check: bool = False,
                 pin: bool = False):  # fmt: skip
        self.torch, self.policy, self._agree = torch, policy, agree
        #: the engine calls check(step) where it reads a step's results: policy fail's check moves there
        self.results_check = bool(results_check or agree is not None)
        self.steps = 0
        self._tracked = sorted(layers)  # model order: the first of them starts a step's entry
        if not self.results_check:
            return
        self._ok_in = {layer: torch.ones(1, dtype=torch.int32, device=device) for layer in layers}
        self._ok = {layer: torch.ones(1, dtype=torch.float32, device=device) for layer in layers}
        self._ok_all = {layer: torch.ones(1, dtype=torch.float32, device=device) for layer in layers}
        self._count = torch.zeros(1, dtype=torch.int64, device=device)  # steps the graph ran
        self._cursor = torch.zeros(1, dtype=torch.int64, device=device)
        # per step: its number, then per layer (model order) ok here and ok on every rank
        self._ring = torch.zeros((OUTCOMES, 1 + 2 * len(self._tracked)), dtype=torch.int64, device=device)
        self._ring_host = torch.zeros(self._ring.shape, dtype=torch.int64, pin_memory=pin)
        self._ring_np = self._ring_host.numpy()
        self._zero_steps = {layer: metrics().zero_rows.labels(str(layer)) for layer in layers}

    def next_step(self) -> int:
        """An arm: the step's number."""
        self.steps += 1
        return self.steps

    def track(self, layer: int, dst, mode) -> None:
        """(the graph's side, after a layer's rows are in place in ``dst``) its ok here (``mode.write_ok``),
        reduced over the ranks, the rows masked by it (every rank serves the table's rows or all the policy's),
        and both into this step's outcome entry."""
        torch = self.torch
        ok = self._ok[layer]
        mode.write_ok(layer, ok, self._ok_in[layer])
        agreed = ok
        if self._agree is not None:
            agreed = self._ok_all[layer]
            agreed.copy_(ok)  # the reduction may be in place: ok stays this rank's own
            agreed = self._agree(agreed)
            dst.mul_(agreed.to(torch.uint8))
        i = self._tracked.index(layer)
        if i == 0:
            self._count.add_(1)
            torch.remainder(self._count, OUTCOMES, out=self._cursor)
            self._ring[:, 0].index_copy_(0, self._cursor, self._count)
        self._ring[:, 1 + 2 * i].index_copy_(0, self._cursor, ok.to(torch.int64))
        self._ring[:, 2 + 2 * i].index_copy_(0, self._cursor, agreed.to(torch.int64))
        self._ring_host.copy_(self._ring, non_blocking=True)

    def check(self, step: int) -> None:
        """Where the engine reads step ``step``'s results: with ``results_check``, whether every layer served the
        table's rows on every rank. Policy ``fail``: GraphStepError naming the first layer that did not (the step's
        output must not be read; every rank raises alike); other policies: the steps a peer's failure masked are
        counted as zero rows."""
        if not self.results_check:
            return
        row = self._ring_np[step % OUTCOMES]
        if int(row[0]) != step:
            raise GraphStepError(
                f"step {step}'s outcome is not held (entry of step {int(row[0])}; {self.steps} armed): check a "
                f"step's results before its replay is {OUTCOMES - 1} launches old, and only steps whose graph ran"
            )
        bad = []
        for i, layer in enumerate(self._tracked):
            here, agreed = int(row[1 + 2 * i]), int(row[2 + 2 * i])
            if agreed:
                continue
            bad.append((layer, here))
            if here and self.policy != "fail":
                self._zero_steps[layer].inc()  # served zeros here because another rank could not serve its rows
        if bad and self.policy == "fail":
            layer, here = bad[0]
            where = "on another rank" if here else "here"
            raise GraphStepError(
                f"layer {layer}: step {step}'s rows were not served {where} (policy fail: the step's output must "
                "not be read)"
            )

    def reset(self) -> None:
        """After a replay that may not have run: the next replay's entry is the next arm's step."""
        if self.results_check:
            self._count.fill_(self.steps)
