"""GPT-2's GPU-oriented options, checked on the CPU: recomputation, fused ops, precision
policies, and the trainer's deferred (sync-free) steps; tests/test_models_gpu_fidelity.py checks
them on a GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models import GPT2Config, load_checkpoint, prepare
from blutrain.models.device import peak_flops
from blutrain.models.gpt2 import GPT2, precision_name
from blutrain.models.tokenizer import SHAKESPEARE_FILE
from blutrain.models.train_config import TrainConfig
from blutrain.models.trainer import Trainer

CFG = GPT2Config(block_size=16, vocab_size=97, n_layer=2, n_head=2, n_embd=16, vocab_multiple=32)


def run(model, x, y):
    model.zero_grad()
    logits, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    return logits.detach().numpy(), float(loss.item()), grads


def twin(rng, **kw):
    a = GPT2(CFG)
    sd = {
        k: rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in a.state_dict().items()
    }
    sd["transformer.wte.weight"][CFG.vocab_size :] = 0
    a.load_state_dict(sd)
    b = GPT2(CFG, **kw)
    b.load_state_dict(sd)
    return a, b


def assert_same_numbers(a, b, x):
    """Models a and b give the same logits and loss (1e-5) and gradients (1e-4) on batch x."""
    la, sa, ga = run(a, x, x)
    lb, sb, gb = run(b, x, x)
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
    assert sb == pytest.approx(sa, rel=1e-5)
    for n in ga:
        np.testing.assert_allclose(gb[n], ga[n], rtol=1e-4, atol=1e-5, err_msg=n)


@pytest.mark.parametrize("fused", [None, True])
@pytest.mark.parametrize("mode", ["gelu", "ln", "attn", "block", "ln+gelu", "ln+attn"])
def test_recompute_gives_the_same_numbers(rng, mode, fused):
    a, b = twin(rng, recompute=mode, fused=fused)
    assert b.recompute == mode
    x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    assert_same_numbers(a, b, x)


@pytest.mark.parametrize("fused", [None, True])
def test_ln_recompute_is_bitwise(rng, fused):
    """The LayerNorm outputs are rebuilt by the same kernels: the same bits as keeping them."""
    _, a = twin(rng, fused=fused)
    b = GPT2(CFG, fused=fused, recompute="ln")
    b.load_state_dict(a.state_dict())
    x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    la, sa, ga = run(a, x, x)
    lb, sb, gb = run(b, x, x)
    assert np.array_equal(la, lb) and sa == sb
    for n in ga:
        assert np.array_equal(ga[n], gb[n]), n


@pytest.mark.parametrize(
    "layers", [("block", "ln+gelu"), ("ln+gelu", "block"), ("attn", "ln"), ("none", "gelu")]
)
def test_recompute_per_layer(rng, layers):
    a, b = twin(rng, fused=True)
    for i, m in enumerate(layers):
        assert b.set_recompute(m, layers=[i]) is b
    assert b.transformer.h[1].recompute == frozenset(layers[1].split("+")) - {"none"}
    assert b.recompute == "per-layer: " + ", ".join(layers)
    x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    assert_same_numbers(a, b, x)
    b.recompute = "gelu"  # the model-wide setter reaches every block
    assert b.recompute == "gelu" and all(blk.mlp.recompute_gelu for blk in b.transformer.h)


def test_recompute_specs():
    m = GPT2(CFG, recompute="gelu+ln")
    assert m.recompute == "ln+gelu"  # canonical order
    assert GPT2(CFG, recompute="ln, gelu").recompute == "ln+gelu"
    with pytest.raises(ValueError, match="recompute 'ln\\+foo' is not one of"):
        GPT2(CFG, recompute="ln+foo")
    with pytest.raises(ValueError, match="'block' already recomputes the whole block"):
        m.set_recompute("block+ln")
    with pytest.raises(IndexError, match="layer 5 out of range"):
        m.set_recompute("ln", layers=[5])
    with pytest.raises(ValueError, match="TrainConfig"):
        TrainConfig(recompute="gelu+all")
    TrainConfig(recompute="ln+gelu")


def test_fused_ops_give_the_same_numbers(rng):
    a, b = twin(rng, fused=True)
    x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    assert_same_numbers(a, b, x)


def test_fused_qkv_attention_gives_the_same_numbers(rng):
    # with the CPU's flash kernels on, the fused model's attention sublayers run bt.qkv_attention
    # (one node; the qkv bias gradient from the packed backward) against linear + sdpa
    with bt.backends.use_flash_attention_cpu(True):
        a, b = twin(rng, fused=True)
        a.fused = False
        x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
        assert_same_numbers(a, b, x)
        assert all(blk.attn.fused for blk in b.transformer.h)
        assert not any(blk.attn.fused for blk in a.transformer.h)


def test_fused_classifier_gives_the_same_numbers(rng):
    # return_logits=False with fused=True: the head and loss as bt.linear_cross_entropy in row
    # chunks (ignored targets, a padded vocabulary), against the plain model's logits path
    a, b = twin(rng, fused=True)
    b.classifier_chunk_size = 5
    x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    y = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    y[0, :3] = -1
    _, sa, ga = run(a, x, y)
    b.zero_grad()
    logits, loss = b(x, y, return_logits=False)
    assert logits is None
    loss.backward()
    assert float(loss.item()) == pytest.approx(sa, rel=1e-5)
    for n, p in b.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), ga[n], rtol=1e-4, atol=1e-5, err_msg=n)
    with pytest.raises(ValueError, match="return_logits=False needs targets"):
        b(x, return_logits=False)


def test_precision_names_and_policies():
    assert precision_name("float32") == "fp32" and precision_name("BF16") == "bf16"
    with pytest.raises(ValueError, match="not one of fp32, tf32, bf16"):
        precision_name("fp8")
    with pytest.raises(ValueError, match="recompute 'all'"):
        GPT2(CFG, recompute="all")
    m = GPT2(CFG)
    assert m.set_precision("tf32") is m and m._compute is None  # tf32: float32 compute

    class Policy:  # the shape of bt.amp.Policy
        compute = bt.bfloat16
        param = bt.bfloat16

    with pytest.raises(ValueError, match="kept in float32"):
        m.set_precision(Policy())
    Policy.param = bt.float32
    m.transformer.h[1].set_precision(Policy())  # one block only
    assert m.transformer.h[1].attn._compute == bt.bfloat16
    assert m.transformer.h[0]._compute is None and m._compute is None
    m.set_precision("fp32")
    assert all(getattr(x, "_compute", None) is None for x in m.modules())


def _stream_dtypes(model, x) -> dict[str, int]:
    """The dtypes the residual stream is written in by one forward: every add (the embeddings'
    sum, unfused x + branch) and every fused add + LayerNorm's sum of (B, T, C)."""
    B, T = x.shape
    with bt.op_log() as log:
        model(x, x)
    out: dict[str, int] = {}
    for e in log:
        if e.op in ("add", "add_layer_norm") and e.outputs[0][1] == (B, T, CFG.n_embd):
            out[e.outputs[0][0]] = out.get(e.outputs[0][0], 0) + 1
    return out


