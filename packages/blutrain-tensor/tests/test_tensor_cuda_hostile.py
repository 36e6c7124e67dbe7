"""GPU tests of issue 37's fixes where the CUDA backend has its own code: side tensors (bias,
weight, residual, target) that are strided or expanded, exact integer scalars and ranges,
relu / log_softmax / var values, embedding's negative indices (a device-side error), huge
expanded views, read-only memory; each against the CPU backend or numpy."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

DTYPES = [bt.float32, bt.bfloat16, bt.float16]
TOL = {bt.float32: 2e-5, bt.bfloat16: 2e-2, bt.float16: 4e-3}


def _np(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().to(bt.float64).numpy()


def _close(got: bt.Tensor, want: bt.Tensor, dtype, k: float = 1) -> None:
    g, w = _np(got), _np(want)
    assert g.shape == w.shape
    scale = np.abs(w).max(initial=0) or 1.0
    assert np.abs(g - w).max(initial=0) / scale <= TOL[dtype] * k


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_strided_and_expanded_bias(rng, dtype):
    x = bt.tensor(rng.standard_normal((5, 8)), dtype=dtype).cuda()
    w = bt.tensor(rng.standard_normal((6, 8)), dtype=dtype).cuda()
    wide = bt.tensor(rng.standard_normal(12), dtype=dtype).cuda()
    _close(bt.linear(x, w, wide[::2]), bt.linear(x, w, wide[::2].contiguous()), dtype)
    one = bt.tensor([0.5], dtype=dtype).cuda().expand(6)
    _close(bt.linear(x, w, one), bt.linear(x, w) + 0.5, dtype, 4)
    # the same on the CPU: one shared place (Primitive::contiguous_input) for both backends
    _close(bt.linear(x, w, wide[::2]), bt.linear(x.cpu(), w.cpu(), wide.cpu()[::2]), dtype, 4)


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
def test_fused_ops_with_strided_side_tensors(rng, dtype):
    x = bt.tensor(rng.standard_normal((2, 16, 64)), dtype=dtype).cuda()
    w = bt.tensor(rng.standard_normal((192, 64)) * 0.1, dtype=dtype).cuda()
    b = bt.tensor(rng.standard_normal(384), dtype=dtype).cuda()
    _close(
        bt.qkv_attention(x, w, b[::2], 1, is_causal=True),
        bt.qkv_attention(x, w, b[::2].contiguous(), 1, is_causal=True),
        dtype,
    )
    x2 = x.reshape(32, 64)
    w1 = bt.tensor(rng.standard_normal((48, 64)) * 0.1, dtype=dtype).cuda()
    w2 = bt.tensor(rng.standard_normal((64, 48)) * 0.1, dtype=dtype).cuda()
    b1, b2 = (bt.tensor(rng.standard_normal(2 * n), dtype=dtype).cuda()[::2] for n in (48, 64))
    _close(
        bt.linear_gelu_linear(x2, w1, b1, w2, b2),
        bt.linear_gelu_linear(x2, w1, b1.contiguous(), w2, b2.contiguous()),
        dtype,
    )
    _close(bt.linear_gelu(x2, w1, b1), bt.linear_gelu(x2, w1, b1.contiguous()), dtype)
    r = bt.tensor(rng.standard_normal((64, 32)), dtype=dtype).cuda().T
    g, bn = (bt.tensor(rng.standard_normal(128), dtype=dtype).cuda()[::2] for _ in range(2))
    s, y = bt.add_layer_norm(x2, r, g, bn)
    s2, y2 = bt.add_layer_norm(x2, r.contiguous(), g.contiguous(), bn.contiguous())
    _close(s, s2, dtype)
    _close(y, y2, dtype)
    t = bt.randint(0, 10, (64,)).cuda()[::2]
    wh = bt.tensor(rng.standard_normal((10, 64)), dtype=dtype).cuda()
    _close(
        bt.linear_cross_entropy(x2, wh, t),
        bt.linear_cross_entropy(x2, wh, t.contiguous()),
        dtype,
    )


def test_exact_ints_on_the_device():
    big = 2**53 + 1
    assert bt.arange(2**62, 2**62 + 5, device="cuda").tolist() == [2**62 + i for i in range(5)]
    assert bt.full((3,), big, device="cuda").tolist() == [big] * 3
    t = bt.tensor([big, 2**53]).cuda()
    assert (t == big).tolist() == [True, False]
    assert bt.zeros(2, dtype=bt.int64, device="cuda").fill_(big).tolist() == [big, big]
    m = bt.tensor([True, False]).cuda()
    assert bt.zeros(2, dtype=bt.int64, device="cuda").masked_fill(m, big).tolist() == [big, 0]
    v = bt.randint(2**62, 2**62 + 3, (256,), device="cuda").tolist()
    assert set(v) == {2**62, 2**62 + 1, 2**62 + 2}
    bt.manual_seed(7)
    a = bt.randint(-5, 5, (1000,), device="cuda")
    bt.manual_seed(7)
    assert a.tolist() == bt.randint(-5, 5, (1000,)).tolist()  # bit for bit with the CPU


def test_values_on_the_device(rng):
    r = bt.tensor([float("nan"), -1.0, 2.0]).cuda().relu()
    assert np.isnan(r[0].item()) and r[1:].tolist() == [0.0, 2.0]
    x = bt.tensor([[1e30, 1e30, 1e30], [1.0, 2.0, 3.0]]).cuda()
    np.testing.assert_allclose(
        _np(bt.log_softmax(x, -1)), _np(bt.log_softmax(x.cpu(), -1)), rtol=1e-6
    )
    assert abs(bt.log_softmax(x, -1)[0, 0].item() + np.log(3)) < 1e-6
    v = bt.tensor([[1.0, 2.0]]).cuda()
    assert v.var(dim=(0, 1), correction=2).item() == float("inf")  # (PyTorch's: dof >= 0)
    assert np.isnan(bt.zeros(3, 0).cuda().var(correction=-1).item())
    a = bt.arange(4.0).reshape(2, 2).cuda()
    a.copy_(a.T)
    assert a.tolist() == [[0.0, 2.0], [1.0, 3.0]]


def test_embedding_negative_index_raises_at_the_synchronisation():
    w = bt.ones(3, 2).cuda()
    out = bt.embedding(bt.tensor([-1]).cuda(), w)
    with pytest.raises(IndexError, match=r"^\[embedding\] index -1 is out of range"):
        out.cpu()
    assert bt.index_select(w, 0, bt.tensor([-1]).cuda()).cpu().shape == (1, 2)


def test_huge_expanded_views_on_the_device():
    x = bt.arange(3.0, device="cuda").reshape(3, 1).expand(3, 2**40)
    assert x[bt.tensor([2, 0]).cuda(), 2**39].tolist() == [2.0, 0.0]
    assert bt.ones(1, device="cuda").expand(2**40)[bt.tensor([5]).cuda()].tolist() == [1.0]
    v = bt.ones(1, device="cuda").expand(2**40)
    assert (v @ v).item() == float(2**40)
    assert repr(v).startswith("tensor(<on cuda:0>, shape=(1099511627776,)")


def test_read_only_memory_stays_read_only_on_the_way_to_the_device():
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    t = bt.from_numpy(a)
    c = t.cuda()  # a copy: writable
    c.add_(1)
    assert c.tolist() == [1.0, 1.0, 1.0] and a.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"^\[add_\] the tensor is read-only"):
        t.add_(1)


def test_fill_with_a_0d_value_on_the_other_device():
    """The GPU fuzz run's crash: a CPU tensor filled from a 0-d CUDA value read device memory on
    the host (SIGSEGV). The value is moved to where the tensor lives, both ways."""
    c = bt.zeros((3, 3, 5), dtype=bt.bfloat16)
    c.fill_(bt.tensor(True, device="cuda"))
    assert c.float().numpy().tolist() == np.ones((3, 3, 5)).tolist()
    g = bt.zeros(4, device="cuda")
    g.fill_(bt.tensor(2.5))
    assert g.tolist() == [2.5] * 4


def test_scatter_add_into_an_empty_dim_raises_on_the_device():
    """The GPU fuzz run accepted it: the kernel skips an empty base and never saw the index."""
    with pytest.raises(IndexError, match=r"^\[scatter_add\] index is out of range"):
        bt.zeros(0, device="cuda").scatter_add(
            0, bt.tensor([3, 1]).cuda(), bt.ones(2, device="cuda")
        )


# ---- GPU fuzz run of session 2026-12-04 (seed 1966040943) and its memcheck run ---------------
def test_device_errors_name_the_op_the_user_called():
    """Case 2199: remainder_ by an integer 0 said [remainder] (the kernel's primitive); the record
    now carries the op the user called at launch (Note [device errors name the op the user
    called]), whatever op syncs later."""
    t = bt.tensor([[5, 7, 9, 11]] * 2, dtype=bt.int32).cuda()[::2]
    t.remainder_(bt.tensor([[0, 2, 0, 4]], dtype=bt.int32).cuda())
    with pytest.raises(ZeroDivisionError, match=r"^\[remainder_\] integer division by zero"):
        t.cpu()
    assert t.cpu().tolist() == [[0, 1, 0, 3]]  # (the record was cleared; zero elements are 0)
    u = bt.tensor([5, 6], dtype=bt.int64).cuda()
    z = bt.tensor([0, 1], dtype=bt.int64).cuda()
    cases = [
        (lambda: u % z, "remainder"),
        (lambda: u // z, "floor_divide"),
        (lambda: bt.floor_divide(u, z), "floor_divide"),
        (lambda: u.clone().floor_divide_(z), "floor_divide_"),
    ]
    for fn, name in cases:
        r = fn()
        with pytest.raises(ZeroDivisionError, match=rf"^\[{name}\] integer division by zero"):
            (r + 1).sum().item()  # synchronised inside add / sum / item: still the launcher's op
    w = bt.ones(3, 2).cuda()
    bt.index_select(w, 0, bt.tensor([0, 3]).cuda())
    with pytest.raises(IndexError, match=r"^\[index_select\] index 3 is out of range .* size 3"):
        bt.cuda.synchronize()
    bt.embedding(bt.tensor([4]).cuda(), w)
    with pytest.raises(IndexError, match=r"^\[embedding\] index 4 is out of range .* size 3"):
        bt.cuda.synchronize()
    bt.zeros(5).cuda().gather(0, bt.tensor([7]).cuda())
    with pytest.raises(IndexError, match=r"^\[gather\] index 7 "):
        bt.cuda.synchronize()
    bt.cuda.synchronize()  # nothing left behind


def test_getitem_on_the_device_names_getitem_and_the_index():
    """Case 2288: t[(None, idx)] on a (0,) CUDA tensor said [index_select] and index
    4611686018427387904 (2**62, the sentinel that keeps the gather in bounds); the CPU says
    [getitem] and the index."""
    t = bt.zeros(0, dtype=bt.int64).cuda()
    with pytest.raises(IndexError, match=r"^\[getitem\] index 3 is out of range for dim 1 of size"):
        t.cpu()[(None, bt.tensor([3, 1, 4]))]
    r = t[(None, bt.tensor([3, 1, 4]).cuda())]
    with pytest.raises(IndexError, match=r"^\[getitem\] index 3 is out of range .* size 0 "):
        r.cpu()
    x = bt.arange(12.0).reshape(3, 4).cuda()
    r = x[bt.tensor([0, 2]).cuda(), bt.tensor([1, -9]).cuda()]
    with pytest.raises(IndexError, match=r"^\[getitem\] index -9 is out of range .* size 4 "):
        bt.cuda.synchronize()
    x[bt.tensor([5]).cuda()]  # the first component this time
    with pytest.raises(IndexError, match=r"^\[getitem\] index 5 is out of range .* size 3 "):
        bt.cuda.synchronize()
    assert x[bt.tensor([2, -1]).cuda(), bt.tensor([-4, 3]).cuda()].tolist() == [8.0, 11.0]
    huge = bt.ones(1, device="cuda").expand(2**40)
    huge[bt.tensor([2**40]).cuda()]
    with pytest.raises(IndexError, match=rf"^\[getitem\] index {2**40} is out of range"):
        bt.cuda.synchronize()


SPECIAL_ROWS = [
    [float("inf"), 1.0],
    [1.0, float("inf"), 2.0],
    [float("inf"), float("inf")],
    [float("inf"), float("-inf")],
    [float("-inf"), float("-inf")],
    [float("nan"), 1.0],
    [1.0, float("nan")],
    [float("-inf"), float("nan")],
    [float("-inf"), 3.0],
    [1e30, -1e30],
]


def _special_batch(C: int, rng) -> np.ndarray:
    """Rows of C values: each SPECIAL_ROWS pattern placed at random columns of a normal row."""
    rows = []
    for pat in SPECIAL_ROWS:
        for _ in range(3):
            r = rng.standard_normal(C)
            if all(np.isneginf(pat)):
                r[:] = -np.inf
            cols = rng.choice(C, size=min(len(pat), C), replace=False)
            r[cols] = pat[: len(cols)]
            rows.append(r)
    return np.array(rows)


def _same_special(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("version", ["", "2"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.float64, bt.bfloat16])
@pytest.mark.parametrize("C", [1, 2, 3, 64, 1000, 4096])
def test_softmax_special_values_match_the_cpu(rng, monkeypatch, version, dtype, C):
    """Case 242 (log_softmax of a column with +inf): CUDA gave 0 / -inf where the CPU, numpy and
    PyTorch give NaN (the online max/sum's "+1" for a new maximum hid exp(inf - inf); a NaN met
    while the running max was -inf was dropped by the merge).  Note [online softmax special
    values]; v2 (BT_CUDA_NN_VERSION=2) and the default kernels."""
    if version:
        monkeypatch.setenv("BT_CUDA_NN_VERSION", version)
    x = bt.tensor(_special_batch(C, rng), dtype=dtype)
    tol = 1e-12 if dtype == bt.float64 else TOL[dtype]
    for lg in (False, True):
        f = bt.log_softmax if lg else bt.softmax
        _same_special(_np(f(x.cuda(), -1)), _np(f(x, -1)), tol)
        _same_special(_np(f(x.cuda().T, 0)), _np(f(x.T, 0)), tol)  # (a non-last dim)


@pytest.mark.parametrize("version", ["", "2"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.float64, bt.bfloat16])
@pytest.mark.parametrize("C", [2, 3, 64, 50257])
def test_cross_entropy_special_values_match_the_cpu(rng, monkeypatch, version, dtype, C):
    if version:
        monkeypatch.setenv("BT_CUDA_NN_VERSION", version)
    logits = bt.tensor(_special_batch(C, rng), dtype=dtype)
    tgt = bt.tensor(rng.integers(0, C, logits.shape[0]))
    tol = 1e-12 if dtype == bt.float64 else TOL[dtype] * 4
    for ls in (0.0, 0.1):
        want = bt.cross_entropy(logits, tgt, reduction="none", label_smoothing=ls)
        got = bt.cross_entropy(logits.cuda(), tgt.cuda(), reduction="none", label_smoothing=ls)
        _same_special(_np(got), _np(want), tol)


def _huge_rows(C: int, rng) -> np.ndarray:
    """Rows whose max is past the log2-unit kernels' range (Note [huge logits]), and ones near
    its 2**20 threshold: +-1e30 pairs in a normal row, offsets of +-1e7 and +-1e6 (a softmax
    that is not one-hot), a row scaled by 1e8, one of -1e30 throughout with a normal column."""
    rows = []
    for _ in range(2):
        r = rng.standard_normal(C)
        r[rng.choice(C, size=min(2, C), replace=False)] = [1e30, -1e30][: min(2, C)]
        rows.append(r)
        rows += [1e7 + 3 * rng.standard_normal(C), -1e7 + 3 * rng.standard_normal(C)]
        rows += [2.0**20 + rng.standard_normal(C), 2.0**20 - 2 + rng.standard_normal(C)]
        rows += [1e8 * rng.standard_normal(C)]
        r = np.full(C, -1e30)
        r[rng.integers(C)] = rng.standard_normal()
        rows.append(r)
    return np.array(rows)


@pytest.mark.parametrize("version", ["", "2"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("C", [2, 3, 64, 4099])
def test_cross_entropy_of_huge_logits_matches_the_cpu(rng, monkeypatch, version, dtype, C):
    """A row [1e30, -1e30] gave a NaN or -inf loss on CUDA (the log2-unit sum's FFMA residual
    overflowed ex2) and its gradient was inf / 0; Note [huge logits].  Loss and gradient against
    the CPU, label smoothing off and on, default kernels (v3) and v2."""
    if version:
        monkeypatch.setenv("BT_CUDA_NN_VERSION", version)
    xd = _huge_rows(C, rng)
    tgt = rng.integers(0, C, xd.shape[0])
    tol = TOL[dtype] * 4
    for ls in (0.0, 0.1):
        out = []
        for dev in ("cpu", "cuda"):
            x = bt.tensor(xd, dtype=dtype, device=dev, requires_grad=True)
            loss = bt.cross_entropy(
                x, bt.tensor(tgt, device=dev), reduction="none", label_smoothing=ls
            )
            loss.sum().backward()
            out.append((_np(loss), _np(x.grad)))
        (want, want_g), (got, got_g) = out
        assert np.isfinite(want).all() and np.isfinite(want_g).all()
        assert np.isfinite(got).all() and np.isfinite(got_g).all()
        # label smoothing's mean logit is summed in float on the device (double on the CPU):
        # at |x| ~ 1e7 its rounding is ~1e-6 of the row's magnitude
        # (per row: np.testing.assert_allclose formats atol with ':g' before comparing, so an
        # array atol raised TypeError on every call, equal arrays included)
        atol = tol + (1e-6 * np.abs(_np(bt.tensor(xd, dtype=dtype))).max(1) if ls else 0)
        err = np.abs(got - want)
        bad = ~(err <= atol + tol * np.abs(want))
        assert not bad.any(), (ls, np.flatnonzero(bad), got[bad], want[bad])
        np.testing.assert_allclose(got_g, want_g, rtol=0, atol=tol)


def _huge_classifier(rng, dtype, fused, monkeypatch):
    monkeypatch.setenv("BT_CUDA_CE_FUSED", fused)
    N, K, V = 96, 8, 1000
    xd = rng.standard_normal((N, K))
    wd = rng.standard_normal((V, K))
    wd[: V // 2] *= 1e28
    wd[V // 2 :] *= 3e5
    xd[N // 2 :, :] = np.abs(xd[N // 2 :, :])
    wd[: V // 2, :] = -np.abs(wd[: V // 2, :])  # rows N/2.. see only the ~3e6 classes win
    t = rng.integers(0, V, N)
    x = bt.tensor(xd, dtype=dtype, device="cuda", requires_grad=True)
    w = bt.tensor(wd, dtype=dtype, device="cuda", requires_grad=True)
    loss = bt.linear_cross_entropy(x, w, bt.tensor(t).cuda(), reduction="sum", chunk_size=32)
    loss.backward()
    return (_np(x), _np(w), t), [_np(a) for a in (loss, x.grad, w.grad)]


def test_linear_cross_entropy_of_huge_logits(rng, monkeypatch):
    """The chunked classifier's one-kernel forward + backward (v4, BT_CUDA_CE_FUSED=1) and its
    two kernels on logits up to ~1e29 and ~3e6 (Note [huge logits]): float32 loss, dx and dw
    against float64 (the spread between classes makes each softmax one-hot, so a wrong row
    cannot hide in rounding); bfloat16: the one kernel against the two."""
    seed = int(rng.integers(2**31))
    for fused in ("1", "0"):
        (xd, wd, t), got = _huge_classifier(
            np.random.default_rng(seed), bt.float32, fused, monkeypatch
        )
        N = len(t)
        z = xd @ wd.T
        lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
        d = np.exp(z - lse[:, None])
        d[np.arange(N), t] -= 1
        want = [(lse - z[np.arange(N), t]).sum(), d @ wd, d.T @ xd]
        for g, w_, what in zip(got, want, ("loss", "dx", "dw")):
            assert np.isfinite(g).all(), (fused, what)
            err = np.abs(g - w_).max() / np.abs(w_).max()
            assert err <= 1e-4, (fused, what, err)
    one = _huge_classifier(np.random.default_rng(seed), bt.bfloat16, "1", monkeypatch)[1]
    two = _huge_classifier(np.random.default_rng(seed), bt.bfloat16, "0", monkeypatch)[1]
    for a, b, what in zip(one, two, ("loss", "dx", "dw")):
        assert np.isfinite(a).all(), what
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), what


def test_a_huge_request_fails_without_asking_cuda():
    """The memcheck run's findings on 2**40-element views: materialising one asked cudaMalloc
    for 4-8 TiB twice (and flushed the cache in between); compute-sanitizer reports each failed
    call.  Now the pool refuses a request above the device's memory at once (Note [Beyond
    capacity], blutrain-alloc), with its statistics; index_select of such a view copies nothing."""
    import blutrain.alloc as ba

    bt.ones(1000, device="cuda")  # something cached
    before = ba.stats("cuda:0")
    huge = bt.ones(1, device="cuda").expand(2**40)
    huge_index = bt.zeros(1, dtype=bt.int64, device="cuda").expand(2**40)
    for fn in (
        huge.clone,
        lambda: huge + 1,
        lambda: bt.index_select(bt.ones(3, device="cuda"), 0, huge_index),
    ):
        with pytest.raises((RuntimeError, MemoryError), match="out of memory") as info:
            fn()
        assert "Capacity" in str(info.value) and "reserved" in str(info.value)
    after = ba.stats("cuda:0")
    for k in ("system_alloc_count", "cache_flushes", "reserved_bytes"):
        assert after[k] == before[k], k
    assert huge.index_select(0, bt.tensor([0, 2**40 - 1], dtype=bt.int64).cuda()).tolist() == [
        1.0,
        1.0,
    ]
    ones = bt.ones(1, dtype=bt.int64, device="cuda").expand(2**40)
    assert bt.index_select(ones, 0, bt.tensor([-1]).cuda()).tolist() == [1]


def test_a_0d_cpu_tensor_is_a_number_next_to_cuda_tensors():
    """PyTorch's rule (Note [a 0-d CPU tensor meets a CUDA tensor]): the value is read on the
    host; promotion is by dtype as for any tensors; a CPU tensor of more dims stays an error."""
    x = bt.tensor([1.0, 2.0, 3.0]).cuda()
    s = bt.tensor(2.0)
    assert (x * s).device == x.device and (x * s).tolist() == [2.0, 4.0, 6.0]
    assert (s - x).tolist() == [1.0, 0.0, -1.0]
    assert (x > s).tolist() == [False, False, True]
    assert (x * bt.tensor(2.0, dtype=bt.float64)).dtype == bt.float64  # (as on one device)
    i = bt.tensor([7, -7], dtype=bt.int64).cuda()
    big = bt.tensor(2**53 + 1)  # exact: read as an int, not through double
    assert (i + big).tolist() == [2**53 + 8, 2**53 - 6]
    assert (bt.tensor([2**53 + 1]).cuda() == big).tolist() == [True]
    assert (i % bt.tensor(3)).tolist() == [1, 2]
    assert (bt.tensor([True, False]).cuda() & bt.tensor(True)).tolist() == [True, False]
    assert bt.where(x > 1.5, x, bt.tensor(0.0)).tolist() == [0.0, 2.0, 3.0]
    assert bt.where(bt.tensor(True), x, bt.tensor(-1.0)).tolist() == [1.0, 2.0, 3.0]
    assert bt.maximum(x, bt.tensor(2.5)).tolist() == [2.5, 2.5, 3.0]
    assert (x ** bt.tensor(2)).tolist() == [1.0, 4.0, 9.0]
    y = x.clone()
    y += bt.tensor(1.0)
    y.mul_(bt.tensor(2.0))
    assert y.tolist() == [4.0, 6.0, 8.0]
    assert (
        bt.ones(2, 2)
        .cuda()
        .masked_fill(bt.tensor([[True, False]] * 2).cuda(), bt.tensor(5.0))
        .tolist()
        == [[5.0, 1.0]] * 2
    )
    both = bt.tensor(3.0) + bt.tensor(4.0).cuda()  # two 0-d tensors: the CUDA one's device
    assert both.device == x.device and both.item() == 7.0
    # a 0-d CPU tensor that requires grad gets its gradient back on the CPU
    w = bt.tensor(3.0, requires_grad=True)
    (x * w).sum().backward()
    assert w.grad.device == "cpu" and w.grad.item() == 6.0
    with pytest.raises(ValueError, match=r"^\[add\] expected all tensors on the same device"):
        x + bt.ones(3)
    with pytest.raises(ValueError, match=r"^\[add_\] expected all tensors on the same device"):
        bt.tensor(1.0).add_(bt.tensor(2.0).cuda())  # (never written into a CPU tensor)
    with pytest.raises(ValueError, match=r"^\[where\] expected all tensors on the same device"):
        bt.where(x > 1, x, bt.zeros(3))


def test_masked_fill_wants_the_mask_on_the_inputs_device_a_0d_one_too():
    """As PyTorch ("expected self and mask to be on the same device"): a 0-d CPU tensor is a number
    next to CUDA tensors as a value, not as a mask.  Both value paths refuse it (a 0-d tensor
    value went through where(), which took the CPU mask silently), naming the mask and both
    devices; a 0-d CPU value with a CUDA mask works."""
    x = bt.ones(2, 3).cuda()
    for value in (5.0, bt.tensor(5.0), bt.tensor(5.0).cuda()):
        for mask in (bt.tensor(True), bt.tensor([[True, False, True]])):
            with pytest.raises(ValueError, match=r"^\[masked_fill\] mask is on cpu but the input"):
                x.masked_fill(mask, value)
            with pytest.raises(ValueError, match=r"^\[masked_fill_\] mask is on cpu but the inp"):
                x.clone().masked_fill_(mask, value)
    with pytest.raises(ValueError, match=r"^\[masked_fill\] mask is on cuda:0 but the input is"):
        bt.ones(2).masked_fill(bt.tensor(True).cuda(), 1.0)
    m = bt.tensor([[True, False, True]]).cuda()
    assert x.masked_fill(m, bt.tensor(5.0)).tolist() == [[5.0, 1.0, 5.0]] * 2
    assert x.masked_fill(bt.tensor(True).cuda(), 7).tolist() == [[7.0] * 3] * 2
    assert x.tolist() == [[1.0] * 3] * 2  # (nothing changed by the refusals)


@pytest.mark.parametrize("where", ["q", "k", "v", "mask"])
def test_attention_with_a_tensor_on_another_device_raises(rng, where):
    """The memcheck fuzz (seed 42, case 321): q on the CPU with k, v on CUDA crashed the process
    (SIGSEGV): the CPU path's scan for non-finite inputs read k and v through host pointers
    before anything checked their devices.  Every mix of devices now raises, naming the op and
    both devices, before a value is read."""
    t = {n: bt.tensor(rng.standard_normal((2, 2, 3, 4))) for n in "qkv"}
    mask = bt.ones(3, 3, dtype=bt.bool)
    for n in "qkv":
        t[n] = t[n] if where == n else t[n].cuda()
    mask = mask if where == "mask" else mask.cuda()
    with pytest.raises(
        ValueError,
        match=r"^\[scaled_dot_product_attention\] expected all tensors "
        r"on the same device, got (cpu and cuda:0|cuda:0 and cpu)",
    ):
        bt.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=mask, is_causal=False)
    if where != "mask":
        with pytest.raises(ValueError, match=r"^\[scaled_dot_product_attention\] expected all"):
            bt.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True)
