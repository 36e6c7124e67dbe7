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

import contextlib
import functools
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ._tensor import bt
from .checkpoint import CheckpointError, check_tensors, load_checkpoint, to_numpy
from .config import (  # RECOMPUTE, RECOMPUTE_PARTS: re-exported
    RECOMPUTE,  # noqa: F401
    RECOMPUTE_PARTS,  # noqa: F401
    GPT2Config,
    parse_recompute,
    recompute_name,
)

# Targets equal to this are ignored by the loss (nanoGPT's and llm.c's convention).
IGNORE_INDEX = -1


def _normal(shape: tuple[int, ...], std: float, device: str | None) -> bt.Tensor:
    return (bt.randn(*shape, device=device) * std).detach()


# -- precision, fused ops, recomputation ---------------------------------------------------------
# Precision modes: the compute dtype of the model's math (None: the parameters' own, float32)
# and the float32 matmul precision ("highest": fp32-accurate, on CUDA by blutrain-linalg's 3xTF32
# kernel; "high": TF32 tensor cores).
PRECISIONS = {
    "fp32": (None, "highest"),
    "tf32": (None, "high"),
    "bf16": (bt.bfloat16, "high"),
}
_PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "tensorfloat32": "tf32"}
# The residual stream's dtype under a 16-bit compute dtype (GPT2.residual_dtype): float32 (the
# default, as autocast) or the compute dtype (the bf16 stream: a little faster and lighter,
# trains off the float32 trajectory).
RESIDUAL_DTYPES = ("float32", "compute")
# The dtype the float32 stream's gradient travels in on the fused path (GPT2.residual_grad_dtype):
# the compute dtype (the default: one bf16 gradient for the stream and the branch) or float32
# (autocast's; twice add_layer_norm's backward bytes).
RESIDUAL_GRAD_DTYPES = ("compute", "float32")


