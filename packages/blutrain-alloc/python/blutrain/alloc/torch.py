"""Make blutrain.alloc PyTorch's CUDA allocator.

    import blutrain.alloc.torch
    blutrain.alloc.torch.use()       # before PyTorch's first CUDA allocation

PyTorch loads ``bt_alloc_torch_malloc`` / ``bt_alloc_torch_free`` from our
shared library through ``torch.cuda.memory.CUDAPluggableAllocator``, so the
allocator's state is the same one blutrain.alloc reports on.
"""

from __future__ import annotations

from ._alloc import library_path


def pluggable_allocator():
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` over our shared library."""
    import torch

    return torch.cuda.memory.CUDAPluggableAllocator(
        library_path(), "bt_alloc_torch_malloc", "bt_alloc_torch_free"
    )


def use() -> None:
    """Install blutrain.alloc as PyTorch's CUDA allocator (must precede any CUDA allocation)."""
    import torch

    torch.cuda.memory.change_current_allocator(pluggable_allocator())
