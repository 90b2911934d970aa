"""The interface every client-side data transport implements.

A transport is built from the server's offer for this session and moves rows
for flat, validated, int64 row ids into a caller-provided ``uint8 [n,
row_bytes]`` buffer. It returns a :class:`Pending` per request. Validation,
shapes, dedup and splitting into requests live in the table layer, once, for
all transports. A new transport = one module + one line in ``__init__``.

Opening one is the same for all (``transports.open_transport``): an optional
:meth:`ClientTransport.prepare` before the session opens (resources whose
description OpenSession carries: rdma's QPs), then the constructor with the
server's offer, all configured by one :class:`TransportOptions`. Overrides
keep the base class's signatures exactly (tests/unit/test_units.py checks).

Errors: a transport raises only tableclient errors (TransportUnavailable when
it cannot serve this client, ConnectError/AuthError for a refused handshake,
TransportError once broken, RemoteError for a refused request, GatherTimeout):
what the layers below raise (verbs' VerbsError, the wire's Refused) is turned
into those where it arises.
"""

from __future__ import annotations

import abc
import threading
import time
from dataclasses import dataclass

import numpy as np

from tableclient.errors import GatherTimeout, RemoteError
from tableserver.common.guard import Cancelled, OutputGuard
from tableserver.common.take import take_checked


@dataclass(frozen=True)
class TransportOptions:
    """How this client's data transports are set up: one object for all of them, each reading its own
    fields (the same for every node of a client)."""

    #: tcp: seconds a reader spins on the socket before sleeping (0: never spins)
    busy_poll: float = 0.0
    #: tcp (and shm's rows port): seconds a connection may sit unused before the next request first checks,
    #: with one non-blocking peek, whether the server closed it meanwhile (--idle-timeout), and re-opens it
    #: then (0: before every request on an unused connection; inf: never). A connection found closed only
    #: by a request sent after a shorter gap is re-opened and the request re-sent, once
    idle_check: float = 1.0
    #: shm: build the page tables of the mappings at connect (no first-touch fault in a gather)
    populate: bool = True
    #: rdma: device (None: the first), GID index (None: the best), port, QPs per session, ring rows per
    #: table and QP (shrunk to fit the device's CQ)
    rdma_device: str | None = None
    rdma_gid_index: int | None = None
    rdma_port: int = 1
    rdma_qps: int = 4
    rdma_ring_rows: int = 4096


DEFAULT_OPTIONS = TransportOptions()


class Prepared:
    """What a transport made before the session opened (see :meth:`ClientTransport.prepare`).

    The transport's constructor takes it over (and closes it if it fails); one never handed to a
    constructor is closed by whoever prepared it. ``close`` is idempotent."""

    def request_fields(self) -> dict:
        """Fields of ``OpenSessionRequest`` describing these resources to the server."""
        return {}

    def close(self) -> None:  # noqa: B027 - nothing to free by default
        """Frees the resources."""


def remote_error(refused) -> RemoteError:
    """A request the server refused (a wire ``Refused``) as this client reports it."""
    return RemoteError(refused.name, refused.message)


