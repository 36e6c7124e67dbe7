"""The seed's headline run, PyTorch's side and the scoring (multi_gpu.py's `headline` part runs
ours through `blutrain train --dist ddp` between these):

    python headline.py init --model gpt2 --out H/init                # one process, the CPU
    mpirun -n 8 blutrain train --dist ddp --precision fp32 --init-from H/init --data H/train ...
    mpirun -n 8 python headline.py torch --init H/init --data H/train --out H/torch ...
    python headline.py eval --init H/init --ours H/ours --torch H/torch/final --val VAL.bin ...

- init: our GPT-2 initialization (bt.manual_seed(seed)), written once as a Hugging Face
  directory: both sides load these bits (ours with --init-from), so they start identical.
- torch: PyTorch DistributedDataParallel over bench/torch_gpt2.py's functional GPT-2 (blutrain-
  models' convergence reference), fused AdamW, clip_grad_norm_, fp32 (no TF32). Every rank reads
  its rows of every global batch from our DataLoader built as the trainer builds its own (same
  shards, seed, rank slicing, step_rows), and the learning rate of every step from our
  CosineSchedule: the token streams and hyper-parameters are the trainer's. Batches go up
  through pinned memory without a host sync, losses are read back once at the end, as the
  trainer queues its steps. Rank and port come from MPI (mpi4py), so nothing of ours is on the
  GPU of this process. Writes <out>/result.json (rank 0) and <out>/final (the last weights).
- eval: the validation loss over the whole val split (every (T+1)-token window of each shard and
  the shorter tail), summed over tokens in float64: of the initial weights in both frameworks
  (the two evaluators must agree), of ours' last checkpoint in ours and of PyTorch's last weights
  in PyTorch. One process, one device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "blutrain-models" / "bench"))  # torch_gpt2

for _k, _v in (  # NVLink multicast stays off, even when started by hand
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)


# ---- init ------------------------------------------------------------------------------------
def cmd_init(a: argparse.Namespace) -> int:
    import blutrain.tensor as bt
    from blutrain.models import save_hf
    from blutrain.models.config import model_config
    from blutrain.models.gpt2 import GPT2

    cfg = model_config(a.model, 1)  # the Hugging Face directory holds the unpadded vocabulary
    bt.manual_seed(a.seed)
    save_hf(a.out, GPT2(cfg, device="cpu").state_dict(), cfg)
    print(f"[headline] initial weights of {a.model} (seed {a.seed}) in {a.out}")
    return 0


# ---- torch DDP -------------------------------------------------------------------------------
def _mpi() -> tuple[Any, int, int, int]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return comm, comm.Get_rank(), comm.Get_size(), local


def cmd_torch(a: argparse.Namespace) -> int:
    """One rank of the PyTorch DDP run. An error on any rank prints "rank N: ..." and ends the
    whole job at once (MPI_Abort): the other ranks never wait out a collective's timeout."""
    import faulthandler

    from mpi4py import MPI

    faulthandler.enable()  # a rank that aborts (SIGABRT) prints its Python stack
    comm, rank, _, _ = _mpi()
    print(f"[headline] torch rank {rank}: pid {os.getpid()}", flush=True)
    try:
        rc = _torch_ddp(a)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        print(f"[headline] torch rank {rank}: error: {type(e).__name__}: {e}", flush=True)
        comm.Abort(1)
        return 1
    # A finished rank leaves without exit-time destructors: once in CI a rank aborted after the
    # run ("terminate called without an active exception", a C++ thread object torch or gloo
    # still held when static destructors ran). MPI is finalised first, so mpiexec sees a clean end.
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(rc)


