"""Fused norm / loss ops on the CPU: add_layer_norm, and the fused backward primitives that the
vjps of softmax / log_softmax / layer_norm / cross_entropy now run (layer_norm_backward,
softmax_backward, cross_entropy_backward), against float64 numpy, finite differences
(bt.gradcheck) and PyTorch when it is importable."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import gradient_probe

import blutrain.tensor as bt

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def leaf(rng, shape, lo=-2.0, hi=2.0, dtype=bt.float64):
    return bt.tensor(rng.uniform(lo, hi, size=shape), dtype=dtype, requires_grad=True)


def f64(t):
    return np.asarray(t.detach().to(bt.float64).numpy(), dtype=np.float64)


# ---- numpy references --------------------------------------------------------------------------
def np_layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(var + eps)
    y = (x - mean) * rstd
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, mean[..., 0], rstd[..., 0]


def np_layer_norm_backward(dy, x, w, eps):
    _, mean, rstd = np_layer_norm(x, None, None, eps)
    xh = (x - mean[..., None]) * rstd[..., None]
    g = dy * w if w is not None else dy
    dx = rstd[..., None] * (g - g.mean(-1, keepdims=True) - xh * (g * xh).mean(-1, keepdims=True))
    C = x.shape[-1]
    dw = (dy * xh).reshape(-1, C).sum(0)
    db = dy.reshape(-1, C).sum(0)
    return dx, dw, db


def np_ce(x, t, ii, red, ls):
    m = x.max(1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]
    valid = t != ii
    tt = np.where(valid, t, 0)
    nll = lse - x[np.arange(len(t)), tt]
    loss = (1 - ls) * nll + ls * (lse - x.mean(1))
    loss = np.where(valid, loss, 0.0)
    p = np.exp(x - lse[:, None])
    onehot = np.zeros_like(x)
    onehot[np.arange(len(t)), tt] = 1
    d = (p - (1 - ls) * onehot - ls / x.shape[1]) * valid[:, None]
    if red == "none":
        return loss, d  # d for a cotangent of ones
    if red == "sum":
        return loss.sum(), d
    return loss.sum() / valid.sum(), d / valid.sum()


# ---- add_layer_norm forward ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [bt.float64, bt.float32])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 16), (1, 1), (5, 1025)])
def test_add_layer_norm_forward(rng, dtype, affine, shape):
    x = rng.standard_normal(shape)
    r = rng.standard_normal(shape)
    C = shape[-1]
    w = rng.standard_normal(C) if affine else None
    b = rng.standard_normal(C) if affine else None
    s, y = bt.add_layer_norm(
        bt.tensor(x, dtype=dtype),
        bt.tensor(r, dtype=dtype),
        bt.tensor(w, dtype=dtype) if affine else None,
        bt.tensor(b, dtype=dtype) if affine else None,
        eps=1e-5,
    )
    assert s.dtype == dtype and y.dtype == dtype and s.shape == shape and y.shape == shape
    ref_s = x + r
    ref_y, _, _ = np_layer_norm(ref_s, w, b, 1e-5)
    tol = 1e-12 if dtype == bt.float64 else 2e-5
    np.testing.assert_allclose(f64(s), ref_s, rtol=tol, atol=tol)
    np.testing.assert_allclose(f64(y), ref_y, rtol=tol * 10, atol=tol * 10)


def test_add_layer_norm_matches_add_then_layer_norm(rng):
    x = bt.tensor(rng.standard_normal((4, 33)), dtype=bt.bfloat16)
    r = bt.tensor(rng.standard_normal((4, 33)), dtype=bt.bfloat16)
    w = bt.tensor(rng.standard_normal(33), dtype=bt.bfloat16)
    b = bt.tensor(rng.standard_normal(33), dtype=bt.bfloat16)
    s, y = bt.add_layer_norm(x, r, w, b)
    s2 = x + r
    y2 = bt.layer_norm(s2, 33, w, b)
    assert np.array_equal(f64(s), f64(s2))
    np.testing.assert_allclose(f64(y), f64(y2), rtol=0, atol=1e-2)


def test_add_layer_norm_errors():
    x = bt.zeros((2, 3))
    with pytest.raises(ValueError, match=r"\[add_layer_norm\]"):
        bt.add_layer_norm(x, bt.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"\[add_layer_norm\]"):
        bt.add_layer_norm(x, x, bt.zeros(4))
    with pytest.raises(TypeError, match=r"\[add_layer_norm\]"):
        bt.add_layer_norm(bt.zeros((2, 3), dtype=bt.int64), bt.zeros((2, 3), dtype=bt.int64))


# ---- gradients (finite differences) ------------------------------------------------------------
def _gc(fn, xs):
    assert bt.gradcheck(fn, xs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_gradcheck_add_layer_norm(rng, affine):
    shapes = (
        [(3, 5), (3, 5)]
        + ([(5,)] if affine != "none" else [])
        + ([(5,)] if affine == "both" else [])
    )
    xs = [leaf(rng, s) for s in shapes]

    def fn(x, r, *wb):
        s, y = bt.add_layer_norm(x, r, *wb, eps=1e-5)
        return s * 0.5 + y

    _gc(fn, xs)


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_add_layer_norm_residual_bias(rng, affine):
    """residual_bias (Note [residual bias]): sum = x + r + rb; rb's gradient is the column sums
    of dsum (from both the sum's and y's cotangents)."""
    shapes = [(2, 3, 5), (2, 3, 5)] + ([(5,), (5,)] if affine else []) + [(5,)]
    xs = [leaf(rng, s) for s in shapes]

    def fn(x, r, *rest):
        wb, rb = rest[:-1], rest[-1]
        s, y = bt.add_layer_norm(x, r, *wb, eps=1e-5, residual_bias=rb)
        return s * 0.5 + y

    _gc(fn, xs)


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
def test_add_layer_norm_residual_bias_matches_unfused(rng, dtype):
    """add_layer_norm(x, r, residual_bias=b) is add_layer_norm(x, r + b) with b's gradient the
    column sums of r's: the same forward (one rounding of the sum in 16-bit, so within a rounding
    there) and the same gradients, b's against float64 column sums of dsum."""
    C = 24
    xd, rd, gd = (rng.standard_normal((4, 7, C)) for _ in range(3))
    bd, wd = rng.standard_normal(C), rng.standard_normal(C)
    g = bt.tensor(gd, dtype=dtype)

    def run(fused):
        x, r = bt.tensor(xd, dtype=dtype, requires_grad=True), bt.tensor(rd, dtype=dtype)
        r.requires_grad_(True)
        b = bt.tensor(bd, dtype=dtype, requires_grad=True)
        w = bt.tensor(wd, dtype=dtype)
        if fused:
            s, y = bt.add_layer_norm(x, r, w, None, residual_bias=b)
        else:
            s, y = bt.add_layer_norm(x, r + b, w, None)
        (s * g + y * g).sum().backward()
        return s, y, x.grad, r.grad, b.grad

    fs, fy, fx, fr, fb = run(True)
    us, uy, ux, ur, ub = run(False)
    tol = 1e-12 if dtype == bt.float64 else (1e-5 if dtype == bt.float32 else 2e-2)
    for a, u in ((fs, us), (fy, uy), (fx, ux), (fr, ur)):
        np.testing.assert_allclose(f64(a), f64(u), rtol=tol, atol=tol * 4)
    # b's gradient: the column sums of dsum as stored (r's gradient), rounded once to b's dtype
    rows = f64(fr).reshape(-1, C)
    ulp = {bt.float64: 1e-15, bt.float32: 2**-23, bt.bfloat16: 2**-8}[dtype]
    err = np.abs(f64(fb) - rows.sum(0)) / np.abs(rows).sum(0)
    assert err.max() <= 2 * ulp, err.max()
    np.testing.assert_allclose(f64(fb), f64(ub), rtol=tol, atol=tol * 28)


