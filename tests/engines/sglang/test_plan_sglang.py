"""``tableserver plan``'s SGLang launch line, checked by the released SGLang 0.5.23's own code on the CPU.

The plan's printed command is split as a shell would, its flags parsed by SGLang's own parser
(``ServerArgs.add_cli_args``) for a DeepSeek-V4.1-shaped model directory and resolved by SGLang's own
resolution pipeline (``ServerArgs.resolve_once``). Then, with those resolved arguments published as SGLang's
scheduler publishes them, SGLang's DeepSeek V4 host-pool sizing (``_deepseek_v4_num_host_pages``) runs on the
planned device pages and SGLang's host-memory check (``host_memory_budget_bytes``: its 10 GiB reserve, split
among the host's ranks) on the planned host. A plan SGLang would refuse fails here; a plan the command refuses
is one SGLang would refuse too. The alternatives the plan avoids (``--hicache-size``, auto-sizing) are shown
refused by SGLang's own code.
"""

from __future__ import annotations

import argparse
import json
import shlex
import types

import pytest
import torchvision_cpu  # noqa: F401  (before sglang: torchvision on a CPU torch)
from conftest import run_cli
from dsv41_model import write_model_dir
from engine_skip import require_engine

ServerArgs = require_engine("sglang.srt.server_args").ServerArgs
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: E402
from sglang.srt.mem_cache.pool_host import base as pool_host  # noqa: E402
from sglang.srt.runtime_context import get_context, get_memory  # noqa: E402

GIB = 1 << 30
#: device pages the checks run on: a 40 GiB pool of 256-token pages at about 4.5 KiB of KV per token
PAGE, SWA_PAGE, FULL_TOKENS = 256, 128, 9_000_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("dsv41")))


def plan(*args) -> dict:
    res = run_cli("plan", "--engine", "sglang", "--json", *args)
    assert res.returncode in (0, 1), res.stderr
    return json.loads(res.stdout)


def sglang_args(command: str, model_dir: str) -> list[str]:
    """The SGLang arguments of the plan's launch line, with the test's model directory."""
    argv = shlex.split(command)
    argv = argv[argv.index("sglang.launch_server") + 1 :]
    argv[argv.index("--model-path") + 1] = model_dir
    return argv + ["--device", "cpu"]


def resolved(argv: list[str]) -> ServerArgs:
    """SGLang's own parsing and resolution of ``argv`` (what sglang.launch_server does, without its logging)."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    args.resolve_once()
    return args


class published:
    """``args`` published as SGLang's runtime context, restored after (its override_server_args saves the rest)."""

    def __init__(self, args: ServerArgs):
        self.args, self.saved = args, get_context().override_server_args()

    def __enter__(self):
        self.saved.install()
        get_context().set_server_args(self.args)
        return get_memory()

    def __exit__(self, *exc):
        self.saved.restore()


def v4_pool(full_tokens: int = FULL_TOKENS):
    """SGLang's DeepSeekV4TokenToKVPool with the planned sizes (SGLang's own stubs skip __init__ likewise)."""
    pool = object.__new__(DeepSeekV4TokenToKVPool)
    pool.size, pool.swa_size = full_tokens, full_tokens // 8
    params = types.SimpleNamespace(token_to_kv_pool_allocator=types.SimpleNamespace(size_full=full_tokens))
    return pool, params


def host_budget(monkeypatch, plan: dict) -> int:
    """SGLang's per-rank host budget (host_memory_budget_bytes) on the planned host: what is available when
    HiCache allocates (the host less the placement's tables, the plugin's staging), the planned ranks."""
    available = plan["host_memory_bytes"] - plan["placement_table_bytes"] - plan["staging_bytes"]
    monkeypatch.setattr(pool_host, "available_host_memory_bytes", lambda **_: available)
    monkeypatch.setattr(pool_host, "ranks_per_host", lambda: plan["ranks_per_host"])
    return pool_host.host_memory_budget_bytes()


