"""GPT-2 and the trainer on a GPU (skipped without one): every precision and recompute mode
trains, the GPU model matches the CPU one, the trainer's deferred steps log every step.
PyTorch comparisons are in tests/test_models_gpu_fidelity.py at the repository root."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import blutrain.tensor as bt
from blutrain.models import GPT2Config, prepare
from blutrain.models.bench import bench
from blutrain.models.device import resolve_device
from blutrain.models.gpt2 import GPT2
from blutrain.models.tokenizer import SHAKESPEARE_FILE
from blutrain.models.train_config import TrainConfig
from blutrain.models.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not bt.cuda_built() or bt.cuda_device_count() == 0, reason="no CUDA device"),
]
CFG = GPT2Config(block_size=64, vocab_size=500, n_layer=2, n_head=4, n_embd=64, vocab_multiple=128)


def weights(cfg, rng):
    m = GPT2(cfg)
    sd = {
        k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32)
        for k, v in m.state_dict().items()
    }
    sd["transformer.wte.weight"][cfg.vocab_size :] = 0
    return sd


def test_auto_device_is_cuda():
    assert resolve_device("auto") == "cuda"


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "bf16/compute"])
def test_gpu_forward_backward_matches_cpu(rng, precision):
    # bf16: the default float32 residual stream; bf16/compute: the opt-in bf16 stream
    precision, _, residual = precision.partition("/")
    sd = weights(CFG, rng)
    x = rng.integers(0, CFG.vocab_size, (3, CFG.block_size))
    cpu = GPT2(CFG)
    cpu.load_state_dict(sd)
    gpu = GPT2(CFG, device="cuda", precision=precision, residual_dtype=residual or "float32")
    gpu.load_state_dict(sd)
    lc, sc = cpu(x, x)
    sc.backward()
    lg, sg = gpu(x, x)
    sg.backward()
    tol = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 3e-2}[precision]
    a, b = lg.detach().float().cpu().numpy(), lc.detach().numpy()
    assert np.abs(a - b).max() <= tol * np.abs(b).max(), precision
    assert abs(sg.item() - sc.item()) <= tol * abs(sc.item())
    gc = dict(cpu.named_parameters())
    for n, p in gpu.named_parameters():
        assert p.dtype == bt.float32 and str(p.grad.device).startswith("cuda"), n
        g, r = p.grad.float().cpu().numpy(), gc[n].grad.numpy()
        assert np.abs(g - r).max() <= 20 * tol * max(np.abs(r).max(), 1e-6), n
    # padded vocabulary rows get no gradient
    wte = dict(gpu.named_parameters())["transformer.wte.weight"].grad.float().cpu().numpy()
    assert not wte[CFG.vocab_size :].any()


@pytest.mark.parametrize("recompute", ["none", "gelu", "ln", "ln+gelu", "attn", "block"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_runs_every_mode(precision, recompute):
    r = bench(
        "tiny",
        batch_size=2,
        seq_len=64,
        steps=2,
        warmup=1,
        device="cuda",
        precision=precision,
        recompute=recompute,
    )
    assert r["device"] == "cuda" and r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
    assert r["peak_mem_bytes"] > 0


def test_bench_cuda_graph_replays_the_eager_step():
    """bench(cuda_graph=True) times replays of the captured step: after as many optimizer steps
    (warm-up, the first untimed replay, the timed ones) its loss is the eager run's."""
    kw = dict(batch_size=2, seq_len=64, warmup=1, device="cuda", precision="bf16", seed=3)
    eager = bench("tiny", steps=3, **kw)
    graph = bench("tiny", steps=2, cuda_graph=True, **kw)
    assert graph["cuda_graph"] and graph["tokens_per_s"] > 0 and math.isfinite(graph["loss"])
    # (the dQ-atomic attention backward may differ in the last bits; a missed update would not)
    assert abs(graph["loss"] - eager["loss"]) <= 1e-5 * abs(eager["loss"]), (graph, eager)


