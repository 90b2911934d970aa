"""The plugin's hooks into vLLM 0.33.0's DeepSeek-V4.1 Engram (``vllm/models/deepseek_v41/common/engram.py``).

vLLM has no hook registry: the hooks are wrappers put on vLLM's own functions (``patch``), once per
process, behind the exact version pin and a check of every hooked function's parameters. A ``local``
layer, or any layer while the plugin is not configured, passes straight through to vLLM's code.

What a layer placed ``remote`` or ``node`` gets (graph modes ``device``, ``in_graph``, ``eager_break``):

* ``Engram._create_embedding`` (the only place vLLM allocates table memory): a
  :class:`~tableclient.vllm.embedding.RemoteEngramEmbedding` instead, with empty parameters; the
  tableserver's table is checked against the layer (rows, row size) right there.
* ``Engram.prepare_embeddings`` (step start, right after vLLM's hasher, before the decoder layers: vLLM
  calls it for every Engram layer in turn, so layer 1 is issued first) and ``Engram._ready_rows`` (when
  the layer runs: the rows dequantized with vLLM's arithmetic into the layer's persistent
  ``staged_rows``; vLLM's own ``Engram.embed`` then joins the ranks' columns, tensor and sequence
  parallelism, as it does for a local table). Between them, one of two paths:

  - graph modes ``device`` and ``in_graph``: the engine-neutral graph step of SGLang's decode graphs
    (:class:`~tableclient.graph.step.GraphStep`, one per placement): ``prepare_embeddings`` copies this rank's
    columns into persistent ids (padding columns dead) and hands them to it, ``_ready_rows`` takes the layer's
    rows from it and dequantizes them; captured in FULL graphs, eager breaks in breakable piecewise ones (a fork
    cannot span segments), run inline otherwise. ``device`` (a ``node`` layer's default): the node's table,
    mapped in this process, is registered with CUDA (``DeviceTable``) and a kernel gathers this rank's columns
    from it on a side stream, one event per layer that the layer waits on, as vLLM does for its ``cpu_offload``
    tables. ``in_graph`` (``remote`` layers, and ``node`` layers whose table the GPU cannot read on some rank,
    where vLLM captures FULL graphs, whose replays run no Python): the ids go to the host (ids, then a flag),
    the poller (the native one where every rank can run it) gathers the live ids, the layer waits for its rows
    flag. ``Worker.execute_model`` (which
    runs even when the step replays a FULL graph) arms each step for its real tokens: a device table mapped
    anew (its daemon restarted) is registered again and its device-side pointer rewritten without recapture,
    and a table not mapped reads as zero rows;
  - otherwise (``eager_break``): this rank's
    columns copied to the host, the gather issued (``EngramRows.issue``), then waited for, copied to the
    device and dequantized (``EngramRows.collect``), both in functions decorated with vLLM's
    ``eager_break_during_capture``: in vLLM's breakable (piecewise) graphs they run eagerly between
    captured segments at every replay, on the same persistent buffers. Graph modes that would capture
    them (FULL, or piecewise without breakable graphs) are refused with the flag to use. With tensor parallelism
    each layer's rows are agreed in ``collect`` before vLLM's all-gather joins them, one MIN over vLLM's CPU group
    (gloo: the rows and the decision are the host's, so no GPU stream is waited for): every rank serves the table's
    rows, or every rank zeros (counted where a rank's own rows were masked), or under policy ``fail`` every rank
    raises at that layer of that step, naming where it failed.

Loading: the checkpoint's tensors of a served table are skipped before they are read by vLLM's
safetensors iterator (``weight_utils.should_skip_weight``), shards holding nothing else are not opened
by any load format (``is_unused_checkpoint_weight``), and ``load_weights`` drops whatever a whole-file
load format read anyway, counts the served parameters as loaded, and runs the start-up check.

Memory: each served layer's table that vLLM did not allocate in this process is recorded when the layer is
built (log line and ``tableserver_client_freed_table_{host,device}_bytes`` at the start-up check); where that
freed host memory goes unused (no ``--kv-offloading-size``) one warning names the flag and ``tableserver plan``,
and where ``--kv-offloading-size`` asks more than this host has once the plugin's staging is allocated (vLLM
itself checks none: it pins what it is told), one warning says so before vLLM allocates it.

Ranks (tensor parallelism) agree: each layer's graph mode and the poller are decided once at start-up over the
tensor-parallel group (:mod:`tableclient.engine.ranks`: a device table that one rank cannot register puts the layer
on the host path on every rank), and each step every device and in_graph layer's rows-ok is reduced inside the step
with vLLM's all-reduce, the rows masked by it (all ranks serve the table's rows, or all the policy's); the outcome is
checked where vLLM reads the step's results (``Worker.sample_tokens``, or its async output's ``get_output``), so
policy ``fail`` raises on every rank at the same step. An eager_break layer's rows are agreed in its eager break
(above), ``fail`` raised there on every rank. An ``arm()`` that fails fails that step only (every GraphStep
reset). Refused at start-up with one line: pipeline parallelism (a stage holding a layer returns no results to
check its rows by). A data-parallel dummy batch (``execute_dummy_batch``) is armed for 0 tokens and every
GraphStep reset after it: its graph may or may not publish ids (vLLM's dummy run skips the hasher outside FULL
replays).

The plugin sets no attribute of its own on vLLM's objects: the wrappers it put on vLLM are in
``_wrappers``, and which layer an ``Engram`` was built as, and whether it is served, in the process's
:class:`~tableclient.engine.plugin.PluginState` (weakly held).
"""

