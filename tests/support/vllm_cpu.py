"""Running vLLM's own Engram classes on this machine's CPU (torch 2.13 CPU build, no GPU, no vllm._C).

Import this module before anything imports vllm or Triton (tests/conftest.py does, where vLLM is
installed). Without CUDA it sets, for this process and the ones it starts:

* ``CUDA_VISIBLE_DEVICES=""``: with no active Triton driver vLLM disables Triton
  (``vllm/triton_utils/importing.py``) unless the visible-device list is empty, as in its distributed
  workers; then it keeps the real Triton, and
* ``TRITON_INTERPRET=1``: Triton's interpreter runs vLLM's own kernels (the n-gram hash, the table
  lookup and dequantization, the gate) on CPU tensors. It must be set before any ``@triton.jit``
  function is decorated: vLLM's kernels, and Triton's own library (``tl.sum``), which is decorated when
  Triton is first imported, by whichever engine comes first;
* ``cpu_site`` on PYTHONPATH: vLLM inspects a model class in a fresh interpreter, which needs
  ``torchvision_cpu`` too (its ``sitecustomize`` applies it on the first ``import torchvision``);
* ``VLLM_CACHE_ROOT``: a temporary directory, so the run reads and leaves nothing in ``~/.cache/vllm``.

:func:`device_queries` covers the one GPU query of vLLM's *local* table (``ParallelEngramEmbedding``
asks the device for its SM count to size the lookup's grid): the layers the plugin serves ask nothing.
With a CUDA build of torch nothing here changes anything.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import types
import weakref

import torch
import torchvision_cpu  # noqa: F401

CPU = not torch.cuda.is_available()
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_site")

if CPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
    if "VLLM_CACHE_ROOT" not in os.environ:  # a cache of this process's (and its children's), removed at its exit
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="tableserver-vllm-cache-")
        atexit.register(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], True)


def require_vllm() -> None:
    """Skips the calling test module where vLLM is not installed (``make test`` installs vllm==0.33.0); an
    installed vLLM whose Engram module cannot be imported fails instead."""
    import pytest

    try:
        import vllm.models.deepseek_v41.common.engram  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "vllm":
            raise
        pytest.skip("vllm==0.33.0 is installed by `make test`", allow_module_level=True)


@contextlib.contextmanager
def device_queries(sms: int = 8):
    """vLLM's local Engram table asks the GPU how many SMs it has; on the CPU it is told ``sms``."""
    if not CPU:
        yield
        return
    saved = torch.cuda.get_device_properties, torch.accelerator.current_device_index
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=sms)
    torch.accelerator.current_device_index = lambda: 0
    try:
        yield
    finally:
        torch.cuda.get_device_properties, torch.accelerator.current_device_index = saved


# ---------------------------------------------------------------------- a small DeepSeek-V4.1 on the CPU
LAYERS = (1, 14)
HIDDEN, HC = 64, 2
IMAGE = 129264  # vLLM's image sentinel token (IMAGE_SENTINEL_BASE_ID): the tokenizer must have it


def make_tokenizer():
    """A local word-level tokenizer (no hub) of 129,265 tokens: some differing only in case, so vLLM's
    normalization compresses the vocabulary as it does DeepSeek's, and ``<image>`` at vLLM's image
    sentinel id, so image spans are real dead tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(240)] + [f"W{i}" for i in range(60)]
    words += [f"x{i}" for i in range(IMAGE - len(words))] + ["<image>"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def write_model(path: str, vocab_size: int = 2000) -> list[int]:
    """A model directory vLLM's ModelConfig loads: DeepSeek-V4.1's config (its Engram fields; the rest
    small) and the tokenizer. ``vocab_size`` is Engram's (the primes start there): each layer's table
    has about 24x that many rows. Returns the tables' row counts, as vLLM's EngramLayout draws them."""
    import json

    from vllm.models.deepseek_v41.common.engram import EngramLayout, build_compressed_token_map

    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(path)
    _, compressed = build_compressed_token_map(tokenizer)
    text = dict(
        engram_layer_ids=list(LAYERS),
        engram_max_ngram_size=4,
        engram_n_heads=8,
        engram_vocab_size=vocab_size,
        engram_head_dim=256,
        engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed,
        hidden_size=HIDDEN,
        hc_mult=HC,
        rms_norm_eps=1e-6,
        num_hidden_layers=16,
        num_attention_heads=4,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
    )
    # the row counts are what the primes add up to: vLLM's layout computes them from the other fields
    probe = EngramLayout(types.SimpleNamespace(**text, engram_num_embeddings=[0] * len(LAYERS)))
    text["engram_num_embeddings"] = [int(o[-1]) + p[-1][-1] for o, p in zip(probe.offsets, probe.primes)]
    doc = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(doc, f)
    return text["engram_num_embeddings"]


@contextlib.contextmanager
def model_class_inspected_here():
    """vLLM inspects a model's class in a fresh interpreter (its registry's ``_run_in_subprocess``, so that importing
    the class initializes no CUDA in the engine's process), once per cache directory: about 14 s of CPU for each
    process that builds a ModelConfig here (every rank process, every fresh process), all but the time to import
    vLLM again. Without a GPU there is no CUDA to initialize: the inspection runs in this process, which imported
    the model's package already (the plugin's loading does), and vLLM caches its result as ever."""
    if not CPU:
        yield
        return
    from vllm.model_executor.models import registry

    saved = registry._run_in_subprocess  # vLLM's own
    registry._run_in_subprocess = lambda fn: fn()  # vLLM's own
    try:
        yield
    finally:
        registry._run_in_subprocess = saved  # vLLM's own


def make_vllm_config(path: str, **engram):
    """vLLM's own configuration of that model on the CPU device (tables on the device, as without
    ``cpu_offload``: pinned host tables need a GPU's unified addressing)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.config.engram import EngramConfig

    with model_class_inspected_here():
        model = ModelConfig(model=path, tokenizer=path, dtype="bfloat16", max_model_len=4096)
    return VllmConfig(
        model_config=model,
        device_config=DeviceConfig(device="cpu"),
        engram_config=EngramConfig(cpu_offload=False, **engram),
    )


