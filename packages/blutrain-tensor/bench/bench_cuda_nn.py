"""CUDA norm / loss kernels at GPT-2 124M shapes (B=16, T=1024, C=768, H=12, V=50257): ours next
to PyTorch's (torch CUDA, same GPU, same run) for layer_norm, residual add + layer_norm, softmax
(attention scores) and cross_entropy (the classifier), forward and forward + backward, in bf16 and
fp32.  Median of many reps after warm-up (reps batched between device synchronisations), achieved
GB/s against the memory floor (bytes moved / 4.3 TB/s measured copy bandwidth).  Prints a table;
--json OUT writes the rows.  Not a test."""

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

BW = 4.3e12  # bytes/s, measured H200 copy bandwidth
B, T, C, H, V = 16, 1024, 768, 12, 50257


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


def _bt_dtype(name):
    return {"bf16": bt.bfloat16, "fp32": bt.float32}[name]


def _torch_dtype(name):
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def cases(dt: str):
    """name -> (bytes fwd, bytes fwd+bwd, ours fwd, ours fwd+bwd, torch fwd, torch fwd+bwd)."""
    e = 2 if dt == "bf16" else 4
    R = B * T
    bdt = _bt_dtype(dt)
    res = {}

    # layer norm (R, C)
    x = bt.randn(R, C, dtype=bdt, device="cuda").requires_grad_(True)
    w = bt.randn(C, dtype=bdt, device="cuda").requires_grad_(True)
    b = bt.randn(C, dtype=bdt, device="cuda").requires_grad_(True)
    g = bt.randn(R, C, dtype=bdt, device="cuda")
    r = bt.randn(R, C, dtype=bdt, device="cuda").requires_grad_(True)

    def ln_f():
        with bt.no_grad():
            bt.layer_norm(x, C, w, b)

    def ln_fb():
        x.grad = w.grad = b.grad = None
        bt.layer_norm(x, C, w, b).backward(g)

    def aln_f():
        with bt.no_grad():
            bt.add_layer_norm(x, r, w, b)

    def aln_fb():
        x.grad = r.grad = w.grad = b.grad = None
        _, y = bt.add_layer_norm(x, r, w, b)
        y.backward(g)  # the residual stream's own gradient is the same tensor

    # softmax over attention scores (B*H*T, T)
    S = bt.randn(B * H * T, T, dtype=bdt, device="cuda").requires_grad_(True)
    gS = bt.randn(B * H * T, T, dtype=bdt, device="cuda")

    def sm_f():
        with bt.no_grad():
            bt.softmax(S, -1)

    def sm_fb():
        S.grad = None
        bt.softmax(S, -1).backward(gS)

    # cross-entropy (R, V)
    L = bt.randn(R, V, dtype=bdt, device="cuda").requires_grad_(True)
    tg = bt.randint(0, V, R, device="cuda")

    def ce_f():
        with bt.no_grad():
            bt.cross_entropy(L, tg)

    def ce_fb():
        L.grad = None
        bt.cross_entropy(L, tg).backward()

    res["layer_norm"] = [2 * R * C * e, 5 * R * C * e, ln_f, ln_fb]
    res["add_layer_norm"] = [4 * R * C * e, 8 * R * C * e, aln_f, aln_fb]
    res["softmax"] = [2 * B * H * T * T * e, 5 * B * H * T * T * e, sm_f, sm_fb]
    res["cross_entropy"] = [R * V * e, 3 * R * V * e, ce_f, ce_fb]

    if torch is not None and torch.cuda.is_available():
        tdt = _torch_dtype(dt)
        dev = "cuda"
        tx = torch.randn(R, C, dtype=tdt, device=dev, requires_grad=True)
        tw = torch.randn(C, dtype=tdt, device=dev, requires_grad=True)
        tb = torch.randn(C, dtype=tdt, device=dev, requires_grad=True)
        tr = torch.randn(R, C, dtype=tdt, device=dev, requires_grad=True)
        tgg = torch.randn(R, C, dtype=tdt, device=dev)
        tS = torch.randn(B * H * T, T, dtype=tdt, device=dev, requires_grad=True)
        tgS = torch.randn(B * H * T, T, dtype=tdt, device=dev)
        tL = torch.randn(R, V, dtype=tdt, device=dev, requires_grad=True)
        ttg = torch.randint(0, V, (R,), device=dev)

        def t_ln_f():
            with torch.no_grad():
                F.layer_norm(tx, (C,), tw, tb)

        def t_ln_fb():
            tx.grad = tw.grad = tb.grad = None
            F.layer_norm(tx, (C,), tw, tb).backward(tgg)

        def t_aln_f():
            with torch.no_grad():
                F.layer_norm(tx + tr, (C,), tw, tb)

        def t_aln_fb():
            tx.grad = tr.grad = tw.grad = tb.grad = None
            F.layer_norm(tx + tr, (C,), tw, tb).backward(tgg)

        def t_sm_f():
            with torch.no_grad():
                torch.softmax(tS, -1)

        def t_sm_fb():
            tS.grad = None
            torch.softmax(tS, -1).backward(tgS)

        def t_ce_f():
            with torch.no_grad():
                F.cross_entropy(tL, ttg)

        def t_ce_fb():
            tL.grad = None
            F.cross_entropy(tL, ttg).backward()

        res["layer_norm"] += [t_ln_f, t_ln_fb]
        res["add_layer_norm"] += [t_aln_f, t_aln_fb]
        res["softmax"] += [t_sm_f, t_sm_fb]
        res["cross_entropy"] += [t_ce_f, t_ce_fb]
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
    hdr = f"{'op':16} {'dtype':5} {'pass':7} {'floor ms':>9} {'ours ms':>9} {'GB/s':>7} "
    hdr += f"{'%floor':>7} {'torch ms':>9} {'GB/s':>7} {'ours/torch':>10}"
    print(hdr)
    for dt in args.dtypes.split(","):
        for name, v in cases(dt).items():
            for k, pas in enumerate(["fwd", "fwd+bwd"]):
                nbytes = v[k]
                reps = 20 if name in ("cross_entropy", "softmax") else 50
                ours = _time(v[2 + k], _sync_bt, reps)
                theirs = _time(v[4 + k], tsync, reps) if len(v) > 4 else float("nan")
                floor = nbytes / BW * 1e3
                row = {
                    "op": name,
                    "dtype": dt,
                    "pass": pas,
                    "bytes": nbytes,
                    "floor_ms": floor,
                    "ours_ms": ours,
                    "ours_gbps": nbytes / ours / 1e6,
                    "torch_ms": theirs,
                    "torch_gbps": nbytes / theirs / 1e6,
                }
                rows.append(row)
                print(
                    f"{name:16} {dt:5} {pas:7} {floor:9.3f} {ours:9.3f} {row['ours_gbps']:7.0f} "
                    f"{100 * floor / ours:6.1f}% {theirs:9.3f} {row['torch_gbps']:7.0f} "
                    f"{theirs / ours:10.2f}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
