"""The in_graph layers' native poller: the C extension's one thread per GraphStep (``_native_c/``), and what
Python keeps doing for it off the hot path: pointing each layer at where its rows come from, again when
that changes, and turning what the thread did into metrics.

Per in_graph layer the thread copies the step's rows from the table this process maps (shm; the row copy
of ``tableserver/common/rowcopy.h``), reads them over a data connection of its own to the node (tcp:
authenticated by Python, handed over unused, never sealed), or READs them through an RC QP of its own
(rdma: ``_native_c/verbs.c``; its QP offered to the node in a session of its own, ``node.QpSession``, which
answers with the server's QP and the table's regions), and applies the policy at the deadline
itself, all without the GIL; with ``realtime`` at real-time priority (SCHED_FIFO 1) where the process may,
so that a busy machine's scheduler does not park it for a slice mid-step (opt-in: a real-time spinner takes
its core from every normal thread while a step is armed); with ``cpus`` pinned to one of the CPUs an
operator set aside for pollers (``tableclient.graph.poller.cpu``: no migration, no engine thread's slice).
:meth:`NativePoller.refresh` runs before every arm (after the steps before were accounted) and never waits
on the network: a node replaced (another session; not another replica's change of state), or a connection
the thread dropped (it never reads a broken one again), gets a new connection from a keeper thread in the
background, with back-off; meanwhile, and for good where the thread cannot read the table itself (a node
that seals its tcp payloads, a table served from the node's disk tier or packed only, rows split over
shards), the layer's steps are handed to a Python thread that reads them through the client's own
transport (bit-exact; a GIL wake-up later). A step whose connection the server had closed while idle is
sent again that way: reads are idempotent. With no node up, and while the layer's node is silent (a step's
rows did not come after its ids: :mod:`tableclient.graph.poller.silence`), the steps get the policy at once. Where this
cannot serve a GraphStep when it is built (the extension not built, policy ``fallback``, any layer read
through the client's transport then), :class:`NativeUnavailable` says why (the GraphStep's start-up log
line) and the GraphStep keeps its Python poller.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from tableclient.errors import ConnectError, GatherTimeout, TableClientError
from tableclient.graph.errors import CLOSED, GraphStepError
from tableclient.graph.poller.cpu import claim_or_reason
from tableclient.graph.poller.keeper import Keeper
from tableclient.graph.poller.silence import SILENT, Silence
from tableclient.metrics import metrics
from tableserver.common.verbs import QpInfo

try:
    from tableclient.graph.poller import _native
except ImportError:  # built without a C compiler
    _native = None
try:
    from tableclient.graph.poller import _verbs

    #: why the native poller cannot read layers over rdma here ("" where it can)
    RDMA_MISSING = ""
except ModuleNotFoundError:  # built without libibverbs' headers
    _verbs = None
    RDMA_MISSING = (
        "tableclient.graph.poller._verbs is not built (no libibverbs headers at install: Debian's libibverbs-dev)"
    )
except ImportError as e:  # built, but this host has no libibverbs
    _verbs = None
    RDMA_MISSING = f"tableclient.graph.poller._verbs cannot load ({e})"

log = logging.getLogger(__name__)

#: whether the native poller is built here (a C compiler at install)
BUILT = _native is not None
#: whether it reads layers over rdma itself (tableclient.graph.poller._verbs: libibverbs' headers at install, libibverbs here)
RDMA = BUILT and _verbs is not None


def stand_in(flags, ids_flag: int, rows_flag: int, timeout: float):
    """What a replayed graph does at one in_graph layer, natively and without the GIL (a stand-in for the GPU
    where there is none: bench/bench_graph.py): sets ``flags[ids_flag]``, waits for ``flags[rows_flag]``;
    ``(published, seconds until it saw the release)`` on time.monotonic()'s clock, None past ``timeout``."""
    if _native is None:
        raise NativeUnavailable("tableclient.graph.poller._native is not built (no C compiler at install)")
    return _native.stand_in(flags, ids_flag, rows_flag, timeout)


#: how ``take_events`` says a step was released: its rows; the policy after an error; the deadline before the
#: graph's ids came (watchdog); a replay nobody armed; the deadline after its ids came (a remote source late)
ROWS, POLICY, WATCHDOG, UNARMED, LATE = 0, 1, 2, 3, 4


