"""What this process's cgroups allow it: memory and hugetlb limits, cgroup v2 and v1.

A memory node in a Kubernetes pod or a systemd unit sees the host's free memory and hugepages in
/proc/meminfo and sysfs, but its cgroup may allow far less; going past it ends in the OOM killer or a
SIGBUS in the middle of a 200 GB load. The memory plan asks here first and fails before loading, naming
the cgroup and the knob.

Each function walks from this process's cgroup (``/proc/self/cgroup``) up to the root, because any
ancestor's limit binds too, and returns the tightest one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"
#: cgroup v1 has no "max": an unlimited knob reads as a huge page-rounded number (0x7ffffffffffff000 on
#: x86-64 with 4 KiB pages); a v1 limit at or above this one is none (v2 writes "max")
V1_NO_LIMIT_FROM = 1 << 62


@dataclass(frozen=True)
class Allowance:
    """``available`` more bytes may be charged to ``cgroup`` before its ``knob`` (limit ``limit``) stops us."""

    available: int
    limit: int
    cgroup: str
    knob: str


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _memberships(proc: str = "/proc/self/cgroup") -> list[tuple[str, list[str], str]]:
    """(hierarchy id, controllers, path) per line of /proc/self/cgroup."""
    out = []
    try:
        with open(proc) as f:
            for line in f:
                hid, controllers, path = line.rstrip("\n").split(":", 2)
                out.append((hid, controllers.split(",") if controllers else [], path))
    except (OSError, ValueError):
        pass
    return out


def _v2_mount(root: str) -> str | None:
    for d in (root, os.path.join(root, "unified")):
        if os.path.exists(os.path.join(d, "cgroup.controllers")):
            return d
    return None


def _ancestors(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _tightest(candidates: list[Allowance]) -> Allowance | None:
    return min(candidates, key=lambda a: a.available) if candidates else None


def _allowance(v2: tuple[str, str], v1: tuple[str, str, str], root: str, proc: str) -> Allowance | None:
    """The tightest of a limit over this process's cgroups and their ancestors: ``v2`` = (max file,
    current file) in the unified hierarchy, ``v1`` = (controller, limit file, usage file)."""
    found = []
    for hid, controllers, path in _memberships(proc):
        if hid == "0" and not controllers:
            base, (limit_file, used_file), no_limit_from = _v2_mount(root), v2, None
        elif v1[0] in controllers:
            base, (limit_file, used_file), no_limit_from = os.path.join(root, v1[0]), v1[1:], V1_NO_LIMIT_FROM
        else:
            continue
        if base is None:
            continue
        for p in _ancestors(path):
            d = os.path.join(base, p.lstrip("/"))
            limit = _read_int(os.path.join(d, limit_file))
            if limit is not None and (no_limit_from is None or limit < no_limit_from):
                used = _read_int(os.path.join(d, used_file)) or 0
                found.append(Allowance(max(0, limit - used), limit, p, limit_file))
    return _tightest(found)


def memory_allowance(root: str = ROOT, proc: str = "/proc/self/cgroup") -> Allowance | None:
    """The tightest memory limit over this process's cgroups (v2 memory.max, v1 memory.limit_in_bytes)."""
    return _allowance(
        ("memory.max", "memory.current"), ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"), root, proc
    )


def _hugetlb_name(page_size: int) -> str:
    return f"{page_size >> 30}GB" if page_size >= 1 << 30 else f"{page_size >> 20}MB"


def hugetlb_allowance(page_size: int, root: str = ROOT, proc: str = "/proc/self/cgroup") -> Allowance | None:
    """The tightest hugetlb limit for ``page_size`` pages (v2 hugetlb.<size>.max, v1 .limit_in_bytes)."""
    name = _hugetlb_name(page_size)
    return _allowance(
        (f"hugetlb.{name}.max", f"hugetlb.{name}.current"),
        ("hugetlb", f"hugetlb.{name}.limit_in_bytes", f"hugetlb.{name}.usage_in_bytes"),
        root,
        proc,
    )
