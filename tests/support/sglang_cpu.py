"""SGLang 0.5.23's own Engram classes on the CPU, as the engine tests build them: the model's pieces (a
local tokenizer, ``DeepseekV41Config``, SGLang's hasher and Engram layers loaded through its weight
loaders), one memory node, SGLang's plugin loading, and forward batches driven as ``DeepseekV4Model``
drives them. Fixtures are imported by the test modules that use them (tests/engines/sglang/,
tests/gpu/); benches build the same models from here.

Import it after ``torchvision_cpu`` and once SGLang is known to be installed (the test modules skip first).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import local_tables, start_daemon
from sglang.srt.configs.deepseek_v41 import DeepseekV41Config
from sglang.srt.layers.engram import Engram, EngramHasher, EngramLayout, build_compressed_token_map
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_parallel
from tableclient.sglang import PluginConfig, configure, hooks
from tests_helpers import scrape, value

from tableserver.tables.demo import DemoTable, write_demo_file

LAYERS = (1, 14)
HIDDEN, HC = 64, 2


# ---------------------------------------------------------------------- the model's pieces
def make_tokenizer():
    """A local word-level tokenizer (no hub): 300 words, some differing only in case, so SGLang's
    normalization compresses the vocabulary as it does DeepSeek's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(240)] + [f"W{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def make_model_config():
    """(SGLang's DeepseekV41Config of the small model, its tokenizer)."""
    tokenizer = make_tokenizer()
    _, compressed = build_compressed_token_map(tokenizer)
    engram = dict(
        engram_layer_ids=list(LAYERS),
        engram_max_ngram_size=4,
        engram_n_heads=8,
        engram_vocab_size=2000,
        engram_head_dim=256,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed,
    )
    probe = EngramLayout.from_config(DeepseekV41Config(text_config=engram))
    engram["engram_num_embeddings"] = [probe.column_bounds(i)[-1] for i in range(len(LAYERS))]
    cfg = DeepseekV41Config(
        text_config=dict(engram, hidden_size=HIDDEN, hc_mult=HC, rms_norm_eps=1e-6, num_hidden_layers=16)
    )
    return cfg, tokenizer


@pytest.fixture(scope="module")
def model_config():
    return make_model_config()


@pytest.fixture(scope="module")
def engram_tables(model_config, tmp_path_factory):
    cfg, _ = model_config
    path = str(tmp_path_factory.mktemp("sglang") / "engram.bin")
    write_demo_file(
        path,
        [DemoTable(f"engram.layer{layer}", rows, 264, layer) for layer, rows in zip(LAYERS, cfg.engram_num_embeddings)],
        seed=11,
    )
    return path


@pytest.fixture(scope="module")
def memnode(engram_tables, tmp_path_factory):
    d = start_daemon(str(tmp_path_factory.mktemp("memnode")), "--tables", engram_tables)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def local_outputs(model_config, engram_tables):
    """The test conversation (:func:`run`, seed 0) through SGLang's own layers and tables: what a served model's
    outputs must equal bit for bit. Built once a module (read, never changed)."""
    return run(build(model_config, engram_tables))


@pytest.fixture(scope="module")
def plugin(memnode):
    """SGLang's own plugin loading, with the plugin's entry point enabled by TABLESERVER_ADDRESS."""
    from sglang.srt.plugins import load_plugins

    os.environ["TABLESERVER_ADDRESS"] = memnode.address
    os.environ["SGLANG_PLUGINS"] = "tableserver"  # SGLang's whitelist: ours is the one plugin loaded
    try:
        load_plugins()
    finally:
        del os.environ["TABLESERVER_ADDRESS"]
    assert hooks.hooks_in_place(), "the plugin's register() did not complete (see SGLang's log)"
    assert hooks.applied(f"{hooks.ENGRAM}.EngramEmbedding.forward"), "load_plugins did not apply the hooks"
    yield
    configure(PluginConfig())  # closes the clients; every layer local again


def build(model_config, engram_tables, *, placement=None, address=None, tp=(1, 0), parallel=None, **plugin_options):
    """SGLang's hasher and Engram layers, loaded the way SGLang loads them; plugin placement or none. Built as
    tensor-parallel rank ``tp`` (size, rank), or under ``parallel`` (SGLang's parallel fields, overridden)."""
    cfg, tokenizer = model_config
    # A memory node is another host: tcp (auto would pick shm, the daemon being on this host).
    plugin_options.setdefault("transport", "tcp")
    # a busy machine (the suite on every CPU) must not fail the memory node over: no test here is about liveness
    plugin_options.setdefault("liveness_timeout", 600.0)
    plugin_options.setdefault("gather_budget", 600.0)  # nor about a gather's budget
    configure(PluginConfig(address=address or "", layers=placement or {}, **plugin_options))
    layout = EngramLayout.from_config(cfg)
    tables = local_tables(engram_tables)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as SGLang's model loader builds modules
    try:
        with get_parallel().override(**(parallel if parallel is not None else {"tp_size": tp[0], "tp_rank": tp[1]})):
            hasher = EngramHasher(layout, tokenizer, cfg.engram_pad_token_id, cfg.engram_compressed_vocab_size)
            engrams = [Engram(cfg, layer, layout, prefix=f"model.layers.{layer}.engram") for layer in LAYERS]
    finally:
        torch.set_default_dtype(default)
    hasher.init_history(num_req_slots=8, device="cpu")
    gen = torch.Generator().manual_seed(5)
    for e, layer in zip(engrams, LAYERS):
        with torch.no_grad():
            e.wkv.weight.copy_((torch.randn(e.wkv.weight.shape, generator=gen) * 0.02).to(e.wkv.weight.dtype))
            e.q_weight.copy_(1 + 0.1 * torch.randn(e.q_weight.shape, generator=gen))
        params = dict(e.embed.named_parameters())
        if params:  # SGLang's own table: loaded through its weight loader, from the checkpoint's two tensors
            full = torch.from_numpy(np.array(tables[f"engram.layer{layer}"]))
            for name, part in (("weight", full[:, :256]), ("scale", full[:, 256:])):
                p = params[name]
                p.weight_loader(p, part.contiguous().view(p.dtype))
    return hasher, engrams


