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


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_non_positive_scale_raises(scale):
    # the kernels take the row max of S before scaling: only a positive finite scale is valid
    q = bt.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"\[flash_attention\] scale must be a positive"):
        flash(q, q, q, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_negative_scale_composes(rng, causal):
    # scaled_dot_product_attention takes the composed path for such a scale, fused kernels on
    needs_linalg()
    _, (q, k, v) = split_qkv(rng, 2, 7, 2, 8, bt.float64)
    old = _tensor._flash_attention_cpu()
    try:
        _tensor._set_flash_attention_cpu(True)
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=-0.4)
    finally:
        _tensor._set_flash_attention_cpu(old)
    ro, _ = ref_attention(f64(q), f64(k), f64(v), causal, -0.4)
    np.testing.assert_allclose(f64(y), ro, rtol=1e-12, atol=1e-12)


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


def test_unused_lse_gets_no_zero_fill_but_hooks_see_zeros(rng):
    """No gradient reaches lse: the backward runs without a dlse (no zero-filled buffer); a hook
    on lse still sees zeros of its shape, and the gradients are the same both ways."""
    qn, kn, vn, gn = (rng.standard_normal((2, 3, 6, 4)) for _ in range(4))
    grads, seen = [], []
    for hook in (False, True):
        q, k, v = (bt.tensor(a, requires_grad=True) for a in (qn, kn, vn))
        out, lse = flash(q, k, v, is_causal=True)
        if hook:
            lse.register_hook(lambda g: seen.append(g.numpy().copy()))
        out.backward(bt.tensor(gn))
        grads.append([t.grad.numpy() for t in (q, k, v)])
    assert len(seen) == 1 and seen[0].shape == (2, 3, 6) and not seen[0].any()
    for a, b in zip(*grads, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_leaf_gradients_in_leaf_layout(rng, causal):
    """Contiguous (B, H, T, D) leaves get contiguous gradients of their layout (the backward
    writes them heads-major); the same values through transposed (B, T, H, D) views agree."""
    B, H, T, D = 2, 3, 5, 4
    qn, kn, vn = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    g = bt.tensor(rng.standard_normal((B, H, T, D)))
    leaves = [bt.tensor(a, requires_grad=True) for a in (qn, kn, vn)]
    flash(*leaves, is_causal=causal)[0].backward(g)
    rows = [bt.tensor(a.transpose(0, 2, 1, 3).copy(), requires_grad=True) for a in (qn, kn, vn)]
    flash(*(t.transpose(1, 2) for t in rows), is_causal=causal)[0].backward(g)
    for a, b in zip(leaves, rows, strict=True):
        assert a.grad.is_contiguous() and tuple(a.grad.shape) == (B, H, T, D)
        np.testing.assert_allclose(
            a.grad.numpy(), b.grad.numpy().transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-12
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


# ---- packed qkv: one op on the (B, T, 3C) tensor, one gradient for it ---------------------------
packed_source = _tensor._packed_qkv_source


def _qkv_views(x, B, T, H, D):
    return [t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2)]


def _sdpa_grad(x_np, B, T, H, D, dtype, causal, fused, pack, extra=False, g_dtype=None):
    """X.grad of sum(sdpa(q, k, v) * g) (+ sum(X * X) when extra) for q, k, v split from X;
    pack=False breaks the packing (q, k, v taken from a clone per slice); g_dtype rounds g
    through that dtype first (a reference seeing a low-precision run's inputs)."""
    old = _tensor._flash_attention_cpu()
    try:
        _tensor._set_flash_attention_cpu(fused)
        x = bt.tensor(x_np, dtype=dtype, requires_grad=True)
        h = x * 1.0  # a non-leaf X, as a linear output
        q, k, v = _qkv_views(h, B, T, H, D)
        if not pack:
            q = q * 1.0
        assert (packed_source(q, k, v) is not None) == pack
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=causal)
        g = np.random.default_rng(7).standard_normal((B, H, T, D))
        if g_dtype is not None:
            g = f64(bt.tensor(g, dtype=g_dtype))
        loss = (y * bt.tensor(g, dtype=dtype)).sum()
        if extra:
            loss = loss + (h * h).sum()
        loss.backward()
        return f64(y), f64(x.grad)
    finally:
        _tensor._set_flash_attention_cpu(old)


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 7, 13])
def test_packed_sdpa_gradients_match(rng, dtype, causal, T):
    """Packed vs unpacked (bitwise: same kernel, same arithmetic) vs the composed float64 path,
    which sees the same (rounded) inputs, so only the run's own arithmetic is measured."""
    needs_linalg()
    B, H, D = 2, 3, 8
    xn = rng.standard_normal((B, T, 3 * H * D))
    xr = f64(bt.tensor(xn, dtype=dtype))
    rtol, atol = TOL[dtype]["rtol"], TOL[dtype]["atol"]
    for extra in (False, True):
        yp, gp = _sdpa_grad(xn, B, T, H, D, dtype, causal, True, True, extra)
        yu, gu = _sdpa_grad(xn, B, T, H, D, dtype, causal, True, False, extra)
        np.testing.assert_array_equal(yp, yu)
        np.testing.assert_array_equal(gp, gu)
        yr, gr = _sdpa_grad(xr, B, T, H, D, bt.float64, causal, False, True, extra, dtype)
        np.testing.assert_allclose(yp, yr, rtol=rtol, atol=atol)
        # Rounding is relative to the terms a gradient element sums, which may cancel: the
        # attention part's D_i = do_i . o_i uses the stored (rounded) o, and with extra the
        # 2X term joins in `dtype` (a bf16 2.0 - 1.97 is off by ulp(2) / 2).  So the absolute
        # tolerance scales with the gradient's largest element, the relative one with the terms.
        terms = np.abs(gr) + (2 * np.abs(xr) if extra else 0)
        err = np.abs(gp - gr)
        bad = err > atol * max(1.0, np.abs(gr).max()) + rtol * terms
        assert not bad.any(), (
            f"{bad.sum()} of {bad.size} X.grad elements off: worst {err.max():.3g} "
            f"(got {gp[bad][:3]}, want {gr[bad][:3]}, terms {terms[bad][:3]})"
        )


