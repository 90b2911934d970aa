"""The bounds every timeout the client takes is checked against, where it is accepted.

A timeout becomes a deadline: ``time.monotonic()`` plus the timeout, and in the native poller nanoseconds in
an int64. ``inf`` or ``1e10`` seconds overflow that (a deadline already passed: every step released at once
with zeros) and ``nan`` compares false with everything; no deployment means either. So every timeout is a
finite number of seconds, above zero, and at most a day: the option's own one-line error otherwise.
"""

from __future__ import annotations

import math

#: the longest timeout taken, in seconds (a day)
MAX_TIMEOUT_S = 86400.0


def timeout_error(name: str, value) -> str | None:
    """Why ``value`` is no timeout for option ``name`` (one line naming it and what to use), or None."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:  # nan too
        return f"{name} must be seconds above 0 and at most {MAX_TIMEOUT_S:g} (a day), got {value!r}"
    return None


def check_timeout(name: str, value) -> float:
    """``value`` as seconds, or ValueError saying why it is no timeout for option ``name``."""
    why = timeout_error(name, value)
    if why is not None:
        raise ValueError(why)
    return float(value)
