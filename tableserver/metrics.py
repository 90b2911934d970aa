"""Prometheus metrics of the memory-node daemon.

Counters and histograms are updated on the paths they describe (gRPC calls,
tcp gathers, owner-side packing, errors); everything that is *state* (tables,
pinned and registered bytes, sessions, QPs, serving) is read from the live
objects at scrape time by :class:`_StateCollector`, so a gauge can never
drift from what the daemon holds. Every metric lives in the daemon's own
registry (with the standard process, platform and GC collectors), so two
daemons in one test process never collide.

Names follow Prometheus conventions (docs/DESIGN.md, "Observability"):
``tableserver_`` prefix, base units (``_seconds``, ``_bytes``), ``_total``
counters, low-cardinality labels only (table, layer, transport, op, method,
code, reason, page_size).
"""

from __future__ import annotations

import asyncio
import inspect
import platform
import socket
import threading
import time

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tableserver import __version__
from tableserver.common.recorder import FlushFirst, Recorder, add_metrics
from tableserver.common.wire import Status

#: exponential latency buckets, 2 us .. ~0.5 s (RDMA reads to a slow tcp path)
LATENCY_BUCKETS = tuple(2e-6 * 2**k for k in range(19))
#: gRPC control calls are slower: 50 us .. ~6.5 s
GRPC_BUCKETS = tuple(50e-6 * 2**k for k in range(18))

#: error reasons (the label values of tableserver_errors_total), all exported from the start
ERROR_REASONS = (
    "bad_row_ids",
    "unknown_table",
    "too_many_rows",
    "bad_frame",
    "auth",
    "session_closed",
    "qp_error",
    "disconnect",
    "internal",
    "rate_limited",
    "too_many_sessions",
    "busy",
    "disk_io",
    "accept",
    "handshake_timeout",
    "handshake_evicted",
    "send_timeout",
)
#: the /metrics endpoint: concurrent requests served, and how long one may take to send its request
HTTP_MAX_REQUESTS = 8
HTTP_TIMEOUT_S = 5.0
#: /livez fails when the control plane's event loop has not run for this long
LIVENESS_S = 10.0
STATUS_REASON = {
    Status.ROW_OUT_OF_RANGE: "bad_row_ids",
    Status.UNKNOWN_TABLE: "unknown_table",
    Status.TOO_MANY_ROWS: "too_many_rows",
    Status.BAD_FRAME: "bad_frame",
    Status.UNAUTHENTICATED: "auth",
    Status.SESSION_CLOSED: "session_closed",
    Status.INTERNAL: "internal",
    Status.BUSY: "busy",
    Status.IO_ERROR: "disk_io",
}
#: why sessions end (label values of tableserver_sessions_ended_total)
END_REASONS = ("closed", "disconnected", "lease_expired", "unbound", "shutdown", "setup_failed")


#: disk table counters (name, help, DiskQueue attribute), read from each table's queue at scrape time
DISK_COUNTERS = (
    ("tableserver_disk_gathers", "Gathers a disk table answered from its file.", "gathers"),
    ("tableserver_disk_pages_read", "Pages a disk table read (each distinct page of a gather once).", "pages_read"),
    ("tableserver_disk_read_bytes", "Bytes a disk table read from its file(s).", "bytes_read"),
    ("tableserver_disk_reads", "Read requests a disk table issued (one per run of contiguous pages).", "reads"),
    ("tableserver_disk_read_errors", "Disk gathers that failed (EIO, short read, file changed, timeout).", "errors"),
    ("tableserver_disk_cancelled_gathers", "Disk gathers stopped because their client left or timed out.", "cancelled"),
)


def _disk_families(tables):
    tier = GaugeMetricFamily(
        "tableserver_table_on_disk", "1 for a table served from disk (--disk-tables), 0 in memory.", labels=["table"]
    )
    counters = [CounterMetricFamily(name, text, labels=["table"]) for name, text, _ in DISK_COUNTERS]
    buffers = GaugeMetricFamily(
        "tableserver_disk_buffer_bytes", "I/O buffer memory of each disk table's reader.", labels=["table"]
    )
    queued = GaugeMetricFamily(
        "tableserver_disk_queued_gathers", "Gathers of each disk table queued or being read.", labels=["table"]
    )
    budget = None
    for t in tables or ():
        tier.add_metric([t.name], 1.0 if t.disk is not None else 0.0)
        if t.disk is not None:
            for family, (_, _, attr) in zip(counters, DISK_COUNTERS):
                family.add_metric([t.name], getattr(t.disk, attr))
            buffers.add_metric([t.name], t.disk.buffer_bytes)
            queued.add_metric([t.name], t.disk.queued)
            budget = t.disk.budget
    yield tier
    yield from counters
    yield buffers
    yield queued
    if budget is not None:
        held = GaugeMetricFamily(
            "tableserver_disk_rows_held_bytes",
            "Row buffers of disk gathers read or being read and not yet sent (all disk tables).",
        )
        held.add_metric([], budget.held)
        yield held


