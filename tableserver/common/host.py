"""Which host this process runs on, as the daemon and the client both tell it (shm is offered and used
only between processes of one host)."""

from __future__ import annotations

import socket

#: this kernel's boot id: equal for every process of one host, its containers included
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_id() -> str:
    """This kernel's boot id: equal on every process of one host (and its containers); the hostname
    where the boot id cannot be read."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def proc_kib(path: str, field: str) -> int:
    """A ``Field:   N kB`` line of a /proc file (``/proc/meminfo``, a process's ``status``), in bytes; 0 where
    the file or the field cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
