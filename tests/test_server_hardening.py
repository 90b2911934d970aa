"""Server hardening: bounded options and config files, TLS certificate validity, sessions that never bind
a keepalive, per-network-prefix limits, a metered catalog, a whole-response send timeout, and a doctor that
never follows a planted symlink."""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, run_cli, wait_for
from test_faults import assert_one_line_error
from tests_helpers import open_raw_session, scrape, tcp_hello, value

from tableserver.common.wire import HEADER, HEADER_BYTES, FrameType, Status, recv_exact, request_header, send_all
from tableserver.config import SERVE_OPTIONS, add_flags, resolve
from tableserver.errors import ConfigError
from tableserver.v1 import tableserver_pb2 as pb
from tableserver.v1 import tableserver_pb2_grpc as pb_grpc


def _parse(argv):
    p = argparse.ArgumentParser()
    add_flags(p)
    return p.parse_args(argv)


NUMERIC = [o for o in SERVE_OPTIONS if o.kind in ("int", "float")]


# ------------------------------------------------------------------ 1. every numeric option bounded


@pytest.mark.parametrize("opt", NUMERIC, ids=lambda o: o.name)
def test_every_numeric_option_has_a_range_its_default_is_in(opt):
    assert opt.lo is not None and opt.hi is not None and opt.lo <= opt.hi, opt
    assert opt.lo <= opt.default <= opt.hi or (opt.default == 0 and opt.zero), opt
    assert resolve(_parse([]), {})[opt.name] == opt.default


@pytest.mark.parametrize("opt", NUMERIC, ids=lambda o: o.name)
def test_values_outside_the_range_are_one_line_errors_naming_where_they_came_from(opt, tmp_path):
    too_big = str(int(opt.hi) * 10 + 1) if opt.kind == "int" else str(opt.hi * 10)
    bad = [too_big, "100000000000000000000", "nan", "inf", "-inf", "-1"]
    if not opt.zero:
        bad.append("0")
    for text in bad:
        for args, env, where in (([f"{opt.flag}={text}"], {}, opt.flag), ([], {opt.env: text}, opt.env)):
            with pytest.raises(ConfigError) as e:
                resolve(_parse(args), env)
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith(f"{where} = {text!r}: expected"), msg
            assert opt.bounds in msg, msg
    key = opt.name.replace("_", "-")
    for literal in ("inf", "nan", too_big):  # TOML has inf and nan literals
        (tmp_path / "c.toml").write_text(f"{key} = {literal}\n")
        with pytest.raises(ConfigError) as e:
            resolve(_parse(["--config", str(tmp_path / "c.toml")]), {})
        assert f"c.toml: {key} = " in str(e.value) and opt.bounds in str(e.value), str(e.value)


def test_values_inside_the_range_are_taken(tmp_path):
    cfg = resolve(
        _parse(["--data-threads", "32", "--idle-timeout", "0", "--max-sessions", "1"]),
        {"TABLESERVER_LEASE_SECONDS": "86400", "TABLESERVER_DATA_THREADS": "2"},
    )
    assert (cfg["data_threads"], cfg["idle_timeout"], cfg["max_sessions"], cfg["lease_seconds"]) == (32, 0, 1, 86400)
    (tmp_path / "c.toml").write_text("data-threads = 4.0\nrdma-gid-index = 3\n")
    cfg = resolve(_parse(["--config", str(tmp_path / "c.toml")]), {})
    assert cfg["data_threads"] == 4 and cfg["rdma_gid_index"] == "3"
    for bad in ("data-threads = 4.5", "data-threads = true", "data-threads = [4]", "rdma-gid-index = 100000"):
        (tmp_path / "c.toml").write_text(bad + "\n")
        with pytest.raises(ConfigError, match="expected an integer in"):
            resolve(_parse(["--config", str(tmp_path / "c.toml")]), {})


def test_the_help_shows_every_range(tmp_path):
    res = run_cli("serve", "--help", env=dict(os.environ, COLUMNS="2000"))  # no wrapping inside a range
    assert res.returncode == 0, res
    text = " ".join(res.stdout.split())
    assert "2..32, or 0 = 2 per core" in text and "0.1..86400" in text
    for opt in NUMERIC:
        assert opt.bounds in text, opt.name


def test_the_cli_refuses_an_unbounded_thread_count_in_one_line(demo_file, tmp_path):
    env = dict(os.environ, TABLESERVER_DATA_THREADS="100000000000000000000")
    assert_one_line_error(
        run_cli("--tables", demo_file, "--listen", "127.0.0.1:0", env=env),
        "TABLESERVER_DATA_THREADS = '100000000000000000000'",
        "2..32",
        code=2,
    )
    (tmp_path / "c.toml").write_text("lease-seconds = inf\n")
    assert_one_line_error(
        run_cli("--tables", demo_file, "--config", str(tmp_path / "c.toml")),
        "lease-seconds = inf",
        "0.1..86400",
        code=2,
    )
    assert_one_line_error(
        run_cli("--tables", demo_file, "--max-sessions", "0"), "--max-sessions = '0'", "1..65536", code=2
    )