def _torch_ddp(a: argparse.Namespace) -> int:
    import socket

    import torch
    import torch.distributed as tdist
    from torch_gpt2 import decay_groups, torch_loss, torch_params

    from blutrain.models import DataLoader, load_hf
    from blutrain.models.schedule import CosineSchedule

    comm, rank, world, local = _mpi()
    cuda = a.device == "cuda"
    dev = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as ours: no TF32 anywhere
    torch.backends.cudnn.allow_tf32 = False
    port = 0
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    addr = socket.gethostbyname(socket.gethostname()) if world > 1 else "127.0.0.1"
    addr, port = comm.bcast((addr, port), root=0)
    tdist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=a.timeout),
    )

    cfg, weights = load_hf(a.init, vocab_multiple=a.vocab_multiple)
    names = list(weights)

    class FunctionalGPT2(torch.nn.Module):
        """torch_gpt2's functional model as a Module, so DDP can own its parameters."""

        def __init__(self, init: dict[str, np.ndarray]) -> None:
            super().__init__()
            self.ws = torch.nn.ParameterList(torch_params(init, str(dev)).values())

        def forward(self, x: Any, y: Any) -> Any:
            return torch_loss(dict(zip(names, self.ws, strict=True)), cfg, x, y)

    model = FunctionalGPT2(weights)
    del weights
    ddp = torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[dev.index] if cuda else None,
        gradient_as_bucket_view=True,  # PyTorch's faster setting
    )
    named = dict(zip(names, model.ws, strict=True))
    kw: dict[str, Any] = dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    try:
        opt = torch.optim.AdamW(decay_groups(named, a.weight_decay), fused=True, **kw)
    except (RuntimeError, ValueError):  # a build without the fused kernel for this device
        opt = torch.optim.AdamW(decay_groups(named, a.weight_decay), foreach=True, **kw)
    schedule = CosineSchedule(a.lr, a.warmup_steps, a.steps, a.min_lr)
    # the trainer's loader, argument for argument (trainer.Trainer._loaders)
    loader = DataLoader(
        a.data,
        a.batch_size,
        a.seq_len,
        split="train",
        seed=a.seed,
        vocab_size=cfg.vocab_size,
        rank=rank,
        world_size=world,
        step_rows=world * a.batch_size,
    )
    crc = 0

    def batch() -> tuple[Any, Any]:
        nonlocal crc
        x, y = loader.next_batch()
        crc = zlib.crc32(x.tobytes(), crc)
        xy = torch.from_numpy(np.stack([x, y]))
        if cuda:
            xy = xy.pin_memory().to(dev, non_blocking=True)
        return xy[0], xy[1]

    die = os.environ.get("BLUTRAIN_HEADLINE_KILL", "")  # "RANK:STEP": that rank dies there
    die_rank, _, die_step = die.partition(":")

    def step(s: int) -> tuple[Any, Any]:
        if die and rank == int(die_rank) and s == int(die_step):
            os.kill(os.getpid(), 9)  # as the OOM killer would (the fault test's rank death)
        x, y = batch()
        loss = ddp(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        for g in opt.param_groups:
            g["lr"] = schedule(s)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), norm.detach()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    out: list[tuple[Any, Any]] = []
    tdist.barrier()
    t0 = time.perf_counter()
    out.append(step(0))  # the first step pays one-off costs (kernel choices, DDP's buckets)
    sync()
    t1 = time.perf_counter()
    for s in range(1, a.steps):
        out.append(step(s))
    sync()
    t2 = time.perf_counter()
    # every rank's losses (the global batch's mean, as the trainer logs it) and the norm
    losses = torch.stack([lo for lo, _ in out]).double()
    tdist.all_reduce(losses)
    losses /= world
    norms = torch.stack([n for _, n in out]).double().cpu().tolist()
    peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else _rss_peak()
    per_rank = comm.gather({"rank": rank, "peak_bytes": peak, "crc": crc}, root=0)
    tokens = a.batch_size * a.seq_len * world
    if rank == 0:
        final = {n: p.detach().cpu().numpy() for n, p in named.items()}
        from blutrain.models import save_hf

        save_hf(Path(a.out) / "final", final, cfg)
        result = {
            "steps": a.steps,
            "world_size": world,
            "losses": losses.cpu().tolist(),
            "grad_norms": norms,
            "first_step_s": t1 - t0,
            "tokens_per_s": tokens * (a.steps - 1) / (t2 - t1) if a.steps > 1 else None,
            "tokens_per_s_all_steps": tokens * a.steps / (t2 - t0),
            "peak_bytes": max(r["peak_bytes"] for r in per_rank),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
            "peak_from": "torch.cuda.max_memory_allocated" if cuda else "peak RSS",
            "token_crc_per_rank": [r["crc"] for r in per_rank],
            "torch": torch.__version__,
        }
        (Path(a.out) / "result.json").write_text(json.dumps(result, indent=1))
        print(
            f"[headline] torch DDP: {a.steps} steps on {world} ranks, loss "
            f"{result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, "
            f"{result['tokens_per_s'] or 0:,.0f} tok/s, peak {result['peak_bytes'] / 2**30:.2f} GiB"
        )
    tdist.barrier()
    tdist.destroy_process_group()
    return 0


def _rss_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- eval ------------------------------------------------------------------------------------
def val_windows(files: list[str], T: int) -> list[np.ndarray]:
    """Every token of the val split as (T+1)-token windows (consecutive, one shared token), the
    last one of each shard shorter: each window predicts len - 1 tokens."""
    from blutrain.models import load_shard

    out = []
    for f in files:
        toks = np.asarray(load_shard(f), dtype=np.int64)
        for lo in range(0, len(toks) - 1, T):
            out.append(toks[lo : lo + T + 1])
    return out


