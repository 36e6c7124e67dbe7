"""GPU precision tests: matmul / bmm / linear / linear_gelu on CUDA against the CPU backend and
float64, the float32 matmul precision modes (TF32 engaged or not), and bf16 Linear policies."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

FLOATS = [bt.float64, bt.float32, bt.bfloat16, bt.float16]
TOL = {bt.float64: 1e-12, bt.float32: 2e-5, bt.bfloat16: 2e-2, bt.float16: 3e-3}
# cuBLASLt's GELU / DGELU epilogues in float64 agree with the CPU to ~2e-10 (measured on the H200:
# 4e-11..1.9e-10 relative), not to float64 rounding: the tolerance grows by sqrt(1e7) there.
EPILOGUE_SLACK = {bt.float64: 1e7}


@pytest.fixture(autouse=True)
def _restore_precision():
    prev = bt.get_float32_matmul_precision()
    yield
    bt.set_float32_matmul_precision(prev)


def _np(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().to(bt.float64).numpy()


def _gelu_tanh(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def _close(got: bt.Tensor, ref: np.ndarray, dtype, what: str, k: int = 1) -> None:
    g = _np(got)
    assert np.isfinite(g).all(), f"{what}: non-finite output"
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(g - ref).max() / scale
    tol = TOL[dtype] * max(1.0, np.sqrt(k) / 16)
    assert err <= tol, f"{what} {dtype}: max rel err {err:.3g} > {tol:.3g}"


def _pair(rng, shape, dtype, scale=1.0):
    a = bt.tensor(rng.standard_normal(shape) * scale, dtype=bt.float64).to(dtype)
    return a, a.to("cuda")


# ---- matmul / bmm / linear vs CPU, every float dtype, transposed operands -------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 33, 5), (64, 128, 96), (1025, 17, 3)])
def test_matmul_vs_cpu(rng, dtype, ta, tb, m, k, n):
    a_c, a_g = _pair(rng, (k, m) if ta else (m, k), dtype)
    b_c, b_g = _pair(rng, (n, k) if tb else (k, n), dtype)
    if ta:
        a_c, a_g = a_c.T, a_g.T
    if tb:
        b_c, b_g = b_c.T, b_g.T
    ref = _np(a_c) @ _np(b_c)
    out = bt.matmul(a_g, b_g)
    assert out.device == "cuda:0" and out.dtype == dtype and out.shape == (m, n)
    _close(out, ref, dtype, f"matmul ta={ta} tb={tb}", k)
    _close(out, _np(bt.matmul(a_c, b_c)), dtype, "matmul gpu vs cpu", k)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("tb", [False, True])
def test_bmm_vs_cpu(rng, dtype, tb):
    a_c, a_g = _pair(rng, (3, 9, 20), dtype)
    b_c, b_g = _pair(rng, (3, 11, 20) if tb else (3, 20, 11), dtype)
    if tb:
        b_c, b_g = b_c.transpose(1, 2), b_g.transpose(1, 2)
    out = bt.bmm(a_g, b_g)
    _close(out, np.matmul(_np(a_c), _np(b_c)), dtype, f"bmm tb={tb}", 20)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_matmul_broadcast_batch(rng, dtype):
    a_c, a_g = _pair(rng, (2, 3, 5, 8), dtype)
    b_c, b_g = _pair(rng, (8, 4), dtype)
    _close(bt.matmul(a_g, b_g), _np(a_c) @ _np(b_c), dtype, "matmul 4-D x 2-D", 8)
    c_c, c_g = _pair(rng, (3, 8, 6), dtype)
    _close(bt.matmul(a_g, c_g), np.matmul(_np(a_c), _np(c_c)), dtype, "matmul bcast batch", 8)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_fwd_bwd_vs_cpu(rng, dtype, bias):
    xs = [_pair(rng, (4, 7, 48), dtype), _pair(rng, (24, 48), dtype, 0.2)]
    if bias:
        xs.append(_pair(rng, (24,), dtype))
    cpu = [c.detach().requires_grad_(True) for c, _ in xs]
    gpu = [g.detach().requires_grad_(True) for _, g in xs]
    gy_c, gy_g = _pair(rng, (4, 7, 24), dtype)
    y_c = bt.linear(*cpu)
    y_g = bt.linear(*gpu)
    _close(y_g, _np(y_c), dtype, "linear fwd", 48)
    y_c.backward(gy_c)
    y_g.backward(gy_g)
    for name, c, g in zip(["dx", "dW", "db"], cpu, gpu, strict=False):
        assert g.grad.device == "cuda:0" and g.grad.dtype == dtype
        _close(g.grad, _np(c.grad), dtype, f"linear {name}", 28)


def test_empty_matmul():
    a = bt.zeros(0, 5, device="cuda")
    b = bt.zeros(5, 3, device="cuda")
    assert bt.matmul(a, b).shape == (0, 3)
    c = bt.matmul(bt.zeros(4, 0, device="cuda"), bt.zeros(0, 3, device="cuda"))
    assert np.array_equal(_np(c), np.zeros((4, 3)))


# ---- TF32 vs highest -------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["matmul", "linear", "linear_gelu", "bmm"])
def test_tf32_engaged_only_in_high(rng, op):
    a = rng.standard_normal((4, 128, 512)) if op == "bmm" else rng.standard_normal((256, 512))
    b = rng.standard_normal((4, 512, 128)) if op == "bmm" else rng.standard_normal((192, 512))
    ta = bt.tensor(a, dtype=bt.float32, device="cuda")
    tb = bt.tensor(b, dtype=bt.float32, device="cuda")
    if op in ("matmul",):
        ref, run = a @ b.T, lambda: bt.matmul(ta, tb.T)
    elif op == "bmm":
        ref, run = np.matmul(a, b), lambda: bt.bmm(ta, tb)
    elif op == "linear":
        ref, run = a @ b.T, lambda: bt.linear(ta, tb)
    else:
        ref, run = _gelu_tanh(a @ b.T), lambda: bt.linear_gelu(ta, tb)
    errs = {}
    for p in ("highest", "high"):
        bt.set_float32_matmul_precision(p)
        errs[p] = np.abs(_np(run()) - ref).max() / np.abs(ref).max()
    assert errs["highest"] < 5e-6, f"'highest' is not fp32-accurate: {errs}"
    assert errs["high"] > 2e-5, f"'high' did not engage TF32 (error looks like fp32): {errs}"
    assert errs["high"] < 5e-3, f"'high' error too large for TF32: {errs}"


def test_tf32_backward_also_follows(rng):
    x = bt.tensor(rng.standard_normal((256, 512)), dtype=bt.float32, device="cuda")
    w = bt.tensor(rng.standard_normal((192, 512)), dtype=bt.float32, device="cuda")
    g = rng.standard_normal((256, 192))
    ref_dx = g @ _np(w)
    errs = {}
    for p in ("highest", "high"):
        bt.set_float32_matmul_precision(p)
        xx = x.detach().requires_grad_(True)
        bt.linear(xx, w).backward(bt.tensor(g, dtype=bt.float32, device="cuda"))
        errs[p] = np.abs(_np(xx.grad) - ref_dx).max() / np.abs(ref_dx).max()
    assert errs["highest"] < 5e-6 and 2e-5 < errs["high"] < 5e-3, errs


# ---- linear_gelu on CUDA --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16, bt.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (7, 40, 24), (1025, 64, 72), (16, 768, 3072)])
def test_linear_gelu_cuda_vs_cpu(rng, dtype, bias, M, K, N):
    xs = [_pair(rng, (M, K), dtype), _pair(rng, (N, K), dtype, 1 / np.sqrt(K))]
    if bias:
        xs.append(_pair(rng, (N,), dtype))
    cpu = [c.detach().requires_grad_(True) for c, _ in xs]
    gpu = [g.detach().requires_grad_(True) for _, g in xs]
    gy_c, gy_g = _pair(rng, (M, N), dtype)
    y_c, y_g = bt.linear_gelu(*cpu), bt.linear_gelu(*gpu)
    assert y_g.dtype == dtype and y_g.device == "cuda:0"
    e = EPILOGUE_SLACK.get(dtype, 1)
    _close(y_g, _np(y_c), dtype, "linear_gelu fwd", K * e)
    # composed reference on the GPU (it rounds the pre-activation to 16 bits before the GELU: one
    # more rounding than the fused epilogue, so at least a few ulps of slack even at K = 1)
    _close(
        y_g,
        _np(bt.gelu(bt.linear(*gpu), "tanh")),
        dtype,
        "linear_gelu vs composed",
        max(K, 1024) * e,
    )
    y_c.backward(gy_c)
    y_g.backward(gy_g)
    for name, c, g in zip(["dx", "dW", "db"], cpu, gpu, strict=False):
        assert g.grad.dtype == dtype
        _close(g.grad, _np(c.grad), dtype, f"linear_gelu {name}", max(M, N) * e)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16, bt.float64], ids=str)
@pytest.mark.parametrize("biases", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("M,K,N1,N2", [(1, 1, 1, 1), (7, 40, 24, 8), (1025, 64, 256, 64)])
def test_linear_gelu_linear_cuda_vs_cpu(rng, dtype, biases, M, K, N1, N2):
    xs = [
        _pair(rng, (M, K), dtype),
        _pair(rng, (N1, K), dtype, 1 / np.sqrt(K)),
        _pair(rng, (N1,), dtype) if biases[0] else (None, None),
        _pair(rng, (N2, N1), dtype, 1 / np.sqrt(N1)),
        _pair(rng, (N2,), dtype) if biases[1] else (None, None),
    ]
    cpu = [c.detach().requires_grad_(True) if c is not None else None for c, _ in xs]
    gpu = [g.detach().requires_grad_(True) if g is not None else None for _, g in xs]
    gy_c, gy_g = _pair(rng, (M, N2), dtype)
    y_c, y_g = bt.linear_gelu_linear(*cpu), bt.linear_gelu_linear(*gpu)
    assert y_g.dtype == dtype and y_g.device == "cuda:0"
    e = EPILOGUE_SLACK.get(dtype, 1)
    _close(y_g, _np(y_c), dtype, "linear_gelu_linear fwd", max(K, N1) * e)
    y_c.backward(gy_c)
    y_g.backward(gy_g)
    for name, c, g in zip(["dx", "dW1", "db1", "dW2", "db2"], cpu, gpu, strict=True):
        if c is None:
            continue
        assert g.grad.dtype == dtype and g.grad.device == "cuda:0"
        _close(g.grad, _np(c.grad), dtype, f"linear_gelu_linear {name}", max(M, N1, N2) * e)


def test_linear_gelu_3d_noncontiguous(rng):
    x_c, x_g = _pair(rng, (2, 9, 32), bt.float32)
    w_c, w_g = _pair(rng, (32, 16), bt.float32)  # weight given as a transposed view
    y = bt.linear_gelu(x_g[:, ::2], w_g.T)
    ref = _gelu_tanh(_np(x_c)[:, ::2] @ _np(w_c))
    _close(y, ref, bt.float32, "linear_gelu strided", 32)


# ---- policies on the GPU ----------------------------------------------------------------------
def test_bf16_linear_policy_cuda(rng):
    lin = nn.Linear(64, 32)
    ref = nn.Linear(64, 32)  # float32 CPU reference with the same weights
    ref.load_state_dict(lin.state_dict())
    for name, p in list(lin._parameters.items()):
        setattr(lin, name, nn.Parameter(p.to("cuda")))
    lin.set_precision(bt.amp.bf16())
    x = bt.tensor(rng.standard_normal((8, 64)), dtype=bt.float32)
    y = lin(x.to("cuda"))
    assert y.dtype == bt.bfloat16 and y.device == "cuda:0"
    y_ref = ref(x)
    _close(y, _np(y_ref), bt.bfloat16, "bf16 Linear fwd", 64)
    y.float().sum().backward()
    y_ref.sum().backward()
    assert lin.weight.grad.dtype == bt.float32 and lin.weight.grad.device == "cuda:0"
    _close(lin.weight.grad, _np(ref.weight.grad), bt.bfloat16, "bf16 Linear dW", 8)
    _close(lin.bias.grad, _np(ref.bias.grad), bt.bfloat16, "bf16 Linear db", 8)


def test_checkpoint_dropout_cuda(rng):
    w = bt.tensor(rng.standard_normal((16, 16)), dtype=bt.float32, device="cuda")
    w.requires_grad_(True)

    def f(x):
        return bt.dropout(bt.linear_gelu(x, w), 0.3, True)

    x0 = rng.standard_normal((8, 16))
    grads = []
    for ck in (False, True):
        bt.manual_seed(7)
        w.grad = None
        x = bt.tensor(x0, dtype=bt.float32, device="cuda", requires_grad=True)
        y = bt.checkpoint(f, x) if ck else f(x)
        (y * y).sum().backward()
        grads.append((_np(y), _np(x.grad), _np(w.grad)))
    np.testing.assert_array_equal(grads[0][0], grads[1][0])  # same dropout mask, same GEMMs
    for a, b in zip(grads[0][1:], grads[1][1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ---- linear_gelu_linear: our dgelu kernel vs cuBLASLt's epilogue, recompute --------------------
# impl "kernel": dh GEMM + our fused du = dh * gelu'(pre) (+ db1) kernel (v2 where N1 is a multiple
# of 16 bytes of the dtype, else v1); "kernel_v1" forces the reference kernel; "cublaslt" the
# DGELU(_BGRAD) epilogue. float32/64 forwards: GEMM + the GeluTanh kernel unless "cublaslt".
LGL_IMPLS = ["kernel", "kernel_v1", "cublaslt"]
# (M, K, N1, N2): N1 = 24 is v2 for every dtype; 33 and 7 force v1 (not a vector multiple).
LGL_SMALL = [(1, 1, 1, 1), (7, 40, 24, 8), (5, 16, 33, 7), (3, 8, 7, 2)]
# v2's partial column strips and row chunks: N1 = 520 (bf16: 65 vectors = 3 strips, the last a
# single vector), 1025 / 4099 rows (64-row chunks with a tail: 17 / 65 chunks).
LGL_LARGE = [(1025, 64, 256, 64), (600, 32, 520, 16), (4099, 16, 3072, 8)]


@pytest.fixture
def lgl_impl():
    prev = bt._tensor._get_linear_gelu_linear_impl()
    yield bt._tensor._set_linear_gelu_linear_impl
    bt._tensor._set_linear_gelu_linear_impl(prev)


def _dgelu_tanh(z: np.ndarray) -> np.ndarray:
    k, c = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(k * (z + c * z**3))
    return 0.5 * (1 + t) + 0.5 * k * z * (1 - t * t) * (1 + 3 * c * z * z)


def _lgl_inputs(rng, dtype, M, K, N1, N2, b1=True, b2=True):
    """(cpu, gpu) pairs of the leaves x, W1, b1, W2, b2 (None pairs without bias), and of dy."""
    xs = [
        _pair(rng, (M, K), dtype),
        _pair(rng, (N1, K), dtype, 1 / np.sqrt(K)),
        _pair(rng, (N1,), dtype) if b1 else (None, None),
        _pair(rng, (N2, N1), dtype, 1 / np.sqrt(N1)),
        _pair(rng, (N2,), dtype) if b2 else (None, None),
    ]
    return xs, _pair(rng, (M, N2), dtype)


def _lgl_fp64(xs, gy):
    """float64 [y, dx, dW1, db1, dW2, db2] and each one's magnitude scale (the same sums over
    absolute values: the rounding-error scale, robust to cancellation in a single element)."""
    x, w1, b1, w2, b2 = (None if c is None else _np(c) for c, _ in xs)
    dy = _np(gy[0])
    b1 = np.zeros(w1.shape[0]) if b1 is None else b1
    b2 = np.zeros(w2.shape[0]) if b2 is None else b2
    pre = x @ w1.T + b1
    h = _gelu_tanh(pre)
    y = h @ w2.T + b2
    gp = _dgelu_tanh(pre)
    du = (dy @ w2) * gp
    # Magnitudes of h and gelu'(pre): the sums of their formulas' absolute terms (gelu = z/2 (1 +
    # t) cancels in the negative tail, where 1 + t is tiny), plus how far they move when pre is
    # rounded on its own scale apre (16 bits when saved or recomputed): gelu' apre, gelu'' apre
    k, c = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(k * (pre + c * pre**3))
    apre = np.abs(x) @ np.abs(w1.T) + np.abs(b1)
    g2 = (_dgelu_tanh(pre + 1e-4) - _dgelu_tanh(pre - 1e-4)) / 2e-4
    agp = 0.5 * (1 + np.abs(t)) + 0.5 * k * np.abs(pre) * (1 - t * t) * (1 + 3 * c * pre * pre)
    adu = (np.abs(dy) @ np.abs(w2)) * (agp + np.abs(g2) * apre)
    ref = [y, du @ w1, du.T @ x, du.sum(0), dy.T @ h, dy.sum(0)]
    ah = 0.5 * np.abs(pre) * (1 + np.abs(t)) + np.abs(gp) * apre
    ax, ady = np.abs(x), np.abs(dy)
    mag = [
        ah @ np.abs(w2.T) + np.abs(b2),
        adu @ np.abs(w1),
        adu.T @ ax,
        adu.sum(0),
        ady.T @ ah,
        ady.sum(0),
    ]
    return ref, [max(m.max(initial=0.0), 1e-30) for m in mag]


def _close_mag(got: bt.Tensor, ref: np.ndarray, mag: float, dtype, what: str, k: int) -> None:
    g = _np(got)
    assert g.shape == ref.shape, f"{what}: shape {g.shape} != {ref.shape}"
    assert np.isfinite(g).all(), f"{what}: non-finite output"
    err = np.abs(g - ref).max(initial=0.0) / mag
    # 16-bit: pre, h, dh and du are each rounded to 16 bits before the compared value, a chain of
    # roundings: twice one op's tolerance
    chain = 2.0 if dtype in (bt.bfloat16, bt.float16) else 1.0
    tol = chain * TOL[dtype] * max(1.0, np.sqrt(k) / 16)
    assert err <= tol, f"{what} {dtype}: max err {err:.3g} of the magnitude > {tol:.3g}"


def _lgl_gpu(xs, gy, recompute, needs=None):
    ts = [g if g is None else g.detach().requires_grad_(True) for _, g in xs]
    if needs is not None:
        for t, n in zip(ts, needs, strict=True):
            if t is not None:
                t.requires_grad_(n)
    y = bt.linear_gelu_linear(*ts, recompute=recompute)
    y.backward(gy[1])
    return y, [None if t is None or not t.requires_grad else t.grad for t in ts]


GRAD_NAMES = ["dx", "dW1", "db1", "dW2", "db2"]


def _check_lgl(xs, gy, dtype, impl, recompute, with_cpu):
    M, K = xs[0][0].shape
    N1, N2 = xs[1][0].shape[0], xs[3][0].shape[0]
    y, grads = _lgl_gpu(xs, gy, recompute)
    ref, mag = _lgl_fp64(xs, gy)
    assert y.dtype == dtype and y.device == "cuda:0"
    e = EPILOGUE_SLACK.get(dtype, 1) if impl == "cublaslt" else 1
    tag = f"lgl[{impl}, recompute={recompute}]"
    _close_mag(y, ref[0], mag[0], dtype, f"{tag} fwd vs fp64", max(K, N1) * e)
    for name, g, r, m in zip(GRAD_NAMES, grads, ref[1:], mag[1:], strict=True):
        if g is None:
            continue
        assert g.dtype == dtype and g.device == "cuda:0", name
        _close_mag(g, r, m, dtype, f"{tag} {name} vs fp64", max(M, N1, N2) * e)
    if not with_cpu:
        return
    # vs the CPU backend (blutrain-linalg's DGELU epilogue there)
    cpu = [c if c is None else c.detach().requires_grad_(True) for c, _ in xs]
    y_c = bt.linear_gelu_linear(*cpu, recompute=recompute)
    y_c.backward(gy[0])
    _close_mag(y, _np(y_c), mag[0], dtype, f"{tag} fwd vs CPU", max(K, N1) * e)
    for name, g, c, m in zip(GRAD_NAMES, grads, cpu, mag[1:], strict=True):
        if g is not None:
            _close_mag(g, _np(c.grad), m, dtype, f"{tag} {name} vs CPU", max(M, N1, N2) * e)


@pytest.mark.parametrize("impl", LGL_IMPLS)
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16, bt.float64], ids=str)
@pytest.mark.parametrize("biases", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("M,K,N1,N2", LGL_SMALL)
def test_lgl_impls_small(rng, lgl_impl, impl, dtype, biases, recompute, M, K, N1, N2):
    lgl_impl(impl)
    xs, gy = _lgl_inputs(rng, dtype, M, K, N1, N2, *biases)
    _check_lgl(xs, gy, dtype, impl, recompute, with_cpu=True)


@pytest.mark.parametrize("impl", LGL_IMPLS)
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float16, bt.float64], ids=str)
@pytest.mark.parametrize("M,K,N1,N2", LGL_LARGE)
def test_lgl_impls_large(rng, lgl_impl, impl, dtype, M, K, N1, N2):
    lgl_impl(impl)
    xs, gy = _lgl_inputs(rng, dtype, M, K, N1, N2)
    _check_lgl(xs, gy, dtype, impl, False, with_cpu=M < 2000)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16], ids=str)
def test_lgl_kernel_grown_chunks(rng, lgl_impl, dtype):
    # > 65535 chunks of 64 rows: the chunk grows (grid.y limit). Exact arithmetic so a lost or
    # doubled row shows: x = 0 and b1 = 0 give pre = 0, gelu'(0) = 0.5; W2 = 1 and dy in {0, 1}
    # give du = 0.5 dy, so db1[j] = 0.5 * (number of ones in dy), exact in float32.
    lgl_impl("kernel")
    M, N1 = 65536 * 64 + 101, 8
    ones = rng.integers(0, 2, (M, 1)).astype(np.float64)
    x = bt.zeros(M, 1, dtype=dtype, device="cuda")
    w1 = bt.tensor(rng.standard_normal((N1, 1)), dtype=dtype, device="cuda")
    b1 = bt.zeros(N1, dtype=dtype, device="cuda", requires_grad=True)
    w2 = bt.ones(1, N1, dtype=dtype, device="cuda")
    y = bt.linear_gelu_linear(x, w1, b1, w2)
    y.backward(bt.tensor(ones, dtype=dtype, device="cuda"))
    want = bt.tensor(np.full(N1, 0.5 * ones.sum()), dtype=bt.float64).to(dtype)
    np.testing.assert_array_equal(_np(b1.grad), _np(want))


@pytest.mark.parametrize("impl", ["kernel", "kernel_v1"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float64], ids=str)
@pytest.mark.parametrize("M,K,N1,N2", [(7, 40, 24, 8), (5, 16, 33, 7), (1025, 64, 256, 64)])
def test_lgl_recompute_bitwise_cuda(rng, lgl_impl, impl, dtype, M, K, N1, N2):
    # Same device, same backward kernels: recompute only changes where h comes from. float32/64
    # run GEMM + GeluTanh kernel in both forwards -> every bit equal. bf16 without recompute uses
    # the GELU_AUX epilogue (h from the fp32 accumulator), so only close.
    lgl_impl(impl)
    xs, gy = _lgl_inputs(rng, dtype, M, K, N1, N2)
    y0, g0 = _lgl_gpu(xs, gy, False)
    y1, g1 = _lgl_gpu(xs, gy, True)
    if dtype == bt.bfloat16:
        _, mag = _lgl_fp64(xs, gy)
        _close_mag(y1, _np(y0), mag[0], dtype, "lgl bf16 recompute fwd", max(K, N1))
        for name, a, b, m in zip(GRAD_NAMES, g0, g1, mag[1:], strict=True):
            _close_mag(b, _np(a), m, dtype, f"lgl bf16 recompute {name}", max(M, N1, N2))
        return
    np.testing.assert_array_equal(_np(y0), _np(y1))
    for name, a, b in zip(GRAD_NAMES, g0, g1, strict=True):
        np.testing.assert_array_equal(_np(a), _np(b), err_msg=name)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16], ids=str)
def test_lgl_kernel_deterministic_and_v1_agrees(rng, lgl_impl, monkeypatch, dtype):
    # v2's db1 (chunked, fixed order) is the same bits run to run, and with one row in flight per
    # thread instead of four; v1/v2's du are the same elementwise formula, so dx and dW1 agree to
    # GEMM rounding and db1 to summation order.  4099 rows: a last chunk of 3.
    xs, gy = _lgl_inputs(rng, dtype, 4099, 16, 3072, 8)
    lgl_impl("kernel")
    _, ga = _lgl_gpu(xs, gy, False)
    _, gb = _lgl_gpu(xs, gy, False)
    monkeypatch.setenv("BT_CUDA_DGELU_ROWS", "1")
    _, g1 = _lgl_gpu(xs, gy, False)
    monkeypatch.delenv("BT_CUDA_DGELU_ROWS")
    for name, a, b, c in zip(GRAD_NAMES, ga, gb, g1, strict=True):
        np.testing.assert_array_equal(_np(a), _np(b), err_msg=name)
        np.testing.assert_array_equal(_np(a), _np(c), err_msg=f"{name} (one row in flight)")
    lgl_impl("kernel_v1")
    _, gv = _lgl_gpu(xs, gy, False)
    _, mag = _lgl_fp64(xs, gy)
    for name, a, b, m in zip(GRAD_NAMES, ga, gv, mag[1:], strict=True):
        _close_mag(a, _np(b), m, dtype, f"lgl v2 vs v1 {name}", 64)


@pytest.mark.parametrize("impl", LGL_IMPLS)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(
    "needs",
    [
        (False, False, False, True, True),  # only W2/b2: the dgelu GEMM does not run
        (False, True, False, False, False),  # only W1: dgelu without bgrad
        (True, False, True, False, False),  # dx and db1
    ],
)
def test_lgl_partial_grads_cuda(rng, lgl_impl, impl, recompute, needs):
    lgl_impl(impl)
    xs, gy = _lgl_inputs(rng, bt.float32, 33, 24, 40, 12)
    _, grads = _lgl_gpu(xs, gy, recompute, needs)
    ref, mag = _lgl_fp64(xs, gy)
    for name, n, g, r, m in zip(GRAD_NAMES, needs, grads, ref[1:], mag[1:], strict=True):
        assert (g is not None) == n, name
        if n:
            _close_mag(g, r, m, bt.float32, f"lgl partial {name}", 64)


@pytest.mark.parametrize("impl", LGL_IMPLS)
@pytest.mark.parametrize("recompute", [False, True])
def test_lgl_noncontiguous_cuda(rng, lgl_impl, impl, recompute):
    # 3-D strided input, transposed weights, a non-contiguous dy
    lgl_impl(impl)
    x_c, x_g = _pair(rng, (3, 10, 16), bt.float32)
    w1_c, w1_g = _pair(rng, (16, 32), bt.float32, 0.25)  # used as .T: (32, 16)
    w2_c, w2_g = _pair(rng, (32, 8), bt.float32, 0.2)  # used as .T: (8, 32)
    b1_c, b1_g = _pair(rng, (32,), bt.float32)
    g_c, g_g = _pair(rng, (3, 8, 5), bt.float32)  # transposed to (3, 5, 8)
    leaves = [t.detach().requires_grad_(True) for t in (x_g, w1_g, b1_g, w2_g)]
    xg, w1g, b1g, w2g = leaves
    y = bt.linear_gelu_linear(xg[:, ::2], w1g.T, b1g, w2g.T, None, recompute=recompute)
    assert y.shape == (3, 5, 8)
    y.backward(g_g.transpose(1, 2))
    x, w1, b1, w2 = _np(x_c)[:, ::2].reshape(-1, 16), _np(w1_c).T, _np(b1_c), _np(w2_c).T
    dy = _np(g_c).transpose(0, 2, 1).reshape(-1, 8)
    pre = x @ w1.T + b1
    h = _gelu_tanh(pre)
    _close(y, (h @ w2.T).reshape(3, 5, 8), bt.float32, "lgl strided fwd", 32)
    du = (dy @ w2) * _dgelu_tanh(pre)
    dx = np.zeros((3, 10, 16))
    dx[:, ::2] = (du @ w1).reshape(3, 5, 16)
    _close(xg.grad, dx, bt.float32, "lgl strided dx", 32)
    _close(w1g.grad, (du.T @ x).T, bt.float32, "lgl strided dW1", 32)
    _close(b1g.grad, du.sum(0), bt.float32, "lgl strided db1", 32)
    _close(w2g.grad, (dy.T @ h).T, bt.float32, "lgl strided dW2", 32)


def test_lgl_empty_rows_cuda(lgl_impl):
    # M = 0: db1 must be zeros (not the allocator's garbage), the weight grads zeros
    for impl in LGL_IMPLS:
        lgl_impl(impl)
        ts = [
            bt.zeros(0, 8, device="cuda"),
            bt.ones(16, 8, device="cuda"),
            bt.ones(16, device="cuda"),
            bt.ones(4, 16, device="cuda"),
            bt.ones(4, device="cuda"),
        ]
        ts = [t.requires_grad_(True) for t in ts]
        y = bt.linear_gelu_linear(*ts)
        assert y.shape == (0, 4)
        y.sum().backward()
        for t in ts[1:]:
            assert np.all(_np(t.grad) == 0), impl