# ------------------------------------------------------------------ 2. the config file bounded


def _limit_memory():
    """A child that would read /dev/zero forever fails on its own, not by filling this machine."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_a_config_that_is_no_regular_file_is_refused_in_one_line(demo_file, tmp_path):
    env = dict(os.environ, TABLESERVER_CONFIG="/dev/zero")
    assert_one_line_error(
        run_cli("--tables", demo_file, env=env, preexec=_limit_memory), "/dev/zero is not a regular file", code=2
    )
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)  # opening it for reading without a writer would wait forever
    assert_one_line_error(run_cli("--tables", demo_file, "--config", fifo), "is not a regular file", code=2)
    assert_one_line_error(run_cli("--tables", demo_file, "--config", str(tmp_path)), "not a regular file", code=2)


def test_a_config_larger_than_the_limit_is_refused(demo_file, tmp_path):
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 120_000)  # 1.2 MB of comments: valid TOML, but no config is that large
    # a bad --listen too: a server that read the file whole would stop there instead of serving
    assert_one_line_error(
        run_cli("--tables", demo_file, "--config", str(big), "--listen", "nohost"), "larger than 1 MiB", code=2
    )


def test_a_deeply_nested_config_is_one_line(demo_file, tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("tables = " + "[" * 5000 + "]" * 5000 + "\n")
    res = run_cli("--tables", demo_file, "--config", str(deep))
    assert_one_line_error(res, "nested too deep", code=2)
    assert "RecursionError" not in res.stderr


# ------------------------------------------------------------------ 3. TLS certificate validity


def _write_cert(d, name, not_before, not_after):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = d / f"{name}.pem", d / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def _start_refused(fresh_daemon, *args):
    d = fresh_daemon(*args, wait=False)
    ready = os.path.join(d.workdir, "ready.json")
    wait_for(lambda: d.proc.poll() is not None or os.path.exists(ready), "the server to exit or serve")
    assert d.proc.poll() is not None, "the server started:\n" + d.log()
    d.proc.wait()
    return d


@pytest.mark.parametrize("when", ["expired", "not yet valid"])
def test_a_server_refuses_a_certificate_outside_its_validity(fresh_daemon, tmp_path, when):
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    if when == "expired":
        cert, key = _write_cert(tmp_path, "old", now - 30 * day, now - day)
        needles = ["expired", "notAfter", (now - day).strftime("%Y-%m-%d"), "renew it"]
    else:
        cert, key = _write_cert(tmp_path, "future", now + day, now + 30 * day)
        needles = ["not valid yet", "notBefore", (now + day).strftime("%Y-%m-%d"), "clock"]
    d = _start_refused(fresh_daemon, "--tls-cert", cert, "--tls-key", key)
    assert d.proc.returncode == 2
    last = d.log().strip().splitlines()[-1]
    assert last.startswith("tableserver: error: TLS certificate " + cert), last
    for n in needles:
        assert n in last, last


def test_a_valid_certificate_still_serves(fresh_daemon, tmp_path):
    now = datetime.datetime.now(datetime.UTC)
    cert, key = _write_cert(tmp_path, "good", now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    d = fresh_daemon("--tls-cert", cert, "--tls-key", key)
    assert d.proc.poll() is None and d.ready["control"]


# ------------------------------------------------------------------ 4. sessions that never bind a keepalive


def test_a_session_without_a_keepalive_stream_is_closed_after_the_bind_timeout(fresh_daemon, demo_local):
    """A session nobody binds a keepalive stream to is closed after the bind timeout, not after its lease; a
    real client, which binds its stream right after opening, keeps being served. (On a machine so busy that
    a client's first ping comes later than the bind timeout, its session is closed too and the client opens
    another: the gather below waits for that rather than fail.)"""
    from tableclient import TableClient, TableClientError

    d = fresh_daemon("--session-bind-timeout", "0.5", "--lease-seconds", "3600")
    with TableClient(d.address, client_name="honest", transport="tcp") as c:  # binds its stream at once
        raw = open_raw_session(d.address)
        wait_for(
            lambda: "never bound a keepalive stream within 0.5 s" in d.log() and "(raw pid" in d.log(),
            lambda: f"the unbound session to be closed:\n{d.log()}",
        )
        with socket.create_connection(tuple(_hostport(d.ready["tcp"])), timeout=EVENT_TIMEOUT) as s:
            assert tcp_hello(s, raw.session_id, raw.secret)[0] == Status.UNAUTHENTICATED
        ids = np.arange(64).reshape(8, 8)

        def served():
            try:
                return np.array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])
            except TableClientError:
                return False

        wait_for(served, "the honest client to be served")
        ended = [line for line in d.log().splitlines() if " ended: " in line and "(raw pid" in line]
        assert len(ended) == 1 and "never bound a keepalive stream" in ended[0], ended
    families = scrape(d.ready["metrics"])
    assert value(families, "tableserver_sessions_ended_total", reason="unbound") >= 1


def test_the_bind_timeout_is_bounded():
    with pytest.raises(ConfigError, match="--session-bind-timeout = 'inf': expected a number in 0.1..86400"):
        resolve(_parse(["--session-bind-timeout", "inf"]), {})
    assert resolve(_parse([]), {})["session_bind_timeout"] == 10.0


# ------------------------------------------------------------------ 5. limits by network prefix


def test_peer_keys_are_network_prefixes():
    from tableserver.control import peer_key

    assert peer_key("ipv4:127.0.0.45:5678") == "127.0.0.0/24"
    assert peer_key("ipv4:10.1.2.3:80", 16) == "10.1.0.0/16"
    assert peer_key("ipv4:10.1.2.3:80", 32) == "10.1.2.3/32"
    assert peer_key("ipv6:[2001:db8:1:2:3:4:5:6]:443") == "2001:db8:1:2::/64"
    assert peer_key("ipv6:%5B2001:db8:1:2:3:4:5:6%5D:443", 24, 48) == "2001:db8:1::/48"
    assert peer_key("ipv6:[::ffff:192.168.7.9]:80") == "192.168.7.0/24"  # IPv4-mapped: as IPv4
    assert peer_key("ipv6:[fe80::1%eth0]:80") == "fe80::/64"
    assert peer_key("unix:/run/a.sock") == peer_key("unix:") == "unix"


def test_the_open_and_catalog_buckets_are_shared_by_a_prefix():
    from tableserver.control import OpenRate, peer_key

    rate = OpenRate(50.0, 200)
    many = [peer_key(f"ipv4:127.0.0.{i}:1000") for i in range(2, 47)]  # 45 loopback sources, one /24
    assert sum(rate.allow(k, now=0.0) for k in many for _ in range(10)) == 200
    assert rate.allow(peer_key("ipv4:127.0.1.2:1000"), now=0.0)  # another /24 has its own bucket
    assert rate.allow(many[0], now=0.02) and not rate.allow(many[0], now=0.02)  # 50/s refills one per 20 ms


class _Forwarder:
    """A local TCP relay whose upstream connections leave from ``source``: a gRPC channel to it reaches
    the server from that source address (grpc cannot bind a client's source address itself)."""

    def __init__(self, source: str, upstream: tuple[str, int]):
        self.source, self.upstream = source, upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.socket()
            up.bind((self.source, 0))
            up.connect(self.upstream)
            self._socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self):
        for s in self._socks:
            s.close()


