"""``tableserver pack`` and ``tableserver inspect``.

pack: every table found in the given safetensors files (see sources.py for
the DeepSeek-V4.1 Engram rule) is streamed, in row blocks, into one table file
written atomically. inspect: prints a file's catalog and re-computes every
chunk checksum, naming the corrupt region if one differs.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from tableserver.errors import ChecksumError, TableFileError
from tableserver.progress import Progress, human_bytes
from tableserver.sources import SafetensorsSource, open_source, open_sources
from tableserver.tablefile import TableFileWriter, checksum_error, chunk_ranges, logical_bytes, rows_per_page

log = logging.getLogger("tableserver.pack")
_BLOCK_ROWS = 1 << 16


def pack(output: str, inputs: list[str], version: int = 1, page_aligned: bool = False) -> str:
    def safetensors_only(path, src):
        if not isinstance(src, SafetensorsSource):
            raise TableFileError(f"{path}: pack reads .safetensors files; this is already a table file")

    entries = open_sources(inputs, "comes from both", "pack them separately or rename a tensor", safetensors_only)
    sources = [src for src, _ in entries]
    specs = [
        dataclasses.replace(spec, version=version, rows_per_page=rows_per_page(spec.row_bytes) if page_aligned else 0)
        for _, spec in entries
    ]
    if not specs:
        raise TableFileError(f"no 2-D tensors in {', '.join(inputs)}: nothing to pack")
    bar = Progress(sum(s.nbytes for s in specs), f"packing {output}")
    with TableFileWriter(output, specs, metadata={"sources": inputs}) as w:
        for i, (src, spec) in enumerate(zip(sources, specs)):
            for a in range(0, spec.rows, _BLOCK_ROWS):
                b = min(a + _BLOCK_ROWS, spec.rows)
                w.append(i, src.rows(spec, a, b))
                bar.update((b - a) * spec.row_bytes)
    bar.finish()
    log.info("packed %d tables (%s) into %s", len(specs), human_bytes(sum(s.nbytes for s in specs)), output)
    return output


def inspect_file(path: str, verify: bool = True, out=None) -> int:
    """Prints the catalog; returns 0 if every checksum matches, 1 otherwise."""
    src = open_source(path)
    w = out.write
    w(f"{path}\n")
    w(f"{'#':>3}  {'name':<24} {'layer':>5} {'rows':>13} {'row_bytes':>9} {'size':>11}  {'dtype':<24} checksum\n")
    for i, s in enumerate(src.specs):
        w(
            f"{i:>3}  {s.name:<24} {s.layer:>5} {s.rows:>13,} {s.row_bytes:>9} {human_bytes(s.nbytes):>11}  "
            f"{s.dtype:<24} {s.checksum or '-'}\n"
        )
    if not verify or isinstance(src, SafetensorsSource):
        return 0
    bad = 0
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for s in src.specs:
        for c, (a, b) in enumerate(chunk_ranges(s.nbytes, s.chunk_bytes)):
            if not s.chunk_ok(c, np.ascontiguousarray(logical_bytes(data, s, a, b))):
                err: ChecksumError = checksum_error(path, s, c)
                w(f"FAIL  {err}\n")
                bad += 1
                break
        else:
            w(
                f"ok    {s.name}: {len(s.chunk_crcs)} chunks verified "
                f"({'SHA-256' if s.chunk_sha256 is not None else 'CRC-32'})\n"
            )
    return 1 if bad else 0
