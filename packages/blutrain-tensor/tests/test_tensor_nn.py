"""Module / Parameter helpers and a GPT-2 block against PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_gpt2_block import Block
from tensor_testutil import needs_linalg

import blutrain.tensor as bt
from blutrain.tensor import nn


def test_module_registers_parameters_and_submodules():
    b = Block(16, 2)
    names = [n for n, _ in b.named_parameters()]
    assert names[:2] == ["ln_1.weight", "ln_1.bias"]
    assert "attn.c_attn.weight" in names and "mlp.c_proj.bias" in names
    assert all(
        isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf for p in b.parameters()
    )
    assert len(list(b.modules())) == 12
    b.eval()
    assert not b.mlp.dropout.training
    sd = b.state_dict()
    b2 = Block(16, 2)
    b2.load_state_dict(sd)
    for (_, p1), (_, p2) in zip(b.named_parameters(), b2.named_parameters()):
        np.testing.assert_array_equal(p1.detach().numpy(), p2.detach().numpy())
    with pytest.raises(KeyError, match=r"\[load_state_dict\] missing"):
        b2.load_state_dict({})
    assert "Linear(16, 48, bias=True)" in repr(b)


def test_zero_grad():
    lin = nn.Linear(3, 2)
    lin(bt.ones(4, 3)).sum().backward()
    assert lin.weight.grad is not None
    lin.zero_grad(set_to_none=False)
    assert not lin.weight.grad.numpy().any()
    lin.zero_grad()
    assert lin.weight.grad is None


def test_gpt2_block_matches_torch(rng, torch_ref):
    needs_linalg()
    t = torch_ref
    C, H, B, T = 16, 4, 2, 5
    blk = Block(C, H, dtype=bt.float64)
    tblk = {n: t.tensor(p.detach().numpy(), requires_grad=True) for n, p in blk.named_parameters()}
    x = rng.standard_normal((B, T, C))
    y = blk(bt.tensor(x))
    F = t.nn.functional

    def tforward(xt):
        p = tblk
        h = F.layer_norm(xt, (C,), p["ln_1.weight"], p["ln_1.bias"])
        q, k, v = F.linear(h, p["attn.c_attn.weight"], p["attn.c_attn.bias"]).split(C, 2)
        q, k, v = (z.view(B, T, H, C // H).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).contiguous().view(B, T, C)
        xt = xt + F.linear(a, p["attn.c_proj.weight"], p["attn.c_proj.bias"])
        h = F.layer_norm(xt, (C,), p["ln_2.weight"], p["ln_2.bias"])
        h = F.gelu(F.linear(h, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"]), approximate="tanh")
        return xt + F.linear(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])

    ty = tforward(t.tensor(x))
    np.testing.assert_allclose(y.detach().numpy(), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    g = rng.standard_normal((B, T, C))
    y.backward(bt.tensor(g))
    ty.backward(t.tensor(g))
    for n, p in blk.named_parameters():
        np.testing.assert_allclose(
            p.grad.numpy(), tblk[n].grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=n
        )


def test_parameter_hooks_for_bucketing():
    """The pattern blutrain-dist uses: a post-accumulate hook per parameter, in reverse order."""
    blk = Block(16, 2)
    ready = []
    for n, p in blk.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: ready.append(n))
    blk(bt.randn(2, 3, 16)).sum().backward()
    assert sorted(ready) == sorted(n for n, _ in blk.named_parameters())
    assert ready.index("mlp.c_proj.weight") < ready.index("attn.c_attn.weight")
    assert ready.index("ln_2.weight") < ready.index("ln_1.weight")


def test_module_to_casts_parameters_and_keeps_ties():
    from blutrain.tensor import nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight  # one Parameter in two modules
            self.norm = nn.LayerNorm(3)

    m = Tied()
    before = m.emb.weight.detach().to(bt.float64).numpy()
    assert m.to(dtype=bt.bfloat16) is m
    assert all(p.dtype == bt.bfloat16 and p.requires_grad for p in m.parameters())
    assert m.head.weight is m.emb.weight  # still tied
    assert [n for n, _ in m.named_parameters()] == ["emb.weight", "norm.weight", "norm.bias"]
    np.testing.assert_allclose(m.emb.weight.detach().to(bt.float64).numpy(), before, rtol=2**-8)
    assert m.cpu() is m and m.emb.weight.device == "cpu"


@pytest.mark.parametrize(
    "make,pattern",
    [
        (lambda nn: nn.Linear(-1, 4), r"^\[Linear\] in_features must be a non-negative int"),
        (lambda nn: nn.Linear(3, 2.5), r"^\[Linear\] out_features must be a non-negative int"),
        (lambda nn: nn.Embedding(-5, 2), r"^\[Embedding\] num_embeddings must be"),
        (lambda nn: nn.Dropout(1.5), r"^\[Dropout\] p must be in \[0, 1\], got 1.5"),
    ],
)
def test_module_constructor_errors(make, pattern):
    from blutrain.tensor import nn

    with pytest.raises(ValueError, match=pattern):
        make(nn)


def test_zero_feature_linear_layers(rng):
    """No input features (K = 0): the product is empty, so a linear layer gives its bias, and the
    gradients have the empty shapes (reshape(-1, 0) alone would be ambiguous)."""
    needs_linalg()
    lin = nn.Linear(0, 3)
    b = rng.standard_normal(3)
    lin.bias = nn.Parameter(bt.tensor(b, dtype=bt.float32))
    x = bt.randn(2, 5, 0, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 5, 3)
    np.testing.assert_allclose(y.detach().numpy(), np.broadcast_to(b, (2, 5, 3)), rtol=1e-6)
    y.sum().backward()
    assert x.grad.shape == (2, 5, 0) and lin.weight.grad.shape == (3, 0)
    np.testing.assert_array_equal(lin.bias.grad.numpy(), [10.0, 10.0, 10.0])
    assert not (bt.randn(2, 3, 0) @ bt.randn(0, 4)).numpy().any()
    w1, b1 = bt.randn(3, 0), bt.tensor(b, dtype=bt.float32)
    h = bt.linear_gelu(bt.randn(4, 0), w1, b1)
    want = bt.gelu(b1, approximate="tanh").numpy()
    np.testing.assert_allclose(h.numpy(), np.broadcast_to(want, (4, 3)))
    assert bt.linear_gelu_linear(bt.randn(4, 0), w1, b1, bt.randn(2, 3), None).shape == (4, 2)
    assert nn.Linear(4, 0)(bt.randn(3, 4)).shape == (3, 0)
