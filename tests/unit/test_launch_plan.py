"""``tableserver plan``: the memory a placement frees, the host KV flags, the checks and the one-line refusals
(pure logic; the engines' own code checks the flags in tests/engines/*/test_plan_*.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import ROOT, run_cli

from tableserver.cli import main
from tableserver.common.hostmem import GIB, Parallel
from tableserver.errors import ConfigError
from tableserver.ops.launch_plan import (
    RESERVE_BYTES,
    PlanRequest,
    kv_pool_from_log,
    make_plan,
    parse_placement,
    render,
)

sys.path.insert(0, os.path.join(ROOT, "bench"))
from replay import placement_toml  # noqa: E402


def request(engine="sglang", placement=None, tp=8, dp=1, host_gib=1024, kv_gib=40, **kw) -> PlanRequest:
    return PlanRequest(Parallel(engine, tp, dp), placement or {}, int(host_gib * GIB), int(kv_gib * GIB), **kw)


def test_sglang_ratio_grows_by_the_freed_memory():
    plan = make_plan(request(placement={1: "remote", 14: "node"}))
    assert plan.fits and plan.home == "shared"
    assert plan.engine_tables == 202_758_032_400 and plan.placed_tables == 101_380_404_048  # layer 14 on the node
    assert plan.freed == 101_377_628_352  # layer 1's one copy
    # (1024 GiB - 94.4 tables - 3 staging - 10 reserve) * 0.8 / 8 ranks * 0.95 / 40 GiB
    assert plan.ratio == 2.17 and plan.baseline_ratio == 1.95
    assert plan.flags == ["--enable-hierarchical-cache", "--hicache-ratio", "2.17"]
    assert plan.command == (
        "TABLESERVER_PLACEMENT=1=remote,14=node TABLESERVER_ADDRESS=memnode:7070 python -m sglang.launch_server "
        "--model-path deepseek-ai/DeepSeek-V4.1-Flash --tp 8 --enable-hierarchical-cache --hicache-ratio 2.17"
    )
    assert "--hicache-size" not in plan.command  # refused on SGLang's DeepSeek V4 path
    assert [c.ok for c in plan.checks] == [True] * 5
    text = render(plan)
    assert text.splitlines()[-1] == plan.command and "freed by the placement: 91.4 GiB" in text


def test_vllm_size_is_per_engine_over_its_ranks():
    plan = make_plan(request("vllm", tp=4, dp=2, kv_gib=60))
    assert plan.fits and plan.home == "shared" and plan.offload_gib == 405.5
    assert plan.host_kv_per_rank == int(405.5 * GIB) // 4
    assert plan.command.endswith(
        "vllm serve deepseek-ai/DeepSeek-V4.1-Flash -tp 4 -dp 2 --compilation-config "
        """'{"cudagraph_mode": "PIECEWISE"}' --kv-offloading-size 405.5 --kv-offloading-backend native"""
    )
    local = make_plan(request("vllm", placement={1: "local", 14: "local"}, tp=4, dp=2, kv_gib=60))
    assert "PIECEWISE" not in local.command and "TABLESERVER_" not in local.command  # no layer served: no plugin


def test_vllm_per_rank_pinned_tables_free_more_than_their_bytes():
    plan = make_plan(request("vllm", tp=8, kv_gib=60, host_gib=768))
    assert plan.home == "per-rank" and plan.freed == 264 * GIB  # the pinned allocator's powers of two
    # with vLLM's own tables this host would give 49 GiB a rank, not above the 60 GiB device pool
    assert plan.baseline_offload_gib == 395.1 and not plan.baseline_useful
    assert plan.fits and plan.offload_gib == 606.2
    assert "395.1 GiB (not above the device pool: of no use)" in render(plan)


def test_every_check_is_made_and_the_first_failure_is_the_line():
    no_room = make_plan(request(placement={1: "node", 14: "local"}, host_gib=150))
    assert not no_room.fits and [c.ok for c in no_room.checks] == [False, None, None, None, None]
    assert no_room.error.startswith("plan does not fit: the placement's tables and the plugin's staging")
    assert "place more layers remote" in no_room.error

    reserve = make_plan(request(host_gib=12))
    assert [c.ok for c in reserve.checks][:2] == [True, False] and "10 GiB reserve" in reserve.error
    assert "place more layers remote" not in reserve.error  # every layer is remote already

    small = make_plan(request(host_gib=256))  # 29 GiB a rank for host KV: not above the 40 GiB device pool
    assert [c.ok for c in small.checks][:4] == [True, True, True, False]
    assert "would not exceed the 40.0 GiB device KV pool" in small.error and "\n" not in small.error
    assert render(small).splitlines()[-1] == small.error


def test_the_reserve_is_sglangs_and_other_memory_counts():
    assert RESERVE_BYTES == 10 * GIB
    base = make_plan(request())
    crowded = make_plan(request(other_bytes=200 * GIB))
    assert crowded.ratio < base.ratio


def test_placement_from_make_replays_file_and_pairs(tmp_path):
    path = tmp_path / "placement.toml"
    path.write_text(placement_toml({1: "shm", 14: "tcp"}, 64, {1: {"shm": 0.0}, 14: {"tcp": 0.0}}))
    assert parse_placement(str(path)) == ({1: "node", 14: "remote"}, str(path))
    assert parse_placement("1=local, 14=remote") == ({1: "local", 14: "remote"}, None)
    assert parse_placement("") == ({}, None)
    plan = make_plan(request(placement={1: "node", 14: "remote"}, placement_file=str(path)))
    assert f"TABLESERVER_SGLANG_CONFIG={path}" in plan.command
    for bad, msg in (("1=far", "use one of remote, node, local"), ("x=node", "not a layer number")):
        with pytest.raises(ConfigError, match=msg):
            parse_placement(bad)
    with pytest.raises(ConfigError, match="names layer 7"):
        make_plan(request(placement={7: "remote"}))


def test_device_pool_from_the_engines_log(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("x\nKV Cache is allocated. dtype: torch.uint8, #tokens: 9000000, KV size: 38.62 GB\n")
    assert kv_pool_from_log("sglang", str(log)) == int(38.62 * GIB)
    log.write_text("INFO [gpu_worker.py:773] Available KV cache memory: 61.2 GiB\n")
    assert kv_pool_from_log("vllm", str(log)) == int(61.2 * GIB)
    with pytest.raises(ConfigError, match="no device KV pool line of sglang"):
        kv_pool_from_log("sglang", str(log))
    # the target's pool, not the speculative draft's logged after it (SGLang's kv_pool_runtime.py)
    log.write_text(
        "Post-capture KV sizing: KV cache allocated. dtype: torch.uint8, #tokens: 9000000, KV size: 38.62 GB, "
        "avail mem=3.10 GB\nPost-capture KV sizing: draft KV cache allocated. dtype: torch.uint8, #tokens: 9000000, "
        "KV size: 1.20 GB\n"
    )
    assert kv_pool_from_log("sglang", str(log)) == int(38.62 * GIB)


def test_the_command(capsys):
    args = ["plan", "--placement", "1=remote,14=node", "--kv-pool-gib", "40", "--host-memory-gib", "1024"]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].endswith("--hicache-ratio 2.17") and out[-1].startswith("TABLESERVER_PLACEMENT=")
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["hicache_ratio"] == 2.17 and doc["freed_bytes"] == 101_377_628_352
    assert main(["plan", "--kv-pool-gib", "40", "--host-memory-gib", "256", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["plan", "--kv-pool-gib", "40", "--host-memory-gib", "256"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tableserver: error: plan does not fit: ")
    for argv, msg in (
        (["plan"], "needs the device KV pool per rank"),
        (["plan", "--kv-pool-gib", "40", "--tp", "3", "--nnodes", "2"], "do not spread evenly"),
        (["plan", "--kv-pool-gib", "-1"], "expected a size in GiB above 0"),
        (["plan", "--kv-pool-gib", "40", "--engine", "vllm", "--engine-tables", "shared"], "dp_shared_memory"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


GOOD = ("--kv-pool-gib", "40", "--host-memory-gib", "1024")
#: every figure a size flag takes as a float that is no size: (value, the problem the line names)
NOT_SIZES = [
    ("inf", "not a finite number"),
    ("nan", "not a finite number"),
    ("1e300", "more than the 8 EiB (2^63 - 1 bytes) a size may be"),
    ("1e-12", "less than a byte"),
]


def refused(*argv: str, code: int = 2) -> str:
    """``tableserver plan ARGV`` in its own process: exit ``code``, one ``tableserver: error:`` line on stderr
    and nothing else (no traceback); the line."""
    res = run_cli("plan", *argv)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code and len(lines) == 1 and lines[0].startswith("tableserver: error: "), res.stderr
    return lines[0].removeprefix("tableserver: error: ")


@pytest.mark.parametrize("flag", ["--kv-pool-gib", "--host-memory-gib", "--other-gib"])
@pytest.mark.parametrize("value,problem", NOT_SIZES, ids=[v for v, _ in NOT_SIZES])
def test_a_size_flag_takes_only_a_size(flag, value, problem):
    """Before: inf and 1e300 ended in an OverflowError, nan in a ValueError (--other-gib), a sub-byte pool in a
    ZeroDivisionError and a sub-byte host in a plan for a host of 0 bytes."""
    args = dict(zip(GOOD[::2], GOOD[1::2]))
    args[flag] = value
    line = refused(*(x for kv in args.items() for x in kv))
    above = "of 0 or more" if flag == "--other-gib" else "above 0"
    assert line == f"{flag} {float(value):g}: {problem}: expected a size in GiB {above}"


def test_zero_is_a_size_only_where_nothing_is_one(capsys):
    assert refused("--kv-pool-gib", "0") == "--kv-pool-gib 0: zero bytes: expected a size in GiB above 0"
    assert refused(*GOOD[:2], "--host-memory-gib", "0").startswith("--host-memory-gib 0: zero bytes")
    assert main(["plan", *GOOD, "--other-gib", "0"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "engine,line,problem",
    [
        ("sglang", "KV size: . GB", "holds no number"),
        ("sglang", "KV size: 0.00 GB", "is zero bytes"),
        ("sglang", "KV size: 1.2.3 GB", "holds no number"),
        ("sglang", "KV size: 99999999999 GB", "is more than the 8 EiB (2^63 - 1 bytes) a size may be"),
        ("vllm", "Available KV cache memory: 0.0000000001 GiB", "is less than a byte"),
    ],
    ids=["dot", "zero", "two-dots", "beyond-int64", "sub-byte"],
)
def test_an_engine_log_line_that_gives_no_pool_is_said(tmp_path, engine, line, problem):
    """Before: 'KV size: . GB' ended in a ValueError, 'KV size: 0.00 GB' in a ZeroDivisionError (a plan for a
    0-byte pool). The last line is the one the engine ran with: an earlier good one does not stand in."""
    log = tmp_path / "engine.log"
    good = "KV size: 40.00 GB" if engine == "sglang" else "Available KV cache memory: 40.0 GiB"
    log.write_text(f"INFO {good}\nINFO {line}\n")
    got = refused("--engine", engine, "--engine-log", str(log), "--host-memory-gib", "1024")
    assert (
        got == f"--engine-log {log}: its last device KV pool line {line!r} {problem}: pass the pool as --kv-pool-gib X"
    )


def test_an_engine_log_is_read_a_line_at_a_time(tmp_path):
    log = tmp_path / "engine.log"
    with open(log, "w") as f:
        f.write("x" * (3 << 20) + "\n")  # a line longer than a read
        f.write("KV Cache is allocated. KV size: 38.62 GB\n")
    assert kv_pool_from_log("sglang", str(log)) == int(38.62 * GIB)


@pytest.mark.parametrize("layers", ["5", "[1, 14]", '"remote"'])
def test_a_placement_file_whose_layers_are_no_table_is_said(tmp_path, layers):
    """Before: ``layers = 5`` ended in an AttributeError."""
    path = tmp_path / "placement.toml"
    path.write_text(f"layers = {layers}\n")
    line = refused("--placement", str(path), *GOOD)
    assert line.startswith(f"--placement {path}: 'layers' is ") and ", not a table: write [layers] with" in line


@pytest.mark.parametrize(
    "argv,line",
    [
        (["--tp", "1000000000000"], "argument --tp: expected a whole number from 1 to 4096, got '1000000000000'"),
        (["--dp", "99999"], "argument --dp: expected a whole number from 1 to 4096, got '99999'"),
        (["--nnodes", "0"], "argument --nnodes: expected a whole number from 1 to 4096, got '0'"),
        (
            ["--tp", "4096", "--dp", "4096"],
            "--tp 4096 --dp 4096 over --nnodes 1 put 16777216 ranks on each host: "
            "a plan takes at most 1024 (give the hosts there are as --nnodes)",
        ),
    ],  # fmt: skip
    ids=["tp", "dp", "nnodes", "ranks-per-host"],
)
def test_the_layout_is_bounded(argv, line):
    """Before: --tp 1000000000000 counted a trillion ranks' tables, one by one (a plan that never answered)."""
    assert refused(*GOOD, *argv).startswith(line)


def test_the_largest_layout_is_planned():
    assert main(["plan", *GOOD, "--tp", "1024", "--json"]) == 1  # 1024 ranks' host KV: no room, but an answer


@pytest.mark.parametrize("flag", ["--engine-log", "--placement", "--tables"])
def test_a_fifo_for_a_file_is_refused_not_waited_on(tmp_path, flag):
    """Before: open() waited for a writer for ever."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = [flag, str(fifo)] + (["--host-memory-gib", "1024"] if flag == "--engine-log" else list(GOOD))
    assert refused(*argv).startswith(f"{flag} {fifo}: not a ")


def test_a_request_beyond_the_bounds_is_refused_by_the_plan_itself():
    for req, msg in (
        (request(kv_gib=0), "device KV pool per rank of 0 bytes"),
        (request(host_gib=1 << 34), "host memory of 18446744073709551616 bytes"),
        (request(other_bytes=-1), "other memory of -1 bytes"),
        (request(tp=8, dp=1024), "put 8192 ranks on each host"),
    ):
        with pytest.raises(ConfigError, match=msg):
            make_plan(req)
