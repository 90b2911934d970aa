"""``tableserver pack`` and ``tableserver inspect``.

pack: the Engram tables found in the given safetensors files (an FP8 e4m3
``[N, 256]`` weight with its ue8m0 ``[N, 8]`` scale, see sources.py), plus only
the other 2-D tensors named with ``--tensor`` (a checkpoint's linear weights are
tensors too, and no table), are listed, then streamed in row blocks into one
table file written atomically. inspect: prints a file's catalog and re-computes
every chunk checksum, naming the corrupt region if one differs.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from tableserver.errors import ChecksumError, TableFileError
from tableserver.tables.progress import Progress, human_bytes
from tableserver.tables.sources import SafetensorsSource, open_source
from tableserver.tables.tablefile import (
    ENGRAM_DTYPE,
    TableFileWriter,
    TableSpec,
    checksum_error,
    chunk_ranges,
    logical_bytes,
    rows_per_page,
)

log = logging.getLogger(__name__)
_BLOCK_ROWS = 1 << 16


def pack(
    output: str,
    inputs: list[str],
    version: int = 1,
    page_aligned: bool = False,
    tensors: tuple[str, ...] | list[str] = (),
    out=None,
) -> str:
    """Packs the Engram tables of ``inputs`` and the 2-D tensors named in ``tensors`` into ``output``,
    after listing them on ``out`` (one line per table). TableFileError when there is nothing to pack or a
    named tensor is not a 2-D tensor of the inputs."""
    entries, others = _chosen(inputs, tuple(dict.fromkeys(tensors)))
    sources = [src for src, _ in entries]
    specs = [
        dataclasses.replace(spec, version=version, rows_per_page=rows_per_page(spec.row_bytes) if page_aligned else 0)
        for _, spec in entries
    ]
    if out is not None:
        _list(out, output, [spec for _, spec in entries], others)
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


def _chosen(inputs: list[str], named: tuple[str, ...]) -> tuple[list[tuple], list[TableSpec]]:
    """``(source, spec)`` of every table to pack (each name once), and the specs of the other tables
    of ``inputs`` left out."""
    entries, others, where, found, sources = [], [], {}, set(), []
    for path in inputs:
        if not os.path.isfile(path):
            raise TableFileError(
                f"{path}: no such file: pass the checkpoint's .safetensors files (e.g. model-*.safetensors) to pack"
            )
        src = open_source(path)
        if not isinstance(src, SafetensorsSource):
            raise TableFileError(f"{path}: pack reads .safetensors files; this is already a table file")
        sources.append(src)
        for spec in src.specs:
            hit = [t for t in (spec.name, *src.tensors_of(spec)) if t in named]  # its table or tensor name
            found.update(hit)
            if spec.dtype != ENGRAM_DTYPE and not hit:
                others.append(spec)
                continue
            if spec.name in where:
                raise TableFileError(
                    f"table {spec.name!r} comes from both {where[spec.name]} and {path}: "
                    "pack them separately or rename a tensor"
                )
            where[spec.name] = path
            entries.append((src, spec))
    for name in named:
        if name in found:
            continue
        held = next(((src.path, shape) for src in sources if (shape := src.tensor_shape(name)) is not None), None)
        if held is None:
            raise TableFileError(
                f"--tensor {name}: no tensor of that name in {_files(inputs)}: "
                "`tableserver inspect FILE.safetensors` lists a file's tables"
            )
        path, shape = held
        raise TableFileError(
            f"--tensor {name}: {path} holds it as a {len(shape)}-D tensor of shape {shape}, and only 2-D tensors "
            "of non-empty rows become tables: drop it from --tensor"
        )
    if not entries:
        besides = f" (only {len(others)} other 2-D tensor{'s' if len(others) != 1 else ''})" if others else ""
        raise TableFileError(
            f"no Engram tables (an FP8 e4m3 [N, 256] weight beside its ue8m0 [N, 8] scale) in "
            f"{_files(inputs)}{besides}: name the tensors to pack with --tensor NAME"
        )
    return entries, others


def _files(paths: list[str]) -> str:
    """``paths`` for a one-line message: all of a few, or the first two and how many in all."""
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, {paths[1]}, ... ({len(paths)} files)"


def _list(out, output: str, specs: list[TableSpec], others: list[TableSpec]) -> None:
    """What pack is about to write, one line per table; then what it leaves out."""
    width = max(len(s.name) for s in specs)
    total = sum(s.nbytes for s in specs)
    w = out.write
    w(f"packing {len(specs)} table{'s' if len(specs) != 1 else ''} ({human_bytes(total)}) into {output}:\n")
    dims = [f"{s.rows:,} rows x {s.row_bytes} B" for s in specs]
    across = max(map(len, dims))
    for s, d in zip(specs, dims):
        w(f"  {s.name:<{width}}  {d:>{across}}  {human_bytes(s.nbytes):>10}\n")
    if others:
        w(
            f"not packed: {len(others)} other 2-D tensor{'s' if len(others) != 1 else ''} "
            f"({human_bytes(sum(s.nbytes for s in others))}); add --tensor NAME to pack one\n"
        )
    out.flush()


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
