"""GPT-2 on blutrain.tensor: shapes, init, padding, gradients, weights in and out, generate, errors.

References are float64 numpy (a forward pass written here) and central finite differences in
float64; the PyTorch comparison lives in tests/test_models_fidelity.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models import GPT2, CheckpointError, GPT2Config, save_hf  # noqa: E402
from blutrain.models.gpt2 import IGNORE_INDEX  # noqa: E402

CFG = GPT2Config(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=16)


def randomize(model: GPT2, rng: np.random.Generator, std: float = 0.3) -> dict[str, np.ndarray]:
    """Random weights of a useful size (GPT-2's init is too small to exercise everything)."""
    sd = {
        k: (rng.standard_normal(v.shape) * std).astype(np.float32)
        for k, v in model.state_dict().items()
    }
    for k in sd:
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            sd[k] += 1
    V = model.config.vocab_size
    sd["transformer.wte.weight"][V:] = 0
    model.load_state_dict(sd)
    return sd


# -- a float64 numpy GPT-2 ---------------------------------------------------------------------


def np_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_gpt2(sd: dict[str, np.ndarray], cfg: GPT2Config, idx: np.ndarray, targets=None):
    p = {k: v.astype(np.float64) for k, v in sd.items()}
    B, T = idx.shape
    C, H = cfg.n_embd, cfg.n_head
    D = C // H
    eps = cfg.layer_norm_epsilon
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]
    for i in range(cfg.n_layer):
        q = lambda n, i=i: p[f"transformer.h.{i}.{n}"]  # noqa: E731
        h = np_layer_norm(x, q("ln_1.weight"), q("ln_1.bias"), eps)
        qkv = h @ q("attn.c_attn.weight").T + q("attn.c_attn.bias")
        qq, kk, vv = (
            qkv[..., j * C : (j + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)
            for j in range(3)
        )
        att = qq @ kk.transpose(0, 1, 3, 2) / math.sqrt(D)
        att = np.where(np.tril(np.ones((T, T), bool)), att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ vv).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ q("attn.c_proj.weight").T + q("attn.c_proj.bias")
        h = np_layer_norm(x, q("ln_2.weight"), q("ln_2.bias"), eps)
        h = np_gelu_tanh(h @ q("mlp.c_fc.weight").T + q("mlp.c_fc.bias"))
        x = x + h @ q("mlp.c_proj.weight").T + q("mlp.c_proj.bias")
    x = np_layer_norm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], eps)
    logits = x @ p["transformer.wte.weight"][: cfg.vocab_size].T
    if targets is None:
        return logits, None
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = targets != IGNORE_INDEX
    nll = -np.take_along_axis(logp, np.where(keep, targets, 0)[..., None], -1)[..., 0]
    return logits, float(nll[keep].mean())


# -- forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_multiple", [1, 128])
def test_forward_matches_float64_numpy(rng, vocab_multiple):
    cfg = GPT2Config(
        block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=16, vocab_multiple=vocab_multiple
    )
    model = GPT2(cfg)
    sd = randomize(model, rng)
    B, T = 3, int(rng.integers(1, cfg.block_size + 1))
    idx = rng.integers(0, cfg.vocab_size, (B, T))
    tgt = rng.integers(0, cfg.vocab_size, (B, T))
    tgt[0, 0] = IGNORE_INDEX
    logits, loss = model(idx, tgt)
    ref_logits, ref_loss = np_gpt2(sd, cfg, idx, tgt)
    assert tuple(logits.shape) == (B, T, cfg.vocab_size)
    assert logits.dtype == bt.float32
    err = np.abs(logits.detach().numpy() - ref_logits).max() / np.abs(ref_logits).max()
    assert err < 2e-6, err
    assert abs(loss.item() - ref_loss) / ref_loss < 2e-6
    # bt tensors and numpy give the same, as do (T,) ids and (1, T)
    l2, loss2 = model(bt.tensor(idx), bt.tensor(tgt))
    assert (
        np.array_equal(l2.detach().numpy(), logits.detach().numpy()) and loss2.item() == loss.item()
    )
    # one sequence alone: the same up to float32 rounding (BLAS may sum a row of a 3T-row
    # product in another order than the same row of a T-row one: OpenBLAS's Zen / Haswell
    # kernels treat M's remainder rows apart)
    l3, _ = model(idx[1])
    ref1 = logits.detach().numpy()[1]
    err1 = np.abs(l3.detach().numpy()[0] - ref1).max() / np.abs(ref1).max()
    assert err1 < 2e-6, err1
    assert model(idx)[1] is None


