"""A GPT-2 transformer block written with blutrain.tensor.nn (shared by the capture and
PyTorch-fidelity tests; the real model lives in blutrain-models)."""

from __future__ import annotations

import blutrain.tensor as bt
from blutrain.tensor import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, dtype=None) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, dtype=dtype)
        self.c_proj = nn.Linear(n_embd, n_embd, dtype=dtype)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, 2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = bt.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0, dtype=None) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, dtype=dtype)
        self.gelu = nn.GELU("tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4, dropout: float = 0.0, dtype=None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, dtype=dtype)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, dtype)
        self.ln_2 = nn.LayerNorm(n_embd, dtype=dtype)
        self.mlp = MLP(n_embd, dropout, dtype)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
