"""EventCQ (tableserver.common.cqevents) on kernel Soft-RoCE: the descriptor it sleeps on is its own completion
channel's -- a completion on its CQ wakes it, and taking that event drains it -- and never another thread's,
whatever other threads do with their event files meanwhile (here done inside the channel's creation, where a
diff of /proc/self/fd could be fooled). Runs in the QEMU guest (tests/host/test_rdma_guest.py boots it)."""

from __future__ import annotations

import os
import select
import types

import pytest
from conftest import EVENT_TIMEOUT, wait_for
from fdnumbers import on_freed_number

from tableserver.common.cqevents import EVENT_INODE, EventCQ, same_file
from tableserver.common.verbs import Device, RegisteredBuffer, create_rc_qp, verbs

pytestmark = pytest.mark.rdma

WR_ID = 0x5EED


@pytest.fixture
def dev():
    with Device("rxe_lo") as d:
        yield d


def event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == EVENT_INODE:
                fds.add(int(name))
        except OSError:
            continue
    return fds


def channel(v, context):
    """A completion channel made here and the number of its descriptor (the test's own thread makes every event
    file of this process meanwhile: the one new number is its)."""
    before = event_fds()
    ch = v.cq.CompChannel(context)
    (fd,) = event_fds() - before
    return ch, fd


def readable(fd: int, timeout: float) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout * 1e3))


def meanwhile(v, during):
    """pyverbs as EventCQ sees it, but ``during(make)`` runs around the creation of its completion channel: what
    another thread of the process does while that channel is made."""
    return types.SimpleNamespace(cq=types.SimpleNamespace(CompChannel=lambda ctx: during(lambda: v.cq.CompChannel(ctx)),
                                                          CQ=v.cq.CQ))  # fmt: skip


def completion_wakes(dev, ecq: EventCQ) -> None:
    """A completion on ``ecq``'s CQ (a receive flushed by its QP's move to the error state) once armed: ``fd``
    turns readable, ``take_event`` drains it, and the completion is the flushed receive."""
    v = verbs()
    e = v.e
    qp, _ = create_rc_qp(dev, ecq.cq, 1, 1, 0)
    buf = RegisteredBuffer(dev, 64, e.IBV_ACCESS_LOCAL_WRITE)
    try:
        wr = v.wr.RecvWR(wr_id=WR_ID, num_sge=1, sg=[v.wr.SGE(buf.addr, 64, buf.mr.lkey)])
        qp.post_recv(wr)
        ecq.arm()
        assert not readable(ecq.fd, 0), "the channel's descriptor is readable before any completion"
        attr = v.qp.QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        qp.modify(attr, e.IBV_QP_STATE)
        assert readable(ecq.fd, EVENT_TIMEOUT), "a completion on the CQ did not wake its descriptor"
        ecq.take_event()
        wcs = wait_for(lambda: ecq.cq.poll(1)[1], "the flushed receive's completion")
        assert wcs[0].wr_id == WR_ID and wcs[0].status == e.IBV_WC_WR_FLUSH_ERR
        assert not readable(ecq.fd, 0), "taking the CQ's event did not drain the descriptor"
    finally:
        qp.close()
        buf.close()


def test_the_descriptor_is_its_channels_own_and_wakes_on_its_cqs_completions(dev):
    """Beside another channel of the process (and the device's own event file): the EventCQ's descriptor wakes
    for its CQ's completion, the other channel's stays quiet; close() is idempotent and closes the descriptor."""
    v = verbs()
    other, other_fd = channel(v, dev.context)
    try:
        ecq = EventCQ(v, dev.context, 16)
        try:
            assert ecq.fd is not None, ecq.why
            assert not same_file(ecq.fd, other_fd)
            completion_wakes(dev, ecq)
            assert not readable(other_fd, 0)
            fd = ecq.fd
            assert same_file(fd, fd)
        finally:
            ecq.close()
            ecq.close()
        assert ecq.fd is None
        with pytest.raises(OSError):
            os.fstat(fd)  # closed with the channel
    finally:
        other.close()


def test_a_number_another_thread_freed_meanwhile_still_gives_the_channels_descriptor(dev):
    """Another thread closes its channel while this one is made, which takes its number: the new channel is
    still told apart (a /proc/self/fd diff saw no new descriptor there, and polled the CQ for good)."""
    v = verbs()
    theirs, number = channel(v, dev.context)
    landed = []

    def during(make):
        return on_freed_number(number, theirs.close, make, lambda: landed.append(number in event_fds()))

    ecq = EventCQ(meanwhile(v, during), dev.context, 16)
    try:
        assert landed == [True], "the new channel did not take the freed number (the test's set-up)"
        assert ecq.fd is not None, getattr(ecq, "why", "no descriptor")
        completion_wakes(dev, ecq)
    finally:
        ecq.close()


def test_a_channel_another_thread_made_meanwhile_is_never_taken_for_its_own(dev):
    """Another thread closes its channel, this one takes its number, and that thread makes another channel
    meanwhile: a /proc/self/fd diff sees exactly one new descriptor -- the other thread's. The EventCQ has no
    descriptor then (its CQ is polled) and says why; never that one."""
    v = verbs()
    theirs, number = channel(v, dev.context)
    made = []

    def during(make):
        return on_freed_number(number, theirs.close, make, lambda: made.append(channel(v, dev.context)))

    ecq = EventCQ(meanwhile(v, during), dev.context, 16)
    try:
        their_fd = made[0][1]
        assert ecq.fd is None or not same_file(ecq.fd, their_fd), "the EventCQ took another thread's channel"
        assert ecq.fd is None
        assert ecq.why == f"2 new {EVENT_INODE} files appeared while one was made (another thread's)"
    finally:
        ecq.close()
        made[0][0].close()