def test_vocab_padding_never_changes_results(rng):
    plain = GPT2(CFG)
    padded = GPT2(GPT2Config(**{**CFG.to_dict(), "vocab_multiple": 128}))
    assert padded.config.padded_vocab_size == 128
    sd = randomize(plain, rng)
    padded.load_state_dict(sd)  # (V, C) wte is accepted and padded with zero rows
    assert padded.state_dict()["transformer.wte.weight"].shape == (128, CFG.n_embd)
    idx = rng.integers(0, CFG.vocab_size, (2, 12))
    tgt = rng.integers(0, CFG.vocab_size, (2, 12))
    la, a = plain(idx, tgt)
    lb, b = padded(idx, tgt)
    assert lb.shape == la.shape
    np.testing.assert_allclose(lb.detach().numpy(), la.detach().numpy(), rtol=1e-6, atol=1e-6)
    assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    b.backward()
    g = dict(padded.named_parameters())["transformer.wte.weight"].grad.detach().numpy()
    assert not g[CFG.vocab_size :].any(), "padding rows got a gradient"
    assert g[: CFG.vocab_size].any()
    out_a = plain.generate(idx[:, :3], 8, top_k=5, seed=3)
    out_b = padded.generate(idx[:, :3], 8, top_k=5, seed=3)
    assert np.array_equal(out_a, out_b)


# -- init ------------------------------------------------------------------------------------------


def test_init_is_gpt2s():
    cfg = GPT2Config(
        block_size=64, vocab_size=1000, n_layer=6, n_head=4, n_embd=64, vocab_multiple=128
    )
    bt.manual_seed(0)
    sd = GPT2(cfg).state_dict()
    assert list(sd) == list(cfg.param_shapes())
    for k, v in sd.items():
        assert v.shape == cfg.param_shapes()[k] and v.dtype == np.float32
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    for k, v in sd.items():
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            assert (v == 1).all(), k
        elif k.endswith("bias"):
            assert (v == 0).all(), k
        else:
            if k == "transformer.wte.weight":
                assert not v[cfg.vocab_size :].any()
                v = v[: cfg.vocab_size]
            want = resid if k.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")) else 0.02
            n = v.size
            # the sample std is within 5 standard errors of the target; the mean is ~0
            assert abs(v.std() - want) < 5 * want / math.sqrt(2 * n), (k, v.std(), want)
            assert abs(v.mean()) < 5 * want / math.sqrt(n), k
    # seeded: the same weights again; another seed differs
    bt.manual_seed(0)
    again = GPT2(cfg).state_dict()
    assert all(np.array_equal(sd[k], again[k]) for k in sd)
    bt.manual_seed(1)
    assert not np.array_equal(
        GPT2(cfg).state_dict()["transformer.wte.weight"], sd["transformer.wte.weight"]
    )


def test_parameters_and_counts():
    cfg = GPT2Config.from_name("tiny", vocab_multiple=128)
    m = GPT2(cfg)
    names = [n for n, _ in m.named_parameters()]
    assert names == list(cfg.param_shapes())  # no separate lm_head: it is tied to wte
    assert len(list(m.parameters())) == len(names)
    assert m.num_parameters() == cfg.n_params()
    assert sum(p.numel() for p in m.parameters()) == cfg.n_params(padded=True)
    assert all(p.requires_grad for p in m.parameters())


# -- gradients -------------------------------------------------------------------------------------


