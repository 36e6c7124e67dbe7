"""A LLaMA-style model (RMSNorm, rotary embeddings, causal attention, SwiGLU MLP, no biases,
untied head) written twice, in primitive blutrain.tensor ops and in PyTorch, with the same
initialisation, for the compiler benchmark: ours eager, ours compiled, torch eager and
torch.compile all train exactly this model and config. blutrain.models' LLaMA (issue 34,
section 3) is used instead when it exists (`--model models`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Config:
    vocab: int = 32000
    n_layer: int = 8
    n_head: int = 8
    dim: int = 512
    hidden: int = 1376  # SwiGLU width (8/3 * dim, rounded to 32)
    seq: int = 512
    eps: float = 1e-5

    @staticmethod
    def preset(name: str) -> Config:
        return {
            "tiny": Config(vocab=512, n_layer=2, n_head=4, dim=64, hidden=192, seq=64),
            "small": Config(),
            "medium": Config(vocab=32000, n_layer=16, n_head=16, dim=1024, hidden=2752, seq=1024),
        }[name]


def init_weights(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}

    def n(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w["tok"] = n(cfg.vocab, cfg.dim)
    for i in range(cfg.n_layer):
        p = f"l{i}."
        w[p + "attn_norm"] = np.ones(cfg.dim, np.float32)
        w[p + "wq"], w[p + "wk"], w[p + "wv"] = (n(cfg.dim, cfg.dim) for _ in range(3))
        w[p + "wo"] = n(cfg.dim, cfg.dim, std=0.02 / math.sqrt(2 * cfg.n_layer))
        w[p + "mlp_norm"] = np.ones(cfg.dim, np.float32)
        w[p + "w1"], w[p + "w3"] = n(cfg.hidden, cfg.dim), n(cfg.hidden, cfg.dim)
        w[p + "w2"] = n(cfg.dim, cfg.hidden, std=0.02 / math.sqrt(2 * cfg.n_layer))
    w["norm"] = np.ones(cfg.dim, np.float32)
    w["head"] = n(cfg.vocab, cfg.dim)
    return w


def rope_tables(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    hd = cfg.dim // cfg.n_head
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.outer(np.arange(cfg.seq, dtype=np.float64), inv)  # (T, hd/2)
    ang = np.concatenate([ang, ang], -1)  # rotate-half layout
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- blutrain.tensor ----------------------------------------------------------------------
def bt_forward(bt, cfg: Config, w: dict, cos, sin, idx, tgt):
    B, T = idx.shape
    H, D = cfg.n_head, cfg.dim // cfg.n_head

    def rms(x, g):
        return x * bt.rsqrt((x * x).mean(-1, keepdim=True) + cfg.eps) * g

    def rot(x):  # (B, H, T, D): x * cos + rotate_half(x) * sin
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + bt.cat([-x2, x1], -1) * sin

    x = bt.embedding(idx, w["tok"])
    for i in range(cfg.n_layer):
        p = f"l{i}."
        h = rms(x, w[p + "attn_norm"])
        q = bt.linear(h, w[p + "wq"]).reshape(B, T, H, D).permute(0, 2, 1, 3)
        k = bt.linear(h, w[p + "wk"]).reshape(B, T, H, D).permute(0, 2, 1, 3)
        v = bt.linear(h, w[p + "wv"]).reshape(B, T, H, D).permute(0, 2, 1, 3)
        a = bt.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        x = x + bt.linear(a.permute(0, 2, 1, 3).reshape(B, T, cfg.dim), w[p + "wo"])
        h = rms(x, w[p + "mlp_norm"])
        g = bt.linear(h, w[p + "w1"])
        x = x + bt.linear(g * bt.sigmoid(g) * bt.linear(h, w[p + "w3"]), w[p + "w2"])
    logits = bt.linear(rms(x, w["norm"]), w["head"])
    return bt.cross_entropy(logits.reshape(B * T, cfg.vocab), tgt.reshape(B * T))


def bt_adamw(bt, params: dict, state: dict, lr, t, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """AdamW written with ops (lr and the step count t are 0-d tensors: runtime arguments of a
    compiled step), the arithmetic of torch.optim.AdamW's single-tensor path."""
    with bt.no_grad():
        bc1 = 1 - bt.pow(bt.full((), b1, device=t.device), t)
        bc2 = 1 - bt.pow(bt.full((), b2, device=t.device), t)
        for name, p in params.items():
            g = p.grad
            m, v = state[name]
            if p.ndim >= 2:
                p.mul_(1 - lr * wd)
            m.mul_(b1).add_(g * (1 - b1))
            v.mul_(b2).add_(g * g * (1 - b2))
            p.sub_(lr * (m / bc1) / (bt.sqrt(v / bc2) + eps))


