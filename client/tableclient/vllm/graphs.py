"""Graph modes device and in_graph: served layers inside vLLM's graphs, through the engine-neutral graph step of
SGLang's decode graphs (:class:`~tableclient.graph.step.GraphStep`, one per placement).

``Engram.prepare_embeddings`` copies this rank's columns into persistent ids (padding columns dead) and hands them to
the layer's GraphStep (:func:`publish`), ``Engram._ready_rows`` takes the layer's rows from it and dequantizes them
(:func:`graph_rows`); captured in FULL graphs, eager breaks in breakable piecewise ones (a fork cannot span
segments), run inline otherwise. ``device`` (a ``node`` layer's default): the node's table, mapped in this process,
is registered with CUDA (``DeviceTable``) and a kernel gathers this rank's columns from it on a side stream, one
event per layer that the layer waits on, as vLLM does for its ``cpu_offload`` tables. ``in_graph`` (``remote``
layers, and ``node`` layers whose table the GPU cannot read on some rank, where vLLM captures FULL graphs, whose
replays run no Python): the ids go to the host (ids, then a flag), the poller (the native one where every rank can
run it) gathers the live ids, the layer waits for its rows flag.

``Worker.execute_model`` (which runs even when the step replays a FULL graph) arms each step for its real tokens
(:func:`execute_model`): a device table mapped anew (its daemon restarted) is registered again and its device-side
pointer rewritten without recapture, and a table not mapped reads as zero rows. Each step every layer's rows-ok is
reduced inside the step with vLLM's all-reduce (:func:`~tableclient.vllm.ranks.tp_agreement`), the rows masked by
it (all ranks serve the table's rows, or all the policy's); the outcome is checked where vLLM reads the step's
results (``Worker.sample_tokens``, or its async output's ``get_output``), so policy ``fail`` raises on every rank
at the same step. An ``arm()`` that fails fails that step only (every GraphStep reset). A data-parallel dummy batch
(``execute_dummy_batch``) is armed for 0 tokens and every GraphStep reset after it: its graph may or may not
publish ids (vLLM's dummy run skips the hasher outside FULL replays).
"""

from __future__ import annotations

import functools
import logging
import weakref

from tableclient.engine.plugin import PluginError
from tableclient.engine.ranks import agree_pollers, describe, register_tables
from tableclient.vllm.ranks import tp_agreement, tp_ranks
from tableclient.vllm.state import DEAD_ID, OUTPUTS, rows

log = logging.getLogger(__name__)

# graph mode device, this configuration's: table name -> DeviceTable (one registration per table, agreed by the
# ranks when the layer is built; its GraphStep reads it, this configuration closes it)
_device: dict = {"tables": {}}
# graph modes device and in_graph: placement -> GraphStep (built at the first forward, vLLM's profile run, before
# any capture), layer -> its persistent device ids, and whether a forward runs inside a step Worker armed (its
# flags live) rather than a start-up warm-up (copies only); the layers served through them; the steps run whose
# outcome is still to check where their results are read ((placement, step number), oldest first)
_graph: dict = {"steps": None, "ids": {}, "in_step": False, "pending": None, "layers": weakref.WeakSet(),
                "armed": [], "replayed": []}  # fmt: skip


def graph_steps() -> dict | None:
    """placement -> the GraphStep of the device and in_graph layers (None until the first forward reaches one)."""
    return _graph["steps"]


def device_tables() -> dict:
    """table name -> the DeviceTable its device layers read (registered where every rank could register it)."""
    return dict(_device["tables"])


def close_graphs() -> None:
    """The device and in_graph layers' GraphSteps closed (a graph replayed after this waits for nobody)."""
    steps, _graph["steps"] = _graph["steps"], None
    _graph["ids"].clear()
    _graph["armed"], _graph["replayed"] = [], []
    for step in (steps or {}).values():
        step.close()


def close() -> None:
    """This configuration's GraphSteps closed, then its device tables unregistered (before the clients that map
    them close); no layer served through them."""
    close_graphs()  # first: they read the device tables
    _graph["layers"].clear()
    for table in _device["tables"].values():  # unregistered before the clients that map them close
        table.close()
    _device["tables"].clear()


def register_table(layer: int, table, device) -> str | None:
    """Graph mode device: the layer's node table registered with CUDA where every rank of the tensor-parallel group
    can (one MIN over them); None where it is, else why it is not (each rank's one line)."""
    return register_tables(tp_ranks(), rows().client("node"), {layer: table}, device, _device["tables"]).get(layer)