def test_gradients_match_finite_differences(rng):
    """Directional derivatives of the float64 loss along random directions, per tensor."""
    cfg = GPT2Config(block_size=8, vocab_size=23, n_layer=2, n_head=2, n_embd=8, vocab_multiple=4)
    model = GPT2(cfg)
    randomize(model, rng)
    params = dict(model.named_parameters())
    # float64 parameters: swap each for a double copy (same Module structure)
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            setattr(mod, pname, bt.nn.Parameter(p.double()))
    params = dict(model.named_parameters())
    idx = rng.integers(0, cfg.vocab_size, (2, 7))
    tgt = rng.integers(0, cfg.vocab_size, (2, 7))
    tgt[1, 3] = IGNORE_INDEX
    _, loss = model(idx, tgt)
    assert loss.dtype == bt.float64
    loss.backward()
    base = {k: p.detach().numpy().copy() for k, p in params.items()}

    def loss_at(values):
        with bt.no_grad():
            for k, p in params.items():
                p.copy_(bt.tensor(values[k]))
            return model(idx, tgt)[1].item()

    eps = 1e-6
    for name, p in params.items():
        d = rng.standard_normal(base[name].shape)
        if name == "transformer.wte.weight":
            d[cfg.vocab_size :] = 0
        plus = dict(base, **{name: base[name] + eps * d})
        minus = dict(base, **{name: base[name] - eps * d})
        numeric = (loss_at(plus) - loss_at(minus)) / (2 * eps)
        analytic = float((p.grad.detach().numpy() * d).sum())
        assert abs(numeric - analytic) <= 1e-6 + 1e-5 * abs(numeric), (name, numeric, analytic)
    loss_at(base)


def test_gradient_accumulation_equals_one_big_batch(rng):
    model = GPT2(CFG)
    randomize(model, rng)
    x = rng.integers(0, CFG.vocab_size, (4, 10))
    y = rng.integers(0, CFG.vocab_size, (4, 10))
    model(x, y)[1].backward()
    full = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    model.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        (model(x[half], y[half])[1] / 2).backward()
    for n, p in model.named_parameters():
        np.testing.assert_allclose(
            p.grad.detach().numpy(), full[n], rtol=1e-4, atol=1e-6, err_msg=n
        )


# -- state dicts and Hugging Face ------------------------------------------------------------------


def test_state_dict_round_trip_and_errors(rng):
    a, b = GPT2(CFG), GPT2(CFG)
    sd = randomize(a, rng)
    b.load_state_dict(a.state_dict())
    idx = rng.integers(0, CFG.vocab_size, (2, 5))
    assert np.array_equal(a(idx)[0].detach().numpy(), b(idx)[0].detach().numpy())
    out = a.state_dict()
    out["transformer.wpe.weight"][:] = 7  # a copy: the model is unchanged
    assert not (a.state_dict()["transformer.wpe.weight"] == 7).any()

    missing = dict(sd)
    del missing["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(CheckpointError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias.*missing"):
        b.load_state_dict(missing)
    with pytest.raises(CheckpointError, match=r"unexpected.*lm_head\.weight"):
        b.load_state_dict({**sd, "lm_head.weight": sd["transformer.wte.weight"]})
    bad = dict(sd)
    bad["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"].T
    before = b.state_dict()
    with pytest.raises(CheckpointError, match=r"c_attn\.weight.*shape \(16, 48\).*\(48, 16\)"):
        b.load_state_dict(bad)
    after = b.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before), "a failed load changed weights"


