"""Lowering a group of captured nodes to one MLIR function: func + linalg/arith/math/tensor.

Every node becomes linalg on tensors as it is (one `linalg.generic` per elementwise op or
reduction, several for a norm or a loss); upstream passes then fuse them. View ops (reshape,
permute, expand, slice, select) emit nothing: they become affine index maps on the operands that
read them, so a permuted or broadcast read is a different indexing map, never a copy. Constants
(`full`) and `arange` become values built inside the bodies (an integer `arange` on the CPU: a
constant operand, Note [positions as operands]).

The function takes the group's inputs as tensors of their storage shape and returns its outputs
(contiguous, logical shape). Numerics follow blutrain.tensor's CPU kernels: 16-bit floats compute
in float32 and round on store; sums of floats accumulate in float64; norm and loss statistics are
float64 (their row formulas are copied from cpu/nn.cpp and cpu/nn_fused.cpp).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import affine, arith, func, linalg, tensor

from . import scalar as S
from .graph import Graph, Node
from .opsets import (  # noqa: F401  (the ops each emitter method takes)
    BINARY,
    COMPOSITES,
    CPU_LOWERABLE,
    LOWERABLE,
    OTHER,
    REDUCTIONS,
    UNARY,
    VIEWS,
)

Expr = Any  # ir.AffineExpr
IndexFn = Callable[[list[Expr]], list[Expr]]

PAR = "#linalg.iterator_type<parallel>"
LANES = 8  # eager's kLanes (cpu/softmax_kernels.h): partial results of a CPU row reduction
SUM_LANES = 16  # eager's kSumLanes: the softmax / log_softmax backward's row sums
# eager's kMaxLanes: a row max does not depend on the order (a -0 / +0 tie changes no later
# result), so it takes eager's lanes for their speed: four independent 8-wide chains
MAX_LANES = 32
# eager's layer-norm backward column blocks (cpu/norm_kernels.h: kBlockRows, kMaxBlocks; Note
# [column blocks]): block_rows(R) = max(32, ceil(R / 64)) rows a partial column sum
LN_BLOCK_ROWS = 32
LN_MAX_BLOCKS = 64
RED = "#linalg.iterator_type<reduction>"
IOTA_MAX = 1 << 17  # positions a constant operand holds (Note [positions as operands])
_INT_NP = {"int64": np.int64, "int32": np.int32}
_NP_INT = {np.dtype(v).str: k for k, v in _INT_NP.items()}


class LoweringError(Exception):
    """A node the lowering cannot express (the caller falls back to eager for it)."""


@dataclass
class Ref:
    """A value as the bodies read it: a tensor (or a constant / an iota) through an index map."""

    dtype: str
    shape: tuple[int, ...]
    tensor: Any = None  # ir.Value of a ranked tensor (the storage)
    index: IndexFn = field(default=lambda e: e)  # logical index exprs -> storage index exprs
    const: float | int | None = None
    iota: tuple[float | int, float | int] | None = None  # (start, step) over storage dim 0
    identity: bool = True  # index is the identity on a tensor of this shape
    flat_src: bool = False  # tensor is the 1-D (flat) form of a value of this shape

    def view(self, shape: Sequence[int], fn: IndexFn) -> Ref:
        inner = self.index
        return Ref(
            self.dtype,
            tuple(shape),
            self.tensor,
            lambda e: inner(fn(e)),
            self.const,
            self.iota,
            False,
            False,
        )


def _c(v: int) -> Expr:
    return ir.AffineConstantExpr.get(v)


def _d(i: int) -> Expr:
    return ir.AffineDimExpr.get(i)


def _strides(shape: Sequence[int]) -> list[int]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return st[::-1]


def _linear(e: list[Expr], shape: Sequence[int]) -> Expr:
    acc: Expr = _c(0)
    for x, st, s in zip(e, _strides(shape), shape):
        if s != 1:
            acc = acc + x * st
    return acc


def _delinear(lin: Expr, shape: Sequence[int]) -> list[Expr]:
    """Row-major index of linear position `lin` in `shape` (floordiv / mod maps)."""
    out: list[Expr] = []
    first = True
    for st, s in zip(_strides(shape), shape):
        if s == 1:
            out.append(_c(0))
            continue
        q = ir.AffineExpr.get_floor_div(lin, st) if st != 1 else lin
        out.append(q if first else ir.AffineExpr.get_mod(q, s))
        first = False
    return out


def _reshape_groups(
    dst: tuple[int, ...], src: tuple[int, ...]
) -> list[tuple[list[int], list[int]]] | None:
    """Pairs (dst dims, src dims) whose products match, in order: a reshape that only merges
    or splits neighbouring dims maps each group alone (no div / mod across groups)."""
    groups = []
    i = j = 0
    while i < len(dst) or j < len(src):
        gd, gs = [], []
        pd = ps = 1
        if i < len(dst):
            gd.append(i)
            pd *= dst[i]
            i += 1
        if j < len(src):
            gs.append(j)
            ps *= src[j]
            j += 1
        while pd != ps:
            if pd < ps and i < len(dst):
                gd.append(i)
                pd *= dst[i]
                i += 1
            elif ps < pd and j < len(src):
                gs.append(j)
                ps *= src[j]
                j += 1
            else:
                return None
        # trailing unit dims join the current group
        while i < len(dst) and dst[i] == 1 and (j >= len(src) or src[j] != 1):
            gd.append(i)
            i += 1
        while j < len(src) and src[j] == 1 and (i >= len(dst) or dst[i] != 1):
            gs.append(j)
            j += 1
        groups.append((gd, gs))
    return groups


def _reshape_index(e: list[Expr], dst: tuple[int, ...], src: tuple[int, ...]) -> list[Expr]:
    groups = _reshape_groups(dst, src)
    if groups is None:
        return _delinear(_linear(e, dst), src)
    out: list[Expr] = [_c(0)] * len(src)
    for gd, gs in groups:
        if len(gd) == 1 and len(gs) == 1:
            out[gs[0]] = e[gd[0]]
            continue
        lin = _linear([e[k] for k in gd], [dst[k] for k in gd])
        for k, x in zip(gs, _delinear(lin, [src[k] for k in gs])):
            out[k] = x
    return out


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


class Emitter:
    """Builds one function for a list of nodes (in program order)."""

    def __init__(
        self,
        graph: Graph,
        nodes: Sequence[Node],
        inputs: Sequence[int],
        outputs: Sequence[int],
        name: str,
        input_shapes: dict[int, tuple[int, ...]] | None = None,
        flat: bool = False,
        cpu: bool = False,
    ):
        self.g, self.nodes, self.inputs, self.outputs, self.name = (
            graph,
            nodes,
            inputs,
            outputs,
            name,
        )
        self.input_shapes = input_shapes or {}
        self.env: dict[int, Ref] = {}
        # flat: every elementwise generic iterates one linear index and every reduction (kept,
        # reduced) — the GPU mapping then needs one tile shape (coalesced: consecutive threads,
        # consecutive elements) for every loop
        self.flat = flat
        # cpu: row reductions marked `lanes` sum in LANES partial results, as eager's CPU kernels
        # (Note [row reductions in lanes]); the GPU's rowgen maps rows its own way
        self.cpu = cpu

    # ---- module -----------------------------------------------------------------------------
    def build(self, module: ir.Module) -> func.FuncOp:
        in_types = []
        for v in self.inputs:
            val = self.g.values[v]
            shp = self.input_shapes.get(v, val.shape)
            in_types.append(ir.RankedTensorType.get(list(shp), S.storage_type(val.dtype)))
        out_types = [
            ir.RankedTensorType.get(
                list(self.g.values[v].shape), S.storage_type(self.g.values[v].dtype)
            )
            for v in self.outputs
        ]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp(self.name, ir.FunctionType.get(in_types, out_types))
            fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
            blk = fn.add_entry_block()
        with ir.InsertionPoint(blk):
            for v, arg in zip(self.inputs, blk.arguments):
                val = self.g.values[v]
                shp = self.input_shapes.get(v, val.shape)
                self.env[v] = Ref(val.dtype, tuple(shp), arg)
            for n in self.nodes:
                self.lower(n)
            results = [self.materialize(self.env[v]) for v in self.outputs]
            func.ReturnOp(results)
        return fn

    # ---- helpers ----------------------------------------------------------------------------
    def materialize(self, r: Ref) -> ir.Value:
        """A tensor of r's logical shape (a copy generic unless r is already one)."""
        if r.tensor is not None and r.identity:
            return r.tensor
        if r.tensor is None or not r.flat_src:
            r = self.ew(r.shape, r.dtype, [r], lambda x: x)
        if r.flat_src:
            return self._unflatten(r)
        return r.tensor

    def _unflatten(self, r: Ref) -> ir.Value:
        t = ir.RankedTensorType.get(list(r.shape), S.storage_type(r.dtype))
        if len(r.shape) == 1:
            return r.tensor
        if len(r.shape) == 0:
            return tensor.CollapseShapeOp(t, r.tensor, ir.ArrayAttr.get([])).result
        reassoc = ir.ArrayAttr.get(
            [
                ir.ArrayAttr.get(
                    [
                        ir.IntegerAttr.get(ir.IntegerType.get_signless(64), i)
                        for i in range(len(r.shape))
                    ]
                )
            ]
        )
        return tensor.ExpandShapeOp(t, r.tensor, reassoc, [], list(r.shape)).result

    def _operand(self, r: Ref, iter_exprs: list[Expr], nd: int) -> tuple[Any, Any] | None:
        if r.tensor is None:
            return None
        exprs = r.index(iter_exprs)
        return r.tensor, ir.AffineMapAttr.get(ir.AffineMap.get(nd, 0, exprs))

    def _scalar_of(self, r: Ref, arg: Any, iter_exprs: list[Expr], nd: int) -> ir.Value:
        if r.const is not None:
            return S.const(r.dtype, r.const)
        if r.iota is not None:
            (e,) = r.index(iter_exprs)
            idx = [_index(i) for i in range(nd)]
            pos = affine.apply(ir.AffineMap.get(nd, 0, [e]), idx)
            i64 = arith.index_cast(ir.IntegerType.get_signless(64), pos)
            start, step = r.iota
            if S.is_float(r.dtype):
                fv = S.cast(i64, "int64", r.dtype)
                return S.add(
                    S.const(r.dtype, start), S.mul(S.const(r.dtype, step), fv, r.dtype), r.dtype
                )
            v = S.add(
                S.const("int64", int(start)),
                S.mul(S.const("int64", int(step)), i64, "int64"),
                "int64",
            )
            return S.cast(v, "int64", r.dtype)
        return S.load_bool(arg) if r.dtype == "bool" else arg

    def generic(
        self,
        iter_shape: Sequence[int],
        reduce_dims: Sequence[int],
        refs: Sequence[Ref],
        outs: Sequence[tuple[str, Any]],
        body: Callable[..., list[ir.Value]],
        with_index: bool = False,
    ) -> list[ir.Value]:
        """A linalg.generic over iter_shape. outs: (dtype, init tensor) of the kept dims' shape
        (reductions) or of iter_shape. body(index_values, *ref scalars, *out scalars)."""
        nd = len(iter_shape)
        ex = [_d(i) for i in range(nd)]
        ops, maps, pos = [], [], []
        seen: dict[tuple[int, str], int] = {}
        for r in refs:
            o = self._operand(r, ex, nd)
            if o is None:
                pos.append(-1)
                continue
            key = (id(o[0]), str(o[1]))
            if key not in seen:
                seen[key] = len(ops)
                ops.append(o[0])
                maps.append(o[1])
            pos.append(seen[key])
        red = set(reduce_dims)
        out_exprs = [_d(i) for i in range(nd) if i not in red]
        out_map = ir.AffineMapAttr.get(ir.AffineMap.get(nd, 0, out_exprs))
        inits = [t for _, t in outs]
        res_types = [t.type for t in inits]
        iters = [ir.Attribute.parse(RED if i in red else PAR) for i in range(nd)]
        g = linalg.GenericOp(
            res_types,
            ops,
            inits,
            ir.ArrayAttr.get(maps + [out_map] * len(inits)),
            ir.ArrayAttr.get(iters),
        )
        elt = [ir.RankedTensorType(o.type).element_type for o in ops] + [
            ir.RankedTensorType(t.type).element_type for t in inits
        ]
        blk = g.regions[0].blocks.append(*elt)
        with ir.InsertionPoint(blk):
            args = list(blk.arguments)
            scal = [
                self._scalar_of(r, args[p] if p >= 0 else None, ex, nd) for r, p in zip(refs, pos)
            ]
            outs_s = args[len(ops) :]
            idx = [_index(i) for i in range(nd)] if with_index else []
            outs_s = [S.load_bool(a) if dt == "bool" else a for a, (dt, _) in zip(outs_s, outs)]
            res = body(idx, *scal, *outs_s) if with_index else body(*scal, *outs_s)
            linalg.YieldOp(
                [S.store_bool(v) if dt == "bool" else v for v, (dt, _) in zip(res, outs)]
            )
        return list(g.results) if len(inits) > 1 else [g.result]

    def empty(self, shape: Sequence[int], dtype: str) -> ir.Value:
        return tensor.EmptyOp(list(shape), S.storage_type(dtype)).result

    def filled(self, shape: Sequence[int], dtype: str, v: float) -> ir.Value:
        c = S.const("uint8", int(bool(v))) if dtype == "bool" else S.const(dtype, v)
        return linalg.fill(c, outs=[self.empty(shape, dtype)])

    def ew(
        self,
        shape: Sequence[int],
        dtype: str,
        refs: Sequence[Ref],
        fn: Callable[..., ir.Value],
        with_index: bool = False,
    ) -> Ref:
        """An elementwise value of `shape`: fn(*scalars) (refs broadcast to shape, numpy-style)."""
        shape = tuple(shape)
        refs = [self.bcast(r, shape) for r in refs]
        if self.flat and len(shape) != 1:
            n = math.prod(shape)
            refs = [r.view((n,), lambda e, sh=shape: _delinear(e[0], sh)) for r in refs]
            if with_index:
                body = lambda idx, *a: [fn(_delin_vals(idx[0], shape), *a[: len(refs)])]  # noqa: E731
            else:
                body = lambda *a: [fn(*a[: len(refs)])]  # noqa: E731
            (t,) = self.generic(
                (n,), (), refs, [(dtype, self.empty((n,), dtype))], body, with_index
            )
            r = Ref(dtype, shape, t, lambda e, sh=shape: [_linear(e, sh)], identity=False)
            r.flat_src = True
            return r
        if with_index:
            body = lambda idx, *a: [fn(idx, *a[: len(refs)])]  # noqa: E731
        else:
            body = lambda *a: [fn(*a[: len(refs)])]  # noqa: E731
        (t,) = self.generic(shape, (), refs, [(dtype, self.empty(shape, dtype))], body, with_index)
        return Ref(dtype, shape, t)

    def reduce(
        self,
        shape: Sequence[int],
        dims: Sequence[int],
        acc: str,
        init: float,
        refs: Sequence[Ref],
        elem: Callable[..., ir.Value],
        combine: Callable[[ir.Value, ir.Value], ir.Value],
        with_index: bool = False,
        lanes: int = 0,
    ) -> Ref:
        """combine over `dims` of elem(*scalars) (refs broadcast to `shape`); the result has the
        kept dims' shape, dtype acc. lanes: a last-dim reduction eager's CPU kernels compute in
        that many partial results (Note [row reductions in lanes]): so do CPU kernels."""
        shape = tuple(shape)
        refs = [self.bcast(r, shape) for r in refs]
        if (
            lanes
            and self.cpu
            and not self.flat
            and not with_index
            and list(dims) == [len(shape) - 1]
            and shape[-1] >= lanes
        ):
            return self._reduce_lanes(shape, acc, init, refs, elem, combine, lanes)
        kept = tuple(s for i, s in enumerate(shape) if i not in set(dims))
        if self.flat and (len(kept) != 1 or len(dims) != 1 or list(dims) != [len(shape) - 1]):
            K, Rn = math.prod(kept), math.prod(shape[d] for d in dims)
            kd_, rd_ = [i for i in range(len(shape)) if i not in set(dims)], list(dims)
            ksh, rsh = tuple(shape[i] for i in kd_), tuple(shape[i] for i in rd_)

            def full(e: list[Expr]) -> list[Expr]:
                ke, re_ = _delinear(e[0], ksh), _delinear(e[1], rsh)
                out: list[Expr] = [_c(0)] * len(shape)
                for i, x in zip(kd_, ke):
                    out[i] = x
                for i, x in zip(rd_, re_):
                    out[i] = x
                return out

            refs = [r.view((K, Rn), full) for r in refs]
            n = len(refs)
            if with_index:
                raise LoweringError("indexed reduction in flat mode")
            body = lambda *a: [combine(elem(*a[:n]), a[n])]  # noqa: E731
            (t,) = self.generic((K, Rn), [1], refs, [(acc, self.filled((K,), acc, init))], body)
            r = Ref(acc, kept, t, lambda e, sh=kept: [_linear(e, sh)], identity=False)
            r.flat_src = True
            return r
        init_t = self.filled(kept, acc, init)
        n = len(refs)
        # loops in the order (kept dims, reduced dims): every reduction is over trailing loops,
        # which the loop mappings (parallel outside, reduction inside) rely on
        dset = set(dims)
        order = [i for i in range(len(shape)) if i not in dset] + sorted(dset)
        if order != list(range(len(shape))):
            pos = {d: k for k, d in enumerate(order)}
            refs = [
                r.view(
                    tuple(shape[d] for d in order),
                    lambda e, pos=pos: [e[pos[i]] for i in range(len(shape))],
                )
                for r in refs
            ]
        pshape = tuple(shape[d] for d in order)
        pdims = list(range(len(kept), len(shape)))
        if with_index:
            inv = [order.index(i) for i in range(len(shape))]

            def body(idx: list, *a: ir.Value) -> list[ir.Value]:
                return [combine(elem([idx[inv[i]] for i in range(len(idx))], *a[:n]), a[n])]

        else:
            body = lambda *a: [combine(elem(*a[:n]), a[n])]  # noqa: E731
        (t,) = self.generic(pshape, pdims, refs, [(acc, init_t)], body, with_index)
        return Ref(acc, kept, t)

    # Note [row reductions in lanes]: eager's CPU row kernels (cpu/softmax_kernels.h: row_max,
    # row_exp_sum) keep LANES independent accumulators, lane k taking elements 8j + k, the tail
    # (C % LANES elements) added to lane 0 in order, then the lanes combined from an initial
    # value in lane order. A single running sum is a dependency chain LLVM must keep scalar (it
    # may not reassociate float adds); lanes are independent, so the (rows, C / LANES, LANES)
    # generic's inner loop over lanes vectorises, exp included. The same order also gives eager's
    # bits. Three generics: the lanes (rows, LANES), the tail into lane 0, the combination.
    # Eager's lane counts: 8 for the exp sums (LANES), 16 for the softmax / log_softmax
    # backward's sums (SUM_LANES), 32 for a max (MAX_LANES, order-free, taken for speed).
    def _reduce_lanes(
        self,
        shape: tuple[int, ...],
        acc: str,
        init: float,
        refs: Sequence[Ref],
        elem: Callable[..., ir.Value],
        combine: Callable[[ir.Value, ir.Value], ir.Value],
        L: int,
    ) -> Ref:
        kept, C = shape[:-1], shape[-1]
        r = len(kept)
        C8, main = C // L, (C // L) * L
        n = len(refs)
        body = lambda *a: [combine(elem(*a[:n]), a[-1])]  # noqa: E731 (a[n]: the anchor)

        def part(x: Ref, start: int, size: int, split: bool) -> Ref:
            """x's columns [start, start + size), split into (C8, L) when `split`."""
            if split:
                return x.view((*kept, C8, L), lambda e: [*e[:r], e[r] * L + e[r + 1]])
            return x.view((*kept, size), lambda e: [*e[:r], e[r] + start])

        def anchor(size: int, nd: int) -> Ref:
            """An unread byte per step of the reduced loop: linalg takes each loop's bound from
            an operand whose map names it plainly, and x's map (d1 * 8 + d2) does not. (A slice
            + expand_shape of x would, but stops elementwise producers fusing into the sum.)"""
            t = self.empty((size,), "uint8")
            return Ref("uint8", (0,) * nd, t, lambda e: [e[r]], identity=False)

        mrefs = [part(x, 0, main, True) for x in refs] + [anchor(C8, r + 2)]
        (lt,) = self.generic(
            (*kept, C8, L), [r], mrefs, [(acc, self.filled((*kept, L), acc, init))], body
        )
        lanes_ref = Ref(acc, (*kept, L), lt)
        refs_f = [lanes_ref]
        if C > main:  # the tail continues lane 0, in order
            l0 = self.materialize(lanes_ref.view(kept, lambda e: [*e, _c(0)]))
            trefs = [part(x, main, C - main, False) for x in refs] + [anchor(C - main, r + 1)]
            (t0,) = self.generic((*kept, C - main), [r], trefs, [(acc, l0)], body)
            refs_f.append(Ref(acc, (*kept, L), t0, lambda e: e[:r]))

        # the lanes folded in order from init: a reduction generic (an elementwise one would be
        # fused into, and recomputed by, every consumer)
        def fold(idx: list, v: ir.Value, *rest: ir.Value) -> list[ir.Value]:
            if len(rest) == 2:  # lane 0 is the tail's result
                z0 = arith.constant(ir.IndexType.get(), 0)
                z = arith.cmpi(arith.CmpIPredicate.eq, idx[r], z0)
                v = arith.select(z, rest[0], v)
            return [combine(v, rest[-1])]

        (t,) = self.generic(
            (*kept, L), [r], refs_f, [(acc, self.filled(kept, acc, init))], fold, True
        )
        return Ref(acc, kept, t)

    def bcast(self, r: Ref, shape: tuple[int, ...]) -> Ref:
        if r.shape == shape:
            return r
        rank, k = len(shape), len(r.shape)
        if k > rank or any(a != b and a != 1 for a, b in zip(r.shape, shape[rank - k :])):
            raise LoweringError(f"cannot broadcast {r.shape} to {shape}")
        src = r.shape
        return r.view(
            shape,
            lambda e: [
                _c(0) if src[i] == 1 and shape[rank - k + i] != 1 else e[rank - k + i]
                for i in range(k)
            ],
        )

    def kd(self, r: Ref, shape: Sequence[int]) -> Ref:
        """Row statistics r (shape[:-1]) read along the last dim of `shape`."""
        shape = tuple(shape)
        if r.shape != shape[:-1]:
            raise LoweringError(f"row statistics of shape {r.shape} for rows {shape}")
        return r.view(shape, lambda e: list(e[:-1]))

    def cast_ref(self, r: Ref, dtype: str) -> Ref:
        if r.dtype == dtype:
            return r
        if r.const is not None:
            return Ref(dtype, r.shape, const=r.const, index=r.index)
        return self.ew(r.shape, dtype, [r], lambda x: S.cast(x, r.dtype, dtype))

    # ---- nodes ------------------------------------------------------------------------------
    def val(self, i: int) -> Ref:
        return self.env[i]

    def out(self, n: Node, k: int = 0) -> tuple[tuple[int, ...], str]:
        v = self.g.values[n.outputs[k]]
        return v.shape, v.dtype

    def lower(self, n: Node) -> None:
        op = n.op
        fn = getattr(self, "op_" + op, None)
        if fn is not None:
            res = fn(n)
        elif op in UNARY:
            res = self.unary(n)
        elif op in BINARY:
            res = self.binary(n)
        else:
            raise LoweringError(f"no lowering for op {op!r}")
        if isinstance(res, Ref):
            res = [res]
        for o, r in zip(n.outputs, res):
            self.env[o] = r

    def unary(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        x = self.val(n.inputs[0])
        cd = S.compute_dtype(x.dtype)
        op = n.op
        return self.ew(
            shape,
            dt,
            [x],
            lambda a: (
                S.cast(
                    S.unary(op, S.cast(a, x.dtype, cd), cd), cd if op != "logical_not" else cd, dt
                )
                if op != "logical_not"
                else S.cmp("eq", a, S.const(x.dtype, 0), x.dtype)
            ),
        )

    def binary(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        a, b = self.val(n.inputs[0]), self.val(n.inputs[1])
        cd = S.compute_dtype(a.dtype)
        op = {"and": "logical_and", "or": "logical_or"}.get(n.op, n.op)

        def f(x: ir.Value, y: ir.Value) -> ir.Value:
            x, y = S.cast(x, a.dtype, cd), S.cast(y, b.dtype, cd)
            if op in ("eq", "ne", "lt", "le", "gt", "ge"):
                return S.cmp(op, x, y, cd)
            if op in ("logical_and", "logical_or"):
                xb, yb = S.cast(x, cd, "bool"), S.cast(y, cd, "bool")
                return arith.andi(xb, yb) if op == "logical_and" else arith.ori(xb, yb)
            if op == "pow":
                if not S.is_float(cd):
                    raise LoweringError("integer pow")
                from mlir.dialects import math as m

                r = m.powf(x, y)
            else:
                r = getattr(S, op)(x, y, cd)
            return S.cast(r, cd, dt)

        return self.ew(shape, dt, [a, b], f)

    def op_full(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        v = n.attrs["value"]
        return Ref(dt, shape, const=(v if S.is_float(dt) else int(v)), identity=False)

    def op_arange(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        start, step = n.attrs["start"], n.attrs["step"]
        if self.cpu and dt in _INT_NP and 0 < shape[0] <= IOTA_MAX:
            vals = int(start) + int(step) * np.arange(shape[0], dtype=np.int64)
            return Ref(dt, shape, self.const_tensor(vals.astype(_INT_NP[dt])), identity=False)
        return Ref(dt, shape, iota=(start, step), identity=False)

    # Note [positions as operands]: on the CPU an integer arange (the causal mask's positions)
    # is a constant int tensor, an operand read through its index map like any other, not the
    # loop's index cast to an integer: affine-super-vectorize does not vectorise a loop that
    # uses its index as a value, and LLVM's vectoriser did not take those nests either, so the
    # attention softmax fused with its mask ran scalar, exp included (LLaMA tiny: 0.54 ms a
    # call, 0.13 ms with the operand). Same integers, no arithmetic changes. Up to IOTA_MAX
    # positions. Cross-entropy's backward keeps comparing its column index with the target:
    # LLVM vectorises that loop itself at full width, faster than 8-wide masked MLIR vectors.
    def const_tensor(self, vals: np.ndarray) -> ir.Value:
        """A constant 1-D integer tensor (a memref.global once bufferized)."""
        t = ir.RankedTensorType.get([len(vals)], S.mlir_type(_NP_INT[vals.dtype.str]))
        attr = ir.DenseElementsAttr.get(np.ascontiguousarray(vals), type=t.element_type)
        return arith.ConstantOp(t, attr).result

    def op_astype(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        x = self.val(n.inputs[0])
        if x.dtype == dt:
            return x
        return self.ew(shape, dt, [x], lambda a: S.cast(a, x.dtype, dt))

    op_contiguous = op_astype
    op_clone = op_astype

    def op_where(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        c, a, b = (self.val(i) for i in n.inputs)
        return self.ew(
            shape,
            dt,
            [c, a, b],
            lambda x, y, z: arith.select(
                S.cast(x, c.dtype, "bool"), S.cast(y, a.dtype, dt), S.cast(z, b.dtype, dt)
            ),
        )

    def op_masked_fill(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        x, m = self.val(n.inputs[0]), self.val(n.inputs[1])
        v = n.attrs["value"]
        return self.ew(
            shape,
            dt,
            [x, m],
            lambda a, b: arith.select(
                S.cast(b, m.dtype, "bool"), S.const(dt, v if S.is_float(dt) else int(v)), a
            ),
        )

    def op_copy_(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        src = self.val(n.inputs[1])
        return self.cast_ref(self.bcast(src, shape), dt)

    def op_cat(self, n: Node) -> Ref:
        """Each element picks its input by its index along `dim` (gathers from the inputs,
        materialised once): a cat fuses with what follows it."""
        shape, dt = self.out(n)
        d = norm_dim(n.attrs["dim"], len(shape))
        parts = [self.val(i) for i in n.inputs]
        tens = [self.materialize(r) for r in parts]
        sizes = [r.shape[d] for r in parts]
        idx_t = ir.IndexType.get()

        def f(idx: list) -> ir.Value:
            pos = idx[d]
            val = None
            start = sum(sizes)
            for k in range(len(parts) - 1, -1, -1):
                start -= sizes[k]
                local = arith.subi(pos, arith.constant(idx_t, start)) if start else pos
                hi = arith.constant(idx_t, sizes[k] - 1)
                lo = arith.constant(idx_t, 0)
                clamped = arith.maxsi(lo, arith.minsi(local, hi))  # never out of bounds
                ii = list(idx)
                ii[d] = clamped
                v = S.cast(_ld(tensor.extract(tens[k], ii), parts[k].dtype), parts[k].dtype, dt)
                if val is None:
                    val = v
                else:
                    inside = arith.cmpi(
                        arith.CmpIPredicate.slt, pos, arith.constant(idx_t, start + sizes[k])
                    )
                    val = arith.select(inside, v, val)
            return val

        return self.ew(shape, dt, [], f, with_index=True)

    # ---- gradients and the optimizer (capture's mutating ops, as pure functions) -------------
    def op_accumulate_grad(self, n: Node) -> Ref:
        """inputs leaf, grad[, prev]: the leaf's new .grad (prev + grad, or grad)."""
        shape, dt = self.out(n)
        g = self.val(n.inputs[1])
        if len(n.inputs) > 2 and n.inputs[2] >= 0:
            prev = self.val(n.inputs[2])
            cd = S.compute_dtype(dt)
            return self.ew(
                shape,
                dt,
                [prev, g],
                lambda a, b: S.cast(
                    S.add(S.cast(a, prev.dtype, cd), S.cast(b, g.dtype, cd), cd), cd, dt
                ),
            )
        return self.cast_ref(self.bcast(g, tuple(shape)), dt)

    def op_adamw_(self, n: Node) -> list[Ref]:
        """cpu/optim.cpp's AdamW, operation for operation: scalars in double from (lr, step),
        rounded to the math type; the update in float (double for float64 parameters)."""
        a = n.attrs
        k = int(a["n"])
        copies = bool(a.get("has_copies"))
        ins = list(n.inputs)
        P, G, M, V = ins[:k], ins[k : 2 * k], ins[2 * k : 3 * k], ins[3 * k : 4 * k]
        j = 5 * k if copies else 4 * k
        lr_i = ins[j] if a.get("has_lr") else -1
        j += 1 if a.get("has_lr") else 0
        st_i = ins[j] if a.get("has_step") else -1
        j += 1 if a.get("has_step") else 0
        sc_i = ins[j] if a.get("has_scale") else -1
        D = "float64"
        b1, b2, eps = float(a["beta1"]), float(a["beta2"]), float(a["eps"])
        wds = list(a["weight_decays"])

        def scalar_in(i: int, default: float) -> Ref:
            if i < 0:
                return Ref(D, (), const=float(default), identity=False)
            r = self.val(i)
            return r.view((), lambda e: [_c(0)] * len(r.shape)) if r.shape else r

        lr, step = scalar_in(lr_i, a.get("lr", 0.0)), scalar_in(st_i, a.get("step", 0))
        scale = scalar_in(sc_i, 1.0) if sc_i >= 0 else None
        outs_p, outs_m, outs_v, outs_c = [], [], [], []
        for t in range(k):
            p, g, m, v = (self.val(x) for x in (P[t], G[t], M[t], V[t]))
            T_, Mt = p.dtype, S.compute_dtype(p.dtype)
            Sd = m.dtype
            wd = float(wds[t])
            refs = [p, g, m, v, self.bcast(lr, p.shape), self.bcast(step, p.shape)]
            if scale is not None:
                refs.append(self.bcast(scale, p.shape))

            def scal(lrv: ir.Value, stv: ir.Value, wd: float = wd, Mt: str = Mt) -> tuple:
                from mlir.dialects import math as m_

                lr64 = S.cast(lrv, lr.dtype, D)
                st64 = S.cast(stv, step.dtype, D)
                bias1 = arith.subf(S.const(D, 1.0), m_.powf(S.const(D, b1), st64))
                b2s = m_.sqrt(arith.subf(S.const(D, 1.0), m_.powf(S.const(D, b2), st64)))
                step_size = S.cast(arith.divf(lr64, bias1), D, Mt)
                dfac = S.cast(arith.subf(S.const(D, 1.0), arith.mulf(lr64, S.const(D, wd))), D, Mt)
                return step_size, S.cast(b2s, D, Mt), dfac

            def upd(
                pv, gv, mv, vv, lrv, stv, *sc, T_=T_, Mt=Mt, Sd=Sd, wd=wd, gdt=g.dtype, which=0
            ):
                step_size, b2s, dfac = scal(lrv, stv, wd, Mt)
                pj, gj = S.cast(pv, T_, Mt), S.cast(gv, gdt, Mt)
                if sc:
                    gj = arith.mulf(gj, S.cast(sc[0], scale.dtype, Mt))
                if wd != 0:
                    pj = arith.mulf(pj, dfac)
                mj, vj = S.cast(mv, Sd, Mt), S.cast(vv, Sd, Mt)
                mj = arith.addf(mj, arith.mulf(arith.subf(gj, mj), S.const(Mt, 1.0 - b1)))
                vj = arith.addf(
                    arith.mulf(vj, S.const(Mt, b2)),
                    arith.mulf(arith.mulf(gj, gj), S.const(Mt, 1.0 - b2)),
                )
                if which == 1:
                    return S.cast(mj, Mt, Sd)
                if which == 2:
                    return S.cast(vj, Mt, Sd)
                from mlir.dialects import math as m_

                denom = arith.addf(arith.divf(m_.sqrt(vj), b2s), S.const(Mt, eps))
                pj = arith.subf(pj, arith.mulf(arith.divf(mj, denom), step_size))
                return S.cast(pj, Mt, T_)

            outs_p.append(self.ew(p.shape, T_, refs, upd))
            outs_m.append(self.ew(p.shape, Sd, refs, lambda *q, u=upd: u(*q, which=1)))
            outs_v.append(self.ew(p.shape, Sd, refs, lambda *q, u=upd: u(*q, which=2)))
        if copies:
            for t in range(k):
                cdt = self.g.values[ins[4 * k + t]].dtype
                outs_c.append(self.cast_ref(outs_p[t], cdt))
        return outs_p + outs_m + outs_v + outs_c

    OPTIM_CHUNK = 4096  # blutrain-tensor's kOptimChunk (src/optim.h): elements per partial sum

    def op_adamw_scalars(self, n: Node) -> list[Ref]:
        """(lr / bias1, sqrt(bias2), lr) in float64 from the device scalars, once per step."""
        from mlir.dialects import math as m_

        D = "float64"
        a = n.attrs

        def scalar_in(i: int, default: float) -> Ref:
            if i < 0:
                return Ref(D, (), const=float(default), identity=False)
            r = self.val(i)
            return r.view((), lambda e: [_c(0)] * len(r.shape)) if r.shape else r

        lr = scalar_in(n.inputs[0], a["lr"])
        st = scalar_in(n.inputs[1], a["step"])
        b1, b2 = float(a["beta1"]), float(a["beta2"])

        def step_size(lv: ir.Value, sv: ir.Value) -> ir.Value:
            bias1 = arith.subf(S.const(D, 1.0), m_.powf(S.const(D, b1), S.cast(sv, st.dtype, D)))
            return arith.divf(S.cast(lv, lr.dtype, D), bias1)

        def b2s(sv: ir.Value) -> ir.Value:
            return m_.sqrt(
                arith.subf(S.const(D, 1.0), m_.powf(S.const(D, b2), S.cast(sv, st.dtype, D)))
            )

        return [
            self.ew((), D, [lr, st], step_size),
            self.ew((), D, [st], b2s),
            self.ew((), D, [lr], lambda lv: S.cast(lv, lr.dtype, D)),
        ]

    def op_adamw_update(self, n: Node) -> list[Ref]:
        """One tensor of cpu/optim.cpp's AdamW: p, g, m, v, (lr / bias1, sqrt(bias2), lr),
        [grad scale], [16-bit copy] -> p', m', v', [copy']."""
        a = n.attrs
        p, g, m, v, s1, s2, s3 = (self.val(i) for i in n.inputs[:7])
        sc_i = n.inputs[7]
        scale = self.val(sc_i) if sc_i >= 0 else None
        D = "float64"
        T_, Mt, Sd = p.dtype, S.compute_dtype(p.dtype), m.dtype
        b1, b2, eps, wd = (float(a[k]) for k in ("beta1", "beta2", "eps", "weight_decay"))

        def zero_d(r: Ref) -> Ref:
            r0 = r.view((), lambda e: [_c(0)] * len(r.shape)) if r.shape else r
            return self.bcast(r0, p.shape)

        refs = [p, g, m, v, zero_d(s1), zero_d(s2), zero_d(s3)]
        if scale is not None:
            refs.append(zero_d(scale))

        def upd(pv, gv, mv, vv, ss, bs, lv, *sc, which=0):
            step_size, b2s = S.cast(ss, D, Mt), S.cast(bs, D, Mt)
            pj, gj = S.cast(pv, T_, Mt), S.cast(gv, g.dtype, Mt)
            if sc:
                gj = arith.mulf(gj, S.cast(sc[0], scale.dtype, Mt))
            if wd != 0:
                dfac = S.cast(arith.subf(S.const(D, 1.0), arith.mulf(lv, S.const(D, wd))), D, Mt)
                pj = arith.mulf(pj, dfac)
            mj, vj = S.cast(mv, Sd, Mt), S.cast(vv, Sd, Mt)
            mj = arith.addf(mj, arith.mulf(arith.subf(gj, mj), S.const(Mt, 1.0 - b1)))
            vj = arith.addf(
                arith.mulf(vj, S.const(Mt, b2)),
                arith.mulf(arith.mulf(gj, gj), S.const(Mt, 1.0 - b2)),
            )
            if which == 1:
                return S.cast(mj, Mt, Sd)
            if which == 2:
                return S.cast(vj, Mt, Sd)
            from mlir.dialects import math as m_

            denom = arith.addf(arith.divf(m_.sqrt(vj), b2s), S.const(Mt, eps))
            pj = arith.subf(pj, arith.mulf(arith.divf(mj, denom), step_size))
            return S.cast(pj, Mt, T_)

        outs = [
            self.ew(p.shape, T_, refs, upd),
            self.ew(p.shape, Sd, refs, lambda *q: upd(*q, which=1)),
            self.ew(p.shape, Sd, refs, lambda *q: upd(*q, which=2)),
        ]
        if a.get("has_copy"):
            cdt = self.g.values[n.outputs[3]].dtype
            outs.append(self.cast_ref(outs[0], cdt))
        return outs

    def op_sumsq(self, n: Node) -> Ref:
        """One tensor's part of grad_norm: chunk partials in the compute type, summed in
        float64 in order (eager's GradNorm)."""
        return self._sumsq(self.val(n.inputs[0]))

    def op_sqrt_sum(self, n: Node) -> Ref:
        from mlir.dialects import math as m_

        shape, dt = self.out(n)
        D = "float64"
        tot = None
        for i in n.inputs:
            r = self.val(i)
            tot = r if tot is None else self.ew((), D, [tot, r], lambda p_, q: arith.addf(p_, q))
        if tot is None:
            tot = Ref(D, (), const=0.0, identity=False)
        return self.ew((), dt, [tot], lambda t_: S.cast(m_.sqrt(t_), D, dt))

    def op_grad_norm(self, n: Node) -> Ref:
        """cpu/optim.cpp's GradNorm (a single tensor, or before decomposition)."""
        from mlir.dialects import math as m_

        shape, dt = self.out(n)
        D = "float64"
        tot = None
        for i in n.inputs:
            r = self._sumsq(self.val(i))
            tot = r if tot is None else self.ew((), D, [tot, r], lambda p_, q: arith.addf(p_, q))
        if tot is None:
            tot = Ref(D, (), const=0.0, identity=False)
        return self.ew((), dt, [tot], lambda t_: S.cast(m_.sqrt(t_), D, dt))

    def _sumsq(self, x: Ref) -> Ref:
        """Sum of squares in eager's order: partials over chunks of OPTIM_CHUNK elements in the
        compute type, summed in float64 in order. The full chunks are a (chunks, OPTIM_CHUNK)
        view of the flat tensor and the tail a slice of it (no copies)."""
        D = "float64"
        K = self.OPTIM_CHUNK
        cd = S.compute_dtype(x.dtype)
        numel = math.prod(x.shape)
        if numel == 0:
            return Ref(D, (), const=0.0, identity=False)
        xt = self.materialize(x)
        flat = (
            self._reshape_tensor(xt, x.shape, (numel,), x.dtype)
            if tuple(x.shape) != (numel,)
            else xt
        )
        nfull, rem = divmod(numel, K)

        def sq(v: ir.Value) -> ir.Value:
            w = S.cast(v, x.dtype, cd)
            return arith.mulf(w, w)

        def part(t: ir.Value, shape: tuple[int, ...]) -> Ref:
            return self.reduce(
                shape,
                [len(shape) - 1],
                cd,
                0.0,
                [Ref(x.dtype, shape, t)],
                sq,
                lambda p_, q: arith.addf(q, p_),
            )

        et = S.storage_type(x.dtype)
        dense = ir.DenseI64ArrayAttr.get
        tot = None
        if nfull:
            body = (
                flat
                if rem == 0
                else tensor.ExtractSliceOp(
                    ir.RankedTensorType.get([nfull * K], et),
                    flat,
                    [],
                    [],
                    [],
                    dense([0]),
                    dense([nfull * K]),
                    dense([1]),
                ).result
            )
            W = self.SUMSQ_GROUP
            groups = nfull // W if self.cpu and not self.flat else 0
            if groups:
                tot = self._sumsq_side_by_side(body, nfull, groups, x.dtype, cd, sq)
            else:
                ps = part(self._reshape_tensor(body, (nfull * K,), (nfull, K), x.dtype), (nfull, K))
                tot = self.reduce(
                    (nfull,),
                    [0],
                    D,
                    0.0,
                    [ps],
                    lambda v: S.cast(v, cd, D),
                    lambda p_, q: arith.addf(q, p_),
                )
        if rem:
            tail = tensor.ExtractSliceOp(
                ir.RankedTensorType.get([rem], et),
                flat,
                [],
                [],
                [],
                dense([nfull * K]),
                dense([rem]),
                dense([1]),
            ).result
            pt = self.ew((), D, [part(tail, (rem,))], lambda v: S.cast(v, cd, D))
            tot = pt if tot is None else self.ew((), D, [tot, pt], lambda p_, q: arith.addf(p_, q))
        return tot

    # Note [chunk sums side by side]: each OPTIM_CHUNK chunk's sum of squares is one chain of
    # dependent float adds (eager's order, kept). Looped chunk after chunk, the CPU waits out
    # every add's latency (a 6.4M-element embedding gradient: ~9 ms at one thread, eager 2-3);
    # eager's GradNorm runs SUMSQ_GROUP chunks side by side (sum_squares<8>), so the chains
    # overlap. Here likewise: a (groups, OPTIM_CHUNK, SUMSQ_GROUP) generic whose innermost loop
    # steps across the chunks of a group, each with its own accumulator; every chunk's sum keeps
    # its order, so the partials, and their float64 sum in chunk order, are the same numbers.
    # Chunks that do not fill a group are summed one after another, continuing that sum. CPU
    # only (the GPU's row kernels map reductions themselves).
    SUMSQ_GROUP = 8  # chunks summed side by side (blutrain-tensor's GradNorm kGroup)

    def _sumsq_side_by_side(
        self,
        body: ir.Value,
        nfull: int,
        groups: int,
        dtype: str,
        cd: str,
        sq: Callable[[ir.Value], ir.Value],
    ) -> Ref:
        """The float64 sum, in chunk order, of the partial sums of squares of the nfull whole
        chunks of `body` (1-D, nfull * OPTIM_CHUNK elements), groups of SUMSQ_GROUP chunks side
        by side (Note [chunk sums side by side])."""
        D, K, W = "float64", self.OPTIM_CHUNK, self.SUMSQ_GROUP
        et = S.storage_type(dtype)
        dense = ir.DenseI64ArrayAttr.get

        def piece(start: int, count: int) -> ir.Value:
            """Chunks [start, start + count) of body, as a (count * K,) tensor."""
            if start == 0 and count == nfull:
                return body
            return tensor.ExtractSliceOp(
                ir.RankedTensorType.get([count * K], et),
                body,
                [],
                [],
                [],
                dense([start * K]),
                dense([count * K]),
                dense([1]),
            ).result

        g3 = self._reshape_tensor(piece(0, groups * W), (groups * W * K,), (groups, W, K), dtype)
        src = Ref(dtype, (groups, W, K), g3).view((groups, K, W), lambda e: [e[0], e[2], e[1]])
        (pt,) = self.generic(
            (groups, K, W),
            [1],
            [src],
            [(cd, self.filled((groups, W), cd, 0.0))],
            lambda v, acc: [arith.addf(acc, sq(v))],
        )
        tot = self.reduce(
            (groups, W),
            [0, 1],
            D,
            0.0,
            [Ref(cd, (groups, W), pt)],
            lambda v: S.cast(v, cd, D),
            lambda p_, q: arith.addf(q, p_),
        )
        rest = nfull - groups * W
        if rest:
            r2 = self._reshape_tensor(piece(groups * W, rest), (rest * K,), (rest, K), dtype)
            pr = self.reduce(
                (rest, K),
                [1],
                cd,
                0.0,
                [Ref(dtype, (rest, K), r2)],
                sq,
                lambda p_, q: arith.addf(q, p_),
            )
            (tt,) = self.generic(
                (rest,),
                [0],
                [pr],
                [(D, self.materialize(tot))],
                lambda v, acc: [arith.addf(acc, S.cast(v, cd, D))],
            )
            tot = Ref(D, (), tt)
        return tot

    def op_clip_coef(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        x = self.val(n.inputs[0])
        mx, eps = float(n.attrs["max_norm"]), float(n.attrs.get("eps", 1e-6))
        F = "float32"

        def f(v: ir.Value) -> ir.Value:
            nrm = S.cast(v, x.dtype, F)
            c = arith.divf(S.const(F, mx), arith.addf(nrm, S.const(F, eps)))
            keep = arith.ori(
                S.cmp("lt", c, S.const(F, 1.0), F), arith.cmpf(arith.CmpFPredicate.UNO, c, c)
            )
            return S.cast(arith.select(keep, c, S.const(F, 1.0)), F, dt)

        return self.ew(shape, dt, [x], f)

    def op_scale_(self, n: Node) -> list[Ref]:
        ins = list(n.inputs)
        coef = self.val(ins[-1])
        out = []
        for i in ins[:-1]:
            x = self.val(i)
            cd = S.compute_dtype(x.dtype)
            c0 = coef.view((), lambda e: [_c(0)] * len(coef.shape)) if coef.shape else coef
            out.append(
                self.ew(
                    x.shape,
                    x.dtype,
                    [x, self.bcast(c0, x.shape)],
                    lambda a, c, x=x, cd=cd: S.cast(
                        arith.mulf(S.cast(a, x.dtype, cd), S.cast(c, coef.dtype, cd)), cd, x.dtype
                    ),
                )
            )
        return out

    # ---- views ------------------------------------------------------------------------------
    def op_reshape(self, n: Node) -> Ref:
        shape, _ = self.out(n)
        x = self.val(n.inputs[0])
        src = x.shape
        if x.tensor is not None and x.identity and tuple(shape) != tuple(src):
            # a contiguous tensor: tensor.collapse_shape / expand_shape (free after
            # bufferization; upstream fusion propagates them), so loop bounds stay plain dims
            return Ref(
                x.dtype, tuple(shape), self._reshape_tensor(x.tensor, src, tuple(shape), x.dtype)
            )
        if tuple(s for s in src if s != 1) == tuple(s for s in shape if s != 1):
            # only unit dims change: a direct map (no div / mod)
            nz = [i for i, s in enumerate(shape) if s != 1]
            return x.view(shape, lambda e: _regroup(e, nz, src))
        return x.view(shape, lambda e: _reshape_index(e, tuple(shape), tuple(src)))

    op_view = op_reshape
    op_squeeze = op_reshape
    op_unsqueeze = op_reshape

    def _reshape_tensor(
        self, t: ir.Value, src: tuple[int, ...], dst: tuple[int, ...], dtype: str
    ) -> ir.Value:
        et = S.storage_type(dtype)

        def reassoc(n: int) -> ir.ArrayAttr:
            i64 = ir.IntegerType.get_signless(64)
            return ir.ArrayAttr.get(
                [ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in range(n)])] if n else []
            )

        flat = t
        n = math.prod(src)
        if len(src) != 1:
            ft = ir.RankedTensorType.get([n] if src else [], et)
            flat = (
                tensor.CollapseShapeOp(ft, t, reassoc(len(src))).result
                if src
                else tensor.ExpandShapeOp(
                    ir.RankedTensorType.get([1], et), t, ir.ArrayAttr.get([]), [], [1]
                ).result
            )
        if len(dst) == 1:
            return flat
        out_t = ir.RankedTensorType.get(list(dst), et)
        if not dst:
            return tensor.CollapseShapeOp(out_t, flat, ir.ArrayAttr.get([])).result
        return tensor.ExpandShapeOp(out_t, flat, reassoc(len(dst)), [], list(dst)).result

    def op_permute(self, n: Node) -> Ref:
        shape, _ = self.out(n)
        perm = [norm_dim(p, len(shape)) for p in n.attrs["perm"]]
        inv = [0] * len(perm)
        for i, p in enumerate(perm):
            inv[p] = i
        return self.val(n.inputs[0]).view(shape, lambda e: [e[inv[j]] for j in range(len(perm))])

    def op_expand(self, n: Node) -> Ref:
        shape, _ = self.out(n)
        return self.bcast(self.val(n.inputs[0]), tuple(shape))

    def op_slice(self, n: Node) -> Ref:
        """tensor.extract_slice (a subview after bufferization, no copy): an index map d + start
        would let linalg take the sliced dim's size from the unsliced operand."""
        shape, _ = self.out(n)
        x = self.val(n.inputs[0])
        d = norm_dim(n.attrs["dim"], len(shape))
        start, step = n.attrs["start"], n.attrs.get("step", 1)
        if tuple(shape) == tuple(x.shape):
            return x
        t = x.tensor if x.tensor is not None and x.identity else self.materialize(x)
        rank = len(x.shape)
        offs = [start if i == d else 0 for i in range(rank)]
        strides = [step if i == d else 1 for i in range(rank)]
        rt = ir.RankedTensorType.get(list(shape), S.storage_type(x.dtype))
        dense = ir.DenseI64ArrayAttr.get
        sl = tensor.ExtractSliceOp(
            rt, t, [], [], [], dense(offs), dense(list(shape)), dense(strides)
        ).result
        return Ref(x.dtype, tuple(shape), sl)

    def op_slice_scatter(self, n: Node) -> Ref:
        """base with src written over base[..., start:stop:step, ...] (a slice's backward:
        GPT-2's logits gradient into its vocabulary padding's zeros), as tensor.insert_slice.

        Note [slice_scatter in the kernel]: eager fills a padded buffer, then copies the
        gradient into its slice. Fused, the kernel that computes src writes it straight into the
        result's slice (BUFFERIZE_CPU's eliminate-empty-tensors turns src's empty init into that
        slice) after the base's values: no copy, no separate buffer for src, the same values. CPU
        only: the GPU's row kernels do not take insert_slice."""
        if not self.cpu:
            raise LoweringError("slice_scatter is lowered for the CPU only")
        shape, dt = self.out(n)
        base, src = self.val(n.inputs[0]), self.val(n.inputs[1])
        a = n.attrs
        rank = len(shape)
        d = norm_dim(a["dim"], rank)
        step = int(a.get("step", 1) or 1)
        start = int(a["start"])
        start = start + shape[d] if start < 0 else start
        if step <= 0 or tuple(base.shape) != tuple(shape) or len(src.shape) != rank:
            raise LoweringError(f"slice_scatter of {src.shape} into {base.shape} step {step}")
        # both through a generic of their own (fused into src's producer by FUSE): an input or
        # a view inserted as it is would bufferize to memref.copy, which lowers to a runtime call
        # (memrefCopy) the JIT does not have
        b = self.ew(shape, dt, [self.cast_ref(base, dt)], lambda v: v).tensor
        t = self.ew(tuple(src.shape), dt, [self.cast_ref(src, dt)], lambda v: v).tensor
        dense = ir.DenseI64ArrayAttr.get
        offs = [start if i == d else 0 for i in range(rank)]
        strides = [step if i == d else 1 for i in range(rank)]
        r = tensor.InsertSliceOp(
            t, b, [], [], [], dense(offs), dense(list(src.shape)), dense(strides)
        ).result
        return Ref(dt, tuple(shape), r)

    def op_select(self, n: Node) -> Ref:
        shape, _ = self.out(n)
        x = self.val(n.inputs[0])
        d = norm_dim(n.attrs["dim"], len(x.shape))
        idx = n.attrs["index"]
        idx = idx + x.shape[d] if idx < 0 else idx
        return x.view(shape, lambda e: list(e[:d]) + [_c(idx)] + list(e[d:]))

    # ---- reductions -------------------------------------------------------------------------
    def _red_dims(self, n: Node, rank: int) -> list[int]:
        dims = n.attrs.get("dims", n.attrs.get("dim"))
        if dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0):
            return list(range(rank))
        if isinstance(dims, int):
            dims = [dims]
        return sorted({norm_dim(d, rank) for d in dims})

    def _keep(self, r: Ref, n: Node) -> Ref:
        shape, _ = self.out(n)
        if r.shape == tuple(shape):
            return r
        return r.view(
            shape, lambda e: _regroup(e, [i for i, s in enumerate(shape) if s != 1], r.shape)
        )

    def op_sum(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        x = self.val(n.inputs[0])
        dims = self._red_dims(n, len(x.shape))
        acc = "float64" if S.is_float(dt) else "int64"
        r = self.reduce(
            x.shape,
            dims,
            acc,
            0,
            [x],
            lambda a: S.cast(a, x.dtype, acc),
            lambda a, b: S.add(a, b, acc),
        )
        if n.op == "mean":
            cnt = math.prod(x.shape[d] for d in dims)
            r = self.ew(r.shape, acc, [r], lambda a: arith.divf(a, S.const(acc, float(cnt))))
        return self._keep(self.cast_ref(r, dt), n)

    op_mean = op_sum

    def op_max(self, n: Node) -> Ref:
        shape, dt = self.out(n)
        x = self.val(n.inputs[0])
        dims = self._red_dims(n, len(x.shape))
        cd = S.compute_dtype(dt)
        is_max = n.op in ("max", "amax")
        if S.is_float(cd):
            init = -math.inf if is_max else math.inf
        else:
            info = {"int64": 2**63, "int32": 2**31, "uint8": 0, "bool": 0}[cd]
            init = (
                (-info if is_max else info - 1)
                if cd not in ("uint8", "bool")
                else (0 if is_max else (255 if cd == "uint8" else 1))
            )
        comb = (lambda a, b: S.maximum(a, b, cd)) if is_max else (lambda a, b: S.minimum(a, b, cd))
        r = self.reduce(x.shape, dims, cd, init, [x], lambda a: S.cast(a, x.dtype, cd), comb)
        return self._keep(self.cast_ref(r, dt), n)

    op_min = op_max
    op_amax = op_max
    op_amin = op_max

    # ---- composites: norms and losses (row formulas of cpu/nn.cpp, cpu/nn_fused.cpp) ----------
    def _rows(self, x: Ref) -> tuple[int, int]:
        C = x.shape[-1] if x.shape else 1
        return (math.prod(x.shape) // C if C else 0), C

    def op_softmax(self, n: Node) -> Ref:
        x = self.val(n.inputs[0])
        rank = len(x.shape)
        if norm_dim(n.attrs.get("dim", -1), rank) != rank - 1:
            raise LoweringError("softmax over a dim other than the last")
        log = n.op == "log_softmax"
        dt = x.dtype
        A = S.compute_dtype(dt)  # float32 for 16/32-bit, float64 for float64
        last = [rank - 1]
        m = self.reduce(
            x.shape,
            last,
            A,
            -math.inf,
            [x],
            lambda a: S.cast(a, dt, A),
            lambda a, b: S.maximum(a, b, A),
            lanes=MAX_LANES,
        )
        # an all -inf row: m = 0 (softmax gives nan, log_softmax -inf), as eager
        m = self.ew(
            m.shape,
            A,
            [m],
            lambda a: arith.select(S.cmp("eq", a, S.const(A, -math.inf), A), S.const(A, 0.0), a),
        )
        s = self.reduce(
            x.shape,
            last,
            "float64",
            0.0,
            [x, self.kd(m, x.shape)],
            lambda a, mm: S.cast(S.exp(arith.subf(S.cast(a, dt, A), mm), A), A, "float64"),
            lambda a, b: arith.addf(a, b),
            lanes=LANES,
        )
        if log and self.cpu:  # (x - m) - log(s), as eager's softmax_row_out: m + log(s)
            # first would round log(s) away for a large m
            lg = self.ew(m.shape, A, [s], lambda ss: S.cast(_log64(ss), "float64", A))
            return self.ew(
                x.shape,
                dt,
                [x, self.kd(m, x.shape), self.kd(lg, x.shape)],
                lambda a, mm, ll: S.cast(arith.subf(arith.subf(S.cast(a, dt, A), mm), ll), A, dt),
            )
        if log:
            lse = self.ew(
                m.shape, A, [m, s], lambda mm, ss: arith.addf(mm, S.cast(_log64(ss), "float64", A))
            )
            return self.ew(
                x.shape,
                dt,
                [x, self.kd(lse, x.shape)],
                lambda a, ls: S.cast(arith.subf(S.cast(a, dt, A), ls), A, dt),
            )
        inv = self.ew(
            s.shape,
            A,
            [s],
            lambda ss: S.cast(arith.divf(S.const("float64", 1.0), ss), "float64", A),
        )
        return self.ew(
            x.shape,
            dt,
            [x, self.kd(m, x.shape), self.kd(inv, x.shape)],
            lambda a, mm, iv: S.cast(
                arith.mulf(S.exp(arith.subf(S.cast(a, dt, A), mm), A), iv), A, dt
            ),
        )

    op_log_softmax = op_softmax

    def op_softmax_backward(self, n: Node) -> Ref:
        y, dy = self.val(n.inputs[0]), self.val(n.inputs[1])
        log = n.op == "log_softmax_backward" or bool(n.attrs.get("log", False))
        dt, D = y.dtype, "float64"
        last = [len(y.shape) - 1]
        if log:
            s = self.reduce(
                y.shape,
                last,
                D,
                0.0,
                [dy],
                lambda g: S.cast(g, dt, D),
                lambda a, b: arith.addf(a, b),
                lanes=SUM_LANES,
            )
            return self.ew(
                y.shape,
                dt,
                [y, dy, self.kd(s, y.shape)],
                lambda a, g, ss: S.cast(
                    arith.subf(S.cast(g, dt, D), arith.mulf(self._exp_bwd(a, dt), ss)), D, dt
                ),
            )
        s = self.reduce(
            y.shape,
            last,
            D,
            0.0,
            [y, dy],
            lambda a, g: arith.mulf(S.cast(g, dt, D), S.cast(a, dt, D)),
            lambda a, b: arith.addf(a, b),
            lanes=SUM_LANES,
        )
        return self.ew(
            y.shape,
            dt,
            [y, dy, self.kd(s, y.shape)],
            lambda a, g, ss: S.cast(
                arith.mulf(S.cast(a, dt, D), arith.subf(S.cast(g, dt, D), ss)), D, dt
            ),
        )

    op_log_softmax_backward = op_softmax_backward

    def _exp_bwd(self, a: ir.Value, dt: str) -> ir.Value:
        """exp(a) (a scalar of dtype dt) as a float64, as the log_softmax / cross-entropy
        backward take it: on the CPU, eager's exp_c in the compute type (float's fast_exp, built
        without FMA as nn_fused.cpp is: -ffp-contract=off), then widened; on the GPU, float64's
        exp."""
        if not self.cpu:
            return _exp64(S.cast(a, dt, "float64"))
        A = S.compute_dtype(dt)
        return S.cast(S.exp(S.cast(a, dt, A), A, fma=False), A, "float64")

    def _ln(
        self,
        x: Ref,
        w: Ref | None,
        b: Ref | None,
        eps: float,
        sdt: str,
        ydt: str | None = None,
    ) -> tuple[Ref, Ref, Ref]:
        """y, mean, rstd of x's rows. ydt: y's dtype (x's by default; 16-bit over a float32 x
        is the mixed norm of the float32 residual stream, eager's Note [float32 residual
        stream]: y from the double value, as eager's normalize_row for every pair but float32
        into float32)."""
        dt, D = x.dtype, "float64"
        ydt = ydt or dt
        rank = len(x.shape)
        last = [rank - 1]
        C = float(x.shape[-1])
        # cpu: eager's row_stats sums in SUM_LANES lanes (Note [row reductions in lanes])
        s = self.reduce(
            x.shape,
            last,
            D,
            0.0,
            [x],
            lambda a: S.cast(a, dt, D),
            lambda a, c: arith.addf(a, c),
            lanes=SUM_LANES,
        )
        mean = self.ew(s.shape, D, [s], lambda a: arith.divf(a, S.const(D, C)))
        ss = self.reduce(
            x.shape,
            last,
            D,
            0.0,
            [x, self.kd(mean, x.shape)],
            lambda a, mm: _sq(arith.subf(S.cast(a, dt, D), mm)),
            lambda a, c: arith.addf(a, c),
            lanes=SUM_LANES,
        )
        rstd = self.ew(
            ss.shape,
            D,
            [ss],
            lambda a: arith.divf(
                S.const(D, 1.0), _sqrt64(arith.addf(arith.divf(a, S.const(D, C)), S.const(D, eps)))
            ),
        )
        refs = (
            [x, self.kd(mean, x.shape), self.kd(rstd, x.shape)]
            + ([w] if w else [])
            + ([b] if b else [])
        )

        F = "float32"

        def f32(a: ir.Value, mm: ir.Value, rs: ir.Value, *wb: ir.Value) -> ir.Value:
            # eager's normalize_row for a float32 row into float32 y (Note [float normalize]):
            # float ops, the double mean as hi + lo floats: ((x - hi) - lo) * rs [* w] [+ b]
            hi = S.cast(mm, D, F)
            lo = S.cast(arith.subf(mm, S.cast(hi, F, D)), D, F)
            v = arith.mulf(arith.subf(arith.subf(a, hi), lo), S.cast(rs, D, F))
            k = 0
            if w:
                v = arith.mulf(v, S.cast(wb[k], w.dtype, F))
                k += 1
            if b:
                v = arith.addf(v, S.cast(wb[k], b.dtype, F))
            return v

        def f(a: ir.Value, mm: ir.Value, rs: ir.Value, *wb: ir.Value) -> ir.Value:
            if self.cpu and dt == F and ydt == F:
                return f32(a, mm, rs, *wb)
            v = arith.mulf(arith.subf(S.cast(a, dt, D), mm), rs)
            k = 0
            if w:
                v = arith.mulf(v, S.cast(wb[k], w.dtype, D))
                k += 1
            if b:
                v = arith.addf(v, S.cast(wb[k], b.dtype, D))
            return S.cast(v, D, ydt)

        y = self.ew(x.shape, ydt, refs, f)
        return y, self.cast_ref(mean, sdt), self.cast_ref(rstd, sdt)

    def _opt(self, i: int) -> Ref | None:
        return None if i < 0 else self.val(i)

    def op_layer_norm(self, n: Node) -> list[Ref]:
        x = self.val(n.inputs[0])
        w = self._opt(n.inputs[1]) if len(n.inputs) > 1 else None
        b = self._opt(n.inputs[2]) if len(n.inputs) > 2 else None
        _, ydt = self.out(n, 0)
        _, sdt = self.out(n, 1)
        y, mean, rstd = self._ln(x, w, b, float(n.attrs["eps"]), sdt, ydt)
        return [y, self._keep_as(mean, n, 1), self._keep_as(rstd, n, 2)]

    def _keep_as(self, r: Ref, n: Node, k: int) -> Ref:
        shape, _ = self.out(n, k)
        if r.shape == tuple(shape):
            return r
        if math.prod(r.shape) != math.prod(shape):
            raise LoweringError(f"{n.op}: output {k} shape {shape} vs {r.shape}")
        return r.view(shape, lambda e: _delinear(_linear(e, shape), r.shape))

    def op_add_layer_norm(self, n: Node) -> list[Ref]:
        x, res = self.val(n.inputs[0]), self.val(n.inputs[1])
        w = self._opt(n.inputs[2]) if len(n.inputs) > 2 else None
        b = self._opt(n.inputs[3]) if len(n.inputs) > 3 else None
        rb = self._opt(n.inputs[4]) if len(n.inputs) > 4 else None
        dt = x.dtype
        cd = S.compute_dtype(dt)
        refs = [x, res] + ([rb] if rb else [])

        def f(a: ir.Value, r: ir.Value, *q: ir.Value) -> ir.Value:
            # the residual: x's dtype, or y's 16-bit one over a float32 x (mixed)
            v = arith.addf(S.cast(a, dt, cd), S.cast(r, res.dtype, cd))
            if rb:
                v = arith.addf(v, S.cast(q[0], rb.dtype, cd))
            return S.cast(v, cd, dt)

        s = self.ew(x.shape, dt, refs, f)
        _, ydt = self.out(n, 1)
        _, sdt = self.out(n, 2)
        y, mean, rstd = self._ln(s, w, b, float(n.attrs["eps"]), sdt, ydt)
        return [s, y, self._keep_as(mean, n, 2), self._keep_as(rstd, n, 3)]

    def op_layer_norm_backward(self, n: Node) -> list[Ref]:
        a = n.attrs
        ins = list(n.inputs)
        dy, x = self.val(ins[0]), self.val(ins[1])
        hw = bool(a.get("has_weight", True))
        w = self._opt(ins[2]) if hw else None
        mean, rstd = self.val(ins[3]), self.val(ins[4])
        ex = self._opt(ins[5]) if a.get("has_extra") and len(ins) > 5 else None
        C = x.shape[-1]
        R = math.prod(x.shape) // C
        dt, D = x.dtype, "float64"
        # dx: x's dtype, or dy's 16-bit one over a float32 x (eager's Note [float32 residual
        # stream]: the stream's gradient carried in bf16), from the double value as eager's
        _, dxt = self.out(n, 0)
        # rows (R, C) and per-row stats (R,)
        x2 = self._as2d(x, R, C)
        dy2 = self._as2d(dy, R, C)
        mean1 = self._as1d(mean, R)
        rstd1 = self._as1d(rstd, R)
        w1 = w

        def gx(g: ir.Value, *wv: ir.Value) -> ir.Value:
            v = S.cast(g, dy.dtype, D)
            return arith.mulf(v, S.cast(wv[0], w1.dtype, D)) if w1 else v

        wr = [w1] if w1 else []
        # cpu: eager's backward_sums in SUM_LANES lanes (Note [row reductions in lanes])
        s1 = self.reduce(
            (R, C), [1], D, 0.0, [dy2] + wr, gx, lambda p, q: arith.addf(p, q), lanes=SUM_LANES
        )
        s2 = self.reduce(
            (R, C),
            [1],
            D,
            0.0,
            [dy2, x2, self.kd(mean1, (R, C)), self.kd(rstd1, (R, C))] + wr,
            lambda g, xv, mm, rs, *wv: arith.mulf(
                arith.mulf(gx(g, *wv), arith.subf(S.cast(xv, dt, D), S.cast(mm, mean.dtype, D))),
                S.cast(rs, rstd.dtype, D),
            ),
            lambda p, q: arith.addf(p, q),
            lanes=SUM_LANES,
        )
        fC = S.const
        ex2 = [self._as2d(ex, R, C)] if ex else []

        def fdx(
            g: ir.Value,
            xv: ir.Value,
            mm: ir.Value,
            rs: ir.Value,
            a1: ir.Value,
            a2: ir.Value,
            *rest: ir.Value,
        ) -> ir.Value:
            wv = rest[:1] if w1 else ()
            e = rest[len(wv) :]
            rsd = S.cast(rs, rstd.dtype, D)
            xh = arith.mulf(arith.subf(S.cast(xv, dt, D), S.cast(mm, mean.dtype, D)), rsd)
            m1 = arith.divf(a1, fC(D, float(C)))
            m2 = arith.divf(a2, fC(D, float(C)))
            v = arith.mulf(rsd, arith.subf(arith.subf(gx(g, *wv), m1), arith.mulf(xh, m2)))
            if e:
                v = arith.addf(v, S.cast(e[0], ex.dtype, D))
            return S.cast(v, D, dxt)

        kd = lambda r: self.kd(r, (R, C))  # noqa: E731
        dx = self.ew((R, C), dxt, [dy2, x2, kd(mean1), kd(rstd1), kd(s1), kd(s2)] + wr + ex2, fdx)
        outs = [self._keep_as(dx, n, 0)]
        k = 1
        gdt = lambda j: self.g.values[n.outputs[j]].dtype  # noqa: E731
        if a.get("need_dweight", hw):
            # column sums over rows: iterate (C, R) with rows reduced

            def tw(g: ir.Value, xv: ir.Value, mm: ir.Value, rs: ir.Value) -> ir.Value:
                gd = S.cast(g, dy.dtype, D)
                xm = arith.subf(S.cast(xv, dt, D), S.cast(mm, mean.dtype, D))
                if self.cpu:  # eager's dy * xhat, xhat = (x - mean) * rstd
                    return arith.mulf(gd, arith.mulf(xm, S.cast(rs, rstd.dtype, D)))
                return arith.mulf(arith.mulf(gd, xm), S.cast(rs, rstd.dtype, D))

            dw = self._col_sum(
                R, C, [self._t(dy2), self._t(x2), self._rowb(mean1, C), self._rowb(rstd1, C)], tw
            )
            outs.append(self.cast_ref(dw, gdt(k)))
            k += 1
        if a.get("need_dbias", False):
            db = self._col_sum(R, C, [self._t(dy2)], lambda g: S.cast(g, dy.dtype, D))
            outs.append(self.cast_ref(db, gdt(k)))
            k += 1
        if a.get("need_dsum", False):
            dsr = self._col_sum(R, C, [self._t(dx)], lambda g: S.cast(g, dxt, D))
            outs.append(self.cast_ref(dsr, gdt(k)))
        return outs

    # Note [column blocks in the compiler]: eager's CPU layer-norm backward (cpu/norm_kernels.h,
    # Note [column blocks]) sums dweight / dbias / dsum per block of block_rows(R) rows (rows in
    # order, from 0), then adds the block partials in block order from 0; so do CPU kernels,
    # for its bits: a (C, blocks, rows) reduction for the full blocks, one for the ragged last
    # block, the partials folded in order. The GPU keeps one sum down all rows.
    def _col_sum(self, R: int, C: int, refs: Sequence[Ref], elem: Callable[..., ir.Value]) -> Ref:
        """sum over rows of elem(*refs) for refs of shape (C, R), in double: (C,)."""
        D = "float64"
        add = lambda p, q: arith.addf(p, q)  # noqa: E731
        br = max(LN_BLOCK_ROWS, -(-R // LN_MAX_BLOCKS))  # eager's block_rows(R)
        if not self.cpu or R <= br:
            return self.reduce((C, R), [1], D, 0.0, refs, elem, add)
        nf, rem = R // br, R % br
        n = len(refs)

        def rows(shape: tuple[int, ...], rows_of: IndexFn) -> Ref:
            """The sum over the last dim of `shape`, row rows_of(e) of refs. An unread byte per
            step of that loop: linalg takes a loop's bound from an operand whose map names it
            plainly, and d1 * br + d2 or d1 + o does not (as _reduce_lanes' anchor)."""
            vs = [r.view(shape, lambda e: [e[0], rows_of(e)]) for r in refs]
            k = len(shape) - 1
            anchor = Ref(
                "uint8",
                shape,
                self.empty((shape[k],), "uint8"),
                lambda e: [e[k]],
                None,
                None,
                False,
            )
            return self.reduce(shape, [k], D, 0.0, vs + [anchor], lambda *a: elem(*a[:n]), add)

        parts = rows((C, nf, br), lambda e: e[1] * br + e[2])
        tot = self.reduce((C, nf), [1], D, 0.0, [parts], lambda v: v, add)
        if rem:
            o = nf * br
            lp = rows((C, rem), lambda e: e[1] + o)
            tot = self.ew((C,), D, [tot, lp], add)
        return tot

    def _as2d(self, r: Ref, R: int, C: int) -> Ref:
        if r.shape == (R, C):
            return r
        src = r.shape
        return r.view((R, C), lambda e: _delinear(e[0] * C + e[1], src))

    def _as1d(self, r: Ref, R: int) -> Ref:
        if r.shape == (R,):
            return r
        src = r.shape
        return r.view((R,), lambda e: _delinear(e[0], src))

    def _t(self, r: Ref) -> Ref:
        (a, b) = r.shape
        return r.view((b, a), lambda e: [e[1], e[0]])

    def _rowb(self, r: Ref, C: int) -> Ref:
        (R,) = r.shape
        return r.view((C, R), lambda e: [e[1]])

    def op_cross_entropy(self, n: Node) -> list[Ref]:
        x, t = self.val(n.inputs[0]), self.val(n.inputs[1])
        a = n.attrs
        if len(x.shape) != 2:
            raise LoweringError("cross_entropy on logits that are not (N, C)")
        N, Cx = x.shape
        C = int(a.get("num_classes", Cx) if a.get("num_classes", -1) not in (None, -1) else Cx)
        ii = int(a.get("ignore_index", -100))
        ls = float(a.get("label_smoothing", 0.0))
        red = a.get("reduction", "mean")
        red = {0: "none", 1: "mean", 2: "sum"}.get(red, red)
        dt, D = x.dtype, "float64"
        A = S.compute_dtype(dt)
        xs = x.view((N, C), lambda e: e) if C != Cx else x
        m = self.reduce(
            (N, C),
            [1],
            A,
            -math.inf,
            [xs],
            lambda v: S.cast(v, dt, A),
            lambda p, q: S.maximum(p, q, A),
            lanes=MAX_LANES,
        )
        s = self.reduce(
            (N, C),
            [1],
            D,
            0.0,
            [xs, self.kd(m, (N, C))],
            lambda v, mm: S.cast(S.exp(arith.subf(S.cast(v, dt, A), mm), A), A, D),
            lambda p, q: arith.addf(p, q),
            lanes=LANES,
        )
        lse = self.ew((N,), D, [m, s], lambda mm, ss: arith.addf(S.cast(mm, A, D), _log64(ss)))
        refs = [lse, t]
        sx = None
        if ls != 0:
            sx = self.reduce(
                (N, C),
                [1],
                D,
                0.0,
                [xs],
                lambda v: S.cast(v, dt, D),
                lambda p, q: arith.addf(p, q),
                lanes=LANES,
            )
            refs.append(sx)
        xt = x.tensor if x.tensor is not None and x.identity else self.materialize(x)
        idx_t = ir.IndexType.get()

        def fl(idx: list, lse_v: ir.Value, tv: ir.Value, *q: ir.Value) -> ir.Value:
            tgt = S.cast(tv, t.dtype, "int64")
            ign = S.cmp("eq", tgt, S.const("int64", ii), "int64")
            safe = arith.select(ign, S.const("int64", 0), tgt)
            pv = tensor.extract(xt, [idx[0], arith.index_cast(idx_t, safe)])
            nll = arith.subf(lse_v, S.cast(pv, dt, D))
            if ls != 0:
                nll = arith.addf(
                    arith.mulf(S.const(D, 1.0 - ls), nll),
                    arith.mulf(
                        S.const(D, ls), arith.subf(lse_v, arith.divf(q[0], S.const(D, float(C))))
                    ),
                )
            return arith.select(ign, S.const(D, 0.0), nll)

        loss = self.ew((N,), D, refs, fl, with_index=True)
        lshape, ldt = self.out(n, 0)
        if red == "none":
            outl = self.cast_ref(loss, ldt)
        else:
            tot = self.reduce((N,), [0], D, 0.0, [loss], lambda v: v, lambda p, q: arith.addf(p, q))
            if red == "mean":
                cnt = self.reduce(
                    (N,),
                    [0],
                    "int64",
                    0,
                    [t],
                    lambda tv: S.cast(
                        S.cmp("ne", S.cast(tv, t.dtype, "int64"), S.const("int64", ii), "int64"),
                        "bool",
                        "int64",
                    ),
                    lambda p, q: arith.addi(p, q),
                )
                tot = self.ew((), D, [tot, cnt], lambda p, c: arith.divf(p, S.cast(c, "int64", D)))
            outl = self.cast_ref(tot, ldt)
        _, sdt = self.out(n, 1)
        return [self._keep_as(outl, n, 0), self.cast_ref(lse, sdt)]

    def op_cross_entropy_backward(self, n: Node) -> Ref:
        x, t, lse, g = (self.val(i) for i in n.inputs[:4])
        a = n.attrs
        N, Cx = x.shape
        nc = a.get("num_classes", -1)
        C = Cx if nc in (None, -1) else int(nc)
        ii = int(a.get("ignore_index", -100))
        ls = float(a.get("label_smoothing", 0.0))
        red = a.get("reduction", 1)
        red = {"none": 0, "mean": 1, "sum": 2}.get(red, red)
        dt, D = x.dtype, "float64"
        ez = S.compute_dtype(dt) if self.cpu else D  # the type exp's argument is rounded to
        off = ls / C
        refs = [x, t, lse]
        if red == 0:
            refs.append(g)
        else:
            refs.append(g.view((N,), lambda e: [_c(0)] * len(g.shape)))
        if red == 1:
            cnt = self.reduce(
                (N,),
                [0],
                "int64",
                0,
                [t],
                lambda tv: S.cast(
                    S.cmp("ne", S.cast(tv, t.dtype, "int64"), S.const("int64", ii), "int64"),
                    "bool",
                    "int64",
                ),
                lambda p, q: arith.addi(p, q),
            )
            refs.append(cnt.view((N,), lambda e: []))

        def f(
            idx: list, xv: ir.Value, tv: ir.Value, lv: ir.Value, gv: ir.Value, *c: ir.Value
        ) -> ir.Value:
            tgt = S.cast(tv, t.dtype, "int64")
            ign = S.cmp("eq", tgt, S.const("int64", ii), "int64")
            sc = S.cast(gv, g.dtype, D)
            if red == 1:
                sc = arith.divf(sc, S.cast(c[0], "int64", D))
            # x - lse in double, rounded once to the compute type on the CPU (ce_grad_row)
            z = arith.subf(S.cast(xv, dt, D), S.cast(lv, lse.dtype, D))
            d = arith.subf(self._exp_bwd(S.cast(z, D, ez), ez), S.const(D, off))
            col = arith.index_cast(ir.IntegerType.get_signless(64), idx[1])
            hit = S.cmp("eq", col, tgt, "int64")
            d = arith.select(hit, arith.subf(d, S.const(D, 1.0 - ls)), d)
            v = arith.mulf(d, sc)
            pad = S.cmp("ge", col, S.const("int64", C), "int64")
            v = arith.select(arith.ori(ign, pad), S.const(D, 0.0), v)
            return S.cast(v, D, dt)

        refs2 = [
            refs[0],
            self._rowb_n(refs[1], Cx),
            self._rowb_n(refs[2], Cx),
            self._rowb_n(refs[3], Cx),
        ] + [self._rowb_n(r, Cx) for r in refs[4:]]
        return self.ew((N, Cx), dt, refs2, f, with_index=True)

    def _rowb_n(self, r: Ref, C: int) -> Ref:
        (N,) = r.shape
        return r.view((N, C), lambda e: r_idx(e))


def r_idx(e: list[Expr]) -> list[Expr]:
    return [e[0]]


def _regroup(e: list[Expr], nz: list[int], src: Sequence[int]) -> list[Expr]:
    """Map an index over a shape that differs from src only by unit dims."""
    out, k = [], 0
    for s in src:
        if s == 1:
            out.append(_c(0))
        else:
            out.append(e[nz[k]])
            k += 1
    return out


def _sq(x: ir.Value) -> ir.Value:
    return arith.mulf(x, x)


def _sqrt64(x: ir.Value) -> ir.Value:
    from mlir.dialects import math as m

    return m.sqrt(x)


def _log64(x: ir.Value) -> ir.Value:
    from mlir.dialects import math as m

    return m.log(x)


def _exp64(x: ir.Value) -> ir.Value:
    from mlir.dialects import math as m

    return m.exp(x)


def _delin_vals(lin: ir.Value, shape: Sequence[int]) -> list[ir.Value]:
    """Index values of a linear index (for bodies that read their position)."""
    out = []
    for st, sz in zip(_strides(shape), shape):
        q = arith.divui(lin, arith.constant(ir.IndexType.get(), st)) if st != 1 else lin
        out.append(arith.remui(q, arith.constant(ir.IndexType.get(), sz)))
    return out


def _ld(v: ir.Value, dtype: str) -> ir.Value:
    return S.load_bool(v) if dtype == "bool" else v


def _index(i: int) -> ir.Value:
    return linalg.IndexOp(ir.IntegerAttr.get(ir.IntegerType.get_signless(64), i)).result
