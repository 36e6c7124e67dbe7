"""The eager op sequence of one bf16 GPT-2 training step (forward + backward), residual stream
float32 against compute (bf16): which ops each runs, how often, and the bytes they move.

    python op_trace.py [--layers 2] [-B 2] [-T 64] [--all] [--json OUT]

Runs on the CPU with the fused path forced (`fused=True`: the ops CUDA runs: add_layer_norm,
qkv_attention, linear_gelu_linear, linear_cross_entropy) through blutrain.tensor's eager op log
(bt.op_log(): every primitive apply() evaluates, with its inputs' and outputs' dtypes and shapes;
bt.capture would not do: a captured backward keeps one dtype per gradient edge, so the float32
stream's gradient would be float32 there, bf16 in eager). Bytes of an op: its inputs' and outputs'
sizes (views move none). GPT-2's layers are alike, so the per-layer cost is the difference of two
runs (--layers L and L + 1); the table extrapolates to GPT-2 124M at B16 x T1024 (12 layers) by
scaling every tensor with a (B, T, ...) or (B*T, ...) leading shape by 16 * 1024 / (B * T). The
cached weight casts (bt.cached_astype) are warmed by an untimed step first, as a training step after
the first finds them. Not a test: it prints a table.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import blutrain.tensor as bt
from blutrain.models import GPT2Config
from blutrain.models.gpt2 import GPT2

_VIEWS = {
    "reshape",
    "view",
    "narrow",
    "transpose",
    "permute",
    "expand",
    "slice",
    "squeeze",
    "unsqueeze",
    "select",
    "as_strided",
    "broadcast_to",
}
_SIZE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
}
_TARGET_ROWS = 16 * 1024  # GPT-2 124M's bench: B16 x T1024


def step_ops(
    residual: str, layers: int, B: int, T: int, C: int, V: int, grad: str = "compute"
) -> list[bt.OpLogEntry]:
    """The eager op log of one forward + backward (the loss through the fused head)."""
    bt.manual_seed(0)
    cfg = GPT2Config(block_size=T, vocab_size=V, n_layer=layers, n_head=C // 64, n_embd=C)
    model = GPT2(cfg, fused=True, residual_dtype=residual, precision="bf16")
    model.residual_grad_dtype = grad
    x = bt.tensor([[(7 * i + j) % V for j in range(T)] for i in range(B)], dtype=bt.int64)
    y = bt.tensor([[(5 * i + 3 * j) % V for j in range(T)] for i in range(B)], dtype=bt.int64)
    model(x, y, return_logits=False)[1].backward()  # warm the weights' cached casts
    model.zero_grad()
    with bt.op_log() as log:
        model(x, y, return_logits=False)[1].backward()
    return log


def _bytes(meta: tuple, scale: float, rows: int, B: int, T: int) -> float:
    dtype, shape = meta
    n = 1
    for s in shape:
        n *= s
    per_token = (len(shape) >= 2 and tuple(shape[:2]) == (B, T)) or (shape and shape[0] == rows)
    return n * _SIZE.get(dtype, 4) * (scale if per_token else 1.0)


def table(
    log: list[bt.OpLogEntry], B: int, T: int
) -> tuple[collections.Counter, collections.Counter]:
    """(count, bytes at B16 x T1024) per op signature "op(inputs)->outputs"."""
    cnt: collections.Counter = collections.Counter()
    byt: collections.Counter = collections.Counter()
    scale = _TARGET_ROWS / (B * T)

    def short(m: tuple) -> str:
        return {"float32": "f32", "bfloat16": "bf16"}.get(m[0], m[0]) + "x".join(map(str, m[1]))

    for op, ins, outs in log:
        sig = f"{op}({','.join(map(short, ins))})->{','.join(map(short, outs))}"
        cnt[sig] += 1
        if op not in _VIEWS:
            byt[sig] += sum(_bytes(m, scale, B * T, B, T) for m in list(ins) + list(outs))
    return cnt, byt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1, help="L: the runs have L and L + 1 layers")
    p.add_argument("-B", type=int, default=2)
    p.add_argument("-T", type=int, default=64)
    p.add_argument("-C", type=int, default=768)
    p.add_argument("-V", type=int, default=50304)
    p.add_argument("--all", action="store_true", help="also the ops both streams run alike")
    p.add_argument(
        "--grad",
        default="compute",
        choices=("compute", "float32"),
        help="the float32 stream's gradient dtype (GPT2.residual_grad_dtype) in its column",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    L = a.layers
    runs = {}
    for res in ("compute", "float32"):
        for n in (L, L + 1):
            grad = a.grad if res == "float32" else "compute"
            runs[res, n] = table(step_ops(res, n, a.B, a.T, a.C, a.V, grad), a.B, a.T)

    def at12(res: str, what: int, sig: str) -> float:  # the run with L layers + (12 - L) more
        lo, hi = runs[res, L][what][sig], runs[res, L + 1][what][sig]
        return lo + (12 - L) * (hi - lo)

    sigs = sorted(set().union(*(r[0] for r in runs.values())))
    rows = []
    for s in sigs:
        row = {"op": s}
        for res in ("compute", "float32"):
            row[res] = (at12(res, 0, s), at12(res, 1, s) / 1e6)
        rows.append(row)
    tot = {
        res: (sum(r[res][0] for r in rows), sum(r[res][1] for r in rows))
        for res in ("compute", "float32")
    }
    print(
        f"one bf16 GPT-2 step (forward + backward), fused ops, extrapolated to 12 layers, "
        f"B16 x T1024 (C={a.C}, V={a.V}; runs at B{a.B} x T{a.T}, {L} and {L + 1} layers); the "
        f"float32 stream's gradient: {a.grad}"
    )
    print(f"{'compute: n':>11} {'MB':>8} | {'float32: n':>10} {'MB':>8} | op(inputs)->outputs")
    for r in rows:
        (nc, mc), (nf, mf) = r["compute"], r["float32"]
        if a.all or abs(nc - nf) > 1e-9 or abs(mc - mf) > 0.05:
            print(f"{nc:11.0f} {mc:8.1f} | {nf:10.0f} {mf:8.1f} | {r['op']}")
    print(
        f"{'total':>5} {tot['compute'][0]:5.0f} {tot['compute'][1]:8.1f} | "
        f"{tot['float32'][0]:10.0f} {tot['float32'][1]:8.1f} | "
        f"float32 - compute: {tot['float32'][0] - tot['compute'][0]:+.0f} ops, "
        f"{tot['float32'][1] - tot['compute'][1]:+.1f} MB"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "total": tot, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
