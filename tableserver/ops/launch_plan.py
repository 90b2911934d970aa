"""``tableserver plan``: the host memory a placement frees, and the engine flags that turn it into host KV cache.

Given a placement of the Engram layers, an engine and its parallel layout, a host's memory and the device KV
pool per rank, the plan says what the tables take on the serving host under that placement and under the
engine's own default (``tableserver.common.hostmem``), and sizes the engine's host KV cache to the memory it
may take there, freed memory included:

* **SGLang 0.5.23**: ``--enable-hierarchical-cache --hicache-ratio R`` (host pages = device pages x R, for the
  full and the sliding-window pools: ``mem_cache/hybrid_cache/hybrid_pool_assembler.py``,
  ``_deepseek_v4_num_host_pages``). Its DeepSeek V4 path requires the ratio given: ``--hicache-size`` is refused
  there, and without ``--hicache-ratio`` its auto-sizing (``mem_cache/hicache_auto_size.py``,
  ``_estimate_hicache_bytes``) refuses the ``DeepSeekV4TokenToKVPool``; auto-sizing only ever lowers a ratio
  anyway. R is sized as that auto-sizing would size it, but upwards: the host's memory after the tables, the
  plugin's staging and SGLang's 10 GiB reserve (``mem_cache/pool_host/base.py``,
  ``HICACHE_HOST_MEMORY_RESERVE_BYTES``, ``host_memory_budget_bytes``: split among the host's ranks), times
  ``--hicache-host-memory-fraction``'s default 0.8, less the 5% ``_ALLOCATION_SLACK_FRACTION`` for page rounding
  and metadata, over the device pool.
* **vLLM 0.33.0**: ``--kv-offloading-size G --kv-offloading-backend native`` (GiB per engine, summed over its
  TP ranks: ``vllm/config/cache.py``; ``VllmConfig._post_init_kv_transfer_config`` makes it the
  ``OffloadingConnector``'s ``cpu_bytes_to_use``). vLLM checks no host memory for it: the plan keeps SGLang's
  reserve and fraction for it too, so the pinned buffer cannot push the host into the OOM killer.

The checks the engine will make are done first (the reserve, every rank's request against its share, host
pages above device pages); a plan that cannot fit says why in one line (``MemoryLimitError``, exit 1). Input that
is no plan's says so in one line naming the flag (``ConfigError``, exit 2): every size finite, above 0 (0 for
``--other-gib``), at least a byte and within int64, wherever it came from (a flag, an engine log's line); the
layout bounded (``MAX_PARALLEL``, ``MAX_RANKS_PER_HOST``); a file flag's file a regular file (a table file: or a
block device), read in bounded pieces. Imported by the command only (tableserver/cli.py).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import stat
import tomllib
from dataclasses import dataclass, field

from tableserver.common.host import proc_kib
from tableserver.common.hostmem import (
    GIB,
    PLACEMENTS,
    STAGING_TOKENS,
    Parallel,
    check_home,
    default_home,
    engine_bytes,
    placed_bytes,
    staging_bytes,
)
from tableserver.common.model import ROW_BYTES, TABLE_ROWS
from tableserver.errors import ConfigError

#: SGLang 0.5.23's host memory left free for the OS and other processes (mem_cache/pool_host/base.py)
RESERVE_BYTES = 10 * GIB
#: SGLang's --hicache-host-memory-fraction default (arg_groups/fields/memory.py): the share of the host's memory
#: after the reserve that HiCache's host pools of all ranks may take when it sizes them
HOST_FRACTION = 0.8
#: SGLang's _ALLOCATION_SLACK_FRACTION (mem_cache/hicache_auto_size.py): page rounding, metadata, staging
SLACK = 0.05
DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
#: the vLLM plugin refuses FULL CUDA graphs for a served layer (client/tableclient/vllm/hooks.py)
VLLM_PIECEWISE = """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'"""
#: the device KV pool as each engine logs it at start-up: SGLang's memory_pool.py / kv_pool_runtime.py
#: ("... KV size: 61.20 GB", GB being GiB there), vLLM's gpu_worker.py ("Available KV cache memory: 61.2 GiB")
KV_LOG_LINES = {
    "sglang": re.compile(r"KV size: ([0-9.]+) GB"),
    "vllm": re.compile(r"Available KV cache memory: ([0-9.]+) GiB"),
}
#: a line of the speculative draft model's pool, logged after the target's (SGLang's kv_pool_runtime.py:
#: "Post-capture KV sizing: draft KV cache allocated. ... KV size: 1.20 GB"): not the pool to plan for
DRAFT_LINE = "draft KV cache"
#: the largest size a plan takes, in bytes (int64's: what every engine and the kernel count sizes in)
MAX_BYTES = (1 << 63) - 1
#: the most of --tp, --dp or --nnodes a plan takes, and the most ranks it puts on one host (the plan counts
#: every rank of a host)
MAX_PARALLEL = 4096
MAX_RANKS_PER_HOST = 1024
#: a placement file is a few lines of TOML; what is read of an engine log at a time (a line, at most)
MAX_PLACEMENT_BYTES = 1 << 20
LOG_CHUNK = 1 << 20
KV_POOL_HELP = (
    "the device KV pool per rank as the engine logs it at start-up (SGLang: 'KV Cache is allocated ... KV size: "
    "X GB'; vLLM: 'Available KV cache memory: X GiB'): pass --kv-pool-gib X or --engine-log FILE"
)


