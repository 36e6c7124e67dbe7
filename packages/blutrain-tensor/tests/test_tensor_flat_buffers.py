"""What blutrain-dist needs from tensors for flat buffers: gradients that stay views of a bucket
and start a window without a zero fill (_set_grad_overwrite), parameters moved into a flat buffer
(_set_data), version counters per bucket (Note [version counter groups] in src/tensor.h),
record_stream, and the public stream / event API (GPU tests at the end)."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.tensor import _tensor as C


def _leaf(rng: np.random.Generator, *shape: int) -> bt.Tensor:
    return bt.tensor(rng.standard_normal(shape).astype(np.float32)).requires_grad_(True)


def test_grad_overwrite_replaces_then_accumulates(rng: np.random.Generator) -> None:
    w = _leaf(rng, 3, 4)
    x = bt.tensor(rng.standard_normal((5, 3)).astype(np.float32))
    flat = bt.full((20,), 7.0)  # stale values from an earlier window
    view = flat[2:14].view(3, 4)
    w.grad = view
    C._set_grad_overwrite([w], True)
    assert w._grad_overwrite
    (x @ w).sum().backward()
    twin = bt.tensor(w.detach().numpy()).requires_grad_(True)  # the same backward, no gradient
    (x @ twin).sum().backward()
    expected = twin.grad.numpy()
    np.testing.assert_array_equal(w.grad.numpy(), expected)  # replaced, not 7 + g
    ref = x.numpy().astype(np.float64).sum(axis=0)[:, None].repeat(4, axis=1)
    np.testing.assert_allclose(expected, ref, rtol=1e-5, atol=1e-6)
    assert not w._grad_overwrite
    assert w.grad.data_ptr() == view.data_ptr()  # still the bucket's memory
    np.testing.assert_array_equal(flat.numpy()[:2], [7.0, 7.0])  # neighbours untouched
    (x @ w).sum().backward()  # the flag cleared: the second backward adds
    np.testing.assert_allclose(w.grad.numpy(), 2 * expected, rtol=1e-6)


def test_grad_overwrite_without_grad_adopts(rng: np.random.Generator) -> None:
    w = _leaf(rng, 4)
    C._set_grad_overwrite([w], True)
    (w * 3.0).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full(4, 3.0, np.float32))
    assert not w._grad_overwrite


def test_set_data_moves_a_parameter_into_a_flat_buffer(rng: np.random.Generator) -> None:
    p = bt.nn.Parameter(bt.tensor(rng.standard_normal((3, 4)).astype(np.float32)))
    seen = []
    p.register_post_accumulate_grad_hook(lambda t: seen.append(1))  # no tensor: no cycle
    flat = bt.zeros(20)
    flat[4:16].copy_(p.detach().reshape(-1))
    C._set_data(p, flat[4:16].view(3, 4))
    assert p.data_ptr() == flat[4:].data_ptr()
    with bt.no_grad():
        flat[4:16].mul_(2.0)  # writes through the flat buffer reach the parameter
    np.testing.assert_array_equal(p.detach().numpy(), flat.numpy()[4:16].reshape(3, 4))
    (p * p).sum().backward()  # the leaf keeps its autograd identity (hooks, .grad)
    np.testing.assert_allclose(p.grad.numpy(), 2 * p.detach().numpy(), rtol=1e-6)
    assert len(seen) == 1


def test_set_data_errors_name_both_sides() -> None:
    p = bt.nn.Parameter(bt.zeros(3, 4))
    want = r"^\[set_data\] the new memory is \(12,\) float32 on cpu; the tensor is \(3, 4\)"
    with pytest.raises(ValueError, match=want):
        C._set_data(p, bt.zeros(12))
    with pytest.raises(ValueError, match=r"^\[set_data\].*float64"):
        C._set_data(p, bt.zeros(3, 4, dtype=bt.float64))
    y = p * 2
    with pytest.raises(RuntimeError, match=r"^\[set_data\] only a leaf"):
        C._set_data(y, bt.zeros(3, 4))


def test_version_counter_groups_keep_other_buckets_valid(rng: np.random.Generator) -> None:
    # Two "buckets" of one flat parameter buffer; a forward saves bucket 0's parameter.
    flat = bt.tensor(rng.standard_normal(8).astype(np.float32))
    a, b = flat[:4], flat[4:]
    x = _leaf(rng, 4)
    # Without groups, a write to bucket 1 invalidates the saved bucket-0 tensor.
    y = (x * a).sum()
    with bt.no_grad():
        b.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.backward()
    # With a group per bucket only writes to the same bucket do.
    C._share_version_counter([a])
    C._share_version_counter([b])
    x.grad = None
    y = (x * a).sum()
    with bt.no_grad():
        b.add_(1.0)
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), a.numpy())
    y = (x * a).sum()
    with bt.no_grad():
        a[1:2].add_(1.0)  # a view of a member is in its group
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.backward()


def test_version_group_write_bumps_the_storage_too(rng: np.random.Generator) -> None:
    flat = bt.tensor(rng.standard_normal(6).astype(np.float32))
    a = flat[:3]
    C._share_version_counter([a])
    x = _leaf(rng, 6)
    y = (x * flat).sum()  # saves the whole buffer (storage's counter)
    with bt.no_grad():
        a.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation"):
        y.backward()


def test_record_stream_on_cpu_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"^\[record_stream\] the tensor is on cpu"):
        bt.zeros(3).record_stream(0)


# ---- GPU -------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not bt.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@cuda
def test_stream_event_ordering(rng: np.random.Generator) -> None:
    a = rng.standard_normal(1 << 20).astype(np.float32)
    x = bt.tensor(a).cuda()
    side = bt.cuda.Stream(priority=bt.cuda.Stream.priority_range()[0])
    side.wait_stream(bt.cuda.current_stream())
    with bt.cuda.stream(side):
        y = x * 2.0 + 1.0
    x.record_stream(side)
    y.record_stream(side)
    ev = side.record_event()
    ev.wait()  # the current stream waits for the side stream
    z = y - 1.0
    np.testing.assert_array_equal(z.cpu().numpy(), a * 2.0)
    side.synchronize()
    assert side.query() and ev.query()
    assert "Stream(cuda:0" in repr(side)


@pytest.mark.gpu
@cuda
def test_stream_priority_out_of_range() -> None:
    g, lo = bt.cuda.Stream.priority_range()
    with pytest.raises(ValueError, match=r"^\[cuda.Stream\] priority"):
        bt.cuda.Stream(priority=g - 5)
    assert lo >= g


@pytest.mark.gpu
@cuda
def test_record_stream_delays_reuse() -> None:
    import blutrain.alloc as alloc

    side = bt.cuda.Stream()
    x = bt.zeros(1 << 18, device="cuda")
    ptr = x.data_ptr()
    x.record_stream(side)
    # A long side-stream task still "uses" x: freeing x must not hand its block out at once.
    with bt.cuda.stream(side):
        big = bt.ones(1 << 24, device="cuda")
        for _ in range(20):
            big = big * 1.0001
    del x
    y = bt.empty(1 << 18, device="cuda")
    assert y.data_ptr() != ptr or side.query()
    side.synchronize()
    assert alloc.stats("cuda")["allocated_bytes"] > 0
