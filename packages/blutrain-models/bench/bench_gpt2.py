"""GPT-2 124M training throughput: blutrain next to a nanoGPT-style PyTorch GPT-2, same GPU.

    python bench_gpt2.py [--json OUT.json] [--quick] [--compile] [-B 16] [-T 1024] [--steps 10]

One training step = forward, loss, backward, global-norm clipping (1.0), fused AdamW. Modes:
fp32 (TF32 off), tf32 (float32 with TF32 matmuls), bf16 (ours: bfloat16 compute with float32
master weights through the model's precision policy; torch: autocast bf16, float32 weights).
Each (framework, mode) runs in its own subprocess, so peaks and caching allocators never
interfere: tokens/s over --steps timed steps after --warmup untimed ones (host sync only at
the ends), peak memory from blutrain.alloc's stats (bt.cuda.max_memory_allocated) for ours and
torch.cuda.max_memory_allocated for torch. Rows: ours, torch eager, and with --compile
torch.compile (about a minute of compilation per mode). A budget (--budget-s) skips what would
not fit: the fp32 runs go last. Prints a table (tok/s, peak GiB, MFU, ratio to torch eager)
and writes JSON. Not a test: it never fails for being slow; a failing run is shown as an error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

# name -> (n_layer, n_head, n_embd); GPT-2 124M by default
MODELS = {"gpt2": (12, 12, 768), "tiny": (4, 4, 128), "gpt2-medium": (24, 16, 1024)}
V, VP = 50257, 50304  # GPT-2's vocabulary, padded to a multiple of 128 (nanoGPT: 64)
PEAK = {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12}  # H100/H200 SXM dense
RUN_ORDER = ("bf16", "tf32", "fp32")  # what matters most first, when the budget is short


def flops_per_token(L: int, C: int, T: int) -> float:
    n = L * (12 * C * C + 13 * C) + 2 * C + V * C + T * C
    return 6.0 * n + 12.0 * L * T * C


# -- workers (one per subprocess) ------------------------------------------------------------


def is_gpu_event(e: dict) -> bool:
    """A trace event of GPU work with a duration: a kernel, memcpy or memset."""
    return e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e


def profile_kernels(step, n: int, trace_path: str | None) -> tuple[list, dict]:
    """GPU time of each kernel name over n more steps, per step, largest first.

    torch.profiler's CUDA activity tracing (CUPTI) records every kernel of the process, ours
    included; the trace's kernel, memcpy and memset events are summed by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    path = trace_path or f"/tmp/bt-trace-{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    agg: dict = {}
    by_grid = os.environ.get("BT_PROFILE_GRID") == "1"  # split each kernel's rows by grid size
    chars = int(os.environ.get("BT_PROFILE_NAME_CHARS", "90"))  # template arguments: longer
    for e in events:
        if is_gpu_event(e):
            name = e["name"][:chars]
            if by_grid:
                name = f"{name[:70]} grid={e.get('args', {}).get('grid')}"
            t, c = agg.get(name, (0.0, 0))
            agg[name] = (t + e["dur"] / 1e3 / n, c + 1 / n)
    kernels = sorted(
        ([k, round(t, 4), round(c, 2)] for k, (t, c) in agg.items()), key=lambda r: -r[1]
    )
    return kernels, idle_between_kernels(events, n, chars)


def idle_between_kernels(events: list, n: int, chars: int) -> dict:
    """Where the GPU sits idle between the traced events of n steps, per step.

    Every gap between the end of the GPU work so far and the start of the next event counts
    (launch latency, a kernel's drain, host stalls), charged to the event that starts after it."""
    evs = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:chars]) for e in events if is_gpu_event(e)
    )
    if not evs:
        return {}
    idle: dict = {}
    end = evs[0][1]
    for start, stop, name in evs[1:]:
        if start > end:
            t, c = idle.get(name, (0.0, 0))
            idle[name] = (t + (start - end) / 1e3 / n, c + 1 / n)
        end = max(end, stop)
    top = sorted(([k, round(t, 4), round(c, 2)] for k, (t, c) in idle.items()), key=lambda r: -r[1])
    return {
        "span_ms": round((end - evs[0][0]) / 1e3 / n, 3),
        "idle_ms": round(sum(r[1] for r in top), 3),
        "events": round(len(evs) / n, 1),
        "idle_before": top[:12],
    }


