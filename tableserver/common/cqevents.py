"""A completion queue whose completions a thread can sleep for in ``poll()``: pyverbs' CQ on a completion
channel of its own, and a descriptor of that channel's file.

pyverbs (rdma-core 44 to 59) does not expose a completion channel's descriptor, and its
``CompChannel.get_cq_event()`` blocks holding the GIL. Nor can the descriptor be told by its name or its
inode: every uverbs event file (each completion channel's, each device context's asynchronous events) is an
anonymous ``[infinibandevent]`` inode, one and the same inode for all of them, so ``/proc/self/fd`` links and
``fstat`` say "an event file", never whose. What tells two of them apart is the open file itself, which
kcmp(2) compares (``KCMP_FILE``: whether two descriptors are one open file). So :func:`created_file`, around
the channel's creation: first it holds a duplicate of every event descriptor of the process (those files stay
open, whoever closes their descriptors meanwhile), then the channel is made, then the channel's file is the
one event file open now that is none of the held ones. A file another thread made meanwhile makes two such
files: then there is no descriptor (``fd`` None, ``why`` says so; the caller polls the CQ instead), never
another thread's. Where kcmp(2) is not allowed (a seccomp filter without it, e.g. a container runtime's
default one) and the process had event files before, there is none either (with none before, the one new
file is the channel's: no comparison needed). ``fd`` is a duplicate of the channel's own file, closed with
the channel.
Once ``poll()`` reports it readable, ``take_event()`` returns at once.

The cycle a waiting thread follows: ``arm()`` (the next completion raises one event), poll the CQ once more
(a completion that came before the arm raises none), sleep in ``poll()`` on ``fd``, ``take_event()``.
"""

from __future__ import annotations

import ctypes
import os
import threading

#: what /proc/self/fd/N links to for a uverbs event file (comp channels and a context's async events)
EVENT_INODE = "anon_inode:[infinibandevent]"
#: kcmp(2)'s number per machine (Linux >= 3.5 with CONFIG_KCMP); KCMP_FILE compares two descriptors' files
SYS_KCMP = {"x86_64": 312, "aarch64": 272, "ppc64le": 354, "s390x": 343, "riscv64": 272}
KCMP_FILE = 0

_creating = threading.Lock()
_syscall = None


def same_file(a: int, b: int) -> bool:
    """Whether descriptors ``a`` and ``b`` of this process are one open file (kcmp(2) KCMP_FILE); OSError (its
    errno) where kcmp is not there or not allowed, or a descriptor is not open."""
    global _syscall
    number = SYS_KCMP.get(os.uname().machine)
    if number is None:
        raise OSError(38, f"kcmp(2)'s number on {os.uname().machine} is not known here")
    if _syscall is None:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
    pid = os.getpid()
    r = _syscall(number, pid, pid, KCMP_FILE, a, b)
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"kcmp(2): {os.strerror(err)}")
    return r == 0


def _link(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed meanwhile
        return ""


def _hold(link: str, skip: frozenset = frozenset()) -> dict[int, int]:
    """``{number: duplicate}`` for every descriptor of this process (but ``skip``) that links to ``link``: a
    descriptor of each of those files of the process's own (closed by the caller)."""
    held = {}
    mine = set(skip)  # and the duplicates made here (one may take the number listdir's own descriptor had)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in mine or _link(fd) != link:
            continue
        try:
            dup = os.dup(fd)
        except OSError:  # closed meanwhile (listdir's own descriptor among them)
            continue
        if _link(dup) == link:  # else the number was another file's by the time of the dup
            held[fd] = dup
            mine.add(dup)
        else:
            os.close(dup)
    return held


def created_file(link: str, make) -> tuple[object, int | None, str]:
    """``make()``, and a descriptor of the one file linking to ``link`` (an anonymous inode's kind) that it made:
    ``(what make returned, a duplicate of that file's descriptor, "")``, or ``(..., None, why)`` where that file
    cannot be told apart for sure (another thread made one too meanwhile, or kcmp(2) is not allowed). Never a
    descriptor of a file ``make`` did not make. The caller closes the descriptor."""
    before = _hold(link)
    try:
        made = make()
        after = _hold(link, frozenset(before.values()))
        try:
            new = [
                dup
                for number, dup in after.items()
                if not (number in before and same_file(dup, before[number]))  # the usual: still the file it was
                and not any(same_file(dup, held) for held in before.values())
            ]
            why = "" if len(new) == 1 else f"{len(new)} new {link} files appeared while one was made (another thread's)"
        except OSError as e:
            new, why = (
                [],
                f"kcmp(2) cannot compare this process's descriptors ({e.strerror}): allow kcmp in its seccomp profile",
            )
        fd = new[0] if len(new) == 1 else None
        for dup in after.values():
            if dup != fd:
                os.close(dup)
    finally:
        for dup in before.values():
            os.close(dup)
    return made, fd, why


class EventCQ:
    """``cq`` (a pyverbs CQ of ``cqe`` entries) on a completion channel of its own; ``fd`` to ``poll()`` for
    its events (a descriptor of the channel's own file), or None where it could not be told apart for sure
    (``why`` says why). ``close()`` is idempotent and destroys the CQ before the channel; the QPs on the CQ
    must be destroyed first."""

    def __init__(self, v, context, cqe: int):
        with _creating:  # two of this module's channels made at once would hide each other
            self.channel, self.fd, self.why = created_file(EVENT_INODE, lambda: v.cq.CompChannel(context))
        try:
            self.cq = v.cq.CQ(context, cqe, None, self.channel, 0)
        except BaseException:
            self._close_fd()
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

    def _close_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.cq.close()
        finally:
            self._close_fd()
            self.channel.close()
