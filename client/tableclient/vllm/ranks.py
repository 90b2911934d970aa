"""vLLM's process groups as the plugin's ranks see them: the tensor-parallel group the ranks decide alike over
(:mod:`tableclient.engine.ranks`), the all-reduce each step's rows-ok is reduced with inside vLLM's graphs, and
the parallel layout whose steps the plugin cannot check (pipeline parallelism, refused at start-up in one line).

Ranks (tensor parallelism) agree: each layer's graph mode and the poller are decided once at start-up over the
tensor-parallel group (a device table that one rank cannot register puts the layer on the host path on every rank),
each step every device and in_graph layer's rows-ok is reduced inside the step with vLLM's all-reduce
(:mod:`tableclient.vllm.graphs`), and an eager_break layer's rows are agreed in its eager break
(:mod:`tableclient.vllm.eager`): every rank serves the table's rows, or every rank the policy's, and policy ``fail``
raises on every rank at the same step. Where there are no process groups (layers built outside vLLM's workers),
one rank.
"""

from __future__ import annotations

from tableclient.engine.plugin import PluginError
from tableclient.engine.ranks import Ranks


def tp_ranks() -> Ranks:
    """vLLM's tensor-parallel group, for the decisions its ranks take alike at start-up (its CPU group: gloo); one
    rank where there are no process groups (layers built outside vLLM's workers)."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    except (ImportError, AssertionError):
        return Ranks()
    return Ranks(group.world_size, group.rank_in_group, group.cpu_group)


def tp_agreement():
    """(agree, ranks): over vLLM's tensor-parallel group, with its own all-reduce (captured in FULL graphs as
    the model's own are), where it has more than one rank (the ranks' columns of a layer meet in its
    collectives); (None, 1) otherwise."""
    from tableclient.graph.step import min_from_sum

    try:
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        ranks = get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):  # no process groups (layers built outside vLLM's workers)
        return None, 1
    if ranks <= 1:
        return None, 1
    return min_from_sum(tensor_model_parallel_all_reduce, ranks), ranks


def check_parallel() -> None:
    """PluginError (one line, the flag) for a parallel layout whose steps the plugin cannot check: pipeline
    parallelism. The stage holding a served layer returns intermediate tensors, not the results where a step's
    outcome is checked, and the last stage, which returns them, holds no layer's outcome: a step served the
    policy's rows would be read."""
    try:
        from vllm.distributed import get_pp_group

        stages = get_pp_group().world_size
    except (ImportError, AssertionError):  # no process groups (layers built outside vLLM's workers)
        return
    if stages > 1:
        raise PluginError(
            f"tableserver plugin: served Engram layers do not handle pipeline parallelism ({stages} stages: the stage "
            "holding a layer returns no results to check its rows by): launch vLLM with --pipeline-parallel-size 1 "
            "(--tensor-parallel-size instead), or place every Engram layer 'local'"
        )
