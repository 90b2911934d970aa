"""Observability: Prometheus metrics of the daemon and the client, the dashboard, structured logs.

Real processes throughout: the daemon's /metrics is scraped over HTTP, client
processes write prometheus multiprocess files, and a real Prometheus (Debian's
``prometheus``, installed by .ci/run) scrapes both before every PromQL query of
the Grafana dashboard is evaluated through its HTTP API.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, ROOT, run_cli, start_daemon
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tableclient import TableClient
from tableclient.metrics import ClientMetrics, latency_buckets
from tests_helpers import open_raw_session, scrape, value

from tableserver.common.wire import HEADER, HEADER_BYTES, FrameType, Status, request_header
from tableserver.logs import RateLimitedLog
from tableserver.ops.dashboard import DEFAULT_DASHBOARD, check, load_targets, substitute
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.join(ROOT, "bench"))
from observe import ALERTS, ClientWorkload, PrometheusServer, prometheus_binary  # noqa: E402

DEPLOY = os.path.join(ROOT, "deploy")
#: every label our metrics may carry (low cardinality by construction; address: one per memory node of a client)
ALLOWED_LABELS = {
    "table",
    "layer",
    "transport",
    "mode",
    "op",
    "method",
    "code",
    "reason",
    "page_size",
    "version",
    "python",
    "grpc",
    "le",
    "outcome",
    "address",
    "phase",
}
UNIT_SUFFIXES = ("_seconds", "_bytes", "_total", "_info", "_rows", "_ratio")


def eventually(address: str, ok, timeout: float = EVENT_TIMEOUT) -> dict:
    """Scrapes until ``ok(families)`` holds; the last scrape either way (the caller's asserts then say why)."""
    deadline = time.monotonic() + timeout
    while True:
        families = scrape(address)
        if ok(families) or time.monotonic() > deadline:
            return families
        time.sleep(0.05)


def convention_problems(families, prefix: str) -> list[str]:
    """Prometheus naming conventions (NOTES.md section 6) our own families break."""
    problems = []
    for f in families:
        if not f.name.startswith("tableserver"):
            continue
        where = f"{f.name} ({f.type})"
        if not f.name.startswith(prefix):
            problems.append(f"{where}: expected prefix {prefix}")
        if prefix == "tableserver_" and f.name.startswith("tableserver_client_"):
            problems.append(f"{where}: the daemon must not export client metrics")
        if ":" in f.name or not re.fullmatch(r"[a-z][a-z0-9_]*", f.name):
            problems.append(f"{where}: names are lower_snake_case without colons")
        if f.type == "counter" and not all(s.name.endswith(("_total", "_created")) for s in f.samples):
            problems.append(f"{where}: counters end in _total")
        if f.type != "counter" and f.name.endswith("_total"):
            problems.append(f"{where}: only counters end in _total")
        if f.type == "histogram" and not f.name.endswith(("_seconds", "_bytes")):
            problems.append(f"{where}: histograms carry a base unit (_seconds, _bytes)")
        if re.search(r"_(ms|us|millis|micros|kb|mb|gb|kib|mib|gib|minutes|hours)(_|$)", f.name):
            problems.append(f"{where}: use base units (seconds, bytes)")
        doc = f.documentation
        if not doc or (doc[0].islower() and not doc.startswith("gRPC")) or not doc.endswith("."):
            problems.append(f"{where}: help must be a sentence (no lowercase start, final period): {f.documentation!r}")
        for s in f.samples:
            bad = set(s.labels) - ALLOWED_LABELS
            if bad:
                problems.append(f"{where}: label(s) {sorted(bad)} are not in the low-cardinality set")
    return problems


# ------------------------------------------------------------------ naming
def test_daemon_metric_names_and_help_follow_the_conventions(daemon):
    families = scrape(daemon.ready["metrics"])
    assert convention_problems(families.values(), "tableserver_") == []
    ours = [n for n in families if n.startswith("tableserver_")]
    assert len(ours) >= 20, ours
    # the standard process metrics are kept next to ours
    assert "process_resident_memory_bytes" in families and "python_info" in families
    assert value(families, "tableserver_build_info", "tableserver_build_info") == 1


def test_client_metric_names_and_help_follow_the_conventions():
    registry = CollectorRegistry()
    m = ClientMetrics(registry)
    m.gather_latency.labels("engram.layer1", "1", "tcp", "read").observe(1e-4)
    m.window.labels("1").set(0.3e-3)
    m.sessions.labels("tcp").inc()
    m.graph_waits.labels("14", "in_graph").observe(1e-3)  # phase: before_replay | in_graph
    m.watchdog_releases.labels("14").inc()
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    assert convention_problems(families, "tableserver_client_") == []
    assert len(families) >= 12


def test_every_dashboard_metric_is_exported(daemon):
    """Static half of the dashboard check: each metric a query names exists on the daemon or the client."""
    names = set(scrape(daemon.ready["metrics"]))
    names |= {f.name for f in text_string_to_metric_families(generate_latest(_client_registry()).decode())}
    for t in load_targets():
        for metric in re.findall(r"\b(tableserver_[a-z0-9_]+)", t.expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
            assert base in names, f"panel {t.panel!r} queries {metric}, which nothing exports"


def _client_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ClientMetrics(registry)
    return registry


def test_client_latency_buckets_default_and_override():
    default = latency_buckets({})
    assert default[0] == pytest.approx(2e-6) and 0.5 <= default[-1] < 1.1
    assert latency_buckets({"TABLESERVER_CLIENT_LATENCY_BUCKETS": "0.001, 0.0001"}) == (0.0001, 0.001)
    with pytest.raises(ValueError, match="TABLESERVER_CLIENT_LATENCY_BUCKETS"):
        latency_buckets({"TABLESERVER_CLIENT_LATENCY_BUCKETS": "fast"})


# ----------------------------------------------------------- server values
def test_daemon_counts_gathers_sessions_grpc_codes_and_errors(fresh_daemon):
    d = fresh_daemon()
    address, metrics = d.address, d.ready["metrics"]
    before = scrape(metrics)
    assert value(before, "tableserver_serving") == 1
    assert value(before, "tableserver_tables_loaded") == 4
    assert value(before, "tableserver_table_bytes", table="engram.layer1") == 50_000 * 264
    assert value(before, "tableserver_pinned_bytes") >= value(before, "tableserver_table_bytes")
    assert value(before, "tableserver_rdma_qps") == 0 and value(before, "tableserver_time_to_serving_seconds") > 0
    rng = np.random.default_rng(3)
    with TableClient(address, transport="tcp") as c:
        ids = rng.integers(0, 50_000, (64, 24))
        c.table("engram.layer1").gather(ids)
        # a filtered scrape (?name[]=) collects only the named metric, not the registry's flush-first
        # collector: it must still see the request the server deferred (the first scrape since it)
        deadline = time.monotonic() + EVENT_TIMEOUT
        while True:
            with urllib.request.urlopen(
                f"http://{metrics}/metrics?name[]=tableserver_gather_rows_total", timeout=EVENT_TIMEOUT
            ) as r:
                filtered = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
            if value(filtered, "tableserver_gather_rows_total") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert value(filtered, "tableserver_gather_rows_total", table="engram.layer1", transport="tcp") == 64 * 24
        during = scrape(metrics)
        assert value(during, "tableserver_sessions", transport="tcp") == 1
        assert value(during, "tableserver_control_sessions") == 1
    from tableclient.rowids import dedup
    from tableclient.transports.tcp import TcpTransport

    # what the client sent: 1,536 ids are below tcp's dedup minimum, and rare duplicates never pay
    unique = dedup(ids.reshape(-1), TcpTransport.dedup_min_ids)[0].size
    after = scrape(metrics)
    assert value(after, "tableserver_gather_rows_total", table="engram.layer1", transport="tcp") == unique
    assert value(after, "tableserver_gather_bytes_total", table="engram.layer1") == unique * 264
    assert (
        value(
            after,
            "tableserver_gather_duration_seconds",
            "tableserver_gather_duration_seconds_count",
            transport="tcp",
            op="gather",
        )
        == 1
    )
    assert value(after, "tableserver_sessions_opened_total") == 1
    assert value(after, "tableserver_sessions_ended_total", reason="closed") == 1
    assert value(after, "tableserver_sessions", transport="tcp") == 0
    assert value(after, "tableserver_grpc_requests_total", method="OpenSession", code="OK") == 1

    # A request the client library would never send: a row id past the end, straight on the tcp port.
    resp = open_raw_session(address)
    host, port = d.ready["tcp"].rsplit(":", 1)
    import socket

    with socket.create_connection((host, int(port)), timeout=EVENT_TIMEOUT) as s:
        from tests_helpers import tcp_hello

        assert tcp_hello(s, resp.session_id, resp.secret)[0] == Status.OK
        s.sendall(request_header(FrameType.GATHER, 2, 0, 1) + np.array([50_000], "<i8").tobytes())
        head = HEADER.unpack(s.recv(HEADER_BYTES))
    assert head[2] == Status.ROW_OUT_OF_RANGE
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError):
            pb_grpc.TableServiceStub(ch).OpenSession(
                pb.OpenSessionRequest(transports=["carrier-pigeon"]), timeout=EVENT_TIMEOUT
            )
    # an aborted call is counted as its coroutine unwinds, which may be just after the client hears it
    late = eventually(
        metrics,
        lambda f: value(f, "tableserver_grpc_requests_total", method="OpenSession", code="INVALID_ARGUMENT") == 1,
    )
    assert value(late, "tableserver_errors_total", reason="bad_row_ids") == 1


def test_auth_failures_are_counted(tmp_path, demo_file):
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--auth-token", "s3cret")
    try:
        with pytest.raises(Exception, match="rejected the credentials"):
            TableClient(d.address, token="wrong")
        families = eventually(d.ready["metrics"], lambda f: value(f, "tableserver_errors_total", reason="auth") >= 1)
        assert value(families, "tableserver_grpc_requests_total", method="GetCatalog", code="UNAUTHENTICATED") >= 1
    finally:
        d.stop()


def test_metrics_port_in_use_is_one_clear_line(tmp_path, demo_file):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--metrics-port", str(port), wait=False)
        assert d.proc.wait(60) != 0
    lines = [line for line in d.log().splitlines() if "error" in line]
    assert any(f"metrics on 127.0.0.1:{port}" in line and "--metrics-port" in line for line in lines), d.log()


def test_dashboard_cli_without_prometheus_is_one_clear_line(tmp_path):
    res = run_cli("dashboard", "check", "--prometheus", "http://127.0.0.1:9")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("tableserver: error: no Prometheus ready at"), res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = run_cli("dashboard", "check", "--dashboard", str(bad))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "is not a Grafana dashboard JSON" in res.stderr.strip().splitlines()[-1], res.stderr


def test_metrics_port_off_serves_no_endpoint(tmp_path, demo_file):
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--metrics-port", "off")
    try:
        assert "metrics" not in d.ready
    finally:
        d.stop()


# ------------------------------------------------------------ client side
CLIENT_SCRIPT = r"""
import sys, numpy as np
from tableclient import TableClient
address, transport, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(seed)
with TableClient(address, transport=transport) as c:
    t = c.table("engram.layer1")
    for _ in range(10):
        ids = rng.integers(0, 1000, (256, 24))  # 6,144 ids, many duplicates: above tcp's dedup minimum
        t.gather(ids)
        from tableclient.rowids import dedup
        from tableclient.transports.tcp import TcpTransport

        print(dedup(ids.reshape(-1), TcpTransport.dedup_min_ids)[0].size, flush=True)  # the rows it asked for
"""


def test_two_client_processes_in_multiprocess_mode_aggregate(daemon, tmp_path):
    from prometheus_client import multiprocess

    mp_dir = tmp_path / "multiproc"
    mp_dir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir))
    procs = [
        subprocess.run(
            [sys.executable, "-c", CLIENT_SCRIPT, daemon.address, "tcp", str(seed)],
            env=env,
            capture_output=True,
            text=True,
            timeout=EVENT_TIMEOUT,
        )
        for seed in (1, 2)
    ]
    for p in procs:
        assert p.returncode == 0, p.stderr
    uniques = [int(x) for p in procs for x in p.stdout.split()]
    assert len(uniques) == 20
    assert len([f for f in os.listdir(mp_dir) if f.endswith(".db")]) >= 2  # one set of files per process

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    lab = dict(table="engram.layer1", layer="1", transport="tcp")
    assert value(families, "tableserver_client_rows_total", **lab) == 20 * 256 * 24
    assert sum(uniques) < 20 * 256 * 24  # each row fetched once: the dedup path ran
    assert value(families, "tableserver_client_unique_rows_total", **lab) == sum(uniques)
    assert value(families, "tableserver_client_read_bytes_total", **lab) == sum(uniques) * 264
    assert (
        value(
            families,
            "tableserver_client_gather_duration_seconds",
            "tableserver_client_gather_duration_seconds_count",
            mode="read",
            **lab,
        )
        == 20
    )
    assert value(families, "tableserver_client_connects_total", transport="tcp") == 2
    assert value(families, "tableserver_client_sessions", transport="tcp") == 0  # both closed their session


