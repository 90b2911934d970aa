"""One memory node as a client sees it: its address, state, session and catalog."""

from __future__ import annotations

import threading

from tableclient.node import NodeSession
from tableclient.table import TableInfo


class Replica:
    """One memory node as this client sees it."""

    def __init__(self, address: str):
        self.address = address
        self.node_id = address
        self.state = "new"  # new -> idle (catalog ok) / up (session) -> down -> ...; refused: other data
        self.node: NodeSession | None = None
        self.tables: dict[str, TableInfo] = {}
        self.failures = 0
        self.retry_at = 0.0
        self.error = ""
        self.busy = False  # a connect or catalog fetch is running for it
        self.lost = False  # it had a session that was lost: the next one counts as a reconnect
        self.connect_lock = threading.Lock()

    @property
    def usable(self) -> bool:
        return self.state in ("idle", "up")

    @property
    def live(self) -> NodeSession | None:
        """Its session when it has one that is open, else None."""
        node = self.node
        return node if node is not None and not node.closed else None

    def __repr__(self) -> str:
        return f"Replica({self.address}, {self.state})"
