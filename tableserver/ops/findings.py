"""What a ``tableserver doctor`` check found: one line each, ``ok``, ``warn`` or ``FAIL``, naming the fix.

Its own module so both the checks of the host's tools (tableserver/ops/doctor.py: pyverbs, RDMA devices,
the native take) and those of a serve configuration (tableserver/ops/host_checks.py) make them without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    check: str
    status: str  # "ok", "warn" or "FAIL"
    message: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.check}: {self.message}"


def failed(findings) -> bool:
    """Whether any of ``findings`` failed (``doctor`` then exits 1)."""
    return any(f.status == "FAIL" for f in findings)
