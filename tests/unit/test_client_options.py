"""TableClient's options: the flat keyword arguments build the same option groups as passing them.

Pure logic: no server. Every keyword argument TableClient has always taken still works, each option's
default is its group's, and values out of bounds fail with a ValueError naming the argument.
"""

from __future__ import annotations

import math

import pytest
from tableclient.node import NodeOptions
from tableclient.options import ClientOptions, client_options
from tableclient.routing import RoutingOptions
from tableclient.routing.identity import Pins
from tableclient.table import TableInfo
from tableclient.transports import TransportOptions

#: every keyword argument of TableClient before the options groups, with a value other than its default
FLAT = dict(
    token="t",
    tls=True,
    tls_ca="ca.pem",
    tls_cert="cert.pem",
    tls_key="key.pem",
    tls_server_name="memnode",
    client_name="worker",
    connect_timeout=3.0,
    mode="pack",
    rdma_device="mlx5_0",
    rdma_gid_index=3,
    rdma_port=2,
    rdma_qps=8,
    rdma_ring_rows=1024,
    client_id="c1",
    checksums={"t": "abc"},
    request_timeout=4.0,
    liveness_timeout=1.0,
    keepalive_interval=0.25,
    dns_refresh=9.0,
    standby=False,
    hedge_after=0.002,
    hedge_fraction=0.25,
    reconnect_wait=1.5,
    busy_poll=0.001,
)
#: which group each of them belongs to
CONNECTION = (
    "token", "tls", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "client_name", "connect_timeout",
    "keepalive_interval",
)  # fmt: skip
TRANSPORTS = ("busy_poll", "rdma_device", "rdma_gid_index", "rdma_port", "rdma_qps", "rdma_ring_rows")
ROUTING = ("client_id", "request_timeout", "liveness_timeout", "dns_refresh", "standby", "reconnect_wait")
OWN = ("mode", "hedge_after", "hedge_fraction", "checksums")


def test_the_flat_arguments_build_the_groups():
    built = client_options(transport="tcp", **FLAT)
    assert sorted(CONNECTION + TRANSPORTS + ROUTING + OWN) == sorted(FLAT)  # each lands in one group

    def pick(names):
        return {k: FLAT[k] for k in names}

    assert built == ClientOptions(
        connection=NodeOptions(
            transport="tcp", transport_options=TransportOptions(**pick(TRANSPORTS)), **pick(CONNECTION)
        ),
        routing=RoutingOptions(**pick(ROUTING)),
        **pick(OWN),
    )


def test_defaults_are_the_groups_and_flat_arguments_apply_on_top_of_options():
    assert client_options() == ClientOptions()
    base = ClientOptions(routing=RoutingOptions(request_timeout=7.0), mode="pack")
    o = client_options(base, client_id="c2")
    assert (o.routing.request_timeout, o.routing.client_id, o.mode) == (7.0, "c2", "pack")
    assert client_options(base) is base


def test_an_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'rdma_qp'"):
        client_options(rdma_qp=4)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(transport="udp"), "unknown transport"),
        (dict(mode="write"), "unknown gather mode"),
        (dict(rdma_qps=65), "rdma_qps must be"),
        (dict(rdma_ring_rows=8), "rdma_ring_rows at least"),
        (dict(request_timeout=0), "request_timeout must be seconds above 0"),
        (dict(keepalive_interval=-1.0), "keepalive_interval must be seconds above 0"),
        (dict(busy_poll=0.5), "busy_poll must be"),
        (dict(idle_check=-1.0), "idle_check must be seconds >= 0"),
        (dict(idle_check=float("nan")), "idle_check must be seconds >= 0"),
        (dict(hedge_fraction=0.0), "hedge_fraction"),
        (dict(hedge_after=0.0), "hedge_after"),
        (dict(backoff_min=0.0), "backoff_min must be > 0"),
        (dict(backoff_min=2.0, backoff_max=1.0), "at most backoff_max"),
    ],
)
def test_values_out_of_bounds_name_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        client_options(**bad)


@pytest.mark.parametrize("value", [math.inf, 1e10, math.nan, 86400.5])
@pytest.mark.parametrize("name", ["request_timeout", "connect_timeout", "liveness_timeout", "hedge_after"])
def test_timeouts_are_finite_and_at_most_a_day(name, value):
    """Issue 50, item 7: a timeout becomes a deadline, natively an int64 of nanoseconds; inf or 1e10 s
    overflowed it (every step released at once with zeros), nan compares false with everything. Refused
    where accepted, one line naming the option; a day is taken."""
    with pytest.raises(ValueError, match=f"{name} must be seconds above 0 and at most 86400"):
        client_options(**{name: value})
    client_options(**{name: 86400.0})


@pytest.mark.parametrize("value", ["inf", "1e10", "nan", "-1"])
def test_the_plugins_timeouts_are_finite_and_at_most_a_day(value):
    from tableclient.engine import ConfigError, PluginConfig

    for name, env in (("timeout", "TABLESERVER_TIMEOUT"), ("liveness_timeout", "TABLESERVER_LIVENESS_TIMEOUT")):
        with pytest.raises(ConfigError, match=f"{name} must be seconds above 0 .* \\({env}\\)"):
            PluginConfig.load({env: value})
    with pytest.raises(ConfigError, match="gather_budget"):
        PluginConfig.load({"TABLESERVER_GATHER_BUDGET": value if value != "-1" else "inf"})


def _info(name: str, checksum: str, rows: int = 10, row_bytes: int = 8) -> TableInfo:
    return TableInfo(0, name, rows, row_bytes, "uint8", (rows, row_bytes), 0, 1, checksum, rows * row_bytes, rows)


def test_pins_keep_the_first_identity_seen_or_the_checksum_given():
    pins = Pins({"b": "given"})
    assert pins.mismatch([_info("a", "x"), _info("b", "given")]) is None
    assert pins.mismatch([_info("a", "x")]) is None
    t, pin = pins.mismatch([_info("a", "x", rows=11)])
    assert (t.name, pin) == ("a", ("x", 10, 8))
    t, pin = Pins({"b": "given"}).mismatch([_info("b", "other")])
    assert (t.name, pin) == ("b", ("given", None, None))
