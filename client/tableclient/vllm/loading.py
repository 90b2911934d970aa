"""Loading a checkpoint whose served tables are never read, and the start-up check once the model is built.

The checkpoint's tensors of a served table are skipped before they are read by vLLM's safetensors iterator
(``weight_utils.should_skip_weight``, :func:`should_skip_weight`), shards holding nothing else are not opened by any
load format (``is_unused_checkpoint_weight``, :func:`is_unused`), and ``load_weights`` (:func:`load_weights`) drops
whatever a whole-file load format read anyway, counts the served parameters as loaded, and runs the start-up check
(:func:`verify`: each layer where the configuration places it, then the memory check of
:mod:`tableclient.vllm.memory`).
"""

from __future__ import annotations

import logging
import re

from tableclient.engine.plugin import PluginError, check_placement
from tableclient.vllm.layers import DP_MIX
from tableclient.vllm.memory import check_memory
from tableclient.vllm.state import STATE, config, served, vllm_modules

log = logging.getLogger(__name__)

#: checkpoint tensors of a layer's table: the checkpoint's names and vLLM's after its weights mapper
TABLE_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.engram\.(?:embed\.(?:weight|scale)|embed_tokens\.(?:weight|weight_scale_inv))$"
)


def served_key(name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a served layer's table."""
    m = TABLE_KEY.search(name)
    return m is not None and served(int(m.group(1)))


def should_skip_weight(original, weight_name, local_expert_ids):
    """vLLM's safetensors iterator asks before reading each tensor: a served table's are never read."""
    return served_key(weight_name) or original(weight_name, local_expert_ids)


def is_unused(original, self, name: str) -> bool:
    """Shards holding only served tables' tensors are not opened, whatever the load format."""
    return served_key(name) or (original is not None and original(self, name))


def load_weights(original, self, weights):
    """A served table's tensors never reach a parameter; its (empty) parameters count as loaded."""
    if not STATE.configured or not config().enabled:
        return original(self, weights)
    loaded = original(self, ((name, w) for name, w in weights if not served_key(name)))
    engrams = verify(self)
    if loaded is not None:
        for name, module in self.named_modules():
            if module in engrams and STATE.served_layer(module) is not None:
                loaded |= {f"{name}.embed_tokens.{p}" for p, _ in module.embed_tokens.named_parameters()}
    return loaded


def verify(model) -> list:
    """Start-up check, once the model is built: each Engram layer is where the configuration puts it, the
    configuration names no other layer, and no local table is sharded over data-parallel ranks beside a
    served layer (vLLM would hand that one every replica's tokens). Returns the Engram modules."""
    engram_cls = vllm_modules()[0].Engram
    engrams = [m for m in model.modules() if isinstance(m, engram_cls)]
    cfg = config()
    built = [(STATE.layer_of(e), STATE.served_layer(e) is not None) for e in engrams]
    layers = check_placement(cfg, built, "vLLM")
    if any(served(x) for x in layers) and any(
        not served(x) and e.embed_tokens.dp_size > 1 for x, e in zip(layers, engrams)
    ):
        raise PluginError(DP_MIX)
    log.info("tableserver plugin engaged: %s", cfg.describe(layers, engine="vLLM"))
    check_memory(layers)
    return engrams
