"""Prometheus metrics of the client library (``tableserver_client_*``).

Library rules (docs/DESIGN.md, "Observability"):

* metrics are created lazily, on the first :class:`~tableclient.TableClient`,
  in prometheus_client's default registry, so a host process that already
  exposes metrics (SGLang does) exports ours with its own;
* inside SGLang prometheus_client runs in **multiprocess mode**
  (``PROMETHEUS_MULTIPROC_DIR``): every worker writes its values to files and
  the host's exporter aggregates them. Gauges therefore say how to aggregate
  (``multiprocess_mode``), and this library **never starts an HTTP server**
  on its own. A standalone client calls :func:`start_http_server` explicitly
  (it aggregates the multiprocess directory when one is set);
* labels stay low-cardinality: table, layer, transport, mode, reason.

Latency buckets default to 2 us .. ~0.5 s (exponential, x2); override them
with ``TABLESERVER_CLIENT_LATENCY_BUCKETS="0.00001,0.0001,..."`` (seconds)
before the first client is created.
"""

from __future__ import annotations

import atexit
import os
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tableserver.common.recorder import FlushFirst, Recorder, add_metrics

#: exponential latency buckets, 2 us .. ~0.5 s
DEFAULT_BUCKETS = tuple(2e-6 * 2**k for k in range(19))
BUCKETS_ENV = "TABLESERVER_CLIENT_LATENCY_BUCKETS"
#: the labels of the per-gather counters
GATHER_LABELS = ("table", "layer", "transport")
#: error reasons (label values of tableserver_client_errors_total), all exported from the start
ERROR_REASONS = ("bad_row_ids", "timeout", "remote", "transport", "connect", "auth", "other")


def latency_buckets(environ=None) -> tuple[float, ...]:
    """The histogram buckets: ``TABLESERVER_CLIENT_LATENCY_BUCKETS`` or the default."""
    value = (os.environ if environ is None else environ).get(BUCKETS_ENV, "").strip()
    if not value:
        return DEFAULT_BUCKETS
    try:
        buckets = tuple(sorted(float(x) for x in value.split(",") if x.strip()))
    except ValueError:
        raise ValueError(
            f"{BUCKETS_ENV}={value!r}: expected comma-separated seconds, e.g. 0.00001,0.0001,0.001"
        ) from None
    if not buckets or buckets[0] <= 0:
        raise ValueError(f"{BUCKETS_ENV}={value!r}: expected positive bucket bounds in seconds")
    return buckets