def _choice(option: str, value: str, allowed: tuple[str, ...]) -> str:
    """value when it is one of allowed; else a ValueError naming the option."""
    if value not in allowed:
        raise ValueError(f"[GPT2] {option} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def precision_name(mode: str) -> str:
    """The canonical name (fp32, tf32, bf16) of a precision mode; raises on others."""
    key = _PRECISION_ALIASES.get(str(mode).lower(), str(mode).lower())
    if key not in PRECISIONS:
        raise ValueError(f"[GPT2] precision {mode!r} is not one of fp32, tf32, bf16")
    return key


def set_matmul_precision(mode: str) -> None:
    """TF32 on or off for float32 matmuls (a process-wide setting of blutrain.tensor)."""
    bt.set_float32_matmul_precision(PRECISIONS[precision_name(mode)][1])


@contextlib.contextmanager
def gemm_autotune(on: bool, device: str) -> Iterator[bool]:
    """Inside the block, on a CUDA device, time cuBLASLt's candidate algorithms for each new
    GEMM shape once; blutrain-linalg's previous setting comes back on exit.

    blutrain-linalg picks by cuBLASLt's heuristic unless its "autotune" option is set; then a
    new (shape, layout, dtype, epilogue) key times up to 32 candidates (a few ms, one host sync,
    a transient scratch buffer of twice the L2 to time with a cold cache) and keeps the fastest,
    persisted under ~/.cache/blutrain/linalg ($BLUTRAIN_CACHE_DIR) so later runs start tuned.
    A training step repeats the same dozen shapes, so this is paid once: GPT-2 124M's step is
    1-2% faster (packages/blutrain-tensor/bench/RESULTS.md, session 25). The trainer wraps its
    steps only: sampling's growing shapes would each pay the timing. Deterministic mode
    (bt.cuda.use_deterministic_algorithms) keeps it off. Yields whether it is on."""
    if not on or not str(device).startswith("cuda") or bt.are_deterministic_algorithms_enabled():
        yield False
        return
    import blutrain.linalg as la  # blutrain-tensor's own dependency: always there

    prev = int(la.get_option("autotune"))
    la.set_option("autotune", 1)
    try:
        yield True
    finally:
        la.set_option("autotune", prev)


def _policy_dtypes(policy: Any) -> tuple[Any, Any]:
    """(compute, param) dtypes of a precision mode string or a bt.amp.Policy-like object."""
    if policy is None:
        return None, None
    if isinstance(policy, str):
        return PRECISIONS[precision_name(policy)][0], None
    return policy.compute, policy.param


# Note [tied table gradient]
# The tied wte gets two gradients: the head's dW (a dense (Vp, C) float32 table) and the
# embedding's rows.  blutrain.tensor's engine lets the embedding's index_add add its rows into
# the head's dW when that is already waiting at the node both reach (Note [taking over a pending
# gradient] there); otherwise backward fills a table of zeros for the rows and adds the two
# tables (GPT-2 124M: 618 MB moved a step, ~0.15 ms of an H200's).  Under bf16 with the bf16
# stream both read one cast, so they meet at the cast's node, the head's first.  With the float32
# stream the embedding reads the float32 master and the head a bf16 cast: they meet at the
# master's accumulator, and the head's dW gets there first only if the cast's node runs before
# the embedding's.  The engine runs ready nodes newest first, so forward() makes the head's cast
# after the embedding, not before it (test_float32_stream_embedding_grad_adds_into_the_heads).


def _cast(p: bt.Tensor | None, dtype: Any) -> bt.Tensor | None:
    """p in the compute dtype (a differentiable cast: gradients reach the fp32 master).

    A parameter's cast is kept between steps (bt.cached_astype: AdamW rewrites it in its own
    kernel), so mixed precision casts each weight once, not once per forward.
    """
    if p is None or dtype is None or p.dtype == dtype:
        return p
    if p.is_leaf and p.requires_grad:
        return bt.cached_astype(p, dtype)
    return p.to(dtype)


def _ln(x: bt.Tensor, ln: bt.nn.LayerNorm, dtype: Any, recompute: bool = False) -> bt.Tensor:
    """LayerNorm of x (in x's dtype, the parameters cast to it) with its output in `dtype` (None:
    x's): a float32 residual stream's norm feeding bf16 GEMMs is one kernel (Note [float32
    residual stream] in blutrain.tensor). recompute: the output is rebuilt in backward."""
    w, b = _cast(ln.weight, x.dtype), _cast(ln.bias, x.dtype)
    od = dtype if dtype is not None and dtype != x.dtype else None
    return bt.layer_norm(x, ln.normalized_shape, w, b, ln.eps, recompute=recompute, out_dtype=od)


def _add_ln(
    x: bt.Tensor,
    r: bt.Tensor,
    ln: bt.nn.LayerNorm,
    dtype: Any,
    fused: bool,
    recompute: bool = False,
    residual_bias: Any = None,
    wide_grad: bool = False,
) -> tuple[bt.Tensor, bt.Tensor]:
    """(x + r (+ residual_bias), LayerNorm of that): the sum in x's dtype (the residual stream's),
    the norm's output in `dtype` (None: x's); one fused kernel when `fused`.  residual_bias: the
    bias of the linear layer that made r, left out of it (Note [residual bias] in
    blutrain.tensor: its gradient comes from the layer norm's backward).  wide_grad: a float32
    x's gradient stays float32 on the fused path (GPT2.residual_grad_dtype "float32"); else it
    travels in `dtype` there."""
    rb = _cast(residual_bias, x.dtype) if residual_bias is not None else None
    if fused:
        od = dtype if dtype is not None and dtype != x.dtype else None
        w, b = _cast(ln.weight, x.dtype), _cast(ln.bias, x.dtype)
        gd = x.dtype if wide_grad and od is not None else None
        return bt.add_layer_norm(
            x,
            r,
            w,
            b,
            ln.eps,
            recompute=recompute,
            residual_bias=rb,
            out_dtype=od,
            stream_grad_dtype=gd,
        )
    s = x + r if rb is None else x + r + rb
    return s, _ln(s, ln, dtype, recompute)


class _Precision:
    """Per-module compute dtype (set_precision); None follows the parent, then float32."""

    _compute: Any = None

    def set_precision(self, policy: Any) -> Any:
        """Compute in `policy`'s dtype (a mode "fp32"/"tf32"/"bf16" or a bt.amp.Policy) here and
        in every sub-block; parameters stay float32 masters. Later calls on a sub-block override
        it for that block only. Returns self."""
        compute, param = _policy_dtypes(policy)
        if param not in (None, bt.float32):
            raise ValueError(
                f"[GPT2] parameters are kept in float32 (master weights); policy asks {param}"
            )
        for m in self.modules():  # type: ignore[attr-defined]
            if isinstance(m, _Precision):
                object.__setattr__(m, "_compute", compute)
        return self


class CausalSelfAttention(_Precision, bt.nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C = config.n_embd
        self.n_head = config.n_head
        self.n_embd = C
        self.c_attn = bt.nn.Linear(C, 3 * C)
        self.c_proj = bt.nn.Linear(C, C)
        self.fused = False  # bt.qkv_attention for c_attn + attention (GPT2 sets it)

    def forward(self, x: bt.Tensor, defer_bias: bool = False) -> bt.Tensor:
        """defer_bias: c_proj's bias is left out, for the add_layer_norm after this sublayer to
        add (Note [residual bias] in blutrain.tensor)."""
        B, T, C = x.shape
        H, dt = self.n_head, self._compute
        w, b = _cast(self.c_attn.weight, dt), _cast(self.c_attn.bias, dt)
        if self.fused:
            # one node: its backward takes c_attn's bias gradient from the attention kernels
            # (Note [packed column sums] in blutrain.tensor)
            y = bt.qkv_attention(x, w, b, H, is_causal=True)
        else:
            qkv = bt.linear(x, w, b)
            # q, k, v: strided views of qkv, (B, T, C) -> (B, H, T, D): no copies before attention
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, 2))
            y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        bias = None if defer_bias else _cast(self.c_proj.bias, dt)
        return bt.linear(y, _cast(self.c_proj.weight, dt), bias)


