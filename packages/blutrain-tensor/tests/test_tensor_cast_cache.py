"""Cached casts and float32 weight gradients (Note [cached casts], src/primitives.h).

bt.cached_astype(p, dtype) keeps p's cast with p's storage and reuses it while p is unchanged;
AdamW rewrites a float32 parameter's kept 16-bit copy in its own kernel.  A cast's node takes its
gradient in its input's dtype, so a 16-bit linear layer's weight GEMM writes a float32 master's
gradient in float32.  Checked on every backend:
  - the kept copy is bitwise astype's, reused (same memory) while p is unchanged, and rebuilt in
    place after an in-place change of p or of the copy;
  - AdamW keeps it current (bitwise astype of the updated p, no new cast) on both CUDA kernels;
  - gradients: the same bits through cached_astype as through astype, and a float32 dW equal to
    a float64 reference of the bf16 GEMM to float32 accuracy (a bf16-rounded one fails that);
  - hooks on the cast's output still see its own dtype; a step between forward and backward
    raises (the copy saved for backward changed); caching off gives the same bits;
  - CUDA: a linear layer's bias gradient by our column-sum kernel and by cuBLASLt's BGRAD
    epilogue (BLUTRAIN_BGRAD=cublaslt), against float64 sums.
"""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import needs_linalg

import blutrain.tensor as bt
from blutrain.tensor import _tensor as C

NO_CUDA = pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]


@pytest.fixture(autouse=True)
def _linalg_and_switch():
    needs_linalg()
    was = bt.is_cast_cache_enabled()
    bt.set_cast_cache_enabled(True)
    yield
    bt.set_cast_cache_enabled(was)


def _bits(t: bt.Tensor) -> np.ndarray:
    a = t.detach().cpu()
    if a.dtype in (bt.bfloat16, bt.float16):
        a = a.float()
    return np.ascontiguousarray(a.numpy()).view(np.uint8)


