"""The client trusts no server (issue 24): a scripted server (tests/hostile_server.py) speaking the real
gRPC API and data protocols misbehaves one way per case; the client, in a subprocess so a crash (SIGBUS,
an abort) is seen, must end each in a TableClientError within the case's bound -- or, where the server
also offers an honest path, be served bit-exact over it -- and hold no more fds or threads after its
third attempt than after its first.

Before this suite: an unsealed memfd truncated under the mapping killed the client with SIGBUS; a
dribbled challenge held TableClient(connect_timeout=2) for ~56 s and a 65,536-byte HELLO reply for
hours; a response with an unknown request id was GatherTimeout "after 0.000000 s"; absurd catalogs
and offers raised OverflowError, ValueError, TypeError instead of a ConnectError.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import EVENT_TIMEOUT, ROOT
from hostile_server import ScriptedServer

CONNECT_TIMEOUT = 2.0
GATHER_TIMEOUT = 1.0
#: how long a case may take at most: far under what each took before (56 s to hours), far over what it
#: takes on a busy machine (a few connect_timeouts)
BOUND_S = 30.0

CLIENT = r"""
import json, os, sys, threading, time
import numpy as np
sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
from hostile_server import table_rows
from tableclient import TableClient, TableClientError

spec = json.loads(sys.argv[1])
rows = table_rows()

def held():
    return len(os.listdir("/proc/self/fd")), threading.active_count()

def attempt():
    t0 = time.monotonic()
    out = {}
    try:
        with TableClient(spec["address"], transport=spec["transport"], connect_timeout=spec["connect_timeout"],
                         request_timeout=spec["gather_timeout"], liveness_timeout=30.0) as c:
            out["transport"] = c.transport
            table = c.table("t")
            ids = np.random.default_rng(1).integers(0, rows.shape[0], 500)
            end = time.monotonic() + spec.get("gather_for", 0.0)
            while True:  # a mapping truncated meanwhile would kill us here
                got = table.gather(ids, timeout=spec["gather_timeout"])
                out["rows_ok"] = bool(np.array_equal(got, rows[ids]))
                if not out["rows_ok"] or time.monotonic() >= end:
                    break
                time.sleep(0.05)
    except TableClientError as e:
        out.update(error=type(e).__name__, message=str(e))
    except BaseException as e:
        out.update(error="not a TableClientError: " + type(e).__name__, message=str(e))
    out["elapsed"] = time.monotonic() - t0
    return out

results = [attempt()]
first = held()
results += [attempt(), attempt()]
deadline = time.monotonic() + 20
while held() > first and time.monotonic() < deadline:  # threads of the last attempt wind down
    time.sleep(0.1)
print(json.dumps({"results": results, "first": first, "last": held()}))
"""


def run_client(server: ScriptedServer, transport: str = "tcp", **extra) -> dict:
    spec = dict(
        address=server.address,
        transport=transport,
        connect_timeout=CONNECT_TIMEOUT,
        gather_timeout=GATHER_TIMEOUT,
        **extra,
    )
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(spec), ROOT],
        capture_output=True,
        text=True,
        timeout=EVENT_TIMEOUT,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"the client died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    first, last = report["first"], report["last"]
    assert last[0] <= first[0] and last[1] <= first[1], f"fds/threads grew {first} -> {last}: {report}"
    return report


CASES = [  # behaviour, transport asked for, the error class or None (served), text the error names
    ("catalog_silent", "tcp", "ConnectError", "cannot reach"),
    ("catalog_row_lo_near_2_64", "tcp", "ConnectError", "bad catalog"),
    ("catalog_row_bytes_0", "tcp", "ConnectError", "bad catalog"),
    ("catalog_rows_past_total", "tcp", "ConnectError", "bad catalog"),
    ("catalog_huge_table", "tcp", "ConnectError", "bad catalog"),
    ("catalog_duplicate_names", "tcp", "ConnectError", "bad catalog"),
    ("lease_nan", "tcp", "ConnectError", "malformed session"),
    ("session_id_short", "tcp", "ConnectError", "malformed session"),
    ("keepalive_silent", "tcp", "ConnectError", "keepalive"),
    ("data_port_silent", "tcp", "ConnectError", "did not complete within"),
    ("challenge_dribbled", "tcp", "ConnectError", "did not complete within"),
    ("hello_reply_huge", "tcp", "ConnectError", "HELLO reply of 65536 bytes"),
    ("offer_tcp_port_out_of_range", "tcp", "ConnectError", "not an address"),
    ("offer_unknown_first", "tcp", None, ""),
    ("response_wrong_length", "tcp", "ConnectError", "response of 501x264 bytes"),
    ("response_unknown_request_id", "tcp", "ConnectError", "not next in line"),
    ("response_huge_error", "tcp", "ConnectError", "error message of"),
    ("gather_silent", "tcp", "GatherTimeout", "not complete after 1"),  # its bound, 1 s
    ("shm_unsealed_truncated", "auto", None, ""),  # refused, served over tcp: never mapped, never SIGBUS
    ("shm_short_memfd", "auto", None, ""),
    ("shm_unsealed_truncated", "shm", "ConnectError", "not sealed"),
    ("shm_short_memfd", "shm", "ConnectError", "bytes sent for"),
    ("shm_bad_json", "shm", "ConnectError", "a reply no tableserver sends"),
    ("shm_size_overflow", "shm", "ConnectError", "does not match the catalog"),
]


@pytest.mark.parametrize("behaviour, transport, error, text", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_hostile_server_ends_in_a_table_client_error(tmp_path, behaviour, transport, error, text):
    with ScriptedServer(behaviour, str(tmp_path)) as server:
        report = run_client(server, transport, gather_for=2.5 if behaviour.startswith("shm_") else 0.0)
    for r in report["results"]:
        assert r["elapsed"] < BOUND_S, r
        if error is None:
            assert "error" not in r and r["rows_ok"] and r["transport"] == "tcp", r
        else:
            assert r.get("error") == error and text in r["message"], r
            assert "0.000000" not in r["message"], r  # a timeout names the bound it had