def test_residual_dtype_defaults_to_float32(tmp_path, shards):
    """Issue 38: the float32 residual stream (autocast's) is the default of the model, of
    TrainConfig and so of `blutrain train` and `blutrain bench`; "compute" (the bf16 stream) is
    the opt-in; anything else is refused naming the option."""
    from blutrain.models.cli import build_parser, config_from_args

    assert GPT2(CFG).residual_dtype == "float32"
    assert GPT2(CFG, precision="bf16").residual_dtype == "float32"
    assert TrainConfig().residual_dtype == "float32"
    with pytest.raises(ValueError, match=r"\[GPT2\] residual_dtype .* float32, compute"):
        GPT2(CFG, residual_dtype="bf16")
    p = build_parser()
    assert config_from_args(p.parse_args(["train"])).residual_dtype == "float32"
    args = p.parse_args(["train", "--residual-dtype", "compute"])
    assert config_from_args(args).residual_dtype == "compute"
    # a --config FILE is settings, not a run's record: a field it omits takes the default
    (tmp_path / "c.json").write_text(json.dumps({"batch_size": 2}))
    args = p.parse_args(["train", "--config", str(tmp_path / "c.json")])
    assert config_from_args(args).residual_dtype == "float32"
    assert p.parse_args(["bench"]).residual_dtype == "float32"
    assert p.parse_args(["bench", "--residual-dtype", "compute"]).residual_dtype == "compute"
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16).to_json(cfg_json)
    kw = dict(model=str(cfg_json), data=str(shards), seq_len=32, max_steps=1, warmup_steps=0,
              device="cpu", progress=False, plot=False)  # fmt: skip
    t = Trainer(TrainConfig(out_dir=str(tmp_path / "a"), **kw))
    assert t.model.residual_dtype == "float32"
    t = Trainer(TrainConfig(out_dir=str(tmp_path / "b"), residual_dtype="compute", **kw))
    assert t.model.residual_dtype == "compute"


