"""The plugin's hooks into SGLang 0.5.23, registered through SGLang's own HookRegistry.

Where SGLang reads an Engram layer's table, and what the hooks do for a layer
placed ``remote`` or ``node`` (a ``local`` layer passes through untouched):

* ``EngramEmbedding.__init__``: allocates **no** table (no fp8 weight, no
  e8m0 scale, no host memfd, no peer shard); checks the tableserver's table
  has this layer's rows and row size; marks the layer ``staged_by_scheduler``
  so a breakable prefill CUDA graph runs its lookup between captured segments.
* ``Engram.__init__``: learns the layer's column in the hasher's output.
* ``EngramHasher.forward`` (step start): issues every served layer's gather
  at once, shortest window first (:meth:`EngramRows.prefetch`).
* ``EngramEmbedding.forward``: the layer's bf16 rows from the tableserver for
  this rank's own tokens, with no TP/DP/CP collective (every rank gets whole
  rows, as SGLang's peer-shard path does), dequantized with SGLang's
  arithmetic (on the GPU with its own ``dequant_staged`` kernel path).
* ``Engram.embed_rows`` (every forward outside a decode graph reaches it once per
  layer, on every rank, idle batches of DP attention and scheduler-staged
  batches included): with tensor parallelism the ranks agree on the layer's
  rows, one MIN over SGLang's tensor-parallel CPU group: every rank serves
  the table's rows, or every rank zeros, or (policy ``fail``) every rank
  raises PluginError at that layer of that step, naming where it failed;
  never one rank alone before the collectives that follow the layer.
* ``EngramRowStager.from_model`` / ``.stage``: the scheduler-side staging of
  extend batches gathers served layers from the tableserver (issued before
  SGLang's own gathers of local layers), and checks at start-up that every
  served layer really is served.
* ``safetensors_weights_iterator`` and ``DeepseekV4ForCausalLM.load_weights``:
  a served layer's table tensors are never read from the checkpoint.
* ``_deepseek_v4_num_host_pages`` (SGLang sized its DeepSeek V4 host KV pools, before it allocates them):
  the host KV cache it is about to ask for is checked against what SGLang's own check grants this rank
  (``host_memory_budget_bytes``) less the plugin's staging, with a warning naming the fix where it does
  not fit. At start-up the plugin also reports the table memory SGLang did not allocate here (log line,
  ``tableserver_client_freed_table_{host,device}_bytes``) and names ``--enable-hierarchical-cache
  --hicache-ratio`` where that freed memory goes unused (``tableserver plan`` sizes it).
* ``DecodeCudaGraphRunner.capture`` / ``.load_batch`` / ``.execute``: decode
  CUDA graphs stay on. Before capture every buffer the graphs touch is
  allocated; in capture a served layer records the copy of its staged rows;
  before each replay its rows are gathered (``before_replay``) or armed for the
  graph to publish their ids (``in_graph``): see ``graphs``.

Any other captured graph (a non-breakable prefill graph) would replay
capture-time rows: a served layer refuses to be captured there, naming the
launch flag that avoids it.

The plugin sets no attribute of its own on SGLang's objects: which layer an
Engram module was built as, and whether it is served, is kept in the
process's :class:`~tableclient.engine.plugin.PluginState`, and a stager's
served columns in ``_stagers`` (both weakly held). The hooks set only the
fields of SGLang's own that SGLang's code reads of the objects they build in
its place (a served ``EngramEmbedding``, a stager).
"""

from __future__ import annotations

import logging
import re
import weakref

from tableclient.engine import memory
from tableclient.engine.config import PluginConfig
from tableclient.engine.plugin import PluginError, PluginState, check_layout, check_placement, check_release
from tableclient.engine.rows import EngramRows, dequantize, to_device
from tableclient.hostmem import Parallel, process_bytes, staging_bytes, table_bytes
from tableclient.sglang import graphs

log = logging.getLogger(__name__)