class Flag:
    """A one-shot event: set once, waited for by any number of threads. ``threading.Event`` minus its
    Condition: one lock, held until set (a gather makes one or two of these, so their cost is per gather)."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                self._lock.release()
            except RuntimeError:  # a racing second set() already released it
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            try:
                self._lock.release()  # the next waiter's turn
            except RuntimeError:  # released meanwhile by a racing second set(): it stays released
                pass
            return True
        return self._set


class Pending:
    """Completion of one transport request. ``wait`` raises what the request hit."""

    __slots__ = ("_event", "_error", "cancelled", "completed_at")

    def __init__(self):
        self._event = Flag()
        self._error: BaseException | None = None
        self.cancelled = False
        self.completed_at = 0.0  # time.perf_counter() when the rows were in place

    def complete(self, error: BaseException | None = None) -> None:
        self._error = error
        self.completed_at = time.perf_counter()
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise GatherTimeout(f"gather not complete after {timeout:.6f} s")
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """The caller no longer wants the rows: once this returns, nothing writes into its buffer.

        A barrier, not a hint: a copy already writing into the buffer is waited for (transports
        override this where a write can be in progress), so the caller may reuse the buffer at once.
        """
        self.cancelled = True


#: bytes one step of a :class:`WriteGuard` copy writes: the most a ``cancel()`` waits for
GUARD_STEP_BYTES = 4 << 20


class WriteGuard(OutputGuard):
    """Makes ``cancel()`` a barrier for a copy into a caller's buffer that runs on the waiting thread (the
    expansion of duplicate rows, the reorder of shards' rows): :meth:`copy` writes in steps of at most
    GUARD_STEP_BYTES, each inside the guard; :meth:`cancel` returns once the step in progress, if any,
    has ended. After ``cancel()`` returns, no step writes."""

    __slots__ = ()

    def copy(self, rows: int, row_bytes: int, step) -> bool:
        """``step(a, b)`` over rows ``0..rows`` in order, a few MiB at a time; False (the rest not written)
        once cancelled."""
        chunk = max(1, GUARD_STEP_BYTES // max(row_bytes, 1))
        try:
            for a in range(0, rows, chunk):
                with self:
                    step(a, min(a + chunk, rows))
        except Cancelled:
            return False
        return True


class Completed(Pending):
    """A request that finished synchronously (one shared instance: DONE)."""

    __slots__ = ()

    def __init__(self):
        super().__init__()
        self._event.set()

    def cancel(self) -> None:
        pass  # nothing left to cancel


DONE = Completed()  # its completed_at is meaningless: synchronous callers time the call itself


class ClientTransport(abc.ABC):
    name: str = ""
    #: remote transports fetch each distinct row once; local ones gather directly
    dedups: bool = True
    #: ... in batches of at least this many ids (below it, fetching the duplicates costs less than
    #: sorting the ids and expanding the rows; ``rowids.dedup`` decides above it)
    dedup_min_ids: int = 2

    #: gather modes this transport implements (rdma: one-sided "read" or owner-side "pack")
    modes: tuple = ("read",)

    #: ``gather(..., expand=inverse)`` supported: rows of distinct ids land in a staging area the
    #: transport owns and are copied once, expanded, into ``out`` (no scratch buffer, no second copy)
    expands: bool = False

    @classmethod
    def prepare(cls, options: TransportOptions, catalog: list) -> Prepared | None:
        """Resources to make before the session opens, whose description the OpenSession request
        carries (rdma: its QPs, connected in the handshake); None when this transport needs none.
        TransportUnavailable when it cannot work on this host at all."""
        return None

    def __init__(  # noqa: B027 - the constructor every transport has (open_transport calls it so)
        self,
        offer,
        session,
        catalog: list,
        connect_timeout: float = 10.0,
        options: TransportOptions = DEFAULT_OPTIONS,
        prepared: Prepared | None = None,
    ):
        """Connects to the server's ``offer`` for ``session`` (``catalog``: its TableInfos), all within
        ``connect_timeout`` seconds; takes ``prepared`` over. TransportUnavailable when it cannot
        serve this client (the next offer is tried), ConnectError/AuthError when the server refuses."""

    @abc.abstractmethod
    def gather(
        self,
        table_index: int,
        ids: np.ndarray,
        out: np.ndarray,
        sync: bool = False,
        mode: str = "read",
        expand: np.ndarray | None = None,
        hedge_after: float | None = None,
    ) -> Pending:
        """Starts moving rows ``ids`` of table ``table_index`` into ``out``.

        ``sync`` says the caller will wait at once: a local transport then
        copies inline instead of handing the copy to a thread. ``mode`` is one
        of ``modes`` (others ignore it). ``expand`` (only where ``expands``):
        ``out`` row i receives the row of ``ids[expand[i]]``. ``hedge_after``:
        re-issue on another replica if still missing then (routing does; one
        node's transport has nowhere else to send it and ignores it).
        """

    def local_table(self, table_index: int):
        """The table's rows as a local read-only array when this transport maps them (shm), else None:
        a synchronous gather then is one bounds-safe ``np.take`` in the caller's thread."""
        return None

    def take_async(self, rows: np.ndarray, ids: np.ndarray, out: np.ndarray) -> Pending:
        """``rows.take(ids, out=out)`` for ``rows`` from :meth:`local_table`, without waiting for it where
        the transport has a copy thread (shm); this default copies inline and returns a done Pending."""
        take_checked(rows, ids, out)
        return DONE

    def request_rows(self, mode: str = "read") -> int | None:
        """Most row ids one request of this transport may carry (None: the session's limit)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the transport. Idempotent; pending requests fail."""
