"""GPU tests of softmax / log_softmax, layer_norm, add_layer_norm and cross_entropy, forward and
backward (the fused backward primitives), CUDA against the CPU backend on the same inputs, in
float32 / bfloat16 / float16 (and float64), odd row sizes (1, 7, 1025, 50257), ignore_index rows,
label smoothing and non-contiguous inputs; plus the block-per-row (v2) kernels forced with
BT_CUDA_NN_VERSION=2 against the CPU (the v1 references left the library for
bench/nn_v1_kernels.cuh: BT_CUDA_NN_V1 and other bad versions are errors) and determinism of layer
norm's dweight / dbias."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("dtype", DTYPES + [bt.float64])
@pytest.mark.parametrize("C", [7, 768, 3072])
@pytest.mark.parametrize("grads", [[0, 1, 2, 3, 4], [0, 4]], ids=["all", "x-rb"])
def test_add_layer_norm_residual_bias(rng, dtype, C, grads):
    """residual_bias on CUDA against the CPU: sum, y and the gradients (all five, or only x's
    and the residual bias's: v6 then sums dx's columns without dweight / dbias).  C 768 / 3072
    in 16-bit run v6's in-kernel sums on sm_90; C 7 and float64 the column-sum pass after."""
    arrays = [rng.standard_normal((3, 50, C)), rng.standard_normal((3, 50, C))]
    arrays += [rng.standard_normal(C) for _ in range(3)]
    _compare(
        lambda x, r, w, b, rb: bt.add_layer_norm(x, r, w, b, residual_bias=rb),
        arrays,
        dtype,
        grads,
        f"add_layer_norm residual_bias {C}",
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


# ---- the block-per-row kernels (v2: every shape's fallback) against the CPU ----------------------
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
def test_v2_matches_the_cpu(rng, monkeypatch, dtype, name):
    fn, shapes, tshapes = CASES_V[name]
    arrays = [rng.standard_normal(s) for s in shapes]
    ints = [_targets(rng, s[0], s[1]) for s in tshapes]
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "2")
    _compare(fn, arrays, dtype, list(range(len(arrays))), f"{name} v2", int_arrays=ints)


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("BT_CUDA_NN_V1", "1", r"\[BT_CUDA_NN_V1\] the v1 reference kernels left the library"),
        ("BT_CUDA_NN_VERSION", "1", r"\[BT_CUDA_NN_VERSION\] must be 2, 3, 4, 5 or 6 \(or unset\), "
         r"got '1'; the v1 reference kernels are in .*bench/nn_v1_kernels.cuh"),
        ("BT_CUDA_NN_VERSION", "7", r"\[BT_CUDA_NN_VERSION\] must be 2, 3, 4, 5 or 6 \(or unset\), "
         r"got '7'$"),
        ("BT_CUDA_NN_VERSION", "v3", r"got 'v3'"),
    ],
)  # fmt: skip
def test_a_bad_kernel_version_is_an_error_naming_it(monkeypatch, var, value, message):
    x = bt.ones(4, 8).to("cuda")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        bt.softmax(x, -1)
    with pytest.raises(ValueError, match=message):
        bt.layer_norm(x, 8)


# ---- cross-entropy on a padded vocabulary, read in place ----------------------------------------
# logits = X[:, :V] of a dense (N, Vp) X: the kernels read the strided rows in place (no
# gather_contiguous copy) and, when the gradient reaches X through views only, the loss runs on X
# with num_classes = V so its backward writes X's padded gradient (zeros in the padding) in one
# pass.  The padding is poisoned with NaN / inf: it must never reach the loss or the gradient.
V_GPT, VP_GPT = 50257, 50304


def _poisoned(rng, N, C, Cp):
    x = rng.standard_normal((N, Cp)) * 2
    x[:, C:] = np.nan
    x[0, C:] = np.inf
    return x


