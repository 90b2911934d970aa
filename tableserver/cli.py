"""The ``tableserver`` command.

    tableserver [serve] --tables engram.bin [...]   run the memory-node daemon
    tableserver gen-demo PATH                       write Engram-shaped demo tables
    tableserver pack OUT IN.safetensors [...]       build a table file from safetensors
    tableserver inspect FILE                        print a file's catalog, verify checksums
    tableserver stripe FILE --table NAME OUT...     deal a table's rows over files on several drives
    tableserver demo                                demo table + server + client replay
    tableserver dashboard check|render --prometheus URL   check / draw the Grafana dashboard's queries
    tableserver doctor [--fix-pyverbs]              what this host lacks; link the host's pyverbs
    tableserver plan --placement P --kv-pool-gib G  the memory a placement frees, as host KV cache flags

User errors print one line (``tableserver: error: ...``) and exit non-zero,
without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from tableserver import __version__, logs
from tableserver.common.model import ROW_BYTES, TABLE_ROWS
from tableserver.errors import ConfigError, TableServerError

COMMANDS = ("serve", "gen-demo", "pack", "inspect", "stripe", "demo", "dashboard", "doctor", "plan")
log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    from tableserver.config import add_flags

    p = _Parser(
        prog="tableserver",
        description="Remote table-memory server: pins lookup tables in host memory "
        "and serves row gathers over shm, tcp (and rdma).",
    )
    p.add_argument("--version", action="version", version=f"tableserver {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    s = sub.add_parser("serve", help="run the daemon (the default command)")
    add_flags(s)

    g = sub.add_parser("gen-demo", help="write deterministic Engram-shaped demo tables")
    g.add_argument("path", help="output table file")
    g.add_argument("--rows", type=_positive_int, default=None, help="rows per table (default 600000)")
    g.add_argument("--row-bytes", type=_positive_int, default=ROW_BYTES, help=f"bytes per row (default {ROW_BYTES})")
    layers = ",".join(map(str, TABLE_ROWS))
    g.add_argument("--layers", default=layers, help=f"one table per layer (default {layers})")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--page-aligned",
        action="store_true",
        help="lay rows out page-aligned: as many whole rows as fit at the start of each 4 KiB page (15 of 264 B), "
        "so a disk table reads one page per row instead of two for the 6.4%% that straddle; 3.4%% more bytes",
    )

    k = sub.add_parser("pack", help="build a table file from safetensors files")
    k.add_argument("output", help="table file to write")
    k.add_argument(
        "inputs",
        nargs="+",
        help=".safetensors files: their Engram tables (an FP8 e4m3 [N, 256] weight with its ue8m0 [N, 8] "
        "scale) are packed, listed first with their sizes",
    )
    k.add_argument(
        "--tensor",
        dest="tensors",
        action="append",
        default=[],
        metavar="NAME",
        help="also pack the 2-D tensor NAME as a table of plain rows (repeatable; by default a checkpoint's "
        "other tensors, its linear weights among them, are left out)",
    )
    k.add_argument(
        "--version",
        dest="table_version",
        type=_positive_int,
        default=1,
        help="content version recorded for every table",
    )
    k.add_argument(
        "--page-aligned",
        action="store_true",
        help="lay rows out page-aligned: as many whole rows as fit at the start of each 4 KiB page (15 of 264 B), "
        "so a disk table reads one page per row instead of two for the 6.4%% that straddle; 3.4%% more bytes",
    )

    i = sub.add_parser("inspect", help="print a table file's catalog and verify its checksums")
    i.add_argument("path")
    i.add_argument("--no-verify", action="store_true", help="only print the catalog")

    t = sub.add_parser("stripe", help="deal one table's rows over files on several drives (for --disk-stripes)")
    t.add_argument("path", help="the table file")
    t.add_argument("outputs", nargs="+", help="stripe files, one per drive, in order")
    t.add_argument("--table", required=True, help="the table to stripe, e.g. engram.layer14")
    t.add_argument("--unit", type=_positive_int, default=1 << 20, help="stripe unit in bytes (default 1 MiB)")

    d = sub.add_parser("demo", help="generate the demo table, start a server and replay decode steps")
    d.add_argument("--rows", type=_positive_int, default=None, help="rows per demo table (default 600000)")
    d.add_argument("--steps", type=_positive_int, default=200, help="decode steps to replay (default 200)")
    d.add_argument("--batch", type=_positive_int, default=64, help="tokens per step (default 64)")
    d.add_argument("--transports", default="shm,tcp", help="transports to replay over (default shm,tcp)")
    d.add_argument("--table", default="", help="table file to use (default: generated in ~/.cache/tableserver)")

    b = sub.add_parser("dashboard", help="check or render the Grafana dashboard's queries against a Prometheus")
    b.add_argument(
        "action",
        choices=("check", "render"),
        help="check: every panel query returns data; render: draw the main panels to a PNG (needs matplotlib)",
    )
    b.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus URL (default %(default)s)")
    b.add_argument(
        "--dashboard", default="", help="dashboard JSON (default deploy/grafana/dashboards/tableserver.json)"
    )
    b.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for (default %(default)s)")
    b.add_argument("--out", default="dashboard.png", help="render: PNG to write (default %(default)s)")
    b.add_argument("--minutes", type=float, default=15.0, help="render: time span to draw (default %(default)s)")

    o = sub.add_parser("doctor", help="check this host for tableserver (pyverbs, RDMA devices); fix pyverbs")
    o.add_argument(
        "--fix-pyverbs",
        action="store_true",
        help="make this host's distribution pyverbs (rdma-core's "
        "Python bindings, e.g. Debian's python3-pyverbs) importable from this Python environment, "
        "and check that it matches the host's rdma-core",
    )
    o.add_argument(
        "--pyverbs-from",
        default="",
        metavar="DIR",
        help="with --fix-pyverbs: link this pyverbs package directory instead (e.g. a vendor OFED/DOCA build)",
    )
    # the serve options: with any of them (or --config) the doctor checks what that server needs
    from tableserver.config import add_flags

    add_flags(o)

    from tableserver.ops.launch_plan import add_flags as add_plan_flags

    n = sub.add_parser(
        "plan",
        help="the host memory a placement frees, and the engine's flags that make it host KV cache",
        description="What the Engram tables take on a serving host under a placement and under the engine's own "
        "default, and the SGLang or vLLM flags that turn the memory freed into host KV cache, checked as the "
        "engine will check them. Exits 1 when the plan cannot fit.",
    )
    add_plan_flags(n)
    return p


def _positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}")
    return n


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    try:
        args = build_parser().parse_args(argv)
        if args.command == "serve":
            return _serve(args)
        logs.setup("info")
        return {
            "gen-demo": _gen_demo,
            "pack": _pack,
            "inspect": _inspect,
            "stripe": _stripe,
            "demo": _demo,
            "dashboard": _dashboard,
            "doctor": _doctor,
            "plan": _plan,
        }[args.command](args)
    except TableServerError as e:
        print(f"tableserver: error: {logs.escape(str(e))}", file=sys.stderr)  # one line, always
        return e.exit_code
    except KeyboardInterrupt:
        print("tableserver: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader went away (tableserver plan | head): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1


def _serve(args) -> int:
    from tableserver.config import resolve
    from tableserver.server import serve

    cfg = resolve(args)
    logs.setup(cfg["log_level"], cfg["log_format"])
    if getattr(args, "auth_token", ""):
        log.warning(
            "--auth-token shows the token to every local user (/proc/PID/cmdline, ps): pass "
            "--auth-token-file or set TABLESERVER_AUTH_TOKEN instead"
        )
    return serve(cfg)


def _gen_demo(args) -> int:
    from tableserver.tables.demo import DEFAULT_ROWS, default_tables, write_demo_file
    from tableserver.tables.progress import Progress

    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--layers {args.layers!r}: expected comma-separated layer numbers, e.g. 1,14") from None
    tables = default_tables(args.rows or DEFAULT_ROWS, args.row_bytes, layers)
    bar = Progress(sum(t.rows * t.row_bytes for t in tables), f"writing {args.path}")
    t0 = time.monotonic()
    _writable_target(args.path)
    write_demo_file(args.path, tables, seed=args.seed, progress=bar.update, page_aligned=args.page_aligned)
    bar.finish()
    log.info("wrote %s: %d tables in %.1f s", args.path, len(tables), time.monotonic() - t0)
    return 0


def _writable_target(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ConfigError(f"cannot write {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK):
        raise ConfigError(f"cannot write {path}: directory {d} is not writable")


def _pack(args) -> int:
    from tableserver.tables.pack import pack

    _writable_target(args.output)
    pack(
        args.output,
        args.inputs,
        version=args.table_version,
        page_aligned=args.page_aligned,
        tensors=args.tensors,
        out=sys.stdout,
    )
    return 0


def _inspect(args) -> int:
    from tableserver.tables.pack import inspect_file

    return inspect_file(args.path, verify=not args.no_verify, out=sys.stdout)


def _stripe(args) -> int:
    from tableserver.tables.stripe import stripe

    for out in args.outputs:
        _writable_target(out)
    stripe(args.path, args.table, args.outputs, unit=args.unit)
    log.info(
        "striped %s over %d files; serve it with --disk-stripes %s=%s --disk-stripe-unit %d",
        args.table,
        len(args.outputs),
        args.table,
        ":".join(args.outputs),
        args.unit,
    )
    return 0


def _demo(args) -> int:
    from tableserver.ops.demo_run import run_demo

    return run_demo(
        rows=args.rows,
        steps=args.steps,
        batch=args.batch,
        transports=[t for t in args.transports.split(",") if t],
        table=args.table or None,
    )


def _doctor(args) -> int:
    import os

    from tableserver.config import ENV_PREFIX, SERVE_OPTIONS, resolve
    from tableserver.ops import doctor

    given = (
        hasattr(args, "config")
        or any(hasattr(args, o.name) for o in SERVE_OPTIONS)
        or bool(os.environ.get(ENV_PREFIX + "CONFIG"))
    )
    return doctor.run(
        fix_pyverbs_=args.fix_pyverbs or bool(args.pyverbs_from),
        pyverbs_from=args.pyverbs_from or None,
        cfg=resolve(args) if given else None,
    )


def _plan(args) -> int:
    import json

    from tableserver.errors import MemoryLimitError
    from tableserver.ops.launch_plan import make_plan, render, request_from_args

    plan = make_plan(request_from_args(args))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0 if plan.fits else MemoryLimitError.exit_code
    print(render(plan) if plan.fits else render(plan).rsplit("\n", 1)[0])
    if not plan.fits:
        raise MemoryLimitError(plan.error)
    return 0


def _dashboard(args) -> int:
    from tableserver.ops import dashboard

    path = args.dashboard or dashboard.DEFAULT_DASHBOARD
    if not os.path.exists(path):
        raise ConfigError(f"dashboard {path} not found: pass --dashboard deploy/grafana/dashboards/tableserver.json")
    try:
        targets = dashboard.load_targets(path)
    except (ValueError, AttributeError, TypeError) as e:
        raise ConfigError(
            f"dashboard {path} is not a Grafana dashboard JSON ({e}): fix it or pass --dashboard"
        ) from None
    prom = dashboard.Prometheus(args.prometheus)
    if not prom.ready():
        raise ConfigError(
            f"no Prometheus ready at {args.prometheus}: start one (deploy/monitoring) or fix --prometheus"
        )
    if args.action == "render":
        _writable_target(args.out)
        print(dashboard.render(prom, args.out, path=path, minutes=args.minutes, rate_interval=args.rate_interval))
        return 0
    problems = dashboard.check(prom, path, args.rate_interval)
    for t, why in problems:
        print(f"NO DATA  {t.panel}: {t.expr}\n         {why}")
    print(f"{len(targets) - len(problems)} of {len(targets)} dashboard queries return data")
    return 1 if problems else 0