class ClientMetrics:
    """Every client metric, in one registry (the default one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None, buckets: tuple[float, ...] | None = None):
        r = registry if registry is not None else REGISTRY
        r.register(_flush_first)  # first: a collection applies deferred gathers before reading ours
        latency = {"buckets": buckets or latency_buckets()}
        # fmt: off
        add_metrics(self, r, (  # (attribute, metric type, name, labels, help[, keyword arguments])
            ("gather_latency", Histogram, "tableserver_client_gather_duration_seconds", ("table", "layer", "transport", "mode"),
             "Time from issuing a gather to its rows being in place in the caller's buffer.", latency),
            ("rows", Counter, "tableserver_client_rows_total", GATHER_LABELS, "Row ids gathered (duplicates included)."),
            ("unique_rows", Counter, "tableserver_client_unique_rows_total", GATHER_LABELS,
             "Distinct rows fetched from the server (rows_total minus duplicates a gather fetched once)."),
            ("bytes", Counter, "tableserver_client_read_bytes_total", GATHER_LABELS, "Row bytes fetched from the server."),
            ("layer_waits", Counter, "tableserver_client_layer_waits_total", ("layer",),
             "Per-layer waits of the step API (one per layer per decode step)."),
            ("deadline_misses", Counter, "tableserver_client_deadline_misses_total", ("layer",),
             "Per-layer waits whose rows were not in place by the layer's window."),
            ("window", Gauge, "tableserver_client_layer_window_seconds", ("layer",),
             "Each layer's window: how long after step start its rows are due.", {"multiprocess_mode": "max"}),
            ("zero_rows", Counter, "tableserver_client_zero_rows_served_total", ("layer",),
             "Steps where a layer was served zero rows after a failure (failure policy 'zeros')."),
            ("fallbacks", Counter, "tableserver_client_fallbacks_total", ("layer",),
             "Steps where a layer's rows came from the fallback transport (failure policy 'fallback')."),
            ("graph_waits", Histogram, "tableserver_client_graph_wait_seconds", ("layer", "phase"),
             "Graph-safe steps, per layer: before_replay, from the start of the host's gathers to the layer's rows "
             "in place (the GPU waits that long before the step); in_graph, from the graph's ids seen to the rows "
             "released to it.", latency),
            ("watchdog_releases", Counter, "tableserver_client_watchdog_releases_total", ("layer",),
             "Steps of in_graph layers whose rows the watchdog released at the layer's timeout (filled by the "
             "failure policy), so the GPU never waited forever."),
            ("graph_handoffs", Counter, "tableserver_client_graph_handoffs_total", ("layer",),
             "Steps of in_graph layers the native poller handed to the client's own transport (a source it cannot "
             "read itself, one being connected again, or a connection the server had closed): rows as ever, a GIL "
             "wake-up later."),
            ("sessions", Gauge, "tableserver_client_sessions", ("transport",), "Open client sessions, by data transport.",
             {"multiprocess_mode": "livesum"}),
            ("connects", Counter, "tableserver_client_connects_total", ("transport",), "Sessions opened with a tableserver."),
            ("reconnects", Counter, "tableserver_client_reconnects_total", (),
             "Sessions opened with a server whose previous session in this process had been lost."),
            ("session_losses", Counter, "tableserver_client_session_losses_total", (),
             "Sessions lost (keepalive stream broken: server gone or unreachable)."),
            ("errors", Counter, "tableserver_client_errors_total", ("reason",), "Failed gathers and connects, by reason."),
            ("replica_up", Gauge, "tableserver_client_replica_up", ("address",), "Whether this client can read from a "
             "memory node (1) or has failed it or refused its data (0), by address.", {"multiprocess_mode": "livemin"}),
            ("failovers", Counter, "tableserver_client_failovers_total", (),
             "Gather parts re-issued on another replica after their node failed."),
            ("hedges", Counter, "tableserver_client_hedges_total", ("outcome",),
             "Hedged reads: issued on a second replica when the first was late, and won (answered first)."),
            ("version_refusals", Counter, "tableserver_client_version_refusals_total", (),
             "Nodes refused because a table there differs from the pinned version (checksum, rows, row size)."),
            ("freed_host", Gauge, "tableserver_client_freed_table_host_bytes", ("layer",),
             "Host memory the engine did not allocate in this process for an Engram layer's table because a "
             "tableserver serves the layer (this process's share where the engine shares one copy).",
             {"multiprocess_mode": "livesum"}),
            ("freed_device", Gauge, "tableserver_client_freed_table_device_bytes", ("layer",),
             "GPU memory the engine did not allocate in this process for an Engram layer's table because a "
             "tableserver serves the layer.", {"multiprocess_mode": "livesum"}),
        ))
        # fmt: on
        for outcome in ("issued", "won"):
            self.hedges.labels(outcome)
        self.failovers.inc(0)
        self.version_refusals.inc(0)
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        self.reconnects.inc(0)
        self.session_losses.inc(0)
        self._recorders: dict[tuple, GatherRecorder] = {}
        self._recorders_lock = threading.Lock()

    def recorder(self, table: str, layer: str, transport: str, mode: str) -> GatherRecorder:
        """The one recorder of these label values, for the process's life: every RemoteTable of the
        table shares it, so gathers deferred through a table object that is dropped right after
        (``client.table(name).gather(ids)``) are still applied."""
        key = (table, layer, transport, mode)
        recorder = self._recorders.get(key)
        if recorder is None:
            with self._recorders_lock:
                recorder = self._recorders.get(key)
                if recorder is None:
                    recorder = self._recorders[key] = GatherRecorder(
                        self.gather_latency.labels(table, layer, transport, mode),
                        self.rows.labels(table, layer, transport),
                        self.unique_rows.labels(table, layer, transport),
                        self.bytes.labels(table, layer, transport),
                    )
        return recorder

    def error(self, exc: BaseException) -> None:
        self.errors.labels(error_reason(exc)).inc()


def error_reason(exc: BaseException) -> str:
    from tableclient.errors import (
        AuthError,
        ConnectError,
        GatherTimeout,
        RemoteError,
        TransportError,
    )

    if isinstance(exc, ValueError):
        return "bad_row_ids"  # refused before anything was sent (ids or out buffer)
    for cls, reason in (
        (GatherTimeout, "timeout"),
        (RemoteError, "remote"),
        (AuthError, "auth"),
        (TransportError, "transport"),
        (ConnectError, "connect"),
    ):
        if isinstance(exc, cls):
            return reason
    return "transport" if isinstance(exc, (OSError, ConnectionError)) else "other"


class GatherRecorder(Recorder):
    """The metric children of one (table, layer, transport, mode), updated together once per gather:
    ``defer(rows, unique_rows, nbytes, seconds)``, or ``count`` at issue and ``observe`` at the wait
    (``tableserver.common.recorder.Recorder``; deferred gathers are applied by every scrape of this
    process's registry, the client's maintenance tick (50 ms), close and exit)."""

    __slots__ = ()

    def __init__(self, latency, rows, unique_rows, nbytes):
        super().__init__(latency, rows, unique_rows, nbytes)
        _flush_first.add(self)


#: every client recorder of this process, flushed by scrapes (registered first in the registry)
_flush_first = FlushFirst()


def flush_deferred() -> None:
    """Applies every recorder's deferred gathers (called by scrapes, the routing tick, close, exit)."""
    _flush_first.flush()


atexit.register(flush_deferred)


_lock = threading.Lock()
_metrics: ClientMetrics | None = None


def metrics() -> ClientMetrics:
    """The process's client metrics, created on first use."""
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = ClientMetrics()
    return _metrics


def start_http_server(port: int, addr: str = "127.0.0.1") -> int:
    """Explicitly serves /metrics for a standalone client; returns the bound port.

    Never called by the library itself. In multiprocess mode it serves the
    aggregate of every process writing to ``PROMETHEUS_MULTIPROC_DIR``.
    """
    import prometheus_client
    from prometheus_client import multiprocess

    metrics()
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    server, _thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return server.server_port