def _ce_padded_run(x, t, C, dtype, device, reduction="mean", ls=0.0, hook=False):
    X = bt.tensor(x, dtype=dtype).to(device).requires_grad_(True)
    ld = bt.float32 if dtype in (bt.bfloat16, bt.float16) else None
    full = X * 1.0  # non-leaf, as GPT-2's head output
    lg = full.reshape(-1, x.shape[-1]).narrow(1, 0, C)
    if hook:
        lg.register_hook(lambda g: None)  # keeps the plain path (slice backward)
    loss = bt.cross_entropy(
        lg,
        bt.tensor(t, dtype=bt.int64).to(device),
        ignore_index=-1,
        reduction=reduction,
        label_smoothing=ls,
        loss_dtype=ld,
    )
    node = loss.grad_fn.next_functions[0][0].name()
    c = np.random.default_rng(1).standard_normal(loss.shape)
    (loss * bt.tensor(c, dtype=loss.dtype).to(device)).sum().backward()
    return loss, X.grad, node


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16, bt.float64])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("NCCp", [(7, V_GPT, VP_GPT), (5, 1025, 1032), (9, 13, 20), (3, 8, 9)])
def test_cross_entropy_padded(rng, dtype, reduction, NCCp):
    N, C, Cp = NCCp
    x = _poisoned(rng, N, C, Cp)
    t = rng.integers(0, C, N)
    t[[0, N // 2]] = -1
    t[-1] = C - 1
    lg, gg, ng = _ce_padded_run(x, t, C, dtype, "cuda", reduction, 0.1)
    lc, gc, nc = _ce_padded_run(x, t, C, dtype, "cpu", reduction, 0.1)
    assert ng == nc == "Mul", (ng, nc)  # the padded path: the loss reads X * 1.0, no Slice
    g = _np(gg)
    assert gg.shape == (N, Cp) and np.all(g[:, C:] == 0), "padding gradient must be 0"
    assert np.isfinite(_np(lg)).all() and np.isfinite(g).all()
    _close(lg, lc, dtype, f"ce padded {NCCp} loss")
    _close(gg, gc, dtype, f"ce padded {NCCp} grad", 4)
    # float64 numpy reference of the gradient (cotangent of ones for mean)
    if reduction == "mean":
        xr = _np(bt.tensor(x, dtype=dtype))[:, :C]
        m = xr.max(1, keepdims=True)
        lse = m + np.log(np.exp(xr - m).sum(1, keepdims=True))
        valid = t != -1
        onehot = np.zeros_like(xr)
        onehot[np.arange(N), np.where(valid, t, 0)] = 1
        d = (np.exp(xr - lse) - 0.9 * onehot - 0.1 / C) * valid[:, None] / valid.sum()
        d *= float(np.random.default_rng(1).standard_normal(()))
        err = np.abs(g[:, :C] - d).max() / np.abs(d).max()
        assert err <= 4 * TOL[dtype], f"grad vs float64: {err:.3g}"


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_cross_entropy_padded_v2_and_plain_path(rng, monkeypatch, dtype):
    """v3 (the default) vs v2 on the padded path, and the plain path (hook on the logits: dense
    (N, V) gradient from a strided input, scalar-aligned rows, then the narrow's scatter) against
    the padded one."""
    N, C, Cp = 6, V_GPT, VP_GPT
    x = _poisoned(rng, N, C, Cp)
    t = rng.integers(0, C, N)
    t[2] = -1
    l2, g2, _ = _ce_padded_run(x, t, C, dtype, "cuda")
    lp, gp, np_ = _ce_padded_run(x, t, C, dtype, "cuda", hook=True)
    assert np_ == "Slice"
    # same per-element formula; only the vector width differs (at most an ulp apart)
    _close(l2, lp, dtype, "ce padded vs plain loss", 0.25)
    _close(g2, gp, dtype, "ce padded vs plain grad", 0.25)
    assert np.all(_np(gp)[:, C:] == 0)
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "2")
    l1, g1, _ = _ce_padded_run(x, t, C, dtype, "cuda")
    _close(l2, l1, dtype, "ce padded v3 vs v2 loss")
    _close(g2, g1, dtype, "ce padded v3 vs v2 grad", 4)
    assert np.all(_np(g1)[:, C:] == 0)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_cross_entropy_strided_forward_in_place(rng, dtype):
    """No grad: the narrowed view is read in place with its row stride (odd offsets too)."""
    N, Cp = 5, 1040
    x = rng.standard_normal((N, Cp))
    t = rng.integers(0, 1000, N)
    for start, C in [(0, 1000), (3, 1001), (1, 7)]:
        tt = np.minimum(t, C - 1)
        with bt.no_grad():
            g = bt.cross_entropy(
                bt.tensor(x, dtype=dtype).to("cuda").narrow(1, start, C),
                bt.tensor(tt, dtype=bt.int64).to("cuda"),
                reduction="none",
            )
            c = bt.cross_entropy(
                bt.tensor(x, dtype=dtype).narrow(1, start, C),
                bt.tensor(tt, dtype=bt.int64),
                reduction="none",
            )
        _close(g, c, dtype, f"ce strided forward start {start} C {C}")


def test_cross_entropy_target_out_of_range_raises():
    x = bt.zeros((4, 9)).to("cuda")
    t = bt.tensor(np.array([0, 9, -100, 3]), dtype=bt.int64).to("cuda")
    loss = bt.cross_entropy(x, t)
    with pytest.raises(IndexError, match="cross_entropy"):
        loss.item()
    # the record is cleared: later work is unaffected
    ok = bt.cross_entropy(x, bt.tensor(np.array([0, 8, -100, 3]), dtype=bt.int64).to("cuda"))
    assert np.isfinite(ok.item())
    # a target in the padding of a padded vocabulary is out of range too (C classes, not Cp)
    X = bt.zeros((2, 16)).to("cuda").requires_grad_(True)
    lp = bt.cross_entropy((X * 1.0).narrow(1, 0, 10), bt.tensor(np.array([1, 12])).to("cuda"))
    with pytest.raises(IndexError, match="cross_entropy"):
        bt.cuda.synchronize()
    del lp
    # negative target that is not ignore_index
    ln = bt.cross_entropy(x, bt.tensor(np.array([0, -5, 1, 2])).to("cuda"), reduction="none")
    with pytest.raises(IndexError, match="cross_entropy"):
        ln.cpu()


# ---- v3 kernels (one warp per row, row in registers) against v2 and the CPU ----------------------
# BT_CUDA_NN_VERSION selects the kernels (3 is used where it applies: fp32 / 16-bit, rows of whole
# 16-byte vectors, aligned; else v2).  Shapes cover GPT-2's rows (768, 3072, 1024), rows that
# leave lanes idle (64, 1000, 1032), ones v3 declines (771, 1030, 4100) and row counts that are
# not a multiple of the warps per block.
V3_CASES = {
    "layer_norm": (lambda x, w, b: bt.layer_norm(x, x.shape[-1], w, b), True),
    "layer_norm_nowb": (lambda x: bt.layer_norm(x, x.shape[-1]), False),
    "add_layer_norm": (lambda x, r, w, b: bt.add_layer_norm(x, r, w, b), True),
    "softmax": (lambda x: bt.softmax(x, -1), False),
    "log_softmax": (lambda x: bt.log_softmax(x, -1), False),
}


def _v3_arrays(rng, name, R, C):
    arrays = [rng.standard_normal((R, C)) * 2 + 0.5]
    if name == "add_layer_norm":
        arrays.append(rng.standard_normal((R, C)))
    if V3_CASES[name][1]:
        arrays += [rng.standard_normal(C), rng.standard_normal(C)]
    return arrays


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("name", sorted(V3_CASES))
@pytest.mark.parametrize(
    "RC", [(37, 768), (9, 3072), (13, 1024), (5, 64), (6, 1000), (7, 1032), (5, 771), (3, 4100)]
)
def test_v3_matches_v2_and_cpu(rng, monkeypatch, dtype, name, RC):
    R, C = RC
    if name.endswith("softmax") and dtype == bt.float16 and C > 2000:
        pytest.skip("covered by fp32 / bf16")
    fn = V3_CASES[name][0]
    arrays = _v3_arrays(rng, name, R, C)
    idx = list(range(len(arrays)))
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "3")
    o3, g3 = _run(fn, arrays, dtype, "cuda", idx)
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "2")
    o2, g2 = _run(fn, arrays, dtype, "cuda", idx)
    oc, gc = _run(fn, arrays, dtype, "cpu", idx)
    for i, (a, b, c) in enumerate(zip(o3, o2, oc)):
        _close(a, b, dtype, f"{name} {RC} v3 vs v2 output {i}")
        _close(a, c, dtype, f"{name} {RC} v3 vs cpu output {i}")
    for i, (a, b, c) in enumerate(zip(g3, g2, gc)):
        # dweight / dbias sum R rows: k scales with the row count in 16-bit
        _close(a, b, dtype, f"{name} {RC} v3 vs v2 grad {i}", 4)
        _close(a, c, dtype, f"{name} {RC} v3 vs cpu grad {i}", 4)