from __future__ import annotations

import functools
import logging
import re
import weakref

from tableclient.engine import memory
from tableclient.engine.config import PluginConfig
from tableclient.engine.plugin import PluginError, PluginState, check_layout, check_placement, check_release
from tableclient.engine.ranks import Ranks, agree_pollers, describe, register_tables, served_alike
from tableclient.hostmem import GIB, Parallel, process_bytes, staging_bytes, table_bytes, vllm_private_bytes

log = logging.getLogger(__name__)

SUPPORTED_VLLM = "0.33.0"
ENGRAM = "vllm.models.deepseek_v41.common.engram"
WEIGHTS = "vllm.model_executor.model_loader.weight_utils"
MODEL = "vllm.models.deepseek_v41"  # DeepseekV41ForCausalLM, the NVIDIA or the ROCm build of it
WORKER = "vllm.v1.worker.gpu_worker"  # Worker.execute_model: the host, before every step (graphs or not)
OUTPUTS = "vllm.v1.outputs"  # AsyncModelRunnerOutput: a step's results, read by vLLM's get_output()
DEAD_ID = -1  # vLLM's engram.DEAD_ID, checked at start-up: ids of padding and dummy runs, zero rows
#: checkpoint tensors of a layer's table: the checkpoint's names and vLLM's after its weights mapper
TABLE_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.engram\.(?:embed\.(?:weight|scale)|embed_tokens\.(?:weight|weight_scale_inv))$"
)
PIECEWISE_FLAG = """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'"""
#: the graph modes vLLM takes: device (node), in_graph (the default with FULL graphs), eager_break (else)
GRAPH_MODES = ("device", "in_graph", "eager_break")
OFFLOAD_FLAG = "--kv-offloading-size G --kv-offloading-backend native"

_state = PluginState("vllm", dead_id=DEAD_ID)
_eager: dict = {}  # issue / collect / publish / rows in vLLM's eager_break_during_capture (patch)
_wrappers: dict = {}  # each wrapper patch() put on vLLM -> (its hook, vLLM's function under it)
# graph mode device, this configuration's: table name -> DeviceTable (one registration per table, agreed by the
# ranks when the layer is built; its GraphStep reads it, this configuration closes it)
_device: dict = {"tables": {}}
# graph modes device and in_graph: placement -> GraphStep (built at the first forward, vLLM's profile run, before
# any capture), layer -> its persistent device ids, and whether a forward runs inside a step Worker armed (its
# flags live) rather than a start-up warm-up (copies only); the layers served through them; the steps run whose
# outcome is still to check where their results are read ((placement, step number), oldest first)
_graph: dict = {"steps": None, "ids": {}, "in_step": False, "pending": None, "layers": weakref.WeakSet(),
                "armed": [], "replayed": []}  # fmt: skip


def config() -> PluginConfig | None:
    return _state.config


def rows():
    return _state.rows()


def configure(cfg: PluginConfig, client_factory=None):
    """Makes ``cfg`` this process's configuration (layers built from now on follow it)."""
    close_graphs()  # first: they read the device tables
    _graph["layers"].clear()
    for table in _device["tables"].values():  # unregistered before the clients that map them close
        table.close()
    _device["tables"].clear()
    return _state.configure(cfg, client_factory)


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


