"""Hostile files and options given to the daemon and its CLI (issue 12, and the server hardening after it):
table-file headers (hostile, nested 200k deep, numbers that are no integers), a zero-width safetensors
tensor, writers that never follow a planted symlink, every numeric option's range, config files that are no
regular file, too large or nested too deep, and an unbounded thread count. Each is refused in one line, in
bounded memory, or written safely -- never a traceback, never a write through somebody else's symlink."""

from __future__ import annotations

import json
import os
import resource
import zlib

import pytest
from conftest import run_cli
from tests_helpers import assert_one_line_error
from tests_helpers import parse_serve_flags as _parse

from tableserver.config import SERVE_OPTIONS, resolve
from tableserver.errors import ConfigError
from tableserver.tables.demo import DemoTable, write_demo_file
from tableserver.tables.tablefile import FORMAT_VERSION, MAGIC, PREAMBLE

# --------------------------------------------------------------------------------------- table files


def _table_file(path, doc: bytes, data_bytes: int = 4 << 20) -> str:
    pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(doc), zlib.crc32(doc), 0, 1 << 21)
    with open(path, "wb") as f:
        f.write(pre + doc)
        f.truncate((1 << 21) + data_bytes)
    return str(path)


def _limited_memory():
    """The child may allocate at most 512 MiB of data: a header must not make it allocate per byte."""
    resource.setrlimit(resource.RLIMIT_DATA, (512 << 20, 512 << 20))


