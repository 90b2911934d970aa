"""What a failed disk read says: :class:`DiskReadError`, and :class:`ReadErrors`, the one-line errors of one
reader's files (each naming the file, the offset and the fix), shared by the reader
(:mod:`tableserver.disk.reader`), its files (:mod:`tableserver.disk.files`) and its engines
(:mod:`tableserver.disk.engines`)."""

from __future__ import annotations

import errno as errno_module

from tableserver.errors import TableFileError


class DiskReadError(TableFileError):
    """A disk table's read failed (EIO, a short read, a file changed or replaced under the reader, or a
    read past the timeout). One line naming the file, the offset and the fix; ``errno`` is the OS error
    number where one caused it."""


class ReadErrors:
    """The :class:`DiskReadError` of each fault of a reader of ``paths`` (file ``i`` is ``paths[i]``) whose
    waits are bounded by ``timeout`` seconds."""

    __slots__ = ("paths", "timeout")

    def __init__(self, paths: list[str], timeout: float):
        self.paths, self.timeout = paths, timeout

    def read(self, i: int, at: int, e: OSError) -> DiskReadError:
        """A read of file ``i`` at byte ``at`` failed with ``e``."""
        return DiskReadError(
            f"{self.paths[i]}: read error at byte {at} ({e.strerror or e}): the drive or file is failing; "
            "check the kernel log (dmesg) and re-copy the table to a healthy drive",
            e.errno,
        )

    def short(self, i: int, at: int, got: int, need: int) -> DiskReadError:
        """A read of file ``i`` at byte ``at`` got ``got`` of the ``need`` bytes the table has there."""
        return DiskReadError(
            f"{self.paths[i]}: short read at byte {at}: {got} of {need} bytes (the file "
            "shrank or was truncated since it was opened): re-copy the table and restart the reader"
        )

    def timed_out(self, npg: int) -> DiskReadError:
        """A batch of ``npg`` pages not back within the timeout."""
        return DiskReadError(
            f"{self.paths[0]}: reads of {npg} pages took over {self.timeout:g} s: the drive is stalled or "
            "overloaded; check it (dmesg, iostat) or raise timeout",
            errno_module.ETIMEDOUT,
        )

    def still_in_flight(self) -> DiskReadError:
        """Reads of an earlier (abandoned) batch still not back: the pool may not be reused."""
        return DiskReadError(
            f"{self.paths[0]}: reads from an earlier gather are still in flight after {self.timeout:g} s: "
            "the drive is stalled; check it (dmesg) and restart the reader",
            errno_module.ETIMEDOUT,
        )

    def changed(self, i: int, what: str) -> DiskReadError:
        """File ``i`` changed (``what``: how) since it was opened."""
        return DiskReadError(
            f"{self.paths[i]}: disk table file {what} since it was opened: rows read now may be wrong; "
            "never write a served table in place -- restart the reader (or daemon) on the new file"
        )
