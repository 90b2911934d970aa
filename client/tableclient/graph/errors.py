"""The graph wing's one error: a graph-safe step cannot go on as configured."""

from __future__ import annotations

from tableclient.errors import TableClientError


class GraphStepError(TableClientError):
    """The graph-safe step cannot go on as configured (a step not consumed, a stream op refused)."""


#: what a closed GraphStep (and its poller) answers an arm: nobody would release the step
CLOSED = (
    "this GraphStep is closed: no poller or watchdog would release a step armed now; build a new "
    "GraphStep (and capture the graphs that use it again)"
)
