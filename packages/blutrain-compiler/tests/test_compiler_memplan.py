"""The static memory plan: intervals never overlap in bytes while live, the planned peak is at
most eager's peak on the same call, a steady-state call makes no allocator call, and a returned
buffer is reused only once the caller has let go of it."""

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

    counts = []
    for _ in range(3):  # `out` holds the previous call's result during each call
        before = alloc.stats("cpu")["alloc_count"]
        out = c(x, w1, w2, w3, g)
        counts.append(alloc.stats("cpu")["alloc_count"] - before)
        np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)
    # the returned (64,) tensor's second buffer, then nothing: intermediates live in the arena
    assert counts == [1, 0, 0], counts
    assert p.stats.planned_bytes == p.plan.size


def test_returned_buffers_are_never_written_while_the_caller_holds_them() -> None:
    """Note [returned buffers]: results kept in a list, a detach() or a view of a result keep
    their values across later calls (each such call gets a fresh buffer); dropped results
    let the buffers take turns again."""
    rng = np.random.default_rng()
    c = btc.compile(lambda x: (x * 2.0).exp().sum(-1))
    xs = [bt.tensor(rng.standard_normal((8, 16)).astype(np.float32)) for _ in range(6)]
    refs = [(x * 2.0).exp().sum(-1).numpy() for x in xs]
    kept = [c(xs[0]), c(xs[1]).detach(), c(xs[2])[1:]]
    counts = []
    for x in xs[3:]:
        before = alloc.stats("cpu")["alloc_count"]
        c(x)
        counts.append(alloc.stats("cpu")["alloc_count"] - before)
    np.testing.assert_array_equal(kept[0].numpy(), refs[0])
    np.testing.assert_array_equal(kept[1].numpy(), refs[1])
    np.testing.assert_array_equal(kept[2].numpy(), refs[2][1:])
    (p,) = [v.prog for v in c.programs.values()]
    (slots,) = p.returned.values()
    # both slots are held (the list, the detach): every call allocates; dropped at once
    assert counts == [1, 1, 1], counts
    del kept
    before = alloc.stats("cpu")["alloc_count"]
    for x, r in zip(xs, refs):
        np.testing.assert_array_equal(c(x).numpy(), r)
    assert alloc.stats("cpu")["alloc_count"] == before and len(slots) == 2


def _index_add_dead(a, idx, src):
    b = a * 2.0
    return (bt.index_add(b, 0, idx, src) * 3.0).sum(-1)


def _index_add_live(a, idx, src):
    b = a * 2.0
    return (bt.index_add(b, 0, idx, src) * 3.0).sum(-1) + b.sum(-1)  # b read afterwards


def test_index_add_over_its_base_only_when_nothing_reads_the_base_afterwards() -> None:
    """Note [shared buffers]: index_add (an eager step) writes over its base when that buffer is
    dead after it: the same values as eager, no allocation for it; when a later step reads the
    base, the base keeps its values (a fresh result)."""
    rng = np.random.default_rng()
    a = bt.tensor(rng.standard_normal((50, 24)).astype(np.float32))
    idx = bt.tensor(rng.integers(0, 50, (40,)))  # repeated rows accumulate
    src = bt.tensor(rng.standard_normal((40, 24)).astype(np.float32))
    for fn, over in ((_index_add_dead, True), (_index_add_live, False)):
        c = btc.compile(fn)
        ref = fn(a, idx, src).numpy()
        np.testing.assert_array_equal(c(a, idx, src).numpy(), ref)
        (p,) = [v.prog for v in c.programs.values()]
        assert bool(p.over) == over, (fn.__name__, p.over)
        before = alloc.stats("cpu")["alloc_count"]
        out = c(a, idx, src)
        allocs = alloc.stats("cpu")["alloc_count"] - before
        np.testing.assert_array_equal(out.numpy(), ref)  # the arena reused: still right
        # the result's own buffer is reused (the first call's result was dropped)
        assert allocs == len(p.fresh_values()) == (not over), (fn.__name__, allocs)