def _open_from(address: str):
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.TableServiceStub(ch).OpenSession(
            pb.OpenSessionRequest(client_name="prefix", transports=["tcp"]), timeout=EVENT_TIMEOUT
        )


def test_the_per_peer_session_cap_counts_a_whole_prefix(fresh_daemon):
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1, source_address=("127.0.0.2", 0)).close()
    except ConnectionRefusedError:
        pass
    except OSError as e:
        pytest.skip(f"this host cannot send from 127.0.0.2 ({e})")
    d = fresh_daemon("--max-sessions-per-peer", "3", "--session-open-rate", "1000")
    upstream = _hostport(d.address)
    relays = {
        src: _Forwarder(src, upstream) for src in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.1.2")
    }
    try:
        for src in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):  # three hosts of one /24: the cap of 3
            _open_from(relays[src].address)
        with pytest.raises(grpc.RpcError) as e:
            _open_from(relays["127.0.0.5"].address)  # a fourth address does not buy a fourth session
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "session limit reached for 127.0.0.0/24" in e.value.details(), e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            _open_from(d.address)  # nor does 127.0.0.1
        assert "127.0.0.0/24" in e.value.details()
        _open_from(relays["127.0.1.2"].address)  # another /24 has its own cap
        assert "from ipv4:127.0.0.3:" in d.log() and "from ipv4:127.0.1.2:" in d.log()  # they came from there
    finally:
        for r in relays.values():
            r.close()


def test_the_rate_limit_names_the_prefix(fresh_daemon):
    d = fresh_daemon("--session-open-rate", "0.01")  # burst 1
    _open_from(d.address)
    with pytest.raises(grpc.RpcError) as e:
        _open_from(d.address)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many sessions opened from 127.0.0.0/24" in e.value.details() and "retry later" in e.value.details()


# ------------------------------------------------------------------ 6. GetCatalog metered, built once


