"""View semantics: views share storage and version; geometry matches numpy's."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt


def arr(shape):
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape)


def t_of(a):
    return bt.tensor(a, dtype=bt.float64)


@pytest.mark.parametrize(
    "index",
    [
        (1,),
        (slice(None), 2),
        (slice(1, None, 2),),
        (Ellipsis, 1),
        (None, 0),
        (-1, slice(None, -1)),
        (slice(None), None, slice(0, 3, 2)),
        (0, 1, 2),
        (slice(5, 1),),
        (slice(-100, 100, 3),),
        (1, Ellipsis, None),
    ],
)
def test_getitem_matches_numpy_and_shares_storage(index):
    a = arr((4, 5, 6))
    t = t_of(a)
    v = t[index]
    np.testing.assert_array_equal(v.numpy(), a[index])
    assert v._shares_storage(t)


def test_views_share_memory_and_writes_show_through():
    t = t_of(arr((3, 4)))
    v = t.T[1:, ::2]
    v.fill_(-1)
    ref = arr((3, 4))
    ref.T[1:, ::2] = -1
    np.testing.assert_array_equal(t.numpy(), ref)
    t[0] = 7.0
    ref[0] = 7.0
    np.testing.assert_array_equal(t.numpy(), ref)
    t[:, 1] = t_of(np.array([1.0, 2.0, 3.0]))
    ref[:, 1] = [1, 2, 3]
    np.testing.assert_array_equal(t.numpy(), ref)


def test_version_counter_is_shared_by_views():
    t = bt.zeros(4)
    v = t[1:3]
    before = t._version
    v.add_(1)
    assert t._version == before + 1 == v._version


def test_reshape_view_vs_copy():
    t = t_of(arr((4, 6)))
    r = t.reshape(2, 12)
    assert r._shares_storage(t) and r.is_contiguous()
    tt = t.T
    assert not tt.is_contiguous()
    r2 = tt.reshape(24)  # needs a copy
    assert not r2._shares_storage(t)
    np.testing.assert_array_equal(r2.numpy(), arr((4, 6)).T.reshape(24))
    with pytest.raises(RuntimeError, match=r"\[view\].*use reshape"):
        tt.view(24)
    # splitting a dim of a transposed tensor is still a view
    v = tt.view(3, 2, 4)
    assert v._shares_storage(t)
    np.testing.assert_array_equal(v.numpy(), arr((4, 6)).T.reshape(3, 2, 4))
    assert t.reshape(-1, 3).shape == (8, 3)
    with pytest.raises(ValueError, match=r"\[reshape\] shape \(5, -1\) is invalid"):
        t.reshape(5, -1)


def test_permute_transpose_expand():
    a = arr((2, 3, 4))
    t = t_of(a)
    np.testing.assert_array_equal(t.permute(2, 0, 1).numpy(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(t.transpose(0, 2).numpy(), a.swapaxes(0, 2))
    e = t_of(arr((3, 1))).expand(2, 3, 4)
    assert e.stride() == (0, 1, 0)
    np.testing.assert_array_equal(e.numpy(), np.broadcast_to(arr((3, 1)), (2, 3, 4)))
    assert t_of(arr((3, 1))).expand(-1, 5).shape == (3, 5)
    with pytest.raises(ValueError, match=r"\[expand\]"):
        t.expand(5, 3, 4)


def test_narrow_split_chunk_squeeze():
    a = arr((6, 5))
    t = t_of(a)
    np.testing.assert_array_equal(t.narrow(1, 1, 3).numpy(), a[:, 1:4])
    parts = t.split(4)
    assert [p.shape for p in parts] == [(4, 5), (2, 5)]
    parts = t.split([1, 2, 2], 1)
    np.testing.assert_array_equal(parts[2].numpy(), a[:, 3:])
    assert [c.shape[0] for c in t.chunk(4)] == [2, 2, 2]
    u = t.unsqueeze(0).unsqueeze(-1)
    assert u.shape == (1, 6, 5, 1)
    assert u.squeeze().shape == (6, 5)
    assert u.squeeze(0).shape == (6, 5, 1)
    assert t.squeeze(0).shape == (6, 5)
    assert t.flatten().shape == (30,)
    assert all(p._shares_storage(t) for p in t.chunk(3))


def test_contiguous_copies_only_when_needed():
    t = t_of(arr((3, 4)))
    assert t.contiguous()._is_same(t)
    c = t.T.contiguous()
    assert c.is_contiguous() and not c._shares_storage(t)
    np.testing.assert_array_equal(c.numpy(), arr((3, 4)).T)


def test_broadcasting_semantics(rng):
    a = rng.standard_normal((5, 1, 4))
    b = rng.standard_normal((3, 1))
    r = t_of(a) * t_of(b)
    assert r.shape == (5, 3, 4)
    np.testing.assert_allclose(r.numpy(), a * b)
    with pytest.raises(ValueError, match=r"\[add\] shapes \(2, 3\) and \(4,\) cannot be broadcast"):
        bt.ones(2, 3) + bt.ones(4)


def test_advanced_index_and_mask():
    a = arr((4, 3))
    t = t_of(a)
    np.testing.assert_array_equal(t[[0, 2, 2]].numpy(), a[[0, 2, 2]])
    np.testing.assert_array_equal(t[:, [2, 0]].numpy(), a[:, [2, 0]])
    m = a > 4
    np.testing.assert_array_equal(t[bt.tensor(m)].numpy(), a[m])
    np.testing.assert_array_equal(t[t > 4].numpy(), a[m])


@pytest.mark.parametrize(
    "index",
    [
        lambda i, j: (i, j),  # adjacent: the broadcast shape replaces the indexed dims
        lambda i, j: (slice(None), i, j),
        lambda i, j: (i, slice(None), j),  # separated by a slice: the broadcast dims go first
        lambda i, j: (i[:, None], j[None, :]),  # broadcast to an outer product
        lambda i, j: (1, slice(1, None), j),  # an int with a tensor index is a 0-d index
        lambda i, j: (Ellipsis, i, 2),
        lambda i, j: (None, i, j, slice(0, 3)),
        lambda i, j: (-1, j),
    ],
)
def test_several_tensor_indices_match_numpy(rng, index):
    a = rng.standard_normal((4, 5, 6))
    i = rng.integers(-4, 4, 3)
    j = rng.integers(0, 5, 3)
    ix = index(i, j)
    as_bt = tuple(bt.tensor(k) if isinstance(k, np.ndarray) else k for k in ix)
    np.testing.assert_array_equal(t_of(a)[as_bt].numpy(), a[ix])
    as_lists = tuple(k.tolist() if isinstance(k, np.ndarray) and k.ndim == 1 else k for k in ix)
    np.testing.assert_array_equal(t_of(a)[as_bt].numpy(), t_of(a)[as_lists].numpy())


def test_several_tensor_indices_gradient_and_setitem(rng):
    a = rng.standard_normal((4, 5))
    i, j = np.array([0, 3, 3, -1]), np.array([1, 4, 4, 0])
    t = bt.tensor(a, requires_grad=True)
    g = rng.standard_normal(4)
    t[bt.tensor(i), bt.tensor(j)].backward(bt.tensor(g))
    want = np.zeros_like(a)
    np.add.at(want, (i, j), g)  # repeated positions accumulate
    np.testing.assert_allclose(t.grad.numpy(), want)
    u = t_of(a)
    u[bt.tensor(i[:2]), bt.tensor(j[:2])] = 7.0
    b = a.copy()
    b[i[:2], j[:2]] = 7.0
    np.testing.assert_array_equal(u.numpy(), b)


def test_several_tensor_indices_errors():
    t = bt.ones(3, 4)
    with pytest.raises(
        IndexError, match=r"^\[getitem\] index 4 is out of range for dim 1 of size 4"
    ):
        t[bt.tensor([0, 1]), bt.tensor([1, 4])]
    with pytest.raises(IndexError, match=r"^\[getitem\] index -4 is out of range for dim 0"):
        t[bt.tensor([-4]), bt.tensor([0])]
    with pytest.raises(ValueError, match=r"^\[getitem\] shapes"):
        t[bt.tensor([0, 1]), bt.tensor([0, 1, 2])]
    with pytest.raises(IndexError, match=r"must be integer"):
        t[bt.tensor([0.0]), bt.tensor([1])]


def test_zero_size_and_scalars():
    z = bt.zeros(0, 3)
    assert z.numel() == 0 and z.sum().item() == 0
    assert (z + 1).shape == (0, 3)
    s = bt.tensor(3.5)
    assert s.shape == () and s.item() == 3.5 and float(s) == 3.5
    assert (s * bt.ones(2)).shape == (2,)
    assert bt.ones(3, 0).sum(1).shape == (3,)


def test_broadcasting_property():
    """Random broadcastable shapes and layouts: every binary op equals numpy's."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    dims = st.lists(st.integers(1, 4), min_size=0, max_size=4)

    @settings(max_examples=60, deadline=None)
    @given(dims, st.data())
    def check(shape, data):
        # b's shape: a suffix of a's with some dims set to 1 (always broadcastable)
        k = data.draw(st.integers(0, len(shape)))
        bshape = [1 if data.draw(st.booleans()) else d for d in shape[len(shape) - k :]]
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        a = rng.standard_normal(shape)
        b = rng.standard_normal(bshape) + 3
        ta, tb = t_of(a), t_of(b)
        if len(shape) >= 2 and data.draw(st.booleans()):  # a transposed layout
            a = np.ascontiguousarray(a.swapaxes(0, 1)).swapaxes(0, 1)
            ta = t_of(a.swapaxes(0, 1)).transpose(0, 1)
        for op in ("__add__", "__sub__", "__mul__", "__truediv__"):
            np.testing.assert_allclose(getattr(ta, op)(tb).numpy(), getattr(a, op)(b), rtol=1e-12)
        np.testing.assert_array_equal((ta < tb).numpy(), a < b)

    check()