def step_trend(gpu_ms: list) -> dict:
    """Summary of the GPU milliseconds between the events recorded after each timed step."""
    srt = sorted(gpu_ms)
    return {
        "min": round(srt[0], 3),
        "median": round(srt[len(srt) // 2], 3),
        "max": round(srt[-1], 3),
        "first": round(gpu_ms[0], 3),
        "last": round(gpu_ms[-1], 3),
        "all": [round(t, 3) for t in gpu_ms],
    }


def run_ours(a: argparse.Namespace, graph: bool = False) -> dict:
    """Our GPT-2 step; graph=True captures the whole step (forward, backward, clipping, AdamW)
    into one CUDA graph after the warm-up and times its replays: no Python or launch overhead,
    so eager vs graph shows how much of the eager step is host time."""
    import numpy as np

    import blutrain.tensor as bt
    from blutrain.models.bench import capture_step
    from blutrain.models.bench import synchronize as _cuda_sync
    from blutrain.models.config import GPT2Config
    from blutrain.models.device import peak_memory_bytes, resolve_recompute
    from blutrain.models.gpt2 import GPT2, gemm_autotune, set_matmul_precision
    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    bt.set_cast_cache_enabled(a.cast_cache == "on")
    L, H, C = MODELS[a.model]
    cfg = GPT2Config(block_size=max(1024, a.T), n_layer=L, n_head=H, n_embd=C, vocab_multiple=128)
    bt.cuda.reset_peak_memory_stats()
    bt.manual_seed(0)
    model = GPT2(
        cfg,
        device="cuda",
        precision=a.mode,
        recompute=resolve_recompute(a.recompute, "cuda", a.mode),
        residual_dtype=a.residual_dtype,
    )
    model.residual_grad_dtype = a.residual_grad_dtype
    model.classifier_chunk_size = a.classifier_chunk or None
    set_matmul_precision(a.mode)
    bt.set_float32_attention_precision(a.attention_precision)
    opt = AdamW(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    params = list(model.parameters())
    rng = np.random.default_rng(0)
    data = rng.integers(0, V, (a.B, a.T + 1))
    x = bt.tensor(data[:, :-1], device="cuda")
    y = bt.tensor(data[:, 1:], device="cuda")

    def step():
        with gemm_autotune(a.gemm_autotune == "on", "cuda"):  # as the trainer: step 1 tunes
            loss = model(x, y, return_logits=False)[1]  # head + loss in chunks: no whole logits
            loss.backward()
        _, coef = grad_norm_and_clip_coef(params, 1.0)  # no host sync
        opt.step(grad_scale=coef)
        opt.zero_grad()
        return loss

    first = float(step().item())
    # a graph's first (untimed) replay is its last warm-up step: as many updates as eager, so the
    # two rows' final losses agree within the run-to-run spread of the (nondeterministic)
    # dQ-atomic attention backward: ~0.02 after 13 steps (two eager runs: 9.259, 9.273)
    eager_warmups = a.warmup - 1 - (1 if graph and a.warmup > 1 else 0)
    for _ in range(eager_warmups):
        step()
    _cuda_sync("cuda")
    run = step
    if graph:  # each replay is the next optimizer step, as the trainer's
        run = capture_step(opt, step)
        run()
        _cuda_sync("cuda")
    # An event after each step: the GPU's time per step, to set beside the host's (a gap
    # between the two is idle GPU time; a rising trend is the clocks dropping under load).
    events = [bt.cuda.Event() for _ in range(a.steps + 1)]
    t0 = time.perf_counter()
    events[0].record()
    for i in range(a.steps):
        loss = run()
        events[i + 1].record()
    last = float(loss.item())
    _cuda_sync("cuda")
    dt = time.perf_counter() - t0
    peak = peak_memory_bytes("cuda")
    gpu_ms = [events[i].elapsed_time(events[i + 1]) for i in range(a.steps)]
    out = {
        "tokens_per_s": a.B * a.T * a.steps / dt,
        "peak_bytes": peak,
        "step_ms": 1e3 * dt / a.steps,
        "first_loss": first,
        "last_loss": last,
        "recompute": model.recompute,
    }
    out["gpu_step_ms"] = step_trend(gpu_ms)
    # GEMMs cuBLASLt had no fused epilogue for (run as GEMM + our epilogue kernel)
    import blutrain.linalg as la

    out["gemm_fallbacks"] = int(la.get_option("fallback_epilogues"))
    if a.profile:
        out["kernels"], out["idle"] = profile_kernels(run, 2, a.trace)
    return out


def run_torch(a: argparse.Namespace, compile_: bool) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    L, H, C = MODELS[a.model]
    tf32 = a.mode != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(C), Attn()
            self.ln_2 = nn.LayerNorm(C)
            self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VP, C), nn.Embedding(max(1024, a.T), C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, VP, bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * L))
                elif p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = GPT().cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        fused=True,
    )
    fwd = torch.compile(model) if compile_ else model
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, V, (a.B, a.T + 1), generator=g).cuda()
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=a.mode == "bf16"):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = float(step().item())
    for _ in range(a.warmup - 1):
        step()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
    t0 = time.perf_counter()
    events[0].record()
    for i in range(a.steps):
        loss = step()
        events[i + 1].record()
    last = float(loss.item())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {
        "tokens_per_s": a.B * a.T * a.steps / dt,
        "peak_bytes": int(torch.cuda.max_memory_allocated()),
        "step_ms": 1e3 * dt / a.steps,
        "first_loss": first,
        "last_loss": last,
        "gpu_step_ms": step_trend([events[i].elapsed_time(events[i + 1]) for i in range(a.steps)]),
    }
    if a.profile:
        out["kernels"], out["idle"] = profile_kernels(step, 2, a.trace)
    return out