@dataclass(frozen=True)
class Table:
    layer: int
    name: str
    rows: int
    row_bytes: int = ROW_BYTES


def catalog(path: str | None = None) -> tuple[list[Table], str]:
    """The Engram tables to plan for and where they come from: a table file's catalog, or DeepSeek-V4.1's."""
    if path is None:
        tables = [Table(layer, f"engram.layer{layer}", rows) for layer, rows in sorted(TABLE_ROWS.items())]
        return tables, "DeepSeek-V4.1 (tableserver/common/model.py)"
    from tableserver.tables.tablefile import read_header

    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = stat.S_IFREG  # read_header says what is wrong, in its words
    if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):  # a FIFO's open would wait for a writer for ever
        raise ConfigError(f"--tables {path}: not a file nor a block device: pass the table file")
    header = read_header(path)  # TableFileError: one line naming the file's problem
    tables = [Table(t.layer, t.name, t.rows, t.row_bytes) for t in header.tables if t.layer >= 0]
    if not tables:
        raise ConfigError(f"{path} holds no Engram layer's table (none has a layer): pass the model's table file")
    return sorted(tables, key=lambda t: t.layer), f"{path}'s catalog"


def size_problem(gib: float, zero: bool = False) -> str | None:
    """What is wrong with ``gib`` GiB as a size (finite, above 0 or, where ``zero``, 0; at least a byte; at
    most ``MAX_BYTES``), or None."""
    if not math.isfinite(gib):
        return "not a finite number"
    if gib < 0 or (gib == 0 and not zero):
        return "zero bytes" if gib == 0 else "below zero"
    if gib * GIB >= MAX_BYTES:
        return "more than the 8 EiB (2^63 - 1 bytes) a size may be"
    if 0 < gib * GIB < 1:
        return "less than a byte"
    return None


def flag_bytes(flag: str, gib: float, zero: bool = False) -> int:
    """``flag``'s ``gib`` GiB in bytes; ConfigError naming the flag, its value and the problem otherwise."""
    problem = size_problem(gib, zero)
    if problem:
        raise ConfigError(f"{flag} {gib:g}: {problem}: expected a size in GiB {'of 0 or more' if zero else 'above 0'}")
    return int(gib * GIB)