def test_residual_grad_dtype_reaches_the_model_from_train(tmp_path, shards):
    """--residual-grad-dtype: "compute" by default, "float32" reaches the trainer's GPT-2 and a
    resumed run's model, a LLaMA model refuses it naming the option."""
    from blutrain.models.cli import build_parser, config_from_args
    from blutrain.models.train_config import ConfigError

    p = build_parser()
    assert config_from_args(p.parse_args(["train"])).residual_grad_dtype == "compute"
    args = p.parse_args(["train", "--residual-grad-dtype", "float32"])
    assert config_from_args(args).residual_grad_dtype == "float32"
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16).to_json(cfg_json)
    kw = dict(model=str(cfg_json), data=str(shards), seq_len=32, max_steps=1, warmup_steps=0,
              device="cpu", progress=False, plot=False, out_dir=str(tmp_path / "a"))  # fmt: skip
    assert Trainer(TrainConfig(**kw)).model.residual_grad_dtype == "compute"
    t = Trainer(TrainConfig(residual_grad_dtype="float32", **kw))
    assert t.model.residual_grad_dtype == "float32"
    with pytest.raises(ConfigError, match=r"residual_grad_dtype \(--residual-grad-dtype\)"):
        Trainer(TrainConfig(**{**kw, "model": "llama-tiny"}, residual_grad_dtype="float32"))


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_stream_is_float32_by_default_and_compute_keeps_the_bf16_stream(rng, fused):
    """Under bf16 the default writes the residual stream in float32 at every add (the
    embeddings' sum and each block's two); residual_dtype="compute" still runs the old path,
    the stream in bf16 at every add, and its numbers differ (the option is not a no-op)."""
    x = rng.integers(0, CFG.vocab_size, (2, 9))
    adds = 1 + 2 * CFG.n_layer
    a, b = twin(rng, precision="bf16", fused=fused)
    b.residual_dtype = "compute"
    a.set_precision("bf16")
    assert a.residual_dtype == "float32"
    assert _stream_dtypes(a, x) == {"float32": adds}
    assert _stream_dtypes(b, x) == {"bfloat16": adds}
    la, lb = (m(x, x)[1].item() for m in (a, b))
    assert la != lb, "the two streams gave the same loss"


@pytest.mark.parametrize("fused", [None, True])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_residual_dtype_changes_nothing_in_fp32_and_tf32(rng, precision, fused):
    """The new default leaves fp32 and tf32 runs as they were: the stream is float32 either
    way, so the default and the old "compute" give the same bits (logits, loss, gradients)."""
    prev = bt.get_float32_matmul_precision()
    try:
        a, b = twin(rng, precision=precision, fused=fused)
        a.set_precision(precision)
        a.fused = fused
        b.residual_dtype = "compute"
        assert a.residual_dtype == "float32"
        x = rng.integers(0, CFG.vocab_size, (2, 9))
        assert _stream_dtypes(a, x) == _stream_dtypes(b, x) == {"float32": 1 + 2 * CFG.n_layer}
        la, sa, ga = run(a, x, x)
        lb, sb, gb = run(b, x, x)
        assert np.array_equal(la, lb) and sa == sb
        assert all(np.array_equal(ga[n], gb[n]) for n in ga)
    finally:
        bt.set_float32_matmul_precision(prev)


