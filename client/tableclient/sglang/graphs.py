"""Served Engram layers inside SGLang's captured decode step (decode CUDA graphs on).

SGLang 0.5.23 captures the whole decode forward -- its Engram hasher, history commit and the layers'
lookups -- and at replay runs no model Python: only ``DecodeCudaGraphRunner.execute`` (``load_batch``,
then ``backend.replay``). The plugin therefore works in two places:

* around ``DecodeCudaGraphRunner.capture``: before anything is captured, every buffer a graph will touch
  is allocated (:class:`~tableclient.graph.step.GraphStep` per placement: staging, device rows, ids,
  flags, events), the configuration is checked against the runner (what is not handled is refused,
  naming the flag), and while the capture runs the served layers' forward records, instead of a
  lookup, the copy of their staged rows to the device and SGLang's own dequantization of them;
* around ``DecodeCudaGraphRunner.execute`` (the host, before every replay): ``before_replay`` layers'
  row ids are computed with SGLang's own hasher on a scratch copy of its history (its history is
  never written twice: the graph commits), copied to the host, gathered into the staging for the
  real tokens only (never the padded bucket's), and only then is the graph replayed; ``in_graph``
  layers are armed for the step's real tokens, and the graph itself publishes their ids right after
  its hasher and waits for their rows just before the layer; ``device`` layers (``node`` tables, mapped
  here and registered with CUDA) are gathered by the graph's own kernel, launched right after its hasher
  on a side stream (inline with the breakable backend, whose segments are separate graphs), so the host
  only checks before each replay that the table it registered is the one mapped; ``eager_break`` layers (with
  ``--cuda-graph-backend-decode breakable``) run between captured segments, as SGLang's own breakable
  prefill runs its Engram lookup.

Ranks (tensor parallelism, DP attention's ranks included) agree: each layer's graph mode and the poller are decided
once, before capture, over the tensor-parallel group (:mod:`tableclient.engine.ranks`: a device table one rank cannot
register puts the layer before_replay on every rank), and each replay reduces every layer's rows-ok inside the graph,
its rows masked by it; the outcome is checked where the scheduler processes the batch's result. A replay of no real
tokens (an idle batch of DP attention, which replays the graph beside its peers' decode) gathers nothing and its
before_replay layers' rows count as the table's: an idle rank never masks its peers' rows by an earlier step's outcome.
An eager_break layer's rows are agreed in the eager break, by the host (:func:`served_alike`: one MIN over the CPU
group per layer and replay), as the hooks agree the rows of every forward outside a decode graph.

Refused at start-up: speculative decoding (its verify graphs hash blocks and commit after accept),
two-batch overlap and PDMux (several graph sets per step, one staging).

The hooks (``hooks``) call in here; nothing here imports them back (an import contract in setup.cfg):
what both need is the engine-neutral core's (``tableclient.engine``), and a session's rows are the
:class:`~tableclient.engine.rows.EngramRows` it was prepared with.
"""

from __future__ import annotations

import logging
import weakref

from tableclient.engine.plugin import PluginError
from tableclient.engine.ranks import Ranks, agree_pollers, describe, register_tables
from tableclient.engine.ranks import served_alike as ranks_served_alike
from tableclient.engine.rows import EngramRowsError, dequantize, to_device

log = logging.getLogger(__name__)

GRAPH_MODES = ("before_replay", "in_graph", "eager_break", "device")


class _Session:
    """The decode graphs of one runner: what they touch, and where a capture or a replay stands. ``rows``:
    the process's :class:`~tableclient.engine.rows.EngramRows` they were prepared with."""

    def __init__(self, runner, hasher, rows, steps: dict, layers: dict, breakable: bool, max_tokens: int,
                 tables: dict | None = None):  # fmt: skip
        import torch

        self.runner, self.hasher, self.rows, self.steps, self.layers = runner, hasher, rows, steps, layers
        self.tables = tables or {}  # the device layers' tables (name -> DeviceTable), closed with the session
        self.breakable, self.max_tokens = breakable, max_tokens
        self.capturing = False  # inside DecodeCudaGraphRunner.capture (warm-ups and captures)
        self.peeking = False  # the hasher runs for the ids before a replay: no eager prefetch of its own
        # the graph's flag operations run on the host, in the forward's thread (an engine without CUDA
        # replaying a step by running the captured forward again; the tests): HostStreamOps
        self.replay_on_host = False
        self.tokens = 0  # the real tokens of the step being replayed (eager breaks read it)
        # a scratch history for the non-committing hash: SGLang's hasher commits into it, not its own
        self.scratch = torch.empty_like(hasher.history)
        self.events = {layer: torch.cuda.Event() if torch.cuda.is_available() else None for layer in layers}
        self.armed: dict = {}  # placement -> the number of the step armed for the next replay
        self.replayed: list = []  # (placement, step) replayed since the scheduler's run_batch began

    def step_of(self, layer: int):
        return self.steps.get(self.layers[layer].placement)

    def mode(self, layer: int) -> str:
        return self.layers[layer].graph_mode


