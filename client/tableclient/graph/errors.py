"""The graph wing's one error: a graph-safe step cannot go on as configured."""

from __future__ import annotations

from tableclient.errors import TableClientError


class GraphStepError(TableClientError):
    """The graph-safe step cannot go on as configured (a step not consumed, a stream op refused)."""
