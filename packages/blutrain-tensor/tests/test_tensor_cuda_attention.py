"""GPU tests of the fused (flash) attention kernels: forward (out, lse) and the three gradients
against float64 numpy on the same (rounded) inputs, in bfloat16 / float16 (tensor-core kernels for
D in {64, 128}) and float32 (SIMT), causal and not, T in {1, 7, 64, 1024} (tails of the 64 / 128
row blocks), q/k/v as non-contiguous views of a (B, T, 3C) tensor (GPT-2's split), odd head dims
and misaligned views (the SIMT fallback), determinism, and the (B, L, H, D) output layout.
Tolerances are relative Frobenius norms (bf16 1.5e-2, fp16 4e-3, fp32 2e-5).
bf16/fp16 backward: by default one kernel per key block (on sm_90a builds with D 64 the wgmma
attn_bwd_sm90_ws, elsewhere attn_bwd_dkdv_v2<kDq>), dQ added by float atomics or a TMA reduce-add:
dq is not bitwise repeatable, dk/dv are; bt.use_deterministic_algorithms(True) selects the
deterministic two-kernel split (bitwise repeatable).  Bitwise checks of the backward run in that
mode.  float32 on tensor cores (attention_tf32.cu) does the same:
dQ by float atomics from the dK / dV kernel by default, the split in deterministic mode; both are
checked against float64."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import _tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

RTOL = {bt.bfloat16: 1.5e-2, bt.float16: 4e-3, bt.float32: 2e-5, bt.float64: 1e-12}
NAME = {bt.bfloat16: "bf16", bt.float16: "fp16", bt.float32: "fp32", bt.float64: "fp64"}


def _np(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().to(bt.float64).numpy()


def _poison_pool(nbytes: int) -> None:
    """Fill freed blocks of the device pool with NaN, so an output element a kernel never writes
    shows up (the next allocations of similar sizes reuse these blocks)."""
    for _ in range(4):
        bt.full((nbytes // 4 + 1024,), float("nan"), dtype=bt.float32, device="cuda")
    bt._tensor._cuda_synchronize(0)


class _deterministic:
    """bt.use_deterministic_algorithms(on) inside the block (restored after)."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        self.prev = bt.are_deterministic_algorithms_enabled()
        bt.use_deterministic_algorithms(self.on)

    def __exit__(self, *exc):
        bt.use_deterministic_algorithms(self.prev)


def ref(q, k, v, g, causal, scale):
    """float64 numpy forward and backward: out, lse, dq, dk, dv (all (B, H, ., D))."""
    s = np.einsum("bhld,bhsd->bhls", q, k) * scale
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    l_ = e.sum(-1, keepdims=True)
    p = e / l_
    out = np.einsum("bhls,bhsd->bhld", p, v)
    dv = np.einsum("bhls,bhld->bhsd", p, g)
    dp = np.einsum("bhld,bhsd->bhls", g, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhls,bhsd->bhld", ds, k) * scale
    dk = np.einsum("bhls,bhld->bhsd", ds, q) * scale
    return out, (m + np.log(l_))[..., 0], dq, dk, dv


def _relerr(got: np.ndarray, want: np.ndarray) -> float:
    # floor 0.1 per element (rms): at T == 1 dq and dk are exactly zero (P == 1, dS == 0), and
    # what a kernel returns is the rounding of dP - Dvec, two O(1) terms that cancel (TF32's
    # 2^-11 on dP gives ~3e-4 per element); the floor measures that against the terms' scale
    floor = 1e-1 * np.sqrt(want.size)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor))


def _check(what, got: bt.Tensor, want: np.ndarray, tol: float) -> None:
    g = _np(got)
    assert g.shape == want.shape, f"{what}: shape {g.shape} != {want.shape}"
    bad = ~np.isfinite(g)
    assert not bad.any(), f"{what}: {bad.sum()} non-finite elements, first at {np.argwhere(bad)[0]}"
    err = _relerr(g, want)
    assert err <= tol, f"{what}: relative Frobenius error {err:.3g} > {tol:.3g}"


def _split_qkv(rng, B, T, H, D, dtype, pad=0):
    """(B, T, 3C + pad) -> q, k, v (B, H, T, D) views (pad != 0 breaks 16-byte row alignment)."""
    x = bt.tensor(rng.standard_normal((B, T, 3 * H * D + pad)), dtype=dtype, device="cuda")
    x = x[:, :, pad:] if pad else x
    x.requires_grad_(True)
    q, k, v = x.split(H * D, dim=2)
    return x, [t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v)]


def _run_case(rng, dtype, B, H, T, D, causal, pad=0, lse_grad=False):
    x, (q, k, v) = _split_qkv(rng, B, T, H, D, dtype, pad)
    assert not q.is_contiguous()
    g_np = rng.standard_normal((B, H, T, D))
    g = bt.tensor(g_np, dtype=dtype, device="cuda")
    _poison_pool(B * T * H * D * 4 * 4)
    out, lse = _tensor.flash_attention(q, k, v, is_causal=causal)
    loss = (out * g).sum()
    glse_np = rng.standard_normal((B, H, T)) if lse_grad else None
    if lse_grad:
        loss = loss + (lse * bt.tensor(glse_np, dtype=lse.dtype, device="cuda")).sum()
    loss.backward()
    qn, kn, vn = (_np(t) for t in (q, k, v))
    gn = _np(g)  # the rounded cotangent
    ro, rl, rdq, rdk, rdv = ref(qn, kn, vn, gn, causal, 1 / np.sqrt(D))
    if lse_grad:  # d lse_i / d s_ij = p_ij: adds p * glse to dS
        s = np.einsum("bhld,bhsd->bhls", qn, kn) / np.sqrt(D)
        if causal:
            s = np.where(np.arange(T)[None, :] > np.arange(T)[:, None], -np.inf, s)
        p = np.exp(s - rl[..., None])
        ds = p * glse_np[..., None]
        rdq = rdq + np.einsum("bhls,bhsd->bhld", ds, kn) / np.sqrt(D)
        rdk = rdk + np.einsum("bhls,bhld->bhsd", ds, qn) / np.sqrt(D)
    tag = f"{NAME[dtype]} B={B} H={H} T={T} D={D} causal={causal}"
    tol = RTOL[dtype]
    _check(f"out {tag}", out, ro, tol)
    # lse averages rounding over the keys; at T = 1 it is one (TF32) dot product (seen: 8.5e-4
    # against tol / 4 = 7.5e-4 on the H200), hence tol / 2 there.
    _check(f"lse {tag}", lse, rl, max(tol / (2 if T == 1 else 4), 1e-6))
    gx = _np(x.grad)
    C = H * D
    pieces = [
        gx[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3)
    ]
    for name, got, want in zip(("dq", "dk", "dv"), pieces, (rdq, rdk, rdv), strict=True):
        assert np.isfinite(got).all(), f"{name} {tag}: non-finite elements"
        err = _relerr(got, want)
        assert err <= 1.5 * tol, f"{name} {tag}: relative Frobenius error {err:.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [1, 7, 64, 1024])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16, bt.float32], ids=NAME.get)
