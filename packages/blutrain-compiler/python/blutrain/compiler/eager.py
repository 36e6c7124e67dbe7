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
    if n.attrs.get("embedding") and n.attrs["dim"] == 0 and x[1].ndim == 1:
        return [bt.embedding(x[1], x[0])]  # its index rules: no negative indices
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
# gathers, scatters, random numbers: eager kernels by design (data-dependent addressing)
EAGER_BY_DESIGN = {
    "index_select",
    "index_add",
    "gather",
    "scatter_add",
    "slice_scatter",
    "random",
    "dropout",
    "embedding",
    "to_device",
}
# attention and the GEMM-fused ops: blutrain.tensor's kernels by design (through replay)
ATTENTION_OPS = {
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_packed",
    "flash_attention_packed_backward",
    "qkv_attention",
    "linear_gelu",
    "linear_gelu_linear",
    "linear_weight_grad",
    "linear_dgelu",
    "linear_cross_entropy",
}


def can_run(op: str) -> bool:
    return op in _TABLE


def replayable(n: Node) -> bool:
    return n.raw is not None


def _replay_graph(
    n: Node,
    raw: dict[str, Any],
    seed: int | None = None,
    attrs: dict[str, Any] | None = None,
    layout: tuple[tuple[int, ...], ...] | None = None,
) -> Any:
    """A one-node bt.Graph of n (blutrain.tensor's replay: any op, eager's bits); value ids
    renumbered 0.. as the loader wants them. layout: the strides of the inputs as the program
    holds them, in place of the captured ones (Note [input layouts])."""
    vals = {v["id"]: v for v in raw["values"]}
    ins: list[int] = []
    for i in n.inputs:
        if i >= 0 and i not in ins:
            ins.append(i)
    new = {old: k for k, old in enumerate(ins + list(n.outputs))}
    values = [
        dict(vals[i], id=new[i], input=True, storage=k, requires_grad=False)
        for k, i in enumerate(ins)
    ]
    if layout is not None:
        for v, st in zip(values, layout):
            v["strides"] = list(st)
            v["offset"] = 0
    values += [
        dict(vals[o], id=new[o], input=False, storage=-1, requires_grad=False) for o in n.outputs
    ]
    node = dict(n.raw or {})
    if attrs:
        node["attrs"] = dict(node.get("attrs", {}), **attrs)
    random = n.op in ("random", "dropout") and "offset" in n.attrs
    if random and seed is not None:  # draw from the generator as it is now (its seed too)
        node["attrs"] = dict(node["attrs"], seed=int(seed))
    node["inputs"] = [new[i] if i >= 0 else -1 for i in n.inputs]
    node["outputs"] = [new[o] for o in n.outputs]
    mutates = list(node.get("mutates", []))
    fresh = len(n.outputs) - len(mutates)
    muts = [[new[n.inputs[p]], new[n.outputs[fresh + j]]] for j, p in enumerate(mutates)]
    # the generator: only a random op draws, ceil(n / 4) Philox counters from its offset, so a
    # replay of it draws where the generator stands and advances it by that much (as eager)
    rng = dict(raw["rng"])
    if random and seed is not None:
        rng["seed"] = int(seed)
    if random:
        count = 1
        for d in vals[n.outputs[0]]["shape"]:
            count *= int(d)
        rng["offset_begin"] = int(n.attrs["offset"])
        rng["offset_end"] = int(n.attrs["offset"]) + (count + 3) // 4
    else:
        rng["offset_end"] = rng["offset_begin"]
    doc = {
        "format": raw["format"],
        "schema_version": raw["schema_version"],
        "numerics": raw["numerics"],
        "rng": rng,
        "inputs": [new[i] for i in ins],
        "outputs": [new[o] for o in n.outputs],
        "mutations": muts,
        "grads": [],
        "values": values,
        "nodes": [node],
    }
    return bt.load_graph(doc), ins