def init_parallel(cfg, world_size: int = 1, rank: int = 0, port: int | None = None, tp: int = 1, pp: int = 1) -> None:
    """vLLM's process groups over gloo (what its workers set up with NCCL on GPUs): ``tp`` tensor-parallel ranks,
    ``pp`` pipeline stages. Again after :func:`close_model_parallel`: only the model-parallel groups anew."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(tp, pp)


def close_model_parallel() -> None:
    """vLLM's model-parallel groups destroyed, its distributed environment kept (another layout follows)."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()


def close_parallel() -> None:
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def build_engrams(cfg, *, seed: int = 5, sequence_parallel: bool = False, layers=LAYERS):
    """vLLM's Engram layers as DeepseekV4DecoderLayer builds them (under the model's config, bf16 default
    dtype), their small projections set from ``seed`` (the same for every build)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41.common.engram import Engram, EngramLayout

    hf = cfg.model_config.hf_text_config
    layout = EngramLayout.from_config(hf)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(cfg), device_queries():
            engrams = [
                Engram(
                    hf, None, layout, layout.layer_ids.index(layer), sequence_parallel, f"model.layers.{layer}.engram"
                )
                for layer in layers
            ]
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    for e in engrams:
        with torch.no_grad():
            for p in (e.wkv.weight, e.q_weight, e.k_weight):
                p.copy_((1 if p is not e.wkv.weight else 0) + 0.1 * torch.randn(p.shape, generator=gen))
    return engrams


def load_table(engram, table) -> None:
    """A local layer's table through vLLM's own weight loader, as the checkpoint's two tensors arrive
    (``engram.embed.weight`` fp8, ``engram.embed.scale`` e8m0); a served layer's loader drops them."""
    full = torch.from_numpy(table) if not isinstance(table, torch.Tensor) else table
    params = dict(engram.embed_tokens.named_parameters())
    weight, scale = full[:, :256].contiguous(), full[:, 256:].contiguous()
    for name, part in (
        ("weight", weight.view(torch.float8_e4m3fn)),
        ("weight_scale_inv", scale.view(torch.float8_e8m0fnu)),
    ):
        params[name].weight_loader(params[name], part)


def make_hasher(cfg):
    """vLLM's NgramHashState as the V2 model runner uses it: stateless, every look-back token supplied. Its
    SWA-cache module is only read for the V1 runner's slot cache (block size, KV cache)."""
    from vllm.models.deepseek_v41.common.engram import EngramLayout, NgramHashState

    layout = EngramLayout.from_config(cfg.model_config.hf_text_config)
    swa = types.SimpleNamespace(block_size=64, kv_cache=torch.empty(0))
    return NgramHashState(cfg, layout, swa)


#: per hasher, the requests it hashed and their (input ids, hash ids, token mask)
_HASHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hash_batch(hasher, requests):
    """vLLM's hash ids ``[T, layers, 24]`` (int32) for one forward: ``requests`` are (tokens before the
    chunk, the chunk's tokens), as DeepseekV4Model.forward hands them to the hasher. Returns
    (input ids, hash ids, token mask: False on image tokens), copies of the first hashing of the same
    requests by the same hasher: stateless (every look-back token supplied), it would compute the same
    ids again in Triton's interpreter, where the tests step the same conversation through many layers."""
    key = tuple((tuple(history), tuple(chunk)) for history, chunk in requests)
    hashed = _HASHED.setdefault(hasher, {})
    if key not in hashed:
        hashed[key] = _hash_batch(hasher, requests)
    return tuple(t.clone() for t in hashed[key])


def _hash_batch(hasher, requests):
    from vllm.models.deepseek_v41.common.mm_preprocess import image_sentinel_mask

    depth = hasher.lookback_depth
    ids = torch.tensor([t for _, chunk in requests for t in chunk], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(h), len(h) + len(c)) for h, c in requests])
    starts = [0]
    for _, chunk in requests:
        starts.append(starts[-1] + len(chunk))
    lookback = torch.tensor(
        [[h[-1 - k] if k < len(h) else -1 for k in range(depth)] for h, _ in requests], dtype=torch.int32
    )
    image = image_sentinel_mask(ids)
    hashes = hasher(
        ids,
        positions,
        torch.tensor(starts, dtype=torch.int32),
        image,
        lookback,
        image_sentinel_mask(lookback),
        None,
        None,
    )
    return ids, hashes, ~image


