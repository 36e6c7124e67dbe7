"""Helpers shared by blutrain-tensor's tests (a unique module name: several packages' tests may
run in one pytest session, so `conftest` is not imported by name)."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt


def needs_linalg() -> None:
    if bt._linalg_status():
        pytest.skip(f"blutrain-linalg unavailable: {bt._linalg_status()}")


def f64(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().to(bt.float64).numpy()


# Tolerances against a float64 reference, per dtype (relative to magnitudes ~1).
TOL = {
    bt.float64: dict(rtol=1e-12, atol=1e-12),
    bt.float32: dict(rtol=1e-5, atol=1e-6),
    bt.float16: dict(rtol=2e-3, atol=2e-3),
    bt.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
FLOAT_DTYPES = [bt.float64, bt.float32, bt.float16, bt.bfloat16]


def gradient_probe():
    """(probe, seen): probe(x) is x * 1.0 whose backward records the data_ptr of the gradient
    arriving there (where that memory came from) in `seen`.  A custom Function rather than a hook,
    which on a view would change the path the gradient takes."""
    seen: list[int] = []

    class Probe(bt.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            seen.append(g.data_ptr())
            return g

    return Probe.apply, seen


# "cpu", and "cuda" as a GPU test (marked gpu, skipped where no device is)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
        ],
    ),
]