_session: dict = {"active": None}
#: id(a scheduler's batch result) -> (a weak reference to it, the (placement, step) its replays ran), until
#: it is processed (SGLang's results are unhashable dataclasses: keyed by identity, dropped once collected)
_results: dict = {}


def session() -> _Session | None:
    return _session["active"]


def capturing() -> bool:
    s = session()
    return s is not None and s.capturing


# ---------------------------------------------------------------------- start-up
def check_runner(runner, modes: dict) -> None:
    """PluginError (naming the launch flag) for what served layers in decode graphs do not handle."""
    spec = getattr(runner, "speculative_algorithm", None)
    if spec is not None and not (spec.is_none() if hasattr(spec, "is_none") else not spec):
        raise PluginError(
            "tableserver plugin: served Engram layers in decode CUDA graphs do not handle speculative "
            "decoding (its verify graphs hash blocks and commit after accept): drop "
            "--speculative-algorithm, launch with --cuda-graph-backend-decode disabled, or place the "
            "layers 'local'"
        )
    if getattr(runner, "enable_two_batch_overlap", False):
        raise PluginError(
            "tableserver plugin: served Engram layers in decode CUDA graphs do not handle two-batch "
            "overlap: drop --enable-two-batch-overlap, or place the layers 'local'"
        )
    if getattr(runner, "enable_pdmux", False):
        raise PluginError(
            "tableserver plugin: served Engram layers in decode CUDA graphs do not handle PDMux (one "
            "graph set per stream group): drop --enable-pdmux, or place the layers 'local'"
        )
    breakable = type(runner.backend).__name__ == "BreakableCudaGraphBackend"
    eager = sorted(layer for layer, mode in modes.items() if mode == "eager_break")
    if eager and not breakable:
        raise PluginError(
            f"tableserver plugin: layer {eager[0]} is graph mode 'eager_break', which needs "
            "--cuda-graph-backend-decode breakable: launch with it, or use before_replay/in_graph"
        )
    if breakable and any(mode == "in_graph" for mode in modes.values()) and _debug_cuda_graph():
        raise PluginError(
            "tableserver plugin: with --debug-cuda-graph the whole decode forward runs as one eager "
            "break, so in_graph layers would never see their graph: drop --debug-cuda-graph, or "
            "place the layers 'before_replay'"
        )


def _debug_cuda_graph() -> bool:
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().graph.debug_cuda_graph)
    except Exception:  # no server configuration published (a runner built outside SGLang's launcher)
        return False


