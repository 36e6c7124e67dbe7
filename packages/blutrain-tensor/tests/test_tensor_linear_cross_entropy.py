"""bt.linear_cross_entropy: the classifier head and its loss without keeping the logits (Note
[chunked classifier], src/autocast.h).  Loss and gradients against a float64 numpy reference
and finite differences on the CPU; on CUDA against the reference (every chunking, a padded
GPT-2 vocabulary, poisoned memory), against linear + cross_entropy, and by peak memory."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import DEVICES, f64, needs_linalg

import blutrain.tensor as bt

V_GPT, VP_GPT = 50257, 50304


@pytest.fixture(autouse=True)
def _linalg():
    needs_linalg()


def _targets(rng, N, V, ii=-100, frac_ignored=0.2):
    t = rng.integers(0, V, size=N)
    t[rng.random(N) < frac_ignored] = ii
    return t


def _reference(x, w, t, V, ii, reduction, cot=1.0):
    """(loss, dx, dw) in float64: x (N, K), w (Vp, K), the first V columns are classes."""
    z = x @ w.T
    zc = z[:, :V]
    m = zc.max(1, keepdims=True)
    lse = (m + np.log(np.exp(zc - m).sum(1, keepdims=True)))[:, 0]
    valid = t != ii
    rows = np.arange(len(t))[valid]
    nll = lse[valid] - zc[rows, t[valid]]
    n = valid.sum()
    scale = cot / n if reduction == "mean" else cot
    loss = nll.sum() / n if reduction == "mean" else nll.sum()
    d = np.zeros_like(z)
    d[:, :V] = np.exp(zc - lse[:, None])
    d[rows, t[valid]] -= 1
    d[~valid] = 0
    d *= scale
    return loss, d @ w, d.T @ x


def _leaves(rng, N, K, Vp, dtype, device="cpu", wscale=0.5):
    x = bt.tensor(rng.standard_normal((N, K)), dtype=dtype, device=device, requires_grad=True)
    w = bt.tensor(
        rng.standard_normal((Vp, K)) * wscale, dtype=dtype, device=device, requires_grad=True
    )
    return x, w


def _check(got, ref, tol, what):
    scale = max(np.abs(ref).max(initial=0), 1e-6)
    err = np.abs(np.asarray(got, dtype=np.float64) - ref).max(initial=0) / scale
    assert err <= tol, f"{what}: max error {err:.3g} relative to max |ref| {scale:.3g}"


# ---- CPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(bt.float64, 1e-12), (bt.float32, 2e-5)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("V, Vp", [(37, 37), (37, 48)])
@pytest.mark.parametrize("chunk", [None, 1, 5, 29, 40])
def test_matches_float64_reference(rng, dtype, tol, reduction, V, Vp, chunk):
    N, K = 29, 12
    x, w = _leaves(rng, N, K, Vp, dtype)
    t = _targets(rng, N, V)
    loss = bt.linear_cross_entropy(
        x, w, bt.tensor(t), reduction=reduction, num_classes=V, chunk_size=chunk
    )
    cot = 2.5
    (loss * cot).backward()
    ref = _reference(f64(x), f64(w), t, V, -100, reduction, cot)
    assert loss.dtype == dtype and loss.shape == ()
    _check(f64(loss), ref[0], tol, "loss")
    _check(f64(x.grad), ref[1], tol, "dx")
    _check(f64(w.grad), ref[2], tol, "dw")
    if Vp > V:  # the padding rows of the weight get exactly zero
        assert np.all(f64(w.grad)[V:] == 0)


def test_leading_dims_and_ignore_index(rng):
    B, T, K, V = 3, 7, 8, 19
    x = bt.tensor(rng.standard_normal((B, T, K)), requires_grad=True)
    w = bt.tensor(rng.standard_normal((V, K)), requires_grad=True)
    t = _targets(rng, B * T, V, ii=-1).reshape(B, T)
    loss = bt.linear_cross_entropy(x, w, bt.tensor(t), ignore_index=-1, chunk_size=4)
    loss.backward()
    ref = _reference(f64(x).reshape(-1, K), f64(w), t.reshape(-1), V, -1, "mean")
    _check(f64(loss), ref[0], 2e-5, "loss")
    assert x.grad.shape == (B, T, K)
    _check(f64(x.grad).reshape(-1, K), ref[1], 2e-5, "dx")
    _check(f64(w.grad), ref[2], 2e-5, "dw")


def test_matches_linear_plus_cross_entropy(rng):
    N, K, V = 50, 16, 31
    x, w = _leaves(rng, N, K, V, bt.float32)
    t = bt.tensor(_targets(rng, N, V))
    loss = bt.linear_cross_entropy(x, w, t, chunk_size=7)
    loss.backward()
    x2 = bt.tensor(x.detach().numpy(), requires_grad=True)
    w2 = bt.tensor(w.detach().numpy(), requires_grad=True)
    ref = bt.cross_entropy(bt.linear(x2, w2), t)
    ref.backward()
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), x2.grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w.grad.numpy(), w2.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_gradcheck(rng):
    N, K, V = 9, 5, 11
    x, w = _leaves(rng, N, K, V + 2, bt.float64)
    t = bt.tensor(_targets(rng, N, V))

    def f(a, b):
        return bt.linear_cross_entropy(a, b, t, num_classes=V, chunk_size=4)

    assert bt.gradcheck(f, [x, w])


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
def test_16bit_on_cpu(rng, dtype):
    N, K, V = 33, 16, 40
    x, w = _leaves(rng, N, K, V, dtype)
    t = _targets(rng, N, V)
    loss = bt.linear_cross_entropy(x, w, bt.tensor(t), chunk_size=8)
    loss.backward()
    assert loss.dtype == bt.float32  # the loss of 16-bit inputs is float32
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    ref = _reference(f64(x), f64(w), t, V, -100, "mean")
    tol = 2e-2 if dtype == bt.bfloat16 else 4e-3
    _check(f64(loss), ref[0], tol, "loss")
    _check(f64(x.grad), ref[1], tol, "dx")
    _check(f64(w.grad), ref[2], tol, "dw")


def test_gradients_only_where_asked(rng):
    N, K, V = 12, 6, 9
    t = bt.tensor(_targets(rng, N, V))
    xd = rng.standard_normal((N, K))
    wd = rng.standard_normal((V, K))
    ref = _reference(xd, wd, t.numpy(), V, -100, "mean")
    x = bt.tensor(xd, requires_grad=True)
    bt.linear_cross_entropy(x, bt.tensor(wd), t, chunk_size=5).backward()
    _check(f64(x.grad), ref[1], 1e-12, "dx only")
    w = bt.tensor(wd, requires_grad=True)
    bt.linear_cross_entropy(bt.tensor(xd), w, t, chunk_size=5).backward()
    _check(f64(w.grad), ref[2], 1e-12, "dw only")
    with bt.no_grad():  # the loss alone (no gradient work)
        loss = bt.linear_cross_entropy(bt.tensor(xd, requires_grad=True), w, t, chunk_size=5)
    assert not loss.requires_grad
    _check(f64(loss), ref[0], 1e-12, "no_grad loss")


def test_retain_graph_backward_twice(rng):
    N, K, V = 10, 4, 7
    x, w = _leaves(rng, N, K, V, bt.float64)
    t = bt.tensor(_targets(rng, N, V, frac_ignored=0))
    loss = bt.linear_cross_entropy(x, w, t, chunk_size=3)
    loss.backward(retain_graph=True)
    g1 = f64(x.grad).copy(), f64(w.grad).copy()
    loss.backward()
    np.testing.assert_allclose(f64(x.grad), 2 * g1[0], rtol=1e-14)
    np.testing.assert_allclose(f64(w.grad), 2 * g1[1], rtol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_last_backward_scales_in_place_to_the_same_bits(rng, device):
    """The last backward scales the saved gradients in place (one multi-tensor kernel); a
    retained graph multiplies instead: the same bits.  With a float32 master behind a bf16 cast,
    dW reaches it in float32 unrounded (Note [cached casts]): its bf16 rounding is the bf16
    weight's gradient."""
    N, K, V = 37, 16, 29
    xd, wd = rng.standard_normal((N, K)), rng.standard_normal((V, K)) * 0.3
    t = bt.tensor(_targets(rng, N, V), device=device)
    dw = {}
    for master in (bt.bfloat16, bt.float32):
        grads = []
        for retain in (False, True):
            x = bt.tensor(xd, dtype=bt.bfloat16, device=device, requires_grad=True)
            w = bt.tensor(wd, dtype=master, device=device, requires_grad=True)
            loss = bt.linear_cross_entropy(x, w.to(bt.bfloat16), t, chunk_size=16)
            (loss * 3.0).backward(retain_graph=retain)
            assert w.grad.dtype == master
            grads.append((f64(x.grad), f64(w.grad)))
        for a, b in zip(grads[0], grads[1], strict=True):
            assert np.array_equal(a, b)
        dw[master] = w.grad
    rounded = f64(dw[bt.float32].to(bt.bfloat16))
    assert np.array_equal(rounded, f64(dw[bt.bfloat16]))
    assert not np.array_equal(rounded, f64(dw[bt.float32])), "dW was rounded to bf16"


