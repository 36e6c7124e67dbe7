"""CUDA GEMM (cuBLASLt) against float64 numpy. Marked gpu: skipped where no device is found."""

from __future__ import annotations

import os

import numpy as np
import pytest

import blutrain.linalg as bl

from linalg_ref import TOL, dgelu64, gelu64, rel_err

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

SHAPES = [(1, 1, 1), (7, 13, 31), (97, 64, 130), (257, 131, 67), (512, 768, 384)]


@pytest.fixture(autouse=True)
def _need_cuda_build():
    if not bl.has_cuda():
        pytest.skip("blutrain-linalg was built without CUDA")


def g(*shape, dtype=torch.float32, seed=None):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed if seed is not None else hash(shape) % (2**31))
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def np64(t):
    return t.detach().double().cpu().numpy()


def ref_mm(a, b, transa=False, transb=False):
    a, b = np64(a), np64(b)
    if transa:
        a = np.swapaxes(a, -1, -2)
    if transb:
        b = np.swapaxes(b, -1, -2)
    return a @ b


@pytest.fixture
def tf32x3():
    """Sets the fp32_3xtf32 option for one test (request.param, else on) and restores it."""
    prev = bl.get_option("fp32_3xtf32")
    yield lambda on: bl.set_option("fp32_3xtf32", int(on))
    bl.set_option("fp32_3xtf32", prev)


def x3_calls():
    torch.cuda.synchronize()
    return bl.get_option("tf32x3_calls")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("transa", [False, True])
@pytest.mark.parametrize("transb", [False, True])
@pytest.mark.parametrize("x3", [True, False])
def test_fp32_true(shape, transa, transb, x3, tf32x3):
    tf32x3(x3)
    m, n, k = shape
    a = g(*((k, m) if transa else (m, k)))
    b = g(*((n, k) if transb else (k, n)))
    before = x3_calls()
    d = bl.matmul(a, b, transa=transa, transb=transb)
    assert isinstance(d, torch.Tensor) and d.is_cuda and d.shape == (m, n)
    assert rel_err(np64(d), ref_mm(a, b, transa, transb)) < TOL["fp32"]
    # The 3xTF32 kernel takes operands whose row strides are multiples of 4 (else cuBLAS runs).
    takes = x3 and a.stride(0) % 4 == 0 and b.stride(0) % 4 == 0
    assert x3_calls() == before + int(takes)


def max_err_over_abs_sum(d, a, b, transa=False, transb=False):
    """max |d - ref| / (|a| @ |b|): each element's error on the scale of fp32's own rounding."""
    ref = ref_mm(a, b, transa, transb)
    scale = np.abs(np64(a).T if transa else np64(a)) @ np.abs(np64(b).T if transb else np64(b))
    return float(np.max(np.abs(np64(d) - ref) / scale))


@pytest.mark.parametrize(
    "m, n, k, transa, transb",
    [(512, 2304, 768, False, True), (512, 768, 3072, False, False), (768, 768, 4096, True, False)],
)
def test_3xtf32_error_is_not_above_sgemm(m, n, k, transa, transb, tf32x3):
    """GPT-2's GEMM layouts (forward, dX, dW with split-K): the 3xTF32 kernel's worst error
    against float64 is within 1.5x of cuBLAS SGEMM's (the harness measures it at about half),
    and far below TF32's."""
    a = g(*((k, m) if transa else (m, k)), seed=m + k)
    b = g(*((n, k) if transb else (k, n)), seed=n + k)

    def err(mode=None):
        d = bl.matmul(a, b, transa=transa, transb=transb, mode=mode)
        return max_err_over_abs_sum(d, a, b, transa, transb)

    tf32x3(True)
    before = x3_calls()
    ours = err()
    assert x3_calls() == before + 1
    tf32x3(False)
    sgemm, tf32 = err(), err("tf32")
    assert ours <= 1.5 * sgemm, (ours, sgemm)
    assert ours < tf32 / 50, (ours, tf32)