def test_add_layer_norm_residual_bias_errors():
    x = bt.zeros((2, 3))
    with pytest.raises(ValueError, match=r"\[add_layer_norm\] weight, bias and residual_bias"):
        bt.add_layer_norm(x, x, residual_bias=bt.zeros(4))


def test_gradcheck_add_layer_norm_only_y(rng):
    xs = [leaf(rng, s) for s in [(2, 3, 4), (2, 3, 4), (4,), (4,)]]
    _gc(lambda x, r, w, b: bt.add_layer_norm(x, r, w, b)[1], xs)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 4), (6,)])
def test_gradcheck_layer_norm(rng, affine, shape):
    C = shape[-1]
    xs = [leaf(rng, shape)] + ([leaf(rng, (C,)), leaf(rng, (C,))] if affine else [])
    _gc(lambda x, *wb: bt.layer_norm(x, C, *wb), xs)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_gradcheck_softmax(rng, log, dim):
    f = bt.log_softmax if log else bt.softmax
    _gc(lambda x: f(x, dim), [leaf(rng, (3, 4, 5))])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_gradcheck_cross_entropy(rng, reduction, ls):
    tgt = bt.tensor(np.array([1, 4, -100, 0, 2, 3]), dtype=bt.int64)
    _gc(
        lambda x: bt.cross_entropy(x, tgt, reduction=reduction, label_smoothing=ls),
        [leaf(rng, (6, 5))],
    )


def test_gradcheck_cross_entropy_nd(rng):
    tgt = bt.tensor(np.array([[1, -100, 2], [0, 3, 3]]), dtype=bt.int64)
    _gc(lambda x: bt.cross_entropy(x, tgt, label_smoothing=0.1), [leaf(rng, (2, 4, 3))])


