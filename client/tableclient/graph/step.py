"""Graph-safe steps: served layers' rows inside a captured decode step (a CUDA graph).

A captured graph replays fixed work on fixed addresses and runs no Python. So everything a graph touches is
allocated here, once, before capture: per served layer a device buffer the graph reads its rows from and, by the
layer's mode (:mod:`tableclient.graph.modes`: ``before_replay``, ``in_graph`` or ``device``), a staging buffer in
pinned host memory ``[max_tokens, 24, row_bytes]`` (its EngramStep's), pinned ids and host-visible flags, or the
table registered for the graph's own kernel. After that no method allocates anything a graph can see.
:class:`GraphStep` dispatches each call per layer to the layer's mode and keeps each step's outcome across ranks
(:mod:`tableclient.graph.outcomes`).

Flag protocol. The values a graph writes and waits for are baked into it, so they are constants; per ``in_graph``
layer three uint32 (ids, rows, ok) in pinned, device-mapped host memory, a 64-byte line each::

    graph      copy ids -> ids buffer; write ids = 1; ...; wait rows == 1; write rows = 0; copy rows
    arm        (host, before replay) waits until the last step was released, its graph consumed the
               release (rows == 0) and any late ids flag of it was taken; then arms the next step
    poller     waits ids == 1; ids = 0; gathers the armed step's tokens into the staging; rows = 1
    watchdog   at the deadline, unless released: cancels the gather (a barrier), fills, rows = 1

Only one of poller and watchdog releases a step, and only the step it was decided for (a state and a step
number: :mod:`tableclient.graph.poller.slots`, or the native poller's own); a step released before its graph
published the ids owes that flag, which the poller then takes without gathering; ids of a replay nobody armed are
released at once with zeros. The stream's side is :mod:`tableclient.graph.streams`: :class:`CudaStreamOps`
(captured as graph memory-operation nodes, after a start-up probe on the device) or :class:`HostStreamOps` (the
host, in the calling thread).
"""

from __future__ import annotations

from tableclient.graph.errors import CLOSED, GraphStepError
from tableclient.graph.modes import MODES
from tableclient.graph.modes.before_replay import BeforeReplayMode
from tableclient.graph.modes.device import DeviceMode
from tableclient.graph.modes.in_graph import InGraphMode, gather_budget
from tableclient.graph.options import GraphOptions, graph_options
from tableclient.graph.outcomes import OUTCOMES, Outcomes, min_from_sum
from tableclient.graph.poller.silence import Silence
from tableclient.graph.streams import CudaStreamOps, GraphFlags, HostStreamOps, wait_flag

__all__ = [
    "GraphStep", "GraphOptions", "GraphStepError", "HostStreamOps", "CudaStreamOps", "GraphFlags", "MODES",
    "OUTCOMES", "wait_flag", "min_from_sum", "gather_budget",
]  # fmt: skip