def test_from_pretrained_and_save_pretrained(tmp_path, rng):
    a = GPT2(CFG)
    randomize(a, rng)
    a.save_pretrained(tmp_path / "hf")
    b = GPT2.from_pretrained(tmp_path / "hf")
    c = GPT2.from_pretrained(tmp_path / "hf", vocab_multiple=64)
    assert b.config == CFG and c.config.padded_vocab_size == 128
    idx = rng.integers(0, CFG.vocab_size, (2, 9))
    assert np.array_equal(a(idx)[0].detach().numpy(), b(idx)[0].detach().numpy())
    np.testing.assert_allclose(
        c(idx)[0].detach().numpy(), a(idx)[0].detach().numpy(), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(FileNotFoundError, match="no such directory"):
        GPT2.from_pretrained(tmp_path / "nope")
    # a checkpoint of another shape: error names the tensor
    other = GPT2Config(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=8)
    save_hf(tmp_path / "other", GPT2(other).state_dict(), other)
    (tmp_path / "other" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="transformer.wte.weight.*shape"):
        GPT2.from_pretrained(tmp_path / "other")


# -- generate --------------------------------------------------------------------------------------


def test_generate_is_deterministic_and_correct(rng):
    model = GPT2(CFG)
    sd = randomize(model, rng, std=0.5)
    prompt = rng.integers(0, CFG.vocab_size, (2, 4))
    a = model.generate(prompt, 20, temperature=0.9, top_k=10, seed=123)
    b = model.generate(prompt, 20, temperature=0.9, top_k=10, seed=123)
    c = model.generate(prompt, 20, temperature=0.9, top_k=10, seed=124)
    assert a.shape == (2, 24) and np.array_equal(a[:, :4], prompt)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < CFG.vocab_size
    # greedy = argmax of the float64 reference at every step (context cropped to block_size)
    g = model.generate(prompt[:1], 20, temperature=0)
    for t in range(4, 24):
        ctx = g[:, max(0, t - CFG.block_size) : t]
        logits, _ = np_gpt2(sd, CFG, ctx)
        assert g[0, t] == logits[0, -1].argmax()
    # top_k=1 is greedy too; bt tensors in -> bt tensor out; (T,) in -> (T + n,) out
    assert np.array_equal(model.generate(prompt[:1], 20, top_k=1, seed=5), g)
    t = model.generate(bt.tensor(prompt[0]), 3, seed=0)
    assert isinstance(t, bt.Tensor) and tuple(t.shape) == (7,)
    # top-k sampling only ever picks among the k most likely tokens
    k = 3
    out = model.generate(prompt[:1], 1, top_k=k, seed=int(rng.integers(1 << 30)))
    logits, _ = np_gpt2(sd, CFG, prompt[:1])
    assert out[0, -1] in np.argsort(logits[0, -1])[-k:]


def test_generate_samples_the_softmax_distribution():
    """With temperature 1, token frequencies follow softmax(logits) (chi-square-like bound)."""
    cfg = GPT2Config(block_size=4, vocab_size=5, n_layer=1, n_head=1, n_embd=4)
    model = GPT2(cfg)
    rng = np.random.default_rng(0)
    randomize(model, rng, std=0.8)
    prompt = np.zeros((2000, 1), np.int64)
    out = model.generate(prompt, 1, seed=7)[:, 1]
    logits = model(prompt[:1])[0].detach().numpy()[0, -1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    freq = np.bincount(out, minlength=5) / len(out)
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / len(out)) + 1e-3)


# -- bad input -------------------------------------------------------------------------------------