class NativeUnavailable(GraphStepError):
    """The native poller cannot serve these layers here (why, in one line): the Python poller does."""


class NativePoller:
    """The native thread of one GraphStep's in_graph layers ``slots``: ``(plan, ids_flag, rows_flag,
    ok_flag, ids, staging)`` each, in the order to serve them (shortest window first); ``ids`` int64 and
    ``staging`` uint8 numpy views of the pinned buffers, ``flags`` the pinned uint32 flags (``ok_flag``: 1
    once a step's rows are the table's, 0 the policy's; -1 none).

    Where each layer's rows come from (its *source*) is decided before every arm by :meth:`refresh`, from
    how routing reads the table now, and it never waits on the network there: a connection of the thread's
    own (tcp, rdma) is opened by a keeper thread in the background (:class:`tableclient.graph.poller.keeper.Keeper`, with back-off), and
    until it is in place -- and for good where the thread cannot read the table itself (a sealed
    connection, a table the node serves from its disk tier or packed only, rows split over shards) -- the
    layer's steps are handed to a Python thread that gathers them through the client's own transport
    (``set_host``; bit-exact as ever, a GIL wake-up later). A step whose connection the server had closed
    before it read a byte of the answer (its idle timeout) is handed over the same way, and sent again there.
    """

    def __init__(self, client, slots: list, flags, policy: str, connect_timeout: float = 5.0, realtime: bool = False,
                 budgets: list | None = None, dead_id: int | None = None, cpus: list | None = None):  # fmt: skip
        if _native is None:
            raise NativeUnavailable("tableclient.graph.poller._native is not built (no C compiler at install)")
        if policy == "fallback":
            raise NativeUnavailable("policy 'fallback' re-reads through another client in Python")
        self._client = client
        self.layers = [plan.layer for plan, *_ in slots]
        self.plans = [plan for plan, *_ in slots]
        self._readers = [client.reader(plan.table) for plan in self.plans]
        self._rows = [client.tables[plan.table].rows for plan in self.plans]
        self._tables = [client.table(plan.table) for plan in self.plans]  # the client's transport: handoffs, probes
        self._timeout = connect_timeout
        self._dead_id = dead_id
        self._ids = [ids for _plan, _i, _r, _o, ids, _staging in slots]
        self._staging = [staging for *_, staging in slots]
        self._shapes = [(ids.size, staging.shape[-1]) for _plan, _i, _r, _o, ids, staging in slots]  # rows, row bytes
        self._silence = [Silence(t, rows, rb) for t, rows, (_n, rb) in zip(self._tables, self._rows, self._shapes)]
        # the sources: what refresh wants each slot to read, what it reads now ((kind, node) each: kind one of
        # shm, tcp, rdma, host, none), its rdma link; under _lock (refresh on the launch path, the keeper)
        self._lock = threading.Lock()
        self._want: list = [None] * len(slots)
        self._reads: list = [None] * len(slots)
        self._links: list = [None] * len(slots)  # rdma: the layer's (QpSession, Endpoint), freed once replaced
        self._said: list = [None] * len(slots)  # the last "read through the client's transport" reason logged
        self._host_nodes: dict = {}  # id(node) -> (node, why): nodes whose tables the thread cannot read itself
        self._closed = False
        # cpus: the CPUs set aside for pollers; this one claims one no other poller on the host holds
        self._claim, unclaimed = claim_or_reason(cpus) if cpus else (None, None)
        try:
            self._poller = _native.Poller(
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
            self.cpu_note = unclaimed  # every CPU held by another poller, or a claim directory not ours
        elif cpus and self.cpu is None:
            self.cpu_note = f"CPU {self._claim.cpu} is outside this process's cpuset"
            self._release_cpu()
        for i, budget in enumerate(budgets or ()):
            self._poller.set_budget(i, budget)
        m = metrics()
        self._waits = [m.graph_waits.labels(str(layer), "in_graph") for layer in self.layers]
        self._watchdog = [m.watchdog_releases.labels(str(layer)) for layer in self.layers]
        self._misses = [m.deadline_misses.labels(str(layer)) for layer in self.layers]
        self._zeros = [m.zero_rows.labels(str(layer)) for layer in self.layers]
        self._handed = [m.graph_handoffs.labels(str(layer)) for layer in self.layers]
        self._keeper = Keeper(self._connect_wanted, self._check_connections)
        self._handoffs = threading.Thread(target=self._serve_handoffs, name="tableclient-graph-handoff", daemon=True)
        try:
            for i in range(len(slots)):
                self._first_source(i)
        except BaseException:
            self.close()  # the thread, and the rdma links of the layers connected before
            for _plan, _ids_flag, rows_flag, *_ in slots:  # close() released them; never served, they are the
                flags[rows_flag] = 0  # GraphStep's again (its Python poller's first arm would wait on them)
            raise
        self._handoffs.start()
        self._keeper.start()

    def _release_cpu(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.close()

    # ------------------------------------------------------------------ sources
    def _kind(self, i: int, route) -> tuple[str, str]:
        """(kind, why) of the source layer ``i`` takes along ``route``: shm (mapped here), tcp or rdma (a
        connection of the thread's own), host (the client's transport: why), none (no node up: the policy)."""
        node = route.node
        if route.local is not None:
            return "shm", ""
        if node is None:
            if len(self._client.shards(self.plans[i].table)) > 1:
                return "host", "shards (its rows split over several nodes)"
            return "none", "no node (none of its nodes is up)"
        known = self._host_nodes.get(id(node))
        if known is not None and known[0] is node:
            return "host", known[1]
        name = route.transport.name if route.transport is not None else ""
        if name == "tcp":
            return "tcp", ""
        if name == "rdma":
            return ("rdma", "") if RDMA else ("host", f"rdma and {RDMA_MISSING}")
        return "host", f"{name or 'no transport'} without a mapping here (the node serves it from its disk tier)"

    def _first_source(self, i: int) -> None:
        """Layer ``i``'s source when the GraphStep is built (connected here, off every launch path):
        NativeUnavailable where the thread cannot read it (the Python poller serves the GraphStep)."""
        route = self._readers[i].route()
        kind, why = self._kind(i, route)
        if kind in ("host", "none"):
            raise NativeUnavailable(f"table {self.plans[i].table!r} is read over {why}")
        key = (kind, route.node)
        self._want[i] = key
        if kind == "shm":
            self._poller.set_shm(i, route.local, self._rows[i])
            self._reads[i] = key
            return
        try:
            link = self._connect(i, kind, route)
        except NativeUnavailable as e:
            raise NativeUnavailable(f"table {self.plans[i].table!r}: {e}") from None
        except (TableClientError, OSError, ValueError) as e:
            raise NativeUnavailable(f"no {'rdma' if kind == 'rdma' else 'data'} connection of its own: {e}") from None
        self._install(i, key, link)

    def refresh(self, i: int) -> None:
        """Layer ``i``'s source as routing reads its table now, before an arm. Never connects (the keeper does)
        nor raises: a source it cannot set gets the policy, said once."""
        try:
            self._refresh(i)
        except Exception as e:  # noqa: BLE001  (no source change may raise out of arm(): the step runs)
            with self._lock:
                if self._said[i] != ("error", str(e)):
                    self._said[i] = ("error", str(e))
                    log.error("layer %d: the native poller could not take its table's source (%s): the policy "
                              "until it can", self.layers[i], e)  # fmt: skip
                try:
                    self._set(i, ("none", None))
                except Exception:  # noqa: BLE001  (closed meanwhile: its steps wait for nobody)
                    self._reads[i] = None

    def _refresh(self, i: int) -> None:
        route = self._readers[i].route()
        node = route.node
        broken = self._poller.broken(i)
        with self._lock:
            silent = self._silence[i].silent(node)  # its node has not answered since a step ran out of time
            if broken is not None:
                self._reads[i] = None  # the thread let go of it (its steps: the client's transport, or the policy)
                log.warning("layer %d: the native poller's connection broke (%s)%s", self.layers[i], broken,
                            "" if silent else ": a new one is connected in the background")  # fmt: skip
            if silent:
                self._want[i] = ("none", node)
                self._keeper.drop(i)
                if self._reads[i] != ("none", node):
                    self._set(i, ("none", node))
                return
            kind, why = self._kind(i, route)
            key = (kind, node)
            self._want[i] = key
            if kind in ("tcp", "rdma"):
                if self._reads[i] != key:
                    if self._reads[i] != ("host", node):  # meanwhile: the client's transport reads its steps
                        self._set(i, ("host", node))
                    self._keeper.want(i, key, route)
                return
            self._keeper.drop(i)
            if self._reads[i] == key:
                return
            if kind == "host" and self._said[i] != (node, why):
                self._said[i] = (node, why)
                log.warning("layer %d: the native poller cannot read table %r itself (it is read over %s): its "
                            "steps are read through the client's transport", self.layers[i], self.plans[i].table,
                            why)  # fmt: skip
            self._set(i, key, route)

    def _set(self, i: int, key: tuple, route=None) -> None:
        """(lock held) Layer ``i`` reads ``key``'s source from now on: shm (``route``'s mapping), host or
        none; the rdma link before let go."""
        kind = key[0]
        if kind == "shm":
            self._poller.set_shm(i, route.local, self._rows[i])
        elif kind == "host":
            self._poller.set_host(i)
        else:
            self._poller.set_none(i)
        self._reads[i] = key
        self._keep(i, None)

    def _install(self, i: int, key: tuple, link) -> None:
        """Layer ``i``'s new connection ``link`` (tcp: a socket, whose duplicate the thread keeps; rdma:
        ``(QpSession, Endpoint)``) handed to the thread as the source for ``key``."""
        if key[0] == "tcp":
            sock, index, max_rows = link
            try:
                self._poller.set_tcp(i, sock.fileno(), index, max_rows)
            finally:
                sock.close()  # the poller holds its own duplicate
            self._reads[i] = key
            self._keep(i, None)
        else:
            try:
                self._poller.set_rdma(i, link[1])
            except BaseException:
                _close_link(link)
                raise
            self._reads[i] = key
            self._keep(i, link)

    def _connect(self, i: int, kind: str, route):
        """A new connection of layer ``i``'s own along ``route`` (up to the connect timeout: never on a launch
        path). NativeUnavailable where the node's table cannot be read by the thread (remembered: its steps
        go through the client's transport); TableClientError, OSError or ValueError where it cannot connect."""
        node = route.node
        if kind == "tcp":
            sock, sealed = node.open_data_socket(self._timeout)
            if sealed:
                sock.close()
                raise self._host_only(node, "the server seals its tcp payloads (the native poller reads plain rows)")
            return sock, route.index, node.max_rows_per_request
        try:
            return self._connect_rdma(i, route)
        except _PackedOnly as e:
            raise self._host_only(node, str(e)) from None

    def _host_only(self, node, why: str) -> NativeUnavailable:
        """``node``'s tables are read through the client's transport from now on (the thread cannot: why)."""
        self._host_nodes = {k: v for k, v in self._host_nodes.items() if not v[0].closed}
        self._host_nodes[id(node)] = (node, why)
        return NativeUnavailable(why)

    def _connect_rdma(self, i: int, route) -> tuple:
        """Layer ``i``'s rdma source, in use: an endpoint of its own on the device the client's rdma transport
        uses, its QP offered to the node in a session of its own, connected to the server's QP, handed to the
        thread. ``(QpSession, Endpoint)``; OSError (verbs), ValueError or TableClientError when it cannot be."""
        dev = route.transport.dev
        table = self.plans[i].table
        capacity, row_bytes = self._shapes[i]
        ep = _verbs.Endpoint(dev.name, dev.port, dev.gid_index, capacity, row_bytes)
        side = None
        try:
            qp = QpInfo(ep.qp_num, ep.psn, ep.gid, ep.mtu)
            side = route.node.open_qp_session(qp, dev.name, ep.max_rd_atomic, self._timeout)
            info = side.tables.get(table)
            if info is None or info.index != route.index:
                raise ConnectError(f"table {table!r}: the node's catalog changed under the client's session")
            regions = side.regions(route.index)
            if not regions:
                raise _PackedOnly(
                    f"table {table!r}: the node registered no memory of it for READs (served packed only)"
                )
            peer = side.peer
            ep.connect(peer.qp_num, peer.psn, peer.gid, peer.mtu, side.rd_atomic, self._rows[i], regions)
        except BaseException:
            if side is not None:
                side.close()
            ep.close()
            raise
        return side, ep

    def _connect_wanted(self, i: int, key: tuple, route) -> bool:
        """(the keeper) Connects layer ``i`` for ``key`` and hands the connection over if refresh still wants
        it. True when done (connected, or not to be: another source wanted now, or the thread cannot read that
        node's table); False to try again later (the keeper backs off)."""
        with self._lock:
            if self._want[i] != key or self._closed:
                return True
        try:
            link = self._connect(i, key[0], route)
        except NativeUnavailable as e:
            log.warning("layer %d: the native poller cannot read table %r itself (%s): its steps are read through "
                        "the client's transport", self.layers[i], self.plans[i].table, e)  # fmt: skip
            with self._lock:
                self._said[i] = (key[1], str(e))
            return True
        except (TableClientError, OSError, ValueError) as e:
            log.info("layer %d: no connection of the native poller's own yet (%s): its steps are read through the "
                     "client's transport meanwhile", self.layers[i], e)  # fmt: skip
            return False
        with self._lock:
            if self._want[i] != key or self._closed:
                _close_link(link if key[0] == "rdma" else (link[0],))
                return True
            try:
                self._install(i, key, link)
            except RuntimeError:  # closed meanwhile: let go of
                return True
        log.info("layer %d: the native poller reads table %r over %s again", self.layers[i], self.plans[i].table,
                 key[0])  # fmt: skip
        return True

    def _check_connections(self) -> None:
        """(the keeper, every few tens of ms) A tcp connection the server closed while idle (its idle timeout)
        is dropped before a step needs it, and connected anew: the layer's steps meanwhile through the
        client's transport, never the policy."""
        for i in range(len(self.layers)):
            with self._lock:
                key = self._reads[i]
                if key is None or key[0] != "tcp" or self._closed:
                    continue
                if not self._poller.poll_closed(i):
                    continue
                self._reads[i] = ("host", key[1])  # the thread hands its steps over now (see set_host)
                route = self._readers[i].route()
                if self._want[i] == key and route.node is key[1]:
                    self._keeper.want(i, key, route)
            log.info("layer %d: the server closed the native poller's idle connection: connecting again",
                     self.layers[i])  # fmt: skip

    def _keep(self, i: int, link) -> None:
        """Layer ``i``'s rdma link is ``link`` from now on (None: none); the one before (the thread let go of
        it: every set_* waits for a gather in progress) closed."""
        old, self._links[i] = self._links[i], link
        if old is not None and old is not link:
            _close_link(old)

    # ------------------------------------------------------------------ steps handed over
    def _serve_handoffs(self) -> None:
        """The Python side of ``set_host``: gathers each step handed over through the client's transport, into
        the layer's staging, by the step's deadline, and releases it (the thread applies the policy to a step
        nobody took by then)."""
        while True:
            job = self._poller.take_handoff(0.5)
            if job is None:
                if self._closed:
                    return
                continue
            i, step, tokens, deadline = job
            self._handed[i].inc()
            ok, why, late = True, "", False
            try:
                ok, why, late = self._host_gather(i, tokens, deadline)
            except Exception as e:  # noqa: BLE001  (the step is released whatever happened: the GPU never waits)
                ok, why = False, f"the client's transport failed: {e}"
            finally:
                self._poller.finish_handoff(i, step, ok, why[:200], late)

    def _host_gather(self, i: int, tokens: int, deadline: float) -> tuple[bool, str, bool]:
        """Layer ``i``'s step of ``tokens`` tokens through the client's transport: (ok, why not, timed out)."""
        ids, staging = self._ids[i][:tokens], self._staging[i][:tokens]
        want, into, live = ids, staging, None
        if self._dead_id is not None:  # the live ids only, then spread (dead ids' rows zero)
            flat = ids.reshape(-1)
            dead = flat == self._dead_id
            if dead.any():
                live = np.flatnonzero(~dead)
                want, into = flat[live], np.empty((live.size, staging.shape[-1]), dtype=np.uint8)
        if want.size:
            try:
                handle = self._tables[i].gather_async(want, out=into)
            except (TableClientError, TimeoutError, OSError, ValueError) as e:
                return False, str(e), False
            try:
                handle.wait(max(deadline - time.monotonic(), 0.0))
            except GatherTimeout:
                handle.cancel()  # a barrier: nothing of it lands after the release
                return False, "rows not in place by the deadline (watchdog)", True
            except (TableClientError, TimeoutError, OSError, ValueError) as e:
                handle.cancel()
                return False, str(e), False
        if live is not None:
            flat = staging.reshape(-1, staging.shape[-1])
            flat.fill(0)
            flat[live] = into
        return True, "", False

    # ------------------------------------------------------------------ steps (the contract: graph/poller/__init__.py)
    kind = "native"

    def busy(self) -> bool:
        return self._poller.busy()

    def arm(self, tokens: int, timeout: float) -> None:
        """The next step of ``tokens`` tokens, once the last one was released and consumed (bounded by
        ``timeout``): each layer's source refreshed (never waiting on a connect), then armed with its ids due
        ``timeout`` seconds from now (after whatever the refresh did)."""
        end = time.monotonic() + timeout
        while self._poller.busy():
            if self._closed:
                raise GraphStepError(CLOSED)
            if time.monotonic() >= end:
                raise GraphStepError(
                    f"layers {sorted(self.layers)}: the last step was not released and consumed within "
                    f"{timeout:g} s: a replay was armed and never launched (call reset() after a failed replay)"
                )
            time.sleep(0.0002)  # the GPU's consumption notifies nobody: poll
        if self._closed:
            raise GraphStepError(CLOSED)
        self.account()  # first: a step before that ran out of time marks its node silent for refresh, which
        for i in range(len(self.layers)):  # then serves the policy at once instead of waiting on a node
            self.refresh(i)  # that does not answer
        deadline = time.monotonic() + timeout
        self._poller.arm(tokens, [deadline] * len(self.layers))

    def wait_released(self, timeout: float):
        """(layer, message) of the step's failed layers once every layer is released; None past ``timeout``."""
        errors = self._poller.wait_released(timeout)
        return None if errors is None else [(self.layers[i], message) for i, message in errors]

    def after_replay(self, timeout: float) -> None:
        errors = self.wait_released(timeout + 1.0)
        if errors is None:
            raise GraphStepError("in_graph layers not released by their deadline: the native poller is stuck")
        if errors:
            layer, message = errors[0]
            raise GraphStepError(f"layer {layer}: {message} (policy fail: the step's output must not be read)")

    def reset(self) -> None:
        if not self._closed:
            self._poller.reset()

    def released_at(self, layer: int) -> float:
        return self._poller.released_at(self.layers.index(layer))

    def silence(self, layer: int) -> Silence:
        """Layer ``layer``'s silence (whether its node answers since a step ran out of time; its probes)."""
        return self._silence[self.layers.index(layer)]

    def account(self) -> None:
        """What the thread did since the last call, into the metrics (off the hot path)."""
        for i, seconds, how, zeroed in self._poller.take_events():
            if zeroed:  # a step served zero rows (the metric counts steps)
                self._zeros[i].inc()
            if how == ROWS:
                self._waits[i].observe(seconds)
                if seconds > self.plans[i].window_s:
                    self._misses[i].inc()
            elif how == LATE:  # its ids came, its rows did not: the node ran out of time
                self._watchdog[i].inc()
                log.warning("layer %d: rows not in place %.1f ms after the graph's ids (the gather's budget or the "
                            "step's deadline): released with zero rows", self.layers[i], seconds * 1e3)  # fmt: skip
                with self._lock:
                    read = self._reads[i]
                node = read[1] if read is not None and read[1] is not None else self._readers[i].route().node
                if self._silence[i].late(node):
                    log.warning(SILENT, self.layers[i])
            elif how == WATCHDOG:  # the graph was late, not the node (its next steps read it as ever)
                self._watchdog[i].inc()
                log.warning("layer %d: the graph's ids did not come by the deadline: released with zero rows",
                            self.layers[i])  # fmt: skip
            elif how == UNARMED:
                log.error("layer %d: a graph published ids of a step nobody armed: released with zero rows "
                          "(the engine must call arm() before each replay)", self.layers[i])  # fmt: skip

    def close(self) -> None:
        """Stops the thread, the keeper and the handoff thread; lets go of every connection. Idempotent."""
        with self._lock:
            self._closed = True
        self._poller.close()  # take_handoff answers None from now on; a step handed over is finished first
        self._keeper.close()
        if self._handoffs.is_alive():
            self._handoffs.join(timeout=10)
        self._release_cpu()
        with self._lock:
            for i in range(len(self._links)):
                self._keep(i, None)
        for silence in self._silence:
            silence.clear()


class _PackedOnly(ValueError):
    """The node registered no memory of the table for READs: served packed only (the client's transport)."""


def _close_link(link) -> None:
    """Closes a connection that never became (or no longer is) a slot's source: a socket, or an rdma link."""
    for part in link:
        part.close()
