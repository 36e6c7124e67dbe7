"""Bit-for-bit comparison of two builds' CPU results. Not a test.

    python cpu_bits.py dump OUT.npz [--step N]  # in each build's env (same OMP_NUM_THREADS)
    python cpu_bits.py compare A.npz B.npz  # which arrays differ, in how many elements, by how much

`dump` runs the main CPU ops (layer norm, softmax, log_softmax, cross-entropy, GELU, reductions,
elementwise, linear in float32 and float64, causal attention) forward and backward on inputs from
fixed seeds at several shapes (GPT-2 tiny's, bench_ops's 2048x1024, ragged ones) and saves every
output and gradient. With --step N it also saves the losses and every parameter of N steps of the
README's tiny GPT-2 training run (blutrain.models' Trainer, CPU, fp32). Only the API both builds
share is used, so an old checkout can be compared with today's: this is how issue 36's "results
stay bit-identical for a fixed thread count" is checked (the thread budget comes from
OMP_NUM_THREADS, so dump at 1 and at 2 threads).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np


def _run(res: dict, bt, name: str, fn, arrays: list[np.ndarray]) -> None:
    xs = [bt.from_numpy(np.ascontiguousarray(a)).requires_grad_(True) for a in arrays]
    y = fn(*xs)
    y = y[0] if isinstance(y, (tuple, list)) else y
    res[name + ".y"] = np.array(y.detach().numpy(), copy=True)
    g = np.random.default_rng(7).standard_normal(y.shape).astype(y.detach().numpy().dtype)
    y.backward(bt.from_numpy(g)) if y.ndim else y.backward()
    for i, x in enumerate(xs):
        if x.grad is not None:
            res[f"{name}.g{i}"] = np.array(x.grad.numpy(), copy=True)


def dump_ops(res: dict) -> None:
    import blutrain.tensor as bt

    for R, C in [(1024, 128), (2048, 1024), (67, 129), (1024, 512)]:
        rng = np.random.default_rng(R * 1000 + C)
        a = rng.standard_normal((R, C)).astype(np.float32)
        b = rng.standard_normal((R, C)).astype(np.float32)
        w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
        bias = (0.1 * rng.standard_normal(C)).astype(np.float32)
        tgt = bt.from_numpy(rng.integers(0, C, R).astype(np.int64))
        lw = (rng.standard_normal((C // 2 + 1, C)) / np.sqrt(C)).astype(np.float32)
        lb = rng.standard_normal(C // 2 + 1).astype(np.float32)
        s = f"{R}x{C}"
        ops = {
            "layer_norm": (
                lambda x, w_, b_, C=C: bt.layer_norm(x, (C,), w_, b_, 1e-5),
                [a, w, bias],
            ),
            "add_layer_norm": (
                lambda x, r, w_, b_: bt.add_layer_norm(x, r, w_, b_, 1e-5),
                [a, b, w, bias],
            ),
            "softmax": (lambda x: bt.softmax(x, -1), [a]),
            "log_softmax": (lambda x: bt.log_softmax(x, -1), [a]),
            "cross_entropy": (lambda x, tgt=tgt: bt.cross_entropy(x, tgt), [a]),
            "gelu": (lambda x: bt.gelu(x, "tanh"), [a]),
            "sum-1": (lambda x: bt.sum(x, -1), [a]),
            "sum0": (lambda x: bt.sum(x, 0), [a]),
            "amax-1": (lambda x: bt.amax(x, -1), [a]),
            "mean-1": (lambda x: bt.mean(x, -1), [a]),
            "var-1": (lambda x: bt.var(x, -1), [a]),
            "exp": (lambda x: bt.exp(x), [a]),
            "tanh": (lambda x: bt.tanh(x), [a]),
            "mul": (lambda x, y: x * y, [a, b]),
            "linear": (lambda x, w_, b_: bt.linear(x, w_, b_), [a, lw, lb]),
            "linear64": (
                lambda x, w_: bt.linear(x, w_),
                [a.astype(np.float64), lw.astype(np.float64)],
            ),
        }
        for name, (fn, arrays) in ops.items():
            _run(res, bt, f"{name}.{s}", fn, arrays)
    for B, H, T, D in [(8, 4, 128, 32), (2, 3, 67, 16)]:
        rng = np.random.default_rng(B * H * T * D)
        qkv = [rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3)]
        _run(res, bt, f"sdpa.{B}x{H}x{T}x{D}",
             lambda q, k, v: bt.scaled_dot_product_attention(q, k, v, is_causal=True), qkv)


def dump_step(res: dict, steps: int) -> None:
    from blutrain.models.trainer import TrainConfig, Trainer

    cfg = TrainConfig(device="cpu", out_dir=tempfile.mkdtemp(), progress=False, plot=False,
                      eval_interval=10**9, sample_interval=10**9, log_interval=10**9)
    t = Trainer(cfg)
    rec = [t.train_step() for _ in range(steps)]
    res["step.loss"] = np.array([r["loss"] for r in rec], np.float64)
    for n, p in t.model.named_parameters():
        res["step.p." + n] = np.array(p.detach().numpy(), copy=True)


def compare(pa: str, pb: str) -> int:
    a, b = np.load(pa), np.load(pb)
    names = sorted(set(a.files) | set(b.files))
    same = 0
    for k in names:
        if k not in a.files or k not in b.files:
            print(f"{k:42s} only in {pa if k in a.files else pb}")
            continue
        x, y = a[k], b[k]
        if x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes():
            same += 1
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            print(f"{k:42s} {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        d = np.abs(x64 - y64)
        scale = np.max(np.abs(x64)) if x.size else 1.0
        print(f"{k:42s} {np.count_nonzero(x != y):>9,}/{x.size:<9,} elements differ; "
              f"max |diff| {np.nanmax(d):.3g} ({np.nanmax(d) / scale:.3g} of max |x|)")
    print(f"{same}/{len(names)} arrays bit-identical")
    return 0 if same == len(names) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser(
        "dump", help="save the ops' outputs and gradients (and a short training run)"
    )
    d.add_argument("out")
    d.add_argument("--step", type=int, default=0, help="also N tiny GPT-2 training steps")
    c = sub.add_parser("compare", help="compare two dumps bit for bit (exit 1 if any differs)")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "compare":
        return compare(args.a, args.b)
    res: dict[str, np.ndarray] = {}
    dump_ops(res)
    if args.step:
        dump_step(res, args.step)
    np.savez(args.out, **res)
    print(f"{args.out}: {len(res)} arrays")
    return 0


if __name__ == "__main__":
    sys.exit(main())