def test_flash_attention(rng, dtype, D, T, causal):
    B, H = (1, 2) if T >= 1024 else (2, 3)
    _run_case(rng, dtype, B, H, T, D, causal)


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32], ids=NAME.get)
@pytest.mark.parametrize("T", [129, 200])
def test_tails_between_blocks(rng, dtype, T):
    _run_case(rng, dtype, 1, 2, T, 64, True)
    _run_case(rng, dtype, 1, 2, T, 128, False)


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32], ids=NAME.get)
def test_lse_gradient(rng, dtype):
    _run_case(rng, dtype, 1, 2, 70, 64, True, lse_grad=True)


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32], ids=NAME.get)
@pytest.mark.parametrize("D", [8, 40, 96])
def test_other_head_dims_simt(rng, dtype, D):
    _run_case(rng, dtype, 1, 2, 33, D, True)


def test_misaligned_views_fall_back(rng):
    # a one-element offset breaks the 16-byte rows the tensor-core path needs: the SIMT path runs
    _run_case(rng, bt.bfloat16, 1, 2, 50, 64, True, pad=1)


def test_float64(rng):
    _run_case(rng, bt.float64, 1, 2, 19, 16, True)


def test_sdpa_front_uses_fused_layout(rng):
    B, T, H, D = 2, 16, 2, 64
    _, (q, k, v) = _split_qkv(rng, B, T, H, D, bt.bfloat16)
    y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert y.shape == (B, H, T, D)
    y2 = y.transpose(1, 2)
    assert y2.is_contiguous()  # GPT-2's .contiguous().view(B, T, C) is free
    ro, *_ = ref(*(_np(t) for t in (q, k, v)), np.zeros((B, H, T, D)), True, 1 / np.sqrt(D))
    _check("sdpa", y, ro, RTOL[bt.bfloat16])
    # a mask or dropout keeps the composed path; its result agrees
    mask = bt.tensor(np.tril(np.ones((T, T), dtype=bool)), device="cuda")
    ym = bt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    _check("sdpa with mask", ym, ro, 2 * RTOL[bt.bfloat16])


@pytest.mark.parametrize("scale", [0.02, 0.4, 3.0, -0.3])
@pytest.mark.parametrize("D", [64, 128])
def test_sdpa_scales(rng, scale, D):
    # the kernels scale after the row max (positive scales); a negative scale composes GEMMs
    B, T, H = 2, 80, 2
    _, (q, k, v) = _split_qkv(rng, B, T, H, D, bt.bfloat16)
    y = bt.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    ro, *_ = ref(*(_np(t) for t in (q, k, v)), np.zeros((B, H, T, D)), True, scale)
    _check(f"sdpa scale={scale} D={D}", y, ro, 2 * RTOL[bt.bfloat16])


def test_deterministic(rng):
    B, T, H, D = 2, 300, 4, 64
    x, _ = _split_qkv(rng, B, T, H, D, bt.bfloat16)
    g = bt.randn(B, H, T, D, dtype=bt.bfloat16, device="cuda")
    res = []
    with _deterministic():
        for _ in range(2):
            x.grad = None
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
            out, _ = _tensor.flash_attention(q, k, v, is_causal=True)
            out.backward(g)
            res.append((_np(out), _np(x.grad)))
    assert np.array_equal(res[0][0], res[1][0])
    assert np.array_equal(res[0][1], res[1][1])


# ---- packed qkv (attn-bf16): sdpa on GPT-2's split views runs one op on the (B, T, 3C) tensor ----
def _sdpa_x_grad(x_np, g_np, B, T, H, D, dtype, causal, pack, device="cuda", extra=False):
    """out and X.grad of sum(sdpa(q, k, v) * g) for q, k, v split from a non-leaf X (a linear
    output); pack=False breaks the packing (q goes through a copy)."""
    xl = bt.tensor(x_np, dtype=dtype, device=device, requires_grad=True)
    x = xl * 1.0
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
    if not pack:
        q = q * 1.0
    assert (_tensor._packed_qkv_source(q, k, v) is not None) == pack
    _poison_pool(B * T * 3 * H * D * 4 * 4)
    y = bt.scaled_dot_product_attention(q, k, v, is_causal=causal)
    loss = (y * bt.tensor(g_np, dtype=dtype, device=device)).sum()
    if extra:
        loss = loss + (x * x).sum()
    loss.backward()
    return _np(y), _np(xl.grad)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [1, 7, 100, 200])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16], ids=NAME.get)
def test_packed_qkv_matches_unpacked_and_reference(rng, dtype, D, T, causal):
    """Packed (gradients written with row stride 3C) == unpacked bitwise (same kernels; in the
    default fused mode the dq slice only up to atomics order), and both match float64 numpy; X
    also used elsewhere (x * x) adds its gradient."""
    B, H = 2, 3
    C = H * D
    x_np = rng.standard_normal((B, T, 3 * H * D))
    g_np = rng.standard_normal((B, H, T, D))
    for det in (True, False):
        for extra in (False, True):
            with _deterministic(det):
                yp, gp = _sdpa_x_grad(x_np, g_np, B, T, H, D, dtype, causal, True, extra=extra)
                yu, gu = _sdpa_x_grad(x_np, g_np, B, T, H, D, dtype, causal, False, extra=extra)
            tag = f"{NAME[dtype]} T={T} D={D} causal={causal} extra={extra} det={det}"
            assert np.isfinite(gp).all(), f"packed dX {tag}: non-finite"
            assert np.array_equal(yp, yu), f"out {tag}: packed != unpacked"
            if det:
                assert np.array_equal(gp, gu), (
                    f"dX {tag}: packed != unpacked, max diff {abs(gp - gu).max()}"
                )
            else:  # dk, dv bitwise; dq (float atomics) close
                assert np.array_equal(gp[:, :, C:], gu[:, :, C:]), (
                    f"dK/dV {tag}: packed != unpacked"
                )
                err = _relerr(gp[:, :, :C], gu[:, :, :C])
                assert err <= RTOL[dtype] / 2, f"dQ {tag}: packed vs unpacked rel err {err:.3g}"
    # float64 reference on the rounded inputs
    xr = _np(bt.tensor(x_np, dtype=dtype))
    gr = _np(bt.tensor(g_np, dtype=dtype))
    C = H * D
    qn, kn, vn = (
        xr[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3)
    )
    ro, _, rdq, rdk, rdv = ref(qn, kn, vn, gr, causal, 1 / np.sqrt(D))
    yp, gp = _sdpa_x_grad(x_np, g_np, B, T, H, D, dtype, causal, True)
    tol = RTOL[dtype]
    assert _relerr(yp, ro) <= tol
    pieces = [
        gp[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3) for i in range(3)
    ]
    for name, got, want in zip(("dq", "dk", "dv"), pieces, (rdq, rdk, rdv), strict=True):
        err = _relerr(got, want)
        assert err <= 1.5 * tol, f"packed {name} {NAME[dtype]} T={T} D={D}: rel err {err:.3g}"


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32], ids=NAME.get)
def test_packed_qkv_gpu_matches_cpu(rng, dtype):
    """The packed op on CUDA against the packed op on the CPU (flash CPU kernel, float64 math)."""
    B, T, H, D = 2, 77, 2, 64
    x_np = rng.standard_normal((B, T, 3 * H * D))
    g_np = rng.standard_normal((B, H, T, D))
    xc = bt.tensor(x_np, dtype=dtype)
    gc = bt.tensor(g_np, dtype=dtype)
    outs = []
    for dev in ("cpu", "cuda"):
        x = xc.to(dev).detach().requires_grad_(True)
        out, lse = _tensor.flash_attention_packed(x, H, is_causal=True)
        (out * gc.to(dev)).sum().backward()
        outs.append((_np(out), _np(lse), _np(x.grad)))
    tol = RTOL[dtype] if dtype != bt.float32 else 5e-3  # fp32 may run TF32 tensor cores
    for name, a, b in zip(("out", "lse", "dX"), outs[1], outs[0], strict=True):
        assert _relerr(a, b) <= 1.5 * tol, f"{name} {NAME[dtype]}: cuda vs cpu"


