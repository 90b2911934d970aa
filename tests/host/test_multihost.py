"""Memory nodes and serving workers on separate hosts: each in its own network namespace.

Three replicas (or 2 shards x 2 replicas) of one table file, each a real daemon serving tcp on its own
address; the worker is tests/support/decode_client.py in a namespace of its own, running decode steps (both
layers at step start, hedged at half of each window) and checking every row against the file. Faults:
kill -9, packets dropped (iptables DROP: silence) or rejected (REJECT: resets), SIGSTOP, a restart with
other table data, shard nodes killed, DNS membership changes. After each, the worker must keep serving:
no failed step, no stale or foreign row.
"""

from __future__ import annotations

import signal

import netns
import pytest
from conftest import wait_for
from netns import PORT, Cluster, Worker
from tableclient.routing import rendezvous_score

from tableserver.tables.demo import DemoTable, write_demo_file

pytestmark = pytest.mark.slow
TABLES = [DemoTable("engram.layer1", 60_000, 264, 1), DemoTable("engram.layer14", 80_003, 264, 14)]


@pytest.fixture(scope="module", autouse=True)
def needs_namespaces():
    why = netns.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("multihost")
    return {
        "v1": write_demo_file(str(d / "v1.bin"), TABLES, seed=1),
        "v2": write_demo_file(str(d / "v2.bin"), TABLES, seed=2),
    }


def primary_of(client_id: str, names) -> str:
    return max(names, key=lambda n: rendezvous_score(client_id, n))


def assert_served(p: dict) -> None:
    assert p["mismatches"] == 0, p  # never a stale or foreign row
    assert p["failed"] == 0, p["errors"]  # and every step served


@pytest.mark.parametrize("fault", ["kill", "drop", "reject", "stop"])
def test_three_replicas_survive_a_node(tmp_path, files, fault):
    names = ["n1", "n2", "n3"]
    with netns.Hosts([*names, "c1"]) as hosts:
        cluster = Cluster(hosts, str(tmp_path))
        for n in names:
            cluster.start(n, files["v1"])
        worker = Worker(hosts, "c1", cluster.address(*names), files["v1"], str(tmp_path), f"w-{fault}")
        worker.wait_steps(20)
        victim = primary_of(f"w-{fault}", names)
        {
            "kill": lambda: cluster.signal(victim, signal.SIGKILL),
            "drop": lambda: hosts.drop(victim),
            "reject": lambda: hosts.reject(victim),
            "stop": lambda: cluster.signal(victim, signal.SIGSTOP),
        }[fault]()
        try:
            after = worker.wait_steps(60)
            assert after["replicas"][cluster.address(victim)]["state"] in ("down", "new"), after["replicas"]
        finally:
            if fault == "stop":
                cluster.signal(victim, signal.SIGCONT)
        assert_served(worker.stop())


def test_a_node_restarted_with_other_data_is_refused(tmp_path, files):
    names = ["n1", "n2", "n3"]
    with netns.Hosts([*names, "c1"]) as hosts:
        cluster = Cluster(hosts, str(tmp_path))
        for n in names:
            cluster.start(n, files["v1"])
        worker = Worker(hosts, "c1", cluster.address(*names), files["v1"], str(tmp_path), "w-version")
        worker.wait_steps(20)
        victim = primary_of("w-version", names)
        cluster.signal(victim, signal.SIGKILL)
        cluster.start(victim, files["v2"])  # back on the same address, with another version of the tables
        wait_for(
            lambda: worker.progress()["replicas"][cluster.address(victim)]["state"] == "refused",
            lambda: f"the restarted node to be refused: {worker.progress()['replicas']}",
        )
        worker.wait_steps(40)
        assert_served(worker.stop())


def test_two_shards_times_two_replicas_lose_a_node_of_each(tmp_path, files):
    shards = {"s0a": "0/2", "s0b": "0/2", "s1a": "1/2", "s1b": "1/2"}
    with netns.Hosts([*shards, "c1"]) as hosts:
        cluster = Cluster(hosts, str(tmp_path))
        for n, shard in shards.items():
            cluster.start(n, files["v1"], "--shard", shard)
        worker = Worker(hosts, "c1", cluster.address(*shards), files["v1"], str(tmp_path), "w-shards")
        worker.wait_steps(20)
        cluster.signal(primary_of("w-shards", ["s0a", "s0b"]), signal.SIGKILL)
        cluster.signal(primary_of("w-shards", ["s1a", "s1b"]), signal.SIGKILL)
        worker.wait_steps(60)
        assert_served(worker.stop())


def test_dns_membership_changes(tmp_path, files):
    """dns:///memnodes:7070 as a headless Service resolves: the worker follows the name's addresses."""
    names = ["n1", "n2", "n3"]
    with netns.Hosts([*names, "c1"]) as hosts:
        cluster = Cluster(hosts, str(tmp_path))
        for n in names:
            cluster.start(n, files["v1"])
        hosts.set_hosts("c1", {"memnodes": [hosts.ip("n1"), hosts.ip("n2")]})
        worker = Worker(
            hosts, "c1", f"dns:///memnodes:{PORT}", files["v1"], str(tmp_path), "w-dns", "--dns-refresh", "0.2"
        )
        p = worker.wait_steps(20)
        assert set(p["replicas"]) == {cluster.address("n1"), cluster.address("n2")}
        hosts.set_hosts("c1", {"memnodes": [hosts.ip("n2"), hosts.ip("n3")]})  # n3 joins, n1 leaves
        wait_for(
            lambda: set(worker.progress()["replicas"]) == {cluster.address("n2"), cluster.address("n3")},
            lambda: f"the new membership: {worker.progress()['replicas']}",
        )
        cluster.signal("n1", signal.SIGKILL)  # gone for good
        worker.wait_steps(40)
        assert worker.progress()["replicas"][cluster.address("n3")]["state"] in ("idle", "up")
        assert_served(worker.stop())
