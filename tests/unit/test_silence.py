"""A layer's silence (client/tableclient/graph/poller/silence.py), pure logic: a table whose gathers are scripted handles.

One late step makes a node silent only where the node itself did not answer (a remote source: the pollers
pass None for a table this process maps, which is never silent); each step of a silent layer issues at most
one probe, never waited for; the first probe answered ends it, a failed one is followed by another, and a
node replaced by another ends it at once. The same logic serves both pollers; their behaviour against real
daemons is in tests/daemon/test_graphpoll_sources.py and tests/daemon/test_graphstep.py."""

from __future__ import annotations

import numpy as np
import pytest
from tableclient.errors import ConnectError, GatherTimeout
from tableclient.graph.poller.silence import PROBE_ROWS, Silence


class Probe:
    """A gather handle whose outcome the test decides: pending, answered or failed."""

    def __init__(self):
        self.outcome = None  # None: in flight; True: answered; an exception: failed
        self.cancelled = False

    def done(self) -> bool:
        return self.outcome is not None

    def wait(self, timeout=None):
        if self.outcome is None:
            raise GatherTimeout("in flight")
        if self.outcome is not True:
            raise self.outcome

    def cancel(self) -> None:
        self.cancelled = True


class Table:
    def __init__(self):
        self.probes: list[Probe] = []
        self.ids: list[np.ndarray] = []

    def gather_async(self, ids, out):
        assert ids.dtype == np.int64 and out.shape == (ids.size, 264)
        self.probes.append(Probe())
        self.ids.append(ids.copy())
        return self.probes[-1]


@pytest.fixture
def table():
    return Table()


def test_a_table_mapped_here_is_never_silent(table):
    s = Silence(table, 1000, 264)
    assert not s.late(None) and not s.silent(None)
    assert table.probes == []


def test_the_first_probe_answered_ends_it(table):
    node = object()
    s = Silence(table, 1000, 264)
    assert s.late(node) and not s.late(node)  # said once
    assert s.silent(node) and len(table.probes) == 1  # the policy at once, a probe
    assert s.silent(node) and len(table.probes) == 1  # still in flight: none more, no wait
    table.probes[0].outcome = ConnectError("refused")
    assert s.silent(node) and len(table.probes) == 2  # failed: the next step probes again
    table.probes[1].outcome = True
    assert not s.silent(node) and s.node is None  # answered: this step is gathered as ever
    assert (s.probes, s.answered) == (2, 1)
    assert not s.silent(node) and len(table.probes) == 2


def test_another_node_ends_it_and_abandons_the_probe(table):
    a, b = object(), object()
    s = Silence(table, 10, 264)
    s.late(a)
    assert s.silent(a)
    assert not s.silent(b) and table.probes[0].cancelled  # a barrier: nothing lands in its buffer after


@pytest.mark.parametrize("rows", [5, 100_000])
def test_a_probe_reads_at_most_one_tokens_rows_of_the_table(table, rows):
    s = Silence(table, rows, 264)
    s.late(object())
    s.silent(s.node)
    np.testing.assert_array_equal(table.ids[0], np.arange(min(rows, PROBE_ROWS)))