def batches(windows: list[np.ndarray], B: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(x, y) batches of up to B windows of one length."""
    by_len: dict[int, list[np.ndarray]] = {}
    for w in windows:
        by_len.setdefault(len(w), []).append(w)
    out = []
    for ws in by_len.values():
        for i in range(0, len(ws), B):
            m = np.stack(ws[i : i + B])
            out.append((m[:, :-1], m[:, 1:]))
    return out


def val_ours(model: Any, bs: list, device: str) -> float:
    import blutrain.tensor as bt

    total, count = 0.0, 0
    model.eval()
    with bt.no_grad():
        for x, y in bs:
            loss = model(bt.tensor(x, device=device), bt.tensor(y, device=device),
                         return_logits=False)[1]  # fmt: skip
            total += float(loss.float().item()) * y.size
            count += y.size
    return total / count


def val_torch(weights: dict[str, np.ndarray], cfg: Any, bs: list, device: str) -> float:
    import torch
    from torch_gpt2 import torch_loss, torch_params

    torch.backends.cuda.matmul.allow_tf32 = False
    params = torch_params(weights, device)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in bs:
            xt, yt = (torch.from_numpy(np.ascontiguousarray(v)).to(device) for v in (x, y))
            total += float(torch_loss(params, cfg, xt, yt).item()) * y.size
            count += y.size
    return total / count


def cmd_eval(a: argparse.Namespace) -> int:
    from blutrain.models import load_hf
    from blutrain.models.gpt2 import GPT2, set_matmul_precision

    dev = a.device
    set_matmul_precision("fp32")
    bs = batches(val_windows(a.val, a.seq_len), a.batch_size)
    res: dict[str, Any] = {"val_tokens": int(sum(y.size for _, y in bs)), "val_files": a.val}
    cfg, init = load_hf(a.init, vocab_multiple=a.vocab_multiple)
    ours = GPT2.from_pretrained(a.init, vocab_multiple=a.vocab_multiple, device=dev)
    ours.set_precision("fp32")
    res["val_init_ours"] = val_ours(ours, bs, dev)
    res["val_init_torch"] = val_torch(init, cfg, bs, dev)
    del ours, init
    if a.ours:
        try:
            ours = GPT2.from_checkpoint(a.ours, device=dev)
            ours.set_precision("fp32")
            res["val_ours"] = val_ours(ours, bs, dev)
        except (OSError, ValueError) as e:
            res["ours_error"] = str(e)
    if a.torch:
        try:
            tcfg, tw = load_hf(a.torch, vocab_multiple=a.vocab_multiple)
            res["val_torch"] = val_torch(tw, tcfg, bs, dev)
        except (OSError, ValueError) as e:
            res["torch_error"] = str(e)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"[headline] eval: {json.dumps(res)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("init", help="write the shared initial weights")
    pi.add_argument("--model", default="gpt2", help="GPT2Config preset or JSON file")
    pi.add_argument("--seed", type=int, default=1337)
    pi.add_argument("--out", required=True)
    pt = sub.add_parser("torch", help="PyTorch DDP training, one process per rank (MPI)")
    pe = sub.add_parser("eval", help="the whole val split's loss of every side")
    for q in (pt, pe):
        q.add_argument("--init", required=True, help="the init command's directory")
        q.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
        q.add_argument("--seq-len", type=int, default=1024)
        q.add_argument("--vocab-multiple", type=int, default=128)
    pt.add_argument("--data", required=True, help="the shard directory the trainer reads")
    pt.add_argument("--out", required=True)
    pt.add_argument("--batch-size", type=int, default=16)
    pt.add_argument("--steps", type=int, required=True)
    pt.add_argument("--warmup-steps", type=int, required=True)
    pt.add_argument("--lr", type=float, default=6e-4)
    pt.add_argument("--min-lr", type=float, default=None, help="default lr / 10, as the trainer")
    pt.add_argument("--weight-decay", type=float, default=0.1)
    pt.add_argument("--grad-clip", type=float, default=1.0)
    pt.add_argument("--seed", type=int, default=1337)
    pt.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    pe.add_argument("--ours", help="ours' run directory (its checkpoint/)")
    pe.add_argument("--torch", help="PyTorch's last weights (torch's <out>/final)")
    pe.add_argument("--val", nargs="+", required=True, help="the val split's shards")
    pe.add_argument("--batch-size", type=int, default=8)
    pe.add_argument("--json", required=True)
    a = p.parse_args()
    return {"init": cmd_init, "torch": cmd_torch, "eval": cmd_eval}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
