"""Fidelity of blutrain.models' GPT-2 on the GPU against a PyTorch GPT-2 on the same GPU.

GPT-2 124M with the same random weights in both (ours with a padded vocabulary, PyTorch's
unpadded), the same tokens (some targets ignored):
- fp32, TF32 off on both sides: logits and loss to 1e-5 relative; 10 AdamW steps (ours fused)
  give the same losses to 1e-5 relative;
- bf16 (our precision policy: bfloat16 compute, float32 master weights) against torch autocast
  bf16: loss within 2e-2, bf16 logits, float32 loss; at trained-like weights the gradients are
  as close to float64's as autocast's (issue 38: the float32 residual stream);
- recomputation (gelu, attn, block) and the fused ops change no number beyond rounding, in bf16
  with the default float32 residual stream and with the opt-in bf16 one ("bf16/compute").
Skipped where there is no CUDA device (for blutrain.tensor or for torch).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import blutrain.tensor as bt
from blutrain.models import GPT2Config  # noqa: E402
from blutrain.models.gpt2 import GPT2  # noqa: E402
from blutrain.models.optim import AdamW, CosineSchedule  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not bt.cuda_built() or bt.cuda_device_count() == 0, reason="no CUDA device for bt"
    ),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch"),
]

F = torch.nn.functional
CFG = GPT2Config.from_name("gpt2", vocab_multiple=128)  # 124M, vocab padded 50257 -> 50304
SMALL = GPT2Config(block_size=64, vocab_size=1000, n_layer=3, n_head=4, n_embd=128)
B, T = 4, 256


# -- the PyTorch reference (fp32 weights, HF's GPT-2 math, unpadded vocabulary) --------------


class TorchBlock(torch.nn.Module):
    def __init__(self, C: int, H: int, eps: float) -> None:
        super().__init__()
        self.H = H
        self.ln_1 = torch.nn.LayerNorm(C, eps=eps)
        self.c_attn = torch.nn.Linear(C, 3 * C)
        self.attn_proj = torch.nn.Linear(C, C)
        self.ln_2 = torch.nn.LayerNorm(C, eps=eps)
        self.c_fc = torch.nn.Linear(C, 4 * C)
        self.mlp_proj = torch.nn.Linear(4 * C, C)
        self.sdpa = False  # F.scaled_dot_product_attention (nanoGPT's), else the explicit softmax

    def forward(self, x):
        Bx, Tx, C = x.shape
        H, D = self.H, C // self.H
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(Bx, Tx, H, D).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(Bx, Tx, C)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
            mask = torch.ones(Tx, Tx, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(Bx, Tx, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT2(torch.nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        C = cfg.n_embd
        self.wte = torch.nn.Embedding(cfg.vocab_size, C)
        self.wpe = torch.nn.Embedding(cfg.block_size, C)
        self.h = torch.nn.ModuleList(
            TorchBlock(C, cfg.n_head, cfg.layer_norm_epsilon) for _ in range(cfg.n_layer)
        )
        self.ln_f = torch.nn.LayerNorm(C, eps=cfg.layer_norm_epsilon)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1
        )
        return logits, loss

    def canonical(self):
        out = [
            ("transformer.wte.weight", self.wte.weight),
            ("transformer.wpe.weight", self.wpe.weight),
        ]
        for i, b in enumerate(self.h):
            p = f"transformer.h.{i}."
            for ours, mod in (
                ("ln_1", b.ln_1),
                ("attn.c_attn", b.c_attn),
                ("attn.c_proj", b.attn_proj),
                ("ln_2", b.ln_2),
                ("mlp.c_fc", b.c_fc),
                ("mlp.c_proj", b.mlp_proj),
            ):
                out += [(p + ours + ".weight", mod.weight), (p + ours + ".bias", mod.bias)]
        out += [
            ("transformer.ln_f.weight", self.ln_f.weight),
            ("transformer.ln_f.bias", self.ln_f.bias),
        ]
        return out


# -- helpers ---------------------------------------------------------------------------------


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_weights(cfg: GPT2Config, seed: int) -> dict[str, np.ndarray]:
    """GPT-2-like random weights, canonical names, unpadded wte."""
    rng = np.random.default_rng(seed)
    w = {}
    for k, s in cfg.param_shapes(padded=False).items():
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            a = 1.0 + 0.1 * rng.standard_normal(s, dtype=np.float32)
        elif k.endswith("bias"):
            a = 0.02 * rng.standard_normal(s, dtype=np.float32)
        else:
            a = 0.02 * rng.standard_normal(s, dtype=np.float32)
        w[k] = a.astype(np.float32)
    return w


def both(cfg: GPT2Config, weights, **kw):
    ours = GPT2(cfg, device="cuda", init=False, **kw)
    ours.load_state_dict(weights)
    ref = TorchGPT2(cfg).cuda()
    with torch.no_grad():
        for name, p in ref.canonical():
            p.copy_(torch.from_numpy(weights[name]))
    return ours, ref


def tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    bt.set_float32_matmul_precision("high" if on else "highest")


def batch(cfg: GPT2Config, seed: int, Bn: int = B, Tn: int = T):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab_size, (Bn, Tn))
    y = rng.integers(0, cfg.vocab_size, (Bn, Tn))
    y[0, :7] = -1  # ignored targets
    return x, y


def to_np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


@pytest.fixture(scope="module")
def weights124m():
    return random_weights(CFG, 1234)


@pytest.fixture(autouse=True)
def no_tf32():
    tf32(False)
    yield
    tf32(False)


# -- tests ---------------------------------------------------------------------------------------


def test_fp32_logits_and_loss_match_torch(weights124m):
    ours, ref = both(CFG, weights124m, precision="fp32")
    x, y = batch(CFG, 1)
    logits, loss = ours(x, y)
    with torch.no_grad():
        rl, rloss = ref(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda())
    assert tuple(logits.shape) == (B, T, CFG.vocab_size) and logits.dtype == bt.float32
    e_logits = rel_err(to_np(logits), rl.cpu().numpy())
    e_loss = abs(loss.item() - rloss.item()) / abs(rloss.item())
    print(f"124M fp32: logits rel err {e_logits:.2e}, loss rel err {e_loss:.2e}")
    assert e_logits < 1e-5
    assert e_loss < 1e-5


def test_fp32_ten_adamw_steps_match_torch(weights124m):
    ours, ref = both(CFG, weights124m, precision="fp32")
    lr, wd, steps = 6e-4, 0.1, 10
    sched = CosineSchedule(lr, warmup_steps=3, max_steps=steps, min_lr=lr / 10)
    opt = AdamW(
        ours.named_parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, fused=True
    )
    named = ref.canonical()
    ropt = torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    x, y = batch(CFG, 2)
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    xb, yb = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
    params = list(ours.parameters())
    losses, rlosses = [], []
    for s in range(steps):
        opt.set_lr(sched(s))
        for g in ropt.param_groups:
            g["lr"] = sched(s)
        _, loss = ours(xb, yb)
        loss.backward()
        bt.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        _, rloss = ref(xt, yt)
        rloss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
        losses.append(loss.detach())
        rlosses.append(rloss.item())
    losses = [float(v.item()) for v in losses]
    errs = [abs(a - b) / abs(b) for a, b in zip(losses, rlosses, strict=True)]
    print("ours ", np.round(losses, 6).tolist())
    print("torch", np.round(rlosses, 6).tolist())
    print(f"max loss rel err over {steps} steps: {max(errs):.2e}")
    assert losses[-1] < losses[0] - 0.05
    assert max(errs) < 1e-5


def test_bf16_policy_matches_torch_autocast(weights124m):
    ours, ref = both(CFG, weights124m, precision="bf16")
    x, y = batch(CFG, 3)
    logits, loss = ours(x, y)
    assert logits.dtype == bt.bfloat16, "bf16 logits (no float32 logits are made)"
    assert loss.dtype == bt.float32
    params = dict(ours.named_parameters())
    assert all(p.dtype == bt.float32 for p in params.values()), "float32 master weights"
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        _, rloss = ref(xt, yt)
    with torch.no_grad():
        _, rloss32 = ref(xt, yt)
    e = abs(loss.item() - rloss.item()) / abs(rloss.item())
    e32 = abs(loss.item() - rloss32.item()) / abs(rloss32.item())
    print(
        f"bf16 loss {loss.item():.5f}, torch autocast {rloss.item():.5f} (rel {e:.2e}), "
        f"torch fp32 {rloss32.item():.5f} (rel {e32:.2e})"
    )
    assert e < 2e-2 and e32 < 2e-2
    loss.backward()  # gradients reach the float32 masters
    g = params["transformer.h.0.mlp.c_fc.weight"].grad
    assert g is not None and g.dtype == bt.float32
    assert np.isfinite(to_np(g)).all() and np.abs(to_np(g)).max() > 0


def trained_like(cfg: GPT2Config, seed: int) -> dict[str, np.ndarray]:
    """Random weights shaped like a trained GPT-2's where it matters for bf16: layer-norm weights
    spread around 1 (not bf16 values), embeddings larger than the branches' outputs."""
    rng = np.random.default_rng(seed)
    L, w = cfg.n_layer, {}
    for k, s in cfg.param_shapes(padded=False).items():
        if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            a = 1 + 0.3 * rng.uniform(-1, 1, s)
        elif k.endswith("bias"):
            a = 0.02 * rng.standard_normal(s)
        elif k.endswith(("wte.weight", "wpe.weight")):
            a = 0.1 * rng.standard_normal(s)
        elif k.endswith("c_proj.weight"):
            a = 0.02 / math.sqrt(2 * L) * rng.standard_normal(s)
        else:
            a = 0.06 * rng.standard_normal(s)
        w[k] = a.astype(np.float32)
    return w


