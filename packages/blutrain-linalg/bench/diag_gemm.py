"""Why a GEMM shape is slower than torch.matmul: host overhead, the autotune field, the kernels.

For the host: wall time per call of a tiny GEMM (the GPU keeps up, so this is the call's
host cost) for torch.matmul, blutrain's matmul (repeat signature: the plan path; and the
general path) and the raw C entry. For each shape: the autotune log (every cuBLASLt
candidate's configuration and cold-L2 time, stderr), then a profile of a few calls of ours and
of torch.matmul: kernel names and mean device time per kernel.

    python bench/diag_gemm.py [--shapes tf32:attn_proj.fwd,bf16:attn_proj.dw] [--rows 16384]
                              [--ab default,ws8MiB,no_alloc,heuristic] [--ab-only]

With --ab, each shape is also timed against torch.matmul interleaved (bench_gemm.time_pair)
under each named configuration (CONFIGS): which option moves the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import blutrain.linalg as bl
from blutrain.linalg import _linalg

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_gemm import gemms, time_pair  # noqa: E402

DEFAULT = (
    "tf32:attn_proj.fwd,tf32:fc.dw,tf32:fc_proj.dw,bf16:attn_proj.fwd,bf16:attn_proj.dx,"
    "bf16:attn_proj.dw,bf16:fc.fwd"
)


def host_costs() -> None:
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    out = torch.empty(64, 64, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    g = _linalg.GemmPlan(
        64, 64, 64, 1, 0, 1, (0, 64, 0, bl.F32), (0, 64, 0, bl.F32), None,
        (0, 64, 0, bl.F32), 1.0, 0.0, 2, 0, None, None, None, 0,
    )  # fmt: skip
    s = torch.cuda.current_stream().cuda_stream
    cases = {
        "torch.matmul(a, b.t(), out=)": lambda: torch.matmul(a, b.t(), out=out),
        "bl.matmul (plan path)": lambda: bl.matmul(a, b, transb=True, out=out, mode="tf32"),
        "bl._matmul_slow (general path)": lambda: bl._matmul_slow(
            a, b, transb=True, out=out, mode="tf32"
        ),
        "GemmPlan.run (C entry only)": lambda: g.run(
            a.data_ptr(), b.data_ptr(), 0, out.data_ptr(), 0, 0, 0, s
        ),
        "bl.matmul, out=None (allocates)": lambda: bl.matmul(a, b, transb=True, mode="tf32"),
    }
    print("host cost per call (64x64x64 tf32; wall time / calls, GPU keeps up):")
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / 2000)
        print(f"  {name:36} {best * 1e6:7.2f} us")
    print(flush=True)


def kernels(fn, n: int = 5) -> list[tuple[str, int, float]]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append((ev.key, ev.count, t / max(ev.count, 1)))
    return sorted(rows, key=lambda r: -r[1] * r[2])


def diag_shape(mode: str, name: str, m: int, n: int, k: int, ta: bool, tb: bool) -> None:
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    a = torch.randn(*((k, m) if ta else (m, k)), device="cuda", dtype=dt)
    b = torch.randn(*((n, k) if tb else (k, n)), device="cuda", dtype=dt)
    o1 = torch.empty(m, n, device="cuda", dtype=dt)
    o2 = torch.empty(m, n, device="cuda", dtype=dt)
    our_mode = None if mode == "bf16" else mode
    print(f"==== {mode} {name} m={m} n={n} k={k} ta={ta} tb={tb}", flush=True)
    bl.matmul(a, b, transa=ta, transb=tb, out=o1, mode=our_mode)  # autotunes (log: stderr)
    torch.cuda.synchronize()
    sys.stderr.flush()

    def ours():
        bl.matmul(a, b, transa=ta, transb=tb, out=o1, mode=our_mode)

    def theirs():
        torch.matmul(a.t() if ta else a, b.t() if tb else b, out=o2)

    for label, fn in (("ours", ours), ("torch", theirs)):
        for key, count, us in kernels(fn):
            print(f"  {label:5} {count:3d}x {us:9.2f} us  {key[:150]}")
    err = ((o1.float() - o2.float()).norm() / o2.float().norm()).item()
    print(f"  rel diff ours vs torch {err:.1e}", flush=True)


# A/B configurations: options set for the run; each configuration starts from an empty cache.
CONFIGS = {
    "default": {},
    "ws8MiB": {"workspace_bytes": 8 << 20},
    # cuBLAS's pre-Hopper default (CUBLAS_WORKSPACE_CONFIG :4096:2:16:8), in case torch's
    # handle runs with it here.
    "ws8.125MiB": {"workspace_bytes": 4096 * 1024 * 2 + 16 * 1024 * 8},
    "ws0": {"workspace_bytes": 0},
    "no_alloc": {"use_alloc": 0},
    "heuristic": {"autotune": 0},
    "noflush": {"autotune_flush_l2": 0},
}


def ab_shape(mode, name, m, n, k, ta, tb, configs, reps) -> None:
    """Ours vs torch.matmul, interleaved (bench_gemm.time_pair), under each configuration."""
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    sets = [
        (
            torch.randn(*((k, m) if ta else (m, k)), device="cuda", dtype=dt),
            torch.randn(*((n, k) if tb else (k, n)), device="cuda", dtype=dt),
        )
        for _ in range(3)
    ]
    o1 = torch.empty(m, n, device="cuda", dtype=dt)
    o2 = torch.empty(m, n, device="cuda", dtype=dt)
    our_mode = None if mode == "bf16" else mode

    def ours(i):
        a, b = sets[i]
        bl.matmul(a, b, transa=ta, transb=tb, out=o1, mode=our_mode)

    def theirs(i):
        a, b = sets[i]
        torch.matmul(a.t() if ta else a, b.t() if tb else b, out=o2)

    print(f"==== A/B {mode} {name} m={m} n={n} k={k} (interleaved; us per call)", flush=True)
    for cfg in configs:
        opts = CONFIGS[cfg]
        saved = {key: bl.get_option(key) for key in opts}
        try:
            for key, v in opts.items():
                bl.set_option(key, v)
            bl.clear_cache()  # the cache is private and unsaved (main): every config tunes anew
            ours(0)  # tunes (unless autotune is off)
            torch.cuda.synchronize()
            (pc_o, b_o), (pc_t, b_t) = time_pair(ours, theirs, 3, 5, reps)
            print(
                f"  {cfg:10} per call ours {pc_o * 1e6:8.1f} torch {pc_t * 1e6:8.1f} "
                f"ratio {pc_t / pc_o:6.3f} | batched ours {b_o * 1e6:8.1f} torch "
                f"{b_t * 1e6:8.1f} ratio {b_t / b_o:6.3f}",
                flush=True,
            )
        finally:
            for key, v in saved.items():
                bl.set_option(key, v)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=DEFAULT)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--candidates", type=int, default=64)
    p.add_argument(
        "--ab",
        default="",
        help=f"after the profiles, time ours vs torch interleaved under these configurations "
        f"(comma-separated: {','.join(CONFIGS)})",
    )
    p.add_argument("--ab-only", action="store_true", help="skip the host costs and profiles")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    table = {name: (m, n, k, ta, tb) for name, m, n, k, ta, tb in gemms(args.rows)}
    # A private, unsaved cache: what this script sees is its own tuning, not a file that an
    # earlier benchmark left (whose entries would be reused without a log).
    bl.set_cache_path(os.path.join(tempfile.mkdtemp(prefix="bt_diag_"), "algos.txt"))
    bl.set_option("persist", 0)
    if args.ab_only:
        bl.set_option("autotune", 1)
        bl.set_option("persist", 0)
        for spec in args.shapes.split(","):
            mode, name = spec.split(":")
            ab_shape(mode, name, *table[name], args.ab.split(","), args.reps)
        return 0
    host_costs()
    bl.set_option("autotune", 1)
    bl.set_option("autotune_log", 1)
    bl.set_option("autotune_candidates", args.candidates)
    bl.set_option("persist", 0)
    for spec in args.shapes.split(","):
        mode, name = spec.split(":")
        diag_shape(mode, name, *table[name])
    if args.ab:
        bl.set_option("autotune_log", 0)
        for spec in args.shapes.split(","):
            mode, name = spec.split(":")
            ab_shape(mode, name, *table[name], args.ab.split(","), args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