def test_bad_input_raises_clear_errors():
    model = GPT2(CFG)
    V, T = CFG.vocab_size, CFG.block_size
    with pytest.raises(
        ValueError,
        match=r"idx holds token id 97 at position \(0, 2\), outside the vocabulary \[0, 97\)",
    ):
        model(np.array([[1, 2, V]]))
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        model(bt.tensor([[1, -2, 3]]))
    with pytest.raises(ValueError, match=r"targets.*outside the vocabulary"):
        model(np.array([[1, 2, 3]]), np.array([[1, 2, 1000]]))
    with pytest.raises(ValueError, match=r"targets.*outside the vocabulary"):
        model(np.array([[1, 2, 3]]), np.array([[1, -5, 1]]))
    with pytest.raises(ValueError, match=r"sequence length 17 is longer than the block size 16"):
        model(np.zeros((1, T + 1), np.int64))
    with pytest.raises(ValueError, match=r"targets have shape"):
        model(np.zeros((2, 4), np.int64), np.zeros((2, 5), np.int64))
    with pytest.raises(TypeError, match="integer token ids"):
        model(np.zeros((1, 4), np.float32))
    with pytest.raises(TypeError, match="integer token ids"):
        model(bt.zeros(1, 4))
    with pytest.raises(ValueError, match=r"\(B, T\) or \(T,\)"):
        model(np.zeros((1, 2, 3), np.int64))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate(np.array([V + 5]), 3)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(np.array([1]), 3, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(np.array([1]), 3, temperature=-1)
    with pytest.raises(TypeError, match="GPT2Config"):
        GPT2({"n_layer": 2})


def test_fused_cpu_head_loss_matches_bt_cross_entropy(rng):
    """The CPU head loss (numpy, see gpt2._HeadCrossEntropyCPU) against bt.cross_entropy:
    value and gradient, with padding columns and ignored rows."""
    from blutrain.models.gpt2 import _HeadCrossEntropyCPU

    N, V, Vp = 37, 301, 384
    x = (rng.standard_normal((N, Vp)) * 3).astype(np.float32)
    t = rng.integers(0, V, N)
    t[[3, 10]] = IGNORE_INDEX
    a = bt.tensor(x, requires_grad=True)
    la = _HeadCrossEntropyCPU.apply(a, bt.tensor(t), V)
    (la * 2.5).backward()
    b = bt.tensor(x[:, :V].copy(), requires_grad=True)
    lb = bt.cross_entropy(b, bt.tensor(t), ignore_index=IGNORE_INDEX)
    (lb * 2.5).backward()
    assert la.dtype == bt.float32 and la.ndim == 0
    assert abs(la.item() - lb.item()) <= 1e-6 * abs(lb.item())
    ga = a.grad.detach().numpy()
    assert not ga[:, V:].any() and not ga[[3, 10]].any()
    np.testing.assert_allclose(ga[:, :V], b.grad.detach().numpy(), rtol=1e-5, atol=1e-8)
    # all targets ignored: nan loss (as PyTorch), zero gradient
    c = bt.tensor(x, requires_grad=True)
    lc = _HeadCrossEntropyCPU.apply(c, bt.tensor(np.full(N, IGNORE_INDEX)), V)
    assert math.isnan(lc.item())
    lc.backward()
    assert not c.grad.detach().numpy().any()


def test_cpu_head_loss_gradient_made_in_forward_is_backwards_own(rng):
    """The forward writes the gradient for an upstream gradient of 1; a backward that cannot use
    it (retain_graph's second, or another upstream gradient) recomputes it: the same bits."""
    from blutrain.models.gpt2 import _HeadCrossEntropyCPU

    N, V, Vp = 70, 301, 384  # 70 rows: several row blocks
    x = (rng.standard_normal((N, Vp)) * 3).astype(np.float32)
    t = rng.integers(0, V, N)
    t[5] = IGNORE_INDEX
    a = bt.tensor(x, requires_grad=True)
    _HeadCrossEntropyCPU.apply(a, bt.tensor(t), V).backward()  # the forward's gradient
    b = bt.tensor(x, requires_grad=True)
    lb = _HeadCrossEntropyCPU.apply(b, bt.tensor(t), V)
    lb.backward(retain_graph=True)
    lb.backward()  # recomputed from the logits, added to the first
    ga, gb = a.grad.detach().numpy(), b.grad.detach().numpy()
    assert np.array_equal(gb, 2 * ga)
    with bt.no_grad():  # no gradient is made without autograd
        c = bt.tensor(x, requires_grad=True)
        assert _HeadCrossEntropyCPU.apply(c, bt.tensor(t), V).item() == lb.item()


def test_backward_twice_with_retain_graph(rng):
    model = GPT2(CFG)
    randomize(model, rng)
    x = rng.integers(0, CFG.vocab_size, (2, 6))
    _, loss = model(x, x)
    loss.backward(retain_graph=True)
    g1 = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.detach().numpy(), 2 * g1[n], rtol=1e-5, atol=1e-7)


def test_to_same_device_and_order():
    m = GPT2(CFG)
    names = [n for n, _ in m.named_parameters()]
    before = m.state_dict()
    assert m.to("cpu") is m
    assert [n for n, _ in m.named_parameters()] == names
    assert all(np.array_equal(before[k], v) for k, v in m.state_dict().items())
    if not bt.cuda_built() or bt.cuda_device_count() == 0:
        with pytest.raises(Exception, match="(?i)cuda"):
            GPT2(CFG, device="cuda")


def test_capture_forward_and_backward(rng):
    """blutrain-compiler captures the model: symbolic ids and targets, then a normal call."""
    cfg = GPT2Config(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=8, vocab_multiple=64)
    model = GPT2(cfg)
    x = rng.integers(0, cfg.vocab_size, (2, 8))
    with bt.capture() as g:
        idx = bt.zeros(2, 8, dtype=bt.int64)
        logits, loss = model(idx, idx)
        loss.backward()
        g.mark_output(loss)
    assert loss.is_symbolic and tuple(logits.shape) == (2, 8, cfg.vocab_size)
    assert len(g.nodes) > 50
    model.zero_grad()
    _, loss = model(x, x)  # no symbolic leftovers (positions cache)
    assert math.isfinite(loss.item())