def step(engrams, hashes, x, token_mask):
    """What DeepseekV4Model.forward does with one step's hash ids: every Engram layer's
    ``prepare_embeddings`` first (before the decoder layers), then each layer on the residual stream."""
    for e in engrams:
        e.prepare_embeddings(hashes[:, e.layer_hash_index])
    return [e(x, hashes[:, e.layer_hash_index], token_mask) for e in engrams]


def worker_step(engrams, hashes, x, mask, output=None, outs=None, forward: bool = True):
    """One step as vLLM's worker runs it: its own ``Worker.execute_model`` (hooked: the plugin's check before
    every step and the in_graph layers' arming, the host code of the plugin a FULL graph's replay runs), whose
    model runner (here: what DeepseekV4Model.forward does with the step) hashes and runs the layers, then its
    own ``Worker.sample_tokens`` (hooked: where the step's results are read, its outcome checked), returning
    ``output`` (default: a ModelRunnerOutput, its tokens on the host). Returns the layers' outputs (also
    appended to ``outs``; None without ``forward``: a model runner that returns without running the layers), with
    the Worker's result where it is not ``output``; raises before the forward (a step that cannot be armed) or
    where the result is read (a step whose rows were not served)."""
    from tableclient.vllm import graphs, hooks
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_worker import Worker

    assert hooks.hooked(Worker.execute_model, graphs.execute_model)
    assert hooks.hooked(Worker.sample_tokens, graphs.sample_tokens)
    outs = [] if outs is None else outs
    worker = object.__new__(Worker)
    worker._pp_send_work, worker.profiler, worker.use_v2_model_runner = [], None, False
    output = ModelRunnerOutput(req_ids=[], req_id_to_index={}) if output is None else output
    worker.model_runner = types.SimpleNamespace(
        execute_model=lambda scheduler_output, intermediate: outs.append(
            step(engrams, hashes, x, mask) if forward else None
        ),
        sample_tokens=lambda grammar_output: output,
    )
    assert Worker.execute_model(worker, types.SimpleNamespace(total_num_scheduled_tokens=len(hashes))) is None
    result = Worker.sample_tokens(worker, None)
    return outs[-1] if result is output else (outs[-1], result)


def dummy_step(engrams, hasher, forward: bool = True):
    """vLLM's own ``Worker.execute_dummy_batch`` (hooked), as a data-parallel replica with nothing to run joins its
    peers' step: its model runner's dummy run steps the layers over vLLM's dummy hashes (every id dead), as a FULL
    replay of the dummy does, or (``forward`` False) hashes nothing and runs no Engram layer, as vLLM's dummy run
    does outside FULL replays (no attention metadata). Returns the layers' outputs (None without ``forward``)."""
    from tableclient.vllm import graphs, hooks
    from vllm.v1.worker.gpu_worker import Worker

    assert hooks.hooked(Worker.execute_dummy_batch, graphs.execute_dummy_batch)
    dummy, keep = hasher.dummy_hashes(torch.zeros(4, dtype=torch.int32))
    x = torch.zeros((4, HC, HIDDEN), dtype=torch.bfloat16)
    outs = []
    worker = object.__new__(Worker)
    worker.parallel_config = types.SimpleNamespace(data_parallel_size=2)  # a DP replica, as vLLM runs them
    worker.model_runner = types.SimpleNamespace(
        uniform_decode_query_len=1,
        _dummy_run=torch.inference_mode()(  # as vLLM's own GPUModelRunner._dummy_run
            lambda *a, **k: outs.append(step(engrams, dummy, x, keep) if forward else None)
        ),
    )
    Worker.execute_dummy_batch(worker)
    return outs[0]


def conversation(seed: int = 0):
    """Prefill of two prompts (one with an image span, n-grams of live tokens on both sides of it), the second
    chunked (its second chunk's n-grams reaching back into the first), then decode steps: yields the requests of
    each forward, as ``hash_batch`` takes them. Both prefills hold an odd number of tokens (a sequence-parallel
    shard pads them); short, as every token of a forward costs a layer's kernels tens of milliseconds in Triton's
    interpreter."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 300, 17).tolist()
    a[10:14] = [IMAGE] * 4
    b = rng.integers(0, 300, 15).tolist()
    yield [([], a), ([], b[:8])]
    yield [(b[:8], b[8:])]
    for _ in range(6):
        ta, tb = rng.integers(0, 300, 2).tolist()
        yield [(a, [ta]), (b, [tb])]
        a, b = a + [ta], b + [tb]


def decode_steps(seed: int = 0) -> list:
    """The conversation's decode steps (two requests of one new token each), as ``hash_batch`` takes them: the
    steps a decode graph replays, each far cheaper in Triton's interpreter than the conversation's prefills."""
    return list(conversation(seed))[2:]
