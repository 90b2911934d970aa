"""Whether an in_graph layer's node answers, after a step whose rows did not come in time (its ids did).

A node that has stopped answering would stall every step of the layer by its gather budget; so once one
step ran out of time after its ids came, the layer's steps get the policy at once (the GPU goes on) while
the node is *silent*. What ends it is the node answering a gather again: each step of a silent layer
issues a probe -- a small gather of the table through the client's own transport, never waited for on the
launch path, into a buffer of its own -- and the first probe answered ends the silence (that step's
successor is gathered as ever). Not the next keepalive: the control plane answering says nothing of the
rows, and it comes up to half a second later (10-25 decode steps of zeros).

Only where the node itself did not answer: a table this process maps (shm) is never silent, its copy cannot
be late because of the node (a late step there is this host's CPU), and a node replaced by another (a new
session, a fail-over) starts anew. The state is per layer and shared by both pollers (``graphpoll`` and the
Python poller of ``graphstep``).
"""

from __future__ import annotations

import numpy as np

from tableclient.errors import TableClientError

#: what both pollers say once when a layer's node goes silent
SILENT = "layer %d: its node has not answered since a step ran out of time: the policy at once until it answers a probe"
#: rows of a probe: one token's ids (the rows are the table's first; what matters is an answer)
PROBE_ROWS = 24
#: the bound on finishing a probe whose answer came (its rows' copy; a routed gather finishes on wait)
FINISH_S = 0.1


class Silence:
    """One layer's silence: ``late(node)`` after a step's rows did not come from ``node``, ``silent(node)``
    before each step. ``table`` is the layer's RemoteTable (the probes' path), ``rows`` and ``row_bytes`` its
    shape."""

    def __init__(self, table, rows: int, row_bytes: int):
        self._table = table
        self._ids = np.arange(min(PROBE_ROWS, max(rows, 1)), dtype=np.int64)
        self._rows = np.empty((self._ids.size, row_bytes), dtype=np.uint8)
        self.node = None  # the node that went silent (None: not silent)
        self._probe = None  # the probe in flight
        #: probes issued and answered since this layer was built (what ended each silence)
        self.probes = self.answered = 0

    def late(self, node) -> bool:
        """A step's rows did not come from ``node`` (remote: tcp, rdma, the client's transport) by its deadline
        after its ids came: silent from now on. Whether it was not silent before (the caller says so once)."""
        if node is None:
            return False
        fresh = self.node is not node
        if fresh:
            self.clear()
            self.node = node
        return fresh

    def silent(self, node) -> bool:
        """Whether this step gets the policy at once: the node read now is the one that went silent and no
        probe of it was answered since. Issues the next probe (at most one in flight)."""
        if self.node is None:
            return False
        if node is not self.node:  # another node (or none) serves the table now: it did not go silent
            self.clear()
            return False
        probe = self._probe
        if probe is not None and probe.done():
            self._probe = None
            try:
                probe.wait(FINISH_S)  # its answer is in: what is left is copying 24 rows
            except (TableClientError, TimeoutError, OSError, ValueError):
                pass  # not answered: the next step probes again
            else:
                self.answered += 1
                self.clear()
                return False
        if self._probe is None:
            try:
                self._probe = self._table.gather_async(self._ids, out=self._rows)
                self.probes += 1
            except (TableClientError, TimeoutError, OSError, ValueError):
                self._probe = None  # refused at once (the node down): the next step tries again
        return True

    def probe_done(self) -> bool:
        """Whether a probe was issued and has completed (answered or failed): the next step reads it."""
        probe = self._probe
        return probe is not None and probe.done()

    def clear(self) -> None:
        """Not silent (any probe in flight abandoned: a barrier, nothing writes into its buffer after)."""
        probe, self._probe, self.node = self._probe, None, None
        if probe is not None:
            probe.cancel()
