"""Parallel CPU kernels (Note [parallel CPU loops] in pipelines.py; runtime src/kmp_pool.c).

Kernels over at least PARALLEL_MIN elements run their outermost parallel loop on
blutrain.tensor's CPU pool, within its budget (bt.set_num_threads); reductions stay serial per
row, so the parallel kernels must equal the serial ones bit for bit (tolerance 0), and eager to
1e-6 of the largest magnitude. Shapes are odd so the static
blocks split unevenly across threads.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import blutrain.compiler as btc
import blutrain.tensor as bt
from blutrain.compiler import backend_cpu, pipelines

RNG = np.random.default_rng()


def rand(*shape: int) -> bt.Tensor:
    return bt.tensor(RNG.uniform(-2.0, 2.0, shape).astype(np.float32))


CASES = {
    "elementwise": (
        lambda x, w: (x * w).tanh() + x.exp() * 0.5,
        lambda: (rand(259, 131), rand(131)),
    ),
    "softmax": (lambda x, w: bt.softmax(x * 2.0 + w, -1), lambda: (rand(263, 129), rand(129))),
    "layer_norm": (
        lambda x, w: bt.layer_norm(x, (x.shape[-1],), w, w * 0.5) * 3.0,
        lambda: (rand(257, 133), rand(133)),
    ),
    "column_sum": (
        lambda x, w: (x * w).sum(0) + (x * x).sum(-1).sum(),
        lambda: (rand(261, 127), rand(127)),
    ),
}


def test_runtime_is_loaded() -> None:
    """libbtc_omp is built and installed with the package (else kernels silently go serial)."""
    assert backend_cpu.omp_threads() >= 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_parallel_kernels_equal_serial_bitwise(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    fn, make = CASES[name]
    args = make()
    assert args[0].numel() >= pipelines.PARALLEL_MIN
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path / "par"))
    par = btc.compile(fn)(*args).numpy()
    loops = "".join(p.read_text() for p in (tmp_path / "par").glob("*/03-loops.mlir"))
    assert "omp.parallel" in loops and "omp.wsloop" in loops
    monkeypatch.setattr(pipelines, "PARALLEL_MIN", 1 << 62)
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path / "ser"))
    ser = btc.compile(fn)(*args).numpy()
    loops = "".join(p.read_text() for p in (tmp_path / "ser").glob("*/03-loops.mlir"))
    assert "omp.parallel" not in loops
    np.testing.assert_array_equal(par, ser)
    ref = np.asarray(fn(*args).numpy(), np.float64)
    err = np.abs(par - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= 1e-6, err


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def test_forks_run_on_eager_pool_within_the_budget() -> None:
    """One pool, one budget (issue 36): a compiled kernel's fork uses bt.get_num_threads()
    threads of blutrain.tensor's own pool, so compiled kernels start no thread of their own
    (no second runtime idling on a core), a budget of 1 runs them on the caller, and the
    results are the same bits at every budget."""
    fn, make = CASES["layer_norm"]
    args = make()
    c = btc.compile(fn)
    c(*args)  # compiled first (the JIT may start threads of its own)
    old = bt.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            bt.set_num_threads(n)
            assert backend_cpu.omp_threads() == n
            (args[0] * 2.0).exp()  # eager's pool at this budget exists (its workers started)
            before = _threads()
            outs.append(c(*args).numpy())
            assert _threads() == before, (n, before, _threads())
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], outs[2])
    finally:
        bt.set_num_threads(old)


@pytest.mark.parametrize("C", [1000, 1001, 1005, 21, 13, 7])
@pytest.mark.parametrize("rows", [3, 67])
def test_row_kernels_keep_eager_bits(C: int, rows: int, tmp_path, monkeypatch) -> None:
    """Note [row reductions in lanes]: softmax's and cross-entropy's max and exp sum run in
    eager's 8 lanes, the softmax / log_softmax backward's sums in its 16 (the tail into lane 0,
    lanes combined in order), and the log_softmax / cross-entropy backward take eager's float
    exp, so compiled CPU results (softmax, log_softmax, cross-entropy, forward and backward)
    equal eager's bit for bit: serial (3 rows) and parallel (67 rows) kernels, rows of a
    multiple of 8 classes, with a tail of 1 and 5, and shorter than the lanes. The parallel
    kernels' exp-sum loop is 8-wide vector code."""
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    x = bt.tensor(RNG.normal(0.0, 3.0, (rows, C)).astype(np.float32), requires_grad=True)
    w = rand(C)
    t = bt.tensor(RNG.integers(0, C, rows).astype(np.int64))

    def step(x: bt.Tensor, t: bt.Tensor, w: bt.Tensor) -> tuple[bt.Tensor, bt.Tensor]:
        h = x * w
        loss = (
            bt.cross_entropy(h, t)
            + (bt.softmax(h * 0.5, -1) * w).sum()
            + (bt.log_softmax(h * 0.25, -1) * w).mean()
        )
        loss.backward()
        return loss, bt.softmax(h, -1)

    outs = []
    for f in (step, btc.compile(step)):
        x.grad = None
        loss, sm = f(x, t, w)
        outs.append((loss.detach().numpy(), sm.detach().numpy(), x.grad.numpy()))
    for e, c in zip(*outs):
        np.testing.assert_array_equal(c, e)
    if rows * C >= pipelines.PARALLEL_MIN and C >= 16:
        loops = "".join(p.read_text() for p in tmp_path.glob("*/03-loops.mlir"))
        assert "omp.parallel" in loops and "vector<8xf64>" in loops


