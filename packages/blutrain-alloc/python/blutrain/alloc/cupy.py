"""Make blutrain.alloc the allocator of CuPy.

    import blutrain.alloc.cupy
    blutrain.alloc.cupy.use()        # every later CuPy allocation comes from us

Allocations are made on CuPy's current stream, so stream-ordered reuse holds.
"""

from __future__ import annotations

from . import _alloc


class _Owner:
    """Frees the block when CuPy drops its last reference to the memory."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        _alloc.free(self.ptr)


def allocate(size: int):
    """A ``cupy.cuda.MemoryPointer`` of ``size`` bytes on the current device and stream."""
    import cupy

    device = cupy.cuda.Device().id
    if size == 0:
        size = 1  # CuPy asks for zero-size arrays; give it a real, unique address
    stream = cupy.cuda.get_current_stream().ptr
    ptr = _alloc.malloc(size, device, stream)
    mem = cupy.cuda.memory.UnownedMemory(ptr, size, _Owner(ptr), device)
    return cupy.cuda.memory.MemoryPointer(mem, 0)


def use() -> None:
    """Route CuPy's device allocations through blutrain.alloc."""
    import cupy

    cupy.cuda.set_allocator(allocate)


def restore() -> None:
    """Give CuPy back its own memory pool."""
    import cupy

    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
