"""The rdma transport on a real verbs stack (Soft-RoCE rxe_lo in the QEMU guest).

Run by tests/host/test_rdma_guest.py inside the guest; the server and every client
are separate processes; expected rows always come from the table file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, ROOT, local_tables, wait_for
from guest import SLOW_CLIENT, guest_daemon, pack_reply_timeout
from tableclient import ConnectError, GatherTimeout, RemoteError, TableClient, TransportError
from tests_helpers import run_workers, scrape, value

from tableserver.common.verbs import RegisteredBuffer, list_devices, verbs
from tableserver.tables.demo import DemoRows, DemoTable
from tableserver.tables.tablefile import TableFileWriter

pytestmark = pytest.mark.rdma

MODES = ["read", "pack"]
#: the suite's daemon: shm off; 3 MiB MR chunks so the larger tables span several regions
RDMA_DAEMON = ("--transports", "rdma,tcp", "--rdma-mr-chunk-bytes", str(3 << 20))


@pytest.fixture(scope="module")
def rdma_daemon(demo_file, tmp_path_factory):
    d = guest_daemon(str(tmp_path_factory.mktemp("rdma")), "--tables", demo_file, *RDMA_DAEMON)
    yield d
    d.stop()


@pytest.fixture(scope="module", params=MODES)
def client(request, rdma_daemon):
    with TableClient(
        rdma_daemon.address, transport="rdma", mode=request.param, rdma_ring_rows=1024, **SLOW_CLIENT
    ) as c:
        assert c.transport == "rdma"
        yield c


def test_device_present():
    assert "rxe_lo" in list_devices()


def test_handshake(rdma_daemon, demo_local):
    with TableClient(rdma_daemon.address, transport="rdma", rdma_qps=3, rdma_ring_rows=256, **SLOW_CLIENT) as c:
        t = c.node_transport()
        assert len(t.qps) == 3 and t.device == "rxe_lo"
        for info in c.tables.values():  # the regions tile every table exactly, on row boundaries
            regions = t.regions(info.index)
            assert regions.starts[0] == 0 and all(s % info.row_bytes == 0 for s in regions.starts)
        big = t.regions(c.tables["engram.layer14"].index)
        assert len(big.starts) > 1  # 18 MB over 3 MiB chunks
        assert c.table("tiny").gather([0]).tobytes() == demo_local["tiny"][0].tobytes()
    log = rdma_daemon.log()
    assert "registered" in log and "window-only (per-session rkeys) MRs" in log and "connected 3 QPs" in log


@pytest.mark.parametrize("name", ["engram.layer1", "engram.layer14", "dense.f32", "tiny"])
def test_random_zipf_duplicates_first_last(client, demo_local, name):
    table = client.table(name)
    local = demo_local[name]
    rng = np.random.default_rng(11)
    last = table.rows - 1
    cases = [
        rng.integers(0, table.rows, (64, 24)),  # one decode step of one layer
        (rng.zipf(1.3, size=(8, 24)) - 1) % table.rows,
        np.array([0, last, 0, last, 0]),
        np.full((3, 5), last // 2),
        np.zeros((0, 24), np.int64),
        rng.integers(0, table.rows, 3000),  # several ring blocks / pack requests
    ]
    for ids in cases:
        rows = table.gather(ids, timeout=EVENT_TIMEOUT)
        assert rows.shape == ids.shape + (table.row_bytes,)
        np.testing.assert_array_equal(rows, local[ids])


def test_gather_many_and_fixed_out_buffers(client, demo_local):
    l1, l14 = client.table("engram.layer1"), client.table("engram.layer14")
    outs = [np.empty((64, 24, 264), np.uint8), np.empty((64, 24, 264), np.uint8)]
    addresses = [o.ctypes.data for o in outs]
    rng = np.random.default_rng(2)
    for _ in range(3):
        ids = [rng.integers(0, l1.rows, (64, 24)), rng.integers(0, l14.rows, (64, 24))]
        h1, h14 = client.gather_many([(l1, ids[0]), (l14, ids[1])], outs=outs)
        assert h1.wait(EVENT_TIMEOUT) is outs[0] and h14.wait(EVENT_TIMEOUT) is outs[1]
        np.testing.assert_array_equal(outs[0], demo_local[l1.name][ids[0]])
        np.testing.assert_array_equal(outs[1], demo_local[l14.name][ids[1]])
    assert [o.ctypes.data for o in outs] == addresses


def test_both_modes_in_one_session(rdma_daemon, demo_local):
    with TableClient(rdma_daemon.address, transport="rdma", rdma_ring_rows=512, **SLOW_CLIENT) as c:
        t = c.table("engram.layer14")
        ids = np.random.default_rng(4).integers(0, t.rows, 700)
        a, b = t.gather_async(ids, mode="read"), t.gather_async(ids, mode="pack")
        np.testing.assert_array_equal(a.wait(EVENT_TIMEOUT), demo_local[t.name][ids])
        np.testing.assert_array_equal(b.wait(EVENT_TIMEOUT), demo_local[t.name][ids])
        with pytest.raises(ValueError, match="unknown gather mode"):
            t.gather([1], mode="write")


def test_rdma_metrics(demo_file, demo_local, tmp_path):
    """QPs, sessions, registered bytes and pack rows on the daemon's /metrics; per-mode latency in the client.
    A daemon of its own: the shared one may still be counting another test's last pack reply."""
    from prometheus_client import REGISTRY

    def client_count(mode):
        return (
            REGISTRY.get_sample_value(
                "tableserver_client_gather_duration_seconds_count",
                dict(table="engram.layer1", layer="1", transport="rdma", mode=mode),
            )
            or 0
        )

    d = guest_daemon(str(tmp_path / "d"), "--tables", demo_file, *RDMA_DAEMON)
    try:
        metrics = d.ready["metrics"]
        before = scrape(metrics)
        assert value(before, "tableserver_rdma_registered_bytes") == sum(t.nbytes for t in demo_local.values())
        assert value(before, "tableserver_rdma_memory_regions") > len(demo_local)  # 3 MiB chunks
        assert value(before, "tableserver_rdma_registration_duration_seconds") > 0
        reads, packs = client_count("read"), client_count("pack")
        ids = np.random.default_rng(9).permutation(50_000)[:900]
        with TableClient(d.address, transport="rdma", rdma_qps=2, rdma_ring_rows=512, **SLOW_CLIENT) as c:
            during = scrape(metrics)
            assert value(during, "tableserver_rdma_qps") >= 2
            assert value(during, "tableserver_sessions", transport="rdma") >= 1
            t = c.table("engram.layer1")
            np.testing.assert_array_equal(t.gather(ids, mode="pack"), demo_local[t.name][ids])
            np.testing.assert_array_equal(t.gather(ids, mode="read"), demo_local[t.name][ids])
        lab = dict(table="engram.layer1", transport="rdma", op="pack")

        def packed() -> float:
            rows = "tableserver_gather_rows_total"
            return value(scrape(metrics), rows, **lab) - value(before, rows, **lab)

        # the daemon counts a pack reply's rows once its pack thread has seen the reply's completion, which on
        # a slow guest can come after the client has the rows: wait for the count, then check it exactly
        wait_for(lambda: packed() >= ids.size, lambda: f"{ids.size} packed rows counted, now {packed()}")
        assert packed() == ids.size
        assert client_count("read") - reads == 1 and client_count("pack") - packs == 1
    finally:
        d.stop()