# Note [input layouts]: a replayed node checks its inputs' strides against the capture's. The
# program does not always hold a value in the layout eager made it in: a fused kernel writes
# its outputs contiguous, where eager's elementwise ops keep a permuted input's layout (rotary
# embedding on q.permute(0, 2, 1, 3) gives attention a (B, H, T, D) view of a (B, T, H, D)
# buffer). blutrain.tensor's eager ops accept any layout, so the guard below specializes the
# node's one-node graph to the layout it is given (the strides are part of the cache key: a
# layout seen before reuses its graph) instead of copying the input into the captured one: no
# copy, no allocation, and the values eager computes on that layout.
def _layout(n: Node, ins: list[int], by_id: dict[int, Any], raw: dict[str, Any]) -> Any:
    """None when every input has its captured strides (size-1 dims ignored), else the inputs'
    strides (the guard's key)."""
    cap = getattr(n, "_cap_strides", None)
    if cap is None:
        vals = {v["id"]: v for v in raw["values"]}
        cap = [(tuple(vals[i]["shape"]), tuple(vals[i]["strides"])) for i in ins]
        n._cap_strides = cap  # type: ignore[attr-defined]
    got = tuple(tuple(by_id[i].stride()) for i in ins)
    for (shape, want), st in zip(cap, got):
        if any(d > 1 and a != b for d, a, b in zip(shape, st, want)):
            return got
    return None


def _cached_graph(n: Node, key: Any, make: Callable[[], Any]) -> Any:
    cache = n.__dict__.setdefault("_replays", {})
    g = cache.get(key)
    if g is None:
        if len(cache) >= 8:  # a random op's seed changed, or layouts churn: keep it bounded
            cache.clear()
        g = cache[key] = make()
    return g


# ops program.py may run over their first input's memory (Note [in-place updates] there)
OVER_BASE = {"index_add", "slice_scatter"}


def run_over_base(n: Node, inputs: Sequence[Any], raw: dict[str, Any]) -> list[Any]:
    """Runs an OVER_BASE node writing its result over inputs[0] (contiguous, of the result's
    shape and dtype, read by nothing afterwards): the same values as run(), no new memory.
    index_add through blutrain.tensor's own IndexAdd with over_base (its donation path);
    slice_scatter as an assignment into the slice."""
    base = inputs[0]
    with bt.no_grad():
        if n.op == "slice_scatter":
            a = n.attrs
            d = a["dim"] % base.ndim
            idx = [slice(None)] * base.ndim
            idx[d] = slice(a["start"], a["stop"], a.get("step", 1))
            base[tuple(idx)] = inputs[1]
            return [base]
        by_id = {i: t for i, t in zip(n.inputs, inputs) if i >= 0}
        ins = _inputs_of(n)
        lay = _layout(n, ins, by_id, raw)
        g, _ = _cached_graph(
            n, ("over", lay), lambda: _replay_graph(n, raw, None, {"over_base": True}, lay)
        )
        return list(g.replay([by_id[i] for i in ins], set_grads=False, check=False))


def _inputs_of(n: Node) -> list[int]:
    ins: list[int] = []
    for i in n.inputs:
        if i >= 0 and i not in ins:
            ins.append(i)
    return ins


def run(n: Node, inputs: Sequence[Any], raw: dict[str, Any] | None = None) -> list[Any]:
    """Runs node n eagerly on `inputs` (one per n.inputs, None where absent)."""
    f = _TABLE.get(n.op)
    if f is None and n.raw is not None and raw is not None:
        seed = int(bt._tensor._get_rng_state()[0]) if n.op in ("random", "dropout") else None
        by_id = {i: t for i, t in zip(n.inputs, inputs) if i >= 0}
        ins = _inputs_of(n)
        lay = _layout(n, ins, by_id, raw)  # Note [input layouts]
        g, _ = _cached_graph(n, (seed, lay), lambda: _replay_graph(n, raw, seed, None, lay))
        with bt.no_grad():
            return list(g.replay([by_id[i] for i in ins], set_grads=False, check=False))
    if f is None:
        raise NotImplementedError(f"[compile] no eager replay for op {n.op!r}")
    with bt.no_grad():
        return f(n, list(inputs))
