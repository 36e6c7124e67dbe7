"""Property-based fuzzing of blutrain.tensor's public API: the engine (specs: tensor_fuzz_ops.py).

A *case* is one call of a public op, generated from (seed, index) alone: a valid call built by the
op's spec (tensor_fuzz_ops.py: shapes, dtypes, strides and views, read-only and foreign buffers,
NaN/inf, sizes near integer limits), then, in most cases, one argument replaced by a bad or edge
value (another dtype, shape or device, a 0-d or empty tensor, a dim out of range, 2**63, NaN, a
str, None, a surplus or unknown argument; an autograd misuse for the scenario specs).  A worker
process runs a batch of cases; each outcome is checked:

  * a raised exception is one of EXPECTED, its message starts with "[op]" for the op the user
    called (tensor_fuzz_ops.names_for) and, for a replaced argument, names it (its name, value,
    shape or dtype appears in the message);
  * a returned value matches the spec's numpy reference (float64 / int64, rounded to the result's
    dtype; the dtype must match PyTorch's promotion) and, for float64 cases, so do the gradients
    (central differences of the reference);
  * where the reference says the call is invalid (PyTorch raises) the op must raise, and where it
    says valid the op must not (for replaced arguments: only specs whose reference is exact about
    validity, Spec.strict).

The parent (test_tensor_fuzz.py, or `main` below) reads the worker's progress lines: a worker
that dies (a crash) or goes silent (a hang) is charged to the case it was running, and a new
worker continues after it.  Every failure is reported with its reproducer line:

    python tests/tensor_fuzz.py case SEED INDEX [--device cuda]    # prints the code, runs it

Usage: python tensor_fuzz.py run [--seed S] [--cases N] [--device cpu|cuda] [--workers W]
       python tensor_fuzz.py worker SEED START COUNT DEVICE   (what run starts)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
EXPECTED = (
    TypeError,
    ValueError,
    IndexError,
    RuntimeError,
    NotImplementedError,
    ZeroDivisionError,
    BufferError,
)
# Note [hang and crash verdicts]: a case is ~1 ms, but CI runs the suite on a loaded 2-core machine
# (other tests in the same process tree), where a worker can be starved for many seconds.  So
# silence only *suspects* a hang: the suspect case is then rerun alone in a fresh worker (a case is
# a function of (seed, index): run_case seeds the generator and resets globals), and only silence
# there too is a hang.  A case that finishes alone gets the outcome it has alone (and is listed as
# slow).  A crash is rerun alone as well: crashing alone or not, it fails (a crash that needs the
# earlier cases of its worker is heap damage they did), except a SIGKILL that does not repeat
# alone (the kernel's OOM killer or a person, not the case).  A worker that cannot start is
# retried, then fails the run: its cases are never skipped silently.
CASE_TIMEOUT_S = float(os.environ.get("BT_FUZZ_CASE_TIMEOUT", "60"))  # seconds silent: a suspect
CONFIRM_TIMEOUT_S = 2 * CASE_TIMEOUT_S  # seconds the suspect gets alone before it is a hang
STARTUP_TIMEOUT_S = 120.0  # seconds for a worker to import blutrain.tensor before its first case
START_TRIES = 3  # worker starts tried for one range before the run fails
# Test hook (test_tensor_fuzz.py checks the verdicts above): "KIND:INDEX[,...]", KIND one of
# hang (the case sleeps for ever), crash (aborts), slow (sleeps 3 timeouts, but not when alone),
# killed (SIGKILLs itself, but not when alone).  Read by the workers.
INJECT = os.environ.get("BT_FUZZ_INJECT", "")
# A command the workers run under (the parent does not use the device), e.g. for the GPU run:
#   BT_FUZZ_WORKER_PREFIX="compute-sanitizer --tool memcheck --error-exitcode 86"
# A sanitizer report ("=========" lines) fails the case it was printed during.
WORKER_PREFIX = os.environ.get("BT_FUZZ_WORKER_PREFIX", "").split()
# What compute-sanitizer prints in every process, errors or not (its first and last lines).
SANITIZER_BANNERS = ("========= COMPUTE-SANITIZER", "========= ERROR SUMMARY: 0 errors")
DEVICE = "cpu"  # the worker's device (set by the worker)


# ---- values the reference works on --------------------------------------------------------------
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("uint8", "int32", "int64")
DTYPES = ("bool", *INTS, *FLOATS)
NP_OF = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
}


class Invalid(Exception):
    """Raised by a reference: PyTorch (and so bt) refuses this call."""


class Skip(Exception):  # noqa: N818
    """Raised by a reference: the values are unspecified (NaN cast to an int): not compared."""


def need(cond: Any, why: str = "invalid") -> None:
    if not cond:
        raise Invalid(why)


@dataclass
class A:
    """A reference value: a numpy array (float64 for floating dtypes, int64 for integers, bool)
    and the bt dtype name it stands for."""

    a: np.ndarray
    dt: str
    # Optional per-element absolute error bound on top of the dtype's tolerance: for ops that add
    # in the result's dtype one term at a time, as PyTorch does (scatter_add, index_add: each add
    # rounds, so a large term cancelled by a later one can take a small one with it).
    err: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.a.shape)

    @property
    def ndim(self) -> int:
        return self.a.ndim


def category(dt: str) -> int:
    return 0 if dt == "bool" else (2 if dt in FLOATS else 1)


def promote(a: str, b: str) -> str:
    """PyTorch's promotion of two tensor dtypes (README, "Dtypes and promotion")."""
    if a == b:
        return a
    ca, cb = category(a), category(b)
    if ca != cb:
        return a if ca > cb else b
    if {a, b} == {"float16", "bfloat16"}:
        return "float32"
    order = DTYPES
    return a if order.index(a) > order.index(b) else b


def scalar_category(v: Any) -> int:
    return 0 if isinstance(v, bool) else (1 if isinstance(v, int) else 2)


def weak(dt: str, v: Any) -> str:
    """The dtype of `tensor op python_scalar` (rule 3: a scalar counts by its category)."""
    c = scalar_category(v)
    if c <= category(dt):
        return dt
    return "float32" if c == 2 else "int64"