def _open_regular(flag: str, path: str, fix: str):
    """``path`` opened for reading in binary, if it is a regular file (a FIFO or a device would never end or
    never answer); else ConfigError naming ``flag``, ending in ``fix``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: {e.strerror}: {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{flag} {path}: not a regular file: {fix}")
    return os.fdopen(fd, "rb")


def parse_placement(spec: str) -> tuple[dict[int, str], str | None]:
    """``1=remote,14=node``, or the path of a placement TOML (``make replay``'s placement.toml, the plugins'
    configuration: its ``[layers]``). Returns ({layer: placement}, the file or None); empty: every layer remote."""
    if not spec.strip():
        return {}, None
    if "=" not in spec:
        try:
            with _open_regular("--placement", spec, "pass a placement.toml or LAYER=PLACEMENT pairs") as f:
                text = f.read(MAX_PLACEMENT_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"--placement {spec}: {e.strerror}") from None
        if len(text) > MAX_PLACEMENT_BYTES:
            raise ConfigError(f"--placement {spec}: over {MAX_PLACEMENT_BYTES >> 20} MiB: not a placement.toml")
        try:
            doc = tomllib.loads(text.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"--placement {spec}: not UTF-8 text: pass a placement.toml") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--placement {spec}: not valid TOML ({e})") from None
        layers, path = doc.get("layers", {}), spec
        if not isinstance(layers, dict):
            raise ConfigError(
                f"--placement {spec}: 'layers' is {type(layers).__name__} {layers!r:.40}, not a table: write "
                '[layers] with a line LAYER = "remote" | "node" | "local" each (e.g. 14 = "node")'
            )
    else:
        layers, path = dict(item.partition("=")[::2] for item in spec.split(",") if item.strip()), None
    out = {}
    for key, placement in layers.items():
        try:
            layer = int(str(key).strip())
        except ValueError:
            raise ConfigError(f"--placement: {key!r} is not a layer number (expected e.g. 1=remote,14=node)") from None
        if str(placement).strip() not in PLACEMENTS:
            raise ConfigError(f"--placement: layer {layer} = {placement!r}: use one of {', '.join(PLACEMENTS)}")
        out[layer] = str(placement).strip()
    return out, path


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """This host's MemTotal."""
    total = proc_kib(meminfo, "MemTotal")
    if not total:
        raise ConfigError(f"cannot read MemTotal from {meminfo}: pass --host-memory-gib")
    return total


def kv_pool_from_log(engine: str, path: str) -> int:
    """The last device KV pool figure the engine logged in ``path``, in bytes (read a line, or a MiB, at a
    time: a log of any size)."""
    last = None
    try:
        with _open_regular("--engine-log", path, "pass the engine's log file, or --kv-pool-gib") as f:
            while chunk := f.readline(LOG_CHUNK):
                text = chunk.decode("utf-8", "replace")
                for found in () if DRAFT_LINE in text else KV_LOG_LINES[engine].finditer(text):
                    last = found
    except OSError as e:
        raise ConfigError(f"--engine-log {path}: {e.strerror}") from None
    if last is None:
        raise ConfigError(f"--engine-log {path}: no device KV pool line of {engine} in it: {KV_POOL_HELP}")
    try:
        gib = float(last.group(1))
    except ValueError:
        gib, problem = 0.0, "holds no number"
    else:
        problem = size_problem(gib)
        problem = problem and f"is {problem}"
    if problem:
        raise ConfigError(
            f"--engine-log {path}: its last device KV pool line {last.group(0)!r} {problem}: pass the pool as "
            "--kv-pool-gib X"
        )
    return int(gib * GIB)


