"""CUDA optimizer kernels over GPT-2 124M's 148 parameter tensors (124.4M parameters): our
multi-tensor AdamW (one launch; also the per-tensor v1 reference, device lr/step + grad_scale, and
bf16 params with fp32 states) next to torch.optim.AdamW(fused=True) and (foreach=True); the global
gradient norm and clip_grad_norm_ next to torch.nn.utils.clip_grad_norm_(foreach=True).  Median of
batched reps after warm-up, achieved GB/s against the memory floor (bytes moved / 4.3 TB/s
measured copy bandwidth; fp32 AdamW reads p, g, m, v and writes p, m, v: 28 bytes/param).  Prints a
table; --json OUT writes the rows.  Not a test."""

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
C = bt._tensor


def gpt2_shapes(n_layer=12, c=768, vocab=50257, block=1024):
    shapes = [(vocab, c), (block, c)]
    for _ in range(n_layer):
        shapes += [(c,), (c,), (3 * c, c), (3 * c,), (c, c), (c,)]
        shapes += [(c,), (c,), (4 * c, c), (4 * c,), (c, 4 * c), (c,)]
    return shapes + [(c,), (c,)]


def _sync_bt() -> None:
    bt._tensor._cuda_synchronize(0)


def _sync_torch() -> None:
    torch.cuda.synchronize()


def _time(fn, sync, reps: int = 20, batches: int = 7) -> float:
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


def _bt_tensors(shapes, dtype, rng, scale=1.0, positive=False):
    out = []
    for s in shapes:
        a = rng.standard_normal(s, dtype=np.float32) * scale
        if positive:
            a = np.abs(a)
        out.append(bt.tensor(a, dtype=dtype, device="cuda"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = gpt2_shapes()
    n = int(sum(np.prod(s) for s in shapes))
    wd = [0.1 if len(s) >= 2 else 0.0 for s in shapes]
    rows = []

    def row(name, ms, nbytes, torch_ms=None, torch_name=""):
        r = {
            "case": name,
            "ours_ms": ms,
            "ours_GBps": nbytes / (ms * 1e-3) / 1e9,
            "floor_ms": nbytes / BW * 1e3,
            "of_floor": (nbytes / BW * 1e3) / ms,
            "torch": torch_name,
            "torch_ms": torch_ms,
            "torch_GBps": None if torch_ms is None else nbytes / (torch_ms * 1e-3) / 1e9,
        }
        rows.append(r)
        t = (
            ""
            if torch_ms is None
            else f"{torch_name:>18} {torch_ms:8.3f} ms {r['torch_GBps']:7.0f}"
        )
        print(
            f"{name:34} {ms:8.3f} ms {r['ours_GBps']:7.0f} GB/s  floor {r['floor_ms']:6.3f} ms "
            f"({100 * r['of_floor']:4.0f}%)  {t}",
            flush=True,
        )

    print(f"GPT-2 124M: {len(shapes)} tensors, {n / 1e6:.1f}M params", flush=True)
    # ---- AdamW fp32 ------------------------------------------------------------------------------
    ps = _bt_tensors(shapes, bt.float32, rng)
    gs = _bt_tensors(shapes, bt.float32, rng, 1e-2)
    ms = _bt_tensors(shapes, bt.float32, rng, 1e-3)
    vs = _bt_tensors(shapes, bt.float32, rng, 1e-4, positive=True)
    step = [1]

    def ours():
        step[0] += 1
        C._adamw_(ps, gs, ms, vs, 1e-6, 0.9, 0.95, 1e-8, wd, step[0])

    lr_t = bt.tensor(1e-6, dtype=bt.float32, device="cuda")
    st_t = bt.tensor(10.0, dtype=bt.float32, device="cuda")
    sc_t = bt.tensor(0.5, dtype=bt.float32, device="cuda")

    def ours_dev():
        C._adamw_(ps, gs, ms, vs, lr_t, 0.9, 0.95, 1e-8, wd, st_t, sc_t)

    def ours_v1():
        C._set_optim_kernel_version(1)
        try:
            ours()
        finally:
            C._set_optim_kernel_version(2)

    t_fused = t_foreach = None
    if torch is not None:
        tp = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
        for p in tp:
            p.grad = torch.randn_like(p) * 1e-2
        opt_f = torch.optim.AdamW(tp, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        opt_e = torch.optim.AdamW(tp, lr=1e-6, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
        t_fused = _time(opt_f.step, _sync_torch, args.reps)
        t_foreach = _time(opt_e.step, _sync_torch, args.reps)
    row(
        "adamw fp32 (multi-tensor)",
        _time(ours, _sync_bt, args.reps),
        28 * n,
        t_fused,
        "torch fused",
    )
    row(
        "adamw fp32 dev lr/step+scale",
        _time(ours_dev, _sync_bt, args.reps),
        28 * n,
        t_foreach,
        "torch foreach",
    )
    row("adamw fp32 v1 (per tensor)", _time(ours_v1, _sync_bt, args.reps), 28 * n)
    # ---- bf16 params, fp32 states: reads p, g (2+2), m, v (4+4); writes p (2), m, v (4+4) -------
    pb = _bt_tensors(shapes, bt.bfloat16, rng)
    gb = _bt_tensors(shapes, bt.bfloat16, rng, 1e-2)

    def ours_bf16():
        C._adamw_(pb, gb, ms, vs, 1e-6, 0.9, 0.95, 1e-8, wd, 10)

    row("adamw bf16 p / fp32 m,v", _time(ours_bf16, _sync_bt, args.reps), 22 * n)
    # ---- grad norm and clipping ---------------------------------------------------------------
    t_norm = t_clip = None
    if torch is not None:
        tg = [p.grad for p in tp]

        def torch_norm():
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tg)))

        def torch_clip():  # max_norm 1e30: coefficient 1, the grads keep their values
            torch.nn.utils.clip_grad_norm_(tp, 1e30, foreach=True)

        t_norm = _time(torch_norm, _sync_torch, args.reps)
        t_clip = _time(torch_clip, _sync_torch, args.reps)
    row(
        "grad_norm (2-stage, deterministic)",
        _time(lambda: C._grad_norm(gs), _sync_bt, args.reps),
        4 * n,
        t_norm,
        "torch foreach_norm",
    )
    params = []
    for g in gs:
        p = bt.nn.Parameter(bt.zeros(*g.shape, device="cuda"))
        p.grad = g
        params.append(p)
    row(
        "clip_grad_norm_ (norm+coef+scale)",
        _time(lambda: bt.clip_grad_norm_(params, 1e30), _sync_bt, args.reps),
        12 * n,
        t_clip,
        "torch clip foreach",
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": n, "tensors": len(shapes), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
