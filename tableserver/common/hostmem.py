"""Where an engine keeps the Engram tables, and how many bytes that takes per process and per host.

The arithmetic ``tableserver plan`` (``tableserver/ops/launch_plan.py``) and the engine plugins' start-up
report (``client/tableclient/engine/plugin.py``, through ``tableclient.hostmem``) share, defined once. Pure:
no engine, no torch. Every rule is read from the released wheels:

* **SGLang 0.5.23** (``sglang/srt/layers/engram.py``: ``EngramEmbedding.__init__``, ``_init_host_table``,
  ``_HostTable``). Without ``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE`` the rows are split over the TP ranks'
  GPUs (home ``device``; ``shard_range``). With it they are in host memory: layout ``shared``
  (``SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT``'s default) is one memfd of the whole table per TP group, which
  the group's other ranks open through ``/proc`` (so a group must sit on one host); ``per_rank`` is each
  rank's own row shard, anonymous memory.
* **vLLM 0.33.0** (``vllm/config/engram.py``: ``EngramConfig``; ``vllm/models/deepseek_v41/common/engram.py``:
  ``ParallelEngramEmbedding``). ``cpu_offload`` (its default) keeps each TP rank's share of the 24 hash
  columns in pinned host memory. ``dp_shared_memory``, which ``EngramConfig.resolve_dp_shared_memory`` turns
  on wherever DP > 1, makes that one ``/dev/shm`` copy per node of every TP shard (``DPSharedEngramStorage``,
  exact bytes; home ``shared``). Otherwise each rank pins its own shard with ``torch.empty(pin_memory=True)``
  (home ``per-rank``), which torch's host allocator rounds up to a power of two
  (``ATen/core/CachingHostAllocator.h``, ``allocate``; vLLM's ``_allocate_weights`` says so too), the fp8
  values and the scales each. ``cpu_offload=False`` keeps them on the GPUs (home ``device``).

A placement's ``node`` layer is one copy per host, in this host's tableserver; ``remote`` takes nothing here;
``local`` is the engine's own, as above. Row counts of a rank's shard are even shares of the table: a
table is 24 prime-sized head tables that differ by well under 0.1%.
"""

from __future__ import annotations

from dataclasses import dataclass

from tableserver.common.model import ROW_BYTES, ROWS_PER_TOKEN

ENGINES = ("sglang", "vllm")
#: where an engine keeps a local layer's table (see the module's docstring); "auto" is the engine's default
TABLE_HOMES = ("device", "shared", "per-rank")
PLACEMENTS = ("remote", "node", "local")
#: fp8 values per e8m0 scale byte
FP8_BLOCK = 32
GIB = 1 << 30
#: tokens per forward the plugins' staging holds (``max_tokens``, tableclient/engine/config.py)
STAGING_TOKENS = 8192
#: pinned staging buffers per served layer and rank: SGLang's forward prefetch, its scheduler's staging of
#: the next batch and its decode graphs' GraphStep (tableclient/engine/rows.py, tableclient/graph/); vLLM's one
#: step per layer (tableclient/vllm/hooks.py)
STAGING_CHANNELS = {"sglang": 3, "vllm": 1}


def table_bytes(rows: int, row_bytes: int = ROW_BYTES) -> int:
    return rows * row_bytes


def pinned_bytes(nbytes: int) -> int:
    """What ``torch.empty(nbytes, pin_memory=True)`` takes: torch's host allocator rounds every allocation up
    to a power of two (``ATen/core/CachingHostAllocator.h``, unless ``pinned_max_round_threshold`` is set)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def vllm_private_bytes(rows: int, row_bytes: int = ROW_BYTES) -> int:
    """A vLLM rank's own pinned shard of ``rows`` rows: the fp8 values and the scales, each rounded up by
    torch's pinned allocator (``ParallelEngramEmbedding._allocate_weights``, its last branch)."""
    dim = row_bytes * FP8_BLOCK // (FP8_BLOCK + 1)
    return pinned_bytes(rows * dim) + pinned_bytes(rows * (row_bytes - dim))


