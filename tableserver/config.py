"""Server configuration: one table of options, read from a TOML file, the
environment (``TABLESERVER_<NAME>``) and flags. Precedence: flags > env > file
> defaults. Every bad value is a one-line :class:`ConfigError` naming where it
came from and what is expected.

Every numeric option carries its accepted range here (``lo``..``hi``, and
``zero`` for an option where 0 means "auto" or "off"), enforced when a value is
read and shown in ``--help``; NaN and infinities are refused. Code that needs
an option's bounds reads them with :func:`option` instead of repeating them.

The config file is read with bounds too: a regular file only, at most
``MAX_CONFIG_BYTES``, nesting no deeper than the parser's recursion allows.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import tomllib
from dataclasses import dataclass

from tableserver.errors import ConfigError

ENV_PREFIX = "TABLESERVER_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
#: the largest config file read (a config is a few hundred bytes; this refuses /dev/zero and the like)
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # str | int | float | bool | list | choice
    default: object
    help: str
    choices: tuple = ()
    metavar: str | None = None
    aliases: tuple = ()
    #: int/float: the accepted range lo..hi (a str option with a range holds an integer in it, or "")
    lo: float | None = None
    hi: float | None = None
    #: what 0 means where it is accepted besides lo..hi ("" where it is not)
    zero: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def bounds(self) -> str:
        """The accepted range as text ("2..32, or 0 = 2 per core"; "" for an option without one)."""
        if self.lo is None:
            return ""
        return f"{_num(self.lo)}..{_num(self.hi)}" + (f", or 0 = {self.zero}" if self.zero else "")


#: every serve option, one a line or two (a table: kept as laid out)
# fmt: off
SERVE_OPTIONS = (
    Option("tables", "list", [], "table files to serve: engram.bin files and/or .safetensors, comma-separated",
           metavar="FILE[,FILE]"),
    Option("listen", "str", "127.0.0.1:7070", "gRPC control-plane address (port 0 = any free port)",
           metavar="HOST:PORT"),
    Option("node_id", "str", "", "this memory node's identity, stable across restarts and distinct between replicas "
           "(default: the hostname); clients route by it", metavar="ID"),
    Option("shard", "str", "", "serve shard K of N: the K-th of N equal row ranges of every table (K from 0)",
           metavar="K/N"),
    Option("rows", "str", "", "serve only table rows LO..HI-1 of every table (instead of --shard)", metavar="LO:HI"),
    Option("transports", "list", ["auto"], "data transports to offer, in preference order: rdma, shm, tcp, or auto "
           "(rdma when an RDMA device is usable, then shm and tcp)", metavar="NAME[,NAME]"),
    Option("tcp_listen", "str", "", "tcp data address (default: the --listen host, control port + 1)",
           metavar="HOST:PORT"),
    Option("tcp_advertise", "str", "", "host name clients use to reach the tcp port (default: its bind host)",
           metavar="HOST"),
    Option("shm_socket", "str", "", "Unix socket of the shm transport (default: $XDG_RUNTIME_DIR or "
           "/run/tableserver/tableserver-PORT.sock)", metavar="PATH"),
    Option("hugepages", "choice", "auto", "page size of table memory: auto picks 1 GiB, then 2 MiB hugepages when "
           "enough are free, else normal pages", choices=("auto", "1g", "2m", "off")),
    Option("mlock", "bool", True, "lock table memory so it never pages out"),
    Option("verify", "bool", True, "verify table checksums while loading"),
    Option("lease_seconds", "float", 15.0, "a session ends this long after its last keepalive", metavar="SECONDS",
           lo=0.1, hi=86400),
    Option("session_bind_timeout", "float", 10.0, "close a session whose client has not bound its keepalive stream "
           "(sent its first ping) this long after opening it", metavar="SECONDS", lo=0.1, hi=86400),
    Option("max_sessions", "int", 4096, "most open client sessions (more are refused: RESOURCE_EXHAUSTED)", metavar="N",
           lo=1, hi=65536),
    Option("max_sessions_per_peer", "int", 512, "most open sessions of one client network prefix (see "
           "--peer-prefix-v4/-v6)", metavar="N", lo=1, hi=65536),
    Option("session_open_rate", "float", 20.0, "sessions one client network prefix may open per second (burst: 5 s "
           "worth)", metavar="PER_SECOND", lo=0.001, hi=1e6),
    Option("catalog_rate", "float", 50.0, "catalog requests one client network prefix may make per second (burst: 4 s "
           "worth; a client makes 2 per connect)", metavar="PER_SECOND", lo=0.01, hi=1e6),
    Option("peer_prefix_v4", "int", 24, "IPv4 clients in one /N network count as one peer for the session cap and the "
           "rate limits", metavar="N", lo=8, hi=32),
    Option("peer_prefix_v6", "int", 64, "IPv6 clients in one /N network count as one peer for the session cap and the "
           "rate limits", metavar="N", lo=16, hi=128),
    Option("data_threads", "int", 0, "worker threads of the tcp data port; connections hold no thread", metavar="N",
           lo=2, hi=32, zero="2 per core"),
    Option("max_connections", "int", 0, "most connections each data port (tcp, shm) holds; more are refused with BUSY",
           metavar="N", lo=1, hi=65536, zero="what the open-file limit allows"),
    Option("max_connections_per_session", "int", 8, "most connections one session may hold on each data port",
           metavar="N", lo=1, hi=1024),
    Option("max_handshakes", "int", 256, "most connections waiting for their HELLO; a new one evicts the oldest",
           metavar="N", lo=1, hi=65536),
    Option("handshake_timeout", "float", 5.0, "a data connection that has not authenticated by then is closed",
           metavar="SECONDS", lo=0.01, hi=3600),
    Option("idle_timeout", "float", 0.0, "close a session's data connection idle this long", metavar="SECONDS", lo=0.01,
           hi=86400, zero="never (the session lease bounds it)"),
    Option("send_timeout", "float", 10.0, "drop a data connection that has not read a whole response this long after "
           "its sending began", metavar="SECONDS", lo=0.01, hi=3600),
    Option("shm_group", "str", "", "group that may use the shm socket besides the server's user (socket mode 0660)",
           metavar="GROUP"),
    Option("max_rows_per_request", "int", 65536, "row ids per data-transport request (clients split larger gathers); "
           "each connection may hold 8 bytes per id", metavar="N", lo=1, hi=1 << 20),
    Option("auth_token", "str", "", "bearer token every control-plane call must carry (prefer --auth-token-file or the "
           "environment: a flag shows in /proc/PID/cmdline)", metavar="TOKEN"),
    Option("auth_token_file", "str", "", "file holding the bearer token", metavar="PATH"),
    Option("allow_anonymous", "bool", False, "listen off loopback without a token (default: generate one and write it "
           "to a 0600 file next to the shm socket)"),
    Option("tls_cert", "str", "", "PEM server certificate: serve the control plane over TLS", metavar="PATH"),
    Option("tls_key", "str", "", "PEM private key of --tls-cert", metavar="PATH"),
    Option("tls_client_ca", "str", "", "PEM CA: require client certificates it signed (mutual TLS)", metavar="PATH"),
    Option("data_encryption", "choice", "auto", "seal tcp data connections with AES-256-GCM keyed from the session "
           "(rows and row ids private and authenticated): on, off, or auto (on when the control plane runs TLS)",
           choices=("auto", "on", "off")),
    Option("rdma_device", "str", "", "RDMA device (default: the first one)", metavar="NAME"),
    Option("rdma_port", "int", 1, "RDMA device port", metavar="N", lo=1, hi=255),
    Option("rdma_gid_index", "str", "", "GID index (default: the first RoCE v2 IPv4-mapped GID)", metavar="N",
           aliases=("--gid-index",), lo=0, hi=4095),
    Option("rdma_max_qps_per_session", "int", 16, "most RC QPs one client session may open", metavar="N", lo=1, hi=256),
    Option("rdma_mr_chunk_bytes", "int", 0, "register tables in memory regions of at most this many bytes",
           metavar="BYTES", lo=1 << 20, hi=1 << 44, zero="as large as the device allows"),
    Option("rdma_rkeys", "choice", "auto", "RDMA access keys: session (each session's QPs get their own memory "
           "windows; its rkeys die with it), shared (one rkey per region for everyone), auto (session where the "
           "device has memory windows)",
           choices=("auto", "session", "shared")),
    Option("rdma_pack_max_rows", "int", 16384, "owner-side packing: most row ids per request (each session's staging "
           "buffer holds that many rows)", metavar="N", lo=1, hi=65536, zero="no packing"),
    Option("disk_tables", "list", [], "tables served from disk instead of memory (names, or all): read page by page "
           "with O_DIRECT per gather, never loaded; memory holds only the I/O buffers", metavar="NAME[,NAME]|all"),
    Option("disk_stripes", "list", [], "disk tables read from stripe files on several drives (written by "
           "`tableserver stripe`), each NAME=FILE:FILE[:FILE...]; such a table is served from disk",
           metavar="NAME=FILE:FILE"),
    Option("disk_stripe_unit", "int", 1 << 20, "the stripe unit `tableserver stripe` used", metavar="BYTES",
           lo=4096, hi=1 << 30),
    Option("disk_io", "choice", "auto", "how disk tables are read: io_uring, threads (a preadv thread pool), python "
           "(Python threads), or auto (io_uring where the kernel allows it, else threads)",
           choices=("auto", "io_uring", "threads", "python")),
    Option("disk_queue_depth", "int", 64, "page reads each disk table keeps in flight", metavar="N", lo=1, hi=1024),
    Option("disk_timeout", "float", 10.0, "a disk gather whose reads take longer fails (IO_ERROR)", metavar="SECONDS",
           lo=0.01, hi=3600),
    Option("disk_buffer_mib", "int", 512, "row buffers of disk gathers not yet sent, all disk tables together; a "
           "session may hold an eighth (gathers past it wait, then are refused BUSY)", metavar="MIB", lo=1,
           hi=1 << 20),
    Option("ready_file", "str", "", "write a JSON file with the bound addresses once SERVING", metavar="PATH"),
    Option("progress", "choice", "auto", "load progress on stderr", choices=("auto", "always", "never")),
    Option("load_io", "choice", "auto", "how table files are read: direct (O_DIRECT, disk straight into pinned "
           "memory), buffered (through the page cache), or auto (direct unless the file is mostly cached)",
           choices=("auto", "direct", "buffered")),
    Option("load_workers", "int", 0, "threads that load tables", metavar="N", lo=1, hi=64, zero="min(8, cores)"),
    Option("metrics_port", "str", "", "Prometheus /metrics port (default: control port + 2; 0 = any free port; off = "
           "no endpoint)", metavar="PORT|off"),
    Option("metrics_host", "str", "127.0.0.1", "address the /metrics endpoint binds (0.0.0.0 to let a Prometheus on "
           "another host scrape it)", metavar="HOST"),
    Option("metrics_tls", "bool", False, "serve /metrics over HTTPS with the --tls-cert/--tls-key pair"),
    Option("log_level", "choice", "info", "log level", choices=("debug", "info", "warning", "error")),
    Option("log_format", "choice", "text", "log lines as text (`tableserver[pid] LEVEL logger: message key=value`) or "
           "json (one object per line)", choices=("text", "json")),
)
# fmt: on


_BY_NAME = {o.name: o for o in SERVE_OPTIONS}


def option(name: str) -> Option:
    """The serve option ``name`` (its default and bounds, for code that must agree with them)."""
    return _BY_NAME[name]


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); ConfigError naming ``what`` (the flag) otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ConfigError(f"{what} {value!r}: expected HOST:PORT, e.g. {option('listen').default}")
    return host.strip("[]"), int(port)


def add_flags(parser: argparse.ArgumentParser, options=SERVE_OPTIONS) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"TOML config file with the options below as keys, at most "
        f"{_kib(MAX_CONFIG_BYTES)} (env: {ENV_PREFIX}CONFIG)",
    )
    for opt in options:
        bounds = f"{opt.bounds}; " if opt.bounds else ""
        env_note = f" ({bounds}env {opt.env}; default {_show(opt.default)})"
        if opt.kind == "bool":
            parser.add_argument(
                opt.flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=opt.help + env_note
            )
        else:
            parser.add_argument(
                opt.flag,
                *opt.aliases,
                dest=opt.name,
                default=argparse.SUPPRESS,
                metavar=opt.metavar,
                choices=opt.choices or None,
                help=opt.help + env_note,
            )


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(value) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != "" else "unset"


def _num(x) -> str:
    """1e6 -> "1000000", 0.1 -> "0.1", 1 << 20 -> "1048576": a bound as the user would type it."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(x)


