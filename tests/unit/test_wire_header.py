"""The native poller's wire constants (client/tableclient/graph/poller/_native_c/wire.h) against the protocol itself
(tableserver/common/wire.py): every define has wire.py's value, every FrameType and Status member has a define (a
status added to wire.py fails here until wire.h has it too), FATAL is the macro's list, and wire.h defines nothing
this test does not check. Read as text (a simple #define parser): no compiler needed."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from tableserver.common import wire

ROOT = Path(__file__).resolve().parents[2]
NATIVE_C = ROOT / "client" / "tableclient" / "graph" / "poller" / "_native_c"
WIRE_H = NATIVE_C / "wire.h"

#: the header's fields, in wire.HEADER's order ("<4sHHQII"), as wire.py's docstring names them
REQUEST_FIELDS = ("magic", "type", "flags", "request_id", "table", "count")
RESPONSE_FIELDS = ("magic", "type", "status", "request_id", "row_bytes", "count")


def parse_defines(text: str) -> dict[str, str]:
    """NAME -> its value's text (comments dropped, continuation lines joined) of every #define."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S).replace("\\\n", " ")
    out = {}
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+(?:\([^)]*\))?)[ \t]*(.*)$", text, re.M):
        name = m.group(1).split("(")[0]
        assert name not in out, f"wire.h defines {name} twice"
        out[name] = m.group(2).strip()
    return out


@pytest.fixture(scope="module")
def defines() -> dict[str, str]:
    return parse_defines(WIRE_H.read_text())


def as_int(defines: dict[str, str], name: str) -> int:
    assert name in defines, f"wire.h has no {name}"
    value = defines[name]
    assert re.fullmatch(r"-?\d+", value), f"{name} is {value!r}, not a plain integer"
    return int(value)


def as_bytes(defines: dict[str, str], name: str) -> bytes:
    assert name in defines, f"wire.h has no {name}"
    m = re.fullmatch(r'"([^"\\]*)"', defines[name])
    assert m, f"{name} is {defines[name]!r}, not a plain string literal"
    return m.group(1).encode()


def field_offsets() -> list[int]:
    """Where each of wire.HEADER's fields starts (little-endian, packed: "<" aligns nothing)."""
    fmt = wire.HEADER.format
    assert fmt[0] == "<", fmt
    codes = re.findall(r"\d*[a-zA-Z?]", fmt[1:])
    return [struct.calcsize("<" + "".join(codes[:k])) for k in range(len(codes))]


def fatal_names(defines: dict[str, str]) -> set[str]:
    assert "WIRE_STATUS_FATAL" in defines, "wire.h has no WIRE_STATUS_FATAL(status)"
    return set(re.findall(r"\bWIRE_STATUS_(\w+)", defines["WIRE_STATUS_FATAL"]))


def test_the_header_size_and_magics_are_wire_py_s(defines):
    assert as_int(defines, "WIRE_HEADER_BYTES") == wire.HEADER_BYTES == wire.HEADER.size
    assert as_bytes(defines, "WIRE_REQUEST_MAGIC") == wire.REQUEST_MAGIC
    assert as_bytes(defines, "WIRE_RESPONSE_MAGIC") == wire.RESPONSE_MAGIC
    magic = as_int(defines, "WIRE_MAGIC_BYTES")
    assert magic == len(wire.REQUEST_MAGIC) == len(wire.RESPONSE_MAGIC) == field_offsets()[1]


def test_each_header_field_starts_where_wire_py_packs_it(defines):
    offsets = field_offsets()
    assert len(offsets) == len(REQUEST_FIELDS) == len(RESPONSE_FIELDS), wire.HEADER.format
    for fields in (REQUEST_FIELDS, RESPONSE_FIELDS):
        for field, at in zip(fields[1:], offsets[1:]):
            assert as_int(defines, f"WIRE_AT_{field.upper()}") == at, field


def test_every_frame_type_has_its_define(defines):
    for member in wire.FrameType:
        assert as_int(defines, f"WIRE_FRAME_{member.name}") == member.value, member
    extra = {n for n in defines if n.startswith("WIRE_FRAME_")} - {f"WIRE_FRAME_{m.name}" for m in wire.FrameType}
    assert not extra, f"wire.h has frame types wire.FrameType does not: {sorted(extra)}"


def test_every_status_has_its_define(defines):
    for member in wire.Status:
        assert as_int(defines, f"WIRE_STATUS_{member.name}") == member.value, member
    named = {f"WIRE_STATUS_{m.name}" for m in wire.Status} | {"WIRE_STATUS_FATAL"}
    extra = {n for n in defines if n.startswith("WIRE_STATUS_")} - named
    assert not extra, f"wire.h has statuses wire.Status does not: {sorted(extra)}"


def test_the_fatal_statuses_are_wire_fatal(defines):
    assert fatal_names(defines) == {s.name for s in wire.FATAL}


def test_row_ids_are_wire_py_s(defines):
    assert as_int(defines, "WIRE_ROW_ID_BYTES") == wire.ROW_ID_BYTES


def test_wire_h_defines_nothing_unchecked(defines):
    checked = {
        "TABLECLIENT_POLLER_WIRE_H",  # the include guard
        "WIRE_HEADER_BYTES",
        "WIRE_MAGIC_BYTES",
        "WIRE_REQUEST_MAGIC",
        "WIRE_RESPONSE_MAGIC",
        "WIRE_ROW_ID_BYTES",
        "WIRE_STATUS_FATAL",
    }
    checked |= {f"WIRE_AT_{f.upper()}" for f in REQUEST_FIELDS[1:] + RESPONSE_FIELDS[1:]}
    checked |= {f"WIRE_FRAME_{m.name}" for m in wire.FrameType} | {f"WIRE_STATUS_{m.name}" for m in wire.Status}
    assert set(defines) <= checked, f"wire.h defines what this test does not check: {sorted(set(defines) - checked)}"


def test_the_poller_s_c_spells_no_magic_of_its_own():
    for path in sorted(NATIVE_C.glob("*.c")):
        text = path.read_text()
        for magic in (wire.REQUEST_MAGIC, wire.RESPONSE_MAGIC):
            assert f'"{magic.decode()}"' not in text, f"{path.name} spells {magic!r}: use wire.h's define"
