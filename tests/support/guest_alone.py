"""The guest's side process runs its tests that must have the guest to themselves last, once the rest is done.

tests/host/test_rdma_guest.py runs the suite as two pytest processes at once, one per vCPU. Some tests bound how
late a spinning thread is released after its deadline, which a test process on the other vCPU would eat into:
those (the files of ``$TABLESERVER_GUEST_ALONE``, less the single tests of ``$TABLESERVER_GUEST_NOT_ALONE``) run
last in the side process, after the rest process has ended (the guest's script then leaves the file
``$TABLESERVER_GUEST_REST_DONE``). Both processes start at once and each imports torch and the rest of a test
process once. Outside that run (no ``$TABLESERVER_GUEST_REST_DONE``) nothing changes. tests/conftest.py calls
these from its hooks.
"""

from __future__ import annotations

import os
import time

ALONE_FILES = "TABLESERVER_GUEST_ALONE"
NOT_ALONE = "TABLESERVER_GUEST_NOT_ALONE"
REST_DONE = "TABLESERVER_GUEST_REST_DONE"
#: the longest the side process waits for the rest to end (the guest's own bound is test_rdma_guest.py's)
WAIT_S = 3600.0


def _names(variable: str) -> set[str]:
    return {name for name in os.environ.get(variable, "").split(",") if name}


def alone(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/rdma/file.py::test[param]``) must have the guest to itself."""
    path, _, test = nodeid.partition("::")
    name = os.path.basename(path)
    return name in _names(ALONE_FILES) and f"{name}::{test.partition('[')[0]}" not in _names(NOT_ALONE)


def order(items: list) -> None:
    """The tests that must be alone last (a stable sort: each file's order stays), in that run only."""
    if os.environ.get(REST_DONE):
        items.sort(key=lambda item: alone(item.nodeid))


def starting(nodeid: str) -> None:
    """Before a test's set-up: one that must be alone waits until the rest process has ended."""
    marker = os.environ.get(REST_DONE)
    if not marker or not alone(nodeid):
        return
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
