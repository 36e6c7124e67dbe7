"""GPT-2 124M's classifier head and loss (N = B*T = 16384 rows, C = 768, vocabulary 50257 padded
to 50304), forward + backward: bt.linear_cross_entropy (the chunked fused classifier, per chunk
size; at the default size also with the chunk's cross-entropy as two kernels instead of one), our
unfused linear + cross_entropy (logits dropped before backward, so dlogits take their
memory) and PyTorch's F.linear + F.cross_entropy, in bf16 and fp32 under TF32 (same GPU, same
run).  Per row: median time per call over CUDA-event batches, the GEMMs' rate (3 GEMMs of
2 N Vp C flops), and the peak device memory above the start (each library's allocator
statistics).  Prints a table; --json OUT writes the rows.  Not a test."""

from __future__ import annotations

import argparse
import json
import os

from cuda_timing import sync_bt, time_events

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

N, C, V, VP = 16 * 1024, 768, 50257, 50304
FLOPS = 3 * 2 * N * VP * C


def _peak_bt(fn, leaves) -> float:
    for t in leaves:  # each measurement includes allocating the gradients
        t.grad = None
    sync_bt()
    start = bt.cuda.memory_allocated()
    bt.cuda.reset_peak_memory_stats()
    fn()
    sync_bt()
    return (bt.cuda.max_memory_allocated() - start) / 2**20


def run(dt: str, reps: int, chunks: list[int | None]) -> list[dict]:
    bdt = {"bf16": bt.bfloat16, "fp32": bt.float32}[dt]
    x = (bt.randn(N, C, dtype=bdt, device="cuda")).detach().requires_grad_(True)
    w = (bt.randn(VP, C, dtype=bdt, device="cuda") * 0.02).detach().requires_grad_(True)
    tgt = bt.randint(0, V, (N,), device="cuda")
    rows = []

    def add(impl, fn, peak_mb):
        ms = time_events(fn, reps)
        rows.append(dict(dtype=dt, impl=impl, ms=ms, tflops=FLOPS / ms / 1e9, peak_MB=peak_mb))

    for ch in chunks:

        def fused(ch=ch):
            bt.linear_cross_entropy(x, w, tgt, num_classes=V, chunk_size=ch).backward()

        add(f"fused chunk={ch or 'auto'}", fused, _peak_bt(fused, (x, w)))
        if ch is None:  # the chunk's cross-entropy as two kernels (forward, backward) instead of v4
            os.environ["BT_CUDA_CE_FUSED"] = "0"
            try:
                add("fused chunk=auto, 2 CE kernels", fused, _peak_bt(fused, (x, w)))
            finally:
                del os.environ["BT_CUDA_CE_FUSED"]

    def unfused():
        loss = bt.cross_entropy(bt.linear(x, w).narrow(1, 0, V), tgt, loss_dtype=bt.float32)
        loss.backward()

    add("ours linear+ce", unfused, _peak_bt(unfused, (x, w)))
    if torch is not None and torch.cuda.is_available():
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        tx = torch.randn(N, C, dtype=tdt, device="cuda", requires_grad=True)
        tw = (torch.randn(VP, C, dtype=tdt, device="cuda") * 0.02).requires_grad_()
        tt = torch.randint(0, V, (N,), device="cuda")
        F = torch.nn.functional

        def tfn():
            F.cross_entropy(F.linear(tx, tw)[:, :V].float(), tt).backward()

        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        tfn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - start) / 2**20
        ms = time_events(tfn, reps, torch_events=True)
        rows.append(dict(dtype=dt, impl="torch linear+ce", ms=ms, tflops=FLOPS / ms / 1e9,
                         peak_MB=peak))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", default="auto,1024,2048,4096",
                    help="chunk sizes in rows, 'auto' for the default")  # fmt: skip
    args = ap.parse_args()
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    chunks = [None if c == "auto" else int(c) for c in args.chunks.split(",")]
    prev = bt.get_float32_matmul_precision()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = True
    bt.set_float32_matmul_precision("high")
    rows = []
    try:
        for dt in ("bf16", "fp32"):
            rows += run(dt, args.reps, chunks)
    finally:
        bt.set_float32_matmul_precision(prev)
    print(f"classifier head + loss, fwd+bwd: N={N} C={C} V={V} (padded {VP}); fp32 = TF32 GEMMs")
    print(f"{'dtype':5} {'impl':30} {'ms':>8} {'TFLOP/s':>8} {'peak MB':>9}")
    for r in rows:
        print(f"{r['dtype']:5} {r['impl']:30} {r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{r['peak_MB']:9.1f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
