"""CUDA elementwise kernels (src/cuda/elementwise.cu) against the CPU backend: full, arange,
random (rand / randn / randint: the same Philox numbers), astype (every dtype pair), slice_scatter
(through slicing's backward), every unary and binary op, where, masked_fill and dropout (the same
mask as the CPU), on fresh random inputs in every relevant dtype, with broadcasting, transposed and
stepped-slice inputs, misaligned views, and odd sizes (0, 1, 7, 1025, 3x5x7).

Each test is small and named per op / dtype / layout so a failure pinpoints the kernel path:
  flat-vector (contiguous, 16-byte aligned), flat-scalar (misaligned), flat-dense (one shared
  transposed layout), strided (broadcast / sliced operands), and 64-bit indexing (> 2^31 elements).
"""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

ALL = [bt.bool, bt.uint8, bt.int32, bt.int64, bt.float16, bt.bfloat16, bt.float32, bt.float64]
INTS = [bt.uint8, bt.int32, bt.int64]
FLOATS = [bt.float16, bt.bfloat16, bt.float32, bt.float64]
SHAPES = [(0,), (1,), (7,), (1025,), (3, 5, 7)]
NAMES = {str(d): d for d in ALL}

# Transcendental tolerances, GPU (libdevice) vs CPU (Cephes / libm): a few ulps of the dtype.
TOL = {
    bt.float64: dict(rtol=1e-12, atol=1e-13),
    bt.float32: dict(rtol=2e-6, atol=1e-6),  # atol: 1 + tanh cancellation in gelu
    bt.float16: dict(rtol=1e-3, atol=1e-3),
    bt.bfloat16: dict(rtol=8e-3, atol=8e-3),
}


def dname(d) -> str:
    return str(d).replace("blutrain.tensor.", "")


def npy(t: bt.Tensor) -> np.ndarray:
    """A CPU numpy copy (16-bit floats widened to float32, which is exact)."""
    t = t.detach().cpu()
    if t.dtype in (bt.float16, bt.bfloat16):
        t = t.to(bt.float32)
    return t.numpy()


def same(gpu: bt.Tensor, cpu: bt.Tensor, tol: dict | None = None, what: str = "") -> None:
    assert str(gpu.device).startswith("cuda"), f"{what}: result on {gpu.device}"
    assert gpu.dtype == cpu.dtype, f"{what}: dtype {gpu.dtype} != {cpu.dtype}"
    assert tuple(gpu.shape) == tuple(cpu.shape), f"{what}: shape {gpu.shape} != {cpu.shape}"
    g, c = npy(gpu), npy(cpu)
    if tol is None:
        np.testing.assert_array_equal(g, c, err_msg=what)  # NaN == NaN here
    else:
        np.testing.assert_allclose(g, c, equal_nan=True, err_msg=what, **tol)


def make(rng: np.random.Generator, shape, dtype, lo=-3.0, hi=3.0) -> bt.Tensor:
    """A fresh CPU tensor of `dtype` with values in [lo, hi) (ints: integers in that range)."""
    if dtype == bt.bool:
        return bt.tensor(np.asarray(rng.random(shape) < 0.5))
    if dtype in INTS:
        lo_i = 0 if dtype == bt.uint8 else int(lo)
        a = np.asarray(rng.integers(lo_i, max(int(hi), lo_i + 1), size=shape), dtype=np.int64)
        return bt.tensor(a).to(dtype)
    a = np.asarray(rng.uniform(lo, hi, size=shape), dtype=np.float64)
    return bt.tensor(a).to(dtype)


def cuda(t: bt.Tensor) -> bt.Tensor:
    return t.to("cuda")


# ---- creation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=dname)
@pytest.mark.parametrize("value", [0.0, 1.0, -2.75, 7.5])
@pytest.mark.parametrize("shape", SHAPES + [(1, 4099)], ids=str)
def test_full(dtype, value, shape):
    if dtype == bt.uint8 and value < 0:
        pytest.skip("negative to uint8 is undefined in C++")
    same(bt.full(shape, value, dtype=dtype, device="cuda"), bt.full(shape, value, dtype=dtype))


