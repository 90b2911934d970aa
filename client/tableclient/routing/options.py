"""What a client may set about routing, and the fixed timings of routing's threads and waits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingOptions:
    client_id: str = ""  # rendezvous key (default hostname:pid)
    request_timeout: float = 30.0  # a gather waited for without a timeout ends after this
    liveness_timeout: float = 2.0  # a node silent this long (no keepalive answer) is failed
    dns_refresh: float = 5.0  # seconds between re-resolutions of dns:/// addresses
    standby: bool = True  # keep a warm session on each shard's second replica
    reconnect_wait: float = 0.0  # a gather with no replica up waits this long for one (0: fail at once)
    backoff_min: float = 0.05  # a failed node's first retry comes this long after the failure
    backoff_max: float = 5.0  # ... doubling per failure up to this (and a refused node's every retry)


DEFAULT_ROUTING = RoutingOptions()


#: the maintenance thread's period (liveness checks, retries, DNS, warm sessions): the fast paths'
#: deferred metrics are applied at most this late
TICK_S = 0.05
#: a failed node's backoff doubles at most this many times (backoff_max bounds it long before)
BACKOFF_DOUBLINGS = 16
#: a gather waiting for a replica to come back looks again at least this often
REPLICA_WAIT_S = 0.1
#: past its hedge time a part's attempts are polled this often: a hedge may join at any moment, and
#: rdma needs the waiter to poll
HEDGE_POLL_S = 0.0005
#: the hedge thread, with nothing scheduled, looks for a close this often
HEDGER_IDLE_S = 0.5
#: a closing router waits at most this long for each of its threads
JOIN_S = 2.0