def to_floating(dt: str) -> str:
    return dt if dt in FLOATS else "float32"


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 values rounded to bfloat16 (through float32, nearest even; NaN kept)."""
    f = np.asarray(x, np.float64).astype(np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(f), np.nan, out)


def round_to(x: np.ndarray, dt: str) -> np.ndarray:
    """x as stored in dtype dt (ints wrap as C casts of in-range values do)."""
    with np.errstate(all="ignore"):
        if dt == "bfloat16":
            return bf16_round(x)
        if dt in FLOATS:
            return np.asarray(x, np.float64).astype(NP_OF[dt]).astype(np.float64)
        if dt == "bool":
            return np.asarray(x).astype(bool)
        return np.asarray(x).astype(np.int64).astype(NP_OF[dt]).astype(np.int64)


def finfo_max(dt: str) -> float:
    return {
        "float16": 65504.0,
        "bfloat16": 3.3895313892515355e38,
        "float32": 3.4028234663852886e38,
    }.get(dt, 1.7976931348623157e308)


# ---- building arguments from printable expressions ----------------------------------------------
def _values(shape: tuple[int, ...], dt: str, fill: str, rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(shape)) if shape else 1
    if dt == "bool":
        return rng.random(n).reshape(shape) < 0.5
    if dt in INTS:
        lo, hi = {"uint8": (0, 256), "int32": (-(2**31), 2**31), "int64": (-(2**63), 2**63)}[dt]
        if fill == "special":
            pool = [0, 1, lo, hi - 1, lo + 1, hi - 2] + (
                [2**53 + 1, -(2**53) - 1] if dt == "int64" else []
            )
            v = rng.choice(np.array(pool, dtype=object), n)
            return np.array(list(v), dtype=np.int64 if dt != "uint8" else np.int64).reshape(shape)
        if fill == "pos":
            return rng.integers(1, 6, n).reshape(shape)
        small = rng.integers(0, 10, n) if dt == "uint8" else rng.integers(-5, 6, n)
        return small.reshape(shape)
    if fill == "special":
        pool = np.array(
            [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, 60000.0, 1e30, 0.5]
        )
        return rng.choice(pool, n).reshape(shape)
    if fill == "sprinkle":  # normal values, about one in five NaN / inf / -inf
        v = rng.standard_normal(n) * 2
        bad = rng.random(n) < 0.2
        v[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf]), int(bad.sum()))
        return v.reshape(shape)
    if fill == "pos":
        return (rng.random(n) * 3 + 0.1).reshape(shape)
    if fill == "unit":
        return (rng.random(n) * 1.8 - 0.9).reshape(shape)
    return (rng.standard_normal(n) * 2).reshape(shape)


def _layout_base(shape: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], Any]:
    """The shape to build and the view that turns it into `shape` with the given layout."""
    nd = len(shape)
    if layout == "T" and nd >= 2:
        base = (*shape[:-2], shape[-1], shape[-2])
        return base, lambda t: t.transpose(-1, -2)
    if layout == "step" and nd >= 1:
        base = (shape[0] * 2, *shape[1:])
        return base, lambda t: t[::2]
    if layout == "off" and nd >= 1:
        base = (*shape[:-1], shape[-1] + 2)
        return base, lambda t: t.narrow(-1, 1, shape[-1])
    if layout == "exp" and nd >= 1 and any(s != 1 for s in shape):
        # the first dim of size != 1 becomes an expanded one (stride 0)
        d = next(i for i, s in enumerate(shape) if s != 1)
        base = tuple(1 if i == d else s for i, s in enumerate(shape))
        return base, lambda t: t.expand(*shape)
    if layout == "perm" and nd >= 3:
        perm = list(range(nd))[::-1]
        base = tuple(shape[p] for p in perm)
        inv = [perm.index(i) for i in range(nd)]
        return base, lambda t: t.permute(*inv)
    return shape, lambda t: t


def T(
    shape: Any,
    dtype: str = "float32",
    layout: str = "c",
    fill: str = "normal",
    seed: int = 0,
    rg: int = 0,
    src: str = "own",
    dev: str | None = None,
) -> Any:
    """A tensor for a case: shape and dtype, a memory layout ("c" contiguous, "T" transposed,
    "step" every other row, "off" a narrowed view, "exp" an expanded dim, "perm" permuted), the
    values ("normal", "pos", "unit", "special": NaN/inf/extremes), where the memory comes from
    ("own", "np": a numpy array, "ro": a read-only numpy array, "dl": DLPack of numpy) and
    rg: 1 a leaf that requires grad, 2 a non-leaf that does (floating dtypes)."""
    import blutrain.tensor as bt

    shape = tuple(shape)
    rng = np.random.default_rng(seed)
    base_shape, view = _layout_base(shape, layout)
    vals = _values(base_shape, dtype, fill, rng)
    if src != "own" and dtype != "bfloat16":
        arr = np.asarray(vals).astype(NP_OF[dtype], order="C")  # (ascontiguousarray: 0-d -> 1-d)
        if src == "ro":
            arr.flags.writeable = False
        t = bt.from_dlpack(arr) if src == "dl" else bt.from_numpy(arr)
    else:
        t = bt.tensor(np.asarray(vals, dtype=np.float64 if dtype in FLOATS else None), dtype=dtype)
    dev = DEVICE if dev is None else dev
    if dev != "cpu":
        t = t.to(dev)
    rg = rg if dtype in FLOATS else 0
    if rg == 1:  # a leaf with the layout's strides
        return view(t).detach().requires_grad_(True)
    if rg == 2:  # a non-leaf (a view of leaf * 1: in-place changes of it are allowed)
        return view(t.requires_grad_(True) * 1)
    return view(t)


def I(  # noqa: E743 (short: it is written in every reproducer)
    shape: Any, hi: int, dtype: str = "int64", seed: int = 0, lo: int = 0, dev: str | None = None
) -> Any:
    """An index tensor of values in [lo, hi)."""
    import blutrain.tensor as bt

    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    v = rng.integers(lo, max(hi, lo + 1), int(np.prod(shape)) if shape else 1).reshape(shape)
    t = bt.tensor(v, dtype=dtype)
    dev = DEVICE if dev is None else dev
    return t.to(dev) if dev != "cpu" else t


def RO(values: Any, dtype: str = "float32") -> np.ndarray:
    """A read-only numpy array."""
    a = np.array(values, dtype=NP_OF[dtype])
    a.flags.writeable = False
    return a


def HUGE(dtype: str = "float32", n: int = 2**40) -> Any:
    """A huge expanded view (no memory behind it but one element)."""
    import blutrain.tensor as bt

    t = bt.ones(1, dtype=dtype)
    return (t.to(DEVICE) if DEVICE != "cpu" else t).expand(n)


def namespace() -> dict[str, Any]:
    import blutrain.tensor as bt

    return {
        "bt": bt,
        "np": np,
        "T": T,
        "I": I,
        "RO": RO,
        "HUGE": HUGE,
        "nan": float("nan"),
        "inf": float("inf"),
        "DEV": DEVICE,
    }


def to_ref(v: Any) -> Any:
    """A Tensor as an A (a copy of its values); lists and tuples element-wise; else v."""
    import blutrain.tensor as bt

    if isinstance(v, bt.Tensor):
        t = v.detach().cpu()
        dt = t.dtype.name
        if dt in FLOATS:
            a = t.to(bt.float64).numpy().copy()
        elif dt == "bool":
            a = t.numpy().copy()
        else:
            a = t.to(bt.int64).numpy().copy()
        return A(a, dt)
    if isinstance(v, list):
        return [to_ref(x) for x in v]
    if isinstance(v, tuple):
        return tuple(to_ref(x) for x in v)
    return v


# ---- the case model -----------------------------------------------------------------------------
@dataclass
class Arg:
    expr: str  # a Python expression in namespace()
    kind: str  # tensor, index, dim, dims, int, float, bool, str, shape, dtype, tensors, any
    name: str  # the parameter's name (what a message about it should say)
    ndim: int = 0  # for dims: the tensor's ndim
    info: tuple = ()  # for tensors: (shape, dtype)


@dataclass
class Call:
    """One generated call: how to call (`how`), its arguments and what to check."""

    how: str  # "fn:bt.add", "method:add_" (args[0] is self), "op:{0} + {1}", "code:<stmts>"
    args: list[Arg] = field(default_factory=list)
    kwargs: dict[str, Arg] = field(default_factory=dict)
    ref: Any = None  # numpy reference (A / python values in, A / values out, or raises Invalid)
    check: Any = None  # extra property of a returned value: check(result, ref_args) -> str|None
    strict: bool = False  # the reference decides validity for replaced arguments too
    inplace: bool = False  # the result is args[0], changed
    grad: bool = False  # compare gradients with central differences of ref (float64 cases)
    tol: float = 1.0  # a multiplier of the dtype's tolerance
    special_ok: bool = True  # values compared when an input holds NaN/inf/1e30 (else only run)
    mutation: str = ""  # what was replaced ("" for a valid call)
    bad_arg: str = ""  # the parameter replaced
    bad_text: tuple = ()  # texts of which one should appear in the message
    spec: str = ""  # the spec's name (tensor_fuzz_ops.SPECS)


class Gen:
    """Random choices for one case; all drawn from rng, so (seed, index) rebuilds the case."""

    def __init__(self, rng: random.Random, device: str) -> None:
        self.rng = rng
        self.device = device

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, seq: Any) -> Any:
        return seq[self.rng.randrange(len(seq))]

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def seed(self) -> int:
        return self.rng.randrange(1 << 30)

    def shape(self, ndim: int | None = None, max_size: int = 5, min_size: int = 0) -> tuple:
        if ndim is None:
            ndim = self.pick([0, 1, 1, 2, 2, 2, 3, 3, 4])
        sizes = []
        for _ in range(ndim):
            s = self.pick([1, 2, 3, 4, max_size]) if self.chance(0.9) else 0
            sizes.append(max(s, min_size))
        return tuple(sizes)

    def dtype(self, kind: str = "any") -> str:
        pool = {
            "any": DTYPES,
            "float": FLOATS,
            "num": (*INTS, *FLOATS),
            "int": INTS,
            "signed": ("int32", "int64", *FLOATS),
        }[kind]
        return self.pick(pool)

    def layout(self, shape: tuple) -> str:
        return "c" if self.chance(0.55) else self.pick(["T", "step", "off", "exp", "perm"])

    def tensor(
        self,
        name: str,
        shape: tuple,
        dtype: str,
        fill: str | None = None,
        rg: int | None = None,
        layout: str | None = None,
        src: str | None = None,
        dev: str | None = None,
        writable: bool = False,
    ) -> Arg:
        """writable: the target of an in-place op (no expanded dims, no read-only memory, no
        leaf that requires grad: those are bad-input cases of their own)."""
        layout = self.layout(shape) if layout is None else layout
        if writable:
            layout = "c" if layout == "exp" else layout
            src = src if src not in (None, "ro") else "own"
            rg = 0 if rg == 1 or (rg is None and self.chance(0.5)) else (2 if rg is None else rg)
        if fill is None:
            fill = "special" if self.chance(0.1) else "normal"
        if rg is None:
            rg = self.pick([0, 0, 1, 2]) if dtype in FLOATS else 0
        if src is None:
            src = "own" if self.chance(0.85) else self.pick(["np", "ro", "dl"])
        parts = [repr(tuple(shape)), repr(dtype)]
        kw = {"layout": layout, "fill": fill, "seed": self.seed(), "rg": rg, "src": src}
        defaults = {"layout": "c", "fill": "normal", "rg": 0, "src": "own"}
        parts += [f"{k}={v!r}" for k, v in kw.items() if defaults.get(k) != v]
        if dev is not None:
            parts.append(f"dev={dev!r}")
        return Arg(f"T({', '.join(parts)})", "tensor", name, len(shape), (tuple(shape), dtype))

    def index(self, name: str, shape: tuple, hi: int, dtype: str = "int64", lo: int = 0) -> Arg:
        e = f"I({tuple(shape)!r}, {hi}, {dtype!r}, seed={self.seed()}" + (
            f", lo={lo})" if lo else ")"
        )
        return Arg(e, "index", name, len(shape), (tuple(shape), dtype))

    def dim(self, name: str, ndim: int, allow_0d: bool = True) -> Arg:
        n = max(ndim, 1) if allow_0d or ndim else 1
        d = self.int(-n, n - 1)
        return Arg(repr(d), "dim", name, ndim)

    def value(self, name: str, v: Any, kind: str) -> Arg:
        return Arg(repr(v), kind, name)


# ---- mutation: one argument replaced by a bad or edge value -------------------------------------
BIG_INTS = [2**63 - 1, -(2**63), 2**63, 2**64, -(2**70), 2**31, 2**62]
JUNK = ["'a'", "None", "[1, 2]", "1.5", "True", "(1,)", "object()", "b'x'", "1j", "np.array(['s'])"]


def mutate(call: Call, g: Gen) -> Call:
    """call with one argument replaced (or one added / removed): an edge or a bad input."""
    slots = [("arg", i, a) for i, a in enumerate(call.args)] + [
        ("kw", k, a) for k, a in call.kwargs.items()
    ]
    self_slot = call.how.startswith(("method:", "op:")) and bool(call.args)
    if call.how.startswith("code:"):
        return call  # (a scenario is its own bad input)
    r = g.rng.random()
    args, kwargs = list(call.args), dict(call.kwargs)
    if call.how.startswith("op:"):  # operator syntax takes no extra or keyword arguments
        r = max(r, 0.1)
    if r < 0.06 or not slots:
        args.append(Arg(g.pick(["1", "'x'", "None", "T((2,), 'float32')"]), "any", "(extra)"))
        call = _replace(
            call,
            args,
            kwargs,
            "extra positional argument",
            "(extra)",
            ("positional", "takes", "argument"),
        )
        return call
    if r < 0.10:
        kwargs["bogus_kw"] = Arg("1", "any", "bogus_kw")
        return _replace(call, args, kwargs, "unknown keyword", "bogus_kw", ("bogus_kw",))
    where, key, arg = g.pick(slots)
    is_self = self_slot and where == "arg" and key == 0
    if is_self and call.inplace and arg.kind == "tensor" and g.chance(0.3):
        # autograd misuse: an in-place change of a leaf that requires grad must raise
        shape, _ = arg.info
        args[0] = Arg(
            f"T({tuple(shape)!r}, 'float32', rg=1, seed={g.seed()})",
            "tensor",
            arg.name,
            len(shape),
            (shape, "float32"),
        )
        c = _replace(
            call,
            args,
            kwargs,
            "in-place on a leaf that requires grad",
            arg.name,
            ("leaf", "requires grad"),
        )
        c.ref, c.strict, c.check = _always_invalid, True, None
        return c
    import tensor_fuzz_ops as ops

    new, what, texts = bad_value(
        arg,
        g,
        tensor_only=is_self,
        huge_ok=call.spec in ops.HUGE_OK,
        writable=is_self and call.inplace,
    )
    if is_self and call.inplace and what == "tensor in read-only memory":
        c = _replace(call, args[:0] + [new] + args[1:], kwargs, what, arg.name, texts)
        c.ref, c.strict, c.check = _always_invalid, True, None
        return c
    if where == "arg":
        args[key] = new
    else:
        kwargs[key] = new
    c = _replace(call, args, kwargs, what, arg.name, texts)
    if what == "tensor on another device" and not (
        tuple(arg.info[0]) == () and ops.takes_cpu_scalar(call.spec, is_self and call.inplace)
    ):
        # numpy's reference has no devices: a clean error naming the op, or (where an op moves
        # or reads across devices, e.g. copy_) the reference's values.  A 0-d CPU tensor next to
        # CUDA tensors in an elementwise op is a number (ops.CPU_SCALAR_SPECS): judged as valid.
        c.strict = False
    return c


def _always_invalid(*args: Any, **kwargs: Any) -> Any:
    raise Invalid("an in-place change of a leaf that requires grad, or of read-only memory")


def _replace(call: Call, args: list, kwargs: dict, what: str, name: str, texts: tuple) -> Call:
    c = copy.copy(call)
    c.args, c.kwargs = args, kwargs
    c.mutation, c.bad_arg, c.bad_text = what, name, (name, *texts)
    return c


def bad_value(
    arg: Arg, g: Gen, tensor_only: bool = False, huge_ok: bool = False, writable: bool = False
) -> tuple[Arg, str, tuple]:
    """A replacement for arg: (new Arg, description, texts a message about it may contain).
    tensor_only: a method's self (replaced by another tensor only)."""
    k = arg.kind
    if k in ("tensor", "index"):
        shape, dtype = arg.info
        choice = g.pick(
            ["dtype", "dtype", "shape", "shape", "zerod", "empty", "special"]
            + ([] if tensor_only else ["pyval", "junk"])
            + (["device"] if g.device != "cpu" else ["ro"])
            + (["huge"] if len(shape) == 1 and huge_ok else [])
        )
        if choice == "dtype":
            dt = g.pick([d for d in DTYPES if d != dtype])
            e = _retype(arg.expr, dtype, dt) if arg.kind == "tensor" else f"{arg.expr}.to({dt!r})"
            return Arg(e, k, arg.name, len(shape), (shape, dt)), f"tensor dtype {dt}", (dt,)
        if choice in ("shape", "zerod", "empty"):
            new = (
                ()
                if choice == "zerod"
                else (
                    g.shape(min_size=0)
                    if choice == "shape"
                    else (*shape[:-1], 0)
                    if shape
                    else (0,)
                )
            )
            t = g.tensor(
                arg.name, new, dtype if dtype in DTYPES else "float32", rg=0, writable=writable
            )
            return t, f"tensor shape {new}", (str(new), str(tuple(shape)))
        if choice == "pyval":
            v = g.pick(["0", "1", "2.5", "True", "-1", "nan"])
            return Arg(v, "any", arg.name), f"python {v}", ()
        if choice == "junk":
            v = g.pick(JUNK)
            return Arg(v, "any", arg.name), f"junk {v}", _junk_texts(v)
        if choice == "device":
            t = g.tensor(arg.name, shape, dtype if dtype in DTYPES else "float32", dev="cpu")
            return t, "tensor on another device", ("cpu", "cuda", "device")
        if choice == "ro" and writable:
            choice = "special"
        if choice == "ro":
            t = g.tensor(
                arg.name, shape, dtype if dtype in DTYPES else "float32", src="ro", rg=0, layout="c"
            )
            return t, "tensor in read-only memory", ("read-only",)
        if choice == "huge":
            return (
                Arg(
                    f"HUGE({(dtype if dtype in DTYPES else 'float32')!r})",
                    k,
                    arg.name,
                    1,
                    ((2**40,), dtype),
                ),
                "tensor huge view",
                (str(2**40),),
            )
        t = g.tensor(
            arg.name,
            shape,
            dtype if dtype in DTYPES else "float32",
            fill="special",
            writable=writable,
        )
        return t, "tensor with NaN/inf values", ()
    if k in ("dim", "int"):
        n = arg.ndim
        pool = [n, -n - 1, n + 3, *BIG_INTS] if k == "dim" else [-1, 0, -(2**63), *BIG_INTS]
        v = g.pick(pool + ["1.5", "'a'", "None", "True", "np.int64(0)"])
        texts = _junk_texts(v) if isinstance(v, str) else (str(v),)
        return Arg(v if isinstance(v, str) else repr(v), "any", arg.name), f"{k} {v}", texts
    if k == "dims":
        v = g.pick(["(0, 0)", "(9,)", f"({2**63},)", "('a',)", "[0, -1]", "'a'", "1.5"])
        return Arg(v, "any", arg.name), f"dims {v}", _junk_texts(v)
    if k == "float":
        v = g.pick(["nan", "inf", "-inf", "-1.0", "1e308", "'a'", "None", "1j", "2**1024"])
        return Arg(v, "any", arg.name), f"float {v}", _junk_texts(v)
    if k == "bool":
        v = g.pick(["2", "'a'", "None", "1.0", "[]"])
        return Arg(v, "any", arg.name), f"bool {v}", _junk_texts(v)
    if k == "str":
        v = g.pick(["'bogus'", "''", "1", "None"])
        return Arg(v, "any", arg.name), f"str {v}", _junk_texts(v)
    if k == "shape":
        v = g.pick(
            [
                "(-1,)",
                f"({2**62}, {2**62})",
                f"({2**63},)",
                "('a',)",
                "1.5",
                "None",
                "((2,),)",
                "(2, -3)",
                f"({2**31}, {2**31})",
            ]
        )
        return Arg(v, "any", arg.name), f"shape {v}", _junk_texts(v)
    if k == "dtype":
        v = g.pick(["'float128'", "'bogus'", "5", "np.complex64", "object", "'int'"])
        return Arg(v, "any", arg.name), f"dtype {v}", _junk_texts(v)
    if k == "tensors":
        v = g.pick(
            [
                "[]",
                "[1, 2]",
                "[None]",
                "[T((2,), 'float32'), T((3,), 'int64')]",
                "[T((2, 2), 'float32'), T((2,), 'float32')]",
                "'ab'",
                "5",
            ]
        )
        return Arg(v, "any", arg.name), f"tensors {v}", _junk_texts(v)
    if k == "rnum":  # the left operand of a reflected operator: no str or bytes (their %)
        v = g.pick(["None", "[1, 2]", "object()", "1j", "(1,)"])
        return Arg(v, "any", arg.name), f"junk {v}", _junk_texts(v)
    v = g.pick(JUNK)
    return Arg(v, "any", arg.name), f"value {v}", _junk_texts(v)


