"""Graph mode eager_break: a served layer gathered on the host in vLLM's eager break.

This rank's columns copied to the host, the gather issued (``EngramRows.issue``, :func:`issue`: step start, from
``Engram.prepare_embeddings``), then waited for, copied to the device and dequantized (``EngramRows.collect``,
:func:`collect`: when the layer runs, from ``Engram._ready_rows``), both in functions decorated with vLLM's
``eager_break_during_capture`` (:mod:`tableclient.vllm.layers`): in vLLM's breakable (piecewise) graphs they run
eagerly between captured segments at every replay, on the same persistent buffers. Graph modes that would capture
them (FULL, or piecewise without breakable graphs) are refused with the flag to use. With tensor parallelism each
layer's rows are agreed in ``collect`` before vLLM's all-gather joins them, one MIN over vLLM's CPU group (gloo: the
rows and the decision are the host's, so no GPU stream is waited for): every rank serves the table's rows, or every
rank zeros (counted where a rank's own rows were masked), or under policy ``fail`` every rank raises at that layer
of that step, naming where it failed.
"""

from __future__ import annotations

from tableclient.engine.plugin import PluginError
from tableclient.engine.ranks import served_alike
from tableclient.vllm.ranks import tp_ranks
from tableclient.vllm.state import PIECEWISE_FLAG, rows


def issue(engram, hash_ids) -> None:
    """Step start (eager, also between captured segments): this rank's columns to the host, gather issued."""
    _refuse_capture(engram, hash_ids)
    embed = engram.embed_tokens
    rows().issue(embed.layer, embed.columns(hash_ids), key=_key(hash_ids))


def collect(engram, out) -> None:
    """The layer runs (eager): its rows waited for, dequantized into ``out`` (its persistent staged rows). With
    tensor parallelism the ranks agree on them first (:func:`~tableclient.engine.ranks.served_alike`: one MIN over
    vLLM's tensor-parallel CPU group, before the layer's all-gather): every rank the table's rows, or every rank
    zeros, or every rank raises PluginError at this layer of this step (policy fail), never one rank alone."""
    import torch

    _refuse_capture(engram, out)
    embed = engram.embed_tokens
    packed = served_alike(tp_ranks(), rows(), embed.layer, lambda: rows().collect(embed.layer, key=out.shape[0]))
    if packed is None:  # a rank served the policy's rows: every rank serves zeros
        out.zero_()
        return
    embed.dequantize_into(packed, out)
    if out.is_cuda:
        copied = torch.cuda.Event()
        copied.record()
        rows().fence(f"layer{embed.layer}", copied)  # the next issue refills the staging after this copy


def _key(hash_ids) -> int:
    """What pairs a collect with its issue: the step's token count (each issue is collected once)."""
    return hash_ids.shape[0]


def _refuse_capture(engram, t) -> None:
    import torch

    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise PluginError(
            f"tableserver plugin: Engram layer {engram.embed_tokens.layer}'s gather is being captured into a CUDA "
            f"graph (vLLM ran its eager break inline): launch vLLM with {PIECEWISE_FLAG} (or --enforce-eager)"
        )