def test_v3_layer_norm_gpt2_rows_and_determinism(rng, monkeypatch):
    """Many rows (more than one pass of the backward grid), bf16: dweight / dbias run to run
    bitwise equal, and close to float64."""
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "3")
    R, C = 4099, 768
    x = rng.standard_normal((R, C))
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    g = rng.standard_normal((R, C))
    res = []
    for _ in range(2):
        xs = [bt.tensor(a, dtype=bt.bfloat16).to("cuda").requires_grad_(True) for a in (x, w, b)]
        y = bt.layer_norm(xs[0], C, xs[1], xs[2])
        y.backward(bt.tensor(g, dtype=bt.bfloat16).to("cuda"))
        res.append([_np(t.grad) for t in xs])
    for a, b2 in zip(res[0], res[1]):
        assert np.array_equal(a, b2), "v3 layer_norm backward is not deterministic"
    xr = _np(bt.tensor(x, dtype=bt.bfloat16))
    gr = _np(bt.tensor(g, dtype=bt.bfloat16))
    m = xr.mean(1, keepdims=True)
    xh = (xr - m) / np.sqrt(((xr - m) ** 2).mean(1, keepdims=True) + 1e-5)
    for got, ref in [(res[0][1], (gr * xh).sum(0)), (res[0][2], gr.sum(0))]:
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 2e-2, f"dweight/dbias vs float64: {err:.3g}"


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_v3_misaligned_input_falls_back(rng, monkeypatch, dtype):
    """A contiguous view at an odd element offset is not 16-byte aligned: v3 declines, v2 runs."""
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "3")
    R, C = 6, 768
    flat = rng.standard_normal(R * C + 1)
    xg = bt.tensor(flat, dtype=dtype).to("cuda").narrow(0, 1, R * C).reshape(R, C)
    xc = bt.tensor(flat, dtype=dtype).narrow(0, 1, R * C).reshape(R, C)
    _close(bt.layer_norm(xg, C), bt.layer_norm(xc, C), dtype, "misaligned layer_norm")
    _close(bt.softmax(xg, -1), bt.softmax(xc, -1), dtype, "misaligned softmax")


