"""What users and engines see is unchanged by a refactor: the daemon's options and help, both metric registries,
the plugins' settings and environment variables, the client's options and names (tests/support/surface.py)."""

import json

import pytest
import surface  # tests/support, on the path by tests/conftest.py


@pytest.fixture(scope="module")
def now():
    return json.loads(json.dumps(surface.surface()))


@pytest.fixture(scope="module")
def snapshot():
    with open(surface.SNAPSHOT) as f:
        return json.load(f)


with open(surface.SNAPSHOT) as _f:
    PARTS = sorted(json.load(_f))


@pytest.mark.parametrize("part", PARTS)
def test_what_users_see_is_as_the_snapshot_has_it(part, now, snapshot):
    assert now[part] == snapshot[part], (
        f"{part} changed; if on purpose, rewrite the snapshot: python tests/support/surface.py --write"
    )
