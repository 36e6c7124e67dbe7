"""blutrain.linalg: GEMMs with fused epilogues on the CPU (OpenBLAS) and CUDA (cuBLASLt).

Everything reduces to one call of the C ABI (``blutrain/linalg.h``)::

    D = epilogue(alpha * op(A) @ op(B) + beta * C)

:func:`matmul` exposes it whole; :func:`linear`, :func:`linear_backward` and
:func:`matmul_dgelu` are the shapes a transformer's MLP needs. Inputs are numpy arrays or
DLPack / ``__cuda_array_interface__`` objects (PyTorch, CuPy), taken zero-copy; the result is
of the input's kind (numpy in, numpy out; torch in, torch out). CUDA outputs come from
blutrain-alloc. Errors start with the op and name the shapes, e.g.
``[gemm] A is (64, 32) and B is (16, 8): k differs (32 vs 16)``.

Modes (``mode=``) say how products of float32 inputs are formed: ``"fp32"`` (fp32-accurate,
the default; on CUDA sm_80+ our 3xTF32 tensor-core kernel, whose error is below cuBLAS
SGEMM's, unless ``set_option("fp32_3xtf32", 0)`` picks SGEMM), ``"tf32"`` (tensor cores,
10-bit mantissa operands), ``"bf16"`` / ``"fp16"`` (operands rounded to 16 bits).
Accumulation is always fp32 or wider. float16 / bfloat16 inputs use their own precision (fp32
accumulation); float64 inputs compute in float64. The CPU emulates the reduced modes by
rounding the operands the same way.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, NamedTuple

import numpy as np

from . import _linalg
from ._linalg import cache_path, clear_cache, get_option, save_cache, set_cache_path, set_option

__all__ = [
    "matmul",
    "linear",
    "linear_backward",
    "matmul_dgelu",
    "gelu",
    "dgelu",
    "has_cuda",
    "set_option",
    "get_option",
    "cache_path",
    "set_cache_path",
    "save_cache",
    "clear_cache",
    "get_include",
    "get_cmake_dir",
    "EPILOGUES",
    "MODES",
]

F32, F64, F16, BF16 = _linalg.F32, _linalg.F64, _linalg.F16, _linalg.BF16
_DTYPE_NAMES = {F32: "float32", F64: "float64", F16: "float16", BF16: "bfloat16"}

EPILOGUES = {
    "none": 0,
    "bias": 1,
    "gelu": 2,
    "bias_gelu": 3,
    "gelu_aux": 4,
    "bias_gelu_aux": 5,
    "dgelu": 6,
    "dgelu_bgrad": 7,
    "bgrad_a": 8,
    "bgrad_b": 9,
}
MODES = {"default": 0, "fp32": 1, "tf32": 2, "bf16": 3, "fp16": 4}
_MODE_DTYPE = {"bf16": BF16, "fp16": F16, "fp32": F32}
_WITH_BIAS = {1, 3, 5}
_WRITES_AUX = {4, 5}
_READS_AUX = {6, 7}
_WITH_BGRAD = {7, 8, 9}


# ---- loading the CPU BLAS and cuBLASLt -------------------------------------------------------
def _load_blas() -> None:
    # The C library opens OpenBLAS by path (see src/cpu/gemm_cpu.cpp for why): find it through
    # the scipy_openblas32 package wherever pip put it. A failure is reported by the first
    # CPU call, so CUDA-only users are not bothered.
    if os.environ.get("BLUTRAIN_LINALG_BLAS"):
        return
    try:
        import scipy_openblas32 as sob

        lib_dir = sob.get_lib_dir()
        name = sob.get_library()
        for fname in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
            path = os.path.join(lib_dir, fname)
            if os.path.exists(path):
                _linalg.load_blas(path)
                return
    except Exception:  # noqa: BLE001 - reported on first use instead
        pass


def _preload_cublaslt() -> None:
    # The C library dlopens "libcublasLt.so.13"; when cuBLAS comes from the nvidia-cublas wheel
    # rather than the system, load it here by path so the soname lookup finds it.
    if not _linalg.get_option("cuda") or os.environ.get("BLUTRAIN_LINALG_CUBLASLT"):
        return
    try:
        import nvidia

        for base in list(nvidia.__path__):
            path = os.path.join(base, "cu13", "lib", "libcublasLt.so.13")
            if os.path.exists(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return
    except Exception:  # noqa: BLE001 - the system's copy may still be found
        pass


def _env_options() -> None:
    # BLUTRAIN_LINALG_OPTIONS="autotune=1,workspace_bytes=0": settings before the first call.
    spec = os.environ.get("BLUTRAIN_LINALG_OPTIONS", "")
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        set_option(name.strip(), int(value or 1))


_load_blas()
_preload_cublaslt()
_env_options()


def has_cuda() -> bool:
    """Whether this build has the CUDA backend (a device may still be absent)."""
    return bool(_linalg.get_option("cuda"))


def get_include() -> str:
    """Directory holding ``blutrain/linalg.h`` and ``blutrain/linalg_import.h``."""
    from ._paths import include_dir

    return include_dir()


def get_cmake_dir() -> str:
    """Directory for CMake's ``find_package(BlutrainLinalg)``."""
    from ._paths import cmake_dir

    return cmake_dir()


