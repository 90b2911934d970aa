"""A DeepSeek-V4.1-shaped model directory that SGLang's and vLLM's own configuration code loads on the CPU.

``config.json`` carries what the engines' argument resolution reads of a DeepSeek-V4.1 checkpoint: the
architecture (``DeepseekV41ForCausalLM``), the V4 attention fields SGLang's ``ModelConfig`` derives its shapes
from (``head_dim``, ``qk_rope_head_dim``, ``sliding_window``, ``index_head_dim``, ``compress_ratios``,
``rope_scaling``), 64 attention heads (so TP up to 64 divides them) and the Engram fields with the released
tables' sizes (``tableserver/common/model.py``). A small word-level tokenizer sits beside it: vLLM loads one
while it builds its configuration. No weights: nothing here builds a model (tests/engines/*/test_plan_*.py).
"""

from __future__ import annotations

import json
import os

from tableserver.common.model import HEADS, TABLE_ROWS

LAYERS = 43


def write_model_dir(path: str) -> str:
    """Writes the model directory at ``path`` (created if missing); returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", *(f"t{i}" for i in range(509))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    text = dict(
        num_hidden_layers=LAYERS, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1,
        head_dim=512, qk_rope_head_dim=64, qk_nope_head_dim=448, v_head_dim=512, kv_lora_rank=512,
        q_lora_rank=1024, sliding_window=128, index_head_dim=128, index_n_heads=64, index_topk=512,
        compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(LAYERS - 2)] + [0],
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, n_shared_experts=1,
        intermediate_size=8192, num_nextn_predict_layers=1, max_position_embeddings=1048576,
        vocab_size=len(vocab), hc_mult=4, rms_norm_eps=1e-6,
        engram_layer_ids=sorted(TABLE_ROWS), engram_num_embeddings=[TABLE_ROWS[k] for k in sorted(TABLE_ROWS)],
        engram_max_ngram_size=4, engram_n_heads=HEADS, engram_vocab_size=16_000_000, engram_head_dim=256,
        engram_pad_token_id=2, engram_compressed_vocab_size=len(vocab),
    )  # fmt: skip
    doc = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(doc, f)
    return path
