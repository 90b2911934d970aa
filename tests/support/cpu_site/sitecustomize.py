"""For the Python subprocesses vLLM starts during the CPU tests (its model registry inspects a model class
in a fresh interpreter): before the first ``import torchvision``, what ``tests/support/torchvision_cpu.py`` does.
tests/support/vllm_cpu.py puts this directory on PYTHONPATH; nothing else uses it."""

import importlib.abc
import os
import sys


class _TorchvisionOnCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            import torchvision_cpu  # noqa: F401
        return None


sys.meta_path.insert(0, _TorchvisionOnCpu())
