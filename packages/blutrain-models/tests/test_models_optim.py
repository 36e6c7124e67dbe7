"""AdamW, the cosine schedule and gradient clipping against float64 numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models.optim import AdamW, CosineSchedule, clip_grad_norm_, cosine_lr  # noqa: E402


def np_adamw(p, g, m, v, t, lr, b1, b2, eps, wd):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1**t)
    vhat = v / (1 - b2**t)
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


def make_params(rng):
    shapes = {"w": (7, 5), "b": (5,), "ln": (5,), "emb": (11, 3)}
    return {
        k: bt.nn.Parameter(bt.tensor(rng.standard_normal(s).astype(np.float32)))
        for k, s in shapes.items()
    }


def test_adamw_matches_float64_reference(rng):
    params = make_params(rng)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    opt = AdamW(params.items(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    assert opt.decay == {"w": True, "b": False, "ln": False, "emb": True}
    ref = {k: (p.detach().numpy().astype(np.float64), 0.0, 0.0) for k, p in params.items()}
    for t in range(1, 8):
        lr_t = lr * (0.5 + 0.1 * t)
        opt.set_lr(lr_t)
        for k, p in params.items():
            g = rng.standard_normal(p.shape).astype(np.float32)
            p.grad = bt.tensor(g)
            rp, rm, rv = ref[k]
            ref[k] = np_adamw(
                rp, g.astype(np.float64), rm, rv, t, lr_t, b1, b2, eps, wd if p.ndim >= 2 else 0.0
            )
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in params.values())
    for k, p in params.items():
        np.testing.assert_allclose(p.detach().numpy(), ref[k][0], rtol=1e-5, atol=1e-6, err_msg=k)


def test_adamw_skips_params_without_grad_and_no_decay_override(rng):
    params = make_params(rng)
    before = {k: p.detach().numpy().copy() for k, p in params.items()}
    opt = AdamW(params.items(), lr=0.1, weight_decay=0.5, no_decay=["w"])
    assert opt.decay["w"] is False and opt.decay["b"] is True
    params["b"].grad = bt.zeros(5)
    opt.step()
    assert np.array_equal(params["w"].detach().numpy(), before["w"])  # no grad: untouched
    # zero gradient: only the decay moves b
    np.testing.assert_allclose(
        params["b"].detach().numpy(), before["b"] * (1 - 0.1 * 0.5), rtol=1e-6
    )
    assert set(opt.state) == {"b"}


def test_adamw_state_dict_round_trip_is_bit_exact(rng):
    def run(params, opt, grads):
        for g in grads:
            for k, p in params.items():
                p.grad = bt.tensor(g[k])
            opt.step()

    grads = [
        {
            k: rng.standard_normal(s).astype(np.float32)
            for k, s in {"w": (7, 5), "b": (5,), "ln": (5,), "emb": (11, 3)}.items()
        }
        for _ in range(6)
    ]
    seed = int(rng.integers(1 << 30))
    pa = make_params(np.random.default_rng(seed))
    oa = AdamW(pa.items(), lr=3e-3)
    run(pa, oa, grads)
    pb = make_params(np.random.default_rng(seed))
    ob = AdamW(pb.items(), lr=3e-3)
    run(pb, ob, grads[:3])
    sd = ob.state_dict()
    assert set(sd["tensors"]) == {f"{m}/{k}" for m in ("exp_avg", "exp_avg_sq") for k in pb}
    assert sd["meta"]["steps"] == {k: 3 for k in pb}
    # a fresh optimizer (and fresh parameter objects holding the same values) resumes exactly
    pc = {k: bt.nn.Parameter(bt.tensor(p.detach().numpy())) for k, p in pb.items()}
    oc = AdamW(pc.items(), lr=1.0)
    oc.load_state_dict(
        {"meta": sd["meta"], "tensors": {k: v.copy() for k, v in sd["tensors"].items()}}
    )
    assert oc.lr == 3e-3
    run(pc, oc, grads[3:])
    for k in pa:
        assert np.array_equal(pa[k].detach().numpy(), pc[k].detach().numpy()), k


def test_adamw_load_state_dict_errors(rng):
    params = make_params(rng)
    opt = AdamW(params.items())
    for p in params.values():
        p.grad = bt.ones(*p.shape)
    opt.step()
    sd = opt.state_dict()
    bad = {"meta": sd["meta"], "tensors": dict(sd["tensors"])}
    bad["tensors"]["exp_avg/w"] = np.zeros((5, 7), np.float32)
    with pytest.raises(ValueError, match=r"exp_avg/w has shape \(5, 7\).*\(7, 5\)"):
        AdamW(params.items()).load_state_dict(bad)
    del bad["tensors"]["exp_avg_sq/b"]
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['exp_avg_sq/b'\]"):
        AdamW(params.items()).load_state_dict(bad)
    with pytest.raises(ValueError, match="unknown parameter"):
        AdamW([("w", params["w"])]).load_state_dict(sd)
    with pytest.raises(ValueError, match="not an AdamW state dict"):
        AdamW(params.items()).load_state_dict({"state": {}})


def test_adamw_argument_errors():
    p = bt.nn.Parameter(bt.zeros(3))
    with pytest.raises(ValueError, match="lr"):
        AdamW([p], lr=-1)
    with pytest.raises(ValueError, match="betas"):
        AdamW([p], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="empty"):
        AdamW([])
    with pytest.raises(TypeError, match="not floating point"):
        AdamW([bt.zeros(3, dtype=bt.int64)])
    with pytest.raises(TypeError, match="single tensor"):
        AdamW(p)


def test_cosine_schedule():
    s = CosineSchedule(1.0, warmup_steps=10, max_steps=110, min_lr=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(4) == pytest.approx(0.5)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.55)  # halfway down the cosine
    assert s(110) == pytest.approx(0.1) and s(500) == 0.1
    lrs = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone after warmup
    assert CosineSchedule(3.0, 0, 10)(10) == pytest.approx(0.3)  # min_lr defaults to lr/10
    assert cosine_lr(35, 1.0, 10, 110, 0.1) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi * 0.25))
    )
    with pytest.raises(ValueError):
        CosineSchedule(1.0, -1, 10)


def test_cosine_schedule_extend():
    """A resumed run with a new end: from the resume step, the cosine runs from the learning
    rate reached there to the new min_lr; the learning rate never rises; the warmup is kept."""
    s = CosineSchedule(1.0, warmup_steps=10, max_steps=110, min_lr=0.1)
    e = s.extend(60, 210, 0.1)  # half-way, twice as long
    assert e(60) == s(60) and e(210) == pytest.approx(0.1)
    lrs = [e(i) for i in range(60, 211)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert e(135) == pytest.approx(0.1 + 0.5 * (s(60) - 0.1))  # half-way down the new cosine
    w = s.extend(5, 50, 0.1)  # inside the warmup: the same warmup, then the whole cosine
    assert [w(i) for i in range(11)] == [s(i) for i in range(11)] and w(50) == 0.1
    done = s.extend(110, 200, 0.1)  # finished: stays at min_lr
    assert {done(i) for i in range(110, 201)} == {0.1}
    lower = s.extend(110, 200, 0.01)  # a lower min_lr: decays on from where it is
    assert lower(110) == 0.1 and lower(200) == pytest.approx(0.01)
    assert CosineSchedule.from_state(e.state_dict()) == e
    with pytest.raises(ValueError, match="above the learning rate"):
        s.extend(110, 200, 0.5)
    with pytest.raises(ValueError, match="already at step 60"):
        s.extend(60, 60, 0.1)


def test_clip_grad_norm(rng):
    params = make_params(rng)
    grads = {k: rng.standard_normal(p.shape).astype(np.float32) * 3 for k, p in params.items()}
    for k, p in params.items():
        p.grad = bt.tensor(grads[k])
    total = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    norm = clip_grad_norm_(params.values(), 1.0)
    assert norm == pytest.approx(total, rel=1e-5)
    after = math.sqrt(
        sum(float((p.grad.numpy().astype(np.float64) ** 2).sum()) for p in params.values())
    )
    assert after == pytest.approx(1.0, rel=1e-5)
    # below the threshold: unchanged; 0 or inf: only measures
    before = {k: p.grad.numpy().copy() for k, p in params.items()}
    assert clip_grad_norm_(params.values(), 10.0) == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm_(params.values(), 0.0) == pytest.approx(1.0, rel=1e-5)
    for k, p in params.items():
        np.testing.assert_allclose(p.grad.numpy(), before[k], rtol=1e-6)
    assert clip_grad_norm_([bt.nn.Parameter(bt.zeros(2))], 1.0) == 0.0


def test_adamw_device_scalars_give_the_same_bits(rng):
    """Note [AdamW in a CUDA graph]: lr and the step count read from 0-d float32 tensors give
    the host scalars' updates bit for bit when lr is a float32 value; the step counts and the
    errors for misuse are checked too."""
    w0 = rng.standard_normal((8, 5)).astype(np.float32)
    b0 = rng.standard_normal(5).astype(np.float32)
    grads = [
        (rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32))
        for _ in range(4)
    ]
    out = {}
    for dev_scalars in (False, True):
        w, b = bt.tensor(w0, requires_grad=True), bt.tensor(b0, requires_grad=True)
        opt = AdamW({"w": w, "b": b}, lr=2.0**-7, weight_decay=0.1)
        if dev_scalars:
            opt.use_device_scalars(True)
        for i, (gw, gb) in enumerate(grads):
            opt.set_lr(2.0 ** -(7 + i))  # float32-exact values: the host path then agrees
            w.grad, b.grad = bt.tensor(gw), bt.tensor(gb)
            opt.step()
        out[dev_scalars] = (w.detach().numpy().copy(), b.detach().numpy().copy())
        assert opt.common_step() == 4
    assert np.array_equal(out[True][0], out[False][0])
    assert np.array_equal(out[True][1], out[False][1])
    opt.advance_steps()
    assert opt.common_step() == 5
    opt.state["b"]["step"] = 2
    with pytest.raises(RuntimeError, match="different step counts"):
        opt.common_step()
    plain = AdamW({"w": bt.tensor(w0, requires_grad=True)})
    with pytest.raises(RuntimeError, match="use_device_scalars"):
        plain.write_device_scalars(1e-3, 1)
    with pytest.raises(ValueError, match="fused"):
        AdamW({"w": bt.tensor(w0, requires_grad=True)}, fused=False).use_device_scalars(True)


def test_device_scalars_written_in_place_without_allocator_calls(rng):
    """Note [scalars written in place]: on the CPU write_device_scalars writes the lr and step
    tensors through numpy views of their memory: no allocator call (blutrain.alloc's count),
    the same tensors (a compiled program holds them), and fill_'s float32 rounding of the same
    double, for lrs that are not float32 values."""
    import blutrain.alloc as alloc

    opt = AdamW({"w": bt.tensor(rng.standard_normal((3, 4)).astype(np.float32))})
    opt.use_device_scalars(True)
    lr_t, step_t = opt._dev_scalars["cpu"]
    ptrs = (lr_t.data_ptr(), step_t.data_ptr())
    ref = bt.zeros((), dtype=bt.float32)
    for k in range(20):
        lr = float(rng.uniform(1e-6, 1e-2))
        before = alloc.stats("cpu")["alloc_count"]
        opt.write_device_scalars(lr, k + 1)
        assert alloc.stats("cpu")["alloc_count"] == before
        ref.fill_(lr)
        assert lr_t.numpy().tobytes() == ref.numpy().tobytes()
        assert float(step_t.item()) == k + 1 and opt.lr == lr
    assert (lr_t.data_ptr(), step_t.data_ptr()) == ptrs


def test_cuda_graph_needs_a_gpu(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from blutrain.models.train_config import TrainConfig
    from blutrain.models.trainer import Trainer

    with pytest.raises(ValueError, match="step cuda-graph needs a CUDA device, not cpu"):
        Trainer(TrainConfig(device="cpu", step="cuda-graph", out_dir=str(tmp_path)))
