"""CPU training step: blutrain next to the same GPT-2 in PyTorch, same run, same threads.

    python bench_cpu.py [--threads 1,2] [--rounds 5] [--steps 3] [--model tiny] [--json OUT]
    python bench_cpu.py --arms "ours" "openblas-pool=ours:BLUTRAIN_BLAS_THREADS=openblas" "torch"

One step = forward, loss, backward, global-norm clipping (1.0), AdamW: blutrain's is the
`blutrain bench` step (blutrain.models.trainer.bench), PyTorch's a nanoGPT-style GPT-2 of the same
shape (tied head, tanh GELU, SDPA, padded vocabulary) with torch.optim.AdamW's default CPU path.
Each arm is one persistent subprocess per thread count (OMP_NUM_THREADS=N, which both libraries
read; blutrain's budget and torch.set_num_threads are set to N as well). The arms take turns: a
round runs --steps timed steps of each arm in turn (the order rotates every round), with a pause
between turns so the previous arm's threads go idle, so a machine whose speed drifts (other
users, thermal) charges all arms alike. Reported per arm: the median step's wall time as
tokens/s, its CPU time (all threads; CPU / wall is how many cores it kept busy), and the first
arm's speed-up over it: the median over rounds of each round's ratio of median step times. The
load average before and after is printed: on a shared machine read the ratios, not the absolute
figures.
Not a test: it never fails for being slow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

MODELS = {"tiny": (4, 4, 128), "gpt2": (12, 12, 768)}  # name -> (n_layer, n_head, n_embd)
V, VP = 50257, 50304  # GPT-2's vocabulary, padded to a multiple of 128


# -- workers (one persistent subprocess per arm and thread count) ------------------------------
def make_ours(a: argparse.Namespace):
    import numpy as np

    import blutrain.tensor as bt
    from blutrain.models.config import model_config
    from blutrain.models.device import resolve_recompute
    from blutrain.models.gpt2 import GPT2, set_matmul_precision
    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    bt.set_num_threads(a.threads)
    bt.manual_seed(0)
    cfg = model_config(a.model, 128)
    m = GPT2(
        cfg, device="cpu", precision="fp32", recompute=resolve_recompute("auto", "cpu", "fp32")
    )
    set_matmul_precision("fp32")
    opt = AdamW(m.named_parameters(), lr=1e-4)
    data = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.B, a.T + 1))
    x, y = bt.tensor(data[:, :-1]), bt.tensor(data[:, 1:])
    params = list(m.parameters())

    def step() -> float:
        loss = m(x, y, return_logits=False)[1]
        loss.backward()
        opt.step(grad_scale=grad_norm_and_clip_coef(params, 1.0)[1])
        opt.zero_grad()
        return float(loss.item())

    return step


def make_torch(a: argparse.Namespace):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    L, H, C = MODELS[a.model]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
            return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VP, C), nn.Embedding(1024, C)
            self.h = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C)
            for name, p in self.named_parameters():
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, std=0.02 / math.sqrt(2 * L))
                elif p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.h:
                x = b(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
            return F.cross_entropy(logits.view(-1, VP)[:, :V], targets.view(-1))

    torch.manual_seed(0)
    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-4
    )
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, V, (a.B, a.T + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> float:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


def worker(a: argparse.Namespace) -> int:
    step = make_ours(a) if a.worker == "ours" else make_torch(a)
    for _ in range(a.warmup):
        step()
    print("READY", flush=True)
    for line in sys.stdin:
        k = int(line.split()[1]) if line.startswith("run") else 0
        if k <= 0:
            break
        wall, cpu, loss = [], [], math.nan
        for _ in range(k):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "loss": loss}), flush=True)
    return 0


# -- driver ---------------------------------------------------------------------------------------
class Arm:
    def __init__(self, spec: str):
        label, _, rest = spec.partition("=")
        fw, _, env = (rest or label).partition(":")
        self.label, self.framework = label, fw
        self.env = dict(kv.split("=", 1) for kv in env.split(",") if kv)
        if fw not in ("ours", "torch"):
            raise SystemExit(f"[bench_cpu] arm {spec!r}: the framework must be ours or torch")

    def start(self, a: argparse.Namespace, threads: int) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **self.env)
        cmd = [sys.executable, __file__, "--worker", self.framework, "--threads", str(threads)]
        cmd += ["--model", a.model, "-B", str(a.B), "-T", str(a.T), "--warmup", str(a.warmup)]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        while True:  # the model is built and warmed up before any arm is timed
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"[bench_cpu] the {self.label} worker exited before it was ready")
            if line.startswith("READY"):
                return p

    @staticmethod
    def run(p: subprocess.Popen, steps: int) -> dict:
        p.stdin.write(f"run {steps}\n")
        p.stdin.flush()
        while True:
            line = p.stdout.readline()
            if not line:
                raise SystemExit("[bench_cpu] a worker exited mid-run")
            if line.startswith("RESULT "):
                return json.loads(line[7:])


def bench_threads(a: argparse.Namespace, arms: list[Arm], threads: int) -> dict:
    procs = [arm.start(a, threads) for arm in arms]
    wall: list[list[float]] = [[] for _ in arms]
    cpu: list[list[float]] = [[] for _ in arms]
    ratios: list[list[float]] = [[] for _ in arms]
    load0 = os.getloadavg()
    try:
        for r in range(a.rounds):
            order = [(r + i) % len(arms) for i in range(len(arms))]
            med = [0.0] * len(arms)
            for i in order:
                time.sleep(a.pause)  # the previous arm's threads stop spinning
                res = Arm.run(procs[i], a.steps)
                wall[i] += res["wall"]
                cpu[i] += res["cpu"]
                med[i] = statistics.median(res["wall"])
            for i in range(len(arms)):
                ratios[i].append(med[i] / med[0])
            print(
                f"  threads={threads} round {r + 1}/{a.rounds}: "
                + "  ".join(f"{arm.label} {1e3 * m:.0f} ms" for arm, m in zip(arms, med)),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for p in procs:
            try:
                p.stdin.write("stop\n")
                p.stdin.close()
            except OSError:
                pass
            p.wait()
    tok = a.B * a.T
    rows = []
    for i, arm in enumerate(arms):
        w = statistics.median(wall[i])
        rows.append(
            {
                "arm": arm.label,
                "threads": threads,
                "tokens_per_s": tok / w,
                "step_ms_median": 1e3 * w,
                "step_ms_min": 1e3 * min(wall[i]),
                "cpu_ms_median": 1e3 * statistics.median(cpu[i]),
                "cores_busy": statistics.median(c / max(x, 1e-9) for c, x in zip(cpu[i], wall[i])),
                # this arm's step time over the first arm's, per round: the first arm's speed-up
                # over this one (> 1: the first arm is faster)
                "first_speedup": statistics.median(ratios[i]),
                "first_speedup_rounds": [round(x, 3) for x in ratios[i]],
            }
        )
    return {
        "threads": threads,
        "rows": rows,
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pause", type=float, default=0.3, help="seconds between turns")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("-B", "--batch-size", dest="B", type=int, default=8)
    p.add_argument("-T", "--seq-len", dest="T", type=int, default=128)
    p.add_argument(
        "--arms",
        nargs="+",
        default=["ours", "torch"],
        help="label=framework[:VAR=value,...], framework ours or torch; ratios are to the first",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.threads = int(a.threads)
        return worker(a)
    arms = [Arm(s) for s in a.arms]
    results = []
    for t in (int(x) for x in a.threads.split(",")):
        results.append(bench_threads(a, arms, t))
    L, H, C = MODELS[a.model]
    print(f"\nGPT-2 {a.model} (L{L} H{H} C{C}), B={a.B} T={a.T}, CPU step incl. AdamW + clip 1.0")
    print(
        f"{'threads':>7s} {'arm':16s} {'tok/s':>8s} {'ms/step':>8s} {'CPU ms':>8s} "
        f"{'cores':>5s} {arms[0].label + ' speed-up':>14s}  per round"
    )
    for res in results:
        for r in res["rows"]:
            print(
                f"{r['threads']:7d} {r['arm']:16s} {r['tokens_per_s']:8,.0f} "
                f"{r['step_ms_median']:8.1f} {r['cpu_ms_median']:8.1f} {r['cores_busy']:5.2f} "
                f"{r['first_speedup']:13.2f}x  {r['first_speedup_rounds']}"
            )
        lb, la = res["loadavg_before"], res["loadavg_after"]
        print(f"{'':7s} load average (1 min) {lb[0]:.1f} before, {la[0]:.1f} after")
    print(
        f"(speed-up: the arm's median step time over {arms[0].label}'s, the median of the "
        "rounds' ratios)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
