"""Whole training steps compiled (forward, backward, clipping, AdamW in one program) against
the same steps run eagerly, over 10 steps with a cosine learning rate (runtime scalars: one
compilation): GPT-2 tiny and the LLaMA-style tiny model.

Tolerances: every step's loss and gradient norm to 1e-6 (relative); the parameters after 10
steps to 1e-5 normwise. The gradients agree to ~3e-7 of their largest element (float rounding
in another order: fused float64 sums, no FMA contraction), but AdamW divides each gradient by
its own running RMS, so an element whose gradient is ~0 (the k-slice of a qkv bias, vocabulary
rows absent from the batch) moves by up to lr whatever the size of that rounding noise: no
reassociation of the float arithmetic keeps those elements within 1e-6.

Memory, from blutrain.alloc's statistics over the same steps: the compiled step's peak (arena
included) at most the eager step's, and a steady-state call making no allocator call.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

import blutrain.alloc as alloc
import blutrain.compiler as btc
import blutrain.tensor as bt
from blutrain.models import GPT2, GPT2Config
from blutrain.models.optim import AdamW, grad_norm_and_clip_coef

sys.path.insert(
    0, os.path.join(os.path.dirname(__file__), "..", "packages", "blutrain-compiler", "bench")
)
import llama_ref as L  # noqa: E402

STEPS = 10
# LLVM -O0 (the same numbers at every level) unless the caller chose: compile time dominates
os.environ.setdefault("BLUTRAIN_COMPILE_OPT", "0")


def _opt(named: list) -> AdamW:
    opt = AdamW(named, lr=1e-3, weight_decay=0.1)
    opt.use_device_scalars()
    for n, p in opt.params:  # states exist before the capture (they are program inputs)
        opt._state_for(n, p)
    return opt


def _step(loss_fn, opt: AdamW):
    params = [p for _, p in opt.params]

    def step(x, y):
        loss = loss_fn(x, y)
        loss.backward()
        norm, coef = grad_norm_and_clip_coef(params, 1.0)
        opt.step(grad_scale=coef)
        opt.zero_grad(set_to_none=True)
        return loss, norm

    return step


def _run_both(make, vocab: int, B: int, T: int) -> tuple:
    rng = np.random.default_rng()
    data = [
        (bt.tensor(rng.integers(0, vocab, (B, T))), bt.tensor(rng.integers(0, vocab, (B, T))))
        for _ in range(STEPS)
    ]
    lrs = [1e-3 * 0.5 * (1 + math.cos(math.pi * i / STEPS)) for i in range(STEPS)]
    (fe, oe, pe), (fc, oc, pc) = make(), make()
    eager, compiled = _step(fe, oe), btc.compile(_step(fc, oc))
    mem = {"eager": 0, "compiled": 0, "allocs": []}
    for i, (x, y) in enumerate(data):
        le, ne, peak, _ = _measured(eager, x, y, oe, lrs[i], i + 1)
        if i >= 1:
            mem["eager"] = max(mem["eager"], peak)
        lc, nc, peak, allocs = _measured(compiled, x, y, oc, lrs[i], i + 1)
        if i >= 1:  # the steady state: the first call captured and compiled
            (prog,) = [c.prog for c in compiled.programs.values()]
            mem["compiled"] = max(mem["compiled"], peak + prog.plan.size)  # + the held arena
            mem["allocs"].append(allocs)
        for a, b, what in ((lc, le, "loss"), (nc, ne, "grad norm")):
            a, b = float(a.item()), float(b.item())
            assert abs(a - b) <= 1e-6 * abs(b), f"step {i}: {what} {a} vs eager {b}"
    assert len(compiled.programs) == 1 and compiled.recompiles == []
    num = den = 0.0
    for a, b in zip(pc, pe):
        a64, b64 = (t.detach().numpy().astype(np.float64) for t in (a, b))
        num += float(((a64 - b64) ** 2).sum())
        den += float((b64**2).sum())
    assert math.sqrt(num / den) <= 1e-5, math.sqrt(num / den)
    (prog,) = [c.prog for c in compiled.programs.values()]
    assert prog.stats.fallbacks == 0
    return prog, mem


def _measured(step, x, y, opt: AdamW, lr: float, k: int) -> tuple:
    """(loss, norm, the step's peak bytes above what was allocated before it, allocator calls),
    from blutrain.alloc's own statistics; the window holds what a training loop does for a
    step: AdamW's lr and step count written (write_device_scalars), then the call."""
    alloc.reset_peak_stats("cpu")
    s0 = alloc.stats("cpu")
    opt.write_device_scalars(lr, k)
    loss, norm = step(x, y)
    s1 = alloc.stats("cpu")
    peak = s1["requested_bytes_peak"] - s0["requested_bytes"]
    return loss, norm, peak, s1["alloc_count"] - s0["alloc_count"]


def _check_memory(prog, mem: dict) -> None:
    """The static plan's promise on a whole training step: the compiled step's peak (its arena
    included) at most eager's, the arena itself no larger, and no allocator call at all in the
    steady state: GEMM outputs, fused kernels, the embedding gathers (index_select's out=), the
    embedding gradient's index_add, slice_scatter and the AdamW updates write planned or shared
    memory, the returned loss and norm take turns in two buffers each (Note [returned
    buffers]: the second call, made while the caller still holds the first call's loss and
    norm, allocates their second buffers; from the third call on, nothing), and AdamW's lr
    and step count are written in place (Note [scalars written in place], optim.py)."""
    assert 0 < prog.plan.size <= mem["compiled"] <= mem["eager"], mem | {"arena": prog.plan.size}
    assert prog.fresh_values() == []
    returned = len(prog.returned)
    assert returned == len(prog.graph.outputs) == 2
    assert mem["allocs"] == [returned] + [0] * (STEPS - 2), mem["allocs"]


def test_gpt2_tiny_training_step_matches_eager() -> None:
    def make():
        bt.manual_seed(1234)
        m = GPT2(GPT2Config.from_name("tiny"))
        m.numpy_loss = False  # bt.cross_entropy, the op a capture records, in both runs
        opt = _opt(list(m.named_parameters()))

        def loss(x, y):
            return m(x, y, return_logits=False)[1]

        return loss, opt, [p for _, p in m.named_parameters()]

    prog, mem = _run_both(make, 50257, 2, 16)
    _check_memory(prog, mem)


def test_llama_tiny_training_step_matches_eager() -> None:
    cfg = L.Config.preset("tiny")
    w0 = L.init_weights(cfg, seed=3)
    cos, sin = (bt.tensor(t) for t in L.rope_tables(cfg))

    def make():
        params = {k: bt.tensor(v.copy()).requires_grad_(True) for k, v in w0.items()}
        opt = _opt(list(params.items()))

        def loss(x, y):
            return L.bt_forward(bt, cfg, params, cos, sin, x, y)

        return loss, opt, list(params.values())

    prog, mem = _run_both(make, cfg.vocab, 4, cfg.seq)
    _check_memory(prog, mem)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_trainer_compiled_step_matches_eager(tmp_path, model: str) -> None:
    """`blutrain train --step compiled` (and --compile) through the trainer's step seam: one
    eager warm-up step, then the compiled program; the same losses, evaluations and parameters
    as the eager step reading the same device scalars. Both models' vocabularies are padded
    (50257 -> 50304 columns); LLaMA's loss reads its logits through a view chain (reshape,
    slice, reshape) that the CPU loops read from the buffer itself
    (program._fold_view_chain_loads)."""
    import json

    from blutrain.models import GPT2Config, LlamaConfig, prepare
    from blutrain.models.tokenizer import SHAKESPEARE_FILE
    from blutrain.models.train_config import TrainConfig
    from blutrain.models.trainer import Trainer

    text = tmp_path / "s.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:40_000])
    prepare([text], tmp_path / "shards", val_fraction=0.1, doc_split="paragraph")
    cfg_json = tmp_path / "m.json"
    if model == "gpt2":
        GPT2Config(block_size=32, n_layer=2, n_head=2, n_embd=32).to_json(cfg_json)
    else:
        LlamaConfig(
            block_size=32,
            n_layer=2,
            n_head=2,
            n_kv_head=2,
            n_embd=32,
            intermediate_size=64,
            vocab_multiple=64,
        ).to_json(cfg_json)
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"run{int(compiled)}"
        t = Trainer(
            TrainConfig(
                model=str(cfg_json),
                data=str(tmp_path / "shards"),
                device="cpu",
                batch_size=2,
                seq_len=32,
                grad_accum=2,
                max_steps=6,
                lr=3e-3,
                warmup_steps=3,
                eval_interval=3,
                eval_batches=1,
                sample_interval=0,
                ckpt_interval=0,
                log_interval=1,
                out_dir=str(out),
                progress=False,
                plot=False,
                compile=compiled,
            )
        )
        if not compiled:
            t.stepper.optimizer.use_device_scalars(True)
            t.model.numpy_loss = False
        t.fit()
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in recs if "loss" in r]
        params = {n: p.detach().numpy().copy() for n, p in t.model.named_parameters()}
        runs[compiled] = (losses, params, t.stepper)
    (le, pe, _), (lc, pc, stepper) = runs[False], runs[True]
    assert type(stepper).__name__ == "CompiledStep" and len(stepper._compiled.programs) == 1
    assert len(le) == 6 and lc == le, list(zip(le, lc))
    for n in pe:
        np.testing.assert_array_equal(pc[n], pe[n], err_msg=n)