def test_packed_source_detection(rng):
    B, T, H, D = 2, 5, 2, 4
    C = H * D
    x = bt.tensor(rng.standard_normal((B, T, 3 * C)), requires_grad=True)
    q, k, v = _qkv_views(x, B, T, H, D)
    src = packed_source(q, k, v)
    assert src is not None and src.shape == (B, T, 3 * C) and src.requires_grad
    np.testing.assert_array_equal(src.detach().numpy(), x.detach().numpy())
    assert packed_source(k, q, v) is None  # wrong order
    assert packed_source(q, q, v) is None
    # no grad wanted: nothing to pack (the forward is the same kernel anyway)
    with bt.no_grad():
        assert packed_source(*_qkv_views(x, B, T, H, D)) is None
    xd = x.detach()
    assert packed_source(*_qkv_views(xd, B, T, H, D)) is None
    # a (B*T, 3C) linear output reshaped to (B, T, 3C): the base is the 2-D tensor
    w = bt.tensor(rng.standard_normal((B * T, 3 * C)), requires_grad=True)
    h = (w * 2.0).view(B, T, 3 * C)
    assert packed_source(*_qkv_views(h, B, T, H, D)) is not None
    # indexing a (B, T, 3, H, D) view also packs (select views)
    h5 = h.view(B, T, 3, H, D)
    q2, k2, v2 = (h5[:, :, i].transpose(1, 2) for i in range(3))
    assert packed_source(q2, k2, v2) is not None
    # rows of 3C inside wider rows (a row stride): packs
    r = bt.tensor(rng.standard_normal((B, T, 4 * C)), requires_grad=True)
    rr = r * 1.0
    assert packed_source(*_qkv_views(rr[:, :, : 3 * C], B, T, H, D)) is not None
    assert packed_source(*_qkv_views(rr[:, :, C:], B, T, H, D)) is not None
    assert packed_source(*_qkv_views(rr[:, :, 1 : 3 * C + 1], B, T, H, D)) is not None
    # a hook or retain_grad on a view: its gradient must flow through it, so no packing
    q, k, v = _qkv_views(x, B, T, H, D)
    q.register_hook(lambda g: g)
    assert packed_source(q, k, v) is None
    q, k, v = _qkv_views(x, B, T, H, D)
    k.retain_grad()
    assert packed_source(q, k, v) is None
    parts = x.split(C, dim=2)
    parts[2].register_hook(lambda g: g)
    assert packed_source(*[t.view(B, T, H, D).transpose(1, 2) for t in parts]) is None
    # a non-contiguous X (its last dim strided): falls back
    xt = bt.tensor(rng.standard_normal((B, 3 * C, T)), requires_grad=True).transpose(1, 2)
    qt, kt, vt = (t.reshape(B, T, H, D).transpose(1, 2) for t in xt.split(C, dim=2))
    assert packed_source(qt, kt, vt) is None


