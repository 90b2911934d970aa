"""Graph mode ``device``: for a table this process maps (a ``node`` layer: this host's daemon's sealed memfd), the
table is registered with CUDA read-only (:mod:`tableclient.graph.device.table`) and the graph gathers the rows
itself, with a kernel on a side stream forked right after the hasher, one event per layer that the layer waits
on. No poller, flags or watchdog, and no CPU at replay but :meth:`DeviceMode.check`'s look that the table mapped
now is the one registered (a restarted daemon's is registered anew, the device-side pointer rewritten without
recapture; while none is mapped the policy applies: zeros, or ``fail`` refuses the step). A table that cannot be
registered (one line why) takes ``before_replay`` (:attr:`DeviceMode.unavailable`); so does policy
``fallback``, whose rows come from another server."""

from __future__ import annotations

import logging

from tableclient.graph.device.table import DeviceTable, DeviceTableUnavailable, gather
from tableclient.graph.errors import GraphStepError
from tableclient.graph.modes import Mode
from tableclient.metrics import metrics

log = logging.getLogger(__name__)


class DeviceMode(Mode):
    """The ``device`` layers of ``plans``. ``tables`` (table name -> DeviceTable): registered by the caller
    already (the ranks agreed on them at start-up), used as they are and left to the caller to close."""

    name = "device"

    def __init__(self, torch, client, plans: list, options, device, max_tokens: int):
        self.torch, self.device, self.max_tokens, self.options = torch, device, max_tokens, options
        #: layer -> its registered table
        self.tables: dict[int, DeviceTable] = {}
        #: the layers whose table could not be registered: they take before_replay
        self.unavailable: list[int] = []
        self._borrowed = set()
        given = options.tables or {}
        for p in plans:
            if given.get(p.table) is not None:
                self.tables[p.layer] = given[p.table]
                self._borrowed.add(p.layer)
                continue
            try:
                if options.policy == "fallback":
                    raise DeviceTableUnavailable("policy 'fallback' gathers on the host")
                self.tables[p.layer] = DeviceTable(client, p.table, device, torch=torch, register=options.register)
            except DeviceTableUnavailable as e:
                log.warning(
                    "layer %d: graph mode 'device' unavailable (%s): its rows are gathered before_replay", p.layer, e
                )
                self.unavailable.append(p.layer)
        super().__init__([p.layer for p in plans if p.layer in self.tables])
        rows = max_tokens * options.rows_per_token
        self.device_rows = {
            layer: torch.zeros((rows, t.row_bytes), dtype=torch.uint8, device=device)
            for layer, t in self.tables.items()
        }
        #: layer -> its ids on the device, ``[max_tokens, 24]`` int64 (the kernel's input)
        self.ids = {
            layer: torch.zeros((max_tokens, options.rows_per_token), dtype=torch.int64, device=device)
            for layer in self.tables
        }
        # the kernels run on a side stream forked after the hasher, one event per layer
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda and options.side_stream and self.tables else None
        self._gathered = {layer: torch.cuda.Event() for layer in self.tables} if self._side is not None else {}
        self._unreadable: dict[int, str] = {}  # layers served zeros now (policy zeros): why
        self._zero_rows = {layer: metrics().zero_rows.labels(str(layer)) for layer in self.tables}

    def check(self, tokens: int) -> None:
        """Every layer's table mapped now is the one its kernel reads (a table mapped anew is registered and its
        pointer rewritten). A table not readable now (its node down) gets the policy: zeros are served (counted,
        logged once per outage), or under ``fail`` GraphStepError before the replay."""
        failed = []
        for layer, table in self.tables.items():
            if table.refresh():
                if self._unreadable.pop(layer, None) is not None:
                    log.warning(
                        "layer %d: table %r readable again: its rows are gathered by the graph", layer, table.name
                    )
                continue
            if layer not in self._unreadable:
                self._unreadable[layer] = table.error
                log.warning("layer %d: table %r is %s (policy %s)", layer, table.name, table.error, self.options.policy)
            if self.options.policy == "fail" and not self.options.results_check:
                failed.append(f"layer {layer}: table {table.name!r} is {table.error}")
            else:  # zeros, or fail checked where the results are read (the kernel serves zeros, ok 0)
                self._zero_rows[layer].inc()  # a step served zero rows (the metric counts steps)
        if failed:
            raise GraphStepError(f"{failed[0]}: the step is not run (policy fail)")

    def publish_ids(self, layer: int, ids, graph: bool) -> None:
        """The layer's ids to its device ids buffer, and its kernel gathers them from the registered table into
        the layer's device rows, on the side stream (forked here from the current one; :meth:`rows` joins it),
        so the gather overlaps every layer before it."""
        table = self.tables[layer]
        tokens = ids.shape[0]
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens in a step, this GraphStep holds {self.max_tokens}")
        dst = self.ids[layer][:tokens]
        dst.copy_(ids.reshape(dst.shape))  # persistent, on the current stream: the side stream reads it
        out = self.device_rows[layer]
        if self._side is None:
            gather(table, dst, out)
            return
        torch = self.torch
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            gather(table, dst, out)
            self._gathered[layer].record(self._side)

    def rows(self, layer: int, tokens: int, dst, graph: bool) -> None:
        if self._side is not None:  # the kernel wrote them: the layer waits for its event
            self.torch.cuda.current_stream(self.device).wait_event(self._gathered[layer])

    def write_ok(self, layer: int, ok, scratch) -> None:
        ok.copy_(self.tables[layer].pointer.ne(0))  # the kernel serves zeros where no table is mapped

    def buffers(self) -> dict:
        return {f"table.{layer}": t.pointer.data_ptr() for layer, t in self.tables.items()}

    def close(self) -> None:
        for layer, table in self.tables.items():
            if layer not in self._borrowed:
                table.close()
