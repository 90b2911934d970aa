"""The engine tests' first step: skip a test module where its engine is not installed (``make test`` installs
the pinned releases), and fail, never skip, where the engine is installed but cannot load."""

from __future__ import annotations

import importlib

import pytest

PINNED = {"sglang": "0.5.23", "vllm": "0.33.0"}


def require_engine(module: str):
    """Imports ``module`` of an engine (its first name: ``sglang`` or ``vllm``) and returns it; skips the calling
    test module when torch or the engine itself is missing, and raises any other import error."""
    engine = module.split(".")[0]
    pytest.importorskip("torch")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != engine:
            raise
        pytest.skip(f"{engine}=={PINNED[engine]} is installed by `make test`", allow_module_level=True)