def test_a_removed_hook_gives_the_packed_path_back(rng):
    # a hook on q turns packing off; removing it erases it in the C++ core, so packing is back
    B, T, H, D = 2, 5, 2, 4
    x = bt.tensor(rng.standard_normal((B, T, 3 * H * D)), requires_grad=True)
    q, k, v = _qkv_views(x, B, T, H, D)
    h = q.register_hook(lambda g: g)
    assert packed_source(q, k, v) is None
    h.remove()
    assert packed_source(q, k, v) is not None


def test_packed_row_stride_and_fallback_gradients(rng):
    """q, k, v from wider rows (packed, row stride 4C) and from a non-contiguous X (unpacked):
    X's gradient matches the composed float64 path either way."""
    needs_linalg()
    B, T, H, D = 2, 6, 2, 4
    C = H * D
    rn = rng.standard_normal((B, T, 4 * C))
    g = rng.standard_normal((B, H, T, D))

    def run(fused, make):
        old = _tensor._flash_attention_cpu()
        try:
            _tensor._set_flash_attention_cpu(fused)
            r = bt.tensor(rn, requires_grad=True)
            q, k, v = make(r * 1.0)
            y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
            (y * bt.tensor(g)).sum().backward()
            return r.grad.numpy()
        finally:
            _tensor._set_flash_attention_cpu(old)

    def wide(h):
        return _qkv_views(h[:, :, : 3 * C], B, T, H, D)

    def strided(h):  # X = h[..., :3C] transposed twice through a copy-free but non-unit layout
        ht = h.transpose(0, 1)  # (T, B, 4C)
        return [t.transpose(0, 1).view(B, T, H, D).transpose(1, 2) for t in ht.split(C, 2)[:3]]

    def wide_offset(h):  # rows start one element into the wider rows
        return _qkv_views(h[:, :, 1 : 3 * C + 1], B, T, H, D)

    for make in (wide, wide_offset, strided):
        np.testing.assert_allclose(run(True, make), run(False, make), rtol=1e-10, atol=1e-12)
    ref = run(False, wide)
    assert np.all(ref[:, :, 3 * C :] == 0)


def test_packed_inplace_after_use_raises(rng):
    """Changing X in place after the fused attention saved it raises at backward, packed or not."""
    B, T, H, D = 1, 4, 2, 4
    old = _tensor._flash_attention_cpu()
    try:
        _tensor._set_flash_attention_cpu(True)
        for pack in (True, False):
            x = bt.tensor(rng.standard_normal((B, T, 3 * H * D)), requires_grad=True)
            h = x * 1.0
            q, k, v = _qkv_views(h, B, T, H, D)
            if not pack:
                q = q * 1.0
            assert (packed_source(q, k, v) is not None) == pack
            y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
            with bt.no_grad():
                h.add_(1.0)
            with pytest.raises(RuntimeError, match="modified by an in-place"):
                y.sum().backward()
    finally:
        _tensor._set_flash_attention_cpu(old)


