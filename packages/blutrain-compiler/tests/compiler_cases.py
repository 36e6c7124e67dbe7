"""Fused-kernel patterns shared by the GPU tests and the PTX tests (no GPU needed to build them),
and the LLaMA-style training steps the CPU and GPU tests both run."""

from __future__ import annotations

import numpy as np

import blutrain.compiler as btc
import blutrain.tensor as bt

RNG = np.random.default_rng()


def dev(a: np.ndarray) -> bt.Tensor:
    return bt.tensor(a).to("cuda")


def err(got: bt.Tensor, ref: bt.Tensor) -> float:
    a = np.asarray(got.float().cpu().numpy(), np.float64)
    b = np.asarray(ref.float().cpu().numpy(), np.float64)
    assert a.shape == b.shape
    fin = np.isfinite(b)
    np.testing.assert_array_equal(np.isfinite(a), fin)
    return float(np.abs(a[fin] - b[fin]).max(initial=0) / max(np.abs(b[fin]).max(initial=0), 1e-30))


def u(*shape: int, lo: float = -2, hi: float = 2) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def _causal(T: int, device: str) -> bt.Tensor:
    i = bt.arange(T, device=device)
    return i.reshape(1, T).gt(i.reshape(T, 1))


CASES = {
    "elementwise_chain": (lambda x: (x * 2 + 1).tanh() * x.sigmoid(), lambda: [u(257, 1031)]),
    "gelu_tanh": (lambda x: bt.gelu(x, approximate="tanh"), lambda: [u(64, 3072)]),
    "broadcast": (lambda x, b: (x + b) * b.exp(), lambda: [u(96, 768), u(768)]),
    "row_sum": (lambda x: (x * x).sum(-1), lambda: [u(333, 517)]),
    "col_sum": (lambda x: x.sum(0), lambda: [u(1024, 768)]),
    "full_mean": (lambda x: (x.abs() + 1).mean(), lambda: [u(128, 129)]),
    "softmax": (lambda x: bt.softmax(x * 0.125, -1), lambda: [u(4, 12, 64, 64, lo=-8, hi=8)]),
    "log_softmax": (lambda x: bt.log_softmax(x, -1), lambda: [u(512, 1000, lo=-8, hi=8)]),
    "layer_norm": (
        lambda x, w, b: bt.layer_norm(x, (768,), w, b),
        lambda: [u(8, 128, 768), u(768), u(768)],
    ),
    "residual_layer_norm": (
        lambda x, r, w, b: bt.layer_norm(x + r, (768,), w, b),
        lambda: [u(1024, 768), u(1024, 768), u(768), u(768)],
    ),
    "cross_entropy": (
        lambda x, t: bt.cross_entropy(x, t),
        lambda: [u(256, 50257, lo=-6, hi=6), RNG.integers(0, 50257, 256).astype(np.int64)],
    ),
    "masked_softmax": (
        lambda x: bt.softmax(x.masked_fill(_causal(64, str(x.device)), float("-inf")), -1),
        lambda: [u(8, 64, 64)],
    ),
}


def llama_steps(dtype, device: str) -> tuple[list[float], list[float], float]:
    """3 AdamW steps of the LLaMA-style tiny model on `device`, eager and compiled (device lr and
    step: runtime inputs); returns (eager losses, compiled losses, normwise parameter error)."""
    import math
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import llama_ref as L

    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    cfg = L.Config.preset("tiny")
    w0 = L.init_weights(cfg, seed=5)
    cos, sin = (bt.tensor(t).to(device).to(dtype=dtype) for t in L.rope_tables(cfg))
    rng = np.random.default_rng(7)
    data = [
        (
            bt.tensor(rng.integers(0, cfg.vocab, (4, cfg.seq))).to(device),
            bt.tensor(rng.integers(0, cfg.vocab, (4, cfg.seq))).to(device),
        )
        for _ in range(3)
    ]

    def make():
        params = {
            k: bt.tensor(v.copy()).to(device).to(dtype=dtype).requires_grad_(True)
            for k, v in w0.items()
        }
        opt = AdamW(list(params.items()), lr=1e-3, weight_decay=0.1)
        opt.use_device_scalars()
        for n, p in opt.params:
            opt._state_for(n, p)
        plist = list(params.values())

        def step(x, y):
            loss = L.bt_forward(bt, cfg, params, cos, sin, x, y).float()
            loss.backward()
            _, coef = grad_norm_and_clip_coef(plist, 1.0)
            opt.step(grad_scale=coef)
            opt.zero_grad()
            return loss

        return step, opt, plist

    (se, oe, pe), (sc, oc, pc) = make(), make()
    sc = btc.compile(sc)
    le, lc = [], []
    for i, (x, y) in enumerate(data):
        lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * i / 3))
        oe.write_device_scalars(lr, i + 1)
        le.append(float(se(x, y).item()))
        oc.write_device_scalars(lr, i + 1)
        lc.append(float(sc(x, y).item()))
    num = den = 0.0
    for a, b in zip(pc, pe):
        a64 = a.detach().float().cpu().numpy().astype(np.float64)
        b64 = b.detach().float().cpu().numpy().astype(np.float64)
        num += float(((a64 - b64) ** 2).sum())
        den += float((b64**2).sum())
    return le, lc, (num / den) ** 0.5