def served(layer: int) -> bool:
    return _state.served(layer)


# ---------------------------------------------------------------------- the pin and the layout
def check_vllm() -> str:
    """The installed vLLM's version, if this plugin supports it; PluginError naming the fix otherwise."""
    import importlib

    version = check_release("vllm", "vLLM", SUPPORTED_VLLM)
    engram, weights, model = _modules()
    worker = _worker()
    expected = {
        engram.Engram.__init__: [
            "self", "config", "quant_config", "layout", "layer_hash_index", "use_sequence_parallel", "prefix",
            "prefetch_stream",
        ],
        engram.Engram._create_embedding: ["self", "layout", "layer_hash_index"],
        engram.Engram._init_staging: ["self", "max_tokens", "head_dim"],
        engram.Engram.prepare_embeddings: ["self", "hash_ids"],
        engram.Engram._ready_rows: ["self", "num_tokens"],
        engram.Engram.embed: ["self", "hash_ids"],
        engram.ParallelEngramEmbedding.lookup: ["self", "indices", "out", "background"],
        engram.EngramBatch.create: ["layers", "max_tokens"],
        weights.should_skip_weight: ["weight_name", "local_expert_ids"],
        model.DeepseekV41ForCausalLM.load_weights: ["self", "weights"],
        worker.Worker.execute_model: ["self", "scheduler_output"],
        worker.Worker.execute_dummy_batch: ["self"],
        worker.Worker.sample_tokens: ["self", "grammar_output"],
    }  # fmt: skip
    pin = f"vllm=={SUPPORTED_VLLM}"
    check_layout(expected, "vLLM", pin, original=_original)
    outputs = importlib.import_module(OUTPUTS)
    wrapped = {"get_output", "get_kv_connector_output"}  # the plugin's CheckedOutput implements exactly these
    if getattr(outputs.AsyncModelRunnerOutput, "__abstractmethods__", None) != wrapped:
        raise PluginError(
            f"tableserver plugin: vLLM's AsyncModelRunnerOutput is not the interface the plugin wraps: install {pin}"
        )
    if getattr(engram, "DEAD_ID", None) != DEAD_ID or not callable(getattr(engram, "eager_break_during_capture", None)):
        raise PluginError(
            f"tableserver plugin: vLLM's Engram module has no DEAD_ID = {DEAD_ID} or eager_break_during_capture: "
            f"install {pin}"
        )
    return version


def check_config(cfg: PluginConfig) -> None:
    """What of a (shared) placement file vLLM cannot honour: SGLang's before_replay (vLLM computes the ids
    inside its graphs; nothing runs on the host between its hasher and its replay)."""
    for layer, mode in sorted(cfg.graph.items()):
        if mode not in GRAPH_MODES:
            raise PluginError(
                f"tableserver plugin: graph.{layer} = {mode!r} is an SGLang decode-graph mode; under vLLM a served "
                "layer runs through vLLM's eager break (piecewise CUDA graphs), waits for its rows inside vLLM's "
                "graphs (in_graph) or, placed node, is gathered by the GPU: remove it, or set 'in_graph', "
                "'eager_break' or 'device' (node)"
            )


def _modules():
    import importlib

    return importlib.import_module(ENGRAM), importlib.import_module(WEIGHTS), importlib.import_module(MODEL)


def _worker():
    import importlib

    return importlib.import_module(WORKER)


def _original(fn):
    """vLLM's own function under the plugin's wrapper (``fn`` itself when not wrapped)."""
    return _wrappers.get(fn, (None, fn))[1]


# ---------------------------------------------------------------------- putting the hooks in place
def patch() -> None:
    """Wraps vLLM's functions (once per process; again is a no-op)."""
    engram, weights, model = _modules()
    eager = engram.eager_break_during_capture
    targets = [
        (engram.Engram, "_create_embedding", _create_embedding),
        (engram.Engram, "prepare_embeddings", _prepare_embeddings),
        (engram.Engram, "_ready_rows", _ready_rows),
        (weights, "should_skip_weight", _should_skip_weight),
        (model.DeepseekV41ForCausalLM, "load_weights", _load_weights),
        (model.DeepseekV41ForCausalLM, "is_unused_checkpoint_weight", _is_unused),  # vLLM's is optional: None
        (_worker().Worker, "execute_model", _execute_model),
        (_worker().Worker, "execute_dummy_batch", _execute_dummy_batch),
        (_worker().Worker, "sample_tokens", _sample_tokens),
    ]
    for owner, name, hook in targets:
        current = getattr(owner, name, None)
        if current not in _wrappers:
            setattr(owner, name, _as_function(hook, current))
    if engram.EngramBatch.create not in _wrappers:  # a classmethod: called on the class
        engram.EngramBatch.create = staticmethod(_as_function(_batch_create, engram.EngramBatch.create))
    _eager["issue"] = eager(_issue)
    _eager["collect"] = eager(_collect)
    _eager["publish"] = eager(_publish)  # device, in_graph: captured in FULL graphs, between segments in breakable
    _eager["rows"] = eager(_graph_rows)
    _state.hooks_in_place = True