def _captured_step(loss_fn, opt: AdamW, x, y) -> btc.Graph:
    params = [p for _, p in opt.params]
    with bt.capture() as cg:
        loss = loss_fn(x, y)
        loss.backward()
        _, coef = grad_norm_and_clip_coef(params, 1.0)
        opt.step(grad_scale=coef)
        opt.zero_grad(set_to_none=True)
        cg.mark_output(loss)
    return btc.from_capture(cg)


def test_ptx_for_every_fused_kernel_of_both_training_steps() -> None:
    """sm_90 PTX, without a GPU, for every fused group of the GPT-2 tiny and LLaMA-style tiny
    training steps (forward, backward, clipping, AdamW), with launches the runtime replays."""
    from blutrain.compiler import program

    bt.manual_seed(1)
    m = GPT2(GPT2Config.from_name("tiny"))
    m.numpy_loss = False
    opt = _opt(list(m.named_parameters()))
    x = bt.tensor(np.random.default_rng().integers(0, 50257, (2, 16)))
    graphs = [_captured_step(lambda a, b: m(a, b, return_logits=False)[1], opt, x, x)]
    cfg = L.Config.preset("tiny")
    params = {k: bt.tensor(v).requires_grad_(True) for k, v in L.init_weights(cfg).items()}
    cos, sin = (bt.tensor(t) for t in L.rope_tables(cfg))
    xl = bt.tensor(np.random.default_rng().integers(0, cfg.vocab, (2, cfg.seq)))
    graphs.append(
        _captured_step(
            lambda a, b: L.bt_forward(bt, cfg, params, cos, sin, a, b),
            _opt(list(params.items())),
            xl,
            xl,
        )
    )
    for g in graphs:
        part, code = program.ptx_for(g)
        assert not code.unsupported, code.unsupported
        assert set(code.functions) == {G.name for G in part.groups}
        assert len(part.groups) > 20
        for f in code.functions.values():
            assert f.launches
        assert all(".target sm_90" in t for t in code.ptx.values())