@pytest.mark.parametrize("C", [48, 37, 7])
@pytest.mark.parametrize("rows", [3, 64, 67, 2113])
def test_layer_norm_keeps_eager_bits(C: int, rows: int, monkeypatch) -> None:
    """Compiled CPU layer_norm / add_layer_norm, forward and backward, equal eager bit for bit:
    the row statistics and the backward's row sums in eager's 16 double lanes, a float32 row
    normalised in float from the double statistics (Note [float normalize] in blutrain.tensor's
    cpu/norm_kernels.h), dweight / dbias / dsum summed per block of block_rows(R) rows and the
    partials added in block order (Note [column blocks in the compiler], lower.py). Rows: one
    block (3), whole blocks of 32 (64), a ragged last block (67), blocks of 34 rows with a
    ragged last one (2113); columns: lanes with tails of 0 and 5, and shorter than the lanes."""
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    x = bt.tensor(RNG.normal(0.5, 2.0, (rows, C)).astype(np.float32), requires_grad=True)
    r = bt.tensor(RNG.normal(0.0, 1.0, (rows, C)).astype(np.float32), requires_grad=True)
    w, b, rb = (
        bt.tensor(RNG.uniform(-2.0, 2.0, C).astype(np.float32), requires_grad=True)
        for _ in range(3)
    )
    g = rand(rows, C)

    def step(x, r, w, b, rb, g):
        s, y = bt.add_layer_norm(x, r, w, b, 1e-5, residual_bias=rb)
        h = bt.layer_norm(y * 1.5 + s, (C,), w, None)
        loss = (h * g).sum() + (s * g).mean()
        loss.backward()
        return loss, h

    leaves = (x, r, w, b, rb)
    outs = []
    for f in (step, btc.compile(step)):
        for t in leaves:
            t.grad = None
        loss, h = f(x, r, w, b, rb, g)
        outs.append([loss.detach().numpy(), h.detach().numpy()] + [t.grad.numpy() for t in leaves])
    for k, (e, c) in enumerate(zip(*outs)):
        np.testing.assert_array_equal(c, e, err_msg=f"output {k}")


