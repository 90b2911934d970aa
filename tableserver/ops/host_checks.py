"""``tableserver doctor`` with a serve configuration: will this host run that server?

One :class:`~tableserver.ops.findings.Finding` per check, each naming the fix: the table files (reachable,
valid), the disk tables (named tables, opened as the daemon opens them: O_DIRECT, the read engine),
the memory plan as ``serve`` would make it (hugepages free per size and per NUMA node, cgroup
memory and hugetlb limits, MemAvailable, locked-memory limit and CAP_IPC_LOCK), the ports (free to bind),
RDMA GIDs (one matches the address clients are told), and the clock (synchronized: TLS certificates and
log timestamps depend on it). The same checks the daemon makes before loading, run without loading.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import ipaddress
import os
import socket

from tableserver.errors import TableServerError
from tableserver.ops.findings import Finding


def run(cfg: dict, rdma: bool) -> list[Finding]:
    sizes, files = check_tables(cfg)
    out = [files]
    if cfg.get("disk_tables") or cfg.get("disk_stripes"):
        out.append(check_disk(cfg))
    out += [check_memory(cfg, sizes), check_memlock(cfg, sizes), check_numa_hugepages(cfg), check_cgroup()]
    out += check_ports(cfg)
    if rdma and os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        out.append(check_gids(cfg))
    out.append(check_clock())
    return out


def check_tables(cfg: dict) -> tuple[list[int], Finding]:
    from tableserver.tables.loader import disk_table_names
    from tableserver.tables.sources import open_source

    paths = cfg.get("tables") or []
    if not paths:
        return [], Finding("tables", "FAIL", "no --tables given: pass the table file(s) the server will serve")
    sizes, described, entries = [], [], []
    for path in paths:
        try:
            source = open_source(path)
        except TableServerError as e:
            return [], Finding("tables", "FAIL", str(e))
        specs = source.specs
        entries += [(source, s) for s in specs]
        described.append(f"{path} ({len(specs)} tables, {sum(s.nbytes for s in specs) / 2**30:.2f} GiB)")
    try:
        on_disk = disk_table_names(entries, _disk_names(cfg))
    except TableServerError as e:
        return [], Finding("tables", "FAIL", str(e))
    sizes = [s.nbytes for _, s in entries if s.name not in on_disk]  # only memory tables need memory
    if on_disk:
        described.append(f"{len(on_disk)} served from disk")
    return sizes, Finding("tables", "ok", ", ".join(described))


def _disk_names(cfg: dict) -> list[str]:
    from tableserver.tables.stripe import parse_stripes

    return list(cfg.get("disk_tables") or []) + list(parse_stripes(cfg.get("disk_stripes") or []))


def check_disk(cfg: dict) -> Finding:
    """Opens each disk table as the daemon would (size, O_DIRECT probe, read engine), reading one page."""
    from tableserver.tables.loader import DiskOptions
    from tableserver.tables.sources import open_source
    from tableserver.tables.stripe import parse_stripes

    seen = []
    try:
        names, stripes = _disk_names(cfg), parse_stripes(cfg.get("disk_stripes") or [])
    except TableServerError as e:
        return Finding("disk tables", "FAIL", str(e))
    for path in cfg.get("tables") or []:
        try:
            source = open_source(path)
            for spec in source.specs:
                if "all" not in names and spec.name not in names:
                    continue
                o = DiskOptions(cfg.get("disk_io", "auto"), cfg.get("disk_queue_depth", 64), 10.0,
                                stripes.get(spec.name), cfg.get("disk_stripe_unit", 1 << 20))  # fmt: skip
                with o.reader(path, spec, 0, spec.rows) as t:
                    if spec.rows:
                        t.gather([0, spec.rows - 1])
                    seen.append(f"{spec.name} ({t.engine}, {t.io_mode})")
                    if not t.direct:
                        return Finding(
                            "disk tables", "warn", f"{spec.name}: {t.io_mode}: reads go through the page cache; "
                            "put the table file on a filesystem with O_DIRECT (ext4, xfs) on the NVMe drive"
                        )  # fmt: skip
        except (TableServerError, ValueError) as e:
            return Finding("disk tables", "FAIL", str(e))
    if not seen:
        return Finding("disk tables", "FAIL", "no table named by --disk-tables is in --tables (see the tables line)")
    return Finding("disk tables", "ok", ", ".join(seen))


def check_memory(cfg: dict, sizes: list[int]) -> Finding:
    from tableserver.tables.memory import plan_memory

    if not sizes:
        return Finding("memory plan", "warn", "no tables to plan for")
    try:
        plan = plan_memory(sizes, cfg.get("hugepages", "auto"), lock=False)
    except TableServerError as e:
        return Finding("memory plan", "FAIL", str(e))
    return Finding("memory plan", "ok", plan.describe())


def check_memlock(cfg: dict, sizes: list[int]) -> Finding:
    import resource

    from tableserver.tables.memory import has_cap_ipc_lock

    if not cfg.get("mlock", True):
        return Finding("memlock", "warn", "--no-mlock: table memory may be paged out under pressure")
    if has_cap_ipc_lock():
        return Finding("memlock", "ok", "CAP_IPC_LOCK is effective: no locked-memory limit applies")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = sum(sizes)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Finding(
            "memlock", "ok", f"locked-memory limit {'unlimited' if soft == resource.RLIM_INFINITY else soft}"
        )
    return Finding(
        "memlock",
        "FAIL",
        f"locked-memory limit is {soft / 2**20:.1f} MiB but the tables need "
        f"{need / 2**20:.1f} MiB pinned, and CAP_IPC_LOCK is not effective: raise it (`ulimit -l "
        "unlimited`, LimitMEMLOCK=infinity, or capabilities.add [IPC_LOCK] as UID 0 in Kubernetes) "
        "or pass --no-mlock",
    )


def check_numa_hugepages(cfg: dict) -> Finding:
    """Free hugepages per NUMA node: a table's memory is one memfd, placed where the loader runs."""
    nodes = {}
    for path in sorted(glob.glob("/sys/devices/system/node/node*/hugepages/hugepages-*kB/free_hugepages")):
        node = path.split("/")[5]
        size = path.split("/")[7].split("-")[1]
        try:
            with open(path) as f:
                nodes.setdefault(node, {})[size] = int(f.read())
        except (OSError, ValueError):
            continue
    text = "; ".join(f"{n}: " + ", ".join(f"{v} x {k}" for k, v in sorted(s.items())) for n, s in nodes.items())
    mode = cfg.get("hugepages", "auto")
    if mode == "off":
        return Finding("hugepages", "ok", "not used (--hugepages off)")
    size = {"1g": "1048576kB", "2m": "2048kB"}.get(mode)  # --hugepages 1g/2m: that size, not just any
    if not any(v for s in nodes.values() for k, v in s.items() if size is None or k == size):
        found = f" ({text})" if text else ""
        reserve = (
            "reserve them at boot (hugepagesz=1G hugepages=N) or per node "
            "(/sys/devices/system/node/nodeN/hugepages/.../nr_hugepages)"
        )
        if size:
            return Finding(
                "hugepages",
                "FAIL",
                f"no {mode.upper()} hugepages free{found}: --hugepages {mode} "
                f"cannot load the tables; {reserve}, or pass --hugepages auto",
            )
        return Finding(
            "hugepages", "warn", f"none free{found}: tables use 4 KiB pages (slower random gathers); " + reserve
        )
    return Finding("hugepages", "ok", text)