SUPPORTED_SGLANG = "0.5.23"
ENGRAM = "sglang.srt.layers.engram"
STAGING = "sglang.srt.layers.engram_staging"
RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
SCHEDULER = "sglang.srt.managers.scheduler"
WEIGHTS = "sglang.srt.model_loader.weight_utils"
HOST_POOLS = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
HICACHE_FLAG = "--enable-hierarchical-cache --hicache-ratio R"
#: checkpoint tensors of a layer's table (names as in the checkpoint and after SGLang's remap)
TABLE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.engram\.embed\.(?:weight|scale)$")
GRAPH_ADVICE = (
    "rows from a tableserver can be replayed in decode CUDA graphs and breakable prefill graphs only: "
    "launch SGLang with --cuda-graph-backend-prefill breakable (or disabled), or place the layer 'local'"
)

_state = PluginState("sglang")
#: SGLang's scheduler-side stagers the plugin built -> per hash column, the served layer or None (local)
_stagers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def config() -> PluginConfig | None:
    return _state.config


def rows() -> EngramRows:
    return _state.rows()


def configure(cfg: PluginConfig, client_factory=None) -> EngramRows:
    """Makes ``cfg`` this process's configuration (layers built from now on follow it); the decode graphs
    of the previous one are closed first."""
    graphs.close()
    return _state.configure(cfg, client_factory)


def served(layer: int) -> bool:
    return _state.served(layer)


# ---------------------------------------------------------------------- registration
def check_sglang() -> str:
    """The installed SGLang's version, if this plugin supports it; PluginError naming the fix otherwise."""
    version = check_release("sglang", "SGLang", SUPPORTED_SGLANG)
    from sglang.srt.layers import engram, engram_staging
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    expected = {
        Scheduler.run_batch: ["self", "batch", "pp_proxy_tensors"],  # a batch's result: its steps' outcome
        Scheduler.process_batch_result: ["self", "batch", "result"],
        DecodeCudaGraphRunner.capture: ["self"],
        DecodeCudaGraphRunner.load_batch: ["self", "forward_batch", "pp_proxy_tensors"],
        DecodeCudaGraphRunner.execute: ["self", "forward_batch", "pp_proxy_tensors"],
        engram.EngramHasher.init_history: ["self", "num_req_slots", "device"],  # graphs read its history
        engram.EngramEmbedding.__init__: ["self", "num_embeddings", "dim", "layer_id", "column_bounds"],
        engram.EngramEmbedding.forward: ["self", "indices", "forward_batch", "cp_all_tokens"],
        engram.Engram.embed_rows: ["self", "hash_ids", "forward_batch", "cp_all_tokens"],  # every forward's rows
        engram.EngramEmbedding.dequant_staged: ["self", "rows", "scales", "copied", "hash_shape"],
        engram.EngramHasher.forward: ["self", "input_ids", "forward_batch"],
        engram_staging.EngramRowStager.stage: ["self", "batch"],
        hybrid_pool_assembler._deepseek_v4_num_host_pages: ["params", "kvcache", "page_size", "swa_page_size"],
    }
    check_layout(expected, "SGLang", f"sglang=={SUPPORTED_SGLANG}")
    return version


def _hooks() -> list:
    """(target, hook, kind) of every hook the plugin registers with SGLang; ``kind`` is "around" or "after"."""
    return [
        (f"{ENGRAM}.EngramEmbedding.__init__", _embedding_init, "around"),
        (f"{ENGRAM}.EngramEmbedding.forward", _embedding_forward, "around"),
        (f"{ENGRAM}.Engram.embed_rows", _embed_rows, "around"),
        (f"{ENGRAM}.Engram.__init__", _engram_init, "after"),
        (f"{ENGRAM}.EngramHasher.forward", _hasher_forward, "after"),
        (f"{RUNNER}.DecodeCudaGraphRunner.capture", _runner_capture, "around"),
        (f"{RUNNER}.DecodeCudaGraphRunner.load_batch", _runner_load_batch, "after"),
        (f"{RUNNER}.DecodeCudaGraphRunner.execute", _runner_execute, "around"),
        (f"{SCHEDULER}.Scheduler.run_batch", _scheduler_run_batch, "around"),
        (f"{SCHEDULER}.Scheduler.process_batch_result", _scheduler_process_result, "around"),
        (f"{STAGING}.EngramRowStager.from_model", _stager_from_model, "around"),
        (f"{STAGING}.EngramRowStager.stage", _stager_stage, "around"),
        (f"{WEIGHTS}.safetensors_weights_iterator", _skip_served_tables, "around"),
        (f"{WEIGHTS}.buffered_multi_thread_safetensors_weights_iterator", _skip_served_tables, "around"),
        ("sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.load_weights", _load_weights, "around"),
        (f"{HOST_POOLS}._deepseek_v4_num_host_pages", _host_pages, "after"),
    ]


