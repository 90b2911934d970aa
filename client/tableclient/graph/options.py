"""A GraphStep's options, grouped (as the client's :mod:`tableclient.options` groups a TableClient's): one frozen
dataclass, checked once where it is built."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tableclient.bounds import check_timeout
from tableclient.graph.poller import KINDS


@dataclass(frozen=True)
class GraphOptions:
    """What a :class:`tableclient.graph.step.GraphStep` is built with, besides its client, plans, modes and
    ``max_tokens``."""

    #: row ids per token (Engram: 24)
    rows_per_token: int = 24
    #: what a layer whose rows do not come in time serves: "fail", "zeros" or "fallback" (``fallback``'s rows)
    policy: str = "fail"
    #: another TableClient, policy "fallback"'s source
    fallback: object = None
    #: the torch device the graph runs on (None: the CPU)
    device: object = None
    #: seconds a step's rows may take at most (a replay whose ids never come); finite, at most a day
    timeout: float = 5.0
    #: the stream's side of the flags (tableclient.graph.streams; None: CudaStreamOps on CUDA, else HostStreamOps)
    stream_ops: object = None
    #: pinned host buffers (None: where the device is CUDA)
    pin: bool | None = None
    #: device layers' kernels on a side stream forked after the hasher (CUDA)
    side_stream: bool = True
    #: register device tables with CUDA (False: a test's stand-in pointer)
    register: bool = True
    #: who serves in_graph layers: "auto", "native" or "python" (tableclient.graph.poller)
    poller: str = "auto"
    #: the native poller's thread at real-time priority where the process may
    realtime: bool = False
    #: per in_graph layer: seconds its gather may take once its ids came (default: gather_budget(window))
    budgets: dict | None = None
    #: a capturable reduction of each layer's ok over the tensor-parallel ranks (tableclient.graph.outcomes)
    agree: object = None
    #: policy fail checked where the engine reads a step's results (GraphStep.check); implied by ``agree``
    results_check: bool = False
    #: an engine's padding marker (vLLM's DEAD_ID): never read nor sent, zero rows
    dead_id: int | None = None
    #: CPUs set aside for pollers (the native poller claims one)
    poller_cpus: list | None = None
    #: table name -> DeviceTable registered by the caller already (used as they are, left to the caller to close)
    tables: dict | None = None

    def checked(self) -> GraphOptions:
        """These options, checked: ValueError naming the first one out of bounds."""
        if self.poller not in KINDS:
            raise ValueError(f"poller {self.poller!r}: use {', '.join(KINDS)}")
        # a deadline of inf would be one already passed, natively
        return replace(
            self,
            timeout=check_timeout("timeout", self.timeout),
            results_check=bool(self.results_check or self.agree is not None),
        )


def graph_options(options: GraphOptions | None = None, **settings) -> GraphOptions:
    """``options`` (default ones where None) with ``settings`` applied, checked."""
    return replace(options if options is not None else GraphOptions(), **settings).checked()