def add_layer(embed) -> None:
    """A device or in_graph layer's embedding: the steps the Worker runs are armed for it from now on."""
    _graph["layers"].add(embed)


def _graph_step(engram):
    """The GraphStep of the layer's placement: every device and in_graph layer's, built at the first forward that
    reaches one (vLLM's profile run, before it captures anything, on every rank), sized by vLLM's staged rows; the
    same poller on every rank (:func:`~tableclient.engine.ranks.agree_pollers`), the decision logged once."""
    steps = _graph["steps"]
    if steps is None:
        import torch

        staged = engram.staged_rows
        agree, ranks = tp_agreement()

        def build(placements=None, poller="auto"):
            with torch.inference_mode(False):  # the host updates them between steps, outside vLLM's inference mode
                return rows().graph_steps(
                    staged.shape[0], staged.device, modes=("in_graph", "device"), tables=_device["tables"],
                    rows_per_token=engram.embed_tokens.part_n_hash_cols, agree=agree,
                    results_check=rows().config.policy == "fail" or agree is not None, poller=poller,
                    placements=placements,
                )  # fmt: skip

        group = tp_ranks()
        steps = _graph["steps"] = agree_pollers(group, build(), lambda redo: build(redo, poller="python"))
        if group.first:
            log.info("tableserver plugin: served layers in vLLM's graphs: %s", describe(steps, group))
        if agree is not None:
            log.info("tableserver plugin: the %d tensor-parallel ranks agree each step on whether every served "
                     "layer's rows are the table's (else all serve the policy's)", ranks)  # fmt: skip
        tokens, _graph["pending"] = _graph["pending"], None
        if tokens is not None:  # built inside a step Worker runs (no profile run before it): armed now
            _graph["armed"] = [(placement, step.arm(tokens)) for placement, step in steps.items()]
    return steps[rows().layers[engram.embed_tokens.layer].placement]


def _live(t) -> bool:
    """Whether this forward's flags are live: it is being captured, or runs in a step Worker armed (not a
    start-up warm-up or profile run, which only copy)."""
    import torch

    return _graph["in_step"] or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def publish(engram, hash_ids) -> None:
    """Step start, in the forward (captured in FULL graphs): this rank's columns into the layer's persistent
    device ids (padding columns dead), then to its GraphStep: a device layer's kernel launched on the side stream,
    an in_graph layer's ids published to the host for the poller (ids, then its flag)."""
    import torch

    embed, step = engram.embed_tokens, _graph_step(engram)
    tokens, part = hash_ids.shape[0], embed.part_n_hash_cols
    buf = _graph["ids"].get(embed.layer)
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: any forward writes it, in vLLM's inference mode or not
            buf = _graph["ids"][embed.layer] = torch.full(
                (engram.staged_rows.shape[0], part), DEAD_ID, dtype=torch.int64, device=hash_ids.device
            )
    ids = buf[:tokens]
    owned = embed.head_end - embed.head_start
    ids[:, :owned].copy_(hash_ids[:, embed.head_start : embed.head_end])
    step.publish_ids(embed.layer, ids, graph=_live(hash_ids))


def graph_rows(engram, out) -> None:
    """The layer runs (captured in FULL graphs): its rows from its GraphStep (a device layer's gather joined, an
    in_graph layer's rows flag waited for; the ranks' agreement on them reduced), dequantized."""
    embed, step = engram.embed_tokens, _graph_step(engram)
    tokens = out.shape[0]
    packed = step.rows(embed.layer, tokens, graph=_live(out))
    embed.dequantize_into(packed.view(tokens, embed.part_n_hash_cols, -1), out)


def execute_model(original, self, scheduler_output):
    """vLLM's Worker, every step (the host runs it whether the step replays a graph or not): the served layers'
    GraphSteps armed for the step's real tokens (device tables checked), the forward. Their outcome (policy fail,
    the ranks' agreement) is checked where the step's results are read: :func:`sample_tokens`."""
    tokens = scheduler_output.total_num_scheduled_tokens
    return _checked(_armed(original, tokens, False, self, scheduler_output))


def sample_tokens(original, self, grammar_output):
    """vLLM's Worker samples the step ``execute_model`` ran: its output carries the step's outcome check."""
    return _checked(original(self, grammar_output))


