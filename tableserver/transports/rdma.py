"""rdma transport, server side: read-only memory regions, per-session RC QPs, owner-side packing.

**Read mode** (one-sided): every table is registered as memory regions,
row-aligned chunks no larger than the device's max MR size (or
``--rdma-mr-chunk-bytes``). A session gets its own RC QPs, connected to the
client's over the gRPC handshake with random PSNs; clients then READ rows
without this process's CPU.

**Revocable access** (``--rdma-rkeys session``, the default where the device
has memory windows): the MRs grant no remote access at all, only MW binding;
each session's QPs get type-2 memory windows bound to them with ``REMOTE_READ``
only, so an rkey works on its own QP and nowhere else. When the session ends,
its windows are deallocated and its QPs destroyed: its rkeys read nothing, and
no other session's rkey ever did. ``shared`` (devices without windows) registers
the MRs ``REMOTE_READ`` and hands every session their rkeys.

**Pack mode** (owner-side, for windows too short for one READ per row): a
client SENDs its row ids; one server thread gathers them with ``np.take`` into
the session's registered staging buffer and RDMA-WRITEs them packed, with the
request id as immediate data, to the destination the request names. Invariant:
the staging buffer is reused only after its WRITE has completed. The thread
polls the sessions' CQs while requests come (napping 0.2 ms between rounds
within a decode step's gap) and, once none came for POLL_FOR_S, sleeps in
``poll()`` on their completion channels (``cqevents``): an idle node takes no
CPU and wakes at the next completion.

A session's QPs, CQ and buffers are destroyed when the session ends (client
close, keepalive loss, lease expiry); nothing else is disturbed.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tableserver.common.cqevents import EventCQ
from tableserver.common.take import in_range, take_checked
from tableserver.common.verbs import (
    Device,
    QpInfo,
    RdmaUnavailable,
    RegisteredBuffer,
    VerbsError,
    connect_rc_qp,
    create_rc_qp,
    error_errno,
    verbs,
)
from tableserver.common.wire import PACK_REPLY_BYTES, PACK_REQUEST, PACK_REQUEST_MAGIC, ROW_ID_BYTES, Refused, Status
from tableserver.errors import TransportError, TransportUnavailable
from tableserver.logs import RateLimitedLog
from tableserver.sessions import Session
from tableserver.transports.base import ServerTransport
from tableserver.v1 import tableserver_pb2 as pb

log = logging.getLogger(__name__)

RECV_DEPTH = 16  # pack requests a QP can have queued at the server
SEND_DEPTH = 64
#: a pack reply (WRITE_WITH_IMM) the client does not take for this long (it stopped posting receive
#: buffers: RNR forever) ends its session; meanwhile every other session is served
PACK_REPLY_TIMEOUT_S = 5.0
#: rounds over the sessions' CQs with nothing to do before the pack thread starts napping between rounds
SPIN_ROUNDS = 50
#: the pack thread's nap between rounds while work came within POLL_FOR_S (a decode step's gap and more); past
#: that it sleeps on the completion events, whose wake-up took longer than these naps in the Soft-RoCE guest
POLL_NAP_S, POLL_FOR_S = 0.0002, 0.1
#: the longest the pack thread sleeps on completion events (it also wakes when a session comes or goes)
SLEEP_S = 1.0


@dataclass
class Region:
    """One read-only MR: ``length`` bytes of table ``table`` from ``table_offset``, at ``addr``."""

    table: int
    table_offset: int
    length: int
    addr: int
    mr: object

    def proto(self, qp_rkeys: list[int] | None = None) -> pb.RdmaRegion:
        """The region as a session sees it: the shared MR rkey, or that session's window rkey per QP."""
        return pb.RdmaRegion(
            table=self.table,
            table_offset=self.table_offset,
            addr=self.addr,
            rkey=qp_rkeys[0] if qp_rkeys else self.mr.rkey,
            length=self.length,
            qp_rkeys=qp_rkeys or [],
        )


