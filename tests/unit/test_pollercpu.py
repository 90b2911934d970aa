"""tableclient.graph.poller.cpu: the CPU list's form, one claim per CPU across processes (real flock, a real
second process), and claims that trust nothing another user made (real files of another uid: the tests run
as root and make them as ``nobody``)."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest
from tableclient.engine import ConfigError, PluginConfig
from tableclient.graph.poller.cpu import claim, claim_dir, claim_or_reason, parse_cpus

OTHER = 65534  # nobody: the other user of the host
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="makes another user's files: needs root")


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpus("") == [] and parse_cpus(" ") == []
    assert parse_cpus("14,15") == [14, 15]
    assert parse_cpus("12-15,20") == [12, 13, 14, 15, 20]
    assert parse_cpus("3, 1-3") == [3, 1, 2]  # the order given (claimed first first), once each
    for bad in ("x", "3-1", "-2", "1-", "1.5"):
        with pytest.raises(ValueError, match="is not a CPU or a range: use e.g. '14,15' or '12-15'"):
            parse_cpus(bad)
    for big in ("1024", "0-100000000"):  # never a list of a hundred million CPUs
        with pytest.raises(ValueError, match="is beyond the 1024 a poller can be pinned to"):
            parse_cpus(big)
    assert parse_cpus("1023") == [1023]


def test_the_plugin_config_checks_its_poller_cpus():
    assert PluginConfig.load({"TABLESERVER_POLLER_CPUS": "6-7"}).poller_cpus == "6-7"
    with pytest.raises(ConfigError, match=r"poller_cpus '6\.\.7': '6\.\.7' is not a CPU or a range"):
        PluginConfig(poller_cpus="6..7")


def test_a_claimed_cpu_is_nobody_elses_until_closed(tmp_path):
    d = str(tmp_path)
    a = claim([4, 5], d)
    b = claim([4, 5], d)
    assert (a.cpu, b.cpu) == (4, 5)
    assert claim([4, 5], d) is None  # both held (another descriptor in this process counts as another poller)
    a.close()
    a.close()  # idempotent
    c = claim([4, 5], d)
    assert c.cpu == 4
    b.close()
    c.close()
    assert claim([], d) is None
    assert claim([1], str(tmp_path / "missing")) is None


def test_a_process_holds_its_claim_until_it_ends(tmp_path):
    d = str(tmp_path)
    held = subprocess.Popen(
        [sys.executable, "-c", f"from tableclient.graph.poller.cpu import claim; c = claim([7], {d!r}); "
                               "print(c.cpu, flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert held.stdout.readline().strip() == "7"
        assert claim([7], d) is None
        mine = claim([7, 8], d)
        assert mine.cpu == 8
        mine.close()
    finally:
        held.kill()  # however a process ends, the kernel drops its lock
        held.wait()
    again = claim([7], d)
    assert again is not None and again.cpu == 7
    again.close()


@pytest.fixture
def shared():
    """A directory every user of the host may write in (as /dev/shm), without the sticky bit, so that the
    kernel's protected_symlinks (off on some hosts) is no part of what the tests prove."""
    d = tempfile.mkdtemp(prefix="pollercpu-")  # under /tmp: reachable by another user, unlike tmp_path
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d)


def as_other(*argv: str) -> None:
    subprocess.run(argv, user=OTHER, group=OTHER, extra_groups=[], check=True)


def test_claims_live_in_a_0700_directory_of_this_user_and_nowhere_else(tmp_path):
    base = str(tmp_path)
    old = os.umask(0o277)  # a umask that would leave the directory unwritable: the claim makes it 0700
    try:
        c = claim([3], base)
    finally:
        os.umask(old)
    assert c is not None and c.cpu == 3
    d = claim_dir(base)
    assert d == os.path.join(base, f"tableserver-poller-cpus-{os.geteuid()}") and os.listdir(base) == [
        os.path.basename(d)
    ]
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    f = os.lstat(os.path.join(d, "cpu-3"))
    assert stat.S_ISREG(f.st_mode) and f.st_uid == os.geteuid() and not stat.S_IMODE(f.st_mode) & 0o077
    c.close()


def test_every_cpu_held_is_said_in_one_line(tmp_path):
    a, why = claim_or_reason([4], str(tmp_path))
    assert a.cpu == 4 and why is None
    none, why = claim_or_reason([4], str(tmp_path))
    assert none is None and why == f"every CPU of [4] is held by another poller of uid {os.geteuid()} on this host"
    a.close()
    none, why = claim_or_reason([1], str(tmp_path / "missing"))
    assert none is None and why.startswith(f"no directory {tmp_path / 'missing'} for poller CPU claims")