def bf16_gradients(residual: str = "float32", grad: str = "compute") -> tuple[dict, dict, dict]:
    """GPT-2 124M's gradients at trained-like weights on one batch: PyTorch float64, autocast
    bf16 and ours bf16 (residual_dtype residual, residual_grad_dtype grad)."""
    w = trained_like(CFG, 77)
    x, y = batch(CFG, 11)
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()

    def torch_grads(dtype, autocast):
        ref = TorchGPT2(CFG).cuda().to(dtype)
        for b in ref.h:  # nanoGPT's attention, as the PyTorch runs
            b.sdpa = True
        with torch.no_grad():
            for name, p in ref.canonical():
                p.copy_(torch.from_numpy(w[name]).to(dtype))
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            ref(xt, yt)[1].backward()
        return {n: p.grad.double().cpu().numpy() for n, p in ref.canonical()}

    ref64 = torch_grads(torch.float64, False)
    auto = torch_grads(torch.float32, True)
    ours = GPT2(CFG, device="cuda", init=False, precision="bf16", residual_dtype=residual)
    ours.residual_grad_dtype = grad
    ours.load_state_dict(w)
    _, loss = ours(x, y, return_logits=False)
    loss.backward()
    grads = {n: to_np(p.grad).astype(np.float64) for n, p in ours.named_parameters()}
    grads["transformer.wte.weight"] = grads["transformer.wte.weight"][: CFG.vocab_size]
    return ref64, auto, grads