def _retype(expr: str, old: str, new: str) -> str:
    """A T(...) expression with another dtype (the shape tuple before it holds no strings)."""
    return expr.replace(repr(old), repr(new), 1)


def _junk_texts(v: str) -> tuple:
    """Texts of a replacement value that a message may quote: its repr and its type name."""
    try:
        obj = eval(v, namespace())  # noqa: S307 (our own expression)
    except Exception:  # noqa: BLE001
        return (v,)
    texts = {v, type(obj).__name__, repr(obj)[:40]}
    if isinstance(obj, int) and not isinstance(obj, bool):
        texts.add(str(obj))
    return tuple(texts)


# ---- running one case ---------------------------------------------------------------------------
def render(call: Call) -> str:
    """The call as a Python statement (the reproducer's last line)."""
    if call.how.startswith("code:"):
        return call.how[5:]
    args = [a.expr for a in call.args]
    kw = [f"{k}={a.expr}" for k, a in call.kwargs.items()]
    if call.how.startswith("fn:"):
        return f"{call.how[3:]}({', '.join(args + kw)})"
    if call.how.startswith("method:"):
        return f"{args[0]}.{call.how[7:]}({', '.join(args[1:] + kw)})"
    if call.how.startswith("op:"):
        return call.how[3:].format(*args)
    raise ValueError(call.how)


