"""Python's // and % on tensors (src/pymath.h): floor_divide and remainder.

Checked against numpy (whose integer and float floor_divide / remainder follow Python's rules) on
fresh random inputs of mixed signs, in every dtype, on the CPU and, where a GPU is present, on
CUDA bit for bit against the CPU.  Also: the special values (zeros of both signs, inf, nan), the
most negative integer // -1 (wraps, as numpy and PyTorch), integer division by zero raising
ZeroDivisionError (on CUDA at the next synchronisation), bool refused, Python scalars on either
side, in-place forms, and gradients (remainder: g and -g * (a // b); floor_divide: zeros).
"""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt

NO_CUDA = pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NO_CUDA])]
INTS = [bt.uint8, bt.int32, bt.int64]
FLOATS = [bt.float16, bt.bfloat16, bt.float32, bt.float64]
OPS = {"floor_divide": np.floor_divide, "remainder": np.remainder}


def _np(t: bt.Tensor) -> np.ndarray:
    t = t.cpu()
    return (t.float() if t.dtype in (bt.float16, bt.bfloat16) else t).numpy()


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values with equal signs of zero, nan where the other is nan."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = (a == b) & (np.signbit(a) == np.signbit(b))
    return bool(np.all(same | (np.isnan(a) & np.isnan(b))))


