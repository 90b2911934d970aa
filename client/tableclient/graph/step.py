"""Graph-safe steps: served layers' rows inside a captured decode step (a CUDA graph).

A captured graph replays fixed work on fixed addresses and runs no Python. So everything a graph
touches is allocated here, once, before capture: per served layer a staging buffer in pinned host
memory ``[max_tokens, 24, row_bytes]`` (its EngramStep's), a device buffer the graph copies it into,
and for ``in_graph`` layers a pinned buffer of row ids and two host-visible flags. After that no
method allocates anything a graph can see. Per layer, one of two modes:

* ``before_replay`` -- the engine computes the step's row ids before it replays the graph (SGLang:
  with its own non-committing hash kernel); :meth:`GraphStep.before_replay` gathers every such layer
  into its staging, shortest window first, and returns once the rows are in place (failure policy
  applied). The graph holds only the copy staging -> device and what reads it. Works for any layer and
  placement; the GPU waits for the gather before the step starts (what the step costs).
* ``in_graph`` -- the graph publishes the ids itself: right after the hasher it copies the layer's ids
  into pinned memory and writes the layer's ``ids`` flag; a poller thread of this process, which waits
  for the flag without the GIL (``tableclient.graph._flags``), gathers them into the staging and writes the
  ``rows`` flag; the graph waits for that just before the layer's copy. The gather overlaps every layer
  before it (layer 14's rows travel while layers 0..13 run). The GPU never waits forever: a watchdog
  releases the flag at the layer's timeout, with zeros or the fallback's rows in the staging (policies
  ``zeros``, ``fallback``; the fallback's own gather adds its time), or with zeros and the step
  poisoned (``fail``: :meth:`after_replay` raises, before the engine reads the step's output). The
  poller waits for the flag natively, but its gather is Python: behind a thread that holds the GIL it
  starts up to one switch interval (``sys.getswitchinterval()``, 5 ms by default) late --
  ``bench/bench_graph.py`` measures the wake-up with a busy Python thread beside it.
* ``device`` -- for a table this process maps (a ``node`` layer: this host's daemon's sealed memfd):
  the table is registered with CUDA read-only (:mod:`tableclient.graph.device.table`) and the graph gathers
  the rows itself, with a kernel on a side stream forked right after the hasher, one event per layer
  that the layer waits on. No poller, flags or watchdog, and no CPU at replay but :meth:`arm`'s check
  that the table mapped now is the one registered (a restarted daemon's is registered anew, the
  device-side pointer rewritten without recapture; while none is mapped the policy applies: zeros,
  or ``fail`` refuses the step). A table that cannot be registered (one line why) takes
  ``before_replay``; so does policy ``fallback``, whose rows come from another server.

Ranks agree (``agree``) and policy ``fail`` is checked where the results are read (``results_check``): each
layer's rows-ok (the table's rows, or the policy's) is reduced over the tensor-parallel ranks inside the
graph and the rows masked by it, so all ranks serve the table's rows or all the policy's; the graph keeps
each step's outcome (OUTCOMES steps) for :meth:`GraphStep.check`, which an engine calls where it reads the
step's results: nothing of ``fail`` raises on the launch path, where a rank alone would leave its peers
waiting in the collective.

Flag protocol. The values a graph writes and waits for are baked into it, so they are constants; per
``in_graph`` layer three uint32 (ids, rows, ok) in pinned, device-mapped host memory, a 64-byte line each::

    graph      copy ids -> ids buffer; write ids = 1; ...; wait rows == 1; write rows = 0; copy rows
    arm        (host, before replay) waits until the last step was released, its graph consumed the
               release (rows == 0) and any late ids flag of it was taken; then arms the next step
    poller     waits ids == 1; ids = 0; gathers the armed step's tokens into the staging; rows = 1
    watchdog   at the deadline, unless released: cancels the gather (a barrier), fills, rows = 1

Only one of poller and watchdog releases a step, and only the step it was decided for (a lock, a
state and a step number); a step released before its graph published the ids owes that flag, which
the poller then takes without gathering; ids of a replay nobody armed are released at once with zeros. The stream's side is
:mod:`tableclient.graph.streams`: :class:`CudaStreamOps` (captured as graph memory-operation nodes, after
a start-up probe on the device) or :class:`HostStreamOps` (the host, in the calling thread).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from tableclient.bounds import check_timeout
from tableclient.errors import GatherTimeout, TableClientError
from tableclient.graph.device.table import DeviceTable, DeviceTableUnavailable, gather
from tableclient.graph.errors import GraphStepError
from tableclient.graph.poller.native import SILENT, NativePoller, NativeUnavailable
from tableclient.graph.poller.silence import Silence
from tableclient.graph.streams import CudaStreamOps, GraphFlags, HostStreamOps, wait_flag
from tableclient.metrics import metrics
from tableclient.step import EngramStep, LayerPlan

log = logging.getLogger(__name__)

MODES = ("before_replay", "in_graph", "device")


def gather_budget(window_s: float) -> float:
    """How long an in_graph layer's gather may take once the graph published its ids, by default: four
    windows, at least 5 ms (layer 1: 5 ms, layer 14: 37 ms). The rows are due one window after the ids;
    a gather several windows late is a node in trouble, and each step then stalls the GPU this long at
    most (with the policy's rows), not for the whole ``timeout``, which bounds only a replay whose ids
    never come."""
    return max(4.0 * window_s, 0.005)


IDS, ROWS, OK = 0, 1, 2
#: steps whose outcome (:meth:`GraphStep.check`) is held at once: the one read and those launched after it
OUTCOMES = 4
__all__ = [
    "GraphStep", "GraphStepError", "HostStreamOps", "CudaStreamOps", "GraphFlags", "MODES", "OUTCOMES", "wait_flag",
    "min_from_sum",
]  # fmt: skip


def min_from_sum(all_reduce_sum, ranks: int):
    """An ``agree`` for :class:`GraphStep` from an engine's own capturable all-reduce (a SUM over its tensor
    parallel group, in place or returning the sum): each rank's 1.0 (rows ok) or 0.0, reduced to 1.0 only where
    every one of the ``ranks`` ranks has 1.0 (their minimum)."""

    def agree(ok):
        total = all_reduce_sum(ok)
        total = ok if total is None else total
        return (total > ranks - 0.5).to(ok.dtype)

    return agree


class _Done:
    """A gather with nothing to read (every id of the step dead): done at once."""

    def wait(self, timeout=None) -> None:
        return None

    def cancel(self) -> None:
        return None


@dataclass
class _Slot:
    """One in_graph layer's step state: idle -> armed -> gathering -> released (or watchdog -> released)."""

    layer: int
    plan: LayerPlan
    ids_flag: int
    rows_flag: int
    state: str = "idle"
    tokens: int = 0
    deadline: float = 0.0
    handle: object = None
    error: BaseException | None = None
    seen: float = 0.0  # perf_counter() when the graph's ids were seen
    step: int = 0  # bumped by every arm: a release is for the step it was decided for, never a later one
    owe_ids: bool = False  # released before its graph published the ids: that late flag is not a new step's
    released_at: float = 0.0  # time.monotonic() of the last release
    live: object = None  # this step's live ids' positions, where some ids are dead (gathered into scratch)
    ok_flag: int = -1  # the host flag saying whether the released rows are the table's (1) or the policy's (0)
    silence: Silence | None = None  # whether its node answers since a step's rows did not come after its ids
    node: object = None  # the node the step in progress reads (None: a mapping here, or routed)


