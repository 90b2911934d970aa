"""The host and device memory a served layer frees in vLLM, and the start-up check of what vLLM is told to use.

Each served layer's table that vLLM did not allocate in this process is recorded when the layer is built
(:func:`freed_table`: log line and ``tableserver_client_freed_table_{host,device}_bytes`` at the start-up check);
where that freed host memory goes unused (no ``--kv-offloading-size``) one warning names the flag and
``tableserver plan``, and where ``--kv-offloading-size`` asks more than this host has once the plugin's staging is
allocated (vLLM itself checks none: it pins what it is told), one warning says so before vLLM allocates it
(:func:`check_memory`).
"""

from __future__ import annotations

import logging

from tableclient.engine import memory as engine_memory
from tableclient.hostmem import GIB, Parallel, process_bytes, staging_bytes, table_bytes, vllm_private_bytes
from tableclient.vllm.state import STATE, config, rows

log = logging.getLogger(__name__)

OFFLOAD_FLAG = "--kv-offloading-size G --kv-offloading-backend native"


def freed_table(layer: int, placement: str, rows_here: int, layout) -> engine_memory.FreedTable:
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
        return engine_memory.FreedTable(layer, placement, table_bytes(rows_here, row_bytes), "device")
    if engram.dp_shared_memory:
        nbytes = process_bytes("vllm", "shared", rows_here, row_bytes, get_engram_dp_size())
    elif engram.use_thp or current_platform.is_rocm():
        nbytes = table_bytes(rows_here, row_bytes)
    else:
        nbytes = vllm_private_bytes(rows_here, row_bytes)
    return engine_memory.FreedTable(layer, placement, nbytes, "host")


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
    hint = engine_memory.plan_hint("vllm", config(), layers, tp, dp)
    engine_memory.report(STATE, "vLLM", size is not None, OFFLOAD_FLAG, hint, log)
    if size is None:
        return True
    ranks_here = parallel.world_size * max(1, parallel.data_parallel_size_local)  # every engine on this host
    staged = [s for s in rows().layers.values() if s.layer in layers and s.graph_mode != "device"]  # device: none
    staging = staging_bytes(Parallel("vllm", tp), len(staged), config().max_tokens)
    fix = f"lower --kv-offloading-size below {size:g}: `{hint}` sizes it for this host"
    # vLLM's size is the engine's, over its ranks (OffloadingConnector: cpu_bytes_to_use / world_size)
    return engine_memory.check_host_kv(
        "vLLM", int(size * GIB) // parallel.world_size, engine_memory.mem_available() // ranks_here, staging, fix, log
    )
