"""The in_graph layers' native poller: the C extension's one thread per GraphStep (``_graphpoll.c``), and what
Python keeps doing for it off the hot path: pointing each layer at where its rows come from, again when
that changes, and turning what the thread did into metrics.

Per in_graph layer the thread copies the step's rows from the table this process maps (shm; the row copy
of ``tableserver/common/rowcopy.h``) or reads them over a data connection of its own to the node (tcp:
authenticated by Python, handed over unused, never sealed), and applies the policy at the deadline
itself, all without the GIL; with ``realtime`` at real-time priority (SCHED_FIFO 1) where the process may,
so that a busy machine's scheduler does not park it for a slice mid-step (opt-in: a real-time spinner takes
its core from every normal thread while a step is armed). :meth:`NativePoller.refresh` runs before every arm: a node replaced,
reconnected, or a connection the thread dropped (it never reads a broken one again) gets a new source;
with none, the layer's steps get the policy at once. Where this cannot serve a GraphStep (the extension
not built, policy ``fallback``, a node reached only over rdma or a sealed connection, rows split over
shards), :class:`NativeUnavailable` says why and the GraphStep keeps its Python poller.
"""

from __future__ import annotations

import logging
import time

from tableclient.errors import TableClientError
from tableclient.metrics import metrics
from tableclient.streamops import GraphStepError

try:
    from tableclient import _graphpoll
except ImportError:  # built without a C compiler
    _graphpoll = None

log = logging.getLogger("tableclient.graphstep")

#: whether the native poller is built here (a C compiler at install)
BUILT = _graphpoll is not None


def stand_in(flags, ids_flag: int, rows_flag: int, timeout: float):
    """What a replayed graph does at one in_graph layer, natively and without the GIL (a stand-in for the GPU
    where there is none: bench/bench_graph.py): sets ``flags[ids_flag]``, waits for ``flags[rows_flag]``;
    ``(published, seconds until it saw the release)`` on time.monotonic()'s clock, None past ``timeout``."""
    if _graphpoll is None:
        raise NativeUnavailable("tableclient._graphpoll is not built (no C compiler at install)")
    return _graphpoll.stand_in(flags, ids_flag, rows_flag, timeout)


#: how ``take_events`` says a step was released
ROWS, POLICY, WATCHDOG, UNARMED = 0, 1, 2, 3


class NativeUnavailable(GraphStepError):
    """The native poller cannot serve these layers here (why, in one line): the Python poller does."""