# ---- v4 layer norm (1-8 warps per row, persistent single-pass backward) --------------------------
# BT_CUDA_NN_VERSION=4 runs v4 where it applies (fp32 / 16-bit, rows of whole 16-byte vectors,
# aligned, C <= 8 * 32 * 24 elements) and falls back to v3 / v2 elsewhere.  Shapes: GPT-2's rows
# (768, 3072), one warp per row with idle lanes (64, 1000, 1032), 2-8 warps per row (2056, 4100,
# 6144), rows v4 declines (771; 8192 in bf16 and fp32), tiny rows (8), and row counts larger than
# the persistent grid's rows in flight (3001, 1200) so every block loops and its dweight / dbias
# partials carry over rows.  Before each run the allocator's free blocks are poisoned with NaN, so
# an output element (or partial) a kernel forgets to write shows up as non-finite.
def _poison_pool(*numels):
    ts = [bt.full((n,), float("nan"), dtype=bt.float32, device="cuda") for n in numels if n > 0]
    bt.cuda.synchronize()
    del ts


LN_CASES = {
    "layer_norm": (lambda x, w, b: bt.layer_norm(x, x.shape[-1], w, b), 3),
    "layer_norm_w": (lambda x, w: bt.layer_norm(x, x.shape[-1], w), 2),
    "layer_norm_nowb": (lambda x: bt.layer_norm(x, x.shape[-1]), 1),
    "add_layer_norm": (lambda x, r, w, b: bt.add_layer_norm(x, r, w, b), 4),
}
V4_SHAPES = [
    (37, 768),
    (9, 3072),
    (13, 1024),
    (5, 64),
    (6, 1000),
    (7, 1032),
    (11, 2056),
    (3, 4100),
    (3, 6144),
    (5, 771),
    (2, 8192),
    (33, 8),
]


def _ln_arrays(rng, name, R, C):
    n = LN_CASES[name][1]
    arrays = [rng.standard_normal((R, C)) * 2 + 0.5]
    if name == "add_layer_norm":
        arrays.append(rng.standard_normal((R, C)))
    while len(arrays) < n:
        arrays.append(rng.standard_normal(C))
    return arrays


def _set_version(monkeypatch, ver):
    """BT_CUDA_NN_VERSION=ver, or unset for "default" (the launcher's per-shape choice)."""
    if ver == "default":
        monkeypatch.delenv("BT_CUDA_NN_VERSION", raising=False)
    else:
        monkeypatch.setenv("BT_CUDA_NN_VERSION", ver)


