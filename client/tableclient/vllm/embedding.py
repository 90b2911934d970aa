"""The embedding a served Engram layer gets in place of vLLM's ``ParallelEngramEmbedding``: no table.

It keeps vLLM's head sharding: tensor-parallel rank ``r`` of ``tp`` owns hash columns
``[r * part, (r + 1) * part)`` with ``part = ceil(columns / tp)`` (columns past the last are padding:
zero rows), so each rank gathers only its share of a token's rows and vLLM's own ``Engram.embed``
joins the ranks' shares (its all-gather over heads, or over tokens with sequence parallelism) exactly
as it does for a local table. Every data-parallel replica gathers its own tokens' rows: ``dp_size`` is
1, as for vLLM's shared host tables, so no data-parallel collective is entered.

``weight`` and ``weight_scale_inv`` exist, so vLLM's loader finds them by name, but hold no rows; their
loader drops what it is handed (the plugin's hooks keep the checkpoint's table tensors from being read
at all where the load format allows: ``loading``).

In graph modes ``device`` and ``in_graph`` (``graph_mode``, set by the hooks) the layer's rows come from the
plugin's :class:`~tableclient.graph.step.GraphStep` (a kernel's gather from the node's registered mapping, or
the host's, waited for inside vLLM's graphs); the layer dequantizes them with the same arithmetic as the
host path (:meth:`RemoteEngramEmbedding.dequantize_into`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tableclient.engine.rows import FP8_BLOCK, dequantize

log = logging.getLogger(__name__)


class RemoteEngramEmbedding(nn.Module):
    """One Engram layer's rows from a tableserver (``rows``: the process's ``EngramRows``)."""

    cpu_offload = False  # vLLM's Engram then keeps no prefetch stream for it: its rows come from the plugin
    peer_rows = 0
    graph_mode = "eager_break"  # device | in_graph (its GraphStep's rows) | eager_break, as the hooks decided

    def __init__(
        self,
        rows,
        layer: int,
        num_embeddings: int,
        dim: int,
        head_sizes: tuple,
        tp_size: int,
        tp_rank: int,
        block_size: int = FP8_BLOCK,
    ):
        super().__init__()
        self.rows, self.layer = rows, layer
        self.num_embeddings, self.dim, self.block_size = num_embeddings, dim, block_size
        self.n_hash_cols = len(head_sizes)
        self.tp_size, self.dp_size = tp_size, 1
        self.part_n_hash_cols = -(-self.n_hash_cols // tp_size)
        self.head_start = tp_rank * self.part_n_hash_cols
        self.head_end = min(self.head_start + self.part_n_hash_cols, self.n_hash_cols)
        self.vocab_start_idx, self.vocab_end_idx = 0, num_embeddings  # ids are global: the server has every row
        self.part_num_embeddings = 0
        self.discarded_bytes = 0
        weight = torch.empty(0, dim, dtype=torch.float8_e4m3fn)  # on whatever device vLLM builds the model
        scales = torch.empty(0, dim // block_size, dtype=torch.uint8)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        for param in (self.weight, self.weight_scale_inv):
            param.weight_loader = self._discard

    def _discard(self, param, loaded_weight, *args, **kwargs) -> None:
        """vLLM's loader hands a served table's tensor here when its load format read it anyway."""
        first = self.discarded_bytes == 0
        self.discarded_bytes += loaded_weight.numel() * loaded_weight.element_size()
        if first:
            log.info(
                "tableserver plugin: Engram layer %d: this load format read its table tensors from the checkpoint; "
                "they are dropped (vLLM's default safetensors loading does not read them)",
                self.layer,
            )

    # ------------------------------------------------------------------ this rank's columns
    def columns(self, hash_ids):
        """``hash_ids [T, n_hash_cols]`` (any device, int32 or int64) -> this rank's ``[T, part]`` on the
        host, int64; padding columns hold the dead id (their rows are zero)."""
        ids = hash_ids[:, self.head_start : self.head_end].to("cpu", torch.int64)
        pad = self.part_n_hash_cols - ids.shape[1]
        if pad:
            ids = nn.functional.pad(ids, (0, pad), value=self.rows.dead_id)
        return ids.numpy()

    def dequantize_into(self, packed, out) -> None:
        """Packed host rows ``[T, part, dim + dim/32]`` -> ``out [T, part, dim]`` bf16 (on ``out``'s device),
        with vLLM's arithmetic (``_engram_lookup_kernel``: the scale byte is the float32 exponent)."""
        if out.is_cuda:
            packed = packed.to(out.device, non_blocking=True)
        out.copy_(dequantize(packed, self.dim, exponent_scales=True))

    # ------------------------------------------------------------------ ParallelEngramEmbedding's interface
    def lookup(self, indices, out, background: bool = False) -> None:
        """Like vLLM's: this rank's columns of ``indices`` into ``out`` (bf16 ``[T, part, dim]`` or packed
        uint8 ``[T, part, dim + dim/32]``), gathered now."""
        if indices.shape[0] == 0:
            return
        packed = self.rows.fetch_now(self.layer, self.columns(indices))
        if out.dtype == torch.uint8:
            out.copy_(packed.to(out.device))
        else:
            self.dequantize_into(packed, out)

    def forward(self, indices):
        """``indices [T, n_hash_cols]`` -> bf16 ``[T, n_hash_cols, dim]``: every column's rows, gathered
        now on this rank (no collective)."""
        ids = indices.to("cpu", torch.int64).numpy()
        out = torch.empty((indices.shape[0], self.n_hash_cols, self.dim), dtype=torch.bfloat16, device=indices.device)
        if indices.shape[0]:
            self.dequantize_into(self.rows.fetch_now(self.layer, ids), out)
        return out

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, num_embeddings={self.num_embeddings}, dim={self.dim}, "
            f"columns={self.head_start}..{self.head_end - 1} of {self.n_hash_cols} (from a tableserver)"
        )