def reproducer(seed: int, index: int, device: str) -> str:
    dev = f" --device {device}" if device != "cpu" else ""
    return f"python packages/blutrain-tensor/tests/tensor_fuzz.py case {seed} {index}{dev}"


def make_case(seed: int, index: int, device: str) -> Call:
    import tensor_fuzz_ops as ops

    rng = random.Random(f"{seed}:{index}:{device}")
    g = Gen(rng, device)
    name = g.pick(ops.SPEC_NAMES)
    spec = ops.SPECS[name]
    call = spec.gen(g, name)
    call.spec = name
    if spec.mutate and g.chance(0.6):
        call = mutate(call, g)
    return call


def _outcome(call: Call, ns: dict) -> dict:
    """Runs call; the checked outcome: {"status": "ok" | one of the failure kinds, ...}."""
    import tensor_fuzz_ops as ops

    import blutrain.tensor as bt

    code = render(call)
    if call.how.startswith("code:"):
        try:
            exec(code, ns)  # noqa: S102 (our own generated code)
        except EXPECTED as e:
            return check_error(call, e)
        except Exception as e:  # noqa: BLE001
            return {"status": "unexpected-exception", "detail": f"{type(e).__name__}: {e}"[:500]}
        return {"status": "ok", "kind": "returned"}
    try:
        args = [eval(a.expr, ns) for a in call.args]  # noqa: S307
        kwargs = {k: eval(a.expr, ns) for k, a in call.kwargs.items()}  # noqa: S307
    except EXPECTED as e:  # building the input itself refused (e.g. a shape)
        return check_error(call, e, building=True)
    huge = any(_is_huge(v) for v in [*args, *kwargs.values()])
    ref_in = [None if _is_huge(a) else to_ref(a) for a in args]
    ref_kw = {k: None if _is_huge(v) else to_ref(v) for k, v in kwargs.items()}
    want, ref_err = None, None
    if huge:  # (a 2**40-element view: no reference; it must run without copying the view)
        call.ref, call.check = None, None
    if not call.special_ok and any(
        "fill='special'" in a.expr for a in [*call.args, *call.kwargs.values()]
    ):
        call.ref, call.check = None, None  # (products of 1e30s overflow where float64 does not)
    if call.ref is not None:
        try:
            with np.errstate(all="ignore"):
                want = call.ref(*ref_in, **ref_kw)
        except Skip:
            call.ref, call.check = None, None
        except Invalid as e:
            ref_err = str(e) or "invalid"
        except Exception as e:  # noqa: BLE001 (a reference that cannot take the replaced input)
            ref_err = f"reference raised {type(e).__name__}: {e}"
            if not call.mutation:
                return {"status": "reference-error", "detail": ref_err[:500]}
            call.strict = False  # (it says nothing about the replaced input's validity)
    judge = (not call.mutation) or call.strict
    try:
        ns["_args"], ns["_kwargs"] = args, kwargs
        result = _invoke(call, args, kwargs)
    except EXPECTED as e:
        out = check_error(call, e)
        if out["status"] != "ok":
            return out
        if call.ref is not None and ref_err is None and judge and not _allocation_failure(e):
            return {"status": "rejected-valid", "detail": f"{type(e).__name__}: {e}"[:500]}
        return out
    except Exception as e:  # noqa: BLE001
        return {"status": "unexpected-exception", "detail": f"{type(e).__name__}: {e}"[:500]}
    try:
        _read_all(result)
        if (
            huge
            or _is_huge(result)
            or (isinstance(result, list | tuple) and any(_is_huge(r) for r in result))
        ):
            return {"status": "ok", "kind": "returned"}  # (a valid huge view: not copied to check)
        got = to_ref(args[0] if call.inplace else result)
    except EXPECTED as e:  # an error found on the device, raised at the synchronisation
        out = check_error(call, e)
        if out["status"] == "ok" and call.ref is not None and ref_err is None and judge:
            return {"status": "rejected-valid", "detail": f"{type(e).__name__}: {e}"[:500]}
        return out if out["status"] != "ok" else {**out, "kind": out["kind"] + " (on the device)"}
    if call.ref is None:
        if call.check is not None:
            msg = call.check(result, ref_in)
            if msg:
                return {"status": "wrong-value", "detail": msg[:800]}
        return {"status": "ok", "kind": "returned"}
    if ref_err is not None:
        if judge:
            return {"status": "accepted-invalid", "detail": ref_err[:500]}
        return {"status": "ok", "kind": "returned (reference refuses)"}
    msg = compare(got, want, call.tol, bt)
    if msg:
        return {"status": "wrong-value", "detail": msg[:800]}
    if call.check is not None:
        msg = call.check(result, ref_in)
        if msg:
            return {"status": "wrong-value", "detail": msg[:800]}
    if call.grad and not call.mutation:
        msg = ops.check_gradients(call, args, kwargs, result, ref_in, ref_kw)
        if msg:
            return {"status": "wrong-gradient", "detail": msg[:800]}
    return {"status": "ok", "kind": "checked"}


