"""Does our GPT-2 train like PyTorch's in every precision?  Ours and a functional PyTorch GPT-2
(bench/torch_gpt2.py) from one initial state and one batch stream, in fp32, tf32 and bf16 (ours:
the model's precision policy; PyTorch: autocast, float32 weights, fused AdamW). Not a test: it
prints tables and writes JSON (and, taking minutes, is not one of the bench_*.py that
scripts/gpu.sh runs).

    python bench/convergence.py --device cuda --json conv.json          # 6 runs, 1000 steps
    python bench/convergence.py --device cuda --quick --json quick.json # 100 steps, diagnostics
    python bench/convergence.py --device cpu --model 2x4x64 -B 2 -T 64 --steps 20 \
        --runs torch:fp32,ours:fp32,torch:bf16,ours:bf16 --compact-vocab  # a CPU smoke run

Runs are framework:precision (ours|torch, fp32|tf32|bf16), optionally ours:PREC/VARIANT[+...]
with the model's options: bf16res = GPT2.residual_dtype "compute" (the residual stream in bf16,
rounded at every add: the policy before issue 38, now opt-in; the model's default and ours:PREC's
is float32, as autocast's), f32grad = GPT2.residual_grad_dtype "float32" (the float32 stream's
gradient float32 on the fused path too, as autocast's; by default it travels in bf16 there),
unfused = fused=False (no add_layer_norm, linear_gelu_linear, qkv_attention, linear_cross_entropy:
plain ops, whose float32 stream also carries a float32 gradient), flash = on the CPU, the fused
attention (bt.backends.use_flash_attention_cpu: float32 scores and softmax, as the CUDA kernels
compute them; the CPU's default composes matmul + softmax in the compute dtype, so its bf16 runs
round the scores to bf16, which CUDA's do not; nothing changes on CUDA), exactattn =
bt.set_float32_attention_precision("highest") (on CUDA the float32 attention in 3xTF32 under
tf32, as PyTorch's float32 scaled_dot_product_attention; nothing changes on the CPU or in bf16),
exactscores = bt.set_float32_attention_precision("scores") (only the attention's scores Q K^T
in 3xTF32).

Per run: the training loss and the gradient norm of every step, the validation loss (the whole
val split) every --eval-every steps, tokens/s, and at each --checkpoints step the norms of every
parameter tensor, of its update, its gradient and its AdamW moments. The summary sets each run
beside the fp32 reference (torch:fp32 when it ran, else ours:fp32): the mean |train loss
difference| over all steps and over the last tenth (same batches, so the batch-to-batch noise
cancels), its signed mean there (a bias), the final and mean |val loss difference|.

--baseline JSON: runs of an earlier call with the same settings (a JSON this script wrote, e.g.
bench/baselines/*.json: PyTorch's runs on an H200, torch 2.11) join the tables as they were
(losses, val, norms; their tok/s are that call's), so a later call reruns only what changed:

    python bench/convergence.py --runs ours:fp32,ours:tf32,ours:bf16 \
        --baseline bench/baselines/conv_b_torch.json

Diagnostics (--quick turns both on):
- --compare: at each checkpoint, every run's weights, gradients and AdamW moments against the
  reference's, per tensor (||a - b|| / ||b||), and each ours:bf16 run against torch:bf16; then,
  tensor by tensor, ours:bf16's distance from the reference over torch:bf16's, largest first.
  The reference runs first, torch:bf16 second; the others' host copies are compared and dropped
  as each run ends (GPT-2 124M: 2.5 GB a checkpoint a run).
- --probe: at each checkpoint, every run kind at the reference run's weights on --probe-batches
  fixed batches: the loss and its signed difference from the reference kind's, the validation
  loss, the final LayerNorm's output, and per tensor the gradient's error against the reference
  kind's and its scale bias <g - r, r> / ||r||^2, each a mean over the batches with its standard
  error: a systematic gradient error (a bias, not noise) shows apart from the divergence of the
  trajectories, which decorrelates every pair of runs (fp32 against fp32 too) within tens of
  steps in the overfitting setting.
- --probe-ref RUN: the probes at RUN's weights, against RUN's gradients (e.g. ours:fp32 run here
  beside a --baseline torch:fp32: a baseline keeps no weights).
- --probe-runs LIST: the run kinds probed (default: --runs); a kind not in --runs is built at
  the reference's weights for the probe only, never trained, so probing four precisions at
  steps 60 and 100 trains only the reference:
      --runs torch:fp32 --probe --probe-runs torch:fp32,torch:bf16,ours:bf16,ours:fp32 \
      --checkpoints 60,100
- --train-tokens N: train on the first N tokens only (a CPU-sized overfitting setting).
- --stop-at N: run steps 1..N of the --steps schedule and stop (the last val loss at N): a probe
  at early checkpoints of a 1000-step run needs only those steps, and the schedule (warmup, the
  cosine's length) stays the 1000-step run's, so the weights are that run's.
- --deterministic: ours with bt.cuda.use_deterministic_algorithms(True) (the JSON's
  "deterministic_algorithms" says how ours ran). Without it ours on CUDA is not bitwise
  reproducible: session 55 measured two ours:fp32 runs of one seed first differing at step 46
  (the gradient norm; the loss from step 49; ours:tf32 and ours:bf16 matched over those 200
  steps), while PyTorch's runs here reproduced bit for bit across calls. The likely source is
  the float32 attention backward's dQ by float atomics (Note [tf32 dQ by atomics]), which
  deterministic mode turns off; not yet run on a GPU this way. A rerun without it is another
  sample of the same chaos, as another seed is.

Defaults: GPT-2 124M on the shipped Tiny Shakespeare (304K train tokens), B=2 x T=256 = 512 tokens
a step, so 1000 steps see 512K tokens (1.7 epochs): far less memorisation than the issue's B16 x
T1024 (16 epochs in 300 steps). lr 6e-4, 50 warmup steps, cosine to 6e-5, AdamW (0.9, 0.95), eps
1e-8, weight decay 0.1 on matrices, clip 1.0, data seed 1337, init seed 0.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = {"gpt2": (12, 12, 768), "tiny": (4, 4, 128)}
KINDS = ("weight", "update", "grad", "exp_avg", "exp_avg_sq")


def parse_model(name: str) -> tuple[int, int, int]:
    if name in MODELS:
        return MODELS[name]
    try:
        L, H, C = (int(v) for v in name.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--model: gpt2, tiny or LxHxC (e.g. 2x4x128), got {name!r}") from None
    return L, H, C


# -- data --------------------------------------------------------------------------------------


class Data:
    """Train / val loaders over llm.c shards; with compact_vocab the ids are renumbered densely
    over the tokens the shards use (a smaller head for small CPU models; not GPT-2's vocab)."""

    def __init__(self, path: str | None, compact_vocab: bool, train_tokens: int = 0) -> None:
        from blutrain.models.config import GPT2_VOCAB_SIZE
        from blutrain.models.data import load_shard, prepare, write_shard

        if path is None:
            path = os.path.join(tempfile.gettempdir(), f"bt-conv-shakespeare-{os.getuid()}")
            if not glob.glob(os.path.join(path, "*_train_*.bin")):
                prepare(None, path)
        self.path = path
        self.files = {
            s: sorted(glob.glob(os.path.join(path, f"*_{s}_*.bin"))) for s in ("train", "val")
        }
        if not self.files["train"] or not self.files["val"]:
            raise SystemExit(f"no *_train_*.bin / *_val_*.bin shards in {path}")
        if train_tokens > 0:  # the first train_tokens tokens only: a CPU-sized overfitting run
            toks = np.concatenate([np.asarray(load_shard(f)) for f in self.files["train"]])
            sub = os.path.join(tempfile.gettempdir(), f"bt-conv-sub-{os.getuid()}-{train_tokens}")
            os.makedirs(sub, exist_ok=True)
            self.files["train"] = [
                str(write_shard(os.path.join(sub, "sub_train_000000.bin"), toks[:train_tokens]))
            ]
        self.lut = None
        self.vocab_size = GPT2_VOCAB_SIZE
        if compact_vocab:
            used = np.unique(
                np.concatenate(
                    [np.asarray(load_shard(f)) for fs in self.files.values() for f in fs]
                )
            )
            self.lut = np.zeros(65536, np.int64)
            self.lut[used] = np.arange(len(used))
            self.vocab_size = len(used)
        self.tokens = {
            s: sum(int(np.asarray(load_shard(f)).size) for f in fs) for s, fs in self.files.items()
        }

    def loader(self, split: str, B: int, T: int, seed: int) -> Any:
        from blutrain.models.data import DataLoader

        return DataLoader(self.files[split], B, T, shuffle=split == "train", seed=seed)

    def map(self, x: np.ndarray) -> np.ndarray:
        return x if self.lut is None else self.lut[x]

    def batches(self, loader: Any, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for _ in range(n):
            x, y = loader.next_batch()
            out.append((self.map(x), self.map(y)))
        return out


# -- the two frameworks --------------------------------------------------------------------------


def make_state(cfg: Any, seed: int) -> dict[str, np.ndarray]:
    """GPT-2's initialization (ours, seeded), as float32 numpy: both frameworks start here."""
    import blutrain.tensor as bt
    from blutrain.models.gpt2 import GPT2

    bt.manual_seed(seed)
    return GPT2(cfg).state_dict()


class Ours:
    """Our GPT-2, AdamW (the fused multi-tensor kernel), clipping without a host sync."""

    framework = "ours"

    def __init__(
        self, cfg: Any, state: dict, precision: str, a: argparse.Namespace, variant: str = ""
    ) -> None:
        import blutrain.tensor as bt
        from blutrain.models.gpt2 import GPT2, set_matmul_precision
        from blutrain.models.optim import AdamW

        self.bt, self.device, self.precision = bt, a.device, precision
        flags = set(variant.split("+")) - {""}
        fused = {"auto": None, "on": True, "off": False}[a.ours_fused]
        if "unfused" in flags:
            fused = False
        residual = "compute" if "bf16res" in flags else "float32"
        grad = "float32" if "f32grad" in flags else "compute"
        self.flash = "flash" in flags
        self.model = GPT2(
            cfg,
            device=a.device,
            init=False,
            precision=precision,
            fused=fused,
            residual_dtype=residual,
        )
        self.model.residual_grad_dtype = grad
        self.model.load_state_dict(state)
        set_matmul_precision(precision)
        # exactattn: float32 attention in 3xTF32 under tf32, as PyTorch's; exactscores: only its
        # scores (process-wide: each run sets it, so the runs after this one get the default)
        attn = "highest" if "exactattn" in flags else "scores" if "exactscores" in flags else None
        bt.set_float32_attention_precision(attn or "matmul")
        self.named = list(self.model.named_parameters())
        self.params = [p for _, p in self.named]
        self.opt = AdamW(
            self.named, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay
        )
        self.clip = a.clip

    def _t(self, x: np.ndarray) -> Any:
        return self.bt.tensor(x, device=self.device)

    def _attention(self) -> Any:
        """The flash variant's CPU attention (a process-wide switch: set around each call)."""
        if not self.flash:
            return contextlib.nullcontext()
        return self.bt.backends.use_flash_attention_cpu(True)

    def forward_backward(self, x: np.ndarray, y: np.ndarray) -> Any:
        with self._attention():
            loss = self.model(self._t(x), self._t(y), return_logits=False)[1]
            loss.backward()
        return loss.detach()

    def step(self, lr: float) -> Any:
        from blutrain.models.optim import grad_norm_and_clip_coef

        norm, coef = grad_norm_and_clip_coef(self.params, self.clip)
        self.opt.set_lr(lr)
        self.opt.step(grad_scale=coef)
        self.opt.zero_grad()
        return norm

    def scalars(self, ts: list) -> list[float]:
        return self.bt.stack([t.float() for t in ts]).cpu().numpy().astype(float).tolist()

    def val_loss(self, batches: list) -> float:
        bt = self.bt
        self.model.eval()
        total: Any = 0.0
        with bt.no_grad(), self._attention():
            for x, y in batches:
                total = total + self.model(self._t(x), self._t(y), return_logits=False)[1].float()
        self.model.train()
        return float(total.item()) / len(batches)

    def _np(self, t: Any) -> np.ndarray:
        return np.array(t.detach().float().cpu().numpy(), dtype=np.float32, copy=True)

    def hidden(self, x: np.ndarray) -> np.ndarray:
        """The final LayerNorm's output (B, T, C) as float32 numpy."""
        with self.bt.no_grad(), self._attention():
            return self._np(self.model.hidden_states(self._t(x)))

    def weights(self) -> dict[str, np.ndarray]:
        return {n: self._np(p) for n, p in self.named}

    def grads(self) -> dict[str, np.ndarray]:
        return {n: self._np(p.grad) for n, p in self.named if p.grad is not None}

    def moments(self) -> tuple[dict, dict]:
        st = self.opt.state
        return (
            {n: self._np(st[n]["exp_avg"]) for n, _ in self.named if n in st},
            {n: self._np(st[n]["exp_avg_sq"]) for n, _ in self.named if n in st},
        )


class Torch:
    """The functional PyTorch GPT-2 (torch_gpt2.py): autocast for bf16, fused AdamW, PyTorch's
    own clip_grad_norm_."""

    framework = "torch"

    def __init__(
        self, cfg: Any, state: dict, precision: str, a: argparse.Namespace, variant: str = ""
    ) -> None:
        import torch
        from torch_gpt2 import decay_groups, torch_params

        self.torch, self.cfg, self.device, self.precision = torch, cfg, a.device, precision
        tf32 = precision != "fp32"  # as ours: bf16's float32 matmuls (none here) on TF32 too
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        self.params = torch_params(state, a.device)
        groups = decay_groups(self.params, a.weight_decay)
        kw = dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        try:
            self.opt = torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, ValueError):  # a device without the fused kernel
            self.opt = torch.optim.AdamW(groups, foreach=True, **kw)
        self.clip = a.clip
        self.dev_type = "cuda" if str(a.device).startswith("cuda") else "cpu"

    def _loss(self, x: np.ndarray, y: np.ndarray) -> Any:
        from torch_gpt2 import torch_loss

        t = self.torch
        xt, yt = (t.from_numpy(np.ascontiguousarray(v)).to(self.device) for v in (x, y))
        with t.autocast(self.dev_type, t.bfloat16, enabled=self.precision == "bf16"):
            return torch_loss(self.params, self.cfg, xt, yt)

    def forward_backward(self, x: np.ndarray, y: np.ndarray) -> Any:
        loss = self._loss(x, y)
        loss.backward()
        return loss.detach()

    def step(self, lr: float) -> Any:
        norm = self.torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm.detach()

    def scalars(self, ts: list) -> list[float]:
        return self.torch.stack([t.float() for t in ts]).cpu().double().tolist()

    def val_loss(self, batches: list) -> float:
        with self.torch.no_grad():
            total = sum(self._loss(x, y).float() for x, y in batches)
        return float(total.item()) / len(batches)

    def _np(self, t: Any) -> np.ndarray:
        return t.detach().float().cpu().numpy().copy()

    def hidden(self, x: np.ndarray) -> np.ndarray:
        from torch_gpt2 import torch_hidden

        t = self.torch
        xt = t.from_numpy(np.ascontiguousarray(x)).to(self.device)
        with t.no_grad(), t.autocast(self.dev_type, t.bfloat16, enabled=self.precision == "bf16"):
            return self._np(torch_hidden(self.params, self.cfg, xt))

    def weights(self) -> dict[str, np.ndarray]:
        return {n: self._np(p) for n, p in self.params.items()}

    def grads(self) -> dict[str, np.ndarray]:
        return {n: self._np(p.grad) for n, p in self.params.items() if p.grad is not None}

    def moments(self) -> tuple[dict, dict]:
        st = self.opt.state
        ps = [(n, p) for n, p in self.params.items() if p in st]
        return (
            {n: self._np(st[p]["exp_avg"]) for n, p in ps},
            {n: self._np(st[p]["exp_avg_sq"]) for n, p in ps},
        )


FRAMEWORKS = {"ours": Ours, "torch": Torch}
VARIANTS = {
    "ours": ("bf16res", "unfused", "flash", "f32grad", "exactattn", "exactscores"),
    "torch": (),
}


def split_name(name: str) -> tuple[str, str, str]:
    """'ours:bf16/bf16res' -> ('ours', 'bf16', 'bf16res')."""
    fw, _, rest = name.partition(":")
    prec, _, variant = rest.partition("/")
    return fw, prec, variant


def make_run(name: str, cfg: Any, state: dict, a: argparse.Namespace) -> Any:
    fw, prec, variant = split_name(name)
    return FRAMEWORKS[fw](cfg, state, prec, a, variant)


# -- one run -----------------------------------------------------------------------------------


def sumsq(v: np.ndarray) -> float:
    """sum(v * v) of a float32 array: BLAS's dot (float32 sums: ample for these ratios; a
    float64 copy of GPT-2's wte would cost 1.2 GB and seconds per call)."""
    f = np.ascontiguousarray(v, dtype=np.float32).ravel()
    return float(np.dot(f, f))


def norms(d: dict[str, np.ndarray]) -> dict[str, float]:
    return {n: math.sqrt(sumsq(v)) for n, v in d.items()}


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        try:
            import blutrain.tensor as bt

            bt.cuda.synchronize()
        except (AttributeError, RuntimeError):
            pass
        try:
            import torch

            torch.cuda.synchronize()
        except (ImportError, RuntimeError):
            pass


def release(dev: str) -> None:
    """Gives the cached device memory of a finished run back (both allocators)."""
    import gc

    gc.collect()
    if not dev.startswith("cuda"):
        return
    try:
        import blutrain.tensor as bt

        bt.cuda.empty_cache()
    except (AttributeError, RuntimeError):
        pass
    try:
        import torch

        torch.cuda.empty_cache()
    except (ImportError, RuntimeError):
        pass


def train(name: str, cfg: Any, state: dict, data: Data, a: argparse.Namespace) -> dict:
    """One run: its losses, norms, validation losses, checkpoint statistics (and snapshots for
    --compare, kept under the '_snap' key)."""
    from blutrain.models.optim import CosineSchedule

    run = make_run(name, cfg, state, a)
    sched = CosineSchedule(a.lr, a.warmup, a.steps, a.min_lr)
    last = a.last  # the step the run ends at (--stop-at: the schedule stays --steps')
    loader = data.loader("train", a.B, a.T, a.seed)
    val = data.batches(data.loader("val", a.eval_B, a.T, 0), a.eval_batches)
    ckpts = set(a.checkpoints)
    losses: list[float] = []
    gnorms: list[float] = []
    pending: list = []
    vals: list[tuple[int, float]] = []
    stats: dict[int, dict] = {}
    snaps: dict[int, dict] = {}
    train_s = 0.0
    if a.eval_every:
        vals.append((0, run.val_loss(val)))

    def flush() -> None:
        if pending:
            v = run.scalars([t for pair in pending for t in pair])
            losses.extend(v[0::2])
            gnorms.extend(v[1::2])
            pending.clear()

    sync(a.device)
    t0 = time.perf_counter()
    for step in range(1, last + 1):
        ((x, y),) = data.batches(loader, 1)
        cap = step in ckpts
        if cap:
            flush()
            sync(a.device)
            train_s += time.perf_counter() - t0
            before = run.weights()
            t0 = time.perf_counter()
        loss = run.forward_backward(x, y)
        if cap:
            sync(a.device)
            train_s += time.perf_counter() - t0
            g = run.grads()
            t0 = time.perf_counter()
        norm = run.step(sched(step - 1))
        pending.append((loss, norm))
        if cap:
            flush()
            sync(a.device)
            train_s += time.perf_counter() - t0
            w = run.weights()
            m, v = run.moments()
            upd = {n: w[n] - before[n] for n in w}
            kinds = {"weight": w, "update": upd, "grad": g, "exp_avg": m, "exp_avg_sq": v}
            stats[step] = {k: norms(d) for k, d in kinds.items()}
            if a.compare:
                snaps[step] = kinds
            elif a.probe and name == a.probe_ref:
                snaps[step] = {"weight": w}
            del before
            t0 = time.perf_counter()
        if len(pending) >= 50:
            flush()
        if a.eval_every and (step % a.eval_every == 0 or step == last):
            flush()
            sync(a.device)
            train_s += time.perf_counter() - t0
            vals.append((step, run.val_loss(val)))
            t0 = time.perf_counter()
    flush()
    sync(a.device)
    train_s += time.perf_counter() - t0
    out = {
        "run": name,
        "loss": losses,
        "grad_norm": gnorms,
        "val": vals,
        "tokens_per_s": a.B * a.T * last / train_s,
        "train_s": train_s,
        "checkpoints": {str(k): v for k, v in stats.items()},
        "_snap": snaps,
    }
    return out


# -- probes: every precision at the reference's weights ------------------------------------------


def probe(cfg: Any, snaps: dict, data: Data, names: list[str], a: argparse.Namespace) -> dict:
    """At each checkpoint, every run kind at the reference run's weights on --probe-batches fixed
    batches: the loss, the val loss, and per tensor the gradient against the reference kind's:
    ||g - r|| / ||r|| (error) and <g - r, r> / ||r||^2 (its component along r: a systematic
    scale bias of that gradient, not noise), each the mean over the batches with the standard
    error of that mean; the loss's signed difference likewise."""
    pbs = data.batches(data.loader("train", a.B, a.T, a.seed + 1), a.probe_batches)
    val = data.batches(data.loader("val", a.eval_B, a.T, 0), a.eval_batches)
    ref = a.probe_ref
    out: dict[str, dict] = {}
    for step, snap in sorted(snaps.items()):
        w = snap["weight"]
        res: dict[str, dict] = {}
        rgrads: list[dict] = []
        rloss: list[float] = []
        hidden_ref = None
        for name in [ref] + [n for n in names if n != ref]:
            run = make_run(name, cfg, w, a)
            losses, rels, scales = [], [], []
            for i, pb in enumerate(pbs):
                losses.append(run.scalars([run.forward_backward(*pb)])[0])
                g = run.grads()
                run.opt.zero_grad()  # each batch alone
                if name == ref:
                    rgrads.append(g)
                    rloss.append(losses[-1])
                rels.append(rel_diffs(g, rgrads[i]))
                scales.append(scale_bias(g, rgrads[i]))
                if name != ref:
                    del g
            hidden = run.hidden(pbs[0][0])
            if name == ref:
                hidden_ref = hidden
            dl = np.array(losses) - np.array(rloss)
            res[name] = {
                "loss": float(np.mean(losses)),
                "loss_bias": float(dl.mean()),
                "loss_bias_sem": sem(dl),
                "val": run.val_loss(val) if a.eval_batches else math.nan,
                "hidden_rel": rel_diffs({"h": hidden}, {"h": hidden_ref})["h"],
                "grad_rel": {n: float(np.mean([r[n] for r in rels])) for n in rels[0]},
                "grad_scale": {n: float(np.mean([s[n] for s in scales])) for n in scales[0]},
                "grad_scale_sem": {n: sem([s[n] for s in scales]) for n in scales[0]},
            }
            del run
            release(a.device)
        out[str(step)] = {n: res[n] for n in dict.fromkeys([ref, *names])}  # the reference too
    return out


def sem(v: Any) -> float:
    """The standard error of the mean of v (0 for one value)."""
    v = np.asarray(v, dtype=np.float64)
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


def scale_bias(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor <a - b, b> / ||b||^2 (a's excess along b: +0.01 = 1% too long), and the
    model-wide one under '*'."""
    out, num, den = {}, 0.0, 0.0
    for n, bv in b.items():
        if n not in a:
            continue
        f = np.ascontiguousarray(bv, dtype=np.float32).ravel()
        d = np.ascontiguousarray(a[n], dtype=np.float32).ravel() - f
        x, s = float(np.dot(d, f)), float(np.dot(f, f))
        out[n] = x / s if s > 0 else 0.0
        num, den = num + x, den + s
    out["*"] = num / den if den > 0 else 0.0
    return out


# -- baselines -----------------------------------------------------------------------------------

# settings a baseline's runs must share with this call (what its losses depend on)
SAME = (
    "data",
    "model",
    "B",
    "T",
    "steps",
    "stop_at",
    "lr",
    "min_lr",
    "warmup",
    "weight_decay",
    "clip",
    "seed",
    "init_seed",
    "eval_every",
    "eval_B",
    "eval_batches",
    "compact_vocab",
    "train_tokens",
)


# what a SAME setting was before this script had it (older JSONs lack the key)
OLD_DEFAULTS = {"train_tokens": 0, "stop_at": 0}


def load_baseline(path: str, a: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """The runs of an earlier call's JSON that this call does not run, as finished runs (no
    snapshots: per-tensor comparisons and probes skip them).  Settings that differ: SystemExit."""
    with open(path) as f:
        old = json.load(f)
    diff = [k for k in SAME if old["args"].get(k, OLD_DEFAULTS.get(k)) != getattr(a, k)]
    if diff:
        raise SystemExit(
            f"--baseline {path}: its runs used other settings: "
            + ", ".join(f"{k} {old['args'].get(k)!r} (here {getattr(a, k)!r})" for k in diff)
        )
    return {n: {**r, "_snap": {}} for n, r in old["runs"].items() if n not in names}


# -- comparisons ---------------------------------------------------------------------------------


def reference(names: list[str]) -> str:
    for r in ("torch:fp32", "ours:fp32", "torch:tf32", "ours:tf32"):
        if r in names:
            return r
    return names[0]


def rel_diffs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor ||a - b|| / ||b||, and the model-wide one under '*'."""
    out, num, den = {}, 0.0, 0.0
    for n, bv in b.items():
        if n not in a:
            continue
        d = sumsq(a[n] - bv)
        s = sumsq(bv)
        out[n] = math.sqrt(d / s) if s > 0 else (0.0 if d == 0 else math.inf)
        num, den = num + d, den + s
    out["*"] = math.sqrt(num / den) if den > 0 else 0.0
    return out


def compare_run(name: str, results: dict[str, dict], cmp: dict) -> None:
    """Adds run `name`'s per-tensor differences against the reference (and, for ours:bf16*,
    against torch:bf16) at every checkpoint to cmp[step][pair]."""
    ref = reference(list(results))
    others = [ref] + (["torch:bf16"] if name.startswith("ours:bf16") else [])
    for other in others:
        if other == name or other not in results:
            continue
        for step, snap in results[name]["_snap"].items():
            base = results[other]["_snap"].get(step)
            if base is not None:
                cmp.setdefault(str(step), {})[f"{name}~{other}"] = {
                    k: rel_diffs(snap[k], base[k]) for k in KINDS
                }


# -- reports -------------------------------------------------------------------------------------


def summarize(results: dict[str, dict], a: argparse.Namespace) -> dict:
    names = list(results)
    ref = reference(names)
    rl = np.array(results[ref]["loss"])
    rv = np.array([v for _, v in results[ref]["val"]])
    tail = max(1, len(rl) // 10)  # the last tenth of the steps run
    out = {}
    for name, r in results.items():
        loss = np.array(r["loss"])
        d = loss - rl
        vv = np.array([v for _, v in r["val"]])
        dv = vv - rv if len(vv) == len(rv) and len(vv) else np.array([np.nan])
        out[name] = {
            "tokens_per_s": r["tokens_per_s"],
            "train_tail": float(loss[-tail:].mean()),
            "val_final": float(vv[-1]) if len(vv) else math.nan,
            "val_min": float(vv.min()) if len(vv) else math.nan,
            "d_train_all": float(np.abs(d).mean()),
            "d_train_tail": float(np.abs(d[-tail:]).mean()),
            "bias_train_tail": float(d[-tail:].mean()),
            "d_val_final": float(abs(dv[-1])),
            "d_val_mean": float(np.abs(dv[1:]).mean()) if len(dv) > 1 else float(abs(dv[-1])),
            "bias_val_final": float(dv[-1]),
            "split_step": split_step(d),
            "spikes": spikes(r["grad_norm"]),
        }
    return out


SPLIT = 0.02  # |train loss difference| at which two runs count as on different trajectories


def split_step(d: np.ndarray) -> int | None:
    """The first step (1-based) where |d| > SPLIT: after it the two runs no longer share a
    trajectory, and their difference measures how far chaos carried them, not a precision's
    bias (setting A, H200: every run split from torch:fp32 at step 10, a loss spike whose size
    each run drew differently, fp32's the largest)."""
    over = np.flatnonzero(np.abs(d) > SPLIT)
    return int(over[0]) + 1 if len(over) else None


def spikes(gnorm: list[float], factor: float = 3.0, half: int = 10) -> list[list[float]]:
    """[step, gradient norm] where the norm exceeds `factor` times the median of the 2 * half + 1
    steps around it: the instabilities that set a run back."""
    g = np.asarray(gnorm, dtype=np.float64)
    out = []
    for i in range(len(g)):
        med = float(np.median(g[max(0, i - half) : i + half + 1]))
        if g[i] > factor * med:
            out.append([i + 1, round(float(g[i]), 2)])
    return out


def print_summary(summary: dict, a: argparse.Namespace, ref: str) -> None:
    tail = max(1, a.last // 10)
    print(
        f"\nvs the reference {ref} (same batches): |d train| over all steps / the last {tail}, "
        f"its mean there (bias), |d val| final / mean over evals, signed final; split: the first "
        f"step with |d train| > {SPLIT}; spikes: steps whose gradient norm is over 3x its "
        "neighbours' median (norm)"
    )
    hdr = (
        f"{'run':<24} {'tok/s':>9} {'train(tail)':>11} {'val':>7} {'val min':>7} "
        f"{'|dtr| all':>9} {'tail':>7} {'bias':>7} {'|dval|':>7} {'mean':>7} {'signed':>7} "
        f"{'split':>5}  spikes"
    )
    print(hdr)
    for name, s in summary.items():
        sp = " ".join(f"{int(k)}({g:.1f})" for k, g in s["spikes"][:6])
        print(
            f"{name:<24} {s['tokens_per_s']:9.0f} {s['train_tail']:11.4f} {s['val_final']:7.4f} "
            f"{s['val_min']:7.4f} {s['d_train_all']:9.4f} {s['d_train_tail']:7.4f} "
            f"{s['bias_train_tail']:+7.4f} {s['d_val_final']:7.4f} {s['d_val_mean']:7.4f} "
            f"{s['bias_val_final']:+7.4f} {str(s['split_step'] or '-'):>5}  {sp}"
        )


def print_curves(results: dict[str, dict], a: argparse.Namespace) -> None:
    names = list(results)
    print("\nvalidation loss (whole val split)")
    print(f"{'step':>6} " + " ".join(f"{n:>16}" for n in names))
    for i, (step, _) in enumerate(results[names[0]]["val"]):
        print(f"{step:6d} " + " ".join(f"{results[n]['val'][i][1]:16.4f}" for n in names))
    w = max(1, a.last // 10)
    print(f"\ntrain loss, mean over windows of {w} steps (and the mean gradient norm)")
    print(f"{'steps':>11} " + " ".join(f"{n:>17}" for n in names))
    for lo in range(0, a.last, w):
        row = []
        for n in names:
            lv, gv = results[n]["loss"][lo : lo + w], results[n]["grad_norm"][lo : lo + w]
            row.append(f"{np.mean(lv):9.4f} ({np.mean(gv):5.2f})")
        print(f"{lo + 1:5d}-{min(lo + w, a.last):<5d} " + " ".join(f"{r:>17}" for r in row))


def print_checkpoints(results: dict[str, dict]) -> None:
    print("\nmodel-wide norms at the checkpoints: weights, update of that step, raw gradient")
    names = list(results)
    for step in sorted({int(s) for r in results.values() for s in r["checkpoints"]}):
        cells = []
        for n in names:
            st = results[n]["checkpoints"].get(str(step))
            if st is None:
                continue

            def tot(k: str, st: dict = st) -> float:
                return math.sqrt(sum(v * v for v in st[k].values()))

            cells.append(f"{n} w {tot('weight'):.3f} dw {tot('update'):.4f} g {tot('grad'):.3f}")
        print(f"step {step}: " + "; ".join(cells))


def print_compare(cmp: dict, top: int) -> None:
    print("\nper-tensor comparisons: ||a - b|| / ||b||, model-wide (largest tensor)")
    for step, pairs in cmp.items():
        print(f"step {step}")
        print(f"  {'pair':<24} " + " ".join(f"{k:>26}" for k in KINDS))
        for pair, kinds in pairs.items():
            cells = []
            for k in KINDS:
                d = kinds[k]
                worst = max((v, n) for n, v in d.items() if n != "*") if len(d) > 1 else (0, "")
                cells.append(f"{d['*']:.2e} ({worst[0]:.1e} {short(worst[1])})")
            print(f"  {pair:<24} " + " ".join(f"{c:>26}" for c in cells))
    print_bf16_tensors(cmp, top)


def short(name: str) -> str:
    return name.replace("transformer.", "").replace(".weight", ".w").replace(".bias", ".b")[:12]


def print_bf16_tensors(cmp: dict, top: int) -> None:
    """Per tensor: each ours:bf16 run's and torch:bf16's distance from the reference, and their
    ratio, largest first."""
    for step, pairs in cmp.items():
        tkey = next((k for k in pairs if k.startswith("torch:bf16~")), None)
        if tkey is None:
            continue
        t = pairs[tkey]
        suffix = tkey[len("torch:bf16") :]
        for okey in (k for k in pairs if k.startswith("ours:bf16") and k.endswith(suffix)):
            o = pairs[okey]
            for kind in ("grad", "weight", "exp_avg_sq"):
                rows = []
                for n in o[kind]:
                    if n == "*" or n not in t[kind]:
                        continue
                    ratio = o[kind][n] / t[kind][n] if t[kind][n] > 0 else math.inf
                    rows.append((ratio, n, o[kind][n], t[kind][n]))
                rows.sort(reverse=True)
                print(
                    f"step {step} {kind}: {okey.split('~')[0]} / torch:bf16 distance from "
                    f"{suffix[1:]}, largest ratios (model-wide {o[kind]['*']:.2e} / "
                    f"{t[kind]['*']:.2e})"
                )
                for ratio, n, ov, tv in rows[:top]:
                    print(f"    {n:<42} {ov:.2e} {tv:.2e}  x{ratio:.2f}")


def print_probe(pr: dict, top: int) -> None:
    print(
        "\nprobes at the reference run's weights (mean over the probe batches, +- its standard "
        "error): loss and its signed difference from the reference's, val loss, the final LN "
        "output's error, the gradient's error ||g - r||/||r|| and scale bias <g - r, r>/||r||^2 "
        "(model-wide; then the tensors with the largest |bias| / error)"
    )
    for step, res in pr.items():
        print(f"step {step}")
        for name, r in res.items():
            g, s, se = r["grad_rel"], r["grad_scale"], r["grad_scale_sem"]
            print(
                f"  {name:<24} loss {r['loss']:.5f} ({r['loss_bias']:+.2e} +- "
                f"{r['loss_bias_sem']:.1e}) val {r['val']:.5f} LN out {r['hidden_rel']:.2e} "
                f"grad err {g['*']:.2e} bias {s['*']:+.2e} +- {se['*']:.1e}"
            )
            worst = sorted(
                ((abs(s[n]) / max(se[n], 1e-12), n) for n in s if n != "*"), reverse=True
            )[:top]
            if any(t > 3 for t, _ in worst):
                w = ", ".join(
                    f"{short(n)} {s[n]:+.1e}+-{se[n]:.0e} (err {g[n]:.1e})"
                    for t, n in worst
                    if t > 3
                )
                print(f"      biased (|bias| > 3 SE): {w}")


def strip(results: dict[str, dict]) -> dict[str, dict]:
    return {n: {k: v for k, v in r.items() if k != "_snap"} for n, r in results.items()}


def write_json(path: str | None, out: dict) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, path)


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", help="llm.c shards (*_train_*, *_val_*); default: Tiny Shakespeare")
    ap.add_argument("--model", default="gpt2", help="gpt2 (124M), tiny, or LxHxC")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-B", type=int, default=2)
    ap.add_argument("-T", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument(
        "--stop-at",
        type=int,
        default=0,
        help="stop after this step of --steps' schedule (0: run all)",
    )
    ap.add_argument(
        "--deterministic", action="store_true", help="ours: bitwise-reproducible kernels"
    )
    ap.add_argument(
        "--runs",
        default="torch:fp32,ours:fp32,torch:tf32,ours:tf32,torch:bf16,ours:bf16",
        help="framework:precision list, in order (reference: torch:fp32, else ours:fp32)",
    )
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1337, help="the train loader's shuffle seed")
    ap.add_argument("--init-seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50, help="0: no validation")
    ap.add_argument("--eval-B", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=0, help="0: the whole val split")
    ap.add_argument("--checkpoints", default="1,10,100")
    ap.add_argument("--compare", action="store_true", help="per-tensor comparisons (host RAM)")
    ap.add_argument("--probe", action="store_true", help="every precision at the ref's weights")
    ap.add_argument("--probe-batches", type=int, default=8, help="batches each probe averages")
    ap.add_argument("--top", type=int, default=8, help="tensors listed per comparison")
    ap.add_argument("--quick", action="store_true", help="100 steps, --compare --probe")
    ap.add_argument("--ours-fused", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--compact-vocab", action="store_true", help="dense ids (small CPU models)")
    ap.add_argument(
        "--train-tokens", type=int, default=0, help="train on the first N tokens only (0: all)"
    )
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: the trainer's rule)")
    ap.add_argument(
        "--probe-ref",
        help="the run whose weights and gradients the probes use (default: the reference); "
        "e.g. ours:fp32 run here beside a --baseline torch:fp32",
    )
    ap.add_argument(
        "--probe-runs",
        help="the run kinds the probes build at the reference's weights (default: --runs); "
        "those not in --runs are not trained",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", help="an earlier call's JSON: its other runs join the tables")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.compare, a.probe = min(a.steps, 100), True, True
        a.eval_every = min(a.eval_every, 25) if a.eval_every else 0
    if not 0 <= a.stop_at <= a.steps:
        raise SystemExit(f"--stop-at {a.stop_at}: must be in 0..--steps ({a.steps}); 0 runs all")
    last = a.last = a.stop_at or a.steps
    asked = sorted({int(s) for s in a.checkpoints.split(",") if s})
    if a.stop_at and any(c > last for c in asked):
        raise SystemExit(
            f"--checkpoints {a.checkpoints!r}: past --stop-at {a.stop_at}, those would never come"
        )
    a.checkpoints = [c for c in asked if c <= a.steps]
    names = [r.strip() for r in a.runs.split(",") if r.strip()]
    a.run_names = names
    if a.probe_ref is not None and a.probe_ref not in names:
        raise SystemExit(f"--probe-ref {a.probe_ref!r} is not one of --runs ({a.runs!r})")
    probed = names
    if a.probe_runs is not None:
        probed = [r.strip() for r in a.probe_runs.split(",") if r.strip()]
        if not a.probe or not probed or len(set(probed)) != len(probed):
            raise SystemExit(
                f"--probe-runs {a.probe_runs!r}: needs --probe and a list of distinct runs"
            )
    for n in dict.fromkeys(names + probed):
        flag = "--runs" if n in names else "--probe-runs"
        fw, prec, variant = split_name(n)
        if fw not in FRAMEWORKS or prec not in ("fp32", "tf32", "bf16"):
            raise SystemExit(
                f"{flag}: framework:precision[/variant] with ours|torch and fp32|tf32|bf16, "
                f"got {n!r}"
            )
        bad = set(variant.split("+")) - {""} - set(VARIANTS[fw])
        if bad:
            raise SystemExit(f"{flag}: {n!r}: {fw}'s variants are {VARIANTS[fw]} ('+' joins them)")
    if len(set(names)) != len(names):
        raise SystemExit(f"--runs lists a run twice: {a.runs!r}")
    if a.deterministic:
        import blutrain.tensor as bt

        bt.cuda.use_deterministic_algorithms(True)
    if a.device == "cpu":  # the one CPU budget (op loops and BLAS), torch given the same
        from blutrain.models.device import set_threads

        n = set_threads(a.threads)
        import torch

        torch.set_num_threads(max(1, n))

    from blutrain.models.config import GPT2Config

    data = Data(a.data, a.compact_vocab, a.train_tokens)
    L, H, C = parse_model(a.model)
    cfg = GPT2Config(
        block_size=max(a.T, 64),
        vocab_size=data.vocab_size,
        n_layer=L,
        n_head=H,
        n_embd=C,
        vocab_multiple=128,
    )
    n_val = data.loader("val", a.eval_B, a.T, 0).batches_per_epoch
    a.eval_batches = n_val if a.eval_batches <= 0 else min(a.eval_batches, n_val)
    tokens = a.B * a.T * a.last  # the tokens this call trains on (--stop-at: its steps)
    print(
        f"GPT-2 L={L} H={H} C={C} V={cfg.vocab_size} ({cfg.n_params() / 1e6:.1f}M) on {a.device}; "
        f"B={a.B} T={a.T}, {a.steps} steps{f' (stopping at {a.stop_at})' if a.stop_at else ''} "
        f"= {tokens:,} tokens = "
        f"{tokens / data.tokens['train']:.2f} epochs of {data.tokens['train']:,}; val "
        f"{a.eval_batches} x {a.eval_B} x {a.T} tokens every {a.eval_every} steps; lr {a.lr} "
        f"warmup {a.warmup} cosine to {a.min_lr}, wd {a.weight_decay}, clip {a.clip}",
        flush=True,
    )
    base = load_baseline(a.baseline, a, names) if a.baseline else {}
    if base:
        print(f"baseline runs (not rerun; tok/s of that call): {', '.join(base)} from {a.baseline}")
    state = make_state(cfg, a.init_seed)
    ref = reference(list(base) + names)
    a.probe_ref = a.probe_ref or ref
    if a.probe and a.probe_ref in base:
        raise SystemExit(
            f"--probe needs its reference {a.probe_ref} run here, not from --baseline "
            "(--probe-ref names another run)"
        )
    # the reference first, then torch:bf16: later runs are compared with them as they end and
    # their host snapshots dropped (GPT-2 124M: 2.5 GB a checkpoint)
    order = [ref] + [n for n in names if n == "torch:bf16" != ref]
    order = [n for n in order if n not in base] + [n for n in names if n not in order]
    results: dict[str, dict] = dict(base)
    cmp: dict[str, dict] = {}
    for name in order:
        t = time.perf_counter()
        results[name] = train(name, cfg, state, data, a)
        release(a.device)
        r = results[name]
        print(
            f"{name:<24} {time.perf_counter() - t:6.1f} s, {r['tokens_per_s']:8.0f} tok/s, "
            f"train {np.mean(r['loss'][-max(1, len(r['loss']) // 10) :]):.4f}, val "
            f"{r['val'][-1][1] if r['val'] else math.nan:.4f}",
            flush=True,
        )
        if a.compare:
            compare_run(name, results, cmp)
            if name not in (ref, "torch:bf16", a.probe_ref):
                r["_snap"] = {}
        partial = {"args": vars(a), "reference": ref, "partial": True, "compare": cmp}
        write_json(a.json, {**partial, "runs": strip(results)})  # kept if a later run is cut
    results = {n: results[n] for n in list(base) + names}  # baselines, then the order asked for
    summary = summarize(results, a)
    print_curves(results, a)
    print_checkpoints(results)
    print_summary(summary, a, ref)
    import blutrain.tensor as bt

    out: dict[str, Any] = {
        "args": {k: v for k, v in vars(a).items()},
        "deterministic_algorithms": bt.are_deterministic_algorithms_enabled(),  # as ours ran
        "reference": ref,
        "summary": summary,
        "runs": strip(results),
    }
    if cmp:
        out["compare"] = cmp
        print_compare(cmp, a.top)
    if a.probe:
        snaps = results[a.probe_ref]["_snap"]
        for r in results.values():
            r["_snap"] = {}  # the host copies: free before the probes
        out["probe"] = probe(cfg, snaps, data, probed, a)  # (--probe-ref ran here)
        print_probe(out["probe"], a.top)
    if a.json:
        write_json(a.json, out)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
