"""Random calls of the public API, most of them wrong (bad shapes, dtypes, dims, argument types,
0-d and empty tensors, strided and expanded views), run by test_tensor_fuzz.py in a child process.

Each call is written to LAST_CALL before it runs, so a crash names it.  A call may succeed or raise
one of the usual exception types with a message that names the op ("[op] ...") or Python's own
argument errors; anything else (an AttributeError, "std::bad_cast", a message naming nothing) is
printed as UNEXPECTED.  Usage: python tensor_fuzz.py SEED CALLS LAST_CALL
"""

from __future__ import annotations

import sys

import numpy as np

import blutrain.tensor as bt

SHAPES = [(), (0,), (3,), (1, 3), (2, 3), (3, 2), (2, 3, 4), (2, 1, 3), (5, 0), (2, 2, 3, 4)]
DTYPES = [bt.float32, bt.float64, bt.bfloat16, bt.float16, bt.int64, bt.int32, bt.bool, bt.uint8]
FUNCTIONS = """abs add add_layer_norm allclose amax amin argmax argmin bmm cat chunk clamp
clip_grad_norm_ clone cos cross_entropy div dropout embedding eq erf exp flatten floor_divide full
gather ge gelu gt index_add index_select layer_norm le linear linear_cross_entropy linear_gelu
linear_gelu_linear log log_softmax logical_not lt masked_fill matmul max maximum mean min minimum
mul narrow ne neg ones permute pow randint randn relu remainder reshape rsqrt
scaled_dot_product_attention scatter_add sigmoid sign sin softmax split sqrt squeeze stack sub sum
tanh tensor transpose unsqueeze var where zeros""".split()
METHODS = """__getitem__ __setitem__ size stride view expand item tolist __len__ __bool__ __float__
__int__ __index__ contiguous float to fill_ zero_ add_ mul_ div_ copy_ masked_fill_ narrow select
__matmul__ __pow__ __truediv__ __floordiv__ __mod__ __rmod__ __lt__ __invert__ backward sum mean
amax argmax max softmax split chunk gather scatter_add index_add_ index_select permute transpose
reshape flatten squeeze unsqueeze detach retain_grad requires_grad_ exp_ neg_""".split()
EXPECTED = (
    TypeError,
    ValueError,
    IndexError,
    RuntimeError,
    NotImplementedError,
    OverflowError,
    ZeroDivisionError,
)
# Python's and nanobind's own messages for a wrong call signature name the function already
PY_ARG_ERRORS = (
    "incompatible function arguments",
    "positional argument",
    "keyword argument",
    "argument after",
    "takes",
    "missing",
    "object is not iterable",
    "unhashable",
    "not supported between",
    "unsupported operand",
    "object cannot be interpreted as an integer",
    "must be real number",
    "object is not callable",
)


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def tensor(self) -> bt.Tensor:
        shape, dtype = self.pick(SHAPES), self.pick(DTYPES)
        a = self.rng.standard_normal(shape) * 3
        if dtype == bt.bool:
            a = a > 0
        elif dtype in (bt.int64, bt.int32, bt.uint8):
            a = np.abs(a).astype(np.int64)
        t = bt.tensor(a, dtype=dtype)
        layout = int(self.rng.integers(4))
        if layout == 1 and t.ndim >= 2:
            t = t.transpose(0, -1)
        elif layout == 2 and t.ndim >= 1 and t.shape[0] == 1:
            t = t.expand(3, *t.shape[1:])
        if dtype in (bt.float32, bt.float64, bt.bfloat16) and self.rng.integers(2):
            t.requires_grad_(True)  # (a view: not a leaf, so in-place ops record too)
        return t

    def arg(self):
        kind = int(self.rng.integers(12))
        if kind < 6:
            return self.tensor()
        return [
            lambda: int(self.rng.integers(-5, 6)),
            lambda: float(self.rng.standard_normal()),
            lambda: tuple(int(v) for v in self.rng.integers(-3, 5, size=self.rng.integers(0, 4))),
            lambda: [self.tensor() for _ in range(self.rng.integers(0, 3))],
            lambda: None,
            lambda: self.pick(["a", True, 2**70, float("nan"), slice(1, 2), Ellipsis]),
        ][kind - 6]()

    def index(self):
        kind = int(self.rng.integers(6))
        if kind == 0:
            return int(self.rng.integers(-6, 6))
        if kind == 1:
            step = int(self.rng.integers(-1, 3)) or None
            return slice(int(self.rng.integers(-4, 4)), int(self.rng.integers(-4, 5)), step)
        if kind == 2:
            return tuple(self.index() for _ in range(self.rng.integers(0, 4)))
        if kind == 3:
            return self.tensor()
        if kind == 4:
            return [int(v) for v in self.rng.integers(-4, 4, size=self.rng.integers(0, 3))]
        return self.pick([None, Ellipsis, True, 1.5])

    def call(self):
        """(description, thunk) of one random call."""
        if self.rng.integers(3) == 0:
            x, name = self.tensor(), self.pick(METHODS)
            n = int(self.rng.integers(0, 3))
            args = [self.index() if "item__" in name else self.arg() for _ in range(n)]
            desc = f"Tensor{tuple(x.shape)}:{x.dtype}.{name}{_describe(args)}"
            return desc, lambda: getattr(x, name)(*args)
        name = self.pick(FUNCTIONS)
        args = [self.arg() for _ in range(self.rng.integers(1, 5))]
        return f"bt.{name}{_describe(args)}", lambda: getattr(bt, name)(*args)

    def use(self, result) -> None:
        """Reads a result back and sometimes runs its backward: lazy paths run too."""
        for t in result if isinstance(result, list | tuple) else [result]:
            if isinstance(t, bt.Tensor):
                t.detach().to(bt.float64).numpy()
                if t.requires_grad and self.rng.integers(2):
                    t.to(bt.float64).sum().backward()


def _describe(args) -> str:
    def one(a):
        if isinstance(a, bt.Tensor):
            return f"Tensor{tuple(a.shape)}:{a.dtype}"
        if isinstance(a, list):
            return "[" + ", ".join(one(v) for v in a) + "]"
        if isinstance(a, tuple):
            return "(" + ", ".join(one(v) for v in a) + ",)"
        return repr(a)

    return "(" + ", ".join(one(a) for a in args) + ")"


def unexpected(e: BaseException) -> bool:
    msg = str(e)
    if not isinstance(e, EXPECTED) or "std::" in msg:
        return True
    return not (msg.startswith("[") or any(s in msg for s in PY_ARG_ERRORS))


def main(seed: int, calls: int, last_call: str) -> int:
    fuzz, seen = Fuzzer(seed), set()
    for _ in range(calls):
        desc, thunk = fuzz.call()
        with open(last_call, "w") as f:
            f.write(desc)
        try:
            fuzz.use(thunk())
        except Exception as e:  # noqa: BLE001 (sorted below)
            key = (type(e).__name__, str(e)[:60])
            if unexpected(e) and key not in seen:
                seen.add(key)
                print(f"UNEXPECTED {type(e).__name__}: {str(e)[:200]}\n    from {desc[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
