"""tableclient.pollercpu: the CPU list's form, and one claim per CPU across processes (real flock, a real
second process)."""

import subprocess
import sys

import pytest
from tableclient.engine import ConfigError, PluginConfig
from tableclient.pollercpu import claim, parse_cpus


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
        [sys.executable, "-c", f"from tableclient.pollercpu import claim; c = claim([7], {d!r}); "
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
