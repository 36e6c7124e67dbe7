"""CPU GEMM against float64 numpy: shapes, transposes, batches, modes, epilogues, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blutrain.linalg as bl

from linalg_ref import TOL, dgelu64, gelu64, rel_err

# Sizes that catch blocking/vectorisation edge cases: 1, primes, non-multiples of 8.
SIZES = [1, 2, 3, 7, 13, 31, 64, 97, 130]
RNG = np.random.default_rng(20261130)


def rand(*shape, dtype=np.float32, rng=RNG):
    return rng.standard_normal(shape).astype(dtype)


def ref_mm(a, b, transa=False, transb=False):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if transa:
        a = np.swapaxes(a, -1, -2)
    if transb:
        b = np.swapaxes(b, -1, -2)
    return a @ b


# ---- plain products ------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 7, 64, 97])
@pytest.mark.parametrize("n", [1, 13, 130])
@pytest.mark.parametrize("k", [1, 31, 130])
@pytest.mark.parametrize("transa", [False, True])
@pytest.mark.parametrize("transb", [False, True])
def test_fp32_shapes_and_transposes(m, n, k, transa, transb):
    a = rand(*((k, m) if transa else (m, k)))
    b = rand(*((n, k) if transb else (k, n)))
    d = bl.matmul(a, b, transa=transa, transb=transb)
    assert isinstance(d, np.ndarray) and d.dtype == np.float32 and d.shape == (m, n)
    assert rel_err(d, ref_mm(a, b, transa, transb)) < TOL["fp32"]


@settings(max_examples=40, deadline=None)
@given(
    m=st.sampled_from(SIZES),
    n=st.sampled_from(SIZES),
    k=st.sampled_from(SIZES),
    batch=st.sampled_from([1, 2, 5]),
    transa=st.booleans(),
    transb=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_batched(m, n, k, batch, transa, transb, seed):
    rng = np.random.default_rng(seed)
    a = rand(batch, *((k, m) if transa else (m, k)), rng=rng)
    b = rand(batch, *((n, k) if transb else (k, n)), rng=rng)
    d = bl.matmul(a, b, transa=transa, transb=transb)
    assert d.shape == (batch, m, n)
    assert rel_err(d, ref_mm(a, b, transa, transb)) < TOL["fp32"]


def test_batch_broadcast_of_a_2d_operand():
    a = rand(4, 9, 13)
    b = rand(13, 5)
    d = bl.matmul(a, b)
    assert d.shape == (4, 9, 5)
    assert rel_err(d, ref_mm(a, b)) < TOL["fp32"]
    d2 = bl.matmul(b.T.copy(), a.transpose(0, 2, 1))  # (5, 13) @ (4, 13, 9)
    assert rel_err(d2, ref_mm(b.T, a.transpose(0, 2, 1))) < TOL["fp32"]


def test_transposed_views_and_row_strides_are_taken_without_copies():
    big = rand(40, 50)
    a = big[3:20, 5:36]  # rows strided by 50: ld 50 for a (17, 31) matrix
    b = rand(23, 31).T  # a Fortran-ordered view: taken as transposed storage
    assert not a.flags.c_contiguous and b.flags.f_contiguous
    d = bl.matmul(a, b)
    assert rel_err(d, ref_mm(a, b)) < TOL["fp32"]
    # Non-BLAS strides (neither last stride is 1) are copied for numpy inputs.
    c = rand(30, 40)[::2, ::2]
    e = rand(20, 6)
    assert rel_err(bl.matmul(c, e), ref_mm(c, e)) < TOL["fp32"]


def test_alpha_beta_and_in_place_accumulate():
    a, b, c = rand(17, 29), rand(29, 11), rand(17, 11)
    d = bl.matmul(a, b, c=c, alpha=0.5, beta=-2.0)
    assert rel_err(d, 0.5 * ref_mm(a, b) - 2.0 * c.astype(np.float64)) < TOL["fp32"]
    acc = c.copy()
    out = bl.matmul(a, b, c=acc, out=acc)  # beta defaults to 1 with c: acc += a @ b
    assert out is acc
    assert rel_err(acc, ref_mm(a, b) + c) < TOL["fp32"]


def test_k_zero_and_empty_shapes():
    a, b = np.zeros((5, 0), np.float32), np.zeros((0, 3), np.float32)
    d = bl.matmul(a, b)
    assert d.shape == (5, 3) and np.all(d == 0)
    c = rand(5, 3)
    np.testing.assert_allclose(bl.matmul(a, b, c=c, beta=3.0), 3.0 * c, rtol=1e-6)
    assert bl.matmul(np.zeros((0, 4), np.float32), rand(4, 3)).shape == (0, 3)


def test_float64():
    a, b = rand(33, 17, dtype=np.float64), rand(17, 9, dtype=np.float64)
    d = bl.matmul(a, b)
    assert d.dtype == np.float64
    assert rel_err(d, a @ b) < TOL["f64"]


# ---- modes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 31), (64, 97, 130), (130, 64, 257)])
def test_modes_against_float64(mode, shape):
    m, n, k = shape
    a, b = rand(m, k), rand(k, n)
    d = bl.matmul(a, b, mode=mode)
    assert d.dtype == np.float32
    err = rel_err(d, ref_mm(a, b))
    assert err < TOL[mode], (mode, err)
    if mode != "fp32" and k >= 31:
        # The reduced modes really round the operands (else this test could not fail).
        assert err > 1e-5, (mode, err)


def test_fp16_inputs_and_output_dtypes():
    a, b = rand(31, 64).astype(np.float16), rand(64, 13).astype(np.float16)
    d = bl.matmul(a, b)
    assert d.dtype == np.float16
    assert rel_err(d, ref_mm(a, b)) < TOL["fp16"]
    d32 = bl.matmul(a, b, dtype=np.float32)
    assert d32.dtype == np.float32
    assert rel_err(d32, ref_mm(a, b)) < 1e-5  # fp32 accumulation, no output rounding
    d16 = bl.matmul(rand(31, 64), rand(64, 13), dtype="float16")
    assert d16.dtype == np.float16


try:
    import torch
except ImportError:  # the torch-based tests skip; the numpy ones still run
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (CPU)")


@needs_torch
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
def test_torch_cpu_tensors_round_trip(dt):
    tdt = getattr(torch, dt)
    a = torch.randn(37, 70, dtype=tdt)
    b = torch.randn(70, 19, dtype=tdt)
    d = bl.matmul(a, b)
    assert isinstance(d, torch.Tensor) and d.dtype == tdt and tuple(d.shape) == (37, 19)
    tol = {"bfloat16": TOL["bf16"], "float16": TOL["fp16"], "float32": TOL["fp32"]}[dt]
    assert rel_err(d.double().numpy(), a.double().numpy() @ b.double().numpy()) < tol
    # bf16 inputs, fp32 output: fp32 accumulation is visible (error far below bf16's 4e-3).
    if dt == "bfloat16":
        d32 = bl.matmul(a, b, dtype=torch.float32)
        assert d32.dtype == torch.float32
        assert rel_err(d32.numpy(), a.double().numpy() @ b.double().numpy()) < 1e-5


@needs_torch
def test_matmul_plan_reruns_a_signature_on_new_operands(monkeypatch):
    # matmul_plan: the general path's plan handed to the caller (blutrain-compiler's GEMMs on
    # blutrain tensors), rerun on new operands of the same signature without the general path;
    # same bits as matmul. Strided operands (a transposed view, an offset slice) and a bias.
    def np64(t):
        return t.double().numpy()

    def operands():
        a = torch.randn(40, 29).t()
        b = torch.randn(17, 48)[:, 3:43]
        return a, b, torch.randn(17), torch.empty(29, 17)

    a, b, bias, out = operands()
    plan = bl.matmul_plan(a, b, transb=True, bias=bias, out=out)
    ref = bl.matmul(a, b, transb=True, bias=bias)
    assert torch.equal(out, ref)
    monkeypatch.setattr(bl, "_matmul_slow", None)
    for _ in range(2):
        a, b, bias, out = operands()
        plan.run(a, b, out, None, bias, None, None, None)
        z = np64(a) @ np64(b).T + np64(bias)
        assert rel_err(np64(out), z) < TOL["fp32"]
    monkeypatch.undo()
    assert torch.equal(out, bl.matmul(a, b, transb=True, bias=bias))
    with pytest.raises(ValueError, match=r"matmul_plan needs out="):
        bl.matmul_plan(a, b, transb=True)


@needs_torch
def test_torch_repeat_calls_reuse_a_plan_and_stay_correct(monkeypatch):
    # A repeated signature of torch operands runs from a cached plan (the hot path of training
    # loops); it must see new data, new pointers and allocate new outputs each call.
    def np64(t):
        return t.double().numpy()

    outs = []
    for i in range(3):
        a, b = torch.randn(29, 40), torch.randn(17, 40)
        if i == 1:  # the repeat must not take the general path
            monkeypatch.setattr(bl, "_matmul_slow", None)
        d = bl.matmul(a, b, transb=True)
        assert rel_err(np64(d), np64(a) @ np64(b).T) < TOL["fp32"]
        outs.append(d)
    monkeypatch.undo()
    assert outs[0].data_ptr() != outs[1].data_ptr()
    # Same shapes, other strides: a transposed view and a row-padded view take their own plans.
    a = torch.randn(40, 29).t()
    b = torch.randn(17, 48)[:, :40]
    d = bl.matmul(a, b, transb=True)
    assert rel_err(np64(d), np64(a) @ np64(b).T) < TOL["fp32"]
    # Into out=, with bias, aux and bias-gradient epilogues, twice each.
    for _ in range(2):
        x, w, bias = torch.randn(33, 24), torch.randn(19, 24), torch.randn(19)
        out, pre = torch.empty(33, 19), torch.empty(33, 19)
        r = bl.matmul(x, w, transb=True, bias=bias, epilogue="bias_gelu_aux", out=out, aux=pre)
        assert r[0] is out and r[1] is pre
        z = np64(x) @ np64(w).T + np64(bias)
        assert rel_err(np64(pre), z) < TOL["fp32"]
        assert rel_err(np64(out), gelu64(z)) < 2 * TOL["fp32"]
        y, p2 = bl.matmul(x, w, transb=True, bias=bias, epilogue="bias_gelu_aux")
        assert rel_err(np64(y), gelu64(z)) < 2 * TOL["fp32"] and p2.data_ptr() != pre.data_ptr()
        dy = torch.randn(33, 19)
        dw, db = bl.matmul(dy, x, transa=True, epilogue="bgrad_a")
        assert rel_err(np64(dw), np64(dy).T @ np64(x)) < TOL["fp32"]
        assert rel_err(np64(db), np64(dy).sum(0)) < TOL["fp32"]
    # In place (c is out) accumulates each call.
    a, b = torch.randn(8, 5), torch.randn(5, 6)
    acc = torch.zeros(8, 6)
    for _ in range(3):
        bl.matmul(a, b, c=acc, out=acc)
    assert rel_err(np64(acc), 3 * (np64(a) @ np64(b))) < TOL["fp32"]
    # A signature that once worked still fails loudly when a checked property changes.
    with pytest.raises(ValueError, match=r"out must be \(8, 6\)"):
        bl.matmul(a, b, out=torch.empty(8, 7))
    with pytest.raises(TypeError, match=r"the inputs must share a dtype"):
        bl.matmul(a, b.double())
    with pytest.raises(ValueError, match=r"k differs"):
        bl.matmul(a, torch.randn(4, 6))


# ---- epilogues -----------------------------------------------------------------------------------
def _ref_epilogue(epi, z, bias=None, aux=None):
    z = np.asarray(z, np.float64)
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    pre = z
    if "gelu" in epi and epi not in ("dgelu", "dgelu_bgrad"):
        z = gelu64(z)
    if epi in ("dgelu", "dgelu_bgrad"):
        z = z * dgelu64(aux)
    return z, pre


@pytest.mark.parametrize("epi", ["bias", "gelu", "bias_gelu", "gelu_aux", "bias_gelu_aux"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 31), (97, 64, 130)])
@pytest.mark.parametrize("transb", [False, True])
def test_forward_epilogues(epi, shape, transb):
    m, n, k = shape
    a = rand(m, k)
    b = rand(n, k) if transb else rand(k, n)
    bias = rand(n) if "bias" in epi else None
    r = bl.matmul(a, b, transb=transb, bias=bias, epilogue=epi)
    want, pre = _ref_epilogue(epi, ref_mm(a, b, False, transb), bias)
    if epi.endswith("_aux"):
        d, aux = r
        assert aux.shape == (m, n) and aux.dtype == np.float32
        assert rel_err(aux, pre) < TOL["fp32"]
    else:
        d = r
    assert rel_err(d, want) < 2 * TOL["fp32"]


@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 31), (97, 64, 130)])
def test_dgelu_and_its_bias_grad(shape):
    m, n, k = shape
    a, b, pre = rand(m, k), rand(k, n), rand(m, n)
    d = bl.matmul_dgelu(a, b, pre)
    want = ref_mm(a, b) * dgelu64(pre)
    assert rel_err(d, want) < 2 * TOL["fp32"]
    d2, bgrad = bl.matmul_dgelu(a, b, pre, bias_grad=True)
    assert rel_err(d2, want) < 2 * TOL["fp32"]
    assert bgrad.shape == (n,)
    assert rel_err(bgrad, want.sum(axis=0)) < 1e-5


@pytest.mark.parametrize("transa", [False, True])
@pytest.mark.parametrize("transb", [False, True])
def test_bgrad_a_and_b(transa, transb):
    m, n, k = 13, 7, 31
    a = rand(k, m) if transa else rand(m, k)
    b = rand(n, k) if transb else rand(k, n)
    oa = ref_mm(a, np.eye(k), transa)  # op(a) in float64
    ob = ref_mm(np.eye(k), b, False, transb)
    d, ga = bl.matmul(a, b, transa=transa, transb=transb, epilogue="bgrad_a")
    assert rel_err(d, ref_mm(a, b, transa, transb)) < TOL["fp32"]
    assert ga.shape == (m,) and rel_err(ga, oa.sum(axis=1)) < 1e-6
    _, gb = bl.matmul(a, b, transa=transa, transb=transb, epilogue="bgrad_b")
    assert gb.shape == (n,) and rel_err(gb, ob.sum(axis=0)) < 1e-6


@needs_torch
def test_mlp_forward_and_backward_against_torch_autograd():
    """linear(gelu) -> linear, backward through matmul_dgelu and linear_backward."""
    rows, c, h = 37, 24, 40
    x = torch.randn(rows, c, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(h, c, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(h, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(c, h, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(c, dtype=torch.float64, requires_grad=True)
    hid = torch.nn.functional.gelu(x @ w1.T + b1, approximate="tanh")
    y = hid @ w2.T + b2
    dy = torch.randn_like(y)
    y.backward(dy)

    f = lambda t: t.detach().numpy().astype(np.float32)  # noqa: E731
    hid_, pre = bl.linear(f(x), f(w1), f(b1), activation="gelu", save_preact=True)
    y_ = bl.linear(hid_, f(w2), f(b2))
    assert rel_err(y_, y.detach().numpy()) < 1e-5
    dhid_in, dw2, db2 = bl.linear_backward(f(dy), hid_, f(w2))
    assert rel_err(dw2, w2.grad.numpy()) < 1e-5
    assert rel_err(db2, b2.grad.numpy()) < 1e-5
    dpre, db1 = bl.matmul_dgelu(f(dy), f(w2), pre, bias_grad=True)
    assert rel_err(db1, b1.grad.numpy()) < 1e-5
    dx, dw1, _ = bl.linear_backward(dpre, f(x), f(w1), need_bias_grad=False)
    assert rel_err(dx, x.grad.numpy()) < 1e-5
    assert rel_err(dw1, w1.grad.numpy()) < 1e-5
    assert rel_err(dhid_in * dgelu64(pre), dpre) < 1e-5


def test_linear_leading_dims_and_batched_epilogue():
    x = rand(2, 3, 16)
    w, b = rand(8, 16), rand(8)
    y = bl.linear(x, w, b)
    assert y.shape == (2, 3, 8)
    assert rel_err(y, x.astype(np.float64) @ w.T.astype(np.float64) + b) < TOL["fp32"]
    d, aux = bl.matmul(rand(3, 5, 7), rand(7, 4), bias=rand(4), epilogue="bias_gelu_aux")
    assert d.shape == aux.shape == (3, 5, 4)
    np.testing.assert_allclose(d, gelu64(aux), rtol=1e-5, atol=1e-6)


# ---- NaN / Inf -----------------------------------------------------------------------------------
@pytest.mark.parametrize("epi", ["none", "bias_gelu"])
def test_nan_and_inf_propagate(epi):
    a, b = rand(9, 12), np.abs(rand(12, 5)) + 0.1
    a[2, 3] = np.nan
    a[5, :] = np.abs(a[5, :])
    a[5, 7] = np.inf
    bias = rand(5) if epi != "none" else None
    d = bl.matmul(a, b, bias=bias, epilogue=epi)
    assert np.all(np.isnan(d[2]))
    assert np.all(np.isposinf(d[5]))
    others = np.delete(d, [2, 5], axis=0)
    assert np.all(np.isfinite(others))
    # beta = 0 must not read C: NaN in out is overwritten, not propagated.
    out = np.full((9, 5), np.nan, np.float32)
    a2 = rand(9, 12)
    bl.matmul(a2, b, out=out)
    assert np.all(np.isfinite(out))


# ---- bad input ---------------------------------------------------------------------------------
def test_error_k_differs_names_the_shapes():
    with pytest.raises(ValueError) as e:
        bl.matmul(np.zeros((64, 32), np.float32), np.zeros((16, 8), np.float32))
    assert str(e.value) == "[gemm] A is (64, 32) and B is (16, 8): k differs (32 vs 16)"


@pytest.mark.parametrize(
    "call, exc, text",
    [
        (
            lambda: bl.matmul(np.zeros((2, 3), np.int32), np.zeros((3, 2), np.float32)),
            TypeError,
            "[gemm] A has dtype int32",
        ),
        (
            lambda: bl.matmul(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float64)),
            TypeError,
            "must share a dtype",
        ),
        (
            lambda: bl.matmul(np.zeros(3, np.float32), np.zeros((3, 2), np.float32)),
            ValueError,
            "[gemm] A is (3,): expected 2 or 3 dimensions",
        ),
        (
            lambda: bl.matmul(np.zeros((2, 3, 4), np.float32), np.zeros((3, 4, 5), np.float32)),
            ValueError,
            "batch differs (2 vs 3)",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float32),
                np.zeros((3, 4), np.float32),
                out=np.zeros((2, 5), np.float32),
            ),
            ValueError,
            "out must be (2, 4), got (2, 5)",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float32),
                np.zeros((3, 4), np.float32),
                out=np.zeros((4, 2), np.float32).T,
            ),
            ValueError,
            "rows must have unit stride",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float32),
                np.zeros((3, 4), np.float32),
                bias=np.zeros(3, np.float32),
            ),
            ValueError,
            "bias must have 4 values, got (3,)",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), epilogue="dgelu"
            ),
            ValueError,
            "needs aux=",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), epilogue="relu"
            ),
            ValueError,
            "unknown epilogue 'relu'",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), mode="int8"
            ),
            ValueError,
            "unknown mode 'int8'",
        ),
        (
            lambda: bl.matmul(
                np.zeros((2, 3), np.float16), np.zeros((3, 4), np.float16), mode="tf32"
            ),
            ValueError,
            "mode 'tf32' applies to float32 inputs",
        ),
        (
            lambda: bl.matmul(np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), beta=1.0),
            ValueError,
            "beta=1.0 needs c=",
        ),
        (
            lambda: bl.linear(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32)),
            ValueError,
            "[linear] x is (2, 3) and weight is (4, 5): in_features differs (3 vs 5)",
        ),
    ],
)
def test_bad_input_raises_clear_errors(call, exc, text):
    with pytest.raises(exc) as e:
        call()
    assert text in str(e.value)
    assert str(e.value).startswith("[")


def test_raw_entry_checks_leading_dimensions_and_pointers():
    from blutrain.linalg import _linalg as L

    a = np.zeros((4, 8), np.float32)
    op = (a.ctypes.data, 8, 0, L.F32)
    with pytest.raises(
        ValueError,
        match=r"\[gemm\] A is stored \(4, 8\) row-major but its row "
        r"stride ld is 4",
    ):
        L.gemm(
            4,
            4,
            8,
            1,
            0,
            0,
            (a.ctypes.data, 4, 0, L.F32),
            op,
            None,
            op,
            1.0,
            0.0,
            0,
            0,
            None,
            None,
            None,
            -1,
            0,
        )
    with pytest.raises(ValueError, match=r"pointer is NULL"):
        L.gemm(
            4,
            8,
            8,
            1,
            0,
            0,
            (0, 8, 0, L.F32),
            op,
            None,
            op,
            1.0,
            0.0,
            0,
            0,
            None,
            None,
            None,
            -1,
            0,
        )
    with pytest.raises(ValueError, match=r"invalid epilogue 42"):
        L.gemm(4, 8, 8, 1, 0, 0, op, op, None, op, 1.0, 0.0, 0, 42, None, None, None, -1, 0)
    with pytest.raises(ValueError, match=r"batch > 1 but D's batch stride is 0"):
        L.gemm(4, 8, 8, 2, 0, 0, op, op, None, op, 1.0, 0.0, 0, 0, None, None, None, -1, 0)


def test_options():
    assert bl.get_option("autotune") in (0, 1)
    bl.set_option("num_threads", 1)
    assert bl.get_option("num_threads") == 1
    with pytest.raises(ValueError, match=r"\[set_option\] unknown option 'nope'"):
        bl.set_option("nope", 1)
    assert bl.cache_path().endswith("cublaslt_algos.txt")


def test_fp32_3xtf32_option_round_trips_and_leaves_the_cpu_alone():
    """The option exists in every build (CUDA or not), defaults on, and does not touch CPU GEMMs
    (true fp32 sgemm there; the 3xTF32 call counter stays put)."""
    prev = bl.get_option("fp32_3xtf32")
    assert prev == 1
    calls = bl.get_option("tf32x3_calls")
    try:
        a = np.random.default_rng(0).standard_normal((33, 20)).astype(np.float32)
        b = np.random.default_rng(1).standard_normal((20, 12)).astype(np.float32)
        for on in (0, 1):
            bl.set_option("fp32_3xtf32", on)
            assert bl.get_option("fp32_3xtf32") == on
            d = bl.matmul(a, b)
            ref = a.astype(np.float64) @ b.astype(np.float64)
            assert np.abs(d - ref).max() / np.abs(ref).max() < 1e-6
        assert bl.get_option("tf32x3_calls") == calls
    finally:
        bl.set_option("fp32_3xtf32", prev)
