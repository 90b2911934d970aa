"""A CPU for the native in_graph poller: the list an operator sets aside, one CPU per poller on the host.

A spinning poller that shares its core with the engine's threads is preempted and migrated now and then,
and each time is a step's tail. An operator who keeps some cores free of the engine (``taskset``,
``isolcpus``, a cpuset) names them in ``poller_cpus`` (``TABLESERVER_POLLER_CPUS="14,15"``); every
GraphStep of every rank process on this host then claims one of them for its poller, so no two pollers
share one.

A claim is an exclusive ``flock`` on ``cpu-<N>`` in the claim directory of the process's user,
``/dev/shm/tableserver-poller-cpus-<uid>/``: the kernel drops it when the process ends, however it ends, so
a crashed rank never keeps its CPU. The directory is this user's own, mode 0700: created so by the first
poller, and checked by every one (a directory, not a symbolic link, owned by this uid, open to no other
user) before anything is opened in it, through its descriptor, never through a link. Another user cannot
plant a link there that makes an engine create or lock a file of their choosing, nor take its claims; one
who made that name first (a symbolic link, their directory, a file) only keeps this user's pollers unpinned,
and ``claim_or_reason`` says who and what to remove, in one line.

Whose claims see each other's: processes of one user that share ``/dev/shm``. Engines run as different
users claim in different directories and may pin their pollers to the same CPU (give each user a list of its
own); processes that do not share ``/dev/shm`` (separate containers) do not see each other's claims either.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat

#: where each user's claim directory is made: shared by every process of the host (and containers given it)
CLAIM_BASE = "/dev/shm"
#: CPUs a thread can be pinned to (glibc's CPU_SETSIZE: the native poller's cpu_set_t)
MAX_CPUS = 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: a FIFO planted in place of a claim file opens at once (and is refused), never waits
_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def parse_cpus(text: str) -> list[int]:
    """``"14,15"`` or ``"12-15,20"`` (the kernel's cpulist form) -> [12, 13, 14, 15, 20]; "" -> [].
    ValueError (one line: the part and the form to use) on anything else."""
    cpus: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            first = last = -1
        if first < 0 or last < first:
            raise ValueError(f"poller_cpus {text!r}: {part!r} is not a CPU or a range: use e.g. '14,15' or '12-15'")
        if last >= MAX_CPUS:
            raise ValueError(f"poller_cpus {text!r}: CPU {last} is beyond the {MAX_CPUS} a poller can be pinned to")
        cpus.extend(c for c in range(first, last + 1) if c not in cpus)
    return cpus


class CpuClaim:
    """One CPU of the list, held until ``close()`` (idempotent) or the process ends."""

    def __init__(self, cpu: int, fd: int):
        self.cpu, self._fd = cpu, fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # the lock goes with the descriptor

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def claim_dir(base: str = CLAIM_BASE) -> str:
    """This process's user's claim directory under ``base``."""
    return os.path.join(base, f"tableserver-poller-cpus-{os.geteuid()}")


def claim(cpus: list[int], base: str = CLAIM_BASE) -> CpuClaim | None:
    """The first CPU of ``cpus`` no other poller of this user on this host holds, or None: every one held, or
    none can be claimed safely (``claim_or_reason`` says why)."""
    return claim_or_reason(cpus, base)[0]


def claim_or_reason(cpus: list[int], base: str = CLAIM_BASE) -> tuple[CpuClaim | None, str | None]:
    """``(claim, None)``, or ``(None, why)``: one line saying why the poller is not pinned (every CPU of
    ``cpus`` held by this user's other pollers; or the claim directory, or a CPU's file in it, is not this
    user's own: who holds it and what to remove). Never follows a symbolic link, never creates a file outside
    the user's own 0700 directory; claims nothing rather than use one it cannot trust."""
    if not cpus:
        return None, "no CPU given to claim"
    dfd, why = _open_claim_dir(base)
    if dfd is None:
        return None, why
    try:
        path = claim_dir(base)
        for cpu in cpus:
            name = f"cpu-{cpu}"
            try:
                fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    return None, _refuse(f"{path}/{name} is a symbolic link, not this user's claim file", path)
                return None, f"cannot claim CPU {cpu} in {path}: {e.strerror}"
            why = _not_ours(os.fstat(fd), f"{path}/{name}", "a plain file")
            if why:
                os.close(fd)
                return None, _refuse(why, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                return None, f"cannot lock {path}/{name}: {e.strerror}"
            return CpuClaim(cpu, fd), None
        return None, f"every CPU of {list(cpus)} is held by another poller of uid {os.geteuid()} on this host"
    finally:
        os.close(dfd)


def _open_claim_dir(base: str) -> tuple[int | None, str | None]:
    """The user's claim directory, opened (made mode 0700 if missing) and checked; else (None, why)."""
    path, name = claim_dir(base), os.path.basename(claim_dir(base))
    try:
        bfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the base may be a link (/dev/shm)
    except OSError as e:
        return None, f"no directory {base} for poller CPU claims ({e.strerror})"
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=bfd)
        except FileExistsError:
            pass
        except OSError as e:
            return None, f"cannot make {path} for poller CPU claims: {e.strerror}"
        try:
            dfd = os.open(name, _DIR_FLAGS, dir_fd=bfd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                return None, f"cannot open {path} for poller CPU claims: {e.strerror}"
            try:
                st = os.stat(name, dir_fd=bfd, follow_symlinks=False)
            except OSError:  # gone meanwhile: the next poller makes it anew
                return None, f"cannot open {path} for poller CPU claims: {e.strerror}"
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            return None, _refuse(f"{path} is {what} of {_user(st.st_uid)}, not this user's claim directory", path)
    finally:
        os.close(bfd)
    st = os.fstat(dfd)
    why = _not_ours(st, path, "a directory")
    if not why and stat.S_IMODE(st.st_mode) & 0o077:
        why = f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, open to other users (a claim directory is 0700)"
    if why:
        os.close(dfd)
        return None, _refuse(why, path)
    try:
        if stat.S_IMODE(st.st_mode) != 0o700:  # ours, closed to others: a umask took bits this user needs
            os.fchmod(dfd, 0o700)
    except OSError as e:
        os.close(dfd)
        return None, f"cannot make {path} mode 0700 for poller CPU claims: {e.strerror}"
    return dfd, None


def _not_ours(st: os.stat_result, path: str, kind: str) -> str | None:
    """Why ``st`` is not this user's own ``kind`` ("a directory", or a plain file of one link), or None."""
    if st.st_uid != os.geteuid():
        return f"{path} is owned by {_user(st.st_uid)}, not by this process's uid {os.geteuid()}"
    if kind == "a directory":
        return None if stat.S_ISDIR(st.st_mode) else f"{path} is not a directory"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a plain file"
    if st.st_nlink != 1:  # a hard link: the same file under another name, perhaps another user's
        return f"{path} has {st.st_nlink} links, not this user's claim file alone"
    return None


def _refuse(why: str, path: str) -> str:
    return f"{why}: poller CPU claims there are refused; remove it (rm -rf {path}) and restart the engine"


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
