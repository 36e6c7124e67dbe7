"""The reproducers of issue 37 (blutrain.tensor under hostile input), one regression test each.

Calls that crashed or hung the interpreter run in a child process (a crash must fail the test, not
end the run).  The property suite that keeps this class of bug out is test_tensor_fuzz.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import blutrain.tensor as bt


def isolated(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (bt, np imported); returns the finished process."""
    src = "import numpy as np\nimport blutrain.tensor as bt\n" + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=timeout
    )


def assert_raises_in_child(code: str, exc: str, prefix: str, timeout: float = 60) -> None:
    """code raises exc with a message starting with prefix, in a child that exits normally."""
    p = isolated(
        f"""
        try:
{textwrap.indent(textwrap.dedent(code), " " * 12)}
        except {exc} as e:
            print("RAISED", str(e))
        else:
            print("NO ERROR")
        """,
        timeout,
    )
    assert p.returncode == 0, f"child died with {p.returncode}: {p.stderr[-2000:]}"
    assert f"RAISED {prefix}" in p.stdout, p.stdout + p.stderr


# ---- crashes -----------------------------------------------------------------------------------
def test_backward_of_none_raises():
    assert_raises_in_child("bt.backward([None])", "TypeError", "[backward] tensors[0] is None")
    assert_raises_in_child(
        "t = bt.ones(2, requires_grad=True)\nbt.backward([t.sum(), None])",
        "TypeError",
        "[backward] tensors[1] is None",
    )


def test_backward_checks_its_gradients():
    t = bt.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"^\[backward\] got 2 gradients for 1 tensors"):
        bt.backward([t.sum()], [bt.ones(()), bt.ones(())])
    with pytest.raises(TypeError, match=r"^\[backward\] gradient must be floating"):
        t.sum().backward(bt.tensor(1))
    (t * 2).sum().backward(bt.tensor(1.0, dtype=bt.float64))  # cast to the output's dtype
    assert t.grad.tolist() == [2.0, 2.0]


def test_randint_full_int64_range_raises():
    assert_raises_in_child("bt.randint(-2**63, 2**63 - 1, (3,))", "ValueError", "[randint]")


def test_inplace_on_read_only_memmap_raises(tmp_path):
    f = tmp_path / "x.bin"
    np.zeros(4, np.float32).tofile(f)
    assert_raises_in_child(
        f"""
        m = np.memmap({str(f)!r}, dtype=np.float32, mode="r")
        bt.from_numpy(m).add_(1)
        """,
        "ValueError",
        "[add_] the tensor is read-only",
    )


# ---- out-of-bounds reads in fused ops with side tensors ------------------------------------------
def test_linear_reads_a_strided_or_expanded_bias_as_strided():
    x, w = bt.ones(1, 1), bt.ones(3, 1)
    assert bt.linear(x, w, bt.arange(6.0)[::2]).tolist() == [[1.0, 3.0, 5.0]]
    assert bt.linear(x, w, bt.ones(1).expand(3)).tolist() == [[2.0, 2.0, 2.0]]
    b = bt.arange(6.0)[::2].requires_grad_()  # (a view: the gradient reaches the base's slots)
    base = bt.arange(6.0, requires_grad=True)
    bt.linear(x, w, base[::2]).sum().backward()
    assert base.grad.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    del b