@pytest.mark.parametrize("dtype", [bt.int32, bt.int64] + FLOATS, ids=dname)
@pytest.mark.parametrize("args", [(0, 7, 1), (0, 1025, 1), (-3, 2.5, 0.25), (10, -5, -0.7)])
def test_arange(dtype, args):
    if dtype in (bt.int32, bt.int64) and any(isinstance(a, float) for a in args):
        args = tuple(int(a) if float(a).is_integer() else a for a in args)
    g = bt.arange(*args, dtype=dtype, device="cuda")
    same(g, bt.arange(*args, dtype=dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("n", [0, 1, 7, 1025, 4099])
def test_rand_same_numbers(dtype, n, rng):
    seed = int(rng.integers(0, 2**62))
    bt.manual_seed(seed)
    bt.rand(3, dtype=dtype)  # moves the offset: the second call starts mid-stream
    g = bt.rand(n, dtype=dtype, device="cuda")
    bt.manual_seed(seed)
    bt.rand(3, dtype=dtype)
    c = bt.rand(n, dtype=dtype)
    same(g, c, what=f"rand {dname(dtype)} n={n}")  # uniform: bit-exact


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("n", [1, 7, 1025, 4099])
def test_randn_same_numbers(dtype, n, rng):
    seed = int(rng.integers(0, 2**62))
    bt.manual_seed(seed)
    g = bt.randn(n, dtype=dtype, device="cuda")
    bt.manual_seed(seed)
    c = bt.randn(n, dtype=dtype)
    # Box-Muller in double on both sides: within an ulp of the dtype.
    same(g, c, dict(rtol=1e-13, atol=1e-13) if dtype == bt.float64 else TOL[dtype], f"randn {n}")
    if dtype == bt.float32:
        assert np.mean(npy(g) == npy(c)) > 0.99


@pytest.mark.parametrize("dtype", [bt.uint8, bt.int32, bt.int64, bt.float32], ids=dname)
@pytest.mark.parametrize("bounds", [(0, 10), (-5, 250), (0, 2**32)])
def test_randint_same_numbers(dtype, bounds, rng):
    if dtype == bt.uint8 and (bounds[0] < 0 or bounds[1] > 256):
        pytest.skip("out of uint8 range")
    if dtype in (bt.int32, bt.float32) and bounds[1] > 2**31:
        pytest.skip("out of range")
    seed = int(rng.integers(0, 2**62))
    bt.manual_seed(seed)
    g = bt.randint(bounds[0], bounds[1], (3, 5, 7), dtype=dtype, device="cuda")
    bt.manual_seed(seed)
    c = bt.randint(bounds[0], bounds[1], (3, 5, 7), dtype=dtype)
    same(g, c)


# ---- astype / contiguous / slice_scatter ------------------------------------------------------
@pytest.mark.parametrize("src", ALL, ids=dname)
@pytest.mark.parametrize("dst", ALL, ids=dname)
@pytest.mark.parametrize("layout", ["contig", "transposed", "stepped", "misaligned"])
def test_astype(src, dst, layout, rng):
    # Values valid in every dtype (non-negative, below 100, fractional for floats).
    x = make(rng, (9, 130), src, 0.0, 100.0)
    if layout == "transposed":
        x = x.transpose(0, 1)
    elif layout == "stepped":
        x = x[1::2, 3:120:3]
    elif layout == "misaligned":
        x = x.reshape(-1)[1:]
    same(cuda(x).to(dst), x.to(dst), what=f"{dname(src)}->{dname(dst)} {layout}")


@pytest.mark.parametrize("dtype", ALL, ids=dname)
def test_contiguous_of_views(dtype, rng):
    x = make(rng, (4, 6, 10), dtype)
    gx = cuda(x)
    for f in (
        lambda t: t.transpose(0, 2),
        lambda t: t[:, 1:5:2, ::3],
        lambda t: t.permute(2, 0, 1)[1:],
        lambda t: t[2].unsqueeze(0).expand(3, 6, 10),
    ):
        same(f(gx).contiguous(), f(x).contiguous())


# Views whose last dim stays contiguous (copy_rows_v4: rows of whole vectors at any offsets), and
# near misses that must take the scalar strided kernel (a row off the vector grid, a last dim that
# is not a multiple of the vector, a misaligned base): every one against the CPU.
ROW_VIEWS = {
    "heads": (lambda t: t.transpose(1, 2), (2, 9, 3, 64)),  # (B, T, H, D) -> (B, H, T, D)
    "heads_d16": (lambda t: t.permute(2, 0, 1, 3), (3, 5, 4, 16)),
    "slice_rows": (lambda t: t[:, 1:6:2], (4, 7, 32)),
    "slice_cols": (lambda t: t[:, :, 16:48], (3, 5, 64)),
    "expanded": (lambda t: t[:, :1].expand(3, 4, 32), (3, 2, 32)),
    "off_grid": (lambda t: t[:, :, 1:33], (3, 5, 40)),
    "odd_last": (lambda t: t.transpose(0, 1), (6, 4, 12)),
    "misaligned": (lambda t: t[1:].reshape(5, 3, 16)[:, ::2], (5 * 3 * 16 + 1,)),
}


@pytest.mark.parametrize("dtype", ALL, ids=dname)
@pytest.mark.parametrize("view", list(ROW_VIEWS))
def test_contiguous_of_row_views(dtype, view, rng):
    f, shape = ROW_VIEWS[view]
    x = make(rng, shape, dtype)
    same(f(cuda(x)).contiguous(), f(x).contiguous(), what=f"{dname(dtype)} {view}")


@pytest.mark.parametrize(
    "src,dst",
    [
        (bt.bfloat16, bt.float32),
        (bt.float32, bt.bfloat16),
        (bt.float16, bt.float32),
        (bt.int32, bt.float64),
    ],
    ids=lambda d: dname(d),
)
@pytest.mark.parametrize("view", ["heads", "slice_cols", "off_grid"])
def test_astype_of_row_views(src, dst, view, rng):
    f, shape = ROW_VIEWS[view]
    x = make(rng, shape, src, 0.0, 100.0)
    same(f(cuda(x)).to(dst), f(x).to(dst), what=f"{dname(src)}->{dname(dst)} {view}")


def test_copy_into_row_view(rng):
    # copy_ into a permuted destination (the output side of the row kernel)
    x = make(rng, (2, 3, 5, 64), bt.bfloat16)
    dst_cpu = bt.zeros(2, 5, 3, 64, dtype=bt.bfloat16)
    dst_gpu = cuda(dst_cpu)
    dst_cpu.transpose(1, 2).copy_(x)
    dst_gpu.transpose(1, 2).copy_(cuda(x))
    same(dst_gpu, dst_cpu)


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("sl", [(slice(None), slice(1, 7, 2)), (slice(2, 3), slice(None, None, 3))])
def test_slice_scatter_via_backward(dtype, sl, rng):
    # Slice's vjp is slice_scatter(zeros, g) on the input's device.
    x = make(rng, (5, 9), dtype)
    gx = cuda(x).requires_grad_(True)
    cx = x.detach().requires_grad_(True)
    gy, cy = gx[sl], cx[sl]
    g = make(rng, tuple(cy.shape), dtype)
    gy.backward(cuda(g))
    cy.backward(g)
    same(gx.grad, cx.grad)


# ---- unary ------------------------------------------------------------------------------------
FLOAT_UNARY = [
    "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "abs", "sigmoid", "relu", "sin", "cos", "erf",
    "sign", "gelu_tanh", "gelu_erf",
]  # fmt: skip
EXACT_UNARY = {"neg", "abs", "relu", "sign"}


def unary(name: str, t: bt.Tensor) -> bt.Tensor:
    if name == "gelu_tanh":
        return bt.gelu(t, approximate="tanh")
    if name == "gelu_erf":
        return bt.gelu(t)
    if name == "logical_not":
        return t.logical_not()
    return getattr(bt, name)(t)


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("op", FLOAT_UNARY)
def test_unary_float(op, dtype, rng):
    lo = 0.01 if op in ("log", "sqrt", "rsqrt") else -6.0
    for shape in SHAPES:
        x = make(rng, shape, dtype, lo, 6.0)
        g = unary(op, cuda(x))
        tol = None if op in EXACT_UNARY else TOL[dtype]
        same(g, unary(op, x), tol, f"{op} {dname(dtype)} {shape}")


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("op", FLOAT_UNARY + ["logical_not"])
def test_unary_special_values(op, dtype):
    v = [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 100.0, -100.0, 1e-30]
    x = bt.tensor(np.array(v)).to(dtype)
    tol = None if op in EXACT_UNARY | {"logical_not"} else TOL[dtype]
    same(unary(op, cuda(x)), unary(op, x), tol, f"{op} {dname(dtype)} special")


@pytest.mark.parametrize("dtype", [bt.bool] + INTS, ids=dname)
@pytest.mark.parametrize("op", ["neg", "abs", "relu", "sign", "logical_not"])
def test_unary_int(op, dtype, rng):
    if dtype == bt.bool and op == "neg":
        pytest.skip("neg of bool")
    x = make(rng, (3, 5, 7), dtype, -50, 50)
    try:
        c = unary(op, x)
    except (TypeError, ValueError, RuntimeError):
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            unary(op, cuda(x))
        return
    same(unary(op, cuda(x)), c, what=f"{op} {dname(dtype)}")


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32], ids=dname)
@pytest.mark.parametrize("op", ["exp", "gelu_tanh", "relu", "neg"])
@pytest.mark.parametrize("layout", ["transposed", "stepped", "misaligned", "expanded"])
def test_unary_layouts(op, dtype, layout, rng):
    x = make(rng, (33, 65), dtype)
    if layout == "transposed":  # dense: the output keeps the layout (flat-dense path)
        f = lambda t: t.transpose(0, 1)  # noqa: E731
    elif layout == "stepped":
        f = lambda t: t[::2, 1::3]  # noqa: E731
    elif layout == "misaligned":
        f = lambda t: t.reshape(-1)[3:]  # noqa: E731
    else:
        f = lambda t: t[:1].expand(5, 65)  # noqa: E731
    g = unary(op, f(cuda(x)))
    tol = None if op in EXACT_UNARY else TOL[dtype]
    same(g, unary(op, f(x)), tol, f"{op} {layout}")


