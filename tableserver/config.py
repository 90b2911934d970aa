"""Server configuration: one table of options, read from a TOML file, the
environment (``TABLESERVER_<NAME>``) and flags. Precedence: flags > env > file
> defaults. Every bad value is a one-line :class:`ConfigError` naming where it
came from and what is expected.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass

from tableserver.errors import ConfigError

ENV_PREFIX = "TABLESERVER_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Option:
    name: str
    kind: str  # str | int | float | bool | list | choice
    default: object
    help: str
    choices: tuple = ()
    metavar: str | None = None
    aliases: tuple = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


SERVE_OPTIONS = (
    Option("tables", "list", [], "table files to serve: engram.bin files and/or .safetensors, comma-separated",
           metavar="FILE[,FILE]"),
    Option("listen", "str", "127.0.0.1:7070", "gRPC control-plane address (port 0 = any free port)",
           metavar="HOST:PORT"),
    Option("node_id", "str", "", "this memory node's identity, stable across restarts and distinct between "
           "replicas (default: the hostname); clients route by it", metavar="ID"),
    Option("shard", "str", "", "serve shard K of N: the K-th of N equal row ranges of every table (K from 0)",
           metavar="K/N"),
    Option("rows", "str", "", "serve only table rows LO..HI-1 of every table (instead of --shard)",
           metavar="LO:HI"),
    Option("transports", "list", ["auto"], "data transports to offer, in preference order: rdma, shm, tcp, or "
           "auto (rdma when an RDMA device is usable, then shm and tcp)", metavar="NAME[,NAME]"),
    Option("tcp_listen", "str", "", "tcp data address (default: the --listen host, control port + 1)",
           metavar="HOST:PORT"),
    Option("tcp_advertise", "str", "", "host name clients use to reach the tcp port (default: its bind host)",
           metavar="HOST"),
    Option("shm_socket", "str", "", "Unix socket of the shm transport (default: $XDG_RUNTIME_DIR or "
           "/run/tableserver/tableserver-PORT.sock)", metavar="PATH"),
    Option("hugepages", "choice", "auto", "page size of table memory: auto picks 1 GiB, then 2 MiB hugepages "
           "when enough are free, else normal pages", choices=("auto", "1g", "2m", "off")),
    Option("mlock", "bool", True, "lock table memory so it never pages out"),
    Option("verify", "bool", True, "verify table checksums while loading"),
    Option("lease_seconds", "float", 15.0, "a session ends this long after its last keepalive",
           metavar="SECONDS"),
    Option("max_sessions", "int", 4096, "most open client sessions (more are refused: RESOURCE_EXHAUSTED)",
           metavar="N"),
    Option("max_sessions_per_peer", "int", 512, "most open sessions of one client host", metavar="N"),
    Option("session_open_rate", "float", 20.0, "sessions one client host may open per second (burst: 5 s "
           "worth)", metavar="PER_SECOND"),
    Option("data_threads", "int", 0, "worker threads of the tcp data port (0 = 2 per core, 2..32); connections "
           "hold no thread", metavar="N"),
    Option("max_connections", "int", 0, "most connections each data port (tcp, shm) holds (0 = what the open-file "
           "limit allows); more are refused with BUSY", metavar="N"),
    Option("max_connections_per_session", "int", 8, "most connections one session may hold on each data port",
           metavar="N"),
    Option("max_handshakes", "int", 256, "most connections waiting for their HELLO; a new one evicts the oldest",
           metavar="N"),
    Option("handshake_timeout", "float", 5.0, "a data connection that has not authenticated by then is closed",
           metavar="SECONDS"),
    Option("idle_timeout", "float0", 0.0, "close a session's data connection idle this long (0 = never: the "
           "session lease bounds it)", metavar="SECONDS"),
    Option("send_timeout", "float", 10.0, "drop a data connection that does not read its response for this long",
           metavar="SECONDS"),
    Option("shm_group", "str", "", "group that may use the shm socket besides the server's user (socket mode "
           "0660)", metavar="GROUP"),
    Option("max_rows_per_request", "int", 65536, "row ids per data-transport request (clients split larger "
           "gathers)", metavar="N"),
    Option("auth_token", "str", "", "bearer token every control-plane call must carry (prefer "
           "--auth-token-file or the environment: a flag shows in /proc/PID/cmdline)", metavar="TOKEN"),
    Option("auth_token_file", "str", "", "file holding the bearer token", metavar="PATH"),
    Option("allow_anonymous", "bool", False, "listen off loopback without a token (default: generate one and "
           "write it to a 0600 file next to the shm socket)"),
    Option("tls_cert", "str", "", "PEM server certificate: serve the control plane over TLS", metavar="PATH"),
    Option("tls_key", "str", "", "PEM private key of --tls-cert", metavar="PATH"),
    Option("tls_client_ca", "str", "", "PEM CA: require client certificates it signed (mutual TLS)",
           metavar="PATH"),
    Option("data_encryption", "choice", "auto", "seal tcp data connections with AES-256-GCM keyed from the session "
           "(rows and row ids private and authenticated): on, off, or auto (on when the control plane runs TLS)",
           choices=("auto", "on", "off")),
    Option("rdma_device", "str", "", "RDMA device (default: the first one)", metavar="NAME"),
    Option("rdma_port", "int", 1, "RDMA device port", metavar="N"),
    Option("rdma_gid_index", "str", "", "GID index (default: the first RoCE v2 IPv4-mapped GID)", metavar="N",
           aliases=("--gid-index",)),
    Option("rdma_max_qps_per_session", "int", 16, "most RC QPs one client session may open", metavar="N"),
    Option("rdma_mr_chunk_bytes", "int", 0, "register tables in memory regions of at most this many bytes "
           "(0: as large as the device allows)", metavar="BYTES"),
    Option("rdma_rkeys", "choice", "auto", "RDMA access keys: session (each session's QPs get their own memory "
           "windows; its rkeys die with it), shared (one rkey per region for everyone), auto (session where the "
           "device has memory windows)", choices=("auto", "session", "shared")),
    Option("rdma_pack_max_rows", "int", 16384, "owner-side packing: most row ids per request (0 disables it)",
           metavar="N"),
    Option("ready_file", "str", "", "write a JSON file with the bound addresses once SERVING", metavar="PATH"),
    Option("progress", "choice", "auto", "load progress on stderr", choices=("auto", "always", "never")),
    Option("load_io", "choice", "auto", "how table files are read: direct (O_DIRECT, disk straight into pinned "
           "memory), buffered (through the page cache), or auto (direct unless the file is mostly cached)",
           choices=("auto", "direct", "buffered")),
    Option("load_workers", "int", 0, "threads that load tables (0 = min(8, cores))", metavar="N"),
    Option("metrics_port", "str", "", "Prometheus /metrics port (default: control port + 2; 0 = any free "
           "port; off = no endpoint)", metavar="PORT|off"),
    Option("metrics_host", "str", "127.0.0.1", "address the /metrics endpoint binds (0.0.0.0 to let a Prometheus "
           "on another host scrape it)", metavar="HOST"),
    Option("metrics_tls", "bool", False, "serve /metrics over HTTPS with the --tls-cert/--tls-key pair"),
    Option("log_level", "choice", "info", "log level", choices=("debug", "info", "warning", "error")),
    Option("log_format", "choice", "text", "log lines as text (`tableserver[pid] LEVEL logger: message "
           "key=value`) or json (one object per line)", choices=("text", "json")),
)


def add_flags(parser: argparse.ArgumentParser, options=SERVE_OPTIONS) -> None:
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help=f"TOML config file with the options below as keys (env: {ENV_PREFIX}CONFIG)")
    for opt in options:
        env_note = f" (env {opt.env}; default {_show(opt.default)})"
        if opt.kind == "bool":
            parser.add_argument(opt.flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=opt.help + env_note)
        else:
            parser.add_argument(opt.flag, *opt.aliases, dest=opt.name, default=argparse.SUPPRESS,
                                metavar=opt.metavar, choices=opt.choices or None, help=opt.help + env_note)


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(value) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != "" else "unset"


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
            if isinstance(value, bool):
                raise ValueError("expected an integer")
            v = int(value)
            if v < 0:
                raise ValueError("expected a non-negative integer")
            return v
        if opt.kind == "float":
            v = float(value)
            if not v > 0:
                raise ValueError("expected a positive number")
            return v
        if opt.kind == "float0":
            v = float(value)
            if not v >= 0:
                raise ValueError("expected a non-negative number")
            return v
        if opt.kind == "list":
            items = value if isinstance(value, list) else str(value).split(",")
            return [str(x).strip() for x in items if str(x).strip()]
        if opt.kind == "choice":
            v = str(value).strip().lower()
            if v not in opt.choices:
                raise ValueError(f"expected one of {', '.join(opt.choices)}")
            return v
        return str(value)
    except ValueError as e:
        msg = str(e) if str(e).startswith("expected") else {
            "int": "expected a non-negative integer", "float": "expected a positive number",
            "float0": "expected a non-negative number"}.get(opt.kind, str(e))
        raise ConfigError(f"{where} = {value!r}: {msg}") from None


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
                raise ConfigError(f"{config_path}: unknown key {key!r}: known keys are "
                                  f"{', '.join(sorted(by_name))}")
            values[name] = _convert(by_name[name], value, f"{config_path}: {key}")
    for opt in options:
        if opt.env in environ and environ[opt.env] != "":
            values[opt.name] = _convert(opt, environ[opt.env], opt.env)
    for opt in options:
        if hasattr(args, opt.name):
            values[opt.name] = _convert(opt, getattr(args, opt.name), opt.flag)
    return values


def _read_config(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found: fix --config") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path} ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML ({e})") from None
