"""One tensor-parallel rank of SGLang 0.5.23's Engram layers and its decode graph runner on the CPU (gloo).

    python tests/support/sglang_ranks.py RANK WORLD PORT TABLE_FILE PLAN

Started once per rank by tests/engines/sglang/test_sglang_ranks.py, which reads every case below from the one run
of the two rank processes; ``PLAN`` is this rank's JSON: ``memnode`` (a node every rank reaches), ``kill_at``,
``runs`` (the agreement and eager cases' runs: each its ``case``, ``policy``, eager's ``mode``, and this rank's node:
on rank 1 one of the run's own, and its pid, killed before decode step ``kill_at``; on rank 0, which kills nothing,
the memnode), ``node`` and ``remote`` (the nodes of the modes case: on rank 1 one that maps nothing and one that
seals its tcp payloads), ``restart_port`` and ``workdir`` (where rank 1's own node of the idle case runs, twice, on
that port) and ``bound`` (the seconds a rank may run: a rank left waiting in a collective its peer never joins ends
itself, its stacks on stderr, before the test's own bound). SGLang's process groups are its
own (``init_distributed_environment`` and ``initialize_model_parallel`` over gloo), its plugin loading its own, its
hasher and Engram layers its own; the decode graph runner is SGLang's ``DecodeCudaGraphRunner`` class (built without
the ``__init__`` that would capture on a GPU). A replay is the captured forward run again with the graph's flag
operations on the host, inside the plugin's ``execute`` as SGLang's own ``execute`` runs ``load_batch`` (the
plugin's host part) before its replay; each replay's result is bound and checked as SGLang's scheduler's hooks do.
Prints JSON lines, each naming its ``case``:

* ``modes``: layer 1 placed node (graph mode device), layer 14 remote in_graph; on rank 1 the node maps nothing
  and the remote node seals its tcp payloads: each layer's graph mode, each placement's poller, the plugin's log
  lines, and whether every decode step was bit-identical to SGLang's own tables.
* ``agreement``: per run (policy), both layers placed node (graph mode device) on this rank's node; rank 1 kills
  its own node before decode step ``kill_at`` and waits until its client sees it down. A line a decode step: which
  reference each layer's output equals ("table", "zeros" or "neither") and what the result's check said.
* ``failed_arm``: both layers remote in_graph; decode step ``kill_at`` is armed and its graph never runs.
* ``eager``: per run (mode and policy), both layers remote on this rank's node, outside SGLang's decode graphs:
  "eager" (decode graphs disabled: every decode step an eager forward) or "eager_break" (the eager breaks of a
  breakable decode graph); rank 1's node killed before decode step ``kill_at``: a line a decode step as for
  ``agreement``, and ``eager_zero_rows``: each layer's zero-rows count over the run.
* ``idle``: DP attention (two attention-DP ranks, attention TP 1), both layers remote before_replay, policy zeros,
  rank 1 on a node of its own (rank 0 on the memnode); rank 1's node dies before decode step ``kill_at`` and is back
  (restarted) after it, and from then on rank 1's batches are idle (a replay of no real token) while rank 0 decodes.
* ``eager_idle``: DP attention, decode graphs disabled, the memnode, policy fail; from decode step ``kill_at`` on
  rank 1's batches are idle (no token) while rank 0 decodes.
"""

from __future__ import annotations

import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # tests/support, tests (conftest)

import torchvision_cpu  # noqa: E402,F401  (before sglang: torchvision on a CPU torch)
from rank_report import plugin_lines, zero_rows  # noqa: E402

#: every GraphStep's deadline: far longer than a busy machine takes for a step
TIMEOUT = 30.0
#: the failed_arm case's: its arm that fails waits it out (the native poller spinning on the armed step the while);
#: still far longer than a step there takes on a busy machine (well under a second)
FAILED_ARM_TIMEOUT = 5.0


def layout(rank: int, world: int, attn_dp: int) -> None:
    """SGLang's model-parallel groups for ``world`` tensor-parallel ranks in ``attn_dp`` attention-DP groups, and this
    rank's place in them (what SGLang's launcher publishes)."""
    from sglang.srt.distributed.parallel_state import initialize_model_parallel
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_size=world, pp_size=1, attn_dp_size=attn_dp, attn_tp_size=world // attn_dp, attn_cp_size=1,
        attn_dcp_size=1, moe_ep_size=1, moe_dp_size=1, moe_tp_size=world, shared_experts_tp_size=None, tp_rank=rank,
    )  # fmt: skip
    initialize_model_parallel()


