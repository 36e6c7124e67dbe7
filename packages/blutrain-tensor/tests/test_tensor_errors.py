"""Bad input gives a clear Python exception whose message starts with the op."""

from __future__ import annotations

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
            r"^\[index_select\] index 7",
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
        (lambda: bt.zeros(2, dtype="float8"), TypeError, r"^\[dtype\] unknown dtype 'float8'"),
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
        (lambda: bt.tensor([1.0], device="cuda"), "to"),
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