# ---- array views -------------------------------------------------------------------------------
class _View(NamedTuple):
    obj: Any  # keeps the memory alive
    kind: str  # "numpy", "torch", "cupy", "dlpack"
    ptr: int
    shape: tuple
    strides: tuple  # in elements
    dtype: int
    device: int  # -1 CPU, >= 0 CUDA ordinal


_NP_CODES = {np.dtype(np.float32): F32, np.dtype(np.float64): F64, np.dtype(np.float16): F16}
_CAI_CODES = {"<f4": F32, "<f8": F64, "<f2": F16}


def _np_code(dt: np.dtype) -> int:
    code = _NP_CODES.get(dt)
    if code is None and dt.name == "bfloat16":  # ml_dtypes
        code = BF16
    return -1 if code is None else code


def _bad_dtype(op: str, name: str, what: Any) -> TypeError:
    return TypeError(
        f"[{op}] {name} has dtype {what}: expected float32, float64, float16 or bfloat16"
    )


_TORCH: dict = {}  # filled on first sight of a torch tensor: {"Tensor": cls, dtype: code}


def _torch_tensor_type() -> Any:
    t = sys.modules.get("torch")
    if t is None:
        return None
    if not _TORCH:
        _TORCH["Tensor"] = t.Tensor
        _TORCH.update({t.float32: F32, t.float64: F64, t.float16: F16, t.bfloat16: BF16})
        raw = getattr(t._C, "_cuda_getCurrentRawStream", None)
        _TORCH["stream"] = (
            raw if raw is not None else (lambda dev: t.cuda.current_stream(dev).cuda_stream)
        )
    return _TORCH["Tensor"]


