"""A served Engram layer in vLLM: built as a :class:`~tableclient.vllm.embedding.RemoteEngramEmbedding`, and its
two moments in every step, each handed to its graph mode's path.

* ``Engram._create_embedding`` (the only place vLLM allocates table memory, :func:`create_embedding`): a
  :class:`~tableclient.vllm.embedding.RemoteEngramEmbedding` instead, with empty parameters; the tableserver's table
  is checked against the layer (rows, row size) right there, the layer's graph mode decided (a ``device`` table
  registered where every rank of the tensor-parallel group can, else the host path on all), and a graph mode vLLM's
  graphs would not take refused with the flag to use.
* ``Engram.prepare_embeddings`` (step start, right after vLLM's hasher, before the decoder layers: vLLM calls it for
  every Engram layer in turn, so layer 1 is issued first, :func:`prepare_embeddings`) and ``Engram._ready_rows``
  (when the layer runs: the rows dequantized with vLLM's arithmetic into the layer's persistent ``staged_rows``,
  :func:`ready_rows`; vLLM's own ``Engram.embed`` then joins the ranks' columns, tensor and sequence parallelism, as
  it does for a local table). Between them, one of two paths, each in vLLM's ``eager_break_during_capture``
  (:func:`wrap_eager`): graph modes ``device`` and ``in_graph`` (:mod:`tableclient.vllm.graphs`), or
  ``eager_break`` (:mod:`tableclient.vllm.eager`).

A local table sharded over data-parallel ranks cannot sit beside a served layer (``EngramBatch.create``,
:func:`batch_create`; :data:`DP_MIX`).
"""

from __future__ import annotations

import logging

from tableclient.engine.config import PluginConfig
from tableclient.engine.plugin import PluginError
from tableclient.vllm import eager, graphs
from tableclient.vllm.memory import freed_table
from tableclient.vllm.ranks import check_parallel
from tableclient.vllm.state import PIECEWISE_FLAG, STATE, config, rows, served

log = logging.getLogger(__name__)

DP_MIX = (
    "tableserver plugin: a local Engram table here is sharded over data-parallel ranks (embedding_across_dp, or "
    "/dev/shm too small to share it), which vLLM cannot mix with a served layer: place every Engram layer remote "
    "or node, or keep local tables whole per replica"
)

_eager: dict = {}  # issue / collect / publish / rows in vLLM's eager_break_during_capture (wrap_eager)


def wrap_eager(eager_break) -> None:
    """What a served layer runs at step start and when it runs, each wrapped by vLLM's ``eager_break_during_capture``
    (``eager_break``): the host path's issue and collect, the graph step's publish and rows."""
    _eager["issue"] = eager_break(eager.issue)
    _eager["collect"] = eager_break(eager.collect)
    # device, in_graph: captured in FULL graphs, between segments in breakable ones
    _eager["publish"] = eager_break(graphs.publish)
    _eager["rows"] = eager_break(graphs.graph_rows)


def eager_breaks() -> dict:
    """name (issue, collect, publish, rows) -> the function a served layer calls, in vLLM's eager break."""
    return dict(_eager)


def create_embedding(original, self, layout, layer_hash_index):
    layer = layout.layer_ids[layer_hash_index]
    STATE.built(self, layer)  # every Engram, local ones too: the start-up check reads it
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
        why = graphs.register_table(layer, served_layer.table, embed.weight.device)
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
        graphs.add_layer(embed)
    STATE.built(self, layer, served=True)
    STATE.table_not_allocated(freed_table(layer, placement, sum(heads[embed.head_start : embed.head_end]), layout))
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


def batch_create(original, layers, max_tokens):
    """vLLM stages every Engram layer as one batch when the first one's table is sharded over DP ranks: a
    served layer cannot join it (its rows are this replica's, whole per token)."""
    if (
        layers
        and STATE.served_layer(layers[0]) is None
        and layers[0].embed_tokens.dp_size > 1
        and any(STATE.served_layer(layer) is not None for layer in layers)
    ):
        raise PluginError(DP_MIX)
    return original(layers, max_tokens)


def prepare_embeddings(original, self, hash_ids):
    layer = STATE.served_layer(self)
    if layer is None:
        return original(self, hash_ids)
    assert self.staged_rows.shape[0] >= hash_ids.shape[0], "engram staging buffer too small"
    if self.embed_tokens.graph_mode == "eager_break":
        _eager["issue"](self, hash_ids)
    else:
        _eager["publish"](self, hash_ids)
    return None


def ready_rows(original, self, num_tokens):
    layer = STATE.served_layer(self)
    if layer is None:
        return original(self, num_tokens)
    rows_out = self.staged_rows[:num_tokens]
    if self.embed_tokens.graph_mode == "eager_break":
        _eager["collect"](self, rows_out)
    else:
        _eager["rows"](self, rows_out)
    return rows_out
