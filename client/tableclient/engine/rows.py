"""Engram rows from tableservers, for the layers of one serving worker process (any engine).

:class:`EngramRows` is the plugin's data side, free of SGLang: it holds one
:class:`~tableclient.TableClient` per tableserver (the memory node of
``remote`` layers, this host's server of ``node`` layers, the fallback), and
per server an :class:`~tableclient.step.EngramStep` whose persistent staging
buffers receive the rows.

* :meth:`prefetch` runs at step start, when the hasher has produced the
  step's row ids ``[T, layers, 24]``: every served layer's gather is issued at
  once, shortest window first (layer 1 is due 0.3 ms later, layer 14 9.3 ms).
* :meth:`rows` hands a layer its packed rows ``[..., 264]`` when it runs: the
  prefetched ones if the layer asks for exactly the ids that were prefetched
  (the same tensor the hasher returned, checked by identity, never by value),
  otherwise fetched now. The failure policy (fail / zeros / fallback) and the
  deadline accounting are the step's.
* :meth:`issue` / :meth:`collect` are the same per layer, for an engine that hands each layer its ids
  separately (vLLM's ``prepare_embeddings``): one layer's gather begun when it is issued, its rows
  when the layer runs. Ids equal to the engine's ``dead_id`` (vLLM's ``DEAD_ID``, padding and dummy
  runs) are never sent: their rows come back as zeros.
* :func:`dequantize` turns packed rows into bf16 with SGLang's arithmetic, or vLLM's
  (``exponent_scales``: the scale byte is the float32 exponent field); :func:`to_device` copies them
  to the device as fp8 values and e8m0 scales, for an engine that dequantizes there (SGLang).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass

from tableclient.engine.config import PluginConfig
from tableclient.errors import TableClientError
from tableclient.graph.poller.cpu import parse_cpus
from tableclient.model import ROWS_PER_TOKEN

FP8_BLOCK = 32


class EngramRowsError(TableClientError, RuntimeError):
    """A served layer cannot work as configured (wrong table, unreachable server); says what to fix."""


def dequantize(packed, dim: int, *, exponent_scales: bool = False):
    """uint8 ``[..., dim + dim/32]`` rows (fp8 e4m3 values, e8m0 block scales) -> bf16 ``[..., dim]``.

    ``bf16(float32(fp8) * float32(scale))`` per block of 32 values, one rounding. The scale is SGLang's
    (``EngramEmbedding._owned_rows``: the byte as ``float8_e8m0fnu``, byte 0 = 2**-127, 255 = NaN) or,
    with ``exponent_scales``, vLLM's (``_engram_lookup_kernel``: the byte shifted into the float32
    exponent field, byte 0 = 0.0, 255 = inf). The two agree on every byte but 0 and 255.
    """
    import torch

    weight = packed[..., :dim].contiguous().view(torch.float8_e4m3fn)
    if exponent_scales:
        scale = (packed[..., dim:].to(torch.int32) << 23).view(torch.float32)
    else:
        scale = packed[..., dim:].contiguous().view(torch.float8_e8m0fnu).float()
    values = weight.float().unflatten(-1, (-1, FP8_BLOCK)) * scale.unsqueeze(-1)
    return values.flatten(-2).to(torch.bfloat16)


def to_device(packed, dim: int, device, stream):
    """Host packed rows -> (device fp8 rows [N, dim], device e8m0 scales [N, dim/32], CUDA event), copied on
    ``stream``: the layout SGLang's ``dequant_staged`` reads."""
    import torch

    with torch.cuda.stream(stream):
        flat = packed.reshape(-1, packed.shape[-1]).to(device, non_blocking=True)
        weight, scale = flat[:, :dim].contiguous(), flat[:, dim:].contiguous()
        copied = torch.cuda.Event()
        copied.record()
    return weight, scale, copied


@dataclass
class ServedLayer:
    layer: int
    placement: str  # remote | node
    table: str
    window_s: float
    dim: int
    hash_index: int | None = None  # column of the hasher's output, when known
    graph_mode: str = (
        "before_replay"  # how its rows reach a captured decode graph (client/tableclient/sglang/graphs.py)
    )
    columns: int = ROWS_PER_TOKEN  # row ids per token this process gathers (fewer: a rank's share of the heads)


