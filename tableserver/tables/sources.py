"""Where tables come from: table files (``engram.bin``) and safetensors files.

A source lists its tables as :class:`~tableserver.tables.tablefile.TableSpec` and
fills a table's bytes into memory the loader provides. Both sources read
through zero-copy file views and never hold a whole table in Python objects.

safetensors layout rules (DeepSeek-V4.1 checkpoints):

* an FP8 e4m3 weight ``[N, 256]`` with a sibling ue8m0 scale ``[N, 8]`` (named
  ``...scale``, ``...weight_scale_inv``, ``...scale_inv`` or ``...weight_scale``)
  becomes one Engram table of 264-byte rows (the 256 weight bytes, then the 8
  scale bytes), named ``engram.layer<L>`` after the ``layers.<L>.`` in its name;
* any other 2-D tensor becomes a table of plain rows (``row_bytes`` = columns x
  element size), named after the tensor;
* tensors of other ranks are skipped (and logged).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tableserver.common.model import FP8_BYTES, ROW_BYTES, SCALE_BYTES
from tableserver.disk.fileid import FileIdentity
from tableserver.errors import TableFileError
from tableserver.tables.tablefile import (
    ENGRAM_DTYPE,
    MAGIC,
    TableSpec,
    check_table_name,
    open_table_file,
    read_header,
)

log = logging.getLogger(__name__)

Progress = Callable[[int], None]

_ST_DTYPES = {  # safetensors dtype -> (catalog dtype name, element bytes)
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
    "C64": ("complex64", 8),
}
_SCALE_SUFFIXES = ("scale", "weight_scale_inv", "scale_inv", "weight_scale")
_LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
_BLOCK_ROWS = 1 << 16


class TableFileSource:
    """A table file made by ``tableserver pack`` / ``gen-demo``."""

    def __init__(self, path: str):
        self.path = path
        self.header = read_header(path)
        self.specs = list(self.header.tables)

    @property
    def identity(self) -> FileIdentity | None:
        """The file the header was read from: every later open must find it, unchanged."""
        return self.header.identity

    def _open(self, flags: int = 0) -> int:
        """An fd of the table file: the file its header was read from, unchanged (else TableFileError)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | flags)
        try:
            self.check_same(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_direct(self) -> int:
        """An O_DIRECT fd of the table file (checked as :meth:`_open`), or -1 where the filesystem has none
        (tmpfs, 9p, ...)."""
        try:
            return self._open(os.O_DIRECT)
        except OSError:
            return -1

    def check_same(self, fd: int) -> None:
        """TableFileError when ``fd`` reads another file than the header's, or the file changed since (a
        re-pack, copy or in-place write during start-up): what is read must be what the header describes."""
        want = self.header.identity
        why = want.change_at(fd, self.path) if want is not None else None
        if why is not None:
            raise TableFileError(
                f"{self.path}: the table file {why} since its header was read (re-packed or copied during "
                "start-up?): restart once the file is final"
            )

    def load(self, spec: TableSpec, dest: np.ndarray, pool: ThreadPoolExecutor, progress: Progress, verify: bool,
             direct: bool = False, rows: tuple[int, int] | None = None) -> str:  # fmt: skip
        """Reads ``spec``'s bytes into ``dest`` (uint8 [nbytes]); returns its checksum.

        Each 64 MiB chunk is read and, when ``verify``, CRC-checked by one
        worker while it is still in cache: one pass over memory. ``direct``
        reads with O_DIRECT (disk -> ``dest``, no page-cache copy): twice as
        fast from a cold disk here, and no second copy of a 200 GB table in
        the page cache; the unaligned tail of a table is read buffered.

        ``rows=(lo, hi)`` loads only that row range into ``dest``; the chunks
        it covers in part are read whole once for their CRC (at most two).
        The checksum returned is the whole table's either way: its identity.
        """
        from tableserver.tables.tablefile import checksum_error, chunk_ranges

        if spec.rows_per_page:
            return self._load_aligned(spec, dest, pool, progress, verify, rows or (0, spec.rows))
        if rows is not None and rows != (0, spec.rows):
            return self._load_range(spec, dest, pool, progress, verify, rows)

        fd = self._open()
        dfd = self._open_direct() if direct else -1
        try:
            view = memoryview(dest)

            def chunk(i_range):
                i, (a, b) = i_range
                part = view[a:b]
                if _is_hole(fd, spec.offset + a, b - a):  # sparse: the fresh memory is already zero
                    if verify and not _zero_chunk_ok(spec, i, b - a):
                        raise checksum_error(self.path, spec, i)
                    progress(b - a)
                    return
                self._read_chunk(fd, dfd if a % DIRECT_ALIGN == 0 else -1, part, spec.offset + a, spec)
                if verify and not spec.chunk_ok(i, part):
                    raise checksum_error(self.path, spec, i)
                progress(b - a)

            for _ in pool.map(chunk, enumerate(chunk_ranges(spec.nbytes, spec.chunk_bytes))):
                pass
            self.check_same(fd)  # and nothing was written in place while it was read
        finally:
            os.close(fd)
            if dfd >= 0:
                os.close(dfd)
        return spec.checksum if verify else unverified(spec.checksum)

    def _load_aligned(self, spec: TableSpec, dest: np.ndarray, pool: ThreadPoolExecutor, progress: Progress,
                      verify: bool, rows: tuple[int, int]) -> str:  # fmt: skip
        """A page-aligned table's rows [lo, hi) into ``dest``, back to back: each checksum chunk's pages are
        read (buffered), their rows compacted and checked, and the part inside the range kept."""
        from tableserver.tables.tablefile import PAGE_BYTES, checksum_error, chunk_ranges

        k, rb = spec.rows_per_page, spec.row_bytes
        start, stop = rows[0] * rb, rows[1] * rb
        fd = self._open()
        try:

            def chunk(i_range):
                i, (a, b) = i_range
                if b <= start or a >= stop:
                    return
                r0, r1 = a // rb, -(-b // rb)
                p0, p1 = r0 // k, (r1 - 1) // k + 1
                pages = np.empty((p1 - p0, PAGE_BYTES), np.uint8)
                self._pread(fd, memoryview(pages).cast("B"), spec.offset + p0 * PAGE_BYTES, spec)
                logical = pages[:, : k * rb].reshape(-1)[(r0 - p0 * k) * rb : r1 * rb - p0 * k * rb]
                part = logical[a - r0 * rb : b - r0 * rb]
                if verify and not spec.chunk_ok(i, part):
                    raise checksum_error(self.path, spec, i)
                lo, hi = max(a, start), min(b, stop)
                dest[lo - start : hi - start] = part[lo - a : hi - a]
                progress(hi - lo)

            for _ in pool.map(chunk, enumerate(chunk_ranges(spec.nbytes, spec.chunk_bytes))):
                pass
            self.check_same(fd)  # and nothing was written in place while it was read
        finally:
            os.close(fd)
        return spec.checksum if verify else unverified(spec.checksum)

    def verify(self, spec: TableSpec, pool: ThreadPoolExecutor, progress: Progress, direct: bool = True,
               rows: tuple[int, int] | None = None) -> None:  # fmt: skip
        """Checks ``spec``'s chunks on disk (those holding ``rows``, all by default) against the file's
        checksums without keeping them: each worker reads one chunk into its own buffer, checks it and
        drops it, so memory holds ``pool`` workers' chunks at most. ChecksumError on a mismatch."""
        import mmap

        from tableserver.tables.tablefile import checksum_error, chunk_ranges

        lo, hi = rows if rows is not None else (0, spec.rows)
        start, stop = lo * spec.row_bytes, hi * spec.row_bytes
        fd = self._open()
        dfd = self._open_direct() if direct else -1
        try:

            def chunk(i_range):
                i, (a, b) = i_range
                if b <= start or a >= stop:
                    return
                if _is_hole(fd, spec.offset + a, b - a):
                    if not _zero_chunk_ok(spec, i, b - a):
                        raise checksum_error(self.path, spec, i)
                    progress(b - a)
                    return
                buf = mmap.mmap(-1, b - a)  # page-aligned, as O_DIRECT wants; unmapped when the check is done
                try:
                    part = memoryview(buf)
                    self._read_chunk(fd, dfd, part, spec.offset + a, spec)
                    ok = spec.chunk_ok(i, part)
                    part.release()
                finally:
                    buf.close()
                if not ok:
                    raise checksum_error(self.path, spec, i)
                progress(b - a)

            for _ in pool.map(chunk, enumerate(chunk_ranges(spec.nbytes, spec.chunk_bytes))):
                pass
            self.check_same(fd)  # and nothing was written in place while it was read
        finally:
            os.close(fd)
            if dfd >= 0:
                os.close(dfd)

    def _read_chunk(self, fd: int, dfd: int, part, at: int, spec: TableSpec) -> None:
        """Fills ``part`` (page-aligned memory) from file offset ``at``: its whole pages through ``dfd``
        (O_DIRECT, -1: none), the rest buffered. O_DIRECT needs the file offset aligned too (files written
        with odd chunk sizes or alignments read those chunks buffered)."""
        n = len(part)
        aligned = n // DIRECT_ALIGN * DIRECT_ALIGN if dfd >= 0 and at % DIRECT_ALIGN == 0 else 0
        if aligned:
            try:
                self._pread(dfd, part[:aligned], at, spec)
            except OSError as e:
                if e.errno != errno.EINVAL:  # the device wants a larger alignment: read buffered
                    raise
                aligned = 0
        if aligned < n:
            self._pread(fd, part[aligned:], at + aligned, spec)

    def _pread(self, fd: int, buf, at: int, spec: TableSpec) -> None:
        """Fills ``buf`` from file offset ``at``; a short file is a one-line TableFileError."""
        pos = 0
        while pos < len(buf):
            n = os.preadv(fd, [buf[pos:]], at + pos)
            if n <= 0:
                raise TableFileError(
                    f"{self.path}: truncated table file: table {spec.name!r} "
                    f"ends early at byte {at + pos}: re-copy or re-pack it"
                )
            pos += n

    def _load_range(
        self,
        spec: TableSpec,
        dest: np.ndarray,
        pool: ThreadPoolExecutor,
        progress: Progress,
        verify: bool,
        rows: tuple[int, int],
    ) -> str:
        """Rows [lo, hi) of ``spec`` into ``dest``, each chunk they touch verified whole (buffered reads)."""
        from tableserver.tables.tablefile import checksum_error, chunk_ranges

        start, stop = rows[0] * spec.row_bytes, rows[1] * spec.row_bytes
        fd = self._open()
        try:

            def read(buf, at):
                self._pread(fd, buf, at, spec)

            def chunk(i_range):
                i, (a, b) = i_range
                lo, hi = max(a, start), min(b, stop)
                if lo >= hi:
                    return
                inside = lo == a and hi == b
                if verify and not inside:  # read the whole chunk once to check it, keep our part
                    whole = np.empty(b - a, np.uint8)
                    read(memoryview(whole), spec.offset + a)
                    if not spec.chunk_ok(i, whole):
                        raise checksum_error(self.path, spec, i)
                    dest[lo - start : hi - start] = whole[lo - a : hi - a]
                else:
                    part = memoryview(dest)[lo - start : hi - start]
                    read(part, spec.offset + lo)
                    if verify and not spec.chunk_ok(i, part):
                        raise checksum_error(self.path, spec, i)
                progress(hi - lo)

            for _ in pool.map(chunk, enumerate(chunk_ranges(spec.nbytes, spec.chunk_bytes))):
                pass
            self.check_same(fd)  # and nothing was written in place while it was read
        finally:
            os.close(fd)
        return spec.checksum if verify else unverified(spec.checksum)


#: O_DIRECT offsets, lengths and buffer addresses are multiples of this (tables start 2 MiB-aligned
#: in the file, chunks are 64 MiB, destinations are page-aligned mappings)
DIRECT_ALIGN = 4096


def page_cache_fraction(path: str, samples: int = 64, window: int = 1 << 20) -> float:
    """Share of ``path`` resident in the page cache, from ``samples`` mincore() probes of ``window`` bytes.

    Decides the load I/O: a file mostly in cache loads fastest by copying from
    the cache; a cold one by O_DIRECT reads.
    """
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            view = np.frombuffer(m, dtype=np.uint8)
            addr = view.ctypes.data
            del view  # no export may outlive the mapping
            resident = total = 0
            vec = (ctypes.c_ubyte * (window // page))()
            for k in range(samples):
                start = (size - window) * k // max(samples - 1, 1) if size > window else 0
                start -= start % page
                length = min(window, size - start)
                if libc.mincore(ctypes.c_void_p(addr + start), ctypes.c_size_t(length), vec) != 0:
                    return 1.0  # cannot tell: copying from the cache is never wrong
                pages = (length + page - 1) // page
                resident += sum(v & 1 for v in vec[:pages])
                total += pages
        finally:
            m.close()
    return resident / max(total, 1)


class SafetensorsSource:
    """Tables read directly from a safetensors file (no checksums stored there)."""

    def __init__(self, path: str):
        self.path = path
        self._tensors, self._data_start = _read_safetensors_header(path)
        self._plans: dict[str, list[tuple[str, int]]] = {}  # table -> [(tensor, row bytes)]
        self.specs = self._discover()

    def _discover(self) -> list[TableSpec]:
        t = self._tensors
        used: set[str] = set()
        specs: list[TableSpec] = []
        for name, info in t.items():
            if info["dtype"] != "F8_E4M3" or info["shape"][1:] != [FP8_BYTES] or not name.endswith("weight"):
                continue
            prefix = name[: -len("weight")]
            scale = next(
                (
                    prefix + s
                    for s in _SCALE_SUFFIXES
                    if prefix + s in t
                    and t[prefix + s]["shape"] == [info["shape"][0], SCALE_BYTES]
                    and t[prefix + s]["dtype"] in ("F8_E8M0", "U8", "I8")
                ),
                None,
            )
            if scale is None:
                continue
            layer = _layer_of(name)
            table = f"engram.layer{layer}" if layer >= 0 else prefix.rstrip(".") or name
            specs.append(
                TableSpec(
                    name=check_table_name(table),
                    rows=info["shape"][0],
                    row_bytes=ROW_BYTES,
                    dtype=ENGRAM_DTYPE,
                    shape=(info["shape"][0], ROW_BYTES),
                    layer=layer,
                    metadata={"weight": name, "scale": scale},
                )
            )
            self._plans[table] = [(name, FP8_BYTES), (scale, SCALE_BYTES)]
            used.update((name, scale))
        for name, info in t.items():
            if name in used:
                continue
            if len(info["shape"]) != 2:
                log.info(
                    "%s: skipping tensor %s of shape %s (only 2-D tensors are tables)", self.path, name, info["shape"]
                )
                continue
            dtype, size = _ST_DTYPES[info["dtype"]]
            rows, cols = info["shape"]
            if cols * size == 0:
                log.info(
                    "%s: skipping tensor %s of shape %s (zero-width rows are no table)", self.path, name, info["shape"]
                )
                continue
            specs.append(
                TableSpec(
                    name=check_table_name(name),
                    rows=rows,
                    row_bytes=cols * size,
                    dtype=dtype,
                    shape=(rows, cols),
                    layer=_layer_of(name),
                )
            )
            self._plans[name] = [(name, cols * size)]
        names = [s.name for s in specs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise TableFileError(f"{self.path}: two tensors map to table name {dup!r}: rename one")
        return specs

    def tensors_of(self, spec: TableSpec) -> tuple[str, ...]:
        """The tensors whose bytes make table ``spec``'s rows, in row order (an Engram table: the
        weight, then its scale)."""
        return tuple(tensor for tensor, _ in self._plans[spec.name])

    def tensor_shape(self, name: str) -> list[int] | None:
        """The shape of tensor ``name`` in this file (None: the file holds no such tensor)."""
        info = self._tensors.get(name)
        return None if info is None else list(info["shape"])

    def _tensor_rows(self, tensor: str, row_bytes: int) -> np.ndarray:
        a, b = self._tensors[tensor]["data_offsets"]
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + a, shape=(b - a,))
        return mm.reshape(-1, row_bytes)

    def rows(self, spec: TableSpec, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``start..stop-1`` of a table as uint8 ``[n, row_bytes]``."""
        out = np.empty((stop - start, spec.row_bytes), np.uint8) if out is None else out
        col = 0
        for tensor, width in self._plans[spec.name]:
            out[:, col : col + width] = self._tensor_rows(tensor, width)[start:stop]
            col += width
        return out

    def load(self, spec: TableSpec, dest: np.ndarray, pool: ThreadPoolExecutor, progress: Progress, verify: bool,
             direct: bool = False, rows: tuple[int, int] | None = None) -> str:  # fmt: skip
        if rows is not None and rows != (0, spec.rows):
            raise TableFileError(
                f"{self.path}: serving a row range needs a table file with chunk checksums "
                "(the identity clients pin): `tableserver pack` it first"
            )
        rows = dest[: spec.nbytes].reshape(spec.rows, spec.row_bytes)

        def block(a):
            b = min(a + _BLOCK_ROWS, spec.rows)
            self.rows(spec, a, b, out=rows[a:b])
            progress((b - a) * spec.row_bytes)

        for _ in pool.map(block, range(0, spec.rows, _BLOCK_ROWS)):
            pass
        return compute_checksum(dest[: spec.nbytes], spec.chunk_bytes, pool) if verify else ""


def _is_hole(fd: int, offset: int, length: int) -> bool:
    """True when [offset, offset + length) of the file holds no data (a sparse hole)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as e:  # ENXIO: no data past offset; EINVAL: SEEK_DATA unsupported (then read it)
        return e.errno == errno.ENXIO


_ZERO_DIGESTS: dict[tuple[int, bool], object] = {}


def _zero_chunk_ok(spec: TableSpec, i: int, n: int) -> bool:
    """Whether chunk ``i`` of ``spec`` is ``n`` zero bytes by its checksum (computed once per size)."""
    import zlib

    from tableserver.tables.tablefile import chunk_sha256

    sha = spec.chunk_sha256 is not None
    if (n, sha) not in _ZERO_DIGESTS:
        zeros = bytes(n)
        _ZERO_DIGESTS[n, sha] = chunk_sha256(zeros) if sha else zlib.crc32(zeros)
    return _ZERO_DIGESTS[n, sha] == (spec.chunk_sha256[i] if sha else spec.chunk_crcs[i])


def unverified(checksum: str) -> str:
    """What the catalog says for a table loaded with --no-verify: the file's claim, marked as such (a
    client that pins the checksum refuses it)."""
    return f"unverified:{checksum}" if checksum else ""


def compute_checksum(data: np.ndarray, chunk_bytes: int, pool: ThreadPoolExecutor) -> str:
    """The catalog checksum of bytes already in memory (chunk SHA-256s in parallel)."""
    from tableserver.tables.tablefile import chunk_ranges, chunk_sha256, table_sha256

    view = memoryview(data)
    return table_sha256(list(pool.map(lambda r: chunk_sha256(view[r[0] : r[1]]), chunk_ranges(len(data), chunk_bytes))))


def _layer_of(name: str) -> int:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else -1


def _read_safetensors_header(path: str) -> tuple[dict, int]:
    """Tensor entries of a safetensors file, validated by the safetensors package."""
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors is a hard dependency
        raise TableFileError("reading .safetensors needs the safetensors package: pip install safetensors") from None
    try:
        with safe_open(path, framework="numpy") as f:
            keys = set(f.keys())
    except FileNotFoundError:
        raise TableFileError(f"table file {path} not found: check --tables", errno=2) from None
    except Exception as e:  # SafetensorError is not exported as a class we can name portably
        from tableserver.logs import escape

        raise TableFileError(f"{path}: not a valid safetensors file ({escape(str(e))[:300]}): re-export it") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        doc = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    tensors = {k: v for k, v in doc.items() if k in keys}
    for k, v in tensors.items():
        if v["dtype"] not in _ST_DTYPES:
            raise TableFileError(f"{path}: tensor {k} has unsupported dtype {v['dtype']}")
    return tensors, 8 + n


def open_source(path: str):
    """A source for ``path``: a table file, or safetensors by extension or content."""
    if path.endswith(".safetensors"):
        return SafetensorsSource(path)
    with open_table_file(path) as f:
        head = f.read(8)
    if head != MAGIC and len(head) == 8 and struct.unpack("<Q", head)[0] < (100 << 20):
        try:
            return SafetensorsSource(path)
        except TableFileError:
            pass
    return TableFileSource(path)


def open_sources(paths: list[str], in_both: str, clash_fix: str, accept=None) -> list[tuple]:
    """``(source, spec)`` of every table in ``paths``, each name once: a name in two files is a
    TableFileError "table NAME {in_both} A and B: {clash_fix}". ``accept(path, source)`` may refuse a
    source by raising."""
    entries, where = [], {}
    for path in paths:
        source = open_source(path)
        if accept is not None:
            accept(path, source)
        for spec in source.specs:
            if spec.name in where:
                raise TableFileError(f"table {spec.name!r} {in_both} {where[spec.name]} and {path}: {clash_fix}")
            where[spec.name] = path
            entries.append((source, spec))
    return entries
