"""Loading tables from their sources into pinned memory, or opening them on disk.

``load_tables`` plans memory for every memory table first (so a too-small
machine fails before anything is read), then fills each table's region from
its source with a pool of threads (file reads and CRCs release the GIL),
verifies checksums on the way, locks and seals each region. A disk table
(``disk_tables``) is not loaded: its chunks are verified on disk once (each
read, checked and dropped) and a :class:`~tableserver.disk.reader.DiskTable` is
opened on its file. On any error every region and disk reader made so far is
freed: the caller gets either all tables or an exception.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tableserver.disk.queue import BUDGET_BYTES, DiskBudget, DiskQueue
from tableserver.disk.reader import DiskTable
from tableserver.errors import TableFileError
from tableserver.logs import kv
from tableserver.tables.memory import PinnedRegion, plan_memory
from tableserver.tables.progress import Progress, human_bytes
from tableserver.tables.sources import TableFileSource, open_sources, unverified
from tableserver.tables.tablefile import TableSpec

log = logging.getLogger(__name__)


@dataclass
class Table:
    """A table, or a row range of it, pinned in memory and ready to serve.

    ``rows`` are the rows held, ``row_lo`` the table row id of the first;
    data transports address them 0..rows-1 (clients subtract ``row_lo``).
    ``checksum`` is the whole table's: the identity every shard and replica of
    one table version shares.

    A memory table has its rows in ``region``; a disk table has ``region``
    None and ``disk``, the reader that gathers its rows from the file
    (``tier`` says which).
    """

    index: int
    spec: TableSpec
    checksum: str
    source: str
    region: PinnedRegion | None
    row_lo: int = 0
    row_hi: int = -1  # -1: the whole table
    disk: DiskQueue | None = None

    @property
    def tier(self) -> str:
        """Where the rows are served from: "memory" or "disk"."""
        return "disk" if self.disk is not None else "memory"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def total_rows(self) -> int:
        return self.spec.rows

    @property
    def rows(self) -> int:
        return (self.spec.rows if self.row_hi < 0 else self.row_hi) - self.row_lo

    @property
    def row_bytes(self) -> int:
        return self.spec.row_bytes

    @property
    def nbytes(self) -> int:
        return self.rows * self.spec.row_bytes

    @property
    def data(self) -> np.ndarray:
        """uint8 ``[rows, row_bytes]`` view of the pinned rows (a memory table's only)."""
        if self.region is None:
            raise TypeError(f"table {self.name!r} is served from disk: its rows are gathered by table.disk")
        return self.region.array[: self.nbytes].reshape(self.rows, self.row_bytes)


class TableSet:
    """The loaded tables, by catalog index and by name. Owns their regions."""

    def __init__(self, tables: list[Table], load_seconds: float = 0.0):
        self.tables = tables
        self.by_name = {t.name: t for t in tables}
        self.load_seconds = load_seconds

    def __iter__(self):
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def __getitem__(self, index: int) -> Table:
        return self.tables[index]

    @property
    def nbytes(self) -> int:
        """Bytes of every table served (memory and disk)."""
        return sum(t.nbytes for t in self.tables)

    @property
    def memory(self) -> list[Table]:
        """The tables held in memory."""
        return [t for t in self.tables if t.region is not None]

    @property
    def memory_nbytes(self) -> int:
        return sum(t.nbytes for t in self.memory)

    def close(self) -> None:
        for t in self.tables:
            close_table(t)

    def __enter__(self) -> TableSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _use_direct(path: str, io: str) -> bool:
    from tableserver.tables.sources import page_cache_fraction

    if io == "buffered" or path.endswith(".safetensors") or not os.path.isfile(path):
        return False
    if io == "direct":
        return True
    cached = page_cache_fraction(path)
    log.info(
        "%s: %.0f%% in the page cache: loading with %s reads",
        path,
        cached * 100,
        "buffered" if cached >= 0.5 else "O_DIRECT",
        extra=kv(event="load_io", path=path, page_cache=round(cached, 2), direct=cached < 0.5),
    )
    return cached < 0.5


def close_table(t: Table) -> None:
    if t.region is not None:
        t.region.close()
    if t.disk is not None:
        t.disk.close()


def disk_table_names(entries: list[tuple], wanted: list[str]) -> set[str]:
    """The names of ``--disk-tables`` (``all``: every table); TableFileError for a name no file holds or
    a table whose rows are not contiguous in its file (safetensors)."""
    names = {s.name for _, s in entries}
    chosen = set(names) if "all" in wanted else set(wanted)
    unknown = sorted(chosen - names)
    if unknown:
        raise TableFileError(
            f"--disk-tables {unknown[0]}: no such table; the table files hold {', '.join(sorted(names))} (or pass all)"
        )
    for source, spec in entries:
        if spec.name in chosen and not isinstance(source, TableFileSource):
            raise TableFileError(
                f"--disk-tables {spec.name}: {source.path} is not a table file (its rows are not contiguous on "
                "disk): pack it first with `tableserver pack` and serve the packed file"
            )
    return chosen


def row_range(spec: TableSpec, rows: tuple[int, int] | None, shard: tuple[int, int] | None) -> tuple[int, int]:
    """The rows [lo, hi) of ``spec`` a server holds: all, ``--rows LO:HI``, or shard K of N (equal ranges)."""
    if shard is not None:
        k, n = shard
        return k * spec.rows // n, (k + 1) * spec.rows // n
    if rows is not None:
        lo, hi = rows
        if hi > spec.rows:
            raise TableFileError(
                f"--rows {lo}:{hi}: table {spec.name!r} has only {spec.rows} rows: use a range "
                "inside every table, or --shard K/N"
            )
        return lo, hi
    return 0, spec.rows


def load_tables(
    paths: list[str],
    *,
    hugepages: str = "auto",
    lock: bool = True,
    verify: bool = True,
    progress: str = "auto",
    workers: int | None = None,
    cancel=None,
    io: str = "auto",
    rows: tuple[int, int] | None = None,
    shard: tuple[int, int] | None = None,
    disk_tables: list[str] | tuple = (),
    disk_io: str = "auto",
    disk_queue_depth: int = 64,
    disk_timeout: float = 10.0,
    disk_stripes: dict | None = None,
    disk_stripe_unit: int = 1 << 20,
    disk_buffer_bytes: int = BUDGET_BYTES,
) -> TableSet:
    """Loads every table of every file in ``paths`` into pinned memory, but those named in
    ``disk_tables`` (``["all"]``: every one), which are served from their file: verified there
    (when ``verify``) and opened as a :class:`DiskTable` (``disk_io``, ``disk_queue_depth``,
    ``disk_timeout`` are its engine, reads in flight and time limit). ``disk_stripes`` {name: files}
    serves a table from the stripe files ``tableserver stripe`` wrote (unit ``disk_stripe_unit``), verified
    through them. ``disk_buffer_bytes``: the row buffers their gathers may hold, all together (a
    :class:`~tableserver.disk.queue.DiskBudget`).

    ``rows=(lo, hi)`` or ``shard=(k, n)`` load only a row range of each table
    (see :func:`row_range`).

    ``io``: "direct" reads table files with O_DIRECT (disk straight into the
    pinned memory), "buffered" through the page cache, "auto" picks direct for
    a file that is mostly not in the page cache and buffered for one that is.

    ``cancel``, when given, is called as bytes arrive and may raise to abort
    the load (the daemon does so on SIGTERM); every region is freed then.
    """
    if not paths:
        raise TableFileError(
            "no table files given: pass --tables FILE[,FILE...] (make a demo file with `tableserver gen-demo PATH`)"
        )
    entries = open_sources(paths, "is defined in both", "table names must be unique across --tables")
    if not entries:
        raise TableFileError(f"{', '.join(paths)}: no tables found: pack some with `tableserver pack`")
    ranges = [row_range(s, rows, shard) for _, s in entries]
    sizes = [(hi - lo) * s.row_bytes for (_, s), (lo, hi) in zip(entries, ranges)]
    stripes = disk_stripes or {}
    on_disk = disk_table_names(entries, list(disk_tables) + list(stripes))
    in_memory = [size for (_, s), size in zip(entries, sizes) if s.name not in on_disk]
    plan = plan_memory([max(n, 1) for n in in_memory], hugepages=hugepages, lock=lock) if in_memory else None
    if plan is not None:
        log.info(
            "memory plan: %s for %d tables",
            plan.describe(),
            len(in_memory),
            extra=kv(event="memory_plan", tables=len(in_memory), plan=plan.describe()),
        )
    pages = iter(plan.page_sizes if plan is not None else ())
    total = sum(sizes)
    bar = Progress(total, "loading tables" if not on_disk else "loading and verifying tables", mode=progress)

    def advance(n: int) -> None:
        if cancel is not None:
            cancel()
        bar.update(n)

    direct = {path: _use_direct(path, io) for path in paths}
    workers = workers or min(8, max(2, os.cpu_count() or 2))
    if any(direct.values()) or on_disk:
        workers = max(workers, 8)  # O_DIRECT reads wait on the disk, not the CPU: keep more in flight
    tables: list[Table] = []
    budget = DiskBudget(disk_buffer_bytes)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="tableserver-load") as pool:
            for index, ((source, spec), (lo, hi), size) in enumerate(zip(entries, ranges, sizes)):
                if spec.name in on_disk:
                    tables.append(
                        _open_disk_table(
                            index,
                            source,
                            spec,
                            (lo, hi),
                            pool,
                            advance,
                            verify,
                            DiskOptions(
                                disk_io, disk_queue_depth, disk_timeout, stripes.get(spec.name), disk_stripe_unit
                            ),
                            budget,
                        )
                    )
                    continue
                region = PinnedRegion(spec.name, max(size, 1), next(pages))
                tables.append(Table(index, spec, "", source.path, region, lo, hi))
                region.advise_hugepage()
                checksum = source.load(
                    spec, region.array, pool, advance, verify, direct=direct[source.path], rows=(lo, hi)
                )
                tables[-1].checksum = checksum or spec.checksum
                if lock:
                    region.lock()
                region.seal()
                _log_table(tables[-1], region.kind, verify, memory=region.kind, page_size=region.page_size)
    except BaseException:
        for t in tables:
            close_table(t)
        raise
    finally:
        bar.finish()
    elapsed = time.monotonic() - t0
    log.info(
        "loaded %d tables, %s in %.2f s (%s/s)",
        len(tables),
        human_bytes(total),
        elapsed,
        human_bytes(total / max(elapsed, 1e-9)),
        extra=kv(event="tables_loaded", tables=len(tables), bytes=total, seconds=round(elapsed, 3)),
    )
    return TableSet(tables, elapsed)


