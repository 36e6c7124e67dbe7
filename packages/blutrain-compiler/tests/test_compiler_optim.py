"""The optimizer's captured primitives lowered as fused elementwise kernels: adamw_ (device lr
and step: runtime inputs), grad_norm, clip_coef, scale_, accumulate_grad, against the eager
multi-tensor kernels. The graphs are built in the compiler's own form (what a capture records,
docs/graph_format.md in blutrain-tensor)."""

from __future__ import annotations

import numpy as np
from mlir import ir

import blutrain.tensor as bt
from blutrain.compiler import program
from blutrain.compiler.graph import Graph, Node, Value

RNG = np.random.default_rng()


def _graph(shapes, dtypes, nodes, outputs) -> Graph:
    g = Graph()
    vid = 0
    for sh, dt in zip(shapes, dtypes):
        g.values[vid] = Value(vid, tuple(sh), dt, "cpu", "", True)
        g.inputs.append(vid)
        vid += 1
    for op, attrs, ins, out_specs in nodes:
        outs = []
        for sh, dt in out_specs:
            g.values[vid] = Value(vid, tuple(sh), dt, "cpu")
            outs.append(vid)
            vid += 1
        g.nodes.append(Node(op, attrs, ins, outs))
    g.outputs = outputs(g)
    g.reindex()
    return g


def test_adamw_matches_eager_kernel() -> None:
    shapes = [(7, 5), (5,), (3, 4, 2)]
    k = len(shapes)
    wds = [0.1, 0.0, 0.1]
    P = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    Gr = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    M = [RNG.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
    V = [np.abs(RNG.standard_normal(s)).astype(np.float32) * 0.01 for s in shapes]
    lr, step, scale = 3e-4, 7.0, 0.5
    attrs = {
        "lr": 0.0,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "step": 0,
        "n": k,
        "weight_decays": tuple(wds),
        "has_lr": True,
        "has_step": True,
        "has_scale": True,
        "has_copies": False,
    }
    ins = list(range(4 * k + 3))
    outs = [(s, "float32") for s in shapes] * 3
    g = _graph(
        shapes * 4 + [(), (), ()],
        ["float32"] * (4 * k + 3),
        [("adamw_", attrs, ins, outs)],
        lambda g: g.nodes[0].outputs,
    )
    prog = program.build(g, "cpu")
    tens = [bt.tensor(a.copy()) for a in P + Gr + M + V] + [
        bt.full((), lr),
        bt.full((), step),
        bt.full((), scale),
    ]
    env = prog.run(tens)
    got = [prog.value(env, o).numpy() for o in g.outputs]
    # eager: the multi-tensor kernel in place
    p, gr, m, v = ([bt.tensor(a.copy()) for a in arrs] for arrs in (P, Gr, M, V))
    bt._tensor._adamw_(
        p, gr, m, v, bt.full((), lr), 0.9, 0.95, 1e-8, wds, bt.full((), step), bt.full((), scale)
    )
    for a, b in zip(got, [t.numpy() for t in p + m + v]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_grad_norm_clip_scale() -> None:
    shapes = [(40, 3), (17,)]
    xs = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    g = _graph(
        shapes,
        ["float32"] * 2,
        [
            ("grad_norm", {}, [0, 1], [((), "float32")]),
            ("clip_coef", {"max_norm": 1.0, "eps": 1e-6}, [2], [((), "float32")]),
            ("scale_", {}, [0, 1, 3], [(s, "float32") for s in shapes]),
        ],
        lambda g: [2, 3, 4, 5],
    )
    prog = program.build(g, "cpu")
    env = prog.run([bt.tensor(a) for a in xs])
    norm = np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in xs))
    got = [prog.value(env, o).numpy() for o in g.outputs]
    np.testing.assert_allclose(got[0], norm, rtol=1e-6)
    coef = np.float32(1.0) / (np.float32(norm) + np.float32(1e-6))
    np.testing.assert_allclose(got[1], min(coef, 1.0), rtol=1e-6)
    for a, x in zip(got[2:], xs):
        np.testing.assert_allclose(a, x * np.float32(min(coef, 1.0)), rtol=1e-6)


def test_accumulate_grad_with_and_without_prev() -> None:
    a, b = (
        RNG.standard_normal((4, 3)).astype(np.float32),
        RNG.standard_normal((4, 3)).astype(np.float32),
    )
    g = _graph(
        [(4, 3)] * 3,
        ["float32"] * 3,
        [
            ("accumulate_grad", {}, [0, 1], [((4, 3), "float32")]),
            ("accumulate_grad", {}, [0, 1, 2], [((4, 3), "float32")]),
        ],
        lambda g: [3, 4],
    )
    prog = program.build(g, "cpu")
    env = prog.run([bt.zeros((4, 3)), bt.tensor(a), bt.tensor(b)])
    np.testing.assert_array_equal(prog.value(env, 3).numpy(), a)
    np.testing.assert_array_equal(prog.value(env, 4).numpy(), b + a)


def test_grad_norm_chunks_side_by_side_keep_eager_bits() -> None:
    """Note [chunk sums side by side] (lower.py): the chunks of 4096 elements summed 8 at a time
    side by side, the rest one after another, the tail last: for one tensor the compiled norm is
    eager's GradNorm bit for bit (the same float partials added in float64 in the same order).
    Chunk counts: fewer than a group (7), one whole group (8), groups with 3 chunks left over
    and a ragged tail (19 + 123 elements), a float64 tensor (double partials)."""
    K = 4096
    for numel, dt in (
        (7 * K + 5, "float32"),
        (8 * K, "float32"),
        (19 * K + 123, "float32"),
        (17 * K + 1, "float64"),
    ):
        x = (RNG.standard_normal(numel) * RNG.uniform(0.1, 10.0)).astype(dt)
        shape = (numel // 2, 2) if numel % 2 == 0 else (numel,)
        g = _graph([shape], [dt], [("grad_norm", {}, [0], [((), dt)])], lambda g: [1])
        prog = program.build(g, "cpu")
        env = prog.run([bt.tensor(x.reshape(shape))])
        got = prog.value(env, 1).numpy()
        ref = bt.optim.grad_norm([bt.tensor(x.reshape(shape))]).numpy()
        assert got.tobytes() == ref.tobytes(), (numel, dt, got, ref)
        np.testing.assert_allclose(got, np.sqrt((x.astype(np.float64) ** 2).sum()), rtol=1e-6)
        groups = numel // K // 8
        if groups:  # the partials of whole groups: one (groups, 8) accumulator
            with ir.Context(), ir.Location.unknown():
                text = str(prog.lower_all())
            acc = "f32" if dt == "float32" else "f64"
            assert f"tensor<{groups}x8x4096x{acc}>" in text and f"tensor<{groups}x8x{acc}>" in text
