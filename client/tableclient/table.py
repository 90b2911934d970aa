"""Tables as the client sees them, and gather handles.

``RemoteTable.gather_async(row_ids, out=None)`` validates the ids and the
output buffer, plans the fetch once (``tableclient.plan``: each distinct row
once where dedup pays, requests of at most ``max_rows_per_request`` ids),
dispatches that plan, and returns a :class:`GatherHandle`; ``wait`` expands
duplicates into the caller's order and returns ``[..., row_bytes]`` uint8 (a
torch tensor when torch was given).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tableclient.errors import GatherTimeout, RemoteError, TableClientError
from tableclient.metrics import GatherRecorder, metrics
from tableclient.plan import GatherPlan, plan_gather
from tableclient.rowids import in_range, prepare_out, to_row_ids
from tableclient.transports.base import WriteGuard
from tableserver.common.buffers import rows_buffer
from tableserver.common.model import NO_LIMIT
from tableserver.common.take import native_take, take_checked


@dataclass(frozen=True)
class TableInfo:
    index: int
    name: str
    rows: int
    row_bytes: int
    dtype: str
    shape: tuple[int, ...]
    layer: int
    version: int
    checksum: str
    nbytes: int
    total_rows: int = 0  # rows of the whole table (``rows``: the ones this server holds)
    row_lo: int = 0  # table row id of the first held row
    tier: str = "memory"  # where the server serves it from: "memory" or "disk" (no rdma READs, no mapping)

    @classmethod
    def from_proto(cls, t) -> TableInfo:
        """The table as a catalog entry describes it; ValueError (naming the field) for values no
        tableserver sends: every number the client computes with stays in int64."""
        total = t.total_rows or t.rows
        if not t.name or len(t.name) > MAX_NAME_CHARS:
            raise ValueError(f"table {t.index}: a name of {len(t.name)} characters (1..{MAX_NAME_CHARS})")
        if t.row_bytes <= 0:
            raise ValueError(f"table {t.name[:64]!r}: rows of {t.row_bytes} bytes")
        if not (0 <= t.row_lo and t.row_lo + t.rows <= total and total * t.row_bytes < 1 << 63):
            raise ValueError(
                f"table {t.name[:64]!r}: rows {t.row_lo}..{t.row_lo + t.rows} of {total} rows of {t.row_bytes} B"
            )
        if (
            t.nbytes != t.rows * t.row_bytes
            or len(t.shape) > 8
            or len(t.dtype) > MAX_NAME_CHARS
            or len(t.checksum) > MAX_NAME_CHARS
        ):
            raise ValueError(f"table {t.name[:64]!r}: nbytes, shape, dtype or checksum out of bounds")
        if t.tier not in ("", "memory", "disk"):
            raise ValueError(f"table {t.name[:64]!r}: tier {t.tier[:16]!r} (memory or disk)")
        return cls(
            index=t.index,
            name=t.name,
            rows=t.rows,
            row_bytes=t.row_bytes,
            dtype=t.dtype,
            shape=tuple(t.shape),
            layer=t.layer,
            version=t.version,
            checksum=t.checksum,
            nbytes=t.nbytes,
            total_rows=total,
            row_lo=t.row_lo,
            tier=t.tier or "memory",
        )

    @property
    def row_hi(self) -> int:
        return self.row_lo + self.rows


#: bounds of a catalog a client accepts (a model's tables are far below them)
MAX_TABLES = 4096
MAX_NAME_CHARS = 256


def check_catalog(infos: list[TableInfo]) -> list[TableInfo]:
    """``infos`` when every table has its own index and name and there are at most MAX_TABLES; else
    ValueError."""
    if len(infos) > MAX_TABLES:
        raise ValueError(f"{len(infos)} tables (at most {MAX_TABLES})")
    if len({t.index for t in infos}) != len(infos) or len({t.name for t in infos}) != len(infos):
        raise ValueError("two tables share an index or a name")
    return infos


class GatherHandle:
    """One gather in flight. ``wait`` returns its rows; ``cancel`` abandons it.

    ``expand``: ``(scratch, inverse, out)`` when the requests fetch each distinct row once into
    ``scratch``; ``wait`` then writes row ``inverse[i]`` of it into row i of ``out`` (the caller's
    buffer), a few MiB at a time, and ``cancel`` is a barrier for that copy too."""

    __slots__ = ("_pendings", "_result", "_expand", "_guard", "rows", "_t0", "_latency")

    def __init__(self, pendings: list, result, expand=None, rows: int = 0, t0: float = 0.0, latency=None):
        self._pendings = pendings
        self._result = result
        self._expand = expand
        self._guard = WriteGuard() if expand is not None else None
        self.rows = rows
        self._t0 = t0  # perf_counter() at issue
        self._latency = latency  # GatherRecorder, observed once on the first successful wait

    def done(self) -> bool:
        return all(p.done() for p in self._pendings)

    @property
    def completed_at(self) -> float:
        """perf_counter() when the last request's rows were in place (0 before; sync copies: the wait)."""
        return max((p.completed_at for p in self._pendings), default=0.0)

    def wait(self, timeout: float | None = None):
        """The rows, once every request has completed; GatherTimeout past ``timeout`` seconds.

        A timed-out handle stays valid: wait again or cancel it. A cancelled one raises TableClientError.
        """
        try:
            if timeout is None:
                for p in self._pendings:
                    p.wait()
            else:
                deadline = time.monotonic() + timeout
                for p in self._pendings:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 and not p.done():
                        raise GatherTimeout(f"gather of {self.rows} rows not complete after {timeout * 1e3:.3f} ms")
                    try:
                        p.wait(max(remaining, 0.0))
                    except GatherTimeout:  # worded with the caller's bound, not what was left of it
                        raise GatherTimeout(
                            f"gather of {self.rows} rows not complete after {timeout * 1e3:.3f} ms"
                        ) from None
        except Exception as e:
            if self._latency is not None:
                metrics().error(e)
            raise
        finish_s = 0.0
        if self._expand is not None:
            f0 = time.perf_counter()
            scratch, inverse, out = self._expand

            def expand(a: int, b: int) -> None:  # inverse indexes scratch by construction
                take_checked(scratch, inverse[a:b], out[a:b])

            if not self._guard.copy(inverse.size, out.shape[-1], expand):
                raise TableClientError(f"gather of {self.rows} rows was cancelled: its rows are not in out")
            self._expand = None
            finish_s = time.perf_counter() - f0
        if self._latency is not None:
            # Rows were in place when the last request completed (plus the
            # duplicate expansion), not when the caller came to wait for them.
            latency, self._latency = self._latency, None
            now = time.perf_counter()
            done = self.completed_at
            latency.observe((done + finish_s if self._t0 < done <= now else now) - self._t0)
        return self._result

    def cancel(self) -> None:
        """Abandons the gather. A barrier: once this returns, nothing of it writes into the output buffer
        (neither rows arriving later nor the expansion of duplicates another thread's ``wait`` runs)."""
        if self._guard is not None:
            self._guard.cancel()
        for p in self._pendings:
            p.cancel()


