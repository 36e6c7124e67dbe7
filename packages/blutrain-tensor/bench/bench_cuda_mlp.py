"""bt.linear_gelu_linear (GPT-2 124M MLP: M = B*T = 16384, C = 768, 4C = 3072) forward and
forward + backward, per implementation of its GELU parts (--impls: 'kernel' = plain GEMMs + our
fused dgelu(+db1) kernel and, for fp32, GEMM + GeluTanh kernel; 'cublaslt' = cuBLASLt's
GELU_AUX / DGELU_BGRAD epilogues) and recompute off/on, next to PyTorch's unfused MLP (linear,
gelu tanh, linear; same GPU, same run). Also the activation memory the op keeps for backward
(memory_allocated after the forward minus before). Times with CUDA events (median of batches
after warm-up). fp32 runs under float32 matmul precision 'high' (TF32), as GPT-2's tf32 preset.
Prints a table; --json OUT writes the rows. Not a test."""

from __future__ import annotations

import argparse
import json

from cuda_timing import sync_bt, time_events

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

M, C = 16 * 1024, 768


def run(dt: str, reps: int) -> list[dict]:
    bdt = {"bf16": bt.bfloat16, "fp32": bt.float32}[dt]
    x = bt.randn(M, C, dtype=bdt, device="cuda")
    g = bt.randn(M, C, dtype=bdt, device="cuda")
    ps = [
        bt.randn(4 * C, C, dtype=bdt, device="cuda") * 0.02,
        bt.zeros(4 * C, dtype=bdt, device="cuda"),
        bt.randn(C, 4 * C, dtype=bdt, device="cuda") * 0.02,
        bt.zeros(C, dtype=bdt, device="cuda"),
    ]
    ps = [p.detach().requires_grad_(True) for p in ps]
    rows = []
    for impl in ("kernel", "cublaslt"):
        bt._tensor._set_linear_gelu_linear_impl(impl)
        for rc in (False, True):

            def fwd(rc=rc):
                return bt.linear_gelu_linear(x, ps[0], ps[1], ps[2], ps[3], recompute=rc)

            def fwd_bwd(rc=rc):
                fwd(rc).backward(g)

            sync_bt()
            before = bt.cuda.memory_allocated()
            y = fwd()
            sync_bt()
            saved = bt.cuda.memory_allocated() - before - y.numel() * y.element_size()
            del y
            with bt.no_grad():
                t_f = time_events(fwd, reps)
            t_fb = time_events(fwd_bwd, reps)
            rows.append(dict(dtype=dt, impl=impl, recompute=rc, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                             saved_MB=saved / 2**20))  # fmt: skip
    if torch is not None and torch.cuda.is_available():
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        tx = torch.randn(M, C, dtype=tdt, device="cuda")
        tg = torch.randn(M, C, dtype=tdt, device="cuda")
        tp = [
            (torch.randn(4 * C, C, dtype=tdt, device="cuda") * 0.02).requires_grad_(),
            torch.zeros(4 * C, dtype=tdt, device="cuda", requires_grad=True),
            (torch.randn(C, 4 * C, dtype=tdt, device="cuda") * 0.02).requires_grad_(),
            torch.zeros(C, dtype=tdt, device="cuda", requires_grad=True),
        ]
        F = torch.nn.functional

        def tfwd():
            return F.linear(F.gelu(F.linear(tx, tp[0], tp[1]), approximate="tanh"), tp[2], tp[3])

        def tfwd_bwd():
            tfwd().backward(tg)

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        ty = tfwd()
        saved = torch.cuda.memory_allocated() - before - ty.numel() * ty.element_size()
        del ty
        with torch.no_grad():
            t_f = time_events(tfwd, reps, torch_events=True)
        t_fb = time_events(tfwd_bwd, reps, torch_events=True)
        rows.append(dict(dtype=dt, impl="torch", recompute=False, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                         saved_MB=saved / 2**20))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    prev_impl = bt._tensor._get_linear_gelu_linear_impl()
    prev_prec = bt.get_float32_matmul_precision()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = True
    bt.set_float32_matmul_precision("high")
    rows = []
    try:
        for dt in ("bf16", "fp32"):
            rows += run(dt, args.reps)
    finally:
        bt._tensor._set_linear_gelu_linear_impl(prev_impl)
        bt.set_float32_matmul_precision(prev_prec)
    print(f"linear_gelu_linear M={M} C={C} 4C={4 * C} (per layer; GPT-2 124M runs 12 a step)")
    hdr = f"{'dtype':5} {'impl':9} {'recompute':9} {'fwd ms':>8} {'fwd+bwd ms':>11}"
    print(f"{hdr} {'saved MB':>9}")
    for r in rows:
        print(f"{r['dtype']:5} {r['impl']:9} {r['recompute']!s:9} {r['fwd_ms']:8.3f} "
              f"{r['fwd_bwd_ms']:11.3f} {r['saved_MB']:9.1f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
