"""The client half of ``tableserver demo``: replay Engram-shaped decode steps against a running server.

    python -m tableclient.demo --control 127.0.0.1:7070 --file demo.bin \\
        --table engram.layer1:OFFSET:ROWS:ROW_BYTES --table engram.layer14:OFFSET:ROWS:ROW_BYTES

Over each transport (``--transports``, default shm,tcp) every step issues layer 1's and layer 14's
gathers at step start (shortest window first), 24 rows per token per layer, then waits for each. It
prints gather latency p50/p99 per layer against the layer's window, and checks sampled steps bit-exact
against the table file (each ``--table`` names where that table's rows sit in it). ``tableserver demo``
starts the server and runs this in a subprocess; it imports only the client, numpy and
``tableserver.common``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tableclient import TableClient
from tableclient.errors import TableClientError
from tableserver.common.model import ROWS_PER_TOKEN, WINDOWS_S

#: decode steps replayed over each transport before the measured ones (at most --steps)
WARMUP_STEPS = 20
#: the warm-up's row-id seed (the measured steps use --seed)
WARMUP_SEED = 99
#: every CHECK_EVERY-th measured step is compared with the table file
CHECK_EVERY = 10
#: seconds one layer's gather may take before the replay fails
GATHER_TIMEOUT_S = 10.0
#: what the error line starts with (``tableserver demo`` reports the rest as its own)
ERROR_PREFIX = "tableclient.demo: error: "


class DemoError(Exception):
    """The replay found rows that differ from the table file, or was given a table it cannot use."""


class DemoIds:
    """Row ids shaped like Engram lookups: Zipfian token reuse, 24 head segments per layer."""

    def __init__(self, rows: int, seed: int = 0, vocab: int = 50_000):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        bounds = np.linspace(0, rows, ROWS_PER_TOKEN + 1).astype(np.int64)
        self.offsets, self.sizes = bounds[:-1], np.diff(bounds)
        self.mult = (self.rng.integers(1, 2**31, size=ROWS_PER_TOKEN) * 2 + 1).astype(np.int64)

    def step(self, batch: int) -> np.ndarray:
        tokens = np.minimum(self.rng.zipf(1.2, size=(batch, 1)), self.vocab).astype(np.int64)
        prev = np.minimum(self.rng.zipf(1.2, size=(batch, 1)), self.vocab).astype(np.int64)
        h = (tokens * self.mult) ^ (prev * (self.mult >> 3))
        return h % self.sizes + self.offsets  # [batch, 24]


def replay(client, steps: int, batch: int, local: dict | None = None, seed: int = 0) -> dict:
    """Decode steps against ``client``; returns per-layer latency arrays (seconds)."""
    tables = sorted((t for t in client.tables.values() if t.layer in WINDOWS_S), key=lambda t: WINDOWS_S[t.layer])
    remote = [client.table(t.name) for t in tables]
    gens = [DemoIds(t.rows, seed + t.layer) for t in tables]
    outs = [np.empty((batch, ROWS_PER_TOKEN, t.row_bytes), np.uint8) for t in tables]  # persistent buffers
    lat = {t.layer: np.empty(steps) for t in tables}
    checked = 0
    for step in range(steps):
        ids = [g.step(batch) for g in gens]
        start = time.perf_counter()
        handles = client.gather_many(list(zip(remote, ids)), outs=outs)  # shortest window first
        for t, h in zip(tables, handles):
            h.wait(timeout=GATHER_TIMEOUT_S)
            lat[t.layer][step] = time.perf_counter() - start
        if local is not None and step % CHECK_EVERY == 0:
            for t, i, o in zip(tables, ids, outs):
                if not np.array_equal(o, local[t.name][i]):
                    raise DemoError(f"step {step}: {t.name} rows differ from the table file")
                checked += 1
    lat["checked"] = checked
    return lat


def local_tables(path: str, tables: list[tuple[str, int, int, int]]) -> dict[str, np.ndarray]:
    """``{name: uint8 [rows, row_bytes]}``: each (name, offset, rows, row_bytes) table of the file at
    ``path``, mapped read-only."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, offset, rows, row_bytes in tables:
        if offset + rows * row_bytes > mm.size:
            raise DemoError(f"table {name} ({rows} rows x {row_bytes} B at {offset}) lies past the end of {path}")
        out[name] = mm[offset : offset + rows * row_bytes].reshape(rows, row_bytes)
    return out