@pytest.mark.parametrize("C,pad", [(1001, 23), (1000, 24)])
def test_sliced_logits_vectorize_and_keep_eager_bits(C: int, pad: int, tmp_path, monkeypatch):
    """GPT-2's logits are the first 50257 of 50304 padded columns: a slice at offset 0 with
    unit strides, whose strided layout affine-super-vectorize refuses. The loops read it
    through its base buffer (Note [slices read through their base], pipelines.py), so the loss
    kernel's max, exp sum and gradient loops are vector code, and the results (loss, the
    padded logits' gradient: zeros in the padding) are eager's bit for bit. Both a ragged
    (1001) and a whole number of lanes (1000)."""
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    rows = 67  # rows * C >= PARALLEL_MIN: the parallel kernels
    x = bt.tensor(RNG.normal(0.0, 3.0, (rows, C + pad)).astype(np.float32), requires_grad=True)
    t = bt.tensor(RNG.integers(0, C, rows).astype(np.int64))

    def step(x: bt.Tensor, t: bt.Tensor) -> bt.Tensor:
        loss = bt.cross_entropy(x[:, :C] * 1.5, t)
        loss.backward()
        return loss

    outs = []
    for f in (step, btc.compile(step)):
        x.grad = None
        loss = f(x, t)
        outs.append((loss.detach().numpy(), x.grad.numpy()))
    for e, c in zip(*outs):
        np.testing.assert_array_equal(c, e)
    assert not outs[1][1][:, C:].any()
    (mlir,) = tmp_path.glob("*/03-loops.mlir")
    loops = mlir.read_text()
    assert "omp.parallel" in loops
    # no scalar access through the strided slice is left, and the exp sum is vector code
    assert not re.search(r"memref\.load %subview\S*\[", loops), "a load through the slice"
    assert "vector<8xf64>" in loops and "vector.transfer_read %arg0" in loops