class DecodeModel(torch.nn.Module):
    """What ModelRunner.model is to SGLang's decode graph runner: the module tree holding the hasher and the
    Engram layers."""

    def __init__(self, hasher, engrams):
        super().__init__()
        self.hasher, self.engrams = hasher, torch.nn.ModuleList(engrams)


def decode_runner(model, backend=None, max_bs: int = 8, **flags):
    """SGLang's DecodeCudaGraphRunner, without the __init__ that would capture on a GPU: the attributes the plugin
    reads, as __init__ sets them (``backend``: SGLang's backend class, FullCudaGraphBackend by default)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    backend = backend or FullCudaGraphBackend
    runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
    runner.model_runner = SimpleNamespace(model=DecodeModel(*model))
    runner.backend = backend.__new__(backend)
    runner.max_bs, runner.captured_req_width = max_bs, 1
    runner.speculative_algorithm = flags.get("speculative_algorithm", SpeculativeAlgorithm.NONE)
    runner.enable_two_batch_overlap = flags.get("enable_two_batch_overlap", False)
    runner.enable_pdmux = flags.get("enable_pdmux", False)
    return runner


def table_bytes(engram) -> int:
    return sum(p.numel() * p.element_size() for p in engram.embed.parameters())


# ---------------------------------------------------------------------- forward batches
def extend_batch(chunks, slots):
    """An EXTEND ForwardBatch: ``chunks`` [(prefix_len, tokens)] per request, in req slots ``slots``."""
    ids = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.int64)
    lens = [len(toks) for _, toks in chunks]
    positions = torch.cat([torch.arange(p, p + len(toks)) for p, toks in chunks])
    starts = torch.tensor(np.concatenate([[0], np.cumsum(lens)[:-1]]), dtype=torch.int64)
    return ids, ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(chunks),
        input_ids=ids,
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor([p + n for (p, _), n in zip(chunks, lens)]),
        out_cache_loc=torch.arange(1, len(ids) + 1),
        seq_lens_sum=int(sum(lens)),
        positions=positions,
        extend_seq_lens=torch.tensor(lens),
        extend_start_loc=starts,
        extend_seq_lens_cpu=lens,
        extend_prefix_lens=torch.tensor([p for p, _ in chunks]),
    )


def decode_batch(tokens, positions, slots):
    ids = torch.tensor(tokens, dtype=torch.int64)
    return ids, ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(tokens),
        input_ids=ids,
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor(positions) + 1,
        out_cache_loc=torch.arange(1, len(ids) + 1),
        seq_lens_sum=int(sum(positions) + len(ids)),
        positions=torch.tensor(positions),
    )


def forward(model, ids, batch, x):
    """What DeepseekV4Model does per forward: hash once, then each Engram layer on the residual."""
    hasher, engrams = model
    hash_ids = hasher(ids, batch)
    return hash_ids, [e(x, hash_ids[:, e.layer_hash_index], batch, input_ids=ids) for e in engrams]


def conversation(rng):
    """Prefill of two prompts, the second chunked; then decode steps. Yields (ids, batch)."""
    a, b = rng.integers(0, 300, 37).tolist(), rng.integers(0, 300, 50).tolist()
    yield extend_batch([(0, a), (0, b[:20])], [0, 1])  # prefill + first chunk of a chunked prefill
    yield extend_batch([(20, b[20:])], [1])  # the second chunk: look-back from the first, via history
    pos = [len(a), len(b)]
    for _ in range(6):
        toks = rng.integers(0, 300, 2).tolist()
        yield decode_batch(toks, pos, [0, 1])
        pos = [p + 1 for p in pos]


def run(model, seed=0):
    rng = np.random.default_rng(seed)
    outs = []
    for ids, batch in conversation(rng):
        x = torch.from_numpy(rng.standard_normal((len(ids), HC, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
        hash_ids, layer_outs = forward(model, ids, batch, x)
        outs.append((hash_ids, layer_outs))
    return outs


def assert_bit_identical(got, want):
    assert len(got) == len(want)
    for (h1, o1), (h2, o2) in zip(got, want):
        assert torch.equal(h1, h2)
        for a, b in zip(o1, o2):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit, not just close


def server_rows(memnode, table) -> float:
    return value(scrape(memnode.ready["metrics"]), "tableserver_gather_rows_total", table=table)
