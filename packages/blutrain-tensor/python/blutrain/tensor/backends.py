"""blutrain.tensor.backends: process-wide switches that choose between kernels of one op.

    import blutrain.tensor as bt
    bt.backends.flash_attention_cpu()              # False: the CPU composes matmul + softmax
    with bt.backends.use_flash_attention_cpu(True):
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)   # the fused CPU kernel

Each switch changes which kernel runs, not what is computed: both paths give the same values to
rounding (the tests compare them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import _tensor as _C

__all__ = ["flash_attention_cpu", "set_flash_attention_cpu", "use_flash_attention_cpu"]


def flash_attention_cpu() -> bool:
    """Whether ``scaled_dot_product_attention`` runs the fused flash-attention kernel on the CPU
    too (without a mask or dropout). Off by default: the composed path runs the CPU's GEMMs.
    ``BLUTRAIN_FLASH_ATTENTION_CPU=1`` turns it on at start. On CUDA the fused kernel runs
    wherever it takes the inputs, whatever this says."""
    return bool(_C._flash_attention_cpu())


def set_flash_attention_cpu(on: bool) -> None:
    """Turns the fused CPU attention kernel on or off for the whole process."""
    if not isinstance(on, bool):
        raise TypeError(f"[set_flash_attention_cpu] on must be a bool, got {on!r}")
    _C._set_flash_attention_cpu(on)


@contextlib.contextmanager
def use_flash_attention_cpu(on: bool = True) -> Iterator[None]:
    """Sets :func:`flash_attention_cpu` inside a ``with`` block and restores it after."""
    old = flash_attention_cpu()
    set_flash_attention_cpu(on)
    try:
        yield
    finally:
        set_flash_attention_cpu(old)