@dataclass(frozen=True)
class PlanRequest:
    parallel: Parallel
    placement: dict  # layer -> remote | node | local (a layer not named: remote, the plugins' default)
    host_bytes: int
    kv_pool_bytes: int  # device KV pool per rank
    tables: list = field(default_factory=lambda: catalog()[0])
    home: str = "auto"  # where the engine keeps a local layer's table; auto: its default
    other_bytes: int = 0  # other memory resident on the host (beside tables, staging, KV cache)
    staging_tokens: int = STAGING_TOKENS
    placement_file: str | None = None
    address: str = "memnode:7070"
    model: str = DEFAULT_MODEL
    model_label: str = "DeepSeek-V4.1"
    host_label: str = "--host-memory-gib"


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not reached (an earlier check failed)
    detail: str


@dataclass
class LaunchPlan:
    request: PlanRequest
    home: str
    rows: list  # (table, placement, engine default bytes, placement bytes) per layer
    staging: int  # on this host
    checks: list
    error: str | None = None
    ratio: float = 0.0  # SGLang's --hicache-ratio
    baseline_ratio: float = 0.0  # the same with the engine's own tables on the host
    offload_gib: float = 0.0  # vLLM's --kv-offloading-size
    baseline_offload_gib: float = 0.0
    host_kv_per_rank: int = 0
    baseline_host_kv_per_rank: int = 0  # the same with the engine's own tables on the host
    baseline_useful: bool = False  # whether the baseline's host KV would be above the device pool
    env: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)
    command: str = ""

    @property
    def fits(self) -> bool:
        return self.error is None

    @property
    def engine_tables(self) -> int:
        return sum(r[2] for r in self.rows)

    @property
    def placed_tables(self) -> int:
        return sum(r[3] for r in self.rows)

    @property
    def freed(self) -> int:
        return self.engine_tables - self.placed_tables

    def to_json(self) -> dict:
        r, p = self.request, self.request.parallel
        return {
            "engine": p.engine,
            "model": r.model,
            "tp": p.tp,
            "dp": p.dp,
            "nnodes": p.nnodes,
            "dp_attention": p.dp_attention,
            "ranks_per_host": p.ranks_per_host,
            "host_memory_bytes": r.host_bytes,
            "kv_pool_bytes_per_rank": r.kv_pool_bytes,
            "engine_table_home": self.home,
            "tables": [
                {
                    "layer": t.layer,
                    "table": t.name,
                    "rows": t.rows,
                    "placement": placement,
                    "engine_default_bytes": default,
                    "placement_bytes": placed,
                }
                for t, placement, default, placed in self.rows
            ],
            "engine_default_table_bytes": self.engine_tables,
            "placement_table_bytes": self.placed_tables,
            "staging_bytes": self.staging,
            "freed_bytes": self.freed,
            "host_kv_bytes_per_rank": self.host_kv_per_rank,
            "baseline_host_kv_bytes_per_rank": self.baseline_host_kv_per_rank,
            "baseline_host_kv_above_device": self.baseline_useful,
            **(
                {"hicache_ratio": self.ratio, "baseline_hicache_ratio": self.baseline_ratio}
                if p.engine == "sglang"
                else {
                    "kv_offloading_size_gib": self.offload_gib,
                    "baseline_kv_offloading_size_gib": self.baseline_offload_gib,
                }
            ),
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "fits": self.fits,
            "error": self.error,
            "env": self.env,
            "flags": self.flags,
            "command": self.command,
        }


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _floor(x: float, step: float) -> float:
    return math.floor(x / step + 1e-9) * step


def host_kv_budget(host: int, used: int, ranks: int) -> tuple[int, int]:
    """(what the engine's check grants each rank: SGLang's host_memory_budget_bytes, the host's memory after
    ``used`` and the reserve, split among the ranks; what the plan sizes each rank's host KV to: that, times
    the host-memory fraction). Negative where the reserve is not left."""
    hard = (host - used - RESERVE_BYTES) // ranks
    return hard, int(hard * HOST_FRACTION)


