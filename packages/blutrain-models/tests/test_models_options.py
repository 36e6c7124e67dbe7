"""GPT-2's GPU-oriented options, checked on the CPU: recomputation, fused ops, precision
policies, and the trainer's deferred (sync-free) steps; tests/test_models_gpu_fidelity.py checks
them on a GPU.
"""

from __future__ import annotations

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


def test_residual_dtype_option(rng, tmp_path, shards):
    """GPT2.residual_dtype: float32 by default (autocast's stream), "compute" keeps the bf16
    stream; anything else is refused naming the option.  It changes nothing in fp32 (the stream
    is float32 either way), and the trainer sets it from --residual-dtype."""
    assert GPT2(CFG).residual_dtype == "float32"
    with pytest.raises(ValueError, match=r"\[GPT2\] residual_dtype .* float32, compute"):
        GPT2(CFG, residual_dtype="bf16")
    a, b = twin(rng, precision="fp32", residual_dtype="compute")
    x = rng.integers(0, CFG.vocab_size, (2, 9))
    la, sa, ga = run(a, x, x)
    lb, sb, gb = run(b, x, x)
    assert np.array_equal(la, lb) and sa == sb
    assert all(np.array_equal(ga[n], gb[n]) for n in ga)
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16).to_json(cfg_json)
    t = Trainer(
        TrainConfig(
            model=str(cfg_json),
            data=str(shards),
            seq_len=32,
            max_steps=1,
            warmup_steps=0,
            out_dir=str(tmp_path / "run"),
            device="cpu",
            residual_dtype="compute",
        )
    )
    assert t.model.residual_dtype == "compute"


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
