"""In-place ops on a view of a tensor in the graph: the base's history is rebased (PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt


def _pair(t, a):
    return bt.tensor(a, dtype=bt.float64, requires_grad=True), t.tensor(a, requires_grad=True)


def _check(x, xt):
    np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-12, atol=1e-12)


CASES = {
    # name: fn(lib, a, w) -> loss, where lib is bt or torch and the view is changed in place
    "slice_mul_": lambda a, w: _slice_mul(a, w),
    "row_add_": lambda a, w: _row_add(a, w),
    "transposed_exp_": lambda a, w: _transposed_exp(a, w),
    "view_of_view_copy_": lambda a, w: _view_of_view_copy(a, w),
    "strided_sub_": lambda a, w: _strided_sub(a, w),
}


def _slice_mul(a, w):
    y = a * 2
    y[1:3].mul_(w[1:3])
    return (y * y).sum()


def _row_add(a, w):
    y = a.cos()
    y[:, 1].add_(w[:, 0])
    return (y * a).sum()


def _transposed_exp(a, w):
    y = a + w
    y.transpose(0, 1)[2].exp_()
    return (y * y * w).sum()


def _view_of_view_copy(a, w):
    y = a * 1.5
    v = y[1:]
    v[:, 1:3].copy_(w[:3, :2] * 3)
    return ((y + 1) ** 2).sum() + (v * v).sum()


def _strided_sub(a, w):
    y = a.sin()
    y[::2, 1::2].sub_(w[::2, 1::2] * a[::2, 1::2])
    return (y * y).sum()


@pytest.mark.parametrize("name", list(CASES))
def test_inplace_on_view_vs_torch(torch_ref, rng, name):
    a = rng.standard_normal((4, 5))
    w = rng.standard_normal((4, 5))
    xa, ta = _pair(torch_ref, a)
    xw, tw = _pair(torch_ref, w)
    loss = CASES[name](xa, xw)
    ref = CASES[name](ta, tw)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-12)
    loss.backward()
    ref.backward()
    _check(xa, ta)
    _check(xw, tw)


@pytest.mark.parametrize("name", list(CASES))
def test_inplace_on_view_finite_differences(rng, name):
    a = bt.tensor(rng.standard_normal((4, 5)), dtype=bt.float64, requires_grad=True)
    w = bt.tensor(rng.standard_normal((4, 5)), dtype=bt.float64, requires_grad=True)
    assert bt.gradcheck(CASES[name], [a, w])


def test_view_of_plain_buffer_takes_history(torch_ref, rng):
    w0 = rng.standard_normal(3)
    w, tw = _pair(torch_ref, w0)
    buf = bt.zeros(4, 3, dtype=bt.float64)
    tbuf = torch_ref.zeros(4, 3, dtype=torch_ref.float64)
    buf[2].copy_(w)
    tbuf[2].copy_(tw)
    assert buf.requires_grad and not buf.is_leaf
    np.testing.assert_array_equal(buf.detach().numpy(), tbuf.detach().numpy())
    (buf.exp() * 2).sum().backward()
    (tbuf.exp() * 2).sum().backward()
    _check(w, tw)


def test_view_of_leaf_that_requires_grad_is_refused():
    a = bt.ones(3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^\[mul_\] a view of a leaf tensor that requires grad"):
        a[0].mul_(2)
    with bt.no_grad():
        a[0].mul_(2)
    np.testing.assert_array_equal(a.detach().numpy()[0], [2, 2, 2])


def test_change_to_a_saved_base_is_caught():
    a = bt.ones(3, 3, dtype=bt.float64, requires_grad=True)
    y = a.exp()  # exp saves its output
    y[0].mul_(2)
    with pytest.raises(RuntimeError, match=r"modified by an in-place"):
        y.sum().backward()


# In-place change of a BASE after views were taken from it: the earlier views read the new value,
# so gradients through them must follow the new history (this used to be silently wrong).
BASE_CASES = {
    "base_mul_after_slice": lambda a, w: _base_mul_after_slice(a, w),
    "base_add_after_transpose": lambda a, w: _base_add_after_transpose(a, w),
    "base_copy_after_strided": lambda a, w: _base_copy_after_strided(a, w),
    "plain_buffer_gets_history": lambda a, w: _plain_buffer_gets_history(a, w),
}


def _base_mul_after_slice(a, w):
    y = a * 1.0
    v = y[1:3]
    y.mul_(w)
    return (v * v).sum() + y.sum()


def _base_add_after_transpose(a, w):
    y = a.sin()
    v = y.transpose(0, 1)[1:4]
    y.add_(w * a)
    return (v.exp() * 3).sum()


def _base_copy_after_strided(a, w):
    y = a + 0.5
    v = y[::2, 1::2]
    u = y[1]
    y.copy_(w.tanh())
    return (v * a[::2, 1::2]).sum() + (u * u).sum()


def _plain_buffer_gets_history(a, w):
    buf = (a * 0).detach()
    v = buf[2]
    buf.add_(w * a)
    return (v * v).sum()


@pytest.mark.parametrize("name", list(BASE_CASES))
def test_inplace_on_base_refreshes_views_vs_torch(torch_ref, rng, name):
    a = rng.standard_normal((4, 5))
    w = rng.standard_normal((4, 5))
    xa, ta = _pair(torch_ref, a)
    xw, tw = _pair(torch_ref, w)
    loss = BASE_CASES[name](xa, xw)
    ref = BASE_CASES[name](ta, tw)
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-12)
    loss.backward()
    ref.backward()
    _check(xa, ta)
    _check(xw, tw)


@pytest.mark.parametrize("name", list(BASE_CASES))
def test_inplace_on_base_finite_differences(rng, name):
    a = bt.tensor(rng.standard_normal((4, 5)), dtype=bt.float64, requires_grad=True)
    w = bt.tensor(rng.standard_normal((4, 5)), dtype=bt.float64, requires_grad=True)
    assert bt.gradcheck(BASE_CASES[name], [a, w])