def run(control: str, local: dict, steps: int, batch: int, transports, out=sys.stdout) -> None:
    """Replays ``steps`` decode steps over each of ``transports`` and prints the latency table."""
    print(
        f"{'transport':<10}{'layer':>6}{'rows':>7}{'p50 us':>10}{'p99 us':>10}{'window us':>11}"
        f"{'in window':>11}{'rows/s':>12}",
        file=out,
    )
    for name in transports:
        with TableClient(control, transport=name) as client:
            replay(client, min(steps, WARMUP_STEPS), batch, seed=WARMUP_SEED)
            lat = replay(client, steps, batch, local)
            layers = [k for k in sorted(WINDOWS_S, key=WINDOWS_S.get) if k in lat]
            step_s = np.max([lat[k] for k in layers], axis=0)  # a step ends when its last layer lands
            rows_s = len(layers) * batch * ROWS_PER_TOKEN * steps / step_s.sum()
            for layer in layers:
                a, window = lat[layer], WINDOWS_S[layer]
                print(
                    f"{client.transport:<10}{layer:>6}{batch * ROWS_PER_TOKEN:>7}"
                    f"{np.percentile(a, 50) * 1e6:>10.0f}{np.percentile(a, 99) * 1e6:>10.0f}"
                    f"{window * 1e6:>11.0f}{(a <= window).mean() * 100:>10.1f}%{rows_s:>12,.0f}",
                    file=out,
                )
            print(f"{'':<10}bit-exact vs the table file on {lat['checked']} sampled gathers", file=out)
    print(
        "\nlatency is from step start (both layers issued at once) to each layer's rows in the buffer;\n"
        f"the windows are DeepSeek-V4.1's: layer 1 at {WINDOWS_S[1] * 1e3:g} ms, layer 14 at "
        f"{WINDOWS_S[14] * 1e3:g} ms after step start.",
        file=out,
    )


def table_arg(value: str) -> tuple[str, int, int, int]:
    """``NAME:OFFSET:ROWS:ROW_BYTES`` -> (name, offset, rows, row_bytes)."""
    name, *numbers = value.rsplit(":", 3)
    try:
        offset, rows, row_bytes = (int(n) for n in numbers)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME:OFFSET:ROWS:ROW_BYTES, got {value!r}") from None
    if not name or offset < 0 or rows <= 0 or row_bytes <= 0:
        raise argparse.ArgumentTypeError(f"expected NAME:OFFSET:ROWS:ROW_BYTES, got {value!r}")
    return name, offset, rows, row_bytes


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tableclient.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--control", required=True, help="the server's control-plane address (HOST:PORT)")
    p.add_argument("--file", required=True, help="the table file the server serves (for the bit-exact check)")
    p.add_argument(
        "--table",
        action="append",
        type=table_arg,
        required=True,
        metavar="NAME:OFFSET:ROWS:ROW_BYTES",
        help="a table of --file: its name, byte offset, rows and row size (repeat for each table)",
    )
    p.add_argument("--steps", type=_positive_int, default=200, help="decode steps to replay (default 200)")
    p.add_argument("--batch", type=_positive_int, default=64, help="tokens per step (default 64)")
    p.add_argument("--transports", default="shm,tcp", help="transports to replay over (default shm,tcp)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        local = local_tables(args.file, args.table)
        run(args.control, local, args.steps, args.batch, [t for t in args.transports.split(",") if t])
    except (DemoError, TableClientError, OSError) as e:
        sys.stdout.flush()
        print(ERROR_PREFIX + str(e).replace("\n", " "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