def _as_function(hook, original):
    """A plain function calling ``hook(original, ...)`` (a method when set on a class), recorded as ours."""

    def wrapper(*args, **kwargs):
        return hook(original, *args, **kwargs)

    if original is not None:
        functools.update_wrapper(wrapper, original)
    _wrappers[wrapper] = (hook, original)
    return wrapper


def hooked(fn, hook) -> bool:
    """Whether ``fn`` (as vLLM now has it) is the plugin's wrapper calling ``hook``."""
    return _wrappers.get(fn, (None, None))[0] is hook


# ---------------------------------------------------------------------- the layer
def _create_embedding(original, self, layout, layer_hash_index):
    layer = layout.layer_ids[layer_hash_index]
    _state.built(self, layer)  # every Engram, local ones too: the start-up check reads it
    if not served(layer):
        return original(self, layout, layer_hash_index)
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from tableclient.vllm.embedding import RemoteEngramEmbedding

    check_parallel()
    cfg = config()
    placement = cfg.placement(layer)
    device = placement == "node" and cfg.graph_mode(layer) == "device"
    in_graph = not device and _takes_in_graph(cfg, layer)
    if not device and not in_graph:
        _check_graphs(layer, placement)
    heads = tuple(size for order in layout.primes[layer_hash_index] for size in order)
    num_embeddings = layout.num_embeddings[layer_hash_index]
    embed = RemoteEngramEmbedding(
        rows(),
        layer,
        num_embeddings,
        layout.head_dim,
        heads,
        get_tensor_model_parallel_world_size(),
        get_tensor_model_parallel_rank(),
    )
    # the table must be this layer's (rows, row size) before anything else is built: EngramRowsError if not
    served_layer = rows().add_layer(layer, placement, num_embeddings, layout.head_dim, columns=embed.part_n_hash_cols)
    if device:  # registered with CUDA here, where every rank of the tensor-parallel group can (one MIN over them)
        why = register_tables(
            tp_ranks(), rows().client("node"), {layer: served_layer.table}, embed.weight.device, _device["tables"]
        ).get(layer)
        if why is not None:  # inside FULL graphs on the host then, else the eager break and its graph modes
            device, in_graph = False, _takes_in_graph(cfg, layer, explicit=False)
            log.warning(
                "tableserver plugin: Engram layer %d: graph mode 'device' unavailable (%s): falls back to %s",
                layer,
                why,
                "the host path, waited for inside vLLM's graphs (in_graph)" if in_graph else "the eager break",
            )
            if not in_graph:
                _check_graphs(layer, placement, why)
    embed.graph_mode = served_layer.graph_mode = "device" if device else "in_graph" if in_graph else "eager_break"
    if embed.graph_mode != "eager_break":
        _graph["layers"].add(embed)
    _state.built(self, layer, served=True)
    _state.table_not_allocated(_vllm_table(layer, placement, sum(heads[embed.head_start : embed.head_end]), layout))
    log.info(
        "tableserver plugin: Engram layer %d reads table %r from %s (%s), hash columns %d..%d, %s; no table allocated",
        layer,
        cfg.table(layer),
        cfg.address_of(placement),
        placement,
        embed.head_start,
        embed.head_end - 1,
        "gathered by the GPU in vLLM's graphs (device)"
        if device
        else "gathered on the host, waited for inside vLLM's graphs (in_graph)"
        if in_graph
        else "gathered on the host in vLLM's eager break",
    )
    return embed