def _listening_sockets(pid: int) -> int:
    """TCP sockets in LISTEN state owned by ``pid`` (inode match against /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and parts[9] in inodes:
                    count += 1
    return count


def test_the_library_never_starts_an_http_server(daemon):
    """Inside SGLang the host owns /metrics: creating clients, gathering and stepping opens no listener."""
    from tableclient.step import EngramStep, LayerPlan

    before = _listening_sockets(os.getpid())
    threads = {t.name for t in threading.enumerate()}
    with TableClient(daemon.address, transport="tcp") as c:
        step = EngramStep(c, [LayerPlan(1, "engram.layer1", 0.3e-3)], max_tokens=4)
        step.begin_step({1: np.zeros((4, 24), np.int64)})
        step.wait(1)
        assert _listening_sockets(os.getpid()) == before
        new = {t.name for t in threading.enumerate()} - threads
        assert not any("serve_forever" in n for n in new), new


def test_step_api_counts_waits_misses_and_windows(daemon):
    from prometheus_client import REGISTRY
    from tableclient.step import EngramStep, LayerPlan

    def get(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    waits0, misses0 = (
        get("tableserver_client_layer_waits_total", layer="14"),
        get("tableserver_client_deadline_misses_total", layer="14"),
    )
    with TableClient(daemon.address, transport="tcp") as c:
        # a window nobody can meet (0 s) and one everybody meets (an hour)
        step = EngramStep(
            c, [LayerPlan(14, "engram.layer14", 0.0), LayerPlan(1, "engram.layer1", 3600.0)], max_tokens=8
        )
        for _ in range(3):
            step.begin_step({1: np.ones((8, 24), np.int64), 14: np.ones((8, 24), np.int64)})
            step.wait(14)
            step.wait(1)
    assert get("tableserver_client_layer_waits_total", layer="14") - waits0 == 3
    assert get("tableserver_client_deadline_misses_total", layer="14") - misses0 == 3
    assert get("tableserver_client_layer_window_seconds", layer="1") == 3600.0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_gathers_through_a_table_object_dropped_at_once_are_counted(daemon, transport):
    """``client.table(name).gather(ids)`` makes a RemoteTable that dies with the statement; the fast
    paths defer their metrics, and those of a dropped table object must still be applied."""
    import gc

    from prometheus_client import REGISTRY

    labels = {"table": "engram.layer1", "layer": "1", "transport": transport}
    before = REGISTRY.get_sample_value("tableserver_client_rows_total", labels) or 0.0
    with TableClient(daemon.address, transport=transport) as c:
        for _ in range(5):
            c.table("engram.layer1").gather(np.arange(100))
        gc.collect()
        assert REGISTRY.get_sample_value("tableserver_client_rows_total", labels) - before == 500


def test_client_counts_refused_row_ids(daemon):
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("tableserver_client_errors_total", {"reason": "bad_row_ids"}) or 0.0
    with TableClient(daemon.address, transport="tcp") as c:
        with pytest.raises(ValueError):
            c.table("engram.layer1").gather([50_000])
    assert REGISTRY.get_sample_value("tableserver_client_errors_total", {"reason": "bad_row_ids"}) - before == 1


# ------------------------------------------------------------------- logs
def test_json_logs_carry_the_catalog_memory_layout_and_time_to_serving(tmp_path, demo_file):
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file, "--log-format", "json")
    d.stop()
    lines = [json.loads(line) for line in d.log().splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "pid", "msg"} <= set(doc) for doc in lines)
    events = {doc.get("event"): doc for doc in lines}
    assert events["memory_plan"]["tables"] == 4
    loaded = [doc for doc in lines if doc.get("event") == "table_loaded"]
    assert {doc["table"] for doc in loaded} == {"engram.layer1", "engram.layer14", "dense.f32", "tiny"}
    assert all(doc["rows"] > 0 and doc["bytes"] > 0 and doc["page_size"] > 0 for doc in loaded)
    assert events["serving"]["time_to_serving_s"] > 0 and events["serving"]["metrics"]


def test_text_logs_have_a_stable_prefix(daemon):
    pattern = re.compile(
        r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z tableserver\[\d+\] (DEBUG|INFO|WARNING|ERROR) "
        r"tableserver(\.\w+)*: "
    )
    lines = [line for line in daemon.log().splitlines() if line and not line.startswith((" ", "Traceback"))]
    assert lines and all(pattern.match(line) for line in lines), lines[:5]
    assert any("SERVING" in line and "time_to_serving_s=" in line for line in lines)


def test_hot_path_errors_are_throttled():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("tableserver.test-throttle")
    logger.addHandler(Keep())
    logger.propagate = False
    now = [0.0]
    limited = RateLimitedLog(logger, interval=5.0)
    import tableserver.logs as logs_mod

    real = logs_mod.time.monotonic
    logs_mod.time.monotonic = lambda: now[0]
    try:
        for _ in range(100):
            limited.warning("bad", "bad request from %s", "peer")
        now[0] = 6.0
        limited.warning("bad", "bad request from %s", "peer")
    finally:
        logs_mod.time.monotonic = real
    assert records == ["bad request from peer", "bad request from peer (99 similar suppressed)"]


# ----------------------------------------------------- real Prometheus
def test_deploy_configs_are_valid():
    promtool = prometheus_binary() and os.path.join(os.path.dirname(prometheus_binary()), "promtool")
    if not promtool or not os.path.exists(promtool):
        pytest.skip("promtool missing: apt-get install prometheus (.ci/run installs it)")
    out = subprocess.run(
        [promtool, "check", "config", os.path.join(DEPLOY, "prometheus", "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "1 rule files found" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([promtool, "check", "rules", ALERTS], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(DEFAULT_DASHBOARD) as f:
        dash = json.load(f)
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "datasources", "prometheus.yml")) as f:
        datasource = f.read()
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
    assert uids == {"prometheus"} and "uid: prometheus" in datasource
    with open(os.path.join(DEPLOY, "grafana", "provisioning", "dashboards", "tableserver.yml")) as f:
        assert "/var/lib/grafana/dashboards" in f.read()


def _wait_rules_evaluated(prom, timeout: float = EVENT_TIMEOUT) -> list:
    deadline = time.monotonic() + timeout
    while True:
        groups = prom.api.rules()
        rules = [r for g in groups for r in g["rules"]]
        if (rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules)) or time.monotonic() > deadline:
            return rules
        time.sleep(0.5)


#: the client workers' pause between decode steps (20 a second each): every rate the dashboard shows has data; more
#: steps (bench/observe.py's default: 200 a second each) only spend CPU beside the rest of the suite
PACE_S = 0.05


def test_real_prometheus_evaluates_every_dashboard_query(tmp_path, demo_file):
    """The daemon and two multiprocess client workers (shm, tcp) scraped by a real Prometheus: every
    PromQL expression of the dashboard returns data with the labels its legend uses."""
    if prometheus_binary() is None:
        pytest.skip("prometheus missing: apt-get install prometheus (.ci/run installs it)")
    d = start_daemon(str(tmp_path / "d"), "--tables", demo_file)
    work = None
    try:
        work = ClientWorkload(d.address, str(tmp_path / "w"), pace_s=PACE_S, timeout=EVENT_TIMEOUT)
        with PrometheusServer(
            {"tableserver": [d.ready["metrics"]], "tableserver-client": [work.exporter_address]},
            str(tmp_path / "prom"),
            rule_files=(ALERTS,),
            timeout=EVENT_TIMEOUT,
        ) as prom:
            prom.wait_for("up == 1", min_series=2)
            work.start_workers()
            prom.wait_for("sum by (transport) (rate(tableserver_client_rows_total[10s]))", min_series=2)
            prom.wait_for("sum by (layer) (rate(tableserver_client_layer_waits_total[10s]))", min_series=2)
            prom.wait_for("sum(rate(tableserver_gather_rows_total[10s]))")
            targets = load_targets()
            assert len(targets) >= 20
            problems = check(prom.api, rate_interval="20s")
            assert problems == [], "\n".join(f"{t.panel}: {substitute(t.expr, '20s')}: {why}" for t, why in problems)
            # and the values mean what they say
            rows = prom.api.query("sum by (transport) (tableserver_client_rows_total)")["result"]
            assert {s["metric"]["transport"] for s in rows} == {"shm", "tcp"}
            sessions = prom.api.query("sum by (transport) (tableserver_sessions)")["result"]
            assert {s["metric"]["transport"]: float(s["value"][1]) for s in sessions} == {"shm": 1.0, "tcp": 1.0}
            # the operator's commands against the same Prometheus
            cli = run_cli("dashboard", "check", "--prometheus", prom.url, "--rate-interval", "20s")
            assert (
                cli.returncode == 0 and f"{len(targets)} of {len(targets)} dashboard queries return data" in cli.stdout
            ), cli.stdout + cli.stderr
            png = tmp_path / "dash.png"
            cli = run_cli("dashboard", "render", "--prometheus", prom.url, "--out", str(png), "--minutes", "2")
            assert cli.returncode == 0 and png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG", (
                cli.stderr
            )
            # every alerting rule of deploy/prometheus/alerts.yml loaded and evaluated against real data
            rules = _wait_rules_evaluated(prom)
            assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules
        assert work.stop_workers() == [0, 0]
    finally:
        if work is not None:
            work.close()
        d.stop()
