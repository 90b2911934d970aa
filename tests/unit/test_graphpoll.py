"""The native poller (client/tableclient/graph/poller/_native_c/) driven directly, with no daemon: its size checks, its
deadlines, ``close()`` racing ``arm()`` and the set_* calls on other threads, its tcp reader against a scripted
peer that speaks the wire's frames (tableserver.common.wire), and steps handed to Python (``set_host``, a
connection the server had closed). The flag protocol is a graph's: ids into the ids buffer, the ids flag set;
the rows flag awaited, then cleared (consumed). What it does against real daemons is in
tests/daemon/test_graphstep.py and tests/daemon/test_graphpoll_sources.py; under the sanitizers too
(tests/sanitize/run.py)."""

from __future__ import annotations

import math
import os
import socket
import threading
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, wait_for
from tableclient.graph.poller import native

from tableserver.common.wire import HEADER, HEADER_BYTES, FrameType, Status, response_header

if not native.BUILT:
    pytest.skip("tableclient.graph.poller._native is not built here", allow_module_level=True)

from tableclient.graph.poller import _native  # noqa: E402

IDS_FLAG, ROWS_FLAG, OK_FLAG = 0, 16, 32


class Slot:
    """One slot's buffers: ``tokens`` x ``columns`` ids, their rows of ``row_bytes``."""

    def __init__(self, max_tokens: int, columns: int, row_bytes: int):
        self.columns, self.row_bytes = columns, row_bytes
        self.flags = np.zeros(64, np.uint32)
        self.ids = np.zeros(max_tokens * columns, np.int64)
        self.staging = np.zeros(max_tokens * columns * row_bytes, np.uint8)

    def poller(self, fail: bool = False, **kw):
        spec = (IDS_FLAG, ROWS_FLAG, OK_FLAG, self.ids, self.staging, self.row_bytes, self.columns)
        return _native.Poller(self.flags, [spec], fail, **kw)

    def step(self, p, ids: np.ndarray, timeout: float = EVENT_TIMEOUT, publish: bool = True) -> np.ndarray:
        """One step of ``ids`` ([tokens, columns]) as a graph runs it: armed, ids published, rows awaited and
        consumed. Its rows; the ok flag in ``self.ok``."""
        tokens = ids.shape[0]
        p.arm(tokens, [time.monotonic() + timeout])
        if publish:
            self.ids[: ids.size] = ids.reshape(-1)
            self.flags[IDS_FLAG] = 1
        wait_for(lambda: self.flags[ROWS_FLAG] == 1, "the step's release")
        self.ok = int(self.flags[OK_FLAG])
        rows = self.staging[: ids.size * self.row_bytes].reshape(tokens, self.columns, self.row_bytes).copy()
        self.flags[ROWS_FLAG] = 0
        wait_for(lambda: not p.busy(), "the slot to be idle")
        return rows


# ---------------------------------------------------------------------- sizes and deadlines
def test_sizes_whose_products_wrap_are_refused():
    """Item 8: every product is checked before it is compared: 4 ids of 2**62-byte rows (2**64 bytes, 0 once
    wrapped) against an 8-byte staging, a table of 2**62 rows of 4 bytes against a small mapping. Before, both
    were taken, and the thread read and wrote far outside its buffers."""
    flags = np.zeros(64, np.uint32)
    ids, staging = np.zeros(4, np.int64), np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match="staging is smaller"):
        _native.Poller(flags, [(0, 16, -1, ids, staging, 1 << 62, 1)], False)
    s = Slot(2, 1, 4)
    p = s.poller()
    try:
        with pytest.raises(ValueError, match="smaller than rows x row_bytes"):
            p.set_shm(0, np.zeros(64, np.uint8), 1 << 62)
        p.set_shm(0, np.arange(64, dtype=np.uint8), 16)  # what fits is taken
    finally:
        p.close()


def test_deadlines_saturate_and_nan_is_refused():
    """Item 7: a deadline of inf (or 1e10 s) is "never", not a wrapped int64 already passed: before, every step
    was released at once with zeros. NaN is refused with one line; so is a NaN timeout."""
    s = Slot(4, 2, 8)
    table = np.random.default_rng(1).integers(0, 256, (100, 8), dtype=np.uint8)
    p = s.poller()
    try:
        p.set_shm(0, table, 100)
        for deadline in (math.inf, 1e10, 1e300):
            p.arm(2, [deadline])
            time.sleep(0.05)  # the thread's loop has looked at the deadline many times over
            assert s.flags[ROWS_FLAG] == 0, f"a step with deadline {deadline} released before its ids came"
            ids = np.array([[1, 2], [3, 99]])
            s.ids[:4] = ids.reshape(-1)
            s.flags[IDS_FLAG] = 1
            wait_for(lambda: s.flags[ROWS_FLAG] == 1, "the step's release")
            assert s.flags[OK_FLAG] == 1
            np.testing.assert_array_equal(s.staging[: 4 * 8].reshape(4, 8), table[ids.reshape(-1)])
            s.flags[ROWS_FLAG] = 0
        with pytest.raises(ValueError, match="nan"):
            p.arm(1, [math.nan])
        with pytest.raises(ValueError, match="nan"):
            p.wait_released(math.nan)
        assert p.wait_released(math.inf) == []  # nothing armed: at once
    finally:
        p.close()


