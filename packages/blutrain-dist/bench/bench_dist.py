"""blutrain.dist next to torch.distributed on the same ranks: collective bus bandwidth, and the
GPT-2 training step (DDP / ZeRO against PyTorch DDP).  A table and JSON; never a test.

    mpiexec -n 4 python bench/bench_dist.py                       # CPU: ours (MPI) vs gloo
    mpirun -n 8 python bench/bench_dist.py --json out.json         # GPU: ours (NCCL) vs NCCL
    python bench/bench_dist.py --gpt2 --modes plain,ddp,torch,torch_ddp   # one GPU, world 1
    mpirun -n 8 python bench/bench_dist.py --gpt2 --precisions bf16,fp32 --modes ddp,zero2,torch_ddp

Bus bandwidth as nccl-tests defines it: all_reduce moves 2 (n - 1) / n of the buffer per rank,
reduce_scatter and all_gather (n - 1) / n of the whole buffer; at one rank it is 0 and the
algorithm bandwidth (bytes / time) is the figure to read.  Both libraries run the same sizes,
the same iterations, on the same ranks, one after the other.

GPT-2 (--gpt2): B x T tokens per rank per step, random tokens, AdamW, clip 1.0; tokens/s counts
every rank's tokens; the peak memory is the largest rank's (blutrain.alloc's statistics for
ours, torch.cuda.max_memory_allocated for PyTorch); PyTorch DDP runs with
gradient_as_bucket_view=True (its faster setting), fused AdamW, autocast for bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import socket
import sys
import time
import warnings
from typing import Any

import numpy as np

import blutrain.dist as dist
import blutrain.tensor as bt

# NVLink multicast stays off (NCCL, torch, NVSHMEM) even when started by hand: a program using
# it can take a shared machine's GPUs out of service.
for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)


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
# mode -> what runs: ours (plain: no blutrain.dist; ddp; zero1 / zero2) or PyTorch (torch: one
# process's step; torch_ddp: DistributedDataParallel; *_compile: the model through torch.compile)
OURS = ("plain", "ddp", "zero1", "zero2")
THEIRS = ("torch", "torch_compile", "torch_ddp", "torch_ddp_compile")
V = 50257  # GPT-2's vocabulary (both models pad it to a multiple of 128)


def torch_gpt(L: int, H: int, C: int, VP: int, T: int) -> Any:
    """nanoGPT's GPT-2 (tied head, GELU-tanh, SDPA attention), as bench_gpt2.py's."""
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
            self.wte, self.wpe = nn.Embedding(VP, C), nn.Embedding(T, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, VP, bias=False)
            self.lm_head.weight = self.wte.weight
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02 / (math.sqrt(2 * L) if "c_proj" in name else 1))
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx: Any, targets: Any) -> Any:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return GPT()


def _model_shape(a: argparse.Namespace) -> Any:
    from blutrain.models.config import model_config

    return model_config(a.model, vocab_multiple=128)


def run_torch(a: argparse.Namespace, mode: str, precision: str) -> dict[str, Any]:
    import torch

    cfg = _model_shape(a)
    cuda = a.device.startswith("cuda")
    dev = torch.device(a.device)
    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = torch_gpt(
        cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.padded_vocab_size, cfg.block_size
    ).to(dev)
    fwd: Any = model
    if mode.startswith("torch_ddp"):
        torch_group(a.device)
        fwd = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[dev.index] if cuda else None,
            gradient_as_bucket_view=True,  # PyTorch's faster setting: no copy into buckets
        )
    if mode.endswith("_compile"):
        fwd = torch.compile(fwd)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    g = torch.Generator().manual_seed(1000 + dist.rank())
    data = torch.randint(0, V, (a.B, a.T + 1), generator=g).to(dev)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    amp = torch.autocast(dev.type, torch.bfloat16, enabled=precision == "bf16")

    def step() -> Any:
        with amp:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def peak() -> int:
        if cuda:
            return int(torch.cuda.max_memory_allocated())
        from blutrain.models.device import peak_memory_bytes

        return peak_memory_bytes("cpu")

    return _time_steps(a, step, sync, peak)


def run_ours(a: argparse.Namespace, mode: str, precision: str) -> dict[str, Any]:
    from blutrain.models.device import peak_memory_bytes, resolve_recompute
    from blutrain.models.gpt2 import GPT2, gemm_autotune, set_matmul_precision
    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    cuda = a.device.startswith("cuda")
    if cuda:
        bt.cuda.reset_peak_memory_stats()
    bt.manual_seed(0)
    cfg = _model_shape(a)
    # as the trainer and blutrain bench: float32 masters, compute in `precision`, recompute
    # "auto" (LayerNorm outputs rebuilt in backward for fp32 on a GPU)
    model = GPT2(
        cfg,
        device=a.device,
        precision=precision,
        recompute=resolve_recompute("auto", a.device, precision),
    )
    set_matmul_precision(precision)
    params = list(model.parameters())
    adamw = AdamW(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fwd: Any = model
    opt: Any = adamw
    if mode == "ddp":
        fwd = dist.DistributedDataParallel(
            model, bucket_cap_mb=a.bucket_mb, first_bucket_mb=a.first_bucket_mb
        )
    elif mode.startswith("zero"):
        opt = dist.ZeroOptimizer(
            adamw, stage=int(mode[-1]), bucket_cap_mb=a.bucket_mb, first_bucket_mb=a.first_bucket_mb
        )
    rng = np.random.default_rng(1000 + dist.rank())
    data = rng.integers(0, V, (a.B, a.T + 1))
    x = bt.tensor(data[:, :-1], device=a.device)
    y = bt.tensor(data[:, 1:], device=a.device)

    def step() -> Any:
        with gemm_autotune(True, a.device):  # as the trainer: the first step tunes
            loss = fwd(x, y, return_logits=False)[1]
            loss.backward()
        if mode.startswith("zero"):
            _, coef = opt.grad_norm_and_clip_coef(1.0)
            opt.step(grad_scale=coef)
        else:
            _, coef = grad_norm_and_clip_coef(params, 1.0)
            opt.step(grad_scale=coef)
            if mode == "plain":
                opt.zero_grad()  # DDP: none (the next backward overwrites its buckets)
        return loss

    def sync() -> None:
        if cuda:
            bt.cuda.synchronize()

    out = _time_steps(a, step, sync, lambda: peak_memory_bytes(a.device))
    if mode.startswith("zero"):
        out["model_state"] = opt.memory()
    return out


def _agree(value: Any, how: Any = max) -> Any:
    """Every rank's value, combined (ranks must take the same decisions)."""
    return how(dist.allgather_object(value))