def test_packed_inplace_before_use_follows_new_value(rng):
    """An in-place change of X under autograd before the attention: the gradient still matches
    the composed path (packing follows X's new history or falls back)."""
    needs_linalg()
    B, T, H, D = 1, 5, 2, 4
    xn = rng.standard_normal((B, T, 3 * H * D))
    grads = []
    old = _tensor._flash_attention_cpu()
    try:
        for fused in (True, False):
            _tensor._set_flash_attention_cpu(fused)
            x = bt.tensor(xn, requires_grad=True)
            w = bt.tensor(xn * 0.5, requires_grad=True)
            h = x * 1.0
            q, k, v = _qkv_views(h, B, T, H, D)
            h.mul_(w)  # q, k, v now read h * w
            y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
            (y * y).sum().backward()
            grads.append((x.grad.numpy(), w.grad.numpy()))
    finally:
        _tensor._set_flash_attention_cpu(old)
    for a, b in zip(grads[0], grads[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_packed_direct(rng, causal):
    """The packed op itself (row stride 4C): forward vs numpy, gradcheck in float64."""
    B, T, H, D = 2, 5, 2, 3
    C = H * D
    r = bt.tensor(rng.standard_normal((B, T, 4 * C)))
    x = r[:, :, C:]
    out, lse = _tensor.flash_attention_packed(x, H, is_causal=causal)
    xn = x.numpy()
    q, k, v = (
        xn[..., i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3)
    )
    ro, rl = ref_attention(q, k, v, causal, 1 / np.sqrt(D))
    np.testing.assert_allclose(out.numpy(), ro, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), rl, rtol=1e-12, atol=1e-12)
    xl = bt.tensor(rng.uniform(-1, 1, size=(1, 4, 3 * C)), dtype=bt.float64, requires_grad=True)
    assert bt.gradcheck(
        lambda t: _tensor.flash_attention_packed(t, H, is_causal=causal),
        [xl],
        eps=1e-6,
        atol=1e-6,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match=r"\[flash_attention_packed\]"):
        _tensor.flash_attention_packed(bt.zeros((2, 3, 10)), 2)


def test_packed_sdpa_capture_records(rng):
    """Under capture (symbolic tensors, no storage) sdpa records the unpacked op (no packing)."""
    B, T, H, D = 1, 4, 2, 4
    old = _tensor._flash_attention_cpu()
    try:
        _tensor._set_flash_attention_cpu(True)
        x = bt.tensor(rng.standard_normal((B, T, 3 * H * D)), requires_grad=True)
        with bt.capture() as g:
            h = x * 1.0
            y = bt.scaled_dot_product_attention(*_qkv_views(h, B, T, H, D), is_causal=True)
            y.sum().backward()
        ops = [n["op"] for n in g.nodes]
        assert "flash_attention" in ops and "flash_attention_backward" in ops
    finally:
        _tensor._set_flash_attention_cpu(old)


# ---- qkv_attention: the qkv projection and attention as one node -----------------------------
def _node_names(t):
    """Names of every autograd node t depends on."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        names.add(n.name())
        todo.extend(nf for nf, _ in n.next_functions)
    return names


def _qkv_composed(x, w, b, H, causal):
    """What qkv_attention computes, spelled as GPT-2 did: linear, split views, sdpa."""
    B, T, _ = x.shape
    C = w.shape[0] // 3
    qkv = bt.linear(x, w, b)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, 2))
    y = bt.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return y.transpose(1, 2).contiguous().view(B, T, C)


class _flash_cpu:
    """The CPU's fused attention kernels on (or off) inside the block."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.old = _tensor._flash_attention_cpu()
        _tensor._set_flash_attention_cpu(self.on)

    def __exit__(self, *exc):
        _tensor._set_flash_attention_cpu(self.old)


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T", [1, 7])
def test_qkv_attention_matches_composition(rng, dtype, causal, bias, T):
    """The fused node (flash CPU kernels on) against linear + split + sdpa with the same kernels:
    the same outputs and gradients, the bias's from the packed backward's column sums."""
    needs_linalg()
    B, H, D, C = 2, 2, 4, 8
    arrays = [
        rng.standard_normal((B, T, C)),
        rng.standard_normal((3 * H * D, C)) * 0.3,
        rng.standard_normal(3 * H * D),
    ]
    g = bt.tensor(rng.standard_normal((B, T, H * D)), dtype=dtype)
    res = []
    with _flash_cpu(True):
        for fn in (bt.qkv_attention, _qkv_composed):
            x, w, b = (bt.tensor(a, dtype=dtype, requires_grad=True) for a in arrays)
            y = fn(x, w, b if bias else None, H, causal)
            assert ("QkvAttention" in _node_names(y)) == (fn is bt.qkv_attention)
            y.backward(g)
            grads = [x.grad, w.grad] + ([b.grad] if bias else [])
            res.append([f64(y)] + [f64(t) for t in grads])
    # float64 sums the same values in another order; bf16 rounds the bias gradient once either way
    tol = {bt.float64: 1e-12, bt.float32: 1e-6, bt.bfloat16: 8e-3}[dtype]
    for name, a, r in zip(("out", "dx", "dW", "db"), res[0], res[1]):
        np.testing.assert_allclose(a, r, rtol=tol, atol=tol, err_msg=name)
    if bias:  # and the bias gradient is the column sums of the composed path's dqkv
        with _flash_cpu(True):
            x, w, b = (bt.tensor(a, dtype=bt.float64, requires_grad=True) for a in arrays)
            qkv = bt.linear(x, w, b)
            qkv.retain_grad()
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, 2))
            y = bt.scaled_dot_product_attention(q, k, v, is_causal=causal)
            y.transpose(1, 2).contiguous().view(B, T, H * D).backward(bt.tensor(f64(g)))
            np.testing.assert_allclose(
                f64(b.grad), qkv.grad.numpy().sum((0, 1)), rtol=1e-12, atol=1e-12
            )