def _invoke(call: Call, args: list, kwargs: dict) -> Any:
    import blutrain.tensor as bt

    if call.how.startswith("fn:"):
        fn: Any = bt
        for part in call.how[3:].split(".")[1:]:
            fn = getattr(fn, part)
        return fn(*args, **kwargs)
    if call.how.startswith("method:"):
        return getattr(args[0], call.how[7:])(*args[1:], **kwargs)
    if call.how.startswith("op:"):
        ns = {f"_a{i}": a for i, a in enumerate(args)}
        ns.update(operator=__import__("operator"), np=np, bt=bt)
        expr = call.how[3:].format(*[f"_a{i}" for i in range(len(args))])
        if "=" in expr.replace("==", "").replace("<=", "").replace(">=", "").replace("!=", ""):
            exec(expr, ns)  # noqa: S102 (t[i] = v, t += x)
            return ns["_a0"]
        return eval(expr, ns)  # noqa: S307
    raise ValueError(call.how)


def _is_huge(v: Any) -> bool:
    import blutrain.tensor as bt

    return isinstance(v, bt.Tensor) and (v.numel() > 1 << 24 or any(d > 1 << 40 for d in v.shape))


def _read_all(v: Any) -> None:
    """Reads every element of the result (a lazy error must surface here, not later)."""
    import blutrain.tensor as bt

    if isinstance(v, bt.Tensor):
        if not v.is_symbolic and not _is_huge(v):
            v.detach().cpu().to(bt.float64).numpy()
        repr(v)
    elif isinstance(v, list | tuple):
        for x in v:
            _read_all(x)


