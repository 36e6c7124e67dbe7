"""blutrain.tensor: typed tensors with reverse-mode autograd.

    import blutrain.tensor as bt
    x = bt.randn(4, 8, requires_grad=True)
    loss = (x @ x.T).softmax(-1).sum()
    loss.backward()

The C++ core (``_tensor``) holds tensors, ops, autograd and capture; this module adds the
PyTorch-style conveniences that are easiest in Python: ``tensor()`` from nested lists, grad-mode
context managers, the ``Function`` API for custom ops, ``capture()``, ``gradcheck`` and
``blutrain.tensor.nn`` (Module, Parameter, layers).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import sys
import types
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _argerrors

try:
    from . import _tensor as _C
except ImportError as _e:  # nanobind wraps an error of the module's init: raise the cause itself
    if isinstance(_e.__cause__, ImportError):  # (a refused C ABI capsule names both sides)
        raise _e.__cause__ from None
    raise

# A refused call raises "[op] argument 'x' must be ..." (Note [argument errors], init_errors.cpp).
# First of all: chaining an overload replaces each function object, so names are bound after.
for _scope in (_C, _C.Tensor, _C.Graph, _C.Node):
    _C._install_argument_errors(_scope)

from ._tensor import (  # noqa: E402
    ABI_VERSION,
    Node,
    Tensor,
    add_layer_norm,
    astype,
    available_cpus,
    bmm,
    cached_astype,
    cast_cache_bytes,
    cat,
    cross_entropy,
    cuda_built,
    cuda_device_count,
    drop_cast_cache,
    dropout,
    dtype,
    embedding,
    empty,
    from_dlpack,
    full,
    gather,
    gelu,
    get_num_threads,
    index_add,
    index_select,
    initial_seed,
    is_cast_cache_enabled,
    is_grad_enabled,
    layer_norm,
    linear,
    linear_cross_entropy,
    log_softmax,
    manual_seed,
    matmul,
    ones,
    promote_types,
    qkv_attention,
    rand,
    randint,
    randn,
    scaled_dot_product_attention,
    scatter_add,
    set_cast_cache_enabled,
    set_num_threads,
    softmax,
    stack,
    where,
    zeros,
)
from ._version import API_LEVEL, __version__  # noqa: E402

# ---- dtypes ------------------------------------------------------------------------------------
bool_ = dtype.bool
uint8 = dtype.uint8
int32 = dtype.int32
int64 = dtype.int64
float16 = dtype.float16
bfloat16 = dtype.bfloat16
float32 = dtype.float32
float64 = dtype.float64
half = float16
double = float64
long = int64
dtype.__repr__ = lambda self: f"bt.{self.name}"  # type: ignore[method-assign]
dtype.__str__ = dtype.__repr__  # type: ignore[method-assign]
dtype.is_floating_point = property(  # type: ignore[attr-defined]
    lambda self: _C.is_floating_point_dtype(self)
)
dtype.itemsize = property(lambda self: _C.itemsize(self))  # type: ignore[attr-defined]

_NUMPY_OK = {"bool", "uint8", "int32", "int64", "float16", "float32", "float64"}


def _linalg_status() -> str:
    """'' when blutrain-linalg is usable, else why not (matmul then raises with this reason)."""
    return _C._linalg_unavailable_reason()


# ---- creation ------------------------------------------------------------------------------------
def tensor(
    data: Any,
    dtype: dtype | str | None = None,
    device: str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """A new tensor holding a copy of ``data`` (nested lists, scalars, numpy arrays, tensors).

    Python floats become float32 (the default float dtype) and Python ints int64, as in PyTorch;
    numpy arrays keep their dtype.
    """
    if isinstance(data, Tensor):
        t = data.detach().clone()
    else:
        try:
            arr = np.asarray(data)
        except ValueError as e:  # ragged nesting: numpy's message, named as ours
            raise ValueError(f"[tensor] cannot make a tensor from this data: {e}") from e
        if not isinstance(data, np.ndarray | np.generic) and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        if arr.dtype.name not in _NUMPY_OK:
            if arr.dtype.kind in "iu":
                if arr.size and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
                    raise ValueError(
                        f"[tensor] {arr.dtype} values above 2**63 - 1 do not fit int64"
                    )
                arr = arr.astype(np.int64)
            elif arr.dtype.kind == "f":
                arr = arr.astype(np.float32)
            else:
                raise TypeError(
                    f"[tensor] cannot make a tensor from {_argerrors.describe(data)} (numpy "
                    f"makes it an array of dtype {arr.dtype}; expected numbers or bools)"
                )
        t = _C._from_numpy(np.asarray(arr, order="C")).clone()
    if dtype is not None:
        t = t.to(dtype)
    if device is not None:
        t = t.to(device)
    if requires_grad:
        t.requires_grad_(True)
    return t


def from_numpy(array: np.ndarray) -> Tensor:
    """A tensor sharing ``array``'s memory (no copy); writes through either are seen by both."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"[from_numpy] expected a numpy.ndarray, got {type(array).__name__}")
    if array.dtype.name not in _NUMPY_OK:
        raise TypeError(
            f"[from_numpy] unsupported numpy dtype {array.dtype}; supported: "
            + ", ".join(sorted(_NUMPY_OK))
        )
    return _C._from_numpy(array, array)


