"""Verbs plumbing shared by the server and client rdma transports (pyverbs).

pyverbs is imported lazily, only when an rdma transport is used, so shm/tcp
clients never need it. It must match the rdma-core userspace it runs on
(Debian: ``python3-pyverbs``); enum modules differ between rdma-core 44
(``pyverbs.enums``) and 59+ (``pyverbs.libibverbs_enums``): :func:`verbs`
hides that.

What lives here:

* :class:`Device`: an opened device port (context, PD, chosen GID, MTU, caps).
  On a host with no RDMA devices pyverbs raises instead of returning an empty
  list; that is reported as :class:`RdmaUnavailable`.
* :func:`create_rc_qp` and :func:`connect_rc_qp`: the RC recipe of rdma-core's
  tests (INIT with access flags, RTR with the peer's QPN/PSN/GID/MTU, RTS).
* :class:`RegisteredBuffer`: fixed-address memory registered as one MR.
* :class:`RingAllocator`: FIFO allocation of contiguous slots in a ring of
  prebuilt work requests / staging rows.

Errors: every failure here is a :class:`VerbsError` (one line, ``errno`` when
the kernel gave one): :class:`RdmaUnavailable` when this host has no usable
stack, :class:`RdmaError` when a verbs call failed. Both are this module's own:
the daemon and the client each wrap them into their own error hierarchy where
a verbs call can raise (tableserver.errors, tableclient.errors).

Every resource closes in reverse order of creation; close() is idempotent.
"""

from __future__ import annotations

import collections
import ipaddress
import secrets
import threading
from dataclasses import dataclass