def test_packed_qkv_row_stride(rng):
    """X = rows of 3C inside (B, T, 4C) rows (row stride 4C) packs; the grad of the unused quarter
    stays zero; and a misaligned X (one-element offset) runs the SIMT kernels, still packed."""
    B, T, H, D = 2, 65, 2, 64
    C = H * D
    for lo, hi in ((0, 3 * C), (C, 4 * C), (1, 3 * C + 1)):
        r_np = rng.standard_normal((B, T, 4 * C))
        g_np = rng.standard_normal((B, H, T, D))
        res = []
        for dev in ("cpu", "cuda"):
            r = bt.tensor(r_np, dtype=bt.bfloat16, device=dev, requires_grad=True)
            x = (r * 1.0)[:, :, lo:hi]
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(C, dim=2))
            assert _tensor._packed_qkv_source(q, k, v) is not None
            if dev == "cuda":
                _poison_pool(B * T * 4 * C * 2 * 4)
            if dev == "cpu":  # the CPU's fused kernel (float64 math), unpacked
                y = _tensor.flash_attention(q, k, v, is_causal=True)[0]
            else:
                y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
            (y * bt.tensor(g_np, dtype=bt.bfloat16, device=dev)).sum().backward()
            res.append((_np(y), _np(r.grad)))
        assert _relerr(res[1][0], res[0][0]) <= RTOL[bt.bfloat16], f"out [{lo}:{hi}]"
        assert _relerr(res[1][1], res[0][1]) <= 1.5 * RTOL[bt.bfloat16], f"dX [{lo}:{hi}]"
        gx = res[1][1]
        assert np.all(gx[:, :, :lo] == 0) and np.all(gx[:, :, hi:] == 0)


def test_packed_qkv_deterministic(rng):
    B, T, H, D = 2, 300, 4, 64
    x_np = rng.standard_normal((B, T, 3 * H * D))
    g_np = rng.standard_normal((B, H, T, D))
    with _deterministic():
        a = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.bfloat16, True, True)
        b = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.bfloat16, True, True)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# ---- fused backward (attn_bwd_dkdv_v2 with kDq: bf16/fp16 D 64, not in deterministic mode) -----
def _leaf_grads(qn, kn, vn, gn, dtype, causal):
    """out, dq, dk, dv (numpy, (B, H, ., D)) through separate contiguous leaf q, k, v."""
    q, k, v = (bt.tensor(a, dtype=dtype, device="cuda", requires_grad=True) for a in (qn, kn, vn))
    _poison_pool(4 * max(a.size for a in (qn, kn, vn)) * 4)
    out, _ = _tensor.flash_attention(q, k, v, is_causal=causal)
    (out * bt.tensor(gn, dtype=dtype, device="cuda")).sum().backward()
    return _np(out), _np(q.grad), _np(k.grad), _np(v.grad)


def _rounded(a, dtype):
    return _np(bt.tensor(a, dtype=dtype))


@pytest.mark.parametrize("layout", ["leaf", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [1, 7, 64, 1024])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16], ids=NAME.get)
def test_fused_backward_reference(rng, dtype, D, T, causal, layout):
    """Fused backward (default mode) against float64 numpy: leaf (B, H, T, D) q, k, v (gradients
    written (B, H, T, D), their layout) and packed X (one (B, T, 3C) gradient, row 3C)."""
    B, H = (1, 2) if T >= 1024 else (2, 3)
    C = H * D
    gn = _rounded(rng.standard_normal((B, H, T, D)), dtype)
    with _deterministic(False):
        if layout == "leaf":
            qn, kn, vn = (_rounded(rng.standard_normal((B, H, T, D)), dtype) for _ in range(3))
            _, *grads = _leaf_grads(qn, kn, vn, gn, dtype, causal)
        else:
            x_np = rng.standard_normal((B, T, 3 * C))
            _, gx = _sdpa_x_grad(x_np, gn, B, T, H, D, dtype, causal, True)
            xr = _rounded(x_np, dtype)
            qn, kn, vn = (
                xr[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)
                for i in range(3)
            )
            grads = [
                gx[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)
                for i in range(3)
            ]
    _, _, rdq, rdk, rdv = ref(qn, kn, vn, gn, causal, 1 / np.sqrt(D))
    tag = f"{NAME[dtype]} {layout} T={T} D={D} causal={causal}"
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv), strict=True):
        bad = ~np.isfinite(got)
        assert not bad.any(), f"{name} {tag}: {bad.sum()} non-finite, first {np.argwhere(bad)[0]}"
        err = _relerr(got, want)
        assert err <= 1.5 * RTOL[dtype], f"{name} {tag}: relative Frobenius error {err:.3g}"


