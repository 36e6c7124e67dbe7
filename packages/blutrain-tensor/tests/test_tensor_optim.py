"""Multi-tensor AdamW, global gradient norm and clipping (bt.optim: adamw_, grad_norm, clip_coef,
scale_) on the CPU backend, against float64 numpy references; their argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import blutrain.tensor as bt

bto = bt.optim


def np_adamw(p, g, m, v, t, lr, b1, b2, eps, wd):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1**t)
    vhat = v / (1 - b2**t)
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


SHAPES = [(7, 5), (5,), (1,), (3, 1025), (0, 4), (11, 3)]
DECAYS = [0.1, 0.0, 0.0, 0.05, 0.1, 0.2]


def make_state(rng, shapes, dtype=bt.float32, state_dtype=bt.float32):
    ps = [bt.tensor(rng.standard_normal(s).astype(np.float32), dtype=dtype) for s in shapes]
    ms = [bt.zeros(*s, dtype=state_dtype) for s in shapes]
    vs = [bt.zeros(*s, dtype=state_dtype) for s in shapes]
    return ps, ms, vs


@pytest.mark.parametrize("device_scalars", [False, True])
def test_adamw_matches_float64_numpy_over_5_steps(rng, device_scalars):
    b1, b2, eps = 0.9, 0.95, 1e-8
    ps, ms, vs = make_state(rng, SHAPES)
    ref = [(p.numpy().astype(np.float64), 0.0, 0.0) for p in ps]
    for t in range(1, 6):
        lr = 1e-2 * (0.5 + 0.1 * t)
        scale = 0.5 + 0.25 * t  # a clip coefficient folded into the gradients
        gs = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        lr_a = bt.tensor(lr, dtype=bt.float32) if device_scalars else lr
        step_a = bt.tensor(float(t), dtype=bt.float32) if device_scalars else t
        bto.adamw_(
            ps,
            [bt.tensor(g) for g in gs],
            ms,
            vs,
            lr=lr_a,
            betas=(b1, b2),
            eps=eps,
            weight_decay=DECAYS,
            step=step_a,
            grad_scale=bt.tensor(scale, dtype=bt.float32),
        )
        lr_r = float(np.float32(lr)) if device_scalars else lr
        for i in range(len(ps)):
            g64 = gs[i].astype(np.float64) * float(np.float32(scale))
            ref[i] = np_adamw(
                *ref[i][:1], g64, ref[i][1], ref[i][2], t, lr_r, b1, b2, eps, DECAYS[i]
            )
    for i, p in enumerate(ps):
        np.testing.assert_allclose(p.numpy(), ref[i][0], rtol=1e-5, atol=1e-6, err_msg=str(i))
        np.testing.assert_allclose(ms[i].numpy(), ref[i][1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(vs[i].numpy(), ref[i][2], rtol=1e-5, atol=1e-7)


def test_adamw_bumps_versions_and_leaves_grads(rng):
    ps, ms, vs = make_state(rng, [(4, 4), (3,)])
    gs = [bt.tensor(rng.standard_normal(p.shape).astype(np.float32)) for p in ps]
    g0 = [g.numpy().copy() for g in gs]
    vers = [t._version for t in ps + ms + vs]
    gvers = [g._version for g in gs]
    bto.adamw_(ps, gs, ms, vs, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step=1)
    assert all(t._version > v for t, v in zip(ps + ms + vs, vers, strict=True))
    assert [g._version for g in gs] == gvers
    for g, g_before in zip(gs, g0, strict=True):
        assert np.array_equal(g.numpy(), g_before)


def test_adamw_float64_and_bfloat16_params(rng):
    shapes = [(9, 4), (4,)]
    gs = [rng.standard_normal(s) for s in shapes]
    # float64 params keep float64 states
    ps, ms, vs = make_state(rng, shapes, bt.float64, bt.float64)
    p0 = [p.numpy().copy() for p in ps]
    bto.adamw_(
        ps,
        [bt.tensor(g) for g in gs],
        ms,
        vs,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=[0.1, 0.0],
        step=1,
    )
    for i in range(2):
        want = np_adamw(p0[i], gs[i], 0.0, 0.0, 1, 1e-2, 0.9, 0.95, 1e-8, [0.1, 0.0][i])[0]
        np.testing.assert_allclose(ps[i].numpy(), want, rtol=1e-12)
    # bfloat16 params with float32 states
    ps, ms, vs = make_state(rng, shapes, bt.bfloat16, bt.float32)
    p0 = [p.float().numpy().astype(np.float64) for p in ps]
    gb = [bt.tensor(g.astype(np.float32), dtype=bt.bfloat16) for g in gs]
    bto.adamw_(
        ps, gb, ms, vs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=[0.1, 0.0], step=1
    )
    for i in range(2):
        g64 = gb[i].float().numpy().astype(np.float64)
        want, wm, _ = np_adamw(p0[i], g64, 0.0, 0.0, 1, 1e-2, 0.9, 0.95, 1e-8, [0.1, 0.0][i])
        np.testing.assert_allclose(ps[i].float().numpy(), want, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(ms[i].numpy(), wm, rtol=1e-6)


def test_adamw_matches_the_models_python_reference_bitwise(rng):
    pytest.importorskip("blutrain.models")
    from blutrain.models.optim import AdamW

    shapes = {"w": (7, 5), "b": (5,), "emb": (33, 8)}
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    runs = {}
    for fused in (False, True):
        params = {k: bt.nn.Parameter(bt.tensor(v)) for k, v in init.items()}
        opt = AdamW(params.items(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        r = np.random.default_rng(7)
        for step in range(4):
            opt.set_lr(3e-3 * (1 + step))
            for k, p in params.items():
                p.grad = bt.tensor(r.standard_normal(shapes[k]).astype(np.float32))
            opt.step(grad_scale=bt.tensor(0.75, dtype=bt.float32))
        runs[fused] = {k: p.detach().numpy().copy() for k, p in params.items()}
    for k in shapes:  # the same float32 arithmetic, operation for operation
        np.testing.assert_allclose(runs[True][k], runs[False][k], rtol=2e-7, atol=1e-9, err_msg=k)


def test_grad_norm_and_clip_match_numpy(rng):
    shapes = [(64, 33), (1,), (4097,), (0,), (5, 5, 5)]
    gs64 = [rng.standard_normal(s) * 3 for s in shapes]
    gs = [bt.tensor(g.astype(np.float32)) for g in gs64]
    total = math.sqrt(
        sum(float((g.astype(np.float32).astype(np.float64) ** 2).sum()) for g in gs64)
    )
    norm = bto.grad_norm(gs)
    assert norm.shape == () and norm.dtype == bt.float32
    assert float(norm.item()) == pytest.approx(total, rel=1e-6)
    coef = bto.clip_coef(norm, 1.0)
    assert float(coef.item()) == pytest.approx(1.0 / (total + 1e-6), rel=1e-6)
    assert float(bto.clip_coef(norm, 1e9).item()) == 1.0
    bto.scale_(gs, coef)
    after = math.sqrt(sum(float((g.numpy().astype(np.float64) ** 2).sum()) for g in gs))
    assert after == pytest.approx(1.0, rel=1e-5)
    # float64 grads give a float64 norm; None entries are skipped; empty list gives 0
    n64 = bto.grad_norm([bt.tensor(g) for g in gs64] + [None])
    assert n64.dtype == bt.float64
    assert float(n64.item()) == pytest.approx(
        math.sqrt(sum(float((g**2).sum()) for g in gs64)), rel=1e-12
    )
    assert float(bto.grad_norm([]).item()) == 0.0


def test_grad_norm_is_deterministic_and_mixed_dtypes(rng):
    gs = [bt.tensor(rng.standard_normal(s).astype(np.float32)) for s in [(300, 70), (17,)]]
    gs.append(bt.tensor(rng.standard_normal(100).astype(np.float32), dtype=bt.bfloat16))
    a = bto.grad_norm(gs).numpy().tobytes()
    b = bto.grad_norm(gs).numpy().tobytes()
    assert a == b
    total = sum(float((g.float().numpy().astype(np.float64) ** 2).sum()) for g in gs)
    assert float(bto.grad_norm(gs).item()) == pytest.approx(math.sqrt(total), rel=1e-6)


def test_clip_coef_propagates_nan():
    assert math.isnan(float(bto.clip_coef(bt.tensor(float("nan")), 1.0).item()))
    assert float(bto.clip_coef(bt.tensor(float("inf")), 1.0).item()) == 0.0


def test_clip_grad_norm_front_matches_numpy(rng):
    ps = [bt.nn.Parameter(bt.zeros(*s)) for s in [(6, 7), (7,)]]
    gs = [rng.standard_normal(p.shape).astype(np.float32) * 2 for p in ps]
    for p, g in zip(ps, gs, strict=True):
        p.grad = bt.tensor(g)
    total = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
    norm = bt.clip_grad_norm_(ps, 0.5)
    assert float(norm.item()) == pytest.approx(total, rel=1e-6)
    for p, g in zip(ps, gs, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), g * (0.5 / (total + 1e-6)), rtol=1e-6)


# ---- errors --------------------------------------------------------------------------------------
def _lists(rng, n=2):
    ps, ms, vs = make_state(rng, [(3, 2)] * n)
    gs = [bt.zeros(3, 2) for _ in range(n)]
    return ps, gs, ms, vs


def _adamw(ps, gs, ms, vs, **over):
    kw = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "step": 1}
    bto.adamw_(ps, gs, ms, vs, **{**kw, **over})


def test_adamw_errors_name_the_op_and_index(rng):
    ps, gs, ms, vs = _lists(rng)
    with pytest.raises(ValueError, match=r"\[adamw_\] got 2 params but 1 grads"):
        _adamw(ps, gs[:1], ms, vs)
    with pytest.raises(ValueError, match=r"\[adamw_\] got 2 params but 3 weight_decay values"):
        _adamw(ps, gs, ms, vs, weight_decay=[0.0] * 3)
    bad = [gs[0], bt.zeros(3, 2, dtype=bt.float64)]
    with pytest.raises(TypeError, match=r"\[adamw_\] grads\[1\] is float64 but params\[1\] is"):
        _adamw(ps, bad, ms, vs)
    bad = [ms[0], bt.zeros(3, 2, dtype=bt.bfloat16)]
    with pytest.raises(TypeError, match=r"\[adamw_\] exp_avgs\[1\] is bfloat16 but must be"):
        _adamw(ps, gs, bad, vs)
    bad = [vs[0], bt.zeros(2, 3)]
    with pytest.raises(ValueError, match=r"\[adamw_\] exp_avg_sqs\[1\] has shape \(2, 3\)"):
        _adamw(ps, gs, ms, bad)
    bad = [gs[0], bt.zeros(2, 3).t()]
    with pytest.raises(ValueError, match=r"\[adamw_\] grads\[1\] is not contiguous"):
        _adamw(ps, bad, ms, vs)
    with pytest.raises(TypeError, match=r"\[adamw_\] grads\[0\] is a str"):
        _adamw(ps, ["x", gs[1]], ms, vs)
    with pytest.raises(ValueError, match=r"\[adamw_\] grads\[1\] is None"):
        _adamw(ps, [gs[0], None], ms, vs)
    with pytest.raises(TypeError, match=r"\[adamw_\] params\[0\] must be floating point"):
        i64 = [bt.zeros(3, 2, dtype=bt.int64)]
        _adamw(i64, [gs[0]], ms[:1], vs[:1])


BAD_SCALARS = [  # (arguments, exception, message); tensors are made in the test
    ({"betas": (1.0, 0.99)}, ValueError, r"betas must lie in \[0, 1\), got \(1, 0.99\)"),
    ({"betas": 0.9}, TypeError, r"betas must be a pair \(beta1, beta2\), got 0.9"),
    ({"betas": (0.9, "x")}, TypeError, r"beta2 must be a number, got 'x'"),
    ({"step": 0}, ValueError, r"step must be >= 1 .*got 0"),
    ({"lr": -1e-3}, ValueError, r"lr must be >= 0, got -0.001"),
    ({"lr": float("nan")}, ValueError, r"lr must be >= 0, got nan"),
    ({"lr": "big"}, TypeError, r"lr must be a float or a 0-d float32 tensor, got str"),
    ({"eps": -1e-8}, ValueError, r"eps must be >= 0, got -1e-08"),
    ({"weight_decay": [0.1, -0.1]}, ValueError, r"weight_decay\[1\] must be >= 0, got -0.1"),
    ({"weight_decay": "0.1"}, TypeError, r"weight_decay must be a number or one number per tensor"),
    ({"weight_decay": [0.1, None]}, TypeError, r"weight_decay\[1\] must be a number, got None"),
    ({"lr": ((), bt.float64)}, TypeError, r"lr must be float32, got float64"),
    ({"grad_scale": ((2,), bt.float32)}, ValueError, r"grad_scale must be a 0-d tensor"),
    ({"grad_scale": 0.5}, TypeError, r"grad_scale must be None or a 0-d float32 tensor"),
]


@pytest.mark.parametrize(("over", "exc", "message"), BAD_SCALARS)
def test_adamw_bad_scalars_name_the_argument_and_value(rng, over, exc, message):
    ps, gs, ms, vs = _lists(rng)
    over = {k: bt.ones(*v[0], dtype=v[1]) if isinstance(v, tuple) and isinstance(v[0], tuple) else v
            for k, v in over.items()}  # fmt: skip
    before = [t.numpy().copy() for t in ps + ms + vs]
    with pytest.raises(exc, match=r"^\[adamw_\] " + message):
        _adamw(ps, gs, ms, vs, **over)
    for t, b in zip(ps + ms + vs, before, strict=True):  # nothing was written
        assert np.array_equal(t.numpy(), b)


def test_numpy_scalars_are_numbers(rng):
    ps, gs, ms, vs = _lists(rng)
    qs = [p.clone() for p in ps]
    _adamw(ps, gs, ms, vs, lr=np.float32(1e-3), betas=(np.float32(0.9), 0.99), step=np.int64(1))
    m2, v2 = [bt.zeros_like(m) for m in ms], [bt.zeros_like(v) for v in vs]
    lr, b1 = float(np.float32(1e-3)), float(np.float32(0.9))
    _adamw(qs, gs, m2, v2, lr=lr, betas=(b1, 0.99), step=1)
    for p, q in zip(ps, qs, strict=True):
        assert np.array_equal(p.numpy(), q.numpy())


def test_lists_must_be_lists(rng):
    ps, gs, ms, vs = _lists(rng)
    with pytest.raises(
        TypeError, match=r"\[adamw_\] params must be a list of tensors, not a single"
    ):
        _adamw(ps[0], gs, ms, vs)
    with pytest.raises(TypeError, match=r"\[grad_norm\] grads must be a list of tensors, got int"):
        bto.grad_norm(3)
    with pytest.raises(TypeError, match=r"\[scale_\] tensors\[0\] is a float"):
        bto.scale_([1.0], bt.tensor(1.0))


def test_adamw_device_mismatch_names_the_index(rng):
    if bt.cuda_device_count() == 0:
        pytest.skip("needs a CUDA device to place one tensor elsewhere")
    ps, gs, ms, vs = _lists(rng)
    bad = [gs[0], gs[1].to("cuda")]
    with pytest.raises(ValueError, match=r"\[adamw_\] grads\[1\] is on cuda:0 but params\[0\]"):
        _adamw(ps, bad, ms, vs)


def test_grad_norm_and_clip_errors():
    with pytest.raises(TypeError, match=r"\[grad_norm\] grads\[1\] must be floating point"):
        bto.grad_norm([bt.zeros(2), bt.zeros(2, dtype=bt.int64)])
    with pytest.raises(ValueError, match=r"\[grad_norm\] grads\[0\] is not contiguous"):
        bto.grad_norm([bt.zeros(2, 3).t()])
    with pytest.raises(ValueError, match=r"\[scale_\] coef must be a 0-d tensor"):
        bto.scale_([bt.zeros(2)], bt.ones(2))
    with pytest.raises(TypeError, match=r"\[scale_\] tensors\[1\] must be floating point"):
        bto.scale_([bt.zeros(2), bt.zeros(2, dtype=bt.int32)], bt.tensor(1.0))
    with pytest.raises(ValueError, match=r"\[clip_coef\] norm must be a 0-d"):
        bto.clip_coef(bt.ones(2), 1.0)
    norm = bt.tensor(2.0)
    with pytest.raises(
        ValueError, match=r"\[clip_coef\] max_norm and eps must be >= 0, got max_norm -1"
    ):
        bto.clip_coef(norm, -1.0)
    with pytest.raises(ValueError, match=r"\[clip_coef\] .*got max_norm 1, eps nan"):
        bto.clip_coef(norm, 1.0, eps=float("nan"))
    with pytest.raises(TypeError, match=r"\[clip_coef\] max_norm must be a number, got '1'"):
        bto.clip_coef(norm, "1")
    assert float(bto.clip_coef(norm, float("inf")).item()) == 1.0  # inf: never clip
    assert float(bto.clip_coef(norm, 0.0).item()) == 0.0
    with pytest.raises(ValueError, match=r"\[clip_grad_norm_\] max_norm must be >= 0, got -0.5"):
        bt.clip_grad_norm_([bt.nn.Parameter(bt.zeros(2))], -0.5)