def _kib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"


def _in_range(opt: Option, v) -> bool:
    return bool(opt.zero and v == 0) or opt.lo <= v <= opt.hi


def _number(opt: Option, value, integer: bool):
    """``value`` as an int/float inside the option's range; ValueError("expected ...") otherwise."""
    want = (
        f"expected {'an integer' if integer else 'a number'} in {opt.bounds}"
        if opt.lo is not None
        else f"expected {'an integer' if integer else 'a number'}"
    )
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(want)
    try:
        if integer:
            if isinstance(value, float):  # TOML 4.0: fine; 4.5, inf, nan: not an integer
                if not value.is_integer():
                    raise ValueError
                value = int(value)
            v = int(value)
        else:
            v = float(value)
    except (ValueError, OverflowError):  # also int("1" * 5000): too many digits to convert
        raise ValueError(want) from None
    if not integer and not math.isfinite(v):
        raise ValueError(want)
    if opt.lo is not None and not _in_range(opt, v):
        raise ValueError(want)
    return v


def _convert(opt: Option, value, where: str):
    try:
        if opt.kind == "bool":
            if isinstance(value, bool):
                return value
            v = str(value).strip().lower()
            if v in _TRUE:
                return True
            if v in _FALSE:
                return False
            raise ValueError("expected true or false")
        if opt.kind == "int":
            return _number(opt, value.strip() if isinstance(value, str) else value, integer=True)
        if opt.kind == "float":
            return _number(opt, value.strip() if isinstance(value, str) else value, integer=False)
        if opt.kind == "list":
            items = value if isinstance(value, list) else str(value).split(",")
            return [str(x).strip() for x in items if str(x).strip()]
        if opt.kind == "choice":
            v = str(value).strip().lower()
            if v not in opt.choices:
                raise ValueError(f"expected one of {', '.join(opt.choices)}")
            return v
        if opt.lo is not None:  # a str option holding an integer or "" (auto)
            v = str(value).strip()
            return "" if v == "" else str(_number(opt, v, integer=True))
        return str(value)
    except ValueError as e:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ConfigError(f"{where} = {shown}: {e}") from None