# ---------------------------------------------------------------------- close() racing the rest
def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_racing_arm_and_source_changes_leaks_nothing_and_closes_nothing_twice():
    """Item 9: close() on one thread while others arm, step and point the slot at new tcp and shm sources: no
    fd closed twice (a closed fd is reused at once: the other thread's socket would be hit), none left open,
    a source set after close refused (its fd let go of), the flags left released."""
    table = np.zeros((50, 8), np.uint8)
    before = open_fds()
    for round_ in range(20):
        s = Slot(4, 2, 8)
        p = s.poller()
        p.set_shm(0, table, 50)
        a, b = socket.socketpair()
        stop = threading.Event()
        refused = []

        def sources(p=p, a=a, refused=refused, stop=stop):
            while not stop.is_set():
                for set_source in (lambda: p.set_tcp(0, a.fileno(), 0, 16), lambda: p.set_shm(0, table, 50),
                                   lambda: p.set_host(0), lambda: p.set_none(0)):  # fmt: skip
                    try:
                        set_source()
                    except RuntimeError as e:
                        refused.append(str(e))
                        return

        def steps(p=p, stop=stop):
            while not stop.is_set():
                try:
                    p.arm(1, [time.monotonic() + 0.01])
                except RuntimeError:
                    return  # closed
                p.wait_released(1.0)
                p.reset()

        threads = [threading.Thread(target=sources), threading.Thread(target=steps)]
        for t in threads:
            t.start()
        time.sleep(0.002 * (round_ % 5))
        closers = [threading.Thread(target=p.close) for _ in range(2)]  # twice at once: one stops it
        for t in closers:
            t.start()
        for t in closers:
            t.join(EVENT_TIMEOUT)
        stop.set()
        for t in threads:
            t.join(EVENT_TIMEOUT)
        assert not any(t.is_alive() for t in threads + closers)
        with pytest.raises(RuntimeError, match="closed"):
            p.set_tcp(0, a.fileno(), 0, 16)
        assert s.flags[ROWS_FLAG] == 1  # a replay after close waits for nobody
        assert all("closed" in r for r in refused)
        a.send(b"x")  # the socket is still ours: nobody closed its fd or a duplicate in use
        assert b.recv(1) == b"x"
        a.close()
        b.close()
        del p
    assert open_fds() <= before, "a source set around close() leaked its descriptor"