def main(rank: int, world: int, port: int, table_file: str, plan: dict) -> None:
    import faulthandler

    from sglang.srt.distributed.parallel_state import destroy_model_parallel, init_distributed_environment
    from sglang.srt.plugins import load_plugins
    from sglang_cpu import make_model_config
    from tableclient.sglang import PluginConfig, configure

    faulthandler.dump_traceback_later(plan["bound"], exit=True)  # a rank its peer left waiting in a collective
    os.environ.update(TABLESERVER_ADDRESS=plan["memnode"], SGLANG_PLUGINS="tableserver")
    load_plugins()
    model_config = make_model_config()
    refs = References(model_config, table_file)  # whole tables, built before the process groups: no collective
    init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
    layout(rank, world, 1)
    try:
        modes(refs, plan)
        agreement(rank, refs, plan)
        failed_arm(refs, plan)
        eager(rank, refs, plan)
        destroy_model_parallel()  # which forgets every published name, the WORLD group's too: published again
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        layout(rank, world, 2)  # DP attention from here on
        idle(rank, refs, plan)
        eager_idle(rank, refs, plan)
    finally:
        configure(PluginConfig())
    faulthandler.cancel_dump_traceback_later()


class References:
    """SGLang's own layers over their own tables and over all-zero tables: what each served layer's output is named
    by ("table", "zeros"), whole tables on every rank (built as one rank: their forward enters no collective)."""

    def __init__(self, model_config, table_file):
        import torch
        from sglang_cpu import build

        self.model_config, self.table_file = model_config, table_file
        self.own, self.zero = build(model_config, table_file), build(model_config, table_file)
        for e in self.zero[1]:
            for p in e.embed.parameters():
                p.data.view(torch.uint8).zero_()

    def fresh(self):
        """(own, zero) with their hashers' histories as new (a conversation of its own)."""
        for hasher, _ in (self.own, self.zero):
            hasher.history.zero_()
        return self.own, self.zero