def _adamw_by_ops(params, grads, state, lr, t):
    """AdamW written with in-place ops (llama_ref.bt_adamw's arithmetic): p, m, v updated."""
    bc1 = 1 - bt.pow(bt.full((), 0.9), t)
    bc2 = 1 - bt.pow(bt.full((), 0.95), t)
    for p, g, (m, v) in zip(params, grads, state):
        p.mul_(1 - lr * 0.1)
        m.mul_(0.9).add_(g * 0.1)
        v.mul_(0.95).add_(g * g * 0.05)
        p.sub_(lr * (m / bc1) / (bt.sqrt(v / bc2) + 1e-8))
    return (params[0] * params[0]).sum()


def test_mutations_written_back_early_into_the_arena() -> None:
    """Note [mutations written back early]: an optimizer written with in-place ops computes
    each new p, m, v in a fused kernel; the program copies them into the caller's tensors as
    soon as nothing reads the old ones, so they live in the arena (one parameter's worth at a
    time) rather than in fresh buffers held to the end of the call: the same values as eager,
    no allocator call in the steady state, and a peak (arena included) at most eager's. The
    scalars made from the learning rate and step count run just before their readers
    (Program._sink_constants), not at the start, where their arena bytes stayed live."""
    rng = np.random.default_rng()
    shapes = [(64, 48), (48,), (96, 64), (32, 96)]

    def fresh(seed: int) -> tuple:
        r = np.random.default_rng(seed)
        ps = [bt.tensor(r.standard_normal(s).astype(np.float32)) for s in shapes]
        gs = [bt.tensor(r.standard_normal(s).astype(np.float32)) for s in shapes]
        st = [(bt.zeros(s), bt.zeros(s)) for s in shapes]
        return ps, gs, st

    seed = int(rng.integers(1 << 30))
    pe, ge, se = fresh(seed)
    pc, gc, sc = fresh(seed)
    c = btc.compile(lambda lr, t: _adamw_by_ops(pc, gc, sc, lr, t), scalars=("t",))
    counts, peaks = [], {"eager": 0, "compiled": 0}
    for k in range(1, 5):
        for name in ("eager", "compiled"):
            alloc.reset_peak_stats("cpu")
            s0 = alloc.stats("cpu")
            if name == "eager":
                out = _adamw_by_ops(pe, ge, se, 1e-2, bt.full((), float(k)))
            else:
                out = c(1e-2, k)
            s1 = alloc.stats("cpu")
            if k >= 3:
                peaks[name] = max(peaks[name], s1["allocated_bytes_peak"] - s0["allocated_bytes"])
                if name == "compiled":
                    counts.append(s1["alloc_count"] - s0["alloc_count"])
            del out
        for a, b in zip(pc + [m for ms in sc for m in ms], pe + [m for ms in se for m in ms]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    (p,) = [v.prog for v in c.programs.values()]
    assert p.writeback and p.fresh_values() == [], (p.writeback, p.fresh_values())
    assert counts == [0, 0], counts
    # the arena holds the largest tensor's update (p, m, v: 3 x 96 x 64 floats), not all of them
    assert p.plan.size < sum(3 * 4 * int(np.prod(s)) for s in shapes), p.plan.size
    # in the allocator's own bytes (blocks of 512: a 0-d eager tensor holds 512, as on CUDA, where
    # max_memory_allocated counts them); the arena, allocated at the first call, is one block
    arena = (p.plan.size + 511) // 512 * 512
    assert peaks["compiled"] + arena <= peaks["eager"], (peaks, p.plan.size)


def test_kernel_temporaries_live_in_the_arena_during_their_step_only() -> None:
    """Note [kernel temporaries in the arena]: a kernel's temporaries (a GPU group's values
    between its launches) are planned as buffers live at their step alone. Each wrapped kernel
    below declares temporaries and fills them with garbage before running: were one placed over
    a buffer live at its step, the results would differ from eager's."""
    import ctypes
    from dataclasses import dataclass, field

    from blutrain.compiler import program

    x = bt.randn(64, 96)
    w1, w2, w3 = bt.randn(256, 96) * 0.1, bt.randn(256, 256) * 0.1, bt.randn(32, 256) * 0.1
    g = bt.randn(96)
    args = [x, w1, w2, w3, g]
    with bt.capture() as cg:
        cg.mark_output(mlp(*args))
    graph = btc.from_capture(cg)
    prog = program.build(graph, "cpu")
    rng = np.random.default_rng()

    @dataclass
    class Fn:
        temps: list = field(default_factory=list)

    class WithTemps:
        def __init__(self, inner) -> None:
            self.inner, self.temp_ptrs, self.calls = inner, None, 0
            self.fn = Fn([((n,), "i8", n) for n in rng.integers(1, 40_000, 2).tolist()])

        def __call__(self, ptrs) -> None:
            assert self.temp_ptrs is not None  # set from the arena before the first run
            for p, (_, _, n) in zip(self.temp_ptrs, self.fn.temps):
                ctypes.memset(p, 0xFF, n)  # NaN bits in every float the temporary overlaps
            self.calls += 1
            self.inner(ptrs)

    wrapped = {gid: WithTemps(k) for gid, k in prog.kernels.items()}
    prog.kernels.update(wrapped)
    by_shape = {tuple(a.shape): a for a in args}  # (the five shapes differ)
    env = prog.run([by_shape[tuple(prog.graph.values[v].shape)] for v in prog.graph.inputs])
    out = prog.value(env, prog.graph.outputs[0])
    np.testing.assert_allclose(out.numpy(), mlp(*args).numpy(), rtol=1e-5, atol=1e-5)
    scratch = [b for b in prog.plan.buffers.values() if b.value < 0]
    assert len(scratch) == 2 * len(wrapped) >= 4
    assert all(b.start == b.end for b in scratch)
    lo = prog.arena.data_ptr()
    for k in wrapped.values():
        assert k.calls == 1
        for p, (_, _, n) in zip(k.temp_ptrs, k.fn.temps):
            assert lo <= p and p + n <= lo + prog.plan.size
    # temporaries of different steps share bytes: the arena is below their sum plus the rest
    rest = sum(b.nbytes for b in prog.plan.buffers.values() if b.value >= 0)
    assert prog.plan.size < rest + sum(b.nbytes for b in scratch)


def test_group_output_over_a_dead_input_where_its_kernels_allow_it() -> None:
    """Note [outputs over dead inputs]: given the kernel's (output, input) pair, the plan puts a
    group's output in the buffer of an input that dies at that group (a GEMM's output here), and
    not when a later step reads the input, nor over a graph input."""
    from types import SimpleNamespace

    from blutrain.compiler import fusion, program

    a, b, c = bt.randn(16, 24), bt.randn(24, 32), bt.randn(32, 8)

    def dies(a, b, c):
        return bt.matmul(bt.softmax(bt.matmul(a, b) * 2.0, -1), c)

    def read_later(a, b, c):
        m = bt.matmul(a, b)
        return bt.matmul(bt.softmax(m * 2.0, -1), c) + m.sum()

    def over_input(a, b, c):
        return bt.softmax(a * 2.0, -1)

    def plan(f):
        with bt.capture() as cg:
            cg.mark_output(f(a, b, c))
        prog = program.build(btc.from_capture(cg), "cpu")
        (G,) = [
            s
            for s in prog.part.steps
            if isinstance(s, fusion.Group) and any(n.op == "softmax" for n in s.nodes)
        ]
        assert len(G.inputs) == 1, G.inputs  # (the pair below names argument 0)
        prog.kernels[G.id] = SimpleNamespace(fn=SimpleNamespace(inplace=[(1, 0)], temps=[]))
        prog.prepare(set(prog.graph.live_out()))
        return prog, G

    prog, G = plan(dies)
    assert prog.alias == {G.outputs[0]: G.inputs[0]}
    assert G.outputs[0] not in prog.plan.buffers
    for f in (read_later, over_input):
        prog, G = plan(f)
        assert G.outputs[0] not in prog.alias, f.__name__
