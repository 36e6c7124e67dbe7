"""blutrain.tensor.cuda: devices, streams, events, memory statistics and CUDA graphs.

    import blutrain.tensor as bt
    bt.cuda.is_available(), bt.cuda.device_count(), bt.cuda.get_device_name()
    start, end = bt.cuda.Event(), bt.cuda.Event()
    start.record(); step(); end.record(); end.synchronize(); ms = start.elapsed_time(end)
    bt.cuda.max_memory_allocated()          # blutrain-alloc's own statistics

Streams: every op of a device runs on that device's *current stream* (blutrain's own
non-blocking stream unless :func:`set_stream` swapped it). ``with bt.cuda.stream(h):`` runs a
block on another stream (a :class:`Stream`, or e.g. PyTorch's ``torch.cuda.current_stream()``).
Order work across streams with events, never with a host sync::

    side = bt.cuda.Stream()                       # non-blocking; priority=-1: more urgent
    side.wait_stream(bt.cuda.current_stream())    # side starts after what is queued so far
    with bt.cuda.stream(side):
        y = f(x)
    x.record_stream(side)                         # x's memory is not reused before side is done
    ev = side.record_event()
    ev.wait()                                     # the current stream waits for side

CUDA graphs capture a whole training step (forward, backward, optimizer update) once and replay
it with one launch::

    static_x, static_y = x0.cuda(), y0.cuda()     # the graph reads these addresses
    for _ in range(3):                             # warm-up: REQUIRED, see below
        step(static_x, static_y)
    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):
        static_loss = step(static_x, static_y)     # recorded, not run
    for x, y in batches:
        static_x.copy_(x); static_y.copy_(y)       # refresh the inputs in place
        g.replay()                                 # static_loss, params, grads are updated

Rules (as for ``torch.cuda.graphs``):

* Warm up first: run the step 2-3 times eagerly before capturing, so blutrain-linalg picks and
  caches its GEMM algorithms and workspaces (autotuning synchronises, which capture forbids; it
  is switched off while capturing, and a warning names GEMMs first seen during capture), and
  gradients / optimizer state that the step creates exist already.
* No host synchronisation inside the captured step: ``item()``, ``numpy()``, ``.cpu()``, prints
  of tensor values and :func:`synchronize` raise a clear error and the capture is abandoned (the
  stream stays usable). Python-side control flow runs once, at capture.
* Every allocation made during capture comes from blutrain-alloc's private graph pool
  (``begin_graph_pool``): those addresses belong to the graph until :meth:`CUDAGraph.reset`.
  Tensors allocated before the capture that the graph reads or writes (parameters, static
  inputs, optimizer state) must be kept alive by you while you replay.
* Random numbers (dropout) are baked into the graph: each replay draws the same numbers.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

from . import _tensor as _C

__all__ = [
    "CUDAGraph",
    "Event",
    "Stream",
    "are_deterministic_algorithms_enabled",
    "current_stream",
    "device_count",
    "empty_cache",
    "get_device_name",
    "graph",
    "is_available",
    "is_current_stream_capturing",
    "make_graphed_step",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "reset_peak_memory_stats",
    "set_stream",
    "stream",
    "synchronize",
    "use_deterministic_algorithms",
]

Device = Any  # None (cuda:0), an int, "cuda" / "cuda:N", or a bt device object


# ---- devices -------------------------------------------------------------------------------------
def is_available() -> bool:
    """Whether this build has CUDA and at least one device is present."""
    return bool(_C.cuda_built()) and _C.cuda_device_count() > 0


def device_count() -> int:
    """Number of CUDA devices (0 without CUDA, a driver or a GPU)."""
    return int(_C.cuda_device_count()) if _C.cuda_built() else 0


def _index(device: Device, op: str) -> int:
    """The CUDA device index `device` names; raises a clear error when it is not usable."""
    if device is None:
        idx = 0
    elif isinstance(device, bool):
        raise TypeError(f"[cuda.{op}] device must be an int or 'cuda:N', got {device!r}")
    elif isinstance(device, int):
        idx = device
    else:
        text = str(device)
        if text == "cuda":
            idx = 0
        elif text.startswith("cuda:") and text[5:].isdigit():
            idx = int(text[5:])
        else:
            raise ValueError(f"[cuda.{op}] not a CUDA device: {device!r} (use None, N or 'cuda:N')")
    if not _C.cuda_built():
        raise RuntimeError(
            f"[cuda.{op}] blutrain-tensor was built without CUDA (rebuild with BLUTRAIN_CUDA=ON)"
        )
    n = _C.cuda_device_count()
    if n == 0:
        raise RuntimeError(f"[cuda.{op}] no CUDA device is present (or the driver is missing)")
    if not 0 <= idx < n:
        raise RuntimeError(f"[cuda.{op}] cannot use cuda:{idx}: only {n} CUDA device(s) present")
    return idx


def get_device_name(device: Device = None) -> str:
    """The device's name, e.g. 'NVIDIA H200'."""
    return str(_C._cuda_device_name(_index(device, "get_device_name")))


