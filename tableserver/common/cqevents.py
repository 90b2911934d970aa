"""A completion queue whose completions a thread can sleep for in ``poll()``: pyverbs' CQ on a completion
channel of its own, and that channel's file descriptor.

pyverbs (rdma-core 44 to 59) does not expose a completion channel's descriptor, and its
``CompChannel.get_cq_event()`` blocks holding the GIL. The descriptor is the one anonymous
``[infinibandevent]`` inode that creating the channel adds to this process: read off /proc/self/fd around
the creation, under a lock so that no other channel of this module's is made meanwhile, and refused (``fd``
None: the caller polls the CQ instead) unless exactly one such inode appeared. Once ``poll()`` reports it
readable, ``take_event()`` returns at once.

The cycle a waiting thread follows: ``arm()`` (the next completion raises one event), poll the CQ once more
(a completion that came before the arm raises none), sleep in ``poll()`` on ``fd``, ``take_event()``.
"""

from __future__ import annotations

import os
import threading

#: what /proc/self/fd/N links to for a uverbs event file (comp channels and a context's async events)
EVENT_INODE = "anon_inode:[infinibandevent]"

_creating = threading.Lock()


def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == EVENT_INODE:
                fds.add(int(name))
        except OSError:  # closed meanwhile (listdir's own descriptor among them)
            continue
    return fds


class EventCQ:
    """``cq`` (a pyverbs CQ of ``cqe`` entries) on a completion channel of its own; ``fd`` to ``poll()`` for
    its events, or None where the channel's descriptor could not be told apart. ``close()`` is idempotent
    and destroys the CQ before the channel; the QPs on the CQ must be destroyed first."""

    def __init__(self, v, context, cqe: int):
        with _creating:
            before = _event_fds()
            self.channel = v.cq.CompChannel(context)
            new = _event_fds() - before
        self.fd = new.pop() if len(new) == 1 else None
        try:
            self.cq = v.cq.CQ(context, cqe, None, self.channel, 0)
        except BaseException:
            self.channel.close()
            raise
        self._closed = False

    def arm(self) -> None:
        """The next completion on the CQ raises one event (``fd`` turns readable)."""
        self.cq.req_notify()

    def take_event(self) -> None:
        """Consumes and acknowledges the event ``fd`` holds: call it only once ``poll()`` says it is readable
        (otherwise it blocks, holding the GIL)."""
        self.channel.get_cq_event(self.cq)
        self.cq.ack_events(1)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.cq.close()
        finally:
            self.channel.close()
