"""Gathers through each transport of a real daemon, bit-exact with local table[row_ids]."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EVENT_TIMEOUT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tableclient import GatherTimeout, TableClient, TableClientError

TRANSPORTS = ["shm", "tcp"]


@pytest.fixture(scope="module", params=TRANSPORTS + ["shm, numpy take"])
def client(request, daemon):
    """Each transport; shm once more with numpy's take (what runs where the native one was not built)."""
    transport = request.param.split(",")[0]
    with pytest.MonkeyPatch.context() as mp:
        if request.param.endswith("numpy take"):
            import tableclient.table

            import tableserver.common.take

            mp.setattr(tableclient.table, "native_take", None)
            mp.setattr(tableserver.common.take, "native_check", None)
            mp.setattr(tableserver.common.take, "take", tableserver.common.take.numpy_take)
        with TableClient(daemon.address, transport=transport) as c:
            assert c.transport == transport
            yield c


def test_catalog_matches_file(client, demo_file, demo_local):
    from tableserver.tables.tablefile import read_header

    header = read_header(demo_file)
    assert list(client.tables) == [s.name for s in header.tables]
    for spec in header.tables:
        info = client.tables[spec.name]
        assert (info.rows, info.row_bytes, info.layer, info.checksum) == (
            spec.rows,
            spec.row_bytes,
            spec.layer,
            spec.checksum,
        )
        assert info.checksum.startswith("sha256:")
    assert client.server.host_id and client.server.max_rows_per_request == 65536
    assert client.table(layer=14).name == "engram.layer14"


@pytest.mark.parametrize("name", ["engram.layer1", "engram.layer14", "dense.f32", "tiny"])
def test_random_ids_bit_exact(client, demo_local, name):
    table = client.table(name)
    local = demo_local[name]
    rng = np.random.default_rng(1)
    for shape in [(1,), (1536,), (64, 24), (2, 3, 8)]:
        ids = rng.integers(0, table.rows, size=shape)
        rows = table.gather(ids)
        assert rows.dtype == np.uint8 and rows.shape == shape + (table.row_bytes,)
        np.testing.assert_array_equal(rows, local[ids])


def test_one_layers_slice_of_step_ids(client, demo_local):
    """A layer's ids as the hasher hands them out: a strided view ``ids[:, i]`` of ``[T, layers, 24]``,
    into a caller's ``out`` (the shm fast path compacts it once) and into one the library allocates."""
    table = client.table("engram.layer1")
    step_ids = np.random.default_rng(5).integers(0, table.rows, size=(64, 2, 24))
    for i in range(2):
        ids = step_ids[:, i]
        assert not ids.flags.c_contiguous
        out = np.empty(ids.shape + (table.row_bytes,), np.uint8)
        assert table.gather(ids, out=out) is out
        np.testing.assert_array_equal(out, demo_local[table.name][ids])
        np.testing.assert_array_equal(table.gather(ids), demo_local[table.name][ids])


def test_first_last_duplicates_empty(client, demo_local):
    table = client.table("engram.layer14")
    local = demo_local[table.name]
    last = table.rows - 1
    ids = np.array([0, last, 0, last, 5, 5, 5, last])
    np.testing.assert_array_equal(table.gather(ids), local[ids])
    np.testing.assert_array_equal(table.gather(np.full((4, 6), 3)), local[np.full((4, 6), 3)])
    for empty in (np.zeros(0, np.int64), np.zeros((0, 24), np.int64), []):
        out = table.gather(empty)
        assert out.shape == np.asarray(empty).shape + (264,)


def test_zipfian_ids(client, demo_local):
    table = client.table("engram.layer1")
    ids = (np.random.default_rng(3).zipf(1.3, size=(64, 24)) - 1) % table.rows
    np.testing.assert_array_equal(table.gather(ids), demo_local[table.name][ids])


def test_other_integer_dtypes(client, demo_local):
    table = client.table("engram.layer1")
    for dtype in (np.int32, np.uint32, np.uint16, np.int64, np.uint64):
        ids = np.arange(0, 40, 3).astype(dtype)
        np.testing.assert_array_equal(table.gather(ids), demo_local[table.name][ids.astype(np.int64)])
    np.testing.assert_array_equal(table.gather([1, 2, 3]), demo_local[table.name][[1, 2, 3]])