MODES = ("read", "pack")
_INT64, _UINT8 = np.dtype(np.int64), np.dtype(np.uint8)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(
            f"unknown gather mode {mode!r}: use 'read' (one-sided RDMA reads) or 'pack' "
            "(the server packs the rows and writes them once)"
        )
    return mode


class RemoteTable:
    """A table of the server, read through its client's :class:`~tableclient.routing.TableReader`.

    ``mode`` matters for rdma only: "read" posts one-sided READs, "pack" asks
    the server to gather the rows and RDMA-WRITE them packed. Both are bit-exact.
    A disk table (``info.tier``) has no memory to READ: it is always packed.
    """

    def __init__(self, client, info: TableInfo, mode: str = "read"):
        self._client = client
        self.info = info
        self.mode = self._mode(mode)
        #: how this table is read now: the node (and shm mapping) that serves it, or routing
        self.reader = client.reader(info.name)
        self._inst: dict[tuple, GatherRecorder] = {}  # (transport, mode) -> the process-wide recorder
        self._shm_recorder = None  # the shm path's, once made (read on every shm gather)

    def _mode(self, mode: str) -> str:
        """``mode`` checked; "pack" for a disk table whatever was asked (a READ has no memory to hit)."""
        return "pack" if check_mode(mode) and self.info.tier == "disk" else mode

    name = property(lambda self: self.info.name)
    rows = property(lambda self: self.info.rows)
    row_bytes = property(lambda self: self.info.row_bytes)
    layer = property(lambda self: self.info.layer)

    def __repr__(self) -> str:
        return (
            f"RemoteTable({self.name!r}, rows={self.rows}, row_bytes={self.row_bytes}, layer={self.layer}, "
            f"mode={self.mode!r})"
        )

    def gather(
        self, row_ids, out=None, timeout: float | None = None, mode: str | None = None, hedge_after: float | None = None
    ):
        """Rows ``row_ids`` (int array/tensor of any shape) as uint8 ``[..., row_bytes]``.

        On an error or timeout the gather is cancelled: rows arriving later never touch ``out``.
        ``hedge_after``: with replicas, re-issue on another one if still missing after this long.

        The ids are checked and planned once (:func:`~tableclient.plan.plan_gather`); the direct path
        and, when it does not take the gather, routing dispatch that plan (made again only where
        routing's limits differ from the node's). The shm path stays apart on purpose: a local ``take``
        from the mapped rows has nothing to deduplicate or split.
        """
        t0 = time.perf_counter()
        route = self.reader.route()
        if route.local is not None:  # shm: the rows are mapped here; one bounds-safe take, no round trip
            return self.take_local(route.local, row_ids, out, t0)
        mode, hedge_after = self._options(mode, hedge_after)
        flat_ids, flat_out, result = self._checked(row_ids, out)
        if flat_ids.size == 0:
            return result
        plan = None
        if route.node is not None and hedge_after is None:
            plan = self._plan(flat_ids, route.transport, mode, route.node.max_rows_per_request)
            if len(plan.slices) == 1:
                if self._gather_direct(route, plan, flat_out, timeout, mode, t0):
                    return result
                t0 = time.perf_counter()  # the node failed it: routing issues it afresh
        handle = self._submit(flat_ids, flat_out, result, True, mode, hedge_after, t0, plan)
        try:
            return handle.wait(timeout)
        except BaseException:
            handle.cancel()
            raise

    def _options(self, mode: str | None, hedge_after: float | None) -> tuple[str, float | None]:
        """A gather's mode (checked; the table's by default) and hedge delay (the client's by default)."""
        mode = self._mode(mode) if mode is not None else self.mode
        return mode, hedge_after if hedge_after is not None else getattr(self._client, "hedge_after", None)

    def _checked(self, row_ids, out):
        """(flat int64 ids, flat output rows, what the caller gets back); ValueError (counted) if bad.

        The common call -- int64 numpy ids, a numpy ``out`` of the right shape or none -- is checked
        inline (a handful of attribute checks and one ``in_range``); anything else, bad ids included,
        takes the general checks (``tableclient.rowids``), which word the error."""
        info = self.info
        if type(row_ids) is np.ndarray and row_ids.dtype == _INT64 and row_ids.size and in_range(row_ids, info.rows):
            if out is None:
                out = rows_buffer(row_ids.shape, info.row_bytes)
                return row_ids.ravel(), out.reshape(-1, info.row_bytes), out
            if (
                type(out) is np.ndarray
                and out.dtype == _UINT8
                and out.shape == row_ids.shape + (info.row_bytes,)
                and out.flags.carray  # C-contiguous, aligned and writeable (one flags object, not two)
            ):
                return row_ids.ravel(), out.reshape(-1, info.row_bytes), out
        try:
            ids, torch_in = to_row_ids(row_ids, info.rows, info.name)
            out_arr, result = prepare_out(out, ids.shape, info.row_bytes, torch_in)
        except ValueError as e:
            metrics().error(e)
            raise
        return ids.reshape(-1), out_arr.reshape(-1, info.row_bytes), result

    def take_local(self, local: np.ndarray, row_ids, out, t0: float | None = None):
        """The shm path: the rows of ``row_ids`` taken from ``local`` (this table's rows as mapped here,
        ``reader.local()``) into ``out`` in the caller's thread, and the metrics deferred (one deque
        append; applied in batches). Nothing else runs per call. The common call -- int64 numpy ids, a
        C-contiguous writeable uint8 ``out`` of shape ``ids.shape + (row_bytes,)`` -- is one native take
        (``tableserver.common.take``), which checks all of that and the ids itself (strided ids, e.g. one
        layer's slice of a step's ``[T, layers, 24]`` ids, are compacted first); everything else, or
        every call without the extension, goes through ``_checked`` and one checked take."""
        if t0 is None:
            t0 = time.perf_counter()
        if type(row_ids) is np.ndarray and native_take is not None and type(out) is np.ndarray:
            if not row_ids.flags.c_contiguous:
                row_ids = np.ascontiguousarray(row_ids)
            try:  # the native take checks it all
                n = native_take(local, row_ids, out)
            except (TypeError, ValueError, BufferError):
                n = -1  # anything else: the checks below take it
            if n > 0:
                (self._shm_recorder or self._shm_instruments()).defer(n, n, out.nbytes, time.perf_counter() - t0)
                return out
        ids, dest, result = self._checked(row_ids, out)
        n = ids.size
        if n:
            take_checked(local, ids, dest)  # in range by the checks (ValueError if changed since)
            (self._shm_recorder or self._shm_instruments()).defer(n, n, dest.nbytes, time.perf_counter() - t0)
        return result

    def _gather_direct(self, route, plan: GatherPlan, flat_out, timeout, mode: str, t0: float) -> bool:
        """``plan`` (one request) sent straight to the one node that holds the whole table (tcp, rdma),
        along the reader's ``route``: no routing objects, the caller's thread reads the answer. True once
        the rows are in ``flat_out``; False when the node fails: the reader then marks it down and the
        caller re-issues the gather through routing, on another replica."""
        transport, unique, inverse = route.transport, plan.unique, plan.inverse
        # rows of repeated ids are fetched once into scratch, then expanded into place
        dest = flat_out if inverse is None else rows_buffer(unique.size, self.info.row_bytes)
        try:
            (pending,) = self._send(transport, route.index, plan, dest, True, mode)
        except (GatherTimeout, RemoteError) as e:
            metrics().error(e)
            raise
        except TableClientError as e:
            self.reader.fail(route, e)
            return False
        try:
            pending.wait(timeout if timeout is not None else self.reader.request_timeout)
        except RemoteError as e:
            pending.cancel()  # a barrier: its rows never land after this
            if e.status == "IO_ERROR" and route.replicas > 1:  # that node's drive: routing asks another
                return False
            metrics().error(e)
            raise
        except GatherTimeout as e:
            pending.cancel()
            metrics().error(e)
            raise
        except TableClientError as e:
            pending.cancel()
            self.reader.fail(route, e)
            return False
        if inverse is not None:  # inverse indexes dest by construction
            take_checked(dest, inverse, flat_out)
        recorder = self._instruments(transport.name, mode if mode in transport.modes else "read")
        recorder.defer(plan.ids.size, unique.size, dest.nbytes, time.perf_counter() - t0)
        return True

    def gather_async(
        self, row_ids, out=None, mode: str | None = None, hedge_after: float | None = None
    ) -> GatherHandle:
        """Starts a gather and returns at once; ``handle.wait()`` returns the rows."""
        t0 = time.perf_counter()
        route = self.reader.route()
        if route.local is not None:
            return self._gather_local_async(route.transport.take_async, route.local, row_ids, out, mode)
        mode, hedge_after = self._options(mode, hedge_after)
        flat_ids, flat_out, result = self._checked(row_ids, out)
        if flat_ids.size == 0:
            return GatherHandle([], result)
        return self._submit(flat_ids, flat_out, result, False, mode, hedge_after, t0)

    def _gather_local_async(self, take_async, local: np.ndarray, row_ids, out, mode: str | None) -> GatherHandle:
        """The shm path of ``gather_async``: the checks, then one take from the mapped rows queued on the
        transport's copy thread (or run by the first ``wait``, whichever comes first; ``local`` keeps
        the mapping alive even if the node closes meanwhile). No routing: nothing to fail over or hedge
        in a local copy, as in ``gather``'s shm path. Counted now, latency observed at the wait."""
        t0 = time.perf_counter()
        if mode is not None:
            check_mode(mode)
        ids, dest, result = self._checked(row_ids, out)
        n = ids.size
        if n == 0:
            return GatherHandle([], result)
        recorder = self._shm_recorder or self._shm_instruments()
        recorder.count(n, n, dest.nbytes)
        return GatherHandle([take_async(local, ids, dest)], result, None, n, t0, recorder)

    def _submit(
        self,
        flat_ids,
        flat_out,
        result,
        sync: bool,
        mode: str,
        hedge_after: float | None,
        t0: float,
        plan: GatherPlan | None = None,
    ) -> GatherHandle:
        """The routed path: the plan of the checked ``flat_ids`` dispatched through the reader's transport
        (routing: shards, replicas, fail-over, hedging), one request per slice. ``plan``: the one the direct
        path made, dispatched as it is when routing's limits are the ones it was made for."""
        info = self.info
        transport = self.reader.transport()
        recorder = self._instruments(transport.name, mode if mode in transport.modes else "read")
        try:
            plan = self._plan(flat_ids, transport, mode, self._client.max_rows_per_request, plan)
            n, unique, inverse = plan.ids.size, plan.unique, plan.inverse
            recorder.count(n, unique.size, unique.size * info.row_bytes)
            if inverse is None:
                pendings = self._send(transport, info.index, plan, flat_out, sync, mode, hedge_after)
                return GatherHandle(pendings, result, None, n, t0, recorder)
            if transport.expands and len(plan.slices) == 1:
                # one request: the transport copies from its staging straight into out, expanded
                pending = transport.gather(info.index, unique, flat_out, sync, mode, expand=inverse)
                return GatherHandle([pending], result, None, n, t0, recorder)
            scratch = rows_buffer(unique.size, info.row_bytes)
            pendings = self._send(transport, info.index, plan, scratch, sync, mode, hedge_after)
            return GatherHandle(pendings, result, (scratch, inverse, flat_out), n, t0, recorder)
        except Exception as e:
            metrics().error(e)
            raise

    def _shm_instruments(self) -> GatherRecorder:
        """The shm paths' recorder, made once and kept in ``_shm_recorder`` (read on every shm gather)."""
        self._shm_recorder = self._instruments("shm", "read")
        return self._shm_recorder

    def _instruments(self, transport: str, mode: str) -> GatherRecorder:
        """The recorder of (transport, mode): the process's one for these labels, looked up once per
        table object (labels() costs microseconds)."""
        inst = self._inst.get((transport, mode))
        if inst is None:  # the process-wide recorder of these labels (a race makes the same one twice)
            inst = self._inst[(transport, mode)] = metrics().recorder(
                self.info.name, str(self.info.layer), transport, mode
            )
        return inst

    @staticmethod
    def _plan(flat_ids, transport, mode: str, session_rows: int, plan: GatherPlan | None = None) -> GatherPlan:
        """The plan of ``flat_ids`` for ``transport``: its dedup, and requests within ``session_rows`` (the
        session's limit) and its own limit for ``mode``. ``plan`` (of the same ids) when it was made for
        those limits: ``plan_gather`` is pure, it would make the same one again."""
        max_rows = min(session_rows, transport.request_rows(mode) or NO_LIMIT)
        min_ids = transport.dedup_min_ids if transport.dedups else None
        if plan is not None and plan.made_for(max_rows, min_ids):
            return plan
        return plan_gather(flat_ids, max_rows, min_ids)

    @staticmethod
    def _send(transport, index: int, plan: GatherPlan, dest, sync: bool, mode: str, hedge_after=None) -> list:
        """One request per slice of ``plan``: ids ``unique[a:b]`` of table ``index`` (the transport's number
        of it) into rows ``a:b`` of ``dest``; their pendings."""
        unique = plan.unique
        if len(plan.slices) == 1:
            return [transport.gather(index, unique, dest, sync, mode, hedge_after=hedge_after)]
        return [
            transport.gather(index, unique[a:b], dest[a:b], sync, mode, hedge_after=hedge_after) for a, b in plan.slices
        ]
