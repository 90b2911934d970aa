"""Pinned table memory: one shareable, locked memory region per table.

Each table lives in a ``memfd`` (hugetlbfs-backed when enough 1 GiB or 2 MiB
hugepages are free, shmem otherwise), mapped read-write while it is loaded,
locked with ``mlock`` so it never pages out, then sealed against growth,
shrinking and new writable mappings. The memfd is what makes the table
shareable: the shm transport passes a read-only file descriptor of it to local
clients, and the RDMA transport registers the same pages. One copy serves all.

Lifetime: the :class:`PinnedRegion` owns the fd and the mapping. Views
(``region.array``) hold a buffer export on the mapping, so the mapping stays
valid while any view lives; :meth:`close` releases the region's own references
and the kernel frees the memory once no process maps or holds the memfd.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import resource
from dataclasses import dataclass

import numpy as np

from tableserver.errors import MemoryLimitError

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
HUGE_2M = 2 << 20
HUGE_1G = 1 << 30
_HUGE_FLAGS = {HUGE_2M: getattr(os, "MFD_HUGE_2MB", 21 << 26), HUGE_1G: getattr(os, "MFD_HUGE_1GB", 30 << 26)}
_SYSFS = "/sys/kernel/mm/hugepages/hugepages-{kb}kB/{field}"
F_SEAL_FUTURE_WRITE = 0x0010
CAP_IPC_LOCK = 14

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

HUGEPAGE_MODES = ("auto", "1g", "2m", "off")


def round_up(n: int, page: int) -> int:
    return max(page, (n + page - 1) // page * page)


def free_hugepages(page_size: int) -> int:
    """Hugepages of ``page_size`` that are free and not reserved by others."""
    kb = page_size // 1024
    try:
        with open(_SYSFS.format(kb=kb, field="free_hugepages")) as f:
            free = int(f.read())
        with open(_SYSFS.format(kb=kb, field="resv_hugepages")) as f:
            resv = int(f.read())
    except (OSError, ValueError):
        return 0
    return max(0, free - resv)


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (cgroup limits: tableserver/tables/cgroups.py)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * PAGE


def has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    """Where each table's region will live, decided before anything is allocated."""

    page_sizes: tuple[int, ...]  # per table: PAGE, HUGE_2M or HUGE_1G
    total_bytes: int  # bytes that will be mapped and locked

    def describe(self) -> str:
        kinds = {PAGE: "4 KiB pages", HUGE_2M: "2 MiB hugepages", HUGE_1G: "1 GiB hugepages"}
        used = sorted(set(self.page_sizes))
        return f"{_gib(self.total_bytes)} in " + " + ".join(kinds.get(p, f"{p}-byte pages") for p in used)


