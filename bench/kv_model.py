#!/usr/bin/env python3
"""What the freed host memory buys as host KV cache: a MODEL of a KV-constrained agent workload, not a measurement.

    python bench/kv_model.py [--kv-pool-gib 40] [--ratio 2.2] [--baseline-ratio 1.9]

A multi-turn agent trace (sessions that reuse their prefixes) is replayed through a prefix cache sized in
tokens from the model's KV bytes per token, once per capacity: the device KV pool alone, and the device pool
with a host KV cache of ``ratio`` times its pages (SGLang's HiCache: host pages = device pages x
--hicache-ratio; vLLM's offloading the same way, by bytes). It reports the prefix hit rate and the prefill
tokens recomputed. ``make replay`` prints it for the ratios of its plan (tableserver/ops/launch_plan.py): with
the engine's own tables on the host and with the placement it recommends.

Assumptions, printed with the results (every one a flag):

* **Trace.** Shaped like the OpenHands/SWE-smith traces of SGLang's ``agentic-trace`` bench
  (``sglang/benchmark/datasets/agentic_trace.py``): every session starts with a system prompt shared by all
  (8 Ki tokens) and a context of its own (60 k tokens, +-50%), then runs 30 turns (+-50%); each turn's request
  is the whole history so far plus ~1,100 new tokens (tool output, exponential), and its reply adds 220 tokens.
  Sessions take turns in random order (their think time); a finished session is replaced by a new one.
* **KV-constrained.** The live sessions' contexts add up to ``pressure`` (2) times what the device pool holds:
  the number of sessions follows from the device pool's tokens, ``kv_pool_bytes / kv_bytes_per_token``.
* **KV bytes per token.** 4,608 B, an assumption for DeepSeek-V4.1's compressed attention (C4/C128 latent
  KV and the indexer's keys, about a tenth of DeepSeek-V3's MLA). Use the engine's own figure where known:
  SGLang logs ``#tokens: N, KV size: X GB`` at start-up (bytes per token = X GiB / N).
* **Cache.** A radix prefix cache in 1,024-token pages (SGLang's DeepSeek V4 pages are 256 tokens; the
  coarser page moves a hit by less than a page in ~90 k), least recently used leaves evicted first; a request
  hits its longest cached prefix. The host cache is write-through (SGLang's default policy): it holds every
  page the device holds, so it adds capacity only above a ratio of 1, and a host hit is loaded, not
  recomputed. Load time, scheduling and batching are not modelled: time to first token and throughput follow
  from the recomputed prefill only on a prefill-bound engine, which is what the GPU run measures.
"""

from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass

import numpy as np

GIB = 1 << 30
KV_BYTES_PER_TOKEN = 4608


@dataclass(frozen=True)
class AgentTrace:
    system_tokens: int = 8192  # shared by every session: system prompt and tool schemas
    context_tokens: int = 60_000  # a session's own first context (repository, task), mean
    turns: int = 30  # requests per session, mean
    turn_tokens: int = 1_100  # new tokens a turn's request adds (tool output), mean
    reply_tokens: int = 220  # the reply each turn adds to the history
    pressure: float = 2.0  # live sessions' contexts over the device pool's tokens
    page_tokens: int = 1024
    rounds: int = 3  # sessions started per live slot, the first round being warm-up
    seed: int = 0

    @property
    def mean_context(self) -> float:
        """A live session's mean context: its prompt halfway through its turns."""
        return self.system_tokens + self.context_tokens + self.turns / 2 * (self.turn_tokens + self.reply_tokens)

    def describe(self, device_tokens: int, sessions: int) -> str:
        return (
            f"{sessions} live agent sessions (their contexts {self.pressure:g}x the device pool's "
            f"{device_tokens / 1e6:.1f} M tokens), each a {self.system_tokens}-token shared system prompt, its own "
            f"{self.context_tokens // 1000} k-token context (+-50%), {self.turns} turns (+-50%) of ~{self.turn_tokens} "
            f"new tokens and a {self.reply_tokens}-token reply; {self.rounds} sessions per slot, the first as warm-up"
        )


class PrefixCache:
    """Pages of token prefixes, least recently used leaf first: a request touches its pages deepest first, so
    its shallow pages (shared by more requests) are the freshest."""

    def __init__(self, pages: int):
        self.capacity = pages
        self.lru: collections.OrderedDict = collections.OrderedDict()

    def serve(self, keys: list, prompt_pages: int) -> int:
        """A request over the pages ``keys`` (its prompt's full pages first, then its reply's): returns how many
        of its first ``prompt_pages`` pages were cached (its longest cached prefix), then caches them all."""
        hit = 0
        while hit < prompt_pages and keys[hit] in self.lru:
            hit += 1
        for key in reversed(keys):
            self.lru[key] = True
            self.lru.move_to_end(key)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
        return hit


def sessions_for(trace: AgentTrace, device_tokens: int) -> int:
    return max(1, math.ceil(trace.pressure * device_tokens / trace.mean_context))


