"""bt.backends: the switch between the fused and the composed CPU attention kernels."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt


def _ops(q: bt.Tensor) -> list[str]:
    with bt.capture() as g:
        bt.scaled_dot_product_attention(q, q, q, is_causal=True)
    return [n["op"] for n in g.nodes]


def test_the_switch_picks_the_kernel_and_is_restored():
    q = bt.randn(1, 2, 4, 8)
    start = bt.backends.flash_attention_cpu()
    with bt.backends.use_flash_attention_cpu(True):
        assert bt.backends.flash_attention_cpu() is True
        assert "flash_attention" in _ops(q)
        with bt.backends.use_flash_attention_cpu(False):
            assert "flash_attention" not in _ops(q) and "softmax" in _ops(q)
        assert bt.backends.flash_attention_cpu() is True
    assert bt.backends.flash_attention_cpu() is start
    with pytest.raises(KeyError), bt.backends.use_flash_attention_cpu(not start):
        raise KeyError("restored on the way out of an exception too")
    assert bt.backends.flash_attention_cpu() is start


def test_both_kernels_give_the_same_values(rng):
    x = rng.standard_normal((2, 3, 5, 8))
    q = bt.tensor(x, dtype=bt.float64)
    outs = []
    for on in (False, True):
        with bt.backends.use_flash_attention_cpu(on):
            outs.append(bt.scaled_dot_product_attention(q, q, q, is_causal=True).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-12, atol=1e-13)


def test_set_needs_a_bool():
    with pytest.raises(TypeError, match=r"\[set_flash_attention_cpu\] on must be a bool, got 1"):
        bt.backends.set_flash_attention_cpu(1)  # type: ignore[arg-type]