@pytest.mark.parametrize("layout", ["leaf", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_backward_more_blocks_than_sms(rng, causal, layout):
    """bf16 D 64 with more (head, key block) items than an H200 has SMs (3 x 16 heads x 4 key
    blocks = 192 > 132), so the persistent Hopper backward's blocks each walk several items (the
    K / V double buffer, the ring running on across items), the pool poisoned with NaN first:
    float64 reference; dk, dv bitwise repeatable."""
    B, H, T, D = 3, 16, 512, 64
    dtype = bt.bfloat16
    C = H * D
    gn = _rounded(rng.standard_normal((B, H, T, D)), dtype)
    runs = []
    with _deterministic(False):
        if layout == "leaf":
            qn, kn, vn = (_rounded(rng.standard_normal((B, H, T, D)), dtype) for _ in range(3))
            for _ in range(2):
                runs.append(_leaf_grads(qn, kn, vn, gn, dtype, causal)[1:])
        else:
            x_np = rng.standard_normal((B, T, 3 * C))
            xr = _rounded(x_np, dtype)
            qn, kn, vn = (
                xr[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)
                for i in range(3)
            )
            for _ in range(2):
                gx = _sdpa_x_grad(x_np, gn, B, T, H, D, dtype, causal, True)[1]
                runs.append(
                    [
                        gx[:, :, i * C : (i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)
                        for i in range(3)
                    ]
                )
    _, _, rdq, rdk, rdv = ref(qn, kn, vn, gn, causal, 1 / np.sqrt(D))
    tag = f"{layout} B={B} H={H} T={T} causal={causal}"
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], (rdq, rdk, rdv), strict=True):
        assert np.isfinite(got).all(), f"{name} {tag}: non-finite elements"
        err = _relerr(got, want)
        assert err <= 1.5 * RTOL[dtype], f"{name} {tag}: relative Frobenius error {err:.3g}"
    assert np.array_equal(runs[0][1], runs[1][1]) and np.array_equal(runs[0][2], runs[1][2]), tag


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_backward_graph_replay(rng, causal):
    """The bf16 D 64 forward and backward captured in one CUDA graph (the Dvec preprocess zeroing
    the float32 dQ accumulator, the persistent backward on Hopper, the dq conversion, all from the
    graph's pool), then replayed on three fresh sets of inputs: float64 reference each time, dk /
    dv bitwise equal to an eager run on the same inputs, dq within two bf16 steps of it (its sums
    land in any order)."""
    B, H, T, D = 2, 8, 512, 64
    dtype = bt.bfloat16

    def inputs():
        return [_rounded(rng.standard_normal((B, H, T, D)), dtype) for _ in range(4)]

    q, k, v, g = (bt.zeros((B, H, T, D), dtype=dtype, device="cuda") for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        for t in (q, k, v):
            t.grad = None
        out, _ = _tensor.flash_attention(q, k, v, is_causal=causal)
        (out * g).sum().backward()
        return q.grad, k.grad, v.grad

    def load(arrays):
        with bt.no_grad():
            for t, a in zip((q, k, v, g), arrays, strict=True):
                t.copy_(bt.tensor(a, dtype=dtype, device="cuda"))

    with _deterministic(False):
        load(inputs())
        step()  # warm-up: kernels loaded, tensor maps and occupancy queried
        graph = bt.cuda.CUDAGraph()
        with bt.cuda.graph(graph):
            grads = step()
        try:
            for rep in range(3):
                arrays = inputs()
                load(arrays)
                graph.replay()
                got = [_np(t) for t in grads]
                eager = [_np(t) for t in step()]
                _, _, rdq, rdk, rdv = ref(*arrays, causal, 1 / np.sqrt(D))
                tag = f"replay {rep} causal={causal}"
                for name, a, want in zip(("dq", "dk", "dv"), got, (rdq, rdk, rdv), strict=True):
                    err = _relerr(a, want)
                    assert err <= 1.5 * RTOL[dtype], f"{name} {tag}: relative error {err:.3g}"
                assert np.array_equal(got[1], eager[1]) and np.array_equal(got[2], eager[2]), tag
                # 2^-7 of the largest |dq|: one to two bf16 steps there
                dq_tol = 2.0**-7 * np.abs(eager[0]).max()
                assert np.abs(got[0] - eager[0]).max() <= dq_tol, tag
        finally:
            graph.reset()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dependent_launches_match_plain_ones(rng, monkeypatch, causal, D):
    """On Hopper the forward, the backward and the dq conversion may start during the tail of the
    kernel before them (programmatic dependent launch; BT_CUDA_PDL=0 turns it off).  Both ways,
    more items than SMs and the pool poisoned: output, dk and dv bitwise equal, dq within two
    bf16 steps (its sums land in any order), and the float64 reference met.  (D 128's backward
    is not the Hopper kernel: there only the forward launches this way.)"""
    B, H, T = 3, 16, 512
    dtype = bt.bfloat16
    qn, kn, vn, gn = (_rounded(rng.standard_normal((B, H, T, D)), dtype) for _ in range(4))
    runs = {}
    with _deterministic(False):
        for pdl in ("1", "0"):
            monkeypatch.setenv("BT_CUDA_PDL", pdl)
            runs[pdl] = _leaf_grads(qn, kn, vn, gn, dtype, causal)
    on, off = runs["1"], runs["0"]
    tag = f"D={D} causal={causal}"
    assert np.array_equal(on[0], off[0]), f"out {tag}"
    assert np.array_equal(on[2], off[2]) and np.array_equal(on[3], off[3]), f"dk / dv {tag}"
    assert np.abs(on[1] - off[1]).max() <= 2.0**-7 * np.abs(off[1]).max(), f"dq {tag}"
    ro, _, rdq, rdk, rdv = ref(qn, kn, vn, gn, causal, 1 / np.sqrt(D))
    for name, got, want in zip(("out", "dq", "dk", "dv"), on, (ro, rdq, rdk, rdv), strict=True):
        err = _relerr(got, want)
        assert err <= 1.5 * RTOL[dtype], f"{name} {tag}: relative error {err:.3g}"


@pytest.mark.parametrize("det", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32, bt.float64], ids=NAME.get)
def test_leaf_gradients_keep_leaf_layout(rng, dtype, D, det):
    """Contiguous (B, H, T, D) leaves: the backward writes dq, dk, dv in that layout (heads-major;
    the leaves keep them as they come: contiguous, no copy); a transposed-view input still gets
    (B, T, H, D) rows.  Both against float64, every backend (tensor cores, the deterministic
    split, TF32, the SIMT reference for float64)."""
    B, H, T = 2, 3, 200
    qn, kn, vn, gn = (_rounded(rng.standard_normal((B, H, T, D)), dtype) for _ in range(4))
    _, _, rdq, rdk, rdv = ref(qn, kn, vn, gn, True, 1 / np.sqrt(D))
    with _deterministic(det):
        q, k, v = (
            bt.tensor(a, dtype=dtype, device="cuda", requires_grad=True) for a in (qn, kn, vn)
        )
        _poison_pool(4 * qn.size * 8)
        out, _ = _tensor.flash_attention(q, k, v, is_causal=True)
        (out * bt.tensor(gn, dtype=dtype, device="cuda")).sum().backward()
        # the same values through (B, T, H, D) leaves seen transposed: the rows layout
        lt = [
            bt.tensor(
                a.transpose(0, 2, 1, 3).copy(), dtype=dtype, device="cuda", requires_grad=True
            )
            for a in (qn, kn, vn)
        ]
        out2, _ = _tensor.flash_attention(*(t.transpose(1, 2) for t in lt), is_causal=True)
        (out2 * bt.tensor(gn, dtype=dtype, device="cuda")).sum().backward()
    tol = 1.5 * RTOL[dtype]
    for name, leaf, tleaf, want in zip(("dq", "dk", "dv"), (q, k, v), lt, (rdq, rdk, rdv)):
        assert leaf.grad.is_contiguous() and tuple(leaf.grad.shape) == (B, H, T, D), name
        for what, got in ((f"{name} leaf", _np(leaf.grad)), (f"{name} rows", _np(tleaf.grad))):
            if what.endswith("rows"):
                got = got.transpose(0, 2, 1, 3)
            assert np.isfinite(got).all(), f"{what} {NAME[dtype]} D={D}: non-finite"
            err = _relerr(got, want)
            assert err <= tol, f"{what} {NAME[dtype]} D={D} det={det}: rel err {err:.3g}"


@pytest.mark.parametrize("LS", [(33, 100), (100, 33), (1, 70)])
@pytest.mark.parametrize("D", [64, 128])
def test_fused_cross_lengths(rng, D, LS):
    """L != S (not causal): dq_acc is (B, H, L, D), the key tail of the last block is masked."""
    B, H, (L, S) = 2, 3, LS
    dtype = bt.bfloat16
    qn = _rounded(rng.standard_normal((B, H, L, D)), dtype)
    kn, vn = (_rounded(rng.standard_normal((B, H, S, D)), dtype) for _ in range(2))
    gn = _rounded(rng.standard_normal((B, H, L, D)), dtype)
    out, *grads = _leaf_grads(qn, kn, vn, gn, dtype, False)
    ro, _, rdq, rdk, rdv = ref(qn, kn, vn, gn, False, 1 / np.sqrt(D))
    assert _relerr(out, ro) <= RTOL[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv), strict=True):
        assert np.isfinite(got).all(), f"{name} L={L} S={S} D={D}: non-finite"
        err = _relerr(got, want)
        assert err <= 1.5 * RTOL[dtype], f"{name} L={L} S={S} D={D}: rel err {err:.3g}"