@pytest.mark.parametrize("causal", [False, True])
def test_qkv_attention_gradcheck(rng, causal):
    needs_linalg()

    def leaf(shape, scale=1.0):
        a = rng.uniform(-1, 1, size=shape) * scale
        return bt.tensor(a, dtype=bt.float64, requires_grad=True)

    xs = [leaf((2, 3, 4)), leaf((12, 4), 0.5), leaf((12,))]
    with _flash_cpu(True):
        assert bt.gradcheck(
            lambda x, w, b: bt.qkv_attention(x, w, b, 2, is_causal=causal),
            xs,
            eps=1e-6,
            atol=1e-6,
            rtol=1e-5,
        )


def test_qkv_attention_composes_where_the_kernels_do_not_run(rng):
    """Flash CPU kernels off, or a scale the kernels do not take: the composition's nodes (and
    its numbers); bad shapes raise naming the op."""
    needs_linalg()
    x = bt.tensor(rng.standard_normal((2, 5, 8)), requires_grad=True)
    w = bt.tensor(rng.standard_normal((24, 8)), requires_grad=True)
    with _flash_cpu(False):
        y = bt.qkv_attention(x, w, None, 2, is_causal=True)
        assert "QkvAttention" not in _node_names(y)
        np.testing.assert_array_equal(
            y.detach().numpy(), _qkv_composed(x, w, None, 2, True).detach().numpy()
        )
    with _flash_cpu(True):
        y = bt.qkv_attention(x, w, None, 2, is_causal=False, scale=-0.5)
        assert "QkvAttention" not in _node_names(y)
    with pytest.raises(ValueError, match=r"\[qkv_attention\] weight must be \(3 \* heads \* D"):
        bt.qkv_attention(x, bt.zeros((20, 8)), None, 2)
    with pytest.raises(ValueError, match=r"\[qkv_attention\] input must be \(B, T, C\)"):
        bt.qkv_attention(bt.zeros((5, 8)), w, None, 2)
    with pytest.raises(ValueError, match=r"\[qkv_attention\] input of shape"):  # (its linear's)
        bt.qkv_attention(bt.zeros((2, 5, 7)), w, None, 2)
    with pytest.raises(ValueError, match=r"\[qkv_attention\] bias has shape"):
        bt.qkv_attention(x, w, bt.zeros((5,)), 2)


# ---- non-finite values: Note [causal masks skip] and Note [empty rows] (src/attention.h) -------


