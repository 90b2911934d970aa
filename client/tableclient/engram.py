"""DeepSeek-V4.1 Engram row ids: from tokens to the rows of each Engram layer's table.

Small pure functions over numpy arrays (no per-token Python), bit-compatible
with SGLang's ``compute_engram_hash_ids`` (python/sglang/srt/layers/engram.py):

* tokens map to a compressed vocabulary (``token_map``; 99,092 ids for V4.1);
  look-back before the sequence start uses the compressed id of pad token 2;
* per layer, one odd multiplier per look-back position from
  ``numpy.random.default_rng(10007 * layer_id)``, bounded by
  ``(int64_max // compressed_vocab) // 2`` so products never overflow;
* for n-gram order n (2..4) the hash is the XOR of ``compressed[t-k] *
  multiplier[k]`` over k < n; head j of that order takes ``hash % prime[j]``
  plus the head's offset in the layer table;
* primes are drawn ascending over (layer, order, head) from one shared
  sequence; every (layer, order) restarts at ``engram_vocab_size`` and skips
  primes already taken (for V4.1: 48 consecutive primes from 16,000,000, which
  sum per layer to exactly 384,006,168 and 384,016,682 rows).

Row ids come out as ``int64 [T, layers, (max_ngram - 1) * heads]`` (24 per
token per layer for V4.1): head-major within each order, orders ascending.

Vision checkpoints (``model_type`` deepseek_v41 with vision layers): token ids
at or above ``MM_PAD_SHIFT_VALUE`` (SGLang's multimodal pad ids) read as the
image token, and an image token blocks its own position and every older
look-back (hashed as the pad). Token ids outside the vocabulary are refused
(ValueError), never clipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tableserver.common.model import FP8_BYTES, HEADS, NGRAM_ORDERS, TABLE_ROWS

INT64_MAX = np.iinfo(np.int64).max
MM_PAD_SHIFT_VALUE = 1_000_000  # SGLang: multimodal pad ids start here (sglang.srt.managers.schedule_batch)


# ------------------------------------------------------------------ primes


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (fixed witness set)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(after: int, taken: set) -> int:
    """The smallest prime > ``after`` that is not in ``taken``."""
    candidate = after + 1
    while not is_prime(candidate) or candidate in taken:
        candidate += 1
    return candidate


# ------------------------------------------------------------------ layout


@dataclass(frozen=True)
class EngramConfig:
    """The Engram part of a model config (DeepSeek-V4.1 defaults)."""

    layer_ids: tuple = tuple(TABLE_ROWS)  # (1, 14)
    max_ngram_size: int = NGRAM_ORDERS + 1  # 4: orders 2..4
    n_heads: int = HEADS  # 8
    head_dim: int = FP8_BYTES  # 256 FP8 values a row
    vocab_size: int = 16_000_000  # engram_vocab_size: where the prime search starts
    compressed_vocab_size: int = 99_092  # bounds the hash multipliers
    pad_id: int = 2  # original token id whose compressed id pads look-back before the start
    num_embeddings: tuple = ()  # the released table sizes, checked against the layout when given
    image_token_id: int | None = None  # vision checkpoints: the image token, hashed as blocked

    @classmethod
    def from_model_config(cls, config) -> EngramConfig:
        """From an HF-style config (dict or object) with ``engram_*`` keys.

        As SGLang reads DeepSeek-V4.1 configs: keys of a nested ``text_config`` count as top-level
        ones (top-level wins), the pad token is ``engram_pad_token_id``, and a vision checkpoint
        (``vision_config`` with layers) blocks its ``image_token_id``.
        """
        values = _config_values(config)
        text = values.get("text_config")
        if text is not None:
            values = {**_config_values(text), **values}
        vision = _config_values(values.get("vision_config") or {})
        vision_layers = int(values.get("vision_n_layers", vision.get("num_hidden_layers", 0)) or 0)
        model_type = values.get("model_type", "")
        image = (
            values.get("image_token_id")
            if model_type in ("deepseek_v41", "deepseek_v41_text") and vision_layers > 0
            else None
        )
        get = values.get
        return cls(
            layer_ids=tuple(get("engram_layer_ids", cls.layer_ids)),
            max_ngram_size=int(get("engram_max_ngram_size", cls.max_ngram_size)),
            n_heads=int(get("engram_n_heads", cls.n_heads)),
            head_dim=int(get("engram_head_dim", cls.head_dim)),
            vocab_size=int(get("engram_vocab_size", cls.vocab_size)),
            compressed_vocab_size=int(get("engram_compressed_vocab_size", cls.compressed_vocab_size)),
            pad_id=int(get("engram_pad_token_id", cls.pad_id)),
            num_embeddings=tuple(get("engram_num_embeddings", ()) or ()),
            image_token_id=None if image is None else int(image),
        )

    @property
    def rows_per_token(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads


def _config_values(config) -> dict:
    """A config's keys as a dict: a dict, an HF PretrainedConfig (``to_dict``) or any object."""
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        values = config.to_dict()
        values.update({k: v for k, v in vars(config).items() if not k.startswith("_")})
        return values
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


