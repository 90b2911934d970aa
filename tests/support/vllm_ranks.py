"""One tensor-parallel rank of vLLM's Engram layers on the CPU (gloo), with and without the plugin.

    python tests/support/vllm_ranks.py RANK WORLD PORT MODEL_DIR TABLE_FILE PLAN

Started once per rank by tests/engines/vllm/test_vllm_ranks.py; ``PLAN`` is this rank's JSON: ``memnode`` (a node
every rank reaches, over tcp and shm), ``kill_at``, ``runs`` (per run its placement, policy and this rank's own node
with its pid), ``eager`` (the same, per policy, for the eager case), ``refuse`` (the node this rank's device layers
read: one that maps nothing on rank 1) and ``bound`` (the seconds a rank may run: one left waiting in a collective
its peer never joins ends itself then, its stacks on stderr). Prints JSON lines, each naming its ``case``. The
cases but ``columns`` run the conversation's decode steps, as many as their tests read, each step's inputs the same
in every case and run and vLLM's own outputs for them (the references) computed once:

* ``agreement``: for each run, this rank's layers served by its own node (``remote``: graph mode in_graph, vLLM's
  FULL graphs; ``node``: graph mode device, the kernel reading the node's mapping), each decode step through
  vLLM's own ``Worker.execute_model`` and ``Worker.sample_tokens`` (hooked), beside vLLM's own layers over its own
  tables and over all-zero tables (the references, alike on every rank). Rank 1 kills its node (SIGKILL) before
  step ``kill_at`` and waits until its client sees it down; two steps from it on. A line a step: which reference
  each served layer's output equals ("table", "zeros" or "neither") and what the check where vLLM reads the result
  said ("ok" or its error).
* ``modes``: node layers whose table rank 1's GPU cannot register (its node serves from disk), under FULL graphs:
  each layer's graph mode and each placement's poller on this rank, the plugin's log lines, and whether every
  decode step was bit-identical to vLLM's own tables.
* ``failed_arm``: remote layers in FULL graphs; before step ``kill_at`` a step whose model runner returns without
  running the layers (armed, its ids never published): a line a step as for ``agreement``.
* ``dummy``: remote layers in FULL graphs; data-parallel dummy batches (``Worker.execute_dummy_batch``) between
  steps, one whose dummy run hashes nothing (as vLLM's outside FULL replays) and one that runs the layers: a line
  a step as for ``agreement``.
* ``pipeline``: the same two processes as two pipeline stages (TP 1): what building a served layer says.
* ``eager`` (first): remote layers in graph mode eager_break, no CUDA graphs; per run of ``PLAN``'s ``eager`` (a
  policy each) this rank's own node, rank 1's killed before step ``kill_at``: a line a step as for ``agreement``, and
  ``eager_zero_rows``: each layer's zero-rows count over the run.
* ``columns`` (then, printed last): vLLM's own layers built three times over the same tables (vLLM's own
  head-sharded tables, every layer served remote over tcp, every layer served node: graph mode device), without and
  with sequence parallelism, the same steps through all three: per mode and placement whether every output was
  bit-identical to vLLM's own, and the hash columns this rank's served layers gathered.
"""

from __future__ import annotations

import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # tests/support, tests (conftest)

import vllm_cpu  # noqa: E402  (before vllm)
from graph_ranks import dead  # noqa: E402
from rank_report import plugin_lines, zero_rows  # noqa: E402

TABLES = tuple(f"engram.layer{layer}" for layer in vllm_cpu.LAYERS)
#: every GraphStep's deadline: far longer than a busy machine takes for a step
TIMEOUT = 30.0
#: the failed_arm case's deadline, and the wait of its arm that fails: waited out while the native poller spins on
#: the step armed before (a core a rank), so shorter; still far longer than one of its decode steps (two tokens)
#: takes to be served on a busy machine (well under a second)
FAILED_ARM_TIMEOUT = 10.0


