"""GPU codegen for row groups: one kernel per fused norm / softmax / loss, a block per row.

After fusion and bufferization a row group's function is a short list of linalg ops over one
iteration space S = (rows..., C): row reductions (S -> rows), elementwise ops over S whose
results are function outputs, per-row ops (rows -> rows) and the fills that initialise the
reductions. Upstream's parallel-loop mapping would give each of them its own kernel with one
thread per row, serial over C, and the row statistics in global memory. Here the whole function
becomes one `gpu.launch`: a block per row, T threads (the compiler picks T from C: a power of
two from 32 to 256) striding over C so neighbouring threads read neighbouring elements, every
reduction finished by `gpu.all_reduce` (warp shuffles + shared memory after convert-gpu-to-nvvm),
and the row statistics kept in registers: they are never written to memory unless they are
outputs (a layer norm's mean and rstd). The linalg bodies are cloned as they are, so the
arithmetic is exactly the fused linalg's.

`apply(func)` rewrites a function in place and returns the block size it chose, or None (and
leaves the function alone) when the function is not a row group: column reductions (a norm's
weight gradient), reductions over several dims, intermediates of full size, ops it does not know.
"""

from __future__ import annotations

import math
from typing import Any

from mlir import ir
from mlir.dialects import affine, arith, gpu, memref, scf

REDUCE_KIND = {
    "arith.addf": "add",
    "arith.addi": "add",
    "arith.maximumf": "maximumf",
    "arith.minimumf": "minimumf",
    "arith.maxsi": "maxsi",
    "arith.minsi": "minsi",
    "arith.maxui": "maxui",
    "arith.minui": "minui",
    "arith.mulf": "mul",
}


VIEWS = ("memref.collapse_shape", "memref.expand_shape", "memref.cast", "memref.subview")


class NotARowGroup(Exception):
    pass


def _maps(op: Any) -> list[Any]:
    a = op.attributes["indexing_maps"]
    return [ir.AffineMapAttr(a[i]).value for i in range(len(a))]


def _iters(op: Any) -> list[str]:
    a = op.attributes["iterator_types"]
    return ["reduction" if "reduction" in str(a[i]) else "parallel" for i in range(len(a))]


def _dim_pos(e: Any) -> int:
    d = e.maybe_downcast() if hasattr(e, "maybe_downcast") else e
    return d.position if isinstance(d, ir.AffineDimExpr) else -1


def _is_dim(e: Any, i: int) -> bool:
    return _dim_pos(e) == i


def _shape(v: Any) -> list[int]:
    return list(ir.MemRefType(v.type).shape)


def _loop_ranges(op: Any, n: int) -> list[int]:
    ranges = [-1] * n
    operands = list(op.operands)
    for v, m in zip(operands, _maps(op)):
        sh = _shape(v)
        for k, e in enumerate(m.results):
            if _dim_pos(e) >= 0:
                ranges[_dim_pos(e)] = sh[k]
    if -1 in ranges:
        raise NotARowGroup("loop range not given by any operand")
    return ranges


def _kind(o: Any, S: tuple | None) -> tuple[str, tuple]:
    """('red' | 'ew' | 'row' | 'other', space) of a linalg.generic; a space is (rows shape,
    reduced shape): a block per row, its threads over the reduced (or last) elements."""
    it = _iters(o)
    n = len(it)
    rng = _loop_ranges(o, n)
    if "reduction" in it:
        k = it.index("reduction")
        if it[k:] != ["reduction"] * (n - k) or it[:k] != ["parallel"] * k:
            return "other", ((), ())
        # threads over the reduced elements: contiguous in memory for the first input, or the
        # row kernel's reads would be strided (column sums keep the thread-per-column loops)
        maps = _maps(o)
        if k > 0 and list(o.inputs):
            last = maps[0].results[-1] if maps[0].results else None
            if last is None or _dim_pos(last) != n - 1:
                return "other", ((), ())
        return "red", (tuple(rng[:k]), tuple(rng[k:]))
    if S is not None and n == len(S[0]) and tuple(rng) == S[0]:
        return "row", S
    if n == 0:
        return "row", ((), (1,))
    return "ew", (tuple(rng[:-1]), (rng[-1],))


