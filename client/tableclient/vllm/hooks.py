"""The plugin's hooks into vLLM 0.33.0's DeepSeek-V4.1 Engram (``vllm/models/deepseek_v41/common/engram.py``).

vLLM has no hook registry: the hooks are wrappers put on vLLM's own functions (``patch``), once per
process, behind the exact version pin and a check of every hooked function's parameters. A ``local``
layer, or any layer while the plugin is not configured, passes straight through to vLLM's code.

This module is what the plugin's entry point (:func:`tableclient.vllm.register`) calls: the pin (``check_vllm``),
what of a configuration vLLM cannot honour (``check_config``), the process's configuration (``configure``) and the
wrappers (``patch``, ``hooked``). What each wrapper runs is in the modules beside it, none of which imports this one:

* :mod:`tableclient.vllm.layers`: ``Engram._create_embedding`` (a served layer built as a
  :class:`~tableclient.vllm.embedding.RemoteEngramEmbedding`, its graph mode decided), ``Engram.prepare_embeddings``
  and ``Engram._ready_rows`` (step start and the layer's run, each handed to its graph mode's path in vLLM's
  ``eager_break_during_capture``), ``EngramBatch.create`` (no served layer in a batch sharded over DP ranks);
* :mod:`tableclient.vllm.graphs`: graph modes ``device`` and ``in_graph``, through the engine-neutral
  :class:`~tableclient.graph.step.GraphStep`; ``Worker.execute_model``, ``execute_dummy_batch`` and
  ``sample_tokens`` (each step armed, its outcome checked where its results are read);
* :mod:`tableclient.vllm.eager`: graph mode ``eager_break``, gathered on the host in vLLM's eager break;
* :mod:`tableclient.vllm.loading`: ``weight_utils.should_skip_weight``, ``is_unused_checkpoint_weight`` and
  ``load_weights`` (a served table's tensors never read), and the start-up check (``verify``);
* :mod:`tableclient.vllm.memory`: the table memory vLLM did not allocate, and ``--kv-offloading-size`` checked
  against this host;
* :mod:`tableclient.vllm.ranks`: vLLM's tensor-parallel group, for what its ranks decide and agree alike
  (pipeline parallelism refused);
* :mod:`tableclient.vllm.state`: the pin, vLLM's module names, and the process's
  :class:`~tableclient.engine.plugin.PluginState`.

The plugin sets no attribute of its own on vLLM's objects: the wrappers it put on vLLM are in
``_wrappers``, and which layer an ``Engram`` was built as, and whether it is served, in the process's
:class:`~tableclient.engine.plugin.PluginState` (weakly held).
"""

from __future__ import annotations

import functools
import importlib

from tableclient.engine.config import PluginConfig
from tableclient.engine.plugin import PluginError, check_layout, check_release
from tableclient.vllm import graphs, layers, loading
from tableclient.vllm.graphs import close_graphs, device_tables, graph_steps
from tableclient.vllm.loading import served_key, verify
from tableclient.vllm.memory import check_memory
from tableclient.vllm.ranks import check_parallel, tp_agreement, tp_ranks
from tableclient.vllm.state import (
    DEAD_ID,
    OUTPUTS,
    STATE,
    SUPPORTED_VLLM,
    config,
    rows,
    served,
    vllm_modules,
    vllm_worker,
)

__all__ = [
    "GRAPH_MODES", "SUPPORTED_VLLM", "DEAD_ID", "PluginError", "check_vllm", "check_config", "configure", "config",
    "rows", "served", "patch", "hooked", "graph_steps", "device_tables", "close_graphs", "served_key", "verify",
    "check_memory", "tp_ranks", "tp_agreement", "check_parallel",
]  # fmt: skip

#: the graph modes vLLM takes: device (node), in_graph (the default with FULL graphs), eager_break (else)
GRAPH_MODES = ("device", "in_graph", "eager_break")

_wrappers: dict = {}  # each wrapper patch() put on vLLM -> (its hook, vLLM's function under it)


def configure(cfg: PluginConfig, client_factory=None):
    """Makes ``cfg`` this process's configuration (layers built from now on follow it)."""
    graphs.close()
    return STATE.configure(cfg, client_factory)


# ---------------------------------------------------------------------- the pin and the layout
def check_vllm() -> str:
    """The installed vLLM's version, if this plugin supports it; PluginError naming the fix otherwise."""
    version = check_release("vllm", "vLLM", SUPPORTED_VLLM)
    engram, weights, model = vllm_modules()
    worker = vllm_worker()
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


def _original(fn):
    """vLLM's own function under the plugin's wrapper (``fn`` itself when not wrapped)."""
    return _wrappers.get(fn, (None, fn))[1]


# ---------------------------------------------------------------------- putting the hooks in place
def patch() -> None:
    """Wraps vLLM's functions (once per process; again is a no-op)."""
    engram, weights, model = vllm_modules()
    targets = [
        (engram.Engram, "_create_embedding", layers.create_embedding),
        (engram.Engram, "prepare_embeddings", layers.prepare_embeddings),
        (engram.Engram, "_ready_rows", layers.ready_rows),
        (weights, "should_skip_weight", loading.should_skip_weight),
        (model.DeepseekV41ForCausalLM, "load_weights", loading.load_weights),
        (model.DeepseekV41ForCausalLM, "is_unused_checkpoint_weight", loading.is_unused),  # vLLM's is optional: None
        (vllm_worker().Worker, "execute_model", graphs.execute_model),
        (vllm_worker().Worker, "execute_dummy_batch", graphs.execute_dummy_batch),
        (vllm_worker().Worker, "sample_tokens", graphs.sample_tokens),
    ]
    for owner, name, hook in targets:
        current = getattr(owner, name, None)
        if current not in _wrappers:
            setattr(owner, name, _as_function(hook, current))
    if engram.EngramBatch.create not in _wrappers:  # a classmethod: called on the class
        engram.EngramBatch.create = staticmethod(_as_function(layers.batch_create, engram.EngramBatch.create))
    layers.wrap_eager(engram.eager_break_during_capture)
    STATE.hooks_in_place = True


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