@pytest.mark.parametrize("fn", ["linear_gelu", "qkv_attention"])
def test_fused_ops_read_strided_biases(rng, fn):
    x = bt.tensor(rng.standard_normal((2, 3, 8)))
    if fn == "linear_gelu":
        w = bt.tensor(rng.standard_normal((6, 8)))
        wide = bt.tensor(rng.standard_normal(12))
        got = bt.linear_gelu(x, w, wide[::2])
        want = bt.gelu(bt.linear(x, w, wide[::2].contiguous()), approximate="tanh")
    else:
        w = bt.tensor(rng.standard_normal((24, 8)))
        wide = bt.tensor(rng.standard_normal(48))
        got = bt.qkv_attention(x, w, wide[::2], 2)
        want = bt.qkv_attention(x, w, wide[::2].contiguous(), 2)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_linear_gelu_linear_and_add_layer_norm_read_strided_side_tensors(rng):
    x = bt.tensor(rng.standard_normal((4, 8)))
    w1, w2 = bt.tensor(rng.standard_normal((6, 8))), bt.tensor(rng.standard_normal((5, 6)))
    b1, b2 = bt.tensor(rng.standard_normal(12)), bt.tensor(rng.standard_normal(10))
    got = bt.linear_gelu_linear(x, w1, b1[::2], w2, b2[::2])
    want = bt.linear_gelu_linear(x, w1, b1[::2].contiguous(), w2, b2[::2].contiguous())
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    r = bt.tensor(rng.standard_normal((8, 4))).T  # a transposed residual
    wn, bn = bt.tensor(rng.standard_normal(16))[::2], bt.tensor(rng.standard_normal(16))[::2]
    s, y = bt.add_layer_norm(x, r, wn, bn)
    s2, y2 = bt.add_layer_norm(x, r.contiguous(), wn.contiguous(), bn.contiguous())
    np.testing.assert_allclose(s.numpy(), s2.numpy(), rtol=1e-6)
    np.testing.assert_allclose(y.numpy(), y2.numpy(), rtol=1e-5, atol=1e-6)


# ---- wrong results -------------------------------------------------------------------------------
def test_copy_from_an_overlapping_view():
    a = bt.arange(4.0).reshape(2, 2)
    a.copy_(a.T)
    assert a.tolist() == [[0.0, 2.0], [1.0, 3.0]]
    t = bt.arange(5)
    t[1:] = t[:-1]
    assert t.tolist() == [0, 0, 1, 2, 3]


def test_arange_of_large_ints_is_exact():
    assert bt.arange(2**53, 2**53 + 3).tolist() == [2**53, 2**53 + 1, 2**53 + 2]
    assert bt.arange(2**62, 2**62 + 5).tolist() == [2**62 + i for i in range(5)]
    assert bt.arange(2**63 - 3, 2**63 - 1).tolist() == [2**63 - 3, 2**63 - 2]
    assert bt.arange(-(2**63), -(2**63) + 2**62 * 3, 2**62).tolist() == [
        -(2**63),
        -(2**62),
        0,
    ]


def test_python_ints_above_2_53_stay_exact():
    big = 2**53 + 1
    assert bt.full((2,), big).tolist() == [big, big]
    t = bt.tensor([big, 2**53])
    assert (t == big).tolist() == [True, False]
    assert (t > 2**53).tolist() == [True, False]
    assert (t + big).tolist() == [2 * big, big + 2**53]
    assert bt.zeros(2, dtype=bt.int64).fill_(big).tolist() == [big, big]
    m = bt.tensor([True, False])
    assert bt.zeros(2, dtype=bt.int64).masked_fill(m, big).tolist() == [big, 0]
    assert bt.where(m, big, bt.zeros(2, dtype=bt.int64)).tolist() == [big, 0]
    assert bt.full((1,), 2**63 - 1).tolist() == [2**63 - 1]
    x = bt.zeros(1, dtype=bt.int64)
    x[0] = 2**62 + 1
    assert x.tolist() == [2**62 + 1]


def test_repr_of_large_int64_values_is_exact():
    assert repr(bt.tensor([2**60 + 1])) == "tensor([1152921504606846977])"
    assert repr(bt.tensor(-(2**63))) == "tensor(-9223372036854775808)"


def test_relu_keeps_nan():
    r = bt.relu(bt.tensor([float("nan"), -1.0, 2.0]))
    assert np.isnan(r[0].item()) and r[1:].tolist() == [0.0, 2.0]
    r = bt.tensor([float("nan")], dtype=bt.bfloat16).relu()
    assert np.isnan(r.float().item())


