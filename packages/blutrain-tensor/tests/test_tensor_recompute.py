"""Recomputed layer-norm outputs (Note [recomputed activations], src/primitives.h).

bt.layer_norm / bt.add_layer_norm with recompute=True: the ops that use the output keep a recipe
instead of the tensor and rebuild it in backward.  Checked on every backend: the same forward
values and bitwise the same gradients as recompute=False (the rebuild runs the same kernels),
that no node holds the output (an in-place change to it no longer trips the saved-tensor check,
and on CUDA the forward's memory is lower by the outputs' bytes), and that an in-place change
to what the recipe reads raises in backward."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import needs_linalg

import blutrain.tensor as bt

NO_CUDA = pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]
DTYPES = [bt.float64, bt.float32, bt.bfloat16]


@pytest.fixture(autouse=True)
def _linalg():
    needs_linalg()


def _leaf(rng, shape, dtype, device, scale=1.0):
    a = rng.standard_normal(shape) * scale
    return bt.tensor(a, dtype=dtype, device=device, requires_grad=True)


def _bits(t: bt.Tensor) -> np.ndarray:
    """The tensor's raw bits (bf16 through float32, exact), for bitwise comparisons."""
    a = t.detach().cpu()
    if a.dtype == bt.bfloat16:
        a = a.float()
    return np.ascontiguousarray(a.numpy()).view(np.uint8)