@pytest.mark.parametrize(
    "layout",
    [
        ("--placement", "1=remote,14=node", "--tp", "8", "--host-memory-gib", "1024"),
        ("--placement", "1=local,14=remote", "--tp", "4", "--dp", "2", "--host-memory-gib", "2048"),
        ("--tp", "8", "--dp", "8", "--dp-attention", "--host-memory-gib", "768"),
    ],
)
def test_the_plans_flags_are_what_sglang_accepts_and_sizes(model_dir, monkeypatch, layout):
    got = plan("--kv-pool-gib", "40", *layout)
    assert got["fits"], got["error"]
    args = resolved(sglang_args(got["command"], model_dir))
    settings = args.resolved_dict()
    assert settings["enable_hierarchical_cache"] and settings["hicache_ratio"] == got["hicache_ratio"]
    # an explicit ratio turns SGLang's auto-sizing off (its fraction resolves to None); no --hicache-size
    assert settings["hicache_host_memory_fraction"] is None and settings["hicache_size"] == 0
    assert settings["tp_size"] == got["tp"]
    assert (settings["attn_dp_size"], settings["dp_size"]) == (
        (got["dp"], 1) if got["dp_attention"] else (1, got["dp"])
    )

    with published(args) as memory:
        assert memory.hicache_ratio == got["hicache_ratio"]
        pool, params = v4_pool()
        full, swa, _ = hybrid_pool_assembler._deepseek_v4_num_host_pages(
            params=params, kvcache=pool, page_size=PAGE, swa_page_size=SWA_PAGE
        )
    assert full > FULL_TOKENS // PAGE and swa > pool.swa_size // SWA_PAGE  # host pages above device pages
    budget = host_budget(monkeypatch, got)
    assert got["host_kv_bytes_per_rank"] <= budget  # every rank's request within SGLang's check
    assert got["host_kv_bytes_per_rank"] * (1 + 0.05) <= budget  # with SGLang's allocation slack to spare


def test_a_plan_the_command_refuses_sglang_would_refuse(monkeypatch):
    """On a host whose memory after SGLang's reserve cannot hold more than the device pool per rank, the plan
    stops (exit 1, one line); SGLang's own budget there is below the device pool, so no ratio above 1 fits."""
    res = run_cli("plan", "--engine", "sglang", "--kv-pool-gib", "40", "--host-memory-gib", "256")
    assert res.returncode == 1
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("tableserver: error: plan does not fit: ") and "device KV pool" in line, res.stderr
    got = plan("--kv-pool-gib", "40", "--host-memory-gib", "256")
    assert not got["fits"] and got["checks"][3]["name"] == "host above device" and not got["checks"][3]["ok"]
    assert host_budget(monkeypatch, got) < got["kv_pool_bytes_per_rank"]


def test_the_alternatives_the_plan_avoids_are_refused_by_sglang(model_dir):
    """Why the plan prints --hicache-ratio: on the DeepSeek V4 path SGLang refuses --hicache-size, and without a
    ratio its auto-sizing refuses the DeepSeek V4 pool (deployers' crash loops)."""
    from sglang.srt.mem_cache.hicache_auto_size import auto_size_hicache

    base = ["--model-path", model_dir, "--device", "cpu", "--tp", "8", "--enable-hierarchical-cache"]
    pool, params = v4_pool()
    with published(resolved(base + ["--hicache-size", "100"])):
        with pytest.raises(ValueError, match="does not support --hicache-size; use --hicache-ratio"):
            hybrid_pool_assembler._deepseek_v4_num_host_pages(
                params=params, kvcache=pool, page_size=PAGE, swa_page_size=SWA_PAGE
            )
    auto = types.SimpleNamespace(
        token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=None,
        mtp_draft_device_pools=(),
    )
    with published(resolved(base)) as memory:
        assert memory.hicache_host_memory_fraction == 0.8  # no ratio given: SGLang would auto-size
        with pytest.raises(ValueError, match="auto-sizing does not support DeepSeekV4TokenToKVPool"):
            with auto_size_hicache(auto, None, enabled=True):
                pass