def test_auto_prefers_rdma(rdma_daemon):
    with TableClient(rdma_daemon.address, **SLOW_CLIENT) as c:
        assert c.transport == "rdma"


def test_out_of_range_rejected_before_posting(client, demo_local, monkeypatch):
    t = client.table("engram.layer1")
    transport = client.node_transport()
    asked = []
    gather = transport.gather
    monkeypatch.setattr(transport, "gather", lambda *args, **kwargs: asked.append(args) or gather(*args, **kwargs))
    for bad in ([t.rows], [-1], [0.5]):
        with pytest.raises(ValueError):
            t.gather(bad)
    assert asked == []  # the transport was asked for no request, let alone posted one
    np.testing.assert_array_equal(t.gather([3], timeout=EVENT_TIMEOUT), demo_local[t.name][[3]])
    assert len(asked) == 1  # a valid gather asks it: the spy is on the path the bad ids would have taken


def test_pack_server_checks_ids_itself(rdma_daemon, demo_local):
    """A client that skips validation gets ROW_OUT_OF_RANGE from the server; the session lives on."""
    with TableClient(rdma_daemon.address, transport="rdma", mode="pack", rdma_ring_rows=256, **SLOW_CLIENT) as c:
        t = c.table("engram.layer1")
        out = np.empty((2, 264), np.uint8)
        pending = c.node_transport().gather(t.info.index, np.array([0, t.rows + 5], np.int64), out, mode="pack")
        with pytest.raises(RemoteError, match="ROW_OUT_OF_RANGE"):
            pending.wait(EVENT_TIMEOUT)
        np.testing.assert_array_equal(t.gather([3, 4], timeout=EVENT_TIMEOUT), demo_local[t.name][[3, 4]])


