"""Fused-kernel patterns shared by the GPU tests and the PTX tests (no GPU needed to build them),
and the LLaMA-style training steps the CPU and GPU tests both run."""

from __future__ import annotations

from typing import Any

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


def _llama_ref() -> Any:
    """bench/llama_ref.py (the LLaMA-style model and the steps the benchmarks compile)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import llama_ref

    return llama_ref


def llama_steps(dtype, device: str, ref64: bool = False) -> dict[str, Any]:
    """3 AdamW steps of the LLaMA-style tiny model on `device`, eager and compiled (device lr and
    step: runtime inputs), from the same weights and batches. Returns {"eager": run,
    "compiled": run} and, with ref64, "float64": the eager step in float64 on the CPU (the
    reference both are measured against); a run is (losses, parameters as float64 arrays)."""
    L = _llama_ref()
    from blutrain.models.optim import grad_norm_and_clip_coef

    cfg = L.Config.preset("tiny")
    w0 = L.init_weights(cfg, seed=5)
    rng = np.random.default_rng(7)
    data = [
        (rng.integers(0, cfg.vocab, (4, cfg.seq)), rng.integers(0, cfg.vocab, (4, cfg.seq)))
        for _ in range(3)
    ]

    def run(dtype, device: str, compiled: bool) -> tuple[list[float], list[np.ndarray]]:
        cos, sin = (bt.tensor(t).to(device).to(dtype=dtype) for t in L.rope_tables(cfg))
        params = {
            k: bt.tensor(v.copy()).to(device).to(dtype=dtype).requires_grad_(True)
            for k, v in w0.items()
        }
        opt, plist = L.models_adamw(list(params.items()))

        def step(x, y):
            loss = L.bt_forward(bt, cfg, params, cos, sin, x, y)
            loss = loss if loss.dtype == bt.float64 else loss.float()
            loss.backward()
            _, coef = grad_norm_and_clip_coef(plist, 1.0)
            opt.step(grad_scale=coef)
            opt.zero_grad()
            return loss

        return _run_steps(btc.compile(step) if compiled else step, opt, plist, data, device)

    out = {"eager": run(dtype, device, False), "compiled": run(dtype, device, True)}
    if ref64:
        out["float64"] = run(bt.float64, "cpu", False)
    return out


def gpt2_bf16_steps(residual: str, device: str) -> dict[str, Any]:
    """3 AdamW steps of a small GPT-2 under its bf16 policy with the residual stream `residual`
    ("float32", the default: its layer norms are the mixed ones; "compute": the bf16 stream),
    fused ops on, eager and compiled, from the same weights and batches; {"eager": run,
    "compiled": run}, a run as in llama_steps."""
    from blutrain.models import GPT2, GPT2Config
    from blutrain.models.optim import grad_norm_and_clip_coef

    L = _llama_ref()

    cfg = GPT2Config(
        block_size=16, vocab_size=96, n_layer=2, n_head=2, n_embd=64, vocab_multiple=128
    )
    rng = np.random.default_rng(11)
    data = [(rng.integers(0, 96, (2, 16)), rng.integers(0, 96, (2, 16))) for _ in range(3)]

    def run(compiled: bool) -> tuple[list[float], list[np.ndarray]]:
        bt.manual_seed(1234)
        m = GPT2(cfg, device=device, precision="bf16", residual_dtype=residual, fused=True)
        m.numpy_loss = False  # bt.cross_entropy: the op a capture records
        opt, plist = L.models_adamw(list(m.named_parameters()))

        def step(x, y):
            loss = m(x, y, return_logits=False)[1]
            loss.backward()
            _, coef = grad_norm_and_clip_coef(plist, 1.0)
            opt.step(grad_scale=coef)
            opt.zero_grad(set_to_none=True)
            return loss

        return _run_steps(btc.compile(step) if compiled else step, opt, plist, data, device)

    return {"eager": run(False), "compiled": run(True)}


def _run_steps(f, opt, plist, data, device: str) -> tuple[list[float], list[np.ndarray]]:
    """Calls the step f(x, y) on each batch of data after writing AdamW's device scalars (a cosine
    learning rate: runtime arguments of a compiled step); (losses, parameters in float64)."""
    import math

    losses = []
    for i, (x, y) in enumerate(data):
        opt.write_device_scalars(1e-3 * 0.5 * (1 + math.cos(math.pi * i / 3)), i + 1)
        losses.append(float(f(bt.tensor(x).to(device), bt.tensor(y).to(device)).item()))
    return losses, [np.asarray(p.detach().double().cpu().numpy()) for p in plist]


def normwise(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """||a - b|| / ||b|| over all parameters together."""
    num = sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b))
    return (num / sum(float((y**2).sum()) for y in b)) ** 0.5


def check_against_float64(runs: dict[str, Any], floor: float) -> None:
    """The compiled step at least as close to float64 as the eager one (Note [tolerance
    relative to float64] in test_compiler_gpu.py): for every loss and for the parameters,
    err(compiled) <= 2 * err(eager) + floor, errors measured against the float64 run."""
    (le, pe), (lc, pc), (lr, pr) = runs["eager"], runs["compiled"], runs["float64"]
    for i, (e, c, r) in enumerate(zip(le, lc, lr)):
        ee, ec = abs(e - r) / abs(r), abs(c - r) / abs(r)
        assert ec <= 2 * ee + floor, f"step {i}: loss error vs float64 {ec:.3g}, eager's {ee:.3g}"
    ee, ec = normwise(pe, pr), normwise(pc, pr)
    assert ec <= 2 * ee + floor, f"parameters: error vs float64 {ec:.3g}, eager's {ee:.3g}"