def worker(a: argparse.Namespace) -> int:
    try:
        if a.worker in ("ours", "ours+graph"):
            r = run_ours(a, graph=a.worker == "ours+graph")
        else:
            r = run_torch(a, compile_=a.worker == "torch.compile")
    except Exception as e:  # noqa: BLE001 - reported as the row's error
        import traceback

        traceback.print_exc()
        r = {"error": f"{type(e).__name__}: {e}"[:300]}
    print("RESULT " + json.dumps(r), flush=True)
    return 0


# -- driver ----------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="B=4 T=512, 4 timed steps")
    p.add_argument("--compile", action="store_true", help="also torch.compile (~1 min a mode)")
    p.add_argument("-B", "--batch-size", dest="B", type=int, default=16)
    p.add_argument("-T", "--seq-len", dest="T", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    p.add_argument("--modes", default="fp32,tf32,bf16")
    p.add_argument(
        "--frameworks",
        default="ours,ours+graph,torch",
        help="ours, ours+graph (the step replayed as one CUDA graph), torch (--compile adds "
        "torch.compile)",
    )
    p.add_argument(
        "--recompute",
        default="auto",
        help="ours: auto (the trainer's: ln in fp32, else none), none, gelu, ln, attn, "
        "block or ln+gelu",
    )
    p.add_argument(
        "--classifier-chunk",
        type=int,
        default=0,
        help="ours: rows per chunk of the fused classifier (0: its default, <= 512 MiB of logits)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting runs after this (default 140, 230 with --compile)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print the N kernels with the most GPU time per step of each run (torch.profiler)",
    )
    p.add_argument(
        "--cast-cache",
        default="on",
        choices=["on", "off"],
        help="ours: keep the weights' 16-bit casts between steps (bt.cached_astype) or cast "
        "every step",
    )
    p.add_argument(
        "--residual-dtype",
        default="float32",
        choices=["float32", "compute"],
        help="ours: the residual stream's dtype under bf16 (GPT2.residual_dtype): float32 (the "
        "model's default, as autocast) or compute (bf16, the opt-in faster stream that trains "
        "off the fp32 trajectory)",
    )
    p.add_argument(
        "--residual-grad-dtype",
        default="compute",
        choices=["compute", "float32"],
        help="ours: the float32 stream's gradient dtype on the fused path (GPT2."
        "residual_grad_dtype): compute (bf16, the default) or float32 (autocast's; more bytes)",
    )
    p.add_argument(
        "--attention-precision",
        default="matmul",
        choices=["matmul", "scores", "highest"],
        help="ours: the float32 attention's precision (bt.set_float32_attention_precision): "
        "matmul (follow the mode: TF32 under tf32), scores (its scores Q K^T in 3xTF32) or "
        "highest (3xTF32, as PyTorch's float32 SDPA)",
    )
    p.add_argument(
        "--gemm-autotune",
        default="on",
        choices=["on", "off"],
        help="ours: time cuBLASLt's algorithms per GEMM shape in the warm-up (the trainer's "
        "default) or take its heuristic's first choice",
    )
    p.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.B, a.T, a.steps, a.warmup = min(a.B, 4), min(a.T, 512), 4, 2
    a.warmup = max(1, a.warmup)
    if a.worker:
        return worker(a)

    budget = a.budget_s or (230.0 if a.compile else 140.0)
    modes = [m for m in RUN_ORDER if m in a.modes.split(",")]
    fws = [f for f in a.frameworks.split(",") if f in ("ours", "ours+graph", "torch")]
    if a.compile:
        fws.append("torch.compile")
    L, H, C = MODELS[a.model]
    fpt = flops_per_token(L, C, a.T)
    t_start = time.perf_counter()
    rows = []
    for mode in modes:
        for fw in fws:
            left = budget - (time.perf_counter() - t_start)
            row = {"mode": mode, "framework": fw, "B": a.B, "T": a.T, "steps": a.steps}
            if left < 15:
                row["error"] = "skipped: over the time budget"
                rows.append(row)
                continue
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                fw,
                "--mode",
                mode,
                "-B",
                str(a.B),
                "-T",
                str(a.T),
                "--steps",
                str(a.steps),
                "--warmup",
                str(a.warmup),
                "--model",
                a.model,
                "--recompute",
                a.recompute,
                "--classifier-chunk",
                str(a.classifier_chunk),
                "--profile",
                str(a.profile),
                "--cast-cache",
                a.cast_cache,
                "--gemm-autotune",
                a.gemm_autotune,
                "--residual-dtype",
                a.residual_dtype,
                "--residual-grad-dtype",
                a.residual_grad_dtype,
                "--attention-precision",
                a.attention_precision,
            ]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=max(30.0, min(left, 150.0))
                )
                res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                r = (
                    json.loads(res[-1][7:])
                    if res
                    else {"error": f"exit {proc.returncode}: " + proc.stderr.strip()[-300:]}
                )
                if "error" in r:
                    r["stderr_tail"] = proc.stderr.strip()[-1500:]
            except subprocess.TimeoutExpired:
                r = {"error": "timed out"}
            row.update(r)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            if "tokens_per_s" in row:
                row["mfu"] = row["tokens_per_s"] * fpt / PEAK[mode]
            rows.append(row)
            status = f"{row['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in row else row["error"]
            print(
                f"  {mode:5s} {fw:14s} {status}  ({row['wall_s']} s)", file=sys.stderr, flush=True
            )
    base = {r["mode"]: r.get("tokens_per_s") for r in rows if r["framework"] == "torch"}
    for r in rows:
        if r.get("tokens_per_s") and base.get(r["mode"]):
            r["ratio_to_torch_eager"] = r["tokens_per_s"] / base[r["mode"]]

    order = {m: i for i, m in enumerate(("fp32", "tf32", "bf16"))}
    rows.sort(key=lambda r: (order[r["mode"]], fws.index(r["framework"])))
    print(
        f"GPT-2 {a.model} training step (fwd+bwd+clip+AdamW), B={a.B} T={a.T}, "
        f"{a.steps} timed steps after {a.warmup}; ratio: tok/s over torch eager's"
    )
    print(
        f"{'mode':5s}  {'framework':14s} {'tok/s':>11s} {'step ms':>8s} {'peak GiB':>9s} "
        f"{'MFU':>6s} {'ratio':>6s}  loss"
    )
    for r in rows:
        if "tokens_per_s" in r:
            print(
                f"{r['mode']:5s}  {r['framework']:14s} {r['tokens_per_s']:11,.0f} "
                f"{r['step_ms']:8.1f} {r['peak_bytes'] / 2**30:9.2f} {100 * r['mfu']:5.1f}% "
                f"{r.get('ratio_to_torch_eager', float('nan')):6.2f}  "
                f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"
                + (f"  recompute {r['recompute']}" if r.get("recompute", "none") != "none" else "")
            )
        else:
            print(f"{r['mode']:5s}  {r['framework']:14s} {r['error']}")
    # GPU time per step (CUDA events): a rise from the first timed step to the last is the
    # clocks dropping under sustained load, not host time
    trend = [r for r in rows if r.get("gpu_step_ms")]
    if trend:
        print("GPU ms a step (first / median / last timed step):")
        for r in trend:
            g = r["gpu_step_ms"]
            print(
                f"  {r['mode']:5s}  {r['framework']:14s} {g['first']:.2f} / {g['median']:.2f} / "
                f"{g['last']:.2f}"
            )
    if a.profile:
        for r in rows:
            if not r.get("kernels"):
                continue
            tot = sum(k[1] for k in r["kernels"])
            head = f"{r['mode']} {r['framework']}: GPU busy {tot:.1f} ms"
            print(f"\n{head} of {r['step_ms']:.1f} ms a step")
            for name, ms, cnt in r["kernels"][: a.profile]:
                print(f"  {ms:8.3f} ms {cnt:6.1f}x  {name}")
            idle = r.get("idle") or {}
            if idle:
                print(
                    f"  idle between GPU events: {idle['idle_ms']:.3f} ms of a "
                    f"{idle['span_ms']:.3f} ms span a step, {idle['events']:.0f} events; "
                    "most before:"
                )
                for name, ms, cnt in idle["idle_before"]:
                    print(f"  {ms:8.3f} ms {cnt:6.1f}x  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "bench": "gpt2",
                    "model": a.model,
                    "B": a.B,
                    "T": a.T,
                    "steps": a.steps,
                    "warmup": a.warmup,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
