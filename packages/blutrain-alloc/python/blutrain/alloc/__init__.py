"""blutrain.alloc: a caching allocator for CUDA devices and host memory.

Usable alone: other projects can route CuPy (:func:`blutrain.alloc.cupy.use`) or
PyTorch (:func:`blutrain.alloc.torch.use`) through it, and C/C++ code links the
shared library found by ``python -m blutrain.alloc --cmake-dir``.

Devices are named as in the C ABI: a CUDA index ``0, 1, ...``, or
:data:`HOST_PAGEABLE` (-1) and :data:`HOST_PINNED` (-2) for host memory. The
functions also accept ``"cpu"``, ``"pinned"``, ``"cuda"`` and ``"cuda:N"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import _alloc
from ._alloc import (
    ABI_VERSION,
    HOST_PAGEABLE,
    HOST_PINNED,
    OutOfMemoryError,
    device_count,
    library_path,
    set_option,
)
from ._summary import memory_summary, plot_snapshot

__all__ = [
    "ABI_VERSION",
    "HOST_PAGEABLE",
    "HOST_PINNED",
    "OutOfMemoryError",
    "Device",
    "malloc",
    "free",
    "record_stream",
    "stats",
    "reset_peak_stats",
    "empty_cache",
    "set_memory_fraction",
    "set_memory_limit",
    "snapshot",
    "set_caching",
    "set_expandable",
    "plot_snapshot",
    "memory_summary",
    "graph_pool",
    "release_graph_pool",
    "device_count",
    "library_path",
    "set_option",
    "get_include",
    "get_cmake_dir",
]

Device = int | str


def _device(device: Device) -> int:
    """Map a device name to the C ABI's integer form."""
    if isinstance(device, bool):
        raise TypeError(f"[alloc] device must be an int or str, got {device!r}")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        if device == "cpu":
            return HOST_PAGEABLE
        if device == "pinned":
            return HOST_PINNED
        if device == "cuda":
            return 0
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
    raise ValueError(
        f"[alloc] unknown device {device!r}: use 'cpu', 'pinned', 'cuda', 'cuda:N' or an int"
    )


def malloc(size: int, device: Device = "cpu", stream: int = 0) -> int:
    """Allocate ``size`` bytes on ``device`` for use on ``stream``; returns the address.

    Raises :class:`OutOfMemoryError` (a MemoryError) when even a released cache
    cannot satisfy the request; its message holds the allocator's statistics.
    """
    return _alloc.malloc(size, _device(device), stream)


def free(ptr: int) -> None:
    """Return ``ptr`` to the cache (ValueError if we do not own it or it was freed)."""
    _alloc.free(ptr)


def record_stream(ptr: int, stream: int) -> None:
    """Mark ``ptr`` as used on ``stream`` so it is not reused before that work is done."""
    _alloc.record_stream(ptr, stream)


def stats(device: Device = "cpu") -> dict[str, int]:
    """Byte totals and counters of one device's pool, plus derived ``fragmentation``.

    ``fragmentation`` is 1 - largest free block / free cached bytes (0 when the
    cache is one piece or empty).
    """
    s = _alloc.stats(_device(device))
    cached = s["reserved_bytes"] - s["allocated_bytes"]
    s["cached_free_bytes"] = cached
    s["fragmentation"] = 0.0 if cached <= 0 else 1.0 - s["largest_free_block"] / cached
    return s


def reset_peak_stats(device: Device = "cpu") -> None:
    """Set the peak counters to the current values."""
    _alloc.reset_peak_stats(_device(device))


def empty_cache(device: Device = "cpu") -> None:
    """Return every wholly free cached segment of ``device`` to the system."""
    _alloc.empty_cache(_device(device))


def set_memory_fraction(fraction: float, device: Device = "cuda") -> None:
    """Cap this process's reserved memory on ``device`` at ``fraction`` of its capacity."""
    _alloc.set_memory_fraction(fraction, _device(device))


def set_memory_limit(nbytes: int, device: Device = "cuda") -> None:
    """Cap reserved memory on ``device`` at ``nbytes`` (0 removes the cap)."""
    _alloc.set_memory_limit(nbytes, _device(device))


def set_expandable(on: bool, device: Device = "cuda") -> None:
    """Serve new large allocations of ``device`` from expandable segments.

    One address range per stream grows and shrinks in 2 MiB granules (CUDA virtual
    memory on devices, mmap on host), so freed space at its end always serves a
    larger request: less fragmentation, at the cost of mapping calls when growing.
    ``BLUTRAIN_ALLOC_CONF=expandable_segments:1`` turns it on for every device.
    """
    _alloc.set_pool_option(_device(device), "expandable_segments", int(on))


def set_caching(on: bool, device: Device = "cuda") -> None:
    """Turn caching off (``on=False``) or back on for ``device``'s default pool.

    Off, every request gets a system allocation of exactly its size, returned to the system
    when freed (``cudaMalloc`` / ``cudaFree`` on devices, which synchronise): memory checkers
    such as ``compute-sanitizer --tool memcheck`` then report an access past a tensor's end
    instead of it landing inside a cached segment.  Slow; for finding bugs.  Graph-capture
    pools keep caching.  ``BLUTRAIN_ALLOC_CONF=caching:0`` turns it off for every device.
    """
    _alloc.set_pool_option(_device(device), "caching", int(on))


def snapshot(device: Device = "cpu") -> list[dict]:
    """Every block of every segment of ``device``, in address order."""
    return _alloc.snapshot(_device(device))


@contextlib.contextmanager
def graph_pool(device: Device, stream: int) -> Iterator[int]:
    """Route allocations on ``stream`` to a private pool while a CUDA graph is captured.

    Yields the pool id; call :func:`release_graph_pool` once the graphs that
    used it are destroyed.
    """
    dev = _device(device)
    pool = _alloc.begin_graph_pool(dev, stream)
    try:
        yield pool
    finally:
        _alloc.end_graph_pool(dev, stream)


def release_graph_pool(pool: int, device: Device = "cuda") -> None:
    """Release a private pool whose graphs are gone."""
    _alloc.release_graph_pool(_device(device), pool)


def get_include() -> str:
    """Directory holding ``blutrain/alloc.h``."""
    from ._paths import include_dir

    return include_dir()


def get_cmake_dir() -> str:
    """Directory holding ``BlutrainAllocConfig.cmake`` (for ``find_package(BlutrainAlloc)``)."""
    from ._paths import cmake_dir

    return cmake_dir()
