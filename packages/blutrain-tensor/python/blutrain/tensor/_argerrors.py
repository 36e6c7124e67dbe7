"""The TypeError of a call the C++ bindings refused (Note [argument errors], init_errors.cpp).

nanobind answers a call whose arguments do not convert with a generic "incompatible function
arguments".  Each public binding has a catch-all overload that lands here instead: the call is
bound to the real overload's signature (``__nb_signature__``) and the first problem is named,
``[transpose] argument 'dim0' must be int, got 'a' (str)``.  Only refused calls get here.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any, NoReturn

_DEFAULT = re.compile(r"\\\d+")  # nanobind's default-value markers: "= \0"
_INT64 = (-(2**63), 2**63 - 1)


class _Param:
    def __init__(self, name: str, kind: str, ann: ast.expr | None, has_default: bool) -> None:
        self.name, self.kind, self.ann, self.has_default = name, kind, ann, has_default


def _params(sig: str) -> list[_Param] | None:
    """The parameters of one nanobind signature string ("def f(x: int, y: float = \\0) -> T")."""
    try:
        fn = ast.parse(_DEFAULT.sub("...", sig).strip() + ": ...").body[0]
    except SyntaxError:
        return None
    if not isinstance(fn, ast.FunctionDef):
        return None
    a = fn.args
    out: list[_Param] = []
    pos = a.posonlyargs + a.args
    first_default = len(pos) - len(a.defaults)
    for i, p in enumerate(pos):
        out.append(_Param(p.arg, "pos", p.annotation, i >= first_default))
    if a.vararg is not None:
        out.append(_Param(a.vararg.arg, "varargs", None, True))
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append(_Param(p.arg, "kw", p.annotation, d is not None))
    if a.kwarg is not None:
        out.append(_Param(a.kwarg.arg, "varkw", None, True))
    return out


def _type_name(ann: ast.expr | None) -> str:
    if ann is None:
        return "any"
    text = ast.unparse(ann)
    for prefix in ("blutrain.tensor._tensor.", "collections.abc.", "typing.", "builtins."):
        text = text.replace(prefix, "")
    return text


def _describe(v: Any) -> str:
    from . import Tensor

    if isinstance(v, Tensor):
        return f"a Tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(v).__name__})"


describe = _describe


def bind_failure(op: str, fn: Any, args: tuple, kwargs: dict) -> str | None:
    """The message for a call of the Python function fn whose arguments do not bind to its
    signature, or None when they do."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return f"[{op}] {e} (arguments: {', '.join(sig.parameters)})"
    return None


def _is_int(v: Any) -> bool:
    """An int argument: an int or anything with __index__, not a bool (PyTorch's rule)."""
    if isinstance(v, bool | float | str) or type(v).__name__ == "bool_":
        return False
    try:
        operator.index(v)
    except Exception:  # noqa: BLE001 (a Tensor's __index__ raises for non-scalars)
        return False
    return True


def _matches(v: Any, ann: ast.expr | None) -> bool:
    """Whether v could convert to the annotated type (loosely: a refusal elsewhere still ends in
    the generic message of raise_for)."""
    from . import Tensor, dtype

    if ann is None:
        return True
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _matches(v, ann.left) or _matches(v, ann.right)
    if isinstance(ann, ast.Constant):
        return ann.value is None and v is None or ann.value is Ellipsis
    if isinstance(ann, ast.Subscript):
        base = _type_name(ann.value)
        if base in ("Sequence", "list", "tuple", "Iterable"):
            if isinstance(v, str | bytes) or not hasattr(v, "__iter__"):
                return False
            elem = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
            try:
                return all(_matches(x, elem) for x in v)
            except TypeError:
                return False
        if base in ("Callable",):
            return callable(v)
        return True
    name = _type_name(ann).rsplit(".", 1)[-1]
    if name == "None":
        return v is None
    if name == "int":
        return _is_int(v) and _INT64[0] <= operator.index(v) <= _INT64[1]
    if name == "float":
        if isinstance(v, int) and not -(2**1024) < v < 2**1024:
            return False  # (past a double's range)
        return isinstance(v, int | float) or hasattr(v, "__float__") or hasattr(v, "__index__")
    if name == "bool":
        return isinstance(v, bool) or type(v).__name__ == "bool_"
    if name == "str":
        return isinstance(v, str)
    if name == "Tensor":
        return isinstance(v, Tensor)
    if name == "dtype":
        return isinstance(v, dtype)
    if name in ("object", "Any", "handle"):
        return True
    if name == "Callable":
        return callable(v)
    return type(v).__name__ == name or not name[:1].isupper()


def _problem(op: str, params: list[_Param], args: tuple, kwargs: dict) -> str | None:
    """The first thing wrong with binding (args, kwargs) to params, or None."""
    names = [p.name for p in params if p.kind in ("pos", "kw")]
    listed = ", ".join(names)
    pos = [p for p in params if p.kind == "pos"]
    bound: dict[str, Any] = {}
    varargs = any(p.kind == "varargs" for p in params)
    varkw = any(p.kind == "varkw" for p in params)
    if len(args) > len(pos) and not varargs:
        return (
            f"[{op}] takes at most {len(pos)} positional argument{'s' * (len(pos) != 1)}"
            f" ({', '.join(p.name for p in pos)}), got {len(args)}"
        )
    for p, v in zip(pos, args, strict=False):
        bound[p.name] = v
    for k, v in kwargs.items():
        if k in bound:
            return f"[{op}] got two values for argument '{k}'"
        if k in names:
            bound[k] = v
        elif not varkw:
            return f"[{op}] got an unexpected keyword argument '{k}' (its arguments: {listed})"
    for p in params:
        if p.kind in ("pos", "kw") and not p.has_default and p.name not in bound:
            return f"[{op}] missing required argument '{p.name}' (its arguments: {listed})"
    for p in params:
        if p.name in bound and not _matches(bound[p.name], p.ann):
            v = bound[p.name]
            if _type_name(p.ann) == "int" and _is_int(v):
                return f"[{op}] argument '{p.name}' = {operator.index(v)} does not fit int64"
            if _type_name(p.ann) in ("float", "float | None") and isinstance(v, int):
                return f"[{op}] argument '{p.name}' = {v} does not fit a float (double)"
            return f"[{op}] argument '{p.name}' must be {_type_name(p.ann)}, got {_describe(v)}"
    return None


def raise_for(op: str, fn: Any, self: Any, args: tuple, kwargs: dict) -> NoReturn:
    """Raises the TypeError for a call of fn (the overloaded binding) it refused."""
    from . import Tensor

    if self is not None and not isinstance(self, Tensor):
        raise TypeError(f"[{op}] self must be a Tensor, got {_describe(self)}")
    while not hasattr(fn, "__nb_signature__") and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__  # (in-place methods: a Python wrapper returning self)
    sigs = [s[0] for s in getattr(fn, "__nb_signature__", ()) if "typing.NoReturn" not in s[0]]
    for sig in sigs:
        params = _params(sig)
        if params is None:
            continue
        if self is not None and params and params[0].name == "self":
            params = params[1:]
        problem = _problem(op, params, tuple(args), dict(kwargs))
        if problem is not None:
            raise TypeError(problem)
    shown = "; ".join(_DEFAULT.sub("...", s).removeprefix("def ") for s in sigs)
    got = ", ".join(
        [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    )
    raise TypeError(f"[{op}] invalid arguments ({got}); expected {shown}")