@pytest.mark.parametrize("D", [64, 128])
def test_fused_vs_deterministic_split(rng, D):
    """Same inputs: the fused backward (default) and the deterministic split agree closely; the
    split is bitwise repeatable; the fused one repeats dk, dv bitwise and dq up to atomics order."""
    B, T, H = 2, 300, 4
    C = H * D
    x_np = rng.standard_normal((B, T, 3 * C))
    g_np = rng.standard_normal((B, H, T, D))
    with _deterministic(True):
        d1 = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.bfloat16, True, True)[1]
        d2 = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.bfloat16, True, True)[1]
    with _deterministic(False):
        f1 = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.bfloat16, True, True)[1]
        f2 = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.bfloat16, True, True)[1]
    assert np.array_equal(d1, d2), "deterministic mode: dX not bitwise repeatable"
    assert np.array_equal(f1[:, :, C:], f2[:, :, C:]), "fused: dK/dV not bitwise repeatable"
    assert _relerr(f1[:, :, :C], f2[:, :, :C]) <= 2e-3, "fused: dQ repeat differs"
    for i, name in enumerate(("dq", "dk", "dv")):
        sl = slice(i * C, (i + 1) * C)
        err = _relerr(f1[:, :, sl], d1[:, :, sl])
        assert err <= RTOL[bt.bfloat16], f"{name} D={D}: fused vs split rel err {err:.3g}"


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16, bt.float32, bt.float64], ids=NAME.get)
@pytest.mark.parametrize("D", [16, 64, 128, 40])
def test_preprocess_vectorised_dvec(rng, dtype, D):
    """The backward's Dvec = rowsum(dO * O) - dlse (vectorised kernel for aligned rows, v1 else):
    checked through the lse gradient path on odd row counts (rows not a multiple of 4 per warp)."""
    _run_case(rng, dtype, 1, 3, 37, D, False, lse_grad=True)


# ---- float32 on tensor cores (attn-tf32): TF32 ("high") and 3xTF32 ("highest") flash kernels ----
# D in {64, 128} float32 runs attention_tf32.cu; the precision is read at each launch.
TF32_TOL = {"highest": 2e-5, "high": 3e-3}


