"""Per-gather metrics recorded off the hot path: counters and one latency histogram, updated together.

Client and server both record once per gather (rows, bytes, latency). prometheus_client's ``inc`` and
``observe`` check their arguments and take a lock per value, several microseconds a request with caches
cold after a gather. A :class:`Recorder` instead appends one tuple to a deque (``defer``, ``count``,
``observe``) and applies the batch later (``flush``) through the same public ``inc``/``observe``, so the
values land wherever prometheus_client keeps them (in multiprocess mode, its files): each counter gets
one ``inc`` of the batch's sum, the histogram one ``observe`` per latency. Whoever owns a registry
registers :class:`FlushFirst` in it before its metrics, so every collection (a scrape,
``get_sample_value``) first applies what waits: a scrape sees every gather that returned before it.
``flush`` also runs inline once MAX_DEFERRED gathers wait, so memory stays bounded.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref

#: deferred gathers one recorder holds before it applies them inline
MAX_DEFERRED = 1024


class Recorder:
    """One latency histogram child and N counter children: ``defer(*amounts, seconds)`` per gather."""

    __slots__ = ("latency", "counters", "_deferred", "_applying", "__weakref__")

    def __init__(self, latency, *counters):
        self.latency, self.counters = latency, counters
        self._deferred: collections.deque = collections.deque()
        self._applying = threading.Lock()  # held by a flush from popping to applied (defer never takes it)

    def defer(self, *values) -> None:
        """One gather: ``values`` is the counters' amounts, then its latency in seconds (NaN: none),
        applied later in a batch (one deque append on the gather's path)."""
        deferred = self._deferred
        deferred.append(values)
        if len(deferred) >= MAX_DEFERRED:
            self.flush()

    def count(self, *amounts) -> None:
        """The counters' amounts of a gather whose latency is not known yet (``observe`` adds it)."""
        self.defer(*amounts, math.nan)

    def observe(self, seconds: float) -> None:
        """The latency of a gather already counted."""
        self.defer(*(0,) * len(self.counters), seconds)

    @property
    def pending(self) -> int:
        """Gathers deferred and not yet applied."""
        return len(self._deferred)

    def flush(self) -> None:
        """Applies the deferred gathers: summed counters, then each latency observed.
        Safe from any thread: each deferred gather is popped, so applied, once, and a flush returns only
        once every gather deferred before it was applied (a second flush waits for one in progress)."""
        with self._applying:
            items, pop = [], self._deferred.popleft
            try:
                while True:
                    items.append(pop())
            except IndexError:
                pass
            if items:
                self._apply(items)

    def __del__(self):
        try:  # a recorder dropped with gathers still deferred applies them first
            if self._deferred:
                self.flush()
        except Exception:
            pass

    def _apply(self, items: list) -> None:
        columns = list(zip(*items))
        for counter, amounts in zip(self.counters, columns):
            total = sum(amounts)
            if total:
                counter.inc(total)
        observe = self.latency.observe
        for seconds in columns[-1]:
            if seconds == seconds:  # NaN: counted only
                observe(seconds)


class FlushFirst:
    """A collector that yields nothing and, registered before the metrics it guards, applies their
    recorders' deferred gathers at the start of every collection of its registry."""

    def __init__(self, recorders: weakref.WeakSet[Recorder] | None = None):
        self.recorders: weakref.WeakSet = recorders if recorders is not None else weakref.WeakSet()

    def add(self, recorder: Recorder) -> Recorder:
        self.recorders.add(recorder)
        return recorder

    def flush(self) -> None:
        for recorder in list(self.recorders):
            recorder.flush()

    def describe(self):
        return []

    def collect(self):
        self.flush()
        return []


def add_metrics(owner, registry, definitions) -> None:
    """Creates each metric of ``definitions`` in ``registry`` as an attribute of ``owner``: an entry is
    ``(attribute, metric type, name, labels, help)``, then optionally a dict of keyword arguments
    (``buckets``, ``multiprocess_mode``), in the order the registry exports them."""
    for attribute, kind, name, labels, documentation, *options in definitions:
        metric = kind(name, documentation, labels, registry=registry, **(options[0] if options else {}))
        setattr(owner, attribute, metric)