def as_tensor(data: Any, dtype: dtype | str | None = None, device: str | None = None) -> Tensor:
    """Like tensor(), but shares memory with a numpy array or tensor when nothing must change."""
    if isinstance(data, Tensor):
        t = data
    elif isinstance(data, np.ndarray) and data.dtype.name in _NUMPY_OK:
        t = from_numpy(data)
    else:
        return tensor(data, dtype=dtype, device=device)
    if dtype is not None:
        t = t.to(dtype)
    if device is not None:
        t = t.to(device)
    return t


def arange(
    start: builtins.float,
    end: builtins.float | None = None,
    step: builtins.float = 1,
    dtype: dtype | str | None = None,
    device: str | None = None,
    requires_grad: bool = False,
) -> Tensor:
    """Values from start (inclusive) to end (exclusive); int64 when all arguments are ints.

    Integer arguments are exact at any size (no rounding through double); every value must fit
    the dtype (an int32 or uint8 range that would wrap is a ValueError), and start, end and step
    must be finite.
    """
    if end is None:
        start, end = 0, start
    t = _C._arange(start, end, step, dtype, device)
    if requires_grad:
        t.requires_grad_(True)
    return t


def zeros_like(t: Tensor, dtype: dtype | None = None) -> Tensor:
    t = _as_input(t, "zeros_like")
    return zeros(*t.shape, dtype=dtype or t.dtype, device=t.device)


def ones_like(t: Tensor, dtype: dtype | None = None) -> Tensor:
    t = _as_input(t, "ones_like")
    return ones(*t.shape, dtype=dtype or t.dtype, device=t.device)


def full_like(t: Tensor, value: builtins.float, dtype: dtype | None = None) -> Tensor:
    t = _as_input(t, "full_like")
    return full(t.shape, value, dtype=dtype or t.dtype, device=t.device)


def empty_like(t: Tensor, dtype: dtype | None = None) -> Tensor:
    t = _as_input(t, "empty_like")
    return empty(*t.shape, dtype=dtype or t.dtype, device=t.device)


def rand_like(t: Tensor, dtype: dtype | None = None) -> Tensor:
    t = _as_input(t, "rand_like")
    return rand(*t.shape, dtype=dtype or t.dtype, device=t.device)


def randn_like(t: Tensor, dtype: dtype | None = None) -> Tensor:
    t = _as_input(t, "randn_like")
    return randn(*t.shape, dtype=dtype or t.dtype, device=t.device)


# ---- functional forms of the methods ----------------------------------------------------------
def _as_input(x: Any, op: str, what: str = "input") -> Tensor:
    """x, which a functional form calls a method of: a non-tensor is a TypeError naming the op
    and the argument (not Python's "'float' object has no attribute ...")."""
    if not isinstance(x, Tensor):
        raise TypeError(f"[{op}] argument '{what}' must be a Tensor, got {_argerrors.describe(x)}")
    return x


def _number(v: Any, op: str, what: str) -> builtins.float:
    """A float argument (an int, a numpy scalar, a one-element tensor); else a TypeError."""
    try:
        return builtins.float(v)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"[{op}] {what} must be a number, got {v!r}") from None


def _other(a: Any, b: Any, op: str) -> Any:
    """The tensor of a binary functional form called with a scalar first (bt.add(2, t))."""
    if not isinstance(b, Tensor):
        raise TypeError(
            f"[{op}] expected a Tensor operand, got {_argerrors.describe(a)} and "
            f"{_argerrors.describe(b)}"
        )
    return b


def _unary(name: str) -> Callable[[Tensor], Tensor]:
    def f(input: Tensor) -> Tensor:
        return _C.unary(name, _as_input(input, name))

    f.__name__ = name
    f.__doc__ = f"Elementwise {name}."
    return f


exp = _unary("exp")
log = _unary("log")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
tanh = _unary("tanh")
abs = _unary("abs")  # noqa: A001 (bt.abs, as torch.abs)
sigmoid = _unary("sigmoid")
relu = _unary("relu")
sin = _unary("sin")
cos = _unary("cos")
erf = _unary("erf")
sign = _unary("sign")
neg = _unary("neg")
logical_not = _unary("logical_not")


def add(a: Tensor, b: Any) -> Tensor:
    return a + b if isinstance(a, Tensor) else _other(a, b, "add").__radd__(a)


def sub(a: Tensor, b: Any) -> Tensor:
    return a - b if isinstance(a, Tensor) else _other(a, b, "sub").__rsub__(a)


def mul(a: Tensor, b: Any) -> Tensor:
    return a * b if isinstance(a, Tensor) else _other(a, b, "mul").__rmul__(a)


def div(a: Tensor, b: Any) -> Tensor:
    return a / b if isinstance(a, Tensor) else _other(a, b, "div").__rtruediv__(a)


def floor_divide(a: Tensor, b: Any) -> Tensor:
    """Python's a // b elementwise (rounds toward minus infinity; integer division by zero
    raises ZeroDivisionError, on CUDA at the next synchronisation)."""
    return a // b if isinstance(a, Tensor) else _other(a, b, "floor_divide").__rfloordiv__(a)