def register_hooks() -> None:
    """Registers every hook with SGLang's HookRegistry and applies them now (once per process)."""
    if _state.hooks_in_place:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kinds = {"around": HookType.AROUND, "after": HookType.AFTER}
    hooks = _hooks()
    for target, fn, kind in hooks:
        HookRegistry.register(target, fn, kinds[kind])
    HookRegistry.apply_hooks()  # SGLang's load_plugins applies them too; doing it here lets us check
    for target, _fn, _kind in hooks:
        if not applied(target):
            raise PluginError(
                f"tableserver plugin: SGLang did not apply the hook on {target} (see its log): the plugin cannot engage"
            )
    _state.hooks_in_place = True


def hooks_in_place() -> bool:
    """Whether ``register_hooks`` completed in this process: SGLang applied every hook, and each was checked."""
    return _state.hooks_in_place


def hook(target: str):
    """The plugin's hook on ``target``, one of the dotted names the plugin hooks (e.g.
    ``sglang.srt.layers.engram.EngramEmbedding.forward``), as SGLang's HookRegistry calls it: ``(original, self,
    ...)`` for an "around" hook, ``(result, self, ...)`` for an "after" one."""
    found = next((fn for t, fn, _kind in _hooks() if t == target), None)
    if found is None:
        raise ValueError(f"the plugin hooks no {target!r}")
    return found


def applied(target: str) -> bool:
    """Whether SGLang applied the plugin's hook on ``target`` (see :func:`hook`): the wrapper chain SGLang put
    there calls it."""
    import pkgutil

    owner, attr = target.rsplit(".", 1)
    return _wraps(getattr(pkgutil.resolve_name(owner), attr), hook(target))


