"""Timing helpers shared by the CUDA kernel benchmarks (bench_cuda_*.py run as scripts, so this
directory is on sys.path): CUDA-event timing of ours or of PyTorch, and device time from a
replayed CUDA graph (both return the median over `batches` of the per-call time, in ms); the
device time of each kernel a call launches (kernel_profile, through torch.profiler)."""

from __future__ import annotations

import statistics

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def sync_bt() -> None:
    bt._tensor._cuda_synchronize(0)


def time_events(fn, reps: int, batches: int = 7, torch_events: bool = False) -> float:
    """Eager: CUDA events around `reps` calls (ours: bt events; torch_events: torch's)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize() if torch_events else sync_bt()
    out = []
    for _ in range(batches):
        if torch_events:
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
        else:
            e0, e1 = bt.cuda.Event(), bt.cuda.Event()
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / reps)
    return statistics.median(out)


def time_graph(fn, reps: int, batches: int = 7) -> float:
    """Device time of ours: `reps` calls captured in one CUDA graph, replays timed with events
    (no host launch gaps).  nan (with a note) if the capture fails."""
    for _ in range(3):
        fn()
    sync_bt()
    g = bt.cuda.CUDAGraph()
    try:
        with bt.cuda.graph(g):
            for _ in range(reps):
                fn()
    except Exception as e:  # noqa: BLE001 - report and go on with the eager numbers
        print(f"  (graph capture failed: {type(e).__name__}: {e})")
        return float("nan")
    try:
        g.replay()
        sync_bt()
        out = []
        for _ in range(batches):
            e0, e1 = bt.cuda.Event(), bt.cuda.Event()
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            out.append(e0.elapsed_time(e1) / reps)
        return statistics.median(out)
    finally:
        g.reset()


def kernel_profile(fn, n: int = 5) -> list:
    """Device time per call of each kernel (and memcpy / memset) `fn` launches, largest first:
    [(name, ms, launches per call)].  torch.profiler's CUPTI trace records every kernel of the
    process, ours included; needs torch with CUDA."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    sync_bt()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        sync_bt()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    agg: dict = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            t, c = agg.get(e["name"][:80], (0.0, 0))
            agg[e["name"][:80]] = (t + e["dur"] / 1e3 / n, c + 1 / n)
    return sorted(((k, t, c) for k, (t, c) in agg.items()), key=lambda r: -r[1])


def print_profile(title: str, rows: list, top: int = 12) -> None:
    total = sum(r[1] for r in rows)
    print(f"  -- {title}: {total:.3f} ms of kernels per call")
    for name, ms, calls in rows[:top]:
        print(f"     {ms:8.4f} ms  x{calls:4.1f}  {name}")