def bt_step(bt, cfg: Config, params: dict, state: dict, cos, sin):
    """The training step the benchmarks and tests compile: forward, backward, bt_adamw (lr and
    t runtime arguments), the gradients dropped; step(idx, tgt, lr, t) -> loss."""

    def step(idx, tgt, lr, t):
        loss = bt_forward(bt, cfg, params, cos, sin, idx, tgt)
        loss.backward()
        bt_adamw(bt, params, state, lr, t)
        for p in params.values():
            p.grad = None
        return loss

    return step


def models_adamw(named: list) -> tuple[Any, list]:
    """blutrain.models' AdamW (lr 1e-3, weight decay 0.1) over named (name, parameter) pairs,
    reading its lr and step count from device scalars, its moments made now (a compiled or
    captured step then only updates them): (the optimizer, the parameters)."""
    from blutrain.models.optim import AdamW

    opt = AdamW(named, lr=1e-3, weight_decay=0.1)
    opt.use_device_scalars()
    for n, p in opt.params:
        opt._state_for(n, p)
    return opt, [p for _, p in opt.params]


def bt_models_step(bt, cfg: Config, params: dict, cos, sin):
    """The step with blutrain.models' AdamW (device lr and step count, clipping at 1.0):
    (step(idx, tgt) -> loss, the optimizer, whose moments exist already)."""
    from blutrain.models.optim import grad_norm_and_clip_coef

    opt, plist = models_adamw(list(params.items()))

    def step(idx, tgt):
        loss = bt_forward(bt, cfg, params, cos, sin, idx, tgt)
        loss.backward()
        _, coef = grad_norm_and_clip_coef(plist, 1.0)
        opt.step(grad_scale=coef)
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


# ---- PyTorch ------------------------------------------------------------------------------
def torch_model(torch, cfg: Config, w: dict, device: str):
    nn = torch.nn
    F = torch.nn.functional

    class RMS(nn.Module):
        def __init__(self, g):
            super().__init__()
            self.weight = nn.Parameter(torch.tensor(g))

        def forward(self, x):
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.eps) * self.weight

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.ParameterDict(
                {k.replace(".", "_"): nn.Parameter(torch.tensor(v)) for k, v in w.items()}
            )
            cos, sin = rope_tables(cfg)
            self.register_buffer("cos", torch.tensor(cos))
            self.register_buffer("sin", torch.tensor(sin))

        def forward(self, idx, tgt):
            B, T = idx.shape
            H, D = cfg.n_head, cfg.dim // cfg.n_head
            P = self.p
            cos, sin = self.cos[:T], self.sin[:T]

            def rms(x, g):
                return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.eps) * g

            def rot(x):
                x1, x2 = x[..., : D // 2], x[..., D // 2 :]
                return x * cos + torch.cat([-x2, x1], -1) * sin

            x = F.embedding(idx, P["tok"])
            for i in range(cfg.n_layer):
                p = f"l{i}_"
                h = rms(x, P[p + "attn_norm"])
                q = F.linear(h, P[p + "wq"]).view(B, T, H, D).transpose(1, 2)
                k = F.linear(h, P[p + "wk"]).view(B, T, H, D).transpose(1, 2)
                v = F.linear(h, P[p + "wv"]).view(B, T, H, D).transpose(1, 2)
                a = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
                x = x + F.linear(a.transpose(1, 2).reshape(B, T, cfg.dim), P[p + "wo"])
                h = rms(x, P[p + "mlp_norm"])
                x = x + F.linear(
                    F.silu(F.linear(h, P[p + "w1"])) * F.linear(h, P[p + "w3"]), P[p + "w2"]
                )
            logits = F.linear(rms(x, P["norm"]), P["head"])
            return F.cross_entropy(logits.view(B * T, -1), tgt.view(B * T))

    del RMS
    return Llama().to(device)
