"""The CPU one-dim reductions of src/cpu/reduce_kernels.h (row sums in lanes, sums proven exact in
any order, max / min in lanes) against their definition, bit for bit: each output's elements
added in index order into a double from 0 (np.cumsum's last element), rounded once to float32 /
float64 (16-bit outputs: the double rounded to float32, then to the 16-bit type, as reduce.cpp
stores them; a NaN sum of rows of 64 or more is the default quiet NaN); max / min the first
extreme in index order (a zero's sign included), NaN if any element is one. Fresh random rows of
every length the kernels split differently (1..70, 1023, 1025), magnitudes over many binades
(where the exact-sum proof fails and the lanes run), NaN and infinities, transposed and
middle-dim rows, at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
from tensor_testutil import f64

import blutrain.tensor as bt

DTYPES = [bt.float32, bt.float64, bt.bfloat16, bt.float16]
LENGTHS = list(range(1, 71)) + [1023, 1025]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    prev = bt.get_num_threads()
    bt.set_num_threads(request.param)
    yield request.param
    bt.set_num_threads(prev)


def rows(rng, shape, dt, kind):
    """A bt tensor of dtype dt and the float64 array of exactly its values."""
    a = rng.standard_normal(shape)
    if kind == "spread":  # magnitudes 2^-40 .. 2^40 (2^-12 .. 2^12 for float16)
        span = 12 if dt == bt.float16 else 40
        a = a * np.exp2(rng.integers(-span, span + 1, size=shape))
    elif kind == "special":
        flat = a.reshape(-1)
        n = flat.size
        flat[rng.integers(0, n, size=max(1, n // 97))] = np.inf
        flat[rng.integers(0, n, size=max(1, n // 89))] = -np.inf
        flat[rng.integers(0, n, size=max(1, n // 101))] = np.nan
    elif kind == "zeros":  # nonpositive, zeros of both signs: max / min of zero
        a = -np.abs(a)
        flat = a.reshape(-1)
        flat[::3] = 0.0
        flat[1::5] = -0.0
    t = bt.tensor(a, dtype=dt)
    return t, f64(t)


def as_stored(vals: np.ndarray, dt) -> np.ndarray:
    """Double results as reduce.cpp stores them in dtype dt, back in float64."""
    if dt == bt.float64:
        return vals
    v32 = vals.astype(np.float32)
    if dt == bt.float32:
        return v32.astype(np.float64)
    return f64(bt.tensor(v32).to(dt))


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    nan = np.isnan(ref)
    return (
        np.array_equal(np.isnan(got), nan)
        and np.array_equal(got[~nan], ref[~nan])
        and np.array_equal(np.signbit(got[~nan]), np.signbit(ref[~nan]))
    )


def seq_sum(vals: np.ndarray, dim: int) -> np.ndarray:
    return np.cumsum(vals, axis=dim).take(-1, axis=dim)


def first_extreme(vals: np.ndarray, dim: int, is_max: bool) -> np.ndarray:
    """The scalar loop: best = x[0]; c > best (c < best) replaces it; NaN if any."""
    v = np.moveaxis(vals, dim, -1)
    out = v[..., 0].copy()
    for j in range(1, v.shape[-1]):
        c = v[..., j]
        take = c > out if is_max else c < out
        out = np.where(take, c, out)
    out[np.isnan(v).any(-1)] = np.nan
    return out


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "spread", "special"])
def test_row_sums_are_the_in_order_double_sums(rng, threads, dt, kind):
    for n in LENGTHS:
        R = 37 if n < 100 else 21  # blocks of 8 rows, then the range's last rows
        t, vals = rows(rng, (R, n), dt, kind)
        seq = seq_sum(vals, -1)
        s, m = f64(t.sum(-1)), f64(t.mean(-1))
        assert same_bits(s, as_stored(seq, dt)), (n, kind)
        assert same_bits(m, as_stored(seq / n, dt)), (n, kind)
        if n >= 64:  # the lane paths: a NaN sum is the default quiet NaN (reduce.cpp)
            assert not np.signbit(s[np.isnan(s)]).any() and not np.signbit(m[np.isnan(m)]).any()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_row_sums_above_the_parallel_threshold(rng, threads, dt):
    # 2048 x 1024: split over the pool; rows 4 KiB apart (float32), many exact-sum blocks and a
    # few whose magnitudes force the lanes
    t, vals = rows(rng, (2048, 1024), dt, "normal")
    vals[5::64, 3] *= 2.0**-30  # tiny elements: these rows' sums are not proven exact
    t = bt.tensor(vals, dtype=dt)
    vals = f64(t)
    seq = seq_sum(vals, -1)
    assert same_bits(f64(t.sum(-1)), as_stored(seq, dt))
    assert same_bits(f64(t.mean(-1)), as_stored(seq / 1024, dt))


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_adjacent_output_sums(rng, threads, dt):
    # the reduced dim strided, the kept innermost contiguous: a transposed view, a middle dim
    for shape, view, dim in [
        ((517, 203), lambda t: t.T, -1),
        ((1025, 45), lambda t: t.T, 1),
        ((3, 77, 129), lambda t: t, 1),
        ((2, 40, 23), lambda t: t, 1),
    ]:
        for kind in ("normal", "special"):
            base, _ = rows(rng, shape, dt, kind)
            t = view(base)
            vals = f64(t)
            seq = seq_sum(vals, dim)
            assert same_bits(f64(t.sum(dim)), as_stored(seq, dt)), (shape, kind)
            assert same_bits(f64(t.mean(dim)), as_stored(seq / vals.shape[dim], dt)), shape


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "special", "zeros"])
def test_row_max_min_are_the_first_extremes(rng, threads, dt, kind):
    for n in LENGTHS:
        t, vals = rows(rng, (19, n), dt, kind)
        assert same_bits(f64(t.amax(-1)), first_extreme(vals, -1, True)), (n, kind)
        assert same_bits(f64(t.amin(-1)), first_extreme(vals, -1, False)), (n, kind)


def to_midpoint(rows: np.ndarray) -> np.ndarray:
    """The rows (float32 values, as float64) with their last two elements changed so that the
    in-order double sum is exactly halfway between two float32 values: the float32 result then
    shows the double's last bit (ties to even; any other order's sum, a few double ulps off,
    rounds away from it). Rows where that fails are dropped."""
    out = []
    for row in rows.copy():
        d = np.cumsum(row[:-2])[-1]
        est = d + row[-2]
        u = float(np.spacing(np.float32(abs(est))))
        m = (np.floor(est / u) + 0.5) * u  # a float32 midpoint near the sum
        e = int(np.floor(np.log2(abs(m))))
        x = 1.5 * 2.0 ** (e - 32)  # the last element, on a grid the double sum shares
        row[-2] = np.float32(m - x - d)
        row[-1] = m - (d + row[-2])
        if np.float32(row[-1]) == row[-1] and np.cumsum(row)[-1] == m:
            out.append(row)
    assert len(out) >= len(rows) // 2
    return np.array(out)


def bound_rows(rng, R: int, n: int, s: int) -> np.ndarray:
    """3 in 4 elements in [1.5, 1.99] 2^s, the others in [1, 2) with random low bits: past 2^53
    ulps of those (near s = 20 for n = 1024) the in-order sum rounds."""
    a = rng.uniform(1.5, 1.99, size=(R, n)).astype(np.float32).astype(np.float64) * 2.0**s
    a[:, ::4] = 1 + rng.integers(0, 1 << 23, size=a[:, ::4].shape) * 2.0**-23
    return a


@pytest.mark.parametrize("n", [100, 1024])
def test_row_sums_keep_the_doubles_last_bit(rng, threads, n):
    # float32 sums at float32 midpoints: the result is the double's last bit. Rows on both sides
    # of the exact-sum proof's bound (n = 1024: magnitudes within 2^19 of each other are proven
    # exact) and far past it, and random magnitudes over 2^+-12 (the lanes): the in-order sum's.
    k = int(np.ceil(np.log2(n)))
    cases = [bound_rows(rng, 32, n, s) for s in (29 - k - 1, 29 - k, 29 - k + 1, 29 - k + 6)]
    spread = rng.standard_normal((64, n)) * np.exp2(rng.integers(-20, 21, size=(64, n)))
    cases.append(spread.astype(np.float32).astype(np.float64))
    for a in cases:
        a = to_midpoint(a)
        seq = seq_sum(a, -1)
        got = f64(bt.tensor(a, dtype=bt.float32).sum(-1))
        assert same_bits(got, seq.astype(np.float32).astype(np.float64))
        # float64 rows of the same values: the lanes (no exact-sum proof for float64)
        assert same_bits(f64(bt.tensor(a, dtype=bt.float64).sum(-1)), seq)
