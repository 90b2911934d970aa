"""Where an engine keeps the Engram tables and what that takes, as the engine adapters read it (they import
only the client): the names of ``tableserver.common.hostmem``, defined once there for ``tableserver plan`` too,
and ``proc_kib`` (``tableserver.common.host``) for the host's memory."""

from tableserver.common.host import proc_kib
from tableserver.common.hostmem import (
    GIB,
    STAGING_TOKENS,
    Parallel,
    pinned_bytes,
    process_bytes,
    staging_bytes,
    table_bytes,
    vllm_private_bytes,
)

__all__ = [
    "GIB",
    "STAGING_TOKENS",
    "Parallel",
    "pinned_bytes",
    "proc_kib",
    "process_bytes",
    "staging_bytes",
    "table_bytes",
    "vllm_private_bytes",
]