@dataclass(frozen=True)
class DiskOptions:
    """How a disk table is read: engine, reads in flight, time limit, and its stripe files (None: the
    table file itself) with their unit."""

    io: str = "auto"
    queue_depth: int = 64
    timeout: float = 10.0
    stripes: list | None = None
    stripe_unit: int = 1 << 20

    def reader(self, path: str, spec: TableSpec, lo: int, hi: int, expect=None) -> DiskTable:
        """A DiskTable of rows lo..hi-1 of ``spec`` from ``path`` or from the stripes, its files the ones
        ``expect`` names (DiskTable's)."""
        k = spec.rows_per_page  # page-aligned: the rows of a shard start at row_base, not at a byte offset
        shift, base = (0, lo) if k else (lo * spec.row_bytes, 0)
        if self.stripes:
            paths, offset, stripe = self.stripes, shift, self.stripe_unit
        else:
            paths, offset, stripe = path, spec.offset + shift, None
        return DiskTable(paths, offset, hi - lo, spec.row_bytes, stripe=stripe, queue_depth=self.queue_depth,
                         timeout=self.timeout, io=self.io, rows_per_page=k, row_base=base,
                         expect=expect)  # fmt: skip


def _open_disk_table(index, source, spec, rows, pool, advance, verify, o: DiskOptions, budget: DiskBudget) -> Table:
    """A disk table: its reader opened on the file the header was read from, its chunks verified on disk
    (progress counted as they are) through that same file, then checked unchanged: what is served is what
    was verified, or the start fails (a file re-packed or copied over during start-up)."""
    lo, hi = rows
    # the serving reader first: its fds pin the files; every later open must find the same ones
    reader = o.reader(source.path, spec, lo, hi, expect=None if o.stripes else [source.identity])
    try:

        def count(n: int) -> None:
            advance(min(n, (hi - lo) * spec.row_bytes))

        if verify and (o.stripes or spec.rows_per_page):
            if (lo, hi) == (0, spec.rows):
                _verify_through(reader, spec, o, count)
            else:  # chunks span rows outside a shard's: read through a whole-table reader of the same files
                with o.reader(source.path, spec, 0, spec.rows, expect=reader.identities) as whole:
                    _verify_through(whole, spec, o, count)
        elif verify:
            source.verify(spec, pool, count, rows=rows)  # its opens are checked against the header's file
        else:
            advance((hi - lo) * spec.row_bytes)
        change = reader.file_change()
        if change is not None:
            raise TableFileError(
                f"{change[0]}: the file of disk table {spec.name!r} {change[1]} while the daemon verified it (re-packed "
                "or copied during start-up?): restart once the file is final"
            )
    except BaseException:
        reader.close()
        raise
    checksum = spec.checksum if verify else unverified(spec.checksum)
    table = Table(index, spec, checksum, source.path, None, lo, hi, DiskQueue(reader, spec.name, budget=budget))
    where = f"disk ({reader.engine}, {reader.io_mode}, queue depth {o.queue_depth}"
    where += f", striped over {len(o.stripes)} files)" if o.stripes else ")"
    _log_table(table, where, verify, memory="disk", disk_engine=reader.engine, direct=reader.direct)
    return table