class VerbsError(Exception):
    """Base of this module's errors: a one-line message and the OS error number when one is known."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class RdmaUnavailable(VerbsError):
    """No usable RDMA stack here (no pyverbs, no device, port down)."""


class RdmaError(VerbsError):
    """A verbs call failed ("Failed to register MR ..."); errno when known."""


def error_errno(e: BaseException) -> int | None:
    """The OS error number an error carries: a VerbsError's or OSError's ``errno``, pyverbs'
    ``PyverbsRDMAError.error_code``; None when it has none."""
    for attr in ("errno", "error_code"):
        code = getattr(e, attr, None)
        if isinstance(code, int) and code > 0:  # pyverbs says -1 for "none"
            return code
    return None


def rdma_error(what: str, e: BaseException) -> RdmaError:
    """``e`` (a pyverbs error raised by a verbs call) as an RdmaError saying what failed; its errno kept."""
    return RdmaError(f"{what}: {e}", errno=error_errno(e))


_verbs = None


def verbs():
    """(pyverbs package namespace with enums as ``e``), imported on first use."""
    global _verbs
    if _verbs is None:
        try:
            import pyverbs.addr as addr
            import pyverbs.cq as cq
            import pyverbs.device as device
            import pyverbs.mr as mr
            import pyverbs.pd as pd
            import pyverbs.qp as qp
            import pyverbs.wr as wr
            from pyverbs.pyverbs_error import PyverbsError
        except ImportError as e:
            raise RdmaUnavailable(
                f"pyverbs is not importable ({e}): install this host's pyverbs (Debian/Ubuntu: "
                "apt-get install python3-pyverbs), then run `tableserver doctor --fix-pyverbs`"
            ) from None
        try:
            import pyverbs.libibverbs_enums as enums  # rdma-core >= 59
        except ImportError:
            import pyverbs.enums as enums  # rdma-core 44
        _verbs = collections.namedtuple("Verbs", "addr cq device mr pd qp wr e Error")(
            addr, cq, device, mr, pd, qp, wr, enums, PyverbsError
        )
    return _verbs


def list_devices() -> list[str]:
    v = verbs()
    try:
        return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in v.device.get_device_list()]
    except v.Error:
        return []  # pyverbs raises "Failed to get devices list" when there are none


def gid_bytes(gid_str: str) -> bytes:
    return ipaddress.IPv6Address(gid_str).packed


def gid_str(raw: bytes) -> str:
    return ipaddress.IPv6Address(raw).exploded


def random_psn() -> int:
    return secrets.randbits(24)


@dataclass(frozen=True)
class QpInfo:
    qp_num: int
    psn: int
    gid: bytes
    mtu: int


class Device:
    """One port of an RDMA device, opened with a PD, ready to make QPs and MRs."""

    def __init__(self, name: str | None = None, port: int = 1, gid_index: int | None = None):
        v = verbs()
        names = list_devices()
        if not names:
            raise RdmaUnavailable(
                "no RDMA device on this host (rdma link shows none): load a driver, or for "
                "testing create Soft-RoCE with `rdma link add rxe0 type rxe netdev IFACE`"
            )
        if name and name not in names:
            raise RdmaUnavailable(f"RDMA device {name!r} not found: this host has {', '.join(names)}")
        self.name = name or names[0]
        self.port = port
        self._closed = False
        try:
            self.context = v.device.Context(name=self.name)
            self.attr = self.context.query_device()
            self.port_attr = self.context.query_port(port)
        except v.Error as e:
            raise RdmaUnavailable(
                f"cannot open RDMA device {self.name} port {port}: {e}", errno=error_errno(e)
            ) from None
        if self.port_attr.state != v.e.IBV_PORT_ACTIVE:
            self.context.close()
            raise RdmaUnavailable(f"RDMA device {self.name} port {port} is not ACTIVE: check `rdma link`")
        try:
            self.gid_index = self._pick_gid(gid_index)
            self.gid = gid_bytes(self.context.query_gid(port, self.gid_index).gid)
            self.mtu = int(self.port_attr.active_mtu)
            self.max_mr_size = int(self.attr.max_mr_size)
            self.max_qp_wr = int(self.attr.max_qp_wr)
            self.max_rd_atomic = int(self.attr.max_qp_rd_atom)
            self.pd = v.pd.PD(self.context)
        except v.Error as e:
            self.context.close()
            raise RdmaUnavailable(
                f"cannot set up RDMA device {self.name} port {port}: {e}", errno=error_errno(e)
            ) from None
        except RdmaUnavailable:
            self.context.close()
            raise

    def _pick_gid(self, wanted: int | None) -> int:
        """The requested GID index, else the best one: RoCE v2 IPv4-mapped, any IPv4-mapped, a
        routable IPv6 GID, and a link-local one last (it needs a route the peer may not have)."""
        v = verbs()
        table = int(self.port_attr.gid_tbl_len)
        if wanted is not None and wanted >= 0:
            if wanted >= table:
                raise RdmaUnavailable(f"--rdma-gid-index {wanted} is beyond the GID table ({table} entries)")
            return wanted
        v2_types = {getattr(v.e, n) for n in ("IBV_GID_TYPE_ROCE_V2", "IBV_GID_TYPE_SYSFS_ROCE_V2") if hasattr(v.e, n)}
        ranked = []
        for i in range(table):
            try:
                addr = ipaddress.IPv6Address(self.context.query_gid(self.port, i).gid)
            except (v.Error, ValueError):
                continue
            if addr.packed == bytes(16):
                continue
            try:
                v2 = self.context.query_gid_type(self.port, i) in v2_types
            except (v.Error, AttributeError):
                v2 = False
            rank = (0 if v2 else 1) if addr.ipv4_mapped is not None else (2 if not addr.is_link_local else 3)
            ranked.append((rank, i))
        if not ranked:
            raise RdmaUnavailable(
                f"RDMA device {self.name} port {self.port} has no usable GID: configure an IP address on its netdev"
            )
        return min(ranked)[1]

    def register(self, address: int, length: int, access: int):
        """An MR over memory we own (never MR.read/write: their offsets break past 2 GiB)."""
        v = verbs()
        try:
            return v.mr.MR(self.pd, length, access, address=address)
        except v.Error as e:
            raise rdma_error(f"Failed to register MR of {length} bytes at {address:#x} on {self.name}", e) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pd.close()
        self.context.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_rc_qp(dev: Device, cq, send_wr: int, recv_wr: int, access: int):
    """An RC QP in INIT with ``access`` as its remote access flags, and its local QpInfo."""
    v = verbs()
    cap = v.qp.QPCap(max_send_wr=send_wr, max_recv_wr=max(recv_wr, 1), max_send_sge=1, max_recv_sge=1)
    try:
        # sq_sig_all=0 (pyverbs defaults to 1): only WRs flagged IBV_SEND_SIGNALED complete, so a chain
        # of 384 READs costs one CQE, not 384 for the poller to drain.
        qp = v.qp.QP(dev.pd, v.qp.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        attr = v.qp.QPAttr()
        attr.qp_access_flags = access
        attr.port_num = dev.port
        attr.pkey_index = 0
        qp.to_init(attr)
    except v.Error as e:
        raise rdma_error(f"Failed to create an RC QP on {dev.name}", e) from None
    return qp, QpInfo(qp.qp_num, random_psn(), dev.gid, dev.mtu)


def connect_rc_qp(dev: Device, qp, local: QpInfo, remote: QpInfo, rd_atomic: int, timeout: int = 14) -> None:
    """INIT -> RTR -> RTS against ``remote``. ``timeout`` 14 is ~67 ms per retry, 7 retries."""
    v = verbs()
    try:
        attr = v.qp.QPAttr()
        attr.path_mtu = min(local.mtu, remote.mtu)
        attr.dest_qp_num = remote.qp_num
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = rd_atomic
        attr.min_rnr_timer = 12
        gr = v.addr.GlobalRoute(dgid=v.addr.GID(gid_str(remote.gid)), sgid_index=dev.gid_index)
        attr.ah_attr = v.addr.AHAttr(gr=gr, is_global=1, port_num=dev.port)
        qp.to_rtr(attr)
        attr.sq_psn = local.psn
        attr.timeout = timeout
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = rd_atomic
        qp.to_rts(attr)
    except v.Error as e:
        raise rdma_error(f"Failed to connect RC QP {local.qp_num} to {remote.qp_num}", e) from None


class RegisteredBuffer:
    """Page-aligned anonymous memory at a fixed address, prefaulted and registered as one MR."""

    def __init__(self, dev: Device, nbytes: int, access: int):
        import mmap

        import numpy as np

        self.mm = mmap.mmap(
            -1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        )
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        try:
            self.mr = dev.register(self.addr, len(self.mm), access)
        except BaseException:
            self.mr, self.array = None, None  # unmapped now, not when the collector gets to it
            try:
                self.mm.close()
            except BufferError:
                pass
            raise

    def close(self) -> None:
        """Deregisters, then unmaps (views still alive keep the memory until they go)."""
        if self.mr is None:
            return
        self.mr.close()
        self.mr = None
        self.array = None
        try:
            self.mm.close()
        except BufferError:
            pass


class RingAllocator:
    """Contiguous FIFO allocation in a ring of ``size`` slots.

    ``alloc(n)`` returns a start slot with ``n`` contiguous free slots (never
    wrapping inside a block: a tail too short is skipped), or None when the ring
    is full; ``free(start)`` marks a block done; space returns only in
    allocation order, so blocks may complete in any order.
    """

    def __init__(self, size: int):
        self.size = size
        self._head = 0  # next free slot
        self._blocks: collections.deque = collections.deque()  # [start, end, done] in allocation order
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        if n > self.size or n <= 0:
            raise ValueError(f"block of {n} slots does not fit a ring of {self.size}")
        with self._lock:
            if not self._blocks:
                start = 0
            else:
                tail, head = self._blocks[0][0], self._head
                if head > tail:  # used [tail, head): free [head, size) and [0, tail)
                    start = head if head + n <= self.size else (0 if n <= tail else None)
                else:  # wrapped, used [tail, size) + [0, head): free [head, tail)
                    start = head if head + n <= tail else None
                if start is None:
                    return None
            self._blocks.append([start, start + n, False])
            self._head = start + n
            return start

    def free(self, start: int) -> None:
        with self._lock:
            for b in self._blocks:
                if b[0] == start and not b[2]:
                    b[2] = True
                    break
            else:
                raise ValueError(f"slot {start} is not an allocated block")
            while self._blocks and self._blocks[0][2]:
                self._blocks.popleft()

    def in_use(self) -> int:
        with self._lock:
            return len(self._blocks)