def synchronize(device: Device = None) -> None:
    """Wait for all work queued on the device's current stream (raises while capturing)."""
    _C._cuda_synchronize(_index(device, "synchronize"))


def manual_seed(seed: int) -> None:
    """Seed the generator; the CPU and every GPU share one counter-based (Philox) generator,
    so this is :func:`blutrain.tensor.manual_seed`."""
    _C.manual_seed(int(seed))


manual_seed_all = manual_seed


# ---- streams -------------------------------------------------------------------------------------
def current_stream(device: Device = None) -> int:
    """The device's current stream as an integer ``cudaStream_t`` handle."""
    return int(_C._cuda_current_stream(_index(device, "current_stream")))


def set_stream(handle: int, device: Device = None) -> None:
    """Make ``handle`` (a ``cudaStream_t`` as an int; 0 restores blutrain's own stream) the
    device's current stream. Swap streams between steps, not while another thread issues work."""
    h = handle.cuda_stream if hasattr(handle, "cuda_stream") else handle
    _C._cuda_set_stream(_index(device, "set_stream"), int(h))


@contextlib.contextmanager
def stream(handle: Any, device: Device = None) -> Iterator[None]:
    """Run the block's work on ``handle`` (an int ``cudaStream_t``, or an object with a
    ``cuda_stream`` attribute such as a ``torch.cuda.Stream``), then restore the previous stream.

    ``handle=None`` is a no-op, as in PyTorch. Ordering with work queued before the block on the
    previous stream is the caller's business (an :class:`Event` or a synchronize)."""
    if handle is None:
        yield
        return
    dev = _index(device, "stream")
    prev = current_stream(dev)
    set_stream(handle, dev)
    try:
        yield
    finally:
        _C._cuda_set_stream(dev, prev)


def is_current_stream_capturing(device: Device = None) -> bool:
    """Whether the device's current stream is being captured into a CUDA graph."""
    if not is_available():
        return False
    return bool(_C._cuda_is_capturing(_index(device, "is_current_stream_capturing")))


class Stream:
    """A CUDA stream blutrain creates (non-blocking: it never waits for the legacy default
    stream).  ``priority``: 0 is the default; negative values are more urgent, down to the
    device's greatest (see :meth:`priority_range`).  ``cuda_stream`` is the ``cudaStream_t`` as
    an int, so it works wherever a stream handle is taken (``bt.cuda.stream(s)``,
    ``tensor.record_stream(s)``, other libraries)."""

    def __init__(self, device: Device = None, priority: int = 0) -> None:
        self.device = _index(device, "Stream")
        self.priority = int(priority)
        greatest, least = self.priority_range(self.device)
        if not greatest <= self.priority <= least:
            raise ValueError(
                f"[cuda.Stream] priority {priority} is outside the device's range "
                f"[{greatest}, {least}] (lower is more urgent)"
            )
        self.cuda_stream = int(_C._cuda_stream_create(self.device, self.priority))

    @staticmethod
    def priority_range(device: Device = None) -> tuple[int, int]:
        """(greatest, least) priority of the device's streams; lower is more urgent."""
        g, lo = _C._cuda_stream_priority_range(_index(device, "Stream.priority_range"))
        return int(g), int(lo)

    def wait_event(self, event: Event) -> None:
        """Work queued on this stream from now on waits for `event` (on the device)."""
        event._check("wait")
        _C._cuda_stream_wait_event(self.cuda_stream, event._handle)

    def wait_stream(self, other: Any) -> None:
        """Work queued on this stream from now on waits for what `other` (a Stream or a
        cudaStream_t int) has queued so far."""
        ev = Event(enable_timing=False)
        ev.record(other, device=self.device)
        self.wait_event(ev)

    def record_event(self, event: Event | None = None) -> Event:
        """Record `event` (a new one by default) on this stream; returns it."""
        event = event or Event(enable_timing=False)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Block the host until this stream's queued work is done."""
        _C._cuda_stream_synchronize(self.cuda_stream)

    def query(self) -> bool:
        """Whether this stream's queued work is done (never blocks)."""
        return bool(_C._cuda_stream_query(self.cuda_stream))

    def __int__(self) -> int:
        return self.cuda_stream

    def __del__(self) -> None:
        h, self.cuda_stream = getattr(self, "cuda_stream", 0), 0
        if h:
            with contextlib.suppress(Exception):
                _C._cuda_stream_destroy(h)

    def __repr__(self) -> str:
        where = f"cuda:{self.device}, priority={self.priority}"
        return f"bt.cuda.Stream({where}, 0x{self.cuda_stream:x})"