# ---- binary -----------------------------------------------------------------------------------
ARITH = ["add", "sub", "mul", "div", "pow", "maximum", "minimum"]
CMP = ["eq", "ne", "lt", "le", "gt", "ge"]
LOGIC = ["logical_and", "logical_or"]


def binary(name: str, a, b):
    if name in LOGIC:
        return getattr(a, name)(b)
    return getattr(bt, name)(a, b)


def bin_tol(op, dtype):
    if op == "pow" and dtype in FLOATS:
        return TOL[dtype]
    return None  # IEEE add/sub/mul/div, compares, max/min, integer ops: bit-exact


def bin_inputs(op, dtype, shape_a, shape_b, rng):
    if op == "pow" and dtype in INTS:
        a = make(rng, shape_a, dtype, -4 if dtype != bt.uint8 else 0, 5)
        b = make(rng, shape_b, dtype, -2 if dtype != bt.uint8 else 0, 6)
    elif op == "pow" and dtype in FLOATS:
        a, b = make(rng, shape_a, dtype, 0.1, 3.0), make(rng, shape_b, dtype, -2.0, 3.0)
    elif op == "div" and dtype in INTS:
        a, b = make(rng, shape_a, dtype, -20, 20), make(rng, shape_b, dtype, 1, 9)
    else:
        a, b = make(rng, shape_a, dtype, -5, 5), make(rng, shape_b, dtype, -5, 5)
    return a, b


