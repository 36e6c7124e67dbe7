"""Autograd semantics: accumulation, retain_graph, grad mode, hooks, Function, version counters."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import blutrain.tensor as bt


def test_leaf_grad_accumulates(rng):
    a = rng.standard_normal((3, 4))
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    (x * 2).sum().backward()
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 + 2 * a)
    assert x.is_leaf and not (x * 2).is_leaf
    assert x.grad.requires_grad is False


def test_accumulation_is_in_place_so_grad_views_stay_valid():
    x = bt.ones(4, requires_grad=True)
    (x * 3).sum().backward()
    g = x.grad
    ptr = g.data_ptr()
    (x * 2).sum().backward()
    assert x.grad.data_ptr() == ptr
    np.testing.assert_array_equal(g.numpy(), np.full(4, 5.0))


def test_shared_subgraph_and_diamond(rng):
    a = rng.standard_normal(5)
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    y = x.exp()
    z = y * y + y.sin()
    z.sum().backward()
    e = np.exp(a)
    np.testing.assert_allclose(x.grad.numpy(), 2 * e * e + np.cos(e) * e)


def test_second_backward_raises_and_retain_graph_allows_it():
    x = bt.ones(3, requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full(3, 4.0))
    with pytest.raises(RuntimeError, match=r"\[backward\].*second time.*retain_graph"):
        y.backward()


def test_graph_is_freed_after_backward():
    x = bt.ones(1000, requires_grad=True)
    y = x.exp()
    node = y.grad_fn
    y.sum().backward()
    # the saved output was released: nothing but our handles keeps y's data
    assert node is not None
    del y
    gc.collect()


def test_non_scalar_backward_needs_gradient():
    x = bt.ones(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\[backward\].*one-element.*\(2, 3\)"):
        (x * 2).backward()
    (x * 2).backward(bt.ones(2, 3))
    with pytest.raises(RuntimeError, match=r"\[backward\] gradient has shape"):
        (x * 2).backward(bt.ones(3))


def test_backward_on_tensor_without_grad():
    with pytest.raises(RuntimeError, match=r"\[backward\].*does not require grad"):
        bt.ones(2).sum().backward()


def test_no_grad_enable_grad_and_detach():
    x = bt.ones(3, requires_grad=True)
    with bt.no_grad():
        y = x * 2
        assert not bt.is_grad_enabled()
        with bt.enable_grad():
            z = x * 2
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad and z.grad_fn is not None
    d = (x * 3).detach()
    assert not d.requires_grad and d.is_leaf
    assert d._shares_storage(d)

    @bt.no_grad()
    def f(t):
        return t * 2

    assert not f(x).requires_grad
    with bt.set_grad_enabled(False):
        assert not (x + 1).requires_grad
    assert bt.is_grad_enabled()


def test_int_outputs_do_not_require_grad():
    x = bt.randn(3, 4, requires_grad=True)
    assert not x.argmax(1).requires_grad
    assert not (x > 0).requires_grad
    with pytest.raises(RuntimeError, match=r"\[requires_grad_\] only floating"):
        bt.ones(3, dtype=bt.int64).requires_grad_()


def test_inplace_on_saved_tensor_is_detected():
    x = bt.ones(3, requires_grad=True)
    y = x.exp()
    z = y * 2  # mul saves y
    y.add_(1)
    with pytest.raises(RuntimeError, match=r"\[backward\].*modified by an in-place operation"):
        z.sum().backward()


def test_inplace_tracks_history():
    a = np.array([1.0, 2.0, 3.0])
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    y = x * 2
    y.mul_(x)  # y = 2 x^2
    y.add_(1)
    assert y.grad_fn is not None
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * a)


def test_inplace_on_leaf_requiring_grad_raises():
    x = bt.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\[add_\] a leaf tensor that requires grad"):
        x.add_(1)
    with bt.no_grad():
        x.add_(1)  # optimizer-style update is fine
    np.testing.assert_array_equal(x.detach().numpy(), np.full(3, 2.0))


def test_hooks_and_retain_grad():
    x = bt.tensor([1.0, 2.0], requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 10)
    y = x * 3
    y.retain_grad()
    y.register_hook(lambda g: g + 1)
    y.sum().backward()
    np.testing.assert_array_equal(y.grad.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(seen[0], [6.0, 6.0])
    np.testing.assert_array_equal(x.grad.numpy(), [60.0, 60.0])


def test_post_accumulate_hook_fires_once_grad_is_final_in_reverse_order():
    # Two layers: w2's gradient is final before w1's (what bucketed all-reduce relies on).
    w1 = bt.ones(3, requires_grad=True)
    w2 = bt.ones(3, requires_grad=True)
    order = []
    w1.register_post_accumulate_grad_hook(lambda p: order.append(("w1", p.grad.numpy().copy())))
    w2.register_post_accumulate_grad_hook(lambda p: order.append(("w2", p.grad.numpy().copy())))
    h = w1 * 2
    h2 = h * w2 + w1  # w1 reached twice: its hook must see the summed gradient, once
    h2.sum().backward()
    assert [n for n, _ in order] == ["w2", "w1"]
    np.testing.assert_array_equal(order[1][1], [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(order[0][1], [2.0, 2.0, 2.0])


def test_multiple_roots():
    x = bt.ones(2, requires_grad=True)
    a, b = (x * 2).sum(), (x * 3).sum()
    bt.backward([a, b])
    np.testing.assert_array_equal(x.grad.numpy(), [5.0, 5.0])


def test_dtype_of_gradient_matches_input():
    x = bt.ones(3, dtype=bt.bfloat16, requires_grad=True)
    y = (x.float() * bt.ones(3, dtype=bt.float64)).sum()
    assert y.dtype == bt.float64
    y.backward()
    assert x.grad.dtype == bt.bfloat16
    np.testing.assert_array_equal(x.grad.float().numpy(), [1.0, 1.0, 1.0])


def test_function_api(rng):
    class Cube(bt.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.save_for_backward(x)
            ctx.k = k
            return x * x * x * k

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g * ctx.k, None

    a = rng.standard_normal(4)
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    y = Cube.apply(x, 2.0)
    assert y.grad_fn.name() == "Cube"
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * a * a)
    assert bt.gradcheck(lambda t: Cube.apply(t, 0.5), [x])

    class Twice(bt.Function):
        @staticmethod
        def forward(ctx, x):
            return x, x * 2

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 + 2 * g2

    p, q = Twice.apply(x)
    (p.sum() + q.sum()).backward()

    x2 = bt.ones(2, requires_grad=True)
    y2 = Cube.apply(x2, 1.0)
    with bt.no_grad():
        x2.mul_(2)
    with pytest.raises(RuntimeError, match=r"saved by Cube.save_for_backward was modified"):
        y2.sum().backward()


def test_function_wrong_number_of_gradients():
    class Bad(bt.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g

    x = bt.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\[Bad\] backward returned 1 gradients, expected 2"):
        Bad.apply(x, x).sum().backward()


def test_requires_grad_flag_changes():
    x = bt.ones(2)
    assert not x.requires_grad
    x.requires_grad = True
    y = x * 2
    with pytest.raises(RuntimeError, match=r"only change requires_grad of leaf"):
        y.requires_grad = False
    assert repr(y).endswith("grad_fn=<MulBackward>)")
    assert "requires_grad=True" in repr(x)


def test_views_carry_gradients(rng):
    a = rng.standard_normal((4, 6))
    x = bt.tensor(a, dtype=bt.float64, requires_grad=True)
    parts = x.chunk(2, 1)
    (parts[0] * 2 + parts[1].exp()).sum().backward()
    ref = np.concatenate([np.full((4, 3), 2.0), np.exp(a[:, 3:])], 1)
    np.testing.assert_allclose(x.grad.numpy(), ref)


def test_hook_handles_remove():
    x = bt.ones(2, requires_grad=True)
    calls = []
    h = x.register_hook(lambda g: calls.append(1))
    p = x.register_post_accumulate_grad_hook(lambda t: calls.append(2))
    (x * 2).sum().backward()
    assert calls == [1, 2]
    h.remove()
    p.remove()
    (x * 2).sum().backward()
    assert calls == [1, 2]
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, 4.0])


def _calls_during(fn):
    """How many hook calls the C++ engine made while fn ran."""
    before = bt._tensor._hook_calls()
    fn()
    return bt._tensor._hook_calls() - before


def test_removed_hooks_leave_the_cpp_core():
    """remove() erases the C++ entry (Note [removable hooks]): backward calls nothing, not even a
    disabled Python stub, and the callable is released. Leaf hooks, post-accumulate hooks and a
    non-leaf's hooks (kept on its grad_fn)."""
    x = bt.ones(3, requires_grad=True)
    y = x * 3
    calls = []

    def leaf_hook(g):
        calls.append("leaf")

    def post_hook(t):
        calls.append("post")

    def mid_hook(g):
        calls.append("mid")

    refs = [weakref.ref(f) for f in (leaf_hook, post_hook, mid_hook)]
    handles = [
        x.register_hook(leaf_hook),
        x.register_post_accumulate_grad_hook(post_hook),
        y.register_hook(mid_hook),
    ]
    assert x._hook_counts() == (1, 1) and y._hook_counts() == (1, 0)
    assert _calls_during(lambda: y.sum().backward(retain_graph=True)) == 3
    assert calls == ["mid", "leaf", "post"]
    for h in handles:
        h.remove()
    assert x._hook_counts() == (0, 0) and y._hook_counts() == (0, 0)
    assert _calls_during(lambda: y.sum().backward()) == 0
    assert calls == ["mid", "leaf", "post"]
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 6.0, 6.0])
    del leaf_hook, post_hook, mid_hook
    gc.collect()
    assert [r() for r in refs] == [None, None, None], "the C++ core still holds a removed hook"


