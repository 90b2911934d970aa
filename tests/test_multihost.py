"""Memory nodes and serving workers on separate hosts: each in its own network namespace.

Three replicas (or 2 shards x 2 replicas) of one table file, each a real daemon serving tcp on its own
address; the worker is tests/decode_client.py in a namespace of its own, running decode steps (both
layers at step start, hedged at half of each window) and checking every row against the file. Faults:
kill -9, packets dropped (iptables DROP: silence) or rejected (REJECT: resets), SIGSTOP, a restart with
other table data, shard nodes killed, DNS membership changes. After each, the worker must keep serving:
no failed step, no stale or foreign row.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

import netns
from conftest import EVENT_TIMEOUT, ROOT, wait_for
from tableclient.routing import rendezvous_score
from tableserver.demo import DemoTable, write_demo_file

pytestmark = pytest.mark.slow
TABLES = [DemoTable("engram.layer1", 60_000, 264, 1), DemoTable("engram.layer14", 80_003, 264, 14)]
PORT = 7070


@pytest.fixture(scope="module", autouse=True)
def needs_namespaces():
    why = netns.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("multihost")
    return {"v1": write_demo_file(str(d / "v1.bin"), TABLES, seed=1),
            "v2": write_demo_file(str(d / "v2.bin"), TABLES, seed=2)}


class Cluster:
    def __init__(self, hosts: netns.Hosts, workdir: str):
        self.hosts, self.workdir = hosts, workdir
        self.nodes: dict[str, object] = {}

    def start(self, name: str, table: str, *flags: str):
        ready = os.path.join(self.workdir, f"{name}.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        log = open(os.path.join(self.workdir, f"{name}.log"), "a")
        proc = self.hosts.popen(name, [sys.executable, "-m", "tableserver", "serve", "--tables", table, "--listen",
                                       f"{self.hosts.ip(name)}:{PORT}", "--transports", "tcp", "--node-id", name,
                                       "--ready-file", ready, "--progress", "never", "--metrics-port", "off",
                                       "--lease-seconds", "120", *flags], stdout=log, stderr=log, cwd=ROOT)
        self.nodes[name] = proc
        wait_for(lambda: os.path.exists(ready) or proc.poll() is not None, f"{name} to serve")
        assert proc.poll() is None, open(os.path.join(self.workdir, f"{name}.log")).read()[-3000:]
        return proc

    def address(self, *names: str) -> str:
        return ",".join(f"{self.hosts.ip(n)}:{PORT}" for n in names)

    def signal(self, name: str, sig) -> None:
        os.kill(self.nodes[name].pid, sig)
        if sig == signal.SIGKILL:
            self.nodes[name].wait(EVENT_TIMEOUT)


class Worker:
    """tests/decode_client.py on its own host."""

    def __init__(self, hosts, host: str, address: str, table: str, workdir: str, client_id: str, *extra: str):
        self.progress_path = os.path.join(workdir, f"{client_id}.json")
        self.stop_path = os.path.join(workdir, f"{client_id}.stop")
        self.log = os.path.join(workdir, f"{client_id}.log")
        with open(self.log, "w") as log:
            self.proc = hosts.popen(host, [sys.executable, os.path.join(ROOT, "tests", "decode_client.py"),
                                           "--address", address, "--tables", table, "--progress",
                                           self.progress_path, "--stop", self.stop_path, "--client-id", client_id,
                                           "--liveness", "1.0", *extra], stdout=log, stderr=log, cwd=ROOT)

    def progress(self) -> dict:
        try:
            with open(self.progress_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"steps": 0}

    def wait_steps(self, more: int) -> dict:
        target = self.progress().get("steps", 0) + more
        wait_for(lambda: self.progress().get("steps", 0) >= target or self.proc.poll() is not None,
                 lambda: f"{more} more decode steps: {self.progress()}\n{open(self.log).read()[-3000:]}",
                 interval=0.05)
        assert self.proc.poll() is None, open(self.log).read()[-3000:]
        return self.progress()

    def stop(self) -> dict:
        open(self.stop_path, "w").close()
        self.proc.wait(EVENT_TIMEOUT)
        return self.progress()


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
        {"kill": lambda: cluster.signal(victim, signal.SIGKILL), "drop": lambda: hosts.drop(victim),
         "reject": lambda: hosts.reject(victim), "stop": lambda: cluster.signal(victim, signal.SIGSTOP)}[fault]()
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
        wait_for(lambda: worker.progress()["replicas"][cluster.address(victim)]["state"] == "refused",
                 lambda: f"the restarted node to be refused: {worker.progress()['replicas']}")
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
        worker = Worker(hosts, "c1", f"dns:///memnodes:{PORT}", files["v1"], str(tmp_path), "w-dns",
                        "--dns-refresh", "0.2")
        p = worker.wait_steps(20)
        assert set(p["replicas"]) == {cluster.address("n1"), cluster.address("n2")}
        hosts.set_hosts("c1", {"memnodes": [hosts.ip("n2"), hosts.ip("n3")]})  # n3 joins, n1 leaves
        wait_for(lambda: set(worker.progress()["replicas"]) == {cluster.address("n2"), cluster.address("n3")},
                 lambda: f"the new membership: {worker.progress()['replicas']}")
        cluster.signal("n1", signal.SIGKILL)  # gone for good
        worker.wait_steps(40)
        assert worker.progress()["replicas"][cluster.address("n3")]["state"] in ("idle", "up")
        assert_served(worker.stop())
