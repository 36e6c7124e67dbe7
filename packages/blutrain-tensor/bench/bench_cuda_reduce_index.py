"""CUDA reductions and indexing at GPT-2 124M shapes (B=16, T=1024, C=768, V=50257): ours next to
PyTorch's (torch CUDA, same GPU, same run): bias-gradient sums over dim 0 of (B*T, C) and
(B*T, 4C), row sums (last dim), a full sum, the embedding forward (index_select of token rows) and
backward (index_add of (B*T, C) rows into a zero (V, C) weight gradient; ours is deterministic,
torch's uses atomics), in bf16 and fp32.  Median of many reps after warm-up (reps batched between
device synchronisations), achieved GB/s against the memory floor (bytes moved / 4.3 TB/s measured
copy bandwidth).  Prints a table; --json OUT writes the rows.  Not a test."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

BW = 4.3e12  # bytes/s, measured H200 copy bandwidth
B, T, C, V = 16, 1024, 768, 50257
N = B * T


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


def cases(dt: str):
    """name -> (bytes, ours, torch or None)."""
    e = 2 if dt == "bf16" else 4
    bdt = {"bf16": bt.bfloat16, "fp32": bt.float32}[dt]
    res = {}
    ids_np = np.minimum(np.random.default_rng(0).zipf(1.3, size=N) - 1, V - 1)  # text-like repeats

    x768 = bt.randn(N, C, dtype=bdt, device="cuda")
    x3072 = bt.randn(N, 4 * C, dtype=bdt, device="cuda")
    w = bt.randn(V, C, dtype=bdt, device="cuda")
    gw0 = bt.zeros(V, C, dtype=bdt, device="cuda")
    ids = bt.tensor(ids_np, dtype=bt.int64).to("cuda")

    res["bias_grad C"] = [N * C * e + C * e, lambda: x768.sum(0)]
    res["bias_grad 4C"] = [N * 4 * C * e + 4 * C * e, lambda: x3072.sum(0)]
    res["row_sum C"] = [N * C * e + N * e, lambda: x768.sum(1)]
    res["row_max 4C"] = [N * 4 * C * e + N * e, lambda: x3072.amax(1)]
    res["full_sum 4C"] = [N * 4 * C * e, lambda: x3072.sum()]
    res["embed_fwd"] = [2 * N * C * e + N * 8, lambda: bt.index_select(w, 0, ids)]
    # out = copy of the (V, C) base + the (N, C) rows added: the base copy is most of the bytes.
    res["embed_bwd"] = [(2 * V * C + N * C) * e + N * 8, lambda: bt.index_add(gw0, 0, ids, x768)]

    if torch is not None and torch.cuda.is_available():
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        t768 = torch.randn(N, C, dtype=tdt, device="cuda")
        t3072 = torch.randn(N, 4 * C, dtype=tdt, device="cuda")
        tw = torch.randn(V, C, dtype=tdt, device="cuda")
        tgw0 = torch.zeros(V, C, dtype=tdt, device="cuda")
        tids = torch.from_numpy(ids_np).to("cuda")
        res["bias_grad C"].append(lambda: t768.sum(0))
        res["bias_grad 4C"].append(lambda: t3072.sum(0))
        res["row_sum C"].append(lambda: t768.sum(1))
        res["row_max 4C"].append(lambda: t3072.amax(1))
        res["full_sum 4C"].append(lambda: t3072.sum())
        res["embed_fwd"].append(lambda: torch.index_select(tw, 0, tids))
        res["embed_bwd"].append(lambda: tgw0.index_add(0, tids, t768))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--dtypes", default="bf16,fp32")
    args = ap.parse_args()
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    rows = []
    tsync = torch.cuda.synchronize if torch is not None else None
    hdr = f"{'op':14} {'dtype':5} {'floor ms':>9} {'ours ms':>9} {'GB/s':>7} {'%floor':>7} "
    hdr += f"{'torch ms':>9} {'GB/s':>7} {'ours/torch':>10}"
    print(hdr)
    for dt in args.dtypes.split(","):
        for name, v in cases(dt).items():
            nbytes = v[0]
            ours = _time(v[1], _sync_bt, 50)
            theirs = _time(v[2], tsync, 50) if len(v) > 2 else float("nan")
            floor = nbytes / BW * 1e3
            row = {
                "op": name,
                "dtype": dt,
                "bytes": nbytes,
                "floor_ms": floor,
                "ours_ms": ours,
                "ours_gbps": nbytes / ours / 1e6,
                "torch_ms": theirs,
                "torch_gbps": nbytes / theirs / 1e6,
            }
            rows.append(row)
            print(
                f"{name:14} {dt:5} {floor:9.4f} {ours:9.4f} {row['ours_gbps']:7.0f} "
                f"{100 * floor / ours:6.1f}% {theirs:9.4f} {row['torch_gbps']:7.0f} "
                f"{theirs / ours:10.2f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
