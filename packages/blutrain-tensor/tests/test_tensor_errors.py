"""Bad input gives a clear Python exception whose message starts with the op."""

from __future__ import annotations

import functools

import pytest
from tensor_testutil import needs_linalg

import blutrain.tensor as bt


@pytest.mark.parametrize(
    "fn,exc,pattern",
    [
        (lambda: bt.ones(2, 3) + bt.ones(4), ValueError, r"^\[add\] shapes \(2, 3\) and \(4,\)"),
        (
            lambda: bt.ones(2, 3).reshape(4, 2),
            ValueError,
            r"^\[reshape\] shape \(4, 2\) is invalid",
        ),
        (lambda: bt.ones(2, 3)[5], IndexError, r"^\[getitem\] index 5 is out of range for dim 0"),
        (lambda: bt.ones(2, 3)[0, 0, 0], IndexError, r"^\[getitem\] too many indices"),
        (lambda: bt.ones(2, 3)[::-1], ValueError, r"^\[getitem\] slice step must be positive"),
        (lambda: bt.ones(2, 3).sum(2), IndexError, r"^\[sum\] dim 2 is out of range"),
        (lambda: bt.ones(2, 3).transpose(0, 3), IndexError, r"^\[transpose\] dim 3"),
        (lambda: bt.ones(2).select(0, 2), IndexError, r"^\[select\] index 2 is out of range"),
        (lambda: bt.ones(4).narrow(0, 2, 3), IndexError, r"^\[narrow\]"),
        (
            lambda: bt.index_select(bt.ones(3, 2), 0, bt.tensor([0, 3])),
            IndexError,
            r"^\[index_select\] index 3 is out of range for dim 0 of size 3",
        ),
        (
            lambda: bt.index_select(bt.ones(3, 2), 0, bt.tensor([0.0])),
            TypeError,
            r"^\[index_select\] index must be int32 or int64, got float32",
        ),
        (
            lambda: bt.embedding(bt.tensor([7]), bt.ones(5, 2)),
            IndexError,
            r"^\[embedding\] index 7",  # (the op called, not its index_select)
        ),
        (lambda: bt.gather(bt.ones(3, 2), 1, bt.tensor([[2]])), IndexError, r"^\[gather\] index 2"),
        (
            lambda: bt.cross_entropy(bt.ones(3, 4), bt.tensor([0, 4, 1])),
            IndexError,
            r"^\[cross_entropy\] target 4 \(row 1\) is out of range for 4 classes",
        ),
        (
            lambda: bt.cross_entropy(bt.ones(3, 4), bt.tensor([0, 1])),
            ValueError,
            r"^\[cross_entropy\] target has shape \(2,\), expected \(3,\)",
        ),
        (
            lambda: bt.cross_entropy(bt.ones(3, 4), bt.tensor([0, 1, 2]), reduction="avg"),
            ValueError,
            r"^\[cross_entropy\] reduction must be",
        ),
        (
            lambda: bt.cat([bt.ones(2, 3), bt.ones(2, 4)]),
            ValueError,
            r"^\[cat\] tensor 1 has shape \(2, 4\)",
        ),
        (lambda: bt.cat([]), ValueError, r"^\[cat\] expected a non-empty list"),
        (lambda: bt.stack([bt.ones(2), bt.ones(3)]), ValueError, r"^\[stack\]"),
        (
            lambda: bt.where(bt.ones(2), bt.ones(2), bt.ones(2)),
            TypeError,
            r"^\[where\] condition must be bool, got float32",
        ),
        (
            lambda: bt.ones(2, 3).masked_fill(bt.ones(2, 3), 0.0),
            TypeError,
            r"^\[masked_fill\] mask",
        ),
        (
            lambda: bt.ones(2, 3).masked_fill(bt.ones(4, dtype=bt.bool), 0.0),
            ValueError,
            r"^\[masked_fill\]",
        ),
        (
            lambda: bt.layer_norm(bt.ones(2, 3), (4,)),
            ValueError,
            r"^\[layer_norm\] normalized_shape \(4,\) does not match",
        ),
        (lambda: bt.zeros(2, dtype="float8"), TypeError, r"^\[zeros\] unknown dtype 'float8'"),
        (lambda: bt.zeros(2, device="tpu"), ValueError, r"^\[zeros\] unknown device 'tpu'"),
        (lambda: bt.zeros(-1), ValueError, r"^\[zeros\] negative dimension"),
        (lambda: bt.ones(2, dtype=bt.bool) - bt.ones(2, dtype=bt.bool), TypeError, r"^\[sub\]"),
        (lambda: -bt.ones(2, dtype=bt.bool), TypeError, r"^\[neg\]"),
        (lambda: bt.ones(2) + "a", TypeError, r"^\[add\] unsupported operand 'a'"),
        (lambda: bt.dropout(bt.ones(2), 1.5), ValueError, r"^\[dropout\] p must be in \[0, 1\]"),
        (lambda: bt.randint(3, 3, (2,)), ValueError, r"^\[randint\] high"),
        (lambda: bt.ones(2, 2).permute(0, 0), ValueError, r"^\[permute\] dim 0 repeats"),
        (lambda: bt.ones(2, 3).view(-1, -1), ValueError, r"^\[view\] only one dimension can be -1"),
        (lambda: bool(bt.ones(2)), RuntimeError, r"^\[bool\] the truth value"),
        (lambda: bt.ones(2, 3).expand(3, 3), ValueError, r"^\[expand\]"),
        (lambda: bt.ones(3).split([1, 1]), ValueError, r"^\[split\] sizes sum to 2"),
    ],
)
def test_error_messages(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


@pytest.mark.parametrize(
    "fn,pattern",
    [
        (
            lambda: bt.ones(2, 3) @ bt.ones(4, 5),
            r"^\[matmul\] shapes \(2, 3\) and \(4, 5\) do not align on k \(3 vs 4\)",
        ),
        (
            lambda: bt.ones(2, 3, dtype=bt.int64) @ bt.ones(3, 2, dtype=bt.int64),
            r"^\[matmul\] expects floating",
        ),
        (
            lambda: bt.linear(bt.ones(2, 3), bt.ones(4, 5)),
            r"^\[linear\] input of shape \(2, 3\) has 3 features",
        ),
        (lambda: bt.bmm(bt.ones(2, 3), bt.ones(3, 2)), r"^\[bmm\] expects 3-D"),
        (lambda: bt.bmm(bt.ones(2, 2, 3), bt.ones(3, 3, 2)), r"^\[bmm\] batch sizes differ"),
    ],
)
def test_matmul_errors(fn, pattern):
    needs_linalg()
    with pytest.raises((ValueError, TypeError), match=pattern):
        fn()


@pytest.mark.skipif(bt.cuda_built(), reason="checks the CPU-only build")
@pytest.mark.parametrize(
    "fn,op",
    [
        (lambda: bt.zeros(2, device="cuda"), "zeros"),
        (lambda: bt.ones(2, device="cuda:1"), "ones"),
        (lambda: bt.randn(2, device="cuda"), "randn"),
        (lambda: bt.ones(2).cuda(), "to"),
        (lambda: bt.ones(2).to("cuda:0"), "to"),
        (lambda: bt.arange(3, device="cuda"), "arange"),
        (lambda: bt.tensor([1.0], device="cuda"), "tensor"),  # (the op called, not its to())
    ],
)
def test_cuda_in_cpu_only_build(fn, op):
    with pytest.raises(
        RuntimeError,
        match=rf"^\[{op}\] cannot use cuda:\d: blutrain-tensor was "
        r"built without CUDA",
    ):
        fn()


def test_cuda_kernels_are_stubs_in_cpu_only_build():
    # A symbolic (captured) CUDA tensor can exist without a GPU; it only fails when run.
    assert bt.cuda_device_count() == 0 or bt.cuda_built()
    with bt.capture() as g:
        x = bt.ones(2, 3, device="cuda")
        y = (x * 2).sum()
    assert y.device == "cuda:0" and y.is_symbolic
    assert [n["op"] for n in g.nodes] == ["full", "full", "expand", "mul", "sum"]


def test_symbolic_tensor_has_no_data():
    with bt.capture():
        y = bt.ones(1) * 3
    with pytest.raises(RuntimeError, match=r"^\[item\] tensor is symbolic"):
        y.item()
    with pytest.raises(RuntimeError, match=r"symbolic"):
        (y + 1).numpy()


def test_device_mismatch_is_named():
    with bt.capture():
        c = bt.ones(2, device="cuda")
        with pytest.raises(
            ValueError,
            match=r"^\[add\] expected all tensors on the same device, "
            r"got cpu and cuda:0",
        ):
            bt.ones(2) + c
        with pytest.raises(ValueError, match=r"^\[cat\] expected all tensors on the same device"):
            bt.cat([bt.ones(2), c])


@pytest.mark.skipif(
    not bt.cuda_built() or bt.cuda_device_count() > 0,
    reason="a CUDA build on a machine without GPU",
)
def test_cuda_build_without_gpu_raises():
    with pytest.raises(RuntimeError, match=r"^\[zeros\] cannot use cuda:0: no CUDA device"):
        bt.zeros(2, device="cuda")
    with pytest.raises(RuntimeError, match=r"^\[to\] cannot use cuda:0: no CUDA device"):
        bt.ones(2).cuda()


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="needs a CUDA device")
def test_gpu_transfers_and_stubs():
    """On a GPU: transfers round-trip, ops run there, and mixing devices names the op."""
    x = bt.arange(6.0).reshape(2, 3)
    g = x.cuda()
    assert g.device == "cuda:0" and g.shape == (2, 3)
    assert g.cpu().tolist() == x.tolist()
    assert (g + g).cpu().tolist() == (x + x).tolist()
    with pytest.raises((ValueError, RuntimeError), match=r"^\[add\]"):
        g + x


