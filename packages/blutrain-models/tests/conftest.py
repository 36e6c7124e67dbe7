"""Shared fixtures of blutrain-models' tests: fresh random data each run, seeds printed."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from blutrain.models import GPT2Config


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    # Fresh inputs every run, printed so a failure can be replayed: BLUTRAIN_TEST_SEED=N pytest ...
    fixed = os.environ.get("BLUTRAIN_TEST_SEED")
    seed = int(fixed) if fixed else np.random.SeedSequence().entropy % (2**32)
    print(f"numpy seed {seed} for {request.node.name}")
    return np.random.default_rng(seed)


@pytest.fixture
def small_config(rng: np.random.Generator) -> GPT2Config:
    """A random small GPT-2 shape: a few layers, odd vocab, heads dividing C."""
    n_head = int(rng.integers(1, 4))
    return GPT2Config(
        block_size=int(rng.integers(4, 17)),
        vocab_size=int(rng.integers(50, 300)),
        n_layer=int(rng.integers(1, 4)),
        n_head=n_head,
        n_embd=n_head * int(rng.integers(2, 6)) * 2,
    )


def random_weights(cfg: GPT2Config, rng: np.random.Generator, padded: bool = True):
    return {
        k: rng.standard_normal(s).astype(np.float32)
        for k, s in cfg.param_shapes(padded=padded).items()
    }


@pytest.fixture
def make_weights(rng):
    return lambda cfg, padded=True: random_weights(cfg, rng, padded)


@pytest.fixture
def rewrite_trainer_json():
    """edit(ck, fn): fn edits a checkpoint's trainer.json (as an older version would have
    written it); the manifest records its new size and hash, so the checkpoint stays intact."""
    import hashlib
    import json

    def edit(ck, fn) -> None:
        t = json.loads((ck / "trainer.json").read_text())
        fn(t)
        data = json.dumps(t).encode()
        (ck / "trainer.json").write_bytes(data)
        m = json.loads((ck / "manifest.json").read_text())
        digest = hashlib.sha256(data).hexdigest()
        m["files"]["trainer.json"] = {"bytes": len(data), "sha256": digest}
        (ck / "manifest.json").write_text(json.dumps(m))

    return edit


BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench_module(request: pytest.FixtureRequest):
    """A bench/ script imported as a module (the test module names it in BENCH_MODULE); bench/
    is on sys.path only while the test module runs."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(request.module.BENCH_MODULE)
    finally:
        sys.path.remove(str(BENCH))
