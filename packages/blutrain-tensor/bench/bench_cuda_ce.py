"""Cross-entropy kernels per version at GPT-2's classifier shape (R = 16 * 1024 rows, V = 50257):
ours with BT_CUDA_NN_VERSION = 3 / 2 (and v3 at 128 / 512 threads per row: BT_CUDA_CE_THREADS)
next to PyTorch (torch CUDA, same GPU, same run), bf16 and fp32, forward (no grad), forward +
backward, and backward alone (the difference).  cross_entropy: dense (R, V) logits; ce_padded:
the first V columns of (R, 50304) logits read in place, the padded gradient written in one pass
(GPT-2's head).  Median of batches of reps after warm-up (CUDA events); %floor = (bytes / 4.3
TB/s) / time.  --json OUT writes the rows.  Not a test."""

from __future__ import annotations

import argparse
import json
import os

from cuda_timing import time_events

import blutrain.tensor as bt

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

BW = 4.3e12  # bytes/s, measured H200 copy bandwidth
R, V, VP = 16 * 1024, 50257, 50304


def _cases(dt: str):
    """name -> (ours fwd, ours fwd+bwd, bytes fwd, bytes fwd+bwd, torch fwd, torch fwd+bwd)."""
    bdt = {"bf16": bt.bfloat16, "fp32": bt.float32}[dt]
    e = 2 if dt == "bf16" else 4
    L = bt.randn(R, V, dtype=bdt, device="cuda").requires_grad_(True)
    Lp = bt.randn(R, VP, dtype=bdt, device="cuda").requires_grad_(True)
    tg = bt.randint(0, V, R, device="cuda")
    lossdt = bt.float32 if dt == "bf16" else None

    def ce_f():
        with bt.no_grad():
            bt.cross_entropy(L, tg)

    def ce_fb():
        L.grad = None
        bt.cross_entropy(L, tg).backward()

    def cep_f():
        with bt.no_grad():
            bt.cross_entropy(Lp.narrow(1, 0, V), tg, ignore_index=-1, loss_dtype=lossdt)

    def cep_fb():
        Lp.grad = None
        bt.cross_entropy(Lp.narrow(1, 0, V), tg, ignore_index=-1, loss_dtype=lossdt).backward()

    nan = lambda: None  # noqa: E731
    t = [nan] * 4
    if torch is not None and torch.cuda.is_available():
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        tL = torch.randn(R, V, dtype=tdt, device="cuda", requires_grad=True)
        tLp = torch.randn(R, VP, dtype=tdt, device="cuda", requires_grad=True)
        ttg = torch.randint(0, V, (R,), device="cuda")

        def t_f(x):
            with torch.no_grad():
                F.cross_entropy(x, ttg)

        def t_fb(src, x):
            src.grad = None
            F.cross_entropy(x(), ttg).backward()

        t = [
            lambda: t_f(tL),
            lambda: t_fb(tL, lambda: tL),
            lambda: t_f(tLp[:, :V]),
            lambda: t_fb(tLp, lambda: tLp[:, :V]),
        ]
    return {
        "cross_entropy": (ce_f, ce_fb, R * V * e, 3 * R * V * e, t[0], t[1]),
        "ce_padded": (cep_f, cep_fb, R * V * e, 2 * R * V * e + R * VP * e, t[2], t[3]),
    }


def _pick(t: tuple[float, float], k: int) -> float:
    return t[k] if k < 2 else t[1] - t[0]  # k == 2: backward = (fwd+bwd) - fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument(
        "--versions",
        default="3,2,3@128,3@512",
        help="BT_CUDA_NN_VERSION values to time; V@T also sets BT_CUDA_CE_THREADS=T (v3 sweep)",
    )
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    versions = [v for v in args.versions.split(",") if v]
    saved = {k: os.environ.get(k) for k in ("BT_CUDA_NN_VERSION", "BT_CUDA_CE_THREADS")}
    rows = []
    hdr = f"{'op':14} {'dtype':5} {'pass':7} {'floor ms':>8}"
    hdr += "".join(f" {'v' + v + ' ms':>9} {'%floor':>6}" for v in versions) + f" {'torch ms':>8}"
    print(hdr)
    for dt in args.dtypes.split(","):
        for name, (f, fb, bf, bfb, tf, tfb) in _cases(dt).items():
            ms = {}
            for ver in versions:
                v, _, thr = ver.partition("@")
                os.environ["BT_CUDA_NN_VERSION"] = v
                if thr:
                    os.environ["BT_CUDA_CE_THREADS"] = thr
                else:
                    os.environ.pop("BT_CUDA_CE_THREADS", None)
                ms[ver] = (time_events(f, args.reps), time_events(fb, args.reps))
            if torch is not None and torch.cuda.is_available():
                th = (
                    time_events(tf, args.reps, torch_events=True),
                    time_events(tfb, args.reps, torch_events=True),
                )
            else:
                th = (float("nan"), float("nan"))
            for k, (pas, nbytes) in enumerate([("fwd", bf), ("fwd+bwd", bfb), ("bwd", bfb - bf)]):
                floor = nbytes / BW * 1e3
                row = {
                    "op": name,
                    "dtype": dt,
                    "pass": pas,
                    "bytes": nbytes,
                    "floor_ms": floor,
                    "torch_ms": _pick(th, k),
                }
                cols = ""
                for ver, tt in ms.items():
                    row[f"v{ver}_ms"] = _pick(tt, k)
                    row[f"v{ver}_pct_floor"] = 100 * floor / _pick(tt, k)
                    cols += f" {_pick(tt, k):9.4f} {100 * floor / _pick(tt, k):5.1f}%"
                rows.append(row)
                print(
                    f"{name:14} {dt:5} {pas:7} {floor:8.4f}{cols} {_pick(th, k):8.4f}", flush=True
                )
    for k, val in saved.items():
        if val is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = val
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"bench": "cuda_ce", "copy_floor_Bps": BW, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