# ---- events --------------------------------------------------------------------------------------
class Event:
    """A CUDA event: marks a point in a stream's work, for timing and waiting.

    Created lazily on the device of the first :meth:`record`."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.enable_timing = bool(enable_timing)
        self._handle = 0
        self._device = -1

    def record(self, stream: Any = None, device: Device = None) -> None:
        """Enqueue the event on `stream` (a Stream, a cudaStream_t int, an object with
        ``cuda_stream``), by default the device's current stream."""
        if device is None and (isinstance(stream, str) or (type(stream) is int and stream < 64)):
            stream, device = None, stream  # record("cuda:1") / record(1): a device, as before
        if isinstance(stream, Stream) and device is None:
            device = stream.device
        dev = _index(device, "Event.record")
        if self._handle and dev != self._device:
            raise ValueError(
                f"[cuda.Event.record] the event belongs to cuda:{self._device}, not cuda:{dev}"
            )
        if not self._handle:
            self._handle = int(_C._cuda_event_create(dev, self.enable_timing))
            self._device = dev
        if stream is None:
            _C._cuda_event_record(self._handle, dev)
        else:
            h = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
            _C._cuda_event_record_on(self._handle, int(h))

    def wait(self, stream: Any = None) -> None:
        """Make `stream` (default: the event's device's current stream) wait for the event's
        work, on the device: no host sync."""
        self._check("wait")
        if stream is None:
            stream = current_stream(self._device)
        h = stream.cuda_stream if hasattr(stream, "cuda_stream") else stream
        _C._cuda_stream_wait_event(int(h), self._handle)

    def _check(self, op: str) -> None:
        if not self._handle:
            raise RuntimeError(f"[cuda.Event.{op}] the event was never recorded")

    def synchronize(self) -> None:
        """Wait until the work before the event is done."""
        self._check("synchronize")
        _C._cuda_event_synchronize(self._handle)

    def query(self) -> bool:
        """Whether the work before the event is done (never blocks)."""
        self._check("query")
        return bool(_C._cuda_event_query(self._handle))

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event to ``end_event`` (both recorded with timing enabled;
        call ``end_event.synchronize()`` first)."""
        self._check("elapsed_time")
        end_event._check("elapsed_time")
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("[cuda.Event.elapsed_time] both events need enable_timing=True")
        return float(_C._cuda_event_elapsed_time(self._handle, end_event._handle))

    def __del__(self) -> None:
        h, self._handle = getattr(self, "_handle", 0), 0
        if h:
            with contextlib.suppress(Exception):
                _C._cuda_event_destroy(h)

    def __repr__(self) -> str:
        where = f"cuda:{self._device}" if self._handle else "not recorded"
        return f"bt.cuda.Event({where}, enable_timing={self.enable_timing})"


# ---- memory (blutrain-alloc's statistics for the device) -----------------------------------------
def _alloc() -> Any:
    import blutrain.alloc as alloc

    return alloc


def _stat_device(device: Device, op: str) -> int | None:
    """The device index, or None where no CUDA device exists (statistics are then 0)."""
    if not is_available():
        return None
    return _index(device, op)


def memory_stats(device: Device = None) -> dict[str, int]:
    """blutrain-alloc's statistics of the device (``blutrain.alloc.stats``); {} without a GPU."""
    dev = _stat_device(device, "memory_stats")
    return {} if dev is None else dict(_alloc().stats(dev))


def _stat(device: Device, key: str, op: str) -> int:
    dev = _stat_device(device, op)
    return 0 if dev is None else int(_alloc().stats(dev)[key])


def memory_allocated(device: Device = None) -> int:
    """Bytes held by live tensors on the device (rounded block sizes)."""
    return _stat(device, "allocated_bytes", "memory_allocated")


