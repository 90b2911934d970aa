"""``tableserver stripe``: one table's rows dealt over files on several drives, for a disk table.

A drive's random reads per second set a disk table's speed; n drives read n times as many pages at
once when a table's pages are spread over them. ``stripe`` cuts the table's bytes (byte 0 = its first
row) into units of ``unit`` bytes and deals them round robin: unit ``u`` goes to file ``u % n``, at
``(u // n) * unit`` (the layout :class:`~tableserver.disk.reader.DiskTable` reads). The files hold rows only:
the table file (``--tables``) still names the table, its rows and checksums; the daemon serves it from
the stripes with ``--disk-stripes NAME=FILE:FILE:... --disk-stripe-unit UNIT`` and, unless
``--no-verify``, checks every chunk read back through the stripes against the table file's digests.
"""

from __future__ import annotations

import os

from tableserver.errors import ConfigError, TableFileError
from tableserver.tables.atomic import create_temp
from tableserver.tables.progress import Progress
from tableserver.tables.tablefile import read_header

#: the default stripe unit: large enough that a row rarely spans two units, small enough to spread
DEFAULT_UNIT = 1 << 20
#: bytes copied per read
_BLOCK = 8 << 20


def check_unit(unit: int) -> int:
    if unit <= 0 or unit % 4096:
        raise ConfigError(
            f"stripe unit {unit}: pass a positive multiple of 4096 bytes (e.g. {DEFAULT_UNIT}), the same to "
            "`tableserver stripe --unit` and `--disk-stripe-unit`"
        )
    return unit


def stripe(path: str, table: str, outputs: list[str], unit: int = DEFAULT_UNIT, progress: str = "auto") -> None:
    """Writes table ``table`` of table file ``path`` over ``outputs`` in units of ``unit`` bytes; each output
    appears whole or not at all."""
    check_unit(unit)
    if len(outputs) < 2:
        raise ConfigError("stripe over at least 2 files (one file is the table file itself)")
    if len({os.path.abspath(o) for o in outputs}) != len(outputs) or os.path.abspath(path) in map(
        os.path.abspath, outputs
    ):
        raise ConfigError("stripe files must be distinct, and not the table file")
    header = read_header(path)
    spec = next((s for s in header.tables if s.name == table), None)
    if spec is None:
        names = ", ".join(s.name for s in header.tables)
        raise TableFileError(f"{path}: no table {table!r} (it holds {names}): pass --table NAME")
    n = len(outputs)
    temps: list[tuple[int, str]] = []
    size = spec.file_bytes  # the bytes as laid out (a page-aligned table: its pages)
    bar = Progress(size, f"striping {table} over {n} files", mode=progress)
    try:
        for out in outputs:
            temps.append(create_temp(out))
        with open(path, "rb", buffering=0) as src:
            for u, at in enumerate(range(0, size, unit)):
                length = min(unit, size - at)
                fd = temps[u % n][0]
                dest = (u // n) * unit
                done = 0
                while done < length:
                    chunk = os.pread(src.fileno(), min(_BLOCK, length - done), spec.offset + at + done)
                    if not chunk:
                        raise TableFileError(f"{path}: truncated table file: table {table!r} ends early")
                    _pwrite_all(fd, chunk, dest + done)
                    done += len(chunk)
                bar.update(length)
        for fd, _ in temps:
            os.fsync(fd)
        for (fd, tmp), out in zip(temps, outputs):
            os.close(fd)
            os.replace(tmp, out)
        temps = []
    finally:
        bar.finish()
        for fd, tmp in temps:
            try:
                os.close(fd)
            except OSError:
                pass
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def parse_stripes(items: list[str]) -> dict[str, list[str]]:
    """``--disk-stripes`` items ``NAME=FILE:FILE:...`` -> {table name: stripe files}; ConfigError otherwise."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, files = item.partition("=")
        paths = [f for f in files.split(":") if f]
        if not sep or not name or len(paths) < 2:
            raise ConfigError(
                f"--disk-stripes {item!r}: expected NAME=FILE:FILE[:FILE...] (the files `tableserver stripe` wrote)"
            )
        if name in out:
            raise ConfigError(f"--disk-stripes: table {name!r} given twice")
        out[name] = paths
    return out
