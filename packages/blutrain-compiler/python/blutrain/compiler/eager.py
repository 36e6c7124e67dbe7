"""Running one captured node through blutrain.tensor's eager ops.

What the compiler does not generate code for runs here: GEMMs and attention (calls into
blutrain.linalg / blutrain.tensor kernels, by design), gathers and scatters, random numbers, and
any op the lowering does not know (an eager fallback, logged once per op). Views run here too
when something outside a fused kernel reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import blutrain.tensor as bt

from .graph import Node

Fn = Callable[[Node, list[Any]], list[Any]]
_TABLE: dict[str, Fn] = {}


def _reg(*names: str) -> Callable[[Fn], Fn]:
    def deco(f: Fn) -> Fn:
        for n in names:
            _TABLE[n] = f
        return f

    return deco


def _dt(s: str) -> Any:
    return getattr(bt, s)


@_reg("matmul", "linear")
def _matmul(n: Node, x: list[Any]) -> list[Any]:
    a, b = x[0], x[1]
    bias = x[2] if len(x) > 2 and n.attrs.get("bias") else None
    if n.attrs.get("trans_b"):
        if bias is not None or b.ndim == 2:
            return [bt.linear(a, b, bias)]
        return [bt.matmul(a, b.mT)]
    r = bt.matmul(a, b)
    return [r if bias is None else r + bias]


@_reg("bmm")
def _bmm(n: Node, x: list[Any]) -> list[Any]:
    return [bt.bmm(x[0], x[1])]


@_reg("index_select")
def _index_select(n: Node, x: list[Any]) -> list[Any]:
    return [bt.index_select(x[0], n.attrs["dim"], x[1])]


@_reg("index_add")
def _index_add(n: Node, x: list[Any]) -> list[Any]:
    return [bt.index_add(x[0], n.attrs["dim"], x[1], x[2])]


@_reg("gather")
def _gather(n: Node, x: list[Any]) -> list[Any]:
    return [bt.gather(x[0], n.attrs["dim"], x[1])]


@_reg("scatter_add")
def _scatter_add(n: Node, x: list[Any]) -> list[Any]:
    return [bt.scatter_add(x[0], n.attrs["dim"], x[1], x[2])]


@_reg("cat")
def _cat(n: Node, x: list[Any]) -> list[Any]:
    return [bt.cat(list(x), n.attrs["dim"])]


@_reg("slice_scatter")
def _slice_scatter(n: Node, x: list[Any]) -> list[Any]:
    base, src = x[0], x[1]
    a = n.attrs
    out = base.clone()
    d = a["dim"] % base.ndim
    idx = [slice(None)] * base.ndim
    idx[d] = slice(a["start"], a["stop"], a.get("step", 1))
    out[tuple(idx)] = src
    return [out]


# ---- views (cheap: metadata only) ------------------------------------------------------------
@_reg("reshape", "view", "squeeze", "unsqueeze")
def _reshape(n: Node, x: list[Any]) -> list[Any]:
    return [x[0].reshape(tuple(n.attrs["shape"]))]


@_reg("permute")
def _permute(n: Node, x: list[Any]) -> list[Any]:
    return [x[0].permute(*n.attrs["perm"])]


@_reg("expand")
def _expand(n: Node, x: list[Any]) -> list[Any]:
    return [x[0].expand(*n.attrs["shape"])]


@_reg("slice")
def _slice(n: Node, x: list[Any]) -> list[Any]:
    a = n.attrs
    d = a["dim"] % x[0].ndim
    idx = [slice(None)] * x[0].ndim
    idx[d] = slice(a["start"], a["stop"], a.get("step", 1))
    return [x[0][tuple(idx)]]


@_reg("select")
def _select(n: Node, x: list[Any]) -> list[Any]:
    return [x[0].select(n.attrs["dim"], n.attrs["index"])]


VIEW_OPS = {"reshape", "view", "squeeze", "unsqueeze", "permute", "expand", "slice", "select"}
LIBRARY_OPS = {"matmul", "linear", "bmm"}  # GEMMs: blutrain.linalg's kernels by design


def can_run(op: str) -> bool:
    return op in _TABLE


def run(n: Node, inputs: Sequence[Any]) -> list[Any]:
    f = _TABLE.get(n.op)
    if f is None:
        raise NotImplementedError(f"[compile] no eager replay for op {n.op!r}")
    with bt.no_grad():
        return f(n, list(inputs))
