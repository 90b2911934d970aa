"""The per-worker step API a serving engine calls every decode step.

    step = EngramStep(client, [LayerPlan(1, "engram.layer1", 0.3e-3),
                               LayerPlan(14, "engram.layer14", 9.3e-3)], max_tokens=256)
    step.begin_step({1: ids1, 14: ids14})     # at step start: every gather issued, shortest window first
    ...                                         # layers 0.. run on the GPU
    rows1 = step.wait(1)                       # torch uint8 [T, 24, 264], a view of fixed staging
    rows14, event = step.wait_to_device(14)    # optional copy into a persistent device tensor

Why this shape (SGLang #39205, vLLM #57023): row ids depend only on tokens,
so fetching starts at step start and overlaps earlier layers; the fetch and
the wait run outside CUDA graphs, and only the host-to-device copy and the
dequantization are captured. A captured graph bakes in buffer addresses, so
every layer's rows land in a **persistent staging buffer allocated once**
(pinned when CUDA is there) and, optionally, a persistent device tensor: no
allocation per step, same addresses every step.

With a device, a layer whose rows this process maps (shm) is gathered in
``begin_step`` itself and its host-to-device copy is queued right there, on the
step's side stream: by the time the layer waits, its rows are usually on the
GPU already. Every copy into the device tensors is ordered after the work that
was queued on the calling thread's current stream when ``begin_step`` ran (the
previous step's readers of those tensors: call it from the forward's thread and
stream), and nothing later, so a late layer's copy does not wait for this step's
earlier layers. ``begin_step`` refills the staging only once the previous step's
copies out of it (``wait_to_device``'s, and any event handed to ``fence``, e.g. of
a captured copy of your own) have finished.

Each ``wait`` records when the rows arrived relative to the layer's window.
Failure policy per deployment: ``fail`` raises, ``zeros`` serves zero rows
(counted), ``fallback`` re-gathers through another client (e.g. tcp, or a
second memory node) and raises only if that fails too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from tableclient.errors import TableClientError
from tableclient.metrics import metrics
from tableserver.common.buffers import pinned_rows_buffer, rows_buffer

log = logging.getLogger(__name__)

POLICIES = ("fail", "zeros", "fallback")
#: the earliest a layer's gather is hedged after step start, however short its window
MIN_HEDGE_S = 1e-4


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    table: str
    window_s: float  # the layer needs its rows this long after step start
    mode: str = "read"


@dataclass
class LayerStats:
    steps: int = 0
    deadline_misses: int = 0
    zeros_served: int = 0
    fallbacks: int = 0
    latencies: list = field(default_factory=list)  # seconds from step start until wait() returned
    arrivals: list = field(default_factory=list)  # seconds from step start until the rows were in place

    def summary(self) -> dict:
        lat = np.array(self.latencies) if self.latencies else np.zeros(1)
        return {
            "steps": self.steps,
            "deadline_misses": self.deadline_misses,
            "zeros_served": self.zeros_served,
            "fallbacks": self.fallbacks,
            "p50_s": float(np.percentile(lat, 50)),
            "p99_s": float(np.percentile(lat, 99)),
        }


class _Failed:
    """Stands in for a handle whose gather could not even be issued."""

    def __init__(self, error: BaseException):
        self.error = error

    def wait(self, timeout=None):
        raise self.error


class _Done:
    """A gather that completed while it was issued (the rows are in place)."""

    def __init__(self):
        self.completed_at = time.perf_counter()

    def wait(self, timeout=None):
        return None


class EngramStep:
    """Issues a step's gathers at step start and hands each layer its rows when it waits.

    ``dead_id``: an engine's marker for padding (vLLM's ``DEAD_ID``): ids equal to it are never sent,
    and their rows come back as zeros (in ``wait`` and in ``gather_now``/``gather_into``)."""

    def __init__(self, client, plans: list, max_tokens: int, *, rows_per_token: int = 24, policy: str = "fail",
                 fallback=None, device=None, pin: bool | None = None, timeout: float = 5.0,
                 keep_latencies: int = 100_000, deadlines: bool = True, hedge: bool = True,
                 dead_id: int | None = None):  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"unknown failure policy {policy!r}: use {', '.join(POLICIES)}")
        if policy == "fallback" and fallback is None:
            raise ValueError("policy 'fallback' needs fallback= (another TableClient)")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.client, self.fallback, self.policy = client, fallback, policy
        self.plans = sorted(plans, key=lambda p: p.window_s)  # shortest window first
        self.max_tokens, self.rows_per_token, self.timeout = max_tokens, rows_per_token, timeout
        self.keep = keep_latencies
        # False where begin_step is not the model's step start (e.g. a scheduler staging the next batch):
        # waits are then not compared with the layers' windows, in stats or metrics.
        self.deadlines = deadlines
        self.hedge = hedge  # with replicas: re-issue a late layer elsewhere at hedge_fraction of its window
        #: an engine's marker for padding (vLLM's DEAD_ID): such ids are never sent, their rows are zeros
        self.dead_id = dead_id
        self.tables = {p.layer: client.table(p.table, mode=p.mode) for p in self.plans}
        self.stats = {p.layer: LayerStats() for p in self.plans}
        m = metrics()
        # metric children per layer: (waits, deadline misses, zero rows served, fallbacks)
        self._inst = {
            p.layer: (
                m.layer_waits.labels(str(p.layer)),
                m.deadline_misses.labels(str(p.layer)),
                m.zero_rows.labels(str(p.layer)),
                m.fallbacks.labels(str(p.layer)),
            )
            for p in self.plans
        }
        for p in self.plans if deadlines else ():
            m.window.labels(str(p.layer)).set(p.window_s)
        self._torch = _torch()
        cuda = self._torch is not None and self._torch.cuda.is_available()
        pin = cuda if pin is None else pin
        self.staging, self._staging_np = {}, {}
        for p in self.plans:  # allocated once: these addresses never change
            shape = (max_tokens, rows_per_token, self.tables[p.layer].row_bytes)
            # placed half a page off alignment: a socket's copy into them does not 4K-alias (buffers.py)
            if self._torch is not None:
                buf = pinned_rows_buffer(self._torch, shape[:-1], shape[-1], pin)
                self.staging[p.layer], self._staging_np[p.layer] = buf, buf.numpy()
            else:
                buf = rows_buffer(shape[:-1], shape[-1])
                self.staging[p.layer] = self._staging_np[p.layer] = buf
        self.device_rows, self._events, self._stream, self._readers = {}, {}, None, None
        self._copied: dict = {}  # layer -> this step's copy to the device is queued (begin_step or a wait)
        self._fences: list = []  # events of other reads of the staging (fence), waited for by begin_step
        if device is not None:
            torch = self._torch
            self._stream = torch.cuda.Stream(device=device)
            self._readers = torch.cuda.Event()  # recorded on the caller's stream at each begin_step
            for p in self.plans:
                shape = self.staging[p.layer].shape
                self.device_rows[p.layer] = torch.empty(shape, dtype=torch.uint8, device=device)
                self._events[p.layer] = torch.cuda.Event()
        self._handles: dict = {}
        self._ids: dict = {}
        self._live: dict = {}  # layer -> (positions of its live ids, dead mask) when this step has dead ids
        self._tokens = 0
        self._t0 = 0.0
        self.issue_order: list = []

    @property
    def started_at(self) -> float:
        """``time.perf_counter()`` when the current step's gathers were issued (0.0 before the first)."""
        return self._t0

    @property
    def copy_stream(self):
        """The side stream the copies to the device run on (``wait_to_device``); None without ``device=``."""
        return self._stream

    def copy_queued(self, layer: int) -> bool:
        """Whether this step's copy of ``layer``'s rows to the device is queued already: ``begin_step`` queues it
        for a layer it copied itself (the shortest window's, mapped here over shm), ``wait_to_device`` for the
        others."""
        return self._copied.get(layer, False)

    # ---------------------------------------------------------------- a step
    def begin_step(self, row_ids: dict) -> None:
        """Issues every layer's gather now, shortest window first. ``row_ids[layer]`` is ``[T, 24]``.

        A gather of the previous step nobody waited for is cancelled first: its late rows never land
        in the staging buffers this step fills.
        """
        self.abandon()
        if self._copied or self._fences:
            self._copies_done()
        self._t0 = time.perf_counter()
        if self._stream is not None:  # what the previous step queued, its readers of the device rows included
            self._readers.record(self._torch.cuda.current_stream(self._stream.device))
        self._handles, self.issue_order, self._ids, self._live = {}, [], {}, {}
        sizes = set()
        for p in self.plans:
            ids = row_ids[p.layer]
            t = len(ids)
            if t > self.max_tokens:
                raise ValueError(f"{t} tokens in a step, this EngramStep holds {self.max_tokens}")
            sizes.add(t)
            out = self._staging_np[p.layer][:t]
            live = self._live_ids(p.layer, ids)
            if live is not None:  # only the live ids are sent, into the staging's first rows
                self._live[p.layer] = live
                ids = np.asarray(ids).reshape(-1)[live[0]]
                out = self._staging_np[p.layer].reshape(-1, out.shape[-1])[: ids.size]
            self._ids[p.layer] = ids  # a reference, for the fallback policy
            try:
                table = self.tables[p.layer]
                local = table.reader.local() if not self.issue_order else None
                if live is not None and not ids.size:  # every id dead: nothing to send
                    self._handles[p.layer] = _Done()
                    self._spread(p.layer, t)
                elif local is not None:
                    # the shortest window's rows are mapped here (shm): one copy now, in this thread, beats
                    # handing it to a worker (a wake-up) while this thread races on to the next layer
                    table.take_local(local, ids, out)
                    self._handles[p.layer] = _Done()
                    if live is not None:
                        self._spread(p.layer, t)
                    if self._stream is not None:  # and on its way to the GPU while the next layer is issued
                        self._copy_to_device(p.layer, t)
                else:
                    self._handles[p.layer] = self.tables[p.layer].gather_async(
                        ids, out=out, hedge_after=self._hedge_after(p)
                    )
            except ValueError:
                raise  # bad row ids are the caller's bug, whatever the policy
            except (TableClientError, OSError) as e:
                self._handles[p.layer] = _Failed(e)
            self.issue_order.append(p.layer)
        if len(sizes) > 1:
            raise ValueError(f"every layer needs row ids for the same tokens, got sizes {sorted(sizes)}")
        self._tokens = sizes.pop() if sizes else 0

    def pending(self) -> list:
        """Layers issued by ``begin_step`` and not yet waited for."""
        return list(self._handles)

    def abandon(self) -> None:
        """Cancels every gather not waited for (their rows never land in the staging buffers)."""
        for handle in self._handles.values():
            getattr(handle, "cancel", lambda: None)()
        self._handles = {}
        self._live = {}

    def _live_ids(self, layer: int, ids):
        """(positions of the live ids in ``ids`` flattened, mask of the dead ones) when some of ``ids`` are
        ``dead_id``, else None (every id is sent as it is)."""
        if self.dead_id is None:
            return None
        ids = np.asarray(ids)
        dead = ids == self.dead_id
        if not dead.any():
            return None
        if ids.shape[1:] != (self.rows_per_token,):
            raise ValueError(
                f"layer {layer}: row ids of shape {tuple(ids.shape)}: pass [T, {self.rows_per_token}] ids, "
                "the shape of its staging"
            )
        return np.flatnonzero(~dead), dead.reshape(-1)

    def _spread(self, layer: int, tokens: int) -> None:
        """The live ids' rows, gathered into the staging's first rows, moved to their places among the
        step's ``tokens`` tokens; the dead ids' rows zeroed."""
        live, dead = self._live.pop(layer)
        rows = self._staging_np[layer][:tokens]
        flat = rows.reshape(-1, rows.shape[-1])
        if live.size:
            flat[live] = flat[: live.size]  # live is ascending: numpy buffers the overlapping source
        flat[dead] = 0

    def wait(self, layer: int):
        """That layer's rows: a ``[T, 24, row_bytes]`` view of its persistent staging buffer."""
        handle = self._handles.pop(layer)
        view = self._staging_np[layer][: self._tokens]
        sparse = layer in self._live
        if sparse:  # only the live ids were gathered, into the first rows
            view = view.reshape(-1, view.shape[-1])[: self._ids[layer].size]
        stats = self.stats[layer]
        try:
            handle.wait(self.timeout)
        except (TableClientError, TimeoutError, OSError) as e:
            getattr(handle, "cancel", lambda: None)()  # late rows must not overwrite what the policy serves
            self.on_failure(layer, view, self._ids[layer], e)
        if sparse:
            self._spread(layer, self._tokens)
        now = time.perf_counter()
        elapsed = now - self._t0
        done_at = getattr(handle, "completed_at", 0.0)
        stats.steps += 1
        if not self.deadlines:
            return self.staging[layer][: self._tokens]
        inst = self._inst[layer]
        inst[0].inc()
        if len(stats.latencies) < self.keep:
            stats.latencies.append(elapsed)
            stats.arrivals.append((done_at if self._t0 < done_at <= now else now) - self._t0)
        if elapsed > self._plan(layer).window_s:
            stats.deadline_misses += 1
            inst[1].inc()
        return self.staging[layer][: self._tokens]

    def wait_to_device(self, layer: int):
        """(device tensor view, CUDA event): the layer's rows copied on the step's side stream into its
        persistent device tensor; make the reading stream wait on the event (``stream.wait_event``).

        A layer gathered in ``begin_step`` (shm) had its copy queued there already: this only records
        the wait. Otherwise the copy is queued now, after the rows arrived (and after the failure
        policy filled them, if the gather failed). Either way it waits on the GPU only for the work
        queued before ``begin_step``. Call it outside CUDA graph capture: to replay the copy in a graph,
        capture your own ``device_rows[layer].copy_(staging[layer])`` and hand each replay's event to
        ``fence``."""
        if self._stream is None:
            raise RuntimeError("EngramStep was built without device=")
        queued = self._copied.get(layer, False)
        self.wait(layer)
        if not queued:
            self._copy_to_device(layer, self._tokens)
        return self.device_rows[layer][: self._tokens], self._events[layer]

    def fence(self, event) -> None:
        """``event`` (anything with ``synchronize()``, e.g. a CUDA event recorded after your own copy
        out of the staging) marks a read of this step's staging: the next ``begin_step`` waits for it
        before refilling the buffers."""
        if not callable(getattr(event, "synchronize", None)):
            raise TypeError(
                f"fence() needs an event with synchronize() (e.g. torch.cuda.Event), got {type(event).__name__}"
            )
        self._fences.append(event)

    def _copy_to_device(self, layer: int, tokens: int) -> None:
        """Queues the copy of ``tokens`` staged rows of ``layer`` to its device tensor on the side stream,
        after the work queued on the caller's stream before ``begin_step`` (the previous step's readers
        of the device tensor) and nothing later."""
        stream = self._stream
        stream.wait_event(self._readers)
        with self._torch.cuda.stream(stream):
            self.device_rows[layer][:tokens].copy_(self.staging[layer][:tokens], non_blocking=True)
            self._events[layer].record(stream)
        self._copied[layer] = True

    def _copies_done(self) -> None:
        """Blocks until the previous step's reads of the staging buffers finished (before refilling)."""
        for layer in self._copied:
            self._events[layer].synchronize()
        self._copied = {}
        fences, self._fences = self._fences, []
        for event in fences:
            event.synchronize()

    # -------------------------------------------------------------- helpers
    def _hedge_after(self, plan: LayerPlan) -> float | None:
        """With replicas: re-issue a layer's gather elsewhere once this share of its window has passed."""
        if not self.hedge or not getattr(self.client, "replicated", False):
            return None
        return max(plan.window_s * self.client.hedge_fraction, MIN_HEDGE_S)

    def _plan(self, layer: int) -> LayerPlan:
        return next(p for p in self.plans if p.layer == layer)

    def gather_now(self, layer: int, row_ids):
        """One layer's rows fetched now, for ids that were not known at step start (not a step of its own).

        The failure policy applies as in :meth:`wait`. Returns a new ``[*row_ids.shape, row_bytes]``
        uint8 numpy array.
        """
        ids = np.asarray(row_ids)
        out = rows_buffer(ids.shape, self.tables[layer].row_bytes)
        self.gather_into(layer, ids, out)
        return out

    def gather_into(self, layer: int, row_ids, out: np.ndarray, timeout: float | None = None) -> None:
        """One layer's rows for ``row_ids`` gathered now into ``out`` (``[*row_ids.shape, row_bytes]``,
        e.g. a slice of its staging): no allocation where no id is dead, the failure policy applied as in
        :meth:`wait`.
        Returns once the rows are in place; on a failure the gather is cancelled first, so nothing of it
        lands in ``out`` after this returns. Ids equal to ``dead_id`` are not sent: their rows are zeros."""
        dead = None if self.dead_id is None else np.asarray(row_ids) == self.dead_id
        if dead is not None and dead.any():  # the live ids alone, gathered apart, then put in their places
            flat = out.reshape(-1, out.shape[-1])
            live = np.flatnonzero(~dead)
            if live.size:
                rows = rows_buffer(live.shape, flat.shape[-1])
                self._gather_into(layer, np.asarray(row_ids).reshape(-1)[live], rows, timeout)
                flat[live] = rows
            flat[dead.reshape(-1)] = 0
            return
        self._gather_into(layer, row_ids, out, timeout)

    def _gather_into(self, layer: int, row_ids, out: np.ndarray, timeout: float | None) -> None:
        try:
            self.tables[layer].gather(row_ids, out=out, timeout=self.timeout if timeout is None else timeout)
        except (TableClientError, TimeoutError, OSError) as e:
            self.on_failure(layer, out, row_ids, e)

    def on_failure(self, layer: int, view: np.ndarray, row_ids, error: BaseException) -> None:
        """Serves ``layer``'s failed rows into ``view`` by the failure policy: ``fail`` raises ``error``,
        ``zeros`` fills zeros, ``fallback`` gathers ``row_ids`` through the fallback client (counted)."""
        stats = self.stats[layer]
        if self.policy == "fail":
            raise error
        if self.policy == "zeros":
            view.fill(0)
            stats.zeros_served += 1
            self._inst[layer][2].inc()
            if stats.zeros_served in (1, 10, 100) or stats.zeros_served % 1000 == 0:
                log.warning("layer %d: serving zero rows (%d times so far): %s", layer, stats.zeros_served, error)
            return
        plan = self._plan(layer)
        self.fallback.table(plan.table, mode=plan.mode).gather(row_ids, out=view, timeout=self.timeout)
        stats.fallbacks += 1
        self._inst[layer][3].inc()

    def summary(self) -> dict:
        return {layer: s.summary() for layer, s in self.stats.items()}


def _torch():
    try:
        import torch

        return torch
    except ImportError:
        return None
