"""`blutrain bench`: tokens/s and peak memory of N training steps of GPT-2 on random tokens.

    from blutrain.models.bench import bench
    bench("gpt2", batch_size=16, seq_len=1024, steps=10, precision="bf16", cuda_graph=True)

The step is the trainer's (forward, loss, backward, clipping, AdamW with no host sync); on a
GPU the timed steps are queued without syncs (one at the end), as the trainer queues them.
bench/bench_gpt2.py puts these figures next to PyTorch's from the same run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .config import LlamaConfig, model_config
from .device import (
    flops_per_token,
    is_cuda,
    peak_flops,
    peak_memory_bytes,
    resolve_device,
    resolve_precision,
    resolve_recompute,
)


def capture_step(opt: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """Captures `step()` (a whole training step ending in `opt.step()`) as one CUDA graph and
    returns `run()`: each call replays it as the next optimizer step and returns the captured
    step's outputs (overwritten by the next replay). AdamW reads lr and the step count from
    device scalars (Note [AdamW in a CUDA graph] in optim.py): the capture counts the first
    replay's step on the host, and every later replay first advances the host counts and writes
    the new step to the device. The trainer's CudaGraphStep does the same with its batches
    copied in (Note [the step as a CUDA graph] in steps/cuda_graph.py)."""
    from ._tensor import bt

    opt.use_device_scalars()  # writes this step's lr and count
    bt.cuda.empty_cache()  # the eager steps' cached blocks: the graph gets its own pool
    graph = bt.cuda.CUDAGraph()
    with bt.cuda.graph(graph):  # records the step; its host-side counts advance here
        outputs = step()
    replays = 0

    def run() -> Any:
        nonlocal replays
        if replays:
            opt.advance_steps()
            opt.write_device_scalars(opt.lr, opt.common_step())
        replays += 1
        graph.replay()
        return outputs

    return run


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if is_cuda(device):
        from ._tensor import bt

        bt.cuda.synchronize(device)


def bench(
    model: str = "tiny",
    batch_size: int = 8,
    seq_len: int = 128,
    steps: int = 10,
    warmup: int = 2,
    device: str = "auto",
    vocab_multiple: int = 128,
    seed: int = 0,
    precision: str = "auto",
    recompute: str = "auto",
    gemm_autotune: bool = True,
    cuda_graph: bool = False,
    residual_dtype: str = "float32",
) -> dict:
    """tokens/s and peak memory of `steps` training steps (forward, backward, clipping, AdamW)
    on one fixed batch of random tokens, after `warmup` untimed steps. On a GPU the timed steps
    run without host syncs (one at the end), as the trainer's; the peak memory is
    blutrain.tensor's allocator's (bt.cuda.max_memory_allocated) over warm-up and timed steps.
    cuda_graph (CUDA only): the whole step is captured once after the warm-up and the timed
    steps replay it, as the trainer's cuda-graph step does. residual_dtype: GPT-2's residual
    stream under bf16 (GPT2.residual_dtype: "float32", or the faster "compute"); a LLaMA model
    takes the default only."""
    for name, v, lo in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("steps", steps, 1),
                        ("warmup", warmup, 0)):  # fmt: skip
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"[bench] {name} must be an int >= {lo}, got {v!r}")
    from ._tensor import bt
    from .gpt2 import GPT2, set_matmul_precision
    from .gpt2 import gemm_autotune as tuned_gemms
    from .llama import Llama
    from .optim import AdamW, grad_norm_and_clip_coef

    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    cfg = model_config(model, vocab_multiple)
    if seq_len > cfg.block_size:
        raise ValueError(
            f"[bench] seq_len {seq_len} is longer than the model's block size {cfg.block_size}"
        )
    if cuda_graph and not is_cuda(dev):
        raise ValueError(f"[bench] cuda_graph needs a CUDA device, not {dev} (drop --cuda-graph)")
    bt.manual_seed(seed)
    if is_cuda(dev):
        bt.cuda.reset_peak_memory_stats(dev)
    if isinstance(cfg, LlamaConfig):
        if residual_dtype != "float32":
            raise ValueError(
                f"[bench] residual_dtype {residual_dtype!r}: GPT-2 models only (a LLaMA model "
                "keeps its residual stream in the compute dtype); drop it for a LLaMA model"
            )
        recompute = "none" if recompute == "auto" else recompute
        m = Llama(cfg, device=dev, precision=prec, recompute=recompute)
    else:
        recompute = resolve_recompute(recompute, dev, prec)
        m = GPT2(
            cfg, device=dev, precision=prec, recompute=recompute, residual_dtype=residual_dtype
        )
    set_matmul_precision(prec)
    opt = AdamW(m.named_parameters(), lr=1e-4)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, cfg.vocab_size, (batch_size, seq_len + 1))
    x = bt.tensor(data[:, :-1], device=dev)
    y = bt.tensor(data[:, 1:], device=dev)
    params = list(m.parameters())

    def step() -> Any:
        with tuned_gemms(gemm_autotune, dev):  # as the trainer: the first warm-up step tunes
            loss = m(x, y, return_logits=False)[1]  # the head + loss in chunks (no whole logits)
            loss.backward()
        _, coef = grad_norm_and_clip_coef(params, 1.0)  # no host sync
        opt.step(grad_scale=coef)
        opt.zero_grad()
        return loss

    for _ in range(warmup):
        float(step().item())
    synchronize(dev)
    run = step
    if cuda_graph:
        run = capture_step(opt, step)
        float(run().item())  # the first replay (untimed), checked for errors
    times = []
    t_all = time.perf_counter()
    loss = None
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = run()
        if not is_cuda(dev):
            times.append(time.perf_counter() - t0)
    last_loss = float(loss.item()) if loss is not None else math.nan  # the one sync
    synchronize(dev)
    total = time.perf_counter() - t_all
    if is_cuda(dev) or not times:
        times = [total / max(1, steps)] * steps
    tok = batch_size * seq_len
    tps = tok * steps / total if total > 0 else float("inf")
    peak = peak_flops(dev, prec)
    return {
        "model": model,
        "n_params": cfg.n_params(),
        "device": dev,
        "precision": prec,
        "recompute": recompute,
        "residual_dtype": getattr(m, "residual_dtype", None),
        "cuda_graph": cuda_graph,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "step_ms_median": 1e3 * float(np.median(times)),
        "tokens_per_s": tps,
        "peak_mem_bytes": peak_memory_bytes(dev),
        "mfu": (tps * flops_per_token(cfg, seq_len) / peak) if peak else None,
        "loss": last_loss,
    }
