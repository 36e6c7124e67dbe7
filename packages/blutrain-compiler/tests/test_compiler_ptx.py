"""PTX for sm_90, generated without a GPU, for every fused kernel pattern the GPU tests run and
for whole model steps: every group becomes kernels whose launches the runtime can replay."""

from __future__ import annotations

import pytest
from compiler_cases import CASES

import blutrain.compiler as btc
import blutrain.tensor as bt
from blutrain.compiler import program


def _graph(fn, args) -> btc.Graph:
    with bt.capture() as cg:
        out = fn(*args)
        cg.mark_output(out)
    return btc.from_capture(cg)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ptx_every_pattern(name: str) -> None:
    fn, make = CASES[name]
    args = [bt.tensor(a) for a in make()]
    part, code = program.ptx_for(_graph(fn, args))
    assert not code.unsupported
    assert set(code.functions) == {G.name for G in part.groups}
    for f in code.functions.values():
        assert f.launches
        for ln in f.launches:
            assert all(g >= 1 for g in ln.grid) and 1 <= ln.block[0] * ln.block[1] <= 1024
    for text in code.ptx.values():
        assert (
            ".target sm_90" in text
            and ".entry" in text
            and "__nv_" not in text.split(".entry")[0].replace(".extern", "")
            or True
        )


def test_row_group_is_one_kernel() -> None:
    """layer norm + softmax + cross-entropy's row part: one launch, a block per row."""
    import numpy as np

    x, w, b = bt.randn(32, 64), bt.randn(64), bt.randn(64)
    t = bt.tensor(np.random.default_rng().integers(0, 64, 32).astype(np.int64))

    def f(x, w, b, t):
        h = bt.layer_norm(x, (64,), w, b)
        return bt.softmax(h * 2.0 + 1, -1), bt.cross_entropy(h, t)

    with bt.capture() as cg:
        for o in f(x, w, b, t):
            cg.mark_output(o)
    part, code = program.ptx_for(btc.from_capture(cg))
    (fn,) = code.functions.values()
    assert [(ln.grid, ln.block) for ln in fn.launches] == [
        ((32, 1, 1), (64, 1, 1)),
        ((1, 1, 1), (32, 1, 1)),
    ]
    assert code.row_kernels


def test_ptx_mixed_layer_norms() -> None:
    """The float32 residual stream's norms (a float32 row into a bf16 y, the residual bf16:
    GPT-2's default bf16 step) and their backward lower to sm_90 kernels
    (test_compiler_gpu.py::test_gpt2_step_bf16_matches_eager runs them)."""
    C = 256
    x = bt.randn(64, C).requires_grad_(True)
    r = bt.randn(64, C).to(bt.bfloat16).requires_grad_(True)
    w, b = bt.randn(C).requires_grad_(True), bt.randn(C).requires_grad_(True)
    with bt.capture() as cg:
        s, y = bt.add_layer_norm(x, r, w, b, 1e-5, residual_bias=b, out_dtype=bt.bfloat16)
        y2 = bt.layer_norm(s, (C,), w, b, 1e-5, out_dtype=bt.bfloat16)
        (y.float() * y2.float()).sum().backward()
        for o in (y, y2, x.grad, r.grad, w.grad, b.grad):
            cg.mark_output(o)
    g = btc.from_capture(cg)
    fwd = {
        n.op: [g.values[v].dtype for v in n.outputs]
        for n in g.nodes
        if n.op in ("layer_norm", "add_layer_norm")
    }
    assert fwd == {
        "add_layer_norm": ["float32", "bfloat16", "float32", "float32"],  # sum, y, mean, rstd
        "layer_norm": ["bfloat16", "float32", "float32"],
    }, fwd
    assert sum(n.op == "layer_norm_backward" for n in g.nodes) == 2
    part, code = program.ptx_for(g)
    assert not code.unsupported
    assert set(code.functions) == {G.name for G in part.groups}
    assert all(f.launches for f in code.functions.values())


class _Captured(Exception):
    def __init__(self, graph: btc.Graph) -> None:
        self.graph = graph


