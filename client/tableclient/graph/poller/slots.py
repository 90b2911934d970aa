"""The Python poller's step state per in_graph layer: a pure state machine, no threads, no clocks.

One :class:`Slot` per layer walks ``idle -> armed -> gathering -> serving -> released`` (or ``armed`` /
``gathering`` -> ``serving`` by the watchdog); :meth:`Slot.arm` and :meth:`Slot.reset` start over. The
poller's two threads (the layer's poller and the watchdog) hold one lock around every call here and act on
what the calls answer; the rules live here, where a test drives them one event at a time:

* a release is for the step it was decided for (``step``, bumped by every arm and reset), never a later one;
* only one side takes a step to release it (:meth:`Slot.take`): the poller only a step it is gathering, the
  watchdog one armed or gathering;
* a step the watchdog took before its graph published the ids *owes* that flag (``owe_ids``): when it comes,
  :meth:`Slot.ids` answers ``"owed"`` and the poller consumes it without gathering; ids of a step nobody
  armed answer ``"unarmed"`` (released at once with zeros: the GPU never waits on nobody);
* the next step is armed only once the last one was released and its flags consumed (:meth:`Slot.busy`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: states a step may be released from, by who takes it
TAKES = {"poller": ("gathering",), "watchdog": ("armed", "gathering")}


@dataclass
class Slot:
    """One in_graph layer's step state (see the module docstring)."""

    layer: int
    plan: object
    ids_flag: int
    rows_flag: int
    ok_flag: int = -1  # the host flag saying whether the released rows are the table's (1) or the policy's (0)
    state: str = "idle"
    tokens: int = 0
    deadline: float = 0.0
    handle: object = None
    error: BaseException | None = None
    seen: float = 0.0  # perf_counter() when the graph's ids were seen
    step: int = 0  # bumped by every arm and reset: a release is for the step it was decided for
    owe_ids: bool = False  # released before its graph published the ids: that late flag is not a new step's
    released_at: float = 0.0  # time.monotonic() of the last release
    live: object = None  # this step's live ids' positions, where some ids are dead (gathered into scratch)
    silence: object = None  # whether its node answers since a step's rows did not come after its ids
    node: object = None  # the node the step in progress reads (None: a mapping here, or routed)

    def busy(self, rows_flag: int) -> bool:
        """Whether the last step is still in flight: not released, its late ids owed, or its release not yet
        consumed by its graph (``rows_flag``, the flag's value now, still 1)."""
        return self.state not in ("idle", "released") or self.owe_ids or rows_flag != 0

    def arm(self, tokens: int, deadline: float) -> None:
        """The next step: ``tokens`` tokens, its rows due by ``deadline``."""
        self.state, self.tokens, self.deadline, self.handle, self.error = "armed", tokens, deadline, None, None
        self.live = None
        self.step += 1

    def ids(self, seen: float) -> str:
        """The graph published this layer's ids (the poller saw them at ``seen``): ``"owed"`` (the late flag of
        a step already released: consumed, nothing to do), ``"unarmed"`` (nobody armed a step: release it with
        zeros) or ``"gather"`` (the armed step is now gathering)."""
        if self.owe_ids:
            self.owe_ids = False
            return "owed"
        if self.state != "armed":
            return "unarmed"
        self.state, self.seen, self.live = "gathering", seen, None
        return "gather"

    def take(self, step: int, by: str) -> str | None:
        """``by`` ("poller" or "watchdog") takes step ``step`` to release it: None where it is not theirs (a
        later step, or the other side took it); else ``"ids_late"`` (the watchdog took it before its ids came:
        that flag is now owed), ``"late"`` (the watchdog took it while it was gathering) or ``"done"``."""
        if self.step != step or self.state not in TAKES[by]:
            return None
        how = "done"
        if by == "watchdog":
            how = "ids_late" if self.state == "armed" else "late"
            self.owe_ids = self.owe_ids or how == "ids_late"
        self.state = "serving"  # ours to release: the other side leaves it alone
        return how

    def release(self, error: BaseException | None, now: float) -> None:
        """The staging holds the step's rows: its graph may copy them (``error``: the policy's, for after_replay)."""
        self.error, self.state, self.released_at = error, "released", now

    def reset(self) -> None:
        """After a replay that may not have run: nothing decided before applies after (a new ``step``)."""
        self.state, self.error, self.owe_ids, self.handle = "idle", None, False, None
        self.step += 1

    def due(self, now: float) -> bool:
        """Whether the watchdog takes this step now: armed or gathering, and past its deadline."""
        return self.state in TAKES["watchdog"] and self.deadline <= now
