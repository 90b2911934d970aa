"""The native poller's rdma source (client/tableclient/_graphverbs.c) on a host without RDMA: built where
libibverbs' headers are (CI installs them and requires it), while the poller itself (_graphpoll) neither links
libibverbs nor needs it to import; what cannot be opened is an OSError carrying errno, and the poller takes
nothing for an rdma source but a connected endpoint. Its reads are tested on Soft-RoCE in the guest
(tests/rdma/test_graphpoll_rdma.py)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from tableclient import graphpoll

REQUIRED = os.environ.get("TABLESERVER_REQUIRE_NATIVE") == "1"
HEADERS = any(os.path.exists(f"{d}/infiniband/verbs.h") for d in ("/usr/include", "/usr/local/include"))


def test_the_poller_imports_without_libibverbs_and_says_why_it_cannot_read_rdma():
    if REQUIRED:
        assert graphpoll.BUILT, "tableclient._graphpoll did not build: install gcc and python3-dev"
        if HEADERS:
            assert graphpoll.RDMA, f"tableclient._graphverbs did not build: {graphpoll.RDMA_MISSING}"
    if not graphpoll.BUILT:
        pytest.skip("tableclient._graphpoll is not built here")
    from tableclient import _graphpoll

    with open(_graphpoll.__file__, "rb") as f:
        assert b"libibverbs" not in f.read(), "_graphpoll links libibverbs: it would not import without it"
    assert graphpoll.RDMA == (graphpoll.RDMA_MISSING == "")
    if not graphpoll.RDMA:
        assert "libibverbs" in graphpoll.RDMA_MISSING


def test_an_endpoint_that_cannot_be_opened_is_an_oserror_with_errno():
    _graphverbs = pytest.importorskip("tableclient._graphverbs")
    with pytest.raises(OSError) as e:
        _graphverbs.Endpoint("no-such-device", 1, 0, 16, 8)
    assert e.value.errno in (errno.ENODEV, errno.ENOSYS), e.value  # ENOSYS: no RDMA at all here
    with pytest.raises(ValueError, match="port 1-255"):
        _graphverbs.Endpoint("rxe_lo", 0, 0, 16, 8)
    with pytest.raises(ValueError, match="max_rows and row_bytes > 0"):
        _graphverbs.Endpoint("rxe_lo", 1, 0, 0, 8)


def test_the_poller_takes_only_a_connected_endpoint_for_rdma():
    if not graphpoll.BUILT:
        pytest.skip("tableclient._graphpoll is not built here")
    from tableclient import _graphpoll

    flags = np.zeros(8, np.uint32)
    ids, staging = np.zeros(4, np.int64), np.zeros(4 * 8, np.uint8)
    p = _graphpoll.Poller(flags, [(0, 1, -1, ids, staging, 8, 1)], False)
    try:
        if graphpoll.RDMA:
            with pytest.raises(TypeError, match="not a tableclient._graphverbs.Endpoint"):
                p.set_rdma(0, object())
        else:
            with pytest.raises(ImportError):
                p.set_rdma(0, object())
        assert p.broken(0) is None  # refused: the slot is as it was
    finally:
        p.close()