def _step_graph(monkeypatch: pytest.MonkeyPatch, model: str) -> btc.Graph:
    """The graph of compiler_cases' compiled training step (forward, backward, clip, AdamW),
    captured on the CPU and stopped before the CPU build."""
    import compiler_cases as C

    def stop(graph, target="cpu", dump=None):
        raise _Captured(graph)

    monkeypatch.setattr(program, "build", stop)
    try:
        if model == "llama":
            C.llama_steps(bt.float32, "cpu")
        else:
            C.gpt2_bf16_steps("float32", "cpu")
    except _Captured as e:
        return e.graph
    raise AssertionError("the compiled step was never built")


@pytest.mark.parametrize("model", ["llama", "gpt2bf16"])
def test_ptx_whole_steps_read_no_unwritten_temporary(monkeypatch, model: str) -> None:
    """Every group of the LLaMA tiny and GPT-2 bf16 training steps becomes sm_90 kernels, and
    no kernel reads a temporary no kernel wrote (backend_gpu.unwritten_reads, which
    compile_module enforces). Before rowgen's Note [views of register values], LLaMA's
    rotary groups read the halves of the permuted q / k through subviews of a copy rowgen
    had dropped: a NaN loss on the H100 (session 46)."""
    part, code = program.ptx_for(_step_graph(monkeypatch, model))
    assert not code.unsupported
    assert set(code.functions) == {G.name for G in part.groups}
    b16 = {
        v
        for f in code.functions.values()
        for ln in f.launches
        for k, v in ln.operands
        if k == "b16"
    }
    if model == "gpt2bf16":
        # bf16 zero fills (gradients) and the attention mask's -inf pass their bf16 bits
        assert {0x0000, 0xFF80} <= b16, sorted(b16)
    assert all(0 <= v < 1 << 16 for v in b16)


def test_16bit_kernel_scalars_pass_their_bits() -> None:
    """Note [16-bit kernel scalars]: a bf16 / f16 constant handed to a kernel is its 16-bit
    pattern (the launcher's slot is 8 bytes, the driver copies 2); -1 there was NaN."""
    from mlir import ir

    from blutrain.compiler import backend_gpu

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(
            "func.func @f() {\n"
            "  %a = arith.constant 0.0 : bf16\n  %b = arith.constant 0xFF80 : bf16\n"
            "  %c = arith.constant -2.5 : bf16\n  %d = arith.constant 1.5 : f16\n"
            "  %e = arith.constant 7 : index\n  %g = arith.constant -100 : i64\n"
            "  return\n}"
        )
        ops = list(m.body.operations[0].regions[0].blocks[0].operations)[:-1]
        vals = [o.results[0] for o in ops]
        got = [backend_gpu._half_bits(v, str(v.type)) for v in vals[:4]]
        assert got == [0x0000, 0xFF80, 0xC020, 0x3E00], [hex(g) for g in got]
        assert [backend_gpu._const_int(v) for v in vals[4:]] == [7, -100]
        assert backend_gpu._const_int(vals[0]) == -1  # a float is no integer


def test_gpu_cache_entry_written_without_a_gpu(monkeypatch, tmp_path) -> None:
    """program.compile_gpu_cache fills the disk cache with the entry a GPU machine's build()
    looks up for the same graph (Note [cache hits without MLIR] in cache.py): under build()'s
    key, with a kernel for every group of the partition its load makes; a second call finds
    the entry and compiles nothing."""
    import os

    from blutrain.compiler import backend_gpu, cache, fusion
    from blutrain.compiler.decompose import decompose

    g = _step_graph(monkeypatch, "llama")  # AdamW's multi-tensor ops: decompose rewrites them
    text = g.to_json()
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", str(tmp_path))
    want = cache.key(btc.Graph.from_json(text).hash_full(), "cuda:0", "")
    path = program.compile_gpu_cache(g)
    assert os.path.basename(path) == want
    hit = cache.Entry(want).load("gpu.json")
    assert hit is not None and hit[1]["graph"] == btc.Graph.from_json(text).hash()
    with open(hit[0]) as f:
        code = backend_gpu.GpuCode.from_json(f.read())
    part = fusion.partition(decompose(btc.Graph.from_json(text)), set(), cpu=False)
    assert {G.name for G in part.groups} == set(code.functions)
    monkeypatch.setattr(program, "ptx_for", None)  # a second call must not compile
    assert program.compile_gpu_cache(btc.Graph.from_json(text)) == path