def _sdpa_run(q, k, v, g, dtype, fused, **kw):
    """out, dq, dk, dv (float64 numpy) of bt.scaled_dot_product_attention with output gradient g,
    on the fused CPU kernel (fused) or the default composed path."""
    prev = _tensor._flash_attention_cpu()
    _tensor._set_flash_attention_cpu(fused)
    try:
        ts = [bt.tensor(a, dtype=dtype).requires_grad_(True) for a in (q, k, v)]
        out = bt.scaled_dot_product_attention(*ts, **kw)
        out.backward(bt.tensor(g, dtype=dtype))
    finally:
        _tensor._set_flash_attention_cpu(prev)
    return [f64(out.detach())] + [f64(t.grad) for t in ts]


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_causal_rows_never_read_later_positions(rng, dtype, fused, where, bad):
    """An inf / NaN at position p of q, k or v changes no causal row i < p, forward or dq, on the
    composed path (it hands such inputs to the fused kernel) and the fused one alike, as the CUDA
    kernels.  (PyTorch's math path makes those rows NaN: 0 * inf; documented.)"""
    B, H, T, D = 2, 2, 9, 4
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    g = rng.standard_normal((B, H, T, D))
    p, b, h, d = int(rng.integers(1, T)), int(rng.integers(B)), int(rng.integers(H)), 0
    arrays = {"q": q, "k": k, "v": v}
    clean = [a.copy() for a in (q, k, v)]
    arrays[where][b, h, p, d] = bad
    got = _sdpa_run(q, k, v, g, dtype, fused, is_causal=True)
    # the reference takes the inputs as rounded to dtype: a bf16 gradient sums products of
    # rounded inputs, whose rounding alone can move a cancelling element past TOL
    rnd = [f64(bt.tensor(a, dtype=dtype)) for a in (*clean, g)]
    want = _sdpa_run(*rnd[:3], rnd[3], bt.float64, True, is_causal=True)
    tol = TOL[dtype]

    def close(x: np.ndarray, w: np.ndarray) -> None:
        if dtype != bt.bfloat16:
            np.testing.assert_allclose(x, w, **tol)
            return
        # bf16: the elementwise atol plus a normwise term, as the fused kernels round P and dS
        # to bf16 for their products (as CUDA's): an element made by cancellation may sit 0.026
        # off at max |w| 1.4 (seed 1625925677, dk); over 1,500 seeds the largest error is 1.6%
        # of max |w|
        scale = np.abs(w).max(initial=0)
        assert np.abs(x - w).max(initial=0) <= tol["atol"] + 2 * tol["rtol"] * scale, (x, w)

    for x, w in ((got[0], want[0]), (got[1], want[1])):  # out and dq: rows i < p of (b, h)
        assert np.all(np.isfinite(x[b, h, :p]))
        close(x[b, h, :p], w[b, h, :p])
    other = np.ones((B, H), bool)
    other[b, h] = False
    for x, w in zip(got, want, strict=True):  # the other (batch, head) pairs: untouched
        close(x[other], w[other])


def test_only_non_finite_inputs_leave_the_composed_cpu_path(rng):
    """Finite inputs keep the composed CPU path (GEMMs); inputs holding inf / NaN take the fused
    kernel, whose causal loop never reads masked keys."""
    assert not _tensor._flash_attention_cpu()
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))

    def names():
        ts = [bt.tensor(a).requires_grad_(True) for a in (q, k, v)]
        return _node_names(bt.scaled_dot_product_attention(*ts, is_causal=True))

    assert "FlashAttention" not in names()
    v[0, 1, 3, 2] = np.inf
    assert "FlashAttention" in names()


