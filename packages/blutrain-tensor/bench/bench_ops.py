"""CPU op timings, blutrain.tensor next to PyTorch (same run, same thread count). Not a test.

    python bench_ops.py [--threads 1,2] [--rounds 7] [--reps 5] [--shape 2048x1024] [--json OUT]

Each op's forward, and its backward where it has one (the gradient into a leaf whose .grad is
None, so no accumulation kernel runs), is timed in rounds: --reps calls of ours, a pause, --reps
calls of torch's, a pause (an idle torch OpenMP team spins for a while after its last op, and our
pool for 50 us), the order alternating between rounds. A row shows each library's median call
over all rounds and torch's / ours (> 1: ours is faster), the median of the per-round ratios, so
a machine whose speed drifts charges both alike. Both libraries get the same thread count
(bt.set_num_threads, torch.set_num_threads). numpy's time is shown where it has the op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import blutrain.tensor as bt

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None


def cases(R: int, C: int, rng: np.random.Generator) -> list[tuple[str, object, object, object]]:
    """(name, ours, torch, numpy) callables; a backward case's callables time only backward."""
    a = rng.standard_normal((R, C)).astype(np.float32)
    b = rng.standard_normal((R, C)).astype(np.float32)
    w = (rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32)
    lw = rng.standard_normal(C).astype(np.float32)
    lb = rng.standard_normal(C).astype(np.float32)
    g = rng.standard_normal((R, C)).astype(np.float32)
    tgt = rng.integers(0, C, R)
    ba, bb, bw, blw, blb, bg, btg = (bt.tensor(x) for x in (a, b, w, lw, lb, g, tgt))
    out = []

    def fwd(name, ours, theirs, numpy_fn=None):
        out.append((name, ours, theirs, numpy_fn))

    def bwd(name, make_ours, make_theirs):
        # make_*() -> (leaves, output, grad); the call times output.backward(grad) only
        def runner(make):
            state = {}

            def prepare():
                state["leaves"], state["y"], state["g"] = make()

            def call():
                state["y"].backward(state["g"])

            return prepare, call

        out.append(
            (name + " bwd", runner(make_ours), runner(make_theirs) if make_theirs else None, None)
        )

    T = torch
    if T is not None:
        ta, tb, tw, tlw, tlb, tg, ttg = (torch.from_numpy(x) for x in (a, b, w, lw, lb, g, tgt))

    def mk_bt(op, *arrays, grad=bg):
        leaves = [bt.tensor(x, requires_grad=True) for x in arrays]
        return leaves, op(*leaves), grad

    def mk_t(op, *arrays, grad=None if T is None else tg):
        leaves = [torch.tensor(x, requires_grad=True) for x in arrays]
        return leaves, op(*leaves), grad

    def both(op_bt, op_t, *arrays, scalar=False):
        extra = {"grad": None} if scalar else {}
        return (lambda: mk_bt(op_bt, *arrays, **extra)), T and (
            lambda: mk_t(op_t, *arrays, **extra)
        )

    fwd("add", lambda: ba + bb, T and (lambda: ta + tb), lambda: a + b)
    fwd("add row (broadcast)", lambda: ba + bb[0], T and (lambda: ta + tb[0]), lambda: a + b[0])
    fwd("mul transposed", lambda: ba.T * bb.T, T and (lambda: ta.T * tb.T), lambda: a.T * b.T)
    fwd("exp", lambda: ba.exp(), T and (lambda: ta.exp()), lambda: np.exp(a))
    fwd("gelu tanh", lambda: bt.gelu(ba, "tanh"), T and (lambda: F.gelu(ta, approximate="tanh")))
    bwd(
        "gelu tanh", *both(lambda x: bt.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"), a)
    )
    fwd("sum(-1)", lambda: ba.sum(-1), T and (lambda: ta.sum(-1)), lambda: a.sum(-1))
    fwd("sum(0)", lambda: ba.sum(0), T and (lambda: ta.sum(0)), lambda: a.sum(0))
    fwd("softmax(-1)", lambda: bt.softmax(ba, -1), T and (lambda: ta.softmax(-1)))
    bwd("softmax(-1)", *both(lambda x: bt.softmax(x, -1), lambda x: x.softmax(-1), a))
    fwd("log_softmax(-1)", lambda: bt.log_softmax(ba, -1), T and (lambda: ta.log_softmax(-1)))
    bwd("log_softmax(-1)", *both(lambda x: bt.log_softmax(x, -1), lambda x: x.log_softmax(-1), a))
    fwd(
        "layer_norm (w, b)",
        lambda: bt.layer_norm(ba, (C,), blw, blb),
        T and (lambda: F.layer_norm(ta, (C,), tlw, tlb)),
    )
    bwd(
        "layer_norm (w, b)",
        *both(
            lambda x, w_, b_: bt.layer_norm(x, (C,), w_, b_),
            lambda x, w_, b_: F.layer_norm(x, (C,), w_, b_),
            a,
            lw,
            lb,
        ),
    )
    fwd(
        "cross_entropy", lambda: bt.cross_entropy(ba, btg), T and (lambda: F.cross_entropy(ta, ttg))
    )
    bwd(
        "cross_entropy",
        *both(
            lambda x: bt.cross_entropy(x, btg), lambda x: F.cross_entropy(x, ttg), a, scalar=True
        ),
    )
    fwd(f"matmul {R}x{C}x{C}", lambda: ba @ bw, T and (lambda: ta @ tw), lambda: a @ w)
    return out


def time_calls(fn, reps: int) -> list[float]:
    if isinstance(fn, tuple):  # (prepare, call): backward
        prepare, call = fn
        ts = []
        for _ in range(reps):
            prepare()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        return ts
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="calls per library per round")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds between libraries")
    ap.add_argument("--shape", default="2048x1024", help="rows x columns of the operands")
    ap.add_argument("--ops", default="", help="only ops whose name contains one of these (a,b)")
    ap.add_argument("--out", "--json", dest="out", default=None)
    args = ap.parse_args()
    R, C = (int(x) for x in args.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    all_cases = cases(R, C, rng)
    if args.ops:
        keys = [k.strip() for k in args.ops.split(",") if k.strip()]
        all_cases = [c for c in all_cases if any(k in c[0] for k in keys)]
    rows = []
    for n in (int(x) for x in args.threads.split(",")):
        bt.set_num_threads(n)
        if torch is not None:
            torch.set_num_threads(n)
        print(f"\n{R}x{C} float32, {n} thread{'s' * (n > 1)}")
        print(f"{'op':28s} {'ours ms':>9s} {'torch ms':>9s} {'numpy ms':>9s} {'torch/ours':>10s}")
        for name, ours, theirs, np_fn in all_cases:
            for f in (ours, theirs, np_fn):  # warm-up (caches, allocators, first-call setup)
                if f is not None:
                    time_calls(f, 1)
            o_all, t_all, n_all, ratios = [], [], [], []
            for r in range(args.rounds):
                pair = [("o", ours), ("t", theirs)]
                for tag, f in pair if r % 2 == 0 else pair[::-1]:
                    if f is None:
                        continue
                    time.sleep(args.pause)
                    ts = time_calls(f, args.reps)
                    (o_all if tag == "o" else t_all).extend(ts)
                    if tag == "o":
                        o_med = statistics.median(ts)
                    else:
                        t_med = statistics.median(ts)
                if theirs is not None:
                    ratios.append(t_med / o_med)
            if np_fn is not None:
                time.sleep(args.pause)
                n_all = time_calls(np_fn, args.reps * 2)
            row = {
                "op": name,
                "threads": n,
                "shape": [R, C],
                "ours_ms": 1e3 * statistics.median(o_all),
                "torch_ms": 1e3 * statistics.median(t_all) if t_all else None,
                "numpy_ms": 1e3 * statistics.median(n_all) if n_all else None,
                "torch_over_ours": statistics.median(ratios) if ratios else None,
            }
            rows.append(row)

            def fmt(v, w=9, p=3):
                return f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"

            print(
                f"{name:28s} {fmt(row['ours_ms'])} {fmt(row['torch_ms'])} "
                f"{fmt(row['numpy_ms'])} {fmt(row['torch_over_ours'], 9, 2)}x",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
