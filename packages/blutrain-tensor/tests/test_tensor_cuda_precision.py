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
    assert errs["highest"] < 5e-6, f"'highest' is not true fp32: {errs}"
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