class EngramRows:
    """Rows of every ``remote``/``node`` Engram layer of this process; ``engine`` names the serving
    engine in the clients' names (the daemon's session list and logs). Row ids equal to ``dead_id``
    (an engine's marker for padding, e.g. vLLM's ``DEAD_ID = -1``) get zero rows and are never sent."""

    def __init__(self, config: PluginConfig, client_factory=None, engine: str = "sglang", dead_id: int | None = None):
        self.config = config
        self.engine = engine
        self.dead_id = dead_id
        self._client_factory = client_factory
        self.layers: dict[int, ServedLayer] = {}
        self._clients: dict[str, object] = {}  # remote / node / fallback -> TableClient
        # (channel, placement) -> EngramStep over that placement's layers. Channels keep apart the
        # forward's prefetch and the scheduler's staging (SGLang's EngramRowStager): separate buffers.
        self._steps: dict[tuple, object] = {}
        self._fences: dict[str, list] = {}  # channel -> copies out of its staging still in flight
        self._lock = threading.RLock()
        self._pending = None  # (weakref to the hasher's output, {layer: view geometry}) of the last prefetch
        # layer -> (key, ids collect fetches itself or None) of its issued, uncollected gather
        self._issued: dict[int, tuple] = {}
        self.served = {}  # layer -> rows served (prefetched, staged, fetched now): for logs and tests

    # ------------------------------------------------------------------ setup
    def client(self, role: str):
        """The TableClient of ``role`` (remote, node, fallback), connected on first use."""
        with self._lock:
            if role not in self._clients:
                self._clients[role] = self._connect(role)
            return self._clients[role]

    def _connect(self, role: str):
        from tableclient import TableClient, TableClientError

        c = self.config
        address = c.address_of(role)
        transport = {"remote": c.transport, "node": "shm", "fallback": "auto"}[role]
        factory = self._client_factory or TableClient
        try:
            client = factory(
                address,
                transport=transport,
                token=c.token or None,
                tls_ca=c.tls_ca or None,
                mode=c.mode,
                liveness_timeout=c.liveness_timeout,
                client_name=f"{self.engine}-{role}-{os.getpid()}",
            )
        except TableClientError as e:
            key = {"remote": "address", "node": "node_address", "fallback": "fallback_address"}[role]
            raise EngramRowsError(
                f"tableserver plugin: cannot reach the {role} tableserver at {address} ({e}); start it or fix {key}"
            ) from None
        logging.getLogger(f"tableclient.{self.engine}").info(  # the adapter's logger: tableclient.sglang, ...
            "tableserver plugin: %s tableserver %s connected over %s", role, address, client.transport
        )
        return client

    def add_layer(
        self, layer: int, placement: str, num_embeddings: int, dim: int, columns: int = ROWS_PER_TOKEN
    ) -> ServedLayer:
        """Registers a served layer and checks its table against what the engine would have allocated.
        ``columns``: row ids per token this process gathers for it (a tensor-parallel rank's heads)."""
        c = self.config
        served = ServedLayer(
            layer, placement, c.table(layer), c.window(layer), dim, graph_mode=c.graph_mode(layer), columns=columns
        )
        client = self.client(placement)
        info = client.tables.get(served.table)
        row_bytes = dim + dim // FP8_BLOCK
        where = c.address_of(placement)
        if info is None:
            raise EngramRowsError(
                f"tableserver plugin: layer {layer} is placed {placement} but {where} serves no "
                f"table {served.table!r} (it has {', '.join(client.tables) or 'none'}): name it "
                f"under [tables] or place the layer 'local'"
            )
        if (info.rows, info.row_bytes) != (num_embeddings, row_bytes):
            raise EngramRowsError(
                f"tableserver plugin: table {served.table!r} on {where} has {info.rows} rows of "
                f"{info.row_bytes} B but layer {layer} of this model needs {num_embeddings} rows "
                f"of {row_bytes} B: serve this model's tables (tableserver pack)"
            )
        if c.policy == "fallback":
            fb = self.client("fallback").tables.get(served.table)
            if fb is None or (fb.rows, fb.row_bytes) != (info.rows, info.row_bytes):
                raise EngramRowsError(
                    f"tableserver plugin: the fallback tableserver {c.fallback_address} does not "
                    f"serve {served.table!r} with {info.rows} rows of {info.row_bytes} B"
                )
        with self._lock:
            self.layers[layer] = served
            self.served.setdefault(layer, {"prefetched": 0, "staged": 0, "fetched": 0})
            for key in [k for k in self._steps if k[1] == placement and (len(k) == 2 or k[2] == layer)]:
                self._steps.pop(key).abandon()  # rebuilt with this layer on next use
        return served

    def set_hash_index(self, layer: int, index: int) -> None:
        with self._lock:
            self.layers[layer].hash_index = index

    def _step(self, placement: str, channel: str = "forward", layer: int | None = None):
        """The EngramStep over every served layer of ``placement`` (built once the layers are known), or
        over ``layer`` alone (the steps of :meth:`issue`)."""
        from tableclient.step import EngramStep, LayerPlan

        key = (channel, placement) if layer is None else (channel, placement, layer)
        step = self._steps.get(key)
        if step is None:
            layers = [s for s in self.layers.values() if s.placement == placement and layer in (None, s.layer)]
            c = self.config
            step = EngramStep(
                self.client(placement),
                [LayerPlan(s.layer, s.table, s.window_s, c.mode) for s in layers],
                c.max_tokens,
                rows_per_token=max(s.columns for s in layers),
                policy=c.policy,
                fallback=self.client("fallback") if c.policy == "fallback" else None,
                timeout=c.timeout,
                deadlines=channel == "forward",
                dead_id=self.dead_id,
            )
            self._steps[key] = step
        return step

    def graph_steps(self, max_tokens: int, device, side_stream: bool = True, agree=None,
                    results_check: bool = False, modes: tuple = ("before_replay", "in_graph", "device"),
                    rows_per_token: int = 24, tables: dict | None = None, poller: str = "auto",
                    placements=None) -> dict:  # fmt: skip
        """placement -> the GraphStep of its before_replay, in_graph and device layers (eager_break layers
        fetch when they run): every buffer a decode graph of up to ``max_tokens`` tokens touches, allocated
        now, before capture. ``tables`` (table name -> DeviceTable): the device layers' tables as the ranks
        agreed on them (:func:`tableclient.engine.ranks.register_tables`); a device layer whose table is not
        there is registered by its GraphStep, or takes before_replay where it cannot be (the GraphStep logs
        why): its ServedLayer says so from then on. ``agree`` and ``results_check``: as GraphStep takes them (the
        ranks' agreement on each step's rows; the check where results are read). ``modes``: only the layers in
        these graph modes; ``rows_per_token``: the ids a token has here (a tensor-parallel rank's share of the 24
        hash columns under vLLM); ``poller``: who serves the in_graph layers (GraphStep's); ``placements``: only
        these placements' GraphSteps (default every one)."""
        from tableclient.graph import GraphStep
        from tableclient.step import LayerPlan

        c = self.config
        out = {}
        with self._lock:
            for placement in sorted({s.placement for s in self.layers.values()}):
                if placements is not None and placement not in placements:
                    continue
                layers = [s for s in self.layers.values() if s.placement == placement and s.graph_mode in modes]
                if not layers:
                    continue
                out[placement] = GraphStep(
                    self.client(placement),
                    [LayerPlan(s.layer, s.table, s.window_s, c.mode) for s in layers],
                    {s.layer: s.graph_mode for s in layers},
                    max_tokens,
                    rows_per_token=rows_per_token,
                    dead_id=self.dead_id,
                    policy=c.policy,
                    fallback=self.client("fallback") if c.policy == "fallback" else None,
                    device=device,
                    timeout=c.timeout,
                    side_stream=side_stream,
                    realtime=c.poller_priority == "realtime",
                    poller_cpus=parse_cpus(c.poller_cpus),
                    budgets={s.layer: c.gather_budget for s in layers} if c.gather_budget else None,
                    agree=agree,
                    results_check=results_check,
                    tables=tables,
                    poller=poller,
                )
                for s in layers:
                    s.graph_mode = out[placement].modes[s.layer]
        return out

    # ------------------------------------------------------------------ a step
    def prefetch(self, hash_ids, channel: str = "forward") -> bool:
        """Issues every served layer's gather for the step's ids ``[T, layers, C]`` (the hasher's output).

        Shortest window first across servers. Returns False when nothing was issued (no layer knows its
        column, an empty step, or more tokens than the staging holds: those layers fetch when they run).
        Channel "forward" is the model's step start; "stage" the scheduler preparing the next batch.
        """
        with self._lock:
            for copy in self._fences.pop(channel, []):  # copies still reading the staging about to be refilled
                copy.synchronize()
            served = [s for s in self.layers.values() if s.hash_index is not None]
            tokens = hash_ids.shape[0]
            if channel == "forward":
                self._pending = None
            if not served or tokens == 0 or tokens > self.config.max_tokens:
                return False
            host = hash_ids.detach().to("cpu", copy=True)  # ours: the caller may refill its tensor
            by_placement: dict[str, dict] = {}
            for s in sorted(served, key=lambda s: s.window_s):
                by_placement.setdefault(s.placement, {})[s.layer] = host[:, s.hash_index].numpy()
            order = sorted(by_placement, key=lambda p: min(self.layers[layer].window_s for layer in by_placement[p]))
            for placement in order:
                self._step(placement, channel).begin_step(by_placement[placement])
            if channel == "forward":
                root = hash_ids if hash_ids._base is None else hash_ids._base
                self._pending = (
                    weakref.ref(root),
                    {s.layer: (_geometry(hash_ids[:, s.hash_index]), host[:, s.hash_index]) for s in served},
                )
            return True

    def rows(self, layer: int, indices):
        """Packed rows ``[*indices.shape, row_bytes]`` (uint8, host) of a served layer for ``indices``.

        Returns ``(rows, staged)``: ``staged`` when they are a view of the layer's persistent staging
        (valid until the next prefetch), else a fresh array.
        """
        import torch

        with self._lock:
            s = self.layers[layer]
            step = self._step(s.placement)
            if layer in step.pending() and self._is_prefetched(layer, indices):
                self.served[layer]["prefetched"] += 1
                return step.wait(layer), True
            self.served[layer]["fetched"] += 1
            return torch.from_numpy(step.gather_now(layer, indices.detach().to("cpu").numpy())), False

    def _is_prefetched(self, layer: int, indices) -> bool:
        """Whether ``indices`` are the ids prefetched for ``layer``: the very view of the hasher's output
        (identity, no copy), or else equal in value (e.g. copied into a CUDA graph's static buffer)."""
        if self._pending is None:
            return False
        ref, by_layer = self._pending
        if layer not in by_layer:
            return False
        geometry, host = by_layer[layer]
        root = indices if indices._base is None else indices._base
        if ref() is root and geometry == _geometry(indices):
            return True
        return tuple(indices.shape) == tuple(host.shape) and bool((indices.detach().to("cpu") == host).all())

    def fetch(self, layer: int, ids, channel: str = "stage"):
        """A layer's rows for ``ids`` now, through ``channel``'s step (fresh host array, policy applied)."""
        import torch

        with self._lock:
            self.served[layer]["fetched"] += 1
            return torch.from_numpy(
                self._step(self.layers[layer].placement, channel).gather_now(layer, ids.detach().to("cpu").numpy())
            )

    def staged(self, layer: int, channel: str = "stage"):
        """The rows of ``layer`` issued by ``prefetch(..., channel)``: ``[T, C, row_bytes]`` of its staging."""
        with self._lock:
            self.served[layer]["staged"] += 1
            return self._step(self.layers[layer].placement, channel).wait(layer)

    # ------------------------------------------------------------------ one layer at a time
    def issue(self, layer: int, ids, key=None) -> bool:
        """Begins ``layer``'s gather for host ids ``[T, C]`` now, on that layer's own step (its staging,
        its deadline accounting); :meth:`collect` with the same ``key`` hands the rows over. Returns False
        when nothing was issued (an empty step, more tokens than the staging holds, or every id dead):
        ``collect`` fetches those ids then (nothing for dead ones). A gather issued before for the layer and never collected is cancelled."""
        import numpy as np

        with self._lock:
            self._issued.pop(layer, None)
            step = self._step(self.layers[layer].placement, "forward", layer)
            step.abandon()
            for copy in self._fences.pop(f"layer{layer}", []):  # copies still reading the staging
                copy.synchronize()
            ids = np.asarray(ids)
            if len(ids) == 0 or len(ids) > self.config.max_tokens or self._all_dead(ids):
                self._issued[layer] = (key, ids)  # collect: fetched then (or zeros, sending nothing)
                return False
            step.begin_step({layer: ids})  # the step sends the live ids alone
            self._issued[layer] = (key, None)
            return True

    def collect(self, layer: int, key=None):
        """The packed rows ``[T, C, row_bytes]`` (uint8, host) of ``layer``'s gather issued with ``key``:
        a view of its staging, valid until its next :meth:`issue` (hand a copy out of it to :meth:`fence`
        with channel ``f"layer{layer}"``), or a fresh array where ``issue`` could not stage them. Dead ids'
        rows are zero. Each issue is collected once; with none issued under ``key``, EngramRowsError
        (never another step's rows)."""
        with self._lock:
            step = self._step(self.layers[layer].placement, "forward", layer)
            issued = self._issued.pop(layer, None)
            if issued is None or issued[0] != key:
                step.abandon()
                raise EngramRowsError(
                    f"tableserver plugin: Engram layer {layer} asked for rows that were not issued at step start"
                )
            _, later = issued
            if later is not None:
                return self.fetch_now(layer, later)
            rows = step.wait(layer)  # the dead ids' rows zeroed by the step
            self.served[layer]["prefetched"] += 1
        return rows

    def _all_dead(self, ids) -> bool:
        """Whether every id of ``ids`` is the engine's dead id (a dummy run's or padding's)."""
        return self.dead_id is not None and bool((ids == self.dead_id).all())

    def fetch_now(self, layer: int, ids):
        """``layer``'s packed rows for host ids of any shape, gathered now into a fresh array (its own
        step's failure policy; dead ids' rows zero, and no request at all when every id is dead). An
        issued gather of the layer is left alone."""
        import numpy as np
        import torch

        with self._lock:
            ids = np.asarray(ids)
            if self._all_dead(ids):  # a dummy run's or padding's ids: nothing to fetch
                s = self.layers[layer]
                return torch.zeros((*ids.shape, s.dim + s.dim // FP8_BLOCK), dtype=torch.uint8)
            step = self._step(self.layers[layer].placement, "forward", layer)
            rows = torch.from_numpy(step.gather_now(layer, ids))  # the live ids alone sent, dead rows zero
            self.served[layer]["fetched"] += 1
        return rows

    def zeros_served(self, layer: int) -> int:
        """Waits and gathers of ``layer`` whose rows the failure policy served as zeros so far, over every step of
        this process that holds the layer (what tells a step served the policy's rows from one served the table's)."""
        with self._lock:
            return sum(step.stats[layer].zeros_served for step in self._steps.values() if layer in step.stats)

    def fence(self, channel: str, copy) -> None:
        """``copy`` (anything with ``synchronize()``, e.g. a CUDA event) still reads ``channel``'s staging:
        the next prefetch on that channel waits for it before overwriting the buffers."""
        with self._lock:
            self._fences.setdefault(channel, []).append(copy)

    def summary(self) -> dict:
        """Per layer: placement, table, rows prefetched / staged / fetched, and the forward's deadline figures."""
        out = {}
        for layer, s in self.layers.items():
            step = self._steps.get(("forward", s.placement, layer)) or self._steps.get(("forward", s.placement))
            stats = step.summary().get(layer, {}) if step is not None else {}
            out[layer] = {"placement": s.placement, "table": s.table, **self.served.get(layer, {}), **stats}
        return out

    def close(self) -> None:
        with self._lock:
            for step in self._steps.values():
                step.abandon()
            self._steps.clear()
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def _geometry(t) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