def tp_ranks() -> Ranks:
    """vLLM's tensor-parallel group, for the decisions its ranks take alike at start-up (its CPU group: gloo); one
    rank where there are no process groups (layers built outside vLLM's workers)."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except (ImportError, AssertionError):
        return Ranks()
    return Ranks(group.world_size, group.rank_in_group, group.cpu_group)


def check_parallel() -> None:
    """PluginError (one line, the flag) for a parallel layout whose steps the plugin cannot check: pipeline
    parallelism. The stage holding a served layer returns intermediate tensors, not the results where a step's
    outcome is checked, and the last stage, which returns them, holds no layer's outcome: a step served the
    policy's rows would be read."""
    try:
        from vllm.distributed import get_pp_group

        stages = get_pp_group().world_size
    except (ImportError, AssertionError):  # no process groups (layers built outside vLLM's workers)
        return
    if stages > 1:
        raise PluginError(
            f"tableserver plugin: served Engram layers do not handle pipeline parallelism ({stages} stages: the stage "
            "holding a layer returns no results to check its rows by): launch vLLM with --pipeline-parallel-size 1 "
            "(--tensor-parallel-size instead), or place every Engram layer 'local'"
        )


def _vllm_table(layer: int, placement: str, rows_here: int, layout) -> memory.FreedTable:
    """What vLLM's ``ParallelEngramEmbedding`` would have allocated here for the layer: this rank's hash
    columns' rows (``vocab_end_idx - vocab_start_idx``), on the GPU without ``cpu_offload``; with it (vLLM's
    default) in host memory: a share of the node's one /dev/shm copy (``dp_shared_memory``), huge pages
    (``use_thp``, ROCm: exact bytes), or this rank's pinned tensors, rounded up to powers of two."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed.parallel_state import get_engram_dp_size
    from vllm.platforms import current_platform

    engram = get_current_vllm_config().engram_config
    row_bytes = layout.head_dim + layout.head_dim // 32
    if not engram.cpu_offload:
        return memory.FreedTable(layer, placement, table_bytes(rows_here, row_bytes), "device")
    if engram.dp_shared_memory:
        nbytes = process_bytes("vllm", "shared", rows_here, row_bytes, get_engram_dp_size())
    elif engram.use_thp or current_platform.is_rocm():
        nbytes = table_bytes(rows_here, row_bytes)
    else:
        nbytes = vllm_private_bytes(rows_here, row_bytes)
    return memory.FreedTable(layer, placement, nbytes, "host")


def _takes_in_graph(cfg: PluginConfig, layer: int, explicit: bool = True) -> bool:
    """Whether a layer gathered on the host waits for its rows inside vLLM's graphs (graph mode in_graph): as
    configured, else where vLLM captures FULL graphs (their replays run no Python: the eager break cannot
    serve them)."""
    from vllm.config import get_current_vllm_config

    configured = cfg.graph.get(layer) if explicit else None
    if configured in ("in_graph", "eager_break"):
        return configured == "in_graph"
    mode = get_current_vllm_config().compilation_config.cudagraph_mode
    return mode is not None and mode.has_full_cudagraphs()


def _check_graphs(layer: int, placement: str, why: str | None = None) -> None:
    """PluginError (naming the flag) where vLLM would capture a served layer's eager-break gather into a
    CUDA graph (a ``remote`` layer, or a ``node`` layer whose table the GPU cannot read here: ``why``)."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.config import get_current_vllm_config

    mode = get_current_vllm_config().compilation_config.cudagraph_mode
    if mode is None:
        return
    where = f"Engram layer {layer} is placed {placement}"
    if why is not None:
        where += f" and the GPU cannot read its table here ({why})"
    where += ": its rows reach vLLM's CUDA graphs through vLLM's eager break"
    if placement == "remote":
        other = "set its graph mode 'in_graph', place it 'node' (read by the GPU), or 'local'"
    elif why is None:
        other = "set its graph mode 'device' (read by the GPU), or place the layer 'local'"
    else:
        other = "place the layer 'local'"
    if mode.has_full_cudagraphs():
        raise PluginError(
            f"tableserver plugin: {where}, which FULL graphs do not take (cudagraph_mode {mode.name}): launch vLLM "
            f"with {PIECEWISE_FLAG} (or --enforce-eager), or {other}"
        )
    if mode.has_piecewise_cudagraphs() and not is_breakable_cudagraph_enabled():
        raise PluginError(
            f"tableserver plugin: {where}, which only breakable graphs take: launch vLLM with "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1 (the default for this model), or --enforce-eager"
        )