def test_residual_grad_dtype_float32_widens_only_the_fused_bf16_stream_gradient(rng):
    """residual_grad_dtype "float32" (the float32 stream's gradient kept float32 on the fused
    path, as autocast's): every layer norm's backward writes a float32 dx where the default
    writes bf16 below the top, the forward is unchanged (same logits and loss bits) and the
    gradients differ; in fp32 the same bits as the default; a bad value names the option."""
    x = rng.integers(0, CFG.vocab_size, (2, 9))
    a, b = twin(rng, precision="bf16", fused=True)
    a.set_precision("bf16")
    a.fused = True
    assert a.residual_grad_dtype == "compute"
    b.residual_grad_dtype = "float32"

    def run16(m):  # (logits, loss, gradients, the dtypes of the layer norms' backward dx)
        m.zero_grad()
        logits, loss = m(x, x)
        with bt.op_log() as log:
            loss.backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in m.named_parameters()}
        dx = collections.Counter(e.outputs[0][0] for e in log if e.op == "layer_norm_backward")
        return logits.detach().float().numpy(), float(loss.item()), grads, dx

    la, sa, ga, dxa = run16(a)
    lb, sb, gb, dxb = run16(b)
    norms = 2 * CFG.n_layer + 1  # ln_1, ln_2 of each block and ln_f
    # the default: only ln_1 of block 0 (a plain layer norm over the float32 embeddings) writes
    # a float32 dx; every add_layer_norm's is bf16
    assert dxa == {"float32": 1, "bfloat16": norms - 1}, dxa
    assert dxb == {"float32": norms}, dxb
    assert np.array_equal(la, lb) and sa == sb
    assert not all(np.array_equal(ga[n], gb[n]) for n in ga), "the option changed nothing"
    f, g = twin(rng, precision="fp32", fused=True)
    f.set_precision("fp32")
    f.fused = True
    g.residual_grad_dtype = "float32"
    lf, sf, gf = run(f, x, x)
    lg, sg, gg = run(g, x, x)
    assert np.array_equal(lf, lg) and sf == sg and all(np.array_equal(gf[n], gg[n]) for n in gf)
    with pytest.raises(ValueError, match=r"\[GPT2\] residual_grad_dtype must be one of"):
        GPT2(CFG, residual_grad_dtype="bf16")


def test_a_run_from_before_the_option_resumes_with_the_bf16_stream(
    tmp_path, shards, monkeypatch, capsys, rewrite_trainer_json
):
    """Note [settings of older runs]: a GPT-2 checkpoint whose trainer.json has no
    residual_dtype (written before the option, when the stream was bf16) resumes through the
    CLI with "compute", what it trained with, not today's default; --residual-dtype given
    again overrides it, and a stored value is kept. The Python API resumes with the config it
    is given and says so when that changes the run's stream."""
    from blutrain.models import cli
    from blutrain.models import trainer as trainer_mod
    from blutrain.models.cli import build_parser, config_from_args
    from blutrain.models.run_state import saved_train_config

    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16).to_json(cfg_json)
    run_dir = tmp_path / "run"
    cfg = TrainConfig(model=str(cfg_json), data=str(shards), batch_size=2, seq_len=16,
                      max_steps=4, warmup_steps=1, eval_interval=0, sample_interval=0,
                      log_interval=0, out_dir=str(run_dir), progress=False, plot=False)  # fmt: skip
    t = Trainer(cfg)
    t.fit(until=2)
    t.close()
    ck = run_dir / "checkpoint"
    assert saved_train_config(ck)["residual_dtype"] == "float32"  # stored, kept
    rewrite_trainer_json(ck, lambda t: t["train_config"].pop("residual_dtype"))
    assert saved_train_config(ck)["residual_dtype"] == "compute"
    p = build_parser()
    resume = ["train", "--out-dir", str(run_dir), "--resume"]
    assert config_from_args(p.parse_args(resume)).residual_dtype == "compute"
    given = p.parse_args([*resume, "--residual-dtype", "float32"])
    assert config_from_args(given).residual_dtype == "float32"
    # the Python API (bf16 stood in for on the CPU: the note is about bf16 runs only)
    monkeypatch.setattr(trainer_mod, "resolve_precision", lambda p, d: "bf16")
    capsys.readouterr()
    t = Trainer(dataclasses.replace(cfg, resume=True))
    assert t.model.residual_dtype == "float32" and not t._bf16_stream()
    t.close()
    note = "[resume] the run trained with residual_dtype 'compute'; it continues with 'float32'"
    assert note in capsys.readouterr().out
    t = Trainer(dataclasses.replace(cfg, resume=True, residual_dtype="compute"))
    assert t._bf16_stream()
    t.close()
    assert "[resume]" not in capsys.readouterr().out
    monkeypatch.undo()
    # the whole CLI resume ends the run with the stream it started with, and records it
    assert cli.main([*resume, "--no-progress"]) == 0
    tr = load_checkpoint(ck).trainer
    assert tr["step"] == 4 and tr["train_config"]["residual_dtype"] == "compute"