def test_3xtf32_split_k_batch_beta_in_place_is_deterministic(tf32x3):
    """Few output tiles over a long k run split-K (partials summed in a fixed order): two runs
    give the same bits; a batch with beta accumulating into D in place matches float64."""
    tf32x3(True)
    a, b = g(2, 4096, 136), g(2, 4096, 200)  # dW-like: op(A) = a^T (136 x 4096)
    c = g(2, 136, 200)
    outs = []
    for _ in range(2):
        acc = c.clone()
        bl.matmul(a, b, transa=True, c=acc, out=acc, alpha=0.5, beta=1.0)
        outs.append(acc)
    want = 0.5 * ref_mm(a, b, transa=True) + np64(c)
    assert rel_err(np64(outs[0]), want) < TOL["fp32"]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [256, 2048])  # split-K and one slice
@pytest.mark.parametrize("epi", ["bias_gelu_aux", "bias", "dgelu_bgrad", "linear_backward"])
def test_3xtf32_with_epilogues_matches_sgemm_path(epi, rows, tf32x3):
    """fp32 epilogues run as our kernels after the 3xTF32 GEMM (split-K at 256 rows, one slice
    at 2048): the same results as cuBLAS's fused path to fp32 accuracy."""
    x, w, b = g(rows, 768), g(3072, 768), g(3072)
    dy, pre = g(rows, 3072), g(rows, 768)

    def run():
        if epi == "bias_gelu_aux":
            return list(bl.linear(x, w, b, activation="gelu", save_preact=True))
        if epi == "bias":
            return [bl.linear(x, w, b), bl.linear(x, w, b)]
        if epi == "dgelu_bgrad":
            return list(bl.matmul_dgelu(dy, w, pre, bias_grad=True))
        return list(bl.linear_backward(dy, x, w))

    tf32x3(True)
    before = x3_calls()
    ours = run()
    assert x3_calls() > before
    tf32x3(False)
    theirs = run()
    assert len(ours) == len(theirs) >= 2
    for o, t in zip(ours, theirs):
        assert rel_err(np64(o), np64(t)) < 1e-5


def test_batch_strides_are_part_of_the_cached_problem(tf32x3):
    # Same sizes, alignments and lds; only B's batch stride differs (0: shared). The cached
    # cuBLASLt layouts must not carry one call's batch stride into the other.
    tf32x3(False)  # cuBLASLt's path
    a = g(3, 64, 64)
    for b in (g(3, 64, 64), g(64, 64), g(3, 64, 64)):
        d = bl.matmul(a, b)
        assert rel_err(np64(d), ref_mm(a, b)) < TOL["fp32"]


def test_transposed_views_strided_rows_alpha_beta_in_place():
    big = g(64, 80)
    a = big[3:40, 5:69]  # ld 80
    b = g(30, 64).t()  # column-major view: taken as transposed storage
    c = g(37, 30)
    acc = c.clone()
    bl.matmul(a, b, c=acc, out=acc, alpha=0.5, beta=2.0)
    want = 0.5 * ref_mm(a, b) + 2.0 * np64(c)
    assert rel_err(np64(acc), want) < TOL["fp32"]


def test_k_zero():
    a, b = g(5, 0), g(0, 3)
    d = bl.matmul(a, b)
    assert torch.all(d == 0)
    c = g(5, 3)
    d = bl.matmul(a, b, c=c, beta=2.0)
    assert torch.allclose(d, 2 * c)


# ---- epilogues: fused (cuBLASLt) and unfused (our kernels) against float64 ----------------------
def _ref(epi, z, bias=None, aux=None):
    if bias is not None:
        z = z + bias
    pre = z
    if epi in ("gelu", "bias_gelu", "gelu_aux", "bias_gelu_aux"):
        z = gelu64(z)
    if epi in ("dgelu", "dgelu_bgrad"):
        z = z * dgelu64(aux)
    return z, pre


@pytest.fixture(params=[True, False], ids=["fused", "unfused"])
def fused(request):
    bl.set_option("fused_epilogues", int(request.param))
    yield request.param
    bl.set_option("fused_epilogues", 1)