def _assert_same_bits(a: bt.Tensor, b: bt.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: not bitwise equal"


def _ln_linear_step(leaves, recompute, fused_add):
    """A pre-LN block's norm and linear consumers; returns (loss, h)."""
    x, r, w, b, W1, b1, W2 = leaves
    if fused_add:
        s, h = bt.add_layer_norm(x, r, w, b, 1e-5, recompute=recompute)
    else:
        s = x + r
        h = bt.layer_norm(s, (x.shape[-1],), w, b, 1e-5, recompute=recompute)
    y = bt.linear(h, W1, b1)  # saves h (or its recipe) for dW1
    z = bt.linear(bt.gelu(y, "tanh"), W2)
    loss = (z * z).sum() + (s * s).sum()
    return loss, h


def _make_leaves(rng, dtype, device, B=3, T=5, C=48):
    return [
        _leaf(rng, (B, T, C), dtype, device),
        _leaf(rng, (B, T, C), dtype, device),
        _leaf(rng, (C,), dtype, device, 0.5),
        _leaf(rng, (C,), dtype, device, 0.5),
        _leaf(rng, (2 * C, C), dtype, device, 0.2),
        _leaf(rng, (2 * C,), dtype, device, 0.2),
        _leaf(rng, (C, 2 * C), dtype, device, 0.2),
    ]


def _grads(leaves, recompute, fused_add):
    for p in leaves:
        p.grad = None
    loss, h = _ln_linear_step(leaves, recompute, fused_add)
    loss.backward()
    return h, [p.grad for p in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused_add", [False, True])
def test_same_values_and_gradients_bitwise(rng, device, dtype, fused_add):
    leaves = _make_leaves(rng, dtype, device)
    h0, g0 = _grads(leaves, False, fused_add)
    h1, g1 = _grads(leaves, True, fused_add)
    _assert_same_bits(h0, h1, "output")
    for k, (a, b) in enumerate(zip(g0, g1, strict=True)):
        _assert_same_bits(a, b, f"grad of leaf {k}")


def _mixed_grads(rng_state, device, recompute, fused_add):
    """A float32 residual stream with a bf16 branch (Note [float32 residual stream]): the norm's
    bf16 output feeds bf16 linears; float32 parameters."""
    rng = np.random.default_rng(rng_state)
    C = 64
    x = _leaf(rng, (3, 5, C), bt.float32, device)
    r = _leaf(rng, (3, 5, C), bt.bfloat16, device)
    w, b = _leaf(rng, (C,), bt.float32, device, 0.5), _leaf(rng, (C,), bt.float32, device, 0.5)
    W1 = _leaf(rng, (2 * C, C), bt.bfloat16, device, 0.2)
    leaves = [x, r, w, b, W1]
    if fused_add:
        s, h = bt.add_layer_norm(x, r, w, b, 1e-5, recompute=recompute, out_dtype=bt.bfloat16)
    else:
        s = x + r.float()
        h = bt.layer_norm(s, (C,), w, b, 1e-5, recompute=recompute, out_dtype=bt.bfloat16)
    s2, h2 = bt.add_layer_norm(s, bt.linear(h, W1)[..., :C], w, b, out_dtype=bt.bfloat16)
    z = bt.linear(h2, W1)
    (z.float() * z.float()).sum().backward()
    return h, [p.grad for p in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused_add", [False, True])
def test_mixed_norms_same_values_and_gradients_bitwise(rng, device, fused_add):
    seed = int(rng.integers(2**31))
    h0, g0 = _mixed_grads(seed, device, False, fused_add)
    h1, g1 = _mixed_grads(seed, device, True, fused_add)
    assert h0.dtype == bt.bfloat16
    _assert_same_bits(h0, h1, "output")
    for k, (a, b) in enumerate(zip(g0, g1, strict=True)):
        _assert_same_bits(a, b, f"grad of leaf {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_rebuilt_output_matches_the_add_kernels_bitwise(rng, device):
    # add_layer_norm's rebuild is layer_norm of the kept sum: the same values as the fused kernel
    for dtype in (bt.float32, bt.bfloat16):
        for C in (96, 768, 3072, 100):
            x = bt.tensor(rng.standard_normal((64, C)), dtype=dtype, device=device)
            r = bt.tensor(rng.standard_normal((64, C)), dtype=dtype, device=device)
            w = bt.tensor(rng.standard_normal(C), dtype=dtype, device=device)
            b = bt.tensor(rng.standard_normal(C), dtype=dtype, device=device)
            s, y = bt.add_layer_norm(x, r, w, b, 1e-5)
            _assert_same_bits(y, bt.layer_norm(s, (C,), w, b, 1e-5), f"{dtype} C={C}")
    for C in (96, 768, 3072, 100, 4096):  # mixed rows (v3 up to 3072 wide, v1 past it on CUDA)
        x = bt.tensor(rng.standard_normal((64, C)) * 4, dtype=bt.float32, device=device)
        r = bt.tensor(rng.standard_normal((64, C)), dtype=bt.bfloat16, device=device)
        w = bt.tensor(rng.standard_normal(C), dtype=bt.float32, device=device)
        b = bt.tensor(rng.standard_normal(C), dtype=bt.float32, device=device)
        s, y = bt.add_layer_norm(x, r, w, b, 1e-5, out_dtype=bt.bfloat16)
        y2 = bt.layer_norm(s, (C,), w, b, 1e-5, out_dtype=bt.bfloat16)
        _assert_same_bits(y, y2, f"mixed C={C}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused_add", [False, True])
def test_the_output_is_not_held_by_its_users(rng, device, fused_add):
    """Changing the output in place after the forward trips the saved-tensor check unless the
    linear kept the recipe; with it, the gradients are those of the forward's values."""
    leaves = _make_leaves(rng, bt.float32, device)
    _, ref = _grads(leaves, False, fused_add)
    for recompute in (False, True):
        for p in leaves:
            p.grad = None
        loss, h = _ln_linear_step(leaves, recompute, fused_add)
        with bt.no_grad():
            h.add_(1.0)
        if not recompute:
            with pytest.raises(RuntimeError, match="modified by an in-place operation"):
                loss.backward()
            continue
        loss.backward()
        for k, p in enumerate(leaves):
            _assert_same_bits(p.grad, ref[k], f"grad of leaf {k}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused_add", [False, True])
def test_changed_recipe_input_raises(rng, device, fused_add):
    x, r, w, b, W1, b1, _ = _make_leaves(rng, bt.float32, device)
    if fused_add:
        s, h = bt.add_layer_norm(x, r, w, b, 1e-5, recompute=True)
    else:
        s = x + r
        h = bt.layer_norm(s, (x.shape[-1],), w, b, 1e-5, recompute=True)
    y = bt.linear(h, W1, b1)
    with bt.no_grad():
        s.mul_(2.0)
    op = "add_layer_norm" if fused_add else "layer_norm"
    with pytest.raises(RuntimeError, match=f"of {op}, kept to recompute its output"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_output_changed_before_use_is_saved_as_usual(rng, device):
    """A marked output changed in place before a linear saves it: the linear keeps the tensor
    (its recipe would rebuild the old values), so dW sees the changed values."""
    x, r, w, b, W1, b1, _ = _make_leaves(rng, bt.float32, device)

    def run(recompute):
        for p in (x, w, b, W1, b1):
            p.grad = None
        h = bt.layer_norm(x, (x.shape[-1],), w, b, 1e-5, recompute=recompute)
        h = h.mul_(2.0)
        bt.linear(h, W1, b1).sum().backward()
        return [p.grad for p in (x, w, b, W1, b1)]

    for k, (a, c) in enumerate(zip(run(False), run(True), strict=True)):
        _assert_same_bits(a, c, f"grad {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_rebuilds_each_time(rng, device):
    leaves = _make_leaves(rng, bt.float32, device)
    _, once = _grads(leaves, False, True)
    once = [g.detach().cpu().numpy().copy() for g in once]
    for p in leaves:
        p.grad = None
    loss, _ = _ln_linear_step(leaves, True, True)
    loss.backward(retain_graph=True)
    loss.backward()
    for k, p in enumerate(leaves):
        np.testing.assert_allclose(
            p.grad.cpu().numpy(), 2 * once[k], rtol=1e-6, atol=1e-6, err_msg=f"leaf {k}"
        )


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_constant_inputs_are_plain(rng, device):
    x = bt.tensor(rng.standard_normal((4, 8)), device=device)
    w = bt.tensor(rng.standard_normal(8), device=device)
    ref = bt.layer_norm(x, (8,), w, None, 1e-5)
    _assert_same_bits(bt.layer_norm(x, (8,), w, None, 1e-5, recompute=True), ref, "constant")
    with bt.no_grad():
        xg = x.detach().requires_grad_(True)
        _assert_same_bits(bt.layer_norm(xg, (8,), w, None, 1e-5, recompute=True), ref, "no_grad")
    s, y = bt.add_layer_norm(x, x, w, None, 1e-5, recompute=True)
    assert not y.requires_grad


def test_module_option(rng):
    ln = bt.nn.LayerNorm(16, recompute=True)
    assert "recompute=True" in repr(ln)
    x = _leaf(rng, (2, 3, 16), bt.float32, "cpu")
    W = _leaf(rng, (4, 16), bt.float32, "cpu")
    h = ln(x)
    y = bt.linear(h, W)
    with bt.no_grad():
        h.add_(1.0)  # held by nobody: no in-place error
    y.sum().backward()
    assert x.grad is not None and ln.weight.grad is not None


@pytest.mark.gpu
@NO_CUDA
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_cuda_forward_keeps_less_memory(rng, dtype):
    """A stack of norm -> linear layers: with recompute the forward holds one (N, C) tensor
    fewer per layer; backward still gives the same gradients bitwise."""
    N, C, L = 4096, 512, 4
    esize = 4 if dtype == bt.float32 else 2
    xd = rng.standard_normal((N, C))
    wd = [rng.standard_normal((C, C)) * C**-0.5 for _ in range(L)]
    held, grads = {}, {}
    for recompute in (False, True):
        x = bt.tensor(xd, dtype=dtype, device="cuda", requires_grad=True)
        ws = [bt.tensor(a, dtype=dtype, device="cuda", requires_grad=True) for a in wd]
        bt.cuda.synchronize()
        start = bt.cuda.memory_allocated()
        h = x
        for W in ws:
            s = h
            h = bt.layer_norm(s, (C,), None, None, 1e-5, recompute=recompute)
            h = bt.linear(h, W) + s
        bt.cuda.synchronize()
        held[recompute] = bt.cuda.memory_allocated() - start
        hf = h.float()
        (hf * hf).sum().backward()
        grads[recompute] = [x.grad] + [W.grad for W in ws]
        del h, s
    saved = held[False] - held[True]
    assert saved >= L * N * C * esize, (held, L * N * C * esize)
    for k, (a, b) in enumerate(zip(grads[False], grads[True], strict=True)):
        _assert_same_bits(a, b, f"grad {k}")