@as_root
def test_a_link_planted_by_another_user_is_never_followed(shared):
    """Another user links the claim directory's name (and the old per-CPU name) to files of their choosing:
    the engine creates and locks neither target, pins nothing, and says whose link to remove."""
    as_other("ln", "-s", os.path.join(shared, "victim-dir"), claim_dir(shared))
    as_other("ln", "-s", os.path.join(shared, "victim"), os.path.join(shared, "tableserver-poller-cpu-4"))
    got, why = claim_or_reason([4], shared)
    assert not os.path.lexists(os.path.join(shared, "victim-dir"))
    assert not os.path.lexists(os.path.join(shared, "victim"))
    assert got is None
    assert why == (
        f"{claim_dir(shared)} is a symbolic link of uid {OTHER} (nobody), not this user's claim directory: "
        f"poller CPU claims there are refused; remove it (rm -rf {claim_dir(shared)}) and restart the engine"
    )


@as_root
@pytest.mark.parametrize("mode", [0o700, 0o777], ids=["0700", "0777"])
def test_a_claim_directory_of_another_user_is_said_in_one_line_and_not_used(shared, mode):
    """Another user made the claim directory first (to hold every claim, or to plant files in it): nothing
    is pinned, nothing is created in it, and the line says who holds it and what to remove."""
    as_other("mkdir", "-m", f"{mode:o}", claim_dir(shared))
    got, why = claim_or_reason([4, 5], shared)
    assert got is None and os.listdir(claim_dir(shared)) == [] and "\n" not in why
    assert why.startswith(f"{claim_dir(shared)} is owned by uid {OTHER} (nobody), not by this process's uid 0: ")
    assert why.endswith(f"remove it (rm -rf {claim_dir(shared)}) and restart the engine")


def test_a_claim_directory_open_to_other_users_is_not_used(tmp_path):
    os.mkdir(claim_dir(str(tmp_path)), 0o700)
    os.chmod(claim_dir(str(tmp_path)), 0o755)
    got, why = claim_or_reason([4], str(tmp_path))
    assert got is None and os.listdir(claim_dir(str(tmp_path))) == []
    assert why.startswith(f"{claim_dir(str(tmp_path))} has mode 0755, open to other users (a claim directory is 0700)")


@as_root
def test_a_claim_file_of_another_user_is_said_in_one_line(tmp_path):
    d = claim_dir(str(tmp_path))
    os.mkdir(d, 0o700)
    with open(os.path.join(d, "cpu-4"), "w"):
        pass
    os.chown(os.path.join(d, "cpu-4"), OTHER, OTHER)
    got, why = claim_or_reason([4, 5], str(tmp_path))
    assert got is None and "\n" not in why
    assert why.startswith(f"{d}/cpu-4 is owned by uid {OTHER} (nobody), not by this process's uid 0: ")


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_claim_file_that_is_not_a_plain_file_of_its_own_is_not_locked(tmp_path, plant):
    """Whoever put it there: a link to another file is neither followed nor locked; a FIFO never blocks."""
    d, victim = claim_dir(str(tmp_path)), str(tmp_path / "victim")
    os.mkdir(d, 0o700)
    path = os.path.join(d, "cpu-4")
    if plant == "symlink":
        os.symlink(victim, path)
    elif plant == "hardlink":
        open(victim, "w").close()
        os.link(victim, path)
    else:
        os.mkfifo(path, 0o600)
    got, why = claim_or_reason([4], str(tmp_path))
    assert got is None and why.startswith(f"{path} ") and "\n" not in why
    assert os.path.exists(victim) == (plant == "hardlink")


@as_root
def test_engines_of_two_users_do_not_see_each_others_claims(shared):
    """nobody's poller holds CPU 7 in its own directory (a forked child that became nobody: this Python may
    sit where nobody cannot run it); root's claim of CPU 7 is its own."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody's engine, until the parent closes done_w
        code = 1
        try:
            os.close(ready_r)
            os.close(done_w)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            c = claim([7], shared)
            os.write(ready_w, str(c.cpu if c else -1).encode())
            os.read(done_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(done_r)
    try:
        assert os.read(ready_r, 16) == b"7"
        mine = claim([7], shared)  # its own directory: nobody's claim is not seen (give each user its own list)
        assert mine is not None and mine.cpu == 7
        mine.close()
        assert sorted(os.listdir(shared)) == sorted(["tableserver-poller-cpus-0", f"tableserver-poller-cpus-{OTHER}"])
    finally:
        os.close(done_w)
        os.close(ready_r)
        assert os.waitpid(pid, 0)[1] == 0
