"""blutrain-dist tests: the multi-rank cases run under mpiexec (dist_worker.py), launched once per
world size (dist_runs.py); fault tests launch their own small jobs; GPU tests run in-process."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random inputs per test; BLUTRAIN_TEST_SEED=N replays one (the seed is printed)."""
    env = os.environ.get("BLUTRAIN_TEST_SEED")
    seed = int(env) if env else zlib.crc32(os.urandom(8))
    print(f"numpy seed {seed} for {request.node.name}")
    return np.random.default_rng(seed)
