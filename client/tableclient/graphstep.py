"""Deprecated: the decode-graph machinery lives in :mod:`tableclient.graph` (its ``__init__`` is the wing's map).
This name re-exports what it held for one release; import from ``tableclient.graph`` instead."""

from tableclient.graph import (  # noqa: F401
    MODES,
    OUTCOMES,
    CudaStreamOps,
    GraphFlags,
    GraphStep,
    GraphStepError,
    HostStreamOps,
    gather_budget,
    min_from_sum,
    wait_flag,
)
