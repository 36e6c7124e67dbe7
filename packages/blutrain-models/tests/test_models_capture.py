"""A whole training step captured (bt.capture) and replayed equals the eager step bit for bit.

The step is the trainer's: forward with the loss, backward, global-norm clipping (its
coefficient scales the gradients inside AdamW), the multi-tensor AdamW update and zero_grad.
Two identical models train side by side: one eagerly, one by replaying a graph captured once,
with the learning rate following a schedule and the step count advancing (both are graph
inputs: the optimizer's device scalars), so the same graph serves every step. Parameters,
both moments, losses and norms must agree to the bit after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt

from blutrain.models import GPT2Config  # noqa: E402
from blutrain.models.gpt2 import GPT2  # noqa: E402
from blutrain.models.optim import AdamW, CosineSchedule, grad_norm_and_clip_coef  # noqa: E402


def _bits(t) -> bytes:
    return t.detach().contiguous().cpu().numpy().tobytes()


def _state(model, opt) -> list[bytes]:
    out = [_bits(p) for p in model.parameters()]
    for st in opt.state.values():
        out += [_bits(st["exp_avg"]), _bits(st["exp_avg_sq"])]
    return out


def _train(make_model, batches, sched, replayed: bool, seed: int, device: str = "cpu"):
    """Per step, the state bytes of one model trained eagerly or (after one eager step that
    creates the optimizer's state) by replaying one captured step; and the graph."""
    bt.manual_seed(seed)
    model = make_model()
    opt = AdamW(model.named_parameters(), lr=sched(0), weight_decay=0.1)
    params = list(model.parameters())
    x_buf = bt.zeros((2, 16), dtype=bt.int64, device=device)
    y_buf = bt.zeros((2, 16), dtype=bt.int64, device=device)

    def step():
        loss = model(x_buf, y_buf, return_logits=False)[1]
        loss.backward()
        norm, coef = grad_norm_and_clip_coef(params, 1.0)
        opt.step(grad_scale=coef)
        opt.zero_grad()
        return loss, norm

    graph = None
    states = []
    for s, (x, y) in enumerate(batches):
        x_buf.copy_(bt.tensor(x, device=device))
        y_buf.copy_(bt.tensor(y, device=device))
        if s == 0:  # the first step creates the optimizer's state, eagerly
            opt.set_lr(sched(s))
            loss, norm = step()
            opt.use_device_scalars()
        elif not replayed:
            opt.set_lr(sched(s))
            loss, norm = step()
        else:
            opt.write_device_scalars(sched(s), opt.common_step() + 1)
            if graph is None:
                with bt.capture() as graph:
                    loss, norm = step()  # counts this step on the host
                    graph.mark_output(loss)
                    graph.mark_output(norm)
            else:
                opt.advance_steps()
            loss, norm = graph.replay()
        states.append(_state(model, opt) + [_bits(loss), _bits(norm)])
    return states, graph


def train_eager_and_replayed(
    make_model, vocab: int, steps: int = 4, seed: int = 0, device: str = "cpu"
):
    """(eager states, replayed states, graph): per step, the model + optimizer state bytes and
    the loss and norm."""
    rng = np.random.default_rng(seed)
    batches = [
        (rng.integers(0, vocab, (2, 16)), rng.integers(0, vocab, (2, 16))) for _ in range(steps)
    ]
    sched = CosineSchedule(max_lr=3e-3, warmup_steps=2, max_steps=steps)
    eager, _ = _train(make_model, batches, sched, False, seed, device)
    replay, graph = _train(make_model, batches, sched, True, seed, device)
    return eager, replay, graph


def _gpt2():
    cfg = GPT2Config.from_name("tiny", n_layer=2, vocab_size=300, block_size=32)
    model = GPT2(cfg)
    model.numpy_loss = False  # the CPU loss through bt.cross_entropy, as a capture records it
    return model


def test_gpt2_training_step_replays_bitwise():
    eager, replay, graph = train_eager_and_replayed(_gpt2, vocab=300)
    for s, (e, r) in enumerate(zip(eager, replay)):
        diff = [i for i, (a, b) in enumerate(zip(e, r)) if a != b]
        assert not diff, f"step {s}: {len(diff)} of {len(e)} tensors differ (first {diff[:5]})"
    ops = {n["op"] for n in graph.nodes}
    # forward, backward, clipping and the optimizer are all in the one graph
    assert {"linear", "layer_norm", "cross_entropy", "cross_entropy_backward"} <= ops
    assert {"layer_norm_backward", "accumulate_grad", "grad_norm", "clip_coef", "adamw_"} <= ops
    (ad,) = [n for n in graph.nodes if n["op"] == "adamw_"]
    assert ad["attrs"]["has_lr"] and ad["attrs"]["has_step"] and ad["attrs"]["has_scale"]
    # every parameter and both of its moments are written, and say so
    n_params = len(list(_gpt2().parameters()))
    assert len(graph.mutations) == 3 * n_params
    # the step's .grad values end as None (zero_grad), and the graph says so
    assert graph.grads and all(g == -1 for _, g in graph.grads)
    # the graph survives JSON: the loaded one is the same program
    assert bt.load_graph(graph.to_json()).hash() == graph.hash()


def test_capturing_a_step_needs_device_scalars():
    model = _gpt2()
    opt = AdamW(model.named_parameters(), lr=1e-3)
    x = bt.zeros((1, 4), dtype=bt.int64)
    model(x, x, return_logits=False)[1].backward()
    opt.step()  # eager: state exists
    model(x, x, return_logits=False)[1].backward()
    with pytest.raises(RuntimeError, match=r"\[AdamW\] capturing a step: call use_device_scalars"):
        with bt.capture():
            opt.step()


@pytest.mark.gpu
@pytest.mark.skipif(not bt.cuda_built() or bt.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_training_step_replays_bitwise_on_cuda(kind):
    """The same on a GPU, in deterministic mode (no float atomics in any backward)."""
    from blutrain.models import Llama, LlamaConfig

    def make():
        if kind == "llama":
            cfg = LlamaConfig.from_name("llama-tiny", vocab_size=300, n_layer=2, n_kv_head=2)
            return Llama(cfg, device="cuda")
        return GPT2(
            GPT2Config.from_name("tiny", n_layer=2, vocab_size=300), device="cuda", fused=False
        )

    prev = bt.are_deterministic_algorithms_enabled()
    bt.use_deterministic_algorithms(True)
    try:
        eager, replay, graph = train_eager_and_replayed(make, vocab=300, device="cuda")
    finally:
        bt.use_deterministic_algorithms(prev)
    for s, (e, r) in enumerate(zip(eager, replay)):
        diff = [i for i, (a, b) in enumerate(zip(e, r)) if a != b]
        assert not diff, f"step {s}: {len(diff)} of {len(e)} tensors differ"
    assert any(v["device"] == "cuda:0" for v in graph.values)