def check_cgroup() -> Finding:
    from tableserver.tables.cgroups import hugetlb_allowance, memory_allowance

    parts = []
    mem = memory_allowance()
    parts.append(
        f"memory: {mem.available / 2**30:.2f} GiB more allowed by {mem.cgroup} ({mem.knob})"
        if mem
        else "memory: no cgroup limit"
    )
    for hp, name in ((1 << 30, "1 GiB"), (2 << 20, "2 MiB")):
        allowed = hugetlb_allowance(hp)
        if allowed is not None:
            parts.append(f"{name} hugepages: {allowed.available // hp} allowed by {allowed.cgroup} ({allowed.knob})")
    return Finding("cgroup", "ok", "; ".join(parts))


def check_ports(cfg: dict) -> list[Finding]:
    from tableserver.config import option, parse_hostport

    found = []
    try:
        host, port = parse_hostport(cfg.get("listen", option("listen").default), "--listen")
    except TableServerError as e:
        return [Finding("ports", "FAIL", str(e))]
    wanted = [("--listen", host, port)]
    if cfg.get("tcp_listen"):
        wanted.append(("--tcp-listen", *parse_hostport(cfg["tcp_listen"], "--tcp-listen")))
    elif port:
        wanted.append(("--tcp-listen", host, port + 1))
    metrics = str(cfg.get("metrics_port", "")).strip().lower()
    if metrics not in ("off", "none", "-1"):
        wanted.append(
            (
                "--metrics-port",
                cfg.get("metrics_host") or "127.0.0.1",
                int(metrics) if metrics.isdigit() else (port + 2 if port else 0),
            )
        )
    for flag, h, p in wanted:
        if not p:
            continue
        try:
            family = socket.AF_INET6 if ":" in h else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((h, p))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            found.append(
                Finding(
                    "ports",
                    "FAIL",
                    f"{h}:{p} ({flag}) {why}: stop what holds it "
                    f"(ss -ltnp 'sport = :{p}') or pass {flag} another address",
                )
            )
    if not found:
        found.append(Finding("ports", "ok", ", ".join(f"{h}:{p} ({flag})" for flag, h, p in wanted if p) or "any"))
    return found


