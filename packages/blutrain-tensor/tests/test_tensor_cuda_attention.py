"""GPU tests of the fused (flash) attention kernels: forward (out, lse) and the three gradients
against float64 numpy on the same (rounded) inputs, in bfloat16 / float16 (tensor-core kernels for
D in {64, 128}) and float32 (SIMT), causal and not, T in {1, 7, 64, 1024} (tails of the 64 / 128
row blocks), q/k/v as non-contiguous views of a (B, T, 3C) tensor (GPT-2's split), odd head dims
and misaligned views (the SIMT fallback), determinism, and the (B, L, H, D) output layout.
Tolerances are relative Frobenius norms (bf16 1.5e-2, fp16 4e-3, fp32 2e-5)."""

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
    # floor 0.01 per element (rms): at T == 1 dq and dk are exactly zero (P == 1, dS == 0)
    floor = 1e-2 * np.sqrt(want.size)
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
    _check(f"lse {tag}", lse, rl, max(tol / 4, 1e-6))
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


def test_deterministic(rng):
    B, T, H, D = 2, 300, 4, 64
    x, _ = _split_qkv(rng, B, T, H, D, bt.bfloat16)
    g = bt.randn(B, H, T, D, dtype=bt.bfloat16, device="cuda")
    res = []
    for _ in range(2):
        x.grad = None
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
        out, _ = _tensor.flash_attention(q, k, v, is_causal=True)
        out.backward(g)
        res.append((_np(out), _np(x.grad)))
    assert np.array_equal(res[0][0], res[1][0])
    assert np.array_equal(res[0][1], res[1][1])