def remainder(a: Tensor, b: Any) -> Tensor:
    """Python's a % b elementwise: a - b * floor(a / b), with the divisor's sign (not C's fmod)."""
    return a % b if isinstance(a, Tensor) else _other(a, b, "remainder").__rmod__(a)


def pow(a: Tensor, b: Any) -> Tensor:  # noqa: A001
    """a ** b elementwise.  An integer tensor to a negative integer power gives C's integer
    answer: 1 for a base of 1, 1 or -1 for -1, else 0 (PyTorch raises for an integer tensor
    exponent, and gives the same for a Python int one)."""
    return a**b if isinstance(a, Tensor) else _other(a, b, "pow").__rpow__(a)


def maximum(a: Tensor, b: Tensor) -> Tensor:
    return _as_input(a, "maximum").maximum(b)


def minimum(a: Tensor, b: Tensor) -> Tensor:
    return _as_input(a, "minimum").minimum(b)


def eq(a: Tensor, b: Any) -> Tensor:
    return _as_input(a, "eq").eq(b)


def ne(a: Tensor, b: Any) -> Tensor:
    return _as_input(a, "ne").ne(b)


def lt(a: Tensor, b: Any) -> Tensor:
    return _as_input(a, "lt").lt(b)


def le(a: Tensor, b: Any) -> Tensor:
    return _as_input(a, "le").le(b)


def gt(a: Tensor, b: Any) -> Tensor:
    return _as_input(a, "gt").gt(b)


def ge(a: Tensor, b: Any) -> Tensor:
    return _as_input(a, "ge").ge(b)


def masked_fill(input: Tensor, mask: Tensor, value: builtins.float) -> Tensor:
    return _as_input(input, "masked_fill").masked_fill(mask, value)


