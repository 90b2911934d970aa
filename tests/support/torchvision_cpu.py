"""Running SGLang's and vLLM's own Engram classes on this machine's CPU (torch 2.13 CPU build, no GPU).

Import this module before anything imports sglang or vllm (``cpu_site/sitecustomize.py`` does it for the
subprocesses vLLM starts). PyPI's torchvision wheels are CUDA builds: their
compiled ops cannot load beside a CPU torch, and ``torchvision/_meta_registrations.py`` then registers
fake kernels for two ops whose schemas were never defined, so ``import torchvision`` (which both engines'
layers import, for their multimodal preprocessing) fails. Defining the two schemas lets the pure-Python
parts of torchvision import; nothing here calls them. With a CUDA (or ROCm) build of torch, as in a real
deployment with its matching torchvision, nothing is defined: torchvision's own ops load, and
defining their schemas first would make that load abort the process.
"""

from __future__ import annotations

import torch

if torch.version.cuda is None and torch.version.hip is None:  # a CPU build: PyPI's torchvision ops cannot load
    _lib = torch.library.Library("torchvision", "FRAGMENT")
    for _op in ("nms", "qnms"):
        try:
            _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass  # already defined (a torchvision whose ops loaded)
