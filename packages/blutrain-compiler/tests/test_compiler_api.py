"""compile(): guards, recompiles and their limit, runtime scalars, fallbacks, errors, dump,
cache."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import blutrain.compiler as btc
import blutrain.tensor as bt
from blutrain.compiler import program


def test_guards_reuse_and_recompile(caplog: pytest.LogCaptureFixture) -> None:
    f = btc.compile(lambda x: (x * 2).exp().sum(-1))
    a, b = bt.randn(4, 8), bt.randn(4, 8)
    f(a)
    f(b)
    assert len(f.programs) == 1
    with caplog.at_level(logging.WARNING, logger="blutrain.compiler"):
        f(bt.randn(3, 8))
    assert len(f.programs) == 2
    assert any(
        "recompiling" in r.message and "(4, 8)" in r.message and "(3, 8)" in r.message
        for r in caplog.records
    )
    f(bt.randn(4, 8).double())  # a dtype change recompiles too
    assert len(f.programs) == 3


def test_recompile_limit_is_a_clear_error() -> None:
    f = btc.compile(lambda x: x + 1, max_recompiles=2)
    f(bt.randn(2))
    f(bt.randn(3))
    with pytest.raises(btc.RecompileLimitError, match=r"max_recompiles=2.*\(3,\) -> \(4,\)"):
        f(bt.randn(4))


def test_cosine_schedule_compiles_once() -> None:
    """100 steps of a cosine learning rate: one program, the lr a runtime argument."""

    def sgd(w, g, lr):
        return w - g * lr

    step = btc.compile(sgd)
    w, g = bt.randn(16), bt.randn(16)
    ref = w.numpy().astype(np.float64)
    for i in range(100):
        lr = 0.5 * 1e-2 * (1 + math.cos(math.pi * i / 100))
        w = step(w, g, lr)
        ref = (ref.astype(np.float32) - g.numpy() * np.float32(lr)).astype(np.float32)
    assert len(step.programs) == 1 and step.recompiles == []
    np.testing.assert_array_equal(w.numpy(), ref)


def test_int_scalars_named_are_runtime() -> None:
    f = btc.compile(lambda x, step: x * (0.9**step), scalars=("step",))
    x = bt.ones(3)
    for s in range(1, 5):
        np.testing.assert_allclose(f(x, s).numpy(), 0.9**s, rtol=1e-6)
    assert len(f.programs) == 1


def test_library_calls_and_fusion_around_gemm() -> None:
    x, w, b = bt.randn(8, 16), bt.randn(32, 16), bt.randn(32)

    def mlp(x, w, b):
        return bt.softmax(bt.gelu(bt.linear(x, w, b)) * 0.5, -1)

    c = btc.compile(mlp)
    np.testing.assert_allclose(c(x, w, b).numpy(), mlp(x, w, b).numpy(), rtol=0, atol=1e-6)
    (p,) = [v.prog for v in c.programs.values()]
    assert p.stats.library_calls == 1 and p.stats.groups == 1


def test_gemms_rerun_their_plans_on_new_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [GEMM plans] (program.py): after its first call a program's GEMMs (a linear with
    bias over a reshaped 3-D input, a matmul of a transposed view, whose strides the plan
    keeps) rerun their blutrain.linalg plans: later calls never take linalg's general path,
    and with new inputs (new pointers, new values) every output equals eager bit for bit."""
    import blutrain.linalg as L

    def f(x, w, b, y):
        h = bt.linear(x, w, b).tanh()
        return bt.matmul(h.reshape(-1, 32), y.permute(1, 0)) * 0.5

    def args():
        return bt.randn(3, 8, 16), bt.randn(32, 16), bt.randn(32), bt.randn(24, 32)

    c = btc.compile(f)
    a0 = args()
    np.testing.assert_array_equal(c(*a0).numpy(), f(*a0).numpy())
    (p,) = [v.prog for v in c.programs.values()]
    assert p.stats.library_calls == 2 and len(p.gemm_plans) == 2
    monkeypatch.setattr(L, "_matmul_slow", None)  # a rerun must not reach the general path
    for _ in range(2):
        a = args()
        got = c(*a).numpy()
        monkeypatch.undo()
        np.testing.assert_array_equal(got, f(*a).numpy())
        monkeypatch.setattr(L, "_matmul_slow", None)
    assert len(c.programs) == 1