def resolve(args: argparse.Namespace, environ=None, options=SERVE_OPTIONS) -> dict:
    """Merges defaults, config file, environment and flags into one dict."""
    environ = os.environ if environ is None else environ
    values = {o.name: o.default for o in options}
    by_name = {o.name: o for o in options}
    config_path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        for key, value in _read_config(config_path).items():
            name = key.replace("-", "_")
            if name not in by_name:
                raise ConfigError(f"{config_path}: unknown key {key!r}: known keys are {', '.join(sorted(by_name))}")
            values[name] = _convert(by_name[name], value, f"{config_path}: {key}")
    for opt in options:
        if opt.env in environ and environ[opt.env] != "":
            values[opt.name] = _convert(opt, environ[opt.env], opt.env)
    for opt in options:
        if hasattr(args, opt.name):
            values[opt.name] = _convert(opt, getattr(args, opt.name), opt.flag)
    return values


def _read_config(path: str, limit: int = MAX_CONFIG_BYTES) -> dict:
    """The TOML document at ``path``: a regular file of at most ``limit`` bytes; ConfigError otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below anyway)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found: fix --config") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path} ({e.strerror}): fix --config") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"config file {path} is not a regular file: pass a TOML file to --config (or {ENV_PREFIX}CONFIG)"
            )
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path} ({e.strerror}): fix --config") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(
            f"config file {path} is larger than {_kib(limit)}: a config holds a few options; "
            "pass the right file to --config"
        )
    try:
        return tomllib.loads(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML (not UTF-8 at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML ({e})") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deep to be a tableserver config: fix --config") from None


def parse_row_range(shard: str, rows: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(--shard K/N, --rows LO:HI) as (k, n) and (lo, hi); ConfigError naming the flag otherwise."""
    if shard and rows:
        raise ConfigError("--shard and --rows both given: a server holds one row range, pick one")
    if shard:
        k, sep, n = shard.partition("/")
        try:
            k, n = int(k), int(n)
        except ValueError:
            k = n = -1
        if not sep or not 0 <= k < n:
            raise ConfigError(f"--shard {shard!r}: expected K/N with 0 <= K < N, e.g. 0/2")
        return (k, n), None
    if rows:
        lo, sep, hi = rows.partition(":")
        try:
            lo, hi = int(lo), int(hi)
        except ValueError:
            lo = hi = -1
        if not sep or not 0 <= lo < hi:
            raise ConfigError(f"--rows {rows!r}: expected LO:HI with 0 <= LO < HI, e.g. 0:1000000")
        return None, (lo, hi)
    return None, None