def _run_version(monkeypatch, ver, fn, arrays, dtype, idx, R, C):
    _set_version(monkeypatch, ver)
    # float32 blocks of each size the run allocates: fp32 / 16-bit (R, C), partials, stats, (C)
    _poison_pool(R * C, R * C, R * C // 2, R * C // 2, 2 * 528 * C, R, R, C, C // 2)
    return _run(fn, arrays, dtype, "cuda", idx)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("name", sorted(LN_CASES))
@pytest.mark.parametrize("RC", V4_SHAPES, ids=lambda rc: f"{rc[0]}x{rc[1]}")
def test_v4_layer_norm_matches_v2_and_cpu(rng, monkeypatch, dtype, name, RC):
    R, C = RC
    fn = LN_CASES[name][0]
    arrays = _ln_arrays(rng, name, R, C)
    idx = list(range(len(arrays)))
    o4, g4 = _run_version(monkeypatch, "4", fn, arrays, dtype, idx, R, C)
    o2, g2 = _run_version(monkeypatch, "2", fn, arrays, dtype, idx, R, C)
    oc, gc = _run(fn, arrays, dtype, "cpu", idx)
    for i, (a, b, c) in enumerate(zip(o4, o2, oc)):
        _close(a, b, dtype, f"{name} {RC} v4 vs v2 output {i}")
        _close(a, c, dtype, f"{name} {RC} v4 vs cpu output {i}")
    for i, (a, b, c) in enumerate(zip(g4, g2, gc)):
        assert np.isfinite(_np(a)).all(), f"{name} {RC} v4 grad {i} not finite"
        _close(a, b, dtype, f"{name} {RC} v4 vs v2 grad {i}", 4)
        _close(a, c, dtype, f"{name} {RC} v4 vs cpu grad {i}", 4)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm"])
@pytest.mark.parametrize("RC", [(3001, 768), (1200, 3072), (517, 2056)], ids=str)
def test_v4_layer_norm_many_rows(rng, monkeypatch, dtype, name, RC):
    """More rows than the persistent backward grid holds at once: v4 vs v3 and the CPU."""
    R, C = RC
    fn = LN_CASES[name][0]
    arrays = _ln_arrays(rng, name, R, C)
    idx = list(range(len(arrays)))
    o4, g4 = _run_version(monkeypatch, "4", fn, arrays, dtype, idx, R, C)
    o3, g3 = _run_version(monkeypatch, "3", fn, arrays, dtype, idx, R, C)
    oc, gc = _run(fn, arrays, dtype, "cpu", idx)
    for i, (a, b, c) in enumerate(zip(o4, o3, oc)):
        _close(a, b, dtype, f"{name} {RC} v4 vs v3 output {i}")
        _close(a, c, dtype, f"{name} {RC} v4 vs cpu output {i}")
    for i, (a, b, c) in enumerate(zip(g4, g3, gc)):
        # dweight / dbias sum R rows; 16-bit rounding of the CPU reference's own sums differs
        k = 4 if dtype == bt.float32 else 8
        _close(a, b, dtype, f"{name} {RC} v4 vs v3 grad {i}", k)
        _close(a, c, dtype, f"{name} {RC} v4 vs cpu grad {i}", k)


@pytest.mark.parametrize("ver", ["4", "5", "6", "default"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("C", [768, 3072])
def test_layer_norm_backward_deterministic_and_float64(rng, monkeypatch, ver, dtype, C):
    """dx / dweight / dbias run to run bitwise equal, dweight / dbias close to float64.  R: several
    rows per row group of the persistent grids (v6's 3-slot ring wraps around)."""
    _set_version(monkeypatch, ver)
    R = 9001 if C == 768 else 2503
    x = rng.standard_normal((R, C))
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    g = rng.standard_normal((R, C))
    res = []
    for _ in range(2):
        _poison_pool(R * C, R * C, R * C // 2, R * C // 2, 2 * 528 * C, R, R)
        xs = [bt.tensor(a, dtype=dtype).to("cuda").requires_grad_(True) for a in (x, w, b)]
        y = bt.layer_norm(xs[0], C, xs[1], xs[2])
        y.backward(bt.tensor(g, dtype=dtype).to("cuda"))
        res.append([_np(t.grad) for t in xs])
    for a, b2 in zip(res[0], res[1]):
        assert np.isfinite(a).all(), f"v{ver} layer_norm backward gave non-finite values"
        assert np.array_equal(a, b2), f"v{ver} layer_norm backward is not deterministic"
    xr = _np(bt.tensor(x, dtype=dtype))
    gr = _np(bt.tensor(g, dtype=dtype))
    m = xr.mean(1, keepdims=True)
    rs = 1 / np.sqrt(((xr - m) ** 2).mean(1, keepdims=True) + 1e-5)
    xh = (xr - m) * rs
    wr = _np(bt.tensor(w, dtype=dtype))
    gw = gr * wr
    dx = rs * (gw - gw.mean(1, keepdims=True) - xh * (gw * xh).mean(1, keepdims=True))
    tol = 1e-4 if dtype == bt.float32 else 2e-2
    for what, got, ref in [
        ("dx", res[0][0], dx),
        ("dweight", res[0][1], (gr * xh).sum(0)),
        ("dbias", res[0][2], gr.sum(0)),
    ]:
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < tol, f"v{ver} {what} vs float64: {err:.3g}"


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("grads", ["x", "x_w", "x_b", "w_b"])
def test_v4_layer_norm_partial_grads(rng, monkeypatch, dtype, grads):
    """Only some of dx / dweight / dbias wanted (need_dweight / need_dbias flags)."""
    R, C = 300, 3072
    arrays = _ln_arrays(rng, "layer_norm", R, C)
    idx = {"x": [0], "x_w": [0, 1], "x_b": [0, 2], "w_b": [1, 2]}[grads]
    fn = LN_CASES["layer_norm"][0]
    o4, g4 = _run_version(monkeypatch, "4", fn, arrays, dtype, idx, R, C)
    oc, gc = _run(fn, arrays, dtype, "cpu", idx)
    _close(o4[0], oc[0], dtype, f"v4 {grads} output")
    for i, (a, c) in enumerate(zip(g4, gc)):
        _close(a, c, dtype, f"v4 {grads} grad {i}", 8)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_v4_layer_norm_non_contiguous_and_misaligned(rng, monkeypatch, dtype):
    """A strided input (copied, then v4) and a misaligned one (v4 declines: v2) match the CPU."""
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "4")
    arrays = [rng.standard_normal((6, 2 * 768)), rng.standard_normal(768), rng.standard_normal(768)]
    _compare(
        lambda x, w, b: bt.layer_norm(x[:, ::2], 768, w, b),
        arrays,
        dtype,
        [0, 1, 2],
        "v4 layer_norm strided",
    )
    R, C = 6, 3072
    flat = rng.standard_normal(R * C + 1)
    xg = bt.tensor(flat, dtype=dtype).to("cuda").narrow(0, 1, R * C).reshape(R, C)
    xc = bt.tensor(flat, dtype=dtype).narrow(0, 1, R * C).reshape(R, C)
    _close(bt.layer_norm(xg, C), bt.layer_norm(xc, C), dtype, "v4 misaligned layer_norm")
    rg = bt.tensor(flat, dtype=dtype).to("cuda").narrow(0, 1, R * C).reshape(R, C)
    s_g, y_g = bt.add_layer_norm(xg, rg)
    s_c, y_c = bt.add_layer_norm(xc, xc)
    _close(s_g, s_c, dtype, "v4 misaligned add_layer_norm sum")
    _close(y_g, y_c, dtype, "v4 misaligned add_layer_norm y")


@pytest.mark.parametrize("ver", ["4", "6"])
def test_add_layer_norm_sum_exact_by_version(rng, monkeypatch, ver):
    """The sum add_layer_norm returns is x + r rounded once, as the elementwise add gives it."""
    monkeypatch.setenv("BT_CUDA_NN_VERSION", ver)
    for C in (768, 3072):
        x = bt.tensor(rng.standard_normal((700, C)), dtype=bt.bfloat16).to("cuda")
        r = bt.tensor(rng.standard_normal((700, C)), dtype=bt.bfloat16).to("cuda")
        s, _ = bt.add_layer_norm(x, r)
        assert np.array_equal(_np(s), _np(x + r)), f"v{ver} add_layer_norm sum {C}"


# ---- v5 / v6 layer norm backward and the default choice ------------------------------------------
# BT_CUDA_NN_VERSION=5: v5 (the next row's loads in flight); 6: v6 (cp.async row ring, dw / db in
# registers, on sm_90 reduced in the kernel through a cluster and the last block to arrive), and
# the forward v6 (cp.async row ring) too; "default": unset, the launcher's choice (backward v6 for
# 16-bit on sm_90, v5 for fp32, ...; forward v6 for 16-bit rows over 1024).  v5 / v6
# apply to fp32 / 16-bit rows of whole 16-byte vectors, aligned, up to 8 * 32 * 3 vectors (bf16
# 6144, fp32 3072 elements); elsewhere the default kernels run.  Shapes as v4's plus row counts
# beyond the persistent grid (every group loops, prefetching past the last row).  Running the
# shapes one after another also checks that v6's arrival counters are left at zero for the next
# launch (a stale count would leave dweight / dbias unwritten: NaN from the poisoned pool).
LN_BWD_VERSIONS = ["5", "6", "default"]


@pytest.mark.parametrize("ver", LN_BWD_VERSIONS)
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16])
@pytest.mark.parametrize("name", sorted(LN_CASES))
@pytest.mark.parametrize(
    "RC", V4_SHAPES + [(3001, 768), (1200, 3072)], ids=lambda rc: f"{rc[0]}x{rc[1]}"
)
def test_layer_norm_bwd_version_matches_v2_and_cpu(rng, monkeypatch, ver, dtype, name, RC):
    R, C = RC
    fn = LN_CASES[name][0]
    arrays = _ln_arrays(rng, name, R, C)
    idx = list(range(len(arrays)))
    o5, g5 = _run_version(monkeypatch, ver, fn, arrays, dtype, idx, R, C)
    o2, g2 = _run_version(monkeypatch, "2", fn, arrays, dtype, idx, R, C)
    oc, gc = _run(fn, arrays, dtype, "cpu", idx)
    for i, (a, b, c) in enumerate(zip(o5, o2, oc)):
        _close(a, b, dtype, f"{name} {RC} v{ver} vs v2 output {i}")
        _close(a, c, dtype, f"{name} {RC} v{ver} vs cpu output {i}")
    k = 4 if R < 1000 else (4 if dtype == bt.float32 else 8)
    for i, (a, b, c) in enumerate(zip(g5, g2, gc)):
        assert np.isfinite(_np(a)).all(), f"{name} {RC} v{ver} grad {i} not finite"
        _close(a, b, dtype, f"{name} {RC} v{ver} vs v2 grad {i}", k)
        _close(a, c, dtype, f"{name} {RC} v{ver} vs cpu grad {i}", k)


@pytest.mark.parametrize("ver", LN_BWD_VERSIONS)
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("grads", ["x", "x_w", "x_b", "w_b"])
def test_layer_norm_bwd_version_partial_grads(rng, monkeypatch, ver, dtype, grads):
    R, C = 300, 768
    arrays = _ln_arrays(rng, "layer_norm", R, C)
    idx = {"x": [0], "x_w": [0, 1], "x_b": [0, 2], "w_b": [1, 2]}[grads]
    fn = LN_CASES["layer_norm"][0]
    o5, g5 = _run_version(monkeypatch, ver, fn, arrays, dtype, idx, R, C)
    oc, gc = _run(fn, arrays, dtype, "cpu", idx)
    _close(o5[0], oc[0], dtype, f"v{ver} {grads} output")
    for i, (a, c) in enumerate(zip(g5, gc)):
        _close(a, c, dtype, f"v{ver} {grads} grad {i}", 8)


# ---- mixed rows: float32 x, 16-bit y (Note [float32 residual stream]) -------------------------
# CUDA against the CPU backend (itself checked against float64 in test_tensor_nn_fused.py) on the
# same inputs: forward layernorm_forward_mixed_v3 (C % 8 == 0, aligned, C <= 3072) or _v2 (the
# rest, or BT_CUDA_NN_VERSION=2), backward layernorm_backward_v6 on mixed rows (sm_80+, rows of
# whole words) or v2 with scalar loads.  Shapes: GPT-2's 768 and 3072 rows, rows v3 / v6 decline (7,
# 1001, 4096 for v3), more rows than the backward's persistent grid (2053).
MIXED_SHAPES = [(37, 768), (9, 3072), (5, 7), (6, 1001), (3, 4096), (2053, 768)]


def _mixed_leaves(arrays, dtypes, device):
    out = []
    for a, d in zip(arrays, dtypes):
        t = bt.tensor(a, dtype=d).to(device)
        out.append(t.requires_grad_(True))
    return out


def _mixed_chain(arrays, half, device, sum_grad, stream_grad=None):
    """x (float32) -> add_layer_norm(x, r1, w1, b1, rb) -> add_layer_norm(s1, r2, w2) with
    16-bit outputs; loss = <y1, g1> + <y2, g2> (+ <s2, gs>: the float32-gradient path);
    stream_grad: the add_layer_norms' stream_grad_dtype."""
    x, r1, r2, w1, b1, rb, w2, g1, g2, gs = arrays
    dts = [bt.float32, half, half, bt.float32, bt.float32, bt.float32, bt.float32]
    leaves = _mixed_leaves([x, r1, r2, w1, b1, rb, w2], dts, device)
    xt, r1t, r2t, w1t, b1t, rbt, w2t = leaves
    kw = {"out_dtype": half, "stream_grad_dtype": stream_grad}
    s1, y1 = bt.add_layer_norm(xt, r1t, w1t, b1t, residual_bias=rbt, **kw)
    s2, y2 = bt.add_layer_norm(s1, r2t, w2t, None, **kw)
    loss = (y1 * bt.tensor(g1, dtype=half).to(device)).float().sum()
    loss = loss + (y2 * bt.tensor(g2, dtype=half).to(device)).float().sum()
    if sum_grad:
        loss = loss + (s2 * bt.tensor(gs, dtype=bt.float32).to(device)).sum()
    loss.backward()
    return [s1, y1, s2, y2], [t.grad for t in leaves]


_MIXED_NOTICE_RUN = """
import numpy as np
import blutrain.tensor as bt
rng = np.random.default_rng(0)
def chain(R, C):  # GPT-2's pair: the first backward has the stream's gradient and a residual bias
    def leaf(shape, dt):
        return bt.tensor(rng.standard_normal(shape), dtype=dt).to("cuda").requires_grad_(True)
    f, h = bt.float32, bt.bfloat16
    x, r1, r2 = leaf((R, C), f), leaf((R, C), h), leaf((R, C), h)
    w1, b1, rb1, w2, b2, rb2 = (leaf((C,), f) for _ in range(6))
    s1, y1 = bt.add_layer_norm(x, r1, w1, b1, residual_bias=rb1, out_dtype=h)
    s2, y2 = bt.add_layer_norm(s1, r2, w2, b2, residual_bias=rb2, out_dtype=h)
    g = bt.tensor(rng.standard_normal((R, C)), dtype=h).to("cuda")
    ((y1 * g).float().sum() + (y2 * g).float().sum()).backward()
    bt.cuda.synchronize()
for _ in range(2):
    chain(300, 768)
    chain(300, 1001)
print(bt._C._notices())
"""


def test_mixed_layer_norm_backward_says_its_v2_fallback_once():
    """Issue 38: the mixed backward's fall to the scalar v2 kernel (about 3x v6's time) is said
    once a shape on stderr, naming C and why (rows v6 cannot take: C = 1001); GPT-2's C = 768
    with the stream's gradient and a residual bias runs v6 (8-warp blocks where the 16-warp
    block's shared memory does not fit: Note [mixed v6 shared memory]) and says nothing.  A
    fresh process, so that no earlier test has said them already."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "BT_CUDA_NN_VERSION"}
    r = subprocess.run(
        [sys.executable, "-c", _MIXED_NOTICE_RUN],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("blutrain.tensor: ")]
    assert len(lines) == 2, r.stderr  # the two backwards of C = 1001 (with / without extra)
    for ln in lines:
        assert "[layer_norm_backward] the float32 residual stream's layer-norm backward" in ln
        assert "C = 1001" in ln and "runs the slow scalar v2 kernel" in ln, ln
        assert "v6 takes rows of whole 16-byte vectors" in ln and "C a multiple of 8" in ln, ln
    assert sum("with the stream's gradient" in ln for ln in lines) == 1, lines
    assert "C = 768" not in r.stderr, r.stderr
    assert r.stdout.strip() == str([ln[len("blutrain.tensor: ") :] for ln in lines])


@pytest.mark.parametrize("half", [bt.bfloat16, bt.float16])
@pytest.mark.parametrize("RC", MIXED_SHAPES, ids=lambda rc: f"{rc[0]}x{rc[1]}")
@pytest.mark.parametrize("version", ["default", "2"])
def test_mixed_layer_norm(rng, monkeypatch, half, RC, version):
    """layer_norm(x float32, out_dtype=16-bit): y within a 16-bit rounding of the CPU's, dx / dw
    / db (float32) to float32 accuracy."""
    if version != "default":
        monkeypatch.setenv("BT_CUDA_NN_VERSION", version)
    R, C = RC
    x, w, b = rng.standard_normal((R, C)) * 3 + 1, rng.standard_normal(C), rng.standard_normal(C)
    g = rng.standard_normal((R, C))
    res = {}
    for dev in ("cuda", "cpu"):
        xt, wt, bt_ = _mixed_leaves([x, w, b], [bt.float32] * 3, dev)
        y = bt.layer_norm(xt, C, wt, bt_, out_dtype=half)
        y.backward(bt.tensor(g, dtype=half).to(dev))
        res[dev] = [y, xt.grad, wt.grad, bt_.grad]
    assert res["cuda"][0].dtype == half and res["cuda"][1].dtype == bt.float32
    _close(res["cuda"][0], res["cpu"][0], half, f"mixed layer_norm {RC} y")
    for i, name in ((1, "dx"), (2, "dw"), (3, "db")):
        _close(res["cuda"][i], res["cpu"][i], bt.float32, f"mixed layer_norm {RC} {name}", 5)


@pytest.mark.parametrize("half", [bt.bfloat16, bt.float16])
@pytest.mark.parametrize("RC", MIXED_SHAPES, ids=lambda rc: f"{rc[0]}x{rc[1]}")
@pytest.mark.parametrize(
    "grad", ["16-bit-stream-grad", "float32-grad", "stream-grad-dtype-float32"]
)
@pytest.mark.parametrize("version", ["default", "2"])
def test_mixed_add_layer_norm(rng, monkeypatch, half, RC, grad, version):
    """Two chained mixed add_layer_norms (residual bias on the first): the float32 sums bitwise
    the CPU's (the same float32 additions in the same order), y within a 16-bit rounding, and
    every gradient (the stream's in 16 bits between the two, or float32 when the last sum has a
    float32 cotangent or with stream_grad_dtype=float32) within the 16-bit tolerance, the float32
    parameters' too."""
    sum_grad = grad == "float32-grad"
    stream_grad = bt.float32 if grad == "stream-grad-dtype-float32" else None
    if version != "default":
        monkeypatch.setenv("BT_CUDA_NN_VERSION", version)
    R, C = RC
    arrays = [rng.standard_normal((R, C)) * 4]
    arrays += [rng.standard_normal((R, C)) for _ in range(2)]
    arrays += [rng.standard_normal(C) for _ in range(4)]
    arrays += [rng.standard_normal((R, C)) for _ in range(3)]
    go, gg = _mixed_chain(arrays, half, "cuda", sum_grad, stream_grad)
    co, cg = _mixed_chain(arrays, half, "cpu", sum_grad, stream_grad)
    assert go[0].dtype == bt.float32 and go[1].dtype == half
    for i in (0, 2):
        assert np.array_equal(_np(go[i]), _np(co[i])), f"mixed add_layer_norm {RC} sum {i}"
    for i in (1, 3):
        _close(go[i], co[i], half, f"mixed add_layer_norm {RC} y {i}")
    names = ["x", "r1", "r2", "w1", "b1", "rb", "w2"]
    for name, a, b in zip(names, gg, cg):
        # 16-bit dx (rounded once per chain link); float32 x with a float32 stream gradient
        tol_dtype = bt.float32 if (grad != "16-bit-stream-grad" and name == "x") else half
        _close(a, b, tol_dtype, f"mixed add_layer_norm {RC} grad {name}", 8)


def test_mixed_add_layer_norm_misaligned_and_deterministic(rng):
    """A float32 x at an odd element offset is not 16-byte aligned: the v2 kernels run; GPT-2's
    shape twice gives bitwise the same parameter gradients (fixed-order reductions)."""
    R, C = 6, 768
    flat = rng.standard_normal(R * C + 1)
    r = rng.standard_normal((R, C))
    outs = {}
    for dev in ("cuda", "cpu"):
        x = bt.tensor(flat, dtype=bt.float32).to(dev).narrow(0, 1, R * C).reshape(R, C)
        rt = bt.tensor(r, dtype=bt.bfloat16).to(dev)
        outs[dev] = bt.add_layer_norm(x, rt, out_dtype=bt.bfloat16)
    assert np.array_equal(_np(outs["cuda"][0]), _np(outs["cpu"][0]))
    _close(outs["cuda"][1], outs["cpu"][1], bt.bfloat16, "misaligned mixed add_layer_norm")
    R = 4099
    x, r, g = (rng.standard_normal((R, C)) for _ in range(3))
    w, b, rb = (rng.standard_normal(C) for _ in range(3))
    res = []
    for _ in range(2):
        xt, wt, bt_, rbt = _mixed_leaves([x, w, b, rb], [bt.float32] * 4, "cuda")
        rt = bt.tensor(r, dtype=bt.bfloat16).to("cuda").requires_grad_(True)
        _, y = bt.add_layer_norm(xt, rt, wt, bt_, residual_bias=rbt, out_dtype=bt.bfloat16)
        y.backward(bt.tensor(g, dtype=bt.bfloat16).to("cuda"))
        res.append([_np(t.grad) for t in (xt, rt, wt, bt_, rbt)])
    for a, b2 in zip(res[0], res[1]):
        assert np.array_equal(a, b2), "mixed layer-norm backward is not deterministic"
