"""The in_graph layers' native poller: the C extension's one thread per GraphStep (``_graphpoll.c``), and what
Python keeps doing for it off the hot path: pointing each layer at where its rows come from, again when
that changes, and turning what the thread did into metrics.

Per in_graph layer the thread copies the step's rows from the table this process maps (shm; the row copy
of ``tableserver/common/rowcopy.h``), reads them over a data connection of its own to the node (tcp:
authenticated by Python, handed over unused, never sealed), or READs them through an RC QP of its own
(rdma: ``_graphverbs.c``; its QP offered to the node in a session of its own, ``node.QpSession``, which
answers with the server's QP and the table's regions), and applies the policy at the deadline
itself, all without the GIL; with ``realtime`` at real-time priority (SCHED_FIFO 1) where the process may,
so that a busy machine's scheduler does not park it for a slice mid-step (opt-in: a real-time spinner takes
its core from every normal thread while a step is armed); with ``cpus`` pinned to one of the CPUs an
operator set aside for pollers (``tableclient.pollercpu``: no migration, no engine thread's slice).
:meth:`NativePoller.refresh` runs before every arm (after the steps before were accounted): a node replaced,
reconnected, or a connection the thread dropped (it never reads a broken one again) gets a new source;
with none, the layer's steps get the policy at once. Where this cannot serve a GraphStep (the extension
not built, policy ``fallback``, a node reached over rdma where ``_graphverbs`` is not built or libibverbs
is missing, a sealed connection, rows split over shards), :class:`NativeUnavailable` says why (the
GraphStep's start-up log line) and the GraphStep keeps its Python poller.
"""

from __future__ import annotations

import logging
import time

from tableclient import pollercpu
from tableclient.errors import ConnectError, TableClientError
from tableclient.metrics import metrics
from tableclient.streamops import GraphStepError
from tableserver.common.verbs import QpInfo

try:
    from tableclient import _graphpoll
except ImportError:  # built without a C compiler
    _graphpoll = None
try:
    from tableclient import _graphverbs

    #: why the native poller cannot read layers over rdma here ("" where it can)
    RDMA_MISSING = ""
except ModuleNotFoundError:  # built without libibverbs' headers
    _graphverbs = None
    RDMA_MISSING = "tableclient._graphverbs is not built (no libibverbs headers at install: Debian's libibverbs-dev)"
except ImportError as e:  # built, but this host has no libibverbs
    _graphverbs = None
    RDMA_MISSING = f"tableclient._graphverbs cannot load ({e})"

log = logging.getLogger("tableclient.graphstep")