def _wraps(fn, hook) -> bool:
    """Whether SGLang's wrapper chain around ``fn`` calls ``hook``."""
    fn = getattr(fn, "__func__", fn)
    while fn is not None:
        if any(cell.cell_contents is hook for cell in (getattr(fn, "__closure__", None) or ()) if _cell_set(cell)):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _cell_set(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- the layer
def _embedding_init(original, self, num_embeddings, dim, layer_id, column_bounds, *args, **kwargs):
    if not served(layer_id):
        return original(self, num_embeddings, dim, layer_id, column_bounds, *args, **kwargs)
    import torch
    from sglang.srt.runtime_context import get_parallel

    torch.nn.Module.__init__(self)
    placement = config().placement(layer_id)
    rows().add_layer(layer_id, placement, num_embeddings, dim)  # PluginError-like if the table does not fit
    # What SGLang's other code reads of an embedding; no weight, no scale, no host table, no peer shard.
    self.dim = dim
    self.tp_size = get_parallel().tp_size
    self.row_start, self.rows = 0, 0
    self.host_table = None
    self._sort_host_reads = False
    self.peer = None
    self.staged_by_scheduler = True  # a breakable prefill graph runs the lookup between its segments
    _state.built(self, layer_id, served=True)
    _state.table_not_allocated(_sglang_table(layer_id, placement, num_embeddings, dim, column_bounds))
    where = config().address if placement == "remote" else config().node_address
    log.info(
        "tableserver plugin: Engram layer %d reads table %r from %s (%s); no local table allocated",
        layer_id,
        config().table(layer_id),
        where,
        placement,
    )


def _sglang_table(layer: int, placement: str, num_embeddings: int, dim: int, column_bounds) -> memory.FreedTable:
    """What SGLang's ``EngramEmbedding.__init__`` would have allocated here for the layer's table: its row
    shard on the GPU (``shard_range``; peer shards too), or with SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE its host
    table, a TP-group-wide memfd of the whole table (layout shared: this rank's share) or the row shard."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.engram import shard_range
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils import is_cuda

    tp, rank = get_parallel().tp_size, get_parallel().tp_rank
    start, end = shard_range(num_embeddings, column_bounds, rank, tp)
    row_bytes = dim + dim // 32
    peer = envs.SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS.get() and tp > 1 and is_cuda()
    if peer or not envs.SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE.get():
        return memory.FreedTable(layer, placement, table_bytes(end - start, row_bytes), "device")
    if envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.get() == "shared":
        return memory.FreedTable(
            layer, placement, process_bytes("sglang", "shared", num_embeddings, row_bytes, tp), "host"
        )
    return memory.FreedTable(layer, placement, table_bytes(end - start, row_bytes), "host")


def _engram_init(result, self, cfg, layer_id, layout, *args, **kwargs):
    _state.built(self, layer_id)  # for the start-up check, local layers included
    if _state.served_layer(self.embed) is not None:
        rows().set_hash_index(layer_id, self.layer_hash_index)


def _hasher_forward(result, self, input_ids, forward_batch, *args, **kwargs):
    """Step start: the step's row ids exist; fetch every served layer's rows now (eager steps), or, in a
    decode graph's capture, publish the in_graph layers' ids from within the graph."""
    state = _state.rows() if _state.configured else None
    if state is None or not state.layers:
        return None
    session = graphs.session()
    if session is not None and session.hasher is self and (session.peeking or session.capturing):
        if session.capturing and not session.peeking and not forward_batch.forward_mode.is_extend():
            graphs.publish(session, result)
        return None
    if _capturing(result):
        return None
    if getattr(forward_batch, "engram_staged_rows", None) is not None:
        return None  # the scheduler staged this batch's rows already
    state.prefetch(result)
    return None


def _embedding_forward(original, self, indices, *args, **kwargs):
    layer = _state.served_layer(self)
    if layer is None:
        return original(self, indices, *args, **kwargs)
    forward_batch = kwargs.get("forward_batch", args[0] if args else None)
    session = graphs.session()
    if graphs.in_capture(session, forward_batch, indices):  # a decode graph's capture (warm-ups included)
        return graphs.captured_rows(session, self, layer, indices)
    return served_rows(self, layer, indices)


def _embed_rows(original, self, hash_ids, *args, **kwargs):
    """A served layer's rows in a forward that is not a decode graph's (eager decode, extend, an idle batch of DP
    attention, a breakable prefill graph's eager break): whatever SGLang reads them from (the plugin's forward, or
    the rows the scheduler staged), agreed by the tensor-parallel ranks (:func:`graphs.served_alike`), which every
    rank reaches once per layer and forward whatever its batch."""
    layer = _state.served_layer(self.embed)
    if layer is None:
        return original(self, hash_ids, *args, **kwargs)
    forward_batch = kwargs.get("forward_batch", args[0] if args else None)
    if graphs.in_capture(graphs.session(), forward_batch, hash_ids) or _capturing(hash_ids):
        return original(self, hash_ids, *args, **kwargs)  # a decode graph's (agreed in it), or refused
    got = graphs.served_alike(rows(), layer, lambda: original(self, hash_ids, *args, **kwargs))
    return self.embed.new_rows(hash_ids).zero_() if got is None else got


def served_rows(embed, layer: int, indices):
    """bf16 ``[*indices.shape, dim]`` for a served layer, on ``indices``' device, no collective."""
    import torch

    if indices.numel() == 0:
        return embed.new_rows(indices)
    if _capturing(indices):
        raise PluginError(f"tableserver plugin: Engram layer {layer}: {GRAPH_ADVICE}")
    packed, staged = rows().rows(layer, indices)  # host uint8 [*indices.shape, dim + dim/32]
    if not indices.is_cuda:
        return dequantize(packed, embed.dim)
    # SGLang's own dequantization of staged rows: device fp8 rows and e8m0 scales, token-major.
    weight, scale, copied = to_device(packed, embed.dim, indices.device, torch.cuda.current_stream())
    if staged:
        rows().fence("forward", copied)
    return embed.dequant_staged(weight, scale, copied, indices.shape)


def _capturing(t) -> bool:
    import torch

    return t.is_cuda and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------- decode CUDA graphs
def _runner_capture(original, self, *args, **kwargs):
    """Before SGLang captures its decode graphs: everything they touch exists (graphs.prepare)."""
    state = _state.rows() if _state.configured else None
    if state is None or not state.layers:
        return original(self, *args, **kwargs)
    session = graphs.prepare(self, state)
    session.capturing = True
    try:
        return original(self, *args, **kwargs)
    finally:
        session.capturing = False


def _runner_load_batch(result, self, forward_batch, *args, **kwargs):
    """The batch is in the graph's buffers, the replay comes next: the host's part of the step."""
    session = graphs.session()
    if session is not None and session.runner is self and not session.capturing:
        graphs.before_replay(session, forward_batch, int(self.raw_num_token))
    return None


def _runner_execute(original, self, forward_batch, *args, **kwargs):
    session = graphs.session()
    if session is None or session.runner is not self or session.capturing:
        return original(self, forward_batch, *args, **kwargs)
    return graphs.execute(session, original, self, forward_batch, *args, **kwargs)


def _scheduler_run_batch(original, self, batch, *args, **kwargs):
    """The steps the batch's replays ran belong to its result (checked where the result is processed)."""
    result = original(self, batch, *args, **kwargs)
    graphs.bind_result(result)
    return result


def _scheduler_process_result(original, self, batch, result, *args, **kwargs):
    """Before SGLang reads a batch's result: its decode steps' rows were the table's on every rank (policy
    fail raises GraphStepError otherwise)."""
    graphs.check_result(result)
    return original(self, batch, result, *args, **kwargs)


# ---------------------------------------------------------------------- scheduler-side staging
def _stager_from_model(original, cls, model, hasher, device):
    import torch
    from sglang.srt.environ import envs
    from sglang.srt.layers.engram import Engram
    from sglang.srt.layers.engram_staging import _GATHER_THREADS
    from sglang.srt.runtime_context import get_parallel

    engrams = sorted((m for m in model.modules() if isinstance(m, Engram)), key=lambda m: m.layer_hash_index)
    if config() is None or not config().enabled:
        return original(cls, model, hasher, device)
    _verify(engrams)
    served_layers = [e for e in engrams if _state.served_layer(e.embed) is not None]
    if not served_layers:
        return original(cls, model, hasher, device)
    local = [e for e in engrams if e not in served_layers]
    if (
        not torch.cuda.is_available()
        or torch.device(device).type != "cuda"
        or get_parallel().attn_cp_size > 1
        or (
            local
            and not (
                envs.SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING.get()
                and all(e.embed.shared_host_table_without_ats for e in local)
            )
        )
    ):
        return None  # no scheduler staging: the forward prefetches at step start
    from concurrent.futures import ThreadPoolExecutor

    stager = cls.__new__(cls)
    stager.hasher, stager.device = hasher, torch.device(device)
    # per hash column: SGLang's (weight, scale) byte views of a local table, or None for a served layer
    stager.tables = [
        None if e in served_layers else (e.embed.weight.data.view(torch.uint8), e.embed.scale.data.view(torch.uint8))
        for e in engrams
    ]
    stager.pool = ThreadPoolExecutor(_GATHER_THREADS)
    stager.copy_stream = torch.cuda.Stream(stager.device)
    _stagers[stager] = [_state.served_layer(e.embed) for e in engrams]
    for e in local:
        e.embed.enable_scheduler_staging()
    log.info("tableserver plugin: the scheduler stages extend batches' rows (served layers from the tableserver)")
    return stager


def _verify(engrams) -> None:
    """Start-up check that each layer is where the configuration puts it; logs what is engaged."""
    cfg = config()
    built = [(_state.layer_of(e), _state.served_layer(e.embed) is not None) for e in engrams]  # as the hooks built them
    layers = check_placement(cfg, built, "SGLang")
    log.info("tableserver plugin engaged: %s", cfg.describe(layers))
    from sglang.srt.runtime_context import get_context, get_memory

    published = get_context().is_config_namespace_published("memory")
    host_kv = bool(get_memory().enable_hierarchical_cache) if published else None
    hint = memory.plan_hint("sglang", cfg, layers, _width("tp_size"), _width("dp_size"))
    memory.report(_state, "SGLang", host_kv, HICACHE_FLAG, hint, log)


def _width(name: str) -> int:
    """A parallel width of this process as SGLang published it (1 where nothing is published)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(getattr(get_parallel(), name))
    except (ValueError, RuntimeError, AttributeError):
        return 1


def _stager_stage(original, self, batch):
    order = _stagers.get(self)
    if order is None:
        return original(self, batch)
    if not batch.forward_mode.is_extend_without_speculative():
        return None
    windows = self._windows(batch)
    if windows is None:
        return None
    ids, _ = self.hasher.hash_windows(*windows)
    state = rows()
    issued = state.prefetch(ids, channel="stage")  # served layers first: their rows travel meanwhile
    import torch

    staged = []
    for column, (layer, table) in enumerate(zip(order, self.tables)):
        if layer is None:  # a local layer: SGLang's own gather from its host table, as in its stage()
            layer_ids = ids[:, column].reshape(-1)
            weight, scale = (self._gather(t, layer_ids) for t in table)
            with torch.cuda.stream(self.copy_stream):
                weight = weight.to(self.device, non_blocking=True)
                scale = scale.to(self.device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
        else:  # served: the channel's pinned staging, or (more tokens than it holds) fetched now
            packed = state.staged(layer) if issued else state.fetch(layer, ids[:, column])
            weight, scale, copied = to_device(packed, state.layers[layer].dim, self.device, self.copy_stream)
            if issued:
                state.fence("stage", copied)  # the next stage() refills the staging only after this copy
        staged.append((weight, scale, copied))
    return staged


# ---------------------------------------------------------------------- host KV cache
def _host_pages(result, *args, **kwargs):
    """SGLang sized its DeepSeek V4 host KV pools (host pages = device pages x --hicache-ratio) and is about to
    allocate them: what they will ask (the ratio times the device pool's buffers, as SGLang's own PD accounting
    lists them) against what SGLang's check grants this rank, less the plugin's staging."""
    state = _state.rows() if _state.configured else None
    kvcache = kwargs.get("kvcache")
    if state is None or not state.layers or kvcache is None:
        return None
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes
    from sglang.srt.runtime_context import get_memory

    try:
        device = sum(sum(infos()[1]) for infos in (kvcache.get_contiguous_buf_infos, kvcache.get_state_buf_infos))
    except Exception as e:  # a check of ours must never stop SGLang: its own pools still check themselves
        log.info("tableserver plugin: cannot size SGLang's host KV cache here (%r): not checked", e)
        return None
    ratio = get_memory().hicache_ratio
    staging = staging_bytes(Parallel("sglang", _width("tp_size")), len(state.layers), config().max_tokens)
    fix = f"lower --hicache-ratio below {ratio:g}: `tableserver plan --engine sglang ...` sizes it for this host"
    memory.check_host_kv("SGLang", int(device * ratio), host_memory_budget_bytes(), staging, fix, log)
    return None


# ---------------------------------------------------------------------- checkpoint loading
def served_key(name: str) -> bool:
    """Whether ``name``, a checkpoint tensor's, is a served layer's table (its weight or scale): never read."""
    m = TABLE_KEY.search(name)
    return m is not None and served(int(m.group(1)))


def _skip_served_tables(original, hf_weights_files, *args, **kwargs):
    """SGLang's safetensors iterators (single- and multi-threaded): files holding a served layer's table
    are read here, every tensor but those; the other files go to SGLang's iterator unchanged."""
    if config() is None or not config().enabled:
        yield from original(hf_weights_files, *args, **kwargs)
        return
    import safetensors

    run = []
    for path in hf_weights_files:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            skip = [k for k in f.keys() if served_key(k)]
        if not skip:
            run.append(path)
            continue
        if run:
            yield from original(run, *args, **kwargs)
            run = []
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in skip:
                    yield name, f.get_tensor(name)
        log.info("tableserver plugin: %s: not reading %s (served by the tableserver)", path, ", ".join(skip))
    if run:
        yield from original(run, *args, **kwargs)


def _load_weights(original, self, weights, *args, **kwargs):
    """Whatever iterator SGLang uses: a served layer's table tensors never reach a parameter."""
    return original(self, ((name, w) for name, w in weights if not served_key(name)), *args, **kwargs)
