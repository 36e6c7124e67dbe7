"""CUDA elementwise kernels at GPT-2 124M shapes (B=16, T=1024, C=768; MLP 4C=3072): ours next to
PyTorch's (torch CUDA, same GPU, same run) for add, mul, gelu (tanh), bf16 <-> fp32 casts (all
contiguous) and the heads transpose (B, T, H, D) -> (B, H, T, D) made contiguous, in bf16 and
fp32.  Also a plain device copy of the same bytes through torch in the
same run (the practical ceiling).  Times with CUDA events (reps batched between two events,
median of several batches after warm-up), eager and as one replayed CUDA graph ("graph": device
time, no host launch gaps); GB/s counts bytes read + written, against the floor
bytes / 4.3 TB/s (measured H200 copy bandwidth).  Prints a table; --json OUT writes the rows.
Not a test."""

from __future__ import annotations

import argparse
import json

from cuda_timing import time_events, time_graph

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

BW = 4.3e12  # bytes/s, measured H200 copy bandwidth (read + write)
B, T, C = 16, 1024, 768
TARGET = 0.80  # ours must reach this fraction of the copy floor


BT_DT = {"bf16": "bfloat16", "fp32": "float32"}
SIZE = {"bf16": 2, "fp32": 4}


def cases():
    """(name, dtype label, shape, bytes, ours fn, torch fn or None)."""
    have_torch = torch is not None and torch.cuda.is_available()
    rows = []
    for dt in ("bf16", "fp32"):
        bdt = getattr(bt, BT_DT[dt])
        e = SIZE[dt]
        for shape in ((B, T, C), (B, T, 4 * C)):
            n = shape[0] * shape[1] * shape[2]
            x = bt.randn(*shape, dtype=bdt, device="cuda")
            y = bt.randn(*shape, dtype=bdt, device="cuda")
            tx = ty = None
            if have_torch:
                tdt = getattr(torch, BT_DT[dt])
                tx = torch.randn(*shape, dtype=tdt, device="cuda")
                ty = torch.randn(*shape, dtype=tdt, device="cuda")
            tag = "x".join(map(str, shape))
            rows.append(
                (
                    "add",
                    dt,
                    tag,
                    3 * n * e,
                    lambda x=x, y=y: x + y,
                    (lambda tx=tx, ty=ty: tx + ty) if have_torch else None,
                )
            )
            rows.append(
                (
                    "mul",
                    dt,
                    tag,
                    3 * n * e,
                    lambda x=x, y=y: x * y,
                    (lambda tx=tx, ty=ty: tx * ty) if have_torch else None,
                )
            )
            rows.append(("gelu_tanh", dt, tag, 2 * n * e,
                         lambda x=x: bt.gelu(x, approximate="tanh"),
                         (lambda tx=tx: torch.nn.functional.gelu(tx, approximate="tanh"))
                         if have_torch else None))  # fmt: skip
            # a broadcast add (bias over rows): the strided path
            bias = bt.randn(shape[-1], dtype=bdt, device="cuda")
            tb = torch.randn(shape[-1], dtype=tx.dtype, device="cuda") if have_torch else None
            rows.append(
                (
                    "add_bias_bcast",
                    dt,
                    tag,
                    2 * n * e,
                    lambda x=x, b=bias: x + b,
                    (lambda tx=tx, tb=tb: tx + tb) if have_torch else None,
                )
            )
    # heads <-> sequence: (B, T, H, D) viewed as (B, H, T, D) made contiguous (copy_rows_v4), as
    # a (B, H, T, D) attention gradient becomes a leaf's
    for dt in ("bf16", "fp32"):
        H, D = 12, 64
        x = bt.randn(B, T, H, D, dtype=getattr(bt, BT_DT[dt]), device="cuda")
        tx = (torch.randn(B, T, H, D, dtype=getattr(torch, BT_DT[dt]), device="cuda")
              if have_torch else None)  # fmt: skip
        theirs = (lambda tx=tx: tx.transpose(1, 2).contiguous()) if have_torch else None
        rows.append(("heads_transpose", dt, f"{B}x{T}x{H}x{D}", 2 * B * T * C * SIZE[dt],
                     lambda x=x: x.transpose(1, 2).contiguous(), theirs))  # fmt: skip
    for src, dst in (("bf16", "fp32"), ("fp32", "bf16")):
        for shape in ((B, T, C), (B, T, 4 * C)):
            n = shape[0] * shape[1] * shape[2]
            x = bt.randn(*shape, dtype=getattr(bt, BT_DT[src]), device="cuda")
            ddt = getattr(bt, BT_DT[dst])
            tx = None
            if have_torch:
                tx = torch.randn(*shape, dtype=getattr(torch, BT_DT[src]), device="cuda")
                tdd = getattr(torch, BT_DT[dst])
            rows.append((f"cast->{dst}", src, "x".join(map(str, shape)),
                         n * (SIZE[src] + SIZE[dst]), lambda x=x, d=ddt: x.to(d),
                         (lambda tx=tx, d=tdd: tx.to(d)) if have_torch else None))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    args = ap.parse_args()
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    have_torch = torch is not None and torch.cuda.is_available()
    hdr = (f"{'op':15} {'dtype':5} {'shape':13} {'MB':>7} {'floor ms':>9} {'ours ms':>9} "
           f"{'GB/s':>6} {'%floor':>7} {'graph ms':>9} {'%floor':>7} {'torch ms':>9} {'GB/s':>6} "
           f"{'copy GB/s':>9} {'ours/torch':>10}")  # fmt: skip
    print(hdr)
    rows = []
    copy_cache: dict[int, float] = {}
    for name, dt, shape, nbytes, ours_fn, torch_fn in cases():
        ours = time_events(ours_fn, args.reps)
        graph = float("nan") if args.no_graph else time_graph(ours_fn, args.reps)
        theirs = (
            time_events(torch_fn, args.reps, torch_events=True)
            if torch_fn is not None
            else float("nan")
        )
        if have_torch and nbytes not in copy_cache:
            # torch device-to-device copy moving the same bytes (half read, half written)
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_cache[nbytes] = time_events(
                lambda s=src, d=dst: d.copy_(s), args.reps, torch_events=True
            )
            del src, dst
        cp = copy_cache.get(nbytes, float("nan"))
        floor = nbytes / BW * 1e3
        row = {
            "op": name,
            "dtype": dt,
            "shape": shape,
            "bytes": nbytes,
            "floor_ms": floor,
            "ours_ms": ours,
            "ours_gbps": nbytes / ours / 1e6,
            "pct_floor": 100 * floor / ours,
            "graph_ms": graph,
            "pct_floor_graph": 100 * floor / graph,
            "torch_ms": theirs,
            "torch_gbps": nbytes / theirs / 1e6,
            "copy_ms": cp,
            "copy_gbps": nbytes / cp / 1e6,
            "meets_target": floor / ours >= TARGET,
            "meets_target_graph": floor / graph >= TARGET,
        }
        rows.append(row)
        print(
            f"{name:15} {dt:5} {shape:13} {nbytes / 1e6:7.1f} {floor:9.4f} {ours:9.4f} "
            f"{row['ours_gbps']:6.0f} {row['pct_floor']:6.1f}% {graph:9.4f} "
            f"{row['pct_floor_graph']:6.1f}% {theirs:9.4f} "
            f"{row['torch_gbps']:6.0f} {row['copy_gbps']:9.0f} {theirs / ours:10.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "cuda_elementwise", "copy_floor_Bps": BW, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
