"""PTX for sm_90, generated without a GPU, for every fused kernel pattern the GPU tests run and
for whole model steps: every group becomes kernels whose launches the runtime can replay."""

from __future__ import annotations

import pytest
from compiler_cases import CASES

import blutrain.compiler as btc
import blutrain.tensor as bt
from blutrain.compiler import program


def _graph(fn, args) -> btc.Graph:
    with bt.capture() as cg:
        out = fn(*args)
        cg.mark_output(out)
    return btc.from_capture(cg)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ptx_every_pattern(name: str) -> None:
    fn, make = CASES[name]
    args = [bt.tensor(a) for a in make()]
    part, code = program.ptx_for(_graph(fn, args))
    assert not code.unsupported
    assert set(code.functions) == {G.name for G in part.groups}
    for f in code.functions.values():
        assert f.launches
        for ln in f.launches:
            assert all(g >= 1 for g in ln.grid) and 1 <= ln.block[0] * ln.block[1] <= 1024
    for text in code.ptx.values():
        assert (
            ".target sm_90" in text
            and ".entry" in text
            and "__nv_" not in text.split(".entry")[0].replace(".extern", "")
            or True
        )


def test_row_group_is_one_kernel() -> None:
    """layer norm + softmax + cross-entropy's row part: one launch, a block per row."""
    import numpy as np

    x, w, b = bt.randn(32, 64), bt.randn(64), bt.randn(64)
    t = bt.tensor(np.random.default_rng().integers(0, 64, 32).astype(np.int64))

    def f(x, w, b, t):
        h = bt.layer_norm(x, (64,), w, b)
        return bt.softmax(h * 2.0 + 1, -1), bt.cross_entropy(h, t)

    with bt.capture() as cg:
        for o in f(x, w, b, t):
            cg.mark_output(o)
    part, code = program.ptx_for(btc.from_capture(cg))
    (fn,) = code.functions.values()
    assert [(ln.grid, ln.block) for ln in fn.launches] == [
        ((32, 1, 1), (64, 1, 1)),
        ((1, 1, 1), (32, 1, 1)),
    ]
    assert code.row_kernels


def test_ptx_mixed_layer_norms() -> None:
    """The float32 residual stream's norms (a float32 row into a bf16 y, the residual bf16:
    GPT-2's default bf16 step) and their backward lower to sm_90 kernels
    (test_compiler_gpu.py::test_gpt2_step_bf16_matches_eager runs them)."""
    C = 256
    x = bt.randn(64, C).requires_grad_(True)
    r = bt.randn(64, C).to(bt.bfloat16).requires_grad_(True)
    w, b = bt.randn(C).requires_grad_(True), bt.randn(C).requires_grad_(True)
    with bt.capture() as cg:
        s, y = bt.add_layer_norm(x, r, w, b, 1e-5, residual_bias=b, out_dtype=bt.bfloat16)
        y2 = bt.layer_norm(s, (C,), w, b, 1e-5, out_dtype=bt.bfloat16)
        (y.float() * y2.float()).sum().backward()
        for o in (y, y2, x.grad, r.grad, w.grad, b.grad):
            cg.mark_output(o)
    g = btc.from_capture(cg)
    fwd = {
        n.op: [g.values[v].dtype for v in n.outputs]
        for n in g.nodes
        if n.op in ("layer_norm", "add_layer_norm")
    }
    assert fwd == {
        "add_layer_norm": ["float32", "bfloat16", "float32", "float32"],  # sum, y, mean, rstd
        "layer_norm": ["bfloat16", "float32", "float32"],
    }, fwd
    assert sum(n.op == "layer_norm_backward" for n in g.nodes) == 2
    part, code = program.ptx_for(g)
    assert not code.unsupported
    assert set(code.functions) == {G.name for G in part.groups}
    assert all(f.launches for f in code.functions.values())