@pytest.mark.parametrize("fused", [False, True])
def test_scores_all_minus_inf_give_zero_and_no_gradient(rng, fused):
    """Note [empty rows]: q_0 = +inf, k_0 = -inf make row 0's only score -inf: out 0, lse -inf,
    no gradient from that row (PyTorch's flash path gives 0 too); other rows as usual."""
    B, H, T, D = 1, 1, 4, 3
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    k = np.abs(k) + 0.1  # row 0's score: +inf * -k0 ... all -inf
    q[0, 0, 0] = np.inf
    k[0, 0, 0] = -np.abs(k[0, 0, 0])
    k[0, 0, 0, 0] = -np.inf
    g = rng.standard_normal((B, H, T, D))
    out, dq, dk, dv = _sdpa_run(q, k, v, g, bt.float64, fused, is_causal=True)
    np.testing.assert_array_equal(out[0, 0, 0], 0.0)
    np.testing.assert_array_equal(dq[0, 0, 0], 0.0)
    o2, lse = flash(*(bt.tensor(a) for a in (q, k, v)), is_causal=True)
    assert f64(lse)[0, 0, 0] == -np.inf
    np.testing.assert_array_equal(f64(o2)[0, 0, 0], 0.0)
    # rows 1..3 see k_0 = -inf too: +inf * ... NaN or -inf scores; whichever, never silent 0
    # for a NaN score: a row with a NaN score is NaN
    s = np.einsum("d,d->", q[0, 0, 0], k[0, 0, 0])
    assert s == -np.inf


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [bt.float64, bt.float32])
def test_fully_masked_rows_match_pytorch(rng, torch_ref, dtype):
    """A row that attn_mask masks entirely (a padding query) is 0 with no gradient, as PyTorch's
    scaled_dot_product_attention (its math path's safe softmax): it was NaN, and its NaN
    gradient reached every key."""
    torch = torch_ref
    B, H, L, S, D = 2, 2, 5, 6, 4
    q = rng.standard_normal((B, H, L, D))
    k, v = rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D))
    g = rng.standard_normal((B, H, L, D))
    mask = rng.random((B, 1, L, S)) < 0.6
    mask[0, 0, 1] = False  # fully masked rows
    mask[1, 0, 4] = False
    fmask = np.where(mask, 0.0, -np.inf)
    for m in (mask, fmask):
        got = _sdpa_run(q, k, v, g, dtype, False, attn_mask=bt.tensor(m))
        ts = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*ts, attn_mask=torch.tensor(m))
        out.backward(torch.tensor(g))
        want = [out.detach().numpy()] + [t.grad.numpy() for t in ts]
        for x, w in zip(got, want, strict=True):
            assert np.all(np.isfinite(x))
            np.testing.assert_allclose(x, w, **TOL[dtype])
        np.testing.assert_array_equal(got[0][0, :, 1], 0.0)
        np.testing.assert_array_equal(got[1][1, :, 4], 0.0)


def test_a_nan_score_still_makes_its_row_nan(rng):
    q, k, v = (rng.standard_normal((1, 1, 3, 2)) for _ in range(3))
    q[0, 0, 2, 0] = np.nan
    for fused in (False, True):
        out = _sdpa_run(q, k, v, np.ones_like(q), bt.float64, fused, is_causal=True)[0]
        assert np.all(np.isnan(out[0, 0, 2])) and np.all(np.isfinite(out[0, 0, :2]))
    mask = np.array([[True, False, False], [False, False, False], [True, True, True]])
    out = _sdpa_run(q, k, v, np.ones_like(q), bt.float64, False, attn_mask=bt.tensor(mask))[0]
    assert np.all(np.isnan(out[0, 0, 2])) and np.all(out[0, 0, 1] == 0)


@pytest.mark.parametrize("causal", [False, True])
def test_default_and_fused_cpu_paths_agree_on_non_finite_inputs(rng, causal):
    """Non-causal too: a row of -inf scores is 0 on the default CPU path as in the fused kernels
    (the composition gave NaN); every other row equal (NaN where NaN), out and gradients."""
    B, H, T, D = 1, 2, 6, 3
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    k = -(np.abs(k) + 0.1)
    k[..., 0] = -np.inf
    q[:, :, 0] = np.inf  # row 0: every score -inf
    v[0, 1, 4, 2] = np.nan
    g = rng.standard_normal((B, H, T, D))
    a = _sdpa_run(q, k, v, g, bt.float64, False, is_causal=causal)
    b = _sdpa_run(q, k, v, g, bt.float64, True, is_causal=causal)
    np.testing.assert_array_equal(a[0][:, :, 0], 0.0)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_scale_raises(scale):
    """(PyTorch returns NaN; the fuzz's scale=-inf case made a row of -inf scores from finite
    inputs: seed 90905218 case 7592.)"""
    q = bt.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"^\[scaled_dot_product_attention\] scale must be fin"):
        bt.scaled_dot_product_attention(q, q, q, is_causal=True, scale=scale)
    with pytest.raises(ValueError, match=r"^\[qkv_attention\] scale must be finite"):
        bt.qkv_attention(bt.zeros((1, 3, 4)), bt.zeros((12, 4)), None, 2, scale=scale)