def _allocation_failure(e: BaseException) -> bool:
    return "cannot allocate" in str(e) or "out of memory" in str(e)


# Mutations that put a Python value where another belongs: the message should quote it (or name
# the argument).  A tensor of another shape or dtype may fail for a reason the message names
# otherwise.
VALUE_MUTATIONS = {
    "junk",
    "dim",
    "int",
    "dims",
    "float",
    "bool",
    "str",
    "shape",
    "dtype",
    "tensors",
    "value",
    "extra",
    "unknown",
    "python",
}


def check_error(call: Call, e: BaseException, building: bool = False) -> dict:
    import tensor_fuzz_ops as ops

    msg = str(e)
    if not isinstance(e, EXPECTED):
        return {"status": "unexpected-exception", "detail": f"{type(e).__name__}: {msg}"[:500]}
    if "std::" in msg or "incompatible function arguments" in msg:
        return {"status": "generic-message", "detail": f"{type(e).__name__}: {msg}"[:500]}
    names = ops.names_for(call)
    if building:
        names = names | {
            "tensor",
            "ones",
            "zeros",
            "to",
            "from_numpy",
            "from_dlpack",
            "expand",
            "full",
        }
    if not any(msg.startswith(f"[{n}]") for n in names):
        return {
            "status": "wrong-op-in-message",
            "detail": f"expected one of {sorted(names)}: {type(e).__name__}: {msg}"[:500],
        }
    if (
        call.mutation
        and call.bad_text
        and not building
        and call.mutation.split()[0] in VALUE_MUTATIONS
    ):
        if not any(t and str(t) in msg for t in call.bad_text) and not ops.names_anything(msg):
            return {
                "status": "message-names-nothing",
                "detail": f"{call.mutation}: {type(e).__name__}: {msg}"[:500],
            }
    return {"status": "ok", "kind": f"raised {type(e).__name__}"}


def compare(got: Any, want: Any, tol: float, bt: Any) -> str | None:
    """None when got (from the op) matches want (the reference), else what differs."""
    if isinstance(want, tuple | list):
        if not isinstance(got, tuple | list) or len(got) != len(want):
            return f"expected a sequence of {len(want)}, got {type(got).__name__}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            m = compare(a, b, tol, bt)
            if m:
                return f"[{i}] {m}"
        return None
    if isinstance(want, A):
        if not isinstance(got, A):
            return f"expected a tensor, got {got!r:.80}"
        if got.dt != want.dt:
            return f"dtype {got.dt}, expected {want.dt}"
        if got.shape != tuple(want.shape):
            return f"shape {got.shape}, expected {tuple(want.shape)}"
        return compare_values(got.a, round_to(want.a, want.dt), want.dt, tol, want.err)
    if isinstance(want, float):
        if not isinstance(got, float | int):
            return f"expected {want!r}, got {got!r:.80}"
        return compare_values(np.array([got], float), np.array([want]), "float64", tol)
    if got != want or type(got) is not type(want):
        return (
            f"expected {want!r:.80} ({type(want).__name__}), got {got!r:.80} ({type(got).__name__})"
        )
    return None


TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-10}
# Unit roundoff of each float dtype (half an ulp of 1).
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def summed_in_dtype(out: np.ndarray, mag: np.ndarray, terms: np.ndarray, dt: str) -> A:
    """The reference of a sum taken in dtype dt one term at a time (any order): out holds the exact
    (float64) sums, mag the sums of the terms' magnitudes, terms how many terms each element got.
    Each add rounds once, so the error is at most terms * u * mag (Higham's bound for recursive
    summation, u the unit roundoff); integers are exact (wrapping as C does)."""
    if dt not in FLOATS:
        return A(out, dt)
    with np.errstate(all="ignore"):
        return A(out, dt, err=terms * UNIT_ROUNDOFF[dt] * mag)


def compare_values(
    got: np.ndarray, want: np.ndarray, dt: str, tol: float, err: np.ndarray | None = None
) -> str | None:
    if dt not in FLOATS:
        bad = got != want
    else:
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        rt = TOL[dt] * tol
        with np.errstate(all="ignore"):
            close = np.abs(g - w) <= rt * np.abs(w) + rt * tol + (0 if err is None else err)
            same_special = (np.isnan(g) & np.isnan(w)) | ((g == w) & np.isinf(w))
            # a value at the edge of the dtype's range may round to inf on one side only
            edge = (
                (np.isinf(g) | np.isinf(w))
                & (np.minimum(np.abs(g), np.abs(w)) > finfo_max(dt) / (1 + 4 * rt))
                & (np.sign(g) == np.sign(w))
            )
        bad = ~(close | same_special | edge)
    if not np.any(bad):
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0]) if np.ndim(bad) else ()
    return (
        f"{int(np.sum(bad))} of {np.size(bad)} values differ; at {idx}: got "
        f"{np.asarray(got)[idx]!r}, expected {np.asarray(want)[idx]!r}"
    )


def run_case(seed: int, index: int, device: str) -> dict:
    global DEVICE
    DEVICE = device
    import blutrain.tensor as bt

    call = make_case(seed, index, device)
    ns = namespace()
    bt.manual_seed(case_seed(seed, index))  # random ops: the same values alone as in a batch
    try:
        with bt.enable_grad():
            out = _outcome(call, ns)
        if device != "cpu":  # an error the device found late belongs to this case
            try:
                bt.cuda.synchronize()
            except EXPECTED as e:
                out = {"status": "late-device-error", "detail": f"{type(e).__name__}: {e}"[:500]}
    except BaseException as e:  # noqa: BLE001 (a check that itself failed is a suite bug)
        out = {"status": "suite-error", "detail": "".join(traceback.format_exception(e))[-1500:]}
    finally:
        reset_globals()
        # A case's hook closes over ns (its globals) while the tensor's C++ hook list holds the
        # hook: a cycle Python's collector cannot see (README, "hooks and cycles"). Break it.
        ns.clear()
    out.update(index=index, spec=call.spec, mutation=call.mutation, code=render(call))
    return out


def case_seed(seed: int, index: int) -> int:
    """The generator's seed for case index (what `case SEED INDEX` uses too)."""
    return random.Random(f"generator:{seed}:{index}").getrandbits(63)


def _injected(index: int) -> None:
    """The BT_FUZZ_INJECT test hook (Note [hang and crash verdicts])."""
    alone = os.environ.get("BT_FUZZ_ALONE") == "1"
    for item in filter(None, INJECT.split(",")):
        kind, at = item.split(":")
        if int(at) != index:
            continue
        if kind == "hang":
            time.sleep(1e6)
        elif kind == "crash":
            os.abort()
        elif kind == "slow" and not alone:
            time.sleep(3 * CASE_TIMEOUT_S)
        elif kind == "killed" and not alone:
            os.kill(os.getpid(), 9)