def max_memory_allocated(device: Device = None) -> int:
    """Peak of :func:`memory_allocated` since start or :func:`reset_peak_memory_stats`."""
    return _stat(device, "allocated_bytes_peak", "max_memory_allocated")


def memory_reserved(device: Device = None) -> int:
    """Bytes the allocator holds from the driver (live plus cached)."""
    return _stat(device, "reserved_bytes", "memory_reserved")


def max_memory_reserved(device: Device = None) -> int:
    """Peak of :func:`memory_reserved`."""
    return _stat(device, "reserved_bytes_peak", "max_memory_reserved")


def reset_peak_memory_stats(device: Device = None) -> None:
    """Set the peak counters to the current values."""
    dev = _stat_device(device, "reset_peak_memory_stats")
    if dev is not None:
        _alloc().reset_peak_stats(dev)


def empty_cache(device: Device = None) -> None:
    """Return every wholly free cached segment of the device to the driver."""
    dev = _stat_device(device, "empty_cache")
    if dev is not None:
        _alloc().empty_cache(dev)


def memory_summary(device: Device = None) -> str:
    """A human-readable table of the device's allocator statistics."""
    dev = _stat_device(device, "memory_summary")
    if dev is None:
        return "bt.cuda.memory_summary: no CUDA device is present"
    return str(_alloc().memory_summary(dev))


# ---- determinism -------------------------------------------------------------------------------
_linalg_saved: dict[str, int] = {}


def _linalg() -> Any:
    try:
        import blutrain.linalg as linalg
    except ImportError:  # pragma: no cover - matmul then raises its own error
        return None
    return linalg if hasattr(linalg, "set_option") else None


def use_deterministic_algorithms(mode: bool) -> None:
    """Bitwise-reproducible kernels on one device: no float atomics in blutrain's kernels, and
    blutrain-linalg's GEMM algorithm pinned to the cuBLASLt heuristic's first choice (measured
    autotuning off; restored when the mode is turned off). Algorithms already cached by an earlier
    autotuned run stay in use (still one fixed choice per shape)."""
    if not (isinstance(mode, bool) or type(mode).__name__ == "bool_"):  # (as PyTorch)
        raise TypeError(
            f"[use_deterministic_algorithms] argument 'mode' must be bool, got {mode!r:.60} "
            f"({type(mode).__name__})"
        )
    mode = bool(mode)
    _C.use_deterministic_algorithms(mode)
    la = _linalg()
    if la is None:
        return
    if mode and "autotune" not in _linalg_saved:
        _linalg_saved["autotune"] = int(la.get_option("autotune"))
        la.set_option("autotune", 0)
    elif not mode and "autotune" in _linalg_saved:
        la.set_option("autotune", _linalg_saved.pop("autotune"))


def are_deterministic_algorithms_enabled() -> bool:
    """Whether :func:`use_deterministic_algorithms` is on."""
    return bool(_C.are_deterministic_algorithms_enabled())


