"""The static memory plan: intervals never overlap in bytes while live, the planned peak is at
most eager's peak on the same call, and a steady-state call allocates only what it returns."""

from __future__ import annotations

import numpy as np

import blutrain.alloc as alloc
import blutrain.compiler as btc
import blutrain.tensor as bt
from blutrain.compiler import memplan


def test_assign_no_overlap_of_live_buffers() -> None:
    rng = np.random.default_rng()
    bufs = []
    for v in range(60):
        s = int(rng.integers(0, 20))
        bufs.append(memplan.Buffer(v, int(rng.integers(1, 5000)), s, s + int(rng.integers(0, 6))))
    size = memplan.assign(bufs)
    for a in bufs:
        assert a.offset % memplan.ALIGN == 0 and a.offset + a.nbytes <= size
        for b in bufs:
            if a is b or a.end < b.start or b.end < a.start:
                continue
            assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    assert size <= sum((b.nbytes + 255) // 256 * 256 for b in bufs)


def mlp(x, w1, w2, w3, g):
    h = bt.layer_norm(x, (x.shape[-1],), g, None)
    h = bt.gelu(bt.linear(h, w1)) * 0.5
    h = bt.softmax(bt.linear(h, w2), -1) + h.sum(-1, keepdim=True) * 1e-3
    return (bt.linear(h, w3).tanh() * 2).sum(-1)


def test_planned_peak_below_eager_and_no_steady_state_allocations() -> None:
    x = bt.randn(64, 96)
    w1, w2, w3 = bt.randn(256, 96) * 0.1, bt.randn(256, 256) * 0.1, bt.randn(32, 256) * 0.1
    g = bt.randn(96)
    c = btc.compile(mlp)
    out = c(x, w1, w2, w3, g)
    ref = mlp(x, w1, w2, w3, g)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)
    (p,) = [v.prog for v in c.programs.values()]

    alloc.reset_peak_stats("cpu")
    base = alloc.stats("cpu")["requested_bytes"]
    mlp(x, w1, w2, w3, g)
    eager_peak = alloc.stats("cpu")["requested_bytes_peak"] - base
    assert 0 < p.plan.size <= eager_peak, (p.plan.size, eager_peak)

    before = alloc.stats("cpu")["alloc_count"]
    c(x, w1, w2, w3, g)
    allocs = alloc.stats("cpu")["alloc_count"] - before
    assert allocs == 1  # the returned (64,) tensor; every intermediate lives in the arena
    assert p.stats.planned_bytes == p.plan.size