class _precision:
    def __init__(self, p: str):
        self.p = p

    def __enter__(self):
        self.old = bt.get_float32_matmul_precision()
        bt.set_float32_matmul_precision(self.p)

    def __exit__(self, *exc):
        bt.set_float32_matmul_precision(self.old)


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("prec", ["highest", "high"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [1, 7, 64, 1024])
@pytest.mark.parametrize("D", [64, 128])
def test_tf32_flash_attention(rng, monkeypatch, prec, D, T, causal, det):
    """Both backwards against float64: the default (dQ by atomics from the dK / dV kernel) and
    deterministic mode's two-kernel split."""
    monkeypatch.setitem(RTOL, bt.float32, TF32_TOL[prec])
    B, H = (1, 2) if T >= 1024 else (2, 3)
    with _precision(prec), _deterministic(det):
        _run_case(rng, bt.float32, B, H, T, D, causal)


@pytest.mark.parametrize("prec", ["highest", "high"])
@pytest.mark.parametrize("T", [129, 200])
def test_tf32_tails_and_lse_grad(rng, monkeypatch, prec, T):
    monkeypatch.setitem(RTOL, bt.float32, TF32_TOL[prec])
    with _precision(prec):
        _run_case(rng, bt.float32, 1, 2, T, 64, True, lse_grad=True)
        _run_case(rng, bt.float32, 1, 2, T, 128, False, lse_grad=True)


@pytest.mark.parametrize("prec", ["highest", "high"])
@pytest.mark.parametrize("D", [64, 128])
def test_tf32_cross_lengths(rng, prec, D):
    """L != S (not causal), contiguous (B, H, L, D) inputs."""
    B, H, L, S = 2, 3, 33, 100
    qn, kn, vn = (rng.standard_normal((B, H, n, D)) for n in (L, S, S))
    gn = rng.standard_normal((B, H, L, D))
    q, k, v = (
        bt.tensor(a, dtype=bt.float32, device="cuda", requires_grad=True) for a in (qn, kn, vn)
    )
    with _precision(prec):
        _poison_pool(B * H * S * D * 4 * 4)
        out, lse = _tensor.flash_attention(q, k, v, is_causal=False)
        (out * bt.tensor(gn, dtype=bt.float32, device="cuda")).sum().backward()
    q32, k32, v32, g32 = (_np(bt.tensor(a, dtype=bt.float32)) for a in (qn, kn, vn, gn))
    ro, rl, rdq, rdk, rdv = ref(q32, k32, v32, g32, False, 1 / np.sqrt(D))
    tol = TF32_TOL[prec]
    tag = f"{prec} L={L} S={S} D={D}"
    _check(f"out {tag}", out, ro, tol)
    _check(f"lse {tag}", lse, rl, max(tol / 4, 1e-6))
    for name, t, want in (("dq", q, rdq), ("dk", k, rdk), ("dv", v, rdv)):
        _check(f"{name} {tag}", t.grad, want, 1.5 * tol)


@pytest.mark.parametrize("D", [64, 128])
def test_tf32_precision_is_used(rng, D):
    """Precisions "high" (1xTF32) and "highest" (3xTF32) both run and differ; "highest" is the
    accurate one (catches a wiring that ignores the precision)."""
    B, T, H = 1, 256, 2
    x, (q, k, v) = _split_qkv(rng, B, T, H, D, bt.float32)
    want = ref(*(_np(t) for t in (q, k, v)), np.zeros((B, H, T, D)), True, 1 / np.sqrt(D))[0]
    errs = {}
    outs = {}
    for prec in ("high", "highest"):
        with _precision(prec):
            out = _tensor.flash_attention(q, k, v, is_causal=True)[0]
        outs[prec] = _np(out)
        errs[prec] = _relerr(outs[prec], want)
    assert not np.array_equal(outs["high"], outs["highest"])
    assert errs["highest"] < 2e-6, errs
    assert errs["high"] > 3 * errs["highest"], errs
    assert bt.get_float32_matmul_precision() == "highest"  # restored by _precision


def _tf32_packed_runs(rng, prec, det, D, runs=2):
    B, T, H = 2, 300, 4
    x, _ = _split_qkv(rng, B, T, H, D, bt.float32)
    g = bt.tensor(rng.standard_normal((B, H, T, D)), dtype=bt.float32, device="cuda")
    res = []
    with _precision(prec), _deterministic(det):
        for _ in range(runs):
            x.grad = None
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
            out, _ = _tensor.flash_attention(q, k, v, is_causal=True)
            out.backward(g)
            res.append((_np(out), _np(x.grad)))
    return res, H * D


@pytest.mark.parametrize("prec", ["highest", "high"])
@pytest.mark.parametrize("D", [64, 128])
def test_tf32_deterministic(rng, prec, D):
    """Deterministic mode: the split backward, bitwise repeatable."""
    res, _ = _tf32_packed_runs(rng, prec, True, D)
    assert np.array_equal(res[0][0], res[1][0])
    assert np.array_equal(res[0][1], res[1][1])


@pytest.mark.parametrize(
    "prec, D",  # D 128 under "highest" keeps the split (attention.cu: it measured faster)
    [("highest", 64), ("high", 64), ("high", 128)],
)
def test_tf32_dq_atomic_matches_split(rng, prec, D):
    """The default backward (dQ by float atomics): dK and dV bitwise those of the split (the
    same products in the same order), dQ within a quarter of the float64 tolerance of the
    split's (different summation orders; TF32 rounds dS in both)."""
    seed = int(rng.integers(1 << 30))
    fused, C = _tf32_packed_runs(np.random.default_rng(seed), prec, False, D)
    split, _ = _tf32_packed_runs(np.random.default_rng(seed), prec, True, D, runs=1)
    assert np.array_equal(fused[0][0], split[0][0])
    for r in fused:
        assert np.array_equal(r[1][:, :, C:], split[0][1][:, :, C:]), "dK / dV changed"
        err = _relerr(r[1][:, :, :C], split[0][1][:, :, :C])
        assert err < TF32_TOL[prec] / 4, f"dQ by atomics vs the split: rel err {err:.3g}"


@pytest.mark.parametrize("prec", ["highest", "high"])
def test_tf32_sdpa_front(rng, prec):
    """float32 sdpa (D 64) takes the fused path: the (B, L, H, D) layout, no T x T matrices; and
    its X gradient (packed qkv when the split is of a non-leaf) agrees with float64."""
    B, T, H, D = 2, 80, 2, 64
    x_np = rng.standard_normal((B, T, 3 * H * D))
    g_np = rng.standard_normal((B, H, T, D))
    with _precision(prec):
        _, (q, k, v) = _split_qkv(rng, B, T, H, D, bt.float32)
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert y.transpose(1, 2).is_contiguous()
        yo, gx = _sdpa_x_grad(x_np, g_np, B, T, H, D, bt.float32, True, True)
    xr = _np(bt.tensor(x_np, dtype=bt.float32))
    qn, kn, vn = (
        xr[:, :, i * H * D : (i + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)
        for i in range(3)
    )
    gr = _np(bt.tensor(g_np, dtype=bt.float32))
    ro, _, rdq, rdk, rdv = ref(qn, kn, vn, gr, True, 1 / np.sqrt(D))
    tol = TF32_TOL[prec]
    assert _relerr(yo, ro) <= tol
    for i, want in enumerate((rdq, rdk, rdv)):
        got = gx[:, :, i * H * D : (i + 1) * H * D].reshape(B, T, H, D).transpose(0, 2, 1, 3)
        assert np.isfinite(got).all()
        assert _relerr(got, want) <= 1.5 * tol, f"dX slice {i} ({prec})"


# ---- qkv_attention: projection + attention in one node, the bias gradient from the kernels ------
def _qkv_attention_grads(arrays, g_np, H, dtype, causal, fused, wide):
    """out and the gradients of x, W, b for sum(y * g), y = qkv_attention (fused) or its
    composition (then also its qkv gradient dX); wide: W and b float32 leaves cast to dtype (their
    gradients come back float32)."""
    leaf_dt = bt.float32 if wide else dtype
    x, w, b = (
        bt.tensor(a, dtype=d, device="cuda", requires_grad=True)
        for a, d in zip(arrays, (dtype, leaf_dt, leaf_dt), strict=True)
    )
    wc, bc = (bt.astype(t, dtype) if wide else t for t in (w, b))
    B, T, C = x.shape[0], x.shape[1], w.shape[0] // 3
    qkv = None
    if fused:
        y = bt.qkv_attention(x, wc, bc, H, is_causal=causal)
    else:
        qkv = bt.linear(x, wc, bc)
        qkv.retain_grad()
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, 2))
        y = bt.scaled_dot_product_attention(q, k, v, is_causal=causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
    _poison_pool(B * T * 3 * C * 4 * 4)  # the column-sum partials come from freed blocks
    (y * bt.tensor(g_np, dtype=dtype, device="cuda")).sum().backward()
    res = [_np(t) for t in (y, x.grad, w.grad, b.grad)]
    return res, b.grad.dtype, (None if fused else _np(qkv.grad).reshape(B * T, 3 * C))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T", [1, 7, 100, 1024])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16, bt.float32], ids=NAME.get)
def test_qkv_attention_matches_composition(rng, dtype, D, T, causal):
    """bt.qkv_attention against linear + split + sdpa (the same GEMMs and attention kernels): the
    same out bitwise; in deterministic mode the same dx and dW bitwise, in the default mode (dQ by
    atomics) close.  The bias gradient against float64 sums of the composition's dX by the
    identities of Note [packed column sums] (q: dQ's column sums, k: 0, v: dO's column sums),
    each column within the dtype's tolerance of the sum of its |terms|; exactly 0 for k where the
    kernels sum (16-bit, D 64, default mode)."""
    B, H, K = 2, 2, 48
    C = H * D
    arrays = [
        rng.standard_normal((B, T, K)),
        rng.standard_normal((3 * C, K)) * 0.2,
        rng.standard_normal(3 * C),
    ]
    g_np = rng.standard_normal((B, T, C))
    g_r = _np(bt.tensor(g_np, dtype=dtype)).reshape(B * T, C)  # dO as the kernels read it
    for det in (True, False):
        for wide in (False, True) if dtype != bt.float32 else (False,):
            with _deterministic(det):
                fu, db_dt, _ = _qkv_attention_grads(arrays, g_np, H, dtype, causal, True, wide)
                co, _, dX = _qkv_attention_grads(arrays, g_np, H, dtype, causal, False, wide)
            tag = f"{NAME[dtype]} T={T} D={D} causal={causal} det={det} wide={wide}"
            assert db_dt == (bt.float32 if wide else dtype), tag
            assert all(np.isfinite(a).all() for a in fu), f"{tag}: non-finite"
            assert np.array_equal(fu[0], co[0]), f"out {tag}"
            for name, a, r in zip(("dx", "dW"), fu[1:3], co[1:3], strict=True):
                if det:
                    assert np.array_equal(a, r), f"{name} {tag}: max diff {abs(a - r).max()}"
                else:
                    assert _relerr(a, r) <= RTOL[dtype] / 2, f"{name} {tag}"
            ref = np.concatenate([dX[:, :C].sum(0), np.zeros(C), g_r.sum(0)])
            # q and v: as a whole, and column by column within the tolerance of the sum of their
            # terms' sizes
            qv = np.r_[0:C, 2 * C : 3 * C]
            err = _relerr(fu[3][qv], ref[qv])
            assert err <= RTOL[dtype] / 2, f"db {tag}: rel err {err:.3g}"
            scale = np.abs(dX[:, qv]).sum(0) + np.abs(ref[qv])
            bad = np.abs(fu[3][qv] - ref[qv]) > RTOL[dtype] * scale
            assert not bad.any(), f"db {tag}: columns {qv[bad][:8]}"
            # k: exact dK sums to 0, a computed one to its rounding noise (at T = 1 dK is all
            # noise): no larger than the noise's own size
            dk_abs = np.abs(dX[:, C : 2 * C]).sum(0)
            assert (np.abs(fu[3][C : 2 * C]) <= dk_abs * (1 + RTOL[dtype]) + 1e-30).all(), tag
            if dtype != bt.float32 and D == 64 and not det:
                assert (fu[3][C : 2 * C] == 0).all(), f"db {tag}: k's slice not exactly 0"


def test_nn_self_attention_bf16_policy_on_gpu(rng):
    """nn.self_attention on the GPU with a bf16 policy (float32 parameters, bf16 compute, float32
    out): the fused node against the same module's composition (linear + split + sdpa) under the
    same policy; float32 gradients of W and b, within bf16's tolerance of the composition's."""
    from blutrain.tensor import nn

    B, T, H, D = 2, 128, 2, 64
    C = H * D
    c_attn = nn.Linear(C, 3 * C).cuda()
    c_attn.set_precision(bt.amp.Policy(compute=bt.bfloat16, output=bt.float32))
    x_np, g_np = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    got = []
    for fused in (True, False):
        c_attn.zero_grad()
        x = bt.tensor(x_np, dtype=bt.float32, device="cuda", requires_grad=True)
        if fused:
            y = nn.self_attention(c_attn, x, H, is_causal=True)
        else:
            qkv = c_attn(x)
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, 2))
            y = bt.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        assert y.dtype == bt.float32
        (y * bt.tensor(g_np, dtype=bt.float32, device="cuda")).sum().backward()
        assert c_attn.weight.grad.dtype == bt.float32 and c_attn.bias.grad.dtype == bt.float32
        got.append([_np(t) for t in (y, x.grad, c_attn.weight.grad, c_attn.bias.grad)])
    for name, a, r in zip(("y", "dx", "dW", "db"), *got, strict=True):
        assert np.isfinite(a).all(), name
        assert _relerr(a, r) <= RTOL[bt.bfloat16], f"{name}: rel err {_relerr(a, r):.3g}"


