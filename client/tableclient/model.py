"""DeepSeek-V4.1's Engram facts, as the client's users read them (the engine adapters import only the
client): the names of ``tableserver.common.model``, where they are defined once for both sides."""

from tableserver.common.model import (
    FP8_BYTES,
    HEADS,
    NGRAM_ORDERS,
    NO_LIMIT,
    ROW_BYTES,
    ROWS_PER_TOKEN,
    SCALE_BYTES,
    TABLE_ROWS,
    WINDOWS_S,
)

__all__ = [
    "FP8_BYTES",
    "SCALE_BYTES",
    "ROW_BYTES",
    "NGRAM_ORDERS",
    "HEADS",
    "ROWS_PER_TOKEN",
    "TABLE_ROWS",
    "WINDOWS_S",
    "NO_LIMIT",
]
