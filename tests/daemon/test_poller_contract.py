"""The poller contract (tableclient.graph.poller.Poller), one suite run against both implementations, native and
Python, built through ``tableclient.graph.poller.start`` on a real daemon and client. A thread stands in for the
graph: it publishes a step's ids flag, waits for the rows flag, reads the staging and consumes the release."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, wait_for

torch = pytest.importorskip("torch")

from tableclient import TableClient  # noqa: E402
from tableclient.errors import TableClientError  # noqa: E402
from tableclient.graph import poller as pollers  # noqa: E402
from tableclient.graph.errors import GraphStepError  # noqa: E402
from tableclient.graph.poller import native  # noqa: E402
from tableclient.graph.poller.silence import Silence  # noqa: E402
from tableclient.graph.streams import GraphFlags, wait_flag  # noqa: E402
from tableclient.step import EngramStep, LayerPlan  # noqa: E402

PLAN = LayerPlan(14, "engram.layer14", 9.3e-3)
MAX_TOKENS = 8


@pytest.fixture(params=["native", "python"])
def kind(request):
    if request.param == "native" and not native.BUILT:
        pytest.skip("tableclient.graph.poller._native is not built here")
    return request.param


@pytest.fixture(scope="module")
def local(demo_file):
    return local_tables(demo_file)


class Rig:
    """One in_graph layer's poller, its flags, ids and staging, and the graph's side of a step."""

    def __init__(self, client, kind: str, policy: str = "zeros", budget: float = EVENT_TIMEOUT):
        self.step = EngramStep(client, [PLAN], MAX_TOKENS, deadlines=False, policy=policy, pin=False)
        self.flags = GraphFlags(torch, 1, False)
        self.ids = np.zeros((MAX_TOKENS, 24), np.int64)
        self.staging = self.step.staging[PLAN.layer]
        self.staging = self.staging.numpy() if hasattr(self.staging, "numpy") else self.staging
        self.at = [self.flags.index(0, which) for which in (0, 1, 2)]
        spec = [(PLAN, *self.at, self.ids, self.staging)]
        self.poller = pollers.start(kind, client, spec, self.flags.host, policy, self.step, timeout=EVENT_TIMEOUT,
                                    budgets={PLAN.layer: budget})  # fmt: skip
        assert self.poller.kind == kind

    def replay(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """The graph's side of one step: publish ``ids``, wait for the release, copy, consume it. (rows, ok)."""
        host = self.flags.host
        self.ids[: len(ids)] = ids
        host[self.at[0]] = 1
        assert wait_flag(host, self.at[1], 1, EVENT_TIMEOUT), "the step was never released"
        rows, ok = self.staging[: len(ids)].copy(), int(host[self.at[2]])
        host[self.at[1]] = 0
        return rows, ok

    def close(self):
        self.poller.close()
        self.step.abandon()


def test_a_step_is_released_with_the_tables_rows(daemon, local, kind):
    with TableClient(daemon.address, transport="tcp") as c:
        rig = Rig(c, kind)
        try:
            rng = np.random.default_rng(5)
            for tokens in (1, 8, 3):
                ids = rng.integers(0, local[PLAN.table].shape[0], (tokens, 24))
                before = time.monotonic()
                rig.poller.arm(tokens, EVENT_TIMEOUT)
                rows, ok = rig.replay(ids)
                np.testing.assert_array_equal(rows, local[PLAN.table][ids])
                assert ok == 1 and rig.poller.released_at(PLAN.layer) >= before
            rig.poller.account()
            assert isinstance(rig.poller.silence(PLAN.layer), Silence)
        finally:
            rig.close()


def test_ids_that_never_come_are_released_by_the_deadline_and_owed(daemon, local, kind):
    """A replay armed and never launched: released with the policy's zeros at the deadline; the next arm waits
    (bounded) for that step's ids flag; once the late flag came and was taken, steps go on."""
    with TableClient(daemon.address, transport="tcp") as c:
        rig = Rig(c, kind)
        try:
            rig.poller.arm(2, 0.3)
            assert wait_flag(rig.flags.host, rig.at[1], 1, EVENT_TIMEOUT), "the deadline released nothing"
            assert int(rig.flags.host[rig.at[2]]) == 0, "zeros: not the table's rows"
            assert not rig.staging[:2].any()
            rig.flags.host[rig.at[1]] = 0  # the graph consumed the release
            with pytest.raises(GraphStepError, match="was not released and consumed within"):
                rig.poller.arm(2, 0.3)  # the late ids are owed: no new step yet
            rig.flags.host[rig.at[0]] = 1  # the late replay's ids, at last: taken without a gather
            wait_for(lambda: rig.flags.host[rig.at[0]] == 0, "the owed ids taken")
            ids = np.arange(48).reshape(2, 24)
            rig.poller.arm(2, EVENT_TIMEOUT)
            rows, ok = rig.replay(ids)
            np.testing.assert_array_equal(rows, local[PLAN.table][ids])
            assert ok == 1
        finally:
            rig.close()


def test_policy_fail_raises_in_after_replay(daemon, kind):
    with TableClient(daemon.address, transport="tcp") as c:
        rig = Rig(c, kind, policy="fail")
        try:
            rig.poller.arm(1, 0.3)  # its ids never come
            with pytest.raises(TableClientError, match="^layer 14: "):  # the first failed layer's error
                rig.poller.after_replay(EVENT_TIMEOUT)
            assert int(rig.flags.host[rig.at[1]]) == 1 and int(rig.flags.host[rig.at[2]]) == 0
        finally:
            rig.close()


def test_reset_clears_a_step_armed_and_never_run(daemon, local, kind):
    with TableClient(daemon.address, transport="tcp") as c:
        rig = Rig(c, kind)
        try:
            rig.poller.arm(1, EVENT_TIMEOUT)
            rig.poller.reset()
            t0 = time.monotonic()
            rig.poller.arm(1, EVENT_TIMEOUT)  # at once: nothing of the reset step is owed
            assert time.monotonic() - t0 < EVENT_TIMEOUT / 2
            ids = np.arange(24).reshape(1, 24)
            rows, ok = rig.replay(ids)
            np.testing.assert_array_equal(rows, local[PLAN.table][ids])
        finally:
            rig.close()


def test_close_releases_every_flag_and_refuses_arms(daemon, kind):
    with TableClient(daemon.address, transport="tcp") as c:
        rig = Rig(c, kind)
        rig.close()
        rig.poller.close()  # idempotent
        assert int(rig.flags.host[rig.at[1]]) == 1, "a graph replayed after close waits for nobody"
        done = threading.Event()

        def arm():
            with pytest.raises(GraphStepError, match="closed"):
                rig.poller.arm(1, EVENT_TIMEOUT)
            done.set()

        t = threading.Thread(target=arm)
        t.start()
        t.join(EVENT_TIMEOUT)
        assert done.is_set()
        rig.poller.reset()  # nothing once closed
