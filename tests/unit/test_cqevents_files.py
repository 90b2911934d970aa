"""How tableserver.common.cqevents tells the descriptor of the file it made from every other of its kind: by the
open file (kcmp(2)), never by a descriptor's number or its /proc link, which another thread's file can share.
Here with eventfds (an anonymous inode of one kind for all, as every uverbs event file is); the completion
channels themselves, on Soft-RoCE, are in tests/rdma/test_cqevents.py."""

from __future__ import annotations

import os

import pytest
from fdnumbers import on_freed_number

from tableserver.common import cqevents
from tableserver.common.cqevents import created_file, same_file

EVENTFD = "anon_inode:[eventfd]"


def close_all(*fds) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def test_the_file_made_is_found_among_others_of_its_kind():
    others = [os.eventfd(0) for _ in range(3)]
    made, fd, why = created_file(EVENTFD, lambda: os.eventfd(0))
    try:
        assert why == "" and fd not in (None, made) and same_file(fd, made)
        assert not any(same_file(fd, o) for o in others)
        os.eventfd_write(made, 1)  # the descriptor is the file's own: what one sees, the other does
        assert os.eventfd_read(fd) == 1
    finally:
        close_all(made, fd, *others)


def test_a_number_another_thread_freed_and_the_file_made_took_is_still_told_apart():
    """Another thread closes its file meanwhile and the new one gets its number (a /proc diff sees nothing new)."""
    theirs = os.eventfd(0)

    def make():
        return on_freed_number(theirs, lambda: os.close(theirs), lambda: os.eventfd(0))

    made, fd, why = created_file(EVENTFD, make)
    try:
        assert made == theirs  # the number theirs had
        assert why == "" and same_file(fd, made)
    finally:
        close_all(made, fd)


def test_a_file_another_thread_made_meanwhile_gives_no_descriptor_never_theirs():
    """Another thread closes its file, the new one takes its number, and that thread makes another: two new
    files (a /proc diff would see only theirs, at a new number): no descriptor, and why."""
    theirs = os.eventfd(0)
    made_meanwhile = []

    def make():
        return on_freed_number(
            theirs, lambda: os.close(theirs), lambda: os.eventfd(0), lambda: made_meanwhile.append(os.eventfd(0))
        )

    made, fd, why = created_file(EVENTFD, make)
    try:
        assert fd is None
        assert why == f"2 new {EVENTFD} files appeared while one was made (another thread's)"
    finally:
        close_all(made, *made_meanwhile)


def test_a_file_another_thread_made_and_closed_meanwhile_does_not_count():
    def make():
        transient = os.eventfd(0)
        ours = os.eventfd(0)
        os.close(transient)
        return ours

    made, fd, why = created_file(EVENTFD, make)
    try:
        assert why == "" and same_file(fd, made)
    finally:
        close_all(made, fd)


def test_where_kcmp_is_not_there_no_descriptor_and_why(monkeypatch):
    """With files of the kind there before, only kcmp(2) tells the new one apart: none without it. With none
    there before, the one new file is the one made (another made meanwhile would make two): no kcmp needed."""
    monkeypatch.setattr(cqevents, "SYS_KCMP", {})
    other = os.eventfd(0)
    before = set(os.listdir("/proc/self/fd"))
    made, fd, why = created_file(EVENTFD, lambda: os.eventfd(0))
    try:
        assert fd is None and why.startswith("kcmp(2) cannot compare this process's descriptors (")
    finally:
        close_all(made)
    assert set(os.listdir("/proc/self/fd")) <= before  # no duplicate left behind
    os.close(other)
    # none of the kind left in this process, unless another test's (gRPC keeps eventfds): then kcmp is needed
    others = [n for n in os.listdir("/proc/self/fd") if _links_to(n, EVENTFD)]
    made, fd, why = created_file(EVENTFD, lambda: os.eventfd(0))
    try:
        if others:
            assert fd is None and why.startswith("kcmp(2) cannot compare"), (others, why)
            return
        assert why == "" and fd is not None
        os.eventfd_write(made, 1)
        assert os.eventfd_read(fd) == 1
    finally:
        close_all(made, fd)


def _links_to(number: str, link: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{number}") == link
    except OSError:  # closed meanwhile (listdir's own descriptor among them)
        return False


def test_nothing_is_left_open_when_making_fails():
    before = set(os.listdir("/proc/self/fd"))
    keep = os.eventfd(0)

    def make():
        raise RuntimeError("no channel")

    with pytest.raises(RuntimeError):
        created_file(EVENTFD, make)
    os.close(keep)
    assert set(os.listdir("/proc/self/fd")) <= before
