"""On a GPU: every fused kernel pattern, compiled to PTX by our codegen and launched with the
CUDA driver API, against blutrain.tensor's eager CUDA kernels on the same inputs.

Tolerance: 2e-6 of the largest reference magnitude for float32 (block reductions add in another
order than eager's kernels), bf16 to 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.compiler as btc
import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]
from compiler_cases import CASES, RNG, err, u  # noqa: E402


def dev(a: np.ndarray) -> bt.Tensor:
    return bt.tensor(a).to("cuda")


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_kernel_matches_eager(name: str) -> None:
    fn, make = CASES[name]
    args = [dev(a) for a in make()]
    c = btc.compile(fn)
    got = c(*args)
    ref = fn(*args)
    assert err(got, ref) <= 2e-6, name
    (p,) = [v.prog for v in c.programs.values()]
    assert p.stats.groups >= 1 and p.gpu_code.ptx


def test_backward_composites_on_gpu() -> None:
    x, w, b = dev(u(64, 256)), dev(u(256)), dev(u(256))
    t = dev(RNG.integers(0, 256, 64).astype(np.int64))

    def loss(x, w, b, t):
        return bt.cross_entropy(bt.softmax(bt.layer_norm(x, (256,), w, b), -1) * 4, t)

    c = btc.compile(loss)
    assert err(c(x, w, b, t), loss(x, w, b, t)) <= 2e-6


def test_bf16_elementwise_and_norm() -> None:
    x = dev(u(512, 1024)).bfloat16()
    w = dev(u(1024)).bfloat16()

    def f(x, w):
        return bt.layer_norm(bt.gelu(x, approximate="tanh"), (1024,), w, None)

    c = btc.compile(f)
    assert err(c(x, w), f(x, w)) <= 1e-2


def _llama_step_on_gpu(dtype) -> tuple[list[float], list[float], float]:
    """3 AdamW steps of the LLaMA-style tiny model on CUDA, eager and compiled (device lr and
    step: runtime inputs); returns (eager losses, compiled losses, normwise parameter error)."""
    import math
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import llama_ref as L

    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    cfg = L.Config.preset("tiny")
    w0 = L.init_weights(cfg, seed=5)
    cos, sin = (bt.tensor(t).to("cuda").to(dtype=dtype) for t in L.rope_tables(cfg))
    rng = np.random.default_rng(7)
    data = [
        (
            bt.tensor(rng.integers(0, cfg.vocab, (4, cfg.seq))).to("cuda"),
            bt.tensor(rng.integers(0, cfg.vocab, (4, cfg.seq))).to("cuda"),
        )
        for _ in range(3)
    ]

    def make():
        params = {
            k: bt.tensor(v.copy()).to("cuda").to(dtype=dtype).requires_grad_(True)
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


def test_llama_step_fp32_matches_eager() -> None:
    le, lc, perr = _llama_step_on_gpu(bt.float32)
    for a, b in zip(lc, le):
        assert abs(a - b) <= 1e-5 * abs(b), (le, lc)
    assert perr <= 1e-4, perr


def test_llama_step_bf16_matches_eager() -> None:
    le, lc, perr = _llama_step_on_gpu(bt.bfloat16)
    for a, b in zip(lc, le):
        assert abs(a - b) <= 2e-2 * abs(b), (le, lc)
    assert perr <= 2e-2, perr