@pytest.mark.parametrize("scale", [-0.7, 0.0])
def test_causal_skip_holds_for_any_finite_scale(rng, scale):
    """A non-positive scale, which the fused kernels refuse, with an inf in v: rows before it
    still equal the clean inputs' (q scale into the kernel with scale 1)."""
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    g = rng.standard_normal(q.shape)
    clean = v.copy()
    v[0, 0, 3, 1] = np.inf
    got = _sdpa_run(q, k, v, g, bt.float64, False, is_causal=True, scale=scale)
    want = _sdpa_run(q, k, clean, g, bt.float64, False, is_causal=True, scale=scale)
    for x, w in zip(got[:2], want[:2], strict=True):
        np.testing.assert_allclose(x[0, 0, :3], w[0, 0, :3], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(x[0, 1], w[0, 1], rtol=1e-12, atol=1e-12)


def test_a_scale_past_the_scores_dtype_raises():
    """(fuzz seeds 1417888661 case 8849 and others: scale=1e308 became inf in float32)"""
    q = bt.zeros((1, 1, 2, 4))
    with pytest.raises(ValueError, match=r"^\[scaled_dot_product_attention\] scale .* overflows"):
        bt.scaled_dot_product_attention(q, q, q, scale=1e308)
    with pytest.raises(ValueError, match=r"^\[qkv_attention\] scale .* overflows float32"):
        bt.qkv_attention(bt.zeros((1, 3, 4)), bt.zeros((12, 4)), None, 2, scale=1e300)
    y = bt.scaled_dot_product_attention(q.double(), q.double(), q.double(), scale=1e308)
    assert y.shape == (1, 1, 2, 4)  # (float64 scores take it)


def test_scores_overflowing_to_minus_inf_give_empty_rows_not_nan():
    """Finite float64 inputs and a huge scale: a row whose scores all overflow to -inf weighs
    nothing (0), as Note [empty rows] (fuzz seed 76989447 case 7870 gave NaN)."""
    q = bt.tensor([[[[1.0], [1.0]]]], dtype=bt.float64)
    k = bt.tensor([[[[-2.0], [-3.0]]]], dtype=bt.float64)
    v = bt.tensor([[[[5.0], [7.0]]]], dtype=bt.float64)
    y = bt.scaled_dot_product_attention(q, k, v, scale=1e308)
    np.testing.assert_array_equal(f64(y), 0.0)


@pytest.mark.parametrize("shape", ["3d", "broadcast", "l_lt_s", "l_gt_s"])
def test_causal_skip_beyond_the_fused_kernels_shapes(rng, shape):
    """Non-finite inputs of shapes the fused kernel does not take as they are (3-D q, k, v;
    broadcast batch dims; causal L != S, top-left): rows before a bad value still equal the clean
    inputs' (fuzz seeds 2116197933 case 1311, 978248026 case 3958 gave NaN for empty rows)."""
    L, S, D = {"l_lt_s": (4, 7, 3), "l_gt_s": (7, 4, 3)}.get(shape, (6, 6, 3))
    qs, ks = {"3d": ((2, L, D), (2, S, D)), "broadcast": ((2, 3, L, D), (1, 3, S, D))}.get(
        shape, ((1, 2, L, D), (1, 2, S, D))
    )
    q, k, v = rng.standard_normal(qs), rng.standard_normal(ks), rng.standard_normal(ks)
    g = rng.standard_normal(qs)
    clean = v.copy()
    p = min(L, S) - 2
    v[..., p, 1] = np.inf
    got = _sdpa_run(q, k, v, g, bt.float64, False, is_causal=True)
    want = _sdpa_run(q, k, clean, g, bt.float64, False, is_causal=True)
    for x, w in zip(got[:2], want[:2], strict=True):
        assert np.isfinite(x[..., :p, :]).all()
        np.testing.assert_allclose(x[..., :p, :], w[..., :p, :], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[0][..., p:, 0], want[0][..., p:, 0], rtol=1e-12)  # (column 0)


def test_float16_scores_overflowing_from_finite_inputs_give_empty_rows():
    """float16 scores overflow at 65504: q = 300, k = -300 (D 1) make -90000 -> -inf in the
    composed CPU path; that row weighs nothing (0) rather than NaN."""
    q = bt.tensor([[[[300.0], [1.0]]]], dtype=bt.float16)
    k = bt.tensor([[[[-300.0], [-300.0]]]], dtype=bt.float16)
    v = bt.tensor([[[[5.0], [7.0]]]], dtype=bt.float16)
    y = f64(bt.scaled_dot_product_attention(q, k, v, scale=1.0))
    assert y[0, 0, 0, 0] == 0.0 and np.isfinite(y).all()