def test_fp32_mode_is_the_plain_model(rng):
    a, b = twin(rng, precision="fp32")
    x = rng.integers(0, CFG.vocab_size, (2, 9))
    la, sa, ga = run(a, x, x)
    lb, sb, gb = run(b, x, x)
    assert np.array_equal(la, lb) and sa == sb


def test_peak_flops_by_precision(monkeypatch):
    monkeypatch.delenv("BLUTRAIN_PEAK_FLOPS", raising=False)
    assert peak_flops("cpu", "bf16") is None
    monkeypatch.setenv("BLUTRAIN_PEAK_FLOPS", "1e12")
    assert peak_flops("cuda", "bf16") == 1e12


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    text = d / "s.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:40_000])
    prepare([text], d / "out", val_fraction=0.1, doc_split="paragraph")
    return d / "out"


def test_deferred_syncs_log_every_step_identically(tmp_path, shards):
    """A GPU trainer reads losses back every N steps only; the metrics are the same."""
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16).to_json(cfg_json)

    def fit(out, sync_every, prefetch=False):
        t = Trainer(
            TrainConfig(
                model=str(cfg_json),
                data=str(shards),
                batch_size=2,
                seq_len=32,
                max_steps=7,
                warmup_steps=2,
                eval_interval=0,
                sample_interval=0,
                out_dir=str(out),
                progress=False,
                plot=False,
                log_interval=0,
                device="cpu",
            )
        )
        t.sync_every = sync_every
        t.prefetch = prefetch  # the GPU path: batches uploaded ahead, one copy per sync
        seen = []
        t.on_step = lambda m: seen.append(m["step"])
        s = t.fit()
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return s, {r["step"]: (r["loss"], r["grad_norm"]) for r in recs if "loss" in r}, seen

    s1, m1, seen1 = fit(tmp_path / "a", 1)
    s3, m3, seen3 = fit(tmp_path / "b", 3)
    s4, m4, seen4 = fit(tmp_path / "c", 3, prefetch=True)
    assert seen1 == seen3 == seen4 == list(range(1, 8))
    assert m1 == m3 == m4
    assert s1["final_loss"] == s3["final_loss"] == s4["final_loss"]
    assert s3["precision"] == "fp32"
    # the loader was saved where the steps stopped, not where the prefetch had read to
    a = load_checkpoint(tmp_path / "a" / "checkpoint").trainer["loader"]
    c = load_checkpoint(tmp_path / "c" / "checkpoint").trainer["loader"]
    assert a == c


