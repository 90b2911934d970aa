"""Health lifecycle, hugepage memory, and several client processes on one table copy."""

from __future__ import annotations

import os
import signal
import socket

import grpc
import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, start_daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tableclient import TableClient
from tests_helpers import run_workers

from tableserver.tables.tablefile import TableFileWriter, TableSpec
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_health_not_serving_until_loaded_then_serving_then_not_serving(tmp_path):
    path = str(tmp_path / "big.bin")
    with TableFileWriter(path, [TableSpec("big", (4 << 30) // 264, 264)]) as w:
        w.fill_zeros(0)  # 4 GiB to allocate, zero and lock: seconds, on any machine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = start_daemon(
        str(tmp_path / "d"), "--tables", path, "--listen", f"127.0.0.1:{port}", "--metrics-port", "0", wait=False
    )
    seen = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=EVENT_TIMEOUT
            )
            for resp in stream:
                seen.append(resp.status)
                if resp.status == NOT_SERVING and len(seen) == 1:
                    with pytest.raises(grpc.RpcError) as e:
                        pb_grpc.TableServiceStub(ch).GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in e.value.details()
                if resp.status == SERVING and SERVING not in seen[:-1]:
                    d.proc.send_signal(signal.SIGTERM)
                if resp.status == NOT_SERVING and SERVING in seen:
                    break
    except grpc.RpcError:
        pass  # the server may end the stream as it stops
    finally:
        d.stop()
    assert seen[0] == NOT_SERVING and SERVING in seen, seen
    assert seen[-1] == NOT_SERVING or d.proc.returncode == 0, seen
    assert d.proc.returncode == 0


HUGEPAGES = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"


@pytest.fixture
def reserved_hugepages():
    """Reserves 2 MiB hugepages for the test (root only), then restores the pool."""
    try:
        with open(HUGEPAGES) as f:
            before = int(f.read())
        with open(HUGEPAGES, "w") as f:
            f.write(str(before + 256))
        with open(HUGEPAGES) as f:
            got = int(f.read())
    except OSError as e:
        pytest.skip(f"cannot reserve hugepages here ({e.strerror}): needs root and a writable {HUGEPAGES}")
    if got < before + 160:
        with open(HUGEPAGES, "w") as f:
            f.write(str(before))
        pytest.skip(f"the kernel granted only {got - before} of 256 hugepages (memory fragmented)")
    yield got - before
    with open(HUGEPAGES, "w") as f:
        f.write(str(before))


def test_hugepage_backed_tables(fresh_daemon, reserved_hugepages, demo_local):
    d = fresh_daemon("--hugepages", "2m")
    assert "hugetlb-2M" in d.log()
    for transport in ("shm", "tcp"):
        with TableClient(d.address, transport=transport) as c:
            for name in demo_local:
                ids = np.random.default_rng(0).integers(0, c.tables[name].rows, 500)
                np.testing.assert_array_equal(c.table(name).gather(ids), demo_local[name][ids])


def test_six_client_processes_share_one_copy(daemon, demo_file):
    configs = [dict(transport=t) for t in ("shm", "tcp", "shm", "tcp", "tcp", "shm")]
    outcomes = run_workers(configs, daemon.address, demo_file, steps=150)
    assert outcomes == {i: "ok" for i in range(len(configs))}, outcomes


def test_server_memory_is_one_copy(daemon):
    """The daemon's resident memory stays near one copy of the tables, with clients attached."""
    pid = daemon.ready["pid"]
    with TableClient(daemon.address, transport="shm") as c:
        total = sum(t.nbytes for t in c.tables.values())
        c.table("engram.layer14").gather(np.arange(1000))
        with open(f"/proc/{pid}/status") as f:
            status = {
                line.split(":")[0]: int(line.split()[1]) * 1024
                for line in f
                if line.startswith(("Rss", "VmLck", "HugetlbPages"))
            }
    # tables on shmem pages, or on hugetlb pages when the machine has some reserved (--hugepages auto)
    resident = status["RssShmem"] + status.get("HugetlbPages", 0)
    assert status["VmLck"] >= total or status.get("HugetlbPages", 0) >= total  # pinned (hugetlb never pages out)
    assert total <= resident < total + (64 << 20)
    assert os.path.exists(daemon.ready["shm"])
