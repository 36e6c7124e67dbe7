"""cross_entropy on (N, C, d1, ...) logits (class dim 1, as PyTorch), with ignore_index."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt


def _ce_ref_nd(a, tgt, ignore_index, reduction, ls=0.0):
    """float64 numpy reference: class dim 1, 'mean' over the non-ignored positions."""
    a = np.moveaxis(a, 1, -1)  # (N, d1, ..., C)
    m = a.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(a - m).sum(-1, keepdims=True)))[..., 0]
    valid = tgt != ignore_index
    safe = np.where(valid, tgt, 0)
    picked = np.take_along_axis(a, safe[..., None], -1)[..., 0]
    loss = (1 - ls) * (lse - picked) + ls * (lse - a.mean(-1))
    loss = np.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def _inputs(rng, shape, ignore_index):
    a = rng.uniform(-3, 3, size=shape)
    tshape = shape[:1] + shape[2:]
    tgt = rng.integers(0, shape[1], size=tshape)
    flat = tgt.reshape(-1)
    flat[rng.choice(flat.size, size=max(1, flat.size // 4), replace=False)] = ignore_index
    # keep at least one valid position so 'mean' is finite
    flat[0] = 0 if ignore_index != 0 else 1
    return a, tgt


SHAPES = [(3, 5, 4), (2, 4, 3, 5), (2, 3, 2, 2, 3), (1, 6, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("dt,tol", [(bt.float64, 1e-12), (bt.float32, 2e-5)])
def test_forward_vs_numpy(rng, shape, reduction, ignore_index, dt, tol):
    a, tgt = _inputs(rng, shape, ignore_index)
    for ls in (0.0, 0.15):
        out = bt.cross_entropy(
            bt.tensor(a, dtype=dt), bt.tensor(tgt), ignore_index, reduction, label_smoothing=ls
        )
        ref = _ce_ref_nd(a, tgt, ignore_index, reduction, ls)
        assert tuple(out.shape) == np.shape(ref)
        assert out.dtype == dt
        np.testing.assert_allclose(out.to(bt.float64).numpy(), ref, rtol=tol, atol=tol)


def test_forward_strided_logits_and_int32_target(rng):
    # (N, T, C) logits transposed to (N, C, T): a non-contiguous view, as GPT code might pass.
    a = rng.standard_normal((2, 5, 4))
    tgt = rng.integers(0, 4, size=(2, 5))
    x = bt.tensor(a, dtype=bt.float64).transpose(1, 2)
    out = bt.cross_entropy(x, bt.tensor(tgt, dtype=bt.int32), reduction="none")
    ref = _ce_ref_nd(np.swapaxes(a, 1, 2), tgt, -100, "none")
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vjp_finite_differences(rng, reduction):
    a, tgt = _inputs(rng, (2, 4, 3, 2), -100)
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    assert bt.gradcheck(
        lambda x: bt.cross_entropy(x, bt.tensor(tgt), reduction=reduction, label_smoothing=0.1),
        [x],
    )
    # Strided logits: the leaf is (N, d2, d1, C) and the op sees a transposed view of it.
    y = bt.tensor(np.swapaxes(a, 1, 3).copy(), dtype=bt.float64, requires_grad=True)
    tgt1 = np.where(tgt == -100, 1, tgt)
    assert bt.gradcheck(
        lambda y: bt.cross_entropy(
            y.transpose(1, 3), bt.tensor(tgt1), ignore_index=1, reduction=reduction
        ),
        [y],
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 1])
def test_forward_and_vjp_vs_torch(torch_ref, rng, shape, reduction, ignore_index):
    t = torch_ref
    a, tgt = _inputs(rng, shape, ignore_index)
    cot = rng.standard_normal(shape[:1] + shape[2:]) if reduction == "none" else None
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    out = bt.cross_entropy(
        x, bt.tensor(tgt), ignore_index=ignore_index, reduction=reduction, label_smoothing=0.05
    )
    xt = t.tensor(a, dtype=t.float64, requires_grad=True)
    ref = t.nn.functional.cross_entropy(
        xt, t.tensor(tgt), ignore_index=ignore_index, reduction=reduction, label_smoothing=0.05
    )
    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    if cot is None:
        out.backward()
        ref.backward()
    else:
        out.backward(bt.tensor(cot, dtype=bt.float64))
        ref.backward(t.tensor(cot))
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_float32_vjp_vs_torch(torch_ref, rng):
    t = torch_ref
    a, tgt = _inputs(rng, (4, 7, 6), -100)
    x = bt.tensor(a, dtype=bt.float32, requires_grad=True)
    bt.cross_entropy(x, bt.tensor(tgt)).backward()
    xt = t.tensor(a, dtype=t.float32, requires_grad=True)
    t.nn.functional.cross_entropy(xt, t.tensor(tgt)).backward()
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"^\[cross_entropy\] target has shape \(2, 3\), expected"):
        bt.cross_entropy(bt.ones(2, 4, 5), bt.zeros(2, 3, dtype=bt.int64))
    with pytest.raises(ValueError, match=r"^\[cross_entropy\] target has shape \(2, 5\), expected"):
        # (B, T, C) with targets (B, T) is not PyTorch's layout: class dim must be dim 1.
        bt.cross_entropy(bt.ones(2, 5, 4), bt.zeros(2, 5, dtype=bt.int64))
    with pytest.raises(ValueError, match=r"^\[cross_entropy\] logits must be \(N, C\)"):
        bt.cross_entropy(bt.ones(4), bt.zeros(1, dtype=bt.int64))
    with pytest.raises(IndexError, match=r"^\[cross_entropy\] target 7"):
        bt.cross_entropy(bt.ones(2, 4, 3), bt.full((2, 3), 7, dtype=bt.int64))
