"""The native poller's rdma source (client/tableclient/graph/poller/_native_c/verbs.c) on a host without RDMA: built where
libibverbs' headers are (CI installs them and requires it), while the poller itself (_native) neither links
libibverbs nor needs it to import; what cannot be opened is an OSError carrying errno, and the poller takes
nothing for an rdma source but a connected endpoint. Its reads are tested on Soft-RoCE in the guest
(tests/rdma/test_graphpoll_rdma.py)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from tableclient.graph.poller import native

REQUIRED = os.environ.get("TABLESERVER_REQUIRE_NATIVE") == "1"
HEADERS = any(os.path.exists(f"{d}/infiniband/verbs.h") for d in ("/usr/include", "/usr/local/include"))


def test_the_poller_imports_without_libibverbs_and_says_why_it_cannot_read_rdma():
    if REQUIRED:
        assert native.BUILT, "tableclient.graph.poller._native did not build: install gcc and python3-dev"
        if HEADERS:
            assert native.RDMA, f"tableclient.graph.poller._verbs did not build: {native.RDMA_MISSING}"
    if not native.BUILT:
        pytest.skip("tableclient.graph.poller._native is not built here")
    from tableclient.graph.poller import _native

    with open(_native.__file__, "rb") as f:
        assert b"libibverbs" not in f.read(), "_native links libibverbs: it would not import without it"
    assert native.RDMA == (native.RDMA_MISSING == "")
    if not native.RDMA:
        assert "libibverbs" in native.RDMA_MISSING


def test_an_endpoint_that_cannot_be_opened_is_an_oserror_with_errno():
    _graphverbs = pytest.importorskip("tableclient.graph.poller._verbs")
    with pytest.raises(OSError) as e:
        _graphverbs.Endpoint("no-such-device", 1, 0, 16, 8)
    assert e.value.errno in (errno.ENODEV, errno.ENOSYS), e.value  # ENOSYS: no RDMA at all here
    with pytest.raises(ValueError, match="port 1-255"):
        _graphverbs.Endpoint("rxe_lo", 0, 0, 16, 8)
    with pytest.raises(ValueError, match="max_rows and row_bytes > 0"):
        _graphverbs.Endpoint("rxe_lo", 1, 0, 0, 8)


def test_the_poller_takes_only_a_connected_endpoint_for_rdma():
    if not native.BUILT:
        pytest.skip("tableclient.graph.poller._native is not built here")
    from tableclient.graph.poller import _native

    flags = np.zeros(8, np.uint32)
    ids, staging = np.zeros(4, np.int64), np.zeros(4 * 8, np.uint8)
    p = _native.Poller(flags, [(0, 1, -1, ids, staging, 8, 1)], False)
    try:
        if native.RDMA:
            with pytest.raises(TypeError, match="not a tableclient.graph.poller._verbs.Endpoint"):
                p.set_rdma(0, object())
        else:
            with pytest.raises(ImportError):
                p.set_rdma(0, object())
        assert p.broken(0) is None  # refused: the slot is as it was
    finally:
        p.close()
