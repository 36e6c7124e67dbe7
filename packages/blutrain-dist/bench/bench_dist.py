"""blutrain.dist next to torch.distributed on the same ranks: collective bus bandwidth, and the
GPT-2 training step (DDP / ZeRO against PyTorch DDP).  A table and JSON; never a test.

    mpiexec -n 4 python bench/bench_dist.py                       # CPU: ours (MPI) vs gloo
    mpirun -n 8 python bench/bench_dist.py --json out.json         # GPU: ours (NCCL) vs NCCL
    python bench/bench_dist.py --gpt2 --modes plain,ddp,torch,torch_ddp   # one GPU, world 1

Bus bandwidth as nccl-tests defines it: all_reduce moves 2 (n - 1) / n of the buffer per rank,
reduce_scatter and all_gather (n - 1) / n of the whole buffer; at one rank it is 0 and the
algorithm bandwidth (bytes / time) is the figure to read.  Both libraries run the same sizes,
the same iterations, on the same ranks, one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import socket
import sys
import time
import warnings
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def torch_group(device: str) -> Any:
    """torch.distributed on the same ranks (address and port agreed over our MPI group)."""
    import torch
    import torch.distributed as tdist

    if tdist.is_initialized():
        return tdist
    # torch 2.13 renamed *_tensor to *_single; the GPU machine's 2.11 has only the old names
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    addr = socket.gethostbyname(socket.gethostname()) if dist.world_size() > 1 else "127.0.0.1"
    if dist.rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    else:
        port = 0
    addr, port = dist.allgather_object((addr, port))[0]
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(device.split(":")[1]))
    tdist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=dist.rank(), world_size=dist.world_size()
    )
    return tdist


def time_loop(fn: Any, sync: Any, min_s: float) -> float:
    """Seconds per call: warm up, then enough calls to fill min_s."""
    for _ in range(3):
        fn()
    sync()
    iters, t = 1, 0.0
    while True:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        t = time.perf_counter() - t0
        # every rank must agree on when to stop (the slowest decides)
        t_all = max(dist.allgather_object(t))
        if t_all >= min_s or iters >= 1000:
            return t_all / iters
        iters = min(1000, max(iters * 2, int(iters * min_s / max(t_all, 1e-6))))


def bench_collectives(a: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    tdist = torch_group(a.device) if not a.no_torch else None
    n, dev = dist.world_size(), a.device
    cuda = dev.startswith("cuda")
    tdev = torch.device(dev) if cuda else torch.device("cpu")

    def sync_ours() -> None:
        if cuda:
            bt.cuda.synchronize()

    def sync_torch() -> None:
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for op in a.ops.split(","):
        for nbytes in sizes(a.min_bytes, a.max_bytes):
            numel = max(n, nbytes // 4 // n * n)  # float32, divisible by the world size
            x = bt.ones(numel, device=dev)
            part = bt.ones(numel // n, device=dev)
            tx = torch.ones(numel, device=tdev)
            tpart = torch.ones(numel // n, device=tdev)
            ours, theirs = _calls(op, x, part, tx, tpart, tdist)
            t_ours = time_loop(ours, sync_ours, a.min_seconds)
            t_theirs = time_loop(theirs, sync_torch, a.min_seconds) if tdist else float("nan")
            b = numel * 4
            row = {
                "op": op,
                "bytes": b,
                "ours_us": 1e6 * t_ours,
                "torch_us": 1e6 * t_theirs,
                "ours_algbw_GBs": b / t_ours / 1e9,
                "torch_algbw_GBs": b / t_theirs / 1e9,
                "ours_busbw_GBs": b / t_ours / 1e9 * bus_factor(op, n),
                "torch_busbw_GBs": b / t_theirs / 1e9 * bus_factor(op, n),
            }
            rows.append(row)
            if dist.rank() == 0:
                print(
                    f"{op:15s} {b:>12,d} B  ours {row['ours_us']:10.1f} us "
                    f"{row['ours_busbw_GBs']:8.2f} GB/s | torch {row['torch_us']:10.1f} us "
                    f"{row['torch_busbw_GBs']:8.2f} GB/s",
                    flush=True,
                )
    return rows


def _calls(op: str, x: Any, part: Any, tx: Any, tpart: Any, tdist: Any) -> tuple[Any, Any]:
    """(ours, torch's) for one collective on the same sizes."""
    if op == "all_reduce":
        return (lambda: dist.all_reduce(x)), (lambda: tdist.all_reduce(tx))
    if op == "reduce_scatter":
        return (lambda: dist.reduce_scatter(part, x)), (
            lambda: tdist.reduce_scatter_tensor(tpart, tx)
        )
    if op == "all_gather":
        return (lambda: dist.all_gather(x, part)), (lambda: tdist.all_gather_into_tensor(tx, tpart))
    raise ValueError(f"[bench_dist] unknown collective {op!r}")


# ---- the GPT-2 step ---------------------------------------------------------------------------
def torch_gpt(L: int, H: int, C: int, V: int, T: int) -> Any:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

        def forward(self, x: Any) -> Any:
            B, T_, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T_, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T_, C))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), Attn(), nn.LayerNorm(C)
            self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.lm_head.weight = self.wte.weight
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02 / (math.sqrt(2 * L) if "c_proj" in name else 1))

        def forward(self, idx: Any, targets: Any) -> Any:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return GPT()