def test_summarised_repr_is_pytorchs():
    assert repr(bt.arange(3000.0)) == "tensor([   0.,    1.,    2.,  ..., 2997., 2998., 2999.])"
    r = repr(bt.zeros(1000, 1000, dtype=bt.int64))
    assert r.splitlines()[:2] == [
        "tensor([[0, 0, 0,  ..., 0, 0, 0],",
        "        [0, 0, 0,  ..., 0, 0, 0],",
    ]
    assert "        ...," in r.splitlines()


# ---- hang ----------------------------------------------------------------------------------------
def test_repr_of_a_huge_expanded_view_is_quick():
    p = isolated(
        "print(repr(bt.ones(1).expand(2**40)))\nprint(str(bt.ones(1, 1).expand(2**30, 2**30)))", 30
    )
    assert p.returncode == 0, p.stderr
    assert "tensor([1., 1., 1.,  ..., 1., 1., 1.])" in p.stdout


# ---- bad input silently accepted -----------------------------------------------------------------
def test_narrow_and_split_sizes_that_overflow_raise():
    with pytest.raises(IndexError, match=r"^\[narrow\]"):
        bt.ones(5).narrow(0, 2**62, 2**62)
    with pytest.raises(IndexError, match=r"^\[narrow\]"):
        bt.ones(5).narrow(0, 2, 2**63 - 1)
    with pytest.raises(ValueError, match=r"^\[split\]"):
        bt.ones(5).split([2**62, 2**62, 2**62, 2**62, 5])
    with pytest.raises(ValueError, match=r"^\[split\]"):
        bt.ones(5).split([2**63 - 1, 2**63 - 1, 3])


def test_randint_ranges_and_dtypes_are_checked():
    with pytest.raises(ValueError, match=r"^\[randint\].*2\^32"):
        bt.randint(0, 2**40, (3,))
    with pytest.raises(ValueError, match=r"^\[randint\].*does not fit uint8"):
        bt.randint(0, 300, (3,), dtype=bt.uint8)
    with pytest.raises(ValueError, match=r"^\[randint\].*does not fit int32"):
        bt.randint(2**31 - 2, 2**31 + 2, (3,), dtype=bt.int32)
    v = bt.randint(2**62, 2**62 + 3, (64,)).tolist()  # exact far above 2**53
    assert set(v) <= {2**62, 2**62 + 1, 2**62 + 2} and len(set(v)) == 3
    u = bt.randint(250, 256, (64,), dtype=bt.uint8).tolist()
    assert set(u) <= set(range(250, 256))


def test_arange_into_a_small_dtype_does_not_wrap():
    with pytest.raises(ValueError, match=r"^\[arange\].*does not fit uint8"):
        bt.arange(250, 260, dtype=bt.uint8)
    with pytest.raises(ValueError, match=r"^\[arange\].*does not fit int32"):
        bt.arange(2**31 - 2, 2**31 + 2, dtype=bt.int32)
    with pytest.raises(TypeError, match=r"^\[arange\] dtype bool"):
        bt.arange(0, 3, dtype=bt.bool)
    assert bt.arange(250, 256, dtype=bt.uint8).tolist() == list(range(250, 256))


@pytest.mark.parametrize(
    "call",
    [
        lambda: bt.ones(3, dtype=bt.int64).masked_fill(bt.ones(3, dtype=bt.bool), float("nan")),
        lambda: bt.ones(3, dtype=bt.int32).fill_(float("inf")),
        lambda: bt.ones(3, dtype=bt.uint8).fill_(256),
        lambda: bt.cross_entropy(bt.zeros(2, 3), bt.tensor([0, 1]), label_smoothing=float("nan")),
        lambda: bt.arange(0, 1, float("nan")),
        lambda: bt.arange(0, 1, float("inf")),
        lambda: bt.arange(0, float("inf")),
        lambda: bt.full((2,), float("nan"), dtype=bt.int64),
        lambda: bt.ones(2, dtype=bt.uint8) + 300,
    ],
)
def test_non_finite_or_unfitting_values_are_refused(call):
    with pytest.raises(ValueError, match=r"^\[(masked_fill|fill_|cross_entropy|arange|full|add)\]"):
        call()


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "flatten", "argmax", "argmin"])
def test_dims_of_a_0d_tensor(fn):
    x = bt.tensor(2.0)
    with pytest.raises(IndexError, match=rf"^\[{fn}\] dim 5 is out of range"):
        getattr(bt, fn)(x, 5)
    for d in (0, -1):  # PyTorch's: a 0-d tensor takes dim 0 and -1
        getattr(bt, fn)(x, d)


