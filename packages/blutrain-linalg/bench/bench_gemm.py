"""GEMM benchmark: every GEMM of a GPT-2 124M training step, blutrain.linalg vs torch.matmul.

Rows = B*T = 16384. For each linear layer (in -> out) of GPT-2 124M (768->2304 qkv,
768->768 attention projection, 768->3072 fc, 3072->768 fc projection, 768->50257 lm head) it
times the forward GEMM (x @ W^T) and both backward GEMMs (dX = dY @ W, dW = dY^T @ X) in fp32
(true fp32), tf32 and bf16, ours next to torch.matmul in the same process on the same GPU, and
linear + bias + GELU fused (one call, pre-activation saved) against torch's three ops.

Timing: CUDA events around each call, median over --reps calls after --warmup calls, inputs
rotated over --rotate sets so no call finds the previous call's operands in L2. Both sides
write into preallocated outputs (out=), so allocation is not timed on either side.

    python bench/bench_gemm.py [--json PATH] [--rows 16384] [--reps 30] [--no-autotune]

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


def time_calls(fn, n_sets: int, warmup: int, reps: int) -> float:
    """Median seconds per call (CUDA events around each call)."""
    for i in range(warmup):
        fn(i % n_sets)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


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
    t_ours = time_calls(ours, args.rotate, args.warmup, args.reps)
    t_torch = time_calls(theirs, args.rotate, args.warmup, args.reps)
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
    t_ours = time_calls(ours, args.rotate, args.warmup, args.reps)
    t_torch = time_calls(theirs, args.rotate, args.warmup, args.reps)
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
            "gemms": results,
            "fused": fused,
            "summary": summary,
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    hdr = (
        f"{'mode':5} {'gemm':16} {'m':>6} {'n':>6} {'k':>6}  {'ours TF/s':>9} "
        f"{'torch TF/s':>10} {'ratio':>6}  {'diff':>8}"
    )
    print(
        f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  rows={args.rows}  "
        f"autotune={'off' if args.no_autotune else 'on'}  median of {args.reps} calls"
    )
    # linear + bias + GELU first: short, and the second target.
    hdr2 = (
        f"{'mode':5} {'op':28} {'fused ms':>9} {'torch 3 ops ms':>14} {'speedup':>8}  {'diff':>8}"
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
            f"{r['speedup']:8.3f}  {r['rel_diff_vs_torch']:8.1e}",
            flush=True,
        )
        dump()
    print()
    print(hdr)
    print("-" * len(hdr))
    for mode in modes:
        for name, m, n, k, ta, tb in gemms(args.rows):
            try:
                r = bench_gemm(mode, name, m, n, k, ta, tb, args)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{mode:5} {name:16} failed: {e}", flush=True)
                continue
            results.append(r)
            flag = "" if r["speedup"] >= 0.98 else "  < 0.98x"
            print(
                f"{mode:5} {name:16} {m:6d} {n:6d} {k:6d}  {r['ours_tflops']:9.1f} "
                f"{r['torch_tflops']:10.1f} {r['speedup']:6.3f}  {r['rel_diff_vs_torch']:8.1e}"
                f"{flag}",
                flush=True,
            )
            dump()

    ratios = [r["speedup"] for r in results] or [float("nan")]
    summary = {
        "min_ratio": min(ratios),
        "geomean_ratio": statistics.geometric_mean(ratios) if results else None,
        "shapes_below_0.98": [f"{r['mode']}:{r['gemm']}" for r in results if r["speedup"] < 0.98],
        "fused_min_speedup": min(r["speedup"] for r in fused) if fused else None,
        "fallback_epilogues": bl.get_option("fallback_epilogues"),
    }
    print()
    print(
        f"min ratio {summary['min_ratio']:.3f}, geomean {summary['geomean_ratio'] or 0:.3f}, "
        f"below 0.98x: {summary['shapes_below_0.98'] or 'none'}; fused min speedup "
        f"{summary['fused_min_speedup'] or 0:.3f}"
    )
    dump(summary)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
