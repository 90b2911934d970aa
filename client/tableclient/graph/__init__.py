"""The decode-graph wing (placeholder map; written when the wing's modules settle)."""

from tableclient.graph.errors import GraphStepError
from tableclient.graph.step import MODES, OUTCOMES, GraphStep, gather_budget, min_from_sum
from tableclient.graph.streams import CudaStreamOps, GraphFlags, HostStreamOps, wait_flag

__all__ = [
    "GraphStep", "GraphStepError", "HostStreamOps", "CudaStreamOps", "GraphFlags", "MODES", "OUTCOMES", "wait_flag",
    "min_from_sum", "gather_budget",
]  # fmt: skip