def test_a_bool_mask_must_match_the_leading_dims():
    x = bt.randn(2, 3)
    with pytest.raises(IndexError, match=r"^\[getitem\] the mask of shape \(3,\)"):
        x[bt.ones(3, dtype=bt.bool)]
    assert x[bt.tensor([True, False])].shape == (1, 3)  # a mask over dim 0 picks rows
    assert x[bt.tensor([[True, False, True], [False, False, True]])].shape == (3,)
    assert x[bt.tensor(True)].shape == (1, 2, 3)
    assert x[[True, False]].shape == (1, 3)


def test_writes_through_read_only_buffers_raise():
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    for t in (bt.as_tensor(a), bt.from_numpy(a)):
        with pytest.raises(ValueError, match=r"^\[add_\] the tensor is read-only"):
            t.add_(1)
        with pytest.raises(ValueError, match=r"^\[setitem\] the tensor is read-only"):
            t[0] = 1
        with pytest.raises(ValueError, match=r"^\[copy_\] the tensor is read-only"):
            t.copy_(bt.ones(3))
        assert not t.numpy().flags.writeable
        assert not np.asarray(t).flags.writeable
        assert (t + 1).tolist() == [1.0, 1.0, 1.0]  # reading is fine
    b = bt.from_dlpack(b"abcd")
    assert b.tolist() == [97, 98, 99, 100]
    with pytest.raises(ValueError, match=r"^\[zero_\] the tensor is read-only"):
        b.zero_()
    with pytest.raises(BufferError, match=r"read-only"):
        b.__dlpack__()
    leaf = bt.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"^\[grad\] the tensor is read-only"):
        leaf.grad = bt.from_numpy(a)
    assert a.tolist() == [0.0, 0.0, 0.0]
    w = bt.from_dlpack(bytearray(b"ab"))  # a writable buffer stays writable
    w.add_(1)
    assert w.tolist() == [98, 99]


# ---- valid input rejected ------------------------------------------------------------------------
def test_none_alone_is_an_index():
    t = bt.ones(3)
    assert t[None].shape == (1, 3)
    assert t[None, None].shape == (1, 1, 3)
    t[None] = 2.0
    assert t.tolist() == [2.0, 2.0, 2.0]