def _verify_through(reader: DiskTable, spec: TableSpec, o: DiskOptions, advance) -> None:
    """Every chunk of ``spec`` read back through ``reader`` (its stripes) against the table file's digests."""
    from tableserver.tables.tablefile import checksum_error, chunk_ranges

    rb = spec.row_bytes
    for i, (a, b) in enumerate(chunk_ranges(spec.nbytes, spec.chunk_bytes)):
        r0, r1 = a // rb, -(-b // rb)
        rows = reader.gather(np.arange(r0, r1, dtype=np.int64))
        if not spec.chunk_ok(i, rows.reshape(-1)[a - r0 * rb : b - r0 * rb]):
            if not o.stripes:
                raise checksum_error(reader.paths[0], spec, i)
            raise TableFileError(
                f"{':'.join(o.stripes)}: bytes {a}..{b - 1} of table {spec.name!r} read through the stripes do "
                "not match the table file's checksum: pass the files `tableserver stripe` wrote for this table, "
                f"in their order, and its unit as --disk-stripe-unit (now {o.stripe_unit})"
            )
        advance(b - a)


def _log_table(t: Table, where: str, verify: bool, **fields) -> None:
    spec, lo, hi = t.spec, t.row_lo, t.row_lo + t.rows
    part = "" if (lo, hi) == (0, spec.rows) else f" (rows {lo}..{hi - 1} of {spec.rows})"
    log.info(
        "table %s: %d rows x %d B = %s%s, layer %d, %s, checksum %s%s",
        spec.name,
        t.rows,
        spec.row_bytes,
        human_bytes(t.nbytes),
        part,
        spec.layer,
        where,
        t.checksum or "-",
        "" if verify else " (not verified)",
        extra=kv(
            event="table_loaded",
            table=spec.name,
            layer=spec.layer,
            rows=t.rows,
            row_lo=lo,
            total_rows=spec.rows,
            row_bytes=spec.row_bytes,
            bytes=t.nbytes,
            tier=t.tier,
            verified=verify,
            **fields,
        ),
    )
