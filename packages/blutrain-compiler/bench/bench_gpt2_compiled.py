"""GPT-2 training step compiled by blutrain-compiler, next to our eager step and PyTorch's.

    python bench_gpt2_compiled.py [--device cuda|cpu] [--model gpt2|tiny] [-B 8] [-T 1024]
                                  [--mode tf32|fp32] [--steps 10] [--warmup 3] [--json OUT.json]

One step = forward, loss, backward, global-norm clipping (1.0), AdamW: the step of
tests/test_compiler_models.py (and of `blutrain train --compile`). Rows, each in its own
subprocess (no shared allocator or compile state): ours eager, ours compiled (the first call
captures and compiles: counted in warmup_s, not in tok/s), torch eager and torch.compile (the
nanoGPT-style model of blutrain-models/bench/bench_gpt2.py; GPU only). Peak memory is each
allocator's own statistic: blutrain.alloc's peak (bt.cuda.max_memory_allocated; on the CPU
blutrain.alloc's requested-bytes peak) over the timed steps (the steady state: the compiled
row's capture and compilation excluded), and torch.cuda.max_memory_allocated. The compiled row
also prints its planned arena (program.stats.planned_bytes), its program's shape, and the
allocator calls a timed step makes: none from the program (the embedding gathers write planned
buffers, also on CUDA through index_select's out=; the returned loss and norm take turns in two
buffers: Note [returned buffers] in program.py), and none from AdamW.write_device_scalars
(Note [scalars written in place] in blutrain-models' optim.py: fill_ with a number writes in
place on every device).
Not a test: prints a table and writes JSON; a row that fails shows its error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS_BENCH = os.path.join(HERE, "..", "..", "blutrain-models", "bench")
MODELS = {"gpt2": (12, 12, 768), "tiny": (4, 4, 128)}  # name -> (n_layer, n_head, n_embd)
V = 50257


def build_step(model: str, B: int, T: int, dev: str, mode: str):
    """GPT-2 `model` on `dev` (its numpy loss off: bt.cross_entropy is the op a capture records),
    AdamW with device scalars, one fixed batch: (step, opt, x, y); step(x, y) runs forward,
    loss, backward, clipping at 1.0 and AdamW, and returns (loss, norm). Also
    profile_gpt2_step.py's step."""
    import numpy as np

    import blutrain.tensor as bt
    from blutrain.models.config import GPT2Config
    from blutrain.models.gpt2 import GPT2, set_matmul_precision
    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    L, H, C = MODELS[model]
    cfg = GPT2Config(block_size=max(1024, T), n_layer=L, n_head=H, n_embd=C, vocab_multiple=128)
    bt.manual_seed(0)
    net = GPT2(cfg, device=dev)
    net.numpy_loss = False
    set_matmul_precision(mode)
    opt = AdamW(net.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    opt.use_device_scalars(True)
    params = list(net.parameters())

    def step(x, y):
        loss = net(x, y, return_logits=False)[1]
        loss.backward()
        norm, coef = grad_norm_and_clip_coef(params, 1.0)
        opt.step(grad_scale=coef)
        opt.zero_grad(set_to_none=True)
        return loss, norm

    data = np.random.default_rng(0).integers(0, V, (B, T + 1))
    x = bt.tensor(data[:, :-1], device=dev)
    y = bt.tensor(data[:, 1:], device=dev)
    return step, opt, x, y


def run_ours(a: argparse.Namespace, compiled: bool) -> dict:
    import blutrain.alloc as A
    import blutrain.tensor as bt

    dev = a.device
    gpu = dev.startswith("cuda")
    step, opt, x, y = build_step(a.model, a.B, a.T, dev, a.mode)

    def sync() -> None:
        if gpu:
            bt.cuda.synchronize()

    def alloc_stats() -> dict:
        return A.stats("cuda:0" if gpu else "cpu")

    k = 0

    def one(fn):
        nonlocal k
        k += 1
        opt.write_device_scalars(3e-4, k)
        before = len(fn.programs) if compiled and fn is not step else None
        out = fn(x, y)
        if before is not None and len(fn.programs) == before:
            opt.advance_steps()  # a program run: no Python advanced the host step counts
        return out

    one(step)  # eager: AdamW's moments exist (program inputs), GEMMs tuned
    run = step
    planned = None
    t0 = time.perf_counter()
    if compiled:
        import blutrain.compiler as btc

        run = btc.compile(step)
    for _ in range(a.warmup - 1):
        loss, _ = one(run)
    first = float(loss.item())
    sync()
    warm = time.perf_counter() - t0
    if compiled:
        (prog,) = [c.prog for c in run.programs.values()]
        planned = prog.stats.planned_bytes
        st = prog.stats
        shape = {
            k: getattr(st, k)
            for k in (
                "nodes",
                "groups",
                "library_calls",
                "eager_steps",
                "fallbacks",
                "compile_s",
                "cache",
            )
        }
    if gpu:
        bt.cuda.reset_peak_memory_stats()
    else:
        A.reset_peak_stats("cpu")
    s0 = alloc_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss, _ = one(run)
    sync()
    dt = time.perf_counter() - t0
    s1 = alloc_stats()
    out = {
        "tokens_per_s": a.B * a.T * a.steps / dt,
        "step_ms": 1e3 * dt / a.steps,
        "warmup_s": warm,
        "first_loss": first,
        "last_loss": float(loss.item()),
        "alloc_calls_per_step": {
            k: (s1[k] - s0[k]) / a.steps for k in ("alloc_count", "system_alloc_count")
        },
    }
    if gpu:
        out["peak_bytes"] = int(bt.cuda.max_memory_allocated())
    else:
        out["peak_bytes"] = int(s1.get("requested_bytes_peak", 0))
    if planned is not None:
        out["planned_bytes"] = int(planned)
        out["recompiles"] = len(run.recompiles)
        out["program"] = shape
    return out


def run_torch(a: argparse.Namespace, compile_: bool) -> dict:
    sys.path.insert(0, MODELS_BENCH)
    import bench_gpt2 as G

    ns = argparse.Namespace(
        model=a.model,
        mode=a.mode,
        B=a.B,
        T=a.T,
        steps=a.steps,
        warmup=a.warmup,
        profile=0,
        trace=None,
    )
    return G.run_torch(ns, compile_)


def worker(a: argparse.Namespace) -> None:
    try:
        if a.worker.startswith("ours"):
            r = run_ours(a, compiled=a.worker == "ours compiled")
        else:
            r = run_torch(a, compile_=a.worker == "torch.compile")
    except Exception as e:  # noqa: BLE001 - the row's error
        import traceback

        traceback.print_exc()
        r = {"error": f"{type(e).__name__}: {e}"[:400]}
    print("RESULT " + json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default=None, choices=sorted(MODELS))
    ap.add_argument("-B", type=int, default=None)
    ap.add_argument("-T", type=int, default=None)
    ap.add_argument("--mode", default="tf32", choices=("fp32", "tf32"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    # the compiled row last: its first call compiles the whole step (minutes for 124M), and
    # it takes whatever the budget leaves
    ap.add_argument("--rows", default="ours eager,torch eager,torch.compile,ours compiled")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per row at most")
    ap.add_argument("--budget-s", type=float, default=1e9, help="seconds for all rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.warmup = max(2, a.warmup)  # the eager first step, then the compiling call
    if a.device is None:
        import blutrain.tensor as bt

        a.device = "cuda" if bt.cuda_device_count() > 0 else "cpu"
    gpu = a.device.startswith("cuda")
    a.model = a.model or ("gpt2" if gpu else "tiny")
    a.B = a.B or (8 if gpu else 2)
    a.T = a.T or (1024 if gpu else 64)
    if a.worker:
        worker(a)
        return
    rows = []
    start = time.perf_counter()
    for name in a.rows.split(","):
        if name.startswith("torch") and not gpu:
            continue  # torch rows are the GPU model of bench_gpt2.py
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            name,
            "--device",
            a.device,
            "--model",
            a.model,
            "-B",
            str(a.B),
            "-T",
            str(a.T),
            "--mode",
            a.mode,
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
        ]
        t0 = time.perf_counter()
        limit = min(a.timeout, a.budget_s - (t0 - start))
        try:
            if limit < 10:
                raise subprocess.TimeoutExpired(cmd, 0)
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(res[-1][7:]) if res else {"error": f"exit {p.returncode}"}
            if "error" in r:
                r["stderr_tail"] = p.stderr.strip()[-1500:]
        except subprocess.TimeoutExpired:
            r = {"error": f"timed out or skipped (budget: {max(limit, 0):.0f} s left for it)"}
        r.update(row=name, wall_s=round(time.perf_counter() - t0, 1))
        rows.append(r)
        print(
            f"  {name:14s} {r.get('tokens_per_s', r.get('error'))}  ({r['wall_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    base = {r["row"]: r.get("tokens_per_s") for r in rows}
    print(
        f"\nGPT-2 {a.model} step (fwd+bwd+clip+AdamW), {a.device}, {a.mode}, B={a.B} T={a.T}, "
        f"{a.steps} timed steps after {a.warmup}"
    )
    print(
        f"{'row':14s} {'tok/s':>10s} {'ms/step':>8s} {'peak GiB':>9s} {'vs eager':>8s} "
        f"{'vs t.comp':>9s} {'warmup s':>8s}  loss"
    )
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['row']:14s} ERROR {r['error']}\n{r.get('stderr_tail', '')[-600:]}")
            continue
        ratio = [
            r["tokens_per_s"] / base[k] if base.get(k) else float("nan")
            for k in ("ours eager", "torch.compile")
        ]
        print(
            f"{r['row']:14s} {r['tokens_per_s']:10,.0f} {r['step_ms']:8.1f} "
            f"{r['peak_bytes'] / 2**30:9.3f} {ratio[0]:8.2f} {ratio[1]:9.2f} "
            f"{r.get('warmup_s', float('nan')):8.1f}  {r['first_loss']:.4f} -> "
            f"{r['last_loss']:.4f}"
        )
        if "planned_bytes" in r:
            print(
                f"{'':14s} planned arena {r['planned_bytes'] / 2**30:.3f} GiB, recompiles "
                f"{r['recompiles']}, allocator calls a timed step {r['alloc_calls_per_step']}"
            )
            print(f"{'':14s} program {r.get('program')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "bench": "gpt2_compiled",
                    "device": a.device,
                    "model": a.model,
                    "B": a.B,
                    "T": a.T,
                    "mode": a.mode,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
