"""One tensor-parallel rank of tests/daemon/test_graph_ranks.py: a GraphStep whose layers agree across the ranks.

    python graph_ranks.py RANK WORLD PORT ADDRESS DAEMON_PID TABLES POLICY POLLER KILL_AT STEPS

Each rank has its own memory node (``ADDRESS``, over tcp) serving the same tables, and a gloo process group
with the others; ``agree`` is ``min_from_sum`` over gloo's SUM all-reduce, as an engine passes its own
capturable all-reduce. Layer 1 is gathered before the replay, layer 14 inside the graph (the host stands in
for the stream, in a thread, as tests/daemon/test_graphstep.py does). Every rank runs the same steps (the
same ids); rank 1 kills its own node (SIGKILL, ``DAEMON_PID``) before step ``KILL_AT``. Per step it prints
one JSON line: per layer whether the rows it served are the table's or all zeros, and what
``GraphStep.check`` said where an engine reads the step's results.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading

import numpy as np
import torch
import torch.distributed as dist
from prometheus_client import REGISTRY

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from conftest import EVENT_TIMEOUT, local_tables, wait_for  # noqa: E402
from tableclient import TableClient  # noqa: E402
from tableclient.graph.step import GraphStep, GraphStepError, HostStreamOps, min_from_sum  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

PLANS = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]
TOKENS = 8


def dead(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (its sockets closed; its parent, the test, reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def main() -> None:
    rank, world, port, address, pid, tables, policy, poller, kill_at, steps = sys.argv[1:]
    rank, world, kill_at, steps = int(rank), int(world), int(kill_at), int(steps)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=EVENT_TIMEOUT),
    )  # fmt: skip
    local = local_tables(tables)
    rng = np.random.default_rng(11)  # the same ids on every rank
    with TableClient(address, transport="tcp") as client:
        g = GraphStep(
            client, PLANS, {14: "in_graph"}, TOKENS, stream_ops=HostStreamOps(EVENT_TIMEOUT), policy=policy,
            timeout=2.0, poller=poller, budgets={14: 1.0}, agree=min_from_sum(dist.all_reduce, world),
        )  # fmt: skip
        try:
            for step in range(steps):
                if step == kill_at and rank == 1:
                    os.kill(int(pid), signal.SIGKILL)
                    wait_for(lambda: dead(int(pid)), "the node to die")  # its sockets closed
                ids = {p.layer: rng.integers(0, local[p.table].shape[0], (TOKENS, 24)) for p in PLANS}
                g.before_replay({1: ids[1]})
                number = g.arm(TOKENS)
                out = {}

                def stream():  # the captured graph's side: ids out, then each layer's rows (in model order)
                    g.publish_ids(14, torch.from_numpy(ids[14]))
                    for p in PLANS:
                        out[p.layer] = g.rows(p.layer, TOKENS).clone().numpy().reshape(TOKENS, 24, -1)

                t = threading.Thread(target=stream)
                t.start()
                t.join(EVENT_TIMEOUT)
                assert not t.is_alive(), "the stream was left waiting"
                g.after_replay()
                try:
                    g.check(number)
                    said = "ok"
                except GraphStepError as e:
                    said = str(e)
                rows = {
                    str(p.layer): "table"
                    if np.array_equal(out[p.layer], local[p.table][ids[p.layer]])
                    else "zeros"
                    if not out[p.layer].any()
                    else "other"
                    for p in PLANS
                }
                g.account()
                zeros = {
                    str(p.layer): REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total",
                                                            {"layer": str(p.layer)}) or 0.0
                    for p in PLANS
                }  # fmt: skip
                print(json.dumps({"step": step, "rows": rows, "check": said, "zero_steps": zeros}), flush=True)
        finally:
            g.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
