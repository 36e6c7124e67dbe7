"""GPU tests at world size 1 (no launcher): NCCL through every collective and mode, the comm
stream's ordering, the reduction kernels against numpy, and DDP / ZeRO against the plain step
bitwise.  Two ranks on one GPU over the MPI backend run from bench/gpu_dist.sh (mpirun)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import blutrain.dist as dist
import blutrain.tensor as bt
from blutrain.dist import _dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not bt.cuda.is_available(), reason="no CUDA device"),
]
FLOATS = {
    "float32": bt.float32,
    "float64": bt.float64,
    "bfloat16": bt.bfloat16,
    "float16": bt.float16,
}


@pytest.fixture(scope="module")
def nccl() -> None:
    dist.init()
    assert dist.backend() == "nccl", f"backend {dist.backend()}: libnccl did not load"
    yield
    dist.shutdown()


def _round(a: np.ndarray, dt) -> np.ndarray:
    return bt.tensor(a.astype(np.float32) if dt != bt.float64 else a).to(dt).to(bt.float64).numpy()


def test_collectives_at_world_size_1(nccl: None, rng: np.random.Generator) -> None:
    for name, dt in {**FLOATS, "int32": bt.int32, "int64": bt.int64, "uint8": bt.uint8}.items():
        for size in (0, 1, 7, 4099):
            a = (
                rng.integers(0, 50, size)
                if dt in (bt.int32, bt.int64, bt.uint8)
                else rng.standard_normal(size)
            )
            for op in ("sum", "avg", "max", "min"):
                if op == "avg" and dt not in FLOATS.values():
                    continue
                x = bt.tensor(a).to(dt).cuda()
                before = x.cpu().to(bt.float64).numpy()
                w = dist.all_reduce(x, op, async_op=True)
                w.wait()
                assert np.array_equal(x.cpu().to(bt.float64).numpy(), before), (name, size, op)
            out = bt.zeros(size, dtype=dt, device="cuda")
            dist.reduce_scatter(out, bt.tensor(a).to(dt).cuda())
            dist.all_gather(out, bt.tensor(a).to(dt).cuda())
            dist.broadcast(out, 0)
            assert np.array_equal(
                out.cpu().to(bt.float64).numpy(), bt.tensor(a).to(dt).to(bt.float64).numpy()
            )


def test_comm_stream_orders_after_compute(nccl: None) -> None:
    # a long chain on the compute stream, then the collective on the comm stream, then a reader
    x = bt.ones(1 << 22, device="cuda")
    for _ in range(50):
        x = x * 1.0 + 1.0
    w = dist.all_reduce(x, "avg", async_op=True)
    w.wait()  # the current stream waits (no host sync)
    y = x + 0.0
    assert float(y[-1].item()) == 51.0
    w.synchronize()
    assert w.is_completed()


def test_divide_kernel_is_exact(rng: np.random.Generator) -> None:
    cs = _dist.comm_stream(0)
    for name, dt in FLOATS.items():
        for n in (2, 3, 5, 7, 6):
            a = rng.standard_normal(10001) * 100
            x = bt.tensor(a).to(dt).cuda()
            held = x.cpu().to(bt.float64).numpy()
            _dist.divide_(x, n, cs)
            _dist.stream_synchronize(cs)
            want = _round(held / n, dt)  # the quotient rounded once
            assert np.array_equal(x.cpu().to(bt.float64).numpy(), want), (name, n)


def _tree(chunks: list[np.ndarray], add) -> np.ndarray:
    stack: list[tuple[np.ndarray, int]] = []
    for c in chunks:
        stack.append((c, 1))
        while len(stack) >= 2 and stack[-1][1] == stack[-2][1]:
            (a, k), (b, _) = stack[-2], stack[-1]
            stack[-2:] = [(add(a, b), 2 * k)]
    while len(stack) >= 2:
        (a, k), (b, m) = stack[-2], stack[-1]
        stack[-2:] = [(add(a, b), k + m)]
    return stack[0][0]


def test_ordered_sum_kernel_matches_the_tree(rng: np.random.Generator) -> None:
    cs = _dist.comm_stream(0)
    for name, dt in FLOATS.items():
        for n in (1, 2, 3, 4, 5, 7, 8, 9):
            chunk = 1001
            a = rng.standard_normal(n * chunk)
            src = bt.tensor(a).to(dt).cuda()
            held = src.cpu().to(bt.float64).numpy().reshape(n, chunk)
            out = bt.empty(chunk, dtype=dt, device="cuda")
            _dist.ordered_sum_(src, n, out, 1, cs)
            _dist.stream_synchronize(cs)
            want = _tree([held[k] for k in range(n)], lambda x, y, dt=dt: _round(x + y, dt))
            assert np.array_equal(out.cpu().to(bt.float64).numpy(), want), (name, n)


def _gpt2():
    from blutrain.models import GPT2Config
    from blutrain.models.gpt2 import GPT2

    bt.manual_seed(0)
    return GPT2(GPT2Config.from_name("tiny"), device="cuda")


def _train(mode: str, steps: int = 2, accum: int = 2) -> tuple[list[float], dict[str, np.ndarray]]:
    from blutrain.models.optim import AdamW

    model = _gpt2()
    rng = np.random.default_rng(5)
    data = rng.integers(0, model.config.vocab_size, (steps, accum, 2, 33))
    fwd, ctx = model, contextlib.nullcontext
    if mode == "plain":
        opt = AdamW(model.named_parameters(), lr=1e-3)
    elif mode.startswith("ddp"):
        rd = bt.bfloat16 if mode == "ddp_bf16" else None
        fwd = dist.DistributedDataParallel(model, reduce_dtype=rd)
        ctx = fwd.no_sync
        opt = AdamW(model.named_parameters(), lr=1e-3)
    else:
        opt = dist.ZeroOptimizer(AdamW(model.named_parameters(), lr=1e-3), stage=int(mode[-1]))
        ctx = opt.no_sync
    losses = []
    for s in range(steps):
        for i in range(accum):
            x = bt.tensor(data[s, i, :, :-1], device="cuda")
            y = bt.tensor(data[s, i, :, 1:], device="cuda")
            with ctx() if i < accum - 1 else contextlib.nullcontext():
                loss = fwd(x, y, return_logits=False)[1]
                (loss / accum).backward()
        losses.append(float(loss.item()))
        opt.step()
        opt.zero_grad(set_to_none=False) if not mode.startswith("zero") else None
    return losses, {n: p.detach().cpu().to(bt.float32).numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2"])
def test_modes_at_world_size_1_equal_the_plain_step_bitwise(nccl: None, mode: str) -> None:
    bt.use_deterministic_algorithms(True)
    ref_losses, ref = _train("plain")
    losses, got = _train(mode)
    assert losses == ref_losses
    for k in ref:
        assert np.array_equal(got[k], ref[k]), f"{mode}: {k}"


def test_ddp_bf16_reduction_at_world_size_1(nccl: None) -> None:
    bt.use_deterministic_algorithms(True)
    _, ref = _train("plain", steps=1)
    _, got = _train("ddp_bf16", steps=1)
    # one rounding of every gradient to bf16 on the comm stream, then AdamW
    err = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    assert err < 5e-3


def test_zero_bf16_memory_vs_formula(nccl: None) -> None:
    """bf16 parameters, float32 masters: ZeRO's 2 + 2 + 12 bytes/param (stage 1) and
    2 + (2 + 12) / N (stage 2), measured by blutrain.alloc."""
    import gc

    import blutrain.alloc as alloc
    from blutrain.models.optim import AdamW

    for stage in (1, 2):
        gc.collect()
        base = alloc.stats("cuda")["allocated_bytes"]
        model = _gpt2()
        bt.nn.Module.to(model, dtype=bt.bfloat16)  # GPT2.to takes a device only
        opt = dist.ZeroOptimizer(AdamW(model.named_parameters(), lr=1e-3), stage=stage)
        x = bt.zeros((2, 32), dtype=bt.int64, device="cuda")
        (model(x, x, return_logits=False)[1]).float().backward()
        opt.step()
        del x
        gc.collect()
        bt.cuda.synchronize()
        held = alloc.stats("cuda")["allocated_bytes"] - base
        mem = opt.memory()
        f = mem["formula_bytes"]
        print(f"ZeRO-{stage}: {held} bytes held, formula {f:.0f} ({mem['formula']})")
        assert abs(held / mem["formula_bytes"] - 1) <= 0.05, (held, mem)
        del opt, model


def test_nccl_errors_name_the_op(nccl: None) -> None:
    with pytest.raises(ValueError, match=r"^\[all_reduce\] tensor is on cpu|^\[all_reduce\]"):
        dist.all_reduce(bt.zeros(3, device="cuda").T.contiguous()[None].T)
    with pytest.raises(TypeError, match=r"^\[all_reduce\] op 'avg' needs a floating dtype"):
        dist.all_reduce(bt.zeros(3, dtype=bt.int32, device="cuda"), "avg")
