"""A disk table's files, open: :class:`TableFiles` -- each opened with O_DIRECT where the filesystem takes it
(probed with one page read) else buffered, checked to hold the table's bytes and to be the file ``expect``
names, and later compared with what was opened (:meth:`TableFiles.first_change`)."""

from __future__ import annotations

import errno as errno_module
import os
from collections.abc import Callable

import numpy as np

from tableserver.disk.engines import Runs
from tableserver.disk.errors import DiskReadError, ReadErrors
from tableserver.disk.fileid import FileIdentity
from tableserver.disk.plan import Layout


class TableFiles:
    """The files ``errors.paths`` of a table laid out as ``layout``, open: ``fds`` (file ``i`` is
    ``paths[i]``; ``fd_of``: as int64), ``ids`` (each :class:`FileIdentity` as opened), ``needs`` (the bytes
    of each file the table needs). ``direct``: try O_DIRECT; where refused, reads are buffered and
    ``warn(reason)`` is told why, once; ``direct`` and ``io_mode`` say how the files are read. ``view``: a
    page-aligned buffer of at least a page, for the O_DIRECT probe. ``expect``: the identity each file must
    still have (None entries: any). Refusals: :class:`DiskReadError`; nothing is left open then."""

    def __init__(self, layout: Layout, direct: bool, expect, view, errors: ReadErrors, warn: Callable[[str], None]):
        self.layout, self.paths, self._errors, self._warn = layout, errors.paths, errors, warn
        self.needs = np.asarray(layout.file_needs(), np.int64)
        self.direct = bool(direct)
        self.io_mode = "O_DIRECT" if direct else "buffered (direct=False)"
        self.fds: list[int] = []
        self.ids: list[FileIdentity] = []
        try:
            self._open(expect)
            if self.direct:
                self._probe(view)
        except BaseException:
            self.close()
            raise
        self.fd_of = np.asarray(self.fds, np.int64)

    def _open(self, expect) -> None:
        expect = list(expect) if expect is not None else [None] * len(self.paths)
        if len(expect) != len(self.paths):
            raise ValueError(f"expect names {len(expect)} files, the reader has {len(self.paths)}")
        lay = self.layout
        for path, need, want in zip(self.paths, self.needs.tolist(), expect):
            flags = os.O_RDONLY | os.O_CLOEXEC
            fd = -1
            if self.direct:
                try:
                    fd = os.open(path, flags | os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno_module.EINVAL:
                        raise DiskReadError(
                            f"{path}: cannot open the disk table ({e.strerror}): check the path", e.errno
                        ) from None
                    self._go_buffered(f"{path}: the filesystem refuses O_DIRECT")
            if fd < 0:
                try:
                    fd = os.open(path, flags)
                except OSError as e:
                    raise DiskReadError(
                        f"{path}: cannot open the disk table ({e.strerror}): check the path", e.errno
                    ) from None
            self.fds.append(fd)
            ident = FileIdentity.of(fd)
            why = want.change_at(fd, path) if want is not None else None
            if why is not None:
                raise DiskReadError(
                    f"{path}: the table file {why} since it was first opened (a re-pack or copy during start-up?): "
                    "restart once the file is final"
                )
            if ident.size < need:
                raise DiskReadError(
                    f"{path}: truncated disk table file: {ident.size} bytes, the table needs {need} "
                    f"(offset {lay.offset}, {lay.rows} rows of {lay.row_bytes} B): re-copy or re-pack it"
                )
            self.ids.append(ident)

    def _go_buffered(self, reason: str) -> None:
        if self.direct:
            self._warn(reason)
        self.direct = False
        self.io_mode = f"buffered ({reason})"

    def _probe(self, view) -> None:
        """One O_DIRECT read of the table's first page per file; EINVAL (an alignment the device does not
        take) switches every file to buffered reads."""
        page = self.layout.page
        for i, fd in enumerate(self.fds):
            at = self.probe_at(i)
            try:
                os.preadv(fd, [view[:page]], at)
            except OSError as e:
                if e.errno != errno_module.EINVAL:
                    raise self._errors.read(i, at, e) from None
                self._go_buffered(f"{self.paths[i]}: O_DIRECT reads of {page} B at offset {at} refused (EINVAL)")
                break
        if not self.direct:
            for i, fd in enumerate(self.fds):
                os.close(fd)
                self.fds[i] = os.open(self.paths[i], os.O_RDONLY | os.O_CLOEXEC)
                why = self.ids[i].change(FileIdentity.of(self.fds[i]))
                if why is not None:
                    raise self._errors.changed(i, why + " while opening")

    def probe_at(self, i: int) -> int:
        """The byte of file ``i`` its probe reads: the table's first page."""
        page = self.layout.page
        return self.layout.offset // page * page if len(self.fds) == 1 else 0

    def first_pages(self) -> Runs:
        """One read of each file's probed page, into pool page 0 (an engine's trial read)."""
        at = np.asarray([self.probe_at(i) for i in range(len(self.fds))], np.int64)
        length = np.full(len(at), self.layout.page, np.int64)
        need = np.minimum(length, self.needs - at)
        return Runs(len(at), np.arange(len(at), dtype=np.int64), self.fd_of, np.zeros(len(at), np.int64), length, at,
                    need)  # fmt: skip

    def first_change(self) -> tuple[int, str] | None:
        """(file index, how) of the first file changed or replaced since it was opened: the file behind each
        fd, and the file at each path, against its identity as opened (a block device: the same device, of
        the same size; its node's times mean nothing). None: every file as opened."""
        for i, (fd, path, opened) in enumerate(zip(self.fds, self.paths, self.ids)):
            why = opened.change_at(fd, path)
            if why is not None:
                return i, why
        return None

    def close(self) -> None:
        """Closes every fd; idempotent."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
