"""The Python poller's step state machine (tableclient.graph.poller.slots), one event at a time: no threads, no
clocks. Each rule the poller's two threads rely on is a case here."""

import pytest
from tableclient.graph.poller.slots import Slot


def slot() -> Slot:
    return Slot(14, plan=None, ids_flag=0, rows_flag=16, ok_flag=32)


def test_a_step_gathered_and_released_walks_every_state():
    s = slot()
    assert not s.busy(0) and s.state == "idle"
    s.arm(4, deadline=10.0)
    assert (s.state, s.tokens, s.deadline, s.step) == ("armed", 4, 10.0, 1) and s.busy(0)
    assert s.ids(seen=1.0) == "gather" and s.state == "gathering" and s.seen == 1.0
    assert s.take(1, "poller") == "done" and s.state == "serving"
    s.release(None, now=2.0)
    assert (s.state, s.released_at, s.error) == ("released", 2.0, None)
    assert s.busy(1), "released, but its graph has not consumed the release yet (rows flag 1)"
    assert not s.busy(0)


def test_only_one_side_takes_a_step():
    s = slot()
    s.arm(4, 10.0)
    s.ids(1.0)
    assert s.take(1, "watchdog") == "late"
    assert s.take(1, "poller") is None, "the watchdog took it: the poller's late finish leaves it alone"
    assert s.take(1, "watchdog") is None


def test_the_poller_never_takes_a_step_it_is_not_gathering():
    s = slot()
    s.arm(4, 10.0)
    assert s.take(1, "poller") is None, "armed, its ids not seen: only the watchdog may release it"


def test_a_release_is_for_the_step_it_was_decided_for():
    s = slot()
    s.arm(4, 10.0)
    s.ids(1.0)
    decided = s.step
    s.reset()  # a failed replay: the engine resets, then arms the next step
    s.arm(4, 20.0)
    s.ids(2.0)
    assert s.take(decided, "watchdog") is None and s.take(decided, "poller") is None
    assert s.take(s.step, "poller") == "done"


def test_a_step_released_before_its_ids_owes_the_late_flag():
    s = slot()
    s.arm(4, 10.0)
    assert s.take(1, "watchdog") == "ids_late" and s.owe_ids
    s.release(TimeoutError("late"), now=10.0)
    assert s.busy(0), "the graph's ids flag is still to come: the next step may not be armed"
    assert s.ids(11.0) == "owed" and not s.owe_ids and s.state == "released", "consumed, nothing gathered"
    assert not s.busy(0)


def test_ids_of_a_step_nobody_armed_are_released_at_once():
    s = slot()
    assert s.ids(1.0) == "unarmed"
    s.arm(4, 10.0)
    s.ids(1.0)
    s.take(1, "poller")
    s.release(None, 2.0)
    assert s.ids(3.0) == "unarmed", "a second replay of the same arm"


def test_reset_forgets_the_owed_flag_and_the_step():
    s = slot()
    s.arm(4, 10.0)
    s.take(1, "watchdog")
    s.handle = object()
    s.reset()
    assert (s.state, s.owe_ids, s.handle, s.error, s.step) == ("idle", False, None, None, 2)


@pytest.mark.parametrize(
    ("state", "deadline", "due"),
    [("armed", 5.0, True), ("gathering", 5.0, True), ("armed", 6.0, False), ("serving", 5.0, False),
     ("released", 5.0, False), ("idle", 0.0, False)],
)  # fmt: skip
def test_the_watchdog_takes_only_live_steps_past_their_deadline(state, deadline, due):
    s = slot()
    s.state, s.deadline = state, deadline
    assert s.due(now=5.5) is due


def test_a_new_arm_forgets_the_last_steps_live_ids():
    s = slot()
    s.arm(4, 10.0)
    s.ids(1.0)
    s.live = [0, 1]
    s.take(1, "poller")
    s.release(None, 2.0)
    s.arm(4, 20.0)
    assert s.live is None and s.handle is None and s.error is None