@pytest.mark.parametrize(
    "dtype, D",
    [(bt.bfloat16, 64), (bt.float16, 128), (bt.float32, 64), (bt.bfloat16, 40), (bt.float64, 16)],
    ids=["bf16-tc", "fp16-tc", "fp32-tf32", "bf16-simt", "fp64-simt"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nonfinite_scores_match_the_cpu(rng, dtype, D, causal):
    """Note [non-finite scores] (attention.cu): key 0 is (inf, 0, ..., 0), so a query's score
    against it is -inf (q[0] < 0: weight 0, the rest of the row finite), +inf (q[0] > 0) or NaN
    (q[0] = 0): both a NaN row, as the CPU reference gives.  Key 0 comes first, so the SIMT kernel
    met -inf before any finite score (exp(-inf - -inf) made such rows NaN before).  Every kernel
    (wgmma / mma.sync / TF32 / SIMT) against the CPU's on the same inputs."""
    B, H, T = 1, 2, 70
    q = rng.standard_normal((B, H, T, D))
    k = rng.standard_normal((B, H, T, D))
    v = rng.standard_normal((B, H, T, D))
    finite_rows = np.arange(T) % 3 == 1  # (row 0, alone with key 0 when causal, is a NaN one)
    q[..., 0] = np.where(finite_rows, -1.0, np.where(np.arange(T) % 3 == 2, 1.0, 0.0))
    k[:, :, 0, :] = 0.0
    k[:, :, 0, 0] = np.inf
    cpu = [bt.tensor(a, dtype=dtype) for a in (q, k, v)]
    out_c, lse_c = _tensor.flash_attention(*cpu, is_causal=causal)
    out_g, lse_g = _tensor.flash_attention(*(t.cuda() for t in cpu), is_causal=causal)
    oc, og = _np(out_c), _np(out_g)
    nan_rows = ~finite_rows
    # (the CPU's semantics)
    assert np.isnan(oc[..., nan_rows, :]).all() and np.isfinite(oc[..., ~nan_rows, :]).all()
    assert np.isnan(og[..., nan_rows, :]).all(), "rows with a +inf or NaN score must be NaN"
    assert np.isfinite(og[..., ~nan_rows, :]).all(), "a -inf score must weigh 0, not poison the row"
    err = _relerr(og[..., ~nan_rows, :], oc[..., ~nan_rows, :])
    assert err <= RTOL[dtype], f"finite rows: relative error {err:.3g}"
    lc, lg = _np(lse_c), _np(lse_g)
    assert np.isnan(lg[..., nan_rows]).all() and np.isfinite(lg[..., ~nan_rows]).all()
    assert _relerr(lg[..., ~nan_rows], lc[..., ~nan_rows]) <= RTOL[dtype]


PATHS = pytest.mark.parametrize(
    "dtype, D",
    [(bt.bfloat16, 64), (bt.float16, 128), (bt.float32, 64), (bt.bfloat16, 40), (bt.float64, 16)],
    ids=["bf16-tc", "fp16-tc", "fp32-tf32", "bf16-simt", "fp64-simt"],
)


def _same_pattern(got: np.ndarray, want: np.ndarray, rtol: float, what: str) -> None:
    """NaN / +inf / -inf where the CPU has them, the finite values within rtol (relative norm)."""
    for f in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(f(got), f(want), err_msg=f"{what}: {f.__name__}")
    fin = np.isfinite(want)
    if fin.any():
        assert _relerr(got[fin], want[fin]) <= rtol, f"{what}: relative error"


def _flash_fwd_bwd(q, k, v, g, dtype, device, causal):
    ts = [bt.tensor(a, dtype=dtype).to(device).requires_grad_(True) for a in (q, k, v)]
    out, lse = _tensor.flash_attention(*ts, is_causal=causal)
    out.backward(bt.tensor(g, dtype=dtype).to(device))
    return [_np(out), _np(lse)] + [_np(t.grad) for t in ts]


@PATHS
@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_causal_masked_non_finite_values_match_the_cpu(rng, dtype, D, where, deterministic):
    """Note [causal masks skip] / [non-finite rows]: inf, -inf and NaN at random positions of q,
    k, v or do (T 150: several 64 / 128-row tiles, so some fall in a diagonal tile): out, lse, dq,
    dk, dv equal the CPU kernel's (which never reads masked pairs) in their NaN / inf pattern and
    within tolerance elsewhere.  The tensor-core kernels made earlier rows of a diagonal tile
    NaN (0 * inf) before their rows were recomputed."""
    B, H, T = 1, 2, 150
    q, k, v, g = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    arr = {"q": q, "k": k, "v": v, "do": g}[where]
    for bad in (np.inf, -np.inf, np.nan):
        arr[0, int(rng.integers(H)), int(rng.integers(T)), int(rng.integers(D))] = bad
    with _deterministic(deterministic):
        want = _flash_fwd_bwd(q, k, v, g, dtype, "cpu", True)
        got = _flash_fwd_bwd(q, k, v, g, dtype, "cuda", True)
    for name, x, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        _same_pattern(x, w, 4 * RTOL[dtype], f"{name} ({where})")


@PATHS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rows_of_minus_inf_scores_are_zero_on_every_kernel(rng, dtype, D, causal):
    """Note [empty rows]: q_0 = +inf and every key's first element -inf (the rest finite,
    negative): row 0's scores are all -inf, so out 0, lse -inf and no gradient from it, as the
    CPU (and PyTorch's sdpa) give; the kernels gave out NaN (0 / 0) and lse -inf (CPU: NaN)."""
    B, H, T = 1, 2, 70
    q = rng.standard_normal((B, H, T, D))
    k = -np.abs(rng.standard_normal((B, H, T, D))) - 0.1
    v, g = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, T, D))
    q[:, :, 0] = np.inf
    k[..., 0] = -np.inf
    want = _flash_fwd_bwd(q, k, v, g, dtype, "cpu", causal)
    got = _flash_fwd_bwd(q, k, v, g, dtype, "cuda", causal)
    assert (got[0][:, :, 0] == 0).all() and (got[1][:, :, 0] == -np.inf).all()
    assert (got[2][:, :, 0] == 0).all()
    for name, x, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        _same_pattern(x, w, 4 * RTOL[dtype], name)


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32])
def test_sdpa_non_finite_rules_match_the_cpu(rng, dtype):
    """scaled_dot_product_attention end to end, GPT-2's shapes (D 64, causal): the fused CUDA
    kernels against the CPU path (which hands non-finite inputs to its fused kernel).  (float64
    composes ops on CUDA, with IEEE arithmetic there: the docstring says so.)"""
    B, H, T, D = 2, 3, 129, 64
    q, k, v = (rng.standard_normal((B, H, T, D)) for _ in range(3))
    v[1, 2, 100, 5] = np.inf
    k[0, 1, 77, 3] = np.nan
    outs = []
    for dev in ("cpu", "cuda"):
        ts = [bt.tensor(a, dtype=dtype).to(dev) for a in (q, k, v)]
        outs.append(_np(bt.scaled_dot_product_attention(*ts, is_causal=True)))
    _same_pattern(outs[1], outs[0], 4 * RTOL[dtype], "sdpa")
    assert np.isfinite(outs[1][1, 2, :100]).all() and np.isfinite(outs[1][0, 1, :77]).all()