def test_huge_expanded_views_are_indexed_and_multiplied_without_a_copy():
    p = isolated(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a copy would need 4 TB
        x = bt.arange(3.0).reshape(3, 1).expand(3, 2**40)
        print(x[bt.tensor([2, 0]), 2**39].tolist(), x[bt.tensor([1]), bt.tensor([7, 9])].tolist())
        print(bt.ones(1).expand(2**40)[bt.tensor([5, 2**40 - 1])].tolist())
        print(x.gather(1, bt.tensor([[2**40 - 1], [0], [7]])).tolist())
        v = bt.ones(1).expand(2**40)
        print((v @ v).item(), (x @ bt.ones(1).expand(2**40)).tolist())
        print(x[2, 2**40 - 1].item(), x[:, 5:7].tolist())
        """,
        120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[:5] == [
        "[2.0, 0.0] [1.0, 1.0]",
        "[1.0, 1.0]",
        "[[0.0], [1.0], [2.0]]",
        f"{float(2**40)} [0.0, {float(2**40)}, {float(2**41)}]",
        "2.0 [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]",
    ]


# ---- messages ------------------------------------------------------------------------------------
def test_binding_errors_name_the_op_and_the_argument():
    t = bt.ones(3)
    with pytest.raises(TypeError, match=r"^\[transpose\] argument 'dim0' must be int, got 'a'"):
        t.transpose("a", 1)
    with pytest.raises(TypeError, match=r"^\[linear\] takes at most 3 positional arguments"):
        bt.linear(t, t, t, t)
    with pytest.raises(TypeError, match=r"^\[softmax\] got an unexpected keyword argument 'axis'"):
        bt.softmax(t, axis=0)
    with pytest.raises(TypeError, match=r"^\[layer_norm\] missing required argument"):
        bt.layer_norm(t)
    with pytest.raises(TypeError, match=r"^\[narrow\] argument 'start' = 1180591620717411303424 "):
        t.narrow(0, 2**70, 1)
    with pytest.raises(TypeError, match=r"^\[index_select\] argument 'index' must be Tensor"):
        bt.index_select(t, 0, [0, 1])
    with pytest.raises(TypeError, match=r"^\[sum\] self must be a Tensor, got 3"):
        bt.Tensor.sum(3)
    assert bt.dropout(t, 0, False).tolist() == [1.0, 1.0, 1.0]  # (an int for a float: valid)


def test_bad_casts_are_named_errors():
    with pytest.raises(TypeError, match=r"^\[from_dlpack\] cannot import a int"):
        bt.from_dlpack(3)
    with pytest.raises(TypeError, match=r"^\[add\]"):
        bt.ones(2) + np.array(["a", "b"])
    with pytest.raises(TypeError, match=r"^\[from_numpy\]"):
        bt.from_numpy(np.array(["a"]))


def test_embedding_errors_name_embedding_and_negative_indices_raise():
    w = bt.ones(3, 2)
    with pytest.raises(IndexError, match=r"^\[embedding\] index 5 is out of range"):
        bt.embedding(bt.tensor([5]), w)
    with pytest.raises(IndexError, match=r"^\[embedding\] index -1 is out of range"):
        bt.embedding(bt.tensor([-1]), w)
    assert bt.index_select(w, 0, bt.tensor([-1])).shape == (1, 2)  # index_select counts back


def test_pytorch_errors_we_keep():
    with pytest.raises(TypeError, match=r"^\[logical_and\] & needs bool operands"):
        bt.tensor([1, 2]) & bt.tensor([3, 4])
    with pytest.raises(TypeError, match=r"^\[logical_or\]"):
        bt.tensor([True]) | bt.tensor([1])
    assert (bt.tensor([True, False]) & True).tolist() == [True, False]
    assert bt.tensor([1, 0]).logical_and(bt.tensor([2, 2])).tolist() == [True, False]
    with pytest.raises(TypeError, match=r"^\[softmax\] expects a floating input, got int64"):
        bt.softmax(bt.tensor([1, 2]), 0)
    with pytest.raises(TypeError, match=r"^\[log_softmax\]"):
        bt.tensor([1, 2]).log_softmax(0)


def test_scatter_add_into_an_empty_dim_raises():
    with pytest.raises(IndexError, match=r"^\[scatter_add\] index is out of range for a dim of "):
        bt.zeros(0).scatter_add(0, bt.tensor([3, 1]), bt.ones(2))
    bt.zeros(0).scatter_add(0, bt.tensor([], dtype=bt.int64), bt.ones(0))  # no index: fine


def test_uint8_index_tensors_are_refused():
    """CPU fuzz run (seed 1006, case 5200): x[empty uint8 tensor] was accepted as indices, where
    PyTorch reads a uint8 index as a (deprecated) boolean mask; refused, saying what to use."""
    x = bt.arange(6.0).reshape(3, 2)
    for ix in (bt.tensor([1, 0], dtype=bt.uint8), bt.zeros(5, 0, dtype=bt.uint8)):
        with pytest.raises(
            IndexError, match=r"^\[getitem\] .*must be integer .*got uint8; use \.bool\(\)"
        ):
            x[ix]
    with pytest.raises(IndexError, match=r"^\[setitem\] .*got uint8"):
        x[bt.tensor([1], dtype=bt.uint8)] = 7.0
    assert x[bt.tensor([1, 0], dtype=bt.int32)].tolist() == [[2.0, 3.0], [0.0, 1.0]]
    assert x[bt.tensor([True, False, True])].tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert x.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_reshape_refuses_a_shape_entry_that_is_a_tuple():
    """CPU fuzz run (seed 2002, case 238): bt.reshape(t, ((2,),)) was read as the shape (2,)
    (the tuple unpacked into Tensor.reshape's one-tuple spelling); PyTorch refuses it."""
    t = bt.ones(1, 2, 1)
    for bad in (((2,),), [(2,)]):
        with pytest.raises(TypeError, match=r"^\[reshape\] shape entries must be ints, got \(2,\)"):
            bt.reshape(t, bad)
    assert bt.reshape(t, (2,)).shape == (2,) and bt.reshape(t, [1, -1]).shape == (1, 2)
    assert t.reshape((2,)).shape == (2,) and t.reshape(2, 1).shape == (2, 1)


def test_dlpack_names_an_unknown_keyword_even_on_a_read_only_tensor():
    """CPU fuzz run (seed 20002, case 2393): __dlpack__ ignored every keyword, so a read-only
    tensor's refusal answered `__dlpack__(bogus_kw=1)` without naming bogus_kw (and a writable one
    accepted it silently); the protocol's keywords still work."""
    a = np.arange(4, dtype=np.uint8)
    a.flags.writeable = False
    ro, rw = bt.from_numpy(a), bt.arange(4)
    for t in (ro, rw):
        with pytest.raises(TypeError, match=r"^\[dlpack\] unexpected keyword argument 'bogus_kw'"):
            t.__dlpack__(bogus_kw=1)
    with pytest.raises(BufferError, match=r"^\[dlpack\] the tensor is read-only"):
        ro.__dlpack__(max_version=(1, 0))
    rw.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=None)
    assert np.from_dlpack(rw).tolist() == [0, 1, 2, 3]


def test_setitem_with_a_repeated_index_keeps_the_value_exactly():
    """CPU fuzz run (seed 20015, case 5394): a position an index tensor names more than once gets
    its values' mean, which was summed in the tensor's dtype: int32 t[[0, 0, 0]] = 2**31 - 1 gave
    715827881 (the sum wrapped), and equal floats came back rounded.  Equal values now come back
    exactly, at the dtype's limits too; inf and NaN stay; the gradient is still 1 / count."""
    values = {
        bt.int32: [2**31 - 1, -(2**31), -7],
        bt.int64: [2**63 - 1, -(2**63), 3],
        bt.uint8: [255, 1],
        bt.float16: [65504.0, 0.1, float("inf")],
        bt.bfloat16: [3.0e38, 0.1, -float("inf")],
        bt.float32: [3.4e38, 0.1, 1 / 3],
        bt.float64: [1.7e308, 0.1, 1 / 3, -float("inf")],
    }
    for dt, vals in values.items():
        for val in vals:
            x = bt.tensor(val, dtype=dt)
            t = bt.zeros(3, dtype=dt)
            t[bt.tensor([0, 0, 0, 2, 2])] = x
            assert t.tolist() == [x.item(), 0, x.item()], (dt, val, t.tolist())
    t = bt.zeros(2)
    t[bt.tensor([1, 1])] = float("nan")
    assert np.isnan(t.tolist()[1]) and t.tolist()[0] == 0
    t = bt.zeros(2, dtype=bt.int32)
    t[bt.tensor([0, 0])] = bt.tensor([2**31 - 1, 2**31 - 3], dtype=bt.int32)
    assert t.tolist() == [2**31 - 2, 0]  # (different values: their mean, without wrapping)
    v = bt.tensor([1.0, 2.0, 3.0], dtype=bt.float64, requires_grad=True)
    c = bt.zeros(3, dtype=bt.float64, requires_grad=True) * 1
    c[bt.tensor([0, 0, 1])] = v
    (c * bt.tensor([1.0, 10.0, 100.0], dtype=bt.float64)).sum().backward()
    assert c.tolist() == [1.5, 3.0, 0.0] and v.grad.tolist() == [0.5, 0.5, 10.0]
