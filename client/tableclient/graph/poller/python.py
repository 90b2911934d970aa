"""The in_graph layers' Python poller: one thread per layer waits for its graph's ids flag without the GIL
(:func:`tableclient.graph.streams.wait_flag`), gathers the armed step's ids through the client into the
staging and writes the ``rows`` flag; one watchdog thread releases a step at its deadline with the policy's
rows. Where it serves: the native poller is not built, policy ``fallback`` (its rows come through another
client), or ``poller="python"``. Its gather is Python: behind a thread that holds the GIL it starts up to one
switch interval late (``bench/bench_graph.py`` measures the wake-up).

The step state per layer is :class:`tableclient.graph.poller.slots.Slot`'s (pure, tested without threads);
this module is its threads, its lock and what a release does to the staging and the flags."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from tableclient.errors import GatherTimeout, TableClientError
from tableclient.graph.errors import CLOSED, GraphStepError
from tableclient.graph.poller.silence import SILENT, Silence
from tableclient.graph.poller.slots import Slot
from tableclient.graph.streams import wait_flag
from tableclient.metrics import metrics

log = logging.getLogger(__name__)


class _Done:
    """A gather with nothing to read (every id of the step dead): done at once."""

    def wait(self, timeout=None) -> None:
        return None

    def cancel(self) -> None:
        return None


class PythonPoller:
    """Python's threads for one GraphStep's in_graph layers ``slots`` (``(plan, ids_flag, rows_flag, ok_flag,
    ids, staging)`` each, as :class:`tableclient.graph.poller.native.NativePoller` takes them), gathering through
    ``step`` (their EngramStep: its tables and its failure policy)."""

    kind = "python"
    cpu = None  # never pinned
    realtime = False

    def __init__(self, client, slots: list, flags, policy: str, step, budgets: dict, dead_id: int | None = None):
        self.flags, self.policy, self.step, self.budgets, self.dead_id = flags, policy, step, budgets, dead_id
        self._ids = {plan.layer: ids for plan, _i, _r, _o, ids, _s in slots}
        self._staging = {plan.layer: staging for plan, *_, staging in slots}
        self._slots = {
            plan.layer: Slot(plan.layer, plan, ids_flag, rows_flag, ok_flag,
                             silence=Silence(client.table(plan.table), client.tables[plan.table].rows, staging.shape[-1]))
            for plan, ids_flag, rows_flag, ok_flag, _ids, staging in slots
        }  # fmt: skip
        # with dead ids: the live ids' rows land here, then spread into the staging
        self._scratch = {
            layer: np.empty((ids.size, self._staging[layer].shape[-1]), dtype=np.uint8)
            for layer, ids in self._ids.items()
            if dead_id is not None
        }
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._closed = False
        m = metrics()
        self._waits = {layer: m.graph_waits.labels(str(layer), "in_graph") for layer in self._slots}
        self._watchdog_releases = {layer: m.watchdog_releases.labels(str(layer)) for layer in self._slots}
        self._misses = {layer: m.deadline_misses.labels(str(layer)) for layer in self._slots}
        self._threads = [
            threading.Thread(target=self._poll, args=(s,), name=f"tableclient-graph-{s.layer}", daemon=True)
            for s in self._slots.values()
        ]
        self._threads.append(threading.Thread(target=self._watchdog, name="tableclient-graph-watchdog", daemon=True))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ the contract (graph/poller/__init__.py)
    def arm(self, tokens: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        host = self.flags
        with self._lock:
            while True:
                if self._closed:  # closed meanwhile: nobody would release this step
                    raise GraphStepError(CLOSED)
                busy = [s for s in self._slots.values() if s.busy(int(host[s.rows_flag]))]
                if not busy:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    b = busy[0]
                    raise GraphStepError(
                        f"layer {b.layer}: the last step ({b.state}, rows flag {int(host[b.rows_flag])}) "
                        f"was not released and consumed within {timeout:g} s: a replay was "
                        "armed and never launched (call reset() after a failed replay)"
                    )
                self._released.wait(min(left, 0.0002))  # the GPU's consumption notifies nobody: poll
            deadline = time.monotonic() + timeout
            for slot in self._slots.values():
                slot.arm(tokens, deadline)
            self._released.notify_all()  # the watchdog's next deadline

    def after_replay(self, timeout: float) -> None:
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

    def reset(self) -> None:
        with self._lock:
            if self._closed:
                return
            for slot in self._slots.values():
                if slot.handle is not None:
                    slot.handle.cancel()
                slot.reset()
                self.flags[slot.ids_flag] = self.flags[slot.rows_flag] = 0
            self._released.notify_all()

    def released_at(self, layer: int) -> float:
        return self._slots[layer].released_at

    def silence(self, layer: int) -> Silence:
        return self._slots[layer].silence

    def account(self) -> None:
        return None  # the threads count as they go

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                self.flags[slot.rows_flag] = 1  # a graph replayed after this waits for nobody
            self._released.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        for slot in self._slots.values():
            slot.silence.clear()  # a probe in flight abandoned

    # ------------------------------------------------------------------ the threads
    def _poll(self, slot: Slot) -> None:
        flags, table = self.flags, self.step.tables[slot.layer]
        staging, ids = self._staging[slot.layer], self._ids[slot.layer]
        while not self._closed:
            if not wait_flag(flags, slot.ids_flag, 1, 0.1):
                continue
            flags[slot.ids_flag] = 0
            error = None
            with self._lock:
                what = slot.ids(time.perf_counter())
                if what == "owed":  # the late ids of a step the watchdog released before they came
                    self._released.notify_all()
                    continue
                if what == "unarmed":  # a replay nobody armed: released with zeros, the GPU never hangs
                    log.error(
                        "layer %d: a graph published ids of a step nobody armed: released with zero rows "
                        "(the engine must call arm() before each replay)",
                        slot.layer,
                    )
                    staging.fill(0)
                    self._release(slot, GraphStepError(f"layer {slot.layer}: step not armed"), ok=False)
                    continue
                tokens, step = slot.tokens, slot.step
                if self.budgets[slot.layer] > 0:  # the gather's own deadline, from its ids: the watchdog's
                    slot.deadline = min(slot.deadline, time.monotonic() + self.budgets[slot.layer])
                    self._released.notify_all()
                want, into = ids[:tokens], staging[:tokens]
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
            self._finish(slot, step, tokens, error, by="poller")

    def _finish(self, slot: Slot, step: int, tokens: int, error: BaseException | None, by: str) -> None:
        """Fills a failed step by the policy and releases it: only step ``step``, and only if the other side
        has not taken it."""
        with self._lock:
            how = slot.take(step, by)
            if how is None:
                return
            if how == "late" and slot.silence.late(slot.node):  # its ids came, its rows did not: the node's time
                log.warning(SILENT, slot.layer)
            handle, slot.handle = slot.handle, None
        if error is not None and handle is not None:
            handle.cancel()  # a barrier: none of a failed or late gather's rows land after this
        if how == "ids_late":
            log.warning("layer %d: the graph's ids did not come by the deadline: the watchdog releases the step "
                        "(%s)", slot.layer, self.policy)  # fmt: skip
        elif how == "late":
            log.warning("layer %d: rows not in place %.1f ms after the graph's ids (the gather's budget or the "
                        "step's deadline): the watchdog releases the step (%s)", slot.layer,
                        (time.perf_counter() - slot.seen) * 1e3, self.policy)  # fmt: skip
        staging = self._staging[slot.layer][:tokens]
        view, want, live = staging, self._ids[slot.layer][:tokens], slot.live
        if live is not None:  # some ids dead: their live ones were gathered into the scratch
            view, want = self._scratch[slot.layer][: live.size], want.reshape(-1)[live]
        poison = None
        if error is not None:
            try:
                if self.policy == "fail":
                    raise error
                self.step.on_failure(slot.layer, view, want.copy(), error)
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
            if by == "watchdog":
                self._watchdog_releases[slot.layer].inc()
            else:
                elapsed = time.perf_counter() - slot.seen
                self._waits[slot.layer].observe(elapsed)
                if elapsed > slot.plan.window_s:
                    self._misses[slot.layer].inc()

    def _release(self, slot: Slot, error: BaseException | None, ok: bool) -> None:
        """(lock held) The staging holds the step's rows (the table's: ``ok``): the graph may copy them."""
        slot.release(error, time.monotonic())
        self.flags[slot.ok_flag] = int(ok)
        self.flags[slot.rows_flag] = 1
        self._released.notify_all()

    def _silent(self, slot: Slot) -> GatherTimeout | None:
        """(lock held) Why ``slot``'s step gets the policy at once: its node has not answered since one of its
        steps ran out of time (:mod:`tableclient.graph.poller.silence`: until a probe is answered); None once it
        has. Notes the node the step reads (``slot.node``): None where this process maps the table, which is
        never silent."""
        route = self.step.client.reader(slot.plan.table).route()
        slot.node = route.node if route.local is None else None
        if not slot.silence.silent(slot.node):
            return None
        return GatherTimeout(
            f"layer {slot.layer}: its node has not answered since a step ran out of time (the policy at once)"
        )

    def _watchdog(self) -> None:
        while not self._closed:
            with self._lock:
                now = time.monotonic()
                due = [(s, s.step, s.tokens) for s in self._slots.values() if s.due(now)]
                if not due:
                    live = [s.deadline for s in self._slots.values() if s.state in ("armed", "gathering")]
                    wait = min(live, default=now + 0.5) - now
                    self._released.wait(min(max(wait, 0.001), 0.5))
                    continue
            for slot, step, tokens in due:
                error = GatherTimeout(f"layer {slot.layer}: rows not in place by the step's deadline (watchdog)")
                self._finish(slot, step, tokens, error, by="watchdog")
