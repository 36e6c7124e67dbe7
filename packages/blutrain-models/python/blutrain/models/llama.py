"""A LLaMA-style language model written only in primitive blutrain.tensor ops.

    from blutrain.models import Llama, LlamaConfig
    model = Llama(LlamaConfig.from_name("llama-tiny"))
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int (bt or numpy)
    out = model.generate(idx, 50, temperature=0.8, top_k=40, seed=0)

Pre-norm blocks with RMSNorm (float32 statistics), rotary position embedding on queries and
keys (the "rotate half" form of GPT-NeoX and Hugging Face's LlamaForCausalLM, base
`rope_theta`), causal attention through bt.scaled_dot_product_attention (grouped queries when
n_kv_head < n_head), a SwiGLU MLP (down(silu(gate(x)) * up(x))), no biases, and an output head
of its own (untied). Everything but the GEMMs and attention is elementwise ops, reductions
and views: no fused kernels, which is the point. blutrain-compiler fuses what a hand-written
kernel would (the norm, the rotary, the SwiGLU, the loss) from the captured graph.

Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``...; Linear
layout (out, in)); LlamaConfig.param_shapes() lists them. Initialization: every weight
N(0, init_std), the residual projections (o_proj, down_proj) N(0, init_std / sqrt(2 n_layer)),
norms 1. The loss ignores targets equal to -1, as GPT-2's does.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._tensor import bt
from .checkpoint import CheckpointError, check_tensors, to_numpy
from .config import LLAMA_RECOMPUTE, LlamaConfig, parse_recompute, recompute_name
from .gpt2 import GPT2, IGNORE_INDEX, _cast, _normal, _Precision, set_matmul_precision

nn = bt.nn


def _silu(x: bt.Tensor) -> bt.Tensor:
    return x * bt.sigmoid(x)


class RMSNorm(_Precision, nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim; the statistics in float32
    (16-bit x is widened first and the result narrowed back before the weight, as LLaMA)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(bt.ones(dim))

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        dt = x.dtype
        xf = x.float() if dt in (bt.bfloat16, bt.float16) else x
        ms = (xf * xf).mean(-1, keepdim=True)
        y = xf * bt.rsqrt(ms + self.eps)
        return y.to(dt) * _cast(self.weight, dt)


def rotary_tables(config: LlamaConfig, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (T, head_dim) float32: position t, frequency i (of head_dim / 2) at
    columns i and i + head_dim / 2, angle t * rope_theta^(-2i / head_dim), computed in float64."""
    D = config.head_dim
    inv = config.rope_theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.outer(np.arange(T, dtype=np.float64), inv)
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rotary(x: bt.Tensor, cos: bt.Tensor, sin: bt.Tensor) -> bt.Tensor:
    """x (B, H, T, D) rotated by position: x cos + rotate_half(x) sin, with rotate_half(x) =
    cat(-x[..., D/2:], x[..., :D/2])."""
    D = x.shape[-1]
    h = D // 2
    rot = bt.cat([-x.narrow(-1, h, h), x.narrow(-1, 0, h)], -1)
    return x * cos + rot * sin


class Attention(_Precision, nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        C, D = config.n_embd, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, D
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, config.n_kv_head * D, bias=False)
        self.v_proj = nn.Linear(C, config.n_kv_head * D, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)

    def forward(self, x: bt.Tensor, cos: bt.Tensor, sin: bt.Tensor) -> bt.Tensor:
        B, T, C = x.shape
        H, KV, D, dt = self.n_head, self.n_kv_head, self.head_dim, self._compute
        q = bt.linear(x, _cast(self.q_proj.weight, dt)).view(B, T, H, D).transpose(1, 2)
        k = bt.linear(x, _cast(self.k_proj.weight, dt)).view(B, T, KV, D).transpose(1, 2)
        v = bt.linear(x, _cast(self.v_proj.weight, dt)).view(B, T, KV, D).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if KV != H:  # grouped queries: each key / value head serves H / KV query heads
            rep = H // KV
            k = k[:, :, None].expand(B, KV, rep, T, D).reshape(B, H, T, D)
            v = v[:, :, None].expand(B, KV, rep, T, D).reshape(B, H, T, D)
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return bt.linear(y, _cast(self.o_proj.weight, dt))