def test_hook_handle_edge_cases():
    x = bt.ones(2, requires_grad=True)
    calls = []
    a = x.register_hook(lambda g: calls.append("a"))
    b = x.register_hook(lambda g: calls.append("b"))
    a.remove()
    a.remove()  # twice: harmless, and b stays
    assert x._hook_counts() == (1, 0)
    with x.register_post_accumulate_grad_hook(lambda t: calls.append("p")):
        x.sum().backward()
    assert calls == ["b", "p"] and x._hook_counts() == (1, 0)  # the with block removed p
    b.remove()
    # a handle that outlives its tensor (or its node) removes nothing and does not crash
    z = bt.ones(2, requires_grad=True)
    h1, h2 = z.register_hook(lambda g: g), (z * 2).register_hook(lambda g: g)
    del z
    gc.collect()
    h1.remove()
    h2.remove()
    with pytest.raises(TypeError, match=r"\[register_hook\] hook must be callable, got int"):
        x.register_hook(3)  # type: ignore[arg-type]


class _Token:
    """Something a hook's closure holds: a weak reference to it tells when the closure is freed."""


def _leaf_cycle(kind):
    """A tensor whose hook refers to the tensor, dropped by the caller: a reference cycle through
    the C++ core (Note [hooks and the cycle collector]). Returns a weak reference to a token the
    hook holds."""
    tok = _Token()
    x = bt.ones(3, requires_grad=True)
    if kind == "leaf":
        x.register_hook(lambda g: g * x.detach() if tok else g)
    elif kind == "post":
        x.register_post_accumulate_grad_hook(lambda t: (x, tok))
    elif kind == "nonleaf":
        y = x * 2.0
        y.register_hook(lambda g: g + 0.0 * y.detach() if tok else g)
    elif kind == "parameter":
        p = bt.nn.Parameter(bt.ones(3))
        p.register_hook(lambda g: g * p.detach() if tok else g)
    elif kind == "module":  # module -> parameter -> hook -> module
        lin = bt.nn.Linear(3, 2)
        lin.weight.register_hook(lambda g: g if lin.training and tok else g)
    return weakref.ref(tok)


