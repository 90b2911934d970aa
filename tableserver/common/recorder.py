"""Per-gather metrics recorded off the hot path: counters and one latency histogram, updated together.

Client and server both record once per gather (rows, bytes, latency). prometheus_client's public
``inc``/``observe`` check their arguments and take a lock per value, several microseconds a request
with caches cold after a gather. A :class:`Recorder` instead appends one tuple to a deque (``defer``) and
applies the batch later (``flush``): counters summed, latencies bucketed in one vectorized pass.
Whoever owns a registry registers :class:`FlushFirst` in it before its metrics, so every collection
(a scrape, ``get_sample_value``) first applies what waits: a scrape sees every gather that returned
before it. ``flush`` also runs inline once MAX_DEFERRED gathers wait, so memory stays bounded.

``direct`` updates call prometheus_client's value objects (``_value.inc``, the histogram's
``_buckets``/``_sum``) where the installed version has them, and the public API otherwise;
tests/unit/test_units.py checks that both export the same samples.
"""

from __future__ import annotations

import collections
import threading
import weakref
from bisect import bisect_left

import numpy as np

#: deferred gathers one recorder holds before it applies them inline
MAX_DEFERRED = 1024


class Recorder:
    """One latency histogram child and N counter children: ``defer(*amounts, seconds)`` per gather."""

    __slots__ = ("latency", "counters", "_incs", "_sum", "_buckets", "_bounds", "_deferred", "_applying", "__weakref__")

    def __init__(self, latency, *counters, direct: bool = True):
        self.latency, self.counters = latency, counters
        self._incs = None
        self._deferred: collections.deque = collections.deque()
        self._applying = threading.Lock()  # held by a flush from popping to applied (defer never takes it)
        if direct:
            try:
                incs = tuple(c._value.inc for c in counters)
                buckets = [b.inc for b in latency._buckets]
                bounds = [float(b) for b in latency._upper_bounds]
                total = latency._sum.inc
            except AttributeError:
                return
            if len(buckets) == len(bounds) and bounds[-1] == float("inf"):
                self._incs, self._buckets, self._bounds, self._sum = incs, buckets, bounds, total

    def count(self, *amounts) -> None:
        incs = self._incs
        if incs is None:
            for counter, amount in zip(self.counters, amounts):
                counter.inc(amount)
        else:
            for inc, amount in zip(incs, amounts):
                inc(amount)

    def observe(self, seconds: float) -> None:
        if self._incs is None:
            self.latency.observe(seconds)
        else:  # the first bucket whose upper bound is >= seconds, as Histogram.observe picks it
            self._sum(seconds)
            self._buckets[bisect_left(self._bounds, seconds)](1)

    def record(self, *values) -> None:
        """``count(*amounts)`` and ``observe(seconds)`` now: ``values`` is the amounts, then the seconds."""
        self.count(*values[:-1])
        self.observe(values[-1])

    def defer(self, *values) -> None:
        """``record``, applied later in a batch (one deque append on the gather's path)."""
        deferred = self._deferred
        deferred.append(values)
        if len(deferred) >= MAX_DEFERRED:
            self.flush()

    def flush(self) -> None:
        """Applies the deferred gathers: summed counters, latencies bucketed in one vectorized pass.
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
        a = np.array(items, dtype=np.float64)
        self.count(*(int(total) for total in a[:, :-1].sum(axis=0).tolist()))
        seconds = a[:, -1]
        if self._incs is None:
            for s in seconds.tolist():
                self.latency.observe(s)
            return
        self._sum(float(seconds.sum()))
        # side="left": the first bucket whose upper bound is >= the latency, as Histogram.observe picks it
        which, counts = np.unique(np.searchsorted(self._bounds, seconds, side="left"), return_counts=True)
        for i, n in zip(which.tolist(), counts.tolist()):
            self._buckets[i](n)


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
