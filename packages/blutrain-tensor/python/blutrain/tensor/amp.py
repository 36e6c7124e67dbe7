"""blutrain.tensor.amp: mixed-precision policies, autocast and activation recomputation.

The main API is an explicit, per-layer policy (every layer open to tuning)::

    import blutrain.tensor as bt
    model.set_precision(bt.amp.Policy(compute=bt.bfloat16, param=bt.float32))  # bf16 mode
    model.transformer.ln_f.set_precision(bt.amp.Policy(compute=bt.float32))  # one override

A module's policy applies to it and to its children unless a child sets its own
(``child.set_precision(None)`` returns it to inheriting). What the layers do with it:

- ``nn.Linear``: casts the input and weight/bias to ``compute`` (the casts are differentiable, so
  the gradients of float32 master weights come back float32); the output is ``compute`` dtype, or
  ``output`` when given. Parameters' casts are kept between steps (``bt.cached_astype``; AdamW
  rewrites them in its kernel), and the weight-gradient GEMMs write float32 directly.
  ``bt.set_cast_cache_enabled(False)`` casts every time instead.
- ``nn.LayerNorm``: keeps 16-bit activations 16-bit in and out; its kernel computes in float32.
- ``nn.Embedding``: gathers rows of the (float32) table, then casts them to ``compute``.
- losses: call them on float32 logits (``Policy(output=bt.float32)`` on the head).

``param`` (when given) is the dtype the module's parameters are stored in (the optimizer's master
weights): ``set_precision`` converts them, so call it before building the optimizer.
``matmul_precision`` (when given) sets the process-wide float32 matmul precision
(``bt.set_float32_matmul_precision``): 'highest' = fp32-accurate (on CUDA, blutrain-linalg's
3xTF32 kernel), 'high' = TF32 tensor cores. The fused float32 attention follows it unless
``bt.set_float32_attention_precision('highest')`` keeps it 3xTF32 (PyTorch's float32
scaled_dot_product_attention is float32-accurate under allow_tf32; ours in TF32 is faster) or
``'scores'`` keeps only its scores Q K^T 3xTF32 (most of the accuracy for less time).

Presets: ``fp32()`` (compute float32, 'highest'), ``tf32()`` (float32 + 'high'), ``bf16()``
(compute bfloat16, params float32, 'highest' for the float32 parts).

``bt.autocast(dtype)`` is a context manager for ad-hoc code: modules without a policy compute in
``dtype`` inside it (explicit policies win).

``bt.checkpoint(fn, *args)`` recomputes ``fn``'s activations in backward instead of storing them
(dropout inside replays the same numbers); ``module.set_checkpoint(True)`` does it per layer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import blutrain.tensor as bt

from . import _tensor as _C
from ._tensor import (
    Tensor,
    get_float32_attention_precision,
    get_float32_matmul_precision,
    linear_gelu,
    linear_gelu_linear,
    set_float32_attention_precision,
    set_float32_matmul_precision,
)

__all__ = [
    "Policy",
    "autocast",
    "bf16",
    "checkpoint",
    "current_autocast_dtype",
    "fp32",
    "get_float32_attention_precision",
    "get_float32_matmul_precision",
    "linear_gelu",
    "linear_gelu_linear",
    "set_float32_attention_precision",
    "set_float32_matmul_precision",
    "tf32",
]


def _floating_dtype(dt: Any, what: str) -> Any:
    """None, or dt (a dtype or its name) as a floating bt dtype; else a named error."""
    if dt is None:
        return None
    try:
        if isinstance(dt, str):
            dt = bt.empty(0, dtype=dt).dtype  # the names bt's factories take ("bfloat16", ...)
        ok = isinstance(dt, bt.dtype) and bt.empty(0, dtype=dt).is_floating_point()
    except (TypeError, ValueError):  # (bt.empty's message would name empty)
        ok = False
    if not ok:
        raise TypeError(f"[{what}] expected a floating dtype, got {dt!r}")
    return dt


@dataclass(frozen=True)
class Policy:
    """A layer's precision: compute dtype, parameter (master weight) dtype, output dtype.

    None means "leave as is": compute=None computes in the inputs' dtypes, param=None keeps the
    parameters' dtype, output=None returns the compute dtype. matmul_precision, when given, sets
    the process-wide float32 matmul precision ('highest' | 'high' | 'medium').
    """

    compute: Any = None
    param: Any = None
    output: Any = None
    matmul_precision: str | None = None

    def __post_init__(self) -> None:
        # dtype names ("bfloat16") become dtypes; anything but a floating dtype is refused here
        # rather than at a layer's first cast
        for field in ("compute", "param", "output"):
            object.__setattr__(
                self, field, _floating_dtype(getattr(self, field), f"Policy.{field}")
            )
        if self.matmul_precision not in (None, "highest", "high", "medium"):
            raise ValueError(
                "[Policy] matmul_precision must be None, 'highest', 'high' or 'medium', "
                f"got {self.matmul_precision!r}"
            )

    def cast(self, t: Tensor | None) -> Tensor | None:
        """t cast to the compute dtype (floating tensors only; differentiable).

        A parameter (a leaf that requires grad) gets ``bt.cached_astype``: its cast is kept
        between steps and AdamW rewrites it with the update, so each weight is cast once.
        """
        if (
            t is None
            or self.compute is None
            or not t.is_floating_point()
            or t.dtype == self.compute
        ):
            return t
        if t.is_leaf and t.requires_grad:
            return _C.cached_astype(t, self.compute)
        return t.to(self.compute)

    def finish(self, t: Tensor) -> Tensor:
        """t cast to the output dtype when one is set."""
        return t if self.output is None or t.dtype == self.output else t.to(self.output)


def fp32() -> Policy:
    """True float32 everywhere ('highest' matmul precision)."""
    return Policy(compute=bt.float32, param=bt.float32, matmul_precision="highest")


def tf32() -> Policy:
    """float32 tensors, float32 GEMMs on TF32 tensor cores ('high' matmul precision)."""
    return Policy(compute=bt.float32, param=bt.float32, matmul_precision="high")


def bf16() -> Policy:
    """bfloat16 compute with float32 master weights (LayerNorm math stays float32)."""
    return Policy(compute=bt.bfloat16, param=bt.float32, matmul_precision="highest")


# ---- autocast (thread-local, for ad-hoc code) --------------------------------------------------
_state = threading.local()


def current_autocast_dtype() -> Any:
    """The dtype of the innermost active bt.autocast on this thread, or None."""
    return getattr(_state, "dtype", None)


@contextlib.contextmanager
def autocast(dtype: Any = None, enabled: bool = True) -> Iterator[None]:
    """Modules without an explicit policy compute in ``dtype`` inside this block.

    with bt.autocast(bt.bfloat16):
        logits = model(idx)      # Linear/Embedding outputs bf16; LayerNorm keeps bf16
    loss = bt.cross_entropy(logits.float(), targets)
    """
    dtype = _floating_dtype(dtype, "autocast") or bt.bfloat16
    prev = current_autocast_dtype()
    _state.dtype = dtype if enabled else None
    try:
        yield
    finally:
        _state.dtype = prev


def effective_policy(own: Policy | None) -> Policy | None:
    """A module's policy, else one from the active bt.autocast, else None."""
    if own is not None:
        return own
    dt = current_autocast_dtype()
    return Policy(compute=dt) if dt is not None else None


