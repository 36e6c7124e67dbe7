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
from compiler_cases import CASES, RNG, err, llama_steps, u  # noqa: E402


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


def test_llama_step_fp32_matches_eager() -> None:
    le, lc, perr = llama_steps(bt.float32, "cuda")
    for a, b in zip(lc, le):
        assert abs(a - b) <= 1e-5 * abs(b), (le, lc)
    assert perr <= 1e-4, perr


def test_llama_step_bf16_matches_eager() -> None:
    le, lc, perr = llama_steps(bt.bfloat16, "cuda")
    for a, b in zip(lc, le):
        assert abs(a - b) <= 2e-2 * abs(b), (le, lc)
    assert perr <= 2e-2, perr