def one_sided_wr(transport, opcode, wr_id: int, rkey: int, addr: int):
    """A signaled one-sided work request (``opcode``: RDMA READ or WRITE) of 264 bytes between a fresh
    4 KiB buffer registered on ``transport``'s device and ``addr`` with ``rkey``: (work request, local buffer).
    The buffer is deregistered with the device when the transport closes, if not before."""
    v = verbs()
    local = RegisteredBuffer(transport.dev, 4096, v.e.IBV_ACCESS_LOCAL_WRITE)
    sge = v.wr.SGE(local.addr, 264, local.mr.lkey)
    wr = v.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=v.e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, addr)
    return wr, local


def post_remote_write(client, wr_id: int):
    """Posts an RDMA WRITE of 264 bytes of 0xAB into row 0 of engram.layer1 on the client's first QP."""
    t = client.node_transport()
    regions = t.regions(client.tables["engram.layer1"].index)
    wr, local = one_sided_wr(t, verbs().e.IBV_WR_RDMA_WRITE, wr_id, int(regions.rkeys[0, 0]), int(regions.addrs[0]))
    local.array[:264] = 0xAB
    t.qps[0].post_send(wr)
    return t, local, wr  # keep them referenced while the WRITE is in flight (pyverbs keeps raw pointers)


def test_server_refuses_remote_write(rdma_daemon, demo_local):
    """Tables are registered REMOTE_READ only: an RDMA WRITE into one fails at the responder."""
    e = verbs().e
    with TableClient(rdma_daemon.address, transport="rdma", rdma_qps=1, rdma_ring_rows=64, **SLOW_CLIENT) as c:
        t, _local, _wr = post_remote_write(c, 77)
        deadline = time.monotonic() + EVENT_TIMEOUT
        statuses = []
        with t.poll_lock:
            while not statuses and time.monotonic() < deadline:
                n, wcs = t.cq.poll(4)
                statuses += [wc.status for wc in wcs[:n] if wc.wr_id == 77]
        # The server QP grants no remote write (rxe NAKs: invalid request) and the MR grants none either
        # (access error): either way the responder refused.
        assert statuses and statuses[0] in (e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR), statuses
    # row 0 intact, still served
    with TableClient(rdma_daemon.address, transport="rdma", rdma_ring_rows=256, **SLOW_CLIENT) as c2:
        row0 = c2.table("engram.layer1").gather([0, 1], timeout=EVENT_TIMEOUT)
        np.testing.assert_array_equal(row0, demo_local["engram.layer1"][[0, 1]])
        assert not (row0[0] == 0xAB).all()


def read_with(transport, rkey: int, addr: int, wr_id: int):
    """One RDMA READ of 264 bytes at ``addr`` with ``rkey`` on the transport's first QP: (status, bytes)."""
    wr, local = one_sided_wr(transport, verbs().e.IBV_WR_RDMA_READ, wr_id, rkey, addr)
    try:
        with transport.poll_lock:
            transport.qps[0].post_send(wr)
            deadline = time.monotonic() + EVENT_TIMEOUT
            while time.monotonic() < deadline:
                n, wcs = transport.cq.poll(4)
                for wc in wcs[:n]:
                    if wc.wr_id == wr_id:
                        return wc.status, bytes(local.array[:264])
        raise AssertionError("the READ never completed")
    finally:
        local.close()