def main(rank: int, world: int, port: int, model_dir: str, table_file: str, plan: dict) -> dict:
    import faulthandler

    import numpy as np
    import torch
    from conftest import local_tables
    from tableclient.engine import PluginConfig
    from tableclient.vllm import hooks
    from vllm.plugins import load_general_plugins

    # a rank left waiting in a collective its peer never joins ends here, its stacks on stderr, before the test's bound
    faulthandler.dump_traceback_later(plan["bound"], exit=True)
    memnode = plan["memnode"]
    os.environ.update(TABLESERVER_ADDRESS=memnode, TABLESERVER_TRANSPORT="tcp", VLLM_PLUGINS="tableserver")
    load_general_plugins()
    cfg = vllm_cpu.make_vllm_config(model_dir)
    vllm_cpu.init_parallel(cfg, world_size=world, rank=rank, port=port, tp=world)
    tables = local_tables(table_file)
    hasher = vllm_cpu.make_hasher(cfg)
    report = {"case": "columns", "rank": rank}
    placements = {
        "local": PluginConfig(transport="tcp"),
        "remote": PluginConfig(address=memnode, transport="tcp"),
        "node": PluginConfig(node_address=memnode, layers={layer: "node" for layer in vllm_cpu.LAYERS}),
    }
    try:
        steps = Steps(cfg, hasher, tables)
        eager(rank, cfg, steps, tables, plan)  # first: vLLM without CUDA graphs
        for sp in (False, True):
            outs, columns, device = [], {}, False
            for placement, plugin_config in placements.items():
                hooks.configure(plugin_config)
                engrams = vllm_cpu.build_engrams(cfg, sequence_parallel=sp)
                for e, layer in zip(engrams, vllm_cpu.LAYERS):
                    vllm_cpu.load_table(e, np.array(tables[f"engram.layer{layer}"]))
                if placement != "local":
                    columns[placement] = [(e.embed_tokens.head_start, e.embed_tokens.head_end) for e in engrams]
                if placement == "node":
                    device = [hooks.rows().layers[layer].graph_mode for layer in vllm_cpu.LAYERS] == ["device"] * 2
                rng = np.random.default_rng(0)
                got = []
                for requests in vllm_cpu.conversation():
                    _, hashes, mask = vllm_cpu.hash_batch(hasher, requests)
                    tokens = len(hashes)
                    x = torch.from_numpy(rng.standard_normal((tokens, vllm_cpu.HC, vllm_cpu.HIDDEN)).astype(np.float32))
                    x = x.to(torch.bfloat16)
                    if sp:  # this rank's share of the tokens, padded to the shard size as vLLM's sp_shard pads it
                        chunk = -(-tokens // world)
                        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, chunk * world - tokens))[
                            rank * chunk : (rank + 1) * chunk
                        ]
                    got.append(vllm_cpu.step(engrams, hashes, x, mask))
                outs.append(got)
                if placement == "remote" and sp:  # sp's steps, each issued at step start
                    report["served"] = {str(k): v["prefetched"] for k, v in hooks.rows().summary().items()}

            def same(got):
                return all(
                    torch.equal(a.view(torch.int16), b.view(torch.int16))
                    for sa, sb in zip(got, outs[0])
                    for a, b in zip(sa, sb)
                )

            report["sp" if sp else "tp"] = {
                "identical": same(outs[1]),
                "columns": columns["remote"],
                "steps": len(outs[0]),
                "node": {"identical": same(outs[2]), "columns": columns["node"], "device": device},
            }
        full_graphs(cfg)  # from here on vLLM captures FULL graphs
        agreement(rank, cfg, steps, tables, plan)
        modes(cfg, steps, tables, plan["refuse"])
        failed_arm(cfg, steps, tables, memnode, plan["kill_at"])
        dummies(cfg, steps, tables, memnode, hasher)
        pipeline(cfg, world, rank, port, memnode)
    finally:
        hooks.configure(PluginConfig())
        vllm_cpu.close_parallel()
    faulthandler.cancel_dump_traceback_later()
    return report


def build(cfg, tables, plugin_config, zero: bool = False):
    """vLLM's layers under ``plugin_config``, each table loaded through vLLM's weight loader (all zeros: ``zero``)."""
    import numpy as np
    from tableclient.vllm import hooks

    hooks.configure(plugin_config)
    engrams = vllm_cpu.build_engrams(cfg)
    for e, layer in zip(engrams, vllm_cpu.LAYERS):
        table = np.array(tables[f"engram.layer{layer}"])
        vllm_cpu.load_table(e, np.zeros_like(table) if zero else table)
    return engrams