def bin_check(op, dtype, a, b, what):
    try:
        c = binary(op, a, b)
    except (TypeError, ValueError, RuntimeError):  # e.g. sub of bools: same error on CUDA
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            binary(op, cuda(a), cuda(b))
        return
    same(binary(op, cuda(a), cuda(b)), c, bin_tol(op, dtype), what)


@pytest.mark.parametrize("dtype", ALL, ids=dname)
@pytest.mark.parametrize("op", ARITH + CMP + LOGIC)
def test_binary_same_shape(op, dtype, rng):
    for shape in SHAPES:
        a, b = bin_inputs(op, dtype, shape, shape, rng)
        bin_check(op, dtype, a, b, f"{op} {dname(dtype)} {shape}")


BROADCASTS = [
    ((3, 1, 7), (5, 1)),
    ((1,), (3, 5, 7)),
    ((), (1025,)),
    ((4, 1), (1, 9)),
    ((0, 3), (3,)),
]


@pytest.mark.parametrize("dtype", ALL, ids=dname)
@pytest.mark.parametrize("op", ["add", "mul", "pow", "maximum", "lt", "logical_or"])
@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
def test_binary_broadcast(op, dtype, shapes, rng):
    a, b = bin_inputs(op, dtype, shapes[0], shapes[1], rng)
    bin_check(op, dtype, a, b, f"{op} {dname(dtype)} {shapes}")
    bin_check(op, dtype, b, a, f"{op} {dname(dtype)} {shapes} swapped")