def size_host_kv(p: Parallel, budget: int, kv_pool: int) -> tuple[float, int]:
    """The engine's flag value for ``budget`` bytes of host KV per rank, and what it makes each rank ask:
    SGLang's ratio (2 decimals, down; its 5% slack kept free), vLLM's GiB per engine (1 decimal, down)."""
    if budget <= 0:
        return 0.0, 0
    if p.engine == "sglang":
        ratio = round(_floor(budget * (1 - SLACK) / kv_pool, 0.01), 2)
        return ratio, int(ratio * kv_pool)
    size = round(_floor(budget * p.ranks_per_engine / GIB, 0.1), 1)
    return size, int(size * GIB) // p.ranks_per_engine


def make_plan(req: PlanRequest) -> LaunchPlan:
    """The plan for ``req``; ``error`` says in one line why it cannot fit (the checks say which failed)."""
    p = req.parallel
    _check_bounds(req)
    home = default_home(p) if req.home == "auto" else req.home
    try:
        check_home(p, home)
    except ValueError as e:
        raise ConfigError(f"--engine-tables {home}: {e}") from None
    known = {t.layer for t in req.tables}
    unknown = sorted(set(req.placement) - known)
    if unknown:
        raise ConfigError(
            f"the placement names layer {unknown[0]}, which has no Engram table in this model (it has "
            f"{', '.join(map(str, sorted(known)))}): fix the placement"
        )
    rows = []
    for t in req.tables:
        where = req.placement.get(t.layer, "remote")
        rows.append((t, where, engine_bytes(p, home, t.rows, t.row_bytes),
                     placed_bytes(p, home, where, t.rows, t.row_bytes)))  # fmt: skip
    served = sum(1 for _, where, _, _ in rows if where != "local")
    row_bytes = max(t.row_bytes for t in req.tables)
    staging = staging_bytes(p, served, req.staging_tokens, row_bytes) * p.ranks_per_host
    plan = LaunchPlan(req, home, rows, staging, [])
    ranks = p.ranks_per_host

    engine = "SGLang" if p.engine == "sglang" else "vLLM"
    used = plan.placed_tables + staging + req.other_bytes
    hard, budget = host_kv_budget(req.host_bytes, used, ranks)
    value, request = size_host_kv(p, budget, req.kv_pool_bytes)
    _, base_budget = host_kv_budget(req.host_bytes, plan.engine_tables + req.other_bytes, ranks)
    base_value, base_request = size_host_kv(p, base_budget, req.kv_pool_bytes)
    plan.baseline_host_kv_per_rank, plan.baseline_useful = base_request, base_request > req.kv_pool_bytes
    if p.engine == "sglang":
        plan.ratio, plan.baseline_ratio = value, base_value
    else:
        plan.offload_gib, plan.baseline_offload_gib = value, base_value
    plan.host_kv_per_rank = request

    reserve_rule = (
        "SGLang's 10 GiB reserve (mem_cache/pool_host/base.py)"
        if p.engine == "sglang"
        else "SGLang's 10 GiB reserve, kept for vLLM (which checks none)"
    )
    share = "host_memory_budget_bytes" if p.engine == "sglang" else "the plan's share"
    fix = "plan for a host with more memory (--host-memory-gib)"
    if any(where != "remote" for _, where, _, _ in rows):
        fix = "place more layers remote, or " + fix
    checks = [
        (
            "tables",
            used <= req.host_bytes,
            f"tables {gib(plan.placed_tables)} + plugin staging {gib(staging)} + other {gib(req.other_bytes)} "
            f"= {gib(used)} of the host's {gib(req.host_bytes)}",
            f"the placement's tables and the plugin's staging ({gib(used)}) do not fit this host's "
            f"{gib(req.host_bytes)}: {fix}",
        ),
        (
            "reserve",
            req.host_bytes - used > RESERVE_BYTES,
            f"{gib(req.host_bytes - used)} left after them, against {reserve_rule}",
            f"{gib(req.host_bytes - used)} are left after the tables and the staging, not more than {reserve_rule}: "
            f"no host memory is left for KV cache: {fix}",
        ),
        (
            "rank request",
            0 < request <= hard,
            f"{ranks} rank(s) x {gib(request)} of host KV, each against its share of {gib(max(hard, 0))} "
            f"((host - tables - staging - reserve) / {ranks}: {share})",
            f"each of the {ranks} rank(s) would ask {gib(request)} but {engine}'s check grants {gib(max(hard, 0))}: {fix}",
        ),
        (
            "host above device",
            request > req.kv_pool_bytes,
            f"host KV {gib(request)} per rank against the device pool's {gib(req.kv_pool_bytes)}"
            + (f" (host pages = device pages x {plan.ratio:.2f})" if p.engine == "sglang" else ""),
            f"host KV of {gib(request)} per rank would not exceed the {gib(req.kv_pool_bytes)} device KV pool, so the "
            f"host cache would hold nothing the GPUs do not: {fix}, or run {engine} without host KV cache",
        ),
    ]
    if p.engine == "sglang":
        checks.append((
            "ratio given",
            True,
            "--hicache-ratio given: DeepSeek V4's pool cannot be auto-sized (hicache_auto_size.py) and "
            "--hicache-size is refused there (hybrid_pool_assembler.py)",
            "",
        ))  # fmt: skip
    failed = False
    for name, ok, detail, why in checks:
        plan.checks.append(Check(name, None if failed else ok, detail))
        if not failed and not ok:
            failed, plan.error = True, f"plan does not fit: {why}"
    _launch_line(plan)
    return plan


