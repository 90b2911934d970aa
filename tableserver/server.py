"""The memory-node daemon: bind, load and pin tables, serve, shut down gracefully.

Order matters and is an invariant:

1. bind every listening socket (gRPC control, tcp, shm) so a port in use
   fails in milliseconds, not after minutes of loading;
2. start gRPC with health NOT_SERVING (orchestrators see "starting");
3. load, verify, pin and seal every table;
4. start the data transports, then report SERVING (health, ready file,
   systemd ``READY=1``);
5. on SIGTERM/SIGINT: NOT_SERVING, end all sessions, stop gRPC with a grace
   period, close transports, and only then unmap tables (no transport can be
   reading them any more).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import threading
import time

from tableserver.auth import TokenAuthInterceptor, load_token, server_credentials
from tableserver.common.host import host_id
from tableserver.config import parse_hostport, parse_row_range
from tableserver.control import OpenRate, ServerState, is_loopback, set_serving, start_control_plane
from tableserver.errors import ConfigError, ListenError, TableServerError, TransportUnavailable
from tableserver.logs import kv
from tableserver.metrics import MetricsInterceptor, ServerMetrics
from tableserver.sessions import SessionRegistry
from tableserver.tables.loader import load_tables
from tableserver.tables.progress import human_bytes
from tableserver.tables.stripe import check_unit, parse_stripes
from tableserver.transports import AUTO, KNOWN, open_transport

log = logging.getLogger(__name__)


class LoadCancelled(TableServerError):
    exit_code = 0


class TableServer:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        if not cfg["tables"]:
            raise ConfigError(
                "no tables to serve: pass --tables FILE (make a demo file with `tableserver gen-demo demo.bin`)"
            )
        self.host, self.port = parse_hostport(cfg["listen"], "--listen")
        names = cfg["transports"]
        bad = [n for n in names if n not in KNOWN and n != "auto"]
        if bad:
            raise ConfigError(f"--transports: unknown transport {bad[0]!r}: use auto or {', '.join(KNOWN)}")
        if not names:
            raise ConfigError("--transports is empty: enable at least one of " + ", ".join(KNOWN))
        self.auto = "auto" in names
        self.transport_names = list(dict.fromkeys(n for x in names for n in (AUTO if x == "auto" else (x,))))
        self.token = load_token(cfg["auth_token"], cfg["auth_token_file"])
        self.credentials = (
            server_credentials(cfg["tls_cert"], cfg["tls_key"], cfg["tls_client_ca"])
            if cfg["tls_cert"] or cfg["tls_key"] or cfg["tls_client_ca"]
            else None
        )
        self.shard, self.rows = parse_row_range(cfg.get("shard", ""), cfg.get("rows", ""))
        self.stripes = parse_stripes(cfg.get("disk_stripes", []))
        if self.stripes:
            check_unit(cfg.get("disk_stripe_unit", 1 << 20))
        self.metrics_host = cfg.get("metrics_host") or "127.0.0.1"
        self.metrics_tls = bool(cfg.get("metrics_tls"))
        if self.metrics_tls and not (cfg["tls_cert"] and cfg["tls_key"]):
            raise ConfigError("--metrics-tls needs --tls-cert and --tls-key (the same pair serves /metrics)")
        self.token_file = ""  # a token this server generated (removed when it stops)
        self.metrics_port = _metrics_port(cfg.get("metrics_port", ""), self.port)
        self.metrics = ServerMetrics()
        self.metrics.bind(self)
        self.sessions: SessionRegistry | None = None
        self.transports: dict = {}
        self.tables = None
        self.state: ServerState | None = None
        self._stop: asyncio.Event | None = None
        self._cancel_load = threading.Event()
        self.started = time.monotonic()
        self.heartbeat: float | None = None  # the event loop's last beat (/livez)
        self.time_to_serving = None

    # ------------------------------------------------------------------ run
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        cfg = self.cfg
        beat = asyncio.create_task(self._beat())
        self.sessions = SessionRegistry(cfg["lease_seconds"], bind_timeout=cfg.get("session_bind_timeout", 10.0))
        self.sessions.add_listener(self.metrics.session_ended)
        grpc_server = None
        try:
            rate, catalog = cfg.get("session_open_rate", 20.0), cfg.get("catalog_rate", 50.0)
            self.state = ServerState(
                self.sessions,
                self.transports,
                cfg["max_rows_per_request"],
                host_id(),
                self.metrics,
                node_id=cfg.get("node_id", ""),
                open_rate=OpenRate(rate, max(1, int(rate * 5))),
                catalog_rate=OpenRate(catalog, max(1, int(catalog * 4))),
                max_sessions=cfg.get("max_sessions", 4096),
                max_sessions_per_peer=cfg.get("max_sessions_per_peer", 512),
                peer_prefixes=(cfg.get("peer_prefix_v4", 24), cfg.get("peer_prefix_v6", 64)),
            )
            self._generate_token_if_exposed()
            # metrics first: it also counts the calls the token check refuses
            interceptors = [MetricsInterceptor(self.metrics)] + (
                [TokenAuthInterceptor(self.token)] if self.token else []
            )
            grpc_server, health, self.port = await start_control_plane(
                self.state, self.host, self.port, credentials=self.credentials, interceptors=interceptors
            )
            self._bind_transports()
            self._start_metrics()
            self._warn_if_exposed()
            log.info(
                "control plane on %s:%d (%s%s), health NOT_SERVING while loading",
                self.host,
                self.port,
                "TLS" if self.credentials else "plaintext",
                ", token auth" if self.token else "",
            )
            sd_notify(f"STATUS=loading {len(cfg['tables'])} table file(s)")
            self.tables = await loop.run_in_executor(None, self._load)
            for t in self.transports.values():  # rdma registers every table here: keep health answering
                await loop.run_in_executor(None, t.start, self.tables)
                self.sessions.add_listener(t.release)
            self.state.tables = self.tables
            self.state.ready = True
            await set_serving(health, True)
            self.time_to_serving = time.monotonic() - self.started
            self._announce()
            watch = asyncio.create_task(self._watch_health(health))
            await self._stop.wait()
            watch.cancel()
            log.info("shutting down: health NOT_SERVING, ending %d sessions", len(self.sessions))
            sd_notify("STOPPING=1\nSTATUS=shutting down")
            await health.enter_graceful_shutdown()
            self.state.ready = False
            self.sessions.close_all()
            await grpc_server.stop(grace=2.0)
            grpc_server = None
            return 0
        except LoadCancelled:
            log.info("stopped while loading tables")
            return 0
        finally:
            beat.cancel()
            if grpc_server is not None:
                await grpc_server.stop(grace=None)
            self.sessions.close_all()
            for t in self.transports.values():
                t.close()
            self.metrics.close()
            if self.tables is not None:
                self.tables.close()
            if cfg["ready_file"]:
                _remove(cfg["ready_file"])
            if self.token_file:
                _remove(self.token_file)

    async def _beat(self) -> None:
        """The event loop's heartbeat for /livez and the systemd watchdog (WATCHDOG_USEC)."""
        watchdog = _watchdog_interval()
        last_ping = 0.0
        while True:
            self.heartbeat = time.monotonic()
            if watchdog and self.heartbeat - last_ping >= watchdog:
                sd_notify("WATCHDOG=1")
                last_ping = self.heartbeat
            await asyncio.sleep(min(1.0, watchdog or 1.0))

    async def _watch_health(self, health, interval: float = 0.25) -> None:
        """Health and tableserver_serving follow the transports: NOT_SERVING while one cannot serve."""
        serving = True
        while True:
            await asyncio.sleep(interval)
            problems = [why for ok, why in (t.health() for t in self.transports.values()) if not ok]
            if bool(problems) == serving:
                serving = not problems
                self.state.unready_reason = f"not serving ({problems[0]})" if problems else ""
                self.state.ready = serving
                await set_serving(health, serving)
                sd_notify(f"STATUS={'serving' if serving else 'NOT_SERVING: ' + problems[0]}")
                if serving:
                    log.warning("transports recovered: health SERVING again", extra=kv(event="serving"))
                else:
                    log.error(
                        "health NOT_SERVING: %s", "; ".join(problems), extra=kv(event="not_serving", reason=problems[0])
                    )

    def request_stop(self, sig=None) -> None:
        if sig is not None:
            log.info("received %s", signal.Signals(sig).name)
        self._cancel_load.set()
        if self._stop is not None:
            self._stop.set()

    # -------------------------------------------------------------- helpers
    def _bind_transports(self) -> None:
        cfg = self.cfg
        if cfg["tcp_listen"]:
            tcp = parse_hostport(cfg["tcp_listen"], "--tcp-listen")
        else:
            tcp = (self.host, self.port + 1 if parse_hostport(cfg["listen"], "--listen")[1] else 0)
        options = dict(cfg, tcp_listen=tcp, control_port=self.port, metrics=self.metrics)
        for name in self.transport_names:
            try:
                t = open_transport(name, self.sessions, options)
                t.bind()
            except TransportUnavailable as e:  # this host cannot run it: auto goes without it
                if not self.auto:
                    raise
                log.info("transports auto: no %s (%s)", name, e)
                continue
            self.transports[name] = t

    def _start_metrics(self) -> None:
        """/metrics from the start, so a scrape sees the load (tableserver_serving 0) too."""
        if self.metrics_port is None:
            return
        try:
            self.metrics_port = self.metrics.serve(
                self.metrics_host,
                self.metrics_port,
                *((self.cfg["tls_cert"], self.cfg["tls_key"]) if self.metrics_tls else ()),
            )
        except OSError as e:
            raise ListenError(
                f"cannot serve metrics on {self.metrics_host}:{self.metrics_port} ({e.strerror}): "
                "fix --metrics-host, or pass --metrics-port PORT (0 picks a free port, off "
                "disables it)",
                errno=e.errno,
            ) from None
        log.info(
            "metrics on %s://%s:%d/metrics",
            "https" if self.metrics_tls else "http",
            self.metrics_host,
            self.metrics_port,
            extra=kv(event="metrics", address=f"{self.metrics_host}:{self.metrics_port}"),
        )

    def _generate_token_if_exposed(self) -> None:
        """Off loopback with no token (and no --allow-anonymous): a random token in a 0600 file."""
        if self.token or is_loopback(self.host) or self.cfg.get("allow_anonymous"):
            return
        import secrets

        from tableserver.transports.shm import runtime_dir

        directory = os.path.dirname(self.cfg["shm_socket"]) if self.cfg.get("shm_socket") else runtime_dir()
        path = os.path.join(directory, f"tableserver-{self.port or os.getpid()}.token")
        token = secrets.token_urlsafe(32)
        _write_atomic(path, token + "\n", mode=0o600)
        self.token, self.token_file = token, path
        log.warning(
            "listening on %s without a token: generated one in %s (mode 0600); clients pass it as "
            "TableClient(token=...) or TABLESERVER_AUTH_TOKEN (--allow-anonymous serves without one)",
            self.host,
            path,
            extra=kv(event="token_generated", token_file=path),
        )

    def _warn_if_exposed(self) -> None:
        if not is_loopback(self.host) and self.credentials is None:
            log.warning(
                "the control plane listens on %s without TLS: tokens and session secrets travel in "
                "clear; pass --tls-cert/--tls-key (and --auth-token)",
                self.host,
            )
        if not is_loopback(self.host) and not self.token:
            log.warning(
                "the control plane listens on %s without --auth-token: any host that reaches it can read every table",
                self.host,
            )

    def _load(self):
        cfg = self.cfg

        def check_cancel() -> None:
            if self._cancel_load.is_set():
                raise LoadCancelled("stopped while loading")

        return load_tables(
            cfg["tables"],
            hugepages=cfg["hugepages"],
            lock=cfg["mlock"],
            verify=cfg["verify"],
            progress=cfg["progress"],
            workers=cfg["load_workers"] or None,
            cancel=check_cancel,
            io=cfg["load_io"],
            rows=self.rows,
            shard=self.shard,
            disk_tables=cfg.get("disk_tables", []),
            disk_io=cfg.get("disk_io", "auto"),
            disk_queue_depth=cfg.get("disk_queue_depth", 64),
            disk_timeout=cfg.get("disk_timeout", 10.0),
            disk_stripes=self.stripes,
            disk_stripe_unit=cfg.get("disk_stripe_unit", 1 << 20),
            disk_buffer_bytes=cfg.get("disk_buffer_mib", 512) << 20,
        )

    def _announce(self) -> None:
        cfg = self.cfg
        endpoints = {"control": f"{self.host}:{self.port}"}
        for name, t in self.transports.items():
            endpoints[name] = t.describe().split(" ", 1)[1]
        if self.metrics_port is not None:
            endpoints["metrics"] = f"{self.metrics_host}:{self.metrics_port}"
        disk = self.tables.nbytes - self.tables.memory_nbytes
        log.info(
            "SERVING %d tables (%s%s) in %.2f s: %s",
            len(self.tables),
            human_bytes(self.tables.memory_nbytes) + " in memory",
            f", {human_bytes(disk)} on disk" if disk else "",
            self.time_to_serving,
            ", ".join(f"{k} {v}" for k, v in endpoints.items()),
            extra=kv(
                event="serving",
                tables=len(self.tables),
                bytes=self.tables.nbytes,
                disk_bytes=disk,
                time_to_serving_s=round(self.time_to_serving, 3),
                **endpoints,
            ),
        )
        if cfg["ready_file"]:
            doc = dict(
                endpoints,
                pid=os.getpid(),
                tables=[t.name for t in self.tables],
                page_sizes={t.name: t.region.page_size for t in self.tables.memory},
                tiers={t.name: t.tier for t in self.tables},
                time_to_serving_s=self.time_to_serving,
            )
            if self.token_file:
                doc["token_file"] = self.token_file
            _write_atomic(cfg["ready_file"], json.dumps(doc, indent=1))
        sd_notify(f"READY=1\nSTATUS=serving {len(self.tables)} tables")


def _metrics_port(value: str, control_port: int) -> int | None:
    """--metrics-port: '' = control port + 2 (any free port when the control port is), 'off' = None."""
    value = str(value).strip().lower()
    if value in ("off", "none", "-1"):
        return None
    if value == "":
        return control_port + 2 if control_port else 0
    if not value.isdigit() or int(value) > 65535:
        raise ConfigError(f"--metrics-port {value!r}: expected a port number 0..65535 or off")
    return int(value)


def _watchdog_interval() -> float:
    """Half of systemd's WatchdogSec for this process (0 when no watchdog is armed)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or (pid and pid != str(os.getpid())):
        return 0.0
    return int(usec) / 2e6


def sd_notify(message: str) -> None:
    """systemd Type=notify readiness (no-op outside systemd)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(message.encode(), path)
    except OSError as e:
        log.warning("sd_notify failed: %s", e)


def _write_atomic(path: str, text: str, mode: int | None = None) -> None:
    from tableserver.tables.atomic import write_atomic

    write_atomic(path, text, 0o644 if mode is None else mode)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def serve(cfg: dict) -> int:
    """Runs the daemon until SIGTERM/SIGINT; returns the exit code."""
    server = TableServer(cfg)
    return asyncio.run(server.run())
