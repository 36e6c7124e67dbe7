"""CPU op timings, blutrain.tensor next to PyTorch (same run, same thread count). Not a test.

    python bench_ops.py [--threads 1,2] [--rounds 7] [--reps 5] [--shape 2048x1024] [--json OUT]

Each library runs in its own persistent worker process (one per thread count, started with
OMP_NUM_THREADS=N; blutrain's budget and torch.set_num_threads are N as well), so neither
library's thread pool disturbs the other's: in one process, torch's OpenMP team and ours fought
over the cores and the 2-thread column meant nothing. Both workers build the same inputs from the
same seed. Each op's forward, and its backward where it has one (the gradient into a leaf whose
.grad is None, so no accumulation kernel runs), is timed in rounds: --reps calls in our worker
(after 50 ms of untimed warm-up calls: a worker idle through the other's turn wakes slowly), a
pause, --reps calls in torch's, a pause (an idle OpenMP team spins for a while after its last
op, and our pool for 50 us), the order alternating between rounds. A row shows each library's
median call over all rounds and torch's / ours (> 1: ours is faster), the median of the
per-round ratios, so a machine whose speed drifts charges both alike. numpy's time (in our
worker) is shown where it has the op. The load average before and after each thread count is
printed: on a shared machine, read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def cases(R: int, C: int, bt, torch) -> list[tuple[str, object, object, object]]:
    """(name, ours, torch, numpy) callables; a backward case's callables time only backward.
    bt / torch: the modules, or None in the worker that does not time that library (its
    callables are then None). The inputs come from a fixed seed: the same in every worker."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((R, C)).astype(np.float32)
    b = rng.standard_normal((R, C)).astype(np.float32)
    w = (rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32)
    lw = rng.standard_normal(C).astype(np.float32)
    lb = rng.standard_normal(C).astype(np.float32)
    g = rng.standard_normal((R, C)).astype(np.float32)
    tgt = rng.integers(0, C, R)
    B, T = bt, torch
    if B is not None:
        ba, bb, bw, blw, blb, bg, btg = (bt.tensor(x) for x in (a, b, w, lw, lb, g, tgt))
    if T is not None:
        import torch.nn.functional as F

        ta, tb, tw, tlw, tlb, tg, ttg = (torch.from_numpy(x) for x in (a, b, w, lw, lb, g, tgt))
    N = np if B is not None else None  # numpy is timed in our worker
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
            (
                name + " bwd",
                runner(make_ours) if make_ours else None,
                runner(make_theirs) if make_theirs else None,
                None,
            )
        )

    def mk_bt(op, *arrays, grad=None if B is None else bg):
        leaves = [bt.tensor(x, requires_grad=True) for x in arrays]
        return leaves, op(*leaves), grad

    def mk_t(op, *arrays, grad=None if T is None else tg):
        leaves = [torch.tensor(x, requires_grad=True) for x in arrays]
        return leaves, op(*leaves), grad

    def both(op_bt, op_t, *arrays, scalar=False):
        extra = {"grad": None} if scalar else {}
        return B and (lambda: mk_bt(op_bt, *arrays, **extra)), T and (
            lambda: mk_t(op_t, *arrays, **extra)
        )

    fwd("add", B and (lambda: ba + bb), T and (lambda: ta + tb), N and (lambda: a + b))
    fwd(
        "add row (broadcast)",
        B and (lambda: ba + bb[0]),
        T and (lambda: ta + tb[0]),
        N and (lambda: a + b[0]),
    )
    fwd(
        "mul transposed",
        B and (lambda: ba.T * bb.T),
        T and (lambda: ta.T * tb.T),
        N and (lambda: a.T * b.T),
    )
    fwd("exp", B and (lambda: ba.exp()), T and (lambda: ta.exp()), N and (lambda: np.exp(a)))
    fwd(
        "gelu tanh",
        B and (lambda: bt.gelu(ba, "tanh")),
        T and (lambda: F.gelu(ta, approximate="tanh")),
    )
    bwd(
        "gelu tanh",
        *both(lambda x: bt.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"), a),
    )
    fwd(
        "sum(-1)", B and (lambda: ba.sum(-1)), T and (lambda: ta.sum(-1)), N and (lambda: a.sum(-1))
    )
    fwd("sum(0)", B and (lambda: ba.sum(0)), T and (lambda: ta.sum(0)), N and (lambda: a.sum(0)))
    fwd(
        "amax(-1)",
        B and (lambda: ba.amax(-1)),
        T and (lambda: ta.amax(-1)),
        N and (lambda: a.max(-1)),
    )
    fwd("softmax(-1)", B and (lambda: bt.softmax(ba, -1)), T and (lambda: ta.softmax(-1)))
    bwd("softmax(-1)", *both(lambda x: bt.softmax(x, -1), lambda x: x.softmax(-1), a))
    fwd(
        "log_softmax(-1)",
        B and (lambda: bt.log_softmax(ba, -1)),
        T and (lambda: ta.log_softmax(-1)),
    )
    bwd("log_softmax(-1)", *both(lambda x: bt.log_softmax(x, -1), lambda x: x.log_softmax(-1), a))
    fwd(
        "layer_norm (w, b)",
        B and (lambda: bt.layer_norm(ba, (C,), blw, blb)),
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
        "cross_entropy",
        B and (lambda: bt.cross_entropy(ba, btg)),
        T and (lambda: F.cross_entropy(ta, ttg)),
    )
    bwd(
        "cross_entropy",
        *both(
            lambda x: bt.cross_entropy(x, btg), lambda x: F.cross_entropy(x, ttg), a, scalar=True
        ),
    )
    fwd(
        f"matmul {R}x{C}x{C}",
        B and (lambda: ba @ bw),
        T and (lambda: ta @ tw),
        N and (lambda: a @ w),
    )
    return out


WARM_S = 0.05  # seconds of untimed calls before each library's timed calls in a round


def time_calls(fn, reps: int) -> list[float]:
    """reps timed calls, after WARM_S of untimed ones: a worker idle during the other library's
    turn wakes slowly (on our 2-vCPU VMs the first 2-thread calls after a 20-300 ms pause took
    2-4x the steady time, ours and torch's alike), so each round times both at steady state."""
    prepare, call = fn if isinstance(fn, tuple) else (None, fn)  # (prepare, call): backward
    end = time.perf_counter() + WARM_S
    while time.perf_counter() < end:
        if prepare is not None:
            prepare()
        call()
    ts = []
    for _ in range(reps):
        if prepare is not None:
            prepare()
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return ts


# -- workers: one persistent process per library and thread count --------------------------------
def worker(a: argparse.Namespace) -> int:
    """Builds the cases for one library (--worker ours: ours and numpy; torch: torch) and times
    them on request: stdin 'run INDEX KIND REPS' (KIND o, t or n) -> 'RESULT [seconds, ...]'."""
    R, C = (int(x) for x in a.shape.lower().split("x"))
    if a.worker == "ours":
        import blutrain.tensor as bt

        bt.set_num_threads(a.threads)
        table, got = cases(R, C, bt, None), bt.get_num_threads()
    else:
        import torch

        torch.set_num_threads(a.threads)
        table, got = cases(R, C, None, torch), torch.get_num_threads()
    fns = {"o": [c[1] for c in table], "t": [c[2] for c in table], "n": [c[3] for c in table]}
    print("READY " + json.dumps({"names": [c[0] for c in table], "threads": got}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "run":
            break
        i, kind, reps = int(parts[1]), parts[2], int(parts[3])
        fn = fns[kind][i]
        ts = time_calls(fn, reps) if fn is not None else []
        print("RESULT " + json.dumps(ts), flush=True)
    return 0


class Worker:
    def __init__(self, framework: str, a: argparse.Namespace, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework]
        cmd += ["--threads", str(threads), "--shape", a.shape]
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        line = self.p.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"[bench_ops] the {framework} worker exited before it was ready")
        info = json.loads(line[6:])
        self.names, self.threads = info["names"], info["threads"]

    def run(self, i: int, kind: str, reps: int) -> list[float]:
        self.p.stdin.write(f"run {i} {kind} {reps}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line.startswith("RESULT "):
            raise SystemExit("[bench_ops] a worker exited mid-run")
        return json.loads(line[7:])

    def stop(self) -> None:
        try:
            self.p.stdin.write("stop\n")
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait()


def have_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def bench_threads(a: argparse.Namespace, n: int, keys: list[str]) -> list[dict]:
    R, C = (int(x) for x in a.shape.lower().split("x"))
    ours = Worker("ours", a, n)
    theirs = Worker("torch", a, n) if have_torch() else None
    load0 = os.getloadavg()
    rows = []
    try:
        print(
            f"\n{R}x{C} float32, {n} thread{'s' * (n > 1)} (ours {ours.threads}, torch "
            f"{theirs.threads if theirs else '-'}; each library in its own process)"
        )
        print(f"{'op':28s} {'ours ms':>9s} {'torch ms':>9s} {'numpy ms':>9s} {'torch/ours':>10s}")
        for i, name in enumerate(ours.names):
            if keys and not any(k in name for k in keys):
                continue
            # warm-up (caches, allocators, first-call setup); a None callable gives []
            has_t = theirs is not None and bool(theirs.run(i, "t", 1))
            ours.run(i, "o", 1)
            has_n = bool(ours.run(i, "n", 1))
            o_all, t_all, n_all, ratios = [], [], [], []
            for r in range(a.rounds):
                turns = [("o", ours), ("t", theirs)] if has_t else [("o", ours)]
                med = {}
                for kind, wk in turns if r % 2 == 0 else turns[::-1]:
                    time.sleep(a.pause)
                    ts = wk.run(i, kind, a.reps)
                    (o_all if kind == "o" else t_all).extend(ts)
                    med[kind] = statistics.median(ts)
                if has_t:
                    ratios.append(med["t"] / med["o"])
            if has_n:
                time.sleep(a.pause)
                n_all = ours.run(i, "n", a.reps * 2)
            row = {
                "op": name,
                "threads": n,
                "shape": [R, C],
                "ours_ms": 1e3 * statistics.median(o_all),
                "torch_ms": 1e3 * statistics.median(t_all) if t_all else None,
                "numpy_ms": 1e3 * statistics.median(n_all) if n_all else None,
                "torch_over_ours": statistics.median(ratios) if ratios else None,
                "torch_over_ours_rounds": [round(x, 3) for x in ratios],
            }
            rows.append(row)

            def fmt(v, w=9, p=3):
                return f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"

            print(
                f"{name:28s} {fmt(row['ours_ms'])} {fmt(row['torch_ms'])} "
                f"{fmt(row['numpy_ms'])} {fmt(row['torch_over_ours'], 9, 2)}x",
                flush=True,
            )
    finally:
        ours.stop()
        if theirs is not None:
            theirs.stop()
    load1 = os.getloadavg()
    print(f"load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} after")
    for row in rows:
        row["loadavg_before"], row["loadavg_after"] = load0, load1
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="calls per library per round")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds between libraries")
    ap.add_argument("--shape", default="2048x1024", help="rows x columns of the operands")
    ap.add_argument("--ops", default="", help="only ops whose name contains one of these (a,b)")
    ap.add_argument("--out", "--json", dest="out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        return worker(args)
    keys = [k.strip() for k in args.ops.split(",") if k.strip()]
    rows = []
    for n in (int(x) for x in args.threads.split(",")):
        rows += bench_threads(args, n, keys)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