def test_an_rkey_reads_only_on_its_own_sessions_qps(rdma_daemon, demo_local):
    """Before: one MR rkey per region served every session, forever (a session that ended, or another
    one, kept reading with it). Now each session's QPs get their own type-2 memory windows: an rkey
    reads on its own QP only, and dies with its session."""
    e = verbs().e
    index = None
    with TableClient(rdma_daemon.address, transport="rdma", rdma_qps=2, rdma_ring_rows=64, **SLOW_CLIENT) as a:
        ta = a.node_transport()
        index = a.tables["engram.layer1"].index
        sa = ta.regions(index)
        addr = int(sa.addrs[0])
        assert sa.rkeys[0, 0] != sa.rkeys[0, 1]  # one window per QP
        status, row = read_with(ta, int(sa.rkeys[0, 0]), addr, 91)
        assert status == e.IBV_WC_SUCCESS and row == demo_local["engram.layer1"][0].tobytes()
        old_rkeys = [int(k) for k in sa.rkeys[0]]
    with TableClient(rdma_daemon.address, transport="rdma", rdma_qps=1, rdma_ring_rows=64, **SLOW_CLIENT) as b:
        tb = b.node_transport()
        assert int(tb.regions(index).rkeys[0, 0]) not in old_rkeys
        status, row = read_with(tb, old_rkeys[0], addr, 92)  # the ended session's rkey, on a live QP
        assert status == e.IBV_WC_REM_ACCESS_ERR and row != demo_local["engram.layer1"][0].tobytes()
    log = rdma_daemon.log()
    assert "window-only (per-session rkeys)" in log


#: how long the stall test's daemon lets a pack reply go untaken before it ends the session (its default: 5 s).
#: The stall is the window in which the other session's gathers must be served to show they are not held
#: behind it: 20 small gathers, a fraction of a second in the guest, and no loaded guest takes 30 s for them.
STALL_S = 30.0


def test_a_client_that_stops_taking_pack_replies_stalls_only_itself(demo_file, demo_local, tmp_path):
    """Before: the one pack thread waited on each reply until it completed (up to 5 s), so a client that
    stopped posting receive buffers held every session's pack requests. Now a reply on the wire holds
    only its own session: the others are served meanwhile, and the stalled session is ended.

    Shown by order, not by speed: every gather of the other session completes while the stalled reply is
    still on the wire (the daemon has not yet ended its session; held behind it, they would complete only
    after). A daemon of its own whose stall bound is STALL_S gives them that window on a slow guest."""

    class Dropped:
        """Where the broken client would re-post a receive buffer: it never does."""

        def post_recv(self, wr):
            pass

    d = guest_daemon(str(tmp_path / "d"), "--tables", demo_file, *RDMA_DAEMON, prefix=pack_reply_timeout(STALL_S))
    rows = demo_local["engram.layer1"]
    try:
        pack = dict(transport="rdma", mode="pack", rdma_qps=1, rdma_ring_rows=64, **SLOW_CLIENT)
        with TableClient(d.address, client_name="stalls", **pack) as x, TableClient(d.address, **pack) as y:
            tx = x.node_transport()
            # a client that never re-posts its receive buffers: a fault no public seam may offer to inject
            tx._recv_wrs = [(Dropped(), wr) for _qp, wr in tx._recv_wrs]  # private: fault injection
            for i in range(16):  # each reply uses up one of its 16 receive buffers
                np.testing.assert_array_equal(x.table("engram.layer1").gather([i], timeout=EVENT_TIMEOUT), rows[[i]])
            stuck = x.table("engram.layer1").gather_async([99])  # its reply finds no receive buffer: RNR
            for i in range(20):
                ids = np.arange(i, 3000, 97)
                np.testing.assert_array_equal(y.table("engram.layer1").gather(ids, timeout=EVENT_TIMEOUT), rows[ids])
                log = d.log()
                assert "pack replies stalled" not in log, f"gather {i} was held behind the stalled reply:\n{log}"
            wait_for(lambda: "pack replies stalled" in d.log(), lambda: f"the stalled session to be ended:\n{d.log()}")
            assert f"a pack reply was not taken for {STALL_S:g} s" in d.log()  # the daemon ran with our bound
            with pytest.raises((TransportError, ConnectError, GatherTimeout)):
                stuck.wait(EVENT_TIMEOUT)
            ids = np.arange(5, 3000, 89)  # and the other session is still served
            np.testing.assert_array_equal(y.table("engram.layer1").gather(ids, timeout=EVENT_TIMEOUT), rows[ids])
    finally:
        d.stop()