@pytest.mark.parametrize("kind", ["leaf", "post", "nonleaf", "parameter", "module"])
def test_a_hook_that_refers_to_its_own_tensor_is_collected(kind):
    """Note [hooks and the cycle collector]: Tensor's tp_traverse reports the Python hooks it owns,
    so gc.collect() frees tensor -> hook -> tensor (it waited for remove() before)."""
    gc.collect()
    gc.disable()  # the cycle must be alive until the explicit collect below
    try:
        ref = _leaf_cycle(kind)
        assert ref() is not None, "not a cycle: freed without the collector"
    finally:
        gc.enable()
    gc.collect()
    assert ref() is None, f"the {kind} hook's cycle survived gc.collect()"


def test_the_collector_sees_a_tensors_hooks():
    x = bt.ones(2, requires_grad=True)

    def hook(g):
        return g

    def post(t):
        pass

    x.register_hook(hook)
    x.register_post_accumulate_grad_hook(post)
    assert hook in gc.get_referents(x) and post in gc.get_referents(x)
    assert gc.is_tracked(x)


def test_a_tensor_held_elsewhere_keeps_its_hooks_through_a_collection():
    """Only a Python object that holds the sole reference to its tensor reports (and on collection
    drops) the tensor's hooks. Here the autograd graph of a live output holds the leaf: its
    wrapper is in a garbage cycle with its hook, yet the hook must still run in that backward."""
    calls = []

    def output_of_a_hooked_leaf():
        x, tok = bt.ones(3, requires_grad=True), _Token()
        x.register_hook(lambda g: calls.append((x.shape, tok)) or g * 10.0)
        return (x * 2.0).sum(), weakref.ref(tok)

    y, ref = output_of_a_hooked_leaf()
    gc.collect()
    y.backward()
    assert len(calls) == 1, "the collector dropped the hook of a tensor the graph still holds"
    # once the graph is gone the leaf's wrapper owns the leaf, and the cycle is collected
    calls.clear()
    del y
    gc.collect()
    assert ref() is None


