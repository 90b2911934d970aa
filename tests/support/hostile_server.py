"""A scripted tableserver for the hostile-server suite (tests/daemon/test_untrusted_server.py).

It speaks the real protocols -- the gRPC API (the generated stubs of proto/tableserver/v1), the tcp data
port's frames and the shm socket's handshake (tableserver/common/wire.py) -- and serves one small table
honestly, except where its ``behaviour`` says to misbehave in one way: dribble the handshake, declare a
huge reply, answer with the wrong length or request id, send an absurd catalog, send an unsealed memfd
and truncate it, stay silent. A client must end each in a TableClientError within its bound, never a
crash and never a wrong row.
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
import threading
from concurrent import futures

import grpc
import numpy as np

from tableserver.common.wire import (
    HEADER,
    HEADER_BYTES,
    HELLO_BYTES,
    FrameType,
    Status,
    challenge_frame,
    response_header,
    server_proof,
)
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

ROWS, ROW_BYTES, SEED = 1000, 264, 11
F_SEAL_FUTURE_WRITE = 0x0010


def table_rows() -> np.ndarray:
    """The one table's rows, the same in the server and in the client that checks them."""
    return np.random.default_rng(SEED).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


class ScriptedServer:
    """gRPC control plane + tcp data port + shm socket on loopback, misbehaving as ``behaviour`` says.
    ``table_shape``: the rows and row bytes its one table's catalog entry claims."""

    table_shape = (ROWS, ROW_BYTES)

    def __init__(self, behaviour: str, workdir: str):
        self.behaviour = behaviour
        self.rows = table_rows()
        self.secrets: dict[bytes, bytes] = {}
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.conns: list[socket.socket] = []
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.tcp_port = self.tcp.getsockname()[1]
        self.shm_path = os.path.join(workdir, "hostile-shm.sock")
        self.shm = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.shm.bind(self.shm_path)
        self.shm.listen(16)
        self.grpc = grpc.server(futures.ThreadPoolExecutor(16))
        pb_grpc.add_TableServiceServicer_to_server(_Service(self), self.grpc)
        self.port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- life
    def __enter__(self):
        self.grpc.start()
        for sock, serve in ((self.tcp, self._serve_tcp), (self.shm, self._serve_shm)):
            self._spawn(self._accept, sock, serve)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for s in (self.tcp, self.shm, *self.conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.grpc.stop(0)
        for t in self.threads:
            t.join(5)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def sleep(self, seconds: float) -> bool:
        """False once the server is stopping."""
        return not self.stop.wait(seconds)

    # ----------------------------------------------------------------- control plane
    def table_info(self) -> pb.TableInfo:
        rows, row_bytes = self.table_shape
        t = dict(
            index=0,
            name="t",
            rows=rows,
            row_bytes=row_bytes,
            dtype="uint8",
            shape=[rows, row_bytes],
            layer=1,
            version=1,
            checksum="sha256:" + "ab" * 32,
            nbytes=rows * row_bytes,
            total_rows=rows,
            row_lo=0,
        )
        b = self.behaviour
        if b == "catalog_row_lo_near_2_64":
            t.update(row_lo=(1 << 64) - 5, total_rows=ROWS)
        elif b == "catalog_row_bytes_0":
            t.update(row_bytes=0, nbytes=0)
        elif b == "catalog_rows_past_total":
            t.update(rows=ROWS, total_rows=ROWS // 2)
        elif b == "catalog_huge_table":
            t.update(rows=1 << 62, total_rows=1 << 62, nbytes=((1 << 62) * ROW_BYTES) % (1 << 64))
        return pb.TableInfo(**t)

    def catalog(self) -> pb.Catalog:
        tables = [self.table_info()]
        if self.behaviour == "catalog_duplicate_names":
            tables.append(
                pb.TableInfo(
                    index=1,
                    name="t",
                    rows=ROWS,
                    row_bytes=ROW_BYTES,
                    nbytes=ROWS * ROW_BYTES,
                    total_rows=ROWS,
                    checksum="sha256:" + "cd" * 32,
                )
            )
        return pb.Catalog(
            tables=tables,
            server=pb.ServerInfo(
                version="0",
                hostname="hostile",
                host_id=boot_id(),
                transports=["shm", "tcp"],
                max_rows_per_request=65536,
                node_id="hostile",
            ),
        )

    def offers(self, wanted) -> list:
        tcp = pb.TransportOffer(name="tcp", tcp=pb.TcpEndpoint(host="127.0.0.1", port=self.tcp_port))
        shm = pb.TransportOffer(name="shm", shm=pb.ShmEndpoint(socket_path=self.shm_path, host_id=boot_id()))
        if self.behaviour == "offer_unknown_first":
            return [pb.TransportOffer(name="carrier-pigeon"), pb.TransportOffer(name="x" * 5000), tcp]
        if self.behaviour == "offer_tcp_port_out_of_range":
            return [pb.TransportOffer(name="tcp", tcp=pb.TcpEndpoint(host="127.0.0.1", port=1 << 20))]
        return [o for o in (shm, tcp) if o.name in wanted]

    def _accept(self, sock, serve) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self._spawn(serve, conn)

    # ----------------------------------------------------------------- tcp data port
    def _dribble(self, conn, data: bytes, per_byte_s: float = 1.0) -> None:
        for i in range(len(data)):
            if not self.sleep(per_byte_s):
                return
            conn.sendall(data[i : i + 1])

    def _serve_tcp(self, conn) -> None:
        b = self.behaviour
        try:
            nonce = os.urandom(32)
            if b == "data_port_silent":
                self.stop.wait()
                return
            if b == "challenge_dribbled":
                self._dribble(conn, challenge_frame(nonce))
                return
            conn.sendall(challenge_frame(nonce))
            head = _recv(conn, HEADER_BYTES)
            body = _recv(conn, HEADER.unpack(head)[5])
            sid, client_nonce = body[:16], body[16:32]
            secret = self.secrets.get(sid)
            if secret is None or len(body) != HELLO_BYTES:
                return
            proof = server_proof(secret, sid, nonce, client_nonce)
            if b == "hello_reply_huge":
                conn.sendall(response_header(FrameType.HELLO, Status.OK, 0, 0, 65536))
                self._dribble(conn, b"\0" * 65536)
                return
            conn.sendall(response_header(FrameType.HELLO, Status.OK, 0, 0, len(proof)) + proof)
            while not self.stop.is_set():
                head = _recv(conn, HEADER_BYTES)
                _magic, _type, _flags, request_id, table, count = HEADER.unpack(head)
                ids = np.frombuffer(_recv(conn, count * 8), "<i8")
                if b == "gather_silent":
                    self.stop.wait()
                    return
                rows = self.rows[ids]
                if b == "response_wrong_length":
                    conn.sendall(
                        response_header(FrameType.GATHER, Status.OK, request_id, ROW_BYTES, count + 1) + rows.tobytes()
                    )
                elif b == "response_unknown_request_id":
                    conn.sendall(
                        response_header(FrameType.GATHER, Status.OK, request_id + 1000, ROW_BYTES, count)
                        + rows.tobytes()
                    )
                elif b == "response_huge_error":
                    conn.sendall(response_header(FrameType.GATHER, Status.INTERNAL, request_id, 0, 1 << 31))
                    self.stop.wait()
                else:
                    conn.sendall(
                        response_header(FrameType.GATHER, Status.OK, request_id, ROW_BYTES, count) + rows.tobytes()
                    )
        except (OSError, ConnectionError):
            pass
        finally:
            conn.close()

    # ----------------------------------------------------------------- shm socket
    def _memfd(self, sealed: bool, size: int) -> int:
        fd = os.memfd_create("hostile-table", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        os.pwrite(fd, self.rows.tobytes()[:size], 0)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE)
        return fd

    def _serve_shm(self, conn) -> None:
        import json

        b = self.behaviour
        try:
            nonce = os.urandom(32)
            conn.send(challenge_frame(nonce))
            body = conn.recv(4096)[HEADER_BYTES:]
            sid, client_nonce = body[:16], body[16:32]
            secret = self.secrets.get(sid)
            if secret is None:
                return
            size = ROWS * ROW_BYTES
            fd = self._memfd(sealed=b != "shm_unsealed_truncated", size=size // 2 if b == "shm_short_memfd" else size)
            entry = {"index": 0, "name": "t", "rows": ROWS, "row_bytes": ROW_BYTES, "size": size}
            doc = {"tables": [entry], "proof": server_proof(secret, sid, nonce, client_nonce).hex()}
            payload = b"{not json" if b == "shm_bad_json" else json.dumps(doc).encode()
            if b == "shm_size_overflow":
                entry["size"] = 1 << 70
                payload = json.dumps(doc).encode()
            socket.send_fds(conn, [response_header(FrameType.HELLO, Status.OK, 1, 0, len(payload)) + payload], [fd])
            if b == "shm_unsealed_truncated" and self.sleep(1.0):
                os.ftruncate(fd, 0)  # a client reading a mapping of it now dies of SIGBUS
            os.close(fd)
            self.stop.wait()
        except OSError:
            pass
        finally:
            conn.close()


def _recv(conn, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise ConnectionError("peer closed")
        buf += got
    return bytes(buf)


class _Service(pb_grpc.TableServiceServicer):
    def __init__(self, server: ScriptedServer):
        self.s = server

    def GetCatalog(self, request, context):
        if self.s.behaviour == "catalog_silent":
            self.s.stop.wait()
        return self.s.catalog()

    def OpenSession(self, request, context):
        sid, secret = os.urandom(16), os.urandom(32)
        self.s.secrets[sid] = secret
        lease = math.nan if self.s.behaviour == "lease_nan" else 30.0
        if self.s.behaviour == "session_id_short":
            sid = sid[:3]
        return pb.OpenSessionResponse(
            session_id=sid,
            secret=secret,
            lease_seconds=lease,
            offers=self.s.offers(list(request.transports)),
            max_rows_per_request=65536,
        )

    def KeepAlive(self, request_iterator, context):
        for _ in request_iterator:
            if self.s.behaviour == "keepalive_silent":
                self.s.stop.wait()
                return
            yield pb.KeepAliveResponse(lease_seconds=30.0)

    def CloseSession(self, request, context):
        return pb.CloseSessionResponse()
