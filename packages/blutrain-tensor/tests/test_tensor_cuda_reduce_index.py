"""GPU tests of the reductions (sum, mean, amax, amin, var, argmax, argmin) and the indexing ops
(index_select, index_add, gather, scatter_add, cat): CUDA against the CPU backend on the same fresh
random inputs, every dims/keepdim combination of 0-4-D tensors, non-contiguous inputs, odd and
zero sizes, ties and NaNs for argmax, repeated indices, bitwise determinism (two runs, same bytes),
the split (multi-chunk) kernel paths and the GPT-2 shapes (bias gradients, embedding forward and
backward)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

# Relative to max |ref| (the GPU sums float32 in float with a tree order, the CPU in double).
TOL = {bt.float64: 1e-12, bt.float32: 2e-5, bt.bfloat16: 1.6e-2, bt.float16: 2e-3}
INT_DTYPES = [bt.int64, bt.int32, bt.uint8, bt.bool]


def _np(t: bt.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in TOL:
        return t.to(bt.float64).numpy()
    return t.numpy()


def _raw(t: bt.Tensor) -> bytes:
    t = t.detach().cpu()
    if t.dtype in (bt.bfloat16, bt.float16):  # the bit patterns, whatever numpy supports
        return t.to(bt.float32).numpy().tobytes()
    return t.numpy().tobytes()


def _close(got: bt.Tensor, ref: bt.Tensor, what: str, k: float = 1, floor: float = 0) -> None:
    """Max error relative to max |ref| (or to `floor` when larger: a sum's rounding scales with
    the sum of |x|, not with a result that cancelled to near zero)."""
    assert got.device.startswith("cuda"), f"{what}: result on {got.device}"
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != {ref.dtype}"
    g, r = _np(got), _np(ref)
    assert g.shape == r.shape, f"{what}: shape {g.shape} != {r.shape}"
    if ref.dtype not in TOL:
        np.testing.assert_array_equal(g, r, err_msg=what)
        return
    np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isinf(g), np.isinf(r), err_msg=f"{what}: inf positions")
    fin = np.isfinite(r)
    if not fin.any():
        return
    scale = max(np.abs(r[fin]).max(), floor, 1e-30)
    err = np.abs(g[fin] - r[fin]).max() / scale
    assert err <= TOL[ref.dtype] * k, f"{what}: max error {err:.3g} (relative to max |ref|)"


def _rand(rng, shape, dtype):
    if dtype == bt.bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype == bt.uint8:
        return rng.integers(0, 256, size=shape).astype(np.uint8)
    if dtype in (bt.int32, bt.int64):
        return rng.integers(-1000, 1000, size=shape).astype(np.int64)
    return rng.standard_normal(shape)


def _pair(a: np.ndarray, dtype):
    c = bt.tensor(a, dtype=dtype)
    return c, c.to("cuda")


def _strided(a: np.ndarray, dtype):
    """(cpu, cuda) non-contiguous views holding `a` (uploaded transposed: no GPU copy kernel)."""
    t = np.ascontiguousarray(np.swapaxes(a, 0, -1))
    return (
        bt.tensor(t, dtype=dtype).transpose(0, -1),
        bt.tensor(t, dtype=dtype).to("cuda").transpose(0, -1),
    )


def _all_dims(ndim: int):
    yield None
    for k in range(1, ndim + 1):
        yield from itertools.combinations(range(ndim), k)


# ---- reductions -------------------------------------------------------------------------------

SHAPES = [(), (1,), (7,), (1025,), (3, 7), (0, 5), (5, 0), (2, 3, 4), (2, 1, 7, 5), (33, 65)]


def _reduce(x: bt.Tensor, op: str, dims, keepdim: bool, correction: float = 1.0):
    if op == "var":
        return x.var(dims, correction=correction, keepdim=keepdim)
    return getattr(x, op)(dims, keepdim=keepdim)


@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin", "var"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reduce_all_dims_float32(rng, op, shape):
    c, g = _pair(_rand(rng, shape, bt.float32), bt.float32)
    for dims in _all_dims(len(shape)):
        for keepdim in (False, True):
            what = f"{op} shape={shape} dims={dims} keepdim={keepdim}"
            try:
                ref = _reduce(c, op, dims, keepdim)
            except ValueError:  # amax/amin over a zero-size dim: the GPU must raise too
                with pytest.raises(ValueError):
                    _reduce(g, op, dims, keepdim)
                continue
            floor = 0.0
            if op in ("sum", "mean"):  # the same reduction of |x|: the rounding's scale
                floor = float(np.abs(_np(_reduce(c.abs(), op, dims, keepdim))).max(initial=0))
            _close(_reduce(g, op, dims, keepdim), ref, what, floor=floor)


@pytest.mark.parametrize("dtype", [bt.float64, bt.bfloat16, bt.float16], ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin", "var"])
def test_reduce_float_dtypes(rng, op, dtype):
    for shape in [(1025,), (3, 7), (2, 3, 4), (64, 130)]:
        c, g = _pair(_rand(rng, shape, dtype), dtype)
        for dims in _all_dims(len(shape)):
            for keepdim in (False, True):
                what = f"{op} {dtype} shape={shape} dims={dims} keepdim={keepdim}"
                _close(_reduce(g, op, dims, keepdim), _reduce(c, op, dims, keepdim), what)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "amax", "amin"])
def test_reduce_int_dtypes_exact(rng, op, dtype):
    for shape in [(), (1025,), (3, 7), (2, 3, 4), (40, 33), (0, 4)]:
        c, g = _pair(_rand(rng, shape, dtype), dtype)
        for dims in _all_dims(len(shape)):
            for keepdim in (False, True):
                what = f"{op} {dtype} shape={shape} dims={dims} keepdim={keepdim}"
                try:
                    ref = _reduce(c, op, dims, keepdim)
                except ValueError:
                    continue
                _close(_reduce(g, op, dims, keepdim), ref, what)


@pytest.mark.parametrize("correction", [0.0, 1.0, 2.0, 7.0])
def test_var_correction(rng, correction):
    for shape, dims in [
        ((7,), None),
        ((5, 7), (1,)),
        ((5, 7), (0,)),
        ((1, 3), (0,)),
        ((64, 33), (0,)),
    ]:
        c, g = _pair(_rand(rng, shape, bt.float32), bt.float32)
        what = f"var correction={correction} shape={shape} dims={dims}"
        _close(
            _reduce(g, "var", dims, False, correction),
            _reduce(c, "var", dims, False, correction),
            what,
        )


def test_var_offset_data(rng):
    # Welford keeps precision when the mean dominates the spread.
    a = 1000.0 + rng.standard_normal((4, 5000))
    c, g = _pair(a, bt.float32)
    for dims in [(1,), (0,), None]:
        _close(g.var(dims), c.var(dims), f"var offset dims={dims}", k=50)


@pytest.mark.parametrize("make", ["transpose", "slice", "permute", "expand"])
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "var"])
def test_reduce_noncontiguous(rng, op, make):
    for dtype in (bt.float32, bt.bfloat16):
        a = _rand(rng, (6, 40, 33), dtype)
        c, g = _pair(a, dtype)
        if make == "transpose":
            c, g = c.transpose(0, 2), g.transpose(0, 2)
        elif make == "slice":
            c, g = c[:, ::3, 1:], g[:, ::3, 1:]
        elif make == "permute":
            c, g = c.permute(1, 2, 0), g.permute(1, 2, 0)
        else:
            c, g = c[:, :1, :].expand(6, 40, 33), g[:, :1, :].expand(6, 40, 33)
        for dims in _all_dims(3):
            for keepdim in (False, True):
                what = f"{op} {dtype} {make} dims={dims} keepdim={keepdim}"
                floor = 0.0
                if op in ("sum", "mean"):  # a sum that cancels: its rounding scales with |x|'s
                    floor = float(np.abs(_np(_reduce(c.abs(), op, dims, keepdim))).max(initial=0))
                _close(
                    _reduce(g, op, dims, keepdim), _reduce(c, op, dims, keepdim), what, floor=floor
                )


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float64], ids=str)
@pytest.mark.parametrize(
    "shape,dims",
    [
        ((4096, 768), (0,)),  # bias gradient: column kernel, split into chunks
        ((1024, 3072), (0,)),
        ((8, 512, 768), (0, 1)),
        ((1 << 20,), None),  # full sum: row kernel, split + finalize
        ((3, 100003), (1,)),  # few long rows: block per row, split
        ((64, 50257), (1,)),  # logits rows
        ((1024, 768), (1,)),  # last dim, warp per row, vector loads
        ((1024, 767), (1,)),  # last dim, scalar loads
        ((50, 7, 768), (1,)),  # middle dim: column kernel with an outer dim
    ],
    ids=str,
)
def test_reduce_large_paths(rng, dtype, shape, dims):
    c, g = _pair(_rand(rng, shape, dtype), dtype)
    for op in ("sum", "mean", "amax", "var"):
        _close(
            _reduce(g, op, dims, False),
            _reduce(c, op, dims, False),
            f"{op} {dtype} {shape} {dims}",
            k=4,
        )
    for op in ("argmax", "argmin"):
        if dims is not None and len(dims) == 1:
            _close(getattr(g, op)(dims[0]), getattr(c, op)(dims[0]), f"{op} {dtype} {shape} {dims}")


def test_reduce_nan_propagates(rng):
    a = rng.standard_normal((9, 70))
    a[3, 5] = np.nan
    a[7, 69] = np.nan
    for dtype in (bt.float32, bt.bfloat16, bt.float64):
        c, g = _pair(a, dtype)
        for op in ("sum", "amax", "amin", "var"):
            for dims in _all_dims(2):
                _close(
                    _reduce(g, op, dims, False),
                    _reduce(c, op, dims, False),
                    f"{op} {dtype} NaN {dims}",
                )


def test_reduce_deterministic_bitwise(rng):
    for shape, dims in [
        ((4096, 768), (0,)),
        ((1 << 21,), None),
        ((512, 3072), (1,)),
        ((3, 100003), (1,)),
    ]:
        for dtype in (bt.float32, bt.bfloat16):
            g = bt.tensor(_rand(rng, shape, dtype), dtype=dtype).to("cuda")
            for op in ("sum", "mean", "var"):
                r1 = _raw(_reduce(g, op, dims, False))
                r2 = _raw(_reduce(g, op, dims, False))
                assert r1 == r2, f"{op} {dtype} {shape} {dims}: two runs differ"


def test_reduce_poisoned_output_overwritten(rng):
    # No path may leave an output element unwritten (e.g. a skipped finalize): run a reduction
    # after filling the allocator with NaNs.
    junk = bt.full((4096, 768), float("nan"), device="cuda")
    del junk
    c, g = _pair(_rand(rng, (4096, 768), bt.float32), bt.float32)
    _close(g.sum(0), c.sum(0), "sum after NaN poison")
    assert not np.isnan(_np(g.sum(1))).any()


# ---- argmax / argmin ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [bt.float32, bt.bfloat16, bt.float64, bt.int64, bt.int32, bt.uint8, bt.bool], ids=str
)
@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_argreduce_ties_all_dims(rng, op, dtype):
    if dtype == bt.bool:  # as PyTorch: no argmax / argmin of bool (issue 37), on either device
        for dev in ("cpu", "cuda"):
            with pytest.raises(TypeError, match=rf"^\[{op}\] is not defined for bool tensors"):
                getattr(bt.ones(3, dtype=bt.bool, device=dev), op)()
        return
    for shape in [(1,), (7,), (1025,), (3, 7), (2, 3, 4), (2, 1, 7, 5), (5, 300)]:
        a = rng.integers(0, 3, size=shape)  # many ties: the first index must win
        if dtype == bt.bool:
            a = a > 0
        c, g = _pair(a, dtype)
        _close(getattr(g, op)(), getattr(c, op)(), f"{op} {dtype} {shape} flat")
        for d in range(len(shape)):
            for keepdim in (False, True):
                what = f"{op} {dtype} shape={shape} dim={d} keepdim={keepdim}"
                _close(getattr(g, op)(d, keepdim=keepdim), getattr(c, op)(d, keepdim=keepdim), what)


@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_argreduce_nan_and_inf(rng, op):
    a = rng.standard_normal((6, 300))
    a[1, 10] = np.nan
    a[1, 200] = np.nan
    a[2, :] = -np.inf
    a[3, :] = np.inf
    a[4, 299] = np.nan
    a[5, 7] = np.inf
    a[5, 9] = -np.inf
    for dtype in (bt.float32, bt.bfloat16, bt.float64):
        c, g = _pair(a, dtype)
        for d in (0, 1):
            _close(getattr(g, op)(d), getattr(c, op)(d), f"{op} {dtype} NaN/inf dim={d}")
        _close(getattr(g, op)(), getattr(c, op)(), f"{op} {dtype} NaN/inf flat")


def test_argreduce_noncontiguous_and_large(rng):
    a = rng.integers(0, 50, size=(40, 3000)).astype(np.float64)
    c, g = _pair(a, bt.float32)
    for op in ("argmax", "argmin"):
        for d in (0, 1):
            _close(getattr(g.T, op)(d), getattr(c.T, op)(d), f"{op} transposed dim={d}")
            _close(getattr(g[:, ::7], op)(d), getattr(c[:, ::7], op)(d), f"{op} sliced dim={d}")
    big = rng.integers(0, 1000, size=(1 << 21,)).astype(np.float64)
    c, g = _pair(big, bt.float32)
    _close(g.argmax(), c.argmax(), "argmax flat 2M (split path)")
    _close(g.argmin(), c.argmin(), "argmin flat 2M (split path)")


# ---- index_select / gather ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [bt.float32, bt.bfloat16, bt.float64, bt.int64, bt.uint8, bt.bool], ids=str
)
@pytest.mark.parametrize("idx_dtype", [bt.int64, bt.int32], ids=str)
def test_index_select(rng, dtype, idx_dtype):
    for shape in [(7,), (50, 33), (50, 32), (6, 70), (4, 9, 16), (3, 5, 7, 2)]:
        a = _rand(rng, shape, dtype)
        c, g = _pair(a, dtype)
        for d in range(len(shape)):
            n = shape[d]
            idx = rng.integers(-n, n, size=2 * n + 1)  # repeats and negatives
            ic, ig = _pair(idx, idx_dtype)
            _close(
                bt.index_select(g, d, ig),
                bt.index_select(c, d, ic),
                f"index_select {dtype} {shape} dim={d}",
            )
            e = bt.tensor(np.zeros(0, np.int64), dtype=idx_dtype)
            _close(
                bt.index_select(g, d, e.to("cuda")),
                bt.index_select(c, d, e),
                f"index_select empty {shape} dim={d}",
            )
        # non-contiguous input and index
        if len(shape) >= 2:
            idx = rng.integers(0, shape[-1], size=20)
            ic, ig = _pair(idx, idx_dtype)
            _close(
                bt.index_select(g.transpose(0, -1), 0, ig),
                bt.index_select(c.transpose(0, -1), 0, ic),
                f"index_select transposed {dtype} {shape}",
            )
            _close(
                bt.index_select(g, -1, ig[::2]),
                bt.index_select(c, -1, ic[::2]),
                f"index_select strided index {dtype} {shape}",
            )


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_index_select_embedding(rng, dtype):
    V, C = 50257, 768
    w = rng.standard_normal((V, C)).astype(np.float32)
    c, g = _pair(w, dtype)
    ids = rng.integers(0, V, size=4096)
    ic, ig = _pair(ids, bt.int64)
    r = bt.index_select(g, 0, ig)
    np.testing.assert_array_equal(_np(r), _np(bt.index_select(c, 0, ic)), err_msg="embedding fwd")


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.int64, bt.bool], ids=str)
def test_gather(rng, dtype):
    for shape in [(7,), (5, 7), (4, 6, 9), (2, 3, 4, 5)]:
        a = _rand(rng, shape, dtype)
        c, g = _pair(a, dtype)
        for d in range(len(shape)):
            ishape = [max(1, s - 1) for s in shape]
            ishape[d] = 2 * shape[d] + 1
            idx = rng.integers(-shape[d], shape[d], size=ishape)
            for idt in (bt.int64, bt.int32):
                ic, ig = _pair(idx, idt)
                _close(
                    bt.gather(g, d, ig),
                    bt.gather(c, d, ic),
                    f"gather {dtype} {shape} dim={d} {idt}",
                )
            if len(shape) >= 2:  # non-contiguous input
                ct, gt = _strided(a, dtype)
                ic, ig = _pair(idx, bt.int64)
                _close(
                    bt.gather(gt, d, ig),
                    bt.gather(ct, d, ic),
                    f"gather strided {dtype} {shape} dim={d}",
                )


# ---- index_add / scatter_add -------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [bt.float32, bt.bfloat16, bt.float16, bt.float64, bt.int64, bt.int32], ids=str
)
def test_index_add(rng, dtype):
    for shape in [(7,), (10, 33), (10, 32), (4, 9, 16), (3, 5, 6, 2)]:
        for d in range(len(shape)):
            base = _rand(rng, shape, dtype)
            J = 3 * shape[d] + 5
            idx = rng.integers(-shape[d], shape[d], size=J)  # many repeats
            sshape = list(shape)
            sshape[d] = J
            src = _rand(rng, sshape, dtype)
            bc, bg = _pair(base, dtype)
            sc, sg = _pair(src, dtype)
            for idt in (bt.int64, bt.int32):
                ic, ig = _pair(idx, idt)
                what = f"index_add {dtype} {shape} dim={d} {idt}"
                _close(bt.index_add(bg, d, ig, sg), bt.index_add(bc, d, ic, sc), what, k=4)
            if len(shape) >= 2:  # non-contiguous base and source
                ic, ig = _pair(idx, bt.int64)
                bct, bgt = _strided(base, dtype)
                sct, sgt = _strided(src, dtype)
                _close(
                    bt.index_add(bgt, d, ig, sgt),
                    bt.index_add(bct, d, ic, sct),
                    f"index_add strided {dtype} {shape} dim={d}",
                    k=4,
                )


def test_index_add_empty_and_all_same(rng):
    base = rng.standard_normal((5, 8))
    bc, bg = _pair(base, bt.float32)
    e = np.zeros(0, np.int64)
    ec, eg = _pair(e, bt.int64)
    z = np.zeros((0, 8))
    zc, zg = _pair(z, bt.float32)
    _close(bt.index_add(bg, 0, eg, zg), bt.index_add(bc, 0, ec, zc), "index_add empty index")
    idx = np.full(5000, 3)  # one hot index: one long segment split into pieces
    src = rng.standard_normal((5000, 8))
    ic, ig = _pair(idx, bt.int64)
    sc, sg = _pair(src, bt.float32)
    _close(bt.index_add(bg, 0, ig, sg), bt.index_add(bc, 0, ic, sc), "index_add one index", k=10)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_index_add_embedding_backward(rng, dtype):
    V, C, N = 50257, 768, 16384
    # Zipf-like ids: a few very frequent tokens, as in text.
    ids = np.minimum(rng.zipf(1.3, size=N) - 1, V - 1)
    src = rng.standard_normal((N, C)).astype(np.float32)
    bc, bg = _pair(np.zeros((V, C), np.float32), dtype)
    ic, ig = _pair(ids, bt.int64)
    sc, sg = _pair(src, dtype)
    r1 = bt.index_add(bg, 0, ig, sg)
    if dtype == bt.float32:
        _close(r1, bt.index_add(bc, 0, ic, sc), f"embedding backward {dtype}", k=4)
    # Against float64 sums of the (rounded) rows: the CPU's 16-bit index_add rounds after every
    # add, so thousands of repeats of a frequent token drift far more than the GPU's float sums.
    ref = np.zeros((V, C))
    np.add.at(ref, ids, _np(sc))
    err = np.abs(_np(r1) - ref).max() / np.abs(ref).max()
    assert err <= TOL[dtype] * 4, f"embedding backward {dtype} vs float64: max error {err:.3g}"
    r2 = bt.index_add(bg, 0, ig, sg)
    assert _raw(r1) == _raw(r2), "embedding backward: two runs differ"


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.float64, bt.int64])
def test_index_add_in_caller_given_scratch_makes_no_allocator_call(rng, dtype):
    """Note [caller-given scratch]: with a region of _index_add_scratch_bytes, index_add's
    temporaries (keys, positions, their sorted copies, cub's storage, partial sums) come from it:
    the same bytes as without it, no allocator call. Bytes around the region stay untouched, and
    a region one byte short falls back to the allocator, not to a wrong result."""
    import blutrain.alloc as alloc

    V, C, N = 1000, 96, 4096
    ids = np.minimum(rng.zipf(1.3, size=N) - 1, V - 1)
    src = rng.standard_normal((N, C)).astype(np.float32)
    _, base = _pair(rng.standard_normal((V, C)).astype(np.float32), dtype)
    _, ig = _pair(ids, bt.int64)
    _, sg = _pair(src, dtype)
    ref = bt.index_add(base, 0, ig, sg)
    need = bt._tensor._index_add_scratch_bytes("cuda:0", N, V, C, str(dtype).split(".")[-1])
    assert need >= N * C * 4
    guard = 4096
    region = bt.full((need + 2 * guard,), 7, dtype=bt.uint8, device="cuda")
    bt.cuda.synchronize()
    before = alloc.stats("cuda:0")["alloc_count"]
    got = bt._tensor._with_scratch(
        region[guard : guard + need], lambda: bt.index_add(base, 0, ig, sg)
    )
    bt.cuda.synchronize()
    calls = alloc.stats("cuda:0")["alloc_count"] - before
    assert _raw(got) == _raw(ref)
    assert calls == 1, calls  # index_add's own result only
    edges = region.cpu().numpy()
    assert (edges[:guard] == 7).all() and (edges[guard + need :] == 7).all()
    short = bt._tensor._with_scratch(region[: need - 1], lambda: bt.index_add(base, 0, ig, sg))
    assert _raw(short) == _raw(ref)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize(
    "dtype", [bt.float32, bt.bfloat16, bt.float64, bt.int64, bt.int32, bt.uint8], ids=str
)
def test_scatter_add(rng, dtype, deterministic):
    old = bt.are_deterministic_algorithms_enabled()
    bt.use_deterministic_algorithms(deterministic)
    try:
        for shape in [(7,), (5, 7), (4, 6, 9)]:
            for d in range(len(shape)):
                base = _rand(rng, shape, dtype)
                ishape = [max(1, s - 1) for s in shape]
                ishape[d] = 3 * shape[d]
                idx = rng.integers(-shape[d], shape[d], size=ishape)
                src = _rand(rng, ishape, dtype)
                bc, bg = _pair(base, dtype)
                sc, sg = _pair(src, dtype)
                ic, ig = _pair(idx, bt.int64)
                what = f"scatter_add {dtype} {shape} dim={d} det={deterministic}"
                r1 = bt.scatter_add(bg, d, ig, sg)
                _close(r1, bt.scatter_add(bc, d, ic, sc), what, k=4)
                if deterministic:
                    assert _raw(r1) == _raw(bt.scatter_add(bg, d, ig, sg)), f"{what}: runs differ"
                if len(shape) >= 2:  # non-contiguous src and index
                    sct, sgt = _strided(src, dtype)
                    ict, igt = _strided(idx, bt.int64)
                    _close(
                        bt.scatter_add(bg, d, igt, sgt),
                        bt.scatter_add(bc, d, ict, sct),
                        what + " strided",
                        k=4,
                    )
    finally:
        bt.use_deterministic_algorithms(old)


def test_scatter_add_many_repeats_deterministic(rng):
    bt.use_deterministic_algorithms(True)
    try:
        base = np.zeros(10)
        idx = rng.integers(0, 10, size=200000)
        src = rng.standard_normal(200000)
        bc, bg = _pair(base, bt.float32)
        ic, ig = _pair(idx, bt.int64)
        sc, sg = _pair(src, bt.float32)
        r1 = bt.scatter_add(bg, 0, ig, sg)
        _close(r1, bt.scatter_add(bc, 0, ic, sc), "scatter_add 200k into 10", k=20)
        assert _raw(r1) == _raw(bt.scatter_add(bg, 0, ig, sg))
    finally:
        bt.use_deterministic_algorithms(False)


# ---- index range errors (policy: device-side check, raised at the next synchronisation) --------


@pytest.mark.parametrize("op", ["index_select", "index_add", "gather", "scatter_add"])
def test_bad_index_raises_and_never_writes_out_of_bounds(rng, op):
    x = bt.tensor(rng.standard_normal((4, 5)), dtype=bt.float32).to("cuda")
    bad = bt.tensor(np.array([0, 9, 1]), dtype=bt.int64).to("cuda")
    with pytest.raises(IndexError, match=op):
        if op == "index_select":
            r = bt.index_select(x, 0, bad)
        elif op == "index_add":
            r = bt.index_add(x, 0, bad, bt.ones(3, 5, device="cuda"))
        elif op == "gather":
            r = bt.gather(x, 0, bad.reshape(3, 1))
        else:
            r = bt.scatter_add(x, 0, bad.reshape(3, 1), bt.ones(3, 1, device="cuda"))
        r.cpu()  # the error surfaces at the synchronisation
    # The error was cleared; the device is still usable.
    ok = bt.tensor(np.array([0, 3, 1]), dtype=bt.int64).to("cuda")
    np.testing.assert_array_equal(_np(bt.index_select(x, 0, ok)), _np(x)[[0, 3, 1]])


# (base or table shape, dim, indices whose last alone is out of range, indices in range or None):
# the output is empty
EMPTY_OUT = {
    "index_add": ((0,), 0, [3], None),  # the fuzz's case (session 54): a (0,) base
    "index_add_cols": ((0, 5), 1, [2, 7], [4, -5]),  # no rows; index 7 against 5 columns
    "index_select": ((5, 0), 0, [1, 7], [4, -5]),  # a (5, 0) table
    "embedding": ((5, 0), 0, [1, -1], [4, 0]),  # embedding's ids must be >= 0
}


@pytest.mark.parametrize("case", list(EMPTY_OUT))
def test_empty_output_still_checks_its_indices_as_the_cpu(case):
    """Note [empty outputs check indices] (cuda/index.cu): an op whose output is empty raises on
    an out-of-range index on CUDA as on the CPU (scatter_add's front refuses these itself)."""
    shape, dim, bad, good = EMPTY_OUT[case]
    op = case.removesuffix("_cols")

    def call(dev: str, idx: list) -> bt.Tensor:
        x = bt.zeros(*shape, device=dev)
        i = bt.tensor(np.array(idx), dtype=bt.int64).to(dev)
        if op == "index_add":
            src = list(shape)
            src[dim] = len(idx)
            return bt.index_add(x, dim, i, bt.ones(*src, device=dev))
        if op == "index_select":
            return bt.index_select(x, dim, i)
        return bt.embedding(i, x)

    for dev in ("cpu", "cuda"):
        with pytest.raises(
            IndexError,
            match=rf"\[{op}\] index {bad[-1]} is out of range",
        ):
            call(dev, bad).cpu()  # CUDA: raised at the synchronisation
    if good is not None:  # in range: no error, the CPU's (empty) result
        got, ref = call("cuda", good), call("cpu", good)
        assert got.shape == ref.shape and got.numel() == 0


# ---- cat ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.int64, bt.bool], ids=str)
def test_cat(rng, dtype):
    for shape in [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 5)]:
        for d in range(len(shape)):
            parts = []
            for k in (1, 0, 3, 2):
                s = list(shape)
                s[d] = k
                parts.append(_rand(rng, s, dtype))
            cs = [bt.tensor(p, dtype=dtype) for p in parts]
            gs = [c.to("cuda") for c in cs]
            _close(bt.cat(gs, d), bt.cat(cs, d), f"cat {dtype} {shape} dim={d}")
            if len(shape) >= 2:  # a non-contiguous piece
                t = _rand(rng, shape, dtype)
                tc, tg = _strided(t, dtype)
                _close(
                    bt.cat([gs[0], tg, gs[2]], d),
                    bt.cat([cs[0], tc, cs[2]], d),
                    f"cat strided {dtype} {shape} dim={d}",
                )


def test_cat_mixed_dtypes_and_large(rng):
    a = rng.standard_normal((1024, 768))
    b = rng.integers(0, 5, size=(1024, 5))
    ca, ga = _pair(a, bt.bfloat16)
    cb, gb = _pair(b, bt.int64)
    _close(bt.cat([ga, gb], 1), bt.cat([ca, cb], 1), "cat mixed dtypes")
    _close(bt.cat([ga, ga, ga], 1), bt.cat([ca, ca, ca], 1), "cat qkv-like")


# ---- fast kernels against the reference (v1) kernels ---------------------------------------------


def test_reduce_fast_paths_match_v1(rng, monkeypatch):
    cases = [
        ((4096, 768), (0,)),
        ((1 << 20,), None),
        ((1024, 768), (1,)),
        ((50, 7, 768), (1,)),
        ((3, 100003), (1,)),
        ((8, 512, 768), (0, 1)),
    ]
    for dtype in (bt.float32, bt.bfloat16):
        for shape, dims in cases:
            g = bt.tensor(_rand(rng, shape, dtype), dtype=dtype).to("cuda")
            ops = ["sum", "mean", "amax", "amin", "var"]
            monkeypatch.delenv("BT_CUDA_REDUCE_V1", raising=False)
            fast = [_reduce(g, op, dims, False) for op in ops]
            monkeypatch.setenv("BT_CUDA_REDUCE_V1", "1")
            ref = [_reduce(g, op, dims, False) for op in ops]
            monkeypatch.delenv("BT_CUDA_REDUCE_V1")
            for op, a, b in zip(ops, fast, ref):
                floor = 0.0
                if op in ("sum", "mean"):  # rounding scales with the reduction of |x|
                    floor = float(np.abs(_np(_reduce(g.abs(), op, dims, False))).max(initial=0))
                _close(a, b, f"{op} {dtype} {shape} {dims}: fast vs v1", k=4, floor=floor)
            if dims is not None and len(dims) == 1:
                for op in ("argmax", "argmin"):
                    a = getattr(g, op)(dims[0])
                    monkeypatch.setenv("BT_CUDA_REDUCE_V1", "1")
                    b = getattr(g, op)(dims[0])
                    monkeypatch.delenv("BT_CUDA_REDUCE_V1")
                    _close(a, b, f"{op} {dtype} {shape} {dims}: fast vs v1")


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
def test_index_fast_paths_match_v1_bitwise(rng, monkeypatch, dtype):
    V, C, n = 5000, 768, 4096
    w = bt.tensor(rng.standard_normal((V, C)), dtype=dtype).to("cuda")
    ids = bt.tensor(np.minimum(rng.zipf(1.3, size=n) - 1, V - 1), dtype=bt.int64).to("cuda")
    src = bt.tensor(rng.standard_normal((n, C)), dtype=dtype).to("cuda")
    monkeypatch.delenv("BT_CUDA_INDEX_V1", raising=False)
    fast = [bt.index_select(w, 0, ids), bt.index_add(w, 0, ids, src)]
    monkeypatch.setenv("BT_CUDA_INDEX_V1", "1")
    ref = [bt.index_select(w, 0, ids), bt.index_add(w, 0, ids, src)]
    monkeypatch.delenv("BT_CUDA_INDEX_V1")
    # Same summation order per column in both: the bytes must match.
    assert _raw(fast[0]) == _raw(ref[0]), "index_select: 16-byte path differs from v1"
    assert _raw(fast[1]) == _raw(ref[1]), "index_add: vector path differs from v1"


def test_index_select_out_on_cuda(rng):
    """index_select(..., out=) on CUDA: index_select's values in the given tensor, no
    allocation, on the current stream."""
    import blutrain.alloc as alloc

    a = rng.standard_normal((300, 70)).astype(np.float32)
    x = bt.tensor(a).to("cuda")
    for dim in (0, 1):
        idx = bt.tensor(rng.integers(0, a.shape[dim], 33)).to("cuda")
        want = bt.index_select(x, dim, idx)
        out = bt.empty(want.shape, device="cuda")
        n0 = alloc.stats("cuda:0")["alloc_count"]
        bt.index_select(x, dim, idx, out=out)
        assert alloc.stats("cuda:0")["alloc_count"] == n0
        np.testing.assert_array_equal(out.cpu().numpy(), want.cpu().numpy())