def plan_memory(sizes: list[int], hugepages: str = "auto", lock: bool = True) -> MemoryPlan:
    """Chooses page sizes for tables of ``sizes`` bytes and checks every limit.

    Raises :class:`MemoryLimitError` with the fix when the tables cannot fit:
    not enough hugepages for a forced page size, not enough available memory,
    or a locked-memory limit (``ulimit -l``) smaller than the tables.
    """
    if hugepages not in HUGEPAGE_MODES:
        raise MemoryLimitError(f"unknown --hugepages {hugepages!r}: use one of {', '.join(HUGEPAGE_MODES)}")
    from tableserver.tables.cgroups import hugetlb_allowance, memory_allowance

    free = {HUGE_1G: free_hugepages(HUGE_1G), HUGE_2M: free_hugepages(HUGE_2M)}
    hugetlb = {hp: hugetlb_allowance(hp) for hp in free}
    for hp, allowed in hugetlb.items():  # the pod's or unit's hugetlb limit binds before the host's pool
        if allowed is not None:
            free[hp] = min(free[hp], allowed.available // hp)
    page_sizes = []
    for size in sizes:
        choice = PAGE
        candidates = {"auto": (HUGE_1G, HUGE_2M), "1g": (HUGE_1G,), "2m": (HUGE_2M,), "off": ()}[hugepages]
        for hp in candidates:
            if hp == HUGE_1G and hugepages == "auto" and size < HUGE_1G:
                continue  # a 1 GiB page for a small table wastes most of it
            need = round_up(size, hp) // hp
            if free[hp] >= need:
                free[hp] -= need
                choice = hp
                break
        if hugepages in ("1g", "2m") and choice == PAGE:
            hp = HUGE_1G if hugepages == "1g" else HUGE_2M
            need = round_up(size, hp) // hp
            allowed = hugetlb[hp]
            if allowed is not None and allowed.available // hp < min(need, free_hugepages(hp)):
                raise MemoryLimitError(
                    f"--hugepages {hugepages} needs {need} {hp >> 20} MiB hugepages for a {_gib(size)} table, but "
                    f"cgroup {allowed.cgroup} allows {allowed.available // hp} more ({allowed.knob} = "
                    f"{_gib(allowed.limit)}): raise it (Kubernetes: resources.limits.hugepages-"
                    f"{'1Gi' if hp == HUGE_1G else '2Mi'}) or use --hugepages auto"
                )
            raise MemoryLimitError(
                f"--hugepages {hugepages} needs {need} free {hp >> 20} MiB hugepages for a {_gib(size)} table, "
                f"{free_hugepages(hp)} are free: reserve them (echo N > "
                f"{_SYSFS.format(kb=hp // 1024, field='nr_hugepages')}) or use --hugepages auto"
            )
        page_sizes.append(choice)
    total = sum(round_up(s, p) for s, p in zip(sizes, page_sizes))
    normal = sum(round_up(s, p) for s, p in zip(sizes, page_sizes) if p == PAGE)
    cgroup = memory_allowance()
    if cgroup is not None and normal > cgroup.available:
        raise MemoryLimitError(
            f"the tables need {_gib(normal)} of memory but cgroup {cgroup.cgroup} allows {_gib(cgroup.available)} "
            f"more ({cgroup.knob} = {_gib(cgroup.limit)}): raise it (Kubernetes: resources.limits.memory; "
            "systemd: MemoryMax=), reserve hugepages for the tables, or serve fewer tables"
        )
    avail = mem_available()
    if normal > avail:
        raise MemoryLimitError(
            f"the tables need {_gib(normal)} of memory but only {_gib(avail)} is available: free memory, "
            "serve fewer tables, or reserve hugepages for them"
        )
    if lock and not has_cap_ipc_lock():
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < total:
            raise MemoryLimitError(
                f"locked-memory limit is {_gib(soft)} but the tables need {_gib(total)} pinned: raise it "
                "(`ulimit -l unlimited`, LimitMEMLOCK=infinity in the systemd unit, or --ulimit memlock=-1 "
                "for containers), or pass --no-mlock"
            )
    return MemoryPlan(tuple(page_sizes), total)


class PinnedRegion:
    """A table's memory: a memfd mapped into this process, optionally locked.

    ``array`` is a ``uint8 [nbytes]`` view of the table's bytes; ``addr`` is
    the mapping's address (what RDMA registers).
    """

    def __init__(self, name: str, nbytes: int, page_size: int = PAGE):
        self.name = name
        self.nbytes = nbytes
        self.page_size = page_size
        self.size = round_up(nbytes, page_size)
        self.locked = False
        self.sealed = False
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if page_size != PAGE:
            flags |= os.MFD_HUGETLB | _HUGE_FLAGS[page_size]
        self.fd = -1
        self._mmap = None
        try:
            self.fd = os.memfd_create(f"tableserver:{name}"[:249], flags)
            # 0400: a process handed a read-only fd cannot reopen it writable through /proc/PID/fd
            # (this process keeps writing through the mapping made below)
            os.fchmod(self.fd, 0o400)
            os.ftruncate(self.fd, self.size)
            self._mmap = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            self.close()
            raise MemoryLimitError(
                f"cannot allocate {_gib(self.size)} for table {name!r} "
                f"({os.strerror(e.errno)}): free memory or hugepages",
                errno=e.errno,
            ) from None
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes) if nbytes else np.empty(0, np.uint8)
        self.addr = np.frombuffer(self._mmap, dtype=np.uint8).ctypes.data

    @property
    def kind(self) -> str:
        return {PAGE: "shmem", HUGE_2M: "hugetlb-2M", HUGE_1G: "hugetlb-1G"}[self.page_size]

    def lock(self) -> None:
        """mlock the whole mapping (pages are resident afterwards)."""
        if _libc.mlock(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.size)) != 0:
            err = ctypes.get_errno()
            raise MemoryLimitError(
                f"mlock of {_gib(self.size)} for table {self.name!r} failed ({os.strerror(err)}): raise the "
                "locked-memory limit (`ulimit -l unlimited` / LimitMEMLOCK=infinity) or pass --no-mlock",
                errno=err,
            )
        self.locked = True

    def advise_hugepage(self) -> None:
        """Asks for transparent hugepages on a shmem region (best effort)."""
        if self.page_size == PAGE:
            _libc.madvise(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.size), 14)  # MADV_HUGEPAGE

    def seal(self) -> None:
        """Forbids resizing and any new writable mapping of the memfd.

        Existing mappings (this process's loader view) keep working; every fd
        handed out afterwards can only be mapped read-only. A kernel without
        F_SEAL_FUTURE_WRITE (< 5.1) gets the other seals; the shm transport
        refuses to start then (transports/shm.py check_read_only).
        """
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        except OSError:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.sealed = True

    def readonly_fd(self) -> int:
        """A new read-only fd of the memfd (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmaps and closes. Idempotent; views still alive keep the mapping."""
        if self._mmap is not None:
            self.array = None
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view still exports the buffer; the mapping goes when it does
            self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