def test_unlowerable_op_falls_back_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    x = bt.randn(6, 5)
    idx = bt.tensor(np.array([0, 2, 4], dtype=np.int64))

    def f(x, idx):  # index_select has no lowering: it runs eagerly between two fused groups
        return (bt.index_select(x.exp(), 0, idx) * 2).sum()

    c = btc.compile(f)
    np.testing.assert_allclose(c(x, idx).numpy(), f(x, idx).numpy(), rtol=1e-6)


def test_lowering_failure_becomes_eager_fallback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blutrain.compiler import lower

    def broken(self, n):  # a lowering that fails: the node runs eagerly, logged once
        raise lower.LoweringError("test: no tanh today")

    monkeypatch.setattr(lower.Emitter, "op_tanh", broken, raising=False)
    from blutrain.compiler import eager

    monkeypatch.setitem(eager._TABLE, "tanh", lambda n, x: [bt.tanh(x[0])])
    x = bt.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="blutrain.compiler"):
        c = btc.compile(lambda t: (t * 3).tanh() + 1)
        out = c(x)
    np.testing.assert_allclose(out.numpy(), ((x * 3).tanh() + 1).numpy(), rtol=1e-6)
    lines = [r.message for r in caplog.records if "tanh" in r.message]
    assert len(lines) == 2  # "cannot be lowered" and "eager fallback", each once
    assert any("cannot be lowered" in m for m in lines)