@pytest.mark.gpu
@pytest.mark.skipif(bt.cuda_device_count() == 0, reason="needs a CUDA device")
def test_cuda_error_is_cleared_once_raised(tmp_path):
    """A CUDA runtime error raised as an exception (here cudaGraphDebugDotPrint failing to open
    its file: not sticky, recorded as the thread's last error) is cleared, so the next op's launch
    check does not report it a second time."""
    x = bt.ones(1024, device="cuda")
    y = x + 1  # the kernel's first launch outside the capture
    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):
        y = x + 1
    g.replay()
    with pytest.raises(RuntimeError, match=r"^\[CUDAGraph\.debug_dump\] cudaGraphDebugDotPrint"):
        g.debug_dump(tmp_path / "no-such-dir" / "graph.dot")
    z = bt.ones(8, device="cuda") + 1  # a kernel launch and its launch check
    assert z.cpu().tolist() == [2.0] * 8
    assert y.cpu().tolist() == [2.0] * 1024


# ---- found by fuzzing random (mostly wrong) calls: each of these crashed or wrote out of bounds


def scalar() -> bt.Tensor:
    # made per test: a module-level tensor would stay allocated while other packages' tests run
    return bt.tensor(1.5)


@pytest.mark.parametrize(
    "fn,exc,pattern",
    [
        # a 0-d tensor has no dim 0 to index (these read shape()[0] of an empty shape)
        (lambda: scalar().size(0), IndexError, r"^\[size\] dim 0 does not exist: the tensor is 0"),
        (lambda: scalar().split(1), IndexError, r"^\[split\] dim 0 does not exist"),
        (lambda: scalar().split([1]), IndexError, r"^\[split\] dim 0 does not exist"),
        (lambda: scalar().chunk(2), IndexError, r"^\[chunk\] dim 0 does not exist"),
        (lambda: scalar().narrow(0, 0, 1), IndexError, r"^\[narrow\] dim 0 does not exist"),
        (
            lambda: bt.index_select(scalar(), 0, bt.tensor([0])),
            IndexError,
            r"^\[index_select\] dim 0 does not exist",
        ),
        (
            lambda: bt.gather(scalar(), 0, bt.tensor(0)),
            IndexError,
            r"^\[gather\] dim 0 does not exist",
        ),
        (lambda: bt.ones(3).transpose(5, 5), IndexError, r"^\[transpose\] dim 5 is out of range"),
        # scatter_add's index addresses the input outside dim at its own position
        (
            lambda: bt.scatter_add(bt.ones(4, 3), 0, bt.zeros(6, 5, dtype=bt.int64), bt.ones(6, 5)),
            ValueError,
            r"^\[scatter_add\] index shape \(6, 5\) is larger than input shape \(4, 3\) at dim 1",
        ),
        (
            lambda: bt.scatter_add(bt.ones(4, 3), 0, bt.zeros(2, dtype=bt.int64), bt.ones(2)),
            ValueError,
            r"^\[scatter_add\] index has 1 dims but the input has 2",
        ),
        # element counts past int64 (they wrapped to a small allocation)
        (lambda: bt.zeros(1 << 62, 4), ValueError, r"^\[zeros\] shape .* more elements than int64"),
        (lambda: bt.empty(1 << 40, 1 << 40), ValueError, r"^\[empty\] shape .* than int64"),
        (lambda: bt.randn(1 << 62, 8), ValueError, r"^\[randn\] shape .* than int64"),
        (lambda: bt.ones(0).reshape(1 << 62, 4, 0), ValueError, r"^\[reshape\] shape .* int64"),
        (lambda: bt.ones(1, 1).expand(1 << 62, 4), ValueError, r"^\[expand\] shape .* int64"),
        # int arguments: a TypeError naming the op (was nanobind's "std::bad_cast")
        (
            lambda: bt.ones(2, 3).reshape(bt.tensor([3, 2])),
            TypeError,
            r"^\[reshape\] shape entries must be ints",
        ),
        (lambda: bt.ones(2, 3).view(6.0), TypeError, r"^\[view\] shape entries must be ints"),
        (lambda: bt.ones(2, 3).reshape(1 << 70), TypeError, r"^\[reshape\] .*out of the int64"),
        (lambda: bt.ones(2, 3).sum(bt.ones(2)), TypeError, r"^\[sum\] dims must be ints"),
        (lambda: bt.ones(2, 3).amax((0, 1.0)), TypeError, r"^\[amax\] dims must be ints"),
        (lambda: bt.ones(2, 3).split([bt.ones(2)]), TypeError, r"^\[split\] dims must be ints"),
    ],
)
def test_fuzz_found_errors(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_int_like_arguments_are_accepted():
    np = pytest.importorskip("numpy")
    x = bt.arange(6)
    assert x.reshape(np.int64(2), np.int32(3)).shape == (2, 3)
    assert x.reshape(bt.tensor(6)).shape == (6,)  # a one-element integer tensor has __index__
    assert x.reshape(2, 3).sum(np.int64(1)).shape == (2,)
    assert scalar().transpose(0, -1).shape == ()
    assert scalar().sum(0).item() == 1.5  # reducing "over" a scalar's dim 0 stays allowed


@pytest.mark.parametrize("value,truth", [(1.5, True), (0.0, False), (-0.0, False), (3, True)])
def test_bool_of_one_element_tensor(value, truth):
    # any dtype and rank (bool() of a float tensor raised "std::bad_cast")
    for dtype in (bt.float32, bt.bfloat16, bt.float64, bt.int64):
        assert bool(bt.full((1, 1), value, dtype=dtype)) is truth
    assert bool(bt.tensor(value)) is truth


def _leaf() -> bt.Tensor:
    return bt.ones(3).requires_grad_(True)


@pytest.mark.parametrize(
    "fn,exc,pattern",
    [
        # a gradient hook's result stands in for the gradient: a Tensor of its shape, or None
        (
            lambda: _hooked(lambda g: "a"),
            TypeError,
            r"^\[hook\] a gradient hook must return a Tensor or None, got <class 'str'>",
        ),
        (
            lambda: _hooked(lambda g: g.reshape(3, 1)),
            ValueError,
            r"^\[hook\] a gradient hook returned shape \(3, 1\) on cpu for a gradient of shape",
        ),
        # .grad is accumulated into and read by optimizers: floating, on the tensor's device
        (
            lambda: setattr(_leaf(), "grad", bt.ones(3, dtype=bt.int64)),
            TypeError,
            r"^\[grad\] assigned gradient is int64 on cpu; expected a floating tensor on cpu",
        ),
        # lists of tensors name the op and the position (were "std::bad_cast")
        (
            lambda: bt.clip_grad_norm_([_leaf(), 3], 1.0),
            TypeError,
            r"^\[clip_grad_norm_\] parameters\[1\] is a int, not a Tensor",
        ),
        (
            lambda: bt.backward([(_leaf() * 2).sum()], ["x"]),
            TypeError,
            r"^\[backward\] grad_tensors\[0\] is a str, not a Tensor",
        ),
        (lambda: bt.backward(5), TypeError, r"^\[backward\] tensors must be a list of tensors"),
    ],
)
def test_autograd_argument_errors(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def _hooked(hook):
    x = _leaf()
    x.register_hook(hook)
    (x * 2).sum().backward()


def test_custom_function_backward_must_return_tensors():
    class Bad(bt.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return 2.0

    with pytest.raises(TypeError, match=r"^\[Bad\] backward's gradients\[0\] is a float"):
        Bad.apply(_leaf()).sum().backward()


@pytest.mark.parametrize(
    "fn,exc,pattern",
    [
        # in-place writes to an expand()ed view would write one element from several places
        (lambda: bt.ones(1, 3).expand(4, 3).add_(1), RuntimeError, r"^\[add_\] .*share memory"),
        (lambda: bt.ones(1, 3).expand(4, 3).zero_(), RuntimeError, r"^\[zero_\] .*stride 0"),
        (
            lambda: bt.ones(3, 1).expand(3, 2).copy_(bt.zeros(3, 2)),
            RuntimeError,
            r"^\[copy_\] the tensor of shape \(3, 2\) has elements that share memory \(dim 1",
        ),
        # in-place arithmetic keeps the tensor's dtype; a float result would be truncated
        (
            lambda: bt.ones(3, dtype=bt.int64).add_(1.5),
            TypeError,
            r"^\[add_\] the result is float32, which cannot be stored in place in a int64 tensor",
        ),
        (lambda: bt.ones(3, dtype=bt.int32).div_(2), TypeError, r"^\[div_\] the result is float"),
        (lambda: bt.ones(3, dtype=bt.int64).exp_(), TypeError, r"^\[exp_\] the result is float"),
        (lambda: bt.ones(3, dtype=bt.bool).mul_(2), TypeError, r"^\[mul_\] .* in a bool tensor"),
        # refused before computing: a division by zero in the refused result is not what is
        # reported (on CUDA that error surfaced at the next synchronisation, after the refusal)
        (
            lambda: bt.ones(1, dtype=bt.bool).__imod__(bt.zeros(1, dtype=bt.int32)),
            TypeError,
            r"^\[remainder_\] the result is int32, which cannot be stored in place in a bool",
        ),
        (
            lambda: bt.ones(2, dtype=bt.int32).floor_divide_(bt.zeros(3, 2, dtype=bt.int32)),
            ValueError,
            r"^\[floor_divide_\] the result of shape \(3, 2\) does not fit the tensor of shape",
        ),
        # a value an integer dtype cannot hold (its cast is undefined behaviour in C++)
        (
            lambda: bt.full((2,), float("nan"), dtype=bt.int64),
            ValueError,
            r"^\[full\] value nan does not fit int64",
        ),
        (lambda: bt.full((2,), 300, dtype=bt.uint8), ValueError, r"^\[full\] .* fit uint8"),
        (lambda: bt.full((2,), 2.0**31, dtype=bt.int32), ValueError, r"^\[full\] .* fit int32"),
    ],
)
def test_in_place_and_fill_errors(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_in_place_cases_that_stay_allowed():
    x = bt.ones(3, dtype=bt.int64)
    x.add_(2)  # int + int stays int
    x[0] = 7.9  # setitem and copy_ cast, as PyTorch
    assert x.tolist() == [7, 3, 3]
    y = bt.zeros(1, 3).expand(4, 3)[1]  # one row of an expanded view does not overlap itself
    y.fill_(5.0)
    assert y.tolist() == [5.0, 5.0, 5.0]
    f = bt.ones(2)
    f.mul_(bt.tensor([2, 3]))  # an int operand into a float tensor
    assert f.tolist() == [2.0, 3.0]
    assert bt.full((2,), 255, dtype=bt.uint8).tolist() == [255, 255]
    assert bt.full((2,), -(2.0**63), dtype=bt.int64).tolist() == [-(2**63)] * 2


def test_bmm_of_an_empty_batch():
    needs_linalg()
    a = bt.randn(0, 2, 3).requires_grad_(True)
    b = bt.randn(0, 3, 4).requires_grad_(True)
    y = bt.bmm(a, b)
    assert y.shape == (0, 2, 4)
    y.sum().backward()
    assert a.grad.shape == (0, 2, 3) and b.grad.shape == (0, 3, 4)


@pytest.mark.parametrize(
    "fn,pattern",
    [
        (lambda: bt.amax(3.0), r"^\[amax\] argument 'input' must be a Tensor, got 3.0 \(float\)"),
        (lambda: bt.sum(None), r"^\[sum\] argument 'input' must be a Tensor, got None"),
        (
            lambda: bt.reshape([1, 2], (2,)),
            r"^\[reshape\] argument 'input' must be a Tensor, got \[1, 2\] \(list\)",
        ),
        (lambda: bt.max((1, 2)), r"^\[max\] argument 'input' must be a Tensor, got \(1, 2\)"),
        (lambda: bt.exp(2.0), r"^\[exp\] argument 'input' must be a Tensor, got 2.0 \(float\)"),
        (lambda: bt.add(2, 3), r"^\[add\] expected a Tensor operand, got 2 \(int\) and 3 \(int\)"),
        (
            lambda: bt.maximum("a", bt.ones(2)),
            r"^\[maximum\] argument 'input' must be a Tensor, got 'a' \(str\)",
        ),
    ],
)
def test_functional_forms_name_the_op_for_non_tensors(fn, pattern):
    with pytest.raises(TypeError, match=pattern):
        fn()


def test_functional_forms_take_a_scalar_first_operand():
    assert bt.add(2, bt.ones(2)).tolist() == [3.0, 3.0]
    assert bt.sub(1, bt.ones(2)).tolist() == [0.0, 0.0]
    assert bt.pow(2, bt.ones(2)).tolist() == [2.0, 2.0]


def test_tensor_from_bad_data():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"^\[tensor\] cannot make a tensor from this data"):
        bt.tensor([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"^\[tensor\] uint64 values above 2\*\*63 - 1"):
        bt.tensor(np.array([2**63], dtype=np.uint64))
    assert bt.tensor(np.array([2**63 - 1], dtype=np.uint64)).tolist() == [2**63 - 1]


@pytest.mark.parametrize(
    "fn,exc,pattern",
    [
        # Python ints past int64 (were "std::bad_cast")
        (lambda: bt.ones(2, dtype=bt.int64) + 2**70, ValueError, r"^\[add\] the integer operand"),
        (lambda: bt.ones(3)[2**70], TypeError, r"^\[getitem\] indices must be ints, got 118"),
        (lambda: bt.ones(3).split(2**70), TypeError, r"^\[split\] sizes must be ints"),
        # an index list numpy cannot hold as ints
        (lambda: bt.ones(3)[[[0, 1], [2]]], IndexError, r"^\[getitem\] index lists must hold ints"),
        # scalars of the Python-level ops
        (lambda: bt.clip_grad_norm_([], "a"), TypeError, r"^\[clip_grad_norm_\] max_norm must"),
        (lambda: bt.allclose(bt.ones(2), bt.ones(3)), ValueError, r"^\[allclose\] shapes \(2,\)"),
        (lambda: bt.allclose(bt.ones(2), bt.ones(2), "x"), TypeError, r"^\[allclose\] rtol must"),
        # a device index that is no CUDA device number (was "std::bad_cast" past int32)
        (lambda: bt.zeros(2, device=2**70), ValueError, r"^\[zeros\] device index 118"),
        (lambda: bt.zeros(2, device=-1), ValueError, r"^\[zeros\] device index -1 is not"),
    ],
)
def test_python_argument_errors(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_slices_with_bounds_and_steps_past_int64():
    x = bt.arange(5.0)
    assert x[2 : 2**70].tolist() == [2.0, 3.0, 4.0]  # clamped, as Python slicing
    assert x[-(2**70) : 2].tolist() == [0.0, 1.0]
    assert x[1 :: 2**70].tolist() == [1.0]  # one element, and no overflow in its stride
    assert x[:: 2**62].tolist() == [0.0]


# ---- every public op, wrong-typed arguments: no generic message (issue 37) ---------------------
class _Junk:
    pass


# Public names no user constructs or calls with arguments: typing re-exports, the max() and
# op_log() result tuples, autograd.Function (subclassed; its apply is checked by the fuzz), Graph
# nodes, the dtype enum (as torch.dtype: its members are the dtypes).
_NOT_CALLED = {
    "Callable", "Iterator", "Sequence", "MaxResult", "OpLogEntry", "Function", "Node", "dtype",
}  # fmt: skip
# Dunders Python itself calls with fixed arguments (protocol, not ops).
_PROTOCOL = {
    "__init__", "__new__", "__init_subclass__", "__subclasshook__", "__getattribute__",
    "__setattr__", "__delattr__", "__dir__", "__reduce__", "__reduce_ex__", "__sizeof__",
    "__getstate__", "__hash__", "__str__", "__format__", "__class__", "__del__",
    "__array_ufunc__", "__deepcopy__", "__copy__", "__dlpack__", "__dlpack_device__",
}  # fmt: skip


def _public_calls():
    for n in bt.__all__:
        obj = getattr(bt, n)
        if n in _NOT_CALLED | {"nn", "Tensor"} or isinstance(obj, bt.dtype) or not callable(obj):
            continue
        yield f"bt.{n}", obj
    for n in dir(bt.Tensor):
        if (n.startswith("_") and not n.endswith("__")) or n in _PROTOCOL:
            continue
        if callable(getattr(bt.Tensor, n)):
            yield f"Tensor.{n}", functools.partial(_call_method, n)


def _call_method(name, *args, **kwargs):
    return getattr(bt.ones(2, 3), name)(*args, **kwargs)


def test_no_public_op_answers_bad_arguments_with_a_generic_message():
    """Every public function, Tensor method (operator dunders called by hand included) and
    constructor, called with wrong types, counts or keywords: each error starts with "[op]"; none
    is nanobind's "incompatible function arguments" or a bare std::bad_cast.  Found at first: 217
    dunder calls (t.__add__(), t.__radd__(1, 2)), Tensor.record_stream(object()) (bad_cast),
    bt.autocast / bt.capture / bt.load_graph / bt.use_deterministic_algorithms / Graph /
    no_grad / np.asarray(t, dtype=junk) with Python's or numpy's unprefixed messages."""
    t = bt.ones(2, 3)
    junk = [
        ((), {}),
        ((_Junk(),), {}),
        (("str",), {}),
        ((None,), {}),
        ((1.5,), {}),
        ((t, _Junk()), {}),
        ((t, "s"), {}),
        ((t, t, _Junk()), {}),
        ((t, 1, "x"), {}),
        ((t, None, None, None), {}),
        ((t,), {"bogus": 1}),
    ]
    bad, calls = [], 0
    for name, fn in _public_calls():
        for args, kwargs in junk:
            try:
                fn(*args, **kwargs)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 (what is checked is the message)
                calls += 1
                msg = str(e)
                if (
                    not msg.startswith("[")
                    or "incompatible function arguments" in msg
                    or "bad_cast" in msg
                ):
                    bad.append(f"{name}{args!r:.60} {kwargs}: {type(e).__name__}: {msg[:120]}")
    assert calls > 2000
    assert not bad, "\n".join(bad[:30])


@pytest.mark.parametrize(
    "fn,exc,pattern",
    [
        (lambda: bt.ones(2).__add__(), TypeError, r"^\[add\] missing required argument 'other'"),
        (lambda: bt.ones(2).__rsub__(1, 2), TypeError, r"^\[sub\] takes at most 1 positional"),
        (lambda: bt.ones(2).__iadd__(x=1), TypeError, r"^\[add\] got an unexpected keyword .*'x'"),
        (lambda: bt.ones(2).add_(bt.ones(2), junk=3), TypeError, r"^\[add_\] .*'junk'"),
        (lambda: bt.ones(2).record_stream(object()), TypeError, r"^\[record_stream\] argument "),
        (lambda: bt.ones(2).record_stream(True), TypeError, r"^\[record_stream\] .*True \(bool\)"),
        (lambda: bt.load_graph(3), TypeError, r"^\[load_graph\] argument 'src' .*3 \(int\)"),
        (lambda: bt.use_deterministic_algorithms(1), TypeError, r"^\[use_deterministic_alg.*1"),
        (lambda: bt.autocast(bt.bfloat16, True, 3), TypeError, r"^\[autocast\] too many"),
        (lambda: bt.capture(1), TypeError, r"^\[capture\] too many positional"),
        (lambda: bt.Graph(1), TypeError, r"^\[Graph\] too many positional"),
        (lambda: bt.no_grad(1), TypeError, r"^\[no_grad\]"),
        (lambda: bt.ones(2).__array__(_Junk()), TypeError, r"^\[array\] argument 'dtype'"),
        (lambda: bt.ones(2).__array__("f8", copy=False), ValueError, r"^\[array\] copy=False"),
    ],
)
def test_python_level_and_dunder_argument_errors(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_caller_given_scratch_scope():
    """Note [caller-given scratch]: _with_scratch runs fn inside the scope and returns its
    result; a region that is not a contiguous uint8 tensor is refused with the op named; an
    exception in fn propagates and ends the scope; on the CPU no op takes scratch (0 bytes)."""
    region = bt.zeros(4096, dtype=bt.uint8)
    x = bt.arange(6, dtype=bt.float32)
    got = bt._tensor._with_scratch(region, lambda: (x * 2).sum())
    assert float(got.item()) == 30.0
    with pytest.raises(ValueError, match=r"\[scratch\].*uint8"):
        bt._tensor._with_scratch(bt.zeros(16), lambda: None)
    with pytest.raises(ValueError, match=r"\[scratch\]"):
        bt._tensor._with_scratch(bt.zeros((64, 64), dtype=bt.uint8)[:, ::2], lambda: None)

    def boom():
        raise KeyError("inside")

    with pytest.raises(KeyError):
        bt._tensor._with_scratch(region, boom)
    assert bt._tensor._with_scratch(region, lambda: 7) == 7
    assert bt._tensor._index_add_scratch_bytes("cpu", 4096, 1000, 64, "float32") == 0
    assert bytes(region.numpy()) == bytes(4096)  # nothing on the CPU wrote into it