def test_all_ignored_and_empty(rng):
    x, w = _leaves(rng, 4, 3, 5, bt.float64)
    t = bt.tensor(np.full(4, -100))
    mean = bt.linear_cross_entropy(x, w, t)
    assert np.isnan(mean.item())  # 0 / 0, as cross_entropy
    mean.backward()  # no row counts: zero gradients, as PyTorch's
    assert np.all(f64(x.grad) == 0) and np.all(f64(w.grad) == 0)
    x.grad, w.grad = None, None
    total = bt.linear_cross_entropy(x, w, t, reduction="sum")
    total.backward()
    assert total.item() == 0 and np.all(f64(x.grad) == 0) and np.all(f64(w.grad) == 0)
    e, we = _leaves(rng, 0, 3, 5, bt.float32)
    s = bt.linear_cross_entropy(e, we, bt.tensor(np.zeros(0, dtype=np.int64)), reduction="sum")
    s.backward()
    assert s.item() == 0 and np.all(we.grad.numpy() == 0)


def test_bad_input_raises_clearly(rng):
    x = bt.zeros(4, 3)
    w = bt.zeros(5, 3)
    t = bt.tensor(np.array([0, 1, 2, 3]))
    lce = bt.linear_cross_entropy
    with pytest.raises(ValueError, match=r"\[linear_cross_entropy\].*\(4, 3\).*\(5, 2\)"):
        lce(x, bt.zeros(5, 2), t)
    with pytest.raises(ValueError, match=r"\[linear_cross_entropy\] target has shape \(3,\)"):
        lce(x, w, bt.tensor(np.array([0, 1, 2])))
    with pytest.raises(TypeError, match=r"\[linear_cross_entropy\] target must hold integer"):
        lce(x, w, bt.zeros(4))
    with pytest.raises(TypeError, match=r"\[linear_cross_entropy\] expects floating"):
        lce(bt.zeros(4, 3, dtype=bt.int64), bt.zeros(5, 3, dtype=bt.int64), t)
    with pytest.raises(ValueError, match=r"reduction must be 'mean' or 'sum', got 'none'"):
        lce(x, w, t, reduction="none")
    with pytest.raises(ValueError, match=r"num_classes 6 must be in \[1, 5\]"):
        lce(x, w, t, num_classes=6)
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1, got 0"):
        lce(x, w, t, chunk_size=0)
    # a bad target is named by its row in the whole batch, not in its chunk
    bad = np.array([0, 1, 2, 4])
    with pytest.raises(IndexError, match=r"target 4 \(row 3\) is out of range for 4 classes"):
        lce(x, w, bt.tensor(bad), num_classes=4, chunk_size=2)


