#!/usr/bin/env bash
# The GPU-side checks in one run (at most ~10 minutes), for a machine with a CUDA GPU and a CUDA build of
# torch (CI has none, so these tests skip there): the CUDA tests (pinned step staging, its copy in a CUDA
# graph, the vLLM plugin's device copies (vLLM itself is not on that machine), the plugin inside SGLang
# 0.5.23 on the GPU), bench/bench_gpu.py, bench/bench_graph.py (served
# layers in captured CUDA graphs: before_replay and in_graph, 100 steps a bucket, a frozen and a killed
# server) and, on the machine's cores, bench/bench_transports.py (tcp against loopback bulk).
#
#   bash bench/gpu_check.sh [OUT_DIR]          (default bench/out)
#
# WHEELS=DIR first installs every wheel in DIR (pip --no-index --no-deps --target), for a GPU machine with
# no package index: this project's wheel (`TABLESERVER_BUILD_NATIVE=0 pip wheel --no-deps .`: pure, for any
# Python; the repo's own tableserver then runs numpy's take), sglang==0.5.23 and the packages of
# tests/requirements-engines.txt that the machine's Python lacks. SGLang 0.5.23's CUDA code paths import
# sglang-kernel 0.4.10 and sgl-deep-gemm at load time (compiled for the torch 2.14.1 it pins): without
# them its Engram modules cannot load on a GPU, and the SGLang tests here fail at collection or setup.
#
# Notes, not run here (issue 38): the measured figure behind `make replay`'s host KV model (bench/kv_model.py)
# needs a machine that holds DeepSeek-V4.1 and its tables (8 GPUs of ~140 GB, a host of ~1 TiB). Serve it twice
# and replay the same multi-turn agent trace against each with SGLang's own bench (prefix hit rate, TTFT p50/p90,
# output throughput); G is the KV size SGLang logs per rank ("KV Cache is allocated ... KV size: G GB"):
#   SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1 python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4.1-Flash \
#       --tp 8 --enable-hierarchical-cache --hicache-ratio R0   # R0: `tableserver plan --placement 1=local,14=local --kv-pool-gib G`
#   eval "$(tableserver plan --placement bench/out/placement.toml --kv-pool-gib G | tail -1)"   # tables served, plan's flags
#   python -m sglang.benchmark.serving --backend sglang-oai-chat --dataset-name agentic-trace --dataset-path TRACE.json \
#       --num-prompts 200 --agentic-max-turns 30
set -u
out=${1:-bench/out}
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site \
        "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels in $WHEELS failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 -c 'import torch, numpy, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy",
numpy.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())' || exit 1
rc=0
# the step API's and the vLLM plugin's CUDA tests on their own (no engine needed): a collection error in the
# SGLang modules must not stop them
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -rs -p no:cacheprovider tests/daemon/test_step.py tests/gpu/test_vllm_gpu.py 2>&1 \
    | tee "$out/gpu_tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_sglang_gpu.py \
    tests/engines/sglang/test_sglang_plugin.py 2>&1 | tee -a "$out/gpu_tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${BENCH_TIMEOUT:-120}" python3 bench/bench_gpu.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_gpu.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${BENCH_TIMEOUT:-150}" python3 bench/bench_graph.py --steps 100 --out "$out" 2>&1 | tee "$out/bench_graph.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
timeout "${BENCH_TIMEOUT:-150}" python3 bench/bench_transports.py --gib 1 --iters 200 2>&1 | tee "$out/bench_transports.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
exit $rc
