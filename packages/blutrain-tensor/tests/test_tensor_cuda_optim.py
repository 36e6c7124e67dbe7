"""CUDA multi-tensor AdamW / grad norm / clipping against the CPU backend (same arithmetic: the
kernels avoid FMA contraction, so float32 agrees to the last bit in practice; asserted 1e-6 rel)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import blutrain.tensor as bt

C = bt._tensor  # private knobs only (_set_optim_kernel_version)
bto = bt.optim
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

B1, B2, EPS = 0.9, 0.95, 1e-8
SMALL = [(7, 5), (5,), (1,), (3, 1025), (0, 4), (4097,), (8192,)]


def gpt2_shapes(n_layer=12, c=768, vocab=50257, block=1024):
    shapes = [(vocab, c), (block, c)]
    for _ in range(n_layer):
        shapes += [(c,), (c,), (3 * c, c), (3 * c,), (c, c), (c,)]
        shapes += [(c,), (c,), (4 * c, c), (4 * c,), (c, 4 * c), (c,)]
    shapes += [(c,), (c,)]
    return shapes


def make(rng, shapes, dtype=np.float32):
    return [rng.standard_normal(s, dtype=np.float32).astype(dtype) for s in shapes]


def run_both(rng, shapes, steps=3, decays=None, device_scalars=False, scale=None, bt_dtype=None):
    """The same AdamW steps on the CPU and on cuda:0; returns ([cpu p, m, v], [gpu p, m, v])."""
    decays = decays or [0.1 if len(s) >= 2 else 0.0 for s in shapes]
    p0 = make(rng, shapes)
    grads = [make(rng, shapes) for _ in range(steps)]
    out = []
    for dev in ("cpu", "cuda"):
        kw = {"dtype": bt_dtype} if bt_dtype is not None else {}
        ps = [bt.tensor(p, device=dev, **kw) for p in p0]
        ms = [bt.zeros(*s, device=dev) for s in shapes]
        vs = [bt.zeros(*s, device=dev) for s in shapes]
        for t in range(1, steps + 1):
            lr = 1e-3 * t
            gs = [bt.tensor(g, device=dev, **kw) for g in grads[t - 1]]
            lr_a = bt.tensor(lr, dtype=bt.float32, device=dev) if device_scalars else lr
            st_a = bt.tensor(float(t), dtype=bt.float32, device=dev) if device_scalars else t
            sc = None if scale is None else bt.tensor(scale, dtype=bt.float32, device=dev)
            bto.adamw_(
                ps,
                gs,
                ms,
                vs,
                lr=lr_a,
                betas=(B1, B2),
                eps=EPS,
                weight_decay=decays,
                step=st_a,
                grad_scale=sc,
            )
        out.append([[t.cpu().float().numpy() for t in lst] for lst in (ps, ms, vs)])
    return out


def assert_close(cpu, gpu, rtol=1e-6, atol=1e-9, what=""):
    for k, name in enumerate(("p", "m", "v")):
        for i, (a, b) in enumerate(zip(cpu[k], gpu[k], strict=True)):
            assert np.isfinite(b).all(), f"{what} {name}[{i}] not finite"
            np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg=f"{what} {name}[{i}]")


@pytest.mark.parametrize("device_scalars", [False, True])
def test_adamw_cuda_matches_cpu_small(rng, device_scalars):
    cpu, gpu = run_both(rng, SMALL, device_scalars=device_scalars)
    assert_close(cpu, gpu, what=f"device_scalars={device_scalars}")


def test_adamw_cuda_grad_scale(rng):
    cpu, gpu = run_both(rng, SMALL, scale=0.37)
    assert_close(cpu, gpu, what="grad_scale")


def test_adamw_cuda_v1_reference_matches_v2(rng):
    shapes = [(33, 17), (1025,), (3,)]
    p0, g = make(rng, shapes), make(rng, shapes)
    res = []
    for ver in (1, 2):
        C._set_optim_kernel_version(ver)
        try:
            ps = [bt.tensor(p, device="cuda") for p in p0]
            ms = [bt.zeros(*s, device="cuda") for s in shapes]
            vs = [bt.zeros(*s, device="cuda") for s in shapes]
            bto.adamw_(
                ps,
                [bt.tensor(x, device="cuda") for x in g],
                ms,
                vs,
                lr=1e-3,
                betas=(B1, B2),
                eps=EPS,
                weight_decay=[0.1, 0.0, 0.0],
                step=1,
            )
            res.append([p.cpu().numpy() for p in ps])
        finally:
            C._set_optim_kernel_version(2)
    for a, b in zip(*res, strict=True):
        np.testing.assert_array_equal(a, b)


def test_adamw_cuda_unaligned_views_use_the_scalar_path(rng):
    # contiguous slices at odd offsets: pointers not 16-byte aligned, odd lengths
    host = [rng.standard_normal(1000, dtype=np.float32) for _ in range(4)]
    host[3] = np.abs(host[3])  # exp_avg_sq >= 0
    dev = [bt.tensor(h, device="cuda") for h in host]
    sl = [(1, 500), (503, 510)]
    gpu = [[d[a:b] for a, b in sl] for d in dev]  # gpu[operand][slice]
    cpu = [[bt.tensor(h[a:b].copy()) for a, b in sl] for h in host]
    bto.adamw_(*gpu, lr=1e-3, betas=(B1, B2), eps=EPS, weight_decay=[0.1, 0.0], step=2)
    bto.adamw_(*cpu, lr=1e-3, betas=(B1, B2), eps=EPS, weight_decay=[0.1, 0.0], step=2)
    for k in (0, 2, 3):
        for j in range(2):
            np.testing.assert_allclose(gpu[k][j].cpu().numpy(), cpu[k][j].numpy(), rtol=1e-6)
    # the untouched elements between the slices stay as they were
    np.testing.assert_array_equal(dev[0].cpu().numpy()[500:503], host[0][500:503])


def test_adamw_cuda_bf16_params_fp32_states(rng):
    cpu, gpu = run_both(rng, SMALL[:4], bt_dtype=bt.bfloat16)
    # p is rounded to bfloat16 each step: allow one bf16 ulp
    for i, (a, b) in enumerate(zip(cpu[0], gpu[0], strict=True)):
        np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-3, err_msg=f"bf16 p[{i}]")
    for k in (1, 2):
        for a, b in zip(cpu[k], gpu[k], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-8)


def test_adamw_cuda_gpt2_124m_148_tensors(rng):
    shapes = gpt2_shapes()
    assert len(shapes) == 148
    cpu, gpu = run_both(rng, shapes, steps=1)
    assert_close(cpu, gpu, what="gpt2")


def test_adamw_cuda_many_tensors_split_launches(rng):
    shapes = [(3,)] * 600 + [(5, 2)] * 500  # > one table of tensors: several launches
    cpu, gpu = run_both(rng, shapes, steps=1, decays=[0.1] * len(shapes))
    assert_close(cpu, gpu, what="1100 tensors")


def test_adamw_cuda_device_lr_changes_between_calls(rng):
    shapes = [(10, 10)]
    p0, g = make(rng, shapes), make(rng, shapes)
    lr_t = bt.tensor(1e-3, dtype=bt.float32, device="cuda")
    step_t = bt.tensor(1.0, dtype=bt.float32, device="cuda")
    ps = [bt.tensor(p0[0], device="cuda")]
    ms, vs = [bt.zeros(10, 10, device="cuda")], [bt.zeros(10, 10, device="cuda")]
    ref = [bt.tensor(p0[0])]
    rm, rv = [bt.zeros(10, 10)], [bt.zeros(10, 10)]
    for t, factor in [(1, 1.0), (2, 5.0), (3, 4.0)]:
        # new values written in place (same device memory, as a CUDA-graph replay would see)
        bto.scale_([lr_t], bt.tensor(factor, dtype=bt.float32, device="cuda"))
        bto.scale_(
            [step_t], bt.tensor(t / (t - 1) if t > 1 else 1.0, dtype=bt.float32, device="cuda")
        )
        lr = float(lr_t.cpu().numpy())
        assert float(step_t.cpu().numpy()) == t
        bto.adamw_(
            ps,
            [bt.tensor(g[0], device="cuda")],
            ms,
            vs,
            lr=lr_t,
            betas=(B1, B2),
            eps=EPS,
            weight_decay=0.1,
            step=step_t,
        )
        bto.adamw_(
            ref, [bt.tensor(g[0])], rm, rv, lr=lr, betas=(B1, B2), eps=EPS, weight_decay=0.1, step=t
        )
    np.testing.assert_allclose(ps[0].cpu().numpy(), ref[0].numpy(), rtol=1e-6)


def test_grad_norm_cuda_matches_cpu_and_is_deterministic(rng):
    shapes = gpt2_shapes(n_layer=2, vocab=1000) + [(1,), (0,), (4097,)]
    gs = make(rng, shapes)
    cpu = float(bto.grad_norm([bt.tensor(g) for g in gs]).item())
    dg = [bt.tensor(g, device="cuda") for g in gs]
    a = bto.grad_norm(dg)
    b = bto.grad_norm(dg)
    assert a.device == bt.device("cuda:0") if hasattr(bt, "device") else True
    assert a.shape == () and a.dtype == bt.float32
    assert a.cpu().numpy().tobytes() == b.cpu().numpy().tobytes()
    total = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
    assert float(a.item()) == pytest.approx(total, rel=1e-6)
    assert float(a.item()) == pytest.approx(cpu, rel=1e-6)


def test_grad_norm_cuda_gpt2_deterministic(rng):
    gs = [bt.tensor(g, device="cuda") for g in make(rng, gpt2_shapes())]
    bits = {bto.grad_norm(gs).cpu().numpy().tobytes() for _ in range(3)}
    assert len(bits) == 1


def test_grad_norm_cuda_dtypes(rng):
    gs = make(rng, [(100, 7), (33,)])
    g64 = [bt.tensor(g.astype(np.float64), device="cuda") for g in gs]
    n = bto.grad_norm(g64)
    assert n.dtype == bt.float64
    want = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
    assert float(n.item()) == pytest.approx(want, rel=1e-12)
    mixed = [bt.tensor(gs[0], device="cuda"), bt.tensor(gs[1], device="cuda", dtype=bt.bfloat16)]
    cpu = bto.grad_norm([t.cpu() for t in mixed])
    assert float(bto.grad_norm(mixed).item()) == pytest.approx(float(cpu.item()), rel=1e-6)
    assert float(bto.grad_norm([]).item()) == 0.0


def test_clip_grad_norm_cuda_front(rng):
    gs = make(rng, [(300, 20), (20,), (1,)])
    ps = [bt.nn.Parameter(bt.zeros(*g.shape, device="cuda")) for g in gs]
    for p, g in zip(ps, gs, strict=True):
        p.grad = bt.tensor(g, device="cuda")
    total = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
    norm = bt.clip_grad_norm_(ps, 1.0)
    assert norm.device.is_cuda if hasattr(norm.device, "is_cuda") else "cuda" in str(norm.device)
    assert float(norm.item()) == pytest.approx(total, rel=1e-6)
    for p, g in zip(ps, gs, strict=True):
        np.testing.assert_allclose(
            p.grad.cpu().numpy(), g * np.float32(1.0 / (total + 1e-6)), rtol=1e-5
        )
    coef = bto.clip_coef(norm, 1.0)
    ccpu = bto.clip_coef(norm.cpu(), 1.0)
    assert coef.cpu().numpy().tobytes() == ccpu.numpy().tobytes()
    nan = bto.clip_coef(bt.tensor(float("nan"), device="cuda"), 1.0)
    assert math.isnan(float(nan.item()))


def test_scale_cuda_matches_cpu(rng):
    gs = make(rng, [(1025,), (3, 3)])
    coef = bt.tensor(0.3, dtype=bt.float32, device="cuda")
    dg = [bt.tensor(g, device="cuda") for g in gs]
    bto.scale_(dg, coef)
    cg = [bt.tensor(g) for g in gs]
    bto.scale_(cg, coef.cpu())
    for a, b in zip(cg, dg, strict=True):
        np.testing.assert_array_equal(b.cpu().numpy(), a.numpy())