#: whether the native poller is built here (a C compiler at install)
BUILT = _graphpoll is not None
#: whether it reads layers over rdma itself (tableclient._graphverbs: libibverbs' headers at install, libibverbs here)
RDMA = BUILT and _graphverbs is not None


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
                 budgets: list | None = None, dead_id: int | None = None, cpus: list | None = None):  # fmt: skip
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
        self._links: list = [None] * len(slots)  # rdma: the layer's (QpSession, Endpoint), freed once replaced
        self._shapes = [(ids.size, staging.shape[-1]) for _plan, _i, _r, _o, ids, staging in slots]  # rows, row bytes
        # cpus: the CPUs set aside for pollers; this one claims one no other poller on the host holds
        self._claim = pollercpu.claim(cpus) if cpus else None
        try:
            self._poller = _graphpoll.Poller(
                flags,
                [(ids_flag, rows_flag, ok_flag, ids.reshape(-1), staging.reshape(-1), staging.shape[-1], ids.shape[-1])
                 for _plan, ids_flag, rows_flag, ok_flag, ids, staging in slots],
                policy == "fail",
                realtime=realtime,
                dead_id=dead_id,
                cpu=self._claim.cpu if self._claim is not None else -1,
            )  # fmt: skip
        except BaseException:
            self._release_cpu()
            raise
        #: whether the thread runs at real-time priority (SCHED_FIFO 1: where this process may)
        self.realtime = self._poller.realtime
        #: the CPU the thread is pinned to; None: not pinned (none asked for, every one claimed, or refused)
        self.cpu = self._poller.cpu if self._poller.cpu >= 0 else None
        #: why it is not pinned though ``cpus`` were given (one line), else None
        self.cpu_note = None
        if cpus and self._claim is None:
            self.cpu_note = f"every CPU of {cpus} is held by another poller on this host"
        elif cpus and self.cpu is None:
            self.cpu_note = f"CPU {self._claim.cpu} is outside this process's cpuset"
            self._release_cpu()
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
            self.close()  # the thread, and the rdma links of the layers connected before
            for _plan, _ids_flag, rows_flag, *_ in slots:  # close() released them; never served, they are the
                flags[rows_flag] = 0  # GraphStep's again (its Python poller's first arm would wait on them)
            raise

    def _release_cpu(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.close()

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
        link = None
        if route.local is not None:
            self._poller.set_shm(i, route.local, self._rows[i])
        elif route.transport is not None and route.transport.name == "rdma" and RDMA:
            try:
                link = self._connect_rdma(i, route)
            except (TableClientError, OSError, ValueError) as e:
                self._unconnected(i, "rdma connection", e, first)
                return
        elif route.transport is not None and route.transport.name == "tcp":
            try:
                sock, sealed = route.node.open_data_socket(self._timeout)
            except TableClientError as e:
                self._unconnected(i, "data connection", e, first)
                return
            try:
                if sealed:
                    raise NativeUnavailable("the server seals its tcp payloads (the native poller reads plain rows)")
                self._poller.set_tcp(i, sock.fileno(), route.index, route.node.max_rows_per_request)
            finally:
                sock.close()  # the poller holds its own duplicate
        elif first:
            why = route.transport.name if route.transport is not None else "rows split over shards, or no node up"
            if why == "rdma" and not RDMA:
                why = f"rdma and {RDMA_MISSING}"
            raise NativeUnavailable(f"table {self.plans[i].table!r} is read over {why}")
        else:
            self._poller.set_none(i)
        self._keep(i, link)
        self._sources[i] = (generation, id(route.node))

    def _connect_rdma(self, i: int, route) -> tuple:
        """Layer ``i``'s rdma source, in use: an endpoint of its own on the device the client's rdma transport
        uses, its QP offered to the node in a session of its own, connected to the server's QP, handed to the
        thread. ``(QpSession, Endpoint)``; OSError (verbs), ValueError or TableClientError when it cannot be."""
        dev = route.transport.dev
        table = self.plans[i].table
        capacity, row_bytes = self._shapes[i]
        ep = _graphverbs.Endpoint(dev.name, dev.port, dev.gid_index, capacity, row_bytes)
        side = None
        try:
            qp = QpInfo(ep.qp_num, ep.psn, ep.gid, ep.mtu)
            side = route.node.open_qp_session(qp, dev.name, ep.max_rd_atomic, self._timeout)
            info = side.tables.get(table)
            if info is None or info.index != route.index:
                raise ConnectError(f"table {table!r}: the node's catalog changed under the client's session")
            regions = side.regions(route.index)
            if not regions:
                raise ValueError(f"table {table!r}: the node registered no memory of it for READs (served packed only)")
            peer = side.peer
            ep.connect(peer.qp_num, peer.psn, peer.gid, peer.mtu, side.rd_atomic, self._rows[i], regions)
            self._poller.set_rdma(i, ep)
        except BaseException:
            if side is not None:
                side.close()
            ep.close()
            raise
        return side, ep

    def _keep(self, i: int, link) -> None:
        """Layer ``i``'s rdma link is ``link`` from now on (None: none); the one before (the thread let go of
        it: every set_* waits for a gather in progress) closed."""
        old, self._links[i] = self._links[i], link
        if old is not None and old is not link:
            side, ep = old
            side.close()
            ep.close()

    def _unconnected(self, i: int, what: str, error: BaseException, first: bool) -> None:
        """Layer ``i`` could not connect its ``what``: NativeUnavailable at start (the Python poller serves it),
        else the policy until a later arm connects it."""
        if first:
            raise NativeUnavailable(f"no {what} of its own: {error}") from None
        log.warning("layer %d: no %s for the native poller (%s): policy until it has one", self.layers[i], what, error)
        self._poller.set_none(i)
        self._sources[i] = None
        self._keep(i, None)

    def busy(self) -> bool:
        return self._poller.busy()

    def arm(self, tokens: int, deadlines: list) -> None:
        self.account()  # first: a step before that ran out of time marks its node silent for refresh, which
        for i in range(len(self.layers)):  # then serves the policy at once instead of reconnecting to a node
            self.refresh(i)  # that does not answer (up to the connect timeout on the launch path)
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
            elif how == WATCHDOG and seconds > 0:  # its ids came, its rows did not: the node ran out of time
                self._watchdog[i].inc()
                self._missed[i] = time.monotonic()
                log.warning("layer %d: rows not in place %.1f ms after the graph's ids (the gather's budget or the "
                            "step's deadline): released with zero rows", self.layers[i], seconds * 1e3)  # fmt: skip
            elif how == WATCHDOG:  # the graph was late, not the node (its next steps read it as ever)
                self._watchdog[i].inc()
                log.warning("layer %d: the graph's ids did not come by the deadline: released with zero rows",
                            self.layers[i])  # fmt: skip
            elif how == UNARMED:
                log.error("layer %d: a graph published ids of a step nobody armed: released with zero rows "
                          "(the engine must call arm() before each replay)", self.layers[i])  # fmt: skip

    def close(self) -> None:
        self._poller.close()
        self._release_cpu()
        for i in range(len(self._links)):
            self._keep(i, None)