def _check_bounds(req: PlanRequest) -> None:
    """ConfigError where a request's layout or sizes are beyond what a plan is made for."""
    p = req.parallel
    for name in ("tp", "dp", "nnodes"):
        if getattr(p, name) > MAX_PARALLEL:
            raise ConfigError(f"--{name} {getattr(p, name)}: expected at most {MAX_PARALLEL}")
    if p.ranks_per_host > MAX_RANKS_PER_HOST:
        raise ConfigError(
            f"--tp {p.tp} --dp {p.dp} over --nnodes {p.nnodes} put {p.ranks_per_host} ranks on each host: a plan "
            f"takes at most {MAX_RANKS_PER_HOST} (give the hosts there are as --nnodes)"
        )
    for name, n, least in (("host memory", req.host_bytes, 1), ("device KV pool per rank", req.kv_pool_bytes, 1),
                           ("other memory", req.other_bytes, 0)):  # fmt: skip
        if not least <= n <= MAX_BYTES:
            raise ConfigError(f"{name} of {n} bytes: expected {least} to {MAX_BYTES} bytes")


def _launch_line(plan: LaunchPlan) -> None:
    req, p = plan.request, plan.request.parallel
    served = {where for _, where, _, _ in plan.rows if where != "local"}
    env = {}
    if served:
        if req.placement_file:
            var = "TABLESERVER_SGLANG_CONFIG" if p.engine == "sglang" else "TABLESERVER_VLLM_CONFIG"
            env[var] = req.placement_file
        else:
            env["TABLESERVER_PLACEMENT"] = ",".join(f"{t.layer}={where}" for t, where, _, _ in plan.rows)
        if "remote" in served:
            env["TABLESERVER_ADDRESS"] = req.address
    if p.engine == "sglang":
        flags = ["--enable-hierarchical-cache", "--hicache-ratio", f"{plan.ratio:.2f}"]
        base = ["python", "-m", "sglang.launch_server", "--model-path", req.model, "--tp", str(p.tp)]
        if p.dp > 1:  # attention DP: --attn-dp-size (0.5.23 deprecates --enable-dp-attention for it)
            base += ["--attn-dp-size" if p.dp_attention else "--dp", str(p.dp)]
        if p.nnodes > 1:
            base += ["--nnodes", str(p.nnodes)]
    else:
        flags = ["--kv-offloading-size", f"{plan.offload_gib:g}", "--kv-offloading-backend", "native"]
        base = ["vllm", "serve", req.model, "-tp", str(p.tp)] + (["-dp", str(p.dp)] if p.dp > 1 else [])
    plan.env, plan.flags = env, flags
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    line += (" " if line else "") + shlex.join(base)
    if p.engine == "vllm" and served:
        line += " " + VLLM_PIECEWISE
    plan.command = line + " " + shlex.join(flags)


