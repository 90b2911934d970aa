from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetCatalogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("index", "name", "rows", "row_bytes", "dtype", "shape", "layer", "version", "checksum", "nbytes", "total_rows", "row_lo", "tier")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_LO_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    rows: int
    row_bytes: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    layer: int
    version: int
    checksum: str
    nbytes: int
    total_rows: int
    row_lo: int
    tier: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., rows: _Optional[int] = ..., row_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., layer: _Optional[int] = ..., version: _Optional[int] = ..., checksum: _Optional[str] = ..., nbytes: _Optional[int] = ..., total_rows: _Optional[int] = ..., row_lo: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "hostname", "host_id", "transports", "max_rows_per_request", "node_id", "instance_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    version: str
    hostname: str
    host_id: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    max_rows_per_request: int
    node_id: str
    instance_id: str
    def __init__(self, version: _Optional[str] = ..., hostname: _Optional[str] = ..., host_id: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., max_rows_per_request: _Optional[int] = ..., node_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class Catalog(_message.Message):
    __slots__ = ("tables", "server")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    server: ServerInfo
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., server: _Optional[_Union[ServerInfo, _Mapping]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "hostname", "host_id", "pid", "transports", "owner_session_id", "owner_proof", "rdma")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_PROOF_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    hostname: str
    host_id: str
    pid: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    owner_session_id: bytes
    owner_proof: bytes
    rdma: RdmaClientParams
    def __init__(self, client_name: _Optional[str] = ..., hostname: _Optional[str] = ..., host_id: _Optional[str] = ..., pid: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., owner_session_id: _Optional[bytes] = ..., owner_proof: _Optional[bytes] = ..., rdma: _Optional[_Union[RdmaClientParams, _Mapping]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "secret", "lease_seconds", "offers", "max_rows_per_request", "server")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    secret: bytes
    lease_seconds: float
    offers: _containers.RepeatedCompositeFieldContainer[TransportOffer]
    max_rows_per_request: int
    server: ServerInfo
    def __init__(self, session_id: _Optional[bytes] = ..., secret: _Optional[bytes] = ..., lease_seconds: _Optional[float] = ..., offers: _Optional[_Iterable[_Union[TransportOffer, _Mapping]]] = ..., max_rows_per_request: _Optional[int] = ..., server: _Optional[_Union[ServerInfo, _Mapping]] = ...) -> None: ...

class TransportOffer(_message.Message):
    __slots__ = ("name", "tcp", "shm", "rdma")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    tcp: TcpEndpoint
    shm: ShmEndpoint
    rdma: RdmaEndpoint
    def __init__(self, name: _Optional[str] = ..., tcp: _Optional[_Union[TcpEndpoint, _Mapping]] = ..., shm: _Optional[_Union[ShmEndpoint, _Mapping]] = ..., rdma: _Optional[_Union[RdmaEndpoint, _Mapping]] = ...) -> None: ...

class TcpEndpoint(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class ShmEndpoint(_message.Message):
    __slots__ = ("socket_path", "host_id", "rows_socket_path")
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    socket_path: str
    host_id: str
    rows_socket_path: str
    def __init__(self, socket_path: _Optional[str] = ..., host_id: _Optional[str] = ..., rows_socket_path: _Optional[str] = ...) -> None: ...

class RdmaQueuePair(_message.Message):
    __slots__ = ("qp_num", "psn", "gid", "lid", "mtu")
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    qp_num: int
    psn: int
    gid: bytes
    lid: int
    mtu: int
    def __init__(self, qp_num: _Optional[int] = ..., psn: _Optional[int] = ..., gid: _Optional[bytes] = ..., lid: _Optional[int] = ..., mtu: _Optional[int] = ...) -> None: ...

class RdmaClientParams(_message.Message):
    __slots__ = ("qps", "device", "staging_addr", "staging_rkey", "staging_bytes", "max_rd_atomic")
    QPS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STAGING_ADDR_FIELD_NUMBER: _ClassVar[int]
    STAGING_RKEY_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    qps: _containers.RepeatedCompositeFieldContainer[RdmaQueuePair]
    device: str
    staging_addr: int
    staging_rkey: int
    staging_bytes: int
    max_rd_atomic: int
    def __init__(self, qps: _Optional[_Iterable[_Union[RdmaQueuePair, _Mapping]]] = ..., device: _Optional[str] = ..., staging_addr: _Optional[int] = ..., staging_rkey: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., max_rd_atomic: _Optional[int] = ...) -> None: ...

class RdmaRegion(_message.Message):
    __slots__ = ("table", "table_offset", "addr", "rkey", "length", "qp_rkeys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    TABLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    QP_RKEYS_FIELD_NUMBER: _ClassVar[int]
    table: int
    table_offset: int
    addr: int
    rkey: int
    length: int
    qp_rkeys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[int] = ..., table_offset: _Optional[int] = ..., addr: _Optional[int] = ..., rkey: _Optional[int] = ..., length: _Optional[int] = ..., qp_rkeys: _Optional[_Iterable[int]] = ...) -> None: ...

class RdmaEndpoint(_message.Message):
    __slots__ = ("qps", "regions", "device", "pack_max_rows", "max_rd_atomic")
    QPS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PACK_MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    qps: _containers.RepeatedCompositeFieldContainer[RdmaQueuePair]
    regions: _containers.RepeatedCompositeFieldContainer[RdmaRegion]
    device: str
    pack_max_rows: int
    max_rd_atomic: int
    def __init__(self, qps: _Optional[_Iterable[_Union[RdmaQueuePair, _Mapping]]] = ..., regions: _Optional[_Iterable[_Union[RdmaRegion, _Mapping]]] = ..., device: _Optional[str] = ..., pack_max_rows: _Optional[int] = ..., max_rd_atomic: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
