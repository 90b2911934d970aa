"""tableclient: the thin client of tableserver, for serving processes.

    from tableclient import TableClient, rows_buffer
    with TableClient("memnode:7070") as client:
        rows = client.table("engram.layer1").gather(row_ids)   # uint8 [..., row_bytes]
        out = rows_buffer(row_ids.shape, 264)  # a buffer to reuse, placed so tcp's copies into it are fast
        client.table("engram.layer1").gather(row_ids, out=out)

Options come as keyword arguments or grouped (``TableClient(address, options=ClientOptions(...))``,
tableclient.options): ``NodeOptions`` (how each node is reached), ``TransportOptions`` (its data
transports' set-up) and ``RoutingOptions`` (replicas, fail-over, timeouts).

Depends on grpcio, protobuf and numpy; torch is optional (tensors in, tensors
out) and pyverbs is only imported by the rdma transport.
"""

from tableclient.client import TableClient
from tableclient.errors import (
    AuthError,
    ConnectError,
    GatherTimeout,
    RemoteError,
    TableClientError,
    TransportError,
)
from tableclient.node import NodeOptions
from tableclient.options import ClientOptions
from tableclient.routing import RoutingOptions
from tableclient.table import GatherHandle, RemoteTable, TableInfo
from tableclient.transports import TransportOptions
from tableserver.common.buffers import rows_buffer

__all__ = [
    "TableClient",
    "ClientOptions",
    "NodeOptions",
    "RoutingOptions",
    "TransportOptions",
    "RemoteTable",
    "GatherHandle",
    "TableInfo",
    "TableClientError",
    "ConnectError",
    "AuthError",
    "TransportError",
    "RemoteError",
    "GatherTimeout",
    "rows_buffer",
]