def render(plan: LaunchPlan) -> str:
    """The plan as text: the tables, the checks, the host KV cache and, last, the launch line (or why not)."""
    req, p = plan.request, plan.request.parallel
    name = "SGLang" if p.engine == "sglang" else "vLLM"
    home = {
        (
            "sglang",
            "shared",
        ): "its host table (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1), layout shared: one copy per TP group",
        (
            "sglang",
            "per-rank",
        ): "its host table (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1), layout per_rank: a shard per rank",
        ("vllm", "shared"): "cpu_offload with dp_shared_memory: one /dev/shm copy per host",
        ("vllm", "per-rank"): "cpu_offload: each rank pins its shard, rounded up to powers of two",
    }.get((p.engine, plan.home), "on the GPUs, none on the host")
    layout = f"TP {p.tp} x DP {p.dp}" + (" (DP attention)" if p.dp_attention else "")
    layout += f" over {p.nnodes} hosts" if p.nnodes > 1 else ""
    out = [
        f"{req.model_label} on {name} {'0.5.23' if p.engine == 'sglang' else '0.33.0'}, {layout}: "
        f"{p.ranks_per_host} rank(s) on a host of {gib(req.host_bytes)} ({req.host_label}), device KV pool "
        f"{gib(req.kv_pool_bytes)} per rank",
        "",
        f"{'Engram tables on this host':<36}{name + ' alone':>16}   {'this placement':>22}",
    ]
    for t, where, default, placed in plan.rows:
        out.append(f"  layer {t.layer:<4}{t.name:<26}{gib(default):>16}   {where:>8}{gib(placed):>14}")
    out.append(
        f"  {'plugin staging, ' + str(p.ranks_per_host) + ' rank(s)':<34}{'-':>16}   {'':>8}{gib(plan.staging):>14}"
    )
    out.append(f"  {'total':<34}{gib(plan.engine_tables):>16}   {'':>8}{gib(plan.placed_tables + plan.staging):>14}")
    freed = plan.freed - plan.staging
    out.append(f"  {name} alone: {home}" + (" (--engine-tables auto)" if req.home == "auto" else ""))
    out.append(f"  freed by the placement: {gib(freed)}" if freed >= 0 else f"  the placement takes {gib(-freed)} more")
    out += ["", f"Checks {'SGLang makes at start-up' if p.engine == 'sglang' else 'for vLLM'}, done here first:"]
    for c in plan.checks:
        out.append(f"  {'--' if c.ok is None else 'ok' if c.ok else 'FAIL':<5}{c.name}: {c.detail}")
    out.append("")
    if p.engine == "sglang":
        value, base, unit = f"--hicache-ratio {plan.ratio:.2f}", plan.baseline_ratio, ""
    else:
        value, base, unit = (
            f"--kv-offloading-size {plan.offload_gib:g} (GiB per engine)",
            plan.baseline_offload_gib,
            " GiB",
        )
    out.append(
        f"Host KV cache: {gib(plan.host_kv_per_rank)} per rank, {value}; with {name}'s own tables on this host: "
        + (f"{base:g}{unit}" if base else "none (no room)")
        + ("" if plan.baseline_useful or not base else " (not above the device pool: of no use)")
    )
    out.append(plan.error or plan.command)
    return "\n".join(out)


