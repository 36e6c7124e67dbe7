"""The LLaMA-style model against a PyTorch LLaMA written here (fp32, CPU), its config and presets,
and its training step captured and replayed bit for bit.

The reference follows Hugging Face's LlamaForCausalLM: RMSNorm (float32 statistics), rotary
embedding in the rotate-half form, grouped-query attention, SwiGLU, no biases, untied head.
Same weights, same tokens: logits, loss and every parameter's gradient agree to 1e-5
(normwise relative error: max |ours - torch| / max |torch| per tensor).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import blutrain.tensor as bt
from blutrain.models import Llama, LlamaConfig
from blutrain.models.config import model_config

F = torch.nn.functional
TOL = 1e-5


# -- the PyTorch reference -----------------------------------------------------------------------


def t_rmsnorm(x, w, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + eps))


def t_rotary(cfg: LlamaConfig, T: int):
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def t_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def t_forward(cfg: LlamaConfig, P: dict[str, torch.Tensor], idx, targets):
    B, T = idx.shape
    H, KV, D, C = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd
    cos, sin = t_rotary(cfg, T)
    x = F.embedding(idx, P["model.embed_tokens.weight"])
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        h = t_rmsnorm(x, P[p + "input_layernorm.weight"], cfg.norm_eps)
        q = (h @ P[p + "self_attn.q_proj.weight"].T).view(B, T, H, D).transpose(1, 2)
        k = (h @ P[p + "self_attn.k_proj.weight"].T).view(B, T, KV, D).transpose(1, 2)
        v = (h @ P[p + "self_attn.v_proj.weight"].T).view(B, T, KV, D).transpose(1, 2)
        q = q * cos + t_rotate_half(q) * sin
        k = k * cos + t_rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ P[p + "self_attn.o_proj.weight"].T
        h = t_rmsnorm(x, P[p + "post_attention_layernorm.weight"], cfg.norm_eps)
        g = h @ P[p + "mlp.gate_proj.weight"].T
        u = h @ P[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T
    x = t_rmsnorm(x, P["model.norm.weight"], cfg.norm_eps)
    logits = (x @ P["lm_head.weight"].T)[..., : cfg.vocab_size]
    loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1), ignore_index=-1)
    return logits, loss


# -- helpers -------------------------------------------------------------------------------------


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_weights(cfg: LlamaConfig, rng: np.random.Generator, std: float) -> dict[str, np.ndarray]:
    w = {}
    for k, s in cfg.param_shapes().items():
        a = rng.standard_normal(s) * std
        if k.endswith("norm.weight"):
            a = 1.0 + 0.1 * rng.standard_normal(s)
        w[k] = a.astype(np.float32)
    V = cfg.vocab_size
    w["model.embed_tokens.weight"][V:] = 0
    w["lm_head.weight"][V:] = 0
    return w


CONFIGS = {
    "mha": LlamaConfig(block_size=32, vocab_size=317, n_layer=2, n_head=4, n_kv_head=4,
                       n_embd=32, intermediate_size=88),
    "gqa-padded": LlamaConfig(block_size=32, vocab_size=317, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=32, intermediate_size=96, vocab_multiple=64,
                              rope_theta=500000.0, norm_eps=1e-6),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("std", [0.02, 0.3])
def test_forward_and_backward_match_pytorch(name, std, rng):
    torch.set_num_threads(2)
    cfg = CONFIGS[name]
    weights = random_weights(cfg, rng, std)
    ours = Llama(cfg, init=False)
    ours.load_state_dict(weights)
    P = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in weights.items()}
    B, T = 3, cfg.block_size
    x = rng.integers(0, cfg.vocab_size, (B, T))
    y = rng.integers(0, cfg.vocab_size, (B, T))
    y[0, :5] = -1  # ignored targets
    logits, loss = ours(x, y)
    loss.backward()
    rlogits, rloss = t_forward(cfg, P, torch.from_numpy(x), torch.from_numpy(y))
    rloss.backward()
    assert tuple(logits.shape) == (B, T, cfg.vocab_size)
    errs = {
        "logits": rel_err(logits.detach().numpy(), rlogits.detach().numpy()),
        "loss": abs(loss.item() - rloss.item()) / abs(rloss.item()),
    }
    own = dict(ours.named_parameters())
    for k, p in P.items():
        errs[k] = rel_err(own[k].grad.numpy(), p.grad.numpy())
    worst = max(errs, key=errs.get)
    print(f"{name} std={std}: worst relative error {errs[worst]:.2e} ({worst})")
    assert errs[worst] <= TOL, {k: f"{v:.2e}" for k, v in errs.items() if v > TOL}
    # the padding rows of the embedding and the head get no gradient
    V = cfg.vocab_size
    assert not own["lm_head.weight"].grad.numpy()[V:].any()


def test_bf16_policy_runs_and_stays_close():
    cfg = CONFIGS["mha"]
    rng = np.random.default_rng(0)
    weights = random_weights(cfg, rng, 0.02)
    x = rng.integers(0, cfg.vocab_size, (2, 16))
    full = Llama(cfg, init=False)
    full.load_state_dict(weights)
    half = Llama(cfg, init=False, precision=bt.amp.Policy(compute=bt.bfloat16, param=bt.float32))
    half.load_state_dict(weights)
    lf, loss_f = full(x, x)
    lh, loss_h = half(x, x)
    assert lh.dtype == bt.bfloat16 and loss_h.dtype == bt.float32
    assert abs(loss_h.item() - loss_f.item()) < 2e-2
    loss_h.backward()
    assert all(p.grad is not None and p.grad.dtype == bt.float32 for p in half.parameters())


# -- config ----------------------------------------------------------------------------------------


def test_presets_and_json():
    small = LlamaConfig.from_name("llama-small")
    assert (small.n_layer, small.n_head, small.n_embd, small.intermediate_size) == (
        12, 12, 768, 2048,
    )  # fmt: skip
    # GPT-2 124M's body (85M besides embeddings), an untied 50257 x 768 embedding and head
    body = 12 * (4 * 768**2 + 3 * 768 * 2048) + 25 * 768  # 25 norms of 768
    assert small.n_params(non_embedding=True) - 50257 * 768 == body
    tiny = model_config("llama-tiny", vocab_multiple=128)
    assert isinstance(tiny, LlamaConfig) and tiny.padded_vocab_size % 128 == 0
    assert LlamaConfig.from_json(tiny.to_json()) == tiny
    assert json_kind(tiny.to_json()) == "llama"
    with pytest.raises(ValueError, match=r"\[LlamaConfig\] unknown model 'llama-huge'"):
        LlamaConfig.from_name("llama-huge")
    with pytest.raises(ValueError, match=r"n_head \(6\) must be a multiple of n_kv_head \(4\)"):
        LlamaConfig(n_head=6, n_kv_head=4, n_embd=48)
    with pytest.raises(ValueError, match=r"recompute 'ln'"):
        Llama(CONFIGS["mha"], recompute="ln")


def json_kind(text: str) -> str:
    import json

    return json.loads(text)["model_type"]


def test_model_config_reads_llama_json_files(tmp_path):
    p = tmp_path / "m.json"
    CONFIGS["gqa-padded"].to_json(p)
    assert model_config(str(p)) == CONFIGS["gqa-padded"]


def test_recompute_gives_the_same_gradients():
    """bt.checkpoint recomputes the same forward; only the order in which the residual stream's
    gradient contributions are summed may differ (float rounding)."""
    cfg = CONFIGS["gqa-padded"]
    weights = random_weights(cfg, np.random.default_rng(1), 0.1)
    x = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 16))
    grads = {}
    for spec in ("none", "attn", "block"):
        m = Llama(cfg, init=False, recompute=spec)
        m.load_state_dict(weights)
        m(x, x)[1].backward()
        assert m.recompute == spec
        grads[spec] = [p.grad.numpy() for p in m.parameters()]
    for spec in ("attn", "block"):
        for a, b in zip(grads[spec], grads["none"]):
            assert rel_err(a, b) < 1e-6


# -- capture ---------------------------------------------------------------------------------------


def test_llama_training_step_replays_bitwise():
    from test_models_capture import train_eager_and_replayed

    def make():
        return Llama(LlamaConfig.from_name("llama-tiny", vocab_size=300, n_layer=2, n_kv_head=2))

    eager, replay, graph = train_eager_and_replayed(make, vocab=300)
    for s, (e, r) in enumerate(zip(eager, replay)):
        diff = [i for i, (a, b) in enumerate(zip(e, r)) if a != b]
        assert not diff, f"step {s}: {len(diff)} of {len(e)} tensors differ"
    ops = {n["op"] for n in graph.nodes}
    assert {"rsqrt", "sigmoid", "cat", "adamw_"} <= ops  # RMSNorm, SwiGLU, rotary, the update
    assert not ops & {"layer_norm", "linear_gelu_linear", "add_layer_norm"}


# -- training: the trainer, the CLI, checkpoints ---------------------------------------------------

SMALL = LlamaConfig(
    block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=48
)  # fmt: skip  (GPT-2's vocabulary: the data's)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from blutrain.models import prepare
    from blutrain.models.tokenizer import SHAKESPEARE_FILE

    d = tmp_path_factory.mktemp("shards")
    text = d / "shakespeare.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:60_000])
    prepare([text], d / "shards", val_fraction=0.1, doc_split="paragraph")
    return d / "shards"


def _train_flags(model: str, data_dir, out, steps: int) -> list[str]:
    return [
        "train", "--model", model, "--data", str(data_dir), "--batch-size", "2",
        "--seq-len", "16", "--max-steps", str(steps), "--warmup-steps", "1",
        "--eval-interval", "0", "--sample-interval", "0", "--out-dir", str(out),
        "--no-progress", "--no-plot", "--threads", "0",
    ]  # fmt: skip


def test_train_resume_sample_and_eval_a_llama(tmp_path, data_dir, capsys):
    """`blutrain train --model <llama json>`: 2 steps, resumed to 4, equal bit for bit to 4
    straight; sample and eval load the checkpoint as a Llama."""
    from blutrain.models import cli, load_checkpoint
    from blutrain.models.zoo import model_from_checkpoint

    model = tmp_path / "llama.json"
    SMALL.to_json(model)
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(_train_flags(str(model), data_dir, a, 4)) == 0
    from blutrain.models.train_config import TrainConfig
    from blutrain.models.trainer import Trainer

    cfg = TrainConfig(model=str(model), data=str(data_dir), batch_size=2, seq_len=16,
                      max_steps=4, warmup_steps=1, eval_interval=0, sample_interval=0,
                      out_dir=str(b), progress=False, plot=False, log_interval=0)  # fmt: skip
    Trainer(cfg).fit(until=2)
    assert Trainer(dataclasses.replace(cfg, resume=True)).fit()["steps"] == 4
    ca, cb = load_checkpoint(a / "checkpoint"), load_checkpoint(b / "checkpoint")
    assert ca.trainer["model_config"]["model_type"] == "llama" and ca.trainer["step"] == 4
    for part in ("weights", "optimizer"):
        ta, tb = getattr(ca, part), getattr(cb, part)
        assert ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta), part
    assert set(ca.weights) == set(SMALL.param_shapes())
    m = model_from_checkpoint(a)
    assert isinstance(m, Llama) and m.config.vocab_multiple == 128
    capsys.readouterr()
    argv = ["sample", "--checkpoint", str(a), "--prompt", "ROMEO:", "-n", "4", "--seed", "1"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    argv = ["eval", "--checkpoint", str(a), "--data", str(data_dir), "--batch-size", "2",
            "--seq-len", "16", "--batches", "2"]  # fmt: skip
    assert cli.main(argv) == 0


def test_llama_run_with_the_old_residual_default_resumes(
    tmp_path, data_dir, capsys, rewrite_trainer_json
):
    """A LLaMA run takes the default residual_dtype (float32, unused: its stream is in the
    compute dtype). One saved when the default was "compute" stored that value; the CLI resume
    keeps a run's settings, yet must not refuse it as a non-default (Note [settings of older
    runs]): it resumes, and the run's record then holds today's default."""
    from blutrain.models import cli, load_checkpoint

    model = tmp_path / "llama.json"
    SMALL.to_json(model)
    out = tmp_path / "run"
    assert cli.main(_train_flags(str(model), data_dir, out, 3)) == 0
    ck = out / "checkpoint"
    assert load_checkpoint(ck).trainer["train_config"]["residual_dtype"] == "float32"
    rewrite_trainer_json(ck, lambda t: t["train_config"].update(residual_dtype="compute"))
    capsys.readouterr()
    # (resumed and extended to 4 steps: the flags given again are the run's own)
    assert cli.main(_train_flags(str(model), data_dir, out, 4) + ["--resume"]) == 0, (
        capsys.readouterr().err
    )
    tr = load_checkpoint(ck).trainer
    assert tr["step"] == 4 and tr["train_config"]["residual_dtype"] == "float32"


def test_llama_run_errors(tmp_path, data_dir, capsys):
    from blutrain.models import cli

    flags = _train_flags("llama-tiny", data_dir, tmp_path / "x", 2)
    assert cli.main(flags + ["--recompute", "ln"]) == 2
    assert "a LLaMA model takes auto, none, attn, block" in capsys.readouterr().err
    assert cli.main(flags + ["--init-from", str(tmp_path)]) == 2
    assert "starts from scratch" in capsys.readouterr().err
    # residual_dtype is GPT-2's: a LLaMA run takes its default (float32) and refuses another
    assert cli.main(flags + ["--residual-dtype", "compute"]) == 2
    err = capsys.readouterr().err
    assert "residual_dtype (--residual-dtype) 'compute': GPT-2 models only" in err, err
    # a GPT-2 run cannot resume from a LLaMA checkpoint
    model = tmp_path / "llama.json"
    SMALL.to_json(model)
    assert cli.main(_train_flags(str(model), data_dir, tmp_path / "r", 1)) == 0
    capsys.readouterr()
    gpt = tmp_path / "gpt.json"
    from blutrain.models import GPT2Config

    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16).to_json(gpt)
    assert cli.main(_train_flags(str(gpt), data_dir, tmp_path / "r", 2) + ["--resume"]) == 2
    assert "holds a LlamaConfig model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