@pytest.mark.parametrize(
    "doc, needle",
    [
        (
            {
                "tables": [
                    {"name": "t", "rows": (4 << 20) // 264, "row_bytes": 264, "offset": 1 << 21, "chunk_crc32": []}
                ],
                "chunk_bytes": 1,
            },
            "chunk_bytes must be an integer in 4096..",
        ),
        ({"tables": [], "metadata": "x"}, "metadata is not an object"),
        (
            {
                "tables": [
                    {"name": "t", "rows": 10, "row_bytes": 8, "offset": 1 << 21, "chunk_crc32": ["0"], "metadata": [1]}
                ]
            },
            "metadata is not an object",
        ),
        (
            {"tables": [{"name": "t", "rows": 10, "row_bytes": 8, "offset": 1 << 21, "chunk_crc32": ["nothex"]}]},
            "hex strings",
        ),
    ],
)
def test_hostile_table_file_headers_are_one_line_errors_in_bounded_memory(tmp_path, doc, needle):
    path = _table_file(tmp_path / "h.bin", json.dumps(doc).encode())
    for cmd in (("inspect", path), ("--tables", path, "--listen", "127.0.0.1:0")):
        assert_one_line_error(run_cli(*cmd, preexec=_limited_memory), needle)


def test_a_header_nested_200k_deep_is_one_line(tmp_path):
    path = _table_file(tmp_path / "deep.bin", b"[" * 200_000 + b"]" * 200_000)
    assert_one_line_error(run_cli("inspect", path), "nested too deep")


@pytest.mark.parametrize(
    "field, value", [("offset", float("inf")), ("rows", 1.5), ("row_bytes", "264"), ("layer", True), ("shape", "abc")]
)
def test_header_numbers_must_be_integers(tmp_path, field, value):
    """Found by the fuzzer: an offset of Infinity (JSON allows it) was an OverflowError traceback."""
    t = {"name": "t", "rows": 10, "row_bytes": 8, "offset": 1 << 21, "chunk_crc32": ["0"], field: value}
    path = _table_file(tmp_path / "n.bin", json.dumps({"tables": [t]}).encode())
    assert_one_line_error(run_cli("inspect", path), field)


def test_a_zero_width_safetensors_tensor_is_no_table(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = str(tmp_path / "zw.safetensors")
    save_file({"w": torch.zeros(10, 0), "ok": torch.ones(4, 2)}, path)
    res = run_cli("inspect", path)
    assert res.returncode == 0 and " ok " in res.stdout and " w " not in res.stdout, res.stdout + res.stderr


# ------------------------------------------------------------ writers never follow a planted symlink


def test_writers_never_follow_a_planted_symlink(tmp_path, monkeypatch):
    """gen-demo / pack / --ready-file wrote through `PATH.tmp` (O_CREAT|O_TRUNC): a symlink planted there
    overwrote its target. Temp files are now unpredictable and created O_EXCL|O_NOFOLLOW."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "demo.bin"
    os.symlink(victim, str(out) + ".tmp")  # the old, predictable temp name
    res = run_cli("gen-demo", str(out), "--rows", "1000")
    assert res.returncode == 0, res.stderr
    assert victim.read_bytes() == b"precious"
    # even a planted symlink at the very name drawn is refused, not followed
    import tableserver.tables.tablefile as tf

    monkeypatch.setattr("secrets.token_hex", lambda n: "0" * (2 * n))
    os.symlink(victim, tmp_path / f".again.bin.{'0' * 16}.tmp")
    with pytest.raises(tf.TableFileError, match="cannot create a temporary file"):
        write_demo_file(str(tmp_path / "again.bin"), [DemoTable("t", 10, 8)])
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "again.bin").exists()


def test_fix_pyverbs_does_not_follow_a_symlink_planted_at_the_temp_name(tmp_path):
    from tableserver.ops import doctor

    purelib, link_dir, pkg = tmp_path / "site-packages", tmp_path / doctor.LINK_DIR_NAME, tmp_path / "pyverbs"
    purelib.mkdir()
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = purelib / (doctor.PTH_NAME + ".tmp")  # the old fixed temp name
    planted.symlink_to(victim)
    undo = doctor.link(str(pkg), str(purelib), str(link_dir))
    assert victim.read_text() == "precious\n"
    pth = purelib / doctor.PTH_NAME
    assert not pth.is_symlink() and pth.read_text() == f"{link_dir}\n"
    assert os.readlink(link_dir / "pyverbs") == str(pkg)
    assert planted.is_symlink() and os.readlink(planted) == str(victim)  # left alone
    assert sorted(p.name for p in purelib.iterdir()) == sorted([doctor.PTH_NAME, planted.name])  # no temp left
    undo()
    assert not pth.exists() and not (link_dir / "pyverbs").exists()


# ---------------------------------------------------------------------- every numeric option bounded


NUMERIC = [o for o in SERVE_OPTIONS if o.kind in ("int", "float")]


@pytest.mark.parametrize("opt", NUMERIC, ids=lambda o: o.name)
def test_every_numeric_option_has_a_range_its_default_is_in(opt):
    assert opt.lo is not None and opt.hi is not None and opt.lo <= opt.hi, opt
    assert opt.lo <= opt.default <= opt.hi or (opt.default == 0 and opt.zero), opt
    assert resolve(_parse([]), {})[opt.name] == opt.default


@pytest.mark.parametrize("opt", NUMERIC, ids=lambda o: o.name)
def test_values_outside_the_range_are_one_line_errors_naming_where_they_came_from(opt, tmp_path):
    too_big = str(int(opt.hi) * 10 + 1) if opt.kind == "int" else str(opt.hi * 10)
    bad = [too_big, "100000000000000000000", "nan", "inf", "-inf", "-1"]
    if not opt.zero:
        bad.append("0")
    for text in bad:
        for args, env, where in (([f"{opt.flag}={text}"], {}, opt.flag), ([], {opt.env: text}, opt.env)):
            with pytest.raises(ConfigError) as e:
                resolve(_parse(args), env)
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith(f"{where} = {text!r}: expected"), msg
            assert opt.bounds in msg, msg
    key = opt.name.replace("_", "-")
    for literal in ("inf", "nan", too_big):  # TOML has inf and nan literals
        (tmp_path / "c.toml").write_text(f"{key} = {literal}\n")
        with pytest.raises(ConfigError) as e:
            resolve(_parse(["--config", str(tmp_path / "c.toml")]), {})
        assert f"c.toml: {key} = " in str(e.value) and opt.bounds in str(e.value), str(e.value)


def test_values_inside_the_range_are_taken(tmp_path):
    cfg = resolve(
        _parse(["--data-threads", "32", "--idle-timeout", "0", "--max-sessions", "1"]),
        {"TABLESERVER_LEASE_SECONDS": "86400", "TABLESERVER_DATA_THREADS": "2"},
    )
    assert (cfg["data_threads"], cfg["idle_timeout"], cfg["max_sessions"], cfg["lease_seconds"]) == (32, 0, 1, 86400)
    (tmp_path / "c.toml").write_text("data-threads = 4.0\nrdma-gid-index = 3\n")
    cfg = resolve(_parse(["--config", str(tmp_path / "c.toml")]), {})
    assert cfg["data_threads"] == 4 and cfg["rdma_gid_index"] == "3"
    for bad in ("data-threads = 4.5", "data-threads = true", "data-threads = [4]", "rdma-gid-index = 100000"):
        (tmp_path / "c.toml").write_text(bad + "\n")
        with pytest.raises(ConfigError, match="expected an integer in"):
            resolve(_parse(["--config", str(tmp_path / "c.toml")]), {})


def test_the_help_shows_every_range(tmp_path):
    res = run_cli("serve", "--help", env=dict(os.environ, COLUMNS="2000"))  # no wrapping inside a range
    assert res.returncode == 0, res
    text = " ".join(res.stdout.split())
    assert "2..32, or 0 = 2 per core" in text and "0.1..86400" in text
    for opt in NUMERIC:
        assert opt.bounds in text, opt.name


def test_the_cli_refuses_an_unbounded_thread_count_in_one_line(demo_file, tmp_path):
    env = dict(os.environ, TABLESERVER_DATA_THREADS="100000000000000000000")
    assert_one_line_error(
        run_cli("--tables", demo_file, "--listen", "127.0.0.1:0", env=env),
        "TABLESERVER_DATA_THREADS = '100000000000000000000'",
        "2..32",
        code=2,
    )
    (tmp_path / "c.toml").write_text("lease-seconds = inf\n")
    assert_one_line_error(
        run_cli("--tables", demo_file, "--config", str(tmp_path / "c.toml")),
        "lease-seconds = inf",
        "0.1..86400",
        code=2,
    )
    assert_one_line_error(
        run_cli("--tables", demo_file, "--max-sessions", "0"), "--max-sessions = '0'", "1..65536", code=2
    )


# --------------------------------------------------------------------------- the config file bounded


def _limit_memory():
    """A child that would read /dev/zero forever fails on its own, not by filling this machine."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_a_config_that_is_no_regular_file_is_refused_in_one_line(demo_file, tmp_path):
    env = dict(os.environ, TABLESERVER_CONFIG="/dev/zero")
    assert_one_line_error(
        run_cli("--tables", demo_file, env=env, preexec=_limit_memory), "/dev/zero is not a regular file", code=2
    )
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)  # opening it for reading without a writer would wait forever
    assert_one_line_error(run_cli("--tables", demo_file, "--config", fifo), "is not a regular file", code=2)
    assert_one_line_error(run_cli("--tables", demo_file, "--config", str(tmp_path)), "not a regular file", code=2)


def test_a_config_larger_than_the_limit_is_refused(demo_file, tmp_path):
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 120_000)  # 1.2 MB of comments: valid TOML, but no config is that large
    # a bad --listen too: a server that read the file whole would stop there instead of serving
    assert_one_line_error(
        run_cli("--tables", demo_file, "--config", str(big), "--listen", "nohost"), "larger than 1 MiB", code=2
    )


def test_a_deeply_nested_config_is_one_line(demo_file, tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("tables = " + "[" * 5000 + "]" * 5000 + "\n")
    res = run_cli("--tables", demo_file, "--config", str(deep))
    assert_one_line_error(res, "nested too deep", code=2)
    assert "RecursionError" not in res.stderr
