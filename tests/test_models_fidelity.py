"""Fidelity of blutrain.models' GPT-2 against a PyTorch fp32 GPT-2 written here (torch CPU).

Same Hugging Face weights (a GPT-2 directory written with random weights), same tokens: our
logits, loss and gradients match PyTorch's, and 10 AdamW steps (decay on dim >= 2 tensors only,
cosine schedule with warmup, gradient clipping) give the same losses, to 1e-5 relative.
bf16 (our precision policy on the CPU build): the gradients are as close to float64's as
PyTorch autocast's (issue 38's regression test).
torch is required: the test session installs it, and its absence is a failure, not a skip.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config, save_hf  # noqa: E402
from blutrain.models.checkpoint import load_safetensors  # noqa: E402
from blutrain.models.optim import AdamW, CosineSchedule, clip_grad_norm_  # noqa: E402

F = torch.nn.functional
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
RTOL = 1e-5


# -- the PyTorch reference: GPT-2 as Hugging Face's GPT2LMHeadModel computes it -----------------


class TorchBlock(torch.nn.Module):
    def __init__(self, C: int, H: int, eps: float) -> None:
        super().__init__()
        self.H = H
        self.ln_1 = torch.nn.LayerNorm(C, eps=eps)
        self.c_attn = torch.nn.Linear(C, 3 * C)
        self.attn_proj = torch.nn.Linear(C, C)
        self.ln_2 = torch.nn.LayerNorm(C, eps=eps)
        self.c_fc = torch.nn.Linear(C, 4 * C)
        self.mlp_proj = torch.nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        H, D = self.H, C // self.H
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # HF: divide by sqrt(head_dim)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_proj(h)


class TorchGPT2(torch.nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        C = cfg.n_embd
        self.wte = torch.nn.Embedding(cfg.vocab_size, C)
        self.wpe = torch.nn.Embedding(cfg.block_size, C)
        self.h = torch.nn.ModuleList(
            TorchBlock(C, cfg.n_head, cfg.layer_norm_epsilon) for _ in range(cfg.n_layer)
        )
        self.ln_f = torch.nn.LayerNorm(C, eps=cfg.layer_norm_epsilon)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied head
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def load_hf(self, hf: dict[str, np.ndarray]) -> None:
        """Hugging Face tensors (Conv1D weights (in, out)) into this model, by hand."""
        hf = {k.removeprefix("transformer."): v for k, v in hf.items()}

        def put(param, key):
            a = hf[key]
            if key.endswith(CONV1D):
                a = a.T
            with torch.no_grad():
                param.copy_(torch.from_numpy(np.ascontiguousarray(a)))

        put(self.wte.weight, "wte.weight")
        put(self.wpe.weight, "wpe.weight")
        for i, b in enumerate(self.h):
            p = f"h.{i}."
            put(b.ln_1.weight, p + "ln_1.weight")
            put(b.ln_1.bias, p + "ln_1.bias")
            put(b.c_attn.weight, p + "attn.c_attn.weight")
            put(b.c_attn.bias, p + "attn.c_attn.bias")
            put(b.attn_proj.weight, p + "attn.c_proj.weight")
            put(b.attn_proj.bias, p + "attn.c_proj.bias")
            put(b.ln_2.weight, p + "ln_2.weight")
            put(b.ln_2.bias, p + "ln_2.bias")
            put(b.c_fc.weight, p + "mlp.c_fc.weight")
            put(b.c_fc.bias, p + "mlp.c_fc.bias")
            put(b.mlp_proj.weight, p + "mlp.c_proj.weight")
            put(b.mlp_proj.bias, p + "mlp.c_proj.bias")
        put(self.ln_f.weight, "ln_f.weight")
        put(self.ln_f.bias, "ln_f.bias")

    def named_canonical(self):
        """(our canonical name, torch parameter) pairs."""
        out = [
            ("transformer.wte.weight", self.wte.weight),
            ("transformer.wpe.weight", self.wpe.weight),
        ]
        for i, b in enumerate(self.h):
            p = f"transformer.h.{i}."
            out += [
                (p + "ln_1.weight", b.ln_1.weight),
                (p + "ln_1.bias", b.ln_1.bias),
                (p + "attn.c_attn.weight", b.c_attn.weight),
                (p + "attn.c_attn.bias", b.c_attn.bias),
                (p + "attn.c_proj.weight", b.attn_proj.weight),
                (p + "attn.c_proj.bias", b.attn_proj.bias),
                (p + "ln_2.weight", b.ln_2.weight),
                (p + "ln_2.bias", b.ln_2.bias),
                (p + "mlp.c_fc.weight", b.c_fc.weight),
                (p + "mlp.c_fc.bias", b.c_fc.bias),
                (p + "mlp.c_proj.weight", b.mlp_proj.weight),
                (p + "mlp.c_proj.bias", b.mlp_proj.bias),
            ]
        out += [
            ("transformer.ln_f.weight", self.ln_f.weight),
            ("transformer.ln_f.bias", self.ln_f.bias),
        ]
        return out


# -- helpers -------------------------------------------------------------------------------------


def rel_err(a, b) -> float:
    """Normwise relative error max|a - b| / max|b| (entrywise would be meaningless near 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


TINY = GPT2Config(block_size=32, vocab_size=317, n_layer=2, n_head=4, n_embd=32)


def hf_dir(tmp_path, cfg: GPT2Config, rng: np.random.Generator, std: float = 0.02):
    """A Hugging Face GPT-2 directory with GPT-2-like random weights (LN weights near 1)."""
    weights = {}
    for k, s in cfg.param_shapes(padded=False).items():
        a = rng.standard_normal(s) * std
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            a = 1.0 + 0.1 * rng.standard_normal(s)
        elif k.endswith("bias"):
            a = 0.02 * rng.standard_normal(s)
        weights[k] = a.astype(np.float32)
    path = tmp_path / "hf"
    save_hf(path, weights, cfg)
    return path


@pytest.fixture
def rng(request):
    # Fresh inputs every run, printed so a failure can be replayed: BLUTRAIN_TEST_SEED=N pytest ...
    fixed = os.environ.get("BLUTRAIN_TEST_SEED")
    seed = int(fixed) if fixed else np.random.SeedSequence().entropy % (2**32)
    print(f"numpy seed {seed} for {request.node.name}")
    return np.random.default_rng(seed)


def both_models(tmp_path, rng, cfg=TINY, vocab_multiple=1, std=0.02):
    path = hf_dir(tmp_path, cfg, rng, std)
    ours = GPT2.from_pretrained(path, vocab_multiple=vocab_multiple)
    ref = TorchGPT2(cfg)
    hf = load_safetensors(path / "model.safetensors")
    # from_pretrained must take keys with or without "transformer.": the file has them with it
    assert all(k.startswith("transformer.") for k in hf)
    ref.load_hf(hf)
    return ours, ref


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_multiple", [1, 128])
@pytest.mark.parametrize("std", [0.02, 0.3])
def test_logits_and_loss_match_pytorch(tmp_path, rng, vocab_multiple, std):
    torch.set_num_threads(2)
    ours, ref = both_models(tmp_path, rng, vocab_multiple=vocab_multiple, std=std)
    B, T = 3, TINY.block_size
    x = rng.integers(0, TINY.vocab_size, (B, T))
    y = rng.integers(0, TINY.vocab_size, (B, T))
    logits, loss = ours(x, y)
    with torch.no_grad():
        rlogits, rloss = ref(torch.from_numpy(x), torch.from_numpy(y))
    assert tuple(logits.shape) == (B, T, TINY.vocab_size)
    e_logits = rel_err(logits.detach().numpy(), rlogits.detach().numpy())
    e_loss = abs(loss.item() - rloss.item()) / abs(rloss.item())
    print(f"logits rel err {e_logits:.2e}, loss rel err {e_loss:.2e}")
    assert e_logits < RTOL
    assert e_loss < RTOL
    # shorter sequences use the first positions only
    logits5, _ = ours(x[:, :5])
    assert rel_err(logits5.detach().numpy(), rlogits.detach().numpy()[:, :5]) < RTOL


def test_gradients_match_pytorch(tmp_path, rng):
    torch.set_num_threads(2)
    ours, ref = both_models(tmp_path, rng, std=0.1)
    x = rng.integers(0, TINY.vocab_size, (2, 16))
    y = rng.integers(0, TINY.vocab_size, (2, 16))
    _, loss = ours(x, y)
    loss.backward()
    _, rloss = ref(torch.from_numpy(x), torch.from_numpy(y))
    rloss.backward()
    mine = dict(ours.named_parameters())
    worst = 0.0
    for name, p in ref.named_canonical():
        e = rel_err(mine[name].grad.detach().numpy(), p.grad.detach().numpy())
        worst = max(worst, e)
        assert e < 1e-4, f"{name}: gradient rel err {e:.2e}"
    print(f"worst gradient rel err {worst:.2e}")


@pytest.fixture
def one_torch_thread():
    """PyTorch's float32 GEMMs round differently with its thread count (which MKL may lower on a
    loaded machine); a reference that Adam's steps amplify should not depend on that."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("accum", [1, 2])
def test_ten_adamw_steps_match_pytorch(tmp_path, rng, accum, one_torch_thread):
    cfg = TINY
    ours, ref = both_models(tmp_path, rng, cfg, vocab_multiple=128)
    lr, wd, steps = 3e-3, 0.1, 10
    sched = CosineSchedule(lr, warmup_steps=3, max_steps=steps, min_lr=lr / 10)
    opt = AdamW(ours.named_parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    named = ref.named_canonical()
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    ropt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    B, T = 4, cfg.block_size
    # two fixed batches (per micro-step) seen again and again: the model must fit them
    data = np.broadcast_to(
        rng.integers(0, cfg.vocab_size, (1, accum, B, T + 1)), (steps, accum, B, T + 1)
    )
    losses, rlosses = [], []
    for s in range(steps):
        opt.set_lr(sched(s))
        for g in ropt.param_groups:
            g["lr"] = sched(s)
        tot, rtot = 0.0, 0.0
        for a in range(accum):
            x, y = data[s, a, :, :-1], data[s, a, :, 1:]
            _, loss = ours(x, y)
            (loss / accum).backward()
            tot += loss.item() / accum
            _, rloss = ref(torch.from_numpy(x.copy()), torch.from_numpy(y.copy()))
            (rloss / accum).backward()
            rtot += rloss.item() / accum
        clip_grad_norm_(ours.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
        losses.append(tot)
        rlosses.append(rtot)
    errs = [abs(a - b) / abs(b) for a, b in zip(losses, rlosses, strict=True)]
    print("ours ", np.round(losses, 6).tolist())
    print("torch", np.round(rlosses, 6).tolist())
    print(f"max loss rel err over {steps} steps: {max(errs):.2e}")
    assert losses[-1] < losses[0] - 0.05  # it trains
    assert max(errs) < RTOL
    # Weights agree less tightly than losses: where an entry's true gradient is (near) zero (the
    # key bias's always is: softmax is shift-invariant), what both compute is rounding noise that
    # Adam divides by its own size into steps up to lr of either sign. So 999 in 1000 entries of
    # every tensor must agree to 5e-4 of its largest entry (measured <= 2e-4 over seeds) and a
    # lone entry to 1e-2 (measured up to 1.05e-3, seed 938864499: one c_proj weight).
    mine = ours.state_dict()
    worst = 0.0
    for name, p in named:
        a = mine[name][: cfg.vocab_size] if name.endswith("wte.weight") else mine[name]
        b = p.detach().numpy().astype(np.float64)
        err = np.abs(np.asarray(a, np.float64) - b) / max(np.abs(b).max(), 1e-30)
        worst = max(worst, float(err.max()))
        assert np.quantile(err, 0.999) < 5e-4, (name, float(np.quantile(err, 0.999)))
        assert err.max() < 1e-2, (name, float(err.max()))
    print(f"worst weight rel err after {steps} steps: {worst:.2e}")
    # padded rows of wte never moved
    assert not mine["transformer.wte.weight"][cfg.vocab_size :].any()


def test_hf_directory_without_prefix_and_config(tmp_path, rng):
    """from_pretrained reads keys without "transformer." too; config.json drives the shape."""
    from safetensors.numpy import save_file

    path = hf_dir(tmp_path, TINY, rng)
    sd = load_safetensors(path / "model.safetensors")
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    save_file(
        {k.removeprefix("transformer."): v for k, v in sd.items()},
        str(stripped / "model.safetensors"),
    )
    (stripped / "config.json").write_text((path / "config.json").read_text())
    a, b = GPT2.from_pretrained(path), GPT2.from_pretrained(stripped)
    assert (
        a.config
        == b.config
        == GPT2Config.from_hf_dict(json.loads((path / "config.json").read_text()))
    )
    x = rng.integers(0, TINY.vocab_size, (2, 8))
    assert np.array_equal(a(x)[0].detach().numpy(), b(x)[0].detach().numpy())


# -- bf16: as close to the float64 gradients as autocast (issue 38) ------------------------------

MIXED = GPT2Config(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=128)


def trained_like(cfg: GPT2Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights shaped like a trained GPT-2's where it matters for bf16: layer-norm weights
    spread around 1 (not bf16 values), embeddings larger than the branches' outputs."""
    L, w = cfg.n_layer, {}
    for k, s in cfg.param_shapes(padded=False).items():
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            a = 1 + 0.3 * rng.uniform(-1, 1, s)
        elif k.endswith("bias"):
            a = 0.02 * rng.standard_normal(s)
        elif k.endswith(("wte.weight", "wpe.weight")):
            a = 0.1 * rng.standard_normal(s)
        elif k.endswith("c_proj.weight"):
            a = 0.02 / math.sqrt(2 * L) * rng.standard_normal(s)
        else:
            a = 0.06 * rng.standard_normal(s)
        w[k] = a.astype(np.float32)
    return w


def grad_error(grads: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """Model-wide ||g - ref|| / ||ref|| over every parameter."""
    num = sum(float(((grads[k] - v) ** 2).sum()) for k, v in ref.items())
    return math.sqrt(num / sum(float((v**2).sum()) for v in ref.values()))


def bf16_gradients(tmp_path, rng, cfg: GPT2Config):
    """One batch at trained-like weights: (PyTorch float64's gradients, autocast bf16's, and
    ours(fused, residual, grad, flash) -> our bf16 gradients with those options)."""
    weights = trained_like(cfg, rng)
    path = tmp_path / "hf"
    save_hf(path, weights, cfg)
    B, T = 4, cfg.block_size
    x = rng.integers(0, cfg.vocab_size, (B, T))
    y = rng.integers(0, cfg.vocab_size, (B, T))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def torch_grads(dtype, autocast):
        ref = TorchGPT2(cfg).to(dtype)
        ref.load_hf(load_safetensors(path / "model.safetensors"))
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            ref(xt, yt)[1].backward()
        return {n: p.grad.double().numpy() for n, p in ref.named_canonical()}

    def ours(fused, residual="float32", grad="compute", flash=False):
        m = GPT2.from_pretrained(path)
        m.fused = fused
        m.residual_dtype = residual
        m.residual_grad_dtype = grad
        m.set_precision("bf16")
        with bt.backends.use_flash_attention_cpu(flash):
            _, loss = m(x, y)
            loss.backward()
        return {n: p.grad.numpy().astype(np.float64) for n, p in m.named_parameters()}

    return torch_grads(torch.float64, False), torch_grads(torch.float32, True), ours


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_gradients_as_close_to_float64_as_autocast(tmp_path, rng, fused, one_torch_thread):
    """Issue 38: our bf16 step drifted from the fp32 trajectory where autocast's did not, because
    the residual stream was bf16 (rounded at every add) and the layer norms used bf16 weights.
    With autocast's dtypes (a float32 stream, float32 norms into bf16 GEMMs; on the fused path
    one bt.add_layer_norm kernel, the stream's gradient in bf16) our gradient error against
    float64 is autocast's (measured 0.95-1.02x); the bf16 stream's was 1.2-1.36x."""
    ref64, auto, ours = bf16_gradients(tmp_path, rng, MIXED)
    e_torch = grad_error(auto, ref64)
    e_ours = grad_error(ours(fused), ref64)
    e_stream16 = grad_error(ours(fused, residual="compute"), ref64)
    print(
        f"gradient error vs float64: autocast {e_torch:.3e}, ours {e_ours:.3e} "
        f"({e_ours / e_torch:.2f}x), ours with a bf16 stream {e_stream16:.3e} "
        f"({e_stream16 / e_torch:.2f}x)"
    )
    assert e_ours <= 1.1 * e_torch
    # the setting tells the two streams apart (else this test could not catch the regression)
    assert e_stream16 > 1.15 * e_torch


DEEP = GPT2Config(block_size=64, vocab_size=512, n_layer=12, n_head=4, n_embd=192)


def layer_errors(grads: dict, ref: dict, n_layer: int) -> list[float]:
    """grad_error per block (0 .. n_layer - 1), then of the rest (embeddings, ln_f)."""
    groups = [[k for k in ref if f".h.{i}." in k] for i in range(n_layer)]
    groups.append([k for k in ref if ".h." not in k])
    return [grad_error({k: grads[k] for k in g}, {k: ref[k] for k in g}) for g in groups]


def test_bf16_gradients_per_layer_as_close_as_autocast(tmp_path, rng, one_torch_thread):
    """Issue 38, per layer and 12 deep (the model-wide error hides it): on the fused path the
    float32 stream's gradient carried in bf16 (residual_grad_dtype "compute", rounded at every
    add on its way down) grows the error with depth: measured 1.23-1.34x autocast's at layer 0,
    0.86x at the top; carried float32 ("float32", autocast's) it stays under autocast's in every
    layer (at most 0.89-0.93x over 15 runs). Attention as CUDA computes it (float32 scores: the
    CPU's flash path)."""
    ref64, auto, ours = bf16_gradients(tmp_path, rng, DEEP)
    e_torch = layer_errors(auto, ref64, DEEP.n_layer)

    def over_autocast(grads):
        return [e / t for e, t in zip(layer_errors(grads, ref64, DEEP.n_layer), e_torch)]

    wide = over_autocast(ours(True, grad="float32", flash=True))
    narrow = over_autocast(ours(True, flash=True))
    print(
        "per layer (0 .. 11, rest), over autocast's: float32 gradient "
        + " ".join(f"{r:.2f}" for r in wide)
        + "; bf16 gradient "
        + " ".join(f"{r:.2f}" for r in narrow)
    )
    assert max(wide) <= 1.05, wide
    # the setting tells the two apart (else the test could not catch a gradient rounded again)
    assert narrow[0] > 1.15 and narrow[-1] > 1.1, narrow