def served_config(**options):
    """The plugin's configuration of a served run: no test here is about liveness or a gather's budget."""
    from tableclient.engine import PluginConfig

    options.setdefault("timeout", TIMEOUT)
    return PluginConfig(liveness_timeout=600.0, gather_budget=600.0, **options)


def full_graphs(cfg) -> None:
    from vllm.config import CUDAGraphMode

    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL  # remote layers: in_graph


class Steps:
    """The conversation's decode steps, each through vLLM's Worker (``worker_step``), beside vLLM's own layers over
    their own tables and over all-zero tables: the references each served layer's output is named by. Step ``i``
    has the same inputs in every case and run of this process (its hash ids, its residual stream drawn once), so
    the references of each step are computed once, for all of them."""

    def __init__(self, cfg, hasher, tables):
        import numpy as np
        import torch
        from tableclient.engine import PluginConfig

        own, zeros = build(cfg, tables, PluginConfig()), build(cfg, tables, PluginConfig(), zero=True)
        rng = np.random.default_rng(0)
        self.inputs, self.references = [], []
        for requests in vllm_cpu.decode_steps():
            _, hashes, mask = vllm_cpu.hash_batch(hasher, requests)
            x = rng.standard_normal((len(hashes), vllm_cpu.HC, vllm_cpu.HIDDEN)).astype(np.float32)
            x = torch.from_numpy(x).to(torch.bfloat16)
            self.inputs.append((hashes, x, mask))
            self.references.append((vllm_cpu.step(own, hashes, x, mask), vllm_cpu.step(zeros, hashes, x, mask)))

    def __len__(self) -> int:
        return len(self.inputs)

    def __call__(self, served, i: int, **case) -> dict:
        """Decode step ``i`` (``forward`` False: its model runner runs no layer); printed and returned: ``rows``
        (per layer "table", "zeros" or "neither"; none without a forward) and ``check``."""
        import torch

        forward = case.pop("forward", True)
        hashes, x, mask = self.inputs[i]
        want, zero = self.references[i]
        outs, check = [], "ok"
        try:
            vllm_cpu.worker_step(served, hashes, x, mask, outs=outs, forward=forward)
        except Exception as e:  # what vLLM's worker would raise: its message
            check = str(e)
        rows = {}
        if outs and outs[-1] is not None:
            for layer, got, a, b in zip(vllm_cpu.LAYERS, outs[-1], want, zero):
                same = lambda r: torch.equal(got.view(torch.int16), r.view(torch.int16))  # noqa: E731
                rows[str(layer)] = "table" if same(a) else "zeros" if same(b) else "neither"
        line = {**case, "step": i, "rows": rows, "check": check}
        print(json.dumps(line), flush=True)
        return line


def agreement(rank: int, cfg, steps: Steps, tables, plan: dict) -> None:
    """Each step's rows, ranks agreeing or not, per run of ``plan["runs"]``: the steps before ``plan["kill_at"]``
    and two from it on (the loss and that its outcome lasts)."""
    from conftest import wait_for
    from tableclient.vllm import hooks

    full_graphs(cfg)
    for run in plan["runs"]:
        placement, policy, address, pid = run["placement"], run["policy"], run["address"], run["pid"]
        if placement == "node":  # graph mode device: the kernel reads this host's node's mapping (shm)
            where = {"node_address": address, "layers": {layer: "node" for layer in vllm_cpu.LAYERS}}
        else:
            where = {"address": address, "transport": "tcp"}
        served = build(cfg, tables, served_config(policy=policy, **where))
        mode = "device" if placement == "node" else "in_graph"
        assert [hooks.rows().layers[layer].graph_mode for layer in vllm_cpu.LAYERS] == [mode] * 2
        for i in range(plan["kill_at"] + 2):
            if i == plan["kill_at"] and rank == 1:
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: dead(pid), "the node to die")  # its sockets closed
                if placement == "node":  # its mapping let go before the step (a device table's read is the host's)
                    client = hooks.rows().client("node")
                    wait_for(lambda: client.replicas()[address]["state"] == "down", "the client to see it down")
            steps(served, i, case="agreement", placement=placement, policy=policy)