def test_mlir_failure_names_hash_and_stage(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from blutrain.compiler import pipelines

    monkeypatch.setattr(pipelines, "CPU_PREP", "builtin.module(no-such-pass)")
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    with pytest.raises(btc.CompileError, match=r"graph [0-9a-f]{16}: stage loops failed") as e:
        btc.compile(lambda t: t.exp() * 2)(bt.randn(3))
    assert str(tmp_path) in str(e.value)


def test_dump_reparses_with_the_bindings(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    c = btc.compile(lambda t: bt.softmax(t * 2, -1))
    c(bt.randn(4, 8))
    (d,) = list(tmp_path.iterdir())
    names = sorted(p.name for p in d.iterdir())
    for want in (
        "graph.json",
        "groups.txt",
        "00-lowered.mlir",
        "01-fused.mlir",
        "02-bufferized.mlir",
        "03-loops.mlir",
        "04-llvm.mlir",
    ):
        assert want in names, names
    from mlir import ir

    with ir.Context():
        for p in sorted(d.glob("*.mlir")):
            ir.Module.parse(p.read_text())
    g = btc.Graph.from_json((d / "graph.json").read_text())
    assert g.hash() == d.name
    assert "boundary" in (d / "groups.txt").read_text()


SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    import numpy as np
    import blutrain.tensor as bt, blutrain.compiler as btc
    x = bt.tensor(np.linspace(-2, 2, 64, dtype=np.float32).reshape(8, 8))
    f = btc.compile(lambda t: bt.softmax(bt.tanh(t) * 3.0, -1))
    t0 = time.perf_counter(); y = f(x); dt = time.perf_counter() - t0
    (p,) = [c.prog for c in f.programs.values()]
    ref = bt.softmax(bt.tanh(x) * 3.0, -1)
    print(json.dumps({"cache": p.stats.cache, "s": dt, "mlir": "mlir" in sys.modules,
                      "err": float(np.abs(y.numpy() - ref.numpy()).max())}))
""")
# Prepended to SCRIPT: the process cannot import the MLIR bindings (a GPU machine with cached
# code and no bindings).
NO_MLIR = textwrap.dedent("""
    import sys
    class _NoMLIR:
        def find_spec(self, name, path=None, target=None):
            if name == "mlir" or name.startswith("mlir."):
                raise ImportError("the MLIR bindings are blocked in this process")
    sys.meta_path.insert(0, _NoMLIR())
""")


def _run(cache: str, no_mlir: bool = False) -> dict:
    import json

    env = dict(os.environ, BLUTRAIN_COMPILE_CACHE=cache)
    env.pop("BLUTRAIN_COMPILE_DUMP", None)
    r = subprocess.run(
        [sys.executable, "-c", (NO_MLIR if no_mlir else "") + SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cache_hits_across_processes_and_corrupt_entries_rebuild(tmp_path) -> None:
    cache = str(tmp_path / "cache")
    first = _run(cache)
    second = _run(cache)
    assert first["cache"] == "miss" and second["cache"] == "hit"
    assert first["err"] < 1e-6 and second["err"] < 1e-6
    # a hit needs no MLIR at all (Note [cache hits without MLIR] in cache.py)
    blind = _run(cache, no_mlir=True)
    assert blind["cache"] == "hit" and not blind["mlir"] and blind["err"] < 1e-6
    (entry,) = [p for p in (tmp_path / "cache").iterdir()]
    so = entry / "kernels.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    third = _run(cache)  # checksum mismatch: rebuilt, not trusted
    assert third["cache"] == "miss" and third["err"] < 1e-6
    assert _run(cache)["cache"] == "hit"


def test_graph_json_roundtrip_and_hash_stable() -> None:
    x = bt.randn(3, 4)
    with bt.capture() as cg:
        cg.mark_output(bt.softmax(x * 0.1, -1))
    g = btc.from_capture(cg)
    g2 = btc.Graph.from_json(g.to_json())
    assert g2.hash() == g.hash() and g2.to_json() == g.to_json()
    with bt.capture() as cg:
        cg.mark_output(bt.softmax(x * 0.1000001, -1))
    assert btc.from_capture(cg).hash() != g.hash()  # exact scalars


def test_ptx_for_sm90_without_a_gpu() -> None:
    x, w, b = bt.randn(4, 32), bt.randn(32), bt.randn(32)
    with bt.capture() as cg:
        cg.mark_output(bt.softmax(bt.layer_norm(x, (32,), w, b) * 2, -1).sum(-1))
    part, code = program.ptx_for(btc.from_capture(cg))
    assert code.ptx and all(".target sm_90" in p and ".entry" in p for p in code.ptx.values())
    assert set(code.functions) == {G.name for G in part.groups}


def test_any_op_falls_back_through_replay_and_random_ops_draw_as_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """argmax has no lowering: blutrain.tensor's replay runs it (one log line); dropout runs
    eagerly by design and draws the same mask as eager, and the generator ends where eager's
    does (the capture's own advance is undone)."""
    x = bt.randn(6, 10)

    def f(t):
        return (t.exp() * 2).argmax(-1), bt.dropout(t * 3, 0.5, True).sum()

    c = btc.compile(f)
    with caplog.at_level(logging.WARNING, logger="blutrain.compiler"):
        bt.manual_seed(5)
        got = c(x)
    after_compiled = bt._tensor._get_rng_state()
    bt.manual_seed(5)
    ref = f(x)
    assert after_compiled == bt._tensor._get_rng_state()
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert sum("argmax" in r.message for r in caplog.records) == 1
    bt.manual_seed(6)
    got2 = c(x)  # a second call: fresh draws, as eager's second call
    bt.manual_seed(6)
    np.testing.assert_array_equal(got2[1].numpy(), f(x)[1].numpy())


def test_eager_step_given_another_layout_than_captured() -> None:
    """Note [input layouts] (eager.py): eager's rotary-style elementwise ops keep q's permuted
    (B, H, T, D) layout, the fused kernel writes its output contiguous, and flash attention
    (a replayed node) is then handed strides the capture did not record. The node is
    specialized to the layout it gets (no copy): values and gradients equal eager's, the
    second call reuses the specialization, and nothing more than eager's results allocates."""
    import blutrain.alloc as alloc

    rng = np.random.default_rng()
    B, T, H, D = 2, 16, 4, 8
    cos = bt.tensor(rng.standard_normal((T, D)).astype(np.float32))

    def f(x, k, v):
        q = x.reshape(B, T, H, D).permute(0, 2, 1, 3)
        q = q * cos + q * 0.5  # elementwise: eager keeps q's layout
        return bt.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    def args():
        x = bt.tensor(rng.standard_normal((B, T, H * D)).astype(np.float32))
        k, v = (bt.tensor(rng.standard_normal((B, H, T, D)).astype(np.float32)) for _ in range(2))
        return x, k, v

    with bt.backends.use_flash_attention_cpu(True):
        c = btc.compile(f)
        for _ in range(3):
            a = args()
            assert float(c(*a).item()) == float(f(*a).item())
        (p,) = [v.prog for v in c.programs.values()]
        (att,) = [
            s.node
            for s in p.part.steps
            if "attention" in getattr(getattr(s, "node", None), "op", "")
        ]
        assert len(att._replays) == 1  # one layout, specialized once
        a = args()
        before = alloc.stats("cpu")["alloc_count"]
        c(*a)
        # what the program names as fresh (the attention's results, the returned sum): no copy
        assert alloc.stats("cpu")["alloc_count"] - before == len(p.fresh_values())


@pytest.mark.parametrize("residual", ["float32", "compute"])
def test_gpt2_bf16_steps_on_cpu(residual: str) -> None:
    """GPT-2's bf16 training step compiled, with its default float32 residual stream (the
    mixed layer norms: float32 rows into bf16 outputs, the stream's gradient in bf16) and with
    the bf16 stream: losses within one bf16 ulp (2^-7 relative) of eager's, parameters 1e-2
    normwise, as the LLaMA bf16 step (the float32 stream did not compile before)."""
    from compiler_cases import gpt2_bf16_steps, normwise

    runs = gpt2_bf16_steps(residual, "cpu")
    (le, pe), (lc, pc) = runs["eager"], runs["compiled"]
    for a, b in zip(lc, le):
        assert abs(a - b) <= 2.0**-7 * abs(b), (le, lc)
    assert normwise(pc, pe) <= 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_steps_through_flash_attention_on_cpu(dtype: str) -> None:
    """The GPU's failing case on the CPU: the LLaMA-style tiny training step with attention as
    the flash-attention op (a replayed node, as on CUDA) reading rotary q / k that a fused kernel
    wrote contiguous; fp32 and bf16 (CPU bf16: the f64 -> bf16 casts round through float32, as
    eager's). Tolerances: fp32 losses 1e-6 relative and parameters 1e-5 normwise (as the
    model-step tests), and the GPU test's rule against float64 (Note [tolerance relative to
    float64]); bf16 losses within one bf16 ulp (2^-7 relative), parameters 1e-2."""
    from compiler_cases import check_against_float64, llama_steps, normwise

    f32 = dtype == "float32"
    with bt.backends.use_flash_attention_cpu(True):
        runs = llama_steps(getattr(bt, dtype), "cpu", ref64=f32)
    (le, pe), (lc, pc) = runs["eager"], runs["compiled"]
    tol, ptol = (1e-6, 1e-5) if f32 else (2.0**-7, 1e-2)
    for a, b in zip(lc, le):
        assert abs(a - b) <= tol * abs(b), (le, lc)
    assert normwise(pc, pe) <= ptol
    if f32:
        check_against_float64(runs, floor=4 * 2.0**-24)


def _repeated_layers(x, w):
    for _ in range(3):  # three layers: the same fused body between GEMMs
        x = bt.linear(bt.tanh(x * 2.0) + x, w)
    return bt.softmax(x, -1).sum(-1)


def test_identical_groups_compile_once_and_reload_from_the_cache(tmp_path, monkeypatch) -> None:
    """Note [identical groups]: groups whose lowered functions are the same but for their names
    share one compiled kernel, each run on its own buffers: same values as eager, fewer
    functions compiled than groups, and a cache hit (a fresh compile of the same function)
    finds each group's kernel through the stored aliases."""
    import ctypes

    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", str(tmp_path))
    rng = np.random.default_rng()
    x = bt.tensor(rng.standard_normal((16, 32)).astype(np.float32))
    w = bt.tensor((rng.standard_normal((32, 32)) * 0.2).astype(np.float32))
    ref = _repeated_layers(x, w).numpy()
    for cache in ("miss", "hit"):
        c = btc.compile(_repeated_layers)
        np.testing.assert_allclose(c(x, w).numpy(), ref, rtol=1e-6, atol=1e-6)
        (p,) = [v.prog for v in c.programs.values()]
        assert p.stats.cache == cache
        if cache == "miss":
            assert p.stats.groups == 4 and p.stats.compiled_functions == 2, p.stats
        addresses = {ctypes.cast(k.fn, ctypes.c_void_p).value for k in p.kernels.values()}
        assert len(p.kernels) == 4 and len(addresses) == 2  # 4 groups, 2 compiled functions


def test_cuda_graph_flag_on_the_cpu_runs_the_program_as_before() -> None:
    """compile(fn, cuda_graph=True) on a CPU target: no graph (CUDA only), same results, and the
    results are fresh each call (no graph buffers to overwrite)."""
    x = bt.randn(8, 16)

    def f(x):
        return (x * 2).softmax(-1).sum(-1)

    c = btc.compile(f, cuda_graph=True)
    outs = [c(x) for _ in range(4)]
    (prog,) = c.programs.values()
    assert not prog.use_graph and prog.cuda_graph is None
    for o in outs:
        np.testing.assert_allclose(o.numpy(), f(x).numpy(), rtol=1e-6)