@dataclass(eq=False)
class _SessionQPs:
    session: Session
    events: EventCQ  # the session's CQ (``events.cq``) on a completion channel of its own
    qps: list
    infos: list
    recv: RegisteredBuffer | None = None
    staging: RegisteredBuffer | None = None
    reply: RegisteredBuffer | None = None
    recv_wrs: list = field(default_factory=list)
    slot: int = 0  # bytes per receive buffer
    windows: list = field(default_factory=list)  # type-2 MWs bound to this session's QPs
    backlog: list = field(default_factory=list)  # pack requests received, not yet served (wr_id, len, qp)
    inflight: tuple | None = None  # the pack reply on the wire: (wr, deadline, table, count, started)
    rkeys: list = field(default_factory=list)  # [region][qp] window rkeys
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    @property
    def cq(self):
        return self.events.cq

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for mw in self.windows:  # the session's rkeys die here
                mw.close()
            for qp in self.qps:
                qp.close()
            self.events.close()
            for b in (self.recv, self.staging, self.reply):
                if b is not None:
                    b.close()


class RdmaTransport(ServerTransport):
    name = "rdma"

    def __init__(self, sessions, options):
        super().__init__(sessions, options)
        self.device_name = options.get("rdma_device") or None
        gid = str(options.get("rdma_gid_index", "") or "")
        if gid and not gid.isdigit():
            from tableserver.errors import ConfigError

            raise ConfigError(f"--rdma-gid-index {gid!r}: expected a GID table index (0, 1, ...) or nothing for auto")
        self.gid_index = int(gid) if gid else -1
        self.port_num = options.get("rdma_port", 1) or 1
        self.max_qps = options.get("rdma_max_qps_per_session", 16) or 16
        self.chunk = options.get("rdma_mr_chunk_bytes", 0) or 0
        self.pack_max_rows = options.get("rdma_pack_max_rows", 16384)
        self.rkeys_mode = options.get("rdma_rkeys", "auto") or "auto"
        self.windows = False  # per-session memory windows (decided in start)
        self.dev: Device | None = None
        self.regions: list[Region] = []
        self._sessions: dict[bytes, _SessionQPs] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the pack thread's: sessions changed
        self._packer: threading.Thread | None = None
        self._closed = False
        self._ratelog = RateLimitedLog(log)
        self._inst: dict = {}  # table index -> its Recorder
        self.register_seconds = 0.0

    # ---------------------------------------------------------------- lifecycle
    def bind(self) -> None:
        try:
            self.dev = Device(self.device_name, self.port_num, self.gid_index if self.gid_index >= 0 else None)
        except RdmaUnavailable as e:
            raise TransportUnavailable(f"rdma transport: {e}", errno=e.errno) from None
        log.info(
            "rdma: device %s port %d, GID index %d, MTU %d, max MR %d bytes",
            self.dev.name,
            self.dev.port,
            self.dev.gid_index,
            128 << self.dev.mtu,
            self.dev.max_mr_size,
        )

    def start(self, tables) -> None:
        """Registers every table read-only before the server reports SERVING."""
        self.tables = tables
        if self.pack_max_rows:
            for t in tables:  # series exist from 0, so rate() counts the first requests
                self._instruments(t.index)
        e = verbs().e
        max_mw = int(getattr(self.dev.attr, "max_mw", 0) or 0)
        if self.rkeys_mode == "session" and not max_mw:
            from tableserver.errors import ConfigError

            raise ConfigError(
                f"--rdma-rkeys session: device {self.dev.name} has no memory windows (max_mw 0): "
                "pass --rdma-rkeys shared (one rkey for every session) or use a device with them"
            )
        disk = [t.name for t in tables if t.disk is not None]
        if disk and not self.pack_max_rows:
            from tableserver.errors import ConfigError

            raise ConfigError(
                f"disk table {disk[0]!r} over rdma needs owner-side packing (a one-sided READ needs memory): "
                "drop --rdma-pack-max-rows 0, or serve it from memory"
            )
        self.windows = self.rkeys_mode != "shared" and max_mw > 0
        if not self.windows:
            log.warning(
                "rdma: one rkey per table region for every session (%s): a session's rkeys stay valid after it ends",
                "device without memory windows" if not max_mw else "--rdma-rkeys shared",
            )
        access = e.IBV_ACCESS_MW_BIND if self.windows else e.IBV_ACCESS_REMOTE_READ
        jobs = []
        for t in tables.memory:  # a disk table has no memory to register: it is served packed only
            limit = min(self.dev.max_mr_size, self.chunk or self.dev.max_mr_size)
            step = max(t.row_bytes, limit // t.row_bytes * t.row_bytes)  # chunks end on row boundaries
            for off in range(0, max(t.nbytes, 1), step):
                jobs.append((t, off, min(step, t.nbytes - off) or t.row_bytes))
        t0 = time.monotonic()

        def register(job):
            t, off, length = job
            addr = t.region.addr + off
            return Region(t.index, off, length, addr, self.dev.register(addr, length, access))

        # pyverbs 44 holds the GIL inside ibv_reg_mr, so chunks register one at a
        # time there; a pyverbs that releases it registers them concurrently.
        try:
            with ThreadPoolExecutor(4, thread_name_prefix="tableserver-reg") as pool:
                self.regions = list(pool.map(register, jobs))
        except VerbsError as e:
            raise TransportError(f"rdma transport: {e}", errno=e.errno) from None
        self.register_seconds = time.monotonic() - t0
        log.info(
            "rdma: registered %d %s MRs over %d tables (%.2f GiB) in %.2f s",
            len(self.regions),
            "window-only (per-session rkeys)" if self.windows else "read-only",
            len(tables.memory),
            tables.memory_nbytes / 2**30,
            self.register_seconds,
        )
        self._packer = threading.Thread(target=self._pack_loop, name="tableserver-rdma-pack", daemon=True)
        self._packer.start()

    def describe(self) -> str:
        return f"rdma {self.dev.name}" if self.dev else "rdma"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._poke()
        if self._packer is not None:
            self._packer.join(timeout=5)
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.close()
        for r in self.regions:
            r.mr.close()
        self.regions = []
        if self.dev is not None:
            self.dev.close()
        os.close(self._wake)

    def _poke(self) -> None:
        """Wakes the pack thread from its sleep on completion events (to see the sessions anew)."""
        try:
            os.eventfd_write(self._wake, 1)
        except OSError:  # the counter is full (the thread is awake anyway) or the transport closed
            pass

    # ----------------------------------------------------------------- sessions
    def offer(self, session: Session, request: pb.OpenSessionRequest):
        params = request.rdma
        if not params.qps:
            return None  # this client brought no QPs: it cannot use rdma
        if len(params.qps) > self.max_qps:
            raise ValueError(f"{len(params.qps)} RDMA QPs requested, this server allows {self.max_qps} per session")
        v, dev = verbs(), self.dev
        e = v.e
        # Reads in flight per QP: as many as both devices allow (16 on ConnectX, 128 on rxe).
        rd_atomic = max(1, min(dev.max_rd_atomic, params.max_rd_atomic or 1))
        try:
            events = EventCQ(v, dev.context, len(params.qps) * (RECV_DEPTH + SEND_DEPTH) + 16)
        except v.Error as err:
            raise TransportError(f"rdma: cannot create a CQ on {dev.name}: {err}", errno=error_errno(err)) from None
        if events.fd is None:
            self._ratelog.warning("events", "rdma: a CQ's completion channel has no descriptor this process can "
                                  "tell apart for sure (%s): the pack thread polls that session's CQ every "
                                  "millisecond when idle", events.why)  # fmt: skip
        s = _SessionQPs(session, events, [], [])
        try:
            for _ in params.qps:
                qp, info = create_rc_qp(dev, s.cq, SEND_DEPTH, RECV_DEPTH, e.IBV_ACCESS_REMOTE_READ)
                s.qps.append(qp)
                s.infos.append(info)
            if self.pack_max_rows:
                self._setup_pack(s)
            for qp, info, remote in zip(s.qps, s.infos, params.qps):
                connect_rc_qp(dev, qp, info, QpInfo(remote.qp_num, remote.psn, remote.gid, remote.mtu), rd_atomic)
            if self.windows:
                self._bind_windows(s)
        except (VerbsError, v.Error) as err:
            s.close()
            raise TransportError(
                f"rdma: setting up the QPs of session {session.label} failed: {err}", errno=error_errno(err)
            ) from None
        except Exception:
            s.close()
            raise
        with self._lock:
            self._sessions[session.id] = s
        self._poke()
        log.info("rdma: session %s connected %d QPs (reads in flight per QP: %d)", session.label, len(s.qps), rd_atomic)
        return pb.TransportOffer(
            name="rdma",
            rdma=pb.RdmaEndpoint(
                qps=[pb.RdmaQueuePair(qp_num=i.qp_num, psn=i.psn, gid=i.gid, mtu=i.mtu) for i in s.infos],
                regions=[r.proto(s.rkeys[i] if s.rkeys else None) for i, r in enumerate(self.regions)],
                device=dev.name,
                pack_max_rows=self.pack_max_rows,
                max_rd_atomic=rd_atomic,
            ),
        )

    def _bind_windows(self, s: _SessionQPs, timeout: float = 10.0) -> None:
        """Binds a type-2 memory window per (QP, region), REMOTE_READ only, on that QP; fills s.rkeys."""
        v = verbs()
        e = v.e
        s.rkeys = [[0] * len(s.qps) for _ in self.regions]
        posted = []  # WRs stay referenced until they complete (pyverbs hands the device raw pointers)

        def reap() -> None:
            deadline = time.monotonic() + timeout
            done = 0
            while done < len(posted):
                n, wcs = s.cq.poll(16)
                for wc in wcs[:n]:
                    if wc.status != e.IBV_WC_SUCCESS:
                        raise RuntimeError(f"binding a memory window failed (completion status {wc.status})")
                    done += 1
                if not n and time.monotonic() > deadline:
                    raise RuntimeError(f"binding memory windows did not complete in {timeout:g} s")
            posted.clear()

        for q, qp in enumerate(s.qps):
            for i, r in enumerate(self.regions):
                mw = v.mr.MW(self.dev.pd, e.IBV_MW_TYPE_2)
                s.windows.append(mw)
                wr = v.wr.SendWR(
                    wr_id=(3 << 40) | len(s.windows), opcode=e.IBV_WR_BIND_MW, send_flags=e.IBV_SEND_SIGNALED
                )
                wr.set_bind_wr(mw, v.mr.MWBindInfo(r.mr, r.addr, r.length, e.IBV_ACCESS_REMOTE_READ))
                qp.post_send(wr)
                posted.append(wr)
                s.rkeys[i][q] = int(wr.rkey)
                if len(posted) >= SEND_DEPTH // 2:
                    reap()
        reap()

    def release(self, session: Session) -> None:
        with self._lock:
            s = self._sessions.pop(session.id, None)
        if s is not None:
            s.close()
            self._poke()
            log.info("rdma: session %s: destroyed %d QPs", session.label, len(s.qps))

    def active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def session_qps(self) -> int:
        with self._lock:
            return sum(len(s.qps) for s in self._sessions.values())

    # ---------------------------------------------------------------- pack mode
    def _setup_pack(self, s: _SessionQPs) -> None:
        v, dev = verbs(), self.dev
        e = v.e
        slot = PACK_REQUEST.size + self.pack_max_rows * ROW_ID_BYTES
        s.recv = RegisteredBuffer(dev, slot * RECV_DEPTH * len(s.qps), e.IBV_ACCESS_LOCAL_WRITE)
        row_bytes = max((t.row_bytes for t in self.tables), default=1)
        s.staging = RegisteredBuffer(dev, self.pack_max_rows * row_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        s.reply = RegisteredBuffer(dev, PACK_REPLY_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
        for q, qp in enumerate(s.qps):
            for i in range(RECV_DEPTH):
                k = q * RECV_DEPTH + i
                sge = v.wr.SGE(s.recv.addr + k * slot, slot, s.recv.mr.lkey)
                wr = v.wr.RecvWR(wr_id=k, num_sge=1, sg=[sge])
                s.recv_wrs.append(wr)
                qp.post_recv(wr)
        s.slot = slot

    def _pack_loop(self) -> None:
        """Serves pack requests of every session. Never waits on one session: a reply still on the wire
        holds only that session's next request. With nothing to do it yields for SPIN_ROUNDS rounds, naps
        POLL_NAP_S between rounds until POLL_FOR_S after the last work, then sleeps on the sessions'
        completion events (:meth:`_sleep`)."""
        idle, worked = 0, float("-inf")
        while not self._stop.is_set():
            with self._lock:
                sessions = [s for s in self._sessions.values() if s.recv is not None]
            if self._serve_round(sessions):
                idle, worked = 0, time.monotonic()
            elif idle < SPIN_ROUNDS:
                idle += 1
                time.sleep(0)
            elif time.monotonic() - worked < POLL_FOR_S:
                time.sleep(POLL_NAP_S)
            elif self._sleep(sessions):  # woken by work (or by a session coming or going): poll again
                idle, worked = 0, time.monotonic()

    def _serve_round(self, sessions: list) -> bool:
        """One pass over ``sessions``' CQs: whether any completion or request was handled."""
        busy = False
        stalled = []
        for s in sessions:
            with s.lock:
                if s.closed:
                    continue
                try:
                    busy |= self._poll_session(s)
                except _Stalled as e:
                    stalled.append((s, str(e)))
                except Exception as e:  # a broken session must not stop the others
                    self.metrics.error("qp_error")
                    self._ratelog.warning("pack", "rdma: session %s pack error: %s", s.session.label, e)
        for s, why in stalled:  # outside s.lock: ending the session releases (closes) it
            self.metrics.error("qp_error")
            log.warning("rdma: session %s: %s; ending it", s.session.label, why)
            self.sessions.close(s.session.id, f"rdma pack replies stalled: {why}")
        return busy or bool(stalled)

    def _sleep(self, sessions: list) -> bool:
        """Arms every session's CQ, looks at them once more (a completion before the arm raises no event)
        and, with nothing there, sleeps in poll() on their completion channels and the wake-up eventfd,
        until a completion, a session coming or going, or the nearest pack reply's deadline (SLEEP_S at
        most; 1 ms where a channel has no descriptor). Whether it found or woke for work."""
        now = time.monotonic()
        timeout = SLEEP_S
        watched = {}
        for s in sessions:
            with s.lock:
                if s.closed:
                    continue
                if s.events.fd is None:
                    timeout = min(timeout, 0.001)
                    continue
                try:
                    s.events.arm()
                except Exception as e:
                    self._ratelog.warning("arm", "rdma: session %s: cannot arm its CQ: %s", s.session.label, e)
                    timeout = min(timeout, 0.001)
                    continue
                watched[s.events.fd] = s
                if s.inflight is not None:
                    timeout = min(timeout, max(s.inflight[1] - now, 0.0))
        if self._serve_round(sessions):
            return True
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        for fd in watched:
            poller.register(fd, select.POLLIN)
        ready = poller.poll(timeout * 1e3)
        for fd, revents in ready:
            if fd == self._wake:
                try:
                    os.eventfd_read(self._wake)
                except OSError:
                    pass
                continue
            s = watched[fd]
            with s.lock:
                if not s.closed and revents & select.POLLIN:  # a closed one's fd may be another file's now
                    s.events.take_event()
        return bool(ready)

    def _poll_session(self, s: _SessionQPs) -> bool:
        e = verbs().e
        n, wcs = s.cq.poll(16)
        for wc in wcs[:n]:
            if s.inflight is not None and wc.wr_id == s.inflight[0].wr_id:
                self._reply_done(s, wc)
            elif wc.status != e.IBV_WC_SUCCESS:
                self.metrics.error("qp_error")
                self._ratelog.warning(
                    "wc",
                    "rdma: session %s: completion error status %d opcode %d",
                    s.session.label,
                    wc.status,
                    wc.opcode,
                )
            elif wc.opcode == e.IBV_WC_RECV:
                s.backlog.append((wc.wr_id, wc.byte_len, wc.qp_num))
        if s.inflight is not None and time.monotonic() > s.inflight[1]:
            raise _Stalled(
                f"a pack reply was not taken for {PACK_REPLY_TIMEOUT_S:g} s (the client stopped "
                "posting receive buffers)"
            )
        served = False
        while s.inflight is None and s.backlog:
            self._serve_pack(s, *s.backlog.pop(0))
            served = True
        return n > 0 or served

    def _reply_done(self, s: _SessionQPs, wc) -> None:
        _wr, _deadline, table_index, count, started = s.inflight
        s.inflight = None
        if wc.status != verbs().e.IBV_WC_SUCCESS:
            raise RuntimeError(f"pack reply failed with status {wc.status}")
        if table_index is not None:
            self._instruments(table_index).defer(
                count, count * self.tables[table_index].row_bytes, time.perf_counter() - started
            )

    def _qp_of(self, s: _SessionQPs, qp_num: int):
        for qp, info in zip(s.qps, s.infos):
            if info.qp_num == qp_num:
                return qp
        raise KeyError(qp_num)

    def _serve_pack(self, s: _SessionQPs, k: int, byte_len: int, qp_num: int) -> None:
        """Answers one pack request: gathers into the staging buffer and posts the WRITE (or the error
        SEND) without waiting for it; the receive buffer goes back at once (the ids were consumed)."""
        v = verbs()
        e = v.e
        base = k * s.slot
        raw = s.recv.array[base : base + byte_len]
        qp = self._qp_of(s, qp_num)
        request_id = 0
        try:
            if byte_len < PACK_REQUEST.size:
                raise Refused(Status.BAD_FRAME, "pack request shorter than its header")
            magic, request_id, table_index, count, dest, rkey = PACK_REQUEST.unpack_from(raw)
            if magic != PACK_REQUEST_MAGIC:
                raise Refused(Status.BAD_FRAME, f"bad pack request magic {bytes(magic)!r}")
            if count > self.pack_max_rows:
                raise Refused(
                    Status.TOO_MANY_ROWS, f"{count} rows in one pack request, the limit is {self.pack_max_rows}"
                )
            if byte_len != PACK_REQUEST.size + count * ROW_ID_BYTES:
                raise Refused(Status.BAD_FRAME, f"pack request of {byte_len} bytes for {count} ids")
            if table_index >= len(self.tables):
                raise Refused(Status.UNKNOWN_TABLE, f"no table #{table_index}")
            table = self.tables[table_index]
            ids = raw[PACK_REQUEST.size :].view("<i8")
            if not in_range(ids, table.rows):
                lo, hi = int(ids.min()), int(ids.max())
                raise Refused(
                    Status.ROW_OUT_OF_RANGE,
                    f"row id {lo if lo < 0 else hi} out of range for table {table.name!r} (0..{table.rows - 1})",
                )
            start = time.perf_counter()
            nbytes = count * table.row_bytes
            rows = s.staging.array[:nbytes].reshape(count, table.row_bytes)
            if table.disk is not None:  # read here, on the packer: pack sessions wait meanwhile (docs/DESIGN.md)
                table.disk.gather(ids, rows, owner=id(s.session))
            else:
                take_checked(table.data, ids, rows)  # checked above
            sge = v.wr.SGE(s.staging.addr, nbytes, s.staging.mr.lkey)
            wr = v.wr.SendWR(
                wr_id=1 << 40,
                opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
                num_sge=1,
                sg=[sge],
                imm_data=request_id,
                send_flags=e.IBV_SEND_SIGNALED,
            )
            wr.set_wr_rdma(rkey, dest)
            qp.post_send(wr)
            s.inflight = (wr, time.monotonic() + PACK_REPLY_TIMEOUT_S, table_index, count, start)
        except Refused as r:
            self.metrics.refused(r.status)
            self._ratelog.warning(r.name, "rdma: session %s pack request refused: %s", s.session.label, r)
            body = r.pack_error(request_id)
            s.reply.array[: len(body)] = np.frombuffer(body, np.uint8)
            sge = v.wr.SGE(s.reply.addr, len(body), s.reply.mr.lkey)
            wr = v.wr.SendWR(wr_id=1 << 41, opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
            qp.post_send(wr)
            s.inflight = (wr, time.monotonic() + PACK_REPLY_TIMEOUT_S, None, 0, 0.0)
        finally:
            qp.post_recv(s.recv_wrs[k])  # the ids were consumed: the receive buffer is free again

    def _instruments(self, table_index: int):
        inst = self._inst.get(table_index)
        if inst is None:
            inst = self._inst[table_index] = self.metrics.gather_op("rdma", "pack", self.tables[table_index].name)
        return inst


class _Stalled(Exception):
    """A session stopped taking its pack replies."""