class NativePoller:
    """The native thread of one GraphStep's in_graph layers ``slots``: ``(plan, ids_flag, rows_flag,
    ok_flag, ids, staging)`` each, in the order to serve them (shortest window first); ``ids`` int64 and
    ``staging`` uint8 numpy views of the pinned buffers, ``flags`` the pinned uint32 flags (``ok_flag``: 1
    once a step's rows are the table's, 0 the policy's; -1 none)."""

    def __init__(self, client, slots: list, flags, policy: str, connect_timeout: float = 5.0, realtime: bool = False,
                 budgets: list | None = None, dead_id: int | None = None):  # fmt: skip
        if _graphpoll is None:
            raise NativeUnavailable("tableclient._graphpoll is not built (no C compiler at install)")
        if policy == "fallback":
            raise NativeUnavailable("policy 'fallback' re-reads through another client in Python")
        self.layers = [plan.layer for plan, *_ in slots]
        self.plans = [plan for plan, *_ in slots]
        self._readers = [client.reader(plan.table) for plan in self.plans]
        self._rows = [client.tables[plan.table].rows for plan in self.plans]
        self._timeout = connect_timeout
        self._sources: list = [None] * len(slots)  # (generation, node) the source was set for
        self._poller = _graphpoll.Poller(
            flags,
            [(ids_flag, rows_flag, ok_flag, ids.reshape(-1), staging.reshape(-1), staging.shape[-1], ids.shape[-1])
             for _plan, ids_flag, rows_flag, ok_flag, ids, staging in slots],
            policy == "fail",
            realtime=realtime,
            dead_id=dead_id,
        )  # fmt: skip
        #: whether the thread runs at real-time priority (SCHED_FIFO 1: where this process may)
        self.realtime = self._poller.realtime
        for i, budget in enumerate(budgets or ()):
            self._poller.set_budget(i, budget)
        #: per layer, time.monotonic() of its last step that ran out of time (None: the last one did not)
        self._missed: list = [None] * len(slots)
        m = metrics()
        self._waits = [m.graph_waits.labels(str(layer), "in_graph") for layer in self.layers]
        self._watchdog = [m.watchdog_releases.labels(str(layer)) for layer in self.layers]
        self._misses = [m.deadline_misses.labels(str(layer)) for layer in self.layers]
        self._zeros = [m.zero_rows.labels(str(layer)) for layer in self.layers]
        try:
            for i in range(len(slots)):
                self.refresh(i, first=True)
        except BaseException:
            self._poller.close()
            raise

    def refresh(self, i: int, first: bool = False) -> None:
        """Layer ``i``'s source as routing reads its table now (before an arm; a connect when it changed)."""
        reader = self._readers[i]
        generation = reader.generation
        route = reader.route()
        missed = self._missed[i]
        if missed is not None and route.node is not None and route.node.last_heard < missed:
            # its node has not answered since a step ran out of time: the policy at once, no stall a step
            if self._sources[i] != "silent":
                log.warning("layer %d: its node has not answered since a step ran out of time: the policy at "
                            "once until it does", self.layers[i])  # fmt: skip
                self._poller.set_none(i)
                self._sources[i] = "silent"
            return
        self._missed[i] = None
        broken = self._poller.broken(i)
        if self._sources[i] == (generation, id(route.node)) and broken is None:
            return
        if broken is not None:
            log.warning("layer %d: the native poller's connection broke (%s): connecting again", self.layers[i], broken)
        if route.local is not None:
            self._poller.set_shm(i, route.local, self._rows[i])
        elif route.transport is not None and route.transport.name == "tcp":
            try:
                sock, sealed = route.node.open_data_socket(self._timeout)
            except TableClientError as e:
                if first:
                    raise NativeUnavailable(f"no data connection of its own: {e}") from None
                log.warning("layer %d: no data connection for the native poller (%s): policy until it has one",
                            self.layers[i], e)  # fmt: skip
                self._poller.set_none(i)
                self._sources[i] = None
                return
            try:
                if sealed:
                    raise NativeUnavailable("the server seals its tcp payloads (the native poller reads plain rows)")
                self._poller.set_tcp(i, sock.fileno(), route.index, route.node.max_rows_per_request)
            finally:
                sock.close()  # the poller holds its own duplicate
        elif first:
            why = route.transport.name if route.transport is not None else "rows split over shards, or no node up"
            raise NativeUnavailable(f"table {self.plans[i].table!r} is read over {why}")
        else:
            self._poller.set_none(i)
        self._sources[i] = (generation, id(route.node))

    def busy(self) -> bool:
        return self._poller.busy()

    def arm(self, tokens: int, deadlines: list) -> None:
        for i in range(len(self.layers)):
            self.refresh(i)
        self.account()
        self._poller.arm(tokens, deadlines)

    def wait_released(self, timeout: float):
        """(layer, message) of the step's failed layers once every layer is released; None past ``timeout``."""
        errors = self._poller.wait_released(timeout)
        return None if errors is None else [(self.layers[i], message) for i, message in errors]

    def reset(self) -> None:
        self._poller.reset()

    def released_at(self, layer: int) -> float:
        return self._poller.released_at(self.layers.index(layer))

    def account(self) -> None:
        """What the thread did since the last call, into the metrics (off the hot path)."""
        for i, seconds, how, zeroed in self._poller.take_events():
            if zeroed:  # a step served zero rows (the metric counts steps)
                self._zeros[i].inc()
            if how == ROWS:
                self._waits[i].observe(seconds)
                if seconds > self.plans[i].window_s:
                    self._misses[i].inc()
            elif how == WATCHDOG:
                self._watchdog[i].inc()
                self._missed[i] = time.monotonic()
                log.warning("layer %d: the graph's ids did not come by the deadline: released with zero rows",
                            self.layers[i])  # fmt: skip
            elif how == UNARMED:
                log.error("layer %d: a graph published ids of a step nobody armed: released with zero rows "
                          "(the engine must call arm() before each replay)", self.layers[i])  # fmt: skip

    def close(self) -> None:
        self._poller.close()