# ---- the backward primitives against float64 numpy, in every float dtype ------------------------
TOL = {bt.float64: 1e-10, bt.float32: 1e-5, bt.bfloat16: 3e-2, bt.float16: 5e-3}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("C", [1, 7, 64, 1025])
def test_layer_norm_backward_vs_numpy(rng, dtype, C):
    R = 9
    x = rng.standard_normal((R, C))
    w = rng.standard_normal(C)
    b = rng.standard_normal(C)
    dy = rng.standard_normal((R, C))
    xt = bt.tensor(x, dtype=dtype, requires_grad=True)
    wt = bt.tensor(w, dtype=dtype, requires_grad=True)
    bt_ = bt.tensor(b, dtype=dtype, requires_grad=True)
    y = bt.layer_norm(xt, C, wt, bt_)
    y.backward(bt.tensor(dy, dtype=dtype))
    # reference on the rounded inputs
    xr, wr, dyr = f64(xt), f64(wt), f64(bt.tensor(dy, dtype=dtype))
    dx, dw, db = np_layer_norm_backward(dyr, xr, wr, 1e-5)
    tol = TOL[dtype]
    scale = 1 if C > 1 else 0  # C == 1: dx is exactly 0
    np.testing.assert_allclose(f64(xt.grad), dx * scale, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(f64(wt.grad), dw, rtol=tol, atol=tol * 10 * np.sqrt(R))
    np.testing.assert_allclose(f64(bt_.grad), db, rtol=tol, atol=tol * 10 * np.sqrt(R))
    assert xt.grad.dtype == dtype and wt.grad.dtype == dtype


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("C", [33, 1000])  # 1000: mostly the vectorised body, 8 rows
def test_softmax_backward_vs_numpy(rng, dtype, log, C):
    x = rng.standard_normal((8 if C > 100 else 5, C))
    dy = rng.standard_normal(x.shape)
    xt = bt.tensor(x, dtype=dtype, requires_grad=True)
    y = (bt.log_softmax if log else bt.softmax)(xt, -1)
    y.backward(bt.tensor(dy, dtype=dtype))
    yr, dyr = f64(y), f64(bt.tensor(dy, dtype=dtype))
    if log:
        ref = dyr - np.exp(yr) * dyr.sum(-1, keepdims=True)
    else:
        ref = yr * (dyr - (dyr * yr).sum(-1, keepdims=True))
    tol = TOL[dtype]
    np.testing.assert_allclose(f64(xt.grad), ref, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("C", [37, 1000])
def test_cross_entropy_vs_numpy(rng, dtype, reduction, ls, C):
    N = 8
    x = rng.standard_normal((N, C)) * 3
    t = rng.integers(0, C, N)
    t[[1, 5]] = -100
    xt = bt.tensor(x, dtype=dtype, requires_grad=True)
    loss = bt.cross_entropy(
        xt, bt.tensor(t, dtype=bt.int64), reduction=reduction, label_smoothing=ls
    )
    assert loss.dtype == dtype
    ref_loss, ref_d = np_ce(f64(xt), t, -100, reduction, ls)
    tol = TOL[dtype]
    np.testing.assert_allclose(f64(loss), ref_loss, rtol=tol, atol=tol)
    if reduction == "none":
        gl = rng.standard_normal(N)
        loss.backward(bt.tensor(gl, dtype=dtype))
        ref_d = ref_d * f64(bt.tensor(gl, dtype=dtype))[:, None]
    else:
        loss.backward()
    assert xt.grad.dtype == dtype
    np.testing.assert_allclose(f64(xt.grad), ref_d, rtol=tol, atol=tol)
    assert np.all(f64(xt.grad)[[1, 5]] == 0)


def test_cross_entropy_all_ignored():
    x = bt.zeros((3, 4), requires_grad=True)
    t = bt.tensor(np.array([-100, -100, -100]), dtype=bt.int64)
    loss = bt.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert f64(loss) == 0
    assert np.all(f64(x.grad) == 0)


def test_add_layer_norm_grad_fn():
    x = bt.zeros((2, 3), requires_grad=True)
    s, y = bt.add_layer_norm(x, x)
    assert y.grad_fn is not None and s.grad_fn is not None


# ---- vs PyTorch CPU (when importable) -----------------------------------------------------------
@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_add_layer_norm_vs_torch(rng):
    x = rng.standard_normal((4, 6, 16))
    r = rng.standard_normal((4, 6, 16))
    w = rng.standard_normal(16)
    b = rng.standard_normal(16)
    g1 = rng.standard_normal((4, 6, 16))
    g2 = rng.standard_normal((4, 6, 16))
    ts = [torch.tensor(a, requires_grad=True) for a in (x, r, w, b)]
    s = ts[0] + ts[1]
    y = torch.nn.functional.layer_norm(s, (16,), ts[2], ts[3])
    ((s * torch.tensor(g1)).sum() + (y * torch.tensor(g2)).sum()).backward()
    bs = [bt.tensor(a, dtype=bt.float64, requires_grad=True) for a in (x, r, w, b)]
    s2, y2 = bt.add_layer_norm(*bs)
    ((s2 * bt.tensor(g1)).sum() + (y2 * bt.tensor(g2)).sum()).backward()
    np.testing.assert_allclose(f64(y2), y.detach().numpy(), rtol=1e-10, atol=1e-10)
    for a, b_ in zip(bs, ts):
        np.testing.assert_allclose(f64(a.grad), b_.grad.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_vs_torch(rng, reduction):
    x = rng.standard_normal((7, 11))
    t = rng.integers(0, 11, 7)
    t[2] = -100
    xt = torch.tensor(x, requires_grad=True)
    lt = torch.nn.functional.cross_entropy(
        xt, torch.tensor(t), reduction=reduction, label_smoothing=0.1
    )
    lt.sum().backward()
    xb = bt.tensor(x, dtype=bt.float64, requires_grad=True)
    lb = bt.cross_entropy(
        xb, bt.tensor(t, dtype=bt.int64), reduction=reduction, label_smoothing=0.1
    )
    lb.sum().backward()
    np.testing.assert_allclose(f64(lb), lt.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f64(xb.grad), xt.grad.numpy(), rtol=1e-10, atol=1e-12)


# ---- cross-entropy on a padded vocabulary (logits = X[:, :C] of a dense (N, Cp) X) -------------
# The front runs the loss on X itself with num_classes = C when the gradient reaches X through
# views only: the backward then writes X's padded (N, Cp) gradient in one pass (zeros in the
# padding) and no slice_scatter runs.  The loss's input edge shows which path ran.
def _ce_input_node(loss):
    """'Slice' on the plain path; on the padded one, whatever made X (X itself when a leaf)."""
    return loss.grad_fn.next_functions[0][0].name()


def _padded_x(rng, N, C, Cp, dtype, poison=True):
    x = rng.standard_normal((N, Cp)) * 3
    if poison:  # the padding must never reach the loss or the gradient
        x[:, C:] = np.nan
        if Cp - C > 1:
            x[0, C + 1] = np.inf
    return x


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_cross_entropy_padded_vs_numpy(rng, dtype, reduction, ls):
    N, C, Cp = 9, 37, 48
    x = _padded_x(rng, N, C, Cp, dtype)
    t = rng.integers(0, C, N)
    t[[0, 4]] = -1
    t[1] = C - 1  # the last real class
    X = bt.tensor(x, dtype=dtype, requires_grad=True)
    ld = bt.float32 if dtype == bt.bfloat16 else None
    loss = bt.cross_entropy(
        X.narrow(1, 0, C),
        bt.tensor(t, dtype=bt.int64),
        ignore_index=-1,
        reduction=reduction,
        label_smoothing=ls,
        loss_dtype=ld,
    )
    assert _ce_input_node(loss) == "AccumulateGrad"  # the padded path: X itself, no Slice
    ref_loss, ref_d = np_ce(f64(X)[:, :C], t, -1, reduction, ls)
    tol = TOL[dtype]
    np.testing.assert_allclose(f64(loss), ref_loss, rtol=tol, atol=tol)
    if reduction == "none":
        gl = rng.standard_normal(N)
        loss.backward(bt.tensor(gl, dtype=loss.dtype))
        ref_d = ref_d * gl[:, None]
    else:
        loss.backward()
    g = f64(X.grad)
    assert X.grad.dtype == dtype and X.grad.shape == (N, Cp)
    assert np.all(g[:, C:] == 0), "padding columns must get a zero gradient"
    np.testing.assert_allclose(g[:, :C], ref_d, rtol=tol, atol=tol)
    assert np.all(g[[0, 4]] == 0)


def _ce_both_paths(rng, dtype, N, C, Cp, ls=0.1, extra_use=True):
    """GPT-2's pattern: full = f(leaf) (B, T, Cp), flat = full.reshape(N, Cp).narrow(1, 0, C),
    full also used elsewhere; gradients of the padded path vs the plain one (a hook on the
    narrowed logits keeps the plain path: slice backward + scatter)."""
    w = rng.standard_normal((N // 3, 3, Cp))
    w[..., C:] = 0.0
    t = rng.integers(0, C, N)
    t[2] = -1
    ld = bt.float32 if dtype in (bt.bfloat16, bt.float16) else None
    grads, losses, nodes = [], [], []
    for plain in (False, True):
        W = bt.tensor(w, dtype=dtype, requires_grad=True)
        full = W * 2.0  # non-leaf (B, T, Cp)
        flat = full.reshape(N, Cp).narrow(1, 0, C)
        if plain:
            flat.register_hook(lambda g: None)
        loss = bt.cross_entropy(
            flat, bt.tensor(t, dtype=bt.int64), ignore_index=-1, label_smoothing=ls, loss_dtype=ld
        )
        nodes.append(_ce_input_node(loss))
        total = loss.to(dtype) + (full * full).sum() * 0.01 if extra_use else loss
        total.backward()
        grads.append(f64(W.grad))
        losses.append(f64(loss))
    assert nodes == ["Reshape", "Slice"], nodes
    return grads, losses


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
def test_cross_entropy_padded_identical_to_plain(rng, dtype):
    (gp, gq), (lp, lq) = _ce_both_paths(rng, dtype, 12, 29, 40)
    assert np.array_equal(lp, lq)
    assert np.array_equal(gp, gq), "padded path gradient differs from the plain path"


def test_cross_entropy_padded_vs_unpadded_equivalent(rng):
    N, C, Cp = 10, 21, 32
    x = _padded_x(rng, N, C, Cp, bt.float64)
    t = rng.integers(0, C, N)
    X = bt.tensor(x, requires_grad=True)
    Y = bt.tensor(np.ascontiguousarray(x[:, :C]), requires_grad=True)
    tt = bt.tensor(t, dtype=bt.int64)
    lx = bt.cross_entropy(X.narrow(1, 0, C), tt, label_smoothing=0.2)
    ly = bt.cross_entropy(Y, tt, label_smoothing=0.2)
    lx.backward()
    ly.backward()
    assert np.array_equal(f64(lx), f64(ly))
    assert np.array_equal(f64(X.grad)[:, :C], f64(Y.grad))


def test_cross_entropy_padded_target_out_of_range():
    # a target in the padding (C <= t < Cp) is out of range: C classes, not Cp
    X = bt.zeros((3, 8), requires_grad=True)
    with pytest.raises(IndexError, match="cross_entropy"):
        bt.cross_entropy(X.narrow(1, 0, 5), bt.tensor(np.array([0, 6, 1]), dtype=bt.int64))


def test_cross_entropy_padded_fallbacks(rng):
    N, C, Cp = 6, 7, 10
    x = rng.standard_normal((N, Cp))
    t = bt.tensor(rng.integers(0, C, N), dtype=bt.int64)
    _, ref_d = np_ce(x[:, 1 : C + 1], t.numpy(), -100, "mean", 0.0)
    # offset view (start 1): the plain path reads the strided rows in place
    X = bt.tensor(x, requires_grad=True)
    loss = bt.cross_entropy(X.narrow(1, 1, C), t)
    assert _ce_input_node(loss) == "Slice"
    loss.backward()
    g = f64(X.grad)
    np.testing.assert_allclose(g[:, 1 : C + 1], ref_d, rtol=1e-10, atol=1e-12)
    assert np.all(g[:, 0] == 0) and np.all(g[:, C + 1 :] == 0)
    # a leaf view (made without grad) that then requires grad: its own .grad, (N, C)
    X2 = bt.tensor(x, requires_grad=True)
    with bt.no_grad():
        v = X2.narrow(1, 0, C)
    v.requires_grad_(True)
    bt.cross_entropy(v, t).backward()
    assert X2.grad is None and v.grad.shape == (N, C)
    _, ref0 = np_ce(x[:, :C], t.numpy(), -100, "mean", 0.0)
    np.testing.assert_allclose(f64(v.grad), ref0, rtol=1e-10, atol=1e-12)
    # retain_grad on the narrowed logits: the plain path, and logits.grad is filled
    X3 = bt.tensor(x, requires_grad=True)
    lg = X3.narrow(1, 0, C)
    lg.retain_grad()
    l3 = bt.cross_entropy(lg, t)
    assert _ce_input_node(l3) == "Slice"
    l3.backward()
    np.testing.assert_allclose(f64(lg.grad), ref0, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f64(X3.grad)[:, :C], ref0, rtol=1e-10, atol=1e-12)
    # transposed base (not row-major): plain path, still correct
    X4 = bt.tensor(np.ascontiguousarray(x.T), requires_grad=True)
    l4 = bt.cross_entropy(X4.T.narrow(1, 0, C), t)
    l4.backward()
    np.testing.assert_allclose(f64(X4.grad).T[:, :C], ref0, rtol=1e-10, atol=1e-12)
    # no grad: forward only on the strided view, same loss
    with bt.no_grad():
        l5 = bt.cross_entropy(bt.tensor(x).narrow(1, 0, C), t)
    np.testing.assert_allclose(f64(l5), f64(l3), rtol=1e-12)


def test_gradcheck_cross_entropy_padded(rng):
    tgt = bt.tensor(np.array([0, 2, -100, 4]), dtype=bt.int64)
    _gc(
        lambda x: bt.cross_entropy(x.narrow(1, 0, 5), tgt, label_smoothing=0.1),
        [leaf(rng, (4, 8))],
    )


# ---- the loss's backward writing dlogits over dropped logits ----------------------------------
# Note [donating a saved input] (primitives.h): with backward's last run (no retain_graph) and no
# other holder of the logits' memory, cross_entropy's vjp writes dlogits over the logits.  The
# gradient then reaches the logits' producer in the logits' own memory (its data_ptr); when the
# logits are held, it gets fresh memory and the held logits are unchanged.  Either way the
# gradients are bitwise those of the out-of-place backward.
def _head_loss(seed, dtype, C, Cp, *, keep, retain=False, B=3, T=5, K=6):
    """h (B, T, K), W (Cp, K) leaves; full = linear(h, W); the loss on full's first C columns,
    backward run once.  Returns (h, W, loss, whether the gradient reached full in the logits'
    memory, (held logits, their values before backward) when keep)."""
    rng = np.random.default_rng(seed)
    h = bt.tensor(rng.standard_normal((B, T, K)), dtype=dtype, requires_grad=True)
    W = bt.tensor(rng.standard_normal((Cp, K)), dtype=dtype, requires_grad=True)
    t = rng.integers(0, C, B * T)
    t[3] = -1
    probe, seen = gradient_probe()
    full = probe(bt.linear(h, W))  # (B, T, Cp), as GPT-2's tied head
    ptr = full.data_ptr()
    flat = full.reshape(B * T, Cp)
    logits = flat.narrow(1, 0, C) if Cp > C else flat
    ld = bt.float32 if dtype == bt.bfloat16 else None
    loss = bt.cross_entropy(
        logits, bt.tensor(t, dtype=bt.int64), ignore_index=-1, label_smoothing=0.1, loss_dtype=ld
    )
    held = (logits, f64(logits)) if keep else None
    del full, flat, logits
    loss.backward(retain_graph=retain)
    return h, W, loss, seen[-1] == ptr, held


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
@pytest.mark.parametrize("C, Cp", [(37, 48), (40, 40)])
def test_cross_entropy_backward_overwrites_dropped_logits(rng, dtype, C, Cp):
    seed = int(rng.integers(1 << 30))
    h, W, _, donated, _ = _head_loss(seed, dtype, C, Cp, keep=False)
    assert donated, "dlogits should take the dropped logits' memory"
    rh, rW, _, donated_ref, (lg, before) = _head_loss(seed, dtype, C, Cp, keep=True)
    assert not donated_ref, "held logits must not be overwritten"
    assert np.array_equal(f64(lg), before), "the held logits changed"
    assert np.array_equal(f64(h.grad), f64(rh.grad)) and np.array_equal(f64(W.grad), f64(rW.grad))
    if dtype == bt.float64:  # and they are right: the float64 reference through the head
        rng = np.random.default_rng(seed)
        x, w = rng.standard_normal((15, 6)), rng.standard_normal((Cp, 6))
        t = rng.integers(0, C, 15)
        t[3] = -1
        _, d = np_ce((x @ w.T)[:, :C], t, -1, "mean", 0.1)
        np.testing.assert_allclose(f64(h.grad).reshape(15, 6), d @ w[:C], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(f64(W.grad)[:C], d.T @ x, rtol=1e-10, atol=1e-12)
        assert np.all(f64(W.grad)[C:] == 0)


def test_cross_entropy_backward_keeps_logits_for_retain_graph(rng):
    seed = int(rng.integers(1 << 30))
    h, W, loss, donated, _ = _head_loss(seed, bt.float32, 37, 48, keep=False, retain=True)
    assert not donated, "retain_graph: the node runs again and must still read its logits"
    once = f64(W.grad)
    loss.backward()  # the second run reads the logits it saved: intact, so the same gradient
    np.testing.assert_array_equal(f64(W.grad), 2 * once)
    rh, rW, _, _, _ = _head_loss(seed, bt.float32, 37, 48, keep=False)
    np.testing.assert_array_equal(once, f64(rW.grad))


def test_cross_entropy_backward_other_holders_block_the_overwrite(rng):
    # a second node that saved the logits (an alias times W, whose backward reads it after the
    # cross-entropy's), and a numpy export: no overwrite, and the gradient is the out-of-place
    # one.  full's gradient is the cross-entropy's alone, so the hook sees that buffer while the
    # logits' memory is still held (a summed gradient, allocated after the holders let go, could
    # reuse that memory and read as an overwrite).
    x = rng.standard_normal((6, 9))
    t = bt.tensor(rng.integers(0, 9, 6), dtype=bt.int64)
    for other in ("mul", "numpy"):
        X = bt.tensor(x, requires_grad=True)
        W = bt.tensor(rng.standard_normal((6, 9)), requires_grad=True)
        full = X * 1.0
        ptr = full.data_ptr()
        seen = []
        full.register_hook(lambda g, seen=seen: seen.append(g.data_ptr()))  # full is no view
        extra = (full.detach() * W).sum() if other == "mul" else None
        export = full.detach().numpy() if other == "numpy" else None
        before = None if export is None else export.copy()
        loss = bt.cross_entropy(full, t)
        del full
        (loss + extra if extra is not None else loss).backward()
        assert seen[-1] != ptr, other
        if export is not None:
            assert np.array_equal(export, before), "the exported logits changed"
        else:  # the product's backward read the logits intact
            np.testing.assert_array_equal(f64(W.grad), x)
        _, d = np_ce(x, t.numpy(), -100, "mean", 0.0)
        np.testing.assert_allclose(f64(X.grad), d, rtol=1e-10, atol=1e-12)


def _gelu_tanh_grad_composed(x: bt.Tensor, g: bt.Tensor) -> bt.Tensor:
    """dy * gelu_tanh'(x) op by op, as Unary's vjp composed it before GeluTanhBackward."""
    k, c = float(np.sqrt(2.0 / np.pi)), 0.044715
    with bt.no_grad():
        x2 = x * x
        t = (x * (x2 * c + 1.0) * k).tanh()
        left = (t + 1.0) * 0.5
        right = x * (1.0 - t * t) * (x2 * (3 * c) + 1.0) * (0.5 * k)
        return g * (left + right)


def _same_bits(a: bt.Tensor, b: bt.Tensor) -> bool:
    a64, b64 = a.to(bt.float64).numpy(), b.to(bt.float64).numpy()
    both_nan = np.isnan(a64) & np.isnan(b64)
    return bool(
        np.array_equal(a64[~both_nan], b64[~both_nan])
        and np.array_equal(np.isnan(a64), np.isnan(b64))
    )


@pytest.mark.parametrize("dtype", [bt.float32, bt.float64, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("n", [1, 7, 513, 70000])
def test_gelu_tanh_backward_is_the_composition_bit_for_bit(rng, dtype, n):
    # GeluTanhBackward (the CPU's one pass) must give the composed ops' bits: the same
    # operations, each rounded to the dtype (Note [gelu backward]); 70000 runs on the pool
    x = rng.standard_normal(n) * 4
    x[: min(n, 6)] = [0.0, -0.0, 25.0, -25.0, 1e-30, np.inf][: min(n, 6)]
    if n > 6:
        x[6] = np.nan
    xt = bt.tensor(x).to(dtype).requires_grad_(True)
    g = bt.tensor(rng.standard_normal(n)).to(dtype)
    bt.gelu(xt, "tanh").backward(g)
    assert xt.grad.dtype == dtype
    assert _same_bits(xt.grad, _gelu_tanh_grad_composed(xt.detach(), g))
    # and against float64 where the rounding allows (a finite, ordinary input)
    ok = np.isfinite(x) & (np.abs(x) < 10)
    x64 = x[ok]
    t = np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3))
    d = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x64**2)
    ref = g.to(bt.float64).numpy()[ok] * d
    got = xt.grad.to(bt.float64).numpy()[ok]
    tol = {bt.float64: 1e-12, bt.float32: 1e-5, bt.bfloat16: 8e-2, bt.float16: 1e-2}[dtype]
    assert np.allclose(got, ref, rtol=tol, atol=tol)


# ---- mixed rows: float32 x, 16-bit y (Note [float32 residual stream]) -------------------------
HALF = [bt.bfloat16, bt.float16]
ULP = {bt.bfloat16: 2.0**-8, bt.float16: 2.0**-11}  # a 16-bit rounding, relative


def rounded(a, dtype):
    """float64 values of `a` rounded to dtype (what a 16-bit tensor holds)."""
    return f64(bt.tensor(a, dtype=dtype))


def np_ln_backward_stats(dy, s, w, mean, rstd):
    """dx, dw, db of a layer norm at the given (saved float32) statistics, in float64."""
    xh = (s - mean[:, None]) * rstd[:, None]
    g = dy * w
    dx = rstd[:, None] * (g - g.mean(-1, keepdims=True) - xh * (g * xh).mean(-1, keepdims=True))
    return dx, (dy * xh).sum(0), dy.sum(0)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("C", [1, 7, 64, 1025])
def test_mixed_layer_norm_vs_numpy(rng, dtype, C):
    """layer_norm(x float32, out_dtype=16-bit): the float32 row normalised with float32 weight
    and bias, y rounded once; backward reads the 16-bit dy and gives float32 dx, dw, db."""
    R = 5
    x = rng.standard_normal((R, C)).astype(np.float32) * 3 + 1
    w, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    xt = bt.tensor(x, requires_grad=True)
    wt, bt_ = bt.tensor(w, requires_grad=True), bt.tensor(b, requires_grad=True)
    y = bt.layer_norm(xt, C, wt, bt_, out_dtype=dtype)
    assert y.dtype == dtype and y.shape == (R, C)
    ref, mean, rstd = np_layer_norm(x.astype(np.float64), w, b, 1e-5)
    # one rounding of the float64 value (the CPU's statistics are double)
    np.testing.assert_array_equal(f64(y), rounded(ref, dtype))
    dy = rounded(rng.standard_normal((R, C)), dtype)
    y.backward(bt.tensor(dy, dtype=dtype))
    assert xt.grad.dtype == bt.float32 and wt.grad.dtype == bt.float32
    dx, dw, db = np_ln_backward_stats(dy, x.astype(np.float64), w, mean, rstd)
    scale = 1 if C > 1 else 0  # C == 1: dx is exactly 0
    np.testing.assert_allclose(f64(xt.grad), dx * scale, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(wt.grad), dw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f64(bt_.grad), db, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("C", [3, 64, 1025])
@pytest.mark.parametrize("rbias", [True, False])
def test_mixed_add_layer_norm_vs_numpy(rng, dtype, C, rbias):
    """add_layer_norm(x float32, residual 16-bit, out_dtype=16-bit): sum = (x + residual) +
    residual_bias in float32 exactly as float32 arithmetic gives it, y the float64 norm of that
    sum rounded once; parameters float32."""
    R = 4
    x = rng.standard_normal((R, C)).astype(np.float32) * 10
    r = rounded(rng.standard_normal((R, C)), dtype).astype(np.float32)
    w, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    rb = rng.standard_normal(C).astype(np.float32)
    s, y = bt.add_layer_norm(
        bt.tensor(x),
        bt.tensor(r, dtype=dtype),
        bt.tensor(w),
        bt.tensor(b),
        residual_bias=bt.tensor(rb) if rbias else None,
        out_dtype=dtype,
    )
    assert s.dtype == bt.float32 and y.dtype == dtype
    ref_s = (x + r) + rb if rbias else x + r  # float32 arithmetic
    np.testing.assert_array_equal(s.numpy(), ref_s)
    ref_y, _, _ = np_layer_norm(ref_s.astype(np.float64), w, b, 1e-5)
    np.testing.assert_array_equal(f64(y), rounded(ref_y, dtype))


def _mixed_chain(rng, dtype, C, sum_cotangent, stream_grad=None):
    """x (float32 leaf) -> (s1, y1) = add_layer_norm(x, r1) -> (s2, y2) = add_layer_norm(s1, r2),
    loss = <y1, g1> + <y2, g2> (+ <s2, gs> with sum_cotangent), all mixed (stream_grad_dtype
    stream_grad); returns the leaves' gradients and the float64 reference of x's."""
    R = 6
    x = rng.standard_normal((R, C)).astype(np.float32) * 4
    r1, r2, g1, g2 = (rounded(rng.standard_normal((R, C)), dtype) for _ in range(4))
    gs = rng.standard_normal((R, C)).astype(np.float32)
    w1, w2, rb1 = (rng.standard_normal(C).astype(np.float32) for _ in range(3))
    leaves = [bt.tensor(x, requires_grad=True), bt.tensor(r1, dtype=dtype, requires_grad=True)]
    leaves += [bt.tensor(r2, dtype=dtype, requires_grad=True), bt.tensor(rb1, requires_grad=True)]
    xt, r1t, r2t, rb1t = leaves
    kw = {"out_dtype": dtype, "stream_grad_dtype": stream_grad}
    s1, y1 = bt.add_layer_norm(xt, r1t, bt.tensor(w1), None, residual_bias=rb1t, **kw)
    s2, y2 = bt.add_layer_norm(s1, r2t, bt.tensor(w2), None, **kw)
    loss = (y1 * bt.tensor(g1, dtype=dtype)).float().sum()
    loss = loss + (y2 * bt.tensor(g2, dtype=dtype)).float().sum()
    if sum_cotangent:
        loss = loss + (s2 * bt.tensor(gs)).sum()
    loss.backward()
    # float64 reference (the forward's float32 sums and statistics as the op stored them)
    S1 = f64(s1)
    S2 = f64(s2)
    _, m1, q1 = np_layer_norm(S1, None, None, 1e-5)
    _, m2, q2 = np_layer_norm(S2, None, None, 1e-5)
    d2 = np_ln_backward_stats(g2, S2, w2, m2, q2)[0] + (gs if sum_cotangent else 0)
    d1 = np_ln_backward_stats(g1, S1, w1, m1, q1)[0] + d2
    return xt.grad, r1t.grad, r2t.grad, rb1t.grad, d1, d2


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_add_layer_norm_stream_gradient_is_16_bit(rng, dtype):
    """The float32 sum's gradient travels in y's dtype between two add_layer_norms: x's gradient
    is then exactly the residual's (one 16-bit dx for both), and each within a 16-bit rounding
    per add of the float64 chain; the residual bias's gradient the column sums of that dx."""
    C = 48
    gx, gr1, gr2, grb, d1, d2 = _mixed_chain(rng, dtype, C, sum_cotangent=False)
    assert gx.dtype == bt.float32 and gr1.dtype == dtype and grb.dtype == bt.float32
    np.testing.assert_array_equal(f64(gx), f64(gr1))
    tol = 4 * ULP[dtype]
    np.testing.assert_allclose(f64(gr2), d2, rtol=tol, atol=tol * np.abs(d2).max())
    np.testing.assert_allclose(f64(gx), d1, rtol=tol, atol=tol * np.abs(d1).max())
    err = np.abs(f64(grb) - f64(gr1).sum(0)) / np.abs(f64(gr1)).sum(0)
    assert err.max() < 1e-6, err.max()


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_add_layer_norm_float32_sum_gradient_stays_float32(rng, dtype):
    """When the sum's gradient comes float32 (its reader is not an add_layer_norm), dx is float32:
    x's gradient matches float64 to float32 accuracy; the residual gets it rounded to 16 bits."""
    C = 40
    gx, gr1, _, _, d1, _ = _mixed_chain(rng, dtype, C, sum_cotangent=True)
    np.testing.assert_allclose(f64(gx), d1, rtol=1e-5, atol=1e-5 * np.abs(d1).max())
    np.testing.assert_array_equal(f64(gr1), rounded(f64(gx), dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_add_layer_norm_float32_stream_gradient(rng, dtype):
    """stream_grad_dtype=float32 (autocast's): the sum's gradient travels float32 between two
    add_layer_norms, so x's gradient matches float64 to float32 accuracy where the default's is
    a 16-bit value; each residual gets its add's float32 gradient rounded once."""
    C = 56
    gx, gr1, gr2, grb, d1, d2 = _mixed_chain(rng, dtype, C, False, stream_grad=bt.float32)
    assert gx.dtype == bt.float32 and gr1.dtype == dtype and gr2.dtype == dtype
    np.testing.assert_allclose(f64(gx), d1, rtol=1e-5, atol=1e-5 * np.abs(d1).max())
    np.testing.assert_array_equal(f64(gr1), rounded(f64(gx), dtype))
    tol = ULP[dtype]  # one rounding of a float32 value
    np.testing.assert_allclose(f64(gr2), d2, rtol=tol, atol=tol * np.abs(d2).max())
    err = np.abs(f64(grb) - f64(gx).sum(0)) / np.abs(f64(gx)).sum(0)  # the float32 dx's sums
    assert err.max() < 1e-6, err.max()
    # the default's x gradient is a 16-bit value (one dx for the stream and the residual)
    gx16 = _mixed_chain(rng, dtype, C, False)[0]
    np.testing.assert_array_equal(f64(gx16), rounded(f64(gx16), dtype))
    assert not np.array_equal(f64(gx), rounded(f64(gx), dtype))


def test_mixed_norm_dtype_pairs_and_errors(rng):
    """Pairs other than float32 -> 16-bit normalise in x's dtype and cast; bad out_dtype names
    the op."""
    x = rng.standard_normal((3, 8))
    xb = bt.tensor(x, dtype=bt.bfloat16)
    y = bt.layer_norm(xb, 8, out_dtype=bt.float32)
    assert y.dtype == bt.float32
    np.testing.assert_array_equal(f64(y), f64(bt.layer_norm(xb, 8).float()))
    x32 = bt.tensor(x, dtype=bt.float32)
    s, y = bt.add_layer_norm(x32, bt.tensor(x, dtype=bt.float32), out_dtype=bt.bfloat16)
    assert s.dtype == bt.float32 and y.dtype == bt.bfloat16  # a float32 residual: add, then cast
    np.testing.assert_array_equal(f64(y), f64(bt.add_layer_norm(x32, x32)[1].to(bt.bfloat16)))
    with pytest.raises(TypeError, match=r"\[layer_norm\] out_dtype"):
        bt.layer_norm(x32, 8, out_dtype=bt.int64)
    with pytest.raises(TypeError, match=r"\[add_layer_norm\] out_dtype"):
        bt.add_layer_norm(x32, x32, out_dtype=bt.int32)
    msg = r"\[add_layer_norm\] stream_grad_dtype must be .*float32.*bfloat16.*got float16"
    with pytest.raises(ValueError, match=msg):
        bt.add_layer_norm(x32, xb, out_dtype=bt.bfloat16, stream_grad_dtype=bt.float16)
    # x's dtype or y's: accepted wherever they are (one dtype to choose from when they agree)
    for gd in (bt.float32, bt.bfloat16):
        bt.add_layer_norm(x32, xb, out_dtype=bt.bfloat16, stream_grad_dtype=gd)
    bt.add_layer_norm(x32, x32, stream_grad_dtype=bt.float32)


SPECIAL_ROWS = [
    [-np.inf, -np.inf, -np.inf, -np.inf],  # every class masked
    [-np.inf, 1.0, -np.inf, 2.0],  # some masked
    [np.nan, 1.0, 2.0, 3.0],
    [np.inf, 1.0, 2.0, 3.0],
    [np.inf, -np.inf, 0.0, 1.0],
    [1e30, -1e30, 0.0, 1.0],
    [0.5, -0.25, 1.0, 2.0],
]


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
def test_special_rows_match_torch(dtype):
    """softmax / log_softmax / cross_entropy of rows with -inf, +inf, NaN (and of a row of -inf
    only: NaN, as PyTorch; its lse statistic is -inf on both backends, src/cpu/nn.cpp), forward
    and gradients.  The CUDA side: test_tensor_cuda_hostile.py's special-value tests."""
    x = np.array(SPECIAL_ROWS)
    tgt = np.array([0, 1, 1, 2, 3, 2, 0])
    g = np.linspace(-1.0, 1.0, x.size).reshape(x.shape)
    tdt = {bt.float64: torch.float64, bt.float32: torch.float32, bt.bfloat16: torch.bfloat16}[dtype]

    def same(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a) & (a > 0), np.isinf(b) & (b > 0))
        np.testing.assert_array_equal(np.isinf(a) & (a < 0), np.isinf(b) & (b < 0))
        fin = np.isfinite(b)
        np.testing.assert_allclose(a[fin], b[fin], rtol=2e-2 if dtype == bt.bfloat16 else 1e-5)

    for name in ("softmax", "log_softmax"):
        xb = bt.tensor(x, dtype=dtype).requires_grad_(True)
        yb = getattr(bt, name)(xb, -1)
        yb.backward(bt.tensor(g, dtype=dtype))
        xt = torch.tensor(x, dtype=tdt, requires_grad=True)
        yt = getattr(torch.nn.functional, name)(xt, -1)
        yt.backward(torch.tensor(g, dtype=tdt))
        same(yb.detach().float().numpy(), yt.detach().float().numpy())
        same(xb.grad.float().numpy(), xt.grad.float().numpy())
    for ii in (-100, 0):  # ignore_index 0 ignores rows 0 and 6
        xb = bt.tensor(x, dtype=dtype).requires_grad_(True)
        lb = bt.cross_entropy(xb, bt.tensor(tgt), ignore_index=ii, reduction="none")
        lb.backward(bt.ones(len(tgt), dtype=dtype))
        xt = torch.tensor(x, dtype=tdt, requires_grad=True)
        lt = torch.nn.functional.cross_entropy(
            xt, torch.tensor(tgt), ignore_index=ii, reduction="none"
        )
        lt.backward(torch.ones(len(tgt), dtype=tdt))
        same(lb.detach().float().numpy(), lt.detach().float().numpy())
        want = xt.grad.float().numpy()
        want[tgt == ii] = 0  # an ignored row passes no gradient (PyTorch: NaN there; docstring)
        same(xb.grad.float().numpy(), want)
