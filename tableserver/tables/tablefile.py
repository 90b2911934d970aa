"""The table file (``engram.bin``): one header describing every table, then rows.

Layout, all integers little-endian (docs/DESIGN.md has the full contract)::

    offset 0    preamble, 64 bytes
                  magic         8s   b"TBLSRV01"
                  version       u16  format version, 1
                  flags         u16  0
                  header_bytes  u32  length of the JSON header
                  header_crc    u32  zlib.crc32 of the JSON header bytes
                  reserved      u32  0
                  data_offset   u64  offset of the first table
                  reserved      32 zero bytes
    offset 64   JSON header (UTF-8), header_bytes long, then zero padding
    table i     at its own ``alignment`` (2 MiB) boundary: rows * row_bytes
                bytes, row-major, so a table can be read straight into
                hugepage memory.

Each table records the CRC-32 of every ``chunk_bytes`` (64 MiB) slice of its
bytes. Chunks let a loader verify in parallel and name the corrupt region; the
table's catalog checksum is the CRC-32 of its chunk CRCs (``crc32:xxxxxxxx``),
so the same rows give the same checksum whichever way they were loaded.

Files are written to ``PATH.tmp`` and renamed into place only when complete,
so a partial table file is never visible under its final name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from tableserver.disk.fileid import FileIdentity
from tableserver.errors import ChecksumError, TableFileError
from tableserver.tables.atomic import create_temp  # noqa: F401 (public here too)

MAGIC = b"TBLSRV01"
FORMAT_VERSION = 1
#: the version of a file holding a page-aligned table (an older reader must refuse it: it would read
#: its rows at row-major offsets)
ALIGNED_FORMAT_VERSION = 2
READ_VERSIONS = (FORMAT_VERSION, ALIGNED_FORMAT_VERSION)
#: a page-aligned table's page: ``rows_per_page`` rows at its start, the rest zero
PAGE_BYTES = 4096
PREAMBLE = struct.Struct("<8sHHIIIQ32x")
assert PREAMBLE.size == 64
ALIGNMENT = 2 << 20  # 2 MiB: a table can go straight into 2 MiB hugepages
CHUNK_BYTES = 64 << 20
MAX_HEADER_BYTES = 64 << 20
#: checksum chunks a header may declare: at least a page each, so a table's list of chunk CRCs (and
#: what reading a header allocates for it) stays proportional to its size in pages at most
MIN_CHUNK_BYTES = 4096
_HEX8 = re.compile(r"[0-9a-fA-F]{1,8}")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
MAX_CHUNK_BYTES = 1 << 40
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,254}$")

#: dtype name of DeepSeek-V4.1 packed Engram rows: 256 FP8 e4m3 values then
#: 8 ue8m0 scales (one per 32 values), ``tableserver.common.model.ROW_BYTES`` (264) bytes.
ENGRAM_DTYPE = "engram_fp8_e4m3_ue8m0"


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def table_digest(chunk_crcs: Sequence[int]) -> str:
    """The catalog checksum of a table without chunk SHA-256s (older files): CRC-32 over its chunk CRCs."""
    packed = np.asarray(chunk_crcs, dtype="<u4").tobytes()
    return f"crc32:{zlib.crc32(packed):08x}"


def table_sha256(chunk_digests: Sequence[bytes]) -> str:
    """The catalog checksum of a table: SHA-256 over its chunks' SHA-256 digests (chunks hash in
    parallel while loading; the result is as collision-resistant as SHA-256 over the bytes)."""
    return "sha256:" + hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def chunk_sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def chunk_count(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return -(-nbytes // chunk_bytes)


def chunk_ranges(nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[start, end) byte ranges of the checksum chunks of a table."""
    return [(a, min(a + chunk_bytes, nbytes)) for a in range(0, nbytes, chunk_bytes)]