# ---- CUDA --------------------------------------------------------------------------------------
GPU_TOL = {bt.float32: 2e-5, bt.bfloat16: 1.5e-2, bt.float16: 3e-3}


def _poison_pool(nbytes: int) -> None:
    """Fills (and frees) pool memory with NaN, so an element a kernel fails to write shows up."""
    p = bt.full((max(1, nbytes // 4),), float("nan"), dtype=bt.float32, device="cuda")
    bt.cuda.synchronize()
    del p


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("chunk", [None, 257, 2000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ce_kernels", ["fused", "two"])
def test_cuda_matches_float64_reference(rng, monkeypatch, dtype, chunk, reduction, ce_kernels):
    # "fused": each chunk's cross-entropy forward and backward in one kernel (v4, the default);
    # "two": the forward and backward kernels (BT_CUDA_CE_FUSED=0)
    monkeypatch.setenv("BT_CUDA_CE_FUSED", "1" if ce_kernels == "fused" else "0")
    N, K = 1037, 64
    xd = rng.standard_normal((N, K))
    wd = rng.standard_normal((VP_GPT, K)) * 0.3
    wd[V_GPT:] = 0  # padding rows, as GPT-2's padded vocabulary
    x = bt.tensor(xd, dtype=dtype, device="cuda", requires_grad=True)
    w = bt.tensor(wd, dtype=dtype, device="cuda", requires_grad=True)
    t = _targets(rng, N, V_GPT)
    _poison_pool(4 * N * VP_GPT)
    loss = bt.linear_cross_entropy(
        x,
        w,
        bt.tensor(t, device="cuda"),
        reduction=reduction,
        num_classes=V_GPT,
        chunk_size=chunk,
    )
    loss.backward()
    ref = _reference(f64(x), f64(w), t, V_GPT, -100, reduction)
    tol = GPU_TOL[dtype]
    _check(f64(loss), ref[0], tol, "loss")
    _check(f64(x.grad), ref[1], tol, "dx")
    _check(f64(w.grad), ref[2], tol, "dw")
    assert np.all(f64(w.grad)[V_GPT:] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_cuda_matches_linear_plus_cross_entropy(rng, dtype):
    N, K = 777, 128
    xd = rng.standard_normal((N, K))
    wd = rng.standard_normal((VP_GPT, K)) * 0.1
    t = bt.tensor(_targets(rng, N, V_GPT), device="cuda")
    grads = []
    for fused in (True, False):
        x = bt.tensor(xd, dtype=dtype, device="cuda", requires_grad=True)
        w = bt.tensor(wd, dtype=dtype, device="cuda", requires_grad=True)
        if fused:
            loss = bt.linear_cross_entropy(x, w, t, num_classes=V_GPT, chunk_size=300)
        else:
            logits = bt.linear(x, w).narrow(1, 0, V_GPT)
            loss = bt.cross_entropy(logits, t, loss_dtype=bt.float32)
            del logits
        loss.backward()
        grads.append((f64(loss), f64(x.grad), f64(w.grad)))
    tol = 1e-5 if dtype == bt.float32 else 1e-2
    for i, what in enumerate(("loss", "dx", "dw")):
        _check(grads[0][i], grads[1][i], tol, what)


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("V, Vp", [(1000, 1000), (997, 1024), (8, 8), (50257, 50304)])
def test_cuda_fused_ce_kernel_matches_the_two_kernels(rng, monkeypatch, dtype, V, Vp):
    """v4 (one kernel) against the forward + backward kernels: the same loss to float32
    rounding, gradients within a rounding step of the 16-bit dlogits (unpadded, padded and
    tiny vocabularies; ignored rows)."""
    N, K = 300, 32
    xd, wd = rng.standard_normal((N, K)), rng.standard_normal((Vp, K)) * 0.3
    wd[V:] = 0
    t = bt.tensor(_targets(rng, N, V), device="cuda")
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("BT_CUDA_CE_FUSED", flag)
        x = bt.tensor(xd, dtype=dtype, device="cuda", requires_grad=True)
        w = bt.tensor(wd, dtype=dtype, device="cuda", requires_grad=True)
        _poison_pool(4 * N * Vp)
        loss = bt.linear_cross_entropy(x, w, t, reduction="sum", num_classes=V, chunk_size=128)
        loss.backward()
        out[flag] = (f64(loss), f64(x.grad), f64(w.grad))
    tol = {bt.float32: 1e-5, bt.bfloat16: 1e-2, bt.float16: 2e-3}[dtype]
    for i, what in enumerate(("loss", "dx", "dw")):
        _check(out["1"][i], out["0"][i], tol, what)
    assert np.all(out["1"][2][V:] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
def test_cuda_deterministic(rng):
    N, K = 600, 64
    xd, wd = rng.standard_normal((N, K)), rng.standard_normal((VP_GPT, K)) * 0.1
    t = bt.tensor(_targets(rng, N, V_GPT), device="cuda")
    runs = []
    for _ in range(2):
        x = bt.tensor(xd, dtype=bt.bfloat16, device="cuda", requires_grad=True)
        w = bt.tensor(wd, dtype=bt.bfloat16, device="cuda", requires_grad=True)
        loss = bt.linear_cross_entropy(x, w, t, num_classes=V_GPT, chunk_size=128)
        loss.backward()
        runs.append((f64(loss), f64(x.grad), f64(w.grad)))
    for a, b in zip(runs[0], runs[1]):
        assert np.array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_cuda_peak_memory_is_one_chunk_of_logits(rng, dtype):
    # forward + backward of the head: the fused op's peak above its start is a chunk of logits
    # plus the gradients; linear + cross_entropy holds all (N, Vp) logits
    N, K, rows = 4096, 64, 512
    item = 4 if dtype == bt.float32 else 2
    xd, wd = rng.standard_normal((N, K)), rng.standard_normal((VP_GPT, K)) * 0.1
    t = bt.tensor(_targets(rng, N, V_GPT), device="cuda")
    peaks = {}
    for fused in (True, False):
        x = bt.tensor(xd, dtype=dtype, device="cuda", requires_grad=True)
        w = bt.tensor(wd, dtype=dtype, device="cuda", requires_grad=True)
        bt.cuda.synchronize()
        start = bt.cuda.memory_allocated()
        bt.cuda.reset_peak_memory_stats()
        if fused:
            loss = bt.linear_cross_entropy(x, w, t, num_classes=V_GPT, chunk_size=rows)
        else:
            loss = bt.cross_entropy(bt.linear(x, w).narrow(1, 0, V_GPT), t, loss_dtype=bt.float32)
        loss.backward()
        bt.cuda.synchronize()
        peaks[fused] = bt.cuda.max_memory_allocated() - start
        del x, w, loss
    logits = N * VP_GPT * item
    chunk = rows * VP_GPT * item
    grads = 2 * (N * K * item + VP_GPT * K * 4)  # saved dx, dW (fp32) and the scaled copies
    assert peaks[False] >= logits, peaks
    assert peaks[True] <= chunk + grads + (8 << 20), (peaks, chunk, grads)


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("ce_kernels", ["fused", "two"])
def test_cuda_target_out_of_range_raises(monkeypatch, ce_kernels):
    monkeypatch.setenv("BT_CUDA_CE_FUSED", "1" if ce_kernels == "fused" else "0")
    # a target in the padding (>= num_classes) or negative: IndexError at the next sync, as
    # cross_entropy's kernels report it; the next good call is unaffected
    x = bt.zeros((6, 4), device="cuda", requires_grad=True)
    w = bt.zeros((16, 4), device="cuda", requires_grad=True)
    bad = bt.tensor(np.array([0, 1, 12, 3, -100, 2]), device="cuda")
    loss = bt.linear_cross_entropy(x, w, bad, num_classes=10, chunk_size=2)
    with pytest.raises(IndexError, match="cross_entropy"):
        loss.item()
    neg = bt.tensor(np.array([0, -3, 1, 2, 3, 4]), device="cuda")
    with pytest.raises(IndexError, match="cross_entropy"):
        bt.linear_cross_entropy(x, w, neg, num_classes=10).item()
    ok = bt.linear_cross_entropy(x, w, bt.tensor(np.arange(6), device="cuda"), num_classes=10)
    assert ok.item() == pytest.approx(np.log(10), rel=1e-6)