def reset_globals() -> None:
    """Undoes what a case may have changed process-wide (the specs of manual_seed and co)."""
    import blutrain.tensor as bt

    bt.set_grad_enabled(True)
    bt.set_float32_matmul_precision("highest")
    bt.set_float32_attention_precision("matmul")
    bt.use_deterministic_algorithms(False)
    bt.set_cast_cache_enabled(True)
    if bt._C._capturing():
        bt._C._set_capture(None)


# ---- worker and parent --------------------------------------------------------------------------
def worker(seed: int, start: int, count: int, device: str) -> None:
    """Runs cases [start, start + count): "CASE i" before each, a JSON result line after."""
    if device == "cpu":
        import resource

        # bytes of address space (a worker peaks near 0.4 GiB): a huge allocation fails at once
        # as an error, instead of swapping or filling 2**31 elements past the hang timeout
        limit = 2 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path.insert(0, str(HERE))
    import blutrain.tensor as bt

    out = sys.stdout
    for i in range(start, start + count):
        out.write(f"CASE {i}\n")
        out.flush()
        bt.set_grad_enabled(True)
        t0 = time.perf_counter()
        if INJECT:
            _injected(i)
        r = run_case(seed, i, device)
        r["seconds"] = round(time.perf_counter() - t0, 4)
        out.write("RESULT " + json.dumps(r) + "\n")
        out.flush()
    out.write("DONE\n")
    out.flush()


@dataclass
class Report:
    seed: int
    device: str
    ran: int = 0
    kinds: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    crashes: int = 0
    hangs: int = 0
    seconds: float = 0.0
    cases: int = 0  # asked for
    notes: list = field(default_factory=list)  # suspects cleared alone (Note [hang and ...])
    slowest: tuple = (0.0, -1)  # (seconds, index) of the slowest case a worker timed
    deadline: float = float("inf")  # time.time() past which no case starts (run's budget_s)

    def summary(self) -> str:
        k = ", ".join(f"{n} {c}" for n, c in sorted(self.kinds.items()))
        lines = [
            f"fuzz seed {self.seed} on {self.device}: {self.ran} of {self.cases} cases in "
            f"{self.seconds:.0f} s ({k}); {len(self.failures)} failed ({self.crashes} crashed, "
            f"{self.hangs} hung); slowest case {self.slowest[1]} ({self.slowest[0]:.2f} s)",
            *self.notes,
        ]
        if self.failures or self.ran != self.cases:
            lines.append(f"repeat this run: {run_reproducer(self.seed, self.cases, self.device)}")
        return "\n".join(lines)


def run_reproducer(seed: int, cases: int, device: str) -> str:
    test = "test_fuzz_cpu" if device == "cpu" else "test_fuzz_cuda"
    return (
        f"BT_FUZZ_SEED={seed} BT_FUZZ_CASES={cases} python -m pytest "
        f"packages/blutrain-tensor/tests/test_tensor_fuzz.py::{test}"
    )


