"""What users and engines see of the project, as one JSON document: the daemon's options and every command's
help, the daemon's and the client's metric families (name, type, labels, help), the plugins' settings and
environment variables, the client's options, the entry points and the client's top-level names.

A refactor must leave it as it was: ``tests/unit/test_surface.py`` compares it with ``tests/unit/surface.json``,
which was written before the graph wing moved (issue 51). A deliberate change to what users see rewrites the file
(``python tests/support/surface.py --write``) in the same commit, so the diff shows it.

Run: ``python tests/support/surface.py`` (prints), ``--write`` (rewrites the snapshot)."""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SNAPSHOT = os.path.join(ROOT, "tests", "unit", "surface.json")


def _families(registry) -> list[dict]:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    helps, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            helps[name] = doc
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            types[name] = kind
    # process_/python_ families differ between hosts and Python builds; ours are the project's
    return [{"name": n, "type": types.get(n), "help": helps[n]} for n in sorted(helps) if n.startswith("tableserver")]


def _labels(registry) -> dict:
    """Label names per metric family: what dashboards and alerts select on. Read from prometheus_client's
    collectors (its registry offers no public listing of a family's label names before a sample exists)."""
    out = {}
    for name, collector in registry._names_to_collectors.items():  # noqa: SLF001 -- prometheus_client's, not ours
        labels = getattr(collector, "_labelnames", None)
        if labels is not None and name.startswith("tableserver"):
            out[name] = list(labels)
    return dict(sorted(out.items()))


def _helps(parser: argparse.ArgumentParser) -> dict:
    out = {"tableserver": parser.format_help()}
    for action in parser._actions:  # noqa: SLF001 -- argparse's subcommands have no public listing
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                out[name] = sub.format_help()
    return out


def _fields(cls) -> list:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append([f.name, repr(default)])
    return out


def surface() -> dict:
    os.environ["COLUMNS"] = "120"
    import tableclient
    from prometheus_client import CollectorRegistry
    from tableclient.engine import config as plugin_config
    from tableclient.metrics import ClientMetrics
    from tableclient.options import ClientOptions

    from tableserver.cli import build_parser
    from tableserver.config import SERVE_OPTIONS
    from tableserver.metrics import ServerMetrics

    daemon = ServerMetrics(CollectorRegistry()).registry
    client_registry = CollectorRegistry()
    ClientMetrics(client_registry)
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return {
        "serve_options": [
            {**{k: repr(v) for k, v in dataclasses.asdict(o).items()}, "flag": o.flag, "env": o.env}
            for o in SERVE_OPTIONS
        ],
        "help": _helps(build_parser()),
        "daemon_metrics": _families(daemon),
        "daemon_metric_labels": _labels(daemon),
        "client_metrics": _families(client_registry),
        "client_metric_labels": _labels(client_registry),
        "plugin_env": plugin_config.ENV,
        "plugin_graph_modes": list(plugin_config.GRAPH_MODES),
        "plugin_policies": list(plugin_config.POLICIES),
        "plugin_placements": list(plugin_config.PLACEMENTS),
        "plugin_config": _fields(plugin_config.PluginConfig),
        "client_options": _fields(ClientOptions),
        "entry_points": {k: v.strip() for k, v in cfg["options.entry_points"].items()},
        "tableclient_names": sorted(tableclient.__all__),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite {os.path.relpath(SNAPSHOT, ROOT)}")
    args = ap.parse_args(argv)
    text = json.dumps(surface(), indent=1, sort_keys=True) + "\n"
    if args.write:
        with open(SNAPSHOT, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
