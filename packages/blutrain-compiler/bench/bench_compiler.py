"""blutrain-compiler benchmark: fused memory-bound kernels and a LLaMA-style training step.

    python bench_compiler.py [--device cuda|cpu] [--model tiny|small|medium] [-B 8] [--steps 10]
                             [--json OUT.json] [--no-torch] [--no-torch-compile]

1. (GPU) Fused memory-bound kernels, compiled by blutrain.compiler (PTX from our codegen): the
   bytes each must move (inputs read once + outputs written once) over its median time, as a
   share of the measured device copy bandwidth (a 1 GiB clone), next to blutrain.tensor's eager
   kernels for the same computation.
2. The LLaMA-style training step (bench/llama_ref.py: RMSNorm, RoPE, causal attention, SwiGLU,
   untied head; forward + backward + AdamW): tokens/s and peak memory for ours eager, ours
   compiled, ours compiled as a CUDA graph (GPU: compile(..., cuda_graph=True)), torch eager and
   torch.compile (its default mode), same model, config and initial weights, each in its own
   subprocess. On the CPU (--device cpu) the same rows run without torch.compile: the
   compiled / eager ratio is the CPU benchmark.
Not a test: prints a table and writes JSON; a row that fails prints its error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


# ---- 1. kernels ----------------------------------------------------------------------------
def kernels(a: argparse.Namespace) -> list[dict]:
    import numpy as np

    import blutrain.compiler as btc
    import blutrain.tensor as bt

    dev = "cuda"
    rng = np.random.default_rng(0)

    def t(*shape: int) -> bt.Tensor:
        return bt.tensor(rng.standard_normal(shape).astype(np.float32)).to(dev)

    def timed(fn, *args, n: int = 20) -> float:
        fn(*args)
        bt.cuda.synchronize()
        ev = [bt.cuda.Event() for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            fn(*args)
            ev[i + 1].record()
        bt.cuda.synchronize()
        ms = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(n))
        return ms[n // 2] / 1e3

    big = t(256 * 1024 * 1024)  # 1 GiB
    copy_s = timed(lambda x: x.clone(), big)
    copy_bw = 2 * big.numel() * 4 / copy_s
    del big
    N, C, V = 16384, 768, 32000
    cases = [
        (
            "layer_norm (16384, 768)",
            lambda x, w, b: bt.layer_norm(x, (C,), w, b),
            [t(N, C), t(C), t(C)],
            2 * N * C * 4,
        ),
        (
            "residual + rms_norm (16384, 768)",
            lambda x, r, w: (
                (x + r) * bt.rsqrt(((x + r) * (x + r)).mean(-1, keepdim=True) + 1e-5) * w
            ),
            [t(N, C), t(N, C), t(C)],
            3 * N * C * 4,
        ),
        (
            "softmax (12*1024, 1024) scaled",
            lambda x: bt.softmax(x * 0.125, -1),
            [t(12 * 1024, 1024)],
            2 * 12 * 1024 * 1024 * 4,
        ),
        (
            "swiglu (16384, 2048)",
            lambda g, u: g * bt.sigmoid(g) * u,
            [t(N, 2048), t(N, 2048)],
            3 * N * 2048 * 4,
        ),
        (
            "gelu_tanh (16384, 3072)",
            lambda x: bt.gelu(x, approximate="tanh"),
            [t(N, 3072)],
            2 * N * 3072 * 4,
        ),
        (
            "cross_entropy (4096, 32000)",
            lambda x, y: bt.cross_entropy(x, y),
            [t(4096, V), bt.tensor(rng.integers(0, V, 4096)).to(dev)],
            4096 * V * 4,
        ),
    ]
    rows = []
    for name, fn, args, nbytes in cases:
        row = {"kernel": name, "bytes": nbytes}
        try:
            c = btc.compile(fn)
            c(*args)
            s = timed(c, *args)
            row.update(
                compiled_s=s, compiled_GBps=nbytes / s / 1e9, share_of_copy=nbytes / s / copy_bw
            )
            (p,) = [v.prog for v in c.programs.values()]
            row["launches"] = sum(len(f.launches) for f in p.gpu_code.functions.values())
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            s = timed(fn, *args)
            row.update(eager_s=s, eager_GBps=nbytes / s / 1e9)
        except Exception as e:  # noqa: BLE001
            row["eager_error"] = str(e)[:200]
        rows.append(row)
    print(f"\ndevice copy bandwidth {copy_bw / 1e9:.0f} GB/s (clone of 1 GiB)")
    print(f"{'kernel':36s} {'launch':>6s} {'ours GB/s':>10s} {'% copy':>7s} {'eager GB/s':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:36s} ERROR {r['error']}")
            continue
        print(
            f"{r['kernel']:36s} {r['launches']:6d} {r['compiled_GBps']:10.0f} "
            f"{100 * r['share_of_copy']:6.1f}% {r.get('eager_GBps', float('nan')):10.0f}"
        )
    return [dict(r, copy_GBps=copy_bw / 1e9) for r in rows]


# ---- 2. the LLaMA-style step (one subprocess per row) ----------------------------------------
def worker(a: argparse.Namespace) -> dict:
    import llama_ref as L
    import numpy as np

    cfg = L.Config.preset(a.model)
    if a.seq:
        cfg.seq = a.seq
    w = L.init_weights(cfg)
    rng = np.random.default_rng(1)
    batches = [
        (rng.integers(0, cfg.vocab, (a.B, cfg.seq)), rng.integers(0, cfg.vocab, (a.B, cfg.seq)))
        for _ in range(a.warmup + a.steps)
    ]
    dev = a.device
    if a.framework == "ours":
        import blutrain.tensor as bt

        if a.precision == "tf32":
            bt.set_float32_matmul_precision("high")
        params = {k: bt.tensor(v).to(dev).requires_grad_(True) for k, v in w.items()}
        state = {
            k: (bt.zeros(p.shape, device=dev), bt.zeros(p.shape, device=dev))
            for k, p in params.items()
        }
        cos, sin = (bt.tensor(x).to(dev) for x in L.rope_tables(cfg))

        step = L.bt_step(bt, cfg, params, state, cos, sin)
        run = step
        if a.compiled:
            import blutrain.compiler as btc

            run = btc.compile(step, scalars=("t",), cuda_graph=a.cuda_graph)

        def one(i: int):
            x, y = batches[i]
            lr = 1e-3
            if a.compiled:
                return run(bt.tensor(x).to(dev), bt.tensor(y).to(dev), lr, i + 1)
            return run(
                bt.tensor(x).to(dev),
                bt.tensor(y).to(dev),
                bt.full((), lr, device=dev),
                bt.full((), float(i + 1), device=dev),
            )

        def sync() -> None:
            if dev.startswith("cuda"):
                bt.cuda.synchronize()

        def peak() -> float:
            if dev.startswith("cuda"):
                return bt.cuda.max_memory_allocated() / 2**30
            import blutrain.alloc as A

            return A.stats("cpu")["allocated_bytes_peak"] / 2**30  # (as max_memory_allocated)

        def reset_peak() -> None:
            if dev.startswith("cuda"):
                bt.cuda.reset_peak_memory_stats()
            else:
                import blutrain.alloc as A

                A.reset_peak_stats("cpu")

        def planned() -> float | None:
            progs = [v.prog for v in run.programs.values()] if a.compiled else []
            return sum(p.stats.planned_bytes for p in progs) / 2**30 if progs else None
    else:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        model = L.torch_model(torch, cfg, w, dev)
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=1e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            foreach=False,
        )

        def step(idx, tgt):
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        run = torch.compile(step) if a.compiled else step

        def one(i: int):
            x, y = batches[i]
            return run(torch.tensor(x, device=dev), torch.tensor(y, device=dev))

        def sync() -> None:
            if dev.startswith("cuda"):
                torch.cuda.synchronize()

        def peak() -> float:
            return torch.cuda.max_memory_allocated() / 2**30 if dev.startswith("cuda") else 0.0

        def reset_peak() -> None:
            if dev.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()

        def planned() -> float | None:
            return None

    t0 = time.perf_counter()
    for i in range(a.warmup):
        loss = one(i)
    sync()
    warm = time.perf_counter() - t0
    # Note [steady-state peak]: the warmup's peak holds what the first calls do once (capture
    # runs the step eagerly; compilation's own buffers); the step's peak is that of the timed
    # steps, every long-lived buffer (parameters, moments, a compiled program's arena) included.
    first_peak = peak()
    reset_peak()
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        loss = one(i)
    sync()
    dt = time.perf_counter() - t0
    lv = float(loss.item()) if hasattr(loss, "item") else float("nan")
    return {
        "tok_s": a.B * cfg.seq * a.steps / dt,
        "step_ms": 1e3 * dt / a.steps,
        "warmup_s": warm,
        "peak_GiB": peak(),
        "first_calls_peak_GiB": first_peak,
        "planned_GiB": planned(),
        "loss": lv,
    }


def steps(a: argparse.Namespace) -> list[dict]:
    rows = []
    plan: list[tuple[str, bool | str]] = [("ours", False), ("ours", True)]
    if a.device.startswith("cuda"):  # Note [compiled programs as CUDA graphs]
        plan.append(("ours", "graph"))
    if not a.no_torch:
        plan.append(("torch", False))
        if not a.no_torch_compile and a.device.startswith("cuda"):
            plan.append(("torch", True))
    for fw, comp in plan:
        cmd = (
            [
                sys.executable,
                __file__,
                "--worker",
                "--framework",
                fw,
                "--device",
                a.device,
                "--model",
                a.model,
                "-B",
                str(a.B),
                "--steps",
                str(a.steps),
                "--warmup",
                str(a.warmup),
                "--precision",
                a.precision,
            ]
            + (["--compiled"] if comp else [])
            + (["--cuda-graph"] if comp == "graph" else [])
            + (["--seq", str(a.seq)] if a.seq else [])
        )
        name = f"{fw} {'compiled' if comp else 'eager'}" + (" +graph" if comp == "graph" else "")
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        try:
            row = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            row = {"error": (r.stderr or r.stdout)[-600:]}
        row["row"] = name
        rows.append(row)
    base = next((r for r in rows if r["row"] == "ours eager" and "tok_s" in r), None)
    print(f"\nLLaMA-style step, model {a.model}, B={a.B}, {a.device}, {a.precision}")
    print(
        f"{'row':22s} {'tok/s':>10s} {'ms/step':>8s} {'peak MiB':>9s} {'vs ours eager':>13s} "
        f"{'warmup s':>8s} {'loss':>8s} {'warmup peak':>11s} {'arena MiB':>9s}"
    )
    for r in rows:
        if "tok_s" not in r:
            print(f"{r['row']:22s} ERROR {r.get('error', '')[-300:]}")
            continue
        ratio = r["tok_s"] / base["tok_s"] if base else float("nan")
        print(
            f"{r['row']:22s} {r['tok_s']:10.0f} {r['step_ms']:8.1f} {1024 * r['peak_GiB']:9.1f} "
            f"{ratio:13.2f} {r['warmup_s']:8.1f} {r['loss']:8.4f} "
            f"{1024 * r.get('first_calls_peak_GiB', float('nan')):11.1f} "
            f"{'' if r.get('planned_GiB') is None else format(1024 * r['planned_GiB'], '.1f'):>9s}"
        )
    print(
        "peak MiB: the timed steps' peak (parameters, moments and the compiled arena included); "
        "warmup peak: the first calls' (capture, compilation)"
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("-B", type=int, default=None)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--framework", default="ours")
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--cuda-graph", action="store_true", help="(worker) compile with cuda_graph")
    a = ap.parse_args()
    if a.device is None:
        import blutrain.tensor as bt

        a.device = "cuda" if bt.cuda_device_count() > 0 else "cpu"
    gpu = a.device.startswith("cuda")
    a.model = a.model or ("small" if gpu else "tiny")
    a.B = a.B or (8 if gpu else 4)
    if a.worker:
        print(json.dumps(worker(a)))
        return
    out: dict = {"device": a.device, "model": a.model, "B": a.B}
    if gpu and not a.no_kernels:
        out["kernels"] = kernels(a)
    out["steps"] = steps(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
