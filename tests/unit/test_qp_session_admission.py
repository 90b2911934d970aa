"""How a native poller's QP session is tied to its main session's daemon (tableclient.node): the catalog it gets
must be the main session's, table by table, and the server the main session's node and start of it. The QP
sessions themselves, on real daemons behind a shared address, are in tests/rdma/test_qp_sessions.py."""

from __future__ import annotations

import dataclasses

from tableclient.node import catalog_difference, daemon_difference
from tableclient.table import TableInfo

from tableserver.v1 import tableserver_pb2 as pb

LAYER14 = TableInfo(1, "engram.layer14", 70_001, 264, "uint8", (70_001, 264), 14, 1, "crc32:0badf00d", 70_001 * 264,
                    70_001, 0, "memory")  # fmt: skip
TINY = TableInfo(3, "tiny", 1, 8, "uint8", (1, 8), -1, 1, "crc32:00000001", 8, 1, 0, "memory")
MINE = [LAYER14, TINY]


def server(**kw) -> pb.ServerInfo:
    fields = dict(version="1", host_id="host-a", node_id="n1", instance_id="5f0c0ffee0ddf00d")
    fields.update(kw)
    return pb.ServerInfo(**fields)


def test_the_same_catalog_in_any_order_is_admitted():
    assert catalog_difference(MINE, list(reversed(MINE))) is None


def test_another_version_of_a_table_is_named_by_its_identity():
    other = dataclasses.replace(LAYER14, checksum="crc32:feedface")
    assert catalog_difference(MINE, [other, TINY]) == (
        "table 'engram.layer14' there is crc32:feedface (70001 rows of 264 B), the session's crc32:0badf00d "
        "(70001 rows of 264 B)"
    )
    rows = dataclasses.replace(LAYER14, total_rows=70_002, rows=70_002, nbytes=70_002 * 264)
    assert "70002 rows of 264 B), the session's crc32:0badf00d (70001 rows" in catalog_difference(MINE, [rows, TINY])
    wide = dataclasses.replace(LAYER14, row_bytes=528, nbytes=70_001 * 528)
    assert "(70001 rows of 528 B), the session's" in catalog_difference(MINE, [wide, TINY])


def test_the_same_table_held_elsewhere_or_otherwise_is_refused_naming_the_fields():
    """Same identity, other rows held (another shard), another index, tier: each field named."""
    shard = dataclasses.replace(LAYER14, rows=35_000, row_lo=35_001, nbytes=35_000 * 264)
    assert catalog_difference(MINE, [shard, TINY]) == (
        "table 'engram.layer14' there has rows 35000 (the session's 70001), nbytes 9240000 (the session's "
        "18480264), row_lo 35001 (the session's 0)"
    )
    moved = dataclasses.replace(LAYER14, index=2)
    assert catalog_difference(MINE, [moved, TINY]) == "table 'engram.layer14' there has index 2 (the session's 1)"
    disk = dataclasses.replace(LAYER14, tier="disk")
    assert "tier 'disk' (the session's 'memory')" in catalog_difference(MINE, [disk, TINY])


def test_a_table_missing_or_extra_is_refused():
    assert catalog_difference(MINE, [LAYER14]) == "table 'tiny' is not served there"
    extra = dataclasses.replace(TINY, index=4, name="more")
    assert catalog_difference(MINE, [*MINE, extra]) == "3 tables there, the session's 2"


def test_only_the_same_node_and_start_of_it_is_the_sessions_daemon():
    mine = server()
    assert daemon_difference(mine, server()) is None
    assert daemon_difference(mine, server(node_id="n2")) == "node 'n2' there, the session's 'n1'"
    assert daemon_difference(mine, server(host_id="host-b")) == (
        "node 'n1' there runs on host 'host-b', the session's on 'host-a'"
    )
    assert daemon_difference(mine, server(instance_id="0123456789abcdef")) == (
        "node 'n1' there is another start of it (instance '0123456789abcdef', the session's '5f0c0ffee0ddf00d')"
    )
    assert "instance 'none'" in daemon_difference(mine, server(instance_id=""))  # an older tableserver


def test_a_main_session_on_a_server_that_names_no_instance_ties_nothing_to_it():
    """An older tableserver names no instance: no QP session can be tied to it (the Python poller serves)."""
    old = server(instance_id="", version="0.0.9")
    assert daemon_difference(old, server(instance_id="", version="0.0.9")) == (
        "node 'n1' names no instance (tableserver 0.0.9, older than this client)"
    )
