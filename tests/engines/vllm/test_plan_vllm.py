"""``tableserver plan``'s vLLM launch line, checked by the released vLLM 0.33.0's own code on the CPU.

The plan's printed command is split as a shell would and its arguments parsed by vLLM's own parser
(``EngineArgs.add_cli_args``) for a DeepSeek-V4.1-shaped model directory; ``EngineArgs.create_engine_config``
then builds the ``VllmConfig`` ``vllm serve`` would run with. The host KV flags must come out as vLLM's native
CPU offloading of the planned size (``VllmConfig._post_init_kv_transfer_config``: the ``OffloadingConnector``
with ``cpu_bytes_to_use``), split over the engine's ranks as the plan says each rank asks, and vLLM's own
resolution of its Engram tables (``EngramConfig.resolve_dp_shared_memory``) must be the default the plan
counted the freed memory against.

vLLM decides its platform once per process: this runs in a fresh interpreter on vLLM's CPU platform
(``VLLM_TARGET_DEVICE=cpu``), so the other vLLM tests of this session keep theirs.
"""

from __future__ import annotations

import json
import shlex

from conftest import run_cli
from engine_skip import require_engine
from tests_helpers import run_fresh

require_engine("vllm")

GIB = 1 << 30
LAYOUTS = [
    ("--placement", "1=remote,14=node", "--tp", "8", "--host-memory-gib", "1024"),
    ("--tp", "4", "--dp", "2", "--host-memory-gib", "1024"),
    ("--placement", "1=local,14=remote", "--tp", "2", "--dp", "4", "--host-memory-gib", "2048"),
]
#: vLLM's own parsing and configuration of each argv in ARGVS (the model directory in MODEL)
BUILD = """
import json, os
from dsv41_model import write_model_dir
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm_cpu import model_class_inspected_here

model = write_model_dir(os.environ["PLAN_MODEL"])
out = []
for argv in json.loads(os.environ["PLAN_ARGVS"]):
    argv[argv.index("MODEL")] = model
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    with model_class_inspected_here():  # not in a process of its own: no GPU here (tests/support/vllm_cpu.py)
        cfg = EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
    kv = cfg.kv_transfer_config
    out.append({
        "connector": kv.kv_connector, "role": kv.kv_role, "cpu_bytes": kv.kv_connector_extra_config["cpu_bytes_to_use"],
        "offloading_size": cfg.cache_config.kv_offloading_size, "backend": cfg.cache_config.kv_offloading_backend,
        "world_size": cfg.parallel_config.world_size, "tp": cfg.parallel_config.tensor_parallel_size,
        "dp": cfg.parallel_config.data_parallel_size, "cpu_offload": cfg.engram_config.cpu_offload,
        "dp_shared_memory": cfg.engram_config.dp_shared_memory,
    })
print("RESULT " + json.dumps(out))
"""


def plan(*args) -> dict:
    res = run_cli("plan", "--engine", "vllm", "--json", *args)
    assert res.returncode in (0, 1), res.stderr
    return json.loads(res.stdout)


def vllm_args(command: str) -> list[str]:
    """The arguments of ``vllm serve`` in the plan's launch line, the model directory left to fill in."""
    argv = shlex.split(command)
    argv = argv[argv.index("serve") + 1 :]
    return ["--model", "MODEL"] + argv[1:]


def test_the_plans_flags_are_what_vllm_builds_its_config_from(tmp_path):
    plans = [plan("--kv-pool-gib", "60", *layout) for layout in LAYOUTS]
    assert all(p["fits"] for p in plans), [p["error"] for p in plans]
    argvs = [vllm_args(p["command"]) for p in plans]
    env = {"VLLM_TARGET_DEVICE": "cpu", "PLAN_MODEL": str(tmp_path / "dsv41"), "PLAN_ARGVS": json.dumps(argvs)}
    res = run_fresh(BUILD, env, prelude="vllm_cpu")
    results = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and results, res.stderr[-3000:]
    for got, want in zip(json.loads(results[-1].removeprefix("RESULT ")), plans):
        assert (got["connector"], got["role"], got["backend"]) == ("OffloadingConnector", "kv_both", "native")
        assert got["offloading_size"] == want["kv_offloading_size_gib"]
        assert got["cpu_bytes"] == want["kv_offloading_size_gib"] * GIB
        # vLLM's size is the engine's, over its ranks: each rank asks what the plan says, above its device pool
        assert (got["tp"], got["dp"], got["world_size"]) == (want["tp"], want["dp"], want["tp"])
        assert got["cpu_bytes"] // got["world_size"] == want["host_kv_bytes_per_rank"]
        assert want["host_kv_bytes_per_rank"] > want["kv_pool_bytes_per_rank"]
        # the tables the plan counted as freed are where vLLM's own default keeps them
        assert got["cpu_offload"] and got["dp_shared_memory"] == (want["engine_table_home"] == "shared")


def test_a_plan_that_cannot_fit_stops_in_one_line():
    """vLLM itself checks no host memory for --kv-offloading-size (it would pin what it is told): the plan
    keeps SGLang's reserve for it and stops where the host cannot hold more than the device pool."""
    res = run_cli("plan", "--engine", "vllm", "--kv-pool-gib", "60", "--tp", "8", "--host-memory-gib", "300")
    assert res.returncode == 1
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("tableserver: error: plan does not fit: ") and "without host KV cache" in line, res.stderr