def _step_op_log(residual: str, layers: int) -> list:
    """The eager op log of one fused bf16 forward + backward (cached casts warmed first)."""
    import collections

    bt.manual_seed(0)
    cfg = GPT2Config(block_size=16, vocab_size=96, n_layer=layers, n_head=1, n_embd=64)
    m = GPT2(cfg, fused=True, residual_dtype=residual, precision="bf16")
    x = bt.tensor(np.arange(32).reshape(2, 16) % 96, dtype=bt.int64)
    m(x, x, return_logits=False)[1].backward()
    m.zero_grad()
    with bt.op_log() as log:
        m(x, x, return_logits=False)[1].backward()
    return collections.Counter(
        (op, tuple(d for d, _ in ins), tuple(d for d, _ in outs)) for op, ins, outs in log
    )


def test_float32_stream_adds_no_ops_per_layer():
    """Issue 38: a layer costs the float32 residual stream the same ops as the bf16 stream's (its
    add_layer_norm reads a float32 x and writes the float32 sum and a bf16 y in one kernel, its
    backward takes the stream's gradient in bf16): no cast of the (B, T, C) stream or of its
    gradient per layer (bt.op_log() of 1 and 2 layers: bt.capture would not do, a captured
    backward keeps the float32 dtype on the stream's gradient edges)."""
    per_layer = {}
    for res in ("compute", "float32"):
        one, two = _step_op_log(res, 1), _step_op_log(res, 2)
        per_layer[res] = two - one
        assert not (one - two), f"{res}: a second layer removed ops {one - two}"
    c, f = per_layer["compute"], per_layer["float32"]
    assert sum(c.values()) == sum(f.values()), f"ops a layer: bf16 stream {c}, float32 stream {f}"
    assert not [k for k in f if k[0] == "astype"], f"float32 stream casts per layer: {f}"
    aln = [k for k in f if k[0] == "add_layer_norm"]
    assert aln and all(k[1][0] == "float32" and k[2][:2] == ("float32", "bfloat16") for k in aln)
    lnb = [k for k in f if k[0] == "layer_norm_backward"]
    # the stream's gradient in bf16: dy bf16 over the float32 sum, dx bf16
    assert lnb and all(k[1][:2] == ("bfloat16", "float32") and k[2][0] == "bfloat16" for k in lnb)


def test_float32_stream_embedding_grad_adds_into_the_heads():
    """Issue 38, Note [tied table gradient]: with the float32 stream the embedding's rows are
    added into the head's float32 dW of the tied table, as with the bf16 stream: the step makes
    no table of zeros and adds no two tables (618 MB a step at GPT-2 124M), and the gradient is
    the one the engine's sum of the two tables gives (forward's order before), to float32
    rounding."""
    bt.manual_seed(0)
    cfg = GPT2Config(
        block_size=16, vocab_size=96, n_layer=1, n_head=1, n_embd=64, vocab_multiple=128
    )
    Vp, C = cfg.padded_vocab_size, cfg.n_embd
    x = bt.tensor(np.arange(32).reshape(2, 16) * 7 % 96, dtype=bt.int64)

    def table_ops(log: list) -> list[str]:  # ops writing a (Vp, C) float32 tensor
        return [e.op for e in log if ("float32", (Vp, C)) in e.outputs]

    for fused in (True, False):
        m = GPT2(cfg, fused=fused, residual_dtype="float32", precision="bf16")
        m(x, x, return_logits=False)[1].backward()  # warm the cached casts
        m.zero_grad()
        with bt.op_log() as log:
            m(x, x, return_logits=False)[1].backward()
        ops = table_ops(log)
        assert ops[-1] == "index_add" and "full" not in ops and "add" not in ops, (fused, ops)
    got = m.transformer.wte.weight.grad.numpy().copy()
    # the head's cast made before the embedding: the engine sums two tables
    m.zero_grad()
    with bt.op_log() as log:
        wte = bt.cached_astype(m.transformer.wte.weight, bt.bfloat16)
        h = m.hidden_states(x)
        logits = bt.linear(h, wte).narrow(-1, 0, 96).float()
        bt.cross_entropy(logits.reshape(32, 96), x.reshape(32)).backward()
    assert {"full", "add"} <= set(table_ops(log)), table_ops(log)
    want = m.transformer.wte.weight.grad.numpy()
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), np.abs(got - want).max()
    assert np.abs(want[:96]).min(axis=1).max() > 0 and not want[96:].any()
