"""tableserver: a remote table-memory server for static LLM lookup tables.

The daemon pins tables (e.g. DeepSeek-V4.1's Engram n-gram tables) in host
memory and serves row gathers over data transports (shm, tcp, rdma); gRPC
carries the catalog, sessions and key exchange. The client library lives in
the ``tableclient`` package.

This module stays import-light: the client imports ``tableserver.v1`` (the
generated gRPC stubs) and ``tableserver.common.wire`` from this package.
"""

__version__ = "0.1.0"