@pytest.mark.parametrize("D", [64, 128])
def test_attention_precision_highest_is_3xtf32_under_high(rng, D):
    """bt.set_float32_attention_precision("highest") under matmul precision "high": the attention
    (forward and backward) runs 3xTF32, bit for bit what "highest" matmul precision gives, while
    the default ("matmul") follows "high" to 1xTF32."""
    B, T, H = 1, 256, 2
    x, _ = _split_qkv(rng, B, T, H, D, bt.float32)
    g = bt.tensor(rng.standard_normal((B, H, T, D)), dtype=bt.float32, device="cuda")

    def run(matmul: str, attention: str) -> tuple[np.ndarray, np.ndarray]:
        old = bt.get_float32_attention_precision()
        bt.set_float32_attention_precision(attention)
        try:
            with _precision(matmul), _deterministic(True):  # bitwise comparable backwards
                x.grad = None
                q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
                out, _ = _tensor.flash_attention(q, k, v, is_causal=True)
                out.backward(g)
        finally:
            bt.set_float32_attention_precision(old)
        return _np(out), _np(x.grad)

    exact = run("highest", "matmul")
    pinned = run("high", "highest")
    fast = run("high", "matmul")
    assert np.array_equal(pinned[0], exact[0]) and np.array_equal(pinned[1], exact[1])
    assert not np.array_equal(fast[0], exact[0])
    assert bt.get_float32_attention_precision() == "matmul"


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("D", [64, 128])
def test_attention_precision_scores_is_3xtf32_for_the_scores(rng, D, det):
    """bt.set_float32_attention_precision("scores") under "high": the scores Q K^T in 3xTF32,
    the other products in 1xTF32 (Note [scores in 3xTF32]). With sharp scores (q, k entries of
    standard deviation 6: scores of 36) 1xTF32's error on a score, an absolute error of its
    probability's logarithm, dominates; "scores" removes it, so its error sits between 1xTF32's
    and 3xTF32's, well below the first (a float64 emulation of the roundings: 0.14x in the output
    and dv, 0.28x in dq and dk), on both backwards (the fused dQ by atomics and deterministic
    mode's split)."""
    B, H, T = 1, 2, 256
    scale = 1 / np.sqrt(D)
    qn, kn = (6 * rng.standard_normal((B, H, T, D)) for _ in range(2))
    vn, gn = (rng.standard_normal((B, H, T, D)) for _ in range(2))
    q32, k32, v32, g32 = (_np(bt.tensor(a, dtype=bt.float32)) for a in (qn, kn, vn, gn))
    want = ref(q32, k32, v32, g32, True, scale)
    want = {"out": want[0], "dq": want[2], "dk": want[3], "dv": want[4]}

    def errs(attention: str) -> dict[str, float]:
        old = bt.get_float32_attention_precision()
        bt.set_float32_attention_precision(attention)
        try:
            q, k, v = (
                bt.tensor(a, dtype=bt.float32, device="cuda", requires_grad=True)
                for a in (q32, k32, v32)
            )
            with _precision("high"), _deterministic(det):
                out, _ = _tensor.flash_attention(q, k, v, is_causal=True)
                (out * bt.tensor(g32, device="cuda")).sum().backward()
        finally:
            bt.set_float32_attention_precision(old)
        got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        return {n: _relerr(_np(t), want[n]) for n, t in got.items()}

    fast, scores, exact = errs("matmul"), errs("scores"), errs("highest")
    for n in want:
        msg = f"{n}: 1xTF32 {fast[n]:.3g}, scores {scores[n]:.3g}, 3xTF32 {exact[n]:.3g}"
        assert scores[n] < 0.5 * fast[n], msg
        assert exact[n] < scores[n], msg
        assert exact[n] < 2e-5, msg
    assert bt.get_float32_attention_precision() == "matmul"
