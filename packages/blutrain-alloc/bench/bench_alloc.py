"""Allocator benchmark: the allocation trace of a GPT-2 124M training step replayed
through blutrain.alloc and the alternatives, in the same process on the same GPU.

Prints a table and writes JSON (--json). Figures:
  * C++ replay, ns per malloc or free: blutrain.alloc, cudaMalloc/cudaFree, cudaMallocAsync
    (all timed inside one C++ loop, so no Python call enters the figure);
  * Python replay, ns per operation: blutrain.alloc against PyTorch's caching allocator
    (torch.cuda.caching_allocator_alloc/delete), both paying one Python call per operation;
  * peak reserved / peak allocated on the trace, ours next to PyTorch's.
Without a GPU it replays a synthetic trace on host memory against malloc/free.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import blutrain.alloc as ba  # noqa: E402
from blutrain.alloc import _alloc  # noqa: E402

import traces  # noqa: E402


def python_replay(trace: np.ndarray, alloc, free, repeats: int) -> float:
    """ns per operation of a Python loop over the trace (median of `repeats`)."""
    rows = trace.tolist()
    slots = [0] * (int(trace[:, 1].max()) + 1)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter_ns()
        for op, i, size in rows:
            if op == 0:
                slots[i] = alloc(size)
            else:
                free(slots[i])
        t1 = time.perf_counter_ns()
        if r:
            times.append((t1 - t0) / len(rows))
    return float(np.median(times))


def ratio_of(stats: dict) -> float:
    return stats["reserved_bytes_peak"] / max(1, stats["allocated_bytes_peak"])


def run_gpu(args) -> dict:
    import torch

    results: dict = {"device": torch.cuda.get_device_name(0), "traces": {}}
    for dtype in args.dtypes:
        trace = traces.record_torch_gpt2(dtype, args.batch, args.seq)
        torch.cuda.empty_cache()  # the recorded model's memory goes back before we replay
        if args.json:  # keep the trace: it replays on host memory too (see traces.py)
            np.save(os.path.join(os.path.dirname(os.path.abspath(args.json)),
                                 f"trace_gpt2_{dtype}.npy"), trace)
        entry: dict = {"ops": int(len(trace))}
        stream = torch.cuda.current_stream().cuda_stream
        # Our memory figures: one replay from an empty cache.
        ba.empty_cache(0)
        ba.reset_peak_stats(0)
        r = _alloc.replay_trace(trace, "blutrain", 0, stream, 1)
        s = ba.stats(0)
        entry["peak_requested_bytes"] = r["peak_live_bytes"]
        entry["blutrain_peak_reserved"] = s["reserved_bytes_peak"]
        entry["blutrain_peak_allocated"] = s["allocated_bytes_peak"]
        entry["blutrain_reserved_over_allocated"] = ratio_of(s)
        entry["blutrain_reserved_over_requested"] = s["reserved_bytes_peak"] / r["peak_live_bytes"]
        ba.empty_cache(0)
        # The same with expandable segments.
        ba.set_expandable(True, 0)
        ba.reset_peak_stats(0)
        t0 = time.perf_counter_ns()
        _alloc.replay_trace(trace, "blutrain", 0, stream, 1)
        entry["expandable_first_replay_ms"] = (time.perf_counter_ns() - t0) / 1e6
        s = ba.stats(0)
        entry["expandable_reserved_over_allocated"] = ratio_of(s)
        r = _alloc.replay_trace(trace, "blutrain", 0, stream, args.repeats)
        entry["cpp_ns_blutrain_expandable"] = r["total_ns"] / r["ops"]
        ba.empty_cache(0)
        ba.set_expandable(False, 0)
        for name in ("blutrain", "cudaMalloc", "cudaMallocAsync"):
            reps = 2 if name == "cudaMalloc" else args.repeats
            r = _alloc.replay_trace(trace, name, 0, stream, reps)
            entry[f"cpp_ns_{name}"] = r["total_ns"] / r["ops"]
        ba.empty_cache(0)
        # Python-level: ours vs PyTorch's caching allocator, same loop.
        entry["py_ns_blutrain"] = python_replay(
            trace, lambda n, s=stream: _alloc.malloc(n, 0, s), _alloc.free, args.repeats)
        ba.empty_cache(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        entry["py_ns_torch"] = python_replay(
            trace, lambda n, s=stream: torch.cuda.caching_allocator_alloc(n, 0, s),
            torch.cuda.caching_allocator_delete, args.repeats)
        entry["torch_peak_reserved"] = torch.cuda.max_memory_reserved()
        entry["torch_peak_allocated"] = torch.cuda.max_memory_allocated()
        entry["torch_reserved_over_allocated"] = (
            entry["torch_peak_reserved"] / entry["torch_peak_allocated"])
        torch.cuda.empty_cache()
        results["traces"][f"gpt2-124m-{dtype}"] = entry
    return results


def run_cpu(args) -> dict:
    results: dict = {"device": "host (no GPU)", "traces": {}}
    trace = traces.synthetic_gpt2(n_layer=4, n_embd=256, n_head=4, vocab=4096, batch=4, seq=256)
    entry: dict = {"ops": int(len(trace))}
    ba.empty_cache("cpu")
    ba.reset_peak_stats("cpu")
    r = _alloc.replay_trace(trace, "blutrain", ba.HOST_PAGEABLE, 0, 1)
    s = ba.stats("cpu")
    entry["peak_requested_bytes"] = r["peak_live_bytes"]
    entry["blutrain_reserved_over_allocated"] = ratio_of(s)
    entry["blutrain_reserved_over_requested"] = s["reserved_bytes_peak"] / r["peak_live_bytes"]
    for name in ("blutrain", "malloc"):
        r = _alloc.replay_trace(trace, name, ba.HOST_PAGEABLE, 0, args.repeats)
        entry[f"cpp_ns_{name}"] = r["total_ns"] / r["ops"]
    ba.empty_cache("cpu")
    results["traces"]["synthetic-gpt2-small-host"] = entry
    return results


def table(results: dict) -> str:
    lines = [f"blutrain.alloc benchmark on {results['device']}"]
    for name, e in results["traces"].items():
        lines.append(f"\ntrace {name}: {e['ops']} operations, peak live "
                     f"{e['peak_requested_bytes'] / 2**30:.2f} GiB")
        lines.append(f"  {'allocator':<34}{'ns/op':>10}")
        for key, label in [("cpp_ns_blutrain", "blutrain.alloc (C++ loop)"),
                           ("cpp_ns_blutrain_expandable", "  ... expandable segments"),
                           ("cpp_ns_cudaMalloc", "cudaMalloc/cudaFree (C++ loop)"),
                           ("cpp_ns_cudaMallocAsync", "cudaMallocAsync (C++ loop)"),
                           ("cpp_ns_malloc", "malloc/free (C++ loop)"),
                           ("py_ns_blutrain", "blutrain.alloc (Python loop)"),
                           ("py_ns_torch", "PyTorch caching (Python loop)")]:
            if key in e:
                lines.append(f"  {label:<34}{e[key]:>10.0f}")
        lines.append(f"  peak reserved / peak allocated: blutrain "
                     f"{e['blutrain_reserved_over_allocated']:.3f}"
                     + (f" (expandable segments {e['expandable_reserved_over_allocated']:.3f})"
                        if "expandable_reserved_over_allocated" in e else "")
                     + (f", PyTorch {e['torch_reserved_over_allocated']:.3f}"
                        if "torch_reserved_over_allocated" in e else "")
                     + "; blutrain reserved / requested "
                     + f"{e['blutrain_reserved_over_requested']:.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write results here (atomically)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="host trace even if a GPU is present")
    args = ap.parse_args()
    gpu = not args.cpu and ba.device_count() > 0
    results = run_gpu(args) if gpu else run_cpu(args)
    print(table(results))
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(results, f, indent=2)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