def test_get_catalog_is_metered_per_prefix_and_counted(fresh_daemon):
    d = fresh_daemon("--catalog-rate", "0.01")  # burst 1, one more every 100 s
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.TableServiceStub(ch)
        first = stub.GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
        assert len(first.tables) == 4
        with pytest.raises(grpc.RpcError) as e:
            stub.GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = e.value.details()
    assert "too many catalog requests from 127.0.0.0/24" in details and "--catalog-rate" in details, details
    assert "\n" not in details
    families = scrape(d.ready["metrics"])
    assert value(families, "tableserver_errors_total", reason="rate_limited") == 1


def test_the_default_catalog_rate_lets_many_clients_connect(fresh_daemon, demo_local):
    from tableclient import TableClient

    d = fresh_daemon("--session-open-rate", "1000")
    clients = [TableClient(d.address, client_name=f"c{i}", transport="tcp") for i in range(40)]  # 2 calls each
    try:
        ids = np.arange(16).reshape(4, 4)
        for c in clients[::13]:
            np.testing.assert_array_equal(c.table("engram.layer1").gather(ids), demo_local["engram.layer1"][ids])
    finally:
        for c in clients:
            c.close()


def test_the_catalog_reply_is_built_once():
    from tableserver.control import ServerState

    class Spec:
        dtype, logical_shape, layer, version = "uint8", (2, 4), 1, 1

    class Table:
        index, name, rows, row_bytes, checksum, nbytes, total_rows, row_lo, spec, tier = (
            0,
            "t",
            2,
            4,
            "x",
            8,
            2,
            0,
            Spec,
            "memory",
        )

    class Sessions:
        lease_seconds = 15.0

    state = ServerState(Sessions(), {"tcp": None}, 64, "host")
    state.tables = [Table]
    first = state.catalog()
    assert first is state.catalog() and first.tables[0].name == "t" and list(first.server.transports) == ["tcp"]


# ------------------------------------------------------------------ 7. the send timeout bounds a whole response


def test_a_reader_that_trickles_is_dropped_when_the_whole_response_is_late(fresh_daemon):
    d = fresh_daemon("--send-timeout", "3")
    with grpc.insecure_channel(d.address) as ch:
        catalog = pb_grpc.TableServiceStub(ch).GetCatalog(pb.GetCatalogRequest(), timeout=EVENT_TIMEOUT)
    table = max(catalog.tables, key=lambda t: t.row_bytes)
    count = catalog.server.max_rows_per_request
    total = HEADER_BYTES + count * table.row_bytes  # megabytes: at the pace read below, minutes to send
    resp = open_raw_session(d.address)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # a small window, set before connecting
    s.settimeout(EVENT_TIMEOUT)
    s.connect(_hostport(d.ready["tcp"]))
    with s:
        assert tcp_hello(s, resp.session_id, resp.secret)[0] == Status.OK
        send_all(s, [request_header(FrameType.GATHER, 1, table.index, count), np.zeros(count, "<i8")])
        head = bytearray(HEADER_BYTES)
        assert recv_exact(s, memoryview(head)) and HEADER.unpack(head)[2] == Status.OK
        got, dropped = HEADER_BYTES, False
        while got < total:  # at most 64 KiB every 50 ms: the server can send again well within the timeout
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                dropped = True
                break
            got += len(chunk)
            time.sleep(0.05)
    assert dropped and got < total, (got, total)
    wait_for(lambda: "(--send-timeout); dropped the connection" in d.log(), lambda: f"the drop logged:\n{d.log()}")
    families = scrape(d.ready["metrics"])
    assert value(families, "tableserver_errors_total", reason="send_timeout") == 1


# ------------------------------------------------------------------ 8. the doctor never follows a planted symlink


def test_fix_pyverbs_does_not_follow_a_symlink_planted_at_the_temp_name(tmp_path):
    from tableserver.ops import doctor

    purelib, link_dir, pkg = tmp_path / "site-packages", tmp_path / doctor.LINK_DIR_NAME, tmp_path / "pyverbs"
    purelib.mkdir()
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = purelib / (doctor.PTH_NAME + ".tmp")  # the old fixed temp name
    planted.symlink_to(victim)
    undo = doctor.link(str(pkg), str(purelib), str(link_dir))
    assert victim.read_text() == "precious\n"
    pth = purelib / doctor.PTH_NAME
    assert not pth.is_symlink() and pth.read_text() == f"{link_dir}\n"
    assert os.readlink(link_dir / "pyverbs") == str(pkg)
    assert planted.is_symlink() and os.readlink(planted) == str(victim)  # left alone
    assert sorted(p.name for p in purelib.iterdir()) == sorted([doctor.PTH_NAME, planted.name])  # no temp left
    undo()
    assert not pth.exists() and not (link_dir / "pyverbs").exists()


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)
