"""DeepSeek-V4.1's Engram facts, defined once for the daemon, the client, the adapters and the benches.

Opaque to the transports (they move rows of any ``row_bytes``); the demo table, the SGLang/vLLM adapters'
start-up checks, the deadline accounting and the benches read them from here.
"""

from __future__ import annotations

#: One row: 256 FP8 (e4m3) values and 8 e8m0 scales, one per 32 values.
FP8_BYTES = 256
SCALE_BYTES = 8
ROW_BYTES = FP8_BYTES + SCALE_BYTES  # 264

#: Row ids one token looks up per Engram layer: 3 n-gram orders x 8 hash heads.
NGRAM_ORDERS = 3
HEADS = 8
ROWS_PER_TOKEN = NGRAM_ORDERS * HEADS  # 24

#: The layers that carry an Engram table, and each table's rows in the released checkpoint.
TABLE_ROWS = {1: 384_006_168, 14: 384_016_682}

#: When each layer's rows are due after a decode step starts (seconds): the deadline of its gather.
WINDOWS_S = {1: 0.3e-3, 14: 9.3e-3}

#: "No limit" where a row or byte count is bounded by the smaller of several limits.
NO_LIMIT = 1 << 62