def prepare(runner, rows) -> _Session | None:
    """Before a decode runner captures: the session of its graphs (None when no layer is served)."""
    import torch
    from sglang.srt.layers.engram import EngramHasher

    old = session()
    if old is not None and old.runner is not runner:
        raise PluginError(
            "tableserver plugin: a second decode CUDA graph runner in one process (a draft model's?) "
            "is not supported with served Engram layers: drop the speculative model, or place the "
            "layers 'local'"
        )
    close()  # the same runner capturing again: its old graphs go with the old session
    if not rows.layers:
        return None
    hashers = [m for m in runner.model_runner.model.modules() if isinstance(m, EngramHasher)]
    if len(hashers) != 1 or hashers[0].history is None:
        raise EngramRowsError(
            f"tableserver plugin: expected one Engram hasher with its history in the model, found "
            f"{len(hashers)}: the plugin cannot serve this model's decode graphs"
        )
    modes = {layer: s.graph_mode for layer, s in rows.layers.items()}
    check_runner(runner, modes)
    missing = [layer for layer, s in rows.layers.items() if s.hash_index is None]
    if missing:
        raise EngramRowsError(
            f"tableserver plugin: layer {missing[0]} has no hash column: the plugin's Engram hook did not run"
        )
    tokens = int(runner.max_bs) * int(getattr(runner, "captured_req_width", 1))
    device = hashers[0].history.device
    device = device if device.type == "cuda" else torch.device("cpu")
    breakable = type(runner.backend).__name__ == "BreakableCudaGraphBackend"
    group = tp_ranks()
    tables = _device_tables(group, rows, device)
    # a breakable graph is several graphs: a device layer's kernel stays on the capturing stream there
    agree, ranks = tp_agreement()

    def build(placements=None, poller="auto"):
        return rows.graph_steps(
            tokens, device, side_stream=not breakable, agree=agree, tables=tables, poller=poller,
            results_check=rows.config.policy == "fail" or agree is not None, placements=placements,
        )  # fmt: skip

    steps = agree_pollers(group, build(), lambda redo: build(redo, poller="python"))
    if agree is not None:
        log.info("tableserver plugin: the %d tensor-parallel ranks agree each step on whether every served "
                 "layer's rows are the table's (else all serve the policy's)", ranks)  # fmt: skip
    s = _Session(runner, hashers[0], rows, steps, dict(rows.layers), breakable, tokens, tables)
    _session["active"] = s
    interval = rows.config.switch_interval
    if interval and any(sl.graph_mode == "in_graph" for sl in rows.layers.values()):
        import sys

        log.info(
            "tableserver plugin: GIL switch interval %g s -> %g s (switch_interval): in_graph layers' poller "
            "gathers in Python",
            sys.getswitchinterval(),
            interval,
        )
        sys.setswitchinterval(interval)
    if group.first:
        eager = [f"layer {layer} eager_break" for layer in sorted(rows.layers) if s.mode(layer) == "eager_break"]
        log.info(
            "tableserver plugin: decode CUDA graphs of up to %d tokens: %s",
            tokens,
            "; ".join(x for x in (describe(steps, group), ", ".join(eager)) if x),
        )
    return s


def _device_tables(group: Ranks, rows, device) -> dict:
    """The device layers' tables registered with CUDA where every rank of ``group`` can register them (name ->
    DeviceTable); a layer refused on any rank is gathered before_replay on every one, each rank saying why."""
    wanted = {layer: sl.table for layer, sl in rows.layers.items() if sl.graph_mode == "device"}
    tables: dict = {}
    if not wanted:  # the same on every rank: the configuration places the device layers
        return tables
    for layer, why in register_tables(group, rows.client("node"), wanted, device, tables).items():
        log.warning("tableserver plugin: Engram layer %d: graph mode 'device' unavailable (%s): its rows are gathered "
                    "before_replay", layer, why)  # fmt: skip
        rows.layers[layer].graph_mode = "before_replay"
    return tables


def tp_ranks() -> Ranks:
    """SGLang's tensor-parallel group, for the decisions its ranks take alike at start-up (its CPU group: gloo); one
    rank where there are no process groups (a runner built outside SGLang's launcher)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        group = get_parallel().tp_group
    except (RuntimeError, ValueError):  # not written in this process: no groups built
        return Ranks()
    if group is None:
        return Ranks()
    return Ranks(group.world_size, group.rank_in_group, group.cpu_group)


def served_alike(rows, layer: int, fetch):
    """A served layer's rows of one eager step (outside any captured graph), agreed over SGLang's tensor-parallel
    group (:func:`tableclient.engine.ranks.served_alike`): ``fetch()``'s result, or None where every rank serves
    zeros; PluginError on every rank where one's fetch raised. One rank: ``fetch()``, no collective."""
    return ranks_served_alike(tp_ranks(), rows, layer, fetch)


def tp_agreement():
    """(agree, ranks): over SGLang's tensor-parallel group, with its own capturable all-reduce, where it has
    more than one rank (the ranks' rows of a layer meet in its collectives); (None, 1) otherwise. (SGLang
    0.5.23's ``sglang.srt.distributed`` does not export its world-size getter: the group says it.)"""
    from tableclient.graph import min_from_sum

    group = tp_ranks()
    if group.size <= 1:
        return None, 1
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    return min_from_sum(tensor_model_parallel_all_reduce, group.size), group.size


