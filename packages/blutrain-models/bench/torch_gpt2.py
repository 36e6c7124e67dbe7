"""A functional PyTorch GPT-2 over a dict of tensors with our canonical names and layouts: the
reference of bench_convergence.py (and its per-tensor comparisons).

    params = torch_params(state, "cuda")            # state: name -> float32 numpy (ours)
    loss = torch_loss(params, cfg, x, y)            # x, y: int64 (B, T) torch tensors
    with torch.autocast("cuda", torch.bfloat16):    # bf16 as PyTorch users train it
        loss = torch_loss(params, cfg, x, y)

GPT-2 as Hugging Face computes it (pre-LN, tanh GELU, tied head), written in plain torch.nn.
functional calls, so autocast decides every dtype as it does for nanoGPT: linears and attention in
bf16, layer norms, the embeddings' sum, the residual stream and the loss in float32, float32
parameters with float32 gradients. The vocabulary may be padded (wte of padded_vocab_size rows):
the head GEMM runs over the padded rows and the loss reads the first vocab_size columns, as ours.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def torch_params(state: dict[str, np.ndarray], device: str) -> dict[str, Any]:
    """Float32 leaf tensors (requires_grad) from float32 numpy arrays, same names."""
    import torch

    return {
        k: torch.tensor(np.ascontiguousarray(v, dtype=np.float32), device=device).requires_grad_()
        for k, v in state.items()
    }


def decay_groups(params: dict[str, Any], weight_decay: float) -> list[dict]:
    """AdamW parameter groups as ours: decay on tensors with dim >= 2 only."""
    return [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]


def torch_hidden(params: dict[str, Any], cfg: Any, idx: Any) -> Any:
    """The final LayerNorm's output (B, T, C)."""
    import torch
    import torch.nn.functional as F

    B, T = idx.shape
    C, H = cfg.n_embd, cfg.n_head
    eps = cfg.layer_norm_epsilon
    p = params
    pos = torch.arange(T, device=idx.device)
    x = F.embedding(idx, p["transformer.wte.weight"]) + F.embedding(
        pos, p["transformer.wpe.weight"]
    )
    for i in range(cfg.n_layer):
        q = f"transformer.h.{i}."
        h = F.layer_norm(x, (C,), p[q + "ln_1.weight"], p[q + "ln_1.bias"], eps)
        qkv = F.linear(h, p[q + "attn.c_attn.weight"], p[q + "attn.c_attn.bias"])
        qq, kk, vv = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
        y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.linear(y, p[q + "attn.c_proj.weight"], p[q + "attn.c_proj.bias"])
        h = F.layer_norm(x, (C,), p[q + "ln_2.weight"], p[q + "ln_2.bias"], eps)
        u = F.linear(h, p[q + "mlp.c_fc.weight"], p[q + "mlp.c_fc.bias"])
        x = x + F.linear(
            F.gelu(u, approximate="tanh"), p[q + "mlp.c_proj.weight"], p[q + "mlp.c_proj.bias"]
        )
    return F.layer_norm(x, (C,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], eps)


def torch_loss(params: dict[str, Any], cfg: Any, idx: Any, targets: Any) -> Any:
    """Mean cross-entropy (float32) of the tied head over the first vocab_size columns; targets
    of -1 are ignored."""
    import torch.nn.functional as F

    h = torch_hidden(params, cfg, idx)
    logits = F.linear(h, params["transformer.wte.weight"])  # (B, T, padded V)
    V = cfg.vocab_size
    if logits.shape[-1] > V:
        logits = logits[..., :V]
    return F.cross_entropy(
        logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1
    )  # autocast: float32
