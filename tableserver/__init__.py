"""tableserver: a remote table-memory server for static LLM lookup tables.

The daemon pins tables (e.g. DeepSeek-V4.1's Engram n-gram tables) in host
memory and serves row gathers over data transports (shm, tcp, rdma); gRPC
carries the catalog, sessions and key exchange. The client library is the
``tableclient`` package (client/tableclient/).

Layout (import contracts in setup.cfg, checked by ``make lint``): this package's
modules are the daemon's; ``tableserver.common`` holds what both sides run and
imports nothing of the daemon; ``tableserver.v1`` the generated gRPC stubs. The
client imports only those two; the daemon never imports the client.
"""

__version__ = "0.1.0"
