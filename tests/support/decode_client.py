#!/usr/bin/env python3
"""A serving worker's Engram reads, as a separate process: decode steps until told to stop.

    python tests/support/decode_client.py --address A --tables FILE --progress P.json --stop STOPFILE
                                  [--batch 64] [--no-hedge] [--client-id ID] [--gap 0.02]

Every step issues both layers' gathers at step start (the step API, hedged at
half of each layer's window when there are replicas), then walks the GPU
timeline the way bench/replay.py does: it reaches layer 1 at 0.3 ms and layer
14 at 9.3 ms (plus the stall so far) and waits there for the rows. The stall
of a step is how long those waits held it up. Every row is compared with the
table file: a mismatch (a stale or foreign row) is counted, never hidden.
Progress (steps, failures, mismatches, every step's stall) is rewritten to
--progress after each step, so a test can wait for the event it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "support")]

import numpy as np  # noqa: E402
from tableclient import TableClient  # noqa: E402
from tableclient.step import EngramStep, LayerPlan  # noqa: E402

WINDOWS = {1: 0.3e-3, 14: 9.3e-3}


def spin_until(t: float) -> None:
    while time.perf_counter() < t:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--tables", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--no-hedge", action="store_true")
    ap.add_argument("--client-id", default="")
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between steps (the rest of a decode step)")
    ap.add_argument("--liveness", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--dns-refresh", type=float, default=5.0)
    args = ap.parse_args()

    from conftest import local_tables

    local = local_tables(args.tables)
    client = TableClient(
        args.address,
        transport="tcp",
        client_id=args.client_id,
        liveness_timeout=args.liveness,
        dns_refresh=args.dns_refresh,
        hedge_fraction=0.5,
    )
    plans = [LayerPlan(1, "engram.layer1", WINDOWS[1]), LayerPlan(14, "engram.layer14", WINDOWS[14])]
    step = EngramStep(
        client, plans, max_tokens=args.batch, policy="fail", timeout=args.timeout, hedge=not args.no_hedge
    )
    rng = np.random.default_rng(abs(hash(args.client_id)) % 2**32)
    state = {"steps": 0, "failed": 0, "mismatches": 0, "stalls": [], "errors": [], "pid": os.getpid()}

    def publish() -> None:
        state["replicas"] = client.replicas()
        tmp = args.progress + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, args.progress)

    publish()
    while not os.path.exists(args.stop):
        ids = {
            1: rng.integers(0, local["engram.layer1"].shape[0], (args.batch, 24)),
            14: rng.integers(0, local["engram.layer14"].shape[0], (args.batch, 24)),
        }
        t0 = time.perf_counter()
        stall = 0.0
        try:
            step.begin_step(ids)
            for layer, name in ((1, "engram.layer1"), (14, "engram.layer14")):
                spin_until(t0 + WINDOWS[layer] + stall)  # the GPU reaches the layer
                w0 = time.perf_counter()
                rows = step.wait(layer)
                stall += time.perf_counter() - w0
                if not np.array_equal(rows.numpy(), local[name][ids[layer]]):
                    state["mismatches"] += 1
        except Exception as e:  # a failed step is counted and reported, the loop goes on
            state["failed"] += 1
            stall = time.perf_counter() - t0
            if len(state["errors"]) < 10:
                state["errors"].append(f"step {state['steps']}: {type(e).__name__}: {e}")
        state["steps"] += 1
        state["stalls"].append(round(stall, 6))
        publish()
        time.sleep(args.gap)
    client.close()
    publish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