DP_MIX = (
    "tableserver plugin: a local Engram table here is sharded over data-parallel ranks (embedding_across_dp, or "
    "/dev/shm too small to share it), which vLLM cannot mix with a served layer: place every Engram layer remote "
    "or node, or keep local tables whole per replica"
)


def _batch_create(original, layers, max_tokens):
    """vLLM stages every Engram layer as one batch when the first one's table is sharded over DP ranks: a
    served layer cannot join it (its rows are this replica's, whole per token)."""
    if (
        layers
        and _state.served_layer(layers[0]) is None
        and layers[0].embed_tokens.dp_size > 1
        and any(_state.served_layer(layer) is not None for layer in layers)
    ):
        raise PluginError(DP_MIX)
    return original(layers, max_tokens)


def _prepare_embeddings(original, self, hash_ids):
    layer = _state.served_layer(self)
    if layer is None:
        return original(self, hash_ids)
    assert self.staged_rows.shape[0] >= hash_ids.shape[0], "engram staging buffer too small"
    if self.embed_tokens.graph_mode == "eager_break":
        _eager["issue"](self, hash_ids)
    else:
        _eager["publish"](self, hash_ids)
    return None


def _ready_rows(original, self, num_tokens):
    layer = _state.served_layer(self)
    if layer is None:
        return original(self, num_tokens)
    rows_out = self.staged_rows[:num_tokens]
    if self.embed_tokens.graph_mode == "eager_break":
        _eager["collect"](self, rows_out)
    else:
        _eager["rows"](self, rows_out)
    return rows_out


# ---------------------------------------------------------------------- graph modes device and in_graph
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


def tp_agreement():
    """(agree, ranks): over vLLM's tensor-parallel group, with its own all-reduce (captured in FULL graphs as
    the model's own are), where it has more than one rank (the ranks' columns of a layer meet in its
    collectives); (None, 1) otherwise."""
    from tableclient.graph.step import min_from_sum

    try:
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        ranks = get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):  # no process groups (layers built outside vLLM's workers)
        return None, 1
    if ranks <= 1:
        return None, 1
    return min_from_sum(tensor_model_parallel_all_reduce, ranks), ranks


def _live(t) -> bool:
    """Whether this forward's flags are live: it is being captured, or runs in a step Worker armed (not a
    start-up warm-up or profile run, which only copy)."""
    import torch

    return _graph["in_step"] or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _publish(engram, hash_ids) -> None:
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


def _graph_rows(engram, out) -> None:
    """The layer runs (captured in FULL graphs): its rows from its GraphStep (a device layer's gather joined, an
    in_graph layer's rows flag waited for; the ranks' agreement on them reduced), dequantized."""
    embed, step = engram.embed_tokens, _graph_step(engram)
    tokens = out.shape[0]
    packed = step.rows(embed.layer, tokens, graph=_live(out))
    embed.dequantize_into(packed.view(tokens, embed.part_n_hash_cols, -1), out)


def _execute_model(original, self, scheduler_output):
    """vLLM's Worker, every step (the host runs it whether the step replays a graph or not): the served layers'
    GraphSteps armed for the step's real tokens (device tables checked), the forward. Their outcome (policy fail,
    the ranks' agreement) is checked where the step's results are read: :func:`_sample_tokens`."""
    tokens = scheduler_output.total_num_scheduled_tokens
    return _checked(_armed(original, tokens, False, self, scheduler_output))


def _sample_tokens(original, self, grammar_output):
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


def _execute_dummy_batch(original, self):
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


def _issue(engram, hash_ids) -> None:
    """Step start (eager, also between captured segments): this rank's columns to the host, gather issued."""
    _refuse_capture(engram, hash_ids)
    embed = engram.embed_tokens
    rows().issue(embed.layer, embed.columns(hash_ids), key=_key(hash_ids))


def _collect(engram, out) -> None:
    """The layer runs (eager): its rows waited for, dequantized into ``out`` (its persistent staged rows). With
    tensor parallelism the ranks agree on them first (:func:`~tableclient.engine.ranks.served_alike`: one MIN over
    vLLM's tensor-parallel CPU group, before the layer's all-gather): every rank the table's rows, or every rank
    zeros, or every rank raises PluginError at this layer of this step (policy fail), never one rank alone."""
    import torch

    _refuse_capture(engram, out)
    embed = engram.embed_tokens
    packed = served_alike(tp_ranks(), rows(), embed.layer, lambda: rows().collect(embed.layer, key=out.shape[0]))
    if packed is None:  # a rank served the policy's rows: every rank serves zeros
        out.zero_()
        return
    embed.dequantize_into(packed, out)
    if out.is_cuda:
        copied = torch.cuda.Event()
        copied.record()
        rows().fence(f"layer{embed.layer}", copied)  # the next issue refills the staging after this copy


