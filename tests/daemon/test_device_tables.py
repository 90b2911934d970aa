"""Graph mode ``device`` on the CPU: a node table (a real daemon's sealed memfd, mapped over shm) read by the
graph's own kernel (tableclient.graph.device.kernel, run by Triton's interpreter on CPU tensors), through GraphStep
and DeviceTable. Every row is checked bit-exact against the table file; a daemon restarted on the same
data is mapped and pointed at anew, one restarted on other data is never read, and a table the GPU cannot
read here takes before_replay with one line saying why.
"""

from __future__ import annotations

import logging
import signal

import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, local_tables, start_daemon, wait_for
from prometheus_client import REGISTRY
from tests_helpers import free_port_block

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tableclient import TableClient  # noqa: E402
from tableclient.graph.device.table import DeviceTable, DeviceTableUnavailable, gather, memlock_refusal  # noqa: E402
from tableclient.graph.step import GraphStep, GraphStepError, HostStreamOps  # noqa: E402
from tableclient.metrics import metrics  # noqa: E402
from tableclient.step import LayerPlan  # noqa: E402

from tableserver.tables.demo import DemoTable, write_demo_file  # noqa: E402

PLANS = [LayerPlan(1, "engram.layer1", 0.3e-3), LayerPlan(14, "engram.layer14", 9.3e-3)]
MAX_TOKENS = 64
TABLES = [DemoTable("engram.layer1", 20_000, 264, 1), DemoTable("engram.layer14", 30_001, 264, 14)]


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two versions of the same tables: same names and sizes, other rows."""
    folder = tmp_path_factory.mktemp("versions")
    return [write_demo_file(str(folder / f"v{seed}.bin"), TABLES, seed=seed) for seed in (11, 12)]


def node(tmp_path, name: str, tables: str, port: int, *flags):
    return start_daemon(
        str(tmp_path / name), "--tables", tables, "--listen", f"127.0.0.1:{port}", "--node-id", name, *flags
    )


def make(client, modes, **kw):
    kw.setdefault("timeout", 10.0)
    return GraphStep(client, PLANS, modes, MAX_TOKENS, stream_ops=HostStreamOps(EVENT_TIMEOUT), **kw)


def step(g: GraphStep, ids: dict, tokens: int) -> dict:
    """One replay as the captured graph runs it: before_replay layers gathered on the host, arm, then the
    graph's side (ids published after the hasher, layer 1 first; each layer's rows)."""
    g.before_replay({layer: ids[layer][:tokens] for layer in g.layers if g.modes[layer] == "before_replay"})
    g.arm(tokens)
    for layer in g.layers:
        g.publish_ids(layer, torch.from_numpy(ids[layer][:tokens]))
    out = {layer: g.rows(layer, tokens).clone().numpy().reshape(tokens, 24, -1) for layer in g.layers}
    g.after_replay()
    return out


def random_ids(rng, local, tokens):
    return {p.layer: rng.integers(0, local[p.table].shape[0], (tokens, 24)) for p in PLANS}


@pytest.mark.parametrize(
    "modes",
    [{1: "device", 14: "device"}, {1: "device", 14: "in_graph"}, {1: "before_replay", 14: "device"}],
    ids=["both_device", "device_and_in_graph", "before_replay_and_device"],
)
def test_device_layers_are_gathered_by_the_kernel_bit_exact_from_the_nodes_mapping(daemon, demo_file, modes):
    local = local_tables(demo_file)
    with TableClient(daemon.address, transport="shm") as c:
        g = make(c, modes)
        try:
            assert g.modes == {layer: modes[layer] for layer in (1, 14)}  # registered, not demoted
            for t in g.device_tables.values():  # the kernel reads the mapping the client reads
                assert int(t.pointer[0]) == c.reader(t.name).local().ctypes.data
            before = g.buffers()
            rng = np.random.default_rng(5)
            for tokens in [1, 2, 8, 64, 3, 64, 1] * 3:
                ids = random_ids(rng, local, tokens)
                out = step(g, ids, tokens)
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
            assert g.buffers() == before  # nothing a graph touches was allocated or moved
        finally:
            g.close()
        assert all(t.error == "closed" for t in g.device_tables.values())


def test_the_kernel_reads_nothing_outside_the_table_and_fills_dead_ids_with_zeros(daemon, demo_file):
    local = local_tables(demo_file)
    with TableClient(daemon.address, transport="shm") as c:
        t = DeviceTable(c, "engram.layer14", "cpu")
        rows = local["engram.layer14"].shape[0]
        ids = torch.tensor([0, rows - 1, -1, rows, 2**40, 7])
        out = torch.full((8, 264), 0xAB, dtype=torch.uint8)
        gather(t, ids, out)
        got = out.numpy()
        np.testing.assert_array_equal(got[[0, 1, 5]], local["engram.layer14"][[0, rows - 1, 7]])
        assert not got[2:5].any()  # a dead id and ids outside the table: zero rows, nothing read
        assert (got[6:] == 0xAB).all()  # past N: untouched
        with pytest.raises(ValueError, match="out must be uint8"):
            gather(t, ids, torch.zeros((8, 260), dtype=torch.uint8))
        t.close()
        t.close()  # idempotent


@pytest.mark.parametrize("row_bytes", [264, 260, 33])
def test_the_kernel_gathers_rows_in_every_word_size(tmp_path, row_bytes):
    """8-, 4- and 1-byte words (a row of 264, 260 and 33 bytes): each bit-exact."""
    path = write_demo_file(str(tmp_path / "w.bin"), [DemoTable("t", 5_000, row_bytes, -1)], seed=3)
    d = start_daemon(str(tmp_path / "d"), "--tables", path)
    try:
        with TableClient(d.address, transport="shm") as c:
            t = DeviceTable(c, "t", "cpu")
            ids = torch.from_numpy(np.random.default_rng(1).integers(0, 5_000, 300))
            out = torch.zeros((300, row_bytes), dtype=torch.uint8)
            gather(t, ids, out)
            np.testing.assert_array_equal(out.numpy(), local_tables(path)["t"][ids.numpy()])
    finally:
        d.stop()


def zero_rows(layer: int) -> float:
    metrics()  # registered in the default registry on first use
    return REGISTRY.get_sample_value("tableserver_client_zero_rows_served_total", {"layer": str(layer)}) or 0.0


@pytest.mark.parametrize("policy", ["zeros", "fail"])
def test_a_node_restart_is_registered_anew_and_other_data_is_never_read(tmp_path, versions, policy):
    """The daemon killed: the table is unreadable (the policy: zero rows, or the step refused before its
    replay); restarted on the same data: mapped anew, the pointer rewritten, bit-exact again (no
    recapture: same buffers); restarted on other data: refused by the client's pinned checksum, so the
    kernel never reads a row of it."""
    v1, v2 = versions
    local, other = local_tables(v1), local_tables(v2)
    port = free_port_block()
    daemons = [node(tmp_path, "a", v1, port)]
    d = daemons[0]
    rng = np.random.default_rng(9)
    with TableClient(d.address, transport="shm") as c:
        g = make(c, {1: "device", 14: "device"}, policy=policy)
        try:
            before = g.buffers()
            ids = random_ids(rng, local, 8)
            out = step(g, ids, 8)
            np.testing.assert_array_equal(out[14], local["engram.layer14"][ids[14]])
            first = {layer: t.generation for layer, t in g.device_tables.items()}

            d.stop(signal.SIGKILL)
            wait_for(lambda: c.replicas()[d.address]["state"] == "down", "the client to notice the loss")
            ids = random_ids(rng, local, 8)
            zeros = zero_rows(14)
            if policy == "fail":
                with pytest.raises(GraphStepError, match="is not mapped in this process.*policy fail"):
                    g.arm(8)
                g.reset()
            else:
                out = step(g, ids, 8)
                assert not out[1].any() and not out[14].any()
                assert zero_rows(14) == zeros + 1  # one step served zero rows
            assert all(int(t.pointer[0]) == 0 for t in g.device_tables.values())

            d = node(tmp_path, "a2", v1, port)  # the same data, restarted: a new memfd, a new mapping
            daemons.append(d)
            wait_for(lambda: c.replicas()[d.address]["state"] == "up", "the client to reconnect")
            ids = random_ids(rng, local, 8)
            out = step(g, ids, 8)
            for p in PLANS:
                np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
            for layer, t in g.device_tables.items():  # registered anew (the address itself may be reused)
                assert t.generation > first[layer] + 1 and int(t.pointer[0]) == c.reader(t.name).local().ctypes.data
            assert g.buffers() == before

            d.stop(signal.SIGKILL)
            d = node(tmp_path, "a3", v2, port)  # same names and sizes, other rows
            daemons.append(d)
            wait_for(lambda: c.replicas()[d.address]["state"] == "refused", lambda: f"a refusal: {c.replicas()}")
            ids = random_ids(rng, local, 8)
            if policy == "fail":
                with pytest.raises(GraphStepError, match="policy fail"):
                    g.arm(8)
                g.reset()
            else:
                out = step(g, ids, 8)
                assert not out[14].any()
                assert not np.array_equal(out[14], other["engram.layer14"][ids[14]])
        finally:
            g.close()
            for each in daemons:
                each.stop()


def test_a_table_the_gpu_cannot_read_here_takes_before_replay_with_one_line(daemon, demo_file, caplog):
    """Over tcp nothing is mapped in this process: the device layer falls back to before_replay, saying why
    in one line, and its rows are still bit-exact."""
    local = local_tables(demo_file)
    with caplog.at_level(logging.WARNING, logger="tableclient.graph"):
        with TableClient(daemon.address, transport="tcp") as c:
            with pytest.raises(DeviceTableUnavailable, match="not mapped in this process"):
                DeviceTable(c, "engram.layer1", "cpu")
            g = make(c, {1: "device", 14: "device"})
            try:
                assert g.modes == {1: "before_replay", 14: "before_replay"} and not g.device_tables
                ids = random_ids(np.random.default_rng(2), local, 16)
                out = step(g, ids, 16)
                for p in PLANS:
                    np.testing.assert_array_equal(out[p.layer], local[p.table][ids[p.layer]])
            finally:
                g.close()
    lines = [r.getMessage() for r in caplog.records if "graph mode 'device' unavailable" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in line and "not mapped in this process" in line for line in lines)


def test_policy_fallback_keeps_device_layers_on_the_host(daemon, demo_file):
    with TableClient(daemon.address, transport="shm") as c, TableClient(daemon.address, transport="tcp") as fb:
        g = make(c, {1: "device"}, policy="fallback", fallback=fb)
        try:
            assert g.modes[1] == "before_replay"
        finally:
            g.close()


def test_memlock_limit_below_the_table_is_one_line_naming_the_fix():
    assert memlock_refusal(2**30, limit=2**40, euid=1000) is None
    assert memlock_refusal(2**30, limit=2**20, euid=0) is None  # root: CAP_IPC_LOCK
    why = memlock_refusal(3 * 2**30, limit=64 * 2**20, euid=1000)
    assert "3.00 GiB" in why and "ulimit -l unlimited" in why and "\n" not in why


def test_the_next_step_armed_while_the_last_is_still_queued_reads_its_own_ids(daemon, demo_file):
    """SGLang's overlap scheduler arms step k+1 before step k's graph ran: a device layer keeps no host state
    per step (arm only checks the mapping), so both steps, replayed in order afterwards, are bit-exact."""
    local = local_tables(demo_file)
    with TableClient(daemon.address, transport="shm") as c:
        g = make(c, {1: "device", 14: "device"})
        try:
            rng = np.random.default_rng(16)
            for _ in range(3):
                first, second = random_ids(rng, local, 4), random_ids(rng, local, 9)
                g.arm(4)
                g.arm(9)  # step k+1, launched by the CPU ahead of the GPU
                for ids, tokens in ((first, 4), (second, 9)):  # the GPU runs k, then k+1
                    for layer in g.layers:
                        g.publish_ids(layer, torch.from_numpy(ids[layer]))
                    for p in PLANS:
                        got = g.rows(p.layer, tokens).clone().numpy().reshape(tokens, 24, -1)
                        np.testing.assert_array_equal(got, local[p.table][ids[p.layer]])
        finally:
            g.close()