def test_an_async_gather_another_thread_read_leaves_the_receiver_its_count(daemon, demo_local, monkeypatch):
    """Between an async gather's send and its hand-over to the receiver thread, another thread's synchronous
    read can take its response (responses come in order). That read used to count the request off the
    receiver's before the hand-over counted it on: the count went below zero, and the receiver slept
    through the next asynchronous request, whose waiter hung (seen once in a busy CI run)."""
    import threading

    from tableclient.transports import tcp

    # The race is between two steps inside one gather (its send, its hand-over): no public seam can hold it there.
    hand_over = tcp.TcpTransport._hand_over  # private: the step the patch below holds
    paused, go = threading.Event(), threading.Event()

    def slow_hand_over(self, p):
        if threading.current_thread().name == "first-async":  # sent, not yet handed over: held here
            paused.set()
            go.wait(EVENT_TIMEOUT)
        return hand_over(self, p)

    monkeypatch.setattr(tcp.TcpTransport, "_hand_over", slow_hand_over)  # private: holds a gather there
    with TableClient(daemon.address, transport="tcp", liveness_timeout=600.0) as c:
        table = c.table("engram.layer1")
        expect = demo_local[table.name]
        rng = np.random.default_rng(9)
        first, second, third = (rng.integers(0, table.rows, 500) for _ in range(3))
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("h", table.gather_async(first)), name="first-async")
        t.start()
        assert paused.wait(EVENT_TIMEOUT)
        np.testing.assert_array_equal(table.gather(second), expect[second])  # reads the first response too
        go.set()
        t.join(EVENT_TIMEOUT)
        np.testing.assert_array_equal(box["h"].wait(timeout=EVENT_TIMEOUT), expect[first])
        # the receiver thread must read this one (before the fix it slept: GatherTimeout)
        np.testing.assert_array_equal(table.gather_async(third).wait(timeout=30.0), expect[third])


def test_torch_ids_and_outputs_are_checked_as_numpys_are():
    """The table layer's checks on torch tensors, before any request: float ids refused, integer ids
    taken as int64, an output made as a torch tensor when torch came in, a torch output of another dtype
    refused; the pinned rows buffer starts OFFSET bytes into a page."""
    from tableclient.rowids import prepare_out, to_row_ids

    from tableserver.common.buffers import OFFSET, PAGE, pinned_rows_buffer

    with pytest.raises(ValueError, match="must be integers"):
        to_row_ids(torch.tensor([1.0]), 10, "t")
    ids, torch_in = to_row_ids(torch.arange(4), 10, "t")
    assert torch_in and ids.dtype == np.int64 and ids.tolist() == [0, 1, 2, 3]
    _, res = prepare_out(None, (2,), 8, torch_in=True)
    assert isinstance(res, torch.Tensor)
    with pytest.raises(ValueError):
        prepare_out(torch.zeros((2, 3, 8), dtype=torch.int16), (2, 3), 8, torch_in=False)
    t = pinned_rows_buffer(torch, (8, 24), 264, pin=False)
    assert tuple(t.shape) == (8, 24, 264) and t.data_ptr() % PAGE == OFFSET and t.is_contiguous()
    assert t.numpy().ctypes.data == t.data_ptr()


def test_torch_in_torch_out(client, demo_local):
    table = client.table("engram.layer1")
    ids = torch.randint(0, table.rows, (8, 24), dtype=torch.int64)
    rows = table.gather(ids)
    assert isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8 and tuple(rows.shape) == (8, 24, 264)
    np.testing.assert_array_equal(rows.numpy(), demo_local[table.name][ids.numpy()])
    out = torch.empty((8, 24, 264), dtype=torch.uint8)
    assert table.gather(ids, out=out) is out
    np.testing.assert_array_equal(out.numpy(), demo_local[table.name][ids.numpy()])


def test_rows_the_library_allocates_start_half_a_page_in(client):
    """Without ``out`` the rows land in a buffer placed like tableserver.common.buffers.copy_buffer (a socket's
    copy into it does not 4K-alias), with or without duplicates, as numpy or torch."""
    from tableserver.common.buffers import OFFSET, PAGE

    table = client.table("engram.layer1")
    for ids in (np.arange(1536) * 7, np.zeros((64, 24), np.int64)):
        rows = table.gather(ids)
        assert rows.shape == ids.shape + (264,) and rows.ctypes.data % PAGE == OFFSET
    torch = pytest.importorskip("torch")
    rows = table.gather(torch.arange(200))
    assert isinstance(rows, torch.Tensor) and rows.data_ptr() % PAGE == OFFSET
    few = table.gather(np.arange(3))  # a few rows: a plain array, no page more
    assert few.base is None or few.base.nbytes == few.nbytes


def test_out_buffer_is_filled_in_place(client, demo_local):
    table = client.table("engram.layer14")
    out = np.zeros((64, 24, 264), np.uint8)
    address = out.ctypes.data
    for seed in range(3):
        ids = np.random.default_rng(seed).integers(0, table.rows, size=(64, 24))
        ids[0, :4] = ids[1, :4]  # duplicates take the dedup path
        assert table.gather(ids, out=out) is out and out.ctypes.data == address
        np.testing.assert_array_equal(out, demo_local[table.name][ids])
    # every shape of ids, a 0-d id and an empty batch included, fills an ``out`` of ids.shape + (row_bytes,)
    for shape in ((), (1,), (9,), (3, 5), (2, 4, 3), (2, 0, 4)):
        ids = np.random.default_rng(7).integers(0, table.rows, size=shape)
        out = np.zeros(shape + (264,), np.uint8)
        assert table.gather(ids, out=out) is out
        np.testing.assert_array_equal(out, demo_local[table.name][ids])