def check_table_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TableFileError(
            f"invalid table name {name!r}: use 1-255 characters of letters, digits and ._:/- "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class TableSpec:
    """One table as a file (or another source) describes it."""

    name: str
    rows: int
    row_bytes: int
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    layer: int = -1
    version: int = 1
    offset: int = 0  # byte offset in its table file; 0 when not file-backed
    chunk_crcs: tuple[int, ...] | None = None
    chunk_bytes: int = CHUNK_BYTES
    chunk_sha256: tuple[bytes, ...] | None = None  # files written since the digest was added
    metadata: dict = field(default_factory=dict, compare=False, hash=False)
    #: 0: rows back to back (row-major); k: page-aligned, k rows at the start of each 4 KiB page (no row
    #: straddles two pages: one page read per row from disk). Checksums cover the rows alone either way.
    rows_per_page: int = 0

    @property
    def nbytes(self) -> int:
        """The rows' bytes (what checksums cover, what memory holds)."""
        return self.rows * self.row_bytes

    @property
    def file_bytes(self) -> int:
        """The bytes the table takes in its file."""
        if self.rows_per_page:
            return -(-self.rows // self.rows_per_page) * PAGE_BYTES
        return self.nbytes

    @property
    def checksum(self) -> str:
        if self.chunk_sha256 is not None:
            return table_sha256(self.chunk_sha256)
        return table_digest(self.chunk_crcs) if self.chunk_crcs is not None else ""

    def chunk_ok(self, i: int, data) -> bool:
        """Whether chunk ``i``'s bytes match the file: SHA-256 when the file has it, else CRC-32."""
        if self.chunk_sha256 is not None:
            return chunk_sha256(data) == self.chunk_sha256[i]
        return zlib.crc32(data) == self.chunk_crcs[i]

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return self.shape or (self.rows, self.row_bytes)


@dataclass(frozen=True)
class TableFileHeader:
    path: str
    file_size: int
    data_offset: int
    chunk_bytes: int
    tables: tuple[TableSpec, ...]
    created_by: str = ""
    metadata: dict = field(default_factory=dict)
    #: the file the header was read from (every later open of ``path`` must find the same, unchanged)
    identity: FileIdentity | None = None


# --------------------------------------------------------------------------- reading


def _bad(path: str, what: str, fix: str = "re-create it with `tableserver pack`") -> TableFileError:
    return TableFileError(f"{path}: {what}: {fix}")


def open_table_file(path: str, permission_fix: str = "") -> BinaryIO:
    """``open(path, "rb")``, its errors as TableFileErrors that say what to do (errno kept)."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise TableFileError(
            f"table file {path} not found: check --tables (make a demo file with `tableserver gen-demo PATH`)", errno=2
        ) from None
    except IsADirectoryError:
        raise TableFileError(f"table file {path} is a directory: pass a file to --tables", errno=21) from None
    except PermissionError as e:
        raise TableFileError(
            f"cannot read table file {path}: permission denied{permission_fix}", errno=e.errno
        ) from None


def file_bytes(fd: int) -> int:
    """The size of an open file, or of a block device (a table written straight onto a drive or a
    partition), whose ``st_size`` is 0; the file position is left at 0."""
    st = os.fstat(fd)
    if not stat.S_ISBLK(st.st_mode):
        return st.st_size
    size = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, 0, os.SEEK_SET)
    return size


def read_header(path: str) -> TableFileHeader:
    """Reads and validates a table file's header (no row data is read)."""
    with open_table_file(path, permission_fix=": fix its mode or run as a user that can read it") as f:
        identity = FileIdentity.of(f.fileno())
        file_size = file_bytes(f.fileno())
        pre = f.read(PREAMBLE.size)
        if len(pre) < PREAMBLE.size:
            raise _bad(path, f"truncated table file ({file_size} bytes, less than the {PREAMBLE.size}-byte preamble)")
        magic, version, _flags, header_bytes, header_crc, _r, data_offset = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise TableFileError(
                f"{path}: not a tableserver table file (magic {magic[:8]!r}, expected {MAGIC!r}): "
                "pass a file made by `tableserver pack` or `tableserver gen-demo`, or a .safetensors file"
            )
        if version not in READ_VERSIONS:
            raise TableFileError(
                f"{path}: table file format version {version}, this tableserver reads versions "
                f"{', '.join(map(str, READ_VERSIONS))}: upgrade tableserver or re-pack the file"
            )
        if header_bytes == 0 or header_bytes > MAX_HEADER_BYTES:
            raise _bad(path, f"bad header length {header_bytes}")
        raw = f.read(header_bytes)
    if len(raw) < header_bytes:
        raise _bad(
            path, f"truncated table file (header needs {PREAMBLE.size + header_bytes} bytes, file has {file_size})"
        )
    if zlib.crc32(raw) != header_crc:
        raise _bad(path, "corrupt header (header checksum mismatch)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"bad header JSON ({e})") from None
    except RecursionError:
        raise _bad(path, "bad header JSON (nested too deep)") from None
    return dataclasses.replace(_parse_header(path, file_size, data_offset, header_bytes, doc), identity=identity)


def _parse_header(path: str, file_size: int, data_offset: int, header_bytes: int, doc) -> TableFileHeader:
    if not isinstance(doc, dict) or not isinstance(doc.get("tables"), list):
        raise _bad(path, "bad header: no 'tables' list")
    chunk_bytes = doc.get("chunk_bytes", CHUNK_BYTES)
    alignment = doc.get("alignment", ALIGNMENT)
    if not (
        isinstance(chunk_bytes, int)
        and MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES
        and isinstance(alignment, int)
        and 0 < alignment <= MAX_CHUNK_BYTES
    ):
        raise _bad(
            path,
            f"bad header: chunk_bytes must be an integer in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} "
            "and alignment a positive integer",
        )
    if not isinstance(doc.get("metadata") or {}, dict):
        raise _bad(path, "bad header: metadata is not an object")
    if data_offset < PREAMBLE.size + header_bytes or data_offset % alignment:
        raise _bad(path, f"bad header: data offset {data_offset} overlaps the header or is not {alignment}-aligned")
    specs: list[TableSpec] = []
    seen: set[str] = set()
    for i, t in enumerate(doc["tables"]):
        try:
            spec = _parse_table(t, chunk_bytes)
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"bad header: table #{i}: {e}") from None
        except TableFileError as e:
            raise _bad(path, f"bad header: table #{i}: {e}") from None
        if spec.name in seen:
            raise TableFileError(
                f"{path}: table name {spec.name!r} appears twice: "
                "table names must be unique; re-pack with distinct names"
            )
        seen.add(spec.name)
        if spec.offset < data_offset or spec.offset % alignment:
            raise _bad(
                path,
                f"bad header: table {spec.name!r} offset {spec.offset} is before the data or not {alignment}-aligned",
            )
        end = spec.offset + spec.file_bytes
        if end > file_size:
            raise TableFileError(
                f"{path}: truncated table file: table {spec.name!r} ends at byte {end} but the file has "
                f"{file_size} bytes: re-copy or re-pack it"
            )
        specs.append(spec)
    ordered = sorted(specs, key=lambda s: s.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.file_bytes > b.offset:
            raise _bad(path, f"bad header: tables {a.name!r} and {b.name!r} overlap")
    return TableFileHeader(
        path=path,
        file_size=file_size,
        data_offset=data_offset,
        chunk_bytes=chunk_bytes,
        tables=tuple(specs),
        created_by=str(doc.get("created_by", ""))[:1000],
        metadata=dict(doc.get("metadata") or {}),
    )


def _int(t: dict, key: str, default=None) -> int:
    """A JSON integer field (not a float, bool or string that looks like one)."""
    v = t.get(key, default) if default is not None else t[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{key} must be an integer, got {json.dumps(v)[:40]}")
    return v


def _parse_table(t: dict, chunk_bytes: int) -> TableSpec:
    if not isinstance(t, dict):
        raise TypeError("entry is not an object")
    name = check_table_name(t["name"])
    rows, row_bytes, offset = _int(t, "rows"), _int(t, "row_bytes"), _int(t, "offset")
    if rows < 0 or row_bytes <= 0 or offset < 0:
        raise ValueError(f"rows={rows} row_bytes={row_bytes} offset={offset} out of range")
    if _int(t, "nbytes", rows * row_bytes) != rows * row_bytes:
        raise ValueError(f"nbytes {t['nbytes']} != rows * row_bytes")
    crcs = t.get("chunk_crc32")
    n_chunks = chunk_count(rows * row_bytes, chunk_bytes)  # counted, never built, before it is checked
    if not isinstance(crcs, list) or len(crcs) != n_chunks:
        raise ValueError(f"needs {n_chunks} chunk checksums")
    if not all(isinstance(c, str) and _HEX8.fullmatch(c) for c in crcs):
        raise ValueError("chunk checksums must be hex strings of up to 8 digits")
    shas = t.get("chunk_sha256")
    if shas is not None:
        if (
            not isinstance(shas, list)
            or len(shas) != n_chunks
            or not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in shas)
        ):
            raise ValueError(f"chunk_sha256 needs {n_chunks} hex strings of 64 digits")
        shas = tuple(bytes.fromhex(h) for h in shas)
    if not isinstance(t.get("metadata") or {}, dict):
        raise ValueError("metadata is not an object")
    raw_shape = t.get("shape") or [rows, row_bytes]
    if not isinstance(raw_shape, list) or len(raw_shape) > 8:
        raise ValueError("shape must be a list of at most 8 integers")
    shape = tuple(_int({"shape": x}, "shape") for x in raw_shape)
    per_page = _int(t, "rows_per_page", 0)
    if per_page < 0 or per_page * row_bytes > PAGE_BYTES:
        raise ValueError(f"rows_per_page {per_page} of {row_bytes} B rows does not fit a {PAGE_BYTES} B page")
    return TableSpec(
        name=name,
        rows=rows,
        row_bytes=row_bytes,
        dtype=str(t.get("dtype", "uint8"))[:64],
        shape=shape,
        layer=_int(t, "layer", -1),
        version=_int(t, "version", 1),
        offset=offset,
        chunk_crcs=tuple(int(c, 16) for c in crcs),
        chunk_bytes=chunk_bytes,
        chunk_sha256=shas,
        metadata=dict(t.get("metadata") or {}),
        rows_per_page=per_page,
    )


def rows_per_page(row_bytes: int) -> int:
    """Rows of ``row_bytes`` in a page-aligned layout's page; TableFileError for rows larger than a page."""
    if row_bytes > PAGE_BYTES:
        raise TableFileError(
            f"rows of {row_bytes} B are larger than a {PAGE_BYTES} B page: page alignment is for smaller rows; "
            "pack without --page-aligned"
        )
    return PAGE_BYTES // row_bytes


def logical_bytes(mapped: np.ndarray, spec: TableSpec, a: int, b: int) -> np.ndarray:
    """Bytes [a, b) of ``spec``'s rows, back to back, from ``mapped`` (its whole file as uint8): a view for
    a row-major table, a copy of the pages' rows for a page-aligned one."""
    if not spec.rows_per_page:
        return mapped[spec.offset + a : spec.offset + b]
    k, rb = spec.rows_per_page, spec.row_bytes
    r0, r1 = a // rb, -(-b // rb)
    p0, p1 = r0 // k, (r1 - 1) // k + 1
    pages = mapped[spec.offset + p0 * PAGE_BYTES : spec.offset + p1 * PAGE_BYTES].reshape(-1, PAGE_BYTES)
    rows = pages[:, : k * rb].reshape(-1)[(r0 - p0 * k) * rb : (r1 - p0 * k) * rb]
    return rows[a - r0 * rb : b - r0 * rb]


def verify_table(path: str, spec: TableSpec, data) -> None:
    """Checks ``data`` (the table's bytes) against the spec's chunk CRCs."""
    view = memoryview(data).cast("B")
    for i, (a, b) in enumerate(chunk_ranges(spec.nbytes, spec.chunk_bytes)):
        if not spec.chunk_ok(i, view[a:b]):
            raise checksum_error(path, spec, i)


def checksum_error(path: str, spec: TableSpec, chunk: int) -> ChecksumError:
    a = chunk * spec.chunk_bytes
    return ChecksumError(
        f"{path}: checksum mismatch in table {spec.name!r} bytes {a}..{min(a + spec.chunk_bytes, spec.nbytes)} "
        f"(rows {a // spec.row_bytes}..{min(a + spec.chunk_bytes, spec.nbytes) // spec.row_bytes}): the file is "
        "corrupt; re-copy or re-pack it (or pass --no-verify to serve it unchecked)"
    )


# --------------------------------------------------------------------------- writing


class TableFileWriter:
    """Writes a table file sequentially; publishes it atomically on commit.

    Rows of each table are appended in order with :meth:`append`; CRCs are
    computed while writing. Use as a context manager: the file appears under
    its final name only if the block exits without an exception.
    """

    def __init__(
        self,
        path: str,
        tables: Iterable[TableSpec],
        *,
        chunk_bytes: int = CHUNK_BYTES,
        alignment: int = ALIGNMENT,
        metadata: dict | None = None,
        created_by: str = "",
    ):
        self.path = path
        self.tmp_path = ""
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.alignment = alignment
        self.metadata = dict(metadata or {})
        self.created_by = created_by or _created_by()
        specs = list(tables)
        names = [check_table_name(s.name) for s in specs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise TableFileError(f"table name {sorted(dup)[0]!r} given twice: table names must be unique")
        self._specs = specs
        self._crcs: list[list[int]] = [[] for _ in specs]
        self._running = [0] * len(specs)
        self._shas: list[list[bytes]] = [[] for _ in specs]
        self._hashers = [hashlib.sha256() for _ in specs]
        self._written = [0] * len(specs)
        header = self._header_bytes(placeholder=True)
        offset = align_up(PREAMBLE.size + len(header), alignment)
        self.data_offset = offset
        self.offsets = []
        for s in specs:
            if s.rows_per_page < 0 or s.rows_per_page * s.row_bytes > PAGE_BYTES:
                raise ValueError(f"table {s.name!r}: {s.rows_per_page} rows of {s.row_bytes} B do not fit a page")
            self.offsets.append(offset)
            offset = align_up(offset + s.file_bytes, alignment)
        self.file_size = self.offsets[-1] + specs[-1].file_bytes if specs else self.data_offset
        self._carry: list[np.ndarray | None] = [None] * len(specs)  # a page-aligned table's rows of its last page
        self._fd, self.tmp_path = create_temp(path)
        os.ftruncate(self._fd, self.file_size)

    # -- header
    def _table_doc(self, i: int, placeholder: bool) -> dict:
        s = self._specs[i]
        n_chunks = chunk_count(s.nbytes, self.chunk_bytes)
        crcs = ["00000000"] * n_chunks if placeholder else [f"{c:08x}" for c in self._crcs[i]]
        shas = ["0" * 64] * n_chunks if placeholder else [h.hex() for h in self._shas[i]]
        return {
            "name": s.name,
            "layer": s.layer,
            "dtype": s.dtype,
            "shape": list(s.logical_shape),
            "rows": s.rows,
            "row_bytes": s.row_bytes,
            "version": s.version,
            "offset": 0 if placeholder else self.offsets[i],
            "nbytes": s.nbytes,
            **({"rows_per_page": s.rows_per_page} if s.rows_per_page else {}),
            "metadata": s.metadata,
            "chunk_crc32": crcs,
            "chunk_sha256": shas,
        }

    @property
    def format_version(self) -> int:
        return ALIGNED_FORMAT_VERSION if any(s.rows_per_page for s in self._specs) else FORMAT_VERSION

    def _header_bytes(self, placeholder: bool) -> bytes:
        doc = {
            "format": "tableserver-tables",
            "version": self.format_version,
            "alignment": self.alignment,
            "chunk_bytes": self.chunk_bytes,
            "created_by": self.created_by,
            "metadata": self.metadata,
            "tables": [self._table_doc(i, placeholder) for i in range(len(self._specs))],
        }
        raw = json.dumps(doc, separators=(",", ":")).encode()
        if placeholder:
            # Offsets are not known yet: reserve room for the widest offset.
            raw += b" " * (24 * max(1, len(self._specs)))
        return raw

    # -- rows
    def append(self, table: int, rows: np.ndarray) -> None:
        """Appends the next rows (uint8 ``[n, row_bytes]``) of table ``table``."""
        s = self._specs[table]
        block = np.ascontiguousarray(rows, dtype=np.uint8)
        if block.ndim != 2 or block.shape[1] != s.row_bytes:
            raise ValueError(f"rows for {s.name!r} must be uint8 [n, {s.row_bytes}], got {rows.shape}")
        if self._written[table] + block.nbytes > s.nbytes:
            raise ValueError(f"too many rows for table {s.name!r} ({s.rows} rows)")
        view = memoryview(block).cast("B")
        if s.rows_per_page:
            self._write_pages(table, block)
        else:
            _pwrite_all(self._fd, view, self.offsets[table] + self._written[table])
        self._crc_update(table, view)

    def _write_pages(self, table: int, block: np.ndarray, last: bool = False) -> None:
        """A page-aligned table's next rows, written in whole pages; the rows of a page not yet full wait
        for the next append (or, ``last``, are written as the table's last page)."""
        s = self._specs[table]
        k, rb = s.rows_per_page, s.row_bytes
        carry = self._carry[table]
        rows = block if carry is None else np.concatenate((carry, block))
        first_row = self._written[table] // rb - (0 if carry is None else len(carry))  # a multiple of k
        pages = -(-len(rows) // k) if last else len(rows) // k
        if pages:
            buf = np.zeros((pages, PAGE_BYTES), np.uint8)
            held = min(len(rows), pages * k)
            flat = np.zeros((pages * k, rb), np.uint8)
            flat[:held] = rows[:held]
            buf[:, : k * rb] = flat.reshape(pages, k * rb)
            _pwrite_all(self._fd, memoryview(buf).cast("B"), self.offsets[table] + first_row // k * PAGE_BYTES)
        rest = rows[pages * k :]
        self._carry[table] = rest.copy() if len(rest) else None

    def skip(self, table: int, rows: int) -> None:
        """Appends ``rows`` zero rows without writing them (the file stays sparse there)."""
        s = self._specs[table]
        end = self._written[table] + rows * s.row_bytes
        if end > s.nbytes:
            raise ValueError(f"too many rows for table {s.name!r} ({s.rows} rows)")
        if s.rows_per_page:  # its pages are written whole: zero rows are appended (not sparse)
            for a in range(0, rows, 1 << 16):
                self.append(table, np.zeros((min(1 << 16, rows - a), s.row_bytes), np.uint8))
            return
        zero_chunk = None
        while self._written[table] < end:
            pos = self._written[table]
            n = min(self.chunk_bytes - pos % self.chunk_bytes, end - pos)
            if n == self.chunk_bytes:  # a whole aligned chunk of zeros: one CRC and digest serve them all
                if zero_chunk is None:
                    zeros = bytes(n)
                    zero_chunk = (zlib.crc32(zeros), chunk_sha256(zeros))
                self._crcs[table].append(zero_chunk[0])
                self._shas[table].append(zero_chunk[1])
                self._written[table] += n
            else:
                self._crc_update(table, memoryview(bytes(n)))

    def fill_zeros(self, table: int) -> None:
        """Declares the rest of a table zero (left sparse on disk)."""
        s = self._specs[table]
        self.skip(table, (s.nbytes - self._written[table]) // s.row_bytes)

    def _crc_update(self, table: int, view: memoryview) -> None:
        pos, crc = self._written[table], self._running[table]
        while len(view):
            room = self.chunk_bytes - pos % self.chunk_bytes
            part, view = view[:room], view[room:]
            crc = zlib.crc32(part, crc)
            self._hashers[table].update(part)
            pos += len(part)
            if pos % self.chunk_bytes == 0:
                self._crcs[table].append(crc)
                self._shas[table].append(self._hashers[table].digest())
                self._hashers[table] = hashlib.sha256()
                crc = 0
        self._written[table], self._running[table] = pos, crc

    # -- publish
    def commit(self) -> str:
        for i, s in enumerate(self._specs):
            if self._written[i] != s.nbytes:
                raise ValueError(f"table {s.name!r}: wrote {self._written[i]} of {s.nbytes} bytes")
            if self._carry[i] is not None:
                self._write_pages(i, np.empty((0, s.row_bytes), np.uint8), last=True)
            if s.nbytes % self.chunk_bytes:
                self._crcs[i].append(self._running[i])
                self._shas[i].append(self._hashers[i].digest())
        header = self._header_bytes(placeholder=False)
        if PREAMBLE.size + len(header) > self.data_offset:
            raise AssertionError("header outgrew its reservation")
        pre = PREAMBLE.pack(MAGIC, self.format_version, 0, len(header), zlib.crc32(header), 0, self.data_offset)
        _pwrite_all(self._fd, memoryview(pre + header), 0)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp_path, self.path)
        return self.path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            if self.tmp_path:
                os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> TableFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _created_by() -> str:
    from tableserver import __version__

    return f"tableserver {__version__}"