@pytest.mark.parametrize("dtype", [bt.int32, bt.bfloat16, bt.float32, bt.float64], ids=dname)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "minimum", "ge"])
@pytest.mark.parametrize(
    "layout", ["both_transposed", "one_transposed", "stepped", "misaligned", "scalar"]
)
def test_binary_layouts(op, dtype, layout, rng):
    a, b = bin_inputs(op, dtype, (17, 40), (17, 40), rng)
    if layout == "both_transposed":  # one shared dense layout: the flat-dense path
        f, h = (lambda t: t.transpose(0, 1)), (lambda t: t.transpose(0, 1))
    elif layout == "one_transposed":
        b = bin_inputs(op, dtype, (40, 17), (40, 17), rng)[1]
        f, h = (lambda t: t), (lambda t: t.transpose(0, 1))
    elif layout == "stepped":
        f, h = (lambda t: t[1::2, 1::3]), (lambda t: t[:16:2, 2::3])
    elif layout == "misaligned":
        f, h = (lambda t: t.reshape(-1)[1:]), (lambda t: t.reshape(-1)[:-1])
    else:
        f, h = (lambda t: t), (lambda t: t[3, 5])
    ca, cb = f(a), h(b)
    ga, gb = f(cuda(a)), h(cuda(b))
    same(binary(op, ga, gb), binary(op, ca, cb), bin_tol(op, dtype), f"{op} {layout}")


@pytest.mark.parametrize("dtype", [bt.float16, bt.bfloat16, bt.float32, bt.float64], ids=dname)
@pytest.mark.parametrize("op", ["maximum", "minimum", "add", "mul", "div", "eq", "lt", "pow"])
def test_binary_special_values(op, dtype):
    v = [0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), float("nan"), 2.0]
    a = bt.tensor(np.repeat(np.array(v), len(v))).to(dtype)
    b = bt.tensor(np.tile(np.array(v), len(v))).to(dtype)
    same(binary(op, cuda(a), cuda(b)), binary(op, a, b), bin_tol(op, dtype), f"{op} special")


@pytest.mark.parametrize("dtype", [bt.uint8, bt.int32, bt.int64], ids=dname)
def test_integer_wraparound(dtype, rng):
    hi = {bt.uint8: 255, bt.int32: 2**31 - 1, bt.int64: 2**62}[dtype]
    a = bt.tensor(np.array([hi, hi, 3, 0])).to(dtype)
    b = bt.tensor(np.array([1, hi, 5, 0])).to(dtype)
    for op in ("add", "mul"):
        same(binary(op, cuda(a), cuda(b)), binary(op, a, b), what=f"{op} wrap")


def test_binary_with_python_scalars(rng):
    x = make(rng, (5, 7), bt.bfloat16)
    gx = cuda(x)
    same(gx * 2.5, x * 2.5)
    same(gx + 1, x + 1)
    same(2.0 - gx, 2.0 - x)
    same(gx / 3, x / 3)
    xi = make(rng, (5, 7), bt.int32, -9, 9)
    same(cuda(xi) * 3, xi * 3)
    same(cuda(xi) / 2, xi / 2)  # true division: float32