def _same_bits(a: bt.Tensor, b: bt.Tensor) -> bool:
    return a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _param(rng, shape, device, scale=1.0):
    return bt.tensor(
        rng.standard_normal(shape) * scale, dtype=bt.float32, device=device, requires_grad=True
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
def test_kept_copy_is_astype_and_reused(device, dtype):
    rng = np.random.default_rng(1)
    p = _param(rng, (37, 29), device)
    a = bt.cached_astype(p, dtype)
    assert a.dtype == dtype and a.shape == p.shape
    assert _same_bits(a, p.detach().to(dtype))
    assert bt.cast_cache_bytes(p) == 37 * 29 * 2
    b = bt.cached_astype(p, dtype)
    assert b.data_ptr() == a.data_ptr(), "an unchanged parameter must reuse its copy"
    same = bt.cached_astype(p, bt.float32)  # same dtype: p itself
    assert same.data_ptr() == p.data_ptr() and same.is_leaf
    # an in-place change of p makes the copy stale: the next call casts again, into its memory
    with bt.no_grad():
        p.mul_(-3.0)
    c = bt.cached_astype(p, dtype)
    assert c.data_ptr() == a.data_ptr()
    assert _same_bits(c, p.detach().to(dtype))
    # so does a change of the copy itself (through the returned view)
    with bt.no_grad():
        c.add_(1.0)
    assert _same_bits(bt.cached_astype(p, dtype), p.detach().to(dtype))
    bt.drop_cast_cache(p)
    assert bt.cast_cache_bytes(p) == 0
    assert _same_bits(bt.cached_astype(p, dtype), p.detach().to(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_geometries_and_dtypes_have_their_own_entries(device):
    rng = np.random.default_rng(2)
    p = _param(rng, (8, 6), device)
    whole = bt.cached_astype(p, bt.bfloat16)
    row = bt.cached_astype(p[3], bt.bfloat16)
    half = bt.cached_astype(p, bt.float16)
    assert _same_bits(row, p.detach()[3].to(bt.bfloat16))
    assert _same_bits(half, p.detach().to(bt.float16))
    assert _same_bits(whole, p.detach().to(bt.bfloat16))
    assert bt.cast_cache_bytes(p) == (48 + 6 + 48) * 2


@pytest.mark.parametrize("device", DEVICES)
def test_not_cached_where_it_does_not_apply(device):
    rng = np.random.default_rng(3)
    i = bt.tensor(rng.integers(0, 9, (5,)), dtype=bt.int64, device=device)
    assert bt.cached_astype(i, bt.float32).dtype == bt.float32
    assert bt.cast_cache_bytes(i) == 0
    p = _param(rng, (4, 4), device)
    bt.set_cast_cache_enabled(False)
    assert _same_bits(bt.cached_astype(p, bt.bfloat16), p.detach().to(bt.bfloat16))
    assert bt.cast_cache_bytes(p) == 0


def _linear_grads(device, cast, seed=4, hook=None):
    """A bf16 linear layer on float32 masters W (N, K), b (N); returns (W, b, x16, g16)."""
    rng = np.random.default_rng(seed)
    M, K, N = 67, 96, 40
    W = _param(rng, (N, K), device, 0.1)
    b = _param(rng, (N,), device, 0.1)
    x16 = bt.tensor(rng.standard_normal((M, K)), dtype=bt.bfloat16, device=device)
    g16 = bt.tensor(rng.standard_normal((M, N)), dtype=bt.bfloat16, device=device)
    w16 = cast(W)
    if hook is not None:
        hook(w16)
    y = bt.linear(x16, w16, cast(b))
    (y.float() * g16.float()).sum().backward()  # y's cotangent is g16, exactly
    return W, b, x16, g16, w16


CASTS = {
    "cached": lambda t: bt.cached_astype(t, bt.bfloat16),
    "astype": lambda t: t.to(bt.bfloat16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast", list(CASTS))
def test_weight_gradient_is_written_in_float32(device, cast):
    W, b, x16, g16, _ = _linear_grads(device, CASTS[cast])
    assert W.grad.dtype == bt.float32 and b.grad.dtype == bt.float32
    g = g16.float().cpu().numpy().astype(np.float64)
    x = x16.float().cpu().numpy().astype(np.float64)
    dw_ref, db_ref = g.T @ x, g.sum(0)
    # float32 accumulation of exact bf16 products: ~1e-6 relative; a bf16-rounded result is off
    # by up to 2^-9 of each value, far outside this tolerance.
    scale = np.abs(g).T @ np.abs(x)
    err = np.abs(W.grad.cpu().numpy() - dw_ref) / scale
    assert err.max() < 2e-5, f"dW relative error {err.max():.2e}: not a float32 result"
    db_err = np.abs(b.grad.cpu().numpy() - db_ref) / np.abs(g).sum(0)
    assert db_err.max() < 2e-5, f"db relative error {db_err.max():.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_cached_and_astype_give_the_same_bits(device):
    Wa, ba, _, _, _ = _linear_grads(device, CASTS["cached"])
    Wb, bb, _, _, _ = _linear_grads(device, CASTS["astype"])
    assert _same_bits(Wa.grad, Wb.grad) and _same_bits(ba.grad, bb.grad)


def _dtype_recording_hook():
    """(seen, hook): hook(w16) records the dtype of each gradient w16 gets and retains it."""
    seen = []

    def hook(w16):
        w16.register_hook(lambda g: seen.append(g.dtype))
        w16.retain_grad()

    return seen, hook


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_on_the_cast_see_its_dtype(device):
    seen, hook = _dtype_recording_hook()

    W, _, x16, g16, w16 = _linear_grads(device, CASTS["cached"], hook=hook)
    assert seen == [bt.bfloat16]
    assert w16.grad.dtype == bt.bfloat16
    # the master still gets the (rounded) gradient, in float32
    assert W.grad.dtype == bt.float32
    assert _same_bits(W.grad, w16.grad.float())


@pytest.mark.parametrize("device", DEVICES)
def test_a_removed_hook_gives_the_float32_gradient_back(device):
    # a hook on the cast makes its node take a bf16 gradient (the master's is then bf16-rounded);
    # once removed, the C++ core has no hook there and dW is written in float32 again
    def hook_then_remove(w16):
        w16.register_hook(lambda g: g).remove()

    plain, _, _, _, _ = _linear_grads(device, CASTS["cached"])
    removed, _, _, _, _ = _linear_grads(device, CASTS["cached"], hook=hook_then_remove)
    hooked, _, _, _, _ = _linear_grads(
        device, CASTS["cached"], hook=lambda w: w.register_hook(lambda g: None)
    )
    assert _same_bits(removed.grad, plain.grad)
    assert not _same_bits(hooked.grad, plain.grad)  # what a left-over C++ entry would give
    assert _same_bits(hooked.grad, hooked.grad.to(bt.bfloat16).float())


@pytest.mark.parametrize("device", DEVICES)
def test_shared_weight_gradients_add_up(device):
    """One cast used twice (a tied embedding): both gradients reach the master."""
    rng = np.random.default_rng(5)
    W = _param(rng, (12, 8), device)
    x16 = bt.tensor(rng.standard_normal((6, 8)), dtype=bt.bfloat16, device=device)
    idx = bt.tensor(np.array([1, 3, 3, 7]), dtype=bt.int64, device=device)
    w16 = bt.cached_astype(W, bt.bfloat16)
    loss = bt.linear(x16, w16).float().sum() + bt.embedding(idx, w16).float().sum()
    loss.backward()
    x = x16.float().cpu().numpy().astype(np.float64)
    want = np.tile(x.sum(0), (12, 1))
    for i in [1, 3, 3, 7]:
        want[i] += 1.0
    np.testing.assert_allclose(W.grad.cpu().numpy(), want, rtol=1e-5, atol=1e-5)


def _adamw(ps, gs, states, step):
    ms, vs = states
    C._adamw_(ps, gs, ms, vs, 1e-2, 0.9, 0.95, 1e-8, [0.1, 0.0, 0.1], step)


@pytest.mark.parametrize(
    "device,kernel",
    [
        ("cpu", 2),
        pytest.param("cuda", 2, marks=[pytest.mark.gpu, NO_CUDA]),
        pytest.param("cuda", 1, marks=[pytest.mark.gpu, NO_CUDA]),
    ],
)
def test_adamw_keeps_the_copies_current(device, kernel):
    rng = np.random.default_rng(6)
    shapes = [(33, 17), (5000,), (3,)]  # odd sizes: vector and scalar tails
    ps = [_param(rng, s, device) for s in shapes]
    ref = [bt.tensor(p.detach().cpu().numpy(), device=device) for p in ps]
    dts = [bt.bfloat16, bt.float16, None]  # the last param has no copy
    copies = [bt.cached_astype(p, d) if d else None for p, d in zip(ps, dts, strict=True)]
    zeros = [[bt.zeros(s, device=device) for s in shapes] for _ in range(4)]
    prev = C._optim_kernel_version() if device == "cuda" else None
    if device == "cuda":
        C._set_optim_kernel_version(kernel)
    try:
        for step in (1, 2, 3):
            gs = [
                bt.tensor(rng.standard_normal(s), dtype=bt.float32, device=device) for s in shapes
            ]
            _adamw(ps, gs, zeros[:2], step)
            _adamw(ref, gs, zeros[2:], step)
    finally:
        if prev is not None:
            C._set_optim_kernel_version(prev)
    for p, r, d, c in zip(ps, ref, dts, copies, strict=True):
        assert _same_bits(p, r), "a kept copy must not change the update"
        if d is None:
            continue
        again = bt.cached_astype(p, d)
        assert again.data_ptr() == c.data_ptr()
        assert _same_bits(again, p.detach().to(d)), "AdamW left the copy stale or misrounded"


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_between_forward_and_backward_raises(device):
    rng = np.random.default_rng(7)
    W = _param(rng, (8, 4), device)
    x16 = bt.tensor(rng.standard_normal((3, 4)), dtype=bt.bfloat16, device=device)
    loss = bt.linear(x16, bt.cached_astype(W, bt.bfloat16)).float().sum()
    with bt.no_grad():  # the step rewrites the copy the linear saved for dx
        C._adamw_(
            [W],
            [bt.ones(W.shape, device=device)],
            [bt.zeros(W.shape, device=device)],
            [bt.zeros(W.shape, device=device)],
            1e-2,
            0.9,
            0.95,
            1e-8,
            0.0,
            1,
        )
    with pytest.raises(RuntimeError, match="modified by an in-place"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_caching_off_trains_to_the_same_bits(device):
    """Two bf16 linear layers on float32 masters, three AdamW steps, cache on and off."""

    def run(enabled):
        bt.set_cast_cache_enabled(enabled)
        rng = np.random.default_rng(8)
        ps = [
            _param(rng, (24, 16), device, 0.2),
            _param(rng, (24,), device, 0.2),
            _param(rng, (8, 24), device, 0.2),
        ]
        states = [[bt.zeros(p.shape, device=device) for p in ps] for _ in range(2)]
        for step in (1, 2, 3):
            x = bt.tensor(rng.standard_normal((10, 16)), dtype=bt.bfloat16, device=device)
            w1, b1, w2 = (bt.cached_astype(p, bt.bfloat16) for p in ps)
            h = bt.gelu(bt.linear(x, w1, b1), "tanh")
            loss = (bt.linear(h, w2).float() ** 2).mean()
            for p in ps:
                p.grad = None
            loss.backward()
            C._adamw_(ps, [p.grad for p in ps], *states, 1e-2, 0.9, 0.95, 1e-8, 0.0, step)
        return ps

    on, off = run(True), run(False)
    for a, b in zip(on, off, strict=True):
        assert _same_bits(a, b)


@pytest.mark.gpu
@NO_CUDA
@pytest.mark.parametrize("impl", ["kernel", "cublaslt"])
@pytest.mark.parametrize("master", [bt.float32, bt.bfloat16, None])
@pytest.mark.parametrize("M,N", [(1, 64), (67, 36), (300, 768), (4099, 2304)])
def test_bias_gradient_kernels(monkeypatch, impl, master, M, N):
    """A linear layer's db on CUDA: our column-sum kernel (the default where rows are whole 16-byte
    vectors) and cuBLASLt's BGRAD epilogue, against float64 sums of the same g; float32 db for a
    float32 master of a bf16 layer, else the layer's dtype."""
    monkeypatch.setenv("BLUTRAIN_BGRAD", impl)
    rng = np.random.default_rng(M * N)
    K = 32
    dt = bt.float32 if master is None else bt.bfloat16
    Wd = master or bt.float32
    W = bt.tensor(rng.standard_normal((N, K)) * 0.1, dtype=Wd, device="cuda", requires_grad=True)
    b = bt.tensor(rng.standard_normal((N,)) * 0.1, dtype=Wd, device="cuda", requires_grad=True)
    x = bt.tensor(rng.standard_normal((M, K)), dtype=dt, device="cuda")
    g = bt.tensor(rng.standard_normal((M, N)), dtype=dt, device="cuda")
    y = bt.linear(x, bt.cached_astype(W, dt), bt.cached_astype(b, dt))
    y.backward(g)
    want = g.cpu().float().numpy().astype(np.float64).sum(0)
    scale = np.abs(g.cpu().float().numpy().astype(np.float64)).sum(0)
    got = b.grad.cpu().float().numpy()
    assert b.grad.dtype == Wd
    # float32 sums: ~1e-6 relative; a bf16 result (bf16 master): 2^-8
    tol = 4e-3 if Wd == bt.bfloat16 else 2e-5
    assert (np.abs(got - want) / scale).max() < tol


# ---- layer norm and embedding gradients in float32 -------------------------------------------
# A 16-bit layer norm's dweight / dbias and an embedding's table gradient go to a float32 master
# in float32 (the kernels' float32 sums unrounded; no widening kernel).  Tolerances as above:
# float32 sums are ~1e-6 relative to the summed magnitudes; a 16-bit result is off by up to 2^-9.
NORM_SHAPES = [(67, 96), (300, 768), (5, 40)]


# how the float32 masters reach a 16-bit norm; "mixed": as they are (the front casts them)
NORM_CASTS = {
    "cached": lambda t, dt: bt.cached_astype(t, dt),
    "astype": lambda t, dt: t.to(dt),
    "mixed": lambda t, dt: t,
}


def _norm_grads(device, kind, R, C, cast, dtype=bt.bfloat16, hook=None):
    """A 16-bit layer norm ("layer_norm" or "add_layer_norm") on float32 masters w, b (reaching it
    through NORM_CASTS[cast]), with y's cotangent g16 exactly; returns (w, b, normalised input s,
    g16, w16)."""
    rng = np.random.default_rng(R * 1000 + C)
    w = _param(rng, (C,), device, 0.5)
    b = _param(rng, (C,), device, 0.5)
    x16 = bt.tensor(rng.standard_normal((R, C)) * 2 + 0.5, dtype=dtype, device=device)
    g16 = bt.tensor(rng.standard_normal((R, C)), dtype=dtype, device=device)
    w16, b16 = NORM_CASTS[cast](w, dtype), NORM_CASTS[cast](b, dtype)
    if hook is not None:
        hook(w16)
    if kind == "layer_norm":
        s, y = x16, bt.layer_norm(x16, (C,), w16, b16)
    else:
        r16 = bt.tensor(rng.standard_normal((R, C)), dtype=dtype, device=device)
        s, y = bt.add_layer_norm(x16, r16, w16, b16)  # the kernels normalise the rounded sum
    (y.float() * g16.float()).sum().backward()
    return w, b, s, g16, w16


def _check_norm_grads(w, b, s, g16, tol=2e-5):
    s64 = s.detach().float().cpu().numpy().astype(np.float64)
    g = g16.float().cpu().numpy().astype(np.float64)
    xhat = (s64 - s64.mean(1, keepdims=True)) / np.sqrt(s64.var(1, keepdims=True) + 1e-5)
    dw_err = np.abs(w.grad.cpu().numpy() - (g * xhat).sum(0)) / np.abs(g * xhat).sum(0)
    db_err = np.abs(b.grad.cpu().numpy() - g.sum(0)) / np.abs(g).sum(0)
    assert dw_err.max() < tol, f"dweight relative error {dw_err.max():.2e}: not a float32 sum"
    assert db_err.max() < tol, f"dbias relative error {db_err.max():.2e}: not a float32 sum"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["layer_norm", "add_layer_norm"])
@pytest.mark.parametrize("cast", list(NORM_CASTS))
@pytest.mark.parametrize("R,C", NORM_SHAPES)
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
def test_layer_norm_affine_gradients_are_float32(device, kind, cast, R, C, dtype):
    w, b, s, g16, _ = _norm_grads(device, kind, R, C, cast, dtype)
    assert w.grad.dtype == bt.float32 and b.grad.dtype == bt.float32
    _check_norm_grads(w, b, s, g16)


@pytest.mark.gpu
@NO_CUDA
@pytest.mark.parametrize("ver", ["2", "3", "4", "5", "6"])
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
@pytest.mark.parametrize("R,C", [*NORM_SHAPES, (2048, 3072)])
def test_layer_norm_float32_gradients_every_kernel(monkeypatch, ver, dtype, R, C):
    """Every backward kernel (BT_CUDA_NN_VERSION; each falls back where it does not apply) writes
    float32 dweight / dbias for a float32 master, and a weight-only norm writes dweight alone."""
    monkeypatch.setenv("BT_CUDA_NN_VERSION", ver)
    w, b, s, g16, _ = _norm_grads("cuda", "add_layer_norm", R, C, "cached", dtype)
    _check_norm_grads(w, b, s, g16)
    w2 = bt.tensor(w.detach().cpu().numpy(), device="cuda", requires_grad=True)
    bt.layer_norm(s.detach(), (C,), bt.cached_astype(w2, dtype)).float().sum().backward()
    assert w2.grad.dtype == bt.float32 and w2.grad.shape == (C,)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_hooks_on_the_cast_see_its_dtype(device):
    seen, hook = _dtype_recording_hook()

    w, b, s, g16, w16 = _norm_grads(device, "layer_norm", 67, 96, "cached", hook=hook)
    assert seen == [bt.bfloat16] and w16.grad.dtype == bt.bfloat16
    assert w.grad.dtype == bt.float32 and _same_bits(w.grad, w16.grad.float())
    # one kernel writes both: with the weight's gradient in bf16, so is the bias's (rounded once)
    assert b.grad.dtype == bt.float32
    _check_norm_grads(w, b, s, g16, tol=4e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast", list(CASTS))
def test_embedding_gradient_is_written_in_float32(device, cast):
    """600 rows into 7 of 50 entries: float32 sums, exact zeros elsewhere."""
    rng = np.random.default_rng(8)
    W = _param(rng, (50, 24), device)
    idx = rng.integers(0, 7, 600)
    g16 = bt.tensor(rng.standard_normal((600, 24)), dtype=bt.bfloat16, device=device)
    e = bt.embedding(bt.tensor(idx, dtype=bt.int64, device=device), CASTS[cast](W))
    (e.float() * g16.float()).sum().backward()
    assert W.grad.dtype == bt.float32
    g = g16.float().cpu().numpy().astype(np.float64)
    want, scale = np.zeros((50, 24)), np.zeros((50, 24))
    np.add.at(want, idx, g)
    np.add.at(scale, idx, np.abs(g))
    got = W.grad.cpu().numpy()
    assert not got[7:].any()
    err = np.abs(got[:7] - want[:7]) / scale[:7]
    assert err.max() < 2e-5, f"embedding gradient relative error {err.max():.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_embedding_gradient_over_fresh_zeros(device, dtype):
    """The table gradient is summed over its fresh zeros in place: a second backward through a
    retained graph starts from zeros again (the leaf's .grad doubles), and rows no index names
    stay exactly zero."""
    rng = np.random.default_rng(9)
    W = bt.tensor(rng.standard_normal((10, 4)), dtype=dtype, device=device, requires_grad=True)
    ids = rng.integers(0, 8, 30)
    e = bt.embedding(bt.tensor(ids, dtype=bt.int64, device=device), W)
    loss = (e.float() * 3.0).sum()
    loss.backward(retain_graph=True)
    first = W.grad.float().cpu().numpy().copy()
    loss.backward()
    counts = np.bincount(ids, minlength=10)[:, None] * np.full((1, 4), 3.0)
    np.testing.assert_array_equal(first, counts)
    np.testing.assert_array_equal(W.grad.float().cpu().numpy(), 2 * counts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast", [*CASTS, "none"])
@pytest.mark.parametrize("order", ["head_last", "embedding_last"])
def test_tied_table_gradient_sums_both_uses(device, cast, order):
    """A table used by an embedding and a linear head (GPT-2's tied wte): the embedding's
    backward adds its rows into the head's dW that the engine offers it (Note [taking over a
    pending gradient]) instead of into zeros and a second add. The sum matches float64 whichever
    use runs first, rows no index names carry the head's part alone, and a second backward
    through the retained graph doubles .grad."""
    rng = np.random.default_rng()
    V, C, N, M = int(rng.integers(40, 90)), 24, 300, 40
    W = _param(rng, (V, C), device)
    Wc = W if cast == "none" else CASTS[cast](W)
    idx = rng.integers(0, V // 2, N)
    h = bt.tensor(rng.standard_normal((M, C)), dtype=Wc.dtype, device=device)
    g1 = bt.tensor(rng.standard_normal((N, C)), dtype=bt.float32, device=device)
    g2 = bt.tensor(rng.standard_normal((M, V)), dtype=bt.float32, device=device)
    ids = bt.tensor(idx, dtype=bt.int64, device=device)
    if order == "head_last":  # the head is made last, so its backward runs first
        emb = (bt.embedding(ids, Wc).float() * g1).sum()
        head = (bt.linear(h, Wc).float() * g2).sum()
    else:
        head = (bt.linear(h, Wc).float() * g2).sum()
        emb = (bt.embedding(ids, Wc).float() * g1).sum()
    loss = emb + head
    loss.backward(retain_graph=True)
    first = W.grad.float().cpu().numpy().copy()
    hf = h.float().cpu().numpy().astype(np.float64)
    g1n, g2n = g1.cpu().numpy().astype(np.float64), g2.cpu().numpy().astype(np.float64)
    want = g2n.T @ hf
    np.add.at(want, idx, g1n)
    scale = np.abs(g2n).T @ np.abs(hf)
    np.add.at(scale, idx, np.abs(g1n))
    tol = 2e-5 if Wc.dtype == bt.float32 else 1e-2  # a bf16 GEMM's dW
    err = np.abs(first - want) / scale
    assert err.max() < tol, f"tied table gradient relative error {err.max():.2e}"
    loss.backward()
    np.testing.assert_allclose(W.grad.float().cpu().numpy(), 2 * first, rtol=1e-6, atol=1e-6)


@pytest.fixture
def lgl_impl():
    prev = C._get_linear_gelu_linear_impl()
    yield C._set_linear_gelu_linear_impl
    C._set_linear_gelu_linear_impl(prev)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("impl", ["kernel", "kernel_v1", "cublaslt"])
def test_mlp_first_bias_gradient_is_float32(lgl_impl, device, recompute, impl):
    """linear_gelu_linear's b1 gradient (column sums of the rounded bf16 dpre) comes out in
    float32: most values are not bf16 numbers (a bf16 sum widened afterwards would all be), and
    it matches float64 to bf16's accuracy of dpre.  impl (CUDA): our column-sum kernel, its v1
    reference, or cuBLASLt's DGELU_BGRAD epilogue, which keeps db1 in bf16 (the CPU always runs
    linalg's epilogue, in float32)."""
    lgl_impl(impl)
    rng = np.random.default_rng(12)
    M, K, N = 96, 64, 128
    p = {
        n: _param(rng, s, device, 0.2)
        for n, s in {"w1": (N, K), "b1": (N,), "w2": (K, N), "b2": (K,)}.items()
    }
    x16 = bt.tensor(rng.standard_normal((M, K)), dtype=bt.bfloat16, device=device)
    c = {n: bt.cached_astype(t, bt.bfloat16) for n, t in p.items()}
    y = bt.linear_gelu_linear(x16, c["w1"], c["b1"], c["w2"], c["b2"], recompute=recompute)
    g16 = bt.tensor(rng.standard_normal((M, K)), dtype=bt.bfloat16, device=device)
    (y.float() * g16.float()).sum().backward()
    db1 = p["b1"].grad.cpu().numpy()
    assert p["b1"].grad.dtype == bt.float32
    as_bf16 = bt.tensor(db1).to(bt.bfloat16).float().numpy()
    if device == "cuda" and impl == "cublaslt":
        assert (as_bf16 == db1).all(), "cuBLASLt's epilogue writes a bf16 db1"
    else:
        assert (as_bf16 != db1).mean() > 0.8, "b1's gradient looks bf16-rounded"
    # float64 reference of the whole chain from the bf16 values
    f = lambda t: t.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    pre = f(x16) @ f(c["w1"]).T + f(c["b1"])
    k = np.sqrt(2 / np.pi)
    t = np.tanh(k * (pre + 0.044715 * pre**3))
    dgelu = 0.5 * (1 + t) + 0.5 * pre * (1 - t * t) * k * (1 + 3 * 0.044715 * pre**2)
    dpre = (f(g16) @ f(c["w2"])) * dgelu
    err = np.abs(db1 - dpre.sum(0)) / np.abs(dpre).sum(0)
    assert err.max() < 2e-2, f"b1 gradient relative error {err.max():.2e}"
