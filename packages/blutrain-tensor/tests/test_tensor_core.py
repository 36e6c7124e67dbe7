"""dtypes and promotion, creation, random numbers, numpy/DLPack exchange, item, repr."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import blutrain.tensor as bt

ALL = [bt.bool, bt.uint8, bt.int32, bt.int64, bt.float16, bt.bfloat16, bt.float32, bt.float64]


def test_dtype_basics():
    assert [d.itemsize for d in ALL] == [1, 1, 4, 8, 2, 2, 4, 8]
    assert repr(bt.float32) == "bt.float32"
    assert bt.float16.is_floating_point and not bt.int32.is_floating_point
    assert bt.float is bt.float32 and bt.int is bt.int32 and bt.long is bt.int64


@pytest.mark.parametrize(
    "a,b,want",
    [
        (bt.bool, bt.bool, bt.bool),
        (bt.bool, bt.uint8, bt.uint8),
        (bt.uint8, bt.int32, bt.int32),
        (bt.int32, bt.int64, bt.int64),
        (bt.int64, bt.float16, bt.float16),
        (bt.float16, bt.bfloat16, bt.float32),
        (bt.bfloat16, bt.float32, bt.float32),
        (bt.float32, bt.float64, bt.float64),
        (bt.bool, bt.float64, bt.float64),
    ],
)
def test_promotion_table(a, b, want):
    assert bt.promote_types(a, b) == want == bt.promote_types(b, a)
    assert (bt.ones(2, dtype=a) * bt.ones(2, dtype=b)).dtype == want


def test_weak_scalars():
    assert (bt.ones(2, dtype=bt.bfloat16) * 2.5).dtype == bt.bfloat16
    assert (bt.ones(2, dtype=bt.int32) * 2).dtype == bt.int32
    assert (bt.ones(2, dtype=bt.int32) * 2.5).dtype == bt.float32
    assert (bt.ones(2, dtype=bt.bool) + 1).dtype == bt.int64
    assert (bt.ones(2, dtype=bt.int64) / 2).dtype == bt.float32
    assert (bt.ones(2, dtype=bt.float16) > 0.5).dtype == bt.bool


@pytest.mark.parametrize("dt", ALL)
def test_creation_and_numpy_roundtrip(dt):
    z = bt.zeros(2, 3, dtype=dt)
    o = bt.ones((2, 3), dtype=dt)
    f = bt.full((2, 3), 1, dtype=dt)
    assert z.shape == o.shape == f.shape == (2, 3) and z.dtype == dt
    assert not z.float().numpy().any()
    np.testing.assert_array_equal(o.float().numpy(), np.ones((2, 3)))
    np.testing.assert_array_equal(f.float().numpy(), np.ones((2, 3)))
    e = bt.empty(4, dtype=dt)
    assert e.shape == (4,)
    if dt != bt.bfloat16:
        assert o.numpy().dtype == np.dtype(str(dt).removeprefix("bt."))


@pytest.mark.parametrize("dt", [bt.float16, bt.bfloat16])
def test_half_conversions_round_to_nearest_even(dt, rng):
    a = np.concatenate(
        [rng.standard_normal(1000) * 10, [0.0, -0.0, 65504, 1e-7, 3e38, np.inf, -np.inf, 1 / 3]]
    )
    t = bt.tensor(a, dtype=bt.float32).to(dt)
    got = t.float().numpy()
    if dt == bt.float16:
        with np.errstate(over="ignore"):
            want = a.astype(np.float32).astype(np.float16).astype(np.float32)
    else:
        import struct  # bf16 reference: round-to-nearest-even on the top 16 bits

        def bf16(x):
            u = struct.unpack("<I", struct.pack("<f", x))[0]
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            return struct.unpack("<f", struct.pack("<I", u))[0]

        want = np.array(
            [bf16(x) if np.isfinite(x) else x for x in a.astype(np.float32)], dtype=np.float32
        )
    np.testing.assert_array_equal(got, want)
    nan = bt.tensor([float("nan")]).to(dt).float().item()
    assert math.isnan(nan)


def test_tensor_from_python_data():
    assert bt.tensor([1.0, 2.0]).dtype == bt.float32
    assert bt.tensor([1, 2]).dtype == bt.int64
    assert bt.tensor([True, False]).dtype == bt.bool
    assert bt.tensor(np.ones(2)).dtype == bt.float64
    assert bt.tensor([[1, 2], [3, 4]], dtype=bt.bfloat16).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert bt.tensor(5).item() == 5 and isinstance(bt.tensor(5).item(), int)
    assert bt.tensor(True).item() is True
    t = bt.tensor([1.0], requires_grad=True)
    assert t.requires_grad and t.is_leaf


def test_from_numpy_is_zero_copy_and_tensor_copies():
    a = np.arange(12.0).reshape(3, 4)
    shared = bt.from_numpy(a)
    copied = bt.tensor(a)
    a[0, 0] = 42
    assert shared[0, 0].item() == 42 and copied[0, 0].item() == 0
    back = shared.numpy()
    back[1, 1] = -1
    assert a[1, 1] == -1  # numpy() shares too
    # strided and negatively strided arrays are views as well
    v = bt.from_numpy(a[::-1, ::2])
    np.testing.assert_array_equal(v.numpy(), a[::-1, ::2])
    with pytest.raises(TypeError, match=r"\[from_numpy\] unsupported numpy dtype"):
        bt.from_numpy(np.zeros(2, dtype=np.uint16))


def test_numpy_keeps_tensor_alive():
    t = bt.arange(10.0)
    a = t.numpy()
    del t
    assert a.sum() == 45.0


def test_numpy_of_grad_tensor_and_bf16():
    t = bt.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"\[numpy\].*detach"):
        t.numpy()
    with pytest.raises(TypeError, match=r"\[numpy\] numpy has no bfloat16"):
        bt.ones(2, dtype=bt.bfloat16).numpy()


def test_dlpack_roundtrip_numpy_and_torch(torch_ref):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = bt.from_dlpack(a)
    a[0, 0] = 9
    assert t[0, 0].item() == 9
    back = np.from_dlpack(t.T)
    np.testing.assert_array_equal(back, a.T)
    assert t.__dlpack_device__() == (1, 0)
    tt = torch_ref.from_dlpack(bt.arange(6.0).reshape(2, 3))
    assert tt.shape == (2, 3) and tt[1, 2].item() == 5.0
    b16 = torch_ref.arange(4, dtype=torch_ref.bfloat16)
    tb = bt.from_dlpack(b16)
    assert tb.dtype == bt.bfloat16 and tb.tolist() == [0.0, 1.0, 2.0, 3.0]
    rt = torch_ref.from_dlpack(bt.ones(3, dtype=bt.bfloat16))
    assert rt.dtype == torch_ref.bfloat16


def test_arange_and_item():
    assert bt.arange(5).tolist() == [0, 1, 2, 3, 4]
    assert bt.arange(1, 2, 0.25).tolist() == [1.0, 1.25, 1.5, 1.75]
    assert bt.arange(5, 0, -2).tolist() == [5, 3, 1]
    assert bt.arange(3, dtype=bt.float64).dtype == bt.float64
    assert bt.arange(5, 0, 1).tolist() == []  # an empty range, as numpy's
    with pytest.raises(ValueError, match=r"\[arange\] the range .* more than int64 can count"):
        bt.arange(2.0**70)  # (was an empty tensor: an out-of-range double -> int64 cast)
    with pytest.raises(ValueError, match=r"\[arange\] the integer operand .* does not fit int64"):
        bt.arange(2**70)
    with pytest.raises(RuntimeError, match=r"\[item\] a tensor with 3 elements"):
        bt.ones(3).item()


def test_random_is_seedable_and_counter_based():
    bt.manual_seed(123)
    a = bt.rand(1000)
    b = bt.randn(1000)
    bt.manual_seed(123)
    a2 = bt.rand(1000)
    b2 = bt.randn(1000)
    np.testing.assert_array_equal(a.numpy(), a2.numpy())
    np.testing.assert_array_equal(b.numpy(), b2.numpy())
    assert not np.array_equal(a.numpy(), b2.numpy())
    # the offset advances by ceil(n / 4) counters per call, whatever the shape
    bt.manual_seed(5)
    c = bt.rand(6)
    seed, off = bt._C._philox_state()
    assert (seed, off) == (5, 2)
    bt.manual_seed(5)
    assert bt.rand(2, 3).reshape(6).tolist() == c.tolist()
    assert bt.initial_seed() == 5


def test_random_distributions():
    bt.manual_seed(0)
    u = bt.rand(200000, dtype=bt.float64).numpy()
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 5e-3
    n = bt.randn(200000).numpy().astype(np.float64)
    assert abs(n.mean()) < 1e-2 and abs(n.std() - 1) < 1e-2
    r = bt.randint(-3, 4, (100000,)).numpy()
    assert r.min() == -3 and r.max() == 3 and r.dtype == np.int64
    assert set(np.bincount(r + 3)) and abs(np.bincount(r + 3).mean() - 100000 / 7) < 1
    h = bt.randn(1000, dtype=bt.bfloat16)
    assert h.dtype == bt.bfloat16


def test_philox_known_answer():
    # Random123's published known-answer vector for philox4x32-10, key (0, 0), counter 0:
    # 6627e8d5 e169c58d bc57ac4c 9b00dbd8.  Our element i of rand() with seed 0, offset 0 takes
    # word i of counter 0, so the first 4 floats are ((w >> 8) + 0.5) / 2^24.
    bt.manual_seed(0)
    got = bt.rand(4, dtype=bt.float32).numpy().astype(np.float64)
    words = [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    want = [(np.float32(w >> 8) + np.float32(0.5)) * np.float32(2**-24) for w in words]
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_repr_like_pytorch():
    assert repr(bt.tensor([1.0, 2.0])) == "tensor([1., 2.])"
    assert repr(bt.tensor([1.5, 2.25])) == "tensor([1.5000, 2.2500])"
    assert repr(bt.tensor([[1, 2], [3, 4]])) == "tensor([[1, 2],\n        [3, 4]])"
    assert repr(bt.tensor([1.0], dtype=bt.float64)) == "tensor([1.], dtype=bt.float64)"
    assert repr(bt.tensor(3.0)) == "tensor(3.)"
    assert repr(bt.tensor([True, False])) == "tensor([ True, False])"
    assert repr(bt.zeros(0)) == "tensor([], size=(0,))"
    big = repr(bt.arange(2000))
    assert "..." in big and big.startswith("tensor([   0,    1,    2")
    assert "e-" in repr(bt.tensor([1e-6, 1.0]))


def test_device_strings():
    t = bt.ones(2)
    assert t.device == "cpu" and not t.is_cuda
    assert t.to("cpu")._is_same(t)
    assert t.to(bt.float64).dtype == bt.float64
    assert t.to("cpu", bt.int32).dtype == bt.int32


def test_c_abi_capsule():
    import ctypes

    cap = bt._C._C_API
    name = b"blutrain.tensor._C_API"
    ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
    ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    ptr = ctypes.pythonapi.PyCapsule_GetPointer(cap, name)
    version, size = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint32))[0:2]
    assert version == bt.ABI_VERSION and size >= 8 + 4 * 8


def _import_with(swap: str) -> subprocess.CompletedProcess:
    """`import blutrain.tensor` in a fresh interpreter after `swap` (code) replaced a module."""
    code = (
        "import ctypes, sys, types\n"
        "new = ctypes.pythonapi.PyCapsule_New\n"
        "new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, "
        "ctypes.c_void_p]\n" + swap + "\nimport blutrain.tensor as bt\n"
        "print('linalg:', bt._C._linalg_unavailable_reason())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_an_alloc_capsule_of_another_version_is_an_import_error_naming_both_sides():
    # blutrain.alloc's table claims ABI 9.0: blutrain.tensor (built for 1.x) must refuse it
    r = _import_with(
        "hdr = (ctypes.c_uint32 * 2)(9 << 16, 4096)\n"
        "m = types.ModuleType('blutrain.alloc._alloc')\n"
        "m.hdr, m._C_API = hdr, new(ctypes.addressof(hdr), b'blutrain.alloc._C_API', None)\n"
        "sys.modules['blutrain.alloc._alloc'] = m\n"
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: [blutrain.tensor] blutrain.alloc C ABI 9.0 is installed, but "
        "blutrain.tensor was built for 1."
    ), r.stderr


def test_a_wrong_linalg_capsule_leaves_matmul_off_with_both_sides_named():
    # linalg's module holds alloc's capsule: tensor imports (linalg is optional) and matmul says
    # which capsule it found where
    r = _import_with(
        "import blutrain.alloc._alloc as a\n"
        "m = types.ModuleType('blutrain.linalg._linalg')\n"
        "m._C_API = a._C_API\n"
        "sys.modules['blutrain.linalg._linalg'] = m\n"
    )
    assert r.returncode == 0, r.stderr
    from blutrain.linalg import _linalg

    v = _linalg.ABI_VERSION  # the headers tensor was built with (this checkout's linalg)
    assert r.stdout.strip() == (
        "linalg: [blutrain.tensor] blutrain.linalg._linalg._C_API is the capsule "
        "'blutrain.alloc._C_API', not 'blutrain.linalg._C_API' with blutrain.linalg's C ABI "
        f"table (blutrain.tensor needs {v >> 16}.{v & 0xFFFF})"
    )


def test_a_bad_alloc_conf_stops_the_import_naming_the_key():
    # blutrain.alloc refuses the setting at import; tensor's capsule import passes it on
    env = dict(os.environ, BLUTRAIN_ALLOC_CONF="expandable_segment:1")
    r = subprocess.run(
        [sys.executable, "-c", "import blutrain.tensor"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("ImportError: [blutrain.tensor] needs blutrain.alloc's C ABI 1.")
    ), r.stderr
    assert (
        "importing blutrain.alloc._alloc failed: [BLUTRAIN_ALLOC_CONF] unknown key "
        "'expandable_segment' (did you mean 'expandable_segments'?)" in r.stderr
    ), r.stderr


def test_c_abi_describe_and_bump_version():
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [
            ("data", ctypes.c_void_p),
            ("ndim", ctypes.c_int32),
            ("dtype", ctypes.c_int32),
            ("device", ctypes.c_int32),
            ("reserved_", ctypes.c_int32),
            ("shape", ctypes.c_int64 * 16),
            ("strides", ctypes.c_int64 * 16),
        ]

    class Api(ctypes.Structure):
        _fields_ = [
            ("abi_version", ctypes.c_uint32),
            ("struct_size", ctypes.c_uint32),
            ("last_error", ctypes.CFUNCTYPE(ctypes.c_char_p)),
            (
                "from_pyobject",
                ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(ctypes.c_void_p)),
            ),
            ("describe", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Info))),
            ("bump_version", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)),
        ]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api = Api.from_address(get(bt._C._C_API, b"blutrain.tensor._C_API"))
    t = bt.arange(12, dtype=bt.float64).reshape(3, 4).T
    h = ctypes.c_void_p()
    assert api.from_pyobject(t, ctypes.byref(h)) == 0
    info = Info()
    assert api.describe(h, ctypes.byref(info)) == 0
    assert info.data == t.data_ptr() and info.ndim == 2 and info.device == -1
    assert info.dtype == 7  # BT_TENSOR_FLOAT64
    assert list(info.shape[:2]) == [4, 3] and list(info.strides[:2]) == [1, 4]
    v = t._version
    assert api.bump_version(h) == 0 and t._version == v + 1
    assert api.from_pyobject([1, 2], ctypes.byref(h)) < 0
    assert b"not a blutrain Tensor" in api.last_error()
