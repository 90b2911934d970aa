"""What a TableClient is told besides its address: groups of options, each default defined once.

    TableClient("memnode:7070", options=ClientOptions(
        connection=NodeOptions(transport="tcp", token=token,            # how every node is reached
                               transport_options=TransportOptions(rdma_qps=8)),
        routing=RoutingOptions(request_timeout=5.0),                     # replicas, fail-over, timeouts
        hedge_after=2e-3))

The flat keyword arguments (``TableClient(address, "tcp", token=token, request_timeout=5.0,
rdma_qps=8)``) build the same objects (:func:`client_options`): each names a field of one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from tableclient.bounds import check_timeout
from tableclient.node import NodeOptions
from tableclient.routing import RoutingOptions
from tableclient.table import check_mode
from tableclient.transports import KNOWN, TransportOptions

#: the most a tcp reader may spin on its socket per wait (a core busy that long)
MAX_BUSY_POLL_S = 0.01
#: queue pairs per rdma session a client may ask for, and the fewest ring rows per table and QP
MAX_RDMA_QPS = 64
MIN_RDMA_RING_ROWS = 16


@dataclass(frozen=True)
class ClientOptions:
    """Every option of a TableClient: ``connection`` (how each node is reached, its data transports'
    set-up in ``connection.transport_options``), ``routing`` and the gathers' own."""

    connection: NodeOptions = field(default_factory=NodeOptions)
    routing: RoutingOptions = field(default_factory=RoutingOptions)
    mode: str = "read"  # gathers' default mode: "read" (one-sided RDMA reads) or "pack"
    hedge_after: float | None = None  # plain gathers: re-issue on another replica when missing this long
    hedge_fraction: float = 0.5  # the step API hedges each layer at this share of its window instead
    checksums: dict | None = None  # {table: checksum} to pin instead of the first seen

    def check(self) -> ClientOptions:
        """These options, or ValueError naming the first one out of bounds (by its flat name)."""
        c, r, t = self.connection, self.routing, self.connection.transport_options
        if c.transport != "auto" and c.transport not in KNOWN:
            raise ValueError(f"unknown transport {c.transport!r}: use auto, {', '.join(KNOWN)}")
        check_mode(self.mode)
        if not 1 <= t.rdma_qps <= MAX_RDMA_QPS or t.rdma_ring_rows < MIN_RDMA_RING_ROWS:
            raise ValueError(f"rdma_qps must be 1..{MAX_RDMA_QPS} and rdma_ring_rows at least {MIN_RDMA_RING_ROWS}")
        for name, value in (
            ("connect_timeout", c.connect_timeout),
            ("request_timeout", r.request_timeout),
            ("liveness_timeout", r.liveness_timeout),
            ("keepalive_interval", c.keepalive_interval),
            ("dns_refresh", r.dns_refresh),
        ):
            check_timeout(name, value)
        if not t.idle_check >= 0:  # nan too; inf: never look first (a request sent into a closed one is re-sent)
            raise ValueError(f"idle_check must be seconds >= 0 (inf: never look before sending), got {t.idle_check!r}")
        if not 0 <= t.busy_poll <= MAX_BUSY_POLL_S:
            raise ValueError(
                f"busy_poll must be 0..{MAX_BUSY_POLL_S:g} seconds (a core spins this long per wait), got {t.busy_poll!r}"
            )
        check_timeout("backoff_max", r.backoff_max)
        if not 0 < r.backoff_min <= r.backoff_max:
            raise ValueError(
                f"backoff_min must be > 0 seconds and at most backoff_max, got {r.backoff_min!r}, {r.backoff_max!r}"
            )
        if not 0 < self.hedge_fraction <= 1:
            raise ValueError(f"hedge_fraction must be in (0, 1], got {self.hedge_fraction!r}")
        if self.hedge_after is not None:
            check_timeout("hedge_after", self.hedge_after)
        return self


#: NodeOptions' field that is no flat keyword argument: a group of its own
_NOT_FLAT = ("transport_options",)

#: flat keyword argument -> (group, field); the group None is ClientOptions itself
_FLAT = {
    **{f.name: ("connection", f.name) for f in fields(NodeOptions) if f.name not in _NOT_FLAT},
    **{f.name: ("transports", f.name) for f in fields(TransportOptions)},
    **{f.name: ("routing", f.name) for f in fields(RoutingOptions)},
    **{f.name: (None, f.name) for f in fields(ClientOptions) if f.name not in ("connection", "routing")},
}


def client_options(options: ClientOptions | None = None, **settings) -> ClientOptions:
    """``options`` (default: every default) with TableClient's flat keyword arguments applied, checked;
    TypeError for a name that is no option."""
    groups: dict = {"connection": {}, "transports": {}, "routing": {}, None: {}}
    for key, value in settings.items():
        if key not in _FLAT:
            raise TypeError(f"TableClient.__init__() got an unexpected keyword argument {key!r}")
        group, name = _FLAT[key]
        groups[group][name] = value
    o = options if options is not None else ClientOptions()
    if any(groups.values()):
        c = o.connection
        transports = replace(c.transport_options, **groups["transports"])
        o = replace(
            o,
            connection=replace(c, transport_options=transports, **groups["connection"]),
            routing=replace(o.routing, **groups["routing"]),
            **groups[None],
        )
    return o.check()