# ---- activation recomputation ------------------------------------------------------------------
class _Checkpoint(bt.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], _anchor: Tensor, *args: Any) -> Any:
        ctx.fn = fn
        ctx.rng = _C._get_rng_state()
        ctx.autocast = current_autocast_dtype()
        ctx.args = [None if isinstance(a, Tensor) else a for a in args]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        return fn(*args)  # bt.Function runs forward under no_grad: nothing inside is saved

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        saved = iter(ctx.saved_tensors)
        inputs: list[Any] = []
        for a in ctx.args:
            if a is None:
                t = next(saved)
                d = t.detach()
                if t.requires_grad:
                    d.requires_grad_(True)
                inputs.append(d)
            else:
                inputs.append(a)
        # Replay fn with the generator where forward found it, then put it back.
        now = _C._get_rng_state()
        prev_autocast = current_autocast_dtype()
        _C._set_rng_state(*ctx.rng)
        _state.dtype = ctx.autocast
        try:
            with bt.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _C._set_rng_state(*now)
            _state.dtype = prev_autocast
        outs = (out,) if isinstance(out, Tensor) else tuple(out)
        touts = [o for o in outs if isinstance(o, Tensor)]  # grads come one per tensor output
        roots, gs = [], []
        for o, g in zip(touts, grads, strict=False):
            if o.requires_grad and g is not None:
                roots.append(o)
                gs.append(g)
        if roots:
            bt.backward(roots, gs)  # parameters used inside fn accumulate their .grad here
        in_grads = tuple(
            x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs
        )
        return (None, None, *in_grads)


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``fn(*args, **kwargs)`` without keeping its intermediate activations.

    Backward re-runs ``fn`` with grad enabled (the generator's state restored, so dropout draws
    the same mask) and back-propagates through it: the tensor arguments get their gradients and
    the parameters ``fn`` uses accumulate theirs in ``.grad``. ``fn`` returns a tensor or a tuple
    of tensors. Without grad mode it simply calls ``fn``.
    """
    if not callable(fn):
        raise TypeError(f"[checkpoint] argument 'fn' must be callable, got {fn!r:.60}")
    if kwargs:
        return checkpoint(lambda *a: fn(*a, **kwargs), *args)
    if not bt.is_grad_enabled():
        return fn(*args)
    # A leaf that needs a gradient, so the node is recorded even when no argument requires grad
    # (fn's parameters still need theirs).
    anchor = _anchor()
    return _Checkpoint.apply(fn, anchor, *args)


def _anchor() -> Tensor:
    a = getattr(_state, "anchor", None)
    if a is None:
        a = bt.zeros(0)
        a.requires_grad_(True)
        _state.anchor = a
    return a