def test_fold_unit_subviews_only_moves_identity_slices() -> None:
    """A slice at offset 0 with unit strides is read through its base at the same indices;
    one at another offset, or with a stride, keeps its own accesses."""
    from mlir import ir

    from blutrain.compiler.program import _fold_unit_subviews

    src = """
    func.func @f(%a: memref<4x10xf32>, %o: memref<4x7xf32>) {
      %s = memref.subview %a[0, 0] [4, 7] [1, 1]
          : memref<4x10xf32> to memref<4x7xf32, strided<[10, 1]>>
      %t = memref.subview %a[0, 3] [4, 7] [1, 1]
          : memref<4x10xf32> to memref<4x7xf32, strided<[10, 1], offset: 3>>
      %u = memref.subview %a[0, 0] [4, 5] [1, 2]
          : memref<4x10xf32> to memref<4x5xf32, strided<[10, 2]>>
      affine.for %i = 0 to 4 {
        affine.for %j = 0 to 5 {
          %v = affine.load %s[%i, %j] : memref<4x7xf32, strided<[10, 1]>>
          %w = affine.load %t[%i, %j] : memref<4x7xf32, strided<[10, 1], offset: 3>>
          %x = affine.load %u[%i, %j] : memref<4x5xf32, strided<[10, 2]>>
          %y = arith.addf %v, %w : f32
          %z = arith.addf %y, %x : f32
          affine.store %z, %o[%i, %j] : memref<4x7xf32>
        }
      }
      return
    }"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(src)
        assert _fold_unit_subviews(m) == 1
        assert m.operation.verify()
        text = str(m)
    assert "affine.load %arg0[%arg2, %arg3] : memref<4x10xf32>" in text
    assert "affine.load %subview_0[" in text and "affine.load %subview_1[" in text


@pytest.mark.parametrize("start,stop,step", [(0, 1001, 1), (3, 900, 1), (2, 1000, 3)])
def test_slice_scatter_fuses_on_the_cpu(start: int, stop: int, step: int, tmp_path, monkeypatch):
    """Note [slice_scatter in the kernel] (lower.py): a slice's backward (slice_scatter into
    zeros) joins the kernel computing the gradient, which writes straight into the result's
    slice: one kernel, no eager step, no copy left after bufferization, eager's bits (the
    gradient, and zeros outside the slice). Offsets, and a stride; a GPU partition keeps
    slice_scatter an eager step."""
    from blutrain.compiler import fusion

    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    rows = 67
    x = bt.tensor(RNG.normal(0.0, 3.0, (rows, 1024)).astype(np.float32), requires_grad=True)
    n = len(range(start, stop, step))
    t = bt.tensor(RNG.integers(0, n, rows).astype(np.int64))

    def step_fn(x: bt.Tensor, t: bt.Tensor) -> bt.Tensor:
        loss = bt.cross_entropy(x[:, start:stop:step] * 1.5, t)
        loss.backward()
        return loss

    outs = []
    for f in (step_fn, c := btc.compile(step_fn)):
        x.grad = None
        loss = f(x, t)
        outs.append((loss.detach().numpy(), x.grad.numpy()))
    for e, got in zip(*outs):
        np.testing.assert_array_equal(got, e)
    (prog,) = [p.prog for p in c.programs.values()]
    assert prog.stats.eager_steps == 0 and prog.stats.groups == 1, prog.stats
    assert any(n.op == "slice_scatter" for n in prog.part.groups[0].compute_nodes())
    (buf,) = tmp_path.glob("*/02-bufferized.mlir")
    assert "memref.copy" not in buf.read_text()
    gpu = fusion.partition(prog.graph)  # cpu=False: what ptx_for and the GPU build use
    assert any(
        getattr(s, "node", None) is not None and s.node.op == "slice_scatter" for s in gpu.steps
    )


def test_strided_copies_become_loops() -> None:
    """A memref.copy with a strided side (what bufferization leaves where a fused slice_scatter
    inserts a slice of another value) becomes linalg.copy: LLVM would lower it to a call of
    the runtime's memrefCopy, which the JIT lacks. A contiguous copy stays (memcpy)."""
    from mlir import ir

    from blutrain.compiler.program import _strided_copies_as_loops

    src = """
    func.func @f(%a: memref<4x10xf32>, %o: memref<4x10xf32>, %p: memref<4x10xf32>) {
      %s = memref.subview %a[0, 3] [4, 7] [1, 1]
          : memref<4x10xf32> to memref<4x7xf32, strided<[10, 1], offset: 3>>
      %t = memref.subview %o[0, 0] [4, 7] [1, 1]
          : memref<4x10xf32> to memref<4x7xf32, strided<[10, 1]>>
      memref.copy %s, %t
          : memref<4x7xf32, strided<[10, 1], offset: 3>> to memref<4x7xf32, strided<[10, 1]>>
      memref.copy %a, %p : memref<4x10xf32> to memref<4x10xf32>
      return
    }"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(src)
        assert _strided_copies_as_loops(m) == 1
        assert m.operation.verify()
        text = str(m)
    assert "linalg.copy" in text and text.count("memref.copy") == 1


def test_small_nests_of_a_parallel_kernel_stay_serial() -> None:
    """Note [small nests stay serial] (program.py): in a parallel kernel, a parallel loop whose
    nest does fewer than PARALLEL_MIN iterations (a row statistic, a lane fill) becomes a serial
    loop, with the same body; a nest at or above it, and one with a bound only known at run
    time, keep their fork."""
    from mlir import ir

    from blutrain.compiler.program import _serialize_small_nests

    src = """
    func.func @f(%a: memref<64xf32>, %b: memref<512x100xf32>, %n: index) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
      %c64 = arith.constant 64 : index
      %c100 = arith.constant 100 : index
      %c512 = arith.constant 512 : index
      scf.parallel (%i) = (%c0) to (%c64) step (%c1) {
        %v = memref.load %a[%i] : memref<64xf32>
        %w = arith.addf %v, %v : f32
        memref.store %w, %a[%i] : memref<64xf32>
        scf.reduce
      }
      scf.parallel (%i) = (%c0) to (%c512) step (%c1) {
        scf.for %j = %c0 to %c100 step %c8 {
          %v = memref.load %b[%i, %j] : memref<512x100xf32>
          memref.store %v, %b[%i, %j] : memref<512x100xf32>
        }
        scf.reduce
      }
      scf.parallel (%i) = (%c0) to (%n) step (%c1) {
        %v = memref.load %a[%i] : memref<64xf32>
        memref.store %v, %a[%i] : memref<64xf32>
        scf.reduce
      }
      return
    }"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(src)
        assert _serialize_small_nests(m, pipelines.PARALLEL_MIN) == 1  # 64 < 32768 <= 51200
        assert m.operation.verify()
        text = str(m)
    assert text.count("scf.parallel") == 2 and text.count("scf.for") == 2
    assert "arith.addf %0, %0" in text  # the serialized body, unchanged