# ---- where / masked_fill ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=dname)
@pytest.mark.parametrize(
    "shapes", [((3, 5, 7),) * 3, ((5, 1), (1, 7), (5, 7)), ((7,), (3, 5, 7), ()), ((0, 2),) * 3]
)
def test_where(dtype, shapes, rng):
    c = make(rng, shapes[0], bt.bool)
    a, b = make(rng, shapes[1], dtype), make(rng, shapes[2], dtype)
    same(bt.where(cuda(c), cuda(a), cuda(b)), bt.where(c, a, b))


def test_where_layouts(rng):
    c = make(rng, (20, 30), bt.bool)
    a, b = make(rng, (30, 20), bt.float32), make(rng, (20, 60), bt.float32)
    ca, cb = a.transpose(0, 1), b[:, ::2]
    same(bt.where(cuda(c), cuda(a).transpose(0, 1), cuda(b)[:, ::2]), bt.where(c, ca, cb))
    same(bt.where(cuda(c), cuda(a).transpose(0, 1), -1.5), bt.where(c, ca, -1.5))


@pytest.mark.parametrize("dtype", ALL, ids=dname)
@pytest.mark.parametrize("mshape", [(3, 5, 7), (5, 1), (7,), ()], ids=str)
@pytest.mark.parametrize("value", [0.0, 1.0, -float("inf"), 3.5])
def test_masked_fill(dtype, mshape, value, rng):
    if dtype not in FLOATS and value in (-float("inf"), 3.5):
        pytest.skip("not representable")
    x = make(rng, (3, 5, 7), dtype)
    m = make(rng, mshape, bt.bool)
    same(bt.masked_fill(cuda(x), cuda(m), value), bt.masked_fill(x, m, value))
    xt = x.transpose(0, 2)
    mt = make(rng, (7, 5, 3), bt.bool)
    same(bt.masked_fill(cuda(x).transpose(0, 2), cuda(mt), value), bt.masked_fill(xt, mt, value))


# ---- dropout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("shape", [(1,), (7,), (1025,), (3, 5, 7)], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_same_mask(dtype, shape, p, rng):
    x = make(rng, shape, dtype, 0.5, 2.0)  # non-zero, so a zero output is a dropped element
    seed = int(rng.integers(0, 2**62))
    bt.manual_seed(seed)
    bt.rand(5)  # an offset that is not a multiple of anything
    g = bt.dropout(cuda(x), p)
    bt.manual_seed(seed)
    bt.rand(5)
    c = bt.dropout(x, p)
    same(g, c, what=f"dropout {dname(dtype)} p={p}")


def test_dropout_strided_input_and_backward(rng):
    x = make(rng, (40, 30), bt.float32, 0.5, 2.0)
    seed = int(rng.integers(0, 2**62))
    bt.manual_seed(seed)
    gx = cuda(x).requires_grad_(True)
    gy = bt.dropout(gx.transpose(0, 1)[::2], 0.3)
    gy.backward(bt.ones_like(gy))
    bt.manual_seed(seed)
    cx = x.detach().requires_grad_(True)
    cy = bt.dropout(cx.transpose(0, 1)[::2], 0.3)
    cy.backward(bt.ones_like(cy))
    same(gy, cy)
    same(gx.grad, cx.grad)


def test_dropout_statistics():
    bt.manual_seed(1234)
    y = bt.dropout(bt.ones(1 << 20, device="cuda"), 0.25)
    kept = float(np.mean(npy(y) != 0))
    assert abs(kept - 0.75) < 0.005
    assert np.allclose(npy(y)[npy(y) != 0], 1 / 0.75)


# ---- big: 64-bit index paths ------------------------------------------------------------------
def test_more_than_2_31_elements():
    n = 2**31 + 7
    try:
        x = bt.full((n,), 3, dtype=bt.uint8, device="cuda")
    except Exception as e:  # pragma: no cover - small GPUs
        pytest.skip(f"cannot allocate {n} bytes: {e}")
    y = x + x  # flat, 64-bit
    assert npy(y[-9:]).tolist() == [6] * 9 and npy(y[:3]).tolist() == [6] * 3
    del y
    z = x + bt.tensor(4, dtype=bt.uint8, device="cuda")  # scalar broadcast: strided, 64-bit
    assert npy(z[-9:]).tolist() == [7] * 9
    del z
    w = bt.dropout(x[-(2**20) :].to(bt.float16), 0.5)
    assert set(np.unique(npy(w)).tolist()) <= {0.0, 6.0}


