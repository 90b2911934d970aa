"""The decode-graph wing: served layers' rows inside an engine's captured decode step (a CUDA graph).

The map, a line a module (who owns what):

* ``step``            :class:`GraphStep` -- allocates what a graph touches, dispatches each call per layer to the
                      layer's mode, runs the flag protocol (its docstring)
* ``options``         :class:`GraphOptions` -- a GraphStep's options, grouped and checked
* ``modes/``          one object per graph mode behind the same calls (``Mode``: check, before_replay, arm,
                      publish_ids, rows, after_replay, reset): ``device``, ``before_replay``, ``in_graph``
* ``outcomes``        each step's outcome across tensor-parallel ranks (``agree``, ``check``), :func:`min_from_sum`
* ``poller/``         who serves in_graph layers: one contract (``Poller``), two implementations -- ``native`` (a C
                      thread, ``_native_c/`` by concept, ``wire.h`` the wire's constants) and ``python`` (threads
                      over the pure ``slots`` state machine); ``keeper`` (the native one's connections, with
                      back-off), ``silence`` (a node that stopped answering), ``cpu``
                      (CPUs set aside for pollers)
* ``device/``         device tables (``table``: a mapped table registered with CUDA) and their gather kernel
                      (``kernel``, Triton)
* ``streams``         the stream's side of the flags (captured stream memory operations, or the host) and the flags
                      themselves; ``_flags.c`` their wait without the GIL
* ``cuda``            the CUDA driver's names (cuda-bindings), resolved once
* ``errors``          :class:`GraphStepError`

It imports the client core (the client, its EngramStep, metrics, errors) and ``tableserver.common``, never an
engine or an adapter (``setup.cfg``'s import contracts); the adapters (``tableclient.sglang``, ``tableclient.vllm``,
``tableclient.engine``) import it. torch is imported where a GraphStep is built, never by importing this wing.
"""

from tableclient.graph.errors import GraphStepError
from tableclient.graph.modes import MODES
from tableclient.graph.modes.in_graph import gather_budget
from tableclient.graph.options import GraphOptions
from tableclient.graph.outcomes import OUTCOMES, min_from_sum
from tableclient.graph.step import GraphStep
from tableclient.graph.streams import CudaStreamOps, GraphFlags, HostStreamOps, wait_flag

__all__ = [
    "GraphStep", "GraphOptions", "GraphStepError", "HostStreamOps", "CudaStreamOps", "GraphFlags", "MODES",
    "OUTCOMES", "wait_flag", "min_from_sum", "gather_budget",
]  # fmt: skip
