"""The Grafana dashboard, checked and rendered through Prometheus' HTTP API.

``deploy/grafana/dashboards/tableserver.json`` is the operators' view. A
dashboard whose queries point at metrics that do not exist fails silently
("No data"), so:

* :func:`check` evaluates every panel query against a Prometheus and reports
  the ones that return nothing or lack the labels their legends use
  (``tableserver dashboard check --prometheus URL``; the tests run it against
  a real Prometheus scraping a real daemon and clients);
* :func:`render` draws the main panels from the same queries to a PNG with
  matplotlib (``tableserver dashboard render --prometheus URL --out F.png``),
  for places without Grafana (the README's picture).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

DEFAULT_DASHBOARD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "deploy",
    "grafana",
    "dashboards",
    "tableserver.json",
)
#: panels drawn by render(), in order (titles of deploy/grafana/dashboards/tableserver.json)
MAIN_PANELS = (
    "Read latency by layer (p50, p99) vs window",
    "Deadline-miss rate by layer",
    "Rows/s by transport (clients)",
    "Read latency p99 by transport and mode",
    "Sessions and QPs",
    "Server errors/s by reason",
)


@dataclass(frozen=True)
class Target:
    panel: str
    expr: str
    legend: str

    def legend_labels(self) -> list[str]:
        return re.findall(r"\{\{\s*(\w+)\s*\}\}", self.legend)

    def label_of(self, metric: dict) -> str:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), self.legend) or json.dumps(metric)


def load_targets(path: str = DEFAULT_DASHBOARD) -> list[Target]:
    """Every query of every panel (rows included) of a dashboard JSON."""
    with open(path) as f:
        doc = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append(Target(p.get("title", ""), t["expr"], t.get("legendFormat", "")))
            walk(p.get("panels", []))

    walk(doc.get("panels", []))
    return out


def substitute(expr: str, rate_interval: str = "1m") -> str:
    """Grafana's built-in variables replaced the way Grafana would, for a plain PromQL query."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("${__rate_interval}", rate_interval)
        .replace("$__interval", rate_interval)
        .replace("$__range", rate_interval)
    )


class Prometheus:
    """A small client of the Prometheus HTTP API (``/api/v1/query``, ``query_range``, ``rules``)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=self.timeout) as r:
            doc = json.load(r)
        if doc.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} {params}: {doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> dict:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self._get("/api/v1/query", **params)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        return self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")

    def rules(self) -> list:
        """The rule groups Prometheus loaded (``/api/v1/rules``), each rule with its health and last evaluation."""
        return self._get("/api/v1/rules")["groups"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


def check_target(prom: Prometheus, target: Target, rate_interval: str = "1m") -> str | None:
    """None when the query returns a vector with at least one finite value and every legend label; else why not."""
    try:
        data = prom.query(substitute(target.expr, rate_interval))
    except (RuntimeError, OSError) as e:
        return f"query failed: {e}"
    if data["resultType"] != "vector":
        return f"expected an instant vector, got {data['resultType']}"
    series = data["result"]
    if not series:
        return "no data (does the metric exist and get scraped?)"
    values = [float(s["value"][1]) for s in series]
    if not any(math.isfinite(v) for v in values):
        return f"{len(series)} series, none with a finite value"
    for s in series:
        missing = [lab for lab in target.legend_labels() if lab not in s["metric"]]
        if missing:
            return f"series {s['metric']} lacks legend label(s) {', '.join(missing)}"
    return None


def check(prom: Prometheus, path: str = DEFAULT_DASHBOARD, rate_interval: str = "1m") -> list[tuple[Target, str]]:
    """(target, problem) for every dashboard query that would show no data; empty when all do."""
    problems = []
    for t in load_targets(path):
        why = check_target(prom, t, rate_interval)
        if why is not None:
            problems.append((t, why))
    return problems


def render(
    prom: Prometheus,
    out: str,
    *,
    path: str = DEFAULT_DASHBOARD,
    minutes: float = 5.0,
    step: float = 2.0,
    rate_interval: str = "20s",
    panels=MAIN_PANELS,
    title: str = "tableserver",
) -> str:
    """Draws ``panels`` over the last ``minutes`` to ``out`` (PNG) from the dashboard's own queries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = load_targets(path)
    end = time.time()
    start = end - minutes * 60
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.4 * rows), squeeze=False)
    units = _units(path)
    for ax, title_ in zip(axes.flat, panels):
        for t in (t for t in targets if t.panel == title_):
            data = prom.query_range(substitute(t.expr, rate_interval), start, end, step)
            for s in data["result"]:
                xs = [float(v[0]) - end for v in s["values"]]
                ys = [float(v[1]) for v in s["values"]]
                scale, _ = _scale(units.get(title_, ""))
                style = "--" if "window" in t.legend else "-"
                ax.plot(xs, [y * scale for y in ys], style, label=t.label_of(s["metric"]), linewidth=1.4)
        scale, unit = _scale(units.get(title_, ""))
        if units.get(title_) == "s":
            ax.set_yscale("log")
        ax.set_title(title_, fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xlabel("seconds before now", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _units(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    units = {}

    def walk(panels):
        for p in panels:
            units[p.get("title", "")] = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            walk(p.get("panels", []))

    walk(doc.get("panels", []))
    return units


def _scale(unit: str) -> tuple[float, str]:
    """Grafana unit -> (factor, axis label) for matplotlib."""
    return {
        "s": (1e3, "ms"),
        "percentunit": (100.0, "%"),
        "Bps": (1 / 2**20, "MiB/s"),
        "rowsps": (1.0, "rows/s"),
        "ops": (1.0, "per s"),
        "reqps": (1.0, "calls/s"),
        "bytes": (1 / 2**30, "GiB"),
        "none": (1.0, ""),
    }.get(unit, (1.0, unit))
