"""Test isolation for every package's tests: blutrain.tensor's process-wide settings are put back
after each test, so one that changes them cannot change a later test's numbers.

The case that needed it: a bf16 GPT-2 sets TF32 float32 matmuls for the process (as its
precision mode says), and a float32 test that ran after it without resetting them compared
TF32-rounded GEMMs with PyTorch's float32 and failed at 1.07e-3 against a 1e-3 bound.
"""

from __future__ import annotations

import pytest

try:  # the allocator's and linalg's tests run without blutrain.tensor too
    import blutrain.tensor as bt
except ImportError:  # pragma: no cover
    bt = None


@pytest.fixture(autouse=True)
def _restore_tensor_settings():
    if bt is None:
        yield
        return
    precision = bt.get_float32_matmul_precision()
    deterministic = bt.are_deterministic_algorithms_enabled()
    grad = bt.is_grad_enabled()
    cast_cache = bt.is_cast_cache_enabled()
    yield
    bt.set_float32_matmul_precision(precision)
    bt.use_deterministic_algorithms(deterministic)
    bt.set_grad_enabled(grad)
    bt.set_cast_cache_enabled(cast_cache)
