"""Bounds for the RDMA suite's clients and daemons in the QEMU guest, where everything runs slow.

The guest is TCG (no KVM) on a host that may be running other tests on its two cores: a session that opens
in 50 ms on the host can take well over 10 s there, a keepalive answer can come seconds late. The client's
and the daemon's defaults are a production deployment's (a 10 s connect, a node failed after 2 s without a
keepalive answer, 5 s to authenticate a tcp connection), and a guest that is merely slow misses them while
nothing is wrong. The tests here prove rows and failures, never speed: every bound below is the suite's
event bound (conftest.EVENT_TIMEOUT, 600 s), each wait ends as soon as its event happens, so a slow guest
makes a test slower, never red.
"""

from __future__ import annotations

import sys

from conftest import EVENT_TIMEOUT, start_daemon

#: TableClient keyword arguments for every client of the guest suite: the session open (connect_timeout),
#: a gather waited for without a timeout (request_timeout) and a node's silence before it is failed
#: (liveness_timeout: a node that is gone still fails at once, its keepalive stream ends) all get the event
#: bound, where the defaults are 10 s, 30 s and 2 s.
SLOW_CLIENT = dict(connect_timeout=EVENT_TIMEOUT, request_timeout=EVENT_TIMEOUT, liveness_timeout=EVENT_TIMEOUT)

#: Daemon flags for every daemon of the guest suite (a later flag wins): a tcp data connection's handshake
#: (default 5 s) and a response's send (10 s), and a disk table's reads (--disk-timeout, 10 s: past it a
#: gather of good rows would fail IO_ERROR), all bounded by the event bound instead.
SLOW_DAEMON = tuple(
    arg for flag in ("--handshake-timeout", "--send-timeout", "--disk-timeout") for arg in (flag, f"{EVENT_TIMEOUT:g}")
)


def guest_daemon(workdir: str, *args: str, **kw):
    """conftest.start_daemon with the guest's bounds (SLOW_DAEMON) before ``args``."""
    return start_daemon(workdir, *SLOW_DAEMON, *args, **kw)


#: ``python -c`` wrapper of ``python -m tableserver ...`` (the command after its first argument) that sets
#: the rdma pack thread's bound on a reply not taken (tableserver.transports.rdma.PACK_REPLY_TIMEOUT_S) to
#: its first argument, in the daemon's own process, before serving.
_PACK_REPLY_TIMEOUT_WRAPPER = r"""
import runpy, sys
import tableserver.transports.rdma as rdma
assert isinstance(getattr(rdma, "PACK_REPLY_TIMEOUT_S", None), float), "no PACK_REPLY_TIMEOUT_S to set"
rdma.PACK_REPLY_TIMEOUT_S = float(sys.argv[1])
at = sys.argv.index("-m")
assert sys.argv[at + 1] == "tableserver", sys.argv
sys.argv = ["tableserver", *sys.argv[at + 2 :]]
runpy.run_module("tableserver", run_name="__main__", alter_sys=True)
"""


def pack_reply_timeout(seconds: float) -> tuple[str, ...]:
    """start_daemon's ``prefix`` for a daemon whose pack replies stall for ``seconds`` before it ends the
    session (instead of 5 s): the process is still the daemon's."""
    return (sys.executable, "-c", _PACK_REPLY_TIMEOUT_WRAPPER, f"{seconds:g}")