# ---- row-broadcast fast path (x op b, b a broadcast row: the v3 kernel) -----------------------
# v3 runs when one operand is contiguous and the other a row broadcast over the leading dims whose
# length is a multiple of 16 bytes of the dtype (and 16-byte aligned); everything else (odd row
# lengths, misaligned rows, non-contiguous x) must still take the general paths.
ROW_CASES = [
    ((16, 64, 768), (768,)),  # GPT-2 bias shape, scaled down
    ((4, 3072), (3072,)),
    ((33, 24), (24,)),  # rows not a multiple of anything
    ((1, 1, 16), (16,)),  # a single row
    ((5, 7, 8), (7, 8)),  # a 2-D row (trailing dims contiguous)
    ((3, 2, 8), (1, 2, 8)),  # leading size-1 dim on the row
    ((9, 40), (40,)),  # fp32: 10 vectors, bf16: 5 vectors -> v3; f64: 20 vectors
    ((6, 12), (12,)),  # bf16/fp16 (8 per vector): not a multiple -> general path
    ((4099, 8), (8,)),  # many rows per thread, unrolled tail
    ((2, 5), (5,)),  # odd: general path
]


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", ROW_CASES, ids=str)
@pytest.mark.parametrize("row_first", [False, True])
def test_row_broadcast_binary(op, dtype, shapes, row_first, rng):
    xs, bs = shapes
    x = make(rng, xs, dtype)
    b = make(rng, bs, dtype, 0.5, 3.0)  # away from 0: div
    f = {"add": bt.add, "sub": bt.sub, "mul": bt.mul, "div": bt.div}[op]
    if row_first:
        cpu, gpu = f(b, x), f(cuda(b), cuda(x))
    else:
        cpu, gpu = f(x, b), f(cuda(x), cuda(b))
    same(gpu, cpu, None, f"{op} row_first={row_first} {xs} {bs}")  # IEEE ops: bit-exact


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32], ids=dname)
def test_row_broadcast_layouts(dtype, rng):
    # misaligned row (offset view), non-contiguous x, a column broadcast, a bias needing a cast
    x = make(rng, (64, 48), dtype)
    b = make(rng, (66,), dtype)
    xg, bg = cuda(x), cuda(b)
    same(xg + bg[1:49], x + b[1:49], None, "misaligned row")
    same(xg[:, :40] + bg[:40], x[:, :40] + b[:40], None, "sliced x")
    same(xg.T + bg[:64], x.T + b[:64], None, "transposed x")
    same(xg + bg[:64].reshape(64, 1), x + b[:64].reshape(64, 1), None, "column broadcast")
    b32 = make(rng, (48,), bt.float32)
    same(xg + cuda(b32), x + b32, None, "promoted bias")
    out_g = xg + bg[:48]
    assert out_g.is_contiguous()
    # in-place add of a bias (copy_ of the out-of-place result into x)
    xi, xi_g = x.clone(), xg.clone()
    xi += b[:48]
    xi_g += bg[:48]
    same(xi_g, xi, None, "in-place bias add")


def test_row_broadcast_grad(rng):
    x = make(rng, (32, 16), bt.float32)
    b = make(rng, (16,), bt.float32)
    xg, bg = cuda(x).requires_grad_(True), cuda(b).requires_grad_(True)
    (xg * bg + bg).sum().backward()
    # db = column sums of x, plus 32: a column can cancel to near 0, so the tolerance is relative
    # to the sum of magnitudes (float32 sums of 32 terms), not to the result
    x64 = npy(x).astype(np.float64)
    scale = np.abs(x64).sum(0) + 32
    np.testing.assert_allclose(npy(bg.grad), x64.sum(0) + 32, rtol=0, atol=1e-6 * scale.max())
    np.testing.assert_allclose(npy(xg.grad), np.broadcast_to(npy(b), (32, 16)), rtol=0)


