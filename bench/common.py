"""Helpers shared by the benchmarks: cached bench tables and a hugepage reservation."""

from __future__ import annotations

import numbers
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tableserver.common.model import ROW_BYTES  # noqa: E402
from tableserver.ops.demo_run import cache_dir  # noqa: E402
from tableserver.tables.demo import DemoTable, write_demo_file  # noqa: E402


def rss_bytes() -> int:
    """Resident anonymous + shared memory of this process (not file pages: a checkpoint's page cache)."""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def process_rss(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS), in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_placements(script: str, cases, argv: list, env: dict | None = None) -> list | None:
    """``python script --case CASE *argv`` for each case, one fresh process each, in order: the JSON line
    each prints last, or None (their error printed) as soon as one fails."""
    import json
    import subprocess

    results = []
    for case in cases:
        res = subprocess.run(
            [sys.executable, script, "--case", case, *argv], capture_output=True, text=True, check=False, env=env
        )
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return None
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return results


def bench_table(gib: float) -> str:
    rows = int(gib * 2**30) // ROW_BYTES
    path = os.path.join(cache_dir(), f"bench-{rows}.bin")
    if not os.path.exists(path):
        print(f"generating {path} ({gib} GiB) ...", flush=True)
        write_demo_file(path, [DemoTable("bench", rows, ROW_BYTES, 1)])
    return path


HUGEPAGES = "/sys/kernel/mm/hugepages/hugepages-{kb}kB/nr_hugepages"
PAGE_BYTES = {"1g": 1 << 30, "2m": 2 << 20}
PAGE_LABELS = {"1g": "1 GiB hugepages", "2m": "2 MiB hugepages", "4k": "4 KiB pages"}


class Hugepages:
    """Reserves hugepages for the server while the bench runs (root), as production would.

    ``nbytes``: the table's size, or a list of each table's (every table starts on a page of its own).
    ``prefer="1g"``: 1 GiB pages where the kernel can still find that much contiguous memory, else 2 MiB
    ones; ``"2m"``: 2 MiB pages only. ``kind`` then says what was reserved ("1g", "2m", or "4k" for
    none), ``label`` says it in words, and ``flag`` is the daemon's ``--hugepages`` value for it.
    Entering returns whether any were reserved; leaving gives back what was added."""

    def __init__(self, nbytes, prefer: str = "2m"):
        self.sizes = [int(nbytes)] if isinstance(nbytes, numbers.Integral) else [int(n) for n in nbytes]
        self.order = {"1g": ("1g", "2m"), "2m": ("2m",)}[prefer] if sum(self.sizes) else ()
        self.kind = "4k"
        self._restore: tuple[str, int] | None = None

    @property
    def label(self) -> str:
        return PAGE_LABELS[self.kind]

    @property
    def flag(self) -> str:
        return "off" if self.kind == "4k" else self.kind

    def __enter__(self) -> bool:
        for kind in self.order:
            page = PAGE_BYTES[kind]
            # every table takes at least one page (the daemon maps an empty one as one byte)
            need = sum(max(1, -(-size // page)) for size in self.sizes) + (8 if kind == "2m" else 0)
            path = HUGEPAGES.format(kb=page >> 10)
            try:
                with open(path) as f:
                    before = int(f.read())
            except OSError:
                continue  # no such page size here, or not root
            try:
                with open(path, "w") as f:
                    f.write(str(before + need))
                with open(path) as f:
                    got = int(f.read())
                if got >= before + need:
                    self.kind, self._restore = kind, (path, before)
                    return True
            except OSError:
                pass
            except BaseException:  # Ctrl-C while the kernel gathers 1 GiB pages: give them back first
                _give_back(path, before)
                raise
            _give_back(path, before)  # only part of it (no contiguous memory left), or a failed write
        return False

    def __exit__(self, *exc) -> None:
        if self._restore is not None:
            path, before = self._restore
            self._restore = None
            _give_back(path, before)


def _give_back(path: str, before: int) -> None:
    """Puts the hugepage count back to what it was before the bench reserved any."""
    try:
        with open(path, "w") as f:
            f.write(str(before))
    except OSError as e:
        print(
            f"warning: could not give back the hugepages reserved for the bench ({e}): echo {before} > {path}",
            file=sys.stderr,
        )