def segments(f: Any) -> list[tuple[str, list[int], list[Any]]]:
    """The function's ops in consecutive segments: ('rows', S, ops) become one launch each,
    ('loops', [], ops) keep upstream's parallel-loop mapping (column reductions)."""
    segs: list[tuple[str, list[int], list[Any]]] = []
    pending: list[Any] = []  # fills wait for the op that consumes them
    cur: tuple[str, list[int], list[Any]] | None = None
    for o in f.regions[0].blocks[0].operations:
        nm = o.operation.name
        if nm in ("arith.constant", "func.return", "memref.alloc") or nm in VIEWS:
            continue
        if nm == "linalg.fill":
            pending.append(o)
            continue
        if nm == "memref.copy":  # an output that is an input (a .grad equal to its gradient)
            cur = ("copy", ((), ()), [o])
            segs.append(cur)
            cur = None
            continue
        if nm != "linalg.generic":
            raise NotARowGroup(f"op {nm}")
        S = cur[1] if cur is not None and cur[0] == "rows" else None
        kind, space = _kind(o, S)
        # a body that gathers (tensor.extract -> memref.load) from a value this segment writes
        # may read another block's elements: it starts a new launch (a grid-wide barrier)
        if cur is not None and cur[0] == "rows":
            gathered: set[Any] = set()
            _body_reads(o, gathered)
            written = {list(p.outputs)[0] for p in cur[2] if p.operation.name == "linalg.generic"}
            if _with_bases(gathered) & written:
                cur = None
        if kind == "other":
            if cur is None or cur[0] != "loops":
                cur = ("loops", ((), ()), [])
                segs.append(cur)
        elif cur is None or cur[0] != "rows" or cur[1] != space:
            if kind == "row" and space != ((), (1,)) and S is None:
                raise NotARowGroup("per-row op outside its rows")
            cur = ("rows", space, [])
            segs.append(cur)
        cur[2].extend(pending)
        pending = []
        cur[2].append(o)
    if pending:
        raise NotARowGroup("a fill nothing reads")
    return segs


def threads_for(C: int) -> int:
    return max(32, min(256, 1 << max(0, math.ceil(math.log2(max(C, 1))))))


def apply(f: Any) -> int | None:
    """Rewrites f's row segments into launches; returns the largest block size or None."""
    try:
        segs = segments(f)
    except NotARowGroup:
        return None
    if not segs:
        return None
    # temporaries first: a launch may store into one allocated further down
    blk = f.regions[0].blocks[0]
    hoist = ("memref.alloc", "arith.constant") + VIEWS
    ops_now = list(blk.operations)
    anchor = next((o for o in ops_now if o.operation.name not in hoist), None)
    if anchor is not None:
        for o in ops_now:
            if o.operation.name in hoist:
                o.operation.move_before(anchor.operation)
    # values a later segment reads (or the caller) must be written to memory
    reads_after: list[set[Any]] = []
    later: set[Any] = set()
    for _, _, ops in reversed(segs):
        reads_after.append(set(later))
        for o in ops:
            for v in o.operation.operands:
                later.add(v)
            _body_reads(o, later)
        later = _with_bases(later)
    reads_after.reverse()
    best = 0
    for (kind, S, ops), needed in zip(segs, reads_after):
        if kind == "rows":
            best = max(best, _emit(f, S, ops, needed))
        elif kind == "copy":
            best = max(best, _emit_copy(ops[0]))
        else:
            fills: list[Any] = []
            for o in ops:
                if o.operation.name == "linalg.fill":
                    fills.append(o)
                    continue
                best = max(best, _emit_columns(f, o, fills))
                fills = []
    for o in list(f.regions[0].blocks[0].operations):
        if o.operation.name == "memref.alloc" and not list(o.operation.results[0].uses):
            o.operation.erase()
    return best


COLUMN_THREADS = 256