class MLP(_Precision, nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        C, F = config.n_embd, config.intermediate_size
        self.gate_proj = nn.Linear(C, F, bias=False)
        self.up_proj = nn.Linear(C, F, bias=False)
        self.down_proj = nn.Linear(F, C, bias=False)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        dt = self._compute
        g = bt.linear(x, _cast(self.gate_proj.weight, dt))
        u = bt.linear(x, _cast(self.up_proj.weight, dt))
        return bt.linear(_silu(g) * u, _cast(self.down_proj.weight, dt))


class Block(_Precision, nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.recompute = "none"

    def _attend(self, x: bt.Tensor, cos: bt.Tensor, sin: bt.Tensor) -> bt.Tensor:
        return self.self_attn(self.input_layernorm(x), cos, sin)

    def _body(self, x: bt.Tensor, cos: bt.Tensor, sin: bt.Tensor) -> bt.Tensor:
        if self.recompute == "attn":
            h = x + bt.checkpoint(self._attend, x, cos, sin)
        else:
            h = x + self._attend(x, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, x: bt.Tensor, cos: bt.Tensor, sin: bt.Tensor) -> bt.Tensor:
        if self.recompute == "block":
            return bt.checkpoint(self._body, x, cos, sin)
        return self._body(x, cos, sin)


class _Decoder(_Precision, nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.n_embd, config.norm_eps)


class Llama(_Precision, nn.Module):
    """LLaMA-style language model. ``logits, loss = model(idx, targets=None)``.

    idx: (B, T) or (T,) integer token ids (bt or numpy), T <= block_size. targets: like idx;
    entries equal to -1 are ignored by the loss. logits: (B, T, vocab_size) in the compute
    dtype; loss: a 0-d float32 tensor (mean cross-entropy over non-ignored targets) or None.
    ``return_logits=False`` with targets returns (None, loss). `precision`: "fp32", "tf32",
    "bf16" or a bt.amp.Policy (bf16 computes in bfloat16 on float32 master weights; the loss
    is float32). `recompute`: "none", "attn" or "block" (bt.checkpoint per block).
    """

    def __init__(
        self,
        config: LlamaConfig,
        device: str | None = None,
        *,
        init: bool = True,
        precision: Any = None,
        recompute: str = "none",
    ) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"[Llama] config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.device = device or "cpu"
        self.model = _Decoder(config)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.recompute = recompute
        if init:
            self.init_weights()
        else:
            with bt.no_grad():
                for p in self.parameters():
                    p.zero_()
        if device not in (None, "cpu"):
            self.to(device)
        self._rope_cache: dict[tuple[int, str], tuple[bt.Tensor, bt.Tensor]] = {}
        if precision is not None:
            self.set_precision(precision)
            if isinstance(precision, str):
                set_matmul_precision(precision)

    # -- construction ------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """N(0, init_std) weights, N(0, init_std / sqrt(2 n_layer)) residual projections, norms
        1 (uses the bt generator: seed it with bt.manual_seed)."""
        cfg = self.config
        std, resid_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)
        with bt.no_grad():
            for name, p in self.named_parameters():
                shape = tuple(p.shape)
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.copy_(_normal(shape, resid_std, None))
                else:
                    p.copy_(_normal(shape, std, None))
            V, Vp = cfg.vocab_size, cfg.padded_vocab_size
            if Vp > V:  # padding rows are zero and, never read or given gradient, stay zero
                self.model.embed_tokens.weight[V:].zero_()
                self.lm_head.weight[V:].zero_()

    @property
    def recompute(self) -> str:
        return self._recompute

    @recompute.setter
    def recompute(self, spec: Any) -> None:
        parts = parse_recompute(spec, "Llama")
        name = recompute_name(parts)
        if name not in LLAMA_RECOMPUTE:
            raise ValueError(
                f"[Llama] recompute {spec!r}: a LLaMA block recomputes 'attn' or 'block' (or "
                "'none'); 'ln' and 'gelu' are GPT-2's"
            )
        object.__setattr__(self, "_recompute", name)
        for b in self.model.layers:
            b.recompute = name

    def to(self, device: str) -> Llama:
        """Moves every parameter to `device` in place."""
        GPT2.to(self, device)  # type: ignore[arg-type]
        self._rope_cache = {}
        return self

    def num_parameters(self, non_embedding: bool = False) -> int:
        return self.config.n_params(non_embedding=non_embedding)

    # -- forward -----------------------------------------------------------------------------------
    _as_ids = GPT2._as_ids

    def _rope(self, T: int, dtype: Any) -> tuple[bt.Tensor, bt.Tensor]:
        """The rotary tables' first T rows (made once per length, outside any capture)."""
        key = (T, str(self.device))
        r = self._rope_cache.get(key)
        if r is None:
            cos, sin = rotary_tables(self.config, T)
            r = (bt.tensor(cos, device=self.device), bt.tensor(sin, device=self.device))
            if not r[0].is_symbolic:
                self._rope_cache[key] = r
        return r

    def hidden_states(self, idx: bt.Tensor) -> bt.Tensor:
        """The final norm's output (B, T, C) for checked int64 ids (B, T)."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(
                f"[Llama] sequence length {T} is longer than the block size "
                f"{self.config.block_size}"
            )
        if T == 0:
            raise ValueError("[Llama] idx is empty (T = 0)")
        d = self.model
        x = _cast(bt.embedding(idx, d.embed_tokens.weight), self._compute)
        cos, sin = self._rope(T, x.dtype)
        for b in d.layers:
            x = b(x, cos, sin)
        return d.norm(x)

    def head(self, h: bt.Tensor) -> bt.Tensor:
        """Logits (..., vocab_size) of hidden states (..., C), padding dropped."""
        logits = bt.linear(h, _cast(self.lm_head.weight, self._compute))
        V = self.config.vocab_size
        return logits.narrow(-1, 0, V) if self.config.padded_vocab_size > V else logits

    def forward(
        self, idx: Any, targets: Any = None, *, return_logits: bool = True
    ) -> tuple[bt.Tensor | None, bt.Tensor | None]:
        idx = self._as_ids(idx, "idx")
        tgt = None
        if targets is not None:
            tgt = self._as_ids(targets, "targets", allow_ignore=True)
            if tuple(tgt.shape) != tuple(idx.shape):
                raise ValueError(
                    f"[Llama] targets have shape {tuple(tgt.shape)}, idx {tuple(idx.shape)}"
                )
        elif not return_logits:
            raise ValueError("[Llama] return_logits=False needs targets (there is nothing else)")
        logits = self.head(self.hidden_states(idx))
        loss = None
        if tgt is not None:
            B, T = idx.shape
            flat = logits.reshape(B * T, logits.shape[-1])
            half = flat.dtype in (bt.bfloat16, bt.float16)
            loss = bt.cross_entropy(
                flat,
                tgt.reshape(B * T),
                ignore_index=IGNORE_INDEX,
                loss_dtype=bt.float32 if half else None,
            )
        return (logits if return_logits else None), loss

    # -- weights as numpy --------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, np.ndarray]:  # type: ignore[override]
        """name -> float32 numpy copy of every parameter, in LlamaConfig.param_shapes() order."""
        own = dict(self.named_parameters())
        return OrderedDict(
            (name, np.array(own[name].detach().cpu().numpy(), copy=True))
            for name in self.config.param_shapes()
        )

    def load_state_dict(  # type: ignore[override]
        self, state: Mapping[str, Any], strict: bool = True, source: str = "state_dict"
    ) -> None:
        """Copy weights in (numpy arrays, bt tensors or array-likes). Missing or unexpected
        tensors and shape mismatches raise a CheckpointError naming the tensor; nothing is
        changed then."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"[Llama] load_state_dict expects a mapping, got {type(state).__name__}"
            )
        cfg = self.config
        arrays: dict[str, np.ndarray] = {}
        for k, v in state.items():
            if isinstance(v, bt.Tensor):
                v = v.detach().cpu().float().numpy()
            arrays[k] = to_numpy(v, k)
        where = f"{source} for Llama L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd}"
        expected = {k: (s, None) for k, s in cfg.param_shapes().items()}
        check_tensors(arrays, expected, where, strict=strict)
        own = dict(self.named_parameters())
        todo = []
        for name, a in arrays.items():
            if name not in own:
                continue
            if a.dtype.kind != "f":
                raise CheckpointError(
                    f"[checkpoint] {where}: tensor {name!r} has dtype {a.dtype}, expected floats"
                )
            todo.append((own[name], a))
        with bt.no_grad():
            for p, a in todo:
                p.copy_(bt.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(p.device))

    generate = GPT2.generate

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"n_layer={c.n_layer}, n_head={c.n_head}, n_kv_head={c.n_kv_head}, "
            f"n_embd={c.n_embd}, ffn={c.intermediate_size}, vocab={c.vocab_size}"
            f"(padded {c.padded_vocab_size}), block={c.block_size}"
        )
