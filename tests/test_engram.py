"""Engram hashing: the V4.1 layout, hand-computed cases, a torch oracle, properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tableclient.engram import (
    EngramConfig, EngramHasher, build_layout, engram_row_ids, hash_multipliers, identity_token_map, is_prime,
    lookback, next_prime, prefill_lookback,
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
    cfg = EngramConfig.from_model_config({"engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
                                          "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_vocab_size": 16000000})
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
    assert EngramHasher(TINY, token_map).step([[4]])[0, 0].tolist() == [h2 % 11, 11 + h2 % 13, 24 + h3 % 17,
                                                                        41 + h3 % 19]


def _sglang_oracle(tokens, blocked, pad_id, token_map, multipliers, primes, offsets):
    """compute_engram_hash_ids as SGLang writes it, in torch (the reference the numpy version must match)."""
    compressed = torch.where(blocked, pad_id, token_map[tokens])
    products = compressed.unsqueeze(1) * multipliers
    rolling, hashes = products[..., 0], []
    for i in range(1, tokens.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % primes[:, i - 1])
    return torch.cat(hashes, dim=-1) + offsets


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40))
def test_matches_the_sglang_torch_formulation(seed, length):
    layout = build_layout(V41)
    rng = np.random.default_rng(seed)
    token_map = rng.integers(0, V41.compressed_vocab_size, 130_000)
    seq = rng.integers(0, token_map.size, length)
    tokens, blocked = prefill_lookback(seq, V41.max_ngram_size)
    pad = int(token_map[V41.pad_id])
    ours = engram_row_ids(tokens, blocked, token_map, pad, layout)
    ref = _sglang_oracle(torch.from_numpy(tokens), torch.from_numpy(blocked), pad, torch.from_numpy(token_map),
                         torch.from_numpy(layout.multipliers), torch.from_numpy(layout.primes),
                         torch.from_numpy(layout.offsets))
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