def run(
    seed: int,
    cases: int,
    device: str,
    workers: int = 2,
    chunk: int = 400,
    budget_s: float | None = None,
) -> Report:
    """Runs cases [0, cases) in `workers` parallel worker processes of `chunk` cases each.  Past
    budget_s seconds the cases not yet run fail as out of time, so the report (its seed and
    reproducers) still comes back before an outer timeout (pytest-timeout) ends the process."""
    rep = Report(seed, device, cases=cases)
    t0 = time.time()
    rep.deadline = t0 + budget_s if budget_s is not None else float("inf")
    lock = threading.Lock()
    todo: queue.Queue = queue.Queue()
    for s in range(0, cases, chunk):
        todo.put((s, min(chunk, cases - s)))

    def drive() -> None:
        while True:
            try:
                start, count = todo.get_nowait()
            except queue.Empty:
                return
            if time.time() > rep.deadline:
                _out_of_time(rep, lock, seed, device, start, start + count)
                continue
            _drive_range(seed, start, count, device, rep, lock)

    threads = [threading.Thread(target=drive) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep.seconds = time.time() - t0
    return rep


class _Worker:
    """One worker process over cases [start, end) and the lines it prints."""

    def __init__(self, seed: int, start: int, end: int, device: str, alone: bool = False) -> None:
        env = dict(os.environ, BT_FUZZ_ALONE="1" if alone else "0")
        self.p = subprocess.Popen(
            [
                *WORKER_PREFIX,
                sys.executable,
                str(HERE / "tensor_fuzz.py"),
                "worker",
                str(seed),
                str(start),
                str(end - start),
                device,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(HERE),
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        self.errs: list[str] = []
        threading.Thread(target=_pump, args=(self.p.stdout, self.lines), daemon=True).start()
        pump_err = threading.Thread(target=lambda: self.errs.extend(self.p.stderr), daemon=True)
        pump_err.start()

    def next(self, timeout: float) -> str | None:
        """The next line; None when the worker ended; "" when it stayed silent for timeout s."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return ""

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()

    def stderr(self) -> str:
        time.sleep(0.05)  # (the pump thread's last lines)
        return "".join(self.errs)[-1500:]


def _out_of_time(
    rep: Report, lock: threading.Lock, seed: int, device: str, start: int, end: int
) -> None:
    with lock:
        rep.failures.append(
            {
                "status": "out-of-time",
                "index": start,
                "spec": "-",
                "code": f"cases [{start}, {end}) not run",
                "detail": "the run's time budget ran out (slowest case "
                f"{rep.slowest[1]}: {rep.slowest[0]:.2f} s)",
                "repro": run_reproducer(seed, rep.cases, device),
            }
        )


def _charge(rep: Report, lock: threading.Lock, f: dict) -> None:
    with lock:
        rep.ran += 1
        rep.crashes += f["status"] == "crash"
        rep.hangs += f["status"] == "hang"
        rep.failures.append(f)


def _record(rep: Report, lock: threading.Lock, r: dict, seed: int, device: str) -> None:
    with lock:
        rep.ran += 1
        key = r.get("kind", r["status"]).split(" (")[0]
        rep.kinds[key] = rep.kinds.get(key, 0) + 1
        if r.get("seconds", 0.0) > rep.slowest[0]:
            rep.slowest = (r["seconds"], r["index"])
        if r["status"] != "ok":
            rep.failures.append({**r, "repro": reproducer(seed, r["index"], device)})


def _alone(seed: int, index: int, device: str) -> tuple[str, Any]:
    """Reruns one case in a fresh worker: ("result", its RESULT), ("hang", None), ("crash", rc
    and stderr) or ("start", why the worker did not start)."""
    why = ""
    for _ in range(START_TRIES):
        w = _Worker(seed, index, index + 1, device, alone=True)
        line = w.next(STARTUP_TIMEOUT_S)
        while line and not line.startswith("CASE "):  # (a sanitizer's banner)
            line = w.next(STARTUP_TIMEOUT_S)
        if line:
            break
        if line == "":
            w.kill()
        why = f"exit code {w.p.wait()}; stderr: {w.stderr()}"
    else:
        return "start", why
    while True:
        line = w.next(CONFIRM_TIMEOUT_S)
        if line == "":
            w.kill()
            return "hang", None
        if line is None:
            return "crash", f"exit code {w.p.wait()}; stderr: {w.stderr()}"
        if line.startswith("RESULT "):
            w.kill()  # (its DONE and exit do not matter here)
            return "result", json.loads(line[7:])


def _suspect(
    seed: int, index: int, device: str, rep: Report, lock: threading.Lock, what: str, rc: Any
) -> None:
    """Settles a case whose worker went silent (what == "hang") or died (what == "crash", rc its
    exit code and stderr) by rerunning it alone (Note [hang and crash verdicts])."""
    if time.time() + STARTUP_TIMEOUT_S / 10 + CONFIRM_TIMEOUT_S > rep.deadline:
        why = "in its worker; no time left in the run's budget to rerun it alone"
        _charge(rep, lock, _failure(seed, index, device, what, f"{what} {rc or ''} {why}"))
        return
    verdict, alone = _alone(seed, index, device)
    if what == "hang":
        first = f"no progress for {CASE_TIMEOUT_S:g} s in its worker"
    else:
        first = f"crashed in its worker ({rc})"
    if verdict == "result" and (what == "hang" or rc.startswith("exit code -9;")):
        with lock:
            rep.notes.append(
                f"case {index}: {first}, then alone in {alone.get('seconds', 0):.2f} s "
                f"(status {alone['status']}): {'starved' if what == 'hang' else 'killed'} "
                "by the machine, not the case"
            )
        _record(rep, lock, alone, seed, device)
        return
    if verdict == "hang":
        detail = f"{first}, and for {CONFIRM_TIMEOUT_S:g} s alone"
        status = "hang"
    elif verdict == "crash":
        detail = f"{first}; alone too: {alone}"
        status = "crash"
    elif verdict == "start":
        detail = f"{first}; the worker to rerun it alone did not start: {alone}"
        status = what
    else:  # a crash that needs the cases before it (or a hang then a crash alone)
        detail = (
            f"{first}; alone it did not (status {alone['status']}): an earlier case in the same "
            "worker may have corrupted memory"
        )
        status = what
    _charge(rep, lock, _failure(seed, index, device, status, detail[:2000]))


def _drive_range(
    seed: int, start: int, count: int, device: str, rep: Report, lock: threading.Lock
) -> None:
    end = start + count
    tries = 0
    while start < end:
        w = _Worker(seed, start, end, device)
        current = None
        last = start - 1
        started = False
        while True:
            wait = CASE_TIMEOUT_S if started else STARTUP_TIMEOUT_S
            line = w.next(min(wait, max(0.1, rep.deadline - time.time())))
            if time.time() > rep.deadline:
                w.kill()
                _out_of_time(rep, lock, seed, device, last + 1, end)
                start = end
                break
            if line == "" and not started:  # (import starved for minutes: try again)
                w.kill()
                line = None
            if line == "":  # silent inside a case (or between two): a suspect
                w.kill()
                at = current if current is not None else last + 1
                _suspect(seed, at, device, rep, lock, "hang", None)
                start = at + 1
                break
            if line is None:  # the worker ended
                rc = w.p.wait()
                if not started:  # before its first case: retried, then a failure of the run
                    tries += 1
                    if tries < START_TRIES:
                        break
                    with lock:
                        rep.failures.append(
                            {
                                "status": "worker-start",
                                "index": start,
                                "spec": "-",
                                "code": f"a worker for cases [{start}, {end})",
                                "detail": f"did not start {START_TRIES} times; exit code {rc}; "
                                f"stderr: {w.stderr()}",
                                "repro": run_reproducer(seed, rep.cases, device),
                            }
                        )
                    start = end
                    break
                # (died between two cases, without DONE: charged to the next one)
                at = current if current is not None else last + 1
                if at < end:
                    why = f"exit code {rc}; stderr: {w.stderr()}"
                    _suspect(seed, at, device, rep, lock, "crash", why)
                    start = at + 1
                else:
                    start = end
                break
            if line.startswith("========="):  # a sanitizer's report: fails the case it ran in
                if line.strip() == "=========" or line.startswith(SANITIZER_BANNERS):
                    continue
                with lock:
                    at = current if current is not None else last
                    rep.failures.append(_failure(seed, at, device, "sanitizer", line.strip()))
                continue
            if line.startswith("CASE "):
                started = True
                tries = 0
                current = int(line.split()[1])
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                _record(rep, lock, r, seed, device)
                last = r["index"]
                current = None
            elif line.startswith("DONE"):
                rc = w.p.wait()
                if rc != 0:  # (a sanitizer's --error-exitcode: its report is already charged)
                    with lock:
                        rep.failures.append(
                            _failure(seed, last, device, "worker-exit", f"exit code {rc}")
                        )
                start = end
                break


def _pump(stream: Any, lines: queue.Queue) -> None:
    for x in stream:
        lines.put(x)
    lines.put(None)


def _failure(seed: int, index: int, device: str, status: str, detail: str) -> dict:
    call = make_case(seed, index, device)
    return {
        "status": status,
        "index": index,
        "spec": call.spec,
        "mutation": call.mutation,
        "code": render(call),
        "detail": detail,
        "repro": reproducer(seed, index, device),
    }


def format_failure(f: dict) -> str:
    return (
        f"{f['status']}: {f['spec']}{' (' + f['mutation'] + ')' if f.get('mutation') else ''}\n"
        f"    {f['code']}\n    {f['detail']}\n    reproduce: {f['repro']}"
    )


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(HERE))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("seed", type=int)
    w.add_argument("start", type=int)
    w.add_argument("count", type=int)
    w.add_argument("device")
    c = sub.add_parser("case", help="print and run one case in this process")
    c.add_argument("seed", type=int)
    c.add_argument("index", type=int)
    c.add_argument("--device", default="cpu")
    r = sub.add_parser("run")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--cases", type=int, default=int(os.environ.get("BT_FUZZ_CASES", "3000")))
    r.add_argument("--device", default="cpu")
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--chunk", type=int, default=400, help="cases per worker process")
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        worker(a.seed, a.start, a.count, a.device)
        return 0
    if a.cmd == "case":
        call = make_case(a.seed, a.index, a.device)
        print(f"# {call.spec}{' (' + call.mutation + ')' if call.mutation else ''}")
        print("import blutrain.tensor as bt, numpy as np")
        print(
            f"from tensor_fuzz import T, I, RO, HUGE  # tests/tensor_fuzz.py (DEVICE={a.device!r})"
        )
        print(f"bt.manual_seed({case_seed(a.seed, a.index)})")
        print(render(call))
        print(json.dumps(run_case(a.seed, a.index, a.device), indent=1))
        return 0
    seed = a.seed if a.seed is not None else random.randrange(1 << 31)
    print(f"fuzz: seed {seed}, {a.cases} cases on {a.device}", flush=True)
    rep = run(seed, a.cases, a.device, a.workers, a.chunk)
    for f in rep.failures:
        print(format_failure(f))
    print(rep.summary())
    return 1 if rep.failures else 0


if __name__ == "__main__":
    # Through the module, not __main__: tensor_fuzz_ops imports tensor_fuzz, and its classes (A,
    # Call) must be the ones the engine checks against.
    sys.path.insert(0, str(HERE))
    import tensor_fuzz

    sys.exit(tensor_fuzz.main(sys.argv[1:]))
