"""Table identity: every table's whole-table checksum, total rows and row size, pinned per client.

The client pins the first identity it sees of each table (or the checksum it is given); a node
whose table differs is refused, never read from: rows of two versions are never mixed.
"""

from __future__ import annotations

from tableclient.errors import ConnectError


class VersionMismatch(ConnectError):
    """A node serves a table whose identity (checksum, rows, row size) differs from the pinned one."""


class Pins:
    """The pinned identity of each table: ``(checksum, total rows, row bytes)``, or ``(checksum, None,
    None)`` for a checksum given before any node was seen. Not locked: the caller holds its lock."""

    def __init__(self, checksums: dict | None = None):
        self._pins: dict[str, tuple] = {name: (c, None, None) for name, c in (checksums or {}).items()}

    def mismatch(self, infos) -> tuple | None:
        """``(table, its pin)`` for the first of ``infos`` (a node's catalog) whose identity differs
        from the pinned one, None when every one matches; tables seen first are pinned on the way."""
        for t in infos:
            pin = self._pins.get(t.name)
            ident = (t.checksum, t.total_rows, t.row_bytes)
            if pin is None or pin[1] is None:
                if pin is not None and pin[0] != t.checksum:
                    return t, pin
                self._pins[t.name] = ident
            elif pin != ident:
                return t, pin
        return None


def refusal(t, pin: tuple) -> str:
    """Why a node serving table ``t`` (a TableInfo) is refused, against the pin it differs from."""
    pinned = pin[0] if pin[1] is None else f"{pin[0]} ({pin[1]} rows of {pin[2]} B)"
    return (
        f"table {t.name!r} there is {t.checksum} ({t.total_rows} rows of {t.row_bytes} B) but this "
        f"client pinned {pinned}"
    )