class Decode:
    """The test conversation through SGLang's layers: prefills eager (SGLang's prefill graphs are breakable),
    decode steps replayed in the served model's decode graphs, beside the references."""

    def __init__(self, refs: References):
        self.model_config, self.table_file = refs.model_config, refs.table_file
        self.own, self.zero = refs.fresh()

    def serve(self, backend=None, **plugin_options):
        """SGLang's layers served as configured, and its decode graph runner's capture (every buffer allocated,
        the ranks' decisions taken; ``backend``: the runner's backend class, SGLang's full graphs by default):
        (model, runner)."""
        import torch
        from sglang_cpu import HC, HIDDEN, build, decode_batch, decode_runner, forward
        from tableclient.sglang import graphs, hooks

        plugin_options.setdefault("timeout", TIMEOUT)
        model = build(self.model_config, self.table_file, parallel={}, **plugin_options)
        runner = decode_runner(model, backend)
        s = graphs.prepare(runner, hooks.rows())
        s.capturing = True
        try:  # what a capture's warm-up runs: the forward once per bucket, dummy tokens
            for bs in (1, 2, 4, 8):
                ids, batch = decode_batch([0] * bs, [5] * bs, list(range(bs)))
                forward(model, ids, batch, torch.zeros((bs, HC, HIDDEN), dtype=torch.bfloat16))
        finally:
            s.capturing = False
        return model, runner

    def run(self, model, runner, case: str, at=None, **fields) -> None:
        """The conversation; before decode step ``i`` ``at(i)`` may say what this rank does: "decode" (default),
        "armed" (armed, the graph never runs) or "idle" (a replay of no real token, as DP attention's idle batch).
        Without a ``runner`` (SGLang's decode graphs disabled) each decode step is an eager forward, "idle" one of
        DP attention's idle batches (no token)."""
        import numpy as np
        import torch
        from sglang_cpu import HC, HIDDEN, conversation, decode_batch, forward

        rng = np.random.default_rng(0)
        step = 0
        for ids, batch in conversation(rng):
            x = torch.from_numpy(rng.standard_normal((len(ids), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
            if not batch.forward_mode.is_decode():
                for m in (model, self.own, self.zero):
                    forward(m, ids, batch, x)
                continue
            what = at(step) if at is not None else "decode"
            line = {"case": case, "step": step, "did": what, **fields}
            if runner is None:
                line.update(self.eager(model, ids, batch, x, idle=what == "idle"))
            elif what == "idle":  # the bucket's padded tokens, in request slots nobody uses
                pad, pad_batch = decode_batch([0] * len(ids), [5] * len(ids), [6, 7][: len(ids)])
                line.update(self.replay(model, runner, pad, pad_batch, torch.zeros_like(x), 0))
            else:
                line.update(self.replay(model, runner, ids, batch, x, len(ids), run=what == "decode"))
            if "outs" in line and what != "idle":
                want, zero = forward(self.own, ids, batch, x)[1], forward(self.zero, ids, batch, x)[1]
                line["rows"] = {
                    str(layer): "table" if same(got, a) else "zeros" if same(got, b) else "neither"
                    for layer, got, a, b in zip((1, 14), line["outs"], want, zero)
                }
            line.pop("outs", None)
            print(json.dumps(line), flush=True)
            step += 1

    @staticmethod
    def eager(model, ids, batch, x, idle: bool = False) -> dict:
        """One eager forward (``idle``: DP attention's idle batch, no token): {"outs": the layers' outputs (where it
        ran through), "check": "ok" or the error}."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang_cpu import forward

        if idle:
            none = torch.empty(0, dtype=torch.int64)
            ids, x = none, x[:0]
            batch = ForwardBatch(
                forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=none, req_pool_indices=none, seq_lens=none,
                out_cache_loc=none, seq_lens_sum=0, positions=none,
            )  # fmt: skip
        got = {}
        try:
            outs = forward(model, ids, batch, x)[1]
            if not idle:
                got["outs"] = outs
            got["check"] = "ok"
        except Exception as e:  # what SGLang's scheduler would raise: its message
            got["check"] = str(e)
        return got

    @staticmethod
    def replay(model, runner, ids, batch, x, tokens: int, run: bool = True) -> dict:
        """One replay inside the plugin's ``execute`` (``run`` False: armed, the graph never runs), its result bound
        and checked: {"outs": the layers' outputs (where the graph ran), "check": "ok" or the error}."""
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang_cpu import forward
        from tableclient.sglang import graphs

        s = graphs.session()
        got = {}

        def execute(runner, forward_batch):  # SGLang's execute: load_batch (the plugin's host part), the replay
            graphs.before_replay(s, forward_batch, tokens)
            if not run:
                return None
            s.capturing = s.replay_on_host = True
            try:
                got["outs"] = forward(model, ids, forward_batch, x)[1]
            finally:
                s.capturing = s.replay_on_host = False

        try:
            graphs.execute(s, execute, runner, batch)
            result = GenerationBatchResult()
            graphs.bind_result(result)  # the scheduler's run_batch, then process_batch_result
            graphs.check_result(result)
            got["check"] = "ok"
        except Exception as e:  # what SGLang's scheduler would raise: its message
            got["check"] = str(e)
        return got


def same(a, b) -> bool:
    import torch

    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def modes(refs: References, plan: dict) -> None:
    """Layer 1 node (device), layer 14 remote in_graph; rank 1's GPU cannot register its node's table, its remote
    node seals its tcp payloads (the native poller cannot read them)."""
    from tableclient.sglang import graphs, hooks

    decode = Decode(refs)
    with plugin_lines() as lines:
        model, runner = decode.serve(
            address=plan["remote"], node_address=plan["node"], placement={1: "node", 14: "remote"},
            graph={14: "in_graph"},
        )  # fmt: skip
        decode.run(model, runner, "modes_step")
    s = graphs.session()
    print(json.dumps({
        "case": "modes",
        "modes": {str(layer): sl.graph_mode for layer, sl in sorted(hooks.rows().layers.items())},
        "pollers": {placement: step.poller for placement, step in s.steps.items()},
        "lines": lines,
    }), flush=True)  # fmt: skip
    graphs.close()


def agreement(rank: int, refs: References, plan: dict) -> None:
    """Both layers device, per policy on this rank's node (rank 1's its own); rank 1's node lost before decode step
    ``kill_at``."""
    from conftest import wait_for
    from graph_ranks import dead
    from tableclient.sglang import graphs, hooks

    for run in (r for r in plan["runs"] if r["case"] == "agreement"):
        policy, address, pid = run["policy"], run["address"], run["pid"]
        decode = Decode(refs)
        model, runner = decode.serve(node_address=address, placement={1: "node", 14: "node"}, policy=policy)
        assert {layer: sl.graph_mode for layer, sl in hooks.rows().layers.items()} == {1: "device", 14: "device"}

        def at(step, pid=pid, address=address):
            if step == plan["kill_at"] and rank == 1:
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: dead(pid), "the node to die")
                client = hooks.rows().client("node")
                wait_for(lambda: client.replicas()[address]["state"] == "down", "the client to see its node down")
            return "decode"

        decode.run(model, runner, "agreement", at, policy=policy)
        graphs.close()


def eager(rank: int, refs: References, plan: dict) -> None:
    """The layers' rows outside SGLang's decode graphs: per eager run of ``plan["runs"]`` (its ``mode``: "eager",
    decode graphs disabled, every step an eager forward; "eager_break", both layers in the eager breaks of a
    breakable decode graph) both layers remote on this rank's node, rank 1's own killed before decode step
    ``kill_at``: a line a decode step, then each layer's zero-rows count of the run."""
    from conftest import wait_for
    from graph_ranks import dead
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend
    from sglang_cpu import build
    from tableclient.sglang import graphs

    for run in (r for r in plan["runs"] if r["case"] == "eager"):
        mode, policy, address, pid = run["mode"], run["policy"], run["address"], run["pid"]
        decode = Decode(refs)
        options = {"address": address, "policy": policy, "timeout": TIMEOUT}
        if mode == "eager_break":
            model, runner = decode.serve(
                BreakableCudaGraphBackend, graph={1: "eager_break", 14: "eager_break"}, **options
            )
        else:
            model, runner = build(refs.model_config, refs.table_file, parallel={}, **options), None

        def at(step, pid=pid):
            if step == plan["kill_at"] and rank == 1:
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: dead(pid), "the node to die")
            return "decode"

        before = zero_rows((1, 14))
        decode.run(model, runner, "eager", at, mode=mode, policy=policy)
        counted = {layer: n - before[layer] for layer, n in zero_rows((1, 14)).items()}
        print(json.dumps({"case": "eager_zero_rows", "mode": mode, "policy": policy, "counted": counted}), flush=True)
        graphs.close()


def eager_idle(rank: int, refs: References, plan: dict) -> None:
    """DP attention (two attention-DP ranks), decode graphs disabled, the memnode, policy fail: from decode step
    ``kill_at`` on rank 1's batches are idle (no token) beside rank 0's decode."""
    from sglang_cpu import build

    decode = Decode(refs)
    model = build(refs.model_config, refs.table_file, parallel={}, address=plan["memnode"], policy="fail")
    decode.run(model, None, "eager_idle", lambda step: "idle" if rank == 1 and step >= plan["kill_at"] else "decode")


def failed_arm(refs: References, plan: dict) -> None:
    """Both layers remote in_graph, policy fail; decode step ``kill_at`` armed and never run."""
    from tableclient.sglang import graphs

    decode = Decode(refs)
    model, runner = decode.serve(
        address=plan["memnode"], graph={1: "in_graph", 14: "in_graph"}, policy="fail", timeout=FAILED_ARM_TIMEOUT
    )
    decode.run(model, runner, "failed_arm", lambda step: "armed" if step == plan["kill_at"] else "decode")
    graphs.close()


def idle(rank: int, refs: References, plan: dict) -> None:
    """DP attention: rank 1's node dies before decode step ``kill_at``, is back after it, rank 1 idle from then on
    (rank 0 on the memnode)."""
    from conftest import start_daemon, wait_for
    from graph_ranks import dead
    from tableclient.sglang import graphs, hooks

    def node(name):
        return start_daemon(
            os.path.join(plan["workdir"], f"{name}{rank}"), "--tables", refs.table_file,
            "--listen", f"127.0.0.1:{plan['restart_port']}", "--node-id", f"{name}{rank}",
        )  # fmt: skip

    daemons = [node("idle")] if rank == 1 else []
    try:
        address = daemons[0].address if rank == 1 else plan["memnode"]
        decode = Decode(refs)
        model, runner = decode.serve(address=address, policy="zeros")
        client = hooks.rows().client("remote")

        def at(step):
            if rank == 1 and step == plan["kill_at"]:
                daemons[0].stop(signal.SIGKILL)
                wait_for(lambda: dead(daemons[0].proc.pid), "the node to die")
                wait_for(lambda: client.replicas()[address]["state"] == "down", "the client to see its node down")
            if rank == 1 and step == plan["kill_at"] + 1:
                daemons.append(node("again"))
                wait_for(lambda: client.replicas()[address]["state"] == "up", "the client to see its node back")
            return "idle" if rank == 1 and step > plan["kill_at"] else "decode"

        decode.run(model, runner, "idle", at)
        graphs.close()
    finally:
        for d in daemons:
            d.stop()


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    main(rank, world, port, sys.argv[4], json.loads(sys.argv[5]))