def _wakeups(pid: int) -> int:
    """Every thread of ``pid``: its context switches so far (each sleep the thread woke from is one)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                n += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except OSError:  # a thread that ended meanwhile
            continue
    return n


#: a pack node's wake-ups over IDLE_S seconds with one idle pack session open, at most (its gRPC, keepalive and
#: metrics threads wake a few dozen times a second; a pack thread that polled each millisecond added 1,000 a second)
IDLE_S, IDLE_WAKEUPS = 2.0, 700


def test_an_idle_pack_node_sleeps_on_completion_events(demo_file, demo_local, tmp_path):
    """Before: the pack thread polled every session's CQ each millisecond when idle, and with no session at
    all too, for the daemon's whole life. Now, once nothing came for its spin rounds, it sleeps on the CQs'
    completion channels: an idle node barely wakes, and a pack request wakes it (served bit-exact)."""
    d = guest_daemon(str(tmp_path / "d"), "--tables", demo_file, *RDMA_DAEMON)
    try:
        time.sleep(1.0)  # started: the pack thread has no session yet
        before = _wakeups(d.proc.pid)
        time.sleep(IDLE_S)
        alone = _wakeups(d.proc.pid) - before
        with TableClient(d.address, transport="rdma", mode="pack", rdma_qps=2, **SLOW_CLIENT) as c:
            t = c.table("engram.layer14")
            rng = np.random.default_rng(5)
            ids = rng.integers(0, t.rows, 300)
            np.testing.assert_array_equal(t.gather(ids, mode="pack"), demo_local[t.name][ids])
            time.sleep(1.0)  # past the spin rounds: asleep on the session's completion channel
            before = _wakeups(d.proc.pid)
            time.sleep(IDLE_S)
            idle = _wakeups(d.proc.pid) - before
            for _ in range(3):  # each one wakes it from its sleep
                ids = rng.integers(0, t.rows, 300)
                np.testing.assert_array_equal(t.gather(ids, mode="pack"), demo_local[t.name][ids])
                time.sleep(0.5)
        print(f"pack node wake-ups in {IDLE_S:g} s: {alone} without a session, {idle} with an idle pack session")
        assert alone <= IDLE_WAKEUPS and idle <= IDLE_WAKEUPS, (
            f"an idle pack node woke {alone} times without a session and {idle} times with one in {IDLE_S:g} s"
        )
        assert "completion channel has no descriptor" not in d.log()
    finally:
        d.stop()


def test_reconnects_after_a_qp_error(rdma_daemon, demo_local):
    """A QP driven into the error state (a remote WRITE the server refuses): the next gather fails over to
    nothing (one node) and fails fast; the client opens a new session and QPs, and serves bit-exact."""
    with TableClient(rdma_daemon.address, transport="rdma", rdma_qps=1, rdma_ring_rows=256, **SLOW_CLIENT) as c:
        t, _local, _wr = post_remote_write(c, 78)  # the responder NAKs it: the QP is in the error state from now on
        deadline = time.monotonic() + EVENT_TIMEOUT
        with pytest.raises(ConnectError):
            # the first gathers may still complete before the error surfaces (how many depends on how fast the
            # guest runs): gather until it does, each that completes bit-exact
            while time.monotonic() < deadline:
                np.testing.assert_array_equal(
                    c.table("engram.layer1").gather([0, 1], timeout=EVENT_TIMEOUT), demo_local["engram.layer1"][[0, 1]]
                )
        wait_for(lambda: c.replicas()[rdma_daemon.address]["state"] == "up", lambda: f"a new session: {c.replicas()}")
        assert c.node_transport() is not t
        ids = np.arange(0, 50_000, 501)
        np.testing.assert_array_equal(
            c.table("engram.layer1").gather(ids, timeout=EVENT_TIMEOUT), demo_local["engram.layer1"][ids]
        )


def test_concurrent_client_processes(rdma_daemon, demo_file):
    # three processes start at once in a TCG guest: their imports and sessions once took over the default
    # 10 s to open there; this test is about concurrent sessions being served right, not about how fast they
    # open (or answer keepalives): the guest's bounds (SLOW_CLIENT) for every one
    configs = [dict(transport="rdma", mode=m, rdma_ring_rows=512, **SLOW_CLIENT) for m in ("read", "pack", "read")]
    outcomes = run_workers(configs, rdma_daemon.address, demo_file, steps=8, batch=16)
    assert outcomes == {i: "ok" for i in range(len(configs))}, outcomes


def test_client_killed_mid_gather(rdma_daemon, demo_local):
    code = (
        "import sys, numpy as np; from tableclient import TableClient\n"
        f"c = TableClient({rdma_daemon.address!r}, transport='rdma', rdma_ring_rows=1024, **{SLOW_CLIENT!r})\n"
        "t = c.table('engram.layer14')\n"
        "rng = np.random.default_rng()\n"
        "t.gather(rng.integers(0, t.rows, 4000))\n"
        "print('gathering', flush=True)\n"
        "while True: t.gather(rng.integers(0, t.rows, 4000))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT)
    assert child.stdout.readline().strip() == b"gathering"  # from here on, it is (almost) always mid-gather
    child.send_signal(signal.SIGKILL)
    child.wait()
    wait_for(
        lambda: rdma_daemon.log().count("destroyed") >= 1 + rdma_daemon.log().count("closed by client"),
        lambda: f"the killed client's QPs to be destroyed:\n{rdma_daemon.log()[-3000:]}",
        interval=0.2,
    )
    with TableClient(rdma_daemon.address, transport="rdma", rdma_ring_rows=256, **SLOW_CLIENT) as c:
        ids = np.arange(0, 70_001, 997)
        np.testing.assert_array_equal(
            c.table("engram.layer14").gather(ids, timeout=EVENT_TIMEOUT), demo_local["engram.layer14"][ids]
        )


def test_server_gone_fails_gathers_cleanly(demo_file, tmp_path):
    d = guest_daemon(str(tmp_path / "d"), "--tables", demo_file, "--transports", "rdma")
    c = TableClient(d.address, transport="rdma", rdma_ring_rows=256, **SLOW_CLIENT)
    assert c.table("tiny").gather([0], timeout=EVENT_TIMEOUT).shape == (1, 8)
    d.stop(signal.SIGKILL)
    with pytest.raises((ConnectError, TransportError, GatherTimeout)):  # one node: no replica to fail over to
        c.table("engram.layer1").gather(np.arange(100), timeout=30)
    c.close()


def replica_pair(tmp_path, demo_file, second: str):
    """Two daemons serving the same tables: node "rdma-a" over rdma, node "rdma-b" over ``second``."""
    a = guest_daemon(str(tmp_path / "a"), "--tables", demo_file, "--transports", "rdma", "--node-id", "rdma-a")
    try:
        b = guest_daemon(str(tmp_path / "b"), "--tables", demo_file, "--transports", second, "--node-id", "rdma-b")
    except BaseException:
        a.stop()
        raise
    return a, b


def client_id_reading(first: str, then: str) -> str:
    """A client id whose rendezvous order reads node ``first`` before node ``then``."""
    from tableclient.routing import rendezvous_score

    return next(
        c for c in (f"failover-{i}" for i in range(1000)) if rendezvous_score(c, first) > rendezvous_score(c, then)
    )


#: a client process without CAP_IPC_LOCK (as an unprivileged one is): RLIMIT_MEMLOCK binds what it may pin
MEMLOCK_CLIENT = r"""
import json, logging, resource, sys
import numpy as np
from tableclient import TableClient