@pytest.mark.parametrize("epi", ["bias", "gelu", "bias_gelu", "gelu_aux", "bias_gelu_aux"])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (97, 64, 130), (256, 768, 512)])
def test_forward_epilogues(fused, epi, dt, shape):
    m, n, k = shape
    tdt = getattr(torch, dt)
    x, w = g(m, k, dtype=tdt), g(n, k, dtype=tdt)  # linear layout: x @ w.T
    bias = g(n, dtype=tdt) if "bias" in epi else None
    r = bl.matmul(
        x, w, transb=True, bias=bias, epilogue=epi, mode="tf32" if dt == "float32" else None
    )
    want, pre = _ref(epi, ref_mm(x, w, False, True), None if bias is None else np64(bias))
    tol = 2e-3 if dt == "float32" else 2e-2
    if epi.endswith("_aux"):
        d, aux = r
        assert rel_err(np64(aux), pre) < tol
    else:
        d = r
    assert rel_err(np64(d), want) < tol, epi


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (97, 64, 130), (256, 768, 512)])
def test_dgelu_bgrad(fused, dt, shape):
    m, n, k = shape
    tdt = getattr(torch, dt)
    a, b, pre = g(m, k, dtype=tdt), g(k, n, dtype=tdt), g(m, n, dtype=tdt)
    want = ref_mm(a, b) * dgelu64(np64(pre))
    # fp32: 1e-4, not 1e-5: cuBLASLt's fused GELU' may use a faster tanh than float64's.
    tol = 1e-4 if dt == "float32" else 2e-2
    d = bl.matmul_dgelu(a, b, pre)
    assert rel_err(np64(d), want) < tol
    d, bg = bl.matmul_dgelu(a, b, pre, bias_grad=True)
    assert rel_err(np64(d), want) < tol
    assert rel_err(np64(bg), want.sum(axis=0)) < tol


@pytest.mark.parametrize("shape", [(97, 64, 130), (256, 768, 512)])
def test_dgelu_bgrad_float32_bias_grad_of_bf16(fused, shape):
    """A float32 bgrad beside a bf16 D (a float32 master's bias): cuBLASLt 13's heuristic rejects
    the fused DGELU_BGRAD as an invalid value, and the call runs unfused rather than failing."""
    m, n, k = shape
    a, b = g(m, k, dtype=torch.bfloat16), g(k, n, dtype=torch.bfloat16)
    pre = g(m, n, dtype=torch.bfloat16)
    bg = torch.full((n,), float("nan"), dtype=torch.float32, device="cuda")
    d, got = bl.matmul(a, b, aux=pre, epilogue="dgelu_bgrad", bgrad=bg)
    want = ref_mm(a, b) * dgelu64(np64(pre))
    assert got.dtype == torch.float32
    assert rel_err(np64(d), want) < 2e-2
    assert rel_err(np64(got), want.sum(axis=0)) < 2e-2


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("transa", [False, True])
def test_bgrad_a_b(fused, dt, transa):
    tdt = getattr(torch, dt)
    m, n, k = 96, 64, 256
    a = g(k, m, dtype=tdt) if transa else g(m, k, dtype=tdt)
    b = g(k, n, dtype=tdt)
    tol = 1e-5 if dt == "float32" else 2e-2
    d, ga = bl.matmul(a, b, transa=transa, epilogue="bgrad_a")
    opa = np64(a).T if transa else np64(a)
    assert rel_err(np64(d), opa @ np64(b)) < tol
    assert rel_err(np64(ga), opa.sum(axis=1)) < tol
    _, gb = bl.matmul(a, b, transa=transa, epilogue="bgrad_b")
    assert rel_err(np64(gb), np64(b).sum(axis=0)) < tol


def test_linear_backward_matches_torch_autograd():
    x = g(300, 96, seed=1).requires_grad_()
    w = g(160, 96, seed=2).requires_grad_()
    b = g(160, seed=3).requires_grad_()
    y = torch.nn.functional.linear(x, w, b)
    dy = g(300, 160, seed=4)
    y.backward(dy)
    dx, dw, db = bl.linear_backward(dy, x.detach(), w.detach())
    assert rel_err(np64(dx), np64(x.grad)) < 1e-5
    assert rel_err(np64(dw), np64(w.grad)) < 1e-5
    assert rel_err(np64(db), np64(b.grad)) < 1e-5


def test_fused_path_is_taken_for_the_transformer_epilogues():
    bl.set_option("fused_epilogues", 1)
    before = bl.get_option("fallback_epilogues")
    x, w, b = (
        g(256, 768, dtype=torch.bfloat16),
        g(3072, 768, dtype=torch.bfloat16),
        g(3072, dtype=torch.bfloat16),
    )
    bl.linear(x, w, b, activation="gelu", save_preact=True)
    bl.linear(x, w, b)
    torch.cuda.synchronize()
    assert bl.get_option("fallback_epilogues") == before