def test_trainer_on_gpu(tmp_path):
    text = tmp_path / "s.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:60_000])
    prepare([text], tmp_path / "shards", val_fraction=0.1, doc_split="paragraph")
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=64, n_layer=2, n_head=2, n_embd=64).to_json(cfg_json)
    t = Trainer(
        TrainConfig(
            model=str(cfg_json),
            data=str(tmp_path / "shards"),
            batch_size=4,
            seq_len=64,
            max_steps=12,
            lr=3e-3,
            warmup_steps=2,
            eval_interval=6,
            eval_batches=2,
            sample_interval=12,
            sample_tokens=8,
            out_dir=str(tmp_path / "run"),
            progress=False,
            plot=False,
            log_interval=5,
        )
    )
    assert t.device == "cuda" and t.precision == "bf16"
    s = t.fit()
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(math.isfinite(r["loss"]) and r["peak_mem_bytes"] > 0 for r in steps)
    assert s["final_loss"] < s["first_loss"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dropped_logits_take_their_gradient(rng, precision):
    # `loss = model(x, y)[1]` drops the logits: the loss's backward writes dlogits over them, so
    # backward's peak is one (B*T, padded vocab) tensor lower than with the logits held, and
    # every gradient is bitwise the same.
    cfg = GPT2Config(block_size=64, vocab_size=8000, n_layer=2, n_head=4, n_embd=64)
    sd = weights(cfg, rng)
    x = bt.tensor(rng.integers(0, cfg.vocab_size, (8, cfg.block_size)), device="cuda")
    out = {}
    for keep in (False, True):
        m = GPT2(cfg, device="cuda", precision=precision)
        m.load_state_dict(sd)
        logits, loss = m(x, x)
        if not keep:
            del logits
        bt.cuda.synchronize()
        before = bt.cuda.memory_allocated()
        bt.cuda.reset_peak_memory_stats()
        loss.backward()
        bt.cuda.synchronize()
        grads = {n: p.grad.cpu().numpy() for n, p in m.named_parameters()}
        out[keep] = (bt.cuda.max_memory_allocated() - before, loss.item(), grads)
    item = 2 if precision == "bf16" else 4
    logits_bytes = 8 * cfg.block_size * cfg.padded_vocab_size * item
    (peak_drop, l_drop, g_drop), (peak_keep, l_keep, g_keep) = out[False], out[True]
    assert peak_keep >= logits_bytes, (peak_keep, logits_bytes)
    assert peak_drop <= peak_keep - 0.9 * logits_bytes, (peak_drop, peak_keep, logits_bytes)
    assert l_drop == l_keep
    for n in g_keep:
        assert np.array_equal(g_drop[n], g_keep[n]), n


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_classifier_never_holds_the_logits(rng, precision):
    # model(x, y, return_logits=False) runs the head and the loss as bt.linear_cross_entropy
    # in row chunks: the step's peak is most of one (B*T, padded vocab) tensor lower than with
    # the logits made (and dropped), and the loss and gradients agree with that path.
    cfg = GPT2Config(block_size=64, vocab_size=8000, n_layer=2, n_head=4, n_embd=64)
    sd = weights(cfg, rng)
    # 32 x 64 rows: the logits (16 MB in bf16) well above the head's float32 dW (2 MB) and the
    # backward's copies of it
    B = 32
    x = bt.tensor(rng.integers(0, cfg.vocab_size, (B, cfg.block_size)), device="cuda")
    y = rng.integers(0, cfg.vocab_size, (B, cfg.block_size))
    y[0, :5] = -1  # ignored targets
    y = bt.tensor(y, device="cuda")
    out = {}
    for fused_head in (True, False):
        m = GPT2(cfg, device="cuda", precision=precision)
        m.load_state_dict(sd)
        m.classifier_chunk_size = 128  # 16 chunks
        bt.cuda.synchronize()
        before = bt.cuda.memory_allocated()
        bt.cuda.reset_peak_memory_stats()
        logits, loss = m(x, y, return_logits=not fused_head)
        assert (logits is None) == fused_head
        del logits
        loss.backward()
        bt.cuda.synchronize()
        grads = {n: p.grad.cpu().float().numpy() for n, p in m.named_parameters()}
        out[fused_head] = (bt.cuda.max_memory_allocated() - before, loss.item(), grads)
    item = 2 if precision == "bf16" else 4
    logits_bytes = B * cfg.block_size * cfg.padded_vocab_size * item
    (peak_f, loss_f, g_f), (peak_u, loss_u, g_u) = out[True], out[False]
    assert peak_f <= peak_u - 0.5 * logits_bytes, (peak_f, peak_u, logits_bytes)
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert loss_f == pytest.approx(loss_u, rel=tol)
    for n in g_u:
        scale = max(np.abs(g_u[n]).max(), 1e-8)
        assert np.abs(g_f[n] - g_u[n]).max() / scale <= 10 * tol, n


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ln_recompute_keeps_two_activations_less_per_layer(rng, precision):
    # recompute="ln": no LayerNorm output is kept through the forward (the linears after them
    # rebuild them in backward), so the memory the forward leaves behind is two (B*T, C) tensors
    # a layer lower; the gradients are bitwise those of keeping them (deterministic mode: the
    # attention backward's float atomics would otherwise differ between any two runs).
    prev = bt.are_deterministic_algorithms_enabled()
    bt.use_deterministic_algorithms(True)
    try:
        _ln_recompute_memory(rng, precision)
    finally:
        bt.use_deterministic_algorithms(prev)


def _ln_recompute_memory(rng, precision):
    cfg = GPT2Config(block_size=64, vocab_size=500, n_layer=3, n_head=4, n_embd=256)
    sd = weights(cfg, rng)
    B = 16
    x = bt.tensor(rng.integers(0, cfg.vocab_size, (B, cfg.block_size)), device="cuda")
    out = {}
    for mode in ("none", "ln"):
        m = GPT2(cfg, device="cuda", precision=precision, recompute=mode)
        m.load_state_dict(sd)
        bt.cuda.synchronize()
        before = bt.cuda.memory_allocated()
        _, loss = m(x, x, return_logits=False)
        bt.cuda.synchronize()
        held = bt.cuda.memory_allocated() - before
        loss.backward()
        grads = {n: p.grad.cpu().float().numpy() for n, p in m.named_parameters()}
        out[mode] = (held, loss.item(), grads)
        del loss, m
    item = 2 if precision == "bf16" else 4
    two_per_layer = 2 * cfg.n_layer * B * cfg.block_size * cfg.n_embd * item
    # less the recipes' own holdings: in bf16 each add_layer_norm's recipe keeps its bias's
    # bf16 copy (n_embd elements), which the norm alone would not
    recipes = (2 * cfg.n_layer - 1) * cfg.n_embd * item if precision == "bf16" else 0
    drop = out["none"][0] - out["ln"][0]
    assert drop >= two_per_layer - recipes, (out["none"][0], out["ln"][0], two_per_layer)
    assert out["none"][1] == out["ln"][1]
    for n, g in out["none"][2].items():
        assert np.array_equal(out["ln"][2][n], g), n


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_trainer_cuda_graph_matches_eager(tmp_path, precision):
    """step="cuda-graph": 3 eager steps, then the step captured once and replayed. With two
    micro-batches, the warm-up lr changing every step, evaluation, text samples (eager forward
    passes between replays) and a checkpoint mid-run, its losses, validation losses, samples,
    parameters and step counts are bitwise the eager run's when that
    run's AdamW also reads lr and the step from device scalars (Note [AdamW in a CUDA graph]).
    (Head size 32 runs the deterministic attention kernels; the one exception is the validation
    loss before training, whose GEMMs the first run met before they were tuned.)"""
    text = tmp_path / "s.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:60_000])
    prepare([text], tmp_path / "shards", val_fraction=0.1, doc_split="paragraph")
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=64, n_layer=2, n_head=2, n_embd=64).to_json(cfg_json)
    runs = {}
    for graph in (False, True):
        out = tmp_path / f"run{int(graph)}"
        t = Trainer(
            TrainConfig(
                model=str(cfg_json),
                data=str(tmp_path / "shards"),
                batch_size=4,
                seq_len=64,
                grad_accum=2,
                max_steps=10,
                lr=3e-3,
                warmup_steps=8,
                precision=precision,
                eval_interval=5,
                eval_batches=2,
                sample_interval=4,
                ckpt_interval=5,
                log_interval=3,
                out_dir=str(out),
                progress=False,
                plot=False,
                step="cuda-graph" if graph else "eager",
            )
        )
        if not graph:
            t.stepper.optimizer.use_device_scalars(True)
        t.fit()
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in recs if "loss" in r]
        vals = [r["val_loss"] for r in recs if "val_loss" in r]
        samples = [(r["step"], r["sample"]) for r in recs if "sample" in r]
        steps = {int(st["step"]) for st in t.stepper.optimizer.state.values()}
        params = {n: p.detach().float().cpu().numpy() for n, p in t.model.named_parameters()}
        runs[graph] = (losses, vals, steps, params, graph and t.stepper.captured, samples)
    (le, ve, se, pe, ge, xe), (lg, vg, sg, pg, gg, xg) = runs[False], runs[True]
    assert not ge and gg, "the graph run captured no graph"
    # samples at steps 4 and 8 (after replays 1 and 5) and at the last step, as in eager mode
    assert [s for s, _ in xg] == [4, 8, 10] and all(text for _, text in xg), xg
    assert xg == xe, (xe, xg)
    assert len(le) == len(lg) == 10 and se == sg == {10}
    assert lg == le, list(zip(le, lg))
    # evaluations at steps 0, 5 and 10, and the final summary's record of the last
    assert len(ve) == len(vg) == 4 and vg[1:] == ve[1:], (ve, vg)
    assert abs(vg[0] - ve[0]) <= 1e-3 * abs(ve[0]), (ve, vg)
    for n in pe:
        assert np.array_equal(pg[n], pe[n]), n


