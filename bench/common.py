"""Helpers shared by the benchmarks: cached bench tables and a hugepage reservation."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tableserver.demo import DemoTable, write_demo_file  # noqa: E402
from tableserver.demo_run import cache_dir  # noqa: E402


def bench_table(gib: float) -> str:
    rows = int(gib * 2**30) // 264
    path = os.path.join(cache_dir(), f"bench-{rows}.bin")
    if not os.path.exists(path):
        print(f"generating {path} ({gib} GiB) ...", flush=True)
        write_demo_file(path, [DemoTable("bench", rows, 264, 1)])
    return path


HUGEPAGES = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"


class Hugepages:
    """Reserves 2 MiB hugepages for the server while the bench runs (root), as production would."""

    def __init__(self, nbytes: int):
        self.need = nbytes // (2 << 20) + 8
        self.before = None

    def __enter__(self) -> bool:
        try:
            with open(HUGEPAGES) as f:
                self.before = int(f.read())
            with open(HUGEPAGES, "w") as f:
                f.write(str(self.before + self.need))
            with open(HUGEPAGES) as f:
                return int(f.read()) >= self.before + self.need
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.before is not None:
            with open(HUGEPAGES, "w") as f:
                f.write(str(self.before))
