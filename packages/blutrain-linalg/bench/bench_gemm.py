"""GEMM benchmark: every GEMM of a GPT-2 124M training step, blutrain.linalg vs torch.matmul.

Rows = B*T = 16384. For each linear layer (in -> out) of GPT-2 124M (768->2304 qkv,
768->768 attention projection, 768->3072 fc, 3072->768 fc projection, 768->50257 lm head) it
times the forward GEMM (x @ W^T) and both backward GEMMs (dX = dY @ W, dW = dY^T @ X) in fp32
(fp32-accurate: ours is the 3xTF32 kernel on sm_80+, torch's SGEMM), tf32 and bf16, ours next to
torch.matmul in the same process on the same GPU, and linear + bias + GELU fused (one call,
pre-activation saved) against torch's three ops.

Timing, two ways, both reported (inputs rotated over --rotate sets so no call finds the
previous call's operands in L2; both sides write into preallocated outputs, out=, so
allocation is not timed on either side):
  per call  CUDA events around each call, median over --reps calls after --warmup calls. The
            host work between the start event and the launch counts, so for GEMMs of tens of
            microseconds this measures the Python/C++ call overhead as much as the kernel.
  batched   CUDA events around --reps back-to-back calls, divided by --reps (median of 7
            such batches): the CPU runs ahead of the GPU, as in a training loop, so this is
            the kernel's throughput.
The verdict (">= 0.98x torch on every shape") is checked under both; a shape below 0.98x
under either is flagged and listed. By default ours and torch alternate call by call and batch
by batch, so drift in clocks or power (and the burst of our first call, which autotunes a new
shape) hits both sides alike; --sequential times all of ours, then all of torch's.

    python bench/bench_gemm.py [--json PATH] [--rows 16384] [--reps 30] [--no-autotune]
                               [--sequential]

Prints a table; writes JSON to --json, else $OUT/bench_gemm.json where OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import blutrain.linalg as bl

LAYERS = [
    ("qkv", 768, 2304),
    ("attn_proj", 768, 768),
    ("fc", 768, 3072),
    ("fc_proj", 3072, 768),
    ("lm_head", 768, 50257),
]
MODES = ["fp32", "tf32", "bf16"]


def gemms(rows: int):
    """(name, m, n, k, transa, transb) for fwd, bwd dX, bwd dW of each layer (row-major)."""
    out = []
    for name, cin, cout in LAYERS:
        out.append((f"{name}.fwd", rows, cout, cin, False, True))  # x (rows,in) @ W(out,in)^T
        out.append((f"{name}.dx", rows, cin, cout, False, False))  # dY (rows,out) @ W (out,in)
        out.append((f"{name}.dw", cout, cin, rows, True, False))  # dY^T (out,rows) @ x (rows,in)
    return out


def time_calls(fn, n_sets: int, warmup: int, reps: int) -> tuple[float, float]:
    """(per call, batched) seconds: the median of CUDA events around each call, and the
    median over 3 batches of events around `reps` back-to-back calls, divided by `reps`."""
    for i in range(warmup):
        fn(i % n_sets)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize()
    per_call = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3
    batches = []
    for _ in range(3):
        b0 = torch.cuda.Event(enable_timing=True)
        b1 = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        b0.record()
        for i in range(reps):
            fn(i % n_sets)
        b1.record()
        torch.cuda.synchronize()
        batches.append(b0.elapsed_time(b1) / 1e3 / reps)
    return per_call, statistics.median(batches)


def time_pair(f_ours, f_torch, n_sets: int, warmup: int, reps: int, batches: int = 7):
    """Like time_calls for both sides, interleaved so drift (clocks, power, a preceding
    autotune burst) hits both alike: per call, ours and torch alternate call by call; batched,
    the batches alternate (ours first, then torch first, ...). Returns ((ours per call, ours
    batched), (torch per call, torch batched)) in seconds."""
    for i in range(warmup):
        f_ours(i % n_sets)
        f_torch(i % n_sets)

    def ev():
        return torch.cuda.Event(enable_timing=True)

    so, eo, st, et = ([ev() for _ in range(reps)] for _ in range(4))
    torch.cuda.synchronize()
    for i in range(reps):
        so[i].record()
        f_ours(i % n_sets)
        eo[i].record()
        st[i].record()
        f_torch(i % n_sets)
        et[i].record()
    torch.cuda.synchronize()
    pc_o = statistics.median(a.elapsed_time(b) for a, b in zip(so, eo)) / 1e3
    pc_t = statistics.median(a.elapsed_time(b) for a, b in zip(st, et)) / 1e3
    bo: list[float] = []
    bt: list[float] = []
    for r in range(batches):
        order = ((f_ours, bo), (f_torch, bt)) if r % 2 == 0 else ((f_torch, bt), (f_ours, bo))
        for fn, acc in order:
            b0, b1 = ev(), ev()
            torch.cuda.synchronize()
            b0.record()
            for i in range(reps):
                fn(i % n_sets)
            b1.record()
            torch.cuda.synchronize()
            acc.append(b0.elapsed_time(b1) / 1e3 / reps)
    return (pc_o, statistics.median(bo)), (pc_t, statistics.median(bt))


def timed(ours, theirs, args):
    if not args.sequential:
        return time_pair(ours, theirs, args.rotate, args.warmup, args.reps)
    return (
        time_calls(ours, args.rotate, args.warmup, args.reps),
        time_calls(theirs, args.rotate, args.warmup, args.reps),
    )


def bench_gemm(mode, name, m, n, k, ta, tb, args):
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    our_mode = None if mode == "bf16" else mode
    sets = []
    for _ in range(args.rotate):
        a = torch.randn(*((k, m) if ta else (m, k)), device="cuda", dtype=dt)
        b = torch.randn(*((n, k) if tb else (k, n)), device="cuda", dtype=dt)
        sets.append((a, b))
    out_ours = torch.empty(m, n, device="cuda", dtype=dt)
    out_torch = torch.empty(m, n, device="cuda", dtype=dt)

    def ours(i):
        a, b = sets[i]
        bl.matmul(a, b, transa=ta, transb=tb, out=out_ours, mode=our_mode)

    def theirs(i):
        a, b = sets[i]
        torch.matmul(a.t() if ta else a, b.t() if tb else b, out=out_torch)

    # Same numbers from both (a cheap guard against timing the wrong thing).
    ours(0)
    theirs(0)
    err = ((out_ours.float() - out_torch.float()).norm() / out_torch.float().norm()).item()
    (t_ours, b_ours), (t_torch, b_torch) = timed(ours, theirs, args)
    flop = 2.0 * m * n * k
    torch.cuda.empty_cache()
    return {
        "mode": mode,
        "gemm": name,
        "m": m,
        "n": n,
        "k": k,
        "transa": ta,
        "transb": tb,
        "ours_ms": t_ours * 1e3,
        "torch_ms": t_torch * 1e3,
        "ours_tflops": flop / t_ours / 1e12,
        "torch_tflops": flop / t_torch / 1e12,
        "speedup": t_torch / t_ours,
        "batched_ours_ms": b_ours * 1e3,
        "batched_torch_ms": b_torch * 1e3,
        "batched_ours_tflops": flop / b_ours / 1e12,
        "batched_torch_tflops": flop / b_torch / 1e12,
        "batched_speedup": b_torch / b_ours,
        "rel_diff_vs_torch": err,
    }


def bench_fused(mode, rows, cin, cout, args):
    """linear + bias + GELU: one fused call (saving the pre-activation) vs torch's 3 ops."""
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    our_mode = None if mode == "bf16" else mode
    sets = [
        (
            torch.randn(rows, cin, device="cuda", dtype=dt),
            torch.randn(cout, cin, device="cuda", dtype=dt) * 0.05,
            torch.randn(cout, device="cuda", dtype=dt),
        )
        for _ in range(args.rotate)
    ]
    y = torch.empty(rows, cout, device="cuda", dtype=dt)
    pre = torch.empty(rows, cout, device="cuda", dtype=dt)
    t_pre = torch.empty(rows, cout, device="cuda", dtype=dt)

    def ours(i):
        x, w, b = sets[i]
        bl.matmul(
            x, w, transb=True, bias=b, epilogue="bias_gelu_aux", out=y, aux=pre, mode=our_mode
        )

    def theirs(i):
        x, w, b = sets[i]
        torch.matmul(x, w.t(), out=t_pre)
        t_pre.add_(b)
        return torch.nn.functional.gelu(t_pre, approximate="tanh")

    ours(0)
    ref = theirs(0)
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    (t_ours, b_ours), (t_torch, b_torch) = timed(ours, theirs, args)
    flop = 2.0 * rows * cin * cout
    torch.cuda.empty_cache()
    return {
        "mode": mode,
        "op": f"linear+bias+gelu {cin}->{cout}",
        "rows": rows,
        "fused_ms": t_ours * 1e3,
        "torch_3ops_ms": t_torch * 1e3,
        "fused_tflops": flop / t_ours / 1e12,
        "torch_tflops": flop / t_torch / 1e12,
        "speedup": t_torch / t_ours,
        "batched_fused_ms": b_ours * 1e3,
        "batched_torch_3ops_ms": b_torch * 1e3,
        "batched_speedup": b_torch / b_ours,
        "rel_diff_vs_torch": err,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rotate", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-autotune", action="store_true", help="heuristic choice only")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="time all of ours, then all of torch's, instead of alternating call by call and "
        "batch by batch (the default, so clock and power drift hit both sides alike)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() or not bl.has_cuda():
        print("bench_gemm: needs a CUDA device and a CUDA build of blutrain-linalg")
        return 2
    bl.set_option("autotune", 0 if args.no_autotune else 1)
    modes = args.modes.split(",")

    results, fused = [], []
    path = args.json or (
        os.path.join(os.environ["OUT"], "bench_gemm.json") if os.environ.get("OUT") else None
    )

    def dump(summary=None):  # after every section: a run cut short still leaves its numbers
        if not path:
            return
        doc = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "rows": args.rows,
            "reps": args.reps,
            "autotune": not args.no_autotune,
            "interleave": not args.sequential,
            "gemms": results,
            "fused": fused,
            "summary": summary,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    hdr = (
        f"{'':46}{'per call (events around each call)':>32}  {'batched (N back-to-back)':>27}\n"
        f"{'mode':5} {'gemm':16} {'m':>6} {'n':>6} {'k':>6}  {'ours TF/s':>9} "
        f"{'torch TF/s':>10} {'ratio':>6}  {'ours TF/s':>9} {'torch TF/s':>10} {'ratio':>6}"
        f"  {'diff':>8}"
    )
    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  rows={args.rows}  "
        f"autotune={'off' if args.no_autotune else 'on'}  per call: median of {args.reps} "
        f"calls; batched: median of {3 if args.sequential else 7} batches of {args.reps} calls; "
        f"{'ours, then torch' if args.sequential else 'interleaved'}"
    )
    # linear + bias + GELU first: short, and the second target.
    hdr2 = (
        f"{'mode':5} {'op':28} {'fused ms':>9} {'torch 3 ops ms':>14} {'speedup':>8}  "
        f"{'batched: fused ms':>17} {'torch ms':>9} {'speedup':>8}  {'diff':>8}"
    )
    print(hdr2)
    print("-" * len(hdr2))
    for mode in modes:
        try:
            r = bench_fused(mode, args.rows, 768, 3072, args)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{mode:5} linear+bias+gelu failed: {e}", flush=True)
            continue
        fused.append(r)
        print(
            f"{mode:5} {r['op']:28} {r['fused_ms']:9.3f} {r['torch_3ops_ms']:14.3f} "
            f"{r['speedup']:8.3f}  {r['batched_fused_ms']:17.3f} "
            f"{r['batched_torch_3ops_ms']:9.3f} {r['batched_speedup']:8.3f}  "
            f"{r['rel_diff_vs_torch']:8.1e}",
            flush=True,
        )
        dump()
    print()
    print(hdr)
    print("-" * len(hdr.splitlines()[-1]))
    for mode in modes:
        for name, m, n, k, ta, tb in gemms(args.rows):
            try:
                r = bench_gemm(mode, name, m, n, k, ta, tb, args)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{mode:5} {name:16} failed: {e}", flush=True)
                continue
            results.append(r)
            slow = [
                w
                for w, x in (("per call", r["speedup"]), ("batched", r["batched_speedup"]))
                if x < 0.98
            ]
            flag = f"  < 0.98x ({', '.join(slow)})" if slow else ""
            print(
                f"{mode:5} {name:16} {m:6d} {n:6d} {k:6d}  {r['ours_tflops']:9.1f} "
                f"{r['torch_tflops']:10.1f} {r['speedup']:6.3f}  "
                f"{r['batched_ours_tflops']:9.1f} {r['batched_torch_tflops']:10.1f} "
                f"{r['batched_speedup']:6.3f}  {r['rel_diff_vs_torch']:8.1e}{flag}",
                flush=True,
            )
            dump()

    def stats(key):
        ratios = [r[key] for r in results] or [float("nan")]
        return {
            "min_ratio": min(ratios),
            "geomean_ratio": statistics.geometric_mean(ratios) if results else None,
            "shapes_below_0.98": [f"{r['mode']}:{r['gemm']}" for r in results if r[key] < 0.98],
        }

    per_call, batched = stats("speedup"), stats("batched_speedup")
    summary = {
        "verdict_method": "both: a shape passes when per-call and batched ratios are >= 0.98",
        "per_call": per_call,
        "batched": batched,
        "min_ratio": min(per_call["min_ratio"], batched["min_ratio"]),
        "shapes_below_0.98": sorted(
            set(per_call["shapes_below_0.98"]) | set(batched["shapes_below_0.98"])
        ),
        "fused_min_speedup": min(r["speedup"] for r in fused) if fused else None,
        "fused_min_batched_speedup": min(r["batched_speedup"] for r in fused) if fused else None,
        "fallback_epilogues": bl.get_option("fallback_epilogues"),
    }
    print()
    for label, st in (("per call", per_call), ("batched ", batched)):
        print(
            f"{label}: min ratio {st['min_ratio']:.3f}, geomean {st['geomean_ratio'] or 0:.3f}, "
            f"below 0.98x: {st['shapes_below_0.98'] or 'none'}"
        )
    print(
        f"verdict (both methods): {'PASS' if not summary['shapes_below_0.98'] else 'FAIL'}; "
        f"fused min speedup {summary['fused_min_speedup'] or 0:.3f} per call, "
        f"{summary['fused_min_batched_speedup'] or 0:.3f} batched"
    )
    dump(summary)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