def test_gather_many_in_order_and_async(client, demo_local):
    l1, l14 = client.table("engram.layer1"), client.table("engram.layer14")
    rng = np.random.default_rng(5)
    ids1, ids14 = rng.integers(0, l1.rows, (64, 24)), rng.integers(0, l14.rows, (64, 24))
    h1, h14 = client.gather_many([(l1, ids1), ("engram.layer14", ids14)])
    np.testing.assert_array_equal(h1.wait(timeout=EVENT_TIMEOUT), demo_local[l1.name][ids1])
    np.testing.assert_array_equal(h14.wait(timeout=EVENT_TIMEOUT), demo_local[l14.name][ids14])
    assert h1.done() and h14.done()
    handles = [l1.gather_async(rng.integers(0, l1.rows, 100)) for _ in range(16)]  # pipelined
    for h in handles:
        assert h.wait(timeout=EVENT_TIMEOUT).shape == (100, 264)


def test_more_rows_than_one_request(client, demo_local):
    """Gathers larger than max_rows_per_request are split and reassembled in order."""
    table = client.table("engram.layer14")
    ids = np.random.default_rng(9).integers(0, table.rows, 200_000)
    np.testing.assert_array_equal(table.gather(ids), demo_local[table.name][ids])


@pytest.mark.parametrize("bad", [10**12, -1, 2**63 - 1])
@pytest.mark.parametrize("size", [1, 40, 3000])
def test_bad_row_id_is_a_value_error_and_leaves_out_alone(client, demo_local, bad, size):
    """On every path (the shm take, the tcp direct path whose server does the check, the routed async
    path): a bad id anywhere in the batch raises ValueError naming it, ``out`` keeps its bytes, and the
    next gather on the same connection is still bit-exact."""
    table = client.table("engram.layer1")
    rows = table.info.rows
    ids = np.random.default_rng(size).integers(0, rows, size)
    ids[size // 2] = bad
    out = np.full((size, 264), 7, np.uint8)
    with pytest.raises(ValueError, match=f"row id {bad} is (out of range|negative)"):
        table.gather(ids, out=out)
    with pytest.raises(ValueError, match=f"row id {bad} is"):
        table.gather_async(ids.reshape(1, -1)).wait(EVENT_TIMEOUT)
    assert (out == 7).all()
    ids[size // 2] = rows - 1
    np.testing.assert_array_equal(table.gather(ids, out=out), demo_local[table.name][ids])


def test_shm_gather_async_survives_the_client_closing_before_the_wait(daemon, demo_local):
    """gather_async over shm queues a take on the transport's copy thread; a client closed before the
    wait still delivers those rows (the queued copy runs at close or at the wait, from a mapping the
    handle keeps alive), and a gather issued after the close is refused."""
    table_name = "engram.layer14"
    rng = np.random.default_rng(12)
    ids = [rng.integers(0, demo_local[table_name].shape[0], 5000) for _ in range(8)]
    c = TableClient(daemon.address, transport="shm")
    table = c.table(table_name)
    handles = [table.gather_async(i) for i in ids]
    c.close()
    for i, h in zip(ids, handles):
        np.testing.assert_array_equal(h.wait(timeout=EVENT_TIMEOUT), demo_local[table_name][i])
    with pytest.raises(TableClientError, match="closed"):
        table.gather_async(ids[0]).wait(timeout=EVENT_TIMEOUT)


def test_zero_timeout_raises_or_returns(client):
    table = client.table("engram.layer14")
    h = table.gather_async(np.arange(60_000))
    try:
        h.wait(timeout=0.0)
    except GatherTimeout:
        pass
    assert h.wait(timeout=EVENT_TIMEOUT).shape == (60_000, 264)


@pytest.mark.parametrize("transport", TRANSPORTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_bit_exact(transport, data, daemon, demo_local, request):
    client = request.getfixturevalue(f"property_client_{transport}")
    name = data.draw(st.sampled_from(sorted(demo_local)))
    table = client.table(name)
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    n = int(np.prod(shape))
    values = data.draw(
        st.lists(
            st.one_of(st.integers(0, table.rows - 1), st.sampled_from([0, table.rows - 1])), min_size=n, max_size=n
        )
    )
    ids = np.array(values, dtype=np.int64).reshape(shape)
    np.testing.assert_array_equal(table.gather(ids), demo_local[name][ids])


@pytest.fixture(scope="module")
def property_client_shm(daemon):
    with TableClient(daemon.address, transport="shm") as c:
        yield c


@pytest.fixture(scope="module")
def property_client_tcp(daemon):
    with TableClient(daemon.address, transport="tcp") as c:
        yield c


def test_auto_prefers_shm_on_the_same_host(daemon):
    with TableClient(daemon.address) as c:
        assert c.transport == "shm"


def test_auto_falls_back_to_tcp_when_shm_is_unreachable(fresh_daemon, demo_local):
    d = fresh_daemon("--transports", "shm,tcp")
    import os

    os.rename(d.ready["shm"], d.ready["shm"] + ".hidden")  # as if the socket lived in another mount namespace
    with TableClient(d.address) as c:
        assert c.transport == "tcp"
        ids = np.arange(10)
        np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])


@pytest.mark.parametrize("busy_poll", [0.0, 200e-6])
def test_tcp_sync_and_async_gathers_from_many_threads(daemon, demo_local, busy_poll):
    """One tcp connection, many threads: synchronous gathers are read by their callers' threads,
    asynchronous ones by the receiver thread, responses in order between them; every row bit-exact."""
    import threading

    # liveness: a busy machine (the suite on every CPU) must not make this a fail-over test
    with TableClient(daemon.address, transport="tcp", busy_poll=busy_poll, liveness_timeout=600.0) as c:
        table = c.table("engram.layer1")
        expect = demo_local[table.name]
        errors = []

        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for i in range(60):
                    ids = rng.integers(0, table.rows, int(rng.integers(1, 3000)))
                    if i % 3 == 0:
                        got = table.gather(ids)
                    elif i % 3 == 1:
                        got = table.gather_async(ids).wait(timeout=EVENT_TIMEOUT)
                    else:
                        h = table.gather_async(ids)
                        got2 = table.gather(ids[::-1])
                        np.testing.assert_array_equal(got2, expect[ids[::-1]])
                        got = h.wait(timeout=EVENT_TIMEOUT)
                    np.testing.assert_array_equal(got, expect[ids])
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(EVENT_TIMEOUT)
        assert not errors, errors[0]
        assert not any(t.is_alive() for t in threads)


def test_busy_poll_is_bounded():
    with pytest.raises(ValueError, match="busy_poll"):
        TableClient("127.0.0.1:1", busy_poll=1.0)


def test_tcp_request_refused_before_sending_leaves_the_connection_usable(daemon, demo_local):
    """A request the transport cannot send (a buffer numpy cannot hand to sendmsg) fails alone: it is not
    left waiting in the connection's queue, so the next responses still match their requests."""
    with TableClient(daemon.address, transport="tcp") as c:
        table = c.table("engram.layer1")
        ids = np.arange(0, 400, dtype=np.int64)
        with pytest.raises((ValueError, BufferError, TypeError)):
            c.node_transport().gather(0, ids[::2], np.empty((200, 264), np.uint8), True)
        for _ in range(3):
            np.testing.assert_array_equal(table.gather(ids[::-1]), demo_local[table.name][ids[::-1]])


def test_out_must_be_contiguous_and_writable_on_every_transport(client):
    """The same contract over shm (its inline fast path) and tcp: a strided or read-only ``out`` is a
    ValueError naming the requirement, and nothing is written."""
    table = client.table("engram.layer1")
    ids = np.arange(10, dtype=np.int64)
    strided = np.zeros((10, 528), np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        table.gather(ids, out=strided)
    frozen = np.zeros((10, 264), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        table.gather(ids, out=frozen)
    assert not strided.any() and not frozen.any()


def test_cancel_is_a_barrier_for_the_duplicate_expansion(daemon):
    """A gather of repeated ids fetches each distinct row once and expands them into ``out`` on the waiting
    thread. Before: cancel() neither stopped nor waited for that expansion, and rows of a cancelled gather
    kept landing in ``out`` after cancel() returned. Now not one row changes after cancel() returns."""
    from tests_helpers import rows_changed_after_cancel

    with TableClient(daemon.address, transport="tcp") as c:
        table = c.table("engram.layer14")
        # 60 distinct ids, fewer than dedup samples (64): deduplicated for sure, then a long expansion
        ids = np.random.default_rng(4).integers(0, 60, 200_000)
        changed = rows_changed_after_cancel(table, ids, 30)
    assert not any(changed), f"rows written after cancel() returned, per trial: {changed}"


def test_node_transport_names_the_table_it_does_not_know(client):
    """The one-node hook for tools: by table name, that table's node; an unknown name is one clear error."""
    assert client.node_transport("engram.layer1") is client.node_transport()
    with pytest.raises(KeyError, match="no table 'nope' on .*: it serves engram.layer1"):
        client.node_transport("nope")