def test_cast_cache_trains_to_the_same_bits(rng):
    """bf16: the weights' kept casts (AdamW rewrites them) give the bits of casting every step."""
    from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

    x = rng.integers(0, CFG.vocab_size, (2, CFG.block_size))
    params_after = []
    for enabled in (True, False):
        bt.set_cast_cache_enabled(enabled)
        try:
            _, m = twin(np.random.default_rng(0), precision="bf16")
            opt = AdamW(m.named_parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
            params = list(m.parameters())
            for _ in range(3):
                m(x, x)[1].backward()
                _, coef = grad_norm_and_clip_coef(params, 1.0)
                opt.step(grad_scale=coef)
                opt.zero_grad()
            kept = bt.cast_cache_bytes(m.transformer.h[0].mlp.c_fc.weight)
            assert (kept > 0) == enabled
            params_after.append({n: p.detach().numpy().copy() for n, p in m.named_parameters()})
        finally:
            bt.set_cast_cache_enabled(True)
    for n, a in params_after[0].items():
        assert np.array_equal(a, params_after[1][n]), n


def test_gemm_autotune_is_scoped():
    """gemm_autotune turns blutrain-linalg's autotune on for a CUDA device inside the block only,
    never on the CPU or in deterministic mode, and restores the previous value (also on error)."""
    import blutrain.linalg as la
    from blutrain.models.gpt2 import gemm_autotune

    prev = int(la.get_option("autotune"))
    try:
        la.set_option("autotune", 0)
        with gemm_autotune(True, "cpu") as on:
            assert not on and la.get_option("autotune") == 0
        with gemm_autotune(False, "cuda") as on:
            assert not on and la.get_option("autotune") == 0
        with gemm_autotune(True, "cuda:0") as on:
            assert on and la.get_option("autotune") == 1
        assert la.get_option("autotune") == 0
        with pytest.raises(KeyError), gemm_autotune(True, "cuda"):
            raise KeyError("inside")
        assert la.get_option("autotune") == 0
        bt.use_deterministic_algorithms(True)
        try:
            with gemm_autotune(True, "cuda") as on:
                assert not on and la.get_option("autotune") == 0
        finally:
            bt.use_deterministic_algorithms(False)
    finally:
        la.set_option("autotune", prev)


def test_gemm_autotune_option_of_the_trainer_and_bench():
    """TrainConfig.gemm_autotune defaults on; `blutrain train` and `blutrain bench` take
    --no-gemm-autotune."""
    from blutrain.models.cli import build_parser

    assert TrainConfig().gemm_autotune is True
    assert TrainConfig(gemm_autotune=False).gemm_autotune is False
    p = build_parser()
    assert p.parse_args(["train", "--no-gemm-autotune"]).gemm_autotune is False
    assert p.parse_args(["train"]).gemm_autotune is None  # TrainConfig's default applies
    assert p.parse_args(["bench", "--no-gemm-autotune"]).gemm_autotune is False
    assert p.parse_args(["bench", "--cuda-graph"]).cuda_graph is True
    assert TrainConfig().step == "eager"
    assert p.parse_args(["train", "--step", "cuda-graph"]).step == "cuda-graph"


def test_recompute_auto_is_ln_for_fp32_on_a_gpu():
    """recompute="auto" (the trainer's and the benchmarks' default) rebuilds the LayerNorms in
    fp32 on a GPU only; explicit specs pass through; bad ones still fail."""
    from blutrain.models.device import resolve_recompute

    assert resolve_recompute("auto", "cuda", "fp32") == "ln"
    assert resolve_recompute("AUTO", "cuda:1", "float32") == "ln"
    assert resolve_recompute("auto", "cuda", "tf32") == "none"
    assert resolve_recompute("auto", "cuda", "bf16") == "none"
    assert resolve_recompute("auto", "cpu", "fp32") == "none"
    assert resolve_recompute("gelu", "cuda", "fp32") == "gelu"
    assert resolve_recompute("none", "cuda", "tf32") == "none"
    assert TrainConfig().recompute == "auto"
    with pytest.raises(ValueError, match="precision"):
        resolve_recompute("auto", "cuda", "fp8")
    with pytest.raises(ValueError, match="recompute .* = 'all': must be auto, none"):
        TrainConfig(recompute="all")


def test_cuda_graph_rejects_a_batch_of_another_shape():
    """A captured step replays fixed shapes: a batch of another shape (or count) is a clear
    ValueError naming both, not a silent partial copy (the copy itself is checked on the CPU)."""
    from blutrain.models.steps.cuda_graph import copy_batches

    bufs = [(bt.zeros((2, 32), dtype=bt.int64), bt.zeros((2, 32), dtype=bt.int64))]
    bad = np.zeros((2, 16), dtype=np.int64)
    with pytest.raises(ValueError, match=r"shape \(2, 16\) differs from the captured \(2, 32\)"):
        copy_batches(bufs, [(bad, bad)], "cpu")
    with pytest.raises(ValueError, match="2 micro-batches, the graph was captured with 1"):
        copy_batches(bufs, [(bad, bad)] * 2, "cpu")
    x = np.arange(64, dtype=np.int64).reshape(2, 32)
    copy_batches(bufs, [(x, x + 1)], "cpu")
    assert np.array_equal(bufs[0][0].numpy(), x)
    assert np.array_equal(bufs[0][1].numpy(), x + 1)
