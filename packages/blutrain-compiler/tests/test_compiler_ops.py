"""Every lowered op and fusion pattern against eager on fresh random inputs.

Tolerance: float32 results to 1e-6 of the largest reference magnitude (the compiled kernels
use eager's own float32 exp / tanh polynomials and float64 sums, so most agree to the bit);
float64 exactly where eager's float64 path is a plain formula (elementwise ops, views).
"""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.compiler as btc
import blutrain.tensor as bt

RNG = np.random.default_rng()


def rand(*shape: int, dtype: str = "float32", lo: float = -2.0, hi: float = 2.0) -> bt.Tensor:
    return bt.tensor(RNG.uniform(lo, hi, shape).astype(dtype))


def close(got: bt.Tensor, ref: bt.Tensor, tol: float = 1e-6) -> float:
    a, b = np.asarray(got.numpy(), np.float64), np.asarray(ref.numpy(), np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.dtype == bool or ref.dtype in (bt.bool, bt.int64, bt.int32):
        np.testing.assert_array_equal(a, b)
        return 0.0
    fin = np.isfinite(b)
    np.testing.assert_array_equal(np.isfinite(a), fin)
    scale = max(np.abs(b[fin]).max(initial=0.0), 1e-30)
    err = np.abs(a[fin] - b[fin]).max(initial=0.0) / scale
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"
    return err


def check(fn, *args, tol: float = 1e-6):
    c = btc.compile(fn)
    got = c(*args)
    ref = fn(*args)
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for g, r in zip(got, ref):
        close(g, r, tol)
    return c


UNARY = ["neg", "exp", "tanh", "abs", "sigmoid", "relu", "sin", "cos", "erf", "sign"]


@pytest.mark.parametrize("op", UNARY + ["log", "sqrt", "rsqrt", "gelu", "gelu_tanh"])
def test_unary(op: str) -> None:
    pos = op in ("log", "sqrt", "rsqrt")
    x = rand(7, 33, lo=0.1 if pos else -3.0, hi=3.0)
    if op == "gelu_tanh":
        check(lambda t: bt.gelu(t, approximate="tanh"), x)
    else:
        check(lambda t: getattr(bt, op)(t), x)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum", "pow"])
def test_binary_broadcast(op: str) -> None:
    a = rand(4, 5, 6, lo=0.5)
    b = rand(5, 1, lo=0.5)
    check(lambda x, y: getattr(bt, op)(x, y), a, b)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_compare(op: str) -> None:
    a = bt.tensor(RNG.integers(0, 3, (6, 7)).astype(np.float32))
    b = bt.tensor(RNG.integers(0, 3, (6, 7)).astype(np.float32))
    check(lambda x, y: getattr(x, op)(y), a, b)


def test_float64_elementwise_exact() -> None:
    a, b = rand(5, 9, dtype="float64"), rand(5, 9, dtype="float64")
    check(lambda x, y: (x * y + x / (y + 3.0)) - bt.maximum(x, y) * 0.5, a, b, tol=0.0)


def test_where_masked_fill_cast() -> None:
    x = rand(8, 8)
    m = x.gt(0.3)
    check(lambda t, mm: bt.where(mm, t * 2, t - 1).masked_fill(mm.logical_not(), -5.0), x, m)
    check(lambda t: (t * 3).long().float() + t.double().float(), x)


def test_views_fused() -> None:
    x = rand(2, 3, 4, 5)
    check(lambda t: (t.permute(0, 2, 1, 3).reshape(8, 15) * 2)[:, 1:9:2].exp(), x)
    check(lambda t: t.transpose(1, 3).sum(dim=(1,)) + t[:, 1].sum(-1).unsqueeze(-1), x)


@pytest.mark.parametrize(
    "dims,keep", [((-1,), False), ((0,), True), ((0, 2), False), (None, False)]
)
def test_reductions(dims, keep) -> None:
    x = rand(6, 7, 8)
    if dims is None:
        check(lambda t: (t * t).sum() + t.mean(), x)
    else:
        check(lambda t: t.sum(dim=dims, keepdim=keep), x)
        check(lambda t: t.mean(dim=dims, keepdim=keep), x)
        check(lambda t: t.amax(dim=dims, keepdim=keep), x)
        check(lambda t: t.amin(dim=dims, keepdim=keep), x)


def test_softmax_family() -> None:
    x = rand(5, 3, 40, lo=-6, hi=6)
    check(lambda t: bt.softmax(t, -1), x)
    check(lambda t: bt.log_softmax(t, -1), x)


def test_layer_norm() -> None:
    x, w, b = rand(4, 6, 48), rand(48), rand(48)
    check(lambda t, ww, bb: bt.layer_norm(t, (48,), ww, bb), x, w, b)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_mixed_layer_norms_match_eager_bitwise(half: str) -> None:
    """The float32 residual stream's norms (blutrain.tensor's Note [float32 residual stream],
    GPT-2's default under bf16): layer_norm and add_layer_norm of a float32 row into a 16-bit
    y (out_dtype), the residual 16-bit, float32 weights, and their backward (the sum's gradient
    carried in y's dtype, layer_norm's input gradient float32): compiled, every output has
    eager's dtype and bits (the lowering wrote y and dx in x's dtype: an MLIR type error)."""
    hdt = getattr(bt, half)
    R, C = 70, 96  # 70 rows: a full and a ragged block of the column sums

    def inputs() -> list[bt.Tensor]:
        x = rand(R, C)
        r = rand(R, C).to(hdt)
        w, b, rb = rand(C, lo=0.5, hi=1.5), rand(C, lo=-0.2, hi=0.2), rand(C, lo=-0.2, hi=0.2)
        return [t.requires_grad_(True) for t in (x, r, w, b, rb)] + [rand(R, C).to(hdt)]

    def f(x, r, w, b, rb, g):
        s, y = bt.add_layer_norm(x, r, w, b, 1e-5, residual_bias=rb, out_dtype=hdt)
        y2 = bt.layer_norm(s, (C,), w, b, 1e-5, out_dtype=hdt)
        ((y.float() * g.float()).sum() + (y2.float() * y.float()).sum()).backward()
        return y, y2, s, x.grad, r.grad, w.grad, b.grad, rb.grad

    args = inputs()

    def fresh() -> list[bt.Tensor]:
        return [t.detach().clone().requires_grad_(True) for t in args[:5]] + args[5:]

    ref = f(*fresh())
    c = btc.compile(f)
    c(*fresh())  # the capture
    got = c(*fresh())  # the compiled program
    names = ["y", "y2", "sum", "dx", "dresidual", "dweight", "dbias", "dresidual_bias"]
    for name, a, e in zip(names, got, ref, strict=True):
        assert a.dtype == e.dtype, (name, a.dtype, e.dtype)
        assert np.array_equal(a.detach().float().numpy(), e.detach().float().numpy()), name


def test_cross_entropy() -> None:
    logits = rand(12, 30, lo=-4, hi=4)
    tgt = bt.tensor(RNG.integers(0, 30, 12).astype(np.int64))
    tgt[3] = -100
    check(lambda a, t: bt.cross_entropy(a, t), logits, tgt)
    check(lambda a, t: bt.cross_entropy(a, t, reduction="sum"), logits, tgt)


def test_backward_composites() -> None:
    """softmax / layer_norm / cross_entropy backward (captured with the forward)."""
    x = rand(6, 32)
    w, b = rand(32), rand(32)
    tgt = bt.tensor(RNG.integers(0, 32, 6).astype(np.int64))

    def loss(t, ww, bb, y):
        h = bt.layer_norm(t, (32,), ww, bb)
        return bt.cross_entropy(bt.softmax(h, -1) * 3.0, y)

    check(loss, x, w, b, tgt)


def test_fusion_counts_softmax_one_group() -> None:
    c = check(lambda t: bt.softmax(t * 2.0 + 1.0, -1).sum(-1), rand(8, 64))
    (prog,) = [p.prog for p in c.programs.values()]
    assert prog.stats.groups == 1
    assert prog.stats.eager_steps == 0


def test_cat_and_rotary() -> None:
    x = rand(2, 3, 5, 8)
    c, s = rand(5, 8), rand(5, 8)

    def rope(t, cs, sn):
        t1, t2 = t[..., :4], t[..., 4:]
        return t * cs + bt.cat([-t2, t1], -1) * sn

    check(rope, x, c, s)
    check(lambda a, b: bt.cat([a, b * 2], 1).exp(), rand(3, 4), rand(3, 6))
