"""Does the chunked classifier train the same model?  GPT-2 trained twice on the GPU from the
same initialization, data order and optimizer: the loss from bt.linear_cross_entropy
(``model(x, y, return_logits=False)``, the trainer's path) and from the logits path
(``model(x, y)``: logits made, cross-entropy over them).  Prints the train loss and the
validation loss of both every --eval-every steps, and the largest differences.  Not a test.

    python bench/classifier_convergence.py --data DIR   # llm.c shards, e.g. from `blutrain prepare`
"""

from __future__ import annotations

import argparse
import glob
import os

import numpy as np

import blutrain.tensor as bt
from blutrain.models.config import GPT2Config
from blutrain.models.data import DataLoader
from blutrain.models.gpt2 import GPT2, set_matmul_precision
from blutrain.models.optim import AdamW, CosineSchedule, grad_norm_and_clip_coef

MODELS = {"gpt2": (12, 12, 768), "tiny": (4, 4, 128)}


def train(a, fused_head: bool, files: dict[str, list[str]]) -> list[tuple[int, float, float]]:
    L, H, C = MODELS[a.model]
    cfg = GPT2Config(block_size=a.T, n_layer=L, n_head=H, n_embd=C, vocab_multiple=128)
    bt.manual_seed(0)
    model = GPT2(cfg, device=a.device, precision=a.precision, fused=True)
    set_matmul_precision(a.precision)
    opt = AdamW(model.named_parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = CosineSchedule(max_lr=a.lr, warmup_steps=a.steps // 10, max_steps=a.steps)
    params = list(model.parameters())
    train_data = DataLoader(files["train"], a.B, a.T, seed=0)
    rows = []

    def loss_of(x, y):
        if fused_head:
            return model(x, y, return_logits=False)[1]
        logits, loss = model(x, y)
        del logits
        return loss

    def val_loss() -> float:
        val = DataLoader(files["val"], a.B, a.T, shuffle=False)
        total, n = 0.0, min(a.eval_batches, val.batches_per_epoch)
        with bt.no_grad():
            for _ in range(n):
                x, y = val.next_batch()
                total += float(
                    loss_of(bt.tensor(x, device=a.device), bt.tensor(y, device=a.device)).item()
                )
        return total / n

    for step in range(1, a.steps + 1):
        x, y = train_data.next_batch()
        opt.set_lr(sched(step - 1))
        loss = loss_of(bt.tensor(x, device=a.device), bt.tensor(y, device=a.device))
        loss.backward()
        _, coef = grad_norm_and_clip_coef(params, 1.0)
        opt.step(grad_scale=coef)
        opt.zero_grad()
        if step % a.eval_every == 0 or step == a.steps:
            rows.append((step, float(loss.item()), val_loss()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", required=True, help="directory of llm.c shards (*_train_*, *_val_*)")
    ap.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (fp32) for a smoke run")
    ap.add_argument("-B", type=int, default=8)
    ap.add_argument("-T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument(
        "--runs",
        default="fused,logits",
        help="heads to train, in order: fused (chunked classifier) or logits; repeat one to see "
        "the run-to-run spread (the attention backward's float atomics)",
    )
    ap.add_argument("--deterministic", action="store_true", help="bt.use_deterministic_algorithms")
    a = ap.parse_args()
    files = {s: sorted(glob.glob(os.path.join(a.data, f"*_{s}_*.bin"))) for s in ("train", "val")}
    if not files["train"] or not files["val"]:
        raise SystemExit(f"no *_train_*.bin / *_val_*.bin shards in {a.data}")
    if a.deterministic:
        bt.use_deterministic_algorithms(True)
    runs = a.runs.split(",")
    if not runs or any(r not in ("fused", "logits") for r in runs):
        raise SystemExit(f"--runs: a list of 'fused' / 'logits', got {a.runs!r}")
    results = [train(a, r == "fused", files) for r in runs]
    det = ", deterministic" if a.deterministic else ""
    print(f"GPT-2 {a.model} {a.precision}{det} B={a.B} T={a.T} lr={a.lr}, {a.steps} steps")
    names = [f"{r}#{i}" for i, r in enumerate(runs)]
    print(f"{'step':>5} " + " ".join(f"{'train ' + n:>15}" for n in names) + " "
          + " ".join(f"{'val ' + n:>13}" for n in names))  # fmt: skip
    for k, (step, _, _) in enumerate(results[0]):
        tr = " ".join(f"{res[k][1]:15.4f}" for res in results)
        va = " ".join(f"{res[k][2]:13.4f}" for res in results)
        print(f"{step:5d} {tr} {va}")
    print("final val loss: " + ", ".join(f"{n} {res[-1][2]:.4f}" for n, res in zip(names, results)))
    vals = [r[2] for res in results for r in res]
    np.testing.assert_(all(np.isfinite(vals)), "non-finite validation loss")


if __name__ == "__main__":
    main()