# ---- CUDA graphs ---------------------------------------------------------------------------------
class CUDAGraph:
    """A captured sequence of GPU work, replayed with one launch. See the module docstring.

    Capture with ``with bt.cuda.graph(g): ...``; :meth:`replay` re-runs it on the same memory;
    :meth:`reset` destroys it and releases its private memory pool.

    ``memsets_as_kernels``: replace the capture's memset nodes (cuBLASLt zeroes scratch words
    before its persistent GEMMs) by kernel nodes that write the same bytes, which a replay runs
    without the ~4 us of idle GPU a memset node costs. None: on unless the environment sets
    ``BLUTRAIN_GRAPH_MEMSETS=keep``."""

    def __init__(self, memsets_as_kernels: bool | None = None) -> None:
        if memsets_as_kernels is None:
            memsets_as_kernels = os.environ.get("BLUTRAIN_GRAPH_MEMSETS", "") != "keep"
        self._memsets_as_kernels = bool(memsets_as_kernels)
        self._g = _C._CUDAGraph()
        self._pool: int | None = None
        self._device: int | None = None
        self._stream: int | None = None

    # The steps of capture; `graph()` calls them and handles errors.
    def capture_begin(self, device: Device = None) -> None:
        if self._g.captured or self._g.capturing or self._pool is not None:
            raise RuntimeError(
                "[cuda.CUDAGraph.capture_begin] this graph already holds a capture; "
                "call reset() before capturing again"
            )
        dev = _index(device, "CUDAGraph.capture_begin")
        alloc = _alloc()
        # Work queued before the capture must not be pending in the pool's bookkeeping.
        _C._cuda_synchronize(dev)
        s = current_stream(dev)
        pool = int(alloc._alloc.begin_graph_pool(dev, s))
        try:
            self._g.capture_begin(dev, self._memsets_as_kernels)
        except BaseException:
            alloc._alloc.end_graph_pool(dev, s)
            alloc.release_graph_pool(pool, dev)
            raise
        self._pool, self._device, self._stream = pool, dev, s

    def capture_end(self) -> None:
        alloc = _alloc()
        try:
            self._g.capture_end()
        except BaseException:
            self._end_pool(alloc)
            self._release_pool(alloc)
            raise
        self._end_pool(alloc)

    def _abort(self) -> None:
        alloc = _alloc()
        self._g.capture_abort()
        self._end_pool(alloc)
        self._release_pool(alloc)

    def _end_pool(self, alloc: Any) -> None:
        if self._device is not None and self._stream is not None:
            with contextlib.suppress(Exception):
                alloc._alloc.end_graph_pool(self._device, self._stream)
            self._stream = None

    def _release_pool(self, alloc: Any) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            alloc.release_graph_pool(pool, self._device)

    def replay(self) -> None:
        """Launch the captured work on the device's current stream (asynchronous)."""
        self._g.replay()

    def reset(self) -> None:
        """Destroy the graph and release its private pool (memory still held by live tensors
        from the capture returns to the driver as they are freed)."""
        self._g.reset()
        if self._pool is not None:
            alloc = _alloc()
            self._end_pool(alloc)
            self._release_pool(alloc)
        self._device = None

    def pool(self) -> int | None:
        """The blutrain-alloc private pool id of this graph (None before capture)."""
        return self._pool

    def num_nodes(self) -> int:
        """Number of nodes (kernels, copies, ...) in the captured graph."""
        return int(self._g.num_nodes())

    @property
    def memsets_replaced(self) -> int:
        """Memset nodes of the capture that run as fill kernels (see the class docstring)."""
        return int(self._g.memsets_replaced)

    def debug_dump(self, path: str) -> None:
        """Write the captured graph as Graphviz text."""
        self._g.debug_dump(str(path))

    @property
    def captured(self) -> bool:
        return bool(self._g.captured)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.reset()

    def __repr__(self) -> str:
        state = f"{self.num_nodes()} nodes on cuda:{self._device}" if self.captured else "empty"
        return f"bt.cuda.CUDAGraph({state})"


@contextlib.contextmanager
def graph(cuda_graph: CUDAGraph, device: Device = None) -> Iterator[CUDAGraph]:
    """Capture the block's GPU work into ``cuda_graph`` (see the module docstring).

    blutrain-linalg's autotuning is off during the capture; GEMM shapes it had not seen before
    (a missing warm-up) are reported with a warning. On an error inside the block the capture is
    abandoned, its memory pool released and the stream left usable."""
    la = _linalg()
    saved_tune = misses = None
    if la is not None:
        saved_tune = int(la.get_option("autotune"))
        la.set_option("autotune", 0)
        with contextlib.suppress(Exception):
            misses = int(la.get_option("cache_misses"))
    try:
        cuda_graph.capture_begin(device)
        try:
            yield cuda_graph
        except BaseException:
            cuda_graph._abort()
            raise
        cuda_graph.capture_end()
    finally:
        if la is not None and saved_tune is not None:
            la.set_option("autotune", saved_tune)
    if la is not None and misses is not None:
        new = int(la.get_option("cache_misses")) - misses
        if new > 0:
            warnings.warn(
                f"[cuda.graph] {new} GEMM shape(s) were first seen during the capture: they use "
                "the heuristic's algorithm and per-call workspaces. Run the step 2-3 times "
                "before capturing (warm-up).",
                RuntimeWarning,
                stacklevel=3,
            )


def make_graphed_step(step: Any, *static_args: Any, warmup: int = 3) -> tuple[CUDAGraph, Any]:
    """Warm ``step(*static_args)`` up ``warmup`` times, capture it, and return
    ``(graph, static_output)``; afterwards refresh the static inputs in place and call
    ``graph.replay()``. The warm-up steps do real work (e.g. optimizer updates)."""
    if warmup < 1:
        raise ValueError("[cuda.make_graphed_step] warmup must be >= 1 (see bt.cuda docs)")
    for _ in range(warmup):
        step(*static_args)
    g = CUDAGraph()
    with graph(g):
        out = step(*static_args)
    return g, out