def _checked(out):
    """A step's output, once it is one (``execute_model`` returns None before ``sample_tokens``): the steps it
    ran are checked as its results are read: at once for a ModelRunnerOutput (its tokens are on the host), in
    ``get_output()`` for an AsyncModelRunnerOutput (vLLM's async scheduling, which reads it a step later).
    Policy fail: PluginError naming the layer; the output is never read."""
    import importlib

    if out is None or not _graph["replayed"]:
        return out
    replayed, _graph["replayed"] = _graph["replayed"], []
    if isinstance(out, importlib.import_module(OUTPUTS).AsyncModelRunnerOutput):
        return _checked_output_class()(out, replayed)
    _check_steps(replayed)
    return out


def _check_steps(replayed) -> None:
    from tableclient.graph.streams import GraphStepError

    steps = _graph["steps"] or {}
    try:
        for placement, number in replayed:
            if placement in steps:
                steps[placement].check(number)
    except GraphStepError as e:
        raise PluginError(f"tableserver plugin: {e}") from None


@functools.cache
def _checked_output_class():
    """An AsyncModelRunnerOutput that checks its steps' outcome when vLLM reads it (after the step's own
    ``get_output()``, which waits for its copy to the host: the outcome, copied earlier on the same stream,
    is there by then). The plugin's own object: nothing is stored on vLLM's."""
    import importlib

    base = importlib.import_module(OUTPUTS).AsyncModelRunnerOutput

    class CheckedOutput(base):
        def __init__(self, output, replayed):
            self.output, self.replayed = output, replayed

        def get_output(self):
            result = self.output.get_output()
            _check_steps(self.replayed)
            return result

        def get_kv_connector_output(self):
            return self.output.get_kv_connector_output()

    return CheckedOutput


def execute_dummy_batch(original, self):
    """A data-parallel replica with nothing to run joins its peers' step with a dummy batch, armed for 0 tokens
    (released at once, no row read). vLLM's dummy run hashes nothing outside FULL replays: its graph may never
    publish the ids it was armed for, so every GraphStep is reset after it (the device's work done, no step
    left armed; the next real step's arm starts clean)."""
    try:
        return _armed(original, 0, True, self)
    finally:
        _reset_steps()


def _reset_steps() -> None:
    """Every GraphStep back to no step armed, flags clear, its outcome count that of the steps armed."""
    for step in (_graph["steps"] or {}).values():
        step.reset()


def _armed(original, tokens: int, dummy: bool, *args):
    """``original(*args)`` as a step of ``tokens`` tokens for the device and in_graph layers (a dummy batch: 0
    tokens; a step of none runs no forward). An ``arm()`` that fails fails this step only: PluginError before the
    forward, every GraphStep reset (the next step is armed afresh, its outcome where the check looks for it)."""
    if not _graph["layers"] or (tokens <= 0 and not dummy):
        return original(*args)
    from tableclient.graph.streams import GraphStepError

    steps = _graph["steps"]
    if steps is None:
        _graph["pending"] = tokens  # the GraphSteps are built at this step's first served layer, then armed
    try:
        _graph["armed"] = [(placement, step.arm(tokens)) for placement, step in (steps or {}).items()]
    except Exception as e:  # a GraphStepError (the last step never consumed, the step closed), or the tokens
        _reset_steps()
        _graph["armed"] = []
        raise PluginError(f"tableserver plugin: this step could not be armed ({e}): it is not run") from None
    _graph["in_step"] = True
    try:
        out = original(*args)
    except BaseException:
        _graph["armed"] = []
        _reset_steps()  # armed, maybe never replayed: no flag may stay set for the next step
        raise
    finally:
        _graph["in_step"], _graph["pending"] = False, None
    armed, _graph["armed"] = _graph["armed"], []  # (placement, step number): armed before or inside the step
    try:
        for step in (_graph["steps"] or {}).values():
            step.after_replay()  # at once where the check is where results are read (results_check)
            step.account()  # what the native poller released so far, into the metrics (off the hot path)
    except GraphStepError as e:
        raise PluginError(f"tableserver plugin: {e}") from None
    if not dummy and any(step.results_check for step in (_graph["steps"] or {}).values()):
        from tableclient.graph.step import OUTCOMES

        # a step's outcome is held for OUTCOMES - 1 launches: older unread ones are nobody's results
        _graph["replayed"] = (_graph["replayed"] + armed)[-len(armed) * (OUTCOMES - 1) :]
    return out