def eager(rank: int, cfg, steps: Steps, tables, plan: dict) -> None:
    """Remote layers in graph mode eager_break (vLLM without CUDA graphs, as --enforce-eager: its eager break runs
    inline; between segments in breakable piecewise graphs), each run on this rank's own node, rank 1's killed before
    step ``kill_at`` (the steps before it and two from it on), a run per ``plan["eager"]``: a line a step as for
    ``agreement``, then each layer's zero-rows count of the run."""
    from conftest import wait_for
    from tableclient.vllm import hooks
    from vllm.config import CUDAGraphMode

    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    for run in plan["eager"]:
        policy, address, pid = run["policy"], run["address"], run["pid"]
        graph = {layer: "eager_break" for layer in vllm_cpu.LAYERS}
        served = build(cfg, tables, served_config(policy=policy, address=address, transport="tcp", graph=graph))
        assert [hooks.rows().layers[layer].graph_mode for layer in vllm_cpu.LAYERS] == ["eager_break"] * 2
        before = zero_rows(vllm_cpu.LAYERS)
        for i in range(plan["kill_at"] + 2):
            if i == plan["kill_at"] and rank == 1:
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: dead(pid), "the node to die")  # its sockets closed
            steps(served, i, case="eager", policy=policy)
        counted = {layer: n - before[layer] for layer, n in zero_rows(vllm_cpu.LAYERS).items()}
        print(json.dumps({"case": "eager_zero_rows", "policy": policy, "counted": counted}), flush=True)


def modes(cfg, steps: Steps, tables, refuse: str) -> None:
    """Node layers (graph mode device) under FULL graphs whose node, on rank 1, maps nothing into the process: four
    decode steps."""
    from tableclient.vllm import hooks

    full_graphs(cfg)
    with plugin_lines() as lines:
        served = build(cfg, tables, served_config(node_address=refuse, layers={1: "node", 14: "node"}))
        identical = all(steps(served, i, case="modes_step")["rows"] == {"1": "table", "14": "table"} for i in range(4))
    graph_steps = hooks.graph_steps() or {}
    print(json.dumps({
        "case": "modes",
        "modes": {str(layer): hooks.rows().layers[layer].graph_mode for layer in vllm_cpu.LAYERS},
        "pollers": {placement: step.poller for placement, step in graph_steps.items()},
        "identical": identical,
        "lines": lines,
    }), flush=True)  # fmt: skip


def failed_arm(cfg, steps: Steps, tables, memnode: str, at: int) -> None:
    """Remote layers in FULL graphs; step ``at`` armed and never run (its model runner returns at once); the steps
    before it, the one after it (whose arm fails) and one more (served again)."""
    full_graphs(cfg)
    config = served_config(address=memnode, transport="tcp", policy="fail", timeout=FAILED_ARM_TIMEOUT)
    served = build(cfg, tables, config)
    for i in range(at + 3):
        steps(served, i, case="failed_arm", forward=i != at)


def dummies(cfg, steps: Steps, tables, memnode: str, hasher) -> None:
    """Remote layers in FULL graphs, four decode steps; a dummy batch that hashes nothing after step 0, one that runs
    the layers after step 2."""
    full_graphs(cfg)
    served = build(cfg, tables, served_config(address=memnode, transport="tcp", policy="fail"))
    for i in range(4):
        steps(served, i, case="dummy")
        if i in (0, 2):
            try:
                vllm_cpu.dummy_step(served, hasher, forward=i == 2)
                said = "ok"
            except Exception as e:
                said = str(e)
            print(json.dumps({"case": "dummy_batch", "after": i, "check": said}), flush=True)


def pipeline(cfg, world: int, rank: int, port: int, memnode: str) -> None:
    """The ranks as ``world`` pipeline stages of one tensor-parallel rank each: a served layer built on each."""
    from tableclient.engine import PluginConfig
    from tableclient.vllm import hooks

    vllm_cpu.close_model_parallel()
    vllm_cpu.init_parallel(cfg, world_size=world, rank=rank, port=port, tp=1, pp=world)
    try:
        hooks.configure(PluginConfig(address=memnode, transport="tcp"))
        vllm_cpu.build_engrams(cfg)
        said = "built"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    print(json.dumps({"case": "pipeline", "said": said}), flush=True)


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    print(json.dumps(main(rank, world, port, sys.argv[4], sys.argv[5], json.loads(sys.argv[6]))))