def run_torch(a: argparse.Namespace, ddp: bool) -> dict[str, Any]:
    import torch

    L, H, C = 12, 12, 768
    dev = torch.device(a.device)
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = torch_gpt(L, H, C, 50304, 1024).to(dev)
    fwd = model
    if ddp:
        torch_group(a.device)
        fwd = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    g = torch.Generator().manual_seed(dist.rank())
    data = torch.randint(0, 50257, (a.B, a.T + 1), generator=g).to(dev)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> Any:
        with torch.autocast("cuda", torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return _time_steps(
        a, step, torch.cuda.synchronize, lambda: int(torch.cuda.max_memory_allocated())
    )


def run_ours(a: argparse.Namespace, mode: str) -> dict[str, Any]:
    from blutrain.models.config import GPT2Config
    from blutrain.models.gpt2 import GPT2, gemm_autotune, set_matmul_precision
    from blutrain.models.trainer import clip_and_step, make_adamw

    bt.cuda.reset_peak_memory_stats()
    bt.manual_seed(0)
    cfg = GPT2Config(block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_multiple=128)
    model = GPT2(cfg, device=a.device, precision="bf16")
    set_matmul_precision("bf16")
    params = list(model.parameters())
    fwd: Any = model
    opt: Any
    if mode == "ddp":
        fwd = dist.DistributedDataParallel(
            model, bucket_cap_mb=a.bucket_mb, first_bucket_mb=a.first_bucket_mb
        )
        opt = make_adamw(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    elif mode.startswith("zero"):
        from blutrain.models.optim import AdamW

        opt = dist.ZeroOptimizer(
            AdamW(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
            stage=int(mode[-1]),
            bucket_cap_mb=a.bucket_mb,
            first_bucket_mb=a.first_bucket_mb,
        )
    else:
        opt = make_adamw(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(dist.rank())
    data = rng.integers(0, 50257, (a.B, a.T + 1))
    x = bt.tensor(data[:, :-1], device=a.device)
    y = bt.tensor(data[:, 1:], device=a.device)

    def step() -> Any:
        with gemm_autotune(True, a.device):
            loss = fwd(x, y, return_logits=False)[1]
            loss.backward()
        if mode.startswith("zero"):
            _, coef = opt.grad_norm_and_clip_coef(1.0)
            opt.step(grad_scale=coef)
        else:
            clip_and_step(opt, params, 1.0)
            opt.zero_grad(set_to_none=mode != "ddp")
        return loss

    out = _time_steps(a, step, bt.cuda.synchronize, bt.cuda.max_memory_allocated)
    if mode.startswith("zero"):
        out["model_state"] = opt.memory()
    return out


def _time_steps(a: argparse.Namespace, step: Any, sync: Any, peak: Any) -> dict[str, Any]:
    first = float(step().item())
    for _ in range(a.warmup - 1):
        step()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    last = float(loss.item())
    sync()
    dt = max(dist.allgather_object(time.perf_counter() - t0))
    tok = a.B * a.T * a.steps * dist.world_size() / dt
    return {
        "tokens_per_s": tok,
        "step_ms": 1e3 * dt / a.steps,
        "peak_bytes": int(peak()),
        "first_loss": first,
        "last_loss": last,
    }


def bench_gpt2(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in a.modes.split(","):
        gc.collect()
        if bt.cuda.is_available():
            bt.cuda.empty_cache()
        r = run_torch(a, mode == "torch_ddp") if mode.startswith("torch") else run_ours(a, mode)
        out[mode] = r
        if dist.rank() == 0:
            print(
                f"gpt2 {mode:10s} {r['tokens_per_s']:12,.0f} tok/s  {r['step_ms']:7.2f} ms/step  "
                f"peak {r['peak_bytes'] / 2**30:6.2f} GiB  loss {r['first_loss']:.3f} -> "
                f"{r['last_loss']:.3f}",
                flush=True,
            )
    if "plain" in out and "ddp" in out and dist.rank() == 0:
        cost = out["plain"]["tokens_per_s"] / out["ddp"]["tokens_per_s"] - 1
        out["ddp_cost_vs_plain"] = cost
        print(f"DDP at world size {dist.world_size()} costs {100 * cost:+.2f}% of the plain step")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather")
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument(
        "--max-bytes", type=int, default=None, help="default 1 GiB on GPU, 64 MiB on CPU"
    )
    p.add_argument("--min-seconds", type=float, default=0.05, help="time per size and library")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--gpt2", action="store_true", help="the GPT-2 124M step (GPU), not collectives")
    p.add_argument("--modes", default="plain,ddp,zero1,zero2,torch,torch_ddp")
    p.add_argument("-B", type=int, default=16)
    p.add_argument("-T", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--first-bucket-mb", type=float, default=1.0)
    p.add_argument("--backend", default="auto")
    a = p.parse_args()
    dist.init(backend=a.backend)
    a.device = dist.device()
    if a.max_bytes is None:
        a.max_bytes = (1 << 30) if a.device.startswith("cuda") else (64 << 20)
    result: dict[str, Any] = {
        "world_size": dist.world_size(),
        "device": a.device,
        "backend": dist.backend(),
        "nccl_version": dist.nccl_version(),
    }
    if dist.rank() == 0:
        print(f"world size {dist.world_size()}, device {a.device}, CUDA backend {dist.backend()}")
    if a.gpt2:
        result["gpt2"] = bench_gpt2(a)
    else:
        result["collectives"] = bench_collectives(a)
    if a.json and dist.rank() == 0:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    with contextlib.suppress(Exception):
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