def test_sole_worksharing_loops_skip_the_barrier_before_the_join(tmp_path, monkeypatch) -> None:
    """Note [no barrier before the join] (program.py): every omp.wsloop alone in its
    omp.parallel region is `nowait` (the region's join waits for the team anyway), and the
    kernels still equal eager (the parallel-equals-serial tests above run the same code)."""
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    x, w = rand(263, 129), rand(129)
    f = btc.compile(lambda a, b: bt.softmax(a * 2.0 + b, -1))
    np.testing.assert_allclose(
        f(x, w).numpy(), bt.softmax(x * 2.0 + w, -1).numpy(), rtol=0, atol=1e-6
    )
    (mlir,) = tmp_path.glob("*/03-loops.mlir")
    text = mlir.read_text()
    assert text.count("omp.wsloop") >= 1
    assert text.count("omp.wsloop nowait") == text.count("omp.wsloop")


@pytest.mark.parametrize("T", [64, 67])
def test_causal_softmax_reads_positions_and_vectorizes(T: int, tmp_path, monkeypatch) -> None:
    """Note [positions as operands] (lower.py): the causal mask's integer aranges are constant
    operands on the CPU, not the loop's index, so affine-super-vectorize takes the attention
    softmax's loops (the exp polynomial included: no scalar float32 fma is left; with the
    index it stayed scalar, 4x slower). Forward and backward equal eager bit for bit, the
    returned mask and position values too (a ragged T as well)."""
    monkeypatch.setenv("BLUTRAIN_COMPILE_CACHE", "0")
    monkeypatch.setenv("BLUTRAIN_COMPILE_DUMP", str(tmp_path))
    x = bt.tensor(RNG.normal(0.0, 3.0, (2, 4, T, T)).astype(np.float32), requires_grad=True)
    g = rand(2, 4, T, T)

    def step(x: bt.Tensor, g: bt.Tensor):
        i = bt.arange(T)
        pos = bt.arange(5, 5 + 3 * T, 3)
        mask = i.reshape(1, T).gt(i.reshape(T, 1))
        y = bt.softmax((x * 0.25).masked_fill(mask, float("-inf")), -1)
        (y * g).sum().backward()
        return y, mask, pos * 2

    outs = []
    for f in (step, btc.compile(step)):
        x.grad = None
        y, mask, pos = f(x, g)
        outs.append([y.detach().numpy(), mask.numpy(), pos.numpy(), x.grad.numpy()])
    for k, (e, c) in enumerate(zip(*outs)):
        np.testing.assert_array_equal(c, e, err_msg=f"output {k}")
    np.testing.assert_array_equal(outs[1][2], 2 * np.arange(5, 5 + 3 * T, 3))
    loops = "".join(p.read_text() for p in tmp_path.glob("*/03-loops.mlir"))
    assert "memref.get_global" in loops
    assert re.search(r"math\.fma [^\n]*: vector<8xf32>\n", loops), "the exp is scalar code"
    if T % 8 == 0:  # else a row's tail (T % 8 elements, in the sum's order) stays scalar
        assert not re.search(r"math\.fma [^\n]*: f32\n", loops), "a scalar exp is left"