class GraphStep:
    """Everything captured decode graphs touch for the served layers of one client, and the host side of
    each step (see the module docstring)."""

    def __init__(self, client, plans: list, modes: dict, max_tokens: int, *, rows_per_token: int = 24,
                 policy: str = "fail", fallback=None, device=None, timeout: float = 5.0, stream_ops=None,
                 pin: bool | None = None, side_stream: bool = True, register: bool = True,
                 poller: str = "auto", realtime: bool = False, budgets: dict | None = None, agree=None,
                 results_check: bool = False, dead_id: int | None = None, poller_cpus: list | None = None,
                 tables: dict | None = None):  # fmt: skip
        import torch

        self.torch = torch
        self.modes = {p.layer: modes.get(p.layer, "before_replay") for p in plans}
        for layer, mode in self.modes.items():
            if mode not in MODES:
                raise ValueError(f"layer {layer}: unknown graph mode {mode!r}: use {', '.join(MODES)}")
        timeout = check_timeout("timeout", timeout)  # a deadline of inf would be one already passed, natively
        self.max_tokens, self.rows_per_token, self.timeout, self.policy = max_tokens, rows_per_token, timeout, policy
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        cuda = self.device.type == "cuda"
        pin = cuda if pin is None else pin
        # device layers: the table registered for the graph's own kernel, or (one line why) the host path;
        # ``tables`` (table name -> DeviceTable): registered by the caller already (the ranks agreed on them at
        # start-up), used as they are and left to the caller to close
        self.device_tables: dict[int, DeviceTable] = {}
        self._borrowed = set()
        for p in plans:
            if self.modes[p.layer] != "device":
                continue
            if (tables or {}).get(p.table) is not None:
                self.device_tables[p.layer] = tables[p.table]
                self._borrowed.add(p.layer)
                continue
            try:
                if policy == "fallback":
                    raise DeviceTableUnavailable("policy 'fallback' gathers on the host")
                self.device_tables[p.layer] = DeviceTable(client, p.table, self.device, torch=torch, register=register)
            except DeviceTableUnavailable as e:
                log.warning(
                    "layer %d: graph mode 'device' unavailable (%s): its rows are gathered before_replay", p.layer, e
                )
                self.modes[p.layer] = "before_replay"
        common = dict(
            rows_per_token=rows_per_token, policy=policy, fallback=fallback, pin=pin, timeout=timeout, dead_id=dead_id
        )
        self.dead_id = dead_id  # an engine's padding marker (vLLM's DEAD_ID): never read nor sent, zero rows
        pre = [p for p in plans if self.modes[p.layer] == "before_replay"]
        post = sorted((p for p in plans if self.modes[p.layer] == "in_graph"), key=lambda p: p.window_s)
        self.pre = EngramStep(client, pre, max_tokens, **common) if pre else None
        self.post = EngramStep(client, post, max_tokens, deadlines=False, **common) if post else None
        self.layers = [p.layer for p in sorted(plans, key=lambda p: p.window_s)]
        self._owner = {p.layer: self.pre for p in pre} | {p.layer: self.post for p in post}
        for step in (self.pre, self.post):  # a padded bucket's rows copy what is there: zeros, then earlier steps'
            for staging in step.staging.values() if step is not None else ():
                staging.zero_()
        self._staging_np = {layer: owner.staging[layer].numpy() for layer, owner in self._owner.items()}
        row_bytes = {layer: owner.staging[layer].shape[-1] for layer, owner in self._owner.items()}
        row_bytes |= {layer: t.row_bytes for layer, t in self.device_tables.items()}
        # the device side: one packed buffer per layer, the copy's (or the kernel's) fixed destination
        self.device_rows = {
            layer: torch.zeros((max_tokens * rows_per_token, row_bytes[layer]), dtype=torch.uint8, device=self.device)
            for layer in self.layers
        }
        self.ids = {p.layer: torch.zeros((max_tokens, rows_per_token), dtype=torch.int64, pin_memory=pin) for p in post}
        self.ids |= {
            layer: torch.zeros((max_tokens, rows_per_token), dtype=torch.int64, device=self.device)
            for layer in self.device_tables
        }
        self._ids_np = {p.layer: self.ids[p.layer].numpy() for p in post}
        # Python's poller with dead ids: the live ids' rows land here, then spread into the staging
        self._scratch = {
            p.layer: np.empty((max_tokens * rows_per_token, row_bytes[p.layer]), dtype=np.uint8)
            for p in (post if dead_id is not None else ())
        }
        # device layers' kernels run on a side stream forked after the hasher, one event per layer
        self._side = torch.cuda.Stream(self.device) if cuda and side_stream and self.device_tables else None
        self._gathered = {layer: torch.cuda.Event() for layer in self.device_tables} if self._side is not None else {}
        self._unreadable: dict[int, str] = {}  # device layers served zeros now (policy zeros): why
        self.flags = GraphFlags(torch, len(post), pin)
        self.ops = (
            stream_ops
            if stream_ops is not None
            else (CudaStreamOps(torch, self.device) if cuda and post else HostStreamOps(timeout * 4))
        )
        if isinstance(self.ops, CudaStreamOps):
            self.flags.device_ptr(self.ops, 0)  # resolved now, not inside the first capture
        self._slots = {
            p.layer: _Slot(p.layer, p, self.flags.index(i, IDS), self.flags.index(i, ROWS), ok_flag=self.flags.index(i, OK),
                           silence=Silence(client.table(p.table), client.tables[p.table].rows, row_bytes[p.layer]))
            for i, p in enumerate(post)
        }  # fmt: skip
        self._outcomes_init(agree, results_check, pin)
        budgets = budgets or {}
        #: per in_graph layer: seconds its gather may take once its ids came (gather_budget(window) by default)
        self.budgets = {p.layer: float(budgets.get(p.layer, gather_budget(p.window_s))) for p in post}
        for layer, budget in self.budgets.items():
            if not 0 <= budget <= 1e6:
                raise ValueError(f"layer {layer}: a gather budget of {budget!r} s: use 0 (the deadline alone) to 1e6")
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._closed = False
        m = metrics()
        self._waits = {
            (layer, phase): m.graph_waits.labels(str(layer), phase)
            for layer in self.layers
            for phase in ("before_replay", "in_graph")
        }
        self._zero_rows = {layer: m.zero_rows.labels(str(layer)) for layer in self.device_tables}
        self._watchdog_releases = {layer: m.watchdog_releases.labels(str(layer)) for layer in self._slots}
        self._misses = {layer: m.deadline_misses.labels(str(layer)) for layer in self._slots}
        # in_graph layers: the native poller where it can serve them (poller "auto"), else Python's threads
        if poller not in ("auto", "native", "python"):
            raise ValueError(f"poller {poller!r}: use auto, native or python")
        self._native = None
        if self._slots and poller != "python":
            slots = [(s.plan, s.ids_flag, s.rows_flag, s.ok_flag, self._ids_np[s.layer], self._staging_np[s.layer])
                     for s in self._slots.values()]  # fmt: skip
            try:
                self._native = NativePoller(
                    client, slots, self.flags.host, policy, connect_timeout=timeout, realtime=realtime,
                    budgets=[self.budgets[s.layer] for s in self._slots.values()], dead_id=dead_id, cpus=poller_cpus,
                )  # fmt: skip
            except NativeUnavailable as e:
                if poller == "native":
                    raise
                log.info("in_graph layers %s: the Python poller (%s)", sorted(self._slots), e)
            else:
                log.info(
                    "in_graph layers %s: the native poller (no GIL on the hot path; %s; %s)",
                    sorted(self._slots),
                    "real-time priority"
                    if self._native.realtime
                    else "normal priority: grant CAP_SYS_NICE or an "
                    "rtprio limit (ulimit -r 1) for a shorter tail on busy cores",
                    f"pinned to CPU {self._native.cpu}"
                    if self._native.cpu is not None
                    else "not pinned: set poller_cpus to cores kept free of the engine"
                    if not poller_cpus
                    else f"not pinned: {self._native.cpu_note}",
                )
        self._threads = [
            threading.Thread(target=self._poll, args=(s,), name=f"tableclient-graph-{s.layer}", daemon=True)
            for s in self._slots.values()
            if self._native is None
        ]
        if self._slots and self._native is None:
            self._threads.append(
                threading.Thread(target=self._watchdog, name="tableclient-graph-watchdog", daemon=True)
            )
        for t in self._threads:
            t.start()

    @property
    def poller(self) -> str | None:
        """Who serves the in_graph layers: "native" (one C thread, no GIL), "python", or None (none)."""
        return None if not self._slots else "native" if self._native is not None else "python"

    @property
    def poller_cpu(self) -> int | None:
        """The CPU the native poller's thread is pinned to (one of ``poller_cpus``), or None."""
        return None if self._native is None else self._native.cpu

    @property
    def poller_realtime(self) -> bool:
        """Whether the native poller's thread runs at real-time priority (asked for with ``realtime``)."""
        return self._native is not None and self._native.realtime

    # ------------------------------------------------------------------ each step's outcome, across ranks
    def _outcomes_init(self, agree, results_check: bool, pin: bool) -> None:
        """What the graph keeps of each step's outcome: per layer whether its rows were the table's here
        (``ok``) and on every rank (``agree``'s reduction), in a ring of OUTCOMES steps on the device, mirrored
        to pinned host memory by the graph itself, read by :meth:`check`."""
        torch = self.torch
        #: the engine calls check(step) where it reads a step's results: policy fail's check moves there
        self.results_check = bool(results_check or agree is not None)
        self._agree = agree
        self._steps = 0  # arms so far: a step's number (arm's return)
        self._tracked = sorted(self.layers)  # model order: the first of them starts a step's entry
        # before_replay layers' ok, written by the host before the replay
        self._pre_ok = torch.ones(len(self.layers), dtype=torch.int32, pin_memory=pin)
        if not self.results_check:
            return
        dev = self.device
        self._ok_in = {layer: torch.ones(1, dtype=torch.int32, device=dev) for layer in self.layers}
        self._ok = {layer: torch.ones(1, dtype=torch.float32, device=dev) for layer in self.layers}
        self._ok_all = {layer: torch.ones(1, dtype=torch.float32, device=dev) for layer in self.layers}
        self._count = torch.zeros(1, dtype=torch.int64, device=dev)  # steps the graph ran
        self._cursor = torch.zeros(1, dtype=torch.int64, device=dev)
        # per step: its number, then per layer (model order) ok here and ok on every rank
        self._ring = torch.zeros((OUTCOMES, 1 + 2 * len(self._tracked)), dtype=torch.int64, device=dev)
        self._ring_host = torch.zeros(self._ring.shape, dtype=torch.int64, pin_memory=pin)
        self._ring_np = self._ring_host.numpy()
        self._zero_steps = {layer: metrics().zero_rows.labels(str(layer)) for layer in self.layers}

    def _track(self, layer: int, dst) -> None:
        """(the graph's side, after a layer's rows are in place) its ok byte here, reduced over the ranks
        (``agree``), the rows masked by it (every rank serves the table's rows or all the policy's), and both
        into this step's outcome entry."""
        torch = self.torch
        table, slot = self.device_tables.get(layer), self._slots.get(layer)
        ok = self._ok[layer]
        if table is not None:
            ok.copy_(table.pointer.ne(0))  # the kernel serves zeros where no table is mapped
        else:
            host = self.flags.tensor[slot.ok_flag : slot.ok_flag + 1] if slot is not None else self._pre_ok[self._tracked.index(layer) : self._tracked.index(layer) + 1]  # fmt: skip
            self._ok_in[layer].copy_(host, non_blocking=True)  # a memcpy node: read at replay, not at capture
            ok.copy_(self._ok_in[layer])
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
        """Where the engine reads step ``step``'s results (``step`` from :meth:`arm`; its outputs computed, e.g.
        copied to the host): with ``results_check``, whether every layer served the table's rows on every rank.
        Policy ``fail``: GraphStepError naming the first layer that did not (the step's output must not be
        read; every rank raises alike); other policies: the steps a peer's failure masked are counted as zero
        rows. Call it for every replayed step, at most OUTCOMES - 1 steps after it was armed."""
        if not self.results_check:
            return
        row = self._ring_np[step % OUTCOMES]
        if int(row[0]) != step:
            raise GraphStepError(
                f"step {step}'s outcome is not held (entry of step {int(row[0])}; {self._steps} armed): check a "
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

    # ------------------------------------------------------------------ what a graph touches
    def buffers(self) -> dict:
        """name -> address of every buffer a captured graph reads or writes (fixed for this step's life)."""
        out = {f"staging.{layer}": owner.staging[layer].data_ptr() for layer, owner in self._owner.items()}
        out |= {f"device.{layer}": t.data_ptr() for layer, t in self.device_rows.items()}
        out |= {f"ids.{layer}": t.data_ptr() for layer, t in self.ids.items()}
        out |= {f"table.{layer}": t.pointer.data_ptr() for layer, t in self.device_tables.items()}
        out["flags"] = self.flags.tensor.data_ptr()
        return out

    def publish_ids(self, layer: int, ids, graph: bool = True) -> None:
        """The graph's side, right after the hasher: layer ``layer``'s ids (``[T, 24]`` int64 on the
        device, T the graph's tokens) into the pinned ids buffer, then its ``ids`` flag. ``graph=False``
        (an eager warm-up run of a capture) copies only: nobody is armed to answer.

        A ``device`` layer's ids go to its device ids buffer, and its kernel gathers them from the
        registered table into the layer's device rows, on the side stream (forked here from the current
        one; :meth:`rows` joins it), so the gather overlaps every layer before it. Call it for the
        layers in window order (layer 1 first): the side stream runs them in that order."""
        table = self.device_tables.get(layer)
        if table is not None:
            self._launch(layer, table, ids)
            return
        if layer not in self._slots:
            return
        self.ids[layer][: ids.shape[0]].copy_(ids, non_blocking=True)
        if graph:
            self.ops.write(self.flags, self._slots[layer].ids_flag, 1)

    def rows(self, layer: int, tokens: int, graph: bool = True):
        """The graph's side, where the layer reads its rows: ``[tokens * 24, row_bytes]`` uint8 on the
        device, copied from the staging (an in_graph layer first waits for its ``rows`` flag and clears
        it). ``graph=False``: the copy alone (an eager warm-up run)."""
        n = tokens * self.rows_per_token
        dst = self.device_rows[layer][:n]
        if layer in self.device_tables:
            if self._side is not None:
                self.torch.cuda.current_stream(self.device).wait_event(self._gathered[layer])
        else:
            slot = self._slots.get(layer)
            if slot is not None and graph:
                self.ops.wait(self.flags, slot.rows_flag, 1)
                self.ops.write(self.flags, slot.rows_flag, 0)
            dst.copy_(self._owner[layer].staging[layer][:tokens].view(dst.shape), non_blocking=True)  # 0 tokens too
        if graph and self.results_check:
            self._track(layer, dst)
        return dst

    def _launch(self, layer: int, table: DeviceTable, ids) -> None:
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

    def check_tables(self, tokens: int) -> None:
        """Before a replay (``arm`` calls it): every device layer's table mapped now is the one its kernel
        reads (a table mapped anew is registered and its pointer rewritten). A table not readable now
        (its node down) gets the policy: zeros are served (counted, logged once per outage), or under
        ``fail`` GraphStepError before the replay."""
        failed = []
        for layer, table in self.device_tables.items():
            if table.refresh():
                if self._unreadable.pop(layer, None) is not None:
                    log.warning(
                        "layer %d: table %r readable again: its rows are gathered by the graph", layer, table.name
                    )
                continue
            if layer not in self._unreadable:
                self._unreadable[layer] = table.error
                log.warning("layer %d: table %r is %s (policy %s)", layer, table.name, table.error, self.policy)
            if self.policy == "fail" and not self.results_check:
                failed.append(f"layer {layer}: table {table.name!r} is {table.error}")
            else:  # zeros, or fail checked where the results are read (the kernel serves zeros, ok 0)
                self._zero_rows[layer].inc()  # a step served zero rows (the metric counts steps)
        if failed:
            raise GraphStepError(f"{failed[0]}: the step is not run (policy fail)")

    # ------------------------------------------------------------------ the host, every step
    def before_replay(self, row_ids: dict) -> None:
        """Every before_replay layer's rows for this step (``row_ids[layer]``: host ``[T, 24]`` ids of
        the step's real tokens) gathered into its staging, shortest window first; returns once all are
        in place (the failure policy applied per layer). The caller sees to it that the last replay's
        copies out of the staging are done (SGLang's hook: copying the step's ids to the host waits for
        the stream, and with it for the last replay)."""
        self._check_open()
        if self.pre is None:
            return
        t0 = time.perf_counter()
        self.pre.begin_step({layer: row_ids[layer] for layer in self.pre.tables})
        for layer in list(self.pre.issue_order):
            zeros = self.pre.stats[layer].zeros_served
            ok = 1
            try:
                self.pre.wait(layer)
            except (TableClientError, TimeoutError, OSError):
                if not self.results_check:
                    raise
                # policy fail, checked where the results are read: the step runs (on every rank) on zeros
                self.pre.staging[layer][: len(row_ids[layer])].zero_()
                self._zero_steps[layer].inc()  # a step served zero rows (the metric counts steps)
                ok = 0
            else:
                ok = int(self.pre.stats[layer].zeros_served == zeros)
            self._pre_ok[self._tracked.index(layer)] = ok
            self._waits[(layer, "before_replay")].observe(time.perf_counter() - t0)

    def arm(self, tokens: int) -> int:
        """Before the replay of a step of ``tokens`` real tokens: every in_graph layer will gather that
        many of the ids the graph publishes, by the layer's timeout. Returns the step's number (for
        :meth:`check`). An engine may launch this step while
        the last one still runs on the GPU (SGLang's overlap scheduler): arm waits, bounded by the
        timeout, until the last step was released, its graph consumed the release (``rows == 0``), and
        a late ids flag of a step released before its ids came was consumed; GraphStepError past that
        (a replay armed and never launched: call :meth:`reset`), or at once once closed."""
        self._check_open()
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens in a step, this GraphStep holds {self.max_tokens}")
        if self.device_tables:
            self.check_tables(tokens)
        self._steps += 1
        if not self._slots:
            return self._steps
        end = time.monotonic() + self.timeout
        if self._native is not None:
            while self._native.busy():
                self._check_open()
                if time.monotonic() >= end:
                    raise GraphStepError(
                        f"layers {sorted(self._slots)}: the last step was not released and consumed within "
                        f"{self.timeout:g} s: a replay was armed and never launched (call reset() after a failed replay)"
                    )
                time.sleep(0.0002)  # the GPU's consumption notifies nobody: poll
            self._native.arm(tokens, self.timeout)  # the deadline taken after its sources were refreshed
            return self._steps
        host = self.flags.host
        with self._lock:
            while True:
                self._check_open()  # closed meanwhile: nobody would release this step
                busy = [
                    s
                    for s in self._slots.values()
                    if s.state not in ("idle", "released") or s.owe_ids or host[s.rows_flag] != 0
                ]
                if not busy:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    b = busy[0]
                    raise GraphStepError(
                        f"layer {b.layer}: the last step ({b.state}, rows flag {int(host[b.rows_flag])}) "
                        f"was not released and consumed within {self.timeout:g} s: a replay was "
                        "armed and never launched (call reset() after a failed replay)"
                    )
                self._released.wait(min(left, 0.0002))  # the GPU's consumption notifies nobody: poll
            deadline = time.monotonic() + self.timeout
            for slot in self._slots.values():
                slot.state, slot.tokens, slot.deadline, slot.handle, slot.error = "armed", tokens, deadline, None, None
                slot.live = None
                slot.step += 1
            self._released.notify_all()  # the watchdog's next deadline
        return self._steps

    def after_replay(self) -> None:
        """After the replay was launched. With policy ``fail``: waits for every in_graph layer's release
        (bounded by its timeout: the watchdog's) and raises the first layer's error, so a step with a
        failed layer is never read. Other policies, and ``results_check`` (the check is :meth:`check`'s, where
        the engine reads the step's results), return at once."""
        if not self._slots or self.policy != "fail" or self.results_check:
            return
        if self._native is not None:
            errors = self._native.wait_released(self.timeout + 1.0)
            if errors is None:
                raise GraphStepError("in_graph layers not released by their deadline: the native poller is stuck")
            if errors:
                layer, message = errors[0]
                raise GraphStepError(f"layer {layer}: {message} (policy fail: the step's output must not be read)")
            return
        with self._lock:
            end = max(s.deadline for s in self._slots.values()) + 1.0
            while any(s.state not in ("released", "idle") for s in self._slots.values()):
                left = end - time.monotonic()
                if left <= 0:
                    raise GraphStepError("in_graph layers not released by their deadline: the watchdog is stuck")
                self._released.wait(left)
            errors = [s.error for s in self._slots.values() if s.error is not None]
        if errors:
            raise errors[0]

    def silence(self, layer: int) -> Silence:
        """In_graph layer ``layer``'s silence (:mod:`tableclient.graph.poller.silence`), by either poller: whether its node has
        answered since a step ran out of time, and its probes."""
        if self._native is not None:
            return self._native.silence(layer)
        return self._slots[layer].silence

    def released_at(self, layer: int) -> float:
        """When in_graph layer ``layer``'s last step was released (time.monotonic()'s clock), by either
        poller: how long the rows took, for a stand-in of the GPU that notices the release late itself."""
        if self._native is not None:
            return self._native.released_at(layer)
        return self._slots[layer].released_at

    def account(self) -> None:
        """Folds what the native poller did into the metrics (waits, watchdog releases, zero rows): every
        arm does it for the steps before, off the hot path; call it before reading them right after a step."""
        if self._native is not None:
            self._native.account()

    def reset(self) -> None:
        """After a replay that was armed but may not have run (the engine's launch raised): waits for the
        device to finish what it queued, then clears every flag and step state. Once closed it leaves
        the flags as close released them (a replay waits for nobody)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        if self.results_check:
            self._count.fill_(self._steps)  # the next replay's entry is the next arm's step
        if self._native is not None:
            if not self._closed:
                self._native.reset()
            return
        with self._lock:
            if self._closed:
                return
            for slot in self._slots.values():
                handle, slot.handle = slot.handle, None
                if handle is not None:
                    handle.cancel()
                slot.state, slot.error, slot.owe_ids = "idle", None, False
                slot.step += 1  # nothing decided before the reset applies after it
                self.flags.host[slot.ids_flag] = self.flags.host[slot.rows_flag] = 0
            self._released.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise GraphStepError(
                "this GraphStep is closed: no poller or watchdog would release a step armed now; build a new "
                "GraphStep (and capture the graphs that use it again)"
            )

    # ------------------------------------------------------------------ poller and watchdog
    def _poll(self, slot: _Slot) -> None:
        flags, table = self.flags.host, self.post.tables[slot.layer]
        staging, ids = self._staging_np[slot.layer], self._ids_np[slot.layer]
        while not self._closed:
            if not wait_flag(flags, slot.ids_flag, 1, 0.1):
                continue
            flags[slot.ids_flag] = 0
            seen = time.perf_counter()
            error = None
            with self._lock:
                if slot.owe_ids:  # the late ids of a step the watchdog released before they came
                    slot.owe_ids = False
                    self._released.notify_all()
                    continue
                if slot.state != "armed":  # a replay nobody armed: released with zeros, the GPU never hangs
                    log.error(
                        "layer %d: a graph published ids of a step nobody armed: released with zero rows "
                        "(the engine must call arm() before each replay)",
                        slot.layer,
                    )
                    staging.fill(0)
                    self._release(slot, GraphStepError(f"layer {slot.layer}: step not armed"), ok=False)
                    continue
                slot.state, slot.seen, tokens, step = "gathering", seen, slot.tokens, slot.step
                if self.budgets[slot.layer] > 0:  # the gather's own deadline, from its ids: the watchdog's
                    slot.deadline = min(slot.deadline, time.monotonic() + self.budgets[slot.layer])
                    self._released.notify_all()
                want, into = ids[:tokens], staging[:tokens]
                slot.live = None
                silent = self._silent(slot)
                if silent is not None:  # its node has not answered since a step ran out of time: no wait
                    want = want[:0]
                    error = silent
                if self.dead_id is not None:  # the live ids only, into the scratch; spread before the release
                    flat = want.reshape(-1)
                    dead = flat == self.dead_id
                    if dead.any():
                        slot.live = np.flatnonzero(~dead)
                        want = flat[slot.live]
                        into = self._scratch[slot.layer][: want.size]
                try:  # issued under the lock: a watchdog taking the step over always finds (and cancels) it
                    slot.handle = table.gather_async(want, out=into) if error is None and want.size else _Done()
                except (TableClientError, TimeoutError, OSError, ValueError) as e:
                    slot.handle, error = None, e
                handle = slot.handle
            while error is None:
                try:
                    handle.wait(0.05)
                    break
                except GatherTimeout:  # the deadline is the watchdog's: it cancels and releases
                    if slot.state != "gathering" or slot.step != step:
                        break
                except (TableClientError, TimeoutError, OSError, ValueError) as e:
                    error = e
            self._finish(slot, step, tokens, error, by_watchdog=False)

    def _finish(self, slot: _Slot, step: int, tokens: int, error: BaseException | None, by_watchdog: bool) -> None:
        """Fills a failed step by the policy and releases it: only step ``step``, and only if the other side
        has not taken it."""
        with self._lock:
            if slot.step != step or slot.state not in (("armed", "gathering") if by_watchdog else ("gathering",)):
                return
            ids_late = by_watchdog and slot.state == "armed"
            if ids_late:
                slot.owe_ids = True  # released before its graph published the ids: their flag comes later
            elif by_watchdog and slot.silence.late(slot.node):  # its ids came, its rows did not: the node's time
                log.warning(SILENT, slot.layer)
            slot.state = "serving"  # ours to release: the other side leaves it alone
            handle, slot.handle = slot.handle, None
        if error is not None and handle is not None:
            handle.cancel()  # a barrier: none of a failed or late gather's rows land after this
        if ids_late:
            log.warning("layer %d: the graph's ids did not come by the deadline: the watchdog releases the step "
                        "(%s)", slot.layer, self.policy)  # fmt: skip
        elif by_watchdog:
            log.warning("layer %d: rows not in place %.1f ms after the graph's ids (the gather's budget or the "
                        "step's deadline): the watchdog releases the step (%s)", slot.layer,
                        (time.perf_counter() - slot.seen) * 1e3, self.policy)  # fmt: skip
        staging = self._staging_np[slot.layer][:tokens]
        view, want, live = staging, self._ids_np[slot.layer][:tokens], slot.live
        if live is not None:  # some ids dead: their live ones were gathered into the scratch
            view, want = self._scratch[slot.layer][: live.size], want.reshape(-1)[live]
        poison = None
        if error is not None:
            try:
                if self.policy == "fail":
                    raise error
                self.post.on_failure(slot.layer, view, want.copy(), error)
            except BaseException as e:  # fail, or the fallback failed too: zeros, and the step is poisoned
                staging.fill(0)
                poison = e
        if poison is None and live is not None:  # the live rows to their places, the dead ones zero
            flat = staging.reshape(-1, staging.shape[-1])
            got = view.copy()
            flat.fill(0)
            flat[live] = got
        with self._lock:
            # the rows are the table's unless the policy filled them (a fallback's rows are the table's too)
            self._release(slot, poison, ok=error is None or (self.policy == "fallback" and poison is None))
            if by_watchdog:
                self._watchdog_releases[slot.layer].inc()
            else:
                elapsed = time.perf_counter() - slot.seen
                self._waits[(slot.layer, "in_graph")].observe(elapsed)
                if elapsed > slot.plan.window_s:
                    self._misses[slot.layer].inc()

    def _release(self, slot: _Slot, error: BaseException | None, ok: bool) -> None:
        """(lock held) The staging holds the step's rows (the table's: ``ok``): the graph may copy them."""
        slot.error, slot.state = error, "released"
        slot.released_at = time.monotonic()
        self.flags.host[slot.ok_flag] = int(ok)
        self.flags.host[slot.rows_flag] = 1
        self._released.notify_all()

    def _silent(self, slot: _Slot) -> GatherTimeout | None:
        """(lock held) Why ``slot``'s step gets the policy at once: its node has not answered since one of its
        steps ran out of time (:mod:`tableclient.graph.poller.silence`: until a probe is answered); None once it has. Notes
        the node the step reads (``slot.node``): None where this process maps the table, which is never silent."""
        route = self.post.client.reader(slot.plan.table).route()
        slot.node = route.node if route.local is None else None
        if not slot.silence.silent(slot.node):
            return None
        return GatherTimeout(
            f"layer {slot.layer}: its node has not answered since a step ran out of time (the policy at once)"
        )

    def _watchdog(self) -> None:
        while not self._closed:
            with self._lock:
                live = [s for s in self._slots.values() if s.state in ("armed", "gathering")]
                now = time.monotonic()
                due = [(s, s.step, s.tokens) for s in live if s.deadline <= now]
                if not due:
                    wait = min((s.deadline for s in live), default=now + 0.5) - now
                    self._released.wait(min(max(wait, 0.001), 0.5))
                    continue
            for slot, step, tokens in due:
                self._finish(
                    slot,
                    step,
                    tokens,
                    GatherTimeout(f"layer {slot.layer}: rows not in place by the step's deadline (watchdog)"),
                    by_watchdog=True,
                )

    def close(self) -> None:
        """Stops the poller and watchdog threads and abandons gathers in flight. Idempotent."""
        if self._closed:
            return
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                self.flags.host[slot.rows_flag] = 1  # a graph replayed after this waits for nobody
            self._released.notify_all()
        if self._native is not None:
            self._native.close()
        for t in self._threads:
            t.join(timeout=5)
        for layer, table in self.device_tables.items():
            if layer not in self._borrowed:
                table.close()
        for step in (self.pre, self.post):
            if step is not None:
                step.abandon()
        for slot in self._slots.values():
            slot.silence.clear()  # a probe in flight abandoned
