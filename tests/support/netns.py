"""Several hosts on one machine: network namespaces joined by a bridge (root only).

    with Hosts(["n1", "n2", "n3", "client"]) as hosts:
        hosts.ip("n1")                                   # 10.213.<net>.1
        proc = hosts.popen("n1", [sys.executable, "-m", "tableserver", ...])
        hosts.drop("n1")                                 # iptables DROP: packets vanish
        hosts.set_hosts("client", {"memnodes": ["10.213.<net>.1", ...]})   # a per-namespace /etc/hosts

Each host is its own namespace with a veth on one bridge in the root
namespace and an address of its own; namespaces share the file system (table
files, ready files) but not the network. ``ip netns exec`` bind-mounts
``/etc/netns/NS/hosts`` over ``/etc/hosts`` for the processes it starts: a
stand-in for a headless Service's DNS (several addresses behind one name).
Rewrite it in place (same inode) to change membership under a running client.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import signal as signals
import subprocess
import sys

from conftest import EVENT_TIMEOUT, ROOT, wait_for

from tableserver.ops.demo_run import serve_command

PORT = 7070

_instances = itertools.count()


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, pkg in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"{tool} missing: apt-get install {pkg} (.ci/run installs it)"
    probe = f"tsprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"ip netns add failed: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip()}")


class Hosts:
    def __init__(self, names: list[str], net: int | None = None):
        # unique per instance: the kernel tears a deleted namespace's devices down asynchronously
        n = next(_instances)
        self.tag = f"{os.getpid() % 1000}{n % 100}"
        self.net = net if net is not None else (os.getpid() + n) % 200 + 20
        self.names = list(names)
        self.bridge = f"tsbr{self.tag}"
        self.procs: list[subprocess.Popen] = []
        self.token = secrets.token_urlsafe(16)

    def ns(self, name: str) -> str:
        return f"ts{self.tag}-{name}"

    def ip(self, name: str) -> str:
        return f"10.213.{self.net}.{self.names.index(name) + 1}"

    def __enter__(self) -> Hosts:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for k, name in enumerate(self.names):
                ns, veth, peer = self.ns(name), f"tsv{self.tag}{k}", f"tsp{self.tag}{k}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
                _run("ip", "link", "set", veth, "netns", ns)
                _run("ip", "link", "set", peer, "master", self.bridge)
                _run("ip", "link", "set", peer, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", veth)
                _run("ip", "-n", ns, "link", "set", veth, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def popen(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        """Runs ``cmd`` on host ``name``. Servers off loopback need a token: every process of these hosts
        shares one (servers and clients read TABLESERVER_AUTH_TOKEN)."""
        kw.setdefault("env", dict(os.environ, TABLESERVER_AUTH_TOKEN=self.token))
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *cmd], **kw)
        self.procs.append(proc)
        return proc

    def run(self, name: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(name), *cmd], **kw)

    # ------------------------------------------------------------------ faults
    def _iptables(self, name: str, *rule: str) -> None:
        _run("ip", "netns", "exec", self.ns(name), "iptables", *rule)

    def drop(self, name: str) -> None:
        """Every packet to and from the host vanishes: connects and requests time out, no reset."""
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(name, "-A", chain, "!", "-o" if chain == "OUTPUT" else "-i", "lo", "-j", "DROP")

    def reject(self, name: str) -> None:
        """Every tcp packet to the host is answered with a reset: connects fail at once."""
        self._iptables(name, "-A", "INPUT", "!", "-i", "lo", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset")

    def heal(self, name: str) -> None:
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(name, "-F", chain)

    def set_hosts(self, name: str, entries: dict) -> None:
        """The host's /etc/hosts: {hostname: [ip, ...]} (in place, so running processes see changes)."""
        d = f"/etc/netns/{self.ns(name)}"
        os.makedirs(d, exist_ok=True)
        text = "127.0.0.1 localhost\n" + "".join(f"{ip} {host}\n" for host, ips in entries.items() for ip in ips)
        with open(os.path.join(d, "hosts"), "r+" if os.path.exists(os.path.join(d, "hosts")) else "w") as f:
            f.seek(0)
            f.write(text)
            f.truncate()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        for k, name in enumerate(self.names):
            subprocess.run(["ip", "link", "del", f"tsp{self.tag}{k}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns(name)], capture_output=True)
            shutil.rmtree(f"/etc/netns/{self.ns(name)}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __exit__(self, *exc) -> None:
        self.close()


class Cluster:
    def __init__(self, hosts: Hosts, workdir: str):
        self.hosts, self.workdir = hosts, workdir
        self.nodes: dict[str, object] = {}

    def start(self, name: str, table: str, *flags: str):
        ready = os.path.join(self.workdir, f"{name}.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        log = open(os.path.join(self.workdir, f"{name}.log"), "a")
        cmd = serve_command(
            ready, "--tables", table, "--listen", f"{self.hosts.ip(name)}:{PORT}", "--transports", "tcp",
            "--node-id", name, "--metrics-port", "off", "--lease-seconds", "120", "--session-bind-timeout", "3600",
            *flags,
        )  # fmt: skip
        proc = self.hosts.popen(name, cmd, stdout=log, stderr=log, cwd=ROOT)
        self.nodes[name] = proc
        wait_for(lambda: os.path.exists(ready) or proc.poll() is not None, f"{name} to serve")
        assert proc.poll() is None, open(os.path.join(self.workdir, f"{name}.log")).read()[-3000:]
        return proc

    def address(self, *names: str) -> str:
        return ",".join(f"{self.hosts.ip(n)}:{PORT}" for n in names)

    def signal(self, name: str, sig) -> None:
        os.kill(self.nodes[name].pid, sig)
        if sig == signals.SIGKILL:
            self.nodes[name].wait(EVENT_TIMEOUT)


class Worker:
    """tests/support/decode_client.py on its own host."""

    def __init__(self, hosts, host: str, address: str, table: str, workdir: str, client_id: str, *extra: str):
        self.progress_path = os.path.join(workdir, f"{client_id}.json")
        self.stop_path = os.path.join(workdir, f"{client_id}.stop")
        self.log = os.path.join(workdir, f"{client_id}.log")
        with open(self.log, "w") as log:
            self.proc = hosts.popen(
                host,
                [
                    sys.executable,
                    os.path.join(ROOT, "tests", "support", "decode_client.py"),
                    "--address",
                    address,
                    "--tables",
                    table,
                    "--progress",
                    self.progress_path,
                    "--stop",
                    self.stop_path,
                    "--client-id",
                    client_id,
                    "--liveness",
                    "1.0",
                    *extra,
                ],
                stdout=log,
                stderr=log,
                cwd=ROOT,
            )

    def progress(self) -> dict:
        try:
            with open(self.progress_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"steps": 0}

    def wait_steps(self, more: int) -> dict:
        target = self.progress().get("steps", 0) + more
        wait_for(
            lambda: self.progress().get("steps", 0) >= target or self.proc.poll() is not None,
            lambda: f"{more} more decode steps: {self.progress()}\n{open(self.log).read()[-3000:]}",
            interval=0.05,
        )
        assert self.proc.poll() is None, open(self.log).read()[-3000:]
        return self.progress()

    def stop(self) -> dict:
        open(self.stop_path, "w").close()
        self.proc.wait(EVENT_TIMEOUT)
        return self.progress()