_CHAIN = """
func.func @f(%a: memref<1024x50304xf32>, %o: memref<1024x50257xf32>) -> f32 {
  %c0 = arith.constant 0 : index
  %e = memref.expand_shape %a [[0, 1], [2]] output_shape [8, 128, 50304]
      : memref<1024x50304xf32> into memref<8x128x50304xf32>
  %s = memref.subview %e[0, 0, OFF] [8, 128, 50257] [1, 1, 1]
      : memref<8x128x50304xf32> to memref<8x128x50257xf32, strided<[6438912, 50304, 1]SOFF>>
  %c = memref.collapse_shape %s [[0, 1], [2]]
      : memref<8x128x50257xf32, strided<[6438912, 50304, 1]SOFF>>
      into memref<1024x50257xf32, strided<[50304, 1]SOFF>>
  %v = memref.load %c[%c0, %c0] : memref<1024x50257xf32, strided<[50304, 1]SOFF>>
  %t = memref.transpose %o (i, j) -> (j, i)
      : memref<1024x50257xf32> to memref<50257x1024xf32, strided<[1, 50257]>>
  %w = memref.load %t[%c0, %c0] : memref<50257x1024xf32, strided<[1, 50257]>>
  memref.store %v, %c[%c0, %c0] : memref<1024x50257xf32, strided<[50304, 1]SOFF>>
  %r = arith.addf %v, %w : f32
  return %r : f32
}
"""


@pytest.mark.parametrize("offset", [0, 1])
def test_loads_through_a_view_chain_read_its_buffer(offset: int) -> None:
    """program._fold_view_chain_loads: a load through expand_shape -> subview -> collapse_shape
    that starts where the buffer does, with its rank and strides (LLaMA's loss reading (B*T, V)
    of its (B*T, Vp) logits), reads the buffer at the same indices; a chain that starts one
    element in, a store, and a view with other strides keep their view."""
    from mlir import ir

    from blutrain.compiler import program

    text = _CHAIN.replace("SOFF", f", offset: {offset}" if offset else "")
    text = text.replace("OFF", str(offset))
    with ir.Context():
        m = ir.Module.parse(text)
        moved = program._fold_view_chain_loads(m)
        out = str(m)
    assert moved == (1 if offset == 0 else 0), out
    if offset == 0:
        assert "memref.load %arg0[%c0, %c0] : memref<1024x50304xf32>" in out, out
    assert "memref.store %0, %collapse_shape" in out, out  # stores keep the view
    assert "memref.load %transpose" in out, out


_ROWS = """
func.func @f(%x: memref<64x32xf32>, %y: memref<64xf32>, %z: memref<64x32xf32>) {
  %c0 = arith.constant 0.0 : f32
  %m = memref.alloca() : memref<64xf32>
  affine.for %r = 0 to 64 {
    affine.store %c0, %m[%r] : memref<64xf32>
  }
  affine.for %r = 0 to 64 {
    affine.for %j = 0 to 32 {
      %v = affine.load %x[%r, %j] : memref<64x32xf32>
      %a = affine.load %m[%r] : memref<64xf32>
      %s = arith.addf %v, %a : f32
      affine.store %s, %m[%r] : memref<64xf32>
    }
  }
  affine.for %r = 0 to 64 {
    %a = affine.load %m[READ] : memref<64xf32>
    affine.store %a, %y[%r] : memref<64xf32>
  }
  return
}
"""


@pytest.mark.parametrize("read", ["%r", "63 - %r"])
def test_row_nests_fuse_only_when_every_shared_buffer_stays_in_its_row(read: str) -> None:
    """Note [one row at a time]: consecutive nests over the same rows become one loop over the
    rows when each buffer they share (here the row sums %m, and the output) is read and written
    at the loop's own row only; a nest that reads another row's value (row 63 - r, written
    later in a fused loop) keeps its own loop after the others."""
    from mlir import ir

    from blutrain.compiler import program

    with ir.Context():
        m = ir.Module.parse(_ROWS.replace("READ", read))
        merged = program._fuse_row_loops(m)
        assert m.operation.verify()
        out = str(m)
    top = [ln for ln in out.splitlines() if ln.startswith("    affine.for")]
    if read == "%r":
        assert merged == 2 and len(top) == 1, out
    else:
        assert merged == 1 and len(top) == 2, out  # the init and the sums fuse; not the reader
