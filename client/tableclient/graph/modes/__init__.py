"""One object per graph mode, behind the same few calls a :class:`tableclient.graph.step.GraphStep` dispatches to
per layer (:class:`Mode`):

* :mod:`.device` -- ``device``: the table this process maps, registered with CUDA; the graph gathers the rows
  itself with a kernel on a side stream. No poller, no flags, no CPU at replay.
* :mod:`.before_replay` -- ``before_replay``: the host gathers the step's rows into the staging before the
  replay; the graph copies them.
* :mod:`.in_graph` -- ``in_graph``: the graph publishes the ids and waits for the rows flag; a poller
  (:mod:`tableclient.graph.poller`) gathers in between, overlapping the layers before.
"""

from __future__ import annotations

MODES = ("before_replay", "in_graph", "device")


class Mode:
    """What a GraphStep asks of a mode, for the layers it serves (``layers``, window order). The host's calls run
    in this order each step: :meth:`check`, :meth:`before_replay`, :meth:`arm`, (the replay:
    :meth:`publish_ids` and :meth:`rows` per layer, captured), :meth:`after_replay`."""

    name = ""

    def __init__(self, layers: list):
        self.layers = layers
        #: layer -> the device buffer the graph reads its rows from, ``[max_tokens * 24, row_bytes]`` uint8
        self.device_rows: dict = {}

    def check(self, tokens: int) -> None:
        """Before a step counts: whether this mode can serve it (GraphStepError refuses it)."""

    def before_replay(self, row_ids: dict) -> None:
        """The host, before the replay: what must be in place before the graph starts."""

    def arm(self, tokens: int) -> None:
        """The host, right before the replay of a step of ``tokens`` tokens."""

    def publish_ids(self, layer: int, ids, graph: bool) -> None:
        """The graph, right after the hasher: ``layer``'s ids (``graph=False``: an eager warm-up run)."""

    def rows(self, layer: int, tokens: int, dst, graph: bool) -> None:
        """The graph, where the layer reads its rows: they are put in ``dst`` (``[tokens * 24, row_bytes]``)."""
        raise NotImplementedError

    def write_ok(self, layer: int, ok, scratch) -> None:
        """The graph: whether ``layer``'s rows this step are the table's (1.0) or the policy's (0.0), into ``ok``
        (a device float32 [1]; ``scratch``: a device int32 [1] to stage a host flag through)."""
        scratch.copy_(self.host_ok(layer), non_blocking=True)  # a memcpy node: read at replay, not at capture
        ok.copy_(scratch)

    def host_ok(self, layer: int):
        """The host-visible int32 [1] saying whether ``layer``'s rows are the table's (modes staging on the host)."""
        raise NotImplementedError

    def after_replay(self) -> None:
        """The host, after the replay was launched."""

    def reset(self) -> None:
        """After a replay that was armed but may not have run."""

    def buffers(self) -> dict:
        """name -> address of what a captured graph touches of this mode's own."""
        return {}

    def close(self) -> None:
        """Lets go of what this mode holds. Idempotent."""


def staged_rows(staging, tokens: int, dst) -> None:
    """The graph's copy of a step's rows from the host staging (``[T, 24, row_bytes]``) into ``dst``."""
    dst.copy_(staging[:tokens].view(dst.shape), non_blocking=True)  # 0 tokens too
