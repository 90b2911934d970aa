"""Authentication and confidentiality: bearer tokens (required, from a file or the environment, generated
off loopback, a warning when one is on the command line), TLS and mutual TLS, certificates outside their
validity window, metrics over https; data ports admit sessions only; shared-memory clients get read-only,
sealed table memory through a socket only this user and --shm-group may reach; and a catalog that says when
its checksums were not verified."""

from __future__ import annotations

import datetime
import errno
import os
import socket

import grpc
import numpy as np
import pytest
from conftest import EVENT_TIMEOUT, wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tableclient import AuthError, ConnectError, TableClient

TOKEN = "s3cret-token-for-tests"


# ------------------------------------------------------------------------------------- bearer tokens


def test_token_required(fresh_daemon, demo_local):
    d = fresh_daemon("--auth-token", TOKEN)
    with pytest.raises(AuthError, match="missing bearer token"):
        TableClient(d.address)
    with pytest.raises(AuthError, match="wrong bearer token"):
        TableClient(d.address, token="guess")
    for transport in ("tcp", "shm"):
        with TableClient(d.address, transport=transport, token=TOKEN) as c:
            np.testing.assert_array_equal(c.table("tiny").gather([0]), demo_local["tiny"][[0]])
    with grpc.insecure_channel(d.address) as ch:  # health stays open to probes without a token
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=EVENT_TIMEOUT).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_token_from_file_and_env(fresh_daemon, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    d = fresh_daemon("--auth-token-file", str(token_file))
    monkeypatch.setenv("TABLESERVER_AUTH_TOKEN", TOKEN)
    with TableClient(d.address) as c:
        assert c.table("tiny").gather([0]).shape == (1, 8)


def test_off_loopback_without_a_token_generates_one(fresh_daemon):
    """Secure by default: listening off loopback with no token makes the server generate one (0600 file);
    only --allow-anonymous serves anyone, and then it warns."""
    import os
    import stat

    d = fresh_daemon("--listen", "0.0.0.0:0", "--tcp-listen", "127.0.0.1:0")
    log = d.log()
    assert "without TLS" in log and "generated one in" in log
    path = d.ready["token_file"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token = open(path).read().strip()
    port = d.address.rsplit(":", 1)[1]
    from tableclient import AuthError

    with pytest.raises(AuthError):
        TableClient(f"127.0.0.1:{port}", token="")
    with TableClient(f"127.0.0.1:{port}", token=token) as c:
        assert c.table("tiny").gather([0]).shape == (1, 8)
    d.stop()
    assert not os.path.exists(path)  # removed with the server
    anon = fresh_daemon("--listen", "0.0.0.0:0", "--tcp-listen", "127.0.0.1:0", "--allow-anonymous")
    assert "without --auth-token" in anon.log() and "token_file" not in anon.ready


def test_a_token_on_the_command_line_warns(fresh_daemon):
    d = fresh_daemon("--auth-token", "s3cret")
    assert "shows the token to every local user" in d.log()


# -------------------------------------------------------------------------------- TLS and mutual TLS


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, issuer_name, issuer_key, key, ca=False, san=None):
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(s) for s in san]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("tableserver test CA", _name("tableserver test CA"), ca_key, ca_key, ca=True)
    files = {}

    def write(name, cert, key):
        files[name] = str(d / f"{name}.pem"), str(d / f"{name}.key")
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    write("ca", ca, ca_key)
    for who, san in (("server", ["localhost"]), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(who, _cert(who, ca.subject, ca_key, key, san=san), key)
    return files


def test_tls(fresh_daemon, pki, demo_local):
    cert, key = pki["server"]
    d = fresh_daemon("--tls-cert", cert, "--tls-key", key, "--auth-token", TOKEN)
    port = d.address.rsplit(":", 1)[1]
    with TableClient(f"localhost:{port}", tls_ca=pki["ca"][0], token=TOKEN, transport="tcp") as c:
        np.testing.assert_array_equal(c.table("tiny").gather([0]), demo_local["tiny"][[0]])
        assert c.node_transport().sealed  # TLS control plane: the tcp rows are sealed too
    with pytest.raises(ConnectError):
        TableClient(f"localhost:{port}", token=TOKEN, connect_timeout=3)  # plaintext to a TLS port


def test_mutual_tls(fresh_daemon, pki):
    cert, key = pki["server"]
    d = fresh_daemon("--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"][0])
    target = f"localhost:{d.address.rsplit(':', 1)[1]}"
    with pytest.raises(ConnectError):
        TableClient(target, tls_ca=pki["ca"][0], connect_timeout=3)  # no client certificate
    ccert, ckey = pki["client"]
    with TableClient(target, tls_ca=pki["ca"][0], tls_cert=ccert, tls_key=ckey) as c:
        assert c.table("tiny").gather([0]).shape == (1, 8)


def test_metrics_over_https(fresh_daemon, pki):
    """--metrics-tls: /metrics (and the probes) speak HTTPS with the control plane's certificate."""
    import ssl
    import urllib.error
    import urllib.request

    cert, key = pki["server"]
    d = fresh_daemon(
        "--tls-cert", cert, "--tls-key", key, "--auth-token-file", _token_file(pki["ca"][0]), "--metrics-tls"
    )
    port = d.ready["metrics"].rsplit(":", 1)[1]
    ctx = ssl.create_default_context(cafile=pki["ca"][0])
    with urllib.request.urlopen(f"https://localhost:{port}/metrics", context=ctx, timeout=EVENT_TIMEOUT) as r:
        assert b"tableserver_serving 1.0" in r.read()
    with urllib.request.urlopen(f"https://localhost:{port}/readyz", context=ctx, timeout=EVENT_TIMEOUT) as r:
        assert r.read() == b"SERVING\n"
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=EVENT_TIMEOUT).read()  # plaintext: refused