@dataclass(frozen=True)
class EngramLayout:
    """Primes and head offsets of every Engram layer table."""

    config: EngramConfig
    primes: np.ndarray  # int64 [layers, max_ngram - 1, heads]
    offsets: np.ndarray  # int64 [layers, (max_ngram - 1) * heads]: each head's first row
    multipliers: np.ndarray = field(repr=False)  # int64 [layers, max_ngram], odd

    @property
    def table_rows(self) -> tuple:
        """Rows of each layer's table (sum of its primes)."""
        return tuple(int(p.sum()) for p in self.primes)


def build_primes(config: EngramConfig) -> np.ndarray:
    taken: set = set()
    out = np.empty((len(config.layer_ids), config.max_ngram_size - 1, config.n_heads), np.int64)
    for li in range(len(config.layer_ids)):
        for order in range(config.max_ngram_size - 1):
            current = config.vocab_size - 1
            for head in range(config.n_heads):
                current = next_prime(current, taken)
                taken.add(current)
                out[li, order, head] = current
    return out


def hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd int64 multipliers [layers, max_ngram] from ``default_rng(10007 * layer_id)``."""
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
        for layer in layer_ids
    ]
    return np.stack(rows)


def build_layout(config: EngramConfig) -> EngramLayout:
    """The layout for ``config``; ValueError if it contradicts ``config.num_embeddings``."""
    primes = build_primes(config)
    flat = primes.reshape(len(config.layer_ids), -1)
    offsets = np.concatenate([np.zeros((flat.shape[0], 1), np.int64), np.cumsum(flat, axis=1)[:, :-1]], axis=1)
    layout = EngramLayout(
        config, primes, offsets, hash_multipliers(config.layer_ids, config.max_ngram_size, config.compressed_vocab_size)
    )
    if config.num_embeddings and tuple(config.num_embeddings) != layout.table_rows:
        raise ValueError(
            f"Engram layout gives tables of {layout.table_rows} rows but the config says "
            f"{tuple(config.num_embeddings)}: check engram_vocab_size / n_heads / max_ngram_size"
        )
    return layout


# ------------------------------------------------------------------ hashing


def engram_row_ids(
    tokens: np.ndarray, blocked: np.ndarray, token_map: np.ndarray, pad_compressed: int, layout: EngramLayout
) -> np.ndarray:
    """Row ids ``int64 [T, layers, (n - 1) * heads]`` for tokens with their look-back.

    ``tokens [T, n]``: column 0 is the token itself, column s its s-th
    predecessor; ``blocked [T, n]`` marks look-back before the sequence
    start (hashed as the pad's compressed id). With an image token in the
    config, multimodal pad ids read as it, and it blocks itself and every
    older look-back.
    """
    image = layout.config.image_token_id
    if image is not None:
        tokens = np.where(tokens >= MM_PAD_SHIFT_VALUE, image, tokens)
        blocked = np.logical_or.accumulate(blocked | (tokens == image), axis=1)
        tokens = np.where(blocked, 0, tokens)  # blocked positions hash as the pad whatever they hold
    bad = (tokens < 0) | (tokens >= token_map.size)
    if bad.any():
        t = int(tokens[bad][0])
        raise ValueError(
            f"token id {t} is outside the vocabulary of {token_map.size} (token_map): check the "
            "tokenizer and the model config"
        )
    compressed = np.where(blocked, pad_compressed, token_map[tokens]).astype(np.int64)  # [T, n]
    products = compressed[:, None, :] * layout.multipliers[None, :, :]  # [T, L, n]
    rolling = products[..., 0]
    hashes = []
    for i in range(1, tokens.shape[1]):
        rolling = np.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling[..., None] % layout.primes[None, :, i - 1, :])  # [T, L, heads]
    return np.concatenate(hashes, axis=-1) + layout.offsets[None]


def lookback(histories: list, max_ngram_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, n], blocked [B, n]) for the last token of each request's history."""
    n = max_ngram_size
    tokens = np.zeros((len(histories), n), np.int64)
    blocked = np.ones((len(histories), n), bool)
    for b, h in enumerate(histories):
        k = min(n, len(h))
        if k:
            tokens[b, :k] = np.asarray(h[-k:], np.int64)[::-1]
            blocked[b, :k] = False
    return tokens, blocked


def prefill_lookback(sequence: np.ndarray, max_ngram_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [T, n], blocked [T, n]) for every position of one sequence (vectorized)."""
    seq = np.asarray(sequence, np.int64)
    pos = np.arange(seq.size)[:, None] - np.arange(max_ngram_size)[None, :]
    blocked = pos < 0
    return seq[np.clip(pos, 0, None)], blocked


class EngramHasher:
    """Row ids for decode steps and prefills of one model.

    ``token_map`` maps the model's token ids to the compressed vocabulary
    (SGLang builds it from the tokenizer's normalizer); the hasher holds the
    layout, multipliers and the pad's compressed id.
    """

    def __init__(self, config: EngramConfig, token_map: np.ndarray):
        self.config = config
        self.layout = build_layout(config)
        self.token_map = np.asarray(token_map, np.int64)
        if self.token_map.ndim != 1 or self.token_map.size <= config.pad_id:
            raise ValueError("token_map must be a 1-D array covering the pad token id")
        if int(self.token_map.max()) >= config.compressed_vocab_size:
            raise ValueError(f"token_map has ids >= compressed_vocab_size {config.compressed_vocab_size}")
        self.pad_compressed = int(self.token_map[config.pad_id])

    def step(self, histories: list) -> np.ndarray:
        """Row ids ``[B, layers, 24]`` for one decode step (each history ends with the new token)."""
        tokens, blocked = lookback(histories, self.config.max_ngram_size)
        return engram_row_ids(tokens, blocked, self.token_map, self.pad_compressed, self.layout)

    def prefill(self, sequence) -> np.ndarray:
        """Row ids ``[T, layers, 24]`` for every position of a prompt."""
        tokens, blocked = prefill_lookback(sequence, self.config.max_ngram_size)
        return engram_row_ids(tokens, blocked, self.token_map, self.pad_compressed, self.layout)

    def by_layer(self, row_ids: np.ndarray) -> dict:
        """``{layer_id: row_ids[:, i]}`` for a ``[T, layers, 24]`` array."""
        return {layer: row_ids[:, i] for i, layer in enumerate(self.config.layer_ids)}


def identity_token_map(vocab: int) -> np.ndarray:
    """A stand-in token map (id -> id) for tests and the demo, when no tokenizer is at hand."""
    return np.arange(vocab, dtype=np.int64)
