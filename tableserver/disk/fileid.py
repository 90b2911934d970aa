"""Which file an open fd reads: :class:`FileIdentity`, compared across the opens of one table file
(its header, its verification, its serving) so that all of them read the same, unchanged file."""

from __future__ import annotations

import os
import stat
from typing import NamedTuple


class FileIdentity(NamedTuple):
    """Which file an open fd reads, and its state: device and inode, size, mtime and ctime (ns). A block
    device (``rdev`` != 0) has its size from SEEK_END and no times (its node's mean nothing)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    rdev: int

    @classmethod
    def of(cls, fd: int) -> FileIdentity:
        """The identity of the file open as ``fd`` now (its file position is kept)."""
        st = os.fstat(fd)
        if stat.S_ISBLK(st.st_mode):
            pos = os.lseek(fd, 0, os.SEEK_CUR)
            size = os.lseek(fd, 0, os.SEEK_END)
            os.lseek(fd, pos, os.SEEK_SET)
            return cls(st.st_dev, st.st_ino, size, 0, 0, st.st_rdev)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, 0)

    def change_at(self, fd: int, path: str) -> str | None:
        """How the file open as ``fd``, or the file now at ``path``, differs from this one (None: both are
        this file, unchanged). A replaced file is named so first: replacing a file also moves the old
        inode's ctime (its link count drops)."""
        try:
            st = os.stat(path)
        except OSError:
            return "was removed or renamed"
        if (st.st_dev, st.st_ino) != (self.dev, self.ino) or (self.rdev and st.st_rdev != self.rdev):
            return "was replaced (another file at the path)"
        return self.change(FileIdentity.of(fd))

    def change(self, now: FileIdentity) -> str | None:
        """How the file ``now`` differs from this one ("was replaced ...", "changed size ..."), None: the
        same file, unchanged."""
        if (now.dev, now.ino, now.rdev) != (self.dev, self.ino, self.rdev):
            return "was replaced (another file at the path)"
        if now.size != self.size:
            return f"changed size ({self.size} -> {now.size} bytes)"
        if now.mtime_ns != self.mtime_ns:
            return "was modified (mtime changed)"
        if now.ctime_ns != self.ctime_ns:
            return "was modified (ctime changed: written in place, or its mode or links changed)"
        return None
