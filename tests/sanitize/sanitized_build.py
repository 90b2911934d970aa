"""pytest plugin of the sanitizer job (tests/sanitize/run.py passes ``-p sanitized_build``): the session
refuses to start unless every C extension is imported from the sanitized copy and instrumented, so a
clean run can only mean the sanitized modules ran clean."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    from stress import check_imports

    tree = os.environ.get("TABLESERVER_SANITIZE_TREE")
    if not tree:
        raise pytest.UsageError("sanitized_build: TABLESERVER_SANITIZE_TREE unset: run tests/sanitize/run.py")
    try:
        check_imports(tree)
    except RuntimeError as e:
        raise pytest.UsageError(f"sanitized_build: {e}") from e