def _emit_copy(o: Any) -> int:
    """memref.copy as a kernel: 256-thread blocks over the flat (contiguous) elements."""
    src, dst = o.operation.operands[0], o.operation.operands[1]
    shape = _shape(dst)
    n = max(1, math.prod(shape))
    T = COLUMN_THREADS
    with ir.InsertionPoint(o):
        launch = gpu.LaunchOp((max(1, (n + T - 1) // T), 1, 1), (T, 1, 1))
    body = launch.regions[0].blocks[0]
    with ir.InsertionPoint(body):
        bx, tx = body.arguments[0], body.arguments[3]
        lin = arith.addi(arith.muli(bx, _c(T)), tx)
        ifop = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lin, _c(n)))
        with ir.InsertionPoint(ifop.then_block):
            idx = _delin(lin, list(shape)) if shape else []
            memref.store(memref.load(src, idx), dst, idx)
            scf.YieldOp([])
        gpu.TerminatorOp()
    o.operation.erase()
    return T


def _emit_columns(f: Any, o: Any, fills: list[Any]) -> int:
    """A reduction whose reduced elements are strided in memory (column sums: a bias
    gradient): a thread per kept element, serial over the reduced ones, so neighbouring threads
    read neighbouring addresses (coalesced); 256-thread blocks."""
    it = _iters(o)
    if "reduction" not in it:
        raise RuntimeError("[compile] column kernel for a non-reduction")
    k = it.index("reduction")
    rng = _loop_ranges(o, len(it))
    kept, red = rng[:k], rng[k:]
    K, R = math.prod(kept), math.prod(red)
    T = COLUMN_THREADS
    maps = _maps(o)
    ins = list(o.inputs)
    (out,) = list(o.outputs)
    init_val = None
    for fl in fills:
        if fl.operation.operands[1] == out:
            init_val = fl.operation.operands[0]
    first = fills[0] if fills else o
    with ir.InsertionPoint(first):
        launch = gpu.LaunchOp((max(1, (K + T - 1) // T), 1, 1), (T, 1, 1))
    body = launch.regions[0].blocks[0]
    with ir.InsertionPoint(body):
        bx, tx = body.arguments[0], body.arguments[3]
        lin = arith.addi(arith.muli(bx, _c(T)), tx)
        ok = arith.cmpi(arith.CmpIPredicate.ult, lin, _c(K))
        ifop = scf.IfOp(ok)
        with ir.InsertionPoint(ifop.then_block):
            kidx = _delin(lin, kept)
            init = init_val
            if init is None:
                oi = [
                    affine.apply(ir.AffineMap.get(len(kept), 0, [e]), kidx)
                    for e in _out_exprs(maps[-1], len(kept))
                ]
                init = memref.load(out, oi)
            loop = scf.ForOp(_c(0), _c(R), _c(1), [init])
            with ir.InsertionPoint(loop.body):
                idx = kidx + _delin(loop.induction_variable, red)
                args = [
                    memref.load(
                        v,
                        [affine.apply(ir.AffineMap.get(m.n_dims, 0, [e]), idx) for e in m.results],
                    )
                    for v, m in zip(ins, maps[: len(ins)])
                ]
                (res,) = _clone_body(o, args + [loop.inner_iter_args[0]], idx)
                scf.YieldOp([res])
            oi = [
                affine.apply(ir.AffineMap.get(len(kept), 0, [e]), kidx)
                for e in _out_exprs(maps[-1], len(kept))
            ]
            memref.store(loop.results[0], out, oi)
            scf.YieldOp([])
        gpu.TerminatorOp()
    for fl in fills:
        fl.operation.erase()
    o.operation.erase()
    return T


def _out_exprs(m: Any, nkept: int) -> list[Any]:
    """The output map's results over the kept dims only (the map has all loop dims)."""
    return [e for e in m.results]


def _delin(lin: Any, shape: list[int]) -> list[Any]:
    out = []
    for k, s in enumerate(shape):
        st = math.prod(shape[k + 1 :])
        q = arith.divui(lin, _c(st)) if st != 1 else lin
        out.append(arith.remui(q, _c(s)) if k > 0 else q)
    return out


def _clone_body(o: Any, args: list[Any], idx: list[Any]) -> list[Any]:
    rb = o.regions[0].blocks[0]
    mapping = {a: v for a, v in zip(rb.arguments, args)}
    for inner in rb.operations:
        if inner.operation.name == "linalg.yield":
            return [mapping.get(x, x) for x in inner.operation.operands]
        if inner.operation.name == "linalg.index":
            d = ir.IntegerAttr(inner.operation.attributes["dim"]).value
            mapping[inner.operation.results[0]] = idx[d]
            continue
        c = inner.operation.clone(ip=ir.InsertionPoint.current)
        for i, x in enumerate(c.operands):
            if x in mapping:
                c.operands[i] = mapping[x]
        for r_old, r_new in zip(inner.operation.results, c.results):
            mapping[r_old] = r_new
    return []


def _bases(v: Any) -> list[Any]:
    """v and the memrefs it views, outermost last (Note [views of register values])."""
    out = [v]
    while True:
        owner = v.owner
        op = getattr(owner, "operation", owner)
        if getattr(op, "name", None) not in VIEWS:
            return out
        v = op.operands[0]
        out.append(v)


# Note [views of register values]: an elementwise value this launch writes stays in registers
# when no later op reads it. A later op may read it through a view, though: rotary's
# rotate-half reads its input's halves as subviews of the permuted copy (and a gather's body
# loads through one), so "read" means read through any view of it; else its store is dropped
# and the reader sees memory nothing wrote (session 46, H100: LLaMA's compiled step gave NaN).
def _with_bases(vals: Any) -> set[Any]:
    return {b for v in vals for b in _bases(v)}


def _body_reads(o: Any, acc: set[Any]) -> None:
    """Memrefs read inside a body (tensor.extract became memref.load)."""
    if o.operation.name != "linalg.generic":
        return
    for inner in o.regions[0].blocks[0].operations:
        if inner.operation.name == "memref.load":
            acc.add(inner.operation.operands[0])


def _c(v: int) -> Any:
    return arith.constant(ir.IndexType.get(), v)


def _emit(f: Any, S: tuple, ops: list[Any], needed: set[Any]) -> int:
    rows_shape, red_shape = list(S[0]), list(S[1])
    C = math.prod(red_shape)
    R = math.prod(rows_shape)
    T = (
        threads_for(C)
        if any(
            _iters(o) and "reduction" in _iters(o)
            for o in ops
            if o.operation.name == "linalg.generic"
        )
        or C > 1
        else 1
    )
    T = max(T, 1)
    fargs = set(f.arguments)
    keep = fargs | needed
    with ir.InsertionPoint(ops[0]):
        launch = gpu.LaunchOp((max(R, 1), 1, 1), (T, 1, 1))
    body = launch.regions[0].blocks[0]
    with ir.InsertionPoint(body):
        bx, tx = body.arguments[0], body.arguments[3]
        ridx = []
        rem = bx
        for k, s in enumerate(rows_shape):
            st = math.prod(rows_shape[k + 1 :])
            q = arith.divui(rem, _c(st)) if st != 1 else rem
            ridx.append(arith.remui(q, _c(s)) if k > 0 else q)
        is0 = arith.cmpi(arith.CmpIPredicate.eq, tx, _c(0))
        row_val: dict[Any, Any] = {}

        def cidx(c: Any) -> list[Any]:
            """Indices of the reduced (or last) dims of linear position c."""
            out = []
            for k, s in enumerate(red_shape):
                st = math.prod(red_shape[k + 1 :])
                q = arith.divui(c, _c(st)) if st != 1 else c
                out.append(arith.remui(q, _c(s)) if k > 0 else q)
            return out

        def load(v: Any, m: Any, idx: list[Any]) -> Any:
            if v in row_val:
                return row_val[v]
            ivals = [affine.apply(ir.AffineMap.get(m.n_dims, 0, [e]), idx) for e in m.results]
            return memref.load(v, ivals)

        def store_row(v: Any, val: Any) -> None:
            if v in keep:
                ifop = scf.IfOp(is0)
                with ir.InsertionPoint(ifop.then_block):
                    memref.store(val, v, ridx[: len(_shape(v))] if _shape(v) else [])
                    scf.YieldOp([])

        def clone_body(o: Any, args: list[Any], idx: list[Any]) -> list[Any]:
            rb = o.regions[0].blocks[0]
            mapping = {a: v for a, v in zip(rb.arguments, args)}
            out = None
            for inner in rb.operations:
                if inner.operation.name == "linalg.yield":
                    out = [mapping.get(x, x) for x in inner.operation.operands]
                    break
                if inner.operation.name == "linalg.index":
                    d = ir.IntegerAttr(inner.operation.attributes["dim"]).value
                    mapping[inner.operation.results[0]] = idx[d]
                    continue
                c = inner.operation.clone(ip=ir.InsertionPoint.current)
                for i, x in enumerate(c.operands):
                    if x in mapping:
                        c.operands[i] = mapping[x]
                for r_old, r_new in zip(inner.operation.results, c.results):
                    mapping[r_old] = r_new
            return out or []

        for j, o in enumerate(ops):
            if o.operation.name == "linalg.fill":
                val, dst = o.operation.operands[0], o.operation.operands[1]
                row_val[dst] = val
                continue
            it = _iters(o)
            maps = _maps(o)
            ins = list(o.inputs)
            (out,) = list(o.outputs)
            n_in = len(ins)
            if "reduction" in it:
                init = row_val.get(out)
                if init is None:
                    init = load(out, maps[-1], ridx)
                loop = scf.ForOp(tx, _c(C), _c(T), [init])
                with ir.InsertionPoint(loop.body):
                    idx = list(ridx) + cidx(loop.induction_variable)
                    args = [load(v, m, idx) for v, m in zip(ins, maps[:n_in])]
                    (res,) = clone_body(o, args + [loop.inner_iter_args[0]], idx)
                    scf.YieldOp([res])
                total = loop.results[0]
                if T > 1:
                    total = gpu.all_reduce(
                        total,
                        op=ir.Attribute.parse(f"#gpu<all_reduce_op {REDUCE_KIND[_combiner(o)]}>"),
                        uniform=True,
                    )
                row_val[out] = total
                store_row(out, total)
            elif len(it) == len(rows_shape) + len(red_shape) and S != ((), (1,)):
                # elementwise over the row, written out
                read_here = any(_reads(p, out) for p in ops[j + 1 :])
                if out not in keep and not read_here:
                    continue  # nothing reads it: dead (erased with the other linalg ops)
                loop = scf.ForOp(tx, _c(C), _c(T))
                with ir.InsertionPoint(loop.body):
                    idx = list(ridx) + cidx(loop.induction_variable)
                    args = [load(v, m, idx) for v, m in zip(ins, maps[:n_in])]
                    (res,) = clone_body(o, args + [_undef_like(out)], idx)
                    oi = [
                        affine.apply(ir.AffineMap.get(maps[-1].n_dims, 0, [e]), idx)
                        for e in maps[-1].results
                    ]
                    memref.store(res, out, oi)
                    scf.YieldOp([])
                if read_here:
                    gpu.barrier()  # later ops of this row read other threads' elements
            else:  # per-row (or a 0-d op)
                args = [load(v, m, ridx[: m.n_dims]) for v, m in zip(ins, maps[:n_in])]
                (res,) = clone_body(o, args + [_undef_like(out)], ridx)
                row_val[out] = res
                store_row(out, res)
        gpu.TerminatorOp()
    for o in ops:
        o.operation.erase()
    for o in list(f.regions[0].blocks[0].operations):
        if o.operation.name == "memref.alloc" and not list(o.operation.results[0].uses):
            o.operation.erase()
    return T


def _reads(o: Any, v: Any) -> bool:
    """Whether op o reads memref v: as an operand or in its body, directly or through a view."""
    s: set[Any] = set(o.operation.operands)
    _body_reads(o, s)
    return v in _with_bases(s)


def _combiner(o: Any) -> str:
    rb = o.regions[0].blocks[0]
    acc = rb.arguments[len(rb.arguments) - 1]
    ops = list(rb.operations)
    y = ops[-1]
    (v,) = list(y.operation.operands)
    d = v.owner
    if d.name not in REDUCE_KIND or acc not in list(d.operands):
        raise RuntimeError(f"[compile] row group: reduction combiner {d.name} not supported")
    return d.name


def _undef_like(out: Any) -> Any:
    """The out block argument of an elementwise body is never read: any value of its type."""
    et = ir.MemRefType(out.type).element_type
    try:
        return arith.constant(et, 0.0)
    except Exception:  # noqa: BLE001
        return arith.constant(et, 0)
