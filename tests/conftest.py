import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared blocks and helpers by name
import testpaths  # noqa: E402

testpaths.add()  # ... and each other across the package folders

import pytest  # noqa: E402

LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _launcher_env_is_left_as_found():
    """A test that leaves a launcher's variables in os.environ makes every later subprocess believe an outside
    launcher started it: a later ``python train.py`` then waits forever for a rank that never comes (CI hung 600 s
    on exactly this). Fail the test that leaks them, not the one that hangs."""
    before = {name: os.environ.get(name) for name in LAUNCHER_ENV}
    yield
    leaked = {name: os.environ.get(name) for name in LAUNCHER_ENV if os.environ.get(name) != before[name]}
    assert not leaked, f"this test left launcher variables in os.environ: {leaked}; restore them in the test"
