"""GPT-2 on blutrain.tensor, as published and as Hugging Face's GPT2LMHeadModel computes it.

    from blutrain.models import GPT2, GPT2Config
    model = GPT2(GPT2Config.from_name("tiny"))
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int (bt or numpy)
    model = GPT2.from_pretrained("path/to/hf")  # config.json + model.safetensors
    out = model.generate(idx, 50, temperature=0.8, top_k=40, seed=0)

Learned positions, pre-LN blocks, tanh GELU, LayerNorm eps from the config (1e-5), output head
tied to the token embedding (logits = x @ wte^T). Initialization is GPT-2's (and nanoGPT's):
every weight N(0, 0.02), the two residual projections (attn.c_proj, mlp.c_proj) N(0,
0.02 / sqrt(2 * n_layer)), biases 0, LayerNorm weight 1 and bias 0.

Parameter names and layouts are the package's canonical ones (`GPT2Config.param_shapes()`):
Hugging Face's names (``transformer.h.0.attn.c_attn.weight``...) with Linear layout (out, in);
`from_pretrained` transposes HF's Conv1D weights on load.

Vocabulary padding (`config.vocab_multiple`, e.g. 128): wte has padded_vocab_size rows so the
head GEMM has friendly sizes, but the model only ever reads the first vocab_size columns of the
head's output: logits are (B, T, vocab_size), the loss and sampling see exactly the unpadded
model, and the padding rows get exactly zero gradient (they start at zero and stay there).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

import blutrain.tensor as bt
from blutrain.tensor import nn

from .checkpoint import CheckpointError, check_tensors, to_numpy
from .config import GPT2Config

# Targets equal to this are ignored by the loss (nanoGPT's and llm.c's convention).
IGNORE_INDEX = -1


def _normal(shape: tuple[int, ...], std: float, device: str | None) -> bt.Tensor:
    return (bt.randn(*shape, device=device) * std).detach()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C = config.n_embd
        self.n_head = config.n_head
        self.n_embd = C
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        B, T, C = x.shape
        H = self.n_head
        qkv = self.c_attn(x)  # (B, T, 3C)
        q, k, v = qkv.split(C, 2)
        # (B, T, C) -> (B, H, T, D)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C = config.n_embd
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        return self.c_proj(bt.gelu(self.c_fc(x), "tanh"))


class Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = MLP(config)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C = config.n_embd
        self.wte = nn.Embedding(config.padded_vocab_size, C)
        self.wpe = nn.Embedding(config.block_size, C)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(C, eps=config.layer_norm_epsilon)


class _HeadCrossEntropyCPU(bt.Function):
    """Mean cross-entropy of (N, Vp) head outputs over their first V columns, on the CPU.

    Why not bt.cross_entropy: on GPT-2's 50,257-wide rows its CPU kernel plus its composed
    backward (about eight full (N, V) passes) take 0.48 s on 2 threads and 0.96 s on 1 for
    N=1024, this numpy version 0.18 s, and the head's loss is a large part of a small model's
    step. Same math: float32 exp, float32 pairwise sums, the mean in float64; the gradient
    (softmax - onehot) / n_valid is zero in the padding columns and the ignored rows. Other
    devices and dtypes use bt.cross_entropy.
    """

    @staticmethod
    def forward(ctx, logits, targets, V):
        x = logits.detach().numpy()[:, :V]
        t = targets.detach().numpy()
        N = x.shape[0]
        valid = t != IGNORE_INDEX
        rows = np.arange(N)[valid]
        tv = t[valid]
        m = x.max(axis=1, keepdims=True)
        e = np.subtract(x, m)
        np.exp(e, out=e)
        s = e.sum(axis=1, keepdims=True)
        lse = m[:, 0].astype(np.float64) + np.log(s[:, 0].astype(np.float64))
        n = int(valid.sum())
        loss = float((lse[valid] - x[rows, tv].astype(np.float64)).sum() / n) if n else math.nan
        ctx.e, ctx.s, ctx.rows, ctx.tv, ctx.n = e, s, rows, tv, n
        ctx.shape, ctx.valid = tuple(logits.shape), valid
        return bt.tensor(np.array(loss, dtype=np.float32))

    @staticmethod
    def backward(ctx, g):
        scale = float(g.item()) / ctx.n if ctx.n else 0.0
        e, V = ctx.e, ctx.e.shape[1]
        # d = e * scale / s, written once into the (padded) output; e stays intact so a
        # backward with retain_graph=True can run again
        d = np.zeros(ctx.shape, dtype=np.float32) if V != ctx.shape[1] else np.empty_like(e)
        np.multiply(e, (scale / ctx.s).astype(np.float32), out=d[:, :V])
        d[ctx.rows, ctx.tv] -= np.float32(scale)
        d[~ctx.valid] = 0
        return bt.from_numpy(d), None, None


class GPT2(nn.Module):
    """GPT-2 language model. ``logits, loss = model(idx, targets=None)``.

    idx: (B, T) or (T,) integer token ids (a bt tensor or a numpy array), T <= block_size.
    targets: like idx; entries equal to -1 are ignored by the loss. logits: (B, T, vocab_size)
    float32 (the padding columns of a padded vocabulary are never returned); loss: a 0-d tensor
    (mean cross-entropy over the non-ignored targets), or None without targets.
    """

    def __init__(self, config: GPT2Config, device: str | None = None, *, init: bool = True) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"[GPT2] config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        self.device = device or "cpu"
        self.transformer = _Transformer(config)
        if init:
            self.init_weights()
        else:
            with bt.no_grad():
                for p in self.parameters():
                    p.zero_()
        if device not in (None, "cpu"):
            self.to(device)
        self._pos_cache: dict[int, bt.Tensor] = {}

    # -- construction --------------------------------------------------------------------------
    def init_weights(self) -> None:
        """GPT-2's initialization (uses the bt generator: seed it with bt.manual_seed)."""
        cfg = self.config
        std = cfg.init_std
        resid_std = std / math.sqrt(2 * cfg.n_layer)
        with bt.no_grad():
            for name, p in self.named_parameters():
                shape = tuple(p.shape)
                if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
                    p.copy_(_normal(shape, resid_std, None))
                else:
                    p.copy_(_normal(shape, std, None))
            V, Vp = cfg.vocab_size, cfg.padded_vocab_size
            if Vp > V:  # padding rows are zero and, since they are never read, stay zero
                self.transformer.wte.weight[V:].zero_()

    def to(self, device: str) -> GPT2:
        """Moves every parameter to `device` ("cpu", "cuda", "cuda:N") in place."""
        with bt.no_grad():
            for m in self.modules():
                for name, p in list(m._parameters.items()):
                    if p is None or str(p.device) == str(device):
                        continue
                    q = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
                    # in place in the registry: setattr would move the name to the end
                    m._parameters[name] = q
                    object.__setattr__(m, name, q)
        self.device = str(device)
        self._pos_cache = {}
        return self

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count as published (tied head counted once; padding rows not counted)."""
        return self.config.n_params(non_embedding=non_embedding)

    # -- forward ---------------------------------------------------------------------------------
    def _as_ids(self, x: Any, what: str, allow_ignore: bool = False) -> bt.Tensor:
        """An int64 (B, T) tensor on the model's device, checked against the vocabulary."""
        V = self.config.vocab_size
        if isinstance(x, bt.Tensor):
            if x.dtype not in (bt.int64, bt.int32, bt.uint8):
                raise TypeError(f"[GPT2] {what} must hold integer token ids, got dtype {x.dtype}")
            t = x if x.dtype == bt.int64 else x.long()
            if t.ndim == 1:
                t = t.unsqueeze(0)
            if t.ndim != 2:
                raise ValueError(
                    f"[GPT2] {what} must be (B, T) or (T,), got shape {tuple(x.shape)}"
                )
            if t.numel() and not t.is_symbolic:  # captured ids have no values to check
                lo, hi = int(t.amin().item()), int(t.amax().item())
            else:
                lo = hi = 0
            if str(t.device) != str(self.device):
                t = t.to(self.device)
        else:
            a = np.asarray(x)
            if a.dtype.kind not in "iu":
                raise TypeError(f"[GPT2] {what} must hold integer token ids, got dtype {a.dtype}")
            if a.ndim == 1:
                a = a[None]
            if a.ndim != 2:
                raise ValueError(f"[GPT2] {what} must be (B, T) or (T,), got shape {np.shape(x)}")
            lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
            t = None
        if lo < 0 or hi >= V:
            vals = t.detach().cpu().numpy() if t is not None else a
            bad = (vals >= V) | (
                (vals < 0) & (vals != IGNORE_INDEX) if allow_ignore else (vals < 0)
            )
            if bad.any():
                pos = tuple(int(i) for i in np.argwhere(bad)[0])
                extra = " (or -1 to ignore a position)" if allow_ignore else ""
                raise ValueError(
                    f"[GPT2] {what} holds token id {int(vals[pos])} at position {pos}, outside "
                    f"the vocabulary [0, {V}){extra}"
                )
        if t is None:
            t = bt.tensor(np.ascontiguousarray(a, dtype=np.int64), device=self.device)
        return t

    def _positions(self, T: int) -> bt.Tensor:
        pos = self._pos_cache.get(T)
        if pos is None or pos.is_symbolic:
            pos = bt.arange(T, device=self.device)
            if not pos.is_symbolic:  # made inside bt.capture(): symbolic, never reuse it
                self._pos_cache[T] = pos
        return pos

    def hidden_states(self, idx: bt.Tensor) -> bt.Tensor:
        """The final LayerNorm's output (B, T, C) for checked int64 ids (B, T)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"[GPT2] sequence length {T} is longer than the block size {self.config.block_size}"
            )
        if T == 0:
            raise ValueError("[GPT2] idx is empty (T = 0)")
        tr = self.transformer
        x = bt.embedding(idx, tr.wte.weight) + bt.embedding(self._positions(T), tr.wpe.weight)
        for block in tr.h:
            x = block(x)
        return tr.ln_f(x)

    def head(self, x: bt.Tensor) -> bt.Tensor:
        """Logits (..., vocab_size) of hidden states x (..., C): the tied head, padding dropped."""
        return self._unpad(bt.linear(x, self.transformer.wte.weight))

    def _unpad(self, logits: bt.Tensor) -> bt.Tensor:
        V = self.config.vocab_size
        return logits.narrow(-1, 0, V) if self.config.padded_vocab_size > V else logits

    def forward(self, idx: Any, targets: Any = None) -> tuple[bt.Tensor, bt.Tensor | None]:
        idx = self._as_ids(idx, "idx")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(
                f"[GPT2] sequence length {idx.shape[1]} is longer than the block size "
                f"{self.config.block_size}"
            )
        full = bt.linear(self.hidden_states(idx), self.transformer.wte.weight)  # (B, T, Vp)
        logits = self._unpad(full)
        loss = None
        if targets is not None:
            tgt = self._as_ids(targets, "targets", allow_ignore=True)
            if tuple(tgt.shape) != tuple(idx.shape):
                raise ValueError(
                    f"[GPT2] targets have shape {tuple(tgt.shape)}, idx {tuple(idx.shape)}"
                )
            B, T = idx.shape
            V = self.config.vocab_size
            if full.device == "cpu" and full.dtype == bt.float32 and not full.is_symbolic:
                loss = _HeadCrossEntropyCPU.apply(
                    full.reshape(B * T, full.shape[-1]), tgt.reshape(B * T), V
                )
            else:
                loss = bt.cross_entropy(
                    logits.reshape(B * T, V), tgt.reshape(B * T), ignore_index=IGNORE_INDEX
                )
        return logits, loss

    # -- weights as numpy --------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, np.ndarray]:  # type: ignore[override]
        """name -> float32 numpy copy of every parameter, canonical names, llm.c's order."""
        own = dict(self.named_parameters())
        out: OrderedDict[str, np.ndarray] = OrderedDict()
        for name in self.config.param_shapes():
            out[name] = np.array(own[name].detach().cpu().numpy(), copy=True)
        return out

    def load_state_dict(  # type: ignore[override]
        self, state: Mapping[str, Any], strict: bool = True, source: str = "state_dict"
    ) -> None:
        """Copy weights in (numpy arrays, bt tensors or anything array-like).

        transformer.wte.weight may have vocab_size rows (padding rows are set to zero) or
        padded_vocab_size rows. Missing or unexpected tensors and shape mismatches raise a
        CheckpointError (a ValueError) naming the tensor; nothing is changed then.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"[GPT2] load_state_dict expects a mapping, got {type(state).__name__}")
        cfg = self.config
        arrays: dict[str, np.ndarray] = {}
        for k, v in state.items():
            if isinstance(v, bt.Tensor):
                v = v.detach().cpu().float().numpy()
            arrays[k] = to_numpy(v, k)
        expected = {k: (s, None) for k, s in cfg.param_shapes().items()}
        wte = arrays.get("transformer.wte.weight")
        V, Vp, C = cfg.vocab_size, cfg.padded_vocab_size, cfg.n_embd
        if wte is not None and Vp > V and tuple(wte.shape) == (V, C):
            padded = np.zeros((Vp, C), dtype=np.float32)
            padded[:V] = wte
            arrays["transformer.wte.weight"] = padded
        where = f"{source} for GPT-2 L={cfg.n_layer} H={cfg.n_head} C={C} V={V}"
        if strict:
            check_tensors(arrays, expected, where, strict=True)
        for name, a in arrays.items():
            if a.dtype.kind != "f":
                raise CheckpointError(
                    f"[checkpoint] {where}: tensor {name!r} has dtype {a.dtype}, expected floats"
                )
        own = dict(self.named_parameters())
        todo = []
        for name, p in own.items():
            if name not in arrays:
                continue
            a = arrays[name]
            if tuple(a.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"[checkpoint] {where}: tensor {name!r} has shape {tuple(a.shape)}, "
                    f"expected {tuple(p.shape)}"
                )
            todo.append((p, a))
        with bt.no_grad():
            for p, a in todo:
                p.copy_(bt.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(p.device))

    # -- Hugging Face ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, vocab_multiple: int = 1, device: str | None = None
    ) -> GPT2:
        """A model from a local Hugging Face GPT-2 directory (config.json + model.safetensors).

        Keys may carry the "transformer." prefix or not; Conv1D weights are transposed; a
        vocab_multiple > 1 pads the embedding (results do not change).
        """
        from .convert import load_hf

        config, weights = load_hf(path, vocab_multiple=vocab_multiple)
        model = cls(config, device=device, init=False)
        model.load_state_dict(weights, source=str(path))
        return model

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write a Hugging Face GPT-2 directory (config.json + model.safetensors)."""
        from .convert import save_hf

        save_hf(path, self.state_dict(), self.config)

    # -- sampling ----------------------------------------------------------------------------------
    def generate(
        self,
        idx: Any,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> Any:
        """Append `max_new_tokens` sampled tokens to idx ((B, T) or (T,)); returns the same kind.

        temperature 0 is greedy (argmax); top_k keeps the k most likely tokens. Sampling uses a
        numpy Generator seeded with `seed`, so a seed gives the same tokens on every run and
        device. The context is cropped to the last block_size tokens, as GPT-2 was trained.
        """
        if max_new_tokens < 0:
            raise ValueError(f"[generate] max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"[generate] temperature must be >= 0, got {temperature}")
        V = self.config.vocab_size
        if top_k is not None and not (1 <= int(top_k)):
            raise ValueError(f"[generate] top_k must be >= 1, got {top_k}")
        as_bt = isinstance(idx, bt.Tensor)
        ids = idx.detach().cpu().long().numpy() if as_bt else np.asarray(idx)
        one_d = ids.ndim == 1
        self._as_ids(ids if ids.size else np.zeros((1, 1), np.int64), "idx")  # checks ids
        ids = np.array(ids[None] if one_d else ids, dtype=np.int64)
        if ids.shape[1] == 0:
            raise ValueError("[generate] idx must hold at least one token")
        rng = np.random.default_rng(seed)
        T = self.config.block_size
        was_training = self.training
        self.eval()
        try:
            with bt.no_grad():
                for _ in range(max_new_tokens):
                    ctx = ids[:, -T:]
                    x = bt.tensor(ctx, device=self.device)
                    h = self.hidden_states(x)
                    last = h.narrow(1, h.shape[1] - 1, 1)  # only the last position's logits
                    logits = self.head(last).reshape(ids.shape[0], V)
                    logits = logits.cpu().double().numpy()
                    ids = np.concatenate([ids, _sample(logits, temperature, top_k, rng)], axis=1)
        finally:
            self.train(was_training)
        out = ids[0] if one_d else ids
        return bt.tensor(out) if as_bt else out

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, "
            f"vocab={c.vocab_size}(padded {c.padded_vocab_size}), block={c.block_size}"
        )


def _sample(
    logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator
) -> np.ndarray:
    """Next tokens (B, 1) from float64 logits (B, V)."""
    if temperature == 0:
        return logits.argmax(axis=1)[:, None].astype(np.int64)
    z = logits / temperature
    if top_k is not None and top_k < z.shape[1]:
        kth = np.partition(z, -top_k, axis=1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    # Inverse-CDF sampling with one uniform u in (0, 1] per row: the first token whose CDF
    # reaches u * total has nonzero probability (a zero-probability token never adds to the CDF).
    u = 1.0 - rng.random(z.shape[0])
    cdf = np.cumsum(p, axis=1)
    tok = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(axis=1), z.shape[1] - 1)
    return tok[:, None].astype(np.int64)