def test_3xtf32_misaligned_operand_keeps_cublaslt_fused_epilogue(tf32x3):
    """A float32 GEMM whose A the 3xTF32 kernel cannot load (4-byte aligned only) goes to
    cuBLASLt with its fused epilogue: no 3xTF32 call, no unfused fallback, fp32-accurate."""
    tf32x3(True)
    bl.set_option("fused_epilogues", 1)
    base, w, b = g(256 * 768 + 1), g(512, 768), g(512)
    x = base[1:].view(256, 768)  # data_ptr 4 bytes past a 16-byte boundary
    calls, fallbacks = x3_calls(), bl.get_option("fallback_epilogues")
    y, pre = bl.linear(x, w, b, activation="gelu", save_preact=True)
    assert x3_calls() == calls
    assert bl.get_option("fallback_epilogues") == fallbacks
    z = ref_mm(x, w, transb=True) + np64(b)
    assert rel_err(np64(pre), z) < 1e-5
    assert rel_err(np64(y), gelu64(z)) < 1e-5


@pytest.mark.parametrize("x3", [True, False])
def test_nan_inf_propagate(x3, tf32x3):
    tf32x3(x3)
    a, b = g(64, 48), g(48, 32).abs() + 0.1
    a[2, 3] = float("nan")
    a[5] = a[5].abs()
    a[5, 7] = float("inf")
    d = bl.matmul(a, b).cpu()
    assert torch.isnan(d[2]).all()
    # cuBLAS SGEMM keeps +inf; 3xTF32's split turns an infinite operand into NaN (Note [3xTF32]).
    assert torch.isposinf(d[5]).all() if not x3 else (~torch.isfinite(d[5])).all()
    rest = torch.cat([d[:2], d[3:5], d[6:]])
    assert torch.isfinite(rest).all()
    out = torch.full((64, 32), float("nan"), device="cuda")
    bl.matmul(g(64, 48), b, out=out)  # beta = 0: NaN in out is not read
    assert torch.isfinite(out).all()


def test_stream_argument_orders_work_without_host_sync():
    s = torch.cuda.Stream()
    a, b = g(512, 512), g(512, 512)
    s.wait_stream(torch.cuda.current_stream())  # a and b were made on the default stream
    with torch.cuda.stream(s):
        d = bl.matmul(a, b)  # the current torch stream is used
        e = bl.matmul(d, b)
    s.synchronize()
    assert rel_err(np64(e), ref_mm(a, b) @ np64(b)) < 1e-5


def test_autotune_and_persisted_cache(tmp_path):
    path = str(tmp_path / "algos.txt")
    bl.set_cache_path(path)
    try:
        bl.set_option("autotune", 1)
        a, b = g(384, 256), g(256, 320)
        d = bl.matmul(a, b, mode="tf32")
        assert rel_err(np64(d), ref_mm(a, b)) < TOL["tf32"]
        assert os.path.exists(path)
        lines = [ln for ln in open(path) if not ln.startswith("#")]
        assert any("\t2 " in ln for ln in lines)  # a measured entry
        bl.set_option("autotune", 0)
        bl.clear_cache()  # forget in memory; the next call reads the file
        hits = bl.get_option("cache_hits")
        d2 = bl.matmul(a, b, mode="tf32")
        assert bl.get_option("cache_hits") == hits + 1
        assert rel_err(np64(d2), np64(d)) < 1e-6
    finally:
        bl.set_option("autotune", 0)
        bl.set_cache_path(None)


def test_device_mismatch_and_non_blas_strides_raise():
    with pytest.raises(ValueError, match=r"\[gemm\] A is on cuda:0 and B is on cpu"):
        bl.matmul(g(4, 4), torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"a BLAS needs one of the last two strides to be 1"):
        bl.matmul(g(8, 8)[::2, ::2], g(4, 4))


def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    a = cupy.random.standard_normal((33, 65), dtype=cupy.float32)
    b = cupy.random.standard_normal((65, 17), dtype=cupy.float32)
    d = bl.matmul(a, b)
    assert isinstance(d, cupy.ndarray)
    assert rel_err(cupy.asnumpy(d), cupy.asnumpy(a).astype(np.float64) @ cupy.asnumpy(b)) < 1e-5