def _key(hash_ids) -> int:
    """What pairs a collect with its issue: the step's token count (each issue is collected once)."""
    return hash_ids.shape[0]


def _refuse_capture(engram, t) -> None:
    import torch

    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise PluginError(
            f"tableserver plugin: Engram layer {engram.embed_tokens.layer}'s gather is being captured into a CUDA "
            f"graph (vLLM ran its eager break inline): launch vLLM with {PIECEWISE_FLAG} (or --enforce-eager)"
        )


# ---------------------------------------------------------------------- checkpoint loading
def served_key(name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a served layer's table."""
    m = TABLE_KEY.search(name)
    return m is not None and served(int(m.group(1)))


def _should_skip_weight(original, weight_name, local_expert_ids):
    """vLLM's safetensors iterator asks before reading each tensor: a served table's are never read."""
    return served_key(weight_name) or original(weight_name, local_expert_ids)


def _is_unused(original, self, name: str) -> bool:
    """Shards holding only served tables' tensors are not opened, whatever the load format."""
    return served_key(name) or (original is not None and original(self, name))


def _load_weights(original, self, weights):
    """A served table's tensors never reach a parameter; its (empty) parameters count as loaded."""
    if not _state.configured or not config().enabled:
        return original(self, weights)
    loaded = original(self, ((name, w) for name, w in weights if not served_key(name)))
    engrams = verify(self)
    if loaded is not None:
        for name, module in self.named_modules():
            if module in engrams and _state.served_layer(module) is not None:
                loaded |= {f"{name}.embed_tokens.{p}" for p, _ in module.embed_tokens.named_parameters()}
    return loaded


def verify(model) -> list:
    """Start-up check, once the model is built: each Engram layer is where the configuration puts it, the
    configuration names no other layer, and no local table is sharded over data-parallel ranks beside a
    served layer (vLLM would hand that one every replica's tokens). Returns the Engram modules."""
    engram_cls = _modules()[0].Engram
    engrams = [m for m in model.modules() if isinstance(m, engram_cls)]
    cfg = config()
    built = [(_state.layer_of(e), _state.served_layer(e) is not None) for e in engrams]
    layers = check_placement(cfg, built, "vLLM")
    if any(served(x) for x in layers) and any(
        not served(x) and e.embed_tokens.dp_size > 1 for x, e in zip(layers, engrams)
    ):
        raise PluginError(DP_MIX)
    log.info("tableserver plugin engaged: %s", cfg.describe(layers, engine="vLLM"))
    check_memory(layers)
    return engrams


def check_memory(layers) -> bool:
    """Start-up, once the model is built: the table memory vLLM did not allocate here, the flag to use it
    where vLLM runs without host KV cache, and whether ``--kv-offloading-size`` fits this host once the
    plugin's staging is allocated (vLLM checks no host memory for it). Returns False where it does not fit;
    True without a current vLLM configuration (vLLM loads its model inside one)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return True
    parallel, size = vllm_config.parallel_config, vllm_config.cache_config.kv_offloading_size
    tp, dp = parallel.tensor_parallel_size, parallel.data_parallel_size
    hint = memory.plan_hint("vllm", config(), layers, tp, dp)
    memory.report(_state, "vLLM", size is not None, OFFLOAD_FLAG, hint, log)
    if size is None:
        return True
    ranks_here = parallel.world_size * max(1, parallel.data_parallel_size_local)  # every engine on this host
    staged = [s for s in rows().layers.values() if s.layer in layers and s.graph_mode != "device"]  # device: none
    staging = staging_bytes(Parallel("vllm", tp), len(staged), config().max_tokens)
    fix = f"lower --kv-offloading-size below {size:g}: `{hint}` sizes it for this host"
    # vLLM's size is the engine's, over its ranks (OffloadingConnector: cpu_bytes_to_use / world_size)
    return memory.check_host_kv(
        "vLLM", int(size * GIB) // parallel.world_size, memory.mem_available() // ranks_here, staging, fix, log
    )