def test_a_live_tensor_keeps_its_hooks_through_a_collection():
    x = bt.ones(3, requires_grad=True)
    keep = [x]
    seen = []
    x.register_hook(lambda g: seen.append(keep[0].shape) or g * 2.0)
    x.register_post_accumulate_grad_hook(lambda t: seen.append("post"))
    y = x * 3.0
    y.register_hook(lambda g: seen.append(y.shape) or g)
    gc.collect()
    y.sum().backward()
    assert seen == [(3,), (3,), "post"]
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 6.0, 6.0])
    assert x._hook_counts() == (1, 1) and y._hook_counts() == (1, 0)


def test_a_hook_may_remove_itself_while_backward_runs():
    x = bt.ones(2, requires_grad=True)
    calls = []
    handles = {}

    def once(g):
        calls.append("once")
        handles["once"].remove()

    handles["once"] = x.register_hook(once)
    x.register_hook(lambda g: calls.append("after"))  # still runs in the same backward
    for _ in range(2):
        (x * 2).sum().backward()
    assert calls == ["once", "after", "after"]
    assert x._hook_counts() == (1, 0)


def test_leaf_keeps_a_gradient_reached_through_views_without_a_copy():
    # The gradient of z = x.reshape(6, 4) is a fresh tensor; the reshape's backward hands the leaf
    # a view of it that nothing else holds: .grad keeps that memory instead of a copy.
    x = bt.randn(2, 3, 4).requires_grad_(True)
    w = bt.randn(6, 4)
    z = x.reshape(6, 4)
    seen = []
    z.register_hook(lambda g: seen.append(g.data_ptr()))
    (z * w).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), w.numpy().reshape(2, 3, 4), rtol=0, atol=0)
    assert x.grad.data_ptr() == seen[0]


def test_leaf_never_aliases_a_user_gradient_passed_through_views():
    x = bt.randn(2, 3, 4).requires_grad_(True)
    g = bt.ones(6, 4)
    x.reshape(6, 4).backward(g)
    assert x.grad.data_ptr() != g.data_ptr()
    g.mul_(5.0)
    np.testing.assert_array_equal(x.grad.numpy(), np.ones((2, 3, 4), np.float32))


def test_nodes_release_saved_state_as_backward_goes():
    # Without retain_graph a node frees what it saved right after it runs (so backward's memory
    # falls as it walks back), not at the end of backward: by the time an earlier op's hook
    # runs, a later custom Function's context is gone.
    import gc
    import weakref

    class Ctx:
        pass

    refs = []

    class Keep(bt.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.payload = Ctx()
            refs.append(weakref.ref(ctx.payload))
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    x = bt.ones(3, requires_grad=True)
    a = x * 3.0
    alive_in_hook = []
    a.register_hook(lambda g: alive_in_hook.append(gc.collect() >= 0 and refs[0]() is not None))
    Keep.apply(a).sum().backward()
    assert alive_in_hook == [False]
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 6.0, 6.0])
    # with retain_graph it stays (the node may run again)
    refs.clear()
    alive_in_hook.clear()
    b = x * 3.0
    b.register_hook(lambda g: alive_in_hook.append(refs[0]() is not None))
    y = Keep.apply(b).sum()
    y.backward(retain_graph=True)
    assert alive_in_hook == [True]