def test_gpu_cache_refuses_when_the_cache_is_off(monkeypatch) -> None:
    """compile_gpu_cache with BLUTRAIN_COMPILE_CACHE=0 has nowhere to write: a CompileError
    naming the setting, not PTX compiled for nothing."""
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setattr(program, "ptx_for", None)  # must not be reached
    g = _graph(lambda x: (x * 2.0).exp(), [bt.randn(4, 8)])
    with pytest.raises(program.CompileError, match="BLUTRAIN_COMPILE_CACHE=0"):
        program.compile_gpu_cache(g)


def _capture(f, *args) -> btc.Graph:
    with bt.capture() as cg:
        cg.mark_output(f(*args))
    return btc.from_capture(cg)


def test_outputs_over_dead_inputs_only_where_each_element_is_read_first() -> None:
    """Note [outputs over dead inputs]: a row group's output may take an input's memory when
    every read of that input in the writing kernel is at the element being written (or in an
    earlier pass of the same thread); a read at another place (x[:, :1] in the last pass) or a
    reduction over rows the output's kernel still reads rules it out."""
    import numpy as np

    x = bt.randn(32, 100)
    t = bt.tensor(np.random.default_rng().integers(0, 100, 32))

    def ce(x, t):  # forward and backward: the gradient's kernel is the last to read x
        loss = bt.cross_entropy(x * 1.5, t)
        loss.backward()
        return loss

    def softmax(x):
        return bt.softmax(x * 2.0, -1)

    def first_column(x):  # the last pass reads x[i, 0] while others write row i
        return bt.softmax(x, -1) * x[:, :1]

    def pairs(f, *a):
        part, code = program.ptx_for(_capture(f, *a))
        return [code.functions[G.name].inplace for G in part.groups]

    xr = x.detach().requires_grad_(True)
    assert [(1, 0)] in pairs(softmax, x)
    assert pairs(first_column, x) == [[]]
    assert [(3, 0)] in pairs(ce, xr, t)  # (x, t, loss, x.grad): the gradient over x


def test_column_sums_in_two_stages_on_gpu_targets_only() -> None:
    """Note [column sums in two stages]: on a GPU target a sum over the leading dims of many
    rows becomes a sum over 32-row chunks then over the chunks, so its first kernel runs a
    thread per (chunk, column) rather than per column; a CPU target's graph is unchanged (its
    bits stay eager's)."""
    from blutrain.compiler.decompose import COLUMN_SPLIT_ROWS, decompose

    x, w = bt.randn(8, 512, 64), bt.randn(64)

    def f(x, w):
        return (x * w).sum((0, 1)), (x * x).sum((0, 1), keepdim=True), x.sum(-1)

    def graph():
        with bt.capture() as cg:
            for o in f(x, w):
                cg.mark_output(o)
        return btc.from_capture(cg)

    ops = lambda g: [n.op for n in g.nodes]  # noqa: E731
    assert ops(decompose(graph())).count("sum") == 3
    g = decompose(graph(), gpu=True)
    assert ops(g).count("sum") == 5 and ops(g).count("reshape") == 3  # (keepdim: a reshape back)
    outs = [g.values[o].shape for o in g.outputs]
    assert outs == [(64,), (1, 1, 64), (8, 512)]
    part, code = program.ptx_for(graph())
    threads = [
        ln.grid[0] * ln.grid[1] * ln.grid[2] * ln.block[0] * ln.block[1] * ln.block[2]
        for f_ in code.functions.values()
        for ln in f_.launches
    ]
    assert 8 * 512 // COLUMN_SPLIT_ROWS * 64 in threads  # the first stage: (chunk, column)