def _view(x: Any, name: str, op: str) -> _View:
    if type(x) is np.ndarray or isinstance(x, np.ndarray):
        code = _np_code(x.dtype)
        if code < 0:
            raise _bad_dtype(op, name, x.dtype)
        item = x.itemsize
        if any(s % item for s in x.strides):
            x = np.ascontiguousarray(x)
        return _View(
            x, "numpy", x.ctypes.data, x.shape, tuple(s // item for s in x.strides), code, -1
        )
    tt = _torch_tensor_type()
    if tt is not None and isinstance(x, tt):  # the hot path of training loops: kept lean
        code = _TORCH.get(x.dtype, -1)
        if code < 0:
            raise _bad_dtype(op, name, x.dtype)
        if not (x.is_cuda or x.device.type == "cpu"):
            raise ValueError(f"[{op}] {name} is on {x.device}: expected cpu or cuda")
        return _View(x, "torch", x.data_ptr(), x.shape, x.stride(), code, x.get_device())
    mod = type(x).__module__
    if mod.startswith("cupy"):
        cai = x.__cuda_array_interface__
        code = _CAI_CODES.get(cai["typestr"], -1)
        if code < 0:
            raise _bad_dtype(op, name, x.dtype)
        item = x.itemsize
        return _View(
            x,
            "cupy",
            cai["data"][0],
            tuple(x.shape),
            tuple(s // item for s in x.strides),
            code,
            x.device.id,
        )
    if hasattr(x, "__dlpack__"):
        ptr, shape, strides, code, dev_type, dev_id = _linalg.describe(x)
        if code < 0:
            raise _bad_dtype(op, name, "of DLPack code (unsupported)")
        if dev_type not in (1, 2, 3):  # kDLCPU, kDLCUDA, kDLCUDAHost
            raise ValueError(
                f"[{op}] {name} is on DLPack device type {dev_type}: expected CPU or CUDA"
            )
        return _View(
            x, "dlpack", ptr, tuple(shape), tuple(strides), code, dev_id if dev_type == 2 else -1
        )
    if hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        code = _CAI_CODES.get(cai["typestr"], -1)
        if code < 0:
            raise _bad_dtype(op, name, cai["typestr"])
        shape = tuple(cai["shape"])
        item = 8 if code == F64 else 4 if code == F32 else 2
        if cai.get("strides") is None:
            strides, acc = [], 1
            for s in reversed(shape):
                strides.append(acc)
                acc *= s
            strides = tuple(reversed(strides))
        else:
            strides = tuple(s // item for s in cai["strides"])
        dev = x.__dlpack_device__()[1] if hasattr(x, "__dlpack_device__") else 0
        return _View(x, "dlpack", cai["data"][0], shape, strides, code, dev)
    arr = np.asarray(x)
    if arr.dtype.kind in "iub":
        arr = arr.astype(np.float64)
    return _view(arr, name, op)


def _dev_name(d: int) -> str:
    return "cpu" if d < 0 else f"cuda:{d}"


def _shape_str(shape: tuple) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


class _Mat(NamedTuple):
    ptr: int
    rows: int  # stored rows (row-major)
    cols: int
    ld: int
    batch: int
    batch_stride: int
    flipped: bool  # storage is the transpose of the logical matrix


def _as_blas(v: _View, name: str, op: str, allow_flip: bool = True) -> _Mat | None:
    """Maps a 2-D or 3-D view onto a BLAS operand; None when no unit stride fits."""
    if len(v.shape) not in (2, 3):
        raise ValueError(f"[{op}] {name} is {_shape_str(v.shape)}: expected 2 or 3 dimensions")
    r, c = v.shape[-2], v.shape[-1]
    s0, s1 = v.strides[-2], v.strides[-1]
    batch = v.shape[0] if len(v.shape) == 3 else 1
    bs = v.strides[0] if len(v.shape) == 3 and batch > 1 else 0
    if bs < 0:
        return None
    if r == 0 or c == 0:  # nothing is read or written: any valid ld
        return _Mat(v.ptr, r, c, max(c, 1), batch, bs, False)
    if c <= 1 or s1 == 1:
        ld = s0 if r > 1 else max(c, 1)
        if ld >= max(c, 1):
            return _Mat(v.ptr, r, c, ld, batch, bs, False)
    if allow_flip and (r <= 1 or s0 == 1):
        ld = s1 if c > 1 else max(r, 1)
        if ld >= max(r, 1):
            return _Mat(v.ptr, c, r, ld, batch, bs, True)
    return None


def _resolve_stream(stream: Any, v: _View) -> int:
    if v.device < 0:
        return 0
    if stream is None:
        if v.kind == "torch":
            return _TORCH["stream"](v.device)
        if v.kind == "cupy":
            import cupy

            return cupy.cuda.get_current_stream().ptr
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"stream must be an int or a stream object, got {type(stream).__name__}")


def _np_dtype(code: int) -> np.dtype:
    if code == BF16:
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            raise TypeError("[gemm] a bfloat16 numpy output needs the ml_dtypes package") from None
    return np.dtype({F32: np.float32, F64: np.float64, F16: np.float16}[code])


def _contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _empty(like: _View, shape: tuple, code: int, stream: int) -> tuple[Any, _View]:
    """An output of `like`'s kind and device; returns (object, view).

    CUDA outputs come from blutrain-alloc, ordered on `stream`, and are handed to the caller's
    framework through DLPack; where blutrain-alloc is unavailable (or use_alloc=0), from the
    framework's own allocator.
    """
    if like.kind == "numpy":
        arr = np.empty(shape, _np_dtype(code))
        return arr, _view(arr, "out", "gemm")
    use_alloc = like.device >= 0 and _linalg.alloc_available() and get_option("use_alloc")
    if like.kind == "torch" and not use_alloc:
        import torch

        tdt = {F32: torch.float32, F64: torch.float64, F16: torch.float16, BF16: torch.bfloat16}
        t = torch.empty(shape, dtype=tdt[code], device="cpu" if like.device < 0 else like.device)
        return t, _view(t, "out", "gemm")
    if like.kind == "cupy" and not use_alloc:
        import cupy

        with cupy.cuda.Device(like.device):
            c = cupy.empty(shape, dtype=_np_dtype(code))
        return c, _view(c, "out", "gemm")
    raw = _linalg.empty(list(shape), code, like.device, stream)
    ptr = _linalg.describe(raw)[0]
    if like.kind == "torch":
        import torch

        obj = torch.from_dlpack(raw)
    elif like.kind == "cupy":
        import cupy

        obj = cupy.from_dlpack(raw)
    else:
        obj = raw
    return obj, _View(
        obj, like.kind, ptr, tuple(shape), _contiguous_strides(shape), code, like.device
    )


def _dtype_name(code: int) -> str:
    return _DTYPE_NAMES.get(code, "?")


def _code_of(dtype: Any) -> int:
    if dtype is None:
        return -1
    if isinstance(dtype, int):
        return dtype
    if not str(dtype).startswith("torch."):
        try:
            dtype = np.dtype(dtype).name
        except TypeError:
            pass
    s = str(dtype).replace("torch.", "")
    names = {
        "float32": F32,
        "float64": F64,
        "float16": F16,
        "bfloat16": BF16,
        "half": F16,
        "float": F32,
        "double": F64,
    }
    if s in names:
        return names[s]
    raise TypeError(f"[gemm] unsupported output dtype {dtype}")


# ---- the general entry -------------------------------------------------------------------------
def matmul(
    a: Any,
    b: Any,
    *,
    out: Any = None,
    transa: bool = False,
    transb: bool = False,
    alpha: float = 1.0,
    beta: float | None = None,
    c: Any = None,
    bias: Any = None,
    epilogue: str | None = None,
    aux: Any = None,
    bgrad: Any = None,
    mode: str | None = None,
    dtype: Any = None,
    stream: Any = None,
    _op: str = "gemm",
) -> Any:
    """``D = epilogue(alpha * op(a) @ op(b) + beta * c)``, op = transpose when trans* is set.

    a and b are 2-D, or 3-D for a strided batch (a 2-D operand is shared by every item).
    Transposed views (``x.T``) are taken as they are, without copies. ``beta`` defaults to 1
    when ``c`` is given, else 0; ``c`` may be ``out`` (in place). ``bias`` has n values and
    is broadcast over rows. ``epilogue`` is one of :data:`EPILOGUES` (default ``"bias"`` when
    a bias is given, else ``"none"``): ``*_aux`` also returns the pre-activation (into
    ``aux`` if given), ``dgelu*`` reads it from ``aux``, ``*bgrad*`` also returns the bias
    gradient (column sums of D for ``dgelu_bgrad``, row sums of op(a) for ``bgrad_a``,
    column sums of op(b) for ``bgrad_b``). ``dtype`` sets the output dtype (default: the
    inputs'). Returns D, or (D, aux) / (D, bgrad) for epilogues with a second output.
    """
    # Fast path (training loops call the same few signatures with torch tensors): everything
    # checked for a signature (shapes, strides, dtypes, devices and the options) is kept as a
    # plan, so a repeat reads the pointers and launches. Keys hold the full signature, so a
    # call that differs in any checked property takes the general path, which raises.
    tt = _TORCH.get("Tensor") or _torch_tensor_type()
    key = None
    if tt is not None and isinstance(a, tt) and isinstance(b, tt):
        try:
            key = (
                _op,
                a.shape,
                a.stride(),
                a.dtype,
                a.device,
                b.shape,
                b.stride(),
                b.dtype,
                b.device,
                None if out is None else _tsig(out, tt),
                None if c is None else _tsig(c, tt),
                None if bias is None else _tsig(bias, tt),
                None if aux is None else _tsig(aux, tt),
                None if bgrad is None else _tsig(bgrad, tt),
                transa,
                transb,
                alpha,
                beta,
                epilogue,
                mode,
                dtype,
            )
            plan = _PLANS.get(key)
        except (_NoPlan, TypeError):  # another kind of operand, or an unhashable option
            key = plan = None
        if plan is not None:
            return plan.run(a, b, out, c, bias, aux, bgrad, stream)
    return _matmul_slow(
        a,
        b,
        out=out,
        transa=transa,
        transb=transb,
        alpha=alpha,
        beta=beta,
        c=c,
        bias=bias,
        epilogue=epilogue,
        aux=aux,
        bgrad=bgrad,
        mode=mode,
        dtype=dtype,
        stream=stream,
        _op=_op,
        _key=key,
    )


def matmul_plan(a: Any, b: Any, **options: Any) -> _Plan:
    """Runs ``matmul(a, b, **options)`` through the checked general path and returns its plan,
    for a caller that repeats one signature with operands other than torch tensors (which
    :func:`matmul` plans by itself): ``plan.run(a, b, out, c, bias, aux, bgrad, stream)``
    repeats the product on operands of the same shapes, strides, dtypes and device, which it
    does not check again (the caller's guarantee: blutrain-compiler keys each plan on them).
    ``out`` must be given to the first call and to every run. A run skips the general path's
    views and checks: about 10 us less a call on the CPU."""
    if options.get("out") is None:
        raise ValueError("[gemm] matmul_plan needs out=")
    key = ("matmul_plan", object())
    _matmul_slow(a, b, _key=key, **options)
    return _PLANS.pop(key)


class _NoPlan(Exception):
    pass


def _tsig(x: Any, tt: type) -> tuple:
    if not isinstance(x, tt):
        raise _NoPlan
    return (x.shape, x.stride(), x.dtype, x.device)


_PLANS: dict = {}  # signature of a torch call -> _Plan


class _Plan:
    """What the general path worked out for one signature of torch operands."""

    __slots__ = ("g", "dev", "like", "dshape", "dcode", "epi", "bgrad_shape")

    def __init__(self, g, dev, dshape, dcode, epi, bgrad_shape):
        self.g = g
        self.dev = dev
        self.like = _View(None, "torch", 0, (), (), dcode, dev)
        self.dshape = dshape
        self.dcode = dcode
        self.epi = epi
        self.bgrad_shape = bgrad_shape

    def run(self, a, b, out, c, bias, aux, bgrad, stream):
        dev = self.dev
        if stream is None:
            s = _TORCH["stream"](dev) if dev >= 0 else 0
        else:
            s = _resolve_stream(stream, self.like)
        if out is None:
            out, vd = _empty(self.like, self.dshape, self.dcode, s)
            dptr = vd.ptr
        else:
            dptr = out.data_ptr()
        epi = self.epi
        auxp = bgp = 0
        if epi in _WRITES_AUX or epi in _READS_AUX:
            if aux is None:  # only for writers: readers without aux never made a plan
                aux, va = _empty(self.like, self.dshape, self.dcode, s)
                auxp = va.ptr
            else:
                auxp = aux.data_ptr()
        if epi in _WITH_BGRAD:
            if bgrad is None:
                bgrad, vb = _empty(self.like, self.bgrad_shape, self.dcode, s)
                bgp = vb.ptr
            else:
                bgp = bgrad.data_ptr()
        self.g.run(
            a.data_ptr(),
            b.data_ptr(),
            0 if c is None else c.data_ptr(),
            dptr,
            0 if bias is None else bias.data_ptr(),
            auxp,
            bgp,
            s,
        )
        if epi in _WRITES_AUX:
            return out, aux
        if epi in _WITH_BGRAD:
            return out, bgrad
        return out


def _matmul_slow(
    a: Any,
    b: Any,
    *,
    out: Any = None,
    transa: bool = False,
    transb: bool = False,
    alpha: float = 1.0,
    beta: float | None = None,
    c: Any = None,
    bias: Any = None,
    epilogue: str | None = None,
    aux: Any = None,
    bgrad: Any = None,
    mode: str | None = None,
    dtype: Any = None,
    stream: Any = None,
    _op: str = "gemm",
    _key: Any = None,
) -> Any:
    # The general path: views, checks and errors; builds the plan and runs it.
    op = _op
    va, vb = _view(a, "A", op), _view(b, "B", op)
    if va.device != vb.device:
        raise ValueError(
            f"[{op}] A is on {_dev_name(va.device)} and B is on "
            f"{_dev_name(vb.device)}: operands must share a device"
        )
    ma = _as_blas(va, "A", op)
    mb = _as_blas(vb, "B", op)
    if ma is None or mb is None:
        if va.kind == "numpy" and vb.kind == "numpy":
            if ma is None:
                va = _view(np.ascontiguousarray(va.obj), "A", op)
                ma = _as_blas(va, "A", op)
            if mb is None:
                vb = _view(np.ascontiguousarray(vb.obj), "B", op)
                mb = _as_blas(vb, "B", op)
        else:
            bad, v = ("A", va) if ma is None else ("B", vb)
            raise ValueError(
                f"[{op}] {bad} is {_shape_str(v.shape)} with strides "
                f"{_shape_str(v.strides)} (elements): a BLAS needs one of the last "
                "two strides to be 1 (make it contiguous first)"
            )
    ta = bool(transa) != ma.flipped
    tb = bool(transb) != mb.flipped
    # Logical op(A) is (m, k), op(B) is (k, n).
    la = va.shape[-2:] if not transa else va.shape[-2:][::-1]
    lb = vb.shape[-2:] if not transb else vb.shape[-2:][::-1]
    m, k = la
    k2, n = lb
    aname = "A^T" if transa else "A"
    bname = "B^T" if transb else "B"
    if k != k2:
        ashape = (
            _shape_str(va.shape) if not transa else f"{_shape_str(va.shape)} (op: {_shape_str(la)})"
        )
        bshape = (
            _shape_str(vb.shape) if not transb else f"{_shape_str(vb.shape)} (op: {_shape_str(lb)})"
        )
        raise ValueError(
            f"[{op}] {aname if not transa else 'A'} is {ashape} and "
            f"{bname if not transb else 'B'} is {bshape}: k differs ({k} vs {k2})"
        )
    if va.dtype != vb.dtype:
        raise TypeError(
            f"[{op}] A is {_dtype_name(va.dtype)} and B is {_dtype_name(vb.dtype)}: "
            "the inputs must share a dtype"
        )
    batch = max(ma.batch, mb.batch)
    if ma.batch != mb.batch and min(ma.batch, mb.batch) != 1:
        raise ValueError(
            f"[{op}] A is {_shape_str(va.shape)} and B is {_shape_str(vb.shape)}: "
            f"batch differs ({ma.batch} vs {mb.batch})"
        )
    batched_out = len(va.shape) == 3 or len(vb.shape) == 3

    # Mode.
    if mode is None or mode == "default":
        compute = 0
    else:
        if mode not in MODES:
            raise ValueError(f"[{op}] unknown mode {mode!r}: expected one of {sorted(MODES)}")
        if va.dtype == F32:
            compute = MODES[mode]
        elif va.dtype == _MODE_DTYPE.get(mode, -2):
            compute = 0
        else:
            raise ValueError(
                f"[{op}] mode {mode!r} applies to float32 inputs, but A and B are "
                f"{_dtype_name(va.dtype)}"
            )

    # Epilogue.
    if epilogue is None:
        epilogue = "bias" if bias is not None else "none"
    if epilogue not in EPILOGUES:
        raise ValueError(
            f"[{op}] unknown epilogue {epilogue!r}: expected one of {sorted(EPILOGUES)}"
        )
    epi = EPILOGUES[epilogue]
    if epi in _WITH_BIAS and bias is None:
        raise ValueError(f"[{op}] epilogue {epilogue!r} needs bias=")
    if epi not in _WITH_BIAS and bias is not None:
        raise ValueError(f"[{op}] bias= was given but epilogue {epilogue!r} does not add one")
    if epi in _READS_AUX and aux is None:
        raise ValueError(f"[{op}] epilogue {epilogue!r} needs aux= (the saved pre-activation)")

    s = _resolve_stream(stream, va)
    dev = va.device
    dshape = (batch, m, n) if batched_out else (m, n)

    # Output D.
    dcode = _code_of(dtype)
    if out is None:
        if dcode < 0:
            dcode = va.dtype
        out, vd = _empty(va, dshape, dcode, s)
    else:
        vd = _view(out, "out", op)
        if dcode >= 0 and vd.dtype != dcode:
            raise TypeError(f"[{op}] out is {_dtype_name(vd.dtype)} but dtype={dtype} was asked")
    if vd.device != dev:
        raise ValueError(f"[{op}] out is on {_dev_name(vd.device)} but A is on {_dev_name(dev)}")
    if tuple(vd.shape) != dshape:
        raise ValueError(
            f"[{op}] A is {_shape_str(va.shape)} and B is {_shape_str(vb.shape)}: "
            f"out must be {_shape_str(dshape)}, got {_shape_str(vd.shape)}"
        )
    md = _as_blas(vd, "out", op, allow_flip=False)
    if md is None:
        raise ValueError(
            f"[{op}] out {_shape_str(vd.shape)} has strides "
            f"{_shape_str(vd.strides)}: rows must have unit stride"
        )
    if batch > 1 and md.batch_stride == 0 and m * n > 0:
        raise ValueError(f"[{op}] out has batch stride 0")

    def vec_operand(x: Any, name: str, length: int) -> tuple:
        v = _view(x, name, op)
        if v.device != dev:
            raise ValueError(
                f"[{op}] {name} is on {_dev_name(v.device)} but A is on {_dev_name(dev)}"
            )
        if len(v.shape) == 1:
            bs = 0
        elif len(v.shape) == 2 and v.shape[0] == batch:
            bs = v.strides[0] if batch > 1 else 0
        else:
            raise ValueError(
                f"[{op}] {name} must be {_shape_str((length,))}, got {_shape_str(v.shape)}"
            )
        if v.shape[-1] != length:
            raise ValueError(
                f"[{op}] A is {_shape_str(va.shape)} and B is "
                f"{_shape_str(vb.shape)}: {name} must have {length} values, got "
                f"{_shape_str(v.shape)}"
            )
        if length > 1 and v.strides[-1] != 1:
            raise ValueError(f"[{op}] {name} must be contiguous")
        return (v.ptr, max(length, 1), bs, v.dtype), v

    def mat_operand(x: Any, name: str) -> tuple:
        v = _view(x, name, op)
        if v.device != dev:
            raise ValueError(
                f"[{op}] {name} is on {_dev_name(v.device)} but A is on {_dev_name(dev)}"
            )
        if (
            tuple(v.shape[-2:]) != (m, n)
            or len(v.shape) not in (2, 3)
            or (len(v.shape) == 3 and v.shape[0] not in (1, batch))
        ):
            raise ValueError(
                f"[{op}] A is {_shape_str(va.shape)} and B is "
                f"{_shape_str(vb.shape)}: {name} must be {_shape_str(dshape)}, got "
                f"{_shape_str(v.shape)}"
            )
        mm = _as_blas(v, name, op, allow_flip=False)
        if mm is None:
            raise ValueError(
                f"[{op}] {name} {_shape_str(v.shape)} has strides "
                f"{_shape_str(v.strides)}: rows must have unit stride"
            )
        return (mm.ptr, mm.ld, mm.batch_stride, v.dtype), v

    c_op = None
    if c is not None:
        if beta is None:
            beta = 1.0
        c_op, _vc = mat_operand(c, "C")
    if beta is None:
        beta = 0.0
    if beta != 0.0 and c is None:
        raise ValueError(f"[{op}] beta={beta} needs c=")

    bias_op = vec_operand(bias, "bias", n)[0] if epi in _WITH_BIAS else None
    aux_out = None
    aux_op = None
    if epi in _WRITES_AUX or epi in _READS_AUX:
        if aux is None:
            aux, _ = _empty(va, dshape, vd.dtype, s)
        aux_op, _va = mat_operand(aux, "aux")
        aux_out = aux
    bgrad_op = None
    if epi in _WITH_BGRAD:
        blen = m if epi == 8 else n
        if bgrad is None:
            bgrad, _ = _empty(va, (batch, blen) if batched_out else (blen,), vd.dtype, s)
        bgrad_op = vec_operand(bgrad, "bgrad", blen)[0]

    g = _linalg.GemmPlan(
        m,
        n,
        k,
        batch,
        int(ta),
        int(tb),
        (ma.ptr, ma.ld, ma.batch_stride, va.dtype),
        (mb.ptr, mb.ld, mb.batch_stride, vb.dtype),
        c_op,
        (md.ptr, md.ld, md.batch_stride, vd.dtype),
        float(alpha),
        float(beta),
        compute,
        epi,
        bias_op,
        aux_op,
        bgrad_op,
        dev,
    )
    g.run(
        ma.ptr,
        mb.ptr,
        c_op[0] if c_op is not None else 0,
        md.ptr,
        bias_op[0] if bias_op is not None else 0,
        aux_op[0] if aux_op is not None else 0,
        bgrad_op[0] if bgrad_op is not None else 0,
        s,
    )
    if _key is not None:  # torch operands only: the plan is reused for this signature
        if len(_PLANS) >= 4096:
            _PLANS.clear()
        _PLANS[_key] = _Plan(
            g,
            dev,
            dshape,
            vd.dtype,
            epi,
            (batch, m if epi == 8 else n) if batched_out else ((m if epi == 8 else n),),
        )
    if epi in _WRITES_AUX:
        return out, aux_out
    if epi in _WITH_BGRAD:
        return out, bgrad
    return out


# ---- the shapes of a linear layer --------------------------------------------------------------
def _rows2d(x: Any, name: str, op: str) -> tuple[Any, tuple]:
    """Collapses leading dims of x (..., f) into rows without copying; returns (x2d, lead)."""
    shape = tuple(x.shape)
    if len(shape) == 2:
        return x, shape[:1]
    if len(shape) < 2:
        raise ValueError(f"[{op}] {name} is {_shape_str(shape)}: expected (..., features)")
    try:
        return x.reshape(-1, shape[-1]), shape[:-1]
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"[{op}] {name} {_shape_str(shape)} cannot be viewed as rows") from e


def _unrows(y: Any, lead: tuple) -> Any:
    return y if len(lead) == 1 else y.reshape(*lead, y.shape[-1])


def linear(
    x: Any,
    weight: Any,
    bias: Any = None,
    *,
    activation: str | None = None,
    save_preact: bool = False,
    out: Any = None,
    mode: str | None = None,
    dtype: Any = None,
    stream: Any = None,
) -> Any:
    """``act(x @ weight.T + bias)`` with weight (out_features, in_features), as torch's Linear.

    x is (..., in_features). activation is None or ``"gelu"`` (tanh form), fused into the GEMM;
    with ``save_preact`` the pre-activation is returned too: ``(y, preact)``.
    """
    if activation not in (None, "gelu"):
        raise ValueError(f"[linear] unknown activation {activation!r}: expected None or 'gelu'")
    if save_preact and activation is None:
        raise ValueError("[linear] save_preact needs activation='gelu'")
    if len(tuple(weight.shape)) != 2:
        raise ValueError(
            f"[linear] weight is {_shape_str(tuple(weight.shape))}: expected "
            "(out_features, in_features)"
        )
    if tuple(x.shape)[-1:] != tuple(weight.shape)[1:]:
        raise ValueError(
            f"[linear] x is {_shape_str(tuple(x.shape))} and weight is "
            f"{_shape_str(tuple(weight.shape))}: in_features differs "
            f"({tuple(x.shape)[-1]} vs {tuple(weight.shape)[1]})"
        )
    x2, lead = _rows2d(x, "x", "linear")
    out2 = None if out is None else _rows2d(out, "out", "linear")[0]
    epi = "none"
    if activation == "gelu":
        epi = ("bias_gelu" if bias is not None else "gelu") + ("_aux" if save_preact else "")
    elif bias is not None:
        epi = "bias"
    r = matmul(
        x2,
        weight,
        transb=True,
        bias=bias,
        epilogue=epi,
        out=out2,
        mode=mode,
        dtype=dtype,
        stream=stream,
        _op="linear",
    )
    if save_preact:
        y, pre = r
        return _unrows(y, lead), _unrows(pre, lead)
    return _unrows(r, lead)


def linear_backward(
    dy: Any,
    x: Any,
    weight: Any,
    *,
    need_input_grad: bool = True,
    need_bias_grad: bool = True,
    mode: str | None = None,
    stream: Any = None,
) -> tuple[Any, Any, Any]:
    """Gradients of ``y = x @ weight.T + b``: ``(dx, dweight, dbias)``.

    dx = dy @ weight; dweight = dy^T @ x with dbias (column sums of dy) from the same call
    (the ``bgrad_a`` epilogue). Entries not asked for are None.
    """
    dy2, lead = _rows2d(dy, "dy", "linear_backward")
    x2, _ = _rows2d(x, "x", "linear_backward")
    dx = None
    if need_input_grad:
        dx = _unrows(matmul(dy2, weight, mode=mode, stream=stream, _op="linear_backward"), lead)
    if need_bias_grad:
        dw, db = matmul(
            dy2,
            x2,
            transa=True,
            epilogue="bgrad_a",
            mode=mode,
            stream=stream,
            _op="linear_backward",
        )
    else:
        dw, db = matmul(dy2, x2, transa=True, mode=mode, stream=stream, _op="linear_backward"), None
    return dx, dw, db


def matmul_dgelu(
    a: Any,
    b: Any,
    preact: Any,
    *,
    bias_grad: bool = False,
    transa: bool = False,
    transb: bool = False,
    out: Any = None,
    mode: str | None = None,
    stream: Any = None,
) -> Any:
    """``(op(a) @ op(b)) * gelu'(preact)``: the backward through a GELU fused into a GEMM.

    For an MLP ``h = gelu(x W1^T + b1); y = h W2^T + b2`` with ``preact`` saved by
    :func:`linear`, ``matmul_dgelu(dy, W2, preact, bias_grad=True)`` returns
    ``(dpre, db1)``. Returns dpre alone without bias_grad.
    """
    return matmul(
        a,
        b,
        aux=preact,
        epilogue="dgelu_bgrad" if bias_grad else "dgelu",
        transa=transa,
        transb=transb,
        out=out,
        mode=mode,
        stream=stream,
        _op="matmul_dgelu",
    )


# ---- references (numpy, float64) used by the tests and handy for users -------------------------
_S = np.sqrt(2.0 / np.pi)


def gelu(z: np.ndarray) -> np.ndarray:
    """GELU, tanh form, in numpy (the epilogue's definition)."""
    z = np.asarray(z, dtype=np.float64)
    return 0.5 * z * (1.0 + np.tanh(_S * (z + 0.044715 * z**3)))


def dgelu(z: np.ndarray) -> np.ndarray:
    """Derivative of :func:`gelu`, in numpy."""
    z = np.asarray(z, dtype=np.float64)
    t = np.tanh(_S * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _S * (1.0 + 3 * 0.044715 * z * z)
