#!/usr/bin/env python3
"""Observability demo: a real Prometheus scraping a tableserver and serving clients, the dashboard
checked and drawn from its own queries.

One run, all real processes on loopback:
  1. the demo table served by `tableserver serve` (its /metrics on an ephemeral port);
  2. two client worker processes in prometheus **multiprocess mode** (as inside SGLang: they write
     their values to PROMETHEUS_MULTIPROC_DIR and never serve HTTP), one over shm and one over tcp,
     each replaying Engram decode steps (layer 1 then 14, batch 64) through EngramStep;
  3. one exporter process aggregating that directory on /metrics (SGLang's own endpoint in production);
  4. Debian's `prometheus` binary scraping the daemon and the exporter every second.
Then every PromQL query of deploy/grafana/dashboards/tableserver.json is evaluated through the HTTP API
(`tableserver dashboard check`) and the main panels are drawn to bench/out/dashboard.png (`... render`).

    python bench/observe.py [--seconds 40] [--out bench/out/dashboard.png]

The test suite (tests/daemon/test_observability.py) uses the same pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ALERTS = os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    """A real Prometheus (the Debian package's binary) scraping ``jobs`` = {job: [host:port, ...]}."""

    def __init__(
        self, jobs: dict, workdir: str, scrape_interval: str = "1s", rule_files: tuple = (), timeout: float = 60.0
    ):
        binary = prometheus_binary()
        self.timeout = timeout  # bound of every wait for Prometheus (start-up, a query's data)
        if binary is None:
            raise RuntimeError("prometheus is not installed: apt-get install prometheus")
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "rule_files": [os.path.abspath(f) for f in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
            ],
        }
        self.config = os.path.join(workdir, "prometheus.yml")
        with open(self.config, "w") as f:
            json.dump(config, f, indent=1)  # JSON is YAML: no YAML library needed
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(workdir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
        from tableserver.ops.dashboard import Prometheus

        self.api = Prometheus(self.url)
        deadline = time.monotonic() + timeout
        while not self.api.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"prometheus did not start:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        with open(os.path.join(self.workdir, "prometheus.log")) as f:
            return f.read()[-4000:]

    def wait_for(self, expr: str, timeout: float | None = None, min_series: int = 1) -> list:
        """Polls an instant query until it returns at least ``min_series`` series with a value > 0."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            result = self.api.query(expr)["result"]
            if len([s for s in result if float(s["value"][1]) > 0]) >= min_series:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus: {expr!r} has no data after {timeout:g} s: {result}")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ClientWorkload:
    """One exporter aggregating a multiprocess directory, and worker processes gathering into it."""

    def __init__(
        self,
        address: str,
        workdir: str,
        transports=("shm", "tcp"),
        batch: int = 64,
        pace_s: float = 0.005,
        timeout: float = 60.0,
    ):
        self.timeout = timeout  # bound of every wait for the exporter and the workers
        self.dir = os.path.join(workdir, "prom-multiproc")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        self.env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.dir)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, self.env.get("PYTHONPATH", "")]))
        self.stop_file = os.path.join(workdir, "workload.stop")
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        port_file = os.path.join(workdir, "exporter.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        self.address, self.transports, self.batch, self.pace_s = address, transports, batch, pace_s
        self.workdir = workdir
        self.workers, self.logs = [], []
        self.exporter = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "exporter", port_file], env=self.env
        )
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if self.exporter.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the metrics exporter did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            self.exporter_address = f"127.0.0.1:{int(f.read())}"

    def start_workers(self) -> None:
        """Starts one worker per transport (after Prometheus scrapes, so it sees every count from 0)."""
        me = os.path.abspath(__file__)
        for t in self.transports:
            log = open(os.path.join(self.workdir, f"worker-{t}.log"), "w")
            self.logs.append(log)
            self.workers.append(
                subprocess.Popen(
                    [sys.executable, me, "worker", self.address, t, self.stop_file, str(self.batch), str(self.pace_s)],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    def stop_workers(self) -> list[int]:
        with open(self.stop_file, "w"):
            pass
        codes = []
        for w in self.workers:
            try:
                codes.append(w.wait(self.timeout))
            except subprocess.TimeoutExpired:
                w.kill()
                codes.append(w.wait())
        return codes

    def close(self) -> None:
        self.stop_workers()
        if self.exporter.poll() is None:
            self.exporter.send_signal(signal.SIGTERM)
            self.exporter.wait(10)
        for log in self.logs:
            log.close()


# ---------------------------------------------------------------- subprocesses
def _worker(address: str, transport: str, stop_file: str, batch: int, pace_s: float) -> int:
    """Replays decode steps (layer 1 then 14) until ``stop_file`` exists; prints steps done."""
    import numpy as np
    from tableclient import TableClient
    from tableclient.step import EngramStep, LayerPlan

    from tableserver.common.model import ROWS_PER_TOKEN, WINDOWS_S

    rng = np.random.default_rng(os.getpid())
    with TableClient(address, transport=transport, client_name=f"observe-{transport}") as client:
        plans = [LayerPlan(1, "engram.layer1", WINDOWS_S[1]), LayerPlan(14, "engram.layer14", WINDOWS_S[14])]
        step = EngramStep(client, plans, max_tokens=batch, keep_latencies=0)
        rows = {p.layer: client.tables[p.table].rows for p in plans}
        steps = 0
        while not os.path.exists(stop_file):
            # Zipf-like reuse: a hot set shared by steps, so the unique-row ratio means something (over tcp,
            # batches under its dedup minimum -- 4,096 ids; these are 1,536 -- fetch their duplicates)
            ids = {
                layer: np.where(
                    rng.random((batch, ROWS_PER_TOKEN)) < 0.3,
                    rng.integers(0, 512, (batch, ROWS_PER_TOKEN)),
                    rng.integers(0, n, (batch, ROWS_PER_TOKEN)),
                )
                for layer, n in rows.items()
            }
            step.begin_step(ids)
            for p in step.plans:
                step.wait(p.layer)
            steps += 1
            time.sleep(pace_s)
    print(f"{transport}: {steps} steps", flush=True)
    return 0


def _exporter(port_file: str) -> int:
    from tableclient.metrics import start_http_server

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    port = start_http_server(0)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


# ----------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the clients replay (default 40)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "dashboard.png"))
    ap.add_argument("--table", default="", help="table file (default: the demo table)")
    args = ap.parse_args()
    if prometheus_binary() is None:
        print("prometheus is not installed: apt-get install prometheus (Debian package)", file=sys.stderr)
        return 1
    from tableserver.ops.dashboard import check, load_targets, render
    from tableserver.ops.demo_run import ensure_demo_file, start_server

    table = args.table or ensure_demo_file()
    with tempfile.TemporaryDirectory(prefix="tableserver-observe-") as tmp:
        server, ready = start_server(table, tmp, ["--metrics-port", "0"])
        try:
            work = ClientWorkload(ready["control"], tmp)
            try:
                with PrometheusServer(
                    {"tableserver": [ready["metrics"]], "tableserver-client": [work.exporter_address]},
                    os.path.join(tmp, "prom"),
                    rule_files=(ALERTS,),
                ) as prom:
                    prom.wait_for("up == 1", min_series=2)  # both targets scraped before any client connects
                    work.start_workers()
                    prom.wait_for("sum(rate(tableserver_client_layer_waits_total[10s]))")
                    print(
                        f"Prometheus {prom.url} scraping tableserver {ready['metrics']} and clients "
                        f"{work.exporter_address}; replaying for {args.seconds:g} s ...",
                        flush=True,
                    )
                    time.sleep(args.seconds)
                    targets = load_targets()
                    problems = check(prom.api, rate_interval="20s")
                    for t, why in problems:
                        print(f"NO DATA  {t.panel}: {t.expr}\n         {why}")
                    print(f"{len(targets) - len(problems)} of {len(targets)} dashboard queries return data")
                    minutes = (args.seconds + 15) / 60
                    print(
                        "wrote",
                        render(
                            prom.api,
                            args.out,
                            minutes=minutes,
                            step=1.0,
                            rate_interval="10s",
                            title=f"tableserver dashboard: demo table, shm + tcp clients, batch 64 "
                            f"({args.seconds:g} s replay)",
                        ),
                    )
            finally:
                work.close()
        finally:
            server.terminate()
            server.wait(30)
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        a = sys.argv[2:]
        raise SystemExit(_worker(a[0], a[1], a[2], int(a[3]), float(a[4])))
    if len(sys.argv) > 1 and sys.argv[1] == "exporter":
        raise SystemExit(_exporter(sys.argv[2]))
    raise SystemExit(main())