def sum(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:  # noqa: A001
    return _as_input(input, "sum").sum(dim, keepdim)


def mean(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """The mean over dim (all dims when None).  Integer and bool inputs are averaged in float32
    (numpy's answer; PyTorch raises for them)."""
    return _as_input(input, "mean").mean(dim, keepdim)


def var(
    input: Tensor, dim: Any = None, correction: builtins.float = 1, keepdim: bool = False
) -> Tensor:
    """The variance over dim, divided by (count - correction).  Integer and bool inputs compute
    in float32 (PyTorch raises for them)."""
    return _as_input(input, "var").var(dim, correction, keepdim)


def amax(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return _as_input(input, "amax").amax(dim, keepdim)


def amin(input: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return _as_input(input, "amin").amin(dim, keepdim)


def argmax(input: Tensor, dim: builtins.int | None = None, keepdim: bool = False) -> Tensor:
    return _as_input(input, "argmax").argmax(dim, keepdim)


def argmin(input: Tensor, dim: builtins.int | None = None, keepdim: bool = False) -> Tensor:
    return _as_input(input, "argmin").argmin(dim, keepdim)


MaxResult = namedtuple("MaxResult", ["values", "indices"])


def _max(self: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    """max() over everything, max(other) elementwise, or max(dim) -> (values, indices)."""
    if isinstance(dim, Tensor):
        return self.maximum(dim)
    if dim is None:
        return self.amax(None, keepdim)
    return MaxResult(self.amax(dim, keepdim), self.argmax(dim, keepdim))


def _min(self: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
    if isinstance(dim, Tensor):
        return self.minimum(dim)
    if dim is None:
        return self.amin(None, keepdim)
    return MaxResult(self.amin(dim, keepdim), self.argmin(dim, keepdim))


def max(input: Tensor, dim: Any = None, keepdim: bool = False) -> Any:  # noqa: A001
    return _max(_as_input(input, "max"), dim, keepdim)


def min(input: Tensor, dim: Any = None, keepdim: bool = False) -> Any:  # noqa: A001
    return _min(_as_input(input, "min"), dim, keepdim)


def clamp(
    input: Tensor, min: builtins.float | None = None, max: builtins.float | None = None
) -> Tensor:  # noqa: A002
    """Limits values to [min, max]; the gradient is 1 inside (and on) the bounds, else 0."""
    r = _as_input(input, "clamp")
    if min is not None:
        r = where(r < min, min, r)
    if max is not None:
        r = where(r > max, max, r)
    return r


def reshape(input: Tensor, shape: Sequence[builtins.int]) -> Tensor:
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise TypeError(
            f"[reshape] argument 'shape' must be a sequence of ints, got "
            f"{_argerrors.describe(shape)}"
        )
    # (one argument: shape=((2,),) is a shape entry that is not an int, as in PyTorch, not
    # Tensor.reshape's one-tuple spelling of (2,))
    return _as_input(input, "reshape").reshape(tuple(shape))


def transpose(input: Tensor, dim0: builtins.int, dim1: builtins.int) -> Tensor:
    return _as_input(input, "transpose").transpose(dim0, dim1)


def permute(input: Tensor, dims: Sequence[builtins.int]) -> Tensor:
    if not isinstance(dims, Sequence) or isinstance(dims, str):
        raise TypeError(
            f"[permute] argument 'dims' must be a sequence of ints, got {_argerrors.describe(dims)}"
        )
    return _as_input(input, "permute").permute(*dims)


def squeeze(input: Tensor, dim: builtins.int | None = None) -> Tensor:
    return _as_input(input, "squeeze").squeeze(dim)


def unsqueeze(input: Tensor, dim: builtins.int) -> Tensor:
    return _as_input(input, "unsqueeze").unsqueeze(dim)


def flatten(input: Tensor, start_dim: builtins.int = 0, end_dim: builtins.int = -1) -> Tensor:
    return _as_input(input, "flatten").flatten(start_dim, end_dim)


def narrow(input: Tensor, dim: builtins.int, start: builtins.int, length: builtins.int) -> Tensor:
    return _as_input(input, "narrow").narrow(dim, start, length)


def split(input: Tensor, split_size_or_sections: Any, dim: builtins.int = 0) -> list[Tensor]:
    return _as_input(input, "split").split(split_size_or_sections, dim)


def chunk(input: Tensor, chunks: builtins.int, dim: builtins.int = 0) -> list[Tensor]:
    return _as_input(input, "chunk").chunk(chunks, dim)


def clone(input: Tensor) -> Tensor:
    return _as_input(input, "clone").clone()


def allclose(
    a: Tensor, b: Tensor, rtol: builtins.float = 1e-5, atol: builtins.float = 1e-8
) -> bool:
    """Whether a and b (broadcast together) agree within atol + rtol * |b| everywhere."""
    x, y = _np64(_as_input(a, "allclose")), _np64(_as_input(b, "allclose"))
    rtol, atol = _number(rtol, "allclose", "rtol"), _number(atol, "allclose", "atol")
    try:
        np.broadcast_shapes(x.shape, y.shape)
    except ValueError:
        raise ValueError(
            f"[allclose] shapes {tuple(x.shape)} and {tuple(y.shape)} cannot be broadcast"
        ) from None
    return builtins.bool(np.allclose(x, y, rtol=rtol, atol=atol))


def _np64(t: Tensor) -> np.ndarray:
    return t.detach().cpu().to(float64).numpy()


# ---- Tensor methods that are simplest in Python ------------------------------------------------
def _tolist(self: Tensor) -> Any:
    t = self.detach().cpu()
    if t.dtype == bfloat16:
        t = t.float()
    return t.numpy().tolist()


def _array(self: Tensor, dtype: Any = None, copy: Any = None) -> np.ndarray:
    """numpy's __array__ protocol: dtype converts (a copy), copy=True always copies."""
    dt = None
    if dtype is not None:
        try:
            dt = np.dtype(dtype)
        except (TypeError, ValueError):
            raise TypeError(
                f"[array] argument 'dtype' must be a numpy dtype, got {_argerrors.describe(dtype)}"
            ) from None
    a = self.numpy()
    if dt is not None and a.dtype != dt:
        if copy is False:
            raise ValueError(f"[array] copy=False, but {a.dtype} -> {dt} needs a copy")
        return a.astype(dt)
    return a.copy() if copy else a


def _iter(self: Tensor) -> Iterator[Tensor]:
    if self.ndim == 0:
        raise TypeError("[iter] iteration over a 0-d tensor")
    for i in range(self.shape[0]):
        yield self[i]


def _float(self: Tensor) -> builtins.float:
    return builtins.float(self.item())


def _int(self: Tensor) -> builtins.int:
    v = self.item()
    if isinstance(v, builtins.float) and not np.isfinite(v):
        raise ValueError(f"[int] cannot convert {v} to an int")
    return builtins.int(v)


def _index(self: Tensor) -> builtins.int:
    """An integer one-element tensor as an index (lists[t], range(t)); PyTorch's rule."""
    if self.numel() != 1 or self.is_floating_point() or self.dtype == bool_:
        raise TypeError(
            "[index] only an integer tensor of one element can be an index, got a "
            f"{self.dtype} tensor of shape {tuple(self.shape)}"
        )
    return builtins.int(self.item())


def _format(self: Tensor, spec: str) -> str:
    if self.numel() == 1 and spec:
        return format(self.item(), spec)
    return repr(self)


class RemovableHandle:
    """Returned by register_hook and register_post_accumulate_grad_hook: ``remove()`` erases the
    hook from the C++ autograd core, so backward no longer calls into Python for it and the fast
    paths a hooked tensor turns off are on again. Also a context manager (removes on exit)."""

    def __init__(self, handle: _C._HookHandle) -> None:
        self._handle: _C._HookHandle | None = handle

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _register_hook(self: Tensor, hook: Callable[[Tensor], Tensor | None]) -> RemovableHandle:
    """hook(grad) -> Tensor | None runs when this tensor's gradient is computed; a returned tensor
    replaces the gradient."""
    if not callable(hook):
        raise TypeError(f"[register_hook] hook must be callable, got {type(hook).__name__}")
    return RemovableHandle(self._register_hook(hook))


def _register_post_accumulate_grad_hook(
    self: Tensor, hook: Callable[[Tensor], None]
) -> RemovableHandle:
    """hook(tensor) runs once this leaf's .grad is final for the current backward."""
    if not callable(hook):
        raise TypeError(
            f"[register_post_accumulate_grad_hook] hook must be callable, got {type(hook).__name__}"
        )
    return RemovableHandle(self._register_post_accumulate_grad_hook(hook))


Tensor.register_hook = _register_hook  # type: ignore[attr-defined]
Tensor.register_post_accumulate_grad_hook = _register_post_accumulate_grad_hook  # type: ignore[attr-defined]
Tensor.max = _max  # type: ignore[method-assign]
Tensor.min = _min  # type: ignore[method-assign]
Tensor.tolist = _tolist  # type: ignore[attr-defined]
Tensor.__array__ = _array  # type: ignore[attr-defined]
Tensor.__array_ufunc__ = None  # numpy defers to our reflected operators
Tensor.__iter__ = _iter  # type: ignore[method-assign]
Tensor.__float__ = _float  # type: ignore[attr-defined]
Tensor.__int__ = _int  # type: ignore[attr-defined]
Tensor.__index__ = _index  # type: ignore[attr-defined]
Tensor.__format__ = _format  # type: ignore[method-assign]


def _t_softmax(self: Tensor, dim: builtins.int) -> Tensor:
    return softmax(self, dim)


def _t_log_softmax(self: Tensor, dim: builtins.int) -> Tensor:
    return log_softmax(self, dim)


def _t_matmul(self: Tensor, other: Tensor) -> Tensor:
    return matmul(self, other)


def _t_type_as(self: Tensor, other: Tensor) -> Tensor:
    return self.to(_as_input(other, "type_as", "other").dtype)


def _t_new_zeros(self: Tensor, *shape: builtins.int) -> Tensor:
    return zeros(*shape, dtype=self.dtype, device=self.device)


def _t_new_ones(self: Tensor, *shape: builtins.int) -> Tensor:
    return ones(*shape, dtype=self.dtype, device=self.device)


def _t_gelu(self: Tensor, approximate: str = "none") -> Tensor:
    return gelu(self, approximate)


def _t_clamp(self: Tensor, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002
    return clamp(self, min, max)


def _t_where(self: Tensor, condition: Tensor, other: Any) -> Tensor:
    return where(condition, self, other)


for _name, _fn in {
    "softmax": _t_softmax,
    "log_softmax": _t_log_softmax,
    "matmul": _t_matmul,
    "type_as": _t_type_as,
    "new_zeros": _t_new_zeros,
    "new_ones": _t_new_ones,
    "gelu": _t_gelu,
    "clamp": _t_clamp,
    "where": _t_where,
}.items():
    _fn.__name__ = _fn.__qualname__ = _name
    setattr(Tensor, _name, _fn)


def _returning_self(method: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """An in-place method that returns self itself, as PyTorch's: the C++ binding returns a new
    Python object for the same tensor, which would drop a subclass (nn.Parameter(x)
    .requires_grad_(False) would be a plain Tensor that a Module does not register)."""

    @functools.wraps(method)
    def f(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        method(self, *args, **kwargs)
        return self

    return f


for _name in dir(Tensor):
    if (_name.endswith("_") and not _name.endswith("__")) or _name in (
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
    ):
        setattr(Tensor, _name, _returning_self(getattr(Tensor, _name)))


# ---- grad mode ----------------------------------------------------------------------------------
class set_grad_enabled(contextlib.ContextDecorator):  # noqa: N801 (PyTorch's name)
    """Context manager (and decorator) that turns autograd recording on or off."""

    def __init__(self, mode: bool) -> None:
        self.prev = is_grad_enabled()
        self.mode = mode
        _C.set_grad_enabled(mode)

    def __enter__(self) -> None:
        _C.set_grad_enabled(self.mode)

    def __exit__(self, *exc: object) -> None:
        _C.set_grad_enabled(self.prev)


class no_grad(contextlib.ContextDecorator):  # noqa: N801
    """Ops inside record no autograd history (use for inference and optimizer steps)."""

    def __enter__(self) -> None:
        self.prev = is_grad_enabled()
        _C.set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        _C.set_grad_enabled(self.prev)


class enable_grad(contextlib.ContextDecorator):  # noqa: N801
    """Turns recording back on inside a no_grad region."""

    def __enter__(self) -> None:
        self.prev = is_grad_enabled()
        _C.set_grad_enabled(True)

    def __exit__(self, *exc: object) -> None:
        _C.set_grad_enabled(self.prev)


def backward(
    tensors: Tensor | Sequence[Tensor], grad_tensors: Any = None, retain_graph: bool = False
) -> None:
    """Backward from several roots at once (their gradients are summed into the leaves)."""
    _C.backward(tensors, grad_tensors, retain_graph)


# ---- custom functions ---------------------------------------------------------------------------
class FunctionCtx:
    """What forward() hands to backward(): saved tensors and flags."""

    def __init__(self) -> None:
        self._saved: tuple[Tensor, ...] = ()
        self._versions: tuple[builtins.int, ...] = ()
        self.needs_input_grad: tuple[bool, ...] = ()
        self._name = "Function"

    def save_for_backward(self, *tensors: Tensor) -> None:
        self._saved = tensors
        self._versions = tuple(t._version if t is not None else 0 for t in tensors)

    @property
    def saved_tensors(self) -> tuple[Tensor, ...]:
        for i, (t, v) in enumerate(zip(self._saved, self._versions, strict=True)):
            if t is not None and t._version != v:
                raise RuntimeError(
                    f"[backward] tensor {i} saved by {self._name}.save_for_backward was modified "
                    f"by an in-place operation (version {t._version}, expected {v})"
                )
        return self._saved


class Function:
    """Custom op with its own forward and backward (PyTorch's autograd.Function API).

        class Square(bt.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * x * g

        y = Square.apply(x)

    forward runs without recording; backward gets one gradient per output and returns one per
    input of forward (None for inputs that are not tensors or need no gradient).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any) -> Any:
        raise NotImplementedError("[Function] subclasses define forward(ctx, *args)")

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> Any:
        raise NotImplementedError("[Function] subclasses define backward(ctx, *grads)")

    @classmethod
    def apply(cls, *args: Any) -> Any:
        ctx = FunctionCtx()
        ctx._name = cls.__name__
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        with no_grad():
            out = cls.forward(ctx, *args)
        single = isinstance(out, Tensor)
        if not single and not (isinstance(out, tuple | list) and out):
            raise TypeError(
                f"[{cls.__name__}] forward must return a Tensor or a tuple of tensors, got "
                f"{_argerrors.describe(out)}"
            )
        outs = (out,) if single else tuple(out)
        # Fresh handles: an output that is an input must not get the input's history overwritten.
        outs = tuple(o.detach() if isinstance(o, Tensor) else o for o in outs)
        if is_grad_enabled() and builtins.any(ctx.needs_input_grad):
            tensor_outs = [o for o in outs if isinstance(o, Tensor)]
            nargs = len(args)

            def run_backward(grads: list[Tensor | None]) -> list[Tensor | None]:
                res = cls.backward(ctx, *grads)
                res = (res,) if not isinstance(res, tuple | list) else tuple(res)
                if len(res) != nargs:
                    raise RuntimeError(
                        f"[{cls.__name__}] backward returned {len(res)} gradients, expected "
                        f"{nargs} (one per forward argument)"
                    )
                return [res[i] for i in tensor_pos]

            _C._attach_function(
                cls.__name__, run_backward, [args[i] for i in tensor_pos], tensor_outs
            )
        return outs[0] if single else outs


from .graph import Graph, load_graph, op_schemas  # noqa: E402  (captured graphs as a contract)


# ---- capture -------------------------------------------------------------------------------------
def is_capturing() -> builtins.bool:
    """Whether ops on this thread are being recorded by bt.capture() (not run)."""
    return builtins.bool(_C._capturing())


@contextlib.contextmanager
def capture() -> Iterator[Graph]:
    """Record ops instead of running them: the graph blutrain-compiler builds on.

    with bt.capture() as g:
        y = model(x)          # symbolic tensors: shape, strides and dtype, no data
        y.sum().backward()    # backward ops are recorded too; p.grad is symbolic meanwhile
        g.mark_output(y)
    print(g)                  # nodes: op, attrs, inputs, outputs
    g.to_json(); g.hash()     # versioned JSON, content hash (docs/graph_format.md)
    g.replay()                # runs it through the eager kernels (eager's bits)

    Every node is checked against its op schema (``bt.op_schemas()``). When the block ends,
    every .grad the capture changed is put back (``g.grads`` says what it became).
    """
    if _C._capturing():
        raise RuntimeError("[capture] a capture is already active on this thread")
    g = Graph()
    _C._set_capture(g)
    try:
        yield g
    finally:
        _C._set_capture(None)


# ---- the eager op log ----------------------------------------------------------------------------
class OpLogEntry(NamedTuple):
    """A primitive evaluated eagerly: its name, its inputs' and outputs' (dtype name, shape)."""

    op: str
    inputs: list[tuple[str, tuple[builtins.int, ...]]]
    outputs: list[tuple[str, tuple[builtins.int, ...]]]


@contextlib.contextmanager
def op_log() -> Iterator[list[OpLogEntry]]:
    """Note every primitive evaluated eagerly inside the block, forward and backward, in order:
    which kernels a step runs, and the dtypes and shapes they read and write.

    with bt.op_log() as log:
        model(x, y)[1].backward()
    for e in log:             # filled when the block ends (also when it raises)
        print(e.op, e.inputs, e.outputs)   # "add_layer_norm" [("float32", (2, 64, 768)), ...]

    Views (reshape, transpose, ...) move no data and are left out; so is a bt.capture() inside
    the block (it records a graph of its own). The log is process-wide: ops of every thread are
    noted. One op log at a time: a nested bt.op_log() raises. A profiling aid: while on, each op
    appends an entry under a lock; off, it costs an op one atomic load.
    """
    if _C._op_log_on():
        raise RuntimeError("[op_log] an op log is already recording (one at a time)")
    entries: list[OpLogEntry] = []
    _C._op_log_start()
    try:
        yield entries
    finally:
        entries.extend(OpLogEntry(*e) for e in _C._op_log_stop())


# ---- gradient checking ---------------------------------------------------------------------------
def gradcheck(
    fn: Callable[..., Tensor],
    inputs: Sequence[Tensor],
    eps: builtins.float = 1e-6,
    atol: builtins.float = 1e-5,
    rtol: builtins.float = 1e-4,
    seed_cotangent: bool = True,
) -> bool:
    """Compares autograd's vector-Jacobian products with central finite differences.

    Inputs should be float64 leaves with requires_grad=True. The output is contracted with a fixed
    random cotangent (so non-scalar outputs are checked in every entry). Raises AssertionError
    naming the input and the worst entry on a mismatch; returns True otherwise.
    """
    if not callable(fn):
        raise TypeError(
            f"[gradcheck] argument 'fn' must be callable, got {_argerrors.describe(fn)}"
        )
    if isinstance(inputs, Tensor) or not isinstance(inputs, Sequence):
        raise TypeError(
            "[gradcheck] argument 'inputs' must be a sequence of tensors, got "
            + _argerrors.describe(inputs)
        )
    inputs = list(inputs)
    out = fn(*inputs)
    outs = (out,) if isinstance(out, Tensor) else tuple(out)
    rng = np.random.default_rng(1234)
    cots = [
        tensor(rng.standard_normal(o.shape) if seed_cotangent else np.ones(o.shape), dtype=o.dtype)
        for o in outs
    ]

    def scalar(*xs: Tensor) -> builtins.float:
        with no_grad():
            r = fn(*xs)
        rs = (r,) if isinstance(r, Tensor) else tuple(r)
        return builtins.sum(
            builtins.float((ri.double() * c.double()).sum().item())
            for ri, c in zip(rs, cots, strict=True)
            if ri.is_floating_point()
        )

    for x in inputs:
        if isinstance(x, Tensor):
            x.grad = None
    roots = [o for o in outs if o.requires_grad]
    backward(roots, [c for o, c in zip(outs, cots, strict=True) if o.requires_grad])
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor) or not x.requires_grad:
            continue
        analytic = x.grad.double().numpy() if x.grad is not None else np.zeros(x.shape)
        base = x.detach().numpy().copy()
        numeric = np.zeros(base.shape)
        flat = numeric.reshape(-1)
        for j in range(base.size):
            xp = base.copy().reshape(-1)
            xp[j] += eps
            plus = scalar(
                *[
                    tensor(xp.reshape(base.shape), dtype=x.dtype) if k == i else v
                    for k, v in enumerate(inputs)
                ]
            )
            xp[j] -= 2 * eps
            minus = scalar(
                *[
                    tensor(xp.reshape(base.shape), dtype=x.dtype) if k == i else v
                    for k, v in enumerate(inputs)
                ]
            )
            flat[j] = (plus - minus) / (2 * eps)
        if not np.allclose(analytic, numeric, atol=atol, rtol=rtol):
            err = np.abs(analytic - numeric)
            k = np.unravel_index(np.argmax(err), err.shape)
            raise AssertionError(
                f"[gradcheck] input {i}: analytic and numeric gradients differ at {k}: "
                f"{analytic[k]} vs {numeric[k]} (max abs err {err.max():.3g})"
            )
    return True


def clip_grad_norm_(parameters: Any, max_norm: builtins.float) -> Tensor:
    """Scales every parameter's .grad in place so their global L2 norm is at most max_norm.

    Returns the total norm before clipping (a 0-d tensor; no host sync is needed to apply it).
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    if not isinstance(parameters, Iterable) or isinstance(parameters, str | bytes):
        raise TypeError(
            "[clip_grad_norm_] argument 'parameters' must be a Tensor or an iterable of tensors, "
            f"got {_argerrors.describe(parameters)}"
        )
    max_norm = _number(max_norm, "clip_grad_norm_", "max_norm")
    if not max_norm >= 0:  # a negative or NaN bound would flip or poison every gradient
        raise ValueError(f"[clip_grad_norm_] max_norm must be >= 0, got {max_norm}")
    return _C.clip_grad_norm_(list(parameters), max_norm)


from . import backends, nn, optim  # noqa: E402  (nn uses the names above)
from .amp import (  # noqa: E402  (bt.amp: precision policies, autocast, checkpoint)
    autocast,
    checkpoint,
    get_float32_attention_precision,
    get_float32_matmul_precision,
    linear_gelu,
    linear_gelu_linear,
    set_float32_attention_precision,
    set_float32_matmul_precision,
)
from .cuda import are_deterministic_algorithms_enabled, use_deterministic_algorithms  # noqa: E402

# ---- public ops written in Python: errors name them (Note [argument errors], init_errors.cpp) ----
_ERRORS = (TypeError, ValueError, IndexError, RuntimeError, NotImplementedError, ZeroDivisionError)
# Ops that run the caller's code (hooks, fn): their errors keep the names they carry.
_RUNS_USER_CODE = {"backward", "gradcheck", "checkpoint", "autocast", "capture"}


def _public_op(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    """fn, whose errors start with "[op]": a call whose arguments do not bind to fn's signature
    (Python's own "f() takes 2 positional arguments ..."), and an error of an op fn is built from
    ("[where] ..." from clamp).  Costs a call frame; nothing more unless something raised."""
    rename = op not in _RUNS_USER_CODE

    @functools.wraps(fn)
    def f(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _ERRORS as e:
            tb = e.__traceback__
            if isinstance(e, TypeError):
                # arguments that do not bind (raised here, or a frame down: contextmanager)
                unbound = _argerrors.bind_failure(op, fn, args, kwargs)
                if unbound is not None:
                    raise TypeError(unbound) from None
                if tb is not None and tb.tb_next is None:
                    raise TypeError(f"[{op}] {e}") from None
            if not rename or type(e) not in _ERRORS:
                raise
            msg = str(e)
            close = msg.find("]")
            if not msg.startswith("[") or close < 0 or msg[1:close] == op:
                raise
            raise type(e)(f"[{op}]{msg[close + 1 :]}").with_traceback(tb) from None

    return f


# PyTorch spells these with builtin names; bound last so the functions above see the builtins.
float = float32  # noqa: A001
int = int32  # noqa: A001
bool = bool_  # noqa: A001

__all__ = [
    "ABI_VERSION",
    "API_LEVEL",
    "__version__",
    "add_layer_norm",
    "Callable",
    "Function",
    "FunctionCtx",
    "Graph",
    "Iterator",
    "MaxResult",
    "Node",
    "RemovableHandle",
    "Sequence",
    "Tensor",
    "abs",
    "add",
    "allclose",
    "amax",
    "are_deterministic_algorithms_enabled",
    "amin",
    "arange",
    "argmax",
    "argmin",
    "as_tensor",
    "astype",
    "autocast",
    "available_cpus",
    "backends",
    "backward",
    "bfloat16",
    "bmm",
    "cached_astype",
    "cast_cache_bytes",
    "bool",
    "bool_",
    "capture",
    "is_capturing",
    "load_graph",
    "op_schemas",
    "cat",
    "chunk",
    "checkpoint",
    "clamp",
    "clip_grad_norm_",
    "clone",
    "cos",
    "cross_entropy",
    "cuda_built",
    "cuda_device_count",
    "div",
    "double",
    "drop_cast_cache",
    "dropout",
    "dtype",
    "embedding",
    "empty",
    "empty_like",
    "enable_grad",
    "eq",
    "erf",
    "exp",
    "flatten",
    "float",
    "float16",
    "float32",
    "float64",
    "floor_divide",
    "from_dlpack",
    "from_numpy",
    "full",
    "full_like",
    "gather",
    "ge",
    "gelu",
    "get_float32_attention_precision",
    "get_float32_matmul_precision",
    "get_num_threads",
    "gradcheck",
    "gt",
    "half",
    "index_add",
    "index_select",
    "initial_seed",
    "int",
    "int32",
    "int64",
    "is_cast_cache_enabled",
    "is_grad_enabled",
    "layer_norm",
    "le",
    "linear",
    "linear_cross_entropy",
    "linear_gelu",
    "linear_gelu_linear",
    "log",
    "log_softmax",
    "logical_not",
    "long",
    "lt",
    "manual_seed",
    "masked_fill",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mul",
    "narrow",
    "ne",
    "neg",
    "nn",
    "no_grad",
    "op_log",
    "OpLogEntry",
    "ones",
    "ones_like",
    "optim",
    "permute",
    "pow",
    "promote_types",
    "qkv_attention",
    "rand",
    "rand_like",
    "randint",
    "randn",
    "randn_like",
    "relu",
    "remainder",
    "reshape",
    "rsqrt",
    "scaled_dot_product_attention",
    "scatter_add",
    "set_cast_cache_enabled",
    "set_float32_attention_precision",
    "set_float32_matmul_precision",
    "set_grad_enabled",
    "set_num_threads",
    "sigmoid",
    "sign",
    "sin",
    "softmax",
    "split",
    "sqrt",
    "squeeze",
    "stack",
    "sub",
    "sum",
    "tanh",
    "tensor",
    "transpose",
    "uint8",
    "unsqueeze",
    "use_deterministic_algorithms",
    "var",
    "where",
    "zeros",
    "zeros_like",
]

# Bound last: every public name is defined by now.
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, types.FunctionType):
        globals()[_name] = _public_op(_obj, _name)
        _home = sys.modules.get(_obj.__module__)
        if _home is not None and getattr(_home, _name, None) is _obj:  # bt.cuda.x is bt.x
            setattr(_home, _name, globals()[_name])
for _name, _op_name in {
    "max": "max",
    "min": "min",
    "tolist": "tolist",
    "__array__": "array",
    "__iter__": "iter",
    "__float__": "float",
    "__int__": "int",
    "__index__": "index",
    "__format__": "format",
    "softmax": "softmax",
    "log_softmax": "log_softmax",
    "matmul": "matmul",
    "type_as": "type_as",
    "new_zeros": "new_zeros",
    "new_ones": "new_ones",
    "gelu": "gelu",
    "clamp": "clamp",
    "where": "where",
    "register_hook": "register_hook",
    "register_post_accumulate_grad_hook": "register_post_accumulate_grad_hook",
}.items():
    setattr(Tensor, _name, _public_op(getattr(Tensor, _name), _op_name))
# constructors of the public classes: "[no_grad] ..." rather than Python's "no_grad() takes no
# arguments" (the fuzz's EXEMPT classes are not constructed by users, so they are left alone)
for _cls in (set_grad_enabled, no_grad, enable_grad, Graph, FunctionCtx, RemovableHandle):
    _cls.__init__ = _public_op(_cls.__init__, _cls.__name__)  # type: ignore[method-assign]
for _name in [n for n in vars(nn.functional) if not n.startswith("_")]:
    if isinstance(globals().get(_name), types.FunctionType):  # the wrapped op, not the original
        setattr(nn.functional, _name, staticmethod(globals()[_name]))