def vllm_columns(tp: int, tp_rank: int, columns: int = ROWS_PER_TOKEN) -> int:
    """Hash columns vLLM gives TP rank ``tp_rank``: ``ceil(columns / tp)`` each, from the first rank on
    (``ParallelEngramEmbedding.__init__``: ``part_n_hash_cols``, ``head_start``)."""
    part = -(-columns // tp)
    return max(0, min(part, columns - tp_rank * part))


def rank_rows(engine: str, rows: int, tp: int, tp_rank: int) -> int:
    """The rows of a table TP rank ``tp_rank`` keeps: vLLM's share of the hash columns, SGLang's row shard."""
    if engine == "vllm":
        return rows * vllm_columns(tp, tp_rank) // ROWS_PER_TOKEN
    return rows // tp + (1 if tp_rank < rows % tp else 0)


def process_bytes(engine: str, home: str, rows_here: int, row_bytes: int = ROW_BYTES, sharers: int = 1) -> int:
    """Bytes one engine process allocates for one table: ``rows_here`` rows (the whole table, or its shard),
    held by ``sharers`` processes together (a shared copy counts a share in each). Host or device memory by
    ``home``; a vLLM rank's private pinned shard as its pinned allocator rounds it."""
    if engine == "vllm" and home == "per-rank":
        return vllm_private_bytes(rows_here, row_bytes)
    return table_bytes(rows_here, row_bytes) // sharers


@dataclass(frozen=True)
class Parallel:
    """An engine's parallel layout: ``tp`` ranks per replica, ``dp`` replicas, over ``nnodes`` hosts.
    ``dp_attention`` (SGLang's ``--attn-dp-size``): the DP replicas share one TP group of ``tp`` ranks."""

    engine: str
    tp: int = 1
    dp: int = 1
    nnodes: int = 1
    dp_attention: bool = False

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        for name in ("tp", "dp", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: expected at least 1")
        if self.dp_attention and (self.engine != "sglang" or self.tp % self.dp):
            raise ValueError("attention DP is SGLang's, with --dp dividing --tp (it runs inside the TP group)")
        if self.world % self.nnodes:
            raise ValueError(f"{self.world} ranks do not spread evenly over {self.nnodes} hosts")

    @property
    def world(self) -> int:
        """Every rank (GPU) of the launch: SGLang's ``compute_world_size``, attention DP adding none."""
        return self.tp if self.dp_attention else self.tp * self.dp

    @property
    def ranks_per_host(self) -> int:
        """Ranks on each host (SGLang's ``ranks_per_host``: the launch world over the hosts)."""
        return self.world // self.nnodes

    @property
    def replicas_per_host(self) -> int:
        """Replicas (TP groups) with all their ranks on each host; 0 where a TP group spans hosts."""
        return self.ranks_per_host // self.tp

    @property
    def ranks_per_engine(self) -> int:
        """The ranks of one engine instance: SGLang's TP group, one vLLM DP engine's TP ranks."""
        return self.tp


def default_home(p: Parallel) -> str:
    """Where the engine keeps a local table by default: SGLang's host table in its default layout (the
    baseline this project replaces; SGLang's own default without SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE is
    ``device``), vLLM's ``cpu_offload`` with ``dp_shared_memory`` as it resolves: shared where DP replicas sit
    together on a host (``can_share_engram_tables``), else per rank."""
    if p.engine == "sglang":
        return "shared"
    return "shared" if p.replicas_per_host > 1 else "per-rank"


def check_home(p: Parallel, home: str) -> None:
    """ValueError, naming the engine's rule, where ``p``'s engine cannot keep its tables in ``home``."""
    if home not in TABLE_HOMES:
        raise ValueError(f"table home {home!r}: use one of {', '.join(TABLE_HOMES)}")
    if p.engine == "sglang" and home == "shared" and p.replicas_per_host < 1:
        raise ValueError(
            f"SGLang's shared host table is one memfd per TP group, opened through /proc: a TP group of {p.tp} "
            f"ranks cannot span hosts of {p.ranks_per_host} ranks (use the per-rank home)"
        )
    if p.engine == "vllm" and home == "shared" and p.replicas_per_host < 2:
        raise ValueError(
            "vLLM's dp_shared_memory needs DP replicas together on a host (vllm/config/engram.py, "
            "can_share_engram_tables): use the per-rank home"
        )


def engine_bytes(p: Parallel, home: str, rows: int, row_bytes: int = ROW_BYTES) -> int:
    """Host bytes one local table takes on each host: every rank's process's share summed (0 on the GPUs)."""
    check_home(p, home)
    if home == "device":
        return 0
    whole = p.engine == "sglang" and home == "shared"  # SGLang's memfd holds the whole table
    sharers = p.tp if whole else p.replicas_per_host if home == "shared" else 1  # vLLM: the host's replicas
    return sum(
        process_bytes(p.engine, home, rows if whole else rank_rows(p.engine, rows, p.tp, i % p.tp), row_bytes, sharers)
        for i in range(p.ranks_per_host)
    )


def placed_bytes(p: Parallel, home: str, placement: str, rows: int, row_bytes: int = ROW_BYTES) -> int:
    """Host bytes one table takes on each host when its layer is placed ``placement``."""
    if placement == "remote":
        return 0
    if placement == "node":
        return table_bytes(rows, row_bytes)  # the node daemon's one copy
    if placement == "local":
        return engine_bytes(p, home, rows, row_bytes)
    raise ValueError(f"placement {placement!r}: use one of {', '.join(PLACEMENTS)}")


def staging_bytes(p: Parallel, served_layers: int, tokens: int = STAGING_TOKENS, row_bytes: int = ROW_BYTES) -> int:
    """Pinned staging the plugin allocates in each rank's process for ``served_layers`` layers (at most: a
    channel an engine does not use is never allocated). A vLLM rank stages only its share of the columns."""
    columns = vllm_columns(p.tp, 0) if p.engine == "vllm" else ROWS_PER_TOKEN
    return STAGING_CHANNELS[p.engine] * served_layers * pinned_bytes(tokens * columns * row_bytes)
