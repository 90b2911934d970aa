"""Descriptor numbers for tests in which a file made lands on the number another file just freed: what another
thread of the process may do at any time, and what tells files apart by their numbers cannot see."""

from __future__ import annotations

import os


def plug_below(n: int) -> list[int]:
    """Descriptors opened on every free number below ``n``: the next file made gets ``n`` once it is free."""
    plugs = []
    while True:
        fd = os.open(os.devnull, os.O_RDONLY)
        if fd >= n:
            os.close(fd)
            return plugs
        plugs.append(fd)


def on_freed_number(number: int, close, make, meanwhile=None):
    """``make()`` right after ``close()`` frees descriptor ``number``, every lower number taken meanwhile, so that
    the file made gets ``number``; then ``meanwhile()`` (say, another file made) before the lower numbers are
    free again. What ``make`` returned."""
    plugs = plug_below(number)
    try:
        close()
        made = make()
        if meanwhile is not None:
            meanwhile()
        return made
    finally:
        for fd in plugs:
            os.close(fd)