class GraphStep:
    """Everything captured decode graphs touch for the served layers of one client, and the host side of each step
    (see the module docstring). ``modes``: layer -> graph mode (``before_replay`` where absent); the options are
    :class:`tableclient.graph.options.GraphOptions`' (``options``, and/or each by its name)."""

    def __init__(self, client, plans: list, modes: dict, max_tokens: int, options: GraphOptions | None = None,
                 **settings):  # fmt: skip
        import torch

        self.modes = {p.layer: modes.get(p.layer, "before_replay") for p in plans}
        for layer, mode in self.modes.items():
            if mode not in MODES:
                raise ValueError(f"layer {layer}: unknown graph mode {mode!r}: use {', '.join(MODES)}")
        o = self.options = graph_options(options, **settings)
        self.torch = torch
        self.max_tokens, self.rows_per_token, self.timeout, self.policy = (
            max_tokens,
            o.rows_per_token,
            o.timeout,
            o.policy,
        )
        self.dead_id = o.dead_id  # an engine's padding marker (vLLM's DEAD_ID): never read nor sent, zero rows
        self.device = torch.device(o.device) if o.device is not None else torch.device("cpu")
        cuda = self.device.type == "cuda"
        pin = cuda if o.pin is None else o.pin
        self.layers = [p.layer for p in sorted(plans, key=lambda p: p.window_s)]

        def of(mode: str) -> list:
            return [p for p in plans if self.modes[p.layer] == mode]

        device = DeviceMode(torch, client, of("device"), o, self.device, max_tokens) if of("device") else None
        for layer in device.unavailable if device is not None else ():
            self.modes[layer] = "before_replay"  # its table could not be registered: the host path (said why)
        common = dict(rows_per_token=o.rows_per_token, policy=o.policy, fallback=o.fallback, pin=pin,
                      timeout=o.timeout, dead_id=o.dead_id)  # fmt: skip
        pre = BeforeReplayMode(torch, client, of("before_replay"), o, self.device, max_tokens, common) if of("before_replay") else None  # fmt: skip
        self.flags = GraphFlags(torch, len(of("in_graph")), pin)
        self.ops = o.stream_ops
        if self.ops is None:
            self.ops = CudaStreamOps(torch, self.device) if cuda and of("in_graph") else HostStreamOps(o.timeout * 4)
        if isinstance(self.ops, CudaStreamOps):
            self.flags.device_ptr(self.ops, 0)  # resolved now, not inside the first capture
        post = None
        try:
            if of("in_graph"):
                post = InGraphMode(
                    torch, client, of("in_graph"), o, self.device, max_tokens, common, self.flags, self.ops
                )
        except BaseException:
            for mode in (device, pre):
                if mode is not None:
                    mode.close()
            raise
        # the modes in the order the host calls them each step: what refuses a step before it counts comes first
        self._modes = [m for m in (device, pre, post) if m is not None and m.layers]
        self._mode_of = {layer: m for m in self._modes for layer in m.layers}
        self._poller = post.poller if post is not None else None
        #: the before_replay and in_graph layers' EngramSteps (None: no such layer)
        self.pre, self.post = (pre.step if pre else None), (post.step if post else None)
        #: device layers: their registered tables
        self.device_tables = device.tables if device is not None else {}
        #: per layer, the device buffer its rows are read from (the copy's or the kernel's fixed destination)
        self.device_rows = {layer: self._mode_of[layer].device_rows[layer] for layer in self.layers}
        #: the ids buffers a graph writes: in_graph layers' pinned ones, device layers' on the device
        self.ids = (post.ids if post else {}) | (device.ids if device else {})
        #: per in_graph layer: seconds its gather may take once its ids came (gather_budget(window) by default)
        self.budgets = post.budgets if post else {}
        self.outcomes = Outcomes(torch, self.device, self.layers, o.policy, o.agree, o.results_check, pin)
        self.results_check = self.outcomes.results_check
        self._closed = False

    @property
    def poller(self) -> str | None:
        """Who serves the in_graph layers: "native" (one C thread, no GIL), "python", or None (none)."""
        return None if self._poller is None else self._poller.kind

    @property
    def poller_cpu(self) -> int | None:
        """The CPU the native poller's thread is pinned to (one of ``poller_cpus``), or None."""
        return None if self._poller is None else self._poller.cpu

    @property
    def poller_realtime(self) -> bool:
        """Whether the native poller's thread runs at real-time priority (asked for with ``realtime``)."""
        return self._poller is not None and self._poller.realtime

    # ------------------------------------------------------------------ what a graph touches
    def buffers(self) -> dict:
        """name -> address of every buffer a captured graph reads or writes (fixed for this step's life)."""
        out = {name: address for mode in self._modes for name, address in mode.buffers().items()}  # staging, tables
        out |= {f"device.{layer}": t.data_ptr() for layer, t in self.device_rows.items()}
        out |= {f"ids.{layer}": t.data_ptr() for layer, t in self.ids.items()}
        out["flags"] = self.flags.tensor.data_ptr()
        return out

    def publish_ids(self, layer: int, ids, graph: bool = True) -> None:
        """The graph's side, right after the hasher: layer ``layer``'s ids (``[T, 24]`` int64 on the device, T the
        graph's tokens) to its mode: an in_graph layer's into the pinned ids buffer, then its ``ids`` flag
        (``graph=False``, an eager warm-up run of a capture, copies only: nobody is armed to answer); a device
        layer's to its kernel, on the side stream (:meth:`rows` joins it), so the gather overlaps every layer
        before it. Call it for the layers in window order (layer 1 first): the side stream runs them in that
        order."""
        mode = self._mode_of.get(layer)
        if mode is not None:
            mode.publish_ids(layer, ids, graph)

    def rows(self, layer: int, tokens: int, graph: bool = True):
        """The graph's side, where the layer reads its rows: ``[tokens * 24, row_bytes]`` uint8 on the device
        (copied from the staging: an in_graph layer first waits for its ``rows`` flag and clears it; a device
        layer's kernel wrote them). ``graph=False``: the copy alone (an eager warm-up run)."""
        dst = self.device_rows[layer][: tokens * self.rows_per_token]
        mode = self._mode_of[layer]
        mode.rows(layer, tokens, dst, graph)
        if graph and self.results_check:
            self.outcomes.track(layer, dst, mode)
        return dst

    # ------------------------------------------------------------------ the host, every step
    def check_tables(self, tokens: int) -> None:
        """Before a replay (``arm`` calls it): every mode's check; the device layers' tables mapped now are the
        ones their kernels read (:meth:`tableclient.graph.modes.device.DeviceMode.check`)."""
        for mode in self._modes:
            mode.check(tokens)

    def before_replay(self, row_ids: dict) -> None:
        """Every before_replay layer's rows for this step (``row_ids[layer]``: host ``[T, 24]`` ids of the step's
        real tokens) gathered into its staging, shortest window first; returns once all are in place (the failure
        policy applied per layer). The caller sees to it that the last replay's copies out of the staging are done
        (SGLang's hook: copying the step's ids to the host waits for the stream, and with it for the last
        replay)."""
        self._check_open()
        for mode in self._modes:
            mode.before_replay(row_ids)

    def arm(self, tokens: int) -> int:
        """Before the replay of a step of ``tokens`` real tokens: every in_graph layer will gather that many of the
        ids the graph publishes, by the layer's timeout. Returns the step's number (for :meth:`check`). An engine
        may launch this step while the last one still runs on the GPU (SGLang's overlap scheduler): arm waits,
        bounded by the timeout, until the last step was released, its graph consumed the release (``rows == 0``),
        and a late ids flag of a step released before its ids came was consumed; GraphStepError past that (a
        replay armed and never launched: call :meth:`reset`), or at once once closed."""
        self._check_open()
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens in a step, this GraphStep holds {self.max_tokens}")
        self.check_tables(tokens)
        step = self.outcomes.next_step()
        for mode in self._modes:
            mode.arm(tokens)
        return step

    def after_replay(self) -> None:
        """After the replay was launched. With policy ``fail``: waits for every in_graph layer's release (bounded
        by its timeout) and raises the first layer's error, so a step with a failed layer is never read. Other
        policies, and ``results_check`` (the check is :meth:`check`'s, where the engine reads the step's results),
        return at once."""
        for mode in self._modes:
            mode.after_replay()

    def check(self, step: int) -> None:
        """Where the engine reads step ``step``'s results (``step`` from :meth:`arm`; its outputs computed, e.g.
        copied to the host): with ``results_check``, whether every layer served the table's rows on every rank
        (:meth:`tableclient.graph.outcomes.Outcomes.check`). Call it for every replayed step, at most OUTCOMES - 1
        steps after it was armed."""
        self.outcomes.check(step)

    def silence(self, layer: int) -> Silence:
        """In_graph layer ``layer``'s silence (:mod:`tableclient.graph.poller.silence`), by either poller: whether
        its node has answered since a step ran out of time, and its probes."""
        return self._poller.silence(layer)

    def released_at(self, layer: int) -> float:
        """When in_graph layer ``layer``'s last step was released (time.monotonic()'s clock), by either poller:
        how long the rows took, for a stand-in of the GPU that notices the release late itself."""
        return self._poller.released_at(layer)

    def account(self) -> None:
        """Folds what the native poller did into the metrics (waits, watchdog releases, zero rows): every arm does
        it for the steps before, off the hot path; call it before reading them right after a step."""
        if self._poller is not None:
            self._poller.account()

    def reset(self) -> None:
        """After a replay that was armed but may not have run (the engine's launch raised): waits for the device
        to finish what it queued, then clears every flag and step state. Once closed it leaves the flags as close
        released them (a replay waits for nobody)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        self.outcomes.reset()
        for mode in self._modes:
            mode.reset()

    def _check_open(self) -> None:
        if self._closed:
            raise GraphStepError(CLOSED)

    def close(self) -> None:
        """Stops the poller and abandons gathers in flight; a graph replayed after this waits for nobody.
        Idempotent."""
        if self._closed:
            return
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        self._closed = True
        for mode in self._modes:
            mode.close()
