"""A CPU for the native in_graph poller: the list an operator sets aside, one CPU per poller on the host.

A spinning poller that shares its core with the engine's threads is preempted and migrated now and then,
and each time is a step's tail. An operator who keeps some cores free of the engine (``taskset``,
``isolcpus``, a cpuset) names them in ``poller_cpus`` (``TABLESERVER_POLLER_CPUS="14,15"``); every
GraphStep of every rank process on this host then claims one of them for its poller, so no two pollers
share one.

A claim is an exclusive ``flock`` on ``/dev/shm/tableserver-poller-cpu-<N>``: the kernel drops it when the
process ends, however it ends, so a crashed rank never keeps its CPU. Processes that do not share
``/dev/shm`` (separate containers) do not see each other's claims.
"""

from __future__ import annotations

import fcntl
import os

CLAIM_DIR = "/dev/shm"
#: CPUs a thread can be pinned to (glibc's CPU_SETSIZE: the native poller's cpu_set_t)
MAX_CPUS = 1024


def parse_cpus(text: str) -> list[int]:
    """``"14,15"`` or ``"12-15,20"`` (the kernel's cpulist form) -> [12, 13, 14, 15, 20]; "" -> [].
    ValueError (one line: the part and the form to use) on anything else."""
    cpus: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            first = last = -1
        if first < 0 or last < first:
            raise ValueError(f"poller_cpus {text!r}: {part!r} is not a CPU or a range: use e.g. '14,15' or '12-15'")
        if last >= MAX_CPUS:
            raise ValueError(f"poller_cpus {text!r}: CPU {last} is beyond the {MAX_CPUS} a poller can be pinned to")
        cpus.extend(c for c in range(first, last + 1) if c not in cpus)
    return cpus


class CpuClaim:
    """One CPU of the list, held until ``close()`` (idempotent) or the process ends."""

    def __init__(self, cpu: int, fd: int):
        self.cpu, self._fd = cpu, fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # the lock goes with the descriptor

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def claim(cpus: list[int], directory: str = CLAIM_DIR) -> CpuClaim | None:
    """The first CPU of ``cpus`` no other poller on this host holds, or None when every one is held (or
    none can be claimed: no ``directory``)."""
    for cpu in cpus:
        path = os.path.join(directory, f"tableserver-poller-cpu-{cpu}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:  # another user's claim file: a lock needs no write access
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return CpuClaim(cpu, fd)
    return None
