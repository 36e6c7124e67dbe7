"""GPU tests of softmax / log_softmax, layer_norm, add_layer_norm and cross_entropy, forward and
backward (the fused backward primitives), CUDA against the CPU backend on the same inputs, in
float32 / bfloat16 / float16 (and float64), odd row sizes (1, 7, 1025, 50257), ignore_index rows,
label smoothing and non-contiguous inputs; plus the fast (v2) kernels against the reference (v1)
ones (BT_CUDA_NN_V1=1) and determinism of layer norm's dweight / dbias."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

DTYPES = [bt.float32, bt.bfloat16, bt.float16]
TOL = {bt.float64: 1e-12, bt.float32: 2e-5, bt.bfloat16: 2e-2, bt.float16: 4e-3}


def _np(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().to(bt.float64).numpy()


def _close(got: bt.Tensor, ref: bt.Tensor, dtype, what: str, k: float = 1) -> None:
    g, r = _np(got), _np(ref)
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != {ref.dtype}"
    assert g.shape == r.shape, f"{what}: shape {g.shape} != {r.shape}"
    assert np.isfinite(g).all() == np.isfinite(r).all(), f"{what}: non-finite mismatch"
    # all-zero refs (layer_norm's dx at C == 1: rstd = 1/sqrt(eps) amplifies rounding) compare
    # absolutely
    scale = np.abs(r).max(initial=0) or 1.0
    err = np.abs(g - r).max(initial=0) / scale
    assert err <= TOL[dtype] * k, f"{what}: max error {err:.3g} (relative to max |ref|)"


def _run(fn, arrays, dtype, device, grad_idx, cot_seed=0, int_arrays=()):
    """Leaves from float64 arrays (cast to dtype, on device), fn(*leaves, *ints) -> outputs;
    backward with fixed random cotangents; returns outputs and grads."""
    xs = [bt.tensor(a, dtype=dtype).to(device) for a in arrays]
    for i in grad_idx:
        xs[i].requires_grad_(True)
    ints = [bt.tensor(a, dtype=bt.int64).to(device) for a in int_arrays]
    outs = fn(*xs, *ints)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    rng = np.random.default_rng(cot_seed)
    total = None
    for o in outs:
        c = bt.tensor(rng.standard_normal(o.shape), dtype=o.dtype).to(device)
        term = (o * c).sum() if o.ndim else o * c
        total = term if total is None else total + term
    total.backward()
    return outs, [xs[i].grad for i in grad_idx]


def _compare(fn, arrays, dtype, grad_idx, what, k=1, int_arrays=()):
    go, gg = _run(fn, arrays, dtype, "cuda", grad_idx, int_arrays=int_arrays)
    co, cg = _run(fn, arrays, dtype, "cpu", grad_idx, int_arrays=int_arrays)
    for i, (a, b) in enumerate(zip(go, co)):
        _close(a, b, dtype, f"{what} output {i}", k)
    for i, (a, b) in enumerate(zip(gg, cg)):
        _close(a, b, dtype, f"{what} grad {i}", 4 * k)


# ---- softmax -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [bt.float64])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("C", [1, 7, 1025])
def test_softmax(rng, dtype, log, C):
    f = bt.log_softmax if log else bt.softmax
    _compare(lambda x: f(x, -1), [rng.standard_normal((13, C)) * 3], dtype, [0], f"softmax {C}")


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_vocab(rng, dtype, log):
    f = bt.log_softmax if log else bt.softmax
    _compare(lambda x: f(x, -1), [rng.standard_normal((3, 50257))], dtype, [0], "softmax V")


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_non_contiguous(rng, dtype):
    # dim 0 of a (C, R) tensor: the front transposes, so the kernel sees a strided view.
    _compare(lambda x: bt.softmax(x, 0), [rng.standard_normal((33, 5))], dtype, [0], "softmax T")
    _compare(
        lambda x: bt.log_softmax(x[:, ::2], -1), [rng.standard_normal((6, 40))], dtype, [0], "ls s"
    )


def test_softmax_empty():
    x = bt.zeros((0, 5)).to("cuda")
    assert bt.softmax(x, -1).shape == (0, 5)


# ---- layer norm ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [bt.float64])
@pytest.mark.parametrize("C", [1, 7, 768, 1025])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(rng, dtype, C, affine):
    arrays = [rng.standard_normal((37, C)) + 0.5]
    if affine:
        arrays += [rng.standard_normal(C), rng.standard_normal(C)]
    idx = list(range(len(arrays)))
    _compare(
        lambda x, *wb: bt.layer_norm(x, C, *wb),
        arrays,
        dtype,
        idx,
        f"layer_norm {C}",
        k=2 if C > 1 else 1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_non_contiguous_and_3d(rng, dtype):
    arrays = [rng.standard_normal((4, 5, 64)), rng.standard_normal(32), rng.standard_normal(32)]
    _compare(
        lambda x, w, b: bt.layer_norm(x[:, :, ::2], 32, w, b),
        arrays,
        dtype,
        [0, 1, 2],
        "layer_norm strided",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_weight_only(rng, dtype):
    arrays = [rng.standard_normal((9, 48)), rng.standard_normal(48)]
    _compare(lambda x, w: bt.layer_norm(x, 48, w), arrays, dtype, [0, 1], "layer_norm w")


def test_layer_norm_backward_deterministic(rng):
    x = bt.tensor(rng.standard_normal((4096, 768)), dtype=bt.float32).to("cuda")
    w = bt.tensor(rng.standard_normal(768), dtype=bt.float32).to("cuda")
    g = bt.tensor(rng.standard_normal((4096, 768)), dtype=bt.float32).to("cuda")
    grads = []
    for _ in range(3):
        xl, wl = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        bt.layer_norm(xl, 768, wl).backward(g)
        grads.append(_np(wl.grad))
    assert np.array_equal(grads[0], grads[1]) and np.array_equal(grads[0], grads[2])


# ---- add_layer_norm ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + [bt.float64])
@pytest.mark.parametrize("C", [1, 7, 768, 1025])
def test_add_layer_norm(rng, dtype, C):
    arrays = [
        rng.standard_normal((2, 9, C)),
        rng.standard_normal((2, 9, C)),
        rng.standard_normal(C),
        rng.standard_normal(C),
    ]
    _compare(
        lambda x, r, w, b: bt.add_layer_norm(x, r, w, b),
        arrays,
        dtype,
        [0, 1, 2, 3],
        f"add_layer_norm {C}",
        k=2,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_non_contiguous(rng, dtype):
    arrays = [rng.standard_normal((40, 6)), rng.standard_normal((6, 40))]
    _compare(lambda x, r: bt.add_layer_norm(x.T, r), arrays, dtype, [0, 1], "add_ln strided")


def test_add_layer_norm_sum_exact(rng):
    x = bt.tensor(rng.standard_normal((5, 77)), dtype=bt.bfloat16).to("cuda")
    r = bt.tensor(rng.standard_normal((5, 77)), dtype=bt.bfloat16).to("cuda")
    s, _ = bt.add_layer_norm(x, r)
    assert np.array_equal(_np(s), _np(x + r))


# ---- cross-entropy -------------------------------------------------------------------------------
def _targets(rng, N, C, ignore=True):
    t = rng.integers(0, C, N)
    if ignore and N > 2:
        t[[0, N // 2]] = -100
    return t


@pytest.mark.parametrize("dtype", DTYPES + [bt.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("C", [1, 7, 1025])
def test_cross_entropy(rng, dtype, reduction, ls, C):
    N = 11
    t = _targets(rng, N, C)

    def fn(x, tt):
        return bt.cross_entropy(x, tt, reduction=reduction, label_smoothing=ls)

    _compare(
        fn,
        [rng.standard_normal((N, C)) * 2],
        dtype,
        [0],
        f"ce {C} {reduction} {ls}",
        int_arrays=[t],
    )


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_vocab(rng, dtype, reduction):
    N, C = 6, 50257
    t = _targets(rng, N, C)
    _compare(
        lambda x, tt: bt.cross_entropy(x, tt, reduction=reduction, label_smoothing=0.1),
        [rng.standard_normal((N, C))],
        dtype,
        [0],
        f"ce V {reduction}",
        int_arrays=[t],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_non_contiguous_and_nd(rng, dtype):
    t = _targets(rng, 9, 13)
    _compare(
        lambda x, tt: bt.cross_entropy(x.T, tt),
        [rng.standard_normal((13, 9))],
        dtype,
        [0],
        "ce transposed",
        int_arrays=[t],
    )
    t2 = rng.integers(0, 5, (2, 3))
    t2[0, 1] = -100
    _compare(
        lambda x, tt: bt.cross_entropy(x, tt, label_smoothing=0.2),
        [rng.standard_normal((2, 5, 3))],
        dtype,
        [0],
        "ce nd",
        int_arrays=[t2],
    )


def test_cross_entropy_all_ignored_and_grad_dtype():
    x = bt.zeros((4, 9), dtype=bt.bfloat16).to("cuda").requires_grad_(True)
    t = bt.tensor(np.full(4, -100), dtype=bt.int64).to("cuda")
    loss = bt.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert x.grad.dtype == bt.bfloat16
    assert float(_np(loss)) == 0 and np.all(_np(x.grad) == 0)
    lm = bt.cross_entropy(x.detach(), t)  # mean over no rows: nan, as the CPU
    assert np.isnan(_np(lm))


# ---- fast kernels (v2) against the reference ones (v1) -------------------------------------------
CASES_V = {
    "softmax": (lambda x: bt.softmax(x, -1), [(17, 1030)], []),
    "log_softmax": (lambda x: bt.log_softmax(x, -1), [(17, 1030)], []),
    "layer_norm": (lambda x, w, b: bt.layer_norm(x, 771, w, b), [(33, 771), (771,), (771,)], []),
    "add_layer_norm": (
        lambda x, r, w, b: bt.add_layer_norm(x, r, w, b),
        [(33, 768), (33, 768), (768,), (768,)],
        [],
    ),
    "cross_entropy": (
        lambda x, t: bt.cross_entropy(x, t, label_smoothing=0.1),
        [(9, 50257)],
        [(9, 50257)],
    ),
}


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES_V))
def test_v2_matches_v1(rng, monkeypatch, dtype, name):
    fn, shapes, tshapes = CASES_V[name]
    arrays = [rng.standard_normal(s) for s in shapes]
    ints = [_targets(rng, s[0], s[1]) for s in tshapes]
    idx = list(range(len(arrays)))
    o2, g2 = _run(fn, arrays, dtype, "cuda", idx, int_arrays=ints)
    monkeypatch.setenv("BT_CUDA_NN_V1", "1")
    o1, g1 = _run(fn, arrays, dtype, "cuda", idx, int_arrays=ints)
    for i, (a, b) in enumerate(zip(o2, o1)):
        _close(a, b, dtype, f"{name} v2 vs v1 output {i}")
    for i, (a, b) in enumerate(zip(g2, g1)):
        _close(a, b, dtype, f"{name} v2 vs v1 grad {i}", 4)
