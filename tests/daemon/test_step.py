"""The step API against real daemons: order, fixed buffers, deadlines, failure policies, CUDA staging."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from conftest import EVENT_TIMEOUT, wait_for
from tableclient import TableClient, TableClientError
from tableclient.step import EngramStep, LayerPlan

PLANS = [LayerPlan(14, "engram.layer14", 9.3e-3), LayerPlan(1, "engram.layer1", 0.3e-3)]


def _ids(rng, t=64):
    return {1: rng.integers(0, 50_000, (t, 24)), 14: rng.integers(0, 70_001, (t, 24))}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_order_fixed_buffers_and_bit_exact_rows(daemon, demo_local, transport):
    with TableClient(daemon.address, transport=transport) as c:
        step = EngramStep(c, PLANS, max_tokens=64)
        addresses = {layer: buf.data_ptr() for layer, buf in step.staging.items()}
        rng = np.random.default_rng(0)
        for t in (64, 17, 64):
            ids = _ids(rng, t)
            step.begin_step(ids)
            assert step.issue_order == [1, 14]  # shortest window first, whatever order the plans came in
            for layer, name in ((1, "engram.layer1"), (14, "engram.layer14")):
                rows = step.wait(layer)
                assert isinstance(rows, torch.Tensor) and tuple(rows.shape) == (t, 24, 264)
                assert rows.data_ptr() == addresses[layer]  # a view of the persistent staging buffer
                np.testing.assert_array_equal(rows.numpy(), demo_local[name][ids[layer]])
        assert {layer: b.data_ptr() for layer, b in step.staging.items()} == addresses
        assert step.summary()[1]["steps"] == 3


def test_fenced_reads_of_the_staging_are_waited_for_once(daemon):
    """Events handed to fence() (a caller's own copy out of the staging) are synchronized by the next
    begin_step, before it refills the buffers, and only by that one."""

    class Event:
        def __init__(self):
            self.synced = 0

        def synchronize(self):
            self.synced += 1

    with TableClient(daemon.address, transport="shm") as c:
        step = EngramStep(c, PLANS, max_tokens=8, pin=False)
        rng = np.random.default_rng(5)
        step.begin_step(_ids(rng, 8))
        step.wait(1)
        step.wait(14)
        first, second = Event(), Event()
        with pytest.raises(TypeError, match="synchronize"):
            step.fence(object())  # refused at once, not at the next begin_step
        step.fence(first)
        step.fence(second)
        assert first.synced == second.synced == 0
        step.begin_step(_ids(rng, 8))
        assert first.synced == second.synced == 1
        step.wait(1)
        step.wait(14)
        step.begin_step(_ids(rng, 8))
        assert first.synced == second.synced == 1


def test_deadline_accounting(daemon):
    with TableClient(daemon.address, transport="tcp") as c:
        plans = [LayerPlan(1, "engram.layer1", 0.0), LayerPlan(14, "engram.layer14", 3600.0)]
        step = EngramStep(c, plans, max_tokens=64)
        rng = np.random.default_rng(1)
        for _ in range(5):
            step.begin_step(_ids(rng))
            step.wait(1)
            step.wait(14)
        s = step.summary()
        assert s[1]["deadline_misses"] == 5 and s[14]["deadline_misses"] == 0  # nothing lands in 0 s; all in an hour
        assert 0 < s[1]["p50_s"] <= s[14]["p99_s"] < 3600


def test_bad_input(daemon):
    with TableClient(daemon.address, transport="tcp") as c:
        step = EngramStep(c, PLANS, max_tokens=8)
        with pytest.raises(ValueError, match="holds 8"):
            step.begin_step({1: np.zeros((9, 24), np.int64), 14: np.zeros((9, 24), np.int64)})
        with pytest.raises(ValueError, match="out of range"):
            step.begin_step({1: np.full((2, 24), 10**9), 14: np.zeros((2, 24), np.int64)})
        with pytest.raises(ValueError, match="policy"):
            EngramStep(c, PLANS, 8, policy="pray")
        with pytest.raises(ValueError, match="fallback="):
            EngramStep(c, PLANS, 8, policy="fallback")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dead_ids_are_never_sent_and_their_rows_are_zero(daemon, demo_local, transport):
    """``dead_id`` (vLLM's DEAD_ID): a step mixing live and dead ids asks for the live ids alone (the client's
    own count of row ids says so), over shm's take in begin_step and gathers alike and in gather_now, and
    hands back zeros for the dead ones; a step of dead ids alone asks for nothing."""
    from tests_helpers import client_rows

    names = {1: "engram.layer1", 14: "engram.layer14"}
    with TableClient(daemon.address, transport=transport) as c:
        step = EngramStep(c, PLANS, max_tokens=64, dead_id=-1)
        ids = _ids(np.random.default_rng(9), 40)
        for layer_ids in ids.values():
            layer_ids[3] = -1  # a padded token
            layer_ids[7, ::4] = -1  # and single columns
        live = {layer: int((v != -1).sum()) for layer, v in ids.items()}

        def asked():
            return {layer: client_rows(name, layer, transport) for layer, name in names.items()}

        before = asked()
        step.begin_step(ids)
        for layer, name in names.items():
            rows, dead = step.wait(layer).numpy(), ids[layer] == -1
            assert not rows[dead].any()
            np.testing.assert_array_equal(rows[~dead], demo_local[name][ids[layer][~dead]])
        now = asked()
        assert {layer: now[layer] - before[layer] for layer in names} == live
        rows = step.gather_now(14, ids[14])
        assert not rows[ids[14] == -1].any()
        np.testing.assert_array_equal(rows[ids[14] != -1], demo_local[names[14]][ids[14][ids[14] != -1]])
        assert asked()[14] - now[14] == live[14]
        now = asked()
        step.begin_step({layer: np.full((5, 24), -1) for layer in names})
        assert not step.wait(1).numpy().any() and not step.wait(14).numpy().any()
        assert asked() == now


@pytest.mark.parametrize("policy", ["fail", "zeros", "fallback"])
def test_failure_policy_with_the_server_killed_mid_step(fresh_daemon, demo_local, policy):
    primary = fresh_daemon()
    backup = fresh_daemon() if policy == "fallback" else None
    c = TableClient(primary.address, transport="tcp")
    fb = TableClient(backup.address, transport="tcp") if backup else None
    try:
        step = EngramStep(c, PLANS, max_tokens=64, policy=policy, fallback=fb, timeout=EVENT_TIMEOUT)
        rng = np.random.default_rng(2)
        step.begin_step(_ids(rng))
        step.wait(1), step.wait(14)
        primary.stop(signal.SIGKILL)  # the memory node dies between steps
        ids = _ids(rng)
        step.begin_step(ids)
        if policy == "fail":
            with pytest.raises(TableClientError):
                step.wait(1)
            return
        rows1 = step.wait(1)
        rows14 = step.wait(14)
        if policy == "zeros":
            assert not rows1.numpy().any() and not rows14.numpy().any()
            assert step.summary()[1]["zeros_served"] == 1 and step.summary()[14]["zeros_served"] == 1
        else:
            np.testing.assert_array_equal(rows1.numpy(), demo_local["engram.layer1"][ids[1]])
            np.testing.assert_array_equal(rows14.numpy(), demo_local["engram.layer14"][ids[14]])
            assert step.summary()[1]["fallbacks"] == 1
    finally:
        c.close()
        if fb:
            fb.close()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@requires_cuda
def test_cuda_staging_and_graph_capture_of_the_copy(daemon, demo_local):
    """Pinned staging, copy to a persistent device tensor on a side stream, and a CUDA graph of that copy."""
    with TableClient(daemon.address, transport="shm") as c:
        step = EngramStep(c, PLANS, max_tokens=64, device="cuda")
        assert all(b.is_pinned() for b in step.staging.values())
        rng = np.random.default_rng(3)
        ids = _ids(rng)
        step.begin_step(ids)
        dev, event = step.wait_to_device(1)
        event.synchronize()
        np.testing.assert_array_equal(dev.cpu().numpy(), demo_local["engram.layer1"][ids[1]])
        step.wait(14)
        # Capture only the H2D copy from the fixed staging into the fixed device tensor; replay each step.
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(graph):
                step.device_rows[14].copy_(step.staging[14], non_blocking=True)
        for _ in range(3):
            ids = _ids(rng)
            step.begin_step(ids)
            step.wait(1)
            step.wait(14)
            graph.replay()
            torch.cuda.synchronize()
            np.testing.assert_array_equal(step.device_rows[14].cpu().numpy(), demo_local["engram.layer14"][ids[14]])


@requires_cuda
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_device_copies_wait_for_readers_and_staging_waits_for_copies(daemon, demo_local, transport):
    """Over shm, layer 1 (gathered in begin_step) is already on its way to the GPU when begin_step returns.
    A step's copy into the device tensors waits for the work queued before it on the caller's stream (a
    reader of the previous step's rows), and the next begin_step refills the staging only once the copy
    out of it finished: the GPU is held busy for ~0.1 s on the caller's stream to make both races real."""
    expect = demo_local["engram.layer1"]
    with TableClient(daemon.address, transport=transport) as c:
        step = EngramStep(c, PLANS, max_tokens=64, device="cuda")
        rng = np.random.default_rng(4)
        a, b, cc = _ids(rng), _ids(rng), _ids(rng)
        step.begin_step(a)
        assert step.copy_queued(1) == (transport == "shm")
        dev, event = step.wait_to_device(1)
        step.wait(14)
        torch.cuda.current_stream().wait_event(event)
        held_a = dev.clone()  # on the caller's stream, after a's copy
        torch.cuda._sleep(200_000_000)  # the caller's stream stays busy, then reads a's rows again
        reread_a = dev.clone()
        step.begin_step(b)  # b's copy must wait for both reads of a's rows
        dev_b, event_b = step.wait_to_device(1)
        torch.cuda.current_stream().wait_event(event_b)
        held_b = dev_b.clone()
        step.wait(14)
        torch.cuda._sleep(200_000_000)
        step.begin_step(cc)  # over shm: refills the staging only after b's copy (queued behind the sleep)
        dev_c, event_c = step.wait_to_device(1)
        step.wait(14)
        event_c.synchronize()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(held_a.cpu().numpy(), expect[a[1]])
        np.testing.assert_array_equal(reread_a.cpu().numpy(), expect[a[1]])
        np.testing.assert_array_equal(held_b.cpu().numpy(), expect[b[1]])
        np.testing.assert_array_equal(dev_c.cpu().numpy(), expect[cc[1]])


@requires_cuda
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_late_layers_copy_does_not_wait_for_the_steps_earlier_layers(daemon, demo_local, transport):
    """Layer 14's copy (queued by wait_to_device, after layers 0..13 were queued on the caller's stream)
    waits only for what was queued before begin_step: it completes while a long kernel queued after
    begin_step still runs. Ordered by GPU timestamps (timing events), not by the host's clock."""
    with TableClient(daemon.address, transport=transport) as c:
        step = EngramStep(c, PLANS, max_tokens=64, device="cuda")
        ids = _ids(np.random.default_rng(6))
        step.begin_step(ids)
        start, end, copied = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        torch.cuda._sleep(1_000_000_000)  # "layers 0..13": ~0.5 s of one kernel on the caller's stream
        end.record()
        step.wait_to_device(1)
        dev, _ = step.wait_to_device(14)
        copied.record(step.copy_stream)
        torch.cuda.synchronize()
        assert start.elapsed_time(copied) < start.elapsed_time(end), "layer 14's copy waited for the kernel"
        np.testing.assert_array_equal(dev.cpu().numpy(), demo_local["engram.layer14"][ids[14]])


def test_a_step_does_not_keep_a_dead_nodes_tables_mapped(fresh_daemon, demo_local):
    """EngramStep reads each layer's mapping through the table's reader, which keeps it between steps
    until a replica changes: once the memory node dies, the client releases its table memory without
    another step, and the next step fails cleanly instead of reading the old mapping."""
    d = fresh_daemon()
    c = TableClient(d.address, transport="shm")
    maps = lambda: [ln for ln in open(f"/proc/{os.getpid()}/maps") if "tableserver:" in ln]  # noqa: E731
    try:
        step = EngramStep(c, PLANS, max_tokens=8, timeout=EVENT_TIMEOUT)
        rng = np.random.default_rng(4)
        for _ in range(2):  # the second step reads the remembered mapping
            ids = _ids(rng, 8)
            step.begin_step(ids)
            np.testing.assert_array_equal(np.asarray(step.wait(1)), demo_local["engram.layer1"][ids[1]])
            step.wait(14)
        reader = step.tables[1].reader
        assert reader.local() is not None and reader.route() is reader.route()  # layer 1 mapped, remembered
        assert maps()
        d.stop(signal.SIGKILL)
        wait_for(lambda: not maps(), "the mapping of the dead server's tables to be released")
        step.begin_step(_ids(rng, 8))
        with pytest.raises(TableClientError):
            step.wait(1)
    finally:
        c.close()
