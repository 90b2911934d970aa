"""Engram hashing: the V4.1 layout, hand-computed cases, SGLang's own functions as the oracle, properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision_cpu  # noqa: F401  (before sglang: torchvision on a CPU torch)
from hypothesis import given, settings
from hypothesis import strategies as st
from tableclient.engram import (
    MM_PAD_SHIFT_VALUE,
    EngramConfig,
    EngramHasher,
    build_layout,
    engram_row_ids,
    hash_multipliers,
    identity_token_map,
    is_prime,
    lookback,
    next_prime,
    prefill_lookback,
)

V41 = EngramConfig(num_embeddings=(384_006_168, 384_016_682))
TINY = EngramConfig(layer_ids=(3,), max_ngram_size=3, n_heads=2, vocab_size=10, compressed_vocab_size=20, pad_id=0)


def test_v41_layout_matches_released_table_sizes():
    layout = build_layout(V41)
    assert layout.table_rows == (384_006_168, 384_016_682)
    primes = layout.primes.reshape(-1)
    assert primes[0] == 16_000_057 and len(set(primes.tolist())) == 48 and all(is_prime(int(p)) for p in primes)
    assert (np.diff(primes) > 0).all()  # drawn ascending over (layer, order, head)
    assert (layout.multipliers % 2 == 1).all()
    assert layout.offsets[0, 0] == 0 and layout.offsets[1, 1] == layout.primes[1, 0, 0]
    with pytest.raises(ValueError, match="check engram_vocab_size"):
        build_layout(EngramConfig(num_embeddings=(1, 2)))


def test_config_from_model_config():
    cfg = EngramConfig.from_model_config(
        {
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_n_heads": 8,
            "engram_vocab_size": 16000000,
        }
    )
    assert cfg.layer_ids == (1, 14) and cfg.rows_per_token == 24 and cfg.num_embeddings == (384006168, 384016682)


def test_primes_and_multipliers_by_hand():
    assert [p for p in range(2, 40) if is_prime(p)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37]
    assert is_prime(2_147_483_647) and not is_prime(2_147_483_649)
    assert next_prime(9, set()) == 11 and next_prime(9, {11}) == 13
    m = hash_multipliers((3,), 3, 20)
    bound = (np.iinfo(np.int64).max // 20) // 2
    expect = np.random.default_rng(30021).integers(0, bound, size=3, dtype=np.int64) * 2 + 1
    assert m.tolist() == [expect.tolist()]


def test_tiny_case_by_hand():
    """TINY: primes from 10 -> order 2: (11, 13), order 3: (17, 19); offsets 0, 11, 24, 41."""
    layout = build_layout(TINY)
    assert layout.primes.tolist() == [[[11, 13], [17, 19]]] and layout.offsets.tolist() == [[0, 11, 24, 41]]
    token_map = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], np.int64)  # compressed = token + 5
    m0, m1, m2 = (int(x) for x in layout.multipliers[0])
    # sequence 4 -> 7 -> 2; position 2 (token 2) sees 7 at -1 and 4 at -2
    c = [token_map[2], token_map[7], token_map[4]]
    h2 = (c[0] * m0) ^ (c[1] * m1)
    h3 = h2 ^ (c[2] * m2)
    want = [h2 % 11, 11 + h2 % 13, 24 + h3 % 17, 41 + h3 % 19]
    got = EngramHasher(TINY, token_map).step([[4, 7, 2]])
    assert got.shape == (1, 1, 4) and got[0, 0].tolist() == want
    # position 0 of a sequence: every look-back is the pad's compressed id (token 0 -> 5)
    pad = int(token_map[0])
    h2 = (int(token_map[4]) * m0) ^ (pad * m1)
    h3 = h2 ^ (pad * m2)
    assert EngramHasher(TINY, token_map).step([[4]])[0, 0].tolist() == [
        h2 % 11,
        11 + h2 % 13,
        24 + h3 % 17,
        41 + h3 % 19,
    ]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40))
def test_matches_sglang_compute_engram_hash_ids(seed, length):
    from sglang.srt.layers.engram import compute_engram_hash_ids

    layout = build_layout(V41)
    rng = np.random.default_rng(seed)
    token_map = rng.integers(0, V41.compressed_vocab_size, 130_000)
    seq = rng.integers(0, token_map.size, length)
    tokens, blocked = prefill_lookback(seq, V41.max_ngram_size)
    pad = int(token_map[V41.pad_id])
    ours = engram_row_ids(tokens, blocked, token_map, pad, layout)
    ref = compute_engram_hash_ids(
        torch.from_numpy(tokens),
        torch.from_numpy(blocked),
        pad,
        torch.from_numpy(token_map),
        torch.from_numpy(layout.multipliers),
        torch.from_numpy(layout.primes),
        torch.from_numpy(layout.offsets),
    )
    np.testing.assert_array_equal(ours, ref.numpy())


def test_properties_ranges_heads_determinism_and_pads():
    layout = build_layout(V41)
    hasher = EngramHasher(V41, identity_token_map(V41.compressed_vocab_size))
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, V41.compressed_vocab_size, rng.integers(1, 30)).tolist() for _ in range(200)]
    ids = hasher.step(histories)
    assert ids.shape == (200, 2, 24) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids, hasher.step(histories))  # deterministic
    for li in range(2):
        lo = layout.offsets[li]
        hi = lo + layout.primes[li].reshape(-1)
        assert ((ids[:, li] >= lo) & (ids[:, li] < hi)).all()  # each head inside its own segment
        assert ids[:, li].max() < layout.table_rows[li]
    # a decode step equals the prefill row of the same position
    seq = histories[7]
    np.testing.assert_array_equal(hasher.prefill(seq)[-1], hasher.step([seq])[0])
    # look-back before the start is the pad: a 1-token history hashes like (pad, pad, pad) predecessors
    tokens, blocked = lookback([[42]], 4)
    assert tokens[0].tolist() == [42, 0, 0, 0] and blocked[0].tolist() == [False, True, True, True]
    # different layers hash differently (their own multipliers and primes)
    assert not np.array_equal(ids[:, 0] - layout.offsets[0], ids[:, 1] - layout.offsets[1])


def test_bad_token_map():
    with pytest.raises(ValueError, match="compressed_vocab_size"):
        EngramHasher(TINY, np.array([0, 1, 99]))
    with pytest.raises(ValueError, match="pad"):
        EngramHasher(TINY, np.array([], np.int64))


def _sglang_config(**extra):
    from sglang.srt.configs.deepseek_v41 import DeepseekV41Config

    text = dict(
        engram_layer_ids=[1, 14],
        engram_max_ngram_size=4,
        engram_n_heads=8,
        engram_vocab_size=2000,
        engram_head_dim=256,
        engram_pad_token_id=5,
        engram_compressed_vocab_size=300,
    )
    return DeepseekV41Config(text_config=text, **extra)


def test_config_as_sglang_reads_it_nested_text_config_pad_token_and_image():
    cfg = EngramConfig.from_model_config(_sglang_config())
    assert (cfg.layer_ids, cfg.max_ngram_size, cfg.n_heads, cfg.vocab_size, cfg.pad_id, cfg.compressed_vocab_size) == (
        (1, 14),
        4,
        8,
        2000,
        5,
        300,
    )
    assert cfg.image_token_id is None  # no vision tower: nothing blocked
    raw = {
        "model_type": "deepseek_v41",
        "image_token_id": 42,
        "vision_config": {"num_hidden_layers": 2},
        "text_config": {"engram_layer_ids": [1, 14], "engram_pad_token_id": 7, "engram_n_heads": 8},
    }
    cfg = EngramConfig.from_model_config(raw)
    assert (cfg.layer_ids, cfg.pad_id, cfg.image_token_id) == ((1, 14), 7, 42)
    from sglang.srt.models.deepseek_v4 import _engram_image_token_id

    vision = _sglang_config(image_token_id=42, vision_config={"num_hidden_layers": 2})
    assert EngramConfig.from_model_config(vision).image_token_id == _engram_image_token_id(vision) == 42


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 30))
def test_image_tokens_and_multimodal_pads_block_as_sglang_hashes_them(seed, length):
    """SGLang's EngramHasher.hash_windows (its real class and normalizing tokenizer map) is the oracle."""
    from sglang.srt.layers.engram import EngramHasher as SGLangHasher
    from sglang.srt.layers.engram import EngramLayout, build_compressed_token_map
    from sglang_cpu import make_tokenizer

    tokenizer = make_tokenizer()
    token_map, compressed = build_compressed_token_map(tokenizer)
    image = 17
    sg_cfg = _sglang_config()
    sg_cfg.engram_compressed_vocab_size = compressed
    layout = EngramLayout.from_config(sg_cfg)
    theirs = SGLangHasher(layout, tokenizer, sg_cfg.engram_pad_token_id, compressed)
    theirs.image_token_id = image
    ours = EngramHasher(
        EngramConfig(
            layer_ids=(1, 14), vocab_size=2000, compressed_vocab_size=compressed, pad_id=5, image_token_id=image
        ),
        np.asarray(token_map),
    )
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, len(token_map), length)
    seq[rng.random(length) < 0.15] = image
    seq[rng.random(length) < 0.1] = MM_PAD_SHIFT_VALUE + 3  # a multimodal pad id, as SGLang's prompts carry
    tokens, blocked = prefill_lookback(seq, 4)
    want, _ = theirs.hash_windows(torch.from_numpy(tokens), torch.from_numpy(blocked))
    np.testing.assert_array_equal(ours.prefill(seq), want.numpy())


def test_out_of_range_token_ids_are_refused_not_clipped():
    hasher = EngramHasher(TINY, np.arange(10, dtype=np.int64) + 5)
    for bad in ([[4, 7, 10]], [[-1]]):
        with pytest.raises(ValueError, match="outside the vocabulary of 10"):
            hasher.step(bad)
    with pytest.raises(ValueError, match="token id 12 is outside"):
        hasher.prefill([1, 12, 3])
