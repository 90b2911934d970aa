"""rdma transport, client side: one-sided READ gathers and owner-side packing.

Resources (made once, at connect): the device's PD, one CQ, N RC QPs (default
4), and one registered **staging buffer per table at a fixed address**:
``[qps x ring_rows, row_bytes]``, QP q owning rows ``q*ring_rows ..``.

**Read mode.** Row ids (already deduplicated by the table layer) are split
into N contiguous parts, one per QP. Each part takes a contiguous block of its
QP's ring (:class:`RingAllocator`); every ring slot has two **prebuilt**
``RDMA_READ`` work requests whose SGE points at that slot's staging row: a
chained one and a signaled terminal one. Posting a block = patching remote
address and rkey into the block's WRs (``set_wr_rdma``; bench/bench_rdma.py times it, no
object created per row), pointing the second-to-last at the terminal WR,
one ``post_send`` for the whole chain, and restoring the link. Remote
addresses are computed vectorized (one searchsorted when a table spans
several MRs). When every part has completed, one ``np.take`` moves the rows
from staging into the caller's buffer in request order and frees the blocks.

**Pack mode.** One SEND per request (header + ids from a registered send
slot); the server gathers and RDMA-WRITEs the rows packed into this table's
pack staging (``REMOTE_WRITE``, only this session's QPs can reach it) with
the request id as immediate data; errors come back as a SEND.

Completions are polled by whichever thread waits (with a deadline); nothing
spins when nobody waits. Every verbs call that can fail is wrapped where it is
made: a failure while connecting is TransportUnavailable (``auto`` moves on),
one in use (registering a table's staging, posting, polling) TransportError,
so routing fails over to a replica; verbs' own errors never reach callers.
Invariants: the WR/SGE objects of a chain live as
long as the transport (pyverbs keeps only raw pointers); a staging block is
reused only after its rows were copied out (or the request was cancelled).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from tableclient.errors import ConnectError, GatherTimeout, TransportError, TransportUnavailable
from tableclient.transports.base import (
    DEFAULT_OPTIONS,
    ClientTransport,
    Pending,
    Prepared,
    TransportOptions,
    remote_error,
)
from tableserver.common.verbs import (
    Device,
    QpInfo,
    RegisteredBuffer,
    RingAllocator,
    VerbsError,
    connect_rc_qp,
    create_rc_qp,
    error_errno,
    verbs,
)
from tableserver.common.wire import PACK_REPLY_BYTES, PACK_REQUEST, PACK_REQUEST_MAGIC, ROW_ID_BYTES, parse_pack_error
from tableserver.v1 import tableserver_pb2 as pb

log = logging.getLogger(__name__)

RECV_DEPTH = 16  # pack replies (WRITE_WITH_IMM / error SEND) each QP can take
SEND_SLOTS = 8  # pack requests in flight
_SEND_TAG = 1 << 62
_RECV_TAG = 1 << 61
#: how long a request waits for staging space or a send slot (completions progressing meanwhile)
STAGING_WAIT_S = 10.0


def probe_wait(deadline: float, now: float) -> float:
    """How long the connect probe's READ may wait at ``now``: what is left of the connect ``deadline``
    (both time.monotonic()), no more; 0 once it has passed."""
    return max(deadline - now, 0.0)


def verbs_failure(what: str, e: BaseException, kind=TransportError):
    """A verbs failure (``VerbsError`` or pyverbs' own) as this client's error saying what failed: ``kind``
    (TransportError in use, TransportUnavailable while connecting), the failure's errno kept."""
    return kind(f"{what}: {e}", errno=error_errno(e))


@dataclass
class RdmaPrepared(Prepared):
    """Device resources made before OpenSession, so the handshake can carry the QPs."""

    dev: Device
    cq: object
    qps: list
    infos: list
    ring_rows: int
    closed: bool = False

    def params(self) -> pb.RdmaClientParams:
        return pb.RdmaClientParams(
            qps=[pb.RdmaQueuePair(qp_num=i.qp_num, psn=i.psn, gid=i.gid, mtu=i.mtu) for i in self.infos],
            device=self.dev.name,
            max_rd_atomic=self.dev.max_rd_atomic,
        )

    def request_fields(self) -> dict:
        return {"rdma": self.params()}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for qp in self.qps:
            qp.close()
        self.cq.close()
        self.dev.close()


class ReadRing:
    """Prebuilt READ chains of one (table, QP): slot i reads into staging row ``base + i``. Built once at
    connect; a gather patches its rows' addresses into them (``post``), so no WR is made per row.
    ``staging`` needs ``addr`` and ``mr.lkey`` only (``bench/bench_rdma.py`` times it unposted)."""

    def __init__(self, v, staging: RegisteredBuffer, base_row: int, rows: int, row_bytes: int):
        e = v.e
        self._set_rdma = v.wr.SendWR.set_wr_rdma
        self.slots = RingAllocator(rows)
        lkey = staging.mr.lkey
        addr0 = staging.addr + base_row * row_bytes
        self.chain = [
            v.wr.SendWR(
                opcode=e.IBV_WR_RDMA_READ,
                num_sge=1,
                sg=[v.wr.SGE(addr0 + i * row_bytes, row_bytes, lkey)],
                send_flags=0,
            )
            for i in range(rows)
        ]
        self.last = [
            v.wr.SendWR(
                opcode=e.IBV_WR_RDMA_READ,
                num_sge=1,
                sg=[v.wr.SGE(addr0 + i * row_bytes, row_bytes, lkey)],
                send_flags=e.IBV_SEND_SIGNALED,
            )
            for i in range(rows)
        ]
        for a, b in zip(self.chain, self.chain[1:]):
            a.next_wr = b
        self.base_row = base_row

    def post(self, qp, start: int, addrs: list, rkeys, wr_id: int) -> None:
        """Posts one chain reading ``addrs`` into slots ``start..``; only its last WR is signaled."""
        set_rdma = self._set_rdma
        k = len(addrs)
        end = start + k - 1
        last = self.last[end]
        last.wr_id = wr_id
        if k == 1:
            set_rdma(last, rkeys if isinstance(rkeys, int) else rkeys[0], addrs[0])
            qp.post_send(last)
            return
        head = self.chain[start:end]
        if isinstance(rkeys, int):
            any(map(set_rdma, head, itertools.repeat(rkeys), addrs))  # set_wr_rdma returns None: runs them all
            set_rdma(last, rkeys, addrs[-1])
        else:
            any(map(set_rdma, head, rkeys, addrs))
            set_rdma(last, rkeys[-1], addrs[-1])
        before = self.chain[end - 1]
        before.next_wr = last
        try:
            qp.post_send(self.chain[start])
        finally:
            if end < len(self.chain):
                before.next_wr = self.chain[end]


@dataclass(frozen=True)
class RemoteRegions:
    """Where one table's rows are on the server, as this session reads them (read-only arrays): each region's
    (MR's) offset in the table, ascending, its address on the server, and its rkeys, ``rkeys[region, qp]``
    (the session's own memory-window rkey per QP, or the region's one rkey on every QP)."""

    starts: np.ndarray
    addrs: np.ndarray
    rkeys: np.ndarray


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


@dataclass
class _TableState:
    info: object
    starts: np.ndarray  # table offset of each MR, ascending
    addrs: np.ndarray
    rkeys: np.ndarray
    staging: RegisteredBuffer | None = None
    staging_rows: np.ndarray | None = None  # [qps * ring_rows, row_bytes] view of staging
    rings: list | None = None
    pack: RegisteredBuffer | None = None
    pack_ring: RingAllocator | None = None
    pack_rows: np.ndarray | None = None


class _Batch(Pending):
    """One read or pack request: completes when its parts landed and were copied out."""

    __slots__ = ("transport", "parts", "blocks", "source", "positions", "out", "token")

    def __init__(self, transport, token: int, out: np.ndarray):
        super().__init__()
        self.transport = transport
        self.token = token
        self.parts = 0
        self.blocks: list = []  # (RingAllocator, start): freed after the copy-out
        self.source = None  # staging array to copy from
        self.positions = None
        self.out = out

    def done(self) -> bool:
        if not self._event.is_set():
            self.transport.progress()
        return self._event.is_set()

    def cancel(self) -> None:
        self.cancelled = True
        with self.transport.poll_lock:  # a copy-out runs under it: wait for one in progress
            pass

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        spin = self.transport.spin_polls
        idle = 0
        while not self._event.is_set():
            if self.transport.progress():
                idle = 0
                continue
            idle += 1
            if deadline is not None and time.monotonic() > deadline:
                raise GatherTimeout(f"rdma gather not complete after {timeout * 1e3:.3f} ms")
            if idle > spin:
                # A hardware NIC answers within the spin; a software one (rxe, siw) runs on our
                # CPUs, so keep polling without starving it.
                time.sleep(self.transport.idle_sleep_s)
        super().wait(0)


class RdmaTransport(ClientTransport):
    name = "rdma"
    dedups = True
    modes = ("read", "pack")
    expands = True

    @classmethod
    def prepare(cls, options: TransportOptions, catalog: list) -> Prepared | None:
        """Opens the device and makes ``options.rdma_qps`` RC QPs in INIT; TransportUnavailable if none
        is usable.

        Each QP's send queue holds a full ring per table plus the pack sends;
        the one CQ holds every WR that could complete at once (a QP error
        flushes them all), so rings shrink to fit the device's max CQ size.
        """
        qps, ring_rows = options.rdma_qps, options.rdma_ring_rows
        try:
            dev = Device(options.rdma_device, options.rdma_port, options.rdma_gid_index)
        except VerbsError as e:
            raise TransportUnavailable(str(e), errno=e.errno) from None
        v = verbs()
        e = v.e
        tables = max(len(catalog), 1)
        extra = SEND_SLOTS + 16
        max_cqe = int(dev.attr.max_cqe)
        fit = ((max_cqe - 64) // qps - RECV_DEPTH - extra) // tables
        rows = max(16, min(ring_rows, fit, (dev.max_qp_wr - extra) // tables))
        if rows < ring_rows:
            log.info(
                "rdma: ring of %d rows per table and QP (asked %d) to fit %s's CQ of %d entries",
                rows,
                ring_rows,
                dev.name,
                max_cqe,
            )
        send_wr = rows * tables + extra
        try:
            cq = v.cq.CQ(dev.context, min(max_cqe, qps * (send_wr + RECV_DEPTH) + 64))
            made = [
                create_rc_qp(dev, cq, send_wr, RECV_DEPTH, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
                for _ in range(qps)
            ]
        except (VerbsError, v.Error) as err:
            dev.close()
            raise verbs_failure("cannot create RDMA QPs", err, TransportUnavailable) from None
        return RdmaPrepared(dev, cq, [m[0] for m in made], [m[1] for m in made], rows)

    def __init__(self, offer, session, catalog, connect_timeout=10.0, options=DEFAULT_OPTIONS, prepared=None):
        deadline = time.monotonic() + connect_timeout  # the handshake and the probe, all of it
        if not isinstance(prepared, RdmaPrepared):
            raise TransportUnavailable("rdma needs device resources prepared before the session opened")
        v = verbs()
        self._v, self._e = v, v.e
        self._prep = prepared  # ours from here: close() frees it, on a failed connect too
        self.dev, self._cq, self._qps = prepared.dev, prepared.cq, prepared.qps
        self.device = self.dev.name
        self.ring_rows = prepared.ring_rows
        self._post_lock = threading.Lock()
        self.poll_lock = threading.Lock()
        self._inflight: dict[int, _Batch] = {}
        self._tokens = itertools.count(1)
        self._rr = itertools.cycle(range(len(self._qps)))
        self._error: BaseException | None = None
        self._closed = False
        self._buffers: list[RegisteredBuffer] = []
        self._tables: dict[int, _TableState] = {}
        self.packed_only: set[int] = set()  # tables this node registered no memory of (see _connect)
        try:
            self._connect(offer.rdma, catalog, deadline)
        except (VerbsError, v.Error, TransportError) as e:  # this client cannot use the offer: the next one
            self.close()
            raise verbs_failure(f"rdma to the server on {self.device}", e, TransportUnavailable) from None
        except BaseException:
            self.close()
            raise

    def _connect(self, ep, catalog: list, deadline: float) -> None:
        # Software RDMA (rxe, siw) executes on the host CPUs: spin briefly, then sleep between polls.
        software = self.dev.name.startswith(("rxe", "siw")) or int(getattr(self.dev.attr, "vendor_id", 1)) == 0
        self.spin_polls = 100 if software else 2000
        self.idle_sleep_s = 20e-6 if software else 0.0  # between polls once the spin is over
        self.pack_max_rows = ep.pack_max_rows
        if len(ep.qps) != len(self._qps):
            raise ConnectError(f"server answered {len(ep.qps)} QPs for our {len(self._qps)}")
        rd_atomic = max(1, min(ep.max_rd_atomic or 1, self.dev.max_rd_atomic))
        for qp, local, remote in zip(self._qps, self._prep.infos, ep.qps):
            connect_rc_qp(self.dev, qp, local, QpInfo(remote.qp_num, remote.psn, remote.gid, remote.mtu), rd_atomic)
        by_table: dict[int, list] = {}
        for r in ep.regions:
            by_table.setdefault(r.table, []).append(r)
        for info in catalog:
            regions = sorted(by_table.get(info.index, []), key=lambda r: r.table_offset)
            # rkeys[region, qp]: a session's own memory-window rkey per QP, or the region's one rkey on all
            rkeys = np.array(
                [list(r.qp_rkeys) if r.qp_rkeys else [r.rkey] * len(self._qps) for r in regions], np.int64
            ).reshape(len(regions), len(self._qps))
            self._tables[info.index] = _TableState(
                info,
                np.array([r.table_offset for r in regions], np.int64),
                np.array([r.addr for r in regions], np.uint64),
                rkeys,
            )
        #: whether this node serves a table it registered no memory of (its disk tier): such a table's reads
        #: go packed whatever the mode asked (a table read when the node served it from memory, and served from
        #: disk since it restarted), so a read request must fit a pack request too
        self.packed_only = {i for i, t in self._tables.items() if not len(t.starts)}
        if self.pack_max_rows:
            self._setup_pack()
        self._probe(deadline)

    # ------------------------------------------------------------------ views
    # Read-only views of the session's verbs resources, for tools and tests below the transport (a READ of
    # their own on the session's QPs, a QP's state): what is posted on them bypasses the transport's books.
    @property
    def qps(self) -> tuple:
        """The session's RC QPs (pyverbs ``QP``), in the order the server paired them."""
        return tuple(self._qps)

    @property
    def cq(self):
        """The one completion queue of the session's QPs (pyverbs ``CQ``); poll it under ``poll_lock``."""
        return self._cq

    def regions(self, table_index: int) -> RemoteRegions:
        """Where table ``table_index``'s rows are on the server, as this session reads them."""
        t = self._tables[table_index]
        return RemoteRegions(_read_only(t.starts), _read_only(t.addrs), _read_only(t.rkeys))

    @property
    def error(self) -> BaseException | None:
        """Why the transport failed, once it has (every request then fails with it; ``close`` fails it too)."""
        return self._error

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (routing closes a node's transport once it failed and was dropped)."""
        return self._closed

    # ------------------------------------------------------------------ setup
    def _table(self, index: int) -> _TableState:
        t = self._tables[index]
        if t.rings is None:  # staging and prebuilt chains are made on a table's first read
            with self._post_lock:  # close() frees staging under it: never built on a closing transport
                self._raise_if_failed()
                if t.rings is None:
                    rows, rb = self.ring_rows, t.info.row_bytes
                    t.staging = self._register(len(self._qps) * rows * rb, self._e.IBV_ACCESS_LOCAL_WRITE)
                    t.staging_rows = t.staging.array[: len(self._qps) * rows * rb].reshape(-1, rb)
                    try:
                        t.rings = [ReadRing(self._v, t.staging, q * rows, rows, rb) for q in range(len(self._qps))]
                    except self._v.Error as e:
                        raise verbs_failure(f"building the READ chains of table {t.info.name!r}", e) from None
        return t

    def _raise_if_failed(self) -> None:
        """The transport's error, once it failed or closed (close fails it before freeing anything)."""
        if self._error is not None:
            raise self._error

    def _register(self, nbytes: int, access: int) -> RegisteredBuffer:
        """A registered buffer freed with the transport; TransportError when it cannot be registered
        (e.g. the locked-memory limit): this node cannot serve the request, a replica may."""
        try:
            b = RegisteredBuffer(self.dev, nbytes, access)
        except (VerbsError, self._v.Error) as e:
            raise verbs_failure(f"rdma staging of {nbytes} bytes on {self.device}", e) from None
        self._buffers.append(b)
        return b

    def _setup_pack(self) -> None:
        v, e = self._v, self._e
        slot = PACK_REQUEST.size + self.pack_max_rows * ROW_ID_BYTES
        self._send = self._register(slot * SEND_SLOTS, e.IBV_ACCESS_LOCAL_WRITE)
        self._send_slot = slot
        self._send_free = list(range(SEND_SLOTS))
        self._send_sges = [v.wr.SGE(self._send.addr + i * slot, slot, self._send.mr.lkey) for i in range(SEND_SLOTS)]
        self._send_wrs = []
        for i, sge in enumerate(self._send_sges):
            wr = v.wr.SendWR(
                wr_id=_SEND_TAG | i, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED
            )
            wr.sg_list = sge  # point at the SGE object itself so its length can change per request
            self._send_wrs.append(wr)
        self._recv = self._register(PACK_REPLY_BYTES * RECV_DEPTH * len(self._qps), e.IBV_ACCESS_LOCAL_WRITE)
        self._recv_wrs = []
        for q, qp in enumerate(self._qps):
            for i in range(RECV_DEPTH):
                k = q * RECV_DEPTH + i
                sge = v.wr.SGE(self._recv.addr + k * PACK_REPLY_BYTES, PACK_REPLY_BYTES, self._recv.mr.lkey)
                wr = v.wr.RecvWR(wr_id=_RECV_TAG | k, num_sge=1, sg=[sge])
                self._recv_wrs.append((qp, wr))
                qp.post_recv(wr)

    def _probe(self, deadline: float) -> None:
        """One READ proves the path to the server works (else auto moves on to shm/tcp), waited for
        until the connect ``deadline`` at most."""
        infos = [t.info for t in self._tables.values() if t.info.rows > 0 and len(t.starts)]
        if not infos:
            return
        info = min(infos, key=lambda i: i.row_bytes)
        out = np.empty((1, info.row_bytes), np.uint8)
        wait = probe_wait(deadline, time.monotonic())
        if wait <= 0:
            raise TransportUnavailable(
                f"rdma to the server on {self.device}: the connect deadline passed before the RDMA READ probe: "
                "raise connect_timeout"
            )
        try:
            self.gather(info.index, np.zeros(1, np.int64), out).wait(wait)
        except (GatherTimeout, TransportError) as e:
            raise TransportUnavailable(f"RDMA READ to the server on {self.device} failed: {e}") from None

    # ----------------------------------------------------------------- gather
    def request_rows(self, mode: str = "read") -> int:
        if mode == "pack":
            return self.pack_max_rows
        reads = self.ring_rows * len(self._qps)
        return min(reads, self.pack_max_rows) if self.packed_only and self.pack_max_rows else reads

    def gather(self, table_index, ids, out, sync=False, mode="read", expand=None, hedge_after=None) -> Pending:
        if self._error is not None:
            raise self._error
        if mode == "pack" or table_index in self.packed_only:  # no memory of it to READ here: packed
            return self._gather_pack(table_index, ids, out, expand)
        t = self._table(table_index)
        rb = t.info.row_bytes
        offsets = ids * rb
        if len(t.starts) == 1:
            addrs = offsets.astype(np.uint64) + t.addrs[0]
            which = None
        else:
            which = np.searchsorted(t.starts, offsets, side="right") - 1
            addrs = (offsets - t.starts[which]).astype(np.uint64) + t.addrs[which]
        n, nq = ids.size, len(self._qps)
        bounds = [n * q // nq for q in range(nq + 1)]
        batch = _Batch(self, next(self._tokens), out)
        positions = np.empty(n, np.int64)
        with self._post_lock:
            self._raise_if_failed()  # closed since _table: its rings are gone
            self._inflight[batch.token] = batch
            try:
                for q in range(nq):
                    a, b = bounds[q], bounds[q + 1]
                    if a == b:
                        continue
                    ring = t.rings[q]
                    start = self._alloc(ring.slots, b - a)
                    batch.blocks.append((ring.slots, start))
                    positions[a:b] = np.arange(ring.base_row + start, ring.base_row + start + b - a)
                    batch.parts += 1
                    rk = int(t.rkeys[0, q]) if which is None else t.rkeys[which[a:b], q].tolist()
                    ring.post(self._qps[q], start, addrs[a:b].tolist(), rk, (batch.token << 8) | q)
            except BaseException as e:
                self._fail_all(TransportError(f"posting RDMA reads failed: {e}"))
                raise self._error from None
        batch.source = t.staging_rows
        batch.positions = positions if expand is None else positions[expand]
        return batch

    def _alloc(self, ring: RingAllocator, n: int, timeout: float = STAGING_WAIT_S) -> int:
        """A ring block, progressing completions while the ring is full (backpressure)."""
        start = ring.alloc(n)
        deadline = time.monotonic() + timeout
        while start is None:
            self.progress()
            if self._error is not None:
                raise self._error
            if time.monotonic() > deadline:
                raise TransportError(f"no staging space for {n} rows after {timeout:.0f} s")
            start = ring.alloc(n)
        return start

    def _gather_pack(
        self, table_index: int, ids: np.ndarray, out: np.ndarray, expand: np.ndarray | None = None
    ) -> Pending:
        t = self._tables[table_index]
        rb, n = t.info.row_bytes, ids.size
        if n > self.pack_max_rows:
            raise ValueError(f"{n} rows in one pack request, the server allows {self.pack_max_rows}")
        batch = _Batch(self, next(self._tokens) & 0xFFFFFFFF or 1, out)
        with self._post_lock:
            self._raise_if_failed()
            if t.pack is None:  # the pack landing buffer is made on a table's first pack request
                t.pack = self._register(
                    2 * self.pack_max_rows * rb, self._e.IBV_ACCESS_LOCAL_WRITE | self._e.IBV_ACCESS_REMOTE_WRITE
                )
                t.pack_ring = RingAllocator(2 * self.pack_max_rows)
                t.pack_rows = t.pack.array[: 2 * self.pack_max_rows * rb].reshape(-1, rb)
            start = self._alloc(t.pack_ring, n)
            batch.blocks.append((t.pack_ring, start))
            batch.source = t.pack_rows
            batch.positions = slice(start, start + n) if expand is None else start + expand
            deadline = time.monotonic() + STAGING_WAIT_S
            while not self._send_free:
                self.progress()
                if self._error is not None:
                    raise self._error
                if time.monotonic() > deadline:  # nothing was posted: the ring block goes back
                    batch.blocks.pop()
                    t.pack_ring.free(start)
                    raise TransportError(f"no pack send slot free after {STAGING_WAIT_S:.0f} s")
            slot = self._send_free.pop()
            base = slot * self._send_slot
            hdr = PACK_REQUEST.pack(
                PACK_REQUEST_MAGIC, batch.token, table_index, n, t.pack.addr + start * rb, t.pack.mr.rkey
            )
            self._send.array[base : base + PACK_REQUEST.size] = np.frombuffer(hdr, np.uint8)
            self._send.array[base + PACK_REQUEST.size : base + PACK_REQUEST.size + n * ROW_ID_BYTES] = ids.view(
                np.uint8
            )
            self._send_sges[slot].length = PACK_REQUEST.size + n * ROW_ID_BYTES
            batch.parts = 1
            self._inflight[batch.token] = batch
            try:
                self._qps[next(self._rr)].post_send(self._send_wrs[slot])
            except BaseException as e:
                self._fail_all(TransportError(f"posting a pack request failed: {e}"))
                raise self._error from None
        return batch

    # ------------------------------------------------------------ completions
    def progress(self) -> int:
        """Polls the CQ once (if no other thread is) and dispatches what completed."""
        if not self.poll_lock.acquire(blocking=False):
            return 0
        try:
            if self._closed:
                return 0
            try:
                n, wcs = self._cq.poll(32)
            except self._v.Error as e:
                self._fail_all(verbs_failure(f"polling the RDMA CQ on {self.device} failed", e))
                return 0
            for wc in wcs[:n]:
                self._dispatch(wc)
            return n
        finally:
            self.poll_lock.release()

    def _dispatch(self, wc) -> None:
        e = self._e
        wr_id = wc.wr_id
        if wc.status != e.IBV_WC_SUCCESS:
            self._fail_all(
                TransportError(
                    f"RDMA completion error on {self.device}: status {wc.status} "
                    f"(opcode {wc.opcode}, vendor error {wc.vendor_err})"
                )
            )
            return
        if wr_id & _SEND_TAG:
            self._send_free.append(wr_id & 0xFFFF)
            return
        if wr_id & _RECV_TAG:
            k = wr_id & 0xFFFF
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                batch = self._inflight.get(wc.imm_data)
                if batch is not None:
                    self._finish(batch)
            elif wc.opcode == e.IBV_WC_RECV:
                self._pack_error(k, wc.byte_len)
            qp, wr = self._recv_wrs[k]
            try:
                qp.post_recv(wr)
            except self._v.Error as err:
                self._fail_all(verbs_failure(f"re-posting an RDMA receive on {self.device} failed", err))
            return
        batch = self._inflight.get(wr_id >> 8)
        if batch is not None:
            batch.parts -= 1
            if batch.parts == 0:
                self._finish(batch)

    def _finish(self, batch: _Batch, error: BaseException | None = None) -> None:
        self._inflight.pop(batch.token, None)
        if error is None and not batch.cancelled:
            if isinstance(batch.positions, slice):
                np.copyto(batch.out, batch.source[batch.positions])
            else:
                np.take(batch.source, batch.positions, axis=0, out=batch.out)
        for ring, start in batch.blocks:
            ring.free(start)
        batch.complete(error)

    def _pack_error(self, k: int, nbytes: int) -> None:
        raw = self._recv.array[k * PACK_REPLY_BYTES : k * PACK_REPLY_BYTES + nbytes].tobytes()
        parsed = parse_pack_error(raw)
        batch = self._inflight.get(parsed[0]) if parsed is not None else None
        if batch is not None:
            self._finish(batch, remote_error(parsed[1]))

    def _fail_all(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
            if not self._closed:
                log.warning("rdma transport failed: %s", error)
        for batch in list(self._inflight.values()):
            self._inflight.pop(batch.token, None)
            batch.complete(self._error)

    def close(self) -> None:
        if self._closed:
            return
        with self.poll_lock:
            self._closed = True
        self._fail_all(TransportError("transport closed"))
        with self._post_lock:  # posters see the error set above and leave; none is mid-post as this frees
            self._prep.qps, qps = [], self._prep.qps
            for qp in qps:
                qp.close()
            for t in self._tables.values():
                t.rings = None
            for b in self._buffers:
                b.close()
            self._prep.close()