# ---------------------------------------------------------------------- the tcp reader
class Peer:
    """A scripted server on loopback tcp speaking the wire's GATHER frames for ``table``: it reads one whole
    request, then writes its whole response before it reads the next (as a server busy writing does), on
    small socket buffers. ``close_after``: it closes the connection after that many responses."""

    def __init__(self, table: np.ndarray, buffers: int = 4096, close_after: int | None = None):
        self.table, self.close_after, self.answered = table, close_after, 0
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.socket()
        self.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
        self.client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        self.client.connect(listener.getsockname())
        self.conn, _ = listener.accept()
        listener.close()
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _recv(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            got = self.conn.recv(n - len(buf))
            if not got:
                return None
            buf += got
        return bytes(buf)

    def _serve(self) -> None:
        try:
            while self.close_after is None or self.answered < self.close_after:
                head = self._recv(HEADER_BYTES)
                if head is None:
                    return
                _magic, _type, _flags, request_id, _table, count = HEADER.unpack(head)
                ids = np.frombuffer(self._recv(count * 8), "<i8")
                rows = self.table[ids]
                header = response_header(FrameType.GATHER, Status.OK, request_id, self.table.shape[1], count)
                self.conn.sendall(header + rows.tobytes())
                self.answered += 1
        except OSError:
            pass
        finally:
            self.conn.close()

    def close(self) -> None:
        self.client.close()
        self.thread.join(EVENT_TIMEOUT)


def test_large_requests_on_small_buffers_never_wedge_both_ends():
    """Item 10: a step of many large requests (4096 ids, 32 KiB each) against a server that writes a whole
    response before it reads on, on 4 KiB socket buffers. Before, the poller sent request k+1 before reading
    response k: it waited for the server to read, the server for it to read, both until the deadline (the
    policy: zeros). Now it never waits to send while a response is owed to it: every row, bit-exact."""
    rng = np.random.default_rng(3)
    table = rng.integers(0, 256, (5000, 8), dtype=np.uint8)
    s = Slot(64, 256, 8)
    peer = Peer(table)
    p = s.poller()
    try:
        p.set_tcp(0, peer.client.fileno(), 0, 4096)
        for tokens in (64, 17, 64):
            ids = rng.integers(0, 5000, (tokens, 256))
            rows = s.step(p, ids)
            assert s.ok == 1, p.wait_released(0)
            np.testing.assert_array_equal(rows, table[ids])
        assert p.broken(0) is None
    finally:
        p.close()
        peer.close()


def take_and_serve(p, s: Slot, table: np.ndarray, results: list) -> threading.Thread:
    """Python's side of a handoff, as native.NativePoller runs it: takes the step and gathers its rows from
    ``table`` into the staging itself."""

    def serve():
        job = p.take_handoff(EVENT_TIMEOUT)
        if job is None:
            results.append(None)
            return
        slot, step, tokens, deadline = job
        n = tokens * s.columns
        s.staging[: n * s.row_bytes] = table[s.ids[:n]].reshape(-1)
        results.append(job)
        assert p.finish_handoff(slot, step, True, "", False)
        assert not p.finish_handoff(slot, step, True, "", False)  # once only

    t = threading.Thread(target=serve)
    t.start()
    return t


def test_a_connection_the_server_closed_hands_the_step_to_python_and_says_why_once():
    """Item 4, the thread's side: the server closed the idle connection (its --idle-timeout). Found before a
    step (poll_closed, which the keeper runs) or by the step itself, never a policy step: the step is handed
    to Python (reads are idempotent: the client's transport sends it again), and broken() says why once."""
    rng = np.random.default_rng(4)
    table = rng.integers(0, 256, (300, 8), dtype=np.uint8)
    for found_by in ("poll_closed", "the step"):
        s = Slot(8, 4, 8)
        peer = Peer(table, close_after=1)
        p = s.poller()
        try:
            p.set_tcp(0, peer.client.fileno(), 0, 4096)
            ids = rng.integers(0, 300, (3, 4))
            np.testing.assert_array_equal(s.step(p, ids), table[ids])
            wait_for(lambda: not peer.thread.is_alive(), "the server to close the connection")
            if found_by == "poll_closed":
                wait_for(lambda: p.poll_closed(0), "the closed connection to be seen")
                assert "closed the idle connection" in p.broken(0)
            results: list = []
            helper = take_and_serve(p, s, table, results)
            ids = rng.integers(0, 300, (5, 4))
            rows = s.step(p, ids)
            helper.join(EVENT_TIMEOUT)
            assert results and results[0] is not None and s.ok == 1
            np.testing.assert_array_equal(rows, table[ids])
            if found_by == "the step":
                assert "closed the connection" in p.broken(0)
            assert p.broken(0) is None  # said once
            assert [e[2] for e in p.take_events()] == [native.ROWS, native.ROWS]
        finally:
            p.close()
            peer.close()


def test_a_handoff_nobody_takes_gets_the_policy_at_its_deadline():
    """set_host with nobody taking its steps: the thread releases each at its deadline with the policy (zeros,
    ok 0, event LATE: a remote source that did not answer); a step of a closed poller is taken by nobody."""
    s = Slot(4, 2, 8)
    s.staging[:] = 7
    p = s.poller()
    try:
        p.set_host(0)
        rows = s.step(p, np.array([[1, 2]]), timeout=0.05)
        assert s.ok == 0 and not rows.any()
        (event,) = p.take_events()
        assert event[2] == native.LATE and event[3] == 2
    finally:
        p.close()
    assert p.take_handoff(1.0) is None


def test_a_step_of_no_live_id_is_the_tables_rows_whatever_the_source():
    """A step of no real token (a data-parallel rank's idle batch) or of padding only reads nothing: released at
    once, ok 1, as the Python poller does, even with no source (a node down): an idle rank's outcome never
    masks its tensor-parallel peers' rows. Before, the native poller released it ok 0 with no source."""
    s = Slot(4, 2, 8)
    s.staging[:] = 7
    p = s.poller(dead_id=-1)
    try:
        for set_source in (p.set_none, p.set_host):
            set_source(0)
            s.step(p, np.zeros((0, 2), np.int64))
            assert s.ok == 1
            rows = s.step(p, np.full((2, 2), -1))
            assert s.ok == 1 and not rows.any()
    finally:
        p.close()


def test_close_lets_go_of_the_mapped_table_at_once():
    """close() releases the table a slot copied from (shm: a node's memory, mapped here) then, not when the
    Poller is freed: a closed GraphStep kept alive a while (a reference cycle, a traceback) must not keep a dead
    node's tables mapped. An mmap refuses to close while a buffer of it is held."""
    import mmap

    s = Slot(4, 2, 8)
    table = mmap.mmap(-1, 100 * 8)
    p = s.poller()
    p.set_shm(0, table, 100)
    with pytest.raises(BufferError):
        table.close()  # the slot holds it
    p.close()
    table.close()  # let go of