def test_setitem_advanced_and_mask():
    a = arr((4, 3))
    t = t_of(a)
    ptr = t.data_ptr()
    t[[0, 2]] = 5.0
    a[[0, 2]] = 5.0
    t[t > 9] = -1.0
    a[a > 9] = -1.0
    t[:, bt.tensor([2])] = t_of(np.array([[7.0], [8.0], [9.0], [10.0]]))
    a[:, [2]] = [[7.0], [8.0], [9.0], [10.0]]
    np.testing.assert_array_equal(t.numpy(), a)
    assert t.data_ptr() == ptr  # still in place


def test_setitem_under_autograd_matches_torch(rng, torch_ref):
    t = torch_ref
    xa, ya = rng.standard_normal((3, 4)), rng.standard_normal(2)
    w = rng.standard_normal((3, 4))

    def run(lib, x, y):
        z = x * 1
        z[1:, 0] = y
        z[0] = 7.0
        z[:, 3] = z[:, 2] * 2
        return (z * lib.tensor(w)).sum()

    bx = bt.tensor(xa, requires_grad=True)
    by = bt.tensor(ya, requires_grad=True)
    tx = t.tensor(xa, requires_grad=True)
    ty = t.tensor(ya, requires_grad=True)
    lb, lt = run(bt, bx, by), run(t, tx, ty)
    assert lb.item() == pytest.approx(lt.item(), rel=1e-12)
    lb.backward()
    lt.backward()
    np.testing.assert_allclose(bx.grad.numpy(), tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(by.grad.numpy(), ty.grad.numpy(), rtol=1e-12)
    with pytest.raises(RuntimeError, match=r"\[setitem\] a leaf tensor that requires grad"):
        bx[0] = 1.0


def test_setitem_in_capture_renames_self():
    x = bt.ones(2, 3)
    with bt.capture() as g:
        y = x * 2
        y[0] = 5.0
        z = y + 1
    ops = [n["op"] for n in g.nodes]
    assert "copy_" in ops and ops[-1] == "add"
    copy = g.nodes[ops.index("copy_")]
    assert g.nodes[-1]["inputs"][0] == copy["outputs"][0]
    assert z.is_symbolic


def test_index_method_forms_match_the_functions_and_numpy(rng):
    a = rng.standard_normal((4, 5))
    x = bt.tensor(a, dtype=bt.float64)
    idx = rng.integers(0, 4, size=6)
    gidx = rng.integers(0, 5, size=(4, 3))
    src = rng.standard_normal((6, 5))
    np.testing.assert_array_equal(x.index_select(0, bt.tensor(idx)).numpy(), a[idx])
    np.testing.assert_array_equal(
        x.gather(1, bt.tensor(gidx)).numpy(), np.take_along_axis(a, gidx, 1)
    )
    want = a.copy()
    np.add.at(want, idx, src)
    np.testing.assert_allclose(
        x.index_add(0, bt.tensor(idx), bt.tensor(src, dtype=bt.float64)).numpy(), want, rtol=1e-12
    )
    sidx = rng.integers(0, 4, size=(3, 5))
    ssrc = rng.standard_normal((3, 5))
    want = a.copy()
    for i in range(3):
        for j in range(5):
            want[sidx[i, j], j] += ssrc[i, j]
    got = x.scatter_add(0, bt.tensor(sidx), bt.tensor(ssrc, dtype=bt.float64)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_array_equal(a, x.numpy())  # the out-of-place forms leave self alone


def test_index_add_in_place_and_its_gradient(rng):
    a = rng.standard_normal((4, 3))
    idx = bt.tensor([0, 2, 0])
    w = bt.tensor(a, dtype=bt.float64).requires_grad_(True)
    s = bt.tensor(rng.standard_normal((3, 3)), dtype=bt.float64).requires_grad_(True)
    h = w * 2.0
    r = h.index_add_(0, idx, s)
    assert r.data_ptr() == h.data_ptr()  # self, changed in place
    (h * h).sum().backward()
    ref = 2 * a
    np.add.at(ref, [0, 2, 0], s.detach().numpy())
    np.testing.assert_allclose(w.grad.numpy(), 2 * 2 * ref, rtol=1e-12)  # d(h^2)/dw = 2h * 2
    np.testing.assert_allclose(s.grad.numpy(), 2 * ref[[0, 2, 0]], rtol=1e-12)


def test_in_place_methods_return_self():
    from blutrain.tensor import nn

    x = bt.ones(3)
    for r in (x.add_(1), x.mul_(2), x.zero_(), x.fill_(2.0), x.exp_(), x.requires_grad_(False)):
        assert r is x
    y = x
    y += 1  # __iadd__ keeps the object: y is still x
    assert y is x and x.tolist() == y.tolist()

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(bt.ones(2)).requires_grad_(False)  # still a Parameter

    m = Frozen()
    assert type(m.w) is nn.Parameter and not m.w.requires_grad
    assert [name for name, _ in m.named_parameters()] == ["w"]