@pytest.mark.parametrize("residual", ["float32", "compute"])
def test_bf16_gradients_as_close_to_float64_as_autocast(residual):
    """Issue 38 on the GPU path (fused kernels: bt.add_layer_norm on a float32 stream, its bf16
    output into the GEMMs): GPT-2 124M's gradient error against PyTorch float64 is autocast's
    (within 1.1x); the bf16 stream ("compute", kept as an option) is measurably worse."""
    ref64, auto, grads = bf16_gradients(residual)
    e_torch, e_ours = grad_error(auto, ref64), grad_error(grads, ref64)
    print(
        f"124M bf16 ({residual} stream): gradient error vs float64 {e_ours:.3e}, autocast "
        f"{e_torch:.3e} ({e_ours / e_torch:.2f}x)"
    )
    if residual == "float32":
        assert e_ours <= 1.1 * e_torch
    else:  # the setting tells the two streams apart (else it could not catch the regression)
        assert e_ours > 1.15 * e_torch


@pytest.mark.parametrize("grad", ["compute", "float32"])
def test_bf16_gradients_per_layer_as_close_as_autocast(grad):
    """Issue 38 per layer (a model-wide error can hide a layer): every block's gradient error
    against float64, and the embeddings' and ln_f's, at or under autocast's, with the float32
    stream's gradient carried in bf16 (the default) or float32. At 124M the bf16 gradient's
    roundings are small next to the rest (CPU, trained-like weights, B2 x T64: 0.93x autocast's
    at layer 0, 0.88x at the top; float32 0.89x / 0.88x); on a narrow deep model they are not
    (tests/test_models_fidelity.py: 12 layers of C=192, 1.23-1.34x at layer 0)."""
    ref64, auto, grads = bf16_gradients("float32", grad)
    groups = [[k for k in ref64 if f".h.{i}." in k] for i in range(CFG.n_layer)]
    groups.append([k for k in ref64 if ".h." not in k])  # embeddings and ln_f
    ratio = [
        grad_error({k: grads[k] for k in g}, {k: ref64[k] for k in g})
        / grad_error({k: auto[k] for k in g}, {k: ref64[k] for k in g})
        for g in groups
    ]
    print(
        f"124M bf16, {grad} stream gradient, per layer over autocast's: "
        + " ".join(f"{r:.2f}" for r in ratio)
    )
    assert max(ratio) <= 1.05, ratio