class MLP(_Precision, bt.nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C = config.n_embd
        self.c_fc = bt.nn.Linear(C, 4 * C)
        self.c_proj = bt.nn.Linear(4 * C, C)
        self.fused = False  # bt.linear_gelu_linear for the whole MLP (GPT2 sets it)
        self.recompute_gelu = False

    def _fc(self, x: bt.Tensor) -> bt.Tensor:
        dt = self._compute
        return bt.linear(x, _cast(self.c_fc.weight, dt), _cast(self.c_fc.bias, dt))

    def _gelu_proj(self, u: bt.Tensor) -> bt.Tensor:
        dt = self._compute
        return bt.linear(
            bt.gelu(u, "tanh"), _cast(self.c_proj.weight, dt), _cast(self.c_proj.bias, dt)
        )

    def forward(self, x: bt.Tensor, defer_bias: bool = False) -> bt.Tensor:
        """defer_bias (fused only): c_proj's bias is left to the next add_layer_norm."""
        dt = self._compute
        if self.fused:
            # one primitive for the whole MLP: GELU in c_fc's GEMM epilogue (16-bit) or its own
            # kernel, and in backward dh = dy W2 then one fused dh * gelu'(pre) + d b1 kernel;
            # recompute_gelu saves the pre-activation only (the op recomputes h in backward)
            return bt.linear_gelu_linear(
                x,
                _cast(self.c_fc.weight, dt),
                _cast(self.c_fc.bias, dt),
                _cast(self.c_proj.weight, dt),
                None if defer_bias else _cast(self.c_proj.bias, dt),
                recompute=self.recompute_gelu,
            )
        if defer_bias:
            raise ValueError("[MLP] defer_bias needs the fused MLP (mlp.fused)")
        if self.recompute_gelu:  # keep the pre-activation only; GELU is redone in backward
            return bt.checkpoint(self._gelu_proj, self._fc(x))
        return self._gelu_proj(self._fc(x))


class Block(_Precision, bt.nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C, eps = config.n_embd, config.layer_norm_epsilon
        self.ln_1 = bt.nn.LayerNorm(C, eps=eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = bt.nn.LayerNorm(C, eps=eps)
        self.mlp = MLP(config)
        self.fused_add_ln = False  # GPT2 sets it
        self.wide_grad = False  # GPT2 sets it (residual_grad_dtype "float32")
        self.recompute: frozenset[str] = frozenset()

    def set_recompute(self, spec: Any) -> Block:
        """What this block recomputes in backward (see RECOMPUTE_PARTS): "none", "gelu", "ln",
        "attn", "block" or parts joined by "+", e.g. "ln+gelu". Returns self."""
        self.recompute = parse_recompute(spec)
        self.mlp.recompute_gelu = "gelu" in self.recompute
        return self

    def attend(self, h: bt.Tensor, defer_bias: bool = False) -> bt.Tensor:
        """The attention sublayer on LayerNorm output h (through bt.checkpoint with "attn")."""
        if "attn" in self.recompute:
            return bt.checkpoint(functools.partial(self.attn, defer_bias=defer_bias), h)
        return self.attn(h, defer_bias)

    def forward(self, x: bt.Tensor) -> bt.Tensor:
        """x: the residual stream, kept in its dtype (float32 under a bf16 policy, as autocast;
        GPT2.residual_dtype); the sublayers compute in the block's dtype."""
        dt, rln = self._compute, "ln" in self.recompute
        a = self.attend(_ln(x, self.ln_1, dt, rln))
        x, h = _add_ln(x, a, self.ln_2, dt, self.fused_add_ln, rln, None, self.wide_grad)
        return x + self.mlp(h)


class _Transformer(_Precision, bt.nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        C = config.n_embd
        self.wte = bt.nn.Embedding(config.padded_vocab_size, C)
        self.wpe = bt.nn.Embedding(config.block_size, C)
        self.h = bt.nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = bt.nn.LayerNorm(C, eps=config.layer_norm_epsilon)


_ROW_BLOCK = 16  # rows a numpy call handles at once (GPT-2's: 3.2 MB, cache-sized passes)
_row_pool: Any = None  # (threads, ThreadPoolExecutor) of _parallel_rows


def _parallel_rows(n_rows: int, fn: Any) -> None:
    """fn(r0, r1) over blocks of _ROW_BLOCK rows, the blocks split into bt.get_num_threads()
    contiguous shares run on that many threads (numpy releases the GIL in its loops; blutrain's
    own pool is idle meanwhile, so the thread budget holds). fn must compute each row alone:
    results do not depend on the split."""
    global _row_pool
    blocks = -(-n_rows // _ROW_BLOCK)
    threads = max(1, min(bt.get_num_threads(), blocks))

    def run(b0: int, b1: int) -> None:
        for b in range(b0, b1):
            fn(b * _ROW_BLOCK, min(n_rows, (b + 1) * _ROW_BLOCK))

    if threads == 1:
        run(0, blocks)
        return
    if _row_pool is None or _row_pool[0] < threads - 1:
        from concurrent.futures import ThreadPoolExecutor

        if _row_pool is not None:
            _row_pool[1].shutdown(wait=False)
        _row_pool = (threads - 1, ThreadPoolExecutor(threads - 1, thread_name_prefix="bt-rows"))
    cuts = [blocks * i // threads for i in range(threads + 1)]
    futures = [_row_pool[1].submit(run, cuts[i], cuts[i + 1]) for i in range(1, threads)]
    run(cuts[0], cuts[1])
    for f in futures:
        f.result()


_scratch = threading.local()  # per thread: a (_ROW_BLOCK, V) float32 block of exponentials


def _exp_block(rows: int, V: int) -> np.ndarray:
    buf = getattr(_scratch, "e", None)
    if buf is None or buf.shape[1] != V:
        buf = _scratch.e = np.empty((_ROW_BLOCK, V), np.float32)
    return buf[:rows]


class _HeadCrossEntropyCPU(bt.Function):
    """Mean cross-entropy of (N, Vp) head outputs over their first V columns, on the CPU.

    Why not bt.cross_entropy: on GPT-2's 50,257-wide rows its CPU kernel plus its composed
    backward (about eight full (N, V) passes) took 0.48 s on 2 threads and 0.96 s on 1 for
    N=1024, this numpy version 0.18 s, and the head's loss is a large part of a small model's
    step. Same math: float32 exp, float32 pairwise sums, the mean in float64; the gradient
    (softmax - onehot) / n_valid is zero in the padding columns and the ignored rows. Other
    devices and dtypes use bt.cross_entropy.

    How it runs: blocks of rows on all the budget's threads (_parallel_rows), each block's
    exponentials in a cache-sized scratch; each row's numbers are those of whole-array numpy
    calls. When a gradient will be needed, the forward also writes it for an upstream gradient
    of 1 (what loss.backward() sends) while the block is in cache, into a buffer from
    blutrain.alloc's cache (fresh numpy arrays of this size were fresh kernel pages every step);
    backward hands that over, or recomputes it from the kept logits for any other upstream
    gradient or a second backward (retain_graph). Memory: the logits and the gradient from
    forward to backward, as the exponentials and the gradient were before.
    """

    @staticmethod
    def _pass(ctx, scale: float, d: np.ndarray | None, need_s: bool) -> None:
        x, m, s, V = ctx.x, ctx.m, ctx.s, ctx.V

        def block(r0: int, r1: int) -> None:
            if need_s:
                np.max(x[r0:r1], axis=1, keepdims=True, out=m[r0:r1])
            e = _exp_block(r1 - r0, V)
            np.subtract(x[r0:r1], m[r0:r1], out=e)
            np.exp(e, out=e)
            if need_s:
                np.sum(e, axis=1, keepdims=True, out=s[r0:r1])
            if d is not None:
                np.multiply(e, (scale / s[r0:r1]).astype(np.float32), out=d[r0:r1, :V])
                if V != d.shape[1]:
                    d[r0:r1, V:] = 0

        _parallel_rows(x.shape[0], block)
        if d is not None:
            d[ctx.rows, ctx.tv] -= np.float32(scale)
            d[~ctx.valid] = 0

    @staticmethod
    def forward(ctx, logits, targets, V):
        ctx.x = x = logits.detach().numpy()[:, :V]
        t = targets.detach().numpy()
        N = x.shape[0]
        ctx.V, ctx.valid = V, t != IGNORE_INDEX
        ctx.rows, ctx.tv = np.arange(N)[ctx.valid], t[ctx.valid]
        ctx.n = n = int(ctx.valid.sum())
        ctx.m, ctx.s = np.empty((N, 1), np.float32), np.empty((N, 1), np.float32)
        ctx.d = None
        if ctx.needs_input_grad[0]:
            ctx.logits = logits  # kept for a backward that cannot use the gradient made here
            ctx.scale = 1.0 / n if n else 0.0
            ctx.d = bt.empty(*logits.shape)
        _HeadCrossEntropyCPU._pass(
            ctx,
            ctx.scale if ctx.d is not None else 0.0,
            ctx.d.numpy() if ctx.d is not None else None,
            True,
        )
        lse = ctx.m[:, 0].astype(np.float64) + np.log(ctx.s[:, 0].astype(np.float64))
        loss = (
            float((lse[ctx.valid] - x[ctx.rows, ctx.tv].astype(np.float64)).sum() / n)
            if n
            else math.nan
        )
        return bt.tensor(np.array(loss, dtype=np.float32))

    @staticmethod
    def backward(ctx, g):
        scale = float(g.item()) / ctx.n if ctx.n else 0.0
        d, ctx.d = ctx.d, None  # the forward's gradient serves one backward at most
        if d is not None and scale == ctx.scale:
            return d, None, None
        d = bt.empty(*ctx.logits.shape)
        _HeadCrossEntropyCPU._pass(ctx, scale, d.numpy(), False)
        return d, None, None


class GPT2(_Precision, bt.nn.Module):
    """GPT-2 language model. ``logits, loss = model(idx, targets=None)``.

    idx: (B, T) or (T,) integer token ids (a bt tensor or a numpy array), T <= block_size.
    targets: like idx; entries equal to -1 are ignored by the loss. logits: (B, T, vocab_size)
    in the compute dtype (float32, or bfloat16 under precision="bf16"; the padding columns of a
    padded vocabulary are never returned); loss: a float32 0-d tensor (mean cross-entropy over
    the non-ignored targets), or None without targets.

    Training, ask for the loss alone: ``loss = model(idx, targets, return_logits=False)[1]``
    (logits None).  On the fused path (CUDA by default, see `fused`) the head and the loss are
    then one bt.linear_cross_entropy, which runs the rows in chunks and never holds the
    (B, T, padded vocab) logits: 3.3 GB in float32 at B=16, T=1024, 1.65 GB in bf16; the
    chunk's size is `classifier_chunk_size` rows (None: chunks of at most 512 MiB).  Elsewhere,
    and when the logits are returned but dropped before backward, the loss's backward writes
    its gradient over them instead of allocating another such tensor.

    GPU options (all keep the math of the plain model):
    - `precision`: "fp32", "tf32" (float32 matmuls on TF32 tensor cores; a global setting) or
      "bf16" (bfloat16 compute, float32 master weights), or a bt.amp.Policy; per block with
      ``model.transformer.h[i].set_precision(...)``.
    - `recompute`: what every block recomputes in backward instead of keeping: "none",
      "gelu" (the MLP keeps its pre-activation only: inside bt.linear_gelu_linear on the fused
      path, else through bt.checkpoint), "ln" (the LayerNorm outputs are not kept: the linears
      after them rebuild them, bitwise, from the kept residual stream), "attn" (each attention
      sublayer keeps its input only), "block" (each block keeps its input only), or parts
      joined by "+" ("ln+gelu").  "attn" and "block" go through bt.checkpoint.  Per layer:
      ``model.set_recompute("ln+gelu", layers=range(6))`` or
      ``model.transformer.h[i].set_recompute(...)``; the final LayerNorm follows the last
      block's "ln".
    - `fused`: None (on CUDA when blutrain.tensor has them), True or False: bt.add_layer_norm
      for every residual add + LayerNorm pair, bt.linear_gelu_linear for the MLP, and
      bt.linear_cross_entropy for the head and loss when the logits are not returned.
    - `residual_dtype`: the residual stream's dtype under a 16-bit compute dtype: "float32"
      (the default, autocast's: the embeddings' sum and every x + branch in float32, the layer
      norms over it with float32 weights, bf16 only into the GEMMs and attention; Note [float32
      residual stream] in blutrain.tensor; it tracks the fp32 run as autocast does: issue 38)
      or "compute" (the opt-in fast stream: bf16, rounded at every add; it trains measurably
      off the float32 trajectory over hundreds of steps).  What the float32 stream costs,
      measured on one H200, GPT-2 124M bf16 as a CUDA graph, B16 x T1024 (session 42): 1.7%
      tokens/s (559K vs 569K) and 0.59 GiB of peak memory (7.37 vs 6.78 GiB).  In fp32 / tf32
      the option changes nothing (the stream is float32 either way).
    - `residual_grad_dtype`: the float32 stream's gradient on the fused path under a 16-bit
      compute dtype: "compute" (the default: bf16, one gradient for the stream and the branch,
      rounded at every add on its way down) or "float32" (autocast's: the stream's gradient
      float32, cast to bf16 for each branch; twice add_layer_norm's backward bytes).  The
      unfused path's gradient is float32 either way.  Gradient error against float64 per
      layer over autocast's (CPU, trained-like weights, session 49): 12 layers of C=192,
      "compute" 0.86x at the top and 1.23-1.34x at layer 0, "float32" at most 0.93x in every
      layer; GPT-2 124M, where the other roundings dominate: "compute" 0.88-0.93x, "float32"
      0.88-0.89x.
    """

    def __init__(
        self,
        config: GPT2Config,
        device: str | None = None,
        *,
        init: bool = True,
        precision: Any = None,
        recompute: str = "none",
        fused: bool | None = None,
        residual_dtype: str = "float32",
        residual_grad_dtype: str = "compute",
    ) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"[GPT2] config must be a GPT2Config, got {type(config).__name__}")
        parse_recompute(recompute)  # bad specs fail before any allocation
        self.config = config
        self.device = device or "cpu"
        self.fused = fused
        self.residual_dtype = residual_dtype
        self.residual_grad_dtype = residual_grad_dtype
        # rows per chunk of the fused classifier (None: bt.linear_cross_entropy's default)
        self.classifier_chunk_size: int | None = None
        # float32 CPU loss in numpy (_HeadCrossEntropyCPU, faster there); False: bt.cross_entropy,
        # the op a bt.capture() records (so eager and a captured step run the same kernels)
        self.numpy_loss = True
        self.transformer = _Transformer(config)
        self.set_recompute(recompute)
        if init:
            self.init_weights()
        else:
            with bt.no_grad():
                for p in self.parameters():
                    p.zero_()
        if device not in (None, "cpu"):
            self.to(device)
        self._pos_cache: dict[int, bt.Tensor] = {}
        if precision is not None:
            self.set_precision(precision)
            if isinstance(precision, str):
                set_matmul_precision(precision)

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
                    q = bt.nn.Parameter(p.to(device), requires_grad=p.requires_grad)
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
            if t.numel() and not bt.is_capturing() and str(t.device) == "cpu":
                # captured ids have no values to check; ids on a GPU are not read back (that
                # would be a host sync every step): the embedding kernel bounds-checks them
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

    # -- recomputation ---------------------------------------------------------------------------
    def set_recompute(self, spec: Any, layers: Any = None) -> GPT2:
        """Sets what blocks recompute in backward (see the class docstring): every block, or
        the block indices in `layers`. Returns self."""
        blocks = list(self.transformer.h)
        idx = range(len(blocks)) if layers is None else list(layers)
        for i in idx:
            if not -len(blocks) <= int(i) < len(blocks):
                raise IndexError(f"[GPT2] set_recompute: layer {i} out of range ({len(blocks)})")
        parts = parse_recompute(spec)
        for i in idx:
            blocks[int(i)].set_recompute(parts)
        return self

    @property
    def recompute(self) -> str:
        """Every block's recompute spec ("none", "ln+gelu", ...), or "per-layer: a, b, ..."."""
        names = [recompute_name(b.recompute) for b in self.transformer.h]
        if len(set(names)) <= 1:
            return names[0] if names else "none"
        return "per-layer: " + ", ".join(names)

    @recompute.setter
    def recompute(self, spec: Any) -> None:
        self.set_recompute(spec)

    @property
    def residual_dtype(self) -> str:
        """The residual stream's dtype: "float32" or "compute" (see the class docstring)."""
        return self._residual_dtype

    @residual_dtype.setter
    def residual_dtype(self, value: str) -> None:
        object.__setattr__(
            self, "_residual_dtype", _choice("residual_dtype", value, RESIDUAL_DTYPES)
        )

    @property
    def residual_grad_dtype(self) -> str:
        """The float32 residual stream's gradient dtype on the fused path: "compute" or "float32"
        (see the class docstring)."""
        return self._residual_grad_dtype

    @residual_grad_dtype.setter
    def residual_grad_dtype(self, value: str) -> None:
        v = _choice("residual_grad_dtype", value, RESIDUAL_GRAD_DTYPES)
        object.__setattr__(self, "_residual_grad_dtype", v)

    def _wants_fused(self, x: bt.Tensor) -> bool:
        """Whether fused ops run for activations like x (`fused`, else on CUDA; never symbolic)."""
        want = self.fused if self.fused is not None else str(x.device).startswith("cuda")
        return bool(want) and not x.is_symbolic

    def hidden_states(self, idx: bt.Tensor, wte: bt.Tensor | None = None) -> bt.Tensor:
        """The final LayerNorm's output (B, T, C) for checked int64 ids (B, T).

        `wte`: the token embedding already in the compute dtype (forward casts it once for
        the tied head and, with a compute-dtype residual stream, the embedding; a float32 stream
        embeds from the float32 table)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"[GPT2] sequence length {T} is longer than the block size {self.config.block_size}"
            )
        if T == 0:
            raise ValueError("[GPT2] idx is empty (T = 0)")
        tr = self.transformer
        dt = self._compute
        compute_stream = self._residual_dtype == "compute"
        rdt = dt if compute_stream else None  # the stream's dtype (None: float32, the masters')
        emb = wte if wte is not None and rdt == dt else _cast(tr.wte.weight, rdt)
        x = bt.embedding(idx, emb) + bt.embedding(self._positions(T), _cast(tr.wpe.weight, rdt))
        fused = self._wants_fused(x)  # add_layer_norm, linear_gelu_linear, qkv_attention
        blocks = list(tr.h)
        wide = self._residual_grad_dtype == "float32" and not compute_stream
        for b in blocks:
            b.fused_add_ln = b.mlp.fused = b.attn.fused = fused
            b.wide_grad = wide
        # The residual stream x and the next LayerNorm's output h travel together, so every
        # "x = x + branch; h = LayerNorm(x)" pair (ln_2, the next block's ln_1, ln_f) can be
        # one fused add + LayerNorm; the math is that of Block.forward.  A block that
        # recomputes whole ("block") takes x alone and keeps only it.  x stays float32 (the
        # norms write h in the block's compute dtype) unless the stream is in the compute dtype.
        h = None  # the pending LayerNorm output of x for the next block (or ln_f)
        for i, b in enumerate(blocks):
            bdt, rln = b._compute, "ln" in b.recompute
            if compute_stream:
                x = _cast(x, bdt)
            if "block" in b.recompute:
                x, h = bt.checkpoint(b, x), None
                continue
            h = _ln(x, b.ln_1, bdt, rln) if h is None else _cast(h, bdt)
            # the residual branches' last biases go to the fused add + LayerNorm after them
            pb = b.attn.c_proj.bias if fused else None
            x, h = _add_ln(x, b.attend(h, fused), b.ln_2, bdt, fused, rln, pb, wide)
            plain_next = i + 1 < len(blocks) and "block" in blocks[i + 1].recompute
            defer = fused and not plain_next
            m = b.mlp(h, defer)
            if plain_next:
                x, h = x + m, None
                continue
            nxt = blocks[i + 1] if i + 1 < len(blocks) else b
            nln = blocks[i + 1].ln_1 if i + 1 < len(blocks) else tr.ln_f
            mb = b.mlp.c_proj.bias if defer else None
            x, h = _add_ln(x, m, nln, bdt, fused, "ln" in nxt.recompute, mb, wide)
        if h is None:
            last = blocks[-1] if blocks else None
            rln = last is not None and "ln" in last.recompute
            h = _ln(_cast(x, dt) if compute_stream else x, tr.ln_f, dt, rln)
        return _cast(h, dt) if dt is not None else h

    def head(self, x: bt.Tensor) -> bt.Tensor:
        """Logits (..., vocab_size) of hidden states x (..., C): the tied head, padding dropped."""
        wte = _cast(self.transformer.wte.weight, self._compute)
        return self._unpad(bt.linear(_cast(x, wte.dtype), wte))

    def _unpad(self, logits: bt.Tensor) -> bt.Tensor:
        V = self.config.vocab_size
        return logits.narrow(-1, 0, V) if self.config.padded_vocab_size > V else logits

    def forward(
        self, idx: Any, targets: Any = None, *, return_logits: bool = True
    ) -> tuple[bt.Tensor | None, bt.Tensor | None]:
        """(logits, loss); with targets and return_logits=False, (None, loss) (see the class)."""
        idx = self._as_ids(idx, "idx")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(
                f"[GPT2] sequence length {idx.shape[1]} is longer than the block size "
                f"{self.config.block_size}"
            )
        tgt = None
        if targets is not None:
            tgt = self._as_ids(targets, "targets", allow_ignore=True)
            if tuple(tgt.shape) != tuple(idx.shape):
                raise ValueError(
                    f"[GPT2] targets have shape {tuple(tgt.shape)}, idx {tuple(idx.shape)}"
                )
        elif not return_logits:
            raise ValueError("[GPT2] return_logits=False needs targets (there is nothing else)")
        dt, table = self._compute, self.transformer.wte.weight
        if dt is None or self._residual_dtype == "compute":
            wte = _cast(table, dt)  # one cast, two uses
            h = self.hidden_states(idx, wte)
        else:  # the head's cast made after the float32 embedding (Note [tied table gradient])
            h = self.hidden_states(idx)
            wte = _cast(table, dt)
        fused_head = self._wants_fused(h)
        if tgt is not None and not return_logits and fused_head:
            # the head and the loss in row chunks: the logits never exist whole
            loss = bt.linear_cross_entropy(
                h,
                wte,
                tgt,
                ignore_index=IGNORE_INDEX,
                num_classes=self.config.vocab_size,
                chunk_size=self.classifier_chunk_size,
            )
            return None, loss
        full = bt.linear(h, wte)  # (B, T, Vp), compute dtype
        logits = self._unpad(full)
        loss = None
        if tgt is not None:
            B, T = idx.shape
            V, Vp = self.config.vocab_size, full.shape[-1]
            numpy_ok = self.numpy_loss and not full.is_symbolic
            if numpy_ok and full.device == "cpu" and full.dtype == bt.float32:
                loss = _HeadCrossEntropyCPU.apply(full.reshape(B * T, Vp), tgt.reshape(B * T), V)
            else:
                # (B*T, Vp) is a view; its first V columns a strided view (row stride Vp) that
                # the loss kernels read in place, and since its gradient reaches `full` through
                # views only, the loss runs on the padded rows (num_classes V) and its backward
                # writes full's (B*T, Vp) gradient in one pass (no copy, no scatter).  bf16
                # logits are never made float32; the loss itself is float32
                flat = full.reshape(B * T, Vp)
                if Vp > V:
                    flat = flat.narrow(1, 0, V)
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

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, device: str | None = None) -> GPT2:
        """The model of a training checkpoint directory (or of the run directory holding one in
        checkpoint/): its config from trainer.json, its weights checked and loaded."""
        from pathlib import Path

        p = Path(path)
        if (p / "checkpoint").is_dir() and not (p / "manifest.json").exists():
            p = p / "checkpoint"
        try:
            ck = load_checkpoint(p)
        except (CheckpointError, FileNotFoundError) as e:
            raise type(e)(
                f"{e} (give a run directory of `blutrain train` or its checkpoint/)"
            ) from None
        mc = (ck.trainer or {}).get("model_config")
        if not isinstance(mc, dict):
            raise CheckpointError(
                f"[GPT2] {p}: the checkpoint has no model_config in trainer.json (not written "
                "by the trainer)"
            )
        try:
            config = GPT2Config.from_dict(mc)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"[GPT2] {p}/trainer.json: model_config: {e}") from None
        model = cls(config, device=device, init=False)
        model.load_state_dict(ck.weights, source=str(p / "model.safetensors"))
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
                    logits = logits.float().cpu().double().numpy()
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