a, b, client_id, out, slow = sys.argv[1:6]
slow = json.loads(slow)  # the guest's bounds (guest.SLOW_CLIENT), and a failed node's retry as late
said = []  # what routing logs: why it failed a node


class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())


logging.getLogger("tableclient").addHandler(Keep(logging.INFO))
logging.getLogger("tableclient").setLevel(logging.INFO)
soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
try:  # room for the sessions' own buffers
    hard = resource.RLIM_INFINITY
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
except (ValueError, OSError):
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
with TableClient(f"{a},{b}", client_id=client_id, rdma_qps=2, rdma_ring_rows=256, **slow) as c:
    before = c.replicas()
    pinned_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmPin:"))
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (pinned_kb << 10, hard))  # the allowance spent: nothing more fits
    t = c.table("engram.layer14")  # never read yet: its rdma staging is registered on this first read
    np.save(out, t.gather(np.arange(3, t.rows, 197), timeout=slow["request_timeout"]))
    print(json.dumps(dict(before=before, after=c.replicas(), pinned_kb=pinned_kb, said=said)), flush=True)
"""


def test_a_verbs_error_on_first_use_fails_over_to_a_replica(demo_file, demo_local, tmp_path):
    """Before: the rdma client registers a table's staging on its first read of it, and a verbs failure
    there (the kernel refusing to pin more memory: the process's locked-memory allowance is spent) raised
    the verbs layer's RdmaError -- no TableClientError -- out of the gather: routing did not fail over and
    ``except TableClientError`` missed it. Now it is a TransportError: the node is failed and the gather
    answered, bit-exact, by the replica (here over tcp: the allowance binds every rdma session)."""
    a, b = replica_pair(tmp_path, demo_file, "tcp")
    try:
        out = tmp_path / "rows.npy"
        cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--", sys.executable, "-c"]
        res = subprocess.run(
            [*cmd, MEMLOCK_CLIENT, a.address, b.address, client_id_reading("rdma-a", "rdma-b"), str(out),
             json.dumps(dict(SLOW_CLIENT, backoff_min=EVENT_TIMEOUT, backoff_max=EVENT_TIMEOUT))],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=3 * EVENT_TIMEOUT,  # only against a hang: its session opens and its gather have their bounds
        )  # fmt: skip
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert report["pinned_kb"] > 0, report  # the sessions' buffers count against the allowance
        assert report["before"][a.address]["transport"] == "rdma", report
        # node a failed on that first read, for the kernel's refusal to pin (ENOMEM), and stays failed: its
        # retry is not due before the event bound (backoff_min), so however slow the guest, the report is read
        # before it (a retry's new session, once the failed one's buffers are unpinned, could open)
        why = [m for m in report["said"] if m.startswith(f"tableserver {a.address} down: ")]
        assert why and "Failed to register MR" in why[0] and "Errno: 12" in why[0], report
        assert report["after"][a.address]["state"] != "up", report
        assert report["after"][b.address]["state"] == "up" and report["after"][b.address]["transport"] == "tcp", report
        ids = np.arange(3, demo_local["engram.layer14"].shape[0], 197)
        np.testing.assert_array_equal(np.load(out), demo_local["engram.layer14"][ids])
    finally:
        a.stop()
        b.stop()


def test_a_qp_error_before_the_first_read_fails_over_to_a_replica(demo_file, demo_local, tmp_path):
    """The node read first has its QP in the error state (a WRITE its responder refused) before the
    client's first READ of a table: that READ fails, the node is failed over, and the gather is
    answered bit-exact by the other replica over rdma."""
    from prometheus_client import REGISTRY

    e = verbs().e
    a, b = replica_pair(tmp_path, demo_file, "rdma")
    try:
        client_id = client_id_reading("rdma-a", "rdma-b")
        with TableClient(
            f"{a.address},{b.address}", client_id=client_id, rdma_qps=1, rdma_ring_rows=256, **SLOW_CLIENT
        ) as c:
            assert c.replicas()[a.address]["transport"] == "rdma"
            failovers = REGISTRY.get_sample_value("tableserver_client_failovers_total") or 0
            t, _local, _wr = post_remote_write(c, 79)  # on node a's QP: the node this client reads first

            def qp_state():
                return t.qps[0].query(e.IBV_QP_STATE)[0].qp_state

            # the responder refused it: the QP is in the error state before the first READ is posted (its
            # failed completion still waits in the CQ, for that READ's wait to find)
            wait_for(lambda: qp_state() == e.IBV_QPS_ERR, lambda: f"the QP in the error state (now {qp_state()})")
            ids = np.arange(5, 70_001, 311)  # one request (225 rows)
            rows = c.table("engram.layer14").gather(ids, timeout=EVENT_TIMEOUT)
            np.testing.assert_array_equal(rows, demo_local["engram.layer14"][ids])
            assert isinstance(t.error, TransportError) and t.closed  # a's transport failed and was dropped
            assert REGISTRY.get_sample_value("tableserver_client_failovers_total") > failovers
            assert c.replicas()[b.address]["transport"] == "rdma"
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
def test_table_with_offsets_over_4gib(tmp_path):
    rows = 17_000_000  # x 264 B = 4.18 GiB
    boundary = (1 << 32) // 264
    real = [(0, 2000), (boundary - 2000, boundary + 2000), (rows - 2000, rows)]
    path = str(tmp_path / "large.bin")
    table = DemoTable("big", rows, 264, 1)
    # 1 MiB checksum chunks: the chunks around the real rows are hashed whole, zeros and all, when the file is
    # written and again when the daemon verifies it (64 MiB ones: 17.8 s and 16.6 s of the guest; 1.2 s and 2.9 s)
    with TableFileWriter(path, [table.spec()], chunk_bytes=1 << 20) as w:
        gen, pos = DemoRows(table), 0
        for a, b in real:
            w.skip(0, a - pos)
            w.append(0, gen.rows(a, b))
            pos = b
        w.fill_zeros(0)
    try:
        with open("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "w") as f:
            f.write("2200")  # hugepages: far fewer pages to pin for the 4 GiB MR
    except OSError:
        pass
    d = guest_daemon(str(tmp_path / "d"), "--tables", path, "--transports", "rdma", "--no-mlock")
    try:
        local = local_tables(path)["big"]
        rng = np.random.default_rng(0)
        ids = np.concatenate([rng.integers(a, b, 300) for a, b in real] + [np.arange(boundary - 2, boundary + 3)])
        assert (ids * 264 >= 1 << 32).sum() >= 400  # half the boundary rows, all the tail rows
        for mode in MODES:
            with TableClient(d.address, transport="rdma", mode=mode, rdma_ring_rows=512, **SLOW_CLIENT) as c:
                rows = c.table("big").gather(ids, timeout=EVENT_TIMEOUT)
                np.testing.assert_array_equal(rows, local[ids])
                assert rows[-1].any()
    finally:
        d.stop()
        os.unlink(path)


@pytest.fixture(scope="module")
def disk_daemon(demo_file, tmp_path_factory):
    """Layer 14 and dense.f32 on disk, the rest in memory, rdma only: one daemon for both modes' tests (their
    counts are lower bounds, its registered bytes do not change)."""
    d = guest_daemon(str(tmp_path_factory.mktemp("disk")), "--tables", demo_file, "--transports", "rdma",
                     "--disk-tables", "engram.layer14,dense.f32")  # fmt: skip
    yield d
    d.stop()


@pytest.mark.parametrize("mode", MODES)
def test_disk_tables_over_rdma_are_packed(disk_daemon, demo_local, mode):
    """Layer 14 on disk, layer 1 in memory, one rdma session: the disk table's gathers go packed whatever
    the mode (no READ on a table without memory), the memory table's by ``mode``; all bit-exact."""
    with TableClient(disk_daemon.address, transport="rdma", mode=mode, rdma_ring_rows=512, **SLOW_CLIENT) as c:
        assert c.transport == "rdma"
        rng = np.random.default_rng(11)
        for name in ("engram.layer14", "dense.f32", "engram.layer1"):
            t = c.table(name)
            assert t.info.tier == ("memory" if name == "engram.layer1" else "disk")
            for n in (1, 24, 1536, 5000):
                ids = rng.integers(0, t.rows, n)
                ids[0], ids[-1] = 0, t.rows - 1
                np.testing.assert_array_equal(t.gather(ids, timeout=EVENT_TIMEOUT), demo_local[name][ids], err_msg=name)
                np.testing.assert_array_equal(t.gather_async(ids).wait(EVENT_TIMEOUT), demo_local[name][ids])
    m = scrape(disk_daemon.ready["metrics"])
    assert value(m, "tableserver_disk_gathers_total", table="engram.layer14") >= 8
    assert value(m, "tableserver_gather_rows_total", transport="rdma", op="pack", table="engram.layer14") > 0
    assert value(m, "tableserver_rdma_registered_bytes") == sum(
        demo_local[n].nbytes for n in ("engram.layer1", "tiny")
    )  # the disk tables' bytes are not registered: they are not in memory