def check_gids(cfg: dict) -> Finding:
    """Does an RDMA GID carry the address clients are told (--tcp-advertise, else the --listen host)?"""
    host = cfg.get("tcp_advertise") or cfg.get("listen", "").rpartition(":")[0].strip("[]")
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host)) if host not in ("", "0.0.0.0", "::") else None
    except (OSError, ValueError):
        addr = None
    gids = []
    for path in sorted(glob.glob("/sys/class/infiniband/*/ports/*/gids/*")):
        try:
            with open(path) as f:
                gid = ipaddress.IPv6Address(f.read().strip())
        except (OSError, ValueError):
            continue
        if gid.packed != bytes(16):
            gids.append((path.split("/")[4], gid))
    if not gids:
        return Finding("rdma gids", "FAIL", "no RDMA port has a GID: give the RDMA netdev an IP address")
    if addr is None:
        return Finding(
            "rdma gids",
            "warn",
            f"{len(gids)} GIDs; set --tcp-advertise to the address clients use so the doctor can match it against them",
        )
    mapped = [d for d, g in gids if g.ipv4_mapped == addr or g == addr]
    if mapped:
        return Finding("rdma gids", "ok", f"{addr} is a GID of {', '.join(sorted(set(mapped)))}")
    return Finding(
        "rdma gids",
        "FAIL",
        f"no RDMA GID carries {addr}, the address clients are told: advertise the "
        "RDMA netdev's address (--tcp-advertise) or pick the device/GID with --rdma-device/--rdma-gid-index",
    )


class _Timex(ctypes.Structure):
    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("pad", ctypes.c_byte * 200),
    ]


def check_clock() -> Finding:
    """adjtimex(2): STA_UNSYNC set means nothing disciplines the clock (no NTP/PTP)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        tx = _Timex()
        state = libc.adjtimex(ctypes.byref(tx))
    except (OSError, AttributeError):
        return Finding("clock", "warn", "cannot read the clock's state")
    if state == 5 or tx.status & 0x0040:  # TIME_ERROR / STA_UNSYNC
        return Finding(
            "clock",
            "warn",
            "not synchronized (no NTP/PTP): TLS certificate checks and log times may "
            "be off; enable chrony or systemd-timesyncd",
        )
    return Finding("clock", "ok", f"synchronized (max error {tx.maxerror} us)")