def _ints(rng, shape, dtype, nonzero=True):
    if dtype == bt.uint8:
        a = rng.integers(0 if not nonzero else 1, 256, shape)
    else:
        lim = 2**31 - 1 if dtype == bt.int32 else 2**62
        a = rng.integers(-lim, lim, shape) // rng.choice([1, 1000, 10**6], shape)
        if nonzero:
            a[a == 0] = 3
    return a


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_integers_match_python(rng, device, op, dtype):
    a, b = _ints(rng, (7, 33), dtype, False), _ints(rng, (7, 33), dtype)
    b[0, :8] = [1, -1, 2, -2, 7, -7, 13, -13] if dtype != bt.uint8 else [1, 2, 3, 4, 7, 9, 13, 200]
    ta = bt.tensor(a, dtype=dtype, device=device)
    tb = bt.tensor(b, dtype=dtype, device=device)
    out = getattr(bt, op)(ta, tb)
    assert out.dtype == dtype and str(out.device).startswith(device)
    np.testing.assert_array_equal(out.cpu().numpy(), OPS[op](a, b))
    # Python's own ints, element by element, on a few
    py = [int(x) // int(y) if op == "floor_divide" else int(x) % int(y) for x, y in zip(a[0], b[0])]
    np.testing.assert_array_equal(out.cpu().numpy()[0], py)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_floats_match_python(rng, device, op, dtype):
    a = rng.uniform(-50, 50, (9, 31)) * rng.choice([1e-3, 1, 1e3], (9, 31))
    b = rng.uniform(0.1, 9, (9, 31)) * rng.choice([-1, 1], (9, 31))
    ta, tb = bt.tensor(a).to(dtype), bt.tensor(b).to(dtype)
    # the reference sees the rounded inputs, in float64 then rounded to the dtype once
    ref64 = OPS[op](_np(ta).astype(np.float64), _np(tb).astype(np.float64))
    ref = _np(bt.tensor(ref64).to(dtype))
    out = getattr(bt, op)(ta.to(device), tb.to(device))
    assert out.dtype == dtype
    if dtype in (bt.float32, bt.float64):
        assert _bits_equal(_np(out), ref)
    else:  # computed in float32, then rounded: a float32 result can round the other way
        np.testing.assert_allclose(_np(out), ref, rtol=2**-7, atol=2**-7 * np.abs(_np(tb)).max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [bt.float32, bt.float64], ids=str)
def test_float_special_values(device, op, dtype):
    v = [0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 7.0, float("inf"), -float("inf"), float("nan")]
    a = np.repeat(np.array(v), len(v))
    b = np.tile(np.array(v), len(v))
    npdt = np.float32 if dtype == bt.float32 else np.float64
    with np.errstate(all="ignore"):
        ref = OPS[op](a.astype(npdt), b.astype(npdt))
    out = getattr(bt, op)(
        bt.tensor(a, dtype=dtype, device=device), bt.tensor(b, dtype=dtype, device=device)
    )
    assert _bits_equal(_np(out), ref), list(zip(a, b, _np(out), ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [bt.int32, bt.int64], ids=str)
def test_most_negative_over_minus_one_wraps(device, dtype):
    lo = np.iinfo(np.int32 if dtype == bt.int32 else np.int64).min
    a = bt.tensor(np.array([lo, lo, 5]), dtype=dtype, device=device)
    b = bt.tensor(np.array([-1, 1, -1]), dtype=dtype, device=device)
    np.testing.assert_array_equal((a // b).cpu().numpy(), [lo, lo, -5])
    np.testing.assert_array_equal((a % b).cpu().numpy(), [0, 0, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["floor_divide", "remainder"])
@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_integer_division_by_zero_raises(device, op, dtype):
    a = bt.tensor(np.array([4, 5, 6]), dtype=dtype, device=device)
    b = bt.tensor(np.array([2, 0, 3]), dtype=dtype, device=device)
    with pytest.raises(ZeroDivisionError, match=rf"\[{op}\] integer division by zero"):
        getattr(bt, op)(a, b).cpu()  # CUDA: raised at the synchronisation
    # the device's error record is cleared: the next good op runs
    np.testing.assert_array_equal(
        getattr(bt, op)(a, a).cpu().numpy(), OPS[op]([4, 5, 6], [4, 5, 6])
    )
    with pytest.raises(ZeroDivisionError):
        (a // 0).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_float_division_by_zero_is_inf_and_nan(device):
    a = bt.tensor([1.0, -1.0, 0.0], device=device)
    np.testing.assert_array_equal((a // 0.0).cpu().numpy()[:2], [np.inf, -np.inf])
    assert np.isnan((a // 0.0).cpu().numpy()[2])
    assert np.isnan((a % 0.0).cpu().numpy()).all()


def test_bool_is_refused():
    t = bt.tensor([True, False])
    for fn in (lambda: t // t, lambda: t % True, lambda: bt.remainder(t, t)):
        with pytest.raises(
            TypeError, match=r"\[(floor_divide|remainder)\] is not defined for bool"
        ):
            fn()


@pytest.mark.parametrize("device", DEVICES)
def test_python_scalars_and_promotion(device):
    i = bt.tensor([-7, -1, 0, 5, 9], device=device)
    np.testing.assert_array_equal((i // 2).cpu().numpy(), np.array([-7, -1, 0, 5, 9]) // 2)
    np.testing.assert_array_equal((i % 3).cpu().numpy(), np.array([-7, -1, 0, 5, 9]) % 3)
    np.testing.assert_array_equal(
        (20 // (i + 10)).cpu().numpy(), 20 // np.array([3, 9, 10, 15, 19])
    )
    np.testing.assert_array_equal((-7 % (i + 10)).cpu().numpy(), -7 % np.array([3, 9, 10, 15, 19]))
    assert (i // 2).dtype == bt.int64 and (i // 2.0).dtype == bt.float32
    np.testing.assert_array_equal((i % 2.5).cpu().numpy(), np.array([-7, -1, 0, 5, 9]) % 2.5)
    np.testing.assert_array_equal(bt.floor_divide(i, 4).cpu().numpy(), [-2, -1, 0, 1, 2])
    np.testing.assert_array_equal(bt.remainder(i, -4).cpu().numpy(), [-3, -1, 0, -3, -3])


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_forms(device):
    x = bt.tensor([-7, 8, 9], device=device)
    before = x
    x //= 2
    assert x is before
    np.testing.assert_array_equal(x.cpu().numpy(), [-4, 4, 4])
    x %= 3
    np.testing.assert_array_equal(x.cpu().numpy(), [2, 1, 1])
    y = bt.tensor([7.5, -7.5], device=device)
    assert y.floor_divide_(2) is y
    np.testing.assert_array_equal(y.cpu().numpy(), [3.0, -4.0])
    assert y.remainder_(3) is y
    np.testing.assert_array_equal(y.cpu().numpy(), [0.0, 2.0])
    with pytest.raises(TypeError):  # float result into an int tensor
        z = bt.tensor([1, 2], device=device)
        z //= 1.5


@pytest.mark.parametrize("device", DEVICES)
def test_gradients(rng, device):
    a = rng.uniform(-9, 9, (4, 6))
    b = rng.uniform(0.7, 3, (6,)) * rng.choice([-1, 1], 6)
    ta = bt.tensor(a, dtype=bt.float64, device=device, requires_grad=True)
    tb = bt.tensor(b, dtype=bt.float64, device=device, requires_grad=True)
    g = rng.standard_normal((4, 6))
    (bt.remainder(ta, tb) * bt.tensor(g, dtype=bt.float64, device=device)).sum().backward()
    np.testing.assert_allclose(ta.grad.cpu().numpy(), g)
    np.testing.assert_allclose(tb.grad.cpu().numpy(), (-g * np.floor_divide(a, b)).sum(0))
    # finite differences where a / b is away from an integer (the jumps)
    eps = 1e-6
    far = np.abs(a / b - np.round(a / b)) > 1e-3
    fd = (np.remainder(a + eps, b) - np.remainder(a - eps, b)) / (2 * eps)
    np.testing.assert_allclose(fd[far], 1.0, atol=1e-6)
    ta.grad = None
    tb.grad = None
    bt.floor_divide(ta, tb).sum().backward()
    assert not ta.grad.cpu().numpy().any() and not tb.grad.cpu().numpy().any()


@pytest.mark.gpu
@NO_CUDA
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", INTS + FLOATS, ids=str)
@pytest.mark.parametrize(
    "layout", ["contiguous", "broadcast", "transposed", "stepped", "scalar", "large"]
)
def test_cuda_matches_cpu_bits(rng, op, dtype, layout):
    """Every kernel path (flat vector / scalar, strided, broadcast) against the CPU kernel."""
    n = 70001 if layout == "large" else 40
    if dtype in INTS:
        a, b = _ints(rng, (17, n), dtype, False), _ints(rng, (17, n), dtype)
    else:
        a = rng.uniform(-40, 40, (17, n))
        b = rng.uniform(0.3, 5, (17, n)) * rng.choice([-1, 1], (17, n))
    ca, cb = bt.tensor(a).to(dtype), bt.tensor(b).to(dtype)
    f, h = {
        "contiguous": (lambda t: t, lambda t: t),
        "broadcast": (lambda t: t, lambda t: t[3]),
        "transposed": (lambda t: t.transpose(0, 1), lambda t: t.transpose(0, 1)),
        "stepped": (lambda t: t[1::2, 1::3], lambda t: t[:8:1, 2::3]),
        "scalar": (lambda t: t, lambda t: t[3, 5]),
        "large": (lambda t: t, lambda t: t),
    }[layout]
    want = getattr(bt, op)(f(ca), h(cb))
    got = getattr(bt, op)(f(ca.to("cuda")), h(cb.to("cuda")))
    assert _bits_equal(_np(got), _np(want))
