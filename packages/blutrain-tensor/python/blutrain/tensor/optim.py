"""blutrain.tensor.optim: multi-tensor optimizer kernels, for optimizers written in Python.

    import blutrain.tensor.optim as bto
    norm = bto.grad_norm([p.grad for p in params])   # 0-d tensor on the grads' device
    coef = bto.clip_coef(norm, max_norm=1.0)         # min(1, 1 / (norm + 1e-6)), 0-d float32
    bto.adamw_(params, grads, exp_avgs, exp_avg_sqs, lr=6e-4, step=t, betas=(0.9, 0.95),
               weight_decay=[0.1 if p.ndim >= 2 else 0.0 for p in params], grad_scale=coef)

Each call is one pass over the whole list (on CUDA one kernel launch for every tensor, on the CPU
OpenMP loops), updates in place, records no autograd history and bumps the versions of what it
writes. Nothing here reads a tensor back to the host: a clip coefficient computed on the device
is applied on the device, so a step built from these calls can be captured as a CUDA graph.

Scalars that change between steps (``lr``, ``step``) may be 0-d float32 tensors on the
parameters' device instead of Python numbers: the kernel then reads them from device memory when
it runs, so a captured step replays with the values written into those tensors before each replay
(Note [AdamW in a CUDA graph] in blutrain.models.optim). The kernel derives its coefficients in
double from either form, so a float32 lr gives the same bits as that lr passed as a number.

blutrain.models' ``AdamW`` is the optimizer class built on ``adamw_``; ``bt.clip_grad_norm_``
is ``grad_norm`` + ``clip_coef`` + ``scale_`` for a list of parameters.
"""

from __future__ import annotations

import builtins
import numbers
from collections.abc import Iterable, Sequence

from . import _tensor as _C
from ._tensor import Tensor

__all__ = ["adamw_", "clip_coef", "grad_norm", "scale_"]


def _list(tensors: Iterable[Tensor | None], op: str, what: str) -> list[Tensor | None]:
    if isinstance(tensors, Tensor):
        raise TypeError(f"[{op}] {what} must be a list of tensors, not a single Tensor")
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(
            f"[{op}] {what} must be a list of tensors, got {type(tensors).__name__}"
        ) from None


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, builtins.bool)  # numpy scalars too


def _float(v: object, op: str, what: str) -> builtins.float:
    if not _is_number(v):
        raise TypeError(f"[{op}] {what} must be a number, got {v!r}")
    return builtins.float(v)  # type: ignore[arg-type]


def adamw_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: builtins.float | Tensor,
    step: builtins.float | Tensor,
    betas: tuple[builtins.float, builtins.float] = (0.9, 0.999),
    eps: builtins.float = 1e-8,
    weight_decay: builtins.float | Sequence[builtins.float] = 0.0,
    grad_scale: Tensor | None = None,
) -> None:
    """One AdamW update of every tensor in ``params``, in place (PyTorch's ``torch.optim.AdamW``
    arithmetic, decoupled weight decay), with ``g = grads[i] * grad_scale``::

        p *= 1 - lr * weight_decay[i]
        m += (1 - beta1) * (g - m);       v = beta2 * v + (1 - beta2) * g * g
        p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    params: floating tensors of one dtype on one device, contiguous; float32, float64, or
    bfloat16 / float16 (whose moments are float32). grads: the same shapes and dtype.
    exp_avgs / exp_avg_sqs: the moments (float32; float64 for float64 params), updated in place.
    lr: >= 0, a number or a 0-d float32 tensor on the params' device. step: the count of this
    update (>= 1, the first update is 1), a number or a 0-d float32 tensor; it sets the bias
    corrections. weight_decay: one value for all, or one per tensor (each >= 0).
    grad_scale: an optional 0-d float32 tensor multiplying every gradient (a clip coefficient
    from :func:`clip_coef`), read on the device. The gradients themselves are not written.

    A float32 parameter whose 16-bit copy is kept by ``bt.cached_astype`` gets that copy
    rewritten from its new value in the same pass (it stays current for the next forward).
    """
    op = "adamw_"
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"[{op}] betas must be a pair (beta1, beta2), got {betas!r}") from None
    b1, b2 = _float(beta1, op, "beta1"), _float(beta2, op, "beta2")
    e = _float(eps, op, "eps")
    wd: builtins.float | list[builtins.float]
    if _is_number(weight_decay):
        wd = builtins.float(weight_decay)  # type: ignore[arg-type]
    elif isinstance(weight_decay, str | bytes) or not isinstance(weight_decay, Iterable):
        raise TypeError(
            f"[{op}] weight_decay must be a number or one number per tensor, got {weight_decay!r}"
        )
    else:
        wd = [_float(w, op, f"weight_decay[{i}]") for i, w in enumerate(weight_decay)]
    _C._adamw_(
        _list(params, op, "params"),
        _list(grads, op, "grads"),
        _list(exp_avgs, op, "exp_avgs"),
        _list(exp_avg_sqs, op, "exp_avg_sqs"),
        lr,
        b1,
        b2,
        e,
        wd,
        step,
        grad_scale,
    )


def grad_norm(grads: Iterable[Tensor | None]) -> Tensor:
    """The global L2 norm of all ``grads`` together (``None`` entries are skipped), as a 0-d
    tensor on their device: float32, or float64 when every gradient is float64 (0 for an empty
    list). Floating tensors of any dtypes, contiguous, on one device. Each tensor is summed in
    float32 chunks and the chunks are added in a fixed order, so the result is deterministic
    (the same bits on every call). No host sync."""
    return _C._grad_norm(_list(grads, "grad_norm", "grads"))


def clip_coef(norm: Tensor, max_norm: builtins.float, eps: builtins.float = 1e-6) -> Tensor:
    """``min(1, max_norm / (norm + eps))`` as a 0-d float32 tensor on ``norm``'s device (no host
    sync): the factor that brings gradients of global norm ``norm`` down to ``max_norm``, as in
    ``torch.nn.utils.clip_grad_norm_``. A NaN norm gives NaN, an infinite one 0. max_norm >= 0
    (inf: never clip), eps >= 0. Pass it to ``adamw_(grad_scale=...)`` or :func:`scale_`."""
    op = "clip_coef"
    return _C._clip_coef(norm, _float(max_norm, op, "max_norm"), _float(eps, op, "eps"))


def scale_(tensors: Iterable[Tensor | None], coef: Tensor) -> None:
    """Multiplies every tensor in place by ``coef``, a 0-d float32 tensor on their device (read
    there: no host sync); ``None`` entries are skipped. Floating, contiguous tensors."""
    _C._scale_(_list(tensors, "scale_", "tensors"), coef)