def _time_steps(a: argparse.Namespace, step: Any, sync: Any, peak: Any) -> dict[str, Any]:
    """Warm up, then time enough steps to fill a.seconds (all ranks agree on the count); the
    timed steps are queued with no host sync between them, as the trainer's."""
    t0 = time.perf_counter()
    first = float(step().item())  # tunes GEMMs, compiles (torch.compile)
    t_first = time.perf_counter() - t0
    for _ in range(max(0, a.warmup - 2)):
        step()
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    est = _agree(time.perf_counter() - t0)
    steps = int(min(a.max_steps, max(a.min_steps, math.ceil(a.seconds / max(est, 1e-6)))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    last = float(loss.item())
    sync()
    dt = _agree(time.perf_counter() - t0)
    n = dist.world_size()
    return {
        "tokens_per_s": a.B * a.T * steps * n / dt,
        "tokens_per_s_per_gpu": a.B * a.T * steps / dt,
        "step_ms": 1e3 * dt / steps,
        "steps": steps,
        "peak_bytes": int(_agree(int(peak()))),  # the largest rank's
        "first_loss": first,
        "last_loss": last,
        "first_step_s": t_first,
    }


def _configs(a: argparse.Namespace) -> list[tuple[str, str]]:
    if a.configs:
        out = []
        for c in a.configs.split(","):
            prec, _, mode = c.partition(":")
            out.append((prec, mode))
    else:
        out = [(p, m) for p in a.precisions.split(",") for m in a.modes.split(",")]
    for prec, mode in out:
        if prec not in ("bf16", "tf32", "fp32") or mode not in OURS + THEIRS:
            raise SystemExit(f"[bench_dist] unknown config {prec}:{mode} (precisions bf16, tf32, "
                             f"fp32; modes {', '.join(OURS + THEIRS)})")  # fmt: skip
    return out


def bench_gpt2(a: argparse.Namespace) -> dict[str, Any]:
    """Every (precision, mode) in turn, each from a fresh model; skips what the deadline does
    not leave time for (a torch.compile config is expected to take ~90 s, others ~20 s)."""
    out: dict[str, Any] = {}
    for prec, mode in _configs(a):
        key = f"{prec}:{mode}"
        k = 2
        while key in out:  # a config given twice (plain, ddp, plain, ddp: the order's effect)
            key, k = f"{prec}:{mode}#{k}", k + 1
        need = 90.0 if mode.endswith("compile") else 20.0
        go = time.time() + need < a.deadline if a.deadline else True
        if not dist.allgather_object(go)[0]:  # rank 0 decides for everyone
            out[key] = {"skipped": f"less than {need:.0f} s left of the budget"}
            if dist.rank() == 0:
                print(f"gpt2 {key:22s} skipped: {out[key]['skipped']}", flush=True)
            continue
        gc.collect()
        if a.device.startswith("cuda"):
            bt.cuda.empty_cache()
            with contextlib.suppress(ImportError):
                import torch

                torch.cuda.empty_cache()
        try:
            r = run_torch(a, mode, prec) if mode in THEIRS else run_ours(a, mode, prec)
        except Exception as e:  # one failing config must not hide the others' figures
            r = {"error": f"{type(e).__name__}: {e}"}
            print(f"[rank {dist.rank()}] gpt2 {key}: {r['error']}", file=sys.stderr, flush=True)
        out[key] = r
        if dist.rank() == 0 and "error" not in r:
            print(
                f"gpt2 {key:22s} {r['tokens_per_s']:12,.0f} tok/s ({r['tokens_per_s_per_gpu']:,.0f}"
                f" per GPU)  {r['step_ms']:7.2f} ms/step  peak {r['peak_bytes'] / 2**30:6.2f} GiB"
                f"  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}",
                flush=True,
            )
    for prec in {p for p, _ in _configs(a)}:

        def best(mode: str, prec: str = prec) -> float | None:  # the fastest of its repeats
            runs = [v["tokens_per_s"] for k, v in out.items() if k.split("#")[0] == f"{prec}:{mode}"
                    and isinstance(v, dict) and "tokens_per_s" in v]  # fmt: skip
            return max(runs) if runs else None

        plain, ddp = best("plain"), best("ddp")
        if plain and ddp:
            cost = plain / ddp - 1
            out[f"{prec}:ddp_cost_vs_plain"] = cost
            if dist.rank() == 0:
                print(f"{prec}: DDP at world size {dist.world_size()} costs {100 * cost:+.2f}% "
                      "of the plain step (aim: <= 2% at world size 1)")  # fmt: skip
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
    p.add_argument("--gpt2", action="store_true", help="the GPT-2 training step, not collectives")
    p.add_argument("--model", default="gpt2", help="GPT2Config preset (gpt2 = 124M; tiny)")
    p.add_argument("--modes", default="plain,ddp,zero1,zero2,torch,torch_ddp",
                   help=f"of {', '.join(OURS + THEIRS)}")  # fmt: skip
    p.add_argument("--precisions", default="bf16", help="of bf16, tf32, fp32")
    p.add_argument("--configs", default=None,
                   help="precision:mode,... instead of --precisions x --modes")  # fmt: skip
    p.add_argument("-B", type=int, default=16)
    p.add_argument("-T", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=2.0, help="timed seconds per config")
    p.add_argument("--min-steps", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first tunes)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="time.time() after which no config starts (0: none)")  # fmt: skip
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--first-bucket-mb", type=float, default=1.0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default=None, help="default: dist.device()")
    a = p.parse_args()
    dist.init(backend=a.backend, device=a.device)
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
        result["gpt2_settings"] = {"model": a.model, "B": a.B, "T": a.T}
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