# ---------------------------------------------------------------------- every step (host)
def peek_hash_ids(hasher, scratch, input_ids, forward_batch):
    """The step's row ids ``[T, layers, 24]``, computed by SGLang's own hasher exactly as the graph will
    compute them (its kernel on the GPU, its torch path elsewhere), without committing: the hasher runs
    on ``scratch``, a copy of its history made now, and the graph's hasher then commits into the real
    one. Any forward mode."""
    history = hasher.history
    scratch.copy_(history)
    hasher.history = scratch
    s = session()
    if s is not None:
        s.peeking = True  # the plugin's hasher hook must not prefetch these ids: they are gathered right here
    try:
        return hasher(input_ids, forward_batch)
    finally:
        hasher.history = history
        if s is not None:
            s.peeking = False


def before_replay(s: _Session, forward_batch, tokens: int) -> None:
    """The host's part of a step, once SGLang has loaded the batch into the graph's buffers and before it
    replays the graph: ``tokens`` real tokens (the padded bucket's rows are never fetched)."""
    import numpy as np

    s.tokens = tokens
    pre = {layer: sl for layer, sl in s.layers.items() if sl.graph_mode == "before_replay"}
    if pre:  # no real token (an idle batch): nothing gathered, the rows' outcome the table's all the same
        ids = None
        if tokens:
            ids = peek_hash_ids(s.hasher, s.scratch, forward_batch.input_ids[:tokens], forward_batch).to("cpu")
        by_placement: dict = {}
        for layer, sl in pre.items():
            by_placement.setdefault(sl.placement, {})[layer] = (
                ids[:, sl.hash_index].numpy() if ids is not None else np.zeros((0, 24), dtype=np.int64)
            )
        for placement, row_ids in sorted(by_placement.items(), key=lambda kv: min(s.layers[k].window_s for k in kv[1])):
            s.steps[placement].before_replay(row_ids)
    s.armed = {placement: step.arm(tokens) for placement, step in s.steps.items()}


def execute(s: _Session, original, runner, forward_batch, *args, **kwargs):
    """A replay (its load_batch runs :func:`before_replay`). Under policy ``fail`` (or with the ranks'
    agreement) its steps' outcome is checked where the scheduler processes the batch's result
    (:func:`check_result`), not here on the launch path."""
    try:
        out = original(runner, forward_batch, *args, **kwargs)
    except BaseException:
        for step in s.steps.values():
            step.reset()  # armed, maybe never replayed: no flag may stay set for the next step
        raise
    for step in s.steps.values():
        step.after_replay()  # returns at once where the check is check_result's (results_check)
    s.replayed.extend(s.armed.items())
    return out


def bind_result(result) -> None:
    """After the scheduler's ``run_batch``: the steps its replays ran belong to ``result`` (its batch result)."""
    s = session()
    if s is None or not s.replayed:
        return
    replayed, s.replayed = s.replayed, []
    for key in [k for k, (ref, _) in _results.items() if ref() is None]:
        del _results[key]  # results never processed (a batch dropped): nothing to check any more
    try:
        _results[id(result)] = (weakref.ref(result), replayed)
    except TypeError:  # a result that cannot be weakly referenced (None: an idle batch) carries no step
        log.warning("tableserver plugin: a decode batch ran no result to check its rows by: %r", type(result))


def check_result(result) -> None:
    """Where the scheduler processes a batch's result, before it reads it: its steps' outcome (each rank
    alike), once their outputs are on the host (SGLang's ``copy_done`` event). Policy ``fail``: GraphStepError
    naming the layer whose rows were not served (here or on another rank); the output is not read."""
    ref, replayed = _results.pop(id(result), (None, None))
    s = session()
    if ref is None or ref() is not result or s is None:
        return
    done = getattr(result, "copy_done", None)
    if done is not None:
        done.synchronize()
    for placement, number in replayed:
        s.steps[placement].check(number)