def replay(trace: AgentTrace, capacity_tokens: int, sessions: int) -> dict:
    """The trace through a prefix cache of ``capacity_tokens``: prompt tokens, those hit, those recomputed
    (after the warm-up round)."""
    rng = np.random.default_rng(trace.seed)
    cache = PrefixCache(max(1, capacity_tokens // trace.page_tokens))
    page = trace.page_tokens
    system = [("system", i) for i in range(trace.system_tokens // page)]
    live, started, warm = [], 0, sessions
    total = hit = requests = 0

    def new_session() -> dict:
        nonlocal started
        started += 1
        return {
            "id": started,
            "history": trace.system_tokens + int(trace.context_tokens * rng.uniform(0.5, 1.5)),
            "left": max(1, int(trace.turns * rng.uniform(0.5, 1.5))),
            "measured": started > warm,
        }

    live = [new_session() for _ in range(sessions)]
    budget = sessions * trace.rounds
    while live:
        i = int(rng.integers(len(live)))
        s = live[i]
        prompt = s["history"] + int(rng.exponential(trace.turn_tokens))
        after = prompt + trace.reply_tokens
        keys = system + [(s["id"], p) for p in range(len(system), after // page)]
        cached = cache.serve(keys, prompt // page) * page
        if s["measured"]:
            total, hit, requests = total + prompt, hit + min(cached, prompt), requests + 1
        s["history"], s["left"] = after, s["left"] - 1
        if s["left"] == 0 and started < budget:
            live[i] = new_session()
        elif s["left"] == 0:  # no more sessions to start: this slot closes
            live[i] = live[-1]
            live.pop()
    return {"requests": requests, "prompt": total, "hit": hit, "recomputed": total - hit}


def model(
    kv_pool_bytes: int,
    ratios: dict,
    trace: AgentTrace = AgentTrace(),
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
) -> tuple[list, str]:
    """Rows (label, ratio or None, results) for the device pool alone and for each {label: host ratio}."""
    device = kv_pool_bytes // kv_bytes_per_token
    sessions = sessions_for(trace, device)
    rows = [("device KV only", None, replay(trace, device, sessions))]
    for label, ratio in ratios.items():
        useful = ratio is not None and ratio > 1  # write-through: the host holds the device's pages too
        rows.append((label, ratio, replay(trace, int(device * ratio), sessions) if useful else None))
    return rows, trace.describe(device, sessions)


def report(
    kv_pool_bytes: int, ratios: dict, trace: AgentTrace = AgentTrace(), kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
) -> str:
    rows, workload = model(kv_pool_bytes, ratios, trace, kv_bytes_per_token)
    base = rows[0][2]
    out = [
        "What the freed memory buys as host KV cache: a MODEL, not a measurement (bench/kv_model.py; the measured "
        "figure needs a GPU run: bench/gpu_check.sh's notes)",
        f"  device KV pool {kv_pool_bytes / GIB:.1f} GiB per rank at {kv_bytes_per_token} B of KV per token (assumed "
        "for DeepSeek-V4.1; SGLang logs its own: KV size / #tokens)",
        f"  trace: {workload}",
        f"  cache: radix prefix cache, {trace.page_tokens}-token pages, least recently used leaves first; host KV "
        "write-through (it holds the device's pages too: no gain at a ratio of 1 or less); load time not modelled",
        f"  {'':<46}{'prefix hit rate':>16}{'prefill recomputed':>20}{'vs device only':>16}",
    ]
    for label, ratio, r in rows:
        name = label + (f" (ratio {ratio:.2f})" if ratio is not None else "")
        if r is None:
            out.append(f"  {name:<46}{'no gain: not above the device pool' if ratio else 'none (no room)':>52}")
            continue
        change = "" if r is base else f"{(r['recomputed'] - base['recomputed']) / max(base['recomputed'], 1):+.0%}"
        out.append(f"  {name:<46}{r['hit'] / max(r['prompt'], 1):>16.1%}{r['recomputed'] / 1e6:>17.1f} M{change:>16}")
    done = [r for _, _, r in rows if r is not None]
    if len(done) > 1:  # the last row against the one before it: what the memory between them adds
        a, b = done[-2], done[-1]
        out.append(
            f"  last row against the one before: prefix hit rate {100 * (b['hit'] / b['prompt'] - a['hit'] / a['prompt']):+.1f} "
            f"points, prefill recomputed {(b['recomputed'] - a['recomputed']) / max(a['recomputed'], 1):+.0%}"
        )
    out.append(f"  ({base['requests']} measured requests, {base['prompt'] / 1e6:.0f} M prompt tokens)")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-pool-gib", type=float, default=40.0, help="device KV pool per rank (as the engine logs it)")
    ap.add_argument("--ratio", type=float, default=2.2, help="host KV ratio with the placement (tableserver plan)")
    ap.add_argument("--baseline-ratio", type=float, default=1.9, help="host KV ratio with the engine's own tables")
    ap.add_argument("--kv-bytes-per-token", type=int, default=KV_BYTES_PER_TOKEN)
    ap.add_argument("--pressure", type=float, default=AgentTrace.pressure)
    ap.add_argument("--rounds", type=int, default=AgentTrace.rounds)
    args = ap.parse_args()
    trace = AgentTrace(pressure=args.pressure, rounds=args.rounds)
    ratios = {"+ host KV, tables on the host": args.baseline_ratio, "+ host KV, tables served": args.ratio}
    print(report(int(args.kv_pool_gib * GIB), ratios, trace, args.kv_bytes_per_token))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
