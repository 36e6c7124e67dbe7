"""Precision controls (CPU): float32 matmul precision, linear_gelu, bt.amp policies, autocast and
bt.checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import nn


def _np(t: bt.Tensor) -> np.ndarray:
    return t.detach().to(bt.float64).numpy()


def _gelu_tanh(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


@pytest.fixture(autouse=True)
def _restore_precision():
    prev = bt.get_float32_matmul_precision()
    prev_attention = bt.get_float32_attention_precision()
    yield
    bt.set_float32_matmul_precision(prev)
    bt.set_float32_attention_precision(prev_attention)


# ---- float32 matmul precision ----------------------------------------------------------------
def test_matmul_precision_roundtrip():
    assert bt.get_float32_matmul_precision() == "highest"
    for p in ("high", "medium", "highest"):
        bt.set_float32_matmul_precision(p)
        assert bt.get_float32_matmul_precision() == p
    with pytest.raises(ValueError, match="set_float32_matmul_precision"):
        bt.set_float32_matmul_precision("fast")
    assert bt.get_float32_matmul_precision() == "highest"


def test_attention_precision_roundtrip():
    assert bt.get_float32_attention_precision() == "matmul"
    for p in ("highest", "scores", "matmul"):
        bt.set_float32_attention_precision(p)
        assert bt.get_float32_attention_precision() == p
    with pytest.raises(ValueError, match=r"set_float32_attention_precision.*got 'high'"):
        bt.set_float32_attention_precision("high")  # a matmul precision's name, not this one's
    assert bt.get_float32_attention_precision() == "matmul"
    assert bt.amp.set_float32_attention_precision is bt.set_float32_attention_precision


@pytest.mark.parametrize("op", ["matmul", "linear", "linear_gelu"])
def test_tf32_error_profile(rng, op):
    # 'high' rounds fp32 operands to TF32 (10-bit mantissa; linalg's CPU emulates it): error
    # ~1e-3 relative; 'highest' stays ~1e-6.
    a = rng.standard_normal((64, 256))
    b = rng.standard_normal((48, 256))
    ref = a @ b.T
    if op == "linear_gelu":
        ref = _gelu_tanh(ref)
    ta, tb = bt.tensor(a, dtype=bt.float32), bt.tensor(b, dtype=bt.float32)

    def run():
        if op == "matmul":
            return bt.matmul(ta, tb.T)
        return getattr(bt, op)(ta, tb)

    errs = {}
    for p in ("highest", "high"):
        bt.set_float32_matmul_precision(p)
        errs[p] = np.abs(_np(run()) - ref).max() / np.abs(ref).max()
    assert errs["highest"] < 2e-6, errs
    assert 1e-5 < errs["high"] < 5e-3, errs


def test_medium_rounds_to_bf16(rng):
    a, b = rng.standard_normal((32, 256)), rng.standard_normal((256, 16))
    ta, tb = bt.tensor(a, dtype=bt.float32), bt.tensor(b, dtype=bt.float32)
    bt.set_float32_matmul_precision("medium")
    err = np.abs(_np(ta @ tb) - a @ b).max() / np.abs(a @ b).max()
    assert 2e-4 < err < 3e-2, err


def test_precision_does_not_touch_other_dtypes(rng):
    a, b = rng.standard_normal((16, 32)), rng.standard_normal((32, 8))
    bt.set_float32_matmul_precision("high")
    out = bt.matmul(bt.tensor(a, dtype=bt.float64), bt.tensor(b, dtype=bt.float64))
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-12, atol=1e-12)


# ---- linear_gelu ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (2, 3, 9), (1, 1)])
def test_linear_gelu_matches_composed_fp64(rng, bias, shape):
    K, N = shape[-1], 6
    x = bt.tensor(rng.standard_normal(shape), dtype=bt.float64, requires_grad=True)
    w = bt.tensor(rng.standard_normal((N, K)), dtype=bt.float64, requires_grad=True)
    b = bt.tensor(rng.standard_normal(N), dtype=bt.float64, requires_grad=True) if bias else None
    g = bt.tensor(rng.standard_normal((*shape[:-1], N)), dtype=bt.float64)

    y = bt.linear_gelu(x, w, b)
    assert y.shape == (*shape[:-1], N) and y.dtype == bt.float64
    (y * g).sum().backward()
    grads = [t.grad.numpy().copy() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    y2 = bt.gelu(bt.linear(x, w, b), "tanh")
    (y2 * g).sum().backward()
    np.testing.assert_allclose(_np(y), _np(y2), rtol=1e-12, atol=1e-12)
    for got, t in zip(grads, [t for t in (x, w, b) if t is not None], strict=True):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_linear_gelu_gradcheck(rng):
    x = bt.tensor(rng.standard_normal((4, 3)), dtype=bt.float64, requires_grad=True)
    w = bt.tensor(rng.standard_normal((5, 3)), dtype=bt.float64, requires_grad=True)
    b = bt.tensor(rng.standard_normal(5), dtype=bt.float64, requires_grad=True)
    assert bt.gradcheck(bt.linear_gelu, [x, w, b])


@pytest.mark.parametrize("dtype,tol", [(bt.float32, 1e-5), (bt.bfloat16, 3e-2)])
def test_linear_gelu_low_precision(rng, dtype, tol):
    x = rng.standard_normal((33, 40))
    w = rng.standard_normal((24, 40)) * 0.2
    b = rng.standard_normal(24)
    g = rng.standard_normal((33, 24))
    ts = [bt.tensor(v, dtype=dtype, requires_grad=True) for v in (x, w, b)]
    y = bt.linear_gelu(*ts)
    assert y.dtype == dtype
    y.backward(bt.tensor(g, dtype=dtype))
    # float64 reference through the composed ops
    rs = [bt.tensor(_np(t), dtype=bt.float64, requires_grad=True) for t in ts]
    yr = bt.gelu(bt.linear(*rs), "tanh")
    yr.backward(bt.tensor(_np(bt.tensor(g, dtype=dtype)), dtype=bt.float64))
    scale = np.abs(_np(yr)).max()
    assert np.abs(_np(y) - _np(yr)).max() <= tol * scale
    for t, r in zip(ts, rs, strict=True):
        assert t.grad.dtype == dtype
        s = np.abs(_np(r.grad)).max()
        assert np.abs(_np(t.grad) - _np(r.grad)).max() <= tol * s * 2


def test_linear_gelu_only_some_grads(rng):
    x = bt.tensor(rng.standard_normal((5, 4)), dtype=bt.float64)
    w = bt.tensor(rng.standard_normal((3, 4)), dtype=bt.float64)
    b = bt.tensor(rng.standard_normal(3), dtype=bt.float64, requires_grad=True)
    bt.linear_gelu(x, w, b).sum().backward()
    pre = _np(x) @ _np(w).T + _np(b)
    eps = 1e-6
    d = (_gelu_tanh(pre + eps) - _gelu_tanh(pre - eps)) / (2 * eps)
    np.testing.assert_allclose(b.grad.numpy(), d.sum(0), rtol=1e-6)


def test_linear_gelu_errors():
    with pytest.raises(ValueError, match=r"\[linear_gelu\]"):
        bt.linear_gelu(bt.zeros(2, 3), bt.zeros(4, 5))
    with pytest.raises(ValueError, match=r"\[linear_gelu\] bias"):
        bt.linear_gelu(bt.zeros(2, 3), bt.zeros(4, 3), bt.zeros(5))
    with pytest.raises(TypeError, match=r"\[linear_gelu\]"):
        bt.linear_gelu(bt.zeros(2, 3, dtype=bt.int64), bt.zeros(4, 3, dtype=bt.int64))


def test_linear_gelu_noncontiguous(rng):
    x = bt.tensor(rng.standard_normal((6, 8)), dtype=bt.float64)
    w = bt.tensor(rng.standard_normal((8, 5)), dtype=bt.float64).T  # (5, 8) transposed view
    xs = x[:, ::2]  # (6, 4) strided
    w2 = bt.tensor(rng.standard_normal((3, 4)), dtype=bt.float64)
    np.testing.assert_allclose(
        bt.linear_gelu(x, w).numpy(), _gelu_tanh(_np(x) @ _np(w).T), rtol=1e-10, atol=1e-13
    )
    np.testing.assert_allclose(
        bt.linear_gelu(xs, w2).numpy(), _gelu_tanh(_np(xs) @ _np(w2).T), rtol=1e-10, atol=1e-13
    )


def test_linear_activation_module(rng):
    m = nn.Linear(6, 4, activation="gelu_tanh")
    x = bt.tensor(rng.standard_normal((3, 6)), dtype=bt.float32)
    ref = _gelu_tanh(_np(x) @ _np(m.weight).T + _np(m.bias))
    np.testing.assert_allclose(_np(m(x)), ref, rtol=1e-5, atol=1e-6)
    assert "gelu_tanh" in repr(m)
    with pytest.raises(ValueError, match="activation"):
        nn.Linear(2, 2, activation="relu")


# ---- policies ------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16, activation="gelu_tanh")
        self.proj = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.proj(self.fc(self.ln(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_policy_presets():
    assert bt.amp.fp32() == bt.amp.Policy(bt.float32, bt.float32, None, "highest")
    assert bt.amp.tf32().matmul_precision == "high"
    assert bt.amp.bf16().compute == bt.bfloat16 and bt.amp.bf16().param == bt.float32


def test_bf16_policy_dtypes_and_fp32_grads():
    net = _Net()
    net.set_precision(bt.amp.bf16())
    idx = bt.tensor([[1, 2, 3], [4, 5, 10]])
    x = net.emb(idx)
    assert x.dtype == bt.bfloat16
    assert net.blocks[0].ln(x).dtype == bt.bfloat16
    logits = net(idx)
    assert logits.dtype == bt.bfloat16
    loss = bt.cross_entropy(logits.float().reshape(-1, 11), idx.reshape(-1))
    assert loss.dtype == bt.float32
    loss.backward()
    for n, p in net.named_parameters():
        assert p.dtype == bt.float32, n
        assert p.grad is not None and p.grad.dtype == bt.float32, n
        assert np.isfinite(_np(p.grad)).all(), n


def test_policy_override_and_output():
    net = _Net()
    net.set_precision(bt.amp.bf16())
    net.head.set_precision(bt.amp.Policy(compute=bt.bfloat16, output=bt.float32))
    net.blocks[1].set_precision(bt.amp.Policy(compute=bt.float32))
    assert net.blocks[1].fc.precision.compute == bt.float32
    assert net.blocks[0].fc.precision.compute == bt.bfloat16
    idx = bt.tensor([[1, 2, 3]])
    x = net.emb(idx)
    assert net.blocks[0](x).dtype == bt.bfloat16
    assert net.blocks[1](x).dtype == bt.float32
    assert net(idx).dtype == bt.float32  # head's output policy
    # clearing an override returns the child to the parent's policy
    net.blocks[1].set_precision(None)
    assert net.blocks[1].fc.precision.compute == bt.bfloat16
    # a module attached later inherits
    net.extra = nn.Linear(8, 8)
    assert net.extra.precision.compute == bt.bfloat16


def test_policy_param_dtype_conversion():
    lin = nn.Linear(4, 3)
    lin.set_precision(bt.amp.Policy(compute=bt.bfloat16, param=bt.float64))
    assert lin.weight.dtype == bt.float64 and lin.bias.dtype == bt.float64
    assert lin.weight.requires_grad
    y = lin(bt.ones(2, 4))
    assert y.dtype == bt.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == bt.float64


def test_tf32_policy_sets_matmul_precision():
    lin = nn.Linear(4, 3)
    lin.set_precision(bt.amp.tf32())
    assert bt.get_float32_matmul_precision() == "high"
    lin.set_precision(bt.amp.fp32())
    assert bt.get_float32_matmul_precision() == "highest"


def test_policy_type_error():
    with pytest.raises(TypeError, match="set_precision"):
        nn.Linear(2, 2).set_precision(bt.bfloat16)


def test_fp32_policy_matches_no_policy(rng):
    net = _Net()
    idx = bt.tensor(rng.integers(0, 11, (2, 5)))
    ref = _np(net(idx))
    net.set_precision(bt.amp.fp32())
    np.testing.assert_array_equal(_np(net(idx)), ref)


def test_autocast_context():
    lin = nn.Linear(4, 3)
    x = bt.ones(2, 4)
    with bt.autocast(bt.bfloat16):
        assert lin(x).dtype == bt.bfloat16
        lin.set_precision(bt.amp.Policy(compute=bt.float32))  # explicit policy wins
        assert lin(x).dtype == bt.float32
        lin.set_precision(None)
        with bt.autocast(enabled=False):
            assert lin(x).dtype == bt.float32
    assert lin(x).dtype == bt.float32
    assert bt.amp.current_autocast_dtype() is None


# ---- checkpoint --------------------------------------------------------------------------------
def _grads(ts):
    return [t.grad.numpy().copy() for t in ts]


def test_checkpoint_matches_plain_fp64(rng):
    lin1 = nn.Linear(5, 7, dtype=bt.float64)
    lin2 = nn.Linear(7, 5, dtype=bt.float64)

    def f(x, scale):
        return lin2(bt.gelu(lin1(x), "tanh")) * scale, lin1(x).sum(-1)

    x0 = rng.standard_normal((3, 5))
    results = []
    for use_ckpt in (False, True):
        x = bt.tensor(x0, dtype=bt.float64, requires_grad=True)
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        y, s = bt.checkpoint(f, x, 2.0) if use_ckpt else f(x, 2.0)
        ((y * y).sum() + s.sum()).backward()
        results.append((_np(y), _grads([x, *lin1.parameters(), *lin2.parameters()])))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_checkpoint_replays_dropout(rng):
    lin = nn.Linear(16, 16, dtype=bt.float64)

    def f(x):
        return bt.dropout(lin(x), 0.5, True)

    x0 = rng.standard_normal((8, 16))
    outs = []
    for use_ckpt in (False, True):
        bt.manual_seed(1234)
        x = bt.tensor(x0, dtype=bt.float64, requires_grad=True)
        lin.weight.grad = lin.bias.grad = None
        y = bt.checkpoint(f, x) if use_ckpt else f(x)
        after = bt._tensor._get_rng_state()
        (y * y).sum().backward()
        assert bt._tensor._get_rng_state() == after  # recompute leaves the generator alone
        outs.append((_np(y), _grads([x, lin.weight, lin.bias])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_checkpoint_inputs_without_grad_still_train_params(rng):
    lin = nn.Linear(4, 2, dtype=bt.float64)
    x = bt.tensor(rng.standard_normal((3, 4)), dtype=bt.float64)  # no grad
    bt.checkpoint(lin, x).sum().backward()
    np.testing.assert_allclose(lin.weight.grad.numpy(), np.tile(_np(x).sum(0), (2, 1)))
    np.testing.assert_allclose(lin.bias.grad.numpy(), [3.0, 3.0])


def test_checkpoint_no_grad_and_kwargs():
    with bt.no_grad():
        y = bt.checkpoint(lambda a, k=1.0: a * k, bt.ones(2), k=3.0)
    assert y.tolist() == [3.0, 3.0]
    x = bt.ones(2, requires_grad=True)
    bt.checkpoint(lambda a, k=1.0: a * k, x, k=3.0).sum().backward()
    assert x.grad.tolist() == [3.0, 3.0]


def test_module_set_checkpoint_matches(rng):
    bt.manual_seed(0)
    net = _Net()
    idx = bt.tensor(rng.integers(0, 11, (2, 6)))
    grads = []
    for ck in (False, True):
        for b in net.blocks:
            b.set_checkpoint(ck)
        net.zero_grad()
        net(idx).float().sum().backward()
        grads.append({n: _np(p.grad) for n, p in net.named_parameters()})
    for n in grads[0]:
        np.testing.assert_allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6, err_msg=n)


# ---- linear_gelu_linear (fused GELU MLP) ------------------------------------------------------
@pytest.mark.parametrize("b1,b2", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6), (1, 6)])
def test_linear_gelu_linear_matches_composed_fp64(rng, b1, b2, shape):
    K, N1, N2 = shape[-1], 9, 4

    def t(*s):
        return bt.tensor(rng.standard_normal(s), dtype=bt.float64, requires_grad=True)

    x, w1, w2 = t(*shape), t(N1, K), t(N2, N1)
    bias1, bias2 = (t(N1) if b1 else None), (t(N2) if b2 else None)
    leaves = [v for v in (x, w1, bias1, w2, bias2) if v is not None]
    g = bt.tensor(rng.standard_normal((*shape[:-1], N2)), dtype=bt.float64)
    y = bt.linear_gelu_linear(x, w1, bias1, w2, bias2)
    assert y.shape == (*shape[:-1], N2)
    y.backward(g)
    got = [v.grad.numpy().copy() for v in leaves]
    for v in leaves:
        v.grad = None
    y2 = bt.linear(bt.gelu(bt.linear(x, w1, bias1), "tanh"), w2, bias2)
    y2.backward(g)
    np.testing.assert_allclose(_np(y), _np(y2), rtol=1e-10, atol=1e-13)
    for a, v in zip(got, leaves, strict=True):
        np.testing.assert_allclose(a, v.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_linear_gelu_linear_gradcheck(rng):
    def t(*s):
        return bt.tensor(rng.standard_normal(s), dtype=bt.float64, requires_grad=True)

    assert bt.gradcheck(bt.linear_gelu_linear, [t(3, 4), t(5, 4), t(5), t(2, 5), t(2)])


@pytest.mark.parametrize("dtype,tol", [(bt.float32, 1e-5), (bt.bfloat16, 3e-2)])
def test_linear_gelu_linear_low_precision(rng, dtype, tol):
    vals = [
        rng.standard_normal((17, 32)),
        rng.standard_normal((48, 32)) * 0.2,
        rng.standard_normal(48),
        rng.standard_normal((8, 48)) * 0.2,
        rng.standard_normal(8),
    ]
    ts = [bt.tensor(v, dtype=dtype, requires_grad=True) for v in vals]
    rs = [bt.tensor(_np(t), dtype=bt.float64, requires_grad=True) for t in ts]
    g = bt.tensor(rng.standard_normal((17, 8)), dtype=dtype)
    y = bt.linear_gelu_linear(*ts)
    y.backward(g)
    yr = bt.linear(bt.gelu(bt.linear(rs[0], rs[1], rs[2]), "tanh"), rs[3], rs[4])
    yr.backward(g.to(bt.float64))
    assert y.dtype == dtype
    assert np.abs(_np(y) - _np(yr)).max() <= tol * np.abs(_np(yr)).max()
    for t, r in zip(ts, rs, strict=True):
        assert t.grad.dtype == dtype
        assert np.abs(_np(t.grad) - _np(r.grad)).max() <= 2 * tol * np.abs(_np(r.grad)).max()


def test_linear_gelu_linear_errors():
    with pytest.raises(ValueError, match=r"\[linear_gelu_linear\] w2"):
        bt.linear_gelu_linear(bt.zeros(2, 3), bt.zeros(4, 3), None, bt.zeros(5, 3))
    with pytest.raises(ValueError, match=r"\[linear_gelu_linear\] b2"):
        bt.linear_gelu_linear(bt.zeros(2, 3), bt.zeros(4, 3), None, bt.zeros(5, 4), bt.zeros(4))


def test_nn_gelu_mlp_with_policy(rng):
    fc, proj = nn.Linear(6, 12), nn.Linear(12, 6)
    x = bt.tensor(rng.standard_normal((3, 6)), dtype=bt.float32)
    ref = proj(bt.gelu(fc(x), "tanh"))
    np.testing.assert_allclose(_np(nn.gelu_mlp(fc, proj, x)), _np(ref), rtol=1e-5, atol=1e-6)
    fc.set_precision(bt.amp.bf16())
    proj.set_precision(bt.amp.Policy(compute=bt.bfloat16, output=bt.float32))
    y = nn.gelu_mlp(fc, proj, x)
    assert y.dtype == bt.float32
    y.sum().backward()
    assert fc.weight.grad.dtype == bt.float32 and proj.bias.grad.dtype == bt.float32
    np.testing.assert_allclose(_np(y), _np(ref), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("flash_cpu", [False, True])
def test_nn_self_attention_with_policy(rng, flash_cpu):
    # nn.self_attention = the split-and-sdpa composition, with c_attn's policy (its fused node
    # where the CPU's flash kernels are on)
    old = bt._tensor._flash_attention_cpu()
    bt._tensor._set_flash_attention_cpu(flash_cpu)
    try:
        c_attn = nn.Linear(8, 24)
        x = bt.tensor(rng.standard_normal((2, 5, 8)), dtype=bt.float32)
        q, k, v = (t.view(2, 5, 2, 4).transpose(1, 2) for t in c_attn(x).split(8, 2))
        ref = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = ref.transpose(1, 2).contiguous().view(2, 5, 8)
        y = nn.self_attention(c_attn, x, 2, is_causal=True)
        np.testing.assert_allclose(_np(y), _np(ref), rtol=1e-5, atol=1e-6)
        c_attn.set_precision(bt.amp.Policy(compute=bt.bfloat16, output=bt.float32))
        y = nn.self_attention(c_attn, x, 2, is_causal=True)
        assert y.dtype == bt.float32
        y.sum().backward()
        assert c_attn.weight.grad.dtype == bt.float32 and c_attn.bias.grad.dtype == bt.float32
        np.testing.assert_allclose(_np(y), _np(ref), rtol=5e-2, atol=5e-2)
    finally:
        bt._tensor._set_flash_attention_cpu(old)


# ---- linear_gelu_linear: recompute option, implementation switch ------------------------------
@pytest.fixture
def lgl_impl():
    prev = bt._tensor._get_linear_gelu_linear_impl()
    yield bt._tensor._set_linear_gelu_linear_impl
    bt._tensor._set_linear_gelu_linear_impl(prev)


def _lgl_leaves(rng, dtype, M, K, N1, N2, b1=True, b2=True):
    vals = [
        rng.standard_normal((M, K)),
        rng.standard_normal((N1, K)) / np.sqrt(K),
        rng.standard_normal(N1) if b1 else None,
        rng.standard_normal((N2, N1)) / np.sqrt(N1),
        rng.standard_normal(N2) if b2 else None,
    ]
    return vals, rng.standard_normal((M, N2))


def _lgl_run(vals, g, dtype, recompute):
    ts = [None if v is None else bt.tensor(v, dtype=dtype, requires_grad=True) for v in vals]
    y = bt.linear_gelu_linear(*ts, recompute=recompute)
    y.backward(bt.tensor(g, dtype=dtype))
    return _np(y), [None if t is None else _np(t.grad) for t in ts]


@pytest.mark.parametrize("impl", ["kernel", "cublaslt"])
@pytest.mark.parametrize("dtype", [bt.float64, bt.float32], ids=str)
@pytest.mark.parametrize("b1,b2", [(True, True), (False, False), (True, False)])
def test_lgl_recompute_bitwise(rng, lgl_impl, impl, dtype, b1, b2):
    # kernel: both forwards run GEMM + the GeluTanh kernel, so every bit matches; cublaslt: the
    # recompute forward still does (h must be what the backward rebuilds), the other uses the
    # GELU_AUX epilogue: equal to rounding only.
    lgl_impl(impl)
    vals, g = _lgl_leaves(rng, dtype, 13, 8, 24, 5, b1, b2)
    y0, g0 = _lgl_run(vals, g, dtype, False)
    y1, g1 = _lgl_run(vals, g, dtype, True)
    if impl == "kernel":
        np.testing.assert_array_equal(y0, y1)
        for a, b in zip(g0, g1, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a, b)
    else:
        tol = 1e-12 if dtype == bt.float64 else 1e-5
        np.testing.assert_allclose(y0, y1, rtol=tol, atol=tol)
        for a, b in zip(g0, g1, strict=True):
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(bt.float32, 1e-5), (bt.bfloat16, 3e-2)])
@pytest.mark.parametrize("recompute", [False, True])
def test_lgl_recompute_vs_fp64(rng, dtype, tol, recompute):
    vals, g = _lgl_leaves(rng, dtype, 17, 32, 48, 8)
    # the reference from the same (dtype-rounded) values
    vals = [None if v is None else _np(bt.tensor(v, dtype=dtype)) for v in vals]
    g = _np(bt.tensor(g, dtype=dtype))
    y, grads = _lgl_run(vals, g, dtype, recompute)
    rs = [bt.tensor(v, dtype=bt.float64, requires_grad=True) for v in vals]
    yr = bt.linear(bt.gelu(bt.linear(rs[0], rs[1], rs[2]), "tanh"), rs[3], rs[4])
    yr.backward(bt.tensor(g, dtype=bt.float64))
    assert np.abs(y - _np(yr)).max() <= tol * np.abs(_np(yr)).max()
    for got, r in zip(grads, rs, strict=True):
        ref = _np(r.grad)
        assert np.abs(got - ref).max() <= 2 * tol * np.abs(ref).max()


def test_lgl_recompute_3d_and_partial_grads(rng):
    x = bt.tensor(rng.standard_normal((2, 5, 6)), dtype=bt.float64)
    w1 = bt.tensor(rng.standard_normal((10, 6)), dtype=bt.float64, requires_grad=True)
    w2 = bt.tensor(rng.standard_normal((3, 10)), dtype=bt.float64, requires_grad=True)
    b2 = bt.tensor(rng.standard_normal(3), dtype=bt.float64, requires_grad=True)
    y = bt.linear_gelu_linear(x, w1, None, w2, b2, recompute=True)
    assert y.shape == (2, 5, 3)
    y.sum().backward()
    w1r, w2r, b2r = (bt.tensor(_np(t), dtype=bt.float64, requires_grad=True) for t in (w1, w2, b2))
    yr = bt.linear(bt.gelu(bt.linear(x, w1r), "tanh"), w2r, b2r)
    yr.sum().backward()
    np.testing.assert_allclose(_np(y), _np(yr), rtol=1e-10, atol=1e-12)
    for a, b in ((w1, w1r), (w2, w2r), (b2, b2r)):
        np.testing.assert_allclose(_np(a.grad), _np(b.grad), rtol=1e-10, atol=1e-12)
    # only w2 needs a gradient: the h recompute runs, the dgelu GEMM does not
    w2.grad = None
    w1.requires_grad_(False)
    b2.requires_grad_(False)
    bt.linear_gelu_linear(x, w1, None, w2, b2, recompute=True).sum().backward()
    np.testing.assert_allclose(_np(w2.grad), _np(w2r.grad), rtol=1e-10, atol=1e-12)


def test_lgl_recompute_gradcheck(rng):
    def t(*s):
        return bt.tensor(rng.standard_normal(s), dtype=bt.float64, requires_grad=True)

    def f(x, w1, b1, w2, b2):
        return bt.linear_gelu_linear(x, w1, b1, w2, b2, recompute=True)

    assert bt.gradcheck(f, [t(3, 4), t(5, 4), t(5), t(2, 5), t(2)])


def test_lgl_impl_setting(lgl_impl):
    import os
    import subprocess
    import sys

    for name in ("kernel", "cublaslt", "kernel_v1"):
        lgl_impl(name)
        assert bt._tensor._get_linear_gelu_linear_impl() == name
    with pytest.raises(ValueError, match="linear_gelu_linear"):
        lgl_impl("fast")
    code = "import blutrain.tensor as bt; print(bt._tensor._get_linear_gelu_linear_impl())"
    for env, want in (("cublaslt", "cublaslt"), ("kernel", "kernel"), ("", "kernel")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "BLUTRAIN_LGL_EPILOGUE": env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == want
    bad = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "BLUTRAIN_LGL_EPILOGUE": "nope"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "BLUTRAIN_LGL_EPILOGUE" in bad.stderr


@pytest.mark.parametrize("impl", ["kernel", "cublaslt"])
def test_linear_gelu_fp32_forward_impls(rng, lgl_impl, impl):
    # float32 linear_gelu forward: GEMM + GeluTanh kernel (kernel) or the GELU_AUX epilogue
    lgl_impl(impl)
    x = rng.standard_normal((9, 16))
    w = rng.standard_normal((12, 16)) / 4
    b = rng.standard_normal(12)
    y = bt.linear_gelu(*(bt.tensor(v, dtype=bt.float32) for v in (x, w, b)))
    ref = _gelu_tanh(
        _np(bt.tensor(x, dtype=bt.float32)) @ _np(bt.tensor(w, dtype=bt.float32)).T
        + _np(bt.tensor(b, dtype=bt.float32))
    )
    np.testing.assert_allclose(_np(y), ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    "make,exc,pattern",
    [
        (
            lambda: bt.amp.Policy(compute=bt.int64),
            TypeError,
            r"^\[Policy\.compute\] expected a floating",
        ),
        (
            lambda: bt.amp.Policy(output="bool"),
            TypeError,
            r"^\[Policy\.output\] expected a floating",
        ),
        (
            lambda: bt.amp.Policy(param="float7"),
            TypeError,
            r"^\[Policy.param\] expected a floating dtype, got 'float7'",
        ),
        (
            lambda: bt.amp.Policy(matmul_precision="fast"),
            ValueError,
            r"^\[Policy\] matmul_precision",
        ),
        (
            lambda: bt.autocast(bt.int32).__enter__(),
            TypeError,
            r"^\[autocast\] expected a floating",
        ),
        (lambda: bt.dropout(bt.ones(2), float("nan")), ValueError, r"^\[dropout\] p must be in"),
    ],
)
def test_policy_and_autocast_argument_errors(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


def test_policy_takes_dtype_names():
    p = bt.amp.Policy(compute="bfloat16", param="float32")
    assert p.compute == bt.bfloat16 and p.param == bt.float32
    assert p.cast(bt.ones(2)).dtype == bt.bfloat16
