"""Fused (flash) attention on the CPU: the primitive's reference kernel against float64 numpy and
against the composed scaled_dot_product_attention, gradients against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import TOL, f64, needs_linalg

import blutrain.tensor as bt
from blutrain.tensor import _tensor

flash = _tensor.flash_attention


def ref_attention(q, k, v, causal, scale):
    """float64 numpy: returns out (B, H, L, D) and lse (B, H, L)."""
    s = np.einsum("bhld,bhsd->bhls", q, k) * scale
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    return np.einsum("bhls,bhsd->bhld", p / l_, v), (m + np.log(l_))[..., 0]


def split_qkv(rng, B, T, H, D, dtype, requires_grad=False):
    """q, k, v as GPT-2 makes them: (B, T, 3C) split and transposed to (B, H, T, D) views."""
    x = bt.tensor(rng.standard_normal((B, T, 3 * H * D)), dtype=dtype)
    if requires_grad:
        x.requires_grad_(True)
    q, k, v = x.split(H * D, dim=2)
    return x, [t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 5, 17])
def test_forward_matches_numpy(rng, dtype, causal, T):
    B, H, D = 2, 3, 8
    _, (q, k, v) = split_qkv(rng, B, T, H, D, dtype)
    assert not q.is_contiguous()
    out, lse = flash(q, k, v, is_causal=causal)
    assert out.shape == (B, H, T, D) and lse.shape == (B, H, T)
    assert lse.dtype == (bt.float64 if dtype == bt.float64 else bt.float32)
    ro, rl = ref_attention(f64(q), f64(k), f64(v), causal, 1 / np.sqrt(D))
    np.testing.assert_allclose(f64(out), ro, **TOL[dtype])
    np.testing.assert_allclose(f64(lse), rl, **TOL[dtype])
    # the (B, L, H, D) layout: transpose back is contiguous and views as (B, L, H * D) for free
    y = out.transpose(1, 2)
    assert y.is_contiguous()
    y.view(B, T, H * D)


def test_cross_attention_and_scale(rng):
    q = bt.tensor(rng.standard_normal((1, 2, 3, 4)))
    k = bt.tensor(rng.standard_normal((1, 2, 6, 4)))
    v = bt.tensor(rng.standard_normal((1, 2, 6, 4)))
    out, lse = flash(q, k, v, scale=0.3)
    ro, rl = ref_attention(q.numpy(), k.numpy(), v.numpy(), False, 0.3)
    np.testing.assert_allclose(out.numpy(), ro, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), rl, rtol=1e-12, atol=1e-12)


def test_unsupported_inputs_raise():
    q = bt.zeros((1, 2, 3, 4))
    k = bt.zeros((1, 2, 5, 4))
    with pytest.raises(ValueError, match=r"\[flash_attention\]"):
        flash(q, k, k, is_causal=True)  # causal needs L == S
    with pytest.raises(ValueError, match=r"\[flash_attention\]"):
        flash(bt.zeros((2, 3, 4)), bt.zeros((2, 3, 4)), bt.zeros((2, 3, 4)))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_fused_matches_composed(rng, causal):
    needs_linalg()
    _, (q, k, v) = split_qkv(rng, 2, 9, 2, 8, bt.float64, requires_grad=True)
    g = bt.tensor(rng.standard_normal((2, 2, 9, 8)))
    outs, grads = [], []
    old = _tensor._flash_attention_cpu()
    try:
        for fused in (False, True):
            _tensor._set_flash_attention_cpu(fused)
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            y = bt.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            y.backward(g)
            outs.append(y.detach().numpy())
            grads.append([t.grad.numpy() for t in (qq, kk, vv)])
    finally:
        _tensor._set_flash_attention_cpu(old)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(rng, causal):
    def leaf(shape):
        return bt.tensor(rng.uniform(-1, 1, size=shape), dtype=bt.float64, requires_grad=True)

    L, S = (4, 4) if causal else (3, 5)
    xs = [leaf((2, 2, L, 4)), leaf((2, 2, S, 4)), leaf((2, 2, S, 4))]
    # both outputs: out, and lse (its cotangent flows through the backward's dlse input)
    assert bt.gradcheck(
        lambda q, k, v: flash(q, k, v, is_causal=causal), xs, eps=1e-6, atol=1e-6, rtol=1e-5
    )
    assert bt.gradcheck(
        lambda q, k, v: flash(q, k, v, is_causal=causal)[0], xs, eps=1e-6, atol=1e-6, rtol=1e-5
    )


def test_gradients_through_qkv_split(rng):
    """Gradients reach the (B, T, 3C) tensor the views came from (GPT-2's path)."""
    B, T, H, D = 2, 6, 2, 4
    x, (q, k, v) = split_qkv(rng, B, T, H, D, bt.float64, requires_grad=True)
    out, _ = flash(q, k, v, is_causal=True)
    y = out.transpose(1, 2).contiguous().view(B, T, H * D)
    g = rng.standard_normal((B, T, H * D))
    y.backward(bt.tensor(g))
    # numpy: d/dx of sum(y * g) via the composed float64 reference and finite differences of one
    # entry per third (q, k, v)
    xn = x.detach().numpy()

    def loss(xv):
        qn, kn, vn = (
            xv[..., i * H * D : (i + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)
            for i in range(3)
        )
        o, _ = ref_attention(qn, kn, vn, True, 1 / np.sqrt(D))
        return float((o.transpose(0, 2, 1, 3).reshape(B, T, H * D) * g).sum())

    for idx in [(0, 3, 1), (1, 5, H * D + 2), (0, 0, 2 * H * D + 3), (1, 2, 2 * H * D + 7)]:
        e = np.zeros_like(xn)
        e[idx] = 1e-6
        fd = (loss(xn + e) - loss(xn - e)) / 2e-6
        np.testing.assert_allclose(x.grad.numpy()[idx], fd, rtol=1e-5, atol=1e-7)
