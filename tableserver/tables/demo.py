"""Deterministic Engram-shaped demo tables, so tests and the demo need no download.

Row ``r`` of a table depends only on ``(seed, table name, r)``, never on how the
file was chunked, so any slice can be regenerated independently. Rows are
unique within a table: an off-by-one anywhere in a gather returns a row that
differs from the expected one.

Engram rows (264 bytes) look like DeepSeek-V4.1's packed rows: 256 FP8 e4m3
bytes with the NaN encodings (``0x7f``/``0xff``) avoided, then 8 ue8m0 scale
bytes in [112, 127] (2^-15 .. 2^0) that spell the row number in nibbles, which
is what makes every row unique. Other row sizes get random bytes with the row
number (xor a per-table salt) in their first 8 bytes.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import numpy as np

from tableserver.common.model import FP8_BYTES, ROW_BYTES, SCALE_BYTES, TABLE_ROWS
from tableserver.tables.tablefile import ENGRAM_DTYPE, TableFileWriter, TableSpec, rows_per_page

DEFAULT_ROWS = 600_000  # x 264 B x 2 tables = 317 MB
DEFAULT_LAYERS = tuple(TABLE_ROWS)  # (1, 14): the layers DeepSeek-V4.1 has a table for
_POOL_ROWS = 1 << 16
_BLOCK_ROWS = 1 << 16


@dataclass(frozen=True)
class DemoTable:
    name: str
    rows: int
    row_bytes: int = ROW_BYTES
    layer: int = -1

    @property
    def engram(self) -> bool:
        return self.row_bytes == ROW_BYTES

    def spec(self) -> TableSpec:
        dtype = ENGRAM_DTYPE if self.engram else "uint8"
        return TableSpec(
            name=self.name,
            rows=self.rows,
            row_bytes=self.row_bytes,
            dtype=dtype,
            shape=(self.rows, self.row_bytes),
            layer=self.layer,
        )


def default_tables(rows: int = DEFAULT_ROWS, row_bytes: int = ROW_BYTES, layers=DEFAULT_LAYERS) -> list[DemoTable]:
    """The two tables DeepSeek-V4.1 has, named for their layers, at demo size."""
    return [DemoTable(f"engram.layer{layer}", rows, row_bytes, layer) for layer in layers]


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized (wrapping uint64 arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class DemoRows:
    """Generates any row range of one demo table."""

    def __init__(self, table: DemoTable, seed: int = 0):
        self.table = table
        self.salt = np.uint64(zlib.crc32(f"{seed}/{table.name}".encode()) | (seed << 32) & (2**64 - 1))
        rng = np.random.default_rng([seed, zlib.crc32(table.name.encode())])
        pool = rng.integers(0, 256, size=(_POOL_ROWS, table.row_bytes), dtype=np.uint8)
        if table.engram:
            fp8 = pool[:, :FP8_BYTES]
            fp8[(fp8 & 0x7F) == 0x7F] ^= 1  # 0x7f/0xff are NaN in e4m3: use +-448 instead
        self.pool = pool

    def rows(self, start: int, stop: int) -> np.ndarray:
        """uint8 ``[stop - start, row_bytes]``: rows ``start..stop-1`` of the table."""
        r = np.arange(start, stop, dtype=np.uint64)
        pick = (_mix64(r ^ self.salt) % np.uint64(_POOL_ROWS)).astype(np.intp)
        out = np.take(self.pool, pick, axis=0)
        if self.table.engram:
            shifts = np.arange(0, 4 * SCALE_BYTES, 4, dtype=np.uint64)  # one nibble of r per scale byte
            out[:, FP8_BYTES:ROW_BYTES] = (np.uint64(112) + ((r[:, None] >> shifts) & np.uint64(0xF))).astype(np.uint8)
        else:
            k = min(8, self.table.row_bytes)
            stamp = (r ^ self.salt).astype("<u8").view(np.uint8).reshape(-1, 8)
            out[:, :k] = stamp[:, :k]
        return out


def write_demo_file(
    path: str, tables: list[DemoTable] | None = None, seed: int = 0, progress=None, page_aligned: bool = False
) -> str:
    """Writes a demo table file atomically and returns its path (``page_aligned``: see TableSpec)."""
    tables = tables if tables is not None else default_tables()
    specs = [
        dataclasses.replace(t.spec(), rows_per_page=rows_per_page(t.row_bytes)) if page_aligned else t.spec()
        for t in tables
    ]
    with TableFileWriter(path, specs, metadata={"demo": True, "seed": seed}) as w:
        for i, t in enumerate(tables):
            gen = DemoRows(t, seed)
            for a in range(0, t.rows, _BLOCK_ROWS):
                b = min(a + _BLOCK_ROWS, t.rows)
                w.append(i, gen.rows(a, b))
                if progress is not None:
                    progress((b - a) * t.row_bytes)
    return path
