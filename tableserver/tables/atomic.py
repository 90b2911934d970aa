"""Files published whole: a new temp file with an unpredictable name next to the target, created
O_CREAT|O_EXCL|O_NOFOLLOW (a file or symlink planted at a temp name is never followed or overwritten),
then renamed into place with os.replace. Standard library only: ``tableserver doctor`` runs it in an
environment without numpy.
"""

from __future__ import annotations

import os
import secrets

from tableserver.errors import TableFileError


def create_temp(path: str, mode: int = 0o644) -> tuple[int, str]:
    """(fd, name) of a new, unpredictable file next to ``path``, created with O_EXCL|O_NOFOLLOW: a file or
    symlink planted at a temp name is never followed or overwritten. Published with os.replace."""
    directory, base = os.path.split(os.path.abspath(path))
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode), tmp
        except FileExistsError:
            continue
    raise TableFileError(f"cannot create a temporary file next to {path}")


def write_atomic(path: str, text: str, mode: int = 0o644) -> None:
    """Writes ``text`` to ``path`` through :func:`create_temp` and a rename: readers see the old file or
    the whole new one."""
    fd, tmp = create_temp(path, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
