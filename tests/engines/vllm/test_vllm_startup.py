"""The plugin and vLLM's start-up, each in a fresh process as vLLM starts one (released vLLM 0.33.0, pinned):
vLLM's own loaders with and without the plugin (parameter bytes, resident memory, the workers' metrics),
and vLLM's real ``load_general_plugins()`` refusing a misconfigured plugin or another vLLM in one line, or
leaving vLLM alone when the plugin is not configured. Apart from tests/engines/vllm/test_vllm_plugin.py so
that the two spread over the test workers (each of these starts vLLM anew)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import vllm_cpu  # noqa: F401  (before vllm: Triton's interpreter, torchvision on a CPU torch)
from conftest import EVENT_TIMEOUT, ROOT
from tests_helpers import as_version, fork_cases, run_fresh
from vllm_cpu import LAYERS

pytest.importorskip("torch")
vllm_cpu.require_vllm()

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------- memory with and without the plugin
@pytest.mark.slow
def test_parameter_bytes_and_rss_with_and_without_the_plugin(tmp_path):
    """Layers 1 and 14 with tables of 127 MB each, built and loaded from a checkpoint by vLLM's own iterator,
    mapper and loaders, in a fresh process each (bench/bench_vllm.py): vLLM's own tables cost their size in
    parameters and resident memory, the served layers neither, and compute the same bits."""
    metrics = tmp_path / "prometheus"
    metrics.mkdir()
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_vllm.py"), "--engram-vocab", "20000", "--json",
         "--cases", "local,remote", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path),
         "--metrics-dir", str(metrics)],
        capture_output=True, text=True, cwd=ROOT, timeout=EVENT_TIMEOUT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert figures["identical"], res.stdout
    table = figures["table_bytes"]
    assert table > 100e6
    assert figures["local"]["param_bytes"] == table and figures["remote"]["param_bytes"] == 0
    assert figures["local"]["rss_growth"] > 0.9 * table
    assert figures["remote"]["rss_growth"] < 0.1 * table, figures
    # the workers' client metrics, as vLLM's /metrics aggregates them in multiprocess mode
    from prometheus_client import generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
    try:
        text = generate_latest(get_prometheus_registry()).decode()
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    for layer in LAYERS:
        assert samples[("tableserver_client_layer_waits_total", (("layer", str(layer)),))] == 1, text[-3000:]
        key = (("layer", str(layer)), ("table", f"engram.layer{layer}"), ("transport", "tcp"))
        assert samples[("tableserver_client_rows_total", key)] == 64 * 24  # the step: 64 tokens, 24 ids each


# ---------------------------------------------------------------------- refusing to start
LOAD_PLUGINS = "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
#: vLLM's plugin loading in fresh processes, as each vLLM process starts, one a case: an interpreter imports vLLM's
#: plugin framework once (what every case imports first), then forks each case's process before any plugin is
#: loaded; the case sets its environment and runs its code, exiting as the interpreter would. Prints
#: {case: [exit status, stdout, stderr]}.
FORK_CASES = fork_cases(
    "from vllm.plugins import load_general_plugins  # noqa: F401  (vLLM imported, no plugin loaded)"
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each case's process (a CompletedProcess: its exit status, stdout and stderr): vLLM's plugin loading with no
    TABLESERVER_* variables but the case's own."""
    bad = tmp_path_factory.mktemp("plugin") / "placement.toml"
    bad.write_text('address = "mem:7070"\n[layers]\n14 = "elsewhere"\n')
    cases = {
        "bad_layer": ({"TABLESERVER_VLLM_CONFIG": str(bad)}, LOAD_PLUGINS),
        "sglang_graph_mode": (
            {"TABLESERVER_ADDRESS": "mem:7070", "TABLESERVER_GRAPH_MODE": "14=before_replay"}, LOAD_PLUGINS
        ),
        "other_version": ({"TABLESERVER_ADDRESS": "mem:7070"}, as_version("vllm", "0.33.1", LOAD_PLUGINS)),
        "not_configured": ({}, LOAD_PLUGINS + (
            "from vllm.models.deepseek_v41.common.engram import Engram\n"
            "print(hasattr(Engram.prepare_embeddings, '__wrapped__'))\n"
        )),
    }  # fmt: skip
    res = run_fresh(FORK_CASES, {"VLLM_PLUGINS": "tableserver", "PLUGIN_CASES": json.dumps(cases)}, prelude="vllm_cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    return {name: subprocess.CompletedProcess(name, *said) for name, said in json.loads(res.stdout).items()}


def test_enabled_but_misconfigured_stops_start_up_with_one_line(launched):
    res = launched["bad_layer"]
    assert res.returncode != 0
    assert (
        res.stderr.strip().splitlines()[-1]
        == "tableserver plugin: layers.14 = 'elsewhere': use one of remote, node, local"
    )
    res = launched["sglang_graph_mode"]
    assert res.returncode != 0
    assert "graph.14 = 'before_replay' is an SGLang decode-graph mode" in res.stderr.strip().splitlines()[-1]


def test_other_vllm_versions_are_refused(launched):
    res = launched["other_version"]
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "tableserver plugin: vLLM 0.33.1 is not supported (tested with 0.33.0, whose Engram internals it hooks): "
        "install vllm==0.33.0, or unset TABLESERVER_ADDRESS to run vLLM without the plugin"
    )


def test_not_configured_leaves_vllm_alone(launched):
    res = launched["not_configured"]
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "False", res.stderr[-2000:]
