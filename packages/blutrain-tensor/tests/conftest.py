"""Shared fixtures: fresh random inputs per test, and the optional PyTorch reference."""

from __future__ import annotations

import os

import numpy as np
import pytest

try:  # PyTorch CPU is a reference only; its tests skip without it.
    import torch
except ImportError:  # pragma: no cover
    torch = None


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    # Fresh inputs every run, printed so a failure can be replayed: BLUTRAIN_TEST_SEED=N pytest ...
    fixed = os.environ.get("BLUTRAIN_TEST_SEED")
    seed = int(fixed) if fixed else np.random.SeedSequence().entropy % (2**32)
    print(f"numpy seed {seed} for {request.node.name}")
    return np.random.default_rng(seed)


@pytest.fixture
def torch_ref():
    if torch is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0)")
    return torch