def test_cuda_graph_step_resumes(tmp_path):
    """A cuda-graph run stopped at step 5 and resumed (the new trainer's step loads the
    optimizer state, runs its 3 eager warm-up steps on the same device scalars and captures)
    ends as the run that never stopped: the same losses at every step (1e-5: the two runs'
    GEMMs may be tuned differently) and the same AdamW step counts."""
    text = tmp_path / "s.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:60_000])
    prepare([text], tmp_path / "shards", val_fraction=0.1, doc_split="paragraph")
    cfg_json = tmp_path / "m.json"
    GPT2Config(block_size=64, n_layer=2, n_head=2, n_embd=64).to_json(cfg_json)

    def config(out, **kw):
        return TrainConfig(
            model=str(cfg_json),
            data=str(tmp_path / "shards"),
            batch_size=4,
            seq_len=64,
            max_steps=12,
            lr=3e-3,
            warmup_steps=2,
            precision="bf16",
            step="cuda-graph",
            eval_interval=0,
            sample_interval=0,
            log_interval=3,
            out_dir=str(tmp_path / out),
            progress=False,
            plot=False,
            **kw,
        )

    straight = Trainer(config("a"))
    straight.fit()
    assert straight.stepper.captured
    first = Trainer(config("b"))
    first.fit(until=5)
    first.close()
    resumed = Trainer(config("b", resume=True))
    assert resumed.step == 5
    resumed.fit()
    assert resumed.stepper.captured

    def losses(out):
        recs = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in recs if "loss" in r}

    la, lb = losses("a"), losses("b")
    assert sorted(la) == sorted(lb) == list(range(1, 13))
    for s in la:
        assert abs(la[s] - lb[s]) <= 1e-5 * abs(la[s]), (s, la[s], lb[s])
    steps = {int(st["step"]) for st in resumed.stepper.optimizer.state.values()}
    assert steps == {12}
