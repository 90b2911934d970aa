"""What the engines' rank processes and their tests share (tests/support/{vllm,sglang}_ranks.py,
tests/engines/*/test_*_ranks.py): the plugin's log lines a rank keeps for its report, and what every rank's steps
must show when one rank's node is lost first."""

from __future__ import annotations

import contextlib
import logging

#: both served layers' outputs equal the reference over the tables' own rows
TABLE_ROWS = {"1": "table", "14": "table"}


class Lines(logging.Handler):
    """Log records as one line each: ``LEVEL message``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def zero_rows(layers) -> dict:
    """This process's ``tableserver_client_zero_rows_served_total`` per layer (its steps served zero rows so far)."""
    from prometheus_client import REGISTRY

    name = "tableserver_client_zero_rows_served_total"
    return {str(layer): REGISTRY.get_sample_value(name, {"layer": str(layer)}) or 0.0 for layer in layers}


def by_case(ranks: list) -> list[dict]:
    """Each rank's printed JSON lines (``tests_helpers.run_ranks``), grouped by their ``case``: {case: [lines]}."""
    return [
        {case: [line for line in rank if line["case"] == case] for case in {x["case"] for x in rank}} for rank in ranks
    ]


@contextlib.contextmanager
def plugin_lines():
    """The plugin's log lines (the ``tableclient`` loggers, INFO and up) while the block runs: yields their list."""
    lines = Lines()
    logger = logging.getLogger("tableclient")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        yield lines.lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def assert_agreed(steps_by_rank: list, kill_at: int, policies) -> None:
    """Each rank's steps (``rows``: per layer "table", "zeros" or "neither"; ``check``; ``policy``; ``step`` from 0),
    rank 1's node lost before step ``kill_at``: before it every step served the table's rows; from it on both ranks'
    layers ran on zero rows (rank 0's own rows masked too: never a mix), and under policy fail both ranks refused
    each such step where the engine reads its result, naming layer 1 and the rank it failed on."""
    for rank, steps in enumerate(steps_by_rank):
        assert {s["policy"] for s in steps} == set(policies), (rank, steps)
        for s in steps:
            if s["step"] < kill_at:
                assert (s["rows"], s["check"]) == (TABLE_ROWS, "ok"), (rank, s)
                continue
            assert s["rows"] == {"1": "zeros", "14": "zeros"}, (rank, s)
            if s["policy"] == "fail":
                where = "on another rank" if rank == 0 else "here"
                assert f"layer 1: step {s['step'] + 1}'s rows were not served {where}" in s["check"], (rank, s)
            else:
                assert s["check"] == "ok", (rank, s)
        for policy in policies:
            assert len([s for s in steps if s["policy"] == policy]) > kill_at + 1, (rank, steps)