# ---------------------------------------------------------------------- inside the captured forward
def publish(s: _Session, hash_ids) -> None:
    """After the captured hasher, layer 1 first: every in_graph layer's ids to the host, then its flag;
    every device layer's kernel launched on the side stream."""
    graph = _recording(s, hash_ids)
    for layer, sl in sorted(s.layers.items(), key=lambda kv: kv[1].window_s):
        if sl.graph_mode in ("in_graph", "device"):
            s.step_of(layer).publish_ids(layer, hash_ids[:, sl.hash_index].contiguous(), graph=graph)


def in_capture(s: _Session | None, forward_batch, indices) -> bool:
    """Whether a served layer's forward is part of a decode graph being captured (or replayed on the host):
    SGLang's capture also runs eager warm-ups of other shapes (an EXTEND autotune pass, say), which take
    the eager path."""
    if s is None or not s.capturing:
        return False
    mode = getattr(forward_batch, "forward_mode", None)
    return (mode is None or not mode.is_extend()) and indices.shape[0] <= s.max_tokens


def captured_rows(s: _Session, embed, layer: int, indices):
    """What a served layer's forward records in a capture: bf16 rows ``[*indices.shape, dim]`` from its
    staging (an in_graph layer waits for its flag first), dequantized as SGLang dequantizes staged rows."""
    sl = s.layers[layer]
    tokens = indices.shape[0]
    if sl.graph_mode == "eager_break":
        out = embed.new_rows(indices)
        _eager_rows(embed, layer, indices, out)
        return out
    packed = s.step_of(layer).rows(layer, tokens, graph=_recording(s, indices))  # [tokens * 24, row_bytes]
    if not indices.is_cuda:
        return dequantize(packed.view(*indices.shape, -1), embed.dim)
    weight, scale = packed[:, : embed.dim].contiguous(), packed[:, embed.dim :].contiguous()
    copied = s.events[layer]
    copied.record()
    return embed.dequant_staged(weight, scale, copied, indices.shape)


_BREAK: dict = {}


def _recording(s: _Session, t) -> bool:
    """Whether the graph's flag operations belong here: a CUDA stream capturing (not an eager warm-up
    run of the capture), or a replay on the host."""
    import torch

    return s.replay_on_host or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _eager_rows(embed, layer: int, indices, out) -> None:
    """An eager break of a breakable decode graph (SGLang's eager_on_graph): at every replay, the real
    tokens' rows fetched now and dequantized into ``out`` (the padded rows are zero)."""
    if "fn" not in _BREAK:
        _BREAK["fn"] = _eager_on_graph()(_fill_rows)
    _BREAK["fn"](embed, layer, indices, out)


def _fill_rows(embed, layer: int, indices, out) -> None:
    """The eager break itself. With tensor parallelism the ranks agree on the rows first (:func:`served_alike`),
    every rank at every replay, a replay of no real token (DP attention's idle batch) included: every rank the
    table's rows, or every rank zeros, or every rank raises (policy fail)."""
    s = session()
    if s is None:  # closed (the plugin configured again): the rows it was prepared with are gone
        raise PluginError(
            f"tableserver plugin: Engram layer {layer}: its decode CUDA graph was replayed after the plugin was "
            "configured again: capture the graphs again"
        )
    tokens = min(indices.shape[0] if s.capturing else s.tokens, indices.shape[0])
    out.zero_()
    packed = served_alike(
        s.rows, layer, lambda: s.rows.fetch(layer, indices[:tokens], channel="forward") if tokens else None
    )
    if packed is None:  # no real token, or a rank served the policy's rows (every rank serves zeros)
        return
    import torch

    if not indices.is_cuda:
        out[:tokens].copy_(dequantize(packed, embed.dim))
        return
    weight, scale, copied = to_device(packed, embed.dim, indices.device, torch.cuda.current_stream())
    out[:tokens].copy_(embed.dequant_staged(weight, scale, copied, indices[:tokens].shape))


def _eager_on_graph():
    """SGLang's own break marker (it needs cuda-python, as the breakable backend does)."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph import (
        eager_on_graph,
    )

    return eager_on_graph


def close() -> None:
    """Ends the session: each GraphStep waits for the device, releases every flag (a graph replayed later
    waits for nobody) and stops its threads."""
    s, _session["active"] = _session["active"], None
    _results.clear()
    if s is not None:
        for step in s.steps.values():
            step.close()
        for table in s.tables.values():  # after the GraphSteps that read them
            table.close()