def request_from_args(args) -> PlanRequest:
    """The plan's inputs from ``tableserver plan``'s flags; ConfigError naming the flag otherwise."""
    try:
        parallel = Parallel(args.engine, args.tp, args.dp, args.nnodes, args.dp_attention)
    except ValueError as e:
        raise ConfigError(f"{e}: fix --tp, --dp, --nnodes or --dp-attention") from None
    placement, path = parse_placement(args.placement)
    tables, label = catalog(args.tables or None)
    if args.kv_pool_gib is not None and args.engine_log:
        raise ConfigError("--kv-pool-gib and --engine-log both give the device KV pool: pass one")
    if args.engine_log:
        kv_pool = kv_pool_from_log(args.engine, args.engine_log)
    elif args.kv_pool_gib is not None:
        kv_pool = flag_bytes("--kv-pool-gib", args.kv_pool_gib)
    else:
        raise ConfigError(f"the plan needs {KV_POOL_HELP}")
    if args.host_memory_gib is not None:
        host = flag_bytes("--host-memory-gib", args.host_memory_gib)
        host_label = "--host-memory-gib"
    else:
        host, host_label = host_memory_bytes(), "MemTotal of this host"
    other = flag_bytes("--other-gib", args.other_gib, zero=True)
    return PlanRequest(
        parallel=parallel,
        placement=placement,
        host_bytes=host,
        kv_pool_bytes=kv_pool,
        tables=tables,
        home=args.engine_tables,
        other_bytes=other,
        placement_file=path,
        address=args.address or os.environ.get("TABLESERVER_ADDRESS") or "memnode:7070",
        model=args.model_path,
        model_label=label,
        host_label=host_label,
    )


def _count(text: str) -> int:
    """A --tp, --dp or --nnodes value: a whole number from 1 to ``MAX_PARALLEL`` (argparse's type)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_PARALLEL:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {MAX_PARALLEL}, got {text!r}")
    return n


def add_flags(parser) -> None:
    """``tableserver plan``'s flags."""
    parser.add_argument(
        "--placement",
        default="",
        metavar="FILE|PAIRS",
        help="make replay's placement.toml (or the plugins' configuration), or pairs such as 1=remote,14=node "
        "(a layer not named: remote; default: every layer remote)",
    )
    parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang", help="default %(default)s")
    parser.add_argument("--tp", type=_count, default=8, help="tensor-parallel ranks per replica (default %(default)s)")
    parser.add_argument("--dp", type=_count, default=1, help="data-parallel replicas (default %(default)s)")
    parser.add_argument("--nnodes", type=_count, default=1, help="hosts the ranks spread over (default %(default)s)")
    parser.add_argument(
        "--dp-attention", action="store_true", help="SGLang's attention DP (--attn-dp-size DP, inside the TP group)"
    )
    parser.add_argument("--kv-pool-gib", type=float, default=None, help="device KV pool per rank, GiB (as logged)")
    parser.add_argument("--engine-log", default="", metavar="FILE", help="read the device KV pool from an engine log")
    parser.add_argument(
        "--host-memory-gib", type=float, default=None, help="plan for a host of this memory (default: MemTotal here)"
    )
    parser.add_argument(
        "--other-gib", type=float, default=0.0, help="other resident memory on the host, GiB (default 0)"
    )
    parser.add_argument(
        "--engine-tables",
        choices=("auto", "device", "shared", "per-rank"),
        default="auto",
        help="where the engine keeps a local layer's table: auto is SGLang's host table (shared memfd per TP "
        "group) or vLLM's cpu_offload (one /dev/shm copy per host where DP replicas share it, else a pinned "
        "shard per rank); device: on the GPUs",
    )
    parser.add_argument(
        "--tables", default="", metavar="FILE", help="plan for a table file's catalog (default: DeepSeek-V4.1's)"
    )
    parser.add_argument(
        "--model-path", default=DEFAULT_MODEL, help="the model in the launch line (default %(default)s)"
    )
    parser.add_argument(
        "--address", default="", help="the memory node in the launch line (default TABLESERVER_ADDRESS or memnode:7070)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (for tools)")