def test_float32_stream_tied_table_gradient_on_cuda():
    """Issue 38, Note [tied table gradient] on CUDA: the float32 stream's fused step adds the
    embedding's rows into the head's float32 dW (CUDA's index_add into the offered table): no
    (Vp, C) zeros and no add of two tables in the op log; the wte gradient is the CPU's within
    bf16 noise (the CPU path is checked against the two-table sum by
    test_float32_stream_embedding_grad_adds_into_the_heads)."""
    cfg = GPT2Config(block_size=64, vocab_size=1000, n_layer=2, n_head=4, n_embd=128)
    Vp, C = cfg.padded_vocab_size, cfg.n_embd
    w = random_weights(cfg, 5)
    x, y = batch(cfg, 6, 4, 64)
    grads = {}
    for dev in ("cuda", "cpu"):
        m = GPT2(cfg, device=dev, init=False, precision="bf16", residual_dtype="float32",
                 fused=True)  # fmt: skip
        m.load_state_dict(w)
        m(x, y, return_logits=False)[1].backward()  # warm the cached casts
        m.zero_grad()
        # (the CPU's fused attention: float32 scores, as CUDA's kernels)
        with bt.backends.use_flash_attention_cpu(True), bt.op_log() as log:
            m(x, y, return_logits=False)[1].backward()
        ops = [e.op for e in log if ("float32", (Vp, C)) in e.outputs]
        assert ops and ops[-1] == "index_add" and "full" not in ops and "add" not in ops, ops
        grads[dev] = to_np(m.transformer.wte.weight.grad)
    err = np.linalg.norm(grads["cuda"] - grads["cpu"]) / np.linalg.norm(grads["cpu"])
    assert err < 2e-2, err


def grad_error(grads: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """Model-wide ||g - ref|| / ||ref|| over every parameter."""
    num = sum(float(((grads[k] - v) ** 2).sum()) for k, v in ref.items())
    return math.sqrt(num / sum(float((v**2).sum()) for v in ref.values()))


def precision_and_stream(spec: str) -> tuple[str, str]:
    """bf16/compute -> ("bf16", "compute"); a plain precision takes the default stream."""
    precision, _, residual = spec.partition("/")
    return precision, residual or "float32"


# bf16 with the default float32 residual stream, and with the opt-in bf16 stream
PRECISION_STREAMS = ["fp32", "bf16", "bf16/compute"]


@pytest.mark.parametrize("spec", PRECISION_STREAMS)
@pytest.mark.parametrize("recompute", ["gelu", "ln", "ln+gelu", "attn", "block"])
def test_recompute_changes_nothing(spec, recompute):
    precision, residual = precision_and_stream(spec)
    w = random_weights(SMALL, 7)
    x, y = batch(SMALL, 4, 3, SMALL.block_size)
    res = {}
    for mode in ("none", recompute):
        m = GPT2(
            SMALL,
            device="cuda",
            init=False,
            precision=precision,
            recompute=mode,
            residual_dtype=residual,
        )
        m.load_state_dict(w)
        _, loss = m(x, y)
        loss.backward()
        res[mode] = (loss.item(), {n: to_np(p.grad) for n, p in m.named_parameters()})
    tol = 1e-5 if precision == "fp32" else 1e-2
    assert abs(res["none"][0] - res[recompute][0]) <= tol * abs(res["none"][0])
    for n, g in res["none"][1].items():
        assert rel_err(res[recompute][1][n], g) < 10 * tol, n


@pytest.mark.parametrize("spec", PRECISION_STREAMS)
def test_fused_ops_change_nothing(spec):
    precision, residual = precision_and_stream(spec)
    w = random_weights(SMALL, 8)
    x, y = batch(SMALL, 5, 3, SMALL.block_size)
    res = {}
    for fused in (False, True):
        m = GPT2(
            SMALL,
            device="cuda",
            init=False,
            precision=precision,
            fused=fused,
            residual_dtype=residual,
        )
        m.load_state_dict(w)
        logits, loss = m(x, y)
        loss.backward()
        res[fused] = (to_np(logits), {n: to_np(p.grad) for n, p in m.named_parameters()})
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert rel_err(res[True][0], res[False][0]) < tol
    for n, g in res[False][1].items():
        assert rel_err(res[True][1][n], g) < 10 * tol, n


def test_cpu_and_gpu_models_agree():
    """Same weights on both devices: the GPU model (fused ops on) matches the CPU one."""
    w = random_weights(SMALL, 9)
    x, y = batch(SMALL, 6, 2, SMALL.block_size)
    cpu = GPT2(SMALL, init=False)
    cpu.load_state_dict(w)
    gpu = GPT2(SMALL, device="cuda", init=False, precision="fp32")
    gpu.load_state_dict(w)
    lc, sc = cpu(x, y)
    lg, sg = gpu(x, y)
    assert rel_err(to_np(lg), to_np(lc)) < 1e-5
    assert abs(sg.item() - sc.item()) < 1e-5 * abs(sc.item())
    out_c = cpu.generate(np.array([1, 2, 3]), 8, temperature=0)
    out_g = gpu.generate(np.array([1, 2, 3]), 8, temperature=0)
    assert np.array_equal(out_c, out_g)
