"""Fused (flash) attention at GPT-2 124M shapes (B=16, H=12, T=1024, D=64; and D=128 with H=6):
ours (bt.scaled_dot_product_attention on CUDA) next to torch.nn.functional.
scaled_dot_product_attention (whichever fused backend torch picks on this GPU, same run), causal
and not, bf16 and fp32.  Passes: fwd and fwd+bwd take q, k, v as views of a (B, T, 3C) tensor
(GPT-2's split, so fwd+bwd includes assembling that tensor's gradient); fb-leaf is fwd+bwd with
q, k, v leaf tensors (the attention kernels alone).  Flops: 4 B H T^2 D forward (half when
causal), 2.5x that backward; TFLOP/s and the floor (flops / 790 TFLOP/s bf16 dense peak
measured).  Median of batched reps between device synchronisations.  Prints a table; --json OUT
writes the rows; --profile lists each pass's kernels.  Not a test."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import blutrain.tensor as bt

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

PEAK = 790e12  # flop/s, measured bf16 dense mma peak on the H200
B, T = 16, 1024


def _sync_bt() -> None:
    bt._tensor._cuda_synchronize(0)


def _time(fn, sync, reps: int, batches: int = 7) -> float:
    for _ in range(3):
        fn()
    sync()
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out) * 1e3  # ms


def cases(dt: str, H: int, D: int, causal: bool):
    """(ours fwd, ours fwd+bwd, torch fwd, torch fwd+bwd, ours and torch fwd+bwd on q/k/v leaves)
    callables; fwd and fwd+bwd take q, k, v from a (B, T, 3C) tensor as GPT-2 does."""
    C = H * D
    bdt = {"bf16": bt.bfloat16, "fp32": bt.float32}[dt]
    x = bt.randn(B, T, 3 * C, dtype=bdt, device="cuda").requires_grad_(True)
    g = bt.randn(B, H, T, D, dtype=bdt, device="cuda")

    def qkv():
        q, k, v = x.split(C, dim=2)
        return [t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v)]

    def ours_f():
        with bt.no_grad():
            bt.scaled_dot_product_attention(*qkv(), is_causal=causal)

    def ours_fb():
        x.grad = None
        bt.scaled_dot_product_attention(*qkv(), is_causal=causal).backward(g)

    # the attention alone: q, k, v leaves (B, H, T, D), no split / transpose gradients to assemble
    leaves = [bt.randn(B, H, T, D, dtype=bdt, device="cuda").requires_grad_(True) for _ in "qkv"]

    def ours_fb_leaves():
        for t in leaves:
            t.grad = None
        bt.scaled_dot_product_attention(*leaves, is_causal=causal).backward(g)

    res = [ours_f, ours_fb, None, None, ours_fb_leaves, None]
    if torch is not None:
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        tx = torch.randn(B, T, 3 * C, dtype=tdt, device="cuda", requires_grad=True)
        tg = torch.randn(B, H, T, D, dtype=tdt, device="cuda")

        def tqkv():
            return [t.view(B, T, H, D).transpose(1, 2) for t in tx.split(C, dim=2)]

        def torch_f():
            with torch.no_grad():
                F.scaled_dot_product_attention(*tqkv(), is_causal=causal)

        def torch_fb():
            tx.grad = None
            F.scaled_dot_product_attention(*tqkv(), is_causal=causal).backward(tg)

        tleaves = [
            torch.randn(B, H, T, D, dtype=tdt, device="cuda", requires_grad=True) for _ in "qkv"
        ]

        def torch_fb_leaves():
            for t in tleaves:
                t.grad = None
            F.scaled_dot_product_attention(*tleaves, is_causal=causal).backward(tg)

        res[2:4] = [torch_f, torch_fb]
        res[5] = torch_fb_leaves
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print each pass's kernels (device time per call) for bf16 D64 causal",
    )
    args = ap.parse_args()
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    tsync = torch.cuda.synchronize if torch is not None else None
    rows = []
    failed = False
    hdr = f"{'shape':22} {'dtype':5} {'causal':6} {'pass':7} {'floor ms':>9} {'ours ms':>9} "
    hdr += f"{'TFLOP/s':>8} {'torch ms':>9} {'TFLOP/s':>8} {'torch/ours':>10}"
    print(hdr)
    for dt in args.dtypes.split(","):
        for H, D in ((12, 64), (6, 128)):
            for causal in (True, False):
                v = cases(dt, H, D, causal)
                fwd_flops = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
                for k, pas in enumerate(["fwd", "fwd+bwd", "fb-leaf"]):
                    flops = fwd_flops * (1.0 if k == 0 else 3.5)
                    reps = 20 if dt == "bf16" else 3
                    mine, other = (v[k], v[2 + k]) if k < 2 else (v[4], v[5])
                    try:  # one failing case (e.g. a missing kernel) must not hide the others
                        ours = _time(mine, _sync_bt, reps)
                    except Exception as e:  # noqa: BLE001
                        print(f"ERROR {dt} H{H} D{D} causal={causal} {pas}: {e}")
                        failed = True
                        continue
                    theirs = _time(other, tsync, reps) if other else float("nan")
                    row = {
                        "shape": f"B{B} H{H} T{T} D{D}",
                        "dtype": dt,
                        "causal": causal,
                        "pass": pas,
                        "flops": flops,
                        "floor_ms": flops / PEAK * 1e3,
                        "ours_ms": ours,
                        "ours_tflops": flops / ours / 1e9,
                        "torch_ms": theirs,
                        "torch_tflops": flops / theirs / 1e9,
                    }
                    rows.append(row)
                    print(
                        f"{row['shape']:22} {dt:5} {causal!s:6} {pas:7} {row['floor_ms']:9.3f} "
                        f"{ours:9.3f} {row['ours_tflops']:8.1f} {theirs:9.3f} "
                        f"{row['torch_tflops']:8.1f} {theirs / ours:10.2f}"
                    )
    if args.profile and torch is not None:
        from cuda_timing import kernel_profile, print_profile

        v = cases("bf16", 12, 64, True)
        for name, fn in zip(("ours fwd", "ours fwd+bwd", "torch fwd", "torch fwd+bwd",
                             "ours fb-leaf", "torch fb-leaf"), v):
            print_profile(f"bf16 B{B} H12 T{T} D64 causal, {name}", kernel_profile(fn))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
