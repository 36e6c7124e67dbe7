"""CPU op timings, blutrain.tensor next to numpy and PyTorch (same run). Prints a table, writes
JSON with --out FILE. Not a test: never run by CI."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def timeit(fn, reps: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3  # ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", "--json", dest="out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 1024)).astype(np.float32)
    b = rng.standard_normal((2048, 1024)).astype(np.float32)
    w = rng.standard_normal((1024, 1024)).astype(np.float32)
    tgt = rng.integers(0, 1024, 2048)
    ba, bb, bw, bt_t = bt.tensor(a), bt.tensor(b), bt.tensor(w), bt.tensor(tgt)
    cases = {
        "add (2048x1024)": (lambda: ba + bb, lambda: a + b, "add"),
        "add broadcast row": (lambda: ba + bb[0], lambda: a + b[0], "addrow"),
        "mul transposed": (lambda: ba.T * bb.T, lambda: a.T * b.T, "mulT"),
        "exp": (lambda: ba.exp(), lambda: np.exp(a), "exp"),
        "gelu tanh": (lambda: bt.gelu(ba, "tanh"), None, "gelu"),
        "sum(-1)": (lambda: ba.sum(-1), lambda: a.sum(-1), "sum"),
        "sum(0)": (lambda: ba.sum(0), lambda: a.sum(0), "sum0"),
        "softmax(-1)": (lambda: bt.softmax(ba, -1), None, "softmax"),
        "layer_norm": (lambda: bt.layer_norm(ba, (1024,)), None, "ln"),
        "cross_entropy": (lambda: bt.cross_entropy(ba, bt_t), None, "ce"),
        "matmul 2048x1024x1024": (lambda: ba @ bw, lambda: a @ w, "mm"),
    }
    tt = {}
    if torch is not None:
        ta, tb, tw, ttgt = (torch.from_numpy(x) for x in (a, b, w, tgt))
        F = torch.nn.functional
        tt = {
            "add": lambda: ta + tb,
            "addrow": lambda: ta + tb[0],
            "mulT": lambda: ta.T * tb.T,
            "exp": lambda: ta.exp(),
            "gelu": lambda: F.gelu(ta, approximate="tanh"),
            "sum": lambda: ta.sum(-1),
            "sum0": lambda: ta.sum(0),
            "softmax": lambda: ta.softmax(-1),
            "ln": lambda: F.layer_norm(ta, (1024,)),
            "ce": lambda: F.cross_entropy(ta, ttgt),
            "mm": lambda: ta @ tw,
        }
    # One library at a time: torch's OpenMP workers spin after each op and would steal the
    # cores from whichever library ran next.
    bt_ms = {name: timeit(fb) for name, (fb, _, _) in cases.items()}
    np_ms = {name: timeit(fn) for name, (_, fn, _) in cases.items() if fn}
    torch_ms = {name: timeit(tt[key]) for name, (_, _, key) in cases.items() if key in tt}
    rows = []
    print(f"{'op':28s} {'bt ms':>9s} {'numpy ms':>9s} {'torch ms':>9s}")

    def fmt(v):
        return f"{v:9.3f}" if v is not None else f"{'-':>9s}"

    for name in cases:
        r = {
            "op": name,
            "bt_ms": bt_ms[name],
            "numpy_ms": np_ms.get(name),
            "torch_ms": torch_ms.get(name),
        }
        rows.append(r)
        print(f"{name:28s} {fmt(r['bt_ms'])} {fmt(r['numpy_ms'])} {fmt(r['torch_ms'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
