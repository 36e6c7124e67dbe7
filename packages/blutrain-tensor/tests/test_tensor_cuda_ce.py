"""GPU tests of the v3 cross-entropy kernels (nn_kernels.cuh crossentropy_forward_v3,
nn_fused_kernels.cuh crossentropy_backward_v3: a block per row, 16-byte streaming loads, exp as
FFMA + MUFU ex2).  BT_CUDA_NN_VERSION=3 (the default) selects them for fp32 / bf16 / fp16 logits;
2 selects the block-per-row v2 kernels (float64's; the v1 references are in
bench/nn_v1_kernels.cuh).  Loss and gradient are checked against a float64 numpy reference on
the same (dtype-rounded) logits, and against v2: odd class counts (head / tail elements around
the 16-byte words), GPT-2's vocabulary, rows read in place from strided / padded logits (padding
poisoned with NaN / inf), ignore_index, label smoothing, every reduction, masked (-inf) logits,
NaN propagation, large logits, out-of-range targets and determinism.  The memory pool is filled
with NaN before each run so an element a kernel fails to write shows up."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import gradient_probe

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

DTYPES = [bt.float32, bt.bfloat16, bt.float16]
# relative to max |ref|: the output rounding of the dtype (the math is fp32 in every version)
TOL = {bt.float32: 2e-5, bt.bfloat16: 1e-2, bt.float16: 2e-3}
V_GPT, VP_GPT = 50257, 50304


def _np(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().to(bt.float64).numpy()


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    """x as the kernels see it (rounded to dtype), in float64."""
    return _np(bt.tensor(x, dtype=dtype))


def _poison_pool(nbytes: int) -> None:
    """Fills (and frees) pool memory with NaN, so fresh outputs start as NaN, not zeros."""
    n = max(1, nbytes // 4)
    p = bt.full((n,), float("nan"), dtype=bt.float32, device="cuda")
    bt.cuda.synchronize()
    del p


def _close(got: np.ndarray, ref: np.ndarray, tol: float, what: str, floor: float = 1e-4) -> None:
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin), f"{what}: non-finite mismatch"
    # floor: the scale errors are measured at when the reference is tiny.  A gradient
    # (p - onehot) * cot is rounded at |cot| (fp32: p - 1 is exact to ~1e-7 only): an all-zero
    # (C == 1) or near one-hot (C == 2, p ~ 1e-4) gradient passes floor = 1e-2 max |cot|.  A zero
    # loss (C == 1) comes out as lse - x with lse rounded at the logits' scale: losses pass
    # floor = max |logit| (the log2-domain lse is exact to a few ulp of it, not of 0).
    scale = max(np.abs(ref[fin]).max(initial=0), floor)
    err = np.abs(got[fin] - ref[fin]).max(initial=0) / scale
    assert err <= tol, f"{what}: max error {err:.3g} (relative to max |ref| {scale:.3g})"


def gfloor(cot) -> float:
    return 1e-2 * float(np.abs(np.asarray(cot, dtype=np.float64)).max(initial=1e-2))


def _ref(x, t, C, ii, reduction, ls, cot):
    """float64 loss and d(loss * cot)/dx for logits x (N, Cx >= C; columns >= C are padding)."""
    N = x.shape[0]
    xr = x[:, :C]
    valid = t != ii
    tt = np.where(valid, t, 0)
    with np.errstate(invalid="ignore", over="ignore"):
        m = xr.max(1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        lse = m + np.log(np.exp(xr - m).sum(1, keepdims=True))
        fin = np.where(np.isfinite(xr), xr, 0)  # masked (-inf) logits: sum_x over finite ones
        row = (1 - ls) * (lse[:, 0] - xr[np.arange(N), tt]) + ls * (lse[:, 0] - fin.mean(1))
    row = np.where(valid, row, 0.0)
    nv = valid.sum()
    if reduction == "none":
        loss, sc = row, np.asarray(cot, dtype=np.float64)
    elif reduction == "sum":
        loss, sc = row.sum(), np.full(N, float(cot))
    else:
        loss, sc = row.sum() / nv, np.full(N, float(cot) / nv)
    onehot = np.zeros_like(xr)
    onehot[np.arange(N), tt] = 1
    with np.errstate(invalid="ignore"):
        d = (np.exp(xr - lse) - (1 - ls) * onehot - ls / C) * (sc * valid)[:, None]
    d = np.where(valid[:, None], d, 0.0)
    g = np.zeros(x.shape)
    g[:, :C] = d
    return np.asarray(loss, dtype=np.float64), g


def _run(
    monkeypatch,
    ver,
    x,
    t,
    dtype,
    *,
    C=None,
    start=0,
    ii=-100,
    reduction="mean",
    ls=0.0,
    loss_dtype=None,
    cot=None,
    padded=False,
):
    """Loss and logits gradient on CUDA with BT_CUDA_NN_VERSION=ver.  The logits are columns
    [start, start + C) of a (N, Cx) leaf: read in place (strided rows); padded=True gives the
    padded path (loss on leaf * 1.0 narrowed: one backward kernel writes the (N, Cx) gradient)."""
    monkeypatch.setenv("BT_CUDA_NN_VERSION", str(ver))
    N, Cx = x.shape
    C = Cx - start if C is None else C
    X = bt.tensor(x, dtype=dtype).to("cuda").requires_grad_(True)
    src = X * 1.0 if padded else X
    lg = src if (start == 0 and C == Cx) else src.narrow(1, start, C)
    _poison_pool(4 * N * Cx * 4)
    loss = bt.cross_entropy(
        lg,
        bt.tensor(t, dtype=bt.int64).to("cuda"),
        ignore_index=ii,
        reduction=reduction,
        label_smoothing=ls,
        loss_dtype=loss_dtype,
    )
    if cot is None:
        cot = np.random.default_rng(7).standard_normal(loss.shape)
    c = bt.tensor(np.asarray(cot), dtype=loss.dtype)
    (loss * c.to("cuda")).sum().backward()
    return loss, _np(loss), _np(X.grad), _np(c)  # the cotangent as used (rounded to loss dtype)


def _targets(rng, N, C, ii=-100):
    t = rng.integers(0, C, N)
    if N > 2:
        t[[0, N // 2]] = ii
    t[-1] = C - 1  # the last class: a tail element for most C
    return t


SHAPES = [
    (1, 1),
    (3, 2),
    (5, 7),
    (4, 8),
    (6, 9),
    (7, 33),
    (5, 257),
    (9, 1025),
    (3, 4099),
    (4, V_GPT),
]
RED_LS = [("mean", 0.0), ("sum", 0.1), ("none", 0.1), ("none", 0.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("NC", SHAPES)
@pytest.mark.parametrize("red_ls", RED_LS)
def test_ce_v3_vs_float64(rng, monkeypatch, dtype, NC, red_ls):
    N, C = NC
    reduction, ls = red_ls
    x = rng.standard_normal((N, C)) * 3
    t = _targets(rng, N, C)
    loss, lo, g, cot = _run(monkeypatch, 3, x, t, dtype, reduction=reduction, ls=ls)
    assert loss.dtype == dtype
    rl, rg = _ref(_rounded(x, dtype), t, C, -100, reduction, ls, cot)
    _close(lo, rl, TOL[dtype], f"ce v3 {NC} {reduction} {ls} loss", floor=np.abs(x).max())
    _close(g, rg, 2 * TOL[dtype], f"ce v3 {NC} {reduction} {ls} grad", floor=gfloor(cot))


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("NC", [(9, V_GPT), (17, 1030), (6, 13)])
def test_ce_v3_matches_v2(rng, monkeypatch, dtype, NC):
    N, C = NC
    x = rng.standard_normal((N, C)) * 2
    t = _targets(rng, N, C)
    res = {v: _run(monkeypatch, v, x, t, dtype, reduction="none", ls=0.1) for v in (3, 2)}
    _close(res[3][1], res[2][1], TOL[dtype], f"ce v3 vs v2 loss {NC}")
    _close(res[3][2], res[2][2], 2 * TOL[dtype], f"ce v3 vs v2 grad {NC}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "start_C_Cx",
    [(0, 1000, 1040), (3, 1001, 1040), (1, 7, 1040), (5, 50257, 50304), (0, 50257, 50304)],
)
def test_ce_v3_strided_rows(rng, monkeypatch, dtype, start_C_Cx):
    """Rows read in place at every alignment (row stride Cx, column offset start); the gradient
    of the narrowed logits is dense (N, C) (v3 where rows keep their alignment, else v2)."""
    start, C, Cx = start_C_Cx
    N = 5
    x = rng.standard_normal((N, Cx)) * 2
    x[:, :start] = np.nan  # outside the view: must not be read
    x[:, start + C :] = np.inf
    t = _targets(rng, N, C)
    _, lo, g, cot = _run(monkeypatch, 3, x, t, dtype, C=C, start=start, reduction="none", ls=0.1)
    rl, rg = _ref(_rounded(x[:, start : start + C], dtype), t, C, -100, "none", 0.1, cot)
    _close(lo, rl, TOL[dtype], f"ce v3 strided {start_C_Cx} loss")
    assert np.all(g[:, :start] == 0) and np.all(g[:, start + C :] == 0)
    _close(g[:, start : start + C], rg, 2 * TOL[dtype], f"ce v3 strided {start_C_Cx} grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "NCCp", [(7, V_GPT, VP_GPT), (5, 1025, 1032), (9, 13, 20), (3, 8, 9), (4, 1, 8), (6, 16, 24)]
)
def test_ce_v3_padded(rng, monkeypatch, dtype, reduction, NCCp):
    """GPT-2's head: loss on the first C columns of (N, Cp), padded (N, Cp) gradient in one pass
    (v3 backward: zero padding columns, straddling words), padding poisoned with NaN / inf."""
    N, C, Cp = NCCp
    x = rng.standard_normal((N, Cp)) * 2
    x[:, C:] = np.nan
    x[0, C:] = np.inf
    t = _targets(rng, N, C, ii=-1)
    ld = bt.float32 if dtype != bt.float32 else None
    loss, lo, g, cot = _run(
        monkeypatch,
        3,
        x,
        t,
        dtype,
        C=C,
        ii=-1,
        reduction=reduction,
        ls=0.1,
        loss_dtype=ld,
        padded=True,
    )
    node = loss.grad_fn.next_functions[0][0].name()
    assert node == "Mul", f"expected the padded path (loss reads X * 1.0), got {node}"
    assert g.shape == (N, Cp) and np.all(g[:, C:] == 0), "padding gradient must be 0"
    rl, rg = _ref(_rounded(x, dtype), t, C, -1, reduction, 0.1, cot)
    fl = np.abs(x[np.isfinite(x)]).max()
    _close(lo, rl, TOL[bt.float32] if ld else TOL[dtype], f"ce v3 padded {NCCp} loss", floor=fl)
    _close(g, rg, 2 * TOL[dtype], f"ce v3 padded {NCCp} grad", floor=gfloor(cot))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_v3_masked_logits(rng, monkeypatch, dtype):
    """-inf logits (masked classes) count for nothing and get zero gradient; with no label
    smoothing the loss is finite (as PyTorch; the CPU backend gives NaN there: 0 * inf)."""
    N, C = 6, 2053
    x = rng.standard_normal((N, C)) * 2
    x[:, ::3] = -np.inf
    x[1, 1:40] = -np.inf  # a run of -inf at the row start (the first words are all -inf)
    t = rng.integers(0, C // 3, N) * 3 + 1
    t[1] = 41
    _, lo, g, cot = _run(monkeypatch, 3, x, t, dtype, reduction="none")
    rl, rg = _ref(_rounded(x, dtype), t, C, -100, "none", 0.0, cot)
    _close(lo, rl, TOL[dtype], "ce v3 masked loss")
    assert np.all(g[:, ::3] == 0)
    _close(g, rg, 2 * TOL[dtype], "ce v3 masked grad")


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_ce_v3_nan_propagates(rng, monkeypatch, dtype):
    N, C = 4, 3001
    x = rng.standard_normal((N, C))
    x[2, 1234] = np.nan
    t = rng.integers(0, C, N)
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "3")
    with bt.no_grad():
        lo = _np(
            bt.cross_entropy(
                bt.tensor(x, dtype=dtype).to("cuda"),
                bt.tensor(t, dtype=bt.int64).to("cuda"),
                reduction="none",
            )
        )
    assert np.isnan(lo[2]) and np.isfinite(np.delete(lo, 2)).all(), lo
    rl, _ = _ref(_rounded(np.delete(x, 2, 0), dtype), np.delete(t, 2), C, -100, "none", 0, 0)
    _close(np.delete(lo, 2), rl, TOL[dtype], "ce v3 rows next to a NaN row")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [40.0, 1e-3])
def test_ce_v3_logit_scales(rng, monkeypatch, dtype, scale):
    """Large logits (exp range, a new running max late in the row) and near-uniform ones."""
    N, C = 5, 10007
    x = rng.standard_normal((N, C)) * scale
    x[0] = np.sort(x[0])  # increasing: the running max changes at every word
    x[1, -1] = x[1].max() + 5 * scale  # the max in the tail
    t = _targets(rng, N, C)
    _, lo, g, cot = _run(monkeypatch, 3, x, t, dtype, reduction="none", ls=0.1)
    rl, rg = _ref(_rounded(x, dtype), t, C, -100, "none", 0.1, cot)
    _close(lo, rl, TOL[dtype], f"ce v3 scale {scale} loss")
    _close(g, rg, 2 * TOL[dtype], f"ce v3 scale {scale} grad")


def test_ce_v3_many_rows_mean(rng, monkeypatch):
    """Many blocks (row counts not a multiple of anything), bf16 logits, float32 loss."""
    N, C = 4099, 1000
    x = rng.standard_normal((N, C)) * 2
    t = _targets(rng, N, C)
    _, lo, g, cot = _run(monkeypatch, 3, x, t, bt.bfloat16, loss_dtype=bt.float32)
    rl, rg = _ref(_rounded(x, bt.bfloat16), t, C, -100, "mean", 0.0, cot)
    _close(lo, rl, 1e-5, "ce v3 many rows loss")
    _close(g, rg, 2 * TOL[bt.bfloat16], "ce v3 many rows grad")


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_ce_v3_deterministic(rng, monkeypatch, dtype):
    N, C = 64, V_GPT
    x = rng.standard_normal((N, C))
    t = _targets(rng, N, C)
    a = _run(monkeypatch, 3, x, t, dtype, ls=0.1)
    b = _run(monkeypatch, 3, x, t, dtype, ls=0.1)
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_ce_v3_all_ignored(monkeypatch):
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "3")
    x = bt.zeros((4, 9), dtype=bt.bfloat16).to("cuda").requires_grad_(True)
    t = bt.tensor(np.full(4, -100), dtype=bt.int64).to("cuda")
    _poison_pool(1 << 16)
    loss = bt.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert float(_np(loss)) == 0 and np.all(_np(x.grad) == 0)
    assert np.isnan(_np(bt.cross_entropy(x.detach(), t)))


def test_ce_v3_target_out_of_range_raises(monkeypatch):
    monkeypatch.setenv("BT_CUDA_NN_VERSION", "3")
    x = bt.zeros((4, 9)).to("cuda")
    loss = bt.cross_entropy(x, bt.tensor(np.array([0, 9, -100, 3]), dtype=bt.int64).to("cuda"))
    with pytest.raises(IndexError, match="cross_entropy"):
        loss.item()
    ok = bt.cross_entropy(x, bt.tensor(np.array([0, 8, -100, 3]), dtype=bt.int64).to("cuda"))
    assert np.isfinite(ok.item())
    ln = bt.cross_entropy(
        bt.zeros((4, 9), dtype=bt.bfloat16).to("cuda"),
        bt.tensor(np.array([0, -5, 1, 2])).to("cuda"),
        reduction="none",
    )
    with pytest.raises(IndexError, match="cross_entropy"):
        ln.cpu()
    # a target in the padding of a padded vocabulary (C classes, not Cp)
    X = bt.zeros((2, 16)).to("cuda").requires_grad_(True)
    lp = bt.cross_entropy((X * 1.0).narrow(1, 0, 10), bt.tensor(np.array([1, 12])).to("cuda"))
    with pytest.raises(IndexError, match="cross_entropy"):
        bt.cuda.synchronize()
    del lp


# ---- dlogits written over dropped logits (Note [donating a saved input], primitives.h) -------
def _head_grads(dtype, hx, w, t, keep, C):
    """GPT-2's padded head on the GPU: full = h @ W^T through a probe that records where its
    gradient arrives; the loss on full's first C columns.  Returns the leaves' gradients,
    whether the gradient came back in the logits' memory, and the held logits' change."""
    probe, seen = gradient_probe()
    h = bt.tensor(hx, dtype=dtype, device="cuda", requires_grad=True)
    W = bt.tensor(w, dtype=dtype, device="cuda", requires_grad=True)
    full = probe(bt.linear(h, W))
    ptr = full.data_ptr()
    logits = full.narrow(1, 0, C) if full.shape[1] > C else full
    tt = bt.tensor(t, dtype=bt.int64, device="cuda")
    loss = bt.cross_entropy(logits, tt, ignore_index=-1, label_smoothing=0.1, loss_dtype=bt.float32)
    before = _np(logits) if keep else None
    held = logits if keep else None
    del full, logits
    loss.backward()
    changed = keep and not np.array_equal(_np(held), before)
    return _np(h.grad), _np(W.grad), seen[-1] == ptr, changed


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, Cp", [(V_GPT, VP_GPT), (1001, 1001)])
def test_ce_backward_over_dropped_logits_bitwise(rng, monkeypatch, version, dtype, C, Cp):
    monkeypatch.setenv("BT_CUDA_NN_VERSION", str(version))
    N, K = 96, 32
    hx, w = rng.standard_normal((N, K)), rng.standard_normal((Cp, K)) * 0.3
    t = _targets(rng, N, C, ii=-1)
    _poison_pool(N * Cp * 4)
    gh, gw, donated, _ = _head_grads(dtype, hx, w, t, False, C)
    _poison_pool(N * Cp * 4)
    rh, rw, donated_ref, changed = _head_grads(dtype, hx, w, t, True, C)
    assert donated and not donated_ref and not changed
    assert np.array_equal(gh, rh) and np.array_equal(gw, rw)
    assert np.all(gw[C:] == 0)


def test_ce_backward_over_dropped_logits_memory(rng):
    # the gradient takes the logits' memory: backward's peak above its start is the (small)
    # head gradients, not another (N, Cp) tensor
    N, K, Cp = 2048, 64, VP_GPT
    peaks = {}
    for keep in (False, True):
        h = bt.tensor(
            rng.standard_normal((N, K)), dtype=bt.bfloat16, device="cuda", requires_grad=True
        )
        W = bt.tensor(
            rng.standard_normal((Cp, K)) * 0.1, dtype=bt.bfloat16, device="cuda", requires_grad=True
        )
        logits = bt.linear(h, W).narrow(1, 0, V_GPT)
        t = bt.tensor(_targets(rng, N, V_GPT), dtype=bt.int64, device="cuda")
        loss = bt.cross_entropy(logits, t, loss_dtype=bt.float32)
        held = logits if keep else None  # noqa: F841
        del logits
        bt.cuda.synchronize()
        start = bt.cuda.memory_allocated()
        bt.cuda.reset_peak_memory_stats()
        loss.backward()
        bt.cuda.synchronize()
        peaks[keep] = bt.cuda.max_memory_allocated() - start
    nbytes = N * Cp * 2
    assert peaks[True] >= nbytes and peaks[False] <= peaks[True] - 0.9 * nbytes, (peaks, nbytes)