def _token_file(near: str) -> str:
    import os

    path = os.path.join(os.path.dirname(near), "token")
    with open(path, "w") as f:
        f.write(TOKEN + "\n")
    return path


# -------------------------------------------------------- certificates outside their validity window


def _write_cert(d, name, not_before, not_after):
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


# -------------------------------------------------------------------- data ports admit sessions only


def test_data_port_rejects_forged_sessions(daemon):
    from tests_helpers import shm_hello, tcp_hello

    from tableserver.common.wire import HEADER, Status

    host, port = daemon.ready["tcp"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=EVENT_TIMEOUT) as s:
        assert tcp_hello(s, bytes(16), bytes(32))[0] == Status.UNAUTHENTICATED
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(daemon.ready["shm"])
        msg, fds = shm_hello(s, bytes(16), bytes(32))
        assert HEADER.unpack_from(msg)[2] == Status.UNAUTHENTICATED and fds == []


# -------------------------------------------- shared memory: read-only, sealed, behind a 0660 socket


def test_shm_fds_are_read_only(daemon):
    """A client cannot write the shared tables: fds are O_RDONLY and the memfds are sealed."""
    import mmap
    import os

    from tests_helpers import shm_fds

    fds = shm_fds(daemon)
    try:
        for fd in fds:
            assert os.fstat(fd).st_mode & 0o777 == 0o400  # no one but root may reopen it writable ...
            pid = os.fork()
            if pid == 0:  # ... checked as another user: the old memfd mode 0777 let any uid reopen it O_RDWR
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                    os._exit(1)
                except PermissionError:
                    os._exit(0)
                except BaseException:
                    os._exit(2)
            assert os.waitpid(pid, 0)[1] == 0
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # even reopened read-write by root:
            try:
                with pytest.raises(PermissionError):  # F_SEAL_FUTURE_WRITE forbids writable mappings
                    mmap.mmap(rw, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(OSError) as refused:
                    os.pwrite(rw, b"x", 0)
                # sealed shmem: EPERM; tables on hugetlbfs (hugepages reserved here): it has no write() at all
                assert refused.value.errno in (errno.EPERM, errno.EINVAL), refused.value
            finally:
                os.close(rw)
    finally:
        for fd in fds:
            os.close(fd)


def test_shm_socket_is_0660_with_a_group(fresh_daemon, tmp_path):
    """Before: the shm socket was 0666 (any local user). Now this user and --shm-group only."""
    import grp
    import os
    import stat

    group = grp.getgrgid(os.getgid()).gr_name
    d = fresh_daemon("--shm-group", group)
    st = os.stat(d.ready["shm"])
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    from conftest import run_cli
    from tests_helpers import assert_one_line_error

    assert_one_line_error(
        run_cli(
            "--tables",
            "x.bin",
            "--listen",
            "127.0.0.1:0",
            "--shm-group",
            "no-such-grp",
            "--shm-socket",
            str(tmp_path / "s.sock"),
        ),
        "no such group",
    )


def test_table_memory_without_the_write_seal_is_refused_for_shm():
    """The shm transport starts only over memory nobody can write: mode 0400 and F_SEAL_FUTURE_WRITE,
    checked at start (a kernel that refused the seal used to be ignored silently)."""
    import fcntl

    from tableserver.errors import TableServerError
    from tableserver.tables.memory import PinnedRegion
    from tableserver.transports.shm import check_read_only

    with PinnedRegion("t", 4096) as good:
        good.seal()
        check_read_only(good)  # the loader's own regions pass
    with PinnedRegion("t", 4096) as half:
        fcntl.fcntl(half.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # what an old kernel gives
        with pytest.raises(TableServerError, match="F_SEAL_FUTURE_WRITE needs Linux >= 5.1"):
            check_read_only(half)
    with PinnedRegion("t", 4096) as loose:
        loose.seal()
        os.fchmod(loose.fd, 0o644)
        with pytest.raises(TableServerError, match="mode 644, expected 0400"):
            check_read_only(loose)


# --------------------------------------------------------------------------- the catalog's checksums


def test_the_catalog_says_when_it_did_not_verify(fresh_daemon, demo_file):
    """Before: with --no-verify the catalog advertised the file's checksum for data nobody checked.
    Now it says "unverified:", and a client pinning the SHA-256 digest refuses such a server."""
    from tableclient import ConnectError, TableClient

    from tableserver.tables.tablefile import read_header

    spec = read_header(demo_file).tables[0]
    assert spec.checksum.startswith("sha256:")
    d = fresh_daemon("--no-verify")
    with TableClient(d.address) as c:
        assert c.tables[spec.name].checksum == "unverified:" + spec.checksum
    with pytest.raises(ConnectError, match="refused"):
        TableClient(d.address, checksums={spec.name: spec.checksum})
    verified = fresh_daemon()
    with TableClient(verified.address, checksums={spec.name: spec.checksum}) as c:
        assert c.tables[spec.name].checksum == spec.checksum