# ---- flat kernel, gelu_tanh 16-bit fast form: GPT-2 sizes --------------------------------------
# The flat kernel walks 16-byte vectors in a grid-stride loop, then a scalar tail; the
# row-broadcast kernel's grid is one wave of resident blocks.  GPT-2 activation sizes run several
# grid strides; +13 adds a tail.  Casts and IEEE ops: bit-exact.
FLAT_SIZES = [1, 9, 8 * 257 + 3, 16 * 1024 * 768 + 13]
SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e38, 3.3895e38, 65504.0]


def _big(rng, n, dtype, scale=3.0):
    a = rng.standard_normal(n) * scale
    a[: min(n, len(SPECIALS))] = SPECIALS[: min(n, len(SPECIALS))]
    return bt.tensor(a).to(dtype)


@pytest.mark.parametrize(
    "pair",
    [(bt.bfloat16, bt.float32), (bt.float32, bt.bfloat16), (bt.float16, bt.float32)],
    ids=lambda p: f"{dname(p[0])}->{dname(p[1])}",
)
@pytest.mark.parametrize("n", FLAT_SIZES)
def test_flat_cast_sizes(pair, n, rng):
    src, dst = pair
    x = _big(rng, n, src, 100.0)
    same(cuda(x).to(dst), x.to(dst), None, f"cast {dname(src)}->{dname(dst)} n={n}")


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16, bt.float32], ids=dname)
@pytest.mark.parametrize("n", FLAT_SIZES)
def test_flat_gelu_and_mul_sizes(dtype, n, rng):
    x, y = _big(rng, n, dtype), _big(rng, n, dtype)
    xg, yg = cuda(x), cuda(y)
    same(xg * yg, x * y, None, f"mul {dname(dtype)} n={n}")
    same(bt.gelu(xg, approximate="tanh"), bt.gelu(x, approximate="tanh"), TOL[dtype], f"gelu {n}")


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
def test_gelu_tanh_16bit_fast_form(dtype):
    """The 16-bit form x / (1 + e^(-2u)) against float64 numpy on a dense grid, tails included:
    within one 16-bit ulp (plus a tiny absolute floor near 0)."""
    a = np.concatenate([np.linspace(-12, 12, 20001), [-30.0, 30.0, 1e-6, -1e-6]])
    x = bt.tensor(a).to(dtype)
    xr = npy(x).astype(np.float64)
    u = 0.7978845608028654 * (xr + 0.044715 * xr**3)
    ref = 0.5 * xr * (1 + np.tanh(u))
    got = npy(bt.gelu(cuda(x), approximate="tanh")).astype(np.float64)
    ulp = 2.0**-8 if dtype == bt.bfloat16 else 2.0**-11
    assert np.all(np.abs(got - ref) <= ulp * np.abs(ref) + 1e-6), "gelu_tanh 16-bit fast form"


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16], ids=dname)
@pytest.mark.parametrize("rows", [16 * 1024, 16 * 1024 + 3, 5])
def test_row_broadcast_gpt2_bias(dtype, rows, rng):
    x = make(rng, (rows, 768), dtype)
    b = make(rng, (768,), dtype)
    same(cuda(x) + cuda(b), x + b, None, f"bias add {rows}x768")
    same(cuda(b) * cuda(x), b * x, None, f"bias mul (row first) {rows}x768")


def test_first_launch_inside_graph_capture(rng):
    """The one-wave grid queries a kernel's occupancy at its first launch: that may happen inside
    a CUDA graph capture (a rarely used cast / op instantiation, never launched before here)."""
    x = make(rng, (4099,), bt.int32, -50, 50)
    m = make(rng, (3, 40), bt.float64)
    b = make(rng, (40,), bt.float64)
    xg, mg, bg = cuda(x), cuda(m), cuda(b)
    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):
        y = xg.to(bt.float16)
        z = mg - bg  # float64 row broadcast (v3 row kernel)
    g.replay()
    same(y, x.to(bt.float16), None, "int32->float16 captured")
    same(z, m - b, None, "float64 row broadcast captured")