def end_reason(text: str) -> str:
    """Maps a session's free-text close reason to a low-cardinality label value."""
    text = text.lower()
    for key, value in (
        ("lease", "lease_expired"),
        ("never bound", "unbound"),
        ("keepalive", "disconnected"),
        ("shutting down", "shutdown"),
        ("setup failed", "setup_failed"),
    ):
        if key in text:
            return value
    return "closed"


class ServerMetrics:
    """The daemon's metrics. ``bind(server)`` attaches the live-state collector."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._flush_first = FlushFirst()  # first: a collection applies deferred gathers before reading them
        r.register(self._flush_first)
        self._recorders: dict[tuple, Recorder] = {}
        self._recorders_lock = threading.Lock()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Info("tableserver_build", "Version of the tableserver daemon and of what it runs on.", registry=r).info(
            {"version": __version__, "python": platform.python_version(), "grpc": grpc.__version__}
        )
        # fmt: off
        add_metrics(self, r, (  # (attribute, metric type, name, labels, help[, keyword arguments])
            ("grpc_requests", Counter, "tableserver_grpc_requests_total", ("method", "code"),
             "gRPC control-plane calls by method and status code."),
            ("grpc_latency", Histogram, "tableserver_grpc_request_duration_seconds", ("method",),
             "Time to answer unary gRPC control-plane calls.", {"buckets": GRPC_BUCKETS}),
            ("gather_latency", Histogram, "tableserver_gather_duration_seconds", ("transport", "op"),
             "Server-side time to gather and send one request's rows (tcp gathers, rdma owner-side packing).",
             {"buckets": LATENCY_BUCKETS}),
            ("gather_rows", Counter, "tableserver_gather_rows_total", ("table", "transport", "op"), "Rows gathered by "
             "the server for clients (tcp gathers and rdma packing; one-sided READs bypass the server CPU)."),
            ("gather_bytes", Counter, "tableserver_gather_bytes_total", ("table", "transport", "op"),
             "Row bytes gathered by the server for clients."),
            ("errors", Counter, "tableserver_errors_total", ("reason",), "Errors by reason: refused requests (bad row "
             "ids, auth, ...), RDMA completion errors, clients gone mid-request."),
            ("sessions_opened", Counter, "tableserver_sessions_opened_total", (), "Sessions opened over gRPC."),
            ("sessions_ended", Counter, "tableserver_sessions_ended_total", ("reason",), "Sessions ended, by reason."),
        ))
        # fmt: on
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        for reason in END_REASONS:
            self.sessions_ended.labels(reason)
        for method in ("GetCatalog", "OpenSession", "KeepAlive", "CloseSession"):
            self.grpc_requests.labels(method, "OK")
            if method != "KeepAlive":  # series from 0, so rate() sees the first calls after a scrape
                self.grpc_latency.labels(method)
        self._state = _StateCollector()
        r.register(self._state)
        self._http = None

    # ------------------------------------------------------------- updates
    def bind(self, server) -> None:
        """Reads live state (tables, sessions, transports) from ``server`` at each scrape."""
        self._state.server = server

    def gather_op(self, transport: str, op: str, table: str) -> Recorder:
        """The recorder of (transport, op, table) -- ``defer(rows, bytes, seconds)`` per request, applied
        by the next scrape -- to be cached by the caller (``labels()`` is too slow for every request).
        One per label values for the daemon's life, held here: a transport closing never drops
        requests it deferred."""
        key = (transport, op, table)
        with self._recorders_lock:
            recorder = self._recorders.get(key)
            if recorder is None:
                recorder = self._recorders[key] = self._flush_first.add(
                    Recorder(
                        self.gather_latency.labels(transport, op),
                        self.gather_rows.labels(table, transport, op),
                        self.gather_bytes.labels(table, transport, op),
                    )
                )
        return recorder

    def error(self, reason: str) -> None:
        self.errors.labels(reason).inc()

    def refused(self, status: Status) -> None:
        self.errors.labels(STATUS_REASON.get(status, "internal")).inc()

    def session_ended(self, session) -> None:
        self.sessions_ended.labels(end_reason(session.close_reason)).inc()

    # ------------------------------------------------------------ endpoint
    def serve(self, host: str, port: int, tls_cert: str = "", tls_key: str = "") -> int:
        """Starts the /metrics HTTP endpoint (the daemon's own process only); returns the bound port."""
        server, thread = start_metrics_server(
            host,
            port,
            self.registry,
            tls_cert,
            tls_key,
            before_scrape=self._flush_first.flush,
            probes={"/readyz": self._ready, "/livez": self._live},
        )
        self._http = (server, thread)
        return server.server_port

    def _ready(self) -> tuple[bool, str]:
        """/readyz: the gRPC health status, in plain HTTP for probes that cannot speak (m)TLS gRPC."""
        state = getattr(self._state.server, "state", None)
        if state is not None and state.ready:
            return True, "SERVING"
        reason = state.unready_reason if state is not None else "starting"
        return False, f"NOT_SERVING: {reason}"

    def _live(self) -> tuple[bool, str]:
        """/livez: the control plane's event loop has run within LIVENESS_S (it beats every second, also
        while tables load)."""
        beat = getattr(self._state.server, "heartbeat", None)
        if beat is None:
            return True, "alive (starting)"
        stale = time.monotonic() - beat
        if stale > LIVENESS_S:
            return False, f"the control-plane event loop has not run for {stale:.0f} s"
        return True, "alive"

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            self._http = None
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


class _StateCollector:
    """Gauges computed from the daemon's live objects at scrape time."""

    def __init__(self):
        self.server = None

    def describe(self):
        return []  # collected lazily: the server is bound after registration

    def collect(self):
        s = self.server
        if s is None:
            return
        tables = s.tables
        serving = GaugeMetricFamily(
            "tableserver_serving", "1 while health reports SERVING (every table pinned and every transport up), else 0."
        )
        serving.add_metric([], 1.0 if s.state is not None and s.state.ready else 0.0)
        yield serving
        uptime = GaugeMetricFamily("tableserver_uptime_seconds", "Seconds since the daemon started.")
        uptime.add_metric([], time.monotonic() - s.started)
        yield uptime
        tts = GaugeMetricFamily("tableserver_time_to_serving_seconds", "Seconds from daemon start to SERVING.")
        if s.time_to_serving is not None:
            tts.add_metric([], s.time_to_serving)
        yield tts
        count = GaugeMetricFamily("tableserver_tables_loaded", "Tables loaded, pinned and served.")
        nbytes = GaugeMetricFamily("tableserver_table_bytes", "Bytes of each served table.", labels=["table", "layer"])
        rows = GaugeMetricFamily("tableserver_table_rows", "Rows of each served table.", labels=["table", "layer"])
        pinned = GaugeMetricFamily(
            "tableserver_pinned_bytes",
            "Table memory mapped by the daemon, by page size; locked (mlock or hugetlb) unless --no-mlock.",
            labels=["page_size"],
        )
        load = GaugeMetricFamily(
            "tableserver_load_duration_seconds", "Seconds spent loading, verifying and pinning every table."
        )
        count.add_metric([], len(tables) if tables is not None else 0)
        if tables is not None:
            by_page: dict[str, int] = {}
            for t in tables:
                nbytes.add_metric([t.name, str(t.spec.layer)], t.nbytes)
                rows.add_metric([t.name, str(t.spec.layer)], t.rows)
                if t.region is not None:
                    key = _page_label(t.region.page_size)
                    by_page[key] = by_page.get(key, 0) + t.region.size
            for key, value in by_page.items():
                pinned.add_metric([key], value)
            load.add_metric([], tables.load_seconds)
        yield from (count, nbytes, rows, pinned, load)
        yield from _disk_families(tables)
        control = GaugeMetricFamily("tableserver_control_sessions", "Sessions open on the control plane.")
        control.add_metric([], len(s.sessions) if s.sessions is not None else 0)
        yield control
        active = GaugeMetricFamily(
            "tableserver_sessions", "Sessions attached to each data transport.", labels=["transport"]
        )
        for name, t in list(s.transports.items()):
            active.add_metric([name], t.active_sessions())
        yield active
        rdma = s.transports.get("rdma")
        qps = GaugeMetricFamily("tableserver_rdma_qps", "RC queue pairs connected to clients.")
        regions = GaugeMetricFamily("tableserver_rdma_memory_regions", "Read-only memory regions registered.")
        registered = GaugeMetricFamily("tableserver_rdma_registered_bytes", "Table bytes registered for RDMA.")
        reg_time = GaugeMetricFamily(
            "tableserver_rdma_registration_duration_seconds",
            "Seconds spent registering every table with the RDMA device.",
        )
        # 0 without an rdma transport, so dashboards show "none" rather than "no data"
        qps.add_metric([], rdma.session_qps() if rdma is not None else 0)
        regions.add_metric([], len(rdma.regions) if rdma is not None else 0)
        registered.add_metric([], sum(r.length for r in rdma.regions) if rdma is not None else 0)
        reg_time.add_metric([], rdma.register_seconds if rdma is not None else 0)
        yield from (qps, regions, registered, reg_time)


def _page_label(page_size: int) -> str:
    return {4096: "4k", 2 << 20: "2m", 1 << 30: "1g"}.get(page_size, str(page_size))


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every gRPC call by method and status code and times unary calls.

    Installed first, so it also sees calls the token interceptor refuses.
    """

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        requests, latency = self.metrics.grpc_requests, self.metrics.grpc_latency.labels(method)

        def done(context, error) -> None:
            code = _code_of(context, error)
            requests.labels(method, code).inc()
            if code == "UNAUTHENTICATED":
                self.metrics.error("auth")

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                start = time.perf_counter()
                error = None
                try:
                    return await inner(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    latency.observe(time.perf_counter() - start)
                    done(context, error)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        streaming = handler.stream_stream or handler.unary_stream
        if streaming is None:
            return handler
        wrap = grpc.stream_stream_rpc_method_handler if handler.stream_stream else grpc.unary_stream_rpc_method_handler

        if inspect.isasyncgenfunction(streaming):

            async def stream(request, context):
                error = None
                try:
                    async for item in streaming(request, context):
                        yield item
                except BaseException as e:
                    error = e
                    raise
                finally:
                    done(context, error)
        else:  # a coroutine that writes its responses with context.write (grpc health's Watch)

            async def stream(request, context):
                error = None
                try:
                    return await streaming(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    done(context, error)

        return wrap(stream, handler.request_deserializer, handler.response_serializer)


def _code_of(context, error) -> str:
    try:
        code = context.code()
    except Exception:  # older grpc.aio contexts cannot report it
        code = None
    if code is not None and code != grpc.StatusCode.OK:
        return code.name if isinstance(code, grpc.StatusCode) else str(code)
    if error is None:
        return "OK"
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


def start_metrics_server(
    host: str, port: int, registry, tls_cert: str = "", tls_key: str = "", probes=None, before_scrape=None
):
    """prometheus-client's WSGI exporter, bounded: at most HTTP_MAX_REQUESTS connections are served at
    once (more are closed at once), each must send its request within HTTP_TIMEOUT_S, and with a cert
    and key it speaks HTTPS (the TLS handshake runs on the request's thread, under the same timeout).
    ``probes`` maps paths (/readyz, /livez) to ``() -> (ok, text)``: 200 or 503 with the text, no table data.
    ``before_scrape`` runs before every /metrics answer, filtered ones (``?name[]=``) included, which
    collect only the named metrics and so skip a registry's flush-first collector."""
    import ssl
    import threading
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_wsgi_app

    slots = threading.BoundedSemaphore(HTTP_MAX_REQUESTS)

    class Handler(_SilentHandler):
        timeout = HTTP_TIMEOUT_S

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def process_request(self, request, client_address):
            if not slots.acquire(blocking=False):
                self.shutdown_request(request)  # busy: close instead of holding another thread
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                self.shutdown_request(request)

        def process_request_thread(self, request, client_address):
            try:
                if context is not None:
                    request.settimeout(HTTP_TIMEOUT_S)
                    request.do_handshake()
                super().process_request_thread(request, client_address)
            except (OSError, ValueError):
                self.shutdown_request(request)
            finally:
                slots.release()

    context = None
    if tls_cert and tls_key:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls_cert, tls_key)
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        probe = (probes or {}).get(environ.get("PATH_INFO", ""))
        if probe is None:
            if before_scrape is not None:
                before_scrape()
            return metrics_app(environ, start_response)
        ok, text = probe()
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")],
        )
        return [text.encode() + b"\n"]

    httpd = make_server(host, port, app, Server, handler_class=Handler)
    if context is not None:
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=httpd.serve_forever, name="tableserver-metrics", daemon=True)
    thread.start()
    return httpd, thread
